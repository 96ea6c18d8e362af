"""The serving engine's host side: `LLM` takes requests from any thread, publishes them into the request
queue, reads the token ring and streams each request's tokens to its handle. It talks to the device only
through the protocol (mdsl.serving.protocol): the same code serves the CPU device and, later, the GPU's.

    llm = LLM("path/to/checkpoint", max_batch=64)
    handle = llm.submit([1, 2, 3], SamplingParams(max_new_tokens=32))
    for token in handle:                 # as the device produces them
        ...
    outputs = llm.generate(["Hello", "Bonjour"], SamplingParams(temperature=0.8, top_p=0.9, seed=1))
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from typing import Optional, Sequence, Union

import attrs
import numpy as np

from mdsl.megakernel.modelgraph.checkpoint import load_model
from mdsl.megakernel.modelgraph.model_config import DEFAULT_MAX_SEQ, eos_token_ids, load_config
from mdsl.serving.cpu import CpuDevice, Doorbell, kv_bytes_per_token, serving_nodes
from mdsl.serving.params import SamplingParams, ServingError
from mdsl.serving.protocol import (DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_MAX_TOKENS_PER_STEP, FAILED, FINISHED, HAS_TOKEN,
                                   MAX_STOP, REASONS, STATUSES, STOPPED, WAS_PREEMPTED, ServingShape, host_region)
from mdsl.serving.tokenizer import Tokenizer

PUMP_WAIT_S = 0.05      # the longest the host thread sleeps between looks at the ring

#: the ring record's fields the host thread reads (_read_ring), in its order
RING_FIELDS = ("seq", "request_id", "token", "position", "flags", "reason")

_log = logging.getLogger(__name__)


@attrs.frozen
class RequestOutput:
    """A finished request: its tokens (the stop token last when it stopped on one), their text when the
    checkpoint has a tokenizer, why it finished ("stop", "length" or "cancelled"), how many times the
    device preempted it (its streamed tokens never repeat), and how many of its prompt's tokens it read
    from the prefix cache when it was admitted."""

    request_id: int
    prompt_token_ids: tuple
    token_ids: tuple
    finish_reason: str
    text: Optional[str] = None
    preemptions: int = 0
    cached_tokens: int = 0


@attrs.frozen
class ServingStats:
    """The device's control words (its status, steps run, preemptions, running requests in the last step
    and at the peak, free pages, token rows run in all steps and in the last), the requests published in
    the queue that the device has not taken yet, the requests the host holds back until the queue has
    room, and the known tokens whose keys and values requests found in the prefix cache instead of
    computing them. free_pages counts the pages a request can take: free, or cached and held by none."""

    status: str

    steps: int
    preemptions: int
    running: int
    peak_running: int
    free_pages: int
    num_pages: int
    host_pending: int
    queued: int
    tokens: int
    step_tokens: int
    cached_tokens: int = 0


class RequestHandle:
    """One submitted request. Iterating it yields its tokens as they are produced (any number of
    iterators, in any threads, each from the first token); `result()` waits for the end."""

    def __init__(self, engine: "LLM", request_id: int, prompt: tuple, params: SamplingParams):
        self._engine = engine
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.params = params
        self._cond = threading.Condition()
        self._tokens: list = []
        self._reason: Optional[str] = None
        self._error: Optional[BaseException] = None
        self._preemptions = 0
        self._cached = 0                       # its prompt's tokens read from the prefix cache (known once done)
        self._handle: Optional[int] = None     # its prompt row / cancel flag once published
        self._listeners: list = []

    def __repr__(self) -> str:
        return f"<RequestHandle {self.request_id}: {len(self._tokens)} tokens, {self._reason or 'running'}>"

    def __iter__(self):
        i = 0
        while True:
            with self._cond:
                while i >= len(self._tokens) and self._reason is None and self._error is None:
                    self._cond.wait()
                if self._error is not None:
                    raise self._failure()
                if i >= len(self._tokens):
                    return
                token = self._tokens[i]
            i += 1
            yield token

    def done(self) -> bool:
        return self._reason is not None or self._error is not None

    @property
    def cached_tokens(self) -> int:
        """Its prompt's tokens read from the prefix cache instead of computed (known once it ends; 0 before)."""
        return self._cached

    def poll(self, start: int = 0) -> tuple:
        """Without waiting: (the tokens from index `start` produced so far, the finish reason or None while
        it runs). Raises the request's failure."""
        with self._cond:
            if self._error is not None:
                raise self._failure()
            return tuple(self._tokens[start:]), self._reason

    def subscribe(self, callback) -> None:
        """Call `callback()` whenever tokens arrive or the request ends, in the engine's host thread (or in
        the thread that cancels a request still held on the host): it must return at once and not call
        the engine (`poll` is fine). For event loops: subscribe, then `poll` until the reason is set,
        waiting for a callback between polls."""
        with self._cond:
            self._listeners.append(callback)

    def cancel(self) -> None:
        """Stop the request: it finishes with reason "cancelled" and the tokens streamed so far."""
        self._engine._cancel(self)

    def result(self, timeout: Optional[float] = None) -> RequestOutput:
        with self._cond:
            if not self._cond.wait_for(self.done, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            if self._error is not None:
                raise self._failure()
            tokens, reason = tuple(self._tokens), self._reason
        return RequestOutput(self.request_id, self.prompt_token_ids, tokens, reason,
                             self._engine.tokenizer.decode(tokens), self._preemptions, self._cached)

    def _failure(self) -> ServingError:
        return ServingError(f"request {self.request_id} failed: {self._error}",
                            hint="the serving device stopped; its error is the cause of this one")

    # ---- the engine's side

    def _push(self, token: int, position: int) -> None:
        with self._cond:
            expected = len(self.prompt_token_ids) + len(self._tokens)
            if position != expected:
                raise ServingError(f"request {self.request_id}: the device sent the token of position {position}, "
                                   f"expected {expected}")
            self._tokens.append(token)
            self._cond.notify_all()
        self._tell_listeners()

    def _finish(self, reason: str) -> None:
        with self._cond:
            self._reason = reason
            self._cond.notify_all()
        self._tell_listeners()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._reason is None:
                self._error = error
            self._cond.notify_all()
        self._tell_listeners()

    def _tell_listeners(self) -> None:
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:    # a listener's bug must not stop the host thread that serves every request
                _log.exception("a listener of request %d failed", self.request_id)


DEVICES = ("cpu", "gpu", "megakernel")


def _device_class(device: str):
    """The class of the device named `device` (imported when asked for: the GPU's import the driver bindings)."""
    if device == "gpu":
        from mdsl.serving.gpu import GpuDevice

        return GpuDevice
    if device == "megakernel":
        from mdsl.serving.megakernel import MegakernelDevice

        return MegakernelDevice
    return CpuDevice


def _positive(name: str, value, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ServingError(f"{name} must be a positive integer, got {value!r}", hint=hint)
    return value


class LLM:
    """A serving engine over a Llama-3, Qwen3, Qwen2, Mistral, Phi-3 or Gemma-2 checkpoint folder (config.json,
    *.safetensors, and optionally generation_config.json for the EOS tokens and tokenizer.json for text
    prompts).

    max_batch: requests in flight on the device at once (running, or preempted and waiting to recompute).
    page_size: tokens per KV-cache page. max_seq: positions per request (prompt plus new tokens; default
    the config's, at most 4096). The page pool holds kv_pages pages, or as many as kv_cache_bytes hold
    (the keys and values in the checkpoint's dtype, as transformers' cache holds them: a bf16 checkpoint's
    are rounded to bf16), by default enough for every batch slot at max_seq (nothing is ever preempted);
    on the GPU, gpu_memory_fraction gives it that share of the GPU's memory less what is in use, the
    weights and the activations. device: "cpu" (numpy), "gpu" (the step's forward and the KV pool on the GPU,
    mdsl.serving.gpu) or "megakernel" (the scheduler and every step in one resident kernel on the GPU,
    mdsl.serving.megakernel). `tokenizer` encodes and decodes text (mdsl.serving.tokenizer).

    max_tokens_per_step: the tokens one step runs: the decode token of every running request first (the
    oldest first when they are more than the budget), then chunks of prompts, oldest first, each as long
    as the budget leaves, so that a long prompt spans several steps beside the decode tokens instead of
    stalling them. The default, 256, is the power of two just past the row count at which a step's linear
    layers stop being bound by reading the weights and become bound by the tensor cores on a Hopper GPU: a
    step does 2 FLOP per token on each 2-byte bf16 weight, i.e. as many FLOP per weight byte as it has
    tokens, and an H200's bf16 FLOP/s over its HBM bytes/s is about 200. Fewer tokens leave the tensor
    cores idle while a prompt is read; more lengthen every step that decode requests share with a prompt
    chunk. It also exceeds the default max_batch, so every decode token runs at every step.

    max_prefill_tokens: the tokens of a step in which no request decodes (prompt chunks alone: no decode
    token waits on it), at least max_tokens_per_step. On the GPU device the default, 1024, lets such a step's
    linears run as GEMMs of 1024 rows, near the tensor cores' rate, where 256-row chunks re-read every weight
    four times as often and leave the GPU's last wave of tiles half full; the activation buffers grow with it
    (a few of rows x width floats for each width of the layers' values, shared by the layers). Elsewhere it
    defaults to max_tokens_per_step: the CPU device gains nothing from longer chunks, and the megakernel's
    scheduler on the GPU has one budget.

    prefix_caching (the cpu and gpu devices; on by default there): a request whose known tokens start with
    the tokens of full KV-cache pages that an earlier request computed reads them instead of computing them
    again (mdsl.serving.prefix_cache): a shared system prompt, few-shot examples or an earlier turn of a
    conversation costs its prompt steps once. Pages no request holds stay cached until a request needs them.
    A request's tokens and logits are the same bits with or without it (a position's keys and values do not
    depend on the step that computed them). The megakernel's scheduler runs on the GPU without it."""

    def __init__(self, model_dir: str, *, max_batch: int = 64, page_size: int = 16, max_seq: Optional[int] = None,
                 kv_pages: Optional[int] = None, kv_cache_bytes: Optional[int] = None, device: str = "cpu",
                 max_tokens_per_step: int = DEFAULT_MAX_TOKENS_PER_STEP, max_prefill_tokens: Optional[int] = None,
                 gpu_memory_fraction: Optional[float] = None, prefix_caching: Optional[bool] = None):
        if device not in DEVICES:
            raise ServingError(f"device must be one of {', '.join(map(repr, DEVICES))}, got {device!r}")
        _positive("max_batch", max_batch, "the number of requests decoded together, e.g. 64")
        _positive("page_size", page_size, "tokens per KV-cache page, e.g. 16")
        _positive("max_tokens_per_step", max_tokens_per_step,
                  f"the tokens a step runs (decode tokens plus prompt chunks), e.g. {DEFAULT_MAX_TOKENS_PER_STEP}")
        device_class = _device_class(device)
        if max_prefill_tokens is None:
            max_prefill_tokens = max(max_tokens_per_step, DEFAULT_MAX_PREFILL_TOKENS) if device == "gpu" else \
                max_tokens_per_step
        _positive("max_prefill_tokens", max_prefill_tokens,
                  f"the tokens of a step of prompt chunks alone, e.g. {DEFAULT_MAX_PREFILL_TOKENS}")
        if max_prefill_tokens < max_tokens_per_step:
            raise ServingError(f"max_prefill_tokens ({max_prefill_tokens}) is below max_tokens_per_step "
                               f"({max_tokens_per_step}): a step of prompts alone runs at least as many tokens as "
                               "one with decode tokens", hint=f"pass max_prefill_tokens >= {max_tokens_per_step}")
        if device == "megakernel" and max_prefill_tokens != max_tokens_per_step:
            raise ServingError("the megakernel device's scheduler (on the GPU) has one token budget a step: "
                               "max_tokens_per_step", hint="leave max_prefill_tokens out on device='megakernel'")
        if prefix_caching is None:
            prefix_caching = device_class.PREFIX_CACHE
        elif not isinstance(prefix_caching, bool):
            raise ServingError(f"prefix_caching must be True, False or None, got {prefix_caching!r}")
        elif prefix_caching and not device_class.PREFIX_CACHE:
            raise ServingError(f"the {device} device has no prefix cache (its scheduler keeps none)",
                               hint="serve with device='gpu' or 'cpu' for the prefix cache, or pass "
                                    "prefix_caching=False")
        config = load_config(model_dir)
        if max_seq is None:
            max_seq = min(config.max_positions, DEFAULT_MAX_SEQ)
        _positive("max_seq", max_seq, "positions per request: prompt plus new tokens")
        if max_seq > config.max_positions:
            raise ServingError(f"max_seq {max_seq} exceeds the model's {config.max_positions} positions",
                               hint="max_position_embeddings in config.json is the most a request can use")
        loaded = load_model(model_dir, max_positions=max_seq)
        if gpu_memory_fraction is not None:
            if device != "gpu":
                raise ServingError("gpu_memory_fraction sizes the GPU device's KV cache; this engine runs on the "
                                   f"{device} device", hint="pass device='gpu', or size the cache with kv_cache_bytes")
            if not 0 < gpu_memory_fraction <= 1 or kv_pages is not None or kv_cache_bytes is not None:
                raise ServingError(f"gpu_memory_fraction must be in (0, 1] and given alone, got {gpu_memory_fraction}"
                                   f" (kv_pages {kv_pages}, kv_cache_bytes {kv_cache_bytes})",
                                   hint="e.g. gpu_memory_fraction=0.9 for nine tenths of the GPU's memory")
            from mdsl.serving.gpu import kv_cache_budget

            kv_cache_bytes = kv_cache_budget(loaded.graph, gpu_memory_fraction, max_prefill_tokens)
            if kv_cache_bytes <= 0:
                raise ServingError(f"gpu_memory_fraction {gpu_memory_fraction} leaves no memory for the KV cache "
                                   "after what is in use, the weights and the activations",
                                   hint="raise it, or free GPU memory")
        self.config, self.model_dir = loaded.config, model_dir
        self.eos_token_ids = tuple(eos_token_ids(model_dir))
        num_pages = self._pool_pages(loaded.graph, max_batch, page_size, max_seq, kv_pages, kv_cache_bytes)
        self.shape = ServingShape(max_batch, page_size, num_pages, max_seq, max_tokens_per_step, max_prefill_tokens)
        region = host_region(self.shape)
        self._host = region.views(device_class.host_memory(region))
        self.tokenizer = Tokenizer(model_dir)
        self._lock = threading.Lock()
        self._pending: deque = deque()         # submitted, not yet in the queue
        self._handles: dict = {}               # request id -> handle, until its last record is read
        self._free_handles = list(range(self.shape.handles))[::-1]
        self._published = 0                    # requests written into the queue
        self._ring_read = 0
        # the ring's columns and the ring_read word, viewed once (_read_ring)
        self._ring_fields = {name: self._host["ring"][name] for name in RING_FIELDS}
        self._ring_read_word = self._host["control"]["ring_read"]
        self._next_id = 0
        self._closed = False
        self._pump_bell = Doorbell()
        if device == "megakernel":
            self.device = device_class(loaded.config, loaded.graph, loaded.weights, self.shape, self._host,
                                       self._pump_bell.ring)
        else:
            self.device = device_class(loaded.graph, loaded.weights, self.shape, self._host, self._pump_bell.ring,
                                       prefix_caching=prefix_caching)
        self._pump = threading.Thread(target=self._serve, name="mdsl-serving-host", daemon=True)
        self.device.start()
        self._pump.start()

    @staticmethod
    def _pool_pages(graph, max_batch: int, page_size: int, max_seq: int, kv_pages, kv_cache_bytes) -> int:
        if kv_pages is not None and kv_cache_bytes is not None:
            raise ServingError("give kv_pages or kv_cache_bytes, not both")
        if kv_pages is not None:
            return _positive("kv_pages", kv_pages, "the page pool's size in pages")
        if kv_cache_bytes is not None:
            _positive("kv_cache_bytes", kv_cache_bytes, "the page pool's memory budget in bytes")
            page_bytes = kv_bytes_per_token(graph) * page_size
            if kv_cache_bytes < page_bytes:
                raise ServingError(f"kv_cache_bytes {kv_cache_bytes} holds no page of {page_bytes} bytes",
                                   hint="give at least one page's bytes (every layer's keys and values for "
                                        "page_size positions)")
            return kv_cache_bytes // page_bytes
        serving_nodes(graph)   # a graph the device cannot serve fails here, before any allocation
        return max_batch * -(-max_seq // page_size)

    # ---- the API

    def submit(self, prompt: Union[str, Sequence[int]], params: Optional[SamplingParams] = None) -> RequestHandle:
        """Queue one request; its handle streams the tokens. Thread-safe."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ServingError(f"params must be a SamplingParams, got {type(params).__name__}")
        tokens = self._prompt_tokens(prompt)
        self._check_request(tokens, params)
        with self._lock:
            if self._closed:
                raise ServingError("the engine is closed", hint="submit before close(), or make a new LLM")
            handle = RequestHandle(self, self._next_id, tokens, params)
            self._next_id += 1
            self._handles[handle.request_id] = handle
            self._pending.append(handle)
        self._pump_bell.ring()
        return handle

    def generate(self, prompts: Sequence[Union[str, Sequence[int]]],
                 params: Union[None, SamplingParams, Sequence[SamplingParams]] = None) -> list:
        """Every prompt served together; their outputs in the prompts' order. `params`: one for all, or one
        per prompt."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise ServingError("generate takes a list of prompts", hint="use submit() for one prompt")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise ServingError(f"{len(params)} SamplingParams for {len(prompts)} prompts",
                               hint="give one SamplingParams for all prompts, or one per prompt")
        handles = [self.submit(p, s) for p, s in zip(prompts, params)]
        return [h.result() for h in handles]

    def stats(self) -> ServingStats:
        c = self._host["control"][0]
        with self._lock:
            pending, queued = len(self._pending), self._published - int(c["queue_taken"])
        prefix = self.device.prefix
        return ServingStats(STATUSES[int(c["status"])], int(c["steps"]), int(c["preemptions"]), int(c["running"]),
                            int(c["peak_running"]), int(c["free_pages"]), self.shape.num_pages, pending, queued,
                            int(c["tokens"]), int(c["step_tokens"]), prefix.hits if prefix is not None else 0)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what is unfinished, stop the device and the host thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            unfinished = list(self._handles.values())
        self.device.resume()                   # a device held for debugging runs again
        for handle in unfinished:
            self._cancel(handle)
        deadline = time.monotonic() + timeout
        for handle in unfinished:
            with handle._cond:
                handle._cond.wait_for(lambda: handle.done() or not self.device.alive,
                                      max(0.0, deadline - time.monotonic()))
        self._host["control"]["shutdown"] = 1
        self.device.wake()
        self.device.join(timeout)
        if self.device.alive:
            self.device.stop(timeout)
        self._pump_bell.ring()
        self._pump.join(timeout)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests

    def _prompt_tokens(self, prompt) -> tuple:
        if isinstance(prompt, str):
            tokens = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (Sequence, np.ndarray)) and not isinstance(prompt, bytes):
            tokens = tuple(prompt)
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in tokens):
                raise ServingError("a prompt of token ids must hold integers only",
                                   hint="pass a list of token ids or a string")
            tokens = tuple(int(t) for t in tokens)
        else:
            raise ServingError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not tokens:
            raise ServingError("the prompt is empty", hint="give at least one token")
        vocab = self.config.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ServingError(f"prompt token {bad[0]} is outside the vocabulary [0, {vocab})")
        return tokens

    def _check_request(self, tokens: tuple, params: SamplingParams) -> None:
        need = len(tokens) + params.max_new_tokens
        if need > self.shape.max_seq:
            raise ServingError(f"{len(tokens)} prompt tokens and max_new_tokens {params.max_new_tokens} need {need} "
                               f"positions; the engine has {self.shape.max_seq}",
                               hint="shorten the prompt, lower max_new_tokens or raise the LLM's max_seq")
        pool_tokens = self.shape.num_pages * self.shape.page_size
        if need - 1 > pool_tokens:
            raise ServingError(f"the request caches {need - 1} positions; the page pool holds {pool_tokens}",
                               hint="give the LLM more kv_pages or kv_cache_bytes")
        bad = [t for t in params.stop_token_ids if t >= self.config.vocab_size]
        if bad:
            raise ServingError(f"stop token {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        if len(self._stop_ids(params)) > MAX_STOP:
            raise ServingError(f"{len(self._stop_ids(params))} stop tokens with the checkpoint's EOS; at most "
                               f"{MAX_STOP}", hint="give fewer stop_token_ids, or ignore_eos=True")

    def _stop_ids(self, params: SamplingParams) -> tuple:
        return tuple(dict.fromkeys(params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)))

    def _cancel(self, handle: RequestHandle) -> None:
        with self._lock:
            if handle.done():
                return
            if handle._handle is None:          # still on the host: finished here
                self._pending.remove(handle)
                del self._handles[handle.request_id]
                handle._finish("cancelled")
                return
            self._host["cancel"][handle._handle] = 1
            control = self._host["control"]      # (after the flag: a device that sees the count sees the flag)
            control["cancels"] = (int(control["cancels"][0]) + 1) & 0xFFFFFFFF
        self.device.wake()

    # ---- the host thread: the ring in, the queue out

    def _serve(self) -> None:
        control = self._host["control"]
        while True:
            self._pump_bell.wait(PUMP_WAIT_S)
            try:
                with self._lock:
                    self._read_ring()
                    self._publish()
            except ServingError as e:         # the device broke the protocol
                self._fail_all(e)
                return
            status = int(control["status"][0])
            if status == FAILED:
                self._fail_all(self.device.error)
                return
            if status == STOPPED or (self._closed and not self.device.alive):
                with self._lock:
                    self._read_ring()
                self._fail_all(ServingError("the serving device stopped"))
                return

    def _read_ring(self) -> None:
        """Hand the device's new records to their requests, in record order, until no slot holds the next one:
        record n is in slot n mod R once the slot's seq (written last) reads n + 1, and its fields are read after
        that; ring_read moves past each record as it is read (the device may reuse its slot). Each field and the
        word through a view taken once (a structured record's field costs about a microsecond a look, and a
        decode step of 64 requests writes 64 records)."""
        f = self._ring_fields
        seq, request_id, token, position, flags, reason = (f[name] for name in RING_FIELDS)
        read = self._ring_read_word
        size = len(seq)
        start = self._ring_read
        while True:
            slot = self._ring_read % size
            if int(seq[slot]) != self._ring_read + 1:
                break
            rid, kind = int(request_id[slot]), int(flags[slot])
            self._ring_read += 1
            read[0] = self._ring_read
            handle = self._handles.get(rid)
            if handle is None:
                raise ServingError(f"the device sent a record of request {rid}, which is not in flight")
            if kind & WAS_PREEMPTED:
                handle._preemptions += 1
            if kind & HAS_TOKEN:
                handle._push(int(token[slot]), int(position[slot]))
            if kind & FINISHED:
                del self._handles[rid]
                self._free_handles.append(handle._handle)
                handle._cached = self.device.take_cached_tokens(rid)
                handle._finish(REASONS[int(reason[slot])])
        if self._ring_read != start:
            self.device.wake()                  # it may be waiting for room in the ring

    def _publish(self) -> None:
        queue, control = self._host["queue"], self._host["control"]
        start = self._published
        while (self._pending and self._free_handles
               and self._published - int(control["queue_taken"][0]) < len(queue)):
            handle = self._pending.popleft()
            h = self._free_handles.pop()
            handle._handle = h
            tokens, params = handle.prompt_token_ids, handle.params
            stops = self._stop_ids(params)
            self._host["cancel"][h] = 0
            self._host["prompts"][h, :len(tokens)] = tokens
            slot = queue[self._published % len(queue)]
            req = slot["request"]
            req["request_id"], req["handle"], req["prompt_len"] = handle.request_id, h, len(tokens)
            req["seed"] = secrets.randbits(64) if params.seed is None else params.seed
            req["max_new_tokens"], req["temperature"] = params.max_new_tokens, params.temperature
            req["top_k"], req["top_p"] = params.top_k, params.top_p
            req["num_stop"] = len(stops)
            req["stop_ids"][:] = -1
            req["stop_ids"][:len(stops)] = stops
            slot["seq"] = self._published + 1   # last: the device reads the slot once it sees this
            self._published += 1
        if self._published != start:
            self.device.wake()

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
            self._pending.clear()
        for handle in handles:
            handle._fail(error)

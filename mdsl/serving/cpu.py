"""The CPU device: the device side of the serving protocol in numpy, one step at a time in a thread.

It does what the megakernel's in-kernel scheduler is specified to do (docs/design.md, "Serving"):
cancel, plan the step's tokens within its budget (every decode token, then chunks of prompts), give them
pages (preempting the youngest request when the pool is empty), admit, run the step, sample, stream,
retire. The step's tokens run as one forward over their rows (mdsl.serving.steprules): each linear a
product over all the rows, each chunk's KV append at once, attention over each request's pages with the
causal mask; the KV pools hold the checkpoint's dtype's values (`kv_dtype`), and a 16-bit checkpoint's
linears read their inputs rounded to it, as the GPU's tensor cores do. Every row gets the bits its position
gets alone in `ReferenceModel` with that kv_dtype and operand_dtype, whatever else is in the step and however
its prompt is chunked."""
from __future__ import annotations

import math
import threading
from typing import Callable, Optional

import numpy as np

from mdsl.errors import UnsupportedError
from mdsl.ir.dtypes import DType, f32
from mdsl.megakernel.modelgraph.model import TOKENS, ModelGraph
from mdsl.serving.protocol import (FAILED, FINISHED, FREE, HAS_TOKEN, MAX_STOP, PREEMPTED, REASON_CANCELLED,
                                   REASON_LENGTH, REASON_NONE, REASON_STOP, RUNNING, SERVING, STOPPED,
                                   WAS_PREEMPTED, ServingShape, device_region, kv_pool_shape)
from mdsl.serving.prefix_cache import PrefixCache
from mdsl.serving.sampling import sample
from mdsl.serving.scheduler import broken_request, damaged_pool
from mdsl.serving.steprules import STEP_RULES, StepBatch

IDLE_WAIT_S = 0.05     # the longest an idle device sleeps between looks at the queue and the control words


class Doorbell:
    """A wake-up between threads: `wait` returns when rung (or at the timeout); what the ringer wrote
    before ringing is visible to the waiter, who then looks at the shared memory itself."""

    def __init__(self):
        self._event = threading.Event()

    def ring(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)
        self._event.clear()


class _Stop(Exception):
    """The host stopped the device while it waited for room in the ring."""


def narrowing(nodes: list, caches: list) -> int:
    """The index of the first node past the last that writes a KV cache: from there on only the rows whose
    logits are wanted are computed."""
    names = {s.name for s in caches}
    return 1 + max((i for i, n in enumerate(nodes) if any(v.name in names for v in n.inputs)), default=-1)


def serving_nodes(graph: ModelGraph) -> tuple:
    """(the nodes that compute the logits, the KV-cache states): every node but the one choosing the
    token; the caches are the states other than the token history."""
    chooser = [n for n in graph.nodes if graph.token in n.outputs]
    nodes = tuple(n for n in graph.nodes if n not in chooser)
    if not any(graph.logits in n.outputs for n in nodes):
        raise UnsupportedError(f"model {graph.name} computes its logits in the node that chooses the token",
                               hint="serve the unfused model graph (its step function's trace)")
    caches = tuple(s for s in graph.states if s.name != TOKENS)
    names = {s.name for s in caches}
    for n in nodes:
        STEP_RULES.lookup(n.op)
        for i in n.opdef.state_inputs:
            if n.inputs[i].name not in names:
                raise UnsupportedError(f"layer op {n.op} updates {n.inputs[i].name}, which serving does not page",
                                       hint="the serving engine pages KV caches [positions, ...] written at the "
                                            "step's position only")
    return nodes, caches


def kv_dtype(graph: ModelGraph) -> DType:
    """The dtype whose values a served model's KV pools hold: the checkpoint's (its weights'), as
    transformers keeps its cache in the model's dtype; float32 where the weights' dtypes differ."""
    dtypes = {w.dtype for w in graph.weights}
    return dtypes.pop() if len(dtypes) == 1 else f32


def kv_bytes_per_token(graph: ModelGraph) -> int:
    """The KV pools' bytes per cached position: every cache's row in kv_dtype, as the GPU device holds
    them (the CPU device holds the same values in float32 arrays). A byte budget gives either device the
    same pages."""
    return sum(kv_dtype(graph).itemsize * math.prod(s.shape[1:]) for s in serving_nodes(graph)[1])


class CpuDevice:
    """Serves requests from the host views (protocol.host_region) with the model graph and weights."""

    PREFIX_CACHE = True   # its scheduler, on the host, can keep a prefix cache (mdsl.serving.prefix_cache)

    @staticmethod
    def host_memory(region) -> np.ndarray:
        """The host region's memory (this device's thread shares the engine's address space)."""
        return region.allocate()

    def __init__(self, graph: ModelGraph, weights: dict, shape: ServingShape, host: dict,
                 notify_host: Callable[[], None], prefix_caching: bool = False):
        self.graph, self.shape, self.host = graph, shape, host
        self.nodes, caches = serving_nodes(graph)
        # the checkpoint's dtype: the pools' values, and a linear's input as its product reads it
        self.kv_dtype = self.operand_dtype = kv_dtype(graph)
        region = device_region(shape)
        self.state = region.views(region.allocate())
        self._narrow_at = narrowing(self.nodes, caches)
        self._prepare(weights, caches)
        pool = self.state["pool"]
        pool["num_pages"], pool["page_size"], pool["free_count"] = shape.num_pages, shape.page_size, shape.num_pages
        self.state["free_pages"][:] = np.arange(shape.num_pages, dtype=np.int32)[::-1]   # page 0 on top
        self.state["page_table"][:] = -1
        host["control"]["free_pages"] = shape.num_pages
        # full pages kept for later requests that start with the same tokens (mdsl.serving.prefix_cache), and
        # each admitted entry's page keys computed so far
        self.prefix = PrefixCache(shape.num_pages, shape.page_size) if prefix_caching else None
        self._keys: dict = {}
        self._queued_keys: tuple = (-1, [])    # (queue position, page keys) of the request at the queue's head
        self._cached_of: dict = {}        # request id -> its prompt's tokens found cached at admission
        self._written = 0                 # ring records written
        self._cancels_seen = 0            # the host's count of cancel flags at the last scan (_cancel)
        self._requests: dict = {}         # entry -> (arrival, request id, stop ids, max_new_tokens)
        # ... the same per entry as arrays, for a decode step's entries at once (_request_arrays): the arrival
        # they were read at, request id, max_new_tokens, stop ids (-1 past num_stop)
        self._request_table = (np.full(shape.max_batch, -1, np.int64), np.zeros(shape.max_batch, np.uint64),
                               np.zeros(shape.max_batch, np.int64), np.full((shape.max_batch, MAX_STOP), -1, np.int64))
        self._decoding: Optional[np.ndarray] = None   # the entries of a decode step begun by _begin_decode
        # field views taken once for the decode steps over arrays (a structured array's field costs about a
        # microsecond a look, a fixed cost of every step)
        entries = self.state["entries"]
        self._entry_fields = {name: entries[name] for name in ("state", "context", "generated", "num_pages", "arrival")}
        self._entry_fields["prompt_len"] = entries["request"]["prompt_len"]
        self._step_fields = {name: self.state["chunks"][name] for name in ("entry", "start", "count", "row", "sample",
                                                                            "pad")}
        self._row_fields = {name: self.state["rows"][name] for name in ("token", "position", "chunk")}
        self._queue_seq = host["queue"]["seq"]
        self._order = np.arange(shape.max_batch)
        # a page table's columns, in its entries' page count's type (compared without a conversion: _check_pool)
        self._page_columns = np.arange(self.state["page_table"].shape[1], dtype=entries["num_pages"].dtype)
        self._pool_unchecked = False     # a step ended since the pool was last checked (_check_pool_now)
        self._tell_host = False
        self._notify_host = notify_host
        self._bell = Doorbell()
        self._step_lock = threading.Lock()
        self._held = False
        self._stop = False
        self.error: Optional[BaseException] = None
        # position -> logits rows, per request id, while `record_logits` (tests compare them); every row's
        # logits are computed then, not only those of the rows that sample
        self.record_logits = False
        self.logits: dict = {}
        self._thread = threading.Thread(target=self._run, name="mdsl-cpu-device", daemon=True)

    def _prepare(self, weights: dict, caches: tuple) -> None:
        """The weights, the KV pools and the program (per node: its step rule, attributes, operand names,
        result names) where the forward runs: numpy arrays here."""
        self.weights = {w.name: np.asarray(weights[w.name], np.float32) for w in self.graph.weights}
        # float32 arrays of kv_dtype values (numpy has no bfloat16): the step's attention rounds as it appends
        self.kv = {s.name: np.zeros(kv_pool_shape(self.shape, *s.shape[1:]), np.float32) for s in caches}
        self._program = [(STEP_RULES[n.op], n.attr_dict, [v.name for v in n.inputs], [v.name for v in n.outputs])
                         for n in self.nodes]

    # ---- what the host engine calls

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """The host published a request, set a cancel flag or the shutdown word, or read ring records."""
        self._bell.ring()

    def stop(self, timeout: float) -> None:
        """Leave now, whatever is admitted (after the shutdown word, for a device that cannot drain)."""
        self._stop = True
        self.wake()
        self.join(timeout)

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- for tests and debugging: hold the thread and run steps by hand

    def hold(self) -> None:
        """The thread runs no step until `resume`; `step` runs one in the caller's thread."""
        self._held = True
        with self._step_lock:     # a step under way finishes first
            pass

    def resume(self) -> None:
        self._held = False
        self.wake()

    def step(self) -> bool:
        """One scheduler step; whether anything happened (a request ran, was admitted or retired)."""
        with self._step_lock:
            worked = self._step(tell_early=False)
            self._flush_host()
            return worked

    def kv_pools(self) -> dict:
        """Cache name -> a copy of its KV pool's values (float32), between steps."""
        return {name: pool.copy() for name, pool in self.kv.items()}

    def queued(self) -> int:
        """Requests published in the queue and not yet taken."""
        queue, taken = self.host["queue"], int(self.host["control"]["queue_taken"][0])
        n = 0
        while n < len(queue) and int(queue["seq"][(taken + n) % len(queue)]) == taken + n + 1:
            n += 1
        return n

    # ---- the loop

    def _run(self) -> None:
        control = self.host["control"]
        control["status"] = SERVING
        try:
            while not self._stop:
                worked = False
                if not self._held:
                    with self._step_lock:
                        worked = self._step(tell_early=True)
                if control["shutdown"][0] and not np.any(self.state["entries"]["state"] != FREE):
                    break
                if not worked:
                    self._flush_host()
                    self._bell.wait(IDLE_WAIT_S)
            control["status"] = STOPPED
        except _Stop:
            control["status"] = STOPPED
        except BaseException as e:   # the host turns it into an error on every unfinished request
            self.error = e
            control["status"] = FAILED
        self._notify_host()

    def _step(self, tell_early: bool) -> bool:
        """One step; with `tell_early` (the thread's loop) the records of the step before (its tokens) and the
        queue slots this one took are told to the host as the forward starts, so that the host's thread
        streams them while the forward runs (the GPU device's waits for its stream let it), not beside the
        planning, whose every numpy call would wait for it; else (a step by hand) once the step is done."""
        worked, rows = self._begin_step()
        if tell_early:
            self._flush_host()
        self._end_step(self._run_chunks() if rows else {})
        return worked or rows > 0

    def _begin_step(self) -> tuple:
        """The scheduler's half before the forward: cancel, plan, pages, admit, and write the step's tables
        (its header, chunks and rows). Returns (whether a request was admitted or retired, the step's rows)."""
        worked = self._cancel()
        running = self._by_age(RUNNING)
        self._decoding = None
        decoding = self._plain_decode(running)
        if decoding is not None:
            return worked, self._begin_decode(*decoding)
        budget = self._budget(running)
        plan, preempted = self._give_pages(self._plan(running, budget), may_preempt=True)
        if not preempted:              # a step that had to preempt admits nothing
            worked = self._admit(plan, budget) or worked
        return worked, self._write_step(plan)

    def _budget(self, running: list) -> int:
        """The step's token budget: max_tokens_per_step while a running entry decodes (its one token to run
        is the one it sampled last: a long prompt's chunks must not stall it), else max_prefill_tokens (the
        step reads prompts alone, their linears at the tensor cores' rate)."""
        entries, shape = self.state["entries"], self.shape
        if any(self._known(e) - int(entries["context"][e]) == 1 for e in running):
            return shape.max_tokens_per_step
        return shape.step_rows

    def _run_chunks(self) -> dict:
        """The step the scheduler wrote, run: the forward over its rows, then the token each chunk that
        samples chooses from its last row's logits. Returns chunk index -> token; every row's logits are
        recorded while `record_logits`."""
        step = self.state["step"][0]
        chunks = self.state["chunks"][:int(step["num_chunks"])]
        logits = self._forward(step, chunks, self.state["rows"][:int(step["num_rows"])])
        self._check_pool_now()   # (where the forward did not: a device whose forward runs elsewhere checks it there)
        if self.record_logits:
            entries = self.state["entries"]
            for e, first, n, row, _, _ in chunks.tolist():
                per = self.logits.setdefault(int(entries["request"]["request_id"][e]), {})
                for i in range(n):
                    per.setdefault(first + i, []).append(logits[row + i])
        return self._samples(logits)

    def _end_step(self, tokens: dict) -> None:
        """The scheduler's half after the forward, from the step's tables: advance each chunk's entry, take
        the token `tokens[c]` of each chunk c that samples (stream it, retire the entry where it stops), and
        update the control words."""
        control, entries, step = self.host["control"], self.state["entries"], self.state["step"][0]
        chunks, rows = self.state["chunks"][:int(step["num_chunks"])], int(step["num_rows"])
        decoding, self._decoding = self._decoding, None
        if decoding is not None and len(decoding) == len(chunks):
            self._end_decode(decoding, tokens)
        else:
            context, records = entries["context"], []
            for c, (e, first, n, _, sampled, _) in enumerate(chunks.tolist()):
                context[e] = first + n
                if self.prefix is not None:
                    self._name_pages(e, first, first + n)
                if sampled:
                    records.append(self._choose(e, int(tokens[c]), first + n - 1))
            self._emit_all(records)
        control["running"], control["step_tokens"] = len(chunks), rows
        if len(chunks):
            control["steps"] += 1
            control["tokens"] += rows
            control["peak_running"] = max(int(control["peak_running"][0]), len(chunks))
        control["free_pages"] = self._available()
        # the pool as the step leaves it is checked at once where no rows ran, else by the next step's forward
        # (_run_chunks), beside its work: its planning only takes and frees pages, each of which leaves the
        # pool whole, so a damage is found there as here, and a GPU's forward checks while its kernels run
        self._pool_unchecked = True
        if not len(chunks):
            self._check_pool_now()

    def _flush_host(self) -> None:
        """Wake the host if a record was written or a queue slot taken since the last time."""
        if self._tell_host:
            self._tell_host = False
            self._notify_host()

    # ---- the scheduler's parts

    def _cancel(self) -> bool:
        """Where the host's count of cancel flags moved since the last look: every admitted entry whose flag is set,
        its last record, then its pages and entry freed."""
        entries, cancel = self.state["entries"], self.host["cancel"]
        found = False
        cancels = int(self.host["control"]["cancels"][0])
        if cancels == self._cancels_seen:
            return found
        self._cancels_seen = cancels
        for e in np.flatnonzero(entries["state"] != FREE):
            req = entries["request"][e]
            if cancel[req["handle"]]:
                self._emit(req["request_id"], -1, req["prompt_len"] + entries["generated"][e], FINISHED,
                           REASON_CANCELLED)
                self._release(int(e))
                found = True
        return found

    def _plan(self, candidates: list, budget: int) -> list:
        """(entry, tokens) pairs for `candidates` (running entries, oldest first) within `budget` tokens:
        every decode token first (an entry whose only known token to run is the one it sampled last), then
        chunks of the others' known tokens (a prompt, or what a preempted request recomputes), oldest
        first, each as long as the budget leaves."""
        pending = {e: self._known(e) - int(self.state["entries"]["context"][e]) for e in candidates}
        plan = []
        for e in [e for e in candidates if pending[e] == 1] + [e for e in candidates if pending[e] > 1]:
            n = min(pending[e], budget)
            if n == 0:
                break
            plan.append((e, n))
            budget -= n
        return plan

    def _give_pages(self, plan: list, may_preempt: bool) -> tuple:
        """Pages for the planned tokens, oldest entry first: (the plan as it can run, whether it preempted).
        A chunk whose pages cannot all be had shrinks to the positions its pages hold; an entry whose next
        position has no page and finds none free preempts the youngest running entry (perhaps itself) when
        `may_preempt`, and otherwise waits for a later step."""
        entries, pool, ps = self.state["entries"], self.state["pool"], self.shape.page_size
        granted, preempted = {}, False
        for e, n in sorted(plan, key=lambda chunk: int(entries["arrival"][chunk[0]])):
            while entries["state"][e] == RUNNING:
                room = int(entries["num_pages"][e]) * ps - int(entries["context"][e])
                if room >= n:
                    break
                if self._available():
                    self._take_page(e)
                elif room or not may_preempt:
                    n = room
                    break
                else:    # the victim is younger than every entry served before e: none of them loses its pages
                    self._preempt(self._by_age(RUNNING)[-1])
                    preempted = True
            if entries["state"][e] == RUNNING and n:
                granted[e] = n
        return [(e, granted[e]) for e, _ in plan if e in granted], preempted

    def _admit(self, plan: list, budget: int) -> bool:
        """Preempted requests (oldest first), then the queue in order, while an entry is free and the free
        pages cover the request's known tokens; the first that cannot be admitted stops admission. Each
        admitted request's first chunk joins `plan` within what the step's `budget` leaves."""
        entries = self.state["entries"]
        budget -= sum(n for _, n in plan)
        admitted = False

        def start(e: int) -> None:
            nonlocal budget, admitted
            entries["state"][e] = RUNNING
            chunk, _ = self._give_pages(self._plan([e], budget), may_preempt=False)
            plan.extend(chunk)
            budget -= sum(n for _, n in chunk)
            admitted = True

        for e in self._by_age(PREEMPTED):
            cached = self._cached_prefix(self.state["history"][e], self._known(e), e)
            if not self._fits(self._known(e), cached):
                return admitted
            self._map_prefix(e, cached)
            start(e)
        control, queue = self.host["control"], self.host["queue"]
        while True:
            k = int(control["queue_taken"][0])
            slot = queue[k % len(queue)]
            if int(slot["seq"]) != k + 1:
                return admitted
            req = slot["request"].copy()
            self._check_request(req)
            if self.host["cancel"][req["handle"]]:      # cancelled while queued: finished without an entry
                control["queue_taken"] = k + 1
                self._emit(req["request_id"], -1, req["prompt_len"], FINISHED, REASON_CANCELLED)
                admitted = True
                continue
            free = np.flatnonzero(entries["state"] == FREE)
            n = int(req["prompt_len"])
            if self._queued_keys[0] != k:          # (the head's page keys, once however long it waits)
                self._queued_keys = (k, [])
            cached = self._cached_prefix(self.host["prompts"][req["handle"]], n, None) if len(free) else []
            if not len(free) or not self._fits(n, cached):
                return admitted
            e = int(free[0])
            entries["request"][e] = req
            entries["arrival"][e], entries["context"][e], entries["generated"][e] = k, 0, 0
            self.state["history"][e, :n] = self.host["prompts"][req["handle"], :n]
            control["queue_taken"] = k + 1             # the slot is copied: the host may reuse it
            self._tell_host = True
            self._keys[e], self._queued_keys = self._queued_keys[1], (-1, [])   # (its history's page keys)
            self._map_prefix(e, cached)
            if cached:
                self._cached_of[int(req["request_id"])] = len(cached) * self.shape.page_size
            start(e)

    #: a plain decode step (_plain_decode) of at least this many entries is planned, written and ended over
    #: arrays of its entries, with the general path's results: the arrays' numpy calls cost a step a fixed
    #: 40-50 µs more than the general path's and save about 5 µs an entry (steps by hand on a 2-core machine:
    #: 50 µs slower at one entry, 10-40 µs faster at 8, 300 µs at 64)
    VECTOR_DECODE_ENTRIES = 8

    def _plain_decode(self, running: list) -> Optional[tuple]:
        """(the running entries oldest first, their contexts, which have their pages full) where the step is a
        plain decode step, else None: every running entry's one token to run is the one it sampled last, the
        budget holds them all, the next position of each entry whose pages are full finds a page (no
        preemption), and nothing waits to be admitted (no preempted entry, the queue's next slot unpublished).
        The general path then plans one token for each entry and takes a page for each full one, oldest first,
        and admits nothing: what _begin_decode does."""
        if not self.VECTOR_DECODE_ENTRIES <= len(running) <= self.shape.max_tokens_per_step:
            return None
        f = self._entry_fields
        if PREEMPTED in f["state"]:
            return None
        k = int(self.host["control"]["queue_taken"][0])
        seq = self._queue_seq
        if int(seq[k % len(seq)]) == k + 1:
            return None
        e = np.array(running, np.int64)
        context = f["context"][e].astype(np.int64)
        if np.any(f["prompt_len"][e] + f["generated"][e] - context != 1):
            return None
        full = f["num_pages"][e] * self.shape.page_size <= context
        if full.any() and int(np.count_nonzero(full)) > self._available():
            return None
        return e, context, full

    def _begin_decode(self, e: np.ndarray, context: np.ndarray, full: np.ndarray) -> int:
        """The decode step of entries e (_plain_decode's): a page for each whose pages are full, oldest first,
        then the step's tables: chunk c is entry e[c]'s next position, row c, sampling. Returns its rows."""
        if full.any():
            for f in e[full].tolist():
                self._take_page(f)
        b = len(e)
        order = self._order[:b]
        chunks, rows, step = self._step_fields, self._row_fields, self.state["step"]
        chunks["entry"][:b], chunks["start"][:b], chunks["count"][:b] = e, context, 1
        chunks["row"][:b], chunks["sample"][:b], chunks["pad"][:b] = order, 1, 0
        rows["token"][:b], rows["position"][:b], rows["chunk"][:b] = self.state["history"][e, context], context, order
        step["num_chunks"], step["num_rows"], step["num_samples"] = b, b, b
        self._decoding = e
        return b

    def _end_decode(self, e: np.ndarray, tokens) -> None:
        """_end_step's chunks for the decode step of entries e: each entry's context one further, its token
        `tokens[c]` in its history and its record (the entry retired on a stop token or at max_new_tokens), the
        pages it completed named (prefix cache); the retirements and namings in chunk order, as the general
        path's, the records in chunk order. `tokens`: chunk -> token, or an array of them in chunk order."""
        f = self._entry_fields
        b = len(e)
        token = tokens.astype(np.int64) if isinstance(tokens, np.ndarray) else \
            np.fromiter((tokens[c] for c in range(b)), np.int64, b)
        position = f["context"][e].astype(np.int64) + 1      # (the sampled token's)
        f["context"][e] = position
        self.state["history"][e, position] = token
        generated = f["generated"][e] + 1
        f["generated"][e] = generated
        request_id, max_new, stops = self._request_arrays(e)
        stopped = (stops == token[:, None]).any(axis=1)
        reason = (generated >= max_new) * REASON_LENGTH
        reason[stopped] = REASON_STOP
        special = reason != REASON_NONE
        named = None
        if self.prefix is not None:
            named = position % self.shape.page_size == 0
            special |= named
        if special.any():
            for c in np.flatnonzero(special).tolist():
                if named is not None and named[c]:
                    self._name_pages(int(e[c]), int(position[c]) - 1, int(position[c]))
                if reason[c]:
                    self._release(int(e[c]))
        flags = HAS_TOKEN + FINISHED * (reason != REASON_NONE)
        self._emit_columns((request_id, token, position, flags, reason))

    def _request_arrays(self, e: np.ndarray) -> tuple:
        """(request ids, max_new_tokens, stop ids [len(e), MAX_STOP], -1 past each request's num_stop) of the
        requests in entries e, read from an entry once per request (as _request_of)."""
        arrival_of, request_id, max_new, stops = self._request_table
        arrival = self._entry_fields["arrival"][e].astype(np.int64)
        stale = arrival_of[e] != arrival
        if stale.any():
            for f in e[stale].tolist():
                self._read_request(f)
        return request_id[e], max_new[e], stops[e]

    def _read_request(self, e: int) -> tuple:
        """Entry e's request's (arrival, request id, stop ids, max_new_tokens), read from the entry into both
        caches (_request_of's, _request_arrays')."""
        req, arrival = self.state["entries"]["request"][e], int(self._entry_fields["arrival"][e])
        stop_ids = req["stop_ids"][:int(req["num_stop"])]
        known = self._requests[e] = (arrival, int(req["request_id"]), frozenset(int(t) for t in stop_ids),
                                     int(req["max_new_tokens"]))
        arrival_of, request_id, max_new, stops = self._request_table
        arrival_of[e], request_id[e], max_new[e] = arrival, known[1], known[3]
        stops[e] = -1
        stops[e, :len(stop_ids)] = stop_ids
        return known

    def _write_step(self, plan: list) -> int:
        """Write the step's header, chunks and rows for `plan` ((entry, tokens) pairs); a chunk samples where
        it ends at the entry's last known token. Returns the step's rows."""
        entries, history = self.state["entries"], self.state["history"]
        step, chunks, rows = self.state["step"], self.state["chunks"], self.state["rows"]
        # (the fields' views taken once: a structured array's field costs a microsecond a look, and a decode
        # step has a chunk of one row per request)
        context, tokens, positions, of_chunk = entries["context"], rows["token"], rows["position"], rows["chunk"]
        r = samples = 0
        for c, (e, n) in enumerate(plan):
            first = int(context[e])
            sampled = int(first + n == self._known(e))
            chunks[c] = (e, first, n, r, sampled, 0)
            if n == 1:
                tokens[r], positions[r], of_chunk[r] = history[e, first], first, c
            else:
                tokens[r:r + n] = history[e, first:first + n]
                positions[r:r + n] = np.arange(first, first + n)
                of_chunk[r:r + n] = c
            r, samples = r + n, samples + sampled
        step["num_chunks"], step["num_rows"], step["num_samples"] = len(plan), r, samples
        return r

    def _samples(self, logits: dict) -> dict:
        """Chunk index -> the token its entry samples from its last row's `logits`, for the step's chunks
        that sample."""
        chunks = self.state["chunks"][:int(self.state["step"]["num_chunks"][0])]
        return {c: self._token(e, logits, row + n - 1, first + n - 1)
                for c, (e, first, n, row, sampled, _) in enumerate(chunks.tolist()) if sampled}

    def _token(self, e: int, logits: dict, row: int, pos: int) -> int:
        """Entry e's next token, sampled from the logits of `row` (at `pos`, its last known position)."""
        req = self.state["entries"]["request"][e]
        return sample(logits[row], temperature=float(req["temperature"]), top_k=int(req["top_k"]),
                      top_p=float(req["top_p"]), seed=int(req["seed"]), position=pos)

    def _choose(self, e: int, token: int, pos: int) -> tuple:
        """Entry e's next token `token`, after `pos`: its ring record (request id, token, position, flags,
        reason: _emit_all streams it), the entry retired on a stop token or at max_new_tokens."""
        generated_of = self.state["entries"]["generated"]
        request_id, stops, max_new = self._request_of(e)
        generated = int(generated_of[e])
        self.state["history"][e, pos + 1] = token
        generated_of[e] = generated + 1
        if token in stops:
            reason = REASON_STOP
        elif generated + 1 >= max_new:
            reason = REASON_LENGTH
        else:
            reason = REASON_NONE
        if reason:
            self._release(e)
        return request_id, token, pos + 1, HAS_TOKEN | (FINISHED if reason else 0), reason

    def _request_of(self, e: int) -> tuple:
        """(request id, stop ids, max_new_tokens) of the request in entry e, read from its entry once per
        request (a numpy record's fields cost microseconds each, at every token of every request)."""
        known = self._requests.get(e)
        if known is None or known[0] != int(self._entry_fields["arrival"][e]):
            known = self._read_request(e)
        return known[1:]

    def _forward(self, step, chunks, rows) -> dict:
        """The step's forward over its rows: row -> logits, for the rows whose chunk samples there (every
        row while `record_logits`). Each node's step rule takes all the rows at once; the KV cache operands
        are the page pools, which the attention rule reads and appends through the chunks' page tables."""
        batch = StepBatch(rows["token"].astype(np.int64), rows["position"].astype(np.int64),
                          tuple(tuple(int(c[f]) for f in ("entry", "start", "count", "row")) for c in chunks),
                          self.state["page_table"], self.shape.page_size, self.kv_dtype, self.operand_dtype)
        keep = (np.arange(len(rows)) if self.record_logits else
                (chunks["row"] + chunks["count"] - 1)[chunks["sample"] == 1].astype(np.int64))
        values = {**self.weights, **self.kv, TOKENS: batch.tokens}
        produced: set = set()
        for i, (rule, attrs, names, results) in enumerate(self._program):
            if i == self._narrow_at and len(keep) < len(rows):
                if not len(keep):
                    return {}
                values.update({name: values[name][keep] for name in produced})
                batch = batch.rows(keep)
            outs = rule([values[name] for name in names], attrs, batch)
            values.update(zip(results, outs))
            produced.update(results)
        logits = np.asarray(values[self.graph.logits.name], np.float32)
        return dict(zip(keep.tolist(), logits))

    # ---- pages, entries, records

    def _by_age(self, state: int) -> list:
        entries = self.state["entries"]
        found = np.flatnonzero(entries["state"] == state)
        return [int(e) for e in found[np.argsort(entries["arrival"][found], kind="stable")]]

    def _known(self, e: int) -> int:
        """Entry e's known tokens: its prompt and the tokens it produced."""
        entries = self.state["entries"]
        return int(entries["request"]["prompt_len"][e]) + int(entries["generated"][e])

    def _pages_for(self, tokens) -> int:
        return -(-int(tokens) // self.shape.page_size)

    def _available(self) -> int:
        """Pages a request can take: the free ones, and the cached ones no request holds."""
        free = int(self.state["pool"]["free_count"][0])
        return free + (len(self.prefix.evictable) if self.prefix is not None else 0)

    def _take_page(self, e: int) -> None:
        """A free page for entry e's next page, else the least recently released cached one."""
        pool, entries = self.state["pool"], self.state["entries"]
        top = int(pool["free_count"][0]) - 1
        k = int(entries["num_pages"][e])
        if top >= 0:
            page = int(self.state["free_pages"][top])
            pool["free_count"] = top
        else:
            page = self.prefix.evict()
        if self.prefix is not None:
            self.prefix.hold(page)
        self.state["page_table"][e, k] = page
        entries["num_pages"][e] = k + 1

    def _free_pages(self, e: int) -> None:
        pool, entries = self.state["pool"], self.state["entries"]
        k, top = int(entries["num_pages"][e]), int(pool["free_count"][0])
        released = self.state["page_table"][e, k - 1::-1] if k else self.state["page_table"][e, :0]
        if self.prefix is not None:   # (a cached page stays with its key, evictable once no request holds it)
            released = np.array([p for p in released.tolist() if self.prefix.release(p)], np.int32)
        self.state["free_pages"][top:top + len(released)] = released
        self.state["page_table"][e, :k] = -1
        pool["free_count"] = top + len(released)
        entries["num_pages"][e] = 0

    # ---- the prefix cache (mdsl.serving.prefix_cache)

    def _cached_prefix(self, tokens: np.ndarray, known: int, e: Optional[int]) -> list:
        """The cached pages of the longest prefix of tokens[:known] that the cache names, in full pages
        short of the last known token (which the request computes: its logits choose its next token). The
        pages' keys extend those kept for the tokens (entry e's history, or the queue's head where e is None),
        so a request that waits to be admitted names its pages once, not at every step."""
        if self.prefix is None:
            return []
        kept = self._keys.get(e, []) if e is not None else self._queued_keys[1]
        keys = self.prefix.keys(tokens, (known - 1) // self.shape.page_size, kept)
        if len(keys) > len(kept):
            if e is not None:
                self._keys[e] = keys
            else:
                self._queued_keys = (self._queued_keys[0], keys)
        return self.prefix.lookup(keys)

    def _fits(self, known: int, cached: list) -> bool:
        """Whether the pages a request's known tokens need beside its `cached` ones can be had."""
        taken = sum(1 for p in cached if self.prefix.refs[p] == 0)   # (they leave the evictable pages)
        return self._available() - taken >= self._pages_for(known) - len(cached)

    def _map_prefix(self, e: int, cached: list) -> None:
        """Entry e (holding no page) starts with the `cached` pages: their positions are cached."""
        if not cached:
            return
        for j, page in enumerate(cached):
            self.prefix.hold(page)
            self.state["page_table"][e, j] = page
        entries = self.state["entries"]
        entries["num_pages"][e], entries["context"][e] = len(cached), len(cached) * self.shape.page_size
        self.prefix.hits += len(cached) * self.shape.page_size

    def take_cached_tokens(self, request_id: int) -> int:
        """The prompt tokens request `request_id` found cached at its admission (0: none), forgotten (the
        host asks once, when the request ends)."""
        return self._cached_of.pop(request_id, 0)

    def _name_pages(self, e: int, start: int, end: int) -> None:
        """Name the pages entry e's positions start .. end - 1 completed (its keys and values written)."""
        ps = self.shape.page_size
        first, last = start // ps, end // ps
        if first == last:
            return
        keys = self._keys[e] = self.prefix.keys(self.state["history"][e], last, self._keys.get(e, []))
        for j in range(first, last):
            self.prefix.register(keys[j], int(self.state["page_table"][e, j]))

    def _preempt(self, e: int) -> None:
        """Free e's pages; it keeps its entry and history, and recomputes its tokens when re-admitted."""
        entries = self.state["entries"]
        req = entries["request"][e]
        self._free_pages(e)
        entries["state"][e], entries["context"][e] = PREEMPTED, 0
        self.host["control"]["preemptions"] += 1
        self._emit(req["request_id"], -1, req["prompt_len"] + entries["generated"][e], WAS_PREEMPTED, REASON_NONE)

    def _release(self, e: int) -> None:
        self._free_pages(e)
        self._keys.pop(e, None)
        self.state["entries"]["state"][e] = FREE

    def _emit(self, request_id, token, position, flags: int, reason: int) -> None:
        """Ring record n: its fields, then its sequence word; wait while the host has not read record n - R."""
        self._emit_all([(request_id, token, position, flags, reason)])

    def _emit_all(self, records: list) -> None:
        """Ring records n, n + 1, ... of (request id, token, position, flags, reason), in order (_emit_columns)."""
        if records:
            self._emit_columns(tuple(zip(*records)))

    def _emit_columns(self, columns: tuple) -> None:
        """Ring records n, n + 1, ... from `columns` (request ids, tokens, positions, flags, reasons: sequences of
        one length), in order, each once the host has read record n - R (a full ring waits), as many at once as
        the ring has room for: their fields, then their sequence words (a field a look for them all: a decode
        step has a record per request, and five looks a record cost a step of many requests hundreds of
        microseconds)."""
        ring, control = self.host["ring"], self.host["control"]
        done, count = 0, len(columns[0])
        while done < count:
            room = len(ring) - (self._written - int(control["ring_read"][0]))
            if room <= 0:
                if self._stop:
                    raise _Stop()
                self._notify_host()
                self._bell.wait(IDLE_WAIT_S)
                continue
            now = min(room, count - done)
            at = (self._written + np.arange(now)) % len(ring)
            for name, values in zip(("request_id", "token", "position", "flags", "reason"), columns):
                ring[name][at] = values[done:done + now]
            ring["seq"][at] = self._written + 1 + np.arange(now)
            self._written += now
            done += now
            self._tell_host = True

    def _check_request(self, req) -> None:
        """The host's side of the contract, checked before the device relies on it."""
        n, new = int(req["prompt_len"]), int(req["max_new_tokens"])
        if not (0 < n and 0 < new and n + new <= self.shape.max_seq and req["handle"] < self.shape.handles
                and req["num_stop"] <= MAX_STOP and self._pages_for(n + new - 1) <= self.shape.num_pages):
            raise broken_request(req)

    def _check_pool_now(self) -> None:
        """The pool's check (_check_pool), where a step ended since the last one."""
        if self._pool_unchecked:
            self._pool_unchecked = False
            self._check_pool()

    def _check_pool(self) -> None:
        """Every page is either free or in exactly one admitted request's page table (with the prefix
        cache: free, cached and held by none, or in as many page tables as hold it)."""
        pool, table = self.state["pool"], self.state["page_table"]
        held = table[self._page_columns[None, :] < self._entry_fields["num_pages"][:, None]]
        free = self.state["free_pages"][:pool["free_count"][0]]
        pages = np.concatenate([free, held]).astype(np.intp)   # (an index array's own type scatters fastest)
        n = self.shape.num_pages
        if pages.min(initial=0) < 0 or pages.max(initial=0) >= n:
            raise damaged_pool()
        if self.prefix is not None:
            if not self.prefix.check(free, held):
                raise damaged_pool()
        else:
            # as many pages as the pool's, each in range: all marked means each once (linear time, and half a
            # count per page's: the check runs every step)
            marks = np.zeros(n, bool)
            marks[pages] = True
            if len(pages) != n or not marks.all():
                raise damaged_pool()

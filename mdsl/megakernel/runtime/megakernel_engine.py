"""The megakernel's host side: weights and KV cache on the GPU, the task tables, and `generate`, which
prefills the prompt and decodes inside ONE launch of the persistent kernel (the prompt's tokens are
steps whose next token is the prompt's; the host sees only the finished tokens).

    engine = MegakernelEngine.from_pretrained("path/to/checkpoint", max_seq=2048)
    tokens = engine.generate([1, 2, 3], max_new_tokens=32)              # greedy
    tokens = engine.generate(ids, 32, temperature=0.7, top_p=0.9, seed=1)

The kernel's few choices are a `MegakernelOptions` (megakernel_options.py); every one left None takes its default for
the configuration (one GPU, or a rank of a tensor-parallel job).

Nothing here touches the CUDA driver before `has_gpu()` says there is a GPU.
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Mapping, Optional, Sequence

import attrs
import numpy as np

from mdsl.backend.cuda import runtime
from mdsl.errors import MdslError, ShapeError
from mdsl.gpu.arrays import DeviceArray
from mdsl.gpu.driver import CudaError, NoGPUError, driver, release
from mdsl.gpu.driver import check as _check
from mdsl.gpu.driver import cu_stream as _cu_stream
from mdsl.ir.dtypes import f32, i32, round_to_dtype
from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.model import ModelFunction, ModelGraph
from mdsl.megakernel.modelgraph.model_config import DEFAULT_MAX_SEQ, ModelConfig
from mdsl.megakernel.runtime.kernel_source import (BLOCK_THREADS, KERNEL_NAME, PARAMS, PROFILE_WORDS, KernelOptionError,
                                                   generate_source)
from mdsl.megakernel.runtime.megakernel_options import MegakernelOptions, OptionError
from mdsl.megakernel.runtime.profile import TaskRecord
from mdsl.megakernel.runtime.shape import (EXPERT_PARTS, KERNEL_WEIGHTS, LAYER_WEIGHTS, MOE_WEIGHTS, POST_NORMS,
                                           QKV_BIASES, DecoderShape, decoder_shape, expert_slot, layer_tensors,
                                           layer_weight_name, rope_tables)
from mdsl.megakernel.runtime.task_plan import TaskPlan, for_ranks, plan_model

_STATE_WORDS = 12                # sync.cuh's STATE_*: 2 unused words, stop step, generated, next token,
_STATE_STOP, _STATE_GENERATED, _STATE_BAD_TOKEN = 2, 3, 5   # bad token, the watchdog's report (5 words)
_STATE_STUCK = slice(6, 11)
_NO_STOP = 2**31 - 1
_STATIC_SMEM_LIMIT = 48 * 1024
_NO_GPU_HINT = ("without a GPU, build the task tables and the CUDA source (mdsl.megakernel.runtime.build_plan, "
                "generate_source), or run the model on the CPU (mdsl.megakernel.modelgraph.reference, .simulator)")
def weight_names(config: ModelConfig) -> list:
    if config.num_experts:   # (a mixture of experts' layers: the built-in step function's weights)
        return [w.name for w in step_function(config).trace(config).weights]
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for layer in range(config.num_layers):
        names += [layer_weight_name(layer, w) for w in layer_tensors(config)]
    return names


def trace_at(model: ModelFunction, config: ModelConfig, max_seq: int) -> ModelGraph:
    """The step function's graph with a KV cache (and token history) of the engine's `max_seq` positions."""
    return model.trace(config, max_positions=max_seq)


def device_plan(config: ModelConfig, graph: Optional[ModelGraph], *, workers: int, max_seq: int,
                options: MegakernelOptions, world: int = 1) -> TaskPlan:
    """The task tables an engine runs: lowered from `graph` (a step function traced at `max_seq` positions;
    None: the built-in step function of the config's architecture) by the layer ops' rules
    (task_plan.plan_model), for one GPU or a rank of `world` (`config` and `graph` then the rank's shard's).
    An op the device cannot run is an UnsupportedError naming it and its line in the step function."""
    if graph is None:
        graph = trace_at(step_function(config), config, max_seq)
    return for_ranks(plan_model(graph, decoder_shape(config), workers=workers, max_seq=max_seq,
                                splits=options.attention_splits, min_chunk=options.attention_min_chunk), world)


def _ctype(c_type: str):
    return {"long long": ctypes.c_int64, "double": ctypes.c_double}.get(c_type, ctypes.c_uint64)


class Params(ctypes.Structure):
    """device.cu's `Params` (source.PARAMS): pointers as integers, counts, sampling settings."""

    _fields_ = [(name, _ctype(c_type)) for c_type, name in PARAMS]


@attrs.frozen
class Run:
    """What one launch did: the new tokens, the steps it ran, its device time, the profile if asked."""

    tokens: tuple
    steps: int
    seconds: float
    profile: Optional[tuple] = None    # TaskRecord


@attrs.frozen
class RankGroup:
    """This process's place in a tensor-parallel job: rank of world, and its NVSHMEM PE (nvshmem.init)."""

    rank: int
    world: int
    pe: object


# how to fix what generate_source's KernelOptionError names
OPTION_HINTS = {"attention_preload": "a smaller max_seq, or more attention_splits, or attention_preload=False"}


class MegakernelEngine:
    """A decoder on one GPU, run by the persistent megakernel. `weights`: name -> array, by the model graph's
    names (the plan binds each to the device's slots by the part it plays), numpy (float32
    values, rounded to the model's dtype on upload) or GPU arrays of the model's dtype (torch tensors,
    DeviceArrays: used in place). `options`: the kernel's choices (MegakernelOptions; what is None there
    takes its default for this configuration: one GPU, or a rank of `ranks.world`). `max_seq`: the KV cache's
    positions (default: the model's, at most DEFAULT_MAX_SEQ). `ranks`: one rank of a tensor-parallel job
    (mdsl.megakernel.parallel.gpu_group builds these): `config` and `weights` are then the rank's shard, and every
    rank must call `run` with the same arguments. `model`: the `@mdsl.model` step function whose traced graph
    the task tables are lowered from (default: the built-in one of the config's architecture)."""

    def __init__(self, config: ModelConfig, weights: Mapping, *, options: MegakernelOptions = MegakernelOptions(),
                 max_seq: Optional[int] = None, device: int = 0, eos_token_ids: Sequence[int] = (),
                 ranks: Optional[RankGroup] = None, model: Optional[ModelFunction] = None):
        if not isinstance(options, MegakernelOptions):
            raise OptionError(f"options is a {type(options).__name__}, not a MegakernelOptions",
                              hint="pass options=MegakernelOptions(...) (mdsl.megakernel.runtime.megakernel_options)")
        options = options.for_world(ranks.world if ranks is not None else 1)
        _require_gpu()
        self.options = options
        self.config = config
        self.shape: DecoderShape = decoder_shape(config)
        self.ranks = ranks
        self.world = ranks.world if ranks is not None else 1
        self.vocab_size = self.shape.vocab * self.world     # token ids: the whole vocabulary's
        self.max_seq = int(max_seq or min(config.max_positions, DEFAULT_MAX_SEQ))
        self.eos_token_ids = tuple(int(e) for e in eos_token_ids)
        self.sampling = {"temperature": 0.0, "top_p": 1.0, "seed": 0}   # generate's defaults
        self.device = device
        dev = runtime._device(device)
        self.workers = int(options.workers or _check(driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev.handle), "reading the SM count"))
        self.graph: ModelGraph = trace_at(model or step_function(config), config, self.max_seq)
        self.plan: TaskPlan = device_plan(config, self.graph, workers=self.workers, max_seq=self.max_seq,
                                          options=options, world=self.world)

        def generate(preload: Optional[bool], stream: bool):
            try:
                return generate_source(self.plan, attrs.evolve(options, attention_preload=preload), stream)
            except KernelOptionError as e:   # (what the options cannot judge without the plan's layout)
                raise OptionError(str(e), hint=OPTION_HINTS[e.option]) from None

        self._arrays: list = []       # every DeviceArray the kernel points into, kept alive
        self._keep: list = []         # foreign GPU arrays used in place
        # the default's attention preload, where its rows fit (None), is dropped again if the kernel then spills
        # (its registers beside the second pass's, at their cap in the tiny test models' kernels), and so are the
        # streamed rows after it: the rows are then read where they lie
        tries = {None: ((None, True), (False, True), (False, False)), True: ((True, True),),
                 False: ((False, True), (False, False))}[options.attention_preload]
        for preload, stream in tries:
            source = generate(preload, stream)
            self.source = source.text
            self.smem_bytes = source.smem_bytes
            self.module = runtime.compile_source(source.text, runtime.target_arch(device))
            if self.smem_bytes > dev.max_smem:
                raise CudaError(f"the megakernel needs {self.smem_bytes} bytes of shared memory per block; the device "
                                f"allows {dev.max_smem}", hint="a smaller max_seq shortens attention's score rows")
            self._module_handle = _check(driver.cuModuleLoadData(self.module.cubin), "loading the megakernel")
            self._function = _check(driver.cuModuleGetFunction(self._module_handle, KERNEL_NAME.encode()),
                                    "cuModuleGetFunction")
            # resources from the loaded function, not the compiler log (a log may lack ptxas's report)
            registers, local_bytes = (_check(driver.cuFuncGetAttribute(attribute, self._function), "cuFuncGetAttribute")
                                      for attribute in (driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS,
                                                        driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES))
            if not local_bytes or (preload, stream) == tries[-1]:
                break
            driver.cuModuleUnload(self._module_handle)
        resources = f"{registers} registers, {local_bytes} bytes of local memory per thread"
        if local_bytes:
            raise CudaError(f"the megakernel spills registers ({resources}); it would run far below bandwidth")
        if self.smem_bytes > _STATIC_SMEM_LIMIT:
            _check(driver.cuFuncSetAttribute(
                self._function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                self.smem_bytes), "allowing the megakernel its shared memory")
        per_sm = _check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self._function, BLOCK_THREADS,
                                                                        self.smem_bytes),
                        "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        if per_sm < 1:
            raise CudaError(f"a megakernel worker block does not fit on an SM ({resources}, {self.smem_bytes} bytes "
                            "of shared memory)")
        self.params = Params()
        self._router_done = None     # a mixture of experts' router counters (_expert_rows)
        self._upload_weights(weights)
        self._allocate()

    @classmethod
    def from_pretrained(cls, folder: str, *, max_seq: Optional[int] = None, device: int = 0,
                        options: MegakernelOptions = MegakernelOptions()) -> "MegakernelEngine":
        """From a Hugging Face checkpoint folder (config.json and *.safetensors; the model graph checks
        every tensor's name, shape and dtype). EOS tokens come from config.json / generation_config.json.
        `options`: the kernel's (MegakernelOptions)."""
        from mdsl.megakernel.modelgraph.checkpoint import open_pretrained

        checkpoint = open_pretrained(folder, max_seq)   # the whole checkpoint checked, no tensor data read yet
        _require_gpu()
        return cls(checkpoint.config, checkpoint.weights(), options=options, max_seq=max_seq, device=device,
                   eos_token_ids=checkpoint.eos_token_ids)

    # -- device memory ---------------------------------------------------------------------------

    def _array(self, values: np.ndarray, dtype) -> int:
        array = DeviceArray.from_numpy(values, dtype, device=self.device)
        self._arrays.append(array)
        return array.ptr

    def _zeros(self, count: int, dtype) -> int:
        array = DeviceArray((max(1, count),), dtype, device=self.device)
        _check(driver.cuMemsetD8Async(array.ptr, 0, array.nbytes, _cu_stream(array.stream)), "cuMemsetD8Async")
        self._arrays.append(array)
        return array.ptr

    def _shared_zeros(self, count: int, dtype) -> int:
        """A buffer every rank's kernel writes into (NVSHMEM's symmetric heap; the same calls in the same
        order on every rank), or an ordinary one on one GPU."""
        if self.ranks is None:
            return self._zeros(count, dtype)
        nbytes = max(1, count) * dtype.itemsize
        ptr = self.ranks.pe.malloc(nbytes)
        _check(driver.cuMemsetD8(ptr, 0, nbytes), "cuMemsetD8")
        deltas = [self.ranks.pe.peer_address(ptr, k) - ptr if k != self.ranks.rank else 0 for k in range(self.world)]
        if self._peer_deltas is None:
            self._peer_deltas = deltas
        elif deltas != self._peer_deltas:   # the device adds one offset per peer to any symmetric address
            raise CudaError(f"NVSHMEM mapped the peers' symmetric buffers at different offsets ({deltas} and "
                            f"{self._peer_deltas})")
        return ptr

    def _weight(self, weights: Mapping, name: str, shape: tuple) -> int:
        if name not in weights:
            raise ShapeError(f"the weights have no tensor {name} (expected {list(shape)})",
                             hint="pass every weight of the model graph by its name there (a built-in decoder's: "
                                  "its Hugging Face checkpoint's)")
        value = weights[name]
        if isinstance(value, np.ndarray):
            if tuple(value.shape) != shape:
                raise ShapeError(f"weight {name} has shape {list(value.shape)}, expected {list(shape)}")
            return self._array(value, self.shape.dtype)
        view = runtime.device_view(value, f"weight {name}")
        if tuple(view.shape) != shape or view.dtype is not self.shape.dtype:
            raise ShapeError(f"weight {name} is {view.dtype}{list(view.shape)}, expected "
                             f"{self.shape.dtype}{list(shape)}")
        self._keep.append(value)
        return view.ptr

    def _upload_weights(self, weights: Mapping) -> None:
        """The weights the plan binds to the device's slots (TaskPlan.weights: the graph's weights by the part
        they play), each uploaded once, by its name in the graph: a slot filled by part of a weight (Phi-3's
        fused qkv_proj) points into its rows, and a weight in two slots (a tied LM head, one norm read by
        attention and the MLP) is one upload."""
        s, p, plan = self.shape, self.params, self.plan
        uploaded: dict = {}
        slots = {(w.slot, w.layer): w for w in plan.weights}   # (a mixture of experts binds thousands)

        def pointer(slot: str, layer: Optional[int] = None) -> int:
            bound = slots.get((slot, layer))
            if bound is None:   # (a slot the model leaves empty, as q_norm without q/k norms: null)
                return 0
            if bound.name not in uploaded:
                uploaded[bound.name] = self._weight(weights, bound.name, bound.shape)
            return uploaded[bound.name] + bound.offset(s.dtype.itemsize)

        p.embed, p.final_norm, p.lm_head = (pointer(slot) for slot in KERNEL_WEIGHTS)
        cache = self.max_seq * s.kv_heads * s.head_dim
        k_cache, v_cache = (self._zeros(s.layers * cache, s.dtype) for _ in range(2))
        biased = any(w.slot in QKV_BIASES for w in plan.weights)
        post_normed = any(w.slot in POST_NORMS for w in plan.weights)
        experts = self._expert_rows(pointer) if any(w.slot in MOE_WEIGHTS for w in plan.weights) else None
        rows = []
        for layer in range(s.layers):
            # sync.cuh's LayerWeights: the weights (null where the model has none), the caches, then the
            # biases where it has them (its QKV_BIAS section), the output rows' norms (ROW_NORM), then a
            # mixture of experts' (its MOE section)
            offset = layer * cache * s.dtype.itemsize
            rows.append([pointer(w, layer) for w in LAYER_WEIGHTS] + [k_cache + offset, v_cache + offset] +
                        ([pointer(b, layer) for b in QKV_BIASES] if biased else []) +
                        ([pointer(n, layer) for n in POST_NORMS] if post_normed else []) +
                        (experts[layer] if experts is not None else []))
        p.layers = self._array(np.array(rows, dtype=np.uint64).view(np.int32), i32)

    def _expert_rows(self, pointer) -> list:
        """Per layer, LayerWeights' MOE section: the router, the expert table (the gates', ups' and downs' pointers:
        only the rows of the experts a step's routing picks are read), the router's logits, the routing's ids and
        weights, the slots' activations and the router's tile count (zeroed before each launch); null in a dense
        layer."""
        s = self.shape
        k, mi, e = s.experts_per_token, s.expert_intermediate, s.experts
        logits, weights = (self._zeros(s.layers * n, f32) for n in (e, k))
        ids, self._router_done = self._zeros(s.layers * k, i32), self._zeros(s.layers, i32)
        acts = self._zeros(s.layers * k * mi, s.dtype)
        rows = []
        for layer in range(s.layers):
            router = pointer("router", layer)
            if not router:
                rows.append([0] * 7)
                continue
            table = self._array(np.array([pointer(expert_slot(part, x), layer) for part in EXPERT_PARTS
                                          for x in range(e)], dtype=np.uint64).view(np.int32), i32)
            rows.append([router, table, logits + 4 * layer * e, ids + 4 * layer * k, weights + 4 * layer * k,
                         acts + layer * k * mi * s.dtype.itemsize, self._router_done + 4 * layer])
        return rows

    def _allocate(self) -> None:
        s, plan, p = self.shape, self.plan, self.params
        tasks, waits, signals = plan.tables()
        p.tasks, p.waits, p.signals = (self._array(t.reshape(-1), i32) for t in (tasks, waits, signals))
        self._initial_events = plan.initial_events()
        self._peer_deltas = None
        p.events = self._shared_zeros(len(self._initial_events), i32)
        p.state = self._zeros(_STATE_WORDS, i32)
        cos, sin = rope_tables(s, self.max_seq)
        p.rope_cos, p.rope_sin = self._array(cos.reshape(-1), f32), self._array(sin.reshape(-1), f32)
        # (under tensor parallelism a rank puts the next step's embedding row into h[0] of every rank)
        p.hs = (self._shared_zeros if self.world > 1 else self._zeros)((s.layers + 1) * s.hidden, s.dtype)
        p.mids = self._zeros(s.layers * s.hidden, s.dtype)
        p.qkvs = self._zeros(s.layers * s.qkv_rows, s.dtype)
        p.attns = self._zeros(s.layers * s.attention_width, s.dtype)
        p.acts = self._zeros(s.layers * s.intermediate, s.dtype)
        p.parts = self._zeros(s.layers * s.heads * plan.splits * (s.head_dim + 2), f32)
        p.attn_done = self._zeros(self._counters, i32)
        self._logits = self._zeros(s.vocab, f32)
        p.logits = self._logits
        p.best_value = self._shared_zeros(self.world * plan.lm_tiles, f32)
        p.best_index = self._shared_zeros(self.world * plan.lm_tiles, i32)
        if self.ranks is not None:
            p.h_parts = self._shared_zeros((s.layers + 1) * self.world * s.hidden, f32)
            p.mid_parts = self._shared_zeros(s.layers * self.world * s.hidden, f32)
            layer_words = self.world * s.hidden
            # the relay's 8-byte words, zeroed before every launch: no tag of a step (step + 1 >= 1)
            self._relay_words = tuple((self._shared_zeros(2 * layers * layer_words, i32), 2 * layers * layer_words)
                                      for layers in (s.layers + 1, s.layers))
            (p.h_relay, _), (p.mid_relay, _) = self._relay_words
            p.peer_delta = self._array(np.array(self._peer_deltas, dtype=np.int64).view(np.int32), i32)
            p.rank = self.ranks.rank
        p.prompt = self._zeros(self.max_seq, i32)
        p.out_tokens = self._zeros(self.max_seq, i32)
        p.eos = self._zeros(max(1, len(self.eos_token_ids)), i32)
        self._stream = _cu_stream(0)
        self._events = tuple(_check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate")
                             for _ in range(2))

    def _copy_in(self, ptr: int, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values)
        _check(driver.cuMemcpyHtoDAsync(ptr, values.ctypes.data, values.nbytes, self._stream), "cuMemcpyHtoDAsync")
        _check(driver.cuStreamSynchronize(self._stream), "cuStreamSynchronize")   # values may be freed after

    def _copy_out(self, ptr: int, count: int, dtype) -> np.ndarray:
        out = np.empty(count, dtype=dtype)
        if count:
            _check(driver.cuMemcpyDtoHAsync(out.ctypes.data, ptr, out.nbytes, self._stream), "cuMemcpyDtoHAsync")
            _check(driver.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
        return out

    # -- running ---------------------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: Optional[float] = None,
                 top_p: Optional[float] = None, seed: Optional[int] = None,
                 eos_token_ids: Optional[Sequence[int]] = None) -> list:
        """Prefill the prompt and generate up to `max_new_tokens` tokens (fewer when an EOS token comes:
        it is the last one returned), all in one launch. Greedy at temperature 0, else temperature and
        nucleus (top_p) sampling with a counter-based RNG seeded by `seed`; what is not given comes from
        `self.sampling` (greedy, or the model's sample op when built by `compile_model`)."""
        given = {"temperature": temperature, "top_p": top_p, "seed": seed}
        settings = {k: self.sampling[k] if v is None else v for k, v in given.items()}
        return list(self.run(prompt_ids, max_new_tokens, eos_token_ids=eos_token_ids, **settings).tokens)

    def run(self, tokens: Sequence[int], max_new_tokens: int, *, start: int = 0, temperature: float = 0.0,
            top_p: float = 1.0, seed: int = 0, eos_token_ids: Optional[Sequence[int]] = None,
            profile: bool = False) -> Run:
        """One launch: positions `start` .. len(tokens) - 1 of `tokens` (the KV cache already holds the
        positions before `start`), then up to `max_new_tokens` new ones. `profile`: record every task's
        SM and times (a Run.profile of TaskRecords)."""
        tokens = [int(t) for t in tokens]
        self._check_request(tokens, max_new_tokens, start, temperature, top_p)
        eos = self.eos_token_ids if eos_token_ids is None else tuple(int(e) for e in eos_token_ids)
        if len(eos) > max(1, len(self.eos_token_ids)):
            raise ShapeError(f"at most {max(1, len(self.eos_token_ids))} EOS tokens per engine, got {len(eos)}")
        steps = len(tokens) - start - 1 + max_new_tokens
        p = self.params
        p.prompt_len, p.start_pos, p.num_steps, p.max_new, p.num_eos = len(tokens), start, steps, max_new_tokens, len(eos)
        p.temperature, p.top_p, p.seed = float(temperature), float(top_p), int(seed) & (2**64 - 1)
        record = None
        if profile:
            record = DeviceArray((steps * self.plan_tasks * PROFILE_WORDS * 2,), i32, device=self.device)
            _check(driver.cuMemsetD8Async(record.ptr, 0, record.nbytes, self._stream), "cuMemsetD8Async")
        p.profile = record.ptr if record is not None else 0
        self._copy_in(p.prompt, np.array(tokens, dtype=np.int32))
        if eos:
            self._copy_in(p.eos, np.array(eos, dtype=np.int32))
        self._copy_in(p.events, self._initial_events)
        # the split counters count from 0 in every launch
        self._copy_in(p.attn_done, np.zeros(self._counters, dtype=np.int32))
        if self._router_done is not None:   # (and a mixture of experts' router tiles)
            self._copy_in(self._router_done, np.zeros(self.shape.layers, dtype=np.int32))
        initial_state = np.zeros(_STATE_WORDS, dtype=np.int32)
        initial_state[_STATE_STOP] = _NO_STOP
        self._copy_in(p.state, initial_state)
        if self.world > 1:   # the relay's words (done before the ranks' barrier below: a peer's kernel then writes them)
            for ptr, words in self._relay_words:
                _check(driver.cuMemsetD32Async(ptr, 0, words, self._stream), "cuMemsetD32Async")
            _check(driver.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
        self._write_first_row(tokens[start])
        if self.ranks is not None:   # every rank's tables and first row are in place before any kernel runs
            self.ranks.pe.barrier()
        arguments = (ctypes.c_void_p * 1)(ctypes.addressof(p))
        _check(driver.cuEventRecord(self._events[0], self._stream), "cuEventRecord")
        _check(driver.cuLaunchCooperativeKernel(self._function, self.workers, 1, 1, BLOCK_THREADS, 1, 1, self.smem_bytes,
                                                self._stream, ctypes.addressof(arguments)), "launching the megakernel")
        _check(driver.cuEventRecord(self._events[1], self._stream), "cuEventRecord")
        _check(driver.cuStreamSynchronize(self._stream), "running the megakernel")
        if self.ranks is not None:   # no rank resets its events while a peer's kernel may still signal them
            self.ranks.pe.barrier()
        milliseconds = _check(driver.cuEventElapsedTime(self._events[0], self._events[1]), "cuEventElapsedTime")
        state = self._copy_out(p.state, _STATE_WORDS, np.int32)
        task, step, event, count, need = (int(v) for v in state[_STATE_STUCK])
        if task == len(self.plan.tasks) + 1:   # sync.cuh's keep_polling
            raise CudaError(f"the megakernel deadlocked: a peer's residual-stream partial still carried step tag "
                            f"{count}, not {need}, after 5 s; every worker stopped",
                            hint="a bug in mdsl's task tables or runtime: please report it with this message")
        if task:
            waited = self.plan.events[event].producers
            raise CudaError(f"the megakernel deadlocked: task {task - 1} ({self.plan.tasks[task - 1].label()}) of step "
                            f"{step} waited over 5 s for event {event} (count {count}, needed {need}; producers "
                            f"{list(waited[:8])}{' ...' if len(waited) > 8 else ''}); every worker stopped",
                            hint="a bug in mdsl's task tables or runtime: please report it with this message")
        if state[_STATE_BAD_TOKEN]:
            raise MdslError(f"the megakernel's logits had no maximum (NaN) at step {int(state[_STATE_STOP])}",
                            hint="check the weights for NaN or inf values")
        made = int(state[_STATE_GENERATED])
        new = tuple(int(t) for t in self._copy_out(p.out_tokens, made, np.int32))
        stop = int(state[_STATE_STOP])
        ran = steps if stop == _NO_STOP else stop + 1
        records = None
        if record is not None:
            raw = self._copy_out(record.ptr, record.shape[0], np.int32).view(np.uint64).reshape(-1, PROFILE_WORDS)
            records = tuple(TaskRecord(index, *map(int, r[:5]), marks=tuple(map(int, r[5:])))
                            for index, r in enumerate(raw) if r[4])   # (done: the task ran)
        return Run(new, ran, milliseconds / 1e3, records)

    def _write_first_row(self, token: int) -> None:
        """Step 0's h: the token's embedding row (later steps' rows the device's sampler writes). Under
        tensor parallelism the rank whose vocabulary shard holds the token puts the row into every rank's
        h[0]."""
        s, p = self.shape, self.params
        row_bytes = s.hidden * s.dtype.itemsize
        if self.plan.embedding_scale:   # the row times the scale, as the sampler writes the later ones
            if self.ranks is not None:
                raise MdslError("a scaled embedding is not implemented under tensor parallelism",
                                hint="run the model on one GPU")
            self._copy_in(p.hs, self._scaled_row(token))
            return
        if self.ranks is None:
            _check(driver.cuMemcpyDtoDAsync(p.hs, p.embed + token * row_bytes, row_bytes, self._stream),
                   "cuMemcpyDtoDAsync")
            return
        local = token - self.ranks.rank * s.vocab
        if 0 <= local < s.vocab:
            for k in range(self.world):
                _check(driver.cuMemcpyDtoDAsync(p.hs + (self._peer_deltas[k] if k != self.ranks.rank else 0),
                                                p.embed + local * row_bytes, row_bytes, self._stream),
                       "cuMemcpyDtoDAsync")
            _check(driver.cuStreamSynchronize(self._stream), "cuStreamSynchronize")

    def _scaled_row(self, token: int) -> np.ndarray:
        """The token's embedding row times the plan's embedding_scale, rounded as sampling.cuh's EMBED_SCALE section
        rounds it (the scale rounded to the model's dtype, then the product), as the device's dtype's bits."""
        s = self.shape
        storage = np.float32 if s.dtype is f32 else np.uint16
        raw = self._copy_out(self.params.embed + token * s.hidden * s.dtype.itemsize, s.hidden, storage)
        values = raw if s.dtype is f32 else (raw.astype(np.uint32) << 16).view(np.float32)
        factor = round_to_dtype(np.array([self.plan.embedding_scale], np.float32), s.dtype)[0]
        scaled = round_to_dtype(values.astype(np.float32) * np.float32(factor), s.dtype).astype(np.float32)
        return scaled if s.dtype is f32 else (scaled.view(np.uint32) >> 16).astype(np.uint16)

    @property
    def _counters(self) -> int:
        """attn_done's words: attention's split counters per (layer, kv head), then, where o-proj and down-proj
        rows are normalised by their last tile (residual.cuh's ROW_NORM), two per layer for those."""
        s = self.shape
        post_normed = any(w.slot in POST_NORMS for w in self.plan.weights)
        return s.layers * s.kv_heads + (2 * s.layers if post_normed else 0)

    @property
    def plan_tasks(self) -> int:
        return len(self.plan.tasks)

    def _check_request(self, tokens, max_new_tokens, start, temperature, top_p) -> None:
        if not tokens:
            raise ShapeError("the prompt is empty", hint="give at least one token id")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ShapeError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})")
        if max_new_tokens < 1:
            raise ShapeError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if not 0 <= start < len(tokens):
            raise ShapeError(f"start {start} is not a position of the {len(tokens)} tokens given")
        if len(tokens) + max_new_tokens > self.max_seq:
            raise ShapeError(f"{len(tokens)} prompt tokens and {max_new_tokens} new ones need "
                             f"{len(tokens) + max_new_tokens} positions; the engine's KV cache has {self.max_seq}",
                             hint="generate fewer tokens, or build the engine with a larger max_seq")
        if temperature < 0 or not 0 < top_p <= 1:
            raise MdslError(f"temperature must be >= 0 and top_p in (0, 1]; got {temperature} and {top_p}")
        if self.world > 1 and temperature > 0 and top_p < 1:
            raise MdslError(f"nucleus sampling (top_p {top_p}) is not implemented for tensor parallelism: each "
                            f"rank holds 1/{self.world} of the logits",
                            hint="use greedy decoding or temperature sampling (top_p=1) with --tp, or one GPU")

    def last_logits(self) -> np.ndarray:
        """The logits of the last step run (float32 [vocab], rounded to the model's dtype as transformers
        rounds them; under tensor parallelism this rank's vocabulary shard, ids rank * vocab onwards)."""
        return self._copy_out(self._logits, self.shape.vocab, np.float32)

    def close(self) -> None:
        """Free the device memory and unload the kernel (also done when the engine is collected: `release`)."""
        self._arrays, self._keep = [], []
        if getattr(self, "_module_handle", None) is not None and driver is not None:
            driver.cuModuleUnload(self._module_handle)
            self._module_handle = None

    def __del__(self):
        self._arrays, self._keep = [], []   # (each DeviceArray queues its own free)
        if getattr(self, "_module_handle", None) is not None and driver is not None:
            release(functools.partial(driver.cuModuleUnload, self._module_handle))
            self._module_handle = None


def compile_model(model_fn: ModelFunction, config: ModelConfig, weights, *, max_seq: Optional[int] = None,
                  device: int = 0, eos_token_ids: Sequence[int] = ()) -> MegakernelEngine:
    """An engine for an `@mdsl.model` step function: `weights` a checkpoint folder or name -> array. The task
    tables are lowered from its traced graph by the layer ops' rules; the first op the device cannot run is
    refused, with its line in the step function, before a GPU is needed. A last op `sample`'s settings become
    generate's defaults."""
    from mdsl.megakernel.modelgraph.checkpoint import load_weights

    positions = int(max_seq or min(config.max_positions, DEFAULT_MAX_SEQ))
    graph = trace_at(model_fn, config, positions)
    # the lowering on one worker: what the device cannot run is refused here, on any machine
    device_plan(config, graph, workers=1, max_seq=positions, options=MegakernelOptions())
    _require_gpu()
    if isinstance(weights, (str, os.PathLike)):
        weights = load_weights(graph, os.fspath(weights))
    engine = MegakernelEngine(config, weights, max_seq=positions, device=device, eos_token_ids=eos_token_ids,
                              model=model_fn)
    last = graph.nodes[-1]
    if last.op == "sample":
        engine.sampling = {k: last.attr_dict[k] for k in ("temperature", "top_p", "seed")}
    return engine


def _require_gpu() -> None:
    if not runtime.has_gpu():
        raise NoGPUError("running the megakernel needs an NVIDIA GPU and its driver; none was found on this machine",
                         hint=_NO_GPU_HINT)

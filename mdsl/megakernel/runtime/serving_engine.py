"""The serving kernel's host side: its tables and source for a model and a ServingShape, its device memory (the
weights in the model's dtype, the paged KV pools, the step rows' buffers, the protocol's device region, the
scheduler's workspace and the step's work region), its parameter block, and its launches.

The kernel stays resident: one launch runs steps until the step boundary stops it (the host's shutdown word with
nothing admitted or queued, an error, or the launch's last step). A launch runs at most `steps_per_launch` steps,
so that no event's threshold, producers * (step + 1), passes its 32-bit counter; its last step boundary ends the
previous step (tokens streamed) and begins none, and the host launches again with the counters reset: the
requests, pages and pools live in device memory across launches.

`dry_run=True` builds everything but on a recorder of allocations instead of the GPU (no driver call): the tests
check the parameter block's pointers and the buffers' sizes against ServingPlan.region, the protocol's regions,
the scheduler's workspace and ServingPlan.activations without a GPU.
"""
from __future__ import annotations

import ctypes
from typing import Mapping, Optional

import attrs
import numpy as np

from mdsl.errors import MdslError, ShapeError
from mdsl.ir.dtypes import f32, i32
from mdsl.megakernel.modelgraph.model import ModelGraph
from mdsl.megakernel.modelgraph.model_config import ModelConfig
from mdsl.megakernel.runtime.kernel_source import BLOCK_THREADS, KERNEL_NAME, PARAMS, PROFILE_WORDS, SERVE_PARAMS
from mdsl.megakernel.runtime.profile import TaskRecord
from mdsl.megakernel.runtime.serving_plan import ServingPlan, check_serving_plan, plan_serving
from mdsl.megakernel.runtime.serving_source import PROFILE_STEPS, generate_serving_source
from mdsl.megakernel.runtime.shape import KERNEL_WEIGHTS, LAYER_WEIGHTS, QKV_BIASES, decoder_shape, rope_tables
from mdsl.serving.protocol import FREE, ServingShape, device_region, kv_pool_shape
from mdsl.serving.scheduler import workspace_bytes

# sync.cuh's and serve.cuh's state words: the step boundary's waits for the host and its error, the stop step, a bad
# token seen, the watchdog's report (task + 1, step, event, count, need), and the launch's end at its last step
STATE_WORDS = 12
STATE_IDLE, STATE_SERVE_ERROR, STATE_STOP, STATE_BAD_TOKEN, STATE_LAUNCH_END = 0, 1, 2, 5, 11
STATE_PROFILE = 3            # the host's: nonzero while the tasks are profiled (serve.cuh)
STATE_STUCK = slice(6, 11)
NO_STOP = 2**31 - 1
HOST_STOP = -2               # the host's stop: every worker leaves at its next wait
ERROR_BAD_LOGITS = 16        # serve.cuh's: a sampling row's logits had no maximum


def steps_per_launch(plan: ServingPlan) -> int:
    """The steps one launch runs at most: every event's and append counter's threshold for its last step within 32
    bits (at least 2: a launch's last step boundary begins no step)."""
    most = max([e.per_step for e in plan.events] + [plan.append_tiles(g) for g in range(plan.shape.kv_heads)])
    return max(2, min(2**31 - 1, (2**32 - 1) // most))


class Params(ctypes.Structure):
    """device.cu's Params with the SERVE section's fields (kernel_source.PARAMS, SERVE_PARAMS)."""

    _fields_ = [(name, ctypes.c_int64 if c_type == "long long" else ctypes.c_double if c_type == "double"
                 else ctypes.c_uint64) for c_type, name in PARAMS + SERVE_PARAMS]


@attrs.frozen
class Allocation:
    name: str
    nbytes: int
    address: int


class Recorder:
    """A dry run's device memory: allocations recorded, addresses numbered in allocation order, and the values
    uploaded (`uploads`: name -> the host array)."""

    def __init__(self):
        self.allocations: list = []
        self.uploads: dict = {}
        self._next = 1 << 32

    def _allocate(self, name: str, nbytes: int) -> int:
        address = self._next
        self._next += -(-max(1, nbytes) // 256) * 256
        self.allocations.append(Allocation(name, int(nbytes), address))
        return address

    def zeros(self, name: str, nbytes: int) -> int:
        return self._allocate(name, nbytes)

    def upload(self, name: str, values: np.ndarray, dtype) -> int:
        self.uploads[name] = values
        return self._allocate(name, int(np.prod(values.shape)) * dtype.itemsize)

    def copy_in(self, address: int, values: np.ndarray, stream=None) -> None:
        pass


class DeviceMemory(Recorder):
    """GPU memory (DeviceArrays, kept alive here); the same record of allocations as a dry run's."""

    def __init__(self, device: int):
        super().__init__()
        self.device, self.arrays = device, []

    def _array(self, name: str, array) -> int:
        self.arrays.append(array)
        self.allocations.append(Allocation(name, array.nbytes, array.ptr))
        return array.ptr

    def zeros(self, name: str, nbytes: int) -> int:
        from mdsl.gpu.arrays import DeviceArray
        from mdsl.gpu.driver import check, cu_stream, driver

        array = DeviceArray((max(1, -(-nbytes // 4)),), i32, device=self.device)   # (whole words)
        check(driver.cuMemsetD8Async(array.ptr, 0, array.nbytes, cu_stream(array.stream)), "cuMemsetD8Async")
        return self._array(name, array)

    def upload(self, name: str, values: np.ndarray, dtype) -> int:
        from mdsl.gpu.arrays import DeviceArray

        return self._array(name, DeviceArray.from_numpy(values, dtype, device=self.device))

    def copy_in(self, address: int, values: np.ndarray, stream=None) -> None:
        from mdsl.gpu.driver import check, cu_stream, driver

        values = np.ascontiguousarray(values)
        handle = cu_stream(0) if stream is None else stream
        check(driver.cuMemcpyHtoDAsync(address, values.ctypes.data, values.nbytes, handle), "cuMemcpyHtoDAsync")
        check(driver.cuStreamSynchronize(handle), "cuStreamSynchronize")


class ServingKernel:
    """The serving kernel of a model (config, its traced graph and weights by the graph's names, numpy float32
    values, uploaded in the model's dtype) for `serving`'s shape, on `workers` worker blocks (default: the GPU's SM
    count), its host region at `host_region` (the device's address of the protocol's host region: pinned and
    mapped). `dry_run`: no GPU; the memory is recorded (`memory.allocations`) and the parameter block holds their
    stand-in addresses."""

    def __init__(self, config: ModelConfig, graph: ModelGraph, weights: Mapping, serving: ServingShape, *,
                 host_region: int, workers: Optional[int] = None, device: int = 0, dry_run: bool = False):
        self.config, self.serving, self.device, self.dry_run = config, serving, device, dry_run
        self.shape = decoder_shape(config)
        if workers is None:
            if dry_run:
                raise MdslError("a dry run needs its worker count", hint="pass workers=, e.g. 132 for an H200")
            workers = _sm_count(device)
        self.plan: ServingPlan = plan_serving(graph, self.shape, serving, workers=workers)
        check_serving_plan(self.plan)
        self.source = generate_serving_source(self.plan)
        self.steps_per_launch = steps_per_launch(self.plan)
        self.memory = Recorder() if dry_run else DeviceMemory(device)
        self.params = Params()
        self.params.host = host_region
        if not dry_run:
            self._load()
        self._upload_weights(weights)
        self._allocate()

    # ---- memory

    def _upload_weights(self, weights: Mapping) -> None:
        """The weights the plan binds to the device's slots, each uploaded once by its name in the graph (a slot
        filled by part of a weight points into its rows); the per-layer pointer table (sync.cuh's LayerWeights:
        the weights, the layer's key and value pools, then the q|k|v biases where the model has them)."""
        s, p, plan = self.shape, self.params, self.plan.base
        uploaded: dict = {}
        slots = {(w.slot, w.layer): w for w in plan.weights}

        def pointer(slot: str, layer: Optional[int] = None) -> int:
            bound = slots.get((slot, layer))
            if bound is None:   # (a slot the model leaves empty: null)
                return 0
            if bound.name not in uploaded:
                if bound.name not in weights:
                    raise ShapeError(f"the weights have no tensor {bound.name} (expected {list(bound.shape)})")
                values = np.asarray(weights[bound.name], np.float32)
                if tuple(values.shape) != tuple(bound.shape):
                    raise ShapeError(f"weight {bound.name} has shape {list(values.shape)}, expected "
                                     f"{list(bound.shape)}")
                uploaded[bound.name] = self.memory.upload(bound.name, values, s.dtype)
            return uploaded[bound.name] + bound.offset(s.dtype.itemsize)

        p.embed, p.final_norm, p.lm_head = (pointer(slot) for slot in KERNEL_WEIGHTS)
        pool = int(np.prod(kv_pool_shape(self.serving, s.kv_heads, s.head_dim))) * s.dtype.itemsize   # a layer's
        self.pools = tuple(self.memory.zeros(name, s.layers * pool) for name in ("k_pool", "v_pool"))
        biased = any(w.slot in QKV_BIASES for w in plan.weights)
        rows = [[pointer(w, layer) for w in LAYER_WEIGHTS] + [base + layer * pool for base in self.pools] +
                ([pointer(b, layer) for b in QKV_BIASES] if biased else []) for layer in range(s.layers)]
        p.layers = self.memory.upload("layers", np.array(rows, dtype=np.uint64).view(np.int32), i32)

    def _allocate(self) -> None:
        s, plan, p, memory = self.shape, self.plan, self.params, self.memory
        tasks, waits, signals = plan.tables()
        p.tasks, p.waits, p.signals = (memory.upload(name, t.reshape(-1), i32)
                                       for name, t in (("tasks", tasks), ("waits", waits), ("signals", signals)))
        p.events = memory.zeros("events", 4 * len(plan.events))
        p.state = memory.zeros("state", 4 * STATE_WORDS)
        cos, sin = rope_tables(s, self.serving.max_seq)
        p.rope_cos, p.rope_sin = (memory.upload(name, t.reshape(-1), f32) for name, t in (("rope_cos", cos),
                                                                                      ("rope_sin", sin)))
        sizes = plan.activations()
        for name, field in (("h", "hs"), ("mid", "mids"), ("qkv", "qkvs"), ("attn", "attns"), ("act", "acts")):
            setattr(p, field, memory.zeros(name, int(np.prod(sizes[name])) * s.dtype.itemsize))
        p.parts = memory.zeros("parts", int(np.prod(sizes["parts"])) * 4)
        p.logits = memory.zeros("logits", int(np.prod(sizes["logits"])) * 4)
        best = int(np.prod(sizes["best"][:2]))
        p.best_value, p.best_index = memory.zeros("best_value", 4 * best), memory.zeros("best_index", 4 * best)
        p.device_state = memory.upload("device_state", self.initial_device_state().view(np.int32), i32)
        p.workspace = memory.zeros("workspace", workspace_bytes(self.serving))
        p.serve = memory.zeros("serve", plan.region().size)
        p.profile = memory.zeros("profile", 8 * PROFILE_WORDS * PROFILE_STEPS * len(plan.tasks))
        p.num_steps = self.steps_per_launch

    def initial_device_state(self) -> np.ndarray:
        """The protocol's device region before the first step (as the CPU device makes it): every entry free, no
        page in a page table, the free stack holding every page with page 0 on top."""
        region = device_region(self.serving)
        buffer = region.allocate()
        views = region.views(buffer)
        pool = views["pool"]
        pool["num_pages"], pool["page_size"], pool["free_count"] = (self.serving.num_pages, self.serving.page_size,
                                                                    self.serving.num_pages)
        views["free_pages"][:] = np.arange(self.serving.num_pages, dtype=np.int32)[::-1]
        views["page_table"][:] = -1
        views["entries"]["state"] = FREE
        return buffer

    def launch_words(self) -> tuple:
        """(address, values) the host writes before each launch: the events at their initial counts, the state
        words (no stop), the step's work region zeroed (the append counters count from 0 in every launch)."""
        state = np.zeros(STATE_WORDS, np.int32)
        state[STATE_STOP] = NO_STOP
        p = self.params
        return ((p.events, self.plan.initial_events()), (p.state, state),
                (p.serve, np.zeros(self.plan.region().size, np.uint8)))

    def profile_records(self, ring: np.ndarray) -> dict:
        """The profile's ring (the `profile` buffer's bytes) as {step of its launch: [TaskRecord]}, each record's
        index step * tasks + task (mdsl.megakernel.runtime.profile's), only the steps whose every task was
        recorded."""
        words = ring.view(np.uint64).reshape(-1, tasks := len(self.plan.tasks), PROFILE_WORDS)
        steps: dict = {}
        for slot in words:   # (a step of the ring: complete where every task has its step, taken and done times)
            step = slot[0, 0] >> np.uint64(32)
            if step and (slot[:, 0] >> np.uint64(32) == step).all() and slot[:, 1].all() and slot[:, 4].all():
                step = int(step) - 1
                steps[step] = [TaskRecord(step * tasks + k, int(rec[0] & 0xFFFFFFFF), int(rec[1]), int(rec[2]),
                                          int(rec[3]), int(rec[4]), tuple(int(m) for m in rec[5:]))
                               for k, rec in enumerate(slot.tolist())]
        return dict(sorted(steps.items()))

    def layout(self) -> dict:
        """name -> Allocation: every buffer the kernel points into."""
        return {a.name: a for a in self.memory.allocations}

    # ---- the GPU

    def _load(self) -> None:
        from mdsl.backend.cuda import runtime
        from mdsl.gpu.driver import CudaError, check, driver, get_device

        dev = get_device(self.device)
        self.module = runtime.compile_source(self.source.text, runtime.target_arch(self.device))
        self._module = check(driver.cuModuleLoadData(self.module.cubin), "loading the serving megakernel")
        self.function = check(driver.cuModuleGetFunction(self._module, KERNEL_NAME.encode()), "cuModuleGetFunction")
        local = check(driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                                                self.function), "cuFuncGetAttribute")
        if local:
            raise CudaError(f"the serving megakernel spills registers ({local} bytes of local memory per thread)")
        if self.source.smem_bytes > dev.max_smem:
            raise CudaError(f"the serving megakernel needs {self.source.smem_bytes} bytes of shared memory per block; "
                            f"the device allows {dev.max_smem}")
        check(driver.cuFuncSetAttribute(self.function,
                                        driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        self.source.smem_bytes), "allowing the serving megakernel its shared memory")
        per_sm = check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, BLOCK_THREADS,
                                                                           self.source.smem_bytes),
                       "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        if per_sm < 1:
            raise CudaError("a serving megakernel worker block does not fit on an SM")

    def launch(self, stream) -> None:
        """Reset the per-launch words, then launch the kernel on `stream` (it returns at once; the kernel runs until
        its step boundary stops it)."""
        from mdsl.gpu.driver import check, driver

        check(driver.cuCtxSynchronize(), "cuCtxSynchronize")   # (the uploads, on the default stream)
        for address, values in self.launch_words():
            self.memory.copy_in(address, values, stream)
        self._arguments = (ctypes.c_void_p * 1)(ctypes.addressof(self.params))
        check(driver.cuLaunchCooperativeKernel(self.function, self.plan.workers, 1, 1, BLOCK_THREADS, 1, 1,
                                               self.source.smem_bytes, stream, ctypes.addressof(self._arguments)),
              "launching the serving megakernel")

    def copy_out(self, address: int, nbytes: int, stream) -> np.ndarray:
        from mdsl.gpu.driver import check, driver

        out = np.empty(nbytes, np.uint8)
        check(driver.cuMemcpyDtoHAsync(out.ctypes.data, address, nbytes, stream), "cuMemcpyDtoHAsync")
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return out

    def close(self) -> None:
        from mdsl.gpu.driver import driver

        if getattr(self, "_module", None) is not None and driver is not None:
            driver.cuModuleUnload(self._module)
            self._module = None
        if isinstance(self.memory, DeviceMemory):
            self.memory.arrays = []


def _sm_count(device: int) -> int:
    from mdsl.gpu.driver import check, driver, get_device

    return int(check(driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                                 get_device(device).handle), "reading the SM count"))

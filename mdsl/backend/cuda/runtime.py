"""The GPU runtime: mdsl's device arrays, adapters for other libraries' GPU arrays, and executables that
launch a compiled mugraph's kernels on a stream.

Everything talks to the CUDA driver through cuda.bindings, and nothing touches the driver before
`has_gpu()` has said there is one: on a machine without a driver, a failed cuda.core call can make
every later driver call in the process hang (toolchain.md, recipe C).

Host launch overhead matters (a decode step is many small kernels): an `Executable` prepares once
whatever does not change between calls (kernel handles, launch configurations, one block of parameter
pointers per launch, intermediate buffers), so a call reads its arguments' pointers, writes them into
those blocks and calls cuLaunchKernel per kernel.

Arguments: torch tensors, anything with `__cuda_array_interface__` (v2/v3) or a CUDA `__dlpack__`,
and `DeviceArray`s; each must be a compact row-major array on the GPU whose address is 16-byte aligned.
"""
from __future__ import annotations

import ctypes
import functools
import sys
import threading
from typing import NamedTuple, Optional, Sequence

import attrs
import numpy as np

from mdsl.backend.cuda import dlpack
from mdsl.errors import DTypeError, MdslError, ShapeError
from mdsl.ir.dtypes import DType, bf16, dtype_from_name, dtype_of_array, f16, f32, i32
from mdsl.ir.graph import KernelGraph
from mdsl.ir.types import TensorType

try:
    from cuda.bindings import driver
except ImportError:  # without cuda-python there is no GPU path; has_gpu() says so
    driver = None

ALIGNMENT = 16            # bytes: the generated kernels load and store 16-byte vectors
_STATIC_SMEM_LIMIT = 48 * 1024   # dynamic shared memory beyond this needs the kernel's opt-in

_NO_GPU_HINT = ("tracing, kernel.optimize() (search and verification) and compiling CUDA source to cubins all "
                "work without a GPU; pass numpy arrays to run the kernel on the CPU (reference interpreter)")


class NoGPUError(MdslError):
    """Running on the GPU was asked for, but this machine has no usable NVIDIA GPU and driver."""


class ArgumentError(MdslError):
    """An argument a GPU kernel cannot take: in host memory, on another GPU, not compact row-major,
    misaligned, or the wrong number of them."""


class CudaError(MdslError):
    """A CUDA driver call failed, or a compiled program does not fit the device."""


# ---------------------------------------------------------------------------------------------
# the driver

@functools.cache
def has_gpu() -> bool:
    """Whether a CUDA driver and at least one GPU are present. Never raises; checked once."""
    if driver is None:
        return False
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, count = driver.cuDeviceGetCount()
        return err == driver.CUresult.CUDA_SUCCESS and count > 0
    except Exception:  # DynamicLibNotFoundError where there is no libcuda
        return False


def require_gpu(what: str = "running a kernel on GPU arrays") -> None:
    if not has_gpu():
        raise NoGPUError(f"{what} needs an NVIDIA GPU and its driver, and none was found on this machine",
                         hint=_NO_GPU_HINT)


def _check(result: tuple, what: str):
    """The value(s) of a cuda.bindings call, or a CudaError naming the call and the driver's error."""
    err = result[0]
    if err:
        raise CudaError(f"{what} failed: {_error_text(err)}")
    return result[1] if len(result) == 2 else result[1:] or None


def _error_text(err) -> str:
    _, name = driver.cuGetErrorName(err)
    _, text = driver.cuGetErrorString(err)
    decode = lambda b: b.decode() if isinstance(b, bytes) else str(b)  # noqa: E731
    return f"{decode(name)} ({decode(text)})"


_THREAD = threading.local()   # .device: the ordinal whose context is current on this thread


class _Device:
    """One GPU: its primary context (the one torch uses too) and what launches need to know of it."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.handle = _check(driver.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        self.context = _check(driver.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self.activate()
        attr = driver.CUdevice_attribute
        self.capability = (self._attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                           self._attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.max_smem = self._attribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        self.l2_bytes = self._attribute(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        # the stream-ordered pool keeps freed memory for reuse instead of returning it at every sync
        pool = _check(driver.cuDeviceGetDefaultMemPool(self.handle), "cuDeviceGetDefaultMemPool")
        _check(driver.cuMemPoolSetAttribute(pool, driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                            driver.cuuint64_t(2**64 - 1)), "cuMemPoolSetAttribute")
        self.event = _check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def _attribute(self, attribute) -> int:
        return _check(driver.cuDeviceGetAttribute(attribute, self.handle), f"cuDeviceGetAttribute({attribute.name})")

    def activate(self) -> None:
        if getattr(_THREAD, "device", None) != self.ordinal:
            _check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
            _THREAD.device = self.ordinal

    def order(self, waiter: int, signaller: int) -> None:
        """Make stream `waiter` wait for the work queued so far on stream `signaller`."""
        _check(driver.cuEventRecord(self.event, _cu_stream(signaller)), "cuEventRecord")
        _check(driver.cuStreamWaitEvent(_cu_stream(waiter), self.event, 0), "cuStreamWaitEvent")


_DEVICES: dict = {}
_DEVICES_LOCK = threading.Lock()


def _device(ordinal: int = 0) -> _Device:
    device = _DEVICES.get(ordinal)
    if device is None:
        require_gpu()
        with _DEVICES_LOCK:
            device = _DEVICES.get(ordinal) or _DEVICES.setdefault(ordinal, _Device(ordinal))
    device.activate()
    return device


@functools.cache
def l2_bytes(device: int = 0) -> int:
    """The GPU's L2 cache size in bytes."""
    require_gpu("reading the L2 cache size")
    return _device(device).l2_bytes


def target_arch(device: int = 0) -> str:
    """The arch to compile for: sm_90a on compute capability 9.0 (Hopper features), sm_XY on others,
    and sm_90a (the H200) where there is no GPU."""
    if not has_gpu():
        return "sm_90a"
    major, minor = _device(device).capability
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


# ---------------------------------------------------------------------------------------------
# streams

_STREAMS: dict = {}   # handle -> CUstream, so that a launch does not build one


def _cu_stream(handle: int):
    stream = _STREAMS.get(handle)
    if stream is None:
        if len(_STREAMS) > 1024:  # streams come and go; keep the cache small
            _STREAMS.clear()
        stream = _STREAMS[handle] = driver.CUstream(handle)
    return stream


def stream_handle(stream) -> int:
    """The CUstream handle of `stream`: None (the legacy default stream), an int handle, a cuda.core
    Stream (`__cuda_stream__`), a torch or CuPy stream, or a cuda.bindings CUstream."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    for attribute in ("cuda_stream", "ptr"):   # torch.cuda.Stream, cupy.cuda.Stream
        handle = getattr(stream, attribute, None)
        if isinstance(handle, int):
            return handle
    if driver is not None and isinstance(stream, driver.CUstream):
        return int(stream)
    raise ArgumentError(f"cannot use a {type(stream).__name__} as a CUDA stream",
                        hint="pass an int handle, a torch.cuda.Stream, a cuda.core Stream or a CUstream")


def _producer_stream(value: Optional[int]) -> Optional[int]:
    """The stream `__cuda_array_interface__` v3 says the data is ready on, as a handle (its 1 is the
    legacy default stream, 2 the per-thread one); None: ready everywhere."""
    return None if value is None else 0 if value == 1 else value


def _consumer_stream(value: Optional[int]) -> Optional[int]:
    """The stream a DLPack consumer will use the data on, as a handle (None and 1 are the legacy default
    stream); None for -1, which asks for no ordering."""
    return None if value == -1 else 0 if value in (None, 1) else value


def _torch_stream(device: int) -> int:
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton uses: no Stream object made
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


# ---------------------------------------------------------------------------------------------
# arguments

class View(NamedTuple):
    """A GPU array as a kernel sees it."""

    ptr: int
    shape: tuple
    dtype: DType
    device: int


def is_torch_tensor(value) -> bool:
    return type(value).__module__.startswith("torch")


_TORCH_DTYPES: dict = {}   # torch.dtype -> DType, filled as dtypes are met (torch is never imported here)


def _torch_dtype(dtype, what: str) -> DType:
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        try:
            found = _TORCH_DTYPES[dtype] = dtype_from_name(str(dtype).removeprefix("torch."))
        except DTypeError as e:
            raise DTypeError(f"{what}: {e.message}", hint=e.hint) from None
    return found


def _torch_view(t, what: str) -> View:
    if not t.is_cuda:
        raise ArgumentError(f"{what} is a torch tensor on the CPU, but this kernel runs on the GPU",
                            hint="move it with .cuda(), or pass only CPU arrays to run the reference interpreter")
    dtype = _torch_dtype(t.dtype, what)
    if not t.is_contiguous():
        raise ArgumentError(f"{what} is not contiguous (strides {tuple(t.stride())} for shape {tuple(t.shape)})",
                            hint="pass x.contiguous(): mdsl kernels read compact row-major arrays")
    return View(_aligned(t.data_ptr(), what), tuple(t.shape), dtype, t.get_device())


_TYPESTRS = {"f2": f16, "f4": f32, "i4": i32, "V2": bf16}   # V2: bf16, which has no typestr of its own


def _cai_view(value, what: str, stream: int) -> View:
    cai = value.__cuda_array_interface__
    shape = tuple(cai["shape"])
    typestr = cai["typestr"]
    dtype = _TYPESTRS.get(typestr.lstrip("<|"))
    if dtype is None or typestr[0] == ">":
        raise DTypeError(f"{what} has element type {typestr!r}", hint="pass f16, bf16 or f32 arrays (i32 for indices)")
    strides = cai.get("strides")
    if strides is not None and (any(s % dtype.itemsize for s in strides)
                                or not dlpack.is_compact(shape, [s // dtype.itemsize for s in strides])):
        raise ArgumentError(f"{what} is not compact row-major (strides {tuple(strides)} bytes for shape {shape})",
                            hint="pass a contiguous copy: mdsl kernels read compact row-major arrays")
    ptr = _aligned(cai["data"][0] or 0, what)
    device = _pointer_device(ptr, what) if ptr else (getattr(_THREAD, "device", None) or 0)
    producer = _producer_stream(cai.get("stream"))
    if producer is not None and producer != stream:  # v3: the data is ready on the producer's stream only
        _device(device).order(stream, producer)
    return View(ptr, shape, dtype, device)


def _pointer_device(ptr: int, what: str) -> int:
    err, ordinal = driver.cuPointerGetAttribute(
        driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    if err:
        raise ArgumentError(f"{what}: its __cuda_array_interface__ pointer {ptr:#x} is not GPU memory",
                            hint="pass an array allocated on the GPU")
    return ordinal


_DL_DTYPES = {(dlpack.FLOAT, 16): f16, (dlpack.BFLOAT, 16): bf16, (dlpack.FLOAT, 32): f32, (dlpack.INT, 32): i32}


def _dlpack_view(value, what: str, stream: int) -> View:
    device_type, device_id = value.__dlpack_device__()
    if device_type not in (dlpack.KDL_CUDA, dlpack.KDL_CUDA_MANAGED):
        raise ArgumentError(f"{what} is a {type(value).__name__} in host memory (DLPack device type {device_type}), "
                            "but this kernel runs on the GPU",
                            hint="copy it to the GPU (mdsl.backend.cuda.runtime.DeviceArray.from_numpy, or "
                                 "torch's .cuda()), or pass only host arrays to run the reference interpreter")
    consumer = 1 if stream == 0 else stream   # DLPack spells the legacy default stream 1
    try:
        capsule = value.__dlpack__(stream=consumer)
    except TypeError:  # a producer from before the stream keyword
        capsule = value.__dlpack__()
    t = dlpack.read(capsule)
    dtype = _DL_DTYPES.get(t.dtype[:2]) if t.dtype[2] == 1 else None
    if dtype is None:
        raise DTypeError(f"{what} has DLPack element type (code {t.dtype[0]}, {t.dtype[1]} bits, {t.dtype[2]} lanes)",
                         hint="pass f16, bf16 or f32 arrays (i32 for indices)")
    if t.strides is not None and not dlpack.is_compact(t.shape, t.strides):
        raise ArgumentError(f"{what} is not compact row-major (strides {t.strides} for shape {t.shape})",
                            hint="pass a contiguous copy: mdsl kernels read compact row-major arrays")
    return View(_aligned(t.data, what), t.shape, dtype, device_id)


def _aligned(ptr: int, what: str) -> int:
    if ptr % ALIGNMENT:
        raise ArgumentError(f"{what} starts at address {ptr:#x}, which is not {ALIGNMENT}-byte aligned",
                            hint="pass a copy (x.clone() / x.copy()): a view that starts inside another "
                                 "array is misaligned")
    return ptr


def device_view(value, what: str, stream: int = 0) -> View:
    """`value` as a GPU array, or an ArgumentError / DTypeError saying why it cannot be one. `stream`
    is the stream the value will be used on (producers that say where their data is ready are
    ordered before it)."""
    if type(value) is DeviceArray:
        if value.stream != stream:   # its data is ready on its own stream
            _device(value.device).order(stream, value.stream)
        return View(value.ptr, value.shape, value.dtype, value.device)
    if is_torch_tensor(value):
        return _torch_view(value, what)
    if hasattr(value, "__cuda_array_interface__"):
        return _cai_view(value, what, stream)
    if hasattr(value, "__dlpack__"):
        return _dlpack_view(value, what, stream)
    raise ArgumentError(f"{what} is a {type(value).__name__}, not a GPU array",
                        hint="pass torch CUDA tensors, DeviceArrays, or arrays with __cuda_array_interface__ or "
                             "__dlpack__ on the GPU")


def launch_stream(values: Sequence, stream=None) -> int:
    """The stream a call runs on: the one given; else torch's current stream when torch tensors are
    passed (so the kernels are ordered with the user's torch work); else the legacy default stream."""
    if stream is not None:
        return stream_handle(stream)
    for value in values:
        if is_torch_tensor(value) and value.is_cuda:
            return _torch_stream(value.get_device())
    return 0


# ---------------------------------------------------------------------------------------------
# mdsl's own device arrays

_BF16_BITS = np.uint16


def _to_device_bits(array, dtype: DType) -> np.ndarray:
    """Host data as the device stores `dtype`; bf16 is rounded to nearest even from float32."""
    if dtype is not bf16:
        return np.ascontiguousarray(array, dtype=dtype.numpy_name)
    x = np.ascontiguousarray(array, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(_BF16_BITS)
    return np.where(np.isnan(x), _BF16_BITS(0x7FC0), rounded)   # a NaN's carry would make it inf


def _from_device_bits(bits: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is bf16:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits


def _host_dtype(dtype: DType):
    return _BF16_BITS if dtype is bf16 else np.dtype(dtype.numpy_name)


_CAI_TYPESTRS = {"f16": "<f2", "bf16": "<V2", "f32": "<f4", "i32": "<i4"}
_DL_CODES = {"f16": (dlpack.FLOAT, 16, 1), "bf16": (dlpack.BFLOAT, 16, 1), "f32": (dlpack.FLOAT, 32, 1),
             "i32": (dlpack.INT, 32, 1)}


class DeviceArray:
    """A compact row-major array in GPU memory, allocated from the device's stream-ordered pool.

    It needs no torch: `DeviceArray.from_numpy(x)` / `.to_numpy()` move data, and torch, CuPy and
    others can use one through `__dlpack__` (any dtype) or `__cuda_array_interface__` (bf16 shows there
    as opaque 2-byte elements, typestr '<V2'). `stream` is the stream its pending work is ordered on.
    """

    is_cuda = True   # duck-typed like a torch CUDA tensor, so frontends tell it from host arrays cheaply

    def __init__(self, shape: Sequence[int], dtype: DType, *, stream=None, device: int = 0):
        """An uninitialised array (see also `from_numpy`)."""
        self.ptr = 0
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.device = device
        self.stream = stream_handle(stream)
        self.nbytes = TensorType(self.shape, dtype).nbytes
        _device(device)
        if self.nbytes:
            self.ptr = int(_check(driver.cuMemAllocAsync(self.nbytes, _cu_stream(self.stream)), "cuMemAllocAsync"))

    @classmethod
    def from_numpy(cls, array, dtype: Optional[DType] = None, *, stream=None, device: int = 0) -> "DeviceArray":
        """A copy of a host array; `dtype` defaults to the array's (float32 data becomes bf16 when asked)."""
        array = np.asarray(array)
        dtype = dtype if dtype is not None else dtype_of_array(array)
        out = cls(array.shape, dtype, stream=stream, device=device)
        bits = _to_device_bits(array, dtype)
        if out.nbytes:  # from pageable memory: returns once `bits` is staged, so it may be freed then
            _check(driver.cuMemcpyHtoDAsync(out.ptr, bits.ctypes.data, out.nbytes, _cu_stream(out.stream)),
                   "cuMemcpyHtoDAsync")
        return out

    def to_numpy(self) -> np.ndarray:
        """A host copy, once the work queued on the array's stream is done (bf16 comes back as float32)."""
        _device(self.device)
        bits = np.empty(self.shape, dtype=_host_dtype(self.dtype))
        if self.nbytes:
            _check(driver.cuMemcpyDtoHAsync(bits.ctypes.data, self.ptr, self.nbytes, _cu_stream(self.stream)),
                   "cuMemcpyDtoHAsync")
        _check(driver.cuStreamSynchronize(_cu_stream(self.stream)), "cuStreamSynchronize")
        return _from_device_bits(bits, self.dtype)

    @property
    def size(self) -> int:
        return TensorType(self.shape, self.dtype).numel

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": _CAI_TYPESTRS[self.dtype.name], "data": (self.ptr, False),
                "version": 3, "strides": None, "stream": self.stream or 1}

    def __dlpack_device__(self) -> tuple:
        return (dlpack.KDL_CUDA, self.device)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if copy:
            raise BufferError("a DeviceArray is exported without copying")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"a DeviceArray lives on CUDA device {self.device}, not on {tuple(dl_device)}")
        consumer = _consumer_stream(stream)
        if consumer is not None and consumer != self.stream:
            _device(self.device).order(consumer, self.stream)
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        return dlpack.export(self.ptr, self.shape, _DL_CODES[self.dtype.name], self.__dlpack_device__(), self,
                             versioned=versioned)

    def __repr__(self) -> str:
        return f"DeviceArray({self.dtype}[{', '.join(map(str, self.shape))}], device={self.device}, ptr={self.ptr:#x})"

    def __del__(self):
        if self.ptr and driver is not None:
            try:
                _check(driver.cuMemFreeAsync(self.ptr, _cu_stream(self.stream)), "cuMemFreeAsync")
            except Exception:  # the stream is gone, or the interpreter is shutting down: free synchronously
                try:
                    driver.cuMemFree(self.ptr)
                except Exception:
                    pass
            self.ptr = 0


# ---------------------------------------------------------------------------------------------
# where each value of a compiled program lives

@attrs.frozen
class BufferPlan:
    """How a program's values map onto memory. Values joined by aliases (views such as reshape) share
    one buffer; each buffer is a *slot* of the parameter block the launches point into.

    `bindings`: (slot, argument index) for slots that hold an argument's pointer (inputs first, then
    outputs). `scratch`: (slot, bytes) for intermediates, allocated once. `copies`: (destination,
    source argument index, bytes) for outputs whose value lives in another argument's buffer (an output
    that is an input, or a view of one, or the same value returned twice). `launch_slots`: per launch,
    the slot of each of its arguments."""

    slots: int
    bindings: tuple
    scratch: tuple
    copies: tuple
    launch_slots: tuple


def _value_types(graph: KernelGraph) -> dict:
    types = {v.name: v.type for v in graph.inputs}
    for node in graph.nodes:
        types.update((v.name, v.type) for v in node.outputs)
    return types


def plan_buffers(graph: KernelGraph, launches: Sequence, aliases: Sequence) -> BufferPlan:
    types = _value_types(graph)
    parent: dict = {}

    def find(name: str) -> str:
        if name not in types:
            raise ValueError(f"the CUDA program of {graph.name} names %{name}, which is not one of its values")
        while parent.get(name, name) != name:
            name = parent[name]
        return name

    for view, base in aliases:
        view_root, base_root = find(view), find(base)
        if types[view].nbytes != types[base].nbytes:
            raise ValueError(f"%{view} ({types[view]}) cannot alias %{base} ({types[base]}): their sizes differ")
        if view_root != base_root:
            parent[view_root] = base_root

    n_in = len(graph.inputs)
    home: dict = {}   # buffer (alias root) -> the argument whose memory it is
    for k, v in enumerate(graph.inputs):
        home.setdefault(find(v.name), k)
    copies = []
    for k, v in enumerate(graph.outputs):
        root = find(v.name)
        if root in home:
            copies.append((n_in + k, home[root], types[v.name].nbytes))
        else:
            home[root] = n_in + k

    slot_of: dict = {}
    bindings, scratch = [], []

    def slot(name: str) -> int:
        root = find(name)
        if root not in slot_of:
            slot_of[root] = len(slot_of)
            if root in home:
                bindings.append((slot_of[root], home[root]))
            else:
                size = max(t.nbytes for n, t in types.items() if find(n) == root)
                scratch.append((slot_of[root], size))
        return slot_of[root]

    launch_slots = tuple(tuple(slot(a) for a in launch.args) for launch in launches)
    return BufferPlan(len(slot_of), tuple(bindings), tuple(scratch), tuple(copies), launch_slots)


def _dim3(value) -> tuple:
    dims = (value,) if isinstance(value, int) else tuple(value)
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


# ---------------------------------------------------------------------------------------------
# executables

class Executable:
    """A compiled mugraph loaded on one GPU, ready to launch.

    `exe(inputs, outputs=None, stream=None)` checks every argument (count, shape, dtype, device,
    layout, alignment) before launching anything, runs the program's kernels in order on the stream,
    and returns the outputs: those passed in, or new ones (torch tensors when the inputs are torch
    tensors, DeviceArrays otherwise). `run_pointers` is the unchecked path for callers that manage
    memory themselves. Intermediate buffers are allocated once, so calls that overlap on different
    streams must use different Executables.
    """

    def __init__(self, program, module, *, device: int = 0):
        """`program`: a CudaProgram (source, launches, aliases, graph); `module`: its CompiledModule."""
        self._scratch: list = []
        self._module_handle = None
        self._dev = _device(device)
        self.device = device
        self.program = program
        self.module = module
        self.graph: KernelGraph = program.graph
        self.name = self.graph.name
        self.input_types = tuple(v.type for v in self.graph.inputs)
        self.output_types = tuple(v.type for v in self.graph.outputs)
        self._input_names = tuple(v.name for v in self.graph.inputs)
        # what errors call each argument, made once: a call formats nothing unless it fails
        self._input_labels = tuple(f"argument {n} of {self.name}" for n in self._input_names)
        self._output_labels = tuple(f"output {k} of {self.name}" for k in range(len(self.output_types)))
        self._lock = threading.Lock()
        self._torch_device = None
        plan = plan_buffers(self.graph, program.launches, program.aliases)
        self._bindings = plan.bindings
        self._copies = plan.copies
        self._ptrs = (ctypes.c_uint64 * max(1, plan.slots))()
        load = getattr(module, "load", None)   # a PTX module is JIT-compiled by the driver as it loads
        self._module_handle = load() if load is not None else \
            _check(driver.cuModuleLoadData(module.cubin), f"loading the cubin of {self.name}")
        self._param_blocks = []
        self._launches = tuple(self._prepare(launch, slots) for launch, slots in zip(program.launches,
                                                                                     plan.launch_slots))
        for slot, size in plan.scratch:
            self._ptrs[slot] = self._allocate_scratch(size)

    def _prepare(self, launch, slots: tuple) -> tuple:
        """The fixed arguments of cuLaunchKernel for one launch (everything but the stream)."""
        function = _check(driver.cuModuleGetFunction(self._module_handle, launch.name.encode()),
                          f"cuModuleGetFunction({launch.name})")
        grid, block, smem = _dim3(launch.grid), _dim3(launch.block), int(launch.smem_bytes)
        if smem > self._dev.max_smem:
            raise CudaError(f"kernel {launch.name} of {self.name} needs {smem} bytes of shared memory; the "
                            f"device allows {self._dev.max_smem}")
        if smem > _STATIC_SMEM_LIMIT:
            _check(driver.cuFuncSetAttribute(
                function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                f"allowing {launch.name} {smem} bytes of dynamic shared memory")
        base, width = ctypes.addressof(self._ptrs), ctypes.sizeof(ctypes.c_uint64)
        block_of_params = (ctypes.c_void_p * max(1, len(slots)))(*[base + width * s for s in slots])
        self._param_blocks.append(block_of_params)   # cuLaunchKernel reads it at each launch
        config = overlapping_launch(grid, block, smem) if getattr(launch, "overlap", False) else None
        return (function, *grid, *block, smem, ctypes.addressof(block_of_params) if slots else None, config)

    def _allocate_scratch(self, size: int) -> int:
        if not size:
            return 0
        ptr = int(_check(driver.cuMemAlloc(size), f"allocating {size} bytes for the intermediates of {self.name}"))
        self._scratch.append(ptr)
        # NaN in every float dtype: a kernel that reads what no kernel wrote shows in the results
        _check(driver.cuMemsetD8(ptr, 0xFF, size), "cuMemsetD8")
        return ptr

    # -- calls -----------------------------------------------------------------------------------

    def __call__(self, inputs: Sequence, outputs: Optional[Sequence] = None, stream=None) -> tuple:
        if len(inputs) != len(self.input_types):
            raise ArgumentError(f"{self.name} takes {len(self.input_types)} input(s), got {len(inputs)}",
                                hint=f"call it with ({', '.join(self._input_names)})")
        handle = launch_stream(inputs, stream)
        views = [device_view(x, label, handle) for x, label in zip(inputs, self._input_labels)]
        return self.launch_views(views, outputs, handle, torch_outputs=any(is_torch_tensor(x) for x in inputs))

    def launch_views(self, views: Sequence[View], outputs: Optional[Sequence], stream: int, *,
                     torch_outputs: bool = False, inputs_checked: bool = False) -> tuple:
        """Launch on arguments already adapted by `device_view` (the frontend's path, which looks the
        executable up by its inputs' shapes, dtypes and device, so that they are `inputs_checked`)."""
        if not inputs_checked:
            for view, want, label in zip(views, self.input_types, self._input_labels):
                self._check_view(view, want, label)
        if outputs is None:
            outputs = self._new_outputs(stream, torch_outputs)
            out_views = [device_view(o, "output", stream) for o in outputs]
        else:
            if len(outputs) != len(self.output_types):
                raise ArgumentError(f"{self.name} has {len(self.output_types)} output(s), got {len(outputs)} to "
                                    "write into", hint="pass one array per output, or none to have them allocated")
            out_views = [device_view(o, label, stream) for o, label in zip(outputs, self._output_labels)]
            for view, want, label in zip(out_views, self.output_types, self._output_labels):
                self._check_view(view, want, label)
        self.run_pointers([v.ptr for v in views], [v.ptr for v in out_views], stream)
        for o in outputs:
            if type(o) is DeviceArray:
                o.stream = stream   # its contents are ready once this stream gets there
        return tuple(outputs)

    def _check_view(self, view: View, want: TensorType, what: str) -> None:
        if view.shape != want.shape:
            raise ShapeError(f"{what} has shape {list(view.shape)}, but this executable was compiled "
                             f"for {list(want.shape)}",
                             hint="an mdsl.kernel compiles a new executable for new shapes; call it rather than "
                                  "an Executable built for other shapes")
        if view.dtype is not want.dtype:
            raise DTypeError(f"{what} is {view.dtype.long_name}, but this executable was compiled for "
                             f"{want.dtype.long_name}", hint=f"convert it to {want.dtype.long_name} first")
        if view.device != self.device:
            raise ArgumentError(f"{what} is on GPU {view.device}, but this executable is loaded on "
                                f"GPU {self.device}", hint="move every argument to the same GPU")

    def _new_outputs(self, stream: int, torch_outputs: bool) -> list:
        if not torch_outputs:
            return [DeviceArray(t.shape, t.dtype, stream=stream, device=self.device) for t in self.output_types]
        torch = sys.modules["torch"]
        if self._torch_device is None:
            self._torch_device = torch.device("cuda", self.device)
        return [torch.empty(t.shape, dtype=getattr(torch, t.dtype.long_name), device=self._torch_device)
                for t in self.output_types]

    def run_pointers(self, inputs: Sequence[int], outputs: Sequence[int], stream: int = 0) -> None:
        """Launch on raw device pointers, unchecked: the fast path for callers that own their memory."""
        arguments = (*inputs, *outputs)
        cu_stream = _cu_stream(stream)
        self._dev.activate()
        launch = driver.cuLaunchKernel
        with self._lock:   # the parameter blocks are shared: fill and launch as one step
            ptrs = self._ptrs
            for slot, k in self._bindings:
                ptrs[slot] = arguments[k]
            for function, gx, gy, gz, bx, by, bz, smem, params, config in self._launches:
                if config is None:
                    (err,) = launch(function, gx, gy, gz, bx, by, bz, smem, cu_stream, params, 0)
                else:   # programmatic dependent launch: may start while the stream's previous kernel runs
                    config.hStream = cu_stream
                    (err,) = driver.cuLaunchKernelEx(config, function, params, 0)
                if err:
                    raise CudaError(f"launching a kernel of {self.name} failed: {_error_text(err)}")
        for dst, src, size in self._copies:
            _check(driver.cuMemcpyDtoDAsync(arguments[dst], arguments[src], size, cu_stream), "cuMemcpyDtoDAsync")

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the intermediates and unload the module (also done when the Executable is collected)."""
        if driver is None:
            return
        for ptr in self._scratch:
            driver.cuMemFree(ptr)
        self._scratch = []
        if self._module_handle is not None:
            driver.cuModuleUnload(self._module_handle)
            self._module_handle = None

    def __enter__(self) -> "Executable":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # the interpreter is shutting down
            pass

    def __repr__(self) -> str:
        return (f"<mdsl Executable {self.name}: {len(self._launches)} launch(es) on GPU {self.device}, "
                f"{len(self.input_types)} input(s), {len(self.output_types)} output(s)>")


def overlapping_launch(grid: tuple, block: tuple, smem: int):
    """The cuLaunchKernelEx configuration of a kernel that waits for its predecessor itself
    (`KernelLaunch.overlap`): programmatic stream serialization lets it start before the stream's previous
    kernel ends, once that one lets it (griddepcontrol.launch_dependents). The stream is set per launch."""
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config.attrs = [attribute]
    config.numAttrs = 1
    return config


EMPTY_KERNEL = 'extern "C" __global__ void mdsl_empty() {}\n'


class EmptyKernel:
    """An empty kernel (one block of 32 threads, no parameters) launched by the same cuLaunchKernel call
    as `Executable.run_pointers`: what a launch costs by itself, for benchmarks. `launcher(stream)`."""

    def __init__(self, device: int = 0):
        require_gpu("launching an empty kernel")
        self._dev = _device(device)
        self._dev.activate()
        cubin = compile_source(EMPTY_KERNEL, target_arch(device)).cubin
        self._module = _check(driver.cuModuleLoadData(cubin), "loading the empty kernel")
        self._function = _check(driver.cuModuleGetFunction(self._module, b"mdsl_empty"), "cuModuleGetFunction(mdsl_empty)")

    def __call__(self, stream: int = 0) -> None:
        (err,) = driver.cuLaunchKernel(self._function, 1, 1, 1, 32, 1, 1, 0, _cu_stream(stream), None, 0)
        if err:
            raise CudaError(f"launching the empty kernel failed: {_error_text(err)}")

    def close(self) -> None:
        if self._module is not None and driver is not None:
            driver.cuModuleUnload(self._module)
            self._module = None


# ---------------------------------------------------------------------------------------------
# from a mugraph to an Executable

@functools.lru_cache(maxsize=256)
def compile_source(source: str, arch: str):
    """The CompiledModule of CUDA source for an arch, compiled once per process."""
    from mdsl.backend.cuda.nvrtc import compile_cuda

    return compile_cuda(source, arch=arch)


BACKENDS = ("cuda", "ptx")   # code generators: CUDA C++ by NVRTC, PTX by llvmlite's NVPTX target


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise MdslError(f"unknown backend {backend!r}",
                        hint=f"use one of {', '.join(map(repr, BACKENDS))} (the default is 'cuda')")
    return backend


def compile_graph(graph: KernelGraph, *, arch: Optional[str] = None, device: int = 0,
                  backend: str = "cuda", options=None) -> Executable:
    """Emit CUDA (or, with backend="ptx", LLVM IR turned into PTX) for a kernel graph, compile it
    (cached) and load it on `device`. `options`: the CUDA backend's `CudaOptions` (none: from the
    environment)."""
    check_backend(backend)
    require_gpu("loading a compiled kernel")
    from mdsl.backend.cuda.codegen import emit_cuda

    arch = arch or target_arch(device)
    if backend == "ptx":
        from mdsl.backend.ptx import compile_ptx, emit_llvm

        program = emit_llvm(graph, arch=arch, options=options)
        return Executable(program, compile_ptx(program.llvm_ir, arch), device=device)
    program = emit_cuda(graph, arch=arch, options=options)
    return Executable(program, compile_source(program.source, arch), device=device)

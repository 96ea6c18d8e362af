"""GPU arrays as the runtime takes them: torch tensors, anything with `__cuda_array_interface__` (v2/v3)
or a CUDA `__dlpack__`, and mdsl's own `DeviceArray`s (which torch, CuPy and others can take in turn).
Each must be a compact row-major array on the GPU whose address is 16-byte aligned; `device_view` says
why one is not. Streams: the stream a call runs on, and the ordering of producers' streams before it.
"""
from __future__ import annotations

import functools
import sys
from typing import NamedTuple, Optional, Sequence

import numpy as np

from mdsl.errors import DTypeError, MdslError
from mdsl.gpu import dlpack
from mdsl.gpu.driver import check, cu_stream, current_ordinal, driver, get_device, release, release_pending
from mdsl.ir.dtypes import DType, bf16, dtype_from_name, dtype_of_array, f16, f32, i32
from mdsl.ir.types import TensorType

ALIGNMENT = 16            # bytes: the generated kernels load and store 16-byte vectors


class ArgumentError(MdslError):
    """An argument a GPU kernel cannot take: in host memory, on another GPU, not compact row-major,
    misaligned, or the wrong number of them."""


# ---------------------------------------------------------------------------------------------
# streams

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


def torch_stream_reader():
    """The function from a device ordinal to the handle of torch's current stream there."""
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton uses: no Stream object made
    return raw if raw is not None else lambda device: torch.cuda.current_stream(device).cuda_stream


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
    device = _pointer_device(ptr, what) if ptr else (current_ordinal() or 0)
    producer = _producer_stream(cai.get("stream"))
    if producer is not None and producer != stream:  # v3: the data is ready on the producer's stream only
        get_device(device).order(stream, producer)
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
                            hint="copy it to the GPU (mdsl.gpu.DeviceArray.from_numpy, or "
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
        value.order_before(stream)
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
            return torch_stream_reader()(value.get_device())
    return 0


# ---------------------------------------------------------------------------------------------
# mdsl's own device arrays

_BF16_BITS = np.uint16


def to_device_bits(array, dtype: DType) -> np.ndarray:
    """Host data as the device stores `dtype`; bf16 is rounded to nearest even from float32."""
    if dtype is not bf16:
        return np.ascontiguousarray(array, dtype=dtype.numpy_name)
    x = np.ascontiguousarray(array, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(_BF16_BITS)
    return np.where(np.isnan(x), _BF16_BITS(0x7FC0), rounded)   # a NaN's carry would make it inf


def from_device_bits(bits: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is bf16:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits


def _host_dtype(dtype: DType):
    return _BF16_BITS if dtype is bf16 else np.dtype(dtype.numpy_name)


_CAI_TYPESTRS = {"f16": "<f2", "bf16": "<V2", "f32": "<f4", "i32": "<i4"}
_DL_CODES = {"f16": (dlpack.FLOAT, 16, 1), "bf16": (dlpack.BFLOAT, 16, 1), "f32": (dlpack.FLOAT, 32, 1),
             "i32": (dlpack.INT, 32, 1)}


def _free(drv, ptr: int, stream: int) -> None:
    """A collected DeviceArray's memory, back to the pool in its stream's order (`release`), through the
    driver `drv` that allocated it."""
    try:
        check(drv.cuMemFreeAsync(ptr, cu_stream(stream)), "cuMemFreeAsync")
    except Exception:  # the stream is gone: free synchronously
        drv.cuMemFree(ptr)


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
        get_device(device)
        release_pending(self.stream)
        if self.nbytes:
            self.ptr = int(check(driver.cuMemAllocAsync(self.nbytes, cu_stream(self.stream)), "cuMemAllocAsync"))

    @classmethod
    def from_numpy(cls, array, dtype: Optional[DType] = None, *, stream=None, device: int = 0) -> "DeviceArray":
        """A copy of a host array; `dtype` defaults to the array's (float32 data becomes bf16 when asked)."""
        array = np.asarray(array)
        dtype = dtype if dtype is not None else dtype_of_array(array)
        out = cls(array.shape, dtype, stream=stream, device=device)
        bits = to_device_bits(array, dtype)
        if out.nbytes:  # from pageable memory: returns once `bits` is staged, so it may be freed then
            check(driver.cuMemcpyHtoDAsync(out.ptr, bits.ctypes.data, out.nbytes, cu_stream(out.stream)),
                   "cuMemcpyHtoDAsync")
        return out

    def to_numpy(self) -> np.ndarray:
        """A host copy, once the work queued on the array's stream is done (bf16 comes back as float32)."""
        get_device(self.device)
        bits = np.empty(self.shape, dtype=_host_dtype(self.dtype))
        if self.nbytes:
            check(driver.cuMemcpyDtoHAsync(bits.ctypes.data, self.ptr, self.nbytes, cu_stream(self.stream)),
                   "cuMemcpyDtoHAsync")
        check(driver.cuStreamSynchronize(cu_stream(self.stream)), "cuStreamSynchronize")
        return from_device_bits(bits, self.dtype)

    @property
    def size(self) -> int:
        return TensorType(self.shape, self.dtype).numel

    # what torch tensors say of themselves, so that a call's signature reads both alike (mdsl.gpu.calls)
    def data_ptr(self) -> int:
        return self.ptr

    def get_device(self) -> int:
        return self.device

    def is_contiguous(self) -> bool:
        return True

    def order_before(self, stream: int) -> None:
        """Make `stream` wait for the work pending on this array (its data is ready on its own stream)."""
        if self.stream != stream:
            get_device(self.device).order(stream, self.stream)

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
            get_device(self.device).order(consumer, self.stream)
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        return dlpack.export(self.ptr, self.shape, _DL_CODES[self.dtype.name], self.__dlpack_device__(), self,
                             versioned=versioned)

    def __repr__(self) -> str:
        return f"DeviceArray({self.dtype}[{', '.join(map(str, self.shape))}], device={self.device}, ptr={self.ptr:#x})"

    def __del__(self):
        if self.ptr and driver is not None:
            release(functools.partial(_free, driver, self.ptr, self.stream))
            self.ptr = 0

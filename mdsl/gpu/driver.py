"""The CUDA driver as the runtime uses it (through cuda.bindings): whether there is a GPU, each device's
primary context and properties, the architecture to compile for, and the errors of driver calls.

Nothing touches the driver before `has_gpu()` has said there is one: on a machine without a driver, a
failed driver call can make every later driver call in the process hang.
"""
from __future__ import annotations

import functools
import gc
import threading
from typing import Callable, Optional

from mdsl.errors import MdslError

try:
    from cuda.bindings import driver
except ImportError:  # without cuda-python there is no GPU path; has_gpu() says so
    driver = None

_NO_GPU_HINT = ("tracing, kernel.optimize() (search and verification) and compiling CUDA source to cubins all "
                "work without a GPU; pass numpy arrays to run the kernel on the CPU (reference interpreter)")


class NoGPUError(MdslError):
    """Running on the GPU was asked for, but this machine has no usable NVIDIA GPU and driver."""


class CudaError(MdslError):
    """A CUDA driver call failed, or a compiled program does not fit the device."""


# ---------------------------------------------------------------------------------------------
# devices

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


def check(result: tuple, what: str):
    """The value(s) of a cuda.bindings call, or a CudaError naming the call and the driver's error."""
    err = result[0]
    if err:
        raise CudaError(f"{what} failed: {error_text(err)}")
    return result[1] if len(result) == 2 else result[1:] or None


def error_text(err) -> str:
    _, name = driver.cuGetErrorName(err)
    _, text = driver.cuGetErrorString(err)
    decode = lambda b: b.decode() if isinstance(b, bytes) else str(b)  # noqa: E731
    return f"{decode(name)} ({decode(text)})"


_THREAD = threading.local()   # .device: the ordinal whose context is current on this thread


class Device:
    """One GPU: its primary context (the one torch uses too) and what launches need to know of it."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.handle = check(driver.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        self.context = check(driver.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self.activate()
        attr = driver.CUdevice_attribute
        self.capability = (self._attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                           self._attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.max_smem = self._attribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        self.l2_bytes = self._attribute(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        # the stream-ordered pool keeps freed memory for reuse instead of returning it at every sync
        pool = check(driver.cuDeviceGetDefaultMemPool(self.handle), "cuDeviceGetDefaultMemPool")
        check(driver.cuMemPoolSetAttribute(pool, driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                           driver.cuuint64_t(2**64 - 1)), "cuMemPoolSetAttribute")
        self.event = check(driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def _attribute(self, attribute) -> int:
        return check(driver.cuDeviceGetAttribute(attribute, self.handle), f"cuDeviceGetAttribute({attribute.name})")

    def activate(self) -> None:
        if getattr(_THREAD, "device", None) != self.ordinal:
            check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
            _THREAD.device = self.ordinal

    def make_current(self) -> None:
        """Make the context current whatever this thread's record says (another library may have made its
        own current since)."""
        check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        _THREAD.device = self.ordinal

    def order(self, waiter: int, signaller: int) -> None:
        """Make stream `waiter` wait for the work queued so far on stream `signaller`."""
        check(driver.cuEventRecord(self.event, cu_stream(signaller)), "cuEventRecord")
        check(driver.cuStreamWaitEvent(cu_stream(waiter), self.event, 0), "cuStreamWaitEvent")


def current_ordinal():
    """The ordinal of the device whose context is current on this thread (None: none made current yet)."""
    return getattr(_THREAD, "device", None)


_DEVICES: dict = {}
_DEVICES_LOCK = threading.Lock()


def get_device(ordinal: int = 0) -> Device:
    device = _DEVICES.get(ordinal)
    if device is None:
        require_gpu()
        with _DEVICES_LOCK:
            device = _DEVICES.get(ordinal) or _DEVICES.setdefault(ordinal, Device(ordinal))
    device.activate()
    return device


@functools.cache
def l2_bytes(device: int = 0) -> int:
    """The GPU's L2 cache size in bytes."""
    require_gpu("reading the L2 cache size")
    return get_device(device).l2_bytes


def target_arch(device: int = 0) -> str:
    """The arch to compile for: sm_90a on compute capability 9.0 (Hopper features), sm_XY on others,
    and sm_90a (the H200) where there is no GPU."""
    if not has_gpu():
        return "sm_90a"
    major, minor = get_device(device).capability
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


_STREAMS: dict = {}   # handle -> CUstream, so that a launch does not build one


def cu_stream(handle: int):
    """The cuda.bindings CUstream of a handle (made once per handle)."""
    stream = _STREAMS.get(handle)
    if stream is None:
        if len(_STREAMS) > 1024:  # streams come and go; keep the cache small
            _STREAMS.clear()
        stream = _STREAMS[handle] = driver.CUstream(handle)
    return stream


# ---------------------------------------------------------------------------------------------
# releases a collection makes

_PENDING: list = []   # driver calls that free, queued by finalizers that ran inside a collection (`release`)
_COLLECTING = [False]  # whether Python's cyclic collector is running (set by `_collector_phase`)


def _collector_phase(phase: str, info: dict) -> None:
    _COLLECTING[0] = phase == "start"


gc.callbacks.append(_collector_phase)


def release(free: Callable[[], object]) -> None:
    """What a finalizer does with `free` (a driver call that frees memory or unloads a module): make it now
    where the object's last reference went (a del, a scope's end: a point of the caller's own code), or queue it
    for `release_pending` where Python's cyclic collector is collecting the object. The collector runs at any
    allocation of any thread, which may be while a stream of the process is being captured into a CUDA graph
    (torch.cuda.graph, a server's step graphs), and cuMemFree or cuModuleUnload there invalidates that capture
    (cudaErrorStreamCaptureInvalidated)."""
    if _COLLECTING[0]:
        _PENDING.append(free)   # (one list operation: atomic under the GIL, whatever thread collects)
        return
    try:
        free()
    except Exception:   # noqa: BLE001 (the interpreter is shutting down, the context is gone)
        pass


def release_pending(stream: Optional[int] = None) -> None:
    """Make the queued frees, where mdsl is about to call the driver itself (allocating, loading a module, a
    kernel's checked call): not while `stream` (the handle of the stream that call uses) is being captured,
    where they wait for a later point. A free that fails (its context gone) is dropped."""
    if not _PENDING or not has_gpu() or (stream is not None and capturing(stream)):
        return
    while _PENDING:
        try:
            free = _PENDING.pop(0)
        except IndexError:   # another thread took the last one
            return
        try:
            free()
        except Exception:   # noqa: BLE001 (the context or stream is gone: nothing left to free)
            pass


def capturing(stream: int) -> bool:
    """Whether the stream of handle `stream` is being captured into a CUDA graph (or cannot be asked: the
    legacy stream while another stream captures)."""
    try:
        err, status = driver.cuStreamIsCapturing(cu_stream(stream))
    except Exception:   # noqa: BLE001 (a stream handle the driver does not know: ask again later)
        return True
    return bool(err) or status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

"""cuBLAS for the launches the lowering marks as library GEMMs (`KernelLaunch.library`, mdsl.lowering.gemm):
plain matmuls, for which cuBLAS has kernels tuned per GPU and shape.

The library is the `nvidia-cublas` wheel's (or a CUDA toolkit's), found by cuda.pathfinder as the runtime
finds NVRTC and nvJitLink, and called through ctypes. Where it cannot be loaded, or cannot start on a GPU,
an executable runs its own kernel for each such launch instead, after one warning.

* The product: row-major C = A @ B is column-major C^T = B^T A^T, so cuBLAS gets B where it expects A and A
  where it expects B, neither transposed, with the row lengths as leading dims (`column_major`); a B read
  from its transpose's buffer (`LibraryGemm.trans_b`) is cuBLAS's A transposed.
  `cublasGemmEx` (one product) or `cublasGemmStridedBatchedEx`, CUBLAS_COMPUTE_32F: f32 sums rounded once
  to the product's dtype (f32 operands without TF32: the default math mode).
* Per device: one handle, created with the device's primary context current (the one the runtime
  uses), and a lock (setting the stream and calling are one step). Per (device, stream): a workspace of
  WORKSPACE_BYTES, so that GEMMs on different streams never share scratch memory (none on a stream being
  captured into a CUDA graph before it ran a GEMM: allocating would end the capture); a GEMM on another
  stream than the last sets the stream and then the workspace again (cublasSetStream_v2 resets it).
  A program captured as a graph for one stream (mdsl.gpu.executable's graphs by pointers) is captured with
  that stream's workspace (`Context.capture_on`).
* A call passes prebuilt ctypes objects (`gemm_arguments`), the operands' pointers as views of the
  executable's parameter slots: nothing is converted or allocated per call.
  Handles and workspaces live as long as the process.
* Every cuBLAS status is checked: a failure is a `CublasError` naming the call.
"""
from __future__ import annotations

import ctypes
import threading
import warnings
from typing import Callable, Optional

import attrs

from mdsl.gpu.driver import CudaError, check, cu_stream, driver, get_device
from mdsl.gpu.program import LibraryGemm

#: a value no stream handle has: the handle's stream before one is set
NO_STREAM = 2**64 - 1
#: the workspace of each (device, stream): what cuBLAS asks for on Hopper (and what PyTorch gives it)
WORKSPACE_BYTES = 32 * 2**20

CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
#: cudaDataType of each dtype a library GEMM takes
CUDA_DTYPES = {"f16": 2, "bf16": 14, "f32": 0}

_MISSING_HINT = ("pip install \"mdsl[cublas]\" (the nvidia-cublas wheel; a CUDA toolkit's libcublas is found too): "
                 "mdsl's own GEMM kernel is several times slower")


class CublasError(CudaError):
    """A cuBLAS call failed."""


@attrs.frozen
class ColumnMajorGemm:
    """The arguments of cublasGemmEx / cublasGemmStridedBatchedEx (column-major) for a `LibraryGemm`:
    `a_operand` and `b_operand` index the product's (A, B) operands, passed as cuBLAS's A and B."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    a_operand: int
    lda: int
    stride_a: int
    b_operand: int
    ldb: int
    stride_b: int
    ldc: int
    stride_c: int
    batch: int


def column_major(gemm: LibraryGemm) -> ColumnMajorGemm:
    """Row-major C (m x n) = A (m x k) @ B (k x n) as cuBLAS computes it: C^T (n x m, leading dim n) =
    B^T (n x k, leading dim n) @ A^T (k x m, leading dim k), both untransposed. With `trans_b` B's buffer
    holds B^T row-major (n x k), which column-major is B (k x n, leading dim k): cuBLAS transposes it."""
    if gemm.trans_b:
        return ColumnMajorGemm(CUBLAS_OP_T, CUBLAS_OP_N, gemm.n, gemm.m, gemm.k,
                               1, gemm.k, gemm.stride_b, 0, gemm.k, gemm.stride_a, gemm.n, gemm.stride_c, gemm.batch)
    return ColumnMajorGemm(CUBLAS_OP_N, CUBLAS_OP_N, gemm.n, gemm.m, gemm.k,
                           1, gemm.n, gemm.stride_b, 0, gemm.k, gemm.stride_a, gemm.n, gemm.stride_c, gemm.batch)


# ---------------------------------------------------------------------------------------------
# the library

_LIBRARY: dict = {}        # "lib": the CDLL, or None where it cannot be loaded
_LIBRARY_LOCK = threading.Lock()
_WARNED: set = set()

_P = ctypes.c_void_p
_PROTOTYPES = {
    "cublasCreate_v2": (ctypes.POINTER(ctypes.c_void_p),),
    "cublasSetStream_v2": (_P, _P),
    "cublasSetWorkspace_v2": (_P, _P, ctypes.c_size_t),
}
#: called with a ctypes object for every argument (`gemm_arguments`), without prototypes: ctypes then
#: converts nothing per call, which halves the call's host time
_GEMMS = ("cublasGemmEx", "cublasGemmStridedBatchedEx")


def _warn_once(key, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _open() -> ctypes.CDLL:
    """libcublas through cuda.pathfinder (site-packages' nvidia wheels, then CUDA_HOME and the system),
    with the prototypes of the calls made here."""
    import cuda.pathfinder

    lib = ctypes.CDLL(cuda.pathfinder.load_nvidia_dynamic_lib("cublas").abs_path)
    for name, argtypes in _PROTOTYPES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    for name in ("cublasGetStatusName", "cublasGetStatusString"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = (ctypes.c_int,), ctypes.c_char_p
    for name in _GEMMS:
        getattr(lib, name).restype = ctypes.c_int
    return lib


def library():
    """The cuBLAS library, or None (with a warning, once) where it cannot be loaded. Needs no GPU."""
    if "lib" not in _LIBRARY:
        with _LIBRARY_LOCK:
            if "lib" not in _LIBRARY:
                try:
                    _LIBRARY["lib"] = _open()
                except Exception as e:   # no cuda.pathfinder, no library, or one without these calls
                    _LIBRARY["lib"] = None
                    _warn_once("library", f"cuBLAS could not be loaded ({type(e).__name__}: {e}); plain matmuls "
                                          f"run mdsl's own GEMM kernel. Hint: {_MISSING_HINT}")
    return _LIBRARY["lib"]


def status_text(lib, status: int) -> str:
    name, text = lib.cublasGetStatusName(status), lib.cublasGetStatusString(status)
    return f"{name.decode() if name else status} ({text.decode() if text else 'no description'})"


def check_status(lib, status: int, what: str) -> None:
    if status:
        raise CublasError(f"{what} failed: {status_text(lib, status)}",
                          hint="the cuBLAS library may not match the driver; MDSL_CUDA_CUBLAS=0 runs mdsl's own "
                               "GEMM kernel instead")


# ---------------------------------------------------------------------------------------------
# per device

class Context:
    """cuBLAS on one GPU: its handle, the workspace of each stream used, and the stream set last."""

    def __init__(self, lib, ordinal: int, handle: ctypes.c_void_p):
        self.lib, self.ordinal, self.handle = lib, ordinal, handle
        self.lock = threading.Lock()
        self.stream: Optional[int] = None
        #: the handle's stream as the C launcher reads it (launcher.c's Gemm.handle_stream): NO_STREAM until set
        self.stream_word = ctypes.c_uint64(NO_STREAM)
        self.workspaces: dict = {}   # stream handle -> device pointer

    def use_stream(self, stream: int) -> None:
        """Make `stream` the handle's stream, with its own workspace (call with the lock held). A stream being
        captured into a CUDA graph, that has none yet, gets none (an allocation would end the capture):
        cuBLAS then runs the algorithms that need no workspace."""
        workspace = self.workspaces.get(stream)
        if workspace is None and not _capturing(stream):
            workspace = int(check(driver.cuMemAlloc(WORKSPACE_BYTES),
                                  f"allocating the {WORKSPACE_BYTES >> 20} MiB cuBLAS workspace on GPU {self.ordinal}"))
            self.workspaces[stream] = workspace
        check_status(self.lib, self.lib.cublasSetStream_v2(self.handle, stream or None), "cublasSetStream_v2")
        check_status(self.lib, self.lib.cublasSetWorkspace_v2(self.handle, workspace, WORKSPACE_BYTES if workspace
                                                              else 0), "cublasSetWorkspace_v2")
        self.stream = stream
        self.stream_word.value = stream

    def capture_on(self, capture: int, like: int) -> None:
        """Make `capture`, a stream about to be captured into a graph that will be launched on `like`, the
        handle's stream, with `like`'s workspace (allocated here if it has none: `capture` is not yet being
        captured): the graph's GEMMs then run the algorithms, and use the scratch memory, of the same GEMMs
        launched on `like` (call with the lock held; `forget_stream` after the capture)."""
        self.use_stream(like)
        check_status(self.lib, self.lib.cublasSetStream_v2(self.handle, capture), "cublasSetStream_v2")
        check_status(self.lib, self.lib.cublasSetWorkspace_v2(self.handle, self.workspaces[like], WORKSPACE_BYTES),
                     "cublasSetWorkspace_v2")
        self.stream = capture
        self.stream_word.value = capture

    def forget_stream(self) -> None:
        """No stream recorded as the handle's (the next call sets its own): after a capture, whose stream is
        destroyed and whose handle value a later stream may have."""
        self.stream = None
        self.stream_word.value = NO_STREAM


def _capturing(stream: int) -> bool:
    status = check(driver.cuStreamIsCapturing(cu_stream(stream)), "cuStreamIsCapturing")
    return status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


_CONTEXTS: dict = {}       # device ordinal -> Context, or None where cuBLAS did not start there
_CONTEXTS_LOCK = threading.Lock()


def context(ordinal: int) -> Optional[Context]:
    """cuBLAS on GPU `ordinal` (its primary context made current), or None (with a warning, once) where
    the library cannot be loaded or its handle cannot be created."""
    if ordinal in _CONTEXTS:
        return _CONTEXTS[ordinal]
    lib = library()
    with _CONTEXTS_LOCK:
        if ordinal not in _CONTEXTS:
            _CONTEXTS[ordinal] = _start(lib, ordinal) if lib is not None else None
    return _CONTEXTS[ordinal]


def _start(lib, ordinal: int) -> Optional[Context]:
    get_device(ordinal)   # its primary context current: the handle belongs to it
    handle = ctypes.c_void_p()
    status = lib.cublasCreate_v2(ctypes.byref(handle))
    if status:
        _warn_once(("create", ordinal), f"cuBLAS could not start on GPU {ordinal}: cublasCreate_v2 failed: "
                                        f"{status_text(lib, status)}; plain matmuls run mdsl's own GEMM kernel")
        return None
    return Context(lib, ordinal, handle)


# ---------------------------------------------------------------------------------------------
# a launch's GEMM

_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)   # alpha and beta (f32 for CUBLAS_COMPUTE_32F)


def gemm_arguments(gemm: LibraryGemm, handle, ptrs, slots: tuple) -> tuple:
    """The arguments of the cuBLAS call for `gemm`, each a ctypes object, built once: the operands' pointers
    are views of the slots `ptrs[slots[0]]` (A), `ptrs[slots[1]]` (B) and `ptrs[slots[2]]` (C) of a
    parameter block (a c_uint64 array), so a call passes whatever the slots hold then, converting nothing."""
    g = column_major(gemm)
    a, b, c = (ctypes.c_void_p.from_buffer(ptrs, slots[k] * ctypes.sizeof(ctypes.c_uint64))
               for k in (g.a_operand, g.b_operand, 2))
    i, ll = ctypes.c_int, ctypes.c_longlong
    dtype = i(CUDA_DTYPES[gemm.dtype])
    head = (handle, i(g.transa), i(g.transb), i(g.m), i(g.n), i(g.k), ctypes.byref(_ONE))
    tail = (i(CUBLAS_COMPUTE_32F), i(CUBLAS_GEMM_DEFAULT))
    if g.batch == 1:
        return (*head, a, dtype, i(g.lda), b, dtype, i(g.ldb), ctypes.byref(_ZERO), c, dtype, i(g.ldc), *tail)
    return (*head, a, dtype, i(g.lda), ll(g.stride_a), b, dtype, i(g.ldb), ll(g.stride_b), ctypes.byref(_ZERO),
            c, dtype, i(g.ldc), ll(g.stride_c), i(g.batch), *tail)


class GemmStep:
    """A launch that cuBLAS runs: `step(stream)` from Python (`gemm_arguments`), and `native`, the same call as
    the C launcher makes it (`native_gemm`); `context` is the device's cuBLAS (its lock serializes calls on the
    handle)."""

    __slots__ = ("context", "native", "_call", "_arguments", "_describe")

    def __init__(self, gemm: LibraryGemm, ctx: Context, ptrs, slots: tuple, what: str):
        name = "cublasGemmEx" if gemm.batch == 1 else "cublasGemmStridedBatchedEx"
        self.context = ctx
        self.native = native_gemm(gemm, ctx, slots)
        self._call, self._arguments = getattr(ctx.lib, name), gemm_arguments(gemm, ctx.handle, ptrs, slots)
        self._describe = f"{name} for {what} ({gemm.dtype}, m={gemm.m} n={gemm.n} k={gemm.k}, {gemm.batch} matrices)"

    def __call__(self, stream: int) -> None:
        ctx = self.context
        with ctx.lock:
            if stream != ctx.stream:
                ctx.use_stream(stream)
            status = self._call(*self._arguments)
        if status:
            raise self.error(status)

    def error(self, status: int) -> CublasError:
        return CublasError(f"{self._describe} failed: {status_text(self.context.lib, status)}",
                           hint="MDSL_CUDA_CUBLAS=0 runs mdsl's own GEMM kernel instead")


def gemm_step(gemm: LibraryGemm, ordinal: int, ptrs, slots: tuple, what: str) -> Optional[GemmStep]:
    """The product run by cuBLAS on GPU `ordinal` on the operands whose device pointers the parameter block
    `ptrs` holds at `slots` (A, B, C) when it is called. None where cuBLAS cannot run there (the caller
    launches its kernel)."""
    ctx = context(ordinal)
    return None if ctx is None else GemmStep(gemm, ctx, ptrs, slots, what)


def native_gemm(gemm: LibraryGemm, ctx: Context, slots: tuple):
    """The C launcher's record of the call (launcher.c's Gemm): the entry point in the loaded library, the
    handle, where the handle's stream is recorded, and the operands' slots."""
    from mdsl.gpu.launcher import Gemm

    g = column_major(gemm)
    function = getattr(ctx.lib, "cublasGemmEx" if gemm.batch == 1 else "cublasGemmStridedBatchedEx")
    # (0 where the library is not a loaded one: the executable then calls it from Python)
    entry = ctypes.cast(function, ctypes.c_void_p).value if isinstance(function, ctypes._CFuncPtr) else 0
    handle = ctx.handle.value if isinstance(ctx.handle, ctypes.c_void_p) else 0
    return Gemm(entry=entry or 0, handle=handle or 0,
                handle_stream=ctypes.addressof(ctx.stream_word), alpha=ctypes.addressof(_ONE),
                beta=ctypes.addressof(_ZERO), stride_a=g.stride_a, stride_b=g.stride_b, stride_c=g.stride_c,
                transa=g.transa, transb=g.transb, m=g.m, n=g.n, k=g.k, a_slot=slots[g.a_operand], lda=g.lda,
                b_slot=slots[g.b_operand], ldb=g.ldb, c_slot=slots[2], ldc=g.ldc, dtype=CUDA_DTYPES[gemm.dtype],
                compute=CUBLAS_COMPUTE_32F, algo=CUBLAS_GEMM_DEFAULT, batch=g.batch, pad=0)

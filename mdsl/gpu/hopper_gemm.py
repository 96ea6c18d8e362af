"""The Hopper GEMM (C[M, N] = A[M, K] W[N, K]^T (+ bias[N]) (+ residual[M, N]) on wgmma and TMA) on the host,
whichever backend wrote its kernel: the configuration both kernels share (the tile, the ring's stages and
shared memory, the kernel's name and parameters, the tile width a product gets, the TMA tensor maps of its
operands), the checks of a call's operands, and the launch (`launch_gemm`).

The kernels: mdsl/backend/cuda/hopper_gemm.cuh (compiled by NVRTC) and the same kernel as the PTX backend's
LLVM IR (mdsl/backend/ptx/hopper_gemm.py); each backend's `hopper_gemm(a, w, ...)` is `launch_gemm` with the
function that loads its kernel's module. Decided here once, the two are one kernel written twice: the same
launch and parameters, and the same arithmetic in the same order (tests/gpu/test_gpu_hopper_gemm.py compares
their bits).

* Configuration: the tile's width BN (128, 192 or 256; BM = 128, BK = 64) is the one that covers the product
  in the fewest waves of blocks over the GPU's SMs, weighted by how fast a tile of that width runs
  (`tile_n`); a kernel per (operand dtype, C's dtype, BN) and backend, compiled for sm_90a (wgmma needs the
  arch-specific target) and cached like every module.
* Tensor maps: one per operand, [rows, K] with K innermost, a BK x (BM or BN) box in 128-byte swizzled rows,
  zeros outside the tensor (`tensor_map_arguments`: pure, so the tests check it without a driver), encoded
  by the driver's cuTensorMapEncodeTiled and passed by value as `const __grid_constant__` kernel parameters.
  TMA needs 16-byte aligned rows: K a multiple of 8.
* Calls take torch tensors, DeviceArrays or anything else `device_view` takes (compact row-major, 16-byte
  aligned), on torch's current stream where the inputs are torch tensors (`launch_stream`).
"""
from __future__ import annotations

import ctypes
import functools
import math
import threading
from typing import Callable, Optional

import attrs

from mdsl.errors import DTypeError, ShapeError, UnsupportedError

BM, BK = 128, 64                 # hopper_gemm.cuh's GemmTile: rows of a tile, K of a stage
TILE_NS = (128, 192, 256)        # the tile widths (one wgmma m64nBNk16 covers a consumer's columns)
THREADS = 384                    # a producer warpgroup and two consumer warpgroups
STAGE_SPACE = 204800             # GemmTile's shared memory for stages (200 KiB)
INPUT_DTYPES = ("bf16", "f16")
OUTPUT_DTYPES = ("bf16", "f16", "f32")
#: relative speed of a tile of each width at equal waves: a wider tile reads fewer shared-memory bytes
#: per product (a wgmma reads A's 64 x 16 and W's BN x 16 for 64 x BN x 16 products)
TILE_RATE = {256: 1.0, 192: 0.97, 128: 0.9}


def stages(bn: int) -> int:
    """GemmTile::STAGES: the stages of A and W tiles that fit STAGE_SPACE."""
    return STAGE_SPACE // ((BM + bn) * BK * 2)


def smem_bytes(bn: int) -> int:
    """GemmTile::SMEM_BYTES: the stages, their full and empty mbarriers, and the slack that aligns them to 1024."""
    return stages(bn) * (BM + bn) * BK * 2 + 2 * stages(bn) * 8 + 1024


def kernel_name(dtype: str, out_dtype: str, bn: int) -> str:
    return f"mdsl_hopper_gemm_{dtype}_{out_dtype}_n{bn}"


@functools.lru_cache(maxsize=1024)
def tile_n(m: int, n: int, sms: int) -> int:
    """The tile width that runs the product fastest: waves of blocks over `sms` SMs times a tile's time
    (its width over TILE_RATE); ties go to the wider tile."""
    def cost(bn: int) -> float:
        return math.ceil(math.ceil(m / BM) * math.ceil(n / bn) / sms) * bn / TILE_RATE[bn]

    return min(sorted(TILE_NS, reverse=True), key=cost)


@attrs.frozen
class TensorMapArguments:
    """cuTensorMapEncodeTiled's arguments for a [rows, k] row-major operand, but for its address."""

    dtype: str                 # "bf16" or "f16"
    dims: tuple                # elements, innermost first: (k, rows)
    strides: tuple             # bytes from one row to the next (the rank - 1 outer dims)
    box: tuple                 # the elements one copy moves, innermost first: (BK, box rows)
    element_strides: tuple = (1, 1)
    swizzle: str = "128B"      # the 128-byte swizzle the wgmma descriptors name
    interleave: str = "NONE"
    l2_promotion: str = "L2_256B"
    oob_fill: str = "NONE"     # zeros outside the tensor: ragged M, N and K add nothing


@functools.lru_cache(maxsize=1024)
def tensor_map_arguments(rows: int, k: int, dtype: str, box_rows: int) -> TensorMapArguments:
    """The tensor map of a [rows, k] operand read in boxes of box_rows x BK (A: BM rows, W: the tile's BN)."""
    check_k(k)
    if rows < 1:
        raise ShapeError(f"an operand of {rows} rows has no tensor map", hint="skip empty products")
    return TensorMapArguments(dtype, (k, rows), (2 * k,), (BK, box_rows))


def check_k(k: int) -> None:
    if k < 1 or k % 8:
        raise ShapeError(f"K = {k}: the Hopper GEMM reads rows of A and W with TMA, which needs them a multiple of "
                         "16 bytes apart (K a positive multiple of 8)",
                         hint="pad A and W with zero columns up to a multiple of 8, or use torch.matmul")


def check_operands(a_shape: tuple, a_dtype: str, w_shape: tuple, w_dtype: str) -> tuple:
    """(M, N, K) of C = A W^T, or the error that says why these operands have no Hopper GEMM."""
    if len(a_shape) != 2 or len(w_shape) != 2:
        raise ShapeError(f"the Hopper GEMM takes matrices: A is {list(a_shape)}, W is {list(w_shape)}",
                         hint="reshape A to [rows, K] (the batch folded into the rows) and pass W as [N, K]")
    (m, k), (n, k_w) = a_shape, w_shape
    if k != k_w:
        raise ShapeError(f"A is [{m}, {k}] but W is [{n}, {k_w}]: C = A W^T needs the same K",
                         hint="W is [out, in] as nn.Linear stores it; pass w.T.contiguous() for a [K, N] matrix")
    for name, dtype in (("A", a_dtype), ("W", w_dtype)):
        if dtype not in INPUT_DTYPES:
            raise DTypeError(f"{name} is {dtype}: the Hopper GEMM multiplies bf16 or f16 operands on wgmma",
                             hint="convert both operands to bfloat16 (or float16), or use torch.matmul for f32")
    if a_dtype != w_dtype:
        raise DTypeError(f"A is {a_dtype} but W is {w_dtype}: wgmma multiplies operands of one dtype",
                         hint=f"convert W to {a_dtype}")
    check_k(k)
    return m, n, k


# ---------------------------------------------------------------------------------------------
# on the GPU


#: loads one configuration's kernel module on the current device: (dtype, out dtype, bn) -> a CUmodule handle
Loader = Callable[[str, str, int], object]


class _Kernel:
    """One configuration's function, loaded on one device by a backend's loader, with its dynamic shared
    memory allowed."""

    def __init__(self, ordinal: int, dtype: str, out_dtype: str, bn: int, load: Loader):
        from mdsl.gpu.driver import check, driver, get_device

        device = get_device(ordinal)
        self.smem = smem_bytes(bn)
        if self.smem > device.max_smem:
            raise UnsupportedError(f"the Hopper GEMM's {bn}-column tile needs {self.smem} bytes of shared memory; "
                                   f"GPU {ordinal} allows {device.max_smem}")
        name = kernel_name(dtype, out_dtype, bn)
        self.module = load(dtype, out_dtype, bn)
        self.function = check(driver.cuModuleGetFunction(self.module, name.encode()), f"cuModuleGetFunction({name})")
        check(driver.cuFuncSetAttribute(self.function,
                                        driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        self.smem), f"allowing {name} {self.smem} bytes of dynamic shared memory")


_KERNELS: dict = {}              # (device, dtype, out dtype, bn, backend) -> _Kernel
_MAPS: dict = {}                 # (device, address, TensorMapArguments) -> CUtensorMap
_MAPS_LIMIT = 1024
_LOCK = threading.Lock()


def _kernel(ordinal: int, dtype: str, out_dtype: str, bn: int, backend: str, load: Loader) -> _Kernel:
    key = (ordinal, dtype, out_dtype, bn, backend)
    found = _KERNELS.get(key)
    if found is None:
        with _LOCK:
            found = _KERNELS.get(key) or _KERNELS.setdefault(key, _Kernel(ordinal, dtype, out_dtype, bn, load))
    return found


@functools.cache
def _sms(ordinal: int) -> int:
    from mdsl.gpu.driver import driver, get_device

    return get_device(ordinal)._attribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)


_DATA_TYPES = {"bf16": "BFLOAT16", "f16": "FLOAT16"}


def encode_arguments(args: TensorMapArguments, address: int) -> tuple:
    """cuTensorMapEncodeTiled's arguments, as cuda.bindings takes them (its enums; no driver call)."""
    from cuda.bindings import driver

    return (getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{_DATA_TYPES[args.dtype]}"),
            len(args.dims), address, [driver.cuuint64_t(d) for d in args.dims],
            [driver.cuuint64_t(s) for s in args.strides], [driver.cuuint32_t(b) for b in args.box],
            [driver.cuuint32_t(e) for e in args.element_strides],
            getattr(driver.CUtensorMapInterleave, f"CU_TENSOR_MAP_INTERLEAVE_{args.interleave}"),
            getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{args.swizzle}"),
            getattr(driver.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{args.l2_promotion}"),
            getattr(driver.CUtensorMapFloatOOBfill, f"CU_TENSOR_MAP_FLOAT_OOB_FILL_{args.oob_fill}"))


def encode_tensor_map(args: TensorMapArguments, address: int):
    """The driver's tensor map of `args` at device address `address` (cuTensorMapEncodeTiled)."""
    from mdsl.gpu.driver import check, driver

    return check(driver.cuTensorMapEncodeTiled(*encode_arguments(args, address)), f"cuTensorMapEncodeTiled({args})")


def _tensor_map(ordinal: int, address: int, args: TensorMapArguments):
    """The tensor map of an operand, encoded once per (device, address, arguments): a map holds nothing but
    these, so one found again is still right for whatever array lives there now."""
    key = (ordinal, address, args)
    found = _MAPS.get(key)
    if found is None:
        if len(_MAPS) >= _MAPS_LIMIT:
            _MAPS.clear()
        found = _MAPS[key] = encode_tensor_map(args, address)
    return found


def launch_gemm(a, w, out=None, *, bias=None, residual=None, out_dtype: Optional[str] = None, stream=None,
                backend: str, load: Loader):
    """C = A @ W^T (+ bias) (+ residual) on Hopper's wgmma and TMA: A [M, K] and W [N, K] (an nn.Linear weight),
    both bf16 or both f16, K a multiple of 8; bias [N] in their dtype; C and residual [M, N] in `out_dtype`
    (bf16, f16 or f32; default: the operands' dtype, or `out`'s where it is given). Returns C: `out`, or a new
    torch tensor (torch inputs) or DeviceArray. Sums in f32, rounded once. Needs a compute capability 9.0 GPU.
    The kernel is `backend`'s, its module loaded by `load` (each backend's `hopper_gemm` passes its own)."""
    from mdsl.gpu.arrays import ArgumentError, DeviceArray, device_view, is_torch_tensor, launch_stream
    from mdsl.gpu.driver import CudaError, cu_stream, driver, error_text, get_device, require_gpu
    from mdsl.ir.dtypes import dtype_from_name

    require_gpu("the Hopper GEMM")
    handle = launch_stream([a, w], stream)
    va, vw = device_view(a, "A", handle), device_view(w, "W", handle)
    m, n, k = check_operands(va.shape, va.dtype.name, vw.shape, vw.dtype.name)
    if va.device != vw.device:
        raise ArgumentError(f"A is on GPU {va.device} but W on GPU {vw.device}", hint="move both to one GPU")
    ordinal = va.device
    capability = get_device(ordinal).capability
    if capability != (9, 0):
        raise UnsupportedError(f"the Hopper GEMM needs a compute capability 9.0 GPU (wgmma, TMA); GPU {ordinal} is "
                               f"{capability[0]}.{capability[1]}",
                               hint="use torch.matmul, or mdsl's kernels (mma.sync), on other GPUs")
    dtype = va.dtype.name
    if out_dtype is not None:   # "bf16", "bfloat16", mdsl.bf16 or torch.bfloat16
        out_dtype = dtype_from_name(str(out_dtype).removeprefix("torch.")).name
    if out is not None:
        vc = device_view(out, "out", handle)
        out_dtype = out_dtype or vc.dtype.name
        if vc.dtype.name != out_dtype:
            raise DTypeError(f"out is {vc.dtype.name} but out_dtype is {out_dtype}", hint="pass one of them")
    out_dtype = out_dtype or dtype
    if out_dtype not in OUTPUT_DTYPES:
        raise DTypeError(f"the Hopper GEMM writes bf16, f16 or f32 products, not {out_dtype}",
                         hint="pass out_dtype='bf16', 'f16' or 'f32'")
    if out is None:
        if is_torch_tensor(a):
            import torch

            out = torch.empty((m, n), dtype=getattr(torch, _torch_name(out_dtype)), device=f"cuda:{ordinal}")
        else:
            out = DeviceArray((m, n), dtype_from_name(out_dtype), stream=handle, device=ordinal)
        vc = device_view(out, "out", handle)
    if vc.shape != (m, n):
        raise ShapeError(f"out is {list(vc.shape)} but C = A W^T is [{m}, {n}]", hint="pass an [M, N] array")
    vb = _optional(bias, "bias", handle, (n,), dtype)
    vr = _optional(residual, "residual", handle, (m, n), out_dtype)
    if m == 0 or n == 0:
        return out
    bn = tile_n(m, n, _sms(ordinal))
    if -(-n // bn) > 65535:
        raise UnsupportedError(f"N = {n}: the Hopper GEMM's grid walks N's tiles in its y dimension, at most 65535",
                               hint="split W into parts of fewer rows")
    kernel = _kernel(ordinal, dtype, out_dtype, bn, backend, load)
    map_a = _tensor_map(ordinal, va.ptr, tensor_map_arguments(m, k, dtype, BM))
    map_w = _tensor_map(ordinal, vw.ptr, tensor_map_arguments(n, k, dtype, bn))
    scalars = (ctypes.c_void_p(vc.ptr), ctypes.c_void_p(vb.ptr if vb else 0), ctypes.c_void_p(vr.ptr if vr else 0),
               ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k))
    params = (ctypes.c_void_p * 8)(map_a.getPtr(), map_w.getPtr(), *(ctypes.addressof(s) for s in scalars))
    get_device(ordinal)
    (err,) = driver.cuLaunchKernel(kernel.function, -(-m // BM), -(-n // bn), 1, THREADS, 1, 1, kernel.smem,
                                   cu_stream(handle), ctypes.addressof(params), 0)
    if err:
        raise CudaError(f"launching {kernel_name(dtype, out_dtype, bn)} (M={m} N={n} K={k}) failed: {error_text(err)}")
    if type(out) is DeviceArray:
        out.stream = handle
    return out


def _torch_name(dtype: str) -> str:
    return {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[dtype]


def _optional(value, what: str, stream: int, shape: tuple, dtype: str):
    if value is None:
        return None
    from mdsl.gpu.arrays import device_view

    view = device_view(value, what, stream)
    if view.shape != shape:
        raise ShapeError(f"{what} is {list(view.shape)}, not {list(shape)}", hint=f"pass a {list(shape)} array")
    if view.dtype.name != dtype:
        raise DTypeError(f"{what} is {view.dtype.name}, not {dtype}", hint=f"convert it to {dtype}")
    return view

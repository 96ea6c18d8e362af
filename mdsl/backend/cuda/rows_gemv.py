"""Decode-sized linears over R <= 64 rows on tensor cores (rows_gemv.cuh) from the host:

    y[r, n] = sum_k x[r, k] W[n, k]     (x [R, K] and W [N, K] bf16, y f32)

* `repack_for_mma(W)` puts an nn.Linear weight into fragment order once (`unpack_from_mma` is its inverse):
  W'[t, s, lane, e] = W[16 t + FRAGMENT_ROW[lane, e], 16 s + FRAGMENT_COL[lane, e]], the 8 bf16 of the
  m16n8k16 A fragment that lane `lane` holds for feature tile t and k16 step s, so one 16-byte load is one
  mma's weight operand.
* `kernel_source(mt, kslice)`: the translation unit of one configuration (MT feature tiles a warp, K slices of
  KSLICE), its products kernel and the kernel that adds the slices in order; `launch_plan` the grid that
  fills the GPU's SMs.
* `rows_gemv(x, packed, n)` runs both on the GPU (torch tensors or DeviceArrays), `bandwidth` times it.

A row's outputs are bit-identical whatever R and whatever its place among the rows: the sums' order depends on
(n, k) and KSLICE only (rows_gemv.cuh says why).
"""
from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import attrs
import numpy as np

from mdsl.errors import DTypeError, ShapeError, UnsupportedError

HEADER = Path(__file__).with_name("rows_gemv.cuh")
WARPS = 8                 # rows_gemv.cuh's WARPS
THREADS = 32 * WARPS
MAX_ROWS = 64             # rows_gemv.cuh's MAX_ROWS
LOADS = 16                # rows_gemv.cuh's LOADS
KSLICE = 1024             # k a block covers: 64 rows of it (132 KB) fit shared memory beside nothing else
TILES = (1, 2)            # feature tiles a warp (MT)
REDUCE_THREADS = 256
H200_SMS = 132


# ---------------------------------------------------------------------------------------------
# fragment order

def _fragment_map() -> tuple:
    """(row, col) in a 16 x 16 block of W of element e of lane `lane`'s A fragment (PTX ISA, mma.m16n8k16 with
    16-bit A: register i // 2 holds elements i and i + 1; rows groupID (+ 8 for registers 1 and 3), columns
    2 threadID_in_group + (e & 1) (+ 8 for registers 2 and 3))."""
    lane, e = np.meshgrid(np.arange(32), np.arange(8), indexing="ij")
    reg = e // 2
    return lane // 4 + 8 * (reg % 2), 2 * (lane % 4) + (e % 2) + 8 * (reg // 2)


FRAGMENT_ROW, FRAGMENT_COL = _fragment_map()


def _check_weight_shape(n: int, k: int) -> None:
    if n % 16 or k % 16 or n < 16 or k < 16:
        raise ShapeError(f"W is [{n}, {k}]: fragment order covers W with 16 x 16 blocks, N and K multiples of 16",
                         hint="pad W with zero rows and columns (and x with zero columns) up to multiples of 16")


def _permute(a, order):
    return a.permute(*order) if hasattr(a, "permute") else a.transpose(order)


def _indices(a) -> tuple:
    """FRAGMENT_ROW and FRAGMENT_COL as `a`'s indices: torch tensors on its device for a torch tensor."""
    if hasattr(a, "permute"):
        import torch

        return (torch.as_tensor(FRAGMENT_ROW, device=a.device), torch.as_tensor(FRAGMENT_COL, device=a.device))
    return FRAGMENT_ROW, FRAGMENT_COL


def repack_for_mma(w):
    """W [N, K] (numpy or torch, any dtype) in fragment order: [N / 16, K / 16, 32, 8], a copy."""
    n, k = w.shape
    _check_weight_shape(n, k)
    blocks = _permute(w.reshape(n // 16, 16, k // 16, 16), (0, 2, 1, 3))   # [t, s, row, col]
    row, col = _indices(w)
    return blocks[:, :, row, col]


def unpack_from_mma(packed):
    """repack_for_mma's inverse: [N / 16, K / 16, 32, 8] back to W [N, K]."""
    t, s = packed.shape[:2]
    if tuple(packed.shape[2:]) != (32, 8):
        raise ShapeError(f"a repacked weight is [N / 16, K / 16, 32, 8], not {list(packed.shape)}",
                         hint="pass repack_for_mma's result")
    blocks = packed.new_empty((t, s, 16, 16)) if hasattr(packed, "new_empty") else np.empty((t, s, 16, 16),
                                                                                            packed.dtype)
    row, col = _indices(packed)
    blocks[:, :, row, col] = packed
    return _permute(blocks, (0, 2, 1, 3)).reshape(16 * t, 16 * s)


# ---------------------------------------------------------------------------------------------
# the source and the grid

def kernel_name(mt: int, kslice: int) -> str:
    return f"mdsl_rows_gemv_m{mt}_k{kslice}"


REDUCE_NAME = "mdsl_rows_reduce"


@functools.cache
def kernel_source(mt: int = 1, kslice: int = KSLICE) -> str:
    """rows_gemv.cuh and its two kernels for MT = `mt` feature tiles a warp and K slices of `kslice`."""
    if mt not in TILES or kslice % 64 or kslice < 64:
        raise UnsupportedError(f"no rows kernel for {mt} feature tiles a warp and K slices of {kslice}",
                               hint=f"tiles a warp {TILES}, slices a multiple of 64")
    return (HEADER.read_text() + "\n"
            f'extern "C" __global__ void __launch_bounds__({THREADS}, 1) {kernel_name(mt, kslice)}(\n'
            "    const uint4* packed, const unsigned short* x, float* partial, int rows, int n, int k,\n"
            "    int tiles_per_block) {\n"
            "  extern __shared__ __align__(128) unsigned char smem[];\n"
            f"  mdsl::rows::rows_gemv_kernel<{mt}, {kslice}>(smem, packed, x, partial, rows, n, k, tiles_per_block);\n"
            "}\n"
            f'extern "C" __global__ void __launch_bounds__({REDUCE_THREADS}) {REDUCE_NAME}(\n'
            "    const float* partial, float* y, int slices, long long count) {\n"
            "  mdsl::rows::rows_reduce_kernel(partial, y, slices, count);\n"
            "}\n")


@attrs.frozen
class LaunchPlan:
    slices: int              # K slices: grid y, and the partial sums RowsReduce adds
    tiles_per_block: int     # feature tiles a block (a multiple of MT)
    blocks: int              # grid x
    smem: int                # dynamic shared memory: the staged rows


def smem_bytes(rows: int, kslice: int = KSLICE) -> int:
    """RowSlice's bytes: rows up to a multiple of 16, each 2 kslice + 16 bytes."""
    return -(-rows // 16) * 16 * (2 * kslice + 16)


def launch_plan(rows: int, n: int, k: int, mt: int = 1, kslice: int = KSLICE, sms: int = H200_SMS) -> LaunchPlan:
    """The grid: K in slices of kslice (by K alone: the sums' order must not depend on R), and the feature tiles
    spread over the blocks of a slice so that the blocks of all slices about fill `sms` SMs."""
    _check_weight_shape(n, k)
    if not 1 <= rows <= MAX_ROWS:
        raise ShapeError(f"{rows} rows: the rows kernel multiplies 1 to {MAX_ROWS} rows",
                         hint=f"split the rows into batches of at most {MAX_ROWS}")
    slices = -(-k // kslice)
    groups = -(-(n // 16) // mt)
    per_slice = max(1, sms // slices)
    tiles_per_block = mt * -(-groups // per_slice)
    return LaunchPlan(slices, tiles_per_block, -(-(n // 16) // tiles_per_block), smem_bytes(rows, kslice))


# ---------------------------------------------------------------------------------------------
# on the GPU

class _Kernels:
    """One configuration's two functions, loaded on one device, the products allowed the most shared memory."""

    def __init__(self, ordinal: int, mt: int, kslice: int):
        from mdsl.backend.cuda.nvrtc import compile_source
        from mdsl.gpu.driver import check, driver, get_device

        get_device(ordinal)
        module = compile_source(kernel_source(mt, kslice), "sm_90a")
        self.module = check(driver.cuModuleLoadData(module.cubin), "loading the rows kernels")
        self.products = check(driver.cuModuleGetFunction(self.module, kernel_name(mt, kslice).encode()),
                              "cuModuleGetFunction")
        self.reduce = check(driver.cuModuleGetFunction(self.module, REDUCE_NAME.encode()), "cuModuleGetFunction")
        check(driver.cuFuncSetAttribute(self.products,
                                        driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        smem_bytes(MAX_ROWS, kslice)), "allowing the rows kernel its shared memory")


@functools.cache
def _kernels(ordinal: int, mt: int, kslice: int) -> _Kernels:
    return _Kernels(ordinal, mt, kslice)


def rows_gemv(x, packed, out=None, *, partial=None, mt: int = 1, kslice: int = KSLICE, stream=None,
              slices_only: bool = False):
    """y = x W^T on tensor cores: x [R, K] bf16 (R <= 64), `packed` = repack_for_mma(W) [N / 16, K / 16, 32, 8]
    bf16 on the GPU; y [R, N] f32 (`out`, or a new array like x). `partial` ([slices, R, N] f32) is the
    slices' scratch, allocated when not given; `slices_only` stops there (out unwritten: `bandwidth` times the
    weight stream alone)."""
    from mdsl.gpu.arrays import ArgumentError, DeviceArray, device_view, is_torch_tensor, launch_stream
    from mdsl.gpu.driver import CudaError, cu_stream, driver, error_text, require_gpu
    from mdsl.ir.dtypes import f32

    require_gpu("the rows kernel")
    handle = launch_stream([x, packed], stream)
    vx, vw = device_view(x, "x", handle), device_view(packed, "packed", handle)
    if len(vx.shape) != 2 or len(vw.shape) != 4 or tuple(vw.shape[2:]) != (32, 8):
        raise ShapeError(f"x is {list(vx.shape)} and packed {list(vw.shape)}: the rows kernel takes x [R, K] and "
                         "repack_for_mma(W), [N / 16, K / 16, 32, 8]", hint="repack W with repack_for_mma")
    rows, k = vx.shape
    n = 16 * vw.shape[0]
    if 16 * vw.shape[1] != k:
        raise ShapeError(f"x is [{rows}, {k}] but W is [{n}, {16 * vw.shape[1]}]", hint="x's columns are W's")
    if vx.dtype.name != "bf16" or vw.dtype.name != "bf16":
        raise DTypeError(f"x is {vx.dtype.name} and W {vw.dtype.name}: the rows kernel multiplies bf16",
                         hint="convert both to bfloat16")
    if vx.device != vw.device:
        raise ArgumentError(f"x is on GPU {vx.device} but W on GPU {vw.device}", hint="move both to one GPU")
    plan = launch_plan(rows, n, k, mt, kslice)

    def scratch(shape):
        if is_torch_tensor(x):
            import torch

            return torch.empty(shape, dtype=torch.float32, device=f"cuda:{vx.device}")
        return DeviceArray(shape, f32, stream=handle, device=vx.device)

    out = scratch((rows, n)) if out is None else out
    partial = scratch((plan.slices, rows, n)) if partial is None else partial
    vy, vp = device_view(out, "out", handle), device_view(partial, "partial", handle)
    if vy.shape != (rows, n) or vy.dtype.name != "f32":
        raise ShapeError(f"out is {vy.dtype.name} {list(vy.shape)}, not f32 [{rows}, {n}]", hint="pass an f32 array")
    if vp.shape != (plan.slices, rows, n) or vp.dtype.name != "f32":
        raise ShapeError(f"partial is {vp.dtype.name} {list(vp.shape)}, not f32 [{plan.slices}, {rows}, {n}]",
                         hint="leave partial out to have it allocated")
    kernels = _kernels(vx.device, mt, kslice)
    scalars = (ctypes.c_void_p(vw.ptr), ctypes.c_void_p(vx.ptr), ctypes.c_void_p(vp.ptr), ctypes.c_int(rows),
               ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(plan.tiles_per_block))
    params = (ctypes.c_void_p * len(scalars))(*(ctypes.addressof(s) for s in scalars))
    (err,) = driver.cuLaunchKernel(kernels.products, plan.blocks, plan.slices, 1, THREADS, 1, 1, plan.smem,
                                   cu_stream(handle), ctypes.addressof(params), 0)
    if err:
        raise CudaError(f"launching {kernel_name(mt, kslice)} (R={rows} N={n} K={k}) failed: {error_text(err)}")
    if slices_only:
        return out
    count = rows * n
    reduce_args = (ctypes.c_void_p(vp.ptr), ctypes.c_void_p(vy.ptr), ctypes.c_int(plan.slices),
                   ctypes.c_longlong(count))
    params = (ctypes.c_void_p * len(reduce_args))(*(ctypes.addressof(s) for s in reduce_args))
    (err,) = driver.cuLaunchKernel(kernels.reduce, min(4 * H200_SMS, -(-count // REDUCE_THREADS)), 1, 1,
                                   REDUCE_THREADS, 1, 1, 0, cu_stream(handle), ctypes.addressof(params), 0)
    if err:
        raise CudaError(f"launching {REDUCE_NAME} failed: {error_text(err)}")
    if type(out) is DeviceArray:
        out.stream = handle
    return out


def bandwidth(rows_list=(1, 8, 32, 64), n: int = 4096, k: int = 4096, mt: int = 1, kslice: int = KSLICE,
              repeats: int = 50, peak: float = 4.25e12, slices_only: bool = False) -> list:
    """(R, GB/s of weight bytes, fraction of `peak`) for each R: rows_gemv's products and reduction (with
    `slices_only`, the products alone) timed with CUDA events over `repeats` calls (the weights 2 N K bytes a
    call; copies of W past L2's size in rotation so that each call reads DRAM), `repeats` calls captured in a CUDA
    graph and replayed. Needs torch."""
    import torch

    copies = max(1, math.ceil(3 * 60e6 / (2 * n * k)))   # past H200's 60 MB of L2
    ws = [repack_for_mma(torch.randn(n, k, device="cuda").div(math.sqrt(k)).to(torch.bfloat16)).contiguous()
          for _ in range(copies)]
    results = []
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        out = torch.empty(rows, n, device="cuda")
        partial = torch.empty(launch_plan(rows, n, k, mt, kslice).slices, rows, n, device="cuda")
        call = functools.partial(rows_gemv, x, out=out, partial=partial, mt=mt, kslice=kslice,
                                 slices_only=slices_only)
        call(ws[0])                      # compiled and loaded outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()   # replayed: no Python between the launches
        with torch.cuda.graph(graph):
            for i in range(repeats):
                call(ws[i % copies])
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / repeats
        rate = 2 * n * k / seconds
        results.append((rows, rate / 1e9, rate / peak))
    return results


if __name__ == "__main__":   # python -m mdsl.backend.cuda.rows_gemv: the bandwidth table the tests do not assert
    for shape in ((4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288)):   # Qwen3-8B's o, qkv, gate|up, down
        for mt in TILES:
            for slices_only in (False, True):
                for rows, gbs, frac in bandwidth(n=shape[0], k=shape[1], mt=mt, slices_only=slices_only):
                    print(f"N={shape[0]:6d} K={shape[1]:6d} MT={mt} R={rows:3d} "
                          f"{'products      ' if slices_only else 'products + sum'}: {gbs:7.0f} GB/s "
                          f"({100 * frac:5.1f}% of 4.25 TB/s)", flush=True)

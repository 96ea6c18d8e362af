"""The Hopper GEMM's configuration, which both backends' kernels share (mdsl/backend/cuda/hopper_gemm.cuh and
.py: the CUDA kernel and the launch; mdsl/backend/ptx/hopper_gemm.py: the same kernel as LLVM IR): the tile
(BM x BN, BK a stage), the ring's stages and shared memory, the kernel's name, the tile width a product gets,
the TMA tensor maps of its operands and the operands it takes. Decided here once, so that the two kernels
are one kernel written twice: the same launch, the same parameters, the same bits.
"""
from __future__ import annotations

import functools
import math

import attrs

from mdsl.errors import DTypeError, ShapeError

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

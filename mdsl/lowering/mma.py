"""Matmuls on tensor cores (mma.sync m16n8k16 with f32 accumulators): which matmuls qualify, and the shape
of the warps' work that both backends write (the CUDA prelude's `mdsl::BlockMma`, the PTX backend's
`BlockMma`), so that both sum the same products in the same order.

A block matmul qualifies when both operands are 16-bit of one dtype (f16 or bf16: the program rounds them
to it, so converting an f32-stored tile to fragments is the program's own rounding), the target has
mma.sync (sm_80+), the block is whole warps, the tiles' rows are contiguous and their batch dims simple:
each operand has the output's batch dims or none at all. Anything else keeps the scalar FMA loop. C's
16 x 8 tiles are dealt to the warps in turn (fragment j of warp w accumulates tile w + j WARPS).
"""
from __future__ import annotations

import math
from typing import Optional

import attrs

from mdsl.ir.graph import Node
from mdsl.lowering.options import CudaOptions, arch_number

MMA_MIN_ARCH = 80
MMA_DTYPES = ("f16", "bf16")


@attrs.frozen
class MmaShape:
    element: str       # the fragments' dtype name ("f16" or "bf16")
    batch: int
    m: int
    n: int
    k: int
    warps: int

    @property
    def fragments_per_warp(self) -> int:
        tiles = self.batch * -(-self.m // 16) * -(-self.n // 8)
        return -(-tiles // self.warps)


def batch_stride(op, batch: tuple) -> Optional[int]:
    """Elements between consecutive matrices of `op` (anything with a shape and strides) over the output's
    batch dims: 0 when it has none (one matrix, repeated), its innermost batch stride when it has exactly
    the output's; else None."""
    own = op.shape[:-2]
    if math.prod(own) == 1:
        return 0
    if tuple(own) != tuple(batch[len(batch) - len(own):]) or len(own) != len(batch):
        return None
    return op.strides[-3]


def mma_shape(node: Node, a, w, out, threads: int, arch: int) -> Optional[MmaShape]:
    """The tensor-core shape of a block matmul whose operand and output tiles are laid out as `a`, `w`,
    `out` (shape and strides), or None where it keeps the scalar loop."""
    dtypes = {v.dtype.name for v in node.inputs}
    if len(dtypes) != 1 or not dtypes <= set(MMA_DTYPES) or arch < MMA_MIN_ARCH or threads % 32:
        return None
    if a.strides[-1] != 1 or w.strides[-1] != 1 or out.strides[-1] != 1:
        return None
    batch = out.shape[:-2]
    if any(batch_stride(op, batch) is None for op in (a, w, out)):
        return None
    (m, k), n = a.shape[-2:], out.shape[-1]
    return MmaShape(node.inputs[0].dtype.name, math.prod(batch), m, n, k, threads // 32)


def kernel_mma_dtype(node: Node, options: CudaOptions, arch: str) -> Optional[str]:
    """The fragments' dtype name when a kernel-level matmul runs on tensor cores: both operands of one
    16-bit dtype, a target with mma.sync, and the option on; else None (the scalar tile)."""
    dtypes = {v.dtype.name for v in node.inputs}
    if not options.mma or arch_number(arch) < MMA_MIN_ARCH or dtypes not in ({"f16"}, {"bf16"}):
        return None
    return node.inputs[0].dtype.name

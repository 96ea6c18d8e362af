"""Block-level matmuls on tensor cores: when a matmul of a block graph can run as `mdsl::BlockMma`
(prelude: mma.sync m16n8k16 with f32 accumulators), and the C++ that calls it.

A matmul qualifies when both operands are 16-bit of one dtype (f16 or bf16: the program rounds them to
it, so converting an f32-stored tile to fragments is the program's own rounding), the target has
mma.sync (sm_80+), the block is whole warps, and the batch dims of the tiles are simple: each operand
has the output's batch dims or none at all. Anything else keeps the scalar FMA loop.
"""
from __future__ import annotations

import math
from typing import Optional

import attrs

from mdsl.backend.cuda.source import Operand, ctype
from mdsl.ir.graph import Node

MMA_MIN_ARCH = 80
_MMA_DTYPES = ("f16", "bf16")


@attrs.frozen
class MmaShape:
    element: str       # the fragments' C type
    batch: int
    m: int
    n: int
    k: int
    warps: int

    @property
    def cls(self) -> str:
        return f"mdsl::BlockMma<{self.element}, {self.batch}, {self.m}, {self.n}, {self.k}, {self.warps}>"

    @property
    def fragments_per_warp(self) -> int:
        tiles = self.batch * -(-self.m // 16) * -(-self.n // 8)
        return -(-tiles // self.warps)


def _batch_stride(op: Operand, batch: tuple) -> Optional[int]:
    """Elements between consecutive matrices of `op` over the output's batch dims: 0 when it has none
    (one matrix, repeated), its innermost batch stride when it has exactly the output's; else None."""
    own = op.shape[:-2]
    if math.prod(own) == 1:
        return 0
    if tuple(own) != tuple(batch[len(batch) - len(own):]) or len(own) != len(batch):
        return None
    return op.strides[-3]


def mma_shape(node: Node, a: Operand, w: Operand, out: Operand, threads: int, arch_number: int) -> Optional[MmaShape]:
    dtypes = {v.dtype.name for v in node.inputs}
    if len(dtypes) != 1 or not dtypes <= set(_MMA_DTYPES) or arch_number < MMA_MIN_ARCH or threads % 32:
        return None
    if a.strides[-1] != 1 or w.strides[-1] != 1 or out.strides[-1] != 1:
        return None
    batch = out.shape[:-2]
    if any(_batch_stride(op, batch) is None for op in (a, w, out)):
        return None
    (m, k), n = a.shape[-2:], out.shape[-1]
    return MmaShape(ctype(node.inputs[0].dtype), math.prod(batch), m, n, k, threads // 32)


def mma_multiply(shape: MmaShape, fragments: str, a: Operand, w: Operand, out_batch: tuple) -> str:
    sa, sw = (_batch_stride(op, shape_batch) for op, shape_batch in ((a, out_batch), (w, out_batch)))
    return (f"{shape.cls}::multiply<{a.strides[-2]}, {sa}, {w.strides[-2]}, {sw}>"
            f"({fragments}, {a.ptr}, {w.ptr});")


def mma_store(shape: MmaShape, fragments: str, out: Operand) -> str:
    return f"{shape.cls}::store<{out.strides[-2]}, {_batch_stride(out, out.shape[:-2])}>({fragments}, {out.ptr});"

"""Block-level matmuls on tensor cores as C++: calls of `mdsl::BlockMma` (prelude: mma.sync m16n8k16 with
f32 accumulators) for the matmuls the lowering puts there (mdsl.lowering.mma)."""
from __future__ import annotations

from mdsl.backend.cuda.source import Operand, element_ctype
from mdsl.lowering.mma import MmaShape, batch_stride


def mma_class(shape: MmaShape) -> str:
    return (f"mdsl::BlockMma<{element_ctype(shape.element)}, {shape.batch}, {shape.m}, {shape.n}, {shape.k}, "
            f"{shape.warps}>")


def mma_multiply(shape: MmaShape, fragments: str, a: Operand, w: Operand, out_batch: tuple) -> str:
    sa, sw = (batch_stride(op, out_batch) for op in (a, w))
    return (f"{mma_class(shape)}::multiply<{a.strides[-2]}, {sa}, {w.strides[-2]}, {sw}>"
            f"({fragments}, {a.ptr}, {w.ptr});")


def mma_store(shape: MmaShape, fragments: str, out: Operand) -> str:
    return f"{mma_class(shape)}::store<{out.strides[-2]}, {batch_stride(out, out.shape[:-2])}>({fragments}, {out.ptr});"

"""Which kernels are library GEMMs: a kernel-level matmul that no custom kernel absorbed, of one float dtype
a BLAS library sums in f32 (f16, bf16, f32), whose operands' batch dims are each the product's or none
(a broadcast that is neither, [4, 1, m, k] @ [3, k, n], keeps mdsl's own kernel). Its launch carries the
product as a `LibraryGemm` (mdsl.gpu.program), which the runtime hands to cuBLAS where it can.

Every kernel-level value is a contiguous row-major tensor of at most 2^31 - 1 elements (so every size and
batch count fits cuBLAS's 32-bit ints), so a matrix's leading dim is its row length and
consecutive matrices of a batch are a matrix apart. Where the right operand is one matrix for every batch,
the batch is folded into the rows of the left one ([b, m, k] @ [k, n] is one [b m, k] @ [k, n] product).

A right operand that a kernel-level transpose of its last two dims made (`x @ transpose(w)`: a linear layer's
weight, a key matrix) is read from the transpose's input with cuBLAS's transposed-operand flag (`trans_b`):
the library needs no copy of it, and the runtime drops the transpose's launch where only such GEMMs read it
(`library_read_transposes`: what the cost model counts as free too).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

from mdsl.gpu.program import LibraryGemm
from mdsl.ir.graph import KernelGraph, Node
from mdsl.ir.types import Var

#: the dtypes a library GEMM takes (operands and product alike), each summed in f32
GEMM_DTYPES = ("f16", "bf16", "f32")


def _batch_stride(shape: tuple, batch: tuple) -> Optional[int]:
    """Elements between an operand's consecutive matrices over the product's batch dims `batch`: 0 when it
    has one matrix (its batch dims, if any, are all 1), a matrix when its batch dims are the product's
    (leading 1s aside), else None."""
    own = tuple(shape[:-2])
    if math.prod(own) == 1:
        return 0
    padded = (1,) * (len(batch) - len(own)) + own
    return math.prod(shape[-2:]) if padded == tuple(batch) else None


def swaps_last_two(node: Node) -> bool:
    """Whether kernel-level `node` is a transpose of its operand's last two dims, the others in place."""
    if node.op != "transpose" or node.body is not None:
        return False
    rank = len(node.inputs[0].shape)
    return rank >= 2 and tuple(node.attr("perm")) == (*range(rank - 2), rank - 1, rank - 2)


def library_gemm(node: Node, transposed: Callable[[Var], Optional[Var]] = lambda value: None) \
        -> Optional[LibraryGemm]:
    """The library GEMM that computes kernel-level `node`, or None where it is not one. `transposed(value)`:
    the input of the transpose of the last two dims that made `value` (`swaps_last_two`), or None; where
    it names one for the right operand, the GEMM reads that input (`trans_b`)."""
    if node.op != "matmul":
        return None
    dtypes = {v.dtype.name for v in (*node.inputs, *node.outputs)}
    if len(dtypes) != 1 or not dtypes <= set(GEMM_DTYPES):
        return None
    a, b, c = node.inputs[0].shape, node.inputs[1].shape, node.output.shape
    (m, k), n = a[-2:], b[-1]
    batch = tuple(c[:-2])
    strides = [_batch_stride(shape, batch) for shape in (a, b)]
    if None in strides:
        return None
    stride_a, stride_b = strides
    count = math.prod(batch)
    if stride_b == 0 and count > 1:   # one right matrix for every batch: the batch is more rows of the left
        m, count = m * count, 1
    trans_b = transposed(node.inputs[1]) is not None
    if count == 1:
        return LibraryGemm(dtypes.pop(), m, n, k, trans_b=trans_b)
    return LibraryGemm(dtypes.pop(), m, n, k, count, stride_a, stride_b, m * n, trans_b=trans_b)


def library_read_transposes(graph: KernelGraph) -> frozenset:
    """Indices of `graph`'s transposes of the last two dims (`swaps_last_two`) that the graph does not return and
    that only library GEMMs read, each as its right operand alone: those GEMMs read the transpose's input
    (`trans_b`), and where cuBLAS runs them the transpose is not launched (`mdsl.gpu.executable.elided_launches`),
    so the cost model counts it as free (a view)."""
    made = {node.output.name: node.inputs[0] for node in graph.nodes if swaps_last_two(node)}
    if not made:
        return frozenset()
    readers = graph.users()
    returned = {v.name for v in graph.outputs}

    def read_in_place(node: Node, name: str) -> bool:
        return (node.body is None and len(node.inputs) == 2 and node.inputs[1].name == name
                and node.inputs[0].name != name and library_gemm(node, lambda v: made.get(v.name)) is not None)

    return frozenset(i for i, node in enumerate(graph.nodes) if swaps_last_two(node)
                     and node.output.name not in returned and readers.get(node.output.name)
                     and all(read_in_place(r, node.output.name) for r in readers[node.output.name]))

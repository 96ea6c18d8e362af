"""Kernel-level nodes that only rename their operand's memory (every value is a contiguous row-major tensor):
a reshape, and a transpose that moves only dims of size 1 relative to the others (its elements keep their
row-major order: [1, 1, 8, 128] -> [1, 8, 1, 128], a traced attention's head transpose at one token). Both
backends alias them instead of launching a kernel, and the cost model counts them as free."""
from __future__ import annotations

from mdsl.ir.graph import Node


def is_view(node: Node) -> bool:
    """Whether kernel-level `node` is a view: a reshape, or a transpose that `keeps_order`."""
    if node.op == "reshape":
        return True
    if node.op != "transpose" or node.body is not None:
        return False
    return keeps_order(node.inputs[0].shape, node.attr("perm"))


def keeps_order(shape: tuple, perm) -> bool:
    """Whether permuting `shape`'s dims by `perm` keeps the dims of more than one element in their order (by
    their place, not their sizes: a square matrix's transpose moves its elements)."""
    moved = [p for p in perm if shape[p] > 1]
    return moved == sorted(moved)

"""Grids, lanes and thread counts that both backends launch and loop with: the blocks of a kernel-level
op's grid-wide loop, the lanes that fold a row of a reduction together, and the one-node thread graph of
an element-wise op."""
from __future__ import annotations

import math

from mdsl.ir.graph import Node, ThreadGraph

KERNEL_THREADS = 256  # threads per block of the standard (kernel-level) kernels
BLOCK_UNROLL = 4      # a block's element loops unrolled this many times by default (CudaOptions.unroll)
MAX_GRID_X = 65535


def blocks_for(n: int, per_block: int) -> int:
    """Blocks for a grid-wide loop over n items (the loops stride, so the grid may be smaller)."""
    return max(1, min(math.ceil(n / per_block), MAX_GRID_X))


def kernel_grid(n: int) -> tuple:
    """The grid of a kernel-level element loop over n items, KERNEL_THREADS a block."""
    return (blocks_for(n, KERNEL_THREADS), 1, 1)


def without(seq: tuple, dim: int) -> tuple:
    return tuple(s for d, s in enumerate(seq) if d != dim)


def group_lanes(length: int, spare: int) -> int:
    """Lanes per row: a power of two, at most 32, at most the row's length and at most `spare` (the
    threads available per row)."""
    want = max(1, min(32, length, spare))
    return 1 << (want.bit_length() - 1)


def reduced_dim(node: Node) -> int:
    """The dim a reduction or norm folds, counted from the front."""
    return node.attr("dim") % node.inputs[0].type.rank


def block_lanes(threads: int, shape: tuple, dim: int) -> int:
    """Lanes per row of a block-level reduction of a tile of `shape` along `dim` by `threads` threads."""
    rows = math.prod(without(shape, dim))
    return group_lanes(shape[dim], -(-threads // rows))


def kernel_lanes(node: Node) -> int:
    """Lanes per row of a kernel-level reduction: a row of contiguous elements is read by a group of lanes
    side by side; when the rows are the contiguous ones (a reduction over a leading dim), one thread per
    row keeps neighbours together."""
    shape, dim = node.inputs[0].shape, reduced_dim(node)
    return group_lanes(shape[dim], 32) if math.prod(shape[dim + 1:]) == 1 else 1


def row_kernel_grid(node: Node) -> tuple:
    """The grid of a kernel-level reduction or norm: `kernel_lanes` a row, KERNEL_THREADS a block."""
    rows = node.inputs[0].type.numel // node.inputs[0].shape[reduced_dim(node)]
    return (blocks_for(rows, KERNEL_THREADS // kernel_lanes(node)), 1, 1)


def alone(node: Node) -> ThreadGraph:
    """The one-node thread graph of an element-wise node (mul(x, x) reads x once)."""
    return ThreadGraph(list(dict.fromkeys(node.inputs)), [node], node.outputs)


def thread_graph(node: Node) -> ThreadGraph:
    """The thread graph an element-wise node computes: a fused node's body, else the node alone."""
    return node.body if node.op == "fused" else alone(node)

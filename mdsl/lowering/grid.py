"""Grids, lanes and thread counts that both backends launch and loop with: the blocks of a kernel-level
op's grid-wide loop, how a reduction or norm walks its rows (`RowLoop`: the lanes that fold a row
together, the elements each load reads, whether a norm keeps the row in registers), and the one-node
thread graph of an element-wise op.

A kernel-level reduction or norm (`kernel_row_loop`) gives a row of contiguous elements a warp's lanes,
or fewer for a short row, and more where that leaves the GPU idle or the row too long for a lane's
registers: lanes double, up to a block of ROW_BLOCK_THREADS per row, while the rows' lanes together are
fewer than FILL_THREADS or a lane's part of the row is more than RESIDENT_ELEMENTS, as long as each lane
keeps a whole widest load. Beyond a warp the lanes of a row are whole warps, whose shuffled results meet
in shared memory. A lane reads `vector` consecutive elements a load (16 bytes where the row's length
allows it: rows start aligned to the load, the tensors being 16-byte aligned). So 8 rows of 8192 f16
elements get a block of 512 threads each, 2 loads of 8 elements a lane; 4096 rows of 128 get a warp
each, 4 elements a lane."""
from __future__ import annotations

import math

import attrs

from mdsl.ir.graph import Node, ThreadGraph

KERNEL_THREADS = 256  # threads per block of the standard (kernel-level) kernels
BLOCK_UNROLL = 4      # a block's element loops unrolled this many times by default (CudaOptions.unroll)
MAX_GRID_X = 65535
WARP = 32
ROW_BLOCK_THREADS = 512   # the most lanes a row of a kernel-level reduction gets: a block of its own
FILL_THREADS = 128 * 1024  # threads that keep a GPU's memory system busy (about a thousand an SM of an H200)
RESIDENT_ELEMENTS = 32    # the most elements of its row a lane of a norm keeps in registers
VECTOR_BYTES = 16         # the widest load
#: the kernel-level ops whose kernels walk rows (`kernel_row_loop`, launched on `row_kernel_grid`)
ROW_OPS = frozenset({"sum", "mean", "max", "rms_norm"})


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
    want = max(1, min(WARP, length, spare))
    return 1 << (want.bit_length() - 1)


@attrs.frozen
class RowLoop:
    """How each row of a reduction or norm is read: by a group of `lanes` consecutive threads (a power of
    two; beyond a warp, whole warps), each lane reading `vector` consecutive elements a load (the row's
    elements contiguous, its length a multiple of it), chunk c of the row (elements c vector ..) read by lane
    c % lanes. `resident`: a lane keeps the elements it read in registers (`trips` loads) for what follows
    the fold (a norm's write), else they are read again."""

    lanes: int
    vector: int = 1
    resident: bool = False

    def chunks(self, length: int) -> int:
        return length // self.vector

    def trips(self, length: int) -> int:
        """Loads per lane (the last one only on the lanes its chunks reach)."""
        return -(-self.chunks(length) // self.lanes)

    def threads(self) -> int:
        """Threads per block of a kernel-level op's kernel: KERNEL_THREADS, or a row's lanes where more."""
        return max(KERNEL_THREADS, self.lanes)


def reduced_dim(node: Node) -> int:
    """The dim a reduction or norm folds, counted from the front."""
    return node.attr("dim") % node.inputs[0].type.rank


def block_lanes(threads: int, shape: tuple, dim: int) -> int:
    """Lanes per row of a block-level reduction of a tile of `shape` along `dim` by `threads` threads."""
    rows = math.prod(without(shape, dim))
    return group_lanes(shape[dim], -(-threads // rows))


def widest_vector(length: int, itemsize: int, most: int) -> int:
    """Elements of the widest load (a power of two, at most VECTOR_BYTES and `most` elements) whose
    multiples a row of `length` elements is."""
    vector = 1
    while vector * 2 * itemsize <= VECTOR_BYTES and vector * 2 <= most and length % (vector * 2) == 0:
        vector *= 2
    return vector


def row_loop(rows: int, length: int, itemsize: int) -> RowLoop:
    """How a kernel-level op reads `rows` rows of `length` contiguous elements of `itemsize` bytes (the
    module docstring says why)."""
    widest = widest_vector(length, itemsize, length)
    lanes = group_lanes(length, WARP)
    while (lanes < ROW_BLOCK_THREADS and lanes * 2 * widest <= length
           and (rows * lanes < FILL_THREADS or -(-length // lanes) > RESIDENT_ELEMENTS)):
        lanes *= 2
    loop = RowLoop(lanes, widest_vector(length, itemsize, max(1, length // lanes)))
    return attrs.evolve(loop, resident=loop.trips(length) * loop.vector <= RESIDENT_ELEMENTS)


def kernel_row_loop(node: Node) -> RowLoop:
    """How a kernel-level reduction or norm reads its rows: a row of contiguous elements as `row_loop`
    says; when the rows are the contiguous ones (a reduction over a leading dim), one thread per row keeps
    neighbours together."""
    x, dim = node.inputs[0], reduced_dim(node)
    length = x.shape[dim]
    if math.prod(x.shape[dim + 1:]) != 1:
        return RowLoop(1, 1, length <= RESIDENT_ELEMENTS)
    return row_loop(x.type.numel // length, length, x.dtype.itemsize)


def row_kernel_grid(node: Node) -> tuple:
    """The grid of a kernel-level reduction or norm: `kernel_row_loop`'s lanes a row, its threads a block."""
    loop = kernel_row_loop(node)
    rows = node.inputs[0].type.numel // node.inputs[0].shape[reduced_dim(node)]
    return (blocks_for(rows, loop.threads() // loop.lanes), 1, 1)


def alone(node: Node) -> ThreadGraph:
    """The one-node thread graph of an element-wise node (mul(x, x) reads x once)."""
    return ThreadGraph(list(dict.fromkeys(node.inputs)), [node], node.outputs)


def thread_graph(node: Node) -> ThreadGraph:
    """The thread graph an element-wise node computes: a fused node's body, else the node alone."""
    return node.body if node.op == "fused" else alone(node)

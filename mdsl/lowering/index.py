"""Index arithmetic over row-major arrays (possibly padded, possibly broadcast), which both backends turn
into code: an element of a loop over a shape, located in an array that the loop reads or writes."""
from __future__ import annotations

import math


def contiguous_strides(shape: tuple) -> tuple:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def merged_dims(shape: tuple, operand_shape: tuple, operand_strides: tuple) -> list:
    """(loop size, operand stride) per dim of a loop over `shape`, outermost first: the operand is
    aligned to the right of the loop and broadcast along its dims of size 1; dims of size 1 are
    dropped and neighbours that are contiguous with each other merged, so that a contiguous operand of
    the loop's shape is one dim, indexed by the loop's flat index itself. An element's offset is the sum
    over the dims of (index / inner size % size) * stride (no modulo on the outermost)."""
    pad = len(shape) - len(operand_shape)
    dims: list = []
    for d, size in enumerate(shape):
        if size == 1:
            continue
        k = d - pad
        stride = operand_strides[k] if k >= 0 and operand_shape[k] != 1 else 0
        if dims and dims[-1][1] == stride * size:
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    return dims


def broadcast_strides(space: tuple, shape: tuple) -> tuple:
    """Strides over `space` that are its contiguous ones along the dims an array of `shape` is broadcast
    along (those it lacks or has of size 1) and 0 elsewhere: an offset with them is 0 exactly where an
    element's coordinates are 0 along those dims (the one element that writes a broadcast output)."""
    pad = len(space) - len(shape)
    return tuple(s if (d < pad or shape[d - pad] == 1) else 0 for d, s in enumerate(contiguous_strides(space)))


def part_extent(shape: tuple, fmap, forloop: int) -> list:
    """The extent along each dim of a block's part of an input's device tensor: its tile's, times the loop's
    iterations along its fmap (None: none)."""
    return [n * (forloop if d == fmap else 1) for d, n in enumerate(shape)]


def part_steps(dim_map: tuple, extent: list, strides: tuple) -> list:
    """(grid axis, elements): how far a block's part of a device tensor starts along it per block of that
    axis, for the axes an imap or omap (`dim_map`: a tensor dim per grid axis, or None) maps to a dim."""
    return [(g, extent[d] * strides[d]) for g, d in enumerate(dim_map) if d is not None]


def vector_space(shape: tuple, vector: int) -> tuple:
    """The loop of a copy of an array of `shape` in vectors of `vector` elements along its last dim."""
    shape = shape or (1,)
    return shape[:-1] + (shape[-1] // vector,)


def vector_strides(strides: tuple, vector: int) -> tuple:
    """An array's strides in a copy's vectors of `vector` elements (see `vector_space`)."""
    strides = strides or (1,)
    return strides[:-1] + (strides[-1] * vector,)


def element_batch(n: int, block: int, unroll: int) -> int:
    """Elements of a block's loop over n that each thread takes a trip, every one loaded before any is
    stored (both backends' element-wise chains on shared-memory tiles): a store to shared memory may alias
    a later load, so the compiler keeps that load behind it, and a loop of one element at a time (unrolled
    or not) waits a whole round trip per element. `unroll` where it divides a thread's trips, else their
    largest common divisor; 1 where n is not whole trips of the block."""
    if n % block:
        return 1
    return math.gcd(n // block, unroll)

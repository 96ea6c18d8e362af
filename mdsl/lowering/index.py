"""Index arithmetic over row-major arrays (possibly padded, possibly broadcast), which both backends turn
into code: an element of a loop over a shape, located in an array that the loop reads or writes."""
from __future__ import annotations


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

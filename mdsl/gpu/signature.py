"""The signature of a GPU call: what its argument checks and launch configuration depend on, read from
its arrays without checking them. A module of its own that imports nothing, so that a frontend can key
its calls without loading the runtime (nor cuda.bindings) on a host call."""
from __future__ import annotations

from typing import Sequence


def signature(values: Sequence) -> tuple:
    """Per array: its type, shape, dtype, whether it is on the GPU and on which one, and whether it is
    compact row-major (every check of an array but its alignment, which depends on where its data
    starts). AttributeError for a value that is neither a torch tensor nor a DeviceArray (nor shaped
    like one): the checks of such arrays are made at every call."""
    return tuple([(type(v), v.shape, v.dtype, v.is_cuda, v.get_device(), v.is_contiguous()) for v in values])


def as_outputs(out) -> tuple:
    """`out=` as a tuple of arrays: one array, or a tuple or list with one per output."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def call_key(args: Sequence, out, stream, backend: str) -> tuple:
    """A call's key: the backend, whether a stream is given (the stream itself is read at every call),
    the signatures of its out= arrays and of its arguments (`signature`'s, written out: this runs at every
    call). An exception (AttributeError, or TypeError for an unhashable part) where an argument's checks
    are made at every call."""
    return (backend, stream is None, None if out is None else signature(as_outputs(out)),
            *[(type(v), v.shape, v.dtype, v.is_cuda, v.get_device(), v.is_contiguous()) for v in args])

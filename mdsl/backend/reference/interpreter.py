"""A numpy interpreter for every level of the mugraph: the oracle that other backends and the
verifier are tested against.

The walk over the graphs (all blocks side by side, loop iteration by loop iteration, on copies of the
tiles each block would load) is `mdsl.ir.evaluate`'s; this module gives it the float semantics:
operators are evaluated through the registry (`OpDef.reference`) in float64 or float32.
"""
from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from mdsl.errors import DTypeError, ShapeError
from mdsl.ir import evaluate
from mdsl.ir.dtypes import DType, i32, round_to_dtype
from mdsl.ir.evaluate import WIDEN_ELEMENTS
from mdsl.ir.graph import BlockGraph, KernelGraph, Node, ThreadGraph
from mdsl.ir.types import TensorType, Var

_PRECISIONS = {"float64": np.float64, "float32": np.float32}


def _float_type(precision: str) -> type:
    try:
        return _PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {sorted(_PRECISIONS)}, got {precision!r}") from None


@attrs.frozen
class FloatSemantics:
    """Values are float arrays of one precision. With `round_storage`, every tensor in device memory
    (inputs and kernel-level node outputs) is rounded to its dtype, as the GPU stores it; arithmetic
    itself stays in the precision.

    A float input no wider than the precision is used as given, not copied (the verifier's float32
    inputs under float64: a weight of 8192 x 8192 would take another 512 MB), and widened where an
    operator reads it: a matmul in pieces of its output (`_matmul`), every other operator whole."""

    ftype: type
    round_storage: bool = False

    def take_input(self, var: Var, array) -> np.ndarray:
        array = np.asarray(array)
        if array.shape != var.shape:
            raise ShapeError(f"input %{var.name} must have shape {list(var.shape)}, got {list(array.shape)}")
        integral = array.dtype.kind in "iu"
        if not (array.dtype.kind == "f" or (integral and var.dtype == i32)):
            raise DTypeError(f"input %{var.name} ({var.type}) cannot be given an array of dtype {array.dtype}",
                             hint="pass floating-point data (integer arrays only for i32 tensors)")
        if array.dtype.kind == "f" and array.dtype.itemsize <= np.dtype(self.ftype).itemsize:
            array = array.view()
            array.flags.writeable = False   # the caller's array: nothing writes into it
            return array
        return np.array(array, dtype=self.ftype)

    def store(self, var: Var, value: np.ndarray) -> np.ndarray:
        if not self.round_storage or _holds(value, var.dtype):
            return value
        # reshape: round_to_dtype turns a rank-0 bf16 value into shape (1,)
        return round_to_dtype(value, var.dtype).reshape(var.shape)

    def convert(self, value) -> np.ndarray:
        return np.asarray(value, dtype=self.ftype)

    def shape(self, value: np.ndarray) -> tuple:
        return value.shape

    def apply(self, node: Node, args: list) -> list:
        if node.op == "matmul":
            return [_matmul(*args, self.ftype)]
        return node.opdef.reference([self.convert(a) for a in args], node.attr_dict)

    def accumulate(self, node: Node, iterations: list) -> list:
        return node.opdef.reference(iterations, node.attr_dict)

    def fold(self, node: Node) -> None:
        """No running form: the reference accumulates every iteration's inputs at once (its float sums in
        the reference's own order)."""
        return None

    def empty(self, type_: TensorType) -> np.ndarray:
        return np.full(type_.shape, np.nan, dtype=self.ftype)  # NaN poison: an unwritten element shows


#: The numpy float types each dtype holds every value of.
_HOLDS = {"f16": (np.float16,), "f32": (np.float16, np.float32)}
#: A matmul widens its larger operand in pieces of about this many elements: fewer and larger than
#: WIDEN_ELEMENTS, as every BLAS call has a cost of its own (it wakes BLAS's threads).
MATMUL_PIECE_ELEMENTS = 4 * WIDEN_ELEMENTS


def _holds(value: np.ndarray, dtype: DType) -> bool:
    """Whether every element of `value` is one that `dtype` holds exactly (rounding would change nothing:
    an input already rounded to its dtype is not copied). Checked in pieces of WIDEN_ELEMENTS."""
    if value.dtype.type in _HOLDS.get(dtype.name, ()):
        return True
    flat = value.reshape(-1)
    for start in range(0, flat.size, WIDEN_ELEMENTS):
        piece = flat[start:start + WIDEN_ELEMENTS]
        with np.errstate(over="ignore", invalid="ignore"):
            if not np.array_equal(round_to_dtype(piece, dtype).reshape(piece.shape), piece, equal_nan=True):
                return False
    return True


def _matmul(a: np.ndarray, b: np.ndarray, ftype: type) -> np.ndarray:
    """np.matmul(a, b) in `ftype` (the registry's matmul), widening a narrower operand of more than
    MATMUL_PIECE_ELEMENTS in pieces: the larger operand's columns (b) or rows (a), each product over
    the whole of K, so that every output element is the same dot product as in one call."""
    big = b if b.size >= a.size else a
    if big.dtype == ftype or big.size <= MATMUL_PIECE_ELEMENTS:
        return np.matmul(np.asarray(a, dtype=ftype), np.asarray(b, dtype=ftype))
    axis = -1 if big is b else -2   # the output's columns follow b's, its rows a's
    per = max(1, MATMUL_PIECE_ELEMENTS // (big.size // big.shape[axis]))
    a, b = (np.asarray(x, dtype=ftype) if x is not big else x for x in (a, b))
    out = np.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), dtype=ftype)
    for start in range(0, big.shape[axis], per):
        piece = slice(start, start + per)
        if big is b:
            out[..., piece] = np.matmul(a, b[..., piece].astype(ftype))
        else:
            out[..., piece, :] = np.matmul(a[..., piece, :].astype(ftype), b)
    return out


def run_kernel_graph(graph: KernelGraph, inputs: Sequence[np.ndarray], *, precision: str = "float64",
                     round_storage: bool = False) -> list:
    """Evaluate a kernel graph on numpy arrays; the outputs are arrays of the computation precision.

    With `round_storage`, every tensor in device memory (inputs and node outputs) is rounded to its
    dtype, as the GPU stores it; arithmetic itself stays in `precision`.
    """
    return evaluate.run_kernel_graph(graph, inputs, FloatSemantics(_float_type(precision), round_storage))


def run_block_graph(bg: BlockGraph, inputs: Sequence[np.ndarray], *, precision: str = "float64") -> list:
    """Evaluate a custom kernel on the whole device tensors it reads; returns the tensors it writes."""
    return evaluate.run_block_graph(bg, inputs, FloatSemantics(_float_type(precision)))


def run_thread_graph(tg: ThreadGraph, inputs: Sequence[np.ndarray], precision: str = "float64") -> list:
    """Evaluate an element-wise chain (numpy broadcasting applies between operands)."""
    return evaluate.run_thread_graph(tg, inputs, FloatSemantics(_float_type(precision)))

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
from mdsl.ir.dtypes import i32, round_to_dtype
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
    itself stays in the precision."""

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
        return np.array(array, dtype=self.ftype)  # a copy: the caller's array is never aliased

    def store(self, var: Var, value: np.ndarray) -> np.ndarray:
        if not self.round_storage:
            return value
        # reshape: round_to_dtype turns a rank-0 bf16 value into shape (1,)
        return round_to_dtype(value, var.dtype).reshape(var.shape)

    def convert(self, value) -> np.ndarray:
        return np.asarray(value, dtype=self.ftype)

    def shape(self, value: np.ndarray) -> tuple:
        return value.shape

    def apply(self, node: Node, args: list) -> list:
        return node.opdef.reference(args, node.attr_dict)

    def accumulate(self, node: Node, iterations: list) -> list:
        return node.opdef.reference(iterations, node.attr_dict)

    def empty(self, type_: TensorType) -> np.ndarray:
        return np.full(type_.shape, np.nan, dtype=self.ftype)  # NaN poison: an unwritten element shows


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

"""Helpers for writing CUDA C++ source: an indenting writer, literals, element types, and the C
expressions of the lowering's index arithmetic (mdsl.lowering.index) over row-major (possibly padded,
possibly broadcast) arrays."""
from __future__ import annotations

import contextlib
from typing import Iterator

import attrs
import numpy as np

from mdsl.ir.dtypes import DType
from mdsl.ir.graph import Node
from mdsl.lowering.index import contiguous_strides, merged_dims
from mdsl.lowering.names import OP_MARKER, describe

_CTYPES = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float", "i32": "int"}


def ctype(dtype: DType) -> str:
    return _CTYPES[dtype.name]


def element_ctype(dtype_name: str) -> str:
    """The C type of a dtype named by the lowering's plans ("f16": `__half`)."""
    return _CTYPES[dtype_name]


def float_literal(value: float) -> str:
    """A C float literal of the value rounded to f32 (the precision the kernels compute in)."""
    with np.errstate(over="ignore"):
        v = np.float32(value)
    if np.isnan(v):
        return "__int_as_float(0x7fc00000)"
    if np.isinf(v):
        return "mdsl::neg_inf()" if v < 0 else "(-mdsl::neg_inf())"
    text = str(v)  # numpy's shortest text that reads back to the same f32
    return f"{text}f" if ("." in text or "e" in text) else f"{text}.0f"


class CodeWriter:
    def __init__(self):
        self.lines: list = []
        self.depth = 0

    def __call__(self, *lines: str) -> None:
        for text in lines:
            self.lines.append(("  " * self.depth + text) if text else "")

    @contextlib.contextmanager
    def block(self, header: str) -> Iterator[None]:
        """`header {`, the body indented, `}`."""
        self(f"{header} {{")
        self.depth += 1
        yield
        self.depth -= 1
        self("}")

    def op(self, node: Node) -> None:
        self(OP_MARKER + describe(node))

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# ---------------------------------------------------------------------------------------------
# index arithmetic


@attrs.frozen
class Operand:
    """An array in memory as the emitted code sees it: a C pointer expression, the element type it
    is stored as, its shape and its strides (in elements)."""

    ptr: str
    ctype: str
    shape: tuple
    strides: tuple

    @classmethod
    def contiguous(cls, ptr: str, ctype_: str, shape: tuple) -> "Operand":
        return cls(ptr, ctype_, tuple(shape), contiguous_strides(tuple(shape)))

    def viewed(self, shape: tuple, strides: tuple) -> "Operand":
        return attrs.evolve(self, shape=tuple(shape), strides=tuple(strides))

    def at(self, offset: str) -> str:
        return f"{self.ptr}[{offset}]"


def offset(index: str, shape: tuple, operand: Operand) -> str:
    """The C expression of the offset in `operand` of element `index` (a variable: the row-major flat index of a
    loop over `shape`; see mdsl.lowering.index.merged_dims)."""
    dims = merged_dims(shape, operand.shape, operand.strides)
    terms, inner = [], 1
    for k in reversed(range(len(dims))):
        size, stride = dims[k]
        if stride:
            coord = index if inner == 1 else f"{index} / {inner}"
            if k > 0:
                coord = f"({coord}) % {size}" if inner != 1 else f"{coord} % {size}"
            terms.append(coord if stride == 1 else f"{coord} * {stride}")  # * and / and % associate left
        inner *= size
    return " + ".join(reversed(terms)) or "0"

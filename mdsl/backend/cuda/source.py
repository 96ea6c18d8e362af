"""Helpers for writing CUDA C++ source: an indenting writer, C identifiers made from value names,
literals, element types, and index arithmetic over row-major (possibly padded, possibly broadcast)
arrays."""
from __future__ import annotations

import contextlib
import re
from typing import Iterator, Optional

import attrs
import numpy as np

from mdsl.ir.dtypes import DType
from mdsl.ir.graph import Node
from mdsl.ir.text import format_attrs

#: Marks the comment naming the mugraph op whose code follows (compile errors point back through it).
OP_MARKER = "// mugraph: "

_CTYPES = {"f16": "__half", "bf16": "__nv_bfloat16", "f32": "float", "i32": "int"}

# C++ keywords and CUDA names that a sanitised value name must not shadow
_RESERVED = frozenset("""
alignas alignof and asm auto bool break case catch char class const constexpr continue decltype default delete do
double else enum explicit extern false float for friend goto if inline int long namespace new noexcept not nullptr
operator or private protected public register return short signed sizeof static struct switch template this throw
true try typedef typename union unsigned using virtual void volatile while threadIdx blockIdx blockDim gridDim
warpSize smem mdsl
""".split())


def ctype(dtype: DType) -> str:
    return _CTYPES[dtype.name]


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


def c_identifier(name: str) -> str:
    """`name` as a C identifier: letters, digits and single underscores, never reserved."""
    ident = re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9_]", "_", name)).strip("_") or "v"
    if ident[0].isdigit() or ident in _RESERVED:
        ident = f"v_{ident}"
    return ident


class Namer:
    """Unique C identifiers within one scope."""

    def __init__(self, taken: Optional[set] = None):
        self.taken = set(taken or ())

    def __call__(self, name: str) -> str:
        base = c_identifier(name)
        ident, k = base, 1
        while ident in self.taken:
            ident = f"{base}_{k}"
            k += 1
        self.taken.add(ident)
        return ident


def describe(node: Node) -> str:
    """One line naming a mugraph op: `%y: f16[2, 8] = matmul(%x, %w)`."""
    outs = ", ".join(f"{v}: {v.type}" for v in node.outputs)
    attrs_text = format_attrs(node.attrs)
    return f"{outs} = {node.op}({', '.join(map(str, node.inputs))})" + (f" {attrs_text}" if attrs_text else "")


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


def contiguous_strides(shape: tuple) -> tuple:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


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
    loop over `shape`. The operand's shape is aligned to the right of `shape` and broadcast along its
    dims of size 1. Dims that are contiguous with each other are merged, so that a contiguous operand
    of the loop's shape is indexed by `index` itself."""
    pad = len(shape) - len(operand.shape)
    dims = []  # (loop size, operand stride), outermost first, merged where contiguous
    for d, size in enumerate(shape):
        if size == 1:
            continue
        k = d - pad
        stride = operand.strides[k] if k >= 0 and operand.shape[k] != 1 else 0
        if dims and dims[-1][1] == stride * size:
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
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

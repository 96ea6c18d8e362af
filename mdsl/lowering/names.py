"""Names in the emitted code, the same in both backends: C identifiers made from value names (kernels,
parameters, registers), unique within a scope, and the op marker, the comment naming the mugraph op whose
code follows (compile errors point back through it)."""
from __future__ import annotations

import re
from typing import Optional

from mdsl.ir.graph import Node
from mdsl.ir.text import format_attrs

#: Marks the comment naming the mugraph op whose code follows (compile errors point back through it).
OP_MARKER = "// mugraph: "

# C++ keywords and CUDA names that a sanitised value name must not shadow
_RESERVED = frozenset("""
alignas alignof and asm auto bool break case catch char class const constexpr continue decltype default delete do
double else enum explicit extern false float for friend goto if inline int long namespace new noexcept not nullptr
operator or private protected public register return short signed sizeof static struct switch template this throw
true try typedef typename union unsigned using virtual void volatile while threadIdx blockIdx blockDim gridDim
warpSize smem mdsl
""".split())


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


"""Streamed accumulation: a loop whose body only folds input tiles element by element.

The combining kernel of a split (flash decoding's second kernel, a split-K sum) loops over the splits
and folds each split's partial results into accumulators: no matmul, no reduction, nothing one
thread computes for another. Through shared memory each iteration costs a copy, a wait and two
barriers for a few hundred bytes, and the loop is a chain of memory latencies (measured on the H200:
16 iterations, 14 us). Here each thread owns elements of the accumulators and folds them over all
iterations straight from device memory, in registers: the loads of every iteration are independent,
so they are in flight together, and no barrier is needed until the accumulators are stored to their
tiles for the code after the loop.

`streamed_accumulators` says whether a block graph qualifies; each accumulator op's `cuda_streamed`
rule gives its start value and its step on registers.
"""
from __future__ import annotations

import math
from typing import Optional

import attrs

from mdsl.backend.cuda.source import Operand, offset
from mdsl.ir.graph import BlockGraph, Node
from mdsl.ir.ops import extend_op

FULL_UNROLL = 32   # loops up to this long are unrolled fully (every iteration's loads in flight together)


def streamed_accumulators(bg: BlockGraph, schedule) -> Optional[list]:
    """The loop's nodes (indices) when every one is an accumulator with a `cuda_streamed` rule that
    folds block inputs only, and the loop has more than one iteration; else None."""
    if bg.forloop <= 1 or not schedule.loop or schedule.pre:
        return None
    inputs = {i.var.name for i in bg.inputs}
    nodes = sorted(i for stage in schedule.loop for i in stage.nodes)
    for i in nodes:
        node = bg.nodes[i]
        rule = node.opdef.rules.get("cuda_streamed")
        if rule is None or not all(v.name in inputs for v in node.inputs) or not rule.accepts(node):
            return None
    return nodes


def emit_streamed(b, bg: BlockGraph, nodes: list, parts: dict) -> None:
    """Each accumulator folded over the loop by the threads owning its elements, into its tile."""
    inputs = {i.var.name: i for i in bg.inputs}
    for i in nodes:
        node = bg.nodes[i]
        rule = node.opdef.rules["cuda_streamed"]
        tile = b.tile(node.output)
        shape = tuple(tile.shape)
        b.w.op(node)
        b.w(f"// streamed: each thread folds its elements over the {bg.forloop} iterations from device memory")
        with b.threads.each(b.w, math.prod(shape)):   # unrolled: several elements' loads in flight too
            values = []
            for v in node.inputs:
                inp, part = inputs[v.name], parts[v.name]
                view = Operand(part.ptr, part.ctype, tuple(v.shape), part.strides)
                step = "" if inp.fmap is None else f" + it * {v.shape[inp.fmap] * part.strides[inp.fmap]}"
                values.append(f"mdsl::to_float({part.ptr}[{offset('i', shape, view)}{step}])")
            b.w(*rule.start())
            b.w(f"#pragma unroll {'' if bg.forloop <= FULL_UNROLL else 8}".rstrip())
            with b.w.block(f"for (int it = 0; it < {bg.forloop}; ++it)"):
                b.w(*rule.step(values))
            b.w(f"{tile.at(offset('i', shape, tile))} = mdsl::from_float<{tile.ctype}>(acc);")


@attrs.frozen
class Folding:
    """accum / accum_max: `acc` folds x."""

    identity: str
    fold: str      # C expression of acc and x

    def accepts(self, node: Node) -> bool:
        return tuple(node.inputs[0].shape) == tuple(node.output.shape)

    def start(self) -> list:
        return [f"float acc = {self.identity};"]

    def step(self, values: list) -> list:
        return [f"const float x = {values[0]};", f"acc = {self.fold};"]


class Rescaling:
    """accum_rescale(x, m): acc relative to the running maximum `top` of m, as `rules._Rescaling`."""

    def accepts(self, node: Node) -> bool:
        x, m = node.inputs
        out = tuple(node.output.shape)
        return tuple(x.shape) == out and len(m.shape) == len(out) and all(a in (1, b) for a, b in zip(m.shape, out))

    def start(self) -> list:
        return ["float acc = 0.0f, top = mdsl::neg_inf();"]

    def step(self, values: list) -> list:
        return [f"const float x = {values[0]};", f"const float m = {values[1]};",
                "const float next = fmaxf(top, m);",
                "acc = acc * mdsl::rescale(top, next) + x * mdsl::rescale(m, next);", "top = next;"]


_RULES = {
    "accum": Folding("0.0f", "acc + x"),
    "accum_max": Folding("mdsl::neg_inf()", "fmaxf(acc, x)"),
    "accum_rescale": Rescaling(),
}

for _name, _rule in _RULES.items():
    extend_op(_name, cuda_streamed=_rule)

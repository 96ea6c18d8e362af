"""Streamed accumulation as C++: the loops the lowering streams (mdsl.lowering.streamed, which says
which), each thread folding its accumulator elements over the iterations from device memory in
registers, by each op's rule in `CUDA_STREAMED_RULES` (its start value and its step)."""
from __future__ import annotations

import math

import attrs

from mdsl.backend.cuda.source import Operand, offset
from mdsl.ir.graph import BlockGraph
from mdsl.ir.rules import RuleTable
from mdsl.lowering.streamed import FULL_UNROLL, ROLLED_UNROLL, backend_table


def emit_streamed(b, bg: BlockGraph, nodes: tuple, parts: dict) -> None:
    """Each accumulator folded over the loop by the threads owning its elements, into its tile."""
    inputs = {i.var.name: i for i in bg.inputs}
    for i in nodes:
        node = bg.nodes[i]
        rule = CUDA_STREAMED_RULES[node.op]
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
            b.w(f"#pragma unroll {'' if bg.forloop <= FULL_UNROLL else ROLLED_UNROLL}".rstrip())
            with b.w.block(f"for (int it = 0; it < {bg.forloop}; ++it)"):
                b.w(*rule.step(values))
            b.w(f"{tile.at(offset('i', shape, tile))} = mdsl::from_float<{tile.ctype}>(acc);")


class StreamedFold:
    """An accumulator folded by each thread over the iterations in registers: `start()` its running
    state, `step(...)` one iteration's fold."""


@attrs.frozen
class Folding(StreamedFold):
    """accum / accum_max: `acc` folds x."""

    identity: str
    fold: str      # C expression of acc and x

    def start(self) -> list:
        return [f"float acc = {self.identity};"]

    def step(self, values: list) -> list:
        return [f"const float x = {values[0]};", f"acc = {self.fold};"]


class Rescaling(StreamedFold):
    """accum_rescale(x, m): acc relative to the running maximum `top` of m, as `rules._Rescaling`."""

    def start(self) -> list:
        return ["float acc = 0.0f, top = mdsl::neg_inf();"]

    def step(self, values: list) -> list:
        return [f"const float x = {values[0]};", f"const float m = {values[1]};",
                "const float next = fmaxf(top, m);",
                "acc = acc * mdsl::rescale(top, next) + x * mdsl::rescale(m, next);", "top = next;"]


#: op -> its rule: every op of mdsl.lowering.streamed.STREAMED_RULES
CUDA_STREAMED_RULES: RuleTable[StreamedFold] = backend_table(
    "CUDA backend's streamed loops", StreamedFold, "mdsl.backend.cuda.streamed (CUDA_STREAMED_RULES)")
for _name, _rule in {
    "accum": Folding("0.0f", "acc + x"),
    "accum_max": Folding("mdsl::neg_inf()", "fmaxf(acc, x)"),
    "accum_rescale": Rescaling(),
}.items():
    CUDA_STREAMED_RULES.register(_name, _rule)

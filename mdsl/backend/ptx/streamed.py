"""Streamed accumulation as LLVM IR: the loops the lowering streams (mdsl.lowering.streamed, which says
which), each thread folding its accumulator elements over the iterations straight from device memory, in
registers, by each op's rule in `PTX_STREAMED_RULES` (its running state and its step); every iteration's loads are
independent, so they are in flight together."""
from __future__ import annotations

import math

import attrs

from mdsl.backend.ptx.llvm import Array, f32, i32
from mdsl.backend.ptx.loops import rescale, weighted_sum
from mdsl.ir.graph import BlockGraph
from mdsl.ir.rules import RuleTable
from mdsl.lowering.streamed import FULL_UNROLL, ROLLED_UNROLL, backend_table


def emit_streamed(bk, bg: BlockGraph, nodes: tuple, parts: dict) -> None:
    """Each accumulator folded over the loop by the threads owning its elements, into its tile."""
    fn, b = bk.fn, bk.fn.b
    inputs = {i.var.name: i for i in bg.inputs}
    for index in nodes:
        node = bg.nodes[index]
        rule = PTX_STREAMED_RULES[node.op]
        tile = bk.tile(node.output)
        shape = tuple(tile.shape)
        fn.marker_for(node)

        def element(i, node=node, rule=rule, tile=tile, shape=shape) -> None:
            sources = []
            for v in node.inputs:
                inp, part = inputs[v.name], parts[v.name]
                view = Array(part.ptr, part.dtype, tuple(v.shape), part.strides)
                step = 0 if inp.fmap is None else v.shape[inp.fmap] * part.strides[inp.fmap]
                sources.append((view, fn.offset(i, shape, view), step))

            def values(it) -> list:
                return [fn.load_float(view, at if not step else b.add(at, i32(it * step) if isinstance(it, int)
                                                                       else b.mul(it, i32(step))))
                        for view, at, step in sources]

            state = rule.start()
            if bg.forloop <= FULL_UNROLL:
                for it in range(bg.forloop):
                    state = rule.step(fn, state, values(it))
            else:
                unroll = max(u for u in (ROLLED_UNROLL, 4, 2, 1) if bg.forloop % u == 0)
                running = [fn.var(s) for s in state]
                with fn.loop(i32(0), bg.forloop, unroll) as it:
                    state = [v.get() for v in running]
                    for u in range(unroll):
                        state = rule.step(fn, state, values(it if u == 0 else b.add(it, i32(u))))
                    for var, s in zip(running, state):
                        var.set(s)
                state = [v.get() for v in running]
            fn.store_float(tile, fn.offset(i, shape, tile), state[0])

        bk.threads.for_each(fn, math.prod(shape), element)


class StreamedFold:
    """An accumulator folded by each thread over the iterations in registers: `start()` its running
    state, `step(...)` one iteration's fold."""


@attrs.frozen
class Folding(StreamedFold):
    """accum / accum_max: the running value folds x."""

    identity: float
    fold: object      # (fn, acc, x) -> value

    def start(self) -> list:
        return [f32(self.identity)]

    def step(self, fn, state: list, values: list) -> list:
        return [self.fold(fn, state[0], values[0])]


class Rescaling(StreamedFold):
    """accum_rescale(x, m): the running value relative to the running maximum of m (state: value, maximum)."""

    def start(self) -> list:
        return [f32(0.0), f32(float("-inf"))]

    def step(self, fn, state: list, values: list) -> list:
        acc, top = state
        x, m = values
        nxt = fn.call_math("maxnum", top, m)
        return [weighted_sum(fn, acc, rescale(fn, top, nxt), x, rescale(fn, m, nxt)), nxt]


#: op -> its rule: every op of mdsl.lowering.streamed.STREAMED_RULES
PTX_STREAMED_RULES: RuleTable[StreamedFold] = backend_table(
    "PTX backend's streamed loops", StreamedFold, "mdsl.backend.ptx.streamed (PTX_STREAMED_RULES)")
for _name, _rule in {
    "accum": Folding(0.0, lambda fn, acc, x: fn.b.fadd(acc, x)),
    "accum_max": Folding(float("-inf"), lambda fn, acc, x: fn.call_math("maxnum", acc, x)),
    "accum_rescale": Rescaling(),
}.items():
    PTX_STREAMED_RULES.register(_name, _rule)

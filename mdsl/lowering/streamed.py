"""Streamed accumulation: a loop whose body only folds input tiles element by element.

The combining kernel of a split (flash decoding's second kernel, a split-K sum) loops over the splits
and folds each split's partial results into accumulators: no matmul, no reduction, nothing one thread
computes for another. Through shared memory each iteration costs a copy, a wait and two barriers for a
few hundred bytes, and the loop is a chain of memory latencies. Streamed, each thread owns elements of
the accumulators and folds them over all iterations straight from device memory, in registers: the
loads of every iteration are independent, so they are in flight together, and no barrier is needed
until the accumulators are stored to their tiles for the code after the loop.

`streamed_accumulators` says whether a block graph qualifies (each accumulator op's rule in
`STREAMED_RULES` says which nodes it folds this way); each backend writes the fold with its own rule of
the op (its start value and its step on registers).
"""
from __future__ import annotations

from typing import Optional

from mdsl.ir.graph import BlockGraph, Node
from mdsl.ir.rules import RuleTable

FULL_UNROLL = 32   # loops up to this long are unrolled fully (every iteration's loads in flight together)
ROLLED_UNROLL = 8  # a longer loop: this many iterations a trip


class StreamedRule:
    """An accumulator a streamed loop may fold: `accepts(node)` says whether this node qualifies."""

    def accepts(self, node: Node) -> bool:
        raise NotImplementedError


class Folding(StreamedRule):
    """accum / accum_max: the running value folds x, of its shape."""

    def accepts(self, node: Node) -> bool:
        return tuple(node.inputs[0].shape) == tuple(node.output.shape)


class Rescaling(StreamedRule):
    """accum_rescale(x, m): the running value relative to the running maximum of m (broadcast to x)."""

    def accepts(self, node: Node) -> bool:
        x, m = node.inputs
        out = tuple(node.output.shape)
        return tuple(x.shape) == out and len(m.shape) == len(out) and all(a in (1, b) for a, b in zip(m.shape, out))


#: op -> its rule: the accumulators a streamed loop may fold
STREAMED_RULES: RuleTable[StreamedRule] = RuleTable("streamed lowering", StreamedRule,
                                                    "mdsl.lowering.streamed (STREAMED_RULES)")
STREAMED_RULES.register("accum", Folding())
STREAMED_RULES.register("accum_max", Folding())
STREAMED_RULES.register("accum_rescale", Rescaling())


def backend_table(consumer: str, rule_type: type, where: str) -> RuleTable:
    """A backend's table of its folds: one for every op of `STREAMED_RULES`, with `start` and `step`."""
    return RuleTable(consumer, rule_type, where, needs=lambda op: op.name in STREAMED_RULES,
                     provides=lambda op: ("start", "step"))


def streamed_accumulators(bg: BlockGraph, schedule) -> Optional[list]:
    """The loop's nodes (indices) when every one is an accumulator whose rule accepts it and that folds
    block inputs only, and the loop has more than one iteration; else None."""
    if bg.forloop <= 1 or not schedule.loop or schedule.pre:
        return None
    inputs = {i.var.name for i in bg.inputs}
    nodes = sorted(i for stage in schedule.loop for i in stage.nodes)
    for i in nodes:
        node = bg.nodes[i]
        rule = STREAMED_RULES.get(node.op)
        if rule is None or not all(v.name in inputs for v in node.inputs) or not rule.accepts(node):
            return None
    return nodes

"""Dimension labels: which tensor dims of a kernel graph are "the same index".

Each operator's rule in `DIMS_RULES` relates its operands' dims to its results' dims and
names the dims it contracts. Joining these facts over a graph (union-find) labels every (tensor, dim)
pair; a label is an index of the program (rows, columns, the k of a matmul, the KV length of
attention). The guided search splits free labels across the grid and loops over a contracted one.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import attrs

from mdsl.ir.graph import KernelGraph, Node
from mdsl.ir.rules import RuleTable


@attrs.frozen
class DimFacts:
    """`same`: ((operand, dim), (result, dim)) pairs with one label; `joint`: operand dims with one
    label (a matmul's k); `contracted`: (operand, dim, kind) dims that the op reduces away or over."""

    same: tuple = ()
    joint: tuple = ()
    contracted: tuple = ()


def _aligned(node: Node) -> DimFacts:
    """Element-wise: numpy broadcasting aligns dims from the right; broadcast (size-1) dims are not tied."""
    out = node.outputs[0]
    same = []
    for i, v in enumerate(node.inputs):
        offset = out.type.rank - v.type.rank
        for d, size in enumerate(v.shape):
            if size == out.shape[d + offset]:
                same.append(((i, d), (0, d + offset)))
    return DimFacts(tuple(same))


def _matmul(node: Node) -> DimFacts:
    a, b = node.inputs
    out = node.outputs[0]
    r = out.type.rank
    same = [((0, a.type.rank - 2), (0, r - 2)), ((1, b.type.rank - 1), (0, r - 1))]
    for i, v in enumerate((a, b)):
        offset = r - v.type.rank
        for d in range(v.type.rank - 2):
            if v.shape[d] == out.shape[d + offset]:
                same.append(((i, d), (0, d + offset)))
    joint = (((0, a.type.rank - 1), (1, b.type.rank - 2)),)
    return DimFacts(tuple(same), joint, ((0, a.type.rank - 1, "matmul"),))


def _reduction(node: Node) -> DimFacts:
    d, keep = node.attr("dim"), node.attr("keepdim")
    rank = node.inputs[0].type.rank
    d %= rank
    same = [((0, i), (0, i if keep or i < d else i - 1)) for i in range(rank) if i != d]
    return DimFacts(tuple(same), (), ((0, d, node.op),))


def _rms_norm(node: Node) -> DimFacts:
    rank = node.inputs[0].type.rank
    d = node.attr("dim") % rank
    return DimFacts(tuple(((0, i), (0, i)) for i in range(rank)), (), ((0, d, "rms_norm"),))


def _transpose(node: Node) -> DimFacts:
    return DimFacts(tuple(((0, p), (0, i)) for i, p in enumerate(node.attr("perm"))))


def _concat(node: Node) -> DimFacts:
    d = node.attr("dim")
    return DimFacts(tuple(((i, k), (0, k)) for i, v in enumerate(node.inputs) for k in range(v.type.rank) if k != d))


def _split(node: Node) -> DimFacts:
    d = node.attr("dim")
    rank = node.inputs[0].type.rank
    return DimFacts(tuple(((0, k), (j, k)) for j in range(len(node.outputs)) for k in range(rank) if k != d))


def reshape_ties(before: tuple, after: tuple) -> tuple:
    """(dim of `before`, dim of `after`) pairs that a reshape from `before` to `after` splits alike: the dims
    it keeps (a common prefix and a common suffix) and, where it splits one dim into several or merges
    several into one, that one with the outermost of the several (of size over 1): n = g * s splits into
    p contiguous parts of n exactly where g's p parts are whole groups of s (p divides g)."""
    before, after = tuple(before), tuple(after)
    head = 0
    while head < min(len(before), len(after)) and before[head] == after[head]:
        head += 1
    tail = 0
    while tail < min(len(before), len(after)) - head and before[-1 - tail] == after[-1 - tail]:
        tail += 1
    ties = [(d, d) for d in range(head)]
    ties += [(len(before) - 1 - t, len(after) - 1 - t) for t in range(tail)]
    middle_before, middle_after = range(head, len(before) - tail), range(head, len(after) - tail)
    one, several, flip = (middle_before, middle_after, False) if len(middle_before) == 1 else \
        (middle_after, middle_before, True)
    shape = after if not flip else before
    outer = next((d for d in several if shape[d] > 1), None)
    if len(one) == 1 and outer is not None:
        ties.append((outer, one[0]) if flip else (one[0], outer))
    return tuple(sorted(ties))


def _reshape(node: Node) -> DimFacts:
    ties = reshape_ties(node.inputs[0].shape, node.outputs[0].shape)
    return DimFacts(tuple(((0, d), (0, e)) for d, e in ties))


def _opaque(node: Node) -> DimFacts:
    return DimFacts()


def _accumulator(node: Node) -> DimFacts:
    """Accumulators keep every dim but a last dim they reduce to 1; a rescale operand broadcasts."""
    out = node.outputs[0].shape
    same, contracted = [], []
    for i, v in enumerate(node.inputs):
        for d, n in enumerate(v.shape):
            if n == out[d]:
                same.append(((i, d), (0, d)))
            elif i == 0:
                contracted.append((0, d, node.op))
    return DimFacts(tuple(same), (), tuple(contracted))


_RULES = {"matmul": _matmul, "sum": _reduction, "mean": _reduction, "max": _reduction, "rms_norm": _rms_norm,
          "transpose": _transpose, "concat": _concat, "split": _split, "reshape": _reshape}
#: op -> node -> its DimFacts; an op without its own rule: aligned if element-wise, an accumulator's rule if
#: an accumulator, else opaque
DIMS_RULES: RuleTable[Callable] = RuleTable(
    "dimension labels", Callable, "mdsl.search.dims (DIMS_RULES)", needs=lambda op: True,
    by_category=lambda op: _aligned if op.is_elementwise else _accumulator if op.is_accumulator else _opaque)
for _name, _rule in _RULES.items():
    DIMS_RULES.register(_name, _rule)


@attrs.frozen
class Zip:
    """Labels of different tensors that one grid dim splits together, each tensor along its own: horizontal
    fusion of independent products of one input (the columns of q, k and v, each block computing its
    slice of each). No value carries two of them."""

    labels: tuple


class UnionFind:
    """Union-find over `parent` (key -> parent key; a root is its own parent), with path halving; a union
    makes the smaller root the representative, so labels are deterministic."""

    parent: dict

    def _find(self, key):
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def _union(self, a, b) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


class Labels(UnionFind):
    """Union-find over (value name, dim) pairs of one kernel graph."""

    def __init__(self, graph: KernelGraph):
        self.parent: dict = {}
        self.sizes: dict = {}
        self._gcd: Optional[dict] = None   # label -> the gcd of its dims' sizes (`size`), once labelling is done
        self.contractions: list = []  # (node, label, kind)
        for v in graph.inputs:
            self._add(v)
        for node in graph.nodes:
            for v in node.outputs:
                self._add(v)
            facts = DIMS_RULES[node.op](node)
            for (i, d), (j, e) in facts.same:
                self._union((node.inputs[i].name, d), (node.outputs[j].name, e))
            for (i, d), (j, e) in facts.joint:
                self._union((node.inputs[i].name, d), (node.inputs[j].name, e))
            for i, d, kind in facts.contracted:
                self.contractions.append((node, (node.inputs[i].name, d), kind))

    def _add(self, var) -> None:
        for d, size in enumerate(var.shape):
            self.parent[(var.name, d)] = (var.name, d)
            self.sizes[(var.name, d)] = size

    def label(self, var_name: str, dim: int):
        return self._find((var_name, dim))

    def size(self, label) -> int:
        """A label's size; where its dims differ in size (a reshape's dim n and the outermost g of the dims
        it splits n into) or for a Zip, the greatest common divisor of theirs (what a grid may split)."""
        if isinstance(label, Zip):
            return math.gcd(*(self.size(member) for member in label.labels))
        if self._gcd is None:
            self._gcd = {}
            for key, size in self.sizes.items():
                root = self._find(key)
                self._gcd[root] = math.gcd(self._gcd.get(root, 0), size)
        return self._gcd[label]

    def dim_of(self, var, label) -> Optional[int]:
        """The dim of `var` that carries `label` (for a Zip: one of its members; None if none; the first if
        several)."""
        members = label.labels if isinstance(label, Zip) else (label,)
        for d in range(var.type.rank):
            if self.label(var.name, d) in members and var.shape[d] > 1:
                return d
        return None

    def contracted_labels(self) -> dict:
        """label -> the kinds of contraction over it."""
        out: dict = {}
        for _, key, kind in self.contractions:
            out.setdefault(self._find(key), set()).add(kind)
        return out

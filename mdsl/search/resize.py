"""A program and its candidate mugraphs at other sizes: the same computation on smaller (or larger) tensors.

Two consumers:

* the reduced-instance screen (`mdsl.search.screen`): a candidate and its original shrunk together, so
  that a wrong candidate is rejected on a few thousand elements before the full-size verification;
* shape families (`mdsl.search.family`): a plan found for one size of the leading dim re-targeted to
  another, by lowering its mugraphs again at the new size, not by a search.

**Joint labels.** Every dim of every value of the graphs (the original, then each candidate), at every
level, gets a label (union-find, as `mdsl.search.dims.Labels` does for one kernel graph): each
operator's `dims` rule at the kernel, block and thread level (accumulators included) ties the dims it
keeps (an operand's dim of size 1 where operands broadcast only where its label is an index of the
program, some dim of it longer than 1: otherwise it is a broadcast, a bias's row); a custom node ties each operand's dims to its block input's tile dims and each block output's
tile dims to its result's; a fused node does the same with its thread graph; and every graph's inputs
and outputs are tied to the original's, which they read and return. A label's *extents* are the sizes
of its dims: a tensor's, and its tiles' (the tensor divided by the grid parts and loop iterations that
split it).

**Resizing.** Multiplying every extent of a label by one factor keeps each tile the same fraction of its
tensor, so grids, loops and maps stay as they are and each node computes the same function of its (smaller or
larger) operands. Every node's types are inferred again at every level (a reshape's shape taken from its
result's resized dims); a node that disagrees (a reshape whose element counts no longer match, a split's
sizes, a concat's sum, a grid that no longer divides) fixes the labels it touches at their sizes and the
resize is tried again. Labels whose size a float constant may encode (n, 1/n, √n, 1/√n: a mean's 1/n, an
attention scale; `sizes_in_constants`) keep their size, since a candidate that reads the size through a
constant would differ from an original that reads it through its shape.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence

import attrs

from mdsl.errors import MdslError
from mdsl.ir.graph import BlockGraph, BlockInput, BlockOutput, KernelGraph, Node, ThreadGraph
from mdsl.ir.types import Var
from mdsl.ir.validate import input_tile_type, output_tensor_type, validate_kernel_graph
from mdsl.search.dims import DIMS_RULES, UnionFind


class CannotResize(Exception):
    """A node whose types do not follow the new sizes; `labels` are the ones it touches."""

    def __init__(self, labels: frozenset):
        super().__init__()
        self.labels = labels


def _body_vars(body) -> tuple:
    """(inputs, outputs) of a block or thread graph as plain values."""
    if isinstance(body, BlockGraph):
        return [i.var for i in body.inputs], [o.var for o in body.outputs]
    return list(body.inputs), list(body.outputs)


class JointLabels(UnionFind):
    """Union-find over (scope, value name, dim) of `graphs` (the original first). A scope is a tuple:
    (graph index,) for a kernel graph, extended by the node index of each body it is inside."""

    def __init__(self, graphs: Sequence[KernelGraph]):
        self.graphs = list(graphs)
        self.parent: dict = {}
        self.extent: dict = {}
        self.weak: list = []   # (operand dim, result dim) pairs of size 1 where operands broadcast
        for g, graph in enumerate(self.graphs):
            scope = (g,)
            for v in graph.inputs:
                self._add(scope, v)
            self._nodes(scope, graph.nodes)
            if g:
                for a, b in zip(self.graphs[0].inputs, graph.inputs):
                    self._tie_values((0,), a, scope, b)
                for a, b in zip(self.graphs[0].outputs, graph.outputs):
                    self._tie_values((0,), a, scope, b)
        self._tie_weak()

    # -- building ----------------------------------------------------------------------------------

    def _add(self, scope: tuple, v: Var) -> None:
        for d, n in enumerate(v.shape):
            key = (scope, v.name, d)
            self.parent.setdefault(key, key)
            self.extent[key] = n

    def _nodes(self, scope: tuple, nodes: Iterable[Node]) -> None:
        for k, node in enumerate(nodes):
            for v in node.outputs:
                self._add(scope, v)
            if node.body is None:
                facts = DIMS_RULES[node.op](node)
                # an operand's dim of size 1 may be a broadcast (a bias's row) as well as an index of size
                # 1 (a tile's one row): such a pair is tied once the rest shows which (`_tie_weak`)
                broadcasts = len(node.inputs) > 1 and (node.opdef.is_elementwise or node.opdef.is_accumulator)
                for (i, d), (j, e) in facts.same:
                    pair = ((scope, node.inputs[i].name, d), (scope, node.outputs[j].name, e))
                    if broadcasts and node.inputs[i].shape[d] == 1:
                        self.weak.append(pair)
                    else:
                        self._union(*pair)
                for (i, d), (j, e) in facts.joint:
                    self._union((scope, node.inputs[i].name, d), (scope, node.inputs[j].name, e))
                continue
            inner = scope + (k,)
            ins, outs = _body_vars(node.body)
            for v in ins:
                self._add(inner, v)
            self._nodes(inner, node.body.nodes)
            for a, b in zip(node.inputs, ins):
                self._tie_values(scope, a, inner, b)
            for a, b in zip(outs, node.outputs):
                self._tie_values(inner, a, scope, b)

    def _tie_weak(self) -> None:
        """Tie each operand dim of size 1 to its result's dim where the operand's label is an index of the
        program (some dim of it is longer than 1: a tile's one row); one whose every dim is 1 is a
        broadcast (a bias's row) and stays apart. Ties can make other labels indices: until none changes."""
        changed = True
        while changed:
            changed = False
            longest: dict = {}
            for key, n in self.extent.items():
                root = self._find(key)
                longest[root] = max(longest.get(root, 1), n)
            for a, b in self.weak:
                if self._find(a) != self._find(b) and longest[self._find(a)] > 1:
                    self._union(a, b)
                    changed = True

    def _tie_values(self, scope_a: tuple, a: Var, scope_b: tuple, b: Var) -> None:
        for d in range(min(a.type.rank, b.type.rank)):
            self._union((scope_a, a.name, d), (scope_b, b.name, d))

    # -- reading -----------------------------------------------------------------------------------

    def label(self, scope: tuple, name: str, dim: int):
        return self._find((scope, name, dim))

    def original_label(self, var: Var, dim: int):
        """The label of dim `dim` of a value of the original's kernel graph."""
        return self.label((0,), var.name, dim)

    def labels(self) -> set:
        return {self._find(k) for k in self.parent}

    def extents(self) -> dict:
        """label -> the set of sizes its dims have."""
        out: dict = {}
        for key, n in self.extent.items():
            out.setdefault(self._find(key), set()).add(n)
        return out

    # -- resizing ----------------------------------------------------------------------------------

    def resized(self, new_extent: Callable, fixed: Iterable = ()) -> tuple:
        """(the graphs with every extent n of label L replaced by `new_extent(L, n)`, the labels that
        had to keep their sizes). A label in `fixed`, or one a node's rule ties to its size, keeps it;
        `new_extent` returns None for an extent it cannot resize (which fixes the label too)."""
        fixed = set(fixed)
        while True:
            try:
                graphs = [self._graph((g,), graph, lambda L, n: n if L in fixed else new_extent(L, n))
                          for g, graph in enumerate(self.graphs)]
                return graphs, frozenset(fixed)
            except CannotResize as e:
                if e.labels <= fixed:   # at the old sizes already: nothing more to fix
                    raise
                fixed |= e.labels

    def _graph(self, scope: tuple, graph: KernelGraph, size: Callable) -> KernelGraph:
        env = {v.name: self._retyped(scope, v, size) for v in graph.inputs}
        nodes = [self._node(scope, k, node, env, size) for k, node in enumerate(graph.nodes)]
        return KernelGraph(graph.name, [env[v.name] for v in graph.inputs], nodes,
                           [env[v.name] for v in graph.outputs])

    def _retyped(self, scope: tuple, v: Var, size: Callable) -> Var:
        shape = []
        for d, n in enumerate(v.shape):
            label = self.label(scope, v.name, d)
            m = size(label, n)
            if m is None or m < 1 or m != int(m):
                raise CannotResize(frozenset({label}))
            shape.append(int(m))
        return Var(v.name, v.type.with_shape(shape))

    def _touched(self, scope: tuple, variables: Iterable[Var]) -> frozenset:
        return frozenset(self.label(scope, v.name, d) for v in variables for d in range(v.type.rank))

    def _node(self, scope: tuple, k: int, node: Node, env: dict, size: Callable) -> Node:
        args = [env[v.name] for v in node.inputs]
        want = [self._retyped(scope, v, size) for v in node.outputs]
        if node.body is None:
            # a reshape's shape is its result's, each dim resized with its label (a result dim its rule does not
            # tie to an operand's keeps its size: the element counts then disagree and the resize fixes them)
            node_attrs = node.attrs if node.op != "reshape" else \
                tuple((name, tuple(want[0].shape) if name == "shape" else value) for name, value in node.attrs)
            try:
                got = list(node.opdef.infer_types(tuple(a.type for a in args), node_attrs))
            except (MdslError, ValueError):
                got = None
            if got != [v.type for v in want]:
                raise CannotResize(self._touched(scope, [*node.inputs, *node.outputs]))
            env.update((v.name, v) for v in want)
            return attrs.evolve(node, inputs=args, outputs=want, attrs=node_attrs)
        inner = scope + (k,)
        body = self._block(inner, node, args, want, size) if isinstance(node.body, BlockGraph) \
            else self._thread(inner, node.body, args, want, size)
        env.update((v.name, v) for v in want)
        return attrs.evolve(node, inputs=args, outputs=want, body=body)

    def _block(self, scope: tuple, node: Node, args: list, want: list, size: Callable) -> BlockGraph:
        body: BlockGraph = node.body
        env: dict = {}
        inputs = []
        for inp, tensor in zip(body.inputs, args):
            tile = self._retyped(scope, inp.var, size)
            try:
                fits = input_tile_type(tensor.type, body.grid, body.forloop, inp.imap, inp.fmap) == tile.type
            except MdslError:
                fits = False
            if not fits:
                raise CannotResize(self._touched(scope, [inp.var]))
            env[tile.name] = tile
            inputs.append(BlockInput(tile, inp.imap, inp.fmap))
        nodes = [self._node(scope, k, n, env, size) for k, n in enumerate(body.nodes)]
        outputs = []
        for out, result in zip(body.outputs, want):
            tile = env[out.var.name]
            try:
                fits = output_tensor_type(tile.type, body.grid, out.omap) == result.type
            except MdslError:
                fits = False
            if not fits:
                raise CannotResize(self._touched(scope, [out.var]))
            outputs.append(BlockOutput(tile, out.omap))
        return attrs.evolve(body, inputs=inputs, nodes=nodes, outputs=outputs)

    def _thread(self, scope: tuple, body: ThreadGraph, args: list, want: list, size: Callable) -> ThreadGraph:
        env = {}
        inputs = []
        for v, arg in zip(body.inputs, args):
            tile = self._retyped(scope, v, size)
            if tile.type != arg.type:
                raise CannotResize(self._touched(scope, [v]))
            env[tile.name] = tile
            inputs.append(tile)
        nodes = [self._node(scope, k, n, env, size) for k, n in enumerate(body.nodes)]
        outputs = [env[v.name] for v in body.outputs]
        if [v.type for v in outputs] != [v.type for v in want]:
            raise CannotResize(self._touched(scope, body.outputs))
        return attrs.evolve(body, inputs=inputs, nodes=nodes, outputs=outputs)


# ---------------------------------------------------------------------------------------------
# constants that may stand for a size

def seen_attributes(graph) -> dict:
    """(attribute name, kind) -> the values a graph uses, bodies included (scalars, eps, clamp bounds, dtypes)."""
    seen: dict = {}
    for node in graph.nodes:
        specs = {s.name: s for s in node.opdef.attr_specs}
        for name, value in node.attrs:
            seen.setdefault((name, specs[name].kind), {})[value] = None
        if node.body is not None:
            for key, values in seen_attributes(node.body).items():
                seen.setdefault(key, {}).update(values)
    return seen


def encodes_size(constants: Sequence[float], n: int) -> bool:
    """Whether one of the constants may stand for a size n: n, 1/n, √n or 1/√n."""
    return n > 1 and any(math.isclose(c, f) for c in constants
                         for f in (n, 1 / n, math.sqrt(n), 1 / math.sqrt(n)))


def float_constants(graphs: Iterable) -> list:
    return [abs(float(v)) for graph in graphs for (_, kind), values in seen_attributes(graph).items()
            if kind == "float" for v in values if v]


def sizes_in_constants(labels: JointLabels) -> set:
    """The labels of which some extent may be encoded by a float constant of any of the graphs."""
    constants = float_constants(labels.graphs)
    return {label for label, sizes in labels.extents().items() if any(encodes_size(constants, n) for n in sizes)}


# ---------------------------------------------------------------------------------------------
# the two resizes

#: The extent the smallest dim of each label takes in a reduced instance (a label's tiles shrink to it).
REDUCED_TILE = 4


def _shrink_factor(sizes: set, smallest: int) -> int:
    """The largest factor dividing every size that leaves the smallest at least `smallest` (1: none)."""
    g = math.gcd(*sizes)
    low = min(sizes)
    best = 1
    for f in range(2, g + 1):
        if g % f == 0 and low // f >= smallest:
            best = f
    return best


def reduced(graphs: Sequence[KernelGraph], smallest: int = REDUCED_TILE) -> Optional[tuple]:
    """The graphs (an original and its candidates) with every label shrunk by the largest factor that
    divides all its extents and leaves its smallest at least `smallest` (labels whose sizes a constant
    may encode, or that a node's rule fixes, keep theirs); None where nothing shrinks, or the result
    does not validate."""
    labels = JointLabels(graphs)
    factors = {label: _shrink_factor(sizes, smallest) for label, sizes in labels.extents().items()}
    keep = sizes_in_constants(labels) | {label for label, f in factors.items() if f == 1}
    try:
        out, fixed = labels.resized(lambda label, n: n // factors[label], keep)
    except CannotResize:
        return None
    if fixed >= set(factors):
        return None
    try:
        for g in out:
            validate_kernel_graph(g)
    except MdslError:
        return None
    return tuple(out)


def elements(graph: KernelGraph) -> int:
    """Elements of every kernel-level tensor of a graph (inputs included): what evaluating it holds."""
    return sum(v.type.numel for v in (*graph.inputs, *(o for n in graph.nodes for o in n.outputs)))

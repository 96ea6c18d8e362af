"""Layout changes inside a part: moved to its boundary or cancelled, so that the rest lifts into one kernel.

A layout operator has no block-level rule (`guided.LIFT_RULES`) but a concat of whole rows and a reshape of
tiles that hold whole groups, so a part that contains one mostly does not lift as it is. Two rewrites take
most of them out of a part's interior; a reshape they cannot take out stays in the core (the lifting
decides whether its tiles hold whole groups: a projection regrouped into heads and normalised per head),
and any other leaves the part as it was:

* **A view moves to the boundary.** A reshape launches nothing (`mdsl.lowering.views`): one that reads a part's
  input, or whose result only leaves the part, is a view around the kernel, not in it. Element-wise
  operators commute with it (each element is computed from the elements at its own position), so a
  reshape moves back past the element-wise operators that produce its operand, toward the inputs, and
  forward past the element-wise operators that read its result, toward the outputs. The other operands
  of a moved operator are reshaped with it: one of the same shape as a whole, a broadcast one (a bias
  row, a per-row scalar) where it has all of the dims the reshape regroups or none of them.
* **A split at the boundary is a view too.** A split that reads a part's input stays before the kernel: its
  parts are strided views of the input that the kernel reads in place (`mdsl.lowering.views`), so siblings
  reading its parts (a gate and an up half, q, k and v) share one kernel. A split whose parts only leave
  the part stays after it: its parts are views of the value the kernel writes, for the kernels after it.
  A split inside the part (a part read there) of an element-wise operator's result moves back past it toward
  the inputs, as a reshape does: the operator runs once a part, on the parts of its operands (split alike;
  one broadcast along the split dim is read whole by each), so a split inside a chain (an activation's
  value cut into halves that later steps read) becomes views of the part's inputs. A split of a product's
  columns moves to its weight: one product a part, sharing their input (a gate and an up cut from one
  weight's product, as Phi-3 stores them, become the gated pair the lifting fuses).
* **A split joined again is its operand.** A concat of a split's parts, all of them in order along its dim,
  is the split's operand: its readers read that (before anything moves, so that the split does not move
  apart what the concat joins); where the part returns the concat by name, the operand's producer writes
  it under that name.
* **Inverse pairs cancel.** A transpose forward past element-wise operators meets its inverse
  transpose (or a reshape its inverse reshape); the pair is removed, and the value it restored takes its
  name. A transpose of a value whose moved dims all have size 1 is a reshape.

The result (`boundary_views`) is the part's views on its inputs, a *core* whose layout operators all
lift (a concat of whole rows, a reshape that regroups whole tiles), and the views of the core's results
that the part returns; the core is what the lifting rules see. Each rewrite computes the same function as
the sub-program it came from (reshapes and transposes only move elements); the verifier checks the
assembled candidate against the sub-program regardless.
"""
from __future__ import annotations

from typing import Optional

import attrs

from mdsl.ir.graph import KernelGraph, Node
from mdsl.ir.ops import get_op
from mdsl.ir.types import Var, fresh_name
from mdsl.lowering.views import keeps_order

#: The layout operators these rewrites move or cancel.
MOVABLE = frozenset({"reshape", "transpose"})
#: The layout operators that stay at a part's boundary, views around its kernel: a reshape reading one of its
#: inputs or returning one of its outputs, and a split there.
AT_BOUNDARY = frozenset({"reshape", "split"})
#: The layout operators that `boundary_views` takes out of a part.
HANDLED = MOVABLE | AT_BOUNDARY
_ROUNDS = 64   # rewrites per part at most (each moves one operator one step or cancels a pair)


@attrs.frozen
class Wrapped:
    """A part as views on its inputs, a core whose operators all lift and views of the core's results."""

    leading: tuple    # reshape and split nodes reading the part's inputs
    core: KernelGraph
    trailing: tuple   # reshape and split nodes whose results the part returns

    def around(self, lifted: KernelGraph) -> list:
        """The part's nodes with the core replaced by `lifted` (a candidate for the core)."""
        return [*self.leading, *lifted.nodes, *self.trailing]


class _Rewrite:
    def __init__(self, graph: KernelGraph):
        self.graph = graph
        self.nodes = list(graph.nodes)
        self.inputs = {v.name for v in graph.inputs}
        self.outputs = {v.name for v in graph.outputs}
        self.taken = self.inputs | {v.name for n in graph.nodes for v in n.outputs}

    # -- helpers ---------------------------------------------------------------------------------

    def fresh(self, base: str) -> str:
        return fresh_name(base, self.taken)

    def producer(self, name: str) -> Optional[Node]:
        return next((n for n in self.nodes if any(v.name == name for v in n.outputs)), None)

    def readers(self, name: str) -> list:
        return [n for n in self.nodes if any(v.name == name for v in n.inputs)]

    def private(self, name: str) -> bool:
        """Whether the value is read by one node and not returned."""
        return name not in self.outputs and len(self.readers(name)) == 1

    def layout(self, op: str, x: Var, target: tuple, perm: Optional[tuple], out: Optional[Var] = None) -> Node:
        """A reshape of x to `target`, or a transpose by `perm` (a reshape where it moves only size-1 dims)."""
        if perm is not None and not keeps_order(x.shape, perm):
            return self._node("transpose", x, target, out, perm=tuple(perm))
        return self._node("reshape", x, target, out, shape=tuple(target))

    def _node(self, op: str, x: Var, target: tuple, out: Optional[Var], **attributes) -> Node:
        out = out if out is not None else Var(self.fresh(f"{x.name}_{op}"), x.type.with_shape(list(target)))
        return Node(op, [x], [out], get_op(op).normalize_attrs(attributes))

    def replace(self, old: Node, new: list) -> None:
        at = self.nodes.index(old)
        self.nodes[at:at + 1] = new

    def read_instead(self, name: str, x: Var) -> None:
        """Every reader of value `name` reads x instead."""
        self.nodes = [attrs.evolve(n, inputs=[x if v.name == name else v for v in n.inputs]) for n in self.nodes]

    # -- the rewrites ------------------------------------------------------------------------------

    def run(self) -> None:
        """Splits that a concat joins again removed first, then reshapes and splits back toward the inputs, then
        layout changes forward toward the outputs (a reshape already on an input stays there), cancelling the
        pairs that meet."""
        for _ in range(_ROUNDS):
            if not self._rejoined():
                break
        for _ in range(_ROUNDS):
            if not self._back():
                break
        for _ in range(_ROUNDS):
            if not (self._cancel() or self._forward()):
                break
        self._topological()
        self._drop_dead()

    def _cancel(self) -> bool:
        """L2(L1(x)) = x: the pair removed, x's producer renamed to L2's result (its only reader is L1); a concat
        of a split's parts in order, along its dim, is x too (`_rejoined`)."""
        if self._rejoined():
            return True
        for second in self.nodes:
            if second.op not in MOVABLE:
                continue
            first = self.producer(second.inputs[0].name)
            if first is None or first.op not in MOVABLE or not self.private(first.outputs[0].name):
                continue
            x, out = first.inputs[0], second.outputs[0]
            if x.shape != out.shape or not _restores(first, second):
                continue
            source = self.producer(x.name)
            if source is not None and self.private(x.name) and len(source.outputs) == 1:
                self.nodes.remove(first)
                self.replace(second, [])
                self.replace(source, [attrs.evolve(source, outputs=[Var(out.name, source.outputs[0].type)])])
                return True
            if out.name in self.outputs:
                continue   # x is an input or read elsewhere, and the part returns the pair's result by its name
            self.nodes.remove(first)
            self.replace(second, [])
            self.read_instead(out.name, x)
            return True
        return False

    def _rejoined(self) -> bool:
        """concat(split(x)) = x, the parts all in order along the split's dim: the concat's readers read x (the
        split stays where another reads its parts). Where the part returns the concat's result by name, x's
        producer writes it under that name instead (x's readers read it so); an x that is an input of the
        part, or a result of its own, has no producer to rename, and the concat stays."""
        for node in self.nodes:
            if node.op != "concat":
                continue
            split = self.producer(node.inputs[0].name)
            if split is None or split.op != "split" or \
                    [v.name for v in node.inputs] != [v.name for v in split.outputs]:
                continue
            rank = len(split.inputs[0].shape)
            if node.attr("dim") % rank != split.attr("dim") % rank:
                continue
            x, out = split.inputs[0], node.outputs[0]
            if out.name in self.outputs:
                source = self.producer(x.name)
                if source is None or x.name in self.outputs or len(source.outputs) != 1:
                    continue
                renamed = Var(out.name, x.type)
                self.nodes.remove(node)
                self.replace(source, [attrs.evolve(source, outputs=[renamed])])
                self.read_instead(x.name, renamed)
                return True
            self.nodes.remove(node)
            self.read_instead(out.name, x)
            return True
        return False

    def _forward(self) -> bool:
        """E(L(a), b) = L(E(a, L^-1(b))) for an element-wise E reading a layout change's result (L kept for
        its other readers)."""
        for node in self.nodes:
            if node.op not in MOVABLE or (node.op == "reshape" and node.inputs[0].name in self.inputs):
                continue   # a view of an input is at the boundary already
            u = node.outputs[0]
            for reader in self.readers(u.name):
                if not _elementwise(reader) or reader.outputs[0].shape != u.shape:
                    continue
                if node.op == "transpose" and not self.private(u.name):
                    continue   # a transpose is a kernel: moved only where it is not kept as well
                operands = self._operands(reader, u, node)
                if operands is None:
                    continue
                before, ins = operands
                a = node.inputs[0]
                out = reader.outputs[0]
                moved = attrs.evolve(reader, inputs=ins,
                                     outputs=[Var(self.fresh(out.name), out.type.with_shape(list(a.shape)))])
                after = self.layout(node.op, moved.outputs[0], out.shape, _perm(node), out)
                self.replace(reader, [*before, moved, after])
                return True
        return False

    def _operands(self, reader: Node, u: Var, node: Node) -> Optional[tuple]:
        """The reader's operands in the layout before `node` (layout nodes to add for the others), or None."""
        a = node.inputs[0]
        before, ins = [], []
        for v in reader.inputs:
            if v.name == u.name:
                ins.append(a)
                continue
            shape = _carried(v.shape, u.shape, a.shape, node, forward=True)
            if shape is None:
                return None
            if tuple(shape) == tuple(v.shape):
                ins.append(v)
                continue
            inverse = _inverse_perm(_perm(node)) if node.op == "transpose" else None
            before.append(self.layout(node.op, v, shape, inverse))
            if before[-1].op != "reshape":
                return None   # a transpose of another operand would be another kernel
            ins.append(before[-1].outputs[0])
        return before, ins

    def _back(self) -> bool:
        """R(E(a, b)) = E(R(a), R(b)) for a reshape R of an element-wise E's private result; a split's
        parts likewise (`_split_back`)."""
        for node in self.nodes:
            if node.op == "split" and self._split_back(node):
                return True
            if node.op != "reshape":
                continue
            v = node.inputs[0]
            source = self.producer(v.name)
            if source is None or not _elementwise(source) or not self.private(v.name):
                continue
            target = node.outputs[0].shape
            before, ins = [], []
            for w in source.inputs:
                shape = _carried(w.shape, v.shape, target, node, forward=False)
                if shape is None:
                    break
                if tuple(shape) == tuple(w.shape):
                    ins.append(w)
                    continue
                before.append(self.layout("reshape", w, shape, None))
                ins.append(before[-1].outputs[0])
            else:
                moved = attrs.evolve(source, inputs=ins, outputs=[node.outputs[0]])
                self.nodes.remove(source)
                self.replace(node, [*before, moved])
                return True
        return False

    def _split_back(self, node: Node) -> bool:
        """S(E(a, b))_i = E(S(a)_i, S(b)_i) for a split S of an element-wise E's private result: E once a part,
        each operand that has the split dim split as the result is (a bias row along columns too), one
        broadcast along it (size 1 there: a per-row scalar) read whole by every part; False (nothing changed)
        for an operand of another rank, and for a split whose parts only leave the part (a view of the
        kernel's result already)."""
        v = node.inputs[0]
        source = self.producer(v.name)
        if source is None or not self.private(v.name) or not any(self.readers(out.name) for out in node.outputs):
            return False
        dim = node.attr("dim") % len(v.shape)
        if source.op == "matmul":
            return self._split_product(node, source, dim)
        if not _elementwise(source):
            return False
        before, operands = [], []   # operands: per operand of E, its value for each part
        for w in source.inputs:
            if len(w.shape) != len(v.shape) or any(a not in (1, b) for a, b in zip(w.shape, v.shape)):
                return False
            if w.shape[dim] == 1 and v.shape[dim] != 1:
                operands.append([w] * len(node.outputs))
                continue
            parts = [Var(self.fresh(f"{w.name}_{k}"),
                         w.type.with_shape([out.shape[d] if d == dim else n for d, n in enumerate(w.shape)]))
                     for k, out in enumerate(node.outputs)]
            before.append(attrs.evolve(node, inputs=[w], outputs=parts))
            operands.append(parts)
        moved = [attrs.evolve(source, inputs=[ins[k] for ins in operands], outputs=[out])
                 for k, out in enumerate(node.outputs)]
        self.nodes.remove(source)
        self.replace(node, [*before, *moved])
        return True

    def _split_product(self, node: Node, product: Node, dim: int) -> bool:
        """S(x @ w)_i = x @ S(w)_i for a split S of a product's columns (its last dim): the weight's columns split
        alike (a view of an input, where the weight is one), one product a part, which share x (one kernel of
        them: horizontal fusion), as q, k and v do from one weight; False for a split along another dim."""
        if dim != len(node.inputs[0].shape) - 1:
            return False
        x, w = product.inputs
        parts = [Var(self.fresh(f"{w.name}_{k}"), w.type.with_shape([*w.shape[:-1], out.shape[-1]]))
                 for k, out in enumerate(node.outputs)]
        columns = {"sizes": node.attr("sizes"), "dim": len(w.shape) - 1}
        cut = attrs.evolve(node, inputs=[w], outputs=parts, attrs=get_op("split").normalize_attrs(columns))
        moved = [attrs.evolve(product, inputs=[x, part], outputs=[out]) for part, out in zip(parts, node.outputs)]
        self.nodes.remove(product)
        self.replace(node, [cut, *moved])
        return True

    # -- tidying -----------------------------------------------------------------------------------

    def _topological(self) -> None:
        defined = set(self.inputs)
        order, left = [], list(self.nodes)
        while left:
            ready = next(n for n in left if all(v.name in defined for v in n.inputs))
            left.remove(ready)
            order.append(ready)
            defined.update(v.name for v in ready.outputs)
        self.nodes = order

    def _drop_dead(self) -> None:
        while True:
            read = {v.name for n in self.nodes for v in n.inputs} | self.outputs
            live = [n for n in self.nodes if any(v.name in read for v in n.outputs)]
            if len(live) == len(self.nodes):
                return
            self.nodes = live


def _elementwise(node: Node) -> bool:
    return node.opdef.is_elementwise and len(node.outputs) == 1


def _perm(node: Node) -> Optional[tuple]:
    return tuple(node.attr("perm")) if node.op == "transpose" else None


def _inverse_perm(perm: tuple) -> tuple:
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return tuple(inverse)


def _restores(first: Node, second: Node) -> bool:
    """Whether second(first(x)) is x (shapes already agree)."""
    if first.op == "reshape" and second.op == "reshape":
        return True
    if first.op == "transpose" and second.op == "transpose":
        return tuple(_perm(first)[p] for p in _perm(second)) == tuple(range(len(_perm(first))))
    return False


def _carried(shape: tuple, full: tuple, target: tuple, node: Node, forward: bool) -> Optional[tuple]:
    """The shape of an operand of `full`'s shape (broadcast to it) carried through `node`'s layout change
    from `full` to `target` (`forward`: undoing it, from its result's layout to its operand's): the
    target itself for an operand of the full shape; for a transpose, its dims permuted; for a reshape,
    the dims it keeps with the regrouped ones (all of them, or 1s where the operand is broadcast along
    all of them: a bias row, a per-row scalar); else None."""
    shape, full, target = tuple(shape), tuple(full), tuple(target)
    if shape == full:
        return target
    if len(shape) != len(full) or any(s not in (1, f) for s, f in zip(shape, full)):
        return None
    if node.op == "transpose":
        perm = _inverse_perm(_perm(node)) if forward else _perm(node)
        return tuple(shape[p] for p in perm)
    # a reshape keeps the dims before the first it changes and regroups the rest: an operand keeps its
    # dims there (a broadcast row's 1s too) and is carried where it has all of the rest or none of it
    kept = next((i for i, (f, t) in enumerate(zip(full, target)) if f != t), min(len(full), len(target)))
    rest = shape[kept:]
    if rest == full[kept:]:
        return shape[:kept] + target[kept:]
    if all(s == 1 for s in rest):
        return shape[:kept] + (1,) * (len(target) - kept)
    return None


def boundary_views(graph: KernelGraph, lift_rules) -> Optional[Wrapped]:
    """The sub-program `graph` as views, a core without the layout operators they take out and views (see
    the module docstring), or None where one without a block-level rule stays inside (or none moved).
    `lift_rules`: the block-level rules (`guided.LIFT_RULES`, which the caller passes: guided reads this
    module), which every operator of the core must have."""
    if not any(n.op in HANDLED for n in graph.nodes):
        return None
    r = _Rewrite(graph)
    r.run()
    inputs = {v.name for v in graph.inputs}
    leading = [n for n in r.nodes if n.op in AT_BOUNDARY and n.inputs[0].name in inputs]
    trailing = []
    for n in reversed(r.nodes):   # views whose results only the part returns (or other such views read)
        if n.op in AT_BOUNDARY and n not in leading \
                and all(m in trailing for v in n.outputs for m in r.readers(v.name)):
            trailing.append(n)
    trailing.reverse()
    core = [n for n in r.nodes if n not in leading and n not in trailing]
    if not core or any(lift_rules.get(n.op) is None for n in core):
        return None
    if not leading and not trailing and all(any(n is m for m in graph.nodes) for n in core):
        return None   # nothing moved: the part lifts as it is, or not at all
    defined = {v.name for n in core for v in n.outputs}
    ins: dict = {}
    for n in core:
        for v in n.inputs:
            if v.name not in defined:
                ins.setdefault(v.name, v)
    needed = {v.name for n in trailing for v in n.inputs} | {v.name for v in graph.outputs}
    outs = [v for n in core for v in n.outputs if v.name in needed]
    if not outs:
        return None
    return Wrapped(tuple(leading), KernelGraph(f"{graph.name}_core", list(ins.values()), core, outs), tuple(trailing))

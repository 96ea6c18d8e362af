"""Guided candidate generation: block graphs derived top-down from the program's structure.

The program's dimension labels (`dims.Labels`) say which indices are free (they can be split across
the grid) and which are contracted (matmul k, reductions, norms, softmax). A *choice* picks up to
three free labels for the grid, optionally one contracted label L for the for-loop (and a split of L
across blocks, flash-decoding style), and the block and loop sizes. `lift` then rewrites the whole
kernel graph into one block graph (or two when L is split: partial results, then a combine that
re-accumulates them) by per-operator lifting rules:

* a contraction over L becomes loop-body work plus an accumulator (matmul -> accum, sum -> accum,
  max -> accum_max);
* rms_norm over L feeding a contraction over L is deferred: (x / r) @ W = (x @ W) / r with
  r = accum_rms(x), divided after the loop (split across blocks, each split keeps its mean of
  squares, and the combine takes r = sqrt(mean of the means + eps): accum_rms's `split` rule);
* softmax over L feeding a contraction over L becomes online softmax: exp(s - max) is computed
  against each chunk's own maximum and the accumulators rescale (accum_rescale, accum_sum_rescale);
* a loop-invariant value (one without the loop label: a bias, a gate, a weight read whole) that meets
  a value after the loop is brought there by accum_max, which gives an invariant tile back (an
  epilogue: a bias added to a product, a second product of an accumulated one);
* everything else runs per tile, in the loop or after it.

Each choice that lifts yields a candidate; candidates come out cheapest first by the cost model, and
the verifier decides which are equivalent.
"""
from __future__ import annotations

import itertools
import math
import re
from typing import Callable, Iterator, Optional

import attrs

from mdsl.errors import MdslError
from mdsl.ir.dtypes import f32
from mdsl.ir.graph import BlockGraph, BlockInput, BlockOutput, KernelGraph, Node
from mdsl.ir.ops import get_op
from mdsl.ir.rules import RuleTable
from mdsl.ir.types import TensorType, Var, fresh_name
from mdsl.ir.validate import input_tile_type, validate_kernel_graph
from mdsl.search.config import SearchConfig
from mdsl.search.cost import estimate
from mdsl.search.dims import Labels, Zip, reshape_ties

LOOP, POST = "loop", "post"
_LOOPABLE = frozenset({"matmul", "sum", "mean", "max", "rms_norm"})


class CannotLift(Exception):
    """This choice of grid and loop does not fit the program (a normal outcome, not an error)."""


@attrs.frozen
class Choice:
    grid: tuple            # ((label, parts), ...) split across grid dims x, y, ...
    loop: Optional[tuple]  # the contracted label the for-loop walks, or None
    forloop: int = 1
    split: int = 1         # blocks along the loop label (partial results combined afterwards)
    threads: int = 128
    combine_parts: int = 1  # the combining kernel's blocks: its grid's widest label split this many times more


@attrs.frozen
class Lifted:
    """A kernel-graph value inside the block graph. A loop value may carry modifiers: its true value
    is var + (shift - M), var * exp(scale - M) (M the overall maximum of shift/scale over the loop) or
    var / divisor (a post-loop value constant along the loop label)."""

    var: Var
    phase: str
    shift: Optional[Var] = None
    scale: Optional[Var] = None
    divisor: Optional[Var] = None
    max_partial: Optional[Var] = None  # post: this is accum_max(max_partial), a max over the loop label

    @property
    def plain(self) -> bool:
        return self.shift is None and self.scale is None and self.divisor is None


@attrs.frozen
class Accumulation:
    node: Node                         # the accumulator node in the block graph
    max_of_scale: Optional[str] = None  # rescaling accumulators: the accum_max output of their scale


class _Builder:
    """Lifts one kernel graph under one choice into block-graph nodes."""

    def __init__(self, graph: KernelGraph, labels: Labels, choice: Choice):
        self.graph, self.labels, self.choice = graph, labels, choice
        self.nodes: list = []
        self.inputs: list = []
        self.operands: list = []
        self.env: dict = {}
        self.accumulations: list = []
        self.max_accumulator: dict = {}  # partial max var name -> its accum_max output var
        self.names: set = set()
        self.origin: dict = {}  # block value name -> the kernel value whose dims (and labels) it has
        self.current: Optional[Node] = None
        self.grid_sizes = tuple(p for _, p in choice.grid) + ((choice.split,) if choice.split > 1 else ())
        self.grid3 = self.grid_sizes + (1,) * (3 - len(self.grid_sizes))

    # -- values ----------------------------------------------------------------------------------

    def fresh(self, base: str) -> str:
        return fresh_name(base, self.names)

    def make(self, op: str, inputs: list, base: Optional[str] = None, **attributes) -> Node:
        """A node of `op` on `inputs` with a fresh output name (from `base`, else the op) and its inferred
        type; not yet in the block graph."""
        opdef = get_op(op)
        try:
            pairs = opdef.normalize_attrs(attributes)
            (out_type,) = opdef.infer_types(tuple(v.type for v in inputs), pairs)
        except MdslError as e:
            raise CannotLift(str(e))
        return Node(op, inputs, [Var(self.fresh(base or op), out_type)], pairs)

    def emit(self, op: str, inputs: list, **attributes) -> Var:
        self.nodes.append(self.make(op, inputs, **attributes))
        out, out_type = self.nodes[-1].outputs[0], self.nodes[-1].outputs[0].type
        if self.current is not None and self.current.outputs[0].type.rank == out_type.rank:
            self.origin[out.name] = self.current.outputs[0]
        return out

    def along_loop(self, kernel_var: Var, dim: int) -> bool:
        loop = self.choice.loop
        return loop is not None and self.labels.label(kernel_var.name, dim % kernel_var.type.rank) == loop

    def has_loop_label(self, kernel_var: Var) -> bool:
        return self.choice.loop is not None and self.labels.dim_of(kernel_var, self.choice.loop) is not None

    def value(self, kernel_var: Var) -> Lifted:
        if kernel_var.name not in self.env:  # a graph input, loaded on first use
            self.env[kernel_var.name] = Lifted(self.load(kernel_var), LOOP)
        return self.env[kernel_var.name]

    def load(self, kernel_var: Var) -> Var:
        imap = [self.labels.dim_of(kernel_var, label) for label, _ in self.choice.grid]
        fmap = self.labels.dim_of(kernel_var, self.choice.loop) if self.choice.loop is not None else None
        if self.choice.split > 1:
            imap.append(fmap)
        imap = [d if size > 1 else None for d, size in zip(imap, self.grid_sizes)]
        try:
            tile = input_tile_type(kernel_var.type, self.grid3, self.choice.forloop, tuple(imap) + (None,) * (3 - len(imap)),
                                   fmap)
        except MdslError as e:
            raise CannotLift(str(e))
        var = Var(self.fresh(kernel_var.name), tile)
        self.origin[var.name] = kernel_var
        self.inputs.append(BlockInput(var, imap, fmap))
        self.operands.append(kernel_var)
        return var

    def accumulate(self, op: str, inputs: list, **attributes) -> Var:
        out = self.emit(op, inputs, **attributes)
        node = self.nodes[-1]
        max_of_scale = self.max_accumulator.get(inputs[1].name) if op in ("accum_rescale", "accum_sum_rescale") else None
        self.accumulations.append(Accumulation(node, max_of_scale))
        return out

    # -- the walk --------------------------------------------------------------------------------

    def run(self) -> None:
        for node in self.graph.nodes:
            rule = LIFT_RULES.get(node.op)
            if rule is None:
                raise CannotLift(f"{node.op} does not lift into a block graph")
            self.current = node
            self.env[node.outputs[0].name] = rule(self, node)
        self.current = None

    def finish_outputs(self) -> list:
        """The block-graph value of each graph output, accumulated when the loop has no label."""
        outs = []
        for v in self.graph.outputs:
            lv = self.value(v)
            if not lv.plain:
                raise CannotLift(f"output %{v.name} still carries a pending rescale or division")
            if lv.phase == LOOP:
                if self.choice.loop is not None:
                    raise CannotLift(f"output %{v.name} does not pass through the loop's contraction")
                lv = Lifted(self.accumulate("accum", [lv.var]), POST)
            outs.append(lv.var)
        return outs


# ---------------------------------------------------------------------------------------------
# lifting rules, one per operator category

def _same_phase(lvs) -> str:
    phases = {lv.phase for lv in lvs}
    if len(phases) != 1:
        raise CannotLift("mixes values from inside and after the loop")
    return phases.pop()


def _after_loop(b: _Builder, lvs: list, kernel_vars) -> list:
    """Plain operands of one operator, where some come after the loop and the others are loop-invariant
    (their values lack the loop label: a bias, a gate, a weight read whole), all after the loop: an
    invariant tile is the same every iteration, so its accum_max over the iterations is the tile itself
    (an epilogue reads it there). Unchanged where the phases agree or a loop operand varies along the
    loop (the other rules decide: x - max over the loop is online softmax's shift)."""
    if len({lv.phase for lv in lvs}) == 1 or not all(lv.plain for lv in lvs) \
            or any(lv.phase == LOOP and b.has_loop_label(v) for lv, v in zip(lvs, kernel_vars)):
        return lvs
    return [Lifted(b.accumulate("accum_max", [lv.var]), POST) if lv.phase == LOOP else lv for lv in lvs]


def _lift_elementwise(b: _Builder, node: Node) -> Lifted:
    lvs = _after_loop(b, [b.value(v) for v in node.inputs], node.inputs)
    attributes = node.attr_dict
    if all(lv.plain for lv in lvs) and len({lv.phase for lv in lvs}) == 1:
        return Lifted(b.emit(node.op, [lv.var for lv in lvs], **attributes), lvs[0].phase)
    if node.op == "sub" and lvs[0].phase == LOOP and lvs[0].plain and lvs[1].max_partial is not None:
        # x - max over the loop label: subtract the chunk's own maximum and remember the shift
        m = lvs[1].max_partial
        return Lifted(b.emit("sub", [lvs[0].var, m]), LOOP, shift=m)
    if node.op == "exp" and lvs[0].shift is not None and lvs[0].scale is None and lvs[0].divisor is None:
        return Lifted(b.emit("exp", [lvs[0].var]), LOOP, scale=lvs[0].shift)
    if node.op == "div" and lvs[0].phase == LOOP and lvs[0].shift is None and lvs[0].divisor is None \
            and lvs[1].phase == POST and lvs[1].plain and not b.has_loop_label(node.inputs[1]):
        # dividing by something constant along the loop label commutes with the contraction
        return attrs.evolve(lvs[0], divisor=lvs[1].var)
    if node.op in ("mul_scalar", "neg", "cast") and lvs[0].phase == LOOP and lvs[0].shift is None:
        return attrs.evolve(lvs[0], var=b.emit(node.op, [lvs[0].var], **attributes))
    if node.op == "mul" and all(lv.phase == LOOP and lv.shift is None for lv in lvs) \
            and sum(not lv.plain for lv in lvs) == 1:
        carrier = lvs[0] if not lvs[0].plain else lvs[1]
        return attrs.evolve(carrier, var=b.emit("mul", [lv.var for lv in lvs]))
    raise CannotLift(f"{node.op} on a value with a pending rescale or division")


def _contract(b: _Builder, partial: Var, lv: Lifted) -> Lifted:
    """Accumulate a loop partial over the loop; apply a deferred division afterwards."""
    acc = b.accumulate("accum_rescale", [partial, lv.scale]) if lv.scale is not None else b.accumulate("accum", [partial])
    if lv.divisor is not None:
        acc = b.emit("div", [acc, lv.divisor])
    return Lifted(acc, POST)


def _lift_matmul(b: _Builder, node: Node) -> Lifted:
    a, w = (b.value(v) for v in node.inputs)
    if b.along_loop(node.inputs[0], node.inputs[0].type.rank - 1):
        if a.phase != LOOP or w.phase != LOOP or a.shift or w.shift or (not a.plain and not w.plain):
            raise CannotLift("matmul over the loop needs both operands inside the loop, one plain")
        modified = a if not a.plain else w
        return _contract(b, b.emit("matmul", [a.var, w.var]), modified)
    if not (a.plain and w.plain):
        raise CannotLift("matmul of a value with a pending rescale or division")
    a, w = _after_loop(b, [a, w], node.inputs)
    phase = _same_phase((a, w))
    return Lifted(b.emit("matmul", [a.var, w.var]), phase)


def _lift_reduction(b: _Builder, node: Node) -> Lifted:
    (x,) = (b.value(v) for v in node.inputs)
    dim, keepdim = node.attr("dim"), node.attr("keepdim")
    if not b.along_loop(node.inputs[0], dim):
        if not x.plain:
            raise CannotLift(f"{node.op} across rows with a pending rescale or division")
        return Lifted(b.emit(node.op, [x.var], dim=dim, keepdim=keepdim), x.phase)
    if x.phase != LOOP or x.shift is not None:
        raise CannotLift(f"{node.op} over the loop label of a value outside the loop")
    if node.op == "max":
        if not x.plain:
            raise CannotLift("max of a rescaled value")
        partial = b.emit("max", [x.var], dim=dim, keepdim=keepdim)
        total = b.accumulate("accum_max", [partial])
        b.max_accumulator[partial.name] = total.name
        return Lifted(total, POST, max_partial=partial)
    if (x.scale is not None or x.divisor is not None) and not keepdim:
        raise CannotLift("a rescaled sum must keep its reduced dim")
    out = _contract(b, b.emit("sum", [x.var], dim=dim, keepdim=keepdim), x)
    if node.op == "mean":
        out = Lifted(b.emit("mul_scalar", [out.var], value=1.0 / node.inputs[0].shape[dim]), POST)
    return out


def _lift_rms_norm(b: _Builder, node: Node) -> Lifted:
    (x,) = (b.value(v) for v in node.inputs)
    dim, eps = node.attr("dim"), node.attr("eps")
    if not x.plain:
        raise CannotLift("rms_norm of a value with a pending rescale or division")
    if not b.along_loop(node.inputs[0], dim):
        return Lifted(b.emit("rms_norm", [x.var], dim=dim, eps=eps), x.phase)
    if x.phase != LOOP or dim % x.var.type.rank != x.var.type.rank - 1:
        raise CannotLift("rms_norm over the loop label needs it to be the last dim")
    # x / rms(x): the rms accumulates over the loop; the division waits for the contraction
    return Lifted(x.var, LOOP, divisor=b.accumulate("accum_rms", [x.var], eps=eps))


def _lift_concat(b: _Builder, node: Node) -> Lifted:
    """A concat of tiles that each hold their operand's whole extent along the concat dim: neither the
    grid nor the loop splits that dim (of an operand or of the result), so the block's concat is the
    tile of the result."""
    lvs = _after_loop(b, [b.value(v) for v in node.inputs], node.inputs)
    if not all(lv.plain for lv in lvs):
        raise CannotLift("concat of a value with a pending rescale or division")
    phase = _same_phase(lvs)
    dim = node.attr("dim") % node.outputs[0].type.rank
    split = {b.choice.loop} | {m for label, parts in b.choice.grid if parts > 1
                               for m in (label.labels if isinstance(label, Zip) else (label,))}
    if any(b.labels.label(v.name, dim) in split for v in (*node.inputs, node.outputs[0])):
        raise CannotLift("concat along a dim that the grid or the loop splits")
    return Lifted(b.emit("concat", [lv.var for lv in lvs], dim=dim), phase)


def _lift_reshape(b: _Builder, node: Node) -> Lifted:
    """A reshape of tiles that each hold whole groups: every dim the grid splits is one the reshape splits
    alike (`dims.reshape_ties`: a dim it keeps, or a dim n of g * s elements and its groups' dim g, which
    the grid splits into whole groups where its parts divide g), and the loop walks none of them. A block's
    tile is then a contiguous run of the groups, and its reshape to the result's tile is the tile of the
    result: the norm of a projection regrouped into heads runs on the product's tile."""
    (x,) = (b.value(v) for v in node.inputs)
    if not x.plain:
        raise CannotLift("reshape of a value with a pending rescale or division")
    src, out = node.inputs[0], node.outputs[0]
    if b.has_loop_label(src) or b.has_loop_label(out):
        raise CannotLift("reshape of a value along the loop label")
    ties = reshape_ties(src.shape, out.shape)
    tile = list(out.shape)
    for label, parts in b.choice.grid:
        d, e = b.labels.dim_of(src, label), b.labels.dim_of(out, label)
        if parts == 1 or (d is None and e is None):
            continue
        if (d, e) not in ties or out.shape[e] % parts:
            raise CannotLift("reshape of tiles that do not hold whole groups")
        tile[e] //= parts
    return Lifted(b.emit("reshape", [x.var], shape=tuple(tile)), x.phase)


def _lift_transpose(b: _Builder, node: Node) -> Lifted:
    """A transpose of a tile: the grid and the loop split its dims as they split the operand's (the labels
    move with the dims), so the block's transpose of the operand's tile is the tile of the result. A weight
    stored [out, in] is then read in place, its tiles as stored, where a kernel of its own would write the
    transposed copy first."""
    (x,) = (b.value(v) for v in node.inputs)
    if not x.plain:
        raise CannotLift("transpose of a value with a pending rescale or division")
    return Lifted(b.emit("transpose", [x.var], perm=tuple(node.attr("perm"))), x.phase)


_CATEGORY_RULES = {"elementwise": _lift_elementwise, "matmul": _lift_matmul, "reduction": _lift_reduction,
                   "norm": _lift_rms_norm}
#: op -> (builder, node) -> Lifted, by the op's category
LIFT_RULES: RuleTable[Callable] = RuleTable("guided lifting", Callable, "mdsl.search.guided (LIFT_RULES)",
                                            by_category=lambda op: _CATEGORY_RULES.get(op.category))
LIFT_RULES.register("concat", _lift_concat)
LIFT_RULES.register("reshape", _lift_reshape)
LIFT_RULES.register("transpose", _lift_transpose)


# ---------------------------------------------------------------------------------------------
# from a lifted program to kernel graphs

def _omap(labels: Labels, var: Var, choice: Choice, kernel_var: Var) -> list:
    omap = []
    for label, parts in choice.grid:
        d = labels.dim_of(kernel_var, label)
        if parts > 1 and d is None:
            raise CannotLift(f"output %{kernel_var.name} has no dim for a grid label")
        omap.append(d if parts > 1 else None)
    return omap


def _single_kernel(b: _Builder, outs: list) -> KernelGraph:
    choice, graph = b.choice, b.graph
    outputs = [BlockOutput(v, _omap(b.labels, v, choice, kv)) for v, kv in zip(outs, graph.outputs)]
    body = BlockGraph(b.grid3, choice.threads, choice.forloop, b.inputs, b.nodes, outputs)
    node = Node("custom", b.operands, list(graph.outputs), body=body)
    return KernelGraph(graph.name, graph.inputs, [node], graph.outputs)


def _retyped(node: Node, inputs: list) -> Node:
    """`node` on new inputs, with output types inferred again (partial results are f32)."""
    (out_type,) = node.opdef.infer_types(tuple(v.type for v in inputs), node.attrs)
    return attrs.evolve(node, inputs=inputs, outputs=[Var(node.outputs[0].name, out_type)])


def _cast_node(v: Var, dtype, name: str) -> Node:
    return Node("cast", [v], [Var(name, v.type.with_dtype(dtype))], get_op("cast").normalize_attrs({"dtype": dtype}))


# ---------------------------------------------------------------------------------------------
# split-K: how each accumulator's work divides across the blocks of a split loop label


@attrs.frozen
class SplitRule:
    """An accumulator's `split` rule. `partial(b, accumulation)`: the phase-1 nodes that replace the
    accumulator, the last one's output being the partial result each split stores; `combine(b,
    accumulation, tile_of, name)`: the phase-2 nodes that fold the splits' partial tiles (`tile_of`:
    accumulator output name -> the split tile of its partial) into the accumulator's value, the last
    one's output named `name`. An accumulator without the rule cannot be split."""

    partial: Callable
    combine: Callable


def _keep_accumulator(b: _Builder, a: Accumulation) -> list:
    return [a.node]


def _same_accumulator(b: _Builder, a: Accumulation, tile_of: dict, name: str) -> list:
    """Sums and maxima of partial sums and maxima: the accumulator itself over the split tiles."""
    ins = [tile_of[a.node.outputs[0].name]]
    if a.node.op == "accum_rescale":
        if a.max_of_scale is None:
            raise CannotLift("a rescaling accumulator without the maximum of its scale")
        ins.append(tile_of[a.max_of_scale])
    return [_retyped(Node(a.node.op, ins, [Var(name, a.node.outputs[0].type)], a.node.attrs), ins)]


def _mean_square_partial(b: _Builder, a: Accumulation) -> list:
    """accum_rms's split: each split's mean of squares (in f32: a square of f16 can overflow)."""
    (x,) = a.node.inputs
    wide = [b.make("cast", [x], f"{x.name}_f32", dtype=f32)] if x.type.dtype != f32 else []
    square = b.make("square", [wide[0].outputs[0] if wide else x], f"{x.name}_square")
    mean = b.make("accum_mean", [square.outputs[0]], f"{a.node.outputs[0].name}_mean_square")
    if a.node.outputs[0].name in b.origin:
        b.origin[mean.outputs[0].name] = b.origin[a.node.outputs[0].name]
    return [*wide, square, mean]


def _rms_of_mean_squares(b: _Builder, a: Accumulation, tile_of: dict, name: str) -> list:
    """The mean of the splits' means of squares (equal splits: the mean over the whole loop label), then
    sqrt(mean + eps) as accum_rms computes it."""
    mean = b.make("accum_mean", [tile_of[a.node.outputs[0].name]], f"{name}_mean_square")
    shifted = b.make("add_scalar", [mean.outputs[0]], f"{name}_eps", value=a.node.attr("eps"))
    root = b.make("sqrt", [shifted.outputs[0]])
    return [mean, shifted, attrs.evolve(root, outputs=[Var(name, root.outputs[0].type)])]


_SPLIT_RULES = {"accum": SplitRule(_keep_accumulator, _same_accumulator),
                "accum_max": SplitRule(_keep_accumulator, _same_accumulator),
                "accum_rescale": SplitRule(_keep_accumulator, _same_accumulator),
                "accum_rms": SplitRule(_mean_square_partial, _rms_of_mean_squares)}
SPLIT_RULES: RuleTable[SplitRule] = RuleTable("split loops' combine", SplitRule, "mdsl.search.guided (SPLIT_RULES)")
for _name, _rule in _SPLIT_RULES.items():
    SPLIT_RULES.register(_name, _rule)


def _split_rule(a: Accumulation) -> SplitRule:
    rule = SPLIT_RULES.get(a.node.op)
    if rule is None:
        raise CannotLift(f"{a.node.op}'s partial results cannot be combined")
    return rule


def _split_kernels(b: _Builder, outs: list) -> KernelGraph:
    """Phase 1 accumulates each split of the loop label and stores the partial results in f32 (each
    accumulator's `split` rule says which); phase 2 loops over the splits, combines them (the rule
    again) and runs the post-loop nodes."""
    choice, graph = b.choice, b.graph
    accs = b.accumulations
    rules = [_split_rule(a) for a in accs]
    post = BlockGraph(b.grid3, choice.threads, choice.forloop, b.inputs, b.nodes, ()).post_loop_vars()
    partial_nodes = {id(a.node): rule.partial(b, a) for a, rule in zip(accs, rules)}
    phase1_nodes = [m for n in b.nodes if not any(v.name in post for v in n.outputs) or n.opdef.is_accumulator
                    for m in partial_nodes.get(id(n), [n])]
    post_nodes = [n for n in b.nodes if any(v.name in post for v in n.outputs) and not n.opdef.is_accumulator]

    grid_parts = [p for _, p in choice.grid]
    partial_outputs, partial_vars, tiles2 = [], [], []
    for a in accs:
        v = partial_nodes[id(a.node)][-1].outputs[0]
        omap = []
        for label, parts in choice.grid:
            d = _tile_dim_for(b, v, label) if parts > 1 else None
            if parts > 1 and d is None:
                d = _replica_dim(v, omap)
            omap.append(d)
        free = [d for d in range(v.type.rank) if d not in omap]
        if not free:
            raise CannotLift("no dim to concatenate a partial result's splits along")
        omap.append(free[-1])
        stored = v
        if v.type.dtype != f32:
            phase1_nodes.append(_cast_node(v, f32, f"{v.name}_f32"))
            stored = phase1_nodes[-1].outputs[0]
        partial_outputs.append(BlockOutput(stored, omap))
        shape = [n * parts if d in omap else n for d, n in enumerate(v.shape)
                 for parts in [math.prod(p for dd, p in zip(omap, grid_parts + [choice.split]) if dd == d)]]
        partial_vars.append(Var(f"{v.name}_splits", TensorType(shape, f32)))
        tiles2.append((Var(f"{v.name}_split", stored.type), omap[:-1], omap[-1]))
    phase1 = BlockGraph(b.grid3, choice.threads, choice.forloop, b.inputs, phase1_nodes, partial_outputs)
    n1 = Node("custom", b.operands, partial_vars, body=phase1)

    # phase 2: the same grid without the split, looping over the splits
    tile_of = {a.node.outputs[0].name: t for a, (t, _, _) in zip(accs, tiles2)}
    totals: dict = {}
    nodes2 = []
    for a, rule in zip(accs, rules):
        v = a.node.outputs[0]
        nodes2.extend(rule.combine(b, a, tile_of, f"{v.name}_total"))
        totals[v.name] = nodes2[-1].outputs[0]
    widened: dict = {}   # an operand of another float dtype than a total's, cast to f32 once
    for n in post_nodes:
        inputs = [totals.get(v.name, v) for v in n.inputs]
        if any(u.type.dtype == f32 for u in inputs):
            for k, u in enumerate(inputs):
                if u.type.dtype != f32 and u.type.dtype.is_float:
                    if u.name not in widened:
                        nodes2.append(_cast_node(u, f32, f"{u.name}_f32"))
                        widened[u.name] = nodes2[-1].outputs[0]
                    inputs[k] = widened[u.name]
        nodes2.append(_retyped(n, inputs))
        totals[n.outputs[0].name] = nodes2[-1].outputs[0]
    outputs2 = []
    for v, kv in zip(outs, graph.outputs):
        result = totals.get(v.name, v)
        if result.type.dtype != kv.type.dtype:
            nodes2.append(_cast_node(result, kv.type.dtype, f"{v.name}_out"))
            result = nodes2[-1].outputs[0]
        outputs2.append(BlockOutput(result, _omap(b.labels, v, choice, kv)[:len(grid_parts)]))
    grid2 = tuple(grid_parts) + (1,) * (3 - len(grid_parts))
    inputs2 = [BlockInput(t, imap, fmap) for t, imap, fmap in tiles2]
    if choice.combine_parts > 1:
        grid2, inputs2 = _refined(grid2, inputs2, choice.combine_parts)
        try:
            nodes2 = _retyped_graph(nodes2, {i.var.name: i.var for i in inputs2})
        except MdslError as e:   # a node of the combine also reads along that dim what it does not split
            raise CannotLift(f"the combining kernel's operators do not take {choice.combine_parts} times narrower "
                             f"tiles: {e.message}") from None
        outputs2 = [BlockOutput(_renamed(nodes2, o.var), o.omap) for o in outputs2]
    phase2 = BlockGraph(grid2, choice.threads, choice.split, inputs2, nodes2, outputs2)
    n2 = Node("custom", partial_vars, list(graph.outputs), body=phase2)
    return KernelGraph(graph.name, graph.inputs, [n1, n2], graph.outputs)


def _replica_dim(partial: Var, omap: list) -> int:
    """A dim of size 1 to concatenate a partial result along for a grid label it does not have (accum_rms's
    per-row partial under a grid over columns: each block stores its own copy, the combine reads its own)."""
    ones = [d for d in range(partial.type.rank) if partial.shape[d] == 1 and d not in omap]
    if not ones:
        raise CannotLift("a partial result has no dim for a grid label")
    return ones[0]


def _refined(grid: tuple, inputs: list, factor: int) -> tuple:
    """The combining kernel with `factor` times more blocks along the grid dim whose tiles are widest
    (every partial result has its rows along it; each block then combines fewer rows, the same splits)."""
    best = None
    for g, parts in enumerate(grid):
        dims = [i.imap[g] if g < len(i.imap) else None for i in inputs]
        if parts == 1 or any(d is None for d in dims):
            continue
        extents = [i.var.shape[d] for i, d in zip(inputs, dims)]
        if all(e % factor == 0 for e in extents) and (best is None or min(extents) > best[1]):
            best = (g, min(extents))
    if best is None:
        raise CannotLift(f"no grid dim of the combining kernel divides {factor} ways")
    g = best[0]
    new_inputs = []
    for i in inputs:
        shape = list(i.var.shape)
        shape[i.imap[g]] //= factor
        new_inputs.append(BlockInput(Var(i.var.name, TensorType(shape, i.var.type.dtype)), i.imap, i.fmap))
    return tuple(p * factor if k == g else p for k, p in enumerate(grid)), new_inputs


def _retyped_graph(nodes: list, values: dict) -> list:
    """The nodes on the (re-shaped) values, their output types inferred again."""
    out = []
    for n in nodes:
        node = _retyped(n, [values.get(v.name, v) for v in n.inputs])
        values[node.outputs[0].name] = node.outputs[0]
        out.append(node)
    return out


def _renamed(nodes: list, var: Var) -> Var:
    """The var of that name among the nodes' outputs (its type after re-shaping)."""
    return next((n.outputs[0] for n in nodes if n.outputs[0].name == var.name), var)


def _tile_dim_for(b: _Builder, tile: Var, label) -> Optional[int]:
    """The dim of a block value that a grid label splits, read off the kernel value it stands for."""
    origin = b.origin.get(tile.name)
    return b.labels.dim_of(origin, label) if origin is not None else None


def lift(graph: KernelGraph, choice: Choice, labels: Optional[Labels] = None) -> KernelGraph:
    """The kernel graph rewritten under `choice`, or CannotLift."""
    b = _Builder(graph, labels or Labels(graph), choice)
    b.run()
    outs = b.finish_outputs()
    candidate = _split_kernels(b, outs) if choice.split > 1 else _single_kernel(b, outs)
    try:
        validate_kernel_graph(candidate)
    except MdslError as e:
        raise CannotLift(str(e))
    return candidate


# ---------------------------------------------------------------------------------------------
# choices

def _powers_of_two_dividing(n: int, limit: int) -> list:
    return [p for p in (2 ** k for k in range(0, 13)) if p <= min(n, limit) and n % p == 0]


def _grid_factors(n: int, limit: int) -> list:
    """Ways to split a dim of size n over blocks: powers of two, or whatever leaves power-of-two tiles."""
    return sorted({p for p in _powers_of_two_dividing(n, limit) if p > 1}
                  | {n // t for t in _powers_of_two_dividing(n, n) if 1 < n // t <= limit})


def choices(graph: KernelGraph, labels: Labels, config: SearchConfig, *, max_split: int = 64,
            min_forloop: int = 2, thread_counts: Optional[tuple] = None) -> Iterator[Choice]:
    """The grid/loop choices for `graph`. The keyword arguments widen the space beyond what the search
    enumerates (`mdsl.search.variants` uses them for GPU tuning): splits of the loop label across up to
    `max_split` blocks, loops of at least `min_forloop` iterations (1: a block takes its whole split in
    one tile), every thread count in `thread_counts` (default: the config's first)."""
    thread_counts = config.thread_counts[:1] if thread_counts is None else thread_counts
    out_labels = None
    for v in graph.outputs:
        ls = {labels.label(v.name, d) for d in range(v.type.rank) if v.shape[d] > 1}
        out_labels = ls if out_labels is None else out_labels & ls
    contracted = labels.contracted_labels()
    free = sorted(l for l in (out_labels or ()) if l not in contracted)
    zipped = _zipped_outputs(graph, labels, set(contracted) | (out_labels or set()))
    free += [zipped] if zipped is not None else []
    loops = [None] + sorted(l for l, kinds in contracted.items() if kinds <= _LOOPABLE)
    for loop in loops:
        n_loop = labels.size(loop) if loop is not None else 1
        splits = _powers_of_two_dividing(n_loop, max_split) if loop is not None else [1]
        max_grid_labels = 3 if loop is None else 2
        for k in range(0, min(max_grid_labels, len(free)) + 1):
            for grid_labels in itertools.combinations(free, k):
                factor_lists = [_grid_factors(labels.size(l), config.max_blocks) for l in grid_labels]
                for factors in itertools.product(*factor_lists):
                    for split in splits:
                        blocks = math.prod(factors) * split
                        if blocks > config.max_blocks or (split > 1 and len(factors) >= 3):
                            continue
                        for forloop in _forloop_ranges(n_loop // split, loop is not None, config, min_forloop):
                            for threads in thread_counts:
                                yield Choice(tuple(zip(grid_labels, factors)), loop, forloop, split, threads)


def _zipped_outputs(graph: KernelGraph, labels: Labels, taken: set) -> Optional[Zip]:
    """The outputs' last-dim labels as one grid group, where outputs differ in them (independent products
    of one input: q, k and v; gate and up), or None. Each member is free (no operator contracts it, and
    it is not a label every output has), and no value of the program carries two members: each block
    then computes its slice of each output."""
    members = tuple(dict.fromkeys(labels.label(v.name, v.type.rank - 1) for v in graph.outputs if v.type.rank
                                  and v.shape[-1] > 1))
    if len(members) < 2 or any(m in taken for m in members):
        return None
    values = (*graph.inputs, *(o for n in graph.nodes for o in n.outputs))
    if any(sum(labels.label(v.name, d) in members for d in range(v.type.rank)) > 1 for v in values):
        return None
    return Zip(members)


def _forloop_ranges(n: int, looping: bool, config: SearchConfig, min_forloop: int = 2) -> list:
    if not looping:
        return [1]
    # chunks of 8 to 512 elements along the loop label keep tiles sensible
    return [r for r in config.forloop_ranges if r >= min_forloop and n % r == 0 and 8 <= n // r <= 512]


@attrs.frozen
class LiftResult:
    """What lifting a program under every choice gave: its distinct candidates, cheapest first by the cost
    model, and why the other choices did not lift (normalised reason -> (count, one message))."""

    candidates: tuple
    failures: dict
    complete: bool        # every choice was tried (not stopped by the work budget or the time cap)


def lift_all(graph: KernelGraph, config: SearchConfig = SearchConfig(), stats=None, *, work: str = "guided",
             limit: int = 48, probe: bool = False, probes_only: bool = False, **space) -> LiftResult:
    """Every choice of `choices(graph, ..., **space)` lifted; each lifting costs one step of the search's
    work budget under the name `work` (`stats.work`), and lifting stops when it is spent or at the
    search's deadline (`complete` is then False).

    With `probe`, the choices of one *structure* (loop label, grid labels, split or not, threads) are
    lifted only if the one with the smallest tiles lifts: whether a structure lifts depends on the
    program and the structure, and its tiles' shared memory only grows with their size. (A part of a
    program, searched with many others, is lifted so.) With `probes_only` as well, only those smallest
    tiles are lifted: a candidate per structure that lifts, at a step or so per structure where every
    choice costs hundreds; `complete` then says every structure was probed, and no candidate means that
    no choice lifts."""
    blocked = next((n for n in graph.nodes if LIFT_RULES.get(n.op) is None), None)
    if blocked is not None:   # no choice lifts it: every lifting would stop at this operator
        message = f"{blocked.op} does not lift into a block graph"
        return LiftResult((), {_normalised(message): (1, message)}, True)
    labels = Labels(graph)
    found: dict = {}
    failures: dict = {}
    complete = True
    groups: dict = {}
    for choice in choices(graph, labels, config, **space):
        key = (choice.loop, tuple(label for label, _ in choice.grid), choice.split > 1, choice.threads)
        groups.setdefault(key if probe else len(groups), []).append(choice)
    for group in groups.values():
        if probe and len(group) > 1:
            smallest = min(group, key=lambda c: _tile_volume(c, labels))
            group = [smallest] + [c for c in group if c is not smallest]
        for k, choice in enumerate(group[:1] if probe and probes_only else group):
            if stats is not None and (stats.out_of_time() or not stats.work(work)):
                stats.count("stopped", f"{work}: {'time' if stats.out_of_time() else 'work'}")
                return LiftResult(tuple(sorted(found.values(), key=estimate)[:limit]), failures, False)
            try:
                candidate = lift(graph, choice, labels)
            except CannotLift as e:
                reason = _normalised(str(e))
                count, message = failures.get(reason, (0, str(e)))
                skipped = len(group) if probe and k == 0 else 1   # a probe that fails stands for its structure
                failures[reason] = (count + skipped, message)
                if stats is not None:
                    stats.count("pruned", f"{work}: does not lift", skipped)
                if skipped > 1:
                    break
                continue
            found.setdefault(candidate.key, candidate)
    ranked = sorted(found.values(), key=estimate)   # stable: equal costs in the choices' order
    return LiftResult(tuple(ranked[:limit]), failures, complete)


def _tile_volume(choice: Choice, labels: Labels) -> float:
    """The elements of a block's tile along the choice's grid and loop labels (smaller: less shared memory)."""
    volume = math.prod(labels.size(label) / parts for label, parts in choice.grid)
    if choice.loop is not None:
        volume *= labels.size(choice.loop) / (choice.split * choice.forloop)
    return volume


def _normalised(message: str) -> str:
    """A CannotLift message without its value names and numbers, so that one reason counts once."""
    return re.sub(r"\d+(\.\d+)?", "N", re.sub(r"%[\w.]+", "%v", message.split(" (largest:")[0]))


def generate(graph: KernelGraph, config: SearchConfig = SearchConfig(), stats=None, limit: int = 48) -> Iterator[KernelGraph]:
    """Candidates derived from the program's structure, cheapest first by the cost model. With the
    search's `stats`, it stops lifting when its work budget is spent or at the search's deadline (and
    ranks what it has). A program whose layout changes move to its boundary (`mdsl.search.layout`) is
    lifted as its core, with the views around it."""
    from mdsl.search.layout import boundary_views

    wrapped = boundary_views(graph, LIFT_RULES)
    if wrapped is None:
        yield from lift_all(graph, config, stats, limit=limit).candidates
        return
    for core in lift_all(wrapped.core, config, stats, limit=limit).candidates:
        yield attrs.evolve(graph, nodes=wrapped.around(core))

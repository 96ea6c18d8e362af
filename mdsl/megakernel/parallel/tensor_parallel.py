"""Tensor parallelism: a model graph split over N ranks (GPUs), one graph that every rank runs on its
own shard of the weights.

    plan = tensor_parallel(graph, world_size=2)      # plan.graph: every rank's model graph
    weights_r = load_rank_weights(plan, folder, r)   # only rank r's slices are read from disk
    tp = build_tensor_parallel_task_graph(plan, PartitionConfig(...))

The split follows Megatron-LM, chosen per op by its rule in `SHARD_RULES` from the layouts of its inputs:

* fused projections of a replicated row (q|k|v, gate|up) split by output columns: each weight's rows
  are dealt out evenly, so rank r holds query heads, KV heads, gate and up columns r * n / N ..;
  head_rms_norm, rope and attention then work on the rank's heads (its KV cache holds only them);
* a projection of a split row (o_proj, down_proj) splits by input columns; its partial sums are
  completed by an `all_reduce`;
* the embedding and the LM head split by vocabulary: `vocab_embedding` + `all_reduce`; the logits
  stay split, and `tp_argmax` (greedy) finds the best token over every rank's shard from one (value,
  index) pair per rank; sampling gathers the logits (`all_gather`) and samples on every rank alike.

The query and KV heads, the intermediate size and the vocabulary must divide by N; an error says
which world sizes a model allows. The communication ops and their task rules are in
`collectives.py`; `TensorParallelTaskGraph` adds the remote events that link the ranks' task graphs.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Optional, Sequence

import attrs
import numpy as np
from attrs import field

from mdsl.errors import ShapeError, UnsupportedError, ValidationError
from mdsl.ir.rules import RuleTable
from mdsl.ir.types import TensorType, Var
from mdsl.megakernel.modelgraph.checkpoint import load_weights
from mdsl.megakernel.modelgraph.layers import LAYER_OPS, get_layer_op
from mdsl.megakernel.modelgraph.model import TOKENS, LayerNode, ModelGraph
from mdsl.megakernel.modelgraph.reference import Generation, check_steps, initial_states
from mdsl.megakernel.parallel.collectives import COLLECTIVE_RULES, RankStepContext
from mdsl.megakernel.taskgraph.partition import build_task_graph
from mdsl.megakernel.taskgraph.tasks import PartitionConfig, RegionIndex, TaskGraph


@attrs.frozen
class Replicated:
    """Every rank holds the whole value."""

    def __str__(self) -> str:
        return "replicated"


REPLICATED = Replicated()


@attrs.frozen
class Split:
    """A row whose consecutive parts (global widths) are each dealt out evenly over the ranks: rank r's
    row is the concatenation of the r-th chunk of every part (q|k|v: three parts; logits: one)."""

    parts: tuple = field(converter=tuple)

    def __str__(self) -> str:
        return f"split{list(self.parts)}"


@attrs.frozen
class _Constraint:
    what: str
    size: int
    loc: object
    op: str
    heads: bool


class _Indivisible(Exception):
    pass


class _Sharder:
    """Builds the per-rank graph while the shard rules walk the source graph's nodes."""

    def __init__(self, graph: ModelGraph, world_size: int, tile_columns: int = 0):
        self.graph = graph
        self.world = world_size
        self.tile_columns = tile_columns
        self.values: dict = {}           # source Var name -> (local Var, layout)
        self.weight_axes: dict = {}      # weight name -> the split axis, None when replicated
        self.local_weights: dict = {}
        self.local_states: dict = {s.name: s for s in graph.states}
        self.nodes: list = []
        self.constraints: list = []
        self.node: Optional[LayerNode] = None

    def split(self, size: int, what: str, heads: bool = False) -> int:
        self.constraints.append(_Constraint(what, size, self.node.loc, self.node.op, heads))
        if size % self.world:
            raise _Indivisible()
        return size // self.world

    def weight(self, var: Var, axis: Optional[int]) -> Var:
        """The rank's part of a weight: rows (axis 0) or columns (axis 1) split, or all of it (None)."""
        if var.name in self.weight_axes:
            if self.weight_axes[var.name] != axis:
                raise UnsupportedError(f"weight {var.name} is split along axis {self.weight_axes[var.name]} by one "
                                       f"use and along {axis} by another", loc=self.node.loc,
                                       hint="a tied weight must be used the same way by every op")
            return self.local_weights[var.name]
        shape = list(var.shape)
        if axis is not None:
            shape[axis] = self.split(shape[axis], f"the {shape[axis]} {('rows', 'columns')[axis]} of weight {var.name}")
        local = Var(var.name, TensorType(tuple(shape), var.dtype))
        self.weight_axes[var.name], self.local_weights[var.name] = axis, local
        return local

    def state(self, var: Var, shape: tuple) -> Var:
        local = Var(var.name, TensorType(tuple(shape), var.dtype))
        self.local_states[var.name] = local
        self.values[var.name] = (local, REPLICATED)
        return local

    def local(self, var: Var) -> tuple:
        """(the rank's Var, its layout) of an activation or state."""
        if var.name not in self.values:
            if var.name not in self.local_states:
                raise UnsupportedError(f"{self.node.op} reads the weight {var.name} where an activation is expected",
                                       loc=self.node.loc)
            self.values[var.name] = (self.local_states[var.name], REPLICATED)
        return self.values[var.name]

    def replicated(self, var: Var) -> Var:
        local, layout = self.local(var)
        if layout != REPLICATED:
            raise UnsupportedError(f"{self.node.op} needs every rank to hold all of {var.name}, which is {layout}",
                                   loc=self.node.loc, hint="the op's rule in SHARD_RULES says which layouts it splits")
        return local

    def emit(self, op: str, *inputs: Var, **attrs_given) -> Var:
        opdef = get_layer_op(op)
        pairs = opdef.normalize_attrs(attrs_given)
        types = opdef.infer_types(tuple(v.type for v in inputs), pairs)
        outs = tuple(Var(f"t{len(self.nodes)}.{i}" if len(types) > 1 else f"t{len(self.nodes)}", t)
                     for i, t in enumerate(types))
        self.nodes.append(LayerNode(op, inputs, outs, pairs, self.node.loc))
        return outs[0]

    def same(self, *inputs: Var, **overrides) -> Var:
        """The current node applied to the rank's inputs, with some attributes changed."""
        return self.emit(self.node.op, *inputs, **{**self.node.attr_dict, **overrides})

    def all_reduce(self, partial: Var) -> tuple:
        return self.emit("all_reduce", partial, world_size=self.world, tile_columns=self.tile_columns), REPLICATED

    def run(self) -> "_Sharder":
        for node in self.graph.nodes:
            self.node = node
            rule = SHARD_RULES.get(node.op)
            if not isinstance(rule, ShardRule):
                raise UnsupportedError(f"layer op {node.op} has no tensor-parallel rule"
                                       + (f": {rule.reason}" if rule is not None else ""), loc=node.loc,
                                       hint="tensor parallelism splits the unfused layer ops that have a rule in "
                                            "SHARD_RULES (mdsl.megakernel.parallel.tensor_parallel)")
            for var, out in zip(node.outputs, rule.split(node, self)):
                self.values[var.name] = out
        return self


# ---------------------------------------------------------------------------------------------
# shard rules, one per layer op: rule(node, sharder) -> [(rank's Var, layout) per output]

def _shard_embedding(node, s):
    tokens, table = node.inputs
    return [s.all_reduce(s.emit("vocab_embedding", s.replicated(tokens), s.weight(table, 0)))]


def _shard_rms_norm(node, s):
    x, w = node.inputs
    return [(s.same(s.replicated(x), s.weight(w, None)), REPLICATED)]


def _shard_linear(node, s):
    x, *ws = node.inputs
    row, layout = s.local(x)
    if layout == REPLICATED:         # column parallel: each weight's output rows dealt out
        return [(s.same(row, *(s.weight(w, 0) for w in ws)), Split(w.shape[0] for w in ws))]
    if isinstance(layout, Split) and len(layout.parts) == 1:   # row parallel: partial sums, then reduced
        return [s.all_reduce(s.same(row, *(s.weight(w, 1) for w in ws)))]
    raise UnsupportedError(f"linear of {x.name}, split as {layout}: a projection reads a replicated row or one "
                           "split into a single part", loc=node.loc)


def _shard_add_bias(node, s):
    """A projection's biases, split as its output row is: each bias vector's elements as its part's columns."""
    row, layout = s.local(node.inputs[0])
    biases = node.inputs[1:]
    if layout == REPLICATED:
        return [(s.same(row, *(s.weight(b, None) for b in biases)), REPLICATED)]
    if isinstance(layout, Split) and layout.parts == tuple(b.shape[0] for b in biases):
        return [(s.same(row, *(s.weight(b, 0) for b in biases)), layout)]
    raise UnsupportedError(f"add_bias of {node.inputs[0].name}, split as {layout}, by biases of "
                           f"{[b.shape[0] for b in biases]} elements: the biases must be the parts of the split row",
                           loc=node.loc, hint="give one bias per weight of the projection that made the row")


def qkv_layout(a: dict) -> Split:
    d = a["head_dim"]
    return Split((a["q_heads"] * d, a["kv_heads"] * d, a["kv_heads"] * d))


def _shard_heads(node, s):
    """head_rms_norm, rope and (scaled_)attention: each rank works on its query heads and their KV heads."""
    a = node.attr_dict
    qkv, *rest = node.inputs
    row, layout = s.local(qkv)
    if layout != qkv_layout(a):
        raise UnsupportedError(f"{node.op} reads {qkv.name} split as {layout}; it needs the q|k|v row of a column-"
                               "parallel projection", loc=node.loc)
    heads = {"q_heads": s.split(a["q_heads"], f"the {a['q_heads']} query heads", heads=True),
             "kv_heads": s.split(a["kv_heads"], f"the {a['kv_heads']} KV heads", heads=True)}
    if node.op in ("attention", "scaled_attention"):
        caches = [s.state(c, (c.shape[0], heads["kv_heads"], c.shape[2])) for c in rest]
        return [(s.same(row, *caches, **heads), Split((a["q_heads"] * a["head_dim"],)))]
    return [(s.same(row, *(s.weight(w, None) for w in rest), **heads), layout)]


def _shard_act_mul(node, s):
    row, layout = s.local(node.inputs[0])
    if layout == REPLICATED:
        return [(s.same(row), REPLICATED)]
    if isinstance(layout, Split) and len(layout.parts) == 2 and layout.parts[0] == layout.parts[1]:
        return [(s.same(row), Split(layout.parts[:1]))]
    raise UnsupportedError(f"{node.op} reads {node.inputs[0].name} split as {layout}; it needs a gate|up row",
                           loc=node.loc)


def _shard_elementwise(node, s):
    """An element-wise op of a row, split as its operand is."""
    row, layout = s.local(node.inputs[0])
    return [(s.same(row), layout)]


def _shard_add(node, s):
    (x, lx), (y, ly) = s.local(node.inputs[0]), s.local(node.inputs[1])
    if lx != ly:
        raise UnsupportedError(f"add of {node.inputs[0].name} ({lx}) and {node.inputs[1].name} ({ly})", loc=node.loc,
                               hint="both operands must be split alike")
    return [(s.same(x, y), lx)]


def _vocabulary_logits(node, s) -> Optional[Var]:
    """The rank's logits if they are split by vocabulary, None if replicated."""
    logits, layout = s.local(node.inputs[0])
    if layout == REPLICATED:
        return None
    if isinstance(layout, Split) and len(layout.parts) == 1:
        return logits
    raise UnsupportedError(f"{node.op} reads {node.inputs[0].name} split as {layout}", loc=node.loc)


def _shard_argmax(node, s):
    tokens = s.replicated(node.inputs[1])
    shard = _vocabulary_logits(node, s)
    if shard is None:
        return [(s.same(s.replicated(node.inputs[0]), tokens), REPLICATED)]
    return [(s.emit("tp_argmax", shard, tokens, world_size=s.world), REPLICATED)]


def _shard_sample(node, s):
    tokens = s.replicated(node.inputs[1])
    shard = _vocabulary_logits(node, s)
    logits = s.replicated(node.inputs[0]) if shard is None else \
        s.emit("all_gather", shard, world_size=s.world, tile_columns=s.tile_columns)
    return [(s.same(logits, tokens), REPLICATED)]


class ShardLowering:
    """A layer op's rule in `SHARD_RULES`: a `ShardRule`, or `NotSharded` with the reason."""


@attrs.frozen
class ShardRule(ShardLowering):
    """How an op is split over the ranks: `split(node, sharder)` gives each output's (rank's value, layout)."""

    split: Callable


@attrs.frozen
class NotSharded(ShardLowering):
    """An op that `tensor_parallel` does not split, and why (it refuses a graph holding one)."""

    reason: str


#: every layer op: the unfused ops split, the fused ops and the collectives say why they do not
SHARD_RULES: RuleTable[ShardLowering] = RuleTable("tensor-parallel split", ShardLowering,
                                                  "mdsl.megakernel.parallel.tensor_parallel (SHARD_RULES)",
                                                  registry=LAYER_OPS, needs=lambda op: True)
for _op, _rule in {"embedding": _shard_embedding, "rms_norm": _shard_rms_norm, "linear": _shard_linear,
                   "head_rms_norm": _shard_heads, "rope": _shard_heads, "attention": _shard_heads,
                   "act_mul": _shard_act_mul, "add": _shard_add, "argmax": _shard_argmax,
                   "sample": _shard_sample, "add_bias": _shard_add_bias, "scaled_attention": _shard_heads,
                   "rms_norm_1p": _shard_rms_norm, "geglu": _shard_act_mul, "scale": _shard_elementwise,
                   "softcap": _shard_elementwise}.items():
    SHARD_RULES.register(_op, ShardRule(_rule))
for _op in ("norm_linear", "norm_linear_bias", "norm_gate_up", "linear_residual", "linear_add_residual",
            "rope_attention", "rope_scaled_attention", "lm_head_argmax", "lm_head_sample", "norm_geglu",
            "linear_norm_residual", "scaled_embedding", "norm_1p_linear", "lm_head_1p_argmax", "lm_head_1p_sample"):
    SHARD_RULES.register(_op, NotSharded("tensor parallelism splits the unfused graph; each rank's graph is fused after "
                                         "the split (layer_fusion.fuse)"))
for _op in ("moe_router", "moe_experts"):
    SHARD_RULES.register(_op, NotSharded("a mixture of experts is not split over ranks (neither by expert nor "
                                         "within each expert's projections)"))
SHARD_RULES.register("gated_scale", NotSharded("a shared expert's gated output is not split over ranks (a mixture of "
                                               "experts is not)"))
for _op in ("norm_moe_router", "norm_moe_experts_residual"):
    SHARD_RULES.register(_op, NotSharded("tensor parallelism splits the unfused graph (a mixture of experts is not "
                                         "split over ranks)"))
for _op in ("all_reduce", "all_gather", "tp_argmax", "vocab_embedding"):
    SHARD_RULES.register(_op, NotSharded("the split makes it: it is already one rank's op"))


# ---------------------------------------------------------------------------------------------
# the plan

@attrs.frozen(eq=False)
class TensorParallelPlan:
    """`graph`: what every rank runs; `weight_axes`: (name, axis) per source weight, axis None when
    every rank holds all of it; `logits_layout`: how the logits output is split."""

    source: ModelGraph
    graph: ModelGraph
    world_size: int
    weight_axes: tuple = field(converter=tuple)
    logits_layout: object = REPLICATED

    def check_rank(self, rank: int) -> int:
        if not (isinstance(rank, (int, np.integer)) and 0 <= rank < self.world_size):
            raise ValidationError(f"rank {rank!r} is not one of the {self.world_size} ranks 0..{self.world_size - 1}")
        return int(rank)

    def weight_slices(self, rank: int) -> dict:
        """Weight name -> (axis, start, stop) of rank's slice, for the weights that are split."""
        rank = self.check_rank(rank)
        out = {}
        for name, axis in self.weight_axes:
            if axis is not None:
                n = self.source.weight(name).shape[axis] // self.world_size
                out[name] = (axis, rank * n, (rank + 1) * n)
        return out

    def shard_weights(self, weights: dict, rank: int) -> dict:
        """Rank's weights cut from the whole model's (name -> array)."""
        slices = self.weight_slices(rank)
        out = {}
        for name, _ in self.weight_axes:
            array = np.asarray(weights[name])
            if name in slices:
                axis, start, stop = slices[name]
                array = np.take(array, np.arange(start, stop), axis=axis)
            out[name] = array
        return out

    def gather_logits(self, per_rank: Sequence[np.ndarray]) -> np.ndarray:
        """The whole logits ([..., vocab]) from every rank's ([..., vocab / N]), in rank order."""
        if self.logits_layout == REPLICATED:
            return np.asarray(per_rank[0])
        pieces, start = [], 0
        for part in self.logits_layout.parts:
            chunk = part // self.world_size
            pieces += [np.asarray(p)[..., start:start + chunk] for p in per_rank]
            start += chunk
        return np.concatenate(pieces, axis=-1)

    def summary(self) -> str:
        split = sum(axis is not None for _, axis in self.weight_axes)
        comm = [n.op for n in self.graph.nodes if n.op in COLLECTIVE_RULES]
        ops = ", ".join(f"{op} x{comm.count(op)}" for op in sorted(set(comm)))
        per_rank = self.graph.weight_bytes()
        return (f"{self.source.name} over {self.world_size} ranks: {split} of {len(self.weight_axes)} weights split, "
                f"{per_rank} weight bytes per rank of {self.source.weight_bytes()}; communication: {ops or 'none'}")


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValidationError(f"the world size must be a positive number of ranks, got {world_size!r}")
    return int(world_size)


def _indivisible_error(graph: ModelGraph, world_size: int) -> ShapeError:
    constraints = _Sharder(graph, 1).run().constraints
    allowed = _divisors(math.gcd(*(c.size for c in constraints)))
    bad = [c for c in constraints if c.size % world_size]
    worst = next((c for c in bad if c.heads), bad[0])
    same_place = [c.what for c in bad if c.loc == worst.loc and c.heads == worst.heads]
    what = " and ".join(dict.fromkeys(same_place)) + (f" of {worst.op}" if worst.heads else "")
    return ShapeError(f"tensor parallelism over {world_size} ranks: {what} do not split into {world_size} "
                      f"equal parts", loc=worst.loc,
                      hint=f"world sizes this model allows: {', '.join(map(str, allowed))}")


def tensor_parallel(graph: ModelGraph, world_size: int, *, tile_columns: int = 0) -> TensorParallelPlan:
    """Split a model graph over `world_size` ranks (see the module's docstring). `tile_columns`: the
    width of the tiles that all_reduce and all_gather send (one put per tile and peer), 0 for the
    partition's column tiles (the finest overlap; a GPU wants fewer, larger puts)."""
    world_size = _check_world_size(world_size)
    if isinstance(tile_columns, bool) or not isinstance(tile_columns, (int, np.integer)) or tile_columns < 0:
        raise ValidationError(f"tile_columns must be 0 or a positive number of columns, got {tile_columns!r}")
    try:
        s = _Sharder(graph, world_size, int(tile_columns)).run()
    except _Indivisible:
        raise _indivisible_error(graph, world_size) from None
    logits, logits_layout = s.values[graph.logits.name]
    token, token_layout = s.values[graph.token.name]
    if token_layout != REPLICATED:
        raise UnsupportedError(f"the token of {graph.name} would differ between ranks ({token_layout})")
    for w in graph.weights:    # a weight no op reads stays whole
        s.weight_axes.setdefault(w.name, None)
        s.local_weights.setdefault(w.name, w)
    local = ModelGraph(f"{graph.name}_tp{world_size}", tuple(s.local_weights[w.name] for w in graph.weights),
                       tuple(s.local_states[x.name] for x in graph.states), tuple(s.nodes), (logits, token))
    return TensorParallelPlan(graph, local, world_size, tuple((w.name, s.weight_axes[w.name]) for w in graph.weights),
                              logits_layout)


def load_rank_weights(plan: TensorParallelPlan, folder: str, rank: int) -> dict:
    """Rank's weights from a Hugging Face checkpoint folder: only its slices of the split tensors are read."""
    return load_weights(plan.source, folder, slices=plan.weight_slices(rank))


# ---------------------------------------------------------------------------------------------
# the numpy reference over ranks

def rank_contexts(world_size: int, position: int, prompt_length: int) -> list:
    return [RankStepContext(position, prompt_length, r, world_size) for r in range(world_size)]


class TensorParallelReference:
    """Every rank's graph run op by op in lockstep: collectives by their `over_ranks` semantics, other
    ops by their reference on each rank's values."""

    def __init__(self, plan: TensorParallelPlan, rank_weights: Sequence[dict]):
        if len(rank_weights) != plan.world_size:
            raise ValidationError(f"{len(rank_weights)} ranks' weights for a plan of {plan.world_size} ranks")
        self.plan = plan
        self.weights = [{w.name: np.asarray(ws[w.name], np.float32) for w in plan.graph.weights} for ws in rank_weights]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        graph = self.plan.graph
        steps = check_steps(graph, prompt_ids, max_new_tokens)
        states = [initial_states(graph, prompt_ids) for _ in self.weights]
        rows = [[] for _ in self.weights]
        for pos in range(steps):
            ctxs = rank_contexts(self.plan.world_size, pos, len(prompt_ids))
            values = [{**w, **st} for w, st in zip(self.weights, states)]
            for node in graph.nodes:
                inputs = [[v[x.name] for x in node.inputs] for v in values]
                collective = COLLECTIVE_RULES.get(node.op)
                outs = collective.over_ranks(inputs, node.attr_dict, ctxs) if collective else \
                    [node.opdef.reference(xs, node.attr_dict, ctx) for xs, ctx in zip(inputs, ctxs)]
                for v, out in zip(values, outs):
                    v.update({x.name: o for x, o in zip(node.outputs, out)})
            for r, v in enumerate(values):
                rows[r].append(v[graph.logits.name].reshape(-1))
        return ranks_generation(self.plan, [st[TOKENS] for st in states], rows, len(prompt_ids), max_new_tokens)


def ranks_generation(plan: TensorParallelPlan, histories: Sequence[np.ndarray], rows: Sequence[list],
                     prompt_length: int, max_new_tokens: int) -> Generation:
    """One Generation from every rank's token history and logits rows; the ranks must agree on the tokens."""
    tokens = [tuple(int(t) for t in h[prompt_length:prompt_length + max_new_tokens]) for h in histories]
    if any(t != tokens[0] for t in tokens):
        raise ValidationError(f"the ranks generated different tokens: {tokens}")
    width = plan.graph.logits.shape[1]
    per_rank = [np.stack(r) if r else np.zeros((0, width), np.float32) for r in rows]
    return Generation(tokens[0], plan.gather_logits(per_rank))


# ---------------------------------------------------------------------------------------------
# the task graph of every rank, with the remote events that link them

@attrs.frozen(cache_hash=True)
class RemoteEvent:
    """A counter on each rank that other ranks' puts increment. `producers`: (task id, peer) pairs: the
    task of that id on rank (r - peer) mod N puts into rank r once per step; complete for step s at
    `count * (s + 1)`."""

    id: int
    producers: tuple = field(converter=tuple)
    consumers: tuple = field(converter=tuple)

    @property
    def count(self) -> int:
        return len(self.producers)

    def threshold(self, step: int) -> int:
        return self.count * (step + 1)

    def __str__(self) -> str:
        producers = " ".join(f"t{t}@-{k}" for t, k in self.producers)
        return f"remote event r{self.id} count={self.count} producers={producers} consumers={list(self.consumers)}"


@attrs.frozen(eq=False)
class TensorParallelTaskGraph:
    """`local`: the task graph every rank runs (its events are local counters); per task, `puts` (with
    the remote events each put signals on its receiver) and `remote_waits` (remote event ids)."""

    plan: TensorParallelPlan
    local: TaskGraph
    puts: tuple = field(converter=tuple)
    remote_events: tuple = field(converter=tuple)
    remote_waits: tuple = field(converter=tuple)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def put_bytes(self, task_id: int) -> int:
        """Bytes the task sends to other ranks per step."""
        return sum(self.local.region_bytes(src) for put in self.puts[task_id] for src, _ in put.regions)

    def summary(self) -> str:
        sending = sum(1 for p in self.puts if p)
        total = sum(self.put_bytes(t.id) for t in self.local.tasks)
        return (f"{self.world_size} ranks; per rank {self.local.summary()}; {sending} tasks send {total} bytes per "
                f"step to other ranks; {len(self.remote_events)} remote events")

    def __str__(self) -> str:
        lines = [f"tensor-parallel taskgraph {self.plan.graph.name} {{  # {self.summary()}"]
        lines += [f"  {e}" for e in self.remote_events]
        for t, puts, waits in zip(self.local.tasks, self.puts, self.remote_waits):
            for put in puts:
                regions = " ".join(f"{src}->{dst}" for src, dst in put.regions)
                events = " ".join(f"r{e}" for e in put.events)
                lines.append(f"  task {t.id} {t.kind} puts to rank+{put.peer}: {regions} signal {events}")
            if waits:
                lines.append(f"  task {t.id} {t.kind} waits remote {' '.join(f'r{e}' for e in waits)}")
        lines.append("}")
        return "\n".join(lines)

    def landings(self) -> list:
        """(sender task id, peer, destination Region) of every put."""
        return [(t.id, put.peer, dst) for t in self.local.tasks for put in self.puts[t.id] for _, dst in put.regions]

    def remote_inputs(self) -> list:
        """Per task: the sorted (sender task, peer) pairs whose puts land in what it reads."""
        landings = self.landings()
        index = RegionIndex((i, dst) for i, (_, _, dst) in enumerate(landings))
        return [sorted({landings[i][:2] for r in t.reads for i in index.overlapping(r)}) for t in self.local.tasks]

    def validate(self) -> "TensorParallelTaskGraph":
        """Across ranks, what `TaskGraph.validate` checks within one: every put a task reads is one of
        its remote events' producers, from an earlier task (in-order dispatch cannot deadlock); and no
        put of step s + 1 can land before the task reading it in step s has run (the task comes before
        the sender's end of step s, or the sender's put comes after the reader's rank starts step s + 1)."""
        events = {e.id: e for e in self.remote_events}
        inputs = self.remote_inputs()
        for t in self.local.tasks:
            covered = {p for e in self.remote_waits[t.id] for p in events[e].producers}
            for sender, peer in inputs[t.id]:
                if (sender, peer) not in covered:
                    raise ValidationError(f"task {t.id} ({t.kind}) reads what task {sender} of rank -{peer} puts "
                                          "without waiting for it")
                if sender >= t.id:
                    raise ValidationError(f"task {t.id} ({t.kind}) waits for a put of the later task {sender}; "
                                          "tasks handed out in order could deadlock")
        ends, starts = self._step_reach()
        n = self.world_size
        for t in self.local.tasks:
            for sender, peer in inputs[t.id]:
                offset = -peer % n
                if not (ends[t.id] >> offset) & 1 and (sender, offset) not in starts:
                    raise ValidationError(f"the put of task {sender} ({self.local.tasks[sender].kind}) from rank "
                                          f"-{peer} in step s + 1 may land before task {t.id} ({t.kind}) has read "
                                          "step s's", hint="the reader must lead to the sender's next token")
        return self

    def _step_reach(self) -> tuple:
        """Dependencies within a step, ranks as offsets from one rank: per task, the bit mask of offsets
        whose end of step (token write) it leads to; and the (task, offset) pairs that follow one rank's
        start of a step."""
        n, tasks = self.world_size, self.local.tasks
        local_events = {e.id: e for e in self.local.events}
        same_step = {w.event for t in tasks for w in t.waits if w.step_offset == 0}
        remote = {e.id: e for e in self.remote_events}
        successors = [[(u, 0) for e in t.signals if e in same_step for u in local_events[e].consumers] +
                      [(u, put.peer) for put in self.puts[t.id] for e in put.events for u in remote[e].consumers]
                      for t in tasks]
        terminal = set(self.local.terminal_tasks())
        full = (1 << n) - 1
        ends = [0] * len(tasks)
        for t in reversed(tasks):
            mask = 1 if t.id in terminal else 0
            for u, shift in successors[t.id]:
                if u > t.id:
                    mask |= ((ends[u] << shift) | (ends[u] >> (n - shift))) & full
            ends[t.id] = mask
        starts = {(t.id, 0) for t in tasks if any(w.step_offset != 0 for w in t.waits)}
        frontier = list(starts)
        while frontier:
            t, offset = frontier.pop()
            for u, shift in successors[t]:
                nxt = (u, (offset + shift) % n)
                if nxt not in starts:
                    starts.add(nxt)
                    frontier.append(nxt)
        return ends, starts


def _inside(inner, outer) -> bool:
    return inner.buffer == outer.buffer and all(c <= a and b <= d for (a, b), (c, d) in zip(inner.box, outer.box))


def build_tensor_parallel_task_graph(plan: TensorParallelPlan,
                                     config: PartitionConfig = PartitionConfig()) -> TensorParallelTaskGraph:
    """The ranks' task graph (`build_task_graph` of the plan's graph) and the remote events of its puts:
    a task reading what other ranks put waits on one remote event counting exactly those puts."""
    local = build_task_graph(plan.graph, config)
    raw = []
    for t in local.tasks:
        collective = COLLECTIVE_RULES.get(plan.graph.nodes[t.node].op)
        rule = collective.puts.get(t.kind) if collective else None
        raw.append(tuple(rule(t, plan.graph.nodes[t.node])) if rule else ())
    entries = [(t.id, put.peer, dst) for t, puts in zip(local.tasks, raw) for put in puts for _, dst in put.regions]
    landing = RegionIndex((i, dst) for i, (_, _, dst) in enumerate(entries))
    _check_puts(local, raw, entries)
    event_ids: dict = {}
    consumers: dict = {}
    waits = []
    for t in local.tasks:
        producers = tuple(sorted({entries[i][:2] for r in t.reads for i in landing.overlapping(r)}))
        if producers:
            eid = event_ids.setdefault(producers, len(event_ids))
            consumers.setdefault(eid, []).append(t.id)
        waits.append((event_ids[producers],) if producers else ())
    events = tuple(RemoteEvent(eid, producers, consumers[eid]) for producers, eid in event_ids.items())
    signalled = defaultdict(list)          # (task, peer) -> the remote events its put counts in
    for e in events:
        for producer in e.producers:
            signalled[producer].append(e.id)
    puts = tuple(tuple(attrs.evolve(put, events=signalled[(t.id, put.peer)]) for put in task_puts)
                 for t, task_puts in zip(local.tasks, raw))
    for t, task_puts in zip(local.tasks, puts):
        for put in task_puts:
            if not put.events:
                raise ValidationError(f"task {t.id} ({t.kind}) puts into rank+{put.peer} what no task there reads")
    return TensorParallelTaskGraph(plan, local, puts, events, waits).validate()


def _check_puts(local: TaskGraph, raw: list, entries: list) -> None:
    """A put sends what its task wrote, lands where no local task writes, and never in the sender's slot."""
    local_writes = RegionIndex((t.id, r) for t in local.tasks for r in t.writes)
    for t, puts in zip(local.tasks, raw):
        for put in puts:
            if not 0 < put.peer < local.model.nodes[t.node].attr_dict.get("world_size", 0):
                raise ValidationError(f"task {t.id} ({t.kind}) puts to rank+{put.peer}, not another rank")
            for src, dst in put.regions:
                if not any(_inside(src, w) for w in t.writes):
                    raise ValidationError(f"task {t.id} ({t.kind}) puts {src}, which it does not write")
    for tid, peer, dst in entries:
        clash = local_writes.overlapping(dst)
        if clash:
            raise ValidationError(f"task {tid} puts into {dst} on rank+{peer}, which task {clash[0]} there writes too")

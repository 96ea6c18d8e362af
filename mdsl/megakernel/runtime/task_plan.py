"""The megakernel's device task tables for one decode step of a decoder, and the events linking them,
lowered from the model's TaskGraph.

`build_plan` traces the built-in decoder (`plan_model` takes any model graph), fuses it
(mdsl.megakernel.taskgraph.layer_fusion: one op per device task kind), cuts it into the device's tiles
(`device_partition`), drops waits that others imply (taskgraph.without_implied_waits) and lowers it
(`lower_task_graph`): each op's rule in `DEVICE_RULES` (below) turns its
tasks into table rows (Kind, layer, begin, end, and the device buffer ranges the row reads and writes);
the TaskGraph's events become the device's (one per distinct set of producer rows). The embedding's tasks
are absorbed: the device's sampling task writes the next step's embedding row, so the tasks that waited
for the embedding wait for the previous step's token instead, the one cross-step event.

A step is a list of tasks in dependency order; the persistent kernel's worker w runs the task indices
`step * tasks_per_step + k` equal to w modulo the workers, in increasing order, so a task only ever waits
on tasks taken before it (no deadlock while every worker block is resident). A consumer waits only for the producer tiles it
reads. An event counts its producers' completions: it is complete for step s at `producers * (s + 1)`,
so counters are never reset within a launch. The embedding row of step s + 1 is written by step s's
sampling task, so the event it signals starts at 1 (the host writes step 0's): the TaskGraph's
threshold `count * (s + 1 - 1)` for a wait on the previous step.

Every task of a step is an ancestor of the step's sampling task, and every task of step s + 1 waits
(through the embedding) for that sampling task: a buffer is never rewritten while a task of the
previous step still reads it. `check_plan` verifies these rules.

Task kinds (each one's device body: cuda_bodies.py, generated from the op's rule in `CUDA_TASK_RULES`; the
residual-stream rows a kind reads and writes, h_l or mid_l, are the plan's `KindOp.streams`, shown here for a
sequential decoder's, Llama-3's):
  QKV      rows [begin, end) of [q; k; v] = W_qkv rms_norm(h_l) (+ b_qkv: Qwen2's biases)
  ATTN     kv head `begin`, split `end` of the positions (the last `window` of them where the model has a
           sliding window): q/k norm, RoPE, the KV cache append (by the
           split holding the newest position), partial softmax-weighted sums over its positions; the
           split of a kv head that finishes last merges the splits' partials of its query heads into the
           attention output (the task graph's combine tasks are absorbed into it)
  OPROJ    rows of mid_l = h_l + W_o attn
  GATEUP   rows of act_l = act(W_gate x) * (W_up x), x = rms_norm(mid_l) (SwiGLU: act = silu)
  DOWN     rows of h_{l+1} = mid_l + W_down act_l
           (a parallel block, x + (o_proj(attn) + mlp): GATEUP normalises h_l, OPROJ writes mid_l = W_o attn, DOWN
           h_{l+1} = h_l + (mid_l + W_down act_l))
           (a post-normed block, x + norm(W out) (Gemma-2's; linear_norm_residual): OPROJ and DOWN tiles write their
           raw rows of mid_l and h_{l+1}, and the tile that finishes last rewrites the row as h_l + norm(mid_l),
           mid_l + norm(h_{l+1}), before it signals)
  LMHEAD   rows of logits = W_lm rms_norm(h_L) and the tile's best token
  SAMPLE   the token (greedy, temperature, top-p), stop conditions, next step's embedding row
  SCHEDULE a serving step's boundary: the tables of serving steps of many rows only (serving_plan.py)
A mixture of experts' layer (Qwen3-MoE), in place of GATEUP and DOWN:
  ROUTER       rows (experts) of the router's logits W_router rms_norm(mid_l); the tile that finishes last
               (a per-layer counter, as attention's merge) routes: softmax, top-k, the k expert ids and weights
  EXPERT_UP    rows [j * MI + a, j * MI + b) of the slots' activations: act(W_gate,e x) * (W_up,e x) for the
               expert e the router put in slot j (rows a..b of it), x = rms_norm(mid_l); only e's rows are read
  EXPERT_DOWN  rows of h_{l+1} = mid_l + sum over the slots j, in order, of weight_j (W_down,e_j act_j)
"""
from __future__ import annotations

import enum
import functools
import re
from typing import Callable, Optional

import attrs
import numpy as np

from mdsl.errors import UnsupportedError
from mdsl.ir.rules import RuleTable
from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.layers import LAYER_OPS, split_biases
from mdsl.megakernel.modelgraph.model import TOKENS, ModelGraph
from mdsl.megakernel.runtime.megakernel_options import MAX_SPLITS
from mdsl.megakernel.runtime.shape import EXPERT_PARTS, QKV_BIASES, DecoderShape, expert_slot
from mdsl.megakernel.taskgraph.layer_fusion import fuse
from mdsl.megakernel.taskgraph.partition import balanced_tiles, build_task_graph
from mdsl.megakernel.taskgraph.tasks import PartitionConfig, TaskGraph, without_implied_waits


class Kind(enum.IntEnum):
    """A device task kind; its number is the task table's (device.cu's KIND_*)."""
    QKV = 0
    ATTN = 1
    OPROJ = 3
    GATEUP = 4
    DOWN = 5
    LMHEAD = 6
    SAMPLE = 7
    # the serving tables' step boundary (serving_plan.py; the kernel declares it only where a plan has it)
    SCHEDULE = 8
    # a mixture of experts' (numbered apart from the decoders' kinds: the kernel declares them only where a plan
    # has them, kernel_source.py)
    ROUTER = 12
    EXPERT_UP = 13
    EXPERT_DOWN = 14


SERVING_KINDS = (Kind.SCHEDULE,)
EMBEDDING = "h0"   # the residual stream's first buffer: the embedding row, written by the previous step


@attrs.frozen
class Access:
    buffer: str
    lo: int
    hi: int

    def overlaps(self, other: "Access") -> bool:
        return self.buffer == other.buffer and self.lo < other.hi and other.lo < self.hi


@attrs.frozen
class PlannedTask:
    kind: Kind
    layer: int
    begin: int
    end: int
    reads: tuple      # Access
    writes: tuple     # Access

    def label(self) -> str:
        where = f" L{self.layer}" if self.kind not in (Kind.LMHEAD, Kind.SAMPLE) else ""
        return f"{self.kind.name.lower()}{where} [{self.begin},{self.end})"


@attrs.frozen
class Event:
    producers: tuple     # task indices within a step (empty: the previous step's sampling task)
    initial: int = 0     # the count the host sets before a launch
    ranks: int = 1       # tensor parallelism: how many ranks' producers signal it (every rank's, or its own)

    @property
    def per_step(self) -> int:
        return max(1, len(self.producers)) * self.ranks


@attrs.frozen
class KindOp:
    kind: Kind
    op: str          # the layer op
    attrs: tuple     # its attributes, (name, value) pairs
    # the residual-stream rows its body reads and writes, (role, "h" or "mid", layer offset from its task's):
    # "row" (the normalised input), "residual" and "addend" (epilogue operands), "out"
    streams: tuple = ()

    def stream(self, role: str) -> Optional[tuple]:
        """("h" or "mid", layer offset) of the residual-stream row it reads or writes as `role`, or None."""
        return next(((family, offset) for r, family, offset in self.streams if r == role), None)

    @property
    def attr_dict(self) -> dict:
        return dict(self.attrs)


# attention positions per split at least (device.cu's MIN_CHUNK), unless a plan asks for fewer: a short
# context is one split, whose softmax weights are relative to the true maximum as in transformers' fused attention
MIN_CHUNK = 64
# ... with more than 16 splits: at least 64 would leave half of 32 splits empty at context 1024 (a rank of
# Qwen3-8B over two GPUs, whose 4 kv heads take 32 splits; `benchmarks/decode.py --variants` compares them)
WIDE_MIN_CHUNK = 32


def default_min_chunk(splits: int) -> int:
    """Attention positions per split at least, for `splits` splits per kv head."""
    return MIN_CHUNK if splits <= 16 else min(MIN_CHUNK, WIDE_MIN_CHUNK)


@attrs.frozen
class TaskPlan:
    shape: DecoderShape
    workers: int
    splits: int          # attention splits of the positions, per kv head
    max_seq: int
    tasks: tuple         # PlannedTask, in dependency order
    events: tuple        # Event
    waits: tuple         # per task: event indices
    signals: tuple       # per task: event indices
    lm_tiles: int
    world: int = 1       # tensor-parallel ranks running this plan, each on its shard (`for_ranks`)
    # KindOp per task kind present: the (fused) layer op whose tasks it runs, the source of its generated
    # body (cuda_bodies.py); every layer's op of a kind is the same, with the same attributes and streams
    kind_ops: tuple = ()
    min_chunk: int = MIN_CHUNK   # attention positions per split at least
    weights: tuple = ()          # BoundWeight per device weight slot its rows read: what the engine uploads
    embedding_scale: float = 0.0   # the embedding row times this (0: the table's row as it is; Gemma's sqrt(hidden))
    # per layer, the positions its attention reads back where that is fewer than the KV cache holds (a sliding
    # window: the device's WINDOW section), 0 where it reads every position; () where no layer has a window
    windows: tuple = ()

    def weight(self, slot: str, layer: Optional[int] = None) -> Optional["BoundWeight"]:
        """The graph weight that fills a device weight slot (of `layer`; None: the kernel's own), or None."""
        return next((w for w in self.weights if (w.slot, w.layer) == (slot, layer)), None)

    def op_of(self, kind: "Kind") -> "KindOp":
        for k in self.kind_ops:
            if k.kind is kind:
                return k
        raise KeyError(f"the plan has no {kind.name} tasks")

    def window(self, layer: int) -> int:
        """The positions layer `layer`'s attention reads back (its sliding window), 0: every position."""
        return self.windows[layer] if self.windows else 0

    @property
    def attention_window(self) -> int:
        """The one window every layer's attention reads back (0: every position), for the tables that take one
        for all layers (the serving tables'); refused where the layers' windows differ (Gemma-2's alternate
        layers: `window(layer)` is each one's)."""
        if len(set(self.windows)) > 1:
            raise UnsupportedError(f"the layers' attention windows differ ({list(self.windows)}): no one window "
                                   "serves every layer", hint="read TaskPlan.window(layer)")
        return self.windows[0] if self.windows else 0

    @property
    def max_chunk(self) -> int:
        """The most positions one attention split covers (device.cu's chunk rule), over the layers."""
        return max(self.min_chunk, *(-(-(w or self.max_seq) // self.splits) for w in set(self.windows) or {0}))

    def attention_range(self, position: int, split: int, layer: int) -> tuple:
        """Positions [lo, hi) of a split of layer `layer` at `position`: equal chunks of at least min_chunk from
        the first position attention reads (0, or the layer's window's first), so that the split holding
        `position` (the one that appends it to the KV cache) is the last non-empty one."""
        window = self.window(layer)
        first = max(0, position + 1 - window) if window else 0
        n = position + 1 - first
        chunk = max(self.min_chunk, -(-n // self.splits))
        return first + min(split * chunk, n), first + min(split * chunk + chunk, n)

    def tables(self) -> tuple:
        """(tasks int32 [n, 8], waits int32 [m, 2], signals int32 [k]): what the device reads.
        A task row: kind, layer, begin, end, first wait, wait count, first signal, signal count;
        a wait row: event, producers per step. An event every rank signals has REMOTE set in its wait and
        signal rows (read at system scope; signalled on the peers too)."""
        return device_tables(self.tasks, self.waits, self.signals, self.events,
                             lambda e: e | REMOTE if self.events[e].ranks > 1 else e)

    def initial_events(self) -> np.ndarray:
        return np.array([e.initial for e in self.events], dtype=np.uint32)

    def statistics(self) -> dict:
        kinds: dict = {}
        for task in self.tasks:
            kinds[task.kind.name] = kinds.get(task.kind.name, 0) + 1
        return {"tasks_per_step": len(self.tasks), "events": len(self.events), "workers": self.workers,
                "attention_splits": self.splits, "tasks_by_kind": kinds,
                "waits": sum(map(len, self.waits)), "signals": sum(map(len, self.signals))}


REMOTE = 1 << 30        # a signal row's flag: the event is signalled on every rank (device.cu's REMOTE)


def device_tables(tasks, waits, signals, events, word=lambda e: e) -> tuple:
    """(tasks int32 [n, 8], waits int32 [m, 2], signals int32 [k]) of tasks with their waits and signals
    (event indices): a task row is kind, layer, begin, end, first wait, wait count, first signal, signal count;
    a wait row the event's word, its producers per step. `word`: an event's index as the device reads it."""
    rows, wait_rows, signal_rows = [], [], []
    for task, task_waits, task_signals in zip(tasks, waits, signals):
        rows.append((int(task.kind), task.layer, task.begin, task.end,
                     len(wait_rows), len(task_waits), len(signal_rows), len(task_signals)))
        wait_rows += [(word(e), events[e].per_step) for e in task_waits]
        signal_rows += [word(e) for e in task_signals]
    return (np.array(rows, dtype=np.int32).reshape(-1, 8), np.array(wait_rows, dtype=np.int32).reshape(-1, 2),
            np.array(signal_rows or [0], dtype=np.int32))
# Under tensor parallelism, the tasks whose outputs every rank reads: the residual stream's partial sums
# (o-proj and down-proj tiles, and the sampler's next embedding row) and the LM head's tile bests.
CROSS_RANK_KINDS = (Kind.OPROJ, Kind.DOWN, Kind.LMHEAD, Kind.SAMPLE)
# ... of which the o-proj and down-proj tiles relay their partials: each tile sums its rows over the ranks itself
RELAYED_KINDS = (Kind.OPROJ, Kind.DOWN)


def for_ranks(plan: TaskPlan, world: int) -> TaskPlan:
    """The tables of one rank of `world` tensor-parallel ranks, from the plan of a rank's shard of the
    model (its query and KV heads, MLP columns and vocabulary slice: `shard_config`). Every rank runs the
    same tables. Each o-proj and down-proj tile (RELAYED_KINDS) puts its rows' partials to the peers as
    flagged words (value, step + 1), waits for the peers' words of the same rows, and writes the rows summed
    in rank order (device.cu's relay_rows), so their events count this rank's tiles only and nothing is
    signalled across GPUs for them; an event whose producers write what every rank reads otherwise (the LM
    head's tile bests, the sampler's embedding row) counts the producers of every rank, and the embedding's
    (the samplers') starts at `world`: the host puts step 0's row on every rank."""
    if plan.world != 1:
        raise ValueError(f"the plan is already one of {plan.world} ranks")
    if world == 1:
        return plan
    events = []
    for event in plan.events:
        kinds = {plan.tasks[k].kind for k in event.producers} or {Kind.SAMPLE}
        if kinds <= set(RELAYED_KINDS):
            events.append(event)
        elif kinds <= set(CROSS_RANK_KINDS):
            events.append(attrs.evolve(event, ranks=world, initial=event.initial * world))
        elif kinds & set(CROSS_RANK_KINDS):
            raise PlanError(f"event {event} mixes producers every rank reads with rank-local ones ({kinds})")
        else:
            events.append(event)
    return attrs.evolve(plan, events=tuple(events), world=world)


MIN_ROWS_PER_TILE = 8   # one per warp: smaller tiles cost more in waiting than they save


def tiles(n: int, count: int) -> list:
    """[lo, hi) ranges splitting n items into `count` near-equal tiles of at least MIN_ROWS_PER_TILE."""
    return balanced_tiles(n, count, MIN_ROWS_PER_TILE)


def attention_splits(shape: DecoderShape, workers: int, max_seq: int) -> int:
    """Splits per kv head: as many as fill the workers, at most MAX_SPLITS (the merge then combines them
    with a warp's shuffles, its loads in one L2 round trip: device.cu's combine_head)."""
    return max(1, min(workers // shape.kv_heads, MAX_SPLITS, max_seq))


def device_partition(workers: int, splits: int, min_chunk: Optional[int] = None) -> PartitionConfig:
    """The task graph's tiling as the device runs it: `tiles` per linear, `splits` chunked attention splits
    of at least `min_chunk` positions (default: default_min_chunk)."""
    return PartitionConfig(num_sms=workers, kv_splits=splits, min_columns=MIN_ROWS_PER_TILE,
                           attention_min_chunk=min_chunk or default_min_chunk(splits))


def build_plan(shape: DecoderShape, *, workers: int, max_seq: int, splits: Optional[int] = None,
               min_chunk: Optional[int] = None) -> TaskPlan:
    """The task tables of one decode step of the built-in decoder of `shape.config`, for `workers` worker
    blocks (one per SM). `splits`: attention splits per kv head (default: attention_splits); `min_chunk`:
    attention positions per split at least (default: default_min_chunk of the splits)."""
    graph = step_function(shape.config).trace(shape.config, max_positions=max_seq)
    return plan_model(graph, shape, workers=workers, max_seq=max_seq, splits=splits, min_chunk=min_chunk)


def plan_model(graph: ModelGraph, shape: DecoderShape, *, workers: int, max_seq: int,
               splits: Optional[int] = None, min_chunk: Optional[int] = None) -> TaskPlan:
    """The device tables of a model graph: fused (mdsl.megakernel.taskgraph.layer_fusion), cut into the device's tiles,
    waits implied by others dropped, and lowered (`lower_task_graph`). A graph the device cannot run gets
    an UnsupportedError naming the op and its line. (A sampling graph's settings are generate()'s.)"""
    splits = splits or attention_splits(shape, workers, max_seq)
    min_chunk = min_chunk or default_min_chunk(splits)
    task_graph = without_implied_waits(build_task_graph(fuse(graph), device_partition(workers, splits, min_chunk)))
    return lower_task_graph(task_graph, shape, workers=workers, max_seq=max_seq, splits=splits, min_chunk=min_chunk)


def lower_task_graph(task_graph: TaskGraph, shape: DecoderShape, *, workers: int, max_seq: int,
                     splits: int, min_chunk: Optional[int] = None) -> TaskPlan:
    """Table rows from the task graph's tasks, by each op's `device` rule (below), in the task graph's
    order; events from its events. A task a rule absorbs (the embedding: the previous step's sampler
    writes the row) hands its waits to the tasks waiting for it. The one cross-step event, a wait on the
    previous step's token (step offset -1), becomes event 0, which starts at count * 1 so that
    `producers * (step + 1)` is the task graph's `count * (step + 1 - 1)`."""
    graph = task_graph.model
    binding = _Binding(shape, max_seq, splits, min_chunk or default_min_chunk(splits))
    by_node: dict = {}
    for t in task_graph.tasks:
        by_node.setdefault(t.node, []).append(t)
    rows: list = []
    row_of: dict = {}     # task id -> row index; absent: absorbed
    kind_ops: dict = {}   # Kind -> the KindOp its rows come from
    for node in graph.nodes:   # (an op without a device lowering first: it says what the device lacks)
        rule = DEVICE_RULES.get(node.op)
        if not isinstance(rule, DeviceRule):
            raise binding.refuse(node, "it has no device lowering" + (f": {rule.reason}" if rule is not None else ""))
    for index, node in enumerate(graph.nodes):
        rule = DEVICE_RULES[node.op]
        binding.streams = []
        binding.kind_attrs = None
        made = rule.rows(node, by_node.get(index, []), binding)
        for task, row in zip(by_node.get(index, []), made):
            if row is not None:
                row_of[task.id] = len(rows)
                rows.append(row)
                mine = KindOp(row.kind, node.op, binding.kind_attrs or node.attrs, tuple(binding.streams))
                kind_op = kind_ops.setdefault(row.kind, mine)
                if kind_op != mine:
                    raise binding.refuse(node, f"its {row.kind.name} tasks ({node.op} {dict(node.attrs)}, rows "
                                               f"{list(mine.streams)}) would share one device body with {kind_op.op} "
                                               f"{dict(kind_op.attrs)}'s (rows {list(kind_op.streams)})")
    binding.finish(graph, rows)
    return attrs.evolve(_link_rows(task_graph, binding, rows, row_of, workers, max_seq, splits),
                        kind_ops=tuple(kind_ops[k] for k in sorted(kind_ops)),
                        min_chunk=binding.min_chunk, weights=tuple(binding.bound.values()),
                        embedding_scale=binding.embedding_scale,
                        windows=tuple(binding.windows.get(layer, 0) for layer in range(shape.layers))
                        if binding.windows else ())


_CROSS = "previous step's token"


def _link_rows(task_graph, binding, rows, row_of, workers, max_seq, splits) -> TaskPlan:
    events = {e.id: e for e in task_graph.events}
    tasks = task_graph.tasks
    sampler = len(rows) - 1

    memo: dict = {}

    def keys(wait) -> list:
        if wait not in memo:
            memo[wait] = device_keys(wait)
        return memo[wait]

    def device_keys(wait) -> list:
        producers = events[wait.event].producers
        if wait.step_offset == -1 and [row_of.get(p) for p in producers] == [sampler]:
            return [_CROSS]
        if wait.step_offset != 0:
            raise binding.refuse(task_graph.model.nodes[tasks[producers[0]].node],
                                 "the device carries only the next token from one step to the next")
        kept = tuple(sorted(row_of[p] for p in producers if p in row_of))
        found = [kept] if kept else []
        for p in producers:
            if p not in row_of:   # absorbed: wait for what it waited for
                found += [k for w in tasks[p].waits for k in keys(w)]
        return found

    device_events = [Event((), initial=1)]   # the cross-step event: initial = count * -(step offset -1)
    event_of = {_CROSS: 0}
    waits = []
    for t in tasks:
        if t.id not in row_of:
            continue
        mine = []
        for w in t.waits:
            for key in keys(w):
                if key not in event_of:
                    event_of[key] = len(device_events)
                    device_events.append(Event(key))
                if event_of[key] not in mine:
                    mine.append(event_of[key])
        waits.append(tuple(mine))
    signals = [[] for _ in rows]
    for e, event in enumerate(device_events):
        for p in event.producers or (sampler,):
            signals[p].append(e)
    lm_tiles = sum(row.kind is Kind.LMHEAD for row in rows)
    return TaskPlan(binding.shape, workers, splits, max_seq, tuple(rows), tuple(device_events), tuple(waits),
                    tuple(map(tuple, signals)), lm_tiles)


# ---------------------------------------------------------------------------------------------
# device rules: rule(node, its tasks, binding) -> a PlannedTask per task (None: absorbed). The device keeps fixed
# buffers per layer (h: the residual stream's row entering the layer, h[L] the last one's output; qkv, part,
# attn; mid: a second row of the stream's width; act), weight slots (shape.py: LAYER_WEIGHTS and QKV_BIASES per
# layer, KERNEL_WEIGHTS) and constants from the DecoderShape. `_Binding` places each graph value in a device
# buffer by the data flow (a task's layer is that of the buffer its input comes from), fills each weight slot
# from the graph weight that an op reads in its place, whatever its name (one weight's rows may fill several
# slots: a fused q|k|v), records the residual-stream rows each kind's body reads and writes (KindOp.streams),
# and refuses a graph the device cannot hold, naming the op.

STREAMS = ("h", "mid")   # the residual stream's rows: h[l] enters layer l; mid[l] is the layer's other row
_BUFFER = re.compile(r"([a-z]+)(\d+)$")


@attrs.frozen
class BoundWeight:
    """A device weight slot and the graph weight that fills it: `slot` (shape.py's LAYER_WEIGHTS or QKV_BIASES
    of layer `layer`, or KERNEL_WEIGHTS with layer None) is the rows from `row` on of the graph's weight `name`,
    of shape `shape`."""

    slot: str
    layer: Optional[int]
    name: str
    row: int
    shape: tuple

    def offset(self, itemsize: int) -> int:
        """Bytes from the start of the weight to the slot's first row."""
        return self.row * int(np.prod(self.shape[1:], dtype=np.int64)) * itemsize


class _Binding:
    def __init__(self, shape: DecoderShape, max_seq: int, splits: int, min_chunk: int):
        self.shape, self.max_seq, self.splits = shape, max_seq, splits
        self.min_chunk = min_chunk
        self.buffer_of: dict = {}    # graph value -> device buffer
        self.defined: set = set()    # device buffers written
        self.bound: dict = {}        # (slot, layer) -> BoundWeight
        self.state_of: dict = {}     # graph state -> device state
        self.graph_state: dict = {}  # device state -> graph state
        self.streams: list = []      # of the node being lowered: (role, stream, layer offset) its body reads, writes
        self.kind_attrs = None       # ... and its attributes as its kind's body reads them (None: the node's)
        self.embedding_scale = 0.0   # the embedding row's factor (scaled_embedding)
        self.windows: dict = {}      # layer -> its attention's window shorter than the KV cache

    def refuse(self, node, why: str) -> UnsupportedError:
        return UnsupportedError(
            f"the megakernel's GPU runtime cannot run {node.op} {_outputs(node)}: {why}", loc=node.loc,
            hint="the device runs the layer ops with a DeviceRule in DEVICE_RULES (mdsl.megakernel.runtime.task_plan) "
                 "once mdsl.megakernel.taskgraph.layer_fusion.fuse has fused the graph: embedding, norm_linear or "
                 "norm_linear_bias (q|k|v of a normalised row), rope_attention or rope_scaled_attention, linear, "
                 "linear_residual or linear_add_residual (o-proj, down-proj), norm_gate_up, norm_moe_router and "
                 "norm_moe_experts_residual (a mixture of experts) and lm_head_argmax / lm_head_sample, and Gemma's: "
                 "scaled_embedding, norm_1p_linear, linear_norm_residual, norm_geglu, lm_head_1p_argmax / "
                 "lm_head_1p_sample, over weights of any name, bound by the part they play; the CPU simulator "
                 "(mdsl.megakernel.taskgraph.simulator) runs any model graph")

    def buffer(self, node, var, families: tuple) -> tuple:
        """(family, layer) of the device buffer holding var, which must be one of `families`."""
        buffer = self.buffer_of.get(var.name)
        match = _BUFFER.match(buffer) if buffer is not None else None
        if match is None or match.group(1) not in families:
            want = " or ".join(f"{family}<layer>" for family in families)
            raise self.refuse(node, f"it reads {var.name} ({buffer or 'a value the device does not keep'}) where "
                                    f"the device reads {want}")
        return match.group(1), int(match.group(2))

    def layer(self, node, var, families: tuple) -> int:
        """The layer of a task whose input var is in one of `families`: that of var's buffer."""
        family, layer = self.buffer(node, var, families)
        if layer >= self.shape.layers:
            raise self.refuse(node, f"it reads {var.name} ({family}{layer}), the row after the model's last layer "
                                    f"({self.shape.layers} layers): the LM head's input")
        return layer

    def stream(self, node, role: str, var, layer: int) -> str:
        """The device row holding var, a row of the residual stream of `layer`, which the node's body reads as
        its `role`; recorded in its kind's streams."""
        family, at = self.buffer(node, var, STREAMS)
        if at != layer:
            raise self.refuse(node, f"its {role} {var.name} is {family}{at}, a row of layer {at}; the device reads "
                                    f"the task's own layer's ({layer})")
        self.streams.append((role, family, 0))
        return f"{family}{at}"

    def write_stream(self, node, var, layer: int) -> str:
        """The device row that a projection of `layer` writes var into: the layer's mid, then the next layer's h
        (recorded in its kind's streams)."""
        for family, at in (("mid", layer), ("h", layer + 1)):
            if f"{family}{at}" not in self.defined:
                self.streams.append(("out", family, at - layer))
                return self.define(node, var, f"{family}{at}")
        raise self.refuse(node, f"the device keeps two rows of the residual stream's width a layer (mid{layer}, "
                                f"h{layer + 1}), both written already")

    def weights(self, node, given, slots: tuple, layer: Optional[int] = None) -> None:
        """Fill the device's weight slots `slots` (of `layer`, or the kernel's own) with the rows of the weights
        `given`, concatenated in order: each slot's rows must lie in one of them."""
        s = self.shape
        dims = [s.slot_shape(slot) for slot in slots]
        have, need = sum(v.shape[0] for v in given), sum(d[0] for d in dims)
        where = f"{', '.join(slots)}" + (f" of layer {layer}" if layer is not None else "")
        if have != need or any(v.dtype != s.dtype for v in given):
            raise self.refuse(node, f"it reads the weights {[f'{v.name}: {v.type}' for v in given]} where the device "
                                    f"reads {where}: {need} rows of {s.dtype}")
        starts = np.cumsum([0] + [v.shape[0] for v in given])
        at = 0
        for slot, d in zip(slots, dims):
            i = int(np.searchsorted(starts, at, side="right")) - 1
            v, row = given[i], at - int(starts[i])
            if row + d[0] > v.shape[0] or tuple(v.shape[1:]) != d[1:]:
                raise self.refuse(node, f"the device's {slot} ({list(d)}) is rows {at}..{at + d[0]} of its weights, "
                                        f"which {v.name}: {v.type} does not hold whole")
            bound = BoundWeight(slot, layer, v.name, row, tuple(v.shape))
            if self.bound.setdefault((slot, layer), bound) != bound:
                raise self.refuse(node, f"the device's {slot}{f' of layer {layer}' if layer is not None else ''} is "
                                        f"{self.bound[slot, layer].name} already")
            at += d[0]

    def attrs(self, node, want: dict) -> None:
        got = node.attr_dict
        for name, value in want.items():
            if got[name] != value:
                raise self.refuse(node, f"its {name} is {got[name]}, the model's {value}")

    def read(self, node, var, buffer: str) -> str:
        if self.buffer_of.get(var.name) != buffer:
            where = self.buffer_of.get(var.name, "a value the device does not keep")
            raise self.refuse(node, f"it reads {var.name} ({where}) where the device reads {buffer}")
        return buffer

    def define(self, node, var, buffer: str, why: str = "") -> str:
        """var is the device's `buffer`, written once a step (`why`: how the buffer's layer was chosen)."""
        if buffer in self.defined:
            raise self.refuse(node, f"the device's {buffer} is written twice" + (f" ({why})" if why else ""))
        self.defined.add(buffer)
        self.buffer_of[var.name] = buffer
        return buffer

    def state(self, node, var, name: str, shape: tuple) -> None:
        """The graph's state var is the device's state `name` (the token history, a layer's KV cache)."""
        if var.shape != shape:
            raise self.refuse(node, f"it updates {var.name}: {var.type}; the device keeps {name} of shape {list(shape)}")
        if self.state_of.setdefault(var.name, name) != name:
            raise self.refuse(node, f"it updates {var.name} as the device's {name}; the device keeps it as "
                                    f"{self.state_of[var.name]}")
        if self.graph_state.setdefault(name, var.name) != var.name:
            raise self.refuse(node, f"it updates {var.name} as the device's {name}, which holds "
                                    f"{self.graph_state[name]}")

    def finish(self, graph, rows) -> None:
        if not rows or rows[-1].kind is not Kind.SAMPLE:
            raise self.refuse(graph.nodes[-1], "the step does not end with the LM head and its token")


def _outputs(node) -> str:
    return ", ".join(map(str, node.outputs))


def _columns(task) -> tuple:
    return task.tile_value("col_start"), task.tile_value("col_stop")


def _embedding_rows(node, tasks, bind):
    tokens, table = node.inputs
    bind.weights(node, (table,), ("embed",))
    bind.state(node, tokens, TOKENS, (bind.max_seq,))
    bind.define(node, node.output, EMBEDDING)
    return [None] * len(tasks)   # the previous step's SAMPLE writes the row (the host, step 0's)


def _scaled_embedding_rows(node, tasks, bind):
    """The embedding's row times a factor, which the previous step's SAMPLE (the host, step 0's) multiplies it by
    as it writes the row (TaskPlan.embedding_scale)."""
    bind.embedding_scale = node.attr_dict["factor"]
    return _embedding_rows(node, tasks, bind)


def _normed_rows(node, tasks, bind, *, kind: Kind, norm: str, slots: tuple, output: str, biases: tuple = ()):
    """QKV and GATEUP: rows of a linear over rms_norm(x) into the `output` buffer of x's layer, x a row of the
    residual stream (h or mid); the norm weight fills slot `norm`, the weights' rows the `slots` in turn (a
    weight each, or one for several: Phi-3's qkv_proj), the biases' rows (norm_linear_bias) the `biases`."""
    x, norm_weight, *rest = node.inputs
    layer = bind.layer(node, x, STREAMS)
    src = bind.stream(node, "row", x, layer)
    out = bind.define(node, node.output, f"{output}{layer}",
                      f"its layer is that of the row it normalises, {x.name} ({src})")
    ws, bs = split_biases(rest) if biases else (tuple(rest), ())
    bind.weights(node, (norm_weight,), (norm,), layer)
    bind.weights(node, ws, slots, layer)
    if biases:
        bind.weights(node, bs, biases, layer)
    bind.attrs(node, {"eps": bind.shape.eps})
    return [PlannedTask(kind, layer, a, b, (Access(src, 0, bind.shape.hidden),), (Access(out, a, b),))
            for a, b in map(_columns, tasks)]


_QKV = ("q_proj", "k_proj", "v_proj")
_norm_linear_rows = functools.partial(_normed_rows, kind=Kind.QKV, norm="input_layernorm", slots=_QKV, output="qkv")
_norm_linear_bias_rows = functools.partial(_normed_rows, kind=Kind.QKV, norm="input_layernorm", slots=_QKV,
                                           output="qkv", biases=QKV_BIASES)
_norm_gate_up_rows = functools.partial(_normed_rows, kind=Kind.GATEUP, norm="post_attention_layernorm",
                                       slots=("gate_proj", "up_proj"), output="act")
# (norm_geglu: the same rows; its epilogue gates by GELU's tanh approximation)


def _rope_attention_rows(node, tasks, bind):
    return _attention_rows(node, tasks, bind, {})


def _attention_rows(node, tasks, bind, options: dict):
    """ATTN rows of rope_attention or rope_scaled_attention, whose attributes beside the heads and RoPE's are
    `options` (the model's), and q/k norms' eps where it has them."""
    s = bind.shape
    qkv_var, k_cache, v_cache, *norms = node.inputs
    layer = bind.layer(node, qkv_var, ("qkv",))
    bind.attrs(node, {"q_heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim, **s.config.rope.attrs(),
                      **options, **({"eps": s.eps} if norms else {})})
    if norms:   # (the device normalises heads where a layer's q_norm and k_norm slots are filled)
        bind.weights(node, norms, ("q_norm", "k_norm"), layer)
    for var, name in ((k_cache, f"k_cache.{layer}"), (v_cache, f"v_cache.{layer}")):
        bind.state(node, var, name, (bind.max_seq, s.kv_heads, s.head_dim))
    qkv = f"qkv{layer}"
    attn = bind.define(node, node.output, f"attn{layer}")
    part, width, d = f"part{layer}", s.head_dim + 2, s.head_dim
    k_base, v_base = s.attention_width, s.attention_width + s.kv_heads * d
    rows = []
    for t in tasks:
        if t.kind == "rope_attention.combine":
            rows.append(None)    # absorbed: the kv head's last split merges (its readers wait for the splits)
            continue
        g, split = t.tile_value("kv_head"), t.tile_value("split")
        assert (t.tile_value("splits"), t.tile_value("min_chunk")) == (bind.splits, bind.min_chunk), t
        reads = (Access(qkv, g * s.group * d, (g + 1) * s.group * d), Access(qkv, k_base + g * d, k_base + (g + 1) * d),
                 Access(qkv, v_base + g * d, v_base + (g + 1) * d))
        parts = [(head * bind.splits + split) * width for head in range(g * s.group, (g + 1) * s.group)]
        # any split may be the last, which merges its siblings' partials (ordered by device.cu's split
        # counter, not by events) and writes its heads' outputs
        writes = tuple(Access(part, r, r + width) for r in parts) + \
            (Access(attn, g * s.group * d, (g + 1) * s.group * d),)
        rows.append(PlannedTask(Kind.ATTN, layer, g, split, reads, writes))
    return rows


def _rope_scaled_attention_rows(node, tasks, bind):
    """rope_attention's rows over the last `window` positions of the layer (TaskPlan.window: the WINDOW section
    of the device's attention, a window per layer), the scores scaled by `scale` (kernel_source's SCALE) and
    soft-capped by `softcap` (the SOFTCAP section). The window is the layer's, not the kind's: the kind's body
    reads window 0, so that layers with different windows, or none (a window at least as long as the KV cache
    is every position), share it (Gemma-2's alternate layers)."""
    layer = bind.layer(node, node.inputs[0], ("qkv",))
    rows = _attention_rows(node, tasks, bind, {})
    window = node.attr_dict["window"]
    if 0 < window < bind.max_seq:
        bind.windows[layer] = window
    bind.kind_attrs = tuple((name, 0 if name == "window" else value) for name, value in node.attrs)
    return rows


def _projection_rows(node, tasks, bind, operands: tuple = ()):
    """OPROJ and DOWN: rows of a projection of a layer's attention output (o-proj) or gated activations
    (down-proj) into a row of the residual stream's width (`write_stream`), with `operands` ((role, var): rows of
    the same layer's residual stream) added in its epilogue."""
    s = bind.shape
    x, ws = node.inputs[0], node.inputs[1 + len(operands):]
    family, layer = bind.buffer(node, x, ("attn", "act"))
    kind, slot, width = (Kind.OPROJ, "o_proj", s.attention_width) if family == "attn" else \
        (Kind.DOWN, "down_proj", s.intermediate)
    bind.weights(node, ws, (slot,), layer)
    reads = [bind.stream(node, role, var, layer) for role, var in operands]
    out = bind.write_stream(node, node.output, layer)
    src = f"{family}{layer}"
    return [PlannedTask(kind, layer, a, b, (Access(src, 0, width), *(Access(r, a, b) for r in reads)),
                        (Access(out, a, b),))
            for a, b in map(_columns, tasks)]


def _linear_norm_residual_rows(node, tasks, bind):
    """OPROJ and DOWN of residual + rms_norm(linear): the tiles write the raw rows of the residual stream's row
    (`write_stream`), and the tile that finishes last (a counter, as attention's last split merges) normalises the
    whole row by the norm weight (slot attn_post_norm, or mlp_post_norm) and adds the residual to it in place
    (residual.cuh's ROW_NORM section); the op's norm task is absorbed (its readers wait for the tiles). Any tile
    may be the last, so each reads the whole residual row and writes the whole output row."""
    s = bind.shape
    x, residual, norm, *ws = node.inputs
    family, layer = bind.buffer(node, x, ("attn", "act"))
    kind, slot, width, norm_slot = (Kind.OPROJ, "o_proj", s.attention_width, "attn_post_norm") if family == "attn" \
        else (Kind.DOWN, "down_proj", s.intermediate, "mlp_post_norm")
    bind.weights(node, ws, (slot,), layer)
    bind.weights(node, (norm,), (norm_slot,), layer)
    bind.attrs(node, {"eps": s.eps})
    res = bind.stream(node, "residual", residual, layer)
    out = bind.write_stream(node, node.output, layer)
    src = f"{family}{layer}"
    tiles_ = [t for t in tasks if t.kind == node.op]
    rows = {t.id: PlannedTask(kind, layer, a, b, (Access(src, 0, width), Access(res, 0, s.hidden)),
                              (Access(out, 0, s.hidden),)) for t, (a, b) in zip(tiles_, map(_columns, tiles_))}
    return [rows.get(t.id) for t in tasks]


def _linear_rows(node, tasks, bind):
    return _projection_rows(node, tasks, bind)


def _linear_residual_rows(node, tasks, bind):
    return _projection_rows(node, tasks, bind, (("residual", node.inputs[1]),))


def _linear_add_residual_rows(node, tasks, bind):
    return _projection_rows(node, tasks, bind, (("addend", node.inputs[1]), ("residual", node.inputs[2])))


def _lm_head_rows(node, tasks, bind):
    s = bind.shape
    x, norm, head, tokens = node.inputs
    bind.weights(node, (norm,), ("final_norm",))
    bind.weights(node, (head,), ("lm_head",))
    bind.attrs(node, {"eps": s.eps})
    bind.state(node, tokens, TOKENS, (bind.max_seq,))
    h = bind.read(node, x, f"h{s.layers}")
    bind.define(node, node.outputs[0], "logits")
    tiles_ = [t for t in tasks if t.kind == "lm_head"]
    rows = [PlannedTask(Kind.LMHEAD, s.layers, a, b, (Access(h, 0, s.hidden),),
                        (Access("logits", a, b), Access("best", t.tile_value("slot"), t.tile_value("slot") + 1)))
            for t, (a, b) in zip(tiles_, map(_columns, tiles_))]
    rows.append(PlannedTask(Kind.SAMPLE, s.layers, 0, len(tiles_),
                            (Access("logits", 0, s.vocab), Access("best", 0, len(tiles_))),
                            (Access(EMBEDDING, 0, s.hidden),)))
    return rows


def _moe_attrs(node, bind) -> None:
    """A mixture of experts' op: the kernel's constants (the experts, how many it picks, their hidden width) are
    the config's, which the op's must equal."""
    c = bind.shape.config
    if not c.num_experts:
        raise bind.refuse(node, "the model's config has no experts (num_experts), whose count, top-k and width "
                                "the device's mixture of experts takes from it")
    bind.attrs(node, {"eps": bind.shape.eps, "top_k": c.experts_per_token,
                      **({"norm_topk_prob": c.norm_topk_prob} if "norm_topk_prob" in node.attr_dict else {})})


def _norm_moe_router_rows(node, tasks, bind):
    """ROUTER rows: the router's rows (experts) of a normalised row of the residual stream; the router's route task is
    absorbed (the tile that finishes last routes: its readers wait for every tile)."""
    s = bind.shape
    x, norm_weight, router = node.inputs
    _moe_attrs(node, bind)
    layer = bind.layer(node, x, STREAMS)
    src = bind.stream(node, "row", x, layer)
    route = bind.define(node, node.output, f"route{layer}", f"its layer is that of the row it normalises, {x.name}")
    bind.weights(node, (norm_weight,), ("post_attention_layernorm",), layer)
    bind.weights(node, (router,), ("router",), layer)
    rows = []
    for t in tasks:
        if t.kind == "moe_router.route":
            rows.append(None)
            continue
        a, b = _columns(t)
        # any tile may be the last, which routes (ordered by the layer's router counter, not by events)
        rows.append(PlannedTask(Kind.ROUTER, layer, a, b, (Access(src, 0, s.hidden),),
                                (Access(f"router_logits{layer}", a, b), Access(route, 0, 2 * s.experts_per_token))))
    return rows


def _norm_moe_experts_residual_rows(node, tasks, bind):
    """EXPERT_UP rows per (slot, rows of the experts' hidden width), flattened to slot * MI + row, and EXPERT_DOWN
    rows of the residual stream's width; each expert's gate, up and down weight fills its slot of the layer's
    expert table (the engine's per-layer table of pointers: a task reads the rows of the expert the routing picked
    only)."""
    s = bind.shape
    x, norm_weight, routing, residual, *ws = node.inputs
    _moe_attrs(node, bind)
    layer = bind.layer(node, x, STREAMS)
    src = bind.stream(node, "row", x, layer)
    if bind.buffer(node, routing, ("route",)) != ("route", layer):
        raise bind.refuse(node, f"its routing row {routing.name} is not its own layer's ({layer}) router's")
    experts, k, inter = s.experts, s.experts_per_token, s.expert_intermediate
    if len(ws) != 3 * experts:
        raise bind.refuse(node, f"it has {len(ws) // 3} experts; the model's config {experts}")
    bind.weights(node, (norm_weight,), ("post_attention_layernorm",), layer)
    for part, group in zip(EXPERT_PARTS, (ws[:experts], ws[experts:2 * experts], ws[2 * experts:])):
        for e, w in enumerate(group):
            bind.weights(node, (w,), (expert_slot(part, e),), layer)
    res = bind.stream(node, "residual", residual, layer)
    out = bind.write_stream(node, node.output, layer)
    route, acts = f"route{layer}", f"expert_acts{layer}"
    rows = []
    for t in tasks:
        a, b = _columns(t)
        if t.kind == "moe.expert_up":
            first = t.tile_value("slot") * inter
            rows.append(PlannedTask(Kind.EXPERT_UP, layer, first + a, first + b,
                                    (Access(src, 0, s.hidden), Access(route, 0, 2 * k)),
                                    (Access(acts, first + a, first + b),)))
        else:
            rows.append(PlannedTask(Kind.EXPERT_DOWN, layer, a, b,
                                    (Access(route, 0, 2 * k), Access(acts, 0, k * inter), Access(res, a, b)),
                                    (Access(out, a, b),)))
    return rows


class DeviceLowering:
    """A layer op's rule in `DEVICE_RULES`: a `DeviceRule`, or `NotOnDevice` with the reason."""


@attrs.frozen
class DeviceRule(DeviceLowering):
    """How a fused layer op's tasks become table rows: `rows(node, tasks, binding)`, one row per task, or
    None for a task the device absorbs. Its device body is the op's rule in cuda_bodies.CUDA_TASK_RULES."""

    rows: Callable


@attrs.frozen
class NotOnDevice(DeviceLowering):
    """A layer op that no device task kind runs as it stands, and why: `plan_model` refuses a graph that
    keeps one after fusion, naming it and its line (the CPU simulator runs it)."""

    reason: str


#: every layer op has a rule: the fused ops of the decoders' task kinds lower to rows, every other op says why it
#: does not (the collectives register theirs in mdsl.megakernel.parallel.collectives)
DEVICE_RULES: RuleTable[DeviceLowering] = RuleTable("megakernel's device tables", DeviceLowering,
                                                    "mdsl.megakernel.runtime.task_plan (DEVICE_RULES)",
                                                    registry=LAYER_OPS, needs=lambda op: True)
for _op, _rule in {"embedding": _embedding_rows, "scaled_embedding": _scaled_embedding_rows,
                   "norm_linear": _norm_linear_rows, "norm_geglu": _norm_gate_up_rows,
                   "norm_1p_linear": _norm_linear_rows, "lm_head_1p_argmax": _lm_head_rows,
                   "lm_head_1p_sample": _lm_head_rows,
                   "linear_norm_residual": _linear_norm_residual_rows,
                   "norm_linear_bias": _norm_linear_bias_rows,
                   "rope_attention": _rope_attention_rows, "rope_scaled_attention": _rope_scaled_attention_rows,
                   "linear": _linear_rows, "linear_residual": _linear_residual_rows,
                   "linear_add_residual": _linear_add_residual_rows,
                   "norm_gate_up": _norm_gate_up_rows, "lm_head_argmax": _lm_head_rows,
                   "lm_head_sample": _lm_head_rows, "norm_moe_router": _norm_moe_router_rows,
                   "norm_moe_experts_residual": _norm_moe_experts_residual_rows}.items():
    DEVICE_RULES.register(_op, DeviceRule(_rule))
# the unfused ops: the device runs each only inside the fused op that layer_fusion.fuse makes of it
for _op, _reason in {
    "rms_norm": "the device normalises a row only as the input of the projections that read it (fused into "
                "norm_linear, norm_gate_up or the LM head); this norm feeds no projection",
    "head_rms_norm": "the device normalises query and key heads only inside attention (fused into rope_attention "
                     "when RoPE and attention follow it alone)",
    "rope": "the device applies RoPE only inside attention (fused into rope_attention when attention alone reads "
            "it)",
    "attention": "the device's attention applies RoPE to its query and key heads (rope_attention); this attention "
                 "reads no rope",
    "scaled_attention": "the device attends only after RoPE (rope_attention); this attention reads no rope",
    "rms_norm_1p": "the device normalises by (1 + weight) only as rms_norm does: the input of the projections "
                   "that read it, or a projection's output before its residual add (linear_norm_residual)",
    "geglu": "the device computes GeGLU only in the gate|up projection's epilogue of a normalised row (norm_geglu)",
    "scale": "the device scales a row only as the embedding's (scaled_embedding: the sampler writes it scaled)",
    "softcap": "the device soft-caps only the LM head's logits, in its epilogue (lm_head_argmax / lm_head_sample "
               "with softcap)",
    "moe_router": "the device routes only a normalised row of the residual stream (fused into norm_moe_router)",
    "moe_experts": "the device runs a mixture of experts only over a normalised row of the residual stream, routed "
                   "by a moe_router, its output added to the stream (fused into norm_moe_experts_residual)",
    "gated_scale": "the device has no body scaling a row by its gate (a shared expert's: Qwen2-MoE runs on the CPU "
                   "simulator and on mdsl.LLM's CPU and GPU devices)",
    "add_bias": "the device adds biases only to the q|k|v projection of a normalised row, in its epilogue "
                "(norm_linear_bias: one bias per weight); this add_bias follows no such projection",
    "act_mul": "the device applies a gated activation only to the gate|up projection of a normalised row "
               "(norm_gate_up)",
    "add": "the device adds rows only in a projection's epilogue: its output to one row (linear_residual), or "
           "to one row and the sum to another (linear_add_residual)",
    "argmax": "the device picks the token only from the LM head's logits of a normalised row (lm_head_argmax)",
    "sample": "the device samples the token only from the LM head's logits of a normalised row (lm_head_sample)",
}.items():
    DEVICE_RULES.register(_op, NotOnDevice(_reason))


def _writers(tasks) -> dict:
    """buffer -> [(task index, Access)] of the tasks writing it."""
    writers: dict = {}
    for k, task in enumerate(tasks):
        for w in task.writes:
            writers.setdefault(w.buffer, []).append((k, w))
    return writers


def _producers(writers: dict, read: Access, reader: int) -> tuple:
    return tuple(sorted({p for p, w in writers.get(read.buffer, ()) if w.overlaps(read) and p != reader}))


def _direct_producers(tasks, writers: dict, k: int) -> set:
    """The tasks of the step whose writes task k reads; len(tasks) stands for the previous step's
    sampler (the embedding row)."""
    found: set = set()
    for r in tasks[k].reads:
        if r.buffer == EMBEDDING and tasks[k].kind is not Kind.SAMPLE:
            found.add(len(tasks))
        else:
            found.update(_producers(writers, r, k))
    return found


class _Ancestry:
    """Ancestor sets as bitsets, per event (its producers and their ancestors) and per task (those of
    the events it waits for); bit n stands for the previous step's sampler."""

    def __init__(self, n: int):
        self.n = n
        self.of_event: list = []
        self.of_task: list = []

    def add_task(self, waits) -> int:
        bits = 0
        for e in waits:
            bits |= self.of_event[e]
        self.of_task.append(bits)
        return bits


def _has_bit(bits: bytes, k: int) -> bool:
    return k >> 3 < len(bits) and (bits[k >> 3] >> (k & 7)) & 1 == 1


def _as_bytes(bits: int) -> bytes:
    return bits.to_bytes((bits.bit_length() + 7) // 8 or 1, "little")


class PlanError(AssertionError):
    """The task tables break a rule the runtime relies on (a bug in mdsl)."""


MAX_WAITS = 256   # a task's waits are checked by one thread each (device.cu's NT)


def check_plan(plan: TaskPlan) -> None:
    """The rules the device runtime relies on: events count exactly the tasks that signal them, waits
    point backwards, every task's inputs are written by tasks it waits for (directly or through
    others), and every task leads to the sampler (so no buffer is rewritten while a task of the
    previous step still reads it)."""
    tasks, n = plan.tasks, len(plan.tasks)
    sampler = n - 1
    if tasks[sampler].kind is not Kind.SAMPLE:
        raise PlanError("the step's last task is not the sampler")
    signalled_by: dict = {}
    for k, signals in enumerate(plan.signals):
        for e in signals:
            signalled_by.setdefault(e, []).append(k)
    for e, event in enumerate(plan.events):
        want = list(event.producers) if event.producers else [sampler]
        if sorted(signalled_by.get(e, [])) != want:
            raise PlanError(f"event {e} is signalled by {signalled_by.get(e)} but counts {want}")
        if not event.producers and event.initial != event.ranks:
            raise PlanError(f"event {e} (the embedding) must start at {event.ranks} (one row per rank), "
                            f"not {event.initial}")
    writers = _writers(tasks)
    ancestry = _Ancestry(n)
    for event in plan.events:
        ancestry.of_event.append(0)   # filled once its producers' ancestors are known
    parents: list = []
    for k, task in enumerate(tasks):
        if len(plan.waits[k]) > MAX_WAITS:
            raise PlanError(f"task {k} ({task.label()}) waits for {len(plan.waits[k])} events (at most {MAX_WAITS})")
        waited = set()
        for e in plan.waits[k]:
            producers = plan.events[e].producers
            if any(p >= k for p in producers):
                raise PlanError(f"task {k} ({task.label()}) waits for a later task of its step: {producers}")
            if not ancestry.of_event[e]:
                bits = 0
                for p in producers or (n,):
                    bits |= (1 << p) | (ancestry.of_task[p] if p < n else 0)
                ancestry.of_event[e] = bits
            waited.update(producers or (n,))
        parents.append(waited)
        mine = _as_bytes(ancestry.add_task(plan.waits[k]))
        for p in _direct_producers(tasks, writers, k):
            if not _has_bit(mine, p):
                what = "the embedding row" if p == n else f"task {p} ({tasks[p].label()})"
                raise PlanError(f"task {k} ({task.label()}) reads from {what} without waiting for it")
    reaches = [False] * n
    reaches[sampler] = True
    for k in range(n - 1, -1, -1):
        if reaches[k]:
            for p in parents[k]:
                if p < n:
                    reaches[p] = True
    lost = [tasks[k].label() for k in range(n) if not reaches[k]]
    if lost:
        raise PlanError(f"{len(lost)} task(s) do not lead to the sampler, e.g. {lost[:3]}")

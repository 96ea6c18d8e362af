"""The megakernel's device tables for serving steps: up to `max_rows` token rows a step (every running request's
decode token and chunks of prompts, mdsl.serving's step) over the paged KV pool, in one resident launch.

`plan_serving` lowers a model graph as `plan_model` does (the same fusion, column tiles, weight slots, kind ops and
events: task_plan.py) and turns its one-row step into a serving step. Every per-layer buffer has a row per step
row ([max_rows][width]: h, mid, qkv, attn, act); a task reads the step's rows, their tokens, positions and
chunks at run time from the tables the scheduler writes (mdsl.serving.protocol's step, chunks and rows, and the
step's work in `ServingPlan.region`), so the tables are static: every task runs every step, and one with no work
for this step's rows only signals.

  SCHEDULE  task 0, the only task that waits on the previous step (on its SAMPLE tasks): the scheduler's step
            boundary (the previous step's tokens taken, streamed and their entries retired where they stop;
            cancel, plan, pages, admit; the protocol's step, chunks and rows), the step's attention items and
            sampling rows, and h0[r] = embed[token of row r] for every row
  QKV       columns [begin, end) of q|k|v of every row; a tile whose columns meet kv head g's key or value
            columns counts itself on the (layer, g) append counter, and the one that brings it to its tiles *
            (step + 1) appends head g's key (q/k-normed where the model has those norms, rotated at the row's
            position) and value of every row to page_table[entry][p // page_size], row p % page_size, for the
            row's position p, before it signals
  ATTN      kv head `begin`, task `end` of U (`attention_tasks`): the step's attention items i = end, end + U,
            ... (an item is one split of one row's causal range, cut by the row's position alone:
            `ServingPlan.row_splits`): its q heads (normed, rotated), the split's scores over the pool's keys,
            its softmax partials; the item that brings its (layer, row, g) merge counter to the row's splits
            merges the row's partials in split order into attn and sets the counter back to 0
  OPROJ, GATEUP, DOWN  their columns of every row (task_plan.py's bodies over rows)
  LMHEAD    vocab columns [begin, end) of the logits of every sampling row (the final norm of its h_L row) and
            the tile's best per sampling row
  SAMPLE    sampler `begin` of P (`samplers`): sampling rows j = begin, begin + P, ...: the token of row j's
            request (mdsl.serving.sampling.sample with its settings at its position) into chosen[j]

A chunk's keys are all in the pool before any of its rows reads them: an ATTN task of (layer, g) waits for every
QKV tile whose columns meet head g's key or value columns (it reads them), and the last of those appended the
head's rows before it signalled. That costs no dependency hop: a layer is QKV -> ATTN -> OPROJ -> GATEUP -> DOWN, as
for one row.

Events keep task_plan's rule: a counter complete for step s at producers * (s + 1). Event 0, the one cross-step
event, counts the P SAMPLE tasks and starts at P (the host's count before a launch), so that step 0's SCHEDULE
runs; SCHEDULE's event (1) completes the h0 rows and the step's tables for the step's first tasks. Every task of a
step leads to a SAMPLE task and SCHEDULE waits for all of them, so when SCHEDULE rewrites the step's tables, h0
and the page tables, no task of the previous step still reads them; `check_serving_plan` verifies it. A merge
counter's reset is its last access of a step (the row's every other item of the kv head counted before it), and
its next one is by an ATTN task of a later step, which descends from that step's SCHEDULE: the counters need no
pass at the step boundary. The append counters are never reset: every QKV tile runs every step, so their
thresholds grow with the step as the events' do.
"""
from __future__ import annotations

from typing import Optional

import attrs
import numpy as np

from mdsl.errors import UnsupportedError
from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.model import ModelGraph
from mdsl.megakernel.runtime.shape import DecoderShape
from mdsl.megakernel.runtime.task_plan import (EMBEDDING, MAX_WAITS, Access, Kind, PlanError, PlannedTask, TaskPlan,
                                               _producers, _writers, attention_splits, device_tables,
                                               plan_model)
from mdsl.megakernel.taskgraph.layer_fusion import fuse
from mdsl.serving.protocol import I32, U32, Array, Field, Layout, Region, ServingShape

# A row's causal range (its window's, with a sliding window) of n keys is cut into splits of SPLIT_KEYS keys, or
# of the multiple of SPLIT_KEYS that makes at most MAX_ROW_SPLITS splits, from its first position: by n alone,
# so a row's partial sums and their merge are the same whatever the step's other rows (the GPU device's
# step_kernels.cu cuts a row's range by the same rule).
SPLIT_KEYS = 64
MAX_ROW_SPLITS = 64

SERVE_WORK = Layout("ServeWork", [
    Field("num_items", U32),         # the step's attention items: items[0 .. num_items)
    Field("num_samples", U32),       # its sampling rows: sample_rows[0 .. num_samples), at most one a chunk
], "the step's work beside the protocol's step tables; SCHEDULE writes it")

ATTN_ITEM = Layout("AttnItem", [
    Field("row", U32),               # the query row: rows[row] gives its position and chunk (its entry's pages)
    Field("split", U32),             # its place among the row's splits, in position order
    Field("splits", U32),            # the row's splits: what its merge counters count to
    Field("first", U32),             # the row's first item: items first .. first + splits - 1 are its splits
    Field("lo", U32),                # the split's keys: positions lo .. hi - 1 of the row's entry
    Field("hi", U32),
], "one split of one row's attention range: the same for every kv head of every layer")

SERVING_LAYOUTS = (SERVE_WORK, ATTN_ITEM)

# the fused layer ops whose tasks run over a step's rows (the decoders' kinds); a graph with another is refused
SERVED_OPS = frozenset({"norm_linear", "norm_linear_bias", "rope_attention", "rope_scaled_attention", "linear",
                        "linear_residual", "linear_add_residual", "norm_gate_up", "lm_head_argmax",
                        "lm_head_sample"})

SCHEDULE_EVENT = 1   # the event SCHEDULE signals (event 0: the previous step's SAMPLE tasks)
STEP = "step"        # the scheduler's tables of the step, as a buffer the tasks read (the protocol's and region's)
# the ATTN items' partials: one buffer for every layer (at 256 rows of 64 splits, 8 kv heads of 4 query heads of 128
# dims, 272 MB), since a layer's ATTN tasks follow the previous layer's merges (through its o-proj tiles)
PARTS = "parts"


@attrs.frozen
class ServingEvent:
    """A counter of its producers' completions (task indices of a step); `previous_step`: it counts the previous
    step's producers, and the host starts it at one step's count."""

    producers: tuple
    previous_step: bool = False

    @property
    def per_step(self) -> int:
        return len(self.producers)

    @property
    def initial(self) -> int:
        return self.per_step if self.previous_step else 0


@attrs.frozen
class ServingPlan:
    base: TaskPlan            # the one-row lowering of the graph: its tiles, weight slots, kind ops
    serving: ServingShape     # rows a step (max_tokens_per_step), batch entries, pages, positions
    tasks: tuple              # PlannedTask: SCHEDULE, the base step's tasks but its sampler, the SAMPLE tasks
    events: tuple             # ServingEvent
    waits: tuple              # per task: event indices
    signals: tuple            # per task: event indices
    attention_tasks: int      # ATTN tasks per (layer, kv head): U
    samplers: int             # SAMPLE tasks: P
    split_keys: int = SPLIT_KEYS
    max_row_splits: int = MAX_ROW_SPLITS

    shape = property(lambda self: self.base.shape)                   # the DecoderShape
    workers = property(lambda self: self.base.workers)
    lm_tiles = property(lambda self: self.base.lm_tiles)
    max_rows = property(lambda self: self.serving.max_tokens_per_step)   # rows a step at most

    def op_of(self, kind: Kind):
        return self.base.op_of(kind)

    def weight(self, slot: str, layer: Optional[int] = None):
        return self.base.weight(slot, layer)

    @property
    def attention_window(self) -> int:
        return self.base.attention_window

    def row_range(self, position: int) -> tuple:
        """(first position, keys) of the causal range a row at `position` attends: from 0, or from its window's
        first position."""
        window = self.attention_window
        first = max(0, position + 1 - window) if window else 0
        return first, position + 1 - first

    def split_width(self, keys: int) -> int:
        """The keys a split of a range of `keys` keys takes: split_keys, or the multiple of it that makes at most
        max_row_splits splits."""
        return self.split_keys * max(1, -(-keys // (self.split_keys * self.max_row_splits)))

    def row_splits(self, position: int) -> list:
        """[lo, hi) of each split of the row at `position`, in position order."""
        first, n = self.row_range(position)
        width = self.split_width(n)
        return [(first + a, first + min(a + width, n)) for a in range(0, n, width)]

    @property
    def max_items(self) -> int:
        """Attention items a step may hold: every row with the most splits a position below max_seq gives."""
        keys = self.attention_window or self.serving.max_seq
        return self.max_rows * min(self.max_row_splits, -(-keys // self.split_keys))

    def items(self, positions) -> np.ndarray:
        """The attention items (ATTN_ITEM records) of a step whose rows are at `positions`: each row's splits in
        order, the rows in order."""
        out = []
        for row, position in enumerate(positions):
            splits = self.row_splits(int(position))
            first = len(out)
            out += [(row, j, len(splits), first, lo, hi) for j, (lo, hi) in enumerate(splits)]
        return np.array(out, dtype=ATTN_ITEM.dtype()).reshape(-1)

    def appended_heads(self, task: PlannedTask) -> tuple:
        """The kv heads whose key or value columns a QKV task's columns meet (it counts itself on their append
        counters)."""
        s = self.shape
        d, k_base, v_base = s.head_dim, s.attention_width, s.attention_width + s.kv_heads * s.head_dim
        return tuple(g for g in range(s.kv_heads)
                     if any(task.begin < base + (g + 1) * d and base + g * d < task.end for base in (k_base, v_base)))

    def append_tiles(self, kv_head: int, layer: int = 0) -> int:
        """The QKV tiles of a layer counted on kv head `kv_head`'s append counter (the same every layer)."""
        return sum(t.kind is Kind.QKV and t.layer == layer and kv_head in self.appended_heads(t) for t in self.tasks)

    def region(self) -> Region:
        """The step's work in device memory beside the protocol's device region: the header, the attention
        items, the sampling rows (a row index each) and their tokens, the merge counters per (layer, row, kv head)
        (each set back to 0 by the item that merges) and the append counters per (layer, kv head) (their
        thresholds grow with the step). The host zeroes the region before a launch."""
        s = self.shape
        return Region("serve", [
            Array("work", SERVE_WORK, (1,)),
            Array("items", ATTN_ITEM, (self.max_items,)),
            Array("sample_rows", I32, (self.serving.max_batch,)),
            Array("chosen", I32, (self.serving.max_batch,)),
            Array("merge_counts", U32, (s.layers, self.max_rows, s.kv_heads)),
            Array("append_counts", U32, (s.layers, s.kv_heads)),
        ])

    def activations(self) -> dict:
        """The kernel's per-step buffers and their shapes in elements (rows first where a buffer has a row per step
        row): the residual stream's rows, q|k|v, attention and MLP rows, the ATTN items' partials (per head of
        the item's kv head: its maximum, sum and weighted values; one buffer for every layer), the sampling rows'
        logits and their tiles' bests (value, token)."""
        s, r = self.shape, self.max_rows
        return {"h": (s.layers + 1, r, s.hidden), "mid": (s.layers, r, s.hidden), "qkv": (s.layers, r, s.qkv_rows),
                "attn": (s.layers, r, s.attention_width), "act": (s.layers, r, s.intermediate),
                "parts": (s.kv_heads, self.max_items, s.group, s.head_dim + 2),
                "logits": (self.serving.max_batch, s.vocab), "best": (self.serving.max_batch, self.lm_tiles, 2)}

    def c_declarations(self) -> str:
        """The region's layouts as C structs (static_asserts of the host's sizes and offsets), its offsets and the
        tables' constants: what the kernel's source includes beside mdsl.serving.protocol.c_declarations."""
        constants = {"MAX_ROWS": self.max_rows, "MAX_ITEMS": self.max_items, "ATTN_TASKS": self.attention_tasks,
                     "SAMPLERS": self.samplers, "SPLIT_KEYS": self.split_keys, "MAX_ROW_SPLITS": self.max_row_splits,
                     "KIND_SCHEDULE": int(Kind.SCHEDULE)}
        parts = [f"constexpr long long {k} = {v};" for k, v in constants.items()]
        parts += [layout.c_struct() for layout in SERVING_LAYOUTS]
        parts.append(self.region().c_offsets())
        return "\n".join(parts) + "\n"

    def tables(self) -> tuple:
        """(tasks int32 [n, 8], waits int32 [m, 2], signals int32 [k]), as TaskPlan.tables: a task row is kind,
        layer, begin, end, first wait, wait count, first signal, signal count; a wait row event, producers a step."""
        return device_tables(self.tasks, self.waits, self.signals, self.events)

    def initial_events(self) -> np.ndarray:
        return np.array([e.initial for e in self.events], dtype=np.uint32)

    def statistics(self) -> dict:
        kinds: dict = {}
        for task in self.tasks:
            kinds[task.kind.name] = kinds.get(task.kind.name, 0) + 1
        return {"tasks_per_step": len(self.tasks), "events": len(self.events), "workers": self.workers,
                "attention_tasks": self.attention_tasks, "samplers": self.samplers, "max_items": self.max_items,
                "tasks_by_kind": kinds}


def build_serving_plan(shape: DecoderShape, serving: ServingShape, *, workers: int, **kwargs) -> ServingPlan:
    """The serving tables of the built-in decoder of `shape.config` (plan_serving's arguments)."""
    graph = step_function(shape.config).trace(shape.config, max_positions=serving.max_seq)
    return plan_serving(graph, shape, serving, workers=workers, **kwargs)


def plan_serving(graph: ModelGraph, shape: DecoderShape, serving: ServingShape, *, workers: int,
                 split_keys: int = SPLIT_KEYS, max_row_splits: int = MAX_ROW_SPLITS) -> ServingPlan:
    """The serving tables of a model graph for `workers` worker blocks: its one-row lowering (plan_model, with
    U = attention_splits ATTN tasks per kv head) with SCHEDULE first, every task over the step's rows, and
    P = min(max_batch, workers) SAMPLE tasks in place of the sampler. A graph whose fused ops are not all
    SERVED_OPS gets an UnsupportedError naming the op and its line."""
    tasks_per_head = attention_splits(shape, workers, serving.max_seq)
    base = plan_model(graph, shape, workers=workers, max_seq=serving.max_seq, splits=tasks_per_head)
    _refuse_unserved(graph, base)
    samplers = max(1, min(serving.max_batch, workers))
    body = base.tasks[:-1]
    if base.tasks[-1].kind is not Kind.SAMPLE or any(not e.producers for e in base.events[1:]):
        raise PlanError("the one-row plan does not end with its sampler, the producer of its event 0 alone")
    s = shape
    schedule = PlannedTask(Kind.SCHEDULE, 0, 0, 0, (Access("chosen", 0, serving.max_batch),),
                           (Access(EMBEDDING, 0, s.hidden), Access(STEP, 0, 1)))
    plan = ServingPlan(base, serving, (), (), (), (), tasks_per_head, samplers, split_keys, max_row_splits)
    tasks = [schedule] + [_over_rows(t, plan) for t in body]
    lm = base.tasks[-1]
    tasks += [PlannedTask(Kind.SAMPLE, lm.layer, p, samplers, (*lm.reads, Access(STEP, 0, 1)),
                          (Access("chosen", p, p + 1),)) for p in range(samplers)]
    first_sampler = 1 + len(body)
    events = [ServingEvent(tuple(range(first_sampler, first_sampler + samplers)), previous_step=True),
              ServingEvent((0,))]
    events += [ServingEvent(tuple(p + 1 for p in e.producers)) for e in base.events[1:]]

    def moved(e: int) -> int:   # base event 0 (the embedding row) is SCHEDULE's; the others move up by one
        return SCHEDULE_EVENT if e == 0 else e + 1

    waits = [(0,)] + [tuple(map(moved, w)) for w in base.waits[:-1]] + [tuple(map(moved, base.waits[-1]))] * samplers
    signals: list = [[] for _ in tasks]
    for e, event in enumerate(events):
        for p in event.producers:
            signals[p].append(e)
    return attrs.evolve(plan, tasks=tuple(tasks), events=tuple(events), waits=tuple(waits),
                        signals=tuple(map(tuple, signals)))


def _refuse_unserved(graph: ModelGraph, base: TaskPlan) -> None:
    for k in base.kind_ops:
        why = None
        if k.op not in SERVED_OPS:
            why = "its tasks have no body over a step's rows"
        elif k.kind is Kind.ATTN and k.attr_dict.get("softcap"):
            why = "attention's soft-capped scores have no body over a step's rows"
        if why:
            node = next((n for n in fuse(graph).nodes if n.op == k.op), None)
            raise UnsupportedError(
                f"the megakernel's serving tables cannot run {k.op} ({k.kind.name}): {why}",
                loc=node.loc if node is not None else None,
                hint=f"the serving tables run the decoders' fused ops ({', '.join(sorted(SERVED_OPS))}): Llama-3, "
                     "Qwen2, Qwen3, Mistral and Phi-3; mdsl.LLM serves every built-in architecture on its CPU and "
                     "GPU devices")
    if len(set(base.windows)) > 1:
        node = next((n for n in fuse(graph).nodes if n.op == base.op_of(Kind.ATTN).op), None)
        raise UnsupportedError(
            f"the megakernel's serving tables cannot run attention whose layers' sliding windows differ "
            f"({list(base.windows)}; 0: every position): a step's attention items cut each row's range by one "
            "window for every layer", loc=node.loc if node is not None else None,
            hint="serve the model with mdsl.LLM's devices (device='cpu' or 'gpu'), which read each layer's window")
    if base.embedding_scale:
        raise UnsupportedError("the megakernel's serving tables cannot run a scaled embedding (SCHEDULE writes the "
                               "table's rows as they are)", hint="serve the model with mdsl.LLM's devices")


def _over_rows(task: PlannedTask, plan: ServingPlan) -> PlannedTask:
    """A base task as it runs over the step's rows: it reads the step's tables; a QKV tile may append the kv heads
    its columns meet (it writes their pool rows); an ATTN task reads its kv head's pool rows and writes its kv
    head's partials (any of its items may merge a row: it writes the head's
    attention columns of any row)."""
    reads, writes = (*task.reads, Access(STEP, 0, 1)), task.writes
    if task.kind is Kind.QKV:
        writes = (*writes, *(Access(f"kv{task.layer}", g, g + 1) for g in plan.appended_heads(task)))
    elif task.kind is Kind.ATTN:
        g = task.begin
        reads = (*reads, Access(f"kv{task.layer}", g, g + 1))
        writes = (Access(PARTS, g, g + 1), task.writes[-1])
    return attrs.evolve(task, reads=reads, writes=writes)


def check_serving_plan(plan: ServingPlan) -> None:
    """The rules the serving runtime relies on: SCHEDULE is the step's first task and the only one waiting on the
    previous step (event 0: every SAMPLE task, the step's last tasks); events count exactly the tasks that signal
    them; waits point backwards; every task's inputs are written by tasks it waits for (directly or through
    others), SCHEDULE's among them (the step's tables, h0); every kv head of every
    layer has QKV tiles appending it; every (layer, kv head) has the U ATTN tasks 0 .. U - 1, each of which
    descends from every ATTN task of the previous layer's kv head (the partials' one buffer is rewritten only
    once the previous layer's merges have read it); and every task leads to a SAMPLE task, so that no task of a
    step still reads what the next SCHEDULE rewrites."""
    tasks, n, p = plan.tasks, len(plan.tasks), plan.samplers
    samplers = list(range(n - p, n))
    if tasks[0].kind is not Kind.SCHEDULE or any(t.kind is Kind.SCHEDULE for t in tasks[1:]):
        raise PlanError("SCHEDULE is not the step's first task alone")
    if [k for k, t in enumerate(tasks) if t.kind is Kind.SAMPLE] != samplers:
        raise PlanError(f"the SAMPLE tasks are not the step's last {p}")
    signalled_by: dict = {}
    for k, signals in enumerate(plan.signals):
        for e in signals:
            signalled_by.setdefault(e, []).append(k)
    for e, event in enumerate(plan.events):
        if sorted(signalled_by.get(e, [])) != list(event.producers) or not event.producers:
            raise PlanError(f"event {e} is signalled by {signalled_by.get(e)} but counts {event.producers}")
        if event.previous_step != (e == 0):
            raise PlanError(f"event {e} {'counts' if event.previous_step else 'does not count'} the previous step")
    if list(plan.events[0].producers) != samplers or plan.waits[0] != (0,) or \
            any(0 in w for w in plan.waits[1:]):
        raise PlanError("event 0 must count every SAMPLE task and be SCHEDULE's one wait, and only SCHEDULE's")
    writers = _writers(tasks)
    if sorted(k for k, _ in writers.get("chosen", ())) != samplers:
        raise PlanError("SCHEDULE reads tokens that are not all the SAMPLE tasks'")
    ancestors: list = [0]   # per task, a bitset of the tasks it waits for, directly or through others
    parents: list = [set()]
    for k in range(1, n):
        task = tasks[k]
        if len(plan.waits[k]) > MAX_WAITS:
            raise PlanError(f"task {k} ({task.label()}) waits for {len(plan.waits[k])} events (at most {MAX_WAITS})")
        bits, mine = 0, set()
        for e in plan.waits[k]:
            for q in plan.events[e].producers:
                if q >= k:
                    raise PlanError(f"task {k} ({task.label()}) waits for a later task of its step: {q}")
                bits |= (1 << q) | ancestors[q]
                mine.add(q)
        ancestors.append(bits)
        parents.append(mine)
        for read in task.reads:
            for q in _producers(writers, read, k):
                if not bits >> q & 1:
                    raise PlanError(f"task {k} ({task.label()}) reads {read.buffer} from task {q} "
                                    f"({tasks[q].label()}) without waiting for it")
        if not bits & 1:
            raise PlanError(f"task {k} ({task.label()}) does not wait for SCHEDULE")
    s = plan.shape
    appenders: dict = {}
    attention: dict = {}
    for k, t in enumerate(tasks):
        if t.kind is Kind.QKV:
            for g in plan.appended_heads(t):
                appenders[t.layer, g] = appenders.get((t.layer, g), 0) + 1
        elif t.kind is Kind.ATTN:
            attention.setdefault((t.layer, t.begin), []).append((t.end, k))
    for layer in range(s.layers):
        for g in range(s.kv_heads):
            if not appenders.get((layer, g)):
                raise PlanError(f"no QKV tile of layer {layer} appends kv head {g}")
            if sorted(u for u, _ in attention.get((layer, g), [])) != list(range(plan.attention_tasks)):
                raise PlanError(f"layer {layer}'s kv head {g} has ATTN tasks {attention.get((layer, g))}, not "
                                f"0 .. {plan.attention_tasks - 1}")
            for _, k in attention.get((layer, g), []) if layer else ():
                early = [q for _, q in attention[layer - 1, g] if not ancestors[k] >> q & 1]
                if early:
                    raise PlanError(f"task {k} ({tasks[k].label()}) may write the partials while task {early[0]} "
                                    f"({tasks[early[0]].label()}) of the previous layer merges from them")
    reaches = [k >= n - p for k in range(n)]
    for k in range(n - 1, 0, -1):
        if reaches[k]:
            for q in parents[k]:
                reaches[q] = True
    lost = [tasks[k].label() for k in range(n) if not reaches[k]]
    if lost:
        raise PlanError(f"{len(lost)} task(s) lead to no SAMPLE task, e.g. {lost[:3]}")

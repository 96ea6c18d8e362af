"""The task graph: every layer op of a model graph split into tasks (one tile of work for one SM),
linked by events (per-tile dependency counters). This module holds the data structures, the
event construction, validation, the textual and DOT forms and statistics; `partition.py` makes the
tasks from each op's `tasks` rule.

Interface for runtimes (the CPU simulator here, the GPU persistent kernel in `runtime/`):

* `TaskGraph.buffers`: every tensor a task touches. `kind` is `weight` (read-only, from the
  checkpoint), `state` (kept across steps: the token history `tokens` and the KV caches), `activation`
  (a model-graph value, rewritten every step) or `scratch` (a task-private intermediate, e.g.
  attention's per-split partial results). Names are the model graph's Var names.
* `TaskGraph.tasks`: in a topological order of one step (a task comes after every task it waits on in
  the same step), ids 0..n-1 equal to positions. A task names its op (`node`, an index into
  `model.nodes`; `op` the op's name), its body (`kind`, e.g. `linear` or `attention.partial`) and its
  tile (`tile`: (name, int) pairs, e.g. `(("col_start", 0), ("col_stop", 16))`; the body's
  meaning of each is documented with the op's rule in partition.py).
* Events are counters that never reset. A task of step s (s = 0, 1, ...) first waits, for each
  `Wait(event, step_offset)`, until `counter[event] >= event.threshold(s, step_offset)` (=
  `len(event.producers) * max(0, s + 1 + step_offset)`: offset 0 waits for this step's producers, -1 for
  the previous step's), then runs its body, then makes its writes visible and increments every event
  in `signals` by one (release). Every producer of an event signals it exactly once per step.
* The only cross-step wait is on the next token (`tokens`): every task descends from the tasks that
  wait on it, and every task is an ancestor of the tasks that write it (checked by `validate`), so a
  step's state and activations are never touched by the next step before the step is done with them.
* The position of step s is s (prefill is successive steps over the prompt's tokens).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Optional

import attrs
import numpy as np
from attrs import field

from mdsl.errors import ValidationError
from mdsl.ir.types import TensorType

WEIGHT, STATE, ACTIVATION, SCRATCH = "weight", "state", "activation", "scratch"
BUFFER_KINDS = (WEIGHT, STATE, ACTIVATION, SCRATCH)


@attrs.frozen(cache_hash=True)
class Buffer:
    name: str
    type: TensorType
    kind: str

    def __str__(self) -> str:
        return f"{self.kind} %{self.name}: {self.type}"


def _box(value) -> tuple:
    return tuple((int(a), int(b)) for a, b in value)


@attrs.frozen(cache_hash=True)
class Region:
    """A box of a buffer, one (start, stop) pair per dim. `dynamic`: the task touches a part of the box
    that depends on the step (the embedding's token row, attention's prefix of the cache); the box is
    the bound, and statistics count it apart."""

    buffer: str
    box: tuple = field(converter=_box)
    dynamic: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.box:
            n *= max(0, b - a)
        return n

    def intersects(self, other: "Region") -> bool:
        return self.buffer == other.buffer and all(a < d and c < b for (a, b), (c, d) in zip(self.box, other.box))

    def __str__(self) -> str:
        return f"%{self.buffer}[{', '.join(f'{a}:{b}' for a, b in self.box)}]" + ("?" if self.dynamic else "")


@attrs.frozen(cache_hash=True)
class Wait:
    event: int
    step_offset: int = 0   # 0: this step's producers; -1: the previous step's

    def __str__(self) -> str:
        return f"e{self.event}" + ("" if self.step_offset == 0 else f"@{self.step_offset:+d}")


@attrs.frozen(cache_hash=True)
class Task:
    id: int
    kind: str
    node: int
    op: str
    tile: tuple = field(converter=tuple)
    reads: tuple = field(converter=tuple)
    writes: tuple = field(converter=tuple)
    waits: tuple = field(default=(), converter=tuple)
    signals: tuple = field(default=(), converter=tuple)

    @property
    def tile_dict(self) -> dict:
        return dict(self.tile)

    def tile_value(self, name: str) -> int:
        for k, v in self.tile:
            if k == name:
                return v
        raise KeyError(f"task {self.id} ({self.kind}) has no tile entry {name!r}")

    def __str__(self) -> str:
        tile = ", ".join(f"{k}={v}" for k, v in self.tile)
        waits = " ".join(map(str, self.waits)) or "-"
        signals = " ".join(f"e{e}" for e in self.signals) or "-"
        return (f"task {self.id} {self.kind} {{{tile}}} node={self.node} wait {waits} signal {signals}\n"
                f"    reads {' '.join(map(str, self.reads)) or '-'}\n"
                f"    writes {' '.join(map(str, self.writes)) or '-'}")


@attrs.frozen(cache_hash=True)
class Event:
    id: int
    producers: tuple = field(converter=tuple)   # task ids; each signals once per step
    consumers: tuple = field(converter=tuple)   # task ids that wait on it

    @property
    def count(self) -> int:
        return len(self.producers)

    def threshold(self, step: int, step_offset: int = 0) -> int:
        return self.count * max(0, step + 1 + step_offset)

    def __str__(self) -> str:
        return (f"event e{self.id} count={self.count} producers={list(self.producers)} "
                f"consumers={list(self.consumers)}")


@attrs.frozen
class PartitionConfig:
    """How ops are cut into tasks. `num_sms`: the work of a wide op is split into at least this many
    tiles where it is that wide; `column_align`: tile widths are multiples of it where they can be;
    `kv_splits`: the splits of each KV head's positions in attention (None: enough to fill num_sms).
    `min_columns`: when set, column ops are cut as the GPU runtime cuts them instead: num_sms near-equal
    tiles of at least this many columns (fewer tiles where the op is narrower). `attention_min_chunk`: the
    fewest positions a split of the fused `rope_attention` covers (its splits are chunks from position 0)."""

    num_sms: int = 132
    column_align: int = 16
    kv_splits: Optional[int] = None
    min_columns: Optional[int] = None
    attention_min_chunk: int = 1


@attrs.frozen(eq=False)
class TaskGraph:
    model: object          # the ModelGraph
    config: PartitionConfig
    buffers: tuple = field(converter=tuple)
    tasks: tuple = field(converter=tuple)
    events: tuple = field(converter=tuple)

    def buffer(self, name: str) -> Buffer:
        return self._buffers_by_name[name]

    @property
    def _buffers_by_name(self) -> dict:
        return {b.name: b for b in self.buffers}

    def region_bytes(self, region: Region) -> int:
        return region.numel * self.buffer(region.buffer).type.dtype.itemsize

    def terminal_tasks(self) -> tuple:
        """The tasks that write the next token: the end of a step."""
        from mdsl.megakernel.modelgraph.model import TOKENS

        return tuple(t.id for t in self.tasks if any(r.buffer == TOKENS for r in t.writes))

    def stats(self) -> dict:
        """Bytes per task and per step; regions marked dynamic are counted apart, as upper bounds."""
        def total(regions, dynamic: bool) -> int:
            return sum(self.region_bytes(r) for r in regions if r.dynamic == dynamic)

        per_task = [{"id": t.id, "kind": t.kind, "bytes_read": total(t.reads, False),
                     "bytes_written": total(t.writes, False), "dynamic_bytes_read_at_most": total(t.reads, True),
                     "dynamic_bytes_written_at_most": total(t.writes, True)} for t in self.tasks]
        kinds = Counter(t.kind for t in self.tasks)
        return {
            "tasks": len(self.tasks),
            "events": len(self.events),
            "waits": sum(len(t.waits) for t in self.tasks),
            "tasks_per_kind": dict(sorted(kinds.items())),
            "bytes_read_per_step": sum(p["bytes_read"] for p in per_task),
            "bytes_written_per_step": sum(p["bytes_written"] for p in per_task),
            "dynamic_bytes_read_at_most": sum(p["dynamic_bytes_read_at_most"] for p in per_task),
            "dynamic_bytes_written_at_most": sum(p["dynamic_bytes_written_at_most"] for p in per_task),
            "weight_bytes": sum(b.type.nbytes for b in self.buffers if b.kind == WEIGHT),
            "per_task": per_task,
        }

    def summary(self) -> str:
        s = self.stats()
        kinds = ", ".join(f"{k}: {n}" for k, n in s["tasks_per_kind"].items())
        return (f"{s['tasks']} tasks ({kinds}), {s['events']} events, {s['waits']} waits; per step "
                f"{s['bytes_read_per_step']} bytes read and {s['bytes_written_per_step']} written, plus at most "
                f"{s['dynamic_bytes_read_at_most']} read and {s['dynamic_bytes_written_at_most']} written where the "
                f"position decides (token row, KV cache); weights {s['weight_bytes']} bytes")

    def __str__(self) -> str:
        lines = [f"taskgraph {getattr(self.model, 'name', '?')} {{  # {self.summary()}"]
        lines += [f"  buffer {b}" for b in self.buffers]
        lines += [f"  {e}" for e in self.events]
        for t in self.tasks:
            lines += ["  " + line for line in str(t).split("\n")]
        lines.append("}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """A plain-data form (for tools and viewers): buffers, events and tasks with their tiles, regions,
        waits and signals. `json.dumps(task_graph.to_json())` writes it."""
        def region(r: Region) -> dict:
            return {"buffer": r.buffer, "box": [list(b) for b in r.box], "dynamic": r.dynamic}

        return {
            "model": getattr(self.model, "name", None),
            "config": attrs.asdict(self.config),
            "buffers": [{"name": b.name, "shape": list(b.type.shape), "dtype": b.type.dtype.name, "kind": b.kind}
                        for b in self.buffers],
            "events": [{"id": e.id, "producers": list(e.producers), "consumers": list(e.consumers)}
                       for e in self.events],
            "tasks": [{"id": t.id, "kind": t.kind, "node": t.node, "op": t.op, "tile": dict(t.tile),
                       "reads": [region(r) for r in t.reads], "writes": [region(r) for r in t.writes],
                       "waits": [{"event": w.event, "step_offset": w.step_offset} for w in t.waits],
                       "signals": list(t.signals)} for t in self.tasks],
        }

    def to_dot(self) -> str:
        """Tasks are boxes clustered by model-graph node; an edge per (producer, consumer) of an event,
        labelled with the event (dashed when it crosses to the next step)."""
        lines = ["digraph taskgraph {", '  node [fontname="monospace", shape=box]; edge [fontname="monospace"];']
        by_node = defaultdict(list)
        for t in self.tasks:
            by_node[t.node].append(t)
        for node, tasks in sorted(by_node.items()):
            lines.append(f'  subgraph cluster_{node} {{ label="{node}: {tasks[0].op}";')
            for t in tasks:
                tile = " ".join(f"{k}={v}" for k, v in t.tile)
                lines.append(f'    t{t.id} [label="{t.id} {t.kind}\\n{tile}"];')
            lines.append("  }")
        events = {e.id: e for e in self.events}
        for t in self.tasks:
            for w in t.waits:
                style = "" if w.step_offset == 0 else ", style=dashed"
                for p in events[w.event].producers:
                    lines.append(f'  t{p} -> t{t.id} [label="e{w.event}"{style}];')
        lines.append("}")
        return "\n".join(lines) + "\n"

    def validate(self) -> "TaskGraph":
        """Structural checks: ids, regions inside their buffers, events consistent with waits and
        signals, same-step waits only on earlier tasks, and every task between the token wait and the
        token write of its step."""
        buffers = self._buffers_by_name
        events = {e.id: e for e in self.events}
        consumers = {e.id: set(e.consumers) for e in self.events}
        last_producer = {e.id: max(e.producers, default=-1) for e in self.events}
        signalled = defaultdict(list)
        for t in self.tasks:
            for e in t.signals:
                signalled[e].append(t.id)
        inside: set = set()    # regions already found inside their buffers
        for i, t in enumerate(self.tasks):
            if t.id != i:
                raise ValidationError(f"task at position {i} has id {t.id}")
            for r in (*t.reads, *t.writes):
                if r in inside:
                    continue
                b = buffers.get(r.buffer)
                if b is None or len(r.box) != b.type.rank or any(
                        not 0 <= a <= c <= n for (a, c), n in zip(r.box, b.type.shape)):
                    raise ValidationError(f"task {t.id} ({t.kind}) touches {r} outside its buffer")
                inside.add(r)
            for r in t.writes:
                if buffers[r.buffer].kind == WEIGHT:
                    raise ValidationError(f"task {t.id} ({t.kind}) writes the weight {r.buffer}")
            for w in t.waits:
                if w.event not in events or t.id not in consumers[w.event]:
                    raise ValidationError(f"task {t.id} waits on e{w.event}, which does not list it")
                if w.step_offset == 0 and last_producer[w.event] >= t.id:
                    raise ValidationError(f"task {t.id} waits in its step on e{w.event}, produced by a later task")
        for e in self.events:
            if sorted(signalled[e.id]) != sorted(e.producers):
                raise ValidationError(f"e{e.id} counts producers {list(e.producers)} but is signalled by "
                                      f"{signalled[e.id]}")
        self._check_step_closure(events)
        return self

    def _check_step_closure(self, events: dict) -> None:
        # per event, not per task: thousands of consumers share an event
        terminal = set(self.terminal_tasks())
        if not terminal:
            raise ValidationError("no task writes the next token")
        reaches_end = set(terminal)
        followed: set = set()     # events whose producers are already in reaches_end
        for t in reversed(self.tasks):
            if t.id in reaches_end:
                for w in t.waits:
                    if w.step_offset == 0 and w.event not in followed:
                        followed.add(w.event)
                        reaches_end.update(events[w.event].producers)
        from_start = set()
        started: dict = {}        # event -> whether a producer descends from the token wait
        kinds = {b.name: b.kind for b in self.buffers}
        for t in self.tasks:
            for w in t.waits:
                if w.step_offset == 0 and w.event not in started:
                    started[w.event] = any(p in from_start for p in events[w.event].producers)
            if any(w.step_offset != 0 or started[w.event] for w in t.waits) or \
                    all(kinds[r.buffer] == WEIGHT for r in t.reads):
                from_start.add(t.id)
        for t in self.tasks:
            if t.id not in reaches_end:
                raise ValidationError(f"task {t.id} ({t.kind}) is not an ancestor of the token write; the next "
                                      "step could overwrite what it reads")
            if t.id not in from_start:
                raise ValidationError(f"task {t.id} ({t.kind}) does not descend from the wait on the previous "
                                      "token; it could run a step early")


class RegionIndex:
    """The (task id, region) pairs of many tasks, by buffer, answering which overlap a region
    (vectorised: large task graphs have thousands of tiles per buffer)."""

    def __init__(self, entries):
        by_buffer = defaultdict(list)
        for tid, region in entries:
            by_buffer[region.buffer].append((tid, region))
        self._ids = {b: np.array([t for t, _ in es], np.int64) for b, es in by_buffer.items()}
        self._boxes = {b: np.array([r.box for _, r in es], np.int64).reshape(len(es), -1, 2)
                       for b, es in by_buffer.items()}

    def overlapping(self, region: Region) -> list:
        boxes = self._boxes.get(region.buffer)
        if boxes is None:
            return []
        box = np.array(region.box, np.int64).reshape(1, -1, 2)
        hit = np.all((boxes[:, :, 0] < box[:, :, 1]) & (box[:, :, 0] < boxes[:, :, 1]), axis=1)
        return self._ids[region.buffer][hit].tolist()


def build_events(buffers: tuple, specs: list) -> tuple:
    """Tasks and events from task specs `(kind, node, op, tile, reads, writes)` in a topological order.

    A task's read of an activation or scratch region waits for exactly the tasks of this step that
    write an intersecting region; one event per distinct set of producer tasks, shared by every
    consumer waiting for that set. A task with no same-step producers that reads state waits for the
    previous step's writers of that state (the token), the one cross-step edge."""
    kinds = {b.name: b.kind for b in buffers}
    writers = RegionIndex((tid, r) for tid, spec in enumerate(specs) for r in spec[5])
    event_ids: dict = {}           # (producers, step_offset) -> event id
    consumers = defaultdict(list)
    task_waits = []
    writers_by_node: dict = {}     # region -> {producing node: sorted writer ids} (many tasks read one region)

    def producing_nodes(region: Region) -> dict:
        found = writers_by_node.get(region)
        if found is None:
            grouped = defaultdict(list)
            for pid in writers.overlapping(region):
                grouped[specs[pid][1]].append(pid)
            found = writers_by_node[region] = {n: tuple(sorted(p)) for n, p in grouped.items()}
        return found

    for tid, (kind, node, op, tile, reads, writes) in enumerate(specs):
        same_step: dict = {}   # producing node -> producer task ids
        for r in reads:
            if kinds[r.buffer] in (ACTIVATION, SCRATCH):
                for n, pids in producing_nodes(r).items():
                    if pids[-1] >= tid:
                        raise ValidationError(f"task {tid} ({kind}) reads {r}, written by the later task {pids[-1]}")
                    same_step[n] = tuple(sorted({*same_step[n], *pids})) if n in same_step else pids
        keys = [(p, 0) for _, p in sorted(same_step.items())]
        if not keys:
            previous = {pid for r in reads if kinds[r.buffer] == STATE for pid in writers.overlapping(r)}
            if previous:
                keys.append((tuple(sorted(previous)), -1))
        waits = []
        for key in keys:
            eid = event_ids.setdefault(key, len(event_ids))
            consumers[eid].append(tid)
            waits.append(Wait(eid, key[1]))
        task_waits.append(tuple(waits))
    signals = defaultdict(list)
    events = []
    for (producers, _), eid in sorted(event_ids.items(), key=lambda kv: kv[1]):
        events.append(Event(eid, producers, tuple(consumers[eid])))
        for p in producers:
            signals[p].append(eid)
    tasks = tuple(Task(tid, kind, node, op, tile, reads, writes, task_waits[tid], tuple(signals[tid]))
                  for tid, (kind, node, op, tile, reads, writes) in enumerate(specs))
    return tasks, tuple(events)


def without_implied_waits(graph: TaskGraph) -> TaskGraph:
    """The task graph less every same-step wait whose producers are all ancestors of another wait of the
    same task (the residual row an o-proj re-reads, written before the attention it waits for): one
    dependency hop per consumer where the data allows it. Events nobody waits on any more are dropped,
    the others renumbered in their order; producers signal only those kept."""
    events = {e.id: e for e in graph.events}
    members = {e.id: sum(1 << p for p in e.producers) for e in graph.events}
    through: dict = {}          # event id -> its producers and their same-step ancestors
    ancestors: list = []
    waits: list = []
    for t in graph.tasks:
        same = [w for w in t.waits if w.step_offset == 0]
        for w in same:
            if w.event not in through:
                bits = members[w.event]
                for p in events[w.event].producers:
                    bits |= ancestors[p]
                through[w.event] = bits
        kept = []
        for w in t.waits:
            others = 0
            for o in same:
                if o is not w:
                    others |= through[o.event]
            if w.step_offset != 0 or members[w.event] & others != members[w.event]:
                kept.append(w)
        if len(same) == 1:
            ancestors.append(through[same[0].event])
        else:
            bits = 0
            for w in same:
                bits |= through[w.event]
            ancestors.append(bits)
        waits.append(kept)
    used = sorted({w.event for ws in waits for w in ws})
    renumber = {old: new for new, old in enumerate(used)}
    consumers = defaultdict(list)
    for t, ws in zip(graph.tasks, waits):
        for w in ws:
            consumers[w.event].append(t.id)
    signals = defaultdict(list)
    for old in used:
        for p in events[old].producers:
            signals[p].append(renumber[old])
    new_events = tuple(Event(renumber[old], events[old].producers, tuple(consumers[old])) for old in used)
    tasks = tuple(attrs.evolve(t, waits=tuple(Wait(renumber[w.event], w.step_offset) for w in ws),
                               signals=tuple(signals[t.id])) for t, ws in zip(graph.tasks, waits))
    return TaskGraph(graph.model, graph.config, graph.buffers, tasks, new_events).validate()

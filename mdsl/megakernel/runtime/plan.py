"""The megakernel's device task tables for one decode step of a decoder, and the events linking them.

A step is a list of tasks in dependency order; the persistent kernel hands out task indices
`step * tasks_per_step + k` from one queue, so a task only ever waits on tasks handed out before it
(no deadlock while every worker block is resident). Each task says which buffer ranges it reads and
writes; a consumer's event is the set of producer tiles whose writes overlap its reads, so it waits
only for the tiles it reads. An event counts its producers' completions: it is complete for step s at
`producers * (s + 1)`, so counters are never reset within a launch. The embedding row of step s + 1 is
written by step s's sampling task, so the event it signals starts at 1 (the host writes step 0's).

Every task of a step is an ancestor of the step's sampling task, and every task of step s + 1 waits
(through the embedding) for that sampling task: a buffer is never rewritten while a task of the
previous step still reads it. `check_plan` verifies these rules.

Task kinds (the device code's switch):
  QKV      rows [begin, end) of [q; k; v] = W_qkv rms_norm(h_l)
  ATTN     kv head `begin`, split `end` of the positions: q/k norm, RoPE, the KV cache append (by the
           split holding the newest position), partial softmax-weighted sums over its positions
  COMBINE  q head `begin`: merges the splits' partial sums into the attention output
  OPROJ    rows of mid_l = h_l + W_o attn
  GATEUP   rows of act_l = silu(W_gate x) * (W_up x), x = rms_norm(mid_l)
  DOWN     rows of h_{l+1} = mid_l + W_down act_l
  LMHEAD   rows of logits = W_lm rms_norm(h_L) and the tile's best token
  SAMPLE   the token (greedy, temperature, top-p), stop conditions, next step's embedding row
"""
from __future__ import annotations

import enum
from typing import Optional

import attrs
import numpy as np

from mdsl.megakernel.runtime.shape import DecoderShape


class Kind(enum.IntEnum):
    QKV = 0
    ATTN = 1
    COMBINE = 2
    OPROJ = 3
    GATEUP = 4
    DOWN = 5
    LMHEAD = 6
    SAMPLE = 7


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

    @property
    def per_step(self) -> int:
        return max(1, len(self.producers))


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

    @property
    def max_chunk(self) -> int:
        """The most positions one attention split covers (device.cu's chunk rule)."""
        return max(MIN_CHUNK, -(-self.max_seq // self.splits))

    def attention_range(self, position: int, split: int) -> tuple:
        """Positions [lo, hi) of a split at `position`: equal chunks of at least MIN_CHUNK from 0, so
        that the split holding `position` (the one that appends it to the KV cache) is the last
        non-empty one."""
        chunk = max(MIN_CHUNK, -(-(position + 1) // self.splits))
        return min(split * chunk, position + 1), min(split * chunk + chunk, position + 1)

    def tables(self) -> tuple:
        """(tasks int32 [n, 8], waits int32 [m, 2], signals int32 [k]): what the device reads.
        A task row: kind, layer, begin, end, first wait, wait count, first signal, signal count;
        a wait row: event, producers per step."""
        rows, wait_rows, signal_rows = [], [], []
        for task, waits, signals in zip(self.tasks, self.waits, self.signals):
            rows.append((int(task.kind), task.layer, task.begin, task.end,
                         len(wait_rows), len(waits), len(signal_rows), len(signals)))
            wait_rows += [(e, self.events[e].per_step) for e in waits]
            signal_rows += list(signals)
        return (np.array(rows, dtype=np.int32).reshape(-1, 8), np.array(wait_rows, dtype=np.int32).reshape(-1, 2),
                np.array(signal_rows or [0], dtype=np.int32))

    def initial_events(self) -> np.ndarray:
        return np.array([e.initial for e in self.events], dtype=np.uint32)

    def statistics(self) -> dict:
        kinds: dict = {}
        for task in self.tasks:
            kinds[task.kind.name] = kinds.get(task.kind.name, 0) + 1
        return {"tasks_per_step": len(self.tasks), "events": len(self.events), "workers": self.workers,
                "attention_splits": self.splits, "tasks_by_kind": kinds,
                "waits": sum(map(len, self.waits)), "signals": sum(map(len, self.signals))}


MIN_ROWS_PER_TILE = 8   # one per warp: smaller tiles cost more in waiting than they save
MIN_CHUNK = 64          # attention positions per split at least (device.cu's MIN_CHUNK)


def tiles(n: int, count: int) -> list:
    """[lo, hi) ranges splitting n items into `count` near-equal tiles of at least MIN_ROWS_PER_TILE."""
    count = max(1, min(count, n // MIN_ROWS_PER_TILE))
    return [(n * k // count, n * (k + 1) // count) for k in range(count)]


def attention_splits(shape: DecoderShape, workers: int, max_seq: int) -> int:
    return max(1, min(workers // shape.kv_heads, max_seq))


def build_plan(shape: DecoderShape, *, workers: int, max_seq: int, splits: Optional[int] = None) -> TaskPlan:
    """The task tables of one decode step for `workers` worker blocks (one per SM)."""
    s = shape
    splits = splits or attention_splits(s, workers, max_seq)
    part_width = s.head_dim + 2
    tasks: list = []

    def add(kind, layer, begin, end, reads, writes):
        tasks.append(PlannedTask(kind, layer, begin, end, tuple(reads), tuple(writes)))

    def linear(kind, layer, rows, inputs, output, extra_reads=()):
        for lo, hi in tiles(rows, workers):
            add(kind, layer, lo, hi, [*inputs, *(Access(b, lo, hi) for b in extra_reads)], [Access(output, lo, hi)])

    for layer in range(s.layers):
        h, mid, qkv = f"h{layer}", f"mid{layer}", f"qkv{layer}"
        linear(Kind.QKV, layer, s.qkv_rows, [Access(h, 0, s.hidden)], qkv)
        k_base, v_base = s.attention_width, s.attention_width + s.kv_heads * s.head_dim
        for g in range(s.kv_heads):
            q = Access(qkv, g * s.group * s.head_dim, (g + 1) * s.group * s.head_dim)
            k = Access(qkv, k_base + g * s.head_dim, k_base + (g + 1) * s.head_dim)
            v = Access(qkv, v_base + g * s.head_dim, v_base + (g + 1) * s.head_dim)
            for split in range(splits):
                rows = [(head * splits + split) * part_width for head in range(g * s.group, (g + 1) * s.group)]
                add(Kind.ATTN, layer, g, split, [q, k, v], [Access(f"part{layer}", r, r + part_width) for r in rows])
        for head in range(s.heads):
            add(Kind.COMBINE, layer, head, head + 1,
                [Access(f"part{layer}", head * splits * part_width, (head + 1) * splits * part_width)],
                [Access(f"attn{layer}", head * s.head_dim, (head + 1) * s.head_dim)])
        linear(Kind.OPROJ, layer, s.hidden, [Access(f"attn{layer}", 0, s.attention_width)], mid, extra_reads=[h])
        linear(Kind.GATEUP, layer, s.intermediate, [Access(mid, 0, s.hidden)], f"act{layer}")
        linear(Kind.DOWN, layer, s.hidden, [Access(f"act{layer}", 0, s.intermediate)], f"h{layer + 1}",
               extra_reads=[mid])
    lm = tiles(s.vocab, workers)
    for k, (lo, hi) in enumerate(lm):
        add(Kind.LMHEAD, s.layers, lo, hi, [Access(f"h{s.layers}", 0, s.hidden)],
            [Access("logits", lo, hi), Access("best", k, k + 1)])
    add(Kind.SAMPLE, s.layers, 0, len(lm), [Access("logits", 0, s.vocab), Access("best", 0, len(lm))],
        [Access(EMBEDDING, 0, s.hidden)])
    return _link(s, workers, splits, max_seq, tasks, len(lm))


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

    def add_event(self, producers: tuple) -> None:
        bits = 0
        for p in producers or (self.n,):
            bits |= (1 << p) | (self.of_task[p] if p < self.n else 0)
        self.of_event.append(bits)

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


def _link(shape, workers, splits, max_seq, tasks, lm_tiles) -> TaskPlan:
    """Events from the tasks' accesses. A task waits for the producers it reads from, less those
    another of them already depends on (the residual stream a linear re-reads, for example), as one
    event per distinct set of producers."""
    n = len(tasks)
    writers = _writers(tasks)
    events: list = [Event((), initial=1)]   # event 0: the embedding row, written by the previous step
    ancestry = _Ancestry(n)
    ancestry.add_event(())
    event_of: dict = {}
    covered_by_others: dict = {}   # direct producers -> bytes of the union of their ancestors
    waits: list = []
    for k in range(n):
        direct = tuple(sorted(_direct_producers(tasks, writers, k)))
        if direct not in covered_by_others:
            union = 0
            for q in direct:
                union |= ancestry.of_task[q] if q < n else 0
            covered_by_others[direct] = _as_bytes(union)
        covered = covered_by_others[direct]
        needed = [0] if n in direct and not _has_bit(covered, n) else []
        kept = tuple(p for p in direct if p < n and not _has_bit(covered, p))
        if kept:
            if kept not in event_of:
                event_of[kept] = len(events)
                events.append(Event(kept))
                ancestry.add_event(kept)
            needed.append(event_of[kept])
        waits.append(tuple(needed))
        ancestry.add_task(needed)
    signals = [[] for _ in tasks]
    for e, event in enumerate(events):
        for p in event.producers or (n - 1,):
            signals[p].append(e)
    return TaskPlan(shape, workers, splits, max_seq, tuple(tasks), tuple(events), tuple(waits),
                    tuple(tuple(sig) for sig in signals), lm_tiles)


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
        if not event.producers and event.initial != 1:
            raise PlanError(f"event {e} (the embedding) must start at 1, not {event.initial}")
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

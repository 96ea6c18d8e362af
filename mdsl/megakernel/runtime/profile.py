"""The megakernel's profile: per executed task, the SM it ran on and four %globaltimer readings: the
scheduler warp took it and began waiting for its inputs, its inputs were ready, the compute warps started
its body, the body was done; and the body's marks, the points it passed on the way (BODY_PARTS: the
parts they split a body of each kind into). Exported as a Chrome / Perfetto trace JSON (open it at
ui.perfetto.dev or chrome://tracing) with two tracks per SM, so that what overlaps shows: the scheduler's
('SM n wait': one 'wait' slice per task, taken -> ready) and the compute warps' ('SM n': the task's body,
its parts nested in it). `layer_phases` condenses a step into one layer's phases: span, body, gap;
`cross_rank_hops` the all-reduce hops between the ranks (clock offsets cancelled)."""
from __future__ import annotations

import bisect
import gzip
import json
import os
from pathlib import Path
from typing import Optional, Sequence

import attrs

from mdsl.gpu.cache import write_atomic


@attrs.frozen
class TaskRecord:
    index: int         # step * tasks_per_step + task
    sm: int
    taken_ns: int      # the scheduler warp took the task and began waiting for its inputs
    ready_ns: int      # its inputs were ready
    started_ns: int    # the compute warps started its body (after the previous task's)
    done_ns: int
    marks: tuple = ()  # when the body passed its marks (BODY_MARKS readings; 0: not passed)


BODY_MARKS = 4   # device.cu's MARKS: readings per task
# the parts a body's marks split it into, by kind (device.cu's mark() calls: a linear body's after its
# input row is loaded, and under the relay an o-proj's or down-proj's once its partials are put, before it
# waits for the peers' words of its rows; attention's after each of its stages)
_LINEAR_PARTS = ("input row", "products out")
_RESIDUAL_PARTS = (*_LINEAR_PARTS, "relay")
BODY_PARTS = {"qkv": _LINEAR_PARTS, "oproj": _RESIDUAL_PARTS, "gateup": _LINEAR_PARTS, "down": _RESIDUAL_PARTS,
              "lmhead": _LINEAR_PARTS,
              "attn": ("q, k, v prepared", "scores", "softmax", "weighted values", "partials out"),
              # a mixture of experts' (moe.cuh): the router's products out include the last tile's routing
              "router": _LINEAR_PARTS, "expert_up": _LINEAR_PARTS, "expert_down": ("slots' rows", "products out")}


# the serving kernel's (serve_rows.cuh): a linear body over the step's rows marks its first group's inputs stored, then
# warp 0's first pass of weights and products done and its sums stored; its step boundary marks its stages
_SERVING_LINEAR = ("input row", "weights and products (warp 0)", "sums and stores (warp 0)", "the other warps, epilogue")
# an ATTN task's marks are its warp 0's first item's
SERVING_BODY_PARTS = {**BODY_PARTS, **{kind: _SERVING_LINEAR for kind in ("qkv", "oproj", "gateup", "down", "lmhead")},
                      "attn": ("item's tables, rows prefetched", "q heads", "keys and values", "partials counted",
                               "merge, the other items"),
                      "schedule": ("previous step's end", "plan", "pool check", "attention items, embeddings")}


def body_parts(record: TaskRecord, kind: str, parts: dict = BODY_PARTS) -> list:
    """(name, start ns, end ns) of each part of the record's body: started -> first mark -> ... -> done, the
    kind's first len(marks) + 1 part names (a body may pass fewer marks than its kind has: an o-proj's
    relay mark only under the relay). Empty where the kind has no parts or the body passed no mark."""
    names = parts.get(kind)
    marks = [m for m in record.marks if m]
    if not names or not marks or len(marks) >= len(names):
        return []
    edges = [record.started_ns, *marks, record.done_ns]
    return [(names[k], edges[k], edges[k + 1]) for k in range(len(marks) + 1)]


def compute_track(sm: int) -> int:
    """The trace's thread id of an SM's compute warps (its scheduler warp's is the next one)."""
    return 2 * sm


def scheduler_track(sm: int) -> int:
    return 2 * sm + 1


def _slice(name: str, category: str, track: int, start_ns: int, end_ns: int, origin: int, args: dict,
           pid: int = 0) -> dict:
    return {"name": name, "cat": category, "ph": "X", "pid": pid, "tid": track, "ts": (start_ns - origin) / 1e3,
            "dur": max(0, end_ns - start_ns) / 1e3, "args": args}


def trace_events(records: Sequence[TaskRecord], labels: Sequence[str], kinds: Sequence[str], *, pid: int = 0,
                 process: str = "mdsl megakernel", origin: Optional[int] = None,
                 peers: Optional[Sequence[tuple]] = None, parts: dict = BODY_PARTS) -> list:
    """Chrome trace events: per task a 'wait' slice (taken -> ready, when it waited) on its SM's scheduler
    track and its body's slice (started -> done) on its SM's compute track; `labels`/`kinds` name the
    tasks of one step. Times in microseconds from `origin` (default: the first record). `pid`/`process`:
    the trace process the tracks belong to (one per GPU of a tensor-parallel job); `peers`, per task of a
    step, whether it waits for other ranks' tiles and whether it puts its own to them: such waits are
    named 'wait for peers' and such bodies get the category '<kind>+put'. `parts`: the names of the bodies' parts
    by kind (SERVING_BODY_PARTS for the serving kernel's)."""
    if not records:
        return []
    per_step = len(labels)
    origin = min(r.taken_ns for r in records) if origin is None else origin
    events = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}}]
    for sm in sorted({r.sm for r in records}):
        for track, name in ((compute_track(sm), f"SM {sm}"), (scheduler_track(sm), f"SM {sm} wait")):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": track, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": track,
                           "args": {"sort_index": track}})
    for r in sorted(records, key=lambda r: (r.sm, r.taken_ns)):
        step, task = divmod(r.index, per_step)
        args = {"step": step, "task": task}
        remote_wait, puts = peers[task] if peers is not None else (False, False)
        if r.ready_ns > r.taken_ns:
            events.append(_slice("wait for peers" if remote_wait else "wait", "wait-remote" if remote_wait else "wait",
                                 scheduler_track(r.sm), r.taken_ns, r.ready_ns, origin, {**args, "for": labels[task]},
                                 pid))
        events.append(_slice(labels[task], f"{kinds[task]}+put" if puts else kinds[task], compute_track(r.sm),
                             r.started_ns, r.done_ns, origin,
                             {**args, "ready_to_start_us": max(0, r.started_ns - r.ready_ns) / 1e3}, pid))
        for name, start, end in body_parts(r, kinds[task], parts):   # nested in the body's slice
            events.append(_slice(name, "part", compute_track(r.sm), start, end, origin, args, pid))
    return events


def write_trace(path: str, records: Sequence[TaskRecord], labels: Sequence[str], kinds: Sequence[str],
                parts: dict = BODY_PARTS) -> None:
    """The trace as JSON at `path`, written atomically."""
    data = json.dumps({"traceEvents": trace_events(records, labels, kinds, parts=parts), "displayTimeUnit": "ns"})
    write_atomic(Path(os.path.abspath(path)), data.encode())


def align_ranks(per_rank: Sequence[Sequence[TaskRecord]], per_step: int) -> list:
    """The ranks' records on rank 0's clock. Each GPU's %globaltimer has its own offset (hundreds of µs
    apart on the H200 pair), so the ranks are aligned on their samplers: every rank's sampler of a step
    finishes once the last LM-head tile of any rank has landed, at the same moment up to a put's latency
    (the median over the steps is the offset taken)."""
    def sampler_done(records) -> dict:
        return {r.index // per_step: r.done_ns for r in records if r.index % per_step == per_step - 1}

    base = sampler_done(per_rank[0]) if per_rank else {}
    aligned = []
    for records in per_rank:
        mine = sampler_done(records)
        shifts = sorted(mine[s] - base[s] for s in mine.keys() & base.keys())
        shift = shifts[len(shifts) // 2] if shifts else 0
        aligned.append([attrs.evolve(r, taken_ns=r.taken_ns - shift, ready_ns=r.ready_ns - shift,
                                     started_ns=r.started_ns - shift, done_ns=r.done_ns - shift,
                                     marks=tuple(m - shift if m else 0 for m in r.marks)) for r in records])
    return aligned


def write_rank_traces(path: str, per_rank: Sequence[Sequence[TaskRecord]], labels: Sequence[str],
                      kinds: Sequence[str], peers: Optional[Sequence[tuple]] = None) -> None:
    """A tensor-parallel job's profile: one trace process per rank (GPU), on rank 0's clock
    (`align_ranks`). A path ending in .gz is written gzip-compressed."""
    per_rank = align_ranks(per_rank, len(labels))
    origin = min((r.taken_ns for records in per_rank for r in records), default=0)
    events = [e for rank, records in enumerate(per_rank)
              for e in trace_events(records, labels, kinds, pid=rank, process=f"rank {rank} (GPU {rank})",
                                    origin=origin, peers=peers)]
    data = json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}).encode()
    write_atomic(Path(os.path.abspath(path)), gzip.compress(data) if path.endswith(".gz") else data)


def read_trace(path: str, per_step: int) -> list:
    """The TaskRecords of a trace written by `write_trace` (times in ns from the trace's origin, to the
    nearest ns; a task with no wait slice was ready when taken), for a plan of `per_step` tasks a step."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    bodies, waits, parts = {}, {}, {}
    for e in events:
        if e.get("ph") != "X":
            continue
        key = (e["args"]["step"], e["args"]["task"])
        start, end = round(e["ts"] * 1e3), round((e["ts"] + e["dur"]) * 1e3)
        if e["cat"] in ("wait", "wait-remote"):
            waits[key] = (start, end)
        elif e["cat"] == "part":
            parts.setdefault(key, []).append((start, end))
        else:
            bodies[key] = (e["tid"] // 2, start, end, round(e["args"]["ready_to_start_us"] * 1e3))
    records = []
    for (step, task), (sm, started, done, queued) in bodies.items():
        taken, ready = waits.get((step, task), (started - queued, started - queued))
        ends = [end for _, end in sorted(parts.get((step, task), []))][:-1]   # each part but the last ends at a mark
        marks = tuple(ends + [0] * (BODY_MARKS - len(ends))) if ends else ()
        records.append(TaskRecord(step * per_step + task, sm, taken, ready, started, done, marks))
    return sorted(records, key=lambda r: r.index)


# the phases that read the ranks' all-reduced partials, after the phase that puts them (and the layer
# offset from producer to reader): gate/up sums the o-proj's, the next layer's QKV the down-proj's
ALL_REDUCE_HOPS = (("oproj", "gateup", 0), ("down", "qkv", 1))


def cross_rank_hops(per_rank: Sequence[Sequence[TaskRecord]], kinds: Sequence[str], layers: Sequence[int],
                    step: int, hops: Sequence[tuple] = ALL_REDUCE_HOPS) -> dict:
    """Each all-reduce hop of one step (µs over the layers: median and least): from a rank's last body
    of the producing phase to a peer's first body of the reading phase, half the sum of the two
    directions of each pair of ranks. The GPUs' clocks' offset cancels in that sum (no alignment is
    needed), and where a reader waited for its own rank's producers instead, that direction only adds:
    an upper bound of a cross-GPU hop, tight where the peers' producers bind."""
    per_step = len(kinds)

    def ends_and_starts(records) -> tuple:
        ends, starts = {}, {}
        for r in records:
            if r.index // per_step != step:
                continue
            task = r.index % per_step
            key = (kinds[task], layers[task])
            ends[key] = max(ends.get(key, r.done_ns), r.done_ns)
            starts[key] = min(starts.get(key, r.started_ns), r.started_ns)
        return ends, starts

    if len(per_rank) < 2:
        return {}
    seen = [ends_and_starts(records) for records in per_rank]
    pairs = [(a, b) for a in range(len(seen)) for b in range(a + 1, len(seen))]
    result = {}
    for producer, reader, offset in hops:
        samples = []
        for layer in sorted(layer for (kind, layer) in seen[0][1] if kind == reader):
            source = (producer, layer - offset)
            if any(source not in ends or (reader, layer) not in starts for ends, starts in seen):
                continue
            samples.append(sum((seen[a][1][reader, layer] - seen[b][0][source]) +
                               (seen[b][1][reader, layer] - seen[a][0][source]) for a, b in pairs) / (2 * len(pairs)))
        if samples:
            samples.sort()
            result[f"{producer}->{reader}"] = {"median_us": round(samples[len(samples) // 2] / 1e3, 2),
                                               "least_us": round(samples[0] / 1e3, 2)}
    return result


def summary(records: Sequence[TaskRecord], kinds: Sequence[str]) -> dict:
    """Per task kind, over all records (ns): count; body time; time waiting for inputs (scheduler);
    time the compute warps sat idle before the body, inputs not yet ready (the wait not hidden behind
    the previous task's body); time ready but queued behind the previous body; the body's parts
    (`parts_ns`, BODY_PARTS, where the bodies passed their marks)."""
    out: dict = {}
    per_step = len(kinds)
    for r in records:
        kind = kinds[r.index % per_step]
        entry = out.setdefault(kind, {"tasks": 0, "body_ns": 0, "wait_ns": 0, "exposed_wait_ns": 0, "queued_ns": 0,
                                      "parts_ns": {}})
        entry["tasks"] += 1
        entry["body_ns"] += max(0, r.done_ns - r.started_ns)
        entry["wait_ns"] += max(0, r.ready_ns - r.taken_ns)
        entry["queued_ns"] += max(0, r.started_ns - r.ready_ns)
        for name, start, end in body_parts(r, kind):
            entry["parts_ns"][name] = entry["parts_ns"].get(name, 0) + max(0, end - start)
    for kind, exposed in _exposed_waits(records, kinds).items():
        out[kind]["exposed_wait_ns"] = exposed
    return out


def _exposed_waits(records: Sequence[TaskRecord], kinds: Sequence[str]) -> dict:
    """Per kind: the time between the previous body's end on the same SM (or the task's taking) and the
    body's start, when the compute warps had nothing to run."""
    per_step = len(kinds)
    exposed: dict = {}
    previous_done: dict = {}
    for r in sorted(records, key=lambda r: (r.sm, r.started_ns)):
        idle_from = max(previous_done.get(r.sm, r.taken_ns), r.taken_ns)
        kind = kinds[r.index % per_step]
        exposed[kind] = exposed.get(kind, 0) + max(0, r.started_ns - idle_from)
        previous_done[r.sm] = r.done_ns
    return exposed


def peer_overlap(records: Sequence[TaskRecord], per_step: int, peers: Sequence[tuple]) -> dict:
    """How one rank's communication overlapped compute. A task that puts to the peers issues its puts as
    its tile is done, while the other SMs still run their tiles: per such task, how many other SMs were
    running a body at that moment (the tile's transfer and signal overlap that compute); and the compute
    warps' idle time waiting for tasks whose inputs come from the peers (exposed, ns, summed over SMs)."""
    starts = sorted(r.started_ns for r in records)
    ends = sorted(r.done_ns for r in records)
    busy = [bisect.bisect_left(starts, r.done_ns) - bisect.bisect_right(ends, r.done_ns)
            for r in records if peers[r.index % per_step][1]]   # bodies started before, done after
    exposed = 0
    previous_done: dict = {}
    for r in sorted(records, key=lambda r: (r.sm, r.started_ns)):
        idle_from = max(previous_done.get(r.sm, r.taken_ns), r.taken_ns)
        if peers[r.index % per_step][0]:
            exposed += max(0, r.started_ns - idle_from)
        previous_done[r.sm] = r.done_ns
    return {"put_tasks": len(busy), "overlapped_fraction": sum(b > 0 for b in busy) / len(busy) if busy else 0.0,
            "mean_busy_sms_at_put": sum(busy) / len(busy) if busy else 0.0, "exposed_peer_wait_ns": exposed}


def _median_us(values: list) -> float:
    """The median of ns values in µs (0 for none)."""
    return round(sorted(values)[len(values) // 2] / 1e3, 2) if values else 0.0


def layer_phases(records: Sequence[TaskRecord], kinds: Sequence[str], layers: Sequence[int], step: int,
                 first_layer: int = 1, last_layer: Optional[int] = None) -> dict:
    """One step's layers condensed (µs, the median over layers first_layer .. last_layer - 1): per kind,
    in the order the layer runs them, the phase's span (first body start to last body end over all SMs),
    its median body, and the gap before it (from the previous phase's last body end: a dependency hop);
    'layer': from one layer's last body end to the next's. `kinds`/`layers`: per task of a step."""
    per_step = len(kinds)
    phases: dict = {}
    for r in records:
        if r.index // per_step == step:
            task = r.index % per_step
            phases.setdefault((layers[task], kinds[task]), []).append(r)
    order = []   # the kinds of a layer in the order their first tasks appear in the step
    for task, kind in enumerate(kinds):
        if layers[task] == first_layer and kind not in order:
            order.append(kind)
    last_layer = max(layers) if last_layer is None else last_layer
    rows: dict = {kind: {"span": [], "body": [], "gap": []} for kind in order}
    rows["layer"] = {"span": [], "body": [], "gap": []}
    for layer in range(first_layer, last_layer):
        if any((l, k) not in phases for l in (layer - 1, layer) for k in order):
            continue
        previous_end = max(r.done_ns for r in phases[layer - 1, order[-1]])
        layer_start = previous_end
        for kind in order:
            tasks = phases[layer, kind]
            start, end = min(r.started_ns for r in tasks), max(r.done_ns for r in tasks)
            bodies = sorted(r.done_ns - r.started_ns for r in tasks)
            rows[kind]["span"].append(end - start)
            rows[kind]["body"].append(bodies[len(bodies) // 2])
            rows[kind]["gap"].append(start - previous_end)
            previous_end = end
        rows["layer"]["span"].append(previous_end - layer_start)

    return {kind: {f"{key}_us": _median_us(values) for key, values in row.items() if values}
            for kind, row in rows.items() if row["span"]}


def idle_by_predecessor(records: Sequence[TaskRecord], kinds: Sequence[str], layers: Sequence[int], step: int,
                        first_layer: int = 1, last_layer: Optional[int] = None) -> dict:
    """Where an SM's compute warps wait, by what ran before (µs, medians over one step's tasks of layers
    first_layer .. last_layer - 1): per (kind, kind of the previous body on the same SM), how many such
    tasks, their median body, and the median idle time between the previous body's end and this one's
    start (the inputs not yet there: a dependency hop plus the wait for the phase's slowest producer,
    which layer_phases' gap, measured from that slowest producer, leaves out)."""
    per_step = len(kinds)
    last_layer = max(layers) if last_layer is None else last_layer
    pairs: dict = {}
    previous: dict = {}   # SM -> its previous record of the step
    for r in sorted((r for r in records if r.index // per_step == step), key=lambda r: (r.sm, r.started_ns)):
        before = previous.get(r.sm)
        previous[r.sm] = r
        task = r.index % per_step
        if before is None or not first_layer <= layers[task] < last_layer:
            continue
        entry = pairs.setdefault((kinds[task], kinds[before.index % per_step]), ([], []))
        entry[0].append(r.done_ns - r.started_ns)
        entry[1].append(max(0, r.started_ns - before.done_ns))

    return {pair: {"tasks": len(bodies), "body_us": _median_us(bodies), "idle_before_us": _median_us(idle)}
            for pair, (bodies, idle) in sorted(pairs.items())}

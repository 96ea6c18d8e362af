"""The megakernel's profile: per executed task, the SM it ran on and three %globaltimer readings (taken
from the queue, inputs ready, done), exported as a Chrome / Perfetto trace JSON with one track per SM
(open it at ui.perfetto.dev or chrome://tracing)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import attrs

from mdsl.backend.cuda.nvrtc import _write_atomic as write_atomic


@attrs.frozen
class TaskRecord:
    index: int         # step * tasks_per_step + task
    sm: int
    taken_ns: int      # the worker took the task and began waiting for its inputs
    ready_ns: int      # its inputs were ready: the body started
    done_ns: int


def trace_events(records: Sequence[TaskRecord], labels: Sequence[str], kinds: Sequence[str]) -> list:
    """Chrome trace events: per task a 'wait' slice (taken -> ready, when it waited) and its body's
    slice (ready -> done) on its SM's track; `labels`/`kinds` name the tasks of one step."""
    if not records:
        return []
    per_step = len(labels)
    origin = min(r.taken_ns for r in records)
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "mdsl megakernel"}}]
    for sm in sorted({r.sm for r in records}):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": sm, "args": {"name": f"SM {sm}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": sm, "args": {"sort_index": sm}})
    for r in sorted(records, key=lambda r: (r.sm, r.taken_ns)):
        step, task = divmod(r.index, per_step)
        args = {"step": step, "task": task}
        if r.ready_ns > r.taken_ns:
            events.append({"name": "wait", "cat": "wait", "ph": "X", "pid": 0, "tid": r.sm,
                           "ts": (r.taken_ns - origin) / 1e3, "dur": (r.ready_ns - r.taken_ns) / 1e3, "args": args})
        events.append({"name": labels[task], "cat": kinds[task], "ph": "X", "pid": 0, "tid": r.sm,
                       "ts": (r.ready_ns - origin) / 1e3, "dur": max(0, r.done_ns - r.ready_ns) / 1e3, "args": args})
    return events


def write_trace(path: str, records: Sequence[TaskRecord], labels: Sequence[str], kinds: Sequence[str]) -> None:
    """The trace as JSON at `path`, written atomically."""
    data = json.dumps({"traceEvents": trace_events(records, labels, kinds), "displayTimeUnit": "ns"})
    write_atomic(Path(os.path.abspath(path)), data.encode())


def summary(records: Sequence[TaskRecord], kinds: Sequence[str]) -> dict:
    """Per task kind: count, total body time and total wait time (ns), over all records."""
    out: dict = {}
    per_step = len(kinds)
    for r in records:
        kind = kinds[r.index % per_step]
        entry = out.setdefault(kind, {"tasks": 0, "body_ns": 0, "wait_ns": 0})
        entry["tasks"] += 1
        entry["body_ns"] += max(0, r.done_ns - r.ready_ns)
        entry["wait_ns"] += max(0, r.ready_ns - r.taken_ns)
    return out

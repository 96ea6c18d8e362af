"""The profiler's export: a Chrome/Perfetto trace with two tracks per SM (the scheduler warp's waits and
the compute warps' bodies, so that what overlaps shows), named after the tasks, which reads back as its
records; and its per-kind summary."""
import json

import attrs

from mdsl.megakernel.runtime.profile import (TaskRecord, compute_track, read_trace, scheduler_track, summary,
                                             trace_events, write_trace)

LABELS = ["qkv L0 [0,8)", "attn L0 [0,1)", "sample [0,1)"]
KINDS = ["qkv", "attn", "sample"]
# (index, sm, taken, ready, started, done); index 3 is step 1's qkv. On SM 5 the sampler's wait (from 1500)
# overlaps the qkv body (1000 -> 3000); it was ready at 2500 but queued behind that body until 3000.
RECORDS = [TaskRecord(0, 5, 1000, 1000, 1000, 3000), TaskRecord(1, 7, 1500, 3100, 3100, 4000),
           TaskRecord(2, 5, 1500, 2500, 3000, 5000), TaskRecord(3, 7, 3200, 5100, 5200, 6100)]


def test_two_tracks_per_sm_and_a_slice_per_task_and_wait():
    events = trace_events(RECORDS, LABELS, KINDS)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {compute_track(5): "SM 5", scheduler_track(5): "SM 5 wait", compute_track(7): "SM 7",
                     scheduler_track(7): "SM 7 wait"}
    assert len(set(names)) == 4
    bodies = [e for e in events if e["ph"] == "X" and e.get("cat") != "wait"]
    assert [(b["name"], b["tid"], b["args"]["step"]) for b in sorted(bodies, key=lambda b: b["ts"])] == [
        ("qkv L0 [0,8)", 10, 0), ("sample [0,1)", 10, 0), ("attn L0 [0,1)", 14, 0), ("qkv L0 [0,8)", 14, 1)]
    first = min(bodies, key=lambda b: b["ts"])
    assert (first["ts"], first["dur"]) == (0.0, 2.0)    # microseconds from the first task
    sample = next(b for b in bodies if b["name"] == "sample [0,1)")
    assert (sample["ts"], sample["dur"], sample["args"]["ready_to_start_us"]) == (2.0, 2.0, 0.5)
    waits = [e for e in events if e.get("cat") == "wait"]
    assert [(w["tid"], w["ts"], w["dur"], w["args"]["for"]) for w in waits] == [
        (11, 0.5, 1.0, "sample [0,1)"), (15, 0.5, 1.6, "attn L0 [0,1)"), (15, 2.2, 1.9, "qkv L0 [0,8)")]


def test_the_trace_file_is_json(tmp_path):
    path = tmp_path / "trace.json"
    write_trace(str(path), RECORDS, LABELS, KINDS)
    data = json.loads(path.read_text())
    assert len([e for e in data["traceEvents"] if e["ph"] == "X"]) == 7
    assert list(tmp_path.iterdir()) == [path]


def test_summary_per_kind():
    assert summary(RECORDS, KINDS) == {
        "qkv": {"tasks": 2, "body_ns": 2900, "wait_ns": 1900, "exposed_wait_ns": 1200, "queued_ns": 100},
        "attn": {"tasks": 1, "body_ns": 900, "wait_ns": 1600, "exposed_wait_ns": 1600, "queued_ns": 0},
        "sample": {"tasks": 1, "body_ns": 2000, "wait_ns": 1000, "exposed_wait_ns": 0, "queued_ns": 500}}


def test_no_records_no_events():
    assert trace_events([], LABELS, KINDS) == []


def test_a_trace_reads_back_as_its_records(tmp_path):
    path = tmp_path / "trace.json"
    write_trace(str(path), RECORDS, LABELS, KINDS)
    origin = min(r.taken_ns for r in RECORDS)
    shifted = [attrs.evolve(r, taken_ns=r.taken_ns - origin, ready_ns=r.ready_ns - origin,
                            started_ns=r.started_ns - origin, done_ns=r.done_ns - origin) for r in RECORDS]
    assert read_trace(str(path), len(LABELS)) == shifted

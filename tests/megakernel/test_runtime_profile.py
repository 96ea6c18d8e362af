"""The profiler's export: a Chrome/Perfetto trace with one track per SM, a slice per task body and per
wait, named after the tasks; and its per-kind summary."""
import json

from mdsl.megakernel.runtime.profile import TaskRecord, summary, trace_events, write_trace

LABELS = ["qkv L0 [0,8)", "attn L0 [0,1)", "sample [0,1)"]
KINDS = ["qkv", "attn", "sample"]
RECORDS = [TaskRecord(0, 5, 1000, 1000, 3000), TaskRecord(1, 7, 1500, 3100, 4000),
           TaskRecord(2, 5, 3000, 4200, 5000), TaskRecord(3, 7, 4100, 5100, 6100)]   # index 3: step 1's qkv


def test_one_track_per_sm_and_a_slice_per_task():
    events = trace_events(RECORDS, LABELS, KINDS)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {5: "SM 5", 7: "SM 7"}
    bodies = [e for e in events if e["ph"] == "X" and e.get("cat") != "wait"]
    assert [(b["name"], b["tid"], b["args"]["step"]) for b in sorted(bodies, key=lambda b: b["ts"])] == [
        ("qkv L0 [0,8)", 5, 0), ("attn L0 [0,1)", 7, 0), ("sample [0,1)", 5, 0), ("qkv L0 [0,8)", 7, 1)]
    first = min(bodies, key=lambda b: b["ts"])
    assert (first["ts"], first["dur"]) == (0.0, 2.0)    # microseconds from the first task
    waits = [e for e in events if e.get("cat") == "wait"]
    assert [(w["tid"], w["ts"], w["dur"]) for w in waits] == [(5, 2.0, 1.2), (7, 0.5, 1.6), (7, 3.1, 1.0)]


def test_the_trace_file_is_json(tmp_path):
    path = tmp_path / "trace.json"
    write_trace(str(path), RECORDS, LABELS, KINDS)
    data = json.loads(path.read_text())
    assert len([e for e in data["traceEvents"] if e["ph"] == "X"]) == 7
    assert list(tmp_path.iterdir()) == [path]


def test_summary_per_kind():
    assert summary(RECORDS, KINDS) == {"qkv": {"tasks": 2, "body_ns": 3000, "wait_ns": 1000},
                                       "attn": {"tasks": 1, "body_ns": 900, "wait_ns": 1600},
                                       "sample": {"tasks": 1, "body_ns": 800, "wait_ns": 1200}}


def test_no_records_no_events():
    assert trace_events([], LABELS, KINDS) == []

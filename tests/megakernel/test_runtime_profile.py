"""The profiler's export: a Chrome/Perfetto trace with two tracks per SM (the scheduler warp's waits and
the compute warps' bodies, so that what overlaps shows), named after the tasks, which reads back as its
records; and its per-kind summary."""
import json

import attrs

from mdsl.megakernel.runtime.profile import (BODY_PARTS, TaskRecord, body_parts, compute_track, cross_rank_hops,
                                             idle_by_predecessor, layer_phases, read_trace, scheduler_track, summary,
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
        "qkv": {"tasks": 2, "body_ns": 2900, "wait_ns": 1900, "exposed_wait_ns": 1200, "queued_ns": 100,
                "parts_ns": {}},
        "attn": {"tasks": 1, "body_ns": 900, "wait_ns": 1600, "exposed_wait_ns": 1600, "queued_ns": 0,
                 "parts_ns": {}},
        "sample": {"tasks": 1, "body_ns": 2000, "wait_ns": 1000, "exposed_wait_ns": 0, "queued_ns": 500,
                   "parts_ns": {}}}


def test_no_records_no_events():
    assert trace_events([], LABELS, KINDS) == []


def test_a_trace_reads_back_as_its_records(tmp_path):
    path = tmp_path / "trace.json"
    write_trace(str(path), RECORDS, LABELS, KINDS)
    origin = min(r.taken_ns for r in RECORDS)
    shifted = [attrs.evolve(r, taken_ns=r.taken_ns - origin, ready_ns=r.ready_ns - origin,
                            started_ns=r.started_ns - origin, done_ns=r.done_ns - origin) for r in RECORDS]
    assert read_trace(str(path), len(LABELS)) == shifted


# the same tasks with the marks their bodies passed: qkv's input row at 1400 (step 0) and 5500 (step 1),
# attention's four stages; the sampler has no marks
MARKED = [attrs.evolve(RECORDS[0], marks=(1400, 0, 0, 0)), attrs.evolve(RECORDS[1], marks=(3300, 3500, 3600, 3800)),
          RECORDS[2], attrs.evolve(RECORDS[3], marks=(5500, 0, 0, 0))]


def test_a_body_is_split_into_its_parts_at_its_marks():
    assert body_parts(MARKED[0], "qkv") == [("input row", 1000, 1400), ("products out", 1400, 3000)]
    assert [(name, end - start) for name, start, end in body_parts(MARKED[1], "attn")] == list(zip(
        BODY_PARTS["attn"], [200, 200, 100, 200, 200]))
    assert body_parts(MARKED[2], "sample") == [] and body_parts(RECORDS[0], "qkv") == []
    assert body_parts(attrs.evolve(RECORDS[1], marks=(3300, 3400, 3500, 3600, 3700)), "qkv") == []   # too many
    # an o-proj's relay mark (under the relay only): its wait for the peers' words is a part of its own
    assert body_parts(attrs.evolve(MARKED[0], marks=(1400, 0, 0, 0)), "oproj") == [
        ("input row", 1000, 1400), ("products out", 1400, 3000)]
    assert body_parts(attrs.evolve(MARKED[0], marks=(1400, 2500, 0, 0)), "down") == [
        ("input row", 1000, 1400), ("products out", 1400, 2500), ("relay", 2500, 3000)]


def test_parts_are_nested_slices_that_read_back_as_marks(tmp_path):
    events = trace_events(MARKED, LABELS, KINDS)
    parts = [e for e in events if e.get("cat") == "part"]
    assert [(e["name"], e["tid"]) for e in parts if e["args"]["step"] == 0][:2] == [("input row", 10), ("products out", 10)]
    assert len(parts) == 2 + 5 + 2
    for part in parts:   # inside its body's slice on the same track
        body = next(e for e in events if e.get("ph") == "X" and e["cat"] not in ("part", "wait")
                    and e["args"]["task"] == part["args"]["task"] and e["args"]["step"] == part["args"]["step"])
        assert body["tid"] == part["tid"] and body["ts"] <= part["ts"] and \
            part["ts"] + part["dur"] <= body["ts"] + body["dur"] + 1e-9
    path = tmp_path / "trace.json"
    write_trace(str(path), MARKED, LABELS, KINDS)
    origin = min(r.taken_ns for r in MARKED)
    shifted = [attrs.evolve(r, taken_ns=r.taken_ns - origin, ready_ns=r.ready_ns - origin,
                            started_ns=r.started_ns - origin, done_ns=r.done_ns - origin,
                            marks=tuple(m - origin if m else 0 for m in r.marks)) for r in MARKED]
    assert read_trace(str(path), len(LABELS)) == shifted
    totals = summary(MARKED, KINDS)
    assert totals["qkv"]["parts_ns"] == {"input row": 400 + 300, "products out": 1600 + 600}
    assert sum(totals["attn"]["parts_ns"].values()) == totals["attn"]["body_ns"]


def test_layer_phases_condense_a_step_into_one_layers_spans_bodies_and_gaps():
    # a step of three layers of two kinds ("a" on two SMs, then "b" on one), then a sampler; step 1 only
    kinds = ["a", "a", "b"] * 3 + ["sample"]
    layers = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    per_step = len(kinds)
    records, t = [], 10_000
    for layer in range(3):
        a0, a1 = t + 1000, t + 1500                       # gap 1000 after the previous layer's "b"
        records += [TaskRecord(per_step + 3 * layer, 0, t, a0, a0, a0 + 4000),
                    TaskRecord(per_step + 3 * layer + 1, 1, t, a1, a1, a1 + 2000)]
        b = a0 + 4000 + 300                              # gap 300 after the last "a"
        records.append(TaskRecord(per_step + 3 * layer + 2, 0, b, b, b, b + 6000))
        t = b + 6000
    records.append(TaskRecord(0, 0, 0, 0, 0, 5))         # step 0: not counted
    phases = layer_phases(records, kinds, layers, step=1)
    assert phases == {"a": {"span_us": 4.0, "body_us": 4.0, "gap_us": 1.0},
                      "b": {"span_us": 6.0, "body_us": 6.0, "gap_us": 0.3},
                      "layer": {"span_us": 11.3}}


def test_idle_time_is_measured_on_each_sm_from_its_previous_body():
    # step 1 of two layers of "a" (2 SMs) then "b" (SM 0 only); SM 1 finishes its "a" early and its next
    # body, layer 1's "a", waits for SM 0's "b": that wait shows as idle before ("a" after "a")
    kinds, layers = ["a", "a", "b"] * 2 + ["sample"], [0, 0, 0, 1, 1, 1, 2]
    per_step = len(kinds)
    records = [TaskRecord(per_step + 0, 0, 0, 0, 0, 4000), TaskRecord(per_step + 1, 1, 0, 0, 0, 1000),
               TaskRecord(per_step + 2, 0, 0, 4500, 4500, 7500),                     # "b" 500 after SM 0's "a"
               TaskRecord(per_step + 3, 0, 0, 8000, 8000, 12000), TaskRecord(per_step + 4, 1, 0, 8200, 8200, 9200),
               TaskRecord(per_step + 5, 0, 0, 12600, 12600, 15600),
               TaskRecord(per_step + 6, 0, 0, 16000, 16000, 16100),                  # the sampler (layer 2)
               TaskRecord(0, 1, 0, 0, 0, 5)]                                          # step 0: not counted
    idle = idle_by_predecessor(records, kinds, layers, step=1, first_layer=0)
    assert idle == {("a", "a"): {"tasks": 1, "body_us": 1.0, "idle_before_us": 7.2},   # SM 1: 1000 -> 8200
                    ("a", "b"): {"tasks": 1, "body_us": 4.0, "idle_before_us": 0.5},   # SM 0: 7500 -> 8000
                    ("b", "a"): {"tasks": 2, "body_us": 3.0, "idle_before_us": 0.6}}   # 500 and 600
    # by default layer 0 is left out (its first tasks follow the previous step's): layer 1's "b" alone
    assert idle_by_predecessor(records, kinds, layers, step=1)[("b", "a")] == {"tasks": 1, "body_us": 3.0,
                                                                             "idle_before_us": 0.6}


def test_a_cross_rank_hop_is_half_the_two_directions_sum_whatever_the_clocks_offset():
    # two ranks, two layers of (down, qkv) in step 1: rank 0's down-proj ends at 10 us, rank 1's at 12; rank
    # 0's next QKV starts 3 us after rank 1's down-proj (a cross-GPU hop), rank 1's 5 us after rank 0's
    # (it waited 1 us more than that for its own); rank 1's clock runs 700 us ahead, which cancels
    kinds = ["down", "qkv"] * 2 + ["sample"]
    layers = [0, 1, 1, 2, 2]
    per_step = len(kinds)

    def rank(down_end: int, qkv_start: int, clock: int = 0) -> list:
        return [TaskRecord(per_step + 0, 0, 0, 0, clock + down_end - 5000, clock + down_end),
                TaskRecord(per_step + 1, 0, 0, clock + qkv_start, clock + qkv_start, clock + qkv_start + 4000),
                TaskRecord(1, 0, 0, 0, 0, 1)]      # step 0's: not counted

    hops = cross_rank_hops([rank(10_000, 15_000), rank(12_000, 15_000, clock=700_000)], kinds, layers, step=1)
    assert hops == {"down->qkv": {"median_us": 4.0, "least_us": 4.0}}   # (3 + 5) / 2: an upper bound
    assert cross_rank_hops([rank(10_000, 15_000)], kinds, layers, step=1) == {}   # one rank: no hop


def test_the_serving_kernels_linear_bodies_have_their_own_parts():
    """A serving linear body passes three marks (its inputs, warp 0's products, warp 0's sums stored): four parts
    under SERVING_BODY_PARTS; under the decode kernel's names (two parts) such a record has none."""
    from mdsl.megakernel.runtime.profile import SERVING_BODY_PARTS, TaskRecord, body_parts

    record = TaskRecord(0, 0, 0, 10, 20, 100, (30, 70, 80, 0))
    assert body_parts(record, "qkv", SERVING_BODY_PARTS) == [
        ("input row", 20, 30), ("weights and products (warp 0)", 30, 70), ("sums and stores (warp 0)", 70, 80),
        ("the other warps, epilogue", 80, 100)]
    assert body_parts(record, "qkv") == []

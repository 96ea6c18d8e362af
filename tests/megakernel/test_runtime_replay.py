"""The replay model of decode steps: on one worker a step is the sum of its bodies; with a worker per
task it is the plan's critical path (bodies, hops and hand-overs along the longest dependency chain);
body times come from a profile's records."""
import numpy as np
import pytest

from mdsl.megakernel.runtime.profile import TaskRecord
from mdsl.megakernel.runtime.replay import body_times, measured_hops, replay
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import build_plan
from tests.megakernel.tiny import tiny_model


@pytest.fixture(scope="module")
def plan():
    config, _, _ = tiny_model("qwen3")
    return build_plan(decoder_shape(config), workers=4, max_seq=24)


def random_bodies(plan, seed=0):
    return np.random.default_rng(seed).uniform(0.5, 5.0, len(plan.tasks))


def test_one_worker_runs_the_step_back_to_back(plan):
    bodies = random_bodies(plan)
    steps = replay(plan, bodies, workers=1, hop_us=0.0, handoff_us=0.0)
    assert steps == pytest.approx([bodies.sum()] * 2)
    # a hop is hidden while the one worker is busy with the producer's successors, never shortens a step
    assert all(s >= bodies.sum() for s in replay(plan, bodies, workers=1, hop_us=0.7))


def critical_path(plan, bodies, hop, handoff):
    """The longest chain through a step, the previous step's sampler included (a separate DP)."""
    n = len(plan.tasks)
    finish = np.zeros(n)
    for k in range(n):
        start = 0.0   # from the previous step's sampler end
        for e in plan.waits[k]:
            producers = plan.events[e].producers
            start = max(start, max((finish[p] for p in producers), default=0.0) + hop)
        finish[k] = start + handoff + bodies[k]
    return finish[n - 1]


def test_a_worker_per_task_runs_the_critical_path(plan):
    bodies = random_bodies(plan, seed=1)
    expected = critical_path(plan, bodies, hop=0.8, handoff=0.1)
    steps = replay(plan, bodies, workers=len(plan.tasks), hop_us=0.8, handoff_us=0.1)
    assert steps == pytest.approx([expected] * 2)
    assert expected < bodies.sum()


def test_more_workers_never_slow_the_step(plan):
    bodies = random_bodies(plan, seed=2)
    times = [replay(plan, bodies, workers=w, hop_us=0.5)[0] for w in (1, 2, 4, len(plan.tasks))]
    assert times[0] > times[-1]
    assert times[-1] == pytest.approx(critical_path(plan, bodies, hop=0.5, handoff=0.1))


def test_body_times_are_per_task_medians(plan):
    n = len(plan.tasks)
    records = [TaskRecord(0, 1, 0, 0, 1000, 3000), TaskRecord(n, 1, 0, 0, 5000, 6000),
               TaskRecord(2 * n, 2, 0, 0, 7000, 11000), TaskRecord(1, 3, 0, 0, 0, 500)]
    bodies = body_times(records, n)
    assert bodies[0] == 2.0 and bodies[1] == 0.5
    assert bodies[2] == pytest.approx(np.median([2.0, 1.0, 4.0, 0.5]))   # never profiled: the median of all


def test_bad_requests_are_refused(plan):
    with pytest.raises(ValueError, match="body times for"):
        replay(plan, [1.0], workers=4)


def test_hops_are_measured_where_the_scheduler_waited(plan):
    n = len(plan.tasks)
    k = next(k for k in range(n) if plan.waits[k] and plan.events[plan.waits[k][0]].producers)
    producers = plan.events[plan.waits[k][0]].producers
    assert len(plan.waits[k]) == 1
    records = [TaskRecord(p, 0, 0, 0, 0, 1000 + 100 * p) for p in producers]
    last = max(r.done_ns for r in records)
    records.append(TaskRecord(k, 1, last - 500, last + 1500, last + 1600, last + 4000))   # waited: a 1.5 µs hop
    records.append(TaskRecord(n + k, 1, 10**6, 10**6, 10**6, 10**6 + 1))   # its producers not profiled
    assert list(measured_hops(records, plan)) == [1.5]
    records[-2] = TaskRecord(k, 1, last + 100, last + 200, last + 300, last + 4000)   # taken after: no hop
    assert list(measured_hops(records, plan)) == []


def test_the_command_replays_a_trace(plan, tmp_path, capsys):
    import json

    from mdsl.megakernel.runtime.profile import write_trace
    from mdsl.megakernel.runtime.replay import main
    from tests.megakernel.tiny import tiny_config_dict

    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_config_dict("qwen3")))
    n = len(plan.tasks)
    bodies = random_bodies(plan, seed=3)
    # a "profile" whose steps are the replay's own (one worker per task, 0.8 µs hops): the command must
    # find the hop and reproduce the step time
    step = critical_path(plan, bodies, hop=0.8, handoff=0.1)
    records = []
    for s in range(3):
        base = 10_000 + s * step * 1e3
        finish = {}
        for k in range(n):
            ready = base
            for e in plan.waits[k]:
                producers = plan.events[e].producers
                ready = max(ready, max((finish[p] for p in producers), default=base - 800) + 800)
            started = ready + 100
            finish[k] = started + bodies[k] * 1e3
            records.append(TaskRecord(s * n + k, k % 4, int(base - 5000), int(ready), int(started), int(finish[k])))
    trace = tmp_path / "trace.json"
    write_trace(str(trace), records, [t.label() for t in plan.tasks], [t.kind.name.lower() for t in plan.tasks])
    assert main([str(trace), "--config", str(config), "--workers", "4", "--max-seq", "24"]) == 0
    out = capsys.readouterr().out
    assert f"{n} tasks a step, {3 * n} profiled" in out
    assert "median hop 0.80 µs" in out
    assert f"measured µs per step (sampler to sampler): [{step:.1f}, {step:.1f}]" in out
    assert "replayed: [" in out and "µs per step" in out
    with pytest.raises(SystemExit):
        main([str(config), "--config", str(config), "--workers", "4", "--max-seq", "24"])

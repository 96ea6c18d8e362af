"""A discrete-event model of the megakernel's decode steps: measured task body times replayed through
the plan's dependencies, to predict what a change of the tables or the hops does before a GPU run (and to
look back at one after it).

    bodies = body_times(records, len(plan.tasks))           # from a profile (Run.profile)
    replay(plan, bodies, workers=132, hop_us=1.0)            # -> µs per step

The runtime modelled is worker.cuh's: worker w takes the task indices w, w + workers, ... in order; its
scheduler warp takes its next task when it hands the previous one over, waits for its inputs while the
compute warps run, and fills one of two slots (so it may be two tasks ahead of the compute warps). A task's inputs are ready `hop_us` after the last
producer's body ends (release, polling); the compute warps start `handoff_us` after the hand-over.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from mdsl.megakernel.runtime.profile import TaskRecord
from mdsl.megakernel.runtime.task_plan import TaskPlan

SLOTS = 2   # sync.cuh's SLOTS


def body_times(records: Sequence[TaskRecord], per_step: int) -> np.ndarray:
    """Per task of a step, its median body time over the profiled steps (µs); a task never profiled
    gets the median of all."""
    samples: list = [[] for _ in range(per_step)]
    for r in records:
        samples[r.index % per_step].append((r.done_ns - r.started_ns) / 1e3)
    seen = [s for task in samples for s in task]
    fallback = float(np.median(seen)) if seen else 0.0
    return np.array([float(np.median(s)) if s else fallback for s in samples])


def _producers(plan: TaskPlan) -> list:
    """Per task of a step: (step offset, task) of the tasks it waits for (-1: the previous step's sampler)."""
    n = len(plan.tasks)
    out = []
    for waits in plan.waits:
        found = []
        for e in waits:
            producers = plan.events[e].producers
            found += [(0, p) for p in producers] if producers else [(-1, n - 1)]
        out.append(found)
    return out


class _Replay:
    def __init__(self, plan: TaskPlan, bodies: np.ndarray, steps: int, hop_us: float):
        self.n = len(plan.tasks)
        self.producers = _producers(plan)
        self.bodies = bodies
        self.total = self.n * steps
        self.hop = hop_us
        self.done = np.full(self.total, np.nan)

    def inputs_ready(self, index: int) -> float:
        """When task `index`'s inputs are ready; its producers (earlier indices) have been replayed."""
        step, k = divmod(index, self.n)
        ready = 0.0
        for offset, p in self.producers[k]:
            j = (step + offset) * self.n + p
            if j >= 0:
                ready = max(ready, self.done[j] + self.hop)
        return ready

    def body(self, index: int) -> float:
        return float(self.bodies[index % self.n])


def replay(plan: TaskPlan, bodies: Sequence[float], *, workers: int, hop_us: float = 1.0,
           handoff_us: float = 0.1, steps: int = 3) -> list:
    """µs per step (from one sampler's end to the next; the first step, which starts cold, is left
    out) of `steps` steps replayed with `bodies` (µs per task of a step)."""
    if len(bodies) != len(plan.tasks):
        raise ValueError(f"{len(bodies)} body times for {len(plan.tasks)} tasks a step")
    r = _Replay(plan, np.asarray(bodies, dtype=float), steps, hop_us)
    _scheduler_warps(r, workers, handoff_us)
    ends = [r.done[(s + 1) * r.n - 1] for s in range(steps)]
    return [float(b - a) for a, b in zip(ends, ends[1:])]


def _scheduler_warps(r: _Replay, workers: int, handoff: float) -> None:
    """The tasks in index order (every producer before its consumers): worker w takes w, w + workers, ...,
    each when it has handed the previous one over."""
    compute_free = [0.0] * workers
    handovers = [0.0] * workers                     # the scheduler takes its next task at its last handover
    handed: list = [[] for _ in range(workers)]     # per worker: done times of the tasks handed over
    for index in range(r.total):
        w = index % workers
        taken = handovers[w]
        ready = max(taken, r.inputs_ready(index))
        slot_free = handed[w][-SLOTS] if len(handed[w]) >= SLOTS else 0.0
        handovers[w] = max(ready, slot_free)
        start = max(handovers[w] + handoff, compute_free[w])
        r.done[index] = start + r.body(index)
        compute_free[w] = r.done[index]
        handed[w].append(r.done[index])


def measured_hops(records: Sequence[TaskRecord], plan: TaskPlan) -> np.ndarray:
    """From a profile: per task whose scheduler was already waiting when its last producer finished,
    the time from that producer's end to the task's inputs being ready (µs): the hop `replay` models."""
    n = len(plan.tasks)
    producers = _producers(plan)
    done = {r.index: r.done_ns for r in records}
    hops = []
    for r in records:
        step, k = divmod(r.index, n)
        ends = [done.get((step + offset) * n + p) for offset, p in producers[k] if (step + offset) * n + p >= 0]
        if ends and None not in ends and r.taken_ns < max(ends):
            hops.append((r.ready_ns - max(ends)) / 1e3)
    return np.array(hops)



def main(argv=None) -> int:
    """`python -m mdsl.megakernel.runtime.replay TRACE.json --model NAME`: a profiled run's trace (from
    benchmarks/decode.py or `mdsl generate --profile`) against the model: its steps as measured, its
    median hop, and its bodies replayed."""
    import argparse
    import json

    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    from mdsl.megakernel.runtime.models import MODELS
    from mdsl.megakernel.runtime.profile import read_trace
    from mdsl.megakernel.runtime.shape import decoder_shape
    from mdsl.megakernel.runtime.task_plan import build_plan

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("trace")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", choices=sorted(MODELS), help="one of the benchmark's shapes")
    which.add_argument("--config", metavar="CONFIG.json", help="a Hugging Face config.json")
    ap.add_argument("--workers", type=int, default=132, help="worker blocks (the GPU's SMs; the H200: 132)")
    ap.add_argument("--max-seq", type=int, default=1064, help="the engine's KV cache positions (decode.py --quick: 1064)")
    args = ap.parse_args(argv)
    if args.config:
        with open(args.config) as f:
            raw = json.load(f)
    else:
        raw = MODELS[args.model]
    plan = build_plan(decoder_shape(config_from_dict(raw)), workers=args.workers, max_seq=args.max_seq)
    n = len(plan.tasks)
    try:
        records = read_trace(args.trace, n)
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"{args.trace} is not a megakernel trace: {e}")
    if not records or any(r.index % n >= n for r in records):
        ap.error(f"{args.trace} holds no profiled task")
    ends: dict = {}
    for r in records:
        ends[r.index // n] = max(ends.get(r.index // n, 0), r.done_ns)
    measured = [(ends[s] - ends[s - 1]) / 1e3 for s in sorted(ends) if s - 1 in ends]
    hops = measured_hops(records, plan)
    hop = float(np.median(hops)) if len(hops) else 1.0
    bodies = body_times(records, n)
    print(f"{n} tasks a step, {len(records)} profiled; measured µs per step (sampler to sampler): "
          f"{[round(m, 1) for m in measured] or 'one step only'}; median hop {hop:.2f} µs over {len(hops)} waits")
    steps = replay(plan, bodies, workers=args.workers, hop_us=hop)
    print(f"replayed: {[round(t, 1) for t in steps]} µs per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

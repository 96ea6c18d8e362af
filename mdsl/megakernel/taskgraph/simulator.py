"""The CPU simulator of the megakernel runtime: the task graph run by numpy task bodies under the
runtime's event semantics, with random interleavings of a random number of workers.

Like the persistent kernel, a scheduler hands out the tasks of step 0, then of step 1, ... in the task
graph's order, one at a time to whichever worker asks (`dispatch="queue"`), or deals them round-robin
into per-worker queues up front, as MPK does (`dispatch="round_robin"`); a worker waits until every event it waits on has
reached its threshold for the task's step, runs the body, and later (any number of other workers' moves
may come between) increments the events it signals. Which worker moves next is random.

Independently of the events, a checker asserts before each body that every task writing what it reads
has finished (this step's writers for activations, the previous step's for state) and that every task
reading what it writes is done with the previous step, so a missing or wrong event is caught even when
the interleaving happens to be benign. A state where no worker can move before the end is a deadlock.
"""
from __future__ import annotations

import random
from collections import defaultdict, deque
from typing import Optional, Sequence

import numpy as np

from mdsl.errors import MdslError
from mdsl.megakernel.modelgraph.layers import StepContext
from mdsl.megakernel.modelgraph.model import TOKENS
from mdsl.megakernel.modelgraph.reference import Generation, check_steps, initial_states
from mdsl.megakernel.taskgraph.numpy_bodies import TASK_BODIES
from mdsl.megakernel.taskgraph.tasks import ACTIVATION, SCRATCH, WEIGHT, RegionIndex, TaskGraph


class _Lookups:
    """A task's view of the buffers that notes the names its body looks up."""

    def __init__(self, buf: dict):
        self.buf, self.names = buf, set()

    def __getitem__(self, name: str):
        self.names.add(name)
        return self.buf[name]

    def __setitem__(self, name: str, value) -> None:
        self.buf[name] = value


class SimulationError(MdslError):
    """The task graph broke the runtime's rules: a deadlock or a task run before its inputs."""


def _requirements(graph: TaskGraph) -> list:
    """Per task: (other task, k) pairs meaning `other` must have finished step s + k - 1 before this task's
    step s starts (k = 1: this step; k = 0: the previous step)."""
    readers = RegionIndex((t.id, r) for t in graph.tasks for r in t.reads)
    writers = RegionIndex((t.id, r) for t in graph.tasks for r in t.writes)
    kinds = {b.name: b.kind for b in graph.buffers}
    out = []
    for t in graph.tasks:
        need: dict = {}

        def require(other: int, k: int) -> None:
            if other != t.id:
                need[other] = max(need.get(other, 0), k)

        for r in t.reads:
            same_step = kinds[r.buffer] in (ACTIVATION, SCRATCH)
            for w in writers.overlapping(r):
                require(w, 1 if same_step else 0)
        for r in t.writes:
            for other in (*readers.overlapping(r), *writers.overlapping(r)):
                require(other, 0)
        out.append(tuple(need.items()))
    return out


class Simulator:
    """Runs a task graph over weights (name -> float32 array)."""

    def __init__(self, graph: TaskGraph, weights: dict):
        self.graph = graph
        self.model = graph.model
        self.weights = {b.name: np.asarray(weights[b.name], np.float32) for b in graph.buffers if b.kind == WEIGHT}
        self._itemsize = {b.name: b.type.nbytes // max(1, b.type.numel) for b in graph.buffers if b.kind == WEIGHT}
        self.requirements = _requirements(graph)
        self.events = {e.id: e for e in graph.events}
        self.terminal = set(graph.terminal_tasks())
        self.bodies = [TASK_BODIES[self.model.nodes[t.node].op].bodies[t.kind] for t in graph.tasks]
        self.tasks_run = 0
        # bytes of each weight read: a task's declared box of a weight, counted where its body looked the weight up
        # (a mixture of experts' task reads no weight of an expert the routing row does not pick)
        self.weight_bytes_read: dict = defaultdict(int)
        self._weight_reads = [[(r.buffer, r.numel * self._itemsize[r.buffer]) for r in t.reads
                               if r.buffer in self._itemsize] for t in graph.tasks]

    def _buffers(self, prompt_ids: Sequence[int]) -> dict:
        buf = dict(self.weights)
        buf.update(initial_states(self.model, prompt_ids))
        for b in self.graph.buffers:
            if b.kind in (ACTIVATION, SCRATCH):
                # NaN-filled floats: a task that reads what was never written poisons the logits
                buf[b.name] = np.full(b.type.shape, np.nan, np.float32) if b.type.dtype.is_float else \
                    np.full(b.type.shape, -1, np.int32)
        return buf

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, workers: int = 4, seed: int = 0,
                 dispatch: str = "queue", max_moves: Optional[int] = None) -> Generation:
        """Prefill and decode like `ReferenceModel.generate`, under one random interleaving."""
        if dispatch not in ("queue", "round_robin"):
            raise ValueError(f"dispatch must be 'queue' or 'round_robin', not {dispatch!r}")
        steps = check_steps(self.model, prompt_ids, max_new_tokens)
        rng = random.Random(seed)
        buf = self._buffers(prompt_ids)
        counters = defaultdict(int)
        done = [0] * len(self.graph.tasks)        # steps each task has finished (signalled)
        order = [(s, t.id) for s in range(steps) for t in self.graph.tasks]
        # one shared queue, or worker w's own queue of every workers-th task
        queues = [deque(order)] if dispatch == "queue" else [deque(order[w::workers]) for w in range(workers)]
        queue_of = (lambda w: queues[0]) if dispatch == "queue" else (lambda w: queues[w])
        current = [None] * workers                # (step, task id, phase) per worker; phase: wait | signal
        logits = [None] * steps
        moves, limit = 0, max_moves or 20 * len(order) + 1000
        while any(queues) or any(c is not None for c in current):
            movable = [w for w in range(workers) if self._can_move(current[w], queue_of(w), counters)]
            if not movable:
                raise SimulationError(f"deadlock: {self._describe(current, counters)}",
                                      hint="an event waits on a task that never signals it")
            w = rng.choice(movable)
            job = current[w]
            if job is None:
                step, tid = queue_of(w).popleft()
                current[w] = (step, tid, "wait")
            elif job[2] == "wait":
                step, tid, _ = job
                self._check_inputs(step, tid, done)
                lookups = _Lookups(buf)
                self.bodies[tid](self.graph.tasks[tid], self.model.nodes[self.graph.tasks[tid].node], lookups,
                                 StepContext(step, len(prompt_ids)))
                for name, nbytes in self._weight_reads[tid]:
                    if name in lookups.names:
                        self.weight_bytes_read[name] += nbytes
                self.tasks_run += 1
                if tid in self.terminal:
                    logits[step] = buf[self.model.logits.name].reshape(-1).copy()
                current[w] = (step, tid, "signal")
            else:
                step, tid, _ = job
                for e in self.graph.tasks[tid].signals:
                    counters[e] += 1
                done[tid] += 1
                current[w] = None
            moves += 1
            if moves > limit:
                raise SimulationError(f"no end after {moves} moves: {self._describe(current, counters)}")
        new = tuple(int(t) for t in buf[TOKENS][len(prompt_ids):len(prompt_ids) + max_new_tokens])
        return Generation(new, np.stack(logits) if steps else np.zeros((0, self.model.logits.shape[1]), np.float32))

    def _ready(self, step: int, tid: int, counters) -> bool:
        return all(counters[w.event] >= self.events[w.event].threshold(step, w.step_offset)
                   for w in self.graph.tasks[tid].waits)

    def _can_move(self, job, queue, counters) -> bool:
        if job is None:
            return bool(queue)
        return job[2] == "signal" or self._ready(job[0], job[1], counters)

    def _check_inputs(self, step: int, tid: int, done: list) -> None:
        for other, k in self.requirements[tid]:
            if done[other] < step + k:
                task, o = self.graph.tasks[tid], self.graph.tasks[other]
                when = "this step" if k == 1 else "the previous step"
                raise SimulationError(f"task {tid} ({task.kind} {dict(task.tile)}) of step {step} started before "
                                      f"task {other} ({o.kind} {dict(o.tile)}) finished {when}",
                                      hint="its events do not cover every tile it reads or overwrites")

    def _describe(self, current, counters) -> str:
        parts = []
        for w, job in enumerate(current):
            if job is not None:
                step, tid, phase = job
                waits = [f"e{x.event}: {counters[x.event]}/{self.events[x.event].threshold(step, x.step_offset)}"
                         for x in self.graph.tasks[tid].waits]
                parts.append(f"worker {w} {phase}s in task {tid} of step {step} ({', '.join(waits)})")
        return "; ".join(parts) or "no worker holds a task"

"""The CPU simulator of a tensor-parallel megakernel: every rank's task graph run by numpy task bodies
with its own workers (a random number per rank) and its own event counters, the ranks linked by a
simulated one-sided transport, all under one random interleaving.

The transport has the semantics of NVSHMEM's put-with-signal, which the GPU design uses: when a task
that sends finishes, each of its puts takes a snapshot of the source regions and is in flight; a
later, separate move (in any order with other moves and other puts) delivers it: the data lands in
the receiver's memory and then the receiver's remote events named by the put go up by one.
A task waits for its local events and its remote events, as on the GPU.

The checker is independent of the events: before a task's body it asserts that the local tasks
writing what it reads have finished (as the single-rank simulator does) and that every put landing
in what it reads has arrived for this step; when a put lands it asserts that the receiver's readers
of that region have finished the previous step (nothing unread is overwritten) and that the same
put of the previous step has landed. A state where nothing can move before the end is a deadlock.
"""
from __future__ import annotations

import random
from collections import defaultdict, deque
from typing import Optional, Sequence, Union

import attrs

from mdsl.errors import ValidationError
from mdsl.megakernel.modelgraph.model import TOKENS
from mdsl.megakernel.modelgraph.reference import Generation, check_steps
from mdsl.megakernel.parallel.collectives import RankStepContext
from mdsl.megakernel.parallel.tensor_parallel import TensorParallelTaskGraph, ranks_generation
from mdsl.megakernel.taskgraph.simulator import SimulationError, Simulator
from mdsl.megakernel.taskgraph.tasks import RegionIndex


@attrs.frozen
class _Message:
    sender: int
    receiver: int
    task: int
    peer: int
    step: int
    data: tuple       # (destination Region, array)
    events: tuple


def _slices(region) -> tuple:
    return tuple(slice(a, b) for a, b in region.box)


class _Rank:
    """One rank's memory, counters and workers during a run."""

    def __init__(self, sim: Simulator, rank: int, workers: int, order: list, dispatch: str, prompt_ids):
        self.sim = sim
        self.rank = rank
        self.workers = workers
        self.buf = sim._buffers(prompt_ids)
        self.counters = defaultdict(int)            # local events
        self.remote = defaultdict(int)              # remote events
        self.delivered = defaultdict(int)           # (task, peer) -> steps of that put landed here
        self.done = [0] * len(sim.graph.tasks)
        self.queues = [deque(order)] if dispatch == "queue" else [deque(order[w::workers]) for w in range(workers)]
        self.current = [None] * workers             # (step, task id, phase) per worker; phase: wait | signal
        self.rows: dict = {}                        # step -> logits
        self.version = 0                            # counts the changes of the counters
        self.checked = [None] * workers             # per worker: (job, version, ready) last computed

    def queue(self, worker: int) -> deque:
        return self.queues[0] if len(self.queues) == 1 else self.queues[worker]

    def busy(self) -> bool:
        return any(self.queues) or any(c is not None for c in self.current)


class TensorParallelSimulator:
    """Runs a TensorParallelTaskGraph over every rank's weights (rank_weights[r]: name -> array)."""

    def __init__(self, graph: TensorParallelTaskGraph, rank_weights: Sequence[dict]):
        if len(rank_weights) != graph.world_size:
            raise ValidationError(f"{len(rank_weights)} ranks' weights for a task graph of {graph.world_size} ranks")
        self.graph = graph
        self.sims = [Simulator(graph.local, w) for w in rank_weights]
        tasks = graph.local.tasks
        self.remote_inputs = graph.remote_inputs()  # per task: the (sender task, peer) puts landing in its reads
        readers = RegionIndex((t.id, r) for t in tasks for r in t.reads)
        self.landing_readers = defaultdict(set)    # (sender task, peer) -> the receiver's tasks reading it
        for tid, peer, dst in graph.landings():
            self.landing_readers[(tid, peer)].update(readers.overlapping(dst))
        self.remote_events = {e.id: e for e in graph.remote_events}
        self.terminal = set(graph.local.terminal_tasks())
        self.tasks_run = 0
        self.puts_delivered = 0
        self.bytes_sent = 0

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *,
                 workers: Union[None, int, Sequence[int]] = None, speeds: Optional[Sequence[float]] = None,
                 seed: int = 0, dispatch: str = "queue", max_moves: Optional[int] = None) -> Generation:
        """Prefill and decode on every rank under one random interleaving; `workers`: per rank (a number
        for all, or None: 1 to 6 at random per rank); `speeds`: per rank, the relative odds that one of its
        workers moves next (None: 1, 0.1 or 0.01 at random per rank, so that ranks drift apart as a
        straggling GPU would; a put's delivery has odds 1). The tokens (the ranks must agree) and the
        logits gathered from the ranks' vocabulary shards."""
        if dispatch not in ("queue", "round_robin"):
            raise ValueError(f"dispatch must be 'queue' or 'round_robin', not {dispatch!r}")
        world = self.graph.world_size
        rng = random.Random(seed)
        if workers is None:
            workers = [rng.randint(1, 6) for _ in range(world)]
        elif isinstance(workers, int):
            workers = [workers] * world
        if len(workers) != world or min(workers) < 1:
            raise ValueError(f"workers must give each of the {world} ranks at least one worker, got {workers}")
        speeds = [rng.choice((1.0, 0.1, 0.01)) for _ in range(world)] if speeds is None else list(speeds)
        if len(speeds) != world or min(speeds) <= 0:
            raise ValueError(f"speeds must give each of the {world} ranks positive odds, got {speeds}")
        steps = check_steps(self.graph.plan.graph, prompt_ids, max_new_tokens)
        order = [(s, t.id) for s in range(steps) for t in self.graph.local.tasks]
        ranks = [_Rank(sim, r, workers[r], order, dispatch, prompt_ids) for r, sim in enumerate(self.sims)]
        in_flight: list = []
        moves, limit = 0, max_moves or 30 * world * len(order) + 1000
        while in_flight or any(rank.busy() for rank in ranks):
            movable = [(rank, w) for rank in ranks for w in range(rank.workers) if self._can_move(rank, w)]
            if not movable and not in_flight:
                raise SimulationError(f"deadlock: {self._describe(ranks)}",
                                      hint="an event waits on a task or a put that never signals it")
            odds = [speeds[rank.rank] for rank, _ in movable] + [1.0] * len(in_flight)
            pick = rng.choices(range(len(odds)), weights=odds)[0]
            if pick < len(movable):
                self._move(*movable[pick], ranks, in_flight, len(prompt_ids))
            else:
                self._deliver(in_flight.pop(pick - len(movable)), ranks)
            moves += 1
            if moves > limit:
                raise SimulationError(f"no end after {moves} moves: {self._describe(ranks)}")
        histories = [rank.buf[TOKENS] for rank in ranks]
        rows = [[rank.rows[s] for s in range(steps)] for rank in ranks]
        return ranks_generation(self.graph.plan, histories, rows, len(prompt_ids), max_new_tokens)

    # moves ----------------------------------------------------------------------------------

    def _ready(self, rank: _Rank, step: int, tid: int) -> bool:
        return rank.sim._ready(step, tid, rank.counters) and all(
            rank.remote[e] >= self.remote_events[e].threshold(step) for e in self.graph.remote_waits[tid])

    def _can_move(self, rank: _Rank, worker: int) -> bool:
        job = rank.current[worker]
        if job is None:
            return bool(rank.queue(worker))
        if job[2] == "signal":
            return True
        # counters only grow: a waiting job is re-checked only after one of its rank's counters moved
        seen = rank.checked[worker]
        if seen is None or seen[0] != job or (not seen[2] and seen[1] != rank.version):
            seen = rank.checked[worker] = (job, rank.version, self._ready(rank, job[0], job[1]))
        return seen[2]

    def _move(self, rank: _Rank, worker: int, ranks: list, in_flight: list, prompt_length: int) -> None:
        job = rank.current[worker]
        if job is None:
            step, tid = rank.queue(worker).popleft()
            rank.current[worker] = (step, tid, "wait")
            return
        step, tid, phase = job
        task = self.graph.local.tasks[tid]
        if phase == "wait":
            rank.sim._check_inputs(step, tid, rank.done)
            self._check_remote_inputs(rank, step, tid)
            ctx = RankStepContext(step, prompt_length, rank.rank, self.graph.world_size)
            rank.sim.bodies[tid](task, rank.sim.model.nodes[task.node], rank.buf, ctx)
            self.tasks_run += 1
            if tid in self.terminal:
                rank.rows[step] = rank.buf[rank.sim.model.logits.name].reshape(-1).copy()
            rank.current[worker] = (step, tid, "signal")
            return
        for put in self.graph.puts[tid]:     # put with signal: a snapshot now, delivered by a later move
            data = tuple((dst, rank.buf[src.buffer][_slices(src)].copy()) for src, dst in put.regions)
            self.bytes_sent += sum(a.nbytes for _, a in data)
            in_flight.append(_Message(rank.rank, (rank.rank + put.peer) % len(ranks), tid, put.peer, step, data,
                                      put.events))
        for e in task.signals:
            rank.counters[e] += 1
        rank.version += 1
        rank.done[tid] += 1
        rank.current[worker] = None

    def _deliver(self, msg: _Message, ranks: list) -> None:
        receiver = ranks[msg.receiver]
        sender_task = self.graph.local.tasks[msg.task]
        where = f"the put of task {msg.task} ({sender_task.kind}) of step {msg.step} from rank {msg.sender}"
        if receiver.delivered[(msg.task, msg.peer)] != msg.step:
            raise SimulationError(f"{where} reached rank {msg.receiver} before that of step "
                                  f"{receiver.delivered[(msg.task, msg.peer)]}", hint="a put overtook the previous "
                                                                                     "step's, whose data it overwrites")
        for reader in sorted(self.landing_readers[(msg.task, msg.peer)]):
            if receiver.done[reader] < msg.step:
                task = self.graph.local.tasks[reader]
                raise SimulationError(f"{where} overwrote rank {msg.receiver}'s data before its task {reader} "
                                      f"({task.kind} {dict(task.tile)}) had read it in step {msg.step - 1}",
                                      hint="the sender ran a step ahead of a reader of its puts")
        for dst, array in msg.data:
            receiver.buf[dst.buffer][_slices(dst)] = array
        receiver.delivered[(msg.task, msg.peer)] += 1
        for e in msg.events:
            receiver.remote[e] += 1
        receiver.version += 1
        self.puts_delivered += 1

    def _check_remote_inputs(self, rank: _Rank, step: int, tid: int) -> None:
        for sender_task, peer in self.remote_inputs[tid]:
            if rank.delivered[(sender_task, peer)] < step + 1:
                task, other = self.graph.local.tasks[tid], self.graph.local.tasks[sender_task]
                sender = (rank.rank - peer) % self.graph.world_size
                raise SimulationError(f"task {tid} ({task.kind} {dict(task.tile)}) of step {step} on rank {rank.rank} "
                                      f"started before the put of task {sender_task} ({other.kind} {dict(other.tile)}) "
                                      f"from rank {sender} arrived", hint="its remote events do not cover every put "
                                                                          "landing in what it reads")

    def _describe(self, ranks: list) -> str:
        parts = []
        for rank in ranks:
            for w, job in enumerate(rank.current):
                if job is None:
                    continue
                step, tid, phase = job
                waits = [f"e{x.event}: {rank.counters[x.event]}/{rank.sim.events[x.event].threshold(step, x.step_offset)}"
                         for x in self.graph.local.tasks[tid].waits]
                waits += [f"r{e}: {rank.remote[e]}/{self.remote_events[e].threshold(step)}"
                          for e in self.graph.remote_waits[tid]]
                parts.append(f"rank {rank.rank} worker {w} {phase}s in task {tid} "
                             f"({self.graph.local.tasks[tid].kind}) of step {step} ({', '.join(waits)})")
        return "; ".join(parts) or "no worker holds a task"

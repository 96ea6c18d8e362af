"""The weight-streaming ring's protocol (device.cu: `stream_weights`, the loader warp, and `task_gemv`'s
streamed path), played under random interleavings with the PTX semantics of mbarrier parity waits:

- `mbarrier.try_wait.parity P` succeeds when the barrier's current (incomplete) phase has the other
  parity: it cannot tell the phase it means from the one two phases earlier.
- The loader issues sub-tile n into buffer n % NB after waiting on that buffer's "empty" barrier for
  the reading of sub-tile n - NB, arrives on its "full" barrier with the byte count, publishes
  `issued = n + 1`; the copy lands later (completing the phase).
- Compute warp w takes sub-tiles first + w, first + w + NW, ... of each task; it waits until its
  sub-tile is issued, then on the buffer's "full" barrier, reads it and arrives on "empty". All warps
  finish a task before any starts the next (the compute barrier after every task).

Checked: every read finds its own sub-tile landed in the buffer, and nothing deadlocks. Without the
wait for `issued` (the first form of the warp-per-sub-tile ring, which failed on Qwen3-8B), a read can
find another sub-tile: the test shows the checker catches it."""
from __future__ import annotations

import random

import pytest

NW = 8


class Barrier:
    """An mbarrier of arrival count 1: `phase` counts completed phases."""

    def __init__(self):
        self.phase = 0
        self.armed = False     # the current phase's arrival happened, bytes still in flight

    def passes(self, parity: int) -> bool:
        return (self.phase & 1) != parity


class Ring:
    def __init__(self, subtiles_per_task: list, buffers: int, wait_for_issue: bool, rng: random.Random):
        self.tasks = subtiles_per_task
        self.nb = buffers
        self.wait_for_issue = wait_for_issue
        self.rng = rng
        self.full = [Barrier() for _ in range(buffers)]
        self.empty = [Barrier() for _ in range(buffers)]
        self.data = [None] * buffers        # the sub-tile a buffer holds once landed
        self.in_flight = []                 # (buffer, sub-tile) copies not landed yet
        self.total = sum(subtiles_per_task)
        self.issued = 0
        self.firsts = [sum(subtiles_per_task[:k]) for k in range(len(subtiles_per_task))]
        self.task = 0                       # the compute warps' task
        self.cursor = [0] * NW              # per warp: its next sub-tile's rank within the task
        self.errors = []

    def warp_subtile(self, w: int):
        """Warp w's next sub-tile number in the current task, or None when it is done with the task."""
        if self.task >= len(self.tasks):
            return None
        k = w + self.cursor[w] * NW
        return self.firsts[self.task] + k if k < self.tasks[self.task] else None

    def actions(self) -> list:
        found = []
        n = self.issued
        if n < self.total:
            b, use = n % self.nb, n // self.nb
            if use == 0 or self.empty[b].passes((use - 1) & 1):
                found.append(("issue", n))
        found += [("land", i) for i in range(len(self.in_flight))]
        for w in range(NW):
            n = self.warp_subtile(w)
            if n is None:
                continue
            if self.wait_for_issue and self.issued <= n:
                continue
            if self.full[n % self.nb].passes((n // self.nb) & 1):
                found.append(("read", w))
        return found

    def step(self, action) -> None:
        kind, arg = action
        if kind == "issue":
            b = arg % self.nb
            assert not self.full[b].armed, "a buffer armed twice"
            self.full[b].armed = True
            self.in_flight.append((b, arg))
            self.issued = arg + 1
        elif kind == "land":
            b, n = self.in_flight.pop(arg)
            self.data[b] = n
            self.full[b].armed = False
            self.full[b].phase += 1
        else:
            w = arg
            n = self.warp_subtile(w)
            b = n % self.nb
            if self.data[b] != n:
                self.errors.append(f"warp {w} read sub-tile {n} from buffer {b}, which holds {self.data[b]}")
            self.empty[b].phase += 1
            self.cursor[w] += 1
            if all(self.warp_subtile(v) is None for v in range(NW)):   # the compute barrier after a task
                self.task += 1
                self.cursor = [0] * NW

    def run(self) -> str:
        while self.task < len(self.tasks) or self.in_flight:
            options = self.actions()
            if not options:
                return f"deadlock: task {self.task}, issued {self.issued}, cursors {self.cursor}"
            self.step(self.rng.choice(options))
            if self.errors:
                return self.errors[0]
        return ""


def random_tasks(rng: random.Random) -> list:
    return [rng.choice([1, 2, 3, 4, 7, 8, 9, 12, 16, 17, 24]) for _ in range(rng.randint(3, 12))]


@pytest.mark.parametrize("buffers", [2, 3, 4, 7, 8, 12, 16])
def test_every_read_finds_its_own_subtile_and_nothing_deadlocks(buffers):
    rng = random.Random(1000 + buffers)
    for _ in range(150):
        ring = Ring(random_tasks(rng), buffers, wait_for_issue=True, rng=rng)
        outcome = ring.run()
        assert outcome == "", outcome
        assert ring.issued == ring.total and ring.task == len(ring.tasks)


def test_without_the_issue_count_a_warp_can_read_another_subtile():
    rng = random.Random(7)
    failures = [outcome for _ in range(300)
                if (outcome := Ring(random_tasks(rng), 7, wait_for_issue=False, rng=rng).run())]
    assert any("read sub-tile" in outcome for outcome in failures), failures[:3]

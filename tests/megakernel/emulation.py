"""What the numpy emulators of the megakernel's tables share (test_runtime_emulation.py: one row a step;
serving_emulator.py: serving steps): device.cu's worker loop under random interleavings, and the device's
weight slots, residual-stream rows and epilogues as a plan binds them."""
import numpy as np

from mdsl.megakernel.modelgraph.epilogues import evaluate_op


def run_workers(plan, workers: int, rng, execute, last) -> None:
    """The static schedule: worker w of `workers` takes the task indices w, w + W, ... (index = step * tasks +
    k) in increasing order; a task runs once each event it waits for has reached its producers a step times
    (step + 1), from the plan's initial counts; the next worker to run is picked at random among those whose task
    is ready. `execute(step, k)` runs task k of a step; `last()` is the highest task index that still runs
    (re-read after every task: a task may stop the launch), past which a worker leaves, as on the device. A
    round in which no worker's task is ready while some worker still holds one is a deadlock: AssertionError."""
    n = len(plan.tasks)
    per_step = [e.per_step for e in plan.events]
    events = plan.initial_events().astype(np.int64)
    held = list(range(workers))   # worker w's next task index; None: it left
    while True:
        limit = last()
        ready = []
        for w, index in enumerate(held):
            if index is None:
                continue
            if index > limit:
                held[w] = None
                continue
            step, k = divmod(index, n)
            if all(events[e] >= per_step[e] * (step + 1) for e in plan.waits[k]):
                ready.append(w)
        if not ready:
            assert all(h is None for h in held), f"deadlock: every worker waits ({held})"
            return
        w = ready[rng.integers(len(ready))]
        step, k = divmod(held[w], n)
        execute(step, k)
        for e in plan.signals[k]:
            events[e] += 1
        held[w] += workers


class Slots:
    """A plan's device weight slots over the graph's weights (`self.plan`, `self.w`: name -> float32 array),
    the residual-stream rows of its kinds (`self.buf`: family -> per-layer arrays) and its kinds' epilogues."""

    def layer(self, layer, slot):
        """The device's weight slot of a layer (None: the kernel's own): the rows of the graph weight the plan
        binds to it (a part of a fused weight: its rows of it), or None where it binds none."""
        bound = self.plan.weight(slot, layer)
        if bound is None:
            return None
        return self.w[bound.name][bound.row:bound.row + self.s.slot_shape(slot)[0]]

    def stream(self, kind, role, layer):
        """The residual-stream row (of every step row, where the buffers have rows) that the kind's body reads
        or writes as `role` at a task's layer, or None."""
        found = self.plan.op_of(kind).stream(role)
        return None if found is None else self.buf[found[0]][layer + found[1]]

    def epilogue(self, kind, **inputs):
        """The kind's layer-op epilogue, rounded to the model's dtype as the generated bodies round it."""
        k = self.plan.op_of(kind)
        return evaluate_op(k.op, k.attr_dict, inputs, self.s.dtype)

"""Memory planning: a shared-memory offset for every tile of a block graph.

A tile is live over a range of epochs of the schedule (the stretches between barriers, see
`mdsl.passes.schedule`): from the epoch that writes it to the last epoch that reads it. Input tiles
are written in the load epoch; those loaded once for the whole loop (no fmap), accumulators and
scratch tiles stay live over the whole loop, accumulators until their last use after it, and output
tiles until the store. Two tiles whose epoch ranges do not overlap may share bytes: a barrier
separates the last read of one from the first write of the other. (A loop iteration's tiles are dead
by the barrier that closes it, so sharing within an iteration is safe from one iteration to the next.)

Packing is interval colouring with sizes: each of a few greedy strategies (first-fit or best-fit,
tiles taken largest first or earliest first) places every tile at the lowest (first-fit) or tightest
(best-fit) 16-byte aligned gap among the tiles it overlaps in time, and the smallest total wins.
"""
from __future__ import annotations

import attrs

from mdsl.errors import ValidationError
from mdsl.ir.dump import dump_ir
from mdsl.ir.graph import BlockGraph
from mdsl.ir.validate import SMEM_LIMIT_BYTES
from mdsl.passes.layout import LayoutPlan, scratch_tiles
from mdsl.passes.plan_dump import dump_plan
from mdsl.passes.schedule import LOAD_EPOCH, Schedule

ALIGN = 16


class SharedMemoryError(ValidationError):
    """A block's tiles do not fit in shared memory even after reuse."""


@attrs.frozen
class Lifetime:
    name: str
    size: int      # bytes, a multiple of ALIGN
    start: int     # first epoch that writes it
    end: int       # last epoch that reads it

    def overlaps(self, other: "Lifetime") -> bool:
        return self.start <= other.end and other.start <= self.end


@attrs.frozen
class MemoryPlan:
    offsets: dict        # tile name -> byte offset in the block's dynamic shared memory
    total: int           # bytes the block needs
    strategy: str        # the packing that won
    lifetimes: tuple     # Lifetime of each tile
    stages: int = 1      # copies of each pipelined input tile (see `plan_memory`)
    slot_bytes: dict = attrs.field(factory=dict)  # pipelined input tile name -> bytes from one copy to the next

    def __str__(self) -> str:
        lines = [f"  %{t.name}: [{self.offsets[t.name]}, {self.offsets[t.name] + t.size}) live in epochs "
                 f"{t.start}..{t.end}" for t in self.lifetimes]
        pipeline = f", inputs {self.stages} deep" if self.slot_bytes else ""
        return f"memory: {self.total} bytes ({self.strategy}{pipeline})\n" + "\n".join(lines)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pipelined_inputs(bg: BlockGraph, stages: int) -> list:
    """Names of the inputs whose tiles a pipeline `stages` deep keeps several copies of: those loaded
    anew each iteration (an fmap), when the loop has more than one iteration."""
    if stages <= 1 or bg.forloop <= 1:
        return []
    return [inp.var.name for inp in bg.inputs if inp.fmap is not None]


def lifetimes(bg: BlockGraph, schedule: Schedule, layout: LayoutPlan, stages: int = 1,
              in_registers: frozenset = frozenset()) -> list:
    """Each tile's live epochs; tiles nothing reads (unused inputs) get none, nor do the tiles a backend
    keeps in registers instead (`in_registers`). With `stages` > 1, each per-iteration input tile is
    `stages` copies, live over the whole loop (the copies for the next iterations are written while
    this one computes)."""
    epoch = schedule.epoch_of()
    start = {inp.var.name: LOAD_EPOCH for inp in bg.inputs}
    end: dict = {}
    for i, node in enumerate(bg.nodes):
        for v in node.inputs:
            end[v.name] = max(end.get(v.name, LOAD_EPOCH), epoch[i])
        for v in node.outputs:
            start[v.name] = epoch[i]
            end.setdefault(v.name, epoch[i])
    for inp in bg.inputs:
        if inp.fmap is None and inp.var.name in end:
            end[inp.var.name] = schedule.loop_end_epoch  # loaded once, read by every iteration
    for i in schedule.hoisted:
        for v in bg.nodes[i].outputs:   # computed once before the loop, read by every iteration
            end[v.name] = max(end[v.name], schedule.loop_end_epoch)
    for node in bg.nodes:
        if node.opdef.is_accumulator:  # starts empty before the loop, finalized after it
            start[node.output.name] = LOAD_EPOCH
            end[node.output.name] = max(end[node.output.name], schedule.finalize_epoch)
    for o in bg.outputs:
        end[o.var.name] = schedule.store_epoch
    for name in scratch_tiles(bg):
        start[name], end[name] = LOAD_EPOCH, schedule.loop_end_epoch
    copies = dict.fromkeys(pipelined_inputs(bg, stages), stages)
    for name in copies:
        if name in end:
            end[name] = max(end[name], schedule.loop_end_epoch)
    return [Lifetime(name, copies.get(name, 1) * _aligned(layout.tiles[name].nbytes), start[name], end[name])
            for name in layout.tiles if name in end and name not in in_registers]


def _place(order: list, best_fit: bool) -> dict:
    offsets: dict = {}
    placed: list = []
    for t in order:
        busy = sorted((offsets[p.name], offsets[p.name] + p.size) for p in placed if p.overlaps(t))
        gaps, cursor = [], 0
        for lo, hi in busy:
            if lo - cursor >= t.size:
                gaps.append((lo - cursor, cursor))
            cursor = max(cursor, hi)
        gaps.append((float("inf"), cursor))  # above everything
        offsets[t.name] = min(gaps)[1] if best_fit else min(g[1] for g in gaps)
        placed.append(t)
    return offsets


_STRATEGIES = {
    "first-fit, largest first": (lambda t: (-t.size, t.start), False),
    "best-fit, largest first": (lambda t: (-t.size, t.start), True),
    "first-fit, earliest first": (lambda t: (t.start, -t.size), False),
    "best-fit, earliest first": (lambda t: (t.start, -t.size), True),
}


def plan_memory(bg: BlockGraph, schedule: Schedule, layout: LayoutPlan, *,
                limit: int = SMEM_LIMIT_BYTES, stages: int = 1, in_registers: frozenset = frozenset()) -> MemoryPlan:
    """Offsets for the tiles; `stages` > 1 plans a pipeline of that depth (`pipelined_inputs`); the
    tiles named in `in_registers` get no memory (the backend keeps those values in registers)."""
    tiles = lifetimes(bg, schedule, layout, stages, in_registers)
    slot_bytes = {name: _aligned(layout.tiles[name].nbytes) for name in pipelined_inputs(bg, stages)
                  if any(t.name == name for t in tiles)}
    best = None
    for strategy, (key, best_fit) in _STRATEGIES.items():
        offsets = _place(sorted(tiles, key=key), best_fit)
        total = max((offsets[t.name] + t.size for t in tiles), default=0)
        if best is None or total < best.total:
            best = MemoryPlan(offsets, total, strategy, tuple(tiles), stages if slot_bytes else 1, slot_bytes)
    if best.total > limit:
        largest = sorted(tiles, key=lambda t: -t.size)[:3]
        shown = ", ".join(f"%{t.name} {layout.tiles[t.name]} ({t.size / 1024:.1f} KB)" for t in largest)
        raise SharedMemoryError(
            f"the block's tiles need {best.total / 1024:.1f} KB of shared memory, over the {limit // 1024} KB "
            f"limit (largest: {shown})",
            hint="split the work across more blocks (a larger grid) or more for-loop iterations")
    dump_ir("memory", bg)
    dump_plan("memory", best)
    return best

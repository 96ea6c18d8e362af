"""The lowered form of a custom kernel: its block graph's lowering (mdsl.lowering.block) and what the
kernel does, in order, as a tuple of steps that each backend writes out step by step
(mdsl.backend.cuda.block, mdsl.backend.ptx.block).

Every kernel first has its tiles in shared memory and, launched to overlap its predecessor and not a
skinny loop (which prefetches its first weights before it waits), waits for that predecessor before it
touches device memory; then each block finds its parts of the device tensors (`CustomKernel.parts`) from
its grid coordinates (imap and omap). Then one of three loops:

    skinny: the skinny loop (mdsl.lowering.skinny); each post-loop stage; the outputs stored
    streamed: each thread folds its accumulator elements over the loop from device memory; barrier;
        each post-loop stage; the outputs stored
    tiles:
    accumulators start empty (in registers: zeroed fragments or row registers); loop-invariant tiles
    are loaded; hoisted stages (barrier first)
    pipelined: iterations 0 .. depth-2's tiles are issued (cp.async), one commit group each
    for each of the `forloop` iterations:
        pipelined: iteration it+depth-1's tiles are issued (after the barrier below where the loop ends
        in row registers); wait for iteration it's group
        else: the iteration's input tiles are loaded
        barrier
        each loop stage (accumulator updates included); barrier, but after trailing stages in registers
    accumulators that need it are finalized, sums in registers stored to their tiles; barrier
    each post-loop stage; barrier
    the output tiles are stored where their omap puts them

The copy into a ring slot is issued one iteration after the slot was last read, behind a barrier every
thread passed after reading it, so a slot is never overwritten while read; where the loop's last stages
are in registers, the next copies go behind the barrier that opens an iteration, so that one barrier an
iteration is enough.

A split and its combine that run as one kernel (mdsl.lowering.onelaunch) are two such kernels,
`OneLaunchKernel`: the split's steps, the block's arrival at its group's counter, then in the group's last
block the combine's steps, its block index the group's.
"""
from __future__ import annotations

import attrs

from mdsl.ir.graph import BlockGraph, Node
from mdsl.lowering.block import Lowered, lower
from mdsl.lowering.onelaunch import SplitPair
from mdsl.lowering.options import OVERLAP_MIN_ARCH, CudaOptions, arch_number
from mdsl.lowering.rows import trailing_stages

#: accumulators whose running value needs a last step after the loop (the mean's division, the rms's root)
FINALIZED = frozenset({"accum_mean", "accum_rms"})

# how a node of a stage is lowered
TILES = "tiles"      # by its op's rule, on shared-memory tiles
ROWS = "rows"        # in the registers of the warps owning its rows (mdsl.lowering.rows)
FOLDED = "folded"    # an accumulator whose matmul folds its product into the sum's registers


@attrs.frozen
class Stage:
    """A stage of the schedule: its nodes, each with how it is lowered, and whether a barrier follows."""

    nodes: tuple      # (node index, TILES / ROWS / FOLDED)
    barrier: bool = True


@attrs.frozen
class SkinnyLoop:
    """The skinny loop (the plan is `Lowered.skinny`): the weights streamed, the sums met in the tiles."""


@attrs.frozen
class StreamedLoop:
    nodes: tuple      # the accumulators each thread folds over the loop from device memory


@attrs.frozen
class Barrier:
    pass


@attrs.frozen
class InitAccumulators:
    nodes: tuple      # (node index, whether in the registers of the warps owning its rows)


@attrs.frozen
class RegisterAccumulators:
    pairs: tuple      # (accum index, matmul index): sums kept in the matmul's mma fragments, zeroed


@attrs.frozen
class LoadOnce:
    inputs: tuple     # loop-invariant block inputs, each loaded into its tile


@attrs.frozen
class Hoisted:
    stages: tuple     # Stage: the loop-invariant nodes, once before the loop (a barrier first)


@attrs.frozen
class Prologue:
    inputs: tuple     # the per-iteration inputs whose tiles are issued for the first iterations
    ahead: int        # iterations issued before the loop (the pipeline's depth - 1)


@attrs.frozen
class Loop:
    forloop: int
    depth: int        # the pipeline's depth (copies of each per-iteration tile)
    inputs: tuple     # the per-iteration block inputs, loaded (or issued) each iteration
    rings: tuple      # names of the inputs copied ahead into rings of `depth` slots (empty: loaded in turn)
    issue_late: bool  # the next copies issued behind the barrier that opens an iteration
    stages: tuple     # Stage


@attrs.frozen
class Finish:
    """After the loop: the pipeline drained, accumulators finalized, sums in registers stored to tiles."""

    pipelined: bool
    finalized: tuple          # accumulator indices whose rule's `finalize` runs
    register_stores: tuple    # (accum index, matmul index): fragments stored to the accumulator's tile
    row_stores: tuple         # accumulator indices in row registers, stored to their tiles
    barrier: bool


@attrs.frozen
class StoreOutputs:
    pass


@attrs.frozen
class CustomKernel:
    """A custom node's kernel as both backends write it."""

    body: BlockGraph        # the block graph (with the block size the options ask for)
    lowered: Lowered
    overlap: bool           # launched to overlap its predecessor (programmatic dependent launch)
    waits_first: bool       # waits for its predecessor before anything else (not a skinny loop)
    parts: tuple            # the block inputs whose part of the device tensor the kernel addresses
    steps: tuple

    @property
    def grid(self) -> tuple:
        return self.body.grid

    @property
    def threads(self) -> int:
        return self.body.threads

    @property
    def smem_bytes(self) -> int:
        return self.lowered.smem_bytes


@attrs.frozen
class OneLaunchKernel:
    """A split and its combine as one kernel (mdsl.lowering.onelaunch): K1's kernel on K1's grid and threads,
    then, in the last block of each group to arrive, K2's kernel as the group's K2 block. K2 never waits for
    a previous kernel (K1's wait, where it overlaps its predecessor, covers the launch)."""

    pair: SplitPair
    first: CustomKernel
    second: CustomKernel

    @property
    def grid(self) -> tuple:
        return self.first.grid

    @property
    def threads(self) -> int:
        return self.first.threads

    @property
    def smem_bytes(self) -> int:
        """K2's tiles reuse K1's shared memory (after the barrier that tells the block it combines)."""
        return max(self.first.smem_bytes, self.second.smem_bytes)

    @property
    def overlap(self) -> bool:
        return self.first.overlap


def _stage(lowered: Lowered, stage, rows: bool = False, barrier: bool = True) -> Stage:
    def how(i: int) -> str:
        if i in lowered.register_accumulated:
            return FOLDED
        if rows and lowered.rows is not None and i in lowered.rows.nodes:
            return ROWS
        return TILES

    return Stage(tuple((i, how(i)) for i in stage.nodes), barrier)


def lower_custom(node: Node, options: CudaOptions, arch: str) -> CustomKernel:
    """The kernel of a custom node for `arch` (sm_90a) with the fast paths `options` allows."""
    arch_n = arch_number(arch)
    bg = node.body if options.threads is None else attrs.evolve(node.body, threads=options.threads)
    lowered = lower(bg, tuple(v.type for v in node.inputs), options, arch_n, skinny=options.skinny)
    overlap = options.overlap and arch_n >= OVERLAP_MIN_ARCH
    schedule, memory = lowered.schedule, lowered.memory
    tiles = {t.name for t in memory.lifetimes}
    in_rows = lowered.rows.nodes if lowered.rows is not None else frozenset()
    streamed = lowered.streamed or ()
    read = {v.name for i in streamed for v in bg.nodes[i].inputs}   # from device memory
    if lowered.skinny is not None:   # every input streamed from device memory
        read = {inp.var.name for inp in bg.inputs}
    parts = tuple(inp for inp in bg.inputs if inp.var.name in tiles or inp.var.name in read)
    post = tuple(_stage(lowered, stage) for stage in schedule.post)
    if lowered.skinny is not None:
        steps: tuple = (SkinnyLoop(), *post, StoreOutputs())
    elif streamed:
        steps = (StreamedLoop(tuple(streamed)), Barrier(), *post, StoreOutputs())
    else:
        steps = _tile_loop(bg, lowered, parts, in_rows) + (*post, StoreOutputs())
    return CustomKernel(bg, lowered, overlap, overlap and lowered.skinny is None, parts, steps)


def lower_pair(graph, pair: SplitPair, options: CudaOptions, arch: str) -> OneLaunchKernel:
    """The one kernel of a split and its combine (`pair`, of the kernel graph `graph`)."""
    first, second = graph.nodes[pair.first], graph.nodes[pair.second]
    return OneLaunchKernel(pair, lower_custom(first, options, arch), lower_custom(second, options, arch))


def _tile_loop(bg: BlockGraph, lowered: Lowered, parts: tuple, in_rows: frozenset) -> tuple:
    schedule, memory = lowered.schedule, lowered.memory
    per_iteration = tuple(inp for inp in parts if inp.fmap is not None)
    accumulators = tuple((i, i in in_rows) for i, n in enumerate(bg.nodes) if n.opdef.is_accumulator)
    steps = [InitAccumulators(accumulators), RegisterAccumulators(tuple(lowered.register_accumulated.items())),
             LoadOnce(tuple(inp for inp in parts if inp.fmap is None))]
    if schedule.pre:
        steps.append(Hoisted(tuple(_stage(lowered, stage) for stage in schedule.pre)))
    rings = tuple(inp.var.name for inp in per_iteration if inp.var.name in memory.slot_bytes)
    if rings:
        steps.append(Prologue(per_iteration, memory.stages - 1))
    free = trailing_stages(schedule, lowered.rows)
    issue_late = bool(rings) and free > 0 and len(rings) == len(per_iteration)
    barrier_free = set(range(len(schedule.loop) - free, len(schedule.loop)))
    if not issue_late:
        barrier_free.discard(len(schedule.loop) - 1)   # the last stage's barrier closes the iteration
    loop = tuple(_stage(lowered, stage, rows=True, barrier=k not in barrier_free)
                 for k, stage in enumerate(schedule.loop))
    steps.append(Loop(bg.forloop, memory.stages, per_iteration, rings, issue_late, loop))
    finalized = tuple(i for i, acc in enumerate(bg.nodes) if acc.opdef.is_accumulator and i not in in_rows
                      and i not in lowered.register_accumulated and acc.op in FINALIZED)
    register_stores = tuple(lowered.register_accumulated.items())
    row_stores = tuple(lowered.rows.accumulators(bg)) if lowered.rows is not None else ()
    steps.append(Finish(bool(rings), finalized, register_stores, row_stores,
                        bool(finalized or register_stores or row_stores)))
    return tuple(steps)


def step_types() -> tuple:
    """Every kind of step a kernel may have (each backend writes each)."""
    return (SkinnyLoop, StreamedLoop, Barrier, InitAccumulators, RegisterAccumulators, LoadOnce, Hoisted,
            Prologue, Loop, Finish, StoreOutputs)

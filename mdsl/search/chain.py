"""What one block of a tile loop does in series, from the lowering both backends write
(mdsl.lowering.block): for an iteration and for the work done once (hoisted before the loop, finalized
and run after it), the barrier-separated stages, the elements of tile ops that one thread computes and
the steps of a warp's chain of dependent mma.sync; and how deep the per-iteration copies are pipelined.
The GPU-aware estimate (`mdsl.search.cost.gpu_estimate`) prices them.

A stage's nodes run on all the block's threads, one after another, and a barrier closes the stage
(mdsl.passes.schedule), but the trailing stages wholly in the registers of the warps owning their rows
(mdsl.lowering.rows), and an iteration opens with the barrier after its copies. A tile op spreads its
elements over the block's threads; a row-resident one gives each warp its 16-row tiles (a lane holds half
a row tile's columns), so that with fewer row tiles than warps some warps idle. A matmul on tensor cores
(mdsl.lowering.mma) deals C's 16 x 8 tiles to the warps, each walking all of K in steps of 16, every step
adding to the one before; a row-resident one gives each warp whole row tiles, its column groups
independent chains along K. An accumulator the matmul sums into its registers costs nothing of its own.
"""
from __future__ import annotations

import math

import attrs

from mdsl.errors import MdslError
from mdsl.ir.graph import BlockGraph, Node
from mdsl.ir.validate import shared_memory_peak
from mdsl.lowering.block import lower
from mdsl.lowering.options import CudaOptions
from mdsl.lowering.rows import trailing_stages
from mdsl.passes.schedule import matmul_accumulators, schedule_block_graph

WARP = 32
MMA_M, MMA_N, MMA_K = 16, 8, 16


@attrs.frozen
class Work:
    """Serial work of one block: what its busiest thread and warp do one after another."""

    stages: int = 0       # barrier-separated stages
    elements: int = 0     # elements of tile ops one thread computes
    mma_steps: int = 0    # dependent mma.sync steps of the busiest warp
    flops: int = 0        # the block's matmul flops (the tensor cores' share of the SM bounds them too)

    def __add__(self, other: "Work") -> "Work":
        return Work(self.stages + other.stages, self.elements + other.elements, self.mma_steps + other.mma_steps,
                    self.flops + other.flops)


@attrs.frozen
class TileLoop:
    depth: int            # copies of each per-iteration input tile (1: each iteration loads, then computes)
    waits: bool           # an iteration waits for its copies (a tile loop without a pipeline: not a loop
                          # whose threads fold their elements straight from device memory)
    smem_bytes: int       # shared memory of one block
    iteration: Work       # every iteration
    once: Work            # hoisted before the loop, and after it: accumulators finalized, post-loop stages


def tile_loop(node: Node, stages: int) -> TileLoop:
    """The serial work of a custom node's tile loop with up to `stages` pipelined copies, as the CUDA
    backend lowers it. Where the backend cannot lower it (its tiles do not fit), as the schedule has it,
    its matmuls on tensor cores, loaded then computed, in the shared memory of its tiles' peak."""
    graph: BlockGraph = node.body
    try:
        lowered = lower(graph, tuple(v.type for v in node.inputs), CudaOptions(stages=stages))
    except MdslError:
        return _unlowered(graph)
    schedule, rows = lowered.schedule, lowered.rows
    warps = max(1, graph.threads // WARP)

    def work(stage_list) -> Work:
        total = Work()
        for stage in stage_list:
            for index in stage.nodes:
                if index not in lowered.register_accumulated:
                    total += _node_work(graph, index, lowered.mma, rows, warps)
        return total

    loop = work(schedule.loop)
    in_registers = trailing_stages(schedule, rows)
    opening = 1 if schedule.loop else 0   # the barrier after the iteration's copies
    barriers = 1 if lowered.streamed is not None else opening + len(schedule.loop) - in_registers
    once = work(schedule.pre) + work(schedule.post)
    streamed = lowered.streamed is not None
    depth = 1 if streamed else lowered.memory.stages
    return TileLoop(depth, depth == 1 and not streamed, lowered.smem_bytes, attrs.evolve(loop, stages=barriers),
                    attrs.evolve(once, stages=len(schedule.pre) + len(schedule.post) + 1))


def _unlowered(graph: BlockGraph) -> TileLoop:
    fused = matmul_accumulators(graph)
    schedule = schedule_block_graph(graph, fused_accumulators=tuple(fused), hoist=True)
    mma = {n.outputs[0].name for n in graph.nodes if n.op == "matmul"}
    warps = max(1, graph.threads // WARP)

    def work(stage_list) -> Work:
        return sum((_node_work(graph, i, mma, None, warps) for stage in stage_list for i in stage.nodes
                    if i not in schedule.fused), Work())

    loop = attrs.evolve(work(schedule.loop), stages=1 + len(schedule.loop))
    once = attrs.evolve(work(schedule.pre) + work(schedule.post), stages=len(schedule.pre) + len(schedule.post) + 1)
    return TileLoop(1, True, shared_memory_peak(graph), loop, once)


def _node_work(graph: BlockGraph, index: int, mma, rows, warps: int) -> Work:
    """`mma`: the names of the products on tensor cores; `rows`: the row-resident plan (or None)."""
    node = graph.nodes[index]
    in_rows = rows is not None and index in rows.nodes
    if node.op == "matmul":
        a, out = node.inputs[0], node.outputs[0]
        m, k = a.shape[-2:]
        n, batch = out.shape[-1], math.prod(out.shape[:-2])
        flops = 2 * math.prod(out.shape) * k
        if out.name not in mma:   # the scalar FMA loop: each thread its share of the products
            return Work(elements=-(-math.prod(out.shape) * k // graph.threads), flops=flops)
        chain = -(-k // MMA_K)
        if in_rows:
            return Work(mma_steps=rows.geometry.rt * chain, flops=flops)
        tiles = batch * -(-m // MMA_M) * -(-n // MMA_N)
        return Work(mma_steps=-(-tiles // warps) * chain, flops=flops)
    numel = max(math.prod(v.shape) for v in (*node.inputs, *node.outputs))
    if in_rows:
        g = rows.geometry
        columns = numel // max(1, g.batch * g.rows)
        return Work(elements=g.rt * -(-columns * MMA_M // WARP))
    return Work(elements=-(-numel // graph.threads))

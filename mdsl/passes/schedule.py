"""Operator scheduling: the order in which a block graph's nodes run, and where the block must wait.

Nodes of a block run one after another on all the block's threads, each writing a shared-memory
tile; a node that reads a tile written by another thread needs a barrier (`__syncthreads()`) between
the two. As in Mirage, nodes are grouped into *stages* by depth (the longest chain of tile producers
leading to them, ASAP): the nodes of one stage are independent, so they run back to back with no
barrier between them, and a barrier follows each stage (each stage reads a tile of the one before,
by the definition of depth). The number of barriers is then the depth of the graph, the fewest any
order can have.

The block's timeline, in *epochs* (the stretches between barriers), is fixed around the stages:

    epoch 0                 input tiles loaded (loop-invariant ones once, before the first iteration)
    ---- barrier
    pre stages              (hoisted) loop-invariant nodes, once: each followed by a barrier
    loop stages             the loop body and the accumulator updates, every iteration
    ---- barrier            (closes the iteration: the next one's loads overwrite its tiles)
    finalize                accumulators that need a last step (mean, rms) take it
    ---- barrier
    post stages             the nodes after the loop
    ---- barrier
    store                   output tiles written to device memory
"""
from __future__ import annotations

from typing import Optional

import attrs

from mdsl.ir.dump import dump_ir
from mdsl.ir.graph import BlockGraph
from mdsl.passes.plan_dump import dump_plan

LOAD_EPOCH = 0


@attrs.frozen
class Stage:
    nodes: tuple     # indices into the block graph's nodes, independent of each other
    epoch: int       # the stretch between barriers the stage runs in; a barrier follows it


@attrs.frozen
class Schedule:
    loop: tuple      # Stages of the for-loop body (accumulator updates included)
    post: tuple      # Stages after the loop
    fused: tuple = ()  # accumulators updated by their matmul in its stage (see `schedule_block_graph`)
    pre: tuple = ()  # Stages of loop-invariant nodes hoisted before the loop (`hoist=True`)

    @property
    def loop_end_epoch(self) -> int:
        return self.loop[-1].epoch if self.loop else self.pre[-1].epoch if self.pre else LOAD_EPOCH

    @property
    def finalize_epoch(self) -> int:
        return self.loop_end_epoch + 1

    @property
    def store_epoch(self) -> int:
        return (self.post[-1].epoch if self.post else self.finalize_epoch) + 1

    @property
    def order(self) -> list:
        return [i for stage in (*self.pre, *self.loop, *self.post) for i in stage.nodes]

    def epoch_of(self) -> dict:
        """Node index -> the epoch it runs in."""
        return {i: stage.epoch for stage in (*self.pre, *self.loop, *self.post) for i in stage.nodes}

    @property
    def hoisted(self) -> frozenset:
        return frozenset(i for stage in self.pre for i in stage.nodes)

    @property
    def barriers_per_iteration(self) -> int:
        return 1 + len(self.loop)  # the one after the loads, then one per stage

    def __str__(self) -> str:
        def show(stages):
            return "".join(f"    epoch {s.epoch}: nodes {list(s.nodes)}\n" for s in stages)
        hoisted = f"  hoisted before the loop:\n{show(self.pre)}" if self.pre else ""
        return (f"schedule: {self.barriers_per_iteration} barrier(s) per iteration\n{hoisted}  loop (after the loads, "
                f"epoch {LOAD_EPOCH}):\n{show(self.loop)}  after the loop (finalize: epoch {self.finalize_epoch}):\n"
                f"{show(self.post)}  store: epoch {self.store_epoch}")


#: accumulators whose running value a backend can keep where a matmul computes its product
REGISTER_ACCUMULATORS = ("accum", "accum_rescale")


def matmul_accumulators(bg: BlockGraph) -> dict:
    """Accumulator node index -> index of the matmul whose product it folds (a plain sum, or online
    softmax's rescaled sum), where the product is read by nothing else and is no block output: a
    backend may keep such a running value where the matmul computes it (the tensor cores' registers)
    and never store the product as a tile."""
    users: dict = {}
    for i, node in enumerate(bg.nodes):
        for v in node.inputs:
            users.setdefault(v.name, []).append(i)
    producer = {v.name: i for i, node in enumerate(bg.nodes) for v in node.outputs}
    kept = {o.var.name for o in bg.outputs}
    out = {}
    for i, node in enumerate(bg.nodes):
        if node.op not in REGISTER_ACCUMULATORS:
            continue
        source = node.inputs[0].name
        j = producer.get(source)
        if j is not None and bg.nodes[j].op == "matmul" and users[source] == [i] and source not in kept:
            out[i] = j
    return out


def loop_invariant_nodes(bg: BlockGraph) -> list:
    """Indices of the loop body's nodes whose value is the same every iteration: no accumulator, and
    every input a tile loaded once (no fmap) or such a node's value. With a loop of one iteration
    there is nothing to gain."""
    if bg.forloop <= 1:
        return []
    post_vars = bg.post_loop_vars()
    invariant = {i.var.name for i in bg.inputs if i.fmap is None}
    out = []
    for i, node in enumerate(bg.nodes):
        if node.opdef.is_accumulator or any(v.name in post_vars for v in node.outputs):
            continue
        if all(v.name in invariant for v in node.inputs):
            invariant.update(v.name for v in node.outputs)
            out.append(i)
    return out


def schedule_block_graph(bg: BlockGraph, *, fused_accumulators: tuple = (), hoist: bool = False) -> Schedule:
    """`fused_accumulators`: indices of accumulators (from `matmul_accumulators`) whose update their
    matmul does as it computes; they run in the matmul's stage, so they cost no stage of their own.
    One whose other operands (a rescale's maximum) are not ready by then is not fused; the schedule's
    `fused` says which are. `hoist`: the loop-invariant nodes (`loop_invariant_nodes`) run once, in
    stages before the loop, instead of every iteration."""
    post_vars = bg.post_loop_vars()
    in_post = [any(v.name in post_vars for v in n.outputs) and not n.opdef.is_accumulator for n in bg.nodes]
    fused = {i: j for i, j in matmul_accumulators(bg).items() if i in set(fused_accumulators)}
    hoisted = set(loop_invariant_nodes(bg)) if hoist else set()
    pre = _stages(sorted(hoisted), bg, first_epoch=LOAD_EPOCH + 1)
    loop_start = (pre[-1].epoch if pre else LOAD_EPOCH) + 1
    loop = _stages([i for i, p in enumerate(in_post) if not p and i not in hoisted], bg, first_epoch=loop_start,
                   same_stage=fused)
    loop_end = loop[-1].epoch if loop else LOAD_EPOCH
    post = _stages([i for i, p in enumerate(in_post) if p], bg, first_epoch=loop_end + 2)
    stage_of = {i: s.epoch for s in loop for i in s.nodes}
    schedule = Schedule(tuple(loop), tuple(post), tuple(i for i, j in fused.items() if stage_of[i] == stage_of[j]),
                        tuple(pre))
    dump_ir("schedule", attrs.evolve(bg, nodes=[bg.nodes[i] for i in schedule.order]))
    dump_plan("schedule", schedule)
    return schedule


def _stages(indices: list, bg: BlockGraph, first_epoch: int, same_stage: Optional[dict] = None) -> list:
    """ASAP stages of the given nodes; values they did not produce are ready when the phase starts.
    A node in `same_stage` (index -> index of another node) runs in that node's stage."""
    same_stage = same_stage or {}
    producer = {v.name: i for i in indices for v in bg.nodes[i].outputs}
    depth: dict = {}
    for i in indices:  # the nodes are in a topological order
        ready = 1 + max((depth[producer[v.name]] for v in bg.nodes[i].inputs if v.name in producer), default=-1)
        partner = same_stage.get(i)
        others = [v for v in bg.nodes[i].inputs if partner is not None and v not in bg.nodes[partner].outputs]
        if partner is not None and all(depth[producer[v.name]] < depth[partner] for v in others if v.name in producer):
            ready = depth[partner]   # its other operands are ready before the partner's stage
        depth[i] = ready
    levels = range(max(depth.values(), default=-1) + 1)
    return [Stage(tuple(i for i in indices if depth[i] == d), first_epoch + d) for d in levels]

"""The kernel of a graph-defined (`custom`) op as LLVM IR: its block graph after the same passes as
the CUDA backend's (mdsl/backend/cuda/block.py: `lower` runs schedule, layout and memory planning),
following the same timeline:

    accumulators start empty; loop-invariant input tiles are loaded
    for each of the `forloop` iterations:
        the iteration's input tiles are loaded; barrier
        each loop stage (accumulator updates included); barrier
    accumulators that need it are finalized; barrier
    each post-loop stage; barrier
    the output tiles are stored where their omap puts them
"""
from __future__ import annotations

import math

from mdsl.backend.ptx.llvm import I8, Array, KernelFunction, i32
from mdsl.backend.ptx.loops import Threads
from mdsl.ir.graph import BlockGraph, Node
from mdsl.passes.layout import scratch_name, select_layout
from mdsl.passes.memory import SharedMemoryError, plan_memory
from mdsl.passes.schedule import schedule_block_graph

_AXES = "xyz"
COPY_BATCH = 8   # vectors a thread copies at once (CUDA's copy loop is unrolled to the same effect)


class BlockKernel:
    """What an op rule sees while writing block-level code: the kernel function, the block's
    threads, the loop counter (inside the loop) and the shared-memory tile of every value."""

    def __init__(self, fn: KernelFunction, smem, bg: BlockGraph, layout, memory):
        self.fn = fn
        self.bg = bg
        self.threads = Threads(bg.threads)
        self.loop_counter = None
        self.layout = layout
        self.tiles: dict = {}
        for t in memory.lifetimes:
            tile = layout.tiles[t.name]
            ptr = fn.b.gep(smem, [i32(memory.offsets[t.name])], inbounds=True, source_etype=I8)
            self.tiles[t.name] = Array(ptr, tile.dtype.name, tile.shape, tile.strides)

    def tile(self, var) -> Array:
        return self.tiles[var.name]

    def scratch(self, node: Node) -> Array:
        return self.tiles[scratch_name(node)]


def lower(bg: BlockGraph, tensor_types: tuple) -> tuple:
    """The schedule, layout and memory plan of a block graph (the passes' plain plan: no pipelined
    inputs, every tile in shared memory): its tiles computed in f32 where they fit, else in their own
    dtypes."""
    schedule = schedule_block_graph(bg)
    for wide in (True, False):
        layout = select_layout(bg, tensor_types, wide=wide)
        try:
            return schedule, layout, plan_memory(bg, schedule, layout)
        except SharedMemoryError:
            if not wide:
                raise
    raise AssertionError("unreachable")


def emit_custom(program, index: int, node: Node) -> None:
    bg = node.body
    schedule, layout, memory = lower(bg, tuple(v.type for v in node.inputs))
    with program.kernel(index, node, grid=bg.grid, threads=bg.threads, smem=memory.total) as scope:
        fn = scope.fn
        bk = BlockKernel(fn, fn.shared_pointer(program.mb.dynamic_smem()), bg, layout, memory)
        parts = {inp.var.name: _input_part(bk, inp, tensor)
                 for inp, tensor in zip(bg.inputs, scope.inputs) if inp.var.name in bk.tiles}  # the inputs read
        loaded = [inp for inp in bg.inputs if inp.var.name in parts]
        accumulators = [n for n in bg.nodes if n.opdef.is_accumulator]
        for acc in accumulators:
            _rule(acc).init(bk, acc)
        for inp in loaded:
            if inp.fmap is None:
                _load(bk, inp, parts[inp.var.name])
        with fn.loop(i32(0), bg.forloop, 1) as it:
            bk.loop_counter = it
            for inp in loaded:
                if inp.fmap is not None:
                    _load(bk, inp, parts[inp.var.name])
            fn.barrier()
            for stage in schedule.loop:
                _stage(bk, stage)
        bk.loop_counter = None
        finishing = [acc for acc in accumulators if _rule(acc).finalize is not None]
        for acc in finishing:
            fn.marker_for(acc)
            _rule(acc).finalize(bk, acc)
        if finishing:
            fn.barrier()
        for stage in schedule.post:
            _stage(bk, stage)
        for out, tensor in zip(bg.outputs, scope.outputs):
            _copy_loop(bk, _part(bk, tensor, out.omap, list(out.var.shape)), bk.tile(out.var), out.var.shape,
                       layout.vectors[out.var.name])


def _rule(node: Node):
    return node.opdef.rules["ptx"]


def _stage(bk: BlockKernel, stage) -> None:
    for i in stage.nodes:
        node = bk.bg.nodes[i]
        bk.fn.marker_for(node)
        rule = _rule(node)
        (rule.update if node.opdef.is_accumulator else rule.block)(bk, node)
    bk.fn.barrier()


def _part(bk: BlockKernel, tensor: Array, dim_map: tuple, extent: list) -> Array:
    """The block's part of a device tensor: slices of `extent` along the mapped dims, picked by the
    grid coordinates."""
    fn = bk.fn
    start = None
    for g, d in enumerate(dim_map):
        if d is not None:
            term = fn.b.mul(fn.sreg(f"ctaid.{_AXES[g]}"), i32(extent[d] * tensor.strides[d]))
            start = term if start is None else fn.b.add(start, term)
    return tensor if start is None else Array(fn.address(tensor, start), tensor.dtype, tensor.shape, tensor.strides)


def _input_part(bk: BlockKernel, inp, tensor: Array) -> Array:
    extent = [n * (bk.bg.forloop if d == inp.fmap else 1) for d, n in enumerate(inp.var.shape)]
    return _part(bk, tensor, inp.imap, extent)


def _copy_loop(bk: BlockKernel, dst: Array, src: Array, shape: tuple, vector: int, src_step=None) -> None:
    """Copy an array of `shape` a row at a time, in vectors of `vector` elements: each thread reads
    up to COPY_BATCH vectors before it writes them, so that its loads are in flight together."""
    fn, b = bk.fn, bk.fn.b
    shape = shape or (1,)
    space = shape[:-1] + (shape[-1] // vector,)
    n, threads = math.prod(space), bk.threads.block

    def vectors(op: Array) -> Array:
        strides = op.strides or (1,)
        return op.viewed(space, strides[:-1] + (strides[-1] * vector,))

    def batch(first, count: int, always_inside: bool) -> None:
        reads = []
        for u in range(count):
            i = first if u == 0 else b.add(first, i32(u * threads))
            inside = None if always_inside and (u + 1) * threads <= n else b.icmp_unsigned("<", i, i32(n))
            safe = i if inside is None else b.select(inside, i, i32(0))   # read an element that exists
            at = fn.offset(safe, space, vectors(src))
            if src_step is not None:
                at = b.add(at, src_step)
            reads.append((inside, safe, fn.read_vector(src, at, vector, dst.dtype)))
        for inside, i, values in reads:
            if inside is None:
                fn.write_vector(dst, fn.offset(i, space, vectors(dst)), values)
            else:
                with fn.when(inside):
                    fn.write_vector(dst, fn.offset(i, space, vectors(dst)), values)

    per_thread = -(-n // threads)
    if per_thread <= COPY_BATCH:
        batch(fn.sreg("tid.x"), per_thread, always_inside=True)
    else:
        with fn.loop(fn.sreg("tid.x"), n, threads * COPY_BATCH) as first:
            batch(first, COPY_BATCH, always_inside=False)


def _load(bk: BlockKernel, inp, part: Array) -> None:
    step = None
    if inp.fmap is not None and bk.bg.forloop > 1:
        step = bk.fn.b.mul(bk.loop_counter, i32(inp.var.shape[inp.fmap] * part.strides[inp.fmap]))
    _copy_loop(bk, bk.tile(inp.var), part, inp.var.shape, bk.layout.vectors[inp.var.name], step)


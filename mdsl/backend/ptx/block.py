"""The kernel of a graph-defined (`custom`) op as LLVM IR: its block graph lowered exactly as the CUDA
backend lowers it (`mdsl.backend.cuda.block.lower`: schedule, layout, memory plan, and the choices the
`CudaOptions` allow: block matmuls on tensor cores, `accum(matmul)` sums kept in the mma's registers,
the cp.async pipeline's depth, loop chains kept in the registers of the warps owning their rows
(`rows.py`), element-wise folding loops streamed from device memory (`streamed.py`) and loop-invariant
nodes hoisted), following the same timeline (mdsl/backend/cuda/block.py):

    streamed: each thread folds its accumulator elements over the loop from device memory; barrier;
        each post-loop stage; the outputs stored
    else:
    accumulators start empty (in registers: zeroed fragments or row registers); loop-invariant tiles
    are loaded; hoisted stages (barrier first)
    pipelined: iterations 0 .. stages-2's tiles are issued (cp.async), one commit group each
    for each of the `forloop` iterations:
        pipelined: iteration it+stages-1's tiles are issued (after the barrier below where the loop
        ends in row registers); wait for iteration it's group
        else: the iteration's input tiles are loaded
        barrier
        each loop stage (accumulator updates included); barrier, but after trailing stages in registers
    accumulators that need it are finalized, sums in registers stored to their tiles; barrier
    each post-loop stage; barrier
    the output tiles are stored where their omap puts them

The copy into a ring slot is issued one iteration after the slot was last read, behind a barrier
every thread passed after reading it, so a slot is never overwritten while read.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import attrs

from mdsl.backend.cuda.block import Lowered, lower
from mdsl.backend.cuda.mma import MmaShape
from mdsl.backend.cuda.options import OVERLAP_MIN_ARCH, arch_number
from mdsl.backend.cuda.rows import trailing_stages
from mdsl.backend.ptx.llvm import I8, ITEMSIZE, Array, KernelFunction, i32
from mdsl.backend.ptx.loops import Threads
from mdsl.backend.ptx.mma import BlockMma
from mdsl.backend.ptx.rows import RowKernel
from mdsl.backend.ptx.skinny import emit_skinny, has_rules
from mdsl.backend.ptx.streamed import emit_streamed
from mdsl.ir.graph import BlockGraph, Node
from mdsl.passes.layout import scratch_name

_AXES = "xyz"
COPY_BATCH = 8   # vectors a thread copies at once (CUDA's copy loop is unrolled to the same effect)


class BlockKernel:
    """What an op rule sees while writing block-level code: the kernel function, the block's
    threads, the loop counter (inside the loop), the shared-memory tile of every value and the
    lowering's choices (which matmuls run on tensor cores, which sums live in their registers)."""

    def __init__(self, fn: KernelFunction, smem, bg: BlockGraph, lowered: Lowered):
        self.fn = fn
        self.bg = bg
        self.threads = Threads(bg.threads, unroll=lowered.options.unroll)
        self.loop_counter = None
        self.layout = lowered.layout
        self.lowered = lowered
        self.tiles: dict = {}
        self.register_accumulators: dict = {}  # matmul output name -> (its accumulator, its fragments)
        memory = lowered.memory
        for t in memory.lifetimes:
            tile = self.layout.tiles[t.name]
            ptr = fn.b.gep(smem, [i32(memory.offsets[t.name])], inbounds=True, source_etype=I8)
            self.tiles[t.name] = Array(ptr, tile.dtype.name, tile.shape, tile.strides)

    def tile(self, var) -> Array:
        return self.tiles[var.name]

    def block_index(self, axis: int):
        """The block's coordinate along a grid axis of the block graph."""
        return self.fn.sreg(f"ctaid.{_AXES[axis]}")

    def scratch(self, node: Node) -> Array:
        return self.tiles[scratch_name(node)]

    def mma_shape(self, node: Node) -> Optional[MmaShape]:
        return self.lowered.mma.get(node.output.name)

    def block_mma(self, node: Node) -> Optional[BlockMma]:
        """The tensor-core matmul of a matmul node, or None where it keeps the scalar loop."""
        shape = self.mma_shape(node)
        return None if shape is None else BlockMma(self.fn, shape, node.inputs[0].dtype.name)


def emit_custom(program, index: int, node: Node) -> None:
    options = program.options
    bg = node.body if options.threads is None else attrs.evolve(node.body, threads=options.threads)
    types, arch = tuple(v.type for v in node.inputs), arch_number(program.arch)
    lowered = lower(bg, types, options, arch, skinny=options.skinny)
    if lowered.skinny is not None and not has_rules(bg, lowered.skinny):
        lowered = lower(bg, types, options, arch)
    schedule, memory = lowered.schedule, lowered.memory
    overlap = options.overlap and arch >= OVERLAP_MIN_ARCH
    with program.kernel(index, node, grid=bg.grid, threads=bg.threads, smem=lowered.smem_bytes,
                        overlap=overlap) as scope:
        fn = scope.fn
        smem = fn.shared_pointer(program.mb.dynamic_smem())
        bk = BlockKernel(fn, smem, bg, lowered)
        if overlap and lowered.skinny is None:   # (the skinny loop prefetches its first slabs before waiting)
            fn.wait_for_previous_kernel()   # launched to overlap it: no global memory touched before
            fn.let_next_kernel_launch()
        rk = RowKernel(bk, lowered.rows) if lowered.rows is not None else None
        in_rows = lowered.rows.nodes if lowered.rows is not None else frozenset()
        streamed = lowered.streamed or ()
        read = {v.name for i in streamed for v in bg.nodes[i].inputs}   # from device memory
        if lowered.skinny is not None:   # every input streamed from device memory
            read = {inp.var.name for inp in bg.inputs}
        parts = {inp.var.name: _input_part(bk, inp, tensor) for inp, tensor in zip(bg.inputs, scope.inputs)
                 if inp.var.name in bk.tiles or inp.var.name in read}
        if lowered.skinny is not None:
            scratch = fn.b.gep(smem, [i32(lowered.scratch_offset)], inbounds=True, source_etype=I8)
            emit_skinny(bk, bg, lowered.skinny, parts, scratch)
            for stage in schedule.post:
                _stage(bk, stage)
            _store_outputs(bk, scope)
            return
        loaded = [inp for inp in bg.inputs if inp.var.name in parts]
        per_iteration = [inp for inp in loaded if inp.fmap is not None]
        if streamed:
            emit_streamed(bk, bg, list(streamed), parts)
            fn.barrier()
            for stage in schedule.post:
                _stage(bk, stage)
            _store_outputs(bk, scope)
            return
        accumulators = [n for n in bg.nodes if n.opdef.is_accumulator]  # those in registers too: their scratch
        for acc in accumulators:
            if bg.nodes.index(acc) in in_rows:
                acc.opdef.rules["ptx_rows"].init(rk, acc)
            else:
                _rule(acc).init(bk, acc)
        in_registers = _register_accumulators(bk)
        for inp in loaded:
            if inp.fmap is None:
                _load(bk, inp, parts[inp.var.name], bk.tile(inp.var))
        if schedule.pre:   # loop-invariant nodes, once before the loop
            fn.barrier()
            for stage in schedule.pre:
                _stage(bk, stage)
        stages = memory.stages
        rings = {inp.var.name: bk.tile(inp.var) for inp in per_iteration if inp.var.name in memory.slot_bytes}
        for ahead in range(stages - 1 if rings else 0):
            _issue(bk, per_iteration, parts, rings, ahead)
        # the loop's last stages in registers need no barrier after them; then, pipelined, the next
        # copies are issued behind the barrier that opens an iteration, into the slot the last one read
        # (every thread is past it), so that one barrier an iteration is enough (as the CUDA backend)
        free = trailing_stages(schedule, lowered.rows)
        issue_late = bool(rings) and free > 0 and len(rings) == len(per_iteration)
        barrier_free = set(range(len(schedule.loop) - free, len(schedule.loop)))
        if not issue_late:
            barrier_free.discard(len(schedule.loop) - 1)   # the last stage's barrier closes the iteration
        with fn.loop(i32(0), bg.forloop, 1) as it:
            bk.loop_counter = it
            if issue_late:
                fn.copy_async_wait(stages - 2)   # this iteration's copies are done (this thread's)
            elif rings:
                _issue(bk, per_iteration, parts, rings, fn.b.add(it, i32(stages - 1)))
                fn.copy_async_wait(stages - 1)
            else:
                for inp in per_iteration:
                    _load(bk, inp, parts[inp.var.name], bk.tile(inp.var))
            fn.barrier()
            if issue_late:
                _issue(bk, per_iteration, parts, rings, fn.b.add(it, i32(stages - 1)))
            for name, ring in rings.items():
                bk.tiles[name] = _slot(bk, name, ring, it)
            for k, stage in enumerate(schedule.loop):
                _stage(bk, stage, rk, barrier=k not in barrier_free)
        bk.loop_counter = None
        bk.tiles.update(rings)
        if rings:
            fn.copy_async_wait(0)
        finishing = [acc for i, acc in enumerate(bg.nodes) if acc.opdef.is_accumulator and i not in in_rows
                     and i not in lowered.register_accumulated and _rule(acc).finalize is not None]
        for acc in finishing:
            fn.marker_for(acc)
            _rule(acc).finalize(bk, acc)
        for acc_index, matmul_index in lowered.register_accumulated.items():
            acc, matmul = bg.nodes[acc_index], bg.nodes[matmul_index]
            fn.marker_for(acc)
            bk.block_mma(matmul).store(in_registers[matmul.output.name], bk.tile(acc.output))
        row_accumulators = lowered.rows.accumulators(bg) if lowered.rows is not None else []
        for i in row_accumulators:
            fn.marker_for(bg.nodes[i])
            rk.store(bg.nodes[i].output, bk.tile(bg.nodes[i].output))
        if finishing or lowered.register_accumulated or row_accumulators:
            fn.barrier()
        for stage in schedule.post:
            _stage(bk, stage)
        _store_outputs(bk, scope)


def _store_outputs(bk: BlockKernel, scope) -> None:
    for out, tensor in zip(bk.bg.outputs, scope.outputs):
        _copy_loop(bk, _part(bk, tensor, out.omap, list(out.var.shape)), bk.tile(out.var), out.var.shape,
                   bk.layout.vectors[out.var.name])


def _register_accumulators(bk: BlockKernel) -> dict:
    """The zeroed fragments of each sum kept in registers; matmul output name -> fragments."""
    for acc_index, matmul_index in bk.lowered.register_accumulated.items():
        matmul = bk.bg.nodes[matmul_index]
        bk.register_accumulators[matmul.output.name] = (bk.bg.nodes[acc_index], bk.block_mma(matmul).zeroed())
    return {name: frags for name, (_, frags) in bk.register_accumulators.items()}


def _slot(bk: BlockKernel, name: str, ring: Array, iteration) -> Array:
    """The ring's slot of an iteration (the ring holds `stages` copies of the tile)."""
    b, memory = bk.fn.b, bk.lowered.memory
    if isinstance(iteration, int):
        first = i32((iteration % memory.stages) * memory.slot_bytes[name])
    else:
        first = b.mul(b.urem(iteration, i32(memory.stages)), i32(memory.slot_bytes[name]))
    ptr = b.gep(ring.ptr, [first], inbounds=True, source_etype=I8)
    return attrs.evolve(ring, ptr=ptr)


def _issue(bk: BlockKernel, inputs: list, parts: dict, rings: dict, iteration) -> None:
    """cp.async copies of iteration `iteration`'s input tiles into their slot, as one group (an empty
    one past the last iteration, so that every iteration waits for the same count)."""
    fn = bk.fn

    def copies() -> None:
        for inp in inputs:
            slot = _slot(bk, inp.var.name, rings[inp.var.name], iteration)
            _load(bk, inp, parts[inp.var.name], slot, iteration, asynchronous=True)

    if isinstance(iteration, int):
        if iteration < bk.bg.forloop:
            copies()
    else:
        with fn.when(fn.b.icmp_unsigned("<", iteration, i32(bk.bg.forloop))):
            copies()
    fn.copy_async_commit()


def _rule(node: Node):
    return node.opdef.rules["ptx"]


def _stage(bk: BlockKernel, stage, rk: Optional[RowKernel] = None, barrier: bool = True) -> None:
    for i in stage.nodes:
        node = bk.bg.nodes[i]
        bk.fn.marker_for(node)
        if i in bk.lowered.register_accumulated:
            continue   # folded by its matmul, in the fragments' registers
        if rk is not None and i in rk.plan.nodes:
            node.opdef.rules["ptx_rows"].emit(rk, node)   # in the registers of the warps owning its rows
            continue
        rule = _rule(node)
        (rule.update if node.opdef.is_accumulator else rule.block)(bk, node)
    if barrier:
        bk.fn.barrier()


def _part(bk: BlockKernel, tensor: Array, dim_map: tuple, extent: list) -> Array:
    """The block's part of a device tensor: slices of `extent` along the mapped dims, picked by the
    grid coordinates."""
    fn = bk.fn
    start = None
    for g, d in enumerate(dim_map):
        if d is not None:
            term = fn.b.mul(bk.block_index(g), i32(extent[d] * tensor.strides[d]))
            start = term if start is None else fn.b.add(start, term)
    return tensor if start is None else Array(fn.address(tensor, start), tensor.dtype, tensor.shape, tensor.strides)


def _input_part(bk: BlockKernel, inp, tensor: Array) -> Array:
    extent = [n * (bk.bg.forloop if d == inp.fmap else 1) for d, n in enumerate(inp.var.shape)]
    return _part(bk, tensor, inp.imap, extent)


def _copy_loop(bk: BlockKernel, dst: Array, src: Array, shape: tuple, vector: int, src_step=None,
               asynchronous: bool = False) -> None:
    """Copy an array of `shape` a row at a time, in vectors of `vector` elements: each thread reads
    up to COPY_BATCH vectors before it writes them, so that its loads are in flight together (with
    cp.async when `asynchronous`: same dtypes, 4 to 16 bytes, nothing passes through registers)."""
    fn, b = bk.fn, bk.fn.b
    shape = shape or (1,)
    space = shape[:-1] + (shape[-1] // vector,)
    n, threads = math.prod(space), bk.threads.block

    def vectors(op: Array) -> Array:
        strides = op.strides or (1,)
        return op.viewed(space, strides[:-1] + (strides[-1] * vector,))

    def source(i):
        at = fn.offset(i, space, vectors(src))
        return at if src_step is None else b.add(at, src_step)

    def batch(first, count: int, always_inside: bool) -> None:
        reads = []   # (inside, where to write, what: the source offset, or the values read)
        for u in range(count):
            i = first if u == 0 else b.add(first, i32(u * threads))
            inside = None if always_inside and (u + 1) * threads <= n else b.icmp_unsigned("<", i, i32(n))
            safe = i if inside is None else b.select(inside, i, i32(0))   # an element that exists
            to = fn.offset(safe, space, vectors(dst))   # before any branch: shared by the batch's offsets
            reads.append((inside, to, source(safe) if asynchronous else
                          fn.read_vector(src, source(safe), vector, dst.dtype)))
        for inside, to, what in reads:
            with fn.when(inside) if inside is not None else contextlib.nullcontext():
                if asynchronous:
                    fn.copy_async(fn.address(dst, to), fn.address(src, what), vector * ITEMSIZE[src.dtype])
                else:
                    fn.write_vector(dst, to, what)

    per_thread = -(-n // threads)
    if per_thread <= COPY_BATCH:
        batch(fn.sreg("tid.x"), per_thread, always_inside=True)
    else:
        with fn.loop(fn.sreg("tid.x"), n, threads * COPY_BATCH) as first:
            batch(first, COPY_BATCH, always_inside=False)


def _load(bk: BlockKernel, inp, part: Array, tile: Array, iteration=None, asynchronous: bool = False) -> None:
    """An input's tile (an iteration's: `iteration`, default the loop counter, picks it along the fmap)."""
    step = None
    if inp.fmap is not None and bk.bg.forloop > 1:
        iteration = bk.loop_counter if iteration is None else iteration
        stride = i32(inp.var.shape[inp.fmap] * part.strides[inp.fmap])
        step = i32(iteration * stride.constant) if isinstance(iteration, int) else bk.fn.b.mul(iteration, stride)
    _copy_loop(bk, tile, part, inp.var.shape, bk.layout.vectors[inp.var.name], step, asynchronous)

"""A custom kernel written as LLVM IR: the lowered form (mdsl.lowering.kernel: the block graph's plans
and the kernel's steps, in order) written step by step, each block-level node by its op's rule (`ptx`, or
`rows.PTX_ROW_RULES` for the nodes in row registers) on the shared-memory tiles: the same timeline as the CUDA
backend's (mdsl/backend/cuda/block.py). Each block finds its slices of the device tensors from its grid
coordinates (imap and omap) and the iteration's tile from the loop counter (fmap).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import attrs

from mdsl.backend.ptx import rows
from mdsl.backend.ptx.llvm import I8, ITEMSIZE, Array, KernelFunction, i32
from mdsl.backend.ptx.loops import Threads
from mdsl.backend.ptx.mma import BlockMma
from mdsl.backend.ptx.rows import RowKernel
from mdsl.backend.ptx.rule_table import PTX_RULES
from mdsl.backend.ptx.skinny import emit_skinny
from mdsl.backend.ptx.streamed import emit_streamed
from mdsl.ir.graph import BlockGraph, Node
from mdsl.lowering import kernel as steps
from mdsl.lowering.block import Lowered
from mdsl.lowering.index import part_extent, part_steps, vector_space, vector_strides
from mdsl.lowering.kernel import FOLDED, ROWS, CustomKernel, lower_custom
from mdsl.lowering.mma import MmaShape
from mdsl.passes.layout import scratch_name

_AXES = "xyz"
COPY_BATCH = 8   # vectors a thread copies at once (CUDA's copy loop is unrolled to the same effect)


class BlockKernel:
    """What an op rule sees while writing block-level code: the kernel function, the block's
    threads, the loop counter (inside the loop), the shared-memory tile of every value and the
    lowering's choices (which matmuls run on tensor cores, which sums live in their registers)."""

    def __init__(self, fn: KernelFunction, smem, bg: BlockGraph, lowered: Lowered,
                 block_index: Optional[tuple] = None):
        self.fn = fn
        self._block_index = block_index   # per grid axis, a value; None: ctaid
        self.smem = smem
        self.bg = bg
        self.threads = Threads(bg.threads, unroll=lowered.options.unroll)
        self.loop_counter = None
        self.layout = lowered.layout
        self.lowered = lowered
        self.tiles: dict = {}
        self.register_accumulators: dict = {}  # matmul output name -> (its accumulator, its fragments)
        self.rows: Optional[RowKernel] = None   # the row registers' state, where the lowering keeps rows there
        self.parts: dict = {}                   # block input name -> the block's part of its device tensor
        memory = lowered.memory
        for t in memory.lifetimes:
            tile = self.layout.tiles[t.name]
            ptr = fn.b.gep(smem, [i32(memory.offsets[t.name])], inbounds=True, source_etype=I8)
            self.tiles[t.name] = Array(ptr, tile.dtype.name, tile.shape, tile.strides)

    def tile(self, var) -> Array:
        return self.tiles[var.name]

    def block_index(self, axis: int):
        """The block's coordinate along a grid axis of the block graph: ctaid's, or where the kernel is the
        combine of a split in one launch, its group's (mdsl.backend.ptx.onelaunch)."""
        return self.fn.sreg(f"ctaid.{_AXES[axis]}") if self._block_index is None else self._block_index[axis]

    def scratch(self, node: Node) -> Array:
        return self.tiles[scratch_name(node)]

    def mma_shape(self, node: Node) -> Optional[MmaShape]:
        return self.lowered.mma.get(node.output.name)

    def block_mma(self, node: Node) -> Optional[BlockMma]:
        """The tensor-core matmul of a matmul node, or None where it keeps the scalar loop."""
        shape = self.mma_shape(node)
        return None if shape is None else BlockMma(self.fn, shape, node.inputs[0].dtype.name)


def emit_custom(program, index: int, node: Node) -> None:
    kernel = lower_custom(node, program.options, program.arch)
    with program.kernel(index, node, grid=kernel.grid, threads=kernel.threads, smem=kernel.smem_bytes,
                        overlap=kernel.overlap) as scope:
        emit_body(program, kernel, scope)


def emit_body(program, kernel: CustomKernel, scope, block_index: Optional[tuple] = None) -> None:
    """A custom kernel's body on the arrays of `scope` (its node's inputs and outputs). `block_index`: the
    block's coordinates (values) where the kernel is the combine of a split in one launch, which waits for
    no previous kernel (the split did); None: ctaid."""
    bg, fn = kernel.body, scope.fn
    bk = BlockKernel(fn, fn.shared_pointer(program.mb.dynamic_smem()), bg, kernel.lowered, block_index)
    if kernel.waits_first and block_index is None:
        fn.wait_for_previous_kernel()   # launched to overlap it: no global memory touched before
        fn.let_next_kernel_launch()
    if kernel.lowered.rows is not None:
        bk.rows = RowKernel(bk, kernel.lowered.rows)
    tensors = dict(zip((inp.var.name for inp in bg.inputs), scope.inputs))
    bk.parts = {inp.var.name: _input_part(bk, inp, tensors[inp.var.name]) for inp in kernel.parts}
    for step in kernel.steps:
        STEPS[type(step)](bk, kernel, scope, step)


def _skinny(bk: BlockKernel, kernel: CustomKernel, scope, step: steps.SkinnyLoop) -> None:
    scratch = bk.fn.b.gep(bk.smem, [i32(kernel.lowered.scratch_offset)], inbounds=True, source_etype=I8)
    emit_skinny(bk, kernel.body, kernel.lowered.skinny, bk.parts, scratch)


def _streamed(bk: BlockKernel, kernel: CustomKernel, scope, step: steps.StreamedLoop) -> None:
    emit_streamed(bk, kernel.body, step.nodes, bk.parts)


def _barrier(bk: BlockKernel, kernel: CustomKernel, scope, step: steps.Barrier) -> None:
    bk.fn.barrier()


def _init_accumulators(bk: BlockKernel, kernel: CustomKernel, scope, step: steps.InitAccumulators) -> None:
    for i, in_rows in step.nodes:
        acc = bk.bg.nodes[i]
        if in_rows:
            rows.PTX_ROW_RULES[acc.op].init(bk.rows, acc)
        else:
            _rule(acc).init(bk, acc)


def _register_accumulators(bk: BlockKernel, kernel: CustomKernel, scope, step: steps.RegisterAccumulators) -> None:
    """The zeroed fragments of each sum kept in registers."""
    for acc_index, matmul_index in step.pairs:
        matmul = bk.bg.nodes[matmul_index]
        bk.register_accumulators[matmul.output.name] = (bk.bg.nodes[acc_index], bk.block_mma(matmul).zeroed())


def _load_once(bk: BlockKernel, kernel: CustomKernel, scope, step: steps.LoadOnce) -> None:
    for inp in step.inputs:
        _load(bk, inp, bk.parts[inp.var.name], bk.tile(inp.var))


def _hoisted(bk: BlockKernel, kernel: CustomKernel, scope, step: steps.Hoisted) -> None:
    bk.fn.barrier()
    for stage in step.stages:
        _stage(bk, stage)


def _prologue(bk: BlockKernel, kernel: CustomKernel, scope, step: steps.Prologue) -> None:
    rings = {inp.var.name: bk.tile(inp.var) for inp in step.inputs}
    for ahead in range(step.ahead):
        _issue(bk, step.inputs, rings, ahead)


def _loop(bk: BlockKernel, kernel: CustomKernel, scope, step: steps.Loop) -> None:
    fn, depth = bk.fn, step.depth
    rings = {name: bk.tiles[name] for name in step.rings}
    with fn.loop(i32(0), step.forloop, 1) as it:
        bk.loop_counter = it
        if step.issue_late:
            fn.copy_async_wait(depth - 2)   # this iteration's copies are done (this thread's)
        elif rings:
            _issue(bk, step.inputs, rings, fn.b.add(it, i32(depth - 1)))
            fn.copy_async_wait(depth - 1)
        else:
            for inp in step.inputs:
                _load(bk, inp, bk.parts[inp.var.name], bk.tile(inp.var))
        fn.barrier()
        if step.issue_late:
            _issue(bk, step.inputs, rings, fn.b.add(it, i32(depth - 1)))
        for name, ring in rings.items():
            bk.tiles[name] = _slot(bk, name, ring, it)
        for stage in step.stages:
            _stage(bk, stage)
    bk.loop_counter = None
    bk.tiles.update(rings)


def _finish(bk: BlockKernel, kernel: CustomKernel, scope, step: steps.Finish) -> None:
    fn, bg = bk.fn, bk.bg
    if step.pipelined:
        fn.copy_async_wait(0)
    for i in step.finalized:
        fn.marker_for(bg.nodes[i])
        _rule(bg.nodes[i]).finalize(bk, bg.nodes[i])
    for acc_index, matmul_index in step.register_stores:
        acc, matmul = bg.nodes[acc_index], bg.nodes[matmul_index]
        fn.marker_for(acc)
        bk.block_mma(matmul).store(bk.register_accumulators[matmul.output.name][1], bk.tile(acc.output))
    for i in step.row_stores:
        fn.marker_for(bg.nodes[i])
        bk.rows.store(bg.nodes[i].output, bk.tile(bg.nodes[i].output))
    if step.barrier:
        fn.barrier()


def _post_stage(bk: BlockKernel, kernel: CustomKernel, scope, step: steps.Stage) -> None:
    _stage(bk, step)


def _outputs(bk: BlockKernel, kernel: CustomKernel, scope, step: steps.StoreOutputs) -> None:
    _store_outputs(bk, scope)


STEPS = {steps.SkinnyLoop: _skinny, steps.StreamedLoop: _streamed, steps.Barrier: _barrier,
          steps.InitAccumulators: _init_accumulators, steps.RegisterAccumulators: _register_accumulators,
          steps.LoadOnce: _load_once, steps.Hoisted: _hoisted, steps.Prologue: _prologue, steps.Loop: _loop,
          steps.Finish: _finish, steps.Stage: _post_stage, steps.StoreOutputs: _outputs}


def _rule(node: Node):
    return PTX_RULES[node.op]


def _stage(bk: BlockKernel, stage: steps.Stage) -> None:
    for i, how in stage.nodes:
        node = bk.bg.nodes[i]
        bk.fn.marker_for(node)
        if how == FOLDED:
            continue   # folded by its matmul, in the fragments' registers
        if how == ROWS:
            rows.PTX_ROW_RULES[node.op].emit(bk.rows, node)   # in the registers of the warps owning its rows
            continue
        rule = _rule(node)
        (rule.update if node.opdef.is_accumulator else rule.block)(bk, node)
    if stage.barrier:
        bk.fn.barrier()


def _store_outputs(bk: BlockKernel, scope) -> None:
    for out, tensor in zip(bk.bg.outputs, scope.outputs):
        _copy_loop(bk, _part(bk, tensor, out.omap, list(out.var.shape)), bk.tile(out.var), out.var.shape,
                   bk.layout.vectors[out.var.name])


def _slot(bk: BlockKernel, name: str, ring: Array, iteration) -> Array:
    """The ring's slot of an iteration (the ring holds `stages` copies of the tile)."""
    b, memory = bk.fn.b, bk.lowered.memory
    if isinstance(iteration, int):
        first = i32((iteration % memory.stages) * memory.slot_bytes[name])
    else:
        first = b.mul(b.urem(iteration, i32(memory.stages)), i32(memory.slot_bytes[name]))
    ptr = b.gep(ring.ptr, [first], inbounds=True, source_etype=I8)
    return attrs.evolve(ring, ptr=ptr)


def _issue(bk: BlockKernel, inputs: tuple, rings: dict, iteration) -> None:
    """cp.async copies of iteration `iteration`'s input tiles into their slot, as one group (an empty
    one past the last iteration, so that every iteration waits for the same count)."""
    fn = bk.fn

    def copies() -> None:
        for inp in inputs:
            slot = _slot(bk, inp.var.name, rings[inp.var.name], iteration)
            _load(bk, inp, bk.parts[inp.var.name], slot, iteration, asynchronous=True)

    if isinstance(iteration, int):
        if iteration < bk.bg.forloop:
            copies()
    else:
        with fn.when(fn.b.icmp_unsigned("<", iteration, i32(bk.bg.forloop))):
            copies()
    fn.copy_async_commit()


def _part(bk: BlockKernel, tensor: Array, dim_map: tuple, extent: list) -> Array:
    """The block's part of a device tensor: slices of `extent` along the mapped dims, picked by the
    grid coordinates."""
    fn = bk.fn
    start = None
    for g, step in part_steps(dim_map, extent, tensor.strides):
        term = fn.b.mul(bk.block_index(g), i32(step))
        start = term if start is None else fn.b.add(start, term)
    return tensor if start is None else Array(fn.address(tensor, start), tensor.dtype, tensor.shape, tensor.strides)


def _input_part(bk: BlockKernel, inp, tensor: Array) -> Array:
    return _part(bk, tensor, inp.imap, part_extent(inp.var.shape, inp.fmap, bk.bg.forloop))


def _copy_loop(bk: BlockKernel, dst: Array, src: Array, shape: tuple, vector: int, src_step=None,
               asynchronous: bool = False) -> None:
    """Copy an array of `shape` a row at a time, in vectors of `vector` elements: each thread reads
    up to COPY_BATCH vectors before it writes them, so that its loads are in flight together (with
    cp.async when `asynchronous`: same dtypes, 4 to 16 bytes, nothing passes through registers)."""
    fn, b = bk.fn, bk.fn.b
    space = vector_space(shape, vector)
    n, threads = math.prod(space), bk.threads.block

    def vectors(op: Array) -> Array:
        return op.viewed(space, vector_strides(op.strides, vector))

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

"""A custom kernel written as CUDA C++: the lowered form (mdsl.lowering.kernel: the block graph's plans
and the kernel's steps, in order) written step by step, each block-level node by its op's rule (`cuda`,
or `rows.CUDA_ROW_RULES` for the nodes in row registers) on the shared-memory tiles. Each block finds its slices
of the device tensors from its grid coordinates (imap and omap) and the iteration's tile from the loop
counter (fmap).
"""
from __future__ import annotations

import math
from typing import Optional

import attrs

from mdsl.backend.cuda import rows
from mdsl.backend.cuda.loops import Threads
from mdsl.backend.cuda.mma import mma_class, mma_store
from mdsl.backend.cuda.rows import RowKernel
from mdsl.backend.cuda.rule_table import CUDA_RULES
from mdsl.backend.cuda.skinny import emit_skinny
from mdsl.backend.cuda.source import CodeWriter, Operand, ctype, offset
from mdsl.backend.cuda.streamed import emit_streamed
from mdsl.ir.graph import BlockGraph, Node
from mdsl.ir.text import print_block_graph
from mdsl.lowering import kernel as steps
from mdsl.lowering.block import Lowered
from mdsl.lowering.index import part_extent, part_steps, vector_space, vector_strides
from mdsl.lowering.kernel import FOLDED, ROWS, CustomKernel, lower_custom
from mdsl.lowering.mma import MmaShape
from mdsl.lowering.options import arch_number
from mdsl.passes.layout import scratch_name

_CTYPE_BYTES = {"__half": 2, "__nv_bfloat16": 2, "float": 4, "int": 4}

_AXES = "xyz"
LOOP_COUNTER = "it"


class BlockKernel:
    """What an op rule sees while writing block-level code: the writer, the names in scope, the
    block's threads, the shared-memory tile of every value and the lowering's choices (which matmuls
    run on tensor cores, which accumulators live in their registers)."""

    def __init__(self, scope, bg: BlockGraph, lowered: Lowered, arch: int, block_index: Optional[tuple] = None,
                 task: bool = False):
        self.w: CodeWriter = scope.w
        self._block_index = block_index   # per grid axis, a C expression; None: blockIdx
        self.namer = scope.namer
        self.bg = bg
        # a task's body (mdsl.backend.cuda.task): the barrier is block_sync<BAR, threads> of the function's
        # template parameter BAR, and the shared memory the function's `smem` parameter
        self.task = task
        self.sync = f"mdsl::block_sync<BAR, {bg.threads}>();" if task else "__syncthreads();"
        self.threads = Threads(bg.threads, unroll=lowered.options.unroll,
                               barrier=f", BAR, {bg.threads}" if task else "")
        self.loop_counter = LOOP_COUNTER
        self.layout = lowered.layout
        self.lowered = lowered
        self.arch = arch
        self.tiles: dict = {}
        self.register_accumulators: dict = {}  # matmul output name -> (its accumulator, the C array of its fragments)
        self.rows: Optional[RowKernel] = None   # the row registers' state, where the lowering keeps rows there
        self.parts: dict = {}                   # block input name -> the block's part of its device tensor
        self._declare_tiles(lowered.memory)

    def tile(self, var) -> Operand:
        return self.tiles[var.name]

    def block_index(self, axis: int) -> str:
        """The block's coordinate along a grid axis of the block graph: blockIdx's, or where the kernel is the
        combine of a split in one launch, its group's (mdsl.backend.cuda.onelaunch)."""
        return f"blockIdx.{_AXES[axis]}" if self._block_index is None else self._block_index[axis]

    def scratch(self, node: Node) -> Operand:
        return self.tiles[scratch_name(node)]

    def mma_shape(self, node: Node) -> Optional[MmaShape]:
        return self.lowered.mma.get(node.output.name)

    def _declare_tiles(self, memory) -> None:
        if not self.task:
            self.w("extern __shared__ __align__(16) unsigned char smem[];")
        for t in memory.lifetimes:
            layout = self.layout.tiles[t.name]
            c = ctype(layout.dtype)
            copies = f"{memory.stages} copies of " if t.name in memory.slot_bytes else ""
            name = self.namer(f"s_{t.name}" + ("_ring" if copies else ""))
            self.w(f"{c}* const {name} = reinterpret_cast<{c}*>(smem + {memory.offsets[t.name]});"
                   f"  // {copies}{layout}, epochs {t.start}..{t.end}")
            self.tiles[t.name] = Operand(name, c, layout.shape, layout.strides)


def header(bg: BlockGraph) -> list:
    """The block graph as the comment above its kernel."""
    return [f"  {line}" for line in print_block_graph(bg).splitlines()]


def emit_custom(program, index: int, node: Node) -> None:
    kernel = lower_custom(node, program.options, program.arch)
    with program.kernel(index, node, grid=kernel.grid, threads=kernel.threads, smem=kernel.smem_bytes,
                        comment=header(kernel.body), overlap=kernel.overlap) as scope:
        emit_body(program, kernel, scope)


def emit_body(program, kernel: CustomKernel, scope, block_index: Optional[tuple] = None, task: bool = False) -> None:
    """A custom kernel's body on the operands of `scope` (its node's inputs and outputs). `block_index`: the
    block's coordinates (C expressions) where the kernel is the combine of a split in one launch, which
    waits for no previous kernel (the split did), or a task's (`task`: the body of mdsl.backend.cuda.task's
    device function, whose caller orders it after its inputs); None: blockIdx."""
    bg = kernel.body
    b = BlockKernel(scope, bg, kernel.lowered, arch_number(program.arch), block_index, task)
    if kernel.waits_first and block_index is None:
        b.w("mdsl::wait_for_previous_kernel();   // launched to overlap it: no global memory touched before",
            "mdsl::let_next_kernel_launch();")
    if kernel.lowered.rows is not None:
        b.rows = RowKernel(b, kernel.lowered.rows)
    tensors = dict(zip((inp.var.name for inp in bg.inputs), scope.inputs))
    b.parts = {inp.var.name: _input_part(b, inp, tensors[inp.var.name]) for inp in kernel.parts}
    for step in kernel.steps:
        STEPS[type(step)](b, kernel, scope, step)


def _skinny(b: BlockKernel, kernel: CustomKernel, scope, step: steps.SkinnyLoop) -> None:
    emit_skinny(b, kernel.body, kernel.lowered.skinny, b.parts, kernel.lowered.scratch_offset)


def _streamed(b: BlockKernel, kernel: CustomKernel, scope, step: steps.StreamedLoop) -> None:
    emit_streamed(b, kernel.body, step.nodes, b.parts)


def _barrier(b: BlockKernel, kernel: CustomKernel, scope, step: steps.Barrier) -> None:
    b.w(b.sync)


def _init_accumulators(b: BlockKernel, kernel: CustomKernel, scope, step: steps.InitAccumulators) -> None:
    b.w("// the accumulators start empty")
    for i, in_rows in step.nodes:
        acc = b.bg.nodes[i]
        if in_rows:
            b.w(f"// %{acc.output.name}: in the registers of the warps owning its rows")
            rows.CUDA_ROW_RULES[acc.op].init(b.rows, acc)
        else:
            _rule(acc).init(b, acc)


def _register_accumulators(b: BlockKernel, kernel: CustomKernel, scope, step: steps.RegisterAccumulators) -> None:
    """The fragments of each accumulator kept in registers, zeroed."""
    for acc_index, matmul_index in step.pairs:
        matmul = b.bg.nodes[matmul_index]
        shape = b.mma_shape(matmul)
        name = b.namer(f"r_{b.bg.nodes[acc_index].output.name}")
        b.w(f"// %{b.bg.nodes[acc_index].output.name}: in the registers of the mma fragments "
            f"({shape.fragments_per_warp * 4} floats a thread)",
            f"{mma_class(shape)}::Fragments {name};", f"{mma_class(shape)}::zero({name});")
        b.register_accumulators[matmul.output.name] = (b.bg.nodes[acc_index], name)


def _load_once(b: BlockKernel, kernel: CustomKernel, scope, step: steps.LoadOnce) -> None:
    for inp in step.inputs:
        _load(b, inp, b.parts[inp.var.name], b.tile(inp.var), LOOP_COUNTER)


def _hoisted(b: BlockKernel, kernel: CustomKernel, scope, step: steps.Hoisted) -> None:
    b.w("// loop-invariant nodes, once before the loop")
    b.w(b.sync)
    for stage in step.stages:
        _stage(b, stage)


def _prologue(b: BlockKernel, kernel: CustomKernel, scope, step: steps.Prologue) -> None:
    depth = step.ahead + 1
    b.w(f"// a pipeline {depth} deep: iteration it + {depth - 1}'s tiles are copied (cp.async) while "
        f"iteration it computes")
    with b.w.block(f"for (int ahead = 0; ahead < {step.ahead}; ++ahead)"):
        _issue(b, step.inputs, _rings(b, step.inputs), "ahead")


def _loop(b: BlockKernel, kernel: CustomKernel, scope, step: steps.Loop) -> None:
    w, depth = b.w, step.depth
    rings = {name: b.tiles[name] for name in step.rings}
    w("#pragma unroll 1")
    with w.block(f"for (int {LOOP_COUNTER} = 0; {LOOP_COUNTER} < {step.forloop}; ++{LOOP_COUNTER})"):
        if step.issue_late:
            w(f"mdsl::copy_async_wait<{depth - 2}>();  // this iteration's copies are done (this thread's)")
        elif step.rings:
            _issue(b, step.inputs, rings, f"{LOOP_COUNTER} + {depth - 1}")
            w(f"mdsl::copy_async_wait<{depth - 1}>();  // this iteration's copies are done (this thread's)")
        else:
            for inp in step.inputs:
                _load(b, inp, b.parts[inp.var.name], b.tile(inp.var), LOOP_COUNTER)
        w(b.sync)
        if step.issue_late:
            _issue(b, step.inputs, rings, f"{LOOP_COUNTER} + {depth - 1}")
        for name, ring in rings.items():
            slot = b.namer(ring.ptr[:-len("_ring")])
            w(f"{ring.ctype}* const {slot} = {ring.ptr} + ({LOOP_COUNTER} % {depth}) * "
              f"{b.lowered.memory.slot_bytes[name] // _itemsize(ring)};")
            b.tiles[name] = attrs.evolve(ring, ptr=slot)
        for stage in step.stages:
            _stage(b, stage)


def _finish(b: BlockKernel, kernel: CustomKernel, scope, step: steps.Finish) -> None:
    w, bg = b.w, b.bg
    if step.pipelined:
        w("mdsl::copy_async_wait<0>();")
    for i in step.finalized:
        w.op(bg.nodes[i])
        _rule(bg.nodes[i]).finalize(b, bg.nodes[i])
    for acc_index, matmul_index in step.register_stores:
        acc, matmul = bg.nodes[acc_index], bg.nodes[matmul_index]
        w.op(acc)
        w(mma_store(b.mma_shape(matmul), b.register_accumulators[matmul.output.name][1], b.tile(acc.output)))
    for i in step.row_stores:
        w.op(bg.nodes[i])
        w("// its registers to its tile")
        b.rows.store(bg.nodes[i].output, b.tile(bg.nodes[i].output))
    if step.barrier:
        w(b.sync)


def _store_outputs(b: BlockKernel, kernel: CustomKernel, scope, step: steps.StoreOutputs) -> None:
    for out, tensor in zip(b.bg.outputs, scope.outputs):
        _store(b, out, tensor)


def _post_stage(b: BlockKernel, kernel: CustomKernel, scope, step: steps.Stage) -> None:
    _stage(b, step)


STEPS = {steps.SkinnyLoop: _skinny, steps.StreamedLoop: _streamed, steps.Barrier: _barrier,
          steps.InitAccumulators: _init_accumulators, steps.RegisterAccumulators: _register_accumulators,
          steps.LoadOnce: _load_once, steps.Hoisted: _hoisted, steps.Prologue: _prologue, steps.Loop: _loop,
          steps.Finish: _finish, steps.Stage: _post_stage, steps.StoreOutputs: _store_outputs}


def _rule(node: Node):
    return CUDA_RULES[node.op]


def _stage(b: BlockKernel, stage: steps.Stage) -> None:
    for i, how in stage.nodes:
        node = b.bg.nodes[i]
        b.w.op(node)
        if how == FOLDED:
            b.w("// (folded by the matmul above, in its registers)")
            continue
        if how == ROWS:
            b.w("// (in the registers of the warps owning its rows)")
            rows.CUDA_ROW_RULES[node.op].emit(b.rows, node)
            continue
        rule = _rule(node)
        (rule.update if node.opdef.is_accumulator else rule.block)(b, node)
    if stage.barrier:
        b.w(b.sync)


def _rings(b: BlockKernel, inputs: tuple) -> dict:
    """The per-iteration inputs' rings (their tiles, `stages` copies each), by name."""
    return {inp.var.name: b.tile(inp.var) for inp in inputs}


def _issue(b: BlockKernel, inputs: tuple, rings: dict, iteration: str) -> None:
    """cp.async copies of iteration `iteration`'s input tiles into their slot, as one group (an empty
    one past the last iteration, so that every iteration waits for the same count)."""
    stages = b.lowered.memory.stages
    with b.w.block(f"if ({iteration} < {b.bg.forloop})"):
        for inp in inputs:
            ring = rings[inp.var.name]
            slot_elems = b.lowered.memory.slot_bytes[inp.var.name] // _itemsize(ring)
            slot = attrs.evolve(ring, ptr=f"({ring.ptr} + (({iteration}) % {stages}) * {slot_elems})")
            _load(b, inp, b.parts[inp.var.name], slot, f"({iteration})", asynchronous=True)
    b.w("mdsl::copy_async_commit();")


def _itemsize(op: Operand) -> int:
    return _CTYPE_BYTES[op.ctype]


def _part(b: BlockKernel, tensor: Operand, dim_map: tuple, extent: list, writable: bool) -> Operand:
    """The block's part of a device tensor (slices of `extent` along the mapped dims, picked by the
    grid coordinates), as a pointer named after the tensor."""
    terms = [f"{b.block_index(g)} * {step}" for g, step in part_steps(dim_map, extent, tensor.strides)]
    if not terms:
        return tensor
    name = b.namer(f"{tensor.ptr}_part")
    b.w(f"{'' if writable else 'const '}{tensor.ctype}* const {name} = {tensor.ptr} + {' + '.join(terms)};")
    return Operand(name, tensor.ctype, tensor.shape, tensor.strides)


def _input_part(b: BlockKernel, inp, tensor: Operand) -> Operand:
    return _part(b, tensor, inp.imap, part_extent(inp.var.shape, inp.fmap, b.bg.forloop), writable=False)


def _maps(entries) -> str:
    return f"[{', '.join('-' if d is None else str(d) for d in entries)}]"


def _copy_loop(b: BlockKernel, dst: Operand, src: Operand, shape: tuple, vector: int, src_step: str = "",
               asynchronous: bool = False) -> None:
    """Copy an array of `shape` a row at a time, in vectors of `vector` elements (with cp.async when
    `asynchronous`: same types, 4 to 16 bytes)."""
    space = vector_space(shape, vector)

    def vectors(op: Operand) -> Operand:
        return op.viewed(space, vector_strides(op.strides, vector))

    copy = f"mdsl::copy_async<{vector * _itemsize(src)}>" if asynchronous else f"mdsl::copy<{vector}>"
    with b.threads.each(b.w, math.prod(space), unrolled=True):  # loads in flight together
        b.w(f"{copy}({dst.ptr} + {offset('i', space, vectors(dst))}, "
            f"{src.ptr}{src_step} + {offset('i', space, vectors(src))});")


def _load(b: BlockKernel, inp, part: Operand, tile: Operand, iteration: str, asynchronous: bool = False) -> None:
    when = "iteration " + iteration + "'s tile" if inp.fmap is not None else "its tile, loaded once"
    b.w(f"// %{inp.var.name}: {when} {inp.var.type} (imap={_maps(inp.imap)}, "
        f"fmap={'-' if inp.fmap is None else inp.fmap})")
    step = ""
    if inp.fmap is not None and b.bg.forloop > 1:
        step = f" + {iteration} * {inp.var.shape[inp.fmap] * part.strides[inp.fmap]}"
    _copy_loop(b, tile, part, inp.var.shape, b.layout.vectors[inp.var.name], step, asynchronous)


def _store(b: BlockKernel, out, tensor: Operand) -> None:
    b.w(f"// %{out.var.name}: stored (omap={_maps(out.omap)})")
    part = _part(b, tensor, out.omap, list(out.var.shape), writable=True)
    _copy_loop(b, part, b.tile(out.var), out.var.shape, b.layout.vectors[out.var.name])

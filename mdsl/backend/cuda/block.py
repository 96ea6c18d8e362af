"""The kernel of a graph-defined (`custom`) op: its block graph lowered and written out.

The passes decide everything but the text: `schedule` orders the nodes and places the barriers,
`layout` lays out the shared-memory tiles and sizes the device-memory accesses, `memory` gives each
tile its offset (and copies of the per-iteration input tiles for a pipeline). The backend's own
choices, switchable through `CudaOptions` (mdsl.backend.cuda.options): which matmuls run on tensor
cores (`mdsl.backend.cuda.mma`), which `accum(matmul)` sums stay in the mma's registers for the whole
loop, and how deep the cp.async pipeline is. The kernel then follows the schedule's timeline:

    accumulators start empty (those in registers: zeroed fragments); loop-invariant tiles are loaded
    pipelined: iterations 0 .. stages-2's tiles are issued (cp.async), one commit group each
    for each of the `forloop` iterations:
        pipelined: iteration it+stages-1's tiles are issued; wait for iteration it's group
        else: the iteration's input tiles are loaded
        barrier
        each loop stage (accumulator updates included); barrier
    accumulators that need it are finalized, sums in registers stored to their tiles; barrier
    each post-loop stage; barrier
    the output tiles are stored where their omap puts them

The copy into a slot is issued one iteration after the slot was last read, behind that iteration's
closing barrier, so a slot is never overwritten while read. Each block finds its slices of the
device tensors from its grid coordinates (imap and omap) and the iteration's tile from the loop
counter (fmap).
"""
from __future__ import annotations

import math
from typing import Optional

import attrs

from mdsl.backend.cuda.loops import Threads
from mdsl.backend.cuda.mma import MmaShape, mma_shape, mma_store
from mdsl.backend.cuda.options import OVERLAP_MIN_ARCH, CudaOptions, arch_number
from mdsl.backend.cuda.rows import RowKernel, RowPlan, plan_rows, trailing_stages
from mdsl.backend.cuda.skinny import SkinnyPlan, emit_skinny, scratch_bytes, skinny_plan
from mdsl.backend.cuda.skinny import in_registers as skinny_in_registers
from mdsl.backend.cuda.streamed import emit_streamed, streamed_accumulators
from mdsl.backend.cuda.source import CodeWriter, Operand, ctype, offset
from mdsl.ir.graph import BlockGraph, Node
from mdsl.ir.text import print_block_graph
from mdsl.passes.layout import LayoutPlan, scratch_name, select_layout
from mdsl.passes.memory import SMEM_LIMIT_BYTES, MemoryPlan, SharedMemoryError, plan_memory
from mdsl.passes.schedule import Schedule, matmul_accumulators, schedule_block_graph

ASYNC_COPY_MIN_ARCH = 80
ASYNC_COPY_BYTES = (4, 8, 16)
DEFAULT_ARCH_NUMBER = 90
_CTYPE_BYTES = {"__half": 2, "__nv_bfloat16": 2, "float": 4, "int": 4}

_AXES = "xyz"
LOOP_COUNTER = "it"


class BlockKernel:
    """What an op rule sees while writing block-level code: the writer, the names in scope, the
    block's threads, the shared-memory tile of every value and the lowering's choices (which matmuls
    run on tensor cores, which accumulators live in their registers)."""

    def __init__(self, scope, bg: BlockGraph, lowered: "Lowered", arch: int):
        self.w: CodeWriter = scope.w
        self.namer = scope.namer
        self.bg = bg
        self.threads = Threads(bg.threads, unroll=lowered.options.unroll)
        self.loop_counter = LOOP_COUNTER
        self.layout = lowered.layout
        self.lowered = lowered
        self.arch = arch
        self.tiles: dict = {}
        self.register_accumulators: dict = {}  # matmul output name -> (its accumulator, the C array of its fragments)
        self._declare_tiles(lowered.memory)

    def tile(self, var) -> Operand:
        return self.tiles[var.name]

    def block_index(self, axis: int) -> str:
        """The block's coordinate along a grid axis of the block graph."""
        return f"blockIdx.{_AXES[axis]}"

    def scratch(self, node: Node) -> Operand:
        return self.tiles[scratch_name(node)]

    def mma_shape(self, node: Node) -> Optional[MmaShape]:
        return self.lowered.mma.get(node.output.name)

    def _declare_tiles(self, memory) -> None:
        self.w("extern __shared__ __align__(16) unsigned char smem[];")
        for t in memory.lifetimes:
            layout = self.layout.tiles[t.name]
            c = ctype(layout.dtype)
            copies = f"{memory.stages} copies of " if t.name in memory.slot_bytes else ""
            name = self.namer(f"s_{t.name}" + ("_ring" if copies else ""))
            self.w(f"{c}* const {name} = reinterpret_cast<{c}*>(smem + {memory.offsets[t.name]});"
                   f"  // {copies}{layout}, epochs {t.start}..{t.end}")
            self.tiles[t.name] = Operand(name, c, layout.shape, layout.strides)


@attrs.frozen
class Lowered:
    """A block graph's lowering: the passes' plans and the backend's choices made on them."""

    schedule: Schedule
    layout: LayoutPlan
    memory: MemoryPlan
    mma: dict                 # matmul output name -> MmaShape, for the matmuls on tensor cores
    register_accumulated: dict  # accum node index -> index of the matmul that sums into its registers
    options: CudaOptions = CudaOptions()
    rows: Optional[RowPlan] = None  # loop chains kept in the registers of the warps owning their rows
    streamed: Optional[tuple] = None  # a loop of element-wise accumulators folded from device memory
    skinny: Optional[SkinnyPlan] = None  # a loop of matmuls of <= 16 rows, weights streamed (skinny.py)
    warps: int = 0                   # the block's warps (the skinny loop's partial sums are per warp)

    @property
    def scratch_offset(self) -> int:
        """Where the skinny loop's partial sums start in shared memory: after the memory plan's tiles."""
        return -(-self.memory.total // 16) * 16

    @property
    def smem_bytes(self) -> int:
        if self.skinny is None:
            return self.memory.total
        return self.scratch_offset + scratch_bytes(self.skinny, self.warps)


def _tile_operand(layout: LayoutPlan, name: str) -> Operand:
    tile = layout.tiles[name]
    return Operand(f"s_{name}", ctype(tile.dtype), tile.shape, tile.strides)


def _mma_shapes(bg: BlockGraph, layout: LayoutPlan, options: CudaOptions, arch: int) -> dict:
    if not options.mma:
        return {}
    out = {}
    for node in bg.nodes:
        if node.op == "matmul":
            a, w, o = (_tile_operand(layout, v.name) for v in (*node.inputs, node.output))
            shape = mma_shape(node, a, w, o, bg.threads, arch)
            if shape is not None:
                out[node.output.name] = shape
    return out


def _asynchronous(bg: BlockGraph, tensor_types: tuple, layout: LayoutPlan, arch: int) -> bool:
    """Whether the per-iteration input tiles can be copied with cp.async: sm_80+, and every such copy
    4, 8 or 16 bytes wide (the tile has the tensor's dtype: inputs keep theirs)."""
    if arch < ASYNC_COPY_MIN_ARCH:
        return False
    return all(layout.vectors[i.var.name] * t.dtype.itemsize in ASYNC_COPY_BYTES
               for i, t in zip(bg.inputs, tensor_types) if i.fmap is not None)


def lower(bg: BlockGraph, tensor_types: tuple, options: Optional[CudaOptions] = None,
          arch: int = DEFAULT_ARCH_NUMBER, skinny: bool = False) -> Lowered:
    """The schedule, layout and memory plan of a block graph: the tiles it computes in f32 where they
    fit in shared memory (with the deepest input pipeline that fits, down to none), else in their own
    dtypes. `skinny` (the CUDA backend passes `options.skinny`; a backend without the skinny loop leaves
    it off): a loop of matmuls of at most 16 rows streams its weights (`skinny.py`) where it qualifies."""
    options = options or CudaOptions()
    error = None
    if skinny:
        found = _lower_skinny(bg, tensor_types, arch, options)
        if found is not None:
            return found
    for wide in (True, False):
        layout = select_layout(bg, tensor_types, wide=wide)
        mma = _mma_shapes(bg, layout, options, arch)
        fused = {}
        if options.register_accumulators:
            fused = {i: j for i, j in matmul_accumulators(bg).items() if bg.nodes[j].output.name in mma}
        schedule = schedule_block_graph(bg, fused_accumulators=tuple(fused), hoist=options.hoist)
        rows = plan_rows(bg, schedule, layout.tiles, mma) if options.rows and options.mma else None
        fused = {i: fused[i] for i in schedule.fused if rows is None or i not in rows.nodes}
        in_registers = rows.without_tiles(bg) if rows is not None else frozenset()
        streamed = streamed_accumulators(bg, schedule) if options.stream else None
        if streamed is not None:   # per-iteration tiles are read from device memory, not copied
            in_registers = frozenset(i.var.name for i in bg.inputs if i.fmap is not None) | \
                frozenset(scratch_name(bg.nodes[i]) for i in streamed)
        deepest = options.stages if _asynchronous(bg, tensor_types, layout, arch) and schedule.loop else 1
        if streamed is not None:
            deepest = 1
        for stages in range(deepest, 0, -1):
            try:
                memory = plan_memory(bg, schedule, layout, stages=stages, in_registers=in_registers)
            except SharedMemoryError as e:
                error = error or e
                continue
            return Lowered(schedule, layout, memory, mma, fused, options, rows,
                           tuple(streamed) if streamed is not None else None)
    raise error


def _lower_skinny(bg: BlockGraph, tensor_types: tuple, arch: int, options: CudaOptions) -> Optional[Lowered]:
    """The skinny lowering (f32 tiles, no input tiles, no pipeline), or None where the block graph does not
    qualify or its tiles and partial sums do not fit."""
    schedule = schedule_block_graph(bg, hoist=options.hoist)
    plan = skinny_plan(bg, schedule, tensor_types, arch, options.overlap, options.stagger, options.lead,
                       options.wide_x)
    if plan is None:
        return None
    layout = select_layout(bg, tensor_types, wide=True)
    try:
        memory = plan_memory(bg, schedule, layout, stages=1, in_registers=skinny_in_registers(bg, plan))
    except SharedMemoryError:
        return None
    lowered = Lowered(schedule, layout, memory, {}, {}, options, skinny=plan, warps=bg.threads // 32)
    return lowered if lowered.smem_bytes <= SMEM_LIMIT_BYTES else None


def emit_custom(program, index: int, node: Node) -> None:
    options = program.options
    arch = arch_number(program.arch)
    bg = node.body if options.threads is None else attrs.evolve(node.body, threads=options.threads)
    lowered = lower(bg, tuple(v.type for v in node.inputs), options, arch, skinny=options.skinny)
    schedule, memory = lowered.schedule, lowered.memory
    header = [f"  {line}" for line in print_block_graph(bg).splitlines()]
    overlap = options.overlap and arch >= OVERLAP_MIN_ARCH
    with program.kernel(index, node, grid=bg.grid, threads=bg.threads, smem=lowered.smem_bytes,
                        comment=header, overlap=overlap) as scope:
        b = BlockKernel(scope, bg, lowered, arch)
        w = b.w
        if overlap and lowered.skinny is None:   # (the skinny loop prefetches its first slabs before waiting)
            w("mdsl::wait_for_previous_kernel();   // launched to overlap it: no global memory touched before",
              "mdsl::let_next_kernel_launch();")
        rk = RowKernel(b, lowered.rows) if lowered.rows is not None else None
        in_rows = lowered.rows.nodes if lowered.rows is not None else frozenset()
        streamed = lowered.streamed or ()
        read = {v.name for i in streamed for v in bg.nodes[i].inputs}
        if lowered.skinny is not None:   # every input streamed from device memory
            read = {inp.var.name for inp in bg.inputs}
        parts = {inp.var.name: _input_part(b, inp, tensor)
                 for inp, tensor in zip(bg.inputs, scope.inputs) if inp.var.name in b.tiles or inp.var.name in read}
        if lowered.skinny is not None:
            emit_skinny(b, bg, lowered.skinny, parts, lowered.scratch_offset)
            for stage in schedule.post:
                _stage(b, stage)
            for out, tensor in zip(bg.outputs, scope.outputs):
                _store(b, out, tensor)
            return
        loaded = [inp for inp in bg.inputs if inp.var.name in parts]
        per_iteration = [inp for inp in loaded if inp.fmap is not None]
        accumulators = [n for n in bg.nodes if n.opdef.is_accumulator]  # those in registers too: their scratch
        if streamed:
            emit_streamed(b, bg, list(streamed), parts)
            w("__syncthreads();")
            for stage in schedule.post:
                _stage(b, stage)
            for out, tensor in zip(bg.outputs, scope.outputs):
                _store(b, out, tensor)
            return
        w("// the accumulators start empty")
        for acc in accumulators:
            if bg.nodes.index(acc) in in_rows:
                w(f"// %{acc.output.name}: in the registers of the warps owning its rows")
                acc.opdef.rules["cuda_rows"].init(rk, acc)
            else:
                _rule(acc).init(b, acc)
        in_registers = _declare_register_accumulators(b)
        for inp in loaded:
            if inp.fmap is None:
                _load(b, inp, parts[inp.var.name], b.tile(inp.var), LOOP_COUNTER)
        if schedule.pre:
            w("// loop-invariant nodes, once before the loop")
            w("__syncthreads();")
            for stage in schedule.pre:
                _stage(b, stage)
        stages = memory.stages
        rings = {inp.var.name: b.tile(inp.var) for inp in per_iteration if inp.var.name in memory.slot_bytes}
        if rings:
            w(f"// a pipeline {stages} deep: iteration it + {stages - 1}'s tiles are copied (cp.async) while "
              f"iteration it computes")
            with w.block(f"for (int ahead = 0; ahead < {stages - 1}; ++ahead)"):
                _issue(b, per_iteration, parts, rings, "ahead")
        # the loop's last stages in registers need no barrier after them; then, pipelined, the next
        # copies are issued behind the barrier that opens an iteration, into the slot the last one read
        # (every thread is past it), so that one barrier an iteration is enough
        free = trailing_stages(schedule, lowered.rows)
        issue_late = bool(rings) and free > 0 and len(rings) == len(per_iteration)
        barrier_free = set(range(len(schedule.loop) - free, len(schedule.loop)))
        if not issue_late:
            barrier_free.discard(len(schedule.loop) - 1)   # the last stage's barrier closes the iteration
        w("#pragma unroll 1")
        with w.block(f"for (int {LOOP_COUNTER} = 0; {LOOP_COUNTER} < {bg.forloop}; ++{LOOP_COUNTER})"):
            if issue_late:
                w(f"mdsl::copy_async_wait<{stages - 2}>();  // this iteration's copies are done (this thread's)")
            elif rings:
                _issue(b, per_iteration, parts, rings, f"{LOOP_COUNTER} + {stages - 1}")
                w(f"mdsl::copy_async_wait<{stages - 1}>();  // this iteration's copies are done (this thread's)")
            else:
                for inp in per_iteration:
                    _load(b, inp, parts[inp.var.name], b.tile(inp.var), LOOP_COUNTER)
            w("__syncthreads();")
            if issue_late:
                _issue(b, per_iteration, parts, rings, f"{LOOP_COUNTER} + {stages - 1}")
            for name, ring in rings.items():
                slot = b.namer(ring.ptr[:-len("_ring")])
                w(f"{ring.ctype}* const {slot} = {ring.ptr} + ({LOOP_COUNTER} % {stages}) * "
                  f"{memory.slot_bytes[name] // _itemsize(ring)};")
                b.tiles[name] = attrs.evolve(ring, ptr=slot)
            for k, stage in enumerate(schedule.loop):
                _stage(b, stage, rk, barrier=k not in barrier_free)
        if rings:
            w("mdsl::copy_async_wait<0>();")
        finishing = [acc for i, acc in enumerate(bg.nodes) if acc.opdef.is_accumulator and i not in in_rows
                     and i not in lowered.register_accumulated and _rule(acc).finalize is not None]
        for acc in finishing:
            w.op(acc)
            _rule(acc).finalize(b, acc)
        for acc_index, matmul_index in lowered.register_accumulated.items():
            acc, matmul = bg.nodes[acc_index], bg.nodes[matmul_index]
            w.op(acc)
            w(mma_store(b.mma_shape(matmul), in_registers[matmul.output.name], b.tile(acc.output)))
        row_accumulators = lowered.rows.accumulators(bg) if lowered.rows is not None else []
        for i in row_accumulators:
            w.op(bg.nodes[i])
            w("// its registers to its tile")
            rk.store(bg.nodes[i].output, b.tile(bg.nodes[i].output))
        if finishing or lowered.register_accumulated or row_accumulators:
            w("__syncthreads();")
        for stage in schedule.post:
            _stage(b, stage)
        for out, tensor in zip(bg.outputs, scope.outputs):
            _store(b, out, tensor)


def _itemsize(op: Operand) -> int:
    return _CTYPE_BYTES[op.ctype]


def _declare_register_accumulators(b: BlockKernel) -> dict:
    """The fragments of each accumulator kept in registers, zeroed; matmul output name -> C name."""
    for acc_index, matmul_index in b.lowered.register_accumulated.items():
        matmul = b.bg.nodes[matmul_index]
        shape = b.mma_shape(matmul)
        name = b.namer(f"r_{b.bg.nodes[acc_index].output.name}")
        b.w(f"// %{b.bg.nodes[acc_index].output.name}: in the registers of the mma fragments "
            f"({shape.fragments_per_warp * 4} floats a thread)",
            f"{shape.cls}::Fragments {name};", f"{shape.cls}::zero({name});")
        b.register_accumulators[matmul.output.name] = (b.bg.nodes[acc_index], name)
    return {matmul: name for matmul, (_, name) in b.register_accumulators.items()}


def _issue(b: BlockKernel, inputs: list, parts: dict, rings: dict, iteration: str) -> None:
    """cp.async copies of iteration `iteration`'s input tiles into their slot, as one group (an empty
    one past the last iteration, so that every iteration waits for the same count)."""
    stages = b.lowered.memory.stages
    with b.w.block(f"if ({iteration} < {b.bg.forloop})"):
        for inp in inputs:
            ring = rings[inp.var.name]
            slot_elems = b.lowered.memory.slot_bytes[inp.var.name] // _itemsize(ring)
            slot = attrs.evolve(ring, ptr=f"({ring.ptr} + (({iteration}) % {stages}) * {slot_elems})")
            _load(b, inp, parts[inp.var.name], slot, f"({iteration})", asynchronous=True)
    b.w("mdsl::copy_async_commit();")


def _rule(node: Node):
    return node.opdef.rules["cuda"]


def _stage(b: BlockKernel, stage, rk: Optional[RowKernel] = None, barrier: bool = True) -> None:
    for i in stage.nodes:
        node = b.bg.nodes[i]
        b.w.op(node)
        if i in b.lowered.register_accumulated:
            b.w("// (folded by the matmul above, in its registers)")
            continue
        if rk is not None and i in rk.plan.nodes:
            b.w("// (in the registers of the warps owning its rows)")
            node.opdef.rules["cuda_rows"].emit(rk, node)
            continue
        rule = _rule(node)
        (rule.update if node.opdef.is_accumulator else rule.block)(b, node)
    if barrier:
        b.w("__syncthreads();")


def _part(b: BlockKernel, tensor: Operand, dim_map: tuple, extent: list, writable: bool) -> Operand:
    """The block's part of a device tensor (slices of `extent` along the mapped dims, picked by the
    grid coordinates), as a pointer named after the tensor."""
    terms = [f"{b.block_index(g)} * {extent[d] * tensor.strides[d]}" for g, d in enumerate(dim_map) if d is not None]
    if not terms:
        return tensor
    name = b.namer(f"{tensor.ptr}_part")
    b.w(f"{'' if writable else 'const '}{tensor.ctype}* const {name} = {tensor.ptr} + {' + '.join(terms)};")
    return Operand(name, tensor.ctype, tensor.shape, tensor.strides)


def _input_part(b: BlockKernel, inp, tensor: Operand) -> Operand:
    extent = [n * (b.bg.forloop if d == inp.fmap else 1) for d, n in enumerate(inp.var.shape)]
    return _part(b, tensor, inp.imap, extent, writable=False)


def _maps(entries) -> str:
    return f"[{', '.join('-' if d is None else str(d) for d in entries)}]"


def _copy_loop(b: BlockKernel, dst: Operand, src: Operand, shape: tuple, vector: int, src_step: str = "",
               asynchronous: bool = False) -> None:
    """Copy an array of `shape` a row at a time, in vectors of `vector` elements (with cp.async when
    `asynchronous`: same types, 4 to 16 bytes)."""
    shape = shape or (1,)
    space = shape[:-1] + (shape[-1] // vector,)

    def vectors(op: Operand) -> Operand:
        strides = op.strides or (1,)
        return op.viewed(space, strides[:-1] + (strides[-1] * vector,))

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

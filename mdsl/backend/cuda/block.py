"""The kernel of a graph-defined (`custom`) op: its block graph lowered and written out.

The passes decide everything but the text: `schedule` orders the nodes and places the barriers,
`layout` lays out the shared-memory tiles and sizes the device-memory accesses, `memory` gives each
tile its offset. The kernel then follows the schedule's timeline:

    accumulators start empty; loop-invariant input tiles are loaded
    for each of the `forloop` iterations:
        the iteration's input tiles are loaded; barrier
        each loop stage (accumulator updates included); barrier
    accumulators that need it are finalized; barrier
    each post-loop stage; barrier
    the output tiles are stored where their omap puts them

Each block finds its slices of the device tensors from its grid coordinates (imap and omap) and the
iteration's tile from the loop counter (fmap).
"""
from __future__ import annotations

import math

from mdsl.backend.cuda.loops import Threads
from mdsl.backend.cuda.source import CodeWriter, Operand, ctype, offset
from mdsl.ir.graph import BlockGraph, Node
from mdsl.ir.text import print_block_graph
from mdsl.passes.layout import scratch_name, select_layout
from mdsl.passes.memory import SharedMemoryError, plan_memory
from mdsl.passes.schedule import schedule_block_graph

_AXES = "xyz"
LOOP_COUNTER = "it"


class BlockKernel:
    """What an op rule sees while writing block-level code: the writer, the names in scope, the
    block's threads and the shared-memory tile of every value."""

    def __init__(self, scope, bg: BlockGraph, layout, memory):
        self.w: CodeWriter = scope.w
        self.namer = scope.namer
        self.bg = bg
        self.threads = Threads(bg.threads)
        self.loop_counter = LOOP_COUNTER
        self.layout = layout
        self.tiles: dict = {}
        self._declare_tiles(memory)

    def tile(self, var) -> Operand:
        return self.tiles[var.name]

    def scratch(self, node: Node) -> Operand:
        return self.tiles[scratch_name(node)]

    def _declare_tiles(self, memory) -> None:
        self.w("extern __shared__ __align__(16) unsigned char smem[];")
        for t in memory.lifetimes:
            layout = self.layout.tiles[t.name]
            name = self.namer(f"s_{t.name}")
            c = ctype(layout.dtype)
            self.w(f"{c}* const {name} = reinterpret_cast<{c}*>(smem + {memory.offsets[t.name]});"
                   f"  // {layout}, epochs {t.start}..{t.end}")
            self.tiles[t.name] = Operand(name, c, layout.shape, layout.strides)


def lower(bg: BlockGraph, tensor_types: tuple) -> tuple:
    """The schedule, layout and memory plan of a block graph: the tiles it computes in f32 where they
    fit in shared memory, else in their own dtypes."""
    schedule = schedule_block_graph(bg)
    try:
        layout = select_layout(bg, tensor_types, wide=True)
        return schedule, layout, plan_memory(bg, schedule, layout)
    except SharedMemoryError:
        layout = select_layout(bg, tensor_types, wide=False)
        return schedule, layout, plan_memory(bg, schedule, layout)


def emit_custom(program, index: int, node: Node) -> None:
    bg = node.body
    schedule, layout, memory = lower(bg, tuple(v.type for v in node.inputs))
    header = [f"  {line}" for line in print_block_graph(bg).splitlines()]
    with program.kernel(index, node, grid=bg.grid, threads=bg.threads, smem=memory.total, comment=header) as scope:
        b = BlockKernel(scope, bg, layout, memory)
        w = b.w
        parts = {inp.var.name: _input_part(b, inp, tensor)
                 for inp, tensor in zip(bg.inputs, scope.inputs) if inp.var.name in b.tiles}  # the inputs read
        loaded = [inp for inp in bg.inputs if inp.var.name in parts]
        accumulators = [n for n in bg.nodes if n.opdef.is_accumulator]
        w("// the accumulators start empty")
        for acc in accumulators:
            _rule(acc).init(b, acc)
        for inp in loaded:
            if inp.fmap is None:
                _load(b, inp, parts[inp.var.name])
        w("#pragma unroll 1")
        with w.block(f"for (int {LOOP_COUNTER} = 0; {LOOP_COUNTER} < {bg.forloop}; ++{LOOP_COUNTER})"):
            for inp in loaded:
                if inp.fmap is not None:
                    _load(b, inp, parts[inp.var.name])
            w("__syncthreads();")
            for stage in schedule.loop:
                _stage(b, stage)
        finishing = [acc for acc in accumulators if _rule(acc).finalize is not None]
        for acc in finishing:
            w.op(acc)
            _rule(acc).finalize(b, acc)
        if finishing:
            w("__syncthreads();")
        for stage in schedule.post:
            _stage(b, stage)
        for out, tensor in zip(bg.outputs, scope.outputs):
            _store(b, out, tensor)


def _rule(node: Node):
    return node.opdef.rules["cuda"]


def _stage(b: BlockKernel, stage) -> None:
    for i in stage.nodes:
        node = b.bg.nodes[i]
        b.w.op(node)
        rule = _rule(node)
        (rule.update if node.opdef.is_accumulator else rule.block)(b, node)
    b.w("__syncthreads();")


def _part(b: BlockKernel, tensor: Operand, dim_map: tuple, extent: list, writable: bool) -> Operand:
    """The block's part of a device tensor (slices of `extent` along the mapped dims, picked by the
    grid coordinates), as a pointer named after the tensor."""
    terms = [f"blockIdx.{_AXES[g]} * {extent[d] * tensor.strides[d]}" for g, d in enumerate(dim_map) if d is not None]
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


def _copy_loop(b: BlockKernel, dst: Operand, src: Operand, shape: tuple, vector: int, src_step: str = "") -> None:
    """Copy an array of `shape` a row at a time, in vectors of `vector` elements."""
    shape = shape or (1,)
    space = shape[:-1] + (shape[-1] // vector,)

    def vectors(op: Operand) -> Operand:
        strides = op.strides or (1,)
        return op.viewed(space, strides[:-1] + (strides[-1] * vector,))

    with b.threads.each(b.w, math.prod(space), unrolled=True):  # loads in flight together
        b.w(f"mdsl::copy<{vector}>({dst.ptr} + {offset('i', space, vectors(dst))}, "
            f"{src.ptr}{src_step} + {offset('i', space, vectors(src))});")


def _load(b: BlockKernel, inp, part: Operand) -> None:
    when = "this iteration's tile" if inp.fmap is not None else "its tile, loaded once"
    b.w(f"// %{inp.var.name}: {when} {inp.var.type} (imap={_maps(inp.imap)}, "
        f"fmap={'-' if inp.fmap is None else inp.fmap})")
    step = ""
    if inp.fmap is not None and b.bg.forloop > 1:
        step = f" + {LOOP_COUNTER} * {inp.var.shape[inp.fmap] * part.strides[inp.fmap]}"
    _copy_loop(b, b.tile(inp.var), part, inp.var.shape, b.layout.vectors[inp.var.name], step)


def _store(b: BlockKernel, out, tensor: Operand) -> None:
    b.w(f"// %{out.var.name}: stored (omap={_maps(out.omap)})")
    part = _part(b, tensor, out.omap, list(out.var.shape), writable=True)
    _copy_loop(b, part, b.tile(out.var), out.var.shape, b.layout.vectors[out.var.name])

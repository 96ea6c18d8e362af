"""A block graph's lowering: the passes' plans and the choices made on them, which both backends write.

The passes decide everything but the code: `schedule` orders the nodes and places the barriers,
`layout` lays out the shared-memory tiles and sizes the device-memory accesses, `memory` gives each
tile its offset (and copies of the per-iteration input tiles for a pipeline). The lowering's own
choices, switchable through `CudaOptions` (mdsl.lowering.options): which matmuls run on tensor cores
(`mma`), which `accum(matmul)` sums stay in the mma's registers for the whole loop, how deep the
cp.async pipeline is, which loop chains stay in the registers of the warps owning their rows (`rows`),
which loops fold their inputs straight from device memory (`streamed`), and which loops of matmuls of
at most 16 rows stream their weights into registers (`skinny`).
"""
from __future__ import annotations

from typing import Optional

import attrs

from mdsl.ir.graph import BlockGraph
from mdsl.lowering.mma import mma_shape
from mdsl.lowering.options import CudaOptions
from mdsl.lowering.rows import RowPlan, plan_rows
from mdsl.lowering.skinny import SkinnyPlan, in_registers, scratch_bytes, skinny_plan
from mdsl.lowering.streamed import streamed_accumulators
from mdsl.passes.layout import LayoutPlan, scratch_name, select_layout
from mdsl.passes.memory import SMEM_LIMIT_BYTES, MemoryPlan, SharedMemoryError, plan_memory
from mdsl.passes.schedule import Schedule, matmul_accumulators, schedule_block_graph

ASYNC_COPY_MIN_ARCH = 80
ASYNC_COPY_BYTES = (4, 8, 16)
DEFAULT_ARCH_NUMBER = 90


@attrs.frozen
class Lowered:
    """A block graph's lowering: the passes' plans and the choices made on them."""

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


def _mma_shapes(bg: BlockGraph, layout: LayoutPlan, options: CudaOptions, arch: int) -> dict:
    if not options.mma:
        return {}
    out = {}
    for node in bg.nodes:
        if node.op == "matmul":
            a, w, o = (layout.tiles[v.name] for v in (*node.inputs, node.output))
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
    dtypes. `skinny` (the emitters pass `options.skinny`): a loop of matmuls of at most 16 rows streams its
    weights where it qualifies."""
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
        kept_out = rows.without_tiles(bg) if rows is not None else frozenset()
        streamed = streamed_accumulators(bg, schedule) if options.stream else None
        if streamed is not None:   # per-iteration tiles are read from device memory, not copied
            kept_out = frozenset(i.var.name for i in bg.inputs if i.fmap is not None) | \
                frozenset(scratch_name(bg.nodes[i]) for i in streamed)
        deepest = options.stages if _asynchronous(bg, tensor_types, layout, arch) and schedule.loop else 1
        if streamed is not None:
            deepest = 1
        for stages in range(deepest, 0, -1):
            try:
                memory = plan_memory(bg, schedule, layout, stages=stages, in_registers=kept_out)
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
        memory = plan_memory(bg, schedule, layout, stages=1, in_registers=in_registers(bg, plan))
    except SharedMemoryError:
        return None
    lowered = Lowered(schedule, layout, memory, {}, {}, options, skinny=plan, warps=bg.threads // 32)
    return lowered if lowered.smem_bytes <= SMEM_LIMIT_BYTES else None

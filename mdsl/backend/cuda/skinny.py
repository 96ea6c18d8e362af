"""Skinny matmuls: a loop whose matmuls multiply an X of at most 16 rows by weights streamed once.

At batch 1-8 a matmul X W (X: M <= 16 rows, W: K x N) is a weight stream: every byte of W is read once
and used by M rows only. The tile lowering copies W's tiles into shared memory (cp.async) and multiplies
from there; its bytes in flight per SM are the pipeline's few tiles (ncu on the H200: ~9% occupancy,
DRAM ~38% of peak for rms_norm_linear). Here, instead, each warp streams its part of W straight into
registers (`mdsl::Skinny` in the prelude): 16-byte `ld.global.nc.L1::no_allocate` loads, the next
slab's loads issued before this one's mmas, K split across the block's warps, the partial sums met in
shared memory after the loop (one barrier), no second kernel. The products run on tensor cores with
W as the mma's A operand (m16n8k16; X's rows are the mma's 8 columns): per 16 bytes of W a thread
issues one load, four byte permutes and 1/8 (M <= 8) or 1/4 (M <= 16) of an mma, where f32 FMAs on CUDA
cores would take 8 conversions and 8 M FMAs (128 at M = 16, the SM's whole issue rate at the DRAM rate).

`skinny_plan` says whether a block graph qualifies: every loop node is a matmul of the one X input
(fmap along K, at most 16 rows) by a weight input (fmap along K) whose only reader is its `accum`, that
accum, or a row accumulator of X with a `cuda_skinny` rule (accum_rms of RMSNorm+Linear: folded from
the X fragments the mmas read). Nothing is hoisted, every input is X or a weight. The code after the
loop (epilogues: the division by the rms, silu, the gate's product) is the block graph's own.

Stagger (`CudaOptions.stagger`): block b walks its slabs from slab b SLABS / blocks on, wrapping around,
so that at any moment the blocks read different rows of X (all of X is read by every block: 128 KB at
batch 8, from L2) and of the weights.

What bounds it (ncu and benchmarks/skinny_scaling.py on the H200, seventh session): each SM's L1 data
pipe. On the busiest SM `l1tex__throughput` ran at 94-97% of its peak while DRAM moved 2.5-2.6 TB/s; one
SM drew 30-37 GB/s whatever its warps (4 or 8), and 48 to 132 blocks of 64 columns took 14 to 20 us. A
load's cost there is the lines it touches: a weight load touches 4 (4 rows x 128 bytes), an 8-byte load of
X's fragments 8 (one a row of X, 32 bytes each), and at batch 8 (16 rows, two of them a slab) X's loads
touched as many lines as the weights'. Hence:

Wide X (`CudaOptions.wide_x`): a warp's step is two slabs (32 rows of K), lane t's mma rows 8t .. 8t + 7,
so that its X fragments of both come in one 16-byte load: half the X loads and the lines they touch.
RMSNorm+Linear batch 8 19.1 -> 17.1 us, batch 1 17.0 -> 15.7 us (with lead 0).

Lead (`CudaOptions.lead`): the loop sends the weight slabs of the iteration `lead` ahead to L2 (`prefetch.
global.L2`, no registers held); 0: no prefetches in the loop (an overlapping start still sends the first
slabs). Each prefetch touches a line in the same pipe, so with 8 warps a block (enough loads in flight from
the register buffers alone) none is faster; with 4 warps a block, a lead of 2. A lead of 4 was slower
everywhere.

Overlap (`CudaOptions.overlap`, sm_90+): the kernel is launched with programmatic stream serialization
(`KernelLaunch.overlap`), so that it may start while the previous kernel of the stream still runs: it
sends its first weight slabs to L2, waits for that kernel (griddepcontrol.wait: nothing in global memory
is read or written before), then lets the next kernel launch. Its launch and the first loads' latency
overlap the previous kernel's tail.
"""
from __future__ import annotations

import math
from typing import Optional

import attrs

from mdsl.backend.cuda.loops import SUM, SUM_OF_SQUARES, Fold
from mdsl.backend.cuda.options import OVERLAP_MIN_ARCH
from mdsl.backend.cuda.source import offset
from mdsl.ir.graph import BlockGraph
from mdsl.ir.ops import extend_op
from mdsl.ir.skinny import GROUP_CHUNKS, MAX_ROWS, SkinnyShape, skinny_shape

SKINNY_MIN_ARCH = 80   # mma.sync and ld.global.nc.L1::no_allocate
_ELEMENTS = {"f16": "__half", "bf16": "__nv_bfloat16"}


@attrs.frozen
class SkinnyPlan:
    shape: SkinnyShape  # the loop's structure (mdsl.ir.skinny)
    element: str        # the 16-bit C type of X and the weights
    overlap: bool = False  # launched to overlap the previous kernel (programmatic dependent launch)
    stagger: bool = False  # each block walks its K from its own starting slab
    lead: int = 2          # loop iterations the L2 prefetches run ahead of the loads
    wide_x: bool = False   # a warp's step is two slabs, X's fragments of both in one 16-byte load

    def part_row(self) -> int:
        """Floats between two rows of X in a warp's partial sums in shared memory: N + 1, odd, so that the
        lanes of a quad (rows 2t apart) store into different banks (N: 8 lanes, 1 bank, a 5.4-way conflict
        in ncu on the H200). The prelude's `Skinny::PART_LD` is the same."""
        return self.shape.n + 1


def skinny_plan(bg: BlockGraph, schedule, tensor_types: tuple, arch: int, overlap: bool = False,
                stagger: bool = False, lead: int = 2, wide_x: bool = False) -> Optional[SkinnyPlan]:
    """The skinny plan of a block graph, or None where it does not qualify: its loop has the skinny
    shape (`mdsl.ir.skinny.skinny_shape`) and nothing hoisted, X and the weights share a 16-bit dtype,
    their rows are 8- and 16-byte aligned, each row accumulator has a `cuda_skinny` rule, and the
    weights' 64-column groups divide among the warps. `overlap` where the arch has programmatic dependent
    launch (sm_90+); `stagger` and `lead` as asked; `wide_x` where X's rows are 16-byte aligned and the
    block's K is whole pairs of slabs."""
    if arch < SKINNY_MIN_ARCH or schedule.pre or bg.threads % 32:
        return None
    shape = skinny_shape(bg)
    if shape is None or not shape.fits(bg.threads // 32):
        return None
    types = {i.var.name: t for i, t in zip(bg.inputs, tensor_types)}
    dtypes = {types[name].dtype.name for name in (shape.x, *shape.weights)}
    if len(dtypes) != 1 or not dtypes <= set(_ELEMENTS):
        return None
    if types[shape.x].shape[-1] % 4 or any(types[w].shape[-1] % shape.columns_per_load() for w in shape.weights):
        return None   # rows of X 8-byte aligned, of the weights aligned to a load
    if any("cuda_skinny" not in bg.nodes[i].opdef.rules for i in shape.rows):
        return None
    wide_x = wide_x and types[shape.x].shape[-1] % 8 == 0 and shape.k % (2 * 16) == 0
    return SkinnyPlan(shape, _ELEMENTS[dtypes.pop()], overlap and arch >= OVERLAP_MIN_ARCH, stagger, lead, wide_x)


def in_registers(bg: BlockGraph, plan: SkinnyPlan) -> frozenset:
    """The tiles the skinny loop does not need: its inputs' and the matmuls' products."""
    shape = plan.shape
    products = {bg.nodes[i].inputs[0].name for i in shape.sums}
    return frozenset({shape.x, *shape.weights} | products)


def scratch_bytes(plan: SkinnyPlan, warps: int) -> int:
    """Shared memory after the memory plan's: each warp's partial sums, then each row accumulator's per warp."""
    shape = plan.shape
    kw = warps // shape.groups()
    return 4 * (len(shape.weights) * kw * shape.m * plan.part_row() + len(shape.rows) * warps * MAX_ROWS)


def emit_skinny(b, bg: BlockGraph, skinny: SkinnyPlan, parts: dict, scratch_offset: int) -> None:
    """The loop: each warp's streamed part, its partial sums met in shared memory into the accumulators'
    tiles (and the row accumulators' folds into theirs, then finalized by their own rules)."""
    plan = skinny.shape
    w, warps = b.w, bg.threads // 32
    mats, kw, k = len(plan.weights), warps // plan.groups(), plan.k
    x_part = parts[plan.x]
    x_ptr, w_ptrs = x_part.ptr, [parts[name].ptr for name in plan.weights]
    cls = (f"mdsl::Skinny<{skinny.element}, {plan.m}, {plan.n}, {k}, {x_part.strides[0]}, "
           f"{parts[plan.weights[0]].strides[0]}, {warps}, {mats}, {plan.columns_per_load()}"
           f"{_tail_arguments(skinny, straddles(plan, parts[plan.weights[0]].strides[0]))}>")
    w(f"// skinny loop: X %{plan.x} ({plan.m} rows) times {mats} weight(s) streamed from device memory, "
      f"K = {k} split over {kw} warp(s) along K")
    for i in plan.rows:
        bg.nodes[i].opdef.rules["cuda"].init(b, bg.nodes[i])
    part = b.namer("s_skinny_part")
    w(f"float* const {part} = reinterpret_cast<float*>(smem + {scratch_offset});")
    w(f"const {skinny.element}* const skinny_w[{mats}] = {{{', '.join(w_ptrs)}}};",
      f"{cls}::Acc skinny_acc;")
    if skinny.overlap:   # no global memory touched above: the previous kernel may still be running
        w(f"{cls}::prefetch_start(skinny_w);   // changes no value: may run before the previous kernel ends",
          "mdsl::wait_for_previous_kernel();   // its writes are visible from here on",
          "mdsl::let_next_kernel_launch();")
    folds = [b.namer(f"p_{bg.nodes[i].output.name}") for i in plan.rows]
    mt = -(-plan.m // 8)
    for name, i in zip(folds, plan.rows):
        identity = bg.nodes[i].opdef.rules["cuda_skinny"].fold.identity
        w(f"float {name}[{mt}] = {{{', '.join([identity] * mt)}}};")
    with w.block(f"{cls}::run(skinny_acc, {x_ptr}, skinny_w, [&](int mt, float x)"):
        for name, i in zip(folds, plan.rows):
            w(f"{{ float& v = {name}[mt]; v = {bg.nodes[i].opdef.rules['cuda_skinny'].fold.step}; }}")
    w(");", f"{cls}::store_part(skinny_acc, {part});")
    rows_base = mats * kw * plan.m * skinny.part_row()
    for r, (name, i) in enumerate(zip(folds, plan.rows)):
        combine = bg.nodes[i].opdef.rules["cuda_skinny"].fold.combine
        w(f"// %{bg.nodes[i].output.name}: each warp's fold of its rows, over the quad's lanes")
        with w.block(f"for (int mt = 0; mt < {mt}; ++mt)"):
            w(f"const float v = mdsl::quad_reduce({name}[mt], {combine});",
              "const int row = mt * 8 + (threadIdx.x % 32) / 4;")
            w(f"if (threadIdx.x % 4 == 0 && row < {plan.m}) "
              f"{part}[{rows_base + r * warps * MAX_ROWS} + threadIdx.x / 32 * {MAX_ROWS} + row] = v;")
    w("__syncthreads();")
    _WarpSums(b, bg, plan, part, kw, warps, rows_base, skinny.part_row()).into_tiles()
    w("__syncthreads();")
    finishing = [i for i in plan.rows if bg.nodes[i].opdef.rules["cuda"].finalize is not None]
    for i in finishing:
        w.op(bg.nodes[i])
        bg.nodes[i].opdef.rules["cuda"].finalize(b, bg.nodes[i])
    if finishing:
        w("__syncthreads();")


LINE = 128   # bytes of an L2 line: what one prefetch.global.L2 brings


def straddles(shape: SkinnyShape, ldw: int, element_bytes: int = 2) -> bool:
    """Whether a column group's row (the bytes a warp's lanes load from one row of a weight) may cross a
    line: its start, over the blocks and groups, is a multiple of gcd(block's columns, group's columns,
    row, line) bytes from a line (weights are line-aligned: device allocations are), so it crosses one where
    that is less than its length (48 columns a block: 96 bytes at multiples of 32). Then the L2 prefetches
    take its last element's line as well as its first."""
    group = min(shape.chunks(), GROUP_CHUNKS) * shape.columns_per_load() * element_bytes
    step = math.gcd(shape.n * element_bytes, group, ldw * element_bytes, LINE)
    return group > step


def _tail_arguments(skinny: SkinnyPlan, straddle: bool) -> str:
    """mdsl::Skinny's defaulted template arguments (STAGGER, LEAD, STRADDLE, WIDE_X), up to the last
    that differs from its default (so that the sources of plans without them stay as they were, and their
    cached kernels)."""
    tail = [("true" if skinny.stagger else "false", skinny.stagger), (str(skinny.lead), skinny.lead != 2),
            ("true" if straddle else "false", straddle),
            ("true" if skinny.wide_x else "false", skinny.wide_x)]
    while tail and not tail[-1][1]:
        tail.pop()
    return "".join(f", {text}" for text, _ in tail)


class _WarpSums:
    """The block's sums over its warps' partials (a fixed order), written by `emit` wherever they go:
    the accumulators' tiles, or a slot of the cluster's meeting area."""

    def __init__(self, b, bg: BlockGraph, plan: SkinnyShape, part: str, kw: int, warps: int, rows_base: int,
                 row: int):
        self.b, self.bg, self.plan, self.part, self.kw, self.warps, self.rows_base = b, bg, plan, part, kw, warps, rows_base
        self.row = row   # SkinnyPlan.part_row

    def emit(self, sum_to, fold_to) -> None:
        """sum_to(mat, value expression) and fold_to(row accumulator's position, its node, value expression):
        the statements that put each sum where it goes (`i`: the element of M x N; threadIdx.x: the row)."""
        b, plan, part = self.b, self.plan, self.part
        w = b.w
        for mat, i in enumerate(plan.sums):
            w.op(self.bg.nodes[i])
            w("// the warps' partial sums, in a fixed order")
            with b.threads.each(w, plan.m * plan.n):
                w("float sum = 0.0f;", "#pragma unroll")
                with w.block(f"for (int kw = 0; kw < {self.kw}; ++kw)"):
                    w(f"sum += {part}[({mat} * {self.kw} + kw) * {plan.m * self.row} + i / {plan.n} * {self.row} "
                      f"+ i % {plan.n}];")
                w(sum_to(mat, "sum"))
        for r, i in enumerate(plan.rows):
            node = self.bg.nodes[i]
            w.op(node)
            combine = node.opdef.rules["cuda_skinny"].fold.combine
            base = self.rows_base + r * self.warps * MAX_ROWS
            with w.block(f"if (threadIdx.x < {plan.m})"):
                w(f"float v = {part}[{base} + threadIdx.x];", "#pragma unroll")
                with w.block(f"for (int warp = 1; warp < {self.warps}; ++warp)"):
                    w(f"v = {combine}(v, {part}[{base} + warp * {MAX_ROWS} + threadIdx.x]);")
                w(fold_to(r, node, "v"))

    def into_tiles(self) -> None:
        b, plan = self.b, self.plan

        def sum_to(mat: int, value: str) -> str:
            tile = b.tile(self.bg.nodes[plan.sums[mat]].output)
            return f"{tile.at(offset('i', (plan.m, plan.n), tile))} = mdsl::from_float<{tile.ctype}>({value});"

        def fold_to(r: int, node, value: str) -> str:
            tile = b.tile(node.output)
            at = tile.at(offset("threadIdx.x", tuple(tile.shape), tile))
            return f"{at} = {node.opdef.rules['cuda_skinny'].fold.combine}({at}, {value});"

        self.emit(sum_to, fold_to)


@attrs.frozen
class SkinnyRows:
    """A row accumulator of X folded from the fragments the mmas read: its fold must combine by sum
    (the warps' and lanes' folds meet in any grouping)."""

    fold: Fold


_RULES = {
    "accum_sum": SkinnyRows(SUM),
    "accum_mean": SkinnyRows(SUM),
    "accum_rms": SkinnyRows(SUM_OF_SQUARES),
}

for _name, _rule in _RULES.items():
    extend_op(_name, cuda_skinny=_rule)

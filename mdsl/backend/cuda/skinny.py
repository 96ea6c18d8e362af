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
"""
from __future__ import annotations

from typing import Optional

import attrs

from mdsl.backend.cuda.loops import SUM, SUM_OF_SQUARES, Fold
from mdsl.backend.cuda.source import offset
from mdsl.ir.graph import BlockGraph
from mdsl.ir.ops import extend_op
from mdsl.ir.skinny import MAX_ROWS, SkinnyShape, skinny_shape

SKINNY_MIN_ARCH = 80   # mma.sync and ld.global.nc.L1::no_allocate
_ELEMENTS = {"f16": "__half", "bf16": "__nv_bfloat16"}


@attrs.frozen
class SkinnyPlan:
    shape: SkinnyShape  # the loop's structure (mdsl.ir.skinny)
    element: str        # the 16-bit C type of X and the weights


def skinny_plan(bg: BlockGraph, schedule, tensor_types: tuple, arch: int) -> Optional[SkinnyPlan]:
    """The skinny plan of a block graph, or None where it does not qualify: its loop has the skinny
    shape (`mdsl.ir.skinny.skinny_shape`) and nothing hoisted, X and the weights share a 16-bit dtype,
    their rows are 8- and 16-byte aligned, each row accumulator has a `cuda_skinny` rule, and the
    weights' 64-column groups divide among the warps."""
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
    return SkinnyPlan(shape, _ELEMENTS[dtypes.pop()])


def in_registers(bg: BlockGraph, plan: SkinnyPlan) -> frozenset:
    """The tiles the skinny loop does not need: its inputs' and the matmuls' products."""
    shape = plan.shape
    products = {bg.nodes[i].inputs[0].name for i in shape.sums}
    return frozenset({shape.x, *shape.weights} | products)


def scratch_bytes(plan: SkinnyPlan, warps: int) -> int:
    """Shared memory after the memory plan's: each warp's partial sums, each row accumulator's per warp."""
    shape = plan.shape
    kw = warps // shape.groups()
    return 4 * (len(shape.weights) * kw * shape.m * shape.n + len(shape.rows) * warps * MAX_ROWS)


def emit_skinny(b, bg: BlockGraph, skinny: SkinnyPlan, parts: dict, scratch_offset: int) -> None:
    """The loop: each warp's streamed part, its partial sums met in shared memory into the accumulators'
    tiles (and the row accumulators' folds into theirs, then finalized by their own rules)."""
    plan = skinny.shape
    w, warps = b.w, bg.threads // 32
    mats, kw = len(plan.weights), warps // plan.groups()
    x_part = parts[plan.x]
    cls = (f"mdsl::Skinny<{skinny.element}, {plan.m}, {plan.n}, {plan.k}, {x_part.strides[0]}, "
           f"{parts[plan.weights[0]].strides[0]}, {warps}, {mats}, {plan.columns_per_load()}>")
    w(f"// skinny loop: X %{plan.x} ({plan.m} rows) times {mats} weight(s) streamed from device memory, "
      f"K = {plan.k} split over {kw} warp(s) along K")
    for i in plan.rows:
        bg.nodes[i].opdef.rules["cuda"].init(b, bg.nodes[i])
    part = b.namer("s_skinny_part")
    w(f"float* const {part} = reinterpret_cast<float*>(smem + {scratch_offset});")
    weights = ", ".join(parts[name].ptr for name in plan.weights)
    w(f"const {skinny.element}* const skinny_w[{mats}] = {{{weights}}};",
      f"{cls}::Acc skinny_acc;")
    folds = [b.namer(f"p_{bg.nodes[i].output.name}") for i in plan.rows]
    mt = -(-plan.m // 8)
    for name, i in zip(folds, plan.rows):
        identity = bg.nodes[i].opdef.rules["cuda_skinny"].fold.identity
        w(f"float {name}[{mt}] = {{{', '.join([identity] * mt)}}};")
    with w.block(f"{cls}::run(skinny_acc, {x_part.ptr}, skinny_w, [&](int mt, float x)"):
        for name, i in zip(folds, plan.rows):
            w(f"{{ float& v = {name}[mt]; v = {bg.nodes[i].opdef.rules['cuda_skinny'].fold.step}; }}")
    w(");", f"{cls}::store_part(skinny_acc, {part});")
    rows_base = mats * kw * plan.m * plan.n
    for k, (name, i) in enumerate(zip(folds, plan.rows)):
        combine = bg.nodes[i].opdef.rules["cuda_skinny"].fold.combine
        w(f"// %{bg.nodes[i].output.name}: each warp's fold of its rows, over the quad's lanes")
        with w.block(f"for (int mt = 0; mt < {mt}; ++mt)"):
            w(f"const float v = mdsl::quad_reduce({name}[mt], {combine});",
              "const int row = mt * 8 + (threadIdx.x % 32) / 4;")
            w(f"if (threadIdx.x % 4 == 0 && row < {plan.m}) "
              f"{part}[{rows_base + k * warps * MAX_ROWS} + threadIdx.x / 32 * {MAX_ROWS} + row] = v;")
    w("__syncthreads();")
    for mat, i in enumerate(plan.sums):
        tile = b.tile(bg.nodes[i].output)
        w.op(bg.nodes[i])
        w("// the warps' partial sums, in a fixed order")
        shape = (plan.m, plan.n)
        with b.threads.each(w, plan.m * plan.n):
            w("float sum = 0.0f;", "#pragma unroll")
            with w.block(f"for (int kw = 0; kw < {kw}; ++kw)"):
                w(f"sum += {part}[({mat} * {kw} + kw) * {plan.m * plan.n} + i];")
            w(f"{tile.at(offset('i', shape, tile))} = mdsl::from_float<{tile.ctype}>(sum);")
    for k, i in enumerate(plan.rows):
        node = bg.nodes[i]
        tile = b.tile(node.output)
        w.op(node)
        combine = node.opdef.rules["cuda_skinny"].fold.combine
        with w.block(f"if (threadIdx.x < {plan.m})"):
            w(f"float v = {part}[{rows_base + k * warps * MAX_ROWS} + threadIdx.x];", "#pragma unroll")
            with w.block(f"for (int warp = 1; warp < {warps}; ++warp)"):
                w(f"v = {combine}(v, {part}[{rows_base + k * warps * MAX_ROWS} + warp * {MAX_ROWS} + threadIdx.x]);")
            at = tile.at(offset("threadIdx.x", tuple(tile.shape), tile))
            w(f"{at} = {combine}({at}, v);")
    w("__syncthreads();")
    finishing = [i for i in plan.rows if bg.nodes[i].opdef.rules["cuda"].finalize is not None]
    for i in finishing:
        w.op(bg.nodes[i])
        bg.nodes[i].opdef.rules["cuda"].finalize(b, bg.nodes[i])
    if finishing:
        w("__syncthreads();")


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

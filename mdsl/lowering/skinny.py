"""Skinny matmuls: a loop whose matmuls multiply an X of at most 16 rows by weights streamed once.

At batch 1-8 a matmul X W (X: M <= 16 rows, W: K x N) is a weight stream: every byte of W is read once
and used by M rows only. The tile lowering copies W's tiles into shared memory (cp.async) and multiplies
from there, with the pipeline's few tiles in flight per SM. The skinny loop instead has each warp stream
its part of W straight into registers: 16-byte `ld.global.nc.L1::no_allocate` loads, the next slab's
loads issued before this one's mmas, K split across the block's warps, the partial sums met in shared
memory after the loop (one barrier), no second kernel. The products run on tensor cores with W as the
mma's A operand (m16n8k16; X's rows are the mma's 8 columns): per 16 bytes of W a thread issues one
load, four byte permutes and 1/8 (M <= 8) or 1/4 (M <= 16) of an mma, where f32 FMAs would take 8
conversions and 8 M FMAs.

The load schedule, which both backends follow (the CUDA prelude's `mdsl::Skinny`, the PTX backend's
`SkinnyLoop`): lane (g, t) of a warp holds chunk g (`columns_per_load` columns) of rows `lane_rows` t ..
of each step of `span` 16-row slabs of a weight, and X's fragments of rows g and g + 8; the steps are
dealt to the warps along K, `step` of them a register buffer, two buffers in turn (one's loads in
flight while the other's mmas run); the rows of the steps `lead` iterations ahead are sent to L2
(`prefetch.global.L2`). Each warp's sums go to shared memory (`part_row` floats a row of X); the row
accumulators of X (accum_rms's sum of squares) are folded from the X fragments the mmas read, by the
warps of the first column group, each row's folds met over the quad, then over the warps. A weight stored
[N, K] (a linear layer's [out, in], read through a block-level transpose: `SkinnyShape.transposed`) is
loaded along K instead: lane (g, t) loads each of its chunk's `columns_per_load` rows of N at K
`lane_rows` t .. (8 bytes, 16 with wide_x), whose words are the mma's A fragments as they come (no byte
permutes), and no row of it is sent to L2 ahead.

`skinny_plan` says whether a block graph qualifies: every loop node is a matmul of the one operand
(at most 16 rows) by a weight input (fmap along K), or by the transpose of one stored [N, K], whose only
reader is its `accum`, that accum, such a transpose, a row accumulator of the operand with a fold in
`ROW_FOLDS` (accum_rms of RMSNorm+Linear), or an element-wise node of the *prologue*, which computes
the operand from the X input (fmap along K) and from *vectors*, inputs of one value per element of K
broadcast along X's rows ([1, K] or [K]: `x * 2.0 @ w`,
`rms_norm(silu(x)) @ w`, `(x - b) @ w`, `(x * g) @ w`). Nothing is hoisted, every input is X, a weight or
a vector. A vector's fragment is loaded beside X's, at the same K (lane t's elements ROWS t .. of the
step, one load for all of X's rows), into the same register buffer. The prologue runs on X's fragments
as a slab's mmas take them, in f32, each value rounded to its dtype as its tile would hold it, so the
products and the folds see the operand's values, and X's loads stay where the register buffers put
them. The code after the loop (epilogues: the division by the rms, silu, the gate's product) is the
block graph's own.

The options (`CudaOptions`):

* stagger: block b walks its slabs from slab b SLABS / blocks on, wrapping around, so that at any moment
  the blocks read different rows of X (all of X is read by every block, from L2) and of the weights;
* wide_x: a warp's step is two slabs (32 rows of K), lane t's mma rows 8t .. 8t + 7, so that its X
  fragments of both come in one 16-byte load: half the X loads and the L1 lines they touch (an SM's L1
  data pipe bounds the loop: a load costs the lines it touches);
* lead: the loop sends the weight slabs of the iteration `lead` ahead to L2 (no registers held); 0: no
  prefetches in the loop (an overlapping start still sends the first slabs);
* overlap (sm_90+): the kernel is launched with programmatic stream serialization, so that it may start
  while the previous kernel of the stream still runs: it sends its first weight slabs to L2, waits for
  that kernel (griddepcontrol.wait: nothing in global memory is read or written before), then lets the
  next kernel launch.
"""
from __future__ import annotations

import math
from typing import Optional

import attrs

from mdsl.ir.graph import BlockGraph
from mdsl.ir.rules import RuleTable
from mdsl.ir.skinny import GROUP_CHUNKS, MAX_ROWS, REGISTER_BUFFER, SLAB, SkinnyShape, skinny_shape
from mdsl.lowering.options import OVERLAP_MIN_ARCH

SKINNY_MIN_ARCH = 80   # mma.sync and ld.global.nc.L1::no_allocate
ELEMENTS = ("f16", "bf16")
LINE = 128   # bytes of an L2 line: what one prefetch.global.L2 brings

#: a row accumulator of X folded from the fragments the mmas read -> the name of its fold (each backend's
#: `FOLDS`), which combines by sum (the warps' and lanes' folds meet in any grouping)
ROW_FOLDS: RuleTable[str] = RuleTable("skinny loop's row folds", str, "mdsl.lowering.skinny (ROW_FOLDS)")
ROW_FOLDS.register("accum_sum", "sum")
ROW_FOLDS.register("accum_mean", "sum")
ROW_FOLDS.register("accum_rms", "sum_of_squares")


@attrs.frozen
class SkinnyPlan:
    shape: SkinnyShape  # the loop's structure (mdsl.ir.skinny)
    element: str        # the 16-bit dtype name of X and the weights
    overlap: bool = False  # launched to overlap the previous kernel (programmatic dependent launch)
    stagger: bool = False  # each block walks its K from its own starting slab
    lead: int = 2          # loop iterations the L2 prefetches run ahead of the loads
    wide_x: bool = False   # a warp's step is two slabs, X's fragments of both in one 16-byte load

    def part_row(self) -> int:
        """Floats between two rows of X in a warp's partial sums in shared memory: N + 1, odd, so that the
        lanes of a quad (rows 2t apart) store into different banks. The prelude's `Skinny::PART_LD`."""
        return self.shape.n + 1

    @property
    def span(self) -> int:
        """16-row slabs of K in one step of a warp."""
        return 2 if self.wide_x else 1

    @property
    def lane_rows(self) -> int:
        """Rows of a step each lane loads of a weight, from row `lane_rows` t."""
        return 4 * self.span

    @property
    def steps(self) -> int:
        """Steps of the block's K."""
        return self.shape.k // (SLAB * self.span)

    @property
    def step(self) -> int:
        """Steps a warp loads at once into one register buffer."""
        return max(1, REGISTER_BUFFER // (self.shape.columns_per_load() * len(self.shape.weights) * self.span))

    def warps_along_k(self, warps: int) -> int:
        return warps // self.shape.groups()

    def rows_base(self, warps: int) -> int:
        """Where the row accumulators' per-warp folds start among the partial sums (floats): after each
        weight's per-warp sums (weight, warp along K, row of X, column)."""
        shape = self.shape
        return len(shape.weights) * self.warps_along_k(warps) * shape.m * self.part_row()

    def row_folds_at(self, r: int, warps: int) -> int:
        """Where row accumulator r's folds start (MAX_ROWS floats a warp)."""
        return self.rows_base(warps) + r * warps * MAX_ROWS


def skinny_plan(bg: BlockGraph, schedule, tensor_types: tuple, arch: int, overlap: bool = False,
                stagger: bool = False, lead: int = 2, wide_x: bool = False) -> Optional[SkinnyPlan]:
    """The skinny plan of a block graph, or None where it does not qualify: its loop has the skinny
    shape (`mdsl.ir.skinny.skinny_shape`) and nothing hoisted, X, the weights and the prologue's vectors
    share a 16-bit dtype, the rows of X and the vectors are 8-byte aligned and the weights' aligned to a
    load, each row accumulator has a fold in `ROW_FOLDS`, and the weights' 64-column groups divide among
    the warps. `overlap` where the arch has programmatic dependent launch (sm_90+); `stagger` and `lead` as
    asked; `wide_x` where the rows of X and the vectors are 16-byte aligned and the block's K is whole
    pairs of slabs."""
    if arch < SKINNY_MIN_ARCH or schedule.pre or bg.threads % 32:
        return None
    shape = skinny_shape(bg)
    if shape is None or not shape.fits(bg.threads // 32):
        return None
    types = {i.var.name: t for i, t in zip(bg.inputs, tensor_types)}
    dtypes = {types[name].dtype.name for name in (shape.x, *shape.weights, *shape.vectors)}
    if shape.prologue:   # the operand goes to the mmas in X's type; the values before it in any float type
        dtypes.add(bg.nodes[shape.prologue[-1]].output.type.dtype.name)
        if any(bg.nodes[i].output.type.dtype.name not in (*ELEMENTS, "f32") for i in shape.prologue):
            return None
    if len(dtypes) != 1 or not dtypes <= set(ELEMENTS):
        return None
    # loaded 8 (wide_x: 16) bytes at a time from each row; so are weights stored [N, K], along K
    fragments = (shape.x, *shape.vectors) + (shape.weights if shape.transposed else ())
    if any(types[name].shape[-1] % 4 for name in fragments) or (not shape.transposed and any(
            types[w].shape[-1] % shape.columns_per_load() for w in shape.weights)):
        return None
    if any(bg.nodes[i].op not in ROW_FOLDS for i in shape.rows):
        return None
    wide_x = wide_x and all(types[name].shape[-1] % 8 == 0 for name in fragments) and shape.k % (2 * SLAB) == 0
    return SkinnyPlan(shape, dtypes.pop(), overlap and arch >= OVERLAP_MIN_ARCH, stagger, lead, wide_x)


def in_registers(bg: BlockGraph, plan: SkinnyPlan) -> frozenset:
    """The tiles the skinny loop does not need: its inputs', the prologue's values, the weights' transposes and
    the matmuls' products."""
    shape = plan.shape
    products = {bg.nodes[i].inputs[0].name for i in shape.sums}
    made = {bg.nodes[i].output.name for i in (*shape.prologue, *shape.transposes)}
    return frozenset({shape.x, *shape.weights, *shape.vectors} | products | made)


def scratch_bytes(plan: SkinnyPlan, warps: int) -> int:
    """Shared memory after the memory plan's: each warp's partial sums, then each row accumulator's per warp."""
    return 4 * (plan.rows_base(warps) + len(plan.shape.rows) * warps * MAX_ROWS)


def straddles(shape: SkinnyShape, ldw: int, element_bytes: int = 2) -> bool:
    """Whether a column group's row (the bytes a warp's lanes load from one row of a weight) may cross a
    line: its start, over the blocks and groups, is a multiple of gcd(block's columns, group's columns,
    row, line) bytes from a line (weights are line-aligned: device allocations are), so it crosses one where
    that is less than its length (48 columns a block: 96 bytes at multiples of 32). Then the L2 prefetches
    take its last element's line as well as its first."""
    group = min(shape.chunks(), GROUP_CHUNKS) * shape.columns_per_load() * element_bytes
    step = math.gcd(shape.n * element_bytes, group, ldw * element_bytes, LINE)
    return group > step

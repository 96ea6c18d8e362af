"""Row-resident chains: the loop nodes that stay in the tensor cores' registers, and the layout both
backends hold them in.

Online softmax (flash attention) and its kin are chains of a matmul, reductions along the last dim,
element-wise ops on the rows, a second matmul and accumulators, all on the same rows. Lowered op by op
through shared memory, each link costs a round trip and a barrier, and the row statistics a
cross-warp reduction. Held in registers, warp w owns the 16-row tiles w, w + warps, ... of the block's
rows and every column of them, in the mma's C-fragment layout: a matmul's product stays where the mma
leaves it, a row's max or sum is a fold over the thread's own elements and two shuffles within its quad,
an element-wise op works on the registers, the next matmul takes its A operand straight from them, and
the accumulators keep their running values there for the whole loop. Nothing of the chain touches shared
memory, and its stages need no barrier.

Values held this way: a *matrix* (rows x cols; lane l, with g = l / 4 and t = l % 4, holds element e of
column group n of row tile j: row g + (e / 2) * 8, column 8 n + 2 t + e % 2) or a *row vector* (rows x 1:
rows g and g + 8 of row tile j, the same on the 4 lanes of a quad).

`plan_rows` decides which loop nodes qualify: each op's rule in `ROW_RULES` says when it accepts a node,
given the values already in registers, and how many columns its value has (every element-wise op, and a
fused chain of them, by its category). Each backend writes the accepted nodes with its own rule of the
same op (mdsl.backend.cuda.rows, mdsl.backend.ptx.rows).
"""
from __future__ import annotations

import math
from typing import Optional

import attrs

from mdsl.ir.graph import BlockGraph, Node
from mdsl.ir.ops import THREAD, OpDef
from mdsl.ir.rules import RuleTable
from mdsl.passes.layout import scratch_name

VECTOR = None   # the `cols` of a row vector


@attrs.frozen
class RowGeometry:
    """The rows every row-resident value of a block shares: `batch` matrices of `rows` rows, dealt to
    `warps` warps 16 rows at a time."""

    batch: int
    rows: int
    warps: int

    @property
    def tm(self) -> int:
        return -(-self.rows // 16)

    @property
    def row_tiles(self) -> int:
        return self.batch * self.tm

    @property
    def rt(self) -> int:
        return -(-self.row_tiles // self.warps)


@attrs.frozen
class RowPlan:
    geometry: RowGeometry
    nodes: frozenset      # indices of the loop nodes lowered in registers
    values: dict          # value name -> its column count (VECTOR for a row vector)

    def accumulators(self, bg: BlockGraph) -> list:
        return [i for i in sorted(self.nodes) if bg.nodes[i].opdef.is_accumulator]

    def without_tiles(self, bg: BlockGraph) -> frozenset:
        """Tiles the lowering never touches: the chain's values (but the accumulators', stored after the
        loop) and the scratch of the accumulators kept in registers."""
        names = set()
        for i in self.nodes:
            node = bg.nodes[i]
            if node.opdef.is_accumulator:
                names.add(scratch_name(node))
            else:
                names.update(v.name for v in node.outputs)
        return frozenset(names)


# ---------------------------------------------------------------------------------------------
# which nodes


class RowContext:
    """What a rule's `accepts` sees: the geometry, the values already accepted, the tiles and mma shapes."""

    def __init__(self, geometry: RowGeometry, values: dict, mma: dict, tile_shapes: dict):
        self.geometry, self.values, self.mma, self.tile_shapes = geometry, values, mma, tile_shapes

    def is_matrix(self, var, cols: Optional[int] = None) -> bool:
        c = self.values.get(var.name, "absent")
        return c not in ("absent", VECTOR) and (cols is None or c == cols)

    def is_vector(self, var) -> bool:
        return var.name in self.values and self.values[var.name] is VECTOR

    def in_registers(self, var) -> bool:
        return var.name in self.values

    def rows_of(self, shape: tuple) -> bool:
        """Whether a value of `shape` has the geometry's batch and rows."""
        g = self.geometry
        return len(shape) >= 2 and shape[-2] == g.rows and math.prod(shape[:-2]) == g.batch

    def broadcastable(self, var, out_shape: tuple) -> bool:
        """A shared-memory tile an element-wise op can read at any (batch, row, column) of `out_shape`."""
        shape = tuple(var.shape)
        if len(shape) < 2 or var.name not in self.tile_shapes:
            return len(shape) <= 1 and math.prod(shape) == 1 and var.name in self.tile_shapes
        batch = math.prod(shape[:-2])
        return (batch in (1, self.geometry.batch) and shape[-2] in (1, out_shape[-2])
                and shape[-1] in (1, out_shape[-1]))


class RowRule:
    """Whether an op's node can be held in row registers: `accepts(ctx, node)` is its value's column
    count (VECTOR for a row vector), or False; `reduces`: whether it reduces rows (then the chain pays
    even where some warps idle)."""

    reduces = False

    def accepts(self, ctx: RowContext, node: Node):
        raise NotImplementedError


class Elementwise(RowRule):
    """An element-wise op (or a fused chain of them) on row-resident values, reading tiles that
    broadcast to its shape as it goes."""

    def accepts(self, ctx: RowContext, node: Node):
        if len(node.outputs) != 1 or not any(ctx.in_registers(v) for v in node.inputs):
            return False
        out = tuple(node.output.shape)
        if not ctx.rows_of(out):
            return False
        cols = VECTOR if out[-1] == 1 else out[-1]
        for v in node.inputs:
            if ctx.is_vector(v):
                continue
            if ctx.is_matrix(v):
                if cols is VECTOR or ctx.values[v.name] != cols:
                    return False
            elif not ctx.broadcastable(v, out):
                return False
        return cols


class Reduction(RowRule):
    """max / sum / mean of each row (the last dim, kept): the thread's elements, then its quad."""

    reduces = True

    def accepts(self, ctx: RowContext, node: Node):
        (x,) = node.inputs
        dim = node.attr("dim")
        last = dim in (-1, len(x.shape) - 1)
        if not (ctx.is_matrix(x) and last and node.attr("keepdim", False) and ctx.rows_of(node.output.shape)):
            return False
        return VECTOR


class Matmul(RowRule):
    """A tensor-core matmul whose product stays in registers: A from the registers of a row-resident
    matrix or from a tile, B from a tile."""

    def accepts(self, ctx: RowContext, node: Node):
        a, w = node.inputs
        out = tuple(node.output.shape)
        if node.output.name not in ctx.mma or not ctx.rows_of(out) or ctx.in_registers(w):
            return False
        if ctx.in_registers(a) and not ctx.is_matrix(a, a.shape[-1]):
            return False
        if not ctx.in_registers(a) and a.name not in ctx.tile_shapes:
            return False
        return out[-1]


class Accumulate(RowRule):
    """accum / accum_max of a row-resident value: the running value in registers for the whole loop."""

    def accepts(self, ctx: RowContext, node: Node):
        (x,) = node.inputs
        return ctx.values[x.name] if ctx.in_registers(x) else False


class Rescaled(RowRule):
    """Online softmax's accum_rescale(x, m) in registers: the running value relative to the running
    maximum M of m (a row vector, also in registers); each iteration M' = max(M, m) and
    acc <- acc * exp(M - M') + x * exp(m - M'), as the tile rule does."""

    def accepts(self, ctx: RowContext, node: Node):
        x, m = node.inputs
        if not ctx.in_registers(x):
            return False
        if not (ctx.is_vector(m) or (m.name in ctx.tile_shapes and ctx.rows_of(m.shape) and m.shape[-1] == 1)):
            return False
        return ctx.values[x.name]


class SumRescaled(Rescaled):
    """accum_sum_rescale(x, m): online softmax's denominator, the rescaled running sum of each row of
    x: the row's sum (its quad's), then folded as accum_rescale folds a row vector."""

    reduces = True

    def accepts(self, ctx: RowContext, node: Node):
        x, m = node.inputs
        if not ctx.is_matrix(x) or Rescaled.accepts(self, ctx, node) is False:
            return False
        return VECTOR


def is_elementwise_chain(op: OpDef) -> bool:
    """An element-wise op, or a fused chain of them (a graph-defined op whose body is a thread graph)."""
    return op.is_elementwise or op.body_level == THREAD


_ELEMENTWISE = Elementwise()

#: op -> its rule: the ops a chain may hold (every element-wise one by its category)
ROW_RULES: RuleTable[RowRule] = RuleTable("row-resident lowering", RowRule, "mdsl.lowering.rows (ROW_RULES)",
                                          by_category=lambda op: _ELEMENTWISE if is_elementwise_chain(op) else None)
for _name, _rule in {
    "matmul": Matmul(),
    "max": Reduction(),
    "sum": Reduction(),
    "mean": Reduction(),
    "accum": Accumulate(),
    "accum_max": Accumulate(),
    "accum_rescale": Rescaled(),
    "accum_sum_rescale": SumRescaled(),
}.items():
    ROW_RULES.register(_name, _rule)


def backend_table(consumer: str, rule_type: type, where: str, elementwise) -> RuleTable:
    """A backend's table of its rules of the ops a chain may hold: it needs one for every op of `ROW_RULES`
    (`elementwise`: its rule of every element-wise op and fused chain, by their category), with `emit(rk,
    node)`, and an accumulator's with `init(rk, node)` too."""
    return RuleTable(consumer, rule_type, where, needs=lambda op: op.name in ROW_RULES,
                     provides=lambda op: ("init", "emit") if op.is_accumulator else ("emit",),
                     by_category=lambda op: elementwise if is_elementwise_chain(op) else None)


def _loop_nodes(schedule) -> list:
    return sorted(i for stage in schedule.loop for i in stage.nodes)


def _geometry(bg: BlockGraph, schedule, mma: dict) -> Optional[RowGeometry]:
    for i in _loop_nodes(schedule):
        node = bg.nodes[i]
        if node.op == "matmul" and node.output.name in mma:
            shape = node.output.shape
            return RowGeometry(math.prod(shape[:-2]), shape[-2], bg.threads // 32)
    return None


def plan_rows(bg: BlockGraph, schedule, tile_shapes: dict, mma: dict) -> Optional[RowPlan]:
    """The loop nodes to lower in registers (None: none worth it). A node qualifies when its op's rule
    accepts it given the values already in registers; a value read by anything else than the chain (a
    node lowered on tiles, the code after the loop, a block output) keeps its tile, so its producer
    leaves the chain, and so on until nothing changes. Accumulators are the exception: their running
    values are stored to their tiles after the loop. A chain whose live values need more than
    ROW_REGISTERS registers a thread stays on tiles."""
    geometry = _geometry(bg, schedule, mma)
    if geometry is None or bg.threads % 32:
        return None
    loop = _loop_nodes(schedule)
    producer = {v.name: i for i, node in enumerate(bg.nodes) for v in node.outputs}
    outputs = {o.var.name for o in bg.outputs}
    candidates = {i for i in loop if bg.nodes[i].op in ROW_RULES}
    while True:
        values: dict = {}
        chosen: set = set()
        for i in loop:
            if i not in candidates:
                continue
            node = bg.nodes[i]
            cols = ROW_RULES[node.op].accepts(RowContext(geometry, values, mma, tile_shapes), node)
            if cols is False:
                continue
            chosen.add(i)
            values[node.output.name] = cols
        leaving = set()
        for j, node in enumerate(bg.nodes):
            for v in node.inputs:
                p = producer.get(v.name)
                if j not in chosen and p in chosen and not (bg.nodes[p].opdef.is_accumulator and j not in loop):
                    leaving.add(p)
        leaving |= {producer[name] for name in outputs & values.keys()
                    if not bg.nodes[producer[name]].opdef.is_accumulator}
        if not leaving:
            break
        candidates -= leaving
    if not any(bg.nodes[i].op == "matmul" for i in chosen) or not _worth_it(bg, chosen, geometry):
        return None
    if peak_registers(bg, loop, chosen, values, geometry) > ROW_REGISTERS:
        return None
    return RowPlan(geometry, frozenset(chosen), values)


#: the most 32-bit registers per thread the chain's live values may take: past it ptxas spills the chain to
#: local memory. A thread has 255; the mma fragments, addresses and loop state take about 80 of them (attention
#: chains of 166-172 compile to 249-253 registers, none spilled; one of 204 spills 36 bytes). Beyond it the
#: tile lowering holds the values in shared memory: a 1 x 8192 row held by one warp is 4,096 floats a thread,
#: which compiles to a 49 KB stack frame after minutes in NVRTC.
ROW_REGISTERS = 192


def value_registers(cols, geometry: RowGeometry) -> int:
    """Registers per thread of one row-resident value: each of the warp's row tiles holds 4 elements of each
    8-column group (a matrix), or its two rows (a row vector)."""
    return geometry.rt * (2 if cols is VECTOR else 4 * -(-cols // 8))


def peak_registers(bg: BlockGraph, loop: list, chosen: set, values: dict, geometry: RowGeometry) -> int:
    """The most registers per thread the chain's values hold at once: a value lives from its node to the
    last chain node reading it, an accumulator's running value for the whole loop."""
    order = [i for i in loop if i in chosen]
    position = {i: k for k, i in enumerate(order)}
    last = {}
    for i in order:
        for v in bg.nodes[i].inputs:
            if v.name in values:
                last[v.name] = position[i]
    live = [0] * (len(order) + 1)
    for i in order:
        node = bg.nodes[i]
        name = node.output.name
        start, end = (0, len(order)) if node.opdef.is_accumulator else (position[i], last.get(name, position[i]))
        size = value_registers(values[name], geometry)
        for k in range(start, end + 1):
            live[k] += size
    return max(live)


def _worth_it(bg: BlockGraph, chosen: set, geometry: RowGeometry) -> bool:
    """Each warp owns whole rows here, where the tile lowering deals a matmul's 16x8 pieces to every
    warp: with fewer row tiles than warps some warps idle. That pays only where rows are reduced (the
    tile lowering's row statistics cost a shared-memory round trip and barriers) or no warp idles."""
    reduces = any(ROW_RULES[bg.nodes[i].op].reduces for i in chosen)
    return reduces or geometry.row_tiles >= geometry.warps


def trailing_stages(schedule, plan: Optional[RowPlan]) -> int:
    """How many of the loop's last stages are wholly in registers: they need no barrier after them
    (nothing after them in the iteration writes shared memory they read)."""
    count = 0
    for stage in reversed(schedule.loop):
        if plan is None or not all(i in plan.nodes for i in stage.nodes):
            break
        count += 1
    return count

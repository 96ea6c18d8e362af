"""Row-resident chains as LLVM IR: the loop nodes the lowering keeps in the tensor cores' registers
(mdsl.lowering.rows, which says which and how the values are laid out), written by each op's rule in
`PTX_ROW_RULES`.

Warp w owns the 16-row tiles w, w + warps, ... of the block's rows and every column of them, in the
mma's C-fragment layout: lane l (g = l / 4, t = l % 4) holds rows g and g + 8 of a tile, columns 2t and
2t + 1 of each 8-column group. A *matrix* value is, per row tile of the warp, a flat list of 4 values
per 8-column group (element e of group n: row g + (e / 2) 8, column 8 n + 2 t + e % 2); a *row
vector* is 2 values per row tile (rows g and g + 8, the same on the 4 lanes of a quad). Values made in
an iteration are SSA values; the accumulators' running values are `Var`s (registers across the
loop). A row tile that only some warps have (the last, where the warps do not divide the row tiles)
is computed under a warp-uniform branch, its values merged by phis (zero where skipped), so that
mma.sync, ldmatrix and the quad shuffles always run on whole warps.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import attrs

from mdsl.backend.ptx.llvm import Array, Var, f32, i32
from mdsl.backend.ptx.loops import MAX, SUM, Fold, chain_values, rescale, weighted_sum
from mdsl.backend.ptx.mma import BlockMma
from mdsl.ir.graph import Node
from mdsl.ir.rules import RuleTable
from mdsl.lowering.grid import thread_graph
from mdsl.lowering.mma import batch_stride
from mdsl.lowering.rows import VECTOR, RowPlan, backend_table


@attrs.frozen
class RowTile:
    """The warp's j-th row tile: its index over batch x row tiles, whether the warp has it (None: every
    warp has), its matrix in the batch, its first row and the lane's two rows."""

    j: int
    index: object
    guard: object
    batch: object
    first_row: object
    rows: tuple


@attrs.frozen
class At:
    """One element of a loop over a value: matrix element (n, e) or row-vector element h."""

    tile: RowTile
    n: Optional[int]
    e: Optional[int]
    h: int            # the row half: rows g (0) or g + 8 (1)
    row: object
    col: object       # None for a row vector


def _groups(cols: int) -> int:
    return -(-cols // 8)


def _value(x):
    return x.get() if isinstance(x, Var) else x


class RowKernel:
    """The rules' shared view of one kernel: the registers of the values, the lane's coordinates
    (computed once, at the start of the kernel, so that they dominate every use)."""

    def __init__(self, bk, plan: RowPlan):
        self.bk, self.fn, self.plan, self.geometry = bk, bk.fn, plan, plan.geometry
        fn, b, g = bk.fn, bk.fn.b, plan.geometry
        tid = fn.sreg("tid.x")
        lane = b.urem(tid, i32(32))
        warp = b.udiv(tid, i32(32))
        self.g, self.t = b.udiv(lane, i32(4)), b.urem(lane, i32(4))
        self.ldmatrix_column = b.mul(b.udiv(lane, i32(16)), i32(8))   # an ldmatrix.x4 lane's column group
        self.tiles = []
        for j in range(g.rt):
            index = warp if j == 0 else b.add(warp, i32(j * g.warps))
            guard = None if (j + 1) * g.warps <= g.row_tiles else b.icmp_unsigned("<", index, i32(g.row_tiles))
            batch = b.udiv(index, i32(g.tm)) if g.batch > 1 else i32(0)
            first = b.mul(b.urem(index, i32(g.tm)), i32(16)) if g.tm > 1 else i32(0)
            lane_row = b.add(first, self.g)
            self.tiles.append(RowTile(j, index, guard, batch, first, (lane_row, b.add(lane_row, i32(8)))))
        widest = max([c for c in plan.values.values() if c is not VECTOR], default=8)
        two_t = b.mul(self.t, i32(2))
        self.columns = [(b.add(two_t, i32(8 * n)), b.add(two_t, i32(8 * n + 1))) for n in range(_groups(widest))]
        self.mma = {}   # matmul output name -> its BlockMma (fragment helpers)
        for i in sorted(plan.nodes):
            node = bk.bg.nodes[i]
            if node.op == "matmul":
                self.mma[node.output.name] = bk.block_mma(node)
        self.registers: dict = {}   # value name -> per row tile, the flat list of its values (or Vars)
        self.maxima: dict = {}      # rescaling accumulator output name -> per row tile, its running maxima (Vars)

    # --- loops

    def elements(self, tile: RowTile, cols) -> list:
        """The lane's elements of a value with `cols` columns (VECTOR: a row vector) in its row tile."""
        if cols is VECTOR:
            return [At(tile, None, None, h, tile.rows[h], None) for h in range(2)]
        return [At(tile, n, e, e >> 1, tile.rows[e >> 1], self.columns[n][e & 1])
                for n in range(_groups(cols)) for e in range(4)]

    def each_tile(self, body: Callable) -> list:
        """body(tile) -> a flat list of values, for each of the warp's row tiles (merged past a guard)."""
        return [self.fn.if_values(tile.guard, lambda tile=tile: body(tile)) for tile in self.tiles]

    @contextlib.contextmanager
    def guarded(self, tile: RowTile):
        with self.fn.when(tile.guard) if tile.guard is not None else contextlib.nullcontext():
            yield

    def variables(self, cols, value) -> list:
        """Running values (Vars) of a value with `cols` columns, per row tile, all `value`."""
        per_tile = 2 if cols is VECTOR else 4 * _groups(cols)
        return [[self.fn.var(value) for _ in range(per_tile)] for _ in self.tiles]

    # --- reading values

    def element(self, var, at: At):
        """`var` at the element `at` (of a loop over a matrix or a row vector): from registers, or
        read from its tile (broadcast; zero in padding rows and columns)."""
        regs = self.registers.get(var.name)
        if regs is not None:
            held = regs[at.tile.j]
            if self.plan.values[var.name] is VECTOR:
                return _value(held[at.h])
            return _value(held[4 * at.n + at.e])
        fn, b, g = self.fn, self.fn.b, self.geometry
        tile = self.bk.tile(var)
        shape = tuple(tile.shape)
        inside = []
        if g.rows % 16:
            inside.append(b.icmp_unsigned("<", at.row, i32(g.rows)))
        if at.col is not None and len(shape) >= 1 and shape[-1] > 1 and shape[-1] % 8:
            inside.append(b.icmp_unsigned("<", at.col, i32(shape[-1])))
        offset = self.tile_offset(tile, at)
        if not inside:
            return fn.load_float(tile, offset)
        ok = inside[0] if len(inside) == 1 else b.and_(*inside)
        value = fn.load_float(tile, b.select(ok, offset, i32(0)))   # read an element that exists
        return b.select(ok, value, f32(0.0))

    def tile_offset(self, tile: Array, at: At):
        fn, b = self.fn, self.fn.b
        shape = tuple(tile.shape)
        if len(shape) < 2:
            return i32(0)
        terms = []
        if math.prod(shape[:-2]) > 1:
            terms.append(fn.offset(at.tile.batch, shape[:-2], tile.viewed(shape[:-2], tile.strides[:-2])))
        if shape[-2] > 1:
            terms.append(b.mul(at.row, i32(tile.strides[-2])))
        if shape[-1] > 1 and at.col is not None:
            terms.append(at.col if tile.strides[-1] == 1 else b.mul(at.col, i32(tile.strides[-1])))
        total = terms[0] if terms else i32(0)
        for term in terms[1:]:
            total = b.add(total, term)
        return total

    def valid(self, at: At, cols) -> list:
        """Conditions: the element is inside the value (rows and columns past the ends are padding)."""
        b, out = self.fn.b, []
        if self.geometry.rows % 16:
            out.append(b.icmp_unsigned("<", at.row, i32(self.geometry.rows)))
        if cols is not VECTOR and cols % 8:
            out.append(b.icmp_unsigned("<", at.col, i32(cols)))
        return out

    def store(self, var, tile: Array) -> None:
        """A value's registers written to its tile (a row vector by the first lane of each quad)."""
        fn, b = self.fn, self.fn.b
        cols = self.plan.values[var.name]
        for row_tile in self.tiles:
            with self.guarded(row_tile):
                for at in self.elements(row_tile, cols):
                    cond = self.valid(at, cols)
                    if cols is VECTOR:
                        cond.append(b.icmp_unsigned("==", self.t, i32(0)))
                    value = self.element(var, at)
                    with fn.when(_all(b, cond)) if cond else contextlib.nullcontext():
                        fn.store_float(tile, self.tile_offset(tile, at), value)

    # --- row statistics

    def row_fold(self, fold: Fold, held: list, cols: int, divisor: Optional[int] = None) -> list:
        """The fold of each of the lane's two rows of a matrix (its values `held` in one row tile): the
        lane's elements of the row, then its quad's (2 shuffles); divided by `divisor` when given."""
        fn, b = self.fn, self.fn.b
        out = []
        for h in range(2):
            v = f32(fold.identity)
            for n in range(_groups(cols)):
                for c in range(2):
                    stepped = fold.step(fn, v, _value(held[4 * n + 2 * h + c]))
                    v = stepped if cols % 8 == 0 else \
                        b.select(b.icmp_unsigned("<", self.columns[n][c], i32(cols)), stepped, v)
            for lanes in (1, 2):   # the quad, as mdsl::quad_reduce
                v = fold.combine(fn, v, fn.shuffle_xor(v, lanes))
            out.append(v if divisor is None else b.fdiv(v, f32(float(divisor))))
        return out


def _all(b, conditions: list):
    out = conditions[0]
    for c in conditions[1:]:
        out = b.and_(out, c)
    return out


# ---------------------------------------------------------------------------------------------
# the rules


class RowsRule:
    """An op's code on row-resident values: `emit(rk, node)`; an accumulator's also `init(rk, node)`,
    which declares its running value before the loop."""


class RowsElementwise(RowsRule):
    """An element-wise op (or a fused chain) on row-resident values, reading broadcast tiles as it goes."""

    def emit(self, rk: RowKernel, node: Node) -> None:
        cols = rk.plan.values[node.output.name]
        tg = thread_graph(node)
        outer_inputs = node.inputs if node.op == "fused" else tg.inputs   # a lone op's graph reads each var once
        out = tg.outputs[0].name

        def body(tile: RowTile) -> list:
            return [chain_values(rk.fn, tg, [rk.element(v, at) for v in outer_inputs])[out]
                    for at in rk.elements(tile, cols)]

        rk.registers[node.output.name] = rk.each_tile(body)


@attrs.frozen
class RowsReduction(RowsRule):
    """max / sum / mean of each row (the last dim, kept): the lane's elements, then its quad."""

    fold: Fold
    mean: bool = False

    def emit(self, rk: RowKernel, node: Node) -> None:
        (x,) = node.inputs
        cols = rk.plan.values[x.name]
        held = rk.registers[x.name]
        rk.registers[node.output.name] = rk.each_tile(
            lambda tile: rk.row_fold(self.fold, held[tile.j], cols, cols if self.mean else None))


class RowsMatmul(RowsRule):
    """A tensor-core matmul whose product stays in registers: A from the registers of a row-resident
    matrix (packed to the mma's type) or from a tile (ldmatrix where whole aligned 16 x 16 pieces
    allow), B from a tile (`BlockMma.b_fragment`: ldmatrix.trans where it allows)."""

    def emit(self, rk: RowKernel, node: Node) -> None:
        a, wv = node.inputs
        fn, b = rk.fn, rk.fn.b
        mma = rk.mma[node.output.name]
        n, k = node.output.shape[-1], a.shape[-1]
        batch = tuple(node.output.shape[:-2])
        bt = rk.bk.tile(wv)
        sb = batch_stride(bt, batch)

        def matrix(op: Array, stride: int, tile: RowTile, shape: tuple) -> Array:
            start = fn.address(op, b.mul(tile.batch, i32(stride))) if stride else op.ptr
            return Array(start, op.dtype, shape, (op.strides[-2], 1))

        def body(tile: RowTile) -> list:
            c = [[f32(0.0)] * 4 for _ in range(_groups(n))]
            w_at = matrix(bt, sb, tile, (k, n))
            for k0, fa in self._a_fragments(rk, mma, a, batch, tile, matrix):
                for nn in range(_groups(n)):
                    fb = mma.b_fragment(w_at, i32(k0), i32(8 * nn), k0 + 16 > k)
                    c[nn] = fn.mma_m16n8k16(mma.dtype, fa, fb, c[nn])
            return [v for group in c for v in group]

        rk.registers[node.output.name] = rk.each_tile(body)

    @staticmethod
    def _a_fragments(rk: RowKernel, mma: BlockMma, a, batch: tuple, tile: RowTile, matrix: Callable):
        """(k0, A's 4 registers) for each K step of 16."""
        fn, b, g = rk.fn, rk.fn.b, rk.geometry
        k = a.shape[-1]
        held = rk.registers.get(a.name)
        if held is not None:   # a row-resident matrix: its C fragments are the A fragments, packed
            p = held[tile.j]
            groups = _groups(k)
            for kk in range(0, groups, 2):
                pairs = [fn.pack_floats(_value(p[4 * kk + e]), _value(p[4 * kk + e + 1]), mma.dtype) for e in (0, 2)]
                pairs += [fn.pack_floats(_value(p[4 * (kk + 1) + e]), _value(p[4 * (kk + 1) + e + 1]), mma.dtype)
                          if kk + 1 < groups else i32(0) for e in (0, 2)]
                yield 8 * kk, pairs
            return
        at = rk.bk.tile(a)
        sa = batch_stride(at, batch)
        a_at = matrix(at, sa, tile, (g.rows, k))
        lda = at.strides[-2]
        ldmatrix = at.dtype == mma.dtype and lda % 8 == 0 and g.rows % 16 == 0 and k % 16 == 0
        if ldmatrix:
            start = b.add(b.mul(b.add(tile.first_row, mma.lane16), i32(lda)), rk.ldmatrix_column)
        starts = [b.mul(r, i32(lda)) for r in tile.rows]
        two_t = b.mul(rk.t, i32(2))
        for k0 in range(0, k, 16):
            if ldmatrix:
                yield k0, fn.ldmatrix_x4(fn.address(a_at, b.add(start, i32(k0))))
                continue
            c0 = b.add(two_t, i32(k0))
            yield k0, [mma._along_row(a_at, r, s, c, sa, k0 + 16 > k)
                       for c in (c0, b.add(c0, i32(8))) for r, s in zip(tile.rows, starts)]


@attrs.frozen
class RowsAccumulate(RowsRule):
    """accum / accum_max of a row-resident value: the running value in registers for the whole loop."""

    identity: float
    step: Callable      # (fn, running, x) -> value

    def init(self, rk: RowKernel, node: Node) -> None:
        rk.registers[node.output.name] = rk.variables(rk.plan.values[node.output.name], f32(self.identity))

    def emit(self, rk: RowKernel, node: Node) -> None:
        (x,) = node.inputs
        cols = rk.plan.values[node.output.name]
        running = rk.registers[node.output.name]

        def body(tile: RowTile) -> list:
            values = [rk.element(x, at) for at in rk.elements(tile, cols)]
            for var, value in zip(running[tile.j], values):
                var.set(self.step(rk.fn, var.get(), value))
            return []

        rk.each_tile(body)


class RowsRescaled(RowsRule):
    """Online softmax's accum_rescale(x, m) in registers: the running value relative to the running
    maximum M of m (a row vector); each iteration M' = max(M, m) and acc <- acc exp(M - M') +
    x exp(m - M'), as the tile rule does."""

    def init(self, rk: RowKernel, node: Node) -> None:
        rk.registers[node.output.name] = rk.variables(rk.plan.values[node.output.name], f32(0.0))
        rk.maxima[node.output.name] = rk.variables(VECTOR, f32(float("-inf")))

    def emit(self, rk: RowKernel, node: Node) -> None:
        x, _ = node.inputs
        vector = rk.plan.values[node.output.name] is VECTOR
        rk.each_tile(lambda tile: self.fold(rk, node, tile, [rk.element(x, at) for at in rk.elements(tile, VECTOR)]
                                            if vector else None))

    def fold(self, rk: RowKernel, node: Node, tile: RowTile, vector_values: Optional[list]) -> list:
        """The update in one row tile, with this iteration's x (a matrix) or, for a row vector, its values."""
        fn = rk.fn
        x, m = node.inputs
        cols = rk.plan.values[node.output.name]
        keep, take = [], []
        for h, at in enumerate(rk.elements(tile, VECTOR)):
            mv = rk.element(m, at)
            top = rk.maxima[node.output.name][tile.j][h]
            nxt = fn.call_math("maxnum", top.get(), mv)
            keep.append(rescale(fn, top.get(), nxt))
            take.append(rescale(fn, mv, nxt))
            top.set(nxt)
        running = rk.registers[node.output.name][tile.j]
        for k, at in enumerate(rk.elements(tile, cols)):
            value = vector_values[at.h] if vector_values is not None else rk.element(x, at)
            running[k].set(weighted_sum(fn, running[k].get(), keep[at.h], value, take[at.h]))
        return []


class RowsSumRescaled(RowsRescaled):
    """accum_sum_rescale(x, m): online softmax's denominator, each row's sum of x (its quad's), then
    folded as accum_rescale folds a row vector."""

    def emit(self, rk: RowKernel, node: Node) -> None:
        x, _ = node.inputs
        held, cols = rk.registers[x.name], rk.plan.values[x.name]
        rk.each_tile(lambda tile: self.fold(rk, node, tile, rk.row_fold(SUM, held[tile.j], cols)))


# ---------------------------------------------------------------------------------------------
# registration

#: op -> its rule: every op of mdsl.lowering.rows.ROW_RULES (the element-wise ones by their category)
PTX_ROW_RULES: RuleTable[RowsRule] = backend_table("PTX backend's row-resident chains", RowsRule,
                                                  "mdsl.backend.ptx.rows (PTX_ROW_RULES)", RowsElementwise())
for _name, _rule in {
    "matmul": RowsMatmul(),
    "max": RowsReduction(MAX),
    "sum": RowsReduction(SUM),
    "mean": RowsReduction(SUM, mean=True),
    "accum": RowsAccumulate(0.0, lambda fn, acc, x: fn.b.fadd(acc, x)),
    "accum_max": RowsAccumulate(float("-inf"), lambda fn, acc, x: fn.call_math("maxnum", acc, x)),
    "accum_rescale": RowsRescaled(),
    "accum_sum_rescale": RowsSumRescaled(),
}.items():
    PTX_ROW_RULES.register(_name, _rule)

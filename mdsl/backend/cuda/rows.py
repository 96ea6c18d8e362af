"""Row-resident chains as C++: the loop nodes the lowering keeps in the tensor cores' registers
(mdsl.lowering.rows, which says which and how the values are laid out), written by each op's rule in
`CUDA_ROW_RULES` on the registers of `mdsl::RowMma` (prelude). A *matrix* is `float x[RT][TN][4]`, a *row vector*
`float x[RT][2]`.
"""
from __future__ import annotations

import math
from typing import Optional

import attrs

from mdsl.backend.cuda.loops import MAX, SUM, Fold, emit_chain, load_float
from mdsl.backend.cuda.source import Operand, element_ctype, float_literal, offset
from mdsl.ir.graph import Node
from mdsl.ir.rules import RuleTable
from mdsl.lowering.grid import thread_graph
from mdsl.lowering.mma import batch_stride
from mdsl.lowering.names import Namer
from mdsl.lowering.rows import VECTOR, RowPlan, backend_table


# ---------------------------------------------------------------------------------------------
# writing the code


class RowKernel:
    """The rules' shared view of one kernel: register names of the values, the geometry's constants."""

    def __init__(self, b, plan: RowPlan):
        self.b, self.plan, self.geometry = b, plan, plan.geometry
        self.registers: dict = {}   # value name -> C array
        self.maxima: dict = {}      # rescaling accumulator output name -> its running maximum's array

    # --- declarations and loops

    def array(self, var, cols) -> str:
        name = self.b.namer(f"r_{var.name}")
        self.registers[var.name] = name
        return name

    def declare(self, name: str, cols) -> str:
        g = self.geometry
        shape = f"[{g.rt}][2]" if cols is VECTOR else f"[{g.rt}][{-(-cols // 8)}][4]"
        return f"float {name}{shape};"

    def each_tile(self):
        g = self.geometry
        w = self.b.w
        w("#pragma unroll")
        block = w.block(f"for (int j = 0; j < {g.rt}; ++j)")
        block.__enter__()
        w(f"const int rt = threadIdx.x / 32 + j * {g.warps};  // the row tile (the same on the warp)")
        w(f"if (rt >= {g.row_tiles}) continue;")
        return block

    def each_element(self, cols):
        """Loops over the thread's elements of a matrix (`n`, `e`) or row vector (`h`), inside `each_tile`;
        `row`, `col` and `bat` name the element's coordinates."""
        g = self.geometry
        w = self.b.w
        if cols is VECTOR:
            w("#pragma unroll")
            block = w.block("for (int h = 0; h < 2; ++h)")
            block.__enter__()
            w(f"const int row = rt % {g.tm} * 16 + (threadIdx.x % 32) / 4 + h * 8, col = 0, bat = rt / {g.tm};")
            return [block]
        w("#pragma unroll")
        outer = w.block(f"for (int n = 0; n < {-(-cols // 8)}; ++n)")
        outer.__enter__()
        w("#pragma unroll")
        inner = w.block("for (int e = 0; e < 4; ++e)")
        inner.__enter__()
        w(f"const int row = rt % {g.tm} * 16 + (threadIdx.x % 32) / 4 + (e >> 1) * 8, "
          f"col = n * 8 + 2 * (threadIdx.x % 4) + (e & 1), bat = rt / {g.tm};")
        return [outer, inner]

    @staticmethod
    def close(*blocks) -> None:
        for block in reversed(blocks):
            block.__exit__(None, None, None)

    def element(self, var, cols) -> str:
        """The C expression of `var` at the current element of a loop over a value with `cols` columns."""
        name = self.registers.get(var.name)
        if name is not None:
            if self.plan.values[var.name] is VECTOR:
                return f"{name}[j][{'h' if cols is VECTOR else 'e >> 1'}]"
            return f"{name}[j][n][e]"
        tile = self.b.tile(var)
        return self.guarded(load_float(tile, self.tile_offset(tile)))

    def guarded(self, expr: str) -> str:
        g = self.geometry
        return expr if g.rows % 16 == 0 else f"(row < {g.rows} ? {expr} : 0.0f)"

    def tile_offset(self, tile: Operand) -> str:
        shape = tuple(tile.shape)
        if len(shape) < 2:
            return "0"
        terms = []
        if math.prod(shape[:-2]) > 1:
            terms.append(f"({offset('bat', shape[:-2], tile.viewed(shape[:-2], tile.strides[:-2]))})")
        if shape[-2] > 1:
            terms.append(f"row * {tile.strides[-2]}")
        if shape[-1] > 1:
            terms.append(f"col * {tile.strides[-1]}")
        return " + ".join(terms) or "0"

    def valid(self, cols) -> str:
        """A C condition: the current element is inside the value (rows and columns past the ends are padding)."""
        g = self.geometry
        parts = [] if g.rows % 16 == 0 else [f"row < {g.rows}"]
        if cols is not VECTOR and cols % 8:
            parts.append(f"col < {cols}")
        return " && ".join(parts)

    def store(self, var, tile: Operand) -> None:
        """A value's registers written to its tile (a row vector by one lane of each quad)."""
        cols = self.plan.values[var.name]
        w = self.b.w
        tb = self.each_tile()
        loops = self.each_element(cols)
        cond = [c for c in (self.valid(cols), "threadIdx.x % 4 == 0" if cols is VECTOR else "") if c]
        line = f"{tile.at(self.tile_offset(tile))} = mdsl::from_float<{tile.ctype}>({self.element(var, cols)});"
        w(f"if ({' && '.join(cond)}) {line}" if cond else line)
        self.close(tb, *loops)


# ---------------------------------------------------------------------------------------------
# the rules


class RowsRule:
    """An op's code on row-resident values: `emit(rk, node)`; an accumulator's also `init(rk, node)`,
    which declares its running value before the loop."""


class RowsElementwise(RowsRule):
    """An element-wise op (or a fused chain of them) on row-resident values, reading tiles that
    broadcast to its shape as it goes."""

    def emit(self, rk: RowKernel, node: Node) -> None:
        cols = rk.plan.values[node.output.name]
        out = rk.array(node.output, cols)
        w = rk.b.w
        w(rk.declare(out, cols))
        tb = rk.each_tile()
        loops = rk.each_element(cols)
        tg = thread_graph(node)
        outer_inputs = node.inputs if node.op == "fused" else tg.inputs   # a lone op's graph reads each var once
        reg = emit_chain(w, Namer(rk.b.namer.taken), tg, [rk.element(v, cols) for v in outer_inputs])
        index = "[j][h]" if cols is VECTOR else "[j][n][e]"
        w(f"{out}{index} = {reg[tg.outputs[0].name]};")
        rk.close(tb, *loops)


@attrs.frozen
class RowsReduction(RowsRule):
    """max / sum / mean of each row (the last dim, kept): the thread's elements, then its quad."""

    fold: Fold
    mean: bool = False

    def emit(self, rk: RowKernel, node: Node) -> None:
        (x,) = node.inputs
        cols = rk.plan.values[x.name]
        out = rk.array(node.output, VECTOR)
        _row_fold(rk, self.fold, rk.registers[x.name], cols, out, cols if self.mean else None)


def _row_fold(rk: RowKernel, fold: Fold, src: str, cols: int, out: str, divisor: Optional[int] = None) -> None:
    """`out` (a row vector, declared here) = the fold of each row of the matrix `src`: the thread's
    elements of the row, then the 4 lanes of its quad."""
    w = rk.b.w
    w(rk.declare(out, VECTOR))
    tb = rk.each_tile()
    w("#pragma unroll")
    with w.block("for (int h = 0; h < 2; ++h)"):
        w(f"float v = {fold.identity};")
        w("#pragma unroll")
        with w.block(f"for (int n = 0; n < {-(-cols // 8)}; ++n)"):
            w("#pragma unroll")
            with w.block("for (int c = 0; c < 2; ++c)"):
                w(f"const float x = {src}[j][n][h * 2 + c];")
                step = f"v = {fold.step};"
                w(step if cols % 8 == 0 else f"if (n * 8 + 2 * (threadIdx.x % 4) + c < {cols}) {step}")
        w(f"v = mdsl::quad_reduce(v, {fold.combine});")
        w(f"{out}[j][h] = {'v' if divisor is None else 'v / ' + float_literal(float(divisor))};")
    rk.close(tb)


class RowsMatmul(RowsRule):
    """A tensor-core matmul whose product stays in registers: A from the registers of a row-resident
    matrix or from a tile, B from a tile."""

    def emit(self, rk: RowKernel, node: Node) -> None:
        a, wv = node.inputs
        g = rk.geometry
        shape = rk.b.mma_shape(node)
        n, k = node.output.shape[-1], a.shape[-1]
        cls = f"mdsl::RowMma<{element_ctype(shape.element)}, {g.batch}, {g.rows}, {n}, {k}, {g.warps}>"
        out = rk.array(node.output, n)
        bt = rk.b.tile(wv)
        sb = batch_stride(bt, tuple(node.output.shape[:-2]))
        rk.b.w(rk.declare(out, n), f"mdsl::fill_rows({out}, 0.0f);")
        if a.name in rk.registers:
            rk.b.w(f"{cls}::multiply_rows<{bt.strides[-2]}, {sb}>({out}, {rk.registers[a.name]}, {bt.ptr});")
        else:
            at = rk.b.tile(a)
            sa = batch_stride(at, tuple(node.output.shape[:-2]))
            rk.b.w(f"{cls}::multiply<{at.strides[-2]}, {sa}, {bt.strides[-2]}, {sb}>({out}, {at.ptr}, {bt.ptr});")


@attrs.frozen
class RowsAccumulate(RowsRule):
    """accum / accum_max of a row-resident value: the running value in registers for the whole loop."""

    identity: str
    step: str

    def init(self, rk: RowKernel, node: Node) -> None:
        cols = rk.plan.values[node.output.name]
        name = rk.array(node.output, cols)
        rk.b.w(rk.declare(name, cols), f"mdsl::fill_rows({name}, {self.identity});")

    def emit(self, rk: RowKernel, node: Node) -> None:
        (x,) = node.inputs
        cols = rk.plan.values[node.output.name]
        acc = rk.registers[node.output.name]
        tb = rk.each_tile()
        loops = rk.each_element(cols)
        at = f"{acc}[j][h]" if cols is VECTOR else f"{acc}[j][n][e]"
        rk.b.w(f"{at} = {self.step.format(acc=at, x=rk.element(x, cols))};")
        rk.close(tb, *loops)


class RowsRescaled(RowsRule):
    """Online softmax's accum_rescale(x, m) in registers: the running value relative to the running
    maximum M of m (a row vector, also in registers); each iteration M' = max(M, m) and
    acc <- acc * exp(M - M') + x * exp(m - M'), as the tile rule does (`rules._Rescaling`)."""

    def init(self, rk: RowKernel, node: Node) -> None:
        cols = rk.plan.values[node.output.name]
        name = rk.array(node.output, cols)
        top = rk.b.namer(f"r_{node.output.name}_max")
        rk.maxima[node.output.name] = top
        rk.b.w(rk.declare(name, cols), f"mdsl::fill_rows({name}, 0.0f);",
               rk.declare(top, VECTOR), f"mdsl::fill_rows({top}, mdsl::neg_inf());")

    def emit(self, rk: RowKernel, node: Node) -> None:
        x, m = node.inputs
        cols = rk.plan.values[node.output.name]
        self.fold(rk, node, rk.element(x, cols) if cols is VECTOR else None)

    def fold(self, rk: RowKernel, node: Node, vector_value: Optional[str]) -> None:
        """The update, with this iteration's value `x` (a matrix) or, for a row vector, `vector_value`."""
        x, m = node.inputs
        cols = rk.plan.values[node.output.name]
        acc, top = rk.registers[node.output.name], rk.maxima[node.output.name]
        w = rk.b.w
        with w.block(""):
            w(rk.declare("keep", VECTOR), rk.declare("take", VECTOR))
            tb = rk.each_tile()
            loops = rk.each_element(VECTOR)
            w(f"const float m = {rk.element(m, VECTOR)};", f"const float next = fmaxf({top}[j][h], m);",
              f"keep[j][h] = mdsl::rescale({top}[j][h], next);", "take[j][h] = mdsl::rescale(m, next);",
              f"{top}[j][h] = next;")
            rk.close(tb, *loops)
            tb = rk.each_tile()
            loops = rk.each_element(cols)
            half = "h" if cols is VECTOR else "e >> 1"
            at = f"{acc}[j][h]" if cols is VECTOR else f"{acc}[j][n][e]"
            value = vector_value if cols is VECTOR else rk.element(x, cols)
            w(f"{at} = {at} * keep[j][{half}] + {value} * take[j][{half}];")
            rk.close(tb, *loops)


class RowsSumRescaled(RowsRescaled):
    """accum_sum_rescale(x, m): online softmax's denominator, the rescaled running sum of each row of
    x: the row's sum (its quad's), then folded as accum_rescale folds a row vector."""

    def emit(self, rk: RowKernel, node: Node) -> None:
        x, _ = node.inputs
        total = rk.b.namer(f"r_{node.output.name}_sum")
        _row_fold(rk, SUM, rk.registers[x.name], rk.plan.values[x.name], total)
        self.fold(rk, node, f"{total}[j][h]")


# ---------------------------------------------------------------------------------------------
# registration: the ops a chain may hold

#: op -> its rule: every op of mdsl.lowering.rows.ROW_RULES (the element-wise ones by their category)
CUDA_ROW_RULES: RuleTable[RowsRule] = backend_table("CUDA backend's row-resident chains", RowsRule,
                                                  "mdsl.backend.cuda.rows (CUDA_ROW_RULES)", RowsElementwise())
for _name, _rule in {
    "matmul": RowsMatmul(),
    "max": RowsReduction(MAX),
    "sum": RowsReduction(SUM),
    "mean": RowsReduction(SUM, mean=True),
    "accum": RowsAccumulate("0.0f", "{acc} + {x}"),
    "accum_max": RowsAccumulate("mdsl::neg_inf()", "fmaxf({acc}, {x})"),
    "accum_rescale": RowsRescaled(),
    "accum_sum_rescale": RowsSumRescaled(),
}.items():
    CUDA_ROW_RULES.register(_name, _rule)

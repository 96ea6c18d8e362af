"""Row-resident lowering: chains of a loop body that stay in the tensor cores' registers.

Online softmax (flash attention) and its kin are chains of a matmul, reductions along the last dim,
element-wise ops on the rows, a second matmul and accumulators, all on the same rows. Lowered op by op
through shared memory, each link costs a round trip and a barrier, and the row statistics a
cross-warp reduction. Here warp w owns the 16-row tiles w, w + warps, ... of the block's rows and every
column of them, in the mma's C-fragment layout (`mdsl::RowMma` in the prelude): a matmul's product
stays where the mma leaves it, a row's max or sum is a fold over the thread's own elements and two
shuffles within its quad, an element-wise op works on the registers, the next matmul takes its A
operand straight from them, and the accumulators keep their running values there for the whole
loop. Nothing of the chain touches shared memory, and its stages need no barrier.

`plan_rows` decides which loop nodes qualify (each op's `cuda_rows` rule says when it accepts a node
and writes its code), `RowKernel` holds the per-kernel state the rules share.

Values held this way: a *matrix* (rows x cols: `float x[RT][TN][4]`, element e of column group n of
row tile j is row g + (e / 2) * 8, column 8 n + 2 t + e % 2 with g = lane / 4, t = lane % 4) or a
*row vector* (rows x 1: `float x[RT][2]`, rows g and g + 8 of row tile j, the same on the 4 lanes of a
quad).
"""
from __future__ import annotations

import math
from typing import Optional

import attrs

from mdsl.backend.cuda.loops import MAX, SUM, Fold, emit_chain, load_float
from mdsl.backend.cuda.mma import _batch_stride
from mdsl.backend.cuda.source import Namer, Operand, float_literal, offset
from mdsl.ir.graph import BlockGraph, Node, ThreadGraph
from mdsl.ir.ops import extend_op

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
        from mdsl.passes.layout import scratch_name

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


class _Context:
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
    values are stored to their tiles after the loop."""
    geometry = _geometry(bg, schedule, mma)
    if geometry is None or bg.threads % 32:
        return None
    loop = _loop_nodes(schedule)
    producer = {v.name: i for i, node in enumerate(bg.nodes) for v in node.outputs}
    outputs = {o.var.name for o in bg.outputs}
    candidates = {i for i in loop if "cuda_rows" in bg.nodes[i].opdef.rules}
    while True:
        values: dict = {}
        chosen: set = set()
        for i in loop:
            if i not in candidates:
                continue
            node = bg.nodes[i]
            cols = node.opdef.rules["cuda_rows"].accepts(_Context(geometry, values, mma, tile_shapes), node)
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
    return RowPlan(geometry, frozenset(chosen), values)


def _worth_it(bg: BlockGraph, chosen: set, geometry: RowGeometry) -> bool:
    """Each warp owns whole rows here, where the tile lowering deals a matmul's 16x8 pieces to every
    warp: with fewer row tiles than warps some warps idle. That pays only where rows are reduced (the
    tile lowering's row statistics cost a shared-memory round trip and barriers) or no warp idles."""
    reduces = any(isinstance(bg.nodes[i].opdef.rules["cuda_rows"], (RowsReduction, RowsSumRescaled)) for i in chosen)
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


def _thread_graph(node: Node) -> ThreadGraph:
    if node.op == "fused":
        return node.body
    return ThreadGraph(list(dict.fromkeys(node.inputs)), [node], node.outputs)


# ---------------------------------------------------------------------------------------------
# the rules


class RowsElementwise:
    """An element-wise op (or a fused chain of them) on row-resident values, reading tiles that
    broadcast to its shape as it goes."""

    def accepts(self, ctx: _Context, node: Node):
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

    def emit(self, rk: RowKernel, node: Node) -> None:
        cols = rk.plan.values[node.output.name]
        out = rk.array(node.output, cols)
        w = rk.b.w
        w(rk.declare(out, cols))
        tb = rk.each_tile()
        loops = rk.each_element(cols)
        tg = _thread_graph(node)
        outer_inputs = node.inputs if node.op == "fused" else tg.inputs   # a lone op's graph reads each var once
        reg = emit_chain(w, Namer(rk.b.namer.taken), tg, [rk.element(v, cols) for v in outer_inputs])
        index = "[j][h]" if cols is VECTOR else "[j][n][e]"
        w(f"{out}{index} = {reg[tg.outputs[0].name]};")
        rk.close(tb, *loops)


@attrs.frozen
class RowsReduction:
    """max / sum / mean of each row (the last dim, kept): the thread's elements, then its quad."""

    fold: Fold
    mean: bool = False

    def accepts(self, ctx: _Context, node: Node):
        (x,) = node.inputs
        dim = node.attr("dim")
        last = dim in (-1, len(x.shape) - 1)
        if not (ctx.is_matrix(x) and last and node.attr("keepdim", False) and ctx.rows_of(node.output.shape)):
            return False
        return VECTOR

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


class RowsMatmul:
    """A tensor-core matmul whose product stays in registers: A from the registers of a row-resident
    matrix or from a tile, B from a tile."""

    def accepts(self, ctx: _Context, node: Node):
        a, w = node.inputs
        out = tuple(node.output.shape)
        if node.output.name not in ctx.mma or not ctx.rows_of(out) or ctx.in_registers(w):
            return False
        if ctx.in_registers(a) and not ctx.is_matrix(a, a.shape[-1]):
            return False
        if not ctx.in_registers(a) and a.name not in ctx.tile_shapes:
            return False
        return out[-1]

    def emit(self, rk: RowKernel, node: Node) -> None:
        a, wv = node.inputs
        g = rk.geometry
        shape = rk.b.mma_shape(node)
        n, k = node.output.shape[-1], a.shape[-1]
        cls = f"mdsl::RowMma<{shape.element}, {g.batch}, {g.rows}, {n}, {k}, {g.warps}>"
        out = rk.array(node.output, n)
        bt = rk.b.tile(wv)
        sb = _batch_stride(bt, tuple(node.output.shape[:-2]))
        rk.b.w(rk.declare(out, n), f"mdsl::fill_rows({out}, 0.0f);")
        if a.name in rk.registers:
            rk.b.w(f"{cls}::multiply_rows<{bt.strides[-2]}, {sb}>({out}, {rk.registers[a.name]}, {bt.ptr});")
        else:
            at = rk.b.tile(a)
            sa = _batch_stride(at, tuple(node.output.shape[:-2]))
            rk.b.w(f"{cls}::multiply<{at.strides[-2]}, {sa}, {bt.strides[-2]}, {sb}>({out}, {at.ptr}, {bt.ptr});")


@attrs.frozen
class RowsAccumulate:
    """accum / accum_max of a row-resident value: the running value in registers for the whole loop."""

    identity: str
    step: str

    def accepts(self, ctx: _Context, node: Node):
        (x,) = node.inputs
        return ctx.values[x.name] if ctx.in_registers(x) else False

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


class RowsRescaled:
    """Online softmax's accum_rescale(x, m) in registers: the running value relative to the running
    maximum M of m (a row vector, also in registers); each iteration M' = max(M, m) and
    acc <- acc * exp(M - M') + x * exp(m - M'), as the tile rule does (`rules._Rescaling`)."""

    def accepts(self, ctx: _Context, node: Node):
        x, m = node.inputs
        if not ctx.in_registers(x):
            return False
        if not (ctx.is_vector(m) or (m.name in ctx.tile_shapes and ctx.rows_of(m.shape) and m.shape[-1] == 1)):
            return False
        return ctx.values[x.name]

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

    def accepts(self, ctx: _Context, node: Node):
        x, m = node.inputs
        if not ctx.is_matrix(x) or RowsRescaled.accepts(self, ctx, node) is False:
            return False
        return VECTOR

    def emit(self, rk: RowKernel, node: Node) -> None:
        x, _ = node.inputs
        total = rk.b.namer(f"r_{node.output.name}_sum")
        _row_fold(rk, SUM, rk.registers[x.name], rk.plan.values[x.name], total)
        self.fold(rk, node, f"{total}[j][h]")


# ---------------------------------------------------------------------------------------------
# registration: the ops a chain may hold

_ELEMENTWISE_OPS = ("exp", "silu", "gelu", "relu", "sigmoid", "sqrt", "rsqrt", "square", "neg", "reciprocal",
                    "mul_scalar", "add_scalar", "pow_scalar", "clamp", "cast", "add", "sub", "mul", "div", "fused")

_RULES = {
    **{op: RowsElementwise() for op in _ELEMENTWISE_OPS},
    "matmul": RowsMatmul(),
    "max": RowsReduction(MAX),
    "sum": RowsReduction(SUM),
    "mean": RowsReduction(SUM, mean=True),
    "accum": RowsAccumulate("0.0f", "{acc} + {x}"),
    "accum_max": RowsAccumulate("mdsl::neg_inf()", "fmaxf({acc}, {x})"),
    "accum_rescale": RowsRescaled(),
    "accum_sum_rescale": RowsSumRescaled(),
}

for _name, _rule in _RULES.items():
    extend_op(_name, cuda_rows=_rule)

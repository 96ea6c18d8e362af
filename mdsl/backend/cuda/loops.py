"""The loops that op rules are made of, at both levels: over the elements of an array (element-wise
chains in registers, copies), and over the rows of a reduction (a group of lanes per row, combined
with warp shuffles).

The same loop runs on the threads of one block (block-graph ops, on shared-memory tiles) or on all
the threads of the grid (kernel-level ops, on device tensors); `Threads` says which. Loop variables
have short plain names (`i`, `o`, `lane`, `v`, ...); values of the mugraph always carry a prefix
(`g_`, `s_`, `r_`), so the two never clash.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import attrs

from mdsl.backend.cuda.rule_table import CUDA_RULES
from mdsl.backend.cuda.source import CodeWriter, Operand, offset
from mdsl.ir.graph import ThreadGraph
from mdsl.ir.ops import broadcast_shapes
from mdsl.lowering.grid import BLOCK_UNROLL, WARP, RowLoop, without
from mdsl.lowering.index import broadcast_strides, element_batch
from mdsl.lowering.names import Namer


ROW_UNROLL = 4   # a row's loop, where the row is not resident, unrolled this many times


@attrs.frozen
class Threads:
    """The threads a loop is spread over: one block of `block` threads, or the whole grid of them."""

    block: int
    grid: bool = False
    unroll: int = BLOCK_UNROLL   # a block's loops (CudaOptions.unroll)
    barrier: str = ""            # the block's barrier as block_sync's template arguments (", BAR, THREADS": a
                                 # block run as a task, mdsl.backend.cuda.task); "" its kernel's __syncthreads

    @property
    def first(self) -> str:
        return f"blockIdx.x * {self.block} + threadIdx.x" if self.grid else "threadIdx.x"

    @property
    def count(self) -> str:
        return f"gridDim.x * {self.block}" if self.grid else str(self.block)

    @contextlib.contextmanager
    def each(self, w: CodeWriter, n: int, unrolled: bool = False) -> Iterator[None]:
        """A loop giving each index `i` below n to one thread. Unless asked to unroll fully, a block's
        loop is unrolled `unroll` times (several shared-memory round trips in flight per thread,
        where a rolled loop waits for each in turn) and a grid's is kept rolled: the compiler would
        unroll a known trip count fully, and many small loops unrolled fully cost seconds of compile
        time and many registers for little gain."""
        if not unrolled:
            trips = -(-n // self.block)
            w(f"#pragma unroll {self.unroll if not self.grid and trips > 1 else 1}")
        with w.block(f"for (int i = {self.first}; i < {n}; i += {self.count})"):
            yield

    def batch(self, n: int) -> int:
        """Elements of a loop over n that a thread takes a trip, loaded before any is stored
        (`mdsl.lowering.index.element_batch`); 1 on a grid."""
        return 1 if self.grid else element_batch(n, self.block, self.unroll)

    @contextlib.contextmanager
    def each_group(self, w: CodeWriter, n: int, lanes: int) -> Iterator[None]:
        """A loop giving each index `o` below n to a group of `lanes` consecutive threads (lane `lane`).
        Its trip count is the same on every thread of a block, so shuffles inside it are safe."""
        per_block = self.block // lanes
        start, step = (f"blockIdx.x * {per_block}", f"gridDim.x * {per_block}") if self.grid else ("0", str(per_block))
        group = "0" if per_block == 1 else "threadIdx.x" if lanes == 1 else f"threadIdx.x / {lanes}"
        w("#pragma unroll 1")
        with w.block(f"for (int o0 = {start}; o0 < {n}; o0 += {step})"):
            w(f"const int o = o0 + {group};", f"const int lane = {'0' if lanes == 1 else f'threadIdx.x % {lanes}'};")
            yield


def load_float(op: Operand, off: str) -> str:
    return f"mdsl::to_float({op.at(off)})"


def store_float(op: Operand, off: str, value: str) -> str:
    return f"{op.at(off)} = mdsl::from_float<{op.ctype}>({value});"


# ---------------------------------------------------------------------------------------------
# element-wise chains


def emit_thread_graph(w: CodeWriter, threads: Threads, namer: Namer, tg: ThreadGraph, ins: list, outs: list) -> None:
    """Each element of the chain's iteration space (the broadcast of its inputs and outputs) computed
    by one thread in f32 registers, from the input operands to the output operands. An output of a
    smaller shape (broadcast in the chain) is written by the threads at coordinate 0 of the dims it
    lacks, so that each of its elements is written once."""
    space = broadcast_shapes("fused", *(o.shape for o in ins + outs))
    n = math.prod(space)
    batch = threads.batch(n)
    if batch > 1:
        _emit_batched(w, threads, namer, tg, ins, outs, space, batch)
        return
    with threads.each(w, n):
        reg = emit_chain(w, Namer(namer.taken), tg, [load_float(op, offset("i", space, op)) for op in ins])
        for var, op in zip(tg.outputs, outs):
            _store(w, space, op, "i", reg[var.name])


def _emit_batched(w: CodeWriter, threads: Threads, namer: Namer, tg: ThreadGraph, ins: list, outs: list,
                  space: tuple, batch: int) -> None:
    """`batch` elements a thread a trip (indices `block` apart), every element's loads and values before
    any store (`mdsl.lowering.index.element_batch` says why)."""
    n = math.prod(space)
    local = Namer(namer.taken | {"i"})
    w("#pragma unroll 1")
    with w.block(f"for (int i = threadIdx.x; i < {n}; i += {threads.block * batch})"):
        index = [local("i") for _ in range(batch)]
        w(*(f"const int {name} = i + {u * threads.block};" for u, name in enumerate(index)))
        regs = [emit_chain(w, local, tg, [load_float(op, offset(name, space, op)) for op in ins]) for name in index]
        for name, reg in zip(index, regs):
            for var, op in zip(tg.outputs, outs):
                _store(w, space, op, name, reg[var.name])


def _store(w: CodeWriter, space: tuple, op: Operand, index: str, value: str) -> None:
    store = store_float(op, offset(index, space, op), value)
    lacking = _lacking_dims(space, op.shape, index)
    w(f"if ({lacking} == 0) {store}" if lacking != "0" else store)


def emit_chain(w: CodeWriter, local: Namer, tg: ThreadGraph, inputs: list,
               wrap: Callable[[str], str] = lambda expr: expr) -> dict:
    """One element of a thread graph in f32 registers, from the C expressions of its inputs: value name
    -> the register holding it. `wrap`: applied to every value's expression (e.g. a rounding)."""
    reg: dict = {}
    for var, expr in zip(tg.inputs, inputs):
        reg[var.name] = local(f"r_{var.name}")
        w(f"const float {reg[var.name]} = {wrap(expr)};")
    for node in tg.nodes:
        expr = CUDA_RULES[node.op].expr(node, [reg[v.name] for v in node.inputs])
        reg[node.output.name] = local(f"r_{node.output.name}")
        w(f"const float {reg[node.output.name]} = {wrap(expr)};")
    return reg


def _lacking_dims(space: tuple, shape: tuple, index: str = "i") -> str:
    """A C expression that is 0 exactly where `index`'s coordinates are 0 along the dims of `space`
    that an array of `shape` is broadcast along."""
    return offset(index, space, Operand("", "", space, broadcast_strides(space, shape)))


# ---------------------------------------------------------------------------------------------
# reductions over one dim


@attrs.frozen
class Fold:
    """How a reduction folds a row: the start value, one step (a C expression of `v` and the element
    `x`) and the combination of partial results across lanes (a functor in the prelude)."""

    identity: str
    step: str
    combine: str


SUM = Fold("0.0f", "v + x", "mdsl::Sum()")
MAX = Fold("mdsl::neg_inf()", "fmaxf(v, x)", "mdsl::Max()")
SUM_OF_SQUARES = Fold("0.0f", "fmaf(x, x, v)", "mdsl::Sum()")
#: the lowering's folds by name (mdsl.lowering.skinny.ROW_FOLDS)
FOLDS = {"sum": SUM, "max": MAX, "sum_of_squares": SUM_OF_SQUARES}


def row_view(op: Operand, dim: int) -> Operand:
    """The operand seen as rows: one element per row, `dim` removed (its first element)."""
    return op.viewed(without(op.shape, dim), without(op.strides, dim))


def emit_row_reduce(w: CodeWriter, threads: Threads, src: Operand, dim: int, fold: Fold, loop: RowLoop,
                    finish: Callable) -> None:
    """For each row of `src` along `dim`, fold its elements into `v` across a group of lanes as `loop` says
    (mdsl.lowering.grid.RowLoop: each lane's chunks in order, then the lanes by shuffles, then a group's
    warps in order: a fixed order); then finish(w) writes what the row gives, with `o` (the row), `v` (the
    folded value, on every lane of the group), `lane`, `row` (a pointer to the row's first element) and,
    where the loop keeps the row resident, `xs` (the lane's elements, `emit_row_map` reads them) in scope."""
    rows = without(src.shape, dim)
    n_rows, length, stride = math.prod(rows), src.shape[dim], src.strides[dim]
    lanes, vector = loop.lanes, loop.vector
    chunks, trips = loop.chunks(length), loop.trips(length)
    with threads.each_group(w, n_rows, lanes):
        if lanes > WARP:
            w(f"__shared__ float part[{threads.block // WARP}];")
        w(f"float v = {fold.identity};",
          f"const {src.ctype}* const row = {src.ptr} + ({offset('o', rows, row_view(src, dim))});")
        if loop.resident:
            w(f"float xs[{trips * vector}];")
        with w.block(f"if (o < {n_rows})"):
            with _each_chunk(w, loop, chunks):
                with _each_element(w, loop, "row", _scaled("c", vector * stride), read=True):
                    w(f"v = {fold.step};")
        if lanes > WARP:
            w(f"v = mdsl::warps_reduce<{lanes}{threads.barrier}>(v, {fold.combine}, part);")
        elif lanes > 1:
            w(f"v = mdsl::group_reduce<{lanes}>(v, {fold.combine});")
        finish(w)


def emit_row_map(w: CodeWriter, src: Operand, out: Operand, dim: int, loop: RowLoop, value: Callable) -> None:
    """Inside `emit_row_reduce`'s finish, on a row in range: each element of the lane's chunks of the row
    written to `out` (of `src`'s shape) as value(x), a C expression of the element `x` (from the loop's
    registers where it keeps the row resident, else read again)."""
    rows, length = without(src.shape, dim), src.shape[dim]
    vector = loop.vector
    out_row = row_view(out, dim)
    w(f"{out.ctype}* const out_row = {out.ptr} + ({offset('o', rows, out_row)});")
    with _each_chunk(w, loop, loop.chunks(length)):
        at = _scaled("c", vector * out.strides[dim])
        if vector > 1:
            w(f"float y[{vector}];")
        with _each_element(w, loop, "row", _scaled("c", vector * src.strides[dim]), read=False):
            w(f"y[e] = {value('x')};" if vector > 1 else f"out_row[{at}] = mdsl::from_float<{out.ctype}>({value('x')});")
        if vector > 1:
            w(f"mdsl::store_floats<{vector}>(out_row + {at}, y);")


@contextlib.contextmanager
def _each_chunk(w: CodeWriter, loop: RowLoop, chunks: int) -> Iterator[None]:
    """A loop over the lane's chunks of a row (`c`, and where the loop keeps the row resident, `k`: the
    lane's load counter, the loop unrolled fully); chunks past the row's end are skipped."""
    if loop.resident:
        w("#pragma unroll")
        with w.block(f"for (int k = 0; k < {loop.trips(chunks * loop.vector)}; ++k)"):
            w(f"const int c = lane + k * {loop.lanes};")
            if chunks % loop.lanes:
                with w.block(f"if (c < {chunks})"):
                    yield
            else:
                yield
    else:
        w(f"#pragma unroll {ROW_UNROLL}")
        with w.block(f"for (int c = lane; c < {chunks}; c += {loop.lanes})"):
            yield


@contextlib.contextmanager
def _each_element(w: CodeWriter, loop: RowLoop, row: str, index: str, read: bool) -> Iterator[None]:
    """Inside `_each_chunk`: each element `x` of the chunk at `index` of `row` (its index in the chunk `e`).
    `read`: the chunk is loaded (into the lane's registers `xs` where the loop keeps the row resident); else
    it is taken from them, or loaded again where the loop does not keep it."""
    vector, resident = loop.vector, loop.resident
    held = f"xs[{_scaled('k', vector)} + e]" if vector > 1 else "xs[k]"
    if vector == 1:
        if resident and read:
            w(f"{held} = mdsl::to_float({row}[{index}]);")
        w(f"const float x = {held if resident else f'mdsl::to_float({row}[{index}])'};")
        yield
        return
    if resident and read:
        w(f"mdsl::load_floats<{vector}>(xs + {_scaled('k', vector)}, {row} + {index});")
    elif not resident:
        w(f"float x_c[{vector}];", f"mdsl::load_floats<{vector}>(x_c, {row} + {index});")
    w("#pragma unroll")
    with w.block(f"for (int e = 0; e < {vector}; ++e)"):
        w(f"const float x = {held if resident else 'x_c[e]'};")
        yield


def _scaled(index: str, factor: int) -> str:
    return index if factor == 1 else f"{index} * {factor}"

"""The loops that the PTX rules are made of, as LLVM IR, at both levels (the CUDA backend's
mdsl/backend/cuda/loops.py, same structure): over the elements of an array (element-wise chains in
registers, copies) and over the rows of a reduction (a group of lanes per row, combined with warp
shuffles). `Threads` says whether a loop runs on one block's threads (block-graph ops, on
shared-memory tiles) or on every thread of the grid (kernel-level ops, on device tensors)."""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Optional

import attrs

from mdsl.backend.ptx.llvm import F32, Array, KernelFunction, f32, i32
from mdsl.backend.ptx.rule_table import PTX_RULES
from mdsl.ir.graph import ThreadGraph
from mdsl.ir.ops import broadcast_shapes
from mdsl.lowering.grid import BLOCK_UNROLL, WARP, RowLoop, without
from mdsl.lowering.index import broadcast_strides, element_batch

ROW_UNROLL = 4   # a row's loops: the CUDA backend's `#pragma unroll 4` (and nvcc's own unrolling)


@attrs.frozen
class Threads:
    """The threads a loop is spread over: one block of `block` threads, or the whole grid of them."""

    block: int
    grid: bool = False
    unroll: int = BLOCK_UNROLL   # a block's element loops (CudaOptions.unroll)

    def first(self, fn: KernelFunction):
        tid = fn.sreg("tid.x")
        return fn.b.add(fn.b.mul(fn.sreg("ctaid.x"), i32(self.block)), tid) if self.grid else tid

    def count(self, fn: KernelFunction):
        return fn.b.mul(fn.sreg("nctaid.x"), i32(self.block)) if self.grid else i32(self.block)

    @contextlib.contextmanager
    def each(self, fn: KernelFunction, n: int) -> Iterator:
        """A loop giving each index i below n to one thread; yields i."""
        with fn.loop(self.first(fn), n, self.count(fn)) as i:
            yield i

    def for_each(self, fn: KernelFunction, n: int, body: Callable) -> None:
        """body(i) for each index i below n, given to one thread. A block's loop is unrolled `unroll`
        times, as the CUDA backend's `#pragma unroll` (several shared-memory round trips in flight per
        thread): a known trip count of at most `unroll` is written out, a longer one is a loop of
        `unroll` bodies (those past the end guarded). A grid's loop stays rolled."""
        if self.grid or self.unroll == 1:
            with self.each(fn, n) as i:
                body(i)
            return
        unrolled_loop(fn, fn.sreg("tid.x"), n, self.block, self.unroll, body)

    def batch(self, n: int) -> int:
        """Elements of a loop over n that a thread takes a trip, loaded before any is stored
        (`mdsl.lowering.index.element_batch`); 1 on a grid or where the loop is rolled."""
        return 1 if self.grid else element_batch(n, self.block, self.unroll)

    @contextlib.contextmanager
    def each_group(self, fn: KernelFunction, n: int, lanes: int) -> Iterator[tuple]:
        """A loop giving each index o below n to a group of `lanes` consecutive threads; yields
        (o, lane). Its trip count is the same on every thread of a block, so shuffles in it are safe."""
        b, tid = fn.b, fn.sreg("tid.x")
        per_block = self.block // lanes
        if self.grid:
            start, step = b.mul(fn.sreg("ctaid.x"), i32(per_block)), b.mul(fn.sreg("nctaid.x"), i32(per_block))
        else:
            start, step = i32(0), i32(per_block)
        group = i32(0) if per_block == 1 else tid if lanes == 1 else b.udiv(tid, i32(lanes))
        lane = i32(0) if lanes == 1 else b.urem(tid, i32(lanes))
        with fn.loop(start, n, step) as o0:
            yield b.add(o0, group), lane


def unrolled_loop(fn: KernelFunction, start, stop: int, step: int, unroll: int, body: Callable) -> None:
    """body(i) for i = start, start + step, ... below `stop`, where start < step, `unroll` bodies a trip
    (the CUDA backend's `#pragma unroll`: several loads in flight per thread): a known trip count of
    at most `unroll` is written out, a longer one is a loop of `unroll` bodies; a body that may pass
    the end is guarded."""
    b = fn.b
    trips = -(-stop // step)
    if trips <= unroll:                       # written out: the trip count is known
        for u in range(trips):
            i = start if u == 0 else b.add(start, i32(u * step))
            if (u + 1) * step <= stop:
                body(i)
            else:
                with fn.when(b.icmp_unsigned("<", i, i32(stop))):
                    body(i)
        return
    whole_groups = stop % (unroll * step) == 0   # else the last group's later bodies are guarded
    with fn.loop(start, stop, unroll * step) as i:
        body(i)
        for u in range(1, unroll):
            at = b.add(i, i32(u * step))
            with fn.when(b.icmp_unsigned("<", at, i32(stop))) if not whole_groups else contextlib.nullcontext():
                body(at)


# ---------------------------------------------------------------------------------------------
# element-wise chains


def emit_thread_graph(fn: KernelFunction, threads: Threads, tg: ThreadGraph, ins: list, outs: list) -> None:
    """Each element of the chain's iteration space (the broadcast of its inputs and outputs) computed
    by one thread in f32 registers; an output of a smaller shape is written by the threads at
    coordinate 0 of the dims it lacks (each of its elements once)."""
    space = broadcast_shapes("fused", *(o.shape for o in ins + outs))

    def values(i) -> dict:
        return chain_values(fn, tg, [fn.load_float(op, fn.offset(i, space, op)) for op in ins])

    def stores(i, reg: dict) -> None:
        for var, op in zip(tg.outputs, outs):
            at = fn.offset(i, space, op)
            lacking = _lacking_dims(fn, i, space, op.shape)
            if lacking is None:
                fn.store_float(op, at, reg[var.name])
            else:
                with fn.when(fn.b.icmp_unsigned("==", lacking, i32(0))):
                    fn.store_float(op, at, reg[var.name])

    n = math.prod(space)
    batch = threads.batch(n)
    if batch > 1:   # every element's loads and values before any store (mdsl.lowering.index.element_batch)
        with fn.loop(fn.sreg("tid.x"), n, threads.block * batch) as i:
            index = [i] + [fn.b.add(i, i32(u * threads.block)) for u in range(1, batch)]
            regs = [values(j) for j in index]
            for j, reg in zip(index, regs):
                stores(j, reg)
        return
    threads.for_each(fn, n, lambda i: stores(i, values(i)))


def chain_values(fn: KernelFunction, tg: ThreadGraph, inputs: list) -> dict:
    """One element of a thread graph in f32 registers, from its inputs' values: value name -> value."""
    reg = {var.name: value for var, value in zip(tg.inputs, inputs)}
    for node in tg.nodes:
        reg[node.output.name] = PTX_RULES[node.op].value(fn, node, [reg[v.name] for v in node.inputs])
    return reg


def rescale(fn: KernelFunction, m, top):
    """exp(m - top) for online softmax; an empty running maximum (-inf) weighs nothing."""
    empty = fn.b.fcmp_ordered("==", m, f32(float("-inf")))
    return fn.b.select(empty, f32(0.0), fn.math("exp", fn.b.fsub(m, top)))


def weighted_sum(fn: KernelFunction, a, wa, x, wx):
    """a wa + x wx."""
    return fn.b.fadd(fn.b.fmul(a, wa), fn.b.fmul(x, wx))


def _lacking_dims(fn: KernelFunction, i, space: tuple, shape: tuple):
    """A value that is 0 exactly where i's coordinates are 0 along the dims of `space` that an array
    of `shape` is broadcast along; None when there are none."""
    strides = broadcast_strides(space, shape)
    if not any(s for d, s in enumerate(strides) if space[d] != 1):
        return None
    return fn.offset(i, space, Array(None, "f32", space, tuple(strides)))


# ---------------------------------------------------------------------------------------------
# reductions over one dim


@attrs.frozen
class Fold:
    """How a reduction folds a row: the start value, one step (of the running value v and the
    element x) and the combination of partial results across lanes."""

    identity: float
    step: Callable      # (fn, v, x) -> value
    combine: Callable   # (fn, a, b) -> value


SUM = Fold(0.0, lambda fn, v, x: fn.b.fadd(v, x), lambda fn, a, b: fn.b.fadd(a, b))
MAX = Fold(float("-inf"), lambda fn, v, x: fn.call_math("maxnum", v, x), lambda fn, a, b: fn.call_math("maxnum", a, b))
SUM_OF_SQUARES = Fold(0.0, lambda fn, v, x: fn.call_math("fma", x, x, v), lambda fn, a, b: fn.b.fadd(a, b))
#: the lowering's folds by name (mdsl.lowering.skinny.ROW_FOLDS)
FOLDS = {"sum": SUM, "max": MAX, "sum_of_squares": SUM_OF_SQUARES}


def row_view(op: Array, dim: int) -> Array:
    """The array seen as rows: one element per row, `dim` removed (its first element)."""
    return op.viewed(without(op.shape, dim), without(op.strides, dim))


def group_reduce(fn: KernelFunction, value, lanes: int, combine: Callable):
    """Combine across the `lanes` consecutive lanes of a group; every lane ends with the result."""
    step = lanes // 2
    while step:
        value = combine(fn, value, fn.shuffle_xor(value, step))
        step //= 2
    return value


@attrs.frozen
class RowRead:
    """A row that a group of lanes has read (`emit_row_reduce`): its index `o` and whether it is in range,
    the lane, the row (a 1-D Array) and, where the loop keeps the row resident, the lane's elements (Vars,
    load by load)."""

    o: object
    lane: object
    row: Array
    in_range: object
    xs: Optional[list] = None


def emit_row_reduce(fn: KernelFunction, threads: Threads, src: Array, dim: int, fold: Fold, loop: RowLoop,
                    finish: Callable) -> None:
    """For each row of `src` along `dim`, fold its elements across a group of lanes as `loop` says
    (mdsl.lowering.grid.RowLoop: each lane's chunks in order, then the lanes by shuffles, then a group's
    warps in order: a fixed order); then finish(read, v) writes what the row gives (read: the `RowRead`;
    v: the folded value on every lane of the group)."""
    rows = without(src.shape, dim)
    n_rows, length, stride = math.prod(rows), src.shape[dim], src.strides[dim]
    vector = loop.vector
    b = fn.b
    with threads.each_group(fn, n_rows, loop.lanes) as (o, lane):
        v = fn.var(f32(fold.identity))
        in_range = b.icmp_unsigned("<", o, i32(n_rows))
        start = fn.address(src, b.select(in_range, fn.offset(o, rows, row_view(src, dim)), i32(0)))
        row = Array(start, src.dtype, (length,), (stride,))
        xs = [fn.var(f32(0.0)) for _ in range(loop.trips(length) * vector)] if loop.resident else None

        def chunk(k, c) -> None:
            for e, x in enumerate(_chunk_values(fn, row, c, vector)):
                if xs is not None:
                    xs[k * vector + e].set(x)
                v.set(fold.step(fn, v.get(), x))

        with fn.when(in_range):
            _each_chunk(fn, loop, length, lane, chunk)
        value = v.get()
        if loop.lanes > WARP:
            value = warps_reduce(fn, value, loop.lanes, threads.block, fold.combine)
        elif loop.lanes > 1:
            value = group_reduce(fn, value, loop.lanes, fold.combine)
        finish(RowRead(o, lane, row, in_range, xs), value)


def emit_row_map(fn: KernelFunction, read: RowRead, out: Array, dim: int, loop: RowLoop, value: Callable) -> None:
    """Inside `emit_row_reduce`'s finish, on a row in range: each element x of the lane's chunks of the row
    written to `out` (of the source's shape) as value(x) (from the loop's registers where it keeps the row
    resident, else read again)."""
    b, row, vector = fn.b, read.row, loop.vector
    rows, length = without(out.shape, dim), out.shape[dim]
    out_row = Array(fn.address(out, fn.offset(read.o, rows, row_view(out, dim))), out.dtype, (length,),
                    (out.strides[dim],))

    def chunk(k, c) -> None:
        xs = ([x.get() for x in read.xs[k * vector:(k + 1) * vector]] if read.xs is not None
              else _chunk_values(fn, row, c, vector))
        fn.store_floats(out_row, b.mul(c, i32(vector * out.strides[dim])), [value(x) for x in xs])

    _each_chunk(fn, loop, length, read.lane, chunk)


def _chunk_values(fn: KernelFunction, row: Array, c, vector: int) -> list:
    """Chunk c of a row (`vector` consecutive elements, one load) as f32 values."""
    at = c if vector * row.strides[0] == 1 else fn.b.mul(c, i32(vector * row.strides[0]))
    return fn.load_floats(row, at, vector)


def _each_chunk(fn: KernelFunction, loop: RowLoop, length: int, lane, body: Callable) -> None:
    """body(k, c) for each chunk c of the lane's part of a row (k: the lane's load counter where the loop
    keeps the row resident, written out; else None, in a loop unrolled ROW_UNROLL times); chunks past the
    row's end are skipped."""
    chunks, lanes = loop.chunks(length), loop.lanes
    if not loop.resident:
        unrolled_loop(fn, lane, chunks, lanes, ROW_UNROLL, lambda c: body(None, c))
        return
    for k in range(loop.trips(length)):
        c = lane if k == 0 else fn.b.add(lane, i32(k * lanes))
        if (k + 1) * lanes <= chunks:
            body(k, c)
        else:
            with fn.when(fn.b.icmp_unsigned("<", c, i32(chunks))):
                body(k, c)


def warps_reduce(fn: KernelFunction, value, lanes: int, block: int, combine: Callable):
    """Combine across a group of `lanes` consecutive threads that are whole warps: each warp's result
    through a shared float per warp of the block, combined in warp order on every thread of the group;
    every thread of the block takes part (two barriers)."""
    b, tid = fn.b, fn.sreg("tid.x")
    value = group_reduce(fn, value, WARP, combine)
    part = Array(fn.mb.static_smem(f"{fn.fn.name}_part", F32, block // WARP), "f32", (block // WARP,), (1,))
    warp, warps = b.udiv(tid, i32(WARP)), lanes // WARP
    with fn.when(b.icmp_unsigned("==", b.urem(tid, i32(WARP)), i32(0))):
        fn.store_float(part, warp, value)
    fn.barrier()
    first = b.mul(b.udiv(warp, i32(warps)), i32(warps))
    value = fn.load_float(part, first)
    for k in range(1, warps):
        value = combine(fn, value, fn.load_float(part, b.add(first, i32(k))))
    fn.barrier()   # every group has read its parts before they are written again
    return value

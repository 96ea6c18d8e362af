"""The PTX rule of every operator (`rule_table.PtxRule`), registered in `PTX_RULES`: the same kernels as
the CUDA backend's rules write, with the same grids, lanes and tensor-core choices (mdsl.lowering.grid,
mdsl.lowering.mma), as LLVM IR. A block matmul runs on tensor cores where the lowering chose mma.sync
(`mdsl.backend.ptx.mma`), a kernel-level one of 16-bit operands as a tensor-core tile with a cp.async ring
(`_gemm_tile_mma`). All arithmetic is f32; values are rounded to their dtype where they are stored.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import attrs
from llvmlite import ir

from mdsl.backend.ptx import mathlib
from mdsl.backend.ptx.block import emit_custom
from mdsl.backend.ptx.llvm import ELEMENT_TYPES, F32, ITEMSIZE, Array, KernelFunction, f32, i32
from mdsl.backend.ptx.loops import (MAX, SUM, SUM_OF_SQUARES, Fold, Threads, emit_row_map, emit_row_reduce,
                                    emit_thread_graph, rescale, row_view, weighted_sum)
from mdsl.backend.ptx.mma import BlockMma
from mdsl.backend.ptx.rule_table import PTX_RULES, PtxRule
from mdsl.errors import UnsupportedError
from mdsl.ir.graph import Node
from mdsl.lowering.grid import (KERNEL_THREADS, RowLoop, alone, block_lanes, kernel_grid, kernel_row_loop,
                                reduced_dim, row_kernel_grid, without)
from mdsl.lowering.mma import MmaShape, kernel_mma_dtype
from mdsl.lowering.views import is_view

GEMM_TILE = 64            # the standard matmul kernel: a 64 x 64 tile of the product per block,
GEMM_K_STEP = 16          # K walked 16 at a time through shared memory,
GEMM_PER_THREAD = 4       # each thread keeping a 4 x 4 piece of the tile:
_GEMM_SIDE = GEMM_TILE // GEMM_PER_THREAD   # 16 x 16 threads
GEMM_THREADS = _GEMM_SIDE * _GEMM_SIDE
_A_PAD = 4                # A's tile is stored transposed, its rows padded against bank conflicts
# the tensor-core matmul kernel (16-bit operands): the same 64 x 64 tile and 256 threads,
MMA_K_STEP = 32           # K walked 32 at a time
MMA_STAGES = 4            # through a ring of 4 buffers (three steps in flight),
MMA_PAD = 8               # rows padded by 8 elements (16 bytes: aligned, fewer bank conflicts),
MMA_VECTOR = 8            # copied 8 elements (16 bytes) at a time


def _grid_threads() -> Threads:
    return Threads(KERNEL_THREADS, grid=True)


def _block_rows(bk, src: Array, dim: int) -> RowLoop:
    """A block-level reduction's rows: a group of lanes each, an element a load."""
    return RowLoop(block_lanes(bk.threads.block, src.shape, dim))


# ---------------------------------------------------------------------------------------------
# element-wise operators


@attrs.frozen
class Elementwise(PtxRule):
    compute: Callable  # (fn, node, f32 operand values) -> f32 value

    def value(self, fn: KernelFunction, node: Node, args: list):
        return self.compute(fn, node, args)

    def block(self, bk, node: Node) -> None:
        tg = alone(node)
        emit_thread_graph(bk.fn, bk.threads, tg, [bk.tile(v) for v in tg.inputs], [bk.tile(v) for v in node.outputs])

    def kernel(self, program, index: int, node: Node) -> None:
        tg = alone(node)
        with program.kernel(index, node, grid=kernel_grid(node.output.type.numel), threads=KERNEL_THREADS) as k:
            emit_thread_graph(k.fn, _grid_threads(), tg, [k.inputs[node.inputs.index(v)] for v in tg.inputs],
                              k.outputs)


def _reciprocal(fn, x):
    return fn.b.fdiv(f32(1.0), x)


def _one_plus_exp_neg(fn, x):
    return fn.b.fadd(f32(1.0), fn.math("exp", fn.b.fneg(x)))


def _gelu(fn, x):
    b = fn.b
    erf = fn.math("erf", b.fmul(x, f32(0.70710678118654752)))
    return b.fmul(b.fmul(f32(0.5), x), b.fadd(f32(1.0), erf))


def _cast(fn, node, a):
    # a float value is rounded where it is stored; an integer one is truncated now
    return a[0] if node.attr("dtype").is_float else fn.call_math("trunc", a[0])


def _unary(compute: Callable) -> Elementwise:
    return Elementwise(lambda fn, node, a: compute(fn, a[0]))


def _binary(method: str) -> Elementwise:
    return Elementwise(lambda fn, node, a: getattr(fn.b, method)(a[0], a[1]))


def _attr(node: Node, name: str):
    return f32(node.attr(name))


_ELEMENTWISE = {
    "exp": _unary(lambda fn, x: fn.math("exp", x)),
    "silu": _unary(lambda fn, x: fn.b.fdiv(x, _one_plus_exp_neg(fn, x))),
    "gelu": _unary(_gelu),
    "relu": _unary(lambda fn, x: fn.call_math("maxnum", x, f32(0.0))),
    "sigmoid": _unary(lambda fn, x: fn.b.fdiv(f32(1.0), _one_plus_exp_neg(fn, x))),
    "sqrt": _unary(lambda fn, x: fn.call_math("sqrt", x)),
    "rsqrt": _unary(lambda fn, x: _reciprocal(fn, fn.call_math("sqrt", x))),
    "square": _unary(lambda fn, x: fn.b.fmul(x, x)),
    "neg": _unary(lambda fn, x: fn.b.fneg(x)),
    "reciprocal": _unary(_reciprocal),
    "mul_scalar": Elementwise(lambda fn, node, a: fn.b.fmul(a[0], _attr(node, "value"))),
    "add_scalar": Elementwise(lambda fn, node, a: fn.b.fadd(a[0], _attr(node, "value"))),
    "pow_scalar": Elementwise(lambda fn, node, a: mathlib.power(fn, a[0], _attr(node, "exponent").constant)),
    "clamp": Elementwise(lambda fn, node, a: fn.call_math("minnum", fn.call_math("maxnum", a[0], _attr(node, "min")),
                                                          _attr(node, "max"))),
    "cast": Elementwise(_cast),
    "add": _binary("fadd"),
    "sub": _binary("fsub"),
    "mul": _binary("fmul"),
    "div": _binary("fdiv"),
}


class Fused(PtxRule):
    """A block-level thread graph: the whole chain per element, in registers."""

    def block(self, bk, node: Node) -> None:
        emit_thread_graph(bk.fn, bk.threads, node.body, [bk.tile(v) for v in node.inputs],
                          [bk.tile(v) for v in node.outputs])


# ---------------------------------------------------------------------------------------------
# matmul


def _batch_start(fn: KernelFunction, op: Array, batch: tuple, index) -> Array:
    """The operand's matrix for the batch `index` of a loop over `batch` (broadcast where it has none)."""
    if not batch:
        return op
    view = op.viewed(op.shape[:-2], op.strides[:-2])
    start = fn.offset(index, batch, view)
    return Array(fn.address(op, start), op.dtype, op.shape[-2:], op.strides[-2:])


class Matmul(PtxRule):
    def block(self, bk, node: Node) -> None:
        """On tensor cores where the operands allow (`mdsl.backend.ptx.mma`, the CUDA backend's
        choice), else one thread per output element, its dot product over K read from the two
        tiles. A matmul whose sum the loop keeps in registers adds into its accumulator's fragments."""
        a, w, out = bk.tile(node.inputs[0]), bk.tile(node.inputs[1]), bk.tile(node.output)
        mma = bk.block_mma(node)
        if mma is None:
            self._scalar(bk, a, w, out)
            return
        entry = bk.register_accumulators.get(node.output.name)
        if entry is not None:
            acc, running = entry
            # the accumulator's rule folds this iteration's product into its running fragments
            PTX_RULES[acc.op].fold_product(bk, acc, mma, running,
                                                lambda frags: mma.multiply(frags, a, w, out.shape[:-2]))
            return
        frags = mma.zeroed()
        mma.multiply(frags, a, w, out.shape[:-2])
        mma.store(frags, out)

    def _scalar(self, bk, a: Array, w: Array, out: Array) -> None:
        fn, b = bk.fn, bk.fn.b
        k_len, n = a.shape[-1], out.shape[-1]
        rows = a.viewed(a.shape[:-1] + (1,), a.strides)           # row m of a, the same for every n
        cols = w.viewed(w.shape[:-2] + (1, n), w.strides)          # column n of w, the same for every m

        def element(i) -> None:
            a_row = Array(fn.address(a, fn.offset(i, out.shape, rows)), a.dtype, (k_len,), (1,))
            w_col = Array(fn.address(w, fn.offset(i, out.shape, cols)), w.dtype, (k_len,), (w.strides[-2],))
            acc = fn.var(f32(0.0))
            with fn.loop(i32(0), k_len, 1) as k:
                x = fn.load_float(a_row, k)
                y = fn.load_float(w_col, b.mul(k, i32(w.strides[-2])))
                acc.set(fn.call_math("fma", x, y, acc.get()))
            fn.store_float(out, fn.offset(i, out.shape, out), acc.get())

        bk.threads.for_each(fn, math.prod(out.shape), element)

    def kernel(self, program, index: int, node: Node) -> None:
        """A GEMM_TILE x GEMM_TILE tile of the product per block, a batch per grid z."""
        (m, k_len), n = node.inputs[0].shape[-2:], node.output.shape[-1]
        batch = node.output.shape[:-2]
        batches = math.prod(batch)
        if batches > 65535:
            raise UnsupportedError(f"matmul over {batches} batches: at most 65535 (the grid's z dim)",
                                   hint="reshape the batch dims into the rows of the left operand")
        grid = (-(-n // GEMM_TILE), -(-m // GEMM_TILE), batches)
        with program.kernel(index, node, grid=grid, threads=GEMM_THREADS) as k:
            fn = k.fn
            z = fn.sreg("ctaid.z") if batch else None
            a, w, out = (_batch_start(fn, op, batch, z) for op in (k.inputs[0], k.inputs[1], k.outputs[0]))
            if kernel_mma_dtype(node, program.options, program.arch) is not None:   # MDSL_CUDA_MMA=0: the scalar tile
                _gemm_tile_mma(fn, program, m, n, k_len, a, w, out)
            else:
                _gemm_tile(fn, program, m, n, k_len, a, w, out)


def _stage_tile(fn: KernelFunction, dst: Array, src: Array, r0, c0) -> None:
    """dst (ROWS x COLS, rows padded) = src[r0:, c0:] (a row-major R x C matrix): 16-byte cp.async
    copies where a row's 8 elements are inside the matrix and aligned, else one element at a time,
    zeros outside (the CUDA backend's `mdsl::stage_tile`)."""
    b = fn.b
    (rows, cols), (big_rows, big_cols) = dst.shape, src.shape
    per_row = cols // MMA_VECTOR
    tid = fn.sreg("tid.x")

    def vector(v) -> None:
        r, c = b.udiv(v, i32(per_row)), b.mul(b.urem(v, i32(per_row)), i32(MMA_VECTOR))
        gr, gc = b.add(r0, r), b.add(c0, c)
        to = b.add(b.mul(r, i32(dst.strides[0])), c)
        row_inside = b.icmp_unsigned("<", gr, i32(big_rows))
        whole = b.and_(row_inside, b.icmp_unsigned("<=", b.add(gc, i32(MMA_VECTOR)), i32(big_cols)))
        cases = [whole] if big_cols % MMA_VECTOR == 0 else []
        for case in fn.chain(cases):
            if cases and case == 0:
                fn.copy_async(fn.address(dst, to), fn.address(src, b.add(b.mul(gr, i32(big_cols)), gc)),
                              MMA_VECTOR * ITEMSIZE[src.dtype])
                continue
            for j in range(MMA_VECTOR):
                col = b.add(gc, i32(j))
                inside = b.and_(row_inside, b.icmp_unsigned("<", col, i32(big_cols)))
                at = b.select(inside, b.add(b.mul(gr, i32(big_cols)), col), i32(0))   # an element that exists
                value = b.select(inside, fn.load(src, at), ir.Constant(src.etype, 0))
                fn.b.store(value, fn.address(dst, b.add(to, i32(j))))

    vectors = rows * per_row
    for first in range(0, vectors, GEMM_THREADS):
        v = b.add(tid, i32(first)) if first else tid
        if first + GEMM_THREADS <= vectors:
            vector(v)
        else:
            with fn.when(b.icmp_unsigned("<", v, i32(vectors))):
                vector(v)


def _gemm_tile_mma(fn: KernelFunction, program, m: int, n: int, k_len: int, a: Array, w: Array, out: Array) -> None:
    """One 64 x 64 tile of C = A B on tensor cores (A, B of one 16-bit dtype, row-major) for a block of
    256 threads: K in steps of 32 through a ring of MMA_STAGES shared-memory buffers, the tiles of the
    next MMA_STAGES - 1 steps in flight (cp.async) while one step multiplies (`mdsl::gemm_tile_mma`)."""
    b, dtype = fn.b, a.dtype
    tile, step, stages = GEMM_TILE, MMA_K_STEP, MMA_STAGES
    lda, ldb = step + MMA_PAD, tile + MMA_PAD
    etype = ELEMENT_TYPES[dtype]
    a_ring = fn.shared_pointer(program.mb.static_smem(f"{fn.fn.name}_a", etype, stages * tile * lda))
    b_ring = fn.shared_pointer(program.mb.static_smem(f"{fn.fn.name}_b", etype, stages * step * ldb))
    m0, n0 = b.mul(fn.sreg("ctaid.y"), i32(tile)), b.mul(fn.sreg("ctaid.x"), i32(tile))
    a_matrix, w_matrix = a.viewed((m, k_len), (k_len, 1)), w.viewed((k_len, n), (n, 1))
    steps = -(-k_len // step)

    def slots(s):
        """Step s's buffers of A (tile x step) and B (step x tile)."""
        ring = i32(s % stages) if isinstance(s, int) else b.urem(s, i32(stages))
        a_at = b.gep(a_ring, [b.mul(ring, i32(tile * lda))], inbounds=True, source_etype=etype)
        b_at = b.gep(b_ring, [b.mul(ring, i32(step * ldb))], inbounds=True, source_etype=etype)
        return Array(a_at, dtype, (tile, step), (lda, 1)), Array(b_at, dtype, (step, tile), (ldb, 1))

    def load(s) -> None:
        """Step s's tiles, one commit group (empty past the end: every wait counts the same)."""
        def copies() -> None:
            a_slot, b_slot = slots(s)
            k0 = i32(s * step) if isinstance(s, int) else b.mul(s, i32(step))
            _stage_tile(fn, a_slot, a_matrix, m0, k0)
            _stage_tile(fn, b_slot, w_matrix, k0, n0)

        if isinstance(s, int):
            if s < steps:
                copies()
        else:
            with fn.when(b.icmp_unsigned("<", s, i32(steps))):
                copies()
        fn.copy_async_commit()

    shape = MmaShape(dtype, 1, tile, tile, step, GEMM_THREADS // 32)
    mma = BlockMma(fn, shape, dtype)
    acc = mma.zeroed()
    for s in range(stages - 1):
        load(s)
    with fn.loop(i32(0), steps, 1) as s:
        load(b.add(s, i32(stages - 1)))   # into the buffer the last step read: free since its closing barrier
        fn.copy_async_wait(stages - 1)
        fn.barrier()
        mma.multiply(acc, *slots(s), ())
        fn.barrier()

    def put(var, value, batch, row, col) -> None:
        r, c = b.add(m0, row), b.add(n0, col)
        inside = b.and_(b.icmp_unsigned("<", r, i32(m)), b.icmp_unsigned("<", c, i32(n)))
        with fn.when(inside):
            fn.store_float(out, b.add(b.mul(r, i32(n)), c), value)

    mma.each(acc, acc, put)


def _gemm_tile(fn: KernelFunction, program, m: int, n: int, k_len: int, a: Array, w: Array, out: Array) -> None:
    """One 64 x 64 tile of C = A B (row-major; A is M x K, B is K x N) for a block of 256 threads: K is
    walked in steps of 16 through shared memory (A transposed, so that a thread reads its 4 rows'
    values at once), each thread keeps a 4 x 4 piece of C in registers."""
    b = fn.b
    tile, step, per = GEMM_TILE, GEMM_K_STEP, GEMM_PER_THREAD
    a_row = tile + _A_PAD
    a_smem = fn.shared_pointer(program.mb.static_smem(f"{fn.fn.name}_a", F32, step * a_row))
    b_smem = fn.shared_pointer(program.mb.static_smem(f"{fn.fn.name}_b", F32, step * tile))
    a_tile = Array(a_smem, "f32", (step, a_row), (a_row, 1))
    b_tile = Array(b_smem, "f32", (step, tile), (tile, 1))
    tid = fn.sreg("tid.x")
    tx, ty = b.urem(tid, i32(_GEMM_SIDE)), b.udiv(tid, i32(_GEMM_SIDE))
    m0, n0 = b.mul(fn.sreg("ctaid.y"), i32(tile)), b.mul(fn.sreg("ctaid.x"), i32(tile))
    acc = [[fn.var(f32(0.0)) for _ in range(per)] for _ in range(per)]

    def stage(src: Array, rows: int, cols: int, rows_limit, row0, col0, cols_limit, ld: int, store) -> None:
        """Copy a rows x cols piece of `src` at (row0, col0) to shared memory, zero outside it."""
        for e0 in range(0, rows * cols, GEMM_THREADS):
            e = b.add(tid, i32(e0))
            r, c = b.udiv(e, i32(cols)), b.urem(e, i32(cols))
            gr, gc = b.add(row0, r), b.add(col0, c)
            inside = b.and_(b.icmp_unsigned("<", gr, i32(rows_limit)), b.icmp_unsigned("<", gc, i32(cols_limit)))
            at = b.select(inside, b.add(b.mul(gr, i32(ld)), gc), i32(0))
            store(r, c, b.select(inside, fn.load_float(src, at), f32(0.0)))

    with fn.loop(i32(0), k_len, step) as k0:
        stage(a, tile, step, m, m0, k0, k_len, k_len,
              lambda r, c, v: fn.store_float(a_tile, b.add(b.mul(c, i32(a_row)), r), v))
        stage(w, step, tile, k_len, k0, n0, n, n,
              lambda r, c, v: fn.store_float(b_tile, b.add(b.mul(r, i32(tile)), c), v))
        fn.barrier()
        a_base, b_base = b.mul(ty, i32(per)), tx
        for kk in range(step):
            xs = [fn.load_float(a_tile, b.add(a_base, i32(kk * a_row + i))) for i in range(per)]
            ys = [fn.load_float(b_tile, b.add(b_base, i32(kk * tile + _GEMM_SIDE * j))) for j in range(per)]
            for i in range(per):
                for j in range(per):
                    acc[i][j].set(fn.call_math("fma", xs[i], ys[j], acc[i][j].get()))
        fn.barrier()
    for i in range(per):
        row = b.add(m0, b.add(b.mul(ty, i32(per)), i32(i)))
        for j in range(per):
            col = b.add(n0, b.add(tx, i32(_GEMM_SIDE * j)))
            inside = b.and_(b.icmp_unsigned("<", row, i32(m)), b.icmp_unsigned("<", col, i32(n)))
            with fn.when(inside):
                fn.store_float(out, b.add(b.mul(row, i32(n)), col), acc[i][j].get())


# ---------------------------------------------------------------------------------------------
# reductions and norms over one dim


def _row_kernel(program, index: int, node: Node, emit: Callable) -> None:
    """A kernel-level reduction or norm: groups of lanes over the rows of the whole tensor, as the lowering
    says (mdsl.lowering.grid.kernel_row_loop)."""
    loop = kernel_row_loop(node)
    with program.kernel(index, node, grid=row_kernel_grid(node), threads=loop.threads()) as k:
        emit(k.fn, Threads(loop.threads(), grid=True), node, k.inputs[0], k.outputs[0], loop)


def _first_lane(fn: KernelFunction, in_range, lane):
    return fn.b.and_(in_range, fn.b.icmp_unsigned("==", lane, i32(0)))


@attrs.frozen
class Reduction(PtxRule):
    fold: Fold
    mean: bool = False

    def _emit(self, fn: KernelFunction, threads: Threads, node: Node, src: Array, out: Array, loop: RowLoop) -> None:
        dim = reduced_dim(node)
        rows = without(src.shape, dim)
        out_rows = row_view(out, dim) if node.attr("keepdim") else out

        def finish(read, v) -> None:
            value = fn.b.fdiv(v, f32(src.shape[dim])) if self.mean else v
            with fn.when(_first_lane(fn, read.in_range, read.lane)):
                fn.store_float(out_rows, fn.offset(read.o, rows, out_rows), value)

        emit_row_reduce(fn, threads, src, dim, self.fold, loop, finish)

    def block(self, bk, node: Node) -> None:
        src = bk.tile(node.inputs[0])
        self._emit(bk.fn, bk.threads, node, src, bk.tile(node.output), _block_rows(bk, src, reduced_dim(node)))

    def kernel(self, program, index: int, node: Node) -> None:
        _row_kernel(program, index, node, self._emit)


class RmsNorm(PtxRule):
    """x / sqrt(mean(x^2 over dim) + eps): a group of lanes per row folds the squares, then writes (from the
    registers where the loop keeps the row resident)."""

    def _emit(self, fn: KernelFunction, threads: Threads, node: Node, src: Array, out: Array, loop: RowLoop) -> None:
        dim = reduced_dim(node)
        length = src.shape[dim]
        b = fn.b

        def finish(read, v) -> None:
            mean = b.fadd(b.fdiv(v, f32(length)), f32(node.attr("eps")))
            inv = b.fdiv(f32(1.0), fn.call_math("sqrt", mean))
            with fn.when(read.in_range):
                emit_row_map(fn, read, out, dim, loop, lambda x: b.fmul(x, inv))

        emit_row_reduce(fn, threads, src, dim, SUM_OF_SQUARES, loop, finish)

    def block(self, bk, node: Node) -> None:
        src = bk.tile(node.inputs[0])
        self._emit(bk.fn, bk.threads, node, src, bk.tile(node.output), _block_rows(bk, src, reduced_dim(node)))

    def kernel(self, program, index: int, node: Node) -> None:
        _row_kernel(program, index, node, self._emit)


# ---------------------------------------------------------------------------------------------
# layout operators


def _coordinate(fn: KernelFunction, i, space: tuple, dim: int):
    """The coordinate along `dim` of element i of a loop over `space`."""
    strides = tuple(1 if d == dim else 0 for d in range(len(space)))
    return fn.offset(i, space, Array(None, "f32", space, strides))


def _pieces(fn: KernelFunction, c, pieces: list, dim: int, write: Callable) -> None:
    """An if-chain on the coordinate c along `dim`: piece k covers c in [start, end)."""
    starts, start = [], 0
    for piece in pieces:
        starts.append(start)
        start += piece.shape[dim]
    conditions = [fn.b.icmp_unsigned("<", c, i32(s + p.shape[dim])) for s, p in zip(starts[:-1], pieces[:-1])]
    for k in fn.chain(conditions):
        write(pieces[k], starts[k])


def _shifted(fn: KernelFunction, i, space: tuple, piece: Array, dim: int, start: int):
    """Offset in `piece` of element i of `space`, whose coordinate along `dim` is `start` too far."""
    at = fn.offset(i, space, piece.viewed(space, piece.strides))
    return at if start == 0 else fn.b.sub(at, i32(start * piece.strides[dim]))


class Concat(PtxRule):
    def _emit(self, fn: KernelFunction, threads: Threads, node: Node, ins: list, out: Array) -> None:
        dim = node.attr("dim") % node.output.type.rank
        space = out.shape

        def element(i) -> None:
            c = _coordinate(fn, i, space, dim)
            at = fn.offset(i, space, out)

            def write(piece: Array, start: int) -> None:
                value = fn.load(piece, _shifted(fn, i, space, piece, dim, start))
                fn.b.store(fn.convert(value, piece.dtype, out.dtype), fn.address(out, at))

            _pieces(fn, c, ins, dim, write)

        threads.for_each(fn, math.prod(space), element)

    def block(self, bk, node: Node) -> None:
        self._emit(bk.fn, bk.threads, node, [bk.tile(v) for v in node.inputs], bk.tile(node.output))

    def kernel(self, program, index: int, node: Node) -> None:
        _copy_kernel(program, index, node)


class Split(PtxRule):
    def kernel(self, program, index: int, node: Node) -> None:
        _copy_kernel(program, index, node)


def _copy_kernel(program, index: int, node: Node) -> None:
    """A kernel-level split's or concat's kernel (`ProgramBuilder.copy_kernel`): a loop of each copy."""
    def copy(k, c) -> None:
        fn = k.fn
        src, dst = _from(fn, k.inputs[c.source], c.source_offset, c.shape), \
            _from(fn, k.outputs[c.target], c.target_offset, c.shape)
        with _grid_threads().each(fn, math.prod(c.shape)) as i:
            value = fn.convert(fn.load(src, fn.offset(i, c.shape, src)), src.dtype, dst.dtype)
            fn.b.store(value, fn.address(dst, fn.offset(i, c.shape, dst)))

    program.copy_kernel(index, node, copy)


def _from(fn: KernelFunction, array: Array, at: int, shape: tuple) -> Array:
    """The elements of `shape` of `array` from `at` on, by its strides."""
    base = fn.b.gep(array.ptr, [i32(at)], inbounds=True, source_etype=array.etype) if at else array.ptr
    return Array(base, array.dtype, shape, array.strides)


class Transpose(PtxRule):
    """On tiles, the elements copied into the result's tile, the operand read through its strides permuted (a
    weight's tile as stored, [n][k], becomes the [k][n] tile a matmul takes); at the kernel level, a kernel
    of that copy, or an alias where only dims of size 1 move."""

    def block(self, bk, node: Node) -> None:
        fn, x, out = bk.fn, bk.tile(node.inputs[0]), bk.tile(node.output)
        permuted = x.viewed(out.shape, tuple(x.strides[p] for p in node.attr("perm")))

        def element(i) -> None:
            value = fn.load(x, fn.offset(i, out.shape, permuted))
            fn.b.store(fn.convert(value, x.dtype, out.dtype), fn.address(out, fn.offset(i, out.shape, out)))

        bk.threads.for_each(fn, node.output.type.numel, element)

    def kernel(self, program, index: int, node: Node) -> None:
        if is_view(node):   # (only size-1 dims move: the same row-major elements)
            program.alias(node.output.name, node.inputs[0].name)
            return
        perm = node.attr("perm")
        with program.kernel(index, node, grid=kernel_grid(node.output.type.numel), threads=KERNEL_THREADS) as k:
            fn, x, out = k.fn, k.inputs[0], k.outputs[0]
            permuted = x.viewed(out.shape, tuple(x.strides[p] for p in perm))
            with _grid_threads().each(fn, node.output.type.numel) as i:
                fn.b.store(fn.load(x, fn.offset(i, out.shape, permuted)), fn.address(out, i))


class Reshape(PtxRule):
    """A view of the same row-major elements: no kernel, an alias. On tiles, the elements copied in row-major
    order into the result's tile (a tile's rows may be padded, so a regrouped tile is not a view of it)."""

    def block(self, bk, node: Node) -> None:
        fn, x, out = bk.fn, bk.tile(node.inputs[0]), bk.tile(node.output)

        def element(i) -> None:
            value = fn.load(x, fn.offset(i, x.shape, x))
            fn.b.store(fn.convert(value, x.dtype, out.dtype), fn.address(out, fn.offset(i, out.shape, out)))

        bk.threads.for_each(fn, node.output.type.numel, element)

    def kernel(self, program, index: int, node: Node) -> None:
        program.alias(node.output.name, node.inputs[0].name)


class Custom(PtxRule):
    def kernel(self, program, index: int, node: Node) -> None:
        emit_custom(program, index, node)


# ---------------------------------------------------------------------------------------------
# accumulators: the running value lives in an f32 tile for the whole loop


def _fill(bk, tile: Array, value) -> None:
    bk.threads.for_each(bk.fn, math.prod(tile.shape),
                        lambda i: bk.fn.store_float(tile, bk.fn.offset(i, tile.shape, tile), value))


@attrs.frozen
class Accumulate(PtxRule):
    """Element-wise: the running value and the tile have one shape."""

    identity: float
    step: Callable                     # (fn, running value, this iteration's value) -> value
    finalize = None                    # the running value is the result

    def init(self, bk, node: Node) -> None:
        _fill(bk, bk.tile(node.output), f32(self.identity))

    def fold_product(self, bk, node: Node, mma, running: list, multiply: Callable) -> None:
        """A sum kept in mma fragments (accum only: `schedule.REGISTER_ACCUMULATORS`): the product
        is accumulated straight into them."""
        multiply(running)

    def update(self, bk, node: Node) -> None:
        fn, acc, x = bk.fn, bk.tile(node.output), bk.tile(node.inputs[0])

        def element(i) -> None:
            at = fn.offset(i, acc.shape, acc)
            fn.store_float(acc, at, self.step(fn, fn.load_float(acc, at), fn.load_float(x, fn.offset(i, acc.shape, x))))

        bk.threads.for_each(fn, math.prod(acc.shape), element)


def _row_finalize(last_step: Callable) -> Callable:
    """A last step on each running row value (fn, node, value, count: elements folded per row)."""

    def finalize(bk, node: Node) -> None:
        fn, acc = bk.fn, bk.tile(node.output)
        count = f32(bk.bg.forloop * node.inputs[0].shape[-1])

        def element(i) -> None:
            at = fn.offset(i, acc.shape, acc)
            fn.store_float(acc, at, last_step(fn, node, fn.load_float(acc, at), count))

        bk.threads.for_each(fn, math.prod(acc.shape), element)

    return finalize


def _mean(fn, node, value, count):
    return fn.b.fdiv(value, count)


def _rms(fn, node, value, count):
    return fn.call_math("sqrt", fn.b.fadd(fn.b.fdiv(value, count), f32(node.attr("eps", 0.0))))


@attrs.frozen
class AccumulateRows(PtxRule):
    """Over the iterations and the tile's last dim: a group of lanes folds each row of the tile."""

    fold: Fold
    finalize: Optional[Callable] = None

    def init(self, bk, node: Node) -> None:
        _fill(bk, bk.tile(node.output), f32(self.fold.identity))

    def update(self, bk, node: Node) -> None:
        fn, acc, x = bk.fn, bk.tile(node.output), bk.tile(node.inputs[0])
        last = len(x.shape) - 1

        def finish(read, v) -> None:
            with fn.when(_first_lane(fn, read.in_range, read.lane)):
                at = fn.offset(read.o, acc.shape, acc)  # the running value's shape is the rows' with a last dim of 1
                fn.store_float(acc, at, fn.b.fadd(fn.load_float(acc, at), v))

        emit_row_reduce(fn, bk.threads, x, last, self.fold, _block_rows(bk, x, last), finish)


class _Rescaling(PtxRule):
    """Online softmax's accumulators, inputs (x, m): the running value is kept relative to M, the
    running maximum of m. Each iteration, with M' = max(M, m): acc <- acc exp(M - M') + x exp(m - M').
    M is double-buffered in the scratch tile (iteration `it` reads buffer it % 2, writes the other),
    so updating it needs no barrier of its own."""

    finalize = None

    def init(self, bk, node: Node) -> None:
        _fill(bk, bk.tile(node.output), f32(0.0))
        m = node.inputs[1]
        scratch = bk.scratch(node)
        bk.threads.for_each(bk.fn, m.type.numel,   # buffer 0: iteration 0's M
                            lambda i: bk.fn.store_float(scratch, i, f32(float("-inf"))))

    def _maxima(self, bk, node: Node) -> tuple:
        """This iteration's M and the next one's, as Arrays of m's shape."""
        fn, b = bk.fn, bk.fn.b
        m = node.inputs[1].type
        scratch = bk.scratch(node)
        it = bk.loop_counter
        parity = b.and_(it, i32(1))
        now = fn.address(scratch, b.mul(parity, i32(m.numel)))
        nxt = fn.address(scratch, b.mul(b.sub(i32(1), parity), i32(m.numel)))
        return Array.contiguous(now, "f32", m.shape), Array.contiguous(nxt, "f32", m.shape)

    def _update_maximum(self, bk, node: Node, now: Array, nxt: Array) -> None:
        fn, m = bk.fn, bk.tile(node.inputs[1])
        bk.threads.for_each(fn, math.prod(m.shape), lambda i: fn.store_float(
            nxt, i, fn.call_math("maxnum", fn.load_float(now, i), fn.load_float(m, fn.offset(i, m.shape, m)))))

    def _weights(self, bk, node: Node, now: Array, index, shape: tuple) -> tuple:
        """(exp(M - M'), exp(m - M')): the weights of the running value and of this iteration's, where
        the element's m is at `index` of `shape`."""
        fn, m = bk.fn, bk.tile(node.inputs[1])
        mv = fn.load_float(m, fn.offset(index, shape, m))
        top = fn.load_float(now, fn.offset(index, shape, now))
        top_next = fn.call_math("maxnum", top, mv)
        return rescale(fn, top, top_next), rescale(fn, mv, top_next)

    def _rescaled(self, bk, node: Node, now: Array, running, index, shape: tuple, value):
        """The running value with `value` folded in, where its element of m is at `index` of `shape`."""
        old, new = self._weights(bk, node, now, index, shape)
        return weighted_sum(bk.fn, running, old, value, new)

    def _fold_rescaled(self, bk, node: Node, now: Array, acc: Array, at, index, shape: tuple, value) -> None:
        """Fold `value` into the running value at `at` of the tile."""
        fn = bk.fn
        fn.store_float(acc, at, self._rescaled(bk, node, now, fn.load_float(acc, at), index, shape, value))


class AccumulateRescaled(_Rescaling):
    def fold_product(self, bk, node: Node, mma, running: list, multiply: Callable) -> None:
        """The running value kept in mma fragments: this iteration's product into fresh fragments,
        each element then folded into its running one as `update` does on the tile."""
        fn, acc = bk.fn, bk.tile(node.output)
        now, nxt = self._maxima(bk, node)
        rows, cols = acc.shape[-2:] if len(acc.shape) >= 2 else (1, acc.shape[-1])
        product = mma.zeroed()
        multiply(product)

        def element(batch, row, col):
            return fn.b.add(fn.b.mul(fn.b.add(fn.b.mul(batch, i32(rows)), row), i32(cols)), col)   # of acc

        def factors(batch, row) -> tuple:
            """The row's weights of the running value and of the product."""
            return self._weights(bk, node, now, element(batch, row, i32(0)), acc.shape)

        def fold(var, x, batch, row, col, weights=None) -> None:
            old, new = weights or self._weights(bk, node, now, element(batch, row, col), acc.shape)
            var.set(weighted_sum(fn, var.get(), old, x, new))

        one_a_row = node.inputs[1].shape[-1:] == (1,)   # m's maximum (online softmax's): once a row
        mma.each(running, product, fold, per_row=factors if one_a_row else None)
        self._update_maximum(bk, node, now, nxt)

    def update(self, bk, node: Node) -> None:
        fn, acc, x = bk.fn, bk.tile(node.output), bk.tile(node.inputs[0])
        now, nxt = self._maxima(bk, node)

        def element(i) -> None:
            value = fn.load_float(x, fn.offset(i, acc.shape, x))
            self._fold_rescaled(bk, node, now, acc, fn.offset(i, acc.shape, acc), i, acc.shape, value)

        bk.threads.for_each(fn, math.prod(acc.shape), element)
        self._update_maximum(bk, node, now, nxt)


class AccumulateRowsRescaled(_Rescaling):
    def update(self, bk, node: Node) -> None:
        fn, acc, x = bk.fn, bk.tile(node.output), bk.tile(node.inputs[0])
        now, nxt = self._maxima(bk, node)
        last = len(x.shape) - 1

        def finish(read, v) -> None:
            with fn.when(_first_lane(fn, read.in_range, read.lane)):
                self._fold_rescaled(bk, node, now, acc, fn.offset(read.o, acc.shape, acc), read.o, acc.shape, v)

        emit_row_reduce(fn, bk.threads, x, last, SUM, _block_rows(bk, x, last), finish)
        self._update_maximum(bk, node, now, nxt)


# ---------------------------------------------------------------------------------------------
# registration

for _name, _rule in {
    **_ELEMENTWISE,
    "matmul": Matmul(),
    "sum": Reduction(SUM),
    "mean": Reduction(SUM, mean=True),
    "max": Reduction(MAX),
    "rms_norm": RmsNorm(),
    "concat": Concat(),
    "split": Split(),
    "reshape": Reshape(),
    "transpose": Transpose(),
    "custom": Custom(),
    "fused": Fused(),
    "accum": Accumulate(0.0, lambda fn, acc, x: fn.b.fadd(acc, x)),
    "accum_max": Accumulate(float("-inf"), lambda fn, acc, x: fn.call_math("maxnum", acc, x)),
    "accum_sum": AccumulateRows(SUM),
    "accum_mean": AccumulateRows(SUM, _row_finalize(_mean)),
    "accum_rms": AccumulateRows(SUM_OF_SQUARES, _row_finalize(_rms)),
    "accum_rescale": AccumulateRescaled(),
    "accum_sum_rescale": AccumulateRowsRescaled(),
}.items():
    PTX_RULES.register(_name, _rule)

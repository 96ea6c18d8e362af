"""The CUDA rule of every operator (`rule_table.CudaRule`), registered in `CUDA_RULES`: what each method
writes is said there. All arithmetic is f32; values are rounded to their dtype where they are stored.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import attrs

from mdsl.backend.cuda.block import emit_custom
from mdsl.backend.cuda.loops import (MAX, SUM, SUM_OF_SQUARES, Fold, Threads, emit_row_map, emit_row_reduce,
                                     emit_thread_graph, load_float, row_view, store_float)
from mdsl.backend.cuda.mma import mma_class, mma_multiply, mma_store
from mdsl.backend.cuda.rule_table import CUDA_RULES, CudaRule
from mdsl.backend.cuda.source import Operand, element_ctype, float_literal, offset
from mdsl.errors import UnsupportedError
from mdsl.ir.graph import Node
from mdsl.lowering.grid import (KERNEL_THREADS, RowLoop, alone, block_lanes, kernel_grid, kernel_row_loop,
                                reduced_dim, row_kernel_grid, without)
from mdsl.lowering.mma import kernel_mma_dtype
from mdsl.lowering.views import is_view

GEMM_TILE = 64        # the output tile of mdsl::gemm_tile (prelude)
ROWS_GEMM_MAX_M = 64  # the most rows mdsl::gemm_rows_mma takes a kernel-level matmul with (past them, the tile)
ROWS_GEMM_COLUMNS = 16   # the columns of C a block of mdsl::gemm_rows_mma computes


def _grid_threads() -> Threads:
    return Threads(KERNEL_THREADS, grid=True)


# ---------------------------------------------------------------------------------------------
# element-wise operators


@attrs.frozen
class Elementwise(CudaRule):
    expr: Callable  # (node, operand registers) -> C expression

    def block(self, b, node: Node) -> None:
        tg = alone(node)
        emit_thread_graph(b.w, b.threads, b.namer, tg, [b.tile(v) for v in tg.inputs],
                          [b.tile(v) for v in node.outputs])

    def kernel(self, program, index: int, node: Node) -> None:
        tg = alone(node)
        with program.kernel(index, node, grid=kernel_grid(node.output.type.numel), threads=KERNEL_THREADS) as k:
            emit_thread_graph(k.w, _grid_threads(), k.namer, tg, [k.inputs[node.inputs.index(v)] for v in tg.inputs],
                              k.outputs)


def _unary(template: str) -> Elementwise:
    return Elementwise(lambda node, a: template.format(x=a[0]))


def _with_attrs(template: str, *names: str) -> Elementwise:
    return Elementwise(lambda node, a: template.format(x=a[0], **{n: float_literal(node.attr(n)) for n in names}))


def _binary(symbol: str) -> Elementwise:
    return Elementwise(lambda node, a: f"{a[0]} {symbol} {a[1]}")


def _cast(node: Node, a: list) -> str:
    # a float value is rounded where it is stored; an integer one is truncated now
    return a[0] if node.attr("dtype").is_float else f"truncf({a[0]})"


_ELEMENTWISE = {
    "exp": _unary("expf({x})"),
    "silu": _unary("{x} / (1.0f + expf(-{x}))"),
    "gelu": _unary("0.5f * {x} * (1.0f + erff({x} * 0.70710678118654752f))"),
    "relu": _unary("fmaxf({x}, 0.0f)"),
    "sigmoid": _unary("1.0f / (1.0f + expf(-{x}))"),
    "sqrt": _unary("sqrtf({x})"),
    "rsqrt": _unary("rsqrtf({x})"),
    "square": _unary("{x} * {x}"),
    "neg": _unary("-{x}"),
    "reciprocal": _unary("1.0f / {x}"),
    "mul_scalar": _with_attrs("{x} * {value}", "value"),
    "add_scalar": _with_attrs("{x} + {value}", "value"),
    "pow_scalar": _with_attrs("powf({x}, {exponent})", "exponent"),
    "clamp": _with_attrs("fminf(fmaxf({x}, {min}), {max})", "min", "max"),
    "cast": Elementwise(_cast),
    "add": _binary("+"),
    "sub": _binary("-"),
    "mul": _binary("*"),
    "div": _binary("/"),
}


class Fused(CudaRule):
    """A block-level thread graph: the whole chain per element, in registers."""

    def block(self, b, node: Node) -> None:
        emit_thread_graph(b.w, b.threads, b.namer, node.body, [b.tile(v) for v in node.inputs],
                          [b.tile(v) for v in node.outputs])


# ---------------------------------------------------------------------------------------------
# matmul


class Matmul(CudaRule):
    def block(self, b, node: Node) -> None:
        """On tensor cores where the operands allow (`mdsl.lowering.mma`), else one thread per
        output element, its dot product over K read from the two tiles. A matmul whose sum the loop
        keeps in registers (`b.register_accumulated`) adds into its accumulator's fragments instead."""
        a, w, out = b.tile(node.inputs[0]), b.tile(node.inputs[1]), b.tile(node.output)
        shape = b.mma_shape(node)
        if shape is not None:
            entry = b.register_accumulators.get(node.output.name)
            if entry is not None:
                acc, running = entry
                # the accumulator's rule folds this iteration's product into its running fragments
                CUDA_RULES[acc.op].fold_product(b, acc, shape, running,
                                                     lambda frags: mma_multiply(shape, frags, a, w, out.shape[:-2]))
                return
            with b.w.block(""):
                b.w(f"{mma_class(shape)}::Fragments acc;", f"{mma_class(shape)}::zero(acc);",
                    mma_multiply(shape, "acc", a, w, out.shape[:-2]), mma_store(shape, "acc", out))
            return
        self._scalar(b, a, w, out)

    def _scalar(self, b, a: Operand, w: Operand, out: Operand) -> None:
        k_len, n = a.shape[-1], out.shape[-1]
        rows = a.viewed(a.shape[:-1] + (1,), a.strides)           # row m of a, the same for every n
        cols = w.viewed(w.shape[:-2] + (1, n), w.strides)          # column n of w, the same for every m
        with b.threads.each(b.w, math.prod(out.shape)):
            b.w(f"const {a.ctype}* const a = {a.ptr} + ({offset('i', out.shape, rows)});",
                f"const {w.ctype}* const b = {w.ptr} + ({offset('i', out.shape, cols)});",
                "float acc = 0.0f;")
            b.w(f"for (int k = 0; k < {k_len}; ++k) "
                f"acc = fmaf(mdsl::to_float(a[k]), mdsl::to_float(b[k * {w.strides[-2]}]), acc);")
            b.w(store_float(out, offset("i", out.shape, out), "acc"))

    def kernel(self, program, index: int, node: Node) -> None:
        """A GEMM_TILE x GEMM_TILE tile of the product per block (`mdsl::gemm_tile`), or on tensor cores for at
        most ROWS_GEMM_MAX_M rows ROWS_GEMM_COLUMNS columns of it (`mdsl::gemm_rows_mma`), a batch per grid z."""
        (m, k_len), n = node.inputs[0].shape[-2:], node.output.shape[-1]
        batch = node.output.shape[:-2]
        batches = math.prod(batch)
        if batches > 65535:
            raise UnsupportedError(f"matmul over {batches} batches: at most 65535 (the grid's z dim)",
                                   hint="reshape the batch dims into the rows of the left operand")
        element = kernel_mma_dtype(node, program.options, program.arch)
        rows = element is not None and m <= ROWS_GEMM_MAX_M
        grid = (-(-n // ROWS_GEMM_COLUMNS), 1, batches) if rows else (-(-n // GEMM_TILE), -(-m // GEMM_TILE), batches)
        with program.kernel(index, node, grid=grid, threads=KERNEL_THREADS) as k:
            a, w, out = k.inputs[0], k.inputs[1], k.outputs[0]
            ptrs = []
            for op in (a, w, out):
                batch_view = op.viewed(op.shape[:-2], op.strides[:-2])
                start = offset("batch", batch, batch_view) if batch else "0"
                ptrs.append(op.ptr if start == "0" else f"{op.ptr} + {start}")
            if batch:
                k.w("const int batch = blockIdx.z;")
            if rows:   # few rows: the product streams B over many blocks
                k.w(f"mdsl::gemm_rows_mma<{element_ctype(element)}, {m}, {n}, {k_len}>({', '.join(ptrs)});")
            elif element is not None:   # tensor cores (MDSL_CUDA_MMA=0: the scalar tile below)
                k.w(f"mdsl::gemm_tile_mma<{element_ctype(element)}, {m}, {n}, {k_len}>({', '.join(ptrs)});")
            else:
                k.w(f"mdsl::gemm_tile<{m}, {n}, {k_len}>({', '.join(ptrs)});")


# ---------------------------------------------------------------------------------------------
# reductions and norms over one dim


def _block_rows(b, src: Operand, dim: int) -> RowLoop:
    """A block-level reduction's rows: a group of lanes each, an element a load."""
    return RowLoop(block_lanes(b.threads.block, src.shape, dim))


def _row_kernel(program, index: int, node: Node, emit: Callable) -> None:
    """A kernel-level reduction or norm: groups of lanes over the rows of the whole tensor, as the lowering
    says (mdsl.lowering.grid.kernel_row_loop)."""
    loop = kernel_row_loop(node)
    with program.kernel(index, node, grid=row_kernel_grid(node), threads=loop.threads()) as k:
        emit(k.w, Threads(loop.threads(), grid=True), node, k.inputs[0], k.outputs[0], loop)


@attrs.frozen
class Reduction(CudaRule):
    fold: Fold
    mean: bool = False

    def _emit(self, w, threads: Threads, node: Node, src: Operand, out: Operand, loop: RowLoop) -> None:
        dim = reduced_dim(node)
        rows = without(src.shape, dim)
        out_rows = row_view(out, dim) if node.attr("keepdim") else out
        value = f"v / {float_literal(src.shape[dim])}" if self.mean else "v"
        finish = store_float(out_rows, offset("o", rows, out_rows), value)
        emit_row_reduce(w, threads, src, dim, self.fold, loop,
                        lambda w: w(f"if (o < {math.prod(rows)} && lane == 0) {finish}"))

    def block(self, b, node: Node) -> None:
        src = b.tile(node.inputs[0])
        self._emit(b.w, b.threads, node, src, b.tile(node.output), _block_rows(b, src, reduced_dim(node)))

    def kernel(self, program, index: int, node: Node) -> None:
        _row_kernel(program, index, node, self._emit)


class RmsNorm(CudaRule):
    """x / sqrt(mean(x^2 over dim) + eps): a group of lanes per row folds the squares, then writes (from the
    registers where the loop keeps the row resident)."""

    def _emit(self, w, threads: Threads, node: Node, src: Operand, out: Operand, loop: RowLoop) -> None:
        dim = reduced_dim(node)
        rows = without(src.shape, dim)
        length = src.shape[dim]

        def finish(w) -> None:
            w(f"const float inv = 1.0f / sqrtf(v / {float_literal(length)} + {float_literal(node.attr('eps'))});")
            with w.block(f"if (o < {math.prod(rows)})"):
                emit_row_map(w, src, out, dim, loop, lambda x: f"{x} * inv")

        emit_row_reduce(w, threads, src, dim, SUM_OF_SQUARES, loop, finish)

    def block(self, b, node: Node) -> None:
        src = b.tile(node.inputs[0])
        self._emit(b.w, b.threads, node, src, b.tile(node.output), _block_rows(b, src, reduced_dim(node)))

    def kernel(self, program, index: int, node: Node) -> None:
        _row_kernel(program, index, node, self._emit)


# ---------------------------------------------------------------------------------------------
# layout operators


def _coordinate(space: tuple, dim: int) -> str:
    """The coordinate along `dim` of element i of a loop over `space`."""
    strides = tuple(1 if d == dim else 0 for d in range(len(space)))
    return offset("i", space, Operand("", "", space, strides))


def _pieces(w, pieces: list, dim: int, write: Callable) -> None:
    """An if-chain on the coordinate c along `dim`: piece k (an Operand) covers c in [start, end)."""
    start = 0
    for k, piece in enumerate(pieces):
        end = start + piece.shape[dim]
        keyword = "if" if k == 0 else "else if" if k < len(pieces) - 1 else "else"
        cond = f" (c < {end})" if keyword != "else" else ""
        w(f"{keyword}{cond} {write(piece, start)}")
        start = end


def _shifted(space: tuple, piece: Operand, dim: int, start: int) -> str:
    """Offset in `piece` of element i of `space`, whose coordinate along `dim` is `start` too far."""
    at = offset("i", space, piece.viewed(space, piece.strides))
    return at if start == 0 else f"{at} - {start * piece.strides[dim]}"


class Concat(CudaRule):
    def _emit(self, w, threads: Threads, node: Node, ins: list, out: Operand) -> None:
        dim = node.attr("dim") % node.output.type.rank
        space = out.shape
        with threads.each(w, math.prod(space)):
            w(f"const int c = {_coordinate(space, dim)};")
            _pieces(w, ins, dim, lambda piece, start: f"{out.at(offset('i', space, out))} = "
                    f"mdsl::convert<{out.ctype}>({piece.at(_shifted(space, piece, dim, start))});")

    def block(self, b, node: Node) -> None:
        self._emit(b.w, b.threads, node, [b.tile(v) for v in node.inputs], b.tile(node.output))

    def kernel(self, program, index: int, node: Node) -> None:
        _copy_kernel(program, index, node)


class Split(CudaRule):
    def kernel(self, program, index: int, node: Node) -> None:
        _copy_kernel(program, index, node)


def _copy_kernel(program, index: int, node: Node) -> None:
    """A kernel-level split's or concat's kernel (`ProgramBuilder.copy_kernel`): a loop of each copy."""
    def copy(k, c) -> None:
        src, dst = k.inputs[c.source], k.outputs[c.target]
        src = Operand(f"({src.ptr} + {c.source_offset})", src.ctype, c.shape, src.strides)
        dst = Operand(f"({dst.ptr} + {c.target_offset})", dst.ctype, c.shape, dst.strides)
        with _grid_threads().each(k.w, math.prod(c.shape)):
            value = f"mdsl::convert<{dst.ctype}>({src.at(offset('i', c.shape, src))})"
            k.w(f"{dst.at(offset('i', c.shape, dst))} = {value};")

    program.copy_kernel(index, node, copy)


class Transpose(CudaRule):
    """On tiles, the elements copied into the result's tile, the operand read through its strides permuted (a
    weight's tile as stored, [n][k], becomes the [k][n] tile a matmul takes); at the kernel level, a kernel
    of that copy, or an alias where only dims of size 1 move."""

    def block(self, b, node: Node) -> None:
        x, out = b.tile(node.inputs[0]), b.tile(node.output)
        permuted = x.viewed(out.shape, tuple(x.strides[p] for p in node.attr("perm")))
        with b.threads.each(b.w, node.output.type.numel):
            b.w(f"{out.at(offset('i', out.shape, out))} = "
                f"mdsl::convert<{out.ctype}>({x.at(offset('i', out.shape, permuted))});")

    def kernel(self, program, index: int, node: Node) -> None:
        if is_view(node):   # (only size-1 dims move: the same row-major elements)
            program.alias(node.output.name, node.inputs[0].name)
            return
        perm = node.attr("perm")
        with program.kernel(index, node, grid=kernel_grid(node.output.type.numel), threads=KERNEL_THREADS) as k:
            x, out = k.inputs[0], k.outputs[0]
            permuted = x.viewed(out.shape, tuple(x.strides[p] for p in perm))
            with _grid_threads().each(k.w, node.output.type.numel):
                k.w(f"{out.at('i')} = {x.at(offset('i', out.shape, permuted))};")


class Reshape(CudaRule):
    """A view of the same row-major elements: no kernel, an alias. On tiles, the elements copied in row-major
    order into the result's tile (a tile's rows may be padded, so a regrouped tile is not a view of it)."""

    def block(self, b, node: Node) -> None:
        x, out = b.tile(node.inputs[0]), b.tile(node.output)
        with b.threads.each(b.w, node.output.type.numel):
            b.w(f"{out.at(offset('i', out.shape, out))} = "
                f"mdsl::convert<{out.ctype}>({x.at(offset('i', x.shape, x))});")

    def kernel(self, program, index: int, node: Node) -> None:
        program.alias(node.output.name, node.inputs[0].name)


class Custom(CudaRule):
    def kernel(self, program, index: int, node: Node) -> None:
        emit_custom(program, index, node)


# ---------------------------------------------------------------------------------------------
# accumulators: the running value lives in an f32 tile for the whole loop


def _fill(b, tile: Operand, value: str) -> None:
    with b.threads.each(b.w, math.prod(tile.shape)):
        b.w(f"{tile.at(offset('i', tile.shape, tile))} = {value};")


@attrs.frozen
class Accumulate(CudaRule):
    """Element-wise: the running value and the tile have one shape."""

    identity: str
    step: str                          # C expression of `acc` (running value) and `x` (this iteration's)
    finalize = None                    # the running value is the result

    def init(self, b, node: Node) -> None:
        _fill(b, b.tile(node.output), self.identity)

    def fold_product(self, b, node: Node, shape, running: str, multiply: Callable) -> None:
        """A sum kept in mma fragments (accum only: `schedule.REGISTER_ACCUMULATORS`): the product
        is accumulated straight into them."""
        b.w(multiply(running))

    def update(self, b, node: Node) -> None:
        acc, x = b.tile(node.output), b.tile(node.inputs[0])
        with b.threads.each(b.w, math.prod(acc.shape)):
            at = acc.at(offset("i", acc.shape, acc))
            b.w(f"{at} = {self.step.format(acc=at, x=load_float(x, offset('i', acc.shape, x)))};")


def _row_finalize(template: str) -> Callable:
    """A last step on each running row value `acc`, knowing `count` (elements folded per row)."""

    def finalize(b, node: Node) -> None:
        acc, x = b.tile(node.output), node.inputs[0]
        count = float_literal(b.bg.forloop * x.shape[-1])
        eps = float_literal(node.attr("eps", 0.0))
        with b.threads.each(b.w, math.prod(acc.shape)):
            at = acc.at(offset("i", acc.shape, acc))
            b.w(f"{at} = {template.format(acc=at, count=count, eps=eps)};")

    return finalize


@attrs.frozen
class AccumulateRows(CudaRule):
    """Over the iterations and the tile's last dim: a group of lanes folds each row of the tile."""

    fold: Fold
    finalize: Optional[Callable] = None

    def init(self, b, node: Node) -> None:
        _fill(b, b.tile(node.output), self.fold.identity)

    def update(self, b, node: Node) -> None:
        acc, x = b.tile(node.output), b.tile(node.inputs[0])
        last = len(x.shape) - 1
        at = acc.at(offset("o", acc.shape, acc))  # the running value's shape is the rows' with a last dim of 1
        emit_row_reduce(b.w, b.threads, x, last, self.fold, _block_rows(b, x, last),
                        lambda w: w(f"if (o < {math.prod(acc.shape)} && lane == 0) {at} += v;"))


class _Rescaling(CudaRule):
    """Online softmax's accumulators, inputs (x, m): the running value is kept relative to M, the
    running maximum of m (per element of m's shape). Each iteration, with M' = max(M, m):
    acc <- acc * exp(M - M') + x * exp(m - M'). That equals the definition, sum_i exp(m_i - max m) x_i,
    once the loop is over. M is double-buffered in the scratch tile (iteration `it` reads buffer
    it % 2, writes the other), so updating it needs no barrier of its own."""

    finalize = None

    def init(self, b, node: Node) -> None:
        _fill(b, b.tile(node.output), "0.0f")
        m = node.inputs[1]
        with b.threads.each(b.w, m.type.numel):
            b.w(f"{b.scratch(node).at('i')} = mdsl::neg_inf();")  # buffer 0: iteration 0's M

    def _maxima(self, b, node: Node) -> tuple:
        """Pointers to this iteration's M and the next one's, as Operands of m's shape."""
        m = node.inputs[1].type
        scratch = b.scratch(node)
        now, nxt = b.namer(f"{scratch.ptr}_now"), b.namer(f"{scratch.ptr}_next")
        it = b.loop_counter
        b.w(f"const float* const {now} = {scratch.ptr} + ({it} & 1) * {m.numel};",
            f"float* const {nxt} = {scratch.ptr} + (({it} + 1) & 1) * {m.numel};")
        return Operand.contiguous(now, "float", m.shape), Operand.contiguous(nxt, "float", m.shape)

    def _update_maximum(self, b, node: Node, now: Operand, nxt: Operand) -> None:
        m = b.tile(node.inputs[1])
        with b.threads.each(b.w, math.prod(m.shape)):
            b.w(f"{nxt.at('i')} = fmaxf({now.at('i')}, {load_float(m, offset('i', m.shape, m))});")

    def _rescaled(self, b, node: Node, now: Operand, at: str, index: str, shape: tuple, value: str) -> list:
        """Lines that fold `value` into the running value `at`, whose element of m is at `index` of `shape`."""
        m = b.tile(node.inputs[1])
        return [f"const float m = {load_float(m, offset(index, shape, m))};",
                f"const float top = {now.at(offset(index, shape, now))};",
                "const float top_next = fmaxf(top, m);",
                f"{at} = {at} * mdsl::rescale(top, top_next) + {value} * mdsl::rescale(m, top_next);"]


class AccumulateRescaled(_Rescaling):
    def fold_product(self, b, node: Node, shape, running: str, multiply: Callable) -> None:
        """The running value kept in mma fragments: this iteration's product into fresh fragments,
        each element then folded into its running one as `update` does on the tile."""
        acc = b.tile(node.output)
        now, nxt = self._maxima(b, node)
        rows, cols = acc.shape[-2:] if len(acc.shape) >= 2 else (1, acc.shape[-1])
        with b.w.block(""):
            cls = mma_class(shape)
            b.w(f"{cls}::Fragments product;", f"{cls}::zero(product);", multiply("product"))
            with b.w.block(f"{cls}::each({running}, product, [&](float& acc, float x, int batch, int row, int col)"):
                b.w(f"const int flat = (batch * {rows} + row) * {cols} + col;  // element of {list(acc.shape)}")
                b.w(*self._rescaled(b, node, now, "acc", "flat", acc.shape, "x"))
            b.w(");")
        self._update_maximum(b, node, now, nxt)

    def update(self, b, node: Node) -> None:
        acc, x = b.tile(node.output), b.tile(node.inputs[0])
        now, nxt = self._maxima(b, node)
        with b.threads.each(b.w, math.prod(acc.shape)):
            b.w(*self._rescaled(b, node, now, acc.at(offset("i", acc.shape, acc)), "i", acc.shape,
                                load_float(x, offset("i", acc.shape, x))))
        self._update_maximum(b, node, now, nxt)


class AccumulateRowsRescaled(_Rescaling):
    def update(self, b, node: Node) -> None:
        acc, x = b.tile(node.output), b.tile(node.inputs[0])
        now, nxt = self._maxima(b, node)
        last = len(x.shape) - 1
        at = acc.at(offset("o", acc.shape, acc))  # the running value's shape is the rows' with a last dim of 1

        def finish(w) -> None:
            with w.block(f"if (o < {math.prod(acc.shape)} && lane == 0)"):
                w(*self._rescaled(b, node, now, at, "o", acc.shape, "v"))

        emit_row_reduce(b.w, b.threads, x, last, SUM, _block_rows(b, x, last), finish)
        self._update_maximum(b, node, now, nxt)


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
    "accum": Accumulate("0.0f", "{acc} + {x}"),
    "accum_max": Accumulate("mdsl::neg_inf()", "fmaxf({acc}, {x})"),
    "accum_sum": AccumulateRows(SUM),
    "accum_mean": AccumulateRows(SUM, _row_finalize("{acc} / {count}")),
    "accum_rms": AccumulateRows(SUM_OF_SQUARES, _row_finalize("sqrtf({acc} / {count} + {eps})")),
    "accum_rescale": AccumulateRescaled(),
    "accum_sum_rescale": AccumulateRowsRescaled(),
}.items():
    CUDA_RULES.register(_name, _rule)

"""The generated coverage set of the CUDA backend: kernel graphs that together use every operator at
every level it may appear at (kernel, block, thread), every accumulator kind, and grids, imaps,
fmaps and omaps of many kinds (1 to 3 grid dims, an fmap on an imap'd dim, replicated inputs,
multiple outputs, fused nodes, chained custom kernels), in f16, bf16 and f32.

`coverage_graphs()` returns them by name; `used_ops(graph)` says which (level, op) pairs a graph uses.
"""
from __future__ import annotations

import functools

from mdsl.ir import bf16, f16, f32, i32
from mdsl.ir.ops import BLOCK, KERNEL, OPS, THREAD
from tests.backend.cuda.builder import Graph

DTYPES = (f16, bf16, f32)
UNARY = tuple(name for name, op in OPS.items() if op.is_unary)
BINARY = tuple(name for name, op in OPS.items() if op.is_binary)
WITH_ATTRS = (("mul_scalar", {"value": 0.5}), ("add_scalar", {"value": -1.25}), ("pow_scalar", {"exponent": 3.0}),
              ("clamp", {"min": -0.5, "max": float("inf")}), ("cast", {"dtype": f32}), ("cast", {"dtype": f16}),
              ("cast", {"dtype": bf16}))


def _unaries():
    return [(op, {}) for op in UNARY] + list(WITH_ATTRS)


def elementwise(dtype, every_op: bool) -> Graph:
    """Each element-wise op alone (`every_op`; on a tile [8, 64] of x, looped over its columns),
    binary ops against broadcast operands of lower rank and of size-1 dims, and a fused chain of
    every op."""
    g = Graph(f"elementwise_{dtype.name}")
    x, y, z = g.input("x", (32, 128), dtype), g.input("y", (32, 1), dtype), g.input("z", (128,), dtype)
    if every_op:
        b = g.block(grid=(4,), forloop=2)
        xt = b.input(x, imap=(0,), fmap=1)
        for op, attrs in _unaries():
            b.output(b.op("accum", b.op(op, xt, **attrs)), omap=(0,))
        b.done()
    b = g.block(grid=(4,), forloop=2, threads=64)
    xt, yt, zt = b.input(x, imap=(0,), fmap=1), b.input(y, imap=(0,)), b.input(z, fmap=0)
    for op in BINARY:
        b.output(b.op("accum", b.op(op, xt, yt)), omap=(0,))
        b.output(b.op("accum", b.op(op, zt, xt)), omap=(0,))
    b.done()

    def chain(t, p, q):
        v = p
        for op, attrs in _unaries():
            v = t.op(op, v, **attrs) if op != "cast" else t.op("cast", v, dtype=dtype)
        for op in BINARY:
            v = t.op(op, v, q)
        return [v, q]  # a pass-through output of a broadcast shape

    b = g.block(grid=(2,), forloop=2, threads=256)
    xt, yt = b.input(x, imap=(0,), fmap=1), b.input(y, imap=(0,))
    (v, w) = b.fused([xt, yt], chain)
    b.output(b.op("accum", v), omap=(0,))
    b.output(b.op("accum_max", w), omap=(0,))
    b.done()
    return g


def reductions(dtype, every_op: bool) -> Graph:
    """Block-level reductions over every dim, keepdim or not (`every_op`; else one), rms_norm and
    concat over every dim, a tile regrouped and back and one transposed (`every_op`), matmul (2-D, batched,
    broadcast batch, a weight tile transposed), a rank-0 tile and an i32 tile."""
    g = Graph(f"reductions_{dtype.name}")
    x = g.input("x", (4, 16, 64), dtype)
    w = g.input("w", (64, 32), dtype)
    b = g.block(grid=(2,), threads=32)
    xt = b.input(x, imap=(0,))                               # [2, 16, 64]
    for op in ("sum", "mean", "max") if every_op else ("mean",):
        for dim in (0, 1, -1) if every_op else (1,):
            for keepdim in (False, True):
                b.output(b.op("accum", b.op(op, xt, dim=dim, keepdim=keepdim)), omap=(0,))
    b.done()
    b = g.block(grid=(4,))
    xt = b.input(x, imap=(0,))
    for dim in (0, 1, 2):
        b.output(b.op("accum", b.op("rms_norm", xt, dim=dim, eps=1e-5)), omap=(0,))
        b.output(b.op("accum", b.op("concat", xt, b.op("neg", xt), xt, dim=dim)), omap=(0,))
    if every_op:   # a tile regrouped into groups of 16, normalised per group and regrouped back
        groups = b.op("reshape", b.op("accum", xt), shape=(1, 16, 4, 16))
        b.output(b.op("reshape", b.op("rms_norm", groups, dim=3, eps=1e-5), shape=(1, 16, 64)), omap=(0,))
        b.output(b.op("transpose", b.op("accum", b.op("exp", xt)), perm=(2, 0, 1)), omap=(1,))   # [64, 4, 16]
    b.done()
    b = g.block(grid=(2,), forloop=2)
    a3, b2 = b.input(x, imap=(0,), fmap=2), b.input(w, fmap=0)
    b.output(b.op("accum", b.op("matmul", a3, b2)), omap=(0,))  # [2, 16, 32]: a batch against a matrix
    b.output(b.op("accum", b.op("matmul", b.op("sum", a3, dim=0, keepdim=True), b2)), omap=(1,))  # [1,16,32]
    b.done()
    b = g.block(grid=(2,), forloop=2)   # a weight stored [out, in] (its tiles along K as stored), transposed
    a3, stored = b.input(x, imap=(0,), fmap=2), b.input(g.input("w_t", (32, 64), dtype), fmap=1)
    b.output(b.op("accum", b.op("matmul", a3, b.op("transpose", stored, perm=(1, 0)))), omap=(0,))
    b.done()
    b = g.block(grid=(1,))
    flat = b.input(g.input("v", (64,), dtype))
    total = b.op("sum", flat, dim=0)                        # a rank-0 tile
    as_int = b.op("cast", b.op("mul_scalar", flat, value=8.0), dtype=i32)
    both = b.op("concat", as_int, as_int, dim=0)            # an i32 tile, stored
    b.output(b.op("accum", total))
    b.output(b.op("accum", b.op("cast", both, dtype=dtype)))
    b.done()
    return g


def accumulators(dtype) -> Graph:
    """Every accumulator kind, with ops after the loop and several outputs, and online softmax."""
    g = Graph(f"accumulators_{dtype.name}")
    x = g.input("x", (64, 256), dtype)
    v = g.input("v", (256, 32), dtype)
    b = g.block(grid=(4,), forloop=4)
    xt = b.input(x, imap=(0,), fmap=1)                      # [16, 64]
    total = b.op("accum", xt)
    rows = b.op("accum_sum", xt)
    mean = b.op("accum_mean", xt)
    rms = b.op("accum_rms", xt, eps=1e-5)
    top = b.op("accum_max", xt)
    b.output(b.op("div", b.op("add", rows, mean), rms), omap=(0,))
    b.output(b.op("mul", total, top), omap=(0,))
    b.output(rms, omap=(0,))
    b.done()
    b = g.block(grid=(4,), forloop=4, threads=256)
    xt, vt = b.input(x, imap=(0,), fmap=1), b.input(v, fmap=0)
    m = b.op("max", xt, dim=1, keepdim=True)
    e = b.op("exp", b.op("sub", xt, m))
    num = b.op("accum_rescale", b.op("matmul", e, vt), m)
    den = b.op("accum_sum_rescale", e, m)
    b.output(b.op("div", num, den), omap=(0,))
    b.output(b.op("accum_rescale", xt, m), omap=(0,))    # x itself rescaled
    b.done()
    return g


def maps() -> Graph:
    """Grids of 1 to 3 dims on x, y or z, fmaps on imap'd dims, replicated inputs, permuted omaps,
    thread counts from 32 to 1024, and two custom kernels chained through a kernel-level op."""
    g = Graph("maps")
    x = g.input("x", (2, 4, 8, 64), f16)
    y = g.input("y", (16, 256), f32)
    w = g.input("w", (256, 64), f16)
    b = g.block(grid=(2, 4, 8), forloop=2, threads=32)      # three grid dims, a loop over the last dim
    b.output(b.op("accum_sum", b.input(x, imap=(0, 1, 2), fmap=3)), omap=(0, 1, 2))
    b.done()
    b = g.block(grid=(4,), forloop=4, threads=1024)          # fmap on the imap'd dim
    b.output(b.op("accum_sum", b.input(y, imap=(1,), fmap=1)), omap=(1,))
    b.done()
    b = g.block(grid=(1, 4, 2), forloop=2)                   # y and z only; w replicated along z
    yt, wt = b.input(y, imap=(None, 0, None), fmap=1), b.input(w, imap=(None, None, 1), fmap=0)
    b.output(b.op("accum", b.op("matmul", b.op("cast", yt, dtype=f16), wt)), omap=(None, 0, 1))
    b.done()
    b = g.block(grid=(2, 4))                                 # permuted omap, two outputs
    xt = b.input(x, imap=(3, 1))
    (first, second) = b.op("accum", xt), b.op("accum_max", b.op("relu", xt))
    b.output(first, omap=(3, 1))
    b.output(second, omap=(1, 3))
    (o1, o2) = b.done()
    mid = g.op("add", o1, o1)                                 # a kernel-level op between custom kernels
    b = g.block(grid=(8,), forloop=4)
    b.output(b.op("accum_mean", b.input(mid, imap=(2,), fmap=3)), omap=(2,))
    b.done()
    return g


def kernel_ops(dtype, every_op: bool) -> Graph:
    """Kernel-level ops in standard kernels, on shapes that are not multiples of the tiles: every op
    (`every_op`), else one of each kind."""
    g = Graph(f"kernel_ops_{dtype.name}")
    x, row, col = g.input("x", (8, 96), dtype), g.input("row", (96,), dtype), g.input("col", (8, 1), dtype)
    for op, attrs in _unaries() if every_op else [("gelu", {}), ("cast", {"dtype": f32})]:
        g.op(op, x, **attrs)
    for op in BINARY if every_op else ("div",):
        g.op(op, x, row)
        g.op(op, col, x)
    as_int = g.op("cast", x, dtype=i32)
    g.op("cast", g.op("transpose", as_int, perm=(1, 0)), dtype=dtype)
    a = g.input("a", (3, 40, 96), dtype)
    g.op("matmul", a, g.input("b", (96, 72), dtype))            # batch broadcast, ragged tiles
    g.op("matmul", g.input("c", (2, 1, 8, 16), dtype), g.input("d", (3, 16, 8), dtype))
    for op in ("sum", "mean", "max") if every_op else ("mean",):
        for dim in (0, 1, 2):
            g.op(op, a, dim=dim, keepdim=dim == 1)
    for dim in (0, 1, 2):
        g.op("rms_norm", a, dim=dim, eps=1e-6)
    g.op("concat", a, a, g.op("neg", a), dim=1)
    g.ops("split", a, sizes=(10, 30), dim=1)
    g.ops("split", as_int, sizes=(32, 64), dim=1)
    view = g.op("reshape", g.op("reshape", a, shape=(120, 96)), shape=(96, 120))  # a view of a view
    g.op("transpose", a, perm=(2, 0, 1))
    g.op("sum", view, dim=0)
    return g


@functools.cache
def coverage_graphs() -> dict:
    # every op in f16; in bf16 and f32, which differ only where values are loaded and stored, fewer
    graphs = [elementwise(d, d is f16) for d in DTYPES] + [reductions(d, d is f16) for d in DTYPES] + \
             [accumulators(d) for d in DTYPES] + [maps()] + [kernel_ops(d, d is f16) for d in DTYPES]
    return {g.graph_name: g.build() for g in graphs}


def used_ops(graph) -> set:
    """(level, op) for every node of the graph, bodies included."""
    out = set()

    def walk(nodes, level):
        for n in nodes:
            out.add((level, n.op))
            if n.body is not None:
                walk(n.body.nodes, BLOCK if n.op == "custom" else THREAD)

    walk(graph.nodes, KERNEL)
    return out

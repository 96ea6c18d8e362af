"""Programs that take the CUDA backend's fast paths at their edges, and the option sets that switch
those paths: block matmuls on tensor cores with ragged M / N / K (guarded fragments), batched and
broadcast tiles, f32-stored operands, sums kept in registers across the loop next to sums that are
not, and per-iteration inputs too narrow for cp.async (synchronous loads)."""
from __future__ import annotations

import functools

from mdsl.ir.dtypes import bf16, f16
from mdsl.lowering.options import CudaOptions
from tests.backend.cuda.builder import Graph

#: name -> options: the default fast paths and each of them switched off (or set otherwise)
OPTION_SETS = {
    "default": CudaOptions(),
    "no-mma": CudaOptions(mma=False),
    "no-register-accumulators": CudaOptions(register_accumulators=False),
    "synchronous-loads": CudaOptions(stages=1),
    "pipeline-2": CudaOptions(stages=2),
    "pipeline-4": CudaOptions(stages=4),
    "threads-64": CudaOptions(threads=64),
    "rolled-loops": CudaOptions(unroll=1),
    "no-rows": CudaOptions(rows=False),
}

#: every switch of the lowerings, one at a time: the sets above and the two that only split plans' kernels
#: take (hoisting and streamed combines)
EVERY_OPTION_SET = {**OPTION_SETS, "no-hoist": CudaOptions(hoist=False), "no-stream": CudaOptions(stream=False)}

#: the option sets that each switch one fast path off (what a GPU run falls back to)
FALLBACKS = ("no-mma", "no-register-accumulators", "synchronous-loads", "rolled-loops", "no-rows")


def options_env(options: CudaOptions) -> dict:
    """The environment variables that select `options` (for code that reads them: emit_cuda)."""
    env = {"MDSL_CUDA_MMA": str(int(options.mma)), "MDSL_CUDA_REGACC": str(int(options.register_accumulators)),
           "MDSL_CUDA_STAGES": str(options.stages), "MDSL_CUDA_UNROLL": str(options.unroll),
           "MDSL_CUDA_ROWS": str(int(options.rows)), "MDSL_CUDA_HOIST": str(int(options.hoist)),
           "MDSL_CUDA_STREAM": str(int(options.stream))}
    if options.threads is not None:
        env["MDSL_CUDA_THREADS"] = str(options.threads)
    return env


def ragged_matmuls(dtype) -> Graph:
    """M = 3, N = 20, K = 40 per tile (none a multiple of the mma's 16 x 8 x 16), summed over a loop of
    4 in registers, plus an epilogue; and a product of an f32-stored tile (silu) read again after it."""
    g = Graph(f"ragged_matmuls_{dtype.name}")
    x, w = g.input("x", (6, 160), dtype), g.input("w", (160, 40), dtype)
    b = g.block(grid=(2, 2), forloop=4, threads=128)
    xt, wt = b.input(x, imap=(0,), fmap=1), b.input(w, imap=(None, 1), fmap=0)   # [3, 40], [40, 20]
    acc = b.op("accum", b.op("matmul", xt, wt))
    b.output(b.op("silu", acc), omap=(0, 1))
    b.done()
    b = g.block(grid=(2,), forloop=2, threads=64)
    xt, wt = b.input(x, fmap=1), b.input(w, imap=(1,), fmap=0)  # [6, 80], [80, 20] ...
    product = b.op("matmul", b.op("silu", xt), wt)   # ... a computed (f32-stored) operand; the product read twice
    b.output(b.op("accum", b.op("add", product, product)), omap=(1,))
    b.done()
    return g


def batched_matmuls(dtype) -> Graph:
    """Batched tiles against a batch and against one matrix (broadcast), and a loop of 1."""
    g = Graph(f"batched_matmuls_{dtype.name}")
    a, w, m = g.input("a", (4, 24, 48), dtype), g.input("w", (4, 48, 16), dtype), g.input("m", (48, 24), dtype)
    b = g.block(grid=(2,), forloop=3, threads=96)
    at, wt = b.input(a, imap=(0,), fmap=2), b.input(w, imap=(0,), fmap=1)       # [2, 24, 16], [2, 16, 16]
    b.output(b.op("accum", b.op("matmul", at, wt)), omap=(0,))
    b.output(b.op("accum", b.op("matmul", at, b.input(m, fmap=0))), omap=(0,))  # [2, 24, 16] @ [16, 24]
    b.done()
    b = g.block(grid=(4,), threads=32)
    at, wt = b.input(a, imap=(0,)), b.input(w, imap=(0,))
    b.output(b.op("accum", b.op("matmul", at, wt)), omap=(0,))
    b.done()
    return g


def ragged_attention(dtype) -> Graph:
    """Online softmax with the rescaled sum of the product with V in registers, on ragged tiles
    (24 queries, 40 dims, 3 iterations of 32 keys), its scores scaled first."""
    g = Graph(f"ragged_attention_{dtype.name}")
    q, k, v = g.input("q", (48, 40), dtype), g.input("k", (40, 96), dtype), g.input("v", (96, 40), dtype)
    b = g.block(grid=(2,), forloop=3, threads=128)
    qt, kt, vt = b.input(q, imap=(0,)), b.input(k, fmap=1), b.input(v, fmap=0)   # [24, 40], [40, 32], [32, 40]
    s = b.op("mul_scalar", b.op("matmul", qt, kt), value=0.15)
    m = b.op("max", s, dim=1, keepdim=True)
    e = b.op("exp", b.op("sub", s, m))
    num = b.op("accum_rescale", b.op("matmul", e, vt), m)
    den = b.op("accum_sum_rescale", e, m)
    b.output(b.op("div", num, den), omap=(0,))
    b.done()
    return g


def row_attention(dtype) -> Graph:
    """Online softmax whose whole loop body stays in the registers of the warps owning the rows
    (mdsl.lowering.rows): batched tiles of 40 rows (ragged: the last 16-row tile is half padding)
    on 2 warps, 24 keys an iteration (the P.V product's K an odd number of 8-column groups), its
    denominator by accum_sum_rescale, the running maximum an output too."""
    g = Graph(f"row_attention_{dtype.name}")
    q, k, v = g.input("q", (4, 40, 32), dtype), g.input("k", (4, 32, 48), dtype), g.input("v", (4, 48, 32), dtype)
    b = g.block(grid=(2,), forloop=2, threads=128)
    qt, kt, vt = b.input(q, imap=(0,)), b.input(k, imap=(0,), fmap=2), b.input(v, imap=(0,), fmap=1)
    s = b.op("matmul", qt, kt)                                    # [2, 40, 24]
    m = b.op("max", s, dim=2, keepdim=True)
    e = b.op("exp", b.op("sub", s, m))
    num = b.op("accum_rescale", b.op("matmul", e, vt), m)       # [2, 40, 32]
    den = b.op("accum_sum_rescale", e, m)
    b.output(b.op("div", num, den), omap=(0,))
    b.output(b.op("accum_max", m), omap=(0,))
    b.done()
    return g


def flash_decoding(dtype) -> Graph:
    """The benchmark's split-KV attention shape on whole 16-row tiles (ldmatrix operands): 64 query
    rows on 4 warps, 32 keys an iteration, the partial results stored for a combine; the queries
    scaled first (loop-invariant: hoisted before the loop)."""
    g = Graph(f"flash_decoding_{dtype.name}")
    q, k, v = g.input("q", (2, 64, 64), dtype), g.input("k", (2, 64, 256), dtype), g.input("v", (2, 256, 64), dtype)
    b = g.block(grid=(2, 2), forloop=4, threads=128)
    qt = b.op("mul_scalar", b.input(q, imap=(0,)), value=0.5)
    kt, vt = b.input(k, imap=(0, 2), fmap=2), b.input(v, imap=(0, 1), fmap=1)   # [1, 64, 32], [1, 32, 64]
    s = b.op("matmul", qt, kt)
    m = b.op("max", s, dim=2, keepdim=True)
    e = b.op("exp", b.op("sub", s, m))
    b.output(b.op("accum_rescale", b.op("matmul", e, vt), m), omap=(0, 2))
    b.output(b.op("accum_rescale", b.op("sum", e, dim=2, keepdim=True), m), omap=(0, 2))
    b.output(b.op("accum_max", m), omap=(0, 2))
    b.done()
    return g


def split_combine(dtype) -> Graph:
    """A combine of 5 splits (mdsl.lowering.streamed): per-split maxima, rescaled partial sums of
    ragged rows (3 x 24 per block), a plain sum, folded straight from device memory; then an epilogue."""
    g = Graph(f"split_combine_{dtype.name}")
    m, x, y = g.input("m", (6, 5), dtype), g.input("x", (6, 120), dtype), g.input("y", (6, 120), dtype)
    b = g.block(grid=(2,), forloop=5, threads=64)
    mt, xt, yt = b.input(m, imap=(0,), fmap=1), b.input(x, imap=(0,), fmap=1), b.input(y, imap=(0,), fmap=1)
    top = b.op("accum_max", mt)                          # [3, 1]
    num = b.op("accum_rescale", xt, mt)                  # [3, 24]
    b.output(b.op("add", b.op("div", num, b.op("exp", top)), b.op("accum", yt)), omap=(0,))
    b.done()
    return g


def kernel_matmuls(dtype) -> Graph:
    """Kernel-level matmuls past the row kernel's rows (mdsl::gemm_tile_mma): a batch against a matrix,
    rows too ragged for 16-byte copies (N = 70), and a K of many steps (the copy ring wraps) that is no multiple
    of the 32-step."""
    g = Graph(f"kernel_matmuls_{dtype.name}")
    g.op("matmul", g.input("a", (2, 72, 96), dtype), g.input("b", (96, 72), dtype))
    g.op("matmul", g.input("c", (130, 20), dtype), g.input("d", (20, 70), dtype))
    g.op("matmul", g.input("e", (65, 200), dtype), g.input("f", (200, 64), dtype))
    return g


def narrow_rows(dtype) -> Graph:
    """Rows of 7 elements (14 bytes): no 4-byte vector divides them, so the loads stay synchronous."""
    g = Graph(f"narrow_rows_{dtype.name}")
    x, w = g.input("x", (8, 21), dtype), g.input("w", (21, 7), dtype)
    b = g.block(grid=(1,), forloop=3, threads=64)
    b.output(b.op("accum", b.op("matmul", b.input(x, fmap=1), b.input(w, fmap=0))))
    b.done()
    return g


def prologue_matmuls(dtype) -> Graph:
    """Matmuls of 64-row tiles whose X is computed in the loop by an element-wise prologue on its tile
    (the random programs' `neg(x) @ w` and `neg(x * b) @ w`, b one row broadcast): pipelined, the prologue
    a loop of 32 elements a thread over shared memory, its operand stored in f32."""
    g = Graph(f"prologue_matmuls_{dtype.name}")
    x, b, w = g.input("x", (64, 512), dtype), g.input("b", (1, 512), dtype), g.input("w", (512, 128), dtype)
    k = g.block(grid=(2,), forloop=8, threads=128)
    xt, wt = k.input(x, fmap=1), k.input(w, imap=(1,), fmap=0)   # [64, 64], [64, 64]
    k.output(k.op("accum", k.op("matmul", k.op("neg", xt), wt)), omap=(1,))
    k.done()
    k = g.block(grid=(2,), forloop=8, threads=128)
    xt, bt, wt = k.input(x, fmap=1), k.input(b, fmap=1), k.input(w, imap=(1,), fmap=0)
    operand = k.fused([xt, bt], lambda t, p, q: [t.op("neg", t.op("mul", p, q))])[0]
    k.output(k.op("accum", k.op("matmul", operand, wt)), omap=(1,))
    k.done()
    return g


@functools.cache
def fast_path_graphs() -> dict:
    both = [make(dtype) for dtype in (f16, bf16)
            for make in (ragged_matmuls, batched_matmuls, ragged_attention, kernel_matmuls, narrow_rows)]
    one = [row_attention(bf16), flash_decoding(f16), split_combine(f16)]   # each compiled under every option set: one dtype each
    one.append(prologue_matmuls(f16))
    return {graph.name: graph for graph in (g.build() for g in both + one)}

"""The benchmark cases' plans, as the kernel benchmark runs them: the plan cache entries of this checkout
(`.plans/plans/*.json`, filled by `benchmarks/kernels.py --plans-only`; the folder is not tracked by git),
read directly (the suite's plan cache is a temporary directory) and validated as the cache validates an
entry. A checkout without them (a clean clone, CI) takes each case's best guided plan instead: the
fused mugraph a search verifies first, of the same shape as the searched one."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

from mdsl.ir.graph import KernelGraph
from mdsl.lowering.options import CudaOptions
from mdsl.search.plan import Plan

PLANS = Path(__file__).resolve().parents[3] / ".plans" / "plans"


def _benchmarks() -> dict:
    """Case name (the benchmark specification's graph name: gqa_bs1, lora, ...) -> the benchmark's name
    among the examples' kernels (tests/backend/cuda/programs.py)."""
    from tests.backend.cuda.programs import benchmark_names, example_kernels

    return {example_kernels()[name].name: name for name in benchmark_names()}


def case_names() -> list:
    """The benchmark cases, sorted (tests parametrised by them need no plan while they are collected)."""
    return sorted(_benchmarks())


def matmul_case_names() -> list:
    """The benchmark cases whose specification has a matmul."""
    from tests.backend.cuda.programs import matmul_benchmark_names

    return sorted(case for case, name in _benchmarks().items() if name in matmul_benchmark_names())


@functools.cache
def stored_plans() -> dict:
    """Case name -> the kernel graph of the checkout's stored plan ({} in a checkout without them)."""
    out = {}
    for path in sorted(PLANS.glob("*.json")):
        plan = Plan.from_json(json.loads(path.read_text(encoding="utf-8"))["plan"])   # parses and validates
        out[plan.graph.name] = plan.graph
    return out


def plan_graph(case: str) -> KernelGraph:
    """The plan of a benchmark case: the stored one, or in a checkout without stored plans its guided plan
    (searched on first use)."""
    if stored_plans():
        return stored_plans()[case]
    from tests.backend.cuda.programs import guided_plan

    return guided_plan(_benchmarks()[case])


def split_attention(qknorm: bool, heads: int = 1, queries: int = 32, kv_len: int = 256, splits: int = 4,
                    forloop: int = 2, head_dim: int = 64) -> KernelGraph:
    """The searched plans of GQA and QKNorm attention (gqa_bs1, qknorm_bs1: a split-KV attention kernel
    of 32 query rows on 4 warps writing f32 partial results, then their combine), op for op, at sizes
    the CPU simulator runs in seconds: its attention chain is row-resident, QKNorm's rms_norm of Q is
    hoisted before the loop and the combine is streamed, under the default options."""
    from mdsl.ir.dtypes import f16, f32
    from tests.backend.cuda.builder import Graph

    g = Graph(f"{'qknorm' if qknorm else 'gqa'}_split_plan")
    q = g.input("q", (heads, queries, head_dim), f16)
    k = g.input("k", (heads, head_dim, kv_len), f16)
    v = g.input("v", (heads, kv_len, head_dim), f16)
    h, r = (0 if heads > 1 else None), (1 if queries > 32 else None)   # a grid dim of 1 maps nothing
    b = g.block(grid=(heads, queries // 32, splits), forloop=forloop, threads=128)
    qt, kt, vt = b.input(q, imap=(h, r, None)), b.input(k, imap=(h, None, 2), fmap=2), b.input(v, imap=(h, None, 1), fmap=1)
    if qknorm:
        qt, kt = b.op("rms_norm", qt, dim=2, eps=1e-6), b.op("rms_norm", kt, dim=1, eps=1e-6)
    s = b.op("matmul", qt, kt)
    m = b.op("max", s, dim=2, keepdim=True)
    top = b.op("accum_max", m)
    e = b.op("exp", b.op("sub", s, m))
    total = b.op("accum_rescale", b.op("sum", e, dim=2, keepdim=True), m)
    weighted = b.op("accum_rescale", b.op("matmul", e, vt), m)
    for value in (top, total, weighted):
        b.output(b.op("cast", value, dtype=f32), omap=(h, r, 2))
    tops, totals, sums = b.done()
    c = g.block(grid=(heads, queries // 32), forloop=splits, threads=128)
    mt, lt, ot = (c.input(x, imap=(h, r), fmap=2) for x in (tops, totals, sums))
    c.op("accum_max", mt)
    out = c.op("div", c.op("accum_rescale", ot, mt), c.op("accum_rescale", lt, mt))
    c.output(c.op("cast", out, dtype=f16), omap=(h, r))
    c.done()
    return g.build(outputs=[g.nodes[-1].outputs[0]])


def rms_norm_linear_skinny(rows: int, forloop: int, columns: int = 6144, blocks: int = 96, k: int = 4096,
                           dtype=None, transposed: bool = False) -> KernelGraph:
    """RMSNorm + Linear as one kernel of `blocks` blocks, each a slice of the weight's columns over a loop of
    `forloop` K tiles: the tuning variants the autotuner runs the skinny loop on in the
    kernel benchmark (rms_norm_linear_bs1: 2 rows, 96 blocks x 8 iterations; bs8: 16 rows, 96 x 64), op
    for op; smaller shapes for the CPU simulator. `transposed`: the weight stored [columns, k] (a linear
    layer's [out, in]), its tiles transposed in the block."""
    from mdsl.ir.dtypes import f16
    from tests.backend.cuda.builder import Graph

    dtype = dtype or f16
    g = Graph(f"rms_norm_linear_skinny_{rows}x{k}x{columns}_{dtype.name}")
    x, w = g.input("x", (rows, k), dtype), g.input("w", (columns, k) if transposed else (k, columns), dtype)
    b = g.block(grid=(blocks,), forloop=forloop, threads=128)
    xt = b.input(x, imap=(None,), fmap=1)
    if transposed:
        wt = b.op("transpose", b.input(w, imap=(0,), fmap=1), perm=(1, 0))
    else:
        wt = b.input(w, imap=(1,), fmap=0)
    norm = b.op("accum_rms", xt, eps=1e-6)
    b.output(b.op("div", b.op("accum", b.op("matmul", xt, wt)), norm), omap=(1,))
    b.done()
    return g.build()


def gated_mlp_skinny(rows: int = 8, k: int = 4096, columns: int = 4096, blocks: int = 64, splits: int = 2,
                     forloop: int = 32, dtype=None, transposed: bool = False) -> KernelGraph:
    """Gated MLP as the autotuner's tuned variant (64 x 2 blocks x 32 iterations, then 128 blocks
    combining the 2 K splits with silu and the gate's product), op for op: the first kernel is a skinny
    loop of two weights (`transposed`: stored [columns, k])."""
    from mdsl.ir.dtypes import f16, f32
    from tests.backend.cuda.builder import Graph

    dtype = dtype or f16
    g = Graph(f"gated_mlp_skinny_{rows}x{k}x{columns}_{dtype.name}")
    x = g.input("x", (rows, k), dtype)
    stored = (columns, k) if transposed else (k, columns)
    w1, w2 = g.input("w1", stored, dtype), g.input("w2", stored, dtype)
    b = g.block(grid=(blocks, splits), forloop=forloop, threads=128)
    xt = b.input(x, imap=(None, 1), fmap=1)

    def weight(w):
        if transposed:
            return b.op("transpose", b.input(w, imap=(0, 1), fmap=1), perm=(1, 0))
        return b.input(w, imap=(1, 0), fmap=0)

    sums = [b.op("accum", b.op("matmul", xt, weight(w))) for w in (w1, w2)]
    for s in sums:
        b.output(b.op("cast", s, dtype=f32), omap=(1, 0))
    gate, up = b.done()
    combine_blocks = 128
    c = g.block(grid=(combine_blocks,), forloop=splits, threads=128)
    gt, ut = (c.input(v, imap=(1,), fmap=0) for v in (gate, up))
    gate_total, up_total = c.op("accum", gt), c.op("accum", ut)
    out = c.op("mul", c.op("silu", gate_total), up_total)
    c.output(c.op("cast", out, dtype=dtype), omap=(1,))
    c.done()
    return g.build(outputs=[g.nodes[-1].outputs[0]])


#: the autotuner's skinny-loop picks in the kernel benchmark (name -> graph, options), on the CUDA and the
#: PTX backend
def tuned_skinny_plans() -> dict:
    return {"rms_norm_linear_bs1": (rms_norm_linear_skinny(2, 8), CudaOptions(skinny=True)),
            "rms_norm_linear_bs8": (rms_norm_linear_skinny(16, 64), CudaOptions(skinny=True, threads=256)),
            "gated_mlp": (gated_mlp_skinny(), CudaOptions(skinny=True))}


def lora_tuned(rows: int = 16, k: int = 256, columns: int = 4096, rank: int = 16) -> KernelGraph:
    """LoRA as the autotuner's tuned variant (2 x 256 blocks of 8 rows and 16 columns, one iteration),
    op for op: X W and (X A) B on 4 warps that hold 2 mma tiles a matmul (half the warps have none)."""
    from mdsl.ir.dtypes import f16
    from tests.backend.cuda.builder import Graph

    g = Graph(f"lora_tuned_{rows}x{k}x{columns}")
    x, w = g.input("x", (rows, k), f16), g.input("w", (k, columns), f16)
    a, b_ = g.input("a", (k, rank), f16), g.input("b", (rank, columns), f16)
    b = g.block(grid=(rows // 8, columns // 16), forloop=1, threads=128)
    xt, wt = b.input(x, imap=(0, None)), b.input(w, imap=(None, 1))
    at, bt = b.input(a, imap=(None, None)), b.input(b_, imap=(None, 1))
    full = b.op("matmul", xt, wt)
    low = b.op("matmul", b.op("matmul", xt, at), bt)
    b.output(b.op("accum", b.op("add", full, low)), omap=(0, 1))
    b.done()
    return g.build()


def tuned_plans() -> dict:
    """The autotuner's tuned picks the PTX backend is slowest on (name -> graph, options): the skinny
    ones and LoRA's (its default pipeline depth 2, which a loop of one iteration does not use)."""
    return {**tuned_skinny_plans(), "lora": (lora_tuned(), CudaOptions(stages=2))}


def split_k(rows: int = 4, k: int = 512, columns: int = 128, block_columns: int = 32, splits: int = 2,
            forloop: int = 4, threads: int = 128, combine_columns: Optional[int] = None,
            combine_threads: int = 128, scale: bool = False, then_matmul: bool = False) -> KernelGraph:
    """The search's split-K plan of `(x * 2.0) @ w` (times `s`, a scale per column, with `scale`), op for op:
    a kernel of columns / block_columns x splits blocks, each a K slice of `forloop` iterations, writing f32
    partial sums (the splits stacked along the rows: f32[splits * rows, columns]), then the combine of
    columns / combine_columns blocks (default block_columns) summing each block's columns over the splits
    (adding the bias's columns). At x f16[4, 8192], w [8192, 2048], 64 x 2 blocks of 16 iterations and a
    combine of 64 blocks, it is what the search chooses (its first kernel a skinny loop where the lowering
    takes one); smaller shapes for the CPU simulator. `then_matmul`: the combine's output times a new input
    v [columns, 64] after them, a kernel with values of its own."""
    from mdsl.ir.dtypes import f16, f32
    from tests.backend.cuda.builder import Graph

    combine_columns = combine_columns or block_columns
    g = Graph(f"split_k_{rows}x{k}x{columns}")
    x, w = g.input("x", (rows, k), f16), g.input("w", (k, columns), f16)
    b = g.block(grid=(columns // block_columns, splits), forloop=forloop, threads=threads)
    xt, wt = b.input(x, imap=(None, 1), fmap=1), b.input(w, imap=(1, 0), fmap=0)
    total = b.op("accum", b.op("matmul", b.op("mul_scalar", xt, value=2.0), wt))
    b.output(b.op("cast", total, dtype=f32), omap=(1, 0))
    (partials,) = b.done()
    c = g.block(grid=(columns // combine_columns,), forloop=splits, threads=combine_threads)
    split = c.input(partials, imap=(1,), fmap=0)
    if scale:
        split = c.op("mul", split, c.op("cast", c.input(g.input("s", (1, columns), f16), imap=(1,)), dtype=f32))
    c.output(c.op("cast", c.op("accum", split), dtype=f16), omap=(1,))
    (out,) = c.done()
    if not then_matmul:
        return g.build(outputs=[out])
    return g.build(outputs=[out, g.op("matmul", out, g.input("v", (columns, 64), f16))])

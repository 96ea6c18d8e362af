"""The programs the CUDA backend is tested on: every kernel graph of the examples (the benchmark
specifications and the hand-written fused versions), the best guided plan of each benchmark, the
hand-written graphs of tests/strategies.py and the generated coverage set."""
from __future__ import annotations

import functools

from mdsl.ir.graph import KernelGraph
from mdsl.search import guided
from tests.backend.cuda.coverage import coverage_graphs
from tests.examples_util import NAMES
from tests.examples_util import example_kernels as kernels_of
from tests.shared import shared_graph
from tests.strategies import example_graphs


@functools.cache
def example_kernels() -> dict:
    """'<example>.<kernel>' -> the kernel's traced graph, for every kernel every example defines."""
    out = {}
    for stem in NAMES:
        for name, kernel in kernels_of(stem).items():
            out[f"{stem}.{name}"] = kernel.graph
    return out


def benchmark_names() -> list:
    """The benchmark specifications: the example kernels without custom ops."""
    return [name for name, graph in example_kernels().items() if not graph.custom_nodes()]


def matmul_benchmark_names() -> list:
    """The benchmarks whose specification has a matmul: the tests of their plans' matmuls take these
    names without searching the plans first (and fail on a plan without one)."""
    return [name for name in benchmark_names() if any(n.op == "matmul" for n in example_kernels()[name].nodes)]


@functools.cache
def guided_plan(name: str) -> KernelGraph:
    """The best guided plan of a benchmark, searched on first use (the search takes seconds) by one of the
    test run's processes, which share it (tests/shared.py)."""
    return shared_graph(f"guided-plan-{name}", lambda: next(guided.generate(example_kernels()[name])))


def block_graphs() -> dict:
    """'<program>/<node>' -> every custom node's block graph among the examples, the hand-written
    graphs and the coverage set."""
    programs = {**example_kernels(), **example_graphs(), **coverage_graphs()}
    return {f"{name}/{i}": node.body for name, graph in programs.items()
            for i, node in enumerate(graph.nodes) if node.op == "custom"}


#: guided mugraphs ranked for `_guided_with`: more than a search takes (48), past the split plans (one launch
#: since their combine runs in their split's) that rank ahead of the unsplit ones the tests ask for
_RANKED = 96


def _guided_with(name: str, accepts) -> KernelGraph:
    """The first guided mugraph of a benchmark whose first custom node's block graph `accepts`."""
    return next(g for g in guided.generate(example_kernels()[name], limit=_RANKED)
                if accepts(g.custom_nodes()[0].body))


def _columns(n: int):
    return lambda bg: bg.nodes[-1].output.shape[-1] == n and len(bg.inputs) == 2


_RNL8 = "rms_norm_linear.rms_norm_linear_bs8"
#: skinny programs that are the first guided mugraph of a benchmark whose first kernel the test accepts
_SEARCHED = {
    "rms_norm_linear_bs8_64_columns": (_RNL8, lambda bg: _columns(64)(bg) and bg.grid[1] == 1),
    "rms_norm_linear_bs8_24_columns": (_RNL8, lambda bg: _columns(24)(bg) and bg.grid[1] == 1),
    "gated_mlp_split": ("gated_mlp.gated_mlp", lambda bg: bg.grid[1] == 2),
}


#: programs whose first kernel takes the skinny loop (mdsl.lowering.skinny): the benchmark plans of
#: RMSNorm+Linear at batch 1 and 8 and of Gated MLP, and coverage: bf16, 64 and 24 weight columns a block
#: (one whole 64-column group; 6 chunks of 4, lanes duplicating), a split Gated MLP (a combine kernel after),
#: 5 rows of X over 65 slabs (the last slabs past the steady loop), 48 columns a block (rows of 96 bytes
#: crossing lines: prefetches of both), prologues reading a vector along K: (x - b) @ w at one row, b [1, K]
#: (the first kernel of benchmarks/random_programs.py's random_s31_7), and rms_norm(x * g) @ w in bf16 at 16
#: rows, g [K]
SKINNY_PROGRAMS = ("gated_mlp", "gated_mlp_split", "rms_norm_linear_48_columns", "rms_norm_linear_5_rows_65_slabs",
                   "rms_norm_linear_bs1", "rms_norm_linear_bs8", "rms_norm_linear_bs8_24_columns",
                   "rms_norm_linear_bs8_64_columns", "rms_norm_linear_bs8_bf16", "prologue_rms_norm_linear_bs8",
                   "vector_prologue_linear_bs1", "vector_prologue_rms_norm_linear_bs16_bf16",
                   "transposed_rms_norm_linear_bs4", "transposed_gated_mlp_bs8")


@functools.cache
def skinny_program(name: str) -> KernelGraph:
    """One of SKINNY_PROGRAMS, built on first use (most are searched: tests/shared.py)."""
    from mdsl.ir.dtypes import bf16, f16
    from mdsl.ir.text import parse_graph
    from tests.backend.ptx.plans import gated_mlp_skinny, rms_norm_linear_skinny
    from tests.gpu.harness import with_dtype
    from tests.ir.skinny_texts import prologue_linear, rms_norm_linear, vector_prologue_linear

    if name in _SEARCHED:
        return shared_graph(f"skinny-program-{name}", lambda: _guided_with(*_SEARCHED[name]))
    if name == "rms_norm_linear_bs8_bf16":
        return with_dtype(guided_plan(_RNL8), f16, bf16)
    if name == "rms_norm_linear_5_rows_65_slabs":   # K = 1040: 65 slabs of 16, not a whole number of steps
        return parse_graph(rms_norm_linear(5, 32, blocks=64, k=1040, forloop=5))
    if name == "prologue_rms_norm_linear_bs8":   # rms_norm(silu(2 x)) @ w: the operand computed from X
        return parse_graph(prologue_linear(8, 32))
    if name == "vector_prologue_linear_bs1":   # (x - b) @ w, x and b [1, 8192], w [8192, 8192]
        return parse_graph(vector_prologue_linear(1, 32, blocks=256, k=8192, forloop=64))
    if name == "vector_prologue_rms_norm_linear_bs16_bf16":   # rms_norm(x * g) @ w, g [4096]
        return parse_graph(vector_prologue_linear(16, 32, body="mul_rms", dtype="bf16", rank=1))
    if name == "transposed_rms_norm_linear_bs4":   # rms_norm(x) @ transpose(w), w stored [4096, 4096] ([out, in])
        return rms_norm_linear_skinny(4, 8, columns=4096, blocks=64, k=4096, transposed=True)
    if name == "transposed_gated_mlp_bs8":   # two weights stored [2048, 2048], K split over 2 blocks, combined
        return gated_mlp_skinny(rows=8, k=2048, columns=2048, blocks=32, splits=2, forloop=8, transposed=True)
    if name == "rms_norm_linear_48_columns":
        return parse_graph(rms_norm_linear(16, 48, blocks=128, k=1024, forloop=16))
    return guided_plan({"rms_norm_linear_bs1": "rms_norm_linear.rms_norm_linear", "rms_norm_linear_bs8": _RNL8,
                        "gated_mlp": "gated_mlp.gated_mlp"}[name])


def skinny_programs() -> dict:
    """Name -> program, for every one of SKINNY_PROGRAMS."""
    return {name: skinny_program(name) for name in SKINNY_PROGRAMS}

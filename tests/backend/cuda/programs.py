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


@functools.cache
def guided_plan(name: str) -> KernelGraph:
    """The best guided plan of a benchmark (computed once per session: the search takes seconds)."""
    return next(guided.generate(example_kernels()[name]))


def block_graphs() -> dict:
    """'<program>/<node>' -> every custom node's block graph among the examples, the hand-written
    graphs and the coverage set."""
    programs = {**example_kernels(), **example_graphs(), **coverage_graphs()}
    return {f"{name}/{i}": node.body for name, graph in programs.items()
            for i, node in enumerate(graph.nodes) if node.op == "custom"}

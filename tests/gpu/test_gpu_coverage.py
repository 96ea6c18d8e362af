"""Coverage sets of kernel graphs on the GPU against the reference: the codegen tests' set (every
operator at every level, every accumulator, maps of many kinds; tests/backend/cuda/coverage.py) and
the systematic imap / fmap / omap / accumulator combinations of tests/gpu/coverage.py in f16, bf16
and f32."""
from __future__ import annotations

import functools

import pytest

from mdsl.ir.dtypes import bf16, f16, f32
from tests.backend.cuda.coverage import coverage_graphs as codegen_graphs
from tests.gpu.coverage import coverage_graphs
from tests.gpu.harness import check_graph

combinations = functools.cache(coverage_graphs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(codegen_graphs()))
def test_codegen_coverage_graph_on_the_gpu(name):
    graph = codegen_graphs()[name]
    # positive inputs: these graphs apply sqrt, rsqrt and reciprocal to inputs directly
    check_graph(graph, f"codegen-coverage:{name}", positive=range(len(graph.inputs)),
                what=f"codegen coverage graph {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (f16, bf16, f32), ids=lambda d: d.name)
@pytest.mark.parametrize("case_id", sorted(combinations(f16)))
def test_custom_kernel_combination_on_the_gpu(case_id, dtype):
    graph = combinations(dtype)[case_id]
    check_graph(graph, f"coverage:{case_id}:{dtype.name}", what=f"custom kernel {case_id} in {dtype.long_name}")

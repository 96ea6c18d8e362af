"""CI acceptance of both backends, without a GPU (tests/backend/acceptance.py says what it checks): every
example (the benchmark specifications and the hand-written fused kernels), the best guided plan of every
benchmark, the generated coverage set, the hand-written graphs and random graphs, through the CUDA backend
and through the PTX backend; the GPU tests' systematic map and accumulator combinations through the PTX
backend."""
from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings

from mdsl.ir import OPS, f16
from tests.backend.acceptance import assert_compiles_clean
from tests.backend.backends import BACKENDS, needs_assembler
from tests.backend.cuda.coverage import coverage_graphs, used_ops
from tests.backend.cuda.programs import benchmark_names, example_kernels, guided_plan
from tests.gpu.coverage import coverage_graphs as combination_graphs
from tests.strategies import example_graphs, kernel_graphs

pytestmark = pytest.mark.shared_compile_cache   # a program's code compiled once per session (tests/shared.py)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(example_kernels()))
def test_example(name, backend):
    assert_compiles_clean(example_kernels()[name], backend)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", benchmark_names())
def test_best_guided_plan_of_each_benchmark(name, backend):
    program, _ = assert_compiles_clean(guided_plan(name), backend)
    assert program.launches and all(l.smem_bytes > 0 for l in program.launches)  # custom kernels only


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(coverage_graphs()))
def test_coverage_graph(name, backend):
    assert_compiles_clean(coverage_graphs()[name], backend)


def test_the_coverage_set_uses_every_operator_at_every_level():
    used = set().union(*(used_ops(g) for g in coverage_graphs().values()))
    missing = sorted((level, name) for name, op in OPS.items() for level in op.levels if (level, name) not in used)
    assert not missing


@functools.cache
def _combinations() -> dict:
    """Every map, accumulator and matmul combination, in f16 (the coverage set above has every
    accumulator and matmul in bf16 and f32 too: the dtypes differ only where tiles are loaded and stored)."""
    return combination_graphs(f16)


@needs_assembler
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case_id", sorted(_combinations()))
def test_map_and_accumulator_combination(case_id):
    assert_compiles_clean(_combinations()[case_id], "ptx")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(example_graphs()))
def test_handwritten_graph(name, backend):
    assert_compiles_clean(example_graphs()[name], backend)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kernel_graphs(max_nodes=4))
def test_random_graphs(backend, graph):
    assert_compiles_clean(graph, backend)

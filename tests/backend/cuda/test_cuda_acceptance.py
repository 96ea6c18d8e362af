"""CI acceptance of the CUDA backend, without a GPU: the CUDA C++ of every example (the benchmark
specifications and the hand-written fused kernels), of the best guided plan of every benchmark, of
the generated coverage set and of random graphs compiles with NVRTC to an sm_90a cubin whose every
kernel, by the compiler's own report, spills nothing, uses no stack and fits in shared memory."""
from __future__ import annotations

import functools
import os

import pytest
from hypothesis import HealthCheck, given, settings

from mdsl.backend.cuda import compile_cuda, emit_cuda
from mdsl.ir import OPS, SMEM_LIMIT_BYTES
from tests.backend.cuda.coverage import coverage_graphs, used_ops
from tests.backend.cuda.programs import benchmark_names, example_kernels, guided_plan
from tests.strategies import example_graphs, kernel_graphs

pytestmark = pytest.mark.shared_compile_cache   # a program's cubin compiled once per session (tests/shared.py)

REGISTERS_PER_SM = 65536


@functools.lru_cache(maxsize=256)
def _compiled(source: str, arch_env):
    return compile_cuda(source)


def compiled(source: str):
    """NVRTC's module for the source, once per process (the same source recurs across these tests:
    a program under the default options, an option set that changes nothing in it); other processes
    find it in the session's cubin cache (tests/shared.py)."""
    return _compiled(source, os.environ.get("MDSL_CUDA_ARCH"))


def assert_compiles_clean(graph):
    program = emit_cuda(graph)
    module = compiled(program.source)
    assert module.cubin.startswith(b"\x7fELF") and module.arch == "sm_90a"
    assert set(module.resources) == {launch.name for launch in program.launches}
    for launch in program.launches:
        r = module.resources[launch.name]
        what = f"{launch.name}: {r}"
        assert r.spill_store_bytes == r.spill_load_bytes == 0, f"spills in {what}"
        assert r.stack_bytes == 0, f"a stack frame in {what}"
        assert launch.smem_bytes + r.smem_bytes <= SMEM_LIMIT_BYTES, f"over the shared-memory limit: {what}"
        assert 0 < r.registers * launch.block[0] <= REGISTERS_PER_SM, f"too many registers: {what}"
    return program, module


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(example_kernels()))
def test_example(name):
    assert_compiles_clean(example_kernels()[name])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", benchmark_names())
def test_best_guided_plan_of_each_benchmark(name):
    program, _ = assert_compiles_clean(guided_plan(name))
    assert program.launches and all(l.smem_bytes > 0 for l in program.launches)  # custom kernels only


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(coverage_graphs()))
def test_coverage_graph(name):
    assert_compiles_clean(coverage_graphs()[name])


def test_the_coverage_set_uses_every_operator_at_every_level():
    used = set().union(*(used_ops(g) for g in coverage_graphs().values()))
    missing = sorted((level, name) for name, op in OPS.items() for level in op.levels if (level, name) not in used)
    assert not missing


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(example_graphs()))
def test_handwritten_graph(name):
    assert_compiles_clean(example_graphs()[name])


@pytest.mark.timeout(90)
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kernel_graphs(max_nodes=4))
def test_random_graphs(graph):
    assert_compiles_clean(graph)

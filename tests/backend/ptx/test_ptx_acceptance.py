"""CI acceptance of the PTX backend, without a GPU: the PTX that llvmlite emits for every example (the
benchmark specifications and the hand-written fused kernels), the best guided plan of every
benchmark, the CUDA backend's generated coverage set, the GPU tests' systematic map and accumulator
combinations, the hand-written graphs and random graphs assembles for sm_90 (nvJitLink or ptxas)
into kernels that, by the assembler's own report, spill nothing, use no stack, fit in shared memory
and launch with the block size they were written for."""
from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings

from mdsl.backend.ptx import assemble, assembler, compile_ptx, emit_llvm
from mdsl.ir import SMEM_LIMIT_BYTES, f16
from tests.backend.cuda.coverage import coverage_graphs
from tests.backend.cuda.programs import benchmark_names, example_kernels, guided_plan
from tests.gpu.coverage import coverage_graphs as combination_graphs
from tests.strategies import example_graphs, kernel_graphs

REGISTERS_PER_SM = 65536

pytestmark = [pytest.mark.skipif(assembler() is None, reason="neither nvJitLink nor ptxas is installed: "
                                 "pip install nvidia-nvjitlink, or put the CUDA toolkit's ptxas on PATH"),
              pytest.mark.shared_compile_cache]   # PTX compiled once per session (tests/shared.py)


@functools.lru_cache(maxsize=256)
def assembled_module(llvm_ir: str):
    """The module's PTX and its assembly (option sets that emit the same IR share them)."""
    module = compile_ptx(llvm_ir)
    return module, assemble(module.ptx)


def assert_assembles_clean(graph, options=None):
    """`options`: the CudaOptions to emit with (None: from the environment, as emit_llvm does)."""
    program = emit_llvm(graph, options=options)
    module, assembled = assembled_module(program.llvm_ir)
    assert ".version 8.0" in module.ptx and ".target sm_90" in module.ptx and module.arch == "sm_90"
    assert assembled.cubin.startswith(b"\x7fELF")
    assert set(assembled.resources) == {launch.name for launch in program.launches}
    for launch in program.launches:
        r = assembled.resources[launch.name]
        what = f"{launch.name}: {r}"
        assert r.spill_store_bytes == r.spill_load_bytes == 0, f"spills in {what}"
        assert r.stack_bytes == 0, f"a stack frame in {what}"
        assert launch.smem_bytes + r.smem_bytes <= SMEM_LIMIT_BYTES, f"over the shared-memory limit: {what}"
        assert 0 < r.registers * launch.block[0] <= REGISTERS_PER_SM, f"too many registers: {what}"
    return program, assembled


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(example_kernels()))
def test_example(name):
    assert_assembles_clean(example_kernels()[name])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", benchmark_names())
def test_best_guided_plan_of_each_benchmark(name):
    program, _ = assert_assembles_clean(guided_plan(name))
    assert program.launches and all(l.smem_bytes > 0 for l in program.launches)  # custom kernels only


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(coverage_graphs()))
def test_coverage_graph(name):
    assert_assembles_clean(coverage_graphs()[name])


@functools.cache
def _combinations() -> dict:
    """Every map, accumulator and matmul combination, in f16 (the coverage set above has every
    accumulator and matmul in bf16 and f32 too: the dtypes differ only where tiles are loaded and stored)."""
    return combination_graphs(f16)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case_id", sorted(_combinations()))
def test_map_and_accumulator_combination(case_id):
    assert_assembles_clean(_combinations()[case_id])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(example_graphs()))
def test_handwritten_graph(name):
    assert_assembles_clean(example_graphs()[name])


@pytest.mark.timeout(90)
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kernel_graphs(max_nodes=4))
def test_random_graphs(graph):
    assert_assembles_clean(graph)

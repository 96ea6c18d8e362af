"""RMSNorm+Linear split-K through the CUDA backend, without a GPU: the benchmark-sized split candidate
(per-split products and means of squares, then the combine's mean, eps, root and division, in the split's
launch: mdsl.lowering.onelaunch) compiles for sm_90a with NVRTC without spills; the register counts of cached
cubins feed the ranking (`autotune.compiled_registers`, the kernel's for both nodes) without compiling
anything."""
from __future__ import annotations

import pytest

from mdsl.backend.cuda import autotune, compile_cuda, emit_cuda
from mdsl.backend.cuda import nvrtc
from mdsl.lowering.options import CudaOptions
from mdsl.search.cost import gpu_estimate
from mdsl.search.dims import Labels
from mdsl.search.guided import Choice, lift
from tests.examples_util import load_example


def _split_rnl(bs: int, column_parts: int = 64, split: int = 4, forloop: int = 8):
    graph = load_example("rms_norm_linear").make_rms_norm_linear(bs).graph
    labels = Labels(graph)
    k, columns = labels.label(graph.inputs[0].name, 1), labels.label(graph.outputs[0].name, 1)
    return lift(graph, Choice(((columns, column_parts),), k, forloop=forloop, split=split), labels)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bs,threads", [(1, None), (8, 256)])
def test_the_split_kernels_compile_for_sm_90a_without_spills(bs, threads, monkeypatch, tmp_path):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    graph = _split_rnl(bs)
    program = emit_cuda(graph, arch="sm_90a", options=CudaOptions(stages=2, threads=threads))
    (launch,) = program.launches   # the combine's 64 blocks run in the last of each group of 4 splits
    assert launch.grid == (64, 4, 1) and launch.counters == 64
    assert "sqrtf" in program.source and "mdsl::copy_async" in program.source
    module = compile_cuda(program.source, arch="sm_90a")
    assert set(module.resources) == {launch.name}
    for r in module.resources.values():
        assert 0 < r.registers <= 255 and r.spill_store_bytes == r.spill_load_bytes == 0


@pytest.mark.timeout(120)
def test_compiled_registers_reads_the_cubin_cache_and_never_compiles(monkeypatch, tmp_path):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    graph = _split_rnl(1)
    calls = []
    real = nvrtc._compile
    monkeypatch.setattr(nvrtc, "_compile", lambda *a: calls.append(a) or real(*a))
    assert autotune.compiled_registers(graph)(0) is None and not calls   # nothing cached: no compile
    stages = autotune.VARIANT_STAGES[0]
    module = compile_cuda(emit_cuda(graph, arch="sm_90a", options=CudaOptions(stages=stages)).source)
    assert len(calls) == 1
    lookup = autotune.compiled_registers(graph)
    assert len(calls) == 1
    program = emit_cuda(graph, arch="sm_90a", options=CudaOptions(stages=stages))
    (launch,) = program.launches
    registers = module.resources[launch.name].registers
    assert lookup(0) == lookup(1) == registers   # the split's and the combine's: their kernel's (no spills to add)
    assert [f.registers for f in gpu_estimate(graph, registers=lookup).kernels] == [registers, registers]

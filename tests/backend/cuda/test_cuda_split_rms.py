"""RMSNorm+Linear split-K through the CUDA backend, without a GPU: the benchmark-sized split candidate
(per-split products and means of squares, then the combine's mean, eps, root and division) compiles for
sm_90a with NVRTC, both kernels without spills; the register counts of cached cubins feed the ranking
(`autotune.compiled_registers`) without compiling anything."""
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
    first, combine = program.launches
    assert first.grid == (64, 4, 1) and combine.grid == (64, 1, 1)
    assert "sqrtf" in program.source and "mdsl::copy_async" in program.source
    module = compile_cuda(program.source, arch="sm_90a")
    assert set(module.resources) == {first.name, combine.name}
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
    for launch in program.launches:
        assert lookup(launch.node_index) == module.resources[launch.name].registers   # no spills to add
    fits = gpu_estimate(graph, registers=lookup).kernels
    assert [f.registers for f in fits] == [module.resources[l.name].registers for l in program.launches]

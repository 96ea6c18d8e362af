"""The skinny loop on the GPU (mdsl.backend.cuda.skinny): the benchmark plans of RMSNorm+Linear at batch 1
and 8 and of Gated MLP, at the benchmark's sizes, and the coverage programs beside them
(tests/backend/cuda/programs.skinny_programs), with the block's own threads and with 256, and with the K
split over clusters of 2 and 4 blocks (sm_90+), against the float64 reference on fresh inputs; and the
autotuner times the skinny loop beside the tile loop, all correct.

    pytest tests/gpu/test_gpu_skinny.py -m gpu
"""
from __future__ import annotations

import pytest

from mdsl.backend.cuda import autotune, runtime
from mdsl.backend.cuda.options import CudaOptions, arch_number
from tests.backend.cuda.programs import skinny_programs
from tests.gpu.harness import compare, random_inputs, reference, rng_for, run, tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("threads, cluster", [(None, 1), (256, 1), (None, 2), (None, 4)])
@pytest.mark.parametrize("name", sorted(skinny_programs()))
def test_the_skinny_loop_computes_the_program(name, threads, cluster):
    graph = skinny_programs()[name]
    what = f"{name}, skinny loop, {threads or 'own'} threads, K split over clusters of {cluster}"
    inputs = random_inputs(graph, rng_for(f"skinny:{name}:{threads}" + (f":cluster {cluster}" if cluster > 1 else "")))
    want = reference(graph, inputs)
    executable = runtime.compile_graph(graph, options=CudaOptions(skinny=True, threads=threads, cluster=cluster))
    source = executable.program.source
    assert "::run(skinny_acc" in source, f"{what}: the skinny loop was not taken"
    if cluster > 1 and arch_number(runtime.target_arch()) >= 90 and "65_slabs" not in name:   # 65 slabs: no split
        assert f"__cluster_dims__({cluster}, 1, 1)" in source, f"{what}: not split over a cluster"
    compare(executable, run(executable, inputs), want, tolerance(graph), what)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rms_norm_linear_bs1", "rms_norm_linear_bs8", "gated_mlp"])
def test_the_autotuner_times_the_skinny_loop_beside_the_tile_loop(name, tmp_path, monkeypatch):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    graph = skinny_programs()[name]
    space = autotune.parameter_space(stages=(3,), threads=(None,))
    result = autotune.autotune([graph], graph, space=space, samples=5, calls=3, cache=False)
    report = "\n".join(result.lines())
    assert len(result.timings) == 1 + len(autotune.CLUSTERS), report   # the tile loop, the skinny loop per cluster
    assert all(t.us is not None for t in result.timings), report   # both correct, both timed

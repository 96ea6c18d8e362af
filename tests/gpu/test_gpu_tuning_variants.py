"""Tuning variants on the GPU: a plan's verified variants (other grids, splits, loop lengths of its fused
kernels) are compiled, checked against the float64 reference and timed by the autotuner like the plan's
own candidates; every one that runs computes the program, and the pick does on fresh inputs too.

    pytest tests/gpu/test_gpu_tuning_variants.py -m gpu
"""
from __future__ import annotations

import pytest

from mdsl.backend.cuda import autotune
from mdsl.search import variants as V
from tests.gpu.harness import check_graph
from tests.search.small_plans import small_plan


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["gqa", "gated_mlp"])
def test_every_variant_runs_correctly_and_the_pick_computes_the_program(name, tmp_path, monkeypatch):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    plan, cache = small_plan(name, tmp_path)
    found = V.ensure_variants(plan, 4, cache=cache, workers=2)
    assert found, f"{name}: no verified tuning variant"
    todo = autotune.tuning_set(plan, limit=2, variants=4, cache=cache)
    result = autotune.autotune(todo.graphs, plan.original, spaces=todo.spaces, names=todo.names, samples=5, calls=3,
                               cache=False)
    report = "\n".join(result.lines())
    wrong = [t for t in result.timings if t.problem.startswith("wrong output")]
    assert not wrong, report
    first_variant = len(todo.graphs) - len(found)
    timed = [t for t in result.timings if t.us is not None]
    assert any(t.variant.candidate >= first_variant for t in timed), f"no tuning variant ran\n{report}"
    assert result.us == min(t.us for t in timed)
    for key, value in {"MDSL_CUDA_STAGES": str(result.options.stages),
                       "MDSL_CUDA_THREADS": str(result.options.threads or "")}.items():
        monkeypatch.setenv(key, value)
    check_graph(result.graph, f"tuning-variant:{name}", what=f"the autotuned pick for {name}")

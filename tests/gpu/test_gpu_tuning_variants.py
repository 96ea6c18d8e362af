"""Tuning variants on the GPU: a plan's verified variants (other grids, splits, loop lengths of its fused
kernels) are compiled, checked against the float64 reference and timed by the autotuner like the plan's
own candidates; every one that runs computes the program, and the pick does on fresh inputs too.

    pytest tests/gpu/test_gpu_tuning_variants.py -m gpu

RMSNorm+Linear's split-K variants (the shapes `--plans-only` stores for the benchmark: per-split products
and means of squares, then a combine of mean, eps, root and division) run at the benchmark's sizes through
both backends and every option the autotuner tries.
"""
from __future__ import annotations

import pytest

from mdsl import gpu as runtime
from mdsl.backend.cuda import autotune
from mdsl.search import variants as V
from mdsl.search.dims import Labels
from mdsl.search.guided import Choice, lift
from tests.examples_util import load_example
from tests.gpu.harness import check_graph, compare, random_inputs, reference, rng_for, run, tolerance
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
                       "MDSL_CUDA_THREADS": str(result.options.threads or ""),
                       "MDSL_CUDA_SKINNY": str(int(result.options.skinny)),
                       "MDSL_CUDA_OVERLAP": str(int(result.options.overlap)),
                       "MDSL_CUDA_STAGGER": str(int(result.options.stagger))}.items():
        monkeypatch.setenv(key, value)
    check_graph(result.graph, f"tuning-variant:{name}", what=f"the autotuned pick for {name}")


def _split_rnl(bs: int, column_parts: int, split: int, forloop: int):
    graph = load_example("rms_norm_linear").make_rms_norm_linear(bs).graph
    labels = Labels(graph)
    k, columns = labels.label(graph.inputs[0].name, 1), labels.label(graph.outputs[0].name, 1)
    return lift(graph, Choice(((columns, column_parts),), k, forloop=forloop, split=split), labels)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize("shape", [(64, 4, 8), (96, 4, 8), (48, 8, 8)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("stages,threads", [(2, ""), (3, ""), (2, "256"), (3, "256")])
def test_rms_norm_linear_split_k_computes_the_program(bs, shape, stages, threads, monkeypatch):
    monkeypatch.setenv("MDSL_CUDA_STAGES", str(stages))
    monkeypatch.setenv("MDSL_CUDA_THREADS", threads)
    graph = _split_rnl(bs, *shape)
    assert len(graph.nodes) == 2
    check_graph(graph, f"rnl-split-k:{bs}:{shape}:{stages}:{threads}",
                what=f"rms_norm_linear_bs{bs} split-K {shape}, {stages} stages, threads {threads or 'own'}")


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("bs", [1, 8])
def test_rms_norm_linear_split_k_through_the_ptx_backend(bs):
    graph = _split_rnl(bs, 64, 4, 8)
    test_id = f"rnl-split-k-ptx:{bs}"
    inputs = random_inputs(graph, rng_for(test_id))
    want = reference(graph, inputs)
    executable = runtime.compile_graph(graph, backend="ptx")
    compare(executable, run(executable, inputs), want, tolerance(graph), f"rms_norm_linear_bs{bs} split-K (PTX)")

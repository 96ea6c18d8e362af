"""The autotuner's view of tuning variants, without a GPU: what it times for a plan (`tuning_set`: the
plan's candidates under the full option space, its stored variants under the trimmed one), variants that
do not emit, the cache key, and the GPU run's read path, which must import neither z3 nor the verifier."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mdsl.backend.cuda import autotune
from mdsl.errors import UnsupportedError
from mdsl.lowering.options import CudaOptions
from mdsl.search import variants as V
from tests.search.small_plans import small_plan

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def gemv(tmp_path_factory):
    root = tmp_path_factory.mktemp("plans")
    plan, cache = small_plan("rms_norm_linear", root)
    found = V.ensure_variants(plan, 3, cache=cache, workers=1)
    return plan, cache, found, root


@pytest.mark.timeout(240)
def test_the_tuning_set_is_the_plans_candidates_then_its_variants(gemv):
    plan, cache, found, _ = gemv
    assert found
    todo = autotune.tuning_set(plan, limit=2, variants=3, cache=cache)
    own = autotune.plan_candidates(plan, 2)
    assert list(todo.graphs) == own + [v.candidate.graph for v in found]
    full, trimmed = autotune.parameter_space(), autotune.parameter_space(stages=autotune.VARIANT_STAGES)
    assert list(todo.spaces) == [full] * len(own) + [trimmed] * len(found)
    assert todo.names[0] == "the plan's choice" and all(n.startswith("variant ") for n in todo.names[len(own):])
    assert autotune.tuning_set(plan, limit=2, variants=0, cache=cache).graphs == tuple(own)
    # every pair is emitted once, each candidate under its own space
    pairs = autotune.variants(todo.graphs, full, spaces=todo.spaces, names=todo.names)
    assert {v.candidate for v in pairs} == set(range(len(todo.graphs)))
    assert all(v.options in todo.spaces[v.candidate] for v in pairs)
    assert len(pairs) <= sum(len(s) for s in todo.spaces)


def test_a_pair_that_does_not_emit_is_reported_not_timed(gemv, monkeypatch):
    plan, cache, _, _ = gemv
    todo = autotune.tuning_set(plan, limit=1, variants=1, cache=cache)
    real = autotune.emit_cuda

    def refuse_deep_pipelines(graph, *, arch, options):
        if options.stages == 3:
            raise UnsupportedError("no 3-stage pipeline for this test")
        return real(graph, arch=arch, options=options)

    monkeypatch.setattr(autotune, "emit_cuda", refuse_deep_pipelines)
    emitted = autotune.emitted_variants(todo.graphs, autotune.parameter_space(), "sm_90a", todo.spaces, todo.names)
    refused = [(v, why) for v, why in emitted if why]
    assert refused and all(v.options.stages == 3 and "does not emit" in why for v, why in refused)
    assert all(v.options.stages != 3 for v in autotune.variants(todo.graphs, autotune.parameter_space(),
                                                                  spaces=todo.spaces))


def test_the_cache_key_depends_on_each_candidates_space(gemv):
    plan, cache, _, _ = gemv
    todo = autotune.tuning_set(plan, limit=1, variants=1, cache=cache)
    space = autotune.parameter_space()
    keys = {autotune.cache_key(todo.graphs, "NVIDIA H200", "sm_90a", space),
            autotune.cache_key(todo.graphs, "NVIDIA H200", "sm_90a", space, todo.spaces),
            autotune.cache_key(todo.graphs, "NVIDIA H200", "sm_90a", space, [space, [CudaOptions(stages=2)]])}
    assert len(keys) == 3


def test_a_variant_is_described_by_its_name(gemv):
    v = autotune.Variant(3, CudaOptions(stages=2), "variant 1: 96 blocks x 8 iteration(s)")
    assert v.describe() == "candidate 3 (variant 1: 96 blocks x 8 iteration(s)), 2-stage pipeline, own threads"
    assert v == autotune.Variant(3, CudaOptions(stages=2))   # the name is a label, not part of the identity


_GPU_READ_PATH = textwrap.dedent("""
    import importlib.abc, json, sys

    class NoZ3(importlib.abc.MetaPathFinder):   # as on the GPU machine: z3 is not installed
        def find_spec(self, name, path=None, target=None):
            if name == "z3" or name.startswith("z3."):
                raise ModuleNotFoundError("No module named 'z3'", name="z3")

    sys.meta_path.insert(0, NoZ3())
    import benchmarks.kernels as harness
    from mdsl.backend.cuda.autotune import emitted_variants, parameter_space, tuning_set
    from mdsl.search.engine import cached_plan
    from tests.search.small_plans import CONFIG, SMALL, two_guided

    plan = cached_plan(SMALL["rms_norm_linear"](), CONFIG, generators=[two_guided])
    todo = tuning_set(plan, 2, 3)
    pairs = emitted_variants(todo.graphs, parameter_space(), "sm_90a", todo.spaces, todo.names)
    loaded = [m for m in ("z3", "mdsl.passes.subexpr", "mdsl.passes.verify", "mdsl.search.guided",
                          "mdsl.search.enumerate") if m in sys.modules]
    print(json.dumps({"graphs": len(todo.graphs), "pairs": len(pairs), "loaded": loaded}))
""")


@pytest.mark.timeout(240)
def test_the_gpu_runs_read_path_imports_neither_z3_nor_the_verifier(gemv):
    plan, _, found, root = gemv
    env = {**os.environ, "MDSL_CACHE_DIR": str(root), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _GPU_READ_PATH], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=200)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["loaded"] == []
    assert report["graphs"] == len(autotune.plan_candidates(plan, 2)) + len(found)
    assert report["pairs"] >= report["graphs"]

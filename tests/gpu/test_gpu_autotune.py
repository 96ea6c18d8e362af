"""Autotuning on the GPU: every variant of the candidates is compiled, checked and timed, the
fastest correct one is returned and cached, and the cache answers the next call."""
from __future__ import annotations

import pytest

from mdsl import gpu as runtime
from mdsl.backend.cuda import autotune
from mdsl.search.guided import generate
from tests.backend.cuda.programs import example_kernels
from tests.gpu.harness import check_graph


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rms_norm_linear.rms_norm_linear", "gated_mlp.gated_mlp"])
def test_autotune_picks_a_correct_variant_and_caches_it(name, tmp_path, monkeypatch):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    original = example_kernels()[name]
    candidates = [g for _, g in zip(range(2), generate(original))]
    space = autotune.parameter_space(stages=(1, 3), threads=(None, 256))
    result = autotune.autotune(candidates, original, space=space, samples=5, calls=3)
    assert not result.cached and result.us > 0
    timed = [t for t in result.timings if t.us is not None]
    assert timed and all(t.problem == "" for t in timed), "\n".join(result.lines())
    assert result.us == min(t.us for t in timed)
    assert len(result.timings) == len(autotune.variants(candidates, space, arch=runtime.target_arch()))
    again = autotune.autotune(candidates, original, space=space)
    assert again.cached and again.variant == result.variant and again.graph == result.graph
    # the chosen variant, as the caller compiles it, against the reference on fresh inputs
    for key, value in {"MDSL_CUDA_STAGES": str(result.options.stages),
                       "MDSL_CUDA_THREADS": str(result.options.threads or "")}.items():
        monkeypatch.setenv(key, value)
    check_graph(result.graph, f"autotuned:{name}", what=f"the autotuned variant of {name}")

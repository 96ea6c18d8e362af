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


@pytest.mark.gpu
def test_a_kernels_first_call_tunes_its_plan_and_later_kernels_read_the_choice(monkeypatch):
    """As a user calls a kernel: the first call times the plan's candidates and the program as written
    (autotune.first_call_set), computes the right outputs with the fastest, and caches the choice per device;
    the same program in another kernel object reads it (no second tuning)."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from mdsl.search.config import SearchConfig
    from mdsl.search.engine import optimize
    from tests.examples_util import load_example
    from tests.gpu.harness import random_inputs, reference, relative_error, rng_for, tolerance

    monkeypatch.delenv("MDSL_AUTOTUNE", raising=False)
    tuned = []
    monkeypatch.setattr(autotune, "autotune", lambda *a, _real=autotune.autotune, **kw: tuned.append(_real(*a, **kw))
                        or tuned[-1])
    outputs = []
    for _ in range(2):
        kernel = load_example("rms_norm_linear").make_rms_norm_linear(4, k=1024, n=512)
        # the GPU machine has no z3, which the default search needs: the plan of a search without it
        plan = optimize(kernel.graph, SearchConfig(budget_s=60.0, work=300, exhaustive=False), cache=False)
        monkeypatch.setattr(kernel, "_gpu_plan", lambda specs, arch, plan=plan: plan)
        inputs = random_inputs(kernel.graph, rng_for("first-call-tuning"))
        got = kernel(*[torch.from_numpy(x).to("cuda", torch.float16) for x in inputs])
        outputs.append(got.float().cpu().numpy().astype(np.float64))
        want = reference(kernel.graph, inputs)[0]
        assert relative_error(outputs[-1], want) <= tolerance(kernel.graph)
    assert [t.cached for t in tuned] == [False, True] and tuned[0].variant == tuned[1].variant
    assert any(t.us is not None for t in tuned[0].timings), "\n".join(tuned[0].lines())

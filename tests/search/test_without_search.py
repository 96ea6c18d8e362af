"""`optimize` on a machine where the default search cannot run (z3 is not installed, as on the GPU
machine): the plan cache serves what it has, provisional plans included, and a program without a plan
raises SearchUnavailable at once instead of running a search that lacks the exhaustive generator."""
from __future__ import annotations

import importlib.util

import attrs
import pytest

from mdsl.search import engine
from mdsl.search.cache import PlanCache
from mdsl.search.engine import SearchUnavailable, optimize, search_unavailable
from tests.search.small_plans import CONFIG as SMALL_CONFIG, SMALL, two_guided

#: the small plans' config with the exhaustive generator, the one generator that needs z3
CONFIG = attrs.evolve(SMALL_CONFIG, exhaustive=True)

NO_Z3 = "z3-solver, which the exhaustive generator needs, is not installed"


@pytest.fixture
def no_search(monkeypatch):
    """This process as a machine without z3: any search fails the test."""
    monkeypatch.setattr(engine, "has_z3", lambda: False)

    def search(*args, **kwargs):
        raise AssertionError("optimize searched where the search cannot run")

    monkeypatch.setattr(engine, "search", search)


def _default_entry(cache: PlanCache, graph, provisional: bool = False):
    """A verified plan of `graph` stored where `optimize` with the default searcher looks for it."""
    plan = optimize(graph, CONFIG, cache=False, generators=[two_guided])
    if provisional:
        plan = attrs.evolve(plan, stats=attrs.evolve(plan.stats, timed_out=True))
        assert plan.provisional
    cache.store(cache.key(graph, CONFIG, searcher=engine._searcher_identity(None, None)), plan)
    return plan


def test_a_machine_without_z3_says_the_search_cannot_run(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "z3" else real(name, *a))
    assert search_unavailable() == NO_Z3


def test_a_program_without_a_plan_raises_at_once(tmp_path, no_search):
    cache = PlanCache(tmp_path)
    with pytest.raises(SearchUnavailable, match="has no plan for it, and the search cannot run here: z3") as caught:
        optimize(SMALL["rms_norm_linear"](), CONFIG, cache=cache)
    assert "z3-solver" in caught.value.hint and not list(tmp_path.rglob("*.json"))


@pytest.mark.parametrize("provisional", [False, True])
def test_a_stored_plan_is_served_provisional_or_not(tmp_path, monkeypatch, provisional):
    graph = SMALL["rms_norm_linear"]()
    cache = PlanCache(tmp_path)
    stored = _default_entry(cache, graph, provisional)
    monkeypatch.setattr(engine, "has_z3", lambda: False)
    monkeypatch.setattr(engine, "search", lambda *a, **k: pytest.fail("optimize searched"))
    plan = optimize(graph, CONFIG, cache=cache)
    assert plan.graph == stored.graph and plan.provisional == provisional


def test_given_generators_search_as_before(tmp_path, no_search):
    """A search of given generators does not need z3 (its key names them): only the default one is refused."""
    graph = SMALL["rms_norm_linear"]()
    with pytest.raises(AssertionError, match="optimize searched"):
        optimize(graph, CONFIG, cache=PlanCache(tmp_path), generators=[two_guided])


def test_a_kernels_gpu_path_runs_its_traced_program_where_no_plan_can_be_had(no_search):
    """What a kernel's first GPU call compiles (no GPU needed to choose it): the traced program, with a
    warning that names why, instead of waiting on a search."""
    from mdsl.frontend.tensor import TensorSpec
    from tests.examples_util import load_example

    kernel = load_example("rms_norm_linear").make_rms_norm_linear(1, k=256, n=192)
    specs = tuple(TensorSpec(v.shape, v.dtype) for v in kernel.graph.inputs)
    with pytest.warns(UserWarning, match="running the traced program unoptimized: .*search cannot run here: z3"):
        assert kernel._gpu_plan(specs, "sm_90a") is None


def test_a_config_without_the_exhaustive_generator_searches_without_z3(tmp_path, monkeypatch):
    """Only the exhaustive generator needs z3: a config that leaves it out searches (its key names the
    config), where the default config's search is refused."""
    monkeypatch.setattr(engine, "has_z3", lambda: False)
    assert search_unavailable() == search_unavailable(CONFIG) == NO_Z3
    assert search_unavailable(SMALL_CONFIG) is None
    plan = optimize(SMALL["rms_norm_linear"](), SMALL_CONFIG, cache=PlanCache(tmp_path))
    assert plan.graph is not None and list(tmp_path.rglob("*.json"))

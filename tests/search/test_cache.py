"""The plan cache: hits, keys, corrupt entries, atomic writes."""
from __future__ import annotations

import json
import os

import attrs
import pytest

import mdsl
from mdsl import Tensor, f16
from mdsl.errors import SourceLoc
from mdsl.search import cache as cache_module
from mdsl.search.cache import PlanCache, default_dir
from mdsl.search.config import SearchConfig
from mdsl.search.engine import optimize
from tests.search import fakes

CONFIG = SearchConfig(budget_s=30, workers=1)


def run(store: PlanCache, graph=fakes.ORIGINAL, config: SearchConfig = CONFIG, **kwargs):
    return optimize(graph, config, cache=store, generators=[fakes.mixed], verifier=fakes.verify, **kwargs)


def entries(store: PlanCache) -> list:
    return sorted(p.name for p in store.plans.iterdir())


@pytest.mark.timeout(30)
def test_the_second_call_is_answered_from_the_cache(tmp_path, monkeypatch):
    store = PlanCache(tmp_path)
    first = run(store)
    assert first.cache_path is None

    def no_search(*args, **kwargs):
        raise AssertionError("a cache hit must not search")

    monkeypatch.setattr("mdsl.search.engine.search", no_search)
    second = run(store)
    assert second == first
    assert second.cache_path == str(store.path(store.key(fakes.ORIGINAL, CONFIG, _searcher())))
    assert f"# cached:   {second.cache_path}" in str(second)
    assert entries(store) == [os.path.basename(second.cache_path)]


def _searcher() -> dict:
    return {"generators": ["tests.search.fakes.mixed"], "verifier": "tests.search.fakes.verify"}


@pytest.mark.timeout(30)
def test_a_hit_is_logged_and_no_search_runs(tmp_path):
    store = PlanCache(tmp_path)
    run(store)
    log = tmp_path / "hit.jsonl"
    run(store, log_path=log)
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["event"] == "cache_hit" and record["path"].endswith(".json")


@pytest.mark.timeout(30)
def test_no_cache_searches_and_stores_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    plan = run(False)
    assert plan.cache_path is None and not (tmp_path / "plans").exists()
    run(True)
    assert len(entries(PlanCache())) == 1


def test_the_location_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    assert default_dir() == tmp_path and PlanCache().plans == tmp_path / "plans"
    monkeypatch.delenv("MDSL_CACHE_DIR")
    assert default_dir() == __import__("pathlib").Path.home() / ".cache" / "mdsl"


def _corrupt_text(path):
    path.write_text("{ not json")


def _other_key(path):
    data = json.loads(path.read_text())
    data["key"] = "0" * 64
    path.write_text(json.dumps(data))


def _other_original(path):
    data = json.loads(path.read_text())
    data["plan"]["original"]["nodes"][0]["attrs"]["value"] = 5.0
    path.write_text(json.dumps(data))


def _invalid_graph(path):
    data = json.loads(path.read_text())
    data["plan"]["chosen"]["graph"]["nodes"][0]["outputs"][0]["shape"] = [8, 8]
    path.write_text(json.dumps(data))


def _stale_cost(path):
    data = json.loads(path.read_text())
    data["plan"]["chosen"]["cost"]["seconds"] = 1e-9
    path.write_text(json.dumps(data))


def _old_schema(path):
    data = json.loads(path.read_text())
    data["mdsl_plan_cache"] = 0
    path.write_text(json.dumps(data))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damage", [_corrupt_text, _other_key, _other_original, _invalid_graph, _stale_cost,
                                    _old_schema])
def test_a_bad_entry_is_ignored_with_a_warning_then_recomputed_and_rewritten(tmp_path, damage):
    store = PlanCache(tmp_path)
    first = run(store)
    path = store.path(store.key(fakes.ORIGINAL, CONFIG, _searcher()))
    damage(path)
    damaged = path.read_text()
    with pytest.warns(UserWarning, match=f"ignoring the plan cache entry {path}"):
        again = run(store)
    assert again == first and again.cache_path is None  # searched again
    assert path.read_text() != damaged
    assert run(store).cache_path == str(path)            # and the rewritten entry is good


def test_the_key_depends_on_what_decides_the_result(monkeypatch):
    store = PlanCache("unused")
    base = store.key(fakes.ORIGINAL, CONFIG)
    assert store.key(fakes.ORIGINAL, SearchConfig(budget_s=30, workers=1)) == base
    assert store.key(fakes.ORIGINAL, SearchConfig(budget_s=30.0, workers=1)) == base   # one number, two spellings
    assert store.key(fakes.ORIGINAL, attrs.evolve(CONFIG, forloop_ranges=(1.0, 2, 4.0, 8, 16, 32, 64, 128))) == base
    assert store.key(fakes.ORIGINAL, attrs.evolve(CONFIG, budget_s=30.5)) != base
    assert store.key(fakes.ORIGINAL, attrs.evolve(CONFIG, workers=7)) == base      # workers: not the result
    assert store.key(fakes.ORIGINAL, attrs.evolve(CONFIG, seed=1)) != base
    assert store.key(fakes.ORIGINAL, attrs.evolve(CONFIG, budget_s=31)) != base
    assert store.key(fakes.ORIGINAL, attrs.evolve(CONFIG, arch="sm_80")) != base
    assert store.key(fakes.chain(-1.0, -1.0, 2.0, shape=(8, 32)), CONFIG) != base   # shape
    assert store.key(fakes.chain(-1.0, -1.0, 3.0), CONFIG) != base                  # program
    assert store.key(fakes.ORIGINAL, CONFIG, {"generators": ["x.y"]}) != base
    monkeypatch.setattr("mdsl._version.__version__", "99.0")   # the version mdsl reports
    assert store.key(fakes.ORIGINAL, CONFIG) != base


def test_the_key_ignores_source_locations():
    @mdsl.kernel
    def k(x: Tensor[4, 8, f16]):
        return mdsl.exp(x)

    graph = k.graph
    moved = attrs.evolve(graph, nodes=[attrs.evolve(n, loc=SourceLoc("elsewhere.py", 99)) for n in graph.nodes])
    store = PlanCache("unused")
    assert store.key(moved, CONFIG) == store.key(graph, CONFIG)


@pytest.mark.timeout(30)
def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path, monkeypatch):
    store = PlanCache(tmp_path)
    plan = run(store, config=attrs.evolve(CONFIG, seed=1))
    assert [name for name in entries(store) if not name.endswith(".json")] == []

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(cache_module.os, "replace", fail)
    with pytest.warns(UserWarning, match="could not write the plan cache entry .*disk full"):
        assert store.store("k" * 64, plan) is None
    assert len(entries(store)) == 1  # neither the entry nor its temporary file


@pytest.mark.timeout(60)
def test_kernel_function_optimize_searches_then_hits_the_cache():
    pytest.importorskip("mdsl.passes.verify")

    @mdsl.kernel
    def small(x: Tensor[4, 64, f16], w: Tensor[64, 32, f16]):
        return mdsl.rms_norm(x) @ w

    config = SearchConfig(budget_s=20, workers=2, exhaustive=False)  # guided candidates are enough here
    plan = small.optimize(config=config)
    assert plan.original == small.graph and plan.cache_path is None
    assert plan.evidence.equivalent and plan.cost <= plan.original_cost
    again = small.optimize(config=config)
    assert again == plan and again.cache_path is not None
    assert small.optimize(mdsl.Tensor[4, 64, f16], mdsl.Tensor[64, 32, f16], config=config).cache_path is not None


@pytest.mark.timeout(30)
def test_cached_plan_answers_what_optimize_stored_and_never_searches(tmp_path):
    from mdsl.search.engine import cached_plan

    store = PlanCache(tmp_path)
    lookup = dict(cache=store, generators=[fakes.mixed], verifier=fakes.verify)
    assert cached_plan(fakes.ORIGINAL, CONFIG, **lookup) is None and not store.plans.exists()
    plan = run(store)
    assert cached_plan(fakes.ORIGINAL, CONFIG, **lookup) == plan
    assert cached_plan(fakes.ORIGINAL, attrs.evolve(CONFIG, seed=1), **lookup) is None   # another key
    assert cached_plan(fakes.ORIGINAL, CONFIG, cache=False) is None

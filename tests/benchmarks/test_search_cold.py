"""benchmarks/cases.py's search_cold: a benchmark case is searched in a plan cache of its own, so the
same program at another batch size in the shared cache does not answer it as a shape-family member, and
its plan is then in the shared cache for the runs that read it."""
from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.cases import search_cold
from mdsl.search.cache import PlanCache
from mdsl.search.engine import cached_plan, optimize
from tests.search.test_family import CONFIG, layer


class Kernel:      # what search_cold uses of an @mdsl.kernel: optimize(config, cache, progress)
    def __init__(self, graph, log):
        self.graph, self.log = graph, log

    def optimize(self, config, cache, progress=None):
        return optimize(self.graph, config, cache=cache, progress=progress, log_path=self.log)


@pytest.mark.timeout(180)
def test_a_case_is_searched_whatever_the_shared_cache_holds_and_lands_there(tmp_path, monkeypatch):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path / "shared"))
    optimize(layer(8), CONFIG)                                   # the shared cache holds the 8-row plan
    shutil.copytree(tmp_path / "shared", tmp_path / "copy")    # (there, the 16-row program is a family hit)
    family = tmp_path / "family.jsonl"
    optimize(layer(16), CONFIG, cache=PlanCache(tmp_path / "copy"), log_path=family)
    assert [json.loads(line)["event"] for line in family.read_text().splitlines()] == ["family_hit"]
    cold = tmp_path / "cold.jsonl"
    plan = search_cold(Kernel(layer(16), cold), CONFIG)
    events = [json.loads(line)["event"] for line in cold.read_text().splitlines()]
    assert "family_hit" not in events and events                 # searched, not re-targeted
    stored = cached_plan(layer(16), CONFIG)
    assert stored is not None and stored.graph == plan.graph
    assert not list((tmp_path / "shared" / "plans").glob("*.tmp*"))

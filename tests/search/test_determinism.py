"""A search's result does not depend on the machine's load: its work budget is a count, and outcomes
are merged in admission order whatever order the workers finish them in. A plan the time cap cut
short is provisional, and the next `optimize` searches again."""
from __future__ import annotations

import json

import pytest

from mdsl.search.cache import PlanCache
from mdsl.search.config import SearchConfig
from mdsl.search import engine
from mdsl.search.engine import optimize, search
from tests.search import fakes


def _outcome(result, log) -> tuple:
    counts = {c: r for c, r in result.stats.counts.items()}
    events = [(e["event"], e.get("key")) for e in map(json.loads, log.read_text().splitlines())
              if e["event"] in ("verified", "rejected", "new_best")]
    return [(c.graph.key, c.cost, c.evidence) for c in result.candidates], counts, events


@pytest.mark.timeout(120)
def test_outcomes_do_not_depend_on_the_order_workers_finish_in(tmp_path, monkeypatch):
    outcomes = []
    for run, (workers, poll_s) in enumerate(((3, engine._POLL_S), (3, 0.0), (3, 0.0), (1, engine._POLL_S))):
        # a poll of 0 reports at every count, so the engine merges whenever it can (as on a loaded machine)
        monkeypatch.setattr(engine, "_POLL_S", poll_s)
        log = tmp_path / f"run{run}.jsonl"
        config = SearchConfig(budget_s=60, workers=workers, top_k=5, seed=5)
        result = search(fakes.chain(*[1.0] * 9, 2.0), config, generators=[fakes.with_fallbacks],
                        verifier=fakes.verify_jittery, log_path=log)
        assert not result.stats.timed_out
        outcomes.append(_outcome(result, log))
    assert all(o == outcomes[0] for o in outcomes[1:])
    candidates, counts, events = outcomes[0]
    assert counts["skipped"]["its first choice was verified"] == 1     # the fallback of a verified candidate
    assert fakes.chain(3.0, 3.0).key in {e[1] for e in events if e[0] == "verified"}   # of a rejected one
    assert fakes.with_exp(fakes.chain(5.0)).key in {e[1] for e in events if e[0] == "rejected"}
    assert counts["skipped"]["candidates of its structure were rejected"] == 1   # x * 7, then exp


@pytest.mark.timeout(60)
def test_the_work_budget_gives_the_same_candidates_at_any_speed():
    slow, fast = (search(fakes.ORIGINAL, SearchConfig(budget_s=60, workers=1, work=700), generators=[fakes.many],
                         verifier=verifier) for verifier in (fakes.verify_slowly, fakes.verify))
    assert [c.graph.key for c in slow.candidates] == [c.graph.key for c in fast.candidates]
    assert slow.stats.counts == fast.stats.counts and slow.stats.by_reason("work") == {"verify": 700}


@pytest.mark.timeout(60)
def test_a_provisional_plan_is_searched_again_and_kept_beside_the_new_candidates(tmp_path):
    cache = PlanCache(tmp_path)
    cut = optimize(fakes.ORIGINAL, SearchConfig(budget_s=1.0, workers=1, work=10**6), cache=cache,
                   generators=[fakes.forever], verifier=fakes.verify)
    assert cut.provisional and "provisional" in str(cut)
    log = tmp_path / "again.jsonl"
    again = optimize(fakes.ORIGINAL, SearchConfig(budget_s=1.0, workers=1, work=10**6), cache=cache,
                     generators=[fakes.forever], verifier=fakes.verify, log_path=log)
    assert any(json.loads(line)["event"] == "start" for line in log.read_text().splitlines())   # searched again
    assert again.provisional
    kept = {c.graph.key for c in (again.chosen, *again.alternatives)}
    assert {c.graph.key for c in (cut.chosen, *cut.alternatives)} <= kept | {fakes.ORIGINAL.key}

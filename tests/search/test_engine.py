"""The search engine with fake generators and verifiers (tests/search/fakes.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import attrs
import pytest

import mdsl
from mdsl import Tensor, f16
from mdsl.search.config import VERIFY_STEPS, SearchConfig
from mdsl.search.engine import search
from tests.search import fakes

QUICK = SearchConfig(budget_s=30, workers=1)
ROOT = Path(__file__).resolve().parents[2]


def keys(result) -> list:
    return [c.graph.key for c in result.candidates]


def events(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(30)
def test_candidates_are_deduplicated_validated_verified_and_ranked_by_cost():
    result = search(fakes.ORIGINAL, QUICK, generators=[fakes.mixed], verifier=fakes.verify)
    assert keys(result) == [fakes.FAST.key, fakes.MIDDLE.key, fakes.ORIGINAL.key]
    costs = [c.cost for c in result.candidates]
    assert costs == sorted(costs)
    stats = result.stats
    assert stats.by_reason("generated") == {"mixed": 8}
    assert stats.total("duplicate") == 2
    assert stats.by_reason("invalid") == {"ShapeError": 1, "signature": 1, "not a kernel graph": 1}
    assert stats.total("verified") == 2
    assert stats.by_reason("rejected") == {"exp changes the values": 1}
    assert stats.best_seconds == result.best.cost.seconds
    assert stats.done and not stats.timed_out


@pytest.mark.timeout(30)
def test_rejected_candidates_are_never_returned():
    result = search(fakes.ORIGINAL, QUICK, generators=[fakes.many], verifier=fakes.verify)
    assert len(result.candidates) == 7  # six without exp, and the original
    assert all(c.evidence.equivalent for c in result.candidates)
    assert not any(n.op == "exp" for c in result.candidates for n in c.graph.nodes)


@pytest.mark.timeout(30)
def test_top_k_keeps_the_best_and_may_drop_the_original():
    result = search(fakes.ORIGINAL, SearchConfig(budget_s=30, workers=1, top_k=2), generators=[fakes.mixed],
                    verifier=fakes.verify)
    assert keys(result) == [fakes.FAST.key, fakes.MIDDLE.key]
    plan = result.plan()
    assert plan.graph == fakes.FAST and [a.graph for a in plan.alternatives] == [fakes.MIDDLE]


@pytest.mark.timeout(30)
def test_without_candidates_the_original_is_the_plan_and_needs_no_verification():
    result = search(fakes.ORIGINAL, QUICK, generators=[], verifier=fakes.verify_broken)
    (only,) = result.candidates
    assert only.graph == fakes.ORIGINAL
    assert only.evidence.is_identity and only.evidence.false_pass_probability == 0.0
    assert only.evidence.seed == QUICK.seed
    assert result.plan().is_original
    assert "nothing to verify" in str(result.plan())


@pytest.mark.timeout(30)
def test_a_verifier_that_raises_rejects_the_candidate_but_not_the_original():
    result = search(fakes.ORIGINAL, QUICK, generators=[fakes.mixed], verifier=fakes.verify_broken)
    assert keys(result) == [fakes.ORIGINAL.key]
    assert result.stats.by_reason("rejected") == {"the verifier raised ValueError: verifier bug": 3}
    assert result.best.evidence.is_identity


@pytest.mark.timeout(30)
def test_a_generator_that_raises_is_reported_and_the_next_one_runs():
    with pytest.warns(UserWarning, match="generator failing raised RuntimeError: generator bug"):
        result = search(fakes.ORIGINAL, QUICK, generators=[fakes.failing, fakes.many], verifier=fakes.verify)
    assert result.stats.by_reason("errors") == {"failing": 1}
    assert result.stats.by_reason("generated") == {"failing": 1, "many": 12}
    assert result.best.graph == fakes.FAST


@pytest.mark.timeout(30)
def test_generators_report_pruning_through_the_stats_hook():
    result = search(fakes.ORIGINAL, QUICK, generators=[fakes.pruning], verifier=fakes.verify)
    assert result.stats.by_reason("pruned") == {"abstract-expression": 5, "shape": 1}
    assert result.stats.by_reason("states") == {"pruning": 40}
    summary = result.stats.summary()
    assert "pruned 6 (abstract-expression 5, shape 1)" in summary and "verified 1, states 40 (pruning 40)" in summary


@pytest.mark.timeout(30)
def test_the_work_budget_stops_an_endless_generator_whatever_the_time():
    fakes.CLOSED.clear()
    config = SearchConfig(budget_s=30, workers=1, top_k=3, work=20 * VERIFY_STEPS)
    result = search(fakes.ORIGINAL, config, generators=[fakes.forever], verifier=fakes.verify)
    assert not result.stats.timed_out and not result.plan().provisional
    assert fakes.CLOSED == [True]
    assert result.stats.by_reason("work") == {"verify": 20 * VERIFY_STEPS}   # 20 candidates admitted, no more
    assert result.stats.by_reason("skipped")["work budget"] == 1
    assert result.best.graph.key == fakes.FAST.key


@pytest.mark.timeout(30)
def test_the_time_cap_stops_an_endless_generator_and_returns_the_best_so_far_as_provisional():
    fakes.CLOSED.clear()
    result = search(fakes.ORIGINAL, SearchConfig(budget_s=1.5, workers=1, top_k=3, work=10**9),
                    generators=[fakes.forever], verifier=fakes.verify)
    assert result.stats.timed_out and result.stats.done and result.plan().provisional
    assert fakes.CLOSED == [True]                  # the engine closed the generator
    assert result.best.graph.key == fakes.FAST.key  # the first candidate, x * 2.0
    assert result.stats.total("skipped") > 0       # most candidates could not reach the top 3


@pytest.mark.timeout(30)
def test_the_budget_stops_a_verification_that_never_ends():
    # a verifier that never returns: only the budget can end this search (pytest-timeout fails a hang)
    result = search(fakes.ORIGINAL, SearchConfig(budget_s=1.0, workers=2), generators=[fakes.mixed],
                    verifier=fakes.verify_never)
    assert result.stats.timed_out
    assert keys(result) == [fakes.ORIGINAL.key]
    assert result.best.evidence.is_identity
    assert result.stats.by_reason("skipped")["budget"] >= 2


@pytest.mark.timeout(30)
def test_ctrl_c_stops_the_workers_and_removes_the_temporary_files(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    log = tmp_path / "search.jsonl"
    with pytest.raises(KeyboardInterrupt):
        search(fakes.ORIGINAL, SearchConfig(budget_s=30, workers=1), generators=[fakes.interrupted],
               verifier=fakes.verify_slowly, log_path=log)
    (worker,) = {e["worker"] for e in events(log) if e["event"] == "verified"}
    assert not _running(worker)   # it was verifying the second candidate: stopped, not waited for
    # (pymp-*: multiprocessing's directory for its forkserver, which serves this process to its end)
    assert [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("pymp-")] == []


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.timeout(30)
def test_earlier_generators_are_verified_first_and_generation_waits_for_busy_workers(tmp_path):
    log = tmp_path / "search.jsonl"
    result = search(fakes.ORIGINAL, SearchConfig(budget_s=30, workers=1), generators=[fakes.costly, fakes.cheap],
                    verifier=fakes.verify_slowly, log_path=log)
    records = events(log)
    verified = [r["key"] for r in records if r["event"] == "verified"]
    costly = [g.key for g in fakes.costly(None, None)]
    assert verified == [*costly, fakes.FAST.key]   # FAST is cheapest, but the first generator's go first
    assert result.best.graph == fakes.FAST
    # while the worker verified, at most one candidate waited: the next one was asked for only after
    # the worker had taken the one before
    order = [r["event"] for r in records if r["event"] in ("candidate", "verified")]
    assert order == ["candidate", "candidate", "verified", "candidate", "verified", "candidate", "verified",
                     "verified"]


@pytest.mark.timeout(60)
def test_results_are_deterministic_across_runs_and_worker_counts():
    slow = fakes.chain(*[1.0] * 9, 2.0)  # every candidate of `many` is cheaper

    def run(workers: int):
        config = SearchConfig(budget_s=30, workers=workers, top_k=4, seed=7)
        return search(slow, config, generators=[fakes.many], verifier=fakes.verify_by_seed)

    first, again, parallel = run(1), run(1), run(2)
    summary = [(c.graph.key, c.cost, c.evidence) for c in first.candidates]
    assert summary == [(c.graph.key, c.cost, c.evidence) for c in again.candidates]
    assert summary == [(c.graph.key, c.cost, c.evidence) for c in parallel.candidates]
    # the seeds make some candidates fail: the outcome depends on them, and they did not change
    assert first.stats.total("rejected") > 0 and len(first.candidates) == 4


@pytest.mark.timeout(30)
def test_workers_are_processes_and_run_in_parallel(tmp_path):
    log = tmp_path / "search.jsonl"
    search(fakes.ORIGINAL, SearchConfig(budget_s=30, workers=2), generators=[fakes.many],
           verifier=fakes.verify_slowly, log_path=log)
    # each verification takes long enough that the second candidate goes to the second worker
    workers = {e["worker"] for e in events(log) if e["event"] in ("verified", "rejected")}
    assert len(workers) == 2 and os.getpid() not in workers


@pytest.mark.timeout(30)
def test_the_log_has_one_json_event_per_line(tmp_path):
    log = tmp_path / "search.jsonl"
    result = search(fakes.ORIGINAL, QUICK, generators=[fakes.mixed], verifier=fakes.verify, log_path=log)
    records = events(log)
    kinds = [r["event"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "done"
    assert {"candidate", "invalid", "verified", "rejected", "new_best"} <= set(kinds)
    assert all(r["kernel"] == "double" and r["t"] >= 0 for r in records)
    bests = [r["key"] for r in records if r["event"] == "new_best"]
    assert bests[0] == fakes.ORIGINAL.key and bests[-1] == fakes.FAST.key
    done = records[-1]
    assert done["kept"] == keys(result) and done["stats"] == result.stats.to_json()
    rejected = next(r for r in records if r["event"] == "rejected")
    assert rejected["key"] == fakes.REJECTED.key and rejected["reason"] == "exp changes the values"
    assert rejected["verify_s"] >= 0 and rejected["cost_s"] > 0


@pytest.mark.timeout(30)
def test_progress_is_reported_until_done():
    seen = []
    search(fakes.ORIGINAL, QUICK, generators=[fakes.mixed], verifier=fakes.verify,
           progress=lambda stats: seen.append((stats.done, stats.total("generated"))))
    assert seen[-1] == (True, 8)
    assert [done for done, _ in seen].count(True) == 1


@pytest.mark.timeout(30)
def test_with_the_real_verifier_a_fused_candidate_is_verified():
    pytest.importorskip("mdsl.passes.verify")

    @mdsl.kernel
    def small(x: Tensor[4, 64, f16], w: Tensor[64, 32, f16]):
        return mdsl.rms_norm(x) @ w

    from mdsl.search import guided

    config = attrs.evolve(QUICK, min_blocks=1, top_k=2)
    result = search(small.graph, config, generators=[guided.generate])
    fused = [c for c in result.candidates if c.graph != small.graph]
    assert fused, "the guided generator's fused graph should verify"
    evidence = fused[0].evidence
    assert evidence.equivalent and evidence.finite_field_tests == QUICK.verify_tests
    assert 0 < evidence.false_pass_probability < 1e-6
    assert evidence.float_rel_error <= evidence.float_bound


@pytest.mark.timeout(60)
def test_a_script_that_searches_at_its_top_level_works_without_a_main_guard(tmp_path):
    # multiprocessing would import the script again in each worker, which would search again there
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""\
        from mdsl.search.config import VERIFY_STEPS, SearchConfig
        from mdsl.search.engine import search
        from tests.search import fakes

        result = search(fakes.ORIGINAL, SearchConfig(budget_s=30, workers=2), generators=[fakes.mixed],
                        verifier=fakes.verify)
        print(result.best.graph == fakes.FAST, result.stats.counts_summary())
        """))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True 8 candidates") and "worker died" not in done.stdout
    assert done.stderr == ""


@pytest.mark.timeout(30)
def test_progress_moves_while_a_generator_works_between_candidates():
    def thorough(graph, config, stats):
        for _ in range(30):
            time.sleep(0.01)
            stats.count("pruned", "slowly")
        yield fakes.FAST

    pruned = []
    search(fakes.ORIGINAL, QUICK, generators=[thorough], verifier=fakes.verify,
           progress=lambda stats: pruned.append(stats.total("pruned")))
    assert any(0 < n < 30 for n in pruned) and pruned[-1] == 30


@pytest.mark.timeout(30)
def test_a_verification_finished_while_a_generator_works_is_kept_when_the_cap_cuts_it():
    # the generator yields one candidate, then works (counting, never yielding) until the cap: the worker
    # verifies the candidate meanwhile, and the cut search's plan is it, not the original
    merged = []

    def grinding(graph, config, stats):
        yield fakes.FAST
        while not stats.out_of_time():
            time.sleep(0.01)
            stats.count("pruned", "slowly")
            merged.append(stats.total("verified"))

    result = search(fakes.ORIGINAL, SearchConfig(budget_s=6, workers=1), generators=[grinding],
                    verifier=fakes.verify)
    assert result.stats.timed_out and result.plan().provisional
    assert result.best.graph.key == fakes.FAST.key and result.stats.total("verified") == 1
    assert merged[0] == 0 and merged[-1] == 1   # merged while the generator worked, before the cap

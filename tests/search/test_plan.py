"""Plans: the printed form a person reads first, and the JSON round trip the cache relies on."""
from __future__ import annotations

import json
import math

import attrs
import pytest

import mdsl
from mdsl.ir.text import parse_graph
from mdsl.search.config import SearchConfig
from mdsl.search.engine import search
from mdsl.search.plan import Plan
from tests.search import fakes

CONFIG = SearchConfig(budget_s=30, workers=1, seed=3, top_k=3)


@pytest.fixture(scope="module")
def plan() -> Plan:
    return search(fakes.ORIGINAL, CONFIG, generators=[fakes.mixed], verifier=fakes.verify).plan()


@pytest.mark.timeout(30)
def test_plan_fields(plan):
    assert plan.original == fakes.ORIGINAL and plan.graph == fakes.FAST and not plan.is_original
    assert plan.cost < plan.original_cost
    assert 0 < plan.floor.seconds < plan.cost.seconds
    assert plan.evidence.equivalent and plan.evidence.finite_field_tests == CONFIG.verify_tests
    assert [a.graph for a in plan.alternatives] == [fakes.MIDDLE, fakes.ORIGINAL]
    assert plan.config == CONFIG and plan.mdsl_version == mdsl.__version__
    assert plan.stats.total("generated") == 8


@pytest.mark.timeout(30)
def test_printed_plan_is_a_commented_header_then_the_mugraph(plan):
    text = str(plan)
    header = text.split("\nkernel ")[0].splitlines()
    assert all(line.startswith("# ") for line in header)
    assert header[0] == f"# mdsl {mdsl.__version__} plan for kernel double, sm_90a: 3x faster than the original (6 us)"
    assert any(line.startswith("# cost:     2.00 us est.") and "1 launch(es)" in line for line in header)
    assert any(line.startswith("# floor:") and "memory-bound" in line and "% of it" in line for line in header)
    assert any(line.startswith("# verified: 3 finite-field tests") for line in header)
    search = next(line for line in header if line.startswith("# search:   finished after"))
    assert "(seed 3): 8 candidates, " in search and ", 3 kept (top_k 3)" in search
    assert "# also:     2 other candidates kept, 4 to 6 us in 2 to 3 launches; the GPU autotuner times them too" \
        in header
    assert parse_graph(text) == plan.graph  # the header is comments: the text parses as the chosen graph


@pytest.mark.timeout(30)
def test_the_header_is_short_and_its_details_are_verbose(plan):
    header = plan.header()
    assert all(len(line) <= 120 for line in header)
    assert not any("duplicate" in line or "(mixed 8)" in line for line in header)   # no breakdown by reason
    verbose = plan.header(verbose=True)
    assert verbose[:len(header)] != header and set(header) <= set(verbose)
    assert any("8 candidates (mixed 8), duplicate 2" in line for line in verbose)
    assert "#           4 us (2 launches), 6 us (3 launches)" in plan.text(verbose=True).splitlines()
    assert parse_graph(plan.text(verbose=True)) == plan.graph


def _alternatives(plan: Plan, costs: list) -> Plan:
    """`plan` with alternatives of these (microseconds, launches), the original's graph and evidence."""
    alternatives = tuple(attrs.evolve(plan.chosen, cost=attrs.evolve(plan.cost, seconds=us * 1e-6, launches=n))
                         for us, n in costs)
    return attrs.evolve(plan, alternatives=alternatives)


@pytest.mark.parametrize("costs, line", [
    ([(13.9, 1)] * 7, "7 other candidates kept, each 13.9 us in 1 launch; the GPU autotuner times them too"),
    ([(13.9, 1), (14.2, 1), (15.9, 2)], "3 other candidates kept, 13.9 to 15.9 us in 1 to 2 launches; the GPU "
                                        "autotuner times them too"),
    ([(15.9, 2)], "1 other candidate kept, 15.9 us in 2 launches; the GPU autotuner times it too"),
])
def test_alternatives_are_summarised_not_listed(plan, costs, line):
    header = _alternatives(plan, costs).header()
    assert f"also:     {line}" in header
    verbose = _alternatives(plan, costs).header(verbose=True)
    groups = verbose[verbose.index(f"also:     {line}") + 1]
    assert groups.count(" us (") == len(set(costs))


@pytest.mark.timeout(30)
def test_json_round_trip(plan):
    data = plan.to_json()
    text = json.dumps(data, allow_nan=False)  # strict JSON
    again = Plan.from_json(json.loads(text))
    assert again == plan
    assert str(again) == str(plan)


@pytest.mark.timeout(30)
def test_json_round_trip_of_a_plan_stopped_by_its_budget():
    plan = search(fakes.ORIGINAL, SearchConfig(budget_s=0.5, workers=1), generators=[fakes.mixed],
                  verifier=fakes.verify_never).plan()
    assert math.isnan(plan.evidence.float_rel_error)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json(), allow_nan=False)))
    assert math.isnan(again.evidence.float_rel_error)
    assert attrs.evolve(again, evidence=plan.evidence) == plan
    assert "# verified: the original program itself: nothing to verify" in str(plan)
    assert "stopped by its 0.5 s budget" in str(plan)


def test_an_unknown_schema_is_refused(plan):
    data = {**plan.to_json(), "mdsl_plan": 99}
    with pytest.raises(ValueError, match="unsupported plan schema 99"):
        Plan.from_json(data)

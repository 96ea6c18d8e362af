"""A plan's candidates in their final order: the fused ones by the finer GPU model (`cost.gpu_estimate`),
which tells apart what `estimate` ranks alike, the program as written last."""
from __future__ import annotations

import itertools
import math

from mdsl.search.config import SearchConfig
from mdsl.search.cost import estimate, gpu_estimate
from mdsl.search.engine import in_final_order
from mdsl.search.guided import generate
from mdsl.search.plan import Candidate, Evidence
from tests.examples_util import load_example

EVIDENCE = Evidence(True, "a stand-in", 0, 0.0, math.nan, math.nan, 0)


def _candidate(graph) -> Candidate:
    return Candidate(graph, estimate(graph), EVIDENCE)


def test_candidates_estimate_ranks_alike_go_by_the_finer_model_and_the_original_last():
    original = load_example("gqa").make_gqa(1).graph
    guided = [g for g in itertools.islice(generate(original, SearchConfig()), 40)]
    by_estimate: dict = {}
    for graph in guided:
        by_estimate.setdefault(round(estimate(graph).seconds, 12), []).append(graph)
    alike = max(by_estimate.values(), key=len)   # one structure under other loop lengths and splits
    finer = [gpu_estimate(g, skinny=True).seconds for g in alike]
    assert len(alike) >= 3 and len(set(finer)) > 1, "the guided generator gives no candidates estimate ranks alike"
    kept = [_candidate(original)] + [_candidate(g) for g in alike]   # the original first, as a worst case
    ordered = in_final_order(kept, original.key)
    assert ordered[-1].graph.key == original.key
    seconds = [gpu_estimate(c.graph, skinny=True).seconds for c in ordered[:-1]]
    assert seconds == sorted(seconds) and {c.graph.key for c in ordered} == {c.graph.key for c in kept}
    assert in_final_order([kept[0]], original.key) == (kept[0],)   # only the original: it is the plan

"""Shape families (mdsl/search/family.py): a plan searched at one size of the leading dim serves the
others it re-targets to, each lowered and verified at its own size, without a search."""
from __future__ import annotations

import json

import attrs
import pytest

import mdsl
from mdsl import Tensor, f16
from mdsl.search.cache import PlanCache
from mdsl.search.config import SearchConfig
from mdsl.search.engine import optimize, search
from mdsl.search.family import family_of, retarget

CONFIG = SearchConfig(budget_s=60, workers=1, exhaustive=False, min_blocks=1, work=2000)


def layer(rows: int, hidden: int = 64):
    @mdsl.kernel(name="layer")
    def program(x: Tensor[rows, hidden, f16], w: Tensor[hidden, 32, f16], b: Tensor[1, 32, f16]):
        return mdsl.silu(mdsl.rms_norm(x) @ w + b) * 2.0
    return program.graph


def events(path) -> list:
    return [json.loads(line)["event"] for line in path.read_text().splitlines()]


@pytest.mark.timeout(120)
def test_a_plan_serves_the_other_sizes_of_its_leading_dim_without_a_search(tmp_path):
    cache = PlanCache(tmp_path / "cache")
    searched = optimize(layer(8), CONFIG, cache=cache)
    family = searched.family
    assert family is not None and family.dim == "dim 0 of %x" and family.size == 8 and family.source is None
    assert 16 in family.sizes and 32 in family.sizes and "family:" in str(searched)
    log = tmp_path / "sixteen.jsonl"
    member = optimize(layer(16), CONFIG, cache=cache, log_path=log)
    assert events(log) == ["family_hit"]                        # no search
    assert member.family.source == 8 and member.family.size == 16
    assert member.original == layer(16) and member.cost.launches == searched.cost.launches
    assert member.evidence.equivalent and member.evidence.finite_field_tests == CONFIG.verify_tests
    def x_tile(plan):
        return next(n.body.inputs[0].var.shape for n in plan.graph.nodes if n.body is not None)

    assert x_tile(member)[0] == 2 * x_tile(searched)[0]          # each block's rows doubled, the grid kept
    again = optimize(layer(16), CONFIG, cache=cache)            # now stored under its own key
    assert again.cache_path is not None and again.graph == member.graph


@pytest.mark.timeout(120)
def test_sizes_the_plan_does_not_cover_and_other_programs_are_searched(tmp_path):
    cache = PlanCache(tmp_path / "cache")
    searched = optimize(layer(8), CONFIG, cache=cache)
    odd = [s for s in (3, 5, 7) if s not in searched.family.sizes]
    assert odd                                                  # a grid over the rows needs them to divide
    log = tmp_path / "other.jsonl"
    optimize(layer(8, hidden=128), CONFIG, cache=cache, log_path=log)   # the same structure, another hidden size
    assert "start" in events(log) and "family_hit" not in events(log)
    assert retarget(searched, layer(8, hidden=128)) is None   # the same structure, not the same program


def test_a_plan_without_a_leading_dim_has_no_family():
    @mdsl.kernel
    def columns(x: Tensor[8, 64, f16]):
        return mdsl.transpose(mdsl.silu(x), 0, 1)

    plan = optimize(columns.graph, CONFIG, cache=False)
    assert plan.family is None and retarget(plan, columns.graph) is None


@pytest.mark.timeout(120)
def test_a_bad_family_index_warns_and_the_size_is_searched(tmp_path):
    cache = PlanCache(tmp_path / "cache")
    optimize(layer(8), CONFIG, cache=cache)
    (index,) = (tmp_path / "cache" / "families").iterdir()
    index.write_text('{"mdsl_plan_family": 2, "family": "x", "keys": ["../../etc"]}')
    log = tmp_path / "sixteen.jsonl"
    with pytest.warns(UserWarning, match="ignoring the plan cache entry .*not a family index"):
        plan = optimize(layer(16), CONFIG, cache=cache, log_path=log)
    assert "start" in events(log) and plan.family.source is None
    assert json.loads(index.read_text())["keys"] == [cache.key(layer(16), CONFIG, {"generators": "default",
                                                                                  "verifier": "default"})]


def test_coverage_is_what_resizes_validates_and_lowers():
    plan = optimize(layer(8), CONFIG, cache=False)
    family = family_of(plan, sizes=(1, 4, 8, 12, 64))
    assert 8 not in family.sizes and set(family.sizes) <= {1, 4, 12, 64}
    assert family_of(attrs.evolve(plan, graph=plan.original), sizes=(3, 5)).sizes == (3, 5)   # unfused: any size


def test_attention_re_targets_to_more_heads_through_its_rescaling_accumulators():
    from tests.examples_util import load_example
    from tests.search import fakes

    graph = load_example("gqa").make_gqa(1, kv_len=256, queries=16, head_dim=16).graph   # 2 kv heads
    plan = search(graph, attrs.evolve(CONFIG, top_k=2), generators=[guided_first], verifier=fakes.verify).plan()
    assert not plan.is_original and any(n.op == "accum_rescale" for k in plan.graph.nodes if k.body
                                        for n in k.body.nodes)
    assert {4, 8, 16} <= set(family_of(plan).sizes)


def guided_first(graph, config):
    """The guided generator's cheapest candidate with online softmax (its loop walks the keys)."""
    from mdsl.search.guided import generate

    yield next(c for c in generate(graph, config) if any(n.op == "accum_rescale" for k in c.nodes if k.body
                                                          for n in k.body.nodes))

"""Tuning variants of a plan (mdsl.search.variants): proposed from the widened guided space, ranked by
the GPU-aware estimate, verified through the engine, stored beside the plan and validated when read."""
from __future__ import annotations

import json
import warnings
import math

import attrs
import numpy as np
import pytest

from mdsl.backend.reference import run_kernel_graph
from mdsl.search import variants as V
from mdsl.search.config import SearchConfig
from mdsl.search.cost import H200, gpu_estimate
from mdsl.search.dims import Labels
from mdsl.search.guided import Choice, choices, lift
from mdsl.search.plan import content_digest
from tests.examples_util import load_example
from tests.search.small_plans import small_plan


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    """A small attention plan with its verified variants stored (one search, one verification run)."""
    plan, cache = small_plan("gqa", tmp_path_factory.mktemp("plans"))
    found = V.ensure_variants(plan, 4, cache=cache, workers=1)
    return plan, cache, found


# ---- proposing and verifying -----------------------------------------------------------------

@pytest.mark.timeout(240)
def test_variants_are_verified_and_compute_the_program(gqa):
    plan, _, found = gqa
    assert 1 <= len(found) <= 4
    plan_keys = {plan.graph.key} | {c.graph.key for c in plan.alternatives}
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(v.shape) for v in plan.original.inputs]
    want = run_kernel_graph(plan.original, inputs, precision="float64")
    for v in found:
        e = v.candidate.evidence
        assert e.equivalent and e.finite_field_tests == plan.config.verify_tests and e.seed == plan.config.seed
        assert not math.isnan(e.float_rel_error) and e.float_rel_error <= e.float_bound
        assert v.candidate.graph.key not in plan_keys
        assert V.structure(v.candidate.graph) == V.structure(plan.graph)
        got = run_kernel_graph(v.candidate.graph, inputs, precision="float64")
        for a, b in zip(got, want):
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-10, v.describe
    assert len({v.candidate.graph.key for v in found}) == len(found)
    assert [v.gpu_seconds for v in found] == sorted(v.gpu_seconds for v in found)


def test_a_variant_the_verifier_rejects_is_not_kept(gqa):
    plan = gqa[0]
    proposals = V.propose(plan, 2)
    wrong = attrs.evolve(proposals[0], graph=_with_output_scaled(proposals[0].graph))
    kept = V.verify(plan, [wrong, proposals[1]], workers=1)
    assert [v.candidate.graph.key for v in kept] == [proposals[1].graph.key]


def _with_output_scaled(graph):
    """The graph with its last kernel's output cast replaced by a mul_scalar: another function."""
    from mdsl.ir.graph import Node
    from mdsl.ir.ops import get_op

    last = graph.nodes[-1]
    body = last.body
    out = body.outputs[0]
    scaled = attrs.evolve(out.var, name=out.var.name + "_x2")
    node = Node("mul_scalar", [out.var], [scaled], get_op("mul_scalar").normalize_attrs({"value": 2.0}))
    body = attrs.evolve(body, nodes=tuple(body.nodes) + (node,),
                        outputs=(attrs.evolve(out, var=scaled),) + tuple(body.outputs[1:]))
    return attrs.evolve(graph, nodes=tuple(graph.nodes[:-1]) + (attrs.evolve(last, body=body),))


# ---- the cache entry ---------------------------------------------------------------------------

def test_the_entry_round_trips_and_is_not_verified_again(gqa, monkeypatch):
    plan, cache, found = gqa
    assert V.load(cache, plan) == (found, 4, True)
    monkeypatch.setattr(V, "verify_all", _must_not_run)
    assert V.ensure_variants(plan, 4, cache=cache) == found
    assert V.ensure_variants(plan, 2, cache=cache) == found[:2]
    own = [plan.chosen, *plan.alternatives]
    got = V.tuning_candidates(plan, 8, cache=cache)
    assert got == own + [v.candidate for v in found]
    assert V.tuning_candidates(plan, 1, variants=1, cache=cache) == [plan.chosen, found[0].candidate]
    assert [p.name for p in V.entry_path(cache, V.plan_key(plan)).parent.iterdir()] == \
        [f"{V.plan_key(plan)}.json"]  # no temp file left


@pytest.fixture
def stubbed_verification(gqa, monkeypatch):
    """verify_all replaced by one that records its calls and keeps the first variant; the cached entry
    restored afterwards."""
    plan, cache, found = gqa
    path = V.entry_path(cache, V.plan_key(plan))
    good = path.read_text()
    calls = []

    def verify_all(*args, **kwargs):
        calls.append(args)
        return found[:1], True

    monkeypatch.setattr(V, "verify_all", verify_all)
    yield calls
    path.write_text(good)


def test_an_entry_whose_verification_ran_out_of_time_is_read_but_verified_again(gqa, stubbed_verification):
    plan, cache, found = gqa
    V.store(cache, plan, found[:2], 4, complete=False)
    assert V.load(cache, plan) == (found[:2], 4, False)
    assert V.tuning_candidates(plan, 8, cache=cache)[-2:] == [v.candidate for v in found[:2]]
    assert not stubbed_verification   # reading the entry verifies nothing
    assert V.ensure_variants(plan, 4, cache=cache) == found[:1] and len(stubbed_verification) == 1
    assert V.load(cache, plan) == (found[:1], 4, True)


def test_refresh_proposes_and_verifies_again_despite_a_complete_entry(gqa, stubbed_verification):
    plan, cache, found = gqa
    assert V.ensure_variants(plan, 4, cache=cache, refresh=True) == found[:1] and len(stubbed_verification) == 1
    assert V.load(cache, plan) == (found[:1], 4, True)


def _must_not_run(*args, **kwargs):
    raise AssertionError("verified again although the cache holds the variants")


DAMAGES = {
    "not json": lambda e: "{truncated",
    "schema": lambda e: {**e, "mdsl_plan_variants": 99},
    "another plan": lambda e: {**e, "plan_key": "0" * 64},
    "another chosen graph": lambda e: {**e, "plan_graph_key": "x"},
    "limit": lambda e: {**e, "limit": -1},
    "complete": lambda e: {**e, "complete": "yes"},
    "too many": lambda e: {**e, "limit": 0},
    "not verified": lambda e: _each_variant(e, lambda v: {**v, "evidence": {**v["evidence"], "equivalent": False}}),
    "other seed": lambda e: _each_variant(e, lambda v: {**v, "evidence": {**v["evidence"], "seed": 1}}),
    "cost": lambda e: _each_variant(e, lambda v: {**v, "cost": {**v["cost"], "seconds": 1.0}}),
    "estimate": lambda e: _each_variant(e, lambda v: {**v, "gpu_seconds": -1.0}),
    "graph": lambda e: _each_variant(e, lambda v: {**v, "graph": {"kind": "nonsense"}}),
}


def _each_variant(entry, change):
    return {**entry, "variants": [change(v) for v in entry["variants"]]}


_SWAPS = {"div": "mul", "mul": "add"}   # in this order: (x - max) -> (x + max) would be a softmax's own shift


def _swap_an_operator(value):
    """The graph JSON `value` with one arithmetic operator replaced by another of the same shapes (what a bug, a
    half-synced file or an edit could leave): the first div, else the first mul, anywhere in its nesting."""
    for old, new in _SWAPS.items():
        done = []

        def walk(v):
            if isinstance(v, dict):
                if not done and v.get("op") == old:
                    done.append(old)
                    return {**v, "op": new}
                return {k: walk(x) for k, x in v.items()}
            if isinstance(v, list):
                return [walk(x) for x in v]
            return v

        out = walk(value)
        if done:
            return out
    raise AssertionError("the variant has no div or mul to change")


#: changes whose digest is recomputed: each is caught by the check of its own kind, not by the digest
SEALED = {**DAMAGES, "an operator": lambda e: {**e, "variants": [{**e["variants"][0], "graph": _swap_an_operator(
    e["variants"][0]["graph"])}, *e["variants"][1:]]}}
SEALED.pop("not json")
SEALED.pop("cost")   # derived data: re-priced on read, not refused


def test_a_variants_stored_cost_is_re_priced(gqa):
    """A variant's cost written by another cost model (its digest recomputed) is replaced by this mdsl's
    estimate: the variants are served, each as the cost model prices it."""
    plan, cache, found = gqa
    path = V.entry_path(cache, V.plan_key(plan))
    good = path.read_text()
    try:
        path.write_text(json.dumps(_sealed(DAMAGES["cost"](json.loads(good)))))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert V.load(cache, plan) == (found, 4, True)
    finally:
        path.write_text(good)


def _sealed(entry: dict) -> dict:
    entry = {k: v for k, v in entry.items() if k != "digest"}
    return {**entry, "digest": content_digest(entry)}


@pytest.mark.parametrize("damage", sorted(SEALED))
def test_a_changed_entry_with_its_digest_recomputed_is_not_served(gqa, damage):
    plan, cache, found = gqa
    path = V.entry_path(cache, V.plan_key(plan))
    good = path.read_text()
    try:
        path.write_text(json.dumps(_sealed(SEALED[damage](json.loads(good)))))
        why = "fails a re-check" if damage == "an operator" else "ignoring the variants entry"
        with pytest.warns(UserWarning, match=why):
            assert V.load(cache, plan) is None
    finally:
        path.write_text(good)
    assert V.load(cache, plan) == (found, 4, True)


def test_an_entry_changed_after_it_was_written_fails_its_digest(gqa):
    plan, cache, found = gqa
    path = V.entry_path(cache, V.plan_key(plan))
    good = path.read_text()
    try:
        entry = json.loads(good)
        path.write_text(json.dumps({**entry, "limit": entry["limit"] + 1}))
        with pytest.warns(UserWarning, match="content digest"):
            assert V.load(cache, plan) is None
    finally:
        path.write_text(good)


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_entry_is_ignored_with_a_warning(gqa, damage, tmp_path):
    plan, cache, found = gqa
    path = V.entry_path(cache, V.plan_key(plan))
    good = path.read_text()
    try:
        damaged = DAMAGES[damage](json.loads(good))
        path.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
        with pytest.warns(UserWarning, match="ignoring the variants entry"):
            assert V.load(cache, plan) is None
        with pytest.warns(UserWarning, match="ignoring the variants entry"):
            assert V.tuning_candidates(plan, 8, cache=cache) == [plan.chosen, *plan.alternatives]
    finally:
        path.write_text(good)
    assert V.load(cache, plan) == (found, 4, True)


def test_a_plan_not_read_from_the_cache_has_no_entry(gqa):
    plan, cache, _ = gqa
    fresh = attrs.evolve(plan, cache_path=None)
    assert V.load(cache, fresh) is None and V.store(cache, fresh, [], 4) is None
    assert V.tuning_candidates(fresh, 8, cache=cache) == [plan.chosen, *plan.alternatives]


# ---- the widened space and the ranking ---------------------------------------------------------

def test_the_default_choice_space_is_unchanged_and_the_widened_one_contains_it():
    graph = load_example("gqa").make_gqa(1).graph
    labels, config = Labels(graph), SearchConfig()
    default = list(choices(graph, labels, config))
    widened = set(choices(graph, labels, config, max_split=256, min_forloop=1))
    assert set(default) <= widened
    assert max(c.split for c in default) == 64 and min(c.forloop for c in default if c.loop) >= 2
    assert max(c.split for c in widened) == 256 and any(c.loop and c.forloop == 1 for c in widened)
    assert {c.threads for c in default} == {128}


def _gqa_bs1(row_parts: int, split: int, forloop: int):
    graph = load_example("gqa").make_gqa(1).graph
    labels = Labels(graph)
    q = graph.inputs[0]
    batch, rows = labels.label(q.name, 0), labels.label(q.name, 1)
    kv = labels.label(graph.inputs[1].name, 2)
    return lift(graph, Choice(((batch, 2), (rows, row_parts)), kv, forloop, split), labels)


def test_the_ranking_prefers_attention_grids_that_fill_the_sms_with_few_iterations():
    searched = gpu_estimate(_gqa_bs1(8, 4, 32))   # the search's plan: 64 blocks x 32 iterations
    wide = gpu_estimate(_gqa_bs1(8, 8, 4))         # 128 blocks x 4 iterations
    (main, _) = searched.kernels
    assert (main.blocks, main.iterations, main.per_sm, main.rounds) == (64, 32, 1, 1)
    assert main.fill == pytest.approx(64 / H200.sms)
    assert wide.kernels[0].blocks == 128 and wide.kernels[0].fill > 0.95
    assert wide.seconds < searched.seconds / 2


def test_the_ranking_prefers_a_memory_bound_grid_that_fills_the_sms():
    graph = load_example("rms_norm_linear").make_rms_norm_linear(1).graph
    labels = Labels(graph)
    w = graph.inputs[1]
    columns, k = labels.label(w.name, 1), labels.label(w.name, 0)
    thin, full = (gpu_estimate(lift(graph, Choice(((columns, parts),), k, 8), labels)) for parts in (32, 128))
    assert thin.kernels[0].fill < 0.25 < 0.95 < full.kernels[0].fill
    assert full.seconds < thin.seconds
    # a second wave of a few blocks: 192 blocks run as 2 per SM on 60 SMs
    uneven = gpu_estimate(lift(graph, Choice(((columns, 192),), k, 8), labels)).kernels[0]
    assert uneven.per_sm == 2 and uneven.fill == pytest.approx(192 / 264)


def test_shared_memory_limits_the_blocks_resident_per_sm():
    large = gpu_estimate(_gqa_bs1(8, 4, 2)).kernels[0]   # 512-long K and V tiles: one block per SM
    small = gpu_estimate(_gqa_bs1(8, 4, 32)).kernels[0]
    assert large.smem_bytes > H200.smem_per_sm // 2 and large.resident == 1
    assert small.resident > 1


def test_diverse_spreads_the_picks_over_grids():
    def p(blocks, split, seconds):
        return V.Proposal(None, f"{blocks}/{split}/{seconds}", ((blocks,), split), seconds)

    ranked = sorted([p(128, 4, 1.0), p(128, 4, 1.1), p(128, 4, 1.2), p(128, 4, 1.3), p(256, 8, 2.0),
                     p(256, 8, 2.1), p(64, 2, 3.0), p(32, 2, 4.0)], key=lambda x: x.gpu_seconds)
    got = [x.gpu_seconds for x in V.diverse(ranked, 4)]
    assert got == [1.0, 1.1, 2.0, 2.1]
    assert [x.gpu_seconds for x in V.diverse(ranked, 7)] == [1.0, 1.1, 1.2, 2.0, 2.1, 3.0, 4.0]
    assert len(V.diverse(ranked, 20)) == len(ranked)


def test_long_loop_tiles_are_refused_only_where_they_live_in_registers():
    space = V.VariantSpace()
    attention = load_example("gqa").make_gqa(1).graph
    labels = Labels(attention)
    keys = labels.label(attention.inputs[1].name, 2)
    resident = V._register_resident_labels(attention, labels)
    assert keys in resident   # the scores Q·K are laid out along the keys
    long_tile, short_tile = (Choice((), keys, forloop, 4) for forloop in (2, 8))   # 512 and 128 keys
    assert not V._fits(long_tile, labels, space, resident) and V._fits(short_tile, labels, space, resident)

    gemv = load_example("rms_norm_linear").make_rms_norm_linear(1).graph
    labels = Labels(gemv)
    k = labels.label(gemv.inputs[1].name, 0)
    resident = V._register_resident_labels(gemv, labels)
    assert k not in resident   # k is only contracted
    assert V._fits(Choice((), k, 8), labels, space, resident)   # 512-long k tiles


# ---- split-K for RMSNorm+Linear and the register term --------------------------------------------

@pytest.fixture(scope="module")
def rnl(tmp_path_factory):
    """An RMSNorm+Linear plan whose kernel loops over k, as the benchmark's (k 1024, 768 columns)."""
    from mdsl.search.cache import PlanCache
    from mdsl.search.engine import cached_plan, optimize
    from tests.search.small_plans import CONFIG

    graph = load_example("rms_norm_linear").make_rms_norm_linear(1, k=1024, n=768).graph
    labels = Labels(graph)
    columns, k = labels.label(graph.outputs[0].name, 1), labels.label(graph.inputs[0].name, 1)
    looped = lift(graph, Choice(((columns, 24),), k, 8), labels)
    cache = PlanCache(tmp_path_factory.mktemp("plans"))

    def generate(g, config):
        yield looped

    optimize(graph, CONFIG, cache=cache, generators=[generate])
    return cached_plan(graph, CONFIG, cache=cache, generators=[generate]), cache


@pytest.mark.timeout(240)
def test_rms_norm_linear_variants_include_verified_split_k_ones(rnl):
    plan, cache = rnl
    proposals = V.propose(plan, 8)
    split = [p for p in proposals if p.group[1] > 1]
    unsplit = [p for p in proposals if p.group[1] == 1]
    assert len(split) == 4 and len(unsplit) == 4, [p.describe for p in proposals]
    assert all(len(bodies(p.graph)) == 2 and "sqrt" in {n.op for n in bodies(p.graph)[1].nodes} for p in split)
    kept = V.verify(plan, split[:2] + unsplit[:1], workers=1)
    assert [v.candidate.graph.key for v in kept] == [p.graph.key for p in split[:2] + unsplit[:1]]
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(v.shape) for v in plan.original.inputs]
    (want,) = run_kernel_graph(plan.original, inputs, precision="float64")
    for v in kept:
        (got,) = run_kernel_graph(v.candidate.graph, inputs, precision="float64")
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-10, v.describe


def bodies(graph):
    return [n.body for n in graph.nodes if n.body is not None]


def test_split_proposals_of_the_preferred_shapes_come_first_one_per_split_factor():
    def proposal(blocks, split, seconds, preferred=True):
        return V.Proposal(None, f"{blocks}/{split}/{seconds}", ((blocks,), split), seconds, preferred)

    ranked = [proposal(64, 1, 1.0), proposal(512, 8, 1.5, preferred=False), proposal(256, 4, 2.0),
              proposal(128, 4, 2.05), proposal(256, 4, 2.1), proposal(384, 8, 2.2), proposal(128, 1, 2.3),
              proposal(128, 1, 2.4), proposal(96, 1, 2.5), proposal(264, 2, 3.0)]
    picked = [p.describe for p in V.diverse(ranked, 6)]
    assert picked == ["64/1/1.0", "256/4/2.0", "384/8/2.2", "128/1/2.3", "128/1/2.4", "264/2/3.0"]
    only_split = [p for p in ranked if p.group[1] > 1]
    assert [p.describe for p in V.diverse(only_split, 2)] == ["512/8/1.5", "256/4/2.0"]  # as before: by rank


def test_the_register_term_counts_row_resident_tiles_and_ranks_spills_last():
    from mdsl.search.cost import estimate_registers

    narrow, wide = _gqa_bs1(16, 4, 16), _gqa_bs1(16, 4, 8)      # 64 and 128 keys an iteration
    tall = _gqa_bs1(2, 4, 16)                                   # 128 rows a block: 2 row tiles a warp
    regs = [estimate_registers(bodies(g)[0]) for g in (narrow, wide, tall)]
    assert regs[0] < regs[1] <= H200.max_registers_per_thread < regs[2]
    assert estimate_registers(bodies(narrow)[1]) < 100         # the combine keeps nothing in registers
    fit = gpu_estimate(tall).kernels[0]
    assert fit.registers == regs[2]
    compiled_fit = gpu_estimate(tall, registers=lambda index: 128).kernels[0]   # as if ptxas had fitted it
    assert compiled_fit.registers == 128
    assert compiled_fit.compute_s < fit.compute_s and compiled_fit.seconds < fit.seconds   # no spill traffic


def test_a_compiled_register_count_limits_the_blocks_resident_per_sm():
    graph = load_example("rms_norm_linear").make_rms_norm_linear(1).graph
    labels = Labels(graph)
    w = graph.inputs[1]
    columns, k = labels.label(w.name, 1), labels.label(w.name, 0)
    candidate = lift(graph, Choice(((columns, 512),), k, 32), labels)   # small tiles: several blocks an SM
    few, many = (gpu_estimate(candidate, registers=lambda index, r=r: r).kernels[0] for r in (64, 255))
    assert few.resident == 8 and many.resident == H200.registers_per_sm // (256 * 128) == 2
    assert gpu_estimate(candidate, registers=lambda index: 255).seconds > gpu_estimate(candidate).seconds


def test_the_estimate_of_a_skinny_loop_split_over_clusters():
    from mdsl.ir.skinny import skinny_shape
    from mdsl.search.cost import _skinny_cluster_fit

    graph = load_example("rms_norm_linear").make_rms_norm_linear(8).graph
    labels = Labels(graph)
    w = graph.inputs[1]
    wide = lift(graph, Choice(((labels.label(w.name, 1), 96),), labels.label(w.name, 0), 32), labels)
    node = wide.custom_nodes()[0]
    alone, clustered = (_skinny_cluster_fit(node, skinny_shape(node.body), c, H200) for c in (1, 4))
    # 96 blocks leave 36 SMs idle; in clusters of 4, 384 blocks (3 on most SMs) each stream a quarter of the K
    assert (alone.blocks, alone.per_sm, alone.cluster, clustered.blocks, clustered.per_sm) == (96, 1, 1, 384, 3)
    # clusters are slower on the H200 (docs/tried-kernels.md): the estimate considers only mdsl.ir.skinny.CLUSTERS
    assert gpu_estimate(wide, skinny=True).kernels[0] == alone


def test_a_prologue_reading_a_vector_along_k_is_estimated_as_a_skinny_loop():
    """(x - b) @ w at 4 rows, b [1, K]: each of the guided generator's first candidates (split-K, `sub` in the
    split's loop) runs its first kernel as a skinny loop by the estimate, faster than as a tile loop."""
    import itertools

    import mdsl
    from mdsl import Tensor, f16
    from mdsl.search.guided import generate

    @mdsl.kernel(name="sub_matmul")
    def program(x: Tensor[4, 8192, f16], b: Tensor[1, 8192, f16], w: Tensor[8192, 2048, f16]):
        return (x - b) @ w

    candidates = list(itertools.islice(generate(program.graph, SearchConfig()), 8))
    assert candidates
    for graph in candidates:
        assert "sub" in {n.op for n in graph.custom_nodes()[0].body.nodes}
        skinny, tile = gpu_estimate(graph, skinny=True), gpu_estimate(graph)
        assert skinny.kernels[0].lowering == "skinny" and skinny.seconds < tile.seconds, skinny.describe()


def test_the_estimate_models_the_skinny_loop_where_asked_by_its_bytes_in_flight():
    from mdsl.ir.skinny import skinny_shape

    graph = load_example("rms_norm_linear").make_rms_norm_linear(8).graph
    labels = Labels(graph)
    w = graph.inputs[1]
    columns, k = labels.label(w.name, 1), labels.label(w.name, 0)
    narrow, wide = (lift(graph, Choice(((columns, parts),), k, 32), labels) for parts in (192, 96))  # 32, 64 columns
    tile = gpu_estimate(narrow).kernels[0]
    assert tile.lowering == "tile"
    fits = [gpu_estimate(g, skinny=True).kernels[0] for g in (narrow, wide)]
    assert [f.lowering for f in fits] == ["skinny", "skinny"]
    for g, fit in zip((narrow, wide), fits):
        body = g.custom_nodes()[0].body
        assert fit.in_flight_per_sm == min(fit.per_sm, fit.resident) * skinny_shape(body).loads_in_flight(body.threads // 32)
        assert fit.iterations == 1 and fit.latency_s < tile.latency_s   # no barrier chain in the loop
    # 192 blocks of 32 columns: two on most SMs, each with as many bytes in flight as one of 64 columns
    assert [(f.cluster, f.blocks, f.per_sm) for f in fits] == [(1, 192, 2), (1, 96, 1)]
    assert fits[0].in_flight_per_sm == 2 * fits[1].in_flight_per_sm
    attention = gpu_estimate(_gqa_bs1(8, 4, 32), skinny=True)
    assert {f.lowering for f in attention.kernels} == {"tile"}    # not a weight stream


def test_every_combine_width_of_every_gqa_choice_lifts_or_cannot_lift():
    """A wider combining kernel whose operators also read, along the refined dim, a value the refinement
    does not split (gqa's split-KV combine) is no candidate (CannotLift), never a shape error that ends
    the proposing."""
    from mdsl.search.config import SearchConfig
    from mdsl.search.guided import CannotLift

    graph = load_example("gqa").make_gqa(1).graph
    labels = Labels(graph)
    lifted = refused = 0
    for choice in choices(graph, labels, SearchConfig(), max_split=64, min_forloop=1):
        if choice.split < 2:
            continue
        for wider in (2, 4):
            try:
                lift(graph, attrs.evolve(choice, combine_parts=wider), labels)
                lifted += 1
            except CannotLift:
                refused += 1
    assert lifted and refused

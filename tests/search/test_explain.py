"""`Plan.explain()` and `mdsl optimize --explain`: why each kernel boundary left in a plan is there,
recorded during the search and stored with the plan."""
from __future__ import annotations

import attrs
import pytest

import mdsl
from mdsl import Tensor, f16, f32
from mdsl.cli import main
from mdsl.search import partition
from mdsl.search.cache import PlanCache
from mdsl.search.config import SearchConfig
from mdsl.search.dims import Labels
from mdsl.search.engine import optimize, search
from mdsl.search.explain import boundaries
from mdsl.search.guided import Choice, lift
from mdsl.search.stats import SearchStats
from tests.search import fakes

CONFIG = SearchConfig(budget_s=60, workers=1, exhaustive=False, min_blocks=1)


def _layout():
    @mdsl.kernel
    def layout(x: Tensor[8, 64, f16], w: Tensor[64, 32, f16]):
        a, b = mdsl.split(mdsl.rms_norm(x @ w), [16, 16], dim=-1)   # a split of a norm's row: no block rule
        return mdsl.silu(a) * b
    return layout.graph


def _whole_row():
    @mdsl.kernel
    def centred(x: Tensor[4, 131072, f32]):
        return x - mdsl.mean(x, dim=-1, keepdim=True)   # 512 KB a row: no block holds one
    return centred.graph


@pytest.mark.timeout(60)
def test_a_layout_change_is_a_boundary_of_its_own():
    plan = search(_layout(), CONFIG).plan()
    text = plan.explain()
    assert f"{plan.cost.launches} kernel(s), where the original launches {plan.original_cost.launches}" in text
    assert len(plan.explanation) == plan.cost.launches - 1 >= 1
    assert all("split %split is a layout change without a block-level rule" in b.reason
               for b in plan.explanation)
    assert any("%rms_norm" in b.tensors for b in plan.explanation)


@pytest.mark.timeout(120)
def test_a_weight_stored_out_in_leaves_no_boundary():
    """A product of an input stored [out, in] (torch.nn.Linear's layout) read through a transpose fuses with the
    norm before it, as the same weight stored [in, out] does: the block reads its tiles as stored."""
    @mdsl.kernel
    def linear_t(x: Tensor[4, 256, f16], w: Tensor[64, 256, f16]):
        return mdsl.rms_norm(x) @ mdsl.transpose(w, 0, 1)

    plan = search(linear_t.graph, CONFIG).plan()
    assert plan.cost.launches == 1 and plan.explanation == ()


@pytest.mark.timeout(60)
def test_a_split_that_still_copies_says_what_and_why():
    """A split's part that is a result is copied (mdsl.lowering.views); the boundary says so, also where the split
    is at the boundary of a fused part (its other part read in place by the part's kernel); a split whose parts
    are all read in place is no boundary at all."""
    @mdsl.kernel
    def parts(x: Tensor[8, 256, f16], w: Tensor[128, 64, f16]):
        a, b = mdsl.split(x, [128, 128], dim=-1)
        return a, b @ w, mdsl.rms_norm(x)

    plan = search(parts.graph, CONFIG).plan()
    assert plan.cost.launches == 2 < plan.original_cost.launches
    said = [b.reason for b in plan.explanation if "split %split copies" in b.reason]
    assert len(said) == len(plan.explanation) == 1
    assert "%split (a result of the program)" in said[0] and "%split_1" not in said[0]

    @mdsl.kernel
    def in_place(x: Tensor[8, 256, f16]):
        a, b = mdsl.split(x, [128, 128], dim=-1)
        return mdsl.rms_norm(a) * mdsl.silu(b)

    plan = search(in_place.graph, CONFIG).plan()
    assert not any("split" in b.before + b.after for b in plan.explanation)


@pytest.mark.timeout(60)
def test_a_row_too_long_for_shared_memory_says_how_much_it_needs():
    plan = search(_whole_row(), CONFIG).plan()
    (boundary,) = plan.explanation
    assert "of shared memory per block" in boundary.reason and "over the 227 KB limit" in boundary.reason
    assert boundary.before == "mean %mean" and boundary.after == "sub %sub"


@pytest.mark.timeout(60)
def test_a_fused_plan_the_verifier_rejects_is_named_as_the_reason():
    plan = search(_layout(), CONFIG, generators=[partition.generate], verifier=fakes.verify_never_equal).plan()
    assert plan.is_original
    reasons = [b.reason for b in plan.explanation]
    assert any(r.startswith("the plan that fused them was not kept: verification rejected it: part 1 of ")
               and r.endswith("never equal") for r in reasons), reasons


@pytest.mark.timeout(60)
def test_a_spent_work_budget_is_named_as_the_reason():
    plan = search(_layout(), attrs.evolve(CONFIG, work=3), generators=[partition.generate],
                  verifier=fakes.verify).plan()
    assert plan.is_original
    assert any("the search's work budget ran out" in b.reason for b in plan.explanation), plan.explain()


def test_a_split_loop_and_its_combine_are_explained(monkeypatch):
    from mdsl.search import cost

    @mdsl.kernel
    def gemv(x: Tensor[1, 1024, f16], w: Tensor[1024, 64, f16]):
        return mdsl.silu(x @ w)

    graph = gemv.graph
    labels = Labels(graph)
    k = labels.label(graph.inputs[0].name, 1)
    split = lift(graph, Choice(((labels.label(graph.outputs[0].name, 1), 8),), k, forloop=4, split=4), labels)
    assert len(split.nodes) == 2
    # the combine runs in its split's launch (mdsl.lowering.onelaunch): no boundary between them
    assert boundaries(graph, split, SearchStats(), {}) == ()
    monkeypatch.setattr(cost, "one_launch_pairs", lambda graph, threads=None: ())   # as a pair that does not qualify
    (boundary,) = boundaries(graph, split, SearchStats(), {})
    assert boundary.reason.startswith("a split loop") and boundary.before.startswith("partial results of matmul")


@pytest.mark.timeout(60)
def test_the_explanation_is_stored_with_the_plan_and_read_back(tmp_path):
    cache = PlanCache(tmp_path)
    graph = _layout()
    plan = optimize(graph, CONFIG, cache=cache)
    again = optimize(graph, CONFIG, cache=cache)
    assert again.cache_path is not None and again.explanation == plan.explanation != ()
    assert again.explain() == plan.explain()


@pytest.mark.timeout(120)
def test_mdsl_optimize_explain_prints_the_reasons(tmp_path, capsys):
    source = tmp_path / "layout.py"
    source.write_text("import mdsl\nfrom mdsl import Tensor, f16\n\n\n@mdsl.kernel\n"
                      "def layout(x: Tensor[8, 64, f16], w: Tensor[64, 32, f16]):\n"
                      "    a, b = mdsl.split(mdsl.rms_norm(x @ w), [16, 16], dim=-1)\n"
                      "    return mdsl.silu(a) * b\n")
    assert main(["optimize", str(source), "--explain", "--workers", "1", "--no-cache", "--work", "300"]) == 0
    out = capsys.readouterr().out
    assert "# explain:" in out and "is a layout change without a block-level rule" in out


def test_a_pair_cheaper_fused_that_the_best_combination_cuts_is_not_called_faster_apart():
    from mdsl.search.explain import _part_reason

    # the best combination fuses 0:2 and 2:4; the pair 1:3 alone would be cheaper fused than apart
    record = {"assemblies": {"best": [[0, 2], [2, 4]]}, "single_s": [2e-6] * 4, "parts": {}, "stopped": ""}
    part = {"status": partition.FUSED, "reason": "", "complete": True, "fused_s": 3e-6, "launches": 1}
    outcomes = {"best": "the search's time cap ran out before it was verified"}
    reason = _part_reason(part, record, outcomes, SearchStats(), (1, 2), (2, 3), (1, 3))
    assert "faster apart" not in reason and "best combination puts them in different parts" in reason
    assert reason.endswith("that plan was not kept: the search's time cap ran out before it was verified")
    part["fused_s"] = 5e-6
    assert "faster apart (4 us) than fused (5 us)" in _part_reason(part, record, outcomes, SearchStats(),
                                                                    (1, 2), (2, 3), (1, 3))


def test_a_part_dear_to_verify_that_the_cap_cut_off_is_explained():
    from tests.search.test_partition import _dear

    graph = _dear()
    stats = SearchStats()
    (cheap,) = partition.generate_cheap(graph, CONFIG, stats)
    stats.timed_out = True   # the cap ran out before the full partition analysis
    (boundary,) = boundaries(graph, cheap.graph, stats, {cheap.graph.key: "verified"})
    assert "time cap ran out before the part joining them was tried: it is dear to verify" in boundary.reason
    assert boundary.before.startswith("max") and boundary.after.startswith("matmul")

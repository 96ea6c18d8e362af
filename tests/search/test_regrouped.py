"""A product regrouped along its last dim, normalised per group and regrouped back (Qwen3's q/k norm): the
reshape's dim ties (mdsl/search/dims.py), its block-level lifting where a tile holds whole groups
(mdsl/search/guided.py), a block graph's reshape in the interpreter, and the search fusing it into one
verified kernel, or leaving it apart where tiles cannot hold whole groups."""
from __future__ import annotations

import json

import attrs
import numpy as np
import pytest

import mdsl
from mdsl import Tensor, f16
from mdsl.backend.reference import run_block_graph, run_kernel_graph
from mdsl.ir.graph import BlockGraph, BlockInput, BlockOutput, KernelGraph, Node
from mdsl.ir.ops import get_op
from mdsl.ir.types import TensorType, Var
from mdsl.passes.verify import verify
from mdsl.search.config import SearchConfig
from mdsl.search.dims import Labels, reshape_ties
from mdsl.search.cache import PlanCache
from mdsl.search.engine import optimize, search
from mdsl.search.guided import LIFT_RULES, CannotLift, Choice, lift
from mdsl.search.layout import boundary_views
from mdsl.search.resize import JointLabels
from tests.search.regrouped_plans import regrouped_candidates, regrouped_program

CONFIG = SearchConfig(budget_s=120, workers=1, exhaustive=False)


def _heads(rows: int = 4, k: int = 256, n: int = 1024, group: int = 128, weight: bool = False) -> KernelGraph:
    heads = n // group
    if weight:
        @mdsl.kernel(name="heads_weighted")
        def program(x: Tensor[rows, k, f16], w: Tensor[k, n, f16], g: Tensor[1, 1, group, f16]):
            h = mdsl.reshape(x @ w, rows, heads, group)
            return mdsl.reshape(mdsl.rms_norm(h, eps=1e-6) * g, rows, n)
    else:
        @mdsl.kernel(name="heads")
        def program(x: Tensor[rows, k, f16], w: Tensor[k, n, f16]):
            h = mdsl.reshape(x @ w, rows, heads, group)
            return mdsl.reshape(mdsl.rms_norm(h, eps=1e-6), rows, n)
    return program.graph


def _same_function(a: KernelGraph, b: KernelGraph) -> None:
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(v.shape) for v in a.inputs]
    for got, want in zip(run_kernel_graph(b, inputs), run_kernel_graph(a, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("before, after, ties", [
    ((2, 1024), (2, 2, 512), ((0, 0), (1, 1))),            # n into (g, s): n with g
    ((2, 2, 512), (2, 1024), ((0, 0), (1, 1))),            # merged back: g with n
    ((8, 4096, 4), (8, 32, 128, 4), ((0, 0), (1, 1), (2, 3))),   # a kept suffix too
    ((2, 1024), (2, 1, 4, 256), ((0, 0), (1, 2))),         # the outermost group dim longer than 1
    ((4, 6), (8, 3), ()),                                  # no dim split alike
    ((2, 6, 512), (2, 3, 1024), ((0, 0),)),                # regrouped, not split: only the rows
])
def test_reshape_ties_the_dims_it_splits_alike(before, after, ties):
    assert reshape_ties(before, after) == ties


def test_a_regrouped_product_and_its_groups_share_a_label_of_the_groups_size():
    graph = _heads(n=1024, group=128)
    labels = Labels(graph)
    matmul, reshape = graph.nodes[0].outputs[0], graph.nodes[1].outputs[0]
    assert labels.label(matmul.name, 1) == labels.label(reshape.name, 1)
    assert labels.label(matmul.name, 0) == labels.label(reshape.name, 0)
    assert labels.size(labels.label(matmul.name, 1)) == 8    # a grid splits n only into whole groups


def _core(graph: KernelGraph):
    wrapped = boundary_views(graph, LIFT_RULES)
    assert wrapped is not None and [n.op for n in wrapped.core.nodes] == ["matmul", "reshape", "rms_norm"][
        :len(wrapped.core.nodes)]
    return wrapped


def _groups_choice(core: KernelGraph, parts: int) -> Choice:
    labels = Labels(core)
    columns = labels.label(core.nodes[0].outputs[0].name, 1)
    k = labels.label(core.inputs[1].name, 0)
    return Choice(grid=((columns, parts),), loop=k, forloop=4)


def test_the_reshape_lifts_onto_tiles_of_whole_groups_and_the_candidate_verifies():
    graph = _heads(n=1024, group=128)
    wrapped = _core(graph)
    assert [n.op for n in wrapped.trailing] == ["reshape"]   # the regrouping back is a view of the result
    lifted = lift(wrapped.core, _groups_choice(wrapped.core, 4))
    (kernel,) = lifted.nodes
    (reshape,) = [n for n in kernel.body.nodes if n.op == "reshape"]
    assert reshape.inputs[0].shape == (4, 256) and reshape.outputs[0].shape == (4, 2, 128)   # two heads a block
    candidate = attrs.evolve(graph, nodes=wrapped.around(lifted))
    _same_function(graph, candidate)
    assert verify(graph, candidate, tests=2, seed=0).equivalent


@pytest.mark.parametrize("parts", [16, 32])
def test_tiles_that_cut_a_group_do_not_lift(parts):
    wrapped = _core(_heads(n=1024, group=128))   # 8 groups: 16 or 32 column tiles would cut each
    with pytest.raises(CannotLift, match="whole groups"):
        lift(wrapped.core, _groups_choice(wrapped.core, parts))


def test_a_block_graph_reshape_regroups_each_blocks_tile():
    tile, regrouped = TensorType((2, 8), "f32"), TensorType((2, 2, 4), "f32")
    x, a, y, z = Var("x", tile), Var("a", tile), Var("y", regrouped), Var("z", regrouped)
    nodes = [Node("accum", [x], [a], ()),
             Node("reshape", [a], [y], get_op("reshape").normalize_attrs({"shape": (2, 2, 4)})),
             Node("rms_norm", [y], [z], get_op("rms_norm").normalize_attrs({"dim": 2, "eps": 1e-6}))]
    body = BlockGraph((4, 1, 1), 128, 1, [BlockInput(x, (1, None, None), None)], nodes,
                      [BlockOutput(z, (1, None, None))])
    rows = np.random.default_rng(0).standard_normal((2, 32))
    (got,) = run_block_graph(body, [rows])   # 4 blocks of 8 columns, each 2 groups of 4
    groups = rows.reshape(2, 8, 4)
    np.testing.assert_allclose(got, groups / np.sqrt((groups ** 2).mean(-1, keepdims=True) + 1e-6), rtol=1e-12)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("weight", [False, True], ids=["norm", "norm-times-weight"])
def test_a_regrouped_norm_fuses_with_its_product_into_one_verified_kernel(weight):
    graph = _heads(weight=weight)
    plan = search(graph, CONFIG).plan()
    assert plan.cost.launches == 1 < plan.original_cost.launches, str(plan)
    assert plan.cost.seconds <= plan.original_cost.seconds
    assert plan.evidence.equivalent and plan.evidence.finite_field_tests == CONFIG.verify_tests
    assert any(m.op == "reshape" for n in plan.graph.nodes if n.body is not None for m in n.body.nodes)
    _same_function(graph, plan.graph)


@pytest.mark.timeout(300)
def test_a_regrouping_of_groups_searches_to_a_verified_plan():
    @mdsl.kernel(name="regrouped")
    def program(x: Tensor[4, 256, f16], w: Tensor[256, 768, f16]):
        h = mdsl.reshape(x @ w, 4, 6, 128)
        r = mdsl.reshape(mdsl.rms_norm(h, eps=1e-6), 4, 3, 256)   # groups of 128 regrouped by 256: no tie
        return mdsl.reshape(mdsl.rms_norm(r, eps=1e-6), 4, 768)

    plan = search(program.graph, CONFIG).plan()
    assert plan.evidence.equivalent
    _same_function(program.graph, plan.graph)


@pytest.mark.timeout(120)
def test_a_regrouped_norm_too_small_to_pay_for_its_split_is_left_apart_by_the_cost_model():
    graph = _heads(rows=2, k=2048, n=1024, group=512)   # two groups: 32 blocks at most, and a combine of 2
    plan = search(graph, CONFIG).plan()
    assert plan.cost.launches == plan.original_cost.launches == 2
    assert "the cost model estimates them faster apart" in plan.explain(), plan.explain()


@pytest.mark.parametrize("name", ["groups-grid", "rows-and-groups-loop", "split-loop-combine"])
def test_a_regrouped_candidate_resizes_with_its_rows_its_reshapes_with_them(name):
    original, candidate = regrouped_program(rows=4), regrouped_candidates(rows=4)[name]
    labels = JointLabels([original, candidate])
    rows = labels.original_label(original.outputs[0], 0)
    (resized_original, resized), fixed = labels.resized(lambda label, n: 2 * n if label == rows else n)
    assert rows not in fixed
    assert resized_original == regrouped_program(rows=8)
    def shapes(graph):   # the reshapes' shapes: the program's, then those of the blocks' tiles
        return ([n.attr("shape") for n in graph.nodes if n.op == "reshape"],
                [m.attr("shape") for n in graph.nodes if n.body is not None for m in n.body.nodes if m.op == "reshape"])

    (views, tiles), (views_before, tiles_before) = shapes(resized), shapes(candidate)
    assert views and all(s[0] == 8 for s in views), views
    assert tiles and [s[0] for s in tiles] == [2 * s[0] for s in tiles_before], (tiles, tiles_before)   # the grid kept
    _same_function(resized_original, resized)


def test_a_reshape_whose_result_dims_are_not_its_operands_keeps_the_resize_from_its_rows():
    @mdsl.kernel(name="rows_into_columns")
    def program(x: Tensor[4, 64, f16]):
        return mdsl.reshape(x, 2, 128) * 2.0   # rows merged into columns: no dim of the result is x's rows

    labels = JointLabels([program.graph])
    rows = labels.label((0,), program.graph.inputs[0].name, 0)
    (resized,), fixed = labels.resized(lambda label, n: 2 * n if label == rows else n)
    assert rows in fixed and resized == program.graph


@pytest.mark.timeout(300)
def test_a_fused_regrouped_norm_serves_other_row_counts_without_a_search(tmp_path):
    config = SearchConfig(budget_s=120, workers=1, exhaustive=False, work=2000)
    cache = PlanCache(tmp_path / "cache")
    searched = optimize(_heads(rows=8), config, cache=cache)
    assert searched.cost.launches == 1 and searched.family is not None and 16 in searched.family.sizes, str(searched)
    log = tmp_path / "sixteen.jsonl"
    member = optimize(_heads(rows=16), config, cache=cache, log_path=log)
    assert [json.loads(line)["event"] for line in log.read_text().splitlines()] == ["family_hit"]   # no search
    assert member.original == _heads(rows=16) and member.cost.launches == 1 and member.evidence.equivalent
    _same_function(_heads(rows=16), member.graph)

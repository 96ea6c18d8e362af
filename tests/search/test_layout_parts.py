"""Layout changes inside a part (mdsl/search/layout.py): views moved to the part's boundary, inverse
transposes cancelled, so that the rest lifts into one kernel. IR in, core and plan out."""
from __future__ import annotations

import numpy as np
import pytest

import mdsl
from mdsl import Tensor, f16
from mdsl.backend.reference import run_kernel_graph
from mdsl.ir.graph import KernelGraph
from mdsl.search.config import SearchConfig
from mdsl.search.engine import search
from mdsl.search.guided import LIFT_RULES
from mdsl.search.layout import boundary_views

CONFIG = SearchConfig(budget_s=90, workers=1, exhaustive=False, min_blocks=1)


def _transposed_scale():
    @mdsl.kernel
    def transposed_scale(x: Tensor[8, 64, f16]):
        t = mdsl.transpose(mdsl.rms_norm(x), 0, 1)       # scaled in the transposed layout, then back
        return mdsl.transpose(t * 0.5, 0, 1)
    return transposed_scale.graph


def _heads():
    @mdsl.kernel
    def heads(x: Tensor[8, 64, f16], b: Tensor[1, 64, f16]):
        h = mdsl.reshape(mdsl.sigmoid(x), 8, 2, 32)       # two heads, normalised each
        return mdsl.reshape(mdsl.rms_norm(h), 8, 64) + b
    return heads.graph


def _ops(graph: KernelGraph) -> list:
    return [n.op for n in graph.nodes]


def _same_function(a: KernelGraph, b: KernelGraph) -> None:
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(v.shape) for v in a.inputs]
    for got, want in zip(run_kernel_graph(b, inputs), run_kernel_graph(a, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_inverse_transposes_around_elementwise_ops_cancel():
    graph = _transposed_scale()
    wrapped = boundary_views(graph, LIFT_RULES)
    assert wrapped is not None and not wrapped.leading and not wrapped.trailing
    assert _ops(wrapped.core) == ["rms_norm", "mul_scalar"]
    assert [v.name for v in wrapped.core.outputs] == [v.name for v in graph.outputs]
    _same_function(graph, wrapped.core)


def test_a_reshape_moves_to_the_inputs_and_its_inverse_to_the_outputs():
    graph = _heads()
    wrapped = boundary_views(graph, LIFT_RULES)
    assert wrapped is not None
    assert _ops(wrapped.core) == ["sigmoid", "rms_norm", "add"]
    assert {n.inputs[0].name for n in wrapped.leading} == {"x", "b"}          # views of the inputs
    assert [n.outputs[0].name for n in wrapped.trailing] == [v.name for v in graph.outputs]
    assert all(n.op == "reshape" for n in (*wrapped.leading, *wrapped.trailing))
    _same_function(graph, KernelGraph(graph.name, graph.inputs, wrapped.around(wrapped.core), graph.outputs))


def test_a_reshape_a_contraction_reads_stays_and_the_part_is_left_alone():
    @mdsl.kernel
    def merged(x: Tensor[8, 2, 32, f16], w: Tensor[64, 16, f16]):
        return mdsl.reshape(mdsl.rms_norm(x), 8, 64) @ w   # the product contracts the merged dim

    assert boundary_views(merged.graph, LIFT_RULES) is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["transposes", "heads", "cut_chain", "fused_gate_up"])
def test_a_part_with_layout_changes_becomes_one_verified_kernel(name):
    graph = {"transposes": _transposed_scale, "heads": _heads, "cut_chain": _cut_chain,
             "fused_gate_up": _fused_gate_up}[name]()
    plan = search(graph, CONFIG).plan()
    assert plan.cost.launches == 1 < plan.original_cost.launches, str(plan)
    assert plan.evidence.equivalent and plan.evidence.finite_field_tests == CONFIG.verify_tests
    assert sum(n.body is not None for n in plan.graph.nodes) == 1
    _same_function(graph, plan.graph)


def test_a_concat_of_whole_rows_lifts_into_its_operands_kernel():
    @mdsl.kernel
    def joined(x: Tensor[8, 64, f16], g: Tensor[8, 32, f16]):
        return mdsl.concat([mdsl.rms_norm(x), mdsl.silu(g)], dim=-1)   # rows joined in the block

    plan = search(joined.graph, CONFIG).plan()
    assert plan.cost.launches == 1 < plan.original_cost.launches, str(plan)
    (kernel,) = plan.graph.nodes
    assert "concat" in [n.op for n in kernel.body.nodes] and plan.evidence.equivalent
    _same_function(joined.graph, plan.graph)


def test_broadcast_operands_move_with_a_reshape_that_regroups_all_or_none_of_their_dims():
    @mdsl.kernel
    def scaled(x: Tensor[8, 64, f16], s: Tensor[8, 1, f16], b: Tensor[1, 64, f16]):
        h = mdsl.reshape((x * s) + b, 8, 2, 32)             # a per-row scalar and a bias row, then heads
        return mdsl.reshape(mdsl.rms_norm(h), 8, 64)

    wrapped = boundary_views(scaled.graph, LIFT_RULES)
    assert wrapped is not None and _ops(wrapped.core) == ["mul", "add", "rms_norm"]
    shapes = {n.inputs[0].name: n.outputs[0].shape for n in wrapped.leading}
    assert shapes == {"x": (8, 2, 32), "s": (8, 1, 1), "b": (1, 2, 32)}
    _same_function(scaled.graph, KernelGraph(scaled.graph.name, scaled.graph.inputs,
                                             wrapped.around(wrapped.core), scaled.graph.outputs))


def _halves():
    @mdsl.kernel
    def halves(x: Tensor[8, 64, f16], w: Tensor[8, 32, f16]):
        a, b = mdsl.split(x, [32, 32], dim=-1)               # parts of an input: views the kernel reads
        c, d = mdsl.split(mdsl.silu(a) * b + w, [16, 16], dim=-1)   # parts that only leave: views of its result
        return c, d
    return halves.graph


def test_a_split_of_an_input_stays_before_the_kernel_and_one_of_its_result_after():
    graph = _halves()
    wrapped = boundary_views(graph, LIFT_RULES)
    assert wrapped is not None and _ops(wrapped.core) == ["silu", "mul", "add"]
    assert [(n.op, n.inputs[0].name) for n in wrapped.leading] == [("split", "x")]
    assert [n.op for n in wrapped.trailing] == ["split"]
    assert [v.name for v in wrapped.trailing[0].outputs] == [v.name for v in graph.outputs]
    _same_function(graph, KernelGraph(graph.name, graph.inputs, wrapped.around(wrapped.core), graph.outputs))


@pytest.mark.timeout(120)
def test_siblings_reading_the_parts_of_a_split_input_share_one_verified_kernel():
    @mdsl.kernel
    def siblings(x: Tensor[8, 64, f16]):
        a, b = mdsl.split(x, [32, 32], dim=-1)
        return mdsl.silu(a) * 2.0, b + 1.0                    # no tensor shared but through the split

    plan = search(siblings.graph, CONFIG).plan()
    assert plan.cost.launches == 1 < plan.original_cost.launches, str(plan)
    assert sum(n.body is not None for n in plan.graph.nodes) == 1 and plan.evidence.equivalent
    _same_function(siblings.graph, plan.graph)


def _cut_chain():
    @mdsl.kernel
    def cut_chain(x: Tensor[8, 64, f16], s: Tensor[8, 1, f16], b: Tensor[1, 64, f16]):
        a, c = mdsl.split(mdsl.sigmoid(x * s + b), [32, 32], dim=-1)   # an activation cut in two inside
        return a, c + 1.0
    return cut_chain.graph


def test_a_split_inside_a_chain_moves_to_the_inputs_past_its_elementwise_producers():
    graph = _cut_chain()
    wrapped = boundary_views(graph, LIFT_RULES)
    assert wrapped is not None and not wrapped.trailing
    # each step once a part: the per-row scalar read whole by both, x and the bias row split as the value was
    assert _ops(wrapped.core) == ["mul", "mul", "add", "add", "sigmoid", "sigmoid", "add_scalar"]
    assert sorted((n.inputs[0].name, n.outputs[0].shape) for n in wrapped.leading) == [("b", (1, 32)),
                                                                                      ("x", (8, 32))]
    assert all(n.op == "split" and len(n.outputs) == 2 for n in wrapped.leading)
    assert {v.name for v in wrapped.core.inputs} >= {"s"}
    assert [v.name for v in wrapped.core.outputs] == [v.name for v in graph.outputs]
    _same_function(graph, KernelGraph(graph.name, graph.inputs, wrapped.around(wrapped.core), graph.outputs))


def test_a_split_of_a_value_read_elsewhere_stays_and_the_part_is_left_alone():
    @mdsl.kernel
    def kept(x: Tensor[8, 64, f16]):
        h = mdsl.sigmoid(x)
        a, c = mdsl.split(h, [32, 32], dim=-1)   # h is returned too: computed whole, not a part at a time
        return h, a * c

    assert boundary_views(kept.graph, LIFT_RULES) is None


def _fused_gate_up():
    @mdsl.kernel
    def fused_gate_up(x: Tensor[8, 64, f16], w: Tensor[64, 64, f16]):
        gate, up = mdsl.split(x @ w, [32, 32], dim=-1)    # one weight holds the gate's and the up's columns
        return mdsl.silu(gate) * up
    return fused_gate_up.graph


def test_a_split_of_a_products_columns_moves_to_its_weight():
    graph = _fused_gate_up()
    wrapped = boundary_views(graph, LIFT_RULES)
    assert wrapped is not None and not wrapped.trailing
    assert _ops(wrapped.core) == ["matmul", "matmul", "silu", "mul"]
    ((cut, shapes),) = [(n.inputs[0].name, [v.shape for v in n.outputs]) for n in wrapped.leading]
    assert cut == "w" and shapes == [(64, 32), (64, 32)]                   # the weight's columns, views
    assert {n.inputs[0].name for n in wrapped.core.nodes if n.op == "matmul"} == {"x"}
    _same_function(graph, KernelGraph(graph.name, graph.inputs, wrapped.around(wrapped.core), graph.outputs))


def test_a_split_of_a_products_rows_stays_and_the_part_is_left_alone():
    @mdsl.kernel
    def rows(x: Tensor[8, 64, f16], w: Tensor[64, 32, f16]):
        a, b = mdsl.split(x @ w, [4, 4], dim=0)
        return a * b

    assert boundary_views(rows.graph, LIFT_RULES) is None


def test_a_concat_of_a_splits_parts_in_order_is_its_operand():
    @mdsl.kernel
    def rejoined(x: Tensor[8, 64, f16], w: Tensor[64, 64, f16]):
        a, b = mdsl.split(x @ w, [16, 48], dim=-1)
        return mdsl.concat([a, b], dim=-1) * 2.0

    @mdsl.kernel
    def swapped(x: Tensor[8, 64, f16], w: Tensor[64, 64, f16]):
        a, b = mdsl.split(x @ w, [16, 48], dim=-1)
        return mdsl.concat([b, a], dim=-1) * 2.0           # not in order: the pieces stay

    for program, ops in ((rejoined, ["matmul", "mul_scalar"]), (swapped, ["matmul", "matmul", "concat", "mul_scalar"])):
        graph = program.graph
        wrapped = boundary_views(graph, LIFT_RULES)
        assert wrapped is not None and _ops(wrapped.core) == ops, program
        assert [n.op for n in wrapped.leading] == ([] if program is rejoined else ["split"]) and not wrapped.trailing
        _same_function(graph, KernelGraph(graph.name, graph.inputs, wrapped.around(wrapped.core), graph.outputs))


def test_a_rejoined_split_returned_by_name_is_its_operand_under_that_name():
    @mdsl.kernel
    def returned(x: Tensor[8, 64, f16], w: Tensor[64, 64, f16]):
        a, b = mdsl.split(mdsl.silu(x @ w), [16, 48], dim=-1)
        return mdsl.concat([a, b], dim=-1)

    @mdsl.kernel
    def of_input(x: Tensor[8, 64, f16]):
        a, b = mdsl.split(x, [16, 48], dim=-1)
        return mdsl.concat([a, b], dim=-1), mdsl.sigmoid(a)   # x has no producer to rename: the concat stays

    graph = returned.graph
    wrapped = boundary_views(graph, LIFT_RULES)
    assert wrapped is not None and not wrapped.leading and not wrapped.trailing
    assert _ops(wrapped.core) == ["matmul", "silu"]
    assert [v.name for v in wrapped.core.outputs] == [v.name for v in graph.outputs]   # silu writes %concat
    _same_function(graph, wrapped.core)
    kept = boundary_views(of_input.graph, LIFT_RULES)
    assert kept is not None and _ops(kept.core) == ["concat", "sigmoid"]


def test_the_guided_generator_lifts_a_whole_program_whose_views_move_to_its_boundary():
    from mdsl.search import guided

    graph = _heads()
    first = next(guided.generate(graph, CONFIG))
    assert [n.op for n in first.nodes if n.body is None] == ["reshape"] * 3    # x, b and the result: views
    assert sum(n.body is not None for n in first.nodes) == 1
    _same_function(graph, first)


def test_a_program_with_an_operator_no_rule_lifts_costs_no_lifting():
    from mdsl.search import guided
    from mdsl.search.stats import SearchStats

    @mdsl.kernel
    def halves(x: Tensor[8, 64, f16]):
        a, b = mdsl.split(mdsl.exp(x), [32, 32], dim=-1)
        return a * b

    stats = SearchStats(work_limit=CONFIG.work)
    result = guided.lift_all(halves.graph, CONFIG, stats)
    assert result.candidates == () and result.complete
    assert list(result.failures.values())[0][1] == "split does not lift into a block graph"
    assert not stats.counts.get("work")

"""Split-K for RMSNorm+Linear: accum_rms's `split` rule (mdsl.search.guided) divides the norm's sum of
squares across the blocks of a split loop (each split stores its mean of squares next to its partial
product; the combine averages them, adds eps, takes the root and divides). The candidates it gives are
verified and evaluated like any other."""
from __future__ import annotations

import attrs
import numpy as np
import pytest

from mdsl.backend.reference import run_kernel_graph
from mdsl.ir.ops import get_op
from mdsl.ir.validate import validate_kernel_graph
from mdsl.passes.verify import verify
from mdsl.search.dims import Labels
from mdsl.search.guided import SPLIT_RULES, Choice, lift
from tests.examples_util import load_example


def _rnl(bs: int = 1, k: int = 256, n: int = 96):
    return load_example("rms_norm_linear").make_rms_norm_linear(bs, k=k, n=n).graph


def _split(graph, column_parts: int, split: int, forloop: int):
    labels = Labels(graph)
    k = labels.label(graph.inputs[0].name, 1)
    columns = labels.label(graph.outputs[0].name, 1)
    return lift(graph, Choice(((columns, column_parts),), k, forloop=forloop, split=split), labels)


def ops(body) -> list:
    return [n.op for n in body.nodes]


def test_every_splittable_accumulator_has_its_rule_in_the_registry():
    assert set(SPLIT_RULES) == {"accum", "accum_max", "accum_rescale", "accum_rms"}


def test_the_split_candidate_stores_means_of_squares_and_combines_them():
    graph = _rnl()
    candidate = _split(graph, 4, 4, 2)
    validate_kernel_graph(candidate)
    first, combine = (n.body for n in candidate.nodes)
    assert first.grid == (4, 4, 1) and combine.grid == (4, 1, 1) and combine.forloop == 4
    assert "accum_rms" not in ops(first) + ops(combine)
    assert ops(first).count("accum_mean") == 1 and {"square", "accum"} <= set(ops(first))
    assert ops(combine)[:3] == ["accum_mean", "add_scalar", "sqrt"] and "div" in ops(combine)
    # the per-row partial has no column dim: each column block stores its own copy, the combine reads its own
    squares = candidate.nodes[0].outputs[0]
    assert squares.type.shape == (2 * 4, 4)   # rows x splits, column blocks


@pytest.mark.parametrize("bs,parts,split,forloop", [(1, 4, 4, 2), (8, 2, 2, 4), (1, 8, 8, 1)])
def test_the_split_candidate_evaluates_equal_to_the_program(bs, parts, split, forloop):
    graph = _rnl(bs)
    candidate = _split(graph, parts, split, forloop)
    rng = np.random.default_rng(bs * 100 + split)
    inputs = [rng.standard_normal(v.shape) for v in graph.inputs]
    (want,) = run_kernel_graph(graph, inputs, precision="float64")
    (got,) = run_kernel_graph(candidate, inputs, precision="float64")
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-12


@pytest.mark.timeout(120)
def test_the_split_candidate_verifies_and_a_wrong_combine_does_not():
    graph = _rnl()
    candidate = _split(graph, 4, 4, 2)
    result = verify(graph, candidate, tests=3, seed=0)
    assert result.equivalent and result.finite_field_tests == 3, result.reason
    wrong = _with_combine_eps(candidate, 1e-3)
    validate_kernel_graph(wrong)
    refused = verify(graph, wrong, tests=3, seed=0)
    assert not refused.equivalent and "finite-field" in refused.reason


def _with_combine_eps(graph, eps: float):
    """The candidate with another eps in its combine: sqrt(mean + 1e-3) is another function."""
    combine = graph.nodes[-1]
    nodes = [attrs.evolve(n, attrs=get_op("add_scalar").normalize_attrs({"value": eps})) if n.op == "add_scalar" else n
             for n in combine.body.nodes]
    return attrs.evolve(graph, nodes=graph.nodes[:-1] + (attrs.evolve(combine, body=attrs.evolve(combine.body,
                                                                                              nodes=tuple(nodes))),))


def test_a_grid_over_rows_and_columns_with_a_split_is_refused_not_mislowered():
    # the per-row partial has no dim left for the split once rows and columns both take grid dims
    from mdsl.search.guided import CannotLift

    graph = _rnl(8)
    labels = Labels(graph)
    k = labels.label(graph.inputs[0].name, 1)
    rows, columns = (labels.label(graph.outputs[0].name, d) for d in (0, 1))
    with pytest.raises(CannotLift, match="partial result"):
        lift(graph, Choice(((columns, 4), (rows, 2)), k, forloop=2, split=2), labels)


def test_an_f32_program_squares_without_a_cast():
    import mdsl
    from mdsl import Tensor, f32

    @mdsl.kernel
    def rnl32(x: Tensor[4, 256, f32], w: Tensor[256, 64, f32]):
        return mdsl.rms_norm(x) @ w

    candidate = _split(rnl32.graph, 2, 4, 2)
    first = candidate.nodes[0].body
    assert "cast" not in ops(first) and ops(first).count("square") == 1
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(v.shape) for v in rnl32.graph.inputs]
    (want,) = run_kernel_graph(rnl32.graph, inputs, precision="float64")
    (got,) = run_kernel_graph(candidate, inputs, precision="float64")
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-12


def test_a_split_total_beside_an_operand_of_the_programs_dtype_is_widened_not_refused():
    # RMSNorm's tail as transformers writes it: the norm in f32, cast to bf16, times a bf16 weight; split
    # over the mean's dim, the combine's f32 values meet the bf16 weight, which is cast up to f32 to meet them
    import mdsl
    from mdsl import Tensor, bf16, f32

    @mdsl.kernel
    def norm_tail(squares: Tensor[1, 1, 1024, f32], x: Tensor[1, 1, 1024, f32], weight: Tensor[1024, bf16]):
        return weight * mdsl.cast(x * mdsl.rsqrt(mdsl.mean(squares, dim=2, keepdim=True) + 1e-6), bf16)

    graph = norm_tail.graph
    labels = Labels(graph)
    candidate = lift(graph, Choice((), labels.label(graph.inputs[0].name, 2), forloop=64, split=2), labels)
    validate_kernel_graph(candidate)
    rng = np.random.default_rng(3)
    inputs = [rng.random(v.shape) + 0.5 for v in graph.inputs]
    (want,) = run_kernel_graph(graph, inputs, precision="float64")
    (got,) = run_kernel_graph(candidate, inputs, precision="float64")
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-12

"""The guided generator's combining kernel spread over more blocks (`Choice.combine_parts`): the same
program, each block combining fewer rows of every split."""
from __future__ import annotations

import attrs
import numpy as np
import pytest

from mdsl.backend.reference import run_kernel_graph
from mdsl.search import guided
from mdsl.search.config import SearchConfig
from mdsl.search.dims import Labels
from tests.backend.cuda.programs import example_kernels


def _split_choice(graph, labels, split: int):
    """The first choice of `split` splits over two grid labels that lifts."""
    for c in guided.choices(graph, labels, SearchConfig()):
        if c.split == split and len(c.grid) == 2:
            try:
                guided.lift(graph, c, labels)
                return c
            except guided.CannotLift:
                continue
    raise AssertionError("no such choice")


@pytest.mark.timeout(60)
def test_a_wider_combine_computes_the_same():
    graph = example_kernels()["gqa.gqa"]
    labels = Labels(graph)
    choice = _split_choice(graph, labels, 4)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(v.shape) * (0.125 if v.name == "k" else 1.0) for v in graph.inputs]
    want = run_kernel_graph(graph, xs, precision="float64")[0]
    narrow = guided.lift(graph, choice, labels)
    for parts in (2, 8):
        wide = guided.lift(graph, attrs.evolve(choice, combine_parts=parts), labels)
        first, combine = wide.nodes
        assert first == narrow.nodes[0]   # the splits themselves are unchanged
        assert np.prod(combine.body.grid) == parts * np.prod(narrow.nodes[1].body.grid)
        assert combine.body.forloop == narrow.nodes[1].body.forloop
        np.testing.assert_allclose(run_kernel_graph(wide, xs, precision="float64")[0], want, rtol=1e-12, atol=1e-12)


def test_a_combine_that_cannot_divide_its_rows_does_not_lift():
    graph = example_kernels()["gqa.gqa"]
    labels = Labels(graph)
    choice = _split_choice(graph, labels, 4)
    rows = guided.lift(graph, choice, labels).nodes[1].body.inputs[0].var.shape[1]
    with pytest.raises(guided.CannotLift, match="divides"):
        guided.lift(graph, attrs.evolve(choice, combine_parts=rows * 2), labels)

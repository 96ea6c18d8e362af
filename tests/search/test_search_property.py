"""Property: on small random programs, every candidate the guided and the exhaustive generator yield
that the verifier accepts computes the program (reference interpreter, float64, fresh inputs), and so
does every plan the search engine returns."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdsl.backend.reference import run_kernel_graph
from mdsl.ir.dtypes import f32
from mdsl.ir.graph import KernelGraph, Node
from mdsl.ir.ops import broadcast_shapes, get_op
from mdsl.ir.types import TensorType, Var
from mdsl.ir.validate import validate_kernel_graph
from mdsl.search import enumerate as exhaustive
from mdsl.search import guided
from mdsl.search.config import SearchConfig

HAS_VERIFY = importlib.util.find_spec("mdsl.passes.verify") is not None
HAS_ENGINE = importlib.util.find_spec("mdsl.search.engine") is not None

CONFIG = SearchConfig(budget_s=1.0, max_block_ops=4, min_blocks=1, thread_counts=(128,), workers=1)
CHECKED_PER_GENERATOR = 6   # candidates verified per generator and program, spread over what it yields

UNARY = ("exp", "silu", "relu", "sigmoid", "square", "neg")
BINARY = ("add", "sub", "mul", "div")
REDUCTIONS = ("sum", "mean", "max")


# ---- random programs ----------------------------------------------------------------------------

class _Program:
    """A kernel graph under construction: values, nodes, fresh names."""

    def __init__(self, inputs: list):
        self.inputs = inputs
        self.values = list(inputs)
        self.nodes: list = []

    def add(self, op: str, operands: list, **attrs) -> None:
        opdef = get_op(op)
        pairs = opdef.normalize_attrs(attrs)
        (out_type,) = opdef.infer_types(tuple(v.type for v in operands), pairs)
        out = Var(f"t{len(self.nodes)}", out_type)
        self.nodes.append(Node(op, operands, [out], pairs))
        self.values.append(out)

    def graph(self) -> KernelGraph:
        graph = KernelGraph("random", self.inputs, self.nodes, [self.values[-1]])
        validate_kernel_graph(graph)
        return graph


def _broadcasts(a: Var, b: Var) -> bool:
    try:
        return broadcast_shapes("add", a.shape, b.shape) in (a.shape, b.shape)
    except Exception:
        return False


def _step(draw, p: _Program) -> None:
    """One operator on values at hand (the newest value more often than not)."""
    newest = p.values[-1]
    x = newest if draw(st.booleans()) else draw(st.sampled_from(p.values))
    kind = draw(st.sampled_from(("unary", "binary", "binary", "matmul", "reduction", "rms_norm")))
    partners = [v for v in p.values if _broadcasts(x, v)]
    factors = [v for v in p.values if v.type.rank == 2 and x.type.rank == 2 and v.shape[0] == x.shape[1]]
    if kind == "binary" and partners:
        y = draw(st.sampled_from(partners))
        operands = [x, y] if draw(st.booleans()) else [y, x]
        p.add(draw(st.sampled_from(BINARY)), operands)
    elif kind == "matmul" and factors:
        p.add("matmul", [x, draw(st.sampled_from(factors))])
    elif kind == "reduction" and x.type.rank == 2:
        p.add(draw(st.sampled_from(REDUCTIONS)), [x], dim=draw(st.integers(0, 1)), keepdim=draw(st.booleans()))
    elif kind == "rms_norm" and x.type.rank == 2:
        p.add("rms_norm", [x], dim=1, eps=1e-6)   # dims as the frontend normalises them
    elif draw(st.booleans()):
        p.add("mul_scalar", [x], value=0.5)
    else:
        p.add(draw(st.sampled_from(UNARY)), [x])


@st.composite
def programs(draw) -> KernelGraph:
    """2-4 operators over 1-3 f32 inputs of shapes (m, k), (k, n), (m, n) with small m, k, n."""
    m, k, n = draw(st.sampled_from((2, 4))), draw(st.sampled_from((8, 16))), draw(st.sampled_from((4, 8)))
    shapes = draw(st.lists(st.sampled_from(((m, k), (k, n), (m, n))), min_size=1, max_size=3))
    p = _Program([Var(f"x{i}", TensorType(s, f32)) for i, s in enumerate(shapes)])
    for _ in range(draw(st.integers(2, 4))):
        _step(draw, p)
    return p.graph()


# ---- the property -------------------------------------------------------------------------------

def _inputs(graph: KernelGraph, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [0.5 * rng.standard_normal(v.shape) for v in graph.inputs]


def _spread(items: list, n: int) -> list:
    """At most n items, evenly spaced (the first always)."""
    if len(items) <= n:
        return items
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def _assert_computes(graph: KernelGraph, candidate: KernelGraph) -> None:
    inputs = _inputs(graph, 2024)
    for got, want in zip(run_kernel_graph(candidate, inputs), run_kernel_graph(graph, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-10, equal_nan=True,
                                   err_msg=f"{graph}\n\ncandidate:\n{candidate}")


def _accepted(graph: KernelGraph, candidate: KernelGraph) -> bool:
    if not HAS_VERIFY:
        return True   # no verifier yet: every candidate must compute the program
    from mdsl.passes.verify import verify

    return verify(graph, candidate, tests=2, seed=7).equivalent


@pytest.mark.timeout(120)
# derandomized: a search's time depends on the program drawn, and CI's time limit must not
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_accepted_candidates_of_both_generators_compute_the_program(graph):
    for generate in (guided.generate, exhaustive.generate):
        for candidate in _spread(list(generate(graph, CONFIG)), CHECKED_PER_GENERATOR):
            validate_kernel_graph(candidate)
            if _accepted(graph, candidate):
                _assert_computes(graph, candidate)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not (HAS_ENGINE and HAS_VERIFY), reason="needs the search engine and the verifier")
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_every_plan_the_engine_returns_computes_the_program(graph):
    from mdsl.search.engine import search

    result = search(graph, SearchConfig(budget_s=3.0, max_block_ops=4, min_blocks=1, workers=1, verify_tests=2))
    assert result.candidates
    for candidate in result.candidates:
        _assert_computes(graph, candidate.graph)

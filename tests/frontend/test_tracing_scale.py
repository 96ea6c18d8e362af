"""Tracing is linear in the number of operators: naming a value and finding its source column cost
the same for the 10,000th operator as for the first. Checked by counting the work of each step (not by
timing), plus one generous wall-clock bound on a long chain, marked slow."""
import time

import pytest

import mdsl
from mdsl import Tensor, f32
from mdsl.frontend import source


class _CountingSet(set):
    """A set that counts membership tests: each is one name tried by `Tracer.fresh`."""

    tests = 0

    def __contains__(self, item):
        _CountingSet.tests += 1
        return super().__contains__(item)


def _names_tried(n: int) -> int:
    _CountingSet.tests = 0

    def chain(x):
        x.tracer._names = _CountingSet(x.tracer._names)
        for _ in range(n):
            x = x * 1.5   # every result is based on the name "mul_scalar"
        return x

    mdsl.kernel(chain).trace(Tensor[4, f32])
    return _CountingSet.tests


def test_naming_a_value_tries_a_bounded_number_of_names():
    assert _names_tried(2000) <= 2 * 2000 + 10
    assert _names_tried(4000) <= 2 * 4000 + 10


def test_a_user_name_that_collides_with_a_generated_one():
    """A name `fresh` skips over is not handed out later: names stay unique whatever the order."""
    @mdsl.kernel
    def k(mul_scalar_2: Tensor[4, f32], mul_scalar: Tensor[4, f32]):
        y = mul_scalar
        for _ in range(4):
            y = y * 2.0
        return y + mul_scalar_2

    names = [v.name for v in k.graph.inputs] + [v.name for n in k.graph.nodes for v in n.outputs]
    assert len(names) == len(set(names))


def test_source_positions_are_read_once_per_function():
    n = 3000
    code = "def straight(x):\n" + "    x = x * 1.5\n" * n + "    return x\n"
    scope: dict = {}
    exec(compile(code, "<generated straight>", "exec"), scope)
    before = source._positions.cache_info()
    graph = mdsl.kernel(scope["straight"]).trace(Tensor[4, f32])
    after = source._positions.cache_info()
    assert after.misses - before.misses <= 2   # the function's code object (and at most one other)
    assert after.hits - before.hits >= n - 2
    assert [node.loc.line for node in graph.nodes[:3]] == [2, 3, 4] and graph.nodes[-1].loc.line == n + 1


@pytest.mark.slow
def test_twenty_thousand_chained_operators_trace_quickly():
    def chain(x):
        for _ in range(20_000):
            x = x * 1.5
        return x

    start = time.monotonic()
    graph = mdsl.kernel(chain).trace(Tensor[4, f32])
    assert len(graph.nodes) == 20_000
    assert time.monotonic() - start < 10.0   # a generous bound: linear tracing takes a fraction of it

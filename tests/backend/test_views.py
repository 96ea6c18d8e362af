"""Kernel-level views (mdsl.lowering.views): a reshape, and a transpose that moves only size-1 dims, alias their
operand on both backends, launch nothing and cost nothing; any other transpose is a kernel."""
from __future__ import annotations

import pytest

from mdsl.backend.cuda import emit_cuda
from mdsl.backend.ptx.codegen import emit_llvm
from mdsl.ir.dtypes import bf16
from mdsl.lowering.options import CudaOptions
from mdsl.lowering.views import is_view
from mdsl.search.cost import estimate
from tests.backend.cuda.builder import Graph

EMITTERS = {"cuda": emit_cuda, "ptx": emit_llvm}


def _moved(shape, perm):
    g = Graph("heads")
    x = g.input("x", shape, bf16)
    return g.build([g.op("exp", g.op("transpose", x, perm=perm))])


@pytest.mark.parametrize("shape, perm, view", [
    ((1, 1, 8, 128), (0, 2, 1, 3), True),     # one token's heads moved ahead of its sequence dim
    ((1, 8, 1, 128), (0, 2, 1, 3), True),
    ((4, 1, 8), (1, 0, 2), True),
    ((3, 1), (1, 0), True),
    ((2, 3), (1, 0), False),
    ((4, 4), (1, 0), False),                  # a square matrix's transpose moves its elements
    ((1, 8, 8, 1), (0, 2, 1, 3), False),
    ((4, 1, 8), (2, 1, 0), False),
    ((1, 8, 2, 128), (0, 2, 1, 3), False),
])
def test_a_transpose_is_a_view_where_only_size_one_dims_move(shape, perm, view):
    graph = _moved(shape, perm)
    transpose = graph.nodes[0]
    assert is_view(transpose) is view
    assert estimate(graph).launches == (1 if view else 2)
    for emit in EMITTERS.values():
        program = emit(graph, options=CudaOptions())
        names = [launch.name for launch in program.launches]
        assert len(names) == (1 if view else 2), names
        assert (("transpose", "x") in tuple(program.aliases)) is view


def test_the_layout_rewrites_make_a_square_transpose_a_transpose():
    from mdsl.ir.types import TensorType, Var
    from mdsl.search.layout import _Rewrite

    g = Graph("square")
    g.op("exp", g.input("x", (4, 4), bf16))
    rewrite = _Rewrite(g.build())
    x = Var("x", TensorType((4, 4), bf16))
    assert rewrite.layout("transpose", x, (4, 4), (1, 0)).op == "transpose"
    assert rewrite.layout("transpose", Var("y", TensorType((1, 4), bf16)), (4, 1), (1, 0)).op == "reshape"

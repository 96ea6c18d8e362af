"""Strided views (mdsl.lowering.views): which split parts are read in place and which concat pieces written in
place, what the two backends emit for them (no launch for a split or concat left with nothing to copy, the
readers and producers taking the other value's pointer, a split or concat copying only the rest), the cost
model's launches and bytes, and the programs compiling clean on both backends. The kernels
computed: tests/backend/ptx/test_ptx_views.py (CPU simulator) and tests/gpu/test_gpu_fast_paths.py (the GPU)."""
from __future__ import annotations

import pytest

from mdsl.backend.cuda import emit_cuda
from mdsl.backend.ptx.codegen import emit_llvm
from mdsl.ir.dtypes import f16, f32
from mdsl.ir.graph import Node
from mdsl.ir.types import TensorType, Var
from mdsl.lowering.program import lower_graph
from mdsl.lowering.views import (StridedView, copied_pieces, copy_reasons, launches_nothing, strided_views,
                                written_parts)
from mdsl.search.cost import estimate
from tests.backend.acceptance import assert_compiles_clean
from tests.backend.cuda.builder import Graph
from tests.backend.cuda.fast_paths import fast_path_graphs
from tests.backend.cuda.views import read_in_place, write_in_place

EMITTERS = {"cuda": emit_cuda, "ptx": emit_llvm}


def _split_then(reader: str, sizes=(256, 256), dtype=f16, result: bool = False, rows: int = 4):
    """x [rows, sum(sizes)] split along its last dim; the second part read by `reader` (a block graph's
    element-wise map, a kernel-level rms_norm or a kernel-level matmul), the first part a result or unread."""
    g = Graph(f"split_{reader}")
    x = g.input("x", (rows, sum(sizes)), dtype)
    first, second = g.ops("split", x, sizes=sizes, dim=1)
    if reader == "map":
        imap = (0,) if rows > 1 else (None,)
        b = g.block(grid=(rows,))
        t = b.input(second, imap=imap)
        b.output(b.op("accum", b.op("exp", t)), omap=imap)
        out = b.done()[0]
    elif reader == "rms_norm":
        out = g.op("rms_norm", second, dim=-1, eps=1e-6)
    else:
        out = g.op("matmul", second, g.input("w", (sizes[1], 64), dtype))
    return g.build([first, out] if result else [out])


def test_a_part_read_in_place_is_a_view_of_the_split_operand():
    views = strided_views(_split_then("map"))
    assert views == {"split": StridedView("x", 0, (512, 1)), "split_1": StridedView("x", 256, (512, 1))}
    assert strided_views(_split_then("rms_norm"))["split_1"] == StridedView("x", 256, (512, 1))


@pytest.mark.parametrize("graph, views", [
    (_split_then("map", result=True), {"split_1"}),            # a result is written (the caller's own memory)
    (_split_then("matmul"), {"split"}),                        # a library GEMM reads contiguous operands
    (_split_then("map", sizes=(4, 508)), {"split"}),           # 8 bytes in: a 16-byte load would straddle
    (_split_then("map", sizes=(256, 250)), {"split"}),         # rows 1012 bytes apart
    (_split_then("map", sizes=(256, 250), rows=1), {"split", "split_1"}),   # one row: no stride across rows
    (_split_then("map", sizes=(4, 508), dtype=f32), {"split", "split_1"}),  # 16 bytes in
], ids=["result", "matmul", "misaligned-offset", "misaligned-rows", "one-row", "f32"])
def test_which_parts_are_views(graph, views):
    assert set(strided_views(graph)) == views


def test_a_view_of_a_view_composes_offsets():
    g = Graph("nested")
    x = g.input("x", (8, 64), f16)
    _, mid = g.ops("split", x, sizes=(16, 48), dim=1)
    _, inner = g.ops("split", mid, sizes=(8, 40), dim=1)
    b = g.block(grid=(8,))
    b.output(b.op("accum", b.op("neg", b.input(inner, imap=(0,)))), omap=(0,))
    graph = g.build(b.done())
    views = strided_views(graph)
    assert views["split_3"] == StridedView("x", 24, (64, 1))
    assert all(launches_nothing(n, views) for n in graph.nodes if n.op == "split")


@pytest.mark.parametrize("backend", sorted(EMITTERS))
def test_a_split_of_views_launches_nothing_and_its_reader_takes_the_operand(backend):
    graph = _split_then("map")
    program = EMITTERS[backend](graph)
    assert [launch.args for launch in program.launches] == [("x", "accum")]
    assert estimate(graph).launches == 1
    if backend == "cuda":
        assert "g_split_1 = g_x + 256;" in program.source


@pytest.mark.parametrize("backend", sorted(EMITTERS))
def test_a_split_writes_only_its_parts_that_are_not_views(backend):
    graph = _split_then("map", result=True)
    split = graph.nodes[0]
    assert [v.name for v in written_parts(split, strided_views(graph))] == ["split"]
    program = EMITTERS[backend](graph)
    assert [launch.args for launch in program.launches] == [("x", "split"), ("x", "accum")]
    both = estimate(_split_then("map", result=True, sizes=(256, 250)))   # (both parts written: rows misaligned)
    one = estimate(graph)
    assert one.launches == both.launches == 2
    assert one.kernels[0].dram_bytes == 2 * 4 * 256 * 2 < both.kernels[0].dram_bytes


def test_the_plan_of_a_program_reads_split_parts_in_place():
    """A traced program whose split feeds a norm and an element-wise product: the split launches nothing."""
    import mdsl
    from mdsl import Tensor

    @mdsl.kernel
    def gated(x: Tensor[4, 1024, f16]):
        a, b = mdsl.split(x, [512, 512], dim=-1)
        return mdsl.rms_norm(a) * mdsl.silu(b)

    graph = lower_graph(gated.graph)
    assert set(strided_views(graph)) == {"split", "split_1"}
    launches = emit_cuda(graph).launches
    assert [graph.nodes[launch.node_index].op for launch in launches] == ["rms_norm", "silu", "mul"]
    assert [launch.args[0] for launch in launches[:2]] == ["x", "x"]
    assert estimate(gated.graph).launches == 3

    @mdsl.kernel
    def projected(x: Tensor[4, 512, f16], w: Tensor[512, 768, f16]):   # (the README's example)
        q, k, v = mdsl.split(x @ w, [512, 128, 128], dim=-1)
        return mdsl.rms_norm(q), mdsl.silu(k) * v

    graph = lower_graph(projected.graph)
    assert "split" not in [graph.nodes[launch.node_index].op for launch in emit_llvm(graph).launches]


@pytest.mark.parametrize("backend", ("cuda", "ptx"))
@pytest.mark.parametrize("name", ("ragged_matmuls_f16", "flash_decoding_f16", "prologue_matmuls_f16",
                                  "narrow_rows_bf16", "split_combine_f16"))
def test_programs_reading_and_writing_in_place_compile_clean(name, backend):
    assert_compiles_clean(write_in_place(read_in_place(fast_path_graphs()[name])), backend)


def _into_concat(producer: str, result: bool = True):
    """Two rows-maps of x [4, 256] (a block graph and a kernel-level exp, or a kernel-level matmul) concatenated
    along the last dim with a third value, an input of the program."""
    g = Graph(f"concat_{producer}")
    x, y = g.input("x", (4, 256), f16), g.input("y", (4, 64), f16)
    b = g.block(grid=(4,))
    b.output(b.op("accum", b.op("neg", b.input(x, imap=(0,)))), omap=(0,))
    first = b.done()[0]
    second = g.op("exp", x) if producer == "exp" else g.op("matmul", x, g.input("w", (256, 256), f16))
    out = g.op("concat", first, second, y, dim=1)
    return g.build([out] if result else [g.op("neg", out)])


@pytest.mark.parametrize("backend", sorted(EMITTERS))
def test_producers_write_a_concat_in_place(backend):
    graph = _into_concat("exp")
    views = strided_views(graph)
    assert views == {"accum": StridedView("concat", 0, (576, 1)), "exp": StridedView("concat", 256, (576, 1))}
    concat = graph.nodes[-1]
    assert copied_pieces(concat, views) == (2,)   # y, an input of the program, is copied
    launches = EMITTERS[backend](graph).launches
    assert [launch.args for launch in launches] == [("x", "concat"), ("x", "concat"), ("y", "concat")]
    assert estimate(graph).kernels[-1].dram_bytes == 2 * 4 * 64 * 2
    if backend == "cuda":
        assert "__half* const g_exp = g_concat + 256;" in EMITTERS[backend](graph).source


def test_a_matmul_result_and_an_input_are_copied_into_a_concat():
    views = strided_views(_into_concat("matmul"))
    assert set(views) == {"accum"}


def test_a_concat_of_pieces_written_in_place_launches_nothing():
    g = Graph("pieces")
    x = g.input("x", (4, 256), f16)
    out = g.op("concat", g.op("exp", x), g.op("neg", x), dim=1)
    graph = g.build([out])
    assert launches_nothing(graph.nodes[-1], strided_views(graph))
    assert estimate(graph).launches == 2
    assert [launch.args for launch in emit_cuda(graph).launches] == [("x", "concat"), ("x", "concat")]


def test_a_piece_read_by_a_matmul_or_read_twice_by_the_concat_is_copied():
    g = Graph("kept")
    x = g.input("x", (4, 256), f16)
    e = g.op("exp", x)
    g.op("matmul", e, g.input("w", (256, 8), f16))
    n = g.op("neg", x)
    graph = g.build([g.op("concat", e, n, n, dim=1)] + [v for v in g.nodes[1].outputs])
    assert strided_views(graph) == {}


def test_copy_reasons_say_why_a_value_is_not_addressed_in_place():
    assert copy_reasons(_split_then("map", result=True)) == {"split": "a result of the program"}
    assert copy_reasons(_split_then("matmul")) == {"split_1": "matmul %matmul takes contiguous operands"}
    assert "16 bytes" in copy_reasons(_split_then("map", sizes=(4, 508)))["split_1"]
    reasons = copy_reasons(_into_concat("matmul"))
    assert reasons == {"matmul": "matmul %matmul does not write in place", "y": "an input of the program"}


def _heads(shape: tuple, norm_dim: int = -1):
    """q, k = split(x @ w) with q reshaped to `shape` (heads of its columns, or its rows merged) and normalised."""
    g = Graph("heads")
    x = g.input("x", (4, 256), f16)
    q, k = g.ops("split", g.op("matmul", x, g.input("w", (256, 384), f16)), sizes=(256, 128), dim=1)
    heads = g.op("reshape", q, shape=shape)
    return g.build([g.op("rms_norm", heads, dim=norm_dim, eps=1e-6), g.op("exp", k)])


def test_a_reshape_of_a_part_is_read_in_place_where_its_dims_keep_to_rows():
    views = strided_views(_heads((4, 4, 64)))
    assert views["reshape"] == StridedView("matmul", 0, (384, 64, 1)) and "split" in views
    assert [launch.name.rsplit("_", 1)[-1] for launch in emit_llvm(_heads((4, 4, 64))).launches] == \
        ["matmul", "norm", "exp"]
    merged = _heads((1024,))                   # the part's rows merged into one: they are not 512 bytes apart
    assert "split" not in strided_views(merged)
    assert copy_reasons(merged)["split"] == "reshape %reshape views it across a gap between rows"


def test_the_strides_of_a_reshape_over_strided_rows():
    from mdsl.lowering.views import _aliased_strides

    g = Graph("r")
    x = g.input("x", (4, 6, 8), f16)
    for shape, strides, want in [((4, 48), (96, 8, 1), (96, 1)),        # 6 rows of 8, contiguous: merged
                                 ((24, 8), (48, 8, 1), (8, 1)),         # contiguous throughout
                                 ((24, 8), (96, 8, 1), None),           # 4 x 6 rows: a gap after every 6th
                                 ((4, 6, 2, 4), (100, 8, 1), (100, 8, 4, 1)),   # a dim split: always a view
                                 ((4, 3, 2, 8), (100, 16, 1), (100, 32, 16, 1)),
                                 ((24, 8), (100, 16, 1), None)]:
        node = Node("reshape", (x,), (Var("y", TensorType(shape, f16)),), (("shape", shape),))
        got = _aliased_strides(node, strides)
        assert got == want, (shape, strides, got)

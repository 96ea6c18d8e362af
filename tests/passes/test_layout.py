"""Layout selection: padded shared-memory rows, f32 accumulators, scratch tiles, vector widths."""
from __future__ import annotations

import pytest

from mdsl.ir.dtypes import bf16, f16, f32
from mdsl.ir.text import parse_graph
from mdsl.ir.types import TensorType
from mdsl.passes.layout import TileLayout, padded_row_stride, select_layout, vector_width
from tests.backend.cuda.programs import example_kernels
from tests.passes.test_fusion import ATTENTION


@pytest.mark.parametrize("shape, dtype, stride", [
    ((64, 64), f16, 72),       # 128-byte rows: every row would start in bank 0
    ((16, 32), f32, 36),
    ((4, 8, 128), bf16, 136),
    ((8, 32), f16, 32),        # 64-byte rows: two rows per pass over the banks already
    ((1, 64), f16, 64),        # one row: no column to walk
    ((64,), f32, 64),
    ((), f32, 1),
])
def test_rows_are_padded_where_columns_would_conflict(shape, dtype, stride):
    assert padded_row_stride(shape, dtype) == stride


def test_tile_layout_geometry():
    tile = TileLayout((2, 16, 64), f16, 72)
    assert (tile.rows, tile.row_length) == (32, 64)
    assert tile.strides == (16 * 72, 72, 1)
    assert tile.nbytes == 32 * 72 * 2
    assert str(tile) == "f16[2, 16, 64], rows padded to 72"
    assert TileLayout((), f32, 1).strides == () and TileLayout((), f32, 1).nbytes == 4


@pytest.mark.parametrize("tile, tensor, width", [
    (TileLayout((16, 64), f16, 72), TensorType((16, 4096), f16), 8),    # 16 bytes
    (TileLayout((16, 64), f32, 68), TensorType((16, 4096), f16), 8),    # an f32 tile stored as f16: converted
    (TileLayout((16, 64), f16, 68), TensorType((16, 4096), f16), 4),    # rows of 68 halves
    (TileLayout((16, 64), f32, 68), TensorType((16, 4096), f32), 4),
    (TileLayout((8, 6), f16, 6), TensorType((8, 12), f16), 2),          # rows of 6 halves
    (TileLayout((8, 4), f16, 4), TensorType((8, 6), f16), 2),           # the tensor's rows of 6
    (TileLayout((64, 1), f16, 1), TensorType((64, 16), f16), 1),
    (TileLayout((), f32, 1), TensorType((), f32), 1),
])
def test_vector_widths(tile, tensor, width):
    assert vector_width(tile, tensor) == width


@pytest.mark.timeout(30)
def test_plan_of_online_softmax(monkeypatch, capsys):
    graph = parse_graph(ATTENTION)
    node = graph.nodes[0]
    monkeypatch.setenv("MDSL_DUMP_IR", "1")
    plan = select_layout(node.body, tuple(v.type for v in node.inputs))
    err = capsys.readouterr().err
    assert "// ----- IR after layout -----" in err and "// ----- layout plan -----" in err
    assert plan.tiles["bq"] == TileLayout((1, 16, 64), f16, 72)
    assert plan.tiles["num"] == TileLayout((1, 16, 64), f32, 68)     # accumulators are f32
    assert plan.tiles["den"] == TileLayout((1, 16, 1), f32, 1)
    assert plan.tiles["num#scratch"] == TileLayout((2, 1, 16, 1), f32, 1)  # the running maximum, twice
    assert plan.tiles["s"] == TileLayout((1, 16, 32), f32, 36)        # computed tiles are f32 ...
    assert select_layout(node.body, tuple(v.type for v in node.inputs), wide=False).tiles["s"] == \
        TileLayout((1, 16, 32), f16, 32)                              # ... unless asked otherwise
    assert plan.vectors == {"bq": 8, "bk": 8, "bv": 8, "y": 8}
    assert set(plan.tiles) == {"bq", "bk", "bv", "s", "t", "m", "d", "e", "pv", "num", "den", "r", "o", "y",
                               "num#scratch", "den#scratch"}


@pytest.mark.timeout(30)
def test_plan_of_rms_norm_linear():
    node = example_kernels()["rms_norm_linear.rms_norm_linear_fused"].nodes[0]
    plan = select_layout(node.body, tuple(v.type for v in node.inputs))
    assert plan.tiles["x"] == TileLayout((2, 64), f16, 72)
    assert plan.tiles["w"] == TileLayout((64, 128), f16, 136)
    assert plan.tiles["matmul"] == TileLayout((2, 128), f32, 132)
    assert plan.vectors == {"x": 8, "w": 8, "div": 8}

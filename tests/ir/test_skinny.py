"""The skinny-loop analysis (mdsl.ir.skinny): which block graphs multiply one X of at most 16 rows by
streamed weights, what it reports of them, and its model of the loads in flight. Block graphs in, shapes
out; the CUDA lowering that uses it is tested in tests/backend/cuda/test_cuda_skinny.py."""
from __future__ import annotations

import pytest

from mdsl.ir.skinny import SkinnyShape, skinny_shape
from mdsl.ir.text import parse_graph
from tests.ir.skinny_texts import prologue_linear, rms_norm_linear, vector_prologue_linear

GATED = """kernel gated(%x: f16[8, 4096], %w1: f16[4096, 4096], %w2: f16[4096, 4096]) {
  %mul: f16[8, 4096] = custom(%x, %w1, %w2) block(grid=[128, 1, 1], threads=128, forloop=32) {
    in %x: f16[8, 128] imap=[-, -, -] fmap=1
    in %w1: f16[128, 32] imap=[1, -, -] fmap=0
    in %w2: f16[128, 32] imap=[1, -, -] fmap=0
    %matmul: f16[8, 32] = matmul(%x, %w1)
    %accum: f16[8, 32] = accum(%matmul)
    %silu: f16[8, 32] = silu(%accum)
    %matmul_1: f16[8, 32] = matmul(%x, %w2)
    %accum_1: f16[8, 32] = accum(%matmul_1)
    %mul: f16[8, 32] = mul(%silu, %accum_1)
    out %mul omap=[1, -, -]
  }
  return %mul
}"""

# X's squares folded in the loop by an element-wise node: not a skinny loop
SQUARED = """kernel squared(%x: f16[16, 4096], %w: f16[4096, 6144]) {
  %matmul: f16[16, 6144] = custom(%x, %w) block(grid=[192, 1, 1], threads=128, forloop=32) {
    in %x: f16[16, 128] imap=[-, -, -] fmap=1
    in %w: f16[128, 32] imap=[1, -, -] fmap=0
    %mul: f16[16, 128] = mul(%x, %x)
    %accum_sum: f16[16, 1] = accum_sum(%mul)
    %matmul: f16[16, 32] = matmul(%x, %w)
    %accum: f16[16, 32] = accum(%matmul)
    %div: f16[16, 32] = div(%accum, %accum_sum)
    out %div omap=[1, -, -]
  }
  return %matmul
}"""


def _body(text: str):
    return parse_graph(text).custom_nodes()[0].body


def test_rms_norm_linear_is_a_skinny_loop_with_its_rms_folded_from_x():
    bg = _body(rms_norm_linear(16, 32))
    shape = skinny_shape(bg)
    names = [n.output.name for n in bg.nodes]
    assert shape == SkinnyShape("x", ("w",), (names.index("accum"),), (names.index("accum_rms"),), 16, 32, 4096)


def test_gated_mlp_streams_two_weights_and_no_row_accumulator():
    shape = skinny_shape(_body(GATED))
    assert (shape.x, shape.weights, shape.rows, shape.m, shape.n, shape.k) == ("x", ("w1", "w2"), (), 8, 32, 4096)


@pytest.mark.parametrize("text", [rms_norm_linear(17, 32), rms_norm_linear(16, 18), rms_norm_linear(16, 36), SQUARED])
def test_more_than_16_rows_columns_no_load_covers_or_other_loop_work_are_not(text):
    assert skinny_shape(_body(text)) is None


def test_a_prologue_computes_the_operand_from_x_and_the_row_fold_reads_the_operand():
    bg = _body(prologue_linear(8, 32))
    shape = skinny_shape(bg)
    names = [n.output.name for n in bg.nodes]
    assert shape.x == "x" and shape.weights == ("w",) and shape.rows == (names.index("accum_rms"),)
    assert [names[i] for i in shape.prologue] == ["mul_scalar", "silu"] and shape.operand == shape.left == "silu"
    assert skinny_shape(_body(rms_norm_linear(8, 32))).left == "x"     # no prologue: the operand is X


# the prologue's value read by the matmul, X itself by the row accumulator; a prologue of two inputs; a
# prologue node whose value the matmul does not need
_ROW_OF_X = prologue_linear(8, 32).replace("accum_rms(%silu)", "accum_rms(%x)")
_TWO_INPUTS = """kernel k(%x: f16[8, 4096], %g: f16[8, 4096], %w: f16[4096, 3072]) {
  %matmul: f16[8, 3072] = custom(%x, %g, %w) block(grid=[96, 1, 1], threads=128, forloop=32) {
    in %x: f16[8, 128] imap=[-, -, -] fmap=1
    in %g: f16[8, 128] imap=[-, -, -] fmap=1
    in %w: f16[128, 32] imap=[1, -, -] fmap=0
    %mul: f16[8, 128] = mul(%x, %g)
    %matmul: f16[8, 32] = matmul(%mul, %w)
    %accum: f16[8, 32] = accum(%matmul)
    out %accum omap=[1, -, -]
  }
  return %matmul
}"""
_UNUSED = """kernel k(%x: f16[8, 4096], %w: f16[4096, 3072]) {
  %matmul: f16[8, 3072] = custom(%x, %w) block(grid=[96, 1, 1], threads=128, forloop=32) {
    in %x: f16[8, 128] imap=[-, -, -] fmap=1
    in %w: f16[128, 32] imap=[1, -, -] fmap=0
    %exp: f16[8, 128] = exp(%x)
    %neg: f16[8, 128] = neg(%x)
    %matmul: f16[8, 32] = matmul(%neg, %w)
    %accum: f16[8, 32] = accum(%matmul)
    %accum_sum: f16[8, 1] = accum_sum(%exp)
    %add: f16[8, 32] = add(%accum, %accum_sum)
    out %add omap=[1, -, -]
  }
  return %matmul
}"""


@pytest.mark.parametrize("text", [_ROW_OF_X, _TWO_INPUTS, _UNUSED])
def test_a_prologue_must_compute_the_one_operand_from_x_alone(text):
    assert skinny_shape(_body(text)) is None


def test_a_prologue_may_read_vectors_along_k_broadcast_over_the_rows():
    """(x - b) @ w with b [1, K], rms_norm(x * g) @ w with g [K]; of one row, X and a [1, K] vector have one
    shape: the first input is X, the other the vector."""
    shape = skinny_shape(_body(vector_prologue_linear(4, 32)))
    assert (shape.x, shape.vectors, shape.operand, shape.rows) == ("x", ("b",), "sub", ())
    normed = skinny_shape(_body(vector_prologue_linear(16, 32, body="mul_rms", dtype="bf16", rank=1)))
    assert (normed.x, normed.vectors, normed.operand, len(normed.rows)) == ("x", ("b",), "mul", 1)
    one_row = skinny_shape(_body(vector_prologue_linear(1, 32, blocks=256, k=8192, forloop=64)))
    assert (one_row.x, one_row.vectors) == ("x", ("b",))
    assert skinny_shape(_body(rms_norm_linear(8, 32))).vectors == ()


# a vector whose loop dim is not K (the same 128 elements in every iteration); one value per row of X ([M,
# 1]); a vector the prologue does not read
_NOT_ALONG_K = vector_prologue_linear(4, 32).replace("%b: f16[1, 4096]", "%b: f16[1, 128]").replace(
    "in %b: f16[1, 128] imap=[-, -, -] fmap=1", "in %b: f16[1, 128] imap=[-, -, -] fmap=-")
_PER_ROW = vector_prologue_linear(4, 32).replace("%b: f16[1, 4096]", "%b: f16[4, 1]").replace(
    "in %b: f16[1, 128] imap=[-, -, -] fmap=1", "in %b: f16[4, 1] imap=[-, -, -] fmap=-")
_VECTOR_UNUSED = vector_prologue_linear(4, 32).replace("%sub: f16[4, 128] = sub(%x, %b)", "%sub: f16[4, 128] = neg(%x)")


@pytest.mark.parametrize("text", [_NOT_ALONG_K, _PER_ROW, _VECTOR_UNUSED])
def test_a_vector_must_run_along_k_and_be_read_by_the_prologue(text):
    assert skinny_shape(_body(text)) is None


def test_loads_cover_as_many_distinct_columns_as_the_lanes_allow():
    # columns -> (columns a load covers, chunks, groups of 8 chunks)
    expected = {64: (8, 8, 1), 128: (8, 16, 2), 32: (4, 8, 1), 96: (4, 24, 3), 24: (4, 6, 1), 48: (8, 6, 1)}
    for n, (load, chunks, groups) in expected.items():
        shape = skinny_shape(_body(rms_norm_linear(16, n)))
        assert (shape.columns_per_load(), shape.chunks(), shape.groups()) == (load, chunks, groups), n


def test_column_groups_must_divide_among_the_warps():
    narrow, wide = (skinny_shape(_body(rms_norm_linear(16, n))) for n in (24, 128))
    assert narrow.fits(1) and narrow.fits(3)
    assert wide.fits(4) and not wide.fits(3)


def test_loads_in_flight_count_distinct_weight_bytes():
    full = skinny_shape(_body(rms_norm_linear(16, 64)))        # 16-byte loads, 2 slabs a buffer
    narrow = skinny_shape(_body(rms_norm_linear(16, 32)))      # 8-byte loads, 4 slabs a buffer: as many bytes
    partial = skinny_shape(_body(rms_norm_linear(16, 24)))     # 6 chunks of 4: two lanes of 8 duplicate
    two = skinny_shape(_body(GATED))                # two weights, 2 slabs a buffer of 8-byte loads
    # 4 warps x 32 lanes x 2 buffers x 2 slabs x 4 rows x 16 bytes
    assert full.loads_in_flight(4) == 4 * 32 * 2 * 2 * 4 * 16
    assert narrow.loads_in_flight(4) == two.loads_in_flight(4) == full.loads_in_flight(4)
    assert partial.loads_in_flight(4) == full.loads_in_flight(4) * 6 // 8

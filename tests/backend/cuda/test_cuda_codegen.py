"""CUDA C++ emission: readable source (one translation unit, the ops' markers, names from the user's values),
literals and index arithmetic, tiles in their own dtype where f32 does not fit. What both backends emit
alike: tests/backend/test_codegen.py."""
from __future__ import annotations

import re

import pytest

from mdsl.backend.cuda import emit_cuda
from mdsl.backend.cuda.source import Operand, float_literal, offset
from mdsl.ir import f16
from mdsl.ir.text import parse_graph
from mdsl.lowering.names import OP_MARKER, Namer, c_identifier
from tests.backend.cuda.builder import Graph
from tests.strategies import EXAMPLES, example_graphs


@pytest.mark.timeout(60)
def test_source_is_one_readable_translation_unit():
    graph = example_graphs()["attention"]
    source = emit_cuda(graph).source
    assert re.findall(r"#include <([^>]+)>", source) == ["cuda_fp16.h", "cuda_bf16.h"]
    # each op's code is preceded by a comment naming the mugraph op
    for line in ["%qs: f16[2, 16, 64] = mul_scalar(%q) {value=0.125}",
                 "%s: f16[1, 16, 32] = matmul(%bq, %bk)",
                 "%num: f16[1, 16, 64] = accum_rescale(%pv, %m)",
                 "%o: f16[1, 16, 64] = div(%num, %den)"]:
        assert OP_MARKER + line in source
    # kernels and variables are named after the user's tensors ('row.max' is not a C identifier)
    assert "attention_out(const __half* __restrict__ g_qs, const __half* __restrict__ g_k," in source
    assert "__half* __restrict__ g_row_max)" in source
    assert "s_bq = reinterpret_cast<__half*>" in source and "float* const s_num =" in source
    assert "switch" not in source


@pytest.mark.timeout(60)
def test_names_from_any_value_name_are_valid_and_distinct():
    graph = parse_graph(EXAMPLES["rms_norm_linear"].replace("%bx", "%int").replace("%bw", "%_w.1"))
    source = emit_cuda(graph).source
    assert "s_int" in source and "s_w_1" in source
    namer = Namer()
    assert [namer(n) for n in ("a.b", "a_b", "a__b", "1x", "int", "", "__x")] == \
        ["a_b", "a_b_1", "a_b_2", "v_1x", "v_int", "v", "x"]
    assert c_identifier("row.max") == "row_max"


def test_float_literals():
    assert [float_literal(v) for v in (0.5, 3, 1e-6, float("inf"), float("-inf"), 1e40)] == \
        ["0.5f", "3.0f", "1e-06f", "(-mdsl::neg_inf())", "mdsl::neg_inf()", "(-mdsl::neg_inf())"]
    assert float_literal(float("nan")).startswith("__int_as_float(")


def test_index_arithmetic():
    padded = Operand("s", "float", (2, 16, 64), (16 * 72, 72, 1))
    assert offset("i", (2, 16, 64), padded) == "i / 64 * 72 + i % 64"   # rows merge, padding stays
    assert offset("i", (2, 16, 64), Operand.contiguous("g", "float", (2, 16, 64))) == "i"
    assert offset("i", (16, 128), Operand.contiguous("g", "float", (16, 1))) == "i / 128"   # broadcast
    assert offset("i", (4, 6, 8), Operand.contiguous("g", "float", (4, 1, 8))) == "i / 48 * 8 + i % 8"
    assert offset("i", (8,), Operand.contiguous("g", "float", ())) == "0"


@pytest.mark.timeout(60)
def test_computed_tiles_fall_back_to_their_dtype_when_f32_does_not_fit():
    g = Graph("wide")
    x = g.input("x", (96, 512), f16)
    b = g.block()
    b.output(b.op("accum_sum", b.op("exp", b.input(x))))
    b.done()
    program = emit_cuda(g.build())
    # in f32 the exp tile would take 194 KB beside the 98 KB input tile; in f16 both fit
    assert 200_000 < program.launches[0].smem_bytes <= 227 * 1024
    assert "__half* const s_exp =" in program.source

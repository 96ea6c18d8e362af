"""benchmarks/serve_linears.py without a GPU: the linears it measures, their floors, its table and its section
of docs/performance.md."""
from __future__ import annotations

import pytest

from benchmarks import report, serve_linears
from mdsl.megakernel.runtime.models import QWEN3_8B, LLAMA_3_2_1B


def test_a_layers_linears_are_launched_as_the_serving_device_launches_them():
    assert serve_linears.layer_linears(QWEN3_8B) == [
        ("qkv", 4096, [4096, 1024, 1024], False), ("o", 4096, [4096], True),
        ("gate_up", 4096, [12288, 12288], False), ("down", 12288, [4096], True), ("lm_head", 4096, [151936], False)]
    # head_dim 64: q is 32 heads of 64, k and v 8 of 64
    assert serve_linears.layer_linears(LLAMA_3_2_1B)[0] == ("qkv", 2048, [2048, 512, 512], False)


def test_the_floor_is_the_bytes_at_few_rows_and_the_products_at_many():
    # one row: 2 bytes a weight, 4 a value in and out
    assert serve_linears.floor_us(1, 4096, 4096, False) == pytest.approx(
        (2 * 4096 * 4096 + 4 * 4096 + 4 * 4096) / 4.25e12 * 1e6)
    assert serve_linears.floor_us(1, 4096, 4096, True) > serve_linears.floor_us(1, 4096, 4096, False)
    # 4096 rows: 2 * 4096^3 flops over 750 TFLOP/s outlast the bytes
    assert serve_linears.floor_us(4096, 4096, 4096, False) == pytest.approx(2 * 4096 ** 3 / 750e12 * 1e6)


def test_the_line_and_the_section_show_times_floors_and_failures():
    ok = {"model": "qwen3-8b", "op": "o", "rows": 8, "k": 4096, "n": 4096, "residual": True, "floor_us": 8.0,
          "blocks": 256, "mdsl_us": 16.0, "torch_us": 12.0, "error": 1e-7}
    bad = {"model": "qwen3-8b", "op": "qkv", "rows": 1, "k": 4096, "n": 6144, "residual": False, "floor_us": 11.9,
           "blocks": 240, "error": 1.0, "failed": "max error 1.00e+00 of the largest value"}
    assert serve_linears._line(ok) == "| qwen3-8b | o | 8 | 4096 | 4096 | 256 | 8.0 | 16.0 | 50% | 12.0 | 0.75× |"
    assert "failed: max error" in serve_linears._line(bad)
    lines = report.serve_linears_section({"meta": None, "rows": [ok, bad]})
    assert "| Qwen3-8B | o | 8 | 4096 | 4096 | 256 | 8.0 | 16.0 | 50% | 12.0 | 0.75× |" in lines
    assert "Failed the float64 check: qwen3-8b qkv at 1 rows." in lines


def test_the_options_name_known_models_only(capsys):
    pytest.importorskip("torch")
    with pytest.raises(SystemExit):
        serve_linears.main(["--models", "qwen3-9b"])
    assert "unknown model" in capsys.readouterr().err

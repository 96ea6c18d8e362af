"""benchmarks/gemm.py without a GPU: its options, its shapes and its table."""
from __future__ import annotations

from benchmarks import gemm


def test_the_default_shapes_are_the_llm_ones():
    args = gemm.parse_args([])
    assert (args.dtype, args.rows, args.sizes) == ("bf16", [1, 16, 64], [4096, 8192])
    got = gemm.shapes(args.rows, args.sizes)
    assert len(got) == 12 and (1, 4096, 8192) in got and (64, 8192, 4096) in got
    assert gemm.parse_args(["--rows", "3", "--sizes", "100,72"]).rows == [3]


def test_shapes_can_be_k_n_pairs():
    args = gemm.parse_args(["--rows", "1024", "--shapes", "4096:6144,12288:4096"])
    assert gemm.shapes(args.rows, args.sizes, args.shapes) == [(1024, 4096, 6144), (1024, 12288, 4096)]


def test_the_table_shows_times_speed_ups_and_what_went_wrong():
    rows = [{"m": 1, "k": 4096, "n": 4096, "cublas_library": True, "cublas_us": 10.0, "kernel_us": 40.0,
             "torch_us": 12.5},
            {"m": 16, "k": 4096, "n": 8192, "cublas_library": False, "cublas_us": None,
             "cublas_error": "relative error 1.00e+00 over 4e-02", "kernel_us": 50.0, "torch_us": 20.0,
             "public_us": 21.0, "public_plan": "custom", "wgmma_us": 25.0, "wgmma_ptx_us": 24.0,
             "wgmma_tile": "128x256"}]
    table = gemm.markdown({"dtype": "bf16", "reps": 5, "batch": 2}, rows)
    assert "| 1 | 4096 | 4096 | 10.0 | 40.0 | — | — | — | 12.5 | 1.25× | — |  |" in table
    line = table.splitlines()[-1]
    assert line.startswith("| 16 | 4096 | 8192 | — | 50.0 | 21.0 | 25.0 | 24.0 | 20.0 | — | 0.80× |")
    assert "cublas: relative error" in line and "cuBLAS did not load" in line and "public plan: custom" in line
    assert "wgmma tile 128x256" in line

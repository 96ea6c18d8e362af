"""benchmarks/call_overhead.py without a GPU: the host overhead it reports (the public call minus the launch
floor), its table, and the report's section on both its schemas (the stored results are schema 1)."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks import call_overhead, report

ROOT = Path(__file__).resolve().parents[2]


def _timing(us: float) -> dict:
    return {"median_us": us, "p10_us": us, "samples": 3, "calls": 10}


def _results() -> dict:
    case = {"inputs": [[[8, 4096], "float16"]], "first_call_s": 1.0, "launches": 2, "launcher": "c",
            "public": _timing(9.5), "public_out": _timing(6.0), "public_sets": _timing(9.75),
            "public_bindings": _timing(14.0),
            "unchecked": _timing(5.0), "gpu": _timing(3.0), "launch_floor": _timing(4.0)}
    case["overhead_us"] = call_overhead.overhead(case["public"], case["launch_floor"])
    case["overhead_out_us"] = call_overhead.overhead(case["public_out"], case["launch_floor"])
    meta = {"samples": 3, "calls": 10, "torch": "2.11", "gpu": {"name": "NVIDIA H200"}}
    graphed = dict(case, graph=True, public=_timing(7.5), public_kernels=_timing(9.5))
    graphed["overhead_us"] = call_overhead.overhead(graphed["public"], graphed["launch_floor"])
    return {"schema": call_overhead.SCHEMA, "meta": meta, "floors": {"empty_launch_mdsl_c": _timing(3.5)},
            "cases": {"silu_mul_add_bs8": case, "mlp": graphed, "broken": {"error": "RuntimeError: no plan"}}}


def test_the_overhead_is_the_public_call_beyond_its_launch_floor():
    assert call_overhead.overhead(_timing(9.5), _timing(4.0)) == 5.5
    assert call_overhead.overhead(_timing(9.5), {"error": "no launcher"}) is None
    assert call_overhead.overhead(None, _timing(4.0)) is None


def test_the_table_shows_the_overhead_against_the_target():
    table = call_overhead.render_markdown(_results())
    assert "| silu_mul_add_bs8 | 2 | c | 9.50 | 6.00 | 9.75 | — | 14.00 | 5.00 | 4.00 | **5.50** (over) | **2.00** | " \
        "3.00 |" in table
    assert "| mlp | 2 | c, graph | 7.50 | 6.00 | 9.75 | 9.50 | 14.00 | 5.00 | 4.00 | **3.50** | **2.00** | 3.00 |" \
        in table
    assert "| broken | failed: RuntimeError: no plan |" in table
    assert "| empty kernel, through mdsl's C launcher | 3.50 |" in table
    assert f"target <= {call_overhead.TARGET_US:g} µs" in table


def test_the_report_reads_both_schemas():
    lines = "\n".join(report.call_section(_results()))
    assert "| silu_mul_add_bs8 | 2 | c | 9.5 | 6.0 | 9.8 | - | 5.0 | 4.0 | 5.5 | 2.0 | 3.0 |" in lines.replace("  ", " ")
    assert "| mlp | 2 | c, graph | 7.5 | 6.0 | 9.8 | 9.5 | 5.0 | 4.0 | 3.5 | 2.0 | 3.0 |" in lines.replace("  ", " ")
    stored = json.loads((ROOT / "docs/results/call_overhead.json").read_text())
    old = "\n".join(report.call_section(stored))
    assert "rms_norm_linear_bs1" in old and "an empty kernel, cuLaunchKernel through cuda.bindings" in old

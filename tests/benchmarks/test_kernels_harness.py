"""benchmarks/kernels.py without a GPU: options, arithmetic, the table, the plot, merging runs and
--plans-only. (The GPU run itself needs torch and a GPU; the one test of the torch programs runs only
where torch is installed.)"""
from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest

from benchmarks import kernels as K


def contender(median_us=None, status="ok", **extra) -> dict:
    out = {"status": status, **extra}
    if median_us is not None:
        out["median_s"] = median_us * 1e-6
    return out


def fake_case(**contenders) -> dict:
    """A case whose floor is 1 µs and 4.25 MB (the H200's bandwidth for 1 µs)."""
    return {"status": "ok", "floor": {"seconds": 1e-6, "bytes": 4_250_000, "flops": 0, "bound": "memory"},
            "contenders": contenders}


def fake_results() -> dict:
    return {
        "schema": K.SCHEMA,
        "meta": {"date": "2026-11-29T12:00:00+00:00", "torch": "2.11.0", "mdsl_commit": "abc123",
                 "gpu": {"name": "NVIDIA H200", "driver": "580.159.03"},
                 "method": {"reps": 200, "batch": 10, "l2_multiple": 2.0, "tolerance": 3e-3}},
        "cases": {
            "gqa_bs1": fake_case(
                eager=contender(10.0), cuda_graph=contender(5.0),
                compile=contender(1.0, "failed", reason="relative error 0.01 > 0.003"),   # faster, but wrong
                compile_max=contender(status="skipped", reason="--no-compile"),
                mdsl=contender(4.0), mdsl_graph=contender(2.0)),
            "lora": fake_case(eager=contender(8.0), mdsl=contender(16.0),
                              mdsl_graph=contender(status="skipped", reason="--no-graphs")),
            "ntrans_bs1": {"status": "failed", "error": "CudaError: launching a kernel failed",
                           "floor": {"seconds": 6e-8, "bytes": 262144, "flops": 0, "bound": "memory"}},
            "gated_mlp": {"status": "skipped", "reason": "time limit"},
        },
    }


# -- options ---------------------------------------------------------------------------------------

def test_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("OUT", raising=False)
    args = K.parse_args([])
    assert args.out == K.Path("bench_out") and args.cases is None and args.compile and args.max_autotune
    assert args.graphs and args.reps >= 100 and args.tolerance == 3e-3 and args.time_limit is None
    assert args.on_miss == "fail" and K.parse_args(["--plans-only"]).on_miss == "search"
    monkeypatch.setenv("OUT", str(tmp_path))
    assert K.parse_args([]).out == tmp_path


def test_options():
    args = K.parse_args(["--cases", "lora, gqa_bs8", "--no-compile", "--no-max-autotune", "--reps", "150",
                         "--time-limit", "300", "--out", "x"])
    assert args.cases == ["lora", "gqa_bs8"] and not args.compile and not args.max_autotune
    assert args.reps == 150 and args.time_limit == 300 and str(args.out) == "x"
    assert args.argv[:2] == ["--cases", "lora, gqa_bs8"]


@pytest.mark.parametrize("argv", [["--cases", "gqa_bs2"], ["--cases", ","], ["--reps", "0"],
                                  ["--time-limit", "-1"], ["--tolerance", "0"], ["--on-miss", "maybe"]])
def test_bad_options_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as e:
        K.parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_case_names_and_inputs_match_the_cases():
    from benchmarks.cases import cases

    kernels = cases()
    assert K.case_names() == list(kernels)
    for name, kernel in kernels.items():
        spec = K.INPUTS[K.family(name)]
        assert [v.name for v in kernel.graph.inputs] == list(spec), name
        assert all(v.type.dtype.name == "f16" for v in kernel.graph.inputs)


def test_family():
    assert K.family("gqa_bs8") == "gqa" and K.family("rms_norm_linear_bs1") == "rms_norm_linear"
    assert K.family("lora") == "lora" and K.family("gated_mlp") == "gated_mlp"


def test_compile_contenders_are_skipped_by_option_or_time_limit():
    bench = K.Bench.__new__(K.Bench)   # skip_reason needs only the options
    bench.args = K.parse_args(["--no-max-autotune"])
    running, over = K.Deadline(None), K.Deadline(1e-9)
    assert bench.skip_reason("compile", running) is None and bench.skip_reason("eager", over) is None
    assert bench.skip_reason("compile_max", running) == "--no-max-autotune"
    assert bench.skip_reason("compile", over) == "time limit"
    bench.args = K.parse_args(["--no-compile", "--no-graphs"])
    assert bench.skip_reason("compile", running) == "--no-compile"
    assert bench.skip_reason("cuda_graph", running) == bench.skip_reason("mdsl_graph", running) == "--no-graphs"
    assert bench.skip_reason("mdsl", running) is None


# -- arithmetic ------------------------------------------------------------------------------------

def test_input_sets_exceed_twice_the_l2_within_the_caps():
    l2 = 60 * 2**20
    assert K.input_sets(262_144, l2, 2.0, 4e9) == 480                   # nTrans bs 1: 480 × 256 KiB = 2 × L2
    assert K.input_sets(67_240_000, l2, 2.0, 4e9) == 2                  # Gated MLP: two sets are 128 MB
    assert K.input_sets(10, l2, 2.0, 4e9) == K.MAX_SETS                 # tiny: capped
    assert K.input_sets(50_000_000, l2, 2.0, 100e6) == 2                # the memory cap, but never under 2
    n = K.input_sets(2_228_224, l2, 2.0, 4e9)
    assert n * 2_228_224 >= 2 * l2 > (n - 1) * 2_228_224


def test_speed_up_and_fraction_of_the_floor():
    d = K.derive(fake_results()["cases"]["gqa_bs1"])
    # the failed compile (1 µs) is no baseline: the best is the CUDA graph's 5 µs; mdsl's best, its graph's 2 µs
    assert d["best_baseline"] == "cuda_graph" and d["best_baseline_s"] == pytest.approx(5e-6)
    assert d["mdsl_best"] == "mdsl_graph" and d["mdsl_s"] == pytest.approx(2e-6)
    assert d["speedup"] == pytest.approx(2.5)
    assert d["speedups"] == pytest.approx({"mdsl": 1.25, "mdsl_graph": 2.5})
    assert d["floor_fraction"] == pytest.approx(0.5)                    # floor 1 µs / 2 µs
    assert d["achieved_bytes_per_s"] == pytest.approx(4.25e6 / 2e-6)   # 2.125 TB/s


def test_a_slow_down_is_a_speed_up_below_one():
    d = K.derive(fake_results()["cases"]["lora"])
    assert d["speedup"] == pytest.approx(0.5) and d["speedups"] == pytest.approx({"mdsl": 0.5})
    assert d["floor_fraction"] == pytest.approx(1 / 16)


def test_ptx_over_cuda_compares_the_two_backends_of_the_same_plan():
    d = K.derive(fake_case(mdsl=contender(4.0), mdsl_ptx=contender(4.2), eager=contender(8.0)))
    assert d["ptx_over_cuda"] == pytest.approx(1.05)
    assert d["mdsl_best"] == "mdsl" and d["speedups"] == pytest.approx({"mdsl": 2.0, "mdsl_ptx": 8 / 4.2})
    assert K.derive(fake_case(mdsl=contender(4.0), mdsl_ptx=contender(1.0, "failed")))["ptx_over_cuda"] is None
    assert "| 1.05 |" in K.render_markdown({"cases": {"x": fake_case(mdsl=contender(4.0), mdsl_ptx=contender(4.2))}})


def test_the_autotuner_s_choice_or_failure_is_noted_under_the_table():
    tuned = {**fake_case(mdsl=contender(4.0)), "autotune": {"choice": "candidate 1, 2-stage pipeline", "us": 3.9}}
    failed = {**fake_case(mdsl=contender(4.0)), "autotune": {"error": "no variant ran correctly"}}
    text = K.render_markdown({"cases": {"a": tuned, "b": failed}})
    assert "- a: autotuned: candidate 1, 2-stage pipeline (3.9 µs in the tuner)" in text
    assert "- b: autotuning failed (no variant ran correctly): the plan's choice was timed" in text
    assert K.parse_args([]).autotune == 3 and K.parse_args(["--autotune", "0"]).autotune == 0


def test_no_speed_up_without_both_sides():
    assert K.derive(fake_case(eager=contender(3.0)))["speedup"] is None
    no_baseline = K.derive(fake_case(mdsl=contender(3.0), eager=contender(1.0, "failed")))
    assert no_baseline["speedup"] is None and no_baseline["speedups"] == {}
    assert no_baseline["floor_fraction"] == pytest.approx(1 / 3)
    assert K.derive({"status": "skipped"})["speedup"] is None


def test_relative_error():
    ref = np.array([3.0, 4.0])
    assert K.rel_error(ref, ref) == 0.0
    assert K.rel_error(np.array([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert math.isnan(K.rel_error(np.array([math.nan, 4.0]), ref))
    assert not K.rel_error(np.array([math.nan, 4.0]), ref) <= 3e-3       # NaN never passes


# -- rendering -------------------------------------------------------------------------------------

def test_markdown_table():
    text = K.render_markdown(fake_results())
    lines = text.splitlines()
    assert lines[0] == "# Kernel benchmark: mdsl vs PyTorch on NVIDIA H200"
    header = next(line for line in lines if line.startswith("| case |"))
    for column in ("floor µs", "eager", "CUDA graph", "compile", "compile-max", "mdsl", "mdsl graph",
                   "speed-up vs best baseline", "% of floor", "bytes", "achieved GB/s"):
        assert f"| {column} |" in header
    cells = {line.split(" | ")[0][2:]: [c.strip() for c in line.strip("| ").split(" | ")]
             for line in lines if line.startswith("| ") and not line.startswith("| case")}
    columns = [c.strip() for c in header.strip("| ").split(" | ")]
    gqa = dict(zip(columns, cells["gqa_bs1"]))
    assert gqa["floor µs"] == "1.00" and gqa["eager"] == "10.0" and gqa["CUDA graph"] == "**5.00**"
    assert gqa["compile"] == "fail" and gqa["compile-max"] == "skip" and gqa["SDPA"] == "-"
    assert gqa["mdsl"] == "4.00" and gqa["mdsl graph"] == "2.00"
    assert gqa["speed-up vs best baseline"] == "2.50×" and gqa["% of floor"] == "50%"
    assert gqa["bytes"] == "4.25 MB" and gqa["achieved GB/s"] == "2125"
    assert dict(zip(columns, cells["lora"]))["speed-up vs best baseline"] == "0.50×"
    assert dict(zip(columns, cells["ntrans_bs1"]))["speed-up vs best baseline"] == "failed"
    assert dict(zip(columns, cells["gated_mlp"]))["speed-up vs best baseline"] == "skipped"
    notes = text[text.index("Notes:"):]
    assert "gqa_bs1 / compile: failed: relative error 0.01 > 0.003" in notes
    assert "ntrans_bs1: failed: CudaError" in notes and "gated_mlp: skipped: time limit" in notes
    assert "--no-compile" not in notes and "--no-graphs" not in notes   # skipped as asked: not news


def test_the_empty_launch_is_reported_above_the_table_and_the_floors_stay():
    results = fake_results()
    plain = K.render_markdown(results)
    results["meta"]["empty_launch"] = {"median_s": 2.1e-6, "samples": 100, "batch": 10}
    text = K.render_markdown(results)
    line = next(line for line in text.splitlines() if line.startswith("An empty kernel"))
    assert "**2.10 µs** per call" in line and text.index(line) < text.index("| case |")
    assert text.replace(line + "\n\n", "") == plain   # the table and its % of floor are untouched
    results["meta"]["empty_launch"] = {"error": "CudaError: no"}
    assert K.render_markdown(results) == plain


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "results.png"
    assert K.render_plot(fake_results(), path) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_plot_without_matplotlib_says_why(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert "matplotlib" in K.render_plot(fake_results(), tmp_path / "results.png")
    assert not (tmp_path / "results.png").exists()


def test_outputs_are_strict_json_markdown_and_a_plot(tmp_path):
    results = fake_results()
    results["cases"]["lora"]["contenders"]["eager"]["rel_error"] = math.nan
    paths = K.write_outputs(results, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text(), parse_constant=pytest.fail)   # no NaN tokens
    assert data["cases"]["lora"]["contenders"]["eager"]["rel_error"] == "nan"
    assert data["cases"]["gqa_bs1"]["derived"]["speedup"] == pytest.approx(2.5)
    assert (tmp_path / "results.md").read_text() == K.render_markdown(results)
    if importlib.util.find_spec("matplotlib"):
        assert paths["png"].exists()
    else:
        assert "png" not in paths


def test_render_merges_runs(tmp_path, capsys):
    first, second = fake_results(), fake_results()
    second["cases"] = {"lora": fake_case(eager=contender(8.0), mdsl=contender(4.0)),   # replaces the first's
                       "gqa_bs1": {"status": "skipped", "reason": "time limit"},      # does not replace it
                       "gated_mlp": fake_case(eager=contender(30.0), mdsl=contender(20.0))}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(first))
    b.write_text(json.dumps(second))
    assert K.main(["--render", str(a), str(b), "--out", str(tmp_path / "out")]) == 1   # ntrans_bs1 failed
    merged = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(merged["cases"]) == ["gqa_bs1", "lora", "ntrans_bs1", "gated_mlp"]
    assert merged["cases"]["gqa_bs1"]["derived"]["speedup"] == pytest.approx(2.5)
    assert merged["cases"]["lora"]["derived"]["speedup"] == pytest.approx(2.0)
    assert merged["cases"]["gated_mlp"]["derived"]["speedup"] == pytest.approx(1.5)
    assert len(merged["meta"]["merged_from"]) == 2
    assert "| gated_mlp |" in capsys.readouterr().out


def test_render_of_a_missing_file_fails_clearly(tmp_path, capsys):
    assert K.main(["--render", str(tmp_path / "nope.json"), "--out", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err


# -- plans -----------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_plans_only_searches_then_answers_from_the_cache(tmp_path, capsys):
    argv = ["--plans-only", "--cases", "ntrans_bs1,lora", "--budget", "2", "--workers", "1", "--autotune", "1",
            "--out", str(tmp_path)]
    assert K.main(argv) == 0
    out = capsys.readouterr().out
    assert "| ntrans_bs1 | searched" in out and "| lora | searched" in out and "2/2 plan(s) ready" in out
    plans = json.loads((tmp_path / "plans.json").read_text())["plans"]
    assert set(plans) == {"ntrans_bs1", "lora"}
    for row in plans.values():
        assert row["launches"] >= 1 and row["text"].startswith("# mdsl") and row["estimate_s"] > 0
        assert "skipped" in row["cuda"] or (row["cuda"]["registers"] > 0
                                            and row["cuda"]["autotune_variants_compiled"] >= 1)

    assert K.main(argv + ["--on-miss", "fail"]) == 0   # the GPU run's lookup: both are cached now
    out = capsys.readouterr().out
    assert "| ntrans_bs1 | hit" in out and "| lora | hit" in out

    from benchmarks.cases import cases
    from mdsl.backend.cuda import runtime

    args = K.parse_args(argv)
    plan, hit = K.get_plan(cases()["lora"], K.search_config(args, runtime.target_arch()), "fail")
    assert hit and plan.original == cases()["lora"].graph


def test_a_missing_plan_fails_the_case_with_on_miss_fail(tmp_path, capsys):
    assert K.main(["--plans-only", "--cases", "lora", "--budget", "7", "--on-miss", "fail",
                   "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "lora: FAILED: PlanMissing: no plan for lora in the plan cache" in out and "0/1 plan(s) ready" in out


# -- the torch programs (only where torch is installed) ---------------------------------------------

def test_torch_programs_compute_the_cases_functions():
    torch = pytest.importorskip("torch")
    from benchmarks.cases import cases
    from mdsl.backend.reference import run_kernel_graph

    programs = K.torch_programs(torch)
    rng = np.random.default_rng(0)
    for name, kernel in cases().items():
        if name.endswith("_bs8"):
            continue
        graph = kernel.graph
        xs = [rng.standard_normal(v.type.shape).astype(np.float16) for v in graph.inputs]
        ref = run_kernel_graph(graph, xs, precision="float64")[0]
        for contender, fn in programs[K.family(name)].items():
            out = fn(*[torch.from_numpy(x).double() for x in xs]).numpy()
            assert K.rel_error(out, ref) < 1e-9, (name, contender)

"""benchmarks/torch_compile.py without a GPU: its options, the order contenders run in, the verdict on a
contender's error, what a contender that fails keeps, its table and docs/performance.md's section, and the decode workload's step set back to
its position (a tiny transformers Qwen3 on CPU tensors)."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from benchmarks import report
from benchmarks import torch_compile as bench


def test_the_defaults_are_the_acceptance_run():
    args = bench.parse_args([])
    assert (args.layers, args.context, args.prefill) == (28, 512, 512)
    assert args.contenders == list(bench.CONTENDERS) and args.workloads == ["decode", "prefill"]
    assert bench.parse_args(["--contenders", "mdsl,eager", "--workloads", "prefill"]).contenders == ["mdsl", "eager"]
    with pytest.raises(SystemExit, match="unknown contender"):
        bench.parse_args(["--contenders", "tensorrt"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--batch", "0"])


def test_the_comparison_runs_first_and_eager_leads_each_workload():
    order = bench.schedule(["decode", "prefill"], list(bench.CONTENDERS))
    assert order[:6] == [("decode", "eager"), ("decode", "inductor"), ("decode", "mdsl"),
                         ("prefill", "eager"), ("prefill", "inductor"), ("prefill", "mdsl")]
    assert sorted(order) == sorted((w, c) for w in ("decode", "prefill") for c in bench.CONTENDERS)
    # eager's logits are the reference: its step is scheduled even where it is not timed
    assert bench.schedule(["prefill"], ["mdsl"]) == [("prefill", "eager"), ("prefill", "mdsl")]


def test_a_contender_passes_within_bf16s_tolerance():
    assert bench.verdict({"l2_rel_err": 1e-2, "finite": True}, floor=3e-3) == "ok"
    assert bench.verdict({"l2_rel_err": 3e-2, "finite": True}, floor=3e-3) == \
        "wrong: L2 relative error 3.00e-02 over 2.0e-02"
    assert bench.verdict({"l2_rel_err": 3e-2, "finite": True}, floor=2e-2) == "ok"   # bf16's own error is larger
    assert bench.verdict({"l2_rel_err": 0.0, "finite": False}, floor=None) == "wrong: non-finite logits"


def test_a_contender_that_fails_keeps_its_warnings_and_what_the_mdsl_backend_made_of_the_model(monkeypatch):
    torch = pytest.importorskip("torch")
    handoff = "40 op(s) run as torch's eager operators: Inductor failed (ValueError: Cannot view a tensor)"

    def contender(torch, name, model, args, graphs, fullgraph=True):
        def call():
            graphs.append(SimpleNamespace(regions=(), left={}, handoff=handoff))
            warnings.warn("mdsl backend: Inductor failed (ValueError: Cannot view a tensor)")
            raise RuntimeError("view size is not compatible with input tensor's size and stride")
        return call

    monkeypatch.setattr(bench, "make_contender", contender)
    rec: dict = {}
    with pytest.raises(RuntimeError, match="view size"):
        bench.measure(torch, SimpleNamespace(reset=lambda: None, call=lambda fn: fn()), "mdsl", None, None, None, rec)
    assert rec["mdsl"]["handoffs"] == [handoff] and "Inductor failed" in rec["warnings"][0]
    rec.update(status="error", error="RuntimeError: view size is not compatible")
    assert "Inductor failed (ValueError: Cannot view a tensor)" in bench.notes_of(rec)


def _results() -> dict:
    ok = {"status": "ok", "ms": 2.0, "p10_ms": 1.9, "p90_ms": 2.2, "compile_s": 40.0, "max_abs_err": 0.02,
          "max_rel_err": 0.004, "l2_rel_err": 0.006, "argmax_match": True, "fullgraph": True}
    return {"schema": 1, "meta": {"date": "2026-12-03T00:00:00+00:00", "command": "benchmarks/torch_compile.py",
                                  "mdsl_commit": "abcdef1", "gpu": {"name": "NVIDIA H200"}, "layers": 28,
                                  "samples": 30, "batch": 8, "torch": "2.11.0", "transformers": "5.17.0"},
            "workloads": {"decode": {"what": "one token", "bf16_floor": 3e-3, "contenders": {
                "eager": {**ok, "ms": 8.0}, "inductor": ok,
                "mdsl": {**ok, "ms": 0.5, "mdsl": {"graphs": 1, "regions": 57, "distinct_regions": 5,
                                                   "region_ops": 900, "left_to_torch": 200, "replays": 0,
                                                   "handoffs": ["Inductor compiled 200 op(s) around the regions "
                                                                "in 30 s; its calls replay a CUDA graph"]}},
                "max-autotune": {"status": "error", "error": "RuntimeError: out of | memory"},
                "reduce-overhead": {"status": "skipped", "error": "not started: 500 s past"}}}}}


def test_the_table_shows_times_speed_ups_errors_and_what_went_wrong():
    table = bench.markdown(_results())
    lines = table.splitlines()
    assert "| inductor | 2.000 | 1.900–2.200 | 1.00× | 40.0 | 2.0e-02 | 4.0e-03 | 6.0e-03 | yes | ok |  |" in lines
    mdsl_row = next(line for line in lines if line.startswith("| mdsl |"))
    assert "| 4.00× |" in mdsl_row and "57 regions (5 distinct)" in mdsl_row and "replay a CUDA graph" in mdsl_row
    error_row = next(line for line in lines if line.startswith("| max-autotune |"))
    assert "| — | — | — |" in error_row and "out of \\| memory" in error_row
    assert "bf16's own error (eager bf16 against float32, L2): 3.0e-03" in table


def test_the_performance_page_has_the_section_with_or_without_results():
    missing = report.torch_compile_section([])
    assert missing[0] == "## torch.compile: the mdsl backend against Inductor" and "has not run" in missing[2]
    text = "\n".join(report.torch_compile_section([_results()]))
    assert text.count("\nRun: 2026-12-03, NVIDIA H200, commit `abcdef1`") == 1
    assert "| 1 | decode | mdsl | 0.500 | 4.00× | - | 40.0 | 6.0e-03 | yes | 57 (5 distinct), 200 ops to torch | ok |" \
        in text
    assert "| 1 | decode | max-autotune | - | - | - | - | - | - | - | error: RuntimeError: out of \\| memory |" in text
    assert "decode: one token; bf16's own L2 error (eager against float32) 3.0e-03." in text


def test_a_workload_s_own_run_joins_the_table_with_its_run_line():
    prefill = _results()
    prefill["meta"] = {**prefill["meta"], "mdsl_commit": "1234567", "command": "benchmarks/torch_compile.py "
                                                                                "--workloads prefill"}
    prefill["workloads"] = {"prefill": prefill["workloads"]["decode"]}
    text = "\n".join(report.torch_compile_section([_results(), prefill]))
    assert text.count("\nRun: 2026-12-03, NVIDIA H200, commit `abcdef1`") == 1
    assert "\nRun: 2026-12-03, NVIDIA H200, commit `1234567`, `python benchmarks/torch_compile.py --workloads " \
           "prefill`" in text
    assert "| 1 | decode | mdsl | 0.500 | 4.00× |" in text and "| 2 | prefill | mdsl | 0.500 | 4.00× |" in text
    h = report.headlines({"torch_compile": [_results(), prefill]})
    assert (h["torch_compile_decode"], h["torch_compile_prefill"]) == ("4.00×", "4.00×")
    assert (h["torch_compile_decode_ms_mdsl"], h["torch_compile_prefill_ms_eager"]) == ("0.50 ms", "8.00 ms")


def test_a_later_run_of_the_same_workload_adds_rows_without_a_speed_up_it_lacks_the_base_of():
    graphs = _results()
    graphs["meta"] = {**graphs["meta"], "mdsl_commit": "7654321"}
    graphs["workloads"]["decode"]["contenders"] = {
        "eager": {"status": "ok", "ms": 9.0}, "reduce-overhead": {"status": "ok", "ms": 0.25, "compile_s": 20.0,
                                                                  "kernels": [{"us_per_call": 150.0},
                                                                              {"us_per_call": 50.0}]}}
    text = "\n".join(report.torch_compile_section([_results(), graphs]))
    assert "| 1 | decode | mdsl | 0.500 | 4.00× |" in text   # the first run's rows stay
    assert "| 2 | decode | reduce-overhead | 0.250 | - | 0.200 | 20.0 |" in text
    assert "commit `7654321`, `python benchmarks/torch_compile.py`. Its rows: run 2." in text
    h = report.headlines({"torch_compile": [_results(), graphs]})
    assert h["torch_compile_decode"] == "4.00×" and h["torch_compile_decode_ms_reduce-overhead"] == "0.25 ms"
    later = _results()
    later["workloads"]["decode"]["contenders"]["mdsl"] = {**later["workloads"]["decode"]["contenders"]["mdsl"],
                                                          "ms": 0.25}
    h = report.headlines({"torch_compile": [_results(), graphs, later]})   # the latest run's figures
    assert (h["torch_compile_decode"], h["torch_compile_decode_ms_mdsl"]) == ("8.00×", "0.25 ms")


class _Event(SimpleNamespace):
    pass


def test_a_profile_keeps_the_costliest_kernels_per_call(monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.profiler

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    # two calls: per call 3 launches of a GEMM (10 µs each), one transpose of 40 µs, 30 small kernels of 1 µs
    events = ([_Event(name="gemm", device_type=cuda, device_time_total=10.0)] * 6
              + [_Event(name="transpose", device_type=cuda, device_time_total=40.0)] * 2
              + [_Event(name=f"k{i}", device_type=cuda, device_time_total=1.0) for i in range(30)] * 2
              + [_Event(name="aten::mm", device_type=cpu, device_time_total=0.0)])

    class FakeProfile:
        def __init__(self, activities):
            assert activities == [torch.profiler.ProfilerActivity.CUDA]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    workload = SimpleNamespace(reset=lambda: None, call=lambda fn: calls.append(fn))
    rows = bench.kernel_profile(torch, workload, "fn", calls=2)
    assert len(calls) == 3   # one before the profile, two in it
    assert rows[:2] == [{"kernel": "transpose", "launches_per_call": 1.0, "us_per_call": 40.0},
                        {"kernel": "gemm", "launches_per_call": 3.0, "us_per_call": 30.0}]
    assert len(rows) == bench.PROFILED_KERNELS + 1
    assert rows[-1] == {"kernel": "(7 others)", "launches_per_call": 7.0, "us_per_call": 7.0}
    results = _results()
    results["workloads"]["decode"]["contenders"]["mdsl"]["kernels"] = rows
    table = bench.markdown(results)
    assert "mdsl's kernels (GPU µs per call, torch.profiler):" in table and "| `transpose` | 1 | 40.0 |" in table


def test_the_decode_step_is_set_back_to_its_position():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval().to(torch.bfloat16)
    decode = bench.Decode(torch, transformers, model, context=10, calls=3)
    assert decode.length == 13 and decode.cache.layers[0].keys.shape[2] == 13
    with torch.no_grad():
        decode.reset()
        first = decode.call(model)
        second = decode.call(model)   # the next position: another step
        decode.reset()
        again = decode.call(model)
    assert [int(layer.cumulative_length) for layer in decode.cache.layers] == [11, 11]
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert not torch.equal(second, first)

"""benchmarks/serve.py without a GPU: the arguments, the seeded workload, the summaries, the tables of both
devices, the step counter's slope, the run over the devices (a fake measurement in place of the GPU's), and
the decode measurement on the CPU device."""
from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import pytest

from benchmarks import serve as S
from mdsl.errors import UnsupportedError


def test_the_devices_are_both_by_default_or_those_named():
    assert S.parse_args([]).device == ["gpu", "megakernel"]
    assert S.parse_args(["--device", "megakernel"]).device == ["megakernel"]
    assert S.parse_args(["--device", "megakernel,gpu,gpu"]).device == ["megakernel", "gpu"]
    for bad in ("cpu", "", "gpu,mega"):
        with pytest.raises(SystemExit):
            S.parse_args(["--device", bad])


def test_the_workload_is_seeded_and_within_its_ranges():
    args = S.parse_args(["--requests", "50", "--prompt-len", "3:9", "--output-len", "2:4", "--seed", "5"])
    work = S.workload(args, vocab=100)
    assert work == S.workload(args, vocab=100) and len(work) == 50
    assert all(3 <= len(p) <= 9 and 2 <= n <= 4 and all(0 <= t < 100 for t in p) for p, n in work)
    assert work != S.workload(S.parse_args(["--requests", "50", "--prompt-len", "3:9", "--output-len", "2:4"]), 100)


def test_a_summary_counts_tokens_and_times_from_the_records():
    records = [{"start": 0.0, "times": [1.0, 1.5, 2.0], "expected": 3}, {"start": 1.0, "times": [1.5, 3.5], "expected": 4}]
    s = S.summary("offline", records)
    assert s["output_tokens"] == 5 and s["wall_s"] == 3.5 and s["short"] == 1
    assert s["ttft_p50_s"] == 0.75 and s["tpot_p50_s"] == 1.25


def _decode(device: str, batch: int, step_s: float, **extra) -> dict:
    return {"device": device, "batch": batch, "context": 1024, "mean_context": 1040.4, "steps": 31, "step_s": step_s,
            "floor_s": 0.001, **extra}


def _run(device: str, name: str, tpot: float) -> dict:
    return {"device": device, **S.summary(name, [{"start": 0.0, "times": [0.1, 0.1 + tpot], "expected": 2}])}


def test_the_tables_show_both_devices_side_by_side():
    result = {"model": "qwen3-0.6b",
              "devices": {"gpu": {"steps": 900, "replayed": 850},
                          "megakernel": {"steps": 1200, "launches": 1, "steps_per_launch": 32537631}},
              "decode": [_decode("gpu", 8, 0.004, ops_us={"linear": 1500.0}), _decode("megakernel", 8, 0.002)],
              "runs": [_run("gpu", "offline", 0.2), _run("gpu", "online 4/s", 0.3),
                       _run("megakernel", "offline", 0.1), _run("megakernel", "online 4/s", 0.15)]}
    text = S.tables(result)
    assert ("| batch | prompts | mean context | floor | gpu step | gpu % of floor | gpu tokens/s | megakernel step "
            "| megakernel % of floor | megakernel tokens/s | PyTorch step | PyTorch / gpu | PyTorch / megakernel |") \
        in text
    assert "| 8 | 1024 | 1040 | 1.000 ms | 4.00 ms | 25% | 2000 | 2.00 ms | 50% | 4000 | - | - | - |" in text
    for d in result["decode"]:
        d["torch_step_s"] = 0.006
    assert "| 8 | 1024 | 1040 | 1.000 ms | 4.00 ms | 25% | 2000 | 2.00 ms | 50% | 4000 | 6.00 ms | 1.50 | 3.00 |" \
        in S.tables(result)
    # the op profile is the GPU device's only
    assert "| batch | linear | sum |" in text and "| 8 | 1500 | 1500 |" in text and text.count("| 8 | 1500") == 1
    # each run's devices on adjacent rows
    runs = [line.split(" | ")[:2] for line in text.splitlines() if line.startswith(("| offline", "| online"))]
    assert runs == [["| offline", "gpu"], ["| offline", "megakernel"], ["| online 4/s", "gpu"],
                    ["| online 4/s", "megakernel"]]
    assert "- megakernel: 1 kernel launch for the run's 1200 steps" in text
    assert "- gpu: 900 steps, 850 of them replayed as a CUDA graph" in text


def test_a_device_without_results_shows_why_and_its_columns_stay_out():
    result = {"model": "qwen3-0.6b", "devices": {"gpu": {"steps": 90, "replayed": 80},
                                                 "megakernel": {"unsupported": "no body for X"}},
              "decode": [_decode("gpu", 1, 0.002)], "runs": []}
    text = S.tables(result)
    assert "- megakernel: cannot serve the model: no body for X" in text
    assert "megakernel step" not in text and "| 1 | 1024 | 1040 | 1.000 ms | 2.00 ms | 50% | 500 | - | - |" in text


def test_results_from_before_the_megakernel_read_as_the_gpu_devices():
    result = {"model": "qwen3-0.6b", "decode": [{k: v for k, v in _decode("gpu", 8, 0.004).items() if k != "device"}],
              "runs": [S.summary("offline", [{"start": 0.0, "times": [0.1, 0.2], "expected": 2}])]}
    text = S.tables(result)
    assert "| 8 | 1024 | 1040 | 1.000 ms | 4.00 ms | 25% | 2000 | - | - |" in text
    assert "| offline | gpu | 1 | 2 |" in text


def test_the_slope_is_the_least_squares_time_per_count():
    samples = [(10.0 + 0.002 * k + (0.0004 if k == 5 else 0.0), k) for k in range(100, 165)]
    assert S.slope(samples) == pytest.approx(0.002, rel=0.01)
    assert S.slope([(1.0, 3), (1.5, 4), (2.5, 6)]) == pytest.approx(0.5)


def test_the_step_counter_is_followed_from_its_next_change_for_the_steps_asked():
    control = np.zeros(1, dtype=[("steps", np.uint64)])
    stop = threading.Event()

    def device():
        while not stop.is_set():
            control["steps"][0] += 1
            time.sleep(0.001)

    thread = threading.Thread(target=device)
    thread.start()
    try:
        step_s, steps = S.step_counter_slope(control, 20)
    finally:
        stop.set()
        thread.join()
    assert steps >= 20 and step_s > 0


def test_a_stalled_step_counter_fails(monkeypatch):
    monkeypatch.setattr(S, "STALL_S", 0.01)
    with pytest.raises(RuntimeError, match="stayed at 7"):
        S.step_counter_slope(np.full(1, 7, dtype=[("steps", np.uint64)]), 5)


def test_the_run_measures_each_device_records_an_unsupported_one_and_writes_both(tmp_path, monkeypatch):
    """main over both devices, each device's measurement faked: the GPU's rows, the megakernel refused; the
    results are written after each device, and PyTorch's step (faked) is timed once per point."""
    measured, torch_points = [], []

    def measure(device, folder, engine, args, parts, points, requests, result):
        measured.append(device)
        if device == "megakernel":   # the GPU device's results are written already
            assert json.loads((tmp_path / "serve.json").read_text())["devices"] == {"gpu": {"steps": 10, "replayed": 9}}
            raise UnsupportedError("the serving kernel has no body for X")
        for batch, context in points:
            result["decode"].append(_decode(device, batch, 0.001 * batch))
        result["runs"].append(_run(device, "offline", 0.1))
        result["devices"][device] = {"steps": 10, "replayed": 9}

    def torch_baseline(model):
        return lambda batch, context: torch_points.append((batch, context)) or 0.005

    monkeypatch.setattr(S, "random_checkpoint", lambda name, folder, layers=None: None)
    monkeypatch.setattr(S, "measure", measure)
    monkeypatch.setattr(S, "torch_baseline", torch_baseline)
    assert S.main(["--batches", "1,8", "--long-contexts", "", "--requests", "4", "--out", str(tmp_path)]) == 0
    assert measured == ["gpu", "megakernel"]
    result = json.loads((tmp_path / "serve.json").read_text())
    assert result["devices"] == {"gpu": {"steps": 10, "replayed": 9},
                                 "megakernel": {"unsupported": "the serving kernel has no body for X"}}
    assert [(d["device"], d["batch"], d["torch_step_s"]) for d in result["decode"]] == [("gpu", 1, 0.005),
                                                                                       ("gpu", 8, 0.005)]
    assert torch_points == [(1, 1040), (8, 1040)]
    assert (tmp_path / "serve.md").read_text() == S.tables(result) + "\n"


def test_both_devices_rows_share_one_pytorch_step_per_point(tmp_path, monkeypatch):
    torch_points = []

    def measure(device, folder, engine, args, parts, points, requests, result):
        result["decode"].append({**_decode(device, 4, 0.002), "mean_context": 1040.0 if device == "gpu" else 1046.0})
        result["devices"][device] = ({"steps": 10, "launches": 1, "steps_per_launch": 99} if device == "megakernel"
                                     else {"steps": 10, "replayed": 9})

    monkeypatch.setattr(S, "random_checkpoint", lambda name, folder, layers=None: None)
    monkeypatch.setattr(S, "measure", measure)
    monkeypatch.setattr(S, "torch_baseline", lambda model: lambda b, c: torch_points.append((b, c)) or 0.004)
    S.main(["--batches", "4", "--long-contexts", "", "--requests", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "serve.json").read_text())
    assert torch_points == [(4, 1043)] and [d["torch_step_s"] for d in result["decode"]] == [0.004, 0.004]


def test_a_whole_run_of_both_devices_on_the_cpu_device(tmp_path, monkeypatch):
    """main and measure end to end on a tiny Qwen3 (random weights at its shapes), each device played by the
    CPU device (the GPU device's op profile and replays, the megakernel's launches and kernel stubbed): every
    part's rows for both devices, each device's launches, the megakernel's kernel closed once it stopped."""
    import mdsl
    from mdsl.megakernel.runtime import models
    from tests.megakernel.tiny import tiny_config_dict

    closed = []

    class OnTheCpu(mdsl.LLM):
        def __init__(self, folder, device, **engine):
            super().__init__(folder, device="cpu", **engine)
            if device == "megakernel":
                self.device.launches = 1
                self.device.profile, self.device.profile_records = (lambda on: None), (lambda: {})
                self.device.kernel = type("Kernel", (), {"steps_per_launch": 99})()
                self.device.close = lambda: closed.append(self.device.alive)
            else:
                self.device.replays = 0
                self.device.profile_ops = lambda on, kernels=False: {"linear: linear_bf16": (10.0, 3),
                                                                     "linear: add": (2.5, 3)}

    monkeypatch.setitem(models.MODELS, "tiny-qwen3", tiny_config_dict("qwen3", max_position_embeddings=512))
    monkeypatch.setattr(mdsl, "LLM", OnTheCpu)
    S.main(["--model", "tiny-qwen3", "--batches", "1,3", "--context", "20", "--long-contexts", "40",
            "--decode-tokens", "3", "--requests", "5", "--prompt-len", "4:9", "--output-len", "2:5", "--rates", "200",
            "--max-batch", "4", "--mixed-batch", "2", "--mixed-decode-prompt", "5", "--mixed-prompt", "300",
            "--mixed-window", "3", "--no-torch", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "serve.json").read_text())
    assert [(d["device"], d["batch"], d["context"]) for d in result["decode"]] == [
        (device, b, c) for device in ("gpu", "megakernel") for b, c in ((1, 20), (3, 20), (1, 40))]
    # (an op's time is its kernels')
    assert all(d["ops_us"] == {"linear": 12.5} and d["steps"] >= 3 for d in result["decode"][:3])
    assert all(d["kernels_us"] == {"linear: linear_bf16": 10.0, "linear: add": 2.5} for d in result["decode"][:3])
    assert all(d["launches"] == 0 and d["steps"] >= 6 for d in result["decode"][3:])
    assert [(r["device"], r["run"], r["output_tokens"], r["short"]) for r in result["runs"]] == [
        (device, run, sum(n for _, n in S.workload(S.parse_args(["--requests", "5", "--prompt-len", "4:9",
                                                                 "--output-len", "2:5"]), 96)), 0)
        for device in ("gpu", "megakernel") for run in ("offline", "online 200/s")]
    gpu, megakernel = result["devices"]["gpu"], result["devices"]["megakernel"]
    assert gpu["replayed"] == 0 and gpu["steps"] > 0 and megakernel["launches"] == 1 and megakernel["steps"] > 0
    assert megakernel["steps_per_launch"] == 99 and closed == [False]
    assert "| batch | prompts | mean context | floor | gpu step" in (tmp_path / "serve.md").read_text()
    mixed = result["mixed"]
    assert [(r["device"], r["batch"], r["prompt"]) for r in mixed] == [("gpu", 2, 300), ("megakernel", 2, 300)]
    assert all(r["steps"] >= 2 and 0 < r["tpot_before_s"] and r["tpot_mixed_s"] <= r["tpot_mixed_worst_s"]
               and r["ttft_s"] > 0 for r in mixed)
    # the GPU device's op profile of the steps that read the prompt again (the stub's), none of the megakernel's
    assert mixed[0]["ops_us"] == {"linear": 12.5} and "ops_us" not in mixed[1]
    assert mixed[0]["kernels_us"] == {"linear: linear_bf16": 10.0, "linear: add": 2.5}
    assert "| device | decoders | their prompts | prompt | steps | TPOT before" in (tmp_path / "serve.md").read_text()
    assert "Where a step that reads the prompt goes (gpu, the prompt read again, µs a step): linear 12." in \
        (tmp_path / "serve.md").read_text()


@pytest.mark.parametrize("device", ["gpu", "megakernel"])
def test_every_timed_decode_step_has_the_whole_batch(tmp_path, device):
    """decode_steps on the CPU device (the GPU device's op profile and graph replays, the megakernel's launches
    stubbed): the prompts are read oldest first, so the first requests decode while the last ones' prompts are
    read; none may end before the timed (and profiled) steps are over, and all are cancelled after."""
    from mdsl import LLM
    from tests.serving.conftest import write_checkpoint

    ckpt = write_checkpoint(tmp_path, "qwen3", positions=400, torch_dtype="float32")
    batch, context, tokens = 6, 40, 5
    with LLM(ckpt.folder, device="cpu", max_batch=8, max_seq=400, max_tokens_per_step=32) as llm:
        llm.device.profile_ops = lambda on, kernels=False: {}
        llm.device.replays = 0
        llm.device.launches = 1
        llm.device.profile, llm.device.profile_records = (lambda on: None), (lambda: {})
        d = S.decode_steps(llm, device, batch, context, tokens, 96, 0)
        assert d["device"] == device and d["batch"] == batch
        assert d["steps"] >= (2 * tokens if device == "megakernel" else tokens) and d["step_s"] > 0
        assert ("launches" in d, "ops_us" in d) == ((True, False) if device == "megakernel" else (False, True))
        assert context < d["mean_context"] < context + S.decode_budget(32, batch, context, tokens)
        assert llm.stats().running == 0 and llm.stats().peak_running == batch


def _both_devices() -> dict:
    return {"model": "qwen3-0.6b", "meta": {"date": "2026-12-02T00:00:00+00:00", "command": "benchmarks/serve.py"},
            "devices": {"gpu": {"steps": 900, "replayed": 850},
                        "megakernel": {"steps": 1200, "launches": 1, "steps_per_launch": 32537631}},
            "decode": [_decode("gpu", 1, 0.002, ops_us={"linear": 700.0}, torch_step_s=0.004),
                       _decode("megakernel", 1, 0.001, torch_step_s=0.004),
                       _decode("gpu", 64, 0.01, torch_step_s=0.006),
                       _decode("megakernel", 64, 0.004, torch_step_s=0.006)],
            "runs": [_run("gpu", "offline", 0.2), _run("megakernel", "offline", 0.1)]}


def test_the_reports_serve_section_shows_both_devices():
    from benchmarks import report

    text = "\n".join(report.serve_section(_both_devices()))
    assert "`LLM(device=\"gpu\")`" in text and "`LLM(device=\"megakernel\")`" in text
    assert ("| batch | prompt | mean context | floor ms | gpu ms | gpu of floor | gpu tokens/s | megakernel ms | "
            "megakernel of floor | megakernel tokens/s | PyTorch ms | PyTorch / gpu | PyTorch / megakernel |") in text
    assert "| 1 | 1024 | 1040 | 1.000 | 2.00 | 50% | 500 | 1.00 | 100% | 1000 | 4.00 | 2.00× | 4.00× |" in text
    assert "| 64 | 1024 | 1040 | 1.000 | 10.00 | 10% | 6400 | 4.00 | 25% | 16000 | 6.00 | 0.60× | 1.50× |" in text
    assert "CUDA graph). Launches: gpu: " in text and "; megakernel: 1 kernel launch for the run's 1200 steps" in text
    assert ("| run | requests | output tokens | gpu tokens/s | gpu TTFT p50 ms | gpu TTFT p99 ms | gpu TPOT p50 ms | "
            "gpu TPOT p99 ms | gpu short | megakernel tokens/s |") in text
    assert re.search(r"\| offline \| 1 \| 2 \| [0-9]+ \| [^|]+\| [^|]+\| [^|]+\| [^|]+\| 0 \| [0-9]+ \|", text)
    assert "| batch | linear | sum |" in text and "| 1 | 700 | 700 |" in text


def test_the_reports_serve_headlines_are_each_devices():
    from benchmarks import report

    h = report.headlines({"serve": _both_devices()})
    assert (h["serve_step_one"], h["serve_step_most"], h["serve_floor_most"]) == ("2.0 ms", "10.0 ms", "10%")
    assert (h["serve_megakernel_step_one"], h["serve_megakernel_step_most"]) == ("1.0 ms", "4.0 ms")
    data = _both_devices()
    data["devices"]["megakernel"] = {"unsupported": "no body for X"}
    data["decode"] = [d for d in data["decode"] if d["device"] == "gpu"]
    h = report.headlines({"serve": data})
    assert h["serve_step_one"] == "2.0 ms" and "serve_megakernel_step_one" not in h
    assert "; megakernel: cannot serve the model: no body for X." in "\n".join(report.serve_section(data))


def test_the_reports_serve_plot_draws_both_devices(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import report

    assert report.plot_serve(_both_devices(), tmp_path / "serve.png") is None
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert report.plot_serve({"decode": []}, tmp_path / "none.png") is not None


def test_the_megakernels_profile_is_of_its_last_complete_step_and_shows_in_the_tables(tmp_path):
    """kernel_profile: profile on for PROFILED_STEPS steps, off, then the ring's last complete step: its span,
    SCHEDULE's body and the layer phases; the trace of that step; the tables' megakernel section."""
    import numpy as np

    from mdsl.megakernel.runtime.profile import TaskRecord

    kinds = ("schedule", "qkv", "attn", "qkv", "attn", "lmhead")
    layers = (0, 0, 0, 1, 1, 2)

    class Control:
        def __init__(self):
            self.steps = 0

        def __getitem__(self, name):
            self.steps += 1     # (each look: a step later)
            return np.array([self.steps])

    class Device:
        def __init__(self):
            self.host, self.switched = {"control": Control()}, []

        def profile(self, on):
            self.switched.append((on, self.host["control"].steps))

        def profile_records(self):
            def step(s, t0):
                # (SCHEDULE's marks: its parts of 100, 200, 300 and 100 ns)
                marks = {0: (t0 + 300, t0 + 500, t0 + 800)}
                return [TaskRecord(s * 6 + k, k, t0 + 1000 * k, t0 + 1000 * k + 100, t0 + 1000 * k + 200,
                                   t0 + 1000 * k + 900, marks.get(k, ())) for k in range(6)]
            return {3: step(3, 0), 4: step(4, 10_000)}

        def profile_tasks(self):
            return tuple(f"{k} L{l}" for k, l in zip(kinds, layers)), kinds, layers

    device = Device()
    trace = tmp_path / "t" / "trace.json"
    profile = S.kernel_profile(device, trace)
    (on, at_on), (off, at_off) = device.switched
    assert on and not off and at_off - at_on >= S.PROFILED_STEPS
    assert profile["step_span_us"] == 5.9 and profile["schedule_us"] == 0.7
    assert profile["schedule_parts_us"] == {"previous step's end": 0.1, "plan": 0.2, "pool check": 0.3,
                                            "attention items, embeddings": 0.1}
    assert profile["phases_us"]["qkv"]["span_us"] == 0.7 and profile["phases_us"]["qkv"]["gap_us"] == 0.3
    assert json.loads(trace.read_text())["traceEvents"]
    result = {"model": "qwen3-0.6b", "devices": {},
              "decode": [{**_decode("megakernel", 1, 0.002), **profile}]}
    text = S.tables(result)
    assert "Where the megakernel's decode step goes" in text
    assert "| 1 | 1024 | 6 | 1 (0 / 0 / 0 / 0) | 0.7 / 0.3 |" in text


def test_a_run_cut_short_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """serve.json is written after every decode point and run: where the run stops on its way (a time limit, an
    error), the file holds the rows measured so far and the device it was on reads as incomplete."""
    import mdsl
    from mdsl.megakernel.runtime import models
    from tests.megakernel.tiny import tiny_config_dict

    class OnTheCpu(mdsl.LLM):
        def __init__(self, folder, device, **engine):
            super().__init__(folder, device="cpu", **engine)
            self.device.replays, self.device.profile_ops = 0, lambda on, kernels=False: {"linear: linear": (12.5, 3)}

    calls = []

    def decode_steps(llm, device, batch, context, *args, **kwargs):
        calls.append(batch)
        if len(calls) == 2:
            raise RuntimeError("cut")
        return {"device": device, "batch": batch, "context": context, "mean_context": float(context),
                "steps": 3, "step_s": 0.001}

    monkeypatch.setitem(models.MODELS, "tiny-qwen3", tiny_config_dict("qwen3", max_position_embeddings=512))
    monkeypatch.setattr(mdsl, "LLM", OnTheCpu)
    monkeypatch.setattr(S, "decode_steps", decode_steps)
    with pytest.raises(RuntimeError, match="cut"):
        S.main(["--model", "tiny-qwen3", "--device", "gpu", "--batches", "1,3", "--context", "20", "--long-contexts",
                "", "--requests", "2", "--prompt-len", "4:9", "--output-len", "2:5", "--max-batch", "4", "--parts",
                "a,b,c", "--no-torch", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "serve.json").read_text())
    assert [d["batch"] for d in result["decode"]] == [1] and result["devices"] == {"gpu": {"incomplete": S.INCOMPLETE}}
    assert f"- gpu: {S.INCOMPLETE}" in (tmp_path / "serve.md").read_text()


def test_the_mean_gap_counts_every_gap_that_overlaps_the_span():
    times = [0.0, 1.0, 3.0, 6.0, 10.0]
    assert S.mean_gap(times, 0.5, 2.0) == (1.0 + 2.0) / 2      # (0, 1) and (1, 3) overlap (0.5, 2)
    assert S.mean_gap(times, 3.0, 6.0) == 3.0                  # only (3, 6)
    assert S.mean_gap(times, 10.0, 12.0) is None and S.mean_gap([1.0], 0.0, 2.0) is None


def test_the_mixed_run_needs_room_for_its_decoders_and_the_prompt():
    with pytest.raises(SystemExit, match="max-batch"):
        S.main(["--parts", "d", "--mixed-batch", "64", "--max-batch", "64"])


def test_the_reports_serve_section_shows_the_mixed_run():
    from benchmarks import report

    data = {"meta": None, "model": "qwen3-0.6b", "decode": [], "runs": [], "devices": {},
            "mixed": [{"device": "gpu", "batch": 32, "decode_prompt": 128, "prompt": 4096, "window": 32, "steps": 19,
                       "tpot_before_s": 0.01, "tpot_mixed_s": 0.015, "tpot_mixed_worst_s": 0.02, "ratio": 1.5,
                       "ratio_worst": 2.0, "ttft_s": 0.4}]}
    text = "\n".join(report.serve_section(data))
    assert "| gpu | 32 | 128 | 4096 | 19 | 10.00 | 15.00 | 20.00 | 1.50× | 2.00× | 400.0 |" in text


def test_the_weights_folder_is_removed_when_timeout_ends_the_run(tmp_path):
    """SIGTERM (what `timeout` sends) ends a benchmark inside scratch_folder with its folder removed."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(S.__file__).resolve().parents[1]
    code = ("import sys, time\n"
            f"sys.path.insert(0, {str(root)!r})\n"
            "from benchmarks.serve_http import scratch_folder\n"
            f"with scratch_folder('mdsl-weights-') as folder:\n"
            "    open(folder + '/weights', 'wb').write(b'x' * 1000)\n"
            "    print(folder, flush=True)\n"
            "    time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    folder = child.stdout.readline().strip()
    assert os.path.exists(os.path.join(folder, "weights"))
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
    assert not os.path.exists(folder)

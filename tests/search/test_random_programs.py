"""Programs the search has never seen (benchmarks/random_programs.py): the generator is a function of its
seed, and on small random programs the search's plan never has more kernels or a higher estimated time
than the original, and computes it."""
from __future__ import annotations

import attrs
import numpy as np
import pytest

import mdsl
from benchmarks import random_programs as rp
from mdsl import Tensor, f16
from mdsl.backend.reference import run_kernel_graph
from mdsl.ir.validate import validate_kernel_graph
from mdsl.search import partition
from mdsl.search.config import SearchConfig
from mdsl.search.cost import estimate
from mdsl.search.engine import search
from mdsl.search.stats import SearchStats

SMALL = dict(rows=(1, 2, 4), hidden=(16, 32))   # the LLM shapes' structure at a test's sizes


def test_a_seed_and_an_index_decide_the_program():
    first = [rp.draw(7, i).source() for i in range(20)]
    assert first == [rp.draw(7, i).source() for i in range(20)]
    assert first != [rp.draw(8, i).source() for i in range(20)]
    assert len(set(first)) == 20


def test_programs_trace_to_valid_graphs_of_3_to_12_operators_over_llm_shapes():
    kinds = set()
    for i in range(40):
        program = rp.draw(3, i)
        graph = program.kernel().graph
        validate_kernel_graph(graph)
        assert rp.MIN_OPS <= len(graph.nodes) <= rp.MAX_OPS, program.source()
        assert program.rows in rp.ROWS and graph.inputs[0].shape[1] in rp.HIDDEN
        assert all(v.type.rank <= 3 and v.type.numel <= max(rp.HIDDEN) ** 2 for v in graph.inputs)
        kinds |= {n.opdef.category for n in graph.nodes}
    assert kinds >= {"matmul", "elementwise", "reduction", "norm", "layout"}


def test_the_float_check_passes_the_program_itself_and_fails_another_function():
    def make(activation):
        @mdsl.kernel(name="layer")
        def layer(x: Tensor[4, 32, f16], w0: Tensor[32, 16, f16]):
            return activation(x @ w0)
        return layer.graph

    program = rp.RandomProgram("layer", 4, roles={"x": "activation", "w0": "weight"})
    graph = make(mdsl.silu)
    plan = search(graph, SearchConfig(budget_s=30, workers=1), generators=[]).plan()
    inputs = rp.float_inputs(program, graph, 0)
    assert rp.float_check(plan, inputs)[0]
    assert not rp.float_check(attrs.evolve(plan, graph=make(mdsl.gelu)), inputs)[0]


def test_the_summary_counts_fusions_failures_and_overruns():
    rows = [{"kernels_before": 5, "kernels_after": 2, "estimate_before_us": 9.0, "estimate_after_us": 4.0,
             "search_s": 10.0, "over_cap_s": 0.0, "provisional": False, "float_ok": True, "fused": True,
             "boundaries": ["transpose %t is a layout change without a block-level rule"]},
            {"kernels_before": 3, "kernels_after": 3, "estimate_before_us": 5.0, "estimate_after_us": 5.0,
             "search_s": 126.0, "over_cap_s": 6.0, "provisional": True, "float_ok": True, "fused": False,
             "boundaries": ["the search's time cap ran out before the part joining them was tried"]}]
    summary = rp.summarise(rows, 120.0)
    assert summary["fused"] == 1 and summary["fused_fraction"] == 0.5 and summary["over_cap"] == 1
    assert summary["kernels_removed_histogram"] == {"0": 1, "3": 1} and summary["worse"] == 0
    assert summary["boundary_reasons"] == {"layout op": 1, "time cap": 1}


def test_a_contender_that_fails_is_its_row_s_error_and_leaves_the_program_uncompared():
    out = {}
    rp.attempt(out, "mdsl", lambda: 10.0)
    rp.attempt(out, "eager", lambda: 30.0)

    def refused():
        raise RuntimeError("operation failed due to a previous error during capture")

    rp.attempt(out, "cuda_graph", refused)
    assert out["mdsl_us"] == 10.0 and out["cuda_graph_us"] is None and "capture" in out["cuda_graph_error"]
    rp.attempt(out, "compile", lambda: (_ for _ in ()).throw(rp.ContenderError("relative error 1e-1 over 3e-3")))
    assert out["compile_error"] == "relative error 1e-1 over 3e-3"
    # against the baselines that ran, the missing CUDA graph (maybe the fastest) would flatter mdsl
    assert rp.speedups(out, compile_baseline=False) == {"speedup_vs_best": None, "speedup_vs_eager": None}
    out["cuda_graph_us"] = 20.0
    assert rp.speedups(out, compile_baseline=False) == {"speedup_vs_best": 2.0, "speedup_vs_eager": 3.0}
    assert rp.speedups(out)["speedup_vs_best"] is None   # torch.compile's output was off
    row = {"kernels_before": 2, "kernels_after": 1, "estimate_before_us": 2.0, "estimate_after_us": 1.0,
           "search_s": 1.0, "over_cap_s": 0.0, "provisional": False, "float_ok": True, "fused": True, "boundaries": []}
    summary = rp.summarise([{**row, "gpu": {"speedup_vs_best": 2.0, "speedup_vs_eager": 3.0}},
                            {**row, "gpu": {"speedup_vs_best": None, "speedup_vs_eager": None}}], 120.0)
    assert summary["gpu_geomean_speedup_vs_best"] == pytest.approx(2.0) and summary["gpu_not_compared"] == 1


@pytest.mark.parametrize("index", range(24))
def test_the_partition_combination_never_costs_more_than_the_original(index):
    graph = rp.draw(5, index, **SMALL).kernel().graph
    generated = [a.graph for a in partition.generate(graph, SearchConfig(min_blocks=1), SearchStats())]
    for candidate in generated:
        validate_kernel_graph(candidate)
        assert estimate(candidate).launches <= estimate(graph).launches
    if generated:   # the best combination: never dearer than the operators apart
        assert estimate(generated[0]).seconds <= estimate(graph).seconds


@pytest.mark.timeout(300)
def test_plans_of_random_programs_are_never_worse_than_the_original_and_compute_it():
    config = SearchConfig(budget_s=120, workers=2, exhaustive=False, min_blocks=1)
    fused = 0
    for index in range(6):
        program = rp.draw(11, index, **SMALL)
        graph = program.kernel().graph
        plan = search(graph, config).plan()
        assert plan.cost.launches <= plan.original_cost.launches, program.source()
        assert plan.cost.seconds <= plan.original_cost.seconds, program.source()
        assert plan.evidence.equivalent and not plan.provisional
        fused += plan.cost.launches < plan.original_cost.launches
        inputs = rp.float_inputs(program, graph, 1)
        for got, want in zip(run_kernel_graph(plan.graph, inputs), run_kernel_graph(graph, inputs)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert fused >= 3


def test_two_runs_compare_the_plans_of_the_programs_both_finished():
    def row(name, digest, provisional=False):
        return {"program": name, "plan_digest": digest, "provisional": provisional}

    quiet = [row("a", "1"), row("b", "2"), row("c", "3", provisional=True), row("d", "4")]
    loaded = [row("a", "1"), row("b", "9"), row("c", "7"), row("e", "5")]
    assert rp.same_plans(quiet, loaded) == {"compared": 2, "differ": ["b"]}


def test_parts_of_a_run_merge_into_the_run(tmp_path):
    """A stored GPU run cut in two parts (as --first and --count cut one) merges back into its rows and
    summary; parts of other seeds, commits or GPUs, or with a program twice, are refused."""
    import copy
    import json
    from pathlib import Path

    whole = json.loads((Path(rp.__file__).parents[1] / "docs/results/random_programs_gpu_seed97.json").read_text())
    first, second = copy.deepcopy(whole), copy.deepcopy(whole)
    first["rows"], second["rows"] = whole["rows"][:4], whole["rows"][4:]
    first["meta"].update(first=0, count=4, command="part one")
    second["meta"].update(first=4, count=len(whole["rows"]) - 4, command="part two")
    run = rp.merged([second, first])
    assert [r["program"] for r in run["rows"]] == [r["program"] for r in whole["rows"]]
    summary = dict(run["summary"])
    assert summary.pop("gpu_geomean_speedup_vs_best") == pytest.approx(whole["summary"]["gpu_geomean_speedup_vs_best"])
    assert summary == {k: v for k, v in whole["summary"].items() if k != "gpu_geomean_speedup_vs_best"}
    assert run["meta"]["first"] == 0 and run["meta"]["count"] == len(whole["rows"])
    assert [p["command"] for p in run["meta"]["parts"]] == ["part two", "part one"]
    other = copy.deepcopy(first)
    other["meta"]["mdsl_commit"] = "0000000"
    with pytest.raises(ValueError, match="mdsl_commit"):
        rp.merged([other, second])
    with pytest.raises(ValueError, match="more than one run: random_s97_0"):
        rp.merged([first, first, second])
    for k, part in enumerate((first, second)):
        (tmp_path / f"{k}.json").write_text(json.dumps(part))
    assert rp.main(["--merge", str(tmp_path / "0.json"), str(tmp_path / "1.json"), "--out", str(tmp_path / "m")]) == 0
    assert json.loads((tmp_path / "m/random_programs.json").read_text())["rows"] == run["rows"]
    with pytest.raises(SystemExit):
        rp.main(["--count", "3"])   # no seed, no --merge


def test_a_plans_digest_is_its_graphs_text():
    program = rp.draw(0, 0)
    graph = program.kernel().graph

    class Plan:          # the digest reads the plan's graph only
        def __init__(self, g):
            self.graph = g

    assert rp.plan_digest(Plan(graph)) == rp.plan_digest(Plan(program.kernel().graph))
    assert rp.plan_digest(Plan(graph)) != rp.plan_digest(Plan(rp.draw(0, 1).kernel().graph))


def test_the_gpu_section_lists_the_programs_that_lose_with_their_slowest_kernel_and_first_calls():
    from benchmarks import report

    def row(name, speedup, first_call):
        gpu = {"mdsl_us": 10.0 / speedup, "mdsl_graph_us": 8.0, "eager_us": 20.0, "cuda_graph_us": 10.0,
               "compile_us": 30.0, "speedup_vs_best": speedup, "first_call_s": first_call,
               "mdsl_kernels_us": {f"{name}_matmul": 7.5, f"{name}_rms_norm": 1.0}, "mdsl_choice": "candidate 0"}
        return {"program": name, "rows": 4, "kernels_before": 3, "kernels_after": 2, "estimate_after_us": 5.0,
                "gpu": gpu}

    run = {"meta": {"seed": 5, "date": "2026-12-03T00:00:00", "command": "benchmarks/random_programs.py --seed 5 --gpu",
                    "mdsl_commit": "abcdef1", "gpu": {"name": "NVIDIA H200"}},
           "summary": {"gpu_geomean_speedup_vs_best": 0.9, "gpu_slower_than_eager": 0},
           "rows": [row("fast", 1.5, 2.0), row("slow", 0.5, 6.0), {"program": "wrong", "rows": 1, "kernels_before": 2,
                                                                    "kernels_after": 1, "estimate_after_us": 1.0,
                                                                    "gpu": {"mdsl_us": None, "mdsl_error": "off"}}]}
    text = "\n".join(report.random_programs_gpu_section([run]))
    assert "Correct on the GPU: 2 of 3" in text and "geometric mean 0.90x" in text
    assert "| slow |" in text and "| fast |" not in text and "slow_matmul 7.5" in text
    assert "median 4.0 s, longest 6.0 s" in text


def test_the_section_names_the_run_compared_against_and_a_runs_background_load():
    from benchmarks import report

    quiet = {"meta": {"seed": 5, "host": "vm", "cpus": 2, "load": [0.1], "command": "q"},
             "summary": {"programs": 2, "fused": 2, "fused_fraction": 1.0}}
    loaded = {"meta": {"seed": 5, "host": "vm", "cpus": 2, "load": [0.3], "load_end": [3.9], "command": "l",
                       "background": "two busy processes"},
              "summary": {"programs": 2, "fused": 2, "fused_fraction": 1.0,
                          "same_as": {"file": "docs/results/random_programs_seed5_quiet.json", "compared": 2,
                                      "differ": ["random_s5_1"]}}}
    text = "\n".join(report.random_programs_section([quiet, loaded]))
    assert "| 0.3 -> 3.9 | 1 of 2 the same (random_programs_seed5_quiet.json) |" in text
    assert text.count("Beside it: two busy processes.") == 1


@pytest.mark.parametrize("compile_baseline", [True, False])
def test_every_program_s_public_call_is_timed_before_any_graph_compile_or_profile(monkeypatch, compile_baseline):
    """measure_on_gpu's passes: a program's call and eager run are timed before any program's CUDA graphs are
    captured, and those before torch.compile and the profiler run (which slow later torch calls)."""
    timed = []

    class Program:
        def __init__(self, name):
            self.name = name

        def kernel(self):
            return f"kernel {self.name}"

    class Contenders:
        def __init__(self, program, kernel, l2_bytes, reps, batch):
            assert kernel == f"kernel {program.name}"
            self.name = program.name

        def run(self, name, out):
            timed.append((self.name, name))
            out[f"{name}_us"] = {"mdsl": 5.0, "eager": 20.0, "cuda_graph": 10.0, "compile": 15.0}.get(name)

    monkeypatch.setattr(rp, "_Contenders", Contenders)
    seen = []
    outs = rp.measure_on_gpu([Program("a"), Program("b")], compile_baseline=compile_baseline,
                             progress=lambda index, step, out: seen.append((index, step)))
    passes = [("mdsl", "eager"), ("cuda_graph", "mdsl_graph")] + [("compile",)] * compile_baseline + [("kernels",)]
    assert timed == [(p, name) for names in passes for p in "ab" for name in names]
    assert len(seen) == 2 * len(passes) and seen[:2] == [(0, 0), (1, 0)]
    assert all(out["speedup_vs_best"] == 2.0 and out["speedup_vs_eager"] == 4.0 for out in outs)

"""scripts/cost_vs_measured.py: the cost model against measured kernels, on results written here."""
from __future__ import annotations

import hashlib
import json
import math

import pytest

from scripts import cost_vs_measured as S


def test_spearman_ranks_ties_by_their_mean_rank():
    assert S.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert S.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert S.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)
    assert S.spearman([1, 2], [2, 1]) is None and S.spearman([1, 1, 1], [1, 2, 3]) is None


def test_errors_are_ratios_of_model_to_measured():
    e = S.errors([(2.0, 1.0), (1.0, 2.0), (1.0, 1.0), (1.2, 1.0)])
    assert e["n"] == 4 and e["median"] == pytest.approx(math.sqrt(1.2))
    assert e["within_1.5x"] == 0.5 and e["within_2x"] == 1.0
    assert e["factor"] == pytest.approx(math.exp(math.sqrt((2 * math.log(2) ** 2 + math.log(1.2) ** 2) / 4)))


def test_a_timed_candidate_of_the_kernel_benchmark_is_priced_under_its_lowering(tmp_path):
    from benchmarks.cases import cases
    from mdsl.search.cost import gpu_estimate

    graph = cases()["lora"].graph   # the program as written stands for the plan's choice
    results = {"cases": {"lora": {
        "plan": {"text": f"# a header line naming the kernel lora\n{graph}"},
        "autotune": {"report": ["autotune: candidate 0 (the plan's choice), ...: 7.00 us per call",
                                "  candidate 0 (the plan's choice), 3-stage pipeline, own threads: 9.50 us",
                                "  candidate 0 (the plan's choice), 2-stage pipeline, 256 threads: 7.00 us",
                                "  candidate 0 (the plan's choice), skinny loop where it qualifies, own threads: "
                                "8.00 us",
                                "  candidate 1 (alternative 1), 3-stage pipeline, own threads: 6.00 us"]}}}}
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(results))
    (row,) = S.priced_candidates(S.tuned_candidates(str(path)))   # the alternative's mugraph is not known
    assert row["case"] == "lora" and row["tile_us"] == 9.5 and row["best_us"] == 8.0   # own threads only
    assert row["gpu_us"] == pytest.approx(gpu_estimate(graph, stages=3).seconds * 1e6)
    assert "| lora | 1 |" in S.report([], [], [row], summary_only=True)


@pytest.mark.timeout(240)
def test_each_launch_of_a_random_program_meets_its_profiled_kernel(tmp_path):
    from mdsl.backend.cuda.codegen import emit_cuda
    from mdsl.ir.printer import print_graph
    from mdsl.lowering.options import CudaOptions
    from tests.search.small_plans import small_plan

    plan, cache = small_plan("rms_norm_linear", tmp_path / "plans")
    launches = emit_cuda(plan.graph, options=CudaOptions()).launches
    name = plan.original.name
    measured = {launch.name: 10.0 + k for k, launch in enumerate(launches) if launch.library is None}
    measured["nvjet_some_cublas_gemm"] = 3.0
    row = {"program": name, "plan_digest": hashlib.sha256(print_graph(plan.graph).encode()).hexdigest()[:16],
           "gpu": {"mdsl_kernels_us": measured}}
    results = tmp_path / "random.json"
    results.write_text(json.dumps({"rows": [row, {"program": "missing", "plan_digest": "0" * 16, "gpu": {}}]}))
    kernels, gemms = S.random_kernels(str(results), str(cache.root))
    assert kernels and [k["measured_us"] for k in kernels] == sorted(v for v in measured.values() if v >= 10)
    assert all(k["program"] == name and k["gpu_us"] > 0 and k["estimate_us"] > 0 for k in kernels)
    assert [g["measured_us"] for g in gemms] == [3.0]
    table = S.report(kernels, gemms, [], summary_only=False)
    assert f"| {name} | {kernels[0]['kernel']} |" in table and "random: custom kernels, gpu_estimate" in table

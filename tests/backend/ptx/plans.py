"""The benchmark cases' plans, as the kernel benchmark runs them: the plan cache entries of this checkout
(`.plans/plans/*.json`, filled by `benchmarks/kernels.py --plans-only`; the folder is not tracked by git),
read directly (the suite's plan cache is a temporary directory) and validated as the cache validates an
entry. A checkout without them (a clean clone, CI) takes each case's best guided plan instead: the
fused mugraph a search verifies first, of the same shape as the searched one."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from mdsl.ir.graph import KernelGraph
from mdsl.search.plan import Plan

PLANS = Path(__file__).resolve().parents[3] / ".plans" / "plans"


@functools.cache
def benchmark_plans() -> dict:
    """Case name (the plan's graph name: gqa_bs1, lora, ...) -> the plan's kernel graph."""
    out = {}
    for path in sorted(PLANS.glob("*.json")):
        plan = Plan.from_json(json.loads(path.read_text(encoding="utf-8"))["plan"])   # parses and validates
        out[plan.graph.name] = plan.graph
    if not out:
        from tests.backend.cuda.programs import benchmark_names, guided_plan

        out = {graph.name: graph for graph in map(guided_plan, benchmark_names())}
    return out


def plan_graph(name: str) -> KernelGraph:
    return benchmark_plans()[name]

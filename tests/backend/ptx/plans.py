"""The benchmark cases' searched plans, as the kernel benchmark runs them: the plan cache entries kept in
the repository (`.plans/plans/*.json`, filled by `benchmarks/kernels.py --plans-only`), read directly
(the suite's plan cache is a temporary directory) and validated as the cache validates an entry."""
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
    return out


def plan_graph(name: str) -> KernelGraph:
    return benchmark_plans()[name]

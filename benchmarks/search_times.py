"""Cold-cache searches of the ten benchmark cases: time, states, verification and the plan found.

    python benchmarks/search_times.py [--budget 120] [--workers 2] [--json out.json] [CASE ...]

Each case is searched in a fresh cache directory of its own (`cases.search_cold`), so nothing is answered
from an earlier run or another case (the same program at another batch size would answer it as a member
of its shape family, without a search); the plans are then copied into --cache. The table says for each
case how the chosen mugraph is fused (custom kernels and what they contain).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from cases import cases, describe_plan, search_cold
from provenance import provenance
from random_programs import plan_digest

from mdsl.search.config import SearchConfig


def run(name: str, kernel, config: SearchConfig) -> dict:
    start = time.perf_counter()
    plan = search_cold(kernel, config)       # cold: in a cache of its own, then stored in the shared one
    cold = time.perf_counter() - start
    start = time.perf_counter()
    kernel.optimize(config=config)           # answered from the cache
    warm = time.perf_counter() - start
    stats = plan.stats
    return {
        "case": name, "seconds": round(cold, 1), "cache_hit_seconds": round(warm, 3),
        "candidates": stats.total("generated"), "pruned": stats.total("pruned"), "states": stats.total("states"),
        "verified": stats.total("verified"), "rejected": stats.total("rejected"),
        "launches": plan.cost.launches, "estimate_us": round(plan.cost.seconds * 1e6, 2),
        "floor_us": round(plan.floor.seconds * 1e6, 2), "original": plan.is_original,
        "false_pass": plan.evidence.false_pass_probability, "plan": describe_plan(plan.graph),
        "provisional": plan.provisional, "plan_digest": plan_digest(plan),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", help="case names (default: all ten)")
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--cache", help="an empty or new directory for the plans (default: a temporary one); "
                                        "keep it to reuse the plans, e.g. for benchmarks/kernels.py")
    args = parser.parse_args(argv)
    cache = args.cache or tempfile.mkdtemp(prefix="mdsl-search-times-")
    os.makedirs(cache, exist_ok=True)
    if os.listdir(cache):
        parser.error(f"--cache {cache} is not empty: the searches must start cold")
    os.environ["MDSL_CACHE_DIR"] = cache
    config = SearchConfig(budget_s=args.budget, workers=args.workers)
    selected = {k: v for k, v in cases().items() if not args.cases or k in args.cases}
    rows = []
    print("| case | search (s) | cache hit (s) | candidates | pruned | verified | est. (us) | floor (us) | plan |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, kernel in selected.items():
        r = run(name, kernel, config)
        rows.append(r)
        print(f"| {r['case']} | {r['seconds']} | {r['cache_hit_seconds']} | {r['candidates']} | {r['pruned']} | "
              f"{r['verified']} | {r['estimate_us']} | {r['floor_us']} | {r['plan']} |", flush=True)
        if args.json:   # after each case: a run cut short keeps the cases done
            meta = provenance("search_times.py", sys.argv[1:] if argv is None else argv)
            meta.update(budget_s=args.budget, workers=args.workers)
            with open(args.json, "w") as f:
                json.dump({"schema": 1, "meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

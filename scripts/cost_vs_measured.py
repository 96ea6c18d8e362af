"""The cost model against the H200's measured kernels: every kernel docs/results times, its lowering, what
`estimate` and `gpu_estimate` say of it, and the model's error.

    MDSL_CACHE_DIR=/tmp/plans-random python scripts/cost_vs_measured.py            # after copying .plans-random
    python scripts/cost_vs_measured.py --plans /tmp/plans-random --summary          # the error tables only

Two sources:

* random programs (`--random`, default docs/results/random_programs_gpu_seed31.json): each program's plan
  is read from the plan cache it was timed with (`--plans`, default $MDSL_CACHE_DIR; only read, never
  searched: a row whose plan is missing is skipped), the candidate the row's `plan_digest` names. Each
  launch of it (mdsl.backend.cuda.codegen, the default lowering options: the tile loop, 3 pipeline stages)
  against the torch profiler's GPU time of its kernel (`gpu.mdsl_kernels_us`, by kernel name). The models'
  times there are a kernel's seconds with the launch's GPU part (`KERNEL_FLOOR_S`) in place of the whole
  launch (`Device.launch_s`): the profiler times the GPU's part. The library GEMMs (cuBLAS, kernels of
  other names) are compared per program, in sum.
* the kernel benchmark's autotuner (`--kernels`, default docs/results/kernels.json): each timed candidate
  whose mugraph is known (the plan's choice, from its printed plan; a tuning variant, lifted again from the
  case's program by the guided choice its grid names, where exactly one of the plan's structure does)
  against its time per call: under the tile loop with 3 pipeline stages and the block's own threads
  (what `gpu_estimate(stages=3)` models) and under the fastest option timed with the block's own threads
  (what `gpu_estimate(skinny=True)` ranks by: the faster of the tile and the skinny loop). A call's time
  includes what the host adds to each launch, as the models' `launch_s` does.

Errors are ratios model / measured: their log's median (the bias), its root mean square, the share within
1.5x and 2x; and within each case, Spearman's rank correlation of the model's times and the measured ones.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from mdsl.ir.graph import BlockGraph  # noqa: E402
from mdsl.search.cost import H200, estimate, gpu_estimate, kernel_costs, launched  # noqa: E402

#: the GPU time of the shortest kernels the profiler reports (a split's copy: 1.0 to 1.5 us in the random
#: programs): the launch's ramp on the GPU, which the models count in `launch_s` with the host's part
KERNEL_FLOOR_S = 1e-6
REPORT = re.compile(r"\s*candidate (\d+) \((.*?)\), (.*): ([\d.]+) us$")
TILE = "3-stage pipeline, own threads"


# ---------------------------------------------------------------------------------------------
# the random programs: each kernel

def plan_graphs(cache: str) -> dict:
    """plan_digest (benchmarks/random_programs.py) -> the candidate's graph, over every plan in `cache`."""
    from mdsl.ir.printer import print_graph
    from mdsl.search.plan import Plan

    out = {}
    for path in sorted(glob.glob(os.path.join(cache, "plans", "*.json"))):
        plan = Plan.from_json(json.loads(Path(path).read_text())["plan"])
        for graph in (plan.graph, *(c.graph for c in plan.alternatives)):
            out[hashlib.sha256(print_graph(graph).encode()).hexdigest()[:16]] = graph
    return out


def _per_node(graph) -> tuple:
    """(node index -> estimate's KernelCost, node index -> gpu_estimate's KernelFit) of the non-view nodes."""
    costs, fits = iter(kernel_costs(graph)), iter(gpu_estimate(graph).kernels)
    by_cost, by_fit = {}, {}
    for index in launched(graph):
        node = graph.nodes[index]
        by_cost[index] = next(costs)
        if isinstance(node.body, BlockGraph):
            by_fit[index] = next(fits)
    return by_cost, by_fit


def random_kernels(results: str, cache: str) -> tuple:
    """(one row per measured mdsl kernel, one row per program's library GEMMs)."""
    from mdsl.backend.cuda.codegen import emit_cuda
    from mdsl.lowering.options import CudaOptions

    graphs = plan_graphs(cache)
    kernels, gemms = [], []
    for row in json.loads(Path(results).read_text())["rows"]:
        graph, measured = graphs.get(row["plan_digest"]), (row.get("gpu") or {}).get("mdsl_kernels_us") or {}
        if graph is None or not measured:
            continue
        by_cost, by_fit = _per_node(graph)
        program = emit_cuda(graph, options=CudaOptions())
        library = {"estimate": 0.0, "gpu": 0.0}
        for launch in program.launches:
            nodes = [launch.node_index] + ([launch.node_index + 1] if launch.counters else [])
            est = sum(by_cost[i].seconds for i in nodes) - H200.launch_s + KERNEL_FLOOR_S
            fits = [by_fit[i] for i in nodes if i in by_fit]
            gpu = sum(f.seconds for f in fits) - H200.launch_s + KERNEL_FLOOR_S if fits else est
            if launch.library is not None:
                library["estimate"] += est
                library["gpu"] += gpu
                continue
            if launch.name not in measured:
                continue
            node = graph.nodes[launch.node_index]
            kernels.append({"program": row["program"], "kernel": launch.name[len(row["program"]) + 1:],
                            "lowering": _lowering(node, fits), "estimate_us": est * 1e6, "gpu_us": gpu * 1e6,
                            "measured_us": measured[launch.name]})
        others = sum(us for name, us in measured.items() if not name.startswith(row["program"] + "_"))
        if others:
            gemms.append({"program": row["program"], "estimate_us": library["estimate"] * 1e6,
                          "gpu_us": library["gpu"] * 1e6, "measured_us": others})
    return kernels, gemms


def _lowering(node, fits) -> str:
    if not fits:
        return f"library {node.op}"
    body, fit = node.body, fits[0]
    pair = " + combine" if len(fits) > 1 else ""
    return (f"{body.num_blocks} blocks x {body.threads} thr, {fit.resident}/SM resident, {fit.rounds} round(s) of "
            f"{fit.iterations} it x {fit.steps} stage(s), {fit.in_flight_per_sm // 1024} KB in flight/SM{pair}")


# ---------------------------------------------------------------------------------------------
# the kernel benchmark's autotuner: each timed candidate

def _variant_pool(original) -> dict:
    """describe_grid -> {graph key: graph} of every mugraph the guided choices of the tuning variants'
    space lift `original` to."""
    import attrs

    from mdsl.backend.cuda.autotune import describe_grid
    from mdsl.errors import MdslError
    from mdsl.search.config import SearchConfig
    from mdsl.search.dims import Labels
    from mdsl.search.guided import CannotLift, choices, lift
    from mdsl.search.variants import VariantSpace, _combine_widths

    labels, space, pool = Labels(original), VariantSpace(), {}
    for choice in choices(original, labels, SearchConfig(), max_split=space.max_split, min_forloop=space.min_forloop):
        for wider in _combine_widths(choice, space):
            try:
                graph = lift(original, attrs.evolve(choice, combine_parts=wider), labels)
            except (CannotLift, MdslError):   # a choice the lifting refuses
                continue
            pool.setdefault(describe_grid(graph), {})[graph.key] = graph
    return pool


def tuned_candidates(results: str) -> list:
    """One row per timed candidate whose mugraph is known: case, name, graph, {options: us}."""
    from benchmarks.cases import cases
    from mdsl.ir.text import parse_graph
    from mdsl.search.variants import structure

    programs, rows = cases(), []
    for case, data in json.loads(Path(results).read_text())["cases"].items():
        report = (data.get("autotune") or {}).get("report") or []
        text = (data.get("plan") or {}).get("text")
        if not report or not text or case not in programs:
            continue
        chosen = parse_graph(text[text.index("\nkernel ") + 1:])
        timed: dict = {}
        for line in report[1:]:
            found = REPORT.match(line)
            if found:
                timed.setdefault((int(found.group(1)), found.group(2)), {})[found.group(3)] = float(found.group(4))
        pool = _variant_pool(programs[case].graph) if any(n.startswith("variant") for _, n in timed) else {}
        for (index, name), options in sorted(timed.items()):
            graphs = [chosen] if index == 0 else []
            if name.startswith("variant"):
                graphs = [g for g in pool.get(name.split(": ", 1)[1], {}).values()
                          if structure(g)[0] == structure(chosen)[0]]
            if len(graphs) == 1:
                rows.append({"case": case, "candidate": f"{index}: {name}", "graph": graphs[0], "us": options})
    return rows


def priced_candidates(rows: list) -> list:
    out = []
    for row in rows:
        graph, options = row["graph"], row["us"]
        own = [us for option, us in options.items() if option.endswith("own threads")]
        out.append({"case": row["case"], "candidate": row["candidate"], "tile_us": options.get(TILE),
                    "best_us": min(own or options.values()), "estimate_us": estimate(graph).seconds * 1e6,
                    "gpu_us": gpu_estimate(graph, stages=3).seconds * 1e6,
                    "gpu_best_us": gpu_estimate(graph, skinny=True).seconds * 1e6})
    return out


# ---------------------------------------------------------------------------------------------
# errors

def errors(pairs: list) -> dict:
    """Of (model, measured) pairs: n, the median ratio, the ratio's typical factor (exp of the RMS of its
    log), the shares within 1.5x and 2x."""
    logs = [math.log(m / x) for m, x in pairs if m > 0 and x > 0]
    if not logs:
        return {"n": 0}
    return {"n": len(logs), "median": math.exp(statistics.median(logs)),
            "factor": math.exp(math.sqrt(statistics.fmean(v * v for v in logs))),
            "within_1.5x": sum(abs(v) <= math.log(1.5) for v in logs) / len(logs),
            "within_2x": sum(abs(v) <= math.log(2) for v in logs) / len(logs)}


def spearman(xs: list, ys: list) -> Optional[float]:
    """Spearman's rank correlation (ties get their mean rank); None for fewer than 3 pairs."""
    if len(xs) < 3:
        return None

    def ranks(values: list) -> list:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else None


def _error_line(label: str, e: dict) -> str:
    if not e.get("n"):
        return f"| {label} | 0 | | | | |"
    return (f"| {label} | {e['n']} | {e['median']:.2f} | {e['factor']:.2f} | {e['within_1.5x']:.0%} | "
            f"{e['within_2x']:.0%} |")


def report(kernels: list, gemms: list, tuned: list, summary_only: bool) -> str:
    lines = []
    if kernels and not summary_only:
        lines += ["## Random programs: each mdsl kernel (GPU us)", "",
                  "| program | kernel | lowering | measured | estimate | gpu_estimate | gpu / measured |",
                  "|---|---|---|---:|---:|---:|---:|"]
        lines += [f"| {k['program']} | {k['kernel']} | {k['lowering']} | {k['measured_us']:.2f} | "
                  f"{k['estimate_us']:.2f} | {k['gpu_us']:.2f} | {k['gpu_us'] / k['measured_us']:.2f} |"
                  for k in kernels]
        lines += ["", "| program | library GEMMs measured | estimate |", "|---|---:|---:|"]
        lines += [f"| {g['program']} | {g['measured_us']:.2f} | {g['estimate_us']:.2f} |" for g in gemms]
        lines.append("")
    if tuned and not summary_only:
        lines += ["## Kernel benchmark: each timed candidate (us per call)", "",
                  "| case | candidate | tile, 3 stages | gpu_estimate | fastest, own threads | gpu_estimate(skinny) "
                  "| estimate |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {t['case']} | {t['candidate'][:60]} | {t['tile_us'] or '-'} | {t['gpu_us']:.2f} | "
                  f"{t['best_us']:.2f} | {t['gpu_best_us']:.2f} | {t['estimate_us']:.2f} |" for t in tuned]
        lines.append("")
    custom = [k for k in kernels if not k["lowering"].startswith("library")]
    big = [k for k in custom if k["measured_us"] >= 5]
    library = [k for k in kernels if k["lowering"].startswith("library")]
    tile = [t for t in tuned if t["tile_us"]]
    sets = [("random: custom kernels, gpu_estimate", custom, "gpu_us", "measured_us"),
            ("random: custom kernels, estimate", custom, "estimate_us", "measured_us"),
            ("random: custom kernels of 5 us or more, gpu_estimate", big, "gpu_us", "measured_us"),
            ("random: custom kernels of 5 us or more, estimate", big, "estimate_us", "measured_us"),
            ("random: mdsl's library kernels (norms, reductions, copies), estimate", library, "estimate_us",
             "measured_us"),
            ("random: library GEMMs, estimate", gemms, "estimate_us", "measured_us"),
            ("kernels: tile loop, gpu_estimate(stages=3)", tile, "gpu_us", "tile_us"),
            ("kernels: fastest with own threads, gpu_estimate(skinny)", tuned, "gpu_best_us", "best_us"),
            ("kernels: fastest with own threads, estimate", tuned, "estimate_us", "best_us")]
    lines += ["## Errors (model / measured)", "",
              "| set | n | median | typical factor | within 1.5x | within 2x |", "|---|---:|---:|---:|---:|---:|"]
    lines += [_error_line(label, errors([(r[model], r[measured]) for r in rows]))
              for label, rows, model, measured in sets]
    cases = sorted({t["case"] for t in tuned})
    if cases:
        lines += ["", "## Rank correlation within each case (Spearman)", "",
                  "| case | candidates | tile: gpu_estimate | fastest: gpu_estimate(skinny) | fastest: estimate |",
                  "|---|---:|---:|---:|---:|"]
        for case in cases:
            own = [t for t in tuned if t["case"] == case]
            timed = [t for t in own if t["tile_us"]]
            cells = [spearman([t["gpu_us"] for t in timed], [t["tile_us"] for t in timed]),
                     spearman([t["gpu_best_us"] for t in own], [t["best_us"] for t in own]),
                     spearman([t["estimate_us"] for t in own], [t["best_us"] for t in own])]
            shown = " | ".join("-" if c is None else f"{c:+.2f}" for c in cells)
            lines.append(f"| {case} | {len(own)} | {shown} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random", default=str(ROOT / "docs/results/random_programs_gpu_seed31.json"))
    parser.add_argument("--plans", default=os.environ.get("MDSL_CACHE_DIR"),
                        help="the plan cache the random programs were timed with (default $MDSL_CACHE_DIR)")
    parser.add_argument("--kernels", default=str(ROOT / "docs/results/kernels.json"))
    parser.add_argument("--summary", action="store_true", help="print the error tables only")
    parser.add_argument("--json", help="also write every row and error to this file")
    args = parser.parse_args(argv)
    if not args.plans:
        parser.error("--plans (or MDSL_CACHE_DIR): the random programs' plan cache")
    kernels, gemms = random_kernels(args.random, args.plans)
    tuned = priced_candidates(tuned_candidates(args.kernels))
    print(report(kernels, gemms, tuned, args.summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"random_kernels": kernels, "library_gemms": gemms, "tuned": tuned},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

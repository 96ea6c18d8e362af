"""The kernel benchmark: mdsl's plan against PyTorch on the ten benchmark cases, in one process and one run.

    python benchmarks/kernels.py [--no-compile] [--cases gqa_bs1,lora] [--time-limit 540] [--out DIR]
    python benchmarks/kernels.py --plans-only       # no GPU: fill the plan cache, compile each plan's CUDA
    python benchmarks/kernels.py --plans-only --autotune 3 --variants 8   # and verify + precompile tuning variants
    python benchmarks/kernels.py --plans-only --variants 8 --refresh-variants --cases rms_norm_linear_bs8
                                                    # propose and verify one case's tuning variants again
    python benchmarks/kernels.py --render a/results.json b/results.json   # no GPU: merge runs, redraw

For each case (benchmarks/cases.py) the contenders are mdsl's plan (its kernels launched through the
runtime's unchecked fast path, and the same launches captured in a CUDA graph) and PyTorch: eager, SDPA
(the attention cases), eager captured in a CUDA graph, torch.compile (default mode and
max-autotune-no-cudagraphs). All of them run on the same f16 inputs on the GPU.

Method:
* Inputs: random (never zeros), drawn on the GPU from a seed per case, in N sets with N × (bytes the
  case reads and writes) >= 2 × L2, so that no set is still in L2 when its turn comes; every call takes
  the next set. CUDA-graph contenders capture one graph per set.
* Correctness before timing: each contender's output on the first and last set, written into
  NaN-poisoned buffers where the harness owns them, against mdsl's reference interpreter in float64 on
  the same rounded inputs: ||out - ref|| / ||ref|| <= --tolerance (3e-3 for f16); NaN never passes. A
  contender that fails is reported with its error and not timed. The torch program is also run in
  float64 and compared with the interpreter, so that a baseline computing another function shows.
* Timing: warm-up (at least one call per input set), then --reps samples per contender, each a batch of
  --batch back-to-back calls between one pair of CUDA events, divided by the batch size (so the first
  call's launch latency is spread over the batch; a contender whose host side is slower than its GPU
  work is measured at its host-bound rate, as a caller would see it). Samples are taken in --passes
  interleaved passes over the contenders; the median over all samples is reported, with each pass's
  median (their spread is the noise).
* Reported: time per call; speed-up = best baseline / best mdsl mode; % of the roofline floor
  max(bytes / 4.25 TB/s, flops / 750 TFLOP/s) (mdsl.search.cost.roofline_floor); bytes moved (each
  input read once, each output written once); achieved bandwidth = those bytes / mdsl's time; and, once
  per run, the time of an empty kernel launched as mdsl launches its kernels (meta.empty_launch), the
  context for floors below one launch.

Plans come from the plan cache ($MDSL_CACHE_DIR) for SearchConfig(budget_s=--budget, seed 0, the target
arch): `--plans-only` on a CPU machine fills it; carry the directory to the GPU machine. There a missing
plan fails mdsl's contenders (the baselines are still measured), unless --on-miss search, which searches
with the guided generator only where z3 is not installed.

Writes results.json (every number and the environment), results.md (the table) and results.png (the
speed-ups) under --out (default $OUT, else ./bench_out); prints the table last. torch is needed only
for the GPU run, matplotlib only for the plot.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # run as a script from anywhere, with or without mdsl installed
    sys.path.insert(0, str(ROOT))

from benchmarks.cases import describe_plan, search_cold  # noqa: E402 - needs ROOT on sys.path
from benchmarks.provenance import nvidia_smi, provenance  # noqa: E402

SCHEMA = 1
EPS = 1e-6                  # every rms_norm of the cases (mdsl.rms_norm's default, rms_norm_linear.EPS)
L2_BYTES = 60 * 1024**2     # the H200's L2, when torch cannot say
MAX_SETS = 1024             # input sets at most (graph contenders capture one graph per set)

BASELINES = ("eager", "sdpa", "cuda_graph", "compile", "compile_max")
MDSL = ("mdsl", "mdsl_graph", "mdsl_ptx")   # mdsl_ptx: the plan through the PTX backend
LABELS = {"eager": "eager", "sdpa": "SDPA", "cuda_graph": "CUDA graph", "compile": "compile",
          "compile_max": "compile-max", "mdsl": "mdsl", "mdsl_graph": "mdsl graph",
          "mdsl_ptx": "mdsl PTX"}
COMPILE_MODES = {"compile": None, "compile_max": "max-autotune-no-cudagraphs"}
METHOD_OPTIONS = ("reps", "batch", "passes", "warmup", "tolerance", "seed", "l2_multiple", "max_input_mb", "budget",
                  "autotune", "variants")

# the inputs of each case family: ("normal", std) or ("uniform", low, high), by parameter name
INPUTS = {
    # K's std 1/8 gives scores Q·K of std 1, as attention's 1/sqrt(head dim) scaling would
    "gqa": {"q": ("normal", 1.0), "k": ("normal", 0.125), "v": ("normal", 1.0)},
    "qknorm": {"q": ("normal", 1.0), "k": ("normal", 1.0), "v": ("normal", 1.0)},
    "rms_norm_linear": {"x": ("normal", 1.0), "w": ("normal", 1 / 64)},
    "lora": {"x": ("normal", 1.0), "w": ("normal", 1 / 16), "a": ("normal", 1 / 16), "b": ("normal", 0.25)},
    "gated_mlp": {"x": ("normal", 1.0), "w1": ("normal", 1 / 64), "w2": ("normal", 1 / 64)},
    "ntrans": {"h": ("normal", 1.0), "x": ("normal", 1.0), "alpha": ("uniform", 0.0, 0.1)},
}


def family(case: str) -> str:
    """gqa_bs8 -> gqa; lora -> lora."""
    head, sep, tail = case.rpartition("_bs")
    return head if sep and tail.isdigit() else case


# ---------------------------------------------------------------------------------------------
# options

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See the module docstring (and benchmarks/README.md) for the method.")
    p.add_argument("--cases", type=_case_list, default=None,
                   help="comma-separated case names (default: all ten, in the order of benchmarks/cases.py)")
    p.add_argument("--reps", type=_positive_int, default=200,
                   help="timed samples per contender (each a batch of --batch calls); the median is reported")
    p.add_argument("--batch", type=_positive_int, default=10, help="back-to-back calls per timed sample")
    p.add_argument("--passes", type=_positive_int, default=2, help="interleaved timing passes over the contenders")
    p.add_argument("--warmup", type=_positive_int, default=50,
                   help="untimed calls first (at least one per input set)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip the torch.compile contenders (slow to compile)")
    p.add_argument("--max-autotune", action=argparse.BooleanOptionalAction, default=True,
                   help="include torch.compile(mode='max-autotune-no-cudagraphs') (default: yes)")
    p.add_argument("--no-graphs", dest="graphs", action="store_false",
                   help="skip the CUDA-graph contenders (PyTorch's and mdsl's)")
    p.add_argument("--autotune", type=int, default=3, metavar="N",
                   help="before timing, autotune the plan's best N verified candidates over the CUDA "
                        "backend's lowering options on the GPU and time the fastest correct one (0: the plan "
                        "as chosen, default options)")
    p.add_argument("--variants", type=int, default=8, metavar="K",
                   help="with --autotune: also tune up to K verified tuning variants of each plan (the same fused "
                        "kernels under other grids, splits and loop lengths; mdsl.search.variants), read from the "
                        "plan cache; --plans-only computes and verifies them (0: none)")
    p.add_argument("--no-ptx", dest="ptx", action="store_false",
                   help="skip mdsl's PTX-backend contender (the same plan through llvmlite's NVPTX target)")
    p.add_argument("--tolerance", type=float, default=3e-3, help="relative error bound, ||out - ref|| / ||ref||")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    p.add_argument("--l2-multiple", type=float, default=2.0,
                   help="input sets are rotated so that together they are this many times the L2")
    p.add_argument("--max-input-mb", type=float, default=4096.0, help="memory cap on one case's input sets")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="start no case (and no torch.compile) after this many seconds; what is done is written")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"),
                   help="output directory (default: $OUT when set, else ./bench_out)")
    search = p.add_argument_group("plans")
    search.add_argument("--plans-only", action="store_true",
                        help="only load (or search) the plans and compile their CUDA; no GPU or torch needed")
    search.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True,
                        help="with --plans-only and --autotune: compile every (candidate, options) pair the GPU run "
                             "will time into the cubin cache (default: yes; --no-precompile verifies the tuning "
                             "variants only, e.g. while the code generator still changes)")
    search.add_argument("--variants-budget", type=float, default=1200.0, metavar="SECONDS",
                        help="with --plans-only: wall clock for verifying one plan's tuning variants (an entry "
                             "cut short by it is stored and verified again by the next --plans-only)")
    search.add_argument("--refresh-variants", action="store_true",
                        help="with --plans-only: propose and verify the named cases' tuning variants again even where "
                             "the plan cache has a complete entry (after a change of mdsl.search.variants); other "
                             "cases' entries are untouched")
    search.add_argument("--budget", type=float, default=120.0,
                        help="the search budget of the plans' SearchConfig (part of the plan cache's key)")
    search.add_argument("--workers", type=_positive_int, default=None, help="search worker processes")
    search.add_argument("--on-miss", choices=("search", "fail"), default=None,
                        help="a plan missing from the cache: search for it, or fail mdsl's contenders (default: "
                             "search with --plans-only, fail in the GPU run, whose machine has no z3 and whose "
                             "time is short)")
    p.add_argument("--render", nargs="+", type=Path, metavar="JSON",
                   help="no GPU: merge these results.json files (later ones win) and write the outputs")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.on_miss is None:
        args.on_miss = "search" if args.plans_only else "fail"
    if not args.tolerance > 0:
        p.error("--tolerance must be > 0")
    if args.time_limit is not None and args.time_limit <= 0:
        p.error("--time-limit must be > 0")
    return args


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _case_list(text: str) -> list:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = case_names()
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown case(s) {', '.join(unknown) or '(none given)'}; "
                                         f"the cases are {', '.join(known)}")
    return names


def case_names() -> list:
    """The ten cases, in the order of benchmarks/cases.py (no tracing)."""
    batched = [f"{name}_bs{bs}" for name in ("gqa", "qknorm", "rms_norm_linear", "ntrans") for bs in (1, 8)]
    return batched + ["lora", "gated_mlp"]


class Deadline:
    def __init__(self, seconds: Optional[float]):
        self.start = time.monotonic()
        self.seconds = seconds

    def expired(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.start >= self.seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start


# ---------------------------------------------------------------------------------------------
# plans (no GPU)

def search_config(args: argparse.Namespace, arch: str):
    from mdsl.search.config import SearchConfig

    extra = {"workers": args.workers} if args.workers else {}
    return SearchConfig(budget_s=args.budget, arch=arch, **extra)


class PlanMissing(Exception):
    pass


def get_plan(kernel, config, on_miss: str, progress: bool = False) -> tuple:
    """(plan, whether it came from the cache)."""
    from mdsl.search.cache import default_dir
    from mdsl.search.engine import cached_plan

    plan = cached_plan(kernel.graph, config)
    if plan is not None:
        return plan, True
    if on_miss == "fail":
        raise PlanMissing(f"no plan for {kernel.name} in the plan cache {default_dir()} (budget "
                          f"{config.budget_s:g} s, arch {config.arch}); run --plans-only with the same "
                          "--budget first, or --on-miss search")
    print(f"   {kernel.name}: not in the plan cache: searching for up to {config.budget_s:g} s", flush=True)
    return search_cold(kernel, config, progress=progress or None), False


def plan_record(plan, hit: bool) -> dict:
    return {"cache": "hit" if hit else "searched", "launches": plan.cost.launches, "estimate_s": plan.cost.seconds,
            "is_original": plan.is_original, "describe": describe_plan(plan.graph),
            "evidence": plan.evidence.describe(), "text": str(plan)}


def compile_record(graph, arch: str) -> dict:
    """Emit the plan's CUDA and compile it with NVRTC (no GPU needed): per-kernel resources."""
    from mdsl.backend.cuda.codegen import emit_cuda
    from mdsl.backend.cuda.nvrtc import compile_cuda

    program = emit_cuda(graph, arch=arch)
    module = compile_cuda(program.source, arch=arch)
    return {"kernels": len(program.launches),
            "registers": max((r.registers for r in module.resources.values()), default=0),
            "spill_bytes": sum(r.spill_store_bytes + r.spill_load_bytes for r in module.resources.values()),
            "stack_bytes": max((r.stack_bytes for r in module.resources.values()), default=0),
            "smem_bytes": max((launch.smem_bytes for launch in program.launches), default=0)}


def tuning_variants(plan, args: argparse.Namespace, arch: str) -> dict:
    """Propose, verify and store the plan's tuning variants (mdsl.search.variants; CPU minutes for the
    attention cases), unless the plan cache has them: what was found. The best proposals are ranked again
    with the register counts of kernels the cubin cache already holds."""
    from mdsl.backend.cuda.autotune import compiled_registers
    from mdsl.search.variants import VariantSpace, ensure_variants

    start = time.perf_counter()
    found = ensure_variants(plan, args.variants, workers=args.workers,
                            space=VariantSpace(budget_s=args.variants_budget), refresh=args.refresh_variants,
                            registers=lambda graph: compiled_registers(graph, arch))
    return {"verified": len(found), "seconds": time.perf_counter() - start,
            "variants": [f"{v.describe}: est. {v.gpu_seconds * 1e6:.1f} us" for v in found]}


def precompile_variants(plan, limit: int, variants: int, arch: str) -> dict:
    """Compile (into the cubin cache under $MDSL_CACHE_DIR) every (candidate, options) pair the GPU run's
    autotuner will time for this plan (`autotune.tuning_set`), so that the GPU's time goes to timing, not
    to NVRTC: how many compiled, and the pairs that failed (the GPU run reports them again)."""
    from mdsl.backend.cuda.autotune import emitted_variants, parameter_space, tuning_set
    from mdsl.backend.cuda.codegen import emit_cuda
    from mdsl.backend.cuda.nvrtc import compile_cuda
    from mdsl.errors import MdslError

    todo = tuning_set(plan, limit, variants)
    compiled, failed = 0, []
    for v, problem in emitted_variants(todo.graphs, parameter_space(), arch, todo.spaces, todo.names):
        if not problem:
            try:
                compile_cuda(emit_cuda(todo.graphs[v.candidate], arch=arch, options=v.options).source, arch=arch)
                compiled += 1
                continue
            except MdslError as e:
                problem = _one_line(e)
        failed.append(f"{v.describe()}: {problem}")
    return {"compiled": compiled, "failed": failed}


def plans_only(args: argparse.Namespace, names: list) -> int:
    from benchmarks.cases import cases
    from mdsl import gpu as runtime
    from mdsl.search.cache import default_dir
    from mdsl.search.cost import roofline_floor

    arch = runtime.target_arch()
    config = search_config(args, arch)
    kernels = cases()
    print(f"plans for {len(names)} case(s): SearchConfig(budget_s={config.budget_s:g}, seed={config.seed}, "
          f"arch={arch}), plan cache {default_dir()}", flush=True)
    rows, failed = {}, 0
    for name in names:
        row = rows[name] = {}
        try:
            start = time.perf_counter()
            plan, hit = get_plan(kernels[name], config, args.on_miss, progress=True)
            if not hit:   # as stored: the variants entry is keyed by the plan's cache key
                plan = get_plan(kernels[name], config, "fail")[0]
            row.update(plan_record(plan, hit), seconds=time.perf_counter() - start,
                       floor_s=roofline_floor(kernels[name].graph).seconds)
            try:
                row["cuda"] = compile_record(plan.graph, arch)
                if args.autotune:
                    if args.variants:
                        try:
                            row["variants"] = tuning_variants(plan, args, arch)
                            print(f"   {name}: {row['variants']['verified']} verified tuning variant(s) in "
                                  f"{row['variants']['seconds']:.0f} s", flush=True)
                        except Exception as e:   # the plan and its own candidates are still tuned
                            row["variants"] = {"error": _one_line(e), "traceback": _traceback()}
                            print(f"   {name}: no tuning variants: {row['variants']['error']}", flush=True)
                    if args.precompile:
                        precompiled = precompile_variants(plan, args.autotune, args.variants, arch)
                        row["cuda"]["autotune_variants_compiled"] = precompiled["compiled"]
                        row["cuda"]["autotune_variants_failed"] = precompiled["failed"]
            except ModuleNotFoundError as e:   # no cuda.bindings: the plan is still good
                row["cuda"] = {"skipped": f"not compiled: {e}"}
        except Exception as e:
            failed += 1
            row.update(status="failed", error=_one_line(e), traceback=_traceback())
        print(_plan_row(name, row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "plans.json"
    path.write_text(json.dumps({"schema": SCHEMA, "meta": environment(args), "plans": rows}, indent=1,
                               default=str))
    print()
    print(plans_table(rows))
    print(f"\n{len(names) - failed}/{len(names)} plan(s) ready in {default_dir()}; details: {path}")
    return 1 if failed else 0


def _plan_row(name: str, row: dict) -> str:
    if row.get("status") == "failed":
        return f"   {name}: FAILED: {row['error']}"
    return f"   {name}: {row['cache']} in {row['seconds']:.1f} s: {row['describe']}"


def plans_table(rows: dict) -> str:
    lines = ["| case | plan | launches | estimate µs | floor µs | CUDA (regs, spills) | kernels |",
             "|---|---|---:|---:|---:|---|---|"]
    for name, row in rows.items():
        if row.get("status") == "failed":
            lines.append(f"| {name} | FAILED: {_cell(row['error'])} | | | | | |")
            continue
        cuda = row.get("cuda", {})
        compiled = cuda.get("skipped") or f"{cuda['registers']} regs, {cuda['spill_bytes']} B spilled"
        lines.append(f"| {name} | {row['cache']}{' (original)' if row['is_original'] else ''} | {row['launches']} | "
                     f"{row['estimate_s'] * 1e6:.2f} | {row['floor_s'] * 1e6:.2f} | {compiled} | "
                     f"{_cell(row['describe'])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# numbers (no GPU)

def input_sets(working_set_bytes: int, l2_bytes: int, l2_multiple: float, max_bytes: float) -> int:
    """How many input sets to rotate: enough that they exceed l2_multiple × L2, at least 2, within the cap."""
    want = math.ceil(l2_multiple * l2_bytes / max(1, working_set_bytes))
    fit = int(max_bytes // max(1, working_set_bytes))
    return max(2, min(want, fit, MAX_SETS))


def _time(contender: Optional[dict]) -> Optional[float]:
    if contender and contender.get("status") == "ok" and contender.get("median_s"):
        return contender["median_s"]
    return None


def derive(case: dict) -> dict:
    """The comparisons of one case from its contenders' medians: best baseline, best mdsl mode,
    speed-up (best baseline / best mdsl), fraction of the roofline floor and achieved bandwidth."""
    contenders = case.get("contenders") or {}
    baselines = {n: t for n in BASELINES if (t := _time(contenders.get(n))) is not None}
    mdsl = {n: t for n in MDSL if (t := _time(contenders.get(n))) is not None}
    best_baseline = min(baselines, key=baselines.get) if baselines else None
    best_mdsl = min(mdsl, key=mdsl.get) if mdsl else None
    out = {"best_baseline": best_baseline, "best_baseline_s": baselines.get(best_baseline),
           "mdsl_best": best_mdsl, "mdsl_s": mdsl.get(best_mdsl), "speedup": None,
           "speedups": {}, "floor_fraction": None, "achieved_bytes_per_s": None, "ptx_over_cuda": None}
    if mdsl.get("mdsl") and mdsl.get("mdsl_ptx"):   # the PTX backend's time over the CUDA backend's
        out["ptx_over_cuda"] = mdsl["mdsl_ptx"] / mdsl["mdsl"]
    if best_baseline:
        out["speedups"] = {n: baselines[best_baseline] / t for n, t in mdsl.items()}
        if best_mdsl:
            out["speedup"] = out["speedups"][best_mdsl]
    floor = case.get("floor")
    if best_mdsl and floor:
        out["floor_fraction"] = floor["seconds"] / mdsl[best_mdsl]
        out["achieved_bytes_per_s"] = floor["bytes"] / mdsl[best_mdsl]
    return out


def rel_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (numpy arrays or torch tensors); NaN where out has NaN."""
    diff, norm = out - ref, ref
    num = float((diff * diff).sum()) ** 0.5
    den = float((norm * norm).sum()) ** 0.5
    return num / den if den else (0.0 if num == 0 else math.inf)


# ---------------------------------------------------------------------------------------------
# rendering (no GPU)

def _us(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    us = seconds * 1e6
    return f"{us:.0f}" if us >= 100 else f"{us:.1f}" if us >= 10 else f"{us:.2f}"


def _num(value: float) -> str:
    """Whole numbers from 10 on, two significant digits below."""
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _contender_cell(case: dict, name: str, best: Optional[str]) -> str:
    c = (case.get("contenders") or {}).get(name)
    if c is None:
        return "-"
    status = c.get("status")
    if status == "ok":
        text = _us(c.get("median_s"))
        return f"**{text}**" if name == best else text
    return "fail" if status == "failed" else "skip"


def render_markdown(results: dict) -> str:
    meta = results.get("meta") or {}
    gpu = meta.get("gpu") or {}
    lines = [f"# Kernel benchmark: mdsl vs PyTorch{' on ' + gpu['name'] if gpu.get('name') else ''}", ""]
    env = [f"{k} {meta[k]}" for k in ("date", "torch", "mdsl_commit") if meta.get(k)]
    if gpu.get("driver"):
        env.append(f"driver {gpu['driver']}")
    if env:
        lines += [", ".join(env), ""]
    method = meta.get("method") or {}
    if method:
        lines += [f"Times in µs per call: median of {method.get('reps')} samples of {method.get('batch')} "
                  f"back-to-back calls (CUDA events), inputs rotated over sets that exceed "
                  f"{method.get('l2_multiple')}× L2; each contender's output checked against a float64 "
                  f"reference first (relative error <= {method.get('tolerance')}). **Bold**: the best baseline. "
                  "Speed-up: best baseline / best mdsl mode; % of floor, achieved GB/s: of that mdsl time.", ""]
    empty = (meta.get("empty_launch") or {}).get("median_s")
    if empty:
        lines += [f"An empty kernel launched as mdsl launches its kernels, timed the same way: **{_us(empty)} µs** "
                  "per call (a floor below it is out of reach of any kernel launched from the host).", ""]
    header = ["case", "floor µs", *(LABELS[n] for n in BASELINES), *(LABELS[n] for n in MDSL),
              "speed-up vs best baseline", "% of floor", "bytes", "achieved GB/s", "PTX / CUDA time"]
    lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    notes = []
    for name, case in (results.get("cases") or {}).items():
        d = derive(case)
        floor = case.get("floor") or {}
        row = [name, _us(floor.get("seconds"))]
        row += [_contender_cell(case, n, d["best_baseline"]) for n in BASELINES + MDSL]
        row += [f"{d['speedup']:.2f}×" if d["speedup"] else "-",
                f"{_num(100 * d['floor_fraction'])}%" if d["floor_fraction"] else "-",
                f"{floor['bytes'] / 1e6:.2f} MB" if floor.get("bytes") else "-",
                _num(d["achieved_bytes_per_s"] / 1e9) if d["achieved_bytes_per_s"] else "-",
                f"{d['ptx_over_cuda']:.2f}" if d["ptx_over_cuda"] else "-"]
        if case.get("status") in ("failed", "skipped"):
            row[2 + len(BASELINES) + len(MDSL)] = case["status"]
            notes.append(f"- {name}: {case['status']}: {case.get('error') or case.get('reason', '')}")
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
        for cname, c in (case.get("contenders") or {}).items():
            if c.get("status") == "failed" or (c.get("status") == "skipped"
                                               and not str(c.get("reason", "")).startswith("--")):
                notes.append(f"- {name} / {LABELS.get(cname, cname)}: {c['status']}: {c.get('reason', '')}")
        tuned = case.get("autotune") or {}
        if tuned.get("error"):
            notes.append(f"- {name}: autotuning failed ({tuned['error']}): the plan's choice was timed")
        elif tuned.get("choice"):
            notes.append(f"- {name}: autotuned: {tuned['choice']} ({tuned['us']:.1f} µs in the tuner)")
        if (case.get("plan") or {}).get("error"):
            notes.append(f"- {name}: no plan: {case['plan']['error']}")
        check = case.get("reference_check")
        if check and not check.get("ok"):
            notes.append(f"- {name}: the torch program in float64 differs from mdsl's interpreter "
                         f"(relative error {check.get('rel_error')}): its baselines compute another function")
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def render_plot(results: dict, path: Path) -> Optional[str]:
    """Bar chart of each mdsl mode's speed-up over the best baseline (log scale); None, or why not drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullLocator
    except ImportError:
        return "matplotlib is not installed: no plot"
    import numpy as np

    cases = results.get("cases") or {}
    names = list(cases)
    derived = [derive(c) for c in cases.values()]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 * len(names) + 2), 4.8))
    x = np.arange(len(names))
    width = 0.8 / len(MDSL)
    values = []
    for k, mode in enumerate(MDSL):
        heights = [d["speedups"].get(mode, math.nan) for d in derived]
        values += [h for h in heights if not math.isnan(h)]
        # bars grow from the 1.0 line, up for a speed-up, down for a slow-down
        bars = ax.bar(x + (k - (len(MDSL) - 1) / 2) * width, [h - 1 for h in heights], width, bottom=1.0,
                      label=LABELS[mode])
        for bar, h in zip(bars, heights):
            if not math.isnan(h):
                ax.annotate(f"{h:.2f}", (bar.get_x() + bar.get_width() / 2, h), ha="center",
                            va="bottom" if h >= 1 else "top", fontsize=7)
    ax.set_yscale("log")
    low, high = min(values + [1.0]) / 1.6, max(values + [1.0]) * 1.6
    ax.set_ylim(low, high)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    ax.set_yticks([t for d in decades for t in (10.0**d, 2 * 10.0**d, 5 * 10.0**d) if low <= t <= high])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.yaxis.set_minor_locator(NullLocator())
    for i, d in enumerate(derived):
        if not d["speedups"]:
            ax.annotate("n/a", (i, 1.0), ha="center", va="bottom", fontsize=8, color="gray")
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.set_ylabel("speed-up over the best PyTorch baseline (×)")
    gpu = ((results.get("meta") or {}).get("gpu") or {}).get("name", "")
    ax.set_title("mdsl vs the best of PyTorch eager, SDPA, CUDA graph and torch.compile"
                 + (f"\n{gpu}" if gpu else ""), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return None


def write_outputs(results: dict, out: Path, plot: bool = True) -> dict:
    """results.json, results.md and (with `plot`) results.png under `out`; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    for case in (results.get("cases") or {}).values():
        case["derived"] = derive(case)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_strict(results), indent=1, default=str, allow_nan=False))
    os.replace(tmp, paths["json"])
    paths["md"].write_text(render_markdown(results))
    if plot:
        why = render_plot(results, out / "results.png")
        if why is None:
            paths["png"] = out / "results.png"
        else:
            print(f"no plot: {why}")
    return paths


def _strict(value):
    """`value` for strict JSON: a float that is not finite (a NaN error, say) becomes its repr."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def merge_results(runs: Sequence[dict]) -> dict:
    """Several runs' results as one: a case in a later run replaces the earlier one's, unless the later
    one was skipped."""
    if len(runs) == 1:
        return runs[0]
    cases: dict = {}
    for run in runs:
        for name, case in (run.get("cases") or {}).items():
            if name not in cases or case.get("status") != "skipped":
                cases[name] = case
    meta = dict(runs[-1].get("meta") or {})
    meta["merged_from"] = [r.get("meta") for r in runs]
    return {"schema": SCHEMA, "meta": meta, "cases": cases}


def render(args: argparse.Namespace) -> int:
    runs = []
    for path in args.render:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            print(f"cannot read {path}: {e}", file=sys.stderr)
            return 2
    results = merge_results(runs)
    paths = write_outputs(results, args.out)
    print(render_markdown(results))
    print("written:", ", ".join(str(p) for p in paths.values()))
    return 0 if all_passed(results) else 1


# ---------------------------------------------------------------------------------------------
# environment

def environment(args: argparse.Namespace, torch=None) -> dict:
    meta = provenance("kernels.py", args.argv)
    meta.update(plan_cache=os.environ.get("MDSL_CACHE_DIR"), method={k: getattr(args, k) for k in METHOD_OPTIONS})
    meta["method"]["timing"] = "median over samples of (batch of back-to-back calls between two CUDA events) / batch"
    if torch is not None:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        meta["torch"] = torch.__version__
        meta["torch_cuda"] = torch.version.cuda
        meta["gpu"] = {"name": props.name, "sms": props.multi_processor_count, "memory_bytes": props.total_memory,
                       "l2_bytes": getattr(props, "L2_cache_size", None),
                       "capability": f"{props.major}.{props.minor}", **nvidia_smi()}
        meta["fp16_reduced_precision_reduction"] = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        try:
            import triton
            meta["triton"] = triton.__version__
        except ImportError:
            pass
    return meta


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def _traceback() -> str:
    text = traceback.format_exc()
    return text if len(text) <= 6000 else "...\n" + text[-6000:]


# ---------------------------------------------------------------------------------------------
# the GPU run

def torch_programs(torch) -> dict:
    """family -> {contender: f(*inputs)}: each case's computation in PyTorch, the semantics of its mdsl
    kernel (rms_norm: x / sqrt(mean(x^2) + eps) with no weight; softmax subtracts the row maximum)."""
    F = torch.nn.functional

    def rms_norm(x, dim: int = -1):
        if dim in (-1, x.ndim - 1):
            return F.rms_norm(x, (x.shape[-1],), eps=EPS)
        return F.rms_norm(x.transpose(dim, -1), (x.shape[dim],), eps=EPS).transpose(dim, -1)

    def attention(q, k, v):
        return torch.softmax(q @ k, dim=-1) @ v

    def sdpa(q, k, v):
        # 4-D (batch 1) with a row-major K, as SDPA's fused kernels need; K is stored transposed
        out = F.scaled_dot_product_attention(q[None], k.transpose(-2, -1).contiguous()[None], v[None], scale=1.0)
        return out[0]

    return {
        "gqa": {"eager": attention, "sdpa": sdpa},
        "qknorm": {"eager": lambda q, k, v: attention(rms_norm(q), rms_norm(k, 1), v),
                   "sdpa": lambda q, k, v: sdpa(rms_norm(q), rms_norm(k, 1), v)},
        "rms_norm_linear": {"eager": lambda x, w: rms_norm(x) @ w},
        "lora": {"eager": lambda x, w, a, b: x @ w + x @ a @ b},
        "gated_mlp": {"eager": lambda x, w1, w2: F.silu(x @ w1) * (x @ w2)},
        "ntrans": {"eager": lambda h, x, alpha: rms_norm(x + alpha * (rms_norm(h) - x))},
    }


@dataclass
class Contender:
    """`run(i)` enqueues one call on input set i (what is timed); `check(i)` runs one and returns its
    output (in a NaN-poisoned buffer where the contender writes into one of ours)."""

    name: str
    run: Callable[[int], Any]
    check: Callable[[int], Any]
    info: dict = field(default_factory=dict)
    release: Callable[[], None] = lambda: None   # frees what it holds (CUDA graphs before the module they run)


class Bench:
    def __init__(self, args: argparse.Namespace, torch):
        from benchmarks.cases import cases
        from mdsl import gpu as runtime

        self.args, self.torch, self.runtime = args, torch, runtime
        self.device = torch.cuda.current_device()
        self.dev = torch.device("cuda", self.device)
        self.arch = runtime.target_arch(self.device)
        self.config = search_config(args, self.arch)
        self.kernels = cases()
        props = torch.cuda.get_device_properties(self.device)
        self.l2_bytes = getattr(props, "L2_cache_size", 0) or L2_BYTES

    # -- one case ----------------------------------------------------------------------------

    def case(self, name: str, rec: dict, deadline: Deadline) -> None:
        from mdsl.backend.reference import run_kernel_graph
        from mdsl.search.cost import roofline_floor

        torch, args = self.torch, self.args
        kernel = self.kernels[name]
        graph = kernel.graph
        floor = roofline_floor(graph)
        rec["floor"] = {"seconds": floor.seconds, "bytes": floor.bytes, "flops": floor.flops, "bound": floor.bound}

        start = time.perf_counter()
        try:
            plan, hit = get_plan(kernel, self.config, args.on_miss)
            rec["plan"] = plan_record(plan, hit)
            rec["plan"]["seconds"] = time.perf_counter() - start
            _say(f"plan ({rec['plan']['cache']}): {rec['plan']['describe']}")
        except PlanMissing as e:   # the baselines are still worth measuring
            plan, rec["plan"] = None, {"error": str(e)}
            _say(f"NO PLAN: {e}")

        n_sets = input_sets(floor.bytes, self.l2_bytes, args.l2_multiple, args.max_input_mb * 1e6)
        rec["input_sets"] = n_sets
        rec["inputs"] = {v.name: list(INPUTS[family(name)][v.name]) for v in graph.inputs}
        sets = self.inputs(name, graph, n_sets)
        outputs = graph.outputs
        if len(outputs) != 1:
            raise ValueError(f"{name} has {len(outputs)} outputs; the harness compares one")
        out_shape, out_dtype = tuple(outputs[0].type.shape), getattr(torch, outputs[0].type.dtype.long_name)

        # the reference: mdsl's interpreter in float64 on the same rounded inputs
        check_sets = sorted({0, n_sets - 1})
        refs = {}
        for i in check_sets:
            host = [x.cpu().numpy() for x in sets[i]]
            refs[i] = torch.from_numpy(run_kernel_graph(graph, host, precision="float64")[0]).to(sets[i][0].device)
        programs = torch_programs(torch)[family(name)]
        torch64 = programs["eager"](*[x.double() for x in sets[0]])
        ref_error = rel_error(torch64, refs[0])
        rec["reference_check"] = {"rel_error": ref_error, "ok": ref_error <= 1e-9}
        if not ref_error <= 1e-9:
            _say(f"WARNING: the torch program in float64 differs from the interpreter: {ref_error:.2e}")

        if args.compile:
            torch._dynamo.reset()   # nothing compiled for an earlier case stays (or is reused with its shapes)
        eager = programs["eager"]
        chosen, options = self.tuned(plan, rec) if plan is not None else (None, None)
        makers = [("mdsl", self.mdsl, (chosen, sets, out_shape, out_dtype, False, "cuda", options)),
                  ("mdsl_graph", self.mdsl, (chosen, sets, out_shape, out_dtype, True, "cuda", options)),
                  # the same graph under the same tuned options, so that PTX / CUDA compares code generators
                  ("mdsl_ptx", self.mdsl, (chosen, sets, out_shape, out_dtype, False, "ptx", options)),
                  *((n, self.eager, (f, sets)) for n, f in programs.items()),
                  ("cuda_graph", self.graph_of, (eager, sets)),
                  *((n, self.compiled, (eager, mode, sets)) for n, mode in COMPILE_MODES.items())]
        results = rec["contenders"] = {}
        made, passed = [], []
        try:
            for cname, make, make_args in makers:
                c = results[cname] = {}
                skip = self.skip_reason(cname, deadline)
                if skip:
                    c.update(status="skipped", reason=skip)
                    continue
                if cname in MDSL and plan is None:
                    c.update(status="failed", reason="no plan (see the case's plan.error)")
                    continue
                try:
                    t0 = time.perf_counter()
                    contender = make(*make_args)
                    contender.name = cname
                    made.append(contender)
                    c["prepare_s"] = time.perf_counter() - t0
                    c.update(contender.info)
                    self.check(contender, c, refs, out_shape, out_dtype)
                except Exception as e:
                    c.update(status="failed", reason=_one_line(e), traceback=_traceback())
                    if not self.cuda_usable():
                        raise RuntimeError(f"the CUDA context is unusable after {cname} failed: {c['reason']}") from e
                if c["status"] == "ok":
                    passed.append(contender)
                _say(f"{cname}: {c['status']}"
                     + (f", error {c['rel_error']:.2e}" if "rel_error" in c else "")
                     + (f", prepared in {c['prepare_s']:.1f} s" if c.get("prepare_s", 0) > 1 else "")
                     + (f": {c['reason']}" if c["status"] != "ok" else ""))
            self.time_all(passed, results, n_sets)
        finally:
            for contender in reversed(made):
                try:
                    contender.release()
                except Exception as e:   # the numbers stand; say what could not be freed
                    rec.setdefault("release_errors", []).append(f"{contender.name}: {_one_line(e)}")
        rec["status"] = "ok"
        d = derive(rec)
        if d["speedup"]:
            _say(f"speed-up {d['speedup']:.2f}x ({LABELS[d['mdsl_best']]} {_us(d['mdsl_s'])} us vs "
                 f"{LABELS[d['best_baseline']]} {_us(d['best_baseline_s'])} us), "
                 f"{_num(100 * d['floor_fraction'])}% of the floor")

    def check(self, contender: Contender, c: dict, refs: dict, out_shape: tuple, out_dtype) -> None:
        """Each check set's output against the reference: c's status, rel_error and reason."""
        errors = {}
        for i, ref in refs.items():
            out = contender.check(i)
            self.torch.cuda.synchronize()
            if tuple(out.shape) != out_shape or out.dtype != out_dtype:
                raise ValueError(f"output {out.dtype}{list(out.shape)}, want {out_dtype}{list(out_shape)}")
            errors[i] = rel_error(out.double(), ref)
        c["rel_error"] = max(errors.values(), key=lambda e: (math.isnan(e), e))   # NaN is the worst
        if c["rel_error"] <= self.args.tolerance:
            c["status"] = "ok"
        else:
            per_set = ", ".join(f"{e:.3g}" for e in errors.values())
            c.update(status="failed", reason=f"relative error {c['rel_error']:.3g} > {self.args.tolerance:g} "
                                             f"(per check set: {per_set})")

    def skip_reason(self, name: str, deadline: Deadline) -> Optional[str]:
        args = self.args
        if name in ("cuda_graph", "mdsl_graph") and not args.graphs:
            return "--no-graphs"
        if name == "mdsl_ptx" and not args.ptx:
            return "--no-ptx"
        if name in COMPILE_MODES:
            if not args.compile:
                return "--no-compile"
            if name == "compile_max" and not args.max_autotune:
                return "--no-max-autotune"
            if deadline.expired():
                return "time limit"
        return None

    def inputs(self, name: str, graph, n_sets: int) -> list:
        """n_sets tuples of random f16 tensors on the GPU, one per kernel parameter, from a seed per case."""
        torch = self.torch
        spec = INPUTS[family(name)]
        if [v.name for v in graph.inputs] != list(spec):
            raise ValueError(f"{name}'s parameters are {[v.name for v in graph.inputs]}, but INPUTS describes "
                             f"{list(spec)}")
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(zlib.crc32(f"{self.args.seed}:{name}".encode()))
        sets = []
        for _ in range(n_sets):
            one = []
            for v in graph.inputs:
                kind, *p = spec[v.name]
                x = torch.empty(tuple(v.type.shape), dtype=torch.float32, device=self.dev)
                x = x.normal_(0.0, p[0], generator=gen) if kind == "normal" else x.uniform_(p[0], p[1], generator=gen)
                one.append(x.to(getattr(torch, v.type.dtype.long_name)))
            sets.append(tuple(one))
        return sets

    # -- contenders ----------------------------------------------------------------------------

    def eager(self, fn: Callable, sets: list) -> Contender:
        return Contender("eager", lambda i: fn(*sets[i]), lambda i: fn(*sets[i]))

    def compiled(self, fn: Callable, mode: Optional[str], sets: list) -> Contender:
        compiled = self.torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        compiled(*sets[0])
        self.torch.cuda.synchronize()
        return Contender("compile", lambda i: compiled(*sets[i]), lambda i: compiled(*sets[i]),
                         {"compile_s": time.perf_counter() - t0})

    def graph_of(self, fn: Callable, sets: list) -> Contender:
        graphs, outs = self.capture([lambda s=s: fn(*s) for s in sets])
        return self.replayer("cuda graph", graphs, outs)

    def tuned(self, plan, rec: dict) -> tuple:
        """The mugraph and CUDA options mdsl's contenders run: the autotuner's pick among the plan's best
        --autotune candidates (recorded in rec["autotune"]), else the plan's choice with default options."""
        if not self.args.autotune:
            return plan.graph, None
        from mdsl.backend.cuda.autotune import autotune, tuning_set

        t0 = time.perf_counter()
        try:
            todo = tuning_set(plan, self.args.autotune, self.args.variants)
            best = autotune(todo.graphs, plan.original, spaces=todo.spaces, names=todo.names, device=self.device)
        except Exception as e:   # the plan as chosen is still worth timing; say why it was not tuned
            rec["autotune"] = {"error": _one_line(e), "seconds": time.perf_counter() - t0}
            _say(f"autotune failed, timing the plan as chosen: {_one_line(e)}")
            return plan.graph, None
        rec["autotune"] = {"choice": best.variant.describe(), "candidate": best.variant.candidate,
                           "us": best.us, "report": best.lines(), "seconds": time.perf_counter() - t0}
        _say("\n   ".join(best.lines()))
        return best.graph, best.options

    def mdsl(self, graph, sets: list, out_shape: tuple, out_dtype, graphs: bool, backend: str = "cuda",
             options=None) -> Contender:
        torch = self.torch
        exe = self.runtime.compile_graph(graph, arch=self.arch, device=self.device, backend=backend, options=options)
        outs = [torch.empty(out_shape, dtype=out_dtype, device=self.dev) for _ in sets]
        exe(list(sets[0]), [outs[0]])   # the checked path once: shapes, dtypes, devices, alignment
        torch.cuda.synchronize()
        ins = [[x.data_ptr() for x in s] for s in sets]
        out_ptrs = [[o.data_ptr()] for o in outs]
        resources = getattr(exe.module, "resources", {}).values()   # the PTX backend's module reports none
        info = {"launches": len(exe.program.launches),
                "registers": max((r.registers for r in resources), default=0),
                "spill_bytes": sum(r.spill_store_bytes + r.spill_load_bytes for r in resources)}
        if graphs:
            calls = [lambda i=i: exe.run_pointers(ins[i], out_ptrs[i], torch.cuda.current_stream().cuda_stream)
                     for i in range(len(sets))]
            captured, _ = self.capture(calls)
            contender = self.replayer("mdsl graph", captured, outs)

            def release():
                captured.clear()   # the graphs, then the module their kernels live in
                exe.close()

            contender.release = release
        else:
            stream = torch.cuda.current_stream().cuda_stream

            def check(i):
                outs[i].fill_(math.nan)
                exe.run_pointers(ins[i], out_ptrs[i], stream)
                return outs[i]

            contender = Contender(f"mdsl ({backend})", lambda i: exe.run_pointers(ins[i], out_ptrs[i], stream), check,
                                  release=exe.close)
        contender.info.update(info)
        return contender

    def capture(self, calls: list) -> tuple:
        """One CUDA graph per call (after a warm-up on a side stream, as torch.cuda.graph asks), sharing
        one memory pool (they replay one at a time, on one stream); (graphs, each call's result)."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                calls[0]()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        graphs, results = [], []
        for call in calls:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                results.append(call())
            graphs.append(g)
        torch.cuda.synchronize()
        return graphs, results

    @staticmethod
    def replayer(name: str, graphs: list, outs: list) -> Contender:
        def check(i):
            outs[i].fill_(math.nan)
            graphs[i].replay()
            return outs[i]

        return Contender(name, lambda i: graphs[i].replay(), check, {"graphs": len(graphs)}, release=graphs.clear)

    # -- timing --------------------------------------------------------------------------------

    def time_all(self, contenders: list, results: dict, n_sets: int) -> None:
        """Warm-up, then --reps samples per contender in --passes interleaved passes."""
        torch, args = self.torch, self.args
        samples = {c.name: [] for c in contenders}
        passes = {c.name: [] for c in contenders}
        cursor = {c.name: 0 for c in contenders}   # each call takes the next input set
        for c in contenders:
            for i in range(max(args.warmup, n_sets)):
                c.run(i % n_sets)
        torch.cuda.synchronize()
        per_pass = math.ceil(args.reps / args.passes)
        for _ in range(args.passes):
            for c in contenders:
                times, cursor[c.name] = self.time_one(c, per_pass, cursor[c.name], n_sets)
                samples[c.name] += times
                passes[c.name].append(_median(times))
        for c in contenders:
            ts = sorted(samples[c.name])
            r = results[c.name]
            r.update(median_s=_median(ts), p10_s=ts[len(ts) // 10], p90_s=ts[(9 * len(ts)) // 10], min_s=ts[0],
                     pass_medians_s=passes[c.name], samples=len(ts), batch=args.batch)
            _say(f"{c.name}: {_us(r['median_s'])} µs (pass medians {', '.join(_us(t) for t in r['pass_medians_s'])})")

    def time_one(self, c: Contender, samples: int, k: int, n_sets: int) -> tuple:
        """`samples` times per call, each of a batch of calls from set k on; (times, the next k)."""
        torch, batch = self.torch, self.args.batch
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
        for s in range(samples):
            starts[s].record()
            for _ in range(batch):
                c.run(k % n_sets)
                k += 1
            ends[s].record()
        torch.cuda.synchronize()
        return [a.elapsed_time(b) * 1e-3 / batch for a, b in zip(starts, ends)], k

    def empty_launch(self) -> dict:
        """An empty kernel launched through mdsl's launch path (`runtime.EmptyKernel`: the cuLaunchKernel call
        of mdsl's contenders, on the same stream), timed as every contender is: what one launch costs."""
        kernel = self.runtime.EmptyKernel(self.device)
        stream = self.torch.cuda.current_stream().cuda_stream
        out = {"empty launch": {}}
        self.time_all([Contender("empty launch", lambda i: kernel(stream), lambda i: None, release=kernel.close)],
                      out, 1)
        kernel.close()
        return out["empty launch"]

    def cuda_usable(self) -> bool:
        torch = self.torch
        try:
            torch.cuda.synchronize()
            return float((torch.ones(4, device=self.dev) * 2).sum().item()) == 8.0
        except Exception:
            return False


def _median(values: list) -> float:
    ts = sorted(values)
    mid = len(ts) // 2
    return ts[mid] if len(ts) % 2 else (ts[mid - 1] + ts[mid]) / 2


def _say(text: str) -> None:
    print(f"   {text}", flush=True)


def gpu_run(args: argparse.Namespace, names: list) -> int:
    try:
        import torch
    except ImportError:
        print("the GPU run needs torch (its baselines); `--plans-only` and `--render` do not", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("torch sees no CUDA GPU: the GPU run needs one (`--plans-only` and `--render` do not)", file=sys.stderr)
        return 2
    from mdsl import gpu as runtime
    from mdsl.search.engine import cached_plan

    runtime.require_gpu("the kernel benchmark")
    deadline = Deadline(args.time_limit)
    bench = Bench(args, torch)
    results = {"schema": SCHEMA, "meta": environment(args, torch), "cases": {}}
    gpu = results["meta"]["gpu"]
    print(f"{gpu['name']}, driver {gpu.get('driver', '?')}, torch {torch.__version__}, arch {bench.arch}, "
          f"L2 {bench.l2_bytes / 2**20:.0f} MiB; {args.reps} samples x {args.batch} calls per contender; "
          f"out {args.out}", flush=True)
    try:
        try:
            results["meta"]["empty_launch"] = bench.empty_launch()
        except Exception as e:   # the cases are still worth measuring
            results["meta"]["empty_launch"] = {"error": _one_line(e)}
            _say(f"the empty kernel launch was not timed: {_one_line(e)}")
        hits = [n for n in names if cached_plan(bench.kernels[n].graph, bench.config) is not None]
        missing = [n for n in names if n not in hits]
        print(f"plan cache {os.environ.get('MDSL_CACHE_DIR') or '(default)'}: {len(hits)}/{len(names)} hit(s)"
              + (f"; missing: {', '.join(missing)} (--on-miss {args.on_miss})" if missing else ""), flush=True)
        results["meta"]["plan_cache_hits"] = hits
        usable = True
        for name in names:
            rec = results["cases"][name] = {}
            if not usable or deadline.expired():
                rec.update(status="skipped", reason="time limit" if usable else "the CUDA context is unusable")
                continue
            print(f"== {name} ({deadline.elapsed():.0f} s)", flush=True)
            start = time.perf_counter()
            try:
                bench.case(name, rec, deadline)
            except Exception as e:
                rec.update(status="failed", error=_one_line(e), traceback=_traceback())
                _say(f"FAILED: {rec['error']}")
                usable = bench.cuda_usable()
            rec["seconds"] = time.perf_counter() - start
            if usable:
                torch.cuda.empty_cache()
            write_outputs(results, args.out, plot=False)
    finally:   # whatever happened (an interrupt too), what is done is written
        paths = write_outputs(results, args.out)
        print(f"\ndone in {deadline.elapsed():.0f} s; written: {', '.join(str(p) for p in paths.values())}\n")
        print(render_markdown(results), flush=True)
    return 0 if all_passed(results) else 1


def all_passed(results: dict) -> bool:
    """Whether every case ran and mdsl's plan passed its correctness check in each."""
    return all(c.get("status") == "ok" and (c.get("contenders") or {}).get("mdsl", {}).get("status") == "ok"
               for c in (results.get("cases") or {}).values())


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args)
    names = args.cases or case_names()
    if args.plans_only:
        return plans_only(args, names)
    return gpu_run(args, names)


if __name__ == "__main__":
    sys.exit(main())

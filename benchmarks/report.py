"""docs/performance.md from the benchmarks' JSON results in docs/results/ (the latest run of each kind).

    python benchmarks/report.py            # write docs/performance.md
    python benchmarks/report.py --check    # exit 1 when docs/performance.md is not what this would write
    python benchmarks/report.py --plot     # also draw docs/results/decode.png and serve.png (needs matplotlib)

Inputs (each written by its benchmark; the command is stored in the file's `meta` and printed above its
table):

    docs/results/kernels.json        benchmarks/kernels.py --out DIR          (DIR/results.json)
    docs/results/kernels.png         the same run's plot                      (DIR/results.png)
    docs/results/decode.json         benchmarks/decode.py --out DIR           (DIR/decode_results.json)
    docs/results/decode_tp.json      benchmarks/decode.py --tp 2 --out DIR    (DIR/decode_results.json)
    docs/results/decode_moe.json     benchmarks/decode.py --models qwen3-30b-a3b --out DIR  (DIR/decode_results.json)
    docs/results/search_times.json   benchmarks/search_times.py --json FILE
    docs/results/compile_times.json  benchmarks/compile_time.py --json FILE
    docs/results/gemm.json           benchmarks/gemm.py --out DIR             (DIR/gemm.json)
    docs/results/gemm_prefill.json   benchmarks/gemm.py --rows 1024,4096 --shapes K:N,... --out DIR  (DIR/gemm.json)
    docs/results/call_overhead.json  benchmarks/call_overhead.py --out DIR    (DIR/call_overhead.json)
    docs/results/torch_compile*.json benchmarks/torch_compile.py [--workloads W] [--contenders C] --out DIR
                                     (DIR/torch_compile.json; one file a run, each its own name)
    docs/results/serve.json          benchmarks/serve.py --out DIR            (DIR/serve.json)
    docs/results/serve_megakernel.json
                                     benchmarks/serve.py --device megakernel --parts a --out DIR  (DIR/serve.json)
    docs/results/serve_qwen3-8b.json benchmarks/serve.py --model qwen3-8b --device gpu --parts d,a
                                     --batches 1,8,32,64 --long-contexts '' --no-torch --out DIR  (DIR/serve.json)
    docs/results/serve_mixed_qwen3-8b.json
                                     benchmarks/serve.py --model qwen3-8b --device gpu --parts d --no-torch --out DIR
    docs/results/serve_http.json     benchmarks/serve_http.py --out DIR       (DIR/serve_http.json)
    docs/results/serve_host.json     benchmarks/serve_host.py --out DIR       (DIR/serve_host.json)
    docs/results/serve_linears.json  benchmarks/serve_linears.py --out DIR    (DIR/serve_linears.json)
    docs/results/serve_linears_prefill.json
                                     benchmarks/serve_linears.py --rows 256,512 --out DIR  (DIR/serve_linears.json)
    docs/results/prefill.json        benchmarks/prefill.py --out DIR          (DIR/prefill.json)
    docs/results/prefill_steps.json  benchmarks/prefill.py --models qwen3-8b --prompts 1024,4096 --out DIR
    docs/results/random_programs_seed<S>.json
                                     benchmarks/random_programs.py --seed S --out DIR  (DIR/random_programs.json)
    docs/tried*.md                   tables `| idea | measured effect |` of ideas measured and rejected

A missing input gives its section a line saying so; an OPTIONAL one (a benchmark that has not run yet) has no
section. Floors are the roofline of the H200 that the cost model uses (`mdsl.search.cost.H200`): bytes over the
measured 4.25 TB/s copy rate, flops over 750 TFLOP/s. `headlines()` gives the figures the README states; tests/test_docs.py
holds the README to them.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import math
import re
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.kernels import BASELINES, LABELS, MDSL, derive  # noqa: E402
from benchmarks.prefill import tables as prefill_tables  # noqa: E402
from benchmarks.serve import device_of, launch_lines, points_of  # noqa: E402
from mdsl.search.cost import H200  # noqa: E402

DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
OUTPUT = DOCS / "performance.md"
INPUTS = ("kernels", "decode", "decode_tp", "search_times", "compile_times", "gemm", "call_overhead")
#: inputs whose section says so while their benchmark has not run yet
OPTIONAL = ("serve", "serve_megakernel", "serve_qwen3-8b", "serve_mixed_qwen3-8b", "serve_http", "gemm_prefill",
            "decode_moe", "prefill", "prefill_steps", "serve_linears", "serve_linears_prefill", "serve_host")
TRIED_HEADER = ("idea", "measured effect")
MODEL_NAMES = {"llama-3.2-1b": "Llama-3.2-1B", "qwen3-0.6b": "Qwen3-0.6B", "qwen3-8b": "Qwen3-8B",
               "qwen3-30b-a3b": "Qwen3-30B-A3B"}


# ---------------------------------------------------------------------------------------------
# inputs

def load_results(results: Path = RESULTS) -> dict:
    """Input name -> its parsed JSON (None where the file is missing); "random_programs": the runs of
    benchmarks/random_programs.py, one file per seed, in seed order; "torch_compile": the runs of
    benchmarks/torch_compile.py, in date order."""
    out = {}
    for name in INPUTS + OPTIONAL:
        path = results / f"{name}.json"
        out[name] = json.loads(path.read_text()) if path.exists() else None
    for key, pattern in (("random_programs", "random_programs_seed*.json"),
                         ("random_programs_gpu", "random_programs_gpu_seed*.json")):
        runs = [json.loads(p.read_text()) for p in results.glob(pattern)]
        out[key] = sorted(runs, key=lambda r: (r.get("meta") or {}).get("seed", 0))
    runs = [json.loads(p.read_text()) for p in results.glob("torch_compile*.json")]
    out["torch_compile"] = sorted(runs, key=lambda r: (r.get("meta") or {}).get("date", ""))
    return out


def tried_rows(docs: Path = DOCS) -> list:
    """The rows of every `| idea | measured effect |` table in docs/tried*.md, files in name order, an idea
    listed twice kept once (its first row)."""
    rows, seen = [], set()
    for path in sorted(docs.glob("tried*.md")):
        in_table = False
        for line in path.read_text().splitlines():
            cells = _cells(line)
            if cells is None:
                in_table = False
                continue
            if tuple(c.lower() for c in cells) == TRIED_HEADER:
                in_table = True
                continue
            if not in_table or set("".join(cells)) <= set("-: "):
                continue
            if len(cells) != 2:
                raise ValueError(f"{path}: a row of the table `| idea | measured effect |` has {len(cells)} "
                                 f"cells: {line.strip()}")
            if cells[0] not in seen:
                seen.add(cells[0])
                rows.append((cells[0], cells[1], path.name))
    return rows


def _cells(line: str) -> Optional[list]:
    text = line.strip()
    if not (text.startswith("|") and text.endswith("|") and len(text) > 1):
        return None
    return [c.strip() for c in re.split(r"(?<!\\)\|", text[1:-1])]


# ---------------------------------------------------------------------------------------------
# formatting

def roofline_s(nbytes: float, flops: float) -> float:
    """max(bytes / copy rate, flops / tensor-core rate) on the H200."""
    return max(nbytes / H200.dram_bytes_per_s, flops / H200.matmul_flops_per_s)


def _us(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    us = seconds * 1e6
    return f"{us:.3g}" if us < 100 else f"{us:.0f}"


def _times(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}×"


def _span(values: Sequence[float], fmt: Callable[[float], str], unit: str = "") -> str:
    low, high = fmt(min(values)), fmt(max(values))
    return f"{low}{unit}" if low == high else f"{low}–{high}{unit}"


def _percent(x: float) -> str:
    return f"{100 * x:.0f}%"


def run_line(meta: Optional[dict]) -> str:
    """Where a table's numbers come from: date, machine, commit, command (and how they were recorded)."""
    meta = meta or {}
    gpu = meta.get("gpu")
    machine = gpu.get("name") if isinstance(gpu, dict) else None
    if machine and isinstance(gpu, dict) and gpu.get("driver"):
        machine += f" (driver {gpu['driver']})"
    if not machine:
        machine = meta.get("host") or "?"
        if meta.get("cpus"):
            machine += f", {meta['cpus']} cores"
        if meta.get("load"):
            machine += f", load {meta['load'][0]:g}"
    date = (meta.get("date") or "?")[:10]
    commit = meta.get("mdsl_commit") or "?"
    line = f"Run: {date}, {machine}, commit `{str(commit)[:7]}`, `python {meta.get('command', '?')}`."
    if meta.get("source"):
        line += f" Figures copied from {meta['source']}."
    if meta.get("background"):
        line += f" Beside it: {meta['background']}."
    return line


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: int = 1, last_left: bool = False) -> list:
    """A Markdown table; columns from `right` on are right-aligned (but the last one with `last_left`)."""
    align = ["---" if i < right or (last_left and i == len(header) - 1) else "---:" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def _missing(name: str) -> list:
    return [f"No results: `docs/results/{name}.json` is missing.", ""]


# ---------------------------------------------------------------------------------------------
# sections

def kernel_cases(data: dict) -> dict:
    """case -> (floor seconds, bound, derive(case)) of the kernel benchmark."""
    out = {}
    for name, case in (data.get("cases") or {}).items():
        floor = case.get("floor") or {}
        seconds = roofline_s(floor.get("bytes", 0), floor.get("flops", 0))
        out[name] = (seconds, floor.get("bound", "-"), derive(case))
    return out


def kernels_section(data: Optional[dict]) -> list:
    lines = ["## Kernels: mdsl against PyTorch", ""]
    if data is None:
        return lines + _missing("kernels")
    lines += [run_line(data.get("meta")), "",
              "µs per call: the median of samples of back-to-back calls between CUDA events, inputs rotated "
              "over sets larger than twice the L2; every contender's output checked against float64 first. "
              "Speed-up: the best PyTorch baseline's time over the faster mdsl backend's; floor: max(bytes / "
              "4.25 TB/s, flops / 750 TFLOP/s).", ""]
    rows = []
    for name, (floor, bound, d) in kernel_cases(data).items():
        contenders = data["cases"][name].get("contenders") or {}

        def cell(n: str) -> str:
            c = contenders.get(n)
            if not c:
                return "-"
            if c.get("status") != "ok":
                return c.get("status", "-")
            text = _us(c.get("median_s"))
            return f"**{text}**" if n in (d["best_baseline"], d["mdsl_best"]) else text

        rows.append([name, f"{_us(floor)} ({bound})", *(cell(n) for n in BASELINES + MDSL),
                     _times(d["speedup"]) if d["speedup"] else "-",
                     _percent(floor / d["mdsl_s"]) if d["mdsl_s"] else "-"])
    header = ["case", "floor µs", *(LABELS[n] for n in BASELINES + MDSL), "speed-up", "% of floor"]
    lines += _table(header, rows) + [""]
    h = headlines({"kernels": data})
    lines += [f"mdsl is faster than the best baseline on {h['kernels_faster']} cases, by {h['kernels_speedups']} "
              f"(geometric mean {h['kernels_geomean']}); the PTX backend's kernels take {h['ptx_over_cuda']} the "
              "CUDA backend's time.", ""]
    if (RESULTS / "kernels.png").exists():
        lines += ["![speed-up over the best PyTorch baseline, per case](results/kernels.png)", ""]
    return lines


def gemm_section(data: Optional[dict]) -> list:
    lines = ["## Plain matmuls a plan leaves unfused", ""]
    if data is None:
        return lines + _missing("gemm")
    dtype = (data.get("meta") or {}).get("dtype", "?")
    lines += [run_line(data.get("meta")), "",
              f"µs per call of [M, K] @ [K, N] in {dtype}, host time included (20 back-to-back calls between CUDA "
              "events, inputs rotated past the L2): mdsl's executable running the product through cuBLAS, the "
              "same program on mdsl's own GEMM kernel, and torch.matmul; floor: bytes / 4.25 TB/s.", ""]
    rows = []
    for r in data.get("rows") or []:
        floor = 2 * (r["m"] * r["k"] + r["k"] * r["n"] + r["m"] * r["n"]) / H200.dram_bytes_per_s
        rows.append([r["m"], r["k"], r["n"], _us(floor), *(f"{r[c]:.1f}" if r.get(c) else "-"
                                                          for c in ("cublas_us", "kernel_us", "torch_us")),
                     _times(r["kernel_us"] / r["cublas_us"]) if r.get("cublas_us") and r.get("kernel_us") else "-"])
    lines += _table(["M", "K", "N", "floor µs", "cuBLAS", "mdsl kernel", "torch", "cuBLAS over kernel"], rows,
                    right=0) + [""]
    return lines


def gemm_prefill_section(data: Optional[dict]) -> list:
    """Prompt-sized products (M in the thousands): the Hopper GEMM (TMA + wgmma) against torch.matmul."""
    lines = ["## Prompt-sized matmuls: the Hopper GEMM against cuBLAS", ""]
    if data is None:
        return lines + _missing("gemm_prefill")
    dtype = (data.get("meta") or {}).get("dtype", "?")
    lines += [run_line(data.get("meta")), "",
              f"µs per call of [M, K] @ [K, N] in {dtype}, host time included (20 back-to-back calls between CUDA "
              "events, inputs rotated past the L2): mdsl's Hopper GEMM (`hopper_gemm`: TMA loads into a ring of "
              "shared memory, wgmma, the tile width it picks; `PTX backend`: the same kernel from the PTX backend's "
              "LLVM IR, where the run has it) and torch.matmul (cuBLAS); floor: flops / 750 TFLOP/s; share: torch's "
              "time over the Hopper GEMM's.", ""]
    rows = []
    for r in data.get("rows") or []:
        if not (r.get("wgmma_us") and r.get("torch_us")):
            continue
        floor = 2 * r["m"] * r["k"] * r["n"] / H200.matmul_flops_per_s
        rows.append([r["m"], r["k"], r["n"], _us(floor), f"{r['torch_us']:.1f}", f"{r['wgmma_us']:.1f}",
                     f"{r['wgmma_ptx_us']:.1f}" if r.get("wgmma_ptx_us") else "-",
                     _percent(r["torch_us"] / r["wgmma_us"]), r.get("wgmma_tile", "-"),
                     _percent(floor * 1e6 / r["wgmma_us"])])
    lines += _table(["M", "K", "N", "floor µs", "torch", "Hopper GEMM", "PTX backend", "share of torch", "tile",
                     "Hopper GEMM % of floor"], rows, right=0) + [""]
    return lines


def serve_host_section(data: dict) -> list:
    """The serving scheduler's host time a decode step, by batch."""
    model = MODEL_NAMES.get(data.get("model"), data.get("model"))
    lines = ["## Serving: the scheduler's host time a step", "", run_line(data.get("meta")), "",
             f"The engine on the CPU device over one layer of {model}'s shapes, its forward replaced by a wait of "
             f"{data.get('forward_ms', '?'):g} ms (a sleep, which lets the engine's thread run, as the GPU device's "
             "wait for its stream does) and every request decoding (`benchmarks/serve_host.py`): the step less "
             "the time the waits took (`forward µs`, measured) is the host's share of a step (the scheduler's "
             "planning, pages and tables, the tokens' ring records and their streaming), which the GPU device adds "
             "to each step's kernels. As on the GPU device, the pool's check runs inside the forward's time (beside "
             "the step's kernels there) and greedy tokens come as an array in chunk order.", ""]
    rows = [[r["batch"], r["context"], r["steps"], f"{r['step_us']:.0f}", f"{r['forward_us']:.0f}",
             f"{r['host_us']:.0f}"] for r in data.get("rows") or []]
    return lines + _table(["batch", "context", "steps", "step µs", "forward µs", "host µs a step"], rows,
                          right=0) + [""]


def serve_linears_section(data: dict, title: str = "Serving: the GPU device's linears") -> list:
    """The GPU serving device's linears on their own, by model, layer op and row count."""
    lines = [f"## {title}", "", run_line(data.get("meta")), "",
             "µs per launch of the GPU serving device's linear (`mdsl.serving.gpu_wgmma`: wgmma, the weights by TMA, "
             "the step's rows as the n of the instruction) for each linear of a layer (q|k|v and gate|up side by side "
             "in one launch, o and down with the residual added) and the LM head, at each of the run's row counts (a "
             "decode step's requests, a prompt chunk's tokens), each launch's output checked against "
             "float64 first; the launches replayed from a CUDA graph, weights rotated past twice the L2 "
             "(`benchmarks/serve_linears.py`); blocks: the launch's grid. Floor: the bf16 weights and the float32 "
             "rows in and out over 4.25 TB/s, or the products over 750 TFLOP/s; torch: `torch.nn.functional.linear` "
             "on the same rows in bf16 (cuBLAS), replayed the same way.", ""]
    rows = [[MODEL_NAMES.get(r["model"], r["model"]), r["op"], r["rows"], r["k"], r["n"], r["blocks"],
             f"{r['floor_us']:.1f}", f"{r['mdsl_us']:.1f}", _percent(r["floor_us"] / r["mdsl_us"]),
             f"{r['torch_us']:.1f}", _times(r["torch_us"] / r["mdsl_us"], 2)]
            for r in data.get("rows") or [] if r.get("mdsl_us") and r.get("torch_us")]
    failed = [r for r in data.get("rows") or [] if r.get("failed")]
    lines += _table(["model", "op", "rows", "k", "n", "blocks", "floor µs", "mdsl µs", "mdsl % of floor", "torch µs",
                     "torch / mdsl"], rows, right=2) + [""]
    if failed:
        named = ", ".join(f"{r['model']} {r['op']} at {r['rows']} rows" for r in failed)
        lines += [f"Failed the float64 check: {named}.", ""]
    return lines


def prefill_section(data: dict, title: str = "Time to first token") -> list:
    """Time to first token: the serving engine reading one prompt, against PyTorch's forward pass of it (a long
    prompt read while requests decode: the serving sections' mixed runs)."""
    rows = data.get("rows") or []
    device = rows[0]["device"] if rows else "gpu"
    repeats = len(rows[0]["runs_s"]) if rows else "?"
    lines = [f"## {title}", "", run_line(data.get("meta")), "",
             f"`LLM(device=\"{device}\")` reading one prompt of random tokens (random bf16 weights at each model's "
             "shapes) in steps of its token budget (`steps`: the prompt's steps), then sampling one greedy token: "
             f"the wall time from `submit` to that token, median of {repeats} after one unmeasured run; PyTorch: "
             "transformers' model over the same checkpoint (bf16, SDPA) running the prompt as one forward pass "
             f"(`logits_to_keep=1`) and reading back the argmax, median of {repeats} after two warm-up passes, in the same "
             "process; `same token`: the two first tokens agree (random weights can tie; `no (2nd)`: the engine's token is PyTorch's runner-up). The floor is the prompt's "
             "arithmetic over 750 TFLOP/s: 2 FLOP per weight of the layers' linears a token, the LM head once, "
             "causal attention's 4 x head_dim FLOP per query head and (query, key) pair (the weights' bytes over "
             "4.25 TB/s where that is more). Below, each layer op's time over the prompt's steps.", ""]
    lines += prefill_tables(data).splitlines() + [""]
    return lines


def prefill_steps_section(data: dict) -> list:
    """The time to first token of a run with prompt-only steps of max_prefill_tokens: its table alone."""
    table = prefill_tables(data).split("\n\n")[0]
    return ["## Time to first token in prompt-only steps", "", run_line(data.get("meta")), "",
            "As above, with prompt-only steps of `max_prefill_tokens` (1,024 tokens).", "", *table.splitlines(), ""]


def _load(meta: dict) -> str:
    """The machine's 1-minute load average as the run started and ended."""
    start, end = (meta.get("load") or [None])[0], (meta.get("load_end") or [None])[0]
    return "-" if start is None else f"{start:g}" + (f" -> {end:g}" if end is not None else "")


def _same_as(same: Optional[dict]) -> str:
    """--same-as: of the programs both runs finished within the cap, how many got the same plan."""
    if not same:
        return "-"
    differ = same.get("differ") or []
    name = Path(same.get("file", "?")).name
    return f"{same['compared'] - len(differ)} of {same['compared']} the same ({name})"


def random_programs_section(runs: list) -> list:
    lines = ["## Programs the search has never seen", ""]
    if not runs:
        return lines + ["No results: no `docs/results/random_programs_seed<S>.json`.", ""]
    lines += ["`benchmarks/random_programs.py`: programs drawn from the operator registry by seed (chains and DAGs of "
              "3-12 operators over LLM-layer shapes), each searched cold under the budget; fused: a plan with fewer "
              "kernels than the program; float check: the plan against float64 on fresh inputs.", ""]
    rows = []
    for run in runs:
        meta, summary = run.get("meta") or {}, run.get("summary") or {}
        rows.append([meta.get("seed", "?"), summary.get("programs", "-"), summary.get("fused", "-"),
                     _percent(summary["fused_fraction"]) if "fused_fraction" in summary else "-",
                     summary.get("float_failures", "-"), summary.get("provisional", "-"), summary.get("over_cap", "-"),
                     f"{summary['budget_s']:g}" if "budget_s" in summary else "-",
                     f"{summary['search_s_median']:.1f}" if "search_s_median" in summary else "-",
                     _load(meta), _same_as(summary.get("same_as"))])
    lines += _table(["seed", "programs", "fused", "fraction", "float failures", "cut by the cap", "over cap > 5 s",
                     "budget s", "median search s", "load (1 min)", "plans as another run's"], rows) + [""]
    lines += [f"Seed {(r.get('meta') or {}).get('seed', '?')}: " + run_line(r.get("meta")) for r in runs] + [""]
    return lines


def random_programs_gpu_section(runs: list) -> list:
    """The random programs timed on the GPU as a user calls them (`random_programs.py --gpu`): per run, the
    summary and the programs mdsl's call loses on."""
    lines = []
    for run in runs:
        meta, summary, rows = run.get("meta") or {}, run.get("summary") or {}, run.get("rows") or []
        speedups = sorted(r["gpu"]["speedup_vs_best"] for r in rows if (r.get("gpu") or {}).get("speedup_vs_best"))
        if not speedups:
            continue
        lines += [f"Seed {meta.get('seed', '?')}, on the GPU: " + run_line(meta), "",
                  "Each program as a user calls it (`k(*torch_tensors)`, host time included, the plan from the plan "
                  "cache; inputs rotated past the L2) against PyTorch eager, eager in a CUDA graph and torch.compile, "
                  "every contender checked against float64 first; the plan replayed in a CUDA graph gives its GPU time "
                  f"alone. Correct on the GPU: {len(speedups)} of {len(rows)}. Speed-up over the best PyTorch baseline: "
                  f"geometric mean {summary.get('gpu_geomean_speedup_vs_best', float('nan')):.2f}x (issue 31's target: "
                  f"1.3x), median {statistics.median(speedups):.2f}x, from {speedups[0]:.2f}x to {speedups[-1]:.2f}x; "
                  f"slower than eager: {summary.get('gpu_slower_than_eager', '-')}."]
        first_calls = [r["gpu"]["first_call_s"] for r in rows if (r.get("gpu") or {}).get("first_call_s") is not None]
        if first_calls:   # compile and, where the call tunes, its tuning (`kernel.tunings`)
            lines[-1] += (f" A program's first call (compiling, tuning): median {statistics.median(first_calls):.1f} "
                          f"s, longest {max(first_calls):.1f} s.")
        lines[-1] += " The programs slower than the best baseline by more than 20%, in µs:"
        lines += [""]
        table = []
        for r in rows:
            g = r.get("gpu") or {}
            if not g.get("speedup_vs_best") or g["speedup_vs_best"] >= 0.8:
                continue
            slowest = max((g.get("mdsl_kernels_us") or {}).items(), key=lambda kv: kv[1], default=("-", 0))
            table.append([r["program"], r["rows"], f"{r['kernels_before']} -> {r['kernels_after']}",
                          f"{r['estimate_after_us']:.1f}", f"{g['mdsl_us']:.1f}",
                          f"{g['mdsl_graph_us']:.1f}" if g.get("mdsl_graph_us") else "-",
                          f"{min(g[k] for k in ('eager_us', 'cuda_graph_us', 'compile_us') if g.get(k)):.1f}",
                          f"{g['speedup_vs_best']:.2f}x", f"{slowest[0]} {slowest[1]:.1f}",
                          g.get("mdsl_choice", "-")])
        lines += _table(["program", "rows", "kernels", "est.", "mdsl call", "mdsl graph", "best PyTorch", "speed-up",
                         "slowest kernel", "tuned choice"], table, last_left=True) + [""]
    return lines


def call_section(data: Optional[dict]) -> list:
    lines = ["## Host time of a kernel call", ""]
    if data is None:
        return lines + _missing("call_overhead")
    lines += [run_line(data.get("meta")), "",
              "µs of host time per call, back to back (median of batches of calls): the public path "
              "`k(*torch_tensors)` (outputs allocated by the call), with `out=` and on input sets in turn (as "
              "the random programs are timed; where the run has it), the public path with the "
              "kernels launched one by one where the launcher launches them as one CUDA graph (`c, graph`), the "
              "unchecked launch of the same executable, the launch floor (as many empty kernels, launched one by "
              "one as the launcher does without a graph), the host overhead (public minus the launch floor; issue "
              "31's target: <= 5 µs) and the kernel's own GPU time; below, the floors a call is built on.", ""]
    rows = []
    for name, c in (data.get("cases") or {}).items():
        overheads = [f"{c[k]:.1f}" if c.get(k) is not None else "-" for k in ("overhead_us", "overhead_out_us")]
        rows.append([name, c.get("launches", "-"), c.get("launcher", "-") + (", graph" if c.get("graph") else ""),
                     *(f"{c[k]['median_us']:.1f}" if c.get(k) and "median_us" in c[k] else "-"
                       for k in ("public", "public_out", "public_sets", "public_kernels", "unchecked",
                                 "launch_floor")),
                     *overheads, f"{c['gpu']['median_us']:.1f}" if c.get("gpu") else "-"])
    lines += _table(["case", "launches", "launcher", "public", "public, out=", "public, sets in turn",
                     "public, one by one", "unchecked", "launch floor", "host overhead", "overhead, out=", "GPU"],
                    rows) + [""]
    labels = {"empty_launch_cuda_bindings": "an empty kernel, cuLaunchKernel through cuda.bindings",
              "empty_launch_mdsl_c": "an empty kernel, through mdsl's C launcher",
              "empty_launch_ctypes": "an empty kernel, cuLaunchKernel through ctypes",
              "torch_empty": "torch.empty of an (8, 4096) f16 tensor",
              "torch_empty_like": "torch.empty_like of the same"}
    floors = data.get("floors") or {}
    lines += _table(["floor", "µs"], [[labels.get(k, k), f"{v['median_us']:.1f}" if "median_us" in v else "-"]
                                      for k, v in floors.items()]) + [""]
    return lines


def torch_compile_section(runs: Sequence[dict]) -> list:
    """The torch.compile table of its runs (each of the workloads and contenders its command names).
    Rows name their run; a speed-up is over the same run's Inductor default mode, so a run without it has
    none."""
    lines = ["## torch.compile: the mdsl backend against Inductor", ""]
    if not runs:
        return lines + ["No results: `benchmarks/torch_compile.py` has not run into docs/results/ yet.", ""]
    meta = runs[0].get("meta") or {}
    for i, r in enumerate(runs, 1):   # (a run's command names its workloads and contenders)
        lines += [f"{run_line(r.get('meta'))} Its rows: run {i}."]
    lines += ["",
              f"transformers' Qwen3ForCausalLM of Qwen3-0.6B's shapes ({meta.get('layers', '?')} layers, random bf16 "
              f"weights), batch 1, torch {meta.get('torch', '?')}: ms per call, host time included (median of "
              f"{meta.get('samples', '?')} samples of {meta.get('batch', '?')} back-to-back calls between CUDA "
              "events), "
              "each contender of a run compiled in the same process on the same inputs; speed-up: the same run's "
              "Inductor default mode's time over the contender's; GPU ms: the kernels' time per call under "
              "torch.profiler (runs with --profile); L2 error: the logits against eager's. mdsl: "
              "`torch.compile(backend=\"mdsl\")`, its calls replaying a CUDA graph (mdsl-no-graphs: without); "
              "reduce-overhead: Inductor with CUDA graphs.", ""]
    rows, whats = [], {}
    for i, r in enumerate(runs, 1):
        for workload, w in (r.get("workloads") or {}).items():
            whats.setdefault(workload, w)
            base = (w.get("contenders", {}).get("inductor") or {}).get("ms")
            for name, c in (w.get("contenders") or {}).items():
                ms = c.get("ms")
                kernels = c.get("kernels")
                gpu = sum(k.get("us_per_call", 0) for k in kernels) / 1e3 if kernels else None
                rows.append([str(i), workload, name, f"{ms:.3f}" if ms else "-",
                             _times(base / ms) if base and ms else "-", f"{gpu:.3f}" if gpu else "-",
                             f"{c['compile_s']:.1f}" if "compile_s" in c else "-",
                             f"{c['l2_rel_err']:.1e}" if c.get("l2_rel_err") is not None else "-",
                             {True: "yes", False: "no"}.get(c.get("argmax_match"), "-"),
                             _regions(c.get("mdsl")),
                             c.get("status", "-") if c.get("status") not in ("error", "cut") else
                             f"{c['status']}: " + str(c.get("error", ""))[:120].replace("|", "\\|")])
    lines += _table(["run", "workload", "contender", "ms", "speed-up", "GPU ms", "compile s", "L2 error", "argmax",
                     "mdsl regions", "verdict"], rows, right=3, last_left=True) + [""]
    lines += [f"{workload}: {w.get('what', '')}; bf16's own L2 error (eager against float32) "
              f"{w['bf16_floor']:.1e}." if w.get("bf16_floor") is not None else f"{workload}: {w.get('what', '')}."
              for workload, w in whats.items()] + [""]
    return lines


def _regions(stats: Optional[dict]) -> str:
    """An mdsl contender's regions: how many ran (distinct plans) and how many operators torch ran."""
    if not stats:
        return "-"
    return (f"{stats.get('regions', 0)} ({stats.get('distinct_regions', 0)} distinct), "
            f"{stats.get('left_to_torch', 0)} ops to torch")


DEVICE_TEXT = {"gpu": "`LLM(device=\"gpu\")` (the host scheduler, one kernel per layer op over the step's rows, steps "
                      "of a repeated shape replayed as CUDA graphs)",
               "megakernel": "`LLM(device=\"megakernel\")` (one resident kernel runs the scheduler and every step; "
                             "requests through a pinned, mapped queue, tokens through a ring)"}


def serve_section(data: Optional[dict], title: str = "Serving many requests on the GPU", plot: str = "serve",
                  mixed: Optional[dict] = None) -> list:
    """A serve.py run's section; `mixed`: a later run of its mixed part alone (part d), whose table replaces the
    run's own."""
    lines = [f"## {title}", ""]
    if data is None:
        return lines + ["No results: `benchmarks/serve.py` has not run into docs/results/ yet.", ""]
    model = MODEL_NAMES.get(data.get("model"), data.get("model"))
    decode, runs = data.get("decode") or [], data.get("runs") or []
    devices = list(dict.fromkeys([*(data.get("devices") or {}), *map(device_of, decode + runs)]))
    measured = list(dict.fromkeys(map(device_of, decode)))
    how = ("; the GPU device's is the wall time of the host's steps, the megakernel's the slope of the times the "
           "host first sees each value of the kernel's step counter (`benchmarks/serve.py` says how)"
           if "megakernel" in measured else "")
    whose = ", the first device's" if len(measured) > 1 else ""
    lines += [run_line(data.get("meta")), "",
              f"{' and '.join(DEVICE_TEXT.get(d, f'`{d}`') for d in devices)} on {model}'s shapes (random bf16 "
              f"weights){', one after the other in one process' if len(devices) > 1 else ''}. Decode step time while "
              "every request of the batch decodes (prompts of `prompt` tokens; the requests read first decode "
              f"further meanwhile: `mean context`{whose})"
              f"{how}. The floor is the weights plus every request's cached keys and values (in the pools' dtype, "
              "the checkpoint's: bf16 here) over 4.25 TB/s; `PyTorch ms`: its kernel-per-op step at the same batch "
              "and context (bf16, static KV caches, a CUDA graph)." +
              (" Launches: " + "; ".join(line[2:] for line in launch_lines(data["devices"])) + "."
               if data.get("devices") else ""), ""]
    rows = []
    for (batch, context), by_device in points_of(decode).items():
        first = next(iter(by_device.values()))
        torch_s = next((d["torch_step_s"] for d in by_device.values() if d.get("torch_step_s")), None)
        row = [batch, context, f"{first['mean_context']:.0f}" if "mean_context" in first else "-",
               f"{first['floor_s'] * 1e3:.3f}"]
        for name in measured:
            d = by_device.get(name)
            row += ([f"{d['step_s'] * 1e3:.2f}", _percent(d["floor_s"] / d["step_s"]), f"{batch / d['step_s']:.0f}"]
                    if d else ["-"] * 3)
        row.append(f"{torch_s * 1e3:.2f}" if torch_s else "-")
        row += [_times(torch_s / by_device[n]["step_s"], 2) if torch_s and n in by_device else "-" for n in measured]
        rows.append(row)
    if rows:
        lines += _table(["batch", "prompt", "mean context", "floor ms",
                         *(f"{n} {c}" for n in measured for c in ("ms", "of floor", "tokens/s")), "PyTorch ms",
                         *(f"PyTorch / {n}" for n in measured)], rows) + [""]
    if (RESULTS / f"{plot}.png").exists():
        lines += [f"![decode step time by batch: each device, the floor, PyTorch](results/{plot}.png)", ""]
    profiled = [d for d in decode if d.get("ops_us") and d["context"] == decode[0]["context"]]
    ops = sorted({op for d in profiled for op in d["ops_us"]},
                 key=lambda op: -max(d["ops_us"].get(op, 0.0) for d in profiled))
    if ops:
        lines += [f"Where the GPU device's step time goes at prompts of {decode[0]['context']}: each layer op's µs "
                  "per step, all layers, timed by events in a twin of the step's CUDA graph "
                  "(`GpuDevice.profile_ops`; `a+b`: two ops fused into one kernel; serve.json has the other "
                  "prompts').", ""]
        lines += _table(["batch", *ops, "sum"], [[d["batch"], *(f"{d['ops_us'].get(op, 0.0):.0f}" for op in ops),
                                               f"{sum(d['ops_us'].values()):.0f}"] for d in profiled]) + [""]
    if runs:
        by_run: dict = {}
        for r in runs:
            by_run.setdefault(r["run"], {})[device_of(r)] = r
        ran = list(dict.fromkeys(map(device_of, runs)))
        columns = ("tokens/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "short")

        def cells(r: Optional[dict]) -> list:
            if r is None:
                return ["-"] * len(columns)
            return [f"{r['output_tokens_per_s']:.0f}",
                    *(f"{r[k] * 1e3:.1f}" for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")),
                    r["short"]]

        lines += ["Whole runs (seeded prompt and output lengths; `offline`: all submitted at once, `online R/s`: "
                  "Poisson arrivals), each device's: output tokens per second, time to first token (TTFT) and per "
                  "output token (TPOT); `short`: requests that streamed fewer tokens than asked.", ""]
        lines += _table(["run", "requests", "output tokens", *(f"{n} {c}" for n in ran for c in columns)],
                        [[name, next(iter(rs.values()))["requests"], next(iter(rs.values()))["output_tokens"],
                          *(c for n in ran for c in cells(rs.get(n)))] for name, rs in by_run.items()],
                        right=1) + [""]
    if mixed is not None:
        lines += ["The mixed run, on its own:", run_line(mixed.get("meta")), ""] + mixed_lines(mixed.get("mixed") or [])
    else:
        lines += mixed_lines(data.get("mixed") or [])
    return lines


def mixed_lines(mixed: list) -> list:
    """The table of benchmarks/serve.py's mixed runs (part d): a long prompt read while requests decode."""
    if not mixed:
        return []
    lines = ["A prompt arriving while requests decode: the decoders' time per output token (TPOT, their median) "
             "over a window before it arrives and while it is read (its submission to its first token: the "
             "steps carry its chunks beside their decode tokens), the worst decoder's, and the prompt's time to "
             "first token.", ""]
    return lines + _table(["device", "decoders", "their prompts", "prompt", "steps", "TPOT before ms",
                           "TPOT while read ms", "worst ms", "ratio", "worst ratio", "prompt's TTFT ms"],
                          [[r["device"], r["batch"], r["decode_prompt"], r["prompt"], r["steps"],
                            f"{r['tpot_before_s'] * 1e3:.2f}", f"{r['tpot_mixed_s'] * 1e3:.2f}",
                            f"{r['tpot_mixed_worst_s'] * 1e3:.2f}", _times(r["ratio"], 2), _times(r["ratio_worst"], 2),
                            f"{r['ttft_s'] * 1e3:.1f}"] for r in mixed]) + [""]


def serve_http_section(data: Optional[dict]) -> list:
    lines = ["## Serving over HTTP", ""]
    if data is None:
        return lines + ["No results: `benchmarks/serve_http.py` has not run into docs/results/ yet.", ""]
    meta, engine = data.get("meta") or {}, data.get("engine") or {}
    lines += [run_line(meta), "",
              f"`mdsl serve` (device `{engine.get('device', '?')}`, max_batch {engine.get('max_batch', '?')}) driven by "
              f"concurrent streaming clients over /v1/completions, and the same requests through `LLM.submit` in one "
              f"process (`offline`): token-id prompts of {data['prompt_len'][0]} to {data['prompt_len'][1]} tokens, "
              f"{data['max_tokens']} greedy tokens each; each client sends its next request when its last one ends.", ""]
    lines += _table(["path", "clients", "requests", "output tokens", "wall s", "tokens/s", "TTFT p50 ms", "TTFT p99 ms",
                     "TPOT p50 ms", "TPOT p99 ms", "errors"],
                    [[r["mode"], r["clients"], r["requests"], r["output_tokens"], f"{r['wall_s']:.1f}",
                      f"{r['output_tokens_per_s']:.0f}",
                      *(f"{r[k] * 1e3:.1f}" for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")),
                      r["errors"]] for r in data.get("runs") or []]) + [""]
    if "http_over_offline" in data:
        lines += [f"HTTP throughput over offline: {data['http_over_offline']:.3f}; requests whose tokens differ "
                  f"between the two paths: {data.get('mismatched', '?')}.", ""]
    return lines


def decode_floor_ms(row: dict) -> float:
    """A decode row's floor in ms: its weight bytes plus the KV bytes a step reads (`kv_bytes`; a row without
    them counts its weights only) over 4.25 TB/s."""
    return (row["weight_bytes"] + row.get("kv_bytes", 0)) / H200.dram_bytes_per_s * 1e3


def decode_contexts(data: dict) -> list:
    """The contexts of a decode JSON's rows, in the run's order (a row without one: the run's single context,
    `meta.context`, or 1024)."""
    meta = data.get("meta") or {}
    default = (meta.get("contexts") or [meta.get("context", 1024)])[0]
    return list(dict.fromkeys([row_context(m, default) for m in data.get("models") or []] or [default]))


def row_context(row: dict, default: int) -> int:
    return row.get("context", default)


def decode_section(data: Optional[dict], moe: Optional[dict] = None) -> list:
    """The decode table; a mixture-of-experts run (`moe`, decode_moe.json: its own run, asked for by name) adds its
    rows below the others and a line saying what its weights are."""
    lines = ["## Decode: the megakernel against PyTorch", ""]
    if data is None:
        return lines + _missing("decode")
    meta = data.get("meta") or {}
    models = data.get("models") or []
    contexts = decode_contexts(data)
    many = len(contexts) > 1
    floor = ("the weight bytes plus the KV cache bytes a step reads (keys and values of the context's positions "
             "in every layer), over 4.25 TB/s" if any("kv_bytes" in m for m in models) else
             "the weight bytes over 4.25 TB/s")
    lines += [run_line(meta), "",
              f"Random bf16 weights, batch 1, context{'s' if many else ''} {', '.join(map(str, contexts))}: ms per "
              f"token over {meta.get('steps', '?')} decode steps in one launch (median of {meta.get('repeats', '?')}), "
              f"against PyTorch's kernel-per-op step captured in a CUDA graph. Floor: {floor}.", ""]
    rows = []
    for m in models + ((moe or {}).get("models") or []):
        first = [MODEL_NAMES.get(m["model"], m["model"])] + ([row_context(m, contexts[0])] if many else [])
        if "error" in m:
            rows.append([*first, f"failed: {m['error']}", *["-"] * 6])
            continue
        floor_ms = decode_floor_ms(m)
        torch_ms = m.get("torch_graph_ms")
        rows.append([*first, f"{m['weight_bytes'] / 1e9:.2f} GB",
                     f"{floor_ms:.3f} ms", f"{m['megakernel_ms']:.3f} ms", _percent(floor_ms / m["megakernel_ms"]),
                     f"{torch_ms:.3f} ms" if torch_ms else "-", _percent(floor_ms / torch_ms) if torch_ms else "-",
                     _times(torch_ms / m["megakernel_ms"]) if torch_ms else "-"])
    lines += _table(["model", *(["context"] if many else []), "weights", "floor", "megakernel", "% of floor",
                     "PyTorch + CUDA graph", "% of floor", "speed-up"], rows) + [""]
    if moe:
        names = ", ".join(MODEL_NAMES.get(m["model"], m["model"]) for m in moe.get("models") or [])
        lines += [f"{names}: a mixture of 128 experts, 8 a token; its weights are the bytes a step reads (each layer's "
                  f"attention, router and picked experts), as the megakernel reads only those and PyTorch's step "
                  f"(transformers' grouped_mm experts) too; its own run:", "", run_line(moe.get("meta") or {}), ""]
    trace = RESULTS / f"megakernel_trace_{meta.get('trace_model')}.json.gz"
    if trace.exists():
        lines += [f"The run's profile of {MODEL_NAMES.get(meta['trace_model'], meta['trace_model'])} (every SM's "
                  f"tasks over two steps{f' at context {contexts[0]}' if many else ''}; open it at ui.perfetto.dev): "
                  f"`docs/results/{trace.name}`.", ""]
    if (RESULTS / "decode.png").exists():
        lines += ["![ms per token against the floor](results/decode.png)", ""]
    return lines


def tp_rows(data: dict) -> list:
    """(model, the best N-GPU run against the best one-GPU run) of a decode JSON written under --tp, a pair
    per row (model and context)."""
    out = []
    for m in data.get("models") or []:
        runs = {v: r for v, r in (m.get("tensor_parallel") or {}).items() if r.get("megakernel_ms")}
        if not runs:
            continue
        best = min(runs, key=lambda v: runs[v]["megakernel_ms"])
        out.append((m, runs[best]))
    return out


def tp_floor_ms(run: dict) -> Optional[float]:
    """A tensor-parallel run's floor per rank in ms: its shard's weight bytes plus the KV bytes a step reads
    (benchmarks/decode.py writes `rank_weight_bytes` and `rank_kv_bytes`; results copied by hand,
    `weight_bytes`); None without its weight bytes."""
    weights = run.get("rank_weight_bytes") or run.get("weight_bytes")
    if not weights:
        return None
    return (weights + (run.get("rank_kv_bytes") or 0)) / H200.dram_bytes_per_s * 1e3


def tp_section(data: Optional[dict]) -> list:
    lines = ["## Decode over two GPUs (tensor parallelism)", ""]
    if data is None:
        return lines + _missing("decode_tp")
    contexts = decode_contexts(data)
    many = len(contexts) > 1
    pairs = tp_rows(data)
    what = ("weight bytes plus its KV bytes a step reads" if any(run.get("rank_kv_bytes") for _, run in pairs)
            else "weight bytes")
    lines += [run_line(data.get("meta")), "",
              "One process per GPU, each with its shard of the heads, MLP columns and vocabulary; the residual "
              f"stream's partial sums relayed between the GPUs inside the kernel. Floor per rank: the shard's {what} "
              "over 4.25 TB/s.", ""]
    rows = []
    for m, run in pairs:
        floor_ms = tp_floor_ms(run)
        weights = run.get("rank_weight_bytes") or run.get("weight_bytes")
        rows.append([MODEL_NAMES.get(m["model"], m["model"]), *([row_context(m, contexts[0])] if many else []),
                     f"{weights / 1e9:.2f} GB" if weights else "-",
                     f"{floor_ms:.3f} ms" if floor_ms else "-", f"{run['one_gpu_ms']:.3f} ms",
                     f"{run['megakernel_ms']:.3f} ms", _percent(floor_ms / run["megakernel_ms"]) if floor_ms else "-",
                     _times(run["megakernel_ms"] / run["one_gpu_ms"], 3)])
    lines += _table(["model", *(["context"] if many else []), "weights per rank", "floor per rank", "1 GPU", "2 GPUs",
                     "% of floor", "2 GPUs / 1 GPU"], rows) + [""]
    if (RESULTS / "tp_timeline_qwen3-8b.png").exists():
        lines += ["![one layer of Qwen3-8B on both ranks: every SM's tasks, coloured by kind]"
                  "(results/tp_timeline_qwen3-8b.png)", ""]
    return lines


def search_section(data: Optional[dict]) -> list:
    lines = ["## Search times", ""]
    if data is None:
        return lines + _missing("search_times")
    meta = data.get("meta") or {}
    lines += [run_line(meta), "",
              "Each case searched from an empty plan cache; \"cache hit\" is the same call again. Candidates: "
              "generated (guided and enumerated); pruned: partial candidates the abstract-expression, shape and "
              "shared-memory checks removed; verified: candidates that passed the verifier.", ""]
    rows = [[r["case"], f"{r['seconds']:.1f}", f"{r['cache_hit_seconds']:.3f}", r["candidates"], r["pruned"],
             r["verified"], f"{r['estimate_us']:.2f}", f"{r['floor_us']:.2f}", r["plan"]] for r in data["rows"]]
    lines += _table(["case", "search s", "cache hit s", "candidates", "pruned", "verified", "est. µs", "floor µs",
                     "plan"], rows, last_left=True) + [""]
    fused = sum(not r.get("original", False) for r in data["rows"])
    lines += [f"{fused} of {len(data['rows'])} searches return a fused plan within the "
              f"{meta.get('budget_s', 120):g} s budget.", ""]
    return lines


def compile_section(data: Optional[dict]) -> list:
    lines = ["## Compile times: PTX generation against NVRTC", ""]
    if data is None:
        return lines + _missing("compile_times")
    lines += [run_line(data.get("meta")), "",
              "Per kernel of each case's plan, compiled from scratch (no disk cache), the two backends taking "
              "turns, median of the repetitions: the CUDA backend's C++ through NVRTC to a cubin, the PTX "
              "backend's LLVM IR through llvmlite to PTX.", ""]
    rows = [[r["case"], r["plan"], r["kernels"], f"{1e3 * r['nvrtc_s'] / r['kernels']:.1f}",
             f"{1e3 * r['ptx_s'] / r['kernels']:.1f}", _times(r["nvrtc_s"] / r["ptx_s"], 1)] for r in data["rows"]]
    lines += _table(["case", "plan", "kernels", "NVRTC ms/kernel", "PTX ms/kernel", "speed-up"], rows, right=2)
    h = headlines({"compile_times": data})
    lines += ["", f"Over all cases PTX generation is {h['compile_speedup']} faster than NVRTC per kernel.", ""]
    return lines


def tried_section(rows: list, docs: Path = DOCS) -> list:
    """An index of the ideas measured and rejected: each docs/tried*.md with its title and its count of rows
    (the tables themselves stay there: copied here they would outgrow the page)."""
    lines = ["## Tried and rejected", ""]
    if not rows:
        return lines + ["No `docs/tried*.md` table found.", ""]
    counts = {}
    for _, _, f in rows:
        counts[f] = counts.get(f, 0) + 1
    lines += [f"{len(rows)} ideas were built, measured and removed, each with its effect (before -> after, in one "
              "run, on the H200 unless the row names another GPU):", ""]
    for f in sorted(counts):
        title = next((l[2:].strip() for l in (docs / f).read_text().splitlines() if l.startswith("# ")), f)
        lines.append(f"- [`docs/{f}`]({f}): {title}, {counts[f]} ideas")
    return lines + [""]


# ---------------------------------------------------------------------------------------------
# the README's figures

def headlines(results: dict) -> dict:
    """The figures the README states, formatted as it states them, from whichever results are given."""
    h = {}
    kernels = results.get("kernels")
    if kernels:
        derived = [d for _, _, d in kernel_cases(kernels).values()]
        speedups = [d["speedup"] for d in derived if d["speedup"]]
        h["kernels_faster"] = f"{sum(s >= 1.0 for s in speedups)} of {len(derived)}"
        h["kernels_geomean"] = _times(math.exp(sum(map(math.log, speedups)) / len(speedups)))
        h["kernels_speedups"] = _span(speedups, lambda x: f"{x:.2f}", "×")
        ratios = [d["ptx_over_cuda"] for d in derived if d["ptx_over_cuda"]]
        h["ptx_over_cuda"] = _span(ratios, lambda x: f"{x:.2f}", "×")
    decode = results.get("decode")
    if decode:
        # the run's first context gives the figures by model; every row also its own, keyed by its context
        first = decode_contexts(decode)[0]
        rows = [m for m in decode.get("models") or [] if "error" not in m]
        models = [m for m in rows if row_context(m, first) == first]
        if models:
            h["decode_floor"] = _span([decode_floor_ms(m) / m["megakernel_ms"] for m in models],
                                      lambda x: f"{100 * x:.0f}", "%")
        speedups = [m["torch_graph_ms"] / m["megakernel_ms"] for m in models if m.get("torch_graph_ms")]
        if speedups:
            h["decode_speedups"] = _span(speedups, lambda x: f"{x:.2f}", "×")
        for m in models:
            h[f"decode_ms_{m['model']}"] = f"{m['megakernel_ms']:.2f} ms"
        for m in rows:
            context = row_context(m, first)
            h[f"decode_ms_{m['model']}_{context}"] = f"{m['megakernel_ms']:.2f} ms"
            h[f"decode_floor_{m['model']}_{context}"] = _percent(decode_floor_ms(m) / m["megakernel_ms"])
    tp = results.get("decode_tp")
    if tp:
        first = decode_contexts(tp)[0]
        for m, run in tp_rows(tp):
            if row_context(m, first) == first:
                h[f"tp_ratio_{m['model']}"] = _times(run["megakernel_ms"] / run["one_gpu_ms"], 3)
    compile_times = results.get("compile_times")
    if compile_times:
        rows = compile_times["rows"]
        nvrtc = sum(r["nvrtc_s"] for r in rows) / sum(r["kernels"] for r in rows)
        ptx = sum(r["ptx_s"] for r in rows) / sum(r["kernels"] for r in rows)
        h["compile_speedup"] = _times(nvrtc / ptx, 1)
    search = results.get("search_times")
    if search:
        h["search_longest"] = f"{max(r['seconds'] for r in search['rows']):.1f} s"
    serve = results.get("serve")
    for device, prefix in (("gpu", "serve"), ("megakernel", "serve_megakernel")):
        steps = sorted((d for d in (serve or {}).get("decode") or () if device_of(d) == device),
                       key=lambda d: d["batch"])
        if steps:   # batch 1 and the largest batch, at the first context measured
            h[f"{prefix}_step_one"] = f"{steps[0]['step_s'] * 1e3:.1f} ms"
            h[f"{prefix}_floor_one"] = _percent(steps[0]["floor_s"] / steps[0]["step_s"])
            h[f"{prefix}_step_most"] = f"{steps[-1]['step_s'] * 1e3:.1f} ms"
            h[f"{prefix}_floor_most"] = _percent(steps[-1]["floor_s"] / steps[-1]["step_s"])
            if steps[-1].get("schedule_us"):   # the step boundary's body in the largest batch's task profile
                h[f"{prefix}_schedule_most"] = f"{steps[-1]['schedule_us'] / 1e3:.2f} ms"
        offline = [r for r in (serve or {}).get("runs") or ()
                   if r.get("device") == device and r.get("run") == "offline"]
        if offline:
            h[f"{prefix}_offline_tokens"] = f"{offline[0]['output_tokens_per_s']:.0f}"
    if "serve_step_one" in h and "serve_megakernel_step_one" in h:   # the megakernel over the GPU device, batch 1
        one = [min((d for d in serve["decode"] if device_of(d) == device), key=lambda d: d["batch"])["step_s"]
               for device in ("gpu", "megakernel")]
        h["serve_megakernel_over_gpu_one"] = _times(one[0] / one[1], 2)
    steps = sorted(((results.get("serve_qwen3-8b") or {}).get("decode") or ()), key=lambda d: d["batch"])
    if steps:   # Qwen3-8B on the GPU device: batch 1 and the largest batch at the first context measured
        steps = [d for d in steps if d["context"] == steps[0]["context"]]
        h["serve_8b_step_one"] = f"{steps[0]['step_s'] * 1e3:.2f} ms"
        h["serve_8b_floor_one"] = _percent(steps[0]["floor_s"] / steps[0]["step_s"])
        h["serve_8b_step_most"] = f"{steps[-1]['step_s'] * 1e3:.2f} ms"
        h["serve_8b_floor_most"] = _percent(steps[-1]["floor_s"] / steps[-1]["step_s"])
    alone = sorted(((results.get("serve_megakernel") or {}).get("decode") or ()), key=lambda d: d["batch"])
    if alone:   # the megakernel device's own run: batch 1 and the largest batch at the first context measured
        alone = [d for d in alone if d["context"] == alone[0]["context"]]
        h["serve_megakernel_alone_step_one"] = f"{alone[0]['step_s'] * 1e3:.2f} ms"
        h["serve_megakernel_alone_step_most"] = f"{alone[-1]['step_s'] * 1e3:.2f} ms"
        h["serve_megakernel_alone_floor_most"] = _percent(alone[-1]["floor_s"] / alone[-1]["step_s"])
    served = results.get("serve_http")
    if served and "http_over_offline" in served:
        h["serve_http_ratio"] = f"{served['http_over_offline']:.2f}×"
        h["serve_http_tokens"] = f"{served['runs'][0]['output_tokens_per_s']:.0f}"
    prefill = [r for r in ((results.get("gemm_prefill") or {}).get("rows") or [])
               if r.get("wgmma_us") and r.get("torch_us")]
    if prefill:
        shares = [r["torch_us"] / r["wgmma_us"] for r in prefill]
        h["hopper_gemm_share"] = f"{_percent(min(shares))[:-1]}–{_percent(max(shares))}"
    ttft = [(name, r) for name in ("prefill", "prefill_steps") for r in (results.get(name) or {}).get("rows") or []]
    for name, r in ttft:   # time to first token, by run, model and prompt length
        key = f"{name}_{r['model']}_{r['prompt']}"
        h[f"{key}_ms"] = f"{r['ttft_s'] * 1e3:.1f} ms"
        h[f"{key}_floor"] = _percent(r["floor_s"] / r["ttft_s"])
        if r.get("torch_s"):
            h[f"{key}_torch_ms"] = f"{r['torch_s'] * 1e3:.1f} ms"
            h[f"{key}_over_torch"] = _times(r["ttft_s"] / r["torch_s"])
    mixed = [r for name in ("serve_qwen3-8b", "serve_mixed_qwen3-8b") for r in (results.get(name) or {}).get("mixed") or []]
    for r in mixed:   # a long prompt read while requests decode: the mixed run's own file, where it has one
        h["mixed_tpot_before"] = f"{r['tpot_before_s'] * 1e3:.1f} ms"
        h["mixed_tpot_while"] = f"{r['tpot_mixed_s'] * 1e3:.1f} ms"
        h["mixed_ratio"] = _times(r["ratio_worst"], 2)
        if (r.get("ops_us") or {}).get("attention"):
            h["mixed_attention"] = f"{r['ops_us']['attention'] / 1e3:.1f} ms"
    chunk = [r for r in (results.get("serve_linears_prefill") or {}).get("rows") or []
             if r.get("model") == "qwen3-8b" and r.get("rows") == 256 and r.get("torch_us") and r.get("mdsl_us")]
    if chunk:   # Qwen3-8B's linears at a mixed step's 256 rows: cuBLAS's time over mdsl's
        h["chunk_linears_over_torch"] = _span([r["torch_us"] / r["mdsl_us"] for r in chunk], lambda x: f"{x:.2f}", "×")
    for run in results.get("torch_compile") or []:   # mdsl over Inductor's default in one run, each one's ms: the latest
        for workload, w in (run.get("workloads") or {}).items():
            ms = {name: c.get("ms") for name, c in (w.get("contenders") or {}).items()}
            if ms.get("inductor") and ms.get("mdsl"):
                h[f"torch_compile_{workload}"] = _times(ms["inductor"] / ms["mdsl"])
            for name, t in ms.items():
                if t:
                    h[f"torch_compile_{workload}_ms_{name}"] = f"{t:.2f} ms"
    for run in results.get("random_programs_gpu") or []:   # the last seed's figures
        summary = run.get("summary") or {}
        if "gpu_geomean_speedup_vs_best" in summary:
            h["random_gpu_geomean"] = _times(summary["gpu_geomean_speedup_vs_best"])
            h["random_gpu_fused"] = f"{summary['fused']} of {summary['programs']}"
            speedups = [r["gpu"]["speedup_vs_best"] for r in run.get("rows") or []
                        if (r.get("gpu") or {}).get("speedup_vs_best")]
            if speedups:
                h["random_gpu_speedups"] = _span(speedups, lambda x: f"{x:.2f}", "×")
    return h


# ---------------------------------------------------------------------------------------------

def render(results: Optional[dict] = None, docs: Path = DOCS) -> str:
    """The text of docs/performance.md."""
    results = load_results() if results is None else results
    lines = ["# Performance", "",
             "<!-- generated by benchmarks/report.py from docs/results/*.json and docs/tried*.md: edit those, "
             "then run it -->", "",
             "Today's measurements, one table per benchmark; above each, the run it comes from (date, machine, "
             "commit, command). To refresh a table, run that command with its JSON output into `docs/results/` "
             "(`benchmarks/report.py` lists which file each benchmark writes), then "
             "`python benchmarks/report.py`. How the benchmarks measure: `benchmarks/README.md`.", ""]
    lines += kernels_section(results.get("kernels"))
    lines += decode_section(results.get("decode"), results.get("decode_moe"))
    lines += tp_section(results.get("decode_tp"))
    lines += search_section(results.get("search_times"))
    lines += compile_section(results.get("compile_times"))
    lines += random_programs_section(results.get("random_programs") or [])
    lines += random_programs_gpu_section(results.get("random_programs_gpu") or [])
    lines += gemm_section(results.get("gemm"))
    lines += gemm_prefill_section(results.get("gemm_prefill"))
    lines += call_section(results.get("call_overhead"))
    if results.get("torch_compile"):
        lines += torch_compile_section(results["torch_compile"])
    sections = (("serve", serve_section),
                ("serve_megakernel", functools.partial(serve_section, plot="serve_megakernel",
                                                       title="Serving: the megakernel device's decode steps, its own run")),
                ("serve_qwen3-8b", functools.partial(serve_section, plot="serve_qwen3-8b",
                                                     title="Serving Qwen3-8B: the GPU device's decode steps",
                                                     mixed=results.get("serve_mixed_qwen3-8b"))),
                ("serve_linears", serve_linears_section),
                ("serve_linears_prefill", functools.partial(
                    serve_linears_section, title="Serving: the GPU device's linears at a prompt chunk's rows")),
                ("serve_http", serve_http_section),
                ("serve_host", serve_host_section),
                ("prefill", prefill_section),
                ("prefill_steps", prefill_steps_section))
    for name, section in sections:
        if results.get(name) is not None:   # (an optional benchmark that has not run has no section)
            lines += section(results[name])
    lines += tried_section(tried_rows(docs), docs)
    return "\n".join(lines).rstrip("\n") + "\n"


def plot_decode(data: dict, path: Path) -> Optional[str]:
    """Bars of ms per token (floor, megakernel, PyTorch + CUDA graph) per model; None, or why not drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    models = [m for m in data.get("models") or [] if "error" not in m]
    contexts = decode_contexts(data)
    series = {"floor": [decode_floor_ms(m) for m in models],
              "megakernel": [m["megakernel_ms"] for m in models],
              "PyTorch + CUDA graph": [m.get("torch_graph_ms") or math.nan for m in models]}
    labels = [MODEL_NAMES.get(m["model"], m["model"]) for m in models]
    if len(contexts) > 1:   # a bar group per model and context
        labels = [f"{label}\n{row_context(m, contexts[0])}" for label, m in zip(labels, models)]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    _grouped_bars(ax, series, len(models), fontsize=7)
    ax.set_xticks(range(len(models)), labels)
    ax.set_ylabel("ms per token")
    gpu = ((data.get("meta") or {}).get("gpu") or {}).get("name", "")
    ax.set_title(f"decode, batch 1, bf16{', ' + gpu if gpu else ''}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _grouped_bars(ax, series: dict, groups: int, fontsize: int) -> None:
    """One bar per series in each of `groups` groups, side by side, each labelled with its value."""
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(groups)]
        ax.bar_label(ax.bar(xs, values, width, label=label), fmt="%.2f", fontsize=fontsize)


def plot_serve(data: dict, path: Path) -> Optional[str]:
    """Bars of decode step ms (floor, each device, PyTorch + CUDA graph) per batch and prompt length; None, or why
    not drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    points = points_of(data.get("decode") or [])
    if not points:
        return "serve.json has no decode steps: no plot"
    devices = list(dict.fromkeys(name for rows in points.values() for name in rows))

    def first(rows: dict, key: str) -> float:
        return next((d[key] * 1e3 for d in rows.values() if d.get(key)), math.nan)

    series = {"floor": [first(rows, "floor_s") for rows in points.values()],
              **{f"{name} device": [rows[name]["step_s"] * 1e3 if name in rows else math.nan
                                    for rows in points.values()] for name in devices},
              "PyTorch + CUDA graph": [first(rows, "torch_step_s") for rows in points.values()]}
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    _grouped_bars(ax, series, len(points), fontsize=6)
    ax.set_xticks(range(len(points)), [f"batch {b}\nprompt {c}" for b, c in points], fontsize=7)
    ax.set_ylabel("ms per decode step")
    model = MODEL_NAMES.get(data.get("model"), data.get("model"))
    gpu = ((data.get("meta") or {}).get("gpu") or {}).get("name", "")
    ax.set_title(f"serving decode steps, {model}, bf16{', ' + gpu if gpu else ''}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/performance.md instead of writing it")
    ap.add_argument("--plot", action="store_true",
                    help="also draw docs/results/decode.png and serve.png (needs matplotlib)")
    args = ap.parse_args(argv)
    results = load_results()
    for name, plot in (("decode", plot_decode), ("serve", plot_serve)) if args.plot else ():
        why = plot(results[name], RESULTS / f"{name}.png") if results[name] is not None else None
        if why:
            print(why, file=sys.stderr)
    text = render(results)
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is not what benchmarks/report.py writes: run it", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

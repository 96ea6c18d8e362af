"""torch.compile on a transformers Qwen3-0.6B-shaped model (random bf16 weights): eager against Inductor's
modes and the "mdsl" backend, for one decode step and one prefill.

    python benchmarks/torch_compile.py [--layers 28] [--contenders eager,inductor,...] [--budget 120]
                                       [--work 20000] [--time-limit 480] [--out DIR]
    python benchmarks/torch_compile.py --plans-only [--layers 2]   # no GPU: search the regions' plans

The model is transformers' `Qwen3ForCausalLM` built from a config written here (Qwen3-0.6B's shapes: hidden
1024, intermediate 3072, 16 query and 8 key/value heads of 128, vocabulary 151936, tied embeddings, RMS
norm eps 1e-6, rope theta 1e6; `--layers` of its 28 layers), weights drawn by transformers' initializer
(seed 0) on the GPU and rounded to bf16, SDPA attention.

Workloads, batch 1:
* decode: one new token against a `StaticCache` holding --context (512) tokens of a random prompt, filled
  by an eager prefill: `model(input_ids=token, past_key_values=cache, use_cache=True).logits`. The static
  cache keeps its position in a tensor of its own (`cumulative_length`) that each step advances, and it
  attends over its whole length (masked past the position), as transformers' static cache does; its length
  is --context + --batch, and the position is set back to --context (outside the timed part) before each
  warm-up call, each checked call and each timed batch of --batch calls, so that every timed step sees
  the same context and no step writes past the cache.
* prefill: the --prefill (512) tokens of a random prompt, no cache, the logits of the last position (what
  `generate` computes at a prefill): `model(input_ids=prompt, use_cache=False, logits_to_keep=1).logits`.

Contenders, in one process on the same inputs, each compiled with `fullgraph=True` (where dynamo breaks
the graph, again without it, which the notes say): `eager`; `inductor` (torch.compile's default);
`max-autotune` (mode "max-autotune-no-cudagraphs"); `reduce-overhead` (Inductor with CUDA graphs);
`mdsl` (backend `mdsl.torch.compiler(SearchConfig(budget_s=--budget, work=--work))`, whose inference graphs
replay CUDA graphs); `mdsl-no-graphs` (the same with `cuda_graphs=False`). dynamo is reset before each.

Method. Compile and warm-up: the opening call (compile time: tracing, mdsl's region searches and kernel
compiles, Inductor's compile and autotuning) and the next two (a CUDA graph's recording), wall clock.
Correctness: the fourth call's logits against eager's (bf16, same model and inputs): the largest absolute
difference, that over the largest eager logit, the L2 norm of the difference over eager's, and whether
the argmax agrees; the scale of bf16's own error is eager bf16 against the same model run in float32 (the
bf16 weights upcast); a contender passes where its L2 error is within max(2e-2, twice that). Timing:
--samples batches of --batch back-to-back calls between two CUDA events, as a user calls the model (host
time included), after the warm-up; the median per call is reported, with the 10th and 90th percentiles.
A contender that fails is recorded with its error, its warnings and what the mdsl backend made of the
model until then (an Inductor failure it fell back from), and the others still run; one that would start after
--time-limit seconds is recorded as skipped, and one still running when the run is killed as cut (30 s past
the limit it prints every thread's stack). Order: decode and prefill of eager, inductor and mdsl first,
then max-autotune, reduce-overhead and mdsl-no-graphs.

mdsl's plans come from the plan cache (`MDSL_CACHE_DIR`; unset: a fresh directory) or, where a region's
plan is missing, from a search on the machine (16 CPU cores on the H200: the search needs z3; without it
a region whose plan is missing is left to Inductor at once, and the notes say how many operators that
leaves). `--plans-only` fills the cache
without a GPU: it compiles both workloads with the mdsl backend on CPU tensors (the regions on the
reference interpreter), searches each distinct region's plan with the same configuration and compiles
it into the cubin cache (NVRTC, no GPU needed); regions alike share a plan, so two layers give every
distinct region of 28. Carry that cache to the GPU machine with the same --budget, --work, --context
and --batch (they shape the regions' programs and key their plans).

Writes torch_compile.json (with `provenance.py`'s meta) and torch_compile.md under --out (default $OUT,
else ./bench_out), after every contender; prints the table.
"""
from __future__ import annotations

import argparse
import copy
import faulthandler
import gc
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # run as a script from anywhere, with or without mdsl installed
    sys.path.insert(0, str(ROOT))

from benchmarks.provenance import provenance  # noqa: E402 - needs ROOT on sys.path

SCHEMA = 1
CONTENDERS = ("eager", "inductor", "max-autotune", "reduce-overhead", "mdsl", "mdsl-no-graphs")
WORKLOADS = ("decode", "prefill")
#: the contenders that run first on every workload (after eager): a run cut short keeps the comparison
PRIORITY = ("inductor", "mdsl")
WARMUP_CALLS = 3           # the compile, then a CUDA graph's warm-up and recording
TOLERANCE = 2e-2           # L2 relative error of the logits against eager's, at least (bf16)
#: Qwen3-0.6B's shapes (transformers' Qwen3Config fields)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 1_000_000.0})


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28, help="decoder layers (Qwen3-0.6B has 28)")
    p.add_argument("--context", type=int, default=512, help="tokens in the KV cache of the decode step")
    p.add_argument("--prefill", type=int, default=512, help="tokens of the prefill")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated, of " + ", ".join(CONTENDERS))
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    p.add_argument("--batch", type=int, default=8, help="back-to-back calls per timed sample")
    p.add_argument("--samples", type=int, default=30, help="timed samples per contender")
    p.add_argument("--budget", type=float, default=120.0, help="seconds a region's plan search may take at most")
    p.add_argument("--work", type=int, default=20_000, help="a region search's work budget (SearchConfig.work)")
    p.add_argument("--time-limit", type=float, default=480.0,
                   help="seconds from the start after which no contender starts (it is recorded as skipped)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timing, N calls of each contender under torch.profiler: GPU time per kernel "
                        "(its 25 costliest, µs per call) into the results")
    p.add_argument("--plans-only", action="store_true",
                   help="no GPU: search the mdsl regions' plans into the plan cache, time nothing")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"),
                   help="output directory (default: $OUT when set, else ./bench_out)")
    args = p.parse_args(argv)
    args.contenders = _names(args.contenders, CONTENDERS, "contender")
    args.workloads = _names(args.workloads, WORKLOADS, "workload")
    if min(args.batch, args.samples, args.layers, args.context, args.prefill) < 1:
        p.error("--batch, --samples, --layers, --context and --prefill must be at least 1")
    return args


def _names(text: str, known: Sequence[str], what: str) -> list:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what}(s) {unknown}; known: {', '.join(known)}")
    return names


def schedule(workloads: Sequence[str], contenders: Sequence[str]) -> list:
    """(workload, contender) in the order they run: eager first for each workload (its logits are the
    reference), then the PRIORITY contenders of every workload, then the others."""
    first = [(w, c) for w in workloads for c in ("eager", *PRIORITY) if c in contenders or c == "eager"]
    rest = [(w, c) for c in contenders for w in workloads if (w, c) not in first]
    return first + rest


def search_config(args):
    from mdsl.search.config import SearchConfig

    return SearchConfig(budget_s=args.budget, work=args.work)


# ---------------------------------------------------------------------------------------------
# the model and the workloads

def build_model(torch, transformers, layers: int, device: str):
    """Qwen3ForCausalLM of Qwen3-0.6B's shapes and `layers` layers, transformers' random weights (seed 0)
    made on `device` and rounded to bf16, in eval mode."""
    config = transformers.Qwen3Config(**{**QWEN3_06B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config)
    return model.to(torch.bfloat16).eval()


class Decode:
    """One decode step against a static cache of `context` tokens (see the module's docstring)."""

    name = "decode"

    def __init__(self, torch, transformers, model, context: int, calls: int, seed: int = 1):
        device = next(model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        vocab = model.config.vocab_size
        self.prompt = torch.randint(0, vocab, (1, context), generator=generator, device=device)
        self.token = torch.randint(0, vocab, (1, 1), generator=generator, device=device)
        self.context, self.length = context, context + calls
        self.transformers = transformers
        self.cache = self.filled_cache(torch, model)

    def filled_cache(self, torch, model):
        """A static cache of the model's dtype holding the prompt, filled by an eager prefill."""
        cache = self.transformers.StaticCache(config=model.config, max_cache_len=self.length)
        with torch.no_grad():
            model(input_ids=self.prompt, past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                raise RuntimeError("this transformers' StaticCache keeps no cumulative_length tensor: the decode "
                                   "step cannot be set back to its position (transformers 5.x has one)")
        return cache

    def reset(self, cache=None) -> None:
        for layer in (self.cache if cache is None else cache).layers:
            layer.cumulative_length.fill_(self.context)

    def call(self, fn, cache=None):
        return fn(input_ids=self.token, past_key_values=self.cache if cache is None else cache, use_cache=True).logits

    def reference_float32(self, torch, model32):
        cache = self.filled_cache(torch, model32)
        self.reset(cache)
        with torch.no_grad():
            return self.call(model32, cache)


class Prefill:
    """A prompt of `tokens` tokens, no cache, the last position's logits."""

    name = "prefill"

    def __init__(self, torch, model, tokens: int, seed: int = 2):
        device = next(model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        self.prompt = torch.randint(0, model.config.vocab_size, (1, tokens), generator=generator, device=device)

    def reset(self) -> None:
        pass

    def call(self, fn):
        return fn(input_ids=self.prompt, use_cache=False, logits_to_keep=1).logits

    def reference_float32(self, torch, model32):
        with torch.no_grad():
            return self.call(model32)


# ---------------------------------------------------------------------------------------------
# contenders

def make_contender(torch, name: str, model, args, graphs: list, fullgraph: bool = True):
    """The callable a contender runs (`graphs` receives the mdsl backend's partitioned graphs)."""
    if name == "eager":
        return model
    if name in ("mdsl", "mdsl-no-graphs"):
        import mdsl.torch

        backend = mdsl.torch.compiler(search_config(args), cuda_graphs=name == "mdsl", on_graph=graphs.append)
        return torch.compile(model, backend=backend, fullgraph=fullgraph)
    mode = {"inductor": None, "max-autotune": "max-autotune-no-cudagraphs", "reduce-overhead": "reduce-overhead"}[name]
    return torch.compile(model, mode=mode, fullgraph=fullgraph)


def errors(torch, got, reference) -> dict:
    """How far `got`'s logits are from the reference's."""
    g, r = got.detach().float(), reference.detach().float()
    diff = g - r
    scale = float(r.abs().max())
    max_abs = float(diff.abs().max())
    return {"max_abs_err": max_abs, "max_rel_err": max_abs / scale if scale else None,
            "l2_rel_err": float(diff.norm() / r.norm()) if float(r.norm()) else None,
            "argmax_match": bool((g.argmax(-1) == r.argmax(-1)).all()), "finite": bool(torch.isfinite(g).all())}


def timed(torch, workload, fn, batch: int, samples: int) -> dict:
    """ms per call: `samples` batches of `batch` back-to-back calls between two CUDA events."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call = []
    for _ in range(samples):
        workload.reset()
        torch.cuda.synchronize()
        start.record()
        for _ in range(batch):
            workload.call(fn)
        stop.record()
        stop.synchronize()
        per_call.append(start.elapsed_time(stop) / batch)
    per_call.sort()
    return {"ms": statistics.median(per_call), "p10_ms": per_call[len(per_call) // 10],
            "p90_ms": per_call[(9 * len(per_call)) // 10], "samples": samples, "batch": batch}


def mdsl_record(graphs: list) -> dict:
    """What the mdsl backend made of the model: regions, distinct region operators, the operators left to
    torch, and what compiled each graph (with its CUDA graph note)."""
    regions = [r for g in graphs for r in g.regions]
    return {"graphs": len(graphs), "regions": len(regions), "distinct_regions": len({r.op for r in regions}),
            "region_ops": sum(len(r.aten_ops) for r in regions),
            "left_to_torch": sum(1 for g in graphs for _ in g.left),
            # operators of regions whose plan the cache lacks, where the search cannot run (no z3): Inductor's
            "no_plan": sum(1 for g in graphs for _, reason in g.left.values() if "no plan for its region" in reason),
            "handoffs": [str(g.handoff) for g in graphs],
            "replays": sum(sum(r.replays.values()) for r in regions)}


def measure(torch, workload, name: str, model, reference, args, rec: dict) -> dict:
    """One contender on one workload: compile and warm-up, correctness, timing, recorded into `rec` as
    they go, so that a contender that fails keeps its warnings and what the mdsl backend made of the
    model (an Inductor failure the backend fell back from, say)."""
    torch._dynamo.reset()
    graphs: list = []
    rec["fullgraph"] = True
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        try:
            _measure(torch, workload, name, model, reference, args, rec, graphs)
        finally:
            notes = list(dict.fromkeys(_first_line(w.message) for w in caught
                                       if not issubclass(w.category, (DeprecationWarning, FutureWarning))))
            if notes:
                rec["warnings"] = notes[:8]
            if graphs:
                rec["mdsl"] = mdsl_record(graphs)
    del graphs
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def _measure(torch, workload, name: str, model, reference, args, rec: dict, graphs: list) -> None:
    fn = make_contender(torch, name, model, args, graphs)
    start = time.perf_counter()
    workload.reset()
    try:
        workload.call(fn)
    except Exception as e:
        if not _graph_break(torch, e):
            raise
        rec["fullgraph"] = False   # dynamo broke the graph: the contender runs as torch.compile allows
        rec["graph_break"] = _first_line(e)
        torch._dynamo.reset()
        fn = make_contender(torch, name, model, args, graphs, fullgraph=False)
        start = time.perf_counter()
        workload.reset()
        workload.call(fn)
    torch.cuda.synchronize()
    rec["compile_s"] = time.perf_counter() - start
    for _ in range(WARMUP_CALLS - 1):
        workload.reset()
        workload.call(fn)
    torch.cuda.synchronize()
    rec["warmup_s"] = time.perf_counter() - start
    workload.reset()
    got = workload.call(fn)
    torch.cuda.synchronize()
    rec.update(errors(torch, got, reference))
    del got
    rec.update(timed(torch, workload, fn, args.batch, args.samples))
    if args.profile:
        rec["kernels"] = kernel_profile(torch, workload, fn, args.profile)


#: kernels a profile keeps, costliest first
PROFILED_KERNELS = 25


def kernel_profile(torch, workload, fn, calls: int) -> list:
    """`calls` calls of `fn` under torch.profiler (CUPTI: kernels launched through the driver, cuBLAS's and
    those replayed from a CUDA graph included): per kernel name, its launches and GPU µs per call, the
    PROFILED_KERNELS costliest, then the others summed into one row."""
    from torch.profiler import ProfilerActivity, profile

    workload.reset()
    workload.call(fn)   # (a call that starts nothing new inside the profile)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            workload.reset()
            workload.call(fn)
        torch.cuda.synchronize()
    totals: dict = {}
    for event in prof.events():
        if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA and event.device_time_total:
            count, us = totals.get(event.name, (0, 0.0))
            totals[event.name] = (count + 1, us + event.device_time_total)
    rows = sorted(({"kernel": name[:120], "launches_per_call": count / calls, "us_per_call": us / calls}
                   for name, (count, us) in totals.items()), key=lambda r: -r["us_per_call"])
    rest = rows[PROFILED_KERNELS:]
    if rest:
        rows = rows[:PROFILED_KERNELS] + [{"kernel": f"({len(rest)} others)",
                                           "launches_per_call": sum(r["launches_per_call"] for r in rest),
                                           "us_per_call": sum(r["us_per_call"] for r in rest)}]
    return rows


def _graph_break(torch, e: Exception) -> bool:
    exc = getattr(torch._dynamo, "exc", None)
    kinds = tuple(k for k in (getattr(exc, "Unsupported", None), getattr(exc, "UserError", None)) if k)
    return isinstance(e, kinds)


def _first_line(e) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    return (f"{type(e).__name__}: {line}" if isinstance(e, BaseException) else line)[:300]


def verdict(rec: dict, floor: Optional[float]) -> str:
    """"ok", or why the contender's logits are not eager's within bf16's tolerance."""
    tolerance = max(TOLERANCE, 2 * floor) if floor is not None else TOLERANCE
    if not rec.get("finite", True):
        return "wrong: non-finite logits"
    if rec.get("l2_rel_err") is not None and rec["l2_rel_err"] > tolerance:
        return f"wrong: L2 relative error {rec['l2_rel_err']:.2e} over {tolerance:.1e}"
    return "ok"


# ---------------------------------------------------------------------------------------------
# the tables

def _ms(value: Optional[float]) -> str:
    return "—" if value is None else (f"{value:.3f}" if value < 10 else f"{value:.1f}")


def _err(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.1e}"


def notes_of(rec: dict) -> str:
    notes = []
    if rec.get("status") not in (None, "ok"):
        notes.append(rec.get("error") or rec["status"])
    if rec.get("fullgraph") is False:
        notes.append(f"graph breaks ({rec.get('graph_break', '?')})")
    if rec.get("mdsl"):
        m = rec["mdsl"]
        notes.append(f"{m['regions']} regions ({m['distinct_regions']} distinct), {m['left_to_torch']} ops left to "
                     f"torch; " + " / ".join(m["handoffs"]))
        if m.get("no_plan"):
            notes.append(f"{m['no_plan']} of those ops are in regions the plan cache has no plan for, which the "
                         "search cannot make here (no z3)")
    notes += [w for w in rec.get("warnings") or [] if "unoptimized" in w or "CUDA graph" in w]
    return "; ".join(notes).replace("|", "\\|")


def markdown(results: dict) -> str:
    meta = results.get("meta") or {}
    gpu = (meta.get("gpu") or {}).get("name") or "?"
    lines = [f"# torch.compile on Qwen3-0.6B's shapes ({meta.get('layers', '?')} layers, random bf16 weights), "
             f"batch 1", "",
             f"{gpu}, torch {meta.get('torch', '?')}, transformers {meta.get('transformers', '?')}, mdsl "
             f"{meta.get('mdsl_commit') or '?'}. ms per call, host time included (median of {meta.get('samples')} "
             f"samples of {meta.get('batch')} calls); speed-up: inductor's time over the contender's; errors: the "
             "logits against eager's.", ""]
    for workload, data in (results.get("workloads") or {}).items():
        floor = data.get("bf16_floor")
        lines += [f"## {workload}: {data.get('what', '')}", "",
                  f"bf16's own error (eager bf16 against float32, L2): {_err(floor)}", "",
                  "| contender | ms | p10–p90 | speed-up | compile s | max abs err | max rel err | L2 rel err | "
                  "argmax | verdict | notes |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
        base = (data["contenders"].get("inductor") or {}).get("ms")
        for name, rec in data["contenders"].items():
            ms = rec.get("ms")
            cells = [name, _ms(ms), f"{_ms(rec.get('p10_ms'))}–{_ms(rec.get('p90_ms'))}" if ms else "—",
                     f"{base / ms:.2f}×" if base and ms else "—",
                     f"{rec['compile_s']:.1f}" if "compile_s" in rec else "—",
                     _err(rec.get("max_abs_err")), _err(rec.get("max_rel_err")), _err(rec.get("l2_rel_err")),
                     "—" if "argmax_match" not in rec else ("yes" if rec["argmax_match"] else "no"),
                     rec.get("status", "?"), notes_of(rec)]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        for name, rec in data["contenders"].items():   # (--profile) each contender's costliest kernels
            if rec.get("kernels"):
                lines += [f"{name}'s kernels (GPU µs per call, torch.profiler):", "",
                          "| kernel | launches per call | µs per call |", "|---|---:|---:|"]
                lines += [f"| `{r['kernel']}` | {r['launches_per_call']:g} | {r['us_per_call']:.1f} |"
                          for r in rec["kernels"]] + [""]
    return "\n".join(lines)


def write_outputs(results: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "torch_compile.json", "md": out / "torch_compile.md"}
    paths["json"].write_text(json.dumps(results, indent=1))
    paths["md"].write_text(markdown(results))
    return paths


# ---------------------------------------------------------------------------------------------
# the runs

def _workload(torch, transformers, name: str, model, args):
    if name == "decode":
        return Decode(torch, transformers, model, args.context, args.batch)
    return Prefill(torch, model, args.prefill)


WHAT = {"decode": "one token against a static cache of {context} tokens (cache length {length})",
        "prefill": "{prefill} tokens, no cache, the last position's logits"}


def run_gpu(args, torch, transformers, started: float) -> dict:
    meta = provenance("torch_compile.py", args.argv, gpu=True)
    meta.update(torch=torch.__version__, transformers=transformers.__version__, layers=args.layers,
                context=args.context, prefill=args.prefill, batch=args.batch, samples=args.samples,
                search={"budget_s": args.budget, "work": args.work}, plan_cache=os.environ["MDSL_CACHE_DIR"],
                search_available=importlib.util.find_spec("z3") is not None, tolerance=TOLERANCE)
    results: dict = {"schema": SCHEMA, "meta": meta, "workloads": {}}
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}; "
          f"plan cache {meta['plan_cache']}; the search {'runs' if meta['search_available'] else 'cannot run (no z3)'}",
          flush=True)
    model = build_model(torch, transformers, args.layers, "cuda")
    workloads, references = {}, {}
    try:
        for workload, name in schedule(args.workloads, args.contenders):
            if workload not in workloads:
                workloads[workload] = state = _workload(torch, transformers, workload, model, args)
                model32 = copy.deepcopy(model).float()
                reference32 = state.reference_float32(torch, model32)
                del model32
                state.reset()
                with torch.no_grad():
                    references[workload] = state.call(model).clone()
                torch.cuda.synchronize()
                floor = errors(torch, references[workload], reference32)
                del reference32
                torch.cuda.empty_cache()
                results["workloads"][workload] = {
                    "what": WHAT[workload].format(context=args.context, length=args.context + args.batch,
                                                  prefill=args.prefill),
                    "bf16_floor": floor["l2_rel_err"], "bf16_vs_float32": floor, "contenders": {}}
            entry = results["workloads"][workload]["contenders"]
            if name not in args.contenders:
                continue
            elapsed = time.perf_counter() - started
            if elapsed > args.time_limit:
                entry[name] = {"status": "skipped", "error": f"not started: {elapsed:.0f} s past, --time-limit "
                                                            f"{args.time_limit:g} s"}
                continue
            print(f"== {workload} / {name} (at {elapsed:.0f} s)", flush=True)
            entry[name] = {"status": "cut", "error": f"started at {elapsed:.0f} s; the run ended before it finished"}
            write_outputs(results, args.out)   # what a run killed now leaves
            # a contender still running 30 s past the limit prints every thread's stack (where a run killed
            # at its limit spent its time)
            faulthandler.dump_traceback_later(args.time_limit + 30 - elapsed)
            rec: dict = {}
            try:
                measure(torch, workloads[workload], name, model, references[workload], args, rec)
                rec["status"] = verdict(rec, results["workloads"][workload]["bf16_floor"])
            except Exception as e:   # the other contenders are still worth measuring
                traceback.print_exc()
                rec.update(status="error", error=_first_line(e))
                torch._dynamo.reset()
                torch.cuda.empty_cache()
            faulthandler.cancel_dump_traceback_later()
            entry[name] = rec
            print(f"   {rec.get('status')}: " + (f"{rec['ms']:.3f} ms per call, compile {rec['compile_s']:.1f} s, "
                                                 f"L2 error {_err(rec.get('l2_rel_err'))}" if "ms" in rec else
                                                 rec.get("error", "")), flush=True)
            write_outputs(results, args.out)
    finally:
        paths = write_outputs(results, args.out)
        print(f"written: {', '.join(str(p) for p in paths.values())}\n")
        print(markdown(results), flush=True)
    return results


def run_plans_only(args, torch, transformers) -> dict:
    """Compile both workloads with the mdsl backend on CPU tensors and search each distinct region's plan."""
    import mdsl.torch

    config = search_config(args)
    model = build_model(torch, transformers, args.layers, "cpu")
    rows, seen = [], set()
    for name in args.workloads:
        workload = _workload(torch, transformers, name, model, args)
        graphs: list = []
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=mdsl.torch.compiler(config, inductor=False, on_graph=graphs.append),
                                 fullgraph=True)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            workload.reset()
            workload.call(compiled)
        for region in (r for g in graphs for r in g.regions):
            if region.op in seen:
                continue
            seen.add(region.op)
            start = time.perf_counter()
            plan = region.kernel.optimize(*region.specs)
            row = {"workload": name, "region": str(region.op), "aten_ops": len(region.aten_ops),
                   "kernels_before": plan.original_cost.launches, "kernels_after": plan.cost.launches,
                   "estimate_us": plan.cost.seconds * 1e6, "provisional": plan.provisional,
                   "search_s": time.perf_counter() - start}
            start = time.perf_counter()
            row["precompiled"] = precompile(plan, config.arch)
            row["compile_s"] = time.perf_counter() - start
            rows.append(row)
            print(json.dumps(row), flush=True)
    provisional = sum(r["provisional"] for r in rows)
    print(f"{len(rows)} distinct region(s) planned into {os.environ['MDSL_CACHE_DIR']}"
          + (f"; {provisional} provisional (cut by --budget: a GPU run without z3 cannot search them again)"
             if provisional else ""))
    return {"regions": rows}


def precompile(plan, arch: str) -> str:
    """Compile the plan's CUDA program into the cubin cache as the GPU run's opening call will ("ok"), or
    say why not (that run compiles it then)."""
    from mdsl.errors import MdslError
    from mdsl.gpu.generators import generator

    cuda = generator("cuda")
    try:
        cuda.compile(cuda.emit(plan.graph, arch=arch), arch)
    except MdslError as e:
        return _first_line(e)
    return "ok"


def main(argv: Optional[Sequence[str]] = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if not os.environ.get("MDSL_CACHE_DIR"):
        os.environ["MDSL_CACHE_DIR"] = tempfile.mkdtemp(prefix="mdsl_plans_")
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"benchmarks/torch_compile.py needs torch and transformers ({e})", file=sys.stderr)
        return 2
    import mdsl.torch  # noqa: F401 - registers the backend

    if args.plans_only:
        run_plans_only(args, torch, transformers)
        return 0
    if not torch.cuda.is_available():
        print("torch sees no CUDA GPU: the benchmark needs one (--plans-only runs without)", file=sys.stderr)
        return 2
    results = run_gpu(args, torch, transformers, started)
    statuses = [rec.get("status") for w in results["workloads"].values() for rec in w["contenders"].values()]
    return 0 if all(s in ("ok", "skipped") for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The serving engine on a GPU (`LLM(device="gpu")`), in-process, random bf16 weights at a benchmark model's
shapes (mdsl.megakernel.runtime.models):

  (a) decode step time against the batch size at a context, and at batch 1 against the context, beside
      the bandwidth floor (the weights plus every request's cached keys and values, as the device stores
      them: bf16, the checkpoint's dtype, over 4.25 TB/s) and PyTorch's kernel-per-op step at the same
      batch and context (bf16, static KV caches, replayed as a CUDA graph: benchmarks/decode.py's baseline);
  (b) an offline run: --requests requests with seeded prompt lengths and output lengths, submitted at once;
      output tokens per second;
  (c) an online run per --rates rate: the same requests arriving as a Poisson process; time to first token
      and time per output token, p50 and p99.

    python3 benchmarks/serve.py --model qwen3-0.6b --out $OUT
    python3 benchmarks/serve.py --model qwen3-0.6b --parts a --batches 1,8,32,64 --context 1024

A decode step is timed over --decode-tokens steps in which every request of the batch decodes: the B
requests' prompts (context - 1 tokens each) are read oldest first, a step's budget at a time, and the
timing starts once the last has its first token; no request ends before the timing (and the op profile
after it) does. The requests read first have decoded further meanwhile: the floor counts each request's
cached keys and values at its mean context over the timed steps. Greedy, `ignore_eos`. Files: serve.json
(with the run's provenance) and serve.md (the tables, also printed).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import provenance  # noqa: E402
from benchmarks.serve_http import _percentile, random_checkpoint  # noqa: E402

BANDWIDTH = 4.25e12     # measured copy bandwidth of the H200, bytes/s (METHOD.md)
PAGE_SIZE = 16


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", help="a model of mdsl.megakernel.runtime.models (random weights)")
    ap.add_argument("--parts", default="a,b,c", help="which of a (decode steps), b (offline), c (online)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=1024, help="(a) the requests' context at their decode steps")
    ap.add_argument("--long-contexts", default="8192,32768",
                    help="(a) also batch 1 at these prompt lengths (comma-separated; empty: none)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="(a) steps timed (and as many profiled)")
    ap.add_argument("--no-torch", dest="torch", action="store_false",
                    help="(a) skip PyTorch's decode step at the same batch and context (CUDA graph, static KV cache)")
    ap.add_argument("--requests", type=int, default=256, help="(b, c) requests")
    ap.add_argument("--prompt-len", default="32:1024", help="(b, c) prompt lengths LO:HI, seeded uniform")
    ap.add_argument("--output-len", default="32:512", help="(b, c) output lengths LO:HI, seeded uniform")
    ap.add_argument("--rates", default="4,16,64", help="(c) Poisson arrival rates, requests per second")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=".", help="folder for serve.json and serve.md")
    return ap.parse_args(argv)


def _range(text: str) -> tuple:
    low, _, high = text.partition(":")
    return int(low), int(high)


def workload(args, vocab: int) -> list:
    """(prompt, output length) per request, seeded."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    (p0, p1), (o0, o1) = _range(args.prompt_len), _range(args.output_len)
    return [([int(t) for t in rng.integers(0, vocab, int(rng.integers(p0, p1 + 1)))], int(rng.integers(o0, o1 + 1)))
            for _ in range(args.requests)]


def decode_budget(per_step: int, batch: int, context: int, tokens: int) -> int:
    """Tokens each request of (a) may produce: enough that none ends before the last one's prompt is read
    (prompts are read oldest first, so the first request decodes while the others' prompts are read) and
    the timed and profiled steps are over."""
    return -(-batch * context // per_step) + batch + 2 * tokens + 8


def decode_steps(llm, batch: int, context: int, tokens: int, vocab: int, seed: int) -> dict:
    """(a): the step time while `batch` requests decode together, prompts of `context` tokens, over `tokens`
    steps from the moment the last prompt is read; then, over as many more, the time of each layer op in a
    step (GpuDevice.profile_ops). Every request runs until both are over (then it is cancelled), so every
    timed step has `batch` rows; the requests read first are further on, and `mean_context` (at the timed
    steps' middle) is what the bandwidth floor counts."""
    import numpy as np

    from mdsl import SamplingParams

    rng = np.random.default_rng(seed + batch)
    params = SamplingParams(max_new_tokens=decode_budget(llm.shape.max_tokens_per_step, batch, context, tokens),
                            ignore_eos=True)
    handles = [llm.submit([int(t) for t in rng.integers(0, vocab, context - 1)], params) for _ in range(batch)]

    def produced() -> list:
        return [len(h.poll()[0]) for h in handles]

    while min(produced()) < 1:
        time.sleep(0.0002)
    start, steps0 = time.perf_counter(), llm.stats().steps
    replays0, preemptions0 = llm.device.replays, llm.stats().preemptions
    before = produced()
    while llm.stats().steps < steps0 + tokens:
        time.sleep(0.0002)
    end, steps1 = time.perf_counter(), llm.stats().steps
    after = produced()
    replays, preemptions = llm.device.replays - replays0, llm.stats().preemptions - preemptions0
    llm.device.profile_ops(True)
    while llm.stats().steps < steps1 + tokens:
        time.sleep(0.0002)
    ops = llm.device.profile_ops(False)
    if any(h.poll()[1] is not None for h in handles):
        raise RuntimeError(f"a request of batch {batch} ended before the timed steps did (decode_budget is short)")
    for h in handles:
        h.cancel()
    for h in handles:
        h.result()
    return {"batch": batch, "context": context, "mean_context": context - 1 + float(np.mean(before + after)),
            "steps": steps1 - steps0, "step_s": (end - start) / max(1, steps1 - steps0),
            "replayed": replays, "preemptions": preemptions,
            "ops_us": {op: round(us, 2) for op, (us, _) in sorted(ops.items(), key=lambda kv: -kv[1][0])}}


def torch_baseline(model: str):
    """step_s(batch, context): PyTorch's kernel-per-op decode step of `batch` sequences at `context`
    (benchmarks/decode.py's, static KV caches, bf16), replayed as a CUDA graph; None without torch and a
    GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    import statistics

    import attrs

    from benchmarks.decode import random_weights, time_torch_graph, torch_decode_step
    from mdsl.ir.dtypes import bf16
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    from mdsl.megakernel.runtime.models import MODELS

    config = attrs.evolve(config_from_dict(MODELS[model]), dtype=bf16)
    weights = random_weights(torch, config)

    def step_s(batch: int, context: int) -> float:
        step = torch_decode_step(torch, config, weights, context - 1, batch=batch)
        seconds = statistics.median(time_torch_graph(torch, step, 32, 5, batch=batch))
        del step
        torch.cuda.empty_cache()
        return seconds

    return step_s


def run_requests(llm, requests: list, arrivals: list) -> list:
    """Submit request i at arrivals[i] seconds from now; per request its start, token times and count."""
    from mdsl import SamplingParams

    records: list = [None] * len(requests)
    origin = time.perf_counter()

    def client(i):
        prompt, n = requests[i]
        delay = origin + arrivals[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        start, times = time.perf_counter(), []
        for _ in llm.submit(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)):
            times.append(time.perf_counter())
        records[i] = {"start": start, "times": times, "expected": n}

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def summary(name: str, records: list) -> dict:
    wall = max(r["times"][-1] for r in records) - min(r["start"] for r in records)
    tokens = sum(len(r["times"]) for r in records)
    ttft = [r["times"][0] - r["start"] for r in records]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in records if len(r["times"]) > 1]
    return {"run": name, "requests": len(records), "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall, "short": sum(len(r["times"]) != r["expected"] for r in records),
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
            "tpot_p50_s": _percentile(tpot, 50), "tpot_p99_s": _percentile(tpot, 99)}


def tables(result: dict) -> str:
    lines = []
    if result.get("decode"):
        lines += [f"Decode steps, {result['model']} (random bf16 weights), GPU serving device:", "",
                  "| batch | prompts | mean context | step | floor | % of floor | tokens/s | PyTorch step | PyTorch / step |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for d in result["decode"]:
            torch_ms = f"{d['torch_step_s'] * 1e3:.2f} ms" if d.get("torch_step_s") else "-"
            ratio = f"{d['torch_step_s'] / d['step_s']:.2f}" if d.get("torch_step_s") else "-"
            lines.append(f"| {d['batch']} | {d['context']} | {d['mean_context']:.0f} | {d['step_s'] * 1e3:.2f} ms | "
                         f"{d['floor_s'] * 1e3:.3f} ms | "
                         f"{100 * d['floor_s'] / d['step_s']:.0f}% | {d['batch'] / d['step_s']:.0f} | {torch_ms} | {ratio} |")
        lines.append("")
        ops = sorted({op for d in result["decode"] for op in d.get("ops_us", {})},
                     key=lambda op: -max(d.get("ops_us", {}).get(op, 0.0) for d in result["decode"]))
        if ops:
            lines += ["Where a decode step's time goes (GpuDevice.profile_ops: µs per step of each layer op, all "
                      "layers, in the replayed graph):", "",
                      "| batch | " + " | ".join(ops) + " | sum |", "|---|" + "---|" * (len(ops) + 1)]
            for d in result["decode"]:
                us = d.get("ops_us", {})
                lines.append(f"| {d['batch']} | " + " | ".join(f"{us.get(op, 0.0):.0f}" for op in ops) +
                             f" | {sum(us.values()):.0f} |")
            lines.append("")
    if result.get("runs"):
        def ms(v):
            return f"{v * 1e3:.1f} ms"

        lines += ["| run | requests | output tokens | wall | tokens/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | short |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["runs"]:
            lines.append(f"| {r['run']} | {r['requests']} | {r['output_tokens']} | {r['wall_s']:.1f} s | "
                         f"{r['output_tokens_per_s']:.0f} | {ms(r['ttft_p50_s'])} | {ms(r['ttft_p99_s'])} | "
                         f"{ms(r['tpot_p50_s'])} | {ms(r['tpot_p99_s'])} | {r['short']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import numpy as np

    from mdsl import LLM
    from mdsl.megakernel.runtime.models import MODELS
    from mdsl.serving.cpu import kv_bytes_per_token
    from mdsl.serving.protocol import DEFAULT_MAX_TOKENS_PER_STEP

    args = parse_args(argv)
    parts = set(args.parts.split(","))
    raw = MODELS[args.model]
    result = {"meta": provenance("serve.py", sys.argv[1:] if argv is None else argv, gpu=True), "model": args.model,
              "decode": [], "runs": []}
    with tempfile.TemporaryDirectory() as folder:
        print(f"writing random weights at {args.model}'s shapes", flush=True)
        random_checkpoint(args.model, folder)
        requests = workload(args, raw["vocab_size"])
        # (batch, prompt length) of each decode measurement: the batches at --context, batch 1 at the long ones
        points = [(int(b), args.context) for b in args.batches.split(",")] + \
                 [(1, int(c)) for c in args.long_contexts.split(",") if c]
        per_step = DEFAULT_MAX_TOKENS_PER_STEP
        spans = [(b, c + decode_budget(per_step, b, c, args.decode_tokens)) for b, c in points] if "a" in parts else []
        max_seq = max([s for _, s in spans] + [len(p) + n for p, n in requests])
        # pages for the most tokens any part holds at once (not every slot at max_seq: 64 x 32k would not fit)
        whole = [args.max_batch * max(len(p) + n for p, n in requests)] if parts & {"b", "c"} else []
        held = max([b * s for b, s in spans] + whole)
        with LLM(folder, device="gpu", max_batch=args.max_batch, max_seq=max_seq, max_tokens_per_step=per_step,
                 kv_pages=-(-held // PAGE_SIZE) + args.max_batch, page_size=PAGE_SIZE) as llm:
            graph = llm.device.graph
            weights = sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in graph.weights)
            per_token = kv_bytes_per_token(graph)         # (the GPU pools' bytes a position, in the weights' bf16)
            llm.submit([1, 2, 3], None).result()          # kernels compiled and loaded
            if "a" in parts:
                for batch, context in points:
                    d = decode_steps(llm, batch, context, args.decode_tokens, raw["vocab_size"], args.seed)
                    d["floor_s"] = (weights + batch * d["mean_context"] * per_token) / BANDWIDTH
                    result["decode"].append(d)
                    print(d, flush=True)
            if "b" in parts:
                result["runs"].append(summary("offline", run_requests(llm, requests, [0.0] * len(requests))))
                print(result["runs"][-1], flush=True)
            if "c" in parts:
                rng = np.random.default_rng(args.seed + 1)
                for rate in (float(r) for r in args.rates.split(",")):
                    arrivals = list(np.cumsum(rng.exponential(1.0 / rate, len(requests))))
                    result["runs"].append(summary(f"online {rate:g}/s", run_requests(llm, requests, arrivals)))
                    print(result["runs"][-1], flush=True)
        del llm
    gc.collect()        # (the engine's device memory goes back before PyTorch's weights and caches are made)
    baseline = torch_baseline(args.model) if args.torch and result["decode"] else None
    for d in result["decode"] if baseline is not None else ():
        d["torch_step_s"] = baseline(d["batch"], int(round(d["mean_context"])))
        print(f"PyTorch, batch {d['batch']} at {d['mean_context']:.0f}: {d['torch_step_s'] * 1e3:.2f} ms", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(result, indent=1))
    text = tables(result)
    (out / "serve.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

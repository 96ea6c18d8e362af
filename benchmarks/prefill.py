"""Time to first token: one prompt, read by the serving engine in steps of its token budget, against PyTorch
running the same prompt as one forward pass (transformers' model over the same checkpoint, bf16, SDPA
attention) in the same process, and against the compute floor. Random bf16 weights at a benchmark model's
shapes (mdsl.megakernel.runtime.models).

    python3 benchmarks/prefill.py --out $OUT
    python3 benchmarks/prefill.py --models qwen3-8b --prompts 1024,4096 --device gpu --out $OUT

Per model and prompt length P: the engine (`LLM(device=...)`, one request at a time, the default step budgets
unless --max-tokens-per-step or --max-prefill-tokens: a prompt alone is read max_prefill_tokens a step) reads
a seeded random prompt of P tokens and samples one greedy token; the time to first token is the wall time
from `submit` to that token, the median of --repeats runs after one unmeasured run of the same length (its
kernels loaded and its step shapes captured). On the GPU device one more run is timed op by op
(`GpuDevice.profile_ops`: each layer op's µs, and each of its kernels', summed over the prompt's steps).
PyTorch's is the wall time of `model(ids, logits_to_keep=1)` and the argmax read back, the median of
--repeats after two warm-up passes; its first token is compared with the engine's (`same token`: random
weights can tie; `no (2nd)`: the engine's token is PyTorch's runner-up).

The floor is the prompt's arithmetic over 750 TFLOP/s: 2 FLOP per weight of every linear layer per token (the
embedding table is a lookup, the LM head runs for the last token only) plus causal attention's 4 x head_dim
FLOP per query head for each (query, key) pair with key <= query. At the lengths measured it exceeds the
weights' bytes over 4.25 TB/s except for the shortest prompts, where the larger of the two is the floor.
Files: prefill.json (with the run's provenance), written after each measurement, and prefill.md.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import provenance, write_outputs  # noqa: E402
from benchmarks.serve import op_times  # noqa: E402
from benchmarks.serve_http import model_dict, random_checkpoint, scratch_folder  # noqa: E402

FLOPS = 750e12          # bf16 dense tensor-core rate of the H200 (METHOD.md)
BANDWIDTH = 4.25e12     # measured copy bandwidth of the H200, bytes/s
DEVICES = ("gpu", "megakernel")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b,llama-3.2-1b,qwen3-8b",
                    help="models of mdsl.megakernel.runtime.models, comma-separated")
    ap.add_argument("--prompts", default="128,1024,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--device", default="gpu", choices=DEVICES, help="the serving device that reads the prompts")
    ap.add_argument("--max-tokens-per-step", type=int, default=None,
                    help="the engine's step budget (default: the engine's)")
    ap.add_argument("--max-prefill-tokens", type=int, default=None,
                    help="the engine's budget of a step of prompt chunks alone (default: the engine's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None,
                    help="the models' first N layers only (a quicker checkpoint for profiling an op: its time a "
                         "layer is the same; time to first token is not the model's)")
    ap.add_argument("--no-torch", dest="torch", action="store_false", help="leave PyTorch's forward out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=".", help="folder for prefill.json and prefill.md")
    args = ap.parse_args(argv)
    try:
        args.prompts = [int(p) for p in args.prompts.split(",") if p.strip()]
    except ValueError:
        ap.error(f"--prompts: expected comma-separated token counts, got {args.prompts!r}")
    if not args.prompts or min(args.prompts) < 1:
        ap.error("--prompts: every prompt needs at least one token")
    if args.repeats < 1:
        ap.error("--repeats: at least one")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    return args


def prompt_flops(graph, config, tokens: int) -> float:
    """The arithmetic of reading a prompt of `tokens` tokens (the module docstring's count)."""
    import numpy as np

    # (the embedding table and the LM head are the 2-D weights outside the layers)
    linear = sum(int(np.prod(w.shape)) for w in graph.weights if w.type.rank == 2 and ".layers." in w.name)
    head = 2 * config.vocab_size * config.hidden_size
    pairs = tokens * (tokens + 1) / 2
    attention = 4 * config.head_dim * config.num_heads * config.num_layers * pairs
    return 2 * linear * tokens + head + attention


def weight_bytes(graph) -> int:
    import numpy as np

    return sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in graph.weights)


def engine_ttft(llm, prompt: list, repeats: int, profile: bool) -> dict:
    """The engine's time to first token for `prompt` (median of `repeats` after one unmeasured run), its
    first token, its steps, and on the GPU device each op's µs over one more (profiled) run."""
    from mdsl import SamplingParams

    params = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def once() -> tuple:
        start = time.perf_counter()
        handle = llm.submit(prompt, params)
        token = next(iter(handle))
        seconds = time.perf_counter() - start
        handle.result()
        return seconds, token

    once()
    steps0 = llm.stats().steps
    runs = [once() for _ in range(repeats)]
    steps = (llm.stats().steps - steps0) / repeats
    tokens = {t for _, t in runs}
    if len(tokens) != 1:
        raise RuntimeError(f"the engine's first token changed between runs of the same prompt: {sorted(tokens)}")
    out = {"ttft_s": statistics.median(s for s, _ in runs), "runs_s": [s for s, _ in runs], "token": runs[0][1],
           "steps": steps}
    if profile:
        llm.device.profile_ops(True, kernels=True)
        once()
        out["ops_us"], out["kernels_us"] = op_times({name: (us * n, 1) for name, (us, n) in
                                                     llm.device.profile_ops(False).items()})
    return out


def torch_forward(folder: str):
    """ttft(prompt) -> (seconds, first token, runner-up token): transformers' model over the checkpoint in
    `folder` (bf16, SDPA) on the GPU, one forward pass of the prompt; None without torch, transformers or a
    GPU. The runner-up (read after the timing) tells a near-tie from a real difference."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa").cuda().eval()

    @torch.inference_mode()
    def ttft(prompt: list, repeats: int) -> tuple:
        ids = torch.tensor([prompt], device="cuda")
        times, token, logits = [], None, None
        for i in range(repeats + 2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            logits = model(input_ids=ids, logits_to_keep=1, use_cache=False).logits
            token = int(logits[0, -1].argmax())
            if i >= 2:
                times.append(time.perf_counter() - start)
        runner_up = int(logits[0, -1].float().topk(2).indices[1])
        return statistics.median(times), token, runner_up

    def close():
        nonlocal model
        model = None
        gc.collect()
        torch.cuda.empty_cache()

    ttft.close = close
    return ttft


def measure_model(name: str, args, result: dict, out: Path) -> None:
    import numpy as np

    from mdsl import LLM
    from mdsl.megakernel.modelgraph.model_config import config_from_dict

    raw = model_dict(name, args.layers)
    config = config_from_dict(raw)
    rng = np.random.default_rng(args.seed)
    prompts = {p: [int(t) for t in rng.integers(0, raw["vocab_size"], p)] for p in args.prompts}
    # (no prefix cache: each run of a prompt reads all of it, as a prompt seen for the first time)
    engine = dict(max_batch=1, max_seq=max(args.prompts) + 16, prefix_caching=False)
    if args.max_tokens_per_step:
        engine["max_tokens_per_step"] = args.max_tokens_per_step
    if args.max_prefill_tokens:
        engine["max_prefill_tokens"] = args.max_prefill_tokens
    rows = []
    with scratch_folder("mdsl-weights-") as folder:
        print(f"writing random weights at {name}'s shapes", flush=True)
        random_checkpoint(name, folder, layers=args.layers)
        llm = LLM(folder, device=args.device, **engine)
        with llm:
            graph = llm.device.graph
            budget, prefill_budget = llm.shape.max_tokens_per_step, llm.shape.max_prefill_tokens
            for p in args.prompts:
                row = {"model": name if args.layers is None else f"{name} ({args.layers} layers)", "prompt": p,
                       "device": args.device, "max_tokens_per_step": budget, "max_prefill_tokens": prefill_budget,
                       "floor_s": max(prompt_flops(graph, config, p) / FLOPS, weight_bytes(graph) / BANDWIDTH),
                       **engine_ttft(llm, prompts[p], args.repeats, profile=args.device == "gpu")}
                rows.append(row)
                result["rows"].append(row)
                print({k: v for k, v in row.items() if k not in ("ops_us", "kernels_us")}, flush=True)
                write(result, out)
        del llm
        gc.collect()
        forward = torch_forward(folder) if args.torch else None
        if forward is not None:
            for row in rows:
                row["torch_s"], token, runner_up = forward(prompts[row["prompt"]], args.repeats)
                row["same_token"] = token == row["token"]
                row["torch_runner_up"] = row["token"] == runner_up   # ours is PyTorch's second choice
                print(f"PyTorch, {name}, {row['prompt']} tokens: {row['torch_s'] * 1e3:.2f} ms", flush=True)
                write(result, out)
            forward.close()


def tables(result: dict) -> str:
    rows = result["rows"]
    if not rows:
        return "No rows."

    def ms(s):
        return f"{s * 1e3:.1f}" if s is not None else "-"

    device = rows[0]["device"]
    lines = [f"| model | prompt | steps | floor ms | {device} ms | {device} % of floor | PyTorch ms | "
             f"{device} / PyTorch | same token |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        torch_s = r.get("torch_s")
        ratio = f"{r['ttft_s'] / torch_s:.2f}×" if torch_s else "-"
        lines.append(f"| {r['model']} | {r['prompt']} | {r['steps']:g} | {ms(r['floor_s'])} | {ms(r['ttft_s'])} | "
                     f"{100 * r['floor_s'] / r['ttft_s']:.0f}% | {ms(torch_s)} | "
                     f"{ratio} | "
                     f"{_same(r)} |")
    # each model's longest profiled prompt (prefill.json has every prompt's)
    longest = {}
    for r in rows:
        if "ops_us" in r and r["prompt"] >= longest.get(r["model"], r)["prompt"]:
            longest[r["model"]] = r
    ops = sorted({op for r in longest.values() for op in r["ops_us"]},
                 key=lambda op: -max(r["ops_us"].get(op, 0.0) for r in longest.values()))
    if ops:
        lines += ["", f"Where the {device} device's time to first token goes, each model's longest prompt: each layer "
                      "op's ms over the prompt's steps (one profiled run; prefill.json has every prompt's).", "",
                  "| model | prompt | " + " | ".join(ops) + " | sum |",
                  "| --- | ---: | " + " | ".join("---:" for _ in ops) + " | ---: |"]
        for r in longest.values():
            lines.append(f"| {r['model']} | {r['prompt']} | "
                         + " | ".join(f"{r['ops_us'].get(op, 0.0) / 1e3:.2f}" for op in ops)
                         + f" | {sum(r['ops_us'].values()) / 1e3:.2f} |")
    return "\n".join(lines)


def _same(row: dict) -> str:
    """`same token`: yes, no, or `no (2nd)` where the engine's token is PyTorch's runner-up (a near-tie)."""
    if row.get("same_token") is None:
        return "-"
    return "yes" if row["same_token"] else "no (2nd)" if row.get("torch_runner_up") else "no"


def write(result: dict, out: Path) -> str:
    """prefill.json and prefill.md in `out`; the tables' text."""
    return write_outputs(out, "prefill", result, tables(result))


def main(argv=None) -> int:
    from mdsl.megakernel.runtime.models import MODELS

    args = parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    out = Path(args.out)
    result = {"meta": provenance("prefill.py", sys.argv[1:] if argv is None else argv, gpu=True), "rows": []}
    failed = False
    for name in args.models:
        try:
            measure_model(name, args, result, out)
        except Exception as e:     # (each model on its own: the others still run)
            import traceback

            traceback.print_exc()
            result.setdefault("failures", {})[name] = f"{type(e).__name__}: {e}"
            failed = True
        gc.collect()
    print(write(result, out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

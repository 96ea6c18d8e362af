"""The serving scheduler's host time a decode step: what the GPU device's steps spend on the host beside the
GPU's forward (the CPU device's scheduler, which the GPU device runs between its steps' CUDA graphs, and the
engine's thread that streams the tokens), on any machine, no GPU needed.

    python3 benchmarks/serve_host.py [--model qwen3-0.6b] [--batches 1,8,32,64] [--context 1024] [--out DIR]

The engine serves a one-layer checkpoint of the model's shapes (random weights) on the CPU device whose
forward is a wait of --forward-ms (a sleep, which lets the engine's thread run, as the GPU device's wait for
its stream does) and whose every request samples token 1 (the GPU device's greedy tokens come from the GPU).
`batch` requests with prompts of `context` tokens decode together; the step time less the forward's (the
time its sleeps took, measured: a sleep outlasts the time it asks for) is the host's share of a step, µs
(the scheduler's planning, pages, tables and the tokens' ring records: the pool's check, which the GPU
device runs beside its kernels, is inside the forward's time, and greedy tokens come as the GPU device's array).
Files: serve_host.json (with the run's provenance) and serve_host.md.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:   # run as a script from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import provenance, write_outputs   # noqa: E402
from benchmarks.serve_http import random_checkpoint, scratch_folder   # noqa: E402


def host_device(forward_s: float):
    """The CPU device with its forward replaced by a wait of `forward_s` and token 1 for every sampling row, its
    host work shaped as the GPU device's: the pool's check inside the forward's time (the GPU device checks it
    while the step's kernels run), and where every chunk samples the tokens as an array in chunk order (the
    GPU device's greedy tokens), else a chunk -> token dict."""
    import numpy as np

    from mdsl.serving.cpu import CpuDevice

    class HostOnly(CpuDevice):
        forward_spent = [0.0]   # seconds its forwards took (a sleep overshoots its time: not the host's share)

        def _forward(self, step, chunks, rows) -> dict:
            start = time.perf_counter()
            self._check_pool_now()
            time.sleep(forward_s)
            HostOnly.forward_spent[0] += time.perf_counter() - start
            keep = (chunks["row"] + chunks["count"] - 1)[chunks["sample"] == 1]
            return {int(r): None for r in keep.tolist()}

        def _samples(self, logits: dict):
            chunks = self.state["chunks"][:int(self.state["step"]["num_chunks"][0])]
            if (chunks["sample"] == 1).all():
                return np.ones(len(chunks), np.int32)
            return {c: 1 for c, sampled in enumerate(chunks["sample"].tolist()) if sampled}

    return HostOnly


def host_us(folder: str, vocab: int, batch: int, context: int, forward_s: float, seconds: float) -> dict:
    """One point: µs a step beside the forward, over `seconds` of steps once every request decodes."""
    import numpy as np

    from mdsl import LLM, SamplingParams
    from mdsl.serving import engine

    new = 4096   # (more tokens than the run produces: every timed step has `batch` rows)
    device = host_device(forward_s)
    engine.CpuDevice, original = device, engine.CpuDevice
    try:
        llm = LLM(folder, device="cpu", max_batch=batch, page_size=16, max_seq=context + new,
                  kv_pages=batch * -(-(context + new) // 16), prefix_caching=False)
    finally:
        engine.CpuDevice = original
    with llm:
        rng = np.random.default_rng(batch)
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        handles = [llm.submit([int(t) for t in rng.integers(0, vocab, context)], params) for _ in range(batch)]
        while min(len(h.poll()[0]) for h in handles) < 2:
            time.sleep(0.001)
        s0, f0, t0 = llm.stats().steps, device.forward_spent[0], time.perf_counter()
        time.sleep(seconds)
        s1, f1, t1 = llm.stats().steps, device.forward_spent[0], time.perf_counter()
        for h in handles:
            h.cancel()
    steps = s1 - s0
    step, forward = (t1 - t0) / steps, (f1 - f0) / steps
    return {"batch": batch, "context": context, "steps": steps, "step_us": 1e6 * step, "forward_us": 1e6 * forward,
            "host_us": 1e6 * (step - forward)}


HEADER = ("| batch | context | steps | step µs | forward µs | host µs a step |\n"
          "| ---: | ---: | ---: | ---: | ---: | ---: |")


def row(r: dict) -> str:
    return (f"| {r['batch']} | {r['context']} | {r['steps']} | {r['step_us']:.0f} | {r['forward_us']:.0f} | "
            f"{r['host_us']:.0f} |")


def main(argv=None) -> int:
    from mdsl.megakernel.runtime.models import MODELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--forward-ms", type=float, default=3.0)
    ap.add_argument("--seconds", type=float, default=3.0, help="of steps timed at each batch")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    result = {"meta": provenance("serve_host.py", sys.argv[1:] if argv is None else argv), "model": args.model,
              "forward_ms": args.forward_ms, "rows": []}
    print(HEADER, flush=True)
    with scratch_folder("mdsl-weights-") as folder:
        random_checkpoint(args.model, folder, layers=1)
        for batch in (int(b) for b in args.batches.split(",")):
            r = host_us(folder, MODELS[args.model]["vocab_size"], batch, args.context, args.forward_ms / 1e3,
                        args.seconds)
            result["rows"].append(r)
            print(row(r), flush=True)
    if args.out is not None:
        text = HEADER + "\n" + "\n".join(row(r) for r in result["rows"])
        write_outputs(args.out, "serve_host", result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

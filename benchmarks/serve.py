"""The serving engine on a GPU, in-process, random bf16 weights at a benchmark model's shapes
(mdsl.megakernel.runtime.models), on each --device one after the other: "gpu" (`LLM(device="gpu")`: the host
scheduler, one kernel per layer op per step, steps of a repeated shape replayed as CUDA graphs) and "megakernel"
(`LLM(device="megakernel")`: one resident kernel runs the scheduler and every step):

  (a) decode step time against the batch size at a context, and at batch 1 against the context, beside
      the bandwidth floor (the weights plus every request's cached keys and values, as the device stores
      them: bf16, the checkpoint's dtype, over 4.25 TB/s) and PyTorch's kernel-per-op step at the same
      batch and context (bf16, static KV caches, replayed as a CUDA graph: benchmarks/decode.py's baseline);
  (b) an offline run: --requests requests with seeded prompt lengths and output lengths, submitted at once;
      output tokens per second;
  (c) an online run per --rates rate: the same requests arriving as a Poisson process; time to first token
      and time per output token, p50 and p99;
  (d) a mixed run: --mixed-batch requests decoding (prompts of --mixed-decode-prompt tokens), then one prompt
      of --mixed-prompt tokens arriving: the decoders' time per output token over --mixed-window tokens
      before it arrives and while it is read (from its submission to its first token: steps that carry its
      chunks beside their decode tokens), and its time to first token.

    python3 benchmarks/serve.py --model qwen3-0.6b --out $OUT
    python3 benchmarks/serve.py --model qwen3-0.6b --device megakernel --parts a --batches 1,8,32,64 --context 1024

A decode step is timed while every request of the batch decodes: the B requests' prompts (context - 1 tokens
each) are read oldest first, a step's budget at a time, and the timing starts once the last has its first token;
no request ends before the timing (and the GPU device's op profile after it) does. The requests read first have
decoded further meanwhile: the floor counts each request's cached keys and values at its mean context over the
timed steps. Greedy, `ignore_eos`.

The GPU device runs each step from the host: its step time is the wall time of --decode-tokens steps (the
engine's step counter, `LLM.stats().steps`) from the step after the batch's first replayed one (a step shape's
first step runs launched and its second is captured as a CUDA graph, once per shape, both slower than a
replay), then as many more are profiled op by op (GpuDevice.profile_ops).
The megakernel device has no per-step host call to time. Its kernel writes the step counter (the control block's
`steps`, in pinned host memory mapped into the GPU) at every step boundary; this process polls it without a
lock every POLL_S, notes the time it first sees each value over 2 x --decode-tokens steps, and the step time is
the least-squares slope of those times against the values. A sample is late by at most the poll's interval
plus the time the engine's host thread holds the interpreter's lock (reading a step's ring records): the slope
spreads that over every step of the window instead of putting it on the two ends. The step time includes any
wait of the kernel for room in the token ring (four steps' records): the host reading the ring is part of
serving on that device.

Each device's launches are recorded: the GPU device's steps replayed as CUDA graphs (a host launch per step),
the megakernel's kernel launches over the whole run (one, unless a run passes its steps_per_launch). Where a
device cannot serve the model (an UnsupportedError), the results hold the reason and the run goes on. Files:
serve.json (with the run's provenance), written after each device, and serve.md (the tables, also printed).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Optional

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import provenance, write_outputs  # noqa: E402
from benchmarks.serve_http import _percentile, random_checkpoint, scratch_folder  # noqa: E402

BANDWIDTH = 4.25e12     # measured copy bandwidth of the H200, bytes/s (METHOD.md)
PAGE_SIZE = 16
DEVICES = ("gpu", "megakernel")
POLL_S = 2e-5           # (a) the megakernel's step counter polled this often
# a device whose measurement did not finish (the run was cut at its time limit): its rows so far are kept
INCOMPLETE = "the run ended before this device's measurements did: its rows so far"
PROFILED_STEPS = 16     # (a) the megakernel's steps run with its profile on (more than its ring holds)
SPARE_STEPS = 256       # (a) steps a request has beyond the timed and profiled ones
WARM_STEPS = 4          # (a) the GPU device's steps before the timing, at most: until one is replayed
STALL_S = 60.0          # (a) a step counter that does not move for this long fails the measurement


def _devices(text: str) -> list:
    names = list(dict.fromkeys(d.strip() for d in text.split(",") if d.strip()))
    if not names or any(d not in DEVICES for d in names):
        raise argparse.ArgumentTypeError(f"expected {', '.join(DEVICES)} or both, comma-separated; got {text!r}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", help="a model of mdsl.megakernel.runtime.models (random weights)")
    ap.add_argument("--device", type=_devices, default=list(DEVICES), metavar="DEVICES",
                    help="the serving devices measured, one after the other in this process: gpu, megakernel or "
                         "gpu,megakernel (the default)")
    ap.add_argument("--parts", default="a,b,c,d", help="which of a (decode steps), b (offline), c (online), d (mixed)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=1024, help="(a) the requests' context at their decode steps")
    ap.add_argument("--long-contexts", default="8192,32768",
                    help="(a) also batch 1 at these prompt lengths (comma-separated; empty: none)")
    ap.add_argument("--decode-tokens", type=int, default=32,
                    help="(a) steps timed on the GPU device (and as many profiled); on the megakernel, twice as many")
    ap.add_argument("--no-torch", dest="torch", action="store_false",
                    help="(a) skip PyTorch's decode step at the same batch and context (CUDA graph, static KV cache)")
    ap.add_argument("--requests", type=int, default=256, help="(b, c) requests")
    ap.add_argument("--prompt-len", default="32:1024", help="(b, c) prompt lengths LO:HI, seeded uniform")
    ap.add_argument("--output-len", default="32:512", help="(b, c) output lengths LO:HI, seeded uniform")
    ap.add_argument("--rates", default="4,16,64", help="(c) Poisson arrival rates, requests per second")
    ap.add_argument("--mixed-batch", type=int, default=32, help="(d) the requests decoding when the prompt arrives")
    ap.add_argument("--mixed-decode-prompt", type=int, default=128, help="(d) their prompts' tokens")
    ap.add_argument("--mixed-prompt", type=int, default=4096, help="(d) the arriving prompt's tokens")
    ap.add_argument("--mixed-window", type=int, default=32, help="(d) the decoders' tokens timed before it arrives")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-tokens-per-step", type=int, default=None,
                    help="the LLM's token budget of a step (default: the LLM's own default)")
    ap.add_argument("--layers", type=int, default=None,
                    help="the model's first N layers only (a quicker checkpoint for profiling an op, whose time a "
                         "layer is the same; with --no-torch: PyTorch's step is the whole model's)")
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
    the GPU device's WARM_STEPS, the timed and profiled steps are over, with SPARE_STEPS to spare for the host's
    late looks (at the first tokens, between the timing and the profile: a megakernel's step may be a fraction
    of a millisecond) and PROFILED_STEPS more for the megakernel's profile."""
    return -(-batch * context // per_step) + batch + 2 * tokens + WARM_STEPS + SPARE_STEPS + PROFILED_STEPS


def op_times(kernels: dict) -> tuple:
    """(µs per op, µs per "op: kernel") from GpuDevice.profile_ops(..., kernels=True)'s answer, each sorted
    slowest first: an op's time is its kernels'."""
    per_kernel = {name: round(us, 2) for name, (us, _) in sorted(kernels.items(), key=lambda kv: -kv[1][0])}
    ops: dict = {}
    for name, (us, _) in kernels.items():
        op = name.split(": ")[0]
        ops[op] = ops.get(op, 0.0) + us
    return {op: round(us, 2) for op, us in sorted(ops.items(), key=lambda kv: -kv[1])}, per_kernel


def decode_steps(llm, device: str, batch: int, context: int, tokens: int, vocab: int, seed: int,
                 trace: Optional[Path] = None) -> dict:
    """(a): the step time while `batch` requests decode together, prompts of `context` tokens, from the moment the
    last prompt is read: on the GPU device over `tokens` steps, then over as many more the time of each layer op in
    a step and of each op's kernels (GpuDevice.profile_ops); on the megakernel over 2 x `tokens` steps, from its
    step counter (step_counter_slope), then a profile of its tasks (kernel_profile; its trace into `trace`). Every
    request runs until both are over (then it is cancelled), so every timed step has `batch` rows; the requests
    read first are further on, and `mean_context` (at the timed steps' middle) is what the bandwidth floor counts."""
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
    preemptions0 = llm.stats().preemptions
    before = produced()
    if device == "megakernel":
        launches0 = llm.device.launches
        step_s, steps = step_counter_slope(llm.device.host["control"], 2 * tokens)
        after = produced()
        timed = {"steps": steps, "step_s": step_s, "launches": llm.device.launches - launches0}
    else:
        # a step shape's first step runs launched and its second is captured (milliseconds for a model's
        # hundreds of launches), once per shape: the timing starts at the step after the first replayed one
        # (the steady state), or after WARM_STEPS steps where none is replayed
        steps_w, replays_w = llm.stats().steps, llm.device.replays
        while llm.device.replays == replays_w and llm.stats().steps < steps_w + WARM_STEPS:
            time.sleep(0.0002)
        boundary = llm.stats().steps
        while llm.stats().steps == boundary:
            time.sleep(0.0002)
        start, steps0, replays0 = time.perf_counter(), llm.stats().steps, llm.device.replays
        while llm.stats().steps < steps0 + tokens:
            time.sleep(0.0002)
        end, steps1 = time.perf_counter(), llm.stats().steps
        after = produced()
        timed = {"steps": steps1 - steps0, "step_s": (end - start) / max(1, steps1 - steps0),
                 "replayed": llm.device.replays - replays0}
    preemptions = llm.stats().preemptions - preemptions0

    def short() -> bool:
        return any(h.poll()[1] is not None for h in handles)

    if device != "megakernel":
        llm.device.profile_ops(True, kernels=True)
        steps1 = llm.stats().steps
        while llm.stats().steps < steps1 + tokens:
            time.sleep(0.0002)
        timed["ops_us"], timed["kernels_us"] = op_times(llm.device.profile_ops(False))
    if short():
        raise RuntimeError(f"a request of batch {batch} ended before the timed steps did (decode_budget is short)")
    if device == "megakernel":
        profile = kernel_profile(llm.device, trace)
        if not short():   # (a profile of fewer rows than the batch is not kept)
            timed.update(profile)
    for h in handles:
        h.cancel()
    for h in handles:
        h.result()
    return {"device": device, "batch": batch, "context": context,
            "mean_context": context - 1 + float(np.mean(before + after)), **timed, "preemptions": preemptions}


def mixed_budget(per_step: int, batch: int, prompt: int, window: int) -> int:
    """(d) tokens each decoder may produce: its first tokens, the undisturbed window, one a step while the
    prompt is read (its chunks take what the decoders leave of a step's budget), and SPARE_STEPS."""
    return 8 + window + -(-prompt // max(1, per_step - batch)) + SPARE_STEPS


def mean_gap(times: list, start: float, end: float) -> Optional[float]:
    """The mean of the gaps between consecutive token times of `times` that overlap (start, end): the time per
    output token over that span (a gap the span cuts counts whole); None where no gap does."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
    return sum(gaps) / len(gaps) if gaps else None


def mixed_run(llm, device: str, batch: int, decode_prompt: int, prompt: int, window: int, vocab: int,
              seed: int) -> dict:
    """(d): `batch` requests decode (prompts of `decode_prompt` tokens); once each has produced 8 tokens, their
    next `window` tokens are the undisturbed ones; then a prompt of `prompt` tokens arrives, and every decoder's
    tokens from then until the prompt's first token are the mixed ones. Per decoder its mean gap over each span
    (mean_gap); the ratio of the medians, and of the worst decoder's mixed gap to the median undisturbed one.
    On the GPU device a prompt of the same length then arrives again, each layer op of the steps from its
    arrival to its first token timed (profile_ops: µs a step, `ops_us`), apart from the timed span: where a
    mixed step's time goes."""
    import numpy as np

    from mdsl import SamplingParams

    rng = np.random.default_rng(seed + 2)
    params = SamplingParams(max_new_tokens=mixed_budget(llm.shape.max_tokens_per_step, batch, prompt, window),
                            ignore_eos=True)
    handles = [llm.submit([int(t) for t in rng.integers(0, vocab, decode_prompt)], params) for _ in range(batch)]
    times: list = [[] for _ in handles]

    def follow(i):
        for _ in handles[i]:
            times[i].append(time.perf_counter())

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(batch)]
    for t in threads:
        t.start()

    def wait_for(counts: list) -> float:
        deadline = time.perf_counter() + STALL_S
        while any(len(ts) < c for ts, c in zip(times, counts)):
            if time.perf_counter() > deadline or any(h.done() for h in handles):
                raise RuntimeError(f"(d) the decoders stopped before producing {counts} tokens")
            time.sleep(0.0002)
        return time.perf_counter()

    try:
        begin = wait_for([8] * batch)
        end = wait_for([len(ts) + window for ts in times])
        steps0 = llm.stats().steps
        submitted = time.perf_counter()
        arriving = llm.submit([int(t) for t in rng.integers(0, vocab, prompt)],
                              SamplingParams(max_new_tokens=1, ignore_eos=True))
        next(iter(arriving))
        first = time.perf_counter()
        steps = llm.stats().steps - steps0
        ops = {}
        if device != "megakernel":   # (its decoders' SPARE_STEPS outlast a second reading of the prompt)
            llm.device.profile_ops(True, kernels=True)
            again = llm.submit([int(t) for t in rng.integers(0, vocab, prompt)],
                               SamplingParams(max_new_tokens=1, ignore_eos=True))
            next(iter(again))
            ops = llm.device.profile_ops(False)
        short = any(h.done() for h in handles)
    finally:   # (the decoders end with the run, however it ends)
        for h in handles:
            h.cancel()
        for t in threads:
            t.join()
    if short:
        raise RuntimeError("(d) a decoder ended before the prompt's first token (mixed_budget is short)")
    before = [mean_gap(ts, begin, end) for ts in times]
    during = [mean_gap(ts, submitted, first) for ts in times]
    if None in before or None in during:
        raise RuntimeError("(d) a decoder produced no token across a span")
    undisturbed, mixed = statistics.median(before), statistics.median(during)
    return {"device": device, "batch": batch, "decode_prompt": decode_prompt, "prompt": prompt, "window": window,
            "tpot_before_s": undisturbed, "tpot_mixed_s": mixed, "tpot_mixed_worst_s": max(during),
            "ratio": mixed / undisturbed, "ratio_worst": max(during) / undisturbed, "ttft_s": first - submitted,
            "steps": steps,
            **(dict(zip(("ops_us", "kernels_us"), op_times(ops))) if ops else {})}


def kernel_profile(device, trace: Optional[Path]) -> dict:
    """The megakernel's tasks profiled over PROFILED_STEPS steps (MegakernelDevice.profile): of the last complete
    step its ring holds, the step's span (first task taken to last body done, µs), SCHEDULE's body and its parts
    (profile.SERVING_BODY_PARTS), and per kind the layer's phase (profile.layer_phases: the median over layers of the
    phase's span, its median body and the gap before it); that step's Perfetto trace into `trace`."""
    from mdsl.megakernel.runtime.profile import SERVING_BODY_PARTS, body_parts, layer_phases, write_trace

    control = device.host["control"]
    device.profile(True)
    start = int(control["steps"][0])
    wait_for_steps(control, lambda s: s >= start + PROFILED_STEPS)
    device.profile(False)
    stop = int(control["steps"][0])
    wait_for_steps(control, lambda s: s >= stop + 2)   # (no record is being written)
    steps = device.profile_records()
    if not steps:
        return {}
    labels, kinds, layers = device.profile_tasks()
    records = steps[max(steps)]
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        write_trace(str(trace), records, labels, kinds, SERVING_BODY_PARTS)
    schedule = [r for r in records if kinds[r.index % len(kinds)] == "schedule"]
    parts: dict = {}
    for r in schedule:
        for name, begin, end in body_parts(r, "schedule", SERVING_BODY_PARTS):
            parts[name] = parts.get(name, 0.0) + (end - begin) / 1e3
    bodies: dict = {}   # kind -> part -> every task's time in it
    for r in records:
        kind = kinds[r.index % len(kinds)]
        for name, begin, end in body_parts(r, kind, SERVING_BODY_PARTS) if kind != "schedule" else ():
            bodies.setdefault(kind, {}).setdefault(name, []).append((end - begin) / 1e3)
    return {"step_span_us": round((max(r.done_ns for r in records) - min(r.taken_ns for r in records)) / 1e3, 2),
            "schedule_us": round(sum(r.done_ns - r.started_ns for r in schedule) / 1e3, 2),
            "schedule_parts_us": {name: round(us, 2) for name, us in parts.items()},
            "phases_us": layer_phases(records, kinds, layers, step=max(steps)),
            "body_parts_us": {kind: {name: round(float(statistics.median(us)), 2) for name, us in named.items()}
                              for kind, named in bodies.items()}}


def wait_for_steps(control, done) -> int:
    """The device's step counter (`control["steps"]`, which the device writes at each step boundary) polled every
    POLL_S until done(value); that value. A counter that does not move for STALL_S fails."""
    deadline, value = time.perf_counter() + STALL_S, int(control["steps"][0])
    while not done(value):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the device's step counter stayed at {value} for {STALL_S:.0f} s (a device "
                               "without a running request: did the batch's requests end? decode_budget is short)")
        time.sleep(POLL_S)
        value = int(control["steps"][0])
    return value


def step_counter_slope(control, count: int) -> tuple:
    """(seconds per step, steps counted) of a device's step counter: from its next change, the time this process
    first sees each value until it has moved `count` more, and the least-squares slope of those times against the
    values."""
    first = int(control["steps"][0])
    value = wait_for_steps(control, lambda s: s != first)
    seen = [(time.perf_counter(), value)]
    while seen[-1][1] < seen[0][1] + count:
        value = wait_for_steps(control, lambda s: s != seen[-1][1])
        seen.append((time.perf_counter(), value))
    return slope(seen), seen[-1][1] - seen[0][1]


def slope(samples: list) -> float:
    """The least-squares slope of the times against the counts of (time, count) samples."""
    import numpy as np

    times, counts = np.array(samples, dtype=np.float64).T
    return float(np.polyfit(counts, times, 1)[0])


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


def device_of(row: dict) -> str:
    """The device of a decode row or run ("gpu" where the results predate the megakernel's)."""
    return row.get("device", "gpu")


def points_of(decode: list) -> dict:
    """(batch, prompt length) -> {device: its decode row}, in the order measured."""
    points: dict = {}
    for d in decode:
        points.setdefault((d["batch"], d["context"]), {})[device_of(d)] = d
    return points


def launch_lines(devices: dict) -> list:
    """Per device: its steps and what launched them, or why it could not serve the model."""
    lines = []
    for name, info in devices.items():
        if "unsupported" in info:
            lines.append(f"- {name}: cannot serve the model: {info['unsupported']}")
        elif "incomplete" in info:
            lines.append(f"- {name}: {info['incomplete']}")
        elif name == "megakernel":
            lines.append(f"- megakernel: {info['launches']} kernel launch{'es' if info['launches'] != 1 else ''} "
                         f"for the run's {info['steps']} steps (at most {info['steps_per_launch']} a launch)")
        else:
            lines.append(f"- {name}: {info['steps']} steps, {info['replayed']} of them replayed as a CUDA graph "
                         "(a host launch each; the others launch each op's kernels)")
    return lines


def tables(result: dict) -> str:
    lines = []
    if result.get("devices"):
        lines += ["Devices:", "", *launch_lines(result["devices"]), ""]
    decode = result.get("decode") or []
    if decode:
        devices = list(dict.fromkeys(device_of(d) for d in decode))
        lines += [f"Decode steps, {result['model']} (random bf16 weights); mean context and floor: the first "
                  "device's:", "",
                  "| batch | prompts | mean context | floor | " +
                  " | ".join(f"{n} step | {n} % of floor | {n} tokens/s" for n in devices) + " | PyTorch step | " +
                  " | ".join(f"PyTorch / {n}" for n in devices) + " |",
                  "|---|---|---|---|" + "---|---|---|" * len(devices) + "---|" * (1 + len(devices))]
        for (batch, context), rows in points_of(decode).items():
            first = next(iter(rows.values()))
            torch_s = next((d["torch_step_s"] for d in rows.values() if d.get("torch_step_s")), None)
            cells = [str(batch), str(context), f"{first['mean_context']:.0f}", f"{first['floor_s'] * 1e3:.3f} ms"]
            for n in devices:
                d = rows.get(n)
                cells += ([f"{d['step_s'] * 1e3:.2f} ms", f"{100 * d['floor_s'] / d['step_s']:.0f}%",
                           f"{batch / d['step_s']:.0f}"] if d else ["-"] * 3)
            cells.append(f"{torch_s * 1e3:.2f} ms" if torch_s else "-")
            cells += [f"{torch_s / rows[n]['step_s']:.2f}" if torch_s and n in rows else "-" for n in devices]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        phased = [d for d in decode if d.get("phases_us")]
        kinds = list(dict.fromkeys(k for d in phased for k in d["phases_us"]))
        if kinds:
            lines += ["Where the megakernel's decode step goes (its task profile, the last profiled step: the step's "
                      "span, SCHEDULE's body (the previous step's end / plan / pool check / attention items and "
                      "embeddings), and per kind the layer's phase, median over layers: span / gap before it, µs):",
                      "",
                      "| batch | prompts | step span | schedule | " + " | ".join(kinds) + " |",
                      "|---|---|---|---|" + "---|" * len(kinds)]
            for d in phased:
                ph = d["phases_us"]
                parts = " / ".join(f"{us:.0f}" for us in d.get("schedule_parts_us", {}).values())
                lines.append(f"| {d['batch']} | {d['context']} | {d['step_span_us']:.0f} | {d['schedule_us']:.0f}"
                             f"{f' ({parts})' if parts else ''} | " +
                             " | ".join(f"{ph[k].get('span_us', 0):.1f} / {ph[k].get('gap_us', 0):.1f}" if k in ph
                                        else "-" for k in kinds) + " |")
            lines.append("")
            lines += ["Each kind's body in parts (median over the step's tasks, µs; a linear kind's marks are warp 0's, "
                      "an attention task's its warp 0's first item's):", ""]
            for d in phased:
                for kind, named in d.get("body_parts_us", {}).items():
                    lines.append(f"- batch {d['batch']}, prompts {d['context']}, {kind}: " +
                                 ", ".join(f"{name} {us:.1f}" for name, us in named.items()))
            lines.append("")
        profiled = [d for d in decode if d.get("ops_us")]
        ops = sorted({op for d in profiled for op in d["ops_us"]},
                     key=lambda op: -max(d["ops_us"].get(op, 0.0) for d in profiled))
        if ops:
            lines += ["Where the GPU device's decode step time goes (GpuDevice.profile_ops: µs per step of each layer "
                      "op, all layers, in the replayed graph):", "",
                      "| batch | " + " | ".join(ops) + " | sum |", "|---|" + "---|" * (len(ops) + 1)]
            for d in profiled:
                us = d["ops_us"]
                lines.append(f"| {d['batch']} | " + " | ".join(f"{us.get(op, 0.0):.0f}" for op in ops) +
                             f" | {sum(us.values()):.0f} |")
            lines.append("")
    if result.get("runs"):
        def ms(v):
            return f"{v * 1e3:.1f} ms"

        order = list(dict.fromkeys(r["run"] for r in result["runs"]))
        lines += ["| run | device | requests | output tokens | wall | tokens/s | TTFT p50 | TTFT p99 | TPOT p50 | "
                  "TPOT p99 | short |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(result["runs"], key=lambda r: order.index(r["run"])):
            lines.append(f"| {r['run']} | {device_of(r)} | {r['requests']} | {r['output_tokens']} | "
                         f"{r['wall_s']:.1f} s | {r['output_tokens_per_s']:.0f} | {ms(r['ttft_p50_s'])} | {ms(r['ttft_p99_s'])} | "
                         f"{ms(r['tpot_p50_s'])} | {ms(r['tpot_p99_s'])} | {r['short']} |")
    if result.get("mixed"):
        lines += [""] if lines and lines[-1] else []
        lines += ["A prompt arriving while requests decode: the decoders' time per output token (their median, and "
                  "the worst decoder's) over the window before it arrives and while it is read, and its time to "
                  "first token:", "",
                  "| device | decoders | their prompts | prompt | steps | TPOT before | TPOT while read | worst | "
                  "ratio | worst ratio | prompt's TTFT |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["mixed"]:
            lines.append(f"| {r['device']} | {r['batch']} | {r['decode_prompt']} | {r['prompt']} | {r['steps']} | "
                         f"{r['tpot_before_s'] * 1e3:.2f} ms | {r['tpot_mixed_s'] * 1e3:.2f} ms | "
                         f"{r['tpot_mixed_worst_s'] * 1e3:.2f} ms | {r['ratio']:.2f} | {r['ratio_worst']:.2f} | "
                         f"{r['ttft_s'] * 1e3:.1f} ms |")
        for r in result["mixed"]:
            if r.get("ops_us"):
                lines += ["", f"Where a step that reads the prompt goes ({r['device']}, the prompt read again, µs a "
                          "step): " + ", ".join(f"{op} {us:.0f}" for op, us in r["ops_us"].items()) + "."]
    return "\n".join(lines)


def measure(device: str, folder: str, engine: dict, args, parts: set, points: list, requests: list,
            result: dict) -> None:
    """Parts `parts` of the benchmark on one device (an LLM over the checkpoint in `folder` with `engine`'s
    settings), into `result`: its decode rows, runs and launches."""
    import numpy as np

    from mdsl import LLM
    from mdsl.megakernel.runtime.models import MODELS
    from mdsl.serving.cpu import kv_bytes_per_token

    vocab = MODELS[args.model]["vocab_size"]
    print(f"== the {device} device", flush=True)
    llm = LLM(folder, device=device, **engine)
    try:
        with llm:
            graph = llm.device.graph
            weights = sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in graph.weights)
            per_token = kv_bytes_per_token(graph)         # (the GPU pools' bytes a position, in the weights' bf16)
            llm.submit([1, 2, 3], None).result()          # kernels compiled and loaded
            if "a" in parts:
                for batch, context in points:
                    first = (batch, context) == points[0]   # (a trace of the first point's last profiled step)
                    d = decode_steps(llm, device, batch, context, args.decode_tokens, vocab, args.seed,
                                     Path(args.out) / f"trace-{device}-b{batch}-c{context}.json" if first else None)
                    d["floor_s"] = (weights + batch * d["mean_context"] * per_token) / BANDWIDTH
                    result["decode"].append(d)
                    print(d, flush=True)
                    write(result, Path(args.out))   # (a run cut at its time limit keeps what it measured)
            if "b" in parts:
                result["runs"].append({"device": device,
                                       **summary("offline", run_requests(llm, requests, [0.0] * len(requests)))})
                print(result["runs"][-1], flush=True)
                write(result, Path(args.out))
            if "c" in parts:
                rng = np.random.default_rng(args.seed + 1)
                for rate in (float(r) for r in args.rates.split(",")):
                    arrivals = list(np.cumsum(rng.exponential(1.0 / rate, len(requests))))
                    result["runs"].append({"device": device, **summary(f"online {rate:g}/s",
                                                                        run_requests(llm, requests, arrivals))})
                    print(result["runs"][-1], flush=True)
                    write(result, Path(args.out))
            if "d" in parts:
                result.setdefault("mixed", []).append(
                    mixed_run(llm, device, args.mixed_batch, args.mixed_decode_prompt, args.mixed_prompt,
                              args.mixed_window, vocab, args.seed))
                print(result["mixed"][-1], flush=True)
                write(result, Path(args.out))
    finally:
        if device == "megakernel" and not llm.device.alive:
            llm.device.close()     # (its module and memory go now: the device stays referenced until exit)
    info = {"steps": llm.stats().steps}
    if device == "megakernel":   # read once the kernel has stopped
        info.update(launches=llm.device.launches, steps_per_launch=llm.device.kernel.steps_per_launch)
    else:
        info["replayed"] = llm.device.replays
    result["devices"][device] = info


def write(result: dict, out: Path) -> str:
    """serve.json and serve.md in `out`; the tables' text."""
    return write_outputs(out, "serve", result, tables(result))


def main(argv=None) -> int:
    from mdsl.errors import UnsupportedError
    from mdsl.megakernel.runtime.models import MODELS
    from mdsl.serving.protocol import DEFAULT_MAX_TOKENS_PER_STEP

    args = parse_args(argv)
    parts = set(args.parts.split(","))
    if "d" in parts and args.mixed_batch + 1 > args.max_batch:
        raise SystemExit(f"--mixed-batch {args.mixed_batch} and the arriving prompt need --max-batch of at least "
                         f"{args.mixed_batch + 1} (it is {args.max_batch})")
    if args.layers is not None and args.torch:
        raise SystemExit("--layers times a part of the model: pass --no-torch (PyTorch's step is the whole model's)")
    raw = MODELS[args.model]
    out = Path(args.out)
    result = {"meta": provenance("serve.py", sys.argv[1:] if argv is None else argv, gpu=True), "model": args.model,
              **({"layers": args.layers} if args.layers is not None else {}), "devices": {}, "decode": [], "runs": []}
    with scratch_folder("mdsl-weights-") as folder:
        print(f"writing random weights at {args.model}'s shapes", flush=True)
        random_checkpoint(args.model, folder, layers=args.layers)
        requests = workload(args, raw["vocab_size"])
        # (batch, prompt length) of each decode measurement: the batches at --context, batch 1 at the long ones
        points = [(int(b), args.context) for b in args.batches.split(",")] + \
                 [(1, int(c)) for c in args.long_contexts.split(",") if c]
        per_step = args.max_tokens_per_step or DEFAULT_MAX_TOKENS_PER_STEP
        spans = [(b, c + decode_budget(per_step, b, c, args.decode_tokens)) for b, c in points] if "a" in parts else []
        max_seq = max([s for _, s in spans] + [len(p) + n for p, n in requests])
        # pages for the most tokens any part holds at once (not every slot at max_seq: 64 x 32k would not fit)
        whole = [args.max_batch * max(len(p) + n for p, n in requests)] if parts & {"b", "c"} else []
        if "d" in parts:   # (d) the decoders to the end of their budget, and the arriving prompt
            mixed = args.mixed_decode_prompt + mixed_budget(per_step, args.mixed_batch, args.mixed_prompt,
                                                            args.mixed_window)
            spans.append((args.mixed_batch, mixed))
            whole.append(args.mixed_batch * mixed + args.mixed_prompt + 1)
            max_seq = max(max_seq, mixed, args.mixed_prompt + 1)
        held = max([b * s for b, s in spans] + whole)
        # (no prefix cache: the offline and online runs submit the same seeded prompts one run after another,
        # and each run reads them as prompts seen for the first time)
        engine = dict(max_batch=args.max_batch, max_seq=max_seq, max_tokens_per_step=per_step,
                      kv_pages=-(-held // PAGE_SIZE) + args.max_batch, page_size=PAGE_SIZE, prefix_caching=False)
        for device in args.device:
            result["devices"][device] = {"incomplete": INCOMPLETE}   # (until measure records its launches)
            try:
                measure(device, folder, engine, args, parts, points, requests, result)
            except UnsupportedError as e:
                result["devices"][device] = {"unsupported": str(e)}
                print(f"the {device} device cannot serve {args.model}: {e}", flush=True)
            gc.collect()    # (the device's memory goes back before the next device's or PyTorch's is made)
            write(result, out)
    baseline = torch_baseline(args.model) if args.torch and result["decode"] else None
    for (batch, _), rows in points_of(result["decode"]).items() if baseline is not None else ():
        context = int(round(sum(d["mean_context"] for d in rows.values()) / len(rows)))
        seconds = baseline(batch, context)
        for d in rows.values():
            d["torch_step_s"] = seconds
        print(f"PyTorch, batch {batch} at {context}: {seconds * 1e3:.2f} ms", flush=True)
    print(write(result, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

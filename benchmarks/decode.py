"""Decode latency of the megakernel next to a PyTorch kernel-per-op decode step under a CUDA graph, for
Llama-3.2-1B, Qwen3-0.6B and Qwen3-8B shapes (random bf16 weights made on the GPU, batch 1), at one or more
contexts (`--contexts`, default 1024), with the fraction of the bandwidth floor and one profiler trace; and,
asked for by name, Qwen3-30B-A3B's (`--models qwen3-30b-a3b`: a mixture of 128 experts, 8 a token, in each of its
48 layers; its floor counts the active weights, the router and the 8 picked experts' a layer, and PyTorch's step
routes as transformers' grouped_mm experts do, reading the picked experts' weights only).

    python3 benchmarks/decode.py --quick --out $OUT          # about 2-3 minutes on the H200
    python3 benchmarks/decode.py --models llama-3.2-1b --steps 128 --repeats 5
    python3 benchmarks/decode.py --models qwen3-8b,llama-3.2-1b --contexts 1024,32768
    python3 benchmarks/decode.py --models qwen3-30b-a3b --variants default --quick --out $OUT

A row is one model at one context C. The megakernel runs `steps` decode steps at positions C - 1, C, ...
in ONE launch (timed with CUDA events around the launch; its KV cache holds C + steps + 8 positions, those
before C - 1 zeros: the work is the same); its per-token latency is that time / steps. It is measured once
per runtime variant (`--variants`, the first one is the table's): "default" (the engine's defaults), and the
kept options' other values (VARIANTS: MegakernelOptions fields); the profiled model's step is profiled under
each, at every context (per task kind the body time, the scheduler's wait and the part of it the compute
warps sat idle; the trace file of the first variant at the first context only). Under --quick the variants
after the first run for the profiled model only. PyTorch runs one decode step at position C - 1 (SDPA over
static caches of C positions, enable_gqa) captured in a CUDA graph, replayed `steps` times between two
events. The floor of a row is the bytes one step at position C - 1 reads over 4.25 TB/s:
the weights (`DecoderShape.weight_bytes`) plus the KV cache's keys and values of C positions in every layer
(`kv_bytes`). --tp and --rank-of measure every context too (a rank's floor: its shard's weights and KV heads).
Each model is independent, and each of its contexts: a failure is printed with its traceback and the others
still run (a failure of PyTorch's step keeps the row's megakernel numbers); the exit status is 1 when any
failed. A model's random weights are made once for all its contexts and freed before the next model's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

if str(Path(__file__).resolve().parent.parent) not in sys.path:   # run as a script from anywhere, with or without mdsl installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COPY_BANDWIDTH = 4.25e12     # bytes/s, device-to-device copy on the H200 (mdsl.search.cost.H200)
CONTEXT = 1024               # --contexts' default
VARIANTS = {   # the megakernel runtime's variants: MegakernelOptions fields
    "default": {},
    # attention's cached rows streamed through a ring of shared memory instead of preloaded whole
    "no-preload": {"attention_preload": False},
    # a linear task's whole first pass of weight loads with its input row (a rank's default), or none (one GPU's)
    "weights-first": {"weights_first": 1.0},
    "weights-after": {"weights_first": 0.0},
    # the early o-proj's second pass of weight loads in flight too (a rank's default), or no second pass (one GPU's)
    "second-pass-oproj": {"second_pass_kinds": ("oproj",)},
    "no-second-pass": {"second_pass_kinds": ()},
    # 32 attention splits of at least 32 positions (a rank of Qwen3-8B's default), or 16 of at least 64
    # (one GPU's, with 8 kv heads)
    "splits32": {"attention_splits": 32, "attention_min_chunk": 32},
    "splits16": {"attention_splits": 16, "attention_min_chunk": 64},
}


def parse_args(argv=None) -> argparse.Namespace:
    from mdsl.megakernel.runtime.models import MODELS, MOE_MODELS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, of {', '.join(MODELS)} (the default) and {', '.join(MOE_MODELS)}")
    ap.add_argument("--steps", type=int, default=128, help="decode steps per timed launch / graph replays")
    ap.add_argument("--repeats", type=int, default=5, help="timed launches per contender (median reported)")
    ap.add_argument("--quick", action="store_true",
                    help="32 steps, 2 repeats, the variants after the first only for the profiled model")
    ap.add_argument("--contexts", default=str(CONTEXT),
                    help="comma-separated contexts: a row per model and context, its timed steps from position "
                         "context - 1 on and its floor counting the KV bytes of context positions (also under --tp "
                         "and --rank-of; the profiled model's trace file at the first context only)")
    ap.add_argument("--trace-model", default="llama-3.2-1b", help="the model whose step is profiled")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated runtime variants, of {', '.join(VARIANTS)} (the first one is the table's)")
    ap.add_argument("--tp", type=int, default=1,
                    help="also run the --tp-models over this many GPUs (tensor parallelism, one process per GPU) and "
                         "report the latency next to one GPU's, with a trace of every rank")
    ap.add_argument("--tp-models", default="qwen3-8b", help="comma-separated models run tensor-parallel under --tp")
    ap.add_argument("--tp-variants", default="", help="comma-separated runtime variants of the --tp runs (default: the "
                                                     "first of --variants); each also runs on one GPU")
    ap.add_argument("--rank-of", type=int, default=1,
                    help="run each model on one GPU with the shapes of one rank of this many (its shard: 1/N of the "
                         "heads, MLP columns and vocabulary) and a rank's defaults (MegakernelOptions.for_world): a rank's kernel "
                         "without its all-reduces, to measure a rank-local change where N GPUs are not at hand (no "
                         "PyTorch contender: a shard is not a model)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for results.json and the trace")
    args = ap.parse_args(argv)
    if args.rank_of < 1 or (args.rank_of > 1 and args.tp > 1):
        ap.error(f"--rank-of {args.rank_of} with --tp {args.tp}: --rank-of takes a world size above 1 and runs on one GPU")
    if args.quick:
        args.steps, args.repeats = 32, 2
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.tp_models = [m.strip() for m in args.tp_models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in {**MODELS, **MOE_MODELS}]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {', '.join({**MODELS, **MOE_MODELS})}")
    args.variants = [s.strip() for s in args.variants.split(",") if s.strip()]
    if not args.variants or any(s not in VARIANTS for s in args.variants):
        ap.error(f"--variants takes some of {', '.join(VARIANTS)}, got {args.variants}")
    args.tp_variants = [s.strip() for s in args.tp_variants.split(",") if s.strip()] or args.variants[:1]
    if any(v not in VARIANTS for v in args.tp_variants):
        ap.error(f"--tp-variants takes some of {', '.join(VARIANTS)}, got {args.tp_variants}")
    try:
        args.contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--contexts takes comma-separated whole numbers, got {args.contexts!r}")
    if not args.contexts or min(args.contexts) < 1 or len(set(args.contexts)) < len(args.contexts):
        ap.error(f"--contexts takes distinct positive contexts, got {args.contexts}")
    for name in args.models:
        last, positions = max(args.contexts) + args.steps - 2, {**MODELS, **MOE_MODELS}[name]["max_position_embeddings"]
        if last >= positions:
            ap.error(f"context {max(args.contexts)} and {args.steps} steps reach position {last}, past {name}'s "
                     f"{positions} positions (max_position_embeddings)")
    return args


def kv_bytes(shape, context: int) -> int:
    """Bytes of the KV cache that a decode step at position `context` - 1 reads: the keys and values of
    `context` positions in every layer, in the model's dtype (a shard's shape: one rank's KV heads)."""
    return context * shape.layers * 2 * shape.kv_heads * shape.head_dim * shape.dtype.itemsize


def floor_seconds(shape, context: int) -> float:
    """The bandwidth floor of one decode step at position `context` - 1: its weight and KV bytes over the
    H200's copy rate."""
    return (shape.weight_bytes() + kv_bytes(shape, context)) / COPY_BANDWIDTH


def tagged(name: str, context: int, args) -> str:
    """A model's name in the printed lines, with the context where more than one is measured."""
    return name if len(args.contexts) == 1 else f"{name} @ {context}"


def random_weights(torch, config, device: str = "cuda") -> dict:
    """bf16 weights named as in the checkpoints: matrices N(0, 0.02^2), norms near 1; on the GPU."""
    from mdsl.megakernel.runtime.megakernel_engine import weight_names

    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = {"q_proj": (config.num_heads * d, h), "k_proj": (config.num_kv_heads * d, h),
              "v_proj": (config.num_kv_heads * d, h), "o_proj": (h, config.num_heads * d), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i), "input_layernorm": (h,), "post_attention_layernorm": (h,),
              "q_norm": (d,), "k_norm": (d,), "embed_tokens": (config.vocab_size, h), "norm": (h,),
              "lm_head": (config.vocab_size, h)}
    generator = torch.Generator(device=device).manual_seed(0)
    weights = {}
    if config.num_experts:
        weights.update(random_experts(torch, config, generator, device))
        shapes["gate"] = (config.num_experts, h)   # the router
    for name in weight_names(config):
        if name in weights:
            continue
        shape = shapes[name.rsplit(".", 2)[-2]]
        if len(shape) == 1:
            w = 1.0 + 0.1 * torch.randn(shape, device=device, generator=generator)
        else:
            w = 0.02 * torch.randn(shape, device=device, generator=generator)
        weights[name] = w.to(torch.bfloat16)
    return weights


def random_experts(torch, config, generator, device: str) -> dict:
    """A mixture of experts' weights, N(0, 0.02^2), per sparse layer stacked as transformers 5 holds them
    (`mlp.experts.gate_up_proj` [E, 2 MI, H], `mlp.experts.down_proj` [E, H, MI]: PyTorch's grouped_mm step reads
    them), and each expert's gate, up and down weight as the checkpoints name them: views of the stacked ones."""
    e, mi, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    weights = {}
    for layer in range(config.num_layers):
        if not config.sparse(layer):
            continue
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = (0.02 * torch.randn((e, 2 * mi, h), device=device, generator=generator)).to(torch.bfloat16)
        down = (0.02 * torch.randn((e, h, mi), device=device, generator=generator)).to(torch.bfloat16)
        weights[p + "gate_up_proj"], weights[p + "down_proj"] = gate_up, down
        for x in range(e):
            weights[f"{p}{x}.gate_proj.weight"], weights[f"{p}{x}.up_proj.weight"] = gate_up[x, :mi], gate_up[x, mi:]
            weights[f"{p}{x}.down_proj.weight"] = down[x]
    return weights


def random_rank_weights(config, rank: int) -> dict:
    """A tensor-parallel rank's random shard (`config` is the shard's), made on its GPU."""
    import torch

    torch.cuda.set_device(rank)
    weights = random_weights(torch, config, device=f"cuda:{rank}")
    torch.cuda.synchronize()
    return weights


KIND_COLOURS = {"qkv": "#4c72b0", "attn": "#dd8452", "oproj": "#55a868", "gateup": "#8172b3", "down": "#c44e52",
                "lmhead": "#da8bc3", "sample": "#8c8c8c"}


def plot_rank_timeline(path: Path, per_rank: list, info: dict, layer: int, step: int = 1) -> None:
    """Every SM of every rank over one layer of one step (on rank 0's clock: profile.align_ranks): bodies
    coloured by kind (hatched: the tile puts to the peers when done), the scheduler's waits for peers'
    tiles as thin grey bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mdsl.megakernel.runtime.profile import align_ranks

    n, labels, kinds, peers = info["tasks_per_step"], info["labels"], info["kinds"], info["peers"]
    per_rank = align_ranks(per_rank, n)
    mine = {k for k, label in enumerate(labels) if f" L{layer} " in label}
    chosen = [[r for r in records if r.index // n == step and r.index % n in mine] for records in per_rank]
    origin = min(r.taken_ns for records in chosen for r in records)
    fig, axes = plt.subplots(len(per_rank), 1, figsize=(12, 3 + 1.5 * len(per_rank)), sharex=True)
    for rank, (ax, records) in enumerate(zip(axes, chosen)):
        for r in records:
            task = r.index % n
            if peers[task][0] and r.ready_ns > r.taken_ns:
                ax.barh(r.sm, (r.ready_ns - r.taken_ns) / 1e3, left=(r.taken_ns - origin) / 1e3, height=0.25,
                        color="#bbbbbb")
            ax.barh(r.sm, (r.done_ns - r.started_ns) / 1e3, left=(r.started_ns - origin) / 1e3, height=0.8,
                    color=KIND_COLOURS.get(kinds[task], "k"), hatch="///" if peers[task][1] else None,
                    edgecolor="white" if peers[task][1] else None, linewidth=0)
        ax.set_ylabel(f"rank {rank}: SM")
        ax.invert_yaxis()
    axes[-1].set_xlabel(f"µs (layer {layer} of step {step})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLOURS.values()]
    handles += [plt.Rectangle((0, 0), 1, 1, facecolor="#999999", hatch="///", edgecolor="white"),
                plt.Rectangle((0, 0), 1, 1, color="#bbbbbb")]
    axes[0].legend(handles, [*KIND_COLOURS, "puts to peers when done", "waits for peers' tiles"], ncol=5,
                   fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_tensor_parallel(config, name: str, args, out: Path, variant: str, context: int) -> dict:
    """The megakernel over args.tp GPUs (random bf16 shards made on each GPU) under a runtime variant at a
    context: per-token latency (the slowest rank's launch), each rank's fraction of its own floor (its
    shard's weight and KV bytes), and a profile of two steps on every rank (its trace files and timeline
    plot at the first context only)."""
    from mdsl.megakernel.parallel.gpu_group import RankSpec, TensorParallelGroup, shard_config
    from mdsl.megakernel.runtime.profile import (cross_rank_hops, idle_by_predecessor, layer_phases, peer_overlap,
                                                 summary, write_rank_traces)
    from mdsl.megakernel.runtime.shape import decoder_shape

    shard = decoder_shape(shard_config(config, args.tp))
    floor = floor_seconds(shard, context)
    spec = RankSpec(config, args.tp, make_weights=random_rank_weights, max_seq=context + args.steps + 8,
                    options=variant_options(variant))
    tag = tagged(name, context, args)
    t0 = time.perf_counter()
    with TensorParallelGroup(spec) as group:
        print(f"[{tag}] {args.tp} ranks ready in {time.perf_counter() - t0:.1f} s: {group.info[0]['tasks_per_step']} "
              f"tasks/step per rank, {shard.weight_bytes() / 1e9:.2f} GB of weights per rank", flush=True)
        tokens = [1] * context
        group.run(tokens, args.steps, start=context - 1, eos_token_ids=())   # warm-up
        samples = []
        for _ in range(args.repeats):
            runs = group.run(tokens, args.steps, start=context - 1, eos_token_ids=())
            if any(run.steps != args.steps for run in runs):
                raise RuntimeError(f"the ranks ran {[run.steps for run in runs]} steps, asked for {args.steps}")
            samples.append(max(run.seconds for run in runs) / args.steps)
        print(f"[{tag}] megakernel over {args.tp} GPUs ({variant}): {median(samples) * 1e3:.3f} ms/token "
              f"({[round(s * 1e3, 3) for s in samples]})", flush=True)   # before the profile: a cut run keeps it
        runs = group.run(tokens, 2, start=context - 1, eos_token_ids=(), profile=True)
        info = group.info[0]
        first = variant == args.tp_variants[0] and context == args.contexts[0]
        trace = out / f"trace_{name}_tp{args.tp}_{variant}.json.gz" if first else None
        if trace is not None:   # one trace (3-4 MB compressed for Qwen3-8B)
            write_rank_traces(str(trace), [run.profile for run in runs], info["labels"], info["kinds"], info["peers"])
        steps_us = [profile_step_us(run.profile, info["tasks_per_step"]) for run in runs]
        by_kind = [summary(run.profile, info["kinds"]) for run in runs]
        phases = [layer_phases(run.profile, info["kinds"], info["layers"], step=1) for run in runs]
        idle = [idle_json(idle_by_predecessor(run.profile, info["kinds"], info["layers"], step=1)) for run in runs]
        overlap = [peer_overlap(run.profile, info["tasks_per_step"], info["peers"]) for run in runs]
        hops = cross_rank_hops([run.profile for run in runs], info["kinds"], info["layers"], step=1)
        for rank, kinds in enumerate(by_kind):
            print(f"[{tag}] rank {rank} profile (2 steps):\n{phase_table(kinds)}\n{layer_table(phases[rank], kinds)}\n"
                  f"{idle_table(idle[rank])}\n[{tag}] rank {rank} communication: {overlap[rank]}", flush=True)
        print(f"[{tag}] all-reduce hops, a rank's last producer to a peer's first reader (µs, an upper bound: "
              f"profile.cross_rank_hops): {hops}", flush=True)
        if trace is not None:
            try:
                plot_rank_timeline(out / f"tp_timeline_{name}.png", [run.profile for run in runs], info,
                                   layer=config.num_layers // 2)
            except ImportError:
                print("(no matplotlib: no timeline plot)", flush=True)
    ms = median(samples) * 1e3
    print(f"[{tag}] {args.tp} GPUs ({variant}): profiled steps per rank {steps_us} µs; trace {trace or '-'}",
          flush=True)
    return {"world": args.tp, "megakernel_ms": ms, "samples_ms": [s * 1e3 for s in samples],
            "rank_weight_bytes": shard.weight_bytes(), "rank_kv_bytes": kv_bytes(shard, context),
            "rank_floor_ms": floor * 1e3,
            "fraction_of_rank_floor": floor / median(samples), "profiled_steps_us": steps_us, "trace": str(trace) if trace else None,
            "profile_by_kind": by_kind, "layer_phases": phases, "communication": overlap, "all_reduce_hops": hops,
            "idle_by_predecessor": idle}


def torch_decode_step(torch, config, weights, position: int, device: str = "cuda", batch: int = 1):
    """A plain kernel-per-op decode step (the PyTorch baseline) of `batch` sequences at `position`, with
    static KV caches [batch, kv heads, position + 1, head dim]: step(tokens [batch]) -> next tokens."""
    import torch.nn.functional as F

    c = config
    hq, hkv, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
    from mdsl.megakernel.runtime.shape import decoder_shape, rope_tables

    cos, sin = rope_tables(decoder_shape(c), position + 1)
    cos = torch.tensor(cos[position], device=device).repeat(2).to(torch.bfloat16)
    sin = torch.tensor(sin[position], device=device).repeat(2).to(torch.bfloat16)
    caches = [(torch.randn(batch, hkv, position + 1, d, device=device, dtype=torch.bfloat16),
               torch.randn(batch, hkv, position + 1, d, device=device, dtype=torch.bfloat16)) for _ in range(c.num_layers)]
    w = weights
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]

    def norm(x, weight):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rope(x):
        half = d // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def experts(n, p):
        """transformers' Qwen3MoeSparseMoeBlock with its grouped_mm experts (capturable: no host sync): softmax and
        top-k in f32, the picked (token, expert) pairs sorted by expert, two grouped GEMMs that read the picked
        experts' weights only, the weighted outputs summed per token."""
        k, e = c.experts_per_token, c.num_experts
        probs = torch.softmax(F.linear(n, w[p + "mlp.gate.weight"]), dim=-1, dtype=torch.float)
        top, ids = torch.topk(probs, k, dim=-1)
        if c.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        flat, perm = torch.sort(ids.reshape(-1))
        offsets = torch.cumsum(torch.histc(flat.int(), bins=e, min=0, max=e - 1), dim=0, dtype=torch.int32)
        picked = n[perm // k]
        gate_up = torch._grouped_mm(picked, w[p + "mlp.experts.gate_up_proj"].transpose(-2, -1), offs=offsets)
        g, u = gate_up.chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(g) * u, w[p + "mlp.experts.down_proj"].transpose(-2, -1), offs=offsets)
        out = out * top.to(n.dtype).reshape(-1)[perm, None]
        return out[torch.argsort(perm)].view(batch, k, -1).sum(dim=1)

    def step(token):
        x = w["model.embed_tokens.weight"][token]                       # [batch, H]
        for layer in range(c.num_layers):
            p = f"model.layers.{layer}."
            n = norm(x, w[p + "input_layernorm.weight"])
            q = F.linear(n, w[p + "self_attn.q_proj.weight"]).view(batch, hq, 1, d)
            k = F.linear(n, w[p + "self_attn.k_proj.weight"]).view(batch, hkv, 1, d)
            v = F.linear(n, w[p + "self_attn.v_proj.weight"]).view(batch, hkv, 1, d)
            if c.qk_norm:
                q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
            q, k = rope(q), rope(k)
            k_cache, v_cache = caches[layer]
            k_cache[:, :, position:position + 1] = k
            v_cache[:, :, position:position + 1] = v
            a = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True).reshape(batch, hq * d)
            x = x + F.linear(a, w[p + "self_attn.o_proj.weight"])
            n = norm(x, w[p + "post_attention_layernorm.weight"])
            if c.sparse(layer):
                x = x + experts(n, p)
                continue
            g = F.linear(n, w[p + "mlp.gate_proj.weight"])
            u = F.linear(n, w[p + "mlp.up_proj.weight"])
            x = x + F.linear(F.silu(g) * u, w[p + "mlp.down_proj.weight"])
        logits = F.linear(norm(x, w["model.norm.weight"]), head)
        return logits.argmax(-1)

    return step


def time_torch_graph(torch, step, steps: int, repeats: int, batch: int = 1) -> list:
    token = torch.zeros(batch, dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step(token)                     # warm-up (cuBLAS handles, SDPA kernel choice)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(token)
    del out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / steps)
    return samples


def time_megakernel(engine, steps: int, repeats: int, context: int) -> list:
    tokens = [1] * context        # positions 0 .. context - 2 are "in the cache"; the launch starts at context - 1
    engine.run(tokens, steps, start=context - 1, eos_token_ids=())   # warm-up
    samples = []
    for _ in range(repeats):
        run = engine.run(tokens, steps, start=context - 1, eos_token_ids=())
        if run.steps != steps:
            raise RuntimeError(f"the megakernel ran {run.steps} steps, asked for {steps}")
        samples.append(run.seconds / steps)
    return samples


def profile_step(engine, out: Path, name: str, variant: str, trace: bool, context: int) -> dict:
    """Two profiled steps from position `context` - 1: per task kind the body, wait and exposed-wait times
    (µs summed over SMs), and the trace file when `trace`."""
    from mdsl.megakernel.runtime.profile import idle_by_predecessor, layer_phases, summary, write_trace

    run = engine.run([1] * context, 2, start=context - 1, eos_token_ids=(), profile=True)
    plan = engine.plan
    labels, kinds = [t.label() for t in plan.tasks], [t.kind.name.lower() for t in plan.tasks]
    result = {"tasks": len(run.profile), "step_us": profile_step_us(run.profile, len(plan.tasks)),
              "by_kind": summary(run.profile, kinds),
              "layer_phases": layer_phases(run.profile, kinds, [t.layer for t in plan.tasks], step=1),
              "idle_by_predecessor": idle_json(idle_by_predecessor(run.profile, kinds, [t.layer for t in plan.tasks],
                                                                   step=1))}
    if trace:
        path = out / f"trace_{name}_{variant}.json"
        write_trace(str(path), run.profile, labels, kinds)
        result["trace"] = str(path)
    return result


def profile_step_us(records, per_step: int) -> list:
    """Per step of a profile: first task taken to last body done, in µs."""
    steps: dict = {}
    for r in records:
        lo, hi = steps.get(r.index // per_step, (r.taken_ns, r.done_ns))
        steps[r.index // per_step] = (min(lo, r.taken_ns), max(hi, r.done_ns))
    return [round((hi - lo) / 1e3, 1) for _, (lo, hi) in sorted(steps.items())]


def phase_table(by_kind: dict) -> str:
    """The profile's per-kind times (ms summed over all SMs): body, wait, exposed wait (compute idle)."""
    lines = ["| kind | tasks | body ms | wait ms | exposed wait ms | ready, queued ms |", "|---|---|---|---|---|---|"]
    for kind, k in by_kind.items():
        lines.append(f"| {kind} | {k['tasks']} | {k['body_ns'] / 1e6:.2f} | {k['wait_ns'] / 1e6:.2f} | "
                     f"{k['exposed_wait_ns'] / 1e6:.2f} | {k['queued_ns'] / 1e6:.2f} |")
    return "\n".join(lines)


def layer_table(phases: dict, by_kind: dict) -> str:
    """One layer of step 1 (layer_phases: medians over the layers, µs) and each kind's body parts (the
    share of its body time, summed over the SMs, between the body's marks)."""
    lines = ["| phase | span µs | median body µs | gap before µs | body parts |", "|---|---|---|---|---|"]
    for kind, phase in phases.items():
        parts = by_kind.get(kind, {}).get("parts_ns", {})
        total = sum(parts.values())
        shares = ", ".join(f"{part} {ns / total:.0%}" for part, ns in parts.items()) if total else ""
        body, gap = (f"{phase[key]:.1f}" if key in phase else "-" for key in ("body_us", "gap_us"))
        lines.append(f"| {kind} | {phase['span_us']:.1f} | {body} | {gap} | {shares} |")
    return "\n".join(lines)


def idle_json(idle: dict) -> dict:
    """profile.idle_by_predecessor's (kind, previous kind) keys as "kind after previous" (JSON keys)."""
    return {f"{kind} after {before}": row for (kind, before), row in idle.items()}


def idle_table(idle: dict) -> str:
    """Where an SM's compute warps wait (`idle_json` of profile.idle_by_predecessor; µs, medians over step
    1's layers): by the kind of the body before on the same SM, the idle time before the body starts."""
    lines = ["| body | after | tasks | median body µs | median idle before µs |", "|---|---|---|---|---|"]
    for key, row in idle.items():
        kind, before = key.split(" after ")
        lines.append(f"| {kind} | {before} | {row['tasks']} | {row['body_us']:.2f} | {row['idle_before_us']:.2f} |")
    return "\n".join(lines)


def median(values: list) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def variant_options(variant: str, world: int = 1):
    """A variant's MegakernelOptions, with the defaults of `world` ranks where it leaves them open (a rank's
    shapes on one GPU, --rank-of, take a rank's defaults, which one GPU's would not)."""
    from mdsl.megakernel.runtime.megakernel_options import MegakernelOptions

    return MegakernelOptions(**VARIANTS[variant]).for_world(world)


def bench_variant(engine_class, config, weights, variant: str, name: str, args, out: Path, context: int) -> dict:
    """One variant's engine at a context: its per-token latency and, for the profiled model, its profile."""
    from mdsl.megakernel.runtime.shape import decoder_shape

    floor, tag = floor_seconds(decoder_shape(config), context), tagged(name, context, args)
    t0 = time.perf_counter()
    engine = engine_class(config, weights, options=variant_options(variant, args.rank_of),
                          max_seq=context + args.steps + 8)
    print(f"[{tag}] engine ({variant}: plan {len(engine.plan.tasks)} tasks/step, {engine.workers} workers, "
          f"compile, upload) in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        mk = time_megakernel(engine, args.steps, args.repeats, context)
        print(f"[{tag}] megakernel ({variant}): {median(mk) * 1e3:.3f} ms/token "
              f"({[round(s * 1e3, 3) for s in mk]})", flush=True)
        measured = {"megakernel_ms": median(mk) * 1e3, "megakernel_samples_ms": [s * 1e3 for s in mk],
                    "megakernel_fraction_of_floor": floor / median(mk), "tasks_per_step": len(engine.plan.tasks),
                    "workers": engine.workers, "registers": engine.module.resources["mdsl_megakernel"].registers,
                    "smem_bytes": engine.smem_bytes}
        if name == args.trace_model:
            trace = variant == args.variants[0] and context == args.contexts[0]
            measured["profile"] = profile_step(engine, out, name, variant, trace, context)
            print(f"[{tag}] profile ({variant}): steps {measured['profile']['step_us']} µs\n"
                  f"{phase_table(measured['profile']['by_kind'])}\n"
                  f"{layer_table(measured['profile']['layer_phases'], measured['profile']['by_kind'])}\n"
                  f"{idle_table(measured['profile']['idle_by_predecessor'])}", flush=True)
        return measured
    finally:
        engine.close()


def variants_of(name: str, args) -> list:
    """The runtime variants measured for a model: all of them, or under --quick the first one only, but
    for the profiled model (so that the extra variants cost two engine builds of the smallest model);
    a model run tensor-parallel also under each of its --tp-variants (one GPU against N in the same run)."""
    chosen = args.variants if not args.quick or name == args.trace_model else args.variants[:1]
    if args.tp > 1 and name in args.tp_models:
        chosen = chosen + [v for v in args.tp_variants if v not in chosen]
    return chosen


def failed_row(name: str, context: int, e: BaseException) -> dict:
    return {"model": name, "context": context, "error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}


def bench_model(torch, name: str, args, out: Path):
    """A model's rows, one per context of args.contexts, each yielded once measured on one GPU (a
    context's failure is its row's error; the other contexts still run). Its random weights are made once
    and freed before the tensor-parallel runs of --tp, which add to the rows already yielded."""
    import attrs

    from mdsl.ir.dtypes import bf16
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    from mdsl.megakernel.runtime.megakernel_engine import MegakernelEngine
    from mdsl.megakernel.runtime.models import MODELS, MOE_MODELS
    from mdsl.megakernel.runtime.shape import decoder_shape

    config = attrs.evolve(config_from_dict({**MODELS, **MOE_MODELS}[name]), dtype=bf16)
    if args.rank_of > 1:
        from mdsl.megakernel.parallel.gpu_group import shard_config
        config = shard_config(config, args.rank_of)
    shape = decoder_shape(config)
    t0 = time.perf_counter()
    weights = random_weights(torch, config)
    torch.cuda.synchronize()
    print(f"[{name}] weights {shape.weight_bytes() / 1e9:.2f} GB made in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    try:
        for context in args.contexts:
            try:
                rows.append(bench_context(torch, MegakernelEngine, config, shape, weights, name, context, args, out))
            except Exception as e:   # one context's failure must not hide the others' numbers
                traceback.print_exc()
                rows.append(failed_row(name, context, e))
            torch.cuda.empty_cache()
            yield rows[-1]
    finally:
        del weights
        torch.cuda.empty_cache()
    if args.tp > 1 and name in args.tp_models:
        for row in rows:
            if "error" not in row:
                bench_tensor_parallel_row(row, config, name, args, out)


def bench_context(torch, engine_class, config, shape, weights, name: str, context: int, args, out: Path) -> dict:
    """One row: the megakernel under each variant of the model and PyTorch's step (not for --rank-of: a
    shard is not a model) at one context."""
    floor, tag = floor_seconds(shape, context), tagged(name, context, args)
    result = {"model": name, "context": context, "weight_bytes": shape.weight_bytes(),
              "kv_bytes": kv_bytes(shape, context), "floor_ms": floor * 1e3, "variants": {}}
    if args.rank_of > 1:
        result["rank_of"] = args.rank_of
    for variant in variants_of(name, args):
        try:
            measured = bench_variant(engine_class, config, weights, variant, name, args, out, context)
        except Exception as e:   # a later variant's failure keeps the first one's numbers
            if variant == args.variants[0]:
                raise
            traceback.print_exc()
            measured = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
        result["variants"][variant] = measured
        if variant == args.variants[0]:
            result.update({k: v for k, v in measured.items() if k != "profile"}, variant=variant)
    if args.rank_of > 1:
        return result
    try:
        pt = time_torch(torch, config, weights, context, args)
    except Exception as e:   # the megakernel's numbers stay; the row counts as failed
        traceback.print_exc()
        result["torch_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        return result
    result.update(torch_graph_ms=median(pt) * 1e3, torch_graph_samples_ms=[s * 1e3 for s in pt],
                  torch_fraction_of_floor=floor / median(pt),
                  speedup_vs_torch_graph=median(pt) * 1e3 / result["megakernel_ms"])
    print(f"[{tag}] PyTorch + CUDA graph: {median(pt) * 1e3:.3f} ms/token", flush=True)
    return result


def time_torch(torch, config, weights, context: int, args) -> list:
    """PyTorch's step at position `context` - 1 under a CUDA graph (time_torch_graph), its static caches
    freed after."""
    step = torch_decode_step(torch, config, weights, context - 1)
    try:
        return time_torch_graph(torch, step, args.steps, args.repeats)
    finally:
        del step   # its caches: as large as the megakernel's at a long context
        torch.cuda.empty_cache()


def bench_tensor_parallel_row(result: dict, config, name: str, args, out: Path) -> None:
    """The --tp runs of a row's model at its context, against one GPU under each variant."""
    context, tag = result["context"], tagged(name, result["context"], args)
    result["tensor_parallel"] = {}
    for variant in args.tp_variants:   # against one GPU under the same variant
        try:
            tp = bench_tensor_parallel(config, name, args, out, variant, context)
        except Exception as e:   # (a variant the ranks cannot build: the other variants still run)
            traceback.print_exc()
            result["tensor_parallel"][variant] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
            print(f"[{tag}] {args.tp} GPUs ({variant}) failed", flush=True)
            continue
        one = result["variants"][variant].get("megakernel_ms")
        tp["one_gpu_ms"], tp["one_gpu_variant"] = one, variant
        tp["ratio_to_one_gpu"] = tp["megakernel_ms"] / one if one else None
        result["tensor_parallel"][variant] = tp
        print(f"[{tag}] {args.tp} GPUs / 1 GPU ({variant}): {tp['megakernel_ms']:.3f} / {one:.3f} ms = "
              f"{tp['ratio_to_one_gpu']:.3f}" if one else f"[{tag}] one GPU failed under {variant}", flush=True)
    best = best_ratio(result)
    if best is not None:   # the one that counts: the fastest N GPUs against the fastest one GPU of the run
        result["tensor_parallel_best"] = best
        print(f"[{tag}] fastest {args.tp} GPUs / fastest 1 GPU of this run: {best['tp_variant']} "
              f"{best['tp_ms']:.3f} / {best['one_gpu_variant']} {best['one_gpu_ms']:.3f} ms = {best['ratio']:.3f}",
              flush=True)


def best_ratio(result: dict) -> Optional[dict]:
    """The fastest tensor-parallel variant of a model's results against its fastest one-GPU variant (a
    variant's own ratio divides by one GPU under that variant, which may be a slow one-GPU choice)."""
    ones = {v: m["megakernel_ms"] for v, m in result["variants"].items() if m.get("megakernel_ms")}
    tps = {v: m["megakernel_ms"] for v, m in result.get("tensor_parallel", {}).items() if m.get("megakernel_ms")}
    if not ones or not tps:
        return None
    one, tp = min(ones, key=ones.get), min(tps, key=tps.get)
    return {"tp_variant": tp, "tp_ms": tps[tp], "one_gpu_variant": one, "one_gpu_ms": ones[one],
            "ratio": tps[tp] / ones[one]}


def contexts_of(results: list) -> list:
    """The contexts of the rows, in their order (a row without one: CONTEXT's)."""
    return list(dict.fromkeys(r.get("context", CONTEXT) for r in results))


def table(results: list) -> str:
    """A row per model and context; a context column where the rows have more than one context, else the
    context in the header. Floor: weights plus the KV bytes of the context (floor_seconds)."""
    contexts = contexts_of(results)
    many = len(contexts) > 1
    first = "| model (bf16, batch 1) | context |" if many else f"| model (bf16, batch 1, context {contexts[0]}) |"
    lines = [first + " weights | floor (weights + KV) | megakernel | % of floor | PyTorch + CUDA graph | % of floor "
             "| speed-up |", "|---|" + "---|" * (8 if many else 7)]
    for r in results:
        first = f"| {r['model']} |" + (f" {r.get('context', CONTEXT)} |" if many else "")
        if "error" in r:
            lines.append(f"{first} failed: {r['error']} | | | | | | |")
            continue
        torch_ms = r.get("torch_graph_ms")
        lines.append(f"{first} {r['weight_bytes'] / 1e9:.2f} GB | {r['floor_ms']:.3f} ms | "
                     f"{r['megakernel_ms']:.3f} ms | {100 * r['megakernel_fraction_of_floor']:.0f}% | "
                     + (f"{torch_ms:.3f} ms | {100 * r['torch_fraction_of_floor']:.0f}% | "
                        f"{r['speedup_vs_torch_graph']:.2f}x |" if torch_ms else "- | - | - |"))
    return "\n".join(lines)


def variant_table(results: list) -> str:
    """Per model (and context, where more than one), the megakernel's ms/token and fraction of the floor
    under each runtime variant measured."""
    names = [v for v in VARIANTS if any(v in r.get("variants", {}) for r in results)]
    many = len(contexts_of(results)) > 1
    lines = ["| model | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in results:
        cells = []
        for name in names:
            m = r.get("variants", {}).get(name)
            cells.append("-" if m is None else f"failed: {m['error']}" if "error" in m else
                         f"{m['megakernel_ms']:.3f} ms ({100 * m['megakernel_fraction_of_floor']:.0f}%)")
        label = f"{r['model']} @ {r.get('context', CONTEXT)}" if many else r["model"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mdsl.backend.cuda.runtime import has_gpu

    if not has_gpu():
        print("benchmarks/decode.py needs an NVIDIA GPU (none found)", file=sys.stderr)
        return 1
    try:
        import torch
    except ImportError:
        print("benchmarks/decode.py needs torch (the PyTorch baseline and the random weights)", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("benchmarks/decode.py: torch cannot see the GPU that the CUDA driver reports", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, steps {args.steps}, repeats {args.repeats}, "
          f"contexts {args.contexts}", flush=True)
    from benchmarks.provenance import provenance

    meta = provenance("decode.py", sys.argv[1:] if argv is None else argv, gpu=True)
    meta.update(torch=torch.__version__, steps=args.steps, repeats=args.repeats, contexts=args.contexts,
                trace_model=args.trace_model)
    results = []

    def save():   # after each row: a run cut short keeps the rows measured
        (out / "decode_results.json").write_text(json.dumps({"schema": 1, "meta": meta, "models": results}, indent=2))

    failed = False
    for name in args.models:
        rows = []
        try:
            for row in bench_model(torch, name, args, out):
                rows.append(row)
                results.append(row)
                save()
        except Exception as e:   # (its weights not made: the other models still run)
            failed = True
            traceback.print_exc()
            missing = [failed_row(name, c, e) for c in args.contexts[len(rows):]]
            rows += missing
            results += missing
        torch.cuda.empty_cache()
        save()
        print(table(rows), flush=True)
    print(table(results))
    print(variant_table(results))
    return 1 if failed or any("error" in r or "torch_error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

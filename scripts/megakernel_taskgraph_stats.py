"""Task-graph statistics of full-size decode steps (no weights needed): tasks, events, waits and bytes per
task for the Llama-3.2-1B, Qwen3-0.6B and Qwen3-8B shapes (bf16), for the H200's 132 SMs. By default the
graph the GPU runtime runs: fused (mdsl.megakernel.taskgraph.layer_fusion), tiled as the device tiles, implied waits
dropped; `--unfused` adds the per-op task graph for comparison.

    .venv/bin/python scripts/megakernel_taskgraph_stats.py [--sms 132] [--positions 2048] [--models llama-3.2-1b]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.model_config import config_from_dict
from mdsl.megakernel.runtime.models import MODELS
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import attention_splits, device_partition
from mdsl.megakernel.taskgraph.layer_fusion import fuse
from mdsl.megakernel.taskgraph.partition import build_task_graph
from mdsl.megakernel.taskgraph.tasks import PartitionConfig, without_implied_waits


def task_graphs(config, sms: int, unfused: bool) -> dict:
    graph = step_function(config).trace(config)
    splits = attention_splits(decoder_shape(config), sms, config.max_positions)
    variants = {"fused": lambda: without_implied_waits(build_task_graph(fuse(graph), device_partition(sms, splits)))}
    if unfused:
        variants["unfused"] = lambda: build_task_graph(graph, PartitionConfig(num_sms=sms))
    out = {}
    for name, build in variants.items():
        start = time.perf_counter()
        out[name] = (build(), time.perf_counter() - start)
    return out


def per_kind(stats: dict) -> list:
    """(kind, tasks, mean bytes read, largest bytes read, mean bytes written) per task kind."""
    groups = defaultdict(list)
    for p in stats["per_task"]:
        groups[p["kind"]].append(p)
    return [(kind, len(ps), sum(p["bytes_read"] for p in ps) / len(ps), max(p["bytes_read"] for p in ps),
             sum(p["bytes_written"] for p in ps) / len(ps)) for kind, ps in sorted(groups.items())]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--positions", type=int, default=2048, help="KV cache length")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--unfused", action="store_true", help="also the unfused per-op task graph (slow)")
    args = ap.parse_args(argv)
    for name in args.models.split(","):
        config = config_from_dict(MODELS[name]).with_max_positions(args.positions)
        for variant, (graph, seconds) in task_graphs(config, args.sms, args.unfused).items():
            s = graph.stats()
            print(f"\n## {name}, {variant}: {s['tasks']} tasks, {s['events']} events, {s['waits']} waits, "
                  f"{len(graph.model.nodes)} ops; weights {s['weight_bytes'] / 1e9:.3f} GB, read per step "
                  f"{s['bytes_read_per_step'] / 1e9:.3f} GB (+ at most {s['dynamic_bytes_read_at_most'] / 1e6:.1f} MB "
                  f"of KV cache and token row), written {s['bytes_written_per_step'] / 1e6:.2f} MB; built in "
                  f"{seconds:.1f} s\n")
            print("| task kind | tasks | mean bytes read | largest bytes read | mean bytes written |")
            print("|---|---:|---:|---:|---:|")
            for kind, n, mean_read, most_read, mean_written in per_kind(s):
                print(f"| {kind} | {n} | {mean_read:,.0f} | {most_read:,} | {mean_written:,.0f} |")


if __name__ == "__main__":
    main()

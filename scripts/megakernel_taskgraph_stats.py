"""Task-graph statistics of full-size decode steps (no weights needed): tasks, events, waits and bytes
per step for the Llama-3.2-1B, Qwen3-0.6B and Qwen3-8B shapes (bf16), tiled for the H200's 132 SMs.

    .venv/bin/python scripts/megakernel_taskgraph_stats.py [--sms 132] [--positions 2048] [--models llama-3.2-1b]
"""
from __future__ import annotations

import argparse
import time

from mdsl.megakernel.architectures import step_function
from mdsl.megakernel.config import config_from_dict
from mdsl.megakernel.partition import build_task_graph
from mdsl.megakernel.taskgraph import PartitionConfig

_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "head_dim": 128, "num_key_value_heads": 8,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
SHAPES = {
    "llama-3.2-1b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
                     "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     "tie_word_embeddings": True, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"},
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": False},
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--positions", type=int, default=2048, help="KV cache length")
    ap.add_argument("--models", default=",".join(SHAPES))
    args = ap.parse_args(argv)
    print("| model | tasks | events | waits | weights (GB) | bytes read / step (GB) | written (MB) | "
          "largest task read (MB) | build (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        config = config_from_dict(SHAPES[name]).with_max_positions(args.positions)
        start = time.perf_counter()
        graph = build_task_graph(step_function(config).trace(config), PartitionConfig(num_sms=args.sms))
        seconds = time.perf_counter() - start
        s = graph.stats()
        largest = max(p["bytes_read"] for p in s["per_task"])
        print(f"| {name} | {s['tasks']} | {s['events']} | {s['waits']} | {s['weight_bytes'] / 1e9:.3f} | "
              f"{s['bytes_read_per_step'] / 1e9:.3f} | {s['bytes_written_per_step'] / 1e6:.2f} | "
              f"{largest / 1e6:.2f} | {seconds:.1f} |")
        kinds = ", ".join(f"{k} {n}" for k, n in s["tasks_per_kind"].items())
        print(f"|  | {kinds} |||||||")


if __name__ == "__main__":
    main()

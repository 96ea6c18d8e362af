"""A Llama-3 / Qwen3 decode step as a model graph and a task graph, run by the numpy reference forward
and by the CPU simulator of the megakernel runtime.

    python examples/megakernel/llama_decode.py                     # a tiny random Llama-3, made here
    python examples/megakernel/llama_decode.py --model DIR --prompt-ids 1,2,3 --new 16
    python examples/megakernel/llama_decode.py --dot model.dot --task-dot tasks.dot

DIR is a Hugging Face checkpoint folder (config.json and *.safetensors) of a LlamaForCausalLM or
Qwen3ForCausalLM model.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

import mdsl
from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.checkpoint import load_weights, random_weights, save_checkpoint
from mdsl.megakernel.modelgraph.model_config import config_from_dict, load_config
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.taskgraph.partition import build_task_graph
from mdsl.megakernel.taskgraph.simulator import Simulator
from mdsl.megakernel.taskgraph.tasks import PartitionConfig

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 64, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 16},
}


def make_tiny_checkpoint(folder: str) -> None:
    """A random tiny Llama-3 checkpoint written with mdsl's safetensors writer."""
    config = config_from_dict(TINY_LLAMA)
    graph = step_function(config).trace(config)
    save_checkpoint(folder, TINY_LLAMA, random_weights(graph, seed=0, scale=0.3))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Hugging Face checkpoint folder (default: a tiny random Llama-3)")
    ap.add_argument("--prompt-ids", default="1,7,42", help="comma-separated token ids")
    ap.add_argument("--new", type=int, default=8, help="tokens to generate")
    ap.add_argument("--sms", type=int, default=132, help="SMs the task graph is tiled for")
    ap.add_argument("--workers", type=int, default=8, help="simulated workers")
    ap.add_argument("--dot", help="write the model graph's DOT here")
    ap.add_argument("--task-dot", help="write the task graph's DOT here")
    args = ap.parse_args(argv)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or tmp
        if not args.model:
            make_tiny_checkpoint(folder)
        config = load_config(folder, max_positions=len(prompt) + args.new)
        graph = step_function(config).trace(config)
        weights = load_weights(graph, folder)
    print("\n".join(str(graph).splitlines()[:4] + ["  ..."] + str(graph).splitlines()[-6:]))
    task_graph = build_task_graph(graph, PartitionConfig(num_sms=args.sms))
    print(f"task graph for {args.sms} SMs: {task_graph.summary()}")
    for path, text in ((args.dot, graph.to_dot()), (args.task_dot, task_graph.to_dot())):
        if path:
            with open(path, "w") as f:
                f.write(text)
            print(f"wrote {os.path.abspath(path)}")
    reference = ReferenceModel(graph, weights).generate(prompt, args.new)
    simulated = Simulator(task_graph, weights).generate(prompt, args.new, workers=args.workers, seed=1)
    print(f"reference tokens: {list(reference.tokens)}")
    print(f"simulated tokens: {list(simulated.tokens)}")
    print(f"largest logit difference: {np.abs(reference.logits - simulated.logits).max():.3g}")
    if reference.tokens != simulated.tokens:
        raise mdsl.MdslError("the simulated megakernel and the reference forward disagree")


if __name__ == "__main__":
    main()

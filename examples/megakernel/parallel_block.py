"""A decoder architecture of the user's own, written in Python only: a parallel block (attention and MLP
read the same normalised input, their outputs are added to the residual together, as in GPT-J and PaLM),
GELU-gated MLP, rotary embeddings, grouped-query attention. It runs on the CPU simulator of the megakernel
and is checked against its numpy reference forward; the GPU megakernel's planner then says whether it can
run it, or which op (and line of the step function) it has no device body for yet.

    python examples/megakernel/parallel_block.py [--new 16] [--layers 2]
"""
from __future__ import annotations

import argparse

import numpy as np

import mdsl
from mdsl.megakernel.modelgraph.checkpoint import random_weights
from mdsl.megakernel.modelgraph.model_config import config_from_dict
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import plan_model
from mdsl.megakernel.taskgraph.partition import build_task_graph
from mdsl.megakernel.taskgraph.simulator import Simulator
from mdsl.megakernel.taskgraph.tasks import PartitionConfig

#: the model's dimensions, in a Hugging Face config's words (only the fields the step function reads)
CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": True,
          "torch_dtype": "float32"}


@mdsl.model(name="parallel_block")
def parallel_block(m, cfg):
    h, d = cfg.hidden_size, cfg.head_dim
    heads = {"q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": d}
    embed = m.weight("embed", [cfg.vocab_size, h])
    x = m.embedding(embed)
    for i in range(cfg.num_layers):
        def w(name, *shape):
            return m.weight(f"layers.{i}.{name}", list(shape))

        normed = m.rms_norm(x, w("norm", h), cfg.rms_norm_eps)    # one norm feeds both branches
        qkv = m.linear(normed, w("q", cfg.num_heads * d, h), w("k", cfg.num_kv_heads * d, h),
                       w("v", cfg.num_kv_heads * d, h))
        k_cache, v_cache = m.kv_cache(i, cfg.num_kv_heads, d)
        attn = m.attention(m.rope(qkv, **heads, **cfg.rope.attrs()), k_cache, v_cache, **heads)
        mlp = m.linear(m.act_mul(m.linear(normed, w("gate", cfg.intermediate_size, h),
                                          w("up", cfg.intermediate_size, h)), "gelu"),
                       w("down", h, cfg.intermediate_size))
        x = m.add(x, m.add(m.linear(attn, w("o", h, cfg.num_heads * d)), mlp))
    logits = m.linear(m.rms_norm(x, m.weight("final_norm", [h]), cfg.rms_norm_eps), embed)
    return logits, m.argmax(logits)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-ids", default="1,7,42", help="comma-separated token ids")
    ap.add_argument("--new", type=int, default=16, help="tokens to generate")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    config = config_from_dict({**CONFIG, "num_hidden_layers": args.layers}).with_max_positions(len(prompt) + args.new)
    graph = parallel_block.trace(config)
    weights = random_weights(graph, seed=0, scale=1.0)
    reference = ReferenceModel(graph, weights).generate(prompt, args.new)
    simulated = Simulator(build_task_graph(graph, PartitionConfig(num_sms=8)), weights).generate(
        prompt, args.new, workers=4, seed=1)
    print(f"reference tokens: {list(reference.tokens)}")
    print(f"simulated tokens: {list(simulated.tokens)}")
    print(f"largest logit difference: {np.abs(reference.logits - simulated.logits).max():.3g}")
    if reference.tokens != simulated.tokens:
        raise mdsl.MdslError("the simulated megakernel and the reference forward disagree")
    try:   # the GPU megakernel's planner: the graph lowered by its layer ops' device rules
        plan_model(graph, decoder_shape(config), workers=8, max_seq=config.max_positions)
        print("the GPU megakernel can run it: mdsl.megakernel.runtime.megakernel_engine.compile_model")
    except mdsl.MdslError as e:
        print(f"the GPU megakernel cannot run it yet:\n{e}")


if __name__ == "__main__":
    main()

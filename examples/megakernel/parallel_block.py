"""A decoder architecture of the user's own, written in Python only: a parallel block (attention and MLP
read the same normalised input, their outputs are added to the residual together, as in GPT-J and PaLM),
GELU-gated MLP, rotary embeddings, grouped-query attention, tied embeddings. It runs on the CPU simulator of
the megakernel and is checked against its numpy reference forward; the GPU megakernel's planner lowers it by
its layer ops' rules (weights bound by the part they play, not by name), and where there is a GPU the
megakernel runs it and its tokens are checked against the reference too.

    python examples/megakernel/parallel_block.py [--new 16] [--layers 2] [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse

import numpy as np

import mdsl
from mdsl.gpu import has_gpu
from mdsl.megakernel.modelgraph.checkpoint import random_weights
from mdsl.megakernel.modelgraph.model_config import config_from_dict
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.runtime.megakernel_engine import compile_model
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import check_plan, plan_model
from mdsl.megakernel.taskgraph.partition import build_task_graph
from mdsl.megakernel.taskgraph.simulator import Simulator
from mdsl.megakernel.taskgraph.tasks import PartitionConfig

#: the model's dimensions, in a Hugging Face config's words (only the fields the step function reads)
CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": True,
          "torch_dtype": "float32"}
#: bf16 units of the larger logit within which the top two tokens are a tie that rounding may break either way
TIE_ULPS = 4


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


def build(layers: int = 2, positions: int = 64, dtype: str = "float32", seed: int = 0) -> tuple:
    """(config, graph, weights): the model with `layers` layers and a KV cache of `positions`, random weights
    (rounded to `dtype`, a torch_dtype name)."""
    config = config_from_dict({**CONFIG, "num_hidden_layers": layers, "torch_dtype": dtype}).with_max_positions(
        positions)
    graph = parallel_block.trace(config)
    return config, graph, random_weights(graph, seed=seed, scale=1.0)


def first_difference(ours, theirs):
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def bf16_ulp(*values) -> float:
    return float(2.0 ** (np.floor(np.log2(max(max(abs(float(v)) for v in values), 1e-30))) - 7))


def compared_tokens(engine, tokens, reference, prompt, bf16: bool) -> int:
    """How many of the megakernel's tokens agree with the reference forward's: all of them, or in bf16 those
    before a first difference that is a tie within TIE_ULPS of bf16's resolution in both models' logits there
    (the reference computes in f32, the megakernel rounds where eager bf16 ops round: such a tie may break
    either way; the megakernel's logits of that step come from a launch over the tokens both chose before it).
    An MdslError where they differ otherwise."""
    first = first_difference(tokens, reference.tokens)
    if first is None and len(tokens) == len(reference.tokens):
        return len(tokens)
    if first is not None and bf16:
        a, b = tokens[first], reference.tokens[first]
        row = reference.logits[len(prompt) - 1 + first]
        engine.run(list(prompt) + list(tokens[:first]), 1, eos_token_ids=())
        mine = engine.last_logits()
        if int(np.argmax(mine)) == a and row[b] - row[a] <= TIE_ULPS * bf16_ulp(row[a], row[b]) and \
                mine[a] - mine[b] <= TIE_ULPS * bf16_ulp(mine[a], mine[b]):
            return first
    raise mdsl.MdslError(f"the GPU megakernel's tokens differ from the reference forward's at new token {first}:\n"
                         f"  megakernel: {list(tokens)}\n  reference:  {list(reference.tokens)}")


def run_on_gpu(config, weights, prompt, reference) -> None:
    """The model on the GPU megakernel (compile_model: the planner's tables, the generated task bodies), its
    greedy tokens checked against the reference's, and its logits of the last step (after the reference's
    tokens) against the reference's."""
    engine = compile_model(parallel_block, config, weights, max_seq=config.max_positions)
    tokens = engine.generate(prompt, len(reference.tokens), eos_token_ids=())
    print(f"megakernel tokens: {tokens}")
    engine.run(list(prompt) + list(reference.tokens[:-1]), 1, eos_token_ids=())
    print(f"largest logit difference, megakernel vs reference (last step): "
          f"{np.abs(engine.last_logits() - reference.logits[-1]).max():.3g}")
    same = compared_tokens(engine, tokens, reference, prompt, config.dtype.name == "bf16")
    if same < len(tokens):
        print(f"the megakernel's tokens are the reference's for {same} tokens, then a tie within bf16's rounding")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-ids", default="1,7,42", help="comma-separated token ids")
    ap.add_argument("--new", type=int, default=16, help="tokens to generate")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the weights' and the GPU's")
    args = ap.parse_args(argv)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    config, graph, weights = build(args.layers, len(prompt) + args.new, args.dtype)
    reference = ReferenceModel(graph, weights).generate(prompt, args.new)
    simulated = Simulator(build_task_graph(graph, PartitionConfig(num_sms=8)), weights).generate(
        prompt, args.new, workers=4, seed=1)
    print(f"reference tokens: {list(reference.tokens)}")
    print(f"simulated tokens: {list(simulated.tokens)}")
    print(f"largest logit difference: {np.abs(reference.logits - simulated.logits).max():.3g}")
    if reference.tokens != simulated.tokens:
        raise mdsl.MdslError("the simulated megakernel and the reference forward disagree")
    try:   # the GPU megakernel's planner: the graph lowered by its layer ops' device rules
        plan = plan_model(graph, decoder_shape(config), workers=8, max_seq=config.max_positions)
    except mdsl.MdslError as e:
        print(f"the GPU megakernel cannot run it:\n{e}")
        return
    check_plan(plan)
    kinds = ", ".join(f"{k.kind.name} {k.op}" for k in plan.kind_ops)
    print(f"the GPU megakernel's planner accepts it: {len(plan.tasks)} tasks a step on 8 workers ({kinds})")
    if has_gpu():
        run_on_gpu(config, weights, prompt, reference)
    else:
        print("no GPU here: the megakernel's run needs one (mdsl.megakernel.runtime.megakernel_engine.compile_model)")


if __name__ == "__main__":
    main()

"""Tiny Llama-3, Mistral, Phi-3, Gemma-2, Qwen2, Qwen3 and Qwen3-MoE configurations and random weights for the
megakernel tests, and examples/megakernel/parallel_block.py (a user's own architecture) as a module."""
import functools
import importlib.util
import sys
from pathlib import Path

from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.checkpoint import random_weights
from mdsl.megakernel.modelgraph.model_config import config_from_dict

ARCHITECTURES = {"llama3": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def tiny_config_dict(arch: str = "llama3", **overrides) -> dict:
    raw = {"architectures": [ARCHITECTURES[arch]], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": arch == "qwen3",
           "max_position_embeddings": 24, "torch_dtype": "float32"}
    if arch == "llama3":
        raw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    if arch in ("mistral", "phi3"):
        raw["sliding_window"] = 5 if arch == "mistral" else 7   # (decode runs well past it)
    if arch == "gemma2":   # (soft-caps low enough to bend the tiny model's scores and logits)
        raw.update(tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=12,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0, sliding_window=4)
    if arch == "qwen3_moe":
        raw.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                   mlp_only_layers=[], decoder_sparse_step=1)
    if arch == "qwen2_moe":   # (its shared expert wider than the routed ones, as Qwen1.5-MoE's; a dense layer)
        raw.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                   norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1, num_hidden_layers=3)
    raw.update(overrides)
    return raw


def tiny_model(arch: str = "llama3", seed: int = 0, **overrides):
    """(config, model graph, weights) of a tiny random model."""
    config = config_from_dict(tiny_config_dict(arch, **overrides))
    graph = step_function(config).trace(config)
    return config, graph, random_weights(graph, seed, scale=0.3)


@functools.cache
def parallel_block_example():
    """examples/megakernel/parallel_block.py as a module: its step function `parallel_block`, `build(layers,
    positions, dtype, seed)` -> (config, graph, weights), and its check of the GPU megakernel's tokens."""
    path = Path(__file__).resolve().parents[2] / "examples" / "megakernel" / "parallel_block.py"
    spec = importlib.util.spec_from_file_location("parallel_block_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

"""Built-in step functions: Llama-3 (LlamaForCausalLM), Mistral (MistralForCausalLM), Phi-3 (Phi3ForCausalLM),
Gemma-2 (Gemma2ForCausalLM), Qwen3-MoE (Qwen3MoeForCausalLM), Qwen2-MoE (Qwen2MoeForCausalLM), Qwen2 / Qwen2.5
(Qwen2ForCausalLM) and Qwen3 (Qwen3ForCausalLM), one decode step each, with the weights named as in their Hugging Face checkpoints.
They are step functions like a user's: the megakernel lowers their traced graphs by the layer ops' rules."""
from __future__ import annotations

import math

from mdsl.errors import UnsupportedError
from mdsl.megakernel.modelgraph.model import ModelFunction
from mdsl.megakernel.modelgraph.model_config import ModelConfig


def _decoder(m, cfg: ModelConfig):
    """The decoder shared by Llama-3, Mistral, Phi-3, Qwen2 and Qwen3; Mistral's (and Phi-3's) attention reads a
    sliding window of positions, Phi-3's checkpoint holds the q|k|v and gate|up projections as one weight each
    (the fused rows are the q|k|v and gate|up rows), Qwen2 adds biases to the q|k|v projection, Qwen3 an rms_norm
    of each query and key head, Qwen3-MoE a mixture of experts for the MLP of its sparse layers, Qwen2-MoE Qwen2's
    attention and a mixture of experts with a shared expert."""
    h, d = cfg.hidden_size, cfg.head_dim
    heads = {"q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": d}
    embed = m.weight("model.embed_tokens.weight", [cfg.vocab_size, h])
    x = m.embedding(embed)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        normed = m.rms_norm(x, m.weight(p + "input_layernorm.weight", [h]), cfg.rms_norm_eps)
        if cfg.fused_projections:
            qkv = m.linear(normed, m.weight(p + "self_attn.qkv_proj.weight", [(cfg.num_heads + 2 * cfg.num_kv_heads) * d, h]))
        else:
            qkv = m.linear(normed, m.weight(p + "self_attn.q_proj.weight", [cfg.num_heads * d, h]),
                           m.weight(p + "self_attn.k_proj.weight", [cfg.num_kv_heads * d, h]),
                           m.weight(p + "self_attn.v_proj.weight", [cfg.num_kv_heads * d, h]))
        if cfg.qkv_bias:
            biases = [m.weight(p + f"self_attn.{proj}.bias", [heads * d])
                      for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads),
                                          ("v_proj", cfg.num_kv_heads))]
            qkv = m.add_bias(qkv, *biases)
        if cfg.qk_norm:
            qkv = m.head_rms_norm(qkv, m.weight(p + "self_attn.q_norm.weight", [d]),
                                  m.weight(p + "self_attn.k_norm.weight", [d]), eps=cfg.rms_norm_eps, **heads)
        qkv = m.rope(qkv, **heads, **cfg.rope.attrs())
        k_cache, v_cache = m.kv_cache(i, cfg.num_kv_heads, d)
        if cfg.sliding_window:
            attn = m.scaled_attention(qkv, k_cache, v_cache, window=cfg.sliding_window, **heads)
        else:
            attn = m.attention(qkv, k_cache, v_cache, **heads)
        x = m.add(x, m.linear(attn, m.weight(p + "self_attn.o_proj.weight", [h, cfg.num_heads * d])))
        normed = m.rms_norm(x, m.weight(p + "post_attention_layernorm.weight", [h]), cfg.rms_norm_eps)
        if cfg.sparse(i):
            x = m.add(x, _experts(m, cfg, normed, p))
            continue
        if cfg.fused_projections:
            gate_up = m.linear(normed, m.weight(p + "mlp.gate_up_proj.weight", [2 * cfg.intermediate_size, h]))
        else:
            gate_up = m.linear(normed, m.weight(p + "mlp.gate_proj.weight", [cfg.intermediate_size, h]),
                               m.weight(p + "mlp.up_proj.weight", [cfg.intermediate_size, h]))
        x = m.add(x, m.linear(m.act_mul(gate_up, cfg.hidden_act), m.weight(p + "mlp.down_proj.weight", [h, cfg.intermediate_size])))
    x = m.rms_norm(x, m.weight("model.norm.weight", [h]), cfg.rms_norm_eps)
    head = embed if cfg.tie_word_embeddings else m.weight("lm_head.weight", [cfg.vocab_size, h])
    logits = m.linear(x, head)
    return logits


def _experts(m, cfg: ModelConfig, normed, p: str):
    """A sparse MLP: the router picks experts_per_token of num_experts; only their weights are read. Qwen2-MoE's
    adds a shared expert, a gated MLP of every token scaled by sigmoid of its own one-row gate projection."""
    h, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    routing = m.moe_router(normed, m.weight(p + "mlp.gate.weight", [e, h]), top_k=cfg.experts_per_token,
                           norm_topk_prob=cfg.norm_topk_prob)
    weights = [m.weight(p + f"mlp.experts.{k}.{proj}.weight", shape) for proj, shape in
               (("gate_proj", [inter, h]), ("up_proj", [inter, h]), ("down_proj", [h, inter])) for k in range(e)]
    out = m.moe_experts(normed, routing, *weights, act=cfg.hidden_act)
    if cfg.shared_expert_size:
        s, q = cfg.shared_expert_size, p + "mlp.shared_expert."
        gate_up = m.linear(normed, m.weight(q + "gate_proj.weight", [s, h]), m.weight(q + "up_proj.weight", [s, h]))
        shared = m.linear(m.act_mul(gate_up, cfg.hidden_act), m.weight(q + "down_proj.weight", [h, s]))
        gate = m.linear(normed, m.weight(p + "mlp.shared_expert_gate.weight", [1, h]))
        out = m.add(out, m.gated_scale(shared, gate, "sigmoid"))
    return out


def _gemma2(m, cfg: ModelConfig):
    """Gemma-2: embeddings times sqrt(hidden), RMSNorms scaled by (1 + weight) before and after attention and
    the MLP, a GeGLU MLP (tanh-approximate GELU), queries scaled by query_pre_attn_scalar^-0.5, soft-capped
    attention scores and logits, a sliding window on the layers layer_types names."""
    h, d, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
    heads = {"q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": d}
    embed = m.weight("model.embed_tokens.weight", [cfg.vocab_size, h])
    x = m.scale(m.embedding(embed), math.sqrt(h))
    for i in range(cfg.num_layers):
        def w(name: str, *shape: int):
            return m.weight(f"model.layers.{i}.{name}.weight", list(shape))

        qkv = m.linear(m.rms_norm_1p(x, w("input_layernorm", h), eps), w("self_attn.q_proj", cfg.num_heads * d, h),
                       w("self_attn.k_proj", cfg.num_kv_heads * d, h), w("self_attn.v_proj", cfg.num_kv_heads * d, h))
        k_cache, v_cache = m.kv_cache(i, cfg.num_kv_heads, d)
        attn = m.scaled_attention(m.rope(qkv, **heads, **cfg.rope.attrs()), k_cache, v_cache, window=cfg.window(i),
                                  scale=cfg.attention_scale, softcap=cfg.attn_softcap, **heads)
        out = m.linear(attn, w("self_attn.o_proj", h, cfg.num_heads * d))
        x = m.add(x, m.rms_norm_1p(out, w("post_attention_layernorm", h), eps))
        gate_up = m.linear(m.rms_norm_1p(x, w("pre_feedforward_layernorm", h), eps),
                           w("mlp.gate_proj", cfg.intermediate_size, h), w("mlp.up_proj", cfg.intermediate_size, h))
        out = m.linear(m.geglu(gate_up), w("mlp.down_proj", h, cfg.intermediate_size))
        x = m.add(x, m.rms_norm_1p(out, w("post_feedforward_layernorm", h), eps))
    head = embed if cfg.tie_word_embeddings else m.weight("lm_head.weight", [cfg.vocab_size, h])
    logits = m.linear(m.rms_norm_1p(x, m.weight("model.norm.weight", [h]), eps), head)
    if cfg.final_softcap:
        logits = m.softcap(logits, cfg.final_softcap)
    return logits


#: each built-in architecture's logits of one decode step
_LOGITS = {"llama3": _decoder, "mistral": _decoder, "phi3": _decoder, "qwen2": _decoder, "qwen3": _decoder,
           "qwen3_moe": _decoder, "qwen2_moe": _decoder, "gemma2": _gemma2}


def _logits_of(architecture: str):
    logits_of = _LOGITS.get(architecture)
    if logits_of is None:
        raise UnsupportedError(f"no built-in model for architecture {architecture!r}",
                               hint=f"built in: {', '.join(_LOGITS)}")
    return logits_of


def _greedy(architecture: str) -> ModelFunction:
    """The built-in model of an architecture: its logits, then the argmax."""
    logits_of = _logits_of(architecture)

    def step(m, cfg: ModelConfig):
        logits = logits_of(m, cfg)
        return logits, m.argmax(logits)

    return ModelFunction(step, architecture)


def sampling_decode(architecture: str, *, temperature: float, top_p: float = 1.0, seed: int = 0) -> ModelFunction:
    """The built-in model of an architecture with seeded temperature/top-p sampling instead of argmax."""
    logits_of = _logits_of(architecture)

    def step(m, cfg: ModelConfig):
        logits = logits_of(m, cfg)
        return logits, m.sample(logits, temperature=temperature, top_p=top_p, seed=seed)

    return ModelFunction(step, f"{architecture}_sampling")


STEP_FUNCTIONS = {architecture: _greedy(architecture) for architecture in _LOGITS}
llama3_decode, qwen3_decode = STEP_FUNCTIONS["llama3"], STEP_FUNCTIONS["qwen3"]


def step_function(cfg: ModelConfig) -> ModelFunction:
    _logits_of(cfg.architecture)   # an unknown one is refused, naming those built in
    return STEP_FUNCTIONS[cfg.architecture]

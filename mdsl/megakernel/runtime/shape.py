"""What the megakernel's generated code needs to know of a decoder model (a `ModelConfig` of the
built-in decoder definitions): its dimensions, dtype and normalisation, plus RoPE's tables."""
from __future__ import annotations

import attrs
import numpy as np

from mdsl.errors import UnsupportedError
from mdsl.ir.dtypes import DType, bf16, f32
from mdsl.megakernel.modelgraph.layers import rope_inv_freq
from mdsl.megakernel.modelgraph.model_config import ModelConfig

SUPPORTED_DTYPES = (bf16, f32)
# The device's weight slots. A layer's (sync.cuh's LayerWeights, in its order), named by the short Hugging Face
# names of the tensors the built-in decoders fill them with (q_norm, k_norm: Qwen3's only); the planner fills
# each from the graph weight that plays its part (task_plan.BoundWeight), whatever its name.
LAYER_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                 "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")
# ... the biases of the q, k and v projections (Qwen2's: self_attn.q_proj.bias, ...), after the KV caches
QKV_BIASES = ("q_bias", "k_bias", "v_bias")
# ... a mixture of experts' layer (the MOE section): the router, and per expert e its gate, up and down weight
# (expert_slot: "expert_gate.<e>", ...; the engine points a per-layer table at them, gates, ups, downs)
MOE_WEIGHTS = ("router",)
EXPERT_PARTS = ("expert_gate", "expert_up", "expert_down")


def expert_slot(part: str, expert: int) -> str:
    """The device weight slot of expert `expert`'s weight `part` (EXPERT_PARTS)."""
    return f"{part}.{expert}"


# ... the norms of the o-proj's and the down-proj's output rows before their residual adds (Gemma-2's
# post_attention_layernorm and post_feedforward_layernorm: linear_norm_residual), after the biases (the ROW_NORM section)
POST_NORMS = ("attn_post_norm", "mlp_post_norm")
# ... and the kernel's own: the embedding table, the final norm, the LM head (the table itself where tied)
KERNEL_WEIGHTS = ("embed", "final_norm", "lm_head")
# Phi-3's fused weights: each holds the rows of these LAYER_WEIGHTS in turn (its checkpoint's tensors; the planner
# fills the device's slots with rows of them as it fills any slot, from the weight the op reads)
FUSED_WEIGHTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def as_checkpoint_holds(config: ModelConfig, weights) -> tuple:
    """Short weight names as the checkpoint of `config` holds them: with fused projections, the parts of
    each fused weight (FUSED_WEIGHTS) by that weight, in its first part's place."""
    if not config.fused_projections:
        return tuple(weights)
    out: list = []
    for w in weights:
        name = next((fused for fused, parts in FUSED_WEIGHTS.items() if w in parts), w)
        if name not in out:
            out.append(name)
    return tuple(out)


def layer_tensors(config: ModelConfig) -> tuple:
    """The short names of the tensors of a layer the device reads, as the checkpoint holds them, in the order
    the engine uploads them: LAYER_WEIGHTS (q_norm and k_norm where the model has them), then its q|k|v
    biases."""
    weights = [w for w in LAYER_WEIGHTS if config.qk_norm or w not in ("q_norm", "k_norm")]
    return as_checkpoint_holds(config, weights) + (QKV_BIASES if config.qkv_bias else ())


def layer_weight_name(layer: int, short: str) -> str:
    """The Hugging Face name of a layer's weight or bias (the built-in model definitions use the same)."""
    if short in QKV_BIASES:
        return f"model.layers.{layer}.self_attn.{short[0]}_proj.bias"
    where = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "q_norm": "self_attn", "k_norm": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
             "qkv_proj": "self_attn", "gate_up_proj": "mlp"}
    middle = f"{where[short]}." if short in where else ""
    return f"model.layers.{layer}.{middle}{short}.weight"


@attrs.frozen
class DecoderShape:
    """A decoder the megakernel runs. `dtype` is the weights' and the activations' (every op computes in
    f32 and rounds to it where the Hugging Face model does)."""

    config: ModelConfig

    hidden = property(lambda self: self.config.hidden_size)
    intermediate = property(lambda self: self.config.intermediate_size)
    layers = property(lambda self: self.config.num_layers)
    heads = property(lambda self: self.config.num_heads)
    kv_heads = property(lambda self: self.config.num_kv_heads)
    head_dim = property(lambda self: self.config.head_dim)
    vocab = property(lambda self: self.config.vocab_size)
    eps = property(lambda self: self.config.rms_norm_eps)
    qk_norm = property(lambda self: self.config.qk_norm)
    qkv_bias = property(lambda self: self.config.qkv_bias)

    experts = property(lambda self: self.config.num_experts)
    experts_per_token = property(lambda self: self.config.experts_per_token)
    expert_intermediate = property(lambda self: self.config.moe_intermediate_size)

    @property
    def dtype(self) -> DType:
        return self.config.dtype

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    def slot_shape(self, slot: str) -> tuple:
        """The shape of a device weight slot (LAYER_WEIGHTS, QKV_BIASES, POST_NORMS, KERNEL_WEIGHTS): [rows, columns] of a
        matrix, [n] of a vector."""
        h, d, kv = self.hidden, self.head_dim, self.kv_heads * self.head_dim
        part = slot.partition(".")[0]
        if part in EXPERT_PARTS:
            mi = self.expert_intermediate
            return (h, mi) if part == "expert_down" else (mi, h)
        if slot == "router":
            return (self.experts, h)
        return {"q_proj": (self.attention_width, h), "k_proj": (kv, h), "v_proj": (kv, h),
                "o_proj": (h, self.attention_width), "gate_proj": (self.intermediate, h),
                "up_proj": (self.intermediate, h), "down_proj": (h, self.intermediate), "input_layernorm": (h,),
                "post_attention_layernorm": (h,), "q_norm": (d,), "k_norm": (d,), "q_bias": (self.attention_width,),
                "k_bias": (kv,), "v_bias": (kv,), "attn_post_norm": (h,), "mlp_post_norm": (h,),
                "embed": (self.vocab, h), "final_norm": (h,),
                "lm_head": (self.vocab, h)}[slot]

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads: every matrix and norm once, one embedding row; of a mixture of
        experts' layer, its router and the weights of the experts_per_token experts it picks (the active ones)."""
        per_layer = (self.qkv_rows * self.hidden + self.hidden * self.attention_width
                     + 3 * self.hidden * self.intermediate + 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
                     + (self.qkv_rows if self.qkv_bias else 0))
        sparse = sum(self.config.sparse(layer) for layer in range(self.layers))
        moe = (self.experts * self.hidden + self.experts_per_token * 3 * self.hidden * self.expert_intermediate
               - 3 * self.hidden * self.intermediate)   # (in place of the dense MLP)
        return (self.layers * per_layer + sparse * moe + self.vocab * self.hidden + 3 * self.hidden) * \
            self.dtype.itemsize

    def __str__(self) -> str:
        c = self.config
        return (f"{c.architecture} {c.dtype}: {c.num_layers} layers, hidden {c.hidden_size}, intermediate "
                f"{c.intermediate_size}, heads {c.num_heads}/{c.num_kv_heads} x {c.head_dim}, vocab {c.vocab_size}")


def decoder_shape(config: ModelConfig) -> DecoderShape:
    """The shape of a model the megakernel runs, or an UnsupportedError saying why it cannot."""
    vec = 16 // config.dtype.itemsize
    problems = []
    if config.dtype not in SUPPORTED_DTYPES:
        problems.append(f"its dtype is {config.dtype.long_name} (bfloat16 and float32 are supported)")
    if config.num_heads % config.num_kv_heads:
        problems.append(f"num_attention_heads ({config.num_heads}) is not a multiple of num_key_value_heads "
                        f"({config.num_kv_heads})")
    for name, value in (("hidden_size", config.hidden_size), ("intermediate_size", config.intermediate_size),
                        ("num_attention_heads * head_dim", config.num_heads * config.head_dim),
                        *((("moe_intermediate_size", config.moe_intermediate_size),) if config.num_experts else ())):
        if value % vec:
            problems.append(f"{name} ({value}) is not a multiple of {vec} (16-byte weight loads)")
    if config.head_dim * config.dtype.itemsize % 16:
        problems.append(f"head_dim ({config.head_dim}) rows of the KV cache are not a multiple of 16 bytes")
    if problems:
        raise UnsupportedError("the megakernel cannot run this model: " + "; ".join(problems),
                               hint="the reference forward (mdsl.megakernel.modelgraph.reference) runs any "
                                    "built-in model")
    return DecoderShape(config)


def rope_tables(shape: DecoderShape, positions: int) -> tuple:
    """cos and sin, float32 [positions, head_dim / 2], of position * inverse frequency (float32, as
    transformers computes the angle)."""
    inv = rope_inv_freq({"head_dim": shape.head_dim, **shape.config.rope.attrs()})
    angles = (np.arange(positions, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

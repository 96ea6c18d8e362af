"""Model configurations read from a Hugging Face `config.json` (LlamaForCausalLM, MistralForCausalLM,
Phi3ForCausalLM, Gemma2ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM,
Qwen2MoeForCausalLM).

Every field mdsl reads is type- and range-checked: a wrong one is a CheckpointError naming the file and
the field, never a Python exception from deep inside the model's construction."""
from __future__ import annotations

import math
import numbers
import os
from typing import Any, Optional

import attrs

from mdsl.errors import CheckpointError, DTypeError, UnsupportedError
from mdsl.ir.dtypes import DType, bf16, f16, f32
from mdsl.megakernel.modelgraph.safetensors import json_kind, read_json_file, shown

ARCHITECTURES = {"LlamaForCausalLM": "llama3", "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3",
                 "Gemma2ForCausalLM": "gemma2", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe"}
# the architectures whose config's sliding_window applies to every layer (Qwen2's only with use_sliding_window)
_SLIDING_WINDOW = ("mistral", "phi3", "gemma2")
_LAYER_TYPES = ("sliding_attention", "full_attention")
_DTYPES = {"float32": f32, "float16": f16, "bfloat16": bf16}
# transformers' ACT2FN names -> the mdsl operator computing the same function
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu", "sigmoid": "sigmoid"}
MAX_SIZE = 2**31 - 1     # sizes and token ids index int32 arrays on the GPU
GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_SEQ = 4096   # KV cache positions unless asked (configs allow up to 131072)


@attrs.frozen
class RopeConfig:
    """Plain theta, or Llama-3's scaling (`factor` != 1 with low/high frequency factors)."""

    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 0    # 0: no scaling

    def attrs(self) -> dict:
        return {"theta": self.theta, "scaling_factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor, "original_max_position": self.original_max_position}


def _positions(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= MAX_SIZE:
        raise CheckpointError(f"max_positions must be a positive integer, got {shown(n)}",
                              hint="the KV cache positions: the prompt and the tokens to generate")
    return int(n)


@attrs.frozen
class ModelConfig:
    architecture: str          # a value of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    max_positions: int
    dtype: DType = f32
    hidden_act: str = "silu"   # the gated MLP's activation: an element-wise operator of mdsl.ir.ops
    sliding_window: int = 0    # attention reads the last sliding_window positions (0: every position)
    sliding_layers: Optional[tuple] = None   # per layer, whether the window applies (None: every layer's does)
    attention_scale: float = 0.0             # scores times this (0: 1/sqrt(head_dim))
    attn_softcap: float = 0.0                # attention scores soft-capped (0: not)
    final_softcap: float = 0.0               # the logits soft-capped (0: not)
    num_experts: int = 0                     # a sparse mixture of experts' E (0: dense MLPs)
    experts_per_token: int = 0               # its top_k
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple = ()                 # the layers with a dense MLP in a mixture-of-experts model
    shared_expert_size: int = 0              # its shared expert's intermediate size (0: none; Qwen2-MoE's)

    @property
    def qk_norm(self) -> bool:
        return self.architecture in ("qwen3", "qwen3_moe")

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def qkv_bias(self) -> bool:
        """Biases on the query, key and value projections (Qwen2's and Qwen2-MoE's, which Qwen2's config.json does
        not flag)."""
        return self.architecture in ("qwen2", "qwen2_moe")

    @property
    def fused_projections(self) -> bool:
        """The checkpoint holds one qkv_proj and one gate_up_proj weight per layer (Phi-3's)."""
        return self.architecture == "phi3"

    def window(self, layer: int) -> int:
        """The positions layer `layer`'s attention reads back (0: every position)."""
        return self.sliding_window if self.sliding_layers is None or self.sliding_layers[layer] else 0

    def with_max_positions(self, n: int) -> "ModelConfig":
        """A shorter KV cache than the model allows (decode tests and small engines)."""
        return attrs.evolve(self, max_positions=_positions(n))


class _Fields:
    """Checked reads of a config's fields: `prefix` names a nested dict (rope_scaling.) in errors."""

    def __init__(self, raw: dict, source: str, prefix: str = ""):
        self.raw, self.source, self.prefix = raw, source, prefix

    def error(self, key: str, expected: str, value: Any) -> CheckpointError:
        return CheckpointError(f"{self.source}: {self.prefix}{key} must be {expected}, got {shown(value)}",
                               hint=f"fix {self.prefix}{key} in {os.path.basename(self.source)}: a Hugging Face "
                                    "config.json of a Llama-3 or Qwen3 model has it right")

    def get(self, key: str, default: Any = attrs.NOTHING) -> Any:
        value = self.raw.get(key)
        if value is not None:
            return value
        if default is attrs.NOTHING:
            raise CheckpointError(f"{self.source}: the config has no {self.prefix}{key}",
                                  hint="a Hugging Face config.json of a Llama-3 or Qwen3 model has it")
        return default

    def integer(self, key: str, default: Any = attrs.NOTHING) -> int:
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIZE:
            raise self.error(key, f"a positive integer (at most {MAX_SIZE})", value)
        return value

    def number(self, key: str, default: Any = attrs.NOTHING) -> float:
        """A positive finite number."""
        value = self.get(key, default)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e308 else math.inf   # (an integer too large for a float)
            if 0 < number < math.inf:
                return number
        raise self.error(key, "a positive finite number", value)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, "true or false", value)
        return value

    def text(self, key: str, default: Any = attrs.NOTHING) -> str:
        value = self.get(key, default)
        if not isinstance(value, str):
            raise self.error(key, "a string", value)
        return value

    def mapping(self, key: str) -> "_Fields":
        value = self.get(key, {})
        if not isinstance(value, dict):
            raise self.error(key, "an object (or null)", value)
        return _Fields(value, self.source, f"{self.prefix}{key}.")


def _rope(f: _Fields) -> RopeConfig:
    # transformers 4 writes rope_theta and rope_scaling; transformers 5 one rope_parameters dict
    params = f.mapping("rope_parameters")
    theta = params.number("rope_theta") if params.raw.get("rope_theta") is not None else \
        f.number("rope_theta", 10000.0)
    scaling = f.mapping("rope_scaling")
    if not scaling.raw:
        scaling = params
    for fields in (f, params):
        if fields.raw.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedError(f"{f.source}: {fields.prefix}partial_rotary_factor "
                                   f"{shown(fields.raw['partial_rotary_factor'])} is not supported",
                                   hint="mdsl's rope turns every dimension of a head (partial_rotary_factor 1.0)")
    kind = scaling.text("rope_type", scaling.raw.get("type") or "default")
    if kind == "default":
        return RopeConfig(theta)
    if kind != "llama3":
        raise UnsupportedError(f"{f.source}: rope_scaling type {shown(kind)} is not supported",
                               hint="mdsl supports plain rope_theta and rope_type 'llama3' (not Phi-3's 'longrope' "
                                    "of its long-context variants)")
    low, high = scaling.number("low_freq_factor"), scaling.number("high_freq_factor")
    if not low < high:
        raise scaling.error("high_freq_factor", f"larger than low_freq_factor ({low})", high)
    return RopeConfig(theta, scaling.number("factor"), low, high, scaling.integer("original_max_position_embeddings"))


def _dtype(f: _Fields) -> DType:
    key = "torch_dtype" if f.raw.get("torch_dtype") is not None else "dtype"
    name = f.text(key, "float32").replace("torch.", "")
    if name not in _DTYPES:
        raise DTypeError(f"{f.source}: weights of dtype {shown(name)} are not supported", hint="use float32, float16 or bfloat16")
    return _DTYPES[name]


def _architecture(f: _Fields) -> str:
    archs = f.get("architectures", [])
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise f.error("architectures", "a list of class names such as [\"LlamaForCausalLM\"]", archs)
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedError(f"{f.source}: architecture {shown(archs or f.raw.get('model_type'))} is not supported",
                               hint=f"mdsl builds {', '.join(ARCHITECTURES)}; write an @mdsl.model step function "
                                    "for other models")
    return arch


def config_from_dict(raw: Any, source: str = "config.json") -> ModelConfig:
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: the config is {json_kind(raw)}, not a JSON object",
                              hint="a Hugging Face config.json is one object of fields")
    f = _Fields(raw, source)
    arch = _architecture(f)
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if f.flag(flag):
            raise UnsupportedError(f"{source}: {flag}=true is not supported", hint="mdsl's built-in models have no "
                                                                                  "biases and full attention")
    if arch == "gemma2":
        act = f.text("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise UnsupportedError(f"{source}: hidden_activation {shown(act)} is not supported for Gemma-2",
                                   hint="mdsl's Gemma-2 MLP computes gelu_pytorch_tanh (geglu)")
        act = "silu"   # (unused: the Gemma-2 step function gates by geglu)
    else:
        act = f.text("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedError(f"{source}: hidden_act {shown(act)} is not supported",
                               hint=f"mdsl computes {', '.join(sorted(ACTIVATIONS))} (transformers' names)")
    hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    kv_heads = f.integer("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.error("num_key_value_heads", f"a divisor of num_attention_heads ({heads})", kv_heads)
    if raw.get("head_dim") is None and hidden % heads:
        raise f.error("num_attention_heads", f"a divisor of hidden_size ({hidden}) when there is no head_dim", heads)
    head_dim = f.integer("head_dim", hidden // heads)
    if head_dim % 2:
        raise f.error("head_dim", "even (rotary embeddings turn pairs of dims)", head_dim)
    layers = f.integer("num_hidden_layers")
    gemma = _gemma2(f, layers) if arch == "gemma2" else _moe(f, layers, arch) if arch.endswith("_moe") else {}
    return ModelConfig(
        architecture=arch, vocab_size=f.integer("vocab_size"), hidden_size=hidden,
        intermediate_size=f.integer("intermediate_size"), num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        rope=_rope(f), tie_word_embeddings=f.flag("tie_word_embeddings"),
        max_positions=f.integer("max_position_embeddings"), dtype=_dtype(f), hidden_act=ACTIVATIONS[act],
        sliding_window=f.integer("sliding_window") if arch in _SLIDING_WINDOW and raw.get("sliding_window") is not None
        else 0, **gemma)


def _gemma2(f: _Fields, layers: int) -> dict:
    """Gemma-2's fields: query_pre_attn_scalar, the two soft-caps, and which layers' attention is windowed
    (layer_types; by default every other layer from the first, as transformers')."""
    types = f.get("layer_types", ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    if not isinstance(types, list) or len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise f.error("layer_types", f"a list of {layers} entries, each one of {', '.join(_LAYER_TYPES)}", types)

    def cap(key: str) -> float:
        return f.number(key) if f.raw.get(key) is not None else 0.0

    return {"sliding_layers": tuple(t == "sliding_attention" for t in types),
            "attention_scale": f.number("query_pre_attn_scalar", 256) ** -0.5,
            "attn_softcap": cap("attn_logit_softcapping"), "final_softcap": cap("final_logit_softcapping")}


def _moe(f: _Fields, layers: int, arch: str) -> dict:
    """Qwen3-MoE's and Qwen2-MoE's fields: E experts, top_k of them per token, their intermediate size, whether the
    top_k probabilities are renormalised, and which layers keep a dense MLP (mlp_only_layers, decoder_sparse_step);
    Qwen2-MoE's shared expert's intermediate size (and its q|k|v biases: qkv_bias, true unless the config says
    otherwise)."""
    # (transformers 5 writes the experts as num_local_experts; the Hub's Qwen3-MoE configs as num_experts)
    experts = f.integer("num_local_experts" if "num_experts" not in f.raw and "num_local_experts" in f.raw
                        else "num_experts")
    top_k = f.integer("num_experts_per_tok")
    if top_k > experts:
        raise f.error("num_experts_per_tok", f"at most num_experts ({experts})", top_k)
    step, only = f.integer("decoder_sparse_step", 1), f.get("mlp_only_layers", [])
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise f.error("mlp_only_layers", "a list of layer indices", only)
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    shared = {}
    if arch == "qwen2_moe":
        if not f.flag("qkv_bias", True):
            raise UnsupportedError(f"{f.source}: qkv_bias=false is not supported for Qwen2-MoE",
                                   hint="mdsl's Qwen2-MoE has Qwen2's q|k|v biases")
        shared = {"shared_expert_size": f.integer("shared_expert_intermediate_size")}
    return {"num_experts": experts, "experts_per_token": top_k, "norm_topk_prob": f.flag("norm_topk_prob"),
            "moe_intermediate_size": f.integer("moe_intermediate_size"), "dense_layers": dense, **shared}


def load_config(path: str, max_positions: Optional[int] = None) -> ModelConfig:
    """From a checkpoint folder (its config.json) or the file itself."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.lexists(file):
        raise CheckpointError(f"no config.json at {path}", hint="pass a Hugging Face checkpoint folder")
    config = config_from_dict(read_json_file(file, "config"), file)
    return config.with_max_positions(max_positions) if max_positions is not None else config


def eos_token_ids(folder: str, vocab_size: Optional[int] = None) -> tuple:
    """EOS token ids from generation_config.json, else config.json (an id or a list; none: ()), each
    below `vocab_size` when it is given."""
    for name in (GENERATION_CONFIG, "config.json"):
        path = os.path.join(folder, name)
        if not os.path.lexists(path):
            continue
        raw = read_json_file(path, "generation config" if name == GENERATION_CONFIG else "config")
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: the file is {json_kind(raw)}, not a JSON object",
                                  hint="a Hugging Face config file is one object of fields")
        value = raw.get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        top = MAX_SIZE if vocab_size is None else vocab_size - 1
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= top for i in ids):
            raise _Fields(raw, path).error("eos_token_id", f"a token id or a list of token ids, each 0..{top}", value)
        return tuple(ids)
    return ()

"""Model configurations read from a Hugging Face `config.json` (LlamaForCausalLM, Qwen3ForCausalLM)."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import attrs

from mdsl.errors import DTypeError, ParseError, UnsupportedError
from mdsl.ir.dtypes import DType, bf16, f16, f32

ARCHITECTURES = {"LlamaForCausalLM": "llama3", "Qwen3ForCausalLM": "qwen3"}
_DTYPES = {"float32": f32, "float16": f16, "bfloat16": bf16}
# transformers' ACT2FN names -> the mdsl operator computing the same function
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu", "sigmoid": "sigmoid"}


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


@attrs.frozen
class ModelConfig:
    architecture: str          # "llama3" | "qwen3"
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

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    def with_max_positions(self, n: int) -> "ModelConfig":
        """A shorter KV cache than the model allows (decode tests and small engines)."""
        return attrs.evolve(self, max_positions=int(n))


def _get(raw: dict, key: str, source: str, default: Any = attrs.NOTHING) -> Any:
    if key in raw and raw[key] is not None:
        return raw[key]
    if default is attrs.NOTHING:
        raise ParseError(f"{source}: the config has no {key!r}", hint="a Hugging Face config.json of a Llama-3 or "
                                                                      "Qwen3 model has it")
    return default


def _rope(raw: dict, source: str) -> RopeConfig:
    # transformers 4 writes rope_theta and rope_scaling; transformers 5 one rope_parameters dict
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta") or _get(raw, "rope_theta", source, 10000.0))
    scaling = raw.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta)
    if kind != "llama3":
        raise UnsupportedError(f"{source}: rope_scaling type {kind!r} is not supported",
                               hint="mdsl supports plain rope_theta and rope_type 'llama3'")
    return RopeConfig(theta, float(scaling["factor"]), float(scaling["low_freq_factor"]),
                      float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))


def _dtype(raw: dict, source: str) -> DType:
    name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    name = str(name).replace("torch.", "")
    if name not in _DTYPES:
        raise DTypeError(f"{source}: weights of dtype {name!r} are not supported", hint="use float32, float16 or bfloat16")
    return _DTYPES[name]


def config_from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedError(f"{source}: architecture {archs or raw.get('model_type')!r} is not supported",
                               hint=f"mdsl builds {', '.join(ARCHITECTURES)}; write an @mdsl.model step function "
                                    "for other models")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if raw.get(flag):
            raise UnsupportedError(f"{source}: {flag}=true is not supported", hint="mdsl's built-in models have no "
                                                                                  "biases and full attention")
    act = raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedError(f"{source}: hidden_act {act!r} is not supported",
                               hint=f"mdsl computes {', '.join(sorted(ACTIVATIONS))} (transformers' names)")
    hidden = int(_get(raw, "hidden_size", source))
    heads = int(_get(raw, "num_attention_heads", source))
    return ModelConfig(
        architecture=arch, vocab_size=int(_get(raw, "vocab_size", source)), hidden_size=hidden,
        intermediate_size=int(_get(raw, "intermediate_size", source)),
        num_layers=int(_get(raw, "num_hidden_layers", source)), num_heads=heads,
        num_kv_heads=int(_get(raw, "num_key_value_heads", source, heads)),
        head_dim=int(_get(raw, "head_dim", source, hidden // heads)),
        rms_norm_eps=float(_get(raw, "rms_norm_eps", source, 1e-6)), rope=_rope(raw, source),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_positions=int(_get(raw, "max_position_embeddings", source)), dtype=_dtype(raw, source),
        hidden_act=ACTIVATIONS[act])


def load_config(path: str, max_positions: Optional[int] = None) -> ModelConfig:
    """From a checkpoint folder (its config.json) or the file itself."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ParseError(f"no config.json at {path}", hint="pass a Hugging Face checkpoint folder") from None
    except json.JSONDecodeError as e:
        raise ParseError(f"{file} is not valid JSON: {e}") from None
    config = config_from_dict(raw, file)
    return config.with_max_positions(max_positions) if max_positions else config

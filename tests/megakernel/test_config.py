"""Hugging Face config.json -> ModelConfig, in transformers 4 and 5 spellings; clear errors."""
import json

import pytest

from mdsl.errors import DTypeError, ParseError, UnsupportedError
from mdsl.ir.dtypes import bf16, f32
from mdsl.megakernel.config import config_from_dict, load_config
from tests.megakernel.tiny import tiny_config_dict


def test_llama3_config_with_rope_scaling():
    c = config_from_dict(tiny_config_dict("llama3", head_dim=None))
    assert (c.architecture, c.head_dim, c.num_kv_heads, c.qk_norm, c.tie_word_embeddings) == ("llama3", 8, 2, False,
                                                                                               False)
    assert (c.rope.factor, c.rope.original_max_position, c.dtype) == (8.0, 8, f32)


def test_qwen3_config_in_transformers5_spelling(tmp_path):
    raw = tiny_config_dict("qwen3", head_dim=16, dtype="bfloat16")
    del raw["rope_theta"], raw["torch_dtype"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = load_config(str(tmp_path), max_positions=10)
    assert (c.architecture, c.qk_norm, c.head_dim, c.rope.theta, c.rope.original_max_position) == (
        "qwen3", True, 16, 1e6, 0)
    assert (c.dtype, c.max_positions, c.tie_word_embeddings) == (bf16, 10, True)


def test_llama3_scaling_in_rope_parameters():
    raw = tiny_config_dict("llama3")
    raw["rope_parameters"] = dict(raw.pop("rope_scaling"), rope_theta=5e5)
    del raw["rope_theta"]
    c = config_from_dict(raw)
    assert (c.rope.theta, c.rope.factor, c.rope.high_freq_factor) == (5e5, 8.0, 4.0)


@pytest.mark.parametrize(("hidden_act", "op"), [("silu", "silu"), ("swish", "silu"), ("gelu", "gelu"),
                                                  ("relu", "relu"), ("sigmoid", "sigmoid")])
def test_hidden_act_names_an_operator(hidden_act, op):
    assert config_from_dict(tiny_config_dict("llama3", hidden_act=hidden_act)).hidden_act == op


@pytest.mark.parametrize("change,error,words", [
    ({"architectures": ["MistralForCausalLM"]}, UnsupportedError, "MistralForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedError, "yarn"),
    ({"attention_bias": True}, UnsupportedError, "attention_bias"),
    ({"hidden_act": "gelu_pytorch_tanh"}, UnsupportedError, "gelu_pytorch_tanh"),
    ({"torch_dtype": "float8_e4m3fn"}, DTypeError, "float8"),
    ({"hidden_size": None}, ParseError, "hidden_size"),
])
def test_config_errors_name_the_problem(change, error, words):
    with pytest.raises(error, match=words):
        config_from_dict(tiny_config_dict("llama3", **change))


def test_missing_config_file(tmp_path):
    with pytest.raises(ParseError, match="no config.json"):
        load_config(str(tmp_path))

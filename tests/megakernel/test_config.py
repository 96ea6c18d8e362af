"""Hugging Face config.json -> ModelConfig, in transformers 4 and 5 spellings; clear errors."""
import json

import pytest

from mdsl.errors import CheckpointError, DTypeError, ParseError, UnsupportedError
from mdsl.ir.dtypes import bf16, f32
from mdsl.megakernel.modelgraph.model_config import config_from_dict, eos_token_ids, load_config
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
    ({"architectures": ["GPTNeoXForCausalLM"]}, UnsupportedError, "GPTNeoXForCausalLM"),
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


_NO_FACTOR = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8}


@pytest.mark.parametrize("change,words", [
    ({"num_hidden_layers": 0}, r"num_hidden_layers must be a positive integer .*got 0"),
    ({"num_hidden_layers": -2}, r"num_hidden_layers must be a positive integer .*got -2"),
    ({"num_hidden_layers": True}, r"num_hidden_layers must be a positive integer .*got True"),
    ({"num_hidden_layers": 2.0}, r"num_hidden_layers must be a positive integer .*got 2\.0"),
    ({"num_attention_heads": 0}, r"num_attention_heads must be a positive integer .*got 0"),
    ({"num_key_value_heads": 3}, r"num_key_value_heads must be a divisor of num_attention_heads \(4\), got 3"),
    ({"head_dim": None, "num_attention_heads": 3, "num_key_value_heads": 1},
     r"num_attention_heads must be a divisor of hidden_size \(32\) when there is no head_dim, got 3"),
    ({"head_dim": 7}, r"head_dim must be even .*got 7"),
    ({"hidden_size": "abc"}, r"hidden_size must be a positive integer .*got 'abc'"),
    ({"vocab_size": 2**40}, r"vocab_size must be a positive integer \(at most 2147483647\), got 1099511627776"),
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps must be a positive finite number, got nan"),
    ({"rms_norm_eps": -1e-5}, r"rms_norm_eps must be a positive finite number, got -1e-05"),
    ({"rms_norm_eps": 10**400}, r"rms_norm_eps must be a positive finite number, got 1000"),
    ({"rms_norm_eps": "1e-5"}, r"rms_norm_eps must be a positive finite number, got '1e-5'"),
    ({"rope_theta": 0}, r"rope_theta must be a positive finite number, got 0"),
    ({"hidden_act": ["silu"]}, r"hidden_act must be a string, got \['silu'\]"),
    ({"tie_word_embeddings": "no"}, r"tie_word_embeddings must be true or false, got 'no'"),
    ({"attention_bias": "false"}, r"attention_bias must be true or false"),
    ({"torch_dtype": 16}, r"torch_dtype must be a string, got 16"),
    ({"architectures": "LlamaForCausalLM"}, r"architectures must be a list of class names"),
    ({"architectures": [{"a": 1}]}, r"architectures must be a list of class names"),
    ({"rope_scaling": _NO_FACTOR}, r"the config has no rope_scaling\.factor"),
    ({"rope_scaling": dict(_NO_FACTOR, factor="8")}, r"rope_scaling\.factor must be a positive finite number"),
    ({"rope_scaling": dict(_NO_FACTOR, factor=8.0, high_freq_factor=1.0)},
     r"rope_scaling\.high_freq_factor must be larger than low_freq_factor \(1\.0\), got 1\.0"),
    ({"rope_scaling": dict(_NO_FACTOR, factor=8.0, original_max_position_embeddings=-8)},
     r"rope_scaling\.original_max_position_embeddings must be a positive integer"),
    ({"rope_scaling": [8.0]}, r"rope_scaling must be an object \(or null\), got \[8\.0\]"),
    ({"rope_scaling": {"rope_type": 3}}, r"rope_scaling\.rope_type must be a string, got 3"),
    ({"rope_parameters": "x"}, r"rope_parameters must be an object"),
    ({"max_position_embeddings": 0}, r"max_position_embeddings must be a positive integer"),
])
def test_config_fields_are_type_and_range_checked(change, words):
    with pytest.raises(CheckpointError, match=words) as info:
        config_from_dict(tiny_config_dict("llama3", **change), "ckpt/config.json")
    assert str(info.value).startswith("ckpt/config.json: ") and "\nhint: " in str(info.value)


@pytest.mark.parametrize("text,words", [
    ("[1, 2]", "the config is an array, not a JSON object"),
    ("null", "the config is null, not a JSON object"),
    ("{\"vocab_size\": ", "not valid JSON"),
    ("[" * 100000, "not valid JSON"),
    ("\udcff", "not valid JSON"),
])
def test_a_config_file_that_is_not_a_json_object(tmp_path, text, words):
    (tmp_path / "config.json").write_text(text, errors="surrogateescape")
    with pytest.raises(CheckpointError, match=words) as info:
        load_config(str(tmp_path))
    assert str(tmp_path / "config.json") in str(info.value)


def test_a_config_path_that_loops_or_is_a_folder(tmp_path):
    (tmp_path / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="cannot read the config .*symbolic links"):
        load_config(str(tmp_path))
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(CheckpointError, match="the config is not a regular file"):
        load_config(str(tmp_path))


def test_max_positions_must_be_positive(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict("llama3")))
    for bad in (0, -3, 2.5):
        with pytest.raises(CheckpointError, match="max_positions must be a positive integer"):
            load_config(str(tmp_path), max_positions=bad)


def test_eos_ids_are_checked(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**tiny_config_dict("llama3"), "eos_token_id": 95}))
    assert eos_token_ids(str(tmp_path), 96) == (95,)
    generation = tmp_path / "generation_config.json"
    for value, words in ((96, r"each 0\.\.95, got 96"), ("2", "got '2'"), ([1, None], r"got \[1, None\]"),
                         ([True], r"got \[True\]"), (-1, "got -1"), ({"id": 1}, "got {'id': 1}")):
        generation.write_text(json.dumps({"eos_token_id": value}))
        with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id must be a token id or a "
                                                  r"list of token ids, .*" + words):
            eos_token_ids(str(tmp_path), 96)
    generation.write_text("{broken")
    with pytest.raises(CheckpointError, match=r"generation_config\.json: the generation config is not valid JSON"):
        eos_token_ids(str(tmp_path), 96)
    generation.write_text("[]")
    with pytest.raises(CheckpointError, match=r"generation_config\.json: the file is an array, not a JSON object"):
        eos_token_ids(str(tmp_path), 96)
    generation.write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert eos_token_ids(str(tmp_path), 96) == (3, 4)

"""The safetensors reader and writer, sharded checkpoints, and checks against the model graph."""
import json
import struct

import numpy as np
import pytest

from mdsl.errors import DTypeError, ParseError, ShapeError
from mdsl.ir.dtypes import bf16, round_to_dtype
from mdsl.megakernel.architectures import step_function
from mdsl.megakernel.checkpoint import load_model, load_weights, save_checkpoint
from mdsl.megakernel.config import load_config
from mdsl.megakernel.safetensors import (INDEX_FILE, SafetensorsFile, bf16_bits_to_f32, f32_to_bf16_bits,
                                         open_checkpoint, write_safetensors)
from tests.megakernel.tiny import tiny_config_dict, tiny_model


def test_round_trip_of_every_dtype(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    path = str(tmp_path / "t.safetensors")
    write_safetensors(path, {"a32": a, "a16": a, "abf": a, "empty": np.zeros((0, 4), np.float32)},
                      {"a16": "f16", "abf": "bf16"}, {"format": "pt"})
    sf = SafetensorsFile(path)
    assert sf.metadata == {"format": "pt"}
    assert [sf.dtype_name(n) for n in ("a32", "a16", "abf")] == ["f32", "f16", "bf16"]
    np.testing.assert_array_equal(sf.read("a32"), a)
    np.testing.assert_array_equal(sf.read("a16"), a.astype(np.float16))
    np.testing.assert_array_equal(sf.read("abf"), round_to_dtype(a, bf16))
    assert sf.read("empty").shape == (0, 4)
    # the layout: u64 header length, JSON header, data 8-byte aligned
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert header["a32"]["data_offsets"] == [0, 60] and (8 + n) % 8 == 0


def test_bf16_rounds_to_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf, np.nan], np.float32)
    back = bf16_bits_to_f32(f32_to_bf16_bits(x))
    np.testing.assert_array_equal(back[:5], [1.0, 1.0, 1.0 + 2**-6, -2.5, np.inf])
    assert np.isnan(back[5])


@pytest.mark.parametrize("payload,words", [
    (struct.pack("<Q", 1 << 40), "header length"),
    (struct.pack("<Q", 4) + b"{no}", "not valid JSON"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    (b"abc", "too short"),
])
def test_malformed_files(tmp_path, payload, words):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(payload)
    with pytest.raises(ParseError, match=words):
        SafetensorsFile(str(path))


def test_offsets_outside_the_data(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(ParseError, match="tensor w"):
        SafetensorsFile(str(path))


@pytest.mark.parametrize("arch,dtype", [("llama3", "float32"), ("qwen3", "bfloat16")])
def test_sharded_checkpoint_loads_every_weight(tmp_path, arch, dtype):
    _, graph, weights = tiny_model(arch)
    raw = tiny_config_dict(arch, torch_dtype=dtype)
    save_checkpoint(str(tmp_path), raw, weights, shards=3)
    assert len(set(json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"].values())) == 3
    config = load_config(str(tmp_path))
    loaded = load_weights(step_function(config).trace(config), str(tmp_path))
    for name, w in weights.items():
        expected = round_to_dtype(w, bf16) if dtype == "bfloat16" else w
        np.testing.assert_array_equal(loaded[name], expected)
    model = load_model(str(tmp_path), max_positions=12)
    assert model.config.max_positions == 12 and model.graph.max_positions == 12
    assert [(w.name, w.shape) for w in model.graph.weights] == [(w.name, w.shape) for w in graph.weights]
    assert [n.op for n in model.graph.nodes] == [n.op for n in graph.nodes]
    assert model.weights.keys() == loaded.keys()


def _checkpoint_with(tmp_path, arch, edit):
    _, graph, weights = tiny_model(arch)
    weights = dict(weights)
    edit(weights)
    save_checkpoint(str(tmp_path), tiny_config_dict(arch), weights)
    return graph


def test_missing_tensor_is_named(tmp_path):
    graph = _checkpoint_with(tmp_path, "qwen3", lambda w: w.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ParseError, match=r"no tensor model\.layers\.1\.self_attn\.k_norm\.weight \(expected f32\[8\]\)"):
        load_weights(graph, str(tmp_path))


def test_wrong_shape_is_named_with_both_shapes(tmp_path):
    def edit(w):
        w["model.layers.0.mlp.up_proj.weight"] = np.zeros((40, 32), np.float32)

    graph = _checkpoint_with(tmp_path, "llama3", edit)
    with pytest.raises(ShapeError, match=r"up_proj\.weight .* has shape \[40, 32\], expected \[48, 32\]"):
        load_weights(graph, str(tmp_path))


def test_wrong_dtype_is_named(tmp_path):
    _, graph, weights = tiny_model("llama3")
    save_checkpoint(str(tmp_path), tiny_config_dict("llama3"), weights, dtype_name="f16")
    with pytest.raises(DTypeError, match=r"model\.embed_tokens\.weight .* is f16, expected f32"):
        load_weights(graph, str(tmp_path))


def test_no_safetensors_files(tmp_path):
    with pytest.raises(ParseError, match="no \\*.safetensors"):
        open_checkpoint(str(tmp_path))

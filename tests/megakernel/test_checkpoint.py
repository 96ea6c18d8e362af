"""The safetensors reader and writer, sharded checkpoints, and checks against the model graph."""
import json
import os
import struct

import numpy as np
import pytest

from mdsl.errors import CheckpointError, DTypeError, ParseError, ShapeError
from mdsl.ir.dtypes import bf16, round_to_dtype
from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.checkpoint import (IGNORED_TENSORS, load_model, load_weights, open_pretrained,
                                                   save_checkpoint)
from mdsl.megakernel.modelgraph.model_config import load_config
from mdsl.megakernel.modelgraph.safetensors import (INDEX_FILE, SafetensorsFile, bf16_bits_to_f32, f32_to_bf16_bits,
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


def _file(path, header, data=b""):
    """A safetensors file with this header (a dict, or the JSON text itself) and data bytes."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


def _f32(shape, begin):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + 4 * int(np.prod(shape))]}


@pytest.mark.parametrize("header,data,words", [
    ({"a": _f32([2], 0), "b": _f32([2], 4)}, 12, r"the data of tensor b \(data_offsets \[4, 12\]\) overlaps tensor a"),
    ({"a": _f32([2], 0), "b": _f32([2], 12)}, 20, r"the data of tensor b .* leaves bytes 8\.\.11 unused"),
    ({"a": _f32([2], 0)}, 12, r"the tensors hold 8 of the file's 12 data bytes"),
    ({"a": _f32([2], 0), "b": _f32([4], 8)}, 16, r"tensor b \(F32\[4\]\) has data offsets \[8, 24\] that do not "
                                                 r"hold its 16 bytes within the 16 data bytes"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, 8, r"do not hold its 8 bytes"),
    ({"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, 8, r"tensor a: \"dtype\" must be a dtype name"),
    ({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, 8, r"tensor a: \"shape\" must be a list of "
                                                                      r"non-negative integers, got '2'"),
    ({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, 8, r"\"shape\" must be .*got \[2\.0\]"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8, r"\"shape\" must be .*got \[-2\]"),
    ({"a": {"dtype": "F32", "shape": [2**70], "data_offsets": [0, 8]}}, 8, r"do not hold its \d+ bytes"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, "8"]}}, 8, r"\"data_offsets\" must be two "
                                                                        r"non-negative integers"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}}, 8, r"\"data_offsets\" must be two"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, 8, r"data offsets \[8, 0\]"),
    ({"a": {"dtype": "F32", "shape": [2]}}, 8, r"tensor a has no \"data_offsets\""),
    ({"a": [1, 2]}, 8, r"tensor a has the header entry \[1, 2\]"),
    ({"a": _f32([2], 0), "__metadata__": {"format": 1}}, 8, r"\"__metadata__\" must map strings to strings"),
    ({"a": _f32([2], 0), "__metadata__": []}, 8, r"\"__metadata__\" must map strings to strings"),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {}}', 8, r"header names 'a' twice"),
    (b"[" * 50000, 0, r"not valid JSON"),
    (b'{"a": \xff}', 0, r"not valid JSON"),
    (b'{"a": 1' + b"0" * 5000 + b"}", 0, r"not valid JSON"),
])
def test_malformed_headers_are_named(tmp_path, header, data, words):
    path = _file(tmp_path / "m.safetensors", header, b"\0" * data)
    with pytest.raises(CheckpointError, match=words) as info:
        SafetensorsFile(path)
    assert str(info.value).startswith(path) and "\nhint: " in str(info.value)


def test_header_lengths_past_the_file_or_the_limit(tmp_path):
    for n in (2**64 - 1, 200 * 1024 * 1024, 17):
        path = tmp_path / f"h{n}.safetensors"
        path.write_bytes(struct.pack("<Q", n) + b"{}" + b" " * 14)
        with pytest.raises(CheckpointError, match=f"header length {n} does not fit the file"):
            SafetensorsFile(str(path))


def test_a_tensor_in_two_files_of_an_unindexed_checkpoint(tmp_path):
    write_safetensors(str(tmp_path / "a.safetensors"), {"w": np.ones(2, np.float32)})
    write_safetensors(str(tmp_path / "b.safetensors"), {"w": np.ones(2, np.float32), "v": np.ones(1, np.float32)})
    with pytest.raises(CheckpointError, match=r"tensor w is in both a\.safetensors and b\.safetensors"):
        open_checkpoint(str(tmp_path))


def _sharded(tmp_path, shards=2):
    _, graph, weights = tiny_model("llama3")
    save_checkpoint(str(tmp_path), tiny_config_dict("llama3"), weights, shards=shards)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    return graph, weights, index


def _write_index(tmp_path, index):
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))


def test_a_tensor_in_two_shards_or_missing_from_the_index(tmp_path):
    _, weights, index = _sharded(tmp_path)
    first, second = sorted(set(index["weight_map"].values()))
    moved = next(n for n, f in index["weight_map"].items() if f == first)
    shard = {n: weights[n] for n, f in index["weight_map"].items() if f == second}
    write_safetensors(str(tmp_path / second), {**shard, moved: weights[moved]})
    with pytest.raises(CheckpointError, match=f"puts tensor {moved} in {first}, but shard {second} holds it"):
        open_checkpoint(str(tmp_path))
    write_safetensors(str(tmp_path / second), {**shard, "extra.weight": np.ones(2, np.float32)})
    with pytest.raises(CheckpointError, match=f"puts tensor extra.weight nowhere, but shard {second} holds it"):
        open_checkpoint(str(tmp_path))


@pytest.mark.parametrize("name,words", [
    ("../model.safetensors", "shard file name '../model.safetensors' is not a file of the checkpoint folder"),
    ("sub/../../x.safetensors", "is not a file of the checkpoint folder"),
    ("/etc/passwd", "shard file name '/etc/passwd' is not a file of the checkpoint folder"),
    ("", "shard file name '' is not a file"),
    (7, "must map tensor names to shard file names"),
    ("gone.safetensors", "names shard gone.safetensors, which is not in"),
])
def test_index_names_outside_the_folder_or_missing(tmp_path, name, words):
    _, _, index = _sharded(tmp_path)
    index["weight_map"][next(iter(index["weight_map"]))] = name
    _write_index(tmp_path, index)
    with pytest.raises(CheckpointError, match=words) as info:
        open_checkpoint(str(tmp_path))
    assert INDEX_FILE in str(info.value) and "\nhint: " in str(info.value)


@pytest.mark.parametrize("index,words", [
    ([], r"\"weight_map\" must map tensor names to shard file names, got \[\]"),
    ({"weights": {}}, r"\"weight_map\" must map .*got None"),
    ({"weight_map": ["a"]}, r"\"weight_map\" must map .*got \['a'\]"),
])
def test_malformed_index(tmp_path, index, words):
    _sharded(tmp_path)
    _write_index(tmp_path, index)
    with pytest.raises(CheckpointError, match=words):
        open_checkpoint(str(tmp_path))
    (tmp_path / INDEX_FILE).write_text("{")
    with pytest.raises(CheckpointError, match="the shard index is not valid JSON"):
        open_checkpoint(str(tmp_path))


def test_links_out_of_the_folder_and_link_loops(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _, _, index = _sharded(folder)
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(folder / shard, outside)
    (folder / shard).symlink_to(outside)
    with pytest.raises(CheckpointError, match=f"{shard} resolves to .*elsewhere.safetensors, outside the checkpoint "
                                              "folder"):
        open_checkpoint(str(folder))
    (folder / shard).unlink()
    (folder / shard).symlink_to(folder / shard)
    with pytest.raises(CheckpointError, match="cannot resolve the shard's path .*symbolic links.*\nhint: a symbolic "
                                              "link loop"):
        open_checkpoint(str(folder))
    (folder / shard).unlink()
    (folder / shard).symlink_to(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=f"names shard {shard}, which is not in"):
        open_checkpoint(str(folder))
    (folder / shard).unlink()
    (folder / shard).mkdir()
    with pytest.raises(CheckpointError, match="the safetensors file is not a regular file"):
        open_checkpoint(str(folder))
    single = tmp_path / "single"
    single.mkdir()
    (single / "model.safetensors").symlink_to(single / "model.safetensors")
    with pytest.raises(CheckpointError, match="symbolic link loop"):
        open_checkpoint(str(single))


def test_a_hugging_face_hub_snapshot_links_into_its_blobs(tmp_path):
    """snapshot_download's layout: REPO/snapshots/REV/FILE -> ../../blobs/HASH."""
    _, graph, weights = tiny_model("llama3")
    staging = tmp_path / "staging"
    save_checkpoint(str(staging), tiny_config_dict("llama3"), weights, shards=2)
    blobs, snapshot = tmp_path / "repo" / "blobs", tmp_path / "repo" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for k, name in enumerate(sorted(os.listdir(staging))):
        os.replace(staging / name, blobs / f"blob{k}")
        (snapshot / name).symlink_to(os.path.join("..", "..", "blobs", f"blob{k}"))
    loaded = open_pretrained(str(snapshot)).weights()
    assert all(np.array_equal(loaded[n], weights[n]) for n in weights)


def test_unused_tensors_are_named(tmp_path):
    """A config of one layer over the weights of two: the second layer's tensors are named, not ignored."""
    _, _, weights = tiny_model("llama3")
    save_checkpoint(str(tmp_path), tiny_config_dict("llama3", num_hidden_layers=1), weights)
    with pytest.raises(CheckpointError, match=r"has 9 tensor\(s\) that llama3 does not use: "
                                              r"model\.layers\.1\.input_layernorm\.weight, .* and 3 more") as info:
        load_model(str(tmp_path))
    assert "the checkpoint has 2 layers and the config 1: fix num_hidden_layers" in info.value.hint
    with pytest.raises(CheckpointError, match="does not use"):
        open_pretrained(str(tmp_path))      # before any tensor data is read
    config = load_config(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not use"):
        load_weights(step_function(config).trace(config), str(tmp_path))


def test_ignored_tensors_follow_their_rules(tmp_path):
    _, graph, weights = tiny_model("qwen3")     # tied: the graph reads no lm_head.weight
    assert {r.pattern for r in IGNORED_TENSORS} >= {r"lm_head\.weight"}
    extra = {"model.layers.1.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32),
             "model.rotary_emb.inv_freq": np.ones(4, np.float32),
             "lm_head.weight": weights["model.embed_tokens.weight"]}
    save_checkpoint(str(tmp_path), tiny_config_dict("qwen3"), {**weights, **extra})
    assert load_model(str(tmp_path)).weights.keys() == weights.keys()
    # a rotary cache of a layer the model does not have is not ignored
    extra["model.layers.2.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    save_checkpoint(str(tmp_path), tiny_config_dict("qwen3"), {**weights, **extra})
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) .*: model\.layers\.2\.self_attn\.rotary_emb\.inv_freq"):
        load_model(str(tmp_path))


def test_saving_again_removes_the_earlier_saves_weight_files(tmp_path):
    _, _, weights = tiny_model("llama3")
    save_checkpoint(str(tmp_path), tiny_config_dict("llama3"), weights, shards=3)
    save_checkpoint(str(tmp_path), tiny_config_dict("llama3"), weights)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    save_checkpoint(str(tmp_path), tiny_config_dict("llama3"), weights, shards=2)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model-00001-of-00002.safetensors",
                                            "model-00002-of-00002.safetensors", INDEX_FILE]


def test_not_a_folder(tmp_path):
    with pytest.raises(CheckpointError, match="is not a checkpoint folder"):
        open_checkpoint(str(tmp_path / "missing"))


def test_layers_the_checkpoint_lacks_are_named_before_the_model_is_built(tmp_path):
    _, _, weights = tiny_model("llama3")
    save_checkpoint(str(tmp_path), tiny_config_dict("llama3", num_hidden_layers=2**31 - 1), weights)
    with pytest.raises(CheckpointError, match=r"config.json says num_hidden_layers 2147483647; checkpoint .* has no "
                                              r"tensors of layer 2 nor of 2147483644 more"):
        open_pretrained(str(tmp_path))
    save_checkpoint(str(tmp_path), tiny_config_dict("llama3"),
                    {n: w for n, w in weights.items() if not n.startswith("model.layers.0.")})
    with pytest.raises(CheckpointError, match=r"num_hidden_layers 2; .* has no tensors of layer 0\n"):
        load_model(str(tmp_path))

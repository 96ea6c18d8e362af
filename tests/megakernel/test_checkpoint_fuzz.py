"""Fuzzing the checkpoint readers: safetensors files, shard indexes, config.json and
generation_config.json, each a valid one mutated (its bytes, or its JSON structure: a value replaced by
any JSON value, a key removed or added), written to a folder and loaded. Whatever the mutation, the
only exceptions that may come out are MdslError subclasses."""
import copy
import json
import os
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdsl.errors import MdslError
from mdsl.megakernel.modelgraph.checkpoint import open_pretrained, save_checkpoint
from mdsl.megakernel.modelgraph.model_config import eos_token_ids, load_config
from mdsl.megakernel.modelgraph.safetensors import (INDEX_FILE, SINGLE_FILE, open_checkpoint, write_checkpoint_files,
                                                    write_safetensors)
from tests.megakernel.tiny import tiny_config_dict, tiny_model

FUZZ = settings(max_examples=500, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# strings the readers give meaning to: dtypes, architectures, activations, rope types, shard names
WORDS = ("F32", "F16", "BF16", "I64", "LlamaForCausalLM", "Qwen3ForCausalLM", "silu", "gelu", "llama3", "default",
         "bfloat16", "float16", "float32", "torch.bfloat16", "model.safetensors", "model-00001-of-00002.safetensors",
         "model-00002-of-00002.safetensors", "../model.safetensors", "/etc/hostname", "config.json", "", ".", "..",
         "sub/x.safetensors", "nonexistent.safetensors", "__metadata__", "\0")
TEXT = st.text(max_size=4)
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(WORDS) | TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=2),
                    max_leaves=4)


def _edit(draw, node, keys, depth=0):
    """`node` with one edit somewhere inside: replaced by any JSON value, or a key or item removed or added
    (the whole document is replaced rarely: the edits that reach a field are the ones worth having)."""
    if not isinstance(node, (dict, list)) or not node or draw(st.integers(0, 15 if depth == 0 else 3)) == 0:
        return draw(JSON)
    action = draw(st.sampled_from(("into", "into", "remove", "add")))
    if isinstance(node, dict):
        if action == "add":
            node[draw(st.sampled_from(keys) | TEXT)] = draw(JSON)
            return node
        key = draw(st.sampled_from(sorted(node)))
        if action == "remove":
            del node[key]
        else:
            node[key] = _edit(draw, node[key], keys, depth + 1)
        return node
    i = draw(st.integers(0, len(node) - 1))
    if action == "add":
        node.insert(i, draw(JSON))
    elif action == "remove":
        del node[i]
    else:
        node[i] = _edit(draw, node[i], keys, depth + 1)
    return node


@st.composite
def json_mutations(draw, doc, keys=()):
    """`doc` after one to three structured edits (`keys`: field names worth adding)."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        doc = _edit(draw, doc, list(keys) or ["x"])
    return doc


@st.composite
def byte_mutations(draw, blob: bytes, focus: int):
    """`blob` with one to four bytes changed, inserted or deleted, mostly in its first `focus` bytes, or
    cut short."""
    b = bytearray(blob)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(("set", "set", "insert", "delete", "truncate")))
        pos = draw(st.integers(0, max(0, min(len(b), focus) - 1)) | st.integers(0, max(0, len(b) - 1)))
        if kind == "set" and b:
            b[pos] = draw(st.integers(0, 255) | st.sampled_from(b'{}[]",:0-9 \\'))
        elif kind == "insert":
            b[pos:pos] = draw(st.binary(min_size=1, max_size=3) | st.sampled_from((b"{", b"]", b'"', b",", b"-1")))
        elif kind == "delete":
            del b[pos:pos + draw(st.integers(1, 3))]
        elif kind == "truncate":
            del b[pos:]
    return bytes(b)


def _tensors():
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((2, 3)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32),
            "c": np.zeros((0, 2), np.float32), "d": rng.standard_normal((3, 1)).astype(np.float32)}


def _files(write) -> dict:
    """File name -> bytes of what `write(folder)` writes into an empty folder."""
    with tempfile.TemporaryDirectory() as folder:
        write(folder)
        return {name: open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)}


VALID_FILE = _files(lambda folder: write_safetensors(os.path.join(folder, SINGLE_FILE), _tensors(),
                                                     {"b": "bf16", "d": "f16"}, {"format": "pt"}))[SINGLE_FILE]
(HEADER_LENGTH,) = struct.unpack("<Q", VALID_FILE[:8])
HEADER = json.loads(VALID_FILE[8:8 + HEADER_LENGTH])
DATA = VALID_FILE[8 + HEADER_LENGTH:]
SHARDED = _files(lambda folder: write_checkpoint_files(folder, _tensors(), shards=2))
INDEX = json.loads(SHARDED[INDEX_FILE])
WEIGHTS = {arch: _files(lambda folder: save_checkpoint(folder, {}, tiny_model(arch)[2]))[SINGLE_FILE]
           for arch in ("llama3", "qwen3")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """One folder per test, its files replaced for each example (`_put`)."""
    return str(tmp_path_factory.mktemp("fuzz"))


def _put(folder: str, files: dict) -> str:
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    for name, data in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return folder


def _load_everything(folder: str) -> None:
    """Open the checkpoint's files and read every tensor whole and sliced; MdslErrors are answers."""
    try:
        located = open_checkpoint(folder)
        for name, sf in located.items():
            sf.read(name)
            shape = sf.shape(name)
            if shape:
                sf.read_slice(name, len(shape) - 1, 0, shape[-1])
    except MdslError:
        pass


@FUZZ
@given(blob=byte_mutations(VALID_FILE, 8 + HEADER_LENGTH))
def test_safetensors_files_with_mutated_bytes(folder, blob):
    _load_everything(_put(folder, {SINGLE_FILE: blob}))


@FUZZ
@given(header=json_mutations(HEADER, ("dtype", "shape", "data_offsets", "__metadata__", "a", "e")),
       length=st.sampled_from((None, None, None)) | st.integers(0, 2**64 - 1) | st.integers(0, 400),
       data=st.sampled_from((DATA, DATA[:-2], DATA + b"\0" * 4, b"")))
def test_safetensors_headers_with_mutated_fields(folder, header, length, data):
    text = json.dumps(header).encode()
    _load_everything(_put(folder, {SINGLE_FILE: struct.pack("<Q", len(text) if length is None else length) + text
                                   + data}))


@FUZZ
@given(index=json_mutations(INDEX, ("weight_map", "metadata", "a", "b", "c", "d")))
def test_shard_indexes_with_mutated_fields(folder, index):
    _load_everything(_put(folder, {**SHARDED, INDEX_FILE: json.dumps(index).encode()}))


CONFIG_KEYS = tuple(tiny_config_dict("llama3")) + ("head_dim", "rope_parameters", "rope_type", "factor", "dtype",
                                                   "eos_token_id", "attention_bias", "hidden_act", "type")


def _open_with_config(folder: str, arch: str, config: bytes) -> None:
    """The tiny model's weights under `config`: the config read alone, the EOS ids, and the whole
    checkpoint checked."""
    _put(folder, {SINGLE_FILE: WEIGHTS[arch], "config.json": config})
    for read in (lambda: load_config(folder), lambda: eos_token_ids(folder, 96), lambda: open_pretrained(folder)):
        try:
            read()
        except MdslError:
            pass


@FUZZ
@given(arch=st.sampled_from(("llama3", "qwen3")), data=st.data())
def test_configs_with_mutated_fields(folder, arch, data):
    raw = data.draw(json_mutations(tiny_config_dict(arch, eos_token_id=[1, 2]), CONFIG_KEYS))
    _open_with_config(folder, arch, json.dumps(raw).encode())


@FUZZ
@given(arch=st.sampled_from(("llama3", "qwen3")), data=st.data())
def test_configs_with_mutated_bytes(folder, arch, data):
    text = json.dumps(tiny_config_dict(arch)).encode()
    _open_with_config(folder, arch, data.draw(byte_mutations(text, len(text))))


@FUZZ
@given(generation=json_mutations({"eos_token_id": [1, 2], "bos_token_id": 0}, ("eos_token_id",)),
       broken=st.booleans(), data=st.data())
def test_generation_configs_with_mutated_fields(folder, generation, broken, data):
    text = json.dumps(generation).encode()
    if broken:
        text = data.draw(byte_mutations(text, len(text)))
    _put(folder, {"config.json": json.dumps(tiny_config_dict("qwen3")).encode(), "generation_config.json": text})
    try:
        eos_token_ids(folder, 96)
    except MdslError:
        pass

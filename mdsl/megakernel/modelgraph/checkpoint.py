"""Hugging Face checkpoints: a folder with config.json and *.safetensors, checked against the model
graph's weights (names, shapes, dtypes) and read as float32 host arrays."""
from __future__ import annotations

import json
import os
import re
from typing import Optional

import attrs
import numpy as np

from mdsl.errors import CheckpointError, DTypeError, ParseError, ShapeError
from mdsl.ir.dtypes import round_to_dtype
from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.model import ModelFunction, ModelGraph
from mdsl.megakernel.modelgraph.model_config import ModelConfig, eos_token_ids, load_config
from mdsl.megakernel.modelgraph.safetensors import open_checkpoint, write_checkpoint_files


@attrs.frozen
class IgnoredTensor:
    """A tensor a checkpoint may hold that no model graph reads. `pattern` matches the whole name;
    `beside` (formatted with the pattern's named groups), when given, is a tensor the graph must read
    for the rule to apply: a layer's rotary cache is ignored only in a layer the model has."""

    pattern: str
    beside: Optional[str]
    why: str


IGNORED_TENSORS = (
    IgnoredTensor(r"model\.layers\.(?P<layer>\d+)\.self_attn\.rotary_emb\.(inv_freq|cos_cached|sin_cached)",
                  "model.layers.{layer}.input_layernorm.weight", "a rotary cache, recomputed from the rope config"),
    IgnoredTensor(r"model\.rotary_emb\.(inv_freq|cos_cached|sin_cached)", None,
                  "a rotary cache, recomputed from the rope config"),
    IgnoredTensor(r"lm_head\.weight", "model.embed_tokens.weight",
                  "tie_word_embeddings: the LM head is the embedding table"),
)


def ignored_by(name: str, used) -> Optional[IgnoredTensor]:
    """The rule of IGNORED_TENSORS that lets a checkpoint hold `name` unread beside the tensors `used`."""
    for rule in IGNORED_TENSORS:
        match = re.fullmatch(rule.pattern, name)
        if match and (rule.beside is None or rule.beside.format(**match.groupdict()) in used):
            return rule
    return None


def _layers(names) -> set:
    return {int(m.group(1)) for m in map(re.compile(r"model\.layers\.(\d+)\.").match, names) if m}


def _check_layer_count(config: ModelConfig, located: dict, folder: str) -> None:
    """Each layer of a built-in model has tensors (model.layers.N.*) in the checkpoint; the tensors of
    layers beyond the config's are named as unused by check_weights."""
    have = _layers(located)
    missing = [i for i in range(min(config.num_layers, max(have, default=-1) + 2)) if i not in have]
    if missing:
        count = config.num_layers - len([i for i in have if i < config.num_layers])
        raise CheckpointError(f"config.json says num_hidden_layers {config.num_layers}; checkpoint {folder} has no "
                              f"tensors of layer {missing[0]}" + (f" nor of {count - 1} more" if count > 1 else ""),
                              hint="fix num_hidden_layers in config.json, or download every shard of the checkpoint")


def check_weights(graph: ModelGraph, located: dict, folder: str) -> None:
    """Every weight of `graph` is in the opened checkpoint `located` with its shape and dtype, and every
    tensor of the checkpoint is a weight of `graph` or ignored by a rule of IGNORED_TENSORS. Reads no
    tensor data."""
    used = {w.name for w in graph.weights}
    for w in graph.weights:
        sf = located.get(w.name)
        if sf is None:
            close = [n for n in located if n.rsplit(".", 2)[-2:] == w.name.rsplit(".", 2)[-2:]][:3]
            raise CheckpointError(f"checkpoint {folder} has no tensor {w.name} (expected {w.type})",
                                  hint=f"tensors with a similar name: {close}" if close else
                                  "the checkpoint does not match the config's architecture or layer count")
        shape, dtype = sf.shape(w.name), sf.dtype_name(w.name)
        if shape != w.shape:
            raise ShapeError(f"checkpoint tensor {w.name} in {os.path.basename(sf.path)} has shape {list(shape)}, "
                             f"expected {list(w.shape)} from the config",
                             hint="the config.json does not describe these weights")
        if dtype != w.dtype.name:
            raise DTypeError(f"checkpoint tensor {w.name} in {os.path.basename(sf.path)} is {dtype}, expected "
                             f"{w.dtype.name} (the config's torch_dtype)",
                             hint="save the checkpoint in the config's dtype, or fix torch_dtype in config.json")
    unused = sorted(n for n in located if n not in used and ignored_by(n, used) is None)
    if unused:
        have, want = _layers(located), _layers(used)
        hint = (f"the checkpoint has {max(have) + 1} layers and the config {max(want, default=-1) + 1}: fix "
                "num_hidden_layers in config.json" if have - want else
                "config.json does not describe this checkpoint (its architecture or tie_word_embeddings), or the "
                "tensors belong to another model; tensors a checkpoint may hold unread: "
                "mdsl.megakernel.modelgraph.checkpoint.IGNORED_TENSORS")
        listed = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        raise CheckpointError(f"checkpoint {folder} has {len(unused)} tensor(s) that {graph.name} does not use: "
                              f"{listed}", hint=hint)


def load_weights(graph: ModelGraph, folder: str, slices: Optional[dict] = None) -> dict:
    """Every weight of `graph` from the checkpoint in `folder`, as float32 arrays (bf16 upcast exactly).
    `slices` (name -> (axis, start, stop)) reads only that slice of the tensors it names (a rank's
    shard), the whole tensor of the others; the names and shapes are still checked against `graph`."""
    return read_weights(graph, open_checkpoint(folder), folder, slices)


def read_weights(graph: ModelGraph, located: dict, folder: str, slices: Optional[dict] = None) -> dict:
    """`load_weights` from an opened checkpoint (`open_checkpoint`: name -> SafetensorsFile, whose
    `bytes_read` then says how much of each file was read); `check_weights` first."""
    slices = slices or {}
    unknown = sorted(set(slices) - {w.name for w in graph.weights})
    if unknown:
        raise ParseError(f"slices of {unknown[0]}, which is not a weight of {graph.name}")
    check_weights(graph, located, folder)
    return {w.name: np.asarray(located[w.name].read_slice(w.name, *slices[w.name]) if w.name in slices
                               else located[w.name].read(w.name), np.float32) for w in graph.weights}


def random_weights(graph: ModelGraph, seed: int = 0, scale: float = 0.08) -> dict:
    """Random weights for tests: norm weights near 1, matrices N(0, scale^2), rounded to the dtype."""
    rng = np.random.default_rng(seed)
    out = {}
    for w in graph.weights:
        if w.type.rank == 1:
            values = 1.0 + 0.1 * rng.standard_normal(w.shape)
        else:
            values = scale * rng.standard_normal(w.shape)
        out[w.name] = round_to_dtype(values.astype(np.float32), w.dtype)
    return out


def pattern_weights(graph: ModelGraph, scale: float = 0.3) -> dict:
    """Pseudo-random weights from integer arithmetic alone, the same on every machine and numpy version
    (golden values recorded with another framework stay valid): norm weights in [0.8, 1.2), matrices
    uniform in [-scale, scale), rounded to the dtype."""
    out = {}
    for k, w in enumerate(graph.weights):
        z = (np.arange(1, w.type.numel + 1, dtype=np.uint64) + np.uint64(k << 40)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)     # splitmix64's finaliser
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        u = (z >> np.uint64(40)).astype(np.float64) / float(1 << 24)       # [0, 1), 24 exact bits
        values = 0.8 + 0.4 * u if w.type.rank == 1 else scale * (2 * u - 1)
        out[w.name] = round_to_dtype(values.reshape(w.shape).astype(np.float32), w.dtype)
    return out


def save_checkpoint(folder: str, config: dict, weights: dict, *, dtype_name: Optional[str] = None,
                    shards: int = 1) -> None:
    """Write config.json and the weights (in the config's torch_dtype) the way save_pretrained does."""
    dtype_name = dtype_name or {"bfloat16": "bf16", "float16": "f16"}.get(config.get("torch_dtype"), "f32")
    write_checkpoint_files(folder, weights, {n: dtype_name for n in weights}, shards)
    tmp = os.path.join(folder, f"config.json.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, os.path.join(folder, "config.json"))


@attrs.frozen(eq=False)
class Checkpoint:
    """A checkpoint folder checked without reading its tensor data (`open_pretrained`): its config, the
    model graph, where each tensor is, and the EOS token ids."""

    folder: str
    config: ModelConfig
    graph: ModelGraph
    located: dict    # tensor name -> SafetensorsFile
    eos_token_ids: tuple

    def weights(self, slices: Optional[dict] = None) -> dict:
        """The graph's weights as float32 arrays (see load_weights)."""
        return read_weights(self.graph, self.located, self.folder, slices)


def open_pretrained(folder: str, max_positions: Optional[int] = None,
                    step: Optional[ModelFunction] = None) -> Checkpoint:
    """A Hugging Face checkpoint folder checked whole before any tensor data is read: config.json's
    fields, the safetensors headers and index, every tensor's name, shape and dtype against the model
    graph of its architecture's built-in step function (or `step`), no tensor left unaccounted for, and
    the EOS ids of generation_config.json / config.json."""
    config = load_config(folder, max_positions)
    located = open_checkpoint(folder)
    if step is None:   # (before tracing, which takes time in proportion to the layers the config claims)
        _check_layer_count(config, located, folder)
    graph = (step or step_function(config)).trace(config)
    check_weights(graph, located, folder)
    return Checkpoint(folder, config, graph, located, eos_token_ids(folder, config.vocab_size))


@attrs.frozen(eq=False)
class LoadedModel:
    config: ModelConfig
    graph: ModelGraph
    weights: dict    # name -> float32 array


def load_model(folder: str, max_positions: Optional[int] = None, step: Optional[ModelFunction] = None) -> LoadedModel:
    """A Hugging Face checkpoint folder's config, the model graph of its architecture's built-in step
    function (or `step`), and its weights, checked against the graph (`open_pretrained`)."""
    checkpoint = open_pretrained(folder, max_positions, step)
    return LoadedModel(checkpoint.config, checkpoint.graph, checkpoint.weights())

"""A reader and writer of the safetensors format (no pickle, no torch).

A file is: an unsigned 64-bit little-endian header length N, N bytes of JSON mapping each tensor name
to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data after the header; an
optional "__metadata__" maps strings to strings), then the raw little-endian data. F32, F16 and BF16
are supported; bf16 is read as float32 (its bits shifted into the high half). A sharded checkpoint has
`model.safetensors.index.json` with {"weight_map": {tensor name: file name}}.

Everything read is checked before it is used, as the format's reference reader checks it: the tensors'
data ranges tile the data exactly (no overlap, no gap, nothing past the end), each tensor is in one file
of the checkpoint, and every file an index names resolves inside the checkpoint's folder. Each problem
is a CheckpointError naming the file and the field.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from typing import Any, Optional

import numpy as np

from mdsl.errors import CheckpointError, DTypeError, ShapeError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_STORED = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_NAMES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
_MAX_HEADER = 100 * 1024 * 1024
_MAX_JSON = 64 * 1024 * 1024       # config.json, generation_config.json, the index: kilobytes in practice
_REWRITE = "the file is damaged or was not written by a safetensors writer: save the model again with " \
           "save_pretrained(..., safe_serialization=True)"


def shown(value: Any, limit: int = 80) -> str:
    """A value as an error message quotes it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words: an array, a string, null, ..."""
    kinds = ((bool, "a boolean"), (dict, "an object"), (list, "an array"), (str, "a string"), ((int, float), "a number"))
    return next((kind for cls, kind in kinds if isinstance(value, cls)), "null")


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _regular_file_size(path: str, what: str) -> int:
    """The size of `path`, which must be (or link to) a regular file: a device, a pipe or a folder under
    a checkpoint's file name is refused before it is opened (reading one may never end)."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the {what} ({_reason(e)})",
                              hint="a missing file, a broken or looping symbolic link, or no permission") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path}: the {what} is not a regular file", hint=f"put the {what} there itself")
    return info.st_size


def read_json_file(path: str, what: str) -> Any:
    """A checkpoint's JSON file (`what` names it in errors), at most 64 MiB."""
    _regular_file_size(path, what)
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_JSON + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the {what} ({_reason(e)})") from None
    if len(data) > _MAX_JSON:
        raise CheckpointError(f"{path}: the {what} is larger than {_MAX_JSON >> 20} MiB",
                              hint=f"a {what} has a few kilobytes: the file is not one")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:   # (ValueError: bad JSON, bad UTF-8, an integer too long)
        raise CheckpointError(f"{path}: the {what} is not valid JSON ({str(e)[:200]})",
                              hint=f"repair or download the {what} again") from None


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _Duplicate(next(k for k in keys if keys.count(k) > 1))
    return dict(pairs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    # (one pass: astype then << makes two, 3-10x slower on a large checkpoint)
    return np.left_shift(bits, 16, dtype=np.uint32).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of float32 to bf16, as bit patterns (NaN stays NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _decoded(values: np.ndarray, stored: str) -> np.ndarray:
    """Stored little-endian values as a fresh native array: float32 for bf16 (upcast), else as stored."""
    if stored == "BF16":
        return bf16_bits_to_f32(values)
    return values.astype(values.dtype.newbyteorder("="), copy=True)


class SafetensorsFile:
    """One file's header, checked when read, with tensors read on demand through a memory map."""

    def __init__(self, path: str):
        self.path = path
        size = _regular_file_size(path, "safetensors file")
        try:
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise CheckpointError(f"{path}: too short for a safetensors file ({size} bytes)", hint=_REWRITE)
                (n,) = struct.unpack("<Q", raw)
                if n > min(_MAX_HEADER, size - 8):
                    raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes) or "
                                          f"exceeds {_MAX_HEADER >> 20} MiB", hint=_REWRITE)
                text = f.read(n)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read the safetensors file ({_reason(e)})") from None
        if len(text) < n:
            raise CheckpointError(f"{path}: the file ends inside its {n}-byte header", hint=_REWRITE)
        try:
            header = json.loads(text, object_pairs_hook=_no_duplicates)
        except _Duplicate as e:
            raise CheckpointError(f"{path}: the safetensors header names {shown(e.args[0])} twice",
                                  hint=_REWRITE) from None
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({str(e)[:200]})",
                                  hint=_REWRITE) from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: the safetensors header is not a JSON object", hint=_REWRITE)
        metadata = header.pop("__metadata__", None)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointError(f"{path}: \"__metadata__\" must map strings to strings, got {shown(metadata)}",
                                  hint=_REWRITE)
        self.metadata = metadata
        self.data_start = 8 + n
        self.data_size = size - self.data_start
        self.entries = header
        self.bytes_read = 0    # tensor data bytes read so far (the header not counted)
        for name, entry in header.items():
            self._check_entry(name, entry)
        self._check_layout()

    def _field_error(self, name: str, field: str, expected: str, value: Any) -> CheckpointError:
        return CheckpointError(f"{self.path}: tensor {name}: \"{field}\" must be {expected}, got {shown(value)}",
                               hint=_REWRITE)

    def _check_entry(self, name: str, entry: Any) -> None:
        if not isinstance(entry, dict):
            raise CheckpointError(f"{self.path}: tensor {name} has the header entry {shown(entry)}, not "
                                  "{\"dtype\", \"shape\", \"data_offsets\"}", hint=_REWRITE)
        for field in ("dtype", "shape", "data_offsets"):
            if field not in entry:
                raise CheckpointError(f"{self.path}: tensor {name} has no \"{field}\"", hint=_REWRITE)
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str):
            raise self._field_error(name, "dtype", "a dtype name such as \"BF16\"", dtype)
        if dtype not in _STORED:
            raise DTypeError(f"{self.path}: tensor {name} has dtype {shown(dtype)}",
                             hint="mdsl reads F32, F16 and BF16 checkpoints")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise self._field_error(name, "shape", "a list of non-negative integers", shape)
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) and o >= 0 for o in offsets):
            raise self._field_error(name, "data_offsets", "two non-negative integers [begin, end]", offsets)
        begin, end = offsets
        nbytes = math.prod(shape) * _STORED[dtype].itemsize
        if not begin <= end <= self.data_size or end - begin != nbytes:
            raise CheckpointError(f"{self.path}: tensor {name} ({dtype}{shape}) has data offsets [{begin}, {end}] "
                                  f"that do not hold its {nbytes} bytes within the {self.data_size} data bytes",
                                  hint=_REWRITE)

    def _check_layout(self) -> None:
        """The tensors' data ranges, in order, tile the data: each begins where the one before ends."""
        at, previous = 0, None
        for begin, end, name in sorted((*e["data_offsets"], name) for name, e in self.entries.items()):
            if begin != at:
                where = f"overlaps tensor {previous}" if begin < at else f"leaves bytes {at}..{begin - 1} unused"
                raise CheckpointError(f"{self.path}: the data of tensor {name} (data_offsets [{begin}, {end}]) "
                                      f"{where}", hint=_REWRITE)
            at, previous = end, name
        if at != self.data_size:
            raise CheckpointError(f"{self.path}: the tensors hold {at} of the file's {self.data_size} data bytes",
                                  hint=_REWRITE)

    def names(self) -> list:
        return list(self.entries)

    def dtype_name(self, name: str) -> str:
        return _NAMES[self.entries[name]["dtype"]]

    def shape(self, name: str) -> tuple:
        return tuple(self.entries[name]["shape"])

    def _changed(self, name: str, e: Exception) -> CheckpointError:
        return CheckpointError(f"{self.path}: cannot read tensor {name} ({e}); the file changed after its header "
                               "was read", hint="do not write a checkpoint while it is loaded")

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32 (bf16 upcast) or float16, a fresh array."""
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        stored = _STORED[entry["dtype"]]
        try:
            raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_start + begin,
                            shape=(end - begin,)) if end > begin else np.zeros(0, np.uint8)
        except (OSError, ValueError) as e:
            raise self._changed(name, e) from None
        self.bytes_read += end - begin
        return _decoded(np.frombuffer(raw, dtype=stored).reshape(entry["shape"]), entry["dtype"])

    def read_slice(self, name: str, axis: int, start: int, stop: int) -> np.ndarray:
        """Indices start..stop of one axis of the tensor (all of the others), reading from the file only
        the bytes of that slice: one contiguous run per index of the axes before `axis`."""
        entry = self.entries[name]
        shape = tuple(entry["shape"])
        if not (0 <= axis < len(shape) and 0 <= start <= stop <= shape[axis]):
            raise ShapeError(f"{self.path}: cannot slice {start}:{stop} of axis {axis} of tensor {name} "
                             f"(shape {list(shape)})")
        stored = _STORED[entry["dtype"]]
        inner = math.prod(shape[axis + 1:]) * stored.itemsize
        outer = math.prod(shape[:axis])
        run = (stop - start) * inner
        out = np.empty(outer * run, np.uint8)
        base = self.data_start + entry["data_offsets"][0] + start * inner
        try:
            with open(self.path, "rb", buffering=0) as f:
                for i in range(outer if run else 0):
                    got = os.preadv(f.fileno(), [memoryview(out)[i * run:(i + 1) * run]],
                                    base + i * shape[axis] * inner)
                    if got != run:
                        raise CheckpointError(f"{self.path}: tensor {name} ends early (read {got} of {run} bytes "
                                              "of its slice)", hint="the file changed after its header was read")
                    self.bytes_read += got
        except OSError as e:
            raise self._changed(name, e) from None
        sliced = (*shape[:axis], stop - start, *shape[axis + 1:])
        return _decoded(out.view(stored).reshape(sliced), entry["dtype"])


def write_safetensors(path: str, tensors: dict, dtypes: Optional[dict] = None,
                      metadata: Optional[dict] = None) -> None:
    """Write `tensors` (name -> array) to `path` atomically; `dtypes` maps a name to "f32" | "f16" |
    "bf16" (default: f16 for float16 arrays, else f32). A bf16 tensor may be given as its values or as its
    uint16 bit patterns. Tensors are encoded one at a time as they are written, so a large checkpoint
    needs no second copy of itself in memory."""
    dtypes = dtypes or {}
    header: dict = {}
    kinds = {}
    offset = 0
    for name, array in tensors.items():
        kind = dtypes.get(name) or ("f16" if np.asarray(array).dtype == np.float16 else "f32")
        if kind not in _ITEMSIZE:
            raise DTypeError(f"cannot write tensor {name} as {kind!r}", hint="use f32, f16 or bf16")
        size = int(np.prod(np.shape(array), dtype=np.int64)) * _ITEMSIZE[kind]
        header[name] = {"dtype": {"f32": "F32", "f16": "F16", "bf16": "BF16"}[kind],
                        "shape": list(np.shape(array)), "data_offsets": [offset, offset + size]}
        kinds[name] = kind
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)   # the format aligns the data to 8 bytes
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, array in tensors.items():
            f.write(_encoded(array, kinds[name]).data)
    os.replace(tmp, path)


_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


def _encoded(array, kind: str) -> np.ndarray:
    """A tensor's little-endian bytes as stored for `kind`, as a contiguous array."""
    if kind == "bf16":
        array = np.asarray(array)
        bits = array if array.dtype == np.uint16 else f32_to_bf16_bits(np.asarray(array, np.float32))
        return np.ascontiguousarray(bits, dtype="<u2").reshape(-1)
    return np.ascontiguousarray(array, dtype="<f2" if kind == "f16" else "<f4").reshape(-1)


def write_checkpoint_files(folder: str, tensors: dict, dtypes: Optional[dict] = None, shards: int = 1) -> list:
    """Write `tensors` into `folder` as model.safetensors, or as `shards` files with an index."""
    os.makedirs(folder, exist_ok=True)
    names = list(tensors)
    if shards <= 1:
        write_safetensors(os.path.join(folder, SINGLE_FILE), tensors, dtypes, {"format": "pt"})
        _remove_stale(folder, [SINGLE_FILE])
        return [SINGLE_FILE]
    files, weight_map = [], {}
    per = -(-len(names) // shards)
    for i in range(shards):
        part = names[i * per:(i + 1) * per]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(os.path.join(folder, file), {n: tensors[n] for n in part}, dtypes, {"format": "pt"})
        weight_map.update({n: file for n in part})
        files.append(file)
    tmp = os.path.join(folder, INDEX_FILE + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    os.replace(tmp, os.path.join(folder, INDEX_FILE))
    _remove_stale(folder, files + [INDEX_FILE])
    return files


def _remove_stale(folder: str, written: list) -> None:
    """Remove the weight files (and index) of an earlier save that this one did not write, as
    save_pretrained does: left behind, they would be tensors held twice or an index of other shards."""
    for name in os.listdir(folder):
        if name not in written and re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors|" + re.escape(INDEX_FILE), name):
            os.remove(os.path.join(folder, name))


def _within(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _roots(folder: str) -> list:
    """Where a checkpoint's files may resolve: inside its folder, and for a snapshot folder of the Hugging
    Face hub's cache (REPO/snapshots/REVISION, whose files link to REPO/blobs/HASH) inside its blobs."""
    real = os.path.realpath(folder)
    roots = [real]
    snapshots = os.path.dirname(real)
    if os.path.basename(snapshots) == "snapshots":
        roots.append(os.path.join(os.path.dirname(snapshots), "blobs"))
    return roots


def shard_path(folder: str, name: Any, source: str) -> str:
    """The path of the checkpoint file `name` (as `source`, an index or the folder, gives it): a relative
    name without `..`, resolving (through any links) to a file inside the folder, or a hub cache's blob."""
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name) \
            or ".." in re.split(r"[\\/]", name) or re.match(r"[A-Za-z]:", name):
        raise CheckpointError(f"{source}: shard file name {shown(name)} is not a file of the checkpoint folder",
                              hint="a shard index names files beside it, such as model-00001-of-00002.safetensors")
    path = os.path.join(folder, name)
    try:
        real = os.path.realpath(path, strict=True)
    except FileNotFoundError:
        raise CheckpointError(f"{source} names shard {name}, which is not in {folder}",
                              hint="download every shard the index lists, or save the model again") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot resolve the shard's path ({_reason(e)})",
                              hint="a symbolic link loop: link the shard to its file") from None
    if not any(_within(real, root) for root in _roots(folder)):
        raise CheckpointError(f"{path} resolves to {real}, outside the checkpoint folder {folder}",
                              hint="copy the shard into the folder instead of linking to it")
    return path


def open_checkpoint(folder: str) -> dict:
    """Tensor name -> the SafetensorsFile holding it, from the index or from every *.safetensors file;
    only the headers are read. Each tensor must be in one file, and an index must list every tensor of
    the files it names (in the file that holds it)."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder} is not a checkpoint folder",
                              hint="pass a folder with config.json and *.safetensors files")
    index = os.path.join(folder, INDEX_FILE)
    if os.path.lexists(index):
        return _open_indexed(folder, index, read_json_file(index, "shard index"))
    try:
        names = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))
    except OSError as e:
        raise CheckpointError(f"{folder}: cannot list the checkpoint folder ({_reason(e)})") from None
    if not names:
        raise CheckpointError(f"no *.safetensors files in {folder}",
                              hint="save the model with save_pretrained(..., safe_serialization=True)")
    located: dict = {}
    for name in names:
        sf = SafetensorsFile(shard_path(folder, name, folder))
        for tensor in sf.names():
            if tensor in located:
                raise CheckpointError(f"{folder}: tensor {tensor} is in both {os.path.basename(located[tensor].path)} "
                                      f"and {name}", hint="a checkpoint holds each tensor once: remove the stale file")
            located[tensor] = sf
    return located


def _open_indexed(folder: str, index: str, raw: Any) -> dict:
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: \"weight_map\" must map tensor names to shard file names, got "
                              f"{shown(weight_map if isinstance(raw, dict) else raw)}",
                              hint="repair or download the index again")
    files = {file: SafetensorsFile(shard_path(folder, file, index)) for file in sorted(set(weight_map.values()))}
    for file, sf in files.items():
        for tensor in sf.names():
            if weight_map.get(tensor) != file:
                where = f"in {weight_map[tensor]}" if tensor in weight_map else "nowhere"
                raise CheckpointError(f"{index} puts tensor {tensor} {where}, but shard {file} holds it",
                                      hint="the index and its shards disagree: save the model again")
    for tensor, file in weight_map.items():
        if tensor not in files[file].entries:
            raise CheckpointError(f"{index} puts tensor {tensor} in {file}, which does not hold it",
                                  hint="the index and its shards disagree: save the model again")
    return {tensor: files[file] for tensor, file in weight_map.items()}

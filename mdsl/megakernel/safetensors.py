"""A reader and writer of the safetensors format (no pickle, no torch).

A file is: an unsigned 64-bit little-endian header length N, N bytes of JSON mapping each tensor name
to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data after the header; an
optional "__metadata__" maps strings to strings), then the raw little-endian data. F32, F16 and BF16
are supported; bf16 is read as float32 (its bits shifted into the high half). A sharded checkpoint has
`model.safetensors.index.json` with {"weight_map": {tensor name: file name}}.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Optional

import numpy as np

from mdsl.errors import DTypeError, ParseError, ShapeError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_STORED = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_NAMES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
_MAX_HEADER = 100 * 1024 * 1024


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


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
    """One file's header, with tensors read on demand through a memory map."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise ParseError(f"{path}: too short for a safetensors file ({size} bytes)")
                (n,) = struct.unpack("<Q", raw)
                if n > min(_MAX_HEADER, size - 8):
                    raise ParseError(f"{path}: header length {n} does not fit the file ({size} bytes)")
                header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ParseError(f"{path}: the safetensors header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise ParseError(f"{path}: the safetensors header is not a JSON object")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + n
        self.data_size = size - self.data_start
        self.entries = header
        self.bytes_read = 0    # tensor data bytes read so far (the header not counted)
        for name, entry in header.items():
            self._check_entry(name, entry)

    def _check_entry(self, name: str, entry) -> None:
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ParseError(f"{self.path}: tensor {name} has a malformed header entry {entry!r}") from None
        if dtype not in _STORED:
            raise DTypeError(f"{self.path}: tensor {name} has dtype {dtype}",
                             hint="mdsl reads F32, F16 and BF16 checkpoints")
        nbytes = int(np.prod(shape, dtype=np.int64)) * _STORED[dtype].itemsize
        if not (0 <= begin <= end <= self.data_size) or end - begin != nbytes:
            raise ParseError(f"{self.path}: tensor {name} ({dtype}{shape}) has data offsets [{begin}, {end}] that "
                             f"do not hold its {nbytes} bytes within the {self.data_size} data bytes")

    def names(self) -> list:
        return list(self.entries)

    def dtype_name(self, name: str) -> str:
        return _NAMES[self.entries[name]["dtype"]]

    def shape(self, name: str) -> tuple:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32 (bf16 upcast) or float16, a fresh array."""
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        stored = _STORED[entry["dtype"]]
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_start + begin, shape=(end - begin,)) \
            if end > begin else np.zeros(0, np.uint8)
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
        inner = int(np.prod(shape[axis + 1:], dtype=np.int64)) * stored.itemsize
        outer = int(np.prod(shape[:axis], dtype=np.int64))
        run = (stop - start) * inner
        out = np.empty(outer * run, np.uint8)
        base = self.data_start + entry["data_offsets"][0] + start * inner
        with open(self.path, "rb", buffering=0) as f:
            for i in range(outer if run else 0):
                got = os.preadv(f.fileno(), [memoryview(out)[i * run:(i + 1) * run]], base + i * shape[axis] * inner)
                if got != run:
                    raise ParseError(f"{self.path}: tensor {name} ends early (read {got} of {run} bytes of its slice)")
                self.bytes_read += got
        sliced = (*shape[:axis], stop - start, *shape[axis + 1:])
        return _decoded(out.view(stored).reshape(sliced), entry["dtype"])


def write_safetensors(path: str, tensors: dict, dtypes: Optional[dict] = None,
                      metadata: Optional[dict] = None) -> None:
    """Write `tensors` (name -> array) to `path` atomically; `dtypes` maps a name to "f32" | "f16" |
    "bf16" (default: f16 for float16 arrays, else f32)."""
    dtypes = dtypes or {}
    header: dict = {}
    blobs = []
    offset = 0
    for name, array in tensors.items():
        kind = dtypes.get(name) or ("f16" if np.asarray(array).dtype == np.float16 else "f32")
        if kind == "bf16":
            data = f32_to_bf16_bits(np.asarray(array, np.float32)).astype("<u2").tobytes()
        elif kind in ("f16", "f32"):
            data = np.ascontiguousarray(array, dtype="<f2" if kind == "f16" else "<f4").tobytes()
        else:
            raise DTypeError(f"cannot write tensor {name} as {kind!r}", hint="use f32, f16 or bf16")
        header[name] = {"dtype": {"f32": "F32", "f16": "F16", "bf16": "BF16"}[kind],
                        "shape": list(np.shape(array)), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)   # the format aligns the data to 8 bytes
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def write_checkpoint_files(folder: str, tensors: dict, dtypes: Optional[dict] = None, shards: int = 1) -> list:
    """Write `tensors` into `folder` as model.safetensors, or as `shards` files with an index."""
    os.makedirs(folder, exist_ok=True)
    names = list(tensors)
    if shards <= 1:
        write_safetensors(os.path.join(folder, SINGLE_FILE), tensors, dtypes, {"format": "pt"})
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
    return files


def open_checkpoint(folder: str) -> dict:
    """Tensor name -> the SafetensorsFile holding it, from the index or from every *.safetensors file."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ParseError(f"{index}: not a safetensors index ({e!r})") from None
        files = {file: SafetensorsFile(os.path.join(folder, file)) for file in sorted(set(weight_map.values()))}
        located = {}
        for name, file in weight_map.items():
            if name not in files[file].entries:
                raise ParseError(f"{index} puts tensor {name} in {file}, which does not hold it")
            located[name] = files[file]
        return located
    paths = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors")) if os.path.isdir(folder) else []
    if not paths:
        raise ParseError(f"no *.safetensors files in {folder}", hint="save the model with save_pretrained("
                                                                    "..., safe_serialization=True)")
    return {name: sf for sf in map(lambda p: SafetensorsFile(os.path.join(folder, p)), paths) for name in sf.names()}


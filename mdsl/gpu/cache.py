"""Where compiled code is cached on disk: one directory per kind of entry (`cubin`, `ptx`, `autotune`)
under `$MDSL_CACHE_DIR` (default `~/.cache/mdsl`). Entries are written atomically (`write_atomic`: a
reader sees the whole entry or none); each kind's reader validates what it reads."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MDSL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mdsl"))


def cache_dir(kind: str) -> Path:
    return cache_root() / kind


def write_atomic(path: Path, data: bytes) -> None:
    """`data` into `path` through a temporary file in the same directory and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

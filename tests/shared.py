"""What the suite's processes (the pytest-xdist workers, or the one process without them) share, in a
directory of the session's own (`shared_dir`, made by tests/conftest.py, removed after the session):

* NVRTC's cubin cache and the PTX cache, for the modules marked `shared_compile_cache`: a module that
  compiles the same source as another test (an option set that changes nothing in a program, the same
  plan in the CUDA and the PTX tests) finds its entry there instead of compiling it again. The entries
  are mdsl's own (keyed by the source, target, options and compiler version, written atomically,
  checked when read); every other test has a cache directory of its own. `compiled_once` compiles a
  program there once for the whole test run, whichever processes ask for it.
* the SASS of cubins (`disassembled`): nvdisasm takes most of a second for any cubin, and the SASS
  tests read the same cubins (the CUDA backend's kernels against the PTX backend's, a program under
  several option sets that emit the same code).
* mugraphs that searches find (`shared_graph`): the guided plans the tests take, each searched by the
  first process that needs it, on first use (never while the tests are collected).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Optional

from mdsl.backend.cuda.nvrtc import compile_cuda, disassemble

SHARED_DIR_ENV = "MDSL_TEST_SHARED_DIR"
_SASS: dict = {}


def shared_dir() -> Optional[Path]:
    """The session's shared directory (None outside a pytest session of this suite)."""
    path = os.environ.get(SHARED_DIR_ENV)
    return Path(path) if path else None


def _write_atomically(path: Path, text: str) -> None:
    """`text` into `path`, atomically: another process reads the whole text or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def disassembled(cubin: bytes) -> str:
    """`mdsl.backend.cuda.nvrtc.disassemble(cubin)`, once per suite for each cubin."""
    key = hashlib.sha256(cubin).hexdigest()
    if key in _SASS:
        return _SASS[key]
    root = shared_dir()
    path = root / "sass" / f"{key}.txt" if root else None
    sass = None
    if path is not None:
        try:
            sass = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            pass
    if sass is None:
        sass = disassemble(cubin)
        if path is not None:
            _write_atomically(path, sass)
    _SASS[key] = sass
    return sass


def shared_graph(key: str, compute):
    """`compute()`, a mugraph (a search's result, say), once per session: the first process of the session
    to ask computes it while the others wait, and they read it from the shared directory (its JSON form,
    mdsl.ir.serialize, which parses back to an equal graph). `key` names it (a file name)."""
    from mdsl.ir import serialize

    root = shared_dir()
    if root is None:
        return compute()
    path = root / "graphs" / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes, or when its process dies
        try:
            return serialize.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            pass
        graph = compute()
        _write_atomically(path, serialize.dumps(graph))
        return graph


def program_text(source: str) -> str:
    """CUDA C++ `source` with its comment lines blank: the same program line for line (a comment is whitespace to
    the compiler, and NVRTC makes the same cubin), so that sources that differ only in their comments (the model
    named in a megakernel's header) are one cache entry. A comment line that ends in a backslash stays: the line
    after it is part of the comment."""
    return "\n".join("" if line.lstrip().startswith("//") and not line.endswith("\\") else line
                     for line in source.split("\n"))


def compiled_once(source: str, arch: str):
    """`compile_cuda(program_text(source), arch=arch)`, once per test run for each program: the first process to
    ask compiles it while any other that asks meanwhile waits, and the others read it from the test run's shared cubin
    cache (the tests of a module marked `shared_compile_cache`; elsewhere each test compiles its own)."""
    text = program_text(source)
    root = shared_dir()
    if root is None:
        return compile_cuda(text, arch=arch)
    key = hashlib.sha256((arch + "\n" + text).encode()).hexdigest()
    path = root / "compiling" / f"{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes, or when its process dies
        return compile_cuda(text, arch=arch)

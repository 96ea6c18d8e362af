"""Compiling what both backends emit, without a GPU: NVRTC (CUDA C++ to a cubin) and llvmlite (LLVM IR to
PTX). Their disk caches (a second compile answered from the cache, another target or option set another
entry, corrupt entries compiled again and repaired, entries written atomically) and their errors (the
rejected line shown with the code around it and the mugraph op whose code holds it). Each compiler's own:
tests/backend/cuda/test_cuda_nvrtc.py, tests/backend/ptx/test_ptx_compile.py."""
from __future__ import annotations

import os
import warnings

import attrs
import pytest

import mdsl
from mdsl.backend.cuda import CompileError, compile_cuda, emit_cuda
from mdsl.backend.cuda import nvrtc
from mdsl.backend.ptx import PtxCompileError, compile_ptx, emit_llvm, llvm_to_ptx
from mdsl.backend.ptx import compile as ptx_compile
from mdsl.gpu.cache import cache_dir
from mdsl.lowering.names import OP_MARKER
from tests.backend.backends import EMITTERS
from tests.backend.cuda.builder import Graph
from tests.strategies import example_graphs

TINY = """\
extern "C" __global__ void tiny(float* out) {
  // mugraph: %y: f32[32] = neg(%x)
  out[threadIdx.x] = -out[threadIdx.x];
}
"""


def small_graph(name: str = "small"):
    g = Graph(name)
    x = g.input("x", (8, 96), mdsl.f16)
    g.op("exp", g.op("add", x, g.input("row", (96,), mdsl.f16)))
    return g.build()


@attrs.frozen
class Compiler:
    """What the cache tests need of a backend's compiler."""

    backend: str
    code: object            # () -> the code compiled
    compile: object         # (code, **other) -> the compiled module
    other: dict             # keyword arguments that make another cache entry
    step: tuple             # (module, name): the compile step the cache saves
    entries: str            # the cache's directory (mdsl.gpu.cache.cache_dir) and its entries' suffix
    word: str               # the cache's name in its warnings
    product: object         # module -> what a compile must reproduce (NVRTC's log holds its compile time)


COMPILERS = {
    "cuda": Compiler("cuda", lambda: TINY, compile_cuda, {"options": ("-DX=1",)}, (nvrtc, "_compile"), "cubin", "cubin",
                     lambda module: module.cubin),
    "ptx": Compiler("ptx", lambda: emit_llvm(small_graph()).llvm_ir, compile_ptx, {"arch": "sm_80"},
                    (ptx_compile, "llvm_to_ptx"), "ptx", "PTX", lambda module: module),
}


@pytest.fixture(params=EMITTERS)
def compiler(request, monkeypatch, tmp_path) -> Compiler:
    """A backend's compiler, its cache in the test's own directory."""
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    return COMPILERS[request.param]


def _entries(compiler: Compiler) -> list:
    """The cache's files, by name."""
    directory = cache_dir(compiler.entries)
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def _entry(compiler: Compiler):
    (path,) = cache_dir(compiler.entries).glob(f"*.{compiler.entries}")
    return path


@pytest.mark.timeout(60)
def test_a_second_compile_is_answered_by_the_cache(compiler, monkeypatch, tmp_path):
    code = compiler.code()
    first = compiler.compile(code)
    assert cache_dir(compiler.entries) == tmp_path / compiler.entries
    if compiler.backend == "cuda":
        assert [p.rsplit(".", 1)[1] for p in _entries(compiler)] == ["cubin", "log"]   # the log beside the cubin
    else:
        assert _entry(compiler).read_text().startswith("// mdsl ptx cache, sha256 ")   # its checksum first

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(*compiler.step, no_compile)
    assert compiler.compile(code) == first
    with pytest.raises(AssertionError, match="compiled again"):   # another target or option set: another entry
        compiler.compile(code, **compiler.other)


#: each cache's entry made unreadable: a cubin that is no ELF file, a PTX entry cut short
CORRUPT = {"cuda": lambda data: b"garbage", "ptx": lambda data: data[:-40]}


@pytest.mark.timeout(60)
def test_a_corrupt_entry_is_compiled_again(compiler, monkeypatch):
    code = compiler.code()
    good = compiler.compile(code)
    entry = _entry(compiler)
    data = entry.read_bytes()
    entry.write_bytes(CORRUPT[compiler.backend](data))
    with pytest.warns(UserWarning, match=f"corrupt {compiler.word} cache entry"):
        again = compiler.compile(code)
    assert compiler.product(again) == compiler.product(good)
    assert entry.read_bytes() == data            # repaired
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiler.compile(code)


@pytest.mark.timeout(60)
def test_entries_are_written_atomically(compiler, monkeypatch):
    real_replace = os.replace

    def crash_on_entry(src, dst):
        if str(dst).endswith(f".{compiler.entries}"):
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_entry)
    with pytest.warns(UserWarning, match=f"could not write the {compiler.word} cache"):
        module = compiler.compile(compiler.code())
    assert module.cubin.startswith(b"\x7fELF") if compiler.backend == "cuda" else ".entry small_exp(" in module.ptx
    assert [p for p in _entries(compiler) if not p.endswith(".log")] == []   # no entry, no temporary file left
    monkeypatch.setattr(os, "replace", real_replace)
    compiler.compile(compiler.code())
    assert len(_entries(compiler)) == {"cuda": 2, "ptx": 1}[compiler.backend]   # (a cubin's log beside it)


ACCUM_RMS = "%rms: f32[8, 1] = accum_rms(%tb) {eps=1e-05}"
EXP = "%exp: f16[8, 96] = exp(%add)"


def _broken(backend: str) -> tuple:
    """Code its compiler rejects inside one op's code: (code, the compile, the op, the rejected text)."""
    if backend == "cuda":
        lines = emit_cuda(example_graphs()["row_stats"]).source.splitlines()
        at = next(k for k, line in enumerate(lines) if line.strip() == OP_MARKER + ACCUM_RMS) + 3
        lines.insert(at, "  undefined_name += 1;")
        return "\n".join(lines), compile_cuda, ACCUM_RMS, "undefined_name"
    source = emit_llvm(small_graph()).llvm_ir
    exp_start = source.index("mugraph: %exp")
    broken = source[:exp_start] + source[exp_start:].replace(" fmul ", " fmul_bogus ", 1)
    return broken, llvm_to_ptx, EXP, "fmul_bogus"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", EMITTERS)
def test_a_compile_error_shows_the_code_and_the_op(backend):
    code, compile_, op, rejected = _broken(backend)
    with pytest.raises((CompileError, PtxCompileError)) as e:
        compile_(code)
    message = str(e.value)
    assert {"cuda": 'identifier "undefined_name" is undefined',
            "ptx": "llvmlite rejected the generated LLVM IR"}[backend] in message and rejected in message
    assert f"in the code of the mugraph op: {op}" in message
    line = e.value.line
    assert rejected in code.splitlines()[line - 1]
    assert f"> {line:5d} | {code.splitlines()[line - 1]}" in message
    shown = [text for text in message.splitlines() if " | " in text]
    assert len(shown) == 11                      # 5 lines either side
    assert "error" in e.value.log

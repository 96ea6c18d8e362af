"""NVRTC compilation (no GPU needed): cubins, the resource report, compile errors that show the
source, and the disk cache of cubins."""
from __future__ import annotations

import os
import warnings

import pytest

from mdsl.backend.cuda import CompileError, compile_cuda, emit_cuda, compile_arch
from mdsl.backend.cuda import nvrtc
from mdsl.gpu.cache import cache_dir
from mdsl.gpu.program import Resources, parse_resources
from mdsl.lowering.names import OP_MARKER
from tests.strategies import example_graphs

ACCUM_RMS = "%rms: f32[8, 1] = accum_rms(%tb) {eps=1e-05}"
TINY = """\
extern "C" __global__ void tiny(float* out) {
  // mugraph: %y: f32[32] = neg(%x)
  out[threadIdx.x] = -out[threadIdx.x];
}
"""


@pytest.mark.timeout(60)
def test_a_cubin_for_sm_90a_with_its_resources():
    module = compile_cuda(emit_cuda(example_graphs()["row_stats"]).source)
    assert module.cubin.startswith(b"\x7fELF") and module.arch == "sm_90a"
    assert set(module.resources) == {"row_stats_st", "row_stats_total"}
    for r in module.resources.values():
        assert r.registers > 0 and r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0
    assert "ptxas info" in module.log


def test_parse_resources():
    log = ("ptxas info    : 0 bytes gmem\n"
           "ptxas info    : Compiling entry function 'a' for 'sm_90a'\n"
           "ptxas info    : Function properties for a\n"
           "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]\n"
           "ptxas info    : Compiling entry function 'b' for 'sm_90a'\n"
           "ptxas info    : Function properties for b\n"
           "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 8 registers, used 0 barriers\n")
    assert parse_resources(log) == {"a": Resources(40, 4096, 16, 8, 4), "b": Resources(8, 0, 0, 0, 0)}


def test_target_arch(monkeypatch):
    monkeypatch.delenv("MDSL_CUDA_ARCH", raising=False)
    assert compile_arch() == "sm_90a"
    assert compile_arch("sm_80") == "sm_80"
    monkeypatch.setenv("MDSL_CUDA_ARCH", "sm_90")
    assert compile_arch() == "sm_90"


@pytest.mark.timeout(60)
def test_a_compile_error_shows_the_source_and_the_op():
    source = emit_cuda(example_graphs()["row_stats"]).source
    lines = source.splitlines()
    at = next(k for k, line in enumerate(lines) if line.strip() == OP_MARKER + ACCUM_RMS) + 3
    lines.insert(at, "  undefined_name += 1;")
    with pytest.raises(CompileError) as e:
        compile_cuda("\n".join(lines))
    message = str(e.value)
    assert 'identifier "undefined_name" is undefined' in message
    assert f"in the code of the mugraph op: {ACCUM_RMS}" in message
    assert f"> {at + 1:5d} |   undefined_name += 1;" in message
    shown = [line for line in message.splitlines() if " | " in line]
    assert len(shown) == 11                      # 5 lines either side
    assert e.value.line == at + 1 and "error" in e.value.log


def _entries() -> list:
    return sorted(p.name for p in cache_dir("cubin").iterdir()) if cache_dir("cubin").exists() else []


@pytest.mark.timeout(60)
def test_cache_hit(monkeypatch, tmp_path):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    first = compile_cuda(TINY)
    assert cache_dir("cubin") == tmp_path / "cubin"
    assert [p.rsplit(".", 1)[1] for p in _entries()] == ["cubin", "log"]

    def no_compile(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(nvrtc, "_compile", no_compile)
    again = compile_cuda(TINY)
    assert again == first
    with pytest.raises(AssertionError):  # another arch, options or source is another entry
        compile_cuda(TINY, options=("-DX=1",))


@pytest.mark.timeout(60)
def test_a_corrupt_entry_is_compiled_again(monkeypatch, tmp_path):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    good = compile_cuda(TINY)
    (cubin,) = cache_dir("cubin").glob("*.cubin")
    cubin.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="corrupt cubin cache entry"):
        again = compile_cuda(TINY)
    assert again.cubin == good.cubin
    assert cubin.read_bytes() == good.cubin      # repaired
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile_cuda(TINY)


@pytest.mark.timeout(60)
def test_entries_are_written_atomically(monkeypatch, tmp_path):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    real_replace = os.replace

    def crash_on_cubin(src, dst):
        if str(dst).endswith(".cubin"):
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_cubin)
    with pytest.warns(UserWarning, match="could not write the cubin cache"):
        module = compile_cuda(TINY)
    assert module.cubin.startswith(b"\x7fELF")
    assert [p for p in _entries() if not p.endswith(".log")] == []   # no cubin, no temporary file left
    monkeypatch.setattr(os, "replace", real_replace)
    compile_cuda(TINY)
    assert len(_entries()) == 2

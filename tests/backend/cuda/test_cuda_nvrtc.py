"""NVRTC compilation (no GPU needed): cubins, the resource report, the target. The disk cache of cubins
and compile errors, as the PTX backend's: tests/backend/test_compile.py."""
from __future__ import annotations

import pytest

from mdsl.backend.cuda import compile_arch, compile_cuda, emit_cuda
from mdsl.gpu.program import Resources, parse_resources
from tests.strategies import example_graphs


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



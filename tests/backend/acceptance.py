"""What CI's acceptance checks of a program, through either backend, without a GPU: its code compiles (CUDA
C++ by NVRTC to an sm_90a cubin; LLVM IR by llvmlite to PTX for sm_90, assembled by nvJitLink or ptxas)
into kernels that, by the compiler's own report, spill nothing, use no stack, fit in shared memory and
launch with the block size they were written for. Each compile happens once per process (the same code
recurs across the tests: a program under the default options, an option set that changes nothing in it);
other processes find it in the test run's compile caches (tests/shared.py)."""
from __future__ import annotations

import functools
import os

from mdsl.backend.cuda import compile_cuda, emit_cuda
from mdsl.backend.ptx import assemble, compile_ptx, emit_llvm
from mdsl.ir import SMEM_LIMIT_BYTES

REGISTERS_PER_SM = 65536


@functools.lru_cache(maxsize=256)
def _compiled(source: str, arch_env):
    return compile_cuda(source)


def compiled(source: str):
    """NVRTC's module for the source, once per process (for the target `$MDSL_CUDA_ARCH` names)."""
    return _compiled(source, os.environ.get("MDSL_CUDA_ARCH"))


@functools.lru_cache(maxsize=256)
def assembled_module(llvm_ir: str):
    """The module's PTX and its assembly (option sets that emit the same IR share them)."""
    module = compile_ptx(llvm_ir)
    return module, assemble(module.ptx)


def assert_compiles_clean(graph, backend: str = "cuda", options=None):
    """The program of `graph` through `backend` ("cuda" or "ptx"; `options`: the CudaOptions to emit with,
    None: from the environment, as the emitters do), and its compiled module (a cubin with ptxas's report),
    once every kernel passes the checks above."""
    if backend == "cuda":
        program = emit_cuda(graph, options=options)
        module = compiled(program.source)
        assert module.cubin.startswith(b"\x7fELF") and module.arch == "sm_90a"
    else:
        program = emit_llvm(graph, options=options)
        ptx, module = assembled_module(program.llvm_ir)
        assert ".version 8.0" in ptx.ptx and ".target sm_90" in ptx.ptx and ptx.arch == "sm_90"
        assert module.cubin.startswith(b"\x7fELF")
    assert set(module.resources) == {launch.name for launch in program.launches}
    for launch in program.launches:
        r = module.resources[launch.name]
        what = f"{launch.name}: {r}"
        assert r.spill_store_bytes == r.spill_load_bytes == 0, f"spills in {what}"
        assert r.stack_bytes == 0, f"a stack frame in {what}"
        assert launch.smem_bytes + r.smem_bytes <= SMEM_LIMIT_BYTES, f"over the shared-memory limit: {what}"
        assert 0 < r.registers * launch.block[0] <= REGISTERS_PER_SM, f"too many registers: {what}"
    return program, module


def assert_assembles_clean(graph, options=None):
    """`assert_compiles_clean` through the PTX backend."""
    return assert_compiles_clean(graph, "ptx", options)

"""PTX from LLVM IR: the target and PTX version, the optimisation level, assembly by nvJitLink and by
ptxas, ptxas's errors that show the failing line and the mugraph op, and the choice of backend per call
(runtime, @mdsl.kernel, the CLI) without touching the driver. The disk cache and LLVM's errors, as the
CUDA backend's: tests/backend/test_compile.py."""
from __future__ import annotations

import numpy as np
import pytest
from llvmlite import ir

import mdsl
from mdsl import Tensor, f32
from mdsl.backend.cuda import runtime
from mdsl.backend.ptx import PtxCompileError, PtxModule, assemble, compile_ptx, emit_llvm, llvm_to_ptx, ptx_target
from mdsl.backend.ptx import compile as ptx_compile
from mdsl.backend.ptx.llvm import F32
from mdsl.backend.ptx.rules import PTX_RULES, Elementwise
from mdsl.cli import make_parser
from mdsl.errors import MdslError, UnsupportedError
from tests.backend.test_compile import small_graph


def test_targets_and_ptx_version():
    assert ptx_target("sm_90a") == "sm_90" and ptx_target("sm_100a") == "sm_100" and ptx_target("sm_80") == "sm_80"
    ptx = llvm_to_ptx(emit_llvm(small_graph()).llvm_ir, "sm_90a")
    assert "\n.version 8.0\n.target sm_90\n.address_size 64\n" in ptx


def test_the_optimisation_level_is_checked(monkeypatch):
    source = emit_llvm(small_graph()).llvm_ir
    monkeypatch.setenv("MDSL_PTX_OPT", "O3")
    assert ".entry small_exp(" in llvm_to_ptx(source)
    monkeypatch.setenv("MDSL_PTX_OPT", "O7")
    with pytest.raises(UnsupportedError, match="MDSL_PTX_OPT='O7'"):
        llvm_to_ptx(source)


@pytest.mark.parametrize("tool", ["nvJitLink", "ptxas"])
def test_both_assemblers_report_resources(tool):
    if tool == "nvJitLink" and ptx_compile._nvjitlink() is None or tool == "ptxas" and ptx_compile.ptxas_path() is None:
        pytest.skip(f"{tool} is not installed here")
    program = emit_llvm(small_graph())
    assembled = assemble(compile_ptx(program.llvm_ir).ptx, tool=tool)
    assert assembled.cubin.startswith(b"\x7fELF")
    assert set(assembled.resources) == {l.name for l in program.launches}
    assert all(r.registers > 0 and r.spill_store_bytes == 0 for r in assembled.resources.values())


def _bogus_exp(fn, node, args):
    """An instruction ptxas does not know, where exp's code goes."""
    return fn.b.asm(ir.FunctionType(F32, [F32]), "bogus.instruction.f32 $0, $1;", "=f,f", [args[0]], False)


def test_ptxas_errors_show_the_ptx_and_the_op(monkeypatch):
    if ptx_compile.assembler() is None:
        pytest.skip("neither nvJitLink nor ptxas is installed here")
    monkeypatch.setitem(PTX_RULES, "exp", Elementwise(_bogus_exp))
    ptx = compile_ptx(emit_llvm(small_graph()).llvm_ir).ptx
    with pytest.raises(PtxCompileError) as info:
        assemble(ptx)
    message = str(info.value)
    assert "rejected the generated PTX" in message and "bogus.instruction" in message
    assert "in the code of the mugraph op: %exp: f16[8, 96] = exp(%add)" in message
    assert f"> {info.value.line:5d} | " in message and "PTX line" in message


def test_error_from_a_log_without_a_line():
    error = ptx_compile.error_from_log("ptxas rejected the generated PTX", "something odd happened", "text", "PTX")
    assert isinstance(error, MdslError) and "something odd happened" in str(error) and error.line is None


# ---------------------------------------------------------------------------------------------
# choosing the backend (no GPU here: nothing may reach the driver)


def test_unknown_backends_are_refused_before_the_gpu_is_looked_for():
    with pytest.raises(MdslError, match="unknown backend 'llvm'") as info:
        runtime.compile_graph(small_graph(), backend="llvm")
    assert "'cuda', 'ptx'" in info.value.hint


@mdsl.kernel
def scaled(x: Tensor[4, 8, f32]):
    return x * 2.0


def test_kernel_calls_take_a_backend():
    x = np.ones((4, 8), np.float32)
    with pytest.raises(MdslError, match="unknown backend 'nvcc'"):
        scaled(x, stream=0, backend="nvcc")
    if not runtime.has_gpu():
        with pytest.raises(runtime.NoGPUError):
            scaled(x, stream=0, backend="ptx")


@pytest.mark.skipif(runtime.has_gpu(), reason="checks the behaviour without a GPU")
def test_loading_ptx_needs_a_gpu():
    with pytest.raises(runtime.NoGPUError, match="loading a PTX module"):
        PtxModule("// no code", "sm_90").load()
    with pytest.raises(runtime.NoGPUError):
        runtime.compile_graph(small_graph(), backend="ptx")


def test_the_cli_gpu_check_takes_a_backend():
    parser = make_parser()
    assert parser.parse_args(["optimize", "f.py"]).backend == "cuda"
    assert parser.parse_args(["optimize", "f.py", "--backend", "ptx"]).backend == "ptx"
    with pytest.raises(SystemExit):
        parser.parse_args(["optimize", "f.py", "--backend", "llvm"])

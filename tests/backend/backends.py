"""Both backends behind one interface, for the tests that check one behaviour of each (parametrised by
`backend`, "cuda" or "ptx"): emitting a program, the code its kernels are written in, its compiled module
(NVRTC's cubin, or the PTX assembled by nvJitLink or ptxas) and that module's SASS."""
from __future__ import annotations

import pytest

from mdsl.backend.cuda import emit_cuda
from mdsl.backend.cuda.nvrtc import nvdisasm_path, sass_instructions
from mdsl.backend.ptx import assembler, emit_llvm
from tests.backend.acceptance import assembled_module, compiled
from tests.shared import disassembled

needs_assembler = pytest.mark.skipif(assembler() is None, reason="neither nvJitLink nor ptxas is installed: "
                                     "pip install nvidia-nvjitlink, or put the CUDA toolkit's ptxas on PATH")
needs_nvdisasm = pytest.mark.skipif(nvdisasm_path() is None, reason="nvdisasm is not installed "
                                    "(pip install nvidia-cuda-nvdisasm): the SASS cannot be read")

#: the backends, for tests that emit code only
EMITTERS = ["cuda", "ptx"]
#: the backends, for tests that compile what they emit (the PTX backend's needs an assembler)
BACKENDS = ["cuda", pytest.param("ptx", marks=needs_assembler)]

#: what each backend's code has where a kernel runs a block matmul on tensor cores
MMA_CODE = {"cuda": ("BlockMma<", "RowMma<", "gemm_tile_mma<", "gemm_rows_mma<"), "ptx": ("mma.sync",)}


def emit(backend: str, graph, options=None, arch=None):
    """The program of `graph` (`options`: the CudaOptions, None: from the environment, as the emitters do)."""
    kwargs = {"options": options} if arch is None else {"options": options, "arch": arch}
    return (emit_cuda if backend == "cuda" else emit_llvm)(graph, **kwargs)


def kernel_code(backend: str, program) -> str:
    """The code of the program's kernels: the CUDA source after the prelude's namespace (whose templates,
    uninstantiated, make no SASS), or the whole LLVM module."""
    return program.source.split("}  // namespace mdsl")[1] if backend == "cuda" else program.llvm_ir


def has_mma(backend: str, code: str) -> bool:
    """Whether `kernel_code` calls the tensor cores."""
    return any(word in code for word in MMA_CODE[backend])


def module(backend: str, program):
    """The compiled module of the program (a cubin with ptxas's report), once per process for each code."""
    return compiled(program.source) if backend == "cuda" else assembled_module(program.llvm_ir)[1]


def kernel_instructions(cubin: bytes) -> dict:
    """Kernel name (or subroutine) -> its SASS instructions in order (nvrtc.sass_instructions); the cubin
    disassembled once per session (tests/shared.py)."""
    return sass_instructions(disassembled(cubin))


def kernel_opcodes(cubin: bytes) -> dict:
    """Kernel name -> {opcode (its first dotted part) -> instructions}, from the cubin's SASS."""
    out: dict = {}
    for kernel, instructions in kernel_instructions(cubin).items():
        counts = out[kernel] = {}
        for op in instructions:
            counts[op.split(".")[0]] = counts.get(op.split(".")[0], 0) + 1
    return out


def kernels_with(cubin: bytes, opcode: str) -> set:
    """The kernels whose SASS has the opcode (HMMA, LDGSTS, LDSM, ...)."""
    return {kernel for kernel, ops in kernel_opcodes(cubin).items() if ops.get(opcode, 0)}


def kernel_body(backend: str, program, name: str) -> str:
    """One kernel's code: its CUDA function up to the next kernel, or its LLVM IR function."""
    if backend == "cuda":
        source = program.source
        start = source.index(f"{name}(")
        end = source.find('extern "C"', start)
        return source[start:end if end >= 0 else len(source)]
    start = program.llvm_ir.index(f'define ptx_kernel void @"{name}"')
    return program.llvm_ir[start:program.llvm_ir.index("\n}\n", start)]


#: a barrier across the block, as each backend's code writes it
BARRIER = {"cuda": "__syncthreads()", "ptx": 'call void @"llvm.nvvm.barrier0"()'}

"""The PTX backend: the CUDA backend's lowered kernels emitted as LLVM IR, written as text while it is
built (`emit_llvm`, `irtext`), turned into PTX by llvmlite's NVPTX target (`compile_ptx`, cached), assembled by
ptxas or nvJitLink for the resource report (`assemble`) and loaded by the driver on a GPU
(`PtxModule.load`). The CUDA backend's fast paths, switched by the same `CudaOptions` (emit_llvm's
`options`, else the MDSL_CUDA_* environment): block matmuls on tensor cores (mma.sync, ldmatrix
fragments), sums kept in the mma's registers, cp.async input pipelines, unrolled block loops, the
tensor-core GEMM kernel, row-resident loop chains (online softmax in the registers of the warps owning
the rows: `rows.py`), streamed combines (`streamed.py`), hoisted loop-invariant nodes and, with
`CudaOptions.skinny`, the skinny loop of matmuls of at most 16 rows (weights streamed into registers:
`skinny.py`).
Importing it loads neither llvmlite.binding nor the CUDA libraries."""
from mdsl.backend.ptx.codegen import PtxProgram, emit_llvm
from mdsl.backend.ptx.compile import (PtxCompileError, PtxModule, assemble, assembler, compile_ptx, llvm_to_ptx,
                                      ptx_target)
from mdsl.gpu.generators import CodeGenerator, register

register(CodeGenerator("ptx", emit_llvm, lambda program, arch: compile_ptx(program.llvm_ir, arch)))

__all__ = ["PtxProgram", "emit_llvm", "PtxCompileError", "PtxModule", "assemble", "assembler", "compile_ptx",
           "llvm_to_ptx", "ptx_target"]

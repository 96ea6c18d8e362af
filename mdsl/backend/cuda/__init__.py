"""The CUDA backend: CUDA C++ emitted per kernel graph from the lowering's plans (`emit_cuda`) and compiled
to a cubin by NVRTC (`compile_cuda`); registered with the GPU runtime as the "cuda" code generator.
Importing it does not load the CUDA libraries; the first compile does."""
from mdsl.backend.cuda.codegen import CudaProgram, emit_cuda
from mdsl.backend.cuda.nvrtc import CompileError, compile_arch, compile_cuda, compile_source
from mdsl.gpu.generators import CodeGenerator, register

register(CodeGenerator("cuda", emit_cuda, lambda program, arch: compile_source(program.source, arch)))

__all__ = ["CudaProgram", "emit_cuda", "CompileError", "compile_cuda", "compile_arch"]

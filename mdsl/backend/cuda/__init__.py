"""The CUDA backend: CUDA C++ emitted per kernel graph (`emit_cuda`) and compiled to a cubin by NVRTC
(`compile_cuda`). Importing it does not load the CUDA libraries; the first compile does."""
from mdsl.backend.cuda.codegen import CudaProgram, KernelLaunch, emit_cuda
from mdsl.backend.cuda.nvrtc import CompileError, CompiledModule, Resources, compile_cuda, compile_arch

__all__ = ["CudaProgram", "KernelLaunch", "emit_cuda", "CompileError", "CompiledModule", "Resources",
           "compile_cuda", "compile_arch"]

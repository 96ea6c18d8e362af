"""Code generators by backend name, and a kernel graph compiled into an `Executable` by one of them.

A backend registers its `CodeGenerator` when it is imported (`register`). The runtime never imports a
backend by name in its code: `generator(name)` imports the package that `PROVIDERS` names for it the
first time it is asked for, so that `compile_graph(graph, backend="ptx")` works in a process that has
imported nothing but the runtime. Registering loads no CUDA library: the driver is imported by the first
`compile_graph`.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Optional

import attrs

from mdsl.errors import MdslError
from mdsl.ir.graph import KernelGraph

if TYPE_CHECKING:
    from mdsl.gpu.executable import Executable

#: backend name -> the package whose import registers its code generator
PROVIDERS = {"cuda": "mdsl.backend.cuda", "ptx": "mdsl.backend.ptx"}
BACKENDS = tuple(PROVIDERS)   # CUDA C++ by NVRTC, PTX by llvmlite's NVPTX target


@attrs.frozen
class CodeGenerator:
    name: str
    emit: Callable       # (graph, *, arch, options) -> program (mdsl.gpu.program)
    compile: Callable    # (program, arch) -> module: a CompiledModule, or an object with load()


_REGISTRY: dict = {}


def register(generator: CodeGenerator) -> None:
    _REGISTRY[generator.name] = generator


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise MdslError(f"unknown backend {backend!r}",
                        hint=f"use one of {', '.join(map(repr, BACKENDS))} (the default is 'cuda')")
    return backend


def generator(backend: str) -> CodeGenerator:
    check_backend(backend)
    if backend not in _REGISTRY:
        importlib.import_module(PROVIDERS[backend])
    return _REGISTRY[backend]


def compile_graph(graph: KernelGraph, *, arch: Optional[str] = None, device: int = 0,
                  backend: str = "cuda", options=None) -> "Executable":
    """Emit a kernel graph with `backend`'s code generator (CUDA C++, or LLVM IR turned into PTX), compile
    it (cached) and load it on `device`. `options`: the lowering's `CudaOptions` (mdsl.lowering.options;
    none: from the environment)."""
    from mdsl.gpu.driver import require_gpu, target_arch
    from mdsl.gpu.executable import Executable

    gen = generator(backend)
    require_gpu("loading a compiled kernel")
    arch = arch or target_arch(device)
    program = gen.emit(graph, arch=arch, options=options)
    return Executable(program, gen.compile(program, arch), device=device)

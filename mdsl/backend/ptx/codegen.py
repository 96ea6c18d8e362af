"""LLVM IR for a kernel graph: one module, one kernel (`.entry`) per kernel-level node (a view such as reshape
gets an alias instead), launched in the graph's order: the kernels the CUDA backend writes as C++
(mdsl/backend/cuda/codegen.py), with the same launches and interface with the runtime (mdsl.gpu.program),
written with llvmlite's types (`irtext`). Each kernel's code starts with the op marker naming the mugraph op
it runs (and each block-level op inside a custom kernel with its own), kept as a comment in the PTX, which
compile errors point back through.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import attrs

from mdsl.backend.ptx.llvm import Array, KernelFunction, ModuleBuilder
from mdsl.backend.ptx.rules import PTX_RULES   # the table, filled by that module
from mdsl.ir.graph import KernelGraph, Node
from mdsl.lowering import program as lowering_program
from mdsl.lowering.options import CudaOptions
from mdsl.lowering.program import lower_graph


@attrs.frozen
class PtxProgram:
    llvm_ir: str             # ONE LLVM module for the whole kernel graph
    launches: tuple          # KernelLaunch, in execution order
    aliases: tuple           # (value name, aliased value name): views that need no kernel (reshape)
    graph: KernelGraph       # the graph the module implements (custom nodes' bodies fused)
    arch: str
    options: CudaOptions = CudaOptions()   # the fast paths the kernels take

    @property
    def source(self) -> str:
        """What this backend compiles (the runtime's failure reports show it)."""
        return self.llvm_ir


@attrs.define
class KernelScope:
    """A kernel being written: its function and its parameters as Arrays (contiguous device tensors)."""

    fn: KernelFunction
    inputs: list
    outputs: list


class ProgramBuilder(lowering_program.ProgramBuilder):
    def __init__(self, graph: KernelGraph, arch: str, options: Optional[CudaOptions] = None):
        super().__init__(graph, arch, options)
        self.mb = ModuleBuilder(graph.name)

    @contextlib.contextmanager
    def kernel(self, index: int, node: Node, *, grid: tuple, threads: int, smem: int = 0,
               overlap: bool = False) -> Iterator[KernelScope]:
        """Write the kernel implementing `node`; the body is the caller's. `overlap`: the body waits for the
        previous kernel (griddepcontrol.wait) before it touches memory, and the launch lets it start before
        that kernel ends (`KernelLaunch.overlap`)."""
        name = self.kernel_name(node)
        values = list(node.inputs) + list(node.outputs)
        fn = KernelFunction(self.mb, name, len(values), threads, read_only=len(node.inputs))
        arrays = [Array.contiguous(p, v.dtype.name, v.shape) for p, v in zip(fn.params, values)]
        scope = KernelScope(fn, arrays[:len(node.inputs)], arrays[len(node.inputs):])
        fn.marker_for(node)
        yield scope
        fn.finish()
        self.record_launch(name, index, node, grid, threads, smem, overlap)


def emit_llvm(graph: KernelGraph, *, arch: str = "sm_90", options: Optional[CudaOptions] = None) -> PtxProgram:
    """One LLVM module implementing `graph` for `arch`, and how to launch its kernels, with the fast
    paths `options` allows (the lowering's switches; none given: `CudaOptions.from_env()`)."""
    lowered = lower_graph(graph)
    options = options if options is not None else CudaOptions.from_env()
    program = ProgramBuilder(lowered, arch, options)
    program.write_nodes(PTX_RULES)
    return PtxProgram(program.mb.text(), tuple(program.launches), tuple(program.aliases.items()), lowered, arch,
                      options)

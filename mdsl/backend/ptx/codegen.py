"""LLVM IR for a kernel graph: one module, one kernel (`.entry`) per kernel-level node (a view such as reshape
gets an alias instead; a split and its combine that qualify share one, `mdsl.lowering.onelaunch`), launched in
the graph's order: the kernels the CUDA backend writes as C++
(mdsl/backend/cuda/codegen.py), with the same launches and interface with the runtime (mdsl.gpu.program),
written with llvmlite's types (`irtext`). Each kernel's code starts with the op marker naming the mugraph op
it runs (and each block-level op inside a custom kernel with its own), kept as a comment in the PTX, which
compile errors point back through.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import attrs

from mdsl.backend.ptx.llvm import Array, KernelFunction, ModuleBuilder, i32
from mdsl.backend.ptx.onelaunch import emit_one_launch
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
    """A kernel being written: its function, its parameters as Arrays (contiguous device tensors, or strided
    views of them: `mdsl.lowering.views`) and, for a split and its combine in one launch, the parameter
    pointing at the group counters."""

    fn: KernelFunction
    inputs: list
    outputs: list
    counters: Optional[object] = None


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
        with self.function(self.kernel_name(node), index, node, node.inputs, node.outputs, (node,), grid=grid,
                           threads=threads, smem=smem, overlap=overlap) as scope:
            yield scope

    @contextlib.contextmanager
    def function(self, name: str, index: int, node: Node, inputs: tuple, outputs: tuple, nodes: tuple, *,
                 grid: tuple, threads: int, smem: int, overlap: bool, counters: int = 0) -> Iterator[KernelScope]:
        """Write the kernel `name` taking `inputs` (read only) and `outputs`, and `counters` group counters
        after them, its code starting with the op markers of `nodes`; its launch is `node`'s (index `index`)."""
        values = list(inputs) + list(outputs)
        fn = KernelFunction(self.mb, name, len(values) + (1 if counters else 0), threads, read_only=len(inputs))
        arrays = [self._array(fn, p, v) for p, v in zip(fn.params, values)]
        scope = KernelScope(fn, arrays[:len(inputs)], arrays[len(inputs):], fn.params[-1] if counters else None)
        for n in nodes:
            fn.marker_for(n)
        yield scope
        fn.finish()
        self.record_launch(name, index, node, grid, threads, smem, overlap, tuple(values), counters)

    def _array(self, fn: KernelFunction, param, var) -> Array:
        """The parameter's array: the value, contiguous; or, for a value that lies in another's buffer (a split's
        part read in place, a concat's piece written in place: `mdsl.lowering.views`), a strided view, the
        parameter then pointing at that buffer."""
        view = self.views.get(var.name)
        if view is None:
            return Array.contiguous(param, var.dtype.name, var.shape)
        array = Array(param, var.dtype.name, tuple(var.shape), view.strides)
        start = fn.b.gep(param, [i32(view.offset)], inbounds=True, source_etype=array.etype) if view.offset else param
        return attrs.evolve(array, ptr=start)

    def write_pair(self, pair) -> None:
        emit_one_launch(self, pair)


def emit_llvm(graph: KernelGraph, *, arch: str = "sm_90", options: Optional[CudaOptions] = None) -> PtxProgram:
    """One LLVM module implementing `graph` for `arch`, and how to launch its kernels, with the fast
    paths `options` allows (the lowering's switches; none given: `CudaOptions.from_env()`)."""
    lowered = lower_graph(graph)
    options = options if options is not None else CudaOptions.from_env()
    program = ProgramBuilder(lowered, arch, options)
    program.write_nodes(PTX_RULES)
    return PtxProgram(program.mb.text(), tuple(program.launches), tuple(program.aliases.items()), lowered, arch,
                      options)

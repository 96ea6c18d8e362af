"""CUDA C++ for a kernel graph: one translation unit, one `__global__` function per kernel-level node
(a view such as reshape gets an alias instead; a split and its combine that qualify share one,
`mdsl.lowering.onelaunch`), launched in the graph's order.

The interface with the runtime is `CudaProgram`. Every pointer a kernel takes is a contiguous
row-major device tensor named by `KernelLaunch.args` (inputs first, then outputs), 16-byte aligned
(the kernels read and write up to 16 bytes at a time); a value that lies in another's buffer (a split's part
read in place, a concat's piece written in place: `mdsl.lowering.views`) is passed as that buffer, the
offset added in the kernel. A value named in `CudaProgram.aliases` is a view of another value (its buffer,
reinterpreted): no kernel writes it. A kernel that asks for more than 48 KB of
dynamic shared memory needs its limit raised before launch
(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES).

Code is written by the operators' rules (`mdsl.backend.cuda.rules`, one per operator, in `CUDA_RULES`);
this module frames the kernels: names, signatures, launch records and the comment naming the mugraph op
above each part (`OP_MARKER`, which compile errors point back through).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import attrs

from mdsl.backend.cuda.onelaunch import emit_one_launch
from mdsl.backend.cuda.prelude import INCLUDES, PRELUDE
from mdsl.backend.cuda.rules import CUDA_RULES   # the table, filled by that module
from mdsl.backend.cuda.source import CodeWriter, Operand, ctype
from mdsl.ir.graph import KernelGraph, Node
from mdsl.lowering import program as lowering_program
from mdsl.lowering.names import OP_MARKER, Namer, describe
from mdsl.lowering.options import CudaOptions
from mdsl.lowering.program import lower_graph


@attrs.frozen
class CudaProgram:
    source: str              # ONE CUDA C++ translation unit for the whole kernel graph
    launches: tuple          # KernelLaunch, in execution order
    aliases: tuple           # (value name, aliased value name): views that need no kernel (reshape)
    graph: KernelGraph       # the graph the source implements (custom nodes' bodies fused)


@attrs.define
class KernelScope:
    """A `__global__` function being written: the writer, the names taken in it, its parameters as
    operands (contiguous device tensors, or strided views of them: `mdsl.lowering.views`) and, for a split and
    its combine in one launch, the parameter pointing at the group counters."""

    w: CodeWriter
    namer: Namer
    inputs: list
    outputs: list
    counters: Optional[str] = None


class ProgramBuilder(lowering_program.ProgramBuilder):
    def __init__(self, graph: KernelGraph, arch: str, options: Optional[CudaOptions] = None):
        super().__init__(graph, arch, options)
        self.w = CodeWriter()

    @contextlib.contextmanager
    def kernel(self, index: int, node: Node, *, grid: tuple, threads: int, smem: int = 0,
               comment: Optional[list] = None, overlap: bool = False) -> Iterator[KernelScope]:
        """Write the `__global__` function implementing `node`; the body is the caller's. `overlap`: the body
        waits for the previous kernel (griddepcontrol.wait) before it touches memory, and the launch lets it
        start before that kernel ends (`KernelLaunch.overlap`)."""
        with self.function(self.kernel_name(node), index, node, node.inputs, node.outputs, (node,), grid=grid,
                           threads=threads, smem=smem, comment=comment, overlap=overlap) as scope:
            yield scope

    @contextlib.contextmanager
    def function(self, name: str, index: int, node: Node, inputs: tuple, outputs: tuple, nodes: tuple, *,
                 grid: tuple, threads: int, smem: int, overlap: bool, comment: Optional[list] = None,
                 counters: int = 0) -> Iterator[KernelScope]:
        """Write the `__global__` function `name` taking `inputs` (read only) and `outputs`, and `counters`
        group counters after them, preceded by the op markers of `nodes`; its launch is `node`'s (index
        `index`)."""
        namer = Namer()
        scope = KernelScope(self.w, namer, [], [])
        params, views = [], []
        for var, writable in [(v, False) for v in inputs] + [(v, True) for v in outputs]:
            c, ptr = ctype(var.dtype), namer(f"g_{var.name}")
            const = "" if writable else "const "
            view = self.views.get(var.name)
            if view is None:
                params.append(f"{const}{c}* __restrict__ {ptr}")
                (scope.outputs if writable else scope.inputs).append(Operand.contiguous(ptr, c, var.shape))
                continue
            param = namer(f"g_{view.of}")   # a strided view: its value's pointer, the offset added in the kernel
            params.append(f"{const}{c}* __restrict__ {param}")
            views.append(f"{const}{c}* const {ptr} = {param} + {view.offset};   // %{var.name}: in %{view.of}")
            (scope.outputs if writable else scope.inputs).append(Operand(ptr, c, tuple(var.shape), view.strides))
        if counters:
            scope.counters = namer("g_counters")
            params.append(f"unsigned* __restrict__ {scope.counters}")
        w = self.w
        w("", "// " + "-" * 98, *(OP_MARKER + describe(n) for n in nodes))
        w(*(f"//{line}" for line in comment or ()))
        w(f'extern "C" __global__ void __launch_bounds__({threads}, 1)')
        with w.block(f"{name}({', '.join(params)})"):
            w(*views)
            yield scope
        self.record_launch(name, index, node, grid, threads, smem, overlap, (*inputs, *outputs), counters)

    def write_pair(self, pair) -> None:
        emit_one_launch(self, pair)

    def source(self) -> str:
        head = (f"// CUDA C++ generated by mdsl for kernel graph {self.graph.name}, target {self.arch}.\n"
                "// One __global__ function per launch, in launch order; each is preceded by the mugraph op it runs.\n")
        return head + INCLUDES + PRELUDE + self.w.text()


def emit_cuda(graph: KernelGraph, *, arch: str = "sm_90a", options: Optional[CudaOptions] = None) -> CudaProgram:
    """One CUDA C++ translation unit implementing `graph` for `arch`, and how to launch it, with the
    fast paths `options` allows (none given: `CudaOptions.from_env()`)."""
    lowered = lower_graph(graph)
    program = ProgramBuilder(lowered, arch, options if options is not None else CudaOptions.from_env())
    program.write_nodes(CUDA_RULES)
    return CudaProgram(program.source(), tuple(program.launches), tuple(program.aliases.items()), lowered)

"""CUDA C++ for a kernel graph: one translation unit, one `__global__` function per kernel-level node
(a view such as reshape gets an alias instead), launched in the graph's order.

The interface with the runtime is `CudaProgram`. Every pointer a kernel takes is a contiguous
row-major device tensor named by `KernelLaunch.args` (inputs first, then outputs), 16-byte aligned
(the kernels read and write up to 16 bytes at a time). A value named in `CudaProgram.aliases` is a
view of another value (its buffer, reinterpreted): no kernel writes it. A kernel that asks for more than 48 KB of
dynamic shared memory needs its limit raised before launch
(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES).

Code is written by the operators' rules (`mdsl.backend.cuda.rules`, one per operator, attached to
the registry); this module frames the kernels: names, signatures, launch records and the comment
naming the mugraph op above each part (`OP_MARKER`, which compile errors point back through).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import attrs

import mdsl.backend.cuda.rules  # noqa: F401 - attaches the cuda rules to the registry
from mdsl.backend.cuda.options import CudaOptions
from mdsl.backend.cuda.prelude import INCLUDES, PRELUDE
from mdsl.backend.cuda.source import OP_MARKER, CodeWriter, Namer, Operand, ctype, describe
from mdsl.errors import UnsupportedError
from mdsl.ir.graph import KernelGraph, Node
from mdsl.passes.fusion import fuse_kernel_graph

MAX_ELEMENTS = 2**31 - 1  # indices are 32-bit


@attrs.frozen
class KernelLaunch:
    name: str                # the __global__ function
    grid: tuple              # (x, y, z)
    block: tuple             # (threads, 1, 1)
    smem_bytes: int          # dynamic shared memory
    args: tuple              # kernel-graph value names passed as pointers, in parameter order
    node_index: int          # the kernel-graph node it implements
    overlap: bool = False    # launched with programmatic stream serialization: it waits for its predecessor
                             # (griddepcontrol.wait) before touching memory, so it may start before that ends


@attrs.frozen
class CudaProgram:
    source: str              # ONE CUDA C++ translation unit for the whole kernel graph
    launches: tuple          # KernelLaunch, in execution order
    aliases: tuple           # (value name, aliased value name): views that need no kernel (reshape)
    graph: KernelGraph       # the graph the source implements (custom nodes' bodies fused)


@attrs.define
class KernelScope:
    """A `__global__` function being written: the writer, the names taken in it, and its parameters
    as operands (contiguous device tensors)."""

    w: CodeWriter
    namer: Namer
    inputs: list
    outputs: list


class ProgramBuilder:
    def __init__(self, graph: KernelGraph, arch: str, options: Optional[CudaOptions] = None):
        self.graph = graph
        self.arch = arch
        self.options = options or CudaOptions()
        self.w = CodeWriter()
        self.kernel_names = Namer()
        self.launches: list = []
        self.aliases: dict = {}

    @contextlib.contextmanager
    def kernel(self, index: int, node: Node, *, grid: tuple, threads: int, smem: int = 0,
               comment: Optional[list] = None, cluster: int = 1, overlap: bool = False) -> Iterator[KernelScope]:
        """Write the `__global__` function implementing `node`; the body is the caller's. `cluster` > 1:
        each block of `grid` becomes that many consecutive blocks along x, one thread-block cluster
        (compiled in with __cluster_dims__, so that a plain launch makes the clusters). `overlap`: the body
        waits for the previous kernel (griddepcontrol.wait) before it touches memory, and the launch lets it
        start before that kernel ends (`KernelLaunch.overlap`)."""
        name = self.kernel_names(f"{self.graph.name}_{node.outputs[0].name}")
        namer = Namer()
        scope = KernelScope(self.w, namer, [], [])
        params, args = [], []
        for var, writable in [(v, False) for v in node.inputs] + [(v, True) for v in node.outputs]:
            c, ptr = ctype(var.dtype), namer(f"g_{var.name}")
            params.append(f"{'' if writable else 'const '}{c}* __restrict__ {ptr}")
            (scope.outputs if writable else scope.inputs).append(Operand.contiguous(ptr, c, var.shape))
            args.append(var.name)
        w = self.w
        w("", "// " + "-" * 98, OP_MARKER + describe(node))
        w(*(f"//{line}" for line in comment or ()))
        dims = f"__cluster_dims__({cluster}, 1, 1) " if cluster > 1 else ""
        w(f'extern "C" __global__ void {dims}__launch_bounds__({threads}, 1)')
        with w.block(f"{name}({', '.join(params)})"):
            yield scope
        launched = (grid[0] * cluster, *grid[1:])
        self.launches.append(KernelLaunch(name, tuple(launched), (threads, 1, 1), smem, tuple(args), index, overlap))

    def alias(self, name: str, of: str) -> None:
        self.aliases[name] = self.aliases.get(of, of)  # a view of a view is a view of the original

    def source(self) -> str:
        head = (f"// CUDA C++ generated by mdsl for kernel graph {self.graph.name}, target {self.arch}.\n"
                "// One __global__ function per launch, in launch order; each is preceded by the mugraph op it runs.\n")
        return head + INCLUDES + PRELUDE + self.w.text()


def _check_sizes(graph: KernelGraph) -> None:
    values = list(graph.inputs) + [v for n in graph.nodes for v in n.outputs]
    for v in values:
        if v.type.numel > MAX_ELEMENTS:
            raise UnsupportedError(f"%{v.name} ({v.type}) has more than 2^31 - 1 elements",
                                   hint="the CUDA backend indexes tensors with 32-bit integers; split the tensor")


def emit_cuda(graph: KernelGraph, *, arch: str = "sm_90a", options: Optional[CudaOptions] = None) -> CudaProgram:
    """One CUDA C++ translation unit implementing `graph` for `arch`, and how to launch it, with the
    fast paths `options` allows (none given: `CudaOptions.from_env()`)."""
    _check_sizes(graph)
    lowered = fuse_kernel_graph(graph)
    program = ProgramBuilder(lowered, arch, options if options is not None else CudaOptions.from_env())
    for index, node in enumerate(lowered.nodes):
        rule = node.opdef.rules.get("cuda")
        if rule is None:
            raise UnsupportedError(f"the CUDA backend has no rule for {node.op}", loc=node.loc)
        rule.kernel(program, index, node)
    return CudaProgram(program.source(), tuple(program.launches), tuple(program.aliases.items()), lowered)

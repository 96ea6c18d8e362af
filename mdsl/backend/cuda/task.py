"""One block of a superoptimized kernel as a device function that a persistent worker's warps run as a task.

A megakernel's worker is one CUDA block that runs task after task: its first warps compute, another warp
schedules, and nothing launches per task. A plan's custom kernel is a grid of identical blocks, each computing
its tile from its grid coordinates; so one block of it is one task. `emit_task` writes that block from the same
lowered form (mdsl.lowering.kernel) by the same emitter (mdsl.backend.cuda.block) as the kernel, with three
differences:

* the block's coordinates are the function's parameters `bx, by, bz` (the task's tile), not blockIdx;
* its barriers are `mdsl::block_sync<BAR, threads>()`, BAR the function's template parameter: a named barrier
  over the block's threads, so that the worker's other warps go on meanwhile (BAR 0 is __syncthreads, the
  kernel's own; 1..15 name the worker's barrier for its compute warps);
* its shared memory is the `smem` parameter (`TaskBody.smem_bytes` of it, 16-byte aligned: the worker's
  share for the task) rather than the kernel's dynamic shared memory. Reductions over several warps also use
  a little static shared memory of their own, as in the kernel.

The caller runs it on the first `threads` threads of its CUDA block (threadIdx.x below that), every one of
them, orders it after the writes of its inputs and before the reads of its outputs (the worker's events), and
passes a barrier of those threads between two tasks on the same shared memory: a task body waits for nothing
itself (it ends with its cp.async copies all done, as the kernel's block does). It is lowered without what
only a kernel launch has: no programmatic dependent launch (`CudaOptions.overlap`) and no skinny loop
staggered by the grid's block index (`stagger`). Otherwise the arithmetic is the kernel's, in the same order,
so a task computes the bits the kernel's block at the same coordinates computes.
"""
from __future__ import annotations

import types
from typing import Optional

import attrs

from mdsl.backend.cuda.block import emit_body
from mdsl.backend.cuda.codegen import KernelScope
from mdsl.backend.cuda.source import CodeWriter, Operand, ctype
from mdsl.errors import UnsupportedError
from mdsl.ir.graph import BlockGraph, KernelGraph
from mdsl.lowering.kernel import lower_custom
from mdsl.lowering.names import OP_MARKER, Namer, describe
from mdsl.lowering.options import CudaOptions
from mdsl.lowering.program import lower_graph


@attrs.frozen
class TaskBody:
    """A block as a task: `source` defines `template <int BAR> __device__ void name(inputs..., outputs...,
    int bx, int by, int bz, unsigned char* smem)`, to follow mdsl's prelude (mdsl.backend.cuda.prelude's
    INCLUDES and PRELUDE) in a translation unit. Every tensor parameter is a contiguous row-major device
    tensor of the graph's input or output of that place (`inputs`, `outputs`: their Vars)."""

    name: str
    source: str
    grid: tuple              # the kernel's blocks, (x, y, z): the tasks, a tile each
    threads: int             # the threads that run it
    smem_bytes: int          # the shared memory `smem` points at
    inputs: tuple
    outputs: tuple

    @property
    def tasks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def emit_task(graph: KernelGraph, *, arch: str = "sm_90a", options: Optional[CudaOptions] = None) -> TaskBody:
    """The block of `graph`'s one custom kernel (a plan whose launches are that kernel alone) as a task's
    device function for `arch`, with the fast paths `options` allows but those only a launch has."""
    options = attrs.evolve(options if options is not None else CudaOptions(), overlap=False, stagger=False)
    lowered = lower_graph(graph)
    if len(lowered.nodes) != 1 or not isinstance(lowered.nodes[0].body, BlockGraph):
        ops = ", ".join(f"{n.op} %{n.outputs[0].name}" for n in lowered.nodes)
        raise UnsupportedError(f"a task body is one custom kernel's block; {graph.name}'s plan runs {ops}",
                               hint="a task body comes from a plan whose launches are one custom kernel: "
                                    "search the ops that one kernel runs as a program of their own")
    node = lowered.nodes[0]
    kernel = lower_custom(node, options, arch)
    name = f"{graph.name}_task"
    w, namer = CodeWriter(), Namer({"bx", "by", "bz", "smem", "BAR"})
    scope = KernelScope(w, namer, [], [])
    params = []
    for var, writable in [(v, False) for v in node.inputs] + [(v, True) for v in node.outputs]:
        c, ptr = ctype(var.dtype), namer(f"g_{var.name}")
        params.append(f"{'' if writable else 'const '}{c}* __restrict__ {ptr}")
        (scope.outputs if writable else scope.inputs).append(Operand.contiguous(ptr, c, var.shape))
    w("", "// " + "-" * 98, OP_MARKER + describe(node),
      f"// one block of {kernel.grid} as a task: {kernel.threads} threads, {kernel.smem_bytes} bytes at smem "
      "(mdsl.backend.cuda.task)")
    w("template <int BAR>")
    signature = ", ".join([*params, "int bx", "int by", "int bz", "unsigned char* __restrict__ smem"])
    with w.block(f"__device__ __forceinline__ void {name}({signature})"):
        emit_body(types.SimpleNamespace(arch=arch), kernel, scope, block_index=("bx", "by", "bz"), task=True)
    return TaskBody(name, w.text(), tuple(kernel.grid), kernel.threads, kernel.smem_bytes, tuple(node.inputs),
                    tuple(node.outputs))

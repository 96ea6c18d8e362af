"""A split and its combine in one launch as LLVM IR (mdsl.lowering.onelaunch says which pairs qualify and why
the code is as it is), the CUDA backend's kernel (mdsl/backend/cuda/onelaunch.py) instruction for instruction:
one kernel on K1's grid and threads, K1's body, the block's arrival at its group's counter, then in the last
block of the group K2's body, its block index the group's."""
from __future__ import annotations

import attrs
from llvmlite import ir

from mdsl.backend.ptx.block import emit_body
from mdsl.backend.ptx.llvm import GLOBAL, I32, i32
from mdsl.lowering.kernel import OneLaunchKernel, lower_pair
from mdsl.lowering.onelaunch import SplitPair

_AXES = "xyz"
_ATOMIC = ir.FunctionType(I32, [ir.PointerType(addrspace=GLOBAL)])
#: the arrival: releases the block's partials (the barrier before it orders them first) and acquires the
#: group's, at GPU scope
ARRIVE = "atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;"
#: the last block's reset of its group's counter, for the next launch
RESET = "atom.global.exch.b32 $0, [$1], 0;"


def emit_one_launch(program, pair: SplitPair) -> None:
    graph = program.graph
    first, second = graph.nodes[pair.first], graph.nodes[pair.second]
    kernel = lower_pair(graph, pair, program.options, program.arch)
    with program.function(program.kernel_name(second), pair.first, first, pair.inputs, pair.outputs,
                          (first, second), grid=kernel.grid, threads=kernel.threads, smem=kernel.smem_bytes,
                          overlap=kernel.overlap, counters=pair.groups.count) as scope:
        arrays = {v.name: a for v, a in zip((*pair.inputs, *pair.outputs), (*scope.inputs, *scope.outputs))}

        def view(node):   # the kernel's scope seen as the node's kernel: its inputs and outputs
            return attrs.evolve(scope, inputs=[arrays[v.name] for v in node.inputs],
                                outputs=[arrays[v.name] for v in node.outputs])

        emit_body(program, kernel.first, view(first))
        block_index = _arrive(scope, kernel)
        scope.fn.marker_for(second)
        emit_body(program, kernel.second, view(second), block_index)


def _arrive(scope, kernel: OneLaunchKernel) -> tuple:
    """The block's arrival at its group's counter; the blocks but the group's last, and K1's threads past
    K2's, return. K2's block index (values per axis)."""
    fn, groups = scope.fn, kernel.pair.groups
    b = fn.b
    fn.barrier()   # every thread's stores of the partials issued
    group = i32(0)
    for a1, k, stride in groups.counter_terms():
        group = b.add(group, b.mul(b.udiv(fn.sreg(f"ctaid.{_AXES[a1]}"), i32(k)), i32(stride)))
    counter = b.gep(scope.counters, [group], inbounds=True, source_etype=I32)
    tid = fn.sreg("tid.x")

    def arrival() -> list:
        arrived = b.asm(_ATOMIC, ARRIVE, "=r,l,~{memory}", [counter], True)
        last = b.icmp_unsigned("==", arrived, i32(groups.size - 1))
        with fn.when(last):
            b.asm(_ATOMIC, RESET, "=r,l,~{memory}", [counter], True)
        return [b.zext(last, I32)]

    (combines,) = fn.if_values(b.icmp_unsigned("==", tid, i32(0)), arrival)
    leave = b.icmp_unsigned("==", fn.intrinsic("llvm.nvvm.barrier0.or", I32, [combines]), i32(0))
    if kernel.second.threads < kernel.first.threads:   # K2's threads combine (no barrier waits for exited ones)
        leave = b.or_(leave, b.icmp_unsigned(">=", tid, i32(kernel.second.threads)))
    with fn.when(leave):
        b.ret_void()
    coordinates = []
    for axis in range(3):
        found = groups.coordinate(axis)
        coordinates.append(i32(0) if found is None else b.udiv(fn.sreg(f"ctaid.{_AXES[found[0]]}"), i32(found[1])))
    return tuple(coordinates)

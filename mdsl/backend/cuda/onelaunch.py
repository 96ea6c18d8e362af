"""A split and its combine in one launch as C++ (mdsl.lowering.onelaunch says which pairs qualify and why the
code is as it is): one `__global__` function on K1's grid and threads, K1's body, the block's arrival at its
group's counter, then in the last block of the group K2's body, its block index the group's."""
from __future__ import annotations

import attrs

from mdsl.backend.cuda.block import emit_body, header
from mdsl.lowering.kernel import OneLaunchKernel, lower_pair
from mdsl.lowering.onelaunch import SplitPair

_AXES = "xyz"


def emit_one_launch(program, pair: SplitPair) -> None:
    graph = program.graph
    first, second = graph.nodes[pair.first], graph.nodes[pair.second]
    kernel = lower_pair(graph, pair, program.options, program.arch)
    comment = header(kernel.first.body) + ["  then, in the last block of each group, as the group's block:"] + \
        header(kernel.second.body)
    with program.function(program.kernel_name(second), pair.first, first, pair.inputs, pair.outputs,
                          (first, second), grid=kernel.grid, threads=kernel.threads, smem=kernel.smem_bytes,
                          comment=comment, overlap=kernel.overlap, counters=pair.groups.count) as scope:
        operands = {v.name: op for v, op in zip((*pair.inputs, *pair.outputs), (*scope.inputs, *scope.outputs))}

        def view(node):   # the function's scope seen as the node's kernel: its inputs and outputs
            return attrs.evolve(scope, inputs=[operands[v.name] for v in node.inputs],
                                outputs=[operands[v.name] for v in node.outputs])

        emit_body(program, kernel.first, view(first))
        block_index = _arrive(scope, kernel)
        with scope.w.block(""):   # K2's tiles and names in a scope of their own
            emit_body(program, kernel.second, view(second), block_index)


def _quotient(axis: int, divisor: int) -> str:
    return f"blockIdx.{_AXES[axis]}" + (f" / {divisor}" if divisor > 1 else "")


def _arrive(scope, kernel: OneLaunchKernel) -> tuple:
    """The block's arrival at its group's counter; the blocks but the group's last, and K1's threads past
    K2's, leave. K2's block index (C expressions per axis)."""
    w, groups = scope.w, kernel.pair.groups
    group = " + ".join(f"{_quotient(a1, k)}" + (f" * {stride}" if stride > 1 else "")
                       for a1, k, stride in groups.counter_terms()) or "0"
    w(f"// the split's blocks meet in {groups.count} group(s) of {groups.size}: the last of a group to arrive "
      "combines its partials",
      "__syncthreads();   // every thread's stores of the partials issued",
      "bool combines = false;")
    with w.block("if (threadIdx.x == 0)"):
        w("unsigned arrived;",
          "// releases the block's partials (the barrier orders them before) and acquires the group's, at GPU scope",
          'asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(arrived) '
          f': "l"({scope.counters} + ({group})) : "memory");',
          f"combines = arrived == {groups.size - 1}u;",
          f"if (combines) atomicExch({scope.counters} + ({group}), 0u);   // zero again for the next launch")
    w("if (!__syncthreads_or(combines)) return;   // (the same on every thread of the block)")
    if kernel.second.threads < kernel.first.threads:
        w(f"if (threadIdx.x >= {kernel.second.threads}) return;   // the combine's threads stay (a barrier does "
          "not wait for exited threads)")
    names = []
    for axis in range(3):
        found = groups.coordinate(axis)
        if found is None:
            names.append("0")
            continue
        name = scope.namer(f"combine_{_AXES[axis]}")
        w(f"const int {name} = {_quotient(*found)};")
        names.append(name)
    return tuple(names)

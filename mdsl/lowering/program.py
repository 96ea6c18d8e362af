"""A kernel graph as both backends emit it: sizes checked (indices are 32-bit), the bodies of custom
nodes fused (thread-graph fusion), one kernel per kernel-level node in the graph's order (a view such as
reshape gets an alias instead)."""
from __future__ import annotations

from mdsl.errors import UnsupportedError
from mdsl.ir.graph import KernelGraph
from mdsl.passes.fusion import fuse_kernel_graph

MAX_ELEMENTS = 2**31 - 1  # indices are 32-bit


def check_sizes(graph: KernelGraph) -> None:
    values = list(graph.inputs) + [v for n in graph.nodes for v in n.outputs]
    for v in values:
        if v.type.numel > MAX_ELEMENTS:
            raise UnsupportedError(f"%{v.name} ({v.type}) has more than 2^31 - 1 elements",
                                   hint="the kernels index tensors with 32-bit integers; split the tensor")


def lower_graph(graph: KernelGraph) -> KernelGraph:
    """The graph whose nodes the backends write, one kernel (or alias) each."""
    check_sizes(graph)
    return fuse_kernel_graph(graph)

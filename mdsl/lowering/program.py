"""A kernel graph as both backends emit it: sizes checked (indices are 32-bit), the bodies of custom
nodes fused (thread-graph fusion), one kernel per kernel-level node in the graph's order (a view such as
reshape gets an alias instead) but one for a split and its combine where they qualify (`onelaunch`),
recorded as the launches (mdsl.gpu.program) the runtime makes; a plain matmul's launch also as the library
GEMM the runtime runs in its place where it can (`gemm`)."""
from __future__ import annotations

from typing import Callable, Optional

from mdsl.gpu.program import KernelLaunch
from mdsl.ir.graph import KernelGraph, Node
from mdsl.ir.ops import BLOCK, KERNEL, THREAD, OpDef
from mdsl.ir.rules import RuleTable
from mdsl.lowering.gemm import library_gemm, swaps_last_two
from mdsl.lowering.grid import KERNEL_THREADS, kernel_grid
from mdsl.lowering.names import Namer
from mdsl.lowering.onelaunch import SplitPair, one_launch_pairs
from mdsl.lowering.options import CudaOptions
from mdsl.lowering.views import layout_copies, strided_views
from mdsl.passes.fusion import fuse_kernel_graph
from mdsl.passes.schedule import REGISTER_ACCUMULATORS

def rule_methods(op: OpDef, thread: str) -> tuple:
    """The methods a backend's rule of `op` has for the levels `op` appears at: `kernel` (its kernel, or an
    alias), `block` (its code on tiles; an accumulator's `init`, `update` and `finalize`, and `fold_product`
    where the lowering may fold a matmul's product into its registers) and `thread` (the name of the
    backend's method giving an element-wise op's value on registers)."""
    methods = []
    if KERNEL in op.levels:
        methods.append("kernel")
    if BLOCK in op.levels:
        methods += ["init", "update", "finalize"] if op.is_accumulator else ["block"]
        if op.name in REGISTER_ACCUMULATORS:
            methods.append("fold_product")
    if THREAD in op.levels:
        methods.append(thread)
    return tuple(methods)


def lower_graph(graph: KernelGraph) -> KernelGraph:
    """The graph whose nodes the backends write, one kernel (or alias) each. (Every tensor of a graph
    has at most 2^31 - 1 elements, `mdsl.ir.types.check_shape`: the kernels' 32-bit indices reach it.)"""
    return fuse_kernel_graph(graph)


class ProgramBuilder:
    """What both backends' program builders share: the graph, the target and the options, the kernels'
    names, and the launches and aliases recorded as the kernels are written (each backend adds its own
    `kernel(...)`, which writes a kernel and records its launch, and `write_pair(pair)`, which writes a
    split and its combine as one kernel, `mdsl.lowering.onelaunch`)."""

    def __init__(self, graph: KernelGraph, arch: str, options: Optional[CudaOptions] = None):
        self.graph = graph
        self.arch = arch
        self.options = options or CudaOptions()
        self.kernel_names = Namer()
        self.launches: list = []
        self.aliases: dict = {}
        #: value name -> the `StridedView` its kernels address it through (a split's part read in place, a concat's
        #: piece written in place)
        self.views: dict = strided_views(graph)
        #: value name -> the input of the transpose of its last two dims that makes it (`swaps_last_two`)
        self._transposed = {node.output.name: node.inputs[0] for node in graph.nodes if swaps_last_two(node)}

    def kernel_name(self, node: Node) -> str:
        """The name of the kernel implementing `node` (unique among the program's kernels)."""
        return self.kernel_names(f"{self.graph.name}_{node.outputs[0].name}")

    def record_launch(self, name: str, index: int, node: Node, grid: tuple, threads: int, smem: int,
                      overlap: bool, values: Optional[tuple] = None, counters: int = 0) -> None:
        """The launch of kernel `name` implementing `node` (index `index`); `values`: its parameters' (default
        the node's inputs, then its outputs; a strided view's is the value whose buffer it lies in); `counters`:
        the group counters it takes after them."""
        values = (*node.inputs, *node.outputs) if values is None else values
        args = tuple(self.views[v.name].of if v.name in self.views else v.name for v in values)
        library = library_gemm(node, lambda v: self._transposed.get(v.name)) \
            if self.options.library_gemm and not counters else None
        library_args = (args[0], self._transposed[args[1]].name, args[2]) if library and library.trans_b else ()
        self.launches.append(KernelLaunch(name, tuple(grid), (threads, 1, 1), smem, args, index, overlap, library,
                                          counters, library_args))

    def alias(self, name: str, of: str) -> None:
        self.aliases[name] = self.aliases.get(of, of)  # a view of a view is a view of the original

    def write_nodes(self, rules: RuleTable) -> None:
        """Each node's kernel (or alias) by its op's rule in the backend's table `rules`; each pair of a
        split and its combine that qualifies (`one_launch_pairs`) as one kernel, by `write_pair`."""
        pairs = {pair.first: pair for pair in one_launch_pairs(self.graph, self.options.threads)}
        index = 0
        while index < len(self.graph.nodes):
            if index in pairs:
                self.write_pair(pairs[index])
                index = pairs[index].second + 1
                continue
            node = self.graph.nodes[index]
            rules.lookup(node.op, node.loc).kernel(self, index, node)
            index += 1

    def write_pair(self, pair: SplitPair) -> None:
        raise NotImplementedError

    def copy_kernel(self, index: int, node: Node, copy: Callable) -> None:
        """The kernel of kernel-level split or concat `node` (index `index`), where it copies anything
        (`mdsl.lowering.views.layout_copies`): copy(scope, c) writes the loop of each `Copy` c over the grid's
        threads, in the backend's `function` scope."""
        lowered = layout_copies(node, self.views)
        if lowered is None:
            return
        with self.function(self.kernel_name(node), index, node, lowered.inputs, lowered.outputs, (node,),
                           grid=kernel_grid(lowered.elements), threads=KERNEL_THREADS, smem=0, overlap=False) as scope:
            for c in lowered.copies:
                copy(scope, c)

"""A small builder of kernel graphs with custom (block graph) nodes, straight in the IR, for the
generated test graphs of the CUDA backend."""
from __future__ import annotations

from typing import Callable, Optional

from mdsl.ir import BlockGraph, BlockInput, BlockOutput, KernelGraph, Node, ThreadGraph, validate_kernel_graph
from mdsl.ir.ops import get_op
from mdsl.ir.types import TensorType, Var
from mdsl.ir.validate import input_tile_type, output_tensor_type


class _Scope:
    def __init__(self):
        self.nodes: list = []
        self.taken: set = set()

    def name(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def op(self, op: str, *inputs: Var, **attrs) -> Var:
        outs = self.ops(op, *inputs, **attrs)
        assert len(outs) == 1
        return outs[0]

    def ops(self, op: str, *inputs: Var, **attrs) -> list:
        opdef = get_op(op)
        pairs = opdef.normalize_attrs(attrs)
        types = opdef.infer_types(tuple(v.type for v in inputs), pairs)
        outs = [Var(self.name(op), t) for t in types]
        self.nodes.append(Node(op, inputs, outs, pairs))
        return outs


class Graph(_Scope):
    def __init__(self, name: str):
        super().__init__()
        self.graph_name = name
        self.inputs: list = []
        self.outputs: list = []

    def input(self, name: str, shape, dtype) -> Var:
        var = Var(self.name(name), TensorType(shape, dtype))
        self.inputs.append(var)
        return var

    def block(self, grid=(1,), forloop: int = 1, threads: int = 128) -> "Block":
        return Block(self, grid, forloop, threads)

    def build(self, outputs: Optional[list] = None) -> KernelGraph:
        outs = outputs if outputs is not None else [v for n in self.nodes for v in n.outputs]
        graph = KernelGraph(self.graph_name, self.inputs, self.nodes, outs)
        validate_kernel_graph(graph)
        return graph


class Block(_Scope):
    """One custom node; `done()` appends it to the graph and returns its kernel-level outputs."""

    def __init__(self, graph: Graph, grid, forloop: int, threads: int):
        super().__init__()
        self.graph = graph
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.forloop, self.threads = forloop, threads
        self.inputs, self.operands, self.outs = [], [], []

    def input(self, tensor: Var, imap=(), fmap: Optional[int] = None) -> Var:
        imap = tuple(imap) + (None,) * (3 - len(imap))
        tile = input_tile_type(tensor.type, self.grid, self.forloop, imap, fmap)
        var = Var(self.name(f"{tensor.name}_tile"), tile)
        self.inputs.append(BlockInput(var, imap, fmap))
        self.operands.append(tensor)
        return var

    def fused(self, inputs: list, body: Callable) -> list:
        """A fused node: body(thread scope, *input vars) returns the thread graph's outputs."""
        scope = _Scope()
        params = [Var(scope.name(f"p{k}"), v.type) for k, v in enumerate(inputs)]
        results = body(scope, *params)
        tg = ThreadGraph(params, scope.nodes, results)
        outs = [Var(self.name("fused"), r.type) for r in results]
        self.nodes.append(Node("fused", inputs, outs, body=tg))
        return outs

    def output(self, tile: Var, omap=()) -> None:
        self.outs.append(BlockOutput(tile, tuple(omap) + (None,) * (3 - len(omap))))

    def done(self) -> list:
        body = BlockGraph(self.grid, self.threads, self.forloop, self.inputs, self.nodes, self.outs)
        results = [Var(self.graph.name(o.var.name), output_tensor_type(o.var.type, self.grid, o.omap))
                   for o in self.outs]
        self.graph.nodes.append(Node("custom", self.operands, results, body=body))
        return results

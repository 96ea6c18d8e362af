"""Programs whose inputs and outputs lie in wider tensors (mdsl.lowering.views): `read_in_place` makes each input
the middle part of a split of a new input padded before and after along one dim, `write_in_place` each output
the middle piece of a concat of the same kind, so that the kernels (block graphs under every fast path, row
kernels, element-wise chains, copies) address them through the wider tensors' strides from an offset."""
from __future__ import annotations

from mdsl.ir import KernelGraph, Node, validate_kernel_graph
from mdsl.ir.ops import get_op
from mdsl.ir.types import TensorType, Var
from mdsl.lowering.views import ALIGNMENT


def _padded(x: Var, dim: int) -> tuple:
    """(dim, before, after, wide): the Vars of x's padding along `dim` (16 bytes of its rows before it, 16 bytes
    or more after it, so that the wide tensor's rows keep 16-byte alignment) and of the wide tensor."""
    d = dim % x.type.rank
    lead = max(1, ALIGNMENT // x.dtype.itemsize)
    trail = lead + (-x.shape[d]) % lead

    def var(name: str, size: int) -> Var:
        return Var(f"{x.name}_{name}", TensorType(tuple(size if k == d else n for k, n in enumerate(x.shape)),
                                                  x.dtype))

    return d, var("before", lead), var("after", trail), var("wide", x.shape[d] + lead + trail)


def read_in_place(graph: KernelGraph, dim: int = -1) -> KernelGraph:
    """`graph` with each input x taken from a new input `x_wide`, split along `dim` into [before, x, after]."""
    inputs, splits = [], []
    for x in graph.inputs:
        d, before, after, wide = _padded(x, dim)
        inputs.append(wide)
        attrs = get_op("split").normalize_attrs({"sizes": (before.shape[d], x.shape[d], after.shape[d]), "dim": d})
        splits.append(Node("split", (wide,), (before, x, after), attrs))
    out = KernelGraph(f"{graph.name}_in_place", inputs, (*splits, *graph.nodes), graph.outputs)
    validate_kernel_graph(out)
    return out


def write_in_place(graph: KernelGraph, dim: int = -1) -> KernelGraph:
    """`graph` with each output y returned as `y_wide`, the concat along `dim` of new inputs `y_before` and
    `y_after` around it."""
    inputs, nodes, outputs = list(graph.inputs), list(graph.nodes), []
    for y in graph.outputs:
        d, before, after, wide = _padded(y, dim)
        inputs += [before, after]
        nodes.append(Node("concat", (before, y, after), (wide,), get_op("concat").normalize_attrs({"dim": d})))
        outputs.append(wide)
    out = KernelGraph(f"{graph.name}_written_in_place", inputs, nodes, outputs)
    validate_kernel_graph(out)
    return out

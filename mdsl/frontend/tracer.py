"""Tracing: symbolic tensors record operator applications into a kernel graph or a block graph.

A `Tracer` owns the nodes of one graph under construction. Every `SymbolicTensor` belongs to one
tracer; `bind` checks an operator application against the registry (level, attributes, shapes,
dtypes), names the result and records the node with the user's source line. Python operators on
symbolic tensors are attached in `mdsl.frontend.functions`.
"""
from __future__ import annotations

import keyword
import re
from typing import Optional, Sequence

from mdsl.errors import MdslError, SourceLoc, TraceError, UnsupportedError, ValidationError
from mdsl.frontend.source import caller_loc
from mdsl.ir.graph import BlockGraph, BlockInput, BlockOutput, KernelGraph, Node
from mdsl.ir.ops import BLOCK, KERNEL, get_op
from mdsl.ir.types import TensorType, Var, check_tensor_type
from mdsl.ir.validate import (check_launch, input_tile_type, output_tensor_type, validate_block_graph,
                              validate_kernel_graph)


def sanitize_name(name: str) -> str:
    """A valid IR identifier derived from a user-provided name."""
    clean = re.sub(r"[^A-Za-z0-9_]", "_", name) or "v"
    if clean[0].isdigit() or keyword.iskeyword(clean):
        clean = "v_" + clean
    return clean


class Tracer:
    level: str = KERNEL

    def __init__(self, name: str):
        self.name = name
        self.nodes: list = []
        self._names: set = set()
        self._next_suffix: dict = {}   # base -> the first suffix not tried yet, so naming stays O(1)
        self.closed = False

    def fresh(self, base: str) -> str:
        base = sanitize_name(base)
        name, k = base, self._next_suffix.get(base, 0)
        if k:
            name = f"{base}_{k}"
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._next_suffix[base] = k + 1
        self._names.add(name)
        return name

    def new_var(self, base: str, type_: TensorType) -> Var:
        return Var(self.fresh(base), type_)

    def check_open(self, loc: Optional[SourceLoc]) -> None:
        if self.closed:
            raise TraceError(f"a symbolic tensor of {self.describe()} was used after that trace ended", loc=loc,
                             hint="symbolic tensors exist only while their function is traced; "
                                  "do not keep them in globals or return them to other traces")

    def describe(self) -> str:
        return f"kernel {self.name}"

    def bind(self, op: str, inputs: Sequence["SymbolicTensor"], attrs: Optional[dict] = None,
             loc: Optional[SourceLoc] = None) -> tuple:
        loc = loc or caller_loc()
        self.check_open(loc)
        try:
            opdef = get_op(op)
            if self.level not in opdef.levels:
                raise UnsupportedError(f"{op} is not available inside a {self.level} graph",
                                       hint=f"use it at the {' or '.join(sorted(opdef.levels))} level")
            attr_pairs = opdef.normalize_attrs(attrs or {})
            out_types = opdef.infer_types(tuple(t.var.type for t in inputs), attr_pairs)
            for t in out_types:
                check_tensor_type(t, f"the result of {op}")
        except MdslError as e:
            raise e.with_loc(loc)
        outs = tuple(self.new_var(op, t) for t in out_types)
        self.nodes.append(Node(op, [t.var for t in inputs], outs, attr_pairs, loc=loc))
        return tuple(SymbolicTensor(self, v) for v in outs)


class KernelTracer(Tracer):
    level = KERNEL

    def __init__(self, name: str):
        super().__init__(name)
        self.inputs: list = []
        self.block_builders = 0

    def add_input(self, name: str, type_: TensorType) -> "SymbolicTensor":
        var = self.new_var(name, type_)
        self.inputs.append(var)
        return SymbolicTensor(self, var)

    def finish(self, outputs: Sequence["SymbolicTensor"]) -> KernelGraph:
        graph = KernelGraph(self.name, self.inputs, self.nodes, [t.var for t in outputs])
        validate_kernel_graph(graph)
        self.closed = True
        return graph

    def inline(self, graph: KernelGraph, args: Sequence["SymbolicTensor"]) -> tuple:
        """Record another kernel's graph applied to `args` (tensors of this trace); its results, one per
        output. The nodes keep their source lines, in the called kernel's function."""
        values = {v.name: a.var for v, a in zip(graph.inputs, args)}
        for node in graph.nodes:
            outs = tuple(self.new_var(v.name, v.type) for v in node.outputs)
            values.update(zip((v.name for v in node.outputs), outs))
            self.nodes.append(Node(node.op, [values[v.name] for v in node.inputs], outs, node.attrs, node.body,
                                   loc=node.loc))
        return tuple(SymbolicTensor(self, values[v.name]) for v in graph.outputs)


_ACTIVE_KERNEL_TRACERS: list = []


def current_kernel_tracer(loc: Optional[SourceLoc]) -> KernelTracer:
    if not _ACTIVE_KERNEL_TRACERS:
        raise TraceError("a block graph can only be built inside a @mdsl.kernel function", loc=loc,
                         hint="move the `with mdsl.block_graph(...)` into the body of a function decorated "
                              "with @mdsl.kernel; its inputs are that kernel's tensors")
    return _ACTIVE_KERNEL_TRACERS[-1]


class SymbolicTensor:
    """A tensor whose value is unknown while tracing: it has a shape, a dtype and a name."""

    __array_ufunc__ = None  # make numpy defer to our reflected operators

    def __init__(self, tracer: Tracer, var: Var):
        self.tracer = tracer
        self.var = var

    shape = property(lambda self: self.var.type.shape)
    dtype = property(lambda self: self.var.type.dtype)
    ndim = property(lambda self: self.var.type.rank)

    def __repr__(self) -> str:
        return f"<{self.tracer.level} tensor %{self.var.name}: {self.var.type}>"

    def __len__(self) -> int:
        return self.shape[0]

    def __hash__(self) -> int:
        return id(self)

    def _no_value(self, what: str):
        raise TraceError(f"{what} of traced tensor %{self.var.name} {self.var.type} is unknown while tracing "
                         f"(data-dependent control flow)", loc=caller_loc(),
                         hint="mdsl traces the function once with symbolic tensors, so Python `if`/`while` and "
                              "conversions cannot depend on tensor values; branch on shapes (x.shape) instead, "
                              "or compute both cases and combine them arithmetically")

    def __bool__(self):
        self._no_value("the truth value")

    def __float__(self):
        self._no_value("the float value")

    def __int__(self):
        self._no_value("the integer value")

    def __index__(self):
        self._no_value("the integer value")

    def _no_compare(self, *_):
        raise TraceError(f"comparisons of traced tensors (%{self.var.name}) are not supported", loc=caller_loc(),
                         hint="use mdsl.max / mdsl.clamp / mdsl.relu for value-dependent selections")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _no_compare

    def __iter__(self):
        raise TraceError(f"iterating over traced tensor %{self.var.name} is not supported", loc=caller_loc(),
                         hint="use mdsl.split(x, sizes, dim) or mdsl.chunk(x, n, dim) to take a tensor apart")

    def __getitem__(self, item):
        raise UnsupportedError(f"indexing traced tensor %{self.var.name} is not supported", loc=caller_loc(),
                               hint="use mdsl.split / mdsl.chunk to take slices and mdsl.reshape to drop dims")

    def __array__(self, *args, **kwargs):
        raise TraceError(f"traced tensor %{self.var.name} {self.var.type} has no values to make a numpy array of",
                         loc=caller_loc(),
                         hint="numpy runs on the arrays a kernel is called with, not inside the kernel: use "
                              "mdsl's functions (mdsl.exp, mdsl.sum, mdsl.concat, ...) on traced tensors")


def _from_end(dim: int, rank: int) -> int:
    """A negative dim counted from the end; other dims unchanged (range errors are the IR's to report)."""
    return dim + rank if dim < 0 else dim


def as_symbolic(value, what: str) -> SymbolicTensor:
    if not isinstance(value, SymbolicTensor):
        raise TraceError(f"{what} must be a traced tensor, got {type(value).__name__}", loc=caller_loc(),
                         hint="mdsl functions take the tensors of the traced function (its parameters and "
                              "what was computed from them); constants are not tensors")
    return value


def common_tracer(tensors: Sequence[SymbolicTensor], op: str) -> Tracer:
    for t in tensors:
        if t.tracer.closed:  # a leaked tensor: say so, rather than that two traces are mixed
            t.tracer.check_open(caller_loc())
    tracer = tensors[0].tracer
    for t in tensors[1:]:
        if t.tracer is not tracer:
            raise TraceError(f"{op} mixes a tensor of {tracer.describe()} with one of {t.tracer.describe()}",
                             loc=caller_loc(),
                             hint="inside a block graph use its tiles (b.input(x)), not the kernel's tensors")
    return tracer


# ---------------------------------------------------------------------------------------------
# block graphs written by hand

class BlockBuilder(Tracer):
    """Build a graph-defined op (custom kernel) by hand inside a @mdsl.kernel function.

        with mdsl.block_graph(grid=(48,), forloop=64) as b:
            xt = b.input(x, imap=(None,), fmap=1)        # X replicated, tiled along dim 1 by the loop
            wt = b.input(w, imap=(1,), fmap=0)           # W's columns split over grid.x
            y = b.accum(xt @ wt) / b.accum_rms(xt)
            b.output(y, omap=(1,))
        (out,) = b.results                               # kernel-level tensors
    """

    level = BLOCK

    def __init__(self, grid: Sequence[int] = (1,), forloop: int = 1, threads: int = 128,
                 name: Optional[str] = None, loc: Optional[SourceLoc] = None):
        self.loc = loc or caller_loc()
        self.kernel = current_kernel_tracer(self.loc)
        self.kernel.block_builders += 1
        super().__init__(name or f"block{self.kernel.block_builders}")
        try:
            self.grid = tuple(grid)
        except TypeError:
            raise ValidationError(f"grid must be a tuple of 1 to 3 block counts, got {grid!r}", loc=self.loc,
                                  hint="e.g. grid=(48,) or grid=(4, 2)") from None
        if not 1 <= len(self.grid) <= 3:
            raise ValidationError(f"a grid has 1 to 3 dims (x, y, z), got {list(self.grid)}", loc=self.loc,
                                  hint="e.g. grid=(48,) or grid=(4, 2)")
        try:
            check_launch(self._grid3, threads, forloop)
        except MdslError as e:
            raise e.with_loc(self.loc)
        self.forloop = forloop
        self.threads = threads
        self.inputs: list = []
        self.operands: list = []
        self.outputs: list = []
        self.results: Optional[tuple] = None

    def describe(self) -> str:
        return f"block graph {self.name}"

    @property
    def _grid3(self) -> tuple:
        return tuple(self.grid) + (1,) * (3 - len(self.grid))

    def _grid_map(self, dims: tuple, rank: int) -> tuple:
        """Normalize an imap/omap: negative dims count from the end; a grid dim of size 1 splits
        nothing, so its entry is dropped (lets one map serve every grid of a parametric graph)."""
        dims = tuple(dims)
        if len(dims) > 3:
            raise ValidationError(f"a grid map has at most 3 entries (x, y, z), got {list(dims)}")
        dims += (None,) * (3 - len(dims))
        return tuple(None if d is None or size == 1 else _from_end(d, rank) for d, size in zip(dims, self._grid3))

    def __enter__(self) -> "BlockBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self.results is None:
            self.finish()

    def input(self, tensor: SymbolicTensor, imap: Sequence = (), fmap: Optional[int] = None) -> SymbolicTensor:
        """The tile of kernel tensor `tensor` that each block sees in each loop iteration."""
        loc = caller_loc()
        self.check_open(loc)
        tensor = as_symbolic(tensor, "b.input's tensor")
        if tensor.tracer is not self.kernel:
            raise TraceError("b.input takes a tensor of the enclosing kernel", loc=loc)
        try:
            fmap_n = None if fmap is None else _from_end(fmap, tensor.ndim)
            imap_n = self._grid_map(imap, tensor.ndim)
            tile = input_tile_type(tensor.var.type, self._grid3, self.forloop, imap_n, fmap_n,
                                   f"block input from %{tensor.var.name} ({tensor.var.type})")
        except MdslError as e:
            raise e.with_loc(loc)
        var = self.new_var(tensor.var.name, tile)
        self.inputs.append(BlockInput(var, imap_n, fmap_n))
        self.operands.append(tensor)
        return SymbolicTensor(self, var)

    def output(self, tile: SymbolicTensor, omap: Sequence = (), name: Optional[str] = None) -> None:
        """Save a post-loop tile; grid dim g concatenates blocks along tensor dim omap[g]. `name` names
        the kernel-level tensor (by default the tile's name)."""
        loc = caller_loc()
        self.check_open(loc)
        tile = as_symbolic(tile, "b.output's tile")
        if tile.tracer is not self:
            raise TraceError("b.output takes a tile of this block graph", loc=loc)
        try:  # checked now as well as in finish(), so that the error points at this line
            out = BlockOutput(tile.var, self._grid_map(omap, tile.ndim))
            if tile.var.name not in BlockGraph(self.grid, self.threads, self.forloop, self.inputs,
                                               self.nodes, ()).post_loop_vars():
                raise ValidationError(f"block output %{tile.var.name} does not pass through an accumulator",
                                      hint="close the for-loop with b.accum (or b.accum_sum, b.accum_max, ...) "
                                           "before saving a tile")
            output_tensor_type(tile.var.type, self._grid3, out.omap, f"block output %{tile.var.name}")
        except MdslError as e:
            raise e.with_loc(loc)
        self.outputs.append((out, name or tile.var.name))

    def _accumulate(self, op: str, inputs, **attrs) -> SymbolicTensor:
        (out,) = self.bind(op, [as_symbolic(t, f"{op}'s operand") for t in inputs], attrs)
        return out

    def accum(self, x):
        """Sum of the tile over the loop iterations."""
        return self._accumulate("accum", [x])

    def accum_sum(self, x):
        """Sum over the iterations and the tile's last dim (kept as size 1)."""
        return self._accumulate("accum_sum", [x])

    def accum_mean(self, x):
        """Mean over the iterations and the tile's last dim (kept as size 1)."""
        return self._accumulate("accum_mean", [x])

    def accum_rms(self, x, eps: float = 1e-6):
        """sqrt(mean of squares over the iterations and the last dim + eps)."""
        return self._accumulate("accum_rms", [x], eps=eps)

    def accum_max(self, x):
        """Element-wise maximum over the iterations."""
        return self._accumulate("accum_max", [x])

    def accum_rescale(self, x, m):
        """Online softmax: sum_i exp(m_i - max_j m_j) * x_i."""
        return self._accumulate("accum_rescale", [x, m])

    def accum_sum_rescale(self, x, m):
        """Online softmax: sum_i exp(m_i - max_j m_j) * rowsum(x_i)."""
        return self._accumulate("accum_sum_rescale", [x, m])

    def finish(self) -> tuple:
        """Close the block graph: record the custom op in the kernel; returns its output tensors."""
        self.check_open(self.loc)
        if not self.outputs:
            raise TraceError(f"{self.describe()} has no outputs", loc=self.loc, hint="call b.output(tile, omap=...)")
        graph = BlockGraph(self.grid, self.threads, self.forloop, self.inputs, self.nodes,
                           [o for o, _ in self.outputs])
        try:
            out_types = validate_block_graph(graph, tuple(t.var.type for t in self.operands))
        except MdslError as e:
            raise e.with_loc(self.loc)
        self.closed = True
        outs = tuple(self.kernel.new_var(name, t) for (_, name), t in zip(self.outputs, out_types))
        self.kernel.nodes.append(Node("custom", [t.var for t in self.operands], outs, body=graph, loc=self.loc))
        self.results = tuple(SymbolicTensor(self.kernel, v) for v in outs)
        return self.results


def block_graph(grid: Sequence[int] = (1,), forloop: int = 1, threads: int = 128,
                name: Optional[str] = None) -> BlockBuilder:
    """Start a hand-written block graph (see `BlockBuilder`)."""
    return BlockBuilder(grid, forloop, threads, name, loc=caller_loc())

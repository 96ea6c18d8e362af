"""The mugraph: kernel graph, block graph and thread graph. All nodes are immutable.

* A `KernelGraph` is a DAG of operators on device tensors. A `custom` node's body is a `BlockGraph`.
* A `BlockGraph` is one custom kernel: a grid of thread blocks, `threads` per block and one for-loop
  of `forloop` iterations. Input i of the block graph is the tile of input i of the custom node that
  a block sees: `imap[g]` names the tensor dim split across grid dim g (None: replicated), `fmap`
  the dim split across the loop iterations (None: the whole tile every iteration). Accumulators close
  the loop; output i's `omap[g]` names the tensor dim that grid dim g concatenates blocks into.
* A `ThreadGraph` is an element-wise chain kept in registers: the body of a block-level `fused` node.

Every structure has a structural key (`.key`): equal for graphs that differ only in value names.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Optional, Union

import attrs
from attrs import field

from mdsl.errors import SourceLoc
from mdsl.ir.ops import get_op
from mdsl.ir.printer import print_block_graph, print_graph, print_thread_graph
from mdsl.ir.types import TensorType, Var

GridMap = tuple  # three entries (grid x, y, z), each a tensor dim or None


def _map3(value: Iterable) -> GridMap:
    entries = [None if v is None else int(v) for v in value]
    if len(entries) > 3:
        raise ValueError(f"a grid map has at most 3 entries (x, y, z), got {len(entries)}")
    return tuple(entries + [None] * (3 - len(entries)))


def _dim3(value: Iterable) -> tuple:
    dims = [int(v) for v in value]
    if len(dims) > 3:
        raise ValueError(f"a grid has at most 3 dims (x, y, z), got {len(dims)}")
    return tuple(dims + [1] * (3 - len(dims)))


@attrs.frozen(cache_hash=True)
class Node:
    """One operator application. `attrs` is a tuple of (name, value) pairs in the operator's declared
    attribute order (see `OpDef.normalize_attrs`); `body` holds the
    block or thread graph of a graph-defined op; `loc` (not part of equality) is the user's line."""

    op: str
    inputs: tuple = field(converter=tuple)
    outputs: tuple = field(converter=tuple)
    attrs: tuple = field(default=(), converter=tuple)
    body: Optional[Union["BlockGraph", "ThreadGraph"]] = None
    loc: Optional[SourceLoc] = field(default=None, eq=False, hash=False)

    @property
    def opdef(self):
        return get_op(self.op)

    @property
    def attr_dict(self) -> dict:
        return dict(self.attrs)

    def attr(self, name: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        return default

    @property
    def output(self) -> Var:
        assert len(self.outputs) == 1, f"{self.op} has {len(self.outputs)} outputs"
        return self.outputs[0]


@attrs.frozen(cache_hash=True)
class KernelGraph:
    name: str
    inputs: tuple = field(converter=tuple)
    nodes: tuple = field(converter=tuple)
    outputs: tuple = field(converter=tuple)

    @property
    def key(self) -> str:
        return structural_key(self)

    def producers(self) -> dict:
        """Var name -> the node that defines it (graph inputs are absent)."""
        return {v.name: n for n in self.nodes for v in n.outputs}

    def users(self) -> dict:
        out: dict = {}
        for n in self.nodes:
            for v in n.inputs:
                out.setdefault(v.name, []).append(n)
        return out

    def custom_nodes(self) -> list:
        return [n for n in self.nodes if n.body is not None]

    def __str__(self) -> str:
        return print_graph(self)


@attrs.frozen(cache_hash=True)
class BlockInput:
    var: Var
    imap: GridMap = field(converter=_map3)
    fmap: Optional[int] = None


@attrs.frozen(cache_hash=True)
class BlockOutput:
    var: Var
    omap: GridMap = field(converter=_map3)


@attrs.frozen(cache_hash=True)
class BlockGraph:
    grid: tuple = field(converter=_dim3)
    threads: int
    forloop: int
    inputs: tuple = field(converter=tuple)
    nodes: tuple = field(converter=tuple)
    outputs: tuple = field(converter=tuple)

    @property
    def num_blocks(self) -> int:
        x, y, z = self.grid
        return x * y * z

    @property
    def key(self) -> str:
        return structural_key(self)

    def post_loop_vars(self) -> set:
        """Names of the values computed after the for-loop: accumulator outputs and what derives from them."""
        post: set = set()
        for n in self.nodes:
            if n.opdef.is_accumulator or any(v.name in post for v in n.inputs):
                post.update(v.name for v in n.outputs)
        return post

    def __str__(self) -> str:
        return print_block_graph(self)


@attrs.frozen(cache_hash=True)
class ThreadGraph:
    inputs: tuple = field(converter=tuple)
    nodes: tuple = field(converter=tuple)
    outputs: tuple = field(converter=tuple)

    @property
    def key(self) -> str:
        return structural_key(self)

    def __str__(self) -> str:
        return print_thread_graph(self)


# ---------------------------------------------------------------------------------------------
# structural keys: the graph with every value renamed by order of definition, hashed

def _canonical(obj, names: dict) -> Any:
    def ref(v: Var):
        return (names.get(v.name, v.name), str(v.type))

    def define(v: Var):
        names[v.name] = f"v{len(names)}"
        return ref(v)

    def nodes(ns):
        out = []
        for n in ns:
            ins = tuple(ref(v) for v in n.inputs)
            body = _canonical(n.body, {}) if n.body is not None else None
            outs = tuple(define(v) for v in n.outputs)
            out.append((n.op, ins, outs, tuple((k, repr(v)) for k, v in n.attrs), body))
        return tuple(out)

    if isinstance(obj, KernelGraph):
        ins = tuple(define(v) for v in obj.inputs)
        return ("kernel", ins, nodes(obj.nodes), tuple(ref(v) for v in obj.outputs))
    if isinstance(obj, BlockGraph):
        ins = tuple((define(i.var), i.imap, i.fmap) for i in obj.inputs)
        body = nodes(obj.nodes)
        outs = tuple((ref(o.var), o.omap) for o in obj.outputs)
        return ("block", obj.grid, obj.threads, obj.forloop, ins, body, outs)
    if isinstance(obj, ThreadGraph):
        ins = tuple(define(v) for v in obj.inputs)
        return ("thread", ins, nodes(obj.nodes), tuple(ref(v) for v in obj.outputs))
    raise TypeError(f"not a mugraph: {type(obj).__name__}")


def structural_key(graph) -> str:
    """A hex digest equal for graphs that differ only in value names (and source locations)."""
    return hashlib.sha256(repr(_canonical(graph, {})).encode()).hexdigest()[:32]


def make_var(name: str, shape, dtype) -> Var:
    return Var(name, TensorType(shape, dtype))

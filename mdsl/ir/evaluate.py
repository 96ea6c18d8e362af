"""Evaluation of mugraphs at every level, generic over a *semantics*.

The walk is the same whatever a value means: kernel graph nodes in order; a graph-defined operator runs
its body; a block graph runs all its blocks at once, loop iteration by loop iteration, on copies of the
tiles each block would load (imap/fmap slicing; nodes that read only tiles loaded alike in every
iteration run once, before the loop), closes the loop with its accumulators, runs the nodes
after the loop and writes each block's output tiles where its omap says, each element exactly once.
What an operator or an accumulator computes, and how values are made and checked, is the `Semantics`'
business: floats in the reference interpreter, residues in the finite-field verifier.

Values are numpy arrays whose leading dims are the tensor's dims; a semantics may add trailing axes
(a finite-field value carries two residues per element), since the walk only ever indexes leading dims.
Inside a block graph every value has one more leading axis, the *block axis* (one entry per block), so that an
operator runs once per iteration for all blocks rather than once per block. Rules need not know: the walk
hands them nodes whose non-negative `dim` attributes count past the block axis (and whose `shape` attribute, a
reshape's, has the block axis in front, as has a transpose's `perm`), and operands of one rank (size-1 axes
inserted after the block axis, where numpy's broadcasting would put them before it). A tile that every block
reads whole is read once, with a block axis of size 1 that broadcasts, so that what derives from it alone is
computed once, not once per block.
Accumulators get, for each iteration, their inputs with the block axis; they stack the iterations on a new
axis 0 and reduce it and axes counted from the end, which the block axis does not move.
"""
from __future__ import annotations

import itertools
from typing import Any, Optional, Protocol, Sequence

import attrs
import numpy as np

from mdsl.errors import MdslError, ShapeError, ValidationError
from mdsl.ir.graph import BlockGraph, KernelGraph, Node, ThreadGraph
from mdsl.ir.ops import BLOCK, THREAD
from mdsl.ir.types import TensorType, Var
from mdsl.ir.validate import input_tile_type, output_tensor_type

Env = dict  # value name -> value

#: Blocks run together hold at most about this many elements (tiles of one iteration, and every
#: iteration's accumulator inputs): 32 MiB of finite-field values (two int64 residues each).
CHUNK_ELEMENTS = 2 ** 21
#: A semantics may hold a large input narrower than its arithmetic (int32 residues, float16 or float32
#: values under float32 or float64) and widen at most about this many of its elements at a time where
#: an operator reads it in pieces (a matmul, by blocks of its output; a block graph, by tiles): 16 MiB
#: of int64 or float64.
WIDEN_ELEMENTS = 2 ** 21


class Semantics(Protocol):
    """What values mean: how they are made, checked and computed."""

    def take_input(self, var: Var, array: Any) -> np.ndarray:
        """A kernel graph's input as a value: the caller's array, read-only, where it already holds values
        of this semantics (a large input is not copied), else a converted copy. Nothing writes into it."""

    def store(self, var: Var, value: np.ndarray) -> np.ndarray:
        """A kernel-level tensor as device memory holds it (e.g. rounded to its dtype)."""

    def convert(self, value: Any) -> np.ndarray:
        """An operator's result, or a tensor handed to a body, as a value of this semantics."""

    def shape(self, value: np.ndarray) -> tuple:
        """The tensor shape a value holds (its leading dims)."""

    def apply(self, node: Node, args: list) -> list:
        """An operator that is neither graph-defined nor an accumulator."""

    def accumulate(self, node: Node, iterations: list) -> list:
        """An accumulator, given for each loop iteration the list of its inputs (with the block axis)."""

    def fold(self, node: Node) -> Optional[Any]:
        """An accumulator's running form, where the semantics has one that gives `accumulate`'s result:
        an object whose `add(inputs)` takes each iteration's inputs in turn and whose `result()` gives the
        outputs, so that the blocks need not hold every iteration's inputs; None: `accumulate` it is."""

    def empty(self, type_: TensorType) -> np.ndarray:
        """A block graph's output tensor before the blocks write it (poisoned, where possible)."""


# ---------------------------------------------------------------------------------------------
# nodes; `lead` is the shape of the leading axes that values carry besides the tensor's: () at
# kernel level, (number of blocks,) inside a block graph

def _args(env: Env, node: Node) -> list:
    missing = [v.name for v in node.inputs if v.name not in env]
    if missing:
        raise ValidationError(f"{node.op} reads %{missing[0]}, which is not available there", loc=node.loc)
    return [env[v.name] for v in node.inputs]


def _aligned(node: Node, args: list) -> list:
    """Batched operands of one rank: size-1 axes after the block axis, so that broadcasting pairs tensor
    dims as it would without the block axis (numpy would pad before it)."""
    rank = max(v.type.rank for v in node.inputs)
    return [np.expand_dims(a, tuple(range(1, 1 + rank - v.type.rank))) for v, a in zip(node.inputs, args)]


def _bind(sem: Semantics, env: Env, variables: Sequence[Var], values: Sequence, lead: tuple = ()) -> None:
    """Store values under their names, checking that they have the declared shapes."""
    if len(values) != len(variables):
        raise ValidationError(f"{len(values)} value(s) computed for {len(variables)} name(s)")
    for var, value in zip(variables, values):
        value = sem.convert(value)
        shape = sem.shape(value)
        # a value equal in every block may have a block axis of size 1 (see _block_index)
        if shape[len(lead):] != var.shape or shape[:len(lead)] not in (lead, (1,) * len(lead)):
            raise ShapeError(f"%{var.name} is declared {var.type} but evaluates to shape {list(shape[len(lead):])}")
        env[var.name] = value


def _run_node(sem: Semantics, node: Node, args: list, lead: tuple) -> list:
    opdef = node.opdef
    if opdef.body_level == BLOCK:  # a kernel-level node: lead is ()
        return run_block_graph(node.body, args, sem)
    if opdef.body_level == THREAD:
        return run_thread_graph(node.body, args, sem, lead)
    if opdef.is_accumulator:
        raise ValidationError(f"{node.op} closes a block graph's for-loop and cannot run here")
    return sem.apply(node, _aligned(node, args) if lead else args)


def _eval_nodes(sem: Semantics, nodes: Sequence[Node], env: Env, lead: tuple = ()) -> None:
    for node in nodes:
        try:
            _bind(sem, env, node.outputs, _run_node(sem, node, _args(env, node), lead), lead)
        except MdslError as e:
            raise e.with_loc(node.loc)


def _per_block(node: Node) -> Node:
    """`node` as it runs on values with a block axis: a non-negative `dim` attribute (the one attribute
    operators use to name a tensor dim) counts past that axis, a `shape` attribute (a reshape's) keeps it
    (-1: the blocks, or 1 for a value equal in every block), a `perm` (a transpose's) leaves it in front; a
    thread-graph body's nodes likewise."""
    shifted = tuple((name, value + 1 if name == "dim" and value >= 0 else
                     (-1, *value) if name == "shape" else
                     (0, *(p + 1 for p in value)) if name == "perm" else value) for name, value in node.attrs)
    body = node.body
    if isinstance(body, ThreadGraph):
        body = attrs.evolve(body, nodes=tuple(_per_block(n) for n in body.nodes))
    return attrs.evolve(node, attrs=shifted, body=body)


# ---------------------------------------------------------------------------------------------
# kernel graphs

def run_kernel_graph(graph: KernelGraph, inputs: Sequence, sem: Semantics) -> list:
    """Evaluate a kernel graph; returns the values of its outputs."""
    if len(inputs) != len(graph.inputs):
        raise ShapeError(f"kernel graph {graph.name} takes {len(graph.inputs)} input(s), got {len(inputs)}")
    env: Env = {var.name: sem.store(var, sem.take_input(var, array)) for var, array in zip(graph.inputs, inputs)}
    returned = {v.name for v in graph.outputs}
    last_read = {v.name: i for i, node in enumerate(graph.nodes) for v in node.inputs}
    for i, node in enumerate(graph.nodes):
        _eval_nodes(sem, (node,), env)
        for var in node.outputs:
            env[var.name] = sem.store(var, env[var.name])
        # a value no later node reads is dropped now: at large shapes intermediates take gigabytes
        for var in (*node.inputs, *node.outputs):
            if last_read.get(var.name, -1) <= i and var.name not in returned:
                env.pop(var.name, None)
    return [_own(sem.convert(env[v.name])) for v in graph.outputs]


def _own(value: np.ndarray) -> np.ndarray:
    """An output as the caller's own array: a copy where it is (a view of) an input, which is read-only."""
    return value if value.flags.writeable else value.copy()


# ---------------------------------------------------------------------------------------------
# block graphs

def _grid_view(array: np.ndarray, shape: tuple, dim_map: tuple, grid: tuple) -> np.ndarray:
    """A view of `array`, a tensor of `shape` (and the semantics' trailing axes), with three leading block
    axes: the part of block (x, y, z) under `dim_map` (an imap or an omap) at [x, y, z], where a grid dim
    that the map replicates has an axis of size 1 (index 0)."""
    split = {d: g for g, d in enumerate(dim_map) if d is not None}
    dims: list = []
    block_axes: list = [None, None, None]
    part_axes = []
    for d, n in enumerate(shape):
        if d in split:
            block_axes[split[d]] = len(dims)
            dims.append(grid[split[d]])
            n //= grid[split[d]]
        part_axes.append(len(dims))
        dims.append(n)
    for g, axis in enumerate(block_axes):
        if axis is None:
            block_axes[g] = len(dims)
            dims.append(1)
    trailing = list(range(len(dims), len(dims) + array.ndim - len(shape)))
    return array.reshape(tuple(dims) + array.shape[len(shape):]).transpose(block_axes + part_axes + trailing)


def _block_index(dim_map: tuple, blocks: np.ndarray) -> tuple:
    """Index arrays selecting `blocks` (rows of x, y, z) in a `_grid_view` under `dim_map`. A tensor that
    every block reads whole is selected once: its tiles are the same in every block, so they (and what
    derives from them alone) are computed once and broadcast along the block axis."""
    if all(d is None for d in dim_map):
        return (np.zeros(1, dtype=np.intp),) * 3
    return tuple(blocks[:, g] if d is not None else np.zeros(len(blocks), dtype=np.intp)
                 for g, d in enumerate(dim_map))


def _iteration_slices(tile_shape: tuple, fmap: Optional[int], forloop: int) -> list:
    """For each loop iteration, the slices selecting its tile within the block's part."""
    out = []
    for i in range(forloop):
        slices = [slice(None)] * len(tile_shape)
        if fmap is not None:
            slices[fmap] = slice(i * tile_shape[fmap], (i + 1) * tile_shape[fmap])
        out.append(tuple(slices))
    return out


def _elements_per_block(bg: BlockGraph, folded: Sequence[bool] = ()) -> int:
    """What one block holds at once: its tiles of one iteration, and every iteration's inputs of each
    accumulator but those `folded` (in the order of the block graph's accumulators), which hold one."""
    tiles = sum(i.var.type.numel for i in bg.inputs) + sum(v.type.numel for n in bg.nodes for v in n.outputs)
    accumulators = [n for n in bg.nodes if n.opdef.is_accumulator]
    folded = list(folded) + [False] * (len(accumulators) - len(folded))
    kept = sum(v.type.numel * (1 if f else bg.forloop) for n, f in zip(accumulators, folded) for v in n.inputs)
    return tiles + kept


class BlockPlan:
    """What does not change from block to block, computed once from the shapes of the tensors read:
    the split of the nodes (as they run on values with a block axis) into those that run once before
    the loop (loop-invariant), in each iteration and after the loop, the slices of each loop
    iteration's tiles, and the blocks, run `chunk(folded)` at a time."""

    def __init__(self, bg: BlockGraph, input_shapes: Sequence[tuple]):
        if len(input_shapes) != len(bg.inputs):
            raise ShapeError(f"the block graph reads {len(bg.inputs)} input(s), got {len(input_shapes)}")
        self.iteration_slices = []
        for k, (inp, shape) in enumerate(zip(bg.inputs, input_shapes)):
            what = f"block input %{inp.var.name} (operand {k})"
            tile = input_tile_type(TensorType(shape, inp.var.dtype), bg.grid, bg.forloop, inp.imap, inp.fmap, what)
            if tile.shape != inp.var.shape:
                raise ShapeError(f"{what}: its tile is {tile} but it is declared {inp.var.type}")
            self.iteration_slices.append(_iteration_slices(tile.shape, inp.fmap, bg.forloop))
        self.out_types = [output_tensor_type(o.var.type, bg.grid, o.omap, f"block output %{o.var.name}")
                          for o in bg.outputs]

        post = bg.post_loop_vars()
        for o in bg.outputs:
            if o.var.name not in post:
                raise ValidationError(f"block output %{o.var.name} does not pass through an accumulator")
        self.accumulators = [_per_block(n) for n in bg.nodes if n.opdef.is_accumulator]
        body = [_per_block(n) for n in bg.nodes if not n.opdef.is_accumulator]
        loop_nodes = [n for n in body if not any(v.name in post for v in n.outputs)]
        self.post_nodes = [n for n in body if any(v.name in post for v in n.outputs)]
        # loop nodes that read only tiles which every iteration loads alike (no fmap), directly or
        # through other such nodes, give the same values in every iteration: they run once, before it
        invariant = {i.var.name for i in bg.inputs if i.fmap is None}
        self.invariant_nodes, self.iteration_nodes = [], []
        for n in loop_nodes:
            if all(v.name in invariant for v in n.inputs):
                invariant.update(v.name for v in n.outputs)
                self.invariant_nodes.append(n)
            else:
                self.iteration_nodes.append(n)

        # (x, y, z), x varying fastest; blocks write disjoint parts, so the order cannot change the result
        x, y, z = bg.grid
        self.blocks = [(bx, by, bz) for bz, by, bx in itertools.product(range(z), range(y), range(x))]
        self.bg = bg

    def chunk(self, folded: Sequence[bool] = ()) -> int:
        """The blocks run together: as many as hold about CHUNK_ELEMENTS (`_elements_per_block`)."""
        return max(1, CHUNK_ELEMENTS // max(1, _elements_per_block(self.bg, folded)))

    def check_writes(self, bg: BlockGraph) -> None:
        """Every output element is written exactly once. Valid omaps (`output_tensor_type`) give each
        block of the grid output tiles of its own, so it is so when the blocks cover the grid once each:
        a property of the plan, checked once rather than element by element."""
        counts = np.zeros(bg.grid, dtype=np.int64)
        np.add.at(counts, tuple(np.array(self.blocks, dtype=np.intp).reshape(-1, 3).T), 1)
        never, more = int(np.sum(counts == 0)), int(np.sum(counts > 1))
        if (never or more) and bg.outputs:
            o = bg.outputs[0]
            raise ValidationError(f"block output %{o.var.name}: {never * o.var.type.numel} element(s) never written "
                                  f"and {more * o.var.type.numel} written more than once under omap {list(o.omap)}")


def _run_blocks(sem: Semantics, bg: BlockGraph, plan: BlockPlan, reads: list, blocks: np.ndarray,
                folded: Sequence[bool]) -> list:
    """`blocks` (rows of x, y, z) side by side along the block axis: the for-loop over their input tiles,
    the accumulators (each `folded` one by its running form, iteration by iteration; the others given
    every iteration's inputs at the end), then the nodes after the loop. `reads` are the inputs' grid
    views."""
    lead = (len(blocks),)
    index = [_block_index(inp.imap, blocks) for inp in bg.inputs]
    collected: list = [sem.fold(node) if f else [] for node, f in zip(plan.accumulators, folded)]
    # indexing copies: each block's own tile, as in shared memory
    invariant: Env = {inp.var.name: sem.convert(view[where + slices[0]])
                      for inp, view, where, slices in zip(bg.inputs, reads, index, plan.iteration_slices)
                      if inp.fmap is None}
    _eval_nodes(sem, plan.invariant_nodes, invariant, lead)
    for i in range(bg.forloop):
        env: Env = dict(invariant)  # rules never write into their operands, so sharing these is safe
        for inp, view, where, slices in zip(bg.inputs, reads, index, plan.iteration_slices):
            if inp.fmap is not None:
                env[inp.var.name] = sem.convert(view[where + slices[i]])
        _eval_nodes(sem, plan.iteration_nodes, env, lead)
        for node, per_iteration in zip(plan.accumulators, collected):
            add = per_iteration.append if isinstance(per_iteration, list) else per_iteration.add
            add(_aligned(node, _args(env, node)))
    env = {}  # only accumulated values survive the loop
    for node, per_iteration in zip(plan.accumulators, collected):
        try:
            values = sem.accumulate(node, per_iteration) if isinstance(per_iteration, list) else per_iteration.result()
            _bind(sem, env, node.outputs, values, lead)
        except MdslError as e:
            raise e.with_loc(node.loc)
    _eval_nodes(sem, plan.post_nodes, env, lead)
    return [env[o.var.name] for o in bg.outputs]


def run_block_graph(bg: BlockGraph, inputs: Sequence, sem: Semantics) -> list:
    """Evaluate a custom kernel on the whole tensors it reads; returns the tensors it writes."""
    inputs = [np.asarray(a) for a in inputs]   # held as given: a block converts the tiles it reads
    plan = BlockPlan(bg, [sem.shape(a) for a in inputs])
    plan.check_writes(bg)
    outputs = [sem.empty(t) for t in plan.out_types]
    reads = [_grid_view(a, sem.shape(a), inp.imap, bg.grid) for a, inp in zip(inputs, bg.inputs)]
    # views of the fresh (contiguous) outputs: writing through them writes the outputs
    writes = [_grid_view(out, t.shape, o.omap, bg.grid) for out, t, o in zip(outputs, plan.out_types, bg.outputs)]
    blocks = np.array(plan.blocks, dtype=np.intp).reshape(-1, 3)
    folded = [sem.fold(node) is not None for node in plan.accumulators]
    step = plan.chunk(folded)
    for start in range(0, len(blocks), step):
        chunk = blocks[start:start + step]
        tiles = _run_blocks(sem, bg, plan, reads, chunk, folded)
        for view, o, tile in zip(writes, bg.outputs, tiles):
            view[_block_index(o.omap, chunk)] = tile
    return outputs


# ---------------------------------------------------------------------------------------------
# thread graphs

def run_thread_graph(tg: ThreadGraph, inputs: Sequence, sem: Semantics, lead: tuple = ()) -> list:
    """Evaluate an element-wise chain (numpy broadcasting applies between operands); `lead`: the shape
    of the axes its values carry before the tensor's (a block axis, inside a block graph)."""
    if len(inputs) != len(tg.inputs):
        raise ShapeError(f"the thread graph reads {len(tg.inputs)} input(s), got {len(inputs)}")
    env: Env = {}
    _bind(sem, env, tg.inputs, inputs, lead)
    _eval_nodes(sem, tg.nodes, env, lead)
    return [env[v.name] for v in tg.outputs]

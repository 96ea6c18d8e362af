"""Evaluation of mugraphs at every level, generic over a *semantics*.

The walk is the same whatever a value means: kernel graph nodes in order; a graph-defined operator runs
its body; a block graph runs block by block and loop iteration by loop iteration on copies of the tiles
each block would load (imap/fmap slicing), closes the loop with its accumulators, runs the nodes after
the loop and writes each block's output tiles where its omap says, each element exactly once. What an
operator or an accumulator computes, and how values are made and checked, is the `Semantics`' business:
floats in the reference interpreter, residues in the finite-field verifier.

Values are numpy arrays whose leading dims are the tensor's dims; a semantics may add trailing axes
(a finite-field value carries two residues per element), since the walk only ever slices leading dims.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from mdsl.errors import MdslError, ShapeError, ValidationError
from mdsl.ir.graph import BlockGraph, KernelGraph, Node, ThreadGraph
from mdsl.ir.ops import BLOCK, THREAD
from mdsl.ir.types import TensorType, Var
from mdsl.ir.validate import input_tile_type, output_tensor_type

Env = dict  # value name -> value


class Semantics(Protocol):
    """What values mean: how they are made, checked and computed."""

    def take_input(self, var: Var, array: Any) -> np.ndarray:
        """A kernel graph's input as a value (a copy: the caller's array is never aliased)."""

    def store(self, var: Var, value: np.ndarray) -> np.ndarray:
        """A kernel-level tensor as device memory holds it (e.g. rounded to its dtype)."""

    def convert(self, value: Any) -> np.ndarray:
        """An operator's result, or a tensor handed to a body, as a value of this semantics."""

    def shape(self, value: np.ndarray) -> tuple:
        """The tensor shape a value holds (its leading dims)."""

    def apply(self, node: Node, args: list) -> list:
        """An operator that is neither graph-defined nor an accumulator."""

    def accumulate(self, node: Node, iterations: list) -> list:
        """An accumulator, given for each loop iteration the list of its inputs."""

    def empty(self, type_: TensorType) -> np.ndarray:
        """A block graph's output tensor before the blocks write it (poisoned, where possible)."""


# ---------------------------------------------------------------------------------------------
# nodes

def _args(env: Env, node: Node) -> list:
    missing = [v.name for v in node.inputs if v.name not in env]
    if missing:
        raise ValidationError(f"{node.op} reads %{missing[0]}, which is not available there", loc=node.loc)
    return [env[v.name] for v in node.inputs]


def _bind(sem: Semantics, env: Env, variables: Sequence[Var], values: Sequence) -> None:
    """Store values under their names, checking that they have the declared shapes."""
    if len(values) != len(variables):
        raise ValidationError(f"{len(values)} value(s) computed for {len(variables)} name(s)")
    for var, value in zip(variables, values):
        value = sem.convert(value)
        if sem.shape(value) != var.shape:
            raise ShapeError(f"%{var.name} is declared {var.type} but evaluates to shape {list(sem.shape(value))}")
        env[var.name] = value


def _run_node(sem: Semantics, node: Node, args: list) -> list:
    opdef = node.opdef
    if opdef.is_graph_defined:
        return _BODY_RUNNERS[opdef.body_level](node.body, args, sem)
    if opdef.is_accumulator:
        raise ValidationError(f"{node.op} closes a block graph's for-loop and cannot run here")
    return sem.apply(node, args)


def _eval_nodes(sem: Semantics, nodes: Sequence[Node], env: Env) -> None:
    for node in nodes:
        try:
            _bind(sem, env, node.outputs, _run_node(sem, node, _args(env, node)))
        except MdslError as e:
            raise e.with_loc(node.loc)


# ---------------------------------------------------------------------------------------------
# kernel graphs

def run_kernel_graph(graph: KernelGraph, inputs: Sequence, sem: Semantics) -> list:
    """Evaluate a kernel graph; returns the values of its outputs."""
    if len(inputs) != len(graph.inputs):
        raise ShapeError(f"kernel graph {graph.name} takes {len(graph.inputs)} input(s), got {len(inputs)}")
    env: Env = {var.name: sem.store(var, sem.take_input(var, array)) for var, array in zip(graph.inputs, inputs)}
    for node in graph.nodes:
        _eval_nodes(sem, (node,), env)
        for var in node.outputs:
            env[var.name] = sem.store(var, env[var.name])
    return [env[v.name] for v in graph.outputs]


# ---------------------------------------------------------------------------------------------
# block graphs

def _block_slices(part_shape: tuple, dim_map: tuple, block: tuple) -> tuple:
    """The slices selecting `block`'s part of a tensor split along `dim_map` (an imap or an omap)
    into parts of `part_shape`."""
    out = [slice(None)] * len(part_shape)
    for d, b in zip(dim_map, block):
        if d is not None:
            out[d] = slice(b * part_shape[d], (b + 1) * part_shape[d])
    return tuple(out)


def _iteration_slices(tile_shape: tuple, fmap: Optional[int], forloop: int) -> list:
    """For each loop iteration, the slices selecting its tile within the block's part."""
    out = []
    for i in range(forloop):
        slices = [slice(None)] * len(tile_shape)
        if fmap is not None:
            slices[fmap] = slice(i * tile_shape[fmap], (i + 1) * tile_shape[fmap])
        out.append(tuple(slices))
    return out


class BlockPlan:
    """What does not change from block to block, computed once from the shapes of the tensors read:
    the loop/post-loop split of the nodes and, per block, the slices it reads and writes."""

    def __init__(self, bg: BlockGraph, input_shapes: Sequence[tuple]):
        if len(input_shapes) != len(bg.inputs):
            raise ShapeError(f"the block graph reads {len(bg.inputs)} input(s), got {len(input_shapes)}")
        part_shapes, self.iteration_slices = [], []
        for k, (inp, shape) in enumerate(zip(bg.inputs, input_shapes)):
            what = f"block input %{inp.var.name} (operand {k})"
            tensor = TensorType(shape, inp.var.dtype)
            tile = input_tile_type(tensor, bg.grid, bg.forloop, inp.imap, inp.fmap, what)
            if tile.shape != inp.var.shape:
                raise ShapeError(f"{what}: its tile is {tile} but it is declared {inp.var.type}")
            part_shapes.append(input_tile_type(tensor, bg.grid, 1, inp.imap, None, what).shape)
            self.iteration_slices.append(_iteration_slices(tile.shape, inp.fmap, bg.forloop))
        self.out_types = [output_tensor_type(o.var.type, bg.grid, o.omap, f"block output %{o.var.name}")
                          for o in bg.outputs]

        post = bg.post_loop_vars()
        for o in bg.outputs:
            if o.var.name not in post:
                raise ValidationError(f"block output %{o.var.name} does not pass through an accumulator")
        self.accumulators = [n for n in bg.nodes if n.opdef.is_accumulator]
        body = [n for n in bg.nodes if not n.opdef.is_accumulator]
        self.loop_nodes = [n for n in body if not any(v.name in post for v in n.outputs)]
        self.post_nodes = [n for n in body if any(v.name in post for v in n.outputs)]

        # x varies fastest; blocks write disjoint parts, so the order cannot change the result
        x, y, z = bg.grid
        self.blocks = []
        for bz, by, bx in itertools.product(range(z), range(y), range(x)):
            block = (bx, by, bz)
            reads = [_block_slices(s, inp.imap, block) for s, inp in zip(part_shapes, bg.inputs)]
            writes = [_block_slices(o.var.shape, o.omap, block) for o in bg.outputs]
            self.blocks.append((reads, writes))


def _run_block(sem: Semantics, bg: BlockGraph, plan: BlockPlan, parts: list) -> list:
    """One block: the for-loop over its input parts, the accumulators, then the nodes after the loop."""
    collected: list = [[] for _ in plan.accumulators]
    for i in range(bg.forloop):
        env: Env = {}
        for inp, part, slices in zip(bg.inputs, parts, plan.iteration_slices):
            env[inp.var.name] = part[slices[i]].copy()  # the block's own copy, as in shared memory
        _eval_nodes(sem, plan.loop_nodes, env)
        for node, per_iteration in zip(plan.accumulators, collected):
            per_iteration.append(_args(env, node))
    env = {}  # only accumulated values survive the loop
    for node, per_iteration in zip(plan.accumulators, collected):
        try:
            _bind(sem, env, node.outputs, sem.accumulate(node, per_iteration))
        except MdslError as e:
            raise e.with_loc(node.loc)
    _eval_nodes(sem, plan.post_nodes, env)
    return [env[o.var.name] for o in bg.outputs]


def run_block_graph(bg: BlockGraph, inputs: Sequence, sem: Semantics) -> list:
    """Evaluate a custom kernel on the whole tensors it reads; returns the tensors it writes."""
    inputs = [sem.convert(a) for a in inputs]
    plan = BlockPlan(bg, [sem.shape(a) for a in inputs])
    outputs = [sem.empty(t) for t in plan.out_types]
    # counts catch elements that no block writes and elements written twice
    counts = [np.zeros(t.shape, dtype=np.int32) for t in plan.out_types]
    for reads, writes in plan.blocks:
        tiles = _run_block(sem, bg, plan, [a[r] for a, r in zip(inputs, reads)])
        for out, count, where, tile in zip(outputs, counts, writes, tiles):
            out[where] = tile
            count[where] += 1
    for o, count in zip(bg.outputs, counts):
        if not np.all(count == 1):
            raise ValidationError(f"block output %{o.var.name}: {int(np.sum(count == 0))} element(s) never written "
                                  f"and {int(np.sum(count > 1))} written more than once under omap {list(o.omap)}")
    return outputs


# ---------------------------------------------------------------------------------------------
# thread graphs

def run_thread_graph(tg: ThreadGraph, inputs: Sequence, sem: Semantics) -> list:
    """Evaluate an element-wise chain (numpy broadcasting applies between operands)."""
    if len(inputs) != len(tg.inputs):
        raise ShapeError(f"the thread graph reads {len(tg.inputs)} input(s), got {len(inputs)}")
    env: Env = {}
    _bind(sem, env, tg.inputs, inputs)
    _eval_nodes(sem, tg.nodes, env)
    return [env[v.name] for v in tg.outputs]


#: How a graph-defined operator runs its body, by the body's level.
_BODY_RUNNERS: dict[str, Callable] = {BLOCK: run_block_graph, THREAD: run_thread_graph}

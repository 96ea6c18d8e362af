"""Structural validation of mugraphs. Each check raises `ValidationError` (or the shape/dtype error of
the failing rule) pointing at the node's source line and saying how to fix the graph."""
from __future__ import annotations

import re
from typing import Optional

from mdsl.errors import MdslError, ShapeError, ValidationError, short_repr
from mdsl.ir.graph import BlockGraph, KernelGraph, Node, ThreadGraph
from mdsl.ir.ops import BLOCK, KERNEL, THREAD, get_op
from mdsl.ir.types import MAX_ELEMENTS, TensorType, check_tensor_type

#: Shared memory a Hopper thread block may use (227 KB on sm_90).
SMEM_LIMIT_BYTES = 227 * 1024
MAX_THREADS = 1024
#: CUDA's largest grid: 2^31 - 1 blocks along x, 65535 along y and z.
MAX_GRID = (2**31 - 1, 65535, 65535)
_AXES = "xyz"


def _within(error: MdslError, step: str) -> MdslError:
    """Record that `error` arose in part `step` of a graph (a node's body error keeps its inner path)."""
    error.ir_path = step if error.ir_path is None else f"{step}.body.{error.ir_path}"
    return error


def _at(error: MdslError, path: str) -> MdslError:
    if error.ir_path is None:
        error.ir_path = path
    return error


def _describe(node: Node) -> str:
    outs = ", ".join(str(v) for v in node.outputs)
    return f"{outs} = {node.op}(...)" if outs else node.op


def check_node(node: Node, level: str, input_types: tuple, *, smem_limit: int = SMEM_LIMIT_BYTES) -> tuple:
    """Check one node's operator, level, attributes and types; return its output types."""
    try:
        op = get_op(node.op)
        if level not in op.levels:
            where = " and ".join(sorted(op.levels))
            raise ValidationError(f"{node.op} cannot appear in a {level} graph (allowed at the {where} level)",
                                  hint=f"move it to a {where} graph")
        if op.normalize_attrs(node.attr_dict) != tuple(node.attrs):
            raise ValidationError(f"{node.op}: attributes {dict(node.attrs)} are not in normal form "
                                  f"(expected {dict(op.normalize_attrs(node.attr_dict))})",
                                  hint="build nodes with OpDef.normalize_attrs: every attribute, in declared order")
        if op.is_graph_defined:
            if op.body_level == BLOCK and isinstance(node.body, BlockGraph):
                return validate_block_graph(node.body, input_types, smem_limit=smem_limit)
            if op.body_level == THREAD and isinstance(node.body, ThreadGraph):
                return validate_thread_graph(node.body, input_types)
            raise ValidationError(f"{node.op} needs a {op.body_level} graph as its body",
                                  hint="custom takes a block graph, fused a thread graph")
        if node.body is not None:
            raise ValidationError(f"{node.op} is not graph-defined and cannot have a body",
                                  hint="only custom (a block graph) and fused (a thread graph) have bodies")
        return op.infer_types(input_types, node.attrs)
    except MdslError as e:
        raise e.with_loc(node.loc)


def _check_outputs(node: Node, types: tuple) -> None:
    if len(types) != len(node.outputs):
        raise ValidationError(f"{node.op} produces {len(types)} value(s) but the node names {len(node.outputs)}",
                              loc=node.loc, hint=f"name {len(types)} output value(s)")
    for v, t in zip(node.outputs, types):
        if v.type != t:
            raise ShapeError(f"{node.op}: %{v.name} is declared {v.type} but the operator gives {t}", loc=node.loc,
                             hint=f"declare %{v.name}: {t}, or change the operands")


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")


class _Scope:
    """Values defined so far in one graph, with the error for a use before definition."""

    def __init__(self, what: str):
        self.what = what
        self.types: dict = {}

    def define(self, var, loc=None) -> None:
        if not _IDENTIFIER.match(var.name):
            raise ValidationError(f"{var.name!r} is not a valid value name in the {self.what}", loc=loc,
                                  hint="names are identifiers: letters, digits, '_' and '.', not starting with a digit")
        if var.name in self.types:
            raise ValidationError(f"%{var.name} is defined twice in the {self.what}", loc=loc,
                                  hint="every value is defined once: rename one of them")
        try:
            check_tensor_type(var.type, f"%{var.name}")
        except MdslError as e:
            raise e.with_loc(loc)
        self.types[var.name] = var.type

    def use(self, var, loc=None) -> TensorType:
        if var.name not in self.types:
            raise ValidationError(f"%{var.name} is used before it is defined in the {self.what}", loc=loc,
                                  hint="a graph defines its values (inputs, node outputs) before using them")
        if self.types[var.name] != var.type:
            raise ShapeError(f"%{var.name} is used as {var.type} but defined as {self.types[var.name]}", loc=loc,
                             hint="a value has one type: the one it is defined with")
        return var.type


def validate_kernel_graph(graph: KernelGraph, *, smem_limit: int = SMEM_LIMIT_BYTES) -> None:
    """Check a kernel graph; an error's `ir_path` names the failing part (e.g. `nodes[2].body.grid`)."""
    if not isinstance(graph.name, str) or not _IDENTIFIER.match(graph.name):
        raise _at(ValidationError(f"{graph.name!r} is not a valid kernel name",
                                  hint="names are identifiers: letters, digits, '_' and '.', not starting with a digit"),
                  "name")
    scope = _Scope(f"kernel graph {graph.name}")
    for k, v in enumerate(graph.inputs):
        try:
            scope.define(v)
        except MdslError as e:
            raise _at(e, f"inputs[{k}]")
    for i, node in enumerate(graph.nodes):
        try:
            types = tuple(scope.use(v, node.loc) for v in node.inputs)
            _check_outputs(node, check_node(node, KERNEL, types, smem_limit=smem_limit))
            for v in node.outputs:
                scope.define(v, node.loc)
        except MdslError as e:
            raise _within(e, f"nodes[{i}]")
    if not graph.outputs:
        raise _at(ValidationError(f"kernel graph {graph.name} has no outputs", hint="return at least one tensor"),
                  "outputs")
    for k, v in enumerate(graph.outputs):
        try:
            scope.use(v)
        except MdslError as e:
            raise _at(e, f"outputs[{k}]")


def validate_thread_graph(graph: ThreadGraph, input_types: tuple) -> tuple:
    if len(graph.inputs) != len(input_types):
        raise _at(ValidationError(f"thread graph takes {len(graph.inputs)} inputs but is given {len(input_types)}",
                                  hint="a fused node passes its operands to its thread graph's inputs, one each"),
                  "inputs")
    scope = _Scope("thread graph")
    for k, (v, t) in enumerate(zip(graph.inputs, input_types)):
        try:
            if v.type != t:
                raise ShapeError(f"thread graph input %{v.name} is {v.type} but is given {t}",
                                 hint="declare the thread graph's inputs with its fused node's operand types")
            scope.define(v)
        except MdslError as e:
            raise _at(e, f"inputs[{k}]")
    for i, node in enumerate(graph.nodes):
        try:
            if not get_op(node.op).is_elementwise:
                raise ValidationError(f"{node.op} is not element-wise and cannot run in a thread graph", loc=node.loc,
                                      hint="a thread graph holds element-wise operators only")
            types = tuple(scope.use(v, node.loc) for v in node.inputs)
            _check_outputs(node, check_node(node, THREAD, types))
            for v in node.outputs:
                scope.define(v, node.loc)
        except MdslError as e:
            raise _within(e, f"nodes[{i}]")
    if not graph.outputs:
        raise _at(ValidationError("a thread graph needs at least one output", hint="add an `out %value` line"),
                  "outputs")
    out = []
    for k, v in enumerate(graph.outputs):
        try:
            out.append(scope.use(v))
        except MdslError as e:
            raise _at(e, f"outputs[{k}]")
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# block graphs

def input_tile_type(tensor: TensorType, grid: tuple, forloop: int, imap: tuple, fmap: Optional[int],
                    what: str = "input") -> TensorType:
    """The tile of `tensor` one block sees in one loop iteration, or a ValidationError."""
    shape = list(tensor.shape)
    seen: dict = {}
    for g, (size, d) in enumerate(zip(grid, imap)):
        if d is None:
            continue
        axis = _AXES[g]
        if size == 1:
            raise ValidationError(f"{what}: imap maps grid dim {axis} (size 1) to tensor dim {d}",
                                  hint="a grid dim of size 1 splits nothing; map it to None")
        if not 0 <= d < tensor.rank:
            raise ValidationError(f"{what}: imap maps grid dim {axis} to dim {d}, but {tensor} has rank {tensor.rank}",
                                  hint=f"map it to a dim from 0 to {tensor.rank - 1}, or to None")
        if d in seen:
            raise ValidationError(f"{what}: grid dims {seen[d]} and {axis} both split tensor dim {d}",
                                  hint="map each tensor dim from at most one grid dim")
        seen[d] = axis
        if shape[d] % size:
            raise ValidationError(f"{what}: grid dim {axis}={size} does not divide dim {d} of {tensor} ({tensor.shape[d]})",
                                  hint=f"choose a grid size that divides {tensor.shape[d]}")
        shape[d] //= size
    if fmap is not None:
        if not 0 <= fmap < tensor.rank:
            raise ValidationError(f"{what}: fmap {fmap} is out of range for {tensor}",
                                  hint=f"fmap is a dim from 0 to {tensor.rank - 1}, or None")
        if shape[fmap] % forloop:
            raise ValidationError(f"{what}: the for-loop range {forloop} does not divide dim {fmap} of the block's tile "
                                  f"({shape[fmap]})", hint=f"choose a for-loop range that divides {shape[fmap]}")
        shape[fmap] //= forloop
    return tensor.with_shape(shape)


def output_tensor_type(tile: TensorType, grid: tuple, omap: tuple, what: str = "output") -> TensorType:
    """The device tensor the blocks' output tiles are concatenated into, or a ValidationError."""
    shape = list(tile.shape)
    seen: dict = {}
    for g, (size, d) in enumerate(zip(grid, omap)):
        axis = _AXES[g]
        if d is None:
            if size > 1:
                raise ValidationError(f"{what}: omap maps grid dim {axis} (size {size}) to nothing, "
                                      f"so the {size} blocks along {axis} would overwrite each other's output",
                                      hint=f"map grid dim {axis} to the tensor dim that its blocks concatenate into")
            continue
        if size == 1:
            raise ValidationError(f"{what}: omap maps grid dim {axis} (size 1) to tensor dim {d}",
                                  hint="a grid dim of size 1 concatenates nothing; map it to None")
        if not 0 <= d < tile.rank:
            raise ValidationError(f"{what}: omap maps grid dim {axis} to dim {d}, but the tile {tile} has rank {tile.rank}",
                                  hint=f"map it to a dim from 0 to {tile.rank - 1}")
        if d in seen:
            raise ValidationError(f"{what}: grid dims {seen[d]} and {axis} both concatenate into tensor dim {d}",
                                  hint="map each tensor dim from at most one grid dim")
        seen[d] = axis
        shape[d] *= size
    return tile.with_shape(shape)


def _storage_bytes(t: TensorType, accumulator: bool) -> int:
    # accumulators are kept in f32 whatever their nominal dtype
    return t.numel * (max(4, t.dtype.itemsize) if accumulator else t.dtype.itemsize)


def shared_memory_peak(graph: BlockGraph) -> int:
    """Peak bytes of live tiles, walking the nodes in order (loop body, then after the loop).

    Accumulators are live for the whole loop; other tiles from definition to last use. Memory
    planning (a later pass) may do better by reordering; this is the bound validation enforces.
    """
    post = graph.post_loop_vars()
    acc_outputs = {v.name for n in graph.nodes if n.opdef.is_accumulator for v in n.outputs}
    last_use: dict = {}
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            last_use[v.name] = i
    for o in graph.outputs:
        last_use[o.var.name] = len(graph.nodes)
    sizes = {i.var.name: _storage_bytes(i.var.type, False) for i in graph.inputs}
    for n in graph.nodes:
        for v in n.outputs:
            sizes[v.name] = _storage_bytes(v.type, v.name in acc_outputs)

    def walk(order, live: set, pinned: int) -> int:
        peak = sum(sizes[v] for v in live) + pinned
        for i, n in order:
            live = live | {v.name for v in n.outputs}
            peak = max(peak, sum(sizes[v] for v in live) + pinned)
            live = {v for v in live if last_use.get(v, -1) > i}
        return peak

    body = [(i, n) for i, n in enumerate(graph.nodes) if not n.opdef.is_accumulator]
    loop = [(i, n) for i, n in body if not any(v.name in post for v in n.outputs)]
    after = [(i, n) for i, n in body if any(v.name in post for v in n.outputs)]
    acc_bytes = sum(sizes[a] for a in acc_outputs)
    return max(walk(loop, {i.var.name for i in graph.inputs}, acc_bytes), walk(after, set(acc_outputs), 0))


def check_launch(grid: tuple, threads, forloop) -> None:
    """Raise ValidationError unless grid (x, y, z), threads and the for-loop range are a launch mdsl can
    run; its `ir_path` names the field. Hand-written block graphs and the validator both call this."""
    for g, size in enumerate(grid):
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_GRID[g]:
            raise _at(ValidationError(f"grid {_ints(grid)}: dim {_AXES[g]} must be an integer from 1 to {MAX_GRID[g]}",
                                      hint="a grid dim counts the thread blocks along it: at least 1 "
                                           "(a dim of 1 splits nothing)"), "grid")
    if isinstance(threads, bool) or not isinstance(threads, int) or not (
            32 <= threads <= MAX_THREADS and threads % 32 == 0):
        raise _at(ValidationError(f"a block of {short_repr(threads)} threads: use a multiple of 32 between 32 and "
                                  f"{MAX_THREADS}", hint="e.g. threads=128"), "threads")
    if isinstance(forloop, bool) or not isinstance(forloop, int) or not 1 <= forloop <= MAX_ELEMENTS:
        raise _at(ValidationError(f"the for-loop range must be an integer from 1 to {MAX_ELEMENTS}, got {short_repr(forloop)}",
                                  hint="forloop counts the iterations each block runs: 1 for no loop"), "forloop")


def _ints(values) -> str:
    return "[" + ", ".join(map(short_repr, values)) + "]"


def validate_block_graph(graph: BlockGraph, input_types: tuple, *, smem_limit: int = SMEM_LIMIT_BYTES) -> tuple:
    """Check a block graph against the device tensors it reads; return the tensors it writes."""
    check_launch(graph.grid, graph.threads, graph.forloop)
    if len(graph.inputs) != len(input_types):
        raise _at(ValidationError(f"the block graph reads {len(graph.inputs)} inputs but the custom op passes "
                                  f"{len(input_types)}", hint="a custom node's operands are its block graph's inputs, "
                                                               "one each"), "inputs")

    scope = _Scope("block graph")
    for k, (inp, tensor) in enumerate(zip(graph.inputs, input_types)):
        what = f"block input %{inp.var.name} (operand {k}, {tensor})"
        try:
            tile = input_tile_type(tensor, graph.grid, graph.forloop, inp.imap, inp.fmap, what)
            if inp.var.type != tile:
                raise ShapeError(f"{what}: its tile is {tile} under imap {list(inp.imap)} and fmap {inp.fmap}, "
                                 f"but it is declared {inp.var.type}", hint=f"declare it {tile}")
            scope.define(inp.var)
        except MdslError as e:
            raise _at(e, f"inputs[{k}]")

    post: set = set()
    for i, node in enumerate(graph.nodes):
        try:
            _check_block_node(node, scope, post, smem_limit)
        except MdslError as e:
            raise _within(e, f"nodes[{i}]")

    if not graph.outputs:
        raise _at(ValidationError("a block graph needs at least one output", hint="add an `out %value omap=[...]` line"),
                  "outputs")
    out_types = []
    for k, out in enumerate(graph.outputs):
        try:
            scope.use(out.var)
            if out.var.name not in post:
                raise ValidationError(f"block output %{out.var.name} does not pass through an accumulator",
                                      hint="every input-to-output path needs exactly one accumulator; "
                                           "close the for-loop with accum (or accum_sum, accum_max, ...) first")
            out_types.append(output_tensor_type(out.var.type, graph.grid, out.omap, f"block output %{out.var.name}"))
        except MdslError as e:
            raise _at(e, f"outputs[{k}]")

    peak = shared_memory_peak(graph)
    if peak > smem_limit:
        largest = sorted(((v.type.nbytes, v) for n in graph.nodes for v in n.outputs), key=lambda p: -p[0])[:3]
        shown = ", ".join(f"%{v.name} {v.type} ({b // 1024} KB)" for b, v in largest)
        raise ValidationError(f"the block's tiles need {peak / 1024:.1f} KB of shared memory, over the "
                              f"{smem_limit // 1024} KB limit (largest: {shown})",
                              hint="split the work across more blocks (a larger grid) or more for-loop iterations")
    return tuple(out_types)


def _check_block_node(node: Node, scope: _Scope, post: set, smem_limit: int) -> None:
    """One node of a block graph: its types, and which side of the for-loop it is on (`post` grows)."""
    types = tuple(scope.use(v, node.loc) for v in node.inputs)
    _check_outputs(node, check_node(node, BLOCK, types, smem_limit=smem_limit))
    after = [v for v in node.inputs if v.name in post]
    inside = [v for v in node.inputs if v.name not in post]
    if node.opdef.is_accumulator:
        if after:
            raise ValidationError(f"{node.op} accumulates %{after[0].name}, which is already accumulated",
                                  loc=node.loc, hint="every input-to-output path passes exactly one accumulator")
        post.update(v.name for v in node.outputs)
    elif after and inside:
        raise ValidationError(f"{_describe(node)} mixes %{inside[0].name} from inside the for-loop with "
                              f"%{after[0].name} from after it", loc=node.loc,
                              hint=f"accumulate %{inside[0].name} (e.g. accum) before using it after the loop")
    elif after:
        post.update(v.name for v in node.outputs)
    for v in node.outputs:
        scope.define(v, node.loc)

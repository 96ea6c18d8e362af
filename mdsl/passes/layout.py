"""Layout selection for a block graph: how each shared-memory tile is laid out, and how wide the
accesses to device memory are.

Device tensors are contiguous and row-major. A shared-memory tile is row-major too, its rows (the
innermost dim) padded where that avoids bank conflicts: shared memory has 32 banks of 4 bytes, so
when a row is a multiple of 128 bytes every row starts in bank 0, and threads walking down a column
(a matmul's left operand, a reduction over a leading dim) all hit one bank. One 16-byte pad (8 halves,
4 floats) shifts each row by 4 banks and keeps rows 16-byte aligned for vector copies.

Tiles computed in the block are stored in f32 (`wide`), as the reference semantics computes them:
a 16-bit tile would round what the reference does not (in attention, the scores rounded to bf16
before exp(s - max) are off by percents). Where that does not fit in shared memory, the caller asks
again with `wide=False`, and they keep their own dtypes. Input tiles keep the dtype of the tensor they
come from. Accumulators are f32 either way; a rescaling accumulator also keeps its running maximum,
double-buffered, in a scratch tile (see `scratch_tiles`).

A block input or output is copied between device and shared memory a row at a time in vectors of up
to 16 bytes: as wide as the tile's rows and the tensor's rows allow (and the padded rows, where the
tile is copied without conversion).
"""
from __future__ import annotations

import math
from typing import Callable

import attrs

from mdsl.ir.dtypes import DType, f32
from mdsl.ir.dump import dump_ir
from mdsl.ir.graph import BlockGraph, Node
from mdsl.ir.rules import RuleTable
from mdsl.ir.types import TensorType
from mdsl.ir.validate import output_tensor_type
from mdsl.passes.plan_dump import dump_plan

BANK_ROW_BYTES = 32 * 4   # one pass over the 32 banks
ROW_PAD_BYTES = 16
VECTOR_BYTES = 16


@attrs.frozen
class TileLayout:
    shape: tuple
    dtype: DType          # how the tile is stored
    row_stride: int       # elements from one row (innermost dim) to the next: its length plus padding

    @property
    def row_length(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_stride * self.dtype.itemsize

    @property
    def strides(self) -> tuple:
        """Elements between neighbours along each dim."""
        out, step = [], 1
        for k, d in enumerate(reversed(self.shape)):
            out.append(step)
            step = self.row_stride if k == 0 else step * d
        return tuple(reversed(out))

    def __str__(self) -> str:
        pad = f", rows padded to {self.row_stride}" if self.row_stride != self.row_length else ""
        return f"{self.dtype.name}[{', '.join(map(str, self.shape))}]{pad}"


@attrs.frozen
class LayoutPlan:
    tiles: dict      # value name (or scratch name) -> TileLayout, for every tile the block keeps
    vectors: dict    # block input or output name -> elements per device-memory access

    def __str__(self) -> str:
        lines = [f"  %{name}: {tile}" + (f", {self.vectors[name]}-element vectors" if name in self.vectors else "")
                 for name, tile in self.tiles.items()]
        return "layout:\n" + "\n".join(lines)


def scratch_name(node: Node) -> str:
    """The scratch tile of an accumulator ('#' cannot appear in a value name, so it never clashes)."""
    return f"{node.outputs[0].name}#scratch"


@attrs.frozen
class ScratchRule:
    """An accumulator's scratch tile in shared memory: `tile(node)` is its type."""

    tile: Callable[[Node], TensorType]


def _running_maximum(node: Node) -> TensorType:
    # two buffers of the scale's shape: iteration i reads one and writes the other, so no barrier
    # separates the rescale of the sum from the update of the maximum
    scale = node.inputs[1].type
    return TensorType((2,) + scale.shape, f32)


#: the operators whose nodes need a scratch tile (the rescaling accumulators' running maximum)
SCRATCH_RULES: RuleTable[ScratchRule] = RuleTable("shared-memory layout's scratch tiles", ScratchRule,
                                                  "mdsl.passes.layout (SCRATCH_RULES)")
SCRATCH_RULES.register("accum_rescale", ScratchRule(_running_maximum))
SCRATCH_RULES.register("accum_sum_rescale", ScratchRule(_running_maximum))


def scratch_tiles(bg: BlockGraph) -> dict:
    """Scratch name -> the node that needs it and its type."""
    out = {}
    for node in bg.nodes:
        rule = SCRATCH_RULES.get(node.op)
        if rule is not None:
            out[scratch_name(node)] = (node, rule.tile(node))
    return out


def padded_row_stride(shape: tuple, dtype: DType) -> int:
    length = shape[-1] if shape else 1
    rows = len(shape) >= 2 and any(d > 1 for d in shape[:-1])
    if rows and (length * dtype.itemsize) % BANK_ROW_BYTES == 0:
        return length + ROW_PAD_BYTES // dtype.itemsize
    return length


def vector_width(tile: TileLayout, tensor: TensorType) -> int:
    """The widest power-of-two vector (at most 16 bytes of the tensor) that divides the tile's rows
    and the tensor's rows, and the padded rows when the tile is copied as is (a tile stored in another
    dtype is converted element by element on the shared-memory side), so that every vector access
    is aligned."""
    size = tensor.dtype.itemsize
    tensor_row = tensor.shape[-1] if tensor.shape else 1
    same = tile.dtype == tensor.dtype
    width = VECTOR_BYTES // size
    while width > 1 and (tile.row_length % width or tensor_row % width or (same and tile.row_stride % width)):
        width //= 2
    return width


def storage_dtype(var, node: Node, wide: bool, operands: tuple = ()) -> DType:
    """How a tile computed by `node` is stored; `operands`: how its operands' tiles are. A transpose moves
    elements and rounds none: its tile is stored as its operand's (a weight's tile stays 16-bit, as the
    tensor-core fragments take it)."""
    if node.op == "transpose" and operands:
        return operands[0]
    if node.opdef.is_accumulator or (wide and var.dtype.is_float):
        return f32
    return var.dtype


def select_layout(bg: BlockGraph, tensor_types: tuple, *, wide: bool = True) -> LayoutPlan:
    """Layouts for the tiles of `bg`, whose inputs are tiles of device tensors of `tensor_types`."""
    tiles: dict = {}
    for i in bg.inputs:
        tiles[i.var.name] = TileLayout(i.var.shape, i.var.dtype, padded_row_stride(i.var.shape, i.var.dtype))
    for n in bg.nodes:
        operands = tuple(tiles[v.name].dtype for v in n.inputs if v.name in tiles)
        for var in n.outputs:
            dtype = storage_dtype(var, n, wide, operands)
            tiles[var.name] = TileLayout(var.shape, dtype, padded_row_stride(var.shape, dtype))
    for name, (_, ttype) in scratch_tiles(bg).items():
        tiles[name] = TileLayout(ttype.shape, ttype.dtype, ttype.shape[-1])  # read by flat index: no padding
    vectors = {i.var.name: vector_width(tiles[i.var.name], t) for i, t in zip(bg.inputs, tensor_types)}
    for o in bg.outputs:
        tensor = output_tensor_type(o.var.type, bg.grid, o.omap)
        vectors[o.var.name] = vector_width(tiles[o.var.name], tensor)
    plan = LayoutPlan(tiles, vectors)
    dump_ir("layout", bg)
    dump_plan("layout", plan)
    return plan

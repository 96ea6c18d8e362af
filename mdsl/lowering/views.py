"""Kernel-level nodes that launch nothing because their values are read where they already lie.

Aliases: a reshape, and a transpose that moves only dims of size 1 relative to the others (its elements keep
their row-major order: [1, 1, 8, 128] -> [1, 8, 1, 128], a traced attention's head transpose at one token),
name their operand's buffer under another shape; both backends alias them (`is_view`).

Strided views: a split's part is its operand's elements from an offset on, with the operand's strides; a
concat's piece is its output's elements from an offset on. Where a split's part is not a result of the program
and every reader of it reads its operands through their strides (`reads_in_place`: every kernel but a
kernel-level matmul's), the part is a `StridedView` of the operand: its readers' kernels take the operand's
pointer and add the offset, and the split writes only its other parts. An alias between the part and its readers
(a reshape into heads, a transpose of size-1 dims) is a strided view too where its dims keep to the part's rows
(`_aliased_strides`). Where a concat's piece is computed by a kernel that writes through the strides
(`writes_in_place`), is not a result, and every other reader reads in place, the piece is a view of the concat's
output: its producer writes it where the concat would have copied it, and the concat copies only its other
pieces. A split or concat left with nothing to copy launches nothing (`launches_nothing`). A view that is read
or written keeps 16-byte alignment: its offset and its strides across rows are whole 16-byte units (the kernels
move up to 16 bytes at a time); a split's part nothing reads is never written. What is left is copied as
`layout_copies` says, which the backends print and the cost model counts."""
from __future__ import annotations

import itertools
import math
from typing import Optional

import attrs

from mdsl.ir.graph import BlockGraph, KernelGraph, Node, ThreadGraph
from mdsl.lowering.index import contiguous_strides

ALIGNMENT = 16   # bytes: the widest load or store the kernels make


def is_view(node: Node) -> bool:
    """Whether kernel-level `node` is a view: a reshape, or a transpose that `keeps_order`."""
    if node.op == "reshape":
        return True
    if node.op != "transpose" or node.body is not None:
        return False
    return keeps_order(node.inputs[0].shape, node.attr("perm"))


def keeps_order(shape: tuple, perm) -> bool:
    """Whether permuting `shape`'s dims by `perm` keeps the dims of more than one element in their order (by
    their place, not their sizes: a square matrix's transpose moves its elements)."""
    moved = [p for p in perm if shape[p] > 1]
    return moved == sorted(moved)


@attrs.frozen
class StridedView:
    """A value that lies in another's buffer: the elements of value `of` (a contiguous row-major buffer) from
    `offset` on, `strides` apart (in elements, one per dim of the view)."""

    of: str
    offset: int
    strides: tuple


def reads_in_place(node: Node) -> bool:
    """Whether `node`'s kernel reads a strided view of an input as it reads a contiguous one, every address
    following the operand's strides: every kernel (a custom kernel's block graph: a block's part of a device
    tensor and its tile copies; a chain of element-wise operators; a kernel-level reduction or norm, its rows
    found by the strides; a split's or concat's copies; a transpose that moves elements) but a kernel-level
    matmul's (a library GEMM, and the GEMM tile's copies, take contiguous operands). An alias reads nothing."""
    return node.opdef.category != "matmul" and not is_view(node)


def writes_in_place(node: Node) -> bool:
    """Whether `node`'s kernel writes its outputs through their strides, so that an output may be a strided view
    of another value's buffer: a custom kernel's block graph (a block's part of the device tensor and its tile
    copies), a chain of element-wise operators, a kernel-level reduction or norm."""
    if isinstance(node.body, (BlockGraph, ThreadGraph)):
        return True
    return node.body is None and node.opdef.category in ("elementwise", "reduction", "norm")


def _aligned(offset: int, strides: tuple, shape: tuple, itemsize: int) -> bool:
    across = [s for d, s in enumerate(strides[:-1]) if shape[d] > 1]
    return (offset * itemsize) % ALIGNMENT == 0 and all((s * itemsize) % ALIGNMENT == 0 for s in across)


def _starts(sizes) -> list:
    return [0, *itertools.accumulate(sizes)][:-1]


def split_starts(node: Node) -> dict:
    """Part name -> where a split's part starts along its dim."""
    dim = node.attr("dim") % node.inputs[0].type.rank
    return dict(zip((v.name for v in node.outputs), _starts(v.shape[dim] for v in node.outputs)))


def concat_starts(node: Node) -> list:
    """Where each of a concat's pieces starts along its dim."""
    dim = node.attr("dim") % node.output.type.rank
    return _starts(v.shape[dim] for v in node.inputs)


def _placed(node: Node, k: int) -> StridedView:
    """Where a concat's k-th piece lies in its output."""
    out = node.output
    strides = contiguous_strides(tuple(out.shape))
    return StridedView(out.name, concat_starts(node)[k] * strides[node.attr("dim") % out.type.rank], strides)


def strided_views(graph: KernelGraph) -> dict:
    """Value name -> its `StridedView` (see the module's text): each concat piece its producer writes in place,
    then each split part read in place (a part of a piece lies in the concat's output)."""
    return views_and_copy_reasons(graph)[0]


def copy_reasons(graph: KernelGraph) -> dict:
    """Value name -> why a split copies that part of its operand, or a concat that piece into its output,
    rather than have its kernels address it in place (`mdsl.search.explain` says so of a boundary)."""
    return views_and_copy_reasons(graph)[1]


def views_and_copy_reasons(graph: KernelGraph) -> tuple:
    """(`strided_views`, `copy_reasons`) of `graph`, decided together."""
    if not any(node.op in ("split", "concat") and node.body is None for node in graph.nodes):
        return {}, {}   # (the cost model asks of every candidate: most have neither)
    users = graph.users()
    producers = graph.producers()
    results, inputs = {v.name for v in graph.outputs}, {v.name for v in graph.inputs}
    views, reasons = {}, {}

    def contiguous_reader(value: str, but: Optional[Node] = None) -> Optional[str]:
        bad = [r for r in users.get(value, []) if r is not but and not reads_in_place(r)]
        return f"{bad[0].op} %{bad[0].outputs[0].name} takes contiguous operands" if bad else None

    def through(var, view: StridedView) -> tuple:
        """Whether `var`, put at `view`, can be read in place: (the views of the aliases between it and the
        kernels that read it, None), else ({}, why not). Reshapes and size-1 transposes are looked through."""
        beyond = {}
        if var.name in users and _misaligned(view, var):
            return {}, _misaligned(view, var)
        for r in users.get(var.name, []):
            if reads_in_place(r):
                continue
            if is_view(r) and r.output.name in results:
                return {}, f"{r.op} %{r.output.name}, a result of the program, is a view of it"
            strides = _aliased_strides(r, view.strides) if is_view(r) else None
            if strides is None:
                what = "views it across a gap between rows" if is_view(r) else "takes contiguous operands"
                return {}, f"{r.op} %{r.outputs[0].name} {what}"
            aliased = StridedView(view.of, view.offset, strides)
            more, reason = through(r.output, aliased)
            if reason is not None:
                return {}, reason
            beyond.update({r.output.name: aliased, **more})
        return beyond, None

    for node in graph.nodes:
        if node.op != "concat" or node.body is not None:
            continue
        for k, piece in enumerate(node.inputs):
            view, producer = _placed(node, k), producers.get(piece.name)
            reason = ("an input of the program" if piece.name in inputs else "a result of the program"
                      if piece.name in results else "placed in another concat" if piece.name in views
                      else "a piece twice" if node.inputs.count(piece) > 1
                      else f"{producer.op} %{producer.outputs[0].name} does not write in place"
                      if not writes_in_place(producer)
                      else contiguous_reader(piece.name, node)
                      or _misaligned(view, piece))
            if reason is None:
                views[piece.name] = view
            else:
                reasons.setdefault(piece.name, reason)
    for node in graph.nodes:
        if node.op != "split" or node.body is not None:
            continue
        src = node.inputs[0]
        base = views.get(src.name) or StridedView(src.name, 0, contiguous_strides(tuple(src.shape)))
        dim = node.attr("dim") % src.type.rank
        for part, start in zip(node.outputs, split_starts(node).values()):
            view = StridedView(base.of, base.offset + start * base.strides[dim], base.strides)
            beyond, reason = ({}, "a result of the program") if part.name in results else through(part, view)
            if reason is None:
                views[part.name] = view
                views.update(beyond)
            else:
                reasons[part.name] = reason
    return views, reasons


def _aliased_strides(node: Node, strides: tuple) -> Optional[tuple]:
    """The strides of alias `node`'s output (a reshape, or a transpose that moves only size-1 dims) over its
    input's elements laid out by `strides`; None where a dim of the output would straddle a gap between rows
    (a reshape that merges a strided dim with its neighbour)."""
    if node.op == "transpose":
        return tuple(strides[p] for p in node.attr("perm"))
    chunks = []   # runs of the input's dims contiguous with each other: (elements, the innermost's stride)
    for n, s in zip(node.inputs[0].shape, strides):
        if n == 1:
            continue
        if chunks and chunks[-1][1] == s * n:
            chunks[-1] = (chunks[-1][0] * n, s)
        else:
            chunks.append((n, s))
    out, left = [], 1
    stride = 1
    for n in reversed(node.output.shape):
        if n != 1:
            if left == 1:
                if not chunks:
                    return None
                left, stride = chunks.pop()
            if left % n:
                return None
            left //= n
        out.append(stride)
        stride *= n
    return tuple(reversed(out)) if left == 1 and not chunks else None


def _misaligned(view: StridedView, var) -> Optional[str]:
    if _aligned(view.offset, view.strides, tuple(var.shape), var.dtype.itemsize):
        return None
    return "it does not start, or its rows do not, at a multiple of 16 bytes"


def written_parts(node: Node, views: dict) -> tuple:
    """A split's parts that its kernel writes: those that are not strided views."""
    return tuple(v for v in node.outputs if v.name not in views)


def copied_pieces(node: Node, views: dict) -> tuple:
    """The positions of a concat's pieces that its kernel copies: those their producers did not write in place."""
    return tuple(k for k, v in enumerate(node.inputs) if views.get(v.name) != _placed(node, k))


def launches_nothing(node: Node, views: dict) -> bool:
    """Whether kernel-level `node` launches no kernel: an alias (`is_view`), a split whose every part is a
    strided view, a concat whose every piece its producer wrote in place."""
    if is_view(node):
        return True
    if node.body is not None:
        return False
    if node.op == "split":
        return not written_parts(node, views)
    return node.op == "concat" and not copied_pieces(node, views)


@attrs.frozen
class Copy:
    """One block of elements a split's or concat's kernel copies: `shape`, from its input `source` (an index into
    `LayoutCopies.inputs`) `source_offset` elements in, to its output `target` `target_offset` elements in, each
    addressed by its operand's strides."""

    source: int
    target: int
    shape: tuple
    source_offset: int
    target_offset: int


@attrs.frozen
class LayoutCopies:
    """The kernel of a split or concat, lowered: the values it takes and writes and what it copies, one loop
    over each `Copy`'s elements (on every thread of the grid)."""

    inputs: tuple
    outputs: tuple
    copies: tuple

    @property
    def elements(self) -> int:
        return sum(math.prod(c.shape) for c in self.copies)


def layout_copies(node: Node, views: dict) -> Optional[LayoutCopies]:
    """What the kernel of kernel-level split or concat `node` copies; None where it copies nothing (no kernel)."""
    def strides(var) -> tuple:
        return views[var.name].strides if var.name in views else contiguous_strides(tuple(var.shape))

    if node.op == "split":
        src, parts = node.inputs[0], written_parts(node, views)
        step = strides(src)[node.attr("dim") % src.type.rank]
        starts = split_starts(node)
        copies = tuple(Copy(0, j, tuple(v.shape), starts[v.name] * step, 0) for j, v in enumerate(parts))
        return LayoutCopies((src,), parts, copies) if copies else None
    assert node.op == "concat", node.op
    positions = copied_pieces(node, views)
    step = strides(node.output)[node.attr("dim") % node.output.type.rank]
    starts = concat_starts(node)
    copies = tuple(Copy(j, 0, tuple(node.inputs[k].shape), 0, starts[k] * step) for j, k in enumerate(positions))
    return LayoutCopies(tuple(node.inputs[k] for k in positions), node.outputs, copies) if copies else None

"""Shape families: a plan found for one size of the leading (batch or token) dim serves its other sizes.

The *family dim* of a program is dim 0 of its first output, where some input's dim 0 carries the same
label (`mdsl.search.resize.JointLabels`) and no operator contracts it: the rows a layer computes one
by one. A plan searched at M rows is *re-targeted* to M' rows by resizing the family label in the
original and in each of the plan's mugraphs by M'/M (grids, loops and maps unchanged: each block
takes a proportionally smaller or larger tile of rows), lowering the result again
(`mdsl.backend.cuda.emit_cuda`, which refuses what its code generator cannot build) and verifying it at
its own size with the search's verifier, seed and tests: no search. It applies where the resize is
exact: every tile of the label divides into the new size (a grid that splits the rows p ways needs
p | M'), no constant of a mugraph that the original lacks encodes the label's size (a lifted mean's
1/M), and the original resized is,
value for value, the program traced at M' (a broadcast dim of size 1 tied to the rows at M = 1 is not).

`family_of` says which of FAMILY_SIZES a plan (a `mdsl.search.plan.Plan`) re-targets to (resized,
validated and lowered; each is verified when it is first used); `retarget` re-targets its chosen
mugraph to one of them, which `mdsl.search.engine.optimize` verifies and stores as that size's plan.
"""
from __future__ import annotations

from typing import Optional

import attrs

from mdsl.errors import MdslError
from mdsl.ir.graph import KernelGraph
from mdsl.search.records import Family
from mdsl.search.resize import CannotResize, JointLabels, encodes_size, float_constants

#: The sizes of the family dim a plan's coverage is reported for (LLM decode and small prefill batches).
FAMILY_SIZES = (1, 2, 4, 8, 16, 32, 64)


def family_label(labels: JointLabels) -> Optional[tuple]:
    """The family label of the original (`labels.graphs[0]`) and a description, or None."""
    original = labels.graphs[0]
    if not original.outputs or not original.outputs[0].type.rank:
        return None
    label = labels.original_label(original.outputs[0], 0)
    carrier = next((v for v in original.inputs if v.type.rank and labels.original_label(v, 0) == label), None)
    if carrier is None:
        return None
    from mdsl.search.dims import Labels

    kernel_labels = Labels(original)
    contracted = kernel_labels.contracted_labels()
    if kernel_labels.label(original.outputs[0].name, 0) in contracted:
        return None
    return label, f"dim 0 of %{carrier.name}"


def _resized(plan, size: int) -> Optional[list]:
    """[original, chosen, *alternatives] at `size` of the family dim, or None where the resize is not exact."""
    graphs = [plan.original, plan.graph, *(c.graph for c in plan.alternatives)]
    labels = JointLabels(graphs)
    found = family_label(labels)
    if found is None:
        return None
    label = found[0]
    old = plan.original.outputs[0].shape[0]
    # a constant of a mugraph that the original does not have may be the family size read another way
    # (a lifted mean's 1/M); the original's own constants stay what they are at any size
    own = set(float_constants([plan.original]))
    derived = [c for c in float_constants(graphs[1:]) if c not in own]
    if any(encodes_size(derived, n) for n in labels.extents()[label]):
        return None

    def new_extent(l, n):
        return n if l != label else (n * size // old if n * size % old == 0 else None)

    try:
        out, fixed = labels.resized(new_extent)
    except CannotResize:
        return None
    return None if label in fixed else out


def _lowers(graph: KernelGraph, arch: str) -> bool:
    from mdsl.backend.cuda import emit_cuda

    try:
        emit_cuda(graph, arch=arch)
    except MdslError:
        return False
    return True


def _valid(graph: KernelGraph) -> bool:
    from mdsl.ir.validate import validate_kernel_graph

    try:
        validate_kernel_graph(graph)
    except MdslError:
        return False
    return True


def family_of(plan, sizes: tuple = FAMILY_SIZES) -> Optional[Family]:
    """The plan's family: the sizes of `sizes` its chosen mugraph re-targets to (resized, validated,
    lowered); None where the program has no family dim."""
    labels = JointLabels([plan.original, plan.graph])
    found = family_label(labels)
    if found is None:
        return None
    here = plan.original.outputs[0].shape[0]
    covered = []
    for size in sizes:
        if size == here:
            continue
        graphs = _resized(attrs.evolve(plan, alternatives=()), size)
        if graphs is not None and _valid(graphs[1]) and _lowers(graphs[1], plan.config.arch):
            covered.append(size)
    return Family(found[1], here, tuple(covered))


def retarget(plan, graph: KernelGraph) -> Optional[KernelGraph]:
    """The plan's chosen mugraph re-targeted to `graph`, the plan's program at another size of its family
    dim: resized, validated and lowered (not yet verified: the caller verifies it at that size, see
    `mdsl.search.engine.optimize`); None where it does not re-target."""
    size = graph.outputs[0].shape[0] if graph.outputs and graph.outputs[0].type.rank else None
    if size is None or plan.family is None:
        return None
    resized = _resized(attrs.evolve(plan, alternatives=()), size)
    if resized is None or attrs.evolve(resized[0], name=graph.name) != graph:
        return None
    chosen = attrs.evolve(resized[1], name=graph.name)
    return chosen if _valid(chosen) and _lowers(chosen, plan.config.arch) else None


def member_family(plan, size: int) -> Family:
    """The family of the plan re-targeted to `size`: the same dim and sizes, that size's."""
    family = plan.family
    return Family(family.dim, size, tuple(s for s in (family.size, *family.sizes) if s != size), source=family.size)

"""The reduced-instance screen: a candidate and its original shrunk together (`mdsl.search.resize.reduced`)
and compared in one finite-field test, before the full-size verification.

A wrong candidate is rejected on a few thousand elements instead of the program's millions; a candidate
that passes still goes through the full-size tests, which alone decide. The screen is sound as a
screen: it only rejects, and it rejects no correct candidate. Both graphs shrink by the same factor per
label, with the same grids, loops and maps: each node computes the same function of operands that are
smaller, so a candidate equal to its original as a function at full size is equal at the reduced sizes
(labels whose size a constant may encode, or that a node's rule ties, keep their sizes: there a
candidate could read the size another way than its original). So the false-pass bound of a verified
candidate is that of its full-size tests alone; the screen adds nothing to it and takes nothing from it.

Its randomness is its own: the seed's child `SCREEN_KEY` (the full-size tests use children 0, 1, ...),
so that a candidate's surviving the screen says nothing about the full-size draws.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from mdsl.errors import MdslError
from mdsl.ir.graph import KernelGraph
from mdsl.search.resize import elements, reduced

#: The SeedSequence child of the screen's randomness (far from the full-size tests' children 0, 1, ...).
SCREEN_KEY = 1 << 20
#: The most elements a reduced instance (both graphs) may hold; beyond it the screen does not run.
SCREEN_ELEMENTS = 1 << 22


def screen(original: KernelGraph, candidate: KernelGraph, seed: int, key: int = SCREEN_KEY) -> Optional[str]:
    """Why the candidate differs from the original on a reduced instance, or None (it agrees, or no reduced
    instance exists: the full-size tests decide)."""
    from mdsl.passes.finite_field import Field, run_in_field   # (numpy only; imported where it is used)

    pair = reduced([original, candidate])
    if pair is None or sum(elements(g) for g in pair) > SCREEN_ELEMENTS:
        return None
    small_original, small_candidate = pair
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(key,)))
    field = Field.draw(rng)
    inputs = [field.random(v.shape, rng) for v in small_original.inputs]
    try:
        expected = run_in_field(small_original, inputs, field)
        got = run_in_field(small_candidate, inputs, field)
    except MdslError as e:   # the original shrinks only where it evaluates: the candidate fails
        return f"it cannot be evaluated at the reduced sizes: {e.message}"
    for k, (want, have) in enumerate(zip(expected, got)):
        differ = int(np.sum(want[..., 0] != have[..., 0]))
        if differ:
            shape = "x".join(map(str, small_original.outputs[k].shape))
            return (f"on a reduced instance (output {k} of shape {shape}) it differs from the original in "
                    f"{differ} of {want[..., 0].size} element(s)")
    return None

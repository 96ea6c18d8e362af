"""Custom kernels (block graphs) that complement the codegen tests' coverage set
(tests/backend/cuda/coverage.py: every operator at every level, every accumulator, maps of many
kinds) with systematic combinations: every imap / fmap / omap combination on 1-D, 2-D and 3-D grids,
every accumulator under several maps, and matrix products split every way. Each case is traced
through the frontend, so it is a valid mugraph (combinations the validator refuses are left out);
`coverage_graphs(dtype)` returns them by id.
"""
from __future__ import annotations

import itertools
from typing import Callable, Optional

import mdsl
from mdsl.errors import MdslError
from mdsl.frontend.tensor import TensorSpec
from mdsl.ir.dtypes import DType
from mdsl.ir.graph import KernelGraph

Body = Callable  # body(b, *tiles) -> [(tile, omap), ...]

_ARITY = {
    1: lambda trace: lambda a: trace(a),
    2: lambda trace: lambda a, b: trace(a, b),
    3: lambda trace: lambda a, b, c: trace(a, b, c),
}


def custom_kernel(name: str, shapes: list, dtype: DType, grid: tuple, forloop: int, maps: list, body: Body,
                  threads: int = 128) -> Optional[KernelGraph]:
    """A kernel graph of one custom op, or None when the validator refuses the combination.
    `maps`: (imap, fmap) per input."""

    def trace(*tensors):
        with mdsl.block_graph(grid=grid, forloop=forloop, threads=threads) as b:
            tiles = [b.input(t, imap=imap, fmap=fmap) for t, (imap, fmap) in zip(tensors, maps)]
            for tile, omap in body(b, *tiles):
                b.output(tile, omap=omap)
        return b.results

    try:
        kernel = mdsl.kernel(_ARITY[len(shapes)](trace), name=name)
        return kernel.trace(*(TensorSpec(tuple(s), dtype) for s in shapes))
    except MdslError:
        return None


def _scaled_accum(b, x):
    return [(b.accum(x * 0.5), None)]


def _with_omap(body: Body, omap: tuple) -> Body:
    return lambda b, *tiles: [(tile, omap) for tile, _ in body(b, *tiles)]


# ---------------------------------------------------------------------------------------------
# the families

def _map_choices(rank: int, grid: tuple) -> list:
    """Every imap: each grid dim of size > 1 splits a distinct tensor dim, or replicates (None)."""
    sizes = [g for g in grid if g > 1]
    options = [None, *range(rank)]
    return [m for m in itertools.product(options, repeat=len(sizes))
            if len([d for d in m if d is not None]) == len({d for d in m if d is not None})]


def _omap_choices(rank: int, grid: tuple) -> list:
    """Every omap: each grid dim of size > 1 concatenates into a distinct output dim."""
    return list(itertools.permutations(range(rank), len([g for g in grid if g > 1])))


def map_combinations(dtype: DType) -> dict:
    """X[16, 64] through `accum(0.5 x)` for every imap x fmap x omap on grids (4,) and (2, 4)."""
    out = {}
    for grid in ((4,), (2, 4)):
        for imap, fmap, omap in itertools.product(_map_choices(2, grid), (None, 0, 1), _omap_choices(2, grid)):
            cid = f"maps-grid{'x'.join(map(str, grid))}-imap{_s(imap)}-fmap{_s(fmap)}-omap{_s(omap)}"
            out[cid] = custom_kernel(_n(cid), [(16, 64)], dtype, grid, 2, [(imap, fmap)],
                                     _with_omap(_scaled_accum, omap))
    return out


def grid3_combinations(dtype: DType) -> dict:
    """X[4, 8, 32] on a (2, 2, 2) grid: every permutation of split dims, with and without a loop."""
    out = {}
    for imap, fmap in itertools.product(itertools.permutations(range(3)), (None, 2)):
        for omap in {imap, (2, 1, 0)}:
            cid = f"grid3-imap{_s(imap)}-fmap{_s(fmap)}-omap{_s(omap)}"
            out[cid] = custom_kernel(_n(cid), [(4, 8, 32)], dtype, (2, 2, 2), 2, [(imap, fmap)],
                                     _with_omap(_scaled_accum, omap))
    return out


def _softmax_parts(b, x):
    m = mdsl.max(x, -1, keepdim=True)
    return mdsl.exp(x - m), m


_ACCUMULATORS = {
    "accum": lambda b, x: b.accum(mdsl.exp(x)),
    "accum_sum": lambda b, x: b.accum_sum(x),
    "accum_mean": lambda b, x: b.accum_mean(x),
    "accum_rms": lambda b, x: b.accum_rms(x, eps=1e-5),
    "accum_max": lambda b, x: b.accum_max(x),
    "accum_rescale": lambda b, x: b.accum_rescale(*_softmax_parts(b, x)),
    "accum_sum_rescale": lambda b, x: b.accum_sum_rescale(*_softmax_parts(b, x)),
}

# (id, grid, forloop, imap, fmap, omap) on X[16, 64]
_ACC_MAPS = [
    ("rows-split-loop-over-cols", (2,), 4, (0,), 1, (0,)),
    ("replicated-loop-over-cols", (4,), 2, (None,), 1, (0,)),
    ("rows-and-cols-split-no-loop", (2, 4), 1, (0, 1), None, (0, 1)),
    ("loop-over-rows", (2,), 2, (1,), 0, (1,)),
    ("one-block-long-loop", (1,), 16, (), 1, ()),
]


def accumulator_combinations(dtype: DType) -> dict:
    out = {}
    for (acc, make), (mid, grid, forloop, imap, fmap, omap) in itertools.product(_ACCUMULATORS.items(), _ACC_MAPS):
        cid = f"{acc}-{mid}"
        out[cid] = custom_kernel(_n(cid), [(16, 64)], dtype, grid, forloop, [(imap, fmap)],
                                 lambda b, x, make=make, omap=omap: [(make(b, x), omap)])
    return out


def matmul_combinations(dtype: DType) -> dict:
    """A[32, 64] @ B[64, 48] split by rows, columns, both, over K by the loop, and over K by the grid."""
    def product(b, a, w):
        return [(b.accum(a @ w), omap)]

    out = {}
    for cid, grid, forloop, maps, omap in [
        ("matmul-one-block", (1,), 1, [((), None), ((), None)], ()),
        ("matmul-rows", (2,), 4, [((0,), 1), ((None,), 0)], (0,)),
        ("matmul-cols", (3,), 4, [((None,), 1), ((1,), 0)], (1,)),
        ("matmul-rows-and-cols", (2, 3), 2, [((0, None), 1), ((None, 1), 0)], (0, 1)),
        ("matmul-k-over-grid", (2,), 2, [((1,), 1), ((0,), 0)], (0,)),   # partial sums side by side
    ]:
        out[cid] = custom_kernel(_n(cid), [(32, 64), (64, 48)], dtype, grid, forloop, maps,
                                 lambda b, a, w, omap=omap: product(b, a, w))
    out["matmul-silu-epilogue"] = custom_kernel(
        "matmul_silu", [(32, 64), (64, 48)], dtype, (2,), 4, [((0,), 1), ((None,), 0)],
        lambda b, a, w: [(mdsl.silu(b.accum(a @ w)), (0,))])
    out["matmul-rms-norm-linear"] = custom_kernel(
        "matmul_rms", [(32, 64), (64, 48)], dtype, (3,), 4, [((None,), 1), ((1,), 0)],
        lambda b, a, w: [(b.accum(a @ w) / b.accum_rms(a, eps=1e-5), (1,))])
    out["matmul-batched"] = custom_kernel(
        "matmul_batched", [(4, 16, 32), (4, 32, 16)], dtype, (4,), 2, [((0,), 2), ((0,), 1)],
        lambda b, a, w: [(b.accum(a @ w), (0,))])
    return out


FAMILIES = (map_combinations, grid3_combinations, accumulator_combinations, matmul_combinations)


def coverage_graphs(dtype: DType) -> dict:
    """id -> kernel graph of every valid case, for one dtype."""
    out = {}
    for family in FAMILIES:
        out.update((cid, g) for cid, g in family(dtype).items() if g is not None)
    return out


def _s(m) -> str:
    if m is None:
        return "-"
    return "".join("-" if d is None else str(d) for d in m) if isinstance(m, tuple) else str(m)


def _n(cid: str) -> str:
    return "cov_" + "".join(c if c.isalnum() else "_" for c in cid)

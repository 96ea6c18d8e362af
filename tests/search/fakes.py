"""Fake generators and verifiers for the search tests: small, fast and deterministic.

The verifiers run in worker processes, so they are module-level functions (pickled by name).
"""
from __future__ import annotations

import itertools
import random
import time
import types

from mdsl.ir.dtypes import f32
from mdsl.ir.graph import KernelGraph, Node, make_var
from mdsl.search.records import Fallback

SHAPE = (8, 16)


def chain(*scalars: float, name: str = "double", shape: tuple = SHAPE, op: str = "mul_scalar") -> KernelGraph:
    """x * s0 * s1 * ...: one launch per scalar, so more scalars cost more."""
    value = make_var("x", shape, f32)
    inputs, nodes = (value,), []
    for i, s in enumerate(scalars):
        out = make_var(f"t{i}", shape, f32)
        nodes.append(Node(op, (value,), (out,), (("value", float(s)),)))
        value = out
    return KernelGraph(name, inputs, nodes, (value,))


def with_exp(graph: KernelGraph) -> KernelGraph:
    """`graph` followed by exp: the fake verifiers reject any graph with an exp."""
    out = make_var("e", SHAPE, f32)
    return KernelGraph(graph.name, graph.inputs, (*graph.nodes, Node("exp", graph.outputs, (out,))), (out,))


ORIGINAL = chain(-1.0, -1.0, 2.0)          # 3 launches
FAST = chain(2.0)                          # 1 launch: the best
MIDDLE = chain(-1.0, -2.0)                 # 2 launches
REJECTED = with_exp(chain(2.0))            # 2 launches, but "not equivalent"
BAD_TYPE = KernelGraph("double", FAST.inputs,
                       (Node("mul_scalar", FAST.inputs, (make_var("y", (8, 8), f32),), (("value", 2.0),)),),
                       (make_var("y", (8, 8), f32),))             # declares the wrong output shape
OTHER_SIGNATURE = chain(2.0, shape=(4, 16))


def mixed(graph, config):
    """Every kind of candidate: good ones, duplicates, invalid ones, one the verifier rejects."""
    yield MIDDLE
    yield REJECTED
    yield FAST
    yield ORIGINAL                         # a duplicate of the original
    yield chain(2.0, name="renamed")       # a duplicate of FAST under another name
    yield BAD_TYPE
    yield OTHER_SIGNATURE
    yield "not a graph"


def many(graph, config):
    """Twelve distinct valid candidates of different costs, some with exp."""
    for n in range(1, 7):
        yield chain(*([1.0] * (n - 1)), 2.0)
        yield with_exp(chain(*([1.0] * (n - 1)), 2.0))


def pruning(graph, config, stats=None):
    """Reports pruning through the stats hook."""
    stats.count("pruned", "abstract-expression", 5)
    stats.count("pruned", "shape")
    stats.count("states", "pruning", 40)  # a category of the generator's own
    yield FAST


def failing(graph, config):
    yield FAST
    raise RuntimeError("generator bug")


CLOSED: list = []  # forever() appends when it is closed


def forever(graph, config):
    """Distinct candidates without end, the cheapest first; records that the engine closed it."""
    try:
        for n in itertools.count(1):
            yield chain(*([1.0] * (n - 1)), 2.0)
    finally:
        CLOSED.append(True)


def interrupted(graph, config):
    """Two candidates, then Ctrl-C (as a KeyboardInterrupt in the generator) while the second is verified
    (with verify_slowly: the engine asks for the third only once the first is done)."""
    yield FAST
    yield MIDDLE
    raise KeyboardInterrupt


def costly(graph, config):
    """Three valid candidates, each dearer than FAST (stands for the guided generator's proposals)."""
    for n in range(2, 5):
        yield chain(*([1.0] * n), 2.0)


def cheap(graph, config):
    """FAST (stands for an enumerated candidate that the cost model prefers)."""
    yield FAST


def _result(equivalent: bool, reason: str, tests: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(equivalent=equivalent, reason=reason, finite_field_tests=tests,
                                 false_pass_probability=2.0 ** -40, float_rel_error=1e-4, float_bound=1e-2)


def verify(original, candidate, *, tests=3, seed=0):
    """Equivalent unless the candidate has an exp; the reason names the seed, so tests can see it."""
    if any(n.op == "exp" for n in candidate.nodes):
        return _result(False, "exp changes the values", tests)
    return _result(True, f"fake check with seed {seed}", tests)


def verify_by_seed(original, candidate, *, tests=3, seed=0):
    """An outcome that depends on the seed and the candidate only: deterministic seeds give deterministic
    outcomes (a search hands every candidate the same seed, so the candidate varies the outcome)."""
    return _result((seed + len(candidate.nodes)) % 3 != 0, f"seed {seed}", tests)


def verify_slowly(original, candidate, *, tests=3, seed=0):
    time.sleep(0.3)
    return verify(original, candidate, tests=tests, seed=seed)


def verify_never(original, candidate, *, tests=3, seed=0):
    time.sleep(600)


def verify_broken(original, candidate, *, tests=3, seed=0):
    raise ValueError("verifier bug")



def verify_never_equal(original, candidate, *, tests=3, seed=0):
    """Rejects every candidate."""
    return _result(False, "never equal", tests)


def verify_jittery(original, candidate, *, tests=3, seed=0):
    """`verify` after a random pause (fresh randomness each call: workers finish in any order)."""
    time.sleep(random.SystemRandom().uniform(0.0, 0.05))
    return verify(original, candidate, tests=tests, seed=seed)


def with_fallbacks(graph, config):
    """Twelve candidates (every other one rejected), then one fallback standing in for a rejected
    candidate (verified) and one for a verified candidate (not verified), then two of the structure
    of a rejected one (x * s, then exp): the second of them is not verified."""
    yield from many(graph, config)
    yield Fallback(chain(3.0, 3.0), REJECTED.key)
    yield Fallback(chain(4.0, 4.0), FAST.key)
    yield with_exp(chain(5.0))
    yield with_exp(chain(7.0))

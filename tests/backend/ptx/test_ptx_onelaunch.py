"""A split and its combine in one launch (mdsl.lowering.onelaunch, mdsl/backend/ptx/onelaunch.py) on the CPU
simulator (tests/backend/ptx/simulator.py: the group counters' atomics, the barrier that ors the block's
votes, threads that exit, and the grid's blocks in the grid's order, reversed or shuffled, so that each block
of a group is the last to arrive in some run): split-K plans (a tile-loop split, a skinny one, overlapping
its predecessor, a combine of fewer threads, a coarser combine reading an input of the program too) and the
benchmarks' split-KV attention plans, against the reference and bit for bit against the same plan launched
as two kernels; and what the simulator catches: a group that never completes, a counter not reset for the
next launch."""
from __future__ import annotations

import attrs
import numpy as np
import pytest

from mdsl.backend.ptx import emit_llvm
from mdsl.lowering import program as lowering_program
from mdsl.lowering.options import CudaOptions
from tests.backend.ptx import simulator
from tests.backend.ptx.plans import split_attention, split_k
from tests.backend.ptx.test_ptx_simulated import pytestmark as needs_simulator
from tests.gpu.harness import random_inputs, reference, relative_error, tolerance

pytestmark = needs_simulator

SKINNY = CudaOptions(skinny=True)

#: (graph, options): the programs of tests/backend/test_onelaunch.py, and QKNorm's split-KV plan
PROGRAMS = {
    "split-k": (lambda: split_k(), CudaOptions()),
    "split-k-skinny": (lambda: split_k(), SKINNY),
    "split-k-skinny-overlap-staggered": (lambda: split_k(), CudaOptions(skinny=True, overlap=True, stagger=True)),
    "split-k-fewer-combine-threads": (lambda: split_k(combine_threads=64), SKINNY),
    "split-k-coarser-combine-scaled": (lambda: split_k(combine_columns=64, scale=True), CudaOptions()),
    "split-kv-attention": (lambda: split_attention(False, heads=2, queries=64), CudaOptions()),
    "split-kv-qknorm": (lambda: split_attention(True), CudaOptions()),
}
ORDERS = ("grid", "reversed", 7)


def _two_launches(graph, options, monkeypatch):
    """The plan's program with each kernel launched alone (no pair qualifies)."""
    with monkeypatch.context() as patch:
        patch.setattr(lowering_program, "one_launch_pairs", lambda graph, threads=None: ())
        program = emit_llvm(graph, options=options)
    assert len(program.launches) == len(graph.nodes)
    return program


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_one_launch_computes_the_two_launches_bit_for_bit(name, monkeypatch):
    make, options = PROGRAMS[name]
    graph = make()
    inputs = random_inputs(graph, np.random.default_rng(21), positive=range(len(graph.inputs)))
    want = reference(graph, inputs)
    program = emit_llvm(graph, options=options)
    (launch,) = program.launches
    assert launch.counters > 0
    apart = simulator.run(_two_launches(graph, options, monkeypatch), inputs)
    for order in ORDERS:
        got = simulator.run(program, inputs, order=order)
        for k, (g, a, w) in enumerate(zip(got, apart, want)):
            what = f"{name}, blocks in {order} order, output {k}"
            assert not np.isnan(g).any(), f"{what}: NaN (a combine read partials not yet written)"
            assert relative_error(g, w) <= tolerance(graph), f"{what}: relative error {relative_error(g, w):.2e}"
            assert np.array_equal(g, a), f"{what}: {int((g != a).sum())} elements differ from the two launches'"


def _with_groups(monkeypatch, change) -> None:
    """The pairs the lowering finds, their grouping changed by `change` (a Groups -> Groups)."""
    found = lowering_program.one_launch_pairs
    monkeypatch.setattr(lowering_program, "one_launch_pairs", lambda graph, threads=None: tuple(
        attrs.evolve(pair, groups=change(pair.groups)) for pair in found(graph, threads)))


def test_a_group_that_never_completes_is_caught(monkeypatch):
    """Groups counted one block larger than they are: no block is ever the last, nothing combines, and the
    counters end the launch non-zero."""
    graph = split_k()
    _with_groups(monkeypatch, lambda groups: attrs.evolve(groups, size=groups.size + 1))
    with pytest.raises(AssertionError, match="group counters non-zero"):
        simulator.run(emit_llvm(graph, options=CudaOptions()), random_inputs(graph, np.random.default_rng(22)))


def test_a_counter_left_for_the_next_launch_is_caught(monkeypatch):
    """A reset that leaves the count (adds 0): the launch ends with its counters non-zero."""
    from mdsl.backend.ptx import onelaunch

    monkeypatch.setattr(onelaunch, "RESET", onelaunch.ARRIVE.replace("], 1;", "], 0;"))
    graph = split_k()
    with pytest.raises(AssertionError, match="group counters non-zero"):
        simulator.run(emit_llvm(graph, options=CudaOptions()), random_inputs(graph, np.random.default_rng(23)))


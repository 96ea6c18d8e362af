"""The vectorised block-graph walk (all blocks at once, along a block axis) against the per-block walk it
replaces (tests/ir/per_block_walk.py), on random valid graphs, in float and in the finite field: the
results must be identical, whatever the number of blocks run together."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdsl.backend.reference.interpreter import FloatSemantics
from mdsl.ir import evaluate
from mdsl.ir.text import parse_graph
from mdsl.passes.finite_field import Field, FieldSemantics, q_residues_read
from tests.ir import per_block_walk
from tests.strategies import EXAMPLES, kernel_graphs

#: operands of different ranks (numpy alone would pair the block axis with a tensor dim), a rank-0
#: tile, and reductions and a concat along dims counted from the front and from the back
RANKS = """\
kernel ranks(%a: f32[4, 6, 8], %w: f32[8, 6], %b: f32[8]) {
  %y: f32[4, 6, 12] = custom(%a, %w, %b) block(grid=[2, 2, 1], threads=128, forloop=2) {
    in %ta: f32[2, 6, 4] imap=[0, -, -] fmap=2
    in %tw: f32[4, 3] imap=[-, 1, -] fmap=0
    in %tb: f32[4] imap=[-, -, -] fmap=0
    %e: f32[2, 6, 4] = add(%ta, %tb)
    %m: f32[2, 6, 3] = matmul(%e, %tw)
    %s0: f32[2, 6] = sum(%m) {dim=2, keepdim=false}
    %s1: f32[2] = max(%s0) {dim=-1, keepdim=false}
    %s2: f32[] = mean(%s1) {dim=0, keepdim=false}
    %mx: f32[] = accum_max(%s2)
    %acc: f32[2, 6, 3] = accum(%m)
    %z: f32[2, 6, 3] = mul(%acc, %mx)
    %c: f32[2, 6, 6] = concat(%z, %acc) {dim=2}
    out %c omap=[0, 2, -]
  }
  return %y
}"""

#: blocks run together: all of them (the default budget), one at a time, a few
CHUNKS = st.sampled_from([evaluate.CHUNK_ELEMENTS, 1, 5000])


def _float_inputs(graph, rng) -> list:
    return [rng.standard_normal(v.shape) if v.dtype.is_float else rng.integers(-8, 8, v.shape) for v in graph.inputs]


def _same(graph, inputs, sem, chunk: int) -> None:
    """Field results must be identical. Float results may differ in the last bit: numpy picks different
    summation and SIMD paths for a block axis of different length, so float64 is compared to 1e-9 of the
    output's scale (a wrong block, map or accumulator is off by far more)."""
    with pytest.MonkeyPatch.context() as patch, np.errstate(all="ignore"):
        patch.setattr(evaluate, "CHUNK_ELEMENTS", chunk)
        got = evaluate.run_kernel_graph(graph, inputs, sem)
        want = per_block_walk.run_kernel_graph(graph, inputs, sem)
    for g, w in zip(got, want):
        if isinstance(sem, FloatSemantics):
            finite = np.isfinite(w)
            np.testing.assert_array_equal(np.isfinite(g), finite)
            scale = max(1.0, float(np.abs(w[finite]).max(initial=0.0)))
            np.testing.assert_allclose(g[finite], w[finite], rtol=1e-9, atol=1e-9 * scale)
        else:
            np.testing.assert_array_equal(g, w)


@given(graph=kernel_graphs(), seed=st.integers(0, 2 ** 32 - 1), chunk=CHUNKS)
@settings(max_examples=80, deadline=None)
def test_the_vectorised_walk_equals_the_per_block_walk_in_float(graph, seed, chunk):
    # float64 without storage rounding: a last-bit difference rounded to f16 and amplified by a later
    # cancellation would be noise, not a bug in the walk
    _same(graph, _float_inputs(graph, np.random.default_rng(seed)), FloatSemantics(np.float64), chunk)


@given(graph=kernel_graphs(), seed=st.integers(0, 2 ** 32 - 1), chunk=CHUNKS)
@settings(max_examples=80, deadline=None)
def test_the_vectorised_walk_equals_the_per_block_walk_in_the_field(graph, seed, chunk):
    rng = np.random.default_rng(seed)
    field = Field.draw(rng)
    _same(graph, [field.random(v.shape, rng) for v in graph.inputs], FieldSemantics(field), chunk)


@given(graph=kernel_graphs(), seed=st.integers(0, 2 ** 32 - 1), chunk=CHUNKS)
@settings(max_examples=80, deadline=None)
def test_with_the_q_residues_read_the_outputs_p_residues_equal_the_per_block_walks(graph, seed, chunk):
    """Knowing which q-residues are read, rescaling accumulators fold their p-residues alone (and matmuls
    skip their q-residues): the outputs' p-residues, all a verification compares, stay the same."""
    rng = np.random.default_rng(seed)
    field = Field.draw(rng)
    inputs = [field.random(v.shape, rng) for v in graph.inputs]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evaluate, "CHUNK_ELEMENTS", chunk)
        got = evaluate.run_kernel_graph(graph, inputs, FieldSemantics(field, q_residues_read(graph)))
    want = per_block_walk.run_kernel_graph(graph, inputs, FieldSemantics(field))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g[..., 0], w[..., 0])


@pytest.mark.parametrize("name", [*EXAMPLES, "ranks"])
@pytest.mark.parametrize("chunk", [evaluate.CHUNK_ELEMENTS, 1])
def test_hand_written_graphs_agree(name, chunk):
    graph = parse_graph({**EXAMPLES, "ranks": RANKS}[name])
    rng = np.random.default_rng(5)
    _same(graph, _float_inputs(graph, rng), FloatSemantics(np.float64), chunk)
    field = Field.draw(rng)
    inputs = [field.random(v.shape, rng) for v in graph.inputs]
    _same(graph, inputs, FieldSemantics(field), chunk)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evaluate, "CHUNK_ELEMENTS", chunk)
        got = evaluate.run_kernel_graph(graph, inputs, FieldSemantics(field, q_residues_read(graph)))
    for g, w in zip(got, per_block_walk.run_kernel_graph(graph, inputs, FieldSemantics(field))):
        np.testing.assert_array_equal(g[..., 0], w[..., 0])


def test_blocks_run_in_chunks_of_bounded_size(monkeypatch):
    graph = parse_graph(EXAMPLES["rms_norm_linear"])  # 48 blocks
    chunks = []
    run = evaluate._run_blocks

    def counted(sem, bg, plan, reads, blocks, folded):
        chunks.append(len(blocks))
        return run(sem, bg, plan, reads, blocks, folded)

    monkeypatch.setattr(evaluate, "_run_blocks", counted)
    monkeypatch.setattr(evaluate, "CHUNK_ELEMENTS", 20 * evaluate._elements_per_block(graph.nodes[0].body))
    evaluate.run_kernel_graph(graph, _float_inputs(graph, np.random.default_rng(0)), FloatSemantics(np.float64))
    assert chunks == [20, 20, 8]


#: rms_norm reads only Q's tile, which every iteration loads alike (no fmap); the matmul reads K's
HOISTED = """\
kernel hoisted(%q: f32[4, 8], %k: f32[8, 16]) {
  %y: f32[4, 1] = custom(%q, %k) block(grid=[2, 1, 1], threads=128, forloop=4) {
    in %tq: f32[2, 8] imap=[0, -, -] fmap=-
    in %tk: f32[8, 4] imap=[-, -, -] fmap=1
    %n: f32[2, 8] = rms_norm(%tq) {dim=1, eps=1e-06}
    %s: f32[2, 4] = matmul(%n, %tk)
    %r: f32[2, 1] = sum(%s) {dim=1, keepdim=true}
    %acc: f32[2, 1] = accum(%r)
    out %acc omap=[0, -, -]
  }
  return %y
}"""


def test_loop_invariant_nodes_run_once_before_the_loop():
    graph = parse_graph(HOISTED)
    applied = []

    class Counting(FloatSemantics):
        def apply(self, node, args):
            applied.append(node.op)
            return super().apply(node, args)

    plan = evaluate.BlockPlan(graph.nodes[0].body, [v.shape for v in graph.inputs])
    assert [n.op for n in plan.invariant_nodes] == ["rms_norm"]
    assert [n.op for n in plan.iteration_nodes] == ["matmul", "sum"]
    inputs = _float_inputs(graph, np.random.default_rng(3))
    _same(graph, inputs, Counting(np.float64), evaluate.CHUNK_ELEMENTS)
    applied.clear()
    evaluate.run_kernel_graph(graph, inputs, Counting(np.float64))
    assert sorted(applied) == ["matmul"] * 4 + ["rms_norm"] + ["sum"] * 4

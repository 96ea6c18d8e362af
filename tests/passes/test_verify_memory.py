"""The verifier's memory: a test's inputs are held narrow (int32 residues, with q-residues only where a
program reads them; float16 or float32 values), drawn again for each evaluation rather than kept, and
widened in pieces where an operator reads them. None of it changes a residue, a float or a verdict."""
from __future__ import annotations

import pickle
import tracemalloc

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mdsl
from mdsl import Tensor, f16
from mdsl.backend.reference import interpreter, run_kernel_graph
from mdsl.ir import evaluate
from mdsl.passes import finite_field as ff
from mdsl.passes import float_check
from mdsl.passes import verify as verifier
from mdsl.passes.finite_field import Field, inputs_q_read, run_in_field
from tests.strategies import kernel_graphs

pytestmark = pytest.mark.timeout(120)


def linear_silu(k: int, n: int):
    """silu(x @ w) and its fused kernel (blocks of 32 output columns, a loop over K in tiles of 128)."""
    @mdsl.kernel(name="linear_silu")
    def spec(x: Tensor[16, k, f16], w: Tensor[k, n, f16]):
        return mdsl.silu(x @ w)

    @mdsl.kernel(name="linear_silu")
    def fused(x: Tensor[16, k, f16], w: Tensor[k, n, f16]):
        with mdsl.block_graph(grid=(n // 32,), forloop=k // 128) as b:
            xt = b.input(x, imap=(None,), fmap=1)
            wt = b.input(w, imap=(1,), fmap=0)
            b.output(mdsl.silu(b.accum(xt @ wt)), omap=(1,))
        return b.results[0]

    return spec.graph, fused.graph


def test_narrow_inputs_are_the_same_draws():
    rng = np.random.default_rng(7)
    field = Field.draw(rng)
    state = rng.bit_generator.state
    wide = [field.random((3, 5), rng), field.random((4,), rng)]
    again = float_check.generator(state)
    narrow = [field.random_input((3, 5), again), field.random_input((4,), again, q_read=False)]
    assert [a.dtype for a in narrow] == [np.int32, np.int32]
    np.testing.assert_array_equal(narrow[0], wide[0])
    # without q_read the p-residues are held once and read as both
    np.testing.assert_array_equal(narrow[1][..., 0], wide[1][..., 0])
    np.testing.assert_array_equal(narrow[1][..., 1], wide[1][..., 0])
    assert narrow[1].strides[-1] == 0 and not narrow[1].flags.writeable
    # without q_drawn the q-residues are not drawn: what is drawn next comes earlier in the stream
    skipped = float_check.generator(state)
    field.random_input((3, 5), skipped, q_read=False, q_drawn=False)
    after_p = float_check.generator(state)
    after_p.integers(0, field.p, 15)
    assert skipped.integers(0, 2 ** 30) == after_p.integers(0, 2 ** 30)


@given(graph=kernel_graphs(), seed=st.integers(0, 2 ** 32 - 1), chunk=st.sampled_from([None, 1, 64]))
@settings(max_examples=60, deadline=None)
def test_narrow_and_p_only_inputs_change_no_output(graph, seed, chunk):
    rng = np.random.default_rng(seed)
    field = Field.draw(rng)
    state = rng.bit_generator.state
    wide = [field.random(v.shape, rng) for v in graph.inputs]
    again = float_check.generator(state)
    narrow = [field.random_input(v.shape, again, q_read) for v, q_read in zip(graph.inputs, inputs_q_read(graph))]
    with pytest.MonkeyPatch.context() as patch:
        if chunk is not None:   # matmuls in short pieces of K
            patch.setattr(ff, "WIDEN_ELEMENTS", chunk)
        want, got = run_in_field(graph, wide, field), run_in_field(graph, narrow, field)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g[..., 0], w[..., 0])


@given(graph=kernel_graphs(), seed=st.integers(0, 2 ** 32 - 1), piece=st.sampled_from([None, 1, 64]))
@settings(max_examples=60, deadline=None)
def test_float_inputs_held_narrow_give_the_same_floats(graph, seed, piece):
    rng = np.random.default_rng(seed)
    narrow = [rng.standard_normal(v.shape).astype(np.float16) if v.dtype.is_float else rng.integers(-8, 8, v.shape)
              for v in graph.inputs]
    wide = [np.asarray(a, dtype=np.float64) for a in narrow]
    runs = [("float64", False), ("float32", True)] if piece is None else [("float64", False)]
    with pytest.MonkeyPatch.context() as patch, np.errstate(all="ignore"):
        if piece is not None:   # matmuls widen their larger operand in pieces of a few columns or rows
            patch.setattr(interpreter, "MATMUL_PIECE_ELEMENTS", piece)
        for precision, round_storage in runs:
            want = run_kernel_graph(graph, wide, precision=precision, round_storage=round_storage)
            got = run_kernel_graph(graph, narrow, precision=precision, round_storage=round_storage)
            for w, g in zip(want, got):
                assert g.dtype == w.dtype
                if piece is None:
                    np.testing.assert_array_equal(g, w)
                    continue
                # a piece of one column is a matrix-vector product for numpy, whose sums may round
                # differently in the last bit (pieces of many columns, as MATMUL_PIECE_ELEMENTS makes
                # them at large shapes, are the same products as one call)
                finite = np.isfinite(w)
                np.testing.assert_array_equal(np.isfinite(g), finite)
                scale = max(1.0, float(np.abs(w[finite]).max(initial=0.0)))
                np.testing.assert_allclose(g[finite], w[finite], rtol=1e-9, atol=1e-9 * scale)


def test_a_float_input_is_used_as_given_and_never_written():
    var = linear_silu(128, 32)[0].inputs[1]   # f16[128, 32]
    held = np.zeros(var.shape, dtype=np.float16)
    for precision in (np.float32, np.float64):
        sem = interpreter.FloatSemantics(precision, round_storage=True)
        value = sem.store(var, sem.take_input(var, held))   # f16 holds every float16: nothing to round
        assert np.shares_memory(value, held) and not value.flags.writeable
    sem = interpreter.FloatSemantics(np.float32, round_storage=True)
    thirds = np.full(var.shape, 1 / 3, dtype=np.float32)    # not f16 values: rounded, into a copy
    stored = sem.store(var, sem.take_input(var, thirds))
    assert stored[0, 0] == np.float32(np.float16(1 / 3)) and thirds[0, 0] == np.float32(1 / 3)
    assert not np.shares_memory(interpreter.FloatSemantics(np.float32).take_input(var, held.astype(np.float64)), held)


def test_the_runs_keep_no_inputs_and_draw_the_same_ones_again():
    original, candidate = linear_silu(256, 128)
    run = verifier._FieldRun.of(original, verifier._rng(3, 0))
    first, second = run.inputs(original), run.inputs(candidate)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a[..., 0], b[..., 0])
    rng = verifier._rng(3, 0)
    field = Field.draw(rng)
    np.testing.assert_array_equal(first[1][..., 0], [field.random(v.shape, rng) for v in original.inputs][1][..., 0])
    # what a run keeps is output-sized (16 x 128 residue pairs at most), not input-sized (256 x 128)
    float_run = float_check.FloatRun.of(original, verifier._rng(3, 3))
    kept = [v for r in (run, float_run) for field_value in attrs.astuple(r, recurse=False)
            for v in (field_value if isinstance(field_value, (list, tuple)) else [field_value])]
    assert max(v.size for v in kept if isinstance(v, np.ndarray)) == 16 * 128 * 2


def test_verification_holds_one_input_at_a_time():
    # w has 8M elements: 32 MiB of int32 residues, 16 MiB of float16. The verifier may hold one test's
    # inputs, one widened piece of a float matmul (float64) and one chunk of blocks (int64 residue pairs),
    # and its runs of the original keep only the original's outputs
    original, candidate = linear_silu(2048, 4096)
    elements = 2048 * 4096
    runs = verifier._OriginalRuns()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verifier, "ORIGINAL_RUNS", runs)
        tracemalloc.start()
        try:
            result = verifier.verify(original, candidate, tests=3, seed=0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert result.equivalent, result.reason
    bound = 4 * elements + 8 * interpreter.MATMUL_PIECE_ELEMENTS + 16 * evaluate.CHUNK_ELEMENTS
    assert peak < bound, f"verification's peak is {peak / 2**20:.0f} MiB, over {bound / 2**20:.0f} MiB"
    kept = len(pickle.dumps(runs.runs))
    assert kept < elements, f"the original's runs take {kept / 2**20:.1f} MiB pickled"


"""The GPU harness's comparison (runs without a GPU): what agrees with the reference and what does not,
infinities included (an f16 result past 65504 is an infinity where it is stored, on the GPU and in the
reference alike; seed 3902276456 draws such an output in the gated MLP example)."""
from __future__ import annotations

import numpy as np

from mdsl.ir.dtypes import bf16, f16, f32
from tests.gpu.harness import TOLERANCES, mismatches

TOL = TOLERANCES["f16"]


def reference_row() -> np.ndarray:
    return np.array([1.0, -2.0, 3.5, np.inf, -np.inf, 100.0])


def test_agreeing_values_and_infinities_of_the_same_sign_pass():
    want = reference_row()
    got = want * (1 + 1e-4)
    err, bad, summary = mismatches(got, want, f16, TOL)
    assert summary is None and not bad.any() and err <= TOL


def test_an_infinity_against_a_value_at_the_edge_of_the_range_passes():
    want = np.array([1.0, np.inf, -65500.0])
    got = np.array([1.0, 65400.0, -np.inf])   # rounded just below / past 65504 on either side
    assert mismatches(got, want, f16, TOL)[2] is None


def test_an_infinity_on_one_side_only_fails_and_is_named():
    want = np.array([1.0, 2.0, np.inf, 4.0])
    for got in (np.array([1.0, np.inf, np.inf, 4.0]),     # the GPU overflowed where the reference did not
                np.array([1.0, 2.0, 1000.0, 4.0]),        # the reference overflowed, the GPU is far below
                np.array([1.0, 2.0, -np.inf, 4.0])):      # the wrong sign
        err, bad, summary = mismatches(got, want, f16, TOL)
        assert summary is not None and "infinite on one side only" in summary
        assert bad.sum() == 1 and err <= TOL   # the finite elements still agree


def test_nan_never_passes_and_wrong_values_fail():
    want = np.array([1.0, 2.0, 3.0, 4.0])
    err, bad, summary = mismatches(np.array([1.0, np.nan, 3.0, 4.0]), want, f16, TOL)
    assert summary is not None and "NaN" in summary and bad.tolist() == [False, True, False, False]
    err, bad, summary = mismatches(np.array([1.0, 2.0, 3.0, 5.0]), want, f16, TOL)
    assert summary is not None and err > TOL and bad.tolist() == [False, False, False, True]


def test_every_float_dtype_has_its_range():
    assert f16.largest == float(np.finfo(np.float16).max)
    assert bf16.largest == float((np.array([0x7F7F0000], dtype=np.uint32)).view(np.float32)[0])
    for dtype in (f16, bf16, f32):
        assert mismatches(np.array([np.inf]), np.array([np.inf]), dtype, TOLERANCES[str(dtype)])[2] is None

"""The verifier: is a candidate mugraph equivalent to the original program? (design.md, "Verification")

Two tests, both required:

* **Finite-field tests** (`mdsl.passes.finite_field`): `tests` independent tests, each with fresh primes
  p and q, a fresh ω, fresh random oracles and fresh random inputs; both programs run exactly in the
  field and every output element must agree (p-residues). A correct rewrite always passes.
* **Float test**: both programs on the same random normal inputs (rounded to their dtypes); the original
  in float64 is the reference, the candidate runs as the GPU would, in float32 with every device tensor
  stored in its dtype. Its relative error ‖cand − ref‖ / ‖ref‖ must be within the output dtype's bound
  (`FLOAT_BOUNDS`) or within `ORIGINAL_SLACK` times the original's own error run the same way, whichever
  is larger; NaN or inf where the original is finite (in float64 and at the target precision) never
  passes. This rejects candidates that are equivalent in exact arithmetic but overflow or lose
  precision in f16.

The stated false-pass probability. Every output element of a program is a rational function of its
inputs once oracle and exp values are taken as fresh variables (the random-oracle model, and the
idealisation behind Mirage's Theorem 2). `finite_field.degrees` bounds the degrees (numerator,
denominator) of the outputs. If two outputs differ as functions, the numerator of their difference,
of degree at most d_out = max(n₁ + d₂, n₂ + d₁), is a nonzero polynomial, and by Schwartz–Zippel it
vanishes at a uniformly random point with probability at most d_out/p. The model also breaks when a
denominator vanishes or two different arguments of an oracle or exp collide at the random point; for
that we charge d_arg/q, d_arg the largest degree (numerator + denominator) of any value the programs
compute. So one test passes a non-equivalent candidate with probability at most ε = (d_out + d_arg)/q
(q < p: conservative), and independent tests multiply: Π_t min(1, ε_t). This is an estimate in that
model, not a proof for arbitrary programs: the collision charge is per value, not a union over all of
them; Mirage's rigorous form adds 8dk⁴/q + q^(−1/k²) for k-term exp sums; and identities of the
non-algebraic operators themselves are not seen (relu(x) rewritten as a max with 0 is rejected).
Degrees are bounded loosely (a sum of K terms with denominators counts K denominators even when they
are one), so ε is pessimistic: about 2·10⁻⁵ per test at the examples' small shapes, 10⁻³ at K = 4096.
"""
from __future__ import annotations

import math
from typing import Optional

import attrs
import numpy as np

from mdsl.backend.reference import run_kernel_graph
from mdsl.errors import ValidationError
from mdsl.ir.dtypes import round_to_dtype
from mdsl.ir.graph import KernelGraph
from mdsl.ir.types import Var
from mdsl.passes.finite_field import Field, degrees, run_in_field

#: Relative error allowed in the float test, by output dtype. The candidate's arithmetic is float32 and
#: every device tensor is rounded to its dtype, so the error is a few unit roundoffs u of the storage
#: dtype, amplified mildly by the computation: f32 (u = 2^-24 ≈ 6e-8; a length-K float32 dot product
#: errs by about √K·u, 4e-6 at K = 4096), f16 (u = 2^-11 ≈ 4.9e-4; ~20u covers a chain of stored
#: intermediates), bf16 (u = 2^-8 ≈ 3.9e-3; ~10u). i32 outputs come from exact float casts.
FLOAT_BOUNDS = {"f32": 1e-5, "f16": 1e-2, "bf16": 4e-2, "i32": 1e-5}
#: A candidate may also be as inaccurate as the original is at the same precision, times this.
ORIGINAL_SLACK = 4.0


@attrs.frozen
class Verification:
    equivalent: bool
    reason: str
    finite_field_tests: int            # tests run (the failing one included)
    false_pass_probability: float      # the bound on accepting a non-equivalent candidate (0 when rejected)
    float_rel_error: float = math.nan  # the float test's worst relative error (NaN when it did not run)
    float_bound: float = math.nan      # the bound it was held to

    def __bool__(self) -> bool:
        return self.equivalent


def _signature(variables, dtypes_check: bool) -> list:
    return [str(v.type) if dtypes_check else list(v.shape) for v in variables]


def _check_inputs(original: KernelGraph, candidate: KernelGraph, dtypes_check: bool) -> None:
    want, got = _signature(original.inputs, dtypes_check), _signature(candidate.inputs, dtypes_check)
    if want != got:
        raise ValidationError(f"candidate {candidate.name} takes ({', '.join(map(str, got))}) but the original "
                              f"{original.name} takes ({', '.join(map(str, want))})",
                              hint="a candidate reads the same tensors as the original, in the same order")


def _output_mismatch(original: KernelGraph, candidate: KernelGraph, dtypes_check: bool) -> Optional[str]:
    want, got = _signature(original.outputs, dtypes_check), _signature(candidate.outputs, dtypes_check)
    if want != got:
        return f"the candidate returns ({', '.join(map(str, got))}), the original ({', '.join(map(str, want))})"
    return None


def degree_bound(original: KernelGraph, candidate: KernelGraph) -> int:
    """d_out + d_arg of the module docstring: one test passes a non-equivalent candidate with
    probability at most this over q."""
    outs_a, largest_a = degrees(original)
    outs_b, largest_b = degrees(candidate)
    d_out = max(max(a[0] + b[1], b[0] + a[1]) for a, b in zip(outs_a, outs_b))
    return d_out + max(largest_a, largest_b)


def _describe(k: int, var: Var) -> str:
    return f"output {k} (%{var.name})"


def _field_test(original: KernelGraph, candidate: KernelGraph, rng: np.random.Generator) -> tuple:
    """One finite-field test: (its field, None) when every output agrees, else (field, why not)."""
    field = Field.draw(rng)
    inputs = [field.random(v.shape, rng) for v in original.inputs]
    expected, got = run_in_field(original, inputs, field), run_in_field(candidate, inputs, field)
    for k, (a, b, var) in enumerate(zip(expected, got, candidate.outputs)):
        differ = int(np.sum(a[..., 0] != b[..., 0]))
        if differ:
            return field, f"{_describe(k, var)} differs in {differ} of {a[..., 0].size} element(s)"
    return field, None


def _float_input(var: Var, rng: np.random.Generator) -> np.ndarray:
    if not var.dtype.is_float:
        return rng.integers(-8, 8, var.shape).astype(np.int32)
    return round_to_dtype(rng.standard_normal(var.shape), var.dtype).reshape(var.shape)


def _rel_error(value: np.ndarray, reference: np.ndarray, where: np.ndarray) -> float:
    """‖value − reference‖ / ‖reference‖ over the elements `where`; inf if value is not finite there."""
    value, reference = value[where], reference[where]
    if not np.all(np.isfinite(value)):
        return math.inf
    scale = float(np.linalg.norm(reference))
    diff = float(np.linalg.norm(value - reference))
    return diff / scale if scale > 0 else diff


def _float_test(original: KernelGraph, candidate: KernelGraph, rng: np.random.Generator) -> tuple:
    """(worst relative error, its bound, None) or (error, bound, why the candidate fails).

    Elements where the original itself is not finite, in float64 or at the target precision, are not
    judged: a candidate must never overflow where the original does not, and cannot be blamed where
    the original does too."""
    inputs = [_float_input(v, rng) for v in original.inputs]
    with np.errstate(all="ignore"):  # overflow is what this test looks for: it is reported, not warned
        reference = run_kernel_graph(original, inputs, precision="float64")
        own = run_kernel_graph(original, inputs, precision="float32", round_storage=True)
        got = run_kernel_graph(candidate, inputs, precision="float32", round_storage=True)
    worst = (-1.0, 0.0, 0.0)
    for k, (ref, mine, cand, var) in enumerate(zip(reference, own, got, candidate.outputs)):
        judged = np.isfinite(ref) & np.isfinite(mine)
        bound = max(FLOAT_BOUNDS[var.dtype.name], ORIGINAL_SLACK * _rel_error(mine, ref, judged))
        error = _rel_error(cand, ref, judged)
        if math.isinf(error):
            return error, bound, (f"float test: {_describe(k, var)} is inf or NaN where the original's is finite "
                                  f"(it overflows in {var.dtype.long_name})")
        if error > bound:
            return error, bound, (f"float test: {_describe(k, var)} has relative error {error:.2e}, over the "
                                  f"{bound:.2e} allowed for {var.dtype.long_name}")
        worst = max(worst, (error / bound, error, bound))
    return worst[1], worst[2], None


def verify(original: KernelGraph, candidate: KernelGraph, *, tests: int = 3, seed: int = 0,
           dtypes_check: bool = True) -> Verification:
    """Check that `candidate` computes what `original` does: `tests` finite-field tests, then the float
    test. Both graphs must read the same inputs (shapes, and dtypes with `dtypes_check`); outputs are
    compared in order. Deterministic for a given seed."""
    if tests < 1:
        raise ValueError(f"verify needs at least one finite-field test, got tests={tests}")
    _check_inputs(original, candidate, dtypes_check)
    mismatch = _output_mismatch(original, candidate, dtypes_check)
    if mismatch:
        return Verification(False, mismatch, 0, 0.0)

    *field_rngs, float_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(tests + 1))
    degree, probability = degree_bound(original, candidate), 1.0
    for t, rng in enumerate(field_rngs, 1):
        field, failure = _field_test(original, candidate, rng)
        if failure:
            return Verification(False, f"finite-field test {t} of {tests} (p = {field.p}, q = {field.q}): {failure}",
                                t, 0.0)
        probability *= min(1.0, degree / field.q)

    error, bound, failure = _float_test(original, candidate, float_rng)
    if failure:
        return Verification(False, failure, tests, 0.0, error, bound)
    return Verification(True, f"{tests} finite-field tests passed (false pass <= {probability:.1e}, degree bound "
                              f"{degree}); float relative error {error:.1e} <= {bound:.1e}",
                        tests, probability, error, bound)

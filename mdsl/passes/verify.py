"""The verifier: is a candidate mugraph equivalent to the original program? (docs/design.md, section "Verification")

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
* **Large-input float test**: the same on normal inputs scaled up by the largest of `LARGE_SCALES`
  under which the original stays finite at the target precision with `LARGE_HEADROOM` to spare in its
  outputs (none, and no such test, where no scale does). Standard-normal inputs keep attention logits
  far below exp's float32 range, so a softmax without its maximum subtracted passes the first float
  test; with Q and K scaled by 16 its logits reach the hundreds and it overflows, while the original
  (max-subtracted) and online softmax (which subtracts running maxima) stay finite.

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

Randomness. Test t's primes, ω, oracle secret and inputs come from child t of the seed's
`SeedSequence` (the float test's inputs from child `tests`, the large-input test's from `tests` + 1),
never from the candidate. So the bound holds for any candidate that is fixed independently of those
draws, even when many candidates share one seed (a search gives all of them its own seed), and the
original's side of every test (its outputs, the float tests' references, bounds and scale) is
computed once per process per (original, seed, test) and reused (`ORIGINAL_RUNS`): a candidate costs only its own evaluations.

Memory. The inputs are not kept between evaluations but drawn again from the generator's state for
each (the same values every time), so that a process holds one test's inputs at a time: int32
residues, with q-residues only where the program reads them, or float values in the narrowest type
that holds them (float16 for f16), each drawn in pieces and widened in pieces where an operator reads
it. A weight of 8192 x 8192 then costs 256 MB in the finite-field tests rather than gigabytes.
"""
from __future__ import annotations

import hashlib
import math
import os
import pickle
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import attrs
import numpy as np

from mdsl.errors import ValidationError
from mdsl.ir.graph import KernelGraph
from mdsl.passes.finite_field import Field, degrees, inputs_q_read, run_in_field
from mdsl.passes.float_check import (FLOAT_BOUNDS, LARGE_HEADROOM, LARGE_SCALES, ORIGINAL_SLACK, FloatRun,  # noqa: F401
                                     describe_output, generator, read_only)


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


def _rng(seed: int, test: int) -> np.random.Generator:
    """Test `test`'s randomness: the seed's child number `test` (the float test's is number `tests`),
    drawn from the seed alone, never from a candidate."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(test,)))


@attrs.frozen(eq=False)
class _FieldRun:
    """One finite-field test's field and the original's outputs on its inputs. The inputs are not kept:
    at large shapes they take hundreds of megabytes a test; each evaluation draws them again from
    `state`, the generator's state after the field's draws (the same residues every time)."""

    field: Field
    state: dict
    expected: list

    @classmethod
    def of(cls, original: KernelGraph, rng: np.random.Generator) -> "_FieldRun":
        field = Field.draw(rng)
        run = cls(field, rng.bit_generator.state, [])
        expected = run_in_field(original, run.inputs(original), field)
        return attrs.evolve(run, expected=read_only(expected))

    def inputs(self, graph: KernelGraph) -> list:
        """The test's inputs, as `graph` reads them: int32 residues, the q-residues only where it reads
        them (`Field.random_input`; those of the last input not even drawn, as nothing after them is)."""
        rng, last = generator(self.state), len(graph.inputs) - 1
        return [self.field.random_input(v.shape, rng, q_read, q_read or k < last)
                for k, (v, q_read) in enumerate(zip(graph.inputs, inputs_q_read(graph)))]

    def failure(self, candidate: KernelGraph) -> Optional[str]:
        """Why the candidate's outputs differ from the original's (p-residues), or None."""
        got = run_in_field(candidate, self.inputs(candidate), self.field)
        for k, (a, b, var) in enumerate(zip(self.expected, got, candidate.outputs)):
            differ = int(np.sum(a[..., 0] != b[..., 0]))
            if differ:
                return f"{describe_output(k, var)} differs in {differ} of {a[..., 0].size} element(s)"
        return None


_ELSEWHERE = object()   # a shared run that another process has claimed and not yet written
#: How long a process waits for a run that another one claimed before it makes the run itself.
SHARED_WAIT_S = 900.0


class _OriginalRuns:
    """The original's runs, made once per process for each (original, seed, test): a search verifies
    every candidate against one original with one seed, so a candidate costs only its own evaluations.
    Only one (original, seed) is kept (a search has one of each).

    Processes that `share` a directory (a search's workers) make each run once between them: the
    first to claim a run (a file created exclusively) makes it and writes it there (atomically), the
    others read it. Runs are deterministic for (original, seed, test), so whoever makes one makes the
    same run."""

    def __init__(self):
        self.key: Optional[tuple] = None
        self.runs: dict = {}
        self.hits = self.misses = 0
        self.shared: Optional[Path] = None

    def share(self, directory: Union[str, Path, None]) -> None:
        self.shared = None if directory is None else Path(directory)

    def get(self, make: Callable, original: KernelGraph, seed: int, test: int, wait: bool = True) -> Any:
        """`make(original, rng)` (_FieldRun.of, FloatRun.of or FloatRun.large) with the randomness of
        test number `test`. Without `wait`, a run that another process is making is `_ELSEWHERE`."""
        if self.key != (original.key, seed):
            self.key, self.runs = (original.key, seed), {}
        if (make, test) in self.runs:
            self.hits += 1
            return self.runs[make, test]
        run = self._make(make, original, seed, test) if self.shared is None else \
            self._shared(make, original, seed, test, wait)
        if run is not _ELSEWHERE:
            self.misses += 1
            self.runs[make, test] = run
        return run

    @staticmethod
    def _make(make: Callable, original: KernelGraph, seed: int, test: int) -> Any:
        return make(original, _rng(seed, test))

    def _shared(self, make: Callable, original: KernelGraph, seed: int, test: int, wait: bool) -> Any:
        digest = hashlib.sha256(original.key.encode()).hexdigest()[:16]
        path = self.shared / f"{digest}-{seed}-{make.__qualname__}-{test}.pickle"
        try:
            os.close(os.open(path.with_suffix(".claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # another process makes it
            if not wait:
                return _ELSEWHERE
            deadline = time.monotonic() + SHARED_WAIT_S
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            if path.exists():
                with open(path, "rb") as f:
                    return _frozen(pickle.load(f))
            return self._make(make, original, seed, test)  # it never came: make it here
        run = self._make(make, original, seed, test)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        with open(partial, "wb") as f:
            pickle.dump(run, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(partial, path)
        return run


def _frozen(run: Any) -> Any:
    """A run read back from a file, with its arrays read-only again (pickling does not keep the flag)."""
    if run is not None:
        for value in attrs.astuple(run, recurse=False):
            if isinstance(value, list):
                read_only(value)
    return run


ORIGINAL_RUNS = _OriginalRuns()


def prepare(original: KernelGraph, *, tests: int = 3, seed: int = 0) -> None:
    """Make the original's side of `verify(original, ..., tests=tests, seed=seed)` now (a search's
    worker does, while the first candidates are generated): first the runs no other process sharing
    ORIGINAL_RUNS' directory has claimed, then those the others make."""
    runs = [(_FieldRun.of, t) for t in range(tests)] + [(FloatRun.of, tests), (FloatRun.large, tests + 1)]
    for make, test in runs:
        ORIGINAL_RUNS.get(make, original, seed, test, wait=False)
    for make, test in runs:
        ORIGINAL_RUNS.get(make, original, seed, test)


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

    degree, probability = degree_bound(original, candidate), 1.0
    for t in range(tests):
        run = ORIGINAL_RUNS.get(_FieldRun.of, original, seed, t)
        failure = run.failure(candidate)
        if failure:
            return Verification(False, f"finite-field test {t + 1} of {tests} (p = {run.field.p}, q = {run.field.q}): "
                                       f"{failure}", t + 1, 0.0)
        probability *= min(1.0, degree / run.field.q)

    error, bound, failure = ORIGINAL_RUNS.get(FloatRun.of, original, seed, tests).test(candidate)
    if failure:
        return Verification(False, failure, tests, 0.0, error, bound)
    large = ORIGINAL_RUNS.get(FloatRun.large, original, seed, tests + 1)
    if large is None:
        large_note = "no input scale keeps the original finite, so no large-input test"
    else:
        large_error, large_bound, failure = large.test(candidate)
        if failure:
            return Verification(False, failure, tests, 0.0, error, bound)
        large_note = f"on inputs scaled by {large.scale:g} {large_error:.1e} <= {large_bound:.1e}"
    return Verification(True, f"{tests} finite-field tests passed (false pass <= {probability:.1e}, degree bound "
                              f"{degree}); float relative error {error:.1e} <= {bound:.1e}; {large_note}",
                        tests, probability, error, bound)

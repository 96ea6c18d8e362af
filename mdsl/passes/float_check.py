"""The float half of the verifier (mdsl.passes.verify): both programs on the same random normal inputs,
rounded to their dtypes; the original in float64 is the reference, the candidate runs as the GPU would,
in float32 with every device tensor stored in its dtype, and its relative error must stay within the
output dtype's bound. A module of its own, importing no solver: a stored plan's re-check
(mdsl.search.plan.recheck) runs it on a GPU machine too, where the search's other modules are absent."""
from __future__ import annotations

import math
from typing import Optional

import attrs
import numpy as np

from mdsl.backend.reference import run_kernel_graph
from mdsl.ir.dtypes import round_to_dtype
from mdsl.ir.graph import KernelGraph
from mdsl.ir.types import Var
from mdsl.passes.finite_field import DRAW_ELEMENTS


#: Relative error allowed in the float test, by output dtype. The candidate's arithmetic is float32 and
#: every device tensor is rounded to its dtype, so the error is a few unit roundoffs u of the storage
#: dtype, amplified mildly by the computation: f32 (u = 2^-24 ≈ 6e-8; a length-K float32 dot product
#: errs by about √K·u, 4e-6 at K = 4096), f16 (u = 2^-11 ≈ 4.9e-4; ~20u covers a chain of stored
#: intermediates), bf16 (u = 2^-8 ≈ 3.9e-3; ~10u). i32 outputs come from exact float casts.
FLOAT_BOUNDS = {"f32": 1e-5, "f16": 1e-2, "bf16": 4e-2, "i32": 1e-5}
#: A candidate may also be as inaccurate as the original is at the same precision, times this.
ORIGINAL_SLACK = 4.0
#: The large-input float test's input scales, largest first (products of two inputs grow by the square).
LARGE_SCALES = (16.0, 8.0, 4.0, 2.0)
#: Its scale must keep the original's float64 outputs this many times below the output dtype's largest
#: finite value, so that a correct candidate rounding differently does not overflow where it does not.
LARGE_HEADROOM = 64.0


def describe_output(k: int, var: Var) -> str:
    return f"output {k} (%{var.name})"


def read_only(arrays: list) -> list:
    """Cached runs serve every later verification: nothing may write into them."""
    arrays = [np.asarray(a) for a in arrays]  # (an evaluation may give a numpy scalar)
    for a in arrays:
        a.flags.writeable = False
    return arrays


def generator(state: dict) -> np.random.Generator:
    """A generator in the bit-generator state `state` (`Generator.bit_generator.state`)."""
    bits = getattr(np.random, state["bit_generator"])()
    bits.state = state
    return np.random.Generator(bits)


#: The numpy type a float test holds an input of each dtype in (float32 for those numpy has none of).
_HELD = {"f16": np.float16}


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (to nearest, ties to even) on their bits: bf16 is float32's upper half.
    The values are finite normal draws, so no NaN or infinity needs care."""
    bits = x.view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(
        np.float32)


def float_inputs(variables: tuple, state: dict, scale: float) -> list:
    """A float test's inputs: for each variable, standard normal draws (integers in [-8, 8) for an
    integer one) from the generator in `state`, times `scale` (floats only), as its dtype holds them,
    in the narrowest numpy type that holds its values exactly (`_HELD`: float16 for f16, a quarter of
    float64's memory). The draws are float32 (numpy's float32 normal generator, twice as fast as float64's)
    and `scale` a power of two, so each value is a float32 normal draw rounded once to the dtype: f16 by
    numpy's cast, bf16 on the bits (`_bf16`). Drawn in pieces of DRAW_ELEMENTS, so that no float64 copy
    of a large input is ever whole; evaluation widens them where it reads them. Every evaluation draws
    them again (a weight of 8192 x 8192 is not kept), which makes the speed of a draw count."""
    rng, out = generator(state), []
    factor = np.float32(scale)
    for var in variables:
        held = np.empty(var.shape, dtype=_HELD.get(var.dtype.name, np.float32) if var.dtype.is_float else np.int32)
        flat = held.reshape(-1)
        for start in range(0, flat.size, DRAW_ELEMENTS):
            n = min(DRAW_ELEMENTS, flat.size - start)
            if not var.dtype.is_float:
                flat[start:start + n] = rng.integers(-8, 8, n)
                continue
            draws = rng.standard_normal(n, dtype=np.float32)
            draws *= factor
            if var.dtype.name == "bf16":
                draws = _bf16(draws)
            elif var.dtype.name not in ("f16", "f32"):
                draws = round_to_dtype(draws, var.dtype)
            flat[start:start + n] = draws   # f16: numpy's cast rounds to nearest even
        out.append(held)
    return out


def rel_error(value: np.ndarray, reference: np.ndarray, where: np.ndarray) -> float:
    """‖value − reference‖ / ‖reference‖ over the elements `where`; inf if value is not finite there."""
    value, reference = value[where], reference[where]
    if not np.all(np.isfinite(value)):
        return math.inf
    scale = float(np.linalg.norm(reference))
    diff = float(np.linalg.norm(value - reference))
    return diff / scale if scale > 0 else diff


def judged_elements(reference: np.ndarray, own: np.ndarray, dtype) -> np.ndarray:
    """The elements of an output a candidate is judged on: where the original is finite in float64 and at
    the target precision (`own`), and its exact value lies below the dtype's largest value by more than the
    error a candidate is allowed there: the dtype's bound, or ORIGINAL_SLACK times the original's own error
    at that element, whichever is larger. Within that band an allowed error may round a value either side
    of the overflow (an exact 65371 is 65472 in an f16 program that rounds a sum to f16 and inf in a
    candidate that keeps it in float32; an exact 64231 that the f16 original itself computes as 63744, the
    exp of a sum rounded to f16 a few units away, may be inf in a candidate that sums in another order):
    neither rounding is wrong, so neither is held to the other."""
    with np.errstate(all="ignore"):
        exact = np.abs(np.where(np.isfinite(reference), reference, 0.0))
        own_error = np.abs(np.where(np.isfinite(own), own, 0.0) - np.where(np.isfinite(reference), reference, 0.0))
        allowed = np.maximum(FLOAT_BOUNDS[dtype.name], ORIGINAL_SLACK * np.where(exact > 0, own_error / exact, 0.0))
        roomy = exact * (1.0 + allowed) <= dtype.largest
    return np.isfinite(reference) & np.isfinite(own) & roomy


@attrs.frozen(eq=False)
class FloatRun:
    """The original's float64 outputs (the reference) on the float test's inputs, which of their elements
    are judged and the relative error each output is allowed. The inputs are not kept: each evaluation
    draws them again (`float_inputs`) from `state`, the generator's state before their draws, for the
    original's input variables `variables`.

    Elements where the original itself is not finite, in float64 or at the target precision, are not
    judged (`judged_elements`), nor those within the error allowed there of the dtype's overflow: a
    candidate must never overflow where the original does not by more than its error allows, and cannot
    be blamed where the original does too."""

    variables: tuple
    state: dict
    reference: list
    judged: list
    bounds: list
    scale: float = 1.0   # the inputs' scale: 1 in the float test, one of LARGE_SCALES in the large one

    @classmethod
    def of(cls, original: KernelGraph, rng: np.random.Generator) -> "FloatRun":
        """The float test: standard normal inputs."""
        return cls._at(original, rng.bit_generator.state, 1.0)

    @classmethod
    def large(cls, original: KernelGraph, rng: np.random.Generator) -> Optional["FloatRun"]:
        """The large-input float test: at the largest of LARGE_SCALES under which the original's outputs
        are finite at the target precision and LARGE_HEADROOM below their dtype's largest value (None
        where no scale is)."""
        state = rng.bit_generator.state

        def roomy(variables, reference) -> bool:   # finite in float64, LARGE_HEADROOM below the dtype's largest
            return all(np.all(np.isfinite(ref))
                       and np.max(np.abs(ref), initial=0.0) * LARGE_HEADROOM <= var.dtype.largest
                       for var, ref in zip(variables, reference))

        for scale in LARGE_SCALES:
            # the original at the target precision runs only where its float64 outputs qualify (at full size each
            # run costs an evaluation of the program)
            run = cls._at(original, state, scale, qualifies=lambda ref: roomy(original.outputs, ref))
            if run is not None and all(np.all(where) for where in run.judged):
                return run
        return None

    @classmethod
    def _at(cls, original: KernelGraph, state: dict, scale: float, qualifies=None) -> Optional["FloatRun"]:
        """The run at `scale`; None where `qualifies` (of the float64 outputs) says no before the target
        precision's run."""
        variables = tuple(original.inputs)
        inputs = float_inputs(variables, state, scale)
        with np.errstate(all="ignore"):  # overflow is what this test looks for: it is reported, not warned
            reference = run_kernel_graph(original, inputs, precision="float64")
            if qualifies is not None and not qualifies(reference):
                return None
            own = run_kernel_graph(original, inputs, precision="float32", round_storage=True)
        judged = [judged_elements(ref, mine, var.dtype) for var, ref, mine in zip(original.outputs, reference, own)]
        bounds = [max(FLOAT_BOUNDS[var.dtype.name], ORIGINAL_SLACK * rel_error(mine, ref, where))
                  for var, ref, mine, where in zip(original.outputs, reference, own, judged)]
        return cls(variables, state, read_only(reference), read_only(judged), bounds, scale)

    def test(self, candidate: KernelGraph) -> tuple:
        """(worst relative error, its bound, None) or (error, bound, why the candidate fails)."""
        inputs = float_inputs(self.variables, self.state, self.scale)
        with np.errstate(all="ignore"):
            got = run_kernel_graph(candidate, inputs, precision="float32", round_storage=True)
        name = "float test" if self.scale == 1.0 else f"float test on inputs scaled by {self.scale:g}"
        worst = (-1.0, 0.0, 0.0)
        for k, (ref, cand, judged, bound, var) in enumerate(zip(self.reference, got, self.judged, self.bounds,
                                                                candidate.outputs)):
            error = rel_error(cand, ref, judged)
            if math.isinf(error):
                return error, bound, (f"{name}: {describe_output(k, var)} is inf or NaN where the original's is "
                                      f"finite (it overflows in {var.dtype.long_name} or on the way there)")
            if error > bound:
                return error, bound, (f"{name}: {describe_output(k, var)} has relative error {error:.2e}, over "
                                      f"the {bound:.2e} allowed for {var.dtype.long_name}")
            worst = max(worst, (error / bound, error, bound))
        return worst[1], worst[2], None

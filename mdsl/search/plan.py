"""A plan: the mugraph a search chose for a program, with the evidence a person needs to trust it.

`str(plan)` is a header of `#` comments (cost, roofline floor, verification, search) followed by the
chosen mugraph in the textual IR, so the text parses back as that graph. `to_json`/`from_json` is
the form the plan cache stores, `content_digest` the hash it stores beside it, and `recheck` what a
plan read back from storage must pass before it is served.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Optional

import attrs
import numpy as np

from mdsl.errors import MdslError
from mdsl.ir import serialize
from mdsl.ir.graph import KernelGraph
from mdsl.ir.text import print_graph
from mdsl.search.config import SearchConfig
from mdsl.search.cost import Cost, Floor, KernelCost, estimate, roofline_floor, same_cost
from mdsl.search.records import Boundary, Family
from mdsl.search.stats import SearchStats

SCHEMA = 1
_FLOAT_EVIDENCE = ("false_pass_probability", "float_rel_error", "float_bound", "seconds")
_EXACT_EVIDENCE = {"equivalent": bool, "reason": str, "finite_field_tests": int, "seed": int}
_OPTIONAL_INT_EVIDENCE = ("parts",)


def _nan_equal(x: float) -> object:
    """Equality key of a float that may be NaN ("not measured"): NaN equals NaN."""
    return "nan" if math.isnan(x) else x


@attrs.frozen
class Evidence:
    """What the verifier found for one candidate (see mdsl.passes.verify.Verification)."""

    equivalent: bool
    reason: str
    finite_field_tests: int
    false_pass_probability: float
    float_rel_error: float = attrs.field(eq=_nan_equal)   # NaN: not measured
    float_bound: float = attrs.field(eq=_nan_equal)
    seed: int
    seconds: float = attrs.field(default=0.0, eq=False)   # verification time, which varies run to run
    parts: int = 0   # verified part by part: how many fused parts (each against its sub-program); 0: whole

    @classmethod
    def of(cls, verification: Any, seed: int, seconds: float) -> "Evidence":
        v = verification
        return cls(bool(v.equivalent), str(v.reason), int(v.finite_field_tests), float(v.false_pass_probability),
                   float(v.float_rel_error), float(v.float_bound), seed, seconds)

    @classmethod
    def failure(cls, reason: str, seed: int, seconds: float = 0.0) -> "Evidence":
        return cls(False, reason, 0, 1.0, math.nan, math.nan, seed, seconds)

    def to_json(self) -> dict:
        # strict JSON: a non-finite float is written as its repr, which float() reads back
        return {k: v if not isinstance(v, float) or math.isfinite(v) else repr(v)
                for k, v in attrs.asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> "Evidence":
        """Raises ValueError on a missing or unknown field or one of the wrong type (a flag written as
        "false" is not a bool: it would read as true)."""
        fields = attrs.fields(cls)
        names = {f.name for f in fields}
        required = {f.name for f in fields if f.default is attrs.NOTHING}
        if not isinstance(data, dict) or not required <= set(data) <= names:
            raise ValueError(f"evidence needs the fields {sorted(required)} and has no others than {sorted(names)}")
        for name, kind in _EXACT_EVIDENCE.items():
            if type(data[name]) is not kind:   # exact: a bool is an int, and neither may stand for the other
                raise ValueError(f"evidence field {name!r} must be a {kind.__name__}, got {data[name]!r}")
        for name in _FLOAT_EVIDENCE:
            if name in data and (isinstance(data[name], bool) or not isinstance(data[name], (int, float, str))):
                raise ValueError(f"evidence field {name!r} must be a number, got {data[name]!r}")
        for name in _OPTIONAL_INT_EVIDENCE:
            if name in data and type(data[name]) is not int:
                raise ValueError(f"evidence field {name!r} must be an int, got {data[name]!r}")
        return cls(**{k: float(v) if k in _FLOAT_EVIDENCE else v for k, v in data.items()})

    @property
    def is_identity(self) -> bool:
        """The evidence of the original program, which needs no verification."""
        return self.equivalent and not self.finite_field_tests and self.false_pass_probability == 0.0

    def describe(self) -> str:
        if self.is_identity:
            return "the original program itself: nothing to verify"
        if not self.finite_field_tests:
            return f"not verified ({self.reason})"
        if not self.equivalent:
            return f"not equivalent ({self.reason})"
        whole = (f" of each of its {self.parts} fused part(s) against the operators it replaces" if self.parts
                 else "")
        return (f"{self.finite_field_tests} finite-field tests{whole} (false-pass probability <= "
                f"{self.false_pass_probability:.1e}), float relative error {self.float_rel_error:.2e} "
                f"(bound {self.float_bound:.1e})")


@attrs.frozen
class Candidate:
    """A verified mugraph (or the original program) and its estimated cost."""

    graph: KernelGraph
    cost: Cost
    evidence: Evidence


@attrs.frozen
class Plan:
    original: KernelGraph
    graph: KernelGraph                 # the chosen mugraph
    cost: Cost
    floor: Floor
    evidence: Evidence
    stats: SearchStats
    alternatives: tuple                # the other verified candidates kept, best first
    config: SearchConfig
    mdsl_version: str
    cache_path: Optional[str] = attrs.field(default=None, eq=False)  # set when read from the plan cache
    explanation: tuple = ()            # Boundary: why each kernel boundary is left (mdsl.search.explain)
    family: Optional[Family] = None    # the sizes of the leading dim it serves (mdsl.search.family)

    @property
    def provisional(self) -> bool:
        """The time cap (or a dead worker) cut the search short: the plan is the best so far, not the
        search's answer, and a later `optimize` searches again (the cache serves it meanwhile)."""
        return self.stats.timed_out or bool(self.stats.by_reason("rejected").get("worker died"))

    def explain(self) -> str:
        """Why the plan's kernel boundaries are there, one line each (what would have to change to remove
        them); a plan of one kernel has none."""
        kernels = self.cost.launches
        head = f"{self.original.name}: {kernels} kernel(s), where the original launches {self.original_cost.launches}"
        if self.provisional:
            head += f" (provisional: the search's {self.config.budget_s:g} s cap cut it short)"
        if not self.explanation:
            return head + ("; no kernel boundary is left" if kernels <= 1 else "")
        return "\n".join([head + "; kernel boundaries left:"] + [f"  {b.describe()}" for b in self.explanation])

    @property
    def is_original(self) -> bool:
        return self.graph.key == self.original.key

    @property
    def chosen(self) -> Candidate:
        return Candidate(self.graph, self.cost, self.evidence)

    @property
    def original_cost(self) -> Cost:
        return estimate(self.original)

    def __str__(self) -> str:
        return self.text()

    def text(self, verbose: bool = False) -> str:
        """The header as `#` comments, then the chosen mugraph in the textual IR; `verbose`: the header
        with the search's full statistics and each alternative's cost."""
        return "\n".join([*(f"# {line}" for line in self.header(verbose)), print_graph(self.graph)])

    def header(self, verbose: bool = False) -> list:
        floor, cost, original = self.floor, self.cost, self.original_cost
        if self.is_original:
            what = "the original program (no faster equivalent mugraph was found)"
        elif cost.seconds > 0:
            what = f"{original.seconds / cost.seconds:.3g}x faster than the original ({_us(original.seconds)})"
        else:
            what = f"no kernel to launch, where the original takes {_us(original.seconds)}"
        # a program that only returns its inputs launches nothing: its estimate is 0 and no ratio exists
        reach = (f"the estimate reaches {100 * floor.seconds / cost.seconds:.3g}% of it" if cost.seconds > 0
                 else "the plan launches no kernel")
        if self.provisional:
            what += "; provisional (the search was cut short: a later optimize searches again)"
        lines = [f"mdsl {self.mdsl_version} plan for kernel {self.original.name}, {self.config.arch}: {what}",
                 f"cost:     {cost}",
                 f"floor:    {_us(floor.seconds)}, {floor.bound}-bound; {reach}",
                 f"verified: {self.evidence.describe()}",
                 f"search:   {self._search_line()}"]
        if verbose:
            lines.append(f"          {self.stats.counts_summary()}")
        if self.alternatives:
            lines.append(f"also:     {self._alternatives_line()}")
            if verbose:
                lines.append(f"          {_cost_groups(self.alternatives)}")
        if self.family is not None:
            lines.append(f"family:   {self.family.describe()}")
        if self.cache_path is not None:
            lines.append(f"cached:   {self.cache_path}")
        return lines

    def _search_line(self) -> str:
        ending = f"stopped by its {self.config.budget_s:g} s budget" if self.stats.timed_out else "finished"
        return (f"{ending} after {self.stats.elapsed_s:.1f} s (seed {self.config.seed}): "
                f"{self.stats.total('generated')} candidates, {self.stats.total('verified')} verified, "
                f"{len(self.alternatives) + 1} kept (top_k {self.config.top_k})")

    def _alternatives_line(self) -> str:
        """The other candidates kept, summarised: how many, the range of their estimates and launches."""
        n = len(self.alternatives)
        us = _span([c.cost.seconds * 1e6 for c in self.alternatives], lambda x: f"{x:.3g}")
        launches = [c.cost.launches for c in self.alternatives]
        kernels = f"{_span(launches, str)} launch{'es' if max(launches) > 1 else ''}"
        if n == 1:
            return f"1 other candidate kept, {us} us in {kernels}; the GPU autotuner times it too"
        each = "" if " to " in us + kernels else "each "
        return f"{n} other candidates kept, {each}{us} us in {kernels}; the GPU autotuner times them too"

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"mdsl_plan": SCHEMA, "mdsl_version": self.mdsl_version, "config": attrs.asdict(self.config),
                "original": serialize.to_json(self.original), "chosen": _candidate_json(self.chosen),
                "floor": attrs.asdict(self.floor), "stats": self.stats.to_json(),
                "alternatives": [_candidate_json(c) for c in self.alternatives],
                "explanation": [b.to_json() for b in self.explanation],
                "family": None if self.family is None else self.family.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        """Raises ValueError, KeyError, TypeError or an MdslError on malformed data."""
        if data.get("mdsl_plan") != SCHEMA:
            raise ValueError(f"unsupported plan schema {data.get('mdsl_plan')!r} (this mdsl reads {SCHEMA})")
        original = _kernel_graph(data["original"])
        chosen = _candidate(data["chosen"])
        return cls(original, chosen.graph, chosen.cost, Floor(**data["floor"]), chosen.evidence,
                   SearchStats.from_json(data["stats"]), tuple(_candidate(c) for c in data["alternatives"]),
                   _config(data["config"]), str(data["mdsl_version"]),
                   explanation=tuple(Boundary.from_json(b) for b in data.get("explanation", [])),
                   family=None if data.get("family") is None else Family.from_json(data["family"]))


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us"


def _span(values: list, show) -> str:
    """`low to high` of the values as `show` writes them, or the one value when they all look alike."""
    low, high = show(min(values)), show(max(values))
    return low if low == high else f"{low} to {high}"


def _cost_groups(candidates) -> str:
    """Each distinct (estimate, launches) of `candidates` once, best first, with how many share it."""
    groups: dict = {}
    for c in candidates:
        key = (_us(c.cost.seconds), c.cost.launches)
        groups[key] = groups.get(key, 0) + 1
    return ", ".join(f"{t} ({n} launch{'es' if n > 1 else ''})" + (f" x{k}" if k > 1 else "")
                     for (t, n), k in groups.items())


def mdsl_version() -> str:
    from mdsl._version import __version__

    return __version__


def content_digest(data: dict) -> str:
    """The sha256 of a plan's JSON (`Plan.to_json()`, or what a file holds in its place): its chosen
    mugraph, the evidence of every candidate, the mdsl version that verified them and the rest. Any
    change to a stored plan changes it."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# a stored plan, checked again before it is served

#: The most elements a reduced instance of a stored plan's pair of graphs may hold for its re-check.
RECHECK_ELEMENTS = 1 << 22


def recheck(plan: Plan, seed: Optional[int] = None) -> Optional[str]:
    """Why `plan`, read back from storage, must not be served as verified, or None.

    Each candidate (the chosen mugraph and every alternative: the GPU autotuner may pick any of them) must
    claim a passed verification that fits it (the original program alone needs none), read and return
    tensors of the original's types, and pass one finite-field test and the float tests
    (`mdsl.passes.float_check`: normal and scaled inputs) against the original, with randomness of its own
    (`seed`; None: fresh from the OS, so that no stored graph can be fitted to it). The test runs on a
    reduced instance of the pair where one exists (`mdsl.search.resize.reduced`: both graphs shrunk by the
    same factor per label, the same grids, loops and maps), else at full size. It re-checks what the content
    digest cannot: a plan whose computation was changed and its digest recomputed. A changed operator,
    attribute, map or wiring changes the function at the reduced sizes too, and is caught with probability
    about 1 - degree / q (q > 2^23, `mdsl.passes.verify`); a change visible only in elements a smaller
    problem lacks (a tile offset, a split point) is not, which is why the search's own verification runs at
    full size. At the reduced sizes the test costs milliseconds where a full-size one costs an evaluation of
    each program (seconds for weights of 8192 x 8192). The float tests catch what the field cannot: a change
    that keeps the rational function and breaks its numerics (a softmax's maximum added rather than
    subtracted)."""
    candidates = [("the chosen mugraph", plan.chosen)]
    candidates += [(f"alternative {i}", c) for i, c in enumerate(plan.alternatives, 1)]
    return recheck_candidates(plan.original, candidates, seed)


def repriced(plan: Plan) -> Plan:
    """`plan` with each candidate's cost (and the floor) as this mdsl's cost model estimates them. A stored
    cost is derived data, the estimate of the mdsl that searched: a revised cost model re-prices a cached
    plan's verified candidates rather than discarding them and searching again (a machine without z3 could
    not). The candidates keep the search's order: the chosen mugraph and its explanation are what the
    search's partition and verification found, and the GPU's first call times the leading candidates and
    the program as written anyway (`mdsl.backend.cuda.autotune.first_call_set`)."""
    def price(c: Candidate) -> Candidate:
        cost = estimate(c.graph)
        return c if same_cost(c.cost, cost) else attrs.evolve(c, cost=cost)

    chosen = price(plan.chosen)
    return attrs.evolve(plan, cost=chosen.cost, floor=roofline_floor(plan.original),
                        alternatives=tuple(price(c) for c in plan.alternatives))


def recheck_candidates(original: KernelGraph, candidates: list, seed: Optional[int] = None) -> Optional[str]:
    """`recheck` of stored candidates of `original` ((name, Candidate) pairs: a plan's, or the tuning
    variants stored beside it, mdsl.search.variants), or None."""
    for name, candidate in candidates:
        problem = _claim_problem(original, candidate)
        if problem:
            return f"{name} {problem}"
    return _field_problem(original, candidates, seed)


def _types(variables) -> list:
    return [str(v.type) for v in variables]


def _claim_problem(original: KernelGraph, candidate: Candidate) -> Optional[str]:
    graph, evidence = candidate.graph, candidate.evidence
    if not evidence.equivalent:
        return f"is marked not equivalent ({evidence.reason})"
    if (_types(graph.inputs), _types(graph.outputs)) != (_types(original.inputs), _types(original.outputs)):
        return "reads or returns tensors of other types than the original program"
    if graph.key != original.key and (evidence.finite_field_tests < 1
                                      or not 0.0 <= evidence.false_pass_probability <= 1.0):
        return (f"claims {evidence.finite_field_tests} finite-field test(s) with false-pass probability "
                f"{evidence.false_pass_probability!r}, which is no verification, but is not the original program")
    return None


def _field_problem(original: KernelGraph, candidates: list, seed: Optional[int]) -> Optional[str]:
    from mdsl.passes.finite_field import Field, run_in_field   # (not mdsl.passes.verify: no z3 on this path)
    from mdsl.passes.float_check import FloatRun
    from mdsl.search.resize import elements, reduced

    others = {}
    for name, candidate in candidates:
        if candidate.graph.key != original.key:
            others.setdefault(candidate.graph.key, (name, candidate.graph))
    rng = np.random.default_rng(seed)
    full_size = None   # (inputs, field, the original's outputs) at full size, made once if a pair has no reduction

    def differs(first: KernelGraph, second: KernelGraph, inputs: list, field, expected=None) -> Optional[str]:
        expected = run_in_field(first, inputs, field) if expected is None else expected
        for k, (want, got) in enumerate(zip(expected, run_in_field(second, inputs, field))):
            differ = int(np.sum(want[..., 0] != got[..., 0]))
            if differ:
                return f"its output {k} differs from the original's in {differ} of {want[..., 0].size} element(s)"
        return None

    def inexact(first: KernelGraph, second: KernelGraph) -> Optional[str]:
        # the float tests, on normal and on scaled inputs: what the field cannot see (a softmax without
        # its maximum subtracted is the same rational function, and overflows)
        for run in (FloatRun.of(first, rng), FloatRun.large(first, rng)):
            if run is not None:
                failure = run.test(second)[2]
                if failure:
                    return failure
        return None

    try:
        for name, graph in others.values():
            pair = reduced([original, graph])
            if pair is not None and sum(elements(g) for g in pair) <= RECHECK_ELEMENTS:
                field = Field.draw(rng)
                small = pair[0]
                problem = differs(small, pair[1], [field.random(v.shape, rng) for v in small.inputs], field) \
                    or inexact(small, pair[1])
                where = "on a reduced instance"
            else:
                if full_size is None:
                    field = Field.draw(rng)
                    inputs = [field.random(v.shape, rng) for v in original.inputs]
                    full_size = (inputs, field, run_in_field(original, inputs, field))
                inputs, field, expected = full_size
                problem = differs(original, graph, inputs, field, expected) or inexact(original, graph)
                where = "at full size"
            if problem:
                return f"{name} fails a re-check {where} (finite field p = {field.p}, then floats): {problem}"
    except MdslError as e:  # every verified candidate has a field semantics
        return f"a candidate cannot be evaluated in a finite field: {e.message}"
    return None


# ---------------------------------------------------------------------------------------------
# JSON of the parts

def _config(data: dict) -> SearchConfig:
    return SearchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def _candidate_json(c: Candidate) -> dict:
    return {"graph": serialize.to_json(c.graph), "cost": attrs.asdict(c.cost), "evidence": c.evidence.to_json()}


def _candidate(data: dict) -> Candidate:
    cost = dict(data["cost"])
    cost["kernels"] = tuple(KernelCost(**k) for k in cost["kernels"])
    return Candidate(_kernel_graph(data["graph"]), Cost(**cost), Evidence.from_json(data["evidence"]))


def _kernel_graph(data: dict) -> KernelGraph:
    graph = serialize.from_json(data)  # validates kernel graphs
    if not isinstance(graph, KernelGraph):
        raise ValueError(f"expected a kernel graph, got a {type(graph).__name__}")
    return graph

"""The search engine: candidate mugraphs streamed from generators, deduplicated, validated, ranked by
the cost model and verified in parallel worker processes; the best verified ones are kept.

* The original program is always a plan (ranked with the others), so a search never comes back empty.
  With the default generators, a candidate the cost model estimates no faster than the original, or
  with more kernels, is not verified: it could never be the plan (given generators, such as the tuning
  variants', have every candidate verified).
* Generators run in order (the cheap parts of a program dear to verify whole, then guided, then
  partition, then exhaustive: `DEFAULT_GENERATORS`); each candidate admitted to verification gets
  the next number, and the workers take them in that order: a dear program's cheap partial fusions
  first (a search its cap cuts still has them), then the guided generator's proposals, cheapest first. The reduced-instance screen
  (`mdsl.search.screen`) rejects a wrong candidate cheaply before its full-size tests.
* **Results do not depend on the machine's load.** What is generated depends on the work budget
  (`SearchConfig.work`: each generator's own steps, the enumerator's z3 queries counted in z3's own
  resource units, and `VERIFY_STEPS` per candidate admitted), never on time. Outcomes are merged in
  admission order whatever order the workers finish them in, and a candidate is passed over only when
  it cannot enter the top k of the candidates merged before it (a decision that more merged results
  never reverse), so that what is kept, counted and logged is the same for any number of workers and
  any speed. The wall-clock budget is a safety cap: a search it cuts
  short returns the best verified result so far, and its plan is provisional (`Plan.provisional`).
* A generator may yield a `Fallback`: a candidate verified only if the one it stands in for is not
  (decided when that one's outcome is merged, so in order too); and an `Assembly`, a candidate made of
  replaced parts, which is verified part by part (`worker.verify_parts`: each replacement against the
  sub-program it replaces; the whole is equivalent by substitution, its bound the sum of the parts'). Once MAX_REJECTED candidates of one
  structure (the same operators in the same kernels) are rejected, the others of that structure are
  not verified: an overflow or a rule that fails one of them fails them all.
* Generation yields the CPU to verification: while every worker is busy and `config.workers`
  candidates already wait, the engine waits for a worker instead of asking for more (on a machine
  with as many cores as workers, an enumerator running beside them would slow every verification).
* Every candidate is verified with one seed, config.seed, so outcomes do not depend on scheduling.
  Sharing the seed is sound: the verifier draws its randomness (primes, ω, oracles, inputs) from the
  seed alone, and candidates are produced without regard to those draws (generators never see
  verification results; the partition generator's own screens draw from another child of the seed),
  so each wrong candidate still passes with probability at most its stated bound; only independence
  between candidates is lost, which a union bound over them does not need. It also lets each worker
  compute the original's side of the tests once (`mdsl.passes.verify.ORIGINAL_RUNS`).
* When the cap runs out (less a short wind-down, so that the whole call fits in it), pending work is
  cancelled, the workers are stopped, and the best verified result so far is returned. Generators are
  only asked for their next candidate before the deadline, so they must yield (or poll
  `stats.out_of_time()`) now and then.
* The worker processes start when the first candidate goes to verification, and make the original's
  side of the tests when the first whole-program candidate does (`worker.prepare`; at large shapes its
  runs are dear): a search that verifies nothing starts no process and makes no run, and one
  that verifies only assemblies runs only their parts' originals.
* Whatever ends a search (its end, the budget, an error, KeyboardInterrupt), its workers are stopped
  and its temporary directory removed before the result or the exception leaves `search`.
* At its end the search explains the best plan's kernel boundaries (`mdsl.search.explain`) from what
  the generators recorded and what became of each candidate.
"""
from __future__ import annotations

import bisect
import concurrent.futures as cf
import contextlib
import importlib
import importlib.util
import inspect
import json
import math
import signal
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import attrs

from mdsl.errors import MdslError
from mdsl.ir.graph import KernelGraph
from mdsl.ir.validate import validate_kernel_graph
from mdsl.search import worker
from mdsl.search.cache import PlanCache
from mdsl.search.config import VERIFY_STEPS, SearchConfig
from mdsl.search.cost import Cost, estimate, gpu_estimate, roofline_floor
from mdsl.search.plan import Candidate, Evidence, Plan, mdsl_version
from mdsl.search.records import Assembly, Fallback
from mdsl.search.progress import StatusLine
from mdsl.search.stats import (DUPLICATE, ERRORS, GENERATED, INVALID, REJECTED, SKIPPED, VERIFIED,
                               SearchStats)

Generator = Callable[..., Iterable[KernelGraph]]   # generate(graph, config[, stats=...])
Progress = Union[None, bool, Callable[[SearchStats], None]]

#: (config flag, module, function): the default generators, in order
DEFAULT_GENERATORS = (("partition", "mdsl.search.partition", "generate_cheap"),
                      ("guided", "mdsl.search.guided", "generate"), ("partition", "mdsl.search.partition", "generate"),
                      ("exhaustive", "mdsl.search.enumerate", "generate"))

_MAX_PENDING = 10_000   # candidates waiting for a worker; beyond it generation waits for verification
#: Rejections of candidates of one structure (the same operators in the same kernels, under other grids
#: and loops) after which the others of that structure are not verified: what fails one of them, an
#: overflow or a rule that does not hold, fails them all.
MAX_REJECTED = 2
_POLL_S = 0.1           # the longest a wait blocks, so that the deadline and progress are noticed promptly
_STOP_GRACE_S = 2.0     # idle workers get this long to exit before they are terminated
_WIND_DOWN_S = 2.0      # kept from the budget for stopping the workers and assembling the plan, so that
                        # search() returns within budget_s of wall clock, not a second or two after


@attrs.frozen
class SearchResult:
    original: KernelGraph
    candidates: tuple        # verified Candidates, best first; never empty (the original is one)
    stats: SearchStats
    config: SearchConfig
    explanation: tuple = ()  # mdsl.search.explain.Boundary: why each kernel boundary of the best is left

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def plan(self) -> Plan:
        best, *others = self.candidates
        return Plan(self.original, best.graph, best.cost, roofline_floor(self.original), best.evidence, self.stats,
                    tuple(others), self.config, mdsl_version(), explanation=self.explanation)


class SearchUnavailable(MdslError):
    """`optimize` needs a search of the default generators and this machine cannot run it (a module it
    needs is not installed), and the plan cache has no plan for the program."""


def has_z3() -> bool:
    """Whether z3 (which the exhaustive generator needs) can be imported here."""
    try:
        return importlib.util.find_spec("z3") is not None
    except (ImportError, ValueError):   # a finder that refuses it, or a module entry without a spec
        return False


def search_unavailable(config: Optional[SearchConfig] = None) -> Optional[str]:
    """Why the default search (of `config`, default: the default config) cannot run on this machine, or
    None. The exhaustive generator needs z3; a search without it finds other plans than its cache key
    promises (the key names the config, whose generators include it), so `optimize` does not run one. A
    config without the exhaustive generator needs no z3."""
    if (config is not None and not config.exhaustive) or has_z3():
        return None
    return "z3-solver, which the exhaustive generator needs, is not installed"


def default_generators(config: SearchConfig) -> list:
    """The generators that exist, of those the config enables, in `DEFAULT_GENERATORS` order."""
    out = []
    for flag, module, function in DEFAULT_GENERATORS:
        if not getattr(config, flag):
            continue
        try:
            out.append(getattr(importlib.import_module(module), function))
        except ModuleNotFoundError as e:
            if e.name == "z3":  # e.g. a GPU machine without z3-solver: search with the other generators
                warnings.warn(f"mdsl search: {module} needs z3-solver, which is not installed; skipping it",
                              stacklevel=2)
            elif e.name != module:  # the module exists but something it imports does not
                raise
    return out


def default_verifier() -> Callable:
    from mdsl.passes.verify import verify

    return verify


def search(graph: KernelGraph, config: SearchConfig = SearchConfig(), *, generators: Optional[Sequence[Generator]] = None,
           verifier: Optional[Callable] = None, progress: Progress = None,
           log_path: Union[str, Path, None] = None) -> SearchResult:
    """Search for verified mugraphs equivalent to `graph`, best first.

    `generators`: functions `generate(graph, config) -> Iterator[KernelGraph]` (those that take a
    `stats` keyword are handed the search's SearchStats); default: `default_generators(config)`.
    `verifier`: `verify(original, candidate, *, tests, seed)` as mdsl.passes.verify.verify (the
    default); it runs in worker processes, so it must be picklable (a module-level function).
    `progress`: True (a status line on stderr, `mdsl.search.progress.StatusLine`), False (none), None (the
    default: a status line when stderr is a terminal) or a callable given the SearchStats.
    `log_path`: a file the search appends its events to, as JSON lines.
    """
    validate_kernel_graph(graph)
    planning = generators is None   # looking for a plan: what cannot beat the original is not verified
    generators = default_generators(config) if generators is None else list(generators)
    verifier = default_verifier() if verifier is None else verifier
    with _EventLog(log_path, graph.name) as log:
        return _Search(graph, config, verifier, _display(progress), log, planning).run(generators)


def optimize(graph: KernelGraph, config: SearchConfig = SearchConfig(), *, cache: Union[bool, PlanCache] = True,
             generators: Optional[Sequence[Generator]] = None, verifier: Optional[Callable] = None,
             progress: Progress = None, log_path: Union[str, Path, None] = None) -> Plan:
    """The plan for `graph`: from the plan cache (`cache`: True for the default location, False for
    none, or a PlanCache), else re-targeted from a plan of the same program at another size of its
    leading dim (`mdsl.search.family`, default searcher only), else from a `search`, then stored in
    the cache. A provisional plan (its search was cut short by the time cap) is searched again, and
    kept beside the new search's candidates where that one is cut short too. Where the default search
    cannot run (`search_unavailable`), a provisional plan is served as it is, and a program without a
    plan raises SearchUnavailable at once."""
    default = generators is None and verifier is None
    store = PlanCache() if cache is True else cache or None
    if store is None:
        return _with_family(search(graph, config, generators=generators, verifier=verifier, progress=progress,
                                   log_path=log_path).plan(), default)
    searcher = _searcher_identity(generators, verifier)
    key = store.key(graph, config, searcher=searcher)
    family = store.family_key(graph, config, searcher)
    plan = store.load(key, graph)
    unavailable = search_unavailable(config) if generators is None else None
    if plan is not None and (not plan.provisional or unavailable):
        with _EventLog(log_path, graph.name) as log:
            log.write("cache_hit", path=plan.cache_path)
        return plan
    if plan is None and default:
        member = _family_member(store, family, graph, searcher)
        if member is not None:
            with _EventLog(log_path, graph.name) as log:
                log.write("family_hit", source_size=member.family.source, size=member.family.size)
            store.store(key, member)
            return member
    if unavailable:
        raise SearchUnavailable(f"kernel {graph.name}: the plan cache {store.root} has no plan for it, and the "
                                f"search cannot run here: {unavailable}",
                                hint="pip install z3-solver, or carry a plan cache made where it is installed "
                                     "(MDSL_CACHE_DIR; `mdsl cache check` it once)")
    found = search(graph, config, generators=generators, verifier=verifier, progress=progress,
                   log_path=log_path).plan()
    if plan is not None and found.provisional:
        found = _merged(found, plan)
    found = _with_family(found, default)
    store.store(key, found)
    if default and not found.provisional and found.family is not None:
        store.add_member(family, key)
    return found


def _with_family(plan: Plan, default: bool) -> Plan:
    """The plan with the sizes of its family it re-targets to (the default searcher's plans only)."""
    if not default:
        return plan
    from mdsl.search.family import family_of

    return attrs.evolve(plan, family=family_of(plan))


def _family_member(store: PlanCache, family: str, graph: KernelGraph, searcher: dict) -> Optional[Plan]:
    """A plan of the program at another size re-targeted to `graph` and verified there, or None."""
    for key in reversed(store.members(family)):
        member = store.load_key(key, searcher)
        if member is not None and member.family is not None and not member.provisional:
            plan = _retargeted(member, graph)
            if plan is not None:
                return plan
    return None


def _retargeted(member: Plan, graph: KernelGraph) -> Optional[Plan]:
    """`member`'s chosen mugraph re-targeted to `graph` (`mdsl.search.family.retarget`) and verified at
    that size with the member's seed and tests (the original kept as the alternative), or None."""
    from mdsl.search.family import member_family, retarget

    chosen = retarget(member, graph)
    if chosen is None:
        return None
    start = time.perf_counter()
    config = member.config
    itself = Evidence(True, "the original program itself", 0, 0.0, math.nan, math.nan, config.seed)
    stats = SearchStats(done=True)
    if chosen.key == graph.key:
        evidence, alternatives = itself, ()
    else:
        evidence = Evidence.of(default_verifier()(graph, chosen, tests=config.verify_tests, seed=config.seed),
                               config.seed, time.perf_counter() - start)
        if not evidence.equivalent:
            return None
        stats.count(VERIFIED)
        alternatives = (Candidate(graph, estimate(graph), itself),)
    stats.elapsed_s = time.perf_counter() - start
    return Plan(graph, chosen, estimate(chosen), roofline_floor(graph), evidence, stats, alternatives, config,
                member.mdsl_version, explanation=member.explanation,
                family=member_family(member, graph.outputs[0].shape[0]))


def _merged(new: Plan, old: Plan) -> Plan:
    """A provisional plan with the verified candidates of an earlier provisional one added (each was
    verified with the same seed and tests), best first, at most top_k."""
    kept = {c.graph.key: c for c in (new.chosen, *new.alternatives)}
    for c in (old.chosen, *old.alternatives):
        kept.setdefault(c.graph.key, c)
    best, *others = in_final_order(sorted(kept.values(), key=lambda c: _rank(c.cost, c.graph.key,
                                                                              c.graph.key == new.original.key)),
                                   new.original.key)
    explanation = new.explanation if best.graph.key == new.graph.key else old.explanation
    return attrs.evolve(new, graph=best.graph, cost=best.cost, evidence=best.evidence,
                        alternatives=tuple(others[:new.config.top_k - 1]), explanation=explanation)


def cache_location(graph: KernelGraph, config: SearchConfig = SearchConfig(), *,
                   cache: Union[bool, PlanCache] = True, generators: Optional[Sequence[Generator]] = None,
                   verifier: Optional[Callable] = None) -> Optional[Path]:
    """The file in which `optimize` (same arguments) keeps the plan for `graph` (None: no cache). It
    exists once a plan is stored there."""
    entry = _cache_entry(graph, config, cache, generators, verifier)
    return None if entry is None else entry[0].path(entry[1])


def cached_plan(graph: KernelGraph, config: SearchConfig = SearchConfig(), *, cache: Union[bool, PlanCache] = True,
                generators: Optional[Sequence[Generator]] = None,
                verifier: Optional[Callable] = None) -> Optional[Plan]:
    """The plan `optimize` would answer from the plan cache (same arguments), or None where it would
    search. Searches nothing."""
    entry = _cache_entry(graph, config, cache, generators, verifier)
    return None if entry is None else entry[0].load(entry[1], graph)


def _cache_entry(graph: KernelGraph, config: SearchConfig, cache: Union[bool, PlanCache],
                 generators: Optional[Sequence[Generator]], verifier: Optional[Callable]) -> Optional[tuple]:
    """(the plan cache, the key of `graph`'s entry there) as `optimize` would use them, or None: no cache."""
    store = PlanCache() if cache is True else cache or None
    if store is None:
        return None
    return store, store.key(graph, config, searcher=_searcher_identity(generators, verifier))


# ---------------------------------------------------------------------------------------------
# the search itself

class _Search:
    def __init__(self, original: KernelGraph, config: SearchConfig, verifier: Callable,
                 progress: Optional[Callable], log: "_EventLog", planning: bool = False):
        self.original, self.config, self.verifier, self.progress, self.log = original, config, verifier, progress, log
        self.planning = planning       # skip what cannot beat the original (given generators: verify all)
        self.start = log.start
        # every count refreshes the progress display (at most every _POLL_S), so that it moves
        # while a generator works between two candidates
        wind_down = min(_WIND_DOWN_S, 0.1 * config.budget_s)
        self.original_cost = estimate(original)
        self.stats = SearchStats(deadline=self.start + config.budget_s - wind_down, listener=self._report,
                                 work_limit=config.work, kernel=original.name, budget_s=config.budget_s,
                                 original_seconds=self.original_cost.seconds)
        self.signature = _signature(original)
        self.seen = {original.key}
        self.admitted = 0              # candidates admitted to verification so far: the next one's number
        self.pending: list = []        # admitted, not yet submitted: _Entry, in admission order
        self.in_flight: dict = {}      # future -> _Entry
        self.done: dict = {}           # number -> (_Entry, outcome): not yet merged
        self.merged = 0                # candidates merged so far, in admission order
        self.verify_spent = False      # the verification allowance is spent: no more candidates
        self.kept: list = []           # sorted ranks of the best verified candidates, at most top_k
        self.verified: dict = {}       # key -> Candidate, for the kept ranks
        self.outcomes: dict = {}       # key -> what became of a candidate (for the plan's explanation)
        self.rejected: dict = {}       # structure -> its candidates rejected (merged so far)
        self.broken = False            # a worker died: no more verification
        self.shared_dir = ""           # the workers' runs of the original
        self.executor: Optional[cf.ProcessPoolExecutor] = None
        self.prepared = False          # the workers were asked to make the original's runs
        self._last_progress = self.start
        self._generating = False       # inside a generator's step: its counts may merge and submit (`_pump`)
        self._pumping = False

    def run(self, generators: list) -> SearchResult:
        self.log.write("start", key=self.original.key, cost_s=self.original_cost.seconds,
                       floor_s=roofline_floor(self.original).seconds, generators=[_name(g) for g in generators],
                       config={**self.config.cache_fields(), "workers": self.config.workers})
        shared = tempfile.TemporaryDirectory(prefix="mdsl-original-runs-")  # the workers' runs of the original
        stream = self._stream(generators)
        self.shared_dir = shared.name
        finished = False
        try:  # whatever ends the search (its end, the budget, an error, Ctrl-C), no worker or file outlives it
            with _signals_held():
                worker.start_server()   # it preloads mdsl while the generators work
            self._start_with_original()
            self._generate_and_verify(stream)
            finished = True
        finally:
            try:
                stream.close()
            finally:
                if self.executor is not None:
                    calm = finished and not (self.in_flight or self.stats.timed_out)
                    _stop_workers(self.executor, _STOP_GRACE_S if calm else 0.0)
                shared.cleanup()
        return self._finish()

    def _generate_and_verify(self, stream: Iterator) -> None:
        generating = True
        while not self.stats.out_of_time():
            self._collect([f for f in self.in_flight if f.done()])
            self._merge()
            self._fill()
            if generating and not self.broken and not self.verify_spent and len(self.pending) < self._pending_limit():
                generating = self._pull(stream)
            elif self.in_flight:
                self._collect(self._wait())
            else:  # nothing to generate or wait for; work is left pending only when a worker died
                self.stats.count(SKIPPED, "worker died", len(self.pending))
                self._merge(final=True)
                return
            self._report()
        self.stats.timed_out = True
        self._collect([f for f in self.in_flight if f.done()])   # verified before the cap: it counts
        self._merge(final=True)   # what was verified counts, in admission order; the rest is cut
        for entry in (*self.pending, *self.in_flight.values()):
            self.outcomes[entry.key] = "the search's time cap ran out before it was verified"
        self.stats.count(SKIPPED, "budget", len(self.pending) + len(self.in_flight))

    def _pending_limit(self) -> int:
        """How many candidates may wait before generation pauses: a worker's worth each once all are busy."""
        return self.config.workers if len(self.in_flight) >= self.config.workers else _MAX_PENDING

    def _wait(self) -> set:
        timeout = max(0.0, min(_POLL_S, self.stats.deadline - time.monotonic()))
        done, _ = cf.wait(self.in_flight, timeout=timeout, return_when=cf.FIRST_COMPLETED)
        return done

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        self.stats.elapsed_s = now - self.start
        if force or now - self._last_progress >= _POLL_S:
            self._last_progress = now
            self._pump()
            if self.progress is not None:
                self.progress(self.stats)

    def _pump(self) -> None:
        """While a generator works between two candidates (it counts as it goes, and each count reports):
        the finished verifications merged and the waiting candidates given to free workers, so that a
        long enumeration neither idles the workers nor holds back what they verified. Merging and
        submitting follow admission order wherever they happen, so the result is the same. Only a
        generator's step pumps: a count made while a merge or a submission is half done (they count
        too) must not start another, which would merge later candidates before the earlier one is kept."""
        if not self._generating or self._pumping:
            return
        self._pumping = True
        try:
            self._collect([f for f in self.in_flight if f.done()])
            self._merge()
            self._fill()
        finally:
            self._pumping = False

    def _finish(self) -> SearchResult:
        self.stats.done = True
        self._report(force=True)
        candidates = in_final_order(tuple(self.verified[_key(rank)] for rank in self.kept), self.original.key)
        # imported here: explain reads the partition generator's records, and a plan served from the cache
        # (the GPU's read path) imports no generator
        from mdsl.search import explain
        explanation = explain.boundaries(self.original, candidates[0].graph, self.stats, self.outcomes)
        self.log.write("done", timed_out=self.stats.timed_out, best=candidates[0].graph.key,
                       best_cost_s=candidates[0].cost.seconds, kept=[c.graph.key for c in candidates],
                       stats=self.stats.to_json())
        return SearchResult(self.original, candidates, self.stats, self.config, explanation)

    # -- candidates in ---------------------------------------------------------------------------

    def _stream(self, generators: list) -> Iterator[tuple]:
        """(generator number, generator name, candidate) from each generator in turn; one that raises is
        reported and skipped."""
        for number, gen in enumerate(generators):
            name = _name(gen)
            candidates: Iterator = iter(())
            try:
                candidates = iter(_call(gen, self.original, self.config, self.stats))
                for candidate in candidates:
                    self.stats.count(GENERATED, name)
                    yield number, name, candidate
            except Exception as e:  # a generator's bug costs its candidates, not the search
                self.stats.count(ERRORS, name)
                self.log.write("generator_error", generator=name, error=f"{type(e).__name__}: {e}")
                warnings.warn(f"mdsl search: generator {name} raised {type(e).__name__}: {e}", stacklevel=2)
            finally:
                getattr(candidates, "close", lambda: None)()  # a stopped search closes its generator

    def _pull(self, stream: Iterator) -> bool:
        self._generating = True
        try:
            item = next(stream, None)
        finally:
            self._generating = False
        if item is None:
            return False
        self._admit(*item)
        return True

    def _admit(self, number: int, name: str, candidate) -> None:
        primary, parts = None, ()
        if isinstance(candidate, Assembly):
            candidate, primary, parts = candidate.graph, candidate.primary, tuple(candidate.parts)
        elif isinstance(candidate, Fallback):
            candidate, primary = candidate.graph, candidate.primary
        if not isinstance(candidate, KernelGraph):
            self._invalid(name, None, "not a kernel graph", type(candidate).__name__)
        elif candidate.key in self.seen:
            self.stats.count(DUPLICATE, name)
        else:
            self.seen.add(candidate.key)
            self._rank_valid(number, name, candidate, primary, parts)

    def _rank_valid(self, number: int, name: str, candidate: KernelGraph, primary: Optional[str] = None,
                    parts: tuple = ()) -> None:
        key = candidate.key
        try:
            validate_kernel_graph(candidate)
        except MdslError as e:
            self._invalid(name, key, type(e).__name__, str(e))
            return
        if _signature(candidate) != self.signature:
            self._invalid(name, key, "signature", "its inputs or outputs differ from the original's")
            return
        cost = estimate(candidate)
        self.log.write("candidate", generator=name, key=key, cost_s=cost.seconds, launches=cost.launches)
        worse = _worse_than(cost, self.original_cost) if self.planning else None
        if worse:   # it could never be the plan, and a full-size verification is dear
            self.stats.count(SKIPPED, worse)
            self.outcomes[key] = (f"the cost model estimates it at {cost.seconds * 1e6:.3g} us in {cost.launches} "
                                  f"kernel(s), the original at {self.original_cost.seconds * 1e6:.3g} us in "
                                  f"{self.original_cost.launches}")
            return
        if not self.stats.work("verify", VERIFY_STEPS):
            self.verify_spent = True
            self.stats.count(SKIPPED, "work budget")
            self.outcomes[key] = "the search's work budget ran out before it was verified"
            return
        self.pending.append(_Entry(self.admitted, _rank(cost, key), cost,
                                   attrs.evolve(candidate, name=self.original.name), primary, _structure(candidate),
                                   parts))
        self.admitted += 1

    def _invalid(self, name: str, key: Optional[str], reason: str, detail: str) -> None:
        self.stats.count(INVALID, reason)
        self.log.write("invalid", generator=name, key=key, reason=reason, detail=detail)

    # -- verification ----------------------------------------------------------------------------

    def _start_with_original(self) -> None:
        """The original is a plan from the start; it needs no verification (it is the program)."""
        key, cost = self.original.key, self.original_cost
        rank = _rank(cost, key, original=True)
        itself = Evidence(True, "the original program itself", 0, 0.0, math.nan, math.nan, self.config.seed)
        self._keep(rank, Candidate(self.original, cost, itself))

    def _cannot_reach(self, entry: "_Entry") -> Optional[str]:
        """Why a candidate need not be verified, or None: it is out of the top k already kept, or its
        structure's first MAX_REJECTED candidates were rejected. Decided on the candidates merged so far
        (a prefix of the admission order), it stays so once more are merged: the k-th kept rank only
        improves, and rejections only add up."""
        if len(self.kept) >= self.config.top_k and entry.rank > self.kept[-1]:
            return _CANNOT_REACH
        if self.rejected.get(entry.structure, 0) >= MAX_REJECTED:
            return _REJECTED_BEFORE
        return None

    def _fill(self) -> None:
        """Submit waiting candidates in admission order while a worker is free; a fallback waits until
        its primary's outcome is merged, and is verified only if the primary was not."""
        at = 0
        while at < len(self.pending) and len(self.in_flight) < self.config.workers and not self.broken:
            entry = self.pending[at]
            if entry.primary is not None:
                outcome = self.outcomes.get(entry.primary)
                if outcome is None:   # not merged yet: the candidates after it may go first
                    at += 1
                    continue
                if outcome == "verified":
                    del self.pending[at]
                    self.done[entry.number] = (entry, _NOT_NEEDED)
                    continue
            del self.pending[at]
            passed_over = self._cannot_reach(entry)
            if passed_over:
                self.done[entry.number] = (entry, passed_over)
                continue
            self._submit(entry)

    def _submit(self, entry: "_Entry") -> None:
        if self.executor is None:  # the first candidate: now the workers are worth their cost
            self.executor = _start_workers(self.config, self.verifier, self.original, self.shared_dir)
        prepare = not entry.parts and not self.prepared
        if prepare:  # the first whole-program candidate: now the original's runs are worth their cost
            self.prepared = True
            # This may start the first worker: a wait for the forkserver to have preloaded mdsl, which a
            # signal may cut short (not held: it can take seconds). A worker the server forks after
            # that ends when this process does (each worker watches it).
            self.executor.submit(worker.prepare)
        with _signals_held():  # the other submissions may start workers, which must not be cut short
            for _ in range(self.config.workers - 1 if prepare else 0):
                self.executor.submit(worker.prepare)
            if entry.parts:
                pairs = [(worker.graph_text(sub), worker.graph_text(replacement)) for sub, replacement in entry.parts]
                future = self.executor.submit(worker.verify_parts, pairs, self.config.verify_tests, self.config.seed)
            else:
                future = self.executor.submit(worker.verify, worker.graph_text(entry.graph), self.config.verify_tests,
                                              self.config.seed)
        self.in_flight[future] = entry

    def _collect(self, done: Iterable) -> None:
        for future in done:
            entry = self.in_flight.pop(future)
            try:
                evidence, pid = future.result()
            except BrokenProcessPool as e:
                self._worker_died(e)
                self.done[entry.number] = (entry, _DIED)
                continue
            self.done[entry.number] = (entry, (evidence, pid))

    def _merge(self, final: bool = False) -> None:
        """Take the finished candidates' outcomes in admission order, whatever order the workers finished
        them in, so that what is kept, counted and logged does not depend on it. `final`: also those
        after a gap (candidates the search no longer waits for)."""
        order = sorted(self.done) if final else []
        while self.merged in self.done or order:
            number = self.merged if self.merged in self.done else order[0]
            entry, outcome = self.done.pop(number)
            if order:
                order.remove(number)
            self.merged = number + 1
            passed_over = outcome if outcome in (_CANNOT_REACH, _REJECTED_BEFORE) else self._cannot_reach(entry)
            if outcome is _NOT_NEEDED:
                self.stats.count(SKIPPED, "its first choice was verified")
                self.outcomes[entry.key] = "a candidate it stands in for was verified"
            elif passed_over is _CANNOT_REACH:
                self.stats.count(SKIPPED, "cannot reach the top k")
                self.outcomes[entry.key] = "verified candidates the cost model ranks higher fill the top k"
            elif passed_over is _REJECTED_BEFORE:
                self.stats.count(SKIPPED, _REJECTED_BEFORE)
                self.outcomes[entry.key] = (f"not verified: {MAX_REJECTED} candidates of its structure (the same "
                                            "operators in each kernel) failed verification")
            elif outcome is _DIED:
                self.stats.count(REJECTED, "worker died")
                self.outcomes[entry.key] = "a worker process died before it was verified"
                self.log.write("rejected", key=entry.key, cost_s=entry.cost.seconds, reason="worker died")
            else:
                evidence, pid = outcome
                if not evidence.equivalent:
                    self.rejected[entry.structure] = self.rejected.get(entry.structure, 0) + 1
                self._verified(entry.rank, Candidate(entry.graph, entry.cost, evidence), pid)

    def _worker_died(self, error: Exception) -> None:
        if not self.broken:
            warnings.warn(f"mdsl search: a worker process died ({error}); returning the best plan so far",
                          stacklevel=3)
        self.broken = True

    def _verified(self, rank: tuple, candidate: Candidate, pid: int) -> None:
        key, evidence = _key(rank), candidate.evidence
        event = dict(key=key, cost_s=candidate.cost.seconds, verify_s=evidence.seconds, worker=pid,
                     evidence=evidence.to_json())
        if evidence.equivalent:
            self.stats.count(VERIFIED)
            self.outcomes[key] = "verified"
            self.log.write("verified", original=False, **event)
            self._keep(rank, candidate)
        else:
            self.stats.count(REJECTED, evidence.reason)
            self.outcomes[key] = f"verification rejected it: {evidence.reason}"
            self.log.write("rejected", reason=evidence.reason, **event)

    def _keep(self, rank: tuple, candidate: Candidate) -> None:
        bisect.insort(self.kept, rank)
        self.verified[_key(rank)] = candidate
        for dropped in self.kept[self.config.top_k:]:
            del self.verified[_key(dropped)]
        del self.kept[self.config.top_k:]
        if self.kept[0] == rank:
            self.stats.best_seconds = candidate.cost.seconds
            self.log.write("new_best", key=_key(rank), cost_s=candidate.cost.seconds, launches=candidate.cost.launches)


@attrs.frozen
class _Entry:
    """A candidate admitted to verification: its number in admission order, rank, cost and graph."""

    number: int
    rank: tuple
    cost: Cost
    graph: KernelGraph
    primary: Optional[str] = None   # a fallback's: verified only if this candidate is not
    structure: tuple = ()           # `_structure` of its graph
    parts: tuple = ()               # an assembly's (sub-program, replacement) pairs: verified part by part

    @property
    def key(self) -> str:
        return _key(self.rank)


_CANNOT_REACH = "cannot reach the top k"   # outcomes of a candidate that was not verified
_NOT_NEEDED = "its primary was verified"
_REJECTED_BEFORE = "candidates of its structure were rejected"
_DIED = "worker died"


def _structure(graph: KernelGraph) -> tuple:
    """A mugraph's operators kernel by kernel (a custom kernel's block operators sorted, casts left out):
    what candidates lifted under other grids and loops share."""
    return tuple((n.op, tuple(sorted(m.op for m in n.body.nodes if m.op != "cast"))) if n.body is not None
                 else (n.op, ()) for n in graph.nodes)


def _worse_than(cost: Cost, original: Cost) -> Optional[str]:
    """Why a candidate can never be a plan, by the cost model (the original, always kept, beats it), or None."""
    if cost.launches > original.launches:
        return "more kernels than the original"
    if cost.seconds >= original.seconds:
        return "no faster than the original (estimate)"
    return None


# ---------------------------------------------------------------------------------------------
# helpers

def in_final_order(candidates: Sequence[Candidate], original_key: str) -> tuple:
    """The kept candidates (best first by `_rank`) in the plan's order: the fused ones by the finer model of
    the GPU (`cost.gpu_estimate`: waves, the serial chain of loop iterations, the bytes in flight, spills),
    which tells apart what `estimate` ranks alike (one structure under other loop lengths and splits: a
    split-KV loop of 32 iterations and one of 8 move the same bytes and flops, but not in the same time),
    their rank breaking ties; the program as written last (every fused candidate kept is estimated faster
    than it)."""
    place = {c.graph.key: k for k, c in enumerate(candidates)}
    return tuple(sorted(candidates, key=lambda c: (c.graph.key == original_key,
                                                   gpu_estimate(c.graph, skinny=True).seconds, place[c.graph.key])))


def _rank(cost: Cost, key: str, original: bool = False) -> tuple:
    """The order of candidates: Cost's own order, then the original before an equal-cost candidate,
    then the structural key, so that no two ranks are equal (plain values: ties are total)."""
    return cost.seconds, cost.dram_bytes, cost.launches, cost.smem_bytes, not original, key


def _key(rank: tuple) -> str:
    return rank[-1]


def _signature(graph: KernelGraph) -> tuple:
    return tuple(v.type for v in graph.inputs), tuple(v.type for v in graph.outputs)


def _name(gen: Generator) -> str:
    """A generator's short name: its module's for a module-level `generate` (guided, enumerate)."""
    name = getattr(gen, "__name__", type(gen).__name__)
    module = getattr(gen, "__module__", None)
    return module.rpartition(".")[2] if name == "generate" and module else name


def _qualified_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _searcher_identity(generators: Optional[Sequence[Generator]], verifier: Optional[Callable]) -> dict:
    """What, besides the config, decides a search's result: part of the plan cache's key."""
    return {"generators": "default" if generators is None else [_qualified_name(g) for g in generators],
            "verifier": "default" if verifier is None else _qualified_name(verifier)}


def _call(gen: Generator, graph: KernelGraph, config: SearchConfig, stats: SearchStats) -> Iterable:
    try:
        params = inspect.signature(gen).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: call it plainly
        params = ()
    takes_stats = any(p.name == "stats" or p.kind is p.VAR_KEYWORD for p in params)
    return gen(graph, config, stats=stats) if takes_stats else gen(graph, config)


def _display(progress: Progress) -> Optional[Callable]:
    """The progress display `progress` asks for: None, a status line when stderr is a terminal (so that a
    search started by hand shows one, and one inside a test suite, a pipe or a log is silent)."""
    if progress is None:
        progress = sys.stderr.isatty()
    if progress is True:
        return StatusLine()
    return progress or None


def _start_workers(config: SearchConfig, verifier: Callable, original: KernelGraph,
                   shared_dir: str) -> cf.ProcessPoolExecutor:
    return cf.ProcessPoolExecutor(max_workers=config.workers, mp_context=worker.context(), initializer=worker.init,
                                  initargs=(verifier, worker.graph_text(original), shared_dir, config.verify_tests,
                                            config.seed))


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Meanwhile SIGINT and SIGTERM are recorded, not handled, and raised again when it ends (main
    thread only; dispositions set outside Python, or ignored, are left alone). A worker whose start a
    signal cuts short is known to no one who could stop it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list = []
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if handler is not None and handler is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, lambda number, frame: held.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


def _stop_workers(executor: cf.ProcessPoolExecutor, grace_s: float) -> None:
    """Cancel pending work and end the workers: idle ones exit within `grace_s`, the rest are
    terminated (a verification cannot be interrupted otherwise), and killed if that does not end them
    within a second. Every wait is bounded."""
    processes = list((executor._processes or {}).values())  # no public handle before Python 3.14
    if grace_s > 0:  # idle workers exit when the executor asks them to
        executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + grace_s
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
    for stop in ("terminate", "kill"):
        running = [p for p in processes if p.is_alive()]
        for p in running:
            getattr(p, stop)()
        deadline = time.monotonic() + 1.0
        for p in running:
            p.join(max(0.0, deadline - time.monotonic()))
    # after the workers have ended: a worker still starting would fail to open the executor's
    # semaphores, which shutting it down removes, and say so on stderr
    executor.shutdown(wait=False, cancel_futures=True)


class _EventLog:
    """JSON lines, one event each, appended to a file (nothing without a path)."""

    def __init__(self, path: Union[str, Path, None], kernel: str):
        self.start = time.monotonic()
        self.kernel = kernel
        # line-buffered, so that `tail -f` shows each event as it happens
        self.file = open(path, "a", encoding="utf-8", buffering=1) if path is not None else None

    def write(self, event: str, **fields) -> None:
        if self.file is not None:
            record = {"event": event, "t": round(time.monotonic() - self.start, 6), "kernel": self.kernel, **fields}
            self.file.write(json.dumps(record, allow_nan=False) + "\n")

    def __enter__(self) -> "_EventLog":
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()

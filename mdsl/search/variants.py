"""Tuning variants of a plan: the plan's fused mugraph derived again under other split factors, verified,
for the GPU autotuner to time.

A search keeps the few candidates its cost model ranks first, and those share nearly one grid. On a GPU
the grid decides much: blocks against 132 SMs (waves), serial loop iterations per block, bytes in
flight per SM, blocks resident per SM. So, from a plan:

1. find the guided *choice* (`mdsl.search.guided.Choice`) that lifts the original program to the plan's
   chosen mugraph (else to its best alternative that has one);
2. lift the original under every choice of a widened space (more splits of the loop label, loops of
   one iteration) with the same loop label, keeping the mugraphs of the same structure: the same
   block-graph ops per kernel as the choice unsplit (a split variant adds a combine kernel, and an
   accumulator's `split` rule may change its ops: accum_rms becomes means of squares and a root);
   where the loop label is only contracted (a GEMV's k) split-K and unsplit variants both qualify;
3. rank them with `mdsl.search.cost.gpu_estimate` and pick up to K diverse ones (round robin over
   (blocks, split) groups; split-K and unsplit half each, the shapes measured to pay first);
4. verify them through the search engine (`engine.search` with these as its only generator: the same
   workers, seed, finite-field and float tests as every searched candidate), keeping the verified ones
   with their evidence.

The result is stored beside the plan in the plan cache, `<root>/variants/<plan key>.json`, written
atomically with a content digest and validated when read as a plan is (bounded read, digest, every
variant's claims, and a re-check of each against the original (finite field and floats):
`mdsl.search.plan.recheck`; the GPU autotuner may run any of them; not again for an entry this user's
mdsl wrote or re-checked: `mdsl.search.trust`), so plan files are untouched; an entry that does not fit
warns and is ignored. Reading (`tuning_candidates`) imports neither the generators nor the verifier: a
GPU machine without z3 only reads what a CPU machine computed.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import attrs

from mdsl.ir.graph import KernelGraph
from mdsl.search import trust
from mdsl.search.cache import PlanCache, _read_bounded, _write_atomic
from mdsl.search.cost import H200, estimate, gpu_estimate, same_cost
from mdsl.search.plan import Candidate, Plan, _candidate, _candidate_json, content_digest, recheck_candidates

SCHEMA = 2
DEFAULT_LIMIT = 8


@attrs.frozen
class VariantSpace:
    """The widened choice space (`guided.choices`' keyword arguments) and what is verified of it."""

    max_split: int = 256          # splits of the loop label across blocks
    min_forloop: int = 1          # 1: a block may take its whole split as one tile
    budget_s: float = 1200.0      # verification wall clock for all of a plan's variants
    combine_blocks: int = 128     # a split variant's combine kernel is also tried with at least this many blocks
    max_loop_tile: int = 128      # elements of the loop label an iteration takes, at most (see `_fits`)
    # split variants preferred (`_preferred`): their first kernel fills the SMs about 1-4 times over and copies
    # at most this many bytes an iteration (more is slower on the H200: docs/tried-kernels.md)
    split_waves: tuple = (0.9, 4)
    max_iteration_bytes: int = 80 * 1024
    min_split_loop_tile: int = 64  # and take at least this much of the loop label an iteration (4 mma k-steps)


@attrs.frozen
class TuningVariant:
    candidate: Candidate          # the verified mugraph, its cost and evidence
    describe: str                 # the choice it was derived under
    gpu_seconds: float            # gpu_estimate's time, the rank among variants


@attrs.frozen
class Proposal:
    graph: KernelGraph
    describe: str
    group: tuple                  # (blocks of the first kernel, split): variants of one group differ in loop
    gpu_seconds: float            # and combine
    preferred: bool = True        # a shape measured to pay (`_preferred`): picked before the others


# ---------------------------------------------------------------------------------------------
# structure

def structure(graph: KernelGraph) -> tuple:
    """What variants share: the kernels' block-graph ops, casts and accumulators aside (a split moves
    the post-loop ops into the combine kernel), the library ops, and the first kernel's accumulators (a
    split variant's combine re-accumulates those); as sorted counts."""
    bodies = [n.body for n in graph.nodes if n.body is not None]
    work = sorted(n.op for b in bodies for n in b.nodes if n.op != "cast" and not n.opdef.is_accumulator)
    library = sorted(n.op for n in graph.nodes if n.body is None)
    accumulators = sorted(n.op for n in bodies[0].nodes if n.opdef.is_accumulator) if bodies else []
    return tuple(work), tuple(library), tuple(accumulators)


def _unsplit_structure(original: KernelGraph, choice, graph: KernelGraph, labels) -> Optional[tuple]:
    """The structure of `graph`, or for a split choice that of the same choice unsplit (a split changes
    an accumulator into its partial and combine: accum_rms into a mean of squares, then the root), so
    that split and unsplit mugraphs of one lifting compare equal; None where the unsplit one does not lift."""
    from mdsl.search.guided import CannotLift, lift

    if choice.split <= 1:
        return structure(graph)
    try:
        return structure(lift(original, attrs.evolve(choice, split=1, combine_parts=1,
                                                  forloop=choice.forloop * choice.split), labels))
    except CannotLift:
        return None


def describe_choice(choice, labels) -> str:
    grid = " x ".join(f"{parts}" for _, parts in choice.grid) or "1"
    if choice.loop is None:
        return f"grid {grid}, no loop"
    n = labels.size(choice.loop) // choice.split
    split = f", split {choice.split}" if choice.split > 1 else ""
    combine = f", combine x{choice.combine_parts}" if choice.combine_parts > 1 else ""
    return f"grid {grid}{split}{combine}, {choice.forloop} iteration(s) of {n // choice.forloop}"


def _main_blocks(graph: KernelGraph) -> tuple:
    return tuple(n.body.num_blocks for n in graph.nodes if n.body is not None)


# ---------------------------------------------------------------------------------------------
# proposing

def propose(plan: Plan, limit: int = DEFAULT_LIMIT, space: VariantSpace = VariantSpace(),
            registers: Optional[Callable] = None) -> list:
    """Up to `limit` unverified Proposals for `plan`, best first by gpu_estimate, diverse; [] when no
    plan candidate is a guided mugraph (the original program, say). `registers(graph)`: where given, the
    `gpu_estimate(registers=...)` lookup of a mugraph's compiled kernels (e.g.
    `mdsl.backend.cuda.autotune.compiled_registers`), used to rank again the best `4 * limit`."""
    from mdsl.search.dims import Labels
    from mdsl.search.guided import CannotLift, choices, lift

    original = plan.original
    labels = Labels(original)
    lifted: dict = {}  # key -> (choice, graph), first choice of each mugraph
    resident = _register_resident_labels(original, labels)
    for choice in choices(original, labels, plan.config, max_split=space.max_split,
                          min_forloop=space.min_forloop):
        if not _fits(choice, labels, space, resident):
            continue
        for wider in _combine_widths(choice, space):
            try:
                graph = lift(original, attrs.evolve(choice, combine_parts=wider), labels)
            except CannotLift:
                continue
            lifted.setdefault(graph.key, (attrs.evolve(choice, combine_parts=wider), graph))
    known = [plan.graph] + [c.graph for c in plan.alternatives]
    base = next((lifted[g.key] for g in known if g.key in lifted), None)
    if base is None:
        return []
    base_choice, base_graph = base
    shape = _unsplit_structure(original, base_choice, base_graph, labels)
    taken = {g.key for g in known}
    proposals = []
    # split and unsplit variants mix where the loop label is only contracted (a GEMV's k: split-K or not);
    # a loop over a register-resident label keeps the plan's kind (flash decoding stays split)
    mixing = base_choice.loop not in resident
    for key, (choice, graph) in lifted.items():
        if key in taken or choice.loop != base_choice.loop \
                or (not mixing and (choice.split > 1) != (base_choice.split > 1)) \
                or _unsplit_structure(original, choice, graph, labels) != shape:
            continue
        proposals.append(Proposal(graph, describe_choice(choice, labels), (_main_blocks(graph)[:1], choice.split),
                                  gpu_estimate(graph, skinny=True).seconds, _preferred(graph, choice, labels, space)))
    proposals.sort(key=lambda p: (p.gpu_seconds, p.graph.key))
    if registers is not None:
        best = [attrs.evolve(p, gpu_seconds=gpu_estimate(p.graph, registers=registers(p.graph), skinny=True).seconds)
                for p in proposals[:4 * limit]]
        proposals = sorted(best, key=lambda p: (p.gpu_seconds, p.graph.key)) + proposals[4 * limit:]
    return diverse(proposals, limit)


def _preferred(graph: KernelGraph, choice, labels, space: "VariantSpace", sms: int = H200.sms) -> bool:
    """Unsplit variants always; split ones whose first kernel has `space.split_waves` waves of blocks,
    loads at most `space.max_iteration_bytes` an iteration and takes at least `space.min_split_loop_tile`
    of the loop label an iteration."""
    if choice.split <= 1:
        return True
    first = next(n.body for n in graph.nodes if n.body is not None)
    low, high = space.split_waves
    per_iteration = sum(i.var.type.nbytes for i in first.inputs if i.fmap is not None)
    tile = labels.size(choice.loop) // (choice.split * choice.forloop)
    return (low * sms <= first.num_blocks <= high * sms and per_iteration <= space.max_iteration_bytes
            and tile >= space.min_split_loop_tile)


def _fits(choice, labels, space: "VariantSpace", resident: frozenset = frozenset()) -> bool:
    """Whether an iteration's tile along the loop label is at most `space.max_loop_tile` long, where
    that tile stays in registers (`resident`): in attention, whose rows stay in the mma registers, a
    thread's row of scores outgrows its registers beyond that, which the estimate does not model (longer
    tiles are slower on the H200: docs/tried-kernels.md). Where the loop label is only contracted (the k
    of a GEMV) the tile's length does not reach the registers: ptxas reports no spills for
    rms_norm_linear and gated_mlp with 512-long k tiles, and longer tiles put more bytes in flight."""
    if choice.loop is None or choice.loop not in resident:
        return True
    return labels.size(choice.loop) // (choice.split * choice.forloop) <= space.max_loop_tile


def _register_resident_labels(graph: KernelGraph, labels) -> frozenset:
    """The labels along which a matmul's result is laid out (attention's keys in the scores Q·K): a loop
    over one of them keeps that tile of the result in each thread's registers."""
    return frozenset(labels.label(n.outputs[0].name, d) for n in graph.nodes if n.op == "matmul"
                     for d in range(n.outputs[0].type.rank))


def _combine_widths(choice, space: "VariantSpace") -> list:
    """The combine kernel's extra split factors to try for a split choice: none, and the powers of two
    that give it at least `space.combine_blocks` blocks: a combine of a few blocks, each looping over
    many splits, costs more than the attention before it (docs/tried-kernels.md)."""
    if choice.split <= 1:
        return [1]
    blocks = math.prod(parts for _, parts in choice.grid)
    wider = 1
    while blocks * wider < space.combine_blocks:
        wider *= 2
    return sorted({1, wider, wider * 2})


def diverse(ranked: Sequence[Proposal], limit: int, per_group: int = 2) -> list:
    """`limit` of the ranked proposals, spread over grids (`_spread`). Where split and unsplit ones both
    exist (a GEMV's split-K), half of each kind (the estimate cannot be trusted to choose between one
    kernel and a split-K pair: the GPU decides), the preferred shapes first and one split variant per
    split factor; in rank order."""
    kinds = [[p for p in ranked if (p.group[1] > 1) == split] for split in (True, False)]
    if not all(kinds):
        return _spread(ranked, limit, per_group)
    split, unsplit = (sorted(k, key=lambda p: not p.preferred) for k in kinds)  # stable: rank order kept
    # one split variant per split factor, the factors of the best ones first (a hedge across factors:
    # the estimate ranks them less surely than grids of one factor)
    picked = _spread(split, -(-limit // 2), 1, group=lambda p: p.group[1])
    picked += _spread(unsplit, limit - len(picked), per_group)
    taken = {id(p) for p in picked}
    picked += [p for p in split if id(p) not in taken][:limit - len(picked)]
    order = {id(p): i for i, p in enumerate(ranked)}
    return sorted(picked, key=lambda p: order[id(p)])


def _spread(ranked: Sequence[Proposal], limit: int, per_group: int, group: Callable = lambda p: p.group) -> list:
    """`limit` of the ranked proposals, spread over grids: up to `per_group` (the best loop lengths) from
    each of the best ceil(limit / per_group) groups (by default (blocks, split)), then the best of the
    rest; in rank order."""
    if limit <= 0:
        return []
    groups: dict = {}
    for p in ranked:
        groups.setdefault(group(p), []).append(p)
    best_groups = list(groups.values())[:-(-limit // per_group)]
    picked = [p for g in best_groups for p in g[:per_group]][:limit]
    chosen = {id(p) for p in picked}
    picked += [p for p in ranked if id(p) not in chosen][:limit - len(picked)]
    order = {id(p): i for i, p in enumerate(ranked)}
    return sorted(picked, key=lambda p: order[id(p)])


# ---------------------------------------------------------------------------------------------
# verifying (through the search engine)

class _Proposed:
    """A generator for `engine.search` that yields the given mugraphs."""

    __name__ = "variants"

    def __init__(self, graphs: Sequence[KernelGraph]):
        self.graphs = list(graphs)

    def __call__(self, graph: KernelGraph, config) -> Iterator[KernelGraph]:
        yield from self.graphs


def verify(plan: Plan, proposals: Sequence[Proposal], *, budget_s: float = VariantSpace().budget_s,
           workers: Optional[int] = None, progress=None) -> list:
    """The proposals the search's verifier accepts, as TuningVariants in the proposals' order. Each is
    verified as a searched candidate is: `engine.search` with the plan's seed and number of tests."""
    return verify_all(plan, proposals, budget_s=budget_s, workers=workers, progress=progress)[0]


def verify_all(plan: Plan, proposals: Sequence[Proposal], *, budget_s: float = VariantSpace().budget_s,
               workers: Optional[int] = None, progress=None) -> tuple:
    """(verify's result, whether every proposal got its verdict within `budget_s`)."""
    from mdsl.search.engine import search

    if not proposals:
        return [], True
    extra = {"workers": workers} if workers else {}
    config = attrs.evolve(plan.config, budget_s=budget_s, top_k=len(proposals) + 1, **extra)
    result = search(plan.original, config, generators=[_Proposed([p.graph for p in proposals])], progress=progress)
    verified = {c.graph.key: c for c in result.candidates if c.evidence.equivalent and c.evidence.finite_field_tests}
    found = [TuningVariant(verified[p.graph.key], p.describe, p.gpu_seconds) for p in proposals
             if p.graph.key in verified]
    return found, not result.stats.timed_out


# ---------------------------------------------------------------------------------------------
# the cache entry

def plan_key(plan: Plan) -> Optional[str]:
    """The plan cache key of a plan read from the plan cache (None for one that was not)."""
    return Path(plan.cache_path).stem if plan.cache_path else None


def entry_path(cache: PlanCache, key: str) -> Path:
    return cache.root / "variants" / f"{key}.json"


def store(cache: PlanCache, plan: Plan, found: Sequence[TuningVariant], limit: int,
          complete: bool = True) -> Optional[Path]:
    """Write the plan's variants entry atomically; a cache that cannot be written only warns.
    `complete`: every proposal got its verdict (else the budget ran out, and `ensure_variants` tries
    again)."""
    key = plan_key(plan)
    if key is None:
        return None
    path = entry_path(cache, key)
    entry = {"mdsl_plan_variants": SCHEMA, "plan_key": key, "plan_graph_key": plan.graph.key,
             "original_key": plan.original.key, "limit": limit, "complete": complete,
             "variants": [{"describe": v.describe, "gpu_seconds": v.gpu_seconds, **_candidate_json(v.candidate)}
                          for v in found]}
    entry["digest"] = content_digest(entry)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, json.dumps(entry, sort_keys=True, indent=1, allow_nan=False))
    except OSError as e:
        warnings.warn(f"mdsl: could not write the variants entry {path}: {e}", stacklevel=2)
        return None
    trust.trust("variants", entry["digest"])
    return path


class CorruptVariants(Exception):
    """A variants entry that does not belong to the plan or does not hold verified mugraphs."""


def load(cache: PlanCache, plan: Plan) -> Optional[tuple]:
    """(variants, the limit they were picked under, whether their verification completed) stored for
    `plan`, or None (no entry, or one that does not fit: that warns)."""
    key = plan_key(plan)
    if key is None:
        return None
    path = entry_path(cache, key)
    try:
        text = _read_bounded(path)
    except FileNotFoundError:
        return None
    except Exception as e:
        warnings.warn(f"mdsl: ignoring the variants entry {path}: {type(e).__name__}: {e}", stacklevel=2)
        return None
    try:
        return _read_entry(text, key, plan)
    except Exception as e:  # untrusted data: whatever is wrong with it, it is not used
        warnings.warn(f"mdsl: ignoring the variants entry {path}: {type(e).__name__}: {e}", stacklevel=2)
        return None


def _read_entry(text: str, key: str, plan: Plan, *, check: bool = False) -> tuple:
    """(variants, limit, complete) of the entry, or CorruptVariants. `check`: re-check the variants even
    where this user's mdsl has."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("mdsl_plan_variants") != SCHEMA:
        raise CorruptVariants(f"not a variants entry of schema {SCHEMA}")
    digest = data.pop("digest", None)
    if digest != content_digest(data):
        raise CorruptVariants("it does not match its content digest: it was changed after it was written")
    if data.get("plan_key") != key or data.get("plan_graph_key") != plan.graph.key \
            or data.get("original_key") != plan.original.key:
        raise CorruptVariants("it belongs to another plan")
    limit = data["limit"]
    if not (isinstance(limit, int) and limit >= 0):
        raise CorruptVariants(f"its limit {limit!r} is not a count")
    signature = _signature(plan.original)
    found = []
    for item in data["variants"]:
        c = _candidate(item)  # parses and validates the mugraph
        if _signature(c.graph) != signature:
            raise CorruptVariants("a variant's inputs or outputs differ from the program's")
        e = c.evidence
        if not (e.equivalent and e.finite_field_tests >= plan.config.verify_tests and e.seed == plan.config.seed):
            raise CorruptVariants(f"a variant lacks the verification a plan candidate has ({e.describe()})")
        cost = estimate(c.graph)   # derived data: re-priced by this mdsl's cost model (plan.repriced)
        if not same_cost(c.cost, cost):
            c = attrs.evolve(c, cost=cost)
        seconds = float(item["gpu_seconds"])
        if not (seconds > 0 and math.isfinite(seconds)):
            raise CorruptVariants(f"a variant's estimate {seconds!r} is not a positive time")
        found.append(TuningVariant(c, str(item["describe"]), seconds))
    if len(found) > limit:
        raise CorruptVariants(f"{len(found)} variants under a limit of {limit}")
    complete = data.get("complete", False)
    if not isinstance(complete, bool):
        raise CorruptVariants(f"its completeness {complete!r} is not a boolean")
    # what the digest cannot catch: a changed variant with its digest recomputed (`mdsl.search.trust`: an
    # entry this user's mdsl wrote or re-checked is not re-checked again)
    if check or not trust.trusted("variants", digest):
        problem = recheck_candidates(plan.original, [(f"variant {i} ({v.describe})", v.candidate)
                                                     for i, v in enumerate(found, 1)])
        if problem:
            raise CorruptVariants(problem)
        trust.trust("variants", digest)
    return found, limit, complete


def _signature(graph: KernelGraph) -> tuple:
    return tuple(v.type for v in graph.inputs), tuple(v.type for v in graph.outputs)


# ---------------------------------------------------------------------------------------------
# the two entry points

def ensure_variants(plan: Plan, limit: int = DEFAULT_LIMIT, *, cache: Optional[PlanCache] = None,
                    space: VariantSpace = VariantSpace(), workers: Optional[int] = None, progress=None,
                    refresh: bool = False, registers: Optional[Callable] = None) -> list:
    """The plan's verified tuning variants: from the cache when a complete entry picked under at least
    `limit` is there (unless `refresh`: proposed again, as after a change of the proposer), else proposed,
    verified and stored (CPU work: minutes for attention; an entry whose verification ran out of
    `space.budget_s` is stored but tried again next time). `registers`: as `propose` takes it."""
    cache = cache or PlanCache()
    stored = None if refresh else load(cache, plan)
    if stored is not None and stored[1] >= limit and stored[2]:
        return stored[0][:limit]
    found, complete = verify_all(plan, propose(plan, limit, space, registers), budget_s=space.budget_s,
                                 workers=workers, progress=progress)
    store(cache, plan, found, limit, complete)
    return found


def tuning_candidates(plan: Plan, limit: int = DEFAULT_LIMIT, *, variants: Optional[int] = None,
                      cache: Optional[PlanCache] = None) -> list:
    """What the GPU autotuner times: the plan's verified candidates (the chosen mugraph, then its
    alternatives; at most `limit`), then up to `variants` (default `limit`) stored tuning variants, as
    Candidates. Only reads the cache: nothing is searched or verified here."""
    own = [c for c in [plan.chosen, *plan.alternatives] if c.evidence.equivalent][:limit]
    stored = load(cache or PlanCache(), plan)
    extra = [v.candidate for v in (stored[0] if stored else [])]
    keys = {c.graph.key for c in own}
    return own + [c for c in extra if c.graph.key not in keys][:limit if variants is None else variants]

"""Why each kernel boundary of a plan is there: the search's own findings, put in a user's terms.

A plan's kernels compute runs of the original's operators (`mdsl.search.partition`: a fused part, or
one operator left apart; a whole-program lifting is one run). Between two consecutive runs A and B
the reason is what the search found for the part that would join them (A's first operator to B's
last): an operator without a block-level rule (a layout change), kernels that share no tensor, no grid
or loop choice lifting it (with the shared memory its tiles would need where that is why), a fused
candidate that failed its reduced-instance screen, a whole plan that fused them and failed
verification or was cut by the budget, or the cost model's estimate that they are faster apart. Inside
one run, two launches are a split loop and its combine (which qualify for one launch where they can:
mdsl.lowering.onelaunch; then no boundary is between them).
"""
from __future__ import annotations

from typing import Optional

from mdsl.ir.graph import KernelGraph
from mdsl.lowering.gemm import library_read_transposes
from mdsl.lowering.views import is_view, launches_nothing, views_and_copy_reasons
from mdsl.search.cost import estimate
from mdsl.search.partition import DEAR, DISCONNECTED, FUSED, NO_LIFT, NOT_TRIED, SCREENED_OUT, UNLIFTABLE
from mdsl.search.records import Boundary
from mdsl.search.stats import SearchStats

_SHOWN = 3                        # operators named per side of a boundary


def boundaries(original: KernelGraph, chosen: KernelGraph, stats: SearchStats, outcomes: dict) -> tuple:
    """The boundaries of `chosen`, a plan for `original`, with their reasons. `outcomes`: candidate key
    -> what the search did with it (verified, rejected and why, skipped and why)."""
    record = stats.partition or {}
    unchanged = chosen.key == original.key
    # an assembly of another partition's (another order, or the program with values computed once per reader)
    record = next((r for r in record.get("others", ()) if chosen.key in r["assemblies"]), record)
    if record:   # the partition's spans index its program's nodes, in its order
        original = record["program"]
    n = len(original.nodes)
    runs = _runs(original, chosen, record, unchanged)
    out = []
    # the plan's transposes that cuBLAS reads in place launch nothing, as views do, and splits and concats left
    # with nothing to copy (mdsl.search.cost)
    in_place = {chosen.nodes[k].outputs[0].name for k in library_read_transposes(chosen)}
    views, copies = views_and_copy_reasons(chosen)
    kernels = [(i, j) for i, j in runs if any(not launches_nothing(node, views) and node.outputs[0].name not in in_place
                                              for node in original.nodes[i:j])]
    for i, j in kernels:
        launches = 1 if unchanged else _launches(original, chosen, (i, j), record)
        for copy in _boundary_copies(original, (i, j), record, copies) if j - i > 1 else ():
            launches -= 1
            out.append(Boundary(copy[0], _ops(original, i, j, "the kernel of "), "", copy[1]))
        for _ in range(launches - 1):
            out.append(Boundary(_ops(original, i, j, "partial results of "), _ops(original, i, j, "the combine of "),
                                "", "a split loop: the blocks of the first kernel each reduce a slice of the loop's "
                                    "dimension in parallel, the second adds up their partial results (the cost "
                                    "model prefers this to one kernel walking the whole dimension)"))
    for k, ((a, b), (c, d)) in enumerate(zip(kernels, kernels[1:])):
        sides = ((a, b), (c, d)) if k == 0 else ((c, d),)   # (a run's copies said once, where it is reached)
        reason = _reason(record, outcomes, stats, (a, b), (c, d), n) + _copies(original, sides, copies)
        out.append(Boundary(_ops(original, a, b), _ops(original, c, d), _crossing(original, (a, b), (c, d)), reason))
    return tuple(out)


def _copies(graph: KernelGraph, runs: tuple, reasons: dict) -> str:
    """For a split or concat that is one of `runs` and still launches a kernel: what it copies, and why its
    kernels could not address that in place (`mdsl.lowering.views.copy_reasons`)."""
    said = []
    for i, j in runs:
        node = graph.nodes[i]
        if j - i != 1 or node.op not in ("split", "concat"):
            continue
        values = node.outputs if node.op == "split" else node.inputs
        copied = {v.name: reasons[v.name] for v in values if v.name in reasons}
        if copied:
            said.append(f"{node.op} %{node.outputs[0].name} copies " +
                        ", ".join(f"%{name} ({why})" for name, why in copied.items()))
    return "".join(f"; {s}" for s in said)


def _boundary_copies(graph: KernelGraph, run: tuple, record: dict, reasons: dict) -> list:
    """A fused run's splits and concats at its boundary (`mdsl.search.layout`) that still copy, as (the
    operator, what it copies and why), as many as the part's candidate launches for them."""
    count = int((record.get("parts", {}).get(f"{run[0]}:{run[1]}") or {}).get("copies") or 0)
    said = [(f"{node.op} %{node.outputs[0].name}", _copies(graph, ((k, k + 1),), reasons)[2:])
            for k, node in enumerate(graph.nodes[run[0]:run[1]], run[0]) if node.op in ("split", "concat")]
    return [s for s in said if s[1]][:count]


def _runs(original: KernelGraph, chosen: KernelGraph, record: dict, unchanged: bool) -> list:
    """The plan's runs of the original's operators, in order."""
    n = len(original.nodes)
    if unchanged:
        return [(i, i + 1) for i in range(n)]
    spans = record.get("assemblies", {}).get(chosen.key)
    if spans is None:
        return [(0, n)]   # a whole-program lifting (guided or enumerated)
    runs, at = [], 0
    for i, j in sorted(map(tuple, spans)):
        runs.extend((k, k + 1) for k in range(at, i))
        runs.append((i, j))
        at = j
    runs.extend((k, k + 1) for k in range(at, n))
    return runs


def _launches(original: KernelGraph, chosen: KernelGraph, run: tuple, record: dict) -> int:
    """Kernels the plan spends on a run: one per operator left apart; a fused run's candidate's."""
    i, j = run
    if j - i == 1:
        return 1
    if (i, j) == (0, len(original.nodes)) and chosen.key not in record.get("assemblies", {}):
        return estimate(chosen).launches
    part = record.get("parts", {}).get(f"{i}:{j}", {})
    return int(part.get("launches") or 1)


def _ops(graph: KernelGraph, i: int, j: int, prefix: str = "") -> str:
    names = [f"{n.op} %{n.outputs[0].name}" for n in graph.nodes[i:j] if not is_view(n)]
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return prefix + ", ".join(names[:_SHOWN]) + more


def _crossing(graph: KernelGraph, first: tuple, second: tuple) -> str:
    """The tensors the first run defines and the second reads (through any views between them)."""
    defined = {v.name: v for n in graph.nodes[first[0]:first[1]] for v in n.outputs}
    aliases = dict(defined)
    for n in graph.nodes[first[1]:second[0]]:   # views between the runs pass a tensor on
        if any(v.name in aliases for v in n.inputs):
            aliases.update((v.name, v) for v in n.outputs)
    read = {v.name: v for n in graph.nodes[second[0]:second[1]] for v in n.inputs if v.name in aliases}
    return ", ".join(f"%{v.name}: {v.type}" for v in read.values())


def _reason(record: dict, outcomes: dict, stats: SearchStats, first: tuple, second: tuple, n: int) -> str:
    if not record:
        cut = " (the search's time cap ran out first)" if stats.timed_out else ""
        return f"the partition search did not run{cut}: no part of the program was fused"
    a, d = first[0], second[1]
    longest = record["max_part_nodes"]
    if d - a > longest:
        pair = record["parts"].get(f"{first[1] - 1}:{second[0] + 1}")
        if pair and pair["status"] not in (FUSED, NOT_TRIED):
            return _part_reason(pair, record, outcomes, stats, first, second, None)
        return (f"joining them would make one kernel of {d - a} operators; the search fuses parts of at most "
                f"{longest}")
    part = record["parts"].get(f"{a}:{d}")
    return _part_reason(part, record, outcomes, stats, first, second, (a, d))


def _part_reason(part: Optional[dict], record: dict, outcomes: dict, stats: SearchStats, first: tuple,
                 second: tuple, span: Optional[tuple]) -> str:
    if part is None:
        return "a kernel boundary the program itself draws (an operator whose results nothing reads)"
    status = part["status"]
    if status in (UNLIFTABLE, DISCONNECTED, NO_LIFT):
        return part["reason"]
    if status == DEAR:
        ended = "the search's time cap ran out" if stats.timed_out else "the search ended"
        return f"{ended} before the part joining them was tried: {part['reason']}"
    if status == SCREENED_OUT:
        return f"its fused candidates failed verification on a reduced instance: {part['reason']}"
    what = "time cap" if record.get("stopped") == "time" else "work budget"
    if status == NOT_TRIED:
        return f"the search's {what} ran out before the part joining them was tried"
    assert status == FUSED and span is not None
    if not part.get("complete", True):
        return (f"the search's {what} ran out before the part joining them was lifted under every choice (its "
                f"best fused kernel so far is estimated at {part['fused_s'] * 1e6:.3g} us)")
    assemblies = record.get("assemblies", {})
    best = next(iter(assemblies), None)   # the partition's best plan; the others are its fallbacks
    outcome = outcomes.get(best, "it was not verified") if best is not None else None
    if best is not None and any(i <= span[0] and span[1] <= j for i, j in assemblies[best]):
        if outcome != "verified":
            return f"the plan that fused them was not kept: {outcome}"
    apart = _run_seconds(record, first) + _run_seconds(record, second)
    if part["fused_s"] < apart:   # cheaper fused, but the best combination cuts between them
        kept = "" if outcome in (None, "verified") else f"; that plan was not kept: {outcome}"
        return (f"the search's best combination puts them in different parts, which the cost model estimates "
                f"cheaper in all than this part fused ({part['fused_s'] * 1e6:.3g} us){kept}")
    return (f"the cost model estimates them faster apart ({apart * 1e6:.3g} us) than fused "
            f"({part['fused_s'] * 1e6:.3g} us)")


def _run_seconds(record: dict, run: tuple) -> float:
    i, j = run
    if j - i == 1:
        return record["single_s"][i]
    part = record["parts"].get(f"{i}:{j}") or {}
    return part.get("fused_s") or sum(record["single_s"][i:j])

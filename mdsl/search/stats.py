"""Search statistics: counters by category and reason, shared by the engine and the generators.

A generator that accepts a `stats` keyword is handed the search's `SearchStats` and reports its
pruning there, e.g. `stats.count("pruned", "abstract-expression")`. It spends the search's work
budget there too: `stats.work("guided")` takes one step of the guided generator's allowance and says
False once it is spent (each consumer, generators and the verification queue alike, has its own
allowance of `SearchConfig.work` steps, so that what one consumer does never depends on how fast
another one ran). A generator that does long stretches of work without yielding may poll
`stats.out_of_time()` (the wall-clock cap) and return early.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import attrs

# the categories the engine counts (generators may add their own, "pruned" first of all)
GENERATED = "generated"      # by generator
DUPLICATE = "duplicate"      # by generator
INVALID = "invalid"          # by reason
PRUNED = "pruned"            # by reason, reported by generators
VERIFIED = "verified"        # accepted by the verifier
REJECTED = "rejected"        # by the verifier's reason
SKIPPED = "skipped"          # not verified: cannot reach the top k, the budget ran out, a worker died
ERRORS = "errors"            # generators that raised, by generator
WORK = "work"                # steps of the work budget spent, by consumer
_ORDER = (GENERATED, DUPLICATE, INVALID, PRUNED, VERIFIED, REJECTED, SKIPPED, ERRORS)


@attrs.define
class SearchStats:
    counts: dict = attrs.field(factory=dict)      # category -> {reason: n}
    best_seconds: Optional[float] = None          # the best verified candidate's estimated time
    elapsed_s: float = attrs.field(default=0.0, eq=False)   # varies run to run
    timed_out: bool = False                       # the budget ran out before the search finished
    done: bool = False
    deadline: Optional[float] = attrs.field(default=None, eq=False, repr=False)  # time.monotonic()
    listener: Optional[Callable[[], None]] = attrs.field(default=None, eq=False, repr=False)  # called on each count
    work_limit: Optional[int] = attrs.field(default=None, eq=False, repr=False)  # steps each consumer may take
    # what the partition generator learned of the program's parts (`mdsl.search.partition`), for the
    # plan's explanation
    partition: Optional[dict] = attrs.field(default=None, eq=False, repr=False)
    # what the counts are measured against, for a progress display (`mdsl.search.progress`)
    kernel: str = attrs.field(default="", eq=False, repr=False)                        # the program's name
    budget_s: Optional[float] = attrs.field(default=None, eq=False, repr=False)        # the wall-clock cap
    original_seconds: Optional[float] = attrs.field(default=None, eq=False, repr=False)  # its estimate

    def count(self, category: str, reason: str = "", n: int = 1) -> None:
        if not n:
            return
        reasons = self.counts.setdefault(category, {})
        reasons[reason] = reasons.get(reason, 0) + n
        if self.listener is not None:
            self.listener()

    def poll(self) -> None:
        """Call the listener without counting: a generator that keeps its counts to itself for a while
        (the enumerator's prunes, a frame at a time) lets the search merge finished verifications and
        hand waiting candidates to free workers meanwhile."""
        if self.listener is not None:
            self.listener()

    def work(self, consumer: str, n: int = 1) -> bool:
        """Spend `n` steps of `consumer`'s work allowance; False (and nothing spent) once they would
        exceed it. Without a limit every step is granted (and counted)."""
        used = self.counts.get(WORK, {}).get(consumer, 0)
        if self.work_limit is not None and used + n > self.work_limit:
            return False
        self.count(WORK, consumer, n)
        return True

    def by_reason(self, category: str) -> dict:
        return dict(self.counts.get(category, {}))

    def total(self, category: str) -> int:
        return sum(self.counts.get(category, {}).values())

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def summary(self) -> str:
        """One line: time, states explored, pruned by reason, verified, best cost so far."""
        best = f", best {self.best_seconds * 1e6:.3g} us" if self.best_seconds is not None else ""
        return f"{self.elapsed_s:.1f}s, {self.counts_summary()}{best}"

    def counts_summary(self) -> str:
        parts = [f"{self.total(GENERATED)} candidates{_reasons(self.by_reason(GENERATED))}"]
        others = sorted(set(self.counts) - set(_ORDER))  # what generators add, such as "states"
        for category in (*_ORDER[1:], *others):
            if self.total(category):
                reasons = _reasons(self.by_reason(category)) if category != DUPLICATE else ""
                parts.append(f"{category} {self.total(category)}{reasons}")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return {"counts": self.counts, "best_seconds": self.best_seconds, "elapsed_s": self.elapsed_s,
                "timed_out": self.timed_out, "done": self.done}

    @classmethod
    def from_json(cls, data: dict) -> "SearchStats":
        counts = {str(c): {str(r): int(n) for r, n in reasons.items()} for c, reasons in data["counts"].items()}
        best = data["best_seconds"]
        return cls(counts, None if best is None else float(best), float(data["elapsed_s"]), bool(data["timed_out"]),
                   bool(data["done"]))


def _reasons(reasons: dict) -> str:
    """` (a 3, b 1)`, most frequent first; nothing when the only reason is unnamed."""
    named = sorted(((n, r) for r, n in reasons.items() if r), key=lambda nr: (-nr[0], nr[1]))
    return f" ({', '.join(f'{r} {n}' for n, r in named)})" if named else ""

"""What a search may explore and how long it may take. Part of the result cache's key.

A search's result depends on its work budget (`work`), never on how fast the machine ran it: each
consumer of work (the guided generator's liftings, the partition generator's liftings, its screens, the
exhaustive generator's states, and the candidates admitted to verification, each counted as
`VERIFY_STEPS` steps) may take `work` steps of its own, in an order that does not depend on time. The
wall-clock `budget_s` is only a safety cap: a search it cuts short returns the best plan so far, marked
provisional (`Plan.provisional`), which the plan cache serves until a later `optimize` searches again.
"""
from __future__ import annotations

import math
import os

import attrs
from attrs import validators as v


def _default_workers() -> int:
    return max(1, os.cpu_count() or 1)


def _finite_positive(instance, attribute, value) -> None:
    # a budget is always finite: every search ends, and a plan's JSON stays strict
    if not (0 < value < math.inf):
        raise ValueError(f"{attribute.name} must be a finite number of seconds > 0, got {value!r}")


#: Steps of the "verify" allowance one candidate admitted to verification takes (so that the default work
#: budget admits work // VERIFY_STEPS candidates).
VERIFY_STEPS = 100


@attrs.frozen
class SearchConfig:
    # the wall-clock cap; the best verified result so far is returned then, as a provisional plan
    budget_s: float = attrs.field(default=120.0, validator=_finite_positive)
    # steps of work each consumer may take (liftings, screens, enumeration states and their z3 queries'
    # resource units, VERIFY_STEPS per candidate verified): what makes a search's result the same on a
    # loaded machine as on a quiet one
    work: int = attrs.field(default=10_000, validator=v.ge(1))
    # worker processes that verify candidates; the result does not depend on it
    workers: int = attrs.field(factory=_default_workers, eq=False, validator=v.ge(1))
    seed: int = 0                       # all randomness (verification inputs, primes, oracles) derives from it
    guided: bool = True                 # propose block graphs from the target's structure first
    partition: bool = True              # then fuse parts of the program where no one kernel computes all of it
    exhaustive: bool = True             # then enumerate block graphs in canonical order
    max_block_ops: int = 7              # ops in one enumerated block graph (accumulators included)
    forloop_ranges: tuple = (1, 2, 4, 8, 16, 32, 64, 128)
    thread_counts: tuple = (128, 256)
    min_blocks: int = 8                 # grids smaller than this rarely pay on a 132-SM GPU
    max_blocks: int = 4096
    verify_tests: int = attrs.field(default=3, validator=v.ge(1))  # independent finite-field tests per candidate
    top_k: int = attrs.field(default=8, validator=v.ge(1))         # verified plans kept, best first
    arch: str = "sm_90a"

    def cache_fields(self) -> dict:
        """The fields that can change a search's result (workers cannot), numbers in one spelling:
        `budget_s=10` and `budget_s=10.0` are the same search, so they must be the same cache key."""
        return {f.name: _canonical(getattr(self, f.name)) for f in attrs.fields(SearchConfig) if f.eq}


def _canonical(value):
    """A whole number as an int (10.0 -> 10), in tuples too; every other value as it is."""
    if isinstance(value, tuple):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value

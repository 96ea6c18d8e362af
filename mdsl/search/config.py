"""What a search may explore and how long it may take. Part of the result cache's key."""
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


@attrs.frozen
class SearchConfig:
    # wall clock; the best verified result so far is returned then
    budget_s: float = attrs.field(default=120.0, validator=_finite_positive)
    # worker processes that verify candidates; the result does not depend on it
    workers: int = attrs.field(factory=_default_workers, eq=False, validator=v.ge(1))
    seed: int = 0                       # all randomness (verification inputs, primes, oracles) derives from it
    guided: bool = True                 # propose block graphs from the target's structure first
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

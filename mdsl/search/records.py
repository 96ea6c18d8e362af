"""Plain records the search's parts hand each other, apart from the plan (which imports the package for
its version): what a generator may yield besides a mugraph (`Fallback`, `Assembly`), and what a plan
stores of its explanation (`Boundary`) and its shape family (`Family`)."""
from __future__ import annotations

from typing import Optional

import attrs

from mdsl.ir.graph import KernelGraph


@attrs.frozen
class Fallback:
    """What a generator yields for a candidate to verify only if another one, `primary` (its structural
    key), is not verified: a second choice that is worth its verification only where the first fails."""

    graph: KernelGraph
    primary: str


@attrs.frozen
class Assembly:
    """What a generator yields for a whole-program candidate made of replaced parts: `parts` pairs each
    sub-program (a run of the original's operators as a program of its own) with the mugraph that
    replaces it in `graph`; every other operator of `graph` is the original's. The verifier checks
    each replacement against its sub-program, and the whole is equivalent by substitution.
    `primary`: as a Fallback's, or None (`mdsl.search.partition` yields its best assembly, then
    fallbacks standing in for it)."""

    graph: KernelGraph
    parts: tuple
    primary: Optional[str] = None


@attrs.frozen
class Boundary:
    """One kernel boundary: the kernels on either side (the original's operators they compute), the
    tensors that cross it, and why it is there."""

    before: str
    after: str
    tensors: str
    reason: str

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Boundary":
        if not isinstance(data, dict) or set(data) != {f.name for f in attrs.fields(cls)} \
                or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"a boundary has the string fields {[f.name for f in attrs.fields(cls)]}")
        return cls(**data)

    def describe(self) -> str:
        crossing = f" ({self.tensors})" if self.tensors else ""
        return f"{self.before} | {self.after}{crossing}: {self.reason}"


@attrs.frozen
class Family:
    """Where a plan belongs: its family dim (described), the size it was searched at, the sizes it
    re-targets to, and, for a re-targeted plan, the size it came from."""

    dim: str
    size: int
    sizes: tuple
    source: Optional[int] = None

    def to_json(self) -> dict:
        return {"dim": self.dim, "size": self.size, "sizes": list(self.sizes), "source": self.source}

    @classmethod
    def from_json(cls, data: dict) -> "Family":
        sizes = tuple(int(s) for s in data["sizes"])
        return cls(str(data["dim"]), int(data["size"]), sizes, None if data["source"] is None else int(data["source"]))

    def describe(self) -> str:
        covered = ", ".join(map(str, self.sizes)) or "no other size"
        origin = f"re-targeted from the plan searched at {self.source}; " if self.source is not None else ""
        return (f"{origin}{self.dim} = {self.size}; the plan re-targets to {covered} "
                "(each verified at its own size when first used)")

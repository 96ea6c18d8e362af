"""What a search's worker processes run: verification of one candidate against the original.

Graphs cross the process boundary as JSON text (the IR's own portable form); the verifier and the
original are handed over once per worker, by the pool's initializer.
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable

from mdsl.ir import serialize
from mdsl.ir.graph import KernelGraph
from mdsl.search.plan import Evidence

_state: dict = {}


def graph_text(graph: KernelGraph) -> str:
    return json.dumps(serialize.to_json(graph), separators=(",", ":"), allow_nan=False)


def init(verifier: Callable, original_text: str) -> None:
    _state["verifier"] = verifier
    _state["original"] = serialize.loads(original_text)


def verify(candidate_text: str, tests: int, seed: int) -> tuple:
    """(Evidence, this worker's pid). A verifier that raises rejects the candidate, with the reason."""
    start = time.perf_counter()
    try:
        candidate = serialize.loads(candidate_text)
        verification = _state["verifier"](_state["original"], candidate, tests=tests, seed=seed)
        evidence = Evidence.of(verification, seed, time.perf_counter() - start)
    except Exception as e:  # a verifier bug must not end the search; the reason says what happened
        evidence = Evidence.failure(f"the verifier raised {type(e).__name__}: {e}", seed, time.perf_counter() - start)
    return evidence, os.getpid()

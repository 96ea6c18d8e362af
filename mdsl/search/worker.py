"""What a search's worker processes run: verification of one candidate against the original.

Graphs cross the process boundary as JSON text (the IR's own portable form); the verifier and the
original are handed over once per worker, by the pool's initializer. A worker lives for the whole
search, so what the verifier keeps between calls (the default one: the original's runs) serves every
candidate it verifies.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time
import types
from typing import Callable, Iterator, Optional

from mdsl.ir import serialize
from mdsl.ir.graph import KernelGraph
from mdsl.search.plan import Evidence

_state: dict = {}


def graph_text(graph: KernelGraph) -> str:
    return json.dumps(serialize.to_json(graph), separators=(",", ":"), allow_nan=False)


def init(verifier: Callable, original_text: str, shared_dir: Optional[str] = None, tests: int = 3,
         seed: int = 0) -> None:
    """A worker's start. With the default verifier and `shared_dir`, the workers of a search make the
    original's side of the tests together, each run once (`mdsl.passes.verify.prepare`), before the
    first candidate comes, rather than each all of it when its first candidate does."""
    # Ctrl-C reaches the whole process group: the search handles it and stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _state["verifier"] = verifier
    _state["original"] = serialize.loads(original_text)
    from mdsl.passes import verify as default  # (imported here: a custom verifier may not need it)

    if shared_dir is not None and verifier is default.verify:
        default.ORIGINAL_RUNS.share(shared_dir)
        try:
            default.prepare(_state["original"], tests=tests, seed=seed)
        except Exception:  # noqa: BLE001 - the verification that needs the run reports what is wrong
            pass


def ready() -> int:
    """Nothing: submitted first, so that the pool starts its workers (and they their `init`) at once."""
    return os.getpid()


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


# ---------------------------------------------------------------------------------------------
# starting workers: forkserver (workers fork from a server with mdsl preloaded), spawn where
# forkserver does not exist. Either would import the user's main module in every worker, and a
# script that calls optimize() at its top level, with no `if __name__ == "__main__":` guard,
# would then fail in each of them. The workers need nothing from that module, so they start
# without it.

_BASE = multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                    else "spawn")


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")  # what multiprocessing tells a new process to import
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class _WorkerProcess(_BASE.Process):
    @staticmethod
    def _Popen(process_obj):
        with _main_module_hidden():
            return _BASE.Process._Popen(process_obj)


class _WorkerContext(type(_BASE)):
    Process = _WorkerProcess


def context() -> multiprocessing.context.BaseContext:
    if _BASE.get_start_method() == "forkserver":
        _BASE.set_forkserver_preload([__name__])  # takes effect when the server first starts
    return _WorkerContext()

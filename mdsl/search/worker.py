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
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
import types
from typing import Callable, Iterator, Optional

import attrs

from mdsl.ir import serialize
from mdsl.ir.graph import KernelGraph
from mdsl.search.plan import Evidence
from mdsl.search.screen import screen

_state: dict = {}


def graph_text(graph: KernelGraph) -> str:
    return json.dumps(serialize.to_json(graph), separators=(",", ":"), allow_nan=False)


def init(verifier: Callable, original_text: str, shared_dir: Optional[str] = None, tests: int = 3,
         seed: int = 0) -> None:
    """A worker's start. With the default verifier and `shared_dir`, the workers of a search share the
    original's side of the tests: each run is made once, by one of them (see `prepare`)."""
    # Ctrl-C reaches the whole process group: the search handles it and stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _end_with_search()
    _state.update(verifier=verifier, original=serialize.loads(original_text), tests=tests, seed=seed)
    from mdsl.passes import verify as default  # (imported here: a custom verifier may not need it)

    _state["shares"] = shared_dir is not None and verifier is default.verify
    # the default verifier's candidates go through the reduced-instance screen first (mdsl.search.screen)
    _state["screen"] = verifier is default.verify
    if _state["shares"]:
        default.ORIGINAL_RUNS.share(shared_dir)


def prepare() -> None:
    """Make the original's side of the tests with the other workers (`mdsl.passes.verify.prepare`):
    the search submits this once per worker before its first candidate, so that the workers make the
    runs together rather than each all of them when its first candidate comes."""
    if not _state.get("shares"):
        return
    from mdsl.passes import verify as default

    try:
        default.prepare(_state["original"], tests=_state["tests"], seed=_state["seed"])
    except Exception:  # noqa: BLE001 - the verification that needs the run reports what is wrong
        pass


def verify(candidate_text: str, tests: int, seed: int) -> tuple:
    """(Evidence, this worker's pid). A verifier that raises rejects the candidate, with the reason. With
    the default verifier, a candidate that fails the reduced-instance screen is rejected before the
    full-size tests."""
    start = time.perf_counter()
    try:
        candidate = serialize.loads(candidate_text)
        failure = screen(_state["original"], candidate, seed) if _state.get("screen") else None
        if failure is not None:
            return Evidence.failure(failure, seed, time.perf_counter() - start), os.getpid()
        verification = _state["verifier"](_state["original"], candidate, tests=tests, seed=seed)
        evidence = Evidence.of(verification, seed, time.perf_counter() - start)
    except Exception as e:  # a verifier bug must not end the search; the reason says what happened
        evidence = Evidence.failure(f"the verifier raised {type(e).__name__}: {e}", seed, time.perf_counter() - start)
    return evidence, os.getpid()


def verify_parts(parts: list, tests: int, seed: int) -> tuple:
    """(Evidence, this worker's pid) of an assembled candidate verified part by part: `parts` holds
    (sub-program, replacement) pairs as JSON text; each replacement is checked against its sub-program
    by the search's verifier, and the whole is equivalent by substitution (the rest of it is the
    original's operators). The bound is the union bound over the parts; the first failure rejects."""
    start = time.perf_counter()
    bound, worst, outcomes = 0.0, None, []
    try:
        for k, (original_text, candidate_text) in enumerate(parts):
            original, candidate = serialize.loads(original_text), serialize.loads(candidate_text)
            v = Evidence.of(_state["verifier"](original, candidate, tests=tests, seed=seed), seed, 0.0)
            ops = ", ".join(n.op for n in original.nodes)
            if not v.equivalent:
                return attrs.evolve(v, reason=f"part {k + 1} of {len(parts)} ({ops}): {v.reason}",
                                    seconds=time.perf_counter() - start, parts=len(parts)), os.getpid()
            bound += v.false_pass_probability
            if worst is None or v.float_rel_error / v.float_bound > worst.float_rel_error / worst.float_bound:
                worst = v
            outcomes.append(f"part {k + 1} ({ops}): {v.reason}")
        evidence = Evidence(True, "; ".join(outcomes), worst.finite_field_tests, min(1.0, bound),
                            worst.float_rel_error, worst.float_bound, seed, time.perf_counter() - start,
                            parts=len(parts))
    except Exception as e:  # a verifier bug must not end the search; the reason says what happened
        evidence = Evidence.failure(f"the verifier raised {type(e).__name__}: {e}", seed, time.perf_counter() - start)
    return evidence, os.getpid()


def _end_with_search() -> None:
    """A thread that ends this worker as soon as the search's process has ended, however it ended (a
    process that is killed cannot stop its workers): a worker busy verifying would otherwise outlive
    it, holding the output streams of whoever ran it. The parent's sentinel is a pipe that the parent
    holds open for as long as it lives."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="mdsl-end-with-search", daemon=True).start()


# ---------------------------------------------------------------------------------------------
# starting workers: forkserver (workers fork from a server with mdsl preloaded), spawn where
# forkserver does not exist. Either would import the user's main module in every worker, and a
# script that calls optimize() at its top level, with no `if __name__ == "__main__":` guard,
# would then fail in each of them. The workers need nothing from that module, so they start
# without it.

_BASE = multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                    else "spawn")


#: the thread pools of the BLAS libraries numpy may use (OpenBLAS, MKL or Accelerate) and of OpenMP: one
#: thread each in a worker, whose parallelism is the pool of workers. With the default (a thread per core in
#: every process), the workers' BLAS threads spin against each other: two workers on two cores took 28-35 s
#: for a gqa_bs8 candidate that one takes 6-8 s to verify, and gqa_bs8's search ran into its time cap.
SINGLE_THREADED = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
                                          "VECLIB_MAXIMUM_THREADS")}
_ENVIRON_LOCK = threading.Lock()


@contextlib.contextmanager
def _worker_environment() -> Iterator[None]:
    """The environment a worker process (or the forkserver it forks from) starts with: this process's, with
    single-threaded BLAS. Set only while the process starts, so this process's own environment is as it was."""
    with _ENVIRON_LOCK:
        saved = {name: os.environ.get(name) for name in SINGLE_THREADED}
        os.environ.update(SINGLE_THREADED)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


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
        with _main_module_hidden(), _worker_environment():
            return _BASE.Process._Popen(process_obj)


class _WorkerContext(type(_BASE)):
    Process = _WorkerProcess


def context() -> multiprocessing.context.BaseContext:
    if _BASE.get_start_method() == "forkserver":
        _BASE.set_forkserver_preload([__name__])  # takes effect when the server first starts
    return _WorkerContext()


def start_server() -> None:
    """Start the forkserver (where workers start through one) without waiting for it: it preloads
    mdsl, which takes a second or so, while the search generates its first candidates."""
    if context().get_start_method() == "forkserver":
        with _worker_environment():
            multiprocessing.forkserver.ensure_running()


def end_server() -> None:
    """Kill the forkserver this process started, if any. It would end once this process has ended, but
    only after its preloading: a command whose search stopped early would end with the server still
    running, holding the output streams of whoever waits for the command. (Unreaped, it is replaced
    by a new one if a later search needs one. CPython keeps the server's pid in a private field.)"""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)

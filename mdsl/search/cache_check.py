"""`mdsl cache check`: every entry of a plan cache re-checked at once, in worker processes.

A cache made on one machine and carried to another is checked once, with every core, before its first
compile: each plan entry, and the tuning variants stored beside it, is read as a load reads it
(`mdsl.search.cache`, `mdsl.search.variants`) and re-checked (`mdsl.search.plan.recheck`) even where
this user's mdsl has checked it before. One that passes is trusted (`mdsl.search.trust`: later reads
skip the re-check); one that fails is deleted, if it is still the file that was read, so that the next
`optimize` searches it again. An entry of another mdsl version is left alone: this mdsl never reads it
(its key names that version), and another installation may.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable, Optional, Union

import attrs

from mdsl.search import trust
from mdsl.search.cache import OtherVersion, PlanCache, _read_bounded, _read_entry, delete_if_unchanged

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.json")


@attrs.frozen
class Checked:
    path: str
    kind: str                          # "plan" or "variants"
    outcome: str                       # PASSED, FAILED or SKIPPED
    reason: str = ""                   # why it failed or was skipped
    seconds: float = 0.0
    seen: Optional[os.stat_result] = attrs.field(default=None, eq=False, repr=False)   # the file that was read
    deleted: bool = False


def entry_keys(root: Path) -> tuple:
    """(keys of the plan entries, keys of variants entries without a plan entry), sorted."""
    def keys(folder: Path) -> set:
        try:
            return {name[:-5] for name in os.listdir(folder) if _ENTRY_NAME.fullmatch(name)}
        except FileNotFoundError:
            return set()

    plans = keys(root / "plans")
    return sorted(plans), sorted(keys(root / "variants") - plans)


def check_cache(root: Union[str, Path], jobs: Optional[int] = None,
                report: Optional[Callable[[Checked], None]] = None) -> list:
    """Re-check every entry under `root` in `jobs` processes (default: one per CPU; 1: in this
    process), trust those that pass and delete those that fail. `report` is called with each Checked
    as it comes (in the order they finish); the list of all is returned."""
    from mdsl.search.variants import entry_path

    root = Path(root)
    plans, orphans = entry_keys(root)
    jobs = max(1, os.cpu_count() or 1) if jobs is None else jobs
    results: list = []

    def take(checked: list) -> None:
        for c in checked:
            if c.outcome == FAILED and c.seen is not None:
                delete_if_unchanged(Path(c.path), c.seen)
                c = attrs.evolve(c, deleted=not os.path.lexists(c.path))
            results.append(c)
            if report is not None:
                report(c)

    take([Checked(str(entry_path(PlanCache(root), key)), "variants", SKIPPED, "there is no plan entry of its key")
          for key in orphans])
    if jobs == 1 or len(plans) <= 1:
        for key in plans:
            take(check_key(str(root), key))
        return results
    from mdsl.search.engine import _stop_workers
    from mdsl.search.worker import context

    executor = cf.ProcessPoolExecutor(max_workers=min(jobs, len(plans)), mp_context=context(),
                                      initializer=_start_worker, initargs=(str(trust.state_dir()),))
    finished = False
    try:
        futures = {executor.submit(check_key, str(root), key): key for key in plans}
        for future in cf.as_completed(futures):
            try:
                take(future.result())
            except BrokenProcessPool as e:   # a worker ended (killed, out of memory): its entries keep their state
                take([Checked(str(PlanCache(root).path(futures[future])), "plan", SKIPPED,
                              f"the process checking it ended ({e})")])
        finished = True
    finally:
        if finished:
            executor.shutdown(wait=True)
        else:   # interrupted: a re-check cannot be stopped otherwise
            _stop_workers(executor, grace_s=0.0)
    return results


def _start_worker(state_dir: str) -> None:
    from mdsl.search.worker import _end_with_search

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the process group: the command stops the workers
    _end_with_search()
    # the parent's state directory: a worker forks from a server that may have started under another environment
    os.environ["MDSL_STATE_DIR"] = state_dir


def check_key(root: str, key: str) -> list:
    """The Checked of the plan entry of `key` under `root`, then of its variants entry if there is one."""
    from mdsl.search.variants import _read_entry as read_variants
    from mdsl.search.variants import entry_path

    cache = PlanCache(root)
    path = cache.path(key)
    plan, out, why_not = None, [], ""
    start = time.perf_counter()
    seen = None
    try:
        seen = os.stat(path, follow_symlinks=False)
        plan = _read_entry(_read_bounded(path), key, None, check=True)
        out.append(Checked(str(path), "plan", PASSED, seconds=time.perf_counter() - start))
    except OtherVersion as e:
        why_not = "its plan entry is another mdsl version's"
        out.append(Checked(str(path), "plan", SKIPPED, f"{e}: this mdsl never reads it"))
    except FileNotFoundError:
        why_not = "its plan entry is gone"
        if seen is None or not os.path.lexists(path):
            out.append(Checked(str(path), "plan", SKIPPED, "it is gone (deleted while the check ran)"))
        else:
            out.append(Checked(str(path), "plan", FAILED, "it is a link to a missing file", seen=seen))
    except Exception as e:   # as a read: whatever is wrong with an entry, it is not served
        why_not = "its plan entry failed"
        out.append(Checked(str(path), "plan", FAILED, f"{type(e).__name__}: {e}", time.perf_counter() - start, seen))
    variants = entry_path(cache, key)
    if not os.path.lexists(variants):
        return out
    if plan is None:
        return out + [Checked(str(variants), "variants", SKIPPED, why_not)]
    start = time.perf_counter()
    seen = None
    try:
        seen = os.stat(variants, follow_symlinks=False)
        read_variants(_read_bounded(variants), key, plan, check=True)
        out.append(Checked(str(variants), "variants", PASSED, seconds=time.perf_counter() - start))
    except FileNotFoundError:
        if seen is None or not os.path.lexists(variants):
            out.append(Checked(str(variants), "variants", SKIPPED, "it is gone (deleted while the check ran)"))
        else:
            out.append(Checked(str(variants), "variants", FAILED, "it is a link to a missing file", seen=seen))
    except Exception as e:
        out.append(Checked(str(variants), "variants", FAILED, f"{type(e).__name__}: {e}",
                           time.perf_counter() - start, seen))
    return out

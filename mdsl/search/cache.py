"""The plan cache: a finished search's plan on disk, so that the same program is searched once.

Layout: `$MDSL_CACHE_DIR` (default `~/.cache/mdsl`) / `plans` / `<key>.json`, where the key is the
sha256 of everything that decides a search's result: the program (structural key and printed text,
source locations left out), input shapes and dtypes, `SearchConfig.cache_fields()`, the target
arch, mdsl's version and which generators and verifier searched. An entry is
`{"mdsl_plan_cache": SCHEMA, "key": ..., "plan": Plan.to_json(), "digest": content_digest(plan)}`,
written atomically (a temp file in the same directory, then os.replace) once the plan prints.

A *family index* (`families/<family key>.json`, `{"mdsl_plan_family": SCHEMA, "family": ..., "keys": [...]}`)
lists the plans searched for one program at different sizes of its leading dim (`mdsl.search.family`):
the family key hashes what the plan key does with every shape left out. `optimize` reads it where
the requested size has no plan of its own, re-targets a member's plan (`family.retarget`: lowered and
verified at the new size, no search) and stores the result under the requested key. A member is read
through `load_key`, which checks everything `load` does, the requested program aside (the re-target
compares the member's program, resized, with it).

An entry is untrusted data (a shared disk, a half-synced folder, a faulty older mdsl, a hand edit),
so reading one checks, before anything is served: that it is a regular file of at most
MAX_ENTRY_BYTES (read no further), its schema, key and content digest, that its plan parses and
validates, was verified by this mdsl version for the requested program, and passes
`mdsl.search.plan.recheck` (claims that fit each candidate, one finite-field test of every candidate
with fresh randomness, on a reduced instance where one exists). Its costs are derived data: the plan is
served re-priced by this mdsl's cost model (`mdsl.search.plan.repriced`), so a revised cost model keeps
the cached plans. An entry that fails is reported once (a warning naming the file and
why), deleted, and searched again by `optimize`, which stores the new plan in its place. A plan this
user's mdsl wrote or re-checked, in this process or an earlier one, is not re-checked again
(`mdsl.search.trust`, by content digest; its other checks run on every read). `mdsl cache check`
re-checks a whole cache at once (`mdsl.search.cache_check`).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Optional, Union

import attrs

from mdsl.ir.graph import KernelGraph
from mdsl.ir.text import print_graph
from mdsl.search import trust
from mdsl.search.config import SearchConfig
from mdsl.search.plan import Plan, content_digest, mdsl_version, recheck, repriced

SCHEMA = 2
#: The largest entry read: a plan with its alternatives takes tens of kilobytes; anything near this is
#: not a plan, and is not read into memory to find out.
MAX_ENTRY_BYTES = 64 << 20

#: Plans a family index lists at most (the newest kept).
MAX_MEMBERS = 16


def default_dir() -> Path:
    return Path(os.environ.get("MDSL_CACHE_DIR") or Path.home() / ".cache" / "mdsl")


class CorruptEntry(Exception):
    """A cache entry that is not what its name promises."""


class OtherVersion(CorruptEntry):
    """An entry verified by another mdsl version (this one never looks it up: its key names that version)."""


class PlanCache:
    def __init__(self, root: Union[str, Path, None] = None):
        self.root = Path(root) if root is not None else default_dir()

    @property
    def plans(self) -> Path:
        return self.root / "plans"

    def path(self, key: str) -> Path:
        return self.plans / f"{key}.json"

    def key(self, graph: KernelGraph, config: SearchConfig, searcher: Optional[dict] = None) -> str:
        material = {
            "schema": SCHEMA,
            "graph_key": graph.key,
            "graph_text": print_graph(_without_locs(graph)),   # a line moved in the user's file is no change
            "inputs": [[list(v.shape), v.dtype.name] for v in graph.inputs],
            "config": config.cache_fields(),
            "arch": config.arch,
            "mdsl_version": mdsl_version(),
            "searcher": searcher or {},
        }
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()

    def family_key(self, graph: KernelGraph, config: SearchConfig, searcher: Optional[dict] = None) -> str:
        """The key of the program's family: its plan key's material with every shape left out (ranks and
        dtypes kept; a reshape's target shape likewise), so that the program at any size of any dim has it;
        a member is a program only once its resized original equals the requested one (`family.retarget`)."""
        def shapeless(v) -> list:
            return [v.name, v.type.rank, v.dtype.name]

        def attribute(name: str, value) -> list:   # a reshape's shape is a shape too: its rank kept
            return [name, len(value)] if name == "shape" else [name, repr(value)]

        structure = {"inputs": [shapeless(v) for v in graph.inputs], "outputs": [shapeless(v) for v in graph.outputs],
                     "nodes": [[n.op, [attribute(k, a) for k, a in n.attrs], [shapeless(v) for v in n.inputs],
                                [shapeless(v) for v in n.outputs], n.body is not None] for n in graph.nodes]}
        material = {"schema": SCHEMA, "family": structure, "config": config.cache_fields(), "arch": config.arch,
                    "mdsl_version": mdsl_version(), "searcher": searcher or {}}
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()

    def family_path(self, family: str) -> Path:
        return self.root / "families" / f"{family}.json"

    def members(self, family: str) -> list:
        """The plan keys the family index lists (none where it is missing; a bad index warns and is deleted)."""
        path = self.family_path(family)
        seen = None
        try:
            seen = os.stat(path, follow_symlinks=False)
            data = json.loads(_read_bounded(path))
            if not isinstance(data, dict) or data.get("mdsl_plan_family") != SCHEMA or data.get("family") != family \
                    or not isinstance(data.get("keys"), list) \
                    or not all(isinstance(k, str) and len(k) == 64 and all(c in "0123456789abcdef" for c in k)
                               for k in data["keys"]):
                raise CorruptEntry("not a family index of this family")
            return list(data["keys"])
        except FileNotFoundError:
            return []
        except Exception as e:   # untrusted data: whatever is wrong, the family starts over
            self._reject(path, seen, f"{type(e).__name__}: {e}")
            return []

    def add_member(self, family: str, key: str) -> None:
        """List `key` in the family's index (written atomically; at most MAX_MEMBERS, newest last)."""
        keys = [k for k in self.members(family) if k != key][-(MAX_MEMBERS - 1):] + [key]
        path = self.family_path(family)
        text = json.dumps({"mdsl_plan_family": SCHEMA, "family": family, "keys": keys}, sort_keys=True, indent=1)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(path, text)
        except OSError as e:
            warnings.warn(f"mdsl: could not write the plan family index {path}: {e}", stacklevel=2)

    def load_key(self, key: str, searcher: Optional[dict] = None) -> Optional[Plan]:
        """The stored plan under `key` whatever program it is for, or None; checked as `load` checks, and
        its original must be the program `key` stands for (with this plan's config and `searcher`)."""
        path = self.path(key)
        seen = None
        try:
            seen = os.stat(path, follow_symlinks=False)
            plan = _read_entry(_read_bounded(path), key, None)
            if self.key(plan.original, plan.config, searcher) != key:
                raise CorruptEntry("its original program is not the one its key stands for")
        except FileNotFoundError:
            return None
        except Exception as e:
            self._reject(path, seen, f"{type(e).__name__}: {e}")
            return None
        return attrs.evolve(plan, cache_path=str(path))

    def load(self, key: str, graph: KernelGraph) -> Optional[Plan]:
        """The stored plan for `graph` under `key`, or None. An entry that fails any check warns, naming
        the file and the reason, and is deleted."""
        path = self.path(key)
        seen = None
        try:
            seen = os.stat(path, follow_symlinks=False)
            plan = _read_entry(_read_bounded(path), key, graph)
        except FileNotFoundError:
            if seen is None or not os.path.lexists(path):   # no entry (or another reader deleted it just now)
                return None
            self._reject(path, seen, "it is a link to a missing file")
            return None
        except Exception as e:  # an entry is untrusted data: whatever is wrong with it, search again
            self._reject(path, seen, f"{type(e).__name__}: {e}")
            return None
        # the requested graph carries the user's current source locations
        return attrs.evolve(plan, original=graph, cache_path=str(path))

    def store(self, key: str, plan: Plan) -> Optional[Path]:
        """Write the entry atomically; a cache that cannot be written only warns. The plan is printed
        first: one whose text cannot be made is a bug to report, never an entry that every later run
        reads back and fails on."""
        str(plan)
        path = self.path(key)
        data = plan.to_json()
        digest = content_digest(data)
        text = json.dumps({"mdsl_plan_cache": SCHEMA, "key": key, "plan": data, "digest": digest}, sort_keys=True,
                          indent=1, allow_nan=False)
        try:
            self.plans.mkdir(parents=True, exist_ok=True)
            _write_atomic(path, text)
        except OSError as e:
            warnings.warn(f"mdsl: could not write the plan cache entry {path}: {e}", stacklevel=2)
            return None
        trust.trust("plan", digest)
        return path

    def _reject(self, path: Path, seen: Optional[os.stat_result], why: str) -> None:
        """Report a bad entry and delete it, if it is still the file that was read (a concurrent
        writer's fresh entry stays), so that it is reported once and the next search replaces it."""
        warnings.warn(f"mdsl: ignoring the plan cache entry {path} (a new search replaces it): {why}", stacklevel=3)
        delete_if_unchanged(path, seen)


def delete_if_unchanged(path: Path, seen: Optional[os.stat_result]) -> None:
    """Delete the entry at `path` if it is still the file `seen` (a concurrent writer's fresh entry stays;
    a folder is not an entry mdsl wrote)."""
    try:
        now = os.stat(path, follow_symlinks=False)
        if seen is not None and _same_file(now, seen) and not stat.S_ISDIR(now.st_mode):
            os.unlink(path)
    except OSError:  # gone already, or not ours to delete: the next store replaces it or warns
        pass


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)


def _read_bounded(path: Path) -> str:
    """The entry's text, read only if it is a regular file (after links) of at most MAX_ENTRY_BYTES. A FIFO
    is opened without blocking and a device (a link to /dev/zero) is not read at all."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptEntry("it is not a regular file")
        if info.st_size > MAX_ENTRY_BYTES:
            raise CorruptEntry(f"it has {info.st_size} bytes, more than a plan's limit of {MAX_ENTRY_BYTES}")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_ENTRY_BYTES + 1)   # it may have grown since
    if len(data) > MAX_ENTRY_BYTES:
        raise CorruptEntry(f"it has more than a plan's limit of {MAX_ENTRY_BYTES} bytes")
    return data.decode("utf-8")


def _read_entry(text: str, key: str, graph: Optional[KernelGraph], *, check: bool = False) -> Plan:
    """The entry's plan, or CorruptEntry. `check`: re-check it even where this user's mdsl has."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("mdsl_plan_cache") != SCHEMA:
        raise CorruptEntry(f"not a plan cache entry of schema {SCHEMA}")
    if data.get("key") != key:
        raise CorruptEntry(f"it is the entry of key {data.get('key')!r}")
    if set(data) != {"mdsl_plan_cache", "key", "plan", "digest"} or not isinstance(data["plan"], dict):
        raise CorruptEntry("its fields are not an entry's")
    digest = content_digest(data["plan"])
    if data["digest"] != digest:
        raise CorruptEntry("its plan does not match its content digest: it was changed after it was written")
    plan = Plan.from_json(data["plan"])  # every graph parses and validates
    if plan.mdsl_version != mdsl_version():
        raise OtherVersion(f"it was verified by mdsl {plan.mdsl_version}, not by this mdsl {mdsl_version()}")
    if graph is not None and plan.original != graph:
        raise CorruptEntry("its original program differs from the requested one")
    if check or not trust.trusted("plan", digest):
        problem = recheck(plan)
        if problem:
            raise CorruptEntry(problem)
        trust.trust("plan", digest)
    return repriced(plan)


def _without_locs(graph):
    """The graph (of any level) with every node's source location removed."""
    nodes = tuple(attrs.evolve(n, loc=None, body=None if n.body is None else _without_locs(n.body))
                  for n in graph.nodes)
    return attrs.evolve(graph, nodes=nodes)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

"""The plan cache: a finished search's plan on disk, so that the same program is searched once.

Layout: `$MDSL_CACHE_DIR` (default `~/.cache/mdsl`) / `plans` / `<key>.json`, where the key is the
sha256 of everything that decides a search's result: the program (structural key and printed text,
source locations left out), input shapes and dtypes, `SearchConfig.cache_fields()`, the target
arch, mdsl's version and which generators and verifier searched. An entry is
`{"mdsl_plan_cache": SCHEMA, "key": ..., "plan": Plan.to_json()}`, written atomically (a temp file in
the same directory, then os.replace) and validated when read; an entry that fails validation is
ignored with a warning naming the file (the caller then searches again and overwrites it).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Optional, Union

import attrs

from mdsl.ir.graph import KernelGraph
from mdsl.ir.text import print_graph
from mdsl.search.config import SearchConfig
from mdsl.search.cost import estimate
from mdsl.search.plan import Plan, mdsl_version

SCHEMA = 1


def default_dir() -> Path:
    return Path(os.environ.get("MDSL_CACHE_DIR") or Path.home() / ".cache" / "mdsl")


class CorruptEntry(Exception):
    """A cache entry that is not what its name promises."""


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

    def load(self, key: str, graph: KernelGraph) -> Optional[Plan]:
        """The stored plan for `graph` under `key`, or None (a corrupt entry also warns)."""
        path = self.path(key)
        try:
            plan = _read_entry(path.read_text(encoding="utf-8"), key, graph)
        except FileNotFoundError:
            return None
        except Exception as e:  # an entry is untrusted data: whatever is wrong with it, search again
            warnings.warn(f"mdsl: ignoring the plan cache entry {path}: {type(e).__name__}: {e}", stacklevel=2)
            return None
        # the requested graph carries the user's current source locations
        return attrs.evolve(plan, original=graph, cache_path=str(path))

    def store(self, key: str, plan: Plan) -> Optional[Path]:
        """Write the entry atomically; a cache that cannot be written only warns."""
        path = self.path(key)
        text = json.dumps({"mdsl_plan_cache": SCHEMA, "key": key, "plan": plan.to_json()}, sort_keys=True,
                          indent=1, allow_nan=False)
        try:
            self.plans.mkdir(parents=True, exist_ok=True)
            _write_atomic(path, text)
        except OSError as e:
            warnings.warn(f"mdsl: could not write the plan cache entry {path}: {e}", stacklevel=2)
            return None
        return path


def _read_entry(text: str, key: str, graph: KernelGraph) -> Plan:
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("mdsl_plan_cache") != SCHEMA:
        raise CorruptEntry(f"not a plan cache entry of schema {SCHEMA}")
    if data.get("key") != key:
        raise CorruptEntry(f"it is the entry of key {data.get('key')!r}")
    plan = Plan.from_json(data["plan"])  # every graph parses and validates
    if plan.original != graph:
        raise CorruptEntry("its original program differs from the requested one")
    if estimate(plan.graph) != plan.cost:
        raise CorruptEntry("its cost differs from the cost model's estimate")
    return plan


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

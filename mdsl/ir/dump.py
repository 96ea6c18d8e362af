"""IR dumps between compilation stages, switched on by the environment:

* `MDSL_DUMP_IR=1` prints each graph to stderr under `// ----- IR after <stage> -----`;
* `MDSL_DUMP_IR=<dir>` writes `<dir>/<NN>-<stage>.mdsl`, numbered in call order per directory
  (and `.dot` beside it when `MDSL_DUMP_IR_DOT=1`).

Files are written atomically (a temp file, then os.replace), so a reader never sees half a graph.
"""
from __future__ import annotations

import itertools
import os
import re
import sys
import tempfile

from mdsl.ir.dot import to_dot
from mdsl.ir.text import print_ir

_counters: dict = {}  # directory -> itertools.count of the files dumped there


def dump_ir(stage: str, graph) -> None:
    target = os.environ.get("MDSL_DUMP_IR")
    if not target or target == "0":
        return
    if target == "1":
        sys.stderr.write(f"// ----- IR after {stage} -----\n{print_ir(graph)}\n")
        return
    os.makedirs(target, exist_ok=True)
    number = next(_counters.setdefault(os.path.abspath(target), itertools.count(1)))
    base = os.path.join(target, f"{number:02d}-{_file_name(stage)}")
    _write_atomic(base + ".mdsl", print_ir(graph) + "\n")
    if os.environ.get("MDSL_DUMP_IR_DOT") == "1":
        _write_atomic(base + ".dot", to_dot(graph))


def _file_name(stage: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stage) or "stage"


def _write_atomic(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

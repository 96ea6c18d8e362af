"""Where a benchmark's numbers come from: the date, the command, the commit and the machine, stored in
the `meta` of every JSON file a benchmark writes, so that `benchmarks/report.py` can say it beside each
table."""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]


def git(*cmd: str) -> Optional[str]:
    """`git CMD` in the repository; None where git or the repository is missing."""
    try:
        done = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def nvidia_smi() -> dict:
    """The first GPU's name, driver, clocks, temperature and power as nvidia-smi reports them ({} without one)."""
    fields = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw"
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    if done.returncode or not done.stdout.strip():
        return {}
    values = [v.strip() for v in done.stdout.splitlines()[0].split(",")]
    return dict(zip(["smi_name", "driver", "sm_clock", "sm_clock_max", "mem_clock", "temperature", "power"], values))


def provenance(script: str, argv: Sequence[str], gpu: bool = False) -> dict:
    """The common part of a benchmark's `meta`: UTC date, `benchmarks/SCRIPT ARGV...`, commit (MDSL_COMMIT
    where the tree is a copy without git metadata: `git rev-parse` there would find an enclosing
    checkout's HEAD), whether the tree had uncommitted changes, the host and, with `gpu`, nvidia-smi's view."""
    import mdsl

    named = os.environ.get("MDSL_COMMIT", "").strip()
    commit = named or git("rev-parse", "--short=7", "HEAD")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([f"benchmarks/{script}", *argv]), "python": platform.python_version(),
            "host": platform.node(), "cpus": os.cpu_count(),
            "load": [round(x, 2) for x in os.getloadavg()],   # a CPU benchmark's numbers depend on it
            "mdsl_version": mdsl.__version__,
            "mdsl_commit": commit,
            "mdsl_dirty": None if named else (bool(git("status", "--porcelain")) if commit else None)}
    if gpu:
        smi = nvidia_smi()
        meta["gpu"] = {"name": smi.get("smi_name"), **smi} if smi else None
    return meta


def write_outputs(out: Path, stem: str, result: dict, text: str) -> str:
    """`result` as out/STEM.json (with its meta) and the tables `text` as out/STEM.md, each written atomically
    (a run cut short leaves the files of its last write whole); returns the text."""
    import json

    from mdsl.gpu.cache import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / f"{stem}.json", json.dumps(result, indent=1).encode())
    write_atomic(out / f"{stem}.md", (text + "\n").encode())
    return text

"""A command's whole process tree, for the tests of `mdsl optimize`'s budget and signals (Linux /proc).

The command runs in a session of its own (`start_new_session=True`), so its processes are those of its
session, the helpers multiprocessing starts (resource tracker, forkserver) and the workers included,
even after their parent has ended.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import mdsl

ROOT = Path(__file__).resolve().parents[2]   # the checkout: its examples


def _stat(pid: int) -> Optional[tuple]:
    """(state, session id) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[3])


def _kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def alive(session: int) -> list:
    """The pids of the session's processes that are still running (zombies are not)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] == session and stat[0] != "Z":
                out.append(int(entry))
    return out


class PeakMemory:
    """Samples a session's processes every few milliseconds until stopped. `peak_kb` bounds the tree's
    peak resident memory from above: the sum over every process ever seen of its own high-water mark
    (VmHWM, which no sampling interval can miss), whether or not they peaked at the same time."""

    def __init__(self, session: int, interval_s: float = 0.01):
        self.session, self.interval_s = session, interval_s
        self.hwm: dict = {}   # pid -> its VmHWM in kB, last read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in alive(self.session):
                self.hwm[pid] = max(self.hwm.get(pid, 0), _kb(pid, "VmHWM"))
            self._stop.wait(self.interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_kb

    @property
    def peak_kb(self) -> int:
        return sum(self.hwm.values())


@contextlib.contextmanager
def temporary_directory() -> Iterator[Path]:
    """An empty directory for a command's TMPDIR, removed afterwards. Not under pytest's tmp_path: its
    paths are long, and multiprocessing's forkserver puts a Unix socket in TMPDIR, whose path may not
    exceed 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="mdsl-test-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _env(tmp: Path, tmpdir: Path) -> dict:
    """The environment of a command: the mdsl these tests import, TMPDIR, the plan cache under `tmp`."""
    package_root = str(Path(mdsl.__file__).resolve().parents[1])
    return dict(os.environ, TMPDIR=str(tmpdir), MDSL_CACHE_DIR=str(tmp / "cache"),
                PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))


def start_mdsl(args: list, tmp: Path, tmpdir: Path) -> subprocess.Popen:
    """`python -m mdsl ARGS` in a session of its own, in `tmp`, with TMPDIR `tmpdir`, its output captured."""
    return subprocess.Popen([sys.executable, "-m", "mdsl", *args], cwd=tmp, env=_env(tmp, tmpdir),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def startup_seconds(tmp: Path, tmpdir: Path) -> float:
    """How long Python takes here, now, to start and import what `mdsl optimize` imports before it
    searches (the command line, z3)."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import mdsl.cli, z3"], cwd=tmp, env=_env(tmp, tmpdir), check=True,
                   timeout=60)
    return time.monotonic() - start


def wait_gone(session: int, timeout_s: float) -> list:
    """Wait up to `timeout_s` for every process of the session to end; those still running."""
    deadline = time.monotonic() + timeout_s
    while alive(session) and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive(session)


def kill_session(session: int) -> None:
    """End what is left of a session whose test failed, so that it does not outlive the test."""
    for pid in alive(session):
        try:
            os.kill(pid, 9)
        except OSError:
            pass

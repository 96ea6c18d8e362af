"""`mdsl optimize` as a process: its budget and memory on a large kernel, and SIGTERM / SIGINT, which
must end its whole process tree (workers, forkserver, resource tracker) and remove its temporary
files. Each command runs in a session of its own (tests/search/proctree.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.search.proctree import (ROOT, PeakMemory, kill_session, start_mdsl, startup_seconds,
                                   temporary_directory, wait_gone)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")

CHAIN_8192 = """
import mdsl
from mdsl import Tensor, f16


@mdsl.kernel
def chain(x: Tensor[16, 8192, f16], w1: Tensor[8192, 8192, f16], w2: Tensor[8192, 8192, f16],
          w3: Tensor[8192, 8192, f16]):
    h = mdsl.silu(x @ w1)
    h = mdsl.relu(h @ w2)
    return (h @ w3) * 2.0
"""


def _finish(process: subprocess.Popen, timeout_s: float) -> tuple:
    """(stdout, stderr) once the command and everything holding its output streams have ended."""
    try:
        return process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_session(process.pid)
        process.communicate()
        raise


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget", [1, 10])
def test_the_budget_and_memory_hold_on_three_8192_square_weights(tmp_path, budget):
    # the program's weights take 384 MB in f16; the search verifies its fused plan (each matmul with its
    # activation) at full size, part by part: a worker holds one test's inputs at a time (one weight's
    # p-residues as int32, or its values as float16), drawn again for each evaluation and widened in
    # pieces, and the original's runs keep only its outputs: under 1 GB in all
    source = tmp_path / "chain.py"
    source.write_text(textwrap.dedent(CHAIN_8192))
    # Python's start and mdsl's imports are the machine's time, not the search's: a loaded machine
    # (a test run with -n) can take seconds for them alone, so the bound adds what they take here
    with temporary_directory() as tmpdir:
        startup = startup_seconds(tmp_path, tmpdir)
        start = time.monotonic()
        process = start_mdsl(["optimize", str(source), "--budget", str(budget), "--workers", "2", "--no-cache"],
                             tmp_path, tmpdir)
        memory = PeakMemory(process.pid)
        try:
            out, err = _finish(process, budget + 60)
        finally:
            peak_kb = memory.stop()
        seconds = time.monotonic() - start
        left = list(tmpdir.iterdir())
    assert process.returncode == 0, err.decode()
    assert b"kernel chain(" in out
    assert seconds <= budget + 2 + startup, f"mdsl optimize --budget {budget} took {seconds:.1f} s ({startup:.1f} s " \
                                            f"to start Python and import mdsl)"
    assert 0 < peak_kb < 2**20, f"the process tree's peak resident memory is {peak_kb / 1024:.0f} MB"
    assert wait_gone(process.pid, 2.0) == [] and left == []


def _under_way(log: Path, event: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Wait until the search's log has `event` (the command must still be running)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        if log.exists() and any(json.loads(line)["event"] == event for line in log.read_text().splitlines()
                                if line.endswith("}")):
            return
        time.sleep(0.02)
    raise AssertionError(f"no {event!r} event in the search log")


# when: (the log event to wait for, then seconds more). "start": the forkserver is still preloading;
# "candidate" and a second: the workers verify (each with its share of the original's runs)
MOMENTS = {"at the start": ("start", 0.0), "while verifying": ("candidate", 1.0)}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("moment", sorted(MOMENTS))
@pytest.mark.parametrize("signum, expected_status, said", [(signal.SIGTERM, 143, "terminated"),
                                                           (signal.SIGINT, 130, "interrupted")])
def test_a_signal_ends_the_whole_process_tree_and_removes_its_files(tmp_path, moment, signum, expected_status, said):
    log = tmp_path / "search.jsonl"
    example = ROOT / "examples" / "rms_norm_linear.py"
    with temporary_directory() as tmpdir:
        process = start_mdsl(["optimize", f"{example}:rms_norm_linear", "--budget", "100", "--workers", "2",
                              "--no-cache", "--log", str(log)], tmp_path, tmpdir)
        status, err, ended, left = _signalled(process, log, MOMENTS[moment], signum)
        temporary = _listing(tmpdir)
    assert (status, err.decode().rsplit("\n", 2)[-2]) == (expected_status, f"mdsl: {said}")
    assert ended <= 2.0, f"the command's output streams were held for {ended:.1f} s after the signal"
    assert left == [], f"still running 2 s after the signal: {left}"
    assert temporary == [], f"left in TMPDIR (path, bytes): {temporary}"


def _listing(folder: Path, most: int = 40) -> list:
    """(path relative to `folder`, bytes or None for a folder) of what lies under it, the first `most`: what a
    leftover holds says who made it."""
    found = []
    for path in sorted(folder.rglob("*"))[:most]:
        try:
            found.append((str(path.relative_to(folder)), None if path.is_dir() else path.stat().st_size))
        except OSError:   # (removed meanwhile)
            continue
    return found


def _signalled(process: subprocess.Popen, log: Path, moment: tuple, signum: int) -> tuple:
    """(exit status, stderr, seconds until the output streams closed, processes left 2 s after the signal)
    of a command sent `signum` at `moment`."""
    try:
        event, then = moment
        _under_way(log, event, process)
        time.sleep(then)
        if signum == signal.SIGINT:
            os.killpg(process.pid, signum)   # as a terminal's Ctrl-C: to the whole process group
        else:
            os.kill(process.pid, signum)     # as `kill` or a job scheduler: to the command alone
        sent = time.monotonic()
        _, err = _finish(process, 10.0)      # returns once nothing holds the command's output streams
        ended = time.monotonic() - sent
        left = wait_gone(process.pid, max(0.0, 2.0 - (time.monotonic() - sent)))
    finally:
        kill_session(process.pid)
    return process.returncode, err, ended, left

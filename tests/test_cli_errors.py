"""Mistakes on `mdsl optimize`'s command line and in the user's file are reported as errors naming the
option or the user's file and line, never as a traceback or a location in mdsl's launcher."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mdsl.cli import main

UNANNOTATED = """\
import mdsl


@mdsl.kernel
def scale(x):
    return x * 2.0
"""


def _write(tmp_path: Path, source: str) -> str:
    path = tmp_path / "user_kernels.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


@pytest.mark.parametrize("log,message", [
    (".", "is a directory; name a file in it"),
    ("missing/search.jsonl", "the folder of"),
])
def test_log_must_be_a_writable_file(capsys, tmp_path, monkeypatch, log, message):
    monkeypatch.chdir(tmp_path)
    kernels = _write(tmp_path, UNANNOTATED)
    with pytest.raises(SystemExit) as exit_info:
        main(["optimize", kernels, "--log", log, "--no-cache"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --log:" in err and message in err and "Traceback" not in err


def test_unannotated_kernel_points_at_the_users_file(capsys, tmp_path):
    status = main(["optimize", _write(tmp_path, UNANNOTATED), "--trace-only"])
    err = capsys.readouterr().err
    assert status == 2
    assert "user_kernels.py:4: kernel scale: parameter(s) x have no Tensor[...] annotation" in err
    assert "hint: annotate them" in err


@pytest.mark.timeout(60)
def test_unannotated_kernel_through_python_dash_m(tmp_path):
    """Run as `python -m mdsl`, the first frame outside mdsl is runpy's: the error names the user's file."""
    done = subprocess.run([sys.executable, "-m", "mdsl", "optimize", _write(tmp_path, UNANNOTATED), "--trace-only"],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2
    assert "user_kernels.py:4: kernel scale" in done.stderr and "runpy" not in done.stderr, done.stderr

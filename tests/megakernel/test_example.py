"""examples/megakernel/llama_decode.py runs: tiny checkpoint, model and task graphs, reference and
simulated decoding agree; its DOT files are valid Graphviz where `dot` is installed."""
import ast
import contextlib
import io
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megakernel" / "llama_decode.py"


def _run(monkeypatch, *args: str) -> str:
    monkeypatch.setattr("sys.argv", [str(EXAMPLE), "--sms", "8", "--new", "5", *args])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    return out.getvalue()


def test_llama_decode_example(monkeypatch):
    lines = _run(monkeypatch).splitlines()
    ref = next(line for line in lines if line.startswith("reference tokens")).split(":")[1]
    sim = next(line for line in lines if line.startswith("simulated tokens")).split(":")[1]
    assert ref == sim and len(ast.literal_eval(ref.strip())) == 5
    assert any(line.startswith("task graph for 8 SMs:") for line in lines)


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz is not installed")
def test_llama_decode_example_dot_files_render(monkeypatch, tmp_path):
    model_dot, task_dot = tmp_path / "model.dot", tmp_path / "tasks.dot"
    _run(monkeypatch, "--dot", str(model_dot), "--task-dot", str(task_dot))
    for path in (model_dot, task_dot):
        subprocess.run(["dot", "-Tsvg", str(path), "-o", str(path.with_suffix(".svg"))], check=True, timeout=60)
        assert path.with_suffix(".svg").stat().st_size > 1000


def test_a_users_own_architecture_runs_on_the_simulator_and_the_gpu_planner_accepts_it(monkeypatch):
    """examples/megakernel/parallel_block.py: a parallel attention + MLP block written in Python only; the
    simulator's tokens are the reference forward's, and the GPU megakernel's planner accepts it (on a machine
    with a GPU the example then runs it there and checks its tokens: tests/gpu/test_megakernel.py)."""
    example = EXAMPLE.parent / "parallel_block.py"
    monkeypatch.setattr("sys.argv", [str(example), "--new", "6"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(example), run_name="__main__")
    lines = out.getvalue().splitlines()
    ref = next(line for line in lines if line.startswith("reference tokens")).split(":")[1]
    sim = next(line for line in lines if line.startswith("simulated tokens")).split(":")[1]
    assert ref == sim and len(ast.literal_eval(ref.strip())) == 6
    verdict = next(line for line in lines if line.startswith("the GPU megakernel"))
    assert verdict.startswith("the GPU megakernel's planner accepts it: ") and "DOWN linear_add_residual" in verdict

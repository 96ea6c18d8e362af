"""The `mdsl` command line, called in-process through `mdsl.cli.main`."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mdsl
from mdsl.cli import main
from mdsl.ir import serialize, text

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RMS_NORM_LINEAR = str(EXAMPLES / "rms_norm_linear.py")


def run(capsys, *argv: str) -> tuple:
    """(exit status, stdout, stderr) of `mdsl ARGV...`."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def write(tmp_path: Path, source: str) -> str:
    path = tmp_path / "user_kernels.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_optimize_prints_every_kernel_of_a_file(capsys):
    status, out, err = run(capsys, "optimize", RMS_NORM_LINEAR)
    assert (status, err) == (0, "")
    headers = [line for line in out.splitlines() if line.startswith("kernel ")]
    assert [h.split("(")[0] for h in headers] == ["kernel rms_norm_linear_bs1", "kernel rms_norm_linear_bs8",
                                                   "kernel rms_norm_linear_fused"]
    first = out.split("\n\n")[0]
    assert text.parse_graph(first).name == "rms_norm_linear_bs1"


def test_optimize_one_function(capsys):
    status, out, err = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear_fused")
    assert (status, err) == (0, "")
    graph = text.parse_graph(out)
    assert graph.name == "rms_norm_linear_fused"
    assert [n.op for n in graph.nodes] == ["custom"]


def test_the_demo_block_of_the_file_does_not_run(capsys):
    status, out, _ = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear")
    assert status == 0 and "max |diff|" not in out


def test_json_format_is_one_graph_per_line(capsys):
    status, out, _ = run(capsys, "optimize", RMS_NORM_LINEAR, "--format", "json")
    assert status == 0
    graphs = [serialize.loads(line) for line in out.splitlines()]
    assert [g.name for g in graphs] == ["rms_norm_linear_bs1", "rms_norm_linear_bs8", "rms_norm_linear_fused"]


def test_dot_format(capsys):
    status, out, _ = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear", "-f", "dot")
    assert status == 0
    assert out.startswith("digraph ") and 'label="kernel rms_norm_linear_bs1"' in out


def test_unknown_function_lists_the_kernels(capsys):
    status, out, err = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:nope")
    assert (status, out) == (2, "")
    assert "no @mdsl.kernel function named 'nope'" in err
    assert "rms_norm_linear, rms_norm_linear_bs8, rms_norm_linear_fused" in err
    assert "Traceback" not in err


def test_missing_file(capsys, tmp_path):
    status, out, err = run(capsys, "optimize", str(tmp_path / "absent.py"))
    assert (status, out) == (2, "")
    assert err.startswith("mdsl: error: no such file: ") and "absent.py" in err


def test_file_without_kernels(capsys, tmp_path):
    status, _, err = run(capsys, "optimize", write(tmp_path, "x = 1\n"))
    assert status == 2
    assert "defines no @mdsl.kernel functions" in err


def test_shape_error_in_a_kernel_is_reported_without_a_traceback(capsys, tmp_path):
    path = write(tmp_path, """\
        import mdsl
        from mdsl import Tensor, f16

        @mdsl.kernel
        def bad(x: Tensor[4, 8, f16], w: Tensor[4, 8, f16]):
            return x @ w
        """)
    status, out, err = run(capsys, "optimize", path)
    assert (status, out) == (2, "")
    assert f"{path}:6:12: matmul: inner dimensions differ" in err
    assert "    return x @ w\n" in err and "hint:" in err
    assert "Traceback" not in err


def test_error_while_loading_the_file_is_reported_without_a_traceback(capsys, tmp_path):
    path = write(tmp_path, """\
        import mdsl
        from mdsl import Tensor

        @mdsl.kernel
        def bad(x: Tensor[4, "f64"]):
            return x
        """)
    status, _, err = run(capsys, "optimize", path)
    assert status == 2
    assert f"{path}:5" in err and "unsupported dtype 'f64'" in err
    assert "Traceback" not in err


def test_the_file_can_import_its_siblings(capsys, tmp_path):
    (tmp_path / "shapes.py").write_text("N = 8\n")
    path = write(tmp_path, """\
        import mdsl
        from mdsl import Tensor, f32
        from shapes import N

        @mdsl.kernel
        def double(x: Tensor[N, f32]):
            return x * 2
        """)
    status, out, _ = run(capsys, "optimize", path)
    assert status == 0 and "%x: f32[8]" in out


def test_version(capsys):
    assert run(capsys, "version") == (0, f"mdsl {mdsl.__version__}\n", "")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_optimize_help_says_what_it_does_for_now(capsys):
    with pytest.raises(SystemExit):
        main(["optimize", "--help"])
    assert "for now this traces and prints" in " ".join(capsys.readouterr().out.split())


def test_python_dash_m_mdsl():
    done = subprocess.run([sys.executable, "-m", "mdsl", "version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"mdsl {mdsl.__version__}\n")

"""The `mdsl` command line, called in-process through `mdsl.cli.main`."""
from __future__ import annotations

import json
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
QUICK = ("--budget", "1", "--workers", "1")  # a short search: these tests are about the command line


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("plans")


@pytest.fixture(autouse=True)
def shared_cache(module_cache, monkeypatch):
    """One plan cache for the module: a search of the examples runs once, later tests hit the cache."""
    monkeypatch.setenv("MDSL_CACHE_DIR", str(module_cache))


def run(capsys, *argv: str) -> tuple:
    """(exit status, stdout, stderr) of `mdsl ARGV...`."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def write(tmp_path: Path, source: str) -> str:
    path = tmp_path / "user_kernels.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


@pytest.mark.timeout(60)
def test_optimize_prints_the_plan_of_a_kernel(capsys):
    status, out, err = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear", "--budget", "5",
                           "--workers", "1")
    assert status == 0
    header = [line for line in out.splitlines() if line.startswith("#")]
    assert header[0].startswith(f"# mdsl {mdsl.__version__} plan for kernel rms_norm_linear_bs1, sm_90a: ")
    assert [line[:12] for line in header[1:5]] == ["# cost:     ", "# floor:    ", "# verified: ", "# search:   "]
    graph = text.parse_graph(out)  # the header is comments: what follows is the chosen mugraph
    assert graph.name == "rms_norm_linear_bs1"
    progress = err.split("next steps:")[0].splitlines()
    assert progress and all(line.startswith("mdsl search rms_norm_linear_bs1: ") for line in progress)
    assert all(len(line) <= 100 for line in progress)   # short: no prune reasons (those are --verbose's)
    assert "candidates, " in progress[-1] and "phase" not in err and "dead-end" not in err
    assert all(len(line) <= 200 for line in header) and not any(line.startswith("#          ") for line in header)


@pytest.mark.timeout(60)
def test_optimize_prints_every_kernel_of_a_file(capsys):
    status, out, _ = run(capsys, "optimize", RMS_NORM_LINEAR, *QUICK)
    assert status == 0
    plans = out.split("\n\n")
    assert [text.parse_graph(p).name for p in plans] == ["rms_norm_linear_bs1", "rms_norm_linear_bs8",
                                                          "rms_norm_linear_fused"]
    assert all(p.startswith("# mdsl ") for p in plans)


@pytest.mark.timeout(60)
def test_optimize_one_function(capsys):
    status, out, _ = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear_fused", *QUICK)
    assert status == 0
    assert text.parse_graph(out).name == "rms_norm_linear_fused"
    assert out.count("# mdsl ") == 1


def test_trace_only_prints_the_traced_graphs(capsys):
    status, out, err = run(capsys, "optimize", RMS_NORM_LINEAR, "--trace-only")
    assert (status, err) == (0, "")
    headers = [line for line in out.splitlines() if line.startswith("kernel ")]
    assert [h.split("(")[0] for h in headers] == ["kernel rms_norm_linear_bs1", "kernel rms_norm_linear_bs8",
                                                   "kernel rms_norm_linear_fused"]
    assert "#" not in out.split("\n")[0]
    fused = text.parse_graph(out.split("\n\n")[2])
    assert [n.op for n in fused.nodes] == ["custom"]


def test_the_demo_block_of_the_file_does_not_run(capsys):
    status, out, _ = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear", "--trace-only")
    assert status == 0 and "max |diff|" not in out


@pytest.mark.timeout(60)
def test_json_format_is_one_chosen_graph_per_line(capsys):
    status, out, _ = run(capsys, "optimize", RMS_NORM_LINEAR, "--format", "json", *QUICK)
    assert status == 0
    graphs = [serialize.loads(line) for line in out.splitlines()]
    assert [g.name for g in graphs] == ["rms_norm_linear_bs1", "rms_norm_linear_bs8", "rms_norm_linear_fused"]


@pytest.mark.timeout(60)
def test_dot_format(capsys):
    status, out, _ = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear", "-f", "dot", *QUICK)
    assert status == 0
    assert out.startswith("digraph ") and 'label="kernel rms_norm_linear_bs1"' in out


@pytest.mark.timeout(60)
def test_search_options_reach_the_search(capsys, tmp_path):
    log = tmp_path / "search.jsonl"
    status, out, _ = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear", "--budget", "1", "--seed", "5",
                         "--workers", "2", "--no-cache", "--log", str(log))
    assert status == 0 and "(seed 5)" in out and "# cached:" not in out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0]["event"] == "start" and records[-1]["event"] == "done"
    assert records[0]["config"]["budget_s"] == 1.0 and records[0]["config"]["workers"] == 2


def test_a_second_run_is_answered_from_the_cache(capsys):
    args = ("optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear_fused", *QUICK)
    run(capsys, *args)
    status, out, err = run(capsys, *args)
    assert status == 0 and "# cached:   " in out and "mdsl search" not in err   # no search, no progress


def next_steps(err: str) -> list:
    """The lines of the next-steps block that ends stderr."""
    assert "\nnext steps:\n" in "\n" + err
    return err.split("next steps:\n")[1].splitlines()


@pytest.mark.timeout(60)
def test_after_the_plan_it_says_how_to_run_it_see_its_code_and_where_it_is_cached(capsys):
    target = f"{RMS_NORM_LINEAR}:rms_norm_linear_fused"
    status, out, err = run(capsys, "optimize", target, *QUICK)
    assert status == 0 and "next steps" not in out   # stdout holds the plan alone
    steps = next_steps(err)
    assert steps[0].startswith("  run it:  on a machine with a GPU, call rms_norm_linear_fused(x, w) on torch CUDA")
    assert f"  code:    mdsl optimize {target} --budget 1 --format cuda (or ptx)" in steps
    (cached,) = [line for line in steps if line.startswith("  cached:  ")]
    path = Path(cached.split()[1])
    assert path.is_file() and path.suffix == ".json"
    assert json.loads(path.read_text())["plan"]["original"]["name"] == "rms_norm_linear_fused"
    assert steps[-1] == "  more:    --explain adds why each kernel boundary is left; --verbose adds the search's " \
                        "full statistics"


@pytest.mark.timeout(60)
def test_next_steps_of_several_kernels_and_without_the_cache(capsys):
    _, _, err = run(capsys, "optimize", RMS_NORM_LINEAR, *QUICK, "--explain", "--verbose")
    steps = next_steps(err)
    assert "call each kernel, e.g. rms_norm_linear(x, w), on torch CUDA tensors" in steps[0]
    cached = [line for line in steps if line.startswith("  cached:  ")]
    assert [line.split()[-1] for line in cached] == ["(rms_norm_linear_bs1)", "(rms_norm_linear_bs8)",
                                                     "(rms_norm_linear_fused)"]
    assert all(Path(line.split()[1]).is_file() for line in cached)
    assert not any(line.startswith("  more:") for line in steps)   # both options were given
    _, _, err = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear_fused", *QUICK, "--no-cache")
    assert "  cached:  nothing (--no-cache): the command above searches again" in next_steps(err)


@pytest.mark.timeout(60)
def test_verbose_shows_the_full_statistics(capsys):
    status, out, err = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear_fused", *QUICK, "--no-cache",
                           "--verbose")
    assert status == 0
    header = [line for line in out.splitlines() if line.startswith("#")]
    search = header.index(next(line for line in header if line.startswith("# search:   ")))
    assert header[search + 1].startswith("#           0 candidates, pruned ")   # by reason
    assert "pruned " in err.split("next steps:")[0]
    assert text.parse_graph(out).name == "rms_norm_linear_fused"


@pytest.mark.timeout(60)
def test_cuda_format_prints_the_plans_cuda_source(capsys):
    status, out, _ = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear_fused", "--format", "cuda", *QUICK)
    assert status == 0
    assert out.startswith("// CUDA C++ generated by mdsl for kernel graph rms_norm_linear_fused, target sm_90a.")
    assert 'extern "C" __global__ void' in out and "#include <cuda_fp16.h>" in out


@pytest.mark.timeout(120)
def test_ptx_format_prints_the_plans_ptx(capsys):
    pytest.importorskip("llvmlite")
    status, out, _ = run(capsys, "optimize", f"{RMS_NORM_LINEAR}:rms_norm_linear_fused", "--format", "ptx", *QUICK)
    assert status == 0
    assert out.startswith("// PTX generated by mdsl for kernel graph rms_norm_linear_fused, target sm_90a")
    assert ".target sm_90" in out and ".visible .entry " in out


def test_source_formats_work_on_the_traced_graphs_too(capsys):
    status, out, err = run(capsys, "optimize", RMS_NORM_LINEAR, "--trace-only", "--format", "cuda")
    assert (status, err) == (0, "")
    heads = [line for line in out.splitlines() if line.startswith("// CUDA C++ generated by mdsl for kernel graph ")]
    assert [h.split()[9].rstrip(",") for h in heads] == ["rms_norm_linear_bs1", "rms_norm_linear_bs8",
                                                          "rms_norm_linear_fused"]


@pytest.mark.parametrize("option, value", [("--budget", "0"), ("--budget", "inf"), ("--workers", "0"),
                                           ("--workers", "two")])
def test_bad_search_options_are_usage_errors(capsys, option, value):
    with pytest.raises(SystemExit) as info:
        main(["optimize", RMS_NORM_LINEAR, option, value])
    assert info.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


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
    status, out, _ = run(capsys, "optimize", path, "--trace-only")
    assert status == 0 and "%x: f32[8]" in out


def test_version(capsys):
    assert run(capsys, "version") == (0, f"mdsl {mdsl.__version__}\n", "")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_optimize_help_says_what_it_does(capsys):
    with pytest.raises(SystemExit):
        main(["optimize", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "search each for the fastest equivalent mugraph" in help_text
    for option in ("--budget SECONDS", "--seed", "--workers", "--no-cache", "--log FILE.jsonl", "--trace-only",
                   "--verbose", "{text,json,dot,cuda,ptx}"):
        assert option in help_text


def test_python_dash_m_mdsl():
    done = subprocess.run([sys.executable, "-m", "mdsl", "version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"mdsl {mdsl.__version__}\n")

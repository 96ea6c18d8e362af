"""The documents say what the tree holds: docs/performance.md is what benchmarks/report.py writes from
docs/results/, the README's figures are those results', every repository path or module a document
names exists, none refers to a file outside the repository, and the README's examples run as written."""
from __future__ import annotations

import importlib
import re
import runpy
from pathlib import Path

import numpy as np
import pytest

import mdsl
from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
TOP_LEVEL = ("mdsl/", "docs/", "benchmarks/", "examples/", "scripts/", "tests/")
#: file names the documents mention that are the user's, not the repository's
USER_FILES = {"config.json", "tokenizer.json", "*.safetensors", "plan.png", "search.jsonl"}
#: a figure the README states: a number or a range, then ×, ms or %
FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:–\d+(?:\.\d+)?)?(?:×| ms\b|%)")


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def spans(text: str) -> list:
    """Inline code spans and link targets of the prose."""
    body = prose(text)
    return re.findall(r"`([^`\n]+)`", body) + re.findall(r"\]\(([^)\s]+)\)", body)


def test_performance_md_is_what_the_report_writes():
    expected = report.render()
    assert (ROOT / "docs" / "performance.md").read_text() == expected, "run: python benchmarks/report.py"
    assert expected.count("\n") < 500


def test_every_benchmark_has_its_results_and_each_table_names_its_run():
    results = report.load_results()
    assert [name for name, data in results.items() if data is None and name not in report.OPTIONAL] == []
    text = report.render(results)
    runs = re.findall(r"^Run: (\d{4}-\d\d-\d\d), (.+?), commit `(\w{7})`, `python benchmarks/\S+\.py[^`]*`",
                      text, flags=re.M)
    assert len(runs) == len(report.INPUTS) + sum(results[name] is not None for name in report.OPTIONAL) + \
        len(results["torch_compile"])


def test_the_readme_states_the_results_figures():
    headlines = report.headlines(report.load_results())
    text = prose(README.read_text())
    stated = set(FIGURE.findall(text))
    assert stated, "the README states no figure"
    assert stated <= set(headlines.values()), f"figures the results do not give: {stated - set(headlines.values())}"
    for key in ("kernels_geomean", "kernels_faster", "decode_ms_qwen3-8b", "decode_speedups", "tp_ratio_qwen3-8b"):
        assert headlines[key] in text, f"the README does not state {key} = {headlines[key]}"


def test_the_tried_tables_merge_and_reject_a_malformed_row(tmp_path):
    (tmp_path / "tried-a.md").write_text("intro\n\n| idea | measured effect |\n|---|---|\n| x | 1 -> 2 ms |\n"
                                         "| y | 3 -> 4 ms |\n\nafter\n| not | this | table |\n")
    (tmp_path / "tried-b.md").write_text("| Idea | Measured effect |\n| --- | --- |\n| x | again |\n| z | 5 ms |\n")
    assert report.tried_rows(tmp_path) == [("x", "1 -> 2 ms", "tried-a.md"), ("y", "3 -> 4 ms", "tried-a.md"),
                                           ("z", "5 ms", "tried-b.md")]
    (tmp_path / "tried-c.md").write_text("| idea | measured effect |\n|---|---|\n| a | b | c |\n")
    with pytest.raises(ValueError, match="tried-c.md"):
        report.tried_rows(tmp_path)


def test_a_missing_result_is_said_not_invented():
    results = {**report.load_results(), "decode": None}
    text = report.render(results)
    assert "No results: `docs/results/decode.json` is missing." in text
    assert "decode_ms_qwen3-8b" not in report.headlines(results)


def _repository_path(token: str) -> bool:
    return token.startswith(TOP_LEVEL) or token in ("README.md", "pyproject.toml")


def _file_name(token: str) -> bool:
    return bool(re.fullmatch(r"[\w./*-]+\.(py|md|cu|sh|json|gz|png|toml|safetensors)", token))


def _exists(doc: Path, token: str) -> bool:
    token = token.split("#")[0].split(":")[0].rstrip("/.,;")
    if not token:
        return True
    if _repository_path(token):
        return bool(list(ROOT.glob(token))) if "*" in token else (ROOT / token).exists()
    if (doc.parent / token).exists():   # a link relative to the document
        return True
    # a file named by its tail (`runtime/task_plan.py`, `rows.py`): some path in the repository ends with it
    return any(p.as_posix().endswith("/" + token.lstrip("./")) for p in ROOT.glob("**/" + token.split("/")[-1]))


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_a_document_names_exists(doc):
    missing = []
    for span in spans(doc.read_text()):
        for token in span.split():
            token = token.strip("()[],;'\"")
            if token.startswith(("http", "$", "~", "/", "-")) or token in USER_FILES:
                continue
            if _repository_path(token) or _file_name(token.split("#")[0].split(":")[0]):
                if not _exists(doc, token):
                    missing.append(token)
    assert missing == [], f"{doc.name} names paths that are not in the repository: {sorted(set(missing))}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_module_a_document_names_exists(doc):
    names = {m for span in spans(doc.read_text()) for m in re.findall(r"\bmdsl(?:\.\w+)+", span)}
    assert sorted(n for n in names if not _resolves(n)) == []


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_document_refers_outside_the_repository(doc):
    text = doc.read_text()
    outside = [m for m in re.findall(r"(\.\./[\w./-]*|/work/[\w./-]*|shared/design\.md|\b(?:METHOD|toolchain|HOPPER|"
                                     r"KINDS|H200)\.md)", text)]
    assert outside == []


def _readme_python() -> list:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readmes_python_examples_run_as_written(monkeypatch):
    # a search takes a minute: it has tests of its own; here optimize only has to be called as written
    monkeypatch.setattr(mdsl.KernelFunction, "optimize", lambda self, *a, **k: f"plan of {self.graph.name}")
    namespace: dict = {}
    for block in _readme_python():
        exec(compile(block, str(README), "exec"), namespace)
    y = namespace["y"]
    assert y.shape == (2, 6144) and y.dtype == np.float16
    assert namespace["plan"] == "plan of rms_norm_linear"
    # the hand-written block graph computes what the specification does
    fused = namespace["rms_norm_linear_fused"](namespace["x"], namespace["w"])
    assert np.abs(fused.astype(np.float32) - y.astype(np.float32)).max() < 2e-2
    assert namespace["gated_mlp"].graph.outputs[0].type.shape == (8, 4096)


def test_the_readme_shows_the_kernel_that_its_command_optimizes():
    example = runpy.run_path(str(ROOT / "examples" / "rms_norm_linear.py"))["rms_norm_linear"]
    readme_graph = re.search(r"def rms_norm_linear\((.*?)\):", _readme_python()[0]).group(1)
    shapes = [list(v.shape) for v in example.graph.inputs]
    assert re.findall(r"Tensor\[(\d+), (\d+)", readme_graph) == [tuple(map(str, s)) for s in shapes]
    assert "mdsl optimize examples/rms_norm_linear.py:rms_norm_linear" in README.read_text()


def test_the_readmes_error_is_the_examples():
    with pytest.raises(mdsl.MdslError) as caught:
        runpy.run_path(str(ROOT / "examples" / "errors" / "matmul_shapes.py"))["rms_norm_linear"].graph
    first, *rest = str(caught.value).splitlines()
    where, _, message = first.partition("matmul_shapes.py:")
    text = README.read_text()
    assert f"examples/errors/matmul_shapes.py:{message}" in text
    assert all(line in text for line in rest)

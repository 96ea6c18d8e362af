"""IR dumps: nothing unless asked, stderr with `1`, numbered files written atomically into a directory."""
import os

import pytest

import mdsl.ir.dump as dump
from mdsl.ir.dump import dump_ir
from mdsl.ir.text import parse
from tests.strategies import EXAMPLES, example_graphs


@pytest.fixture
def graph():
    return example_graphs()["rms_norm_linear"]


@pytest.mark.parametrize("value", [None, "", "0"])
def test_off_does_nothing(monkeypatch, capsys, tmp_path, graph, value):
    monkeypatch.chdir(tmp_path)
    if value is None:
        monkeypatch.delenv("MDSL_DUMP_IR", raising=False)
    else:
        monkeypatch.setenv("MDSL_DUMP_IR", value)
    monkeypatch.setattr(dump, "print_ir", None)  # it must not even print the graph
    dump_ir("trace", graph)
    assert capsys.readouterr() == ("", "")
    assert list(tmp_path.iterdir()) == []


def test_stderr(monkeypatch, capsys, graph):
    monkeypatch.setenv("MDSL_DUMP_IR", "1")
    dump_ir("canonicalize", graph)
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"// ----- IR after canonicalize -----\n{EXAMPLES['rms_norm_linear']}\n"


def test_directory_gets_numbered_files(monkeypatch, tmp_path, graph):
    target = tmp_path / "dumps"
    monkeypatch.setenv("MDSL_DUMP_IR", str(target))
    monkeypatch.delenv("MDSL_DUMP_IR_DOT", raising=False)
    body = graph.nodes[0].body
    dump_ir("trace", graph)
    dump_ir("search/best candidate", graph)
    dump_ir("block", body)
    assert sorted(os.listdir(target)) == ["01-trace.mdsl", "02-search_best_candidate.mdsl", "03-block.mdsl"]
    assert (target / "01-trace.mdsl").read_text() == EXAMPLES["rms_norm_linear"] + "\n"
    assert parse((target / "02-search_best_candidate.mdsl").read_text()) == graph
    assert parse((target / "03-block.mdsl").read_text()) == body


def test_dot_files_beside(monkeypatch, tmp_path, graph):
    monkeypatch.setenv("MDSL_DUMP_IR", str(tmp_path))
    monkeypatch.setenv("MDSL_DUMP_IR_DOT", "1")
    dump_ir("trace", graph)
    dump_ir("layout", graph)
    assert sorted(os.listdir(tmp_path)) == ["01-trace.dot", "01-trace.mdsl", "02-layout.dot", "02-layout.mdsl"]
    assert (tmp_path / "02-layout.dot").read_text().startswith("digraph mdsl {")


def test_writes_are_atomic(monkeypatch, tmp_path, graph):
    monkeypatch.setenv("MDSL_DUMP_IR", str(tmp_path))
    monkeypatch.delenv("MDSL_DUMP_IR_DOT", raising=False)
    replaced = []
    real_replace = os.replace

    def replace(src, dst):
        # the whole text is in the temp file, in the same directory, before it takes the final name
        assert os.path.dirname(src) == str(tmp_path) and not os.path.exists(dst)
        assert open(src).read() == EXAMPLES["rms_norm_linear"] + "\n"
        replaced.append(os.path.basename(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    dump_ir("trace", graph)
    assert replaced == ["01-trace.mdsl"] and os.listdir(tmp_path) == ["01-trace.mdsl"]


def test_failed_write_leaves_nothing(monkeypatch, tmp_path, graph):
    monkeypatch.setenv("MDSL_DUMP_IR", str(tmp_path))

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        dump_ir("trace", graph)
    assert os.listdir(tmp_path) == []

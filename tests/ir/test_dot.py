"""The DOT form: one cluster per graph-defined node, and text Graphviz can read."""
import re
import shutil
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings

from mdsl.ir import KernelGraph, Node, f16
from mdsl.ir.dot import to_dot
from mdsl.ir.graph import make_var
from tests.strategies import example_graphs, kernel_graphs

_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_VERTEX = re.compile(r"^\s*(n\d+) \[label=", re.MULTILINE)
_EDGE = re.compile(r"^\s*(\S+) -> (\S+?)(?: \[label=.*\])?;$", re.MULTILINE)


def _graph_defined(graph) -> int:
    """The number of nodes with a body, nested ones included."""
    return sum(1 + _graph_defined(n.body) for n in graph.nodes if n.body is not None)


def check_well_formed(dot: str) -> None:
    """Balanced braces and brackets outside strings, every edge between declared vertices."""
    bare = _QUOTED.sub('""', dot)
    assert '"' not in _QUOTED.sub("", dot), "an unterminated string"
    depth = 0
    for ch in bare:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0
    assert depth == 0 and bare.count("[") == bare.count("]")
    vertices = _VERTEX.findall(dot)
    assert len(vertices) == len(set(vertices))
    edges = _EDGE.findall(dot)
    assert edges and all(src in vertices and dst in vertices for src, dst in edges)
    assert bare.count("->") == len(edges)


@pytest.mark.parametrize("name", ["rms_norm_linear", "attention", "row_stats", "layout"])
def test_examples(name):
    g = example_graphs()[name]
    dot = to_dot(g)
    check_well_formed(dot)
    assert dot.startswith("digraph mdsl {") and dot.endswith("}\n")
    assert dot.count("subgraph cluster_") == _graph_defined(g)


def test_block_graph_details():
    dot = to_dot(example_graphs()["rms_norm_linear"])
    assert 'label="custom: block grid=[48, 1, 1] threads=128 forloop=64"' in dot
    assert 'label="fused: thread"' in dot
    assert re.search(r'n0 -> n\d+ \[label="imap=\[-, -, -\] fmap=1"\];', dot)  # %x feeds %bx
    assert re.search(r'n1 -> n\d+ \[label="imap=\[1, -, -\] fmap=0"\];', dot)
    assert 'label="out %o omap=[1, -, -]\\n%y: f16[16, 6144]", shape="house"' in dot
    assert 'label="accum_rms {eps=1e-06}\\n%r: f16[16, 1]", shape="box", style="filled,bold"' in dot
    assert 'label="matmul\\n%m: f16[16, 128]", shape="box"];' in dot  # not an accumulator: plain
    assert 'label="return %y: f16[16, 6144]", shape="ellipse"' in dot


def test_edges_sit_outside_clusters():
    # an edge written inside a cluster would pull a kernel input into it
    dot = to_dot(example_graphs()["attention"])
    edge_lines = [ln for ln in dot.splitlines() if "->" in ln]
    assert all(ln.startswith("  n") for ln in edge_lines)
    assert dot.index("subgraph cluster_0") > dot.index('n2 [label="%v: f16[2, 128, 64]"')


def test_multi_output_edges_name_the_value():
    dot = to_dot(example_graphs()["layout"])
    assert re.search(r'n\d+ -> n\d+ \[label="%a"\];', dot) and re.search(r'n\d+ -> n\d+ \[label="%b"\];', dot)


def test_standalone_block_and_thread_graphs():
    custom = example_graphs()["attention"].nodes[1]
    dot = to_dot(custom.body)
    check_well_formed_without_edges_into_inputs(dot)
    assert dot.count("subgraph cluster_") == 1
    assert 'in %bk: f16[1, 64, 32]\\nimap=[0, -, -] fmap=2' in dot  # no edge to carry the maps
    thread = example_graphs()["rms_norm_linear"].nodes[0].body.nodes[3].body
    check_well_formed_without_edges_into_inputs(to_dot(thread))


def check_well_formed_without_edges_into_inputs(dot: str) -> None:
    check_well_formed(dot)
    inputs = re.findall(r'(n\d+) \[label="in ', dot)
    assert inputs and not any(dst in inputs for _, dst in _EDGE.findall(dot))


def test_names_are_escaped():
    x, y = make_var("x", [2], f16), make_var("y", [2], f16)
    g = KernelGraph('we"ird\\name\n{}', [x], [Node("exp", [x], [y])], [y])
    dot = to_dot(g)
    check_well_formed(dot)
    assert 'label="kernel we\\"ird\\\\name\\n{}"' in dot


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kernel_graphs())
def test_random_graphs(g):
    dot = to_dot(g)
    check_well_formed(dot)
    assert dot.count("subgraph cluster_") == _graph_defined(g)


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_graphviz_reads_it():
    for g in example_graphs().values():
        subprocess.run(["dot", "-Tsvg"], input=to_dot(g), text=True, check=True, capture_output=True)

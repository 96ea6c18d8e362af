"""The textual IR: exact round trips at every level, and errors that point at the bad line."""
import math

import pytest
from hypothesis import HealthCheck, given, settings

from mdsl.errors import MdslError, ParseError, ShapeError, SourceLoc, UnsupportedError, ValidationError
from mdsl.ir import BlockGraph, KernelGraph, Node, ThreadGraph, f16, f32
from mdsl.ir.graph import make_var
from mdsl.ir.ops import get_op
from mdsl.ir.text import parse, parse_graph, print_block_graph, print_graph, print_node, print_thread_graph
from tests.strategies import EXAMPLES, FILE_NAMES, all_locs, example_graphs, kernel_graphs

HEADER = "kernel k(%x: f16[16, 4096], %w: f16[4096, 6144]) {"


def _node(op, inputs, outputs, loc=None, body=None, **attrs):
    return Node(op, inputs, outputs, get_op(op).normalize_attrs(attrs), body, loc)


def _rms_norm_linear() -> KernelGraph:
    x, w = make_var("x", [16, 4096], f16), make_var("w", [4096, 6144], f16)
    t0, t1 = make_var("t0", [16, 4096], f16), make_var("t1", [16, 6144], f16)
    loc = SourceLoc("/path/examples/rms_norm_linear.py", 8, 11, 27)
    return KernelGraph("rms_norm_linear", [x, w],
                       [_node("rms_norm", [x], [t0], loc), _node("matmul", [t0, w], [t1])], [t1])


def test_prints_the_documented_format():
    assert print_graph(_rms_norm_linear()) == """\
kernel rms_norm_linear(%x: f16[16, 4096], %w: f16[4096, 6144]) {
  %t0: f16[16, 4096] = rms_norm(%x) {dim=-1, eps=1e-06}  # @ /path/examples/rms_norm_linear.py:8:11-27
  %t1: f16[16, 6144] = matmul(%t0, %w)
  return %t1
}"""


def test_str_of_graphs_is_their_text():
    g = example_graphs()["rms_norm_linear"]
    assert str(g) == EXAMPLES["rms_norm_linear"]
    assert str(g.nodes[0].body) == print_block_graph(g.nodes[0].body)


def test_constructed_graph_round_trips_with_locs():
    g = _rms_norm_linear()
    back = parse(print_graph(g))
    assert back == g
    assert all_locs(back) == all_locs(g)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_hand_written_examples_round_trip_exactly(name):
    text = EXAMPLES[name]
    g = parse(text)
    assert print_graph(g) == text
    assert parse(print_graph(g)) == g


def test_examples_cover_every_accumulator_and_a_thread_graph():
    ops = set()
    for g in example_graphs().values():
        for n in g.nodes:
            ops.add(n.op)
            for m in (n.body.nodes if n.body is not None else ()):
                ops.add(m.op)
                ops.update(k.op for k in (m.body.nodes if m.body is not None else ()))
    assert {"accum", "accum_sum", "accum_mean", "accum_rms", "accum_max", "accum_rescale",
            "accum_sum_rescale", "fused", "silu", "split", "concat", "reshape", "transpose"} <= ops


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kernel_graphs())
def test_random_graphs_round_trip(g):
    text = print_graph(g)
    back = parse(text)
    assert back == g
    assert all_locs(back) == all_locs(g)
    assert print_graph(back) == text


# --- values ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [1e-06, 0.5, -0.0, 1e300, 5e-324, 0.1 + 0.2, 3.0])
def test_float_attributes_read_back_bit_exact(value):
    x, y = make_var("x", [4], f32), make_var("y", [4], f32)
    g = KernelGraph("k", [x], [_node("mul_scalar", [x], [y], value=value)], [y])
    text = print_graph(g)
    back = parse(text).nodes[0].attr("value")
    assert math.copysign(1, back) == math.copysign(1, value) and back == value
    assert print_graph(parse(text)) == text


def test_infinite_clamp_bounds_read_back():
    text = "kernel k(%x: f32[4]) {\n  %y: f32[4] = clamp(%x) {min=-inf, max=inf}\n  return %y\n}"
    g = parse(text)
    assert g.nodes[0].attrs == (("min", -math.inf), ("max", math.inf))
    assert print_graph(g) == text


def test_bool_dtype_and_list_attributes():
    text = ("kernel k(%x: f16[2, 3, 4]) {\n"
            "  %s: f16[2, 1, 4] = sum(%x) {dim=1, keepdim=true}\n"
            "  %c: bf16[2, 1, 4] = cast(%s) {dtype=bf16}\n"
            "  %t: bf16[4, 2, 1] = transpose(%c) {perm=[2, 0, 1]}\n"
            "  %r: bf16[8] = reshape(%t) {shape=[8]}\n"
            "  return %r\n}")
    g = parse(text)
    assert g.nodes[0].attr("keepdim") is True
    assert g.nodes[3].attr("shape") == (8,)
    assert print_graph(g) == text


@pytest.mark.parametrize("file", FILE_NAMES)
@pytest.mark.parametrize("col,end_col", [(None, None), (4, None), (4, 17), (None, 9), (0, 0)])
def test_source_locations_read_back(file, col, end_col):
    loc = SourceLoc(file, 12, col, end_col)
    x, y = make_var("x", [4], f32), make_var("y", [4], f32)
    g = KernelGraph("k", [x], [_node("exp", [x], [y], loc)], [y])
    assert parse(print_graph(g)).nodes[0].loc == loc


def test_location_comment_text():
    line = print_graph(_rms_norm_linear()).splitlines()[1]
    assert line.endswith("  # @ /path/examples/rms_norm_linear.py:8:11-27")


def test_any_identifier_names():
    names = ["in", "out", "return", "kernel", "block", "thread", "inf", "nan", "true", "a.b.c", "_", "X9"]
    vs = [make_var(n, [2], f16) for n in names]
    nodes = [_node("neg", [a], [b]) for a, b in zip(vs, vs[1:])]
    for kernel_name in ("nan", "kernel", "a.b"):
        g = KernelGraph(kernel_name, vs[:1], nodes, [vs[-1]])
        assert parse(print_graph(g)) == g


def test_comments_blank_lines_and_indentation_are_ignored():
    messy = """
# a graph written by hand
kernel k(%x: f16[16, 4096], %w: f16[4096, 6144]) {   # the inputs

      %t0: f16[16, 4096] = rms_norm(%x) {dim=-1, eps=1e-06}  # just a note
%t1: f16[16, 6144] = matmul(%t0, %w)
  # @ a.py:1 on a line of its own is a comment too
  return %t1   # done
}
"""
    g = parse(messy)
    assert g.nodes[0].loc is None
    assert print_graph(g) == HEADER + """
  %t0: f16[16, 4096] = rms_norm(%x) {dim=-1, eps=1e-06}
  %t1: f16[16, 6144] = matmul(%t0, %w)
  return %t1
}"""


def test_attributes_are_printed_in_registry_order():
    g = parse(HEADER + "\n  %t0: f16[16, 4096] = rms_norm(%x) {eps=0.5, dim=1}\n  return %t0\n}")
    assert "rms_norm(%x) {dim=1, eps=0.5}" in print_graph(g)


# --- block and thread graphs on their own ----------------------------------------------------------

def test_block_graph_round_trips_alone_and_indented():
    body = example_graphs()["attention"].nodes[1].body
    text = print_block_graph(body)
    assert text.startswith("block(grid=[2, 1, 1], threads=128, forloop=4) {\n  in %bq: f16[1, 16, 64] imap=[0, -, -] fmap=-")
    assert parse(text) == body
    assert print_block_graph(parse(text)) == text
    indented = print_block_graph(body, indent=4)
    assert indented.splitlines()[1].startswith("      in %bq") and indented.endswith("\n    }")
    assert parse(indented) == body


def test_thread_graph_round_trips_alone():
    tg = example_graphs()["rms_norm_linear"].nodes[0].body.nodes[3].body
    assert isinstance(tg, ThreadGraph)
    text = print_thread_graph(tg)
    assert text.splitlines()[0] == "thread {" and "  in %q: f16[16, 1]" in text and text.endswith("  out %s\n}")
    back = parse(text)
    assert back == tg and all_locs(back) == all_locs(tg)


def test_print_node_of_a_custom_node():
    node = example_graphs()["row_stats"].nodes[0]
    lines = print_node(node, indent=2).splitlines()
    assert lines[0].startswith("  %st: f32[32, 2], %ms: f32[32, 2] = custom(%a, %b) block(grid=[4, 2, 1]")
    assert lines[1] == "    in %ta: f32[8, 8] imap=[0, 1, -] fmap=1"
    assert lines[-1] == "  }"


def test_block_names_are_scoped_to_their_block():
    # the block reads %x under the kernel's name for another value: scopes are separate
    text = """\
kernel k(%x: f32[8, 4]) {
  %y: f32[8, 4] = custom(%x) block(grid=[2, 1, 1], threads=32, forloop=1) {
    in %x: f32[4, 4] imap=[0, -, -] fmap=-
    %y: f32[4, 4] = accum(%x)
    out %y omap=[0, -, -]
  }
  return %y
}"""
    assert print_graph(parse(text)) == text
    bad = text.replace("%y: f32[4, 4] = accum(%x)", "%z: f32[4, 4] = accum(%w)")
    with pytest.raises(ParseError, match=r"undefined value %w") as e:
        parse(bad)
    assert e.value.loc.line == 4


# --- errors ------------------------------------------------------------------------------------

def _error(text, kind=MdslError):
    with pytest.raises(kind) as e:
        parse(text)
    return e.value


def _kernel(*lines):
    return "\n".join([HEADER, *lines, "}"])


def test_bad_character():
    line = "  %t0: f16[16, 4096] = rms_norm(%x) $"
    e = _error(_kernel(line, "  return %t0"), ParseError)
    assert (e.loc.file, e.loc.line, e.loc.col) == ("<text>", 2, line.index("$"))
    assert "'$'" in e.message


def test_bad_token_says_what_was_expected():
    e = _error(_kernel("  %t0 f16[16, 4096] = rms_norm(%x)", "  return %t0"), ParseError)
    assert (e.loc.line, e.loc.col) == (2, 6)
    assert e.message == "expected ':', got 'f16'"
    assert str(e).startswith("<text>:2:7: expected ':'")


def test_unknown_dtype():
    e = _error(_kernel("  %t0: f64[16, 4096] = rms_norm(%x)", "  return %t0"), ParseError)
    assert (e.loc.line, e.loc.col) == (2, 7) and "a dtype" in e.message


def test_undefined_name():
    line = "  %t1: f16[16, 6144] = matmul(%x, %nope)"
    e = _error(_kernel(line, "  return %t1"), ParseError)
    assert (e.loc.line, e.loc.col) == (2, line.index("%nope"))
    assert e.message == "undefined value %nope"


def test_undefined_output():
    e = _error(_kernel("  return %t1"), ParseError)
    assert e.loc.line == 2 and "%t1" in e.message


def test_name_defined_twice():
    e = _error(_kernel("  %x: f16[16, 4096] = exp(%x)", "  return %x"), ParseError)
    assert e.loc.line == 2 and "already defined" in e.message


def test_unknown_operator_carries_the_line():
    line = "  %t1: f16[16, 4096] = frobnicate(%t0)"
    e = _error(_kernel("  %t0: f16[16, 4096] = exp(%x)", line, "  return %t1"), UnsupportedError)
    assert (e.loc.file, e.loc.line, e.loc.col) == ("<text>", 3, line.index("frobnicate"))
    assert "frobnicate" in e.message


@pytest.mark.parametrize("attrs,needle", [
    ("{dim=-1, epsilon=1e-06}", "epsilon"),
    ("{dim=1.5}", "dim"),
    ("{dim=true}", "dim"),
    ("{dim=-1, dim=0}", "twice"),
    ("{dim=-1, eps=f16}", "eps"),
])
def test_bad_attribute(attrs, needle):
    e = _error(_kernel("  %t0: f16[16, 4096] = exp(%x)", f"  %t1: f16[16, 4096] = rms_norm(%t0) {attrs}",
                       "  return %t1"), ParseError)
    assert e.loc.line == 3 and needle in e.message


def test_missing_required_attribute():
    e = _error(_kernel("  %s: f16[16] = sum(%x)", "  return %s"), ParseError)
    assert e.loc.line == 2 and "'dim'" in e.message


def test_invalid_graph_points_at_the_text_line():
    # the declared type is wrong; the node's own `# @` loc is the user's file, but the error shows the text line
    e = _error(_kernel("  %t0: f16[16, 4096] = exp(%x)",
                       "  %t1: f16[16, 6000] = matmul(%t0, %w)  # @ user.py:7:2-9", "  return %t1"), ShapeError)
    assert (e.loc.file, e.loc.line) == ("<text>", 3)
    assert "f16[16, 6144]" in e.message


def test_invalid_block_graph_points_at_the_custom_node():
    text = """\
kernel k(%x: f32[8, 4]) {
  %y: f32[4, 4] = exp(%x)  # fine
  %z: f32[8, 4] = custom(%x) block(grid=[2, 1, 1], threads=32, forloop=1) {
    in %bx: f32[4, 4] imap=[0, -, -] fmap=-
    %e: f32[4, 4] = exp(%bx)
    out %e omap=[0, -, -]
  }
  return %z
}"""
    e = _error(text.replace("%y: f32[4, 4]", "%y: f32[8, 4]"), ValidationError)
    assert e.loc.line == 3 and "accumulator" in e.message
    e = _error(text, ShapeError)
    assert e.loc.line == 2


def test_validation_can_be_skipped():
    g = parse(_kernel("  %t1: f16[1, 1] = matmul(%x, %w)", "  return %t1"), validate=False)
    assert g.nodes[0].outputs[0].shape == (1, 1)


@pytest.mark.parametrize("text,line,expected", [
    (_kernel("  %t1: f16[16, 6144] = matmul(%x, %w)", "  return %t1")[:-2], 4, "expected '}', got end of text"),
    (HEADER + "\n  return %x\n}\n}", 4, "expected end of text, got '}'"),
    ("graph k() {\n}", 1, "expected 'kernel', 'block' or 'thread'"),
    (_kernel("  %t1: f16[16, 6144] = matmul(%x, %w) extra", "  return %t1"), 2, "expected end of line, got 'extra'"),
    (_kernel("  %t1: f16[16, 6144] = matmul(%x, %w)  # @ nowhere", "  return %t1"), 2, "source location"),
    (_kernel("  in %t1: f16[16, 6144]", "  return %t1"), 2, "expected a node"),
    ("block(grid=[1, 1, 1], threads=32, forloop=1) {\n  out %x omap=[-, -, -]\n}", 2, "undefined value %x"),
    ("block(grid=[1, 1, 1, 1], threads=32, forloop=1) {\n}", 1, "at most 3"),
    ("block(grid=[2], threads=32, forloop=1) {\n  in %x: f16[2] imap=[0, -, -, -] fmap=-\n}", 2, "at most 3"),
    ("block(threads=32) {\n}", 1, "expected 'grid'"),
])
def test_syntax_errors(text, line, expected):
    e = _error(text, ParseError)
    assert e.loc.line == line
    assert expected in e.message


def test_parse_graph_wants_a_kernel():
    with pytest.raises(ParseError, match="expected a kernel graph"):
        parse_graph("thread {\n}")
    assert isinstance(parse("thread {\n}"), ThreadGraph)
    assert isinstance(parse("block(grid=[], threads=32, forloop=1) {\n}"), BlockGraph)

"""Abstract expressions: the term language, each operator's rule, and the pass over whole graphs."""
import pickle
import subprocess
import sys
from fractions import Fraction

import pytest

from mdsl.errors import ParseError, UnsupportedError
from mdsl.ir import OPS, BlockGraph, BlockInput, BlockOutput, KernelGraph, Node, ThreadGraph, Var, get_op
from mdsl.ir.dtypes import f16, f32
from mdsl.ir.types import TensorType
from mdsl.ir.validate import input_tile_type, validate_kernel_graph
from mdsl.passes import abstract as A
from mdsl.passes.abstract import (abstract_terms, block_terms, node_terms, output_terms, parse_term, rebuild,
                                  strip_max_subtraction, subterms)

P = parse_term
pytestmark = pytest.mark.timeout(30)


def v(name, *shape, dtype=f32):
    return Var(name, TensorType(shape, dtype))


def make_node(op, inputs, **attrs):
    opdef = get_op(op)
    pairs = opdef.normalize_attrs(attrs)
    types = opdef.infer_types(tuple(x.type for x in inputs), pairs)
    return Node(op, inputs, [v(f"out{k}", *t.shape, dtype=t.dtype) for k, t in enumerate(types)], pairs)


def rule(op, shapes, args=None, forloop=1, **attrs):
    """The printed output terms of `op` on inputs of `shapes` whose terms are `args` (x0, x1, ...)."""
    node = make_node(op, [v(f"in{k}", *s) for k, s in enumerate(shapes)], **attrs)
    args = [P(a) for a in args] if args else [A.var(k) for k in range(len(shapes))]
    return [str(t) for t in node_terms(node, args, forloop)]


# ---------------------------------------------------------------------------------------------
# the term language

def test_terms_are_hash_consed_and_print_readably():
    t = A.reduction("sum", 4096, A.mul(A.var(0), A.var(1)))
    assert t is P("sum(4096, mul(x0, x1))")
    assert str(t) == "sum(4096, mul(x0, x1))"
    assert hash(t) == hash(P("sum(4096, mul(x1, x0))"))
    with pytest.raises(AttributeError):
        t.head = "max"


def test_terms_survive_pickling_as_the_same_object():
    t = P("div(sum(4096, mul(x0, x1)), rms(4096, x0))")
    assert pickle.loads(pickle.dumps(t)) is t


@pytest.mark.parametrize("text", [
    "sum(4096, mul(x0, x1))", "mul(const(1/4096), sum(4096, x0))", "clamp(-3/2, 6, exp(x0))", "pow(x0, 0.1)",
    "concat[-1: 256, 16](x0, x1)", "concat[?: 2, 3](x0, x1)", "max(4, neg(x3))", "div(x0, rms(64, x0))",
    "add(gelu(x0), reciprocal(x7), relu(x1), rsqrt(x2), sigmoid(x3), silu(x4), sqrt(x5), square(x6))",
])
def test_printing_and_parsing_round_trip(text):
    t = P(text)
    assert str(t) == text
    assert P(str(t)) is t


@pytest.mark.parametrize("text, canonical", [
    ("sum(4, sum(16, x0))", "sum(64, x0)"),                               # nested sums merge
    ("max(2, max(8, x0))", "max(16, x0)"),
    ("sum(1, x0)", "x0"),                                                 # a sum over one element
    ("add(x1, add(x0, x2))", "add(x0, x1, x2)"),                          # flattened and sorted
    ("mul(x2, mul(x1, x0))", "mul(x0, x1, x2)"),
    ("add(x0, const(0))", "x0"),
    ("mul(const(2), x0, const(3))", "mul(const(6), x0)"),                 # constants fold
    ("neg(neg(x0))", "x0"),
    ("div(x0, const(4))", "mul(const(1/4), x0)"),
    ("sum(8, mul(x0, const(1/2)))", "mul(const(1/2), sum(8, x0))"),       # constant factors leave a sum
    ("sum(8, mul(sum(2, x0), const(3)))", "mul(const(3), sum(16, x0))"),  # ... so partial sums still merge
    ("sum(8, neg(x0))", "neg(sum(8, x0))"),
    ("concat[-1: 4, 4](x0, x0)", "x0"),                                   # identical pieces
    ("pow(x0, 1)", "x0"),
])
def test_constructors_canonicalise(text, canonical):
    assert str(P(text)) == canonical


def test_no_cancellation_in_canonical_forms():
    assert str(P("div(mul(x0, x1), x1)")) == "div(mul(x0, x1), x1)"
    assert str(P("add(x0, neg(x0))")) == "add(neg(x0), x0)"


@pytest.mark.parametrize("text", ["sum(4, x0", "foo(x0)", "sum(x0, 4)", "x0 x1", "concat[1 2](x0)"])
def test_parse_errors(text):
    with pytest.raises(ParseError):
        P(text)


def test_subterms_children_first():
    t = P("div(exp(x0), sum(4, exp(x0)))")
    assert [str(s) for s in subterms(t)] == ["x0", "exp(x0)", "sum(4, exp(x0))", str(t)]


def test_rebuild_canonicalises():
    t = P("sum(4, add(x0, x1))")
    assert rebuild(t, [P("sum(2, x0)")]) is P("sum(8, x0)")
    assert rebuild(P("clamp(0, 6, x0)"), [P("x1")]) is P("clamp(0, 6, x1)")


# ---------------------------------------------------------------------------------------------
# one rule per operator

def test_every_operator_has_an_abstract_rule():
    assert not A.ABSTRACT_RULES.missing(OPS), "operators without an abstract-expression rule"


def test_an_operator_without_a_rule_is_reported(monkeypatch):
    monkeypatch.delitem(A.ABSTRACT_RULES, "matmul")
    with pytest.raises(UnsupportedError, match="the abstract-expression pass has no rule for matmul"):
        rule("matmul", [(4, 8), (8, 2)])


@pytest.mark.parametrize("op", sorted(A.unary_heads() - {"neg"}))
def test_elementwise_unary_ops_map_one_to_one(op):
    assert rule(op, [(4, 8)]) == [f"{op}(x0)"]


@pytest.mark.parametrize("op, attrs, expected", [
    ("neg", {}, "neg(x0)"),
    ("mul_scalar", {"value": 0.5}, "mul(const(1/2), x0)"),
    ("add_scalar", {"value": 3.0}, "add(const(3), x0)"),
    ("pow_scalar", {"exponent": 3.0}, "pow(x0, 3)"),
    ("clamp", {"min": -1.0, "max": 6.0}, "clamp(-1, 6, x0)"),
    ("cast", {"dtype": "f16"}, "x0"),
])
def test_scalar_and_layout_free_unary_ops(op, attrs, expected):
    assert rule(op, [(4, 8)], **attrs) == [expected]


@pytest.mark.parametrize("op, expected", [
    ("add", "add(x0, x1)"), ("sub", "add(neg(x1), x0)"), ("mul", "mul(x0, x1)"), ("div", "div(x0, x1)"),
])
def test_binary_ops(op, expected):
    assert rule(op, [(4, 8), (1, 8)]) == [expected]


def test_exp_strips_a_subtracted_max():
    assert rule("exp", [(4, 8)], ["add(x0, neg(max(8, x0)))"]) == ["exp(x0)"]
    assert rule("exp", [(4, 8)], ["add(x0, neg(x1))"]) == ["exp(add(neg(x1), x0))"]
    assert strip_max_subtraction(P("neg(max(8, x0))")) is P("neg(max(8, x0))")


def test_matmul_sums_over_the_contracted_dim():
    assert rule("matmul", [(2, 16, 64), (2, 64, 32)]) == ["sum(64, mul(x0, x1))"]


def test_matmul_of_concatenations_along_the_contracted_dim_adds_two_matmuls():
    # LoRA: (X | X.A) . (W ; B) = X.W + X.A.B
    x_xa = "concat[-1: 256, 16](sum(256, mul(x0, x2)), x0)"
    w_b = "concat[-2: 256, 16](x1, x3)"
    out = rule("matmul", [(16, 272), (272, 4096)], [x_xa, w_b])
    assert out == [str(P("add(sum(256, mul(sum(256, mul(x0, x2)), x1)), sum(16, mul(x0, x3)))"))]
    # along another dim the concat stays inside
    assert rule("matmul", [(32, 8), (8, 4)], ["concat[-2: 16, 16](x0, x1)", "x2"]) == \
        ["sum(8, mul(concat[-2: 16, 16](x0, x1), x2))"]


@pytest.mark.parametrize("op, dim, expected", [
    ("sum", 1, "sum(32, x0)"), ("sum", 0, "sum(8, x0)"), ("max", -1, "max(32, x0)"),
    ("mean", 1, "mul(const(1/32), sum(32, x0))"),
])
def test_reductions(op, dim, expected):
    assert rule(op, [(8, 32)], dim=dim) == [expected]
    assert rule(op, [(8, 32)], dim=dim, keepdim=True) == [expected]


def test_a_reduction_over_one_element_is_the_identity():
    assert rule("sum", [(8, 1)], dim=1) == ["x0"]


def test_rms_norm_drops_eps():
    assert rule("rms_norm", [(16, 4096)], eps=1e-5) == ["div(x0, rms(4096, x0))"]
    assert rule("rms_norm", [(16, 4096)], dim=0) == ["div(x0, rms(16, x0))"]


def test_concat_and_split():
    assert rule("concat", [(4, 8), (4, 2)], dim=1) == ["concat[-1: 8, 2](x0, x1)"]
    assert rule("concat", [(4, 8), (4, 8)], ["exp(x0)", "exp(x0)"], dim=0) == ["exp(x0)"]
    assert rule("split", [(4, 10)], ["concat[-1: 8, 2](x0, x1)"], dim=1, sizes=(8, 2)) == ["x0", "x1"]
    assert rule("split", [(4, 10)], ["concat[-1: 8, 2](x0, x1)"], dim=1, sizes=(5, 5)) == \
        ["concat[-1: 8, 2](x0, x1)"] * 2
    assert rule("split", [(4, 10)], dim=1, sizes=(5, 5)) == ["x0", "x0"]


def test_layout_ops_are_the_identity():
    assert rule("reshape", [(4, 8)], shape=(32,)) == ["x0"]
    assert rule("transpose", [(4, 8)], perm=(1, 0)) == ["x0"]
    # a transpose moves a concat's dim; a reshape forgets it
    assert rule("transpose", [(4, 8, 10)], ["concat[-1: 8, 2](x0, x1)"], perm=(2, 0, 1)) == \
        ["concat[-3: 8, 2](x0, x1)"]
    assert rule("reshape", [(4, 10)], ["concat[-1: 8, 2](x0, x1)"], shape=(40,)) == ["concat[?: 8, 2](x0, x1)"]


@pytest.mark.parametrize("op, expected", [
    ("accum", "sum(4, x0)"),
    ("accum_sum", "sum(256, x0)"),
    ("accum_mean", "mul(const(1/256), sum(256, x0))"),
    ("accum_rms", "rms(256, x0)"),
    ("accum_max", "max(4, x0)"),
])
def test_accumulators_reduce_over_the_loop(op, expected):
    assert rule(op, [(16, 64)], forloop=4) == [expected]


@pytest.mark.parametrize("op, expected", [("accum_rescale", "sum(4, x0)"), ("accum_sum_rescale", "sum(256, x0)")])
def test_rescaling_accumulators_drop_their_scale(op, expected):
    assert rule(op, [(16, 64), (16, 1)], forloop=4) == [expected]


def test_accumulating_a_partial_sum_merges_the_sums():
    assert rule("accum", [(16, 64)], ["sum(256, mul(x0, x1))"], forloop=16) == ["sum(4096, mul(x0, x1))"]


# ---------------------------------------------------------------------------------------------
# the pass over graphs; graph-defined ops are inlined

def test_abstract_terms_of_a_kernel_graph():
    x, w = v("x", 16, 4096, dtype=f16), v("w", 4096, 6144, dtype=f16)
    norm = make_node("rms_norm", [x])
    y = norm.output
    mm = make_node("matmul", [y, w])
    out = Var("out", mm.output.type)
    mm = Node("matmul", [y, w], [out])
    g = KernelGraph("rms_norm_linear", [x, w], [norm, mm], [out])
    validate_kernel_graph(g)
    terms = abstract_terms(g)
    assert str(terms["x"]) == "x0" and str(terms["w"]) == "x1"
    assert str(terms[y.name]) == "div(x0, rms(4096, x0))"
    assert str(terms["out"]) == "sum(4096, mul(div(x0, rms(4096, x0)), x1))"
    assert output_terms(g) == (terms["out"],)


def _block_graph():
    """A custom op computing exp(x) @ w with the contraction over a loop of 4: tiles [8, 16] and [16, 32]."""
    x, w = v("x", 8, 64), v("w", 64, 32)
    xt = v("xt", *input_tile_type(x.type, (1, 1, 1), 4, (None, None, None), 1).shape)
    wt = v("wt", *input_tile_type(w.type, (1, 1, 1), 4, (None, None, None), 0).shape)
    e = Node("exp", [xt], [v("e", 8, 16)])
    mm = Node("matmul", [e.output, wt], [v("mm", 8, 32)])
    acc = Node("accum", [mm.output], [v("acc", 8, 32)])
    body = BlockGraph((1, 1, 1), 128, 4, [BlockInput(xt, (None,), 1), BlockInput(wt, (None,), 0)],
                      [e, mm, acc], [BlockOutput(acc.output, (None,))])
    return x, w, body


def test_custom_ops_inline_their_block_graph():
    x, w, body = _block_graph()
    out = v("out", 8, 32)
    g = KernelGraph("k", [x, w], [Node("custom", [x, w], [out], body=body)], [out])
    validate_kernel_graph(g)
    assert str(abstract_terms(g)["out"]) == "sum(64, mul(exp(x0), x1))"


def test_block_terms_of_a_partial_block_graph():
    _, _, body = _block_graph()
    partial = BlockGraph(body.grid, body.threads, body.forloop, body.inputs, body.nodes[:2], ())
    terms = block_terms(partial, [P("x3"), P("x1")])
    assert {k: str(t) for k, t in terms.items()} == {
        "xt": "x3", "wt": "x1", "e": "exp(x3)", "mm": "sum(16, mul(exp(x3), x1))"}
    with pytest.raises(ValueError):
        block_terms(partial, [P("x0")])


def test_fused_thread_graphs_inline():
    a, b = v("a", 8, 16), v("b", 8, 16)
    s = Node("silu", [a], [v("s", 8, 16)])
    m = Node("mul", [s.output, b], [v("m", 8, 16)])
    tg = ThreadGraph([a, b], [s, m], [m.output])
    node = Node("fused", [v("p", 8, 16), v("q", 8, 16)], [v("r", 8, 16)], body=tg)
    assert [str(t) for t in node_terms(node, [P("x0"), P("exp(x1)")])] == ["mul(exp(x1), silu(x0))"]


def test_abstract_does_not_import_z3():
    code = "import sys, mdsl.passes.abstract; assert 'z3' not in sys.modules, 'z3 imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_constants_are_exact():
    assert P("const(0.1)").param == Fraction(0.1)
    assert str(P("const(0.1)")) == "const(0.1)"

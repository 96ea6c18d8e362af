"""The subexpression check: each axiom, its near misses, the pre-check, caching, limits, and the terms
of whole candidate graphs (RMSNorm + Linear fused, online-softmax attention)."""
import os
import signal
import threading
import time

import pytest

from mdsl.ir import BlockGraph, BlockInput, BlockOutput, KernelGraph, Node, TensorType, Var, get_op
from mdsl.ir.dtypes import f16
from mdsl.ir.validate import input_tile_type, validate_block_graph, validate_kernel_graph
from mdsl.passes.abstract import block_terms, output_terms, parse_term, unary_heads, var
from mdsl.passes.subexpr import OutOfTime, SubexprChecker

P = parse_term
pytestmark = pytest.mark.timeout(30)


def check(target: str, term: str, **options) -> tuple:
    checker = SubexprChecker([P(target)], **options)
    return checker.is_subexpression(P(term)), checker.stats


# ---------------------------------------------------------------------------------------------
# one query per axiom: (what, target, a term the axiom makes a subexpression, a near miss)

AXIOMS = [
    ("A_sub 1 reflexivity", "mul(x0, x1)", "mul(x0, x1)", "mul(x0, x0)"),
    ("A_sub 2 transitivity", "exp(sqrt(x0))", "x0", "sqrt(exp(x0))"),
    ("A_sub 3 add", "exp(add(x0, x1))", "x1", "mul(x0, x1)"),
    ("A_sub 4 mul", "exp(mul(x0, x1))", "x1", "add(x0, x1)"),
    ("A_sub 5 numerator", "exp(div(x0, x1))", "x0", "div(x1, x0)"),
    ("A_sub 6 denominator", "exp(div(x0, x1))", "x1", "exp(x1)"),
    *[(f"A_sub 7-12 {h}", f"{h}(add(x0, x1))", "x1", f"{h}(x1)")
      for h in sorted(unary_heads())],
    ("A_sub 13 clamp", "clamp(0, 6, x0)", "x0", "clamp(0, 5, x0)"),
    ("A_sub 13 pow", "pow(x0, 3)", "x0", "pow(x0, 2)"),
    ("A_sub 14 rms", "rms(64, x0)", "x0", "rms(32, x0)"),
    ("A_sub 15 sum", "sum(64, exp(x0))", "exp(x0)", "exp(sum(64, x0))"),
    ("A_sub 16 partial sum", "exp(sum(64, x0))", "sum(16, x0)", "sum(128, x0)"),
    ("A_sub 16 partial max", "exp(max(64, x0))", "max(8, x0)", "max(8, neg(x0))"),
    ("concat pieces", "exp(concat[-1: 4, 4](x0, x1))", "x1", "concat[-1: 4, 4](x1, x0)"),
    ("A_eq 1+3 add comm/assoc", "add(x0, x1, x2)", "add(x0, x2)", "add(x0, x0)"),
    ("A_eq 2+4 mul comm/assoc", "exp(mul(x0, x1, x2))", "mul(x0, x2)", "mul(x0, x0)"),
    ("A_eq 5 distributivity", "mul(add(x0, x1), x2)", "mul(x0, x2)", "add(x0, mul(x1, x2))"),
    ("A_eq 6 div over add", "div(add(x0, x1), x2)", "div(x0, x2)", "div(x0, x1)"),
    ("A_eq 7 mul/div", "mul(x0, div(x1, x2))", "mul(x0, x1)", "mul(x0, x2)"),
    ("A_eq 8+9 sum merge", "sum(4, add(sum(16, x0), x1))", "sum(64, x0)", "sum(128, x0)"),
    ("A_eq 10 sum of add", "sum(8, add(x0, x1))", "sum(8, x1)", "sum(8, mul(x0, x1))"),
    ("A_eq 11 sum of product", "mul(sum(8, x0), x1)", "sum(8, mul(x0, x1))", "sum(8, div(x0, x1))"),
    ("A_eq 11 constant factor", "mul(const(2), sum(64, exp(x0)))", "mul(const(2), sum(8, exp(x0)))",
     "mul(const(2), exp(sum(8, x0)))"),
    ("A_eq 12 sum of quotient", "div(sum(8, x0), x1)", "sum(8, div(x0, x1))", "sum(8, div(x1, x0))"),
    ("negation moves out", "mul(neg(x0), x1)", "neg(mul(x0, x1))", "mul(neg(x0), neg(x1))"),
]


@pytest.mark.parametrize("what, target, implied, near_miss", AXIOMS, ids=[a[0] for a in AXIOMS])
def test_each_axiom_in_z3(what, target, implied, near_miss):
    proved, stats = check(target, implied, precheck=False)
    assert proved and stats.proved == 1, f"{what}: {implied} should be a subexpression of {target}"
    refuted, stats = check(target, near_miss, precheck=False)
    assert not refuted, f"{what}: {near_miss} should not be a subexpression of {target}"
    assert stats.proved == stats.unknown == 0


@pytest.mark.parametrize("what, target, implied, near_miss", AXIOMS, ids=[a[0] for a in AXIOMS])
def test_the_precheck_agrees_with_z3(what, target, implied, near_miss):
    assert check(target, implied)[0]
    assert not check(target, near_miss)[0]


@pytest.mark.parametrize("precheck", [True, False])
def test_cancellation_is_not_an_axiom(precheck):
    assert not check("add(div(mul(x0, x1), x1), x2)", "add(x0, x2)", precheck=precheck)[0]
    assert not check("exp(div(mul(x0, x1), x1))", "exp(x0)", precheck=precheck)[0]


def test_a_sum_over_3_is_not_a_subexpression_of_a_sum_over_4():
    answer, stats = check("sum(4, x0)", "sum(3, x0)")
    assert not answer and stats.syntactic == 1
    answer, stats = check("sum(4, x0)", "sum(3, x0)", precheck=False)   # 3 cannot even be encoded
    assert not answer and stats.z3_calls == 0
    assert check("sum(12, x0)", "sum(3, x0)", precheck=False)[0]       # 12 = 2^2 * 3


def test_swapping_matmul_operands_between_inputs_fails():
    gated_mlp = "mul(silu(sum(4096, mul(x0, x1))), sum(4096, mul(x0, x2)))"
    swapped = "mul(silu(sum(4096, mul(x0, x2))), sum(4096, mul(x0, x1)))"
    answer, stats = check(gated_mlp, swapped)
    assert not answer and stats.z3_calls == 1
    assert check(gated_mlp, "sum(4096, mul(x0, x2, silu(sum(4096, mul(x0, x1)))))")[0]


@pytest.mark.parametrize("term", ["exp(x0)", "x3", "sum(8, mul(x0, const(2)))", "rms(8, x0)", "max(16, exp(x0))"])
def test_heads_inputs_and_parameters_the_target_lacks_fail_without_z3(term):
    answer, stats = check("sum(8, mul(x0, x1))", term)
    assert not answer and stats.z3_calls == 0 and stats.syntactic >= 1


@pytest.mark.parametrize("term", ["mul(x0, x1)", "sum(8, mul(x1, x0))", "sum(2, mul(x0, x1))", "add(x2, x0)"])
def test_literal_subterms_pass_without_z3(term):
    answer, stats = check("exp(add(x0, sum(8, mul(x0, x1)), x2))", term)
    assert answer and stats.z3_calls == 0


def test_several_targets():
    checker = SubexprChecker([P("sum(64, mul(x0, x1))"), P("exp(x2)")])
    assert checker.is_subexpression(P("exp(x2)"))
    assert checker.is_subexpression(P("sum(8, mul(x0, x1))"))
    assert not checker.is_subexpression(P("exp(mul(x0, x1))"))
    with pytest.raises(ValueError):
        SubexprChecker([])


# ---------------------------------------------------------------------------------------------
# online-softmax stabilisers

SCORES = "sum(64, mul(x0, x1))"
ATTENTION = f"sum(4096, mul(div(exp({SCORES}), sum(4096, exp({SCORES}))), x2))"


@pytest.mark.parametrize("term", [f"max(256, {SCORES})", f"add({SCORES}, neg(max(256, {SCORES})))",
                                  f"max(4096, {SCORES})"])
def test_the_max_that_softmax_subtracts_is_accepted(term):
    assert check(ATTENTION, term)[0]


def test_a_max_that_no_exponent_subtracts_is_not():
    assert not check(ATTENTION, "max(256, x2)")[0]
    assert not check(ATTENTION, "add(x2, neg(max(256, x2)))")[0]


# ---------------------------------------------------------------------------------------------
# caching, limits, determinism

def test_a_repeated_query_hits_the_cache():
    checker = SubexprChecker([P(ATTENTION)])
    term = P(f"sum(256, mul(exp({SCORES}), x2))")
    assert checker.is_subexpression(term)
    assert (checker.stats.z3_calls, checker.stats.cache_hits) == (1, 0)
    assert checker.is_subexpression(term)
    assert (checker.stats.z3_calls, checker.stats.cache_hits) == (1, 1)
    assert checker.stats.queries == 2 and checker.stats.z3_seconds > 0


def test_an_unknown_answer_is_counted_and_prunes():
    hard = f"div(sum(4096, mul(exp({SCORES}), x2)), sum(4096, exp({SCORES})))"
    answer, stats = check(ATTENTION, hard, rlimit=1_000)
    assert not answer and stats.unknown == 1 and stats.proved == 0
    answer, stats = check(ATTENTION, hard)
    assert answer and stats.proved == 1


LORA = "add(sum(256, mul(x0, x1)), sum(16, mul(sum(256, mul(x0, x2)), x3)))"


@pytest.mark.parametrize("options", [{}, {"rlimit": 10**9, "timeout_ms": 300}])
def test_a_query_whose_instantiations_blow_up_ends(options):
    answer, stats = check(LORA, f"mul({LORA}, {LORA})", **options)
    assert not answer and stats.unknown == 1


def test_a_query_stops_when_the_callers_time_runs_out_and_answers_nothing():
    left = {"until": time.monotonic() + 0.3}
    checker = SubexprChecker([P(LORA)], rlimit=10**9, timeout_ms=10_000,
                             time_left=lambda: left["until"] - time.monotonic())
    blow_up = P(f"mul({LORA}, {LORA})")
    with pytest.raises(OutOfTime):
        checker.is_subexpression(blow_up)
    assert checker.stats.z3_calls == 1 and checker.stats.unknown == 0   # no answer, so none counted
    with pytest.raises(OutOfTime):   # no time left: no query starts
        checker.is_subexpression(blow_up)
    assert checker.stats.z3_calls == 1
    left["until"] = time.monotonic() + 60   # more time: the query runs again (nothing was cached)
    checker.timeout_ms = 300
    assert not checker.is_subexpression(blow_up) and checker.stats.z3_calls == 2 and checker.stats.unknown == 1


def test_ctrl_c_during_a_query_is_not_swallowed():
    # z3's own Ctrl-C trap would end the query as `unknown` (pruning the term) and drop the signal
    checker = SubexprChecker([P(LORA)], rlimit=10**9, timeout_ms=3_000)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            checker.is_subexpression(P(f"mul({LORA}, {LORA})"))
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert checker.stats.unknown == 0 and not checker.stats.refuted


def test_answers_do_not_depend_on_query_order():
    terms = [P(t) for t in (f"sum(256, mul(exp({SCORES}), x2))", f"mul(exp({SCORES}), x1)", "sum(16, mul(x0, x1))",
                            f"div(exp({SCORES}), sum(2048, exp({SCORES})))", f"mul(x2, exp({SCORES}))")]
    forward = SubexprChecker([P(ATTENTION)])
    backward = SubexprChecker([P(ATTENTION)])
    answers = [forward.is_subexpression(t) for t in terms]
    assert answers == [backward.is_subexpression(t) for t in reversed(terms)][::-1]
    assert answers == [True, False, True, False, True]


# ---------------------------------------------------------------------------------------------
# whole graphs

class Builder:
    """Appends nodes with inferred output types."""

    def __init__(self):
        self.nodes = []

    def __call__(self, op, *inputs, body=None, out_types=None, **attrs):
        opdef = get_op(op)
        pairs = opdef.normalize_attrs(attrs)
        types = out_types or opdef.infer_types(tuple(x.type for x in inputs), pairs)
        outs = [Var(f"{op}{len(self.nodes)}_{k}", t) for k, t in enumerate(types)]
        self.nodes.append(Node(op, inputs, outs, pairs, body=body))
        return outs[0] if len(outs) == 1 else outs


def tensor(name, *shape):
    return Var(name, TensorType(shape, f16))


def tile(name, tensor_var, grid, forloop, imap, fmap):
    return BlockInput(Var(name, input_tile_type(tensor_var.type, grid, forloop, imap, fmap)), imap, fmap)


def custom_graph(name, inputs, body):
    k = Builder()
    outs = k("custom", *inputs, body=body, out_types=validate_block_graph(body, tuple(x.type for x in inputs)))
    graph = KernelGraph(name, inputs, k.nodes, outs if isinstance(outs, list) else [outs])
    validate_kernel_graph(graph)
    return graph


def rms_norm_linear():
    """rms_norm(X) @ W, and the fused block graph: X's tile replicated over the grid and cut by the
    loop (fmap 1), W cut by the grid (imap 1) and the loop (fmap 0); matmul -> accum; accum_rms of
    X's tile; the division after the loop."""
    x, w = tensor("x", 16, 4096), tensor("w", 4096, 6144)
    k = Builder()
    reference = KernelGraph("rms_norm_linear", [x, w], k.nodes, [k("matmul", k("rms_norm", x), w)])
    validate_kernel_graph(reference)
    grid, loop = (96, 1, 1), 16
    xt = tile("xt", x, grid, loop, (None, None, None), 1)
    wt = tile("wt", w, grid, loop, (1, None, None), 0)
    b = Builder()
    y = b("div", b("accum", b("matmul", xt.var, wt.var)), b("accum_rms", xt.var))
    body = BlockGraph(grid, 128, loop, [xt, wt], b.nodes, [BlockOutput(y, (1, None, None))])
    return reference, custom_graph("rms_norm_linear_fused", [x, w], body)


def attention():
    """softmax(Q.K).V (max-subtracted), and a flash-decoding block graph: blocks over heads and
    query rows, the loop over the keys, online softmax with accum_rescale / accum_sum_rescale, and
    the running max kept by accum_max as a second output."""
    q, kk, v = tensor("q", 2, 256, 64), tensor("k", 2, 64, 4096), tensor("v", 2, 4096, 64)
    k = Builder()
    s = k("matmul", q, kk)
    e = k("exp", k("sub", s, k("max", s, dim=2, keepdim=True)))
    out = k("matmul", k("div", e, k("sum", e, dim=2, keepdim=True)), v)
    reference = KernelGraph("attention", [q, kk, v], k.nodes, [out])
    validate_kernel_graph(reference)
    grid, loop = (2, 4, 1), 16
    qt = tile("qt", q, grid, loop, (0, 1, None), None)
    kt = tile("kt", kk, grid, loop, (0, None, None), 2)
    vt = tile("vt", v, grid, loop, (0, None, None), 1)
    b = Builder()
    s = b("matmul", qt.var, kt.var)
    m = b("max", s, dim=2, keepdim=True)
    e = b("exp", b("sub", s, m))
    o = b("accum_rescale", b("matmul", e, vt.var), m)
    y = b("div", o, b("accum_sum_rescale", e, m))
    running_max = b("accum_max", m)
    body = BlockGraph(grid, 128, loop, [qt, kt, vt], b.nodes,
                      [BlockOutput(y, (0, 1, None)), BlockOutput(running_max, (0, 1, None))])
    return reference, custom_graph("flash_decoding", [q, kk, v], body)


def test_rms_norm_linear_terms():
    reference, fused = rms_norm_linear()
    (target,), (candidate,) = output_terms(reference), output_terms(fused)
    assert str(target) == "sum(4096, mul(div(x0, rms(4096, x0)), x1))"
    assert str(candidate) == "div(sum(4096, mul(x0, x1)), rms(4096, x0))"


def test_rms_norm_linear_fused_is_equivalent_and_every_tile_is_a_subexpression():
    reference, fused = rms_norm_linear()
    (target,), (candidate,) = output_terms(reference), output_terms(fused)
    assert SubexprChecker([target]).is_subexpression(candidate)
    assert SubexprChecker([candidate]).is_subexpression(target)
    checker = SubexprChecker([target])
    body = fused.nodes[0].body
    for name, term in block_terms(body, [var(0), var(1)]).items():
        assert checker.is_subexpression(term), f"%{name} = {term}"


def test_a_wrong_accumulator_is_pruned():
    reference, fused = rms_norm_linear()
    body = fused.nodes[0].body
    mm = body.nodes[0]
    wrong = Node("accum_sum", [mm.output], [Var("acc", TensorType((16, 1), f16))])   # also sums the tile's columns
    terms = block_terms(BlockGraph(body.grid, body.threads, body.forloop, body.inputs, [mm, wrong], ()),
                        [var(0), var(1)])
    assert str(terms["acc"]) == "sum(262144, mul(x0, x1))"
    assert not SubexprChecker(output_terms(reference)).is_subexpression(terms["acc"])


def test_attention_terms():
    reference, flash = attention()
    (target,) = output_terms(reference)
    assert target is P(ATTENTION)
    out, running_max = output_terms(flash)
    assert out is P(f"div(sum(4096, mul(exp({SCORES}), x2)), sum(4096, exp({SCORES})))")
    assert running_max is P(f"max(4096, {SCORES})")


def test_flash_decoding_terms_are_subexpressions_of_attention():
    reference, flash = attention()
    (target,) = output_terms(reference)
    out, running_max = output_terms(flash)
    checker = SubexprChecker([target])
    terms = block_terms(flash.nodes[0].body, [var(0), var(1), var(2)])
    for name, term in terms.items():
        assert checker.is_subexpression(term), f"%{name} = {term}"
    assert checker.is_subexpression(running_max)
    assert SubexprChecker([out]).is_subexpression(target)    # and equivalent
    assert checker.stats.unknown == 0

"""The verifier: it accepts correct rewrites (fused kernels, online softmax, algebraic identities) with a
stated false-pass probability, and rejects every kind of mutant of them, each still a valid graph."""
from __future__ import annotations

import math
from typing import Callable

import attrs
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import mdsl
from mdsl import Tensor, f16
from mdsl.backend.reference import run_kernel_graph
from mdsl.errors import ValidationError
from mdsl.ir import KernelGraph, Node, Var, get_op, validate_kernel_graph
from mdsl.passes import float_check
from mdsl.passes import verify as verifier
from mdsl.passes.verify import degree_bound, verify
from tests.strategies import kernel_graphs
from tests.test_examples import example

pytestmark = pytest.mark.timeout(60)

TESTS = 3
SHAPES = dict(kv_len=64, queries=8, head_dim=4)   # GQA / QKNorm: 2 heads
HEADS = 2
EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# programs: the examples' factories at small shapes, and a few written here

def rms_norm_linear(grid_x=4, forloop=8):
    rnl = example("rms_norm_linear")
    return rnl.make_rms_norm_linear(1, k=64, n=48), rnl.make_rms_norm_linear_fused(2, 64, 48, grid_x, forloop)


def gated_mlp():
    mlp = example("gated_mlp")
    return mlp.make_gated_mlp(4, 64, 32), mlp.make_gated_mlp_fused(4, 64, 32, grid_x=4, forloop=8)


def gqa_block_combine():
    gqa = example("gqa")
    return gqa.make_gqa(1, **SHAPES), gqa.make_gqa_flash(1, splits=4, forloop=2, row_blocks=2, **SHAPES)


def gqa_kernel_combine(splits=4, forloop=2, kv_len=64, queries=8, head_dim=4):
    """Flash decoding whose partial results are combined by kernel-level operators."""
    @mdsl.kernel(name="gqa_kernel_combine")
    def flash(q: Tensor[HEADS, queries, head_dim, f16], k: Tensor[HEADS, head_dim, kv_len, f16],
              v: Tensor[HEADS, kv_len, head_dim, f16]):
        with mdsl.block_graph(grid=(HEADS, splits), forloop=forloop) as b:
            qt = b.input(q, imap=(0, None))
            kt = b.input(k, imap=(0, 2), fmap=2)
            vt = b.input(v, imap=(0, 1), fmap=1)
            s = qt @ kt
            m = mdsl.max(s, -1, keepdim=True)
            e = mdsl.exp(s - m)
            b.output(b.accum_rescale(e @ vt, m), omap=(0, 2))
            b.output(b.accum_sum_rescale(e, m), omap=(0, 2))
            b.output(b.accum_max(m), omap=(0, 2))
        o, l_sum, m_split = b.results
        o = mdsl.reshape(o, HEADS, queries, splits, head_dim)
        l_sum, m_split = (mdsl.reshape(t, HEADS, queries, splits, 1) for t in (l_sum, m_split))
        weight = mdsl.exp(m_split - mdsl.max(m_split, 2, keepdim=True))
        return mdsl.sum(o * weight, 2) / mdsl.sum(l_sum * weight, 2)

    return example("gqa").make_gqa(1, **SHAPES), flash


def head_tiles(b, q, k, v) -> tuple:
    """An attention block graph's inputs, one block per head: Q whole, K and V walked along the sequence."""
    return b.input(q, imap=(0,)), b.input(k, imap=(0,), fmap=2), b.input(v, imap=(0,), fmap=1)


def gqa_without_max(forloop=4, kv_len=64, queries=8, head_dim=4):
    """Attention in one kernel that sums exp(Q·K)·V and exp(Q·K) with no maximum subtracted: equal in
    exact arithmetic, and its float32 tiles keep standard-normal logits in range, but exp overflows
    once Q and K are scaled up (the plan the exhaustive enumerator once found for GQA)."""
    @mdsl.kernel(name="gqa_without_max")
    def unsafe(q: Tensor[HEADS, queries, head_dim, f16], k: Tensor[HEADS, head_dim, kv_len, f16],
               v: Tensor[HEADS, kv_len, head_dim, f16]):
        with mdsl.block_graph(grid=(HEADS,), forloop=forloop) as b:
            qt, kt, vt = head_tiles(b, q, k, v)
            e = mdsl.exp(qt @ kt)
            b.output(b.accum(e @ vt) / b.accum_sum(e), omap=(0,))
        return b.results[0]

    return example("gqa").make_gqa(1, **SHAPES), unsafe


def qknorm_fused(forloop=4, kv_len=64, queries=8, head_dim=4):
    """QKNorm + attention in one kernel: both norms on the tiles, online softmax over KV chunks."""
    @mdsl.kernel(name="qknorm_fused")
    def fused(q: Tensor[HEADS, queries, head_dim, f16], k: Tensor[HEADS, head_dim, kv_len, f16],
              v: Tensor[HEADS, kv_len, head_dim, f16]):
        with mdsl.block_graph(grid=(HEADS,), forloop=forloop) as b:
            qt, kt, vt = head_tiles(b, q, k, v)
            s = mdsl.rms_norm(qt, -1, eps=EPS) @ mdsl.rms_norm(kt, dim=1, eps=EPS)
            m = mdsl.max(s, -1, keepdim=True)
            e = mdsl.exp(s - m)
            b.output(b.accum_rescale(e @ vt, m) / b.accum_sum_rescale(e, m), omap=(0,))
        return b.results[0]

    return example("qknorm").make_qknorm(1, **SHAPES), fused


def qknorm_written_out(kv_len=64, queries=8, head_dim=4):
    """The norms as x · rsqrt(mean(x²) + eps): the same oracle value as rms_norm's square root."""
    def norm(x, dim):
        return x * mdsl.rsqrt(mdsl.mean(mdsl.square(x), dim, keepdim=True) + EPS)

    @mdsl.kernel(name="qknorm_written_out")
    def written(q: Tensor[HEADS, queries, head_dim, f16], k: Tensor[HEADS, head_dim, kv_len, f16],
                v: Tensor[HEADS, kv_len, head_dim, f16]):
        return mdsl.softmax(norm(q, -1) @ norm(k, 1)) @ v

    return example("qknorm").make_qknorm(1, **SHAPES), written


def ntrans_fused(rows=8, hidden=32):
    """nTrans with rms_norm(H) as a custom kernel: accum(h) / accum_rms(h) with a one-step loop."""
    @mdsl.kernel(name="ntrans_fused")
    def fused(h: Tensor[rows, hidden, f16], x: Tensor[rows, hidden, f16], alpha: Tensor[rows, hidden, f16]):
        with mdsl.block_graph(grid=(2,), forloop=1) as b:
            ht = b.input(h, imap=(0,))
            b.output(b.accum(ht) / b.accum_rms(ht, eps=EPS), omap=(0,))
        return mdsl.rms_norm(x + alpha * (b.results[0] - x), eps=EPS)

    return example("ntrans").make_ntrans(1, hidden=hidden), fused


def lora(m=4, k=32, n=64, r=4):
    """X·W + (X·A)·B as one block graph on a 2 x 2 grid (rows x columns), one loop step."""
    @mdsl.kernel(name="lora")
    def spec(x: Tensor[m, k, f16], w: Tensor[k, n, f16], a: Tensor[k, r, f16], b_: Tensor[r, n, f16]):
        return x @ w + x @ a @ b_

    @mdsl.kernel(name="lora_fused")
    def fused(x: Tensor[m, k, f16], w: Tensor[k, n, f16], a: Tensor[k, r, f16], b_: Tensor[r, n, f16]):
        with mdsl.block_graph(grid=(2, 2), forloop=1) as b:
            xt = b.input(x, imap=(0, None))
            wt = b.input(w, imap=(None, 1))
            at = b.input(a)
            bt = b.input(b_, imap=(None, 1))
            b.output(b.accum(xt @ wt + (xt @ at) @ bt), omap=(0, 1))
        return b.results[0]

    return spec, fused


def softmax(n=8, scale=1.0):
    """Max-subtracted softmax against plain exp / sum: equal in exact arithmetic, but the plain one
    overflows in f16 once the inputs are scaled up (by `scale` in the program, or by the large-input
    float test), so it is a mutant, not a correct rewrite."""
    @mdsl.kernel(name="softmax")
    def spec(x: Tensor[n, n, f16]):
        return mdsl.softmax(x * scale)

    @mdsl.kernel(name="plain_softmax")
    def plain(x: Tensor[n, n, f16]):
        e = mdsl.exp(x * scale)
        return e / mdsl.sum(e, -1, keepdim=True)

    return spec, plain


def distributivity(n=8):
    @mdsl.kernel(name="distributed")
    def spec(x: Tensor[n, n, f16], a: Tensor[n, n, f16], b: Tensor[n, n, f16]):
        return x @ (a + b)

    @mdsl.kernel(name="distributed_out")
    def out(x: Tensor[n, n, f16], a: Tensor[n, n, f16], b: Tensor[n, n, f16]):
        return x @ a + x @ b

    return spec, out


def concat_matmul(m=4, k=16, n=8):
    @mdsl.kernel(name="matmul_of_concat")
    def spec(x: Tensor[m, k, f16], w1: Tensor[k, n, f16], w2: Tensor[k, n, f16]):
        return x @ mdsl.concat([w1, w2], dim=1)

    @mdsl.kernel(name="concat_of_matmuls")
    def split_up(x: Tensor[m, k, f16], w1: Tensor[k, n, f16], w2: Tensor[k, n, f16]):
        return mdsl.concat([x @ w1, x @ w2], dim=1)

    return spec, split_up


def sum_splitting(rows=4, n=12, h=5):
    @mdsl.kernel(name="sum")
    def spec(x: Tensor[rows, n, f16]):
        return mdsl.sum(x, 1)

    @mdsl.kernel(name="sum_of_pieces")
    def pieces(x: Tensor[rows, n, f16]):
        a, b = mdsl.split(x, [h, n - h], dim=1)
        return mdsl.sum(a, 1) + mdsl.sum(b, 1)

    return spec, pieces


def weighted_sum_splitting(rows=4, n=12, h=5):
    """2·Σ x[:, :h] + Σ x[:, h:] = Σ x + Σ x[:, :h]: the split's sizes matter."""
    @mdsl.kernel(name="weighted")
    def spec(x: Tensor[rows, n, f16]):
        a, b = mdsl.split(x, [h, n - h], dim=1)
        return mdsl.sum(a, 1) * 2.0 + mdsl.sum(b, 1)

    @mdsl.kernel(name="weighted_merged")
    def merged(x: Tensor[rows, n, f16]):
        a, _ = mdsl.split(x, [h, n - h], dim=1)
        return mdsl.sum(x, 1) + mdsl.sum(a, 1)

    return spec, merged


def mean_as_scaled_sum(rows=4, n=6):
    @mdsl.kernel(name="mean")
    def spec(x: Tensor[rows, n, f16]):
        return mdsl.mean(x, -1)

    @mdsl.kernel(name="scaled_sum")
    def scaled(x: Tensor[rows, n, f16]):
        return mdsl.sum(x, -1) * (1.0 / n)   # 1/6 is not a float: the field reads the rational it rounds

    return spec, scaled


def row_sums(rows=8, n=32):
    @mdsl.kernel(name="row_dot")
    def spec(x: Tensor[rows, n, f16], y: Tensor[rows, n, f16]):
        return mdsl.sum(x * y, -1, keepdim=True)

    @mdsl.kernel(name="row_dot_tiled")
    def tiled(x: Tensor[rows, n, f16], y: Tensor[rows, n, f16]):
        with mdsl.block_graph(grid=(2,), forloop=4) as b:
            xt, yt = b.input(x, imap=(0,), fmap=1), b.input(y, imap=(0,), fmap=1)
            b.output(b.accum_sum(xt * yt), omap=(0,))
        return b.results[0]

    return spec, tiled


def row_max(m=4, k=8, n=32):
    """max over a row as accum_max over the loop of each tile's max."""
    @mdsl.kernel(name="row_max")
    def spec(x: Tensor[m, k, f16], w: Tensor[k, n, f16]):
        return mdsl.max(x @ w, -1, keepdim=True)

    @mdsl.kernel(name="row_max_tiled")
    def tiled(x: Tensor[m, k, f16], w: Tensor[k, n, f16]):
        with mdsl.block_graph(grid=(2,), forloop=4) as b:
            xt, wt = b.input(x, imap=(0,)), b.input(w, fmap=1)
            b.output(b.accum_max(mdsl.max(xt @ wt, -1, keepdim=True)), omap=(0,))
        return b.results[0]

    return spec, tiled


def max_of_maxima(rows=4, n=12, h=5):
    @mdsl.kernel(name="max")
    def spec(x: Tensor[rows, n, f16]):
        return mdsl.max(x, -1, keepdim=True)

    @mdsl.kernel(name="max_of_maxima")
    def merged(x: Tensor[rows, n, f16]):
        a, b = mdsl.split(x, [h, n - h], dim=1)
        return mdsl.max(mdsl.concat([mdsl.max(a, -1, keepdim=True), mdsl.max(b, -1, keepdim=True)], 1), -1,
                        keepdim=True)

    return spec, merged


def two_outputs(m=4, k=16, n=8):
    @mdsl.kernel(name="two_products")
    def spec(x: Tensor[m, k, f16], w1: Tensor[k, n, f16], w2: Tensor[k, n, f16]):
        return x @ w1, x @ w2

    @mdsl.kernel(name="two_products_fused")
    def fused(x: Tensor[m, k, f16], w1: Tensor[k, n, f16], w2: Tensor[k, n, f16]):
        with mdsl.block_graph(grid=(2,), forloop=4) as b:
            xt = b.input(x, fmap=1)
            w1t, w2t = b.input(w1, imap=(1,), fmap=0), b.input(w2, imap=(1,), fmap=0)
            b.output(b.accum(xt @ w1t), omap=(1,))
            b.output(b.accum(xt @ w2t), omap=(1,))
        return b.results

    return spec, fused


def f16_overflow(n=8):
    """x·y as ((x·2^10)·(y·2^10))·2^-20: exact in any field, inf in f16 (2^20·x·y > 65504)."""
    @mdsl.kernel(name="product")
    def spec(x: Tensor[n, n, f16], y: Tensor[n, n, f16]):
        return x * y

    @mdsl.kernel(name="scaled_product")
    def scaled(x: Tensor[n, n, f16], y: Tensor[n, n, f16]):
        return ((x * 1024.0) * (y * 1024.0)) * 2.0 ** -20

    return spec, scaled


CORRECT: dict[str, Callable] = {
    "rms_norm_linear": rms_norm_linear,
    "gated_mlp": gated_mlp,
    "gqa_flash_block_combine": gqa_block_combine,
    "gqa_flash_kernel_combine": gqa_kernel_combine,
    "qknorm_fused": qknorm_fused,
    "qknorm_written_out": qknorm_written_out,
    "ntrans_fused": ntrans_fused,
    "lora": lora,
    "distributivity": distributivity,
    "concat_matmul": concat_matmul,
    "sum_splitting": sum_splitting,
    "weighted_sum_splitting": weighted_sum_splitting,
    "mean_as_scaled_sum": mean_as_scaled_sum,
    "row_sums": row_sums,
    "row_max": row_max,
    "max_of_maxima": max_of_maxima,
    "two_outputs": two_outputs,
}


def graphs(make: Callable) -> tuple:
    spec, candidate = make()
    return spec.graph, candidate.graph


# ---------------------------------------------------------------------------------------------
# correct rewrites are accepted

@pytest.mark.parametrize("name", CORRECT)
def test_correct_rewrites_are_accepted(name):
    original, candidate = graphs(CORRECT[name])
    result = verify(original, candidate, tests=TESTS)
    assert result.equivalent, result.reason
    assert result.finite_field_tests == TESTS
    assert 0 < result.false_pass_probability < 1e-9
    assert result.float_rel_error <= result.float_bound


def test_the_stated_probability_is_the_degree_bound_over_q_per_test():
    original, candidate = graphs(rms_norm_linear)
    one, three = (verify(original, candidate, tests=t) for t in (1, 3))
    d = degree_bound(original, candidate)
    assert 2 ** -24 * d < one.false_pass_probability < 2 ** -23 * d   # q is in [2^23, 2^24)
    assert three.false_pass_probability < one.false_pass_probability ** 2
    assert "false pass <=" in three.reason


def test_verification_is_deterministic_for_a_seed():
    original, candidate = graphs(gqa_block_combine)
    assert verify(original, candidate, seed=5) == verify(original, candidate, seed=5)
    assert verify(original, candidate, seed=5).false_pass_probability != verify(original, candidate,
                                                                                seed=6).false_pass_probability


@given(graph=kernel_graphs(), seed=st.integers(0, 2 ** 32 - 1))
@settings(max_examples=30, deadline=None)
def test_every_valid_graph_is_equivalent_to_itself(graph, seed):
    # (the float reference cannot run a rank-0 transpose: ops.py's rule turns [] into [1])
    assume(not any(n.op == "transpose" and not n.attr("perm") for n in graph.nodes))
    result = verify(graph, graph, tests=1, seed=seed)
    assert result.equivalent, result.reason


def test_the_originals_side_is_computed_once_per_original_seed_and_test(monkeypatch):
    runs = verifier._OriginalRuns()
    monkeypatch.setattr(verifier, "ORIGINAL_RUNS", runs)
    evaluated = []  # for every evaluation: was it the original's?
    for module, name in ((verifier, "run_in_field"), (float_check, "run_kernel_graph")):
        run = getattr(module, name)
        monkeypatch.setattr(module, name, lambda g, *a, run=run, **k: evaluated.append(g is original) or run(g, *a, **k))
    original, candidate = graphs(rms_norm_linear)
    first = verify(original, candidate, seed=4)
    assert (runs.misses, runs.hits) == (TESTS + 2, 0)
    large = runs.runs[float_check.FloatRun.large, TESTS + 1]
    assert large.scale == verifier.LARGE_SCALES[0]
    # a field run per test; float64 and float32 in the float test and at the large test's scale
    assert evaluated.count(True) == TESTS + 4

    evaluated.clear()
    assert verify(original, candidate, seed=4) == first
    _, bad = mutant("eps_changed")
    assert not verify(original, bad, seed=4).equivalent   # rejected in the first test, from its cached run
    assert (runs.misses, runs.hits) == (TESTS + 2, TESTS + 3)
    assert evaluated == [False] * (TESTS + 3)    # only the candidates ran: each test, then the float tests

    assert verify(original, candidate, seed=5) != first   # another seed draws afresh
    assert runs.misses == 2 * (TESTS + 2) and runs.key == (original.key, 5)


def test_processes_sharing_a_directory_make_each_original_run_once(tmp_path, monkeypatch):
    original, candidate = graphs(rms_norm_linear)
    alone = verify(original, candidate, seed=4)
    evaluated = []  # for every evaluation: was it the original's?
    for module, name in ((verifier, "run_in_field"), (float_check, "run_kernel_graph")):
        run = getattr(module, name)
        monkeypatch.setattr(module, name, lambda g, *a, run=run, **k: evaluated.append(g is original) or run(g, *a, **k))
    first, second, late = verifier._OriginalRuns(), verifier._OriginalRuns(), verifier._OriginalRuns()
    for runs in (first, second, late):
        runs.share(tmp_path)
    monkeypatch.setattr(verifier, "ORIGINAL_RUNS", first)
    verifier.prepare(original, tests=TESTS, seed=4)
    assert evaluated == [True] * (TESTS + 4)   # made here, and written to the directory
    evaluated.clear()
    monkeypatch.setattr(verifier, "ORIGINAL_RUNS", second)
    assert verify(original, candidate, seed=4) == alone
    assert evaluated == [False] * (TESTS + 2)  # read from the directory: only the candidate ran
    # a run claimed by another process and not written yet is left to it, or waited for
    (tmp_path / "other").mkdir()
    late.share(tmp_path / "other")
    (tmp_path / "other" / next(tmp_path.glob("*FieldRun.of-0.claim")).name).touch()
    assert late.get(verifier._FieldRun.of, original, 4, 0, wait=False) is verifier._ELSEWHERE


def overflowing_exp(n=8):
    @mdsl.kernel(name="exp16")
    def spec(x: Tensor[n, n, f16]):
        return mdsl.exp(x * 16.0)           # inf in f16 wherever x > 0.7

    @mdsl.kernel(name="exp16_squared")
    def squared(x: Tensor[n, n, f16]):
        return mdsl.square(mdsl.exp(x * 8.0))   # overflows where the spec does, and only there

    return spec, squared


def test_a_softmax_without_its_maximum_is_caught_by_the_large_input_test_alone():
    original, unsafe = mutant("attention_without_max")
    normal = float_check.FloatRun.of(original, np.random.default_rng(0))
    assert normal.test(unsafe)[2] is None   # standard-normal logits stay in float32's range
    result = verify(original, unsafe, tests=TESTS)
    assert result.reason.startswith(f"float test on inputs scaled by {verifier.LARGE_SCALES[0]:g}"), result.reason


@pytest.mark.parametrize("name", ["gqa_flash_block_combine", "gqa_flash_kernel_combine", "qknorm_fused"])
def test_online_softmax_passes_the_large_input_test(name):
    original, candidate = graphs(CORRECT[name])
    large = float_check.FloatRun.large(original, np.random.default_rng(0))
    assert large is not None and large.scale == verifier.LARGE_SCALES[0]
    error, bound, failure = large.test(candidate)
    assert failure is None and error <= bound


def test_no_large_input_test_where_every_scale_overflows_the_original():
    @mdsl.kernel(name="high_power")
    def high_power(x: Tensor[8, 8, f16]):
        return mdsl.square(mdsl.square(mdsl.square(x)) * x) * 1000.0   # 1000·x^18: inf in f16 at x = 2

    assert float_check.FloatRun.large(high_power.graph, np.random.default_rng(0)) is None
    result = verify(high_power.graph, high_power.graph)
    assert result.equivalent and "no large-input test" in result.reason


def test_a_candidate_may_overflow_only_where_the_original_does():
    original, candidate = graphs(overflowing_exp)
    assert verify(original, candidate).equivalent
    assert verify(original, original).equivalent


# ---------------------------------------------------------------------------------------------
# signatures

def test_inputs_must_match():
    original, _ = graphs(rms_norm_linear)
    other, _ = graphs(gated_mlp)
    with pytest.raises(ValidationError, match=r"candidate gated_mlp takes \(f16\[4, 64\], .*but the original"):
        verify(original, other)
    retyped = attrs.evolve(original, inputs=[Var(v.name, v.type.with_dtype(mdsl.f32)) for v in original.inputs])
    with pytest.raises(ValidationError, match="takes"):
        verify(original, retyped)
    with pytest.raises(ValueError, match="at least one"):
        verify(original, original, tests=0)


def two_outputs_in_f32(m=4, k=16, n=8):
    @mdsl.kernel(name="two_products_f32")
    def wide(x: Tensor[m, k, f16], w1: Tensor[k, n, f16], w2: Tensor[k, n, f16]):
        return mdsl.cast(x @ w1, mdsl.f32), mdsl.cast(x @ w2, mdsl.f32)

    return wide


def test_outputs_must_match():
    original, candidate = graphs(two_outputs)
    result = verify(original, attrs.evolve(candidate, outputs=candidate.outputs[:1]))
    assert not result.equivalent
    assert result.reason == "the candidate returns (f16[4, 8]), the original (f16[4, 8], f16[4, 8])"
    wide = two_outputs_in_f32().graph
    assert "returns (f32[4, 8], f32[4, 8])" in verify(original, wide).reason
    assert verify(original, wide, dtypes_check=False).equivalent  # shapes only: an f32 result is fine


# ---------------------------------------------------------------------------------------------
# mutants: small edits of correct graphs, each still valid

def edit(graph: KernelGraph, op: str, change: Callable, nth: int = 0) -> KernelGraph:
    """Replace the nth node applying `op` (kernel nodes in order, each custom body before the nodes after
    it) by change(node)."""
    seen = 0

    def nodes(ns):
        nonlocal seen
        out = []
        for node in ns:
            if node.op == op:
                node = change(node) if seen == nth else node
                seen += 1
            elif node.body is not None:
                node = attrs.evolve(node, body=attrs.evolve(node.body, nodes=nodes(node.body.nodes)))
            out.append(node)
        return out

    edited = attrs.evolve(graph, nodes=nodes(graph.nodes))
    assert seen > nth, f"{graph.name} has no {op} #{nth}"
    return edited


def edit_block(graph: KernelGraph, change: Callable, nth: int = 0) -> KernelGraph:
    """Replace the body of the nth custom node by change(body)."""
    return edit(graph, "custom", lambda n: attrs.evolve(n, body=change(n.body)), nth)


def with_attrs(**changes) -> Callable:
    return lambda n: attrs.evolve(n, attrs=n.opdef.normalize_attrs({**n.attr_dict, **changes}))


def as_op(op: str, inputs: slice = slice(None)) -> Callable:
    """Another operator on (some of) the same inputs, with its default attributes."""
    def change(n: Node) -> Node:
        opdef = get_op(op)
        kept = {k: v for k, v in n.attrs if any(spec.name == k for spec in opdef.attr_specs)}
        return attrs.evolve(n, op=op, inputs=n.inputs[inputs], attrs=opdef.normalize_attrs(kept))
    return change


def swapped(n: Node) -> Node:
    return attrs.evolve(n, inputs=n.inputs[::-1])


def retype(graph: KernelGraph, types: dict) -> KernelGraph:
    """Give kernel values new types (name -> type) wherever they appear."""
    def fix(v: Var) -> Var:
        return Var(v.name, types[v.name]) if v.name in types else v

    nodes = [attrs.evolve(n, inputs=[fix(v) for v in n.inputs], outputs=[fix(v) for v in n.outputs])
             for n in graph.nodes]
    return attrs.evolve(graph, nodes=nodes, outputs=[fix(v) for v in graph.outputs])


def transpose_operand(graph: KernelGraph, k: int) -> KernelGraph:
    """Insert a transpose of operand k before the first kernel-level matmul."""
    i = next(i for i, n in enumerate(graph.nodes) if n.op == "matmul")
    matmul = graph.nodes[i]
    operand = matmul.inputs[k]
    flipped = Var(operand.name + "_T", operand.type.with_shape(operand.shape[::-1]))
    transpose = Node("transpose", [operand], [flipped], get_op("transpose").normalize_attrs({"perm": (1, 0)}))
    inputs = list(matmul.inputs)
    inputs[k] = flipped
    nodes = list(graph.nodes)
    nodes[i:i + 1] = [transpose, attrs.evolve(matmul, inputs=inputs)]
    return attrs.evolve(graph, nodes=nodes)


def off_by_one_split(graph: KernelGraph) -> KernelGraph:
    node = next(n for n in graph.nodes if n.op == "split")
    sizes = (node.attr("sizes")[0] + 1, node.attr("sizes")[1] - 1)
    graph = edit(graph, "split", with_attrs(sizes=sizes))
    return retype(graph, {v.name: v.type.with_shape(v.shape[:-1] + (s,)) for v, s in zip(node.outputs, sizes)})


def sum_over_columns(graph: KernelGraph) -> KernelGraph:
    """softmax's row sums (keepdim, square input) taken over the columns: [n, 1] becomes [1, n]."""
    total = next(n for n in graph.nodes if n.op == "sum").output
    graph = edit(graph, "sum", with_attrs(dim=0))
    return retype(graph, {total.name: total.type.with_shape(total.shape[::-1])})


def block_output_before_division(body):
    """The block saves the numerator of its final division instead of the quotient."""
    (division,) = [n for n in body.nodes if n.op == "div"]
    out = attrs.evolve(body.outputs[0], var=division.inputs[0])
    return attrs.evolve(body, outputs=[out])


def imap_on_the_other_grid_dim(body):
    """LoRA's W columns follow grid x (the row blocks) instead of grid y."""
    inputs = list(body.inputs)
    inputs[1] = attrs.evolve(inputs[1], imap=(1, None, None))
    return attrs.evolve(body, inputs=inputs)


def omaps_swapped(body):
    return attrs.evolve(body, outputs=[attrs.evolve(o, omap=(o.omap[1], o.omap[0], o.omap[2])) for o in body.outputs])


def loop_over_columns(body):
    """W split over the grid by rows and walked by the loop along its columns (grid == forloop keeps
    the tile's shape): the wrong fmap."""
    inputs = list(body.inputs)
    inputs[1] = attrs.evolve(inputs[1], imap=(0, None, None), fmap=1)
    return attrs.evolve(body, inputs=inputs)


def without_adapter(body):
    """LoRA's block accumulates X·W alone: the low-rank term X·A·B is dropped from the sum."""
    first_product = next(n for n in body.nodes if n.op == "matmul").output
    nodes = [attrs.evolve(n, inputs=[first_product]) if n.op == "accum" else n for n in body.nodes]
    return attrs.evolve(body, nodes=nodes)


def without_silu(body):
    """The gated MLP multiplies the two products with no silu on the gate."""
    (silu,) = [n for n in body.nodes if n.op == "silu"]
    nodes = [attrs.evolve(n, inputs=[silu.inputs[0], n.inputs[1]]) if n.op == "mul" else n for n in body.nodes]
    return attrs.evolve(body, nodes=nodes)


def correct(name: str) -> Callable:
    return lambda: graphs(CORRECT[name])


def spec_of(make: Callable) -> Callable:
    """The specification as its own correct candidate."""
    return lambda: (graphs(make)[0],) * 2


def drop_rescale(nth: int) -> Callable:
    """The nth accum_rescale(x, m) becomes accum(x): partial sums under different maxima are added."""
    return lambda g: edit(g, "accum_rescale", as_op("accum", slice(0, 1)), nth)


def rms_norm_linear_square_tiles():
    """grid == forloop, so that W's tile keeps its shape when the grid and the loop trade dims."""
    return graphs(lambda: rms_norm_linear(grid_x=4, forloop=4))


#: kind -> (the correct (original, candidate) pair, the edit that breaks the candidate)
MUTANTS: dict[str, tuple] = {
    "sub_operands_swapped": (spec_of(softmax), lambda g: edit(g, "sub", swapped)),
    "div_operands_swapped": (correct("rms_norm_linear"), lambda g: edit(g, "div", swapped)),
    "matmul_operands_swapped": (correct("distributivity"), lambda g: edit(g, "matmul", swapped)),
    "matmul_operand_transposed": (correct("distributivity"), lambda g: transpose_operand(g, 1)),
    "wrong_reduction_dim": (spec_of(softmax), sum_over_columns),
    "split_off_by_one": (correct("weighted_sum_splitting"), off_by_one_split),
    "missing_rescale": (correct("gqa_flash_block_combine"), drop_rescale(0)),
    "missing_rescale_in_combine": (correct("gqa_flash_block_combine"), drop_rescale(1)),
    "eps_changed": (correct("rms_norm_linear"), lambda g: edit(g, "accum_rms", with_attrs(eps=0.0))),
    "accum_mean_for_accum_sum": (correct("row_sums"), lambda g: edit(g, "accum_sum", as_op("accum_mean"))),
    "omaps_swapped": (correct("lora"), lambda g: edit_block(g, omaps_swapped)),
    "wrong_imap": (correct("lora"), lambda g: edit_block(g, imap_on_the_other_grid_dim)),
    "wrong_fmap": (rms_norm_linear_square_tiles, lambda g: edit_block(g, loop_over_columns)),
    "exp_to_sigmoid": (spec_of(softmax), lambda g: edit(g, "exp", as_op("sigmoid"))),
    "silu_to_gelu": (correct("gated_mlp"), lambda g: edit(g, "silu", as_op("gelu"))),
    "missing_normalisation": (correct("gqa_flash_block_combine"),
                              lambda g: edit_block(g, block_output_before_division, nth=1)),
    "scalar_changed": (correct("mean_as_scaled_sum"), lambda g: edit(g, "mul_scalar", with_attrs(value=1.0 / 7))),
    "concat_operands_swapped": (correct("concat_matmul"), lambda g: edit(g, "concat", swapped)),
    "max_to_sum": (correct("row_max"), lambda g: edit(g, "max", as_op("sum"))),
    "accum_max_to_accum": (correct("row_max"), lambda g: edit(g, "accum_max", as_op("accum"))),
    "rms_norm_wrong_dim": (spec_of(qknorm_fused), lambda g: edit(g, "rms_norm", with_attrs(dim=2), nth=1)),
    "outputs_swapped": (correct("two_outputs"), lambda g: attrs.evolve(g, outputs=g.outputs[::-1])),
    "lora_term_dropped": (correct("lora"), lambda g: edit_block(g, without_adapter)),
    "gate_dropped": (correct("gated_mlp"), lambda g: edit_block(g, without_silu)),
    "f16_overflow": (lambda: graphs(f16_overflow), None),
    "softmax_overflow": (lambda: graphs(lambda: softmax(scale=16.0)), None),
    "softmax_without_max": (lambda: graphs(softmax), None),
    "attention_without_max": (lambda: graphs(gqa_without_max), None),
}
# equal in exact arithmetic: only the float tests see them
FLOAT_ONLY = {"f16_overflow", "softmax_overflow", "softmax_without_max", "attention_without_max"}


def mutant(kind: str) -> tuple:
    make, change = MUTANTS[kind]
    original, candidate = make()
    return original, (change(candidate) if change else candidate)


@pytest.mark.parametrize("kind", MUTANTS)
def test_mutants_are_valid_graphs_that_compute_something_else(kind):
    original, bad = mutant(kind)
    validate_kernel_graph(bad)
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(v.shape) for v in original.inputs]
    want, got = run_kernel_graph(original, inputs), run_kernel_graph(bad, inputs)
    differs = any(not np.allclose(w, g, rtol=1e-9, atol=0) for w, g in zip(want, got))
    assert differs == (kind not in FLOAT_ONLY)


@pytest.mark.parametrize("kind", MUTANTS)
def test_mutants_are_rejected(kind):
    original, bad = mutant(kind)
    result = verify(original, bad, tests=TESTS)
    assert not result.equivalent
    assert result.false_pass_probability == 0.0
    if kind in FLOAT_ONLY:
        assert result.finite_field_tests == TESTS and result.reason.startswith("float test"), result.reason
        assert "overflows in float16" in result.reason
    else:
        assert result.reason.startswith("finite-field test 1 of 3"), result.reason


def test_there_are_at_least_twenty_kinds_of_mutant():
    assert len(MUTANTS) >= 20


def test_a_rejection_names_the_output_and_the_test():
    original, bad = mutant("outputs_swapped")
    result = verify(original, bad)
    assert "output 0 (%" in result.reason and "differs in 32 of 32 element(s)" in result.reason
    assert math.isnan(result.float_rel_error)


def test_a_candidate_may_be_as_inaccurate_as_the_original():
    @mdsl.kernel(name="cancellation")
    def spec(x: Tensor[8, 8, f16]):
        return (x + 1000.0) - 1000.0   # f16 keeps x + 1000 to 0.5: the spec itself errs by ~25%

    result = verify(spec.graph, spec.graph)
    assert result.equivalent and result.float_rel_error > 0.05
    assert result.float_bound == pytest.approx(4 * result.float_rel_error)   # ORIGINAL_SLACK x its own error


def test_a_candidate_may_round_across_the_overflow_within_its_error_bound():
    """An exact 65371 (1% under f16's overflow) is 65472 in an f16 original and may be inf in a candidate
    whose error the f16 bound allows; 60000 may not be. An exact 64231 the original itself computes 0.76% off
    (63744) may be, as far as 4 times that error reaches; an exact 60000 computed 0.83% off may not be."""
    reference = np.array([65545.5, 65371.0, 60000.0, -65110.0, 1.0, np.inf, 2.0, 64231.36, 60000.0])
    own = np.array([65472.0, 65472.0, 60000.0, -64384.0, 1.0, np.inf, np.inf, 63744.0, 59500.0])
    judged = float_check.judged_elements(reference, own, f16)
    assert judged.tolist() == [False, False, True, False, True, False, False, False, True]

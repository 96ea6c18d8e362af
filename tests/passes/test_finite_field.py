"""The finite-field semantics: field arithmetic, exp, the random oracles and the random order, every
operator's rule, the generic walk over block graphs, and the degree bounds."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mdsl
from mdsl import Tensor, f32
from mdsl.backend.reference import run_kernel_graph
from mdsl.errors import ValidationError
from mdsl.ir import OPS, evaluate, validate_kernel_graph
from mdsl.passes import finite_field as ff
from mdsl.passes.finite_field import (FIELD_RULES, Field, FieldRule, FieldSemantics, degrees, q_residues_read,
                                      run_in_field, simplest_rational)
from tests.strategies import kernel_graphs
from tests.test_examples import example

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def rng():
    return np.random.default_rng(20250101)


@pytest.fixture
def field(rng):
    return Field.draw(rng)


def residues(field: Field, value: int) -> np.ndarray:
    return np.array([value % field.p, value % field.q])


# ---------------------------------------------------------------------------------------------
# the field

@pytest.mark.parametrize("seed", range(5))
def test_primes(seed):
    f = Field.draw(np.random.default_rng(seed))
    assert ff.is_prime(f.p) and ff.is_prime(f.q)
    assert (f.p - 1) % f.q == 0 and f.p < 2 ** 25 and f.q >= 2 ** 23


def test_every_test_draws_a_fresh_field():
    fields = [Field.draw(np.random.default_rng(s)) for s in range(8)]
    assert len({f.p for f in fields}) == 8 and len({f.omega for f in fields}) == 8
    assert len({f.secret for f in fields}) == 8


def test_is_prime_against_trial_division():
    def slow(n):
        return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))

    assert [n for n in range(3000) if ff.is_prime(n)] == [n for n in range(3000) if slow(n)]
    for carmichael in (561, 1105, 2465, 41041, 825265, 321197185):
        assert not ff.is_prime(carmichael)
    assert ff.is_prime(2 ** 31 - 1) and not ff.is_prime(2 ** 24 + 1)


def test_omega_has_order_q(field):
    assert field.omega != 1 and pow(field.omega, field.q, field.p) == 1


def test_exp_is_omega_to_the_q_residue(field, rng):
    x = field.random((200,), rng)
    got = field.exp(x)[..., 0]
    assert [int(g) for g in got] == [pow(field.omega, int(t), field.p) for t in x[..., 1]]
    assert field.exp(residues(field, 0))[0] == 1


def test_exp_of_a_sum_is_the_product_of_the_exps(field, rng):
    a, b = field.random((50,), rng), field.random((50,), rng)
    np.testing.assert_array_equal(field.exp(field.add(a, b))[..., 0], field.mul(field.exp(a), field.exp(b))[..., 0])
    np.testing.assert_array_equal(field.mul(field.exp(a), field.exp(field.neg(a)))[..., 0], 1)


def test_inverse(field, rng):
    x = field.random((300,), rng)
    x = x[(x != 0).all(axis=-1)]
    np.testing.assert_array_equal(field.mul(x, field.inverse(x)), 1)
    np.testing.assert_array_equal(field.inverse(residues(field, 0)), 0)  # 1/0 := 0, the same in both programs


def test_powers(field, rng):
    x = field.random((20,), rng)
    for n in (0, 1, 2, 5, -3):
        want = np.ones_like(x)
        for _ in range(abs(n)):
            want = field.mul(want, x)
        np.testing.assert_array_equal(field.power(x, n), want if n >= 0 else field.inverse(want))
    # huge exponents are reduced by Fermat's little theorem, zero stays zero
    big = 10 ** 40 + 7
    assert field.power(residues(field, 3), big)[0] == pow(3, big, field.p)
    np.testing.assert_array_equal(field.power(residues(field, 0), big), 0)


def test_matmul_is_exact(field, rng, monkeypatch):
    a = field.random((2, 3, 70), rng)
    b = field.random((70, 5), rng)
    a[0, 0] = [field.p - 1, field.q - 1]  # the largest residues
    b[:, 0] = [field.p - 1, field.q - 1]
    want = [[[sum(int(a[i, j, k, c]) * int(b[k, n, c]) for k in range(70)) % m for c, m in
              enumerate((field.p, field.q))] for n in range(5)] for i in range(2) for j in range(3)]
    got = field.matmul(a, b)
    assert got.reshape(6, 5, 2).tolist() == want
    monkeypatch.setattr(ff, "MATMUL_CHUNK", 16)  # the chunked path for long K
    np.testing.assert_array_equal(field.matmul(a, b), got)
    monkeypatch.setattr(ff, "WIDEN_ELEMENTS", 20)  # pieces of K short enough for a bounded float64 copy
    np.testing.assert_array_equal(field.matmul(a, b), got)
    np.testing.assert_array_equal(field.matmul(a.astype(np.int32), b.astype(np.int32)), got)  # narrow operands


@pytest.mark.parametrize("rows", [1, 3])  # the left operand smaller, then larger, than the right: either is split
@pytest.mark.parametrize("k", [ff.MATMUL_CHUNK, 2 * ff.MATMUL_CHUNK + 3])
def test_matmul_is_exact_at_the_largest_residues_and_k(field, rng, rows, k):
    # residues just below the moduli: every float64 partial sum is as large as it can get
    largest = np.array([field.p, field.q])
    a, b = largest - rng.integers(1, 100, (rows, k, 2)), largest - rng.integers(1, 100, (k, 2, 2))
    want = [(a[..., c].astype(object) @ b[..., c].astype(object)) % m for c, m in enumerate(largest.tolist())]
    np.testing.assert_array_equal(field.matmul(a, b), np.stack(want, axis=-1).astype(np.int64))


@pytest.mark.parametrize("terms", [3, (1 << 13) + 5])  # one reduction at the end; then one on the way too
def test_sums_of_products_are_exact_at_the_largest_residues(field, rng, terms):
    largest = np.array([field.p, field.q])
    a, b = largest - rng.integers(1, 100, (terms, 4, 2)), largest - rng.integers(1, 100, (terms, 1, 2))
    want = [(a[..., c].astype(object) * b[..., c].astype(object)).sum(axis=0) % m
            for c, m in enumerate(largest.tolist())]
    got = field.sum_of_products(zip(a, b))   # b broadcasts along a's rows
    np.testing.assert_array_equal(got, np.stack(want, axis=-1).astype(np.int64))
    np.testing.assert_array_equal(got, field.sum(field.mul(a, b), axis=0))


def test_sums_are_exact(field):
    x = np.broadcast_to(np.array([field.p - 1, field.q - 1]), (5000, 2))
    want = [(m - 1) * 5000 % m for m in (field.p, field.q)]
    np.testing.assert_array_equal(field.sum(x, axis=0), want)


# ---------------------------------------------------------------------------------------------
# scalars

@pytest.mark.parametrize("value, rational", [(1.0 / 6, Fraction(1, 6)), (1e-6, Fraction(1, 10 ** 6)),
                                             (0.1, Fraction(1, 10)), (2.0 ** -20, Fraction(1, 2 ** 20)),
                                             (-2.5, Fraction(-5, 2)), (3.0, Fraction(3)), (0.0, Fraction(0))])
def test_scalars_are_the_simplest_rational_of_the_float(value, rational):
    assert simplest_rational(value) == rational


@given(st.floats(allow_nan=False, allow_infinity=False), st.floats(allow_nan=False, allow_infinity=False))
@settings(max_examples=200, deadline=None)
def test_simplest_rational_rounds_back_and_keeps_floats_apart(a, b):
    assert float(simplest_rational(a)) == a
    assert (simplest_rational(a) == simplest_rational(b)) == (a == b)


def test_scalars_in_the_field(field):
    assert field.mul(field.scalar(1.0 / 6), residues(field, 6)).tolist() == [1, 1]
    assert field.add(field.scalar(0.5), field.scalar(0.5)).tolist() == [1, 1]


# ---------------------------------------------------------------------------------------------
# oracles and the random order

def test_oracles_are_deterministic_and_fresh_per_test_and_key(rng):
    f1, f2 = Field.draw(rng), Field.draw(rng)
    x = np.stack([rng.integers(0, 2 ** 22, 1000), rng.integers(0, 2 ** 22, 1000)], axis=-1)
    np.testing.assert_array_equal(f1.oracle("sqrt", x), f1.oracle("sqrt", x.copy()))
    assert np.mean(f1.oracle("sqrt", x)[..., 0] == f2.oracle("sqrt", x)[..., 0]) < 0.01
    assert np.mean(f1.oracle("sqrt", x)[..., 0] == f1.oracle("sigmoid", x)[..., 0]) < 0.01
    assert np.all(f1.oracle("sqrt", x) < f1.modulus) and np.all(f1.oracle("sqrt", x) >= 0)
    # values are spread over the field: no structure a wrong candidate could hit
    assert len(np.unique(f1.oracle("sqrt", x)[..., 0])) > 990


def test_oracles_read_only_the_p_residue_and_exp_only_the_q_residue(field, rng):
    x = field.random((100,), rng)
    other_q, other_p = x.copy(), x.copy()
    other_q[..., 1] = (x[..., 1] + 1) % field.q
    other_p[..., 0] = (x[..., 0] + 1) % field.p
    np.testing.assert_array_equal(field.oracle("relu", x), field.oracle("relu", other_q))
    # both residues of exp(x) depend on x's q-residue alone: exp(exp(x)) is still a function of x
    np.testing.assert_array_equal(field.exp(x), field.exp(other_p))
    assert not np.array_equal(field.exp(x), field.exp(other_q))


def test_max_is_a_maximum_under_a_random_order(field, rng):
    x = field.random((6, 40), rng)
    top = field.max(x, axis=1)
    for row, m in zip(x, top):
        assert any((row == m).all(axis=-1))  # one of its arguments
    # a maximum of partial maxima is the maximum (what accum_max over tile maxima relies on)
    halves = np.concatenate([field.max(x[:, :13], 1, keepdims=True), field.max(x[:, 13:], 1, keepdims=True)], axis=1)
    np.testing.assert_array_equal(field.max(halves, axis=1), top)
    np.testing.assert_array_equal(field.max(x[:, ::-1], axis=1), top)
    # the order is the test's: another test picks other elements
    assert not np.array_equal(Field.draw(rng).max(x, axis=1), top)


# ---------------------------------------------------------------------------------------------
# rules

def test_every_operator_has_a_finite_field_rule():
    # a graph-defined operator means what its body means: the walk runs the body
    assert not FIELD_RULES.missing()
    assert all(isinstance(FIELD_RULES[name], FieldRule) for name, op in OPS.items() if not op.is_graph_defined)


@pytest.mark.parametrize("op", ["accum", "accum_sum", "accum_mean", "accum_rms", "accum_max", "accum_rescale",
                                "accum_sum_rescale"])
def test_every_accumulators_running_form_gives_what_its_rule_gives_all_iterations_at_once(field, rng, op):
    """FieldRule.fold, iteration by iteration, against `apply` on every iteration's inputs: both residues
    (the rescaling accumulators: their p-residues, which they alone fold); ties in the maximum included
    (every other iteration repeats an earlier one's maxima, q-residues changed)."""
    rule = FIELD_RULES[op]
    a = {"eps": 1e-6} if op == "accum_rms" else {}
    iterations = []
    for i in range(70):
        x = field.random((3, 2, 5), rng)
        m = field.random((3, 2, 1), rng)
        if i % 2 and iterations:
            m = iterations[-1][-1].copy()
            m[..., 1] = rng.integers(0, field.q, m.shape[:-1])
        iterations.append([x, m] if op.endswith("rescale") else [m if op == "accum_max" else x])
    p_only = op.endswith("rescale")
    assert rule.fold(field, a, False) is None if p_only else rule.fold(field, a, False) is not None
    fold = rule.fold(field, a, p_only)
    for it in iterations:
        fold.add(it)
    (got,), (want,) = fold.result(), rule.apply(field, iterations, a)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got[..., 0], want[..., 0])
    if not p_only:
        np.testing.assert_array_equal(got, want)


def exact_program(n: int = 4):
    """Every operator that is exact in the field, on small integers: float64 computes it exactly too."""
    @mdsl.kernel(name="exact")
    def exact(x: Tensor[n, 2 * n, f32], w: Tensor[2 * n, n, f32], b: Tensor[n, f32]):
        y = (x @ w + b) * 3.0
        a, c = mdsl.split(y, [1, n - 1], dim=1)
        z = mdsl.concat([c, mdsl.square(a) - a], dim=1)
        t = mdsl.reshape(mdsl.transpose(z), n * n // 2, 2)
        s = mdsl.sum(t, dim=0, keepdim=True) + mdsl.mean(mdsl.neg(t) + 2.0, dim=1, keepdim=True)
        return s, mdsl.power(mdsl.cast(c, f32), 3) / 2.0

    return exact


def test_exact_operators_agree_with_the_float_reference_on_integers(field, rng):
    graph = exact_program().graph
    xs = [rng.integers(-5, 6, v.shape).astype(np.float64) for v in graph.inputs]
    want = run_kernel_graph(graph, xs)
    got = run_in_field(graph, [np.stack([x.astype(np.int64) % field.p, x.astype(np.int64) % field.q], -1)
                               for x in xs], field)
    for w, g in zip(want, got):
        expected = np.vectorize(lambda v: int(field.rational(Fraction(v))[0]))(w)
        np.testing.assert_array_equal(g[..., 0], expected)


def block_program(rows=4, cols=8, n=6, grid=2, forloop=4):
    """Every exact accumulator, on a block graph tiled over rows (grid) and columns (loop)."""
    @mdsl.kernel(name="accumulators")
    def acc(x: Tensor[rows, cols, f32], w: Tensor[cols, n, f32]):
        with mdsl.block_graph(grid=(grid,), forloop=forloop) as b:
            xt = b.input(x, imap=(0,), fmap=1)
            wt = b.input(w, imap=(None,), fmap=0)
            b.output(b.accum(xt @ wt), omap=(0,))
            b.output(b.accum_sum(xt) + b.accum_mean(mdsl.square(xt)), omap=(0,))
        return b.results

    @mdsl.kernel(name="accumulators_spec")
    def spec(x: Tensor[rows, cols, f32], w: Tensor[cols, n, f32]):
        return x @ w, mdsl.sum(x, -1, keepdim=True) + mdsl.mean(mdsl.square(x), -1, keepdim=True)

    return spec, acc


def test_block_graphs_run_through_the_generic_walk(field, rng):
    spec, acc = block_program()
    inputs = [field.random(v.shape, rng) for v in spec.graph.inputs]
    for want, got in zip(run_in_field(spec.graph, inputs, field), run_in_field(acc.graph, inputs, field)):
        np.testing.assert_array_equal(got, want)  # both residues: no exp here


def test_rms_norm_and_the_fused_accum_rms_agree(field, rng):
    rnl = example("rms_norm_linear")
    spec, fused = rnl.make_rms_norm_linear(1, k=32, n=24).graph, rnl.make_rms_norm_linear_fused(2, 32, 24, 3, 4).graph
    inputs = [field.random(v.shape, rng) for v in spec.inputs]
    (want,), (got,) = run_in_field(spec, inputs, field), run_in_field(fused, inputs, field)
    np.testing.assert_array_equal(got[..., 0], want[..., 0])


def test_field_values_keep_their_residue_axis(field, rng):
    spec, acc = block_program()
    with pytest.raises(mdsl.ShapeError, match=r"must have shape \[4, 8, 2\]"):
        run_in_field(spec.graph, [np.zeros((4, 8)), np.zeros((8, 6, 2))], field)
    (custom,) = acc.graph.nodes
    outs = evaluate.run_block_graph(custom.body, [field.random((4, 8), rng), field.random((8, 6), rng)],
                                    FieldSemantics(field))
    assert [o.shape for o in outs] == [(4, 6, 2), (4, 1, 2)]


def test_unwritten_block_outputs_are_caught_in_the_field_too(field, rng, monkeypatch):
    _, acc = block_program()
    build = evaluate.BlockPlan.__init__

    def drop_a_block(self, *args):
        build(self, *args)
        self.blocks.pop()

    monkeypatch.setattr(evaluate.BlockPlan, "__init__", drop_a_block)
    with pytest.raises(ValidationError, match="never written"):
        run_in_field(acc.graph, [field.random(v.shape, rng) for v in acc.graph.inputs], field)


@given(graph=kernel_graphs(), seed=st.integers(0, 2 ** 32 - 1))
@settings(max_examples=40, deadline=None)
def test_every_valid_graph_runs_in_the_field_deterministically(graph, seed):
    validate_kernel_graph(graph)
    rng = np.random.default_rng(seed)
    field = Field.draw(rng)
    inputs = [field.random(v.shape, rng) for v in graph.inputs]
    first, again = run_in_field(graph, inputs, field), run_in_field(graph, inputs, field)
    for v, a, b in zip(graph.outputs, first, again):
        assert a.shape == v.shape + (2,) and a.dtype == np.int64
        assert np.all((a >= 0) & (a < field.modulus))
        np.testing.assert_array_equal(a, b)
    outs, largest = degrees(graph)
    assert len(outs) == len(graph.outputs) and all(n >= 0 and d >= 0 for n, d in outs)
    assert largest >= max(n + d for n, d in outs)


# ---------------------------------------------------------------------------------------------
# degrees

def test_degrees():
    n = 8

    @mdsl.kernel(name="degrees")
    def program(x: Tensor[n, n, f32], w: Tensor[n, n, f32]):
        softmax = mdsl.softmax(x @ w)           # exp is a fresh variable; sum keeps it; div adds a denominator
        norm = mdsl.rms_norm(x) @ w             # n terms x_k w_k / s_k: denominators multiply
        return softmax, norm, x * x @ w + 1.0, mdsl.reciprocal(x) * x

    outs, largest = degrees(program.graph)
    assert outs == [(1, 1), (2 + (n - 1), n), (3, 0), (1, 1)]
    assert largest == 2 * n + 1


def test_half_integer_powers_use_the_sqrt_oracle(field, rng):
    x = field.random((30,), rng)

    def power(e):
        return FIELD_RULES["pow_scalar"].apply(field, [x], {"exponent": e})[0]

    np.testing.assert_array_equal(power(0.5), field.sqrt(x))
    np.testing.assert_array_equal(power(-0.5), field.inverse(field.sqrt(x)))
    np.testing.assert_array_equal(power(1.5), field.mul(field.mul(field.sqrt(x), field.sqrt(x)), field.sqrt(x)))
    np.testing.assert_array_equal(power(-2.0), field.inverse(field.mul(x, x)))
    third, quarter = power(1 / 3), power(0.25)   # other exponents: an oracle per exponent
    assert np.mean(third[..., 0] == quarter[..., 0]) < 0.1


def test_infinite_scalars_are_constants_of_the_test(field):
    np.testing.assert_array_equal(field.scalar(np.inf), field.scalar(float("inf")))
    assert not np.array_equal(field.scalar(np.inf), field.scalar(-np.inf))


@given(graph=kernel_graphs(), seed=st.integers(0, 2 ** 32 - 1))
@settings(max_examples=60, deadline=None)
def test_skipping_unread_q_residues_leaves_every_p_residue_as_it_was(graph, seed):
    rng = np.random.default_rng(seed)
    field = Field.draw(rng)
    inputs = [field.random(v.shape, rng) for v in graph.inputs]
    every = evaluate.run_kernel_graph(graph, inputs, FieldSemantics(field))
    for want, got in zip(every, run_in_field(graph, inputs, field)):
        np.testing.assert_array_equal(got[..., 0], want[..., 0])


def test_q_residues_are_read_only_on_the_way_to_an_exp():
    gqa = example("gqa").make_gqa(1, kv_len=64, queries=8, head_dim=4).graph
    read = q_residues_read(gqa)
    first: dict = {}
    for n in gqa.nodes:
        first.setdefault(n.op, n.outputs[0].name)
    # Q·K (the first matmul), its row maximum and their difference feed exp; exp's result, the row
    # sums, the normalised weights and their product with V (the output) feed no exp
    assert {first[op] for op in ("matmul", "max", "sub")} <= read
    assert not {first[op] for op in ("exp", "sum", "div")} & read
    assert gqa.outputs[0].name not in read and gqa.nodes[-1].op == "matmul"

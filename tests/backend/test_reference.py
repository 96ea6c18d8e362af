"""The numpy reference interpreter against direct numpy, on kernel graphs and on custom kernels
(block graphs) that compute the benchmark kernels the way a GPU would: block by block, tile by tile."""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdsl.backend.reference import run_block_graph, run_kernel_graph, run_thread_graph
from mdsl.errors import DTypeError, ShapeError, SourceLoc, ValidationError
from mdsl.ir import (BLOCK, KERNEL, OPS, THREAD, BlockGraph, BlockInput, BlockOutput, KernelGraph, Node, OpDef,
                     ThreadGraph, Var, bf16, f16, f32, get_op, i32)
from mdsl.ir import evaluate
from mdsl.ir.dtypes import round_to_dtype
from mdsl.ir.types import TensorType
from mdsl.ir.validate import check_node, input_tile_type, validate_kernel_graph

NO_MAP = (None, None, None)


class Builder:
    """Appends nodes at one level, with output types inferred (and checked) by the validator."""

    def __init__(self, level: str, prefix: str):
        self.level, self.prefix, self.nodes = level, prefix, []
        self._names = itertools.count()

    def __call__(self, op: str, *inputs: Var, body=None, loc=None, **attrs):
        pairs = get_op(op).normalize_attrs(attrs)
        types = check_node(Node(op, inputs, (), pairs, body), self.level, tuple(v.type for v in inputs))
        outputs = tuple(Var(f"{self.prefix}{next(self._names)}", t) for t in types)
        self.nodes.append(Node(op, inputs, outputs, pairs, body, loc))
        return outputs[0] if len(outputs) == 1 else outputs


def pad3(values, fill):
    return tuple(values) + (fill,) * (3 - len(values))


def block_graph(grid, forloop: int, operands, build, omaps, threads: int = 128) -> BlockGraph:
    """operands: (tensor type, imap, fmap) per input; build(builder, *tiles) returns the output tiles."""
    grid = pad3(grid, 1)
    b = Builder(BLOCK, "t")
    tiles = [Var(f"in{k}", input_tile_type(t, grid, forloop, pad3(imap, None), fmap))
             for k, (t, imap, fmap) in enumerate(operands)]
    outs = build(b, *tiles)
    return BlockGraph(grid, threads, forloop,
                      [BlockInput(tile, imap, fmap) for tile, (_, imap, fmap) in zip(tiles, operands)],
                      b.nodes, [BlockOutput(o, m) for o, m in zip(outs, omaps)])


def split_map(size: int, dim: int):
    """The map entry of a grid dim of `size`: split (or concatenate) `dim`, or nothing when size is 1."""
    return dim if size > 1 else None


def tensor(name: str, shape, dtype=f32) -> Var:
    return Var(name, TensorType(shape, dtype))


def rel_error(actual, expected) -> float:
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def rms_norm(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


@pytest.fixture
def rng():
    return np.random.default_rng(20240607)


# ---------------------------------------------------------------------------------------------
# kernel graphs

def _kernel_ops_graph():
    k = Builder(KERNEL, "k")
    x, w, bias = tensor("X", (4, 6)), tensor("W", (6, 5)), tensor("b", (5,))
    h = k("add", k("matmul", x, w), bias)
    n = k("rms_norm", h, eps=0.5)
    t = k("reshape", k("transpose", n, perm=(1, 0)), shape=(10, 2))
    top, bottom = k("split", t, sizes=(3, 7), dim=0)
    c = k("concat", bottom, top, dim=0)
    s = k("sum", k("gelu", c), dim=1, keepdim=True)
    m = k("max", k("clamp", c, min=-0.5, max=0.5), dim=0)
    r = k("mean", k("pow_scalar", k("add_scalar", k("sigmoid", c), value=1.0), exponent=2.5), dim=-1)
    return KernelGraph("ops", [x, w, bias], k.nodes, [s, m, r])


def test_kernel_graph_against_numpy(rng):
    graph = _kernel_ops_graph()
    validate_kernel_graph(graph)
    x, w, b = rng.standard_normal((4, 6)), rng.standard_normal((6, 5)), rng.standard_normal(5)
    s, m, r = run_kernel_graph(graph, [x, w, b])
    n = rms_norm(x @ w + b, 0.5)
    t = n.T.reshape(10, 2)
    c = np.concatenate([t[3:], t[:3]])
    np.testing.assert_allclose(s, np.sum(gelu(c), axis=1, keepdims=True), rtol=1e-13)
    np.testing.assert_allclose(m, np.max(np.clip(c, -0.5, 0.5), axis=0), rtol=1e-13)
    np.testing.assert_allclose(r, np.mean((1.0 / (1.0 + np.exp(-c)) + 1.0) ** 2.5, axis=-1), rtol=1e-13)
    assert all(o.dtype == np.float64 for o in (s, m, r))


def test_integer_input_for_an_i32_tensor(rng):
    k = Builder(KERNEL, "k")
    idx, x = tensor("idx", (3,), i32), tensor("x", (3,))
    y = k("add", k("cast", idx, dtype=f32), x)
    graph = KernelGraph("g", [idx, x], k.nodes, [y])
    xs = rng.standard_normal(3)
    (out,) = run_kernel_graph(graph, [np.array([1, -2, 7], dtype=np.int32), xs])
    np.testing.assert_array_equal(out, xs + [1, -2, 7])


def test_float_input_arrays_of_any_precision(rng):
    x = tensor("x", (2, 3), f16)
    graph = KernelGraph("g", [x], [], [x])
    for dtype in (np.float16, np.float32, np.float64):
        data = rng.standard_normal((2, 3)).astype(dtype)
        (out,) = run_kernel_graph(graph, [data], precision="float32")
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out, data.astype(np.float32))
        out[0, 0] = 123.0  # the output never aliases the caller's array
        assert data[0, 0] != 123.0


def test_input_errors(rng):
    graph = _kernel_ops_graph()
    good = [rng.standard_normal((4, 6)), rng.standard_normal((6, 5)), rng.standard_normal(5)]
    with pytest.raises(ShapeError, match=r"input %W must have shape \[6, 5\], got \[5, 6\]"):
        run_kernel_graph(graph, [good[0], good[1].T, good[2]])
    with pytest.raises(ShapeError, match=r"kernel graph ops takes 3 input\(s\), got 2"):
        run_kernel_graph(graph, good[:2])
    with pytest.raises(DTypeError, match=r"input %X \(f32\[4, 6\]\) cannot be given an array of dtype int32"):
        run_kernel_graph(graph, [good[0].astype(np.int32), good[1], good[2]])
    with pytest.raises(ValueError, match="precision must be one of"):
        run_kernel_graph(graph, good, precision="float16")


def test_bad_declared_type_is_reported_at_the_node():
    loc = SourceLoc("model.py", 12)
    x, y = tensor("x", (2, 3)), tensor("y", (3, 2))
    graph = KernelGraph("g", [x], [Node("exp", [x], [y], loc=loc)], [y])  # not validated
    with pytest.raises(ShapeError, match=r"%y is declared f32\[3, 2\] but evaluates to shape \[2, 3\]") as err:
        run_kernel_graph(graph, [np.ones((2, 3))])
    assert err.value.loc == loc


# ---------------------------------------------------------------------------------------------
# (a) RMSNorm + Linear as one custom kernel

def rms_norm_linear(m: int, k: int, n: int, grid: int, forloop: int, eps: float, dtype=f32, fused_epilogue=False):
    """Y = rms_norm(X) @ W: W's columns split across the grid, the shared dim across the loop.
    rms_norm(X) @ W = (X @ W) / rms(X), so the norm is an accumulator and one division after the loop."""
    x, w = tensor("X", (m, k), dtype), tensor("W", (k, n), dtype)

    def body(b, xt, wt):
        product = b("accum", b("matmul", xt, wt))
        return [b("div", product, b("accum_rms", xt, eps=eps))]

    bg = block_graph((grid,), forloop, [(x.type, NO_MAP, 1), (w.type, (split_map(grid, 1),), 0)], body,
                     [(split_map(grid, 1),)])
    kb = Builder(KERNEL, "k")
    y = kb("custom", x, w, body=bg)
    return KernelGraph("rms_norm_linear", [x, w], kb.nodes, [y])


@pytest.mark.parametrize("grid, forloop", [(1, 1), (1, 8), (2, 4), (3, 2), (6, 16), (12, 64)])
def test_rms_norm_linear(rng, grid, forloop):
    m, k, n, eps = 4, 64, 48, 1e-3
    graph = rms_norm_linear(m, k, n, grid, forloop, eps)
    validate_kernel_graph(graph)
    x, w = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    (y,) = run_kernel_graph(graph, [x, w])
    assert rel_error(y, rms_norm(x, eps) @ w) < 1e-10


# ---------------------------------------------------------------------------------------------
# (b) flash-decoding attention: online softmax over KV chunks, partial results per split, combine

B, SQ, D, S = 2, 3, 8, 64


def attention_partials(kb: Builder, q: Var, k: Var, v: Var, nsplit: int, forloop: int):
    """A custom kernel: block (b, s) runs online softmax over split s of the keys of batch b.
    Returns O (normalised by L), M (row max) and L (row sum of exp), splits concatenated along dim 1."""
    scale = 1.0 / math.sqrt(D)

    def body(b, qt, kt, vt):
        scores = b("mul_scalar", b("matmul", qt, kt), value=scale)
        m = b("max", scores, dim=-1, keepdim=True)
        e = b("exp", b("sub", scores, m))
        o = b("accum_rescale", b("matmul", e, vt), m)
        l_sum = b("accum_sum_rescale", e, m)
        return [b("div", o, l_sum), b("accum_max", m), l_sum]

    split = split_map(nsplit, 1)
    omap = (0, split)
    bg = block_graph((B, nsplit), forloop,
                     [(q.type, (0, None), None), (k.type, (0, split_map(nsplit, 2)), 2), (v.type, (0, split), 1)],
                     body, [omap, omap, omap])
    return kb("custom", q, k, v, body=bg)


def attention_inputs(rng):
    q = rng.standard_normal((B, SQ, D)) * 40  # scores in the hundreds: exp overflows without the max
    return q, rng.standard_normal((B, D, S)), rng.standard_normal((B, S, D))


def attention_expected(q, k, v):
    scores = q @ k / math.sqrt(D)
    p = np.exp(scores - np.max(scores, axis=-1, keepdims=True))
    return (p / np.sum(p, axis=-1, keepdims=True)) @ v, np.max(scores, axis=-1, keepdims=True)


def attention_with_kernel_combine(nsplit: int, forloop: int) -> KernelGraph:
    kb = Builder(KERNEL, "k")
    q, k, v = tensor("Q", (B, SQ, D)), tensor("K", (B, D, S)), tensor("V", (B, S, D))
    o, m, l_sum = attention_partials(kb, q, k, v, nsplit, forloop)
    # a new split axis: [B, nsplit * SQ, .] -> [B, nsplit, SQ, .]
    o, m, l_sum = (kb("reshape", t, shape=(B, nsplit, SQ, t.shape[-1])) for t in (o, m, l_sum))
    weight = kb("mul", l_sum, kb("exp", kb("sub", m, kb("max", m, dim=1, keepdim=True))))
    out = kb("div", kb("sum", kb("mul", o, weight), dim=1), kb("sum", weight, dim=1))
    return KernelGraph("flash_decoding", [q, k, v], kb.nodes, [out])


def attention_with_block_combine(nsplit: int, forloop: int) -> KernelGraph:
    kb = Builder(KERNEL, "k")
    q, k, v = tensor("Q", (B, SQ, D)), tensor("K", (B, D, S)), tensor("V", (B, S, D))
    partials = attention_partials(kb, q, k, v, nsplit, forloop)

    def combine(b, o, m, l_sum):
        # iteration i reads split i: the online-softmax merge of the splits' partial results
        total = b("accum_rescale", b("mul", o, l_sum), m)
        return [b("div", total, b("accum_sum_rescale", l_sum, m)), b("accum_max", m)]

    bg = block_graph((B,), nsplit, [(p.type, (0,), 1) for p in partials], combine, [(0,), (0,)])
    out, row_max = kb("custom", *partials, body=bg)
    return KernelGraph("flash_decoding", [q, k, v], kb.nodes, [out, row_max])


@pytest.mark.parametrize("nsplit, forloop", [(1, 4), (2, 1), (2, 4), (4, 8), (8, 2)])
def test_flash_decoding_with_kernel_combine(rng, nsplit, forloop):
    graph = attention_with_kernel_combine(nsplit, forloop)
    validate_kernel_graph(graph)
    inputs = attention_inputs(rng)
    (out,) = run_kernel_graph(graph, inputs)
    assert rel_error(out, attention_expected(*inputs)[0]) < 1e-12


@pytest.mark.parametrize("nsplit, forloop", [(2, 2), (4, 1), (8, 4)])
def test_flash_decoding_with_block_combine(rng, nsplit, forloop):
    graph = attention_with_block_combine(nsplit, forloop)
    validate_kernel_graph(graph)
    inputs = attention_inputs(rng)
    out, row_max = run_kernel_graph(graph, inputs)
    expected, expected_max = attention_expected(*inputs)
    assert rel_error(out, expected) < 1e-12
    np.testing.assert_allclose(row_max, expected_max, rtol=1e-14)


# ---------------------------------------------------------------------------------------------
# (c) gated MLP and (e) a fused thread graph inside a block graph

def gated_mlp(m: int, k: int, n: int, grid: int, forloop: int, fused: bool) -> KernelGraph:
    """silu(X @ W1) * (X @ W2), both products in one custom kernel; with `fused`, the epilogue after the
    loop and a prologue on the X tile inside it (X scaled by 0.5, undone after the loop) are thread graphs."""
    x, w1, w2 = tensor("X", (m, k)), tensor("W1", (k, n)), tensor("W2", (k, n))

    def prologue():
        t = Builder(THREAD, "r")
        xt = tensor("x", (m, k // forloop))
        half = t("mul_scalar", xt, value=0.5)
        return ThreadGraph([xt], t.nodes, [half])

    def epilogue(a1, a2):
        t = Builder(THREAD, "r")
        u_in, v_in = tensor("u", a1.shape), tensor("v", a2.shape)
        u, v = t("mul_scalar", u_in, value=2.0), t("mul_scalar", v_in, value=2.0)
        out = t("mul", t("mul", u, t("sigmoid", u)), v)
        return ThreadGraph([u_in, v_in], t.nodes, [out])

    def body(b, xt, w1t, w2t):
        if fused:
            xt = b("fused", xt, body=prologue())
        a1, a2 = b("accum", b("matmul", xt, w1t)), b("accum", b("matmul", xt, w2t))
        if fused:
            return [b("fused", a1, a2, body=epilogue(a1, a2))]
        return [b("mul", b("silu", a1), a2)]

    wmap = (split_map(grid, 1),)
    bg = block_graph((grid,), forloop, [(x.type, NO_MAP, 1), (w1.type, wmap, 0), (w2.type, wmap, 0)], body, [wmap])
    kb = Builder(KERNEL, "k")
    y = kb("custom", x, w1, w2, body=bg)
    return KernelGraph("gated_mlp", [x, w1, w2], kb.nodes, [y])


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("grid, forloop", [(1, 1), (2, 4), (4, 8)])
def test_gated_mlp(rng, grid, forloop, fused):
    graph = gated_mlp(8, 32, 16, grid, forloop, fused)
    validate_kernel_graph(graph)
    x, w1, w2 = rng.standard_normal((8, 32)), rng.standard_normal((32, 16)), rng.standard_normal((32, 16))
    (y,) = run_kernel_graph(graph, [x, w1, w2])
    assert rel_error(y, silu(x @ w1) * (x @ w2)) < 1e-12


def test_thread_graph_broadcasts(rng):
    t = Builder(THREAD, "r")
    a, b = tensor("a", (4, 1)), tensor("b", (1, 3))
    out = t("exp", t("sub", a, b))
    graph = ThreadGraph([a, b], t.nodes, [out])
    xa, xb = rng.standard_normal((4, 1)), rng.standard_normal((1, 3))
    (out,) = run_thread_graph(graph, [xa, xb])
    np.testing.assert_allclose(out, np.exp(xa - xb), rtol=1e-15)
    (out32,) = run_thread_graph(graph, [xa, xb], "float32")
    assert out32.dtype == np.float32


# ---------------------------------------------------------------------------------------------
# (d) every accumulator and every combination of imap, fmap and omap

ACCUMULATORS = ("accum", "accum_sum", "accum_mean", "accum_rms", "accum_max", "accum_rescale", "accum_sum_rescale")
RESCALING = ("accum_rescale", "accum_sum_rescale")
EPS = 0.25


def online_rescaled_sum(iterations, reduce_last: bool):
    """sum_i exp(m_i - max m) * x_i computed online: a running max, the running sum rescaled as it grows."""
    running_max, total = -np.inf, 0.0
    for x, m in iterations:
        x = np.sum(x, axis=-1, keepdims=True) if reduce_last else x
        new_max = np.maximum(running_max, m)
        total = total * np.exp(running_max - new_max) + x * np.exp(m - new_max)
        running_max = new_max
    return total


def accumulate(kind: str, iterations):
    """Each accumulator as a loop over the iterations' inputs."""
    xs = [it[0] for it in iterations]
    count = len(xs) * xs[0].shape[-1]
    rows = functools.partial(np.sum, axis=-1, keepdims=True)
    if kind in RESCALING:
        return online_rescaled_sum(iterations, kind == "accum_sum_rescale")
    return {
        "accum": lambda: functools.reduce(np.add, xs),
        "accum_max": lambda: functools.reduce(np.maximum, xs),
        "accum_sum": lambda: functools.reduce(np.add, map(rows, xs)),
        "accum_mean": lambda: functools.reduce(np.add, map(rows, xs)) / count,
        "accum_rms": lambda: np.sqrt(functools.reduce(np.add, [rows(x * x) for x in xs]) / count + EPS),
    }[kind]()


def map_graph(kind, shape, grid, forloop, imap, fmap, omap) -> BlockGraph:
    """out = 2 * acc(f(X tile * Z)), Z a replicated [1, 1, 1] input; f gives rescaling accumulators
    their (exp(s - m), m) pair and is a sigmoid for the others."""
    def body(b, xt, zt):
        s = b("mul", xt, zt)
        if kind in RESCALING:
            m = b("max", s, dim=-1, keepdim=True)
            acc = b(kind, b("exp", b("sub", s, m)), m)
        else:
            acc = b(kind, b("sigmoid", s), **({"eps": EPS} if kind == "accum_rms" else {}))
        return [b("mul_scalar", acc, value=2.0)]

    return block_graph(grid, forloop, [(TensorType(shape, f32), imap, fmap), (TensorType((1, 1, 1), f32), NO_MAP, None)],
                       body, [omap])


def expected_map_graph(kind, x, z, grid, forloop, imap, fmap, omap):
    """The same computation, written with np.split / np.concatenate instead of slices."""
    tiles = {}
    for block in itertools.product(*(range(g) for g in grid)):
        part = x
        for size, d, b in zip(grid, imap, block):
            if d is not None:
                part = np.split(part, size, axis=d)[b]
        chunks = np.split(part, forloop, axis=fmap) if fmap is not None else [part] * forloop
        iterations = []
        for chunk in chunks:
            s = chunk * z
            if kind in RESCALING:
                m = np.max(s, axis=-1, keepdims=True)
                iterations.append([np.exp(s - m), m])
            else:
                iterations.append([1.0 / (1.0 + np.exp(-s))])
        tiles[block] = 2.0 * accumulate(kind, iterations)
    for size, d in zip(grid, omap):  # merge grid dim x, then y, then z
        tiles = {key[1:]: (np.concatenate([tiles[(b,) + key[1:]] for b in range(size)], axis=d) if d is not None
                           else tiles[(0,) + key[1:]]) for key in tiles}
    return tiles[()]


@st.composite
def map_cases(draw):
    kind = draw(st.sampled_from(ACCUMULATORS))
    grid = tuple(draw(st.lists(st.sampled_from([1, 2, 3]), min_size=3, max_size=3)))
    free = [0, 1, 2]
    imap = []
    for size in grid:  # each grid dim above 1: replicate, or split a tensor dim of its own
        d = draw(st.sampled_from([None] + free)) if size > 1 else None
        free = [f for f in free if f != d]
        imap.append(d)
    fmap = draw(st.sampled_from([None, 0, 1, 2]))  # may be a dim the grid splits too
    forloop = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 2)) for _ in range(3)]
    for size, d in zip(grid, imap):
        if d is not None:
            shape[d] *= size
    if fmap is not None:
        shape[fmap] *= forloop
    out_dims = draw(st.permutations([0, 1, 2]))
    omap = tuple(out_dims[g] if size > 1 else None for g, size in enumerate(grid))
    return kind, tuple(shape), grid, forloop, tuple(imap), fmap, omap


def check_map_case(kind, shape, grid, forloop, imap, fmap, omap, seed):
    bg = map_graph(kind, shape, grid, forloop, imap, fmap, omap)
    rng = np.random.default_rng(seed)
    x, z = rng.standard_normal(shape), rng.standard_normal((1, 1, 1))
    (out,) = run_block_graph(bg, [x, z])
    expected = expected_map_graph(kind, x, z, grid, forloop, imap, fmap, omap)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", ACCUMULATORS)
@pytest.mark.parametrize("shape, grid, forloop, imap, fmap, omap", [
    ((4, 9, 2), (2, 3, 1), 2, (0, 1, None), 0, (0, 1, None)),    # fmap on a dim the grid splits
    ((2, 3, 8), (2, 3, 2), 4, (None, 1, 2), 2, (2, 0, 1)),       # three grid dims, x replicated
    ((3, 2, 4), (3, 2, 1), 1, (None, None, None), None, (1, 2, None)),  # fully replicated
    ((6, 4, 3), (1, 1, 1), 3, (None, None, None), 2, (None, None, None)),  # one block
])
def test_accumulators_and_maps(kind, shape, grid, forloop, imap, fmap, omap):
    check_map_case(kind, shape, grid, forloop, imap, fmap, omap, seed=7)


@given(case=map_cases(), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=150, deadline=None)
def test_random_maps(case, seed):
    check_map_case(*case, seed)


# ---------------------------------------------------------------------------------------------
# blocks are independent

def test_tiles_are_copies(rng, monkeypatch):
    # an operator that writes into its operand must not change what other blocks or iterations see
    def scribble(xs, attrs):
        xs[0] += 1000.0
        return [xs[0]]

    monkeypatch.setitem(OPS, "scribble", OpDef("scribble", "elementwise", frozenset({BLOCK}), 1, (),
                                               lambda types, attrs: (types[0],), scribble))
    x = tensor("X", (4, 6))
    bg = block_graph((3,), 2, [(x.type, NO_MAP, None)], lambda b, xt: [b("accum", b("scribble", xt))], [(1,)])
    data = rng.standard_normal((4, 6))
    (out,) = run_block_graph(bg, [data])
    np.testing.assert_allclose(out, np.tile(2 * (data + 1000.0), (1, 3)), rtol=1e-15)


def _reorder_blocks(monkeypatch, change):
    build = evaluate.BlockPlan.__init__

    def patched(self, *args):
        build(self, *args)
        change(self.blocks)

    monkeypatch.setattr(evaluate.BlockPlan, "__init__", patched)


def test_block_order_does_not_matter(rng, monkeypatch):
    graph = attention_with_kernel_combine(4, 2)
    inputs = attention_inputs(rng)
    (first,) = run_kernel_graph(graph, inputs)
    _reorder_blocks(monkeypatch, lambda blocks: np.random.default_rng(3).shuffle(blocks))
    (shuffled,) = run_kernel_graph(graph, inputs)
    np.testing.assert_array_equal(first, shuffled)


def test_unwritten_output_elements_are_reported(rng, monkeypatch):
    _reorder_blocks(monkeypatch, lambda blocks: blocks.pop())
    graph = rms_norm_linear(2, 8, 6, 3, 2, 1e-6)
    with pytest.raises(ValidationError, match=r"4 element\(s\) never written and 0 written more than once"):
        run_kernel_graph(graph, [rng.standard_normal((2, 8)), rng.standard_normal((8, 6))])


def test_block_graph_input_errors(rng):
    bg = rms_norm_linear(2, 8, 6, 3, 2, 1e-6).nodes[0].body
    with pytest.raises(ShapeError, match=r"reads 2 input\(s\), got 1"):
        run_block_graph(bg, [rng.standard_normal((2, 8))])
    with pytest.raises(ValidationError, match="does not divide"):
        run_block_graph(bg, [rng.standard_normal((2, 8)), rng.standard_normal((8, 5))])
    with pytest.raises(ShapeError, match=r"its tile is f32\[4, 2\] but it is declared f32\[2, 4\]"):
        run_block_graph(bg, [rng.standard_normal((4, 4)), rng.standard_normal((4, 6))])


def test_values_do_not_cross_the_loop(rng):
    # a (not validated) node after the loop that reads a loop value: the interpreter refuses it
    bg = rms_norm_linear(2, 4, 3, 1, 2, 1e-6).nodes[0].body
    product = bg.nodes[0].output
    bad = Node("add", [bg.outputs[0].var, product], [Var("bad", product.type)])
    bg = BlockGraph(bg.grid, bg.threads, bg.forloop, bg.inputs, bg.nodes + (bad,), [BlockOutput(bad.output, NO_MAP)])
    with pytest.raises(ValidationError, match=f"add reads %{product.name}, which is not available there"):
        run_block_graph(bg, [rng.standard_normal((2, 4)), rng.standard_normal((4, 3))])


def test_grid_of_many_blocks_and_iterations(rng):
    # 64 blocks x 16 iterations: the interpreter must stay fast enough for tests to run it often
    graph = rms_norm_linear(4, 64, 256, 64, 16, 1e-6)
    x, w = rng.standard_normal((4, 64)), rng.standard_normal((64, 256))
    (y,) = run_kernel_graph(graph, [x, w])
    assert rel_error(y, rms_norm(x, 1e-6) @ w) < 1e-12


# ---------------------------------------------------------------------------------------------
# (f) storage rounding and (g) float32 computation

@pytest.mark.parametrize("dtype, tiny", [(f16, 2.0 ** -11), (bf16, 2.0 ** -8)])
def test_round_storage_rounds_every_stored_tensor(dtype, tiny):
    k = Builder(KERNEL, "k")
    x, y = tensor("x", (1,), dtype), tensor("y", (1,), dtype)
    s = k("add", x, y)
    graph = KernelGraph("g", [x, y], k.nodes, [s, k("add_scalar", s, value=tiny)])
    # 1 + tiny is a tie between two neighbours of the dtype: round to even gives 1
    exact = run_kernel_graph(graph, [np.array([1.0]), np.array([tiny])])
    stored = run_kernel_graph(graph, [np.array([1.0]), np.array([tiny])], round_storage=True)
    assert [float(v[0]) for v in exact] == [1.0 + tiny, 1.0 + 2 * tiny]
    assert [float(v[0]) for v in stored] == [1.0, 1.0]


@pytest.mark.parametrize("dtype", [f16, bf16, f32])
def test_round_storage_keeps_rank_zero_tensors(dtype):
    k = Builder(KERNEL, "k")
    x = tensor("x", (3,), dtype)
    total = k("sum", x, dim=0)
    (out,) = run_kernel_graph(KernelGraph("g", [x], k.nodes, [total]), [np.ones(3)], round_storage=True)
    assert out.shape == () and out == 3.0


@pytest.mark.parametrize("dtype, eps", [(f16, 2.0 ** -10), (bf16, 2.0 ** -7), (f32, 2.0 ** -23)])
def test_round_storage_error_is_about_the_dtype_epsilon(rng, dtype, eps):
    graph = rms_norm_linear(8, 64, 32, 4, 4, 1e-6, dtype=dtype)
    x, w = rng.standard_normal((8, 64)), rng.standard_normal((64, 32)) * 0.1
    (exact,) = run_kernel_graph(graph, [x, w])
    (stored,) = run_kernel_graph(graph, [x, w], round_storage=True)
    np.testing.assert_array_equal(stored, round_to_dtype(stored, dtype))  # representable in the dtype
    assert 0.05 * eps < rel_error(stored, exact) < eps


def test_float32_agrees_with_float64(rng):
    for graph, inputs in [(attention_with_block_combine(4, 2), attention_inputs(rng)),
                          (gated_mlp(8, 32, 16, 2, 4, fused=True), [rng.standard_normal((8, 32)),
                                                                    rng.standard_normal((32, 16)),
                                                                    rng.standard_normal((32, 16))])]:
        out64 = run_kernel_graph(graph, inputs)
        out32 = run_kernel_graph(graph, inputs, precision="float32")
        for a, b in zip(out32, out64):
            assert a.dtype == np.float32 and b.dtype == np.float64
            assert rel_error(a, b) < 1e-5

"""Every operator of the registry: its shape/dtype rule and its reference semantics.

Each operator needs an entry in SHAPE_CASES and in REFERENCE_CASES (test_every_operator_has_cases
fails otherwise), so a new operator cannot be registered without tests. The expected values are
computed independently of mdsl: element by element with `math`, or with explicit loops.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdsl.backend.reference import run_kernel_graph
from mdsl.errors import DTypeError, ShapeError, ValidationError
from mdsl.ir import BLOCK, KERNEL, OPS, BlockGraph, BlockInput, BlockOutput, KernelGraph, Node, ThreadGraph, Var
from mdsl.ir import bf16, f16, f32, get_op, i32
from mdsl.ir.types import TensorType
from mdsl.ir.validate import check_node

FLOATS = (f16, bf16, f32)
float_dtypes = st.sampled_from(FLOATS)
small_shapes = st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple)
nonscalar_shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)
SETTINGS = settings(max_examples=40, deadline=None)


def infer(op: str, types, **attrs) -> tuple:
    opdef = get_op(op)
    return opdef.infer_types(tuple(types), opdef.normalize_attrs(attrs))


def reference(op: str, arrays, **attrs) -> list:
    opdef = get_op(op)
    return opdef.reference(list(arrays), dict(opdef.normalize_attrs(attrs)))


def elementwise(fn: Callable, *arrays: np.ndarray) -> np.ndarray:
    """Apply a scalar function element by element, with numpy broadcasting of the operands."""
    shape = np.broadcast_shapes(*(a.shape for a in arrays))
    out = np.empty(shape)
    for idx in np.ndindex(shape):
        out[idx] = fn(*(float(a[_broadcast_index(idx, a.shape)]) for a in arrays))
    return out


def _broadcast_index(idx: tuple, shape: tuple) -> tuple:
    tail = idx[len(idx) - len(shape):]
    return tuple(0 if n == 1 else i for i, n in zip(tail, shape))


# ---------------------------------------------------------------------------------------------
# the cases of each operator

class Unary(NamedTuple):
    math_fn: Callable      # the scalar definition
    attrs: dict = {}
    positive: bool = False  # the domain needs x > 0


UNARY = {
    "exp": Unary(math.exp),
    "silu": Unary(lambda x: x / (1.0 + math.exp(-x))),
    "gelu": Unary(lambda x: 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))),
    "relu": Unary(lambda x: max(x, 0.0)),
    "sigmoid": Unary(lambda x: 1.0 / (1.0 + math.exp(-x))),
    "sqrt": Unary(math.sqrt, positive=True),
    "rsqrt": Unary(lambda x: 1.0 / math.sqrt(x), positive=True),
    "square": Unary(lambda x: x * x),
    "neg": Unary(lambda x: -x),
    "reciprocal": Unary(lambda x: 1.0 / x, positive=True),
    "mul_scalar": Unary(lambda x: x * -2.5, {"value": -2.5}),
    "add_scalar": Unary(lambda x: x + 0.75, {"value": 0.75}),
    "pow_scalar": Unary(lambda x: math.pow(x, 1.5), {"exponent": 1.5}, positive=True),
    "clamp": Unary(lambda x: min(max(x, -0.5), 0.25), {"min": -0.5, "max": 0.25}),
}
BINARY = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b}
REDUCTIONS = {"sum": math.fsum, "mean": lambda v: math.fsum(v) / len(v), "max": max}
ACCUMULATORS = ("accum", "accum_sum", "accum_mean", "accum_rms", "accum_max", "accum_rescale", "accum_sum_rescale")
GRAPH_DEFINED = ("custom", "fused")

SHAPE_CASES: dict = {}
REFERENCE_CASES: dict = {}


def case(table: dict, *names: str):
    def register(fn):
        for name in names:
            table[name] = fn
        return fn
    return register


def test_every_operator_has_cases():
    assert set(OPS) - set(SHAPE_CASES) == set(), "operators without a shape-rule test case"
    assert set(OPS) - set(REFERENCE_CASES) == set(), "operators without a reference test case"
    assert set(SHAPE_CASES) | set(REFERENCE_CASES) <= set(OPS), "test cases for operators that do not exist"


# ---- element-wise unary -----------------------------------------------------------------------

@case(SHAPE_CASES, *UNARY)
def _unary_shape(name, data):
    t = TensorType(data.draw(small_shapes), data.draw(float_dtypes))
    assert infer(name, [t], **UNARY[name].attrs) == (t,)
    with pytest.raises(DTypeError, match="floating-point"):
        infer(name, [t.with_dtype(i32)], **UNARY[name].attrs)


@case(REFERENCE_CASES, *UNARY)
def _unary_reference(name, rng):
    spec = UNARY[name]
    x = rng.standard_normal((3, 4)) * 2
    if spec.positive:
        x = np.abs(x) + 0.1
    (out,) = reference(name, [x], **spec.attrs)
    np.testing.assert_allclose(out, elementwise(spec.math_fn, x), rtol=1e-13)
    (out32,) = reference(name, [x.astype(np.float32)], **spec.attrs)
    assert out32.dtype == np.float32  # float32 precision mode stays in float32


def test_pow_scalar_with_integral_exponent_on_negative_base():
    x = np.array([-2.0, -0.5, 0.0, 3.0])
    np.testing.assert_array_equal(reference("pow_scalar", [x], exponent=3)[0], [-8.0, -0.125, 0.0, 27.0])


def test_clamp_rejects_min_above_max():
    with pytest.raises(ValidationError, match="min 1.0 is greater than max 0.0"):
        infer("clamp", [TensorType((2,), f32)], min=1.0, max=0.0)


@case(SHAPE_CASES, "cast")
def _cast_shape(name, data):
    shape = data.draw(small_shapes)
    src, dst = data.draw(st.sampled_from(FLOATS + (i32,))), data.draw(st.sampled_from(FLOATS + (i32,)))
    assert infer("cast", [TensorType(shape, src)], dtype=dst) == (TensorType(shape, dst),)
    assert infer("cast", [TensorType(shape, src)], dtype=dst.name) == (TensorType(shape, dst),)


@case(REFERENCE_CASES, "cast")
def _cast_reference(name, rng):
    x = np.array([-1.7, -0.2, 0.0, 0.5, 2.9, 1.0 + 2.0 ** -20])
    # to a float dtype the value is unchanged: rounding happens where the tensor is stored
    np.testing.assert_array_equal(reference("cast", [x], dtype="f16")[0], x)
    np.testing.assert_array_equal(reference("cast", [x], dtype="i32")[0], [math.trunc(v) for v in x])


# ---- element-wise binary ----------------------------------------------------------------------

@st.composite
def broadcastable_pair(draw):
    """Two shapes that broadcast: size-1 dims and missing leading dims on either side."""
    full = draw(small_shapes)

    def operand():
        kept = full[draw(st.integers(0, len(full))):]
        return tuple(1 if draw(st.booleans()) else d for d in kept)

    return operand(), operand()


@case(SHAPE_CASES, *BINARY)
def _binary_shape(name, data):
    a, b = data.draw(broadcastable_pair())
    dtype = data.draw(float_dtypes)
    assert infer(name, [TensorType(a, dtype), TensorType(b, dtype)]) == (TensorType(np.broadcast_shapes(a, b), dtype),)
    other = data.draw(st.sampled_from([d for d in FLOATS if d != dtype]))
    with pytest.raises(DTypeError, match="different dtypes"):
        infer(name, [TensorType(a, dtype), TensorType(b, other)])
    with pytest.raises(DTypeError, match="floating-point"):
        infer(name, [TensorType(a, i32), TensorType(b, i32)])
    # a clash in one dim names that dim (counted from the right, as numpy does)
    rank = data.draw(st.integers(1, 4))
    pos = data.draw(st.integers(1, rank))
    base = list(data.draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    left, right = list(base), list(base)
    left[-pos], right[-pos] = 2, 3
    with pytest.raises(ShapeError, match=rf"do not broadcast \(dimension {-pos}: 2 vs 3\)"):
        infer(name, [TensorType(left, dtype), TensorType(right, dtype)])


@case(REFERENCE_CASES, *BINARY)
def _binary_reference(name, rng):
    a = rng.standard_normal((2, 1, 4))
    b = rng.standard_normal((3, 1)) + 3.0  # away from 0 for div
    (out,) = reference(name, [a, b])
    np.testing.assert_allclose(out, elementwise(BINARY[name], a, b), rtol=1e-15)


# ---- matmul -----------------------------------------------------------------------------------

@case(SHAPE_CASES, "matmul")
def _matmul_shape(name, data):
    bx, bw = data.draw(broadcastable_pair())
    m, k, n = (data.draw(st.integers(1, 6)) for _ in range(3))
    dtype = data.draw(float_dtypes)
    x, w = TensorType(bx + (m, k), dtype), TensorType(bw + (k, n), dtype)
    assert infer("matmul", [x, w]) == (TensorType(np.broadcast_shapes(bx, bw) + (m, n), dtype),)
    bad = TensorType(bw + (k + 1, n), dtype)
    with pytest.raises(ShapeError, match="inner dimensions differ") as err:
        infer("matmul", [x, bad])
    assert str(x) in err.value.message and str(bad) in err.value.message
    with pytest.raises(ShapeError, match="rank >= 2"):
        infer("matmul", [TensorType((k,), dtype), w])
    with pytest.raises(DTypeError, match="different dtypes"):
        infer("matmul", [x, w.with_dtype(data.draw(st.sampled_from([d for d in FLOATS if d != dtype])))])
    with pytest.raises(DTypeError, match="floating-point"):
        infer("matmul", [x.with_dtype(i32), w.with_dtype(i32)])


@case(REFERENCE_CASES, "matmul")
def _matmul_reference(name, rng):
    x, w = rng.standard_normal((2, 1, 3, 4)), rng.standard_normal((5, 4, 2))
    (out,) = reference("matmul", [x, w])
    expected = np.empty((2, 5, 3, 2))
    for b0, b1, i, j in np.ndindex(expected.shape):
        expected[b0, b1, i, j] = math.fsum(x[b0, 0, i, k] * w[b1, k, j] for k in range(4))
    np.testing.assert_allclose(out, expected, rtol=1e-13)


# ---- reductions and rms_norm ------------------------------------------------------------------

@case(SHAPE_CASES, *REDUCTIONS)
def _reduction_shape(name, data):
    shape = data.draw(nonscalar_shapes)
    dtype = data.draw(float_dtypes)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    keepdim = data.draw(st.booleans())
    d = dim % len(shape)
    expected = shape[:d] + ((1,) if keepdim else ()) + shape[d + 1:]
    assert infer(name, [TensorType(shape, dtype)], dim=dim, keepdim=keepdim) == (TensorType(expected, dtype),)
    with pytest.raises(ShapeError, match=f"dim {len(shape)} is out of range for a tensor of rank {len(shape)}"):
        infer(name, [TensorType(shape, dtype)], dim=len(shape))
    with pytest.raises(DTypeError):
        infer(name, [TensorType(shape, i32)], dim=0)


@case(REFERENCE_CASES, *REDUCTIONS)
def _reduction_reference(name, rng):
    x = rng.standard_normal((2, 3, 4))
    for dim in range(-3, 3):
        d = dim % 3
        for keepdim in (False, True):
            (out,) = reference(name, [x], dim=dim, keepdim=keepdim)
            rest = x.shape[:d] + x.shape[d + 1:]
            expected = np.empty(rest)
            for idx in np.ndindex(rest):
                expected[idx] = REDUCTIONS[name]([x[idx[:d] + (j,) + idx[d:]] for j in range(x.shape[d])])
            if keepdim:
                expected = np.expand_dims(expected, d)
            np.testing.assert_allclose(out, expected, rtol=1e-14)


@case(SHAPE_CASES, "rms_norm")
def _rms_norm_shape(name, data):
    t = TensorType(data.draw(nonscalar_shapes), data.draw(float_dtypes))
    dim = data.draw(st.integers(-t.rank, t.rank - 1))
    assert infer("rms_norm", [t], dim=dim, eps=1e-5) == (t,)
    with pytest.raises(ShapeError, match="out of range"):
        infer("rms_norm", [t], dim=t.rank)
    with pytest.raises(ValidationError, match=r"eps=-1.0 of rms_norm must be a finite number >= 0"):
        infer("rms_norm", [t], eps=-1.0)
    with pytest.raises(DTypeError):
        infer("rms_norm", [t.with_dtype(i32)])


@case(REFERENCE_CASES, "rms_norm")
def _rms_norm_reference(name, rng):
    x = rng.standard_normal((3, 5))
    eps = 0.25  # large enough to matter
    (out,) = reference("rms_norm", [x], eps=eps)
    for i in range(3):
        scale = math.sqrt(math.fsum(v * v for v in x[i]) / 5 + eps)
        np.testing.assert_allclose(out[i], x[i] / scale, rtol=1e-14)
    (out0,) = reference("rms_norm", [x], dim=0, eps=0.0)
    for j in range(5):
        np.testing.assert_allclose(out0[:, j], x[:, j] / math.sqrt(math.fsum(v * v for v in x[:, j]) / 3), rtol=1e-14)


# ---- layout operators -------------------------------------------------------------------------

@case(SHAPE_CASES, "concat")
def _concat_shape(name, data):
    shape = data.draw(nonscalar_shapes)
    dtype = data.draw(st.sampled_from(FLOATS + (i32,)))  # layout ops move any dtype
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    d = dim % len(shape)
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    types = [TensorType(shape[:d] + (s,) + shape[d + 1:], dtype) for s in sizes]
    assert infer("concat", types, dim=dim) == (TensorType(shape[:d] + (sum(sizes),) + shape[d + 1:], dtype),)
    if len(shape) > 1:
        other = (d + 1) % len(shape)
        bad = list(types[0].shape)
        bad[other] += 1
        with pytest.raises(ShapeError, match=f"differ in dimension {other}"):
            infer("concat", [types[0], TensorType(bad, dtype)], dim=dim)
    with pytest.raises(ShapeError, match="different ranks"):
        infer("concat", [types[0], TensorType(shape + (1,), dtype)], dim=0)
    with pytest.raises(DTypeError, match="different dtypes"):
        infer("concat", [types[0], types[0].with_dtype(f32 if dtype != f32 else f16)], dim=dim)


@case(REFERENCE_CASES, "concat")
def _concat_reference(name, rng):
    parts = [rng.standard_normal((2, s, 3)) for s in (1, 3, 2)]
    (out,) = reference("concat", parts, dim=1)
    expected = np.empty((2, 6, 3))
    offset = 0
    for p in parts:
        for i, j, k in np.ndindex(p.shape):
            expected[i, offset + j, k] = p[i, j, k]
        offset += p.shape[1]
    np.testing.assert_array_equal(out, expected)


@st.composite
def split_case(draw):
    shape = draw(nonscalar_shapes)
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    total = shape[dim % len(shape)]
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=total - 1))) if total > 1 else []
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    return shape, dim, sizes


@case(SHAPE_CASES, "split")
def _split_shape(name, data):
    shape, dim, sizes = data.draw(split_case())
    dtype = data.draw(st.sampled_from(FLOATS + (i32,)))
    d = dim % len(shape)
    expected = tuple(TensorType(shape[:d] + (s,) + shape[d + 1:], dtype) for s in sizes)
    assert infer("split", [TensorType(shape, dtype)], sizes=sizes, dim=dim) == expected
    with pytest.raises(ShapeError, match="must be positive and add up"):
        infer("split", [TensorType(shape, dtype)], sizes=sizes + [1], dim=dim)
    with pytest.raises(ShapeError, match="must be positive and add up"):
        infer("split", [TensorType(shape, dtype)], sizes=[0] + sizes, dim=dim)


@case(REFERENCE_CASES, "split")
def _split_reference(name, rng):
    x = rng.standard_normal((3, 7))
    pieces = reference("split", [x], sizes=[2, 4, 1], dim=-1)
    assert [p.shape for p in pieces] == [(3, 2), (3, 4), (3, 1)]
    for p, start in zip(pieces, (0, 2, 6)):
        for i, j in np.ndindex(p.shape):
            assert p[i, j] == x[i, start + j]


@st.composite
def reshape_case(draw):
    shape = draw(small_shapes)
    numel = math.prod(shape)
    factors = []
    rest = numel
    for _ in range(draw(st.integers(0, 3))):
        f = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
        factors.append(f)
        rest //= f
    return shape, tuple(factors + [rest])


@case(SHAPE_CASES, "reshape")
def _reshape_shape(name, data):
    shape, new = data.draw(reshape_case())
    dtype = data.draw(st.sampled_from(FLOATS + (i32,)))
    assert infer("reshape", [TensorType(shape, dtype)], shape=new) == (TensorType(new, dtype),)
    with pytest.raises(ShapeError, match="cannot view"):
        infer("reshape", [TensorType(shape, dtype)], shape=new[:-1] + (new[-1] + 1,))
    with pytest.raises(ShapeError, match="cannot view"):
        infer("reshape", [TensorType(shape, dtype)], shape=(-1,))


@case(REFERENCE_CASES, "reshape")
def _reshape_reference(name, rng):
    x = rng.standard_normal((2, 3, 4))
    (out,) = reference("reshape", [x], shape=[4, 6])
    assert out.shape == (4, 6)
    assert list(out.flat) == [x[idx] for idx in np.ndindex(x.shape)]  # row-major order is kept


@case(SHAPE_CASES, "transpose")
def _transpose_shape(name, data):
    shape = data.draw(small_shapes)
    perm = data.draw(st.permutations(range(len(shape))))
    dtype = data.draw(st.sampled_from(FLOATS + (i32,)))
    assert infer("transpose", [TensorType(shape, dtype)], perm=perm) == (TensorType([shape[p] for p in perm], dtype),)
    with pytest.raises(ShapeError, match="is not a permutation"):
        infer("transpose", [TensorType(shape, dtype)], perm=list(perm) + [0])


@case(REFERENCE_CASES, "transpose")
def _transpose_reference(name, rng):
    x = rng.standard_normal((2, 3, 4))
    perm = (2, 0, 1)
    (out,) = reference("transpose", [x], perm=perm)
    assert out.shape == (4, 2, 3)
    for idx in np.ndindex(x.shape):
        assert out[tuple(idx[p] for p in perm)] == x[idx]


# ---- accumulators -----------------------------------------------------------------------------

RESCALING = ("accum_rescale", "accum_sum_rescale")


@case(SHAPE_CASES, *ACCUMULATORS)
def _accumulator_shape(name, data):
    t = TensorType(data.draw(nonscalar_shapes), data.draw(float_dtypes))
    reduces_last = name in ("accum_sum", "accum_mean", "accum_rms", "accum_sum_rescale")
    out = t.with_shape(t.shape[:-1] + (1,)) if reduces_last else t
    operands = [t]
    if name in RESCALING:
        # the scale has the output's rank and broadcasts to it (a row maximum, typically)
        operands.append(TensorType(t.shape[:-1] + (1,), t.dtype))
        with pytest.raises(ShapeError, match="must have the rank of"):
            infer(name, [t, TensorType(t.shape[:-1], t.dtype)])
    assert infer(name, operands) == (out,)
    with pytest.raises(DTypeError, match="floating-point"):
        infer(name, [o.with_dtype(i32) for o in operands])
    if reduces_last:
        with pytest.raises(ShapeError, match="rank >= 1"):
            infer(name, [TensorType((), t.dtype)] * len(operands))


def online_rescaled_sum(iterations, reduce_last: bool) -> np.ndarray:
    """Online softmax's loop: keep a running maximum and rescale the running sum whenever it grows."""
    running_max, total = None, None
    for x, m in iterations:
        x = np.sum(x, axis=-1, keepdims=True) if reduce_last else x
        if total is None:
            running_max, total = m, x
            continue
        new_max = np.maximum(running_max, m)
        total = total * np.exp(running_max - new_max) + x * np.exp(m - new_max)
        running_max = new_max
    return total


def accumulator_definition(name: str, iterations, eps: float) -> np.ndarray:
    """Each accumulator written out as a loop over the iterations."""
    xs = [it[0] for it in iterations]
    count = len(xs) * xs[0].shape[-1]
    if name == "accum":
        return functools.reduce(np.add, xs)
    if name == "accum_max":
        return functools.reduce(np.maximum, xs)
    row_sums = [np.sum(x, axis=-1, keepdims=True) for x in xs]
    if name == "accum_sum":
        return functools.reduce(np.add, row_sums)
    if name == "accum_mean":
        return functools.reduce(np.add, row_sums) / count
    if name == "accum_rms":
        return np.sqrt(functools.reduce(np.add, [np.sum(x * x, axis=-1, keepdims=True) for x in xs]) / count + eps)
    return online_rescaled_sum(iterations, reduce_last=name == "accum_sum_rescale")


def check_accumulator(name: str, rng, shape: tuple, iterations_count: int) -> None:
    iterations = []
    for _ in range(iterations_count):
        x = rng.standard_normal(shape) * 3
        m = np.max(x, axis=-1, keepdims=True) + rng.standard_normal(shape[:-1] + (1,))
        iterations.append([x, m] if name in RESCALING else [x])
    eps = 0.3
    attrs = {"eps": eps} if name == "accum_rms" else {}
    (out,) = reference(name, iterations, **attrs)
    np.testing.assert_allclose(out, accumulator_definition(name, iterations, eps), rtol=1e-12, atol=1e-12)


@case(REFERENCE_CASES, *ACCUMULATORS)
def _accumulator_reference(name, rng):
    check_accumulator(name, rng, (2, 3), 3)


@pytest.mark.parametrize("name", ACCUMULATORS)
@given(shape=nonscalar_shapes, iterations_count=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
@SETTINGS
def test_accumulators_on_random_iteration_lists(name, shape, iterations_count, seed):
    check_accumulator(name, np.random.default_rng(seed), shape, iterations_count)


# ---- graph-defined operators ------------------------------------------------------------------

def _body_node(name: str, t: TensorType) -> Node:
    """A `custom` node (a 2-block, 2-iteration sum) or a `fused` node (exp then negate) on t."""
    if name == "custom":
        tile = Var("tile", t.with_shape((t.shape[0] // 2, t.shape[1] // 2)))
        acc = Var("acc", tile.type)
        body = BlockGraph((2, 1, 1), 128, 2, [BlockInput(tile, (0, None, None), 1)],
                          [Node("accum", [tile], [acc])], [BlockOutput(acc, (0, None, None))])
    else:
        x, e, y = Var("x", t), Var("e", t), Var("y", t)
        body = ThreadGraph([x], [Node("exp", [x], [e]), Node("neg", [e], [y])], [y])
    return Node(name, [Var("in", t)], (), (), body)


@case(SHAPE_CASES, *GRAPH_DEFINED)
def _graph_defined_shape(name, data):
    # the output types come from the body
    opdef = get_op(name)
    assert opdef.is_graph_defined
    with pytest.raises(ValidationError, match="come from its body"):
        opdef.infer_types((TensorType((2, 2), f32),), ())
    t = TensorType((2 * data.draw(st.integers(1, 3)), 2 * data.draw(st.integers(1, 3))), data.draw(float_dtypes))
    level = KERNEL if opdef.body_level == BLOCK else BLOCK
    expected = t.with_shape((t.shape[0], t.shape[1] // 2)) if name == "custom" else t
    assert check_node(_body_node(name, t), level, (t,)) == (expected,)
    with pytest.raises(ValidationError, match=f"needs a {opdef.body_level} graph as its body"):
        check_node(Node(name, [Var("in", t)], ()), level, (t,))


@case(REFERENCE_CASES, *GRAPH_DEFINED)
def _graph_defined_reference(name, rng):
    # no reference of their own: the interpreter runs the body
    assert get_op(name).reference is None
    t = TensorType((4, 6), f32)
    node = _body_node(name, t)
    if name == "fused":  # wrap it in a block graph, which a kernel graph then runs
        tile, acc = Var("tile", t), Var("acc", t)
        inner = Node("fused", [tile], [Var("y", t)], (), node.body)
        node = Node("custom", [Var("in", t)], (), (), BlockGraph(
            (1, 1, 1), 128, 1, [BlockInput(tile, (None, None, None))],
            [inner, Node("accum", [inner.output], [acc])], [BlockOutput(acc, (None, None, None))]))
    (out_type,) = check_node(node, KERNEL, (t,))
    node = Node("custom", node.inputs, [Var("out", out_type)], (), node.body)
    x = rng.standard_normal(t.shape)
    (out,) = run_kernel_graph(KernelGraph("g", [Var("in", t)], [node], node.outputs), [x])
    expected = x[:, :3] + x[:, 3:] if name == "custom" else elementwise(lambda v: -math.exp(v), x)
    np.testing.assert_allclose(out, expected, rtol=1e-14)


# ---------------------------------------------------------------------------------------------
# the parametrized drivers

@pytest.mark.parametrize("name", sorted(SHAPE_CASES))
@given(data=st.data())
@SETTINGS
def test_shape_rule(name, data):
    SHAPE_CASES[name](name, data)


@pytest.mark.parametrize("name", sorted(REFERENCE_CASES))
def test_reference_semantics(name):
    REFERENCE_CASES[name](name, np.random.default_rng(1234))

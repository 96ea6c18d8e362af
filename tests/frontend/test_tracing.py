"""Tracing: each mdsl function and Python operator records the right registry operator, with the right
attributes and result types; kernels trace per shape/dtype signature and run like numpy."""
from __future__ import annotations

import math

import numpy as np
import pytest

import mdsl
from mdsl import Tensor, f16, f32
from mdsl.ir.ops import unary_operator_names
from mdsl.ir.text import parse_graph


def trace(fn, *specs):
    """The kernel graph of `fn` for the given Tensor[...] specs."""
    return mdsl.kernel(fn).trace(*specs)


def ops(graph) -> list:
    return [n.op for n in graph.nodes]


def only_node(fn, *specs):
    (node,) = trace(fn, *specs).nodes
    return node


def out_shape(graph) -> tuple:
    return graph.outputs[0].shape


X = Tensor[4, 8, f32]
X3 = Tensor[2, 4, 8, f32]


# ---------------------------------------------------------------------------------------------
# mdsl functions

@pytest.mark.parametrize("name", unary_operator_names())
def test_unary_function_binds_its_operator(name):
    fn = getattr(mdsl, name)
    node = only_node(lambda x: fn(x), Tensor[4, 8, f16])
    assert node.op == name
    assert node.attrs == ()
    assert node.output.type == Tensor[4, 8, f16].type


def test_clamp_records_its_bounds():
    node = only_node(lambda x: mdsl.clamp(x, -1, 2.5), X)
    assert (node.op, node.attr_dict) == ("clamp", {"min": -1.0, "max": 2.5})


@pytest.mark.parametrize("dtype", [mdsl.f32, "f32", "float32"])
def test_cast_changes_the_dtype(dtype):
    node = only_node(lambda x: mdsl.cast(x, dtype), Tensor[4, 8, f16])
    assert node.op == "cast"
    assert node.attr("dtype") is mdsl.f32
    assert node.output.type == X.type


@pytest.mark.parametrize("name", ["sum", "mean", "max"])
@pytest.mark.parametrize("dim, keepdim, attr_dim, shape", [
    (1, False, 1, (2, 8)),
    (-1, False, 2, (2, 4)),
    (-3, True, 0, (1, 4, 8)),
    (2, True, 2, (2, 4, 1)),
])
def test_reduction_over_one_dim(name, dim, keepdim, attr_dim, shape):
    node = only_node(lambda x: getattr(mdsl, name)(x, dim, keepdim=keepdim), X3)
    assert node.op == name
    assert node.attr_dict == {"dim": attr_dim, "keepdim": keepdim}
    assert node.output.shape == shape


@pytest.mark.parametrize("keepdim, shape", [(False, (4,)), (True, (1, 4, 1))])
def test_reduction_over_a_tuple_of_dims_reduces_the_highest_first(keepdim, shape):
    graph = trace(lambda x: mdsl.sum(x, (0, -1), keepdim=keepdim), X3)
    assert ops(graph) == ["sum", "sum"]
    assert [n.attr("dim") for n in graph.nodes] == [2, 0]
    assert out_shape(graph) == shape


def test_reductions_are_also_tensor_methods():
    graph = trace(lambda x: x.sum(-1) + x.mean(-1) + x.max(-1), X)
    assert ops(graph) == ["sum", "mean", "add", "max", "add"]


@pytest.mark.parametrize("kwargs, attrs", [
    ({}, {"dim": 2, "eps": 1e-6}),
    ({"dim": 1, "eps": 1e-5}, {"dim": 1, "eps": 1e-5}),
    ({"dim": -2}, {"dim": 1, "eps": 1e-6}),
])
def test_rms_norm_records_dim_and_eps(kwargs, attrs):
    node = only_node(lambda x: mdsl.rms_norm(x, **kwargs), X3)
    assert (node.op, node.attr_dict) == ("rms_norm", attrs)
    assert node.output.type == X3.type


def test_softmax_is_max_subtracted_exp_over_sum():
    graph = trace(lambda x: mdsl.softmax(x, dim=1), X3)
    assert ops(graph) == ["max", "sub", "exp", "sum", "div"]
    mx, sub, exp, sm, div = graph.nodes
    assert mx.attr_dict == sm.attr_dict == {"dim": 1, "keepdim": True}
    assert sub.inputs == (graph.inputs[0], mx.output)
    assert div.inputs == (exp.output, sm.output)
    assert out_shape(graph) == X3.shape


def test_concat_joins_along_a_dim():
    node = only_node(lambda x, y: mdsl.concat([x, y], dim=-1), X, Tensor[4, 3, f32])
    assert (node.op, node.attr_dict, node.output.shape) == ("concat", {"dim": 1}, (4, 11))


@pytest.mark.parametrize("sizes, expected", [(3, (3, 3, 2)), ([2, 6], (2, 6)), ((8,), (8,))])
def test_split_by_size_or_sizes(sizes, expected):
    graph = trace(lambda x: mdsl.split(x, sizes, dim=1), X)
    (node,) = graph.nodes
    assert node.op == "split"
    assert node.attr_dict == {"sizes": expected, "dim": 1}
    assert [v.shape for v in graph.outputs] == [(4, s) for s in expected]


@pytest.mark.parametrize("chunks, expected", [(2, (4, 4)), (3, (3, 3, 2)), (8, (1,) * 8)])
def test_chunk_follows_torch(chunks, expected):
    node = only_node(lambda x: mdsl.chunk(x, chunks, dim=-1), X)
    assert node.attr_dict == {"sizes": expected, "dim": 1}


@pytest.mark.parametrize("shape, expected", [((8, -1), (8, 4)), ((-1,), (32,)), (((2, 2, -1),), (2, 2, 8))])
def test_reshape_infers_the_minus_one(shape, expected):
    node = only_node(lambda x: mdsl.reshape(x, *shape), X)
    assert (node.op, node.attr("shape"), node.output.shape) == ("reshape", expected, expected)


def test_reshape_method():
    assert out_shape(trace(lambda x: x.reshape(2, 16), X)) == (2, 16)


@pytest.mark.parametrize("fn, perm, shape", [
    (lambda x: mdsl.transpose(x), (0, 2, 1), (2, 8, 4)),
    (lambda x: mdsl.transpose(x, 0, -1), (2, 1, 0), (8, 4, 2)),
    (lambda x: mdsl.permute(x, [1, -1, 0]), (1, 2, 0), (4, 8, 2)),
    (lambda x: x.permute([2, 0, 1]), (2, 0, 1), (8, 2, 4)),
    (lambda x: x.transpose(0, 1), (1, 0, 2), (4, 2, 8)),
    (lambda x: x.T, (0, 2, 1), (2, 8, 4)),  # swaps the last two dims, like torch's .mT
])
def test_transpose_and_permute(fn, perm, shape):
    node = only_node(fn, X3)
    assert (node.op, node.attr("perm"), node.output.shape) == ("transpose", perm, shape)


# ---------------------------------------------------------------------------------------------
# Python operators

@pytest.mark.parametrize("fn, expected", [
    (lambda x, y: x + y, [("add", {})]),
    (lambda x, y: x - y, [("sub", {})]),
    (lambda x, y: x * y, [("mul", {})]),
    (lambda x, y: x / y, [("div", {})]),
    (lambda x, y: -x, [("neg", {})]),
    (lambda x, y: +x * 1, [("mul_scalar", {"value": 1.0})]),
    (lambda x, y: x + 2, [("add_scalar", {"value": 2.0})]),
    (lambda x, y: 2 + x, [("add_scalar", {"value": 2.0})]),
    (lambda x, y: x - 2, [("add_scalar", {"value": -2.0})]),
    (lambda x, y: 2 - x, [("neg", {}), ("add_scalar", {"value": 2.0})]),
    (lambda x, y: x * 3, [("mul_scalar", {"value": 3.0})]),
    (lambda x, y: 3 * x, [("mul_scalar", {"value": 3.0})]),
    (lambda x, y: x / 4, [("mul_scalar", {"value": 0.25})]),
    (lambda x, y: 1 / x, [("reciprocal", {})]),
    (lambda x, y: 3 / x, [("reciprocal", {}), ("mul_scalar", {"value": 3.0})]),
    (lambda x, y: x ** 2, [("square", {})]),
    (lambda x, y: x ** 0.5, [("sqrt", {})]),
    (lambda x, y: x ** -0.5, [("rsqrt", {})]),
    (lambda x, y: x ** -1, [("reciprocal", {})]),
    (lambda x, y: x ** 3, [("pow_scalar", {"exponent": 3.0})]),
    (lambda x, y: x ** 1 + y, [("add", {})]),
    (lambda x, y: x * np.float32(2), [("mul_scalar", {"value": 2.0})]),
    (lambda x, y: np.float16(0.5) * x, [("mul_scalar", {"value": 0.5})]),
    (lambda x, y: np.float64(1.5) + x, [("add_scalar", {"value": 1.5})]),
    (lambda x, y: x - np.int64(3), [("add_scalar", {"value": -3.0})]),
    (lambda x, y: x * np.array(2.0), [("mul_scalar", {"value": 2.0})]),
])
def test_python_operators(fn, expected):
    graph = trace(fn, X, X)
    assert [(n.op, n.attr_dict) for n in graph.nodes] == expected
    assert out_shape(graph) == X.shape


def test_matmul_operator_batches_and_broadcasts():
    node = only_node(lambda x, w: x @ w, Tensor[2, 1, 4, 8, f32], Tensor[3, 8, 5, f32])
    assert (node.op, node.output.shape) == ("matmul", (2, 3, 4, 5))
    assert ops(trace(lambda x, w: mdsl.matmul(x, w), X, Tensor[8, 2, f32])) == ["matmul"]


@pytest.mark.parametrize("a, b, shape", [
    ((4, 1, 8), (3, 1), (4, 3, 8)),
    ((4, 8), (8,), (4, 8)),
    ((4, 1), (1, 8), (4, 8)),
    ((1,), (2, 3), (2, 3)),
])
def test_binary_operators_broadcast_like_numpy(a, b, shape):
    graph = trace(lambda x, y: x * y, Tensor[(*a, f32)], Tensor[(*b, f32)])
    assert out_shape(graph) == shape == np.broadcast_shapes(a, b)


def test_broadcast_mismatch_is_a_shape_error():
    with pytest.raises(mdsl.ShapeError, match="do not broadcast"):
        trace(lambda x, y: x + y, X, Tensor[4, 3, f32])


def test_named_arithmetic_functions_match_the_operators():
    graph = trace(lambda x, y: mdsl.div(mdsl.mul(mdsl.sub(mdsl.add(x, y), y), 2), mdsl.power(x, 2)), X, X)
    assert ops(graph) == ["add", "sub", "mul_scalar", "square", "div"]


# ---------------------------------------------------------------------------------------------
# kernels: signatures, outputs, caching

def test_annotations_give_the_input_shapes_dtypes_and_names():
    @mdsl.kernel
    def k(x: Tensor[16, 64, f16], w: Tensor[64, 32, f16]):
        return x @ w

    graph = k.graph
    assert [(v.name, v.shape, v.dtype) for v in graph.inputs] == [("x", (16, 64), f16), ("w", (64, 32), f16)]
    assert graph.name == "k"
    assert out_shape(graph) == (16, 32) and graph.outputs[0].dtype is f16
    assert k.graph is graph  # traced once


def test_tuple_return_gives_several_outputs():
    @mdsl.kernel
    def k(x: Tensor[4, 8, f32]):
        return mdsl.exp(x), mdsl.sum(x, -1)

    graph = k.graph
    assert [v.shape for v in graph.outputs] == [(4, 8), (4,)]
    assert [v.name for v in graph.outputs] == [n.output.name for n in graph.nodes]


def test_kernel_name_can_be_given():
    @mdsl.kernel(name="my kernel")
    def k(x: Tensor[4, f32]):
        return x

    assert k.name == "my kernel"
    assert k.graph.name == "my_kernel"   # the IR's names are identifiers, so the printed graph parses back
    assert parse_graph(str(k.graph)) == k.graph


def test_kernel_keeps_the_function_name_and_doc():
    @mdsl.kernel
    def scaled(x: Tensor[4, f32]):
        """Twice x."""
        return x * 2

    assert isinstance(scaled, mdsl.KernelFunction)
    assert scaled.__name__ == "scaled"
    assert scaled.__doc__ == "Twice x."
    assert scaled.__wrapped__.__name__ == "scaled"


def test_unannotated_kernel_traces_per_shape_and_dtype_signature():
    calls = []

    @mdsl.kernel
    def k(x, y):
        calls.append(x.shape)
        return x * y + 1

    a, b = np.ones((2, 3), np.float32), np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(k(a, b), np.full((2, 3), 2, np.float32))
    assert calls == [(2, 3)]
    k(a * 2, b * 3)                            # same signature: no retrace
    assert calls == [(2, 3)]
    k(np.ones((4, 3), np.float32), np.ones((1, 3), np.float32))   # new shapes: retrace
    assert calls == [(2, 3), (4, 3)]
    k(a.astype(np.float16), b.astype(np.float16))                 # new dtypes: retrace
    assert calls == [(2, 3), (4, 3), (2, 3)]
    assert k.trace(Tensor[4, 3, f32], Tensor[1, 3, f32]).inputs[1].shape == (1, 3)  # cached
    assert len(calls) == 3


def test_trace_with_specs_matches_trace_with_arrays():
    @mdsl.kernel
    def k(x):
        return mdsl.relu(x)

    assert k.trace(Tensor[2, 5, f16]) is k.trace(np.zeros((2, 5), np.float16))


# ---------------------------------------------------------------------------------------------
# running: the reference interpreter agrees with numpy

def _rms_norm(x, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


PROGRAMS = {
    "rms_norm_linear": (lambda x, w: mdsl.rms_norm(x) @ w, lambda x, w: _rms_norm(x) @ w),
    "attention": (lambda x, w: mdsl.softmax(x @ w) @ w.T, lambda x, w: _softmax(x @ w) @ w.T),
    "gated": (lambda x, w: mdsl.silu(x @ w) * mdsl.gelu(x @ w) - 0.5 * mdsl.sigmoid(x @ w),
              lambda x, w: (x @ w) / (1 + np.exp(-(x @ w))) * _gelu(x @ w) - 0.5 / (1 + np.exp(-(x @ w)))),
    "norms": (lambda x, w: mdsl.rsqrt(mdsl.mean(x ** 2, -1, keepdim=True) + 1) * mdsl.clamp(x, -1, 1) + mdsl.max(x, 0),
              lambda x, w: (np.mean(x ** 2, -1, keepdims=True) + 1) ** -0.5 * np.clip(x, -1, 1) + x.max(0)),
    "layout": (lambda x, w: mdsl.concat(mdsl.chunk(x, 2, dim=1)[::-1], dim=0).reshape(4, -1).T,
               lambda x, w: np.concatenate(np.split(x, 2, axis=1)[::-1], axis=0).reshape(4, -1).T),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("dtype, rtol", [(np.float32, 1e-5), (np.float16, 2e-3)])
def test_calling_a_kernel_matches_numpy(name, dtype, rtol):
    fn, reference = PROGRAMS[name]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 16)).astype(dtype)
    w = (rng.standard_normal((16, 12)) / 4).astype(dtype)
    out = mdsl.kernel(fn)(x, w)
    assert out.dtype == dtype
    expected = reference(x.astype(np.float64), w.astype(np.float64))
    np.testing.assert_allclose(out, expected, rtol=rtol, atol=rtol * np.abs(expected).max())

"""Frontend errors: each is an MdslError subclass whose message names this file and the exact line of
the failing expression (marked below with a `# @tag` comment) and says how to fix it.

No `from __future__ import annotations` here: annotations are evaluated where they are written.
"""

import re
from pathlib import Path

import numpy as np
import pytest

import mdsl
from mdsl import Tensor, f32

_LINES = Path(__file__).read_text().splitlines()


def line_of(tag: str) -> int:
    """The line of this file that ends with the comment `# @tag`."""
    (line,) = [i + 1 for i, text in enumerate(_LINES) if text.rstrip().endswith(f"# @{tag}")]
    return line


def check(info: pytest.ExceptionInfo, tag: str, *fragments: str) -> str:
    """The error names this file at the tagged line, has a hint and contains `fragments`."""
    text = str(info.value)
    assert isinstance(info.value, mdsl.MdslError)
    assert re.search(rf"{re.escape(Path(__file__).name)}:{line_of(tag)}\b", text), text
    assert "\nhint: " in text, text
    for fragment in fragments:
        assert fragment in text, text
    return text


# ---------------------------------------------------------------------------------------------
# shapes and data-dependent Python

def test_matmul_shape_mismatch_points_at_the_expression():
    @mdsl.kernel
    def k(x: Tensor[4, 8, f32], w: Tensor[16, 2, f32]):
        y = mdsl.exp(x)
        return x @ w  # @matmul

    with pytest.raises(mdsl.ShapeError) as info:
        k.graph
    text = check(info, "matmul", "inner dimensions differ", "8 != 16", "transpose")
    shown, caret = text.splitlines()[1:3]
    assert shown.strip() == "return x @ w  # @matmul"
    assert shown[caret.index("^"):caret.rindex("^") + 1] == "x @ w"


def test_if_on_a_tensor_is_data_dependent_control_flow():
    @mdsl.kernel
    def k(x: Tensor[4, f32]):
        if x:  # @if
            return x
        return -x

    with pytest.raises(mdsl.TraceError) as info:
        k.graph
    check(info, "if", "truth value", "data-dependent control flow", "x.shape")


def test_float_of_a_tensor():
    @mdsl.kernel
    def k(x: Tensor[4, f32]):
        return x * float(x)  # @float

    with pytest.raises(mdsl.TraceError) as info:
        k.graph
    check(info, "float", "float value")


def test_iterating_a_tensor():
    @mdsl.kernel
    def k(x: Tensor[4, 2, f32]):
        return mdsl.concat([row for row in x])  # @iter

    with pytest.raises(mdsl.TraceError) as info:
        k.graph
    check(info, "iter", "iterating", "mdsl.split")


def test_indexing_a_tensor():
    @mdsl.kernel
    def k(x: Tensor[4, 2, f32]):
        return x[0]  # @index

    with pytest.raises(mdsl.UnsupportedError) as info:
        k.graph
    check(info, "index", "indexing", "mdsl.split")


@pytest.mark.parametrize("compare", [lambda x: x > 0, lambda x: x == x, lambda x: 0 <= x])
def test_comparing_tensors(compare):
    @mdsl.kernel
    def k(x: Tensor[4, f32]):
        return compare(x)

    with pytest.raises(mdsl.TraceError, match="comparisons") as info:
        k.graph
    assert "hint: use mdsl.max" in str(info.value)


# ---------------------------------------------------------------------------------------------
# signatures and arguments

def test_unsupported_dtype_in_an_annotation():
    with pytest.raises(mdsl.DTypeError) as info:
        @mdsl.kernel
        def k(x: Tensor[4, "f64"]):  # @annotation
            return x
    check(info, "annotation", "unsupported dtype 'f64'", "f16, bf16 or f32")


def test_unsupported_dtype_of_an_argument():
    @mdsl.kernel
    def k(x):
        return x

    with pytest.raises(mdsl.DTypeError) as info:
        k(np.zeros(4))  # @float64
    check(info, "float64", "argument x", "float64", ".astype(np.float32)")


def test_argument_shape_differs_from_its_annotation():
    @mdsl.kernel
    def k(x: Tensor[4, 8, f32]):
        return x

    with pytest.raises(mdsl.ShapeError) as info:
        k(np.zeros((8, 4), np.float32))  # @wrong-shape
    check(info, "wrong-shape", "argument x is Tensor[8, 4, f32] but is annotated Tensor[4, 8, f32]")


def test_wrong_number_of_arguments():
    @mdsl.kernel
    def k(x: Tensor[4, f32], y: Tensor[4, f32]):
        return x + y

    with pytest.raises(mdsl.TraceError) as info:
        k(np.zeros(4, np.float32))  # @arity
    check(info, "arity", "takes 2 tensor(s), got 1", "k(x, y)")


def test_returning_something_else_than_a_tensor():
    @mdsl.kernel  # @returns
    def k(x: Tensor[4, f32]):
        return 1.0

    with pytest.raises(mdsl.TraceError) as info:
        k.graph
    check(info, "returns", "the result is float, not a tensor")


def test_using_a_tensor_after_its_trace_ended():
    leaked = []

    @mdsl.kernel
    def k(x: Tensor[4, f32]):
        leaked.append(x)
        return x

    @mdsl.kernel
    def later(y: Tensor[4, f32]):
        return y + leaked[0]  # @leaked-in-kernel

    k.graph
    with pytest.raises(mdsl.TraceError) as info:
        mdsl.exp(leaked[0])  # @leaked
    check(info, "leaked", "used after that trace ended", "kernel k")
    with pytest.raises(mdsl.TraceError) as info:
        later.graph
    check(info, "leaked-in-kernel", "used after that trace ended")


# ---------------------------------------------------------------------------------------------
# hand-written block graphs

def test_mixing_block_tiles_and_kernel_tensors():
    @mdsl.kernel
    def k(x: Tensor[4, 8, f32], w: Tensor[8, 8, f32]):
        with mdsl.block_graph(grid=(2,), forloop=1) as b:
            xt = b.input(x, imap=(0,))
            b.output(b.accum(xt @ w), omap=(0,))  # @mix
        return b.results[0]

    with pytest.raises(mdsl.TraceError) as info:
        k.graph
    check(info, "mix", "mixes a tensor of block graph", "b.input")


def test_block_graph_outside_a_kernel():
    with pytest.raises(mdsl.TraceError) as info:
        mdsl.block_graph(grid=(2,))  # @outside
    check(info, "outside", "inside a @mdsl.kernel function")


def test_grid_that_does_not_divide_a_dim_points_at_the_input():
    @mdsl.kernel
    def k(x: Tensor[6, 8, f32]):
        with mdsl.block_graph(grid=(4,), forloop=2) as b:
            xt = b.input(x, imap=(0,), fmap=1)  # @divide
            b.output(b.accum(xt), omap=(0,))
        return b.results[0]

    with pytest.raises(mdsl.ValidationError) as info:
        k.graph
    check(info, "divide", "grid dim x=4 does not divide dim 0", "divides 6")


def test_block_output_without_an_accumulator():
    @mdsl.kernel
    def k(x: Tensor[4, 8, f32]):
        with mdsl.block_graph(grid=(2,), forloop=1) as b:
            xt = b.input(x, imap=(0,))
            b.output(mdsl.exp(xt), omap=(0,))  # @no-accum
        return b.results[0]

    with pytest.raises(mdsl.ValidationError) as info:
        k.graph
    check(info, "no-accum", "does not pass through an accumulator", "b.accum")


def test_omap_that_maps_a_split_grid_dim_to_nothing():
    @mdsl.kernel
    def k(x: Tensor[4, 8, f32]):
        with mdsl.block_graph(grid=(2,), forloop=1) as b:
            xt = b.input(x, imap=(0,))
            b.output(b.accum(xt), omap=(None,))  # @omap
        return b.results[0]

    with pytest.raises(mdsl.ValidationError) as info:
        k.graph
    check(info, "omap", "maps grid dim x (size 2) to nothing", "overwrite")


def test_split_inside_a_block_graph_is_a_level_error():
    @mdsl.kernel
    def k(x: Tensor[4, 8, f32]):
        with mdsl.block_graph(grid=(2,), forloop=1) as b:
            xt = b.input(x, imap=(0,))
            lo, hi = mdsl.split(xt, 4, dim=1)  # @split
            b.output(b.accum(lo), omap=(0,))
        return b.results[0]

    with pytest.raises(mdsl.UnsupportedError) as info:
        k.graph
    check(info, "split", "split is not available inside a block graph", "kernel level")


def test_size_one_grid_dims_need_no_map():
    """A map entry for a grid dim of size 1 splits nothing, so one map serves every grid."""
    @mdsl.kernel
    def k(x: Tensor[4, 8, f32]):
        with mdsl.block_graph(grid=(1, 2), forloop=1) as b:
            xt = b.input(x, imap=(1, 0))
            b.output(b.accum(xt), omap=(1, 0))
        return b.results[0]

    (custom,) = k.graph.nodes
    assert custom.body.inputs[0].imap == (None, 0, None)
    assert custom.body.outputs[0].omap == (None, 0, None)


def test_grid_map_with_more_than_three_entries():
    @mdsl.kernel
    def k(x: Tensor[4, 8, f32]):
        with mdsl.block_graph(grid=(2,), forloop=1) as b:
            xt = b.input(x, imap=(0, None, None, None))  # @map4
            b.output(b.accum(xt), omap=(0,))
        return b.results[0]

    with pytest.raises(mdsl.ValidationError, match="at most 3 entries") as info:
        k.graph
    assert f"test_errors.py:{line_of('map4')}:" in str(info.value)


# ---------------------------------------------------------------------------------------------
# numpy on traced tensors, call arguments, scalars, launch parameters

def test_numpy_function_on_a_traced_tensor_names_the_mdsl_function():
    @mdsl.kernel
    def k(x: Tensor[4, f32]):
        return np.exp(x)  # @np-exp

    with pytest.raises(mdsl.TraceError) as info:
        k.graph
    check(info, "np-exp", "numpy.exp cannot run on traced tensor %x", "use mdsl.exp instead")


@pytest.mark.parametrize("call,fragments", [
    (lambda x: np.sum(x, axis=0), ("numpy.sum", "use mdsl.sum instead")),
    (lambda x: np.concatenate([x, x]), ("numpy.concatenate", "use mdsl.concat instead")),
    (lambda x: np.tanh(x), ("numpy.tanh", "mdsl has no tanh", "mdsl.exp")),
    (lambda x: np.add.reduce(x), ("numpy.add.reduce",)),
    (lambda x: np.multiply(x, 2.0, out=x), ("numpy.multiply",)),
    (lambda x: np.asarray(x), ("has no values to make a numpy array of", "mdsl.exp")),
])
def test_other_numpy_calls_on_traced_tensors(call, fragments):
    @mdsl.kernel
    def k(x: Tensor[4, f32]):
        return call(x)

    with pytest.raises(mdsl.TraceError) as info:
        k.graph
    text = str(info.value)
    assert f"{Path(__file__).name}:" in text and "\nhint: " in text
    for fragment in fragments:
        assert fragment in text, text


def test_numpy_scalars_and_operators_still_trace():
    @mdsl.kernel
    def k(x: Tensor[4, f32]):
        return np.float32(2.0) * x + x * np.float64(0.5) - np.int64(1) + np.negative(x) ** np.int32(2)

    assert [n.op for n in k.graph.nodes] == ["mul_scalar", "mul_scalar", "add", "add_scalar", "neg", "square", "add"]

    @mdsl.kernel
    def by_shape(x: Tensor[4, 2, f32]):   # numpy's shape functions read the static shape
        assert np.shape(x) == (4, 2) and np.ndim(x) == 2 and np.size(x) == 8 and np.size(x, 1) == 2
        return x

    assert by_shape.graph.outputs == by_shape.graph.inputs


def test_keyword_arguments_of_a_kernel_call():
    @mdsl.kernel
    def k(x: Tensor[4, f32], y: Tensor[4, f32]):
        return x - y

    a, b = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    np.testing.assert_array_equal(k(y=b, x=a), a - b)
    np.testing.assert_array_equal(k(a, y=b), a - b)
    with pytest.raises(mdsl.TraceError) as info:
        k(a, b, z=b)  # @kwarg
    check(info, "kwarg", "kernel k: got an unexpected keyword argument 'z'", "k(x, y)", "out=")
    with pytest.raises(mdsl.TraceError) as info:
        k(a, x=b)  # @kwarg-twice
    check(info, "kwarg-twice", "multiple values for argument 'x'")


@pytest.mark.parametrize("expression", [lambda x: x * 10**400, lambda x: 10**400 + x, lambda x: x - 10**400,
                                        lambda x: 10**400 / x, lambda x: x ** 10**400])
def test_integers_beyond_float64_are_trace_errors(expression):
    @mdsl.kernel
    def k(x: Tensor[4, f32]):
        return expression(x)

    with pytest.raises(mdsl.TraceError, match=r"the scalar about 2\^1328, beyond the range of a float64") as info:
        k.graph
    assert f"{Path(__file__).name}:" in str(info.value) and info.value.hint


def test_clamp_bounds_beyond_float64():
    @mdsl.kernel
    def k(x: Tensor[4, f32]):
        return mdsl.clamp(x, 0, 10**400)  # @clamp-big

    with pytest.raises(mdsl.ValidationError) as info:
        k.graph
    check(info, "clamp-big", "attribute max=about 2^1328 of clamp is beyond the range of a float64")


@pytest.mark.parametrize("kwargs,message", [
    ({"grid": (0,)}, "grid [0, 1, 1]: dim x must be an integer from 1 to 2147483647"),
    ({"grid": (2, 0)}, "grid [2, 0, 1]: dim y must be an integer from 1 to 65535"),
    ({"grid": (2.0,)}, "grid [2.0, 1, 1]: dim x must be an integer"),
    ({"grid": 2}, "grid must be a tuple of 1 to 3 block counts, got 2"),
    ({"grid": (2,), "forloop": 0}, "the for-loop range must be an integer from 1 to 2147483647, got 0"),
    ({"grid": (2,), "threads": 100}, "a block of 100 threads: use a multiple of 32"),
])
def test_bad_launch_parameters_of_a_block_graph(kwargs, message):
    @mdsl.kernel
    def k(x: Tensor[4, 8, f32]):
        with mdsl.block_graph(**kwargs) as b:  # @launch
            xt = b.input(x, imap=(0,))
            b.output(b.accum(xt), omap=(0,))
        return b.results[0]

    with pytest.raises(mdsl.ValidationError) as info:
        k.graph
    check(info, "launch", message)


def test_zero_size_array_argument():
    @mdsl.kernel
    def k(x):
        return x

    with pytest.raises(mdsl.ShapeError) as info:
        k(np.zeros((0, 4), np.float32))  # @empty
    check(info, "empty", "kernel k: argument x f32[0, 4]: dim 0 is 0, not a positive integer")


# ---------------------------------------------------------------------------------------------
# kernels calling kernels

@mdsl.kernel
def _scaled(x, s):
    return x * s + 1.0  # @callee


def test_a_kernel_calling_a_kernel_inlines_it():
    @mdsl.kernel
    def outer(x: Tensor[4, f32], y: Tensor[4, f32]):
        return mdsl.exp(_scaled(x, y))

    graph = outer.graph
    assert [n.op for n in graph.nodes] == ["mul", "add_scalar", "exp"]
    assert [v.name for v in graph.inputs] == ["x", "y"] and graph.nodes[0].inputs == tuple(graph.inputs)
    assert graph.nodes[0].loc.line == line_of("callee")   # the callee's own line
    a, b = np.arange(4, dtype=np.float32), np.full(4, 0.5, np.float32)
    np.testing.assert_allclose(outer(a, b), np.exp(a * b + 1.0), rtol=1e-6)


def test_a_kernel_with_several_results_called_twice():
    @mdsl.kernel
    def halves(x):
        return mdsl.chunk(x, 2, dim=0)

    @mdsl.kernel
    def outer(x: Tensor[4, f32]):
        lo, hi = halves(x)
        a, b = halves(lo + hi)
        return a * b

    assert [n.op for n in outer.graph.nodes] == ["split", "add", "split", "mul"]
    names = [v.name for n in outer.graph.nodes for v in n.outputs]
    assert len(names) == len(set(names)) == 6


def test_a_kernel_calling_itself():
    @mdsl.kernel
    def k(x: Tensor[4, f32]):
        return k(x)  # @recursion

    with pytest.raises(mdsl.TraceError) as info:
        k.graph
    check(info, "recursion", "kernel k calls itself with the same shapes", "Python loop")


def test_a_kernel_called_with_a_mix_of_traced_and_real_tensors():
    @mdsl.kernel
    def outer(x: Tensor[4, f32]):
        return _scaled(x, np.ones(4, np.float32))  # @mixed

    with pytest.raises(mdsl.TraceError) as info:
        outer.graph
    check(info, "mixed", "kernel _scaled: argument s is a ndarray, not a tensor of the kernel being traced")


def test_a_kernel_called_inside_a_block_graph():
    @mdsl.kernel
    def outer(x: Tensor[4, 8, f32]):
        with mdsl.block_graph(grid=(2,)) as b:
            xt = b.input(x, imap=(0,))
            b.output(b.accum(_scaled(xt, xt)), omap=(0,))  # @in-block
        return b.results[0]

    with pytest.raises(mdsl.TraceError) as info:
        outer.graph
    check(info, "in-block", "kernel _scaled is called inside a block graph", "outside the `with mdsl.block_graph")


def test_an_unannotated_kernel_points_at_its_definition():
    @mdsl.kernel  # @unannotated
    def k(x):
        return x

    with pytest.raises(mdsl.TraceError) as info:
        k.graph
    check(info, "unannotated", "parameter(s) x have no Tensor[...] annotation")

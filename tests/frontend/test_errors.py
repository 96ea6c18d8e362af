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

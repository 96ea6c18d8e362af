"""Structural validation: each rule raises its error with the promised message, located at the
user's line of the failing node (for a block graph's maps: the line of its custom op)."""
from __future__ import annotations

import pytest

from mdsl.errors import DTypeError, ShapeError, SourceLoc, UnsupportedError, ValidationError
from mdsl.ir import (SMEM_LIMIT_BYTES, BlockGraph, BlockInput, BlockOutput, KernelGraph, Node, ThreadGraph, Var, f16,
                     f32, get_op, validate_block_graph, validate_kernel_graph)
from mdsl.ir.types import TensorType

CUSTOM_LOC = SourceLoc(__file__, 3, 4, 10)  # where the user's custom op is
NODE_LOC = SourceLoc(__file__, 5, 8, 12)    # where an operator inside it is


def var(name: str, shape, dtype=f32) -> Var:
    return Var(name, TensorType(shape, dtype))


def node(op: str, inputs, outputs, loc=NODE_LOC, body=None, **attrs) -> Node:
    return Node(op, inputs, outputs, get_op(op).normalize_attrs(attrs), body, loc)


def raises(cls, match: str, loc, fn, *args, **kwargs):
    """Assert that fn(*args) raises cls matching `match`, located at `loc`; return the error."""
    with pytest.raises(cls, match=match) as info:
        fn(*args, **kwargs)
    assert info.value.loc == loc
    return info.value


# ---------------------------------------------------------------------------------------------
# a custom kernel to break in every way: Y[4, 6] = X[4, 8] @ W[8, 6], W's columns split across the
# grid, the shared dim (8) across the for-loop

X, W = var("X", (4, 8)), var("W", (8, 6))


def linear(grid=(2, 1, 1), forloop=2, x_map=((None, None, None), 1), w_map=((1, None, None), 0),
           omap=(1, None, None), x_tile=(4, 4), w_tile=(4, 3), y=(4, 6), threads=128, dtype=f32,
           extra_nodes=(), output=None, x_shape=X.shape) -> KernelGraph:
    x, w = var("x", x_tile, dtype), var("w", w_tile, dtype)
    p = var("p", (x_tile[0], w_tile[1]), dtype)
    a = var("a", p.shape, dtype)
    nodes = [node("matmul", [x, w], [p]), node("accum", [p], [a]), *extra_nodes]
    body = BlockGraph(grid, threads, forloop, [BlockInput(x, *x_map), BlockInput(w, *w_map)], nodes,
                      [BlockOutput(output or a, omap)])
    xs, ws = var("X", x_shape, dtype), var("W", W.shape, dtype)
    ys = var("Y", y, dtype)
    return KernelGraph("linear", [xs, ws], [Node("custom", [xs, ws], [ys], (), body, CUSTOM_LOC)], [ys])


def test_the_base_kernel_is_valid():
    validate_kernel_graph(linear())


# ---------------------------------------------------------------------------------------------
# node types

def test_declared_type_differs_from_inferred():
    y = var("y", (4, 7))
    graph = KernelGraph("g", [X, W], [node("matmul", [X, W], [y])], [y])
    raises(ShapeError, r"%y is declared f32\[4, 7\] but the operator gives f32\[4, 6\]", NODE_LOC,
           validate_kernel_graph, graph)


def test_custom_output_declared_with_the_wrong_type():
    raises(ShapeError, r"%Y is declared f32\[4, 3\] but the operator gives f32\[4, 6\]", CUSTOM_LOC,
           validate_kernel_graph, linear(y=(4, 3)))


def test_operator_shape_error_carries_the_location():
    y = var("y", (4, 6))
    graph = KernelGraph("g", [X, W], [node("matmul", [W, X], [y])], [y])
    err = raises(ShapeError, "inner dimensions differ", NODE_LOC, validate_kernel_graph, graph)
    assert str(err).startswith(f"{NODE_LOC}: matmul")
    assert "hint: " in str(err)


def test_wrong_number_of_outputs():
    y, z = var("y", (4, 6)), var("z", (4, 6))
    graph = KernelGraph("g", [X, W], [node("matmul", [X, W], [y, z])], [y])
    raises(ValidationError, r"matmul produces 1 value\(s\) but the node names 2", NODE_LOC, validate_kernel_graph, graph)


# ---------------------------------------------------------------------------------------------
# grid, imap, fmap, omap

def test_grid_dim_must_divide_the_mapped_dim():
    raises(ValidationError, r"grid dim x=4 does not divide dim 1 of f32\[8, 6\] \(6\)", CUSTOM_LOC,
           validate_kernel_graph, linear(grid=(4, 1, 1)))


def test_imap_must_not_map_a_size_one_grid_dim():
    raises(ValidationError, r"imap maps grid dim y \(size 1\) to tensor dim 0", CUSTOM_LOC,
           validate_kernel_graph, linear(x_map=((None, 0, None), 1)))


def test_two_grid_dims_cannot_split_one_tensor_dim():
    raises(ValidationError, "grid dims x and y both split tensor dim 1", CUSTOM_LOC,
           validate_kernel_graph, linear(grid=(2, 3, 1), w_map=((1, 1, None), 0)))


def test_imap_dim_out_of_range():
    raises(ValidationError, r"imap maps grid dim x to dim 2, but f32\[8, 6\] has rank 2", CUSTOM_LOC,
           validate_kernel_graph, linear(w_map=((2, None, None), 0)))


def test_forloop_must_divide_the_fmap_dim():
    raises(ValidationError, r"the for-loop range 3 does not divide dim 1 of the block's tile \(8\)", CUSTOM_LOC,
           validate_kernel_graph, linear(forloop=3))


def test_fmap_out_of_range():
    raises(ValidationError, "fmap 2 is out of range", CUSTOM_LOC, validate_kernel_graph,
           linear(x_map=((None, None, None), 2)))


def test_declared_tile_differs_from_the_mapped_tile():
    raises(ShapeError, r"its tile is f32\[4, 4\] under imap \[None, None, None\] and fmap 1, but it is declared "
                       r"f32\[4, 2\]", CUSTOM_LOC, validate_kernel_graph, linear(x_tile=(4, 2)))


def test_omap_must_map_every_grid_dim_above_one():
    raises(ValidationError, r"omap maps grid dim x \(size 2\) to nothing, so the 2 blocks along x would overwrite "
                            "each other's output", CUSTOM_LOC, validate_kernel_graph, linear(omap=(None, None, None)))


def test_omap_must_not_map_a_size_one_grid_dim():
    raises(ValidationError, r"omap maps grid dim y \(size 1\) to tensor dim 0", CUSTOM_LOC,
           validate_kernel_graph, linear(omap=(1, 0, None)))


def test_two_grid_dims_cannot_concatenate_into_one_dim():
    graph = linear(grid=(2, 2, 1), x_map=((None, 0, None), 1), w_map=((1, None, None), 0), x_tile=(2, 4),
                   omap=(1, 1, None))
    raises(ValidationError, "grid dims x and y both concatenate into tensor dim 1", CUSTOM_LOC,
           validate_kernel_graph, graph)


@pytest.mark.parametrize("grid, forloop, threads, match", [
    ((0, 1, 1), 2, 128, r"grid \[0, 1, 1\]: dim x must be an integer from 1 to 2147483647"),
    ((2, 1, 70000), 2, 128, r"grid \[2, 1, 70000\]: dim z must be an integer from 1 to 65535"),
    ((2, 1, 1), 0, 128, "the for-loop range must be an integer from 1 to 2147483647, got 0"),
    ((2, 1, 1), 2**40, 128, "the for-loop range must be an integer from 1 to 2147483647, got 1099511627776"),
    ((2, 1, 1), 2.0, 128, "the for-loop range must be an integer from 1 to 2147483647, got 2.0"),
    ((2, 1, 1), 2, 100, "a block of 100 threads: use a multiple of 32 between 32 and 1024"),
    ((2, 1, 1), 2, 2048, "a block of 2048 threads"),
    ((2, 1, 1), 2, 0, "a block of 0 threads"),
])
def test_grid_loop_and_thread_counts(grid, forloop, threads, match):
    raises(ValidationError, match, CUSTOM_LOC, validate_kernel_graph, linear(grid=grid, forloop=forloop, threads=threads))


def test_block_graph_input_count():
    body = linear().nodes[0].body
    raises(ValidationError, r"reads 2 inputs but the custom op passes 1", None, validate_block_graph, body, (X.type,))


# ---------------------------------------------------------------------------------------------
# shared memory

def _big_tile_graph(rows: int, dtype=f32) -> KernelGraph:
    # a single block that loads all of X[rows, 8] at once
    return linear(grid=(1, 1, 1), forloop=1, x_map=((None, None, None), None), w_map=((None, None, None), None),
                  omap=(None, None, None), x_tile=(rows, 8), w_tile=(8, 6), y=(rows, 6), dtype=dtype,
                  x_shape=(rows, 8))


def test_tiles_over_the_shared_memory_limit():
    rows = SMEM_LIMIT_BYTES // (8 * 4)  # the X tile alone fills the limit
    graph = _big_tile_graph(rows)
    err = raises(ValidationError, r"KB of shared memory, over the 227 KB limit \(largest: %p f32\[7264, 6\]",
                 CUSTOM_LOC, validate_kernel_graph, graph)
    assert "larger grid" in err.hint
    validate_kernel_graph(graph, smem_limit=3 * SMEM_LIMIT_BYTES)  # the same graph fits a larger limit


def test_tiles_within_the_shared_memory_limit():
    validate_kernel_graph(_big_tile_graph(SMEM_LIMIT_BYTES // (8 * 4) // 4))


def test_accumulators_count_as_f32_in_shared_memory():
    # live in the loop: x f16[rows, 8], w f16[8, 6], p f16[rows, 6] and the accumulator a [rows, 6],
    # which would fit as f16 but is kept in f32
    w_bytes = 8 * 6 * 2
    rows = (SMEM_LIMIT_BYTES - w_bytes) // (2 * 8 + 2 * 6 + 2 * 6)
    body = _big_tile_graph(rows, f16).nodes[0].body
    types = (TensorType((rows, 8), f16), TensorType((8, 6), f16))
    raises(ValidationError, "KB of shared memory", None, validate_block_graph, body, types)
    validate_block_graph(body, types, smem_limit=(2 * 8 + 2 * 6 + 4 * 6) * rows + w_bytes)


# ---------------------------------------------------------------------------------------------
# the for-loop and its accumulators

def test_output_path_without_an_accumulator():
    p = linear().nodes[0].body.nodes[0].output
    raises(ValidationError, "block output %p does not pass through an accumulator", CUSTOM_LOC,
           validate_kernel_graph, linear(output=p))


def test_node_mixing_loop_and_post_loop_values():
    p, a = var("p", (4, 3)), var("a", (4, 3))
    mixed = var("m", (4, 3))
    err = raises(ValidationError, "%m = add\\(...\\) mixes %p from inside the for-loop with %a from after it",
                 NODE_LOC, validate_kernel_graph, linear(extra_nodes=[node("add", [a, p], [mixed])], output=mixed))
    assert "accumulate %p" in err.hint


def test_nested_accumulators():
    a, b = var("a", (4, 3)), var("b", (4, 3))
    raises(ValidationError, "accum accumulates %a, which is already accumulated", NODE_LOC,
           validate_kernel_graph, linear(extra_nodes=[node("accum", [a], [b])], output=b))


def test_post_loop_chain_is_valid():
    a, b = var("a", (4, 3)), var("b", (4, 3))
    validate_kernel_graph(linear(extra_nodes=[node("exp", [a], [b])], output=b))


# ---------------------------------------------------------------------------------------------
# scopes

def test_use_before_definition_in_a_kernel_graph():
    y, z = var("y", (4, 6)), var("z", (4, 6))
    graph = KernelGraph("g", [X, W], [node("exp", [z], [y]), node("matmul", [X, W], [z])], [y])
    raises(ValidationError, "%z is used before it is defined in the kernel graph g", NODE_LOC,
           validate_kernel_graph, graph)


def test_use_before_definition_in_a_block_graph():
    a, b, c = var("a", (4, 3)), var("b", (4, 3)), var("c", (4, 3))
    graph = linear(extra_nodes=[node("exp", [c], [b]), node("exp", [a], [c])], output=b)
    raises(ValidationError, "%c is used before it is defined in the block graph", NODE_LOC,
           validate_kernel_graph, graph)


def test_duplicate_definition():
    y = var("y", (4, 6))
    graph = KernelGraph("g", [X, W], [node("matmul", [X, W], [y]), node("exp", [y], [y])], [y])
    raises(ValidationError, "%y is defined twice in the kernel graph g", NODE_LOC, validate_kernel_graph, graph)


def test_duplicate_definition_of_an_input():
    graph = KernelGraph("g", [X, W], [node("exp", [X], [var("W", X.shape)])], [X])
    raises(ValidationError, "%W is defined twice", NODE_LOC, validate_kernel_graph, graph)


def test_use_with_another_type_than_defined():
    y = var("y", (4, 6))
    graph = KernelGraph("g", [X, W], [node("exp", [var("X", (4, 9))], [y])], [y])
    raises(ShapeError, r"%X is used as f32\[4, 9\] but defined as f32\[4, 8\]", NODE_LOC, validate_kernel_graph, graph)


def test_undefined_graph_output():
    graph = KernelGraph("g", [X], [], [var("nowhere", (1,))])
    raises(ValidationError, "%nowhere is used before it is defined", None, validate_kernel_graph, graph)


def test_kernel_graph_without_outputs():
    raises(ValidationError, "kernel graph g has no outputs", None, validate_kernel_graph, KernelGraph("g", [X], [], []))


# ---------------------------------------------------------------------------------------------
# levels

def test_split_in_a_block_graph():
    a, b, c = var("a", (4, 3)), var("b", (4, 1)), var("c", (4, 2))
    graph = linear(extra_nodes=[Node("split", [a], [b, c], (("sizes", (1, 2)), ("dim", 1)), loc=NODE_LOC)], output=b)
    raises(ValidationError, r"split cannot appear in a block graph \(allowed at the kernel level\)", NODE_LOC,
           validate_kernel_graph, graph)


def test_accumulator_in_a_kernel_graph():
    y = var("y", (4, 8))
    raises(ValidationError, r"accum cannot appear in a kernel graph \(allowed at the block level\)", NODE_LOC,
           validate_kernel_graph, KernelGraph("g", [X], [node("accum", [X], [y])], [y]))


def _fused_graph(thread_nodes) -> KernelGraph:
    a, f = var("a", (4, 3)), var("f", (4, 3))
    t_in = var("t", (4, 3))
    nodes = thread_nodes(t_in)
    body = ThreadGraph([t_in], nodes, [nodes[-1].outputs[-1]])
    return linear(extra_nodes=[Node("fused", [a], [f], (), body, NODE_LOC)], output=f)


def test_fused_thread_graph_is_valid():
    validate_kernel_graph(_fused_graph(lambda t: [node("exp", [t], [var("e", (4, 3))])]))


def test_matmul_in_a_thread_graph():
    thread_loc = SourceLoc(__file__, 7)
    w = var("w", (3, 3))
    graph = _fused_graph(lambda t: [Node("matmul", [t, w], [var("e", (4, 3))], (), loc=thread_loc)])
    raises(ValidationError, "matmul is not element-wise and cannot run in a thread graph", thread_loc,
           validate_kernel_graph, graph)


def test_thread_graph_input_types():
    body = ThreadGraph([var("t", (4, 2))], [], [var("t", (4, 2))])
    a, f = var("a", (4, 3)), var("f", (4, 2))
    graph = linear(extra_nodes=[Node("fused", [a], [f], (), body, NODE_LOC)], output=f)
    raises(ShapeError, r"thread graph input %t is f32\[4, 2\] but is given f32\[4, 3\]", NODE_LOC,
           validate_kernel_graph, graph)


def test_graph_defined_op_needs_its_body():
    y = var("y", (4, 8))
    raises(ValidationError, "custom needs a block graph as its body", NODE_LOC, validate_kernel_graph,
           KernelGraph("g", [X], [Node("custom", [X], [y], loc=NODE_LOC)], [y]))


def test_plain_op_cannot_have_a_body():
    y = var("y", (4, 8))
    body = ThreadGraph([var("t", (4, 8))], [], [var("t", (4, 8))])
    raises(ValidationError, "exp is not graph-defined and cannot have a body", NODE_LOC, validate_kernel_graph,
           KernelGraph("g", [X], [Node("exp", [X], [y], (), body, NODE_LOC)], [y]))


def test_unknown_operator():
    y = var("y", (4, 8))
    err = raises(UnsupportedError, "unknown operator 'frobnicate'", NODE_LOC, validate_kernel_graph,
                 KernelGraph("g", [X], [Node("frobnicate", [X], [y], loc=NODE_LOC)], [y]))
    assert "known operators: " in err.hint


# ---------------------------------------------------------------------------------------------
# attributes

@pytest.mark.parametrize("op, attrs, match", [
    ("sum", (("dim", 1.5), ("keepdim", False)), r"attribute dim=1.5 of sum must be of kind int"),
    ("sum", (("dim", True), ("keepdim", False)), r"attribute dim=True of sum must be of kind int"),
    ("sum", (("dim", 1), ("keepdim", 1)), r"attribute keepdim=1 of sum must be of kind bool"),
    ("mul_scalar", (("value", "many"),), r"attribute value='many' of mul_scalar must be of kind float"),
    ("reshape", (("shape", (2.5, 4)),), r"attribute shape=\(2.5, 4\) of reshape must be of kind ints"),
    ("reshape", (("shape", 8),), r"attribute shape=8 of reshape must be of kind ints"),
    ("sum", (("keepdim", False),), r"sum needs the attribute 'dim'"),
    ("exp", (("dim", 0),), r"exp has no attribute 'dim'"),
    ("sum", (("keepdim", False), ("dim", 1)), r"attributes .* are not in normal form"),
    ("sum", (("dim", 1),), r"attributes \{'dim': 1\} are not in normal form \(expected \{'dim': 1, 'keepdim': False\}\)"),
])
def test_wrong_attributes(op, attrs, match):
    y = var("y", (4,))
    graph = KernelGraph("g", [X], [Node(op, [X], [y], attrs, loc=NODE_LOC)], [y])
    raises(ValidationError, match, NODE_LOC, validate_kernel_graph, graph)


def test_unknown_dtype_attribute():
    y = var("y", (4, 8))
    graph = KernelGraph("g", [X], [Node("cast", [X], [y], (("dtype", "f64"),), loc=NODE_LOC)], [y])
    raises(DTypeError, "unsupported dtype 'f64'", NODE_LOC, validate_kernel_graph, graph)


def test_error_renders_the_source_line():
    y = var("y", (4, 6))
    loc = SourceLoc(__file__, 3, 0, 4)
    err = raises(ShapeError, "declared", loc, validate_kernel_graph,
                 KernelGraph("g", [X, W], [node("matmul", [X, W], [var("y", (4, 5))], loc=loc)], [y]))
    text = str(err)
    assert text.splitlines()[0].startswith(f"{__file__}:3:1: matmul")
    assert "^^^^" in text


@pytest.mark.parametrize("file", ["model\x00.py", "model\udfa9.py"])
def test_an_error_at_a_location_no_file_can_have_still_prints(file):
    # a location read from a user's JSON (mdsl.ir.serialize) may name anything; its message must still print
    loc = SourceLoc(file, 3, 0, 4)
    err = raises(ShapeError, "declared", loc, validate_kernel_graph,
                 KernelGraph("g", [X, W], [node("matmul", [X, W], [var("y", (4, 5))], loc=loc)], [var("y", (4, 5))]))
    assert "matmul" in str(err) and loc.render() == ""

"""Strided views (mdsl.lowering.views) computed on the CPU by the PTX backend's kernels (the simulator of
test_ptx_simulated.py), against the reference: every fast-path program, kernel-level ops and the row kernels
with each input read in place as the middle part of a wider tensor and each output written in place as the
middle piece of one, along the last dim or the first (tests/backend/cuda/views.py); heads reshaped from a
split's parts. The simulator fails any access that is not aligned to its width."""
from __future__ import annotations

import pytest

from mdsl.ir import f16, f32
from mdsl.lowering.index import contiguous_strides
from mdsl.lowering.options import CudaOptions
from mdsl.lowering.program import lower_graph
from mdsl.lowering.views import strided_views
from tests.backend.cuda.builder import Graph
from tests.backend.cuda.fast_paths import OPTION_SETS, fast_path_graphs
from tests.backend.cuda.views import read_in_place, write_in_place
from tests.backend.ptx.test_ptx_simulated import _row_kernels, check_simulated
from tests.backend.ptx.test_ptx_simulated import pytestmark   # noqa: F401 (the simulator's host requirement)


def _viewed(graph) -> list:
    """The program's original inputs that its kernels read in place, and outputs they write in place."""
    views = strided_views(lower_graph(graph))
    return sorted(name for name in views if not name.endswith(("_before", "_after")))


def _written(graph) -> list:
    """The outputs of `graph` whose kernels can write them through strides (not a kernel-level matmul's)."""
    producers = lower_graph(graph).producers()
    return sorted(v.name for v in graph.outputs if producers[v.name].op != "matmul")


def _rows_aligned(v) -> bool:
    """Whether the rows of `v`, split from a wider tensor along its first dim, lie 16 bytes apart."""
    return all(n == 1 or (s * v.dtype.itemsize) % 16 == 0
               for n, s in zip(v.shape[:-1], contiguous_strides(tuple(v.shape))[:-1]))


_TENSOR_CORES = ("ragged_matmuls_f16", "ragged_attention_f16", "prologue_matmuls_f16", "flash_decoding_f16")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dim", (-1, 0))
@pytest.mark.parametrize("name", sorted(fast_path_graphs()))
def test_fast_path_programs_read_in_place(name, dim):
    """Every input is read in place where its rows keep 16-byte alignment (split along the last dim: all of them),
    but a kernel-level matmul's operands (copied out by the split, and read by the matmul's kernel)."""
    graph = read_in_place(fast_path_graphs()[name], dim)
    viewed = _viewed(graph)
    if name.startswith("kernel_matmuls"):
        assert viewed == []
        if dim == 0:
            return   # nothing read in place along either dim: dim -1's simulation runs the copies and products
    elif dim == -1:
        assert viewed == sorted(v.name for v in fast_path_graphs()[name].inputs)
    else:
        assert viewed == sorted(v.name for v in fast_path_graphs()[name].inputs if _rows_aligned(v))
    check_simulated(graph, seed=21, options=CudaOptions())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("options", ("no-mma", "synchronous-loads", "threads-64"))
@pytest.mark.parametrize("name", _TENSOR_CORES)
def test_tensor_core_programs_read_in_place_under_option_sets(name, options):
    check_simulated(read_in_place(fast_path_graphs()[name]), seed=22, options=OPTION_SETS[options])


def _kernel_level(dtype):
    """Kernel-level element-wise ops, reductions, norms (over a middle dim and the last), a concat, a split and a
    transpose of one input, and a matmul of another."""
    g = Graph(f"kernel_level_{dtype.name}")
    a = g.input("a", (2, 40, 24), dtype)
    for op, dim in (("sum", 0), ("mean", 2), ("max", 1)):
        g.op(op, a, dim=dim, keepdim=dim == 1)
    g.op("rms_norm", a, dim=1, eps=1e-6)
    g.op("rms_norm", a, dim=2, eps=1e-6)
    g.op("concat", a, a, dim=2)
    g.ops("split", a, sizes=(10, 30), dim=1)
    g.op("mul", g.op("exp", a), g.op("add", a, g.input("bias", (24,), dtype)))
    g.op("transpose", a, perm=(0, 2, 1))
    g.op("matmul", g.input("b", (2, 40, 24), dtype), g.input("c", (24, 72), dtype))
    return g.build()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dim", (-1, 0, 1))
def test_kernel_level_ops_read_in_place(dim):
    """Element-wise ops, reductions, norms, a concat, a split and a transpose read their views; a kernel-level
    matmul's operands are copied out by the split first (its parts that are not views) and read contiguous."""
    graph = read_in_place(_kernel_level(f16), dim)
    assert _viewed(graph) == ["a", "bias"]
    check_simulated(graph, seed=23)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape, dtypes", (((8, 8190), (f16, f32)), ((512, 128), (f16,)), ((40, 33), (f16, f32))),
                         ids=str)
def test_row_kernels_read_in_place(shape, dtypes):
    """(Many short rows in f16 only: in f32 they take the simulator half a minute; f32 rows are read in place
    in the other shapes.)"""
    for dtype in dtypes:
        graph = read_in_place(_row_kernels(shape, dtype))
        assert _viewed(graph) == ["x"]
        check_simulated(graph, seed=24)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dim", (-1, 0))
@pytest.mark.parametrize("name", sorted(fast_path_graphs()))
def test_fast_path_programs_write_in_place(name, dim):
    """Every output is written in place as the middle piece of a concat, where its rows keep 16-byte alignment
    (along the last dim: all of them), but a kernel-level matmul's (copied in by the concat)."""
    program = fast_path_graphs()[name]
    graph = write_in_place(program, dim)
    written = _viewed(graph)
    if dim == -1:
        assert written == _written(program)
    else:
        aligned = {v.name for v in program.outputs if _rows_aligned(v)}
        assert written == [v for v in _written(program) if v in aligned]
    check_simulated(graph, seed=25, options=CudaOptions())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", _TENSOR_CORES + ("narrow_rows_f16", "split_combine_f16", "row_attention_bf16"))
def test_fast_path_programs_read_and_write_in_place(name):
    graph = write_in_place(read_in_place(fast_path_graphs()[name]))
    check_simulated(graph, seed=26, options=CudaOptions())


@pytest.mark.timeout(240)
def test_kernel_level_ops_write_in_place():
    """Element-wise ops, reductions and norms write their results in place; the concat copies those of a
    concat, a transpose and a matmul, and the split's parts, read in place from the split's operand."""
    graph = write_in_place(_kernel_level(f16))
    assert _viewed(graph) == ["add", "exp", "max", "mean", "mul", "rms_norm", "rms_norm_1", "split", "split_1", "sum"]
    check_simulated(graph, seed=27)


def _heads(rows: int):
    """q, k, v = split(x @ w) at `rows` tokens, q's and k's heads made by a reshape (and at one token a transpose
    that moves the token dim: an alias), each normalised, v negated: every part read in place."""
    g = Graph(f"heads_{rows}")
    x = g.input("x", (rows, 64), f16)
    q, k, v = g.ops("split", g.op("matmul", x, g.input("w", (64, 192), f16)), sizes=(128, 32, 32), dim=1)
    qh = g.op("reshape", q, shape=(rows, 4, 32))
    if rows == 1:
        qh = g.op("transpose", qh, perm=(1, 0, 2))
    kh = g.op("reshape", k, shape=(rows, 1, 32))
    return g.build([g.op("rms_norm", qh, dim=-1, eps=1e-6), g.op("rms_norm", kh, dim=-1, eps=1e-6), g.op("neg", v)])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rows", (1, 5))
def test_heads_of_a_part_read_in_place_through_reshapes(rows):
    graph = _heads(rows)
    views = strided_views(lower_graph(graph))
    assert {"split", "split_1", "split_2", "reshape", "reshape_1"} <= set(views)
    check_simulated(graph, seed=28)

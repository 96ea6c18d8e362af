"""Every kernel-level operator, alone (the backend's standard kernels), on the GPU against the
reference, in f16, bf16 and f32, on regular and ragged shapes; the reductions and norms also on few long
rows and many short ones (the `rows-` cases)."""
from __future__ import annotations

import pytest

from mdsl.ir.dtypes import bf16, f16, f32, i32
from mdsl.ir.graph import KernelGraph, Node
from mdsl.ir.ops import KERNEL, OPS, get_op
from mdsl.ir.types import TensorType, Var
from tests.gpu.harness import check_graph

FLOATS = (f16, bf16, f32)
UNARY = ("exp", "silu", "gelu", "relu", "sigmoid", "square", "neg")
POSITIVE_UNARY = ("sqrt", "rsqrt", "reciprocal")   # their operand is drawn positive, away from 0
SHAPES = ((64, 256), (7, 33))                     # regular, and ragged (no dim a multiple of 8)

# (case id, op, operand shapes, attributes, operands drawn positive); dtypes come from the parameter
CASES = [
    *[(f"{op}-{'x'.join(map(str, s))}", op, (s,), {}, ()) for op in UNARY for s in SHAPES],
    *[(f"{op}-{'x'.join(map(str, s))}", op, (s,), {}, (0,)) for op in POSITIVE_UNARY for s in SHAPES],
    ("mul_scalar", "mul_scalar", ((64, 256),), {"value": 1.5}, ()),
    ("add_scalar-ragged", "add_scalar", ((7, 33),), {"value": -0.75}, ()),
    ("pow_scalar-fractional", "pow_scalar", ((64, 256),), {"exponent": 2.5}, (0,)),
    ("pow_scalar-integral", "pow_scalar", ((7, 33),), {"exponent": 3.0}, ()),
    ("clamp", "clamp", ((64, 256),), {"min": -0.5, "max": 0.7}, ()),
    *[(f"cast-to-{d.name}", "cast", ((64, 256),), {"dtype": d}, ()) for d in (f16, bf16, f32, i32)],
    ("cast-to-f32-ragged", "cast", ((7, 33),), {"dtype": f32}, ()),
    *[(f"{op}-{name}", op, shapes, {}, (1,) if op == "div" else ())
      for op in ("add", "sub", "mul", "div")
      for name, shapes in (("same", ((64, 256), (64, 256))), ("row", ((64, 256), (256,))),
                           ("outer", ((64, 1), (1, 256))), ("ragged-3d", ((4, 1, 33), (7, 1))))],
    ("matmul", "matmul", ((64, 128), (128, 96)), {}, ()),
    ("matmul-ragged", "matmul", ((7, 33), (33, 5)), {}, ()),
    ("matmul-gemv", "matmul", ((1, 256), (256, 512)), {}, ()),
    ("matmul-batched", "matmul", ((4, 32, 64), (4, 64, 48)), {}, ()),
    ("matmul-broadcast-weight", "matmul", ((4, 32, 64), (64, 48)), {}, ()),
    ("matmul-broadcast-batch", "matmul", ((3, 1, 16, 32), (2, 32, 8)), {}, ()),
    *[(f"{op}-dim{d}{'-keep' if keep else ''}", op, ((16, 64, 32),), {"dim": d, "keepdim": keep}, ())
      for op in ("sum", "mean", "max") for d, keep in ((0, False), (1, True), (2, False), (-1, True))],
    *[(f"{op}-ragged", op, ((7, 33),), {"dim": -1}, ()) for op in ("sum", "mean", "max")],
    ("rms_norm", "rms_norm", ((16, 256),), {"dim": -1, "eps": 1e-6}, ()),
    ("rms_norm-ragged", "rms_norm", ((7, 33),), {"dim": -1, "eps": 1e-5}, ()),
    ("rms_norm-middle-dim", "rms_norm", ((8, 16, 32),), {"dim": 1}, ()),
    # few long rows (a block of lanes a row, 16-byte loads, the row kept in registers; a length not a multiple
    # of 8; a row too long for the registers) and many short ones (a warp a row): mdsl.lowering.grid.row_loop
    *[(f"rows-{op}-{name}", op, (shape,), {"dim": -1, **({"eps": 1e-6} if op == "rms_norm" else {})}, ())
      for op in ("rms_norm", "sum", "mean", "max")
      for name, shape in (("8x8192", (8, 8192)), ("8x8190", (8, 8190)), ("1x32768", (1, 32768)),
                          ("4096x128", (4096, 128)), ("1024x8192", (1024, 8192)))],
    ("concat-dim1", "concat", ((16, 32), (16, 48)), {"dim": 1}, ()),
    ("concat-dim0-three", "concat", ((8, 32), (24, 32), (1, 32)), {"dim": 0}, ()),
    ("split-dim1", "split", ((16, 96),), {"sizes": (32, 64), "dim": 1}, ()),
    ("split-ragged", "split", ((10, 8),), {"sizes": (3, 7), "dim": 0}, ()),
    ("reshape", "reshape", ((16, 96),), {"shape": (96, 16)}, ()),
    ("reshape-flatten", "reshape", ((4, 24, 16),), {"shape": (1536,)}, ()),
    ("transpose-2d", "transpose", ((16, 96),), {"perm": (1, 0)}, ()),
    ("transpose-ragged", "transpose", ((7, 33),), {"perm": (1, 0)}, ()),
    ("transpose-3d", "transpose", ((4, 8, 16),), {"perm": (2, 0, 1)}, ()),
]


def single_op_graph(case_id: str, op: str, shapes: tuple, attrs: dict, dtype) -> KernelGraph:
    opdef = get_op(op)
    inputs = [Var(f"x{k}", TensorType(s, dtype)) for k, s in enumerate(shapes)]
    pairs = opdef.normalize_attrs(attrs)
    types = opdef.infer_types(tuple(v.type for v in inputs), pairs)
    outputs = [Var(f"y{k}", t) for k, t in enumerate(types)]
    return KernelGraph(case_id.replace("-", "_"), inputs, [Node(op, inputs, outputs, pairs)], outputs)


def test_every_kernel_level_operator_has_a_case():
    """Runs without a GPU too: an operator added to the registry needs a GPU case here."""
    kernel_ops = {name for name, op in OPS.items() if KERNEL in op.levels and not op.is_graph_defined}
    assert kernel_ops - {c[1] for c in CASES} == set()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("case_id, op, shapes, attrs, positive", CASES, ids=[c[0] for c in CASES])
def test_operator_on_the_gpu(case_id, op, shapes, attrs, positive, dtype):
    graph = single_op_graph(case_id, op, shapes, attrs, dtype)
    check_graph(graph, f"op:{case_id}:{dtype.name}", positive=positive,
                what=f"operator {op} ({case_id}) on {dtype.long_name} inputs")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_views_of_computed_values(dtype):
    """reshape is an alias, not a kernel: of a value a kernel writes, returned twice, and of an input."""
    x = Var("x", TensorType((16, 96), dtype))
    e = Var("e", TensorType((16, 96), dtype))
    r = Var("r", TensorType((96, 16), dtype))
    v = Var("v", TensorType((1536,), dtype))
    nodes = [Node("exp", [x], [e]), Node("reshape", [e], [r], get_op("reshape").normalize_attrs({"shape": (96, 16)})),
             Node("reshape", [x], [v], get_op("reshape").normalize_attrs({"shape": (1536,)}))]
    graph = KernelGraph("views", [x], nodes, [r, v, r])
    check_graph(graph, f"views:{dtype.name}")


@pytest.mark.gpu
def test_integer_inputs():
    x = Var("x", TensorType((64, 33), i32))
    y = Var("y", TensorType((64, 33), f32))
    graph = KernelGraph("cast_i32", [x], [Node("cast", [x], [y], get_op("cast").normalize_attrs({"dtype": f32}))],
                        [y])
    check_graph(graph, "cast-from-i32")

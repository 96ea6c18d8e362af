"""Row-resident chains (mdsl.lowering.rows, written by mdsl.backend.cuda.rows), without a GPU: which loop nodes
stay in the warps' registers, what leaves the chain and why, the tiles that then need no shared memory, and
the CUDA code: the switch, loop-invariant nodes hoisted before the loop. What both backends' code does
(one barrier an iteration, ldmatrix, no spills): tests/backend/test_rows.py. The GPU tests run these
programs against the reference under every option set (tests/gpu/test_gpu_fast_paths.py)."""
from __future__ import annotations

from mdsl.backend.cuda import emit_cuda
from mdsl.ir.dtypes import f16
from mdsl.lowering.block import lower
from mdsl.lowering.options import CudaOptions
from mdsl.lowering.rows import VECTOR
from tests.backend.cuda.builder import Graph
from tests.backend.cuda.fast_paths import fast_path_graphs
from tests.backend.cuda.programs import guided_plan


def _custom(graph, k: int = 0):
    node = graph.custom_nodes()[k]
    return node.body, tuple(v.type for v in node.inputs)


def _ops(bg, indices) -> list:
    return sorted(bg.nodes[i].op for i in indices)


def test_online_softmax_stays_in_registers_from_scores_to_accumulators():
    bg, types = _custom(fast_path_graphs()["flash_decoding_f16"])
    lowered = lower(bg, types)
    rows = lowered.rows
    assert rows is not None
    assert _ops(bg, rows.nodes) == sorted(["matmul", "max", "sub", "exp", "matmul", "sum", "accum_rescale",
                                           "accum_rescale", "accum_max"])
    assert (rows.geometry.batch, rows.geometry.rows, rows.geometry.warps) == (1, 64, 4)
    by_op = {bg.nodes[i].op: bg.nodes[i].output.name for i in rows.nodes}
    assert rows.values[by_op["max"]] is VECTOR and rows.values[by_op["exp"]] == 32
    # the chain's values get no tile; the accumulators keep theirs (read after the loop), not their scratch
    placed = {t.name for t in lowered.memory.lifetimes}
    assert not placed & {by_op["matmul"], by_op["max"], by_op["exp"], by_op["sum"]}
    assert by_op["accum_max"] in placed
    assert not lowered.register_accumulated   # the tile lowering's mma registers are not used beside it


def test_a_value_read_outside_the_chain_takes_its_producers_out():
    g = Graph("leaving")
    q, k, v = g.input("q", (64, 32), f16), g.input("k", (32, 128), f16), g.input("v", (128, 32), f16)
    b = g.block(grid=(1,), forloop=4, threads=128)
    s = b.op("matmul", b.input(q), b.input(k, fmap=1))
    m = b.op("max", s, dim=1, keepdim=True)
    e = b.op("exp", b.op("sub", s, m))
    b.output(b.op("accum_rescale", b.op("matmul", e, b.input(v, fmap=0)), m))
    b.output(b.op("accum", b.op("sum", e, dim=0, keepdim=True)))   # a column sum reads exp: exp keeps its tile
    b.done()
    bg, types = _custom(g.build())
    lowered = lower(bg, types)
    rows = lowered.rows
    assert rows is not None
    # exp keeps its tile, so does what it reads (sub, then the scores and their max): only the
    # product with V, whose A operand is now exp's tile, and its accumulator stay in registers
    assert _ops(bg, rows.nodes) == ["accum_rescale", "matmul"]
    exp_name = next(n.output.name for n in bg.nodes if n.op == "exp")
    matmul = next(bg.nodes[i] for i in rows.nodes if bg.nodes[i].op == "matmul")
    assert matmul.inputs[0].name == exp_name
    assert exp_name in {t.name for t in lowered.memory.lifetimes}


def test_gemv_like_loops_keep_the_tile_lowering():
    """A 2-row matmul would leave 3 of 4 warps idle with rows per warp; nothing is reduced along its rows."""
    bg, types = _custom(guided_plan("rms_norm_linear.rms_norm_linear"))
    assert lower(bg, types).rows is None


def test_switched_off_by_the_option_and_the_environment(monkeypatch):
    graph = fast_path_graphs()["flash_decoding_f16"]
    bg, types = _custom(graph)
    assert lower(bg, types, CudaOptions(rows=False)).rows is None
    assert lower(bg, types, CudaOptions(mma=False)).rows is None   # the chain is made of mma fragments
    monkeypatch.setenv("MDSL_CUDA_ROWS", "0")
    assert emit_cuda(graph).source == emit_cuda(graph, options=CudaOptions(rows=False)).source
    assert "mdsl::RowMma<" not in emit_cuda(graph).source and "mdsl::RowMma<" in emit_cuda(graph, options=CudaOptions()).source
    assert CudaOptions.from_env({"MDSL_CUDA_ROWS": "off"}) == CudaOptions(rows=False)


def test_loop_invariant_nodes_run_once_before_the_loop(monkeypatch):
    graph = fast_path_graphs()["flash_decoding_f16"]
    program = emit_cuda(graph)
    kernel = program.source[program.source.index(program.launches[0].name + "("):]
    scale = kernel.index("mul_scalar(")
    assert scale < kernel.index("for (int it = 0;")   # the queries' scaling: hoisted
    assert CudaOptions.from_env({"MDSL_CUDA_HOIST": "0"}) == CudaOptions(hoist=False)
    monkeypatch.setenv("MDSL_CUDA_HOIST", "0")
    kernel = emit_cuda(graph).source
    kernel = kernel[kernel.index(program.launches[0].name + "("):]
    assert kernel.index("mul_scalar(") > kernel.index("for (int it = 0;")



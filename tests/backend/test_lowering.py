"""The lowering both backends emit (mdsl.lowering), without a GPU: its index arithmetic, every kind of step
written by each backend, and the steps of a kernel of each loop kind (its rule tables against the
backends': tests/ir/test_rule_tables.py)."""
from __future__ import annotations

import importlib

import pytest

from mdsl.lowering import kernel as steps
from mdsl.lowering.index import broadcast_strides, merged_dims
from mdsl.lowering.kernel import lower_custom
from mdsl.lowering.options import CudaOptions
from tests.backend.cuda.fast_paths import fast_path_graphs
from tests.backend.ptx.plans import rms_norm_linear_skinny, split_attention

BACKENDS = ("cuda", "ptx")


def _backend(name: str, module: str):
    return importlib.import_module(f"mdsl.backend.{name}.{module}")


def test_merged_dims_drop_unit_dims_merge_contiguous_ones_and_broadcast():
    # a contiguous operand of the loop's shape: one dim of stride 1
    assert merged_dims((4, 8, 16), (4, 8, 16), (128, 16, 1)) == [(512, 1)]
    # broadcast along the rows (an operand of one row) and along a leading dim it lacks
    assert merged_dims((4, 8, 16), (1, 16), (16, 1)) == [(32, 0), (16, 1)]
    assert merged_dims((4, 8, 16), (8, 16), (16, 1)) == [(4, 0), (128, 1)]
    # a padded tile: rows of 16 elements, 20 apart; unit dims vanish
    assert merged_dims((1, 8, 16), (1, 8, 16), (160, 20, 1)) == [(8, 20), (16, 1)]
    assert merged_dims((), (), ()) == []


def test_broadcast_strides_are_nonzero_along_the_broadcast_dims_only():
    assert broadcast_strides((4, 8, 16), (8, 16)) == (128, 0, 0)
    assert broadcast_strides((4, 8, 16), (4, 1, 16)) == (0, 16, 0)
    assert broadcast_strides((4, 8), (4, 8)) == (0, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_backend_writes_every_kind_of_step(backend):
    assert set(_backend(backend, "block").STEPS) == set(steps.step_types()) | {steps.Stage}


def _kernel(graph, options: CudaOptions, k: int = 0):
    return lower_custom(graph.custom_nodes()[k], options, "sm_90a")


def _kinds(kernel) -> list:
    return [type(step).__name__ for step in kernel.steps]


def test_a_pipelined_tile_loop_s_steps():
    kernel = _kernel(fast_path_graphs()["ragged_matmuls_f16"], CudaOptions())
    assert _kinds(kernel)[:6] == ["InitAccumulators", "RegisterAccumulators", "LoadOnce", "Prologue", "Loop", "Finish"]
    assert _kinds(kernel)[-1] == "StoreOutputs" and not kernel.waits_first
    loop = next(step for step in kernel.steps if isinstance(step, steps.Loop))
    assert loop.depth == 3 and loop.rings == tuple(inp.var.name for inp in loop.inputs) and loop.stages[-1].barrier
    (prologue,) = [step for step in kernel.steps if isinstance(step, steps.Prologue)]
    assert prologue.ahead == loop.depth - 1
    finish = next(step for step in kernel.steps if isinstance(step, steps.Finish))
    assert finish.pipelined and finish.register_stores and finish.barrier
    synchronous = _kernel(fast_path_graphs()["ragged_matmuls_f16"], CudaOptions(stages=1))
    assert "Prologue" not in _kinds(synchronous)
    assert next(step for step in synchronous.steps if isinstance(step, steps.Loop)).rings == ()


def test_a_row_resident_chain_s_last_stages_need_no_barrier_and_its_copies_go_late():
    kernel = _kernel(split_attention(qknorm=False), CudaOptions())
    loop = next(step for step in kernel.steps if isinstance(step, steps.Loop))
    assert loop.issue_late and not loop.stages[-1].barrier
    assert any(how == steps.ROWS for stage in loop.stages for _, how in stage.nodes)
    init = next(step for step in kernel.steps if isinstance(step, steps.InitAccumulators))
    assert any(in_rows for _, in_rows in init.nodes)


def test_a_streamed_and_a_skinny_kernel_s_steps():
    combine = _kernel(split_attention(qknorm=False), CudaOptions(), k=1)
    assert _kinds(combine)[:2] == ["StreamedLoop", "Barrier"] and _kinds(combine)[-1] == "StoreOutputs"
    skinny = _kernel(rms_norm_linear_skinny(2, 4, columns=128, blocks=2, k=512), CudaOptions(skinny=True, overlap=True))
    assert _kinds(skinny)[0] == "SkinnyLoop" and _kinds(skinny)[-1] == "StoreOutputs"
    assert skinny.overlap and not skinny.waits_first   # the skinny loop prefetches before it waits
    tile = _kernel(rms_norm_linear_skinny(2, 4, columns=128, blocks=2, k=512), CudaOptions(overlap=True))
    assert tile.overlap and tile.waits_first


def _row_chain(columns: int) -> str:
    """One block: a softmax over x @ w's 8 columns scales x (1 x `columns`), a mean of the result scales it
    again: the row-resident chain holds each 1 x `columns` value on one warp."""
    return f"""kernel chain(%x: f16[1, {columns}], %w: f16[{columns}, 8], %g: f16[1, {columns}]) {{
  %out: f16[1, {columns}] = custom(%x, %w, %g) block(grid=[1, 1, 1], threads=128, forloop=1) {{
    in %x: f16[1, {columns}] imap=[-, -, -] fmap=-
    in %w: f16[{columns}, 8] imap=[-, -, -] fmap=-
    in %g: f16[1, {columns}] imap=[-, -, -] fmap=-
    %matmul: f16[1, 8] = matmul(%x, %w)
    %max: f16[1, 1] = max(%matmul) {{dim=1, keepdim=true}}
    %sub: f16[1, 8] = sub(%matmul, %max)
    %exp: f16[1, 8] = exp(%sub)
    %sum: f16[1, 1] = sum(%exp) {{dim=1, keepdim=true}}
    %div: f16[1, 8] = div(%exp, %sum)
    %top: f16[1, 1] = max(%div) {{dim=1, keepdim=true}}
    %mul: f16[1, {columns}] = mul(%x, %top)
    %sub_1: f16[1, {columns}] = sub(%mul, %g)
    %mul_1: f16[1, {columns}] = mul(%x, %sub_1)
    %mean: f16[1, 1] = mean(%mul_1) {{dim=1, keepdim=true}}
    %mul_2: f16[1, {columns}] = mul(%sub_1, %mean)
    %accum: f16[1, {columns}] = accum(%mul_2)
    out %accum omap=[-, -, -]
  }}
  return %out
}}
"""


@pytest.mark.parametrize("columns, in_rows", [(64, True), (8192, False)])
def test_a_row_chain_stays_in_registers_only_where_its_live_values_fit_them(columns, in_rows):
    # at 8192 columns a warp's row is 4,096 floats a thread: held in registers, ptxas spent minutes on it and
    # spilled it to a 49 KB stack frame; on tiles it is an ordinary block
    from mdsl.ir.text import parse_graph

    kernel = _kernel(parse_graph(_row_chain(columns)), CudaOptions())
    rows = {how == steps.ROWS for step in kernel.steps if isinstance(step, steps.Loop)
            for stage in step.stages for _, how in stage.nodes}
    assert (True in rows) is in_rows

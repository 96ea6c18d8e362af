"""A tile loop's serial work (mdsl.search.chain) and how the GPU-aware estimate prices it
(mdsl.search.cost.gpu_estimate), on synthetic kernels written in the textual IR."""
from __future__ import annotations

import attrs
import pytest

from mdsl.ir.text import parse_graph
from mdsl.search.chain import tile_loop
from mdsl.search.cost import H200, gpu_estimate

#: x[rows, 8192] @ w[8192, 2048] as one custom kernel: 2048 / cols blocks, each its `cols` columns, a loop
#: over K of `loop` iterations; `pre`: element-wise ops on X's tile before the matmul
GEMV = """kernel gemv(%x: f16[{rows}, 8192], %w: f16[8192, 2048]) {{
  %y: f16[{rows}, 2048] = custom(%x, %w) block(grid=[{blocks}, 1, 1], threads={threads}, forloop={loop}) {{
    in %x: f16[{rows}, {k}] imap=[-, -, -] fmap=1
    in %w: f16[{k}, {cols}] imap=[1, -, -] fmap=0
{pre}    %matmul: f16[{rows}, {cols}] = matmul(%a{depth}, %w)
    %accum: f16[{rows}, {cols}] = accum(%matmul)
    out %accum omap=[1, -, -]
  }}
  return %y
}}"""


def gemv(loop: int = 64, cols: int = 32, rows: int = 4, threads: int = 128, pre: int = 0):
    k = 8192 // loop
    ops = "".join(f"    %a{i + 1}: f16[{rows}, {k}] = neg(%a{i})\n" for i in range(pre))
    text = GEMV.format(rows=rows, blocks=2048 // cols, threads=threads, loop=loop, k=k, cols=cols, pre=ops, depth=pre)
    return parse_graph(text.replace("%a0", "%x"))


def seconds(graph, device=H200, stages: int = 3) -> float:
    return gpu_estimate(graph, device, stages=stages).seconds


# ---- what a block does in series ------------------------------------------------------------------

def test_a_gemv_iteration_is_one_stage_of_mma_steps_after_the_copies():
    loop = tile_loop(gemv().nodes[0], 3)
    assert loop.depth == 3
    # the barrier after the copies, then the matmul with its accumulator in the mma's registers
    assert loop.iteration.stages == 2 and loop.iteration.elements == 0
    # C's 4 tiles of 16 x 8 over 4 warps: one each, 128 / 16 steps along K
    assert loop.iteration.mma_steps == 8 and loop.iteration.flops == 2 * 4 * 32 * 128
    assert loop.once.stages == 1


def test_each_element_wise_op_on_the_tile_is_a_stage_of_its_elements():
    plain, one, two = (tile_loop(gemv(pre=n).nodes[0], 3).iteration for n in (0, 1, 2))
    assert (one.stages, two.stages) == (plain.stages + 1, plain.stages + 2)
    assert (one.elements, two.elements) == (4 * 128 // 128, 2 * 4 * 128 // 128)   # its tile over 128 threads
    assert one.mma_steps == plain.mma_steps


def test_a_warp_walks_its_tiles_of_c_one_after_another_along_k():
    wide = tile_loop(gemv(cols=128).nodes[0], 3).iteration          # 16 tiles: 4 a warp
    more_warps = tile_loop(gemv(cols=128, threads=256).nodes[0], 3).iteration   # 2 a warp
    longer_k = tile_loop(gemv(cols=128, loop=32).nodes[0], 3).iteration      # 256-long K tiles
    assert wide.mma_steps == 4 * 128 // 16
    assert more_warps.mma_steps == wide.mma_steps // 2 and longer_k.mma_steps == 2 * wide.mma_steps


def test_row_resident_matmuls_give_each_warp_whole_row_tiles():
    loop = tile_loop(gemv(rows=64, cols=64, loop=128).nodes[0], 3)   # 64 rows: a row tile a warp
    assert loop.iteration.mma_steps == 64 // 16      # its column groups are independent chains
    assert loop.iteration.stages == 1                # in registers: no barrier closes the stage


def test_a_loop_of_one_iteration_has_no_pipeline():
    assert tile_loop(gemv(loop=1, cols=8).nodes[0], 3).depth == 1
    assert tile_loop(gemv().nodes[0], 1).depth == 1


# ---- how the estimate prices it -------------------------------------------------------------------

def test_twice_the_iterations_on_the_same_grid_cost_more():
    """The same bytes and flops in twice the iterations of half the tile: twice the serial chain."""
    assert seconds(gemv(loop=128)) > seconds(gemv(loop=64)) > seconds(gemv(loop=32))


def test_an_element_wise_stage_in_the_loop_costs_its_barrier_and_elements():
    assert seconds(gemv()) < seconds(gemv(pre=1)) < seconds(gemv(pre=2))
    no_barrier = attrs.evolve(H200, step_s=0.0, thread_element_s=0.0)
    assert seconds(gemv(pre=2), no_barrier) == pytest.approx(seconds(gemv(), no_barrier))


def test_a_pipelined_loop_overlaps_copies_and_work_and_an_unpipelined_one_adds_them():
    graph = gemv()
    fit = gpu_estimate(graph).kernels[0]
    unpipelined = gpu_estimate(graph, stages=1).kernels[0]
    assert unpipelined.seconds > fit.seconds
    # the loads alone and the work alone bound the pipelined loop; the unpipelined one takes their sum
    body = fit.seconds - H200.launch_s
    assert max(fit.memory_s, fit.compute_s + fit.latency_s) <= body + 1e-12
    assert unpipelined.seconds - H200.launch_s == pytest.approx(
        unpipelined.memory_s + unpipelined.compute_s + unpipelined.latency_s)


def test_an_unpipelined_iteration_waits_a_memory_round_trip_for_its_copies():
    graph = gemv(loop=128)
    slower_memory = attrs.evolve(H200, memory_latency_s=2 * H200.memory_latency_s)
    unpipelined = gpu_estimate(graph, stages=1).kernels[0]
    assert tile_loop(graph.nodes[0], 1).waits and not tile_loop(graph.nodes[0], 3).waits
    waited = seconds(graph, slower_memory, stages=1) - seconds(graph, stages=1)
    # 128 iterations, one block an SM: each iteration waits one round trip more
    assert unpipelined.per_sm == 1 and waited == pytest.approx(128 * H200.memory_latency_s)
    assert seconds(graph, slower_memory) == pytest.approx(seconds(graph))   # the pipeline covers it


def test_a_copy_bound_loop_follows_what_an_sm_draws_and_a_chain_bound_one_does_not():
    copy_bound = gemv(loop=8, cols=32)      # 1024-long K tiles: 66 KB of copies an iteration
    chain_bound = gemv(loop=256, cols=32)   # 32-long K tiles: the barriers dominate
    faster_draw = attrs.evolve(H200, tile_sm_bytes_per_s=2 * H200.tile_sm_bytes_per_s,
                               dram_bytes_per_s=2 * H200.dram_bytes_per_s)
    assert seconds(copy_bound, faster_draw) < 0.8 * seconds(copy_bound)
    # (but for the outputs' stores, after the loop)
    assert seconds(chain_bound, faster_draw) == pytest.approx(seconds(chain_bound), rel=1e-3)


def test_blocks_beyond_what_the_sms_hold_run_in_rounds():
    many = gemv(cols=8, loop=4)   # 256 blocks of 145 KB (2048-long K tiles, 3 stages): one an SM at a time
    fit = gpu_estimate(many).kernels[0]
    assert (fit.per_sm, fit.resident, fit.rounds) == (2, 1, 2)
    roomy = gpu_estimate(many, attrs.evolve(H200, smem_per_sm=2 * H200.smem_per_sm)).kernels[0]
    assert roomy.resident > 1 and roomy.rounds == 1 and roomy.seconds < fit.seconds


def test_spilled_registers_slow_the_element_work():
    graph = gemv(pre=2)
    fitted, spilled = (gpu_estimate(graph, registers=lambda index, r=r: r).kernels[0] for r in (128, 400))
    assert spilled.compute_s > fitted.compute_s

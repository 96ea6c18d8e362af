"""Operator scheduling: stages by depth, a barrier after each, the block's timeline in epochs."""
from __future__ import annotations

import numpy as np
import pytest

from mdsl.backend.reference import run_block_graph
from mdsl.ir.text import parse_graph
from mdsl.passes.fusion import fuse_block_graph
from mdsl.passes.schedule import LOAD_EPOCH, schedule_block_graph
from tests.backend.cuda.programs import block_graphs, example_kernels
from tests.passes.test_fusion import ATTENTION


def _ops(bg, stages) -> list:
    return [[bg.nodes[i].op for i in s.nodes] for s in stages]


@pytest.mark.timeout(30)
def test_stages_of_online_softmax():
    bg = fuse_block_graph(parse_graph(ATTENTION).nodes[0].body)
    schedule = schedule_block_graph(bg)
    assert _ops(bg, schedule.loop) == [["matmul"], ["mul_scalar"], ["max"], ["fused"], ["matmul", "accum_sum_rescale"],
                                       ["accum_rescale"]]
    assert _ops(bg, schedule.post) == [["reciprocal"], ["fused"]]
    assert [s.epoch for s in schedule.loop] == [1, 2, 3, 4, 5, 6]
    assert (schedule.loop_end_epoch, schedule.finalize_epoch) == (6, 7)
    assert [s.epoch for s in schedule.post] == [8, 9]
    assert schedule.store_epoch == 10
    assert schedule.barriers_per_iteration == 7
    assert "7 barrier(s) per iteration" in str(schedule)


@pytest.mark.timeout(30)
def test_independent_nodes_share_a_stage():
    bg = example_kernels()["gated_mlp.gated_mlp_fused"].nodes[0].body
    schedule = schedule_block_graph(fuse_block_graph(bg))
    assert _ops(bg, schedule.loop) == [["matmul", "matmul"], ["accum", "accum"]]
    assert [len(s.nodes) for s in schedule.post] == [1]  # silu * up, fused


def _depth(bg, i, phase: set, memo: dict) -> int:
    if i not in memo:
        producers = {v.name: k for k, n in enumerate(bg.nodes) if k in phase for v in n.outputs}
        memo[i] = 1 + max((_depth(bg, producers[v.name], phase, memo) for v in bg.nodes[i].inputs
                           if v.name in producers), default=-1)
    return memo[i]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(block_graphs()))
def test_schedule_is_a_minimal_topological_order(name):
    bg = fuse_block_graph(block_graphs()[name])
    schedule = schedule_block_graph(bg)
    assert sorted(schedule.order) == list(range(len(bg.nodes)))
    post_vars = bg.post_loop_vars()
    stage_of = {i: k for k, s in enumerate((*schedule.loop, *schedule.post)) for i in s.nodes}
    for i in schedule.order:  # a node runs in a later stage than every producer of its phase
        node = bg.nodes[i]
        for k, producer in enumerate(bg.nodes):
            if any(v in producer.outputs for v in node.inputs) and not producer.opdef.is_accumulator:
                assert stage_of[k] < stage_of[i], (producer.op, node.op)
    in_loop = {i for s in schedule.loop for i in s.nodes}
    assert all(bg.nodes[i].opdef.is_accumulator or not any(v.name in post_vars for v in bg.nodes[i].outputs)
               for i in in_loop)
    # as few stages (barriers) as the longest dependence chain allows
    memo: dict = {}
    assert len(schedule.loop) == 1 + max(_depth(bg, i, in_loop, memo) for i in in_loop)
    assert schedule.loop[0].epoch == LOAD_EPOCH + 1
    if schedule.post:
        assert schedule.post[0].epoch == schedule.finalize_epoch + 1


@pytest.mark.timeout(30)
def test_the_scheduled_order_computes_the_same(monkeypatch, capsys):
    bg = parse_graph(ATTENTION).nodes[0].body
    monkeypatch.setenv("MDSL_DUMP_IR", "1")
    schedule = schedule_block_graph(bg)
    dumped = capsys.readouterr().err
    assert dumped.startswith("// ----- IR after schedule -----\nblock(")
    reordered = bg.__class__(bg.grid, bg.threads, bg.forloop, bg.inputs, [bg.nodes[i] for i in schedule.order],
                             bg.outputs)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s) for s in [(2, 16, 64), (2, 64, 128), (2, 128, 64)]]
    for x, y in zip(run_block_graph(bg, inputs), run_block_graph(reordered, inputs)):
        np.testing.assert_allclose(x, y, rtol=1e-12)


@pytest.mark.timeout(30)
def test_matmul_accumulators_are_the_sums_of_products_read_by_nothing_else():
    from mdsl.passes.schedule import matmul_accumulators

    bg = fuse_block_graph(example_kernels()["gated_mlp.gated_mlp_fused"].nodes[0].body)
    pairs = matmul_accumulators(bg)
    assert [(bg.nodes[i].op, bg.nodes[j].op) for i, j in pairs.items()] == [("accum", "matmul")] * 2
    assert all(bg.nodes[i].inputs[0] == bg.nodes[j].output for i, j in pairs.items())
    # online softmax: the rescaled sum of the product with V can live in registers; the rescaled
    # row sum (accum_sum_rescale) reduces over the product's rows and cannot
    attention = fuse_block_graph(parse_graph(ATTENTION).nodes[0].body)
    pairs = matmul_accumulators(attention)
    assert [(attention.nodes[i].op, attention.nodes[j].op) for i, j in pairs.items()] == [("accum_rescale", "matmul")]


@pytest.mark.timeout(30)
def test_a_fused_rescale_waits_for_its_maximum():
    """A rescaled sum folded by its matmul runs in the matmul's stage only when its maximum is ready
    before that stage; the schedule's `fused` lists the ones that are."""
    from mdsl.passes.schedule import matmul_accumulators

    bg = fuse_block_graph(parse_graph(ATTENTION).nodes[0].body)
    (acc, matmul), = matmul_accumulators(bg).items()
    plain, fused = schedule_block_graph(bg), schedule_block_graph(bg, fused_accumulators=(acc,))
    assert fused.fused == (acc,) and plain.fused == ()
    stage = {i: s.epoch for s in fused.loop for i in s.nodes}
    assert stage[acc] == stage[matmul]
    assert all(stage[k] < stage[matmul] for k, n in enumerate(bg.nodes) if n.outputs[0] in bg.nodes[acc].inputs[1:])


@pytest.mark.timeout(30)
def test_a_product_read_twice_is_not_summed_in_place():
    from mdsl.passes.schedule import matmul_accumulators

    text = """kernel k(%x: f16[16, 64], %w: f16[64, 32]) {
  %s: f16[16, 32], %t: f16[16, 32] = custom(%x, %w) block(grid=[1, 1, 1], threads=128, forloop=2) {
    in %xt: f16[16, 32] imap=[-, -, -] fmap=1
    in %wt: f16[32, 32] imap=[-, -, -] fmap=0
    %p: f16[16, 32] = matmul(%xt, %wt)
    %s: f16[16, 32] = accum(%p)
    %e: f16[16, 32] = exp(%p)
    %t: f16[16, 32] = accum(%e)
    out %s omap=[-, -, -]
    out %t omap=[-, -, -]
  }
  return %s, %t
}"""
    assert matmul_accumulators(parse_graph(text).nodes[0].body) == {}


@pytest.mark.timeout(30)
def test_fused_accumulators_run_in_their_matmuls_stage():
    bg = fuse_block_graph(example_kernels()["gated_mlp.gated_mlp_fused"].nodes[0].body)
    from mdsl.passes.schedule import matmul_accumulators

    fused = schedule_block_graph(bg, fused_accumulators=tuple(matmul_accumulators(bg)))
    assert _ops(bg, fused.loop) == [["matmul", "accum", "matmul", "accum"]]
    assert fused.fused == tuple(matmul_accumulators(bg))
    assert fused.barriers_per_iteration == schedule_block_graph(bg).barriers_per_iteration - 1
    assert sorted(fused.order) == list(range(len(bg.nodes)))


@pytest.mark.timeout(30)
def test_a_rescale_whose_maximum_comes_later_is_not_fused():
    from mdsl.passes.schedule import matmul_accumulators

    text = """kernel k(%q: f16[16, 64], %k: f16[64, 16], %x: f16[16, 32]) {
  %acc: f16[16, 16] = custom(%q, %k, %x) block(grid=[1, 1, 1], threads=128, forloop=2) {
    in %qt: f16[16, 32] imap=[-, -, -] fmap=1
    in %kt: f16[32, 16] imap=[-, -, -] fmap=0
    in %xt: f16[16, 16] imap=[-, -, -] fmap=1
    %p: f16[16, 16] = matmul(%qt, %kt)
    %e: f16[16, 16] = exp(%xt)
    %e2: f16[16, 16] = exp(%e)
    %m: f16[16, 1] = max(%e2) {dim=1, keepdim=true}
    %acc: f16[16, 16] = accum_rescale(%p, %m)
    out %acc omap=[-, -, -]
  }
  return %acc
}"""
    bg = parse_graph(text).nodes[0].body
    (acc, matmul), = matmul_accumulators(bg).items()
    schedule = schedule_block_graph(bg, fused_accumulators=(acc,))
    assert schedule.fused == ()
    stage = {i: s.epoch for s in schedule.loop for i in s.nodes}
    assert stage[acc] > stage[3] > stage[matmul]   # after the maximum, as without fusion


QKNORM_BLOCK = """kernel qk(%q: f16[64, 32], %k: f16[32, 128], %v: f16[128, 32]) {
  %acc: f16[64, 32] = custom(%q, %k, %v) block(grid=[1], threads=128, forloop=4) {
    in %bq: f16[64, 32] imap=[] fmap=-
    in %bk: f16[32, 32] imap=[] fmap=1
    in %bv: f16[32, 32] imap=[] fmap=0
    %nq: f16[64, 32] = rms_norm(%bq) {dim=1, eps=1e-06}
    %sq: f16[64, 32] = mul_scalar(%nq) {value=0.5}
    %nk: f16[32, 32] = rms_norm(%bk) {dim=0, eps=1e-06}
    %s: f16[64, 32] = matmul(%sq, %nk)
    %p: f16[64, 32] = matmul(%s, %bv)
    %a: f16[64, 32] = accum(%p)
    out %a omap=[]
  }
  return %acc
}
"""


@pytest.mark.timeout(30)
def test_loop_invariant_nodes_are_hoisted_before_the_loop():
    bg = parse_graph(QKNORM_BLOCK).nodes[0].body
    schedule = schedule_block_graph(bg, hoist=True)
    assert _ops(bg, schedule.pre) == [["rms_norm"], ["mul_scalar"]]     # the queries' norm and scale: once
    assert _ops(bg, schedule.loop) == [["rms_norm"], ["matmul"], ["matmul"], ["accum"]]   # the keys' norm: per tile
    assert [s.epoch for s in schedule.pre] == [1, 2]
    assert schedule.loop[0].epoch == 3 and schedule.barriers_per_iteration == 5
    assert {bg.nodes[i].op for i in schedule.hoisted} == {"rms_norm", "mul_scalar"}
    # off by default, and nothing to hoist out of a loop of one iteration
    assert schedule_block_graph(bg).pre == ()
    single = parse_graph(QKNORM_BLOCK.replace("forloop=4", "forloop=1").replace("f16[32, 32] imap=[] fmap=1",
                         "f16[32, 128] imap=[] fmap=1").replace("f16[32, 32] imap=[] fmap=0", "f16[128, 32] imap=[] fmap=0")
                         .replace("%nk: f16[32, 32]", "%nk: f16[32, 128]").replace("%s: f16[64, 32]", "%s: f16[64, 128]"))
    assert schedule_block_graph(single.nodes[0].body, hoist=True).pre == ()


@pytest.mark.timeout(30)
def test_hoisted_values_stay_live_for_the_whole_loop():
    from mdsl.passes.layout import select_layout
    from mdsl.passes.memory import plan_memory
    from tests.strategies import block_input_tensors

    bg = parse_graph(QKNORM_BLOCK).nodes[0].body
    schedule = schedule_block_graph(bg, hoist=True)
    memory = plan_memory(bg, schedule, select_layout(bg, tuple(block_input_tensors(bg))))
    live = {t.name: (t.start, t.end) for t in memory.lifetimes}
    assert live["sq"] == (2, schedule.loop_end_epoch)
    assert live["nq"][1] == schedule.loop_end_epoch   # (conservatively) until the loop ends

"""Memory planning: lifetimes from the schedule, reuse of dead tiles, alignment, the limit."""
from __future__ import annotations

import pytest

from mdsl.ir.text import parse_graph
from mdsl.passes.fusion import fuse_block_graph
from mdsl.passes.layout import select_layout
from mdsl.passes.memory import ALIGN, Lifetime, SharedMemoryError, _place, plan_memory
from mdsl.passes.schedule import schedule_block_graph
from tests.backend.cuda.programs import block_graphs
from tests.passes.test_fusion import ATTENTION
from tests.strategies import block_input_tensors


def _lower(bg, limit=None):
    bg = fuse_block_graph(bg)
    schedule = schedule_block_graph(bg)
    layout = select_layout(bg, tuple(block_input_tensors(bg)))
    memory = plan_memory(bg, schedule, layout, **({} if limit is None else {"limit": limit}))
    return bg, schedule, layout, memory


@pytest.mark.timeout(30)
def test_lifetimes_of_online_softmax():
    bg, schedule, layout, memory = _lower(parse_graph(ATTENTION).nodes[0].body)
    live = {t.name: (t.start, t.end) for t in memory.lifetimes}
    loop_end, store = schedule.loop_end_epoch, schedule.store_epoch
    assert live["bq"] == (0, loop_end)          # no fmap: loaded once, read by every iteration
    assert live["bk"] == (0, 1)                 # this iteration's tile, read by the first stage
    assert live["s"] == (1, 2)
    assert live["num"] == (0, 9)                # an accumulator: from before the loop to its last use
    assert live["num#scratch"] == (0, loop_end)
    assert live["y"][1] == store                # outputs until the store
    assert "d" not in live                      # fused away: a register


@pytest.mark.timeout(30)
def test_tiles_a_backend_keeps_in_registers_get_no_memory():
    bg = fuse_block_graph(parse_graph(ATTENTION).nodes[0].body)
    schedule = schedule_block_graph(bg)
    layout = select_layout(bg, tuple(block_input_tensors(bg)))
    whole = plan_memory(bg, schedule, layout)
    lean = plan_memory(bg, schedule, layout, in_registers=frozenset({"s", "num#scratch"}))
    assert {t.name for t in whole.lifetimes} - {t.name for t in lean.lifetimes} == {"s", "num#scratch"}
    assert lean.total < whole.total


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(block_graphs()))
def test_tiles_live_at_once_never_share_bytes(name):
    bg, schedule, layout, memory = _lower(block_graphs()[name])
    tiles = memory.lifetimes
    for t in tiles:
        assert memory.offsets[t.name] % ALIGN == 0 and t.size % ALIGN == 0
        assert t.size >= layout.tiles[t.name].nbytes
        assert memory.offsets[t.name] + t.size <= memory.total
    for a in tiles:
        for b in tiles:
            if a.name < b.name and a.overlaps(b):
                lo = max(memory.offsets[a.name], memory.offsets[b.name])
                hi = min(memory.offsets[a.name] + a.size, memory.offsets[b.name] + b.size)
                assert lo >= hi, f"{a.name} and {b.name} are live together and share bytes"
    assert memory.total <= sum(t.size for t in tiles)


@pytest.mark.timeout(30)
def test_dead_tiles_are_reused():
    bg, schedule, layout, memory = _lower(block_graphs()["gqa.gqa_flash/0"])
    assert memory.total < sum(t.size for t in memory.lifetimes)
    offsets = memory.offsets
    assert offsets["exp"] == offsets["k"]        # exp is written after the last read of k's tile


def test_placement_strategies():
    # best-fit takes the tightest gap, first-fit the lowest
    tiles = [Lifetime("a", 32, 0, 0), Lifetime("b", 16, 0, 2), Lifetime("c", 64, 0, 2), Lifetime("d", 16, 1, 2)]
    assert _place(tiles, best_fit=False)["d"] == 0
    order = [Lifetime("big", 64, 0, 2), Lifetime("gap1", 48, 0, 0), Lifetime("sep", 16, 0, 2),
             Lifetime("gap2", 16, 0, 0), Lifetime("end", 16, 0, 2), Lifetime("new", 16, 1, 2)]
    first, best = _place(order, best_fit=False), _place(order, best_fit=True)
    assert first["new"] == first["gap1"] and best["new"] == best["gap2"]


@pytest.mark.timeout(30)
def test_over_the_limit_names_the_largest_tiles(monkeypatch, capsys):
    bg = parse_graph(ATTENTION).nodes[0].body
    with pytest.raises(SharedMemoryError) as e:
        _lower(bg, limit=4096)
    message = str(e.value)
    assert "over the 4 KB limit" in message and "%num f32[1, 16, 64], rows padded to 68 (4.2 KB)" in message
    assert "hint:" in message
    monkeypatch.setenv("MDSL_DUMP_IR", "1")
    _lower(bg)
    assert "// ----- memory plan -----\nmemory: " in capsys.readouterr().err


UNUSED = """\
kernel unused(%x: f32[8, 64], %y: f32[8, 64]) {
  %s: f32[8, 1] = custom(%x, %y) block(grid=[1, 1, 1], threads=32, forloop=2) {
    in %bx: f32[8, 32] imap=[-, -, -] fmap=1
    in %by: f32[8, 64] imap=[-, -, -] fmap=-
    %s: f32[8, 1] = accum_sum(%bx)
    out %s omap=[-, -, -]
  }
  return %s
}"""


@pytest.mark.timeout(30)
def test_unused_inputs_get_no_tile():
    _, _, _, memory = _lower(parse_graph(UNUSED).nodes[0].body)
    assert set(memory.offsets) == {"bx", "s"}


@pytest.mark.timeout(30)
def test_a_pipeline_keeps_copies_of_the_per_iteration_tiles_for_the_whole_loop():
    bg = fuse_block_graph(parse_graph(ATTENTION).nodes[0].body)
    schedule = schedule_block_graph(bg)
    layout = select_layout(bg, tuple(block_input_tensors(bg)))
    one, three = plan_memory(bg, schedule, layout), plan_memory(bg, schedule, layout, stages=3)
    assert (one.stages, one.slot_bytes) == (1, {})
    per_iteration = {i.var.name for i in bg.inputs if i.fmap is not None}
    assert three.stages == 3 and set(three.slot_bytes) == per_iteration
    size = {t.name: t.size for t in one.lifetimes}
    for t in three.lifetimes:
        if t.name in per_iteration:
            assert t.size == 3 * size[t.name] == 3 * three.slot_bytes[t.name]
            assert (t.start, t.end) == (0, schedule.loop_end_epoch)   # copies in flight while any stage runs
    for a in three.lifetimes:   # still no two live tiles share bytes
        for b in three.lifetimes:
            if a.name < b.name and a.overlaps(b):
                lo, hi = three.offsets[a.name], three.offsets[b.name]
                assert lo + a.size <= hi or hi + b.size <= lo
    assert "inputs 3 deep" in str(three)

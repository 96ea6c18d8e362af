"""The cost model: roofline floors and the terms that rank candidates."""
import attrs
import pytest

from mdsl.search.cost import H200, estimate, roofline_floor
from tests.examples_util import load_example

example = load_example


def test_floor_of_rms_norm_linear_counts_each_input_and_output_once():
    g = example("rms_norm_linear").make_rms_norm_linear(1).graph
    floor = roofline_floor(g)
    assert floor.bytes == 2 * (2 * 4096 + 4096 * 6144 + 2 * 6144)
    assert floor.flops == 2 * 2 * 4096 * 6144
    assert floor.bound == "memory"
    assert floor.seconds == pytest.approx(floor.bytes / H200.dram_bytes_per_s)


def test_floor_of_gqa_is_compute_bound_at_batch_one():
    g = example("gqa").make_gqa(1).graph
    floor = roofline_floor(g)
    assert floor.flops == 2 * (2 * 2 * 256 * 64 * 4096)   # Q·K and P·V
    assert floor.bound == "compute"


def test_fused_plan_moves_fewer_bytes_and_launches_less_than_the_kernel_per_op_graph():
    module = example("rms_norm_linear")
    unfused, fused = estimate(module.make_rms_norm_linear(1).graph), estimate(module.rms_norm_linear_fused.graph)
    assert fused.launches == 1 < unfused.launches
    assert fused.dram_bytes < unfused.dram_bytes


def test_costs_order_by_estimated_time_first():
    module = example("rms_norm_linear")
    a, b = estimate(module.make_rms_norm_linear(1).graph), estimate(module.rms_norm_linear_fused.graph)
    assert (a < b) == (a.seconds < b.seconds)


def test_too_few_blocks_cost_more_than_a_full_grid():
    module = example("rms_norm_linear")
    narrow = estimate(module.make_rms_norm_linear_fused(grid_x=12, forloop=64).graph)
    wide = estimate(module.make_rms_norm_linear_fused(grid_x=96, forloop=64).graph)
    assert wide.seconds < narrow.seconds


def test_a_slower_device_gives_a_larger_estimate():
    g = example("gated_mlp").gated_mlp.graph
    slow = attrs.evolve(H200, dram_bytes_per_s=H200.dram_bytes_per_s / 2)
    assert estimate(g, slow).seconds > estimate(g, H200).seconds

"""The cost model: roofline floors and the terms that rank candidates."""
import math

import attrs
import pytest

from mdsl.search.cost import H200, estimate, gpu_estimate, kernel_costs, roofline_floor, same_cost
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


def test_the_estimate_sums_its_kernels_times_correctly_rounded():
    """The same on every Python: the builtin sum() of floats rounds one way on 3.11 and another on 3.12."""
    cost = estimate(example("gqa").make_gqa(1).graph)
    assert len(cost.kernels) > 2 and cost.seconds == math.fsum(k.seconds for k in cost.kernels)


def test_a_stored_cost_agrees_with_the_estimate_to_rounding_and_no_further():
    cost = estimate(example("gated_mlp").gated_mlp.graph)
    last_bit = attrs.evolve(cost, seconds=math.nextafter(cost.seconds, 0.0))
    assert same_cost(cost, cost) and same_cost(last_bit, cost)
    kernel = attrs.evolve(cost.kernels[0], seconds=math.nextafter(cost.kernels[0].seconds, 1.0))
    assert same_cost(attrs.evolve(cost, kernels=(kernel, *cost.kernels[1:])), cost)
    assert not same_cost(attrs.evolve(cost, seconds=cost.seconds * 0.999), cost)
    assert not same_cost(attrs.evolve(cost, dram_bytes=cost.dram_bytes - 1), cost)
    assert not same_cost(attrs.evolve(cost, launches=True), attrs.evolve(cost, launches=1))
    assert not same_cost(attrs.evolve(cost, kernels=cost.kernels[1:]), cost)
    assert not same_cost(attrs.evolve(cost, seconds=math.nan), cost)


def _split_k_plan():
    """`(x * 2.0) @ w` at x f16[4, 8192], w [8192, 2048], and the split-K plan the search finds first: a split
    kernel of 64 x 2 blocks writing f32 partials, then a combine of 64 blocks."""
    import mdsl
    from mdsl import Tensor, f16
    from mdsl.search import guided

    @mdsl.kernel(name="scaled_matmul")
    def scaled_matmul(x: Tensor[4, 8192, f16], w: Tensor[8192, 2048, f16]):
        return (x * 2.0) @ w

    original = scaled_matmul.graph
    plan = next(guided.generate(original))
    assert [n.body.grid for n in plan.custom_nodes()] == [(64, 2, 1), (64, 1, 1)]
    return original, plan


def test_a_split_and_its_combine_in_one_launch_cost_one_launch():
    """The combine runs in its split's launch (mdsl.lowering.onelaunch): its kernel's time without a launch,
    its reads of the partials the split just wrote waiting an L2 hit rather than a DRAM round trip."""
    _, plan = _split_k_plan()
    cost = estimate(plan)
    split, combine = cost.kernels
    apart = kernel_costs(attrs.evolve(plan, nodes=plan.nodes[:1], outputs=plan.nodes[0].outputs))[0]
    assert cost.launches == 1 and len(cost.kernels) == 2 and split == apart
    alone = attrs.evolve(plan, inputs=plan.nodes[0].outputs, nodes=plan.nodes[1:])
    from_l2 = attrs.evolve(H200, memory_latency_s=H200.l2_latency_s)
    assert combine.seconds == pytest.approx(estimate(alone, from_l2).seconds - H200.launch_s)
    assert combine.seconds < estimate(alone).seconds - H200.launch_s
    fits = gpu_estimate(plan).kernels
    assert fits[1].seconds == pytest.approx(gpu_estimate(alone).seconds - H200.launch_s)


def test_the_split_k_plan_is_estimated_faster_than_the_program_as_written():
    """Charged one launch, the skinny matmul's split-K plan beats the two element-wise and matmul kernels of
    the program (which two launches of the plan did not)."""
    original, plan = _split_k_plan()
    assert estimate(plan).seconds < estimate(original).seconds < estimate(plan).seconds + H200.launch_s


def test_an_element_wise_epilogue_fused_into_a_split_k_product_is_estimated_faster_than_apart():
    """exp(x @ w) at x f16[16, 8192], w [8192, 1024]: the split-K plan's combine applies the exp, reading the
    partials from L2, and the plan beats the library product and the exp's own kernel; the exp adds nothing
    to the product's plan."""
    import mdsl
    from mdsl import Tensor, f16
    from mdsl.search import guided

    @mdsl.kernel(name="exp_matmul")
    def exp_matmul(x: Tensor[16, 8192, f16], w: Tensor[8192, 1024, f16]):
        return mdsl.exp(x @ w)

    @mdsl.kernel(name="plain_matmul")
    def plain_matmul(x: Tensor[16, 8192, f16], w: Tensor[8192, 1024, f16]):
        return x @ w

    fused, plain = next(guided.generate(exp_matmul.graph)), next(guided.generate(plain_matmul.graph))
    assert len(fused.custom_nodes()) == 2 and estimate(fused).launches == 1
    assert estimate(fused).seconds < estimate(exp_matmul.graph).seconds
    assert estimate(fused).seconds == pytest.approx(estimate(plain).seconds, rel=1e-3)


def _linear(extra: str):
    """x @ transpose(w) (w: [out, in], a linear layer's weight as a traced torch graph has it), and `extra`."""
    from mdsl.ir.dtypes import bf16
    from tests.backend.cuda.builder import Graph

    g = Graph("linear")
    x, w = g.input("x", (4, 512), bf16), g.input("w", (256, 512), bf16)
    wt = g.op("transpose", w, perm=(1, 0))
    outputs = [g.op("matmul", x, wt)]
    if extra == "a kernel reads it":
        outputs.append(g.op("exp", wt))
    elif extra == "returned":
        outputs.append(wt)
    elif extra == "left operand":
        outputs.append(g.op("matmul", wt, g.input("y", (256, 8), bf16)))
    return g.build(outputs)


def test_a_transpose_that_cublas_reads_in_place_costs_nothing():
    alone = estimate(_linear("alone"))
    assert alone.launches == 1 and [k.name for k in alone.kernels] == ["matmul"]
    assert alone.dram_bytes == (4 * 512 + 256 * 512 + 4 * 256) * 2   # the weight read once, by the GEMM
    assert gpu_estimate(_linear("alone")).seconds == pytest.approx(alone.seconds)


@pytest.mark.parametrize("extra", ["a kernel reads it", "returned", "left operand"])
def test_a_transpose_read_otherwise_is_a_kernel(extra):
    cost = estimate(_linear(extra))
    assert "transpose" in [k.name for k in cost.kernels]
    assert cost.launches == {"a kernel reads it": 3, "returned": 2, "left operand": 3}[extra]

"""The structure-guided generator: labels, lifting rules, and the fused kernels it must find."""
import time

import numpy as np
import pytest

from mdsl.backend.reference import run_kernel_graph
from mdsl.search.config import SearchConfig
from mdsl.search.dims import Labels
from mdsl.search.guided import CannotLift, Choice, generate, lift
from mdsl.search.stats import SearchStats
from tests.examples_util import load_example

def example(name):
    return load_example(name)


def ops_of(block_graph):
    return [n.op for n in block_graph.nodes]


def bodies(graph):
    return [n.body for n in graph.nodes if n.body is not None]


# ---- labels ----------------------------------------------------------------------------------

def test_matmul_ties_k_and_keeps_rows_and_columns():
    g = example("rms_norm_linear").make_rms_norm_linear(1, k=64, n=96).graph
    labels = Labels(g)
    x, w = g.inputs
    out = g.outputs[0]
    assert labels.label(x.name, 1) == labels.label(w.name, 0)            # k
    assert labels.label(x.name, 0) == labels.label(out.name, 0)          # rows
    assert labels.label(w.name, 1) == labels.label(out.name, 1)          # columns
    contracted = labels.contracted_labels()
    assert contracted[labels.label(x.name, 1)] == {"rms_norm", "matmul"}
    assert labels.label(out.name, 1) not in contracted


def test_softmax_contracts_the_kv_length_three_ways():
    g = example("gqa").make_gqa(1, kv_len=64, queries=8, head_dim=16).graph
    labels = Labels(g)
    q, k, v = g.inputs
    kv = labels.label(k.name, 2)
    assert kv == labels.label(v.name, 1)
    assert labels.contracted_labels()[kv] == {"max", "sum", "matmul"}
    assert labels.label(q.name, 2) == labels.label(k.name, 1)  # the head dim, contracted by Q·K


# ---- every candidate computes the program ------------------------------------------------------

SMALL = {
    "gqa": lambda m: m.make_gqa(1, kv_len=128, queries=16, head_dim=16),
    "qknorm": lambda m: m.make_qknorm(1, kv_len=128, queries=16, head_dim=16),
    "rms_norm_linear": lambda m: m.make_rms_norm_linear(1, k=128, n=192),
    "gated_mlp": lambda m: m.make_gated_mlp(8, 128, 128),
    "ntrans": lambda m: m.make_ntrans(1, 256),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_candidate_equals_the_program_in_float64(name):
    graph = SMALL[name](example(name)).graph
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(v.shape) for v in graph.inputs]
    want = run_kernel_graph(graph, inputs)
    candidates = list(generate(graph, SearchConfig(min_blocks=1), limit=40))
    assert candidates
    for c in candidates:
        got = run_kernel_graph(c, inputs)
        for a, b in zip(got, want):
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-10, str(c)


# ---- the best candidates at the benchmark shapes are the fused kernels ------------------------

def best(graph):
    return next(generate(graph, SearchConfig()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bs", [1, 8])
def test_rms_norm_linear_fuses_the_norm_into_the_matmul_loop(bs):
    plan = best(example("rms_norm_linear").make_rms_norm_linear(bs).graph)
    (body,) = bodies(plan)
    assert body.forloop > 1
    assert {"matmul", "accum", "accum_rms", "div"} <= set(ops_of(body))
    assert "rms_norm" not in ops_of(body)


@pytest.mark.timeout(60)
def test_gated_mlp_puts_both_matmuls_and_the_gate_in_one_block_graph():
    plan = best(example("gated_mlp").gated_mlp.graph)
    assert any(ops_of(b).count("matmul") == 2 and {"silu", "mul"} <= set(ops_of(b)) for b in bodies(plan))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module,factory", [("gqa", "make_gqa"), ("qknorm", "make_qknorm")])
@pytest.mark.parametrize("bs", [1, 8])
def test_attention_becomes_split_kv_flash_decoding(module, factory, bs):
    plan = best(getattr(example(module), factory)(bs).graph)
    first, combine = bodies(plan)
    assert {"accum_rescale", "accum_max", "exp", "max"} <= set(ops_of(first))
    assert "accum_rescale" in ops_of(combine) and combine.forloop > 1
    if module == "qknorm":
        assert ops_of(first).count("rms_norm") == 2  # both norms inside the attention kernel


@pytest.mark.timeout(60)
def test_lora_is_one_block_graph():
    plan = best(example("lora").lora.graph)
    (body,) = bodies(plan)
    assert ops_of(body).count("matmul") == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bs", [1, 8])
def test_ntrans_is_one_kernel(bs):
    plan = best(example("ntrans").make_ntrans(bs).graph)
    assert len(plan.nodes) == 1 and plan.nodes[0].op == "custom"


# ---- refusals -----------------------------------------------------------------------------------

def test_a_grid_over_a_contracted_label_is_not_offered():
    g = example("rms_norm_linear").make_rms_norm_linear(1, k=64, n=96).graph
    labels = Labels(g)
    k = labels.label(g.inputs[0].name, 1)
    from mdsl.search.guided import choices

    assert all(label != k for c in choices(g, labels, SearchConfig()) for label, _ in c.grid)


def test_an_accumulator_without_a_split_rule_refuses_a_split_loop():
    # accum_sum's partial results have no combine rule (no lifting emits one): a split is refused
    from mdsl.ir.dtypes import f32
    from mdsl.ir.graph import Node
    from mdsl.ir.types import TensorType, Var
    from mdsl.search.guided import Accumulation, _split_rule

    x = Var("x", TensorType((4, 8), f32))
    node = Node("accum_sum", [x], [Var("s", x.type.with_shape((4, 1)))])
    with pytest.raises(CannotLift, match="cannot be combined"):
        _split_rule(Accumulation(node))


def test_an_output_that_skips_the_loop_contraction_is_refused():
    import mdsl
    from mdsl import Tensor, f32

    @mdsl.kernel
    def two(x: Tensor[4, 16, f32], w: Tensor[16, 8, f32]):
        return x @ w, mdsl.exp(x)

    g = two.graph
    labels = Labels(g)
    k = labels.label(g.inputs[0].name, 1)
    with pytest.raises(CannotLift):
        lift(g, Choice((), k, forloop=2), labels)


def test_negative_dims_in_a_hand_built_graph_lift_like_positive_ones():
    from mdsl.ir import KernelGraph, Node, f32, get_op
    from mdsl.ir.graph import make_var

    x, w = make_var("x", (4, 32), f32), make_var("w", (32, 16), f32)
    n, y = make_var("n", (4, 32), f32), make_var("y", (4, 16), f32)
    graph = KernelGraph("neg_dims", [x, w], [
        Node("rms_norm", [x], [n], get_op("rms_norm").normalize_attrs({"dim": -1})),
        Node("matmul", [n, w], [y])], [y])
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(v.shape) for v in graph.inputs]
    want = run_kernel_graph(graph, inputs)[0]
    candidates = list(generate(graph, SearchConfig(min_blocks=1), limit=10))
    assert any(c.nodes[0].op == "custom" and "accum_rms" in ops_of(c.nodes[0].body) for c in candidates)
    for c in candidates:
        assert np.allclose(run_kernel_graph(c, inputs)[0], want, rtol=1e-10)


def test_a_weighted_norm_before_the_matmul_still_fuses_into_the_loop():
    # (x / rms(x)) * g @ W = ((x * g) @ W) / rms(x): the division waits through the multiply
    import mdsl
    from mdsl import Tensor, f32

    @mdsl.kernel
    def weighted(x: Tensor[4, 64, f32], g: Tensor[64, f32], w: Tensor[64, 32, f32]):
        return (mdsl.rms_norm(x) * g * 0.5) @ w

    graph = weighted.graph
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(v.shape) for v in graph.inputs]
    want = run_kernel_graph(graph, inputs)[0]
    candidates = list(generate(graph, SearchConfig(min_blocks=1), limit=20))
    assert any(c.nodes[0].body is not None and c.nodes[0].body.forloop > 1
               and "accum_rms" in ops_of(c.nodes[0].body) for c in candidates)
    for c in candidates:
        assert np.allclose(run_kernel_graph(c, inputs)[0], want, rtol=1e-10)


def _linear_transposed(rows: int, k: int, n: int):
    """(rms_norm(x) * g) @ transpose(W), W stored [out, in] as torch.nn.Linear stores it."""
    import mdsl
    from mdsl import Tensor, f16

    @mdsl.kernel
    def linear_t(x: Tensor[rows, k, f16], g: Tensor[1, k, f16], w: Tensor[n, k, f16]):
        return (mdsl.rms_norm(x) * g) @ mdsl.transpose(w, 0, 1)
    return linear_t.graph


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rows,k,n", [(4, 256, 64), (1, 1024, 64)])
def test_a_weight_stored_out_in_is_read_in_place_and_transposed_per_tile(rows, k, n):
    """The transpose lifts into the block: the weight's tiles are read as stored, the loop walking its last
    dim (K), and a block-level transpose turns each into the product's operand; every candidate computes
    the program."""
    graph = _linear_transposed(rows, k, n)
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(v.shape) for v in graph.inputs]
    want = run_kernel_graph(graph, inputs)[0]
    candidates = list(generate(graph, SearchConfig(min_blocks=1), limit=20))
    whole = [c for c in candidates if len(c.nodes) == 1]
    assert whole
    for c in candidates:
        assert np.linalg.norm(run_kernel_graph(c, inputs)[0] - want) / np.linalg.norm(want) < 1e-10
    looped = [c.nodes[0].body for c in whole if c.nodes[0].body.forloop > 1]
    assert looped
    for body in looped:
        transpose = next(node for node in body.nodes if node.op == "transpose")
        (weight,) = [i for i in body.inputs if i.var.name == transpose.inputs[0].name]
        assert weight.fmap == 1 and transpose.attr("perm") == (1, 0)   # its tiles along K, as stored
        assert {"matmul", "accum_rms"} <= set(ops_of(body))


def test_the_search_deadline_stops_the_lifting():
    graph = example("rms_norm_linear").make_rms_norm_linear(1).graph
    assert list(generate(graph, SearchConfig(), SearchStats()))   # in time: candidates
    stats = SearchStats(deadline=time.monotonic())
    assert list(generate(graph, SearchConfig(), stats)) == []
    assert stats.by_reason("stopped") == {"guided: time": 1} and "pruned" not in stats.counts

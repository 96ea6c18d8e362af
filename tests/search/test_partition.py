"""Partial fusion (mdsl/search/partition.py): programs that no one kernel computes are cut into parts,
each fused by the guided lifting rules, and the combination is verified as a whole. IR in, plan out."""
from __future__ import annotations

import attrs
import numpy as np
import pytest

import mdsl
from mdsl import Tensor, f16
from mdsl.backend.reference import run_kernel_graph
from mdsl.ir.graph import KernelGraph
from mdsl.search import explain, partition
from mdsl.search.config import SearchConfig
from mdsl.search.cost import estimate
from mdsl.search.engine import search
from mdsl.search.records import Assembly
from mdsl.search.stats import SearchStats

# the default generators but the exhaustive one (its states would dominate these tests' time)
CONFIG = SearchConfig(budget_s=90, workers=1, exhaustive=False, min_blocks=1)


def _cut(y):
    """A kernel boundary: a split of a norm's row has no block-level rule (the split cannot move past the norm)."""
    half = y.shape[-1] // 2
    a, b = mdsl.split(mdsl.rms_norm(y), [half, half], dim=-1)
    return a * b


def _layout_epilogue():
    @mdsl.kernel
    def epilogue(x: Tensor[16, 8, f16], w: Tensor[16, 64, f16], b: Tensor[1, 64, f16]):
        t = mdsl.transpose(x, 0, 1)                      # a layout change
        return mdsl.silu(t @ w + b) * 2.0                # the bias, silu and scale: the product's epilogue
    return epilogue.graph


def _epilogue():
    @mdsl.kernel
    def epilogue(x: Tensor[16, 8, f16], w: Tensor[4, 64, f16], b: Tensor[1, 64, f16]):
        return mdsl.silu(_cut(x) @ w + b) * 2.0          # the bias, silu and scale: the product's epilogue
    return epilogue.graph


def _norm_matmul():
    @mdsl.kernel
    def norm_matmul(x: Tensor[8, 64, f16], w: Tensor[64, 32, f16]):
        return _cut(mdsl.rms_norm(x) @ w)                # the rms folds into the product's loop
    return norm_matmul.graph


def _horizontal():
    @mdsl.kernel
    def qk(x: Tensor[8, 64, f16], wq: Tensor[64, 32, f16], wk: Tensor[64, 16, f16]):
        h = mdsl.rms_norm(x)
        return _cut(h @ wq), h @ wk                      # two products of one input: one kernel
    return qk.graph


def _row_scalar():
    @mdsl.kernel
    def row_scalar(x: Tensor[8, 64, f16], w: Tensor[64, 32, f16]):
        s = mdsl.max(x, dim=-1, keepdim=True)                # a per-row scalar scaling the product
        return _cut((x @ w) * s)
    return row_scalar.graph


def _softmax():
    @mdsl.kernel
    def scores(x: Tensor[8, 64, f16], w: Tensor[64, 32, f16]):
        return _cut(mdsl.softmax((x @ w) * 0.125, dim=-1))
    return scores.graph


def _split_gate():
    @mdsl.kernel
    def split_gate(x: Tensor[8, 64, f16], w: Tensor[64, 64, f16]):
        gate, up = mdsl.split(x @ w, [32, 32], dim=-1)       # a layout change between product and gate
        return mdsl.silu(gate) * up
    return split_gate.graph


FAMILIES = {"epilogue": (_epilogue, {"silu", "add", "matmul"}),
            "norm_matmul": (_norm_matmul, {"matmul"}),
            "horizontal": (_horizontal, {"matmul"}),
            "row_scalar": (_row_scalar, {"max", "matmul"}),
            "softmax": (_softmax, {"exp", "matmul"})}
# (_split_gate is one kernel: its split moves to the weight, tests/search/test_layout_parts.py)


def _fused_ops(graph: KernelGraph) -> set:
    return {m.op for n in graph.nodes if n.body is not None for m in n.body.nodes}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_program_no_one_kernel_computes_is_fused_part_by_part_and_verified(name):
    make, fused_ops = FAMILIES[name]
    graph = make()
    result = search(graph, CONFIG)
    plan = result.plan()
    assert plan.cost.launches < plan.original_cost.launches, str(plan)
    assert plan.cost.seconds < plan.original_cost.seconds
    assert plan.graph.key in result.stats.partition["assemblies"]   # the partition generator's combination
    assert fused_ops <= _fused_ops(plan.graph)
    if name == "norm_matmul":   # the norm in the product's kernel: whole rows, or its statistics in the loop
        assert _fused_ops(plan.graph) & {"rms_norm", "accum_rms"}
    assert plan.evidence.equivalent and plan.evidence.finite_field_tests == CONFIG.verify_tests
    # and it computes the program (float64, fresh inputs)
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal(v.shape) for v in graph.inputs]
    for got, want in zip(run_kernel_graph(plan.graph, inputs), run_kernel_graph(graph, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def test_horizontal_fusion_computes_both_products_in_one_kernel():
    graph = _horizontal()
    stats = SearchStats()
    best, *_ = partition.generate(graph, CONFIG, stats)
    (fused,) = [n for n in best.graph.nodes if n.body is not None and
                [m.op for m in n.body.nodes].count("matmul") == 2]
    assert len(fused.outputs) == 2


def test_a_subprogram_reads_what_its_nodes_read_and_returns_what_later_nodes_read():
    graph = partition.ordered(_layout_epilogue())
    ops = [n.op for n in graph.nodes]
    assert ops == ["transpose", "matmul", "add", "silu", "mul_scalar"]
    part = partition.subprogram(graph, 1, 3)
    assert [v.name for v in part.inputs] == [graph.nodes[0].outputs[0].name, "w", "b"]
    assert [v.name for v in part.outputs] == [graph.nodes[2].outputs[0].name]   # the add, which silu reads
    assert partition.subprogram(graph, 1, 5).outputs == graph.outputs


def test_the_node_order_keeps_a_consumer_beside_its_producer():
    @mdsl.kernel
    def breadth_first(x: Tensor[8, 64, f16], w: Tensor[64, 64, f16], g: Tensor[8, 64, f16]):
        h = x @ w
        t = mdsl.transpose(h, 0, 1)      # traced before the gate that also reads h
        return t, h * g

    ops = [n.op for n in partition.ordered(breadth_first.graph).nodes]
    assert ops == ["matmul", "mul", "transpose"]


def test_the_combination_never_costs_more_than_the_operators_apart():
    graph = _split_gate()
    part = partition.Partition(graph, CONFIG, SearchStats())
    part.analyse()
    combination = part.screened_best()
    assembled = part.assemble(combination)
    assert estimate(assembled).seconds <= estimate(graph).seconds
    assert estimate(assembled).launches <= estimate(graph).launches
    nothing = part.best(excluded=frozenset(part.parts))   # every part excluded: the operators apart
    assert all(option is None for _, _, option in nothing)
    assert part.assemble(nothing).key == partition.ordered(graph).key


def test_fallbacks_leave_out_one_fused_part_each_and_wait_for_the_best():
    @mdsl.kernel
    def two_parts(x: Tensor[8, 64, f16], w: Tensor[64, 64, f16], v: Tensor[32, 32, f16]):
        h = mdsl.silu(x @ w) * 2.0
        return mdsl.relu(_cut(h) @ v) + 1.0              # a kernel between

    stats = SearchStats()
    best, *fallbacks = partition.generate(two_parts.graph, CONFIG, stats)
    assert isinstance(best, Assembly) and best.primary is None and fallbacks
    assert all(isinstance(f, Assembly) and f.primary == best.graph.key for f in fallbacks)
    spans = {key: set(map(tuple, s)) for key, s in stats.partition["assemblies"].items()}
    assert len(spans[best.graph.key]) == len(best.parts) == 2
    assert all(spans[best.graph.key] - spans[f.graph.key] for f in fallbacks)   # each without a part of the best
    for sub, replacement in best.parts:   # each part's replacement reads and returns what its sub-program does
        assert [v.type for v in replacement.inputs] == [v.type for v in sub.inputs]
        assert [v.name for v in replacement.outputs] == [v.name for v in sub.outputs]


def test_a_part_that_fails_its_screen_gives_way_to_its_next_candidate(monkeypatch):
    graph = _norm_matmul()
    calls = []

    def first_fails(original, candidate, seed, key=None):
        calls.append(candidate.key)
        return "differs" if len(calls) == 1 else None

    monkeypatch.setattr(partition, "screen", first_fails)
    part = partition.Partition(graph, CONFIG, SearchStats())
    part.analyse()
    combination = part.screened_best()
    used = [option for _, _, option in combination if option is not None]
    # one screen a part, and one more for the part whose first candidate failed: its next one is used instead
    keys = {option[0].key for option in used}
    assert len(calls) == len(used) + 1 and calls[0] not in keys and keys == set(calls[1:])


def test_an_analysis_cut_short_by_its_work_allowance_still_screens_and_combines_what_it_found():
    @mdsl.kernel
    def chain(x: Tensor[8, 64, f16], w: Tensor[64, 32, f16], g: Tensor[8, 32, f16]):
        t = mdsl.transpose(mdsl.exp(x), 0, 1)
        return mdsl.silu(mdsl.rms_norm(x) @ w) * g, t

    config = SearchConfig(budget_s=90, workers=1, exhaustive=False, min_blocks=1, work=40)
    stats = SearchStats(work_limit=config.work)
    best, *_ = partition.generate(chain.graph, config, stats)
    assert stats.partition["stopped"] == "work"                  # the liftings spent their allowance
    assert stats.counts["work"]["partition screens"] > 0         # the screens have theirs
    assert isinstance(best, Assembly) and best.parts
    assert estimate(best.graph).launches < estimate(chain.graph).launches


def test_element_wise_siblings_of_one_input_are_ordered_together_and_fused():
    @mdsl.kernel
    def siblings(x: Tensor[4, 64, f16], b: Tensor[1, 64, f16], w: Tensor[64, 256, f16], g: Tensor[4, 64, f16]):
        return x * b, x @ w, x * g          # the product is traced between the two scalings of x

    ordered = partition.ordered(siblings.graph)
    assert [n.op for n in ordered.nodes] == ["mul", "mul", "matmul"]
    part = partition.Partition(siblings.graph, CONFIG, SearchStats())
    part.analyse()
    assert part.parts[0, 2].status == partition.FUSED
    assert any(o is not None and i <= 0 and 2 <= j for i, j, o in part.screened_best())   # one kernel has both


def _dear():
    @mdsl.kernel
    def dear(x: Tensor[64, 8192, f16], w: Tensor[8192, 4096, f16]):
        return mdsl.softmax(x, dim=-1) @ w           # a 4.3-GFLOP product after a cheap softmax
    return dear.graph


def test_a_program_dear_to_verify_has_its_cheap_parts_fused_first():
    graph = _dear()
    assert estimate(graph).flops > partition.DEAR_FLOPS
    stats = SearchStats()
    (best,) = list(partition.generate_cheap(graph, CONFIG, stats))
    assert isinstance(best, Assembly) and best.parts
    assert estimate(best.graph).launches < estimate(graph).launches
    assert all(estimate(sub).flops <= partition.CHEAP_PART_FLOPS for sub, _ in best.parts)
    assert "matmul" in {n.op for n in best.graph.nodes}    # the product is left as it was
    record = stats.partition
    assert list(record["assemblies"]) == [best.graph.key]
    dear = [p for p in record["parts"].values() if p["status"] == partition.DEAR]
    assert dear and all("dear to verify" in p["reason"] for p in dear)
    assert stats.by_reason("work").get("cheap parts", 0) > 0 and "partition" not in stats.by_reason("work")

    # the full analysis, cut at once by its work allowance, keeps the cheap assembly in its record
    list(partition.generate(graph, attrs.evolve(CONFIG, work=1), stats))
    assert best.graph.key in stats.partition["assemblies"]
    assert {s for s, p in record["parts"].items() if p["status"] == partition.FUSED} <= \
        {s for s, p in stats.partition["parts"].items() if p["status"] == partition.FUSED}


def test_a_program_cheap_to_verify_gets_no_early_partial_fusion():
    stats = SearchStats()
    assert list(partition.generate_cheap(_softmax(), CONFIG, stats)) == [] and stats.partition is None


def test_a_transpose_cublas_reads_in_place_is_left_to_it_rather_than_made_for_a_fused_kernel():
    """x @ transpose(w) + r (w: [out, in], a linear layer's weight and a residual, as a traced torch graph has
    them): fusing the add into the product's kernel would need w's transpose made each call; left apart, cuBLAS
    reads w in place and the transpose costs nothing, which the combination counts."""
    from mdsl.ir.dtypes import bf16
    from mdsl.lowering.gemm import library_read_transposes
    from tests.backend.cuda.builder import Graph

    g = Graph("linear_residual")
    x, w, r = g.input("x", (1, 2048), bf16), g.input("w", (3072, 2048), bf16), g.input("r", (1, 3072), bf16)
    y = g.op("add", g.op("matmul", x, g.op("transpose", w, perm=(1, 0))), r)
    part = partition.Partition(g.build([y]), CONFIG, SearchStats())
    (t,) = library_read_transposes(part.graph)
    assert part.single[t].seconds == 0.0 and part.single[t].launches == 0
    matmul = next(k for k, n in enumerate(part.graph.nodes) if n.op == "matmul")
    made = part._made(matmul, matmul + 2)   # a fused product and add reads the transpose's value
    assert [c.launches for c in made] == [1] and made[0].seconds > 0
    assert part._made(t, t + 1) == []       # (the transpose itself reads w)
    part.analyse()
    fused = part.parts.get((matmul, matmul + 2))
    assert fused is not None and fused.current() is not None, "the product and the add fuse into one kernel"
    plan = part.assemble(part.screened_best())
    # ... and yet the combination keeps the product a library GEMM that reads w in place
    assert [n.op for n in plan.nodes] == ["transpose", "matmul", "add"] and library_read_transposes(plan)


def _residual_norms():
    @mdsl.kernel
    def residual_norms(x: Tensor[64, 256, f16], y: Tensor[64, 256, f16], w: Tensor[1, 256, f16]):
        h = x + y                                        # two residual adds, each with an rms norm spelled out
        n = h * mdsl.rsqrt(mdsl.mean(h * h, dim=-1, keepdim=True) + 1e-6) * w
        g = n + x
        return g * mdsl.rsqrt(mdsl.mean(g * g, dim=-1, keepdim=True) + 1e-6) * w
    return residual_norms.graph


def test_probes_reach_the_long_parts_that_lifting_every_choice_of_the_short_ones_would_not():
    # lifting every choice of each two-operator part costs ~100-300 steps apiece: 1000 steps would end at
    # parts of three operators; a probe per structure reaches every length, and the combination's parts
    # are then lifted under every choice
    graph = _residual_norms()
    config = SearchConfig(budget_s=90, workers=1, exhaustive=False, min_blocks=1, work=1000)
    part = partition.Partition(graph, config, SearchStats(work_limit=config.work))
    part.analyse()
    assert part.stopped == "work"
    combination = part.screened_best()
    fused = [(i, j) for i, j, option in combination if option is not None]
    assert fused == [(0, 7), (7, 14)]                             # a residual add and its norm: one kernel each
    assert all(part.parts[span].refined for span in fused)


def test_with_work_to_spare_every_part_that_lifts_is_lifted_under_every_choice():
    @mdsl.kernel
    def residual_norm(x: Tensor[64, 256, f16], y: Tensor[64, 256, f16]):
        h = x + y
        return h * mdsl.rsqrt(mdsl.mean(h * h, dim=-1, keepdim=True) + 1e-6)

    graph = residual_norm.graph
    part = partition.Partition(graph, CONFIG, SearchStats(work_limit=CONFIG.work))
    part.analyse()
    assert not part.stopped
    lifted = [p for p in part.parts.values() if p is not None and p.status == partition.FUSED]
    assert lifted and all(p.refined and p.complete for p in lifted)
    assert all(p.complete for p in part.parts.values() if p is not None and p.status == partition.NO_LIFT)


def _norm_siblings_and_chain():
    @mdsl.kernel
    def siblings_and_chain(x: Tensor[8, 8192, f16], w0: Tensor[8192, 2048, f16], w1: Tensor[8192, 8192, f16],
                           w2: Tensor[2048, 2048, f16]):
        h = mdsl.rms_norm(x)      # (too large for one kernel with all three products)
        a = h @ w0                # read by a third product: the chain's order places it right after a
        return h @ w1, a @ w2
    return siblings_and_chain.graph


def test_siblings_first_is_a_second_order_whose_runs_hold_a_norm_and_both_products():
    graph = _norm_siblings_and_chain()
    chains, siblings = partition.orders(graph)
    names = lambda nodes: [graph.nodes[k].op for k in nodes]
    assert names(chains) == ["rms_norm", "matmul", "matmul", "matmul"]
    first = {graph.nodes[k].outputs[0].name for k in chains[:3]}
    second = {graph.nodes[k].outputs[0].name for k in siblings[:3]}
    assert first != second and all(graph.nodes[k].inputs[0].name == graph.nodes[siblings[0]].outputs[0].name
                                   for k in siblings[1:3])   # both products of the norm, then the chained one
    # a program with no such choice has one order
    assert len(partition.orders(_norm_matmul())) == 1


def test_a_cheaper_combination_in_the_siblings_order_comes_first_and_shared_parts_are_lifted_once():
    graph = _norm_siblings_and_chain()
    stats = SearchStats()
    chains, siblings = partition.orders(graph)
    in_chains, in_siblings = partition.analysed(graph, CONFIG, stats)
    assert (in_chains.order, in_siblings.order) == (chains, siblings)
    combination = in_siblings.screened_best()
    (fused,) = [(i, j) for i, j, o in combination if o is not None]
    assert fused == (0, 3)   # the norm and both of its products: one kernel
    # in the chains' order no run holds them, and no part of it fuses for less than its operators apart
    assert all(o is None for _, _, o in in_chains.screened_best())
    assert in_siblings.total(combination) < in_chains.total(in_chains.screened_best())
    assert in_chains.parts[0, 2] is in_siblings.parts[0, 2]   # {norm, first product}: a run of both, one part
    # the siblings' best combination is yielded first; the explanation reads its spans in its order
    stats = SearchStats()
    best, *_ = partition.generate(graph, CONFIG, stats)
    assert best.primary is None and estimate(best.graph).launches == 2
    assert stats.partition["order"] == [graph.nodes[k].outputs[0].name for k in chains]
    (other,) = stats.partition["others"]
    assert other["order"] == [graph.nodes[k].outputs[0].name for k in siblings]
    assert other["assemblies"][best.graph.key] == [[0, 3]]


def test_an_earlier_records_spans_move_to_the_later_order_or_are_left_out():
    moved = partition._span_mover([0, 1, 2, 3], [0, 2, 1, 3])
    assert moved(0, 1) == (0, 1) and moved(1, 3) == (1, 3) and moved(0, 2) is None and moved(2, 4) is None
    assert moved(0, 3) == (0, 3)


def _scaled_and_returned():
    @mdsl.kernel
    def scaled_and_returned(x: Tensor[2, 1024, f16], w: Tensor[1024, 2048, f16]):
        s = x * 0.125                                     # read by a product and by a layout round trip
        t = mdsl.transpose(mdsl.transpose(s, 0, 1) * 0.5, 0, 1)
        return t, s @ w
    return scaled_and_returned.graph


def test_the_duplicated_form_computes_an_element_wise_value_once_per_reader():
    graph = _scaled_and_returned()
    copies = partition.duplicated(graph)
    assert [n.op for n in copies.nodes].count("mul_scalar") == 3 and len(copies.nodes) == len(graph.nodes) + 1
    scaled = {n.outputs[0].name for n in copies.nodes if n.op == "mul_scalar" and n.inputs[0].name == "x"}
    readers = [n for n in copies.nodes if any(v.name in scaled for v in n.inputs)]
    assert len(scaled) == 2 and len(readers) == 2   # one copy per reader
    assert {v.name for r in readers for v in r.inputs} & scaled == scaled
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(v.shape) for v in graph.inputs]
    for got, want in zip(run_kernel_graph(copies, inputs), run_kernel_graph(graph, inputs)):
        np.testing.assert_array_equal(got, want)
    assert partition.duplicated(_norm_matmul()) is None   # no value with two readers


def test_a_chain_of_element_wise_steps_is_copied_whole_and_copies_are_bounded():
    @mdsl.kernel
    def chain(x: Tensor[4, 64, f16], w: Tensor[64, 64, f16], v: Tensor[64, 64, f16]):
        s = mdsl.silu(x) * 2.0                        # two steps, read by three products
        return s @ w, s @ v, mdsl.exp(s)

    copies = partition.duplicated(chain.graph)
    ops = [n.op for n in copies.nodes]
    assert ops.count("mul_scalar") == 3 and ops.count("silu") == 3   # each reader's own silu and scale
    assert len(copies.nodes) <= 2 * len(chain.graph.nodes)


def test_a_copy_fused_into_its_readers_kernel_removes_a_kernel_the_program_as_written_cannot():
    graph = _scaled_and_returned()
    stats = SearchStats()
    written, *others = partition.analysed(graph, CONFIG, stats)
    copies = [p for p in others if len(p.graph.nodes) == len(graph.nodes) + 1]
    assert copies and len(copies) == len(others)                # one form of copies, in its orders
    best = min(copies, key=lambda p: p.total(p.screened_best()))
    assert best.total(best.screened_best())[1] < written.total(written.screened_best())[1]
    first, *rest = partition.generate(graph, CONFIG, SearchStats())
    assert isinstance(first, Assembly) and first.primary is None
    assert estimate(first.graph).launches == 2
    assert any(isinstance(c, Assembly) and len(c.parts) and c.primary is None for c in rest)   # the program's own
    # the search verifies the two kernels and keeps them (the finer GPU model orders the kept ones), and
    # explains them in the copies' form's terms
    result = search(graph, CONFIG)
    (two,) = [c for c in result.candidates if c.cost.launches == 2]
    assert two.evidence.equivalent
    assert any(two.graph.key in other["assemblies"] for other in result.stats.partition["others"])
    (boundary,) = explain.boundaries(graph, two.graph, result.stats, {})
    assert "mul_scalar" in boundary.before and "matmul" in boundary.after
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(v.shape) for v in graph.inputs]
    for got, want in zip(run_kernel_graph(two.graph, inputs), run_kernel_graph(graph, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)

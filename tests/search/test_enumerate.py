"""The exhaustive generator: what it finds on small programs, canonical order, label-consistent maps,
pruning and its bounds."""
from __future__ import annotations

import functools
import time
import tracemalloc

import attrs
import numpy as np
import pytest

import mdsl
from mdsl import Tensor, f16, f32
from mdsl.backend.reference import run_kernel_graph
from mdsl.errors import MdslError
from mdsl.ir.validate import validate_kernel_graph
from mdsl.search import enumerate as E
from mdsl.search.config import SearchConfig
from mdsl.search.dims import Labels
from mdsl.search.enumerate import _Search, generate
from mdsl.search.stats import SearchStats


# ---- the programs -------------------------------------------------------------------------------

def rms_norm_linear():
    @mdsl.kernel
    def rms_norm_linear(x: Tensor[2, 64, f16], w: Tensor[64, 96, f16]):
        return mdsl.rms_norm(x) @ w
    return rms_norm_linear.graph


def gated_mlp():
    @mdsl.kernel
    def gated_mlp(x: Tensor[2, 64, f16], w1: Tensor[64, 32, f16], w2: Tensor[64, 32, f16]):
        return mdsl.silu(x @ w1) * (x @ w2)
    return gated_mlp.graph


def row_wise():
    @mdsl.kernel
    def row_wise(x: Tensor[8, 16, f32], y: Tensor[8, 16, f32]):
        return mdsl.exp(x) * y
    return row_wise.graph


def row_sum():
    @mdsl.kernel
    def row_sum(x: Tensor[8, 64, f32]):
        return mdsl.sum(x, dim=1)
    return row_sum.graph


def lora():
    @mdsl.kernel
    def lora(x: Tensor[4, 32, f16], w: Tensor[32, 64, f16], a: Tensor[32, 4, f16], b: Tensor[4, 64, f16]):
        return x @ w + (x @ a) @ b
    return lora.graph


#: program -> the largest block graph it may take
PROGRAMS = {"rms_norm_linear": (rms_norm_linear, 5), "gated_mlp": (gated_mlp, 6), "row_wise": (row_wise, 4),
            "row_sum": (row_sum, 3)}


@functools.cache
def run(name: str, **options):
    """(graph, candidates, stats, seconds) of one enumeration, shared by the tests."""
    make, max_ops = PROGRAMS[name]
    graph = make()
    stats = SearchStats()
    start = time.perf_counter()
    candidates = list(generate(graph, SearchConfig(max_block_ops=max_ops, workers=1, work=10**6), stats, **options))
    return graph, candidates, stats, time.perf_counter() - start


def body(candidate):
    (node,) = candidate.nodes
    return node.body


def ops(candidate) -> list:
    return sorted(n.op for n in body(candidate).nodes)


COMMUTATIVE = ("add", "mul")


def dag_key(candidate) -> tuple:
    """The block graph as a DAG: equal for the same operators applied in another order (and the
    operands of add and mul in another order)."""
    b = body(candidate)
    expr = {inp.var.name: ("in", k, inp.imap, inp.fmap) for k, inp in enumerate(b.inputs)}
    for n in b.nodes:
        operands = [expr[v.name] for v in n.inputs]
        expr[n.output.name] = (n.op, n.attrs, tuple(sorted(operands, key=repr) if n.op in COMMUTATIVE else operands))
    return (b.grid, b.threads, b.forloop, frozenset(expr[n.output.name] for n in b.nodes),
            tuple((expr[o.var.name], o.omap) for o in b.outputs))


# ---- what it finds ------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_rms_norm_linear_fused_within_five_ops():
    graph, candidates, stats, seconds = run("rms_norm_linear")
    fused = [c for c in candidates if ops(c) == ["accum", "accum_rms", "div", "matmul"] and body(c).forloop > 1]
    assert fused, "the fused RMSNorm + Linear block graph"
    assert not stats.by_reason("stopped"), "found by exhausting the bounded space, not cut short"
    for c in fused:
        x, w = body(c).inputs
        assert (x.fmap, w.fmap) == (1, 0)          # the loop walks K in both
        (mm,) = [n for n in body(c).nodes if n.op == "matmul"]
        assert [v.name for v in mm.inputs] == [x.var.name, w.var.name]
    # Mirage's graph: every block reads all of X and its own columns of W
    assert any(body(c).inputs[0].imap == (None, None, None) and body(c).inputs[1].imap == (1, None, None)
               for c in fused)


@pytest.mark.timeout(60)
def test_gated_mlp_with_both_matmuls_in_one_loop_within_six_ops():
    graph, candidates, stats, seconds = run("gated_mlp")
    fused = [c for c in candidates if ops(c) == ["accum", "accum", "matmul", "matmul", "mul", "silu"]
             and body(c).forloop > 1]
    assert fused
    post = body(fused[0]).post_loop_vars()
    assert {n.op for n in body(fused[0]).nodes if n.output.name in post} == {"accum", "silu", "mul"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_candidate_validates_and_computes_the_program(name):
    graph, candidates, stats, seconds = run(name)
    assert candidates
    rng = np.random.default_rng(12345)
    inputs = [rng.standard_normal(v.shape) for v in graph.inputs]
    want = run_kernel_graph(graph, inputs)
    for c in candidates:
        validate_kernel_graph(c)
        assert c.inputs == graph.inputs and c.outputs == graph.outputs
        for got, expected in zip(run_kernel_graph(c, inputs), want):
            np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12, err_msg=str(c))


# ---- canonical order and consistent maps -------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_no_candidate_twice_not_even_in_another_operator_order(name):
    graph, candidates, stats, seconds = run(name)
    assert len({c.key for c in candidates}) == len(candidates)
    assert len({dag_key(c) for c in candidates}) == len(candidates)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["row_wise", "rms_norm_linear"])
def test_canonical_order_drops_only_other_orders_of_the_same_graph(name, monkeypatch):
    graph, candidates, stats, seconds = run(name)
    ordered = _Search._candidates

    def unordered(search):   # as if no operator came before: every order of every DAG
        ranks, search.ranks = search.ranks, []
        try:
            return ordered(search)
        finally:
            search.ranks = ranks

    monkeypatch.setattr(_Search, "_candidates", unordered)
    every_order = list(generate(graph, SearchConfig(max_block_ops=PROGRAMS[name][1])))
    assert {dag_key(c) for c in every_order} == {dag_key(c) for c in candidates}
    assert len(every_order) > len(candidates)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_grid_dim_splits_one_label_everywhere_and_the_loop_walks_one(name):
    graph, candidates, stats, seconds = run(name)
    labels = Labels(graph)
    contracted = labels.contracted_labels()
    for c in candidates:
        (node,) = c.nodes
        b = node.body
        for g, size in enumerate(b.grid):
            split = {labels.label(t.name, i.imap[g]) for t, i in zip(node.inputs, b.inputs) if i.imap[g] is not None}
            split |= {labels.label(t.name, o.omap[g]) for t, o in zip(node.outputs, b.outputs) if o.omap[g] is not None}
            assert len(split) == (size > 1), str(c)
            assert not split & set(contracted)
        looped = {labels.label(t.name, i.fmap) for t, i in zip(node.inputs, b.inputs) if i.fmap is not None}
        assert len(looped) == (b.forloop > 1) and looped <= set(contracted)


@pytest.mark.timeout(60)
def test_blocks_stay_within_the_configured_range():
    graph, candidates, stats, seconds = run("rms_norm_linear")
    config = SearchConfig()
    assert all(config.min_blocks <= body(c).num_blocks <= config.max_blocks for c in candidates)
    assert {body(c).threads for c in candidates} == set(config.thread_counts)


@pytest.mark.timeout(30)
def test_scalars_come_from_the_program():
    @mdsl.kernel
    def scaled(x: Tensor[8, 16, f32], y: Tensor[8, 16, f32]):
        return (x * 0.5) + y

    graph = scaled.graph
    candidates = list(generate(graph, SearchConfig(max_block_ops=4)))
    assert candidates
    scalars = {v for c in candidates for n in body(c).nodes for k, v in n.attrs if k == "value"}
    assert scalars == {0.5}


# ---- pruning and bounds -------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_pruning_is_counted_by_reason():
    graph, candidates, stats, seconds = run("rms_norm_linear")
    pruned = stats.by_reason("pruned")
    for reason in ("abstract-expression", "order", "shape", "dims", "phase", "dead-end"):
        assert pruned.get(reason, 0) > 0, reason
    assert stats.by_reason("states")["enumerate"] > 0
    assert "stopped" not in stats.counts   # small programs are enumerated to the end


@pytest.mark.timeout(60)
def test_the_abstract_expression_check_removes_states_but_no_candidate():
    graph, pruned_candidates, pruned, _ = run("row_sum")
    _, candidates, unpruned, _ = run("row_sum", prune=False)
    assert unpruned.total("pruned") and "abstract-expression" not in unpruned.by_reason("pruned")
    assert pruned.by_reason("pruned")["abstract-expression"] > 0
    assert 10 * pruned.by_reason("states")["enumerate"] < unpruned.by_reason("states")["enumerate"]
    assert {c.key for c in pruned_candidates} == {c.key for c in candidates}


@pytest.mark.timeout(30)
def test_the_state_budget_ends_a_large_space(monkeypatch):
    monkeypatch.setattr(E, "SOLVER_UNITS_PER_STEP", 10 ** 9)   # (the states alone: the queries' units below)
    stats = SearchStats()
    candidates = list(generate(lora(), SearchConfig(max_block_ops=7), stats, max_states=50))
    assert stats.by_reason("stopped") == {"enumerate: states": 1}
    assert stats.by_reason("states")["enumerate"] == 51
    assert all(c.key for c in candidates)


@pytest.mark.timeout(60)
def test_the_work_budget_bounds_the_states_whatever_the_time(monkeypatch):
    monkeypatch.setattr(E, "SOLVER_UNITS_PER_STEP", 10 ** 9)
    stats = SearchStats()
    list(generate(lora(), SearchConfig(max_block_ops=7, work=40, budget_s=1.0), stats))
    assert stats.by_reason("stopped") == {"enumerate: states": 1}   # a wall-clock budget plays no part
    assert stats.by_reason("states")["enumerate"] == 41


@pytest.mark.timeout(120)
def test_the_z3_queries_resource_units_count_as_work_and_end_it_the_same_way_each_time(monkeypatch):
    """A state costs a step and its abstract-expression queries their z3 resource units: with few units a
    step, the enumeration ends by them, at the same state in every run (the units are z3's deterministic
    count, not time), before the states run out."""
    monkeypatch.setattr(E, "SOLVER_UNITS_PER_STEP", 20)
    runs = []
    for _ in range(2):
        stats = SearchStats()
        keys = [c.key for c in generate(lora(), SearchConfig(max_block_ops=7, work=2000), stats)]
        runs.append((keys, stats.by_reason("states"), stats.by_reason("stopped")))
    assert runs[0] == runs[1]
    assert runs[0][2] == {"enumerate: solver": 1} and runs[0][1]["enumerate"] < 2000


@pytest.mark.timeout(60)
def test_every_state_polls_the_search_so_that_it_verifies_while_the_enumeration_runs(monkeypatch):
    monkeypatch.setattr(E, "SOLVER_UNITS_PER_STEP", 10 ** 9)
    polls = []
    stats = SearchStats(listener=lambda: polls.append(1))
    list(generate(lora(), SearchConfig(max_block_ops=7), stats, max_states=50))
    assert len(polls) >= 51   # a poll a state, besides the counts (the prunes come a frame at a time)


@pytest.mark.timeout(30)
def test_the_search_deadline_stops_it():
    stats = SearchStats(deadline=time.monotonic())
    list(generate(lora(), SearchConfig(max_block_ops=7), stats))
    assert stats.by_reason("stopped") == {"enumerate: time": 1}


@pytest.mark.timeout(30)
def test_time_the_consumer_spends_does_not_count():
    graph = row_wise()
    everything = list(generate(graph, SearchConfig(max_block_ops=4)))
    config = SearchConfig(max_block_ops=4, budget_s=2.0)
    pause = 1.2 * config.budget_s / len(everything)
    slow = []
    for c in generate(graph, config):
        slow.append(c)
        time.sleep(pause)
    assert [c.key for c in slow] == [c.key for c in everything]


def test_programs_one_kernel_cannot_stand_for_yield_nothing():
    @mdsl.kernel
    def identity(x: Tensor[8, 16, f32]):
        return x

    assert list(generate(identity.graph)) == []


# ---- the numeric screen -------------------------------------------------------------------------

def _full_size_screen(graph, seed: int):
    """The screen at the program's own sizes: what the reduced screen must agree with."""
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(v.shape) for v in graph.inputs]
    expected = run_kernel_graph(graph, inputs)

    def passes(candidate) -> bool:
        try:
            got = run_kernel_graph(candidate, inputs)
        except MdslError:
            return False
        return all(E._close(a, b) for a, b in zip(got, expected))

    return passes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_reduced_screen_agrees_with_the_full_size_one_on_every_program(name):
    make, max_ops = PROGRAMS[name]
    graph = make()
    config = SearchConfig(max_block_ops=max_ops, workers=1)
    problem, stats = E._Problem(graph, config), SearchStats()
    budget = E._Budget(10**6, stats)
    matcher = E._Matcher(problem.targets)
    checker = E.SubexprChecker([t.term for t in problem.targets])
    screen, full = E._Screen(problem, config.seed), _full_size_screen(graph, config.seed)
    verdicts = []
    for frame in problem.frames:
        for program in E._Search(problem, frame, checker, matcher, budget, stats).run():
            reduced = screen.passes(program)
            verdicts.append(reduced)
            assert reduced == full(E._kernel_graph(problem, program, E.Grid(), config.thread_counts[0])), program
    assert True in verdicts
    shrunk = [i.graph for i in screen.instances.values() if i is not None]
    assert any(_elements(g) < _elements(graph) for g in shrunk)   # (a loop of 8 chunks of 8 keeps 64)


def _elements(graph) -> int:
    return sum(v.type.numel for v in (*graph.inputs, *graph.outputs))


def test_a_program_that_computes_something_else_fails_the_reduced_screen():
    graph = gated_mlp()
    problem = E._Problem(graph, SearchConfig(max_block_ops=6, workers=1))
    screen = E._Screen(problem, 0)
    frame = next(f for f in problem.frames if f.forloop == 2)
    steps = (E.Step("matmul", (0, 1), ()), E.Step("matmul", (0, 2), ()), E.Step("accum", (3,), ()),
             E.Step("accum", (4,), ()), E.Step("silu", (5,), ()), E.Step("mul", (7, 6), ()))
    right = E.Program(frame, steps, (8,), ((),) * 9)   # (one block: no grid map reads the labels)
    wrong = attrs.evolve(right, steps=steps[:-1] + (E.Step("mul", (5, 6), ()),))   # the silu left out
    assert screen.passes(right) is True
    assert screen.passes(wrong) is False


def test_labels_an_operator_fixes_keep_their_size_in_the_screen():
    @mdsl.kernel
    def joined(x: Tensor[64, 32, f32], y: Tensor[64, 32, f32], w: Tensor[32, 48, f32]):
        return mdsl.exp(mdsl.concat([x @ w, y @ w], dim=1))

    graph = joined.graph
    problem = E._Problem(graph, SearchConfig(workers=1))
    reduced = E._Screen(problem, 0)._reduced(E.Frame())
    concat = next(n for n in reduced.nodes if n.op == "concat")
    assert concat.outputs[0].shape == (64, 96)       # a concat's sizes add up: the labels it touches stay
    assert [v.shape for v in reduced.inputs] == [(64, 8), (64, 8), (8, 48)]   # k, which it does not, shrinks
    validate_kernel_graph(reduced)


@pytest.mark.timeout(60)
def test_a_program_too_large_to_screen_goes_to_the_verifier_unscreened(monkeypatch):
    graph, screened, _, _ = run("row_wise")
    monkeypatch.setattr(E, "SCREEN_ELEMENTS", 10)
    stats = SearchStats()
    unscreened = list(generate(graph, SearchConfig(max_block_ops=4, workers=1), stats))
    assert stats.total("unscreened") > 0 and "numerics" not in stats.by_reason("pruned")
    assert {c.key for c in screened} <= {c.key for c in unscreened}


def chain_8192():
    @mdsl.kernel
    def chain(x: Tensor[16, 8192, f16], w1: Tensor[8192, 8192, f16], w2: Tensor[8192, 8192, f16],
              w3: Tensor[8192, 8192, f16]):
        return mdsl.relu(mdsl.silu(x @ w1) @ w2) @ w3 * 2.0
    return chain.graph


@pytest.mark.timeout(120)
def test_the_screen_of_a_large_program_stays_small():
    # at full size, one float64 run of this program takes 1.6 GB for its inputs alone
    graph = chain_8192()
    problem = E._Problem(graph, SearchConfig(workers=1))
    screen = E._Screen(problem, 0)
    tracemalloc.start()
    try:
        for frame in problem.frames:
            instance = screen._instance(frame)
            assert instance is not None and _elements(instance.graph) <= E.SCREEN_ELEMENTS
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20
    for frame in problem.frames:   # every label shrinks; the loop label to a multiple of the frame's range
        inputs = screen.instances[frame].graph.inputs
        for tensor, reduced in zip(graph.inputs, inputs):
            for d, n in enumerate(reduced.shape):
                if problem.labels.label(tensor.name, d) == frame.loop:
                    assert n % frame.forloop == 0 and 2 <= n // frame.forloop <= E.SCREEN_SIZE
                else:
                    assert n == min(tensor.shape[d], E.SCREEN_SIZE)


def test_a_size_that_a_constant_of_the_program_encodes_keeps_its_size_in_the_screen():
    @mdsl.kernel
    def scaled(q: Tensor[4, 64, f32], k: Tensor[64, 128, f32]):
        return mdsl.sum(q @ k * 0.125, dim=1) * (1 / 128)   # 1/√64 and a mean over 128 written as a sum

    graph = scaled.graph
    problem = E._Problem(graph, SearchConfig(workers=1))
    reduced = E._Screen(problem, 0)._reduced(E.Frame())
    assert [v.shape for v in reduced.inputs] == [(4, 64), (64, 128)]

    @mdsl.kernel
    def plain(q: Tensor[4, 64, f32], k: Tensor[64, 128, f32]):
        return mdsl.sum(q @ k * 0.5, dim=1)

    problem = E._Problem(plain.graph, SearchConfig(workers=1))
    assert [v.shape for v in E._Screen(problem, 0)._reduced(E.Frame()).inputs] == [(4, 8), (8, 8)]

"""Partitioning (mdsl.torch.regions.partition): aten graphs (made by make_fx, with example values) in,
mdsl regions (each called as a torch operator named by what it computes) and the reasons for what stays
with torch out; the partitioned module computes what the graph computed."""
from __future__ import annotations

import pytest

from mdsl.search.config import SearchConfig

SEARCH = SearchConfig(budget_s=20.0, work=200, workers=1)


def _partitioned(torch, fn, *inputs):
    from torch.fx.experimental.proxy_tensor import make_fx

    from mdsl.torch.regions import partition

    gm = make_fx(fn)(*inputs)
    expected = fn(*inputs)
    result = partition(gm, SEARCH)
    got = result.module(*inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, (tuple, list)) else (got,)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    return result


def _called(result) -> list:
    return [n.meta["mdsl_region"] for n in result.module.graph.nodes if "mdsl_region" in n.meta]


def test_an_unmapped_operator_splits_a_chain_into_two_regions(torch):
    def fn(x, w):
        h = torch.tanh(torch.nn.functional.silu(x @ w) * 2.0)
        return torch.exp(h) + 1.0

    result = _partitioned(torch, fn, torch.randn(4, 8), torch.randn(8, 16))
    assert [r.aten_ops for r in result.regions] == [["aten.mm.default", "aten.silu.default", "aten.mul.Tensor"],
                                                   ["aten.exp.default", "aten.add.Tensor"]]
    assert list(result.left.values()) == [("aten.tanh.default", "no mapping for aten.tanh.default")]
    assert _called(result) == ["mdsl_region_0", "mdsl_region_1"]
    assert all(str(n.target) != "aten.mm.default" for n in result.module.graph.nodes)


def test_a_graph_that_mdsl_computes_whole_is_one_region(torch):
    def fn(x, w1, w2):
        h = torch.nn.functional.gelu(x @ w1)
        return torch.softmax(h @ w2, dim=-1), h.mean(dim=-1, keepdim=True)

    result = _partitioned(torch, fn, torch.randn(4, 8), torch.randn(8, 16), torch.randn(16, 8))
    (region,) = result.regions
    assert len(region.inputs) == 3 and len(region.outputs) == 2 and result.left == {}
    assert "aten._softmax.default" in region.aten_ops


@pytest.mark.parametrize("fn, reason", [
    (lambda torch, x: torch.exp(x.double()), "float64"),
    (lambda torch, x: torch.exp(x * x.bfloat16()), "different dtypes"),
    (lambda torch, x: torch.exp(x[:, ::2]), "step 2"),
    (lambda torch, x: torch.exp(torch.nn.functional.gelu(x, approximate="tanh")), "approximate='tanh'"),
    (lambda torch, x: torch.exp(x.sum()), "0-dim"),
])
def test_each_node_left_to_torch_says_why(torch, fn, reason):
    result = _partitioned(torch, lambda x: fn(torch, x), torch.randn(4, 8))
    assert any(reason in why for _, why in result.left.values()), result.left


def test_a_region_that_only_moves_data_stays_with_torch(torch):
    result = _partitioned(torch, lambda x: x.t().reshape(2, 16).permute(1, 0), torch.randn(4, 8))
    assert result.regions == () and _called(result) == []


def test_layout_and_slices_around_arithmetic_lower_to_mdsl(torch):
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1) * 0.5 + x.unsqueeze(0).expand(3, -1, -1)[1]

    result = _partitioned(torch, rotate_half, torch.randn(4, 8))
    assert len(result.regions) >= 1 and result.left == {}


def test_regions_alike_trace_to_the_same_program(torch):
    def fn(x, w1, w2):
        a = torch.tanh(torch.relu(x @ w1))
        return torch.tanh(torch.relu(a @ w2))

    result = _partitioned(torch, fn, torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8))
    first, second = result.regions
    assert first.graph().key == second.graph().key
    assert first.op is second.op and _called(result) == ["mdsl_region_0", "mdsl_region_1"]


NO_Z3 = "z3-solver, which the exhaustive generator needs, is not installed"


def _chain(torch):
    return (lambda x, w: torch.relu(x @ w) * 2.0), (torch.randn(4, 32), torch.randn(32, 16))


def test_on_a_gpu_without_a_plan_or_a_search_a_region_is_left_to_torch_at_once(torch, monkeypatch):
    """As on the GPU machine without z3 and a plan cache that lacks the region's plan: the region's
    operators go to torch (Inductor) with the reason, and nothing is searched."""
    from mdsl.search import engine

    monkeypatch.setattr(engine, "has_z3", lambda: False)
    monkeypatch.setattr(engine, "search", lambda *a, **k: pytest.fail("the partition searched"))
    from torch.fx.experimental.proxy_tensor import make_fx

    from mdsl.torch.regions import partition

    fn, inputs = _chain(torch)
    result = partition(make_fx(fn)(*inputs), SEARCH, arch="sm_90a")
    assert not result.regions and not _called(result)
    reasons = {reason for _, reason in result.left.values()}
    assert reasons == {f"the plan cache has no plan for its region, and the search cannot run here ({NO_Z3})"}
    assert {aten for aten, _ in result.left.values()} >= {"aten.mm.default", "aten.relu.default"}
    got = result.module(*inputs)
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, fn(*inputs))


def test_on_a_gpu_without_a_search_a_region_with_a_stored_plan_stays_in_mdsl(torch, monkeypatch):
    import attrs
    from torch.fx.experimental.proxy_tensor import make_fx

    from mdsl.search import engine
    from mdsl.search.cache import PlanCache
    from mdsl.torch.regions import partition

    fn, inputs = _chain(torch)
    (region,) = partition(make_fx(fn)(*inputs), SEARCH).regions
    graph, config = region.graph(), attrs.evolve(SEARCH, arch="sm_90a")
    plan = engine.optimize(graph, config, cache=False, generators=[])   # the traced program, as its own plan
    cache = PlanCache()
    cache.store(cache.key(graph, config, searcher=engine._searcher_identity(None, None)), plan)
    monkeypatch.setattr(engine, "has_z3", lambda: False)
    monkeypatch.setattr(engine, "search", lambda *a, **k: pytest.fail("the partition searched"))
    result = partition(make_fx(fn)(*inputs), SEARCH, arch="sm_90a")
    assert len(result.regions) == 1 and not result.left


def test_the_backend_looks_plans_up_for_the_gpu_its_examples_are_on(torch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mdsl.torch.backend import _gpu_arch

    with FakeTensorMode():
        on_gpu = torch.empty(2, 3, device="cuda")
    assert _gpu_arch([torch.ones(2), on_gpu]) == "sm_90a"   # (no GPU here: the H200's arch)
    assert _gpu_arch([torch.ones(2), 3]) is None

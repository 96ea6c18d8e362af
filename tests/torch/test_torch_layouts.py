"""The layouts of the "mdsl" backend's region results: each keeps the strides of the value it replaces in the
graph (`node.meta["val"]`), since torch's later operators were traced on those and some depend on them (a
view of a transposed result, an operator whose result follows its operand's layout and a view of that):
a transposed result is a view of what the kernel computes in memory order, a transpose that the layout
undoes is not computed, and where the memory order moves a symbolic leading dim inward torch copies the
kernel's row-major result into that layout."""
from __future__ import annotations

import warnings

import pytest

from mdsl.search.config import SearchConfig

SEARCH = SearchConfig(budget_s=20.0, work=200, workers=1, partition=False, exhaustive=False)


def _strides(t) -> list:
    """A tensor's strides where they matter (a dim of size 1 has any stride)."""
    return [s for s, n in zip(t.stride(), t.shape) if n != 1]


def _compile(torch, fn, graphs: list, inductor: bool = True, **kwargs):
    import mdsl.torch

    torch._dynamo.reset()
    return torch.compile(fn, backend=mdsl.torch.compiler(SEARCH, inductor=inductor, on_graph=graphs.append),
                         **kwargs)


@pytest.fixture
def region_results(monkeypatch):
    """(region, its results) of every region call while the test runs."""
    from mdsl.torch.regions import Region

    calls: list = []
    call = Region.__call__

    def recording(self, tensors, sizes=()):
        results = call(self, tensors, sizes)
        calls.append((self, results))
        return results

    monkeypatch.setattr(Region, "__call__", recording)
    return calls


def _transposed_then_viewed(x):
    b, s, h, d = x.shape
    y = (x * 2).transpose(1, 2)   # mdsl's region: a [b, h, s, d] result laid out as x, [b, s, h, d]
    z = y.double()                # torch's (mdsl computes no f64): its result follows y's layout
    return z.transpose(1, 2).view(b, s, h * d)   # a view only that layout allows


def _attention_then_viewed(x):
    import torch

    b, s, h, d = x.shape
    q, k = (x * 2).transpose(1, 2), (x * 3).transpose(1, 2)   # mdsl's region, laid out as x
    # torch's fused attention: its result follows the query's layout (on a GPU too)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, x.transpose(1, 2), is_causal=True)
    return o.transpose(1, 2).view(b, s, h * d).double()   # torch's view (and a cast mdsl leaves)


@pytest.mark.parametrize("fn, ops", [(_transposed_then_viewed, ["mul_scalar"]),
                                     (_attention_then_viewed, ["mul_scalar", "mul_scalar"])])
@pytest.mark.parametrize("inductor", [True, False])
def test_a_transposed_region_result_keeps_its_layout_for_a_later_view(torch, fn, ops, inductor):
    x = torch.randn(2, 8, 4, 16)
    graphs: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _compile(torch, fn, graphs, inductor)(x)
    torch.testing.assert_close(got, fn(x), rtol=1e-6, atol=1e-6)
    assert not [w for w in caught if "Inductor failed" in str(w.message)]
    (graph,) = graphs
    assert graph.handoff.compiler == ("inductor" if inductor else "eager")
    (region,) = graph.regions
    assert all(order == (0, 2, 1, 3) for order in region.layouts)
    # the kernel computes its results in memory order: the transposes that the layout undoes are gone
    assert [n.op for n in region.graph().nodes] == ops


def test_a_qwen3_prefill_without_a_cache_matches_eager_and_its_region_results_keep_their_layouts(
        torch, region_results):
    transformers = pytest.importorskip("transformers", reason="the model comes from transformers")
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    prompt = torch.randint(0, 128, (1, 16))
    graphs: list = []
    with torch.no_grad():
        expected = model(input_ids=prompt, use_cache=False, logits_to_keep=1).logits
        got = _compile(torch, model, graphs, fullgraph=True)(input_ids=prompt, use_cache=False,
                                                             logits_to_keep=1).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    (graph,) = graphs
    assert graph.handoff.compiler == "inductor"
    assert {r for r, _ in region_results} == set(graph.regions)
    for region, results in region_results:
        for out, result in zip(region.outputs, results):
            assert _strides(result) == _strides(out.meta["val"]), (region.name, out.name)
    # the rotary embedding's query is laid out as the projection's [b, s, h, d]: SDPA reads it so
    assert any(order is not None for r in graph.regions for order in r.layouts)


def test_a_layout_that_moves_a_symbolic_leading_dim_inward_is_torch_s_copy(torch, region_results):
    def fn(x):
        return torch.nn.functional.silu(x * 2)   # the result follows x's layout: its batch dim innermost but one

    graphs: list = []
    compiled = _compile(torch, fn, graphs)
    with torch.no_grad():
        for k, batch in enumerate((3, 5)):
            x = torch.randn(8, batch, 16).transpose(0, 1)   # [batch, 8, 16], laid out as [8, batch, 16]
            if k == 0:
                torch._dynamo.mark_dynamic(x, 0)
            got, expected = compiled(x), fn(x)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            assert got.stride() == expected.stride()
    (graph,) = graphs
    (region,) = graph.regions
    assert not isinstance(region.outputs[0].meta["val"].shape[0], int)   # the batch is symbolic
    assert region.layouts == ((1, 0, 2),) and region.kernel_layouts == (None,)
    assert [n.op for n in region.graph().nodes][-1] != "transpose"   # the kernel's result is row-major
    assert [r.stride() for _, (r,) in region_results] == [(16, 48, 1), (16, 80, 1)]

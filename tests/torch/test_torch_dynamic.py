"""Dynamic shapes under torch.compile(backend="mdsl"): a symbolic leading (batch) dim leaves the regions
in mdsl, each size traced (and on a GPU planned: the plan cache's shape families) at run time, so one
compiled graph serves every batch size; a symbolic dim elsewhere leaves the node to torch, which says so."""
from __future__ import annotations

import pytest

from mdsl.search.config import SearchConfig

SEARCH = SearchConfig(budget_s=20.0, work=200, workers=1, partition=False, exhaustive=False)


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def _run_sizes(torch, model, sizes, make_input, *, mark=False, **kwargs):
    """Compile `model` once and call it at each size; returns the graphs the backend compiled."""
    import mdsl.torch

    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(model, backend=mdsl.torch.compiler(SEARCH, on_graph=graphs.append))
    with torch.no_grad():
        for k, size in enumerate(sizes):
            x = make_input(size)
            if mark and k == 0:
                torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(_first(compiled(x, **kwargs)), _first(model(x, **kwargs)),
                                       rtol=1e-4, atol=1e-4)
    return graphs


def _leading_sizes(region) -> set:
    return {key[0] for key in region.calls}


def test_an_mlp_under_default_dynamic_shapes_serves_every_batch_size_from_one_graph(torch):
    from tests.torch.models import MLP

    torch.manual_seed(0)
    sizes = [2, 3, 5, 8, 16, 33, 64]
    # the first size compiles a static graph, the second a dynamic one (torch's automatic dynamic shapes);
    # every later size runs that graph
    graphs = _run_sizes(torch, MLP(dim=32, hidden=64, act=torch.nn.SiLU).eval(), sizes, lambda m: torch.randn(m, 32))
    static, dynamic = graphs
    (region,) = dynamic.regions
    assert any(not isinstance(a.meta["val"].shape[0], int) for a in region.inputs)   # the batch is symbolic
    assert _leading_sizes(region) == set(sizes[1:]) and all(n == 1 for n in region.calls.values())
    assert not region.replays and dynamic.left == {}


def test_a_llama_decoder_layer_serves_batch_sizes_1_to_64_from_one_graph(torch):
    import torch.fx.experimental._config as fx_config

    transformers = pytest.importorskip("transformers", reason="the decoder layer comes from transformers")
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=32, num_hidden_layers=1, vocab_size=128)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = modeling_llama.LlamaDecoderLayer(config, 0).eval()
    position_embeddings = modeling_llama.LlamaRotaryEmbedding(config)(torch.randn(1, 8, 64), torch.arange(8)[None])
    sizes = [4, 1, 2, 7, 64]
    # the batch dim marked dynamic from the start; size-oblivious sizes keep torch from specialising 1
    with fx_config.patch(backed_size_oblivious=True):
        (graph,) = _run_sizes(torch, layer, sizes, lambda b: torch.randn(b, 8, 64), mark=True,
                              position_embeddings=position_embeddings, attention_mask=None)
    assert len(graph.regions) == 2 and graph.handoff.compiler == "inductor"   # torch's fused attention
    for region in graph.regions:
        assert region.sizes, "the region reads the symbolic batch size (its views' sizes)"
        assert _leading_sizes(region) == set(sizes) and not region.replays


def test_a_node_with_a_symbolic_dim_other_than_the_leading_one_stays_with_torch_and_says_why(torch):
    import mdsl.torch

    def fn(x, w):
        return torch.nn.functional.silu(x.transpose(0, 1) @ w)

    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(fn, backend=mdsl.torch.compiler(SEARCH, inductor=False, on_graph=graphs.append))
    w = torch.randn(4, 8)
    for n in (3, 5):   # the second size makes dim 1 of x, the rows of the product, symbolic
        x = torch.randn(4, n)
        torch.testing.assert_close(compiled(x, w), fn(x, w), rtol=1e-5, atol=1e-5)
    # the transpose reads x of shape [4, s]: torch's; the product's rows are its leading dim: mdsl's
    assert [(aten, "only a symbolic leading dim" in why) for aten, why in graphs[-1].left.values()] == \
        [("aten.transpose.int", True)]
    (region,) = graphs[-1].regions
    assert region.aten_ops == ["aten.mm.default", "aten.silu.default"] and _leading_sizes(region) == {5}

"""torch.compile(model, backend="mdsl") on CPU tensors (regions through the reference interpreter, the
rest compiled by Inductor to C++): the transformers Llama and Qwen3 decoder layers with tiny configs and
random weights, and hand-written MLP and attention blocks, match eager; `mdsl.torch.explain` lists their
regions, plans, what torch keeps and what compiled it."""
from __future__ import annotations

import attrs
import pytest

from mdsl.search.config import SearchConfig

#: a search small enough for the suite: the plans it finds are still verified ones
SEARCH = SearchConfig(budget_s=20.0, work=200, workers=1, partition=False, exhaustive=False)


def _compare(torch, model, *inputs, rtol=1e-4, atol=1e-4, **kwargs):
    import mdsl.torch

    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(*inputs, **kwargs)
        got = torch.compile(model, backend=mdsl.torch.compiler(SEARCH))(*inputs, **kwargs)
    expected = expected[0] if isinstance(expected, tuple) else expected
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("act", ["GELU", "SiLU", "ReLU", "Sigmoid"])
def test_an_mlp_block_matches_eager(torch, act):
    from tests.torch.models import MLP

    torch.manual_seed(0)
    _compare(torch, MLP(act=getattr(torch.nn, act)).eval(), torch.randn(2, 8, 64))


def test_an_attention_block_matches_eager_and_torch_keeps_its_layer_norm(torch):
    import mdsl.torch
    from tests.torch.models import Attention

    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 8, 64)
    _compare(torch, model, x)
    report = mdsl.torch.explain(model, x, search=SEARCH)
    assert report.regions and any("aten._softmax.default" in r.aten_ops for r in report.regions)
    assert any(o.aten == "aten.native_layer_norm.default" for o in report.left_to_torch)
    (handoff,) = report.handoffs   # the layer norm is Inductor's, around mdsl's regions
    assert handoff.compiler == "inductor" and handoff.ops >= 1 and "Inductor compiled" in str(report)


def test_where_inductor_fails_the_rest_runs_eagerly_and_explain_says_why(torch, monkeypatch):
    import torch._inductor.compile_fx as inductor

    import mdsl.torch
    from tests.torch.models import Attention

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(inductor, "compile_fx", broken)
    torch.manual_seed(0)
    model, x = Attention().eval(), torch.randn(2, 8, 64)
    with pytest.warns(UserWarning, match="Inductor failed"):
        _compare(torch, model, x)
        report = mdsl.torch.explain(model, x, search=SEARCH)
    (handoff,) = report.handoffs
    assert handoff.compiler == "eager" and "RuntimeError: no C++ compiler" in handoff.reason
    assert "run as torch's eager operators: Inductor failed" in str(report)
    off = mdsl.torch.explain(model, x, search=SEARCH, inductor=False)
    assert off.handoffs[0].compiler == "eager" and "inductor=False" in off.handoffs[0].reason


def test_explain_names_a_region_without_a_plan_where_the_search_cannot_run(torch, monkeypatch):
    import mdsl.torch
    from mdsl.search import engine
    from tests.torch.models import MLP

    monkeypatch.setattr(engine, "has_z3", lambda: False)
    monkeypatch.setattr(engine, "search", lambda *a, **k: pytest.fail("explain searched"))
    torch.manual_seed(0)
    report = mdsl.torch.explain(MLP(act=torch.nn.GELU).eval(), torch.randn(2, 8, 64),
                                search=attrs.evolve(SEARCH, exhaustive=True))   # (the one generator that needs z3)
    assert report.regions and all(r.no_plan and r.kernels_after == r.kernels_before for r in report.regions)
    assert "plan: none (kernel mdsl_region: the plan cache" in str(report)
    assert "the search cannot run here: z3-solver, which the exhaustive generator needs, is not installed)" in str(report)


def test_a_bf16_mlp_matches_eager_within_bf16_tolerance(torch):
    from tests.torch.models import MLP

    torch.manual_seed(0)
    _compare(torch, MLP(act=torch.nn.SiLU).eval().to(torch.bfloat16), torch.randn(2, 8, 64, dtype=torch.bfloat16),
             rtol=3e-2, atol=3e-2)


def test_with_gradients_the_forward_runs_in_mdsl_and_inductor_and_the_backward_in_torch(torch):
    import mdsl.torch
    from tests.torch.models import Attention

    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 8, 64)
    torch._dynamo.reset()
    expected = model(x).sum()
    expected.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = torch.compile(model, backend=mdsl.torch.compiler(SEARCH))(x).sum()
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-4)


def _decoder_layer(torch, family: str, attention: str):
    transformers = pytest.importorskip("transformers", reason="the decoder layers come from transformers")
    module = getattr(transformers.models, family.lower())
    modeling = getattr(module, f"modeling_{family.lower()}")
    config = getattr(transformers, f"{family}Config")(
        hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_hidden_layers=1, vocab_size=128, max_position_embeddings=64)
    config._attn_implementation = attention
    torch.manual_seed(0)
    layer = getattr(modeling, f"{family}DecoderLayer")(config, 0).eval()
    rope = getattr(modeling, f"{family}RotaryEmbedding")(config)
    x = torch.randn(1, 8, 64)
    return layer, x, rope(x, torch.arange(8)[None])


@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_transformers_decoder_layers_match_eager_and_explain_lists_their_regions(torch, family, attention):
    import mdsl.torch

    layer, x, position_embeddings = _decoder_layer(torch, family, attention)
    _compare(torch, layer, x, position_embeddings=position_embeddings, attention_mask=None)
    report = mdsl.torch.explain(layer, x, position_embeddings=position_embeddings, attention_mask=None,
                                search=SEARCH)
    ops = [op for r in report.regions for op in r.aten_ops]
    assert {"aten.mm.default", "aten.rsqrt.default", "aten.silu.default", "aten.cat.default"} <= set(ops)
    assert all(r.kernels_after <= r.kernels_before for r in report.regions)
    text = str(report)
    assert "mdsl_region_0" in text and "plan:" in text
    if attention == "eager":   # the whole layer, attention included, is mdsl's: nothing for Inductor
        assert "aten._softmax.default" in ops and report.left_to_torch == ()
        assert report.handoffs[0].compiler == "eager" and "whole graph" in report.handoffs[0].reason
    else:                      # torch's fused attention stays with torch (Inductor), and says so
        assert len(report.regions) == 2
        assert [o.aten for o in report.left_to_torch] == ["aten._scaled_dot_product_flash_attention_for_cpu.default"]
        assert "no mapping for" in text and report.handoffs[0].compiler == "inductor"

"""mdsl inside PyTorch on a GPU: a kernel as a torch custom operator called on CUDA tensors, captured in a
torch.cuda.graph and replayed on new data, and on a side stream of torch's; torch.compile(backend="mdsl")
on a hand-written MLP and a transformers Llama decoder layer (tiny, random weights) on CUDA tensors,
compared with eager, one compiled graph of the MLP serving batch sizes 1 to 64, and a tiny transformers
Qwen3's decode steps on a static KV cache replaying the backend's CUDA graph, new tokens each step."""
from __future__ import annotations

import pytest

import mdsl
from mdsl.search.config import SearchConfig

pytestmark = [pytest.mark.gpu, pytest.mark.shared_compile_cache]

# the GPU machine has no z3, which only the exhaustive generator needs: the search runs the others
SEARCH = SearchConfig(budget_s=30.0, work=500, exhaustive=False)


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch", reason="mdsl.torch needs PyTorch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device (a CPU build of torch)")
    return torch


@mdsl.kernel
def norm_matmul(x, w):
    return mdsl.rms_norm(x) @ w


def _reference(torch, x, w):
    return (torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=1e-6) @ w.float()).to(x.dtype)


def test_a_custom_op_runs_on_torchs_current_stream(torch):
    import mdsl.torch

    op = mdsl.torch.custom_op(norm_matmul)
    x = torch.randn(16, 256, device="cuda", dtype=torch.float16)
    w = torch.randn(256, 128, device="cuda", dtype=torch.float16) / 16
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = op(x, w)
    torch.cuda.current_stream().wait_stream(side)
    assert out.is_cuda and out.dtype == torch.float16
    torch.testing.assert_close(out, _reference(torch, x, w), rtol=2e-2, atol=2e-2)


def test_a_custom_op_replays_correctly_in_a_captured_cuda_graph(torch):
    import mdsl.torch

    op = mdsl.torch.custom_op(norm_matmul)
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16) / 16
    side = torch.cuda.Stream()   # warm-up (compile, load) outside the capture, as torch's docs ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, w)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _reference(torch, x, w), rtol=3e-2, atol=3e-2)


def test_a_compiled_custom_op_is_one_graph_under_fullgraph(torch):
    import mdsl.torch

    op = mdsl.torch.custom_op(norm_matmul)
    compiled = torch.compile(lambda x, w: torch.relu(op(x, w)), backend="inductor", fullgraph=True)
    x = torch.randn(16, 256, device="cuda", dtype=torch.float16)
    w = torch.randn(256, 128, device="cuda", dtype=torch.float16) / 16
    torch.testing.assert_close(compiled(x, w), torch.relu(_reference(torch, x, w)), rtol=2e-2, atol=2e-2)


def _compare(torch, model, *inputs, tolerance, **kwargs):
    import mdsl.torch

    torch._dynamo.reset()
    graphs: list = []
    with torch.no_grad():
        expected = model(*inputs, **kwargs)
        got = torch.compile(model, backend=mdsl.torch.compiler(SEARCH, on_graph=graphs.append))(*inputs, **kwargs)
    assert graphs and all(g.regions for g in graphs), "a graph without an mdsl region"
    expected = expected[0] if isinstance(expected, tuple) else expected
    got = got[0] if isinstance(got, tuple) else got
    assert got.is_cuda and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_the_backend_runs_an_mlp_on_cuda_tensors(torch, dtype_name):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256))
    model = model.eval().to("cuda", dtype)
    _compare(torch, model, torch.randn(4, 16, 256, device="cuda", dtype=dtype), tolerance=3e-2)


def test_the_backend_runs_a_llama_decoder_layer_on_cuda_tensors(torch):
    transformers = pytest.importorskip("transformers", reason="the decoder layer comes from transformers")
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64, num_hidden_layers=1, vocab_size=128)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = modeling_llama.LlamaDecoderLayer(config, 0).eval().to("cuda", torch.bfloat16)
    rope = modeling_llama.LlamaRotaryEmbedding(config).to("cuda")
    x = torch.randn(1, 32, 256, device="cuda", dtype=torch.bfloat16)
    position_embeddings = tuple(t.to(torch.bfloat16) for t in rope(x, torch.arange(32, device="cuda")[None]))
    _compare(torch, layer, x, position_embeddings=position_embeddings, attention_mask=None, tolerance=5e-2)


def test_one_compiled_graph_serves_every_batch_size_on_cuda_tensors(torch):
    import torch.fx.experimental._config as fx_config

    import mdsl.torch

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256))
    model = model.eval().to("cuda", torch.float16)
    graphs: list = []
    compiled = torch.compile(model, backend=mdsl.torch.compiler(SEARCH, on_graph=graphs.append))
    sizes = [16, 1, 2, 8, 64]
    # the batch dim marked dynamic from the start; size-oblivious sizes keep torch from specialising 1
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        for k, m in enumerate(sizes):
            x = torch.randn(m, 256, device="cuda", dtype=torch.float16)
            if k == 0:
                torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), rtol=3e-2, atol=3e-2)
    (graph,) = graphs
    (region,) = graph.regions
    assert {key[0] for key in region.calls} == set(sizes) and not region.replays


def test_a_qwen3_decode_step_replays_a_cuda_graph_and_matches_eager_step_after_step(torch, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="the model comes from transformers")
    import mdsl.torch

    config = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: (replays.append(graph), replay(graph))[1])
    caches = [transformers.StaticCache(config=config, max_cache_len=32) for _ in range(2)]
    graphs: list = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=mdsl.torch.compiler(SEARCH, on_graph=graphs.append), fullgraph=True)
    kept = []
    with torch.no_grad():
        prompt = torch.randint(0, 256, (1, 16), device="cuda")
        for cache in caches:   # the same context in both caches, filled eagerly
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        for step in range(6):   # a new token each step: the graph's copy of the input changes
            token = torch.randint(0, 256, (1, 1), device="cuda")
            want = model(input_ids=token, past_key_values=caches[0], use_cache=True).logits
            got = compiled(input_ids=token, past_key_values=caches[1], use_cache=True).logits
            torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
            kept.append((got, want))
        for got, want in kept:   # a later replay leaves the results of earlier steps as they were
            torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
        for eager, ours in zip(caches[0].layers, caches[1].layers):   # the graph wrote the cache in place
            assert int(ours.cumulative_length) == int(eager.cumulative_length) == 22
            torch.testing.assert_close(ours.keys, eager.keys, rtol=5e-2, atol=5e-2)
            torch.testing.assert_close(ours.values, eager.values, rtol=5e-2, atol=5e-2)
    (graph,) = graphs
    assert graph.handoff.cuda_graph == "its calls replay a CUDA graph"
    assert len(replays) == 4   # steps 3 to 6 (the first compiles, the second warms the graph's stream)

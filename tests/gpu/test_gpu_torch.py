"""mdsl inside PyTorch on a GPU: a kernel as a torch custom operator called on CUDA tensors, captured in a
torch.cuda.graph and replayed on new data, and on a side stream of torch's; torch.compile(backend="mdsl")
on a hand-written MLP and a transformers Llama decoder layer (tiny, random weights) on CUDA tensors,
compared with eager, and one compiled graph of the MLP serving batch sizes 1 to 64."""
from __future__ import annotations

import pytest

import mdsl
from mdsl.search.config import SearchConfig

pytestmark = [pytest.mark.gpu, pytest.mark.shared_compile_cache]

SEARCH = SearchConfig(budget_s=30.0, work=500)


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
    with torch.no_grad():
        expected = model(*inputs, **kwargs)
        got = torch.compile(model, backend=mdsl.torch.compiler(SEARCH))(*inputs, **kwargs)
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

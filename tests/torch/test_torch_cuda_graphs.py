"""The "mdsl" backend's CUDA graphs, what of them runs without a GPU: which graphs may replay one (static
CUDA inputs, writes only to static ones), the inputs a graph writes, the calls of `GraphedForward` with
the capture simulated on the CPU (each call computes once, inputs copied or read in place, a moved static
input captured again, results kept from earlier calls unchanged, a failed capture said and run uncaptured),
and a transformers Qwen3 decode step on a static KV cache, whose writes the inference graph keeps, matching
eager step after step on CPU tensors. The CUDA capture itself is tests/gpu/test_gpu_torch.py's."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch", reason="mdsl.torch needs PyTorch (the test extra installs its CPU build)")


@pytest.fixture(scope="module")
def cuda_graphs(torch):
    import mdsl.torch.cuda_graphs

    return mdsl.torch.cuda_graphs


def _fake_cuda(torch, *shapes):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return [torch.empty(shape, device="cuda") for shape in shapes]


def test_a_graph_replays_only_where_a_replay_computes_what_a_call_does(torch, cuda_graphs):
    x, w, cache = _fake_cuda(torch, (1, 8), (8, 8), (4, 8))
    assert cuda_graphs.graph_problem([x, w, cache], static=[1, 2], mutated=[2]) is None
    assert cuda_graphs.graph_problem([x, w, cache], static=[1], mutated=[2]) == \
        "the graph writes input(s) [2], whose addresses are not static"
    assert cuda_graphs.graph_problem([x, torch.zeros(2)], static=[], mutated=[]) == "input 1 is on cpu"
    assert cuda_graphs.graph_problem([x, 3], static=[], mutated=[]) == "input 1 is a int, not a tensor"
    assert cuda_graphs.graph_problem([], static=[], mutated=[]) == "the graph has no inputs"
    fn = object()
    wrapped, note = cuda_graphs.graphed(fn, [x, w, cache], static=[1, 2], mutated=[2])
    assert isinstance(wrapped, cuda_graphs.GraphedForward) and wrapped.static == {1, 2}
    assert note == "its calls replay a CUDA graph"
    assert cuda_graphs.graphed(fn, [x, w, cache], static=[1], mutated=[2]) == \
        (fn, "no CUDA graph: the graph writes input(s) [2], whose addresses are not static")
    assert cuda_graphs.graphed(fn, [torch.zeros(2)], static=[], mutated=[]) == (fn, "")   # CPU: nothing to say


def test_the_inputs_a_graph_writes_are_its_copy_targets(torch, cuda_graphs):
    graph = torch.fx.Graph()
    x, cache, position = (graph.placeholder(name) for name in ("x", "cache", "position"))
    total = graph.call_function(torch.ops.aten.add.Tensor, (x, position))
    graph.call_function(torch.ops.aten.copy_.default, (cache, total))
    graph.call_function(torch.ops.aten.add_.Tensor, (position, 1))
    graph.output(total)
    assert cuda_graphs.mutated_inputs(graph) == [1, 2]


class _Replay:
    """What a CUDA graph's replay does, on the CPU: the captured function run again on the captured
    inputs, its results written into the captured outputs."""

    def __init__(self, fn, inputs, outputs):
        self.fn, self.inputs, self.outputs = fn, inputs, outputs

    def replay(self):
        for out, new in zip(self.outputs, self.fn(list(self.inputs))):
            out.copy_(new)


def _simulated(cuda_graphs, fail: bool = False):
    class Simulated(cuda_graphs.GraphedForward):
        captures = 0

        def _capturing(self):
            return False

        def _call_on_graph_stream(self, args):
            return self.fn(args)

        def _capture(self, inputs):   # a capture computes nothing: the outputs come from copies of the inputs
            if fail:
                raise RuntimeError("operation not permitted when stream is capturing\nmore")
            self.captures += 1
            outputs = self.fn([x.clone() for x in inputs])
            return _Replay(self.fn, inputs, outputs), outputs

    return Simulated


def _step(torch):
    """A compiled step's stand-in: reads x (copied) and w (static), advances a position it writes (static),
    and returns a tensor and a view into it at an offset."""
    def fn(args):
        x, w, position = args
        position.add_(1)
        y = x @ w + position
        both = torch.cat([y, 2 * y])
        return [both, both[1:]]
    return fn


def test_each_call_computes_once_and_keeps_its_results(torch, cuda_graphs):
    fn = _step(torch)
    w, position = torch.randn(4, 4), torch.zeros(())
    graphed = _simulated(cuda_graphs)(fn, static=[1, 2], device=None)
    kept = []
    for call in range(1, 7):
        x = torch.randn(1, 4)
        want = x @ w + call
        both, view = graphed([x, w, position])
        assert float(position) == call   # the write happened once per call
        torch.testing.assert_close(both, torch.cat([want, 2 * want]))
        torch.testing.assert_close(view, 2 * want)
        assert view.storage_offset() == both.storage_offset() + 4   # the view keeps its offset ...
        assert view.untyped_storage().data_ptr() == both.untyped_storage().data_ptr()   # ... and its base
        kept.append((both, want))
    assert graphed.captures == 1 and sorted(graphed.buffers) == [0]
    for both, want in kept:   # a later replay does not overwrite an earlier call's results
        torch.testing.assert_close(both[:1], want)


def test_a_static_input_that_moved_is_captured_again(torch, cuda_graphs):
    graphed = _simulated(cuda_graphs)(_step(torch), static=[1, 2], device=None)
    x, position = torch.randn(1, 4), torch.zeros(())
    first, second = torch.randn(4, 4), torch.randn(4, 4)
    for w, captures in ((first, 0), (first, 0), (first, 1), (second, 2), (second, 2), (first, 3)):
        both, _ = graphed([x, w, position])
        torch.testing.assert_close(both[:1], x @ w + float(position))
        assert graphed.captures == captures


def test_a_failed_capture_is_said_and_the_calls_run_uncaptured(torch, cuda_graphs):
    graphed = _simulated(cuda_graphs, fail=True)(_step(torch), static=[1, 2], device=None)
    x, w, position = torch.randn(1, 4), torch.randn(4, 4), torch.zeros(())
    graphed([x, w, position])
    graphed([x, w, position])
    with pytest.warns(UserWarning, match="capturing the compiled graph into a CUDA graph failed .RuntimeError: "
                                         "operation not permitted when stream is capturing.; its calls run "
                                         "uncaptured"):
        both, _ = graphed([x, w, position])
    torch.testing.assert_close(both[:1], x @ w + 3)
    both, _ = graphed([x, w, position])
    torch.testing.assert_close(both[:1], x @ w + 4)
    assert graphed.problem.startswith("RuntimeError") and graphed.graph is None


def test_a_static_cache_decode_step_writes_the_cache_as_eager_does(torch):
    transformers = pytest.importorskip("transformers", reason="the model comes from transformers")
    import mdsl.torch
    from mdsl.search.config import SearchConfig

    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval().to(torch.bfloat16)
    prompt = torch.randint(0, 128, (1, 12))
    caches = [transformers.StaticCache(config=config, max_cache_len=20) for _ in range(2)]
    graphs: list = []
    search = SearchConfig(budget_s=20.0, work=200, workers=1, partition=False, exhaustive=False)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=mdsl.torch.compiler(search, inductor=False, on_graph=graphs.append),
                             fullgraph=True)
    with torch.no_grad():
        for cache in caches:
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        for step in range(4):
            token = torch.randint(0, 128, (1, 1))
            want = model(input_ids=token, past_key_values=caches[0], use_cache=True).logits
            got = compiled(input_ids=token, past_key_values=caches[1], use_cache=True).logits
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            for eager, ours in zip(caches[0].layers, caches[1].layers):
                assert int(ours.cumulative_length) == int(eager.cumulative_length) == 13 + step
                torch.testing.assert_close(ours.keys, eager.keys, rtol=2e-2, atol=2e-2)
                torch.testing.assert_close(ours.values, eager.values, rtol=2e-2, atol=2e-2)
    (graph,) = graphs
    assert graph.regions and graph.handoff.cuda_graph == ""   # CPU tensors: no CUDA graph, nothing said
    assert any(target == "aten.copy_.default" for target, _ in graph.left.values())   # the cache's writes

"""Streamed accumulation (mdsl.lowering.streamed, written by mdsl.backend.cuda.streamed), without a GPU: which
loops fold their inputs straight from device memory, the code (no shared-memory copies, no barrier inside the
fold), the switch. The GPU tests run these programs against the reference (tests/gpu/test_gpu_fast_paths.py
and the guided plans of the attention examples)."""
from __future__ import annotations

from mdsl.backend.cuda import emit_cuda
from mdsl.lowering.block import lower
from mdsl.lowering.options import CudaOptions
from tests.backend.cuda.fast_paths import fast_path_graphs
from tests.backend.cuda.programs import guided_plan


def _lowered(graph, k: int = 0, options=None):
    node = graph.custom_nodes()[k]
    return node.body, lower(node.body, tuple(v.type for v in node.inputs), options)


def test_a_split_combine_folds_from_device_memory():
    bg, lowered = _lowered(fast_path_graphs()["split_combine_f16"])
    assert [bg.nodes[i].op for i in lowered.streamed] == ["accum_max", "accum_rescale", "accum"]
    placed = {t.name for t in lowered.memory.lifetimes}
    assert not placed & {i.var.name for i in bg.inputs}   # no tile for what is read from device memory
    assert lowered.memory.stages == 1
    source = emit_cuda(fast_path_graphs()["split_combine_f16"]).source
    kernel = source[source.index("split_combine_f16_add("):]
    assert "copy_async" not in kernel
    fold = kernel[kernel.index("streamed:"):kernel.index("__syncthreads()")]
    assert fold.count("for (int it = 0; it < 5; ++it)") == 3


def test_the_attention_combine_is_streamed_and_the_attention_is_not():
    graph = guided_plan("gqa.gqa")
    assert _lowered(graph, 0)[1].streamed is None
    assert _lowered(graph, 1)[1].streamed is not None


def test_switched_off_it_loops_through_shared_memory(monkeypatch):
    graph = fast_path_graphs()["split_combine_f16"]
    assert _lowered(graph, options=CudaOptions(stream=False))[1].streamed is None
    monkeypatch.setenv("MDSL_CUDA_STREAM", "0")
    assert "streamed:" not in emit_cuda(graph).source
    assert CudaOptions.from_env({"MDSL_CUDA_STREAM": "0"}) == CudaOptions(stream=False)

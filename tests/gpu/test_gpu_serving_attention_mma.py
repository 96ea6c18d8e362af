"""The GPU serving device's tensor-core attention (mdsl/serving/attention_mma.cuh) at the head dims and query
heads per KV head of real models, over 16-bit pools: a request's logits agree with the CPU device's (the
reference) within the pool's rounding, and are the same bits whatever its chunking, whatever shares its steps
and alone; sliding windows and Gemma-2's soft-capping included."""
from __future__ import annotations

import numpy as np
import pytest

from mdsl import LLM, SamplingParams
from mdsl.gpu import has_gpu
from tests.gpu.test_gpu_serving import agree, chunked_runs, same_bits_alone, served
from tests.serving.conftest import arrivals_of, random_prompts, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="no GPU")]

#: (architecture, head dim, query heads, KV heads, sliding window): the tensor-core tile's M rows over 1, 4,
#: 8 and 16 query heads a KV head, dims of 64 and 128 and one short of a k16 step (24: 8 dims of zeros)
SHAPES = [("qwen3", 128, 8, 2, None), ("llama3", 64, 16, 2, None), ("qwen2", 24, 4, 4, None),
          ("mistral", 128, 16, 1, 150), ("gemma2", 64, 8, 2, 150)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch, head_dim, heads, kv_heads, window", SHAPES)
def test_tensor_core_attention_agrees_and_keeps_a_requests_bits(tmp_path, arch, head_dim, heads, kv_heads, window,
                                                                dtype):
    extra = {} if window is None else {"sliding_window": window}
    ckpt = write_checkpoint(tmp_path, arch, positions=320, torch_dtype=dtype, head_dim=head_dim,
                            num_attention_heads=heads, num_key_value_heads=kv_heads, **extra)
    rng = np.random.default_rng(21)
    prompts = random_prompts(rng, 8, 1, 300)
    params = [SamplingParams(max_new_tokens=int(n)) for n in rng.integers(8, 17, 8)]
    runs = chunked_runs(ckpt.folder, prompts, params, 30, 12)
    cpu = served(ckpt.folder, "cpu", arrivals_of(np.random.default_rng(30), prompts, params, 12), max_batch=8,
                 page_size=16)
    agree(runs[256], cpu, prompts, "bfloat16")   # (float16's rounding is the finer)
    with LLM(ckpt.folder, device="gpu", max_batch=1, page_size=16) as llm:
        assert llm.device.attention_work, "the tensor-core attention is not in use"
    same_bits_alone(ckpt.folder, prompts, params, runs, (0, 3, 6))

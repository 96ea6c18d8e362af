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


def test_a_tile_folding_its_own_splits_gives_the_bits_of_their_partials_folded(tmp_path, monkeypatch):
    """A prompt chunk's tile whose one item holds all its splits folds them as they end and writes its rows'
    output (attention_mma's whole item: every shared tile's on a grid of one block); the same splits written
    as partials and folded by attention_fold (the GPU's grid: items of one split) give the same bits."""
    from mdsl.serving import gpu

    ckpt = write_checkpoint(tmp_path, "qwen3", positions=1100, torch_dtype="bfloat16", head_dim=128,
                            num_attention_heads=8, num_key_value_heads=2)
    rng = np.random.default_rng(8)
    prompts = random_prompts(rng, 3, 700, 1000)
    params = [SamplingParams(max_new_tokens=4)] * 3
    arrivals = {0: [(i, p, params[i]) for i, p in enumerate(prompts)]}
    splits = {True: 0, False: 0}   # the most splits of a tile folded in its item, and of one left to the fold
    step_items = gpu.step_items

    def recorded(*args):
        items, alone, done = step_items(*args)
        for first, size, s0, s1 in items[alone:].tolist():
            whole = bool(done[first])
            assert (s0 == 0) >= whole and done[first:first + size].tolist() == [whole] * size
            splits[whole] = max(splits[whole], s1)
        return items, alone, done

    monkeypatch.setattr(gpu, "step_items", recorded)
    whole = served(ckpt.folder, "gpu", arrivals, attention_grid=1, max_batch=3, page_size=16)
    assert splits[True] > 1
    splits[False] = 0
    parts = served(ckpt.folder, "gpu", arrivals, max_batch=3, page_size=16)
    assert splits[False] > 1
    for i in range(len(prompts)):
        assert whole[0][i].token_ids == parts[0][i].token_ids, i
        assert sorted(whole[1][i]) == sorted(parts[1][i])
        for pos, rows in whole[1][i].items():
            assert all(np.array_equal(a, b) for a, b in zip(rows, parts[1][i][pos])), (i, pos)

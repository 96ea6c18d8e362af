"""The serving engine on the architectures besides Llama-3 and Qwen3 whose layer ops have step rules:
Qwen2 (q/k/v biases), Mistral and Phi-3 (sliding-window attention), Gemma-2 (its (1 + weight) norms,
tanh-GELU gate, scaled embeddings, attention with its own query scale, soft-capped scores and logits, a
window on alternate layers), Qwen3-MoE (each row's router picking its own experts) and Qwen2-MoE (its shared
expert beside the routed ones). Requests arriving at random steps, their prompts chunked across steps (so
windows cross chunk boundaries), give the reference's tokens and logits bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from mdsl import LLM, SamplingParams
from tests.serving.conftest import drive, write_checkpoint

VOCAB = 96


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "phi3", "gemma2", "qwen3_moe", "qwen2_moe"])
def test_requests_of_every_architecture_match_the_reference_bit_for_bit(tmp_path, arch):
    ckpt = write_checkpoint(tmp_path, arch, positions=48)
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, int(rng.integers(1, 25)))] for _ in range(10)]
    lengths = [int(n) for n in rng.integers(3, 12, 10)]
    arrivals: dict = {}
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        arrivals.setdefault(int(rng.integers(0, 12)), []).append((i, prompt, SamplingParams(max_new_tokens=n)))
    with LLM(ckpt.folder, max_batch=10, page_size=4, max_tokens_per_step=7) as llm:
        llm.device.record_logits = True
        handles = drive(llm, arrivals)
        outputs = {i: h.result() for i, h in handles.items()}
        logits = {i: llm.device.logits.pop(out.request_id) for i, out in outputs.items()}
        assert llm.stats().peak_running >= 3
    reference = ckpt.reference()
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        generation = reference.generate(prompt, n)
        assert outputs[i].token_ids == generation.tokens
        for pos, row in enumerate(generation.logits):
            assert np.array_equal(logits[i][pos][0], row), (i, pos)

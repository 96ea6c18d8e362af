"""The KV pools hold the checkpoint's dtype's values, as transformers' cache in the model's dtype does: a
16-bit checkpoint's keys and values are rounded (to nearest, ties to even) as they are appended, and its
linears' inputs before their products, on the CPU device as in the reference with that kv_dtype and
operand_dtype, so a request's logits are that reference's bits whatever the chunking and the batch; a byte
budget counts the pools' 16-bit rows."""
from __future__ import annotations

import numpy as np
import pytest

from mdsl import LLM, SamplingParams
from mdsl.ir.dtypes import bf16, f16, f32, round_to_dtype
from mdsl.megakernel.modelgraph.layers import StepContext, get_layer_op
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.serving.cpu import kv_bytes_per_token, kv_dtype
from tests.serving.conftest import arrivals_of, drive, random_prompts, write_checkpoint

DTYPES = {"bfloat16": bf16, "float16": f16}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama3", "gemma2", "qwen3_moe"])
def test_a_16_bit_checkpoints_requests_give_the_bits_of_the_reference_with_its_kv_dtype(tmp_path, arch, dtype):
    ckpt = write_checkpoint(tmp_path, arch, positions=48, torch_dtype=dtype)
    assert kv_dtype(ckpt.graph) is DTYPES[dtype]
    rng = np.random.default_rng(14)
    prompts = random_prompts(rng, 8, 1, 24)
    lengths = [int(n) for n in rng.integers(3, 12, 8)]
    arrivals = arrivals_of(rng, prompts, [SamplingParams(max_new_tokens=n) for n in lengths], 10)
    with LLM(ckpt.folder, max_batch=8, page_size=4, max_tokens_per_step=7) as llm:
        llm.device.record_logits = True
        handles = drive(llm, arrivals)
        outputs = {i: h.result() for i, h in handles.items()}
        logits = {i: llm.device.logits.pop(out.request_id) for i, out in outputs.items()}
        pools = list(llm.device.kv_pools().values())
    assert all(np.array_equal(round_to_dtype(pool, DTYPES[dtype]), pool) for pool in pools)
    assert all(np.count_nonzero(pool) for pool in pools)
    reference = ReferenceModel(ckpt.graph, ckpt.weights, kv_dtype=DTYPES[dtype], operand_dtype=DTYPES[dtype])
    unrounded = [ReferenceModel(ckpt.graph, ckpt.weights),
                 ReferenceModel(ckpt.graph, ckpt.weights, kv_dtype=DTYPES[dtype]),
                 ReferenceModel(ckpt.graph, ckpt.weights, operand_dtype=DTYPES[dtype])]
    differ = 0
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        generation = reference.generate(prompt, n)
        assert outputs[i].token_ids == generation.tokens
        for pos, row in enumerate(generation.logits):
            assert np.array_equal(logits[i][pos][0], row), (i, pos)
        differ += all(not np.array_equal(u.generate(prompt, n).logits, generation.logits) for u in unrounded)
    assert differ == len(prompts)      # (both roundings are there: without either, other bits)


def test_the_reference_rounds_a_linears_input_to_the_operand_dtype():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 24)).astype(np.float32)
    w = round_to_dtype(rng.standard_normal((5, 24)).astype(np.float32), bf16)
    for dtype in (f32, bf16, f16):
        (got,) = get_layer_op("linear").reference([x, w], {}, StepContext(0, operand_dtype=dtype))
        want = round_to_dtype(x, dtype).astype(np.float64) @ w.astype(np.float64).T
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert (dtype is f32) == np.allclose(got, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-6, atol=1e-6)


def test_the_reference_rounds_what_it_caches_to_the_kv_dtype():
    heads = {"q_heads": 2, "kv_heads": 1, "head_dim": 4}
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((1, 16)).astype(np.float32)
    for dtype in (f32, bf16, f16):
        k_cache, v_cache = np.zeros((4, 1, 4), np.float32), np.zeros((4, 1, 4), np.float32)
        get_layer_op("attention").reference([qkv, k_cache, v_cache], heads, StepContext(2, kv_dtype=dtype))
        assert np.array_equal(k_cache[2, 0], round_to_dtype(qkv[0, 8:12], dtype))
        assert np.array_equal(v_cache[2, 0], round_to_dtype(qkv[0, 12:], dtype))
        assert (dtype is f32) == np.array_equal(k_cache[2, 0], qkv[0, 8:12])


def test_a_byte_budget_counts_the_pools_16_bit_rows(tmp_path):
    ckpt = write_checkpoint(tmp_path, "llama3", torch_dtype="bfloat16")
    per_token = 2 * 2 * 2 * 8 * 2       # layers x (k, v) x kv heads x head_dim x bfloat16
    assert kv_bytes_per_token(ckpt.graph) == per_token
    with LLM(ckpt.folder, page_size=4, kv_cache_bytes=per_token * 4 * 10 + 7) as llm:
        assert llm.shape.num_pages == 10


def test_a_mixture_of_experts_rounds_its_products_inputs_to_the_operand_dtype():
    """The router's and each expert's products take their inputs (the row, the expert's hidden row) rounded to the
    operand dtype, as a linear's."""
    rng = np.random.default_rng(5)
    h, e, inter = 24, 4, 8
    x = rng.standard_normal((1, h)).astype(np.float32)
    router = round_to_dtype(rng.standard_normal((e, h)).astype(np.float32), bf16)
    ws = [round_to_dtype(rng.standard_normal(shape).astype(np.float32), bf16)
          for shape in [(inter, h)] * (2 * e) + [(h, inter)] * e]
    attrs = {"top_k": 2, "norm_topk_prob": True}
    for dtype in (f32, bf16):
        ctx = StepContext(0, operand_dtype=dtype)
        (routing,) = get_layer_op("moe_router").reference([x, router], attrs, ctx)
        xr = round_to_dtype(x, dtype).astype(np.float64)
        logits = xr @ router.astype(np.float64).T
        p = np.exp(logits - logits.max())
        assert set(np.flatnonzero(routing)) == set(np.argsort(-p.reshape(-1))[:2])
        (out,) = get_layer_op("moe_experts").reference([x, routing, *ws], {"act": "relu"}, ctx)
        want = np.zeros(h)
        for k in np.flatnonzero(routing):
            hidden = np.maximum(xr @ ws[k].astype(np.float64).T, 0) * (xr @ ws[e + k].astype(np.float64).T)
            want += routing[0, k] * (round_to_dtype(hidden.astype(np.float32), dtype).astype(np.float64) @
                                     ws[2 * e + k].astype(np.float64).T).reshape(-1)
        np.testing.assert_allclose(out.reshape(-1), want, rtol=1e-5, atol=1e-5)

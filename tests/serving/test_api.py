"""The engine's API: parameters checked with MdslErrors, EOS and stop tokens, text prompts through a
checkpoint's tokenizer.json, offline generate, a device failure reaching every request, and logits without a
maximum."""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest

import mdsl
from mdsl import LLM, SamplingParams
from mdsl.errors import MdslError
from mdsl.serving import ServingError
from mdsl.serving.cpu import CpuDevice
from mdsl.serving.protocol import MAX_STOP
from mdsl.serving.sampling import NoMaximum, sample


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.5}, {"temperature": float("nan")}, {"temperature": "hot"}, {"top_p": 0.0}, {"top_p": 1.5},
    {"top_k": -1}, {"top_k": 2.5}, {"seed": -1}, {"seed": 2**64}, {"seed": True}, {"max_new_tokens": 0},
    {"max_new_tokens": 3.0}, {"stop_token_ids": [1, -2]}, {"stop_token_ids": "12"},
    {"stop_token_ids": list(range(MAX_STOP + 1))}, {"ignore_eos": "yes"},
])
def test_bad_sampling_params_raise_mdsl_errors(kwargs):
    with pytest.raises(MdslError) as caught:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)).split("_")[0] in str(caught.value)


def test_the_top_level_exports():
    assert mdsl.LLM is LLM and mdsl.SamplingParams is SamplingParams


@pytest.mark.parametrize("kwargs, error, words", [
    ({"max_batch": 0}, ServingError, "max_batch"), ({"page_size": 0}, ServingError, "page_size"),
    ({"max_seq": 1000}, ServingError, "exceeds"), ({"kv_pages": 0}, ServingError, "kv_pages"),
    ({"kv_pages": 4, "kv_cache_bytes": 10**6}, ServingError, "not both"),
    ({"kv_cache_bytes": 100}, ServingError, "holds no page"), ({"device": "tpu"}, ServingError, "device"),
])
def test_bad_engine_settings_raise_mdsl_errors(checkpoints, kwargs, error, words):
    with pytest.raises(error, match=words):
        LLM(checkpoints["llama3"].folder, **kwargs)


def test_the_pool_is_sized_from_a_byte_budget(checkpoints):
    ckpt = checkpoints["llama3"]
    per_token = 2 * 2 * 2 * 8 * 4       # layers x (k, v) x kv heads x head_dim x float32
    with LLM(ckpt.folder, page_size=4, kv_cache_bytes=per_token * 4 * 10 + 7) as llm:
        assert llm.shape.num_pages == 10
    with LLM(ckpt.folder, max_batch=2, page_size=16, max_seq=40) as llm:
        assert llm.shape.num_pages == 2 * 3    # every batch slot can hold max_seq positions


@pytest.mark.parametrize("prompt, params, words", [
    ([], None, "empty"), ([1, 96], None, "outside the vocabulary"), ([1, True], None, "integers"),
    (b"abc", None, "string or a list"), (3, None, "string or a list"),
    ([1] * 30, SamplingParams(max_new_tokens=40), "positions"),
    ([1] * 10, SamplingParams(max_new_tokens=20), "page pool holds"),
    ([1], SamplingParams(stop_token_ids=[96]), "outside the vocabulary"), ([1], {"max_new_tokens": 3}, "SamplingParams"),
])
def test_bad_requests_raise_mdsl_errors(checkpoints, prompt, params, words):
    with LLM(checkpoints["llama3"].folder, max_batch=2, page_size=4, kv_pages=6, max_seq=64) as llm:
        with pytest.raises(ServingError, match=words):
            llm.submit(prompt, params)
        with pytest.raises(ServingError, match="list of prompts"):
            llm.generate("one prompt")
        with pytest.raises(ServingError, match="2 SamplingParams for 1 prompts"):
            llm.generate([[1]], [SamplingParams(), SamplingParams()])
    with pytest.raises(ServingError, match="closed"):
        llm.submit([1])


def _greedy_with_a_new_token_at(reference, k: int):
    """A prompt whose greedy continuation's k-th token (0-based) appears nowhere before it, and that
    continuation."""
    rng = np.random.default_rng(0)
    for _ in range(100):
        prompt = [int(t) for t in rng.integers(0, 96, 5)]
        tokens = reference.generate(prompt, 10).tokens
        if tokens[k] not in tokens[:k]:
            return prompt, tokens
    raise AssertionError("no such prompt")


def test_eos_from_generation_config_and_stop_tokens_end_a_request(checkpoints, tmp_path):
    ckpt = checkpoints["llama3"]
    prompt, tokens = _greedy_with_a_new_token_at(ckpt.reference(), 3)
    folder = str(tmp_path / "with-eos")
    shutil.copytree(ckpt.folder, folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tokens[3], 95]}, f)
    with LLM(folder, max_batch=4) as llm:
        assert llm.eos_token_ids == (tokens[3], 95)
        stopped, ignored, by_stop_id = llm.generate([prompt] * 3, [
            SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=10, ignore_eos=True),
            SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=[tokens[3]])])
    assert (stopped.token_ids, stopped.finish_reason) == (tokens[:4], "stop")
    assert (ignored.token_ids, ignored.finish_reason) == (tokens, "length")
    assert (by_stop_id.token_ids, by_stop_id.finish_reason) == (tokens[:4], "stop")


def _word_tokenizer(path: str):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(95)}
    vocab["[UNK]"] = 95
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(path)
    return tok


def test_text_prompts_go_through_the_checkpoints_tokenizer(checkpoints, tmp_path):
    ckpt = checkpoints["qwen3"]
    folder = str(tmp_path / "with-tokenizer")
    shutil.copytree(ckpt.folder, folder)
    tok = _word_tokenizer(os.path.join(folder, "tokenizer.json"))
    texts = ["w1 w2 w3 w4", "w50 w7 nonsense w94"]
    with LLM(folder, max_batch=4) as llm:
        by_text = llm.generate(texts, SamplingParams(max_new_tokens=6))
        by_ids = llm.generate([tok.encode(t).ids for t in texts], SamplingParams(max_new_tokens=6))
    for text, out, ids_out in zip(texts, by_text, by_ids):
        assert out.prompt_token_ids == tuple(tok.encode(text).ids) and 95 in by_text[1].prompt_token_ids
        assert out.token_ids == ids_out.token_ids
        assert out.text == ids_out.text == tok.decode(list(out.token_ids)) and out.text


def test_text_prompts_without_a_tokenizer_say_how_to_get_one(checkpoints, monkeypatch):
    with LLM(checkpoints["llama3"].folder, max_batch=2) as llm:
        with pytest.raises(ServingError, match="no tokenizer.json"):
            llm.submit("hello")
        assert llm.submit([1, 2], SamplingParams(max_new_tokens=2)).result().text is None
    monkeypatch.setitem(sys.modules, "tokenizers", None)     # the package is not installed
    with LLM(checkpoints["llama3"].folder, max_batch=2) as llm:
        with pytest.raises(ServingError) as caught:
            llm.submit("hello")
    assert "tokenizers package" in caught.value.message and "mdsl[text]" in caught.value.hint


def test_a_device_failure_reaches_every_request(checkpoints, monkeypatch):
    def broken(self, e, pos, prompt_len):
        raise FloatingPointError("the forward broke")

    monkeypatch.setattr(CpuDevice, "_forward", broken)
    with LLM(checkpoints["llama3"].folder, max_batch=2) as llm:
        handles = [llm.submit([1, 2, 3], SamplingParams(max_new_tokens=4)) for _ in range(4)]
        for h in handles:
            with pytest.raises(ServingError, match="the forward broke"):
                h.result(timeout=60)
            with pytest.raises(ServingError, match="the forward broke"):
                list(h)
        assert llm.stats().status == "failed"


def test_a_nan_logit_never_wins_and_a_row_without_a_maximum_is_an_error():
    """Every device's rule: the first largest logit above -inf, NaN never chosen nor allowed; a row with no
    such logit raises NoMaximum, greedy or sampled."""
    row = np.array([1.0, np.nan, 3.0, 3.0, np.nan, -np.inf], np.float32)
    assert sample(row, temperature=0.0, top_k=0, top_p=1.0, seed=0, position=0) == 2
    for top_k, top_p in ((0, 1.0), (3, 1.0), (0, 0.5)):
        tokens = {sample(row, temperature=0.8, top_k=top_k, top_p=top_p, seed=s, position=7) for s in range(40)}
        assert tokens and tokens <= {0, 2, 3}, (top_k, top_p)
    for bad in (np.full(6, np.nan, np.float32), np.full(6, -np.inf, np.float32)):
        for temperature in (0.0, 0.8):
            with pytest.raises(NoMaximum, match="no maximum"):
                sample(bad, temperature=temperature, top_k=0, top_p=0.9, seed=0, position=0)


def test_nan_weights_fail_every_request_with_no_maximum(checkpoints, tmp_path):
    from mdsl.megakernel.modelgraph.checkpoint import save_checkpoint

    ckpt = checkpoints["llama3"]
    weights = dict(ckpt.weights)
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], np.nan)
    save_checkpoint(str(tmp_path), ckpt.raw, weights)
    with LLM(str(tmp_path), max_batch=2) as llm:
        handles = [llm.submit([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=t)) for t in (0.0, 0.7)]
        for h in handles:
            with pytest.raises(ServingError, match="no maximum"):
                h.result(timeout=60)
        assert llm.stats().status == "failed"


def test_close_cancels_what_is_unfinished_and_stops_the_device(checkpoints):
    llm = LLM(checkpoints["qwen3"].folder, max_batch=2)
    llm.device.hold()
    handles = [llm.submit([1, 2, 3], SamplingParams(max_new_tokens=40)) for _ in range(6)]
    llm.device.step()
    llm.device.step()
    llm.close()
    assert [h.result(timeout=0).finish_reason for h in handles] == ["cancelled"] * 6
    stats = llm.stats()
    assert not llm.device.alive and stats.status == "stopped" and stats.free_pages == stats.num_pages

"""A real `mdsl serve` process through the `openai` client: completions and chat completions, streamed and
not, carry exactly the tokens the engine produces offline for the same prompt and parameters (50
concurrent streams included), stop strings and stop tokens cut the text, and /v1/models, /health and
/metrics answer."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from mdsl import SamplingParams
from tests.server.conftest import API_KEY, EOS, metric_values


@pytest.fixture(scope="module")
def openai():
    # (imported when a test runs, not at collection: the client package takes half a second to import)
    return pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(openai, server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def _reference(offline, prompt, max_tokens, **settings):
    return offline.generate([prompt], SamplingParams(max_new_tokens=max_tokens, **settings))[0]


def _streamed(stream):
    """(token ids, text, finish reason) of a streamed completion, checking that no chunk holds two tokens."""
    tokens, texts, reasons = [], [], []
    for chunk in stream:
        (choice,) = chunk.choices
        assert len(choice.token_ids) <= 1
        tokens += choice.token_ids
        texts.append(choice.text if hasattr(choice, "text") else (choice.delta.content or ""))
        reasons.append(choice.finish_reason)
    assert reasons[-1] is not None and not any(reasons[:-1])
    return tokens, "".join(texts), reasons[-1]


def test_completions_streamed_and_not_carry_the_engines_tokens(client, offline):
    prompt = "w3 w14 w15 w92 w65"
    ref = _reference(offline, offline.tokenizer.encode(prompt), 12, temperature=0.7, top_k=30, seed=5)
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.7, seed=5,
                                      extra_body={"top_k": 30})
    (choice,) = whole.choices
    assert (tuple(choice.token_ids), choice.text, choice.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, len(ref.token_ids))
    assert whole.model == "tiny" and whole.object == "text_completion"
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.7, seed=5,
                                       extra_body={"top_k": 30}, stream=True)
    assert _streamed(stream) == (list(ref.token_ids), ref.text, ref.finish_reason)


def test_token_id_prompts_and_the_usage_chunk(client, offline):
    ref = _reference(offline, [7, 8, 9], 6, ignore_eos=True)
    chunks = list(client.completions.create(model="tiny", prompt=[7, 8, 9], max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 6, 9)
    assert _streamed(chunks[:-1]) == (list(ref.token_ids), ref.text, "length")


def test_the_usage_counts_the_prompts_tokens_read_from_the_prefix_cache(client, offline):
    """A prompt of 40 token ids sent three times: the second and the third (streamed) read its first two
    full pages (16 tokens each) from the prefix cache, and the usage says so."""
    prompt = [int(t) for t in np.random.default_rng(41).integers(10, 90, 40)]
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    cached = [u.prompt_tokens_details.cached_tokens for u in (first.usage, again.usage, chunks[-1].usage)]
    assert cached == [0, 32, 32] and again.choices[0].token_ids == first.choices[0].token_ids


def test_chat_completions_render_the_template_and_carry_the_engines_tokens(client, offline):
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": [{"type": "text", "text": "w3"}]}]
    prompt = offline.tokenizer.encode("<s><|system|> w1 w2 <|user|> w3 <|assistant|> ", add_special_tokens=False)
    ref = _reference(offline, prompt, 8, temperature=0.9, top_p=0.8, seed=11)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0.9, top_p=0.8,
                                           seed=11)
    (choice,) = whole.choices
    assert (tuple(choice.token_ids), choice.message.content, choice.message.role, choice.finish_reason) == (
        ref.token_ids, ref.text, "assistant", ref.finish_reason)
    assert prompt == (90, 93, 1, 2, 91, 3, 92) and whole.usage.prompt_tokens == 7 and whole.object == "chat.completion"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8,
                                                 temperature=0.9, top_p=0.8, seed=11, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].token_ids == []
    assert _streamed(chunks) == (list(ref.token_ids), ref.text, ref.finish_reason)


def _prompt_with_a_new_word(offline, k: int):
    """A prompt whose greedy continuation's k-th token (0-based) is a word that appears nowhere before it
    in the continuation, with that continuation."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        prompt = [int(t) for t in rng.integers(0, 90, size=4)]
        ref = _reference(offline, prompt, k + 4, ignore_eos=True)
        words = [f"w{t}" for t in ref.token_ids]
        if all(t < 90 for t in ref.token_ids) and words[k] not in " ".join(words[:k]):
            return prompt, ref
    raise AssertionError("no prompt found")


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cuts_the_text_and_ends_the_request(client, offline, stream):
    prompt, ref = _prompt_with_a_new_word(offline, 3)
    stop = f"w{ref.token_ids[3]}"
    expected_text = ref.text[:ref.text.index(stop)]
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0, stop=["w999", stop],
                                       extra_body={"ignore_eos": True}, stream=stream)
    if stream:
        got = _streamed(answer)
    else:
        (choice,) = answer.choices
        got = (choice.token_ids, choice.text, choice.finish_reason)
        assert answer.usage.completion_tokens == 4
    assert got == (list(ref.token_ids[:4]), expected_text, "stop")


def test_a_stop_token_ends_the_request_and_adds_no_text(client, offline):
    prompt, ref = _prompt_with_a_new_word(offline, 3)
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0,
                                       stop=[ref.token_ids[3]], extra_body={"ignore_eos": True})
    (choice,) = answer.choices
    assert choice.token_ids == list(ref.token_ids[:4]) and choice.finish_reason == "stop"
    assert choice.text == offline.tokenizer.decode(ref.token_ids[:3])


def test_fifty_concurrent_streams_each_receive_exactly_the_engines_tokens(openai, server, offline):
    rng = np.random.default_rng(7)
    requests = []
    for i in range(50):
        prompt = [int(t) for t in rng.integers(0, 96, size=int(rng.integers(1, 12)))]
        settings = {"temperature": 0.0} if i % 2 else {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 100 + i}
        requests.append((prompt, int(rng.integers(2, 10)), settings))
    expected = offline.generate([p for p, _, _ in requests],
                                [SamplingParams(max_new_tokens=n, **s) for _, n, s in requests])
    assert any(out.finish_reason == "stop" for out in expected)       # some end at the EOS

    async def one(client, prompt, max_tokens, settings):
        extra = {"top_k": settings.pop("top_k")} if "top_k" in settings else {}
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 extra_body=extra, **settings)
        tokens, reason = [], None
        async for chunk in stream:
            assert len(chunk.choices[0].token_ids) <= 1
            tokens += chunk.choices[0].token_ids
            reason = chunk.choices[0].finish_reason
        return tuple(tokens), reason

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=64))) as client:
            return await asyncio.gather(*(one(client, p, n, dict(s)) for p, n, s in requests))

    received = asyncio.run(all_of_them())
    assert received == [(out.token_ids, out.finish_reason) for out in expected]
    assert all(out.token_ids[-1] == EOS for out in expected if out.finish_reason == "stop")


def test_models_health_and_metrics(server, client, auth):
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.owned_by == "mdsl"
    health = httpx.get(f"{server.url}/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    before = metric_values(httpx.get(f"{server.url}/metrics").text)
    httpx.post(f"{server.url}/v1/completions", headers=auth,
               json={"model": "tiny", "prompt": [1, 2], "max_tokens": 5, "ignore_eos": True}).raise_for_status()
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = metric_values(response.text)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("mdsl_generation_tokens_total") == 5 and delta("mdsl_prompt_tokens_total") == 2
    assert delta("mdsl_requests_finished_total", reason="length") == 1
    for name in ("mdsl_time_to_first_token_seconds_count", "mdsl_time_per_output_token_seconds_count",
                 "mdsl_e2e_request_latency_seconds_count"):
        assert delta(name) == 1
    assert after[("mdsl_kv_pages_total", ())] == 64 * 2048 // 16
    for name in ("mdsl_requests_running", "mdsl_requests_waiting", "mdsl_kv_pages_in_use",
                 "mdsl_generation_tokens_per_second", "mdsl_preemptions_total"):
        assert (name, ()) in after
    assert after[("mdsl_generation_tokens_per_second", ())] > 0

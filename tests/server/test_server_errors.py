"""Bad requests get their 4xx with OpenAI's error body, and a client that disconnects cancels its request
and frees its KV pages (seen through /metrics: the engine's stats)."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.server.conftest import API_KEY, POSITIONS, metric_values

GOOD = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
KEY = {"Authorization": f"Bearer {API_KEY}"}


def _with(base: dict, **changes) -> dict:
    return {k: v for k, v in {**base, **changes}.items() if v is not ...}


# (what, method, path, headers, body (a dict, or bytes sent as they are), status, param, code, words in the message)
BAD = [
    ("malformed JSON", "POST", "/v1/completions", KEY, b'{"model": "tiny", "prompt": ', 400, None, None, "not valid JSON"),
    ("not UTF-8", "POST", "/v1/completions", KEY, b'{"model": "\xff"}', 400, None, None, "not valid JSON"),
    ("a JSON array", "POST", "/v1/completions", KEY, b"[1, 2]", 400, None, None, "JSON object"),
    ("no API key", "POST", "/v1/completions", {}, GOOD, 401, None, "invalid_api_key", "didn't provide an API key"),
    ("a wrong API key", "POST", "/v1/completions", {"Authorization": "Bearer nope"}, GOOD, 401, None,
     "invalid_api_key", "Incorrect API key"),
    ("a wrong API key on /v1/models", "GET", "/v1/models", {"Authorization": "Bearer nope"}, None, 401, None,
     "invalid_api_key", "Incorrect API key"),
    ("an unknown model", "POST", "/v1/completions", KEY, _with(GOOD, model="gpt-4"), 404, "model",
     "model_not_found", "'gpt-4' does not exist"),
    ("no model", "POST", "/v1/completions", KEY, _with(GOOD, model=...), 400, "model", None, "model parameter"),
    ("an unknown field", "POST", "/v1/completions", KEY, _with(GOOD, temprature=0.5), 400, "temprature",
     "unknown_parameter", "Unrecognized request argument supplied: temprature"),
    ("n = 2", "POST", "/v1/completions", KEY, _with(GOOD, n=2), 400, "n", "unsupported_parameter", "'n'"),
    ("logprobs", "POST", "/v1/completions", KEY, _with(GOOD, logprobs=5), 400, "logprobs", "unsupported_parameter",
     "not supported"),
    ("a presence penalty", "POST", "/v1/chat/completions", KEY, _with(CHAT, presence_penalty=0.5), 400,
     "presence_penalty", "unsupported_parameter", "not supported"),
    ("an empty prompt", "POST", "/v1/completions", KEY, _with(GOOD, prompt=""), 400, "prompt", None, "empty"),
    ("no prompt tokens", "POST", "/v1/completions", KEY, _with(GOOD, prompt=[]), 400, "prompt", None, "no tokens"),
    ("no prompt", "POST", "/v1/completions", KEY, _with(GOOD, prompt=...), 400, "prompt", None, "required"),
    ("two prompts", "POST", "/v1/completions", KEY, _with(GOOD, prompt=["w1", "w2"]), 400, "prompt", None,
     "one per request"),
    ("a token outside the vocabulary", "POST", "/v1/completions", KEY, _with(GOOD, prompt=[1, 96]), 400, "prompt",
     None, "outside the vocabulary"),
    ("a prompt of floats", "POST", "/v1/completions", KEY, _with(GOOD, prompt=[1.5]), 400, "prompt", None, "integer"),
    ("an over-long prompt", "POST", "/v1/completions", KEY, _with(GOOD, prompt=[1] * POSITIONS), 400, "prompt",
     "context_length_exceeded", "leaves no room"),
    ("max_tokens beyond the context", "POST", "/v1/completions", KEY, _with(GOOD, max_tokens=POSITIONS), 400,
     "max_tokens", "context_length_exceeded", "leave room for"),
    ("max_tokens 0", "POST", "/v1/completions", KEY, _with(GOOD, max_tokens=0), 400, "max_tokens", None, ">= 1"),
    ("max_tokens as a string", "POST", "/v1/completions", KEY, _with(GOOD, max_tokens="2"), 400, "max_tokens", None,
     "integer"),
    ("a temperature as a string", "POST", "/v1/completions", KEY, _with(GOOD, temperature="hot"), 400, "temperature",
     None, "number"),
    ("a negative temperature", "POST", "/v1/completions", KEY, _with(GOOD, temperature=-1), 400, "temperature",
     None, ">= 0"),
    ("top_p 0", "POST", "/v1/completions", KEY, _with(GOOD, top_p=0), 400, "top_p", None, "(0, 1]"),
    ("a negative seed", "POST", "/v1/completions", KEY, _with(GOOD, seed=-3), 400, "seed", None, "[0,"),
    ("stream as a string", "POST", "/v1/completions", KEY, _with(GOOD, stream="yes"), 400, "stream", None, "boolean"),
    ("stream_options without stream", "POST", "/v1/completions", KEY, _with(GOOD, stream_options={}), 400,
     "stream_options", None, "only allowed"),
    ("an empty stop string", "POST", "/v1/completions", KEY, _with(GOOD, stop=[""]), 400, "stop", None, "empty"),
    ("no messages", "POST", "/v1/chat/completions", KEY, _with(CHAT, messages=...), 400, "messages", None, "required"),
    ("messages as a string", "POST", "/v1/chat/completions", KEY, _with(CHAT, messages="hi"), 400, "messages", None,
     "array"),
    ("a message without a role", "POST", "/v1/chat/completions", KEY, _with(CHAT, messages=[{"content": "w1"}]), 400,
     "messages[0].role", None, "non-empty string"),
    ("an image part", "POST", "/v1/chat/completions", KEY,
     _with(CHAT, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content", None, "not a text part"),
    ("the template's raise_exception", "POST", "/v1/chat/completions", KEY,
     _with(CHAT, messages=[{"role": "assistant", "content": "w1"}]), 400, "messages", None,
     "must not be the assistant's"),
    ("max_tokens and max_completion_tokens", "POST", "/v1/chat/completions", KEY,
     _with(CHAT, max_completion_tokens=2), 400, "max_tokens", None, "not both"),
    ("an unknown path", "POST", "/v1/embeddings", KEY, GOOD, 404, None, "not_found", "no route"),
    ("a GET of completions", "GET", "/v1/completions", KEY, None, 405, None, "method_not_allowed", "no route"),
]


@pytest.mark.parametrize("what, method, path, headers, body, status, param, code, words", BAD,
                         ids=[row[0] for row in BAD])
def test_a_bad_request_gets_its_status_and_an_openai_error_body(server, what, method, path, headers, body, status,
                                                                param, code, words):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    response = httpx.request(method, f"{server.url}{path}", headers=headers, timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert words in error["message"]


def _engine(server) -> dict:
    values = metric_values(httpx.get(f"{server.url}/metrics").text)
    return {"running": values[("mdsl_requests_running", ())], "waiting": values[("mdsl_requests_waiting", ())],
            "pages": values[("mdsl_kv_pages_in_use", ())],
            "cancelled": values.get(("mdsl_requests_finished_total", (("reason", "cancelled"),)), 0.0)}


def _wait_for_idle(server, cancelled: float) -> dict:
    deadline = time.monotonic() + 30
    while True:
        state = _engine(server)
        if state == {"running": 0, "waiting": 0, "pages": 0, "cancelled": cancelled}:
            return state
        assert time.monotonic() < deadline, f"the engine did not free the request: {state}"
        time.sleep(0.05)


LONG = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True}


def test_a_client_that_disconnects_mid_stream_cancels_its_request_and_frees_its_pages(server):
    before = _engine(server)["cancelled"]
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=KEY, json={**LONG, "stream": True},
                      timeout=30) as response:
        lines, events = response.iter_lines(), 0     # held: a generator closed early closes the connection
        for line in lines:
            events += line.startswith("data: ")
            if events == 3:
                break
        assert _engine(server)["pages"] > 0        # the request holds pages while it streams
    _wait_for_idle(server, before + 1)


def test_a_client_that_gives_up_on_a_whole_completion_cancels_it(server):
    before = _engine(server)["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=KEY, json=LONG, timeout=httpx.Timeout(30, read=0.5))
    _wait_for_idle(server, before + 1)

"""The app in this process (httpx's ASGI transport): a device that fails mid-request gives a whole
completion a 500 and a stream its error event and [DONE]; then /health and new requests answer 503."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from mdsl import LLM
from mdsl.server.api import ServedModel
from mdsl.server.app import create_app
from mdsl.serving.cpu import CpuDevice


def test_a_failed_device_fails_its_requests_with_500_and_then_answers_503(checkpoint, monkeypatch):
    def broken(self, e, pos, prompt_len):
        raise FloatingPointError("the forward broke")

    monkeypatch.setattr(CpuDevice, "_forward", broken)
    llm = LLM(checkpoint, max_batch=2)
    llm.device.hold()             # until both requests are in: the first failure stops the device
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}

    async def resume_once_both_are_queued():
        while llm.stats().queued + llm.stats().host_pending < 2:
            await asyncio.sleep(0.01)
        llm.device.resume()

    async def requests():
        transport = httpx.ASGITransport(app=create_app(ServedModel("tiny", llm, None)))
        async with httpx.AsyncClient(transport=transport, base_url="http://mdsl") as client:
            whole, stream, _ = await asyncio.gather(client.post("/v1/completions", json=body),
                                                    client.post("/v1/completions", json={**body, "stream": True}),
                                                    resume_once_both_are_queued())
            return whole, stream, await client.get("/health"), await client.post("/v1/completions", json=body)

    try:
        whole, stream, health, after = asyncio.run(requests())
    finally:
        llm.close()
    assert whole.status_code == 500
    error = whole.json()["error"]
    assert error["type"] == "server_error" and "the forward broke" in error["message"]
    events = [line[len("data: "):] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert stream.status_code == 200 and events[-1] == "[DONE]"
    assert "the forward broke" in json.loads(events[-2])["error"]["message"]
    assert (health.status_code, health.json()) == (503, {"status": "failed"})
    assert after.status_code == 503 and "has failed" in after.json()["error"]["message"]


@pytest.mark.parametrize("header", ["Bearer wrong", "Basic test-key", "Bearer", ""])
def test_only_the_bearer_key_passes(checkpoint, header):
    llm = LLM(checkpoint, max_batch=1)

    async def request(value):
        transport = httpx.ASGITransport(app=create_app(ServedModel("tiny", llm, None), api_key="test-key"))
        async with httpx.AsyncClient(transport=transport, base_url="http://mdsl") as client:
            return await client.get("/v1/models", headers={"Authorization": value} if value else {})

    try:
        refused, accepted = asyncio.run(request(header)), asyncio.run(request("Bearer test-key"))
    finally:
        llm.close()
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert accepted.status_code == 200 and accepted.json()["data"][0]["id"] == "tiny"

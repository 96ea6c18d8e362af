"""A server over a checkpoint without a tokenizer serves token ids and refuses text; on SIGTERM it
finishes the stream that ends within the shutdown timeout, cancels the one that does not (it still ends
with its last event and [DONE]), closes the engine and exits 0. The command line's own errors."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from mdsl.gpu import has_gpu
from tests.server.conftest import start_server, write_checkpoint


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> str:
    return write_checkpoint(tmp_path_factory.mktemp("bare") / "bare", tokenizer=False)


def _stream(url: str, body: dict, first_event: threading.Event, out: list) -> None:
    """Read a streamed completion into `out`: its events (JSON objects, then "[DONE]")."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
                first_event.set()


def test_without_a_tokenizer_token_ids_are_served_and_text_is_refused(bare, tmp_path):
    server = start_server(bare, tmp_path)
    try:
        done = httpx.post(f"{server.url}/v1/completions", json={"model": "bare", "prompt": [1, 2], "max_tokens": 3,
                                                                 "ignore_eos": True}).json()
        assert done["choices"][0]["text"] == "" and len(done["choices"][0]["token_ids"]) == 3
        for path, body, param in [("/v1/completions", {"prompt": "w1 w2"}, "prompt"),
                                  ("/v1/completions", {"prompt": [1], "stop": "w3"}, "stop"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]},
                                   "messages")]:
            response = httpx.post(f"{server.url}{path}", json={"model": "bare", **body})
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert "tokenizer.json" in httpx.post(f"{server.url}/v1/completions",
                                              json={"model": "bare", "prompt": "w1"}).json()["error"]["message"]
        port = server.url.rsplit(":", 1)[1]       # a second server on the same port
        busy = subprocess.run([sys.executable, "-m", "mdsl", "serve", "--model", bare, "--port", port],
                              capture_output=True, text=True, timeout=120)
        assert busy.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr, busy.stderr
    finally:
        assert server.stop(signal.SIGINT) == 0, server.log()


def test_sigterm_finishes_or_cancels_running_streams_and_exits_0(bare, tmp_path):
    server = start_server(bare, tmp_path, "--shutdown-timeout", "1")   # the long stream needs several seconds
    short, long_ = [], []
    started = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream, args=(server.url, body, event, out)) for body, event, out in [
        ({"model": "bare", "prompt": [1, 2, 3], "max_tokens": 1900, "ignore_eos": True}, started[0], long_),
        ({"model": "bare", "prompt": [4, 5], "max_tokens": 8, "ignore_eos": True}, started[1], short)]]
    for thread, event in zip(threads, started):
        thread.start()
        assert event.wait(60), server.log()
    code = server.stop(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert code == 0, server.log()
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["token_ids"]) for e in short[:-1]) == 8
    assert long_[-1] == "[DONE]" and long_[-2]["choices"][0]["finish_reason"] == "cancelled"
    assert sum(len(e["choices"][0]["token_ids"]) for e in long_[:-1]) < 1900
    log = server.log()
    assert "Traceback" not in log and "Application shutdown complete" in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")


@pytest.mark.parametrize("args, words", [
    (["--gpu-memory-fraction", "0.9"], "sizes the GPU device's KV cache"),
    (["--device", "megakernel", "--gpu-memory-fraction", "0.9"], "--device megakernel takes its size from "
                                                                 "--kv-cache-bytes"),
    (["--device", "tpu"], "invalid choice: 'tpu' (choose from"),
    *([] if has_gpu() else [(["--device", "gpu"], "needs an NVIDIA GPU"),
                            (["--device", "megakernel"], "needs an NVIDIA GPU")]),
    (["--max-batch", "0"], "positive integer"),
    (["--port", "70000"], "[0, 65535]"),
    (["--host", "192.0.2.1"], "cannot listen on 192.0.2.1"),          # an address of no interface here
    (["--max-seq", "100000"], "exceeds"),
])
def test_command_line_errors_are_clear(bare, args, words):
    done = subprocess.run([sys.executable, "-m", "mdsl", "serve", "--model", bare, "--port", "0", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_missing_checkpoint_is_clear(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mdsl", "serve", "--model", str(tmp_path / "nothing")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "nothing" in done.stderr, done.stderr

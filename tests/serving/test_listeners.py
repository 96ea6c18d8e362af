"""What an event loop needs from the engine: a handle's `subscribe` callbacks and non-blocking `poll`,
the requests waiting in the queue in `stats`, and text encoded without the tokenizer's special tokens."""
from __future__ import annotations

import os
import shutil
import threading

import pytest

from mdsl import LLM, SamplingParams
from mdsl.serving import ServingError
from mdsl.serving.cpu import CpuDevice
from tests.serving.conftest import wait_until


def test_a_subscriber_is_called_for_every_token_and_the_end_and_polls_them_in_order(checkpoints):
    with LLM(checkpoints["qwen3"].folder, max_batch=2) as llm:
        llm.device.hold()
        handle = llm.submit([1, 2, 3], SamplingParams(max_new_tokens=6, ignore_eos=True))
        seen, calls = [], []

        def on_update():                         # in the engine's host thread
            calls.append(threading.current_thread().name)
            new, reason = handle.poll(len(seen))
            seen.extend(new)
            if reason is not None:
                seen.append(reason)

        handle.subscribe(on_update)
        assert handle.poll() == ((), None)
        llm.device.resume()
        out = handle.result(timeout=60)
        wait_until(lambda: seen[-1:] == ["length"], what="the last callback")
    assert seen == [*out.token_ids, "length"]
    assert len(calls) >= 7 and set(calls) == {"mdsl-serving-host"}
    assert handle.poll(4) == (out.token_ids[4:], "length")


def test_a_failing_subscriber_does_not_stop_the_engine(checkpoints, caplog):
    with LLM(checkpoints["qwen3"].folder, max_batch=2) as llm:
        broken = llm.submit([1, 2], SamplingParams(max_new_tokens=3))
        broken.subscribe(lambda: 1 / 0)
        other = llm.submit([4, 5], SamplingParams(max_new_tokens=3))
        assert len(broken.result(timeout=60).token_ids) >= 1 and len(other.result(timeout=60).token_ids) >= 1
        assert llm.stats().status == "serving"
    assert "a listener of request" in caplog.text and "ZeroDivisionError" in caplog.text


def test_poll_raises_the_devices_failure(checkpoints, monkeypatch):
    def broken(self, e, pos, prompt_len):
        raise FloatingPointError("the forward broke")

    monkeypatch.setattr(CpuDevice, "_forward", broken)
    with LLM(checkpoints["llama3"].folder, max_batch=2) as llm:
        handle = llm.submit([1, 2, 3], SamplingParams(max_new_tokens=4))
        woken = threading.Event()
        handle.subscribe(woken.set)
        assert woken.wait(60)
        wait_until(handle.done, what="the failure")
        with pytest.raises(ServingError, match="the forward broke"):
            handle.poll()


def test_stats_count_the_requests_queued_and_held_on_the_host(checkpoints):
    with LLM(checkpoints["llama3"].folder, max_batch=2) as llm:
        llm.device.hold()
        handles = [llm.submit([1, 2], SamplingParams(max_new_tokens=2)) for _ in range(5)]
        wait_until(lambda: llm.device.queued() == 2, what="a full queue")
        stats = llm.stats()
        assert (stats.queued, stats.host_pending) == (2, 3)
        llm.device.resume()
        for h in handles:
            h.result(timeout=60)
        stats = llm.stats()
        assert (stats.queued, stats.host_pending) == (0, 0)


def test_text_encodes_without_the_tokenizers_special_tokens_on_request(checkpoints, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    folder = str(tmp_path / "with-bos")
    shutil.copytree(checkpoints["qwen3"].folder, folder)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(os.path.join(folder, "tokenizer.json"))
    with LLM(folder, max_batch=1) as llm:
        assert llm.tokenizer.encode("a b") == (0, 1, 2)
        assert llm.tokenizer.encode("<s> a b", add_special_tokens=False) == (0, 1, 2)
        assert llm.tokenizer.encode("a b", add_special_tokens=False) == (1, 2)

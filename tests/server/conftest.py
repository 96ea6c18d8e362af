"""A tiny Qwen3 checkpoint with a word-level tokenizer.json, a tokenizer_config.json chat template and an
EOS token, and real `mdsl serve` processes on free ports."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

import mdsl
from mdsl.megakernel.architectures import step_function
from mdsl.megakernel.checkpoint import random_weights, save_checkpoint
from mdsl.megakernel.config import config_from_dict
from tests.megakernel.tiny import tiny_config_dict

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

API_KEY = "test-key"
POSITIONS = 2048          # long enough that a 1500-token request outlives a client's disconnect
WORDS = 90                # token i < 90 is the word "w{i}"
SPECIALS = ["<s>", "<|user|>", "<|assistant|>", "<|system|>", "</s>", "[UNK]"]
BOS, EOS = 90, 94         # the tiny model's favourite token is the EOS: some requests stop early
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                 "{% if loop.first and m['role'] == 'assistant' %}"
                 "{{ raise_exception('the first message must not be the assistant\\'s') }}{% endif %}"
                 "<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")
STARTUP_S = 60


def write_tokenizer(folder: str):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(WORDS)}
    vocab.update({s: WORDS + i for i, s in enumerate(SPECIALS)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return tok


def write_checkpoint(folder, *, tokenizer: bool = True) -> str:
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    raw = tiny_config_dict("qwen3", max_position_embeddings=POSITIONS)
    config = config_from_dict(raw)
    save_checkpoint(folder, raw, random_weights(step_function(config).trace(config), 0, scale=0.3))
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": EOS}, f)
    if tokenizer:
        write_tokenizer(folder)
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True},
                       "chat_template": CHAT_TEMPLATE}, f)
    return folder


@attrs.define
class ServerProcess:
    """`python -m mdsl serve --port 0 ...` with the mdsl this test imports; its output goes to a file."""

    process: subprocess.Popen
    log_path: Path
    url: str = ""

    @classmethod
    def start(cls, folder: str, log_dir: Path, *args: str) -> "ServerProcess":
        log_path = log_dir / f"serve-{time.monotonic_ns()}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(mdsl.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               "PYTHONUNBUFFERED": "1"}
        env.pop("MDSL_API_KEY", None)
        with open(log_path, "w") as log:
            process = subprocess.Popen([sys.executable, "-m", "mdsl", "serve", "--model", folder, "--port", "0", *args],
                                       stdout=log, stderr=subprocess.STDOUT, cwd=log_dir, env=env)
        server = cls(process, log_path)
        deadline = time.monotonic() + STARTUP_S
        while not server.url:
            found = re.search(r"at (http://\S+)/v1 ", log_path.read_text())
            if found:
                server.url = found.group(1)
            elif process.poll() is not None or time.monotonic() > deadline:
                server.stop(signal.SIGKILL)
                raise AssertionError(f"mdsl serve did not start:\n{server.log()}")
            else:
                time.sleep(0.05)
        return server

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig=signal.SIGINT, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"mdsl serve did not exit within {timeout} s of {sig!r}:\n{self.log()}") from None


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    return write_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny")


@pytest.fixture(scope="session")
def server(checkpoint, tmp_path_factory):
    """The shared server (API key `test-key`); stopped by SIGINT at the end, which must exit 0."""
    process = ServerProcess.start(checkpoint, tmp_path_factory.mktemp("serve"), "--api-key", API_KEY)
    yield process
    code = process.stop(signal.SIGINT)
    assert code == 0, process.log()
    assert "Traceback" not in process.log(), process.log()


@pytest.fixture(scope="session")
def offline(checkpoint):
    """The engine the server runs, in this process: the reference for the tokens a client receives."""
    from mdsl import LLM

    with LLM(checkpoint, max_batch=64) as llm:
        yield llm


@pytest.fixture
def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def metric_values(text: str) -> dict:
    """{(sample name, labels as a sorted tuple): value} of a Prometheus exposition, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}

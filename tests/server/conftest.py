"""A tiny Qwen3 checkpoint with a word-level tokenizer.json, a tokenizer_config.json chat template and an
EOS token, and real `mdsl serve` processes on free ports (benchmarks/serve_http.py's launcher)."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from benchmarks.serve_http import ServerProcess
from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.checkpoint import random_weights, save_checkpoint
from mdsl.megakernel.modelgraph.model_config import config_from_dict
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


def start_server(folder: str, log_dir: Path, *args: str) -> ServerProcess:
    """`mdsl serve --port 0 ARGS` on the folder, its log in log_dir (the load generator's launcher)."""
    return ServerProcess(folder, log_dir / f"serve-{time.monotonic_ns()}.log", *args, timeout=STARTUP_S)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    return write_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny")


@pytest.fixture(scope="session")
def server(checkpoint, tmp_path_factory):
    """The shared server (API key `test-key`); stopped by SIGINT at the end, which must exit 0."""
    process = start_server(checkpoint, tmp_path_factory.mktemp("serve"), "--api-key", API_KEY)
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

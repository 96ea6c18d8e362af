"""The server's text: incremental detokenization (pieces that add up to the whole decode, never a broken
UTF-8 character, cut at stop strings and stop tokens) and chat templates rendered as transformers does."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mdsl.server.chat import ChatTemplate, ChatTemplateError
from mdsl.server.text import TextStream
from mdsl.serving import ServingError
from mdsl.serving.tokenizer import Tokenizer

tokenizers = pytest.importorskip("tokenizers")

CORPUS = ["héllo wörld, ça va? 東京 へ ようこそ", "the quick brown fox — naïve café", "€100 or ¥200 in 北京 ✓",
          "hello world " * 3]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Tokenizer:
    """A byte-level BPE tokenizer small enough that many characters take several tokens."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    folder = tmp_path_factory.mktemp("bpe")
    tok.save(str(folder / "tokenizer.json"))
    return Tokenizer(str(folder))


def _pieces(stream: TextStream, tokens) -> list:
    return [stream.push(t) for t in tokens] + [stream.finish()]


@pytest.mark.parametrize("text", CORPUS)
def test_pieces_add_up_to_the_whole_decode_and_never_split_a_character(byte_level, text):
    tokens = byte_level.encode(text)
    assert len(tokens) > len(text.split())       # several tokens per word: the window matters
    pieces = _pieces(TextStream(byte_level), tokens)
    assert "".join(pieces) == byte_level.decode(tokens) == text
    assert not any("\ufffd" in p for p in pieces)


def test_random_token_runs_decode_as_a_whole(byte_level):
    rng = np.random.default_rng(0)
    for _ in range(50):
        tokens = [int(t) for t in rng.integers(0, 300, size=int(rng.integers(1, 30)))]
        assert "".join(_pieces(TextStream(byte_level), tokens)) == byte_level.decode(tokens)


@pytest.mark.parametrize("stops, expected", [
    (("wörld",), "héllo "), (("o w",), "héll"), (("va?", "ll"), "hé"), (("東京",), "héllo wörld, ça va? "),
    (("absent",), CORPUS[0]),
])
def test_a_stop_string_cuts_the_text_and_nothing_after_it_is_released(byte_level, stops, expected):
    tokens = byte_level.encode(CORPUS[0])
    stream = TextStream(byte_level, stops)
    released = ""
    for i, t in enumerate(tokens):
        released += stream.push(t)
        assert not any(s in released for s in stops)
        if stream.stopped:      # at the token that completes the first stop string
            assert any(s in byte_level.decode(tokens[:i + 1]) for s in stops)
            assert not any(s in byte_level.decode(tokens[:i]) for s in stops)
            break
    released += stream.finish()
    assert released == stream.text == expected
    assert stream.stopped == (stops != ("absent",))


def test_a_stop_token_adds_no_text(byte_level):
    tokens = byte_level.encode("hello world")
    stream = TextStream(byte_level, stop_ids=frozenset({tokens[-1]}))
    assert "".join(_pieces(stream, tokens)) == byte_level.decode(tokens[:-1])


def test_without_a_tokenizer_the_text_is_empty(tmp_path):
    stream = TextStream(Tokenizer(str(tmp_path)), ("w1",))
    assert _pieces(stream, [1, 2, 3]) == ["", "", "", ""] and not stream.stopped


# ---- chat templates

def _folder(tmp_path, config: dict, jinja=None) -> str:
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump(config, f)
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return str(tmp_path)


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]


def test_a_template_sees_the_messages_the_special_tokens_and_the_generation_prompt(tmp_path):
    source = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}\n{% endfor %}"
              "{% if add_generation_prompt %}[assistant]{% endif %}")
    template = ChatTemplate.load(_folder(tmp_path, {"chat_template": source, "bos_token": "<s>",
                                                    "eos_token": {"content": "</s>", "lstrip": False}}))
    assert template.render(MESSAGES) == "<s>[system]be brief</s>\n[user]héllo</s>\n[assistant]"
    assert template.render(MESSAGES, add_generation_prompt=False) == "<s>[system]be brief</s>\n[user]héllo</s>\n"


def test_transformers_extensions_filters_and_globals(tmp_path):
    source = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
              "{% generation %}|gen|{% endgeneration %}{{ strftime_now('%Y') | length }}\n"
              "    {% if true %}\n    lstrip{% endif %}")
    template = ChatTemplate.load(_folder(tmp_path, {"chat_template": source}))
    # lstrip_blocks drops the indent before {% if %}, trim_blocks the newline after it
    assert template.render(MESSAGES) == '{"role": "system", "content": "be brief"}|gen|4\n    lstrip'


def test_named_templates_and_chat_template_jinja(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default {{ messages | length }}"}]
    assert ChatTemplate.load(_folder(tmp_path, {"chat_template": named})).render(MESSAGES) == "default 2"
    jinja = ChatTemplate.load(_folder(tmp_path, {"chat_template": "config"}, jinja="file {{ bos_token }}"))
    assert jinja.render(MESSAGES) == "file " and jinja.origin.endswith("chat_template.jinja")
    os.remove(tmp_path / "chat_template.jinja")
    assert ChatTemplate.load(_folder(tmp_path, {"bos_token": "<s>"})) is None
    os.remove(tmp_path / "tokenizer_config.json")
    assert ChatTemplate.load(str(tmp_path)) is None


@pytest.mark.parametrize("source, words", [
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{{ messages.append(1) }}", "SecurityError: .*unsafe"),                     # the immutable sandbox
    ("{{ messages[0].content.nope.deeper }}", "fails on these messages: UndefinedError: .* no attribute 'nope'"),
    ("{{ messages[0]['content'] + 1 }}", "TypeError"),
])
def test_a_template_that_refuses_or_fails_raises_a_chat_template_error(tmp_path, source, words):
    template = ChatTemplate.load(_folder(tmp_path, {"chat_template": source}))
    with pytest.raises(ChatTemplateError, match=words):
        template.render(MESSAGES)


@pytest.mark.parametrize("config, words", [
    ({"chat_template": "{% for %}"}, "does not compile"), ({"chat_template": 3}, "not a string"),
])
def test_a_broken_template_or_config_fails_when_loaded(tmp_path, config, words):
    with pytest.raises(ServingError, match=words):
        ChatTemplate.load(_folder(tmp_path, config))
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ServingError, match="could not be read"):
        ChatTemplate.load(str(tmp_path))

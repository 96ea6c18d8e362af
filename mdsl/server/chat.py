"""A checkpoint's chat template, rendered as Hugging Face transformers renders it: jinja2's immutable
sandbox with trim_blocks and lstrip_blocks, the loopcontrols extension and `{% generation %}` blocks,
the `tojson` filter and the `raise_exception` and `strftime_now` globals; the template sees `messages`,
`add_generation_prompt` and the special tokens of tokenizer_config.json (`bos_token`, `eos_token`, ...).

The template is `chat_template.jinja` beside the weights, else tokenizer_config.json's `chat_template`
(a string, or a list of named templates of which "default" is used)."""
from __future__ import annotations

import datetime
import json
import os
from typing import Optional

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mdsl.serving.params import ServingError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ServingError):
    """A conversation the template refuses (its `raise_exception`), or a template that fails on it."""


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it; the
    text is the block's body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


class _Refused(jinja2.TemplateError):
    """The template's raise_exception."""


def _raise_exception(message):
    raise _Refused(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.datetime.now().strftime(format)


def _token_text(value):
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class ChatTemplate:
    """A compiled template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: dict, origin: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationBlocks, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ServingError(f"{origin}: the chat template does not compile: {e.message} (template line {e.lineno})",
                               hint="use the chat template that came with the model") from None
        self.special_tokens = special_tokens
        self.origin = origin

    @classmethod
    def load(cls, folder: str) -> Optional["ChatTemplate"]:
        """The folder's template, or None when it has none."""
        config_path = os.path.join(folder, "tokenizer_config.json")
        config = {}
        if os.path.exists(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ServingError(f"{config_path} could not be read: {e}",
                                   hint="use the tokenizer_config.json that came with the model") from None
            if not isinstance(config, dict):
                raise ServingError(f"{config_path} holds a {type(config).__name__}, not a JSON object")
        special = {name: _token_text(config[name]) for name in SPECIAL_TOKENS
                   if isinstance(_token_text(config.get(name)), str)}
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return cls(f.read(), special, jinja_path)
        source = config.get("chat_template")
        if isinstance(source, list):    # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise ServingError(f"{config_path}: chat_template is a {type(source).__name__}, not a string",
                               hint="use the tokenizer_config.json that came with the model")
        return cls(source, special, config_path)

    def render(self, messages: list, add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except _Refused as e:
            raise ChatTemplateError(f"the chat template refuses these messages: {e.message}",
                                    hint=f"the template is {self.origin}") from None
        except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            # an undefined name, a sandbox violation, an operation on the wrong type
            raise ChatTemplateError(f"the chat template fails on these messages: {type(e).__name__}: {e}",
                                    hint=f"the template is {self.origin}") from None

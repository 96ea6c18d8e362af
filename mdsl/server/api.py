"""The OpenAI API's requests, checked field by field and mapped to the engine's: a `Job` per request, or an
`ApiError` whose body is OpenAI's error object {"error": {"message", "type", "param", "code"}}.

Fields, as OpenAI itself treats them, an unrecognized top-level field is refused (400, naming it). Of the
fields OpenAI defines that the engine has no use for, those that change nothing at their neutral value are
accepted at that value only (`n` 1, `logprobs` null or false, `presence_penalty` 0, `echo` false, no
`tools`, ...); `user` is accepted and ignored. Extensions (as vLLM names them): `top_k` (0 or -1: every
token) and `ignore_eos`; `stop` takes strings and token ids."""
from __future__ import annotations

from typing import Optional

import attrs

from mdsl.errors import MdslError
from mdsl.serving import LLM, SamplingParams, ServingError
from mdsl.serving.protocol import MAX_STOP
from mdsl.server.chat import ChatTemplate, ChatTemplateError

_U64 = 2**64
MAX_STOP_STRINGS = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions; chat defaults to the room left

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class ApiError(MdslError):
    """A request the server refuses, with its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 hint: Optional[str] = None):
        super().__init__(message, hint=hint)
        self.status, self.param, self.code = status, param, code

    @classmethod
    def bad(cls, error: MdslError, param: Optional[str] = None, code: Optional[str] = None) -> "ApiError":
        return cls(400, error.message, param=param, code=code, hint=error.hint)

    def body(self) -> dict:
        message = self.message if not self.hint else f"{self.message} (hint: {self.hint})"
        return {"error": {"message": message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


@attrs.frozen(eq=False)
class ServedModel:
    """The model behind the API: its name, its engine and its chat template (None: chat is refused)."""

    name: str
    llm: LLM
    chat_template: Optional[ChatTemplate]

    @property
    def context(self) -> int:
        """Positions one request may use: the engine's max_seq, or one more than the page pool caches."""
        shape = self.llm.shape
        return min(shape.max_seq, shape.num_pages * shape.page_size + 1)


@attrs.frozen
class Job:
    """One checked request: the prompt's token ids, the engine's parameters, the stop strings (matched on
    the output's text) and how to answer."""

    chat: bool
    prompt: tuple
    params: SamplingParams
    stop_strings: tuple
    stream: bool
    include_usage: bool


# ---- fields

_NEUTRAL = {   # OpenAI fields the engine has no use for: the values at which they change nothing
    "n": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},),
    "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "best_of": (1,),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},), "parallel_tool_calls": (True, False),
}
_IGNORED = ("user",)
_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "ignore_eos", "n", "presence_penalty", "frequency_penalty", "logit_bias", *_IGNORED)
COMPLETION_FIELDS = frozenset((*_COMMON, "prompt", "logprobs", "echo", "suffix", "best_of"))
CHAT_FIELDS = frozenset((*_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                         "tool_choice", "functions", "function_call", "response_format", "parallel_tool_calls"))
MESSAGE_FIELDS = frozenset(("role", "content", "name"))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


def _kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _wrong(name: str, value, expected: str) -> ApiError:
    return ApiError(400, f"'{name}' must be {expected}, got {_kind(value)}" +
                    (f" ({value!r})" if not isinstance(value, (dict, list)) else ""), param=name)


def _integer(body: dict, name: str, low: int, high: Optional[int] = None) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise _wrong(name, value, "an integer")
    if value < low or (high is not None and value >= high):
        raise ApiError(400, f"'{name}' must be {f'>= {low}' if high is None else f'in [{low}, {high})'}, got {value}",
                       param=name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise _wrong(name, value, "a finite number")
    return float(value)


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _wrong(name, value, "a boolean")
    return value


def _check_fields(body, allowed: frozenset) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_kind(body)}")
    for name, value in body.items():
        if name not in allowed:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name,
                           code="unknown_parameter")
        if name in _NEUTRAL and value is not None and not any(
                type(value) is type(v) and value == v for v in _NEUTRAL[name]):
            shown = " or ".join(repr(v) for v in _NEUTRAL[name])
            raise ApiError(400, f"'{name}' is not supported: only {shown} (or null) is accepted, got {value!r}",
                           param=name, code="unsupported_parameter")


def _model(body: dict, model: ServedModel) -> None:
    name = body.get("model")
    if name is None:
        raise ApiError(400, "you must provide a model parameter", param="model",
                       hint=f"this server serves {model.name!r} (GET /v1/models)")
    if not isinstance(name, str):
        raise _wrong("model", name, "a string")
    if name != model.name:
        raise ApiError(404, f"The model '{name}' does not exist", param="model", code="model_not_found",
                       hint=f"this server serves {model.name!r} (GET /v1/models)")


def _token_ids(value, name: str, vocab: int) -> tuple:
    for t in value:
        if not _is_int(t):
            raise _wrong(name, t, "an integer token id")
        if not 0 <= t < vocab:
            raise ApiError(400, f"token id {t} in '{name}' is outside the vocabulary [0, {vocab})", param=name)
    return tuple(value)


def _stop(body: dict, model: ServedModel) -> tuple:
    """(stop strings, stop token ids)."""
    value = body.get("stop")
    if value is None:
        return (), ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise _wrong("stop", value, "a string or an array of strings and token ids")
    strings = tuple(s for s in items if isinstance(s, str))
    ids = _token_ids([t for t in items if not isinstance(t, str)], "stop", model.llm.config.vocab_size)
    if any(not s for s in strings):
        raise ApiError(400, "a stop string is empty", param="stop")
    if len(strings) > MAX_STOP_STRINGS:
        raise ApiError(400, f"{len(strings)} stop strings; at most {MAX_STOP_STRINGS}", param="stop")
    if strings:
        _need_text(model, "stop", "stop strings")
    return strings, ids


def _need_text(model: ServedModel, param: str, what: str) -> None:
    try:
        model.llm.tokenizer.encode("")
    except ServingError as e:
        raise ApiError(400, f"{what} need the model's tokenizer: {e.message}", param=param, hint=e.hint) from None


def _sampling(body: dict, model: ServedModel, prompt_len: int, max_tokens_name: str, default_max: Optional[int],
              prompt_name: str) -> tuple:
    """(SamplingParams, stop strings), with the request's length checked against the context."""
    room = model.context - prompt_len
    if room < 1:
        raise ApiError(400, f"the prompt has {prompt_len} tokens; this model serves at most {model.context} positions "
                            "(prompt and completion), which leaves no room for a completion", param=prompt_name,
                       code="context_length_exceeded", hint="shorten the prompt")
    max_tokens = _integer(body, max_tokens_name, 1)
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    elif max_tokens > room:
        raise ApiError(400, f"'{max_tokens_name}' is {max_tokens}, but the prompt's {prompt_len} tokens leave room for "
                            f"{room} of this model's {model.context} positions", param=max_tokens_name,
                       code="context_length_exceeded", hint=f"ask for at most {room} tokens, or shorten the prompt")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise ApiError(400, f"'temperature' must be >= 0, got {temperature}", param="temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = _integer(body, "top_k", -1)
    seed = _integer(body, "seed", 0, _U64)
    ignore_eos = _boolean(body, "ignore_eos")
    strings, ids = _stop(body, model)
    if len(set(ids) | (set() if ignore_eos else set(model.llm.eos_token_ids))) > MAX_STOP:
        raise ApiError(400, f"{len(set(ids))} stop token ids with the model's EOS tokens; at most {MAX_STOP}",
                       param="stop")
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=max(0, top_k or 0), seed=seed,
                            max_new_tokens=max_tokens, stop_token_ids=ids, ignore_eos=ignore_eos)
    return params, strings


def _stream(body: dict) -> tuple:
    """(stream, include_usage)."""
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, "'stream_options' must be an object with the one field 'include_usage'",
                       param="stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _wrong("stream_options.include_usage", include_usage, "a boolean")
    return stream, include_usage


# ---- the two endpoints

def completion_job(body, model: ServedModel) -> Job:
    """A /v1/completions request. `prompt`: a string, an array of token ids, or an array holding one of
    those (a batch of one)."""
    _check_fields(body, COMPLETION_FIELDS)
    _model(body, model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, f"'prompt' holds {len(prompt)} prompts; this server takes one per request",
                           param="prompt", hint="send one request per prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", param="prompt")
        _need_text(model, "prompt", "text prompts")
        tokens = model.llm.tokenizer.encode(prompt)
    elif isinstance(prompt, list):
        tokens = _token_ids(prompt, "prompt", model.llm.config.vocab_size)
    elif prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    else:
        raise _wrong("prompt", prompt, "a string or an array of token ids")
    if not tokens:
        raise ApiError(400, "'prompt' is empty" if prompt else "'prompt' has no tokens", param="prompt")
    params, strings = _sampling(body, model, len(tokens), "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
    return Job(False, tokens, params, strings, *_stream(body))


def _message(i: int, message) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _wrong(where, message, "an object with 'role' and 'content'")
    for key in message:
        if key not in MESSAGE_FIELDS:
            raise ApiError(400, f"'{where}.{key}' is not supported; a message has 'role', 'content' and 'name'",
                           param=f"{where}.{key}")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise _wrong(f"{where}.role", role, "a non-empty string")
    if isinstance(content, list):     # content parts: the text ones, joined as vLLM joins them
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"'{where}.content[{j}]' is not a text part; only {{'type': 'text', 'text': ...}} "
                                    "parts are supported", param=f"{where}.content")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise _wrong(f"{where}.content", content, "a string or an array of text parts")
    if "name" in message and not isinstance(message["name"], str):
        raise _wrong(f"{where}.name", message["name"], "a string")
    return {**message, "content": content}


def chat_job(body, model: ServedModel) -> Job:
    """A /v1/chat/completions request: the messages rendered by the model's chat template and tokenized
    without the tokenizer's own special tokens (the template writes them)."""
    _check_fields(body, CHAT_FIELDS)
    _model(body, model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise (_wrong("messages", messages, "a non-empty array of messages") if messages is not None
               else ApiError(400, "'messages' is required", param="messages"))
    messages = [_message(i, m) for i, m in enumerate(messages)]
    if model.chat_template is None:
        raise ApiError(400, f"the model {model.name!r} has no chat template", param="messages",
                       hint="serve a checkpoint whose tokenizer_config.json has a chat_template, or use "
                            "/v1/completions")
    _need_text(model, "messages", "chat completions")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise ApiError(400, "give 'max_tokens' or 'max_completion_tokens', not both", param="max_tokens")
    try:
        text = model.chat_template.render(messages)
    except ChatTemplateError as e:
        raise ApiError.bad(e, "messages") from None
    tokens = model.llm.tokenizer.encode(text, add_special_tokens=False)
    if not tokens:
        raise ApiError(400, "the chat template renders these messages as no tokens", param="messages")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    params, strings = _sampling(body, model, len(tokens), name, None, "messages")
    return Job(True, tokens, params, strings, *_stream(body))

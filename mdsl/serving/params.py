"""SamplingParams: how one request chooses its tokens and when it stops, every setting checked."""
from __future__ import annotations

import math
from typing import Optional

import attrs

from mdsl.errors import MdslError
from mdsl.serving.protocol import MAX_STOP

_U64 = 2**64


class ServingError(MdslError):
    """A request or an engine setting that the serving engine cannot take, or a device that stopped."""


def _integer(name: str, value, low: int, high: Optional[int] = None, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ServingError(f"{name} must be an integer, got {value!r}", hint=hint or None)
    if value < low or (high is not None and value >= high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ServingError(f"{name} must be {bounds}, got {value}", hint=hint or None)
    return value


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ServingError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _stop_ids(value) -> tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ServingError(f"stop_token_ids must be a sequence of token ids, got {value!r}")
    return tuple(_integer("a stop token id", v, 0) for v in value)


@attrs.frozen
class SamplingParams:
    """Per request. temperature 0 is greedy (argmax; top_k, top_p and seed then do nothing); otherwise
    softmax sampling at that temperature over the tokens top_k (0: all) and top_p (1: all) allow, with
    noise keyed by (seed, position): the same seed gives the same tokens whatever else runs. seed None
    draws one per request. A request stops after max_new_tokens tokens, or at a token of
    stop_token_ids or the checkpoint's EOS (unless ignore_eos); that token is the last of its output."""

    temperature: float = attrs.field(default=0.0, converter=lambda v: _real("temperature", v))
    top_p: float = attrs.field(default=1.0, converter=lambda v: _real("top_p", v))
    top_k: int = attrs.field(default=0, converter=lambda v: _integer("top_k", v, 0, hint="0 keeps every token"))
    seed: Optional[int] = attrs.field(
        default=None, converter=lambda v: None if v is None else _integer("seed", v, 0, _U64,
                                                                           "a seed is a 64-bit unsigned integer"))
    max_new_tokens: int = attrs.field(default=16, converter=lambda v: _integer("max_new_tokens", v, 1))
    stop_token_ids: tuple = attrs.field(default=(), converter=_stop_ids)
    ignore_eos: bool = attrs.field(default=False)

    def __attrs_post_init__(self):
        if self.temperature < 0:
            raise ServingError(f"temperature must be >= 0, got {self.temperature}",
                               hint="0 is greedy decoding; 1 samples from the model's distribution")
        if not 0 < self.top_p <= 1:
            raise ServingError(f"top_p must be in (0, 1], got {self.top_p}", hint="1 keeps every token")
        if not isinstance(self.ignore_eos, bool):
            raise ServingError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if len(set(self.stop_token_ids)) > MAX_STOP:
            raise ServingError(f"at most {MAX_STOP} stop token ids, got {len(set(self.stop_token_ids))}")

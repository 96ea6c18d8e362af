"""Per-request token choice, a function of the request's logits, its settings and (seed, position) only,
so that a request samples the same tokens whatever else is in the batch and after a preemption.

The noise is the megakernel's (runtime/device.cu: `philox`, `gumbel`): Philox4x32-10 keyed by the seed,
counter (token, position low, position high, "mdsl"), its first word turned into a uniform in (0, 1)
and a Gumbel draw; the token is the Gumbel-max over the allowed tokens of logit / temperature + noise
(ties to the lower token id, as `better` does). Greedy is the logits' argmax. Top-k allows the k largest
logits (ties to the lower id); top-p then allows the most likely tokens whose probability (softmax of
logit / temperature over the tokens top-k allows) first reaches top_p, and every token whose logit ties
the last of them (the device's threshold rule). A NaN logit never wins and is never allowed (the devices'
comparisons never hold for it); a row with no logit above -inf has no token to choose: `NoMaximum`, on every
device."""
from __future__ import annotations

import numpy as np

from mdsl.errors import MdslError

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LOW = np.uint64(0xFFFFFFFF)
_TAG = 0x6D64736C                  # "mdsl": the counter's fourth word


def philox4x32(counter: tuple, key: tuple, rounds: int = 10) -> tuple:
    """Philox4x32 over uint32 arrays (or ints) `counter` (4 words) and `key` (2 words): 4 uint32 arrays."""
    c = [np.asarray(x, np.uint64) & _LOW for x in counter]
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for _ in range(rounds):
        p0, p1 = _M0 * c[0], _M1 * c[2]
        hi0, lo0, hi1, lo1 = p0 >> np.uint64(32), p0 & _LOW, p1 >> np.uint64(32), p1 & _LOW
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
        k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return tuple(x.astype(np.uint32) for x in c)


def gumbel_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """float32 Gumbel noise for every token at (seed, position)."""
    tokens = np.arange(vocab, dtype=np.uint64)
    r = philox4x32((tokens, position & 0xFFFFFFFF, (position >> 32) & 0xFFFFFFFF, _TAG),
                   (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))[0]
    u = ((r >> np.uint32(8)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 16777216.0)
    return -np.log(-np.log(u))


class NoMaximum(MdslError):
    """A sampling row's logits hold no value above -inf (all NaN or -inf): no token can be chosen."""

    def __init__(self):
        super().__init__("the logits of a sampling row had no maximum (NaN or -inf everywhere)",
                         hint="check the weights for NaN or inf values")


def first_maximum(values: np.ndarray) -> int:
    """The index of the first largest value above -inf, NaN never (NoMaximum where there is none): the GPU
    devices' argmax. np.argmax stops at the first NaN, so one pass answers a row without NaN."""
    i = int(np.argmax(values))
    if np.isnan(values[i]):
        values = np.where(np.isnan(values), -np.inf, values)
        i = int(np.argmax(values))
    if not values[i] > -np.inf:
        raise NoMaximum()
    return i


def allowed_tokens(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The token ids that top-k and top-p allow (all of them when both are off; a NaN logit counts as -inf),
    ascending."""
    logits = np.asarray(logits, np.float32).reshape(-1)
    if np.isnan(logits).any():
        logits = np.where(np.isnan(logits), np.float32(-np.inf), logits)
    order = np.argsort(-logits, kind="stable")           # descending, ties to the lower id
    if not logits[order[0]] > -np.inf:
        raise NoMaximum()
    if 0 < top_k < order.size:
        order = order[:top_k]
    if top_p < 1.0:
        z = logits[order].astype(np.float64) / temperature
        p = np.exp(z - z[0])
        mass = np.cumsum(p)
        last = min(int(np.searchsorted(mass, top_p * mass[-1], side="left")), order.size - 1)
        threshold = logits[order[last]]
        order = order[logits[order] >= threshold]
    return np.sort(order)


def sample(logits: np.ndarray, *, temperature: float, top_k: int, top_p: float, seed: int, position: int) -> int:
    """The token chosen at `position` (the position whose logits these are)."""
    logits = np.asarray(logits, np.float32).reshape(-1)
    if temperature == 0.0:
        return first_maximum(logits)
    allowed = allowed_tokens(logits, temperature, top_k, top_p)
    keys = logits[allowed] / np.float32(temperature) + gumbel_noise(seed, position, logits.size)[allowed]
    return int(allowed[first_maximum(keys)])

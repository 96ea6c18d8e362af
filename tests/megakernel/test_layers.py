"""Reference semantics of the layer ops, against direct formulas."""
import math

import numpy as np
import pytest

from mdsl.megakernel.modelgraph.layers import (StepContext, attend, get_layer_op, rope_inv_freq, sample_token,
                                               sample_uniform)
from mdsl.megakernel.taskgraph.partition import split_range

HEADS = {"q_heads": 4, "kv_heads": 2, "head_dim": 8}


def test_llama3_rope_frequencies():
    a = {"head_dim": 16, "theta": 500000.0, "scaling_factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position": 64}
    plain = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    got = rope_inv_freq(a)
    wavelen = 2 * math.pi / plain
    for f, p, wl in zip(got, plain, wavelen):
        if wl < 64 / 4:
            assert f == pytest.approx(p, rel=1e-6)           # high frequencies kept
        elif wl > 64 / 1:
            assert f == pytest.approx(p / 8, rel=1e-6)       # low frequencies divided by the factor
        else:
            s = (64 / wl - 1) / (4 - 1)
            assert f == pytest.approx((1 - s) * p / 8 + s * p, rel=1e-5)
    assert (got < plain * 0.99).any() and (np.isclose(got, plain)).any()
    assert np.allclose(rope_inv_freq(dict(a, original_max_position=0)), plain, rtol=1e-6)


def test_rope_rotates_query_and_key_heads_only():
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((1, 64)).astype(np.float32)
    attrs = dict(HEADS, theta=10000.0, scaling_factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position=0)
    out = get_layer_op("rope").reference([qkv], attrs, StepContext(3))[0]
    np.testing.assert_array_equal(out[0, 48:], qkv[0, 48:])
    # rotation keeps each pair's norm: (x_i, x_{i+4}) for head_dim 8
    heads_in, heads_out = qkv[0, :48].reshape(6, 2, 4), out[0, :48].reshape(6, 2, 4)
    np.testing.assert_allclose(np.hypot(*heads_out.transpose(1, 0, 2)), np.hypot(*heads_in.transpose(1, 0, 2)),
                               rtol=1e-5)
    np.testing.assert_allclose(get_layer_op("rope").reference([qkv], attrs, StepContext(0))[0], qkv)


def test_attention_appends_and_attends_causally_with_grouped_heads():
    rng = np.random.default_rng(2)
    k_cache, v_cache = (rng.standard_normal((6, 2, 8)).astype(np.float32) for _ in range(2))
    qkv = rng.standard_normal((1, 64)).astype(np.float32)
    old_k = k_cache.copy()
    out = get_layer_op("attention").reference([qkv, k_cache, v_cache], HEADS, StepContext(3))[0]
    q, k, v = qkv[0, :32].reshape(4, 8), qkv[0, 32:48].reshape(2, 8), qkv[0, 48:].reshape(2, 8)
    np.testing.assert_array_equal(k_cache[3], k)
    np.testing.assert_array_equal(v_cache[3], v)
    np.testing.assert_array_equal(k_cache[4:], old_k[4:])      # later positions untouched
    for head in range(4):
        kv = head // 2
        scores = k_cache[:4, kv] @ q[head] / math.sqrt(8)
        p = np.exp(scores - scores.max())
        np.testing.assert_allclose(out[0, head * 8:(head + 1) * 8], p @ v_cache[:4, kv] / p.sum(), rtol=1e-5)


def test_split_attention_recombines_exactly():
    rng = np.random.default_rng(3)
    q, keys, values = rng.standard_normal((2, 8)), rng.standard_normal((7, 8)), rng.standard_normal((7, 8))
    whole, _ = attend(q, keys, values)
    parts = [attend(q, keys[a:b], values[a:b]) for a, b in (split_range(6, s, 3) for s in range(3))]
    lse = np.stack([p[1] for p in parts])
    w = np.exp(lse - lse.max(0))
    merged = sum(wi[:, None] * p[0] for wi, p in zip(w, parts)) / w.sum(0)[:, None]
    np.testing.assert_allclose(merged, whole, rtol=1e-5)


@pytest.mark.parametrize("position,splits", [(0, 4), (2, 4), (9, 4), (5, 1), (11, 3)])
def test_split_ranges_cover_positions_and_the_last_holds_the_newest(position, splits):
    ranges = [split_range(position, s, splits) for s in range(splits)]
    covered = [p for a, b in ranges for p in range(a, b)]
    assert covered == list(range(position + 1))
    assert ranges[-1][1] == position + 1


def test_sampling_is_seeded_and_respects_top_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert sample_uniform(7, 3) == sample_uniform(7, 3) != sample_uniform(7, 4)
    picks = {sample_token(logits, 1.0, 0.75, u) for u in np.linspace(0, 0.999, 50)}
    assert picks == {0, 1}                  # 0.5 + 0.3 reaches 0.75: only the two most likely
    picks = {sample_token(logits, 1.0, 1.0, u) for u in np.linspace(0, 0.999, 200)}
    assert picks == {0, 1, 2, 3}
    assert sample_token(logits, 1e-3, 1.0, 0.99) == 0   # low temperature: greedy
    counts = np.bincount([sample_token(logits, 1.0, 1.0, sample_uniform(1, i)) for i in range(4000)], minlength=4)
    np.testing.assert_allclose(counts / 4000, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_argmax_writes_the_token_after_the_prompt_only():
    tokens = np.array([4, 9, 0, 0], np.int32)
    logits = np.array([[0.0, 2.0, 2.0, 1.0]], np.float32)
    op = get_layer_op("argmax")
    assert op.reference([logits, tokens], {}, StepContext(0, prompt_length=2))[0][0] == 1   # first of the ties
    assert tokens.tolist() == [4, 9, 0, 0]          # position 1 is the prompt's
    op.reference([logits, tokens], {}, StepContext(1, prompt_length=2))
    assert tokens.tolist() == [4, 9, 1, 0]

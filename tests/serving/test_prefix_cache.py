"""The prefix cache (mdsl.serving.prefix_cache) on the CPU device: requests that start with the tokens of
full pages an earlier request computed read them instead of computing them, and their tokens and logits
are the same bits as without the cache (a shared system prompt, a conversation's next turn, a preempted
request coming back); pages no request holds stay cached until a request needs them; the pool stays
whole at every step (CpuDevice._check_pool)."""
from __future__ import annotations

import numpy as np
import pytest

from mdsl import LLM, SamplingParams
from mdsl.serving.params import ServingError
from mdsl.serving.prefix_cache import PrefixCache
from tests.serving.conftest import drive
from tests.serving.test_batching import assert_pool_full
from tests.serving.test_prefill import prompt_of as tokens


# ---- the cache alone

def test_a_pages_key_names_every_token_before_its_end():
    cache = PrefixCache(8, 4)
    a = np.arange(12, dtype=np.int32)
    b = a.copy()
    b[1] = 50                                     # a token of the first page differs: every key differs
    c = a.copy()
    c[9] = 50                                     # a token of the third page: the first two keys agree
    ka, kb, kc = (cache.keys(t, 3, []) for t in (a, b, c))
    assert len(set(ka)) == 3 and not set(ka) & set(kb)
    assert kc[:2] == ka[:2] and kc[2] != ka[2]
    assert cache.keys(a, 3, ka[:1]) == ka and cache.keys(a, 2, ka) == ka[:2]   # extended from known keys


def test_lookup_finds_the_longest_cached_run_and_eviction_is_least_recently_released_first():
    cache = PrefixCache(6, 2)
    keys = cache.keys(np.arange(8, dtype=np.int32), 4, [])
    for page, key in zip((3, 1, 4), keys[:3]):
        cache.hold(page)
        cache.register(key, page)
    cache.register(keys[0], 5)                    # a key already named keeps its page
    assert cache.lookup(keys) == [3, 1, 4] and cache.lookup(cache.keys(np.arange(1, 9, dtype=np.int32), 4, [])) == []
    assert [cache.release(p) for p in (4, 3, 1)] == [False] * 3    # cached: evictable, not free
    assert list(cache.evictable) == [4, 3, 1]
    cache.hold(3)                                 # a request takes a cached page back
    assert list(cache.evictable) == [4, 1]
    assert cache.evict() == 4 and cache.lookup(keys) == [3, 1]
    assert cache.evict() == 1 and cache.lookup(keys) == [3]
    cache.hold(0)                                 # an unnamed page goes back to the free list
    assert cache.release(0) is True
    free = np.array([0, 1, 2, 4, 5], np.int32)
    assert cache.check(free, np.array([3], np.int32))
    assert not cache.check(free, np.array([3, 3], np.int32))              # held twice, counted once
    assert not cache.check(np.array([0, 2, 4, 5], np.int32), np.array([3], np.int32))   # page 1 lost


# ---- the CPU device

def served(folder, requests, arrivals=None, **engine) -> tuple:
    """(each request's output, its logits by position, the engine's stats): `requests` (prompt, params)
    one after another (arrivals None) or arriving at the steps `arrivals` gives, every row's logits
    recorded."""
    with LLM(folder, **engine) as llm:
        llm.device.record_logits = True
        if arrivals is None:
            outs = [llm.submit(p, s).result() for p, s in requests]
        else:
            schedule: dict = {}
            for i, step in enumerate(arrivals):
                schedule.setdefault(step, []).append((i, *requests[i]))
            handles = drive(llm, schedule)
            outs = [handles[i].result() for i in range(len(requests))]
        logits = [{p: rows for p, rows in llm.device.logits.get(o.request_id, {}).items()} for o in outs]
        stats = llm.stats()
        assert_pool_full(llm)
    return outs, logits, stats


def assert_same_bits(cached: tuple, fresh: tuple) -> None:
    """Each request's tokens alike, and every position the cached run computed has the logits the run
    without the cache computed there."""
    (outs, logits, _), (outs0, logits0, _) = cached, fresh
    for out, out0, per, per0 in zip(outs, outs0, logits, logits0):
        assert out.token_ids == out0.token_ids and out.finish_reason == out0.finish_reason
        for position, rows in per.items():
            for row in rows:
                assert np.array_equal(row, per0[position][0]), position


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_a_shared_system_prompt_is_computed_once_and_every_request_keeps_its_bits(checkpoints, arch):
    rng = np.random.default_rng(5)
    system = tokens(rng, 21)
    requests = [(system + tokens(rng, int(rng.integers(1, 8))),
                 SamplingParams(max_new_tokens=int(rng.integers(2, 7)), ignore_eos=True,
                                **({"temperature": 0.8, "seed": 7 + i} if i % 2 else {})))
                for i in range(6)]
    engine = dict(max_batch=4, page_size=4)
    fresh = served(checkpoints[arch].folder, requests, prefix_caching=False, **engine)
    cached = served(checkpoints[arch].folder, requests, **engine)
    assert_same_bits(cached, fresh)
    # every request after the first finds the system prompt's five full pages (20 tokens)
    assert cached[2].cached_tokens == 5 * 20 and fresh[2].cached_tokens == 0
    assert cached[2].tokens == fresh[2].tokens - cached[2].cached_tokens
    for per in cached[1][1:]:
        assert min(per) == 20      # the positions before are read from the cache, never computed


def test_a_conversations_next_turn_reads_the_earlier_turns_pages(checkpoints):
    rng = np.random.default_rng(6)
    first = tokens(rng, 10)
    with LLM(checkpoints["qwen3"].folder, max_batch=2, page_size=4) as llm:
        reply = llm.submit(first, SamplingParams(max_new_tokens=7, ignore_eos=True)).result()
        # the first turn computed positions 0 .. 15 (its last token's keys and values are never needed)
        second = first + list(reply.token_ids) + tokens(rng, 3)
        answer = llm.submit(second, SamplingParams(max_new_tokens=2)).result()
        assert llm.stats().cached_tokens == 16 and (reply.cached_tokens, answer.cached_tokens) == (0, 16)
    fresh = served(checkpoints["qwen3"].folder, [(first, SamplingParams(max_new_tokens=7, ignore_eos=True)),
                                                 (second, SamplingParams(max_new_tokens=2))],
                   max_batch=2, page_size=4, prefix_caching=False)
    cached = served(checkpoints["qwen3"].folder, [(first, SamplingParams(max_new_tokens=7, ignore_eos=True)),
                                                  (second, SamplingParams(max_new_tokens=2))],
                    max_batch=2, page_size=4)
    assert_same_bits(cached, fresh)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_arrivals_sharing_prefixes_in_a_small_pool_keep_their_bits(checkpoints, seed):
    """Requests drawn from a few shared prefixes arrive at random steps into a pool too small for all of
    them, in steps of a few tokens: cached pages are evicted for new ones, requests are preempted and come
    back (perhaps to their own cached pages), and every request's tokens and logits are those of the run
    without the cache."""
    rng = np.random.default_rng(40 + seed)
    page_size = int(rng.choice([2, 4]))
    prefixes = [tokens(rng, int(rng.integers(3, 14))) for _ in range(3)]
    requests = [(prefixes[int(rng.integers(0, 3))] + tokens(rng, int(rng.integers(0, 5))),
                 SamplingParams(max_new_tokens=int(rng.integers(2, 8)), ignore_eos=True,
                                **({"temperature": 0.9, "top_p": 0.9, "seed": int(rng.integers(1 << 40))}
                                   if rng.random() < 0.5 else {})))
                for _ in range(12)]
    longest = max(len(p) + s.max_new_tokens for p, s in requests)
    # (steps of a few tokens: prompts span steps, their chunks ending inside pages while others arrive)
    engine = dict(max_batch=int(rng.integers(2, 5)), page_size=page_size, max_tokens_per_step=int(rng.integers(3, 9)),
                  kv_pages=-(-longest // page_size) + int(rng.integers(1, 4)))
    arrivals = [int(rng.integers(0, 30)) for _ in requests]
    arch = "llama3" if seed % 2 else "qwen3"
    fresh = served(checkpoints[arch].folder, requests, arrivals, prefix_caching=False, **engine)
    cached = served(checkpoints[arch].folder, requests, arrivals, **engine)
    assert_same_bits(cached, fresh)
    assert cached[2].cached_tokens > 0


def test_requests_of_one_prompt_admitted_together_each_compute_it_and_the_pool_stays_whole(checkpoints):
    rng = np.random.default_rng(8)
    prompt = tokens(rng, 13)
    requests = [(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))] * 3
    fresh = served(checkpoints["llama3"].folder, requests, [0, 0, 0], max_batch=3, page_size=4,
                   prefix_caching=False)
    cached = served(checkpoints["llama3"].folder, requests, [0, 0, 0], max_batch=3, page_size=4)
    assert_same_bits(cached, fresh)
    assert cached[2].cached_tokens == 0     # admitted in one step: none had finished a page before


def test_the_megakernel_device_refuses_the_prefix_cache(checkpoints):
    with pytest.raises(ServingError, match="no prefix cache"):
        LLM(checkpoints["llama3"].folder, device="megakernel", prefix_caching=True)
    with pytest.raises(ServingError, match="prefix_caching must be"):
        LLM(checkpoints["llama3"].folder, prefix_caching="yes")


def test_a_page_is_found_only_once_every_position_of_it_is_computed(checkpoints):
    """A prompt read three tokens a step: a request with the same prompt arriving a step later finds each
    page only once the first has computed all its positions (the first step's 3 of page 0's 4: none), and
    both keep the bits of the run without the cache."""
    rng = np.random.default_rng(9)
    prompt = tokens(rng, 14)
    requests = [(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))] * 2
    engine = dict(max_batch=2, page_size=4, max_tokens_per_step=3)
    fresh = served(checkpoints["qwen3"].folder, requests, [0, 1], prefix_caching=False, **engine)
    cached = served(checkpoints["qwen3"].folder, requests, [0, 1], **engine)
    assert_same_bits(cached, fresh)
    assert cached[2].cached_tokens == 0
    later = served(checkpoints["qwen3"].folder, requests, [0, 6], **engine)   # the first has read 12 by then
    assert_same_bits(later, fresh)
    assert later[2].cached_tokens == 12 and min(later[1][1]) == 12


def test_a_request_waiting_at_the_queues_head_names_its_pages_once(checkpoints, monkeypatch):
    """One batch slot: the second request waits at the queue's head while the first decodes 30 tokens. Its
    prompt's page keys are computed once, and kept for naming its pages once admitted: the run computes a
    page's key once for each request's pages (no more than both requests' full pages), not at every step."""
    import hashlib

    import mdsl.serving.prefix_cache as prefix_cache

    digests = []

    class Counting:
        @staticmethod
        def blake2b(*args, **kwargs):
            digests.append(1)
            return hashlib.blake2b(*args, **kwargs)

    monkeypatch.setattr(prefix_cache, "hashlib", Counting)
    rng = np.random.default_rng(10)
    requests = [(tokens(rng, 30), SamplingParams(max_new_tokens=30, ignore_eos=True)) for _ in range(2)]
    out = served(checkpoints["llama3"].folder, requests, [0, 0], max_batch=1, page_size=4, max_seq=64)
    assert out[2].steps > 50 and all(len(o.token_ids) == 30 for o in out[0])
    assert len(digests) <= 2 * (30 + 30) // 4

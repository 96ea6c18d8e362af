"""Continuous batching on the CPU device: a request's tokens and logits do not depend on what else runs,
when it arrives, or whether it was preempted and recomputed."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from mdsl import LLM, SamplingParams
from mdsl.serving.protocol import FREE, PREEMPTED, RUNNING
from mdsl.serving.sampling import allowed_tokens
from tests.serving.conftest import drive, random_prompts, wait_until



def alone(folder: str, requests: list) -> list:
    """Each (prompt, params) served by itself, one after another."""
    with LLM(folder, max_batch=1) as llm:
        return [llm.submit(prompt, params).result().token_ids for prompt, params in requests]


def assert_pool_full(llm) -> None:
    """No page held: each free, or cached and evictable (the prefix cache's)."""
    stats, prefix = llm.stats(), llm.device.prefix
    cached = len(prefix.evictable) if prefix is not None else 0
    assert stats.free_pages == stats.num_pages == llm.device.state["pool"]["free_count"][0] + cached
    assert prefix is None or not prefix.refs.any()
    assert np.all(llm.device.state["entries"]["state"] == FREE)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_32_requests_arriving_at_random_steps_match_alone_and_the_reference_bit_for_bit(checkpoints, arch, scheduler):
    ckpt = checkpoints[arch]
    rng = np.random.default_rng(1)
    prompts = random_prompts(rng, 32)
    lengths = [int(n) for n in rng.integers(3, 13, 32)]
    arrivals: dict = {}
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        arrivals.setdefault(int(rng.integers(0, 40)), []).append((i, prompt, SamplingParams(max_new_tokens=n)))
    # (no prefix cache: each request computes every position, batched and alone, and the logits of each are
    # compared; test_prefix_cache.py compares runs with the cache and without)
    with LLM(ckpt.folder, max_batch=32, page_size=4, prefix_caching=False) as llm:
        llm.device.record_logits = True
        handles = drive(llm, arrivals)
        batched = {i: h.result() for i, h in handles.items()}
        batched_logits = {i: llm.device.logits.pop(out.request_id) for i, out in batched.items()}
        assert llm.stats().peak_running >= 8          # they did share steps
        alone_logits = {}
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            out = llm.submit(prompt, SamplingParams(max_new_tokens=n)).result()
            assert out.token_ids == batched[i].token_ids
            alone_logits[i] = llm.device.logits.pop(out.request_id)
        assert_pool_full(llm)
    reference = ckpt.reference()
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        generation = reference.generate(prompt, n)
        assert batched[i].token_ids == generation.tokens and batched[i].finish_reason == "length"
        assert sorted(batched_logits[i]) == sorted(alone_logits[i]) == list(range(len(generation.logits)))
        for pos, row in enumerate(generation.logits):
            (mine,), (lone,) = batched_logits[i][pos], alone_logits[i][pos]
            assert np.array_equal(mine, row) and np.array_equal(lone, mine), (i, pos)


def test_seeded_sampling_is_reproducible_and_does_not_depend_on_the_batch(checkpoints, scheduler):
    ckpt = checkpoints["qwen3"]
    rng = np.random.default_rng(2)
    settings = [dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.7), dict(temperature=1.3, top_k=20,
                                                                                          top_p=0.8), dict(temperature=2.0)]
    prompts = random_prompts(rng, 8)
    sampled = [SamplingParams(seed=100 + i, max_new_tokens=10, **settings[i % 4]) for i in range(8)]
    fillers = random_prompts(rng, 12)
    arrivals: dict = {}
    for key, prompt, params in [*((i, p, s) for i, (p, s) in enumerate(zip(prompts, sampled))),
                                *((f"g{j}", p, SamplingParams(max_new_tokens=6)) for j, p in enumerate(fillers))]:
        arrivals.setdefault(int(rng.integers(0, 15)), []).append((key, prompt, params))
    with LLM(ckpt.folder, max_batch=20, page_size=4) as llm:
        llm.device.record_logits = True
        handles = drive(llm, arrivals)
        batched = [handles[i].result().token_ids for i in range(8)]
        for i, params in enumerate(sampled):       # every token is one the request's top-k / top-p allows
            rows = llm.device.logits[handles[i].request_id]
            for k, token in enumerate(batched[i]):
                (row,) = rows[len(prompts[i]) - 1 + k]
                assert token in allowed_tokens(row, params.temperature, params.top_k, params.top_p)
        reseeded = llm.generate(prompts, [SamplingParams(seed=900 + i, max_new_tokens=10, **settings[i % 4])
                                          for i in range(8)])
    assert batched == alone(ckpt.folder, list(zip(prompts, sampled)))
    assert sum(out.token_ids != mine for out, mine in zip(reseeded, batched)) >= 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_into_a_small_pool_wait_or_are_preempted_and_finish_as_alone(checkpoints, seed, scheduler):
    ckpt = checkpoints["llama3" if seed % 2 else "qwen3"]
    rng = np.random.default_rng(10 + seed)
    prompts = random_prompts(rng, 10, 2, 12)
    params = [SamplingParams(max_new_tokens=int(rng.integers(4, 10)), ignore_eos=True,
                             **({"temperature": 0.9, "top_p": 0.9, "seed": int(rng.integers(1 << 40))}
                                if rng.random() < 0.5 else {})) for _ in prompts]
    page_size = int(rng.choice([2, 4, 8]))
    longest = max(len(p) + s.max_new_tokens - 1 for p, s in zip(prompts, params))
    kv_pages = -(-longest // page_size) + int(rng.integers(0, 2))
    arrivals: dict = {}
    for i in rng.permutation(len(prompts)):
        arrivals.setdefault(int(rng.integers(0, 6)), []).append((int(i), prompts[i], params[i]))
    with LLM(ckpt.folder, max_batch=int(rng.integers(3, 6)), page_size=page_size, kv_pages=kv_pages) as llm:
        llm.device.record_logits = True
        handles = drive(llm, arrivals)
        outs = {i: h.result() for i, h in handles.items()}
        stats = llm.stats()
        assert stats.preemptions > 0 and sum(o.preemptions for o in outs.values()) == stats.preemptions
        # a recomputed position gives the logits it gave the first time
        recomputed = [rows for per in llm.device.logits.values() for rows in per.values() if len(rows) > 1]
        assert recomputed and all(np.array_equal(r, rows[0]) for rows in recomputed for r in rows)
        assert_pool_full(llm)
    expected = alone(ckpt.folder, list(zip(prompts, params)))
    assert [outs[i].token_ids for i in range(len(prompts))] == expected


def test_cancel_ends_running_preempted_queued_and_held_requests_and_frees_their_pages(checkpoints, scheduler):
    ckpt = checkpoints["llama3"]
    prompts = random_prompts(np.random.default_rng(3), 9, 8, 8)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    with LLM(ckpt.folder, max_batch=3, page_size=4, kv_pages=8) as llm:
        llm.device.hold()
        handles = [llm.submit(p, params) for p in prompts]
        wait_until(lambda: llm.device.queued() == 3, what="a full queue")
        assert llm.stats().host_pending == 6                 # the queue has 3 slots: 6 wait on the host
        entries = llm.device.state["entries"]
        for _ in range(40):
            llm.device.step()
            if np.any(entries["state"] == PREEMPTED):
                break
        # 3 admitted (one now preempted), 3 in the queue, 3 held on the host
        wait_until(lambda: llm.device.queued() == 3 and llm.stats().host_pending == 3, what="the queue refilled")
        by_id = {h.request_id: h for h in handles}
        preempted = by_id[int(entries["request"]["request_id"][np.flatnonzero(entries["state"] == PREEMPTED)[0]])]
        running = by_id[int(entries["request"]["request_id"][np.flatnonzero(entries["state"] == RUNNING)[0]])]
        queued_head, queued_other, on_host = handles[3], handles[4], handles[7]
        wait_until(lambda: len(running._tokens) > 0, what="a streamed token")
        for h in (running, preempted, queued_head, queued_other, on_host):
            h.cancel()
        assert on_host.result().finish_reason == "cancelled" and on_host.result().token_ids == ()
        llm.device.resume()
        outs = [h.result(timeout=60) for h in handles]
        on_host.cancel()                                     # after the end: nothing happens
        assert_pool_full(llm)
    cancelled = {h.request_id for h in (running, preempted, queued_head, queued_other, on_host)}
    reference = ckpt.reference()
    for prompt, out in zip(prompts, outs):
        full = reference.generate(prompt, 20).tokens
        if out.request_id in cancelled:
            assert out.finish_reason == "cancelled" and out.token_ids == full[:len(out.token_ids)]
        else:
            assert out.finish_reason == "length" and out.token_ids == full
    assert len(running.result().token_ids) > 0 and queued_head.result().token_ids == ()


def test_streams_arrive_in_order_without_duplicates_across_preemptions(checkpoints, scheduler):
    ckpt = checkpoints["qwen3"]
    prompts = random_prompts(np.random.default_rng(4), 10, 4, 8)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with LLM(ckpt.folder, max_batch=6, page_size=4, kv_pages=5) as llm:
        handles = [llm.submit(p, params) for p in prompts]
        streamed: dict = {}
        readers = [threading.Thread(target=lambda h=h: streamed.__setitem__(h.request_id, list(h))) for h in handles]
        for r in readers:
            r.start()
        for r in readers:
            r.join(timeout=120)
        assert llm.stats().preemptions > 0
        for prompt, h in zip(prompts, handles):
            out = h.result()
            assert streamed[h.request_id] == list(out.token_ids) == list(h)     # a second iterator: the same
            assert out.token_ids == ckpt.reference().generate(prompt, 12).tokens


def test_max_batch_bounds_the_requests_running_together(checkpoints, scheduler):
    ckpt = checkpoints["llama3"]
    prompts = random_prompts(np.random.default_rng(5), 10)
    with LLM(ckpt.folder, max_batch=3, page_size=4) as llm:
        running = []
        handles = [llm.submit(p, SamplingParams(max_new_tokens=5)) for p in prompts]
        llm.device.hold()
        while not all(h.done() for h in handles):
            if llm.device.step():
                running.append(llm.stats().running)
        llm.device.resume()
        assert max(running) == 3 == llm.stats().peak_running
    reference = ckpt.reference()
    assert [h.result().token_ids for h in handles] == [reference.generate(p, 5).tokens for p in prompts]


@pytest.mark.parametrize("damage", ["duplicate", "lost", "out of range"])
def test_a_damaged_page_pool_stops_the_device(checkpoints, damage, scheduler):
    from mdsl.serving.params import ServingError

    with LLM(checkpoints["llama3"].folder, max_batch=2, page_size=4) as llm:
        llm.device.hold()
        state = llm.device.state
        free = state["free_pages"]
        if damage == "duplicate":
            free[0] = free[1]
        elif damage == "lost":
            state["pool"]["free_count"] = int(state["pool"]["free_count"][0]) - 1
        else:
            free[0] = llm.shape.num_pages
        with pytest.raises(ServingError, match="lost or duplicated"):
            llm.device.step()
        llm.device.resume()          # the device thread finds the damage too, and stops

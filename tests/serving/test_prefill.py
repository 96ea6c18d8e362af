"""Steps with a token budget on the CPU device: every decode token, then chunks of prompts. A request's
tokens and logits do not depend on how its prompt is chunked nor on what shares its steps; a long
prompt spans several steps beside the decode tokens; the pool runs out with chunks and nothing is lost."""
from __future__ import annotations

import numpy as np
import pytest

from mdsl import LLM, SamplingParams
from mdsl.errors import MdslError
from mdsl.serving.protocol import CHUNK, STEP_ROW
from mdsl.serving.steprules import rows_times
from tests.serving.conftest import drive, wait_until

VOCAB = 96
CHUNK_SIZES = (1, 7, 64, 256)
LENGTHS = (1, 2, 7, 8, 15, 63, 64, 65, 130, 255, 256, 257, 300)


def prompt_of(rng, n: int) -> list:
    return [int(t) for t in rng.integers(0, VOCAB, n)]


def served(folder: str, requests: list, **engine) -> tuple:
    """(each request's RequestOutput, each request's logits: position -> row), the requests generated
    together, every row's logits recorded."""
    with LLM(folder, **engine) as llm:
        llm.device.record_logits = True
        outs = llm.generate([p for p, _ in requests], [s for _, s in requests])
        logits = [llm.device.logits.pop(out.request_id) for out in outs]
    return outs, logits


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_prompts_of_1_to_300_tokens_give_the_references_tokens_and_logits_under_every_chunk_size(long_checkpoints,
                                                                                                  arch, scheduler):
    ckpt = long_checkpoints[arch]
    rng = np.random.default_rng(20)
    requests = [(prompt_of(rng, n), SamplingParams(max_new_tokens=6, ignore_eos=True)) for n in LENGTHS]
    reference = ckpt.reference()
    generations = [reference.generate(p, 6) for p, _ in requests]
    first = None
    for size in CHUNK_SIZES:
        outs, logits = served(ckpt.folder, requests, max_batch=len(requests), max_tokens_per_step=size)
        for (prompt, _), out, rows, generation in zip(requests, outs, logits, generations):
            assert out.token_ids == generation.tokens, (size, len(prompt))
            assert sorted(rows) == list(range(len(generation.logits)))
            for pos, row in enumerate(generation.logits):
                (mine,) = rows[pos]
                assert np.array_equal(mine, row), (size, len(prompt), pos)
        if first is None:
            first = logits
        assert all(np.array_equal(rows[pos][0], ref[pos][0]) for rows, ref in zip(logits, first) for pos in rows)


def test_seeded_top_k_top_p_tokens_do_not_depend_on_the_chunk_size(long_checkpoints, scheduler):
    ckpt = long_checkpoints["qwen3"]
    rng = np.random.default_rng(21)
    settings = [dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.7),
                dict(temperature=1.3, top_k=20, top_p=0.8), dict(temperature=2.0)]
    requests = [(prompt_of(rng, n), SamplingParams(seed=500 + i, max_new_tokens=12, ignore_eos=True,
                                                   **settings[i % 4]))
                for i, n in enumerate((3, 40, 97, 200, 300, 128))]
    tokens = {size: [out.token_ids for out in served(ckpt.folder, requests, max_batch=6, max_tokens_per_step=size)[0]]
              for size in CHUNK_SIZES}
    assert tokens[1] == tokens[7] == tokens[64] == tokens[256]
    assert len({t for per in tokens[1] for t in per}) > 12        # they did sample, not decode greedily


def test_a_long_prompt_runs_in_chunks_beside_the_decode_tokens_and_every_request_matches_its_solo_run(
        long_checkpoints, scheduler):
    ckpt = long_checkpoints["llama3"]
    rng = np.random.default_rng(22)
    short = [prompt_of(rng, n) for n in (3, 9, 5, 12)]
    long_prompt = prompt_of(rng, 300)
    decode, prefill = SamplingParams(max_new_tokens=40, ignore_eos=True), SamplingParams(max_new_tokens=8,
                                                                                         ignore_eos=True)
    with LLM(ckpt.folder, max_batch=8, max_tokens_per_step=64, page_size=8) as llm:
        llm.device.hold()
        handles = [llm.submit(p, decode) for p in short]
        wait_until(lambda: llm.stats().host_pending == 0, what="publication")
        while not all(len(h._tokens) >= 2 for h in handles):
            llm.device.step()
        big = llm.submit(long_prompt, prefill)
        wait_until(lambda: llm.stats().host_pending == 0, what="publication")
        steps = []
        entries = llm.device.state["entries"]
        while not big.done():
            llm.device.step()
            header = llm.device.state["step"][0]
            chunks = llm.device.state["chunks"][:header["num_chunks"]].copy()
            rows = llm.device.state["rows"][:header["num_rows"]].copy()
            ids = [int(entries["request"]["request_id"][c["entry"]]) for c in chunks]
            steps.append((chunks, rows, ids))
        llm.device.resume()
        outs = [h.result() for h in handles] + [big.result()]
    # the prompt's chunks: 60 rows a step beside the 4 decode tokens, so 5 steps read its 300 tokens, and
    # each of them ran every decode token
    prefill_steps = [(c, r, ids) for c, r, ids in steps if big.request_id in ids and
                     c[ids.index(big.request_id)]["count"] > 1]
    assert [int(c[ids.index(big.request_id)]["count"]) for c, _, ids in prefill_steps] == [60] * 5
    for chunks, rows, ids in prefill_steps:
        assert len(rows) == 64 and sorted(ids) == sorted([h.request_id for h in handles] + [big.request_id])
        assert list(chunks["count"][:4]) == [1] * 4 and ids[4] == big.request_id     # decode tokens first
        assert list(chunks["row"]) == [0, 1, 2, 3, 4] and np.all(rows["chunk"][4:] == 4)
        first = int(chunks["start"][4])
        assert list(rows["position"][4:]) == list(range(first, first + 60))
        assert list(rows["token"][4:]) == long_prompt[first:first + 60]
        assert list(chunks["sample"]) == [1, 1, 1, 1, int(first + 60 == 300)]
    alone = []
    with LLM(ckpt.folder, max_batch=1) as llm:
        for prompt, params in [*((p, decode) for p in short), (long_prompt, prefill)]:
            alone.append(llm.submit(prompt, params).result().token_ids)
    assert [out.token_ids for out in outs] == alone


@pytest.mark.parametrize("length, steps", [(256, 4), (257, 5), (64, 1), (63, 1)])
def test_a_prompt_takes_one_step_per_chunk(long_checkpoints, length, steps, scheduler):
    prompt = prompt_of(np.random.default_rng(23), length)
    # (no prefix cache: the second run reads the prompt again; test_prefix_cache.py runs it from the cache)
    with LLM(long_checkpoints["qwen3"].folder, max_batch=4, max_tokens_per_step=64, prefix_caching=False) as llm:
        out = llm.submit(prompt, SamplingParams(max_new_tokens=1)).result()
        stats = llm.stats()
        assert len(out.token_ids) == 1
        assert (stats.steps, stats.tokens) == (steps, length)
        llm.submit(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True)).result()
        stats = llm.stats()            # and then two decode steps of one token
        assert (stats.steps, stats.tokens) == (2 * steps + 2, 2 * length + 2)


def test_a_chunk_takes_the_pages_of_all_its_positions_at_once(long_checkpoints, scheduler):
    with LLM(long_checkpoints["llama3"].folder, max_batch=2, page_size=8, max_tokens_per_step=50) as llm:
        llm.device.hold()
        llm.submit(prompt_of(np.random.default_rng(24), 120), SamplingParams(max_new_tokens=2))
        wait_until(lambda: llm.stats().host_pending == 0, what="publication")
        entries = llm.device.state["entries"]
        held = []
        for _ in range(3):
            llm.device.step()
            held.append((int(entries["context"][0]), int(entries["num_pages"][0])))
        llm.device.resume()
    assert held == [(50, 7), (100, 13), (120, 15)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_prompts_in_a_small_pool_wait_or_are_preempted_and_finish_as_alone(long_checkpoints, seed, scheduler):
    ckpt = long_checkpoints["qwen3" if seed % 2 else "llama3"]
    rng = np.random.default_rng(30 + seed)
    prompts = [prompt_of(rng, int(n)) for n in rng.integers(20, 90, 8)]
    params = [SamplingParams(max_new_tokens=int(rng.integers(4, 12)), ignore_eos=True,
                             **({"temperature": 0.9, "top_p": 0.9, "seed": int(rng.integers(1 << 40))}
                                if rng.random() < 0.5 else {})) for _ in prompts]
    page_size = int(rng.choice([4, 8]))
    longest = max(len(p) + s.max_new_tokens - 1 for p, s in zip(prompts, params))
    kv_pages = -(-longest // page_size) + int(rng.integers(2, 6))
    arrivals: dict = {}
    for i in rng.permutation(len(prompts)):
        arrivals.setdefault(int(rng.integers(0, 8)), []).append((int(i), prompts[i], params[i]))
    with LLM(ckpt.folder, max_batch=5, page_size=page_size, kv_pages=kv_pages,
             max_tokens_per_step=int(rng.choice([7, 16, 40]))) as llm:
        llm.device.record_logits = True
        handles = drive(llm, arrivals)
        outs = {i: h.result() for i, h in handles.items()}
        stats = llm.stats()
        assert stats.preemptions > 0 and sum(o.preemptions for o in outs.values()) == stats.preemptions
        recomputed = [rows for per in llm.device.logits.values() for rows in per.values() if len(rows) > 1]
        assert recomputed and all(np.array_equal(r, rows[0]) for rows in recomputed for r in rows)
        assert stats.free_pages == stats.num_pages
    with LLM(ckpt.folder, max_batch=1) as llm:
        expected = [llm.submit(p, s).result().token_ids for p, s in zip(prompts, params)]
    assert [outs[i].token_ids for i in range(len(prompts))] == expected


def test_a_budget_below_the_decoding_requests_runs_the_oldest_first_and_stalls_none_for_good(checkpoints, scheduler):
    ckpt = checkpoints["llama3"]
    rng = np.random.default_rng(25)
    prompts = [prompt_of(rng, int(n)) for n in rng.integers(1, 10, 5)]
    with LLM(ckpt.folder, max_batch=5, max_tokens_per_step=2) as llm:
        llm.device.hold()
        handles = [llm.submit(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in prompts]
        wait_until(lambda: llm.stats().host_pending == 0, what="publication")
        rows = []
        while not all(h.done() for h in handles):
            if llm.device.step():
                rows.append(llm.stats().step_tokens)
        llm.device.resume()
        assert max(rows) == 2
    reference = ckpt.reference()
    assert [h.result().token_ids for h in handles] == [reference.generate(p, 6).tokens for p in prompts]


def test_a_step_of_prompts_alone_takes_max_prefill_tokens_and_one_with_decode_tokens_max_tokens_per_step(
        long_checkpoints):
    ckpt = long_checkpoints["llama3"]
    rng = np.random.default_rng(27)
    first, second = prompt_of(rng, 300), prompt_of(rng, 300)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    with LLM(ckpt.folder, max_batch=4, max_tokens_per_step=64, max_prefill_tokens=128, prefix_caching=False) as llm:
        assert llm.shape.step_rows == 128 and llm.device.state["rows"].shape == (128,)
        llm.device.hold()
        steps = []     # (the step's rows, whether it ran a decode token)

        def step():
            if llm.device.step():
                header = llm.device.state["step"][0]
                chunks = llm.device.state["chunks"][:header["num_chunks"]]
                steps.append((int(header["num_rows"]), bool(np.any(chunks["count"] == 1))))

        a = llm.submit(first, params)
        wait_until(lambda: llm.stats().host_pending == 0, what="publication")
        while len(steps) < 3:   # its prompt, the first token sampled in the third step
            step()
        # (no step runs while the host's reader takes the token: stepping on would decode the first request to its
        # end before the second arrives wherever the reader lags, as on a loaded machine)
        wait_until(lambda: a._tokens, what="the first token")
        b = llm.submit(second, params)
        wait_until(lambda: llm.stats().host_pending == 0, what="publication")
        while not (a.done() and b.done()):
            step()
        llm.device.resume()
        outs = [a.result(), b.result()]
    # the first prompt alone: 128 + 128 + 44; then the second's chunks of 63 beside the first's two decode
    # tokens, and 128 at a time alone once the first has finished (128 + 46), then its decode tokens
    assert steps[:7] == [(128, False), (128, False), (44, False), (64, True), (64, True), (128, False), (46, False)]
    assert all(n == 1 and decode for n, decode in steps[7:]), steps
    reference = ckpt.reference()
    assert [out.token_ids for out in outs] == [reference.generate(p, 3).tokens for p in (first, second)]


@pytest.mark.parametrize("engine", [dict(max_tokens_per_step=64, max_prefill_tokens=32), dict(max_prefill_tokens=0),
                                    dict(max_prefill_tokens=2.5), dict(device="megakernel", max_prefill_tokens=1024)])
def test_a_bad_prefill_budget_raises_an_mdsl_error(checkpoints, engine):
    with pytest.raises(MdslError, match="max_prefill_tokens"):
        LLM(checkpoints["llama3"].folder, **engine)


def test_the_cpu_device_reads_prompts_in_steps_of_max_tokens_per_step_by_default(checkpoints):
    with LLM(checkpoints["llama3"].folder, max_tokens_per_step=48) as llm:
        assert (llm.shape.max_prefill_tokens, llm.shape.step_rows) == (48, 48)


def test_the_step_layouts_are_the_documented_records():
    assert CHUNK.size == 24 and STEP_ROW.size == 12
    assert list(CHUNK.offsets) == ["entry", "start", "count", "row", "sample", "pad"]


def test_a_rows_product_does_not_depend_on_the_rows_beside_it():
    rng = np.random.default_rng(26)
    w = rng.standard_normal((97, 129)).astype(np.float32)
    x = rng.standard_normal((70, 129)).astype(np.float32)
    whole = rows_times(x, w)
    assert all(np.array_equal(whole[i], (x[i:i + 1] @ w.T)[0]) for i in range(70))
    assert np.array_equal(rows_times(x[5:12], w), whole[5:12])


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_a_bad_token_budget_raises_an_mdsl_error(checkpoints, value):
    with pytest.raises(MdslError, match="max_tokens_per_step"):
        LLM(checkpoints["llama3"].folder, max_tokens_per_step=value)

"""The CPU device's plain decode steps (every running entry decodes one token, nothing to admit or preempt),
planned, written and ended over arrays of entries (from CpuDevice.VECTOR_DECODE_ENTRIES entries), leave every
step's state and ring records exactly as the general path's do: two engines, one with it and one without, stepped in lockstep
on the same arrivals, cancellations, stop tokens, length limits, page pressure and prefix cache; the first takes
its tokens as an array in chunk order where every chunk samples (as the GPU device's greedy tokens come)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from mdsl import LLM, SamplingParams
from tests.serving.conftest import VOCAB, random_prompts, wait_until


def _published(llm) -> None:
    wait_until(lambda: llm.stats().host_pending == 0 or llm.device.queued() == llm.shape.queue_slots,
               what="publication")


def _recording(dev) -> list:
    """Every ring record the device writes, in order (its _emit_columns, wrapped)."""
    records: list = []
    emit = dev._emit_columns

    def recorded(columns):
        records.extend(zip(*(np.asarray(c).tolist() for c in columns)))
        emit(columns)

    dev._emit_columns = recorded
    return records


def _anonymous(values: np.ndarray) -> np.ndarray:
    """A state array with its entries' request ids and seeds zeroed (each engine draws its own; the requests
    are greedy)."""
    if values.dtype.names and "request" in values.dtype.names:
        values = values.copy()
        values["request"]["request_id"] = values["request"]["seed"] = 0
    return values


def _keyed(records: list, handles: dict) -> list:
    """Ring records with each request id replaced by the request's key in the test."""
    key = {h.request_id: i for i, h in handles.items()}
    return [(key[r[0]], *r[1:]) for r in records]


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("kv_pages", [None, 24])
@pytest.mark.timeout(240)
def test_plain_decode_steps_over_arrays_leave_the_state_and_records_of_the_general_path(checkpoints, prefix_caching,
                                                                                          kv_pages):
    ckpt = checkpoints["qwen3"]
    rng = np.random.default_rng(7 + (kv_pages or 0))
    shared = [int(t) for t in rng.integers(0, VOCAB, 9)]   # (a prefix several prompts start with: cache hits)
    prompts = [shared + p if i % 3 == 0 else p for i, p in enumerate(random_prompts(rng, 24, 1, 14))]
    params = [SamplingParams(max_new_tokens=int(rng.integers(1, 30)), ignore_eos=True,
                             stop_token_ids=tuple(int(t) for t in rng.integers(0, VOCAB, 3)) if i % 2 else ())
              for i in range(len(prompts))]
    arrivals: dict = {}
    for i in range(len(prompts)):
        arrivals.setdefault(int(rng.integers(0, 30)), []).append(i)
    arrival = {i: step for step, keys in arrivals.items() for i in keys}
    # (requests with no stop token and many to produce, cancelled a few steps after they arrive: still queued
    # or running then)
    long = [i for i in range(0, len(prompts), 2) if params[i].max_new_tokens >= 12]
    cancels = {arrival[i] + 3: i for i in long[:3]}
    engines = [LLM(ckpt.folder, max_batch=12, page_size=4, kv_pages=kv_pages, prefix_caching=prefix_caching)
               for _ in range(2)]
    engines[0].device.VECTOR_DECODE_ENTRIES = 1     # (over arrays at any batch: the equality is what is tested)
    engines[1].device.VECTOR_DECODE_ENTRIES = 13    # (never: more than max_batch)
    records = [_recording(llm.device) for llm in engines]
    counts = {"vector": 0, "array": 0}
    begin = engines[0].device._begin_decode

    def counted(*decoding):
        counts["vector"] += 1
        return begin(*decoding)

    engines[0].device._begin_decode = counted
    samples = engines[0].device._samples

    def as_array(logits):
        # the tokens as the GPU device gives them where every chunk samples greedily: an array in chunk order
        tokens = samples(logits)
        n = int(engines[0].device.state["step"]["num_chunks"][0])
        if n and len(tokens) == n:
            counts["array"] += 1
            return np.array([tokens[c] for c in range(n)], np.int32)
        return tokens

    engines[0].device._samples = as_array
    handles: list = [{}, {}]
    try:
        for llm in engines:
            llm.device.hold()
        for step in range(5000):
            for i in arrivals.get(step, ()):
                for llm, h in zip(engines, handles):
                    h[i] = llm.submit(prompts[i], params[i])
            if step in cancels and cancels[step] in handles[0]:
                for h in handles:
                    h[cancels[step]].cancel()
            for llm in engines:
                _published(llm)
            if step > max(arrivals) and all(h.done() for h in handles[0].values()):
                break
            worked = [llm.device.step() for llm in engines]
            assert worked[0] == worked[1], step
            if not worked[0]:
                time.sleep(0.001)     # nothing ran: the host threads are still reading the last records
            for name, value in engines[1].device.state.items():
                assert np.array_equal(_anonymous(engines[0].device.state[name]), _anonymous(value)), (step, name)
            assert _keyed(records[0], handles[0]) == _keyed(records[1], handles[1]), step
        else:
            raise AssertionError("the requests did not finish")
        stats = engines[0].stats()
        for llm in engines:
            llm.device.resume()
        outputs = [{i: h[i].result(timeout=60) for i in h} for h in handles]
        assert {i: (o.token_ids, o.finish_reason) for i, o in outputs[0].items()} == \
            {i: (o.token_ids, o.finish_reason) for i, o in outputs[1].items()}
    finally:
        for llm in engines:
            llm.close()
    assert counts["vector"] >= 20          # the plain decode steps ran over arrays
    assert counts["array"] >= 20           # ... and steps ended from an array of tokens
    assert stats.preemptions > 0 if kv_pages else stats.preemptions == 0     # (a small pool preempts)
    assert stats.cached_tokens > 0 if prefix_caching else stats.cached_tokens == 0
    reasons = {o.finish_reason for o in outputs[0].values()}
    assert {"length", "stop", "cancelled"} <= reasons, reasons

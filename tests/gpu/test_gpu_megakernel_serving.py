"""The megakernel serving device (`LLM(..., device="megakernel")`: the scheduler and every step in one resident
kernel) on an H100/H200 with tiny random Llama-3 and Qwen3 checkpoints (float32 and bfloat16): requests of 1 to 40
prompt tokens arriving at different steps, more than the batch holds, give the CPU device's greedy tokens (up to a
near-tie of its logits) and each request's tokens alone, bit for bit, at budgets of 1, 7 and 64 rows a step; a pool
small enough to preempt changes no token; seeded top-k / top-p requests repeat whatever shares their steps; a
launch that ends at its step limit is followed by the next without a changed token; close() stops the kernel, with
requests in flight too, and leaves every page free; the task profile records whole steps; a damaged page pool stops
the kernel.

    pytest tests/gpu/test_gpu_megakernel_serving.py -m gpu
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from mdsl import LLM, SamplingParams
from mdsl.gpu import has_gpu
from mdsl.serving.protocol import FREE
from tests.megakernel.test_serving_emulation import on_the_cpu_device, pool_pages, requests
from tests.serving.conftest import wait_until, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="no GPU")]

POSITIONS = 64
TIMEOUT = 180.0
#: a token may differ from the CPU device's only where the CPU's two best logits are this close (a share of the row's
#: largest logit): float32 sums in other orders; bfloat16 rounds every activation the kernel stores (transformers'
#: bf16 arithmetic), where the CPU device keeps float32 activations
TIE = {"float32": 1e-3, "bfloat16": 0.15}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return {(arch, dtype): write_checkpoint(tmp_path_factory.mktemp(f"{arch}-{dtype}"), arch, seed=5,
                                            positions=POSITIONS, torch_dtype=dtype)
            for arch in ("llama3", "qwen3") for dtype in ("float32", "bfloat16")}


def serve(folder: str, arrivals: dict, **engine) -> tuple:
    """`arrivals` (step -> [(key, prompt, params)]) served by the megakernel: each step's requests submitted once the
    device has run that many steps (or has nothing in flight). (key -> RequestOutput, the stats once the engine is
    closed, the device)."""
    with LLM(folder, device="megakernel", **engine) as llm:
        handles: dict = {}
        for step in sorted(arrivals):
            wait_until(lambda: llm.stats().steps >= step or all(h.done() for h in handles.values()), TIMEOUT,
                       f"step {step}")
            for key, prompt, params in arrivals[step]:
                handles[key] = llm.submit(prompt, params)
        outputs = {key: h.result(timeout=TIMEOUT) for key, h in handles.items()}
    return outputs, llm.stats(), llm.device   # after close: the kernel has stopped


def alone(folder: str, arrivals: dict, **engine) -> dict:
    """key -> each request's tokens served alone (one after another on one megakernel)."""
    with LLM(folder, device="megakernel", **engine) as llm:
        return {key: llm.submit(prompt, params).result(timeout=TIMEOUT).token_ids
                for batch in arrivals.values() for key, prompt, params in batch}


def params_of(arrivals: dict, key) -> SamplingParams:
    return next(params for batch in arrivals.values() for k, _, params in batch if k == key)


def agree_with_the_cpu(outputs: dict, cpu: tuple, dtype: str) -> None:
    """Every greedy token the CPU device's, or the first that differs at a near-tie of the CPU's logits (after which
    the request goes its own way); most tokens agree (in float32; bfloat16's rounded activations part sooner)."""
    want, logits = cpu
    agreed = total = 0
    for key, out in outputs.items():
        theirs = want[key].token_ids
        total += len(theirs)
        end = len(out.prompt_token_ids) - 1
        for k, (a, b) in enumerate(zip(out.token_ids, theirs)):
            if a != b:
                row = logits[key][end + k][0]
                top2 = np.sort(row)[-2:]
                assert top2[1] - top2[0] <= TIE[dtype] * max(1.0, float(np.abs(row).max())), (key, k, a, b, top2)
                break
            agreed += 1
        else:
            assert out.token_ids == theirs, key
    assert agreed >= (0.8 if dtype == "float32" else 0.5) * total, (agreed, total)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("arch", "budget"), [("llama3", 7), ("qwen3", 64), ("qwen3", 1)])
def test_requests_give_the_cpu_devices_tokens_and_their_tokens_alone(checkpoints, arch, budget, dtype):
    folder = checkpoints[arch, dtype].folder
    rng = np.random.default_rng(budget * 10 + len(dtype))
    arrivals = requests(rng, 5 if budget == 1 else 12, 10)
    greedy = {step: [(key, prompt, SamplingParams(max_new_tokens=params.max_new_tokens, ignore_eos=True))
                     for key, prompt, params in batch] for step, batch in arrivals.items()}
    engine = dict(max_batch=4, page_size=4, max_tokens_per_step=budget)
    outputs, stats, device = serve(folder, greedy, **engine)
    assert stats.status == "stopped" and not device.alive and device.error is None
    assert stats.peak_running >= (1 if budget == 1 else 2) and stats.steps > 0
    solo = alone(folder, greedy, **engine)
    for key, out in outputs.items():
        assert out.finish_reason == "length" and len(out.token_ids) == params_of(greedy, key).max_new_tokens
        assert out.token_ids == solo[key], key
    agree_with_the_cpu(outputs, on_the_cpu_device(folder, greedy, **engine), dtype)


def test_rows_wide_enough_to_slice_k_among_warps_give_their_tokens_alone(tmp_path):
    """A bfloat16 model whose linear tasks take the tensor cores' longer paths (serve_tensor.cuh): K of several runs
    sliced among a task's warps (2 to 6 slices summed in shared memory), several 16-row tiles and, at 64 rows a
    step, two groups of staged rows (the 1536-wide down-projection stages 48 at a time)."""
    folder = write_checkpoint(tmp_path, "qwen3", seed=7, positions=POSITIONS, torch_dtype="bfloat16",
                              hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                              num_key_value_heads=4, head_dim=64).folder
    rng = np.random.default_rng(11)
    arrivals = {step: [(key, prompt, SamplingParams(max_new_tokens=params.max_new_tokens, ignore_eos=True))
                       for key, prompt, params in batch] for step, batch in requests(rng, 12, 4).items()}
    engine = dict(max_batch=8, page_size=4, max_tokens_per_step=64)
    outputs, stats, _ = serve(folder, arrivals, **engine)
    assert stats.peak_running >= 2 and stats.status == "stopped"
    solo = alone(folder, arrivals, **engine)
    for key, out in outputs.items():
        assert out.token_ids == solo[key], key
    agree_with_the_cpu(outputs, on_the_cpu_device(folder, arrivals, **engine), "bfloat16")


def test_a_pool_small_enough_to_preempt_changes_no_token(checkpoints):
    folder = checkpoints["qwen3", "float32"].folder
    rng = np.random.default_rng(11)
    arrivals = requests(rng, 10, 4)
    engine = dict(max_batch=5, page_size=4, max_tokens_per_step=7)
    outputs, stats, device = serve(folder, arrivals, kv_pages=pool_pages(arrivals, 4, 2), **engine)
    assert stats.preemptions > 0
    roomy, _, _ = serve(folder, arrivals, **engine)
    for key, out in outputs.items():
        assert out.token_ids == roomy[key].token_ids, key
    state = device.device_state()
    assert state["pool"]["free_count"][0] == stats.num_pages and (state["entries"]["state"] == FREE).all()


def test_seeded_sampling_repeats_whatever_shares_its_steps(checkpoints):
    folder = checkpoints["llama3", "bfloat16"].folder
    rng = np.random.default_rng(12)
    arrivals = requests(rng, 10, 6)   # (greedy and seeded top-k / top-p requests)
    late = {3 * step + 1: batch for step, batch in arrivals.items()}
    first, _, _ = serve(folder, arrivals, max_batch=4, page_size=4, max_tokens_per_step=7)
    second, _, _ = serve(folder, late, max_batch=6, page_size=8, max_tokens_per_step=64)
    solo = alone(folder, arrivals, max_batch=2, page_size=4, max_tokens_per_step=3)
    for key, out in first.items():
        assert out.token_ids == second[key].token_ids == solo[key], key


def test_launches_that_end_at_their_step_limit_change_no_token(checkpoints, monkeypatch):
    from mdsl.megakernel.runtime import serving_engine

    folder = checkpoints["llama3", "float32"].folder
    rng = np.random.default_rng(13)
    arrivals = requests(rng, 6, 6)
    engine = dict(max_batch=4, page_size=4, max_tokens_per_step=7)
    whole, _, _ = serve(folder, arrivals, **engine)
    monkeypatch.setattr(serving_engine, "steps_per_launch", lambda plan: 3)   # two steps a launch
    outputs, stats, device = serve(folder, arrivals, **engine)
    assert device.launches > stats.steps // 2 >= 2
    for key, out in outputs.items():
        assert out.token_ids == whole[key].token_ids, key


def test_close_stops_the_kernel_with_requests_in_flight_and_frees_every_page(checkpoints):
    folder = checkpoints["qwen3", "bfloat16"].folder
    llm = LLM(folder, device="megakernel", max_batch=4, page_size=4)
    running = [llm.submit([1 + k, 2, 3], SamplingParams(max_new_tokens=POSITIONS - 8, ignore_eos=True))
               for k in range(6)]
    wait_until(lambda: any(len(h.poll()[0]) > 2 for h in running), TIMEOUT, "a few tokens")
    llm.close(timeout=60)
    assert not llm.device.alive and llm.device.error is None and llm.stats().status == "stopped"
    for handle in running:
        out = handle.result(timeout=10)
        assert out.finish_reason in ("cancelled", "length")
    state = llm.device.device_state()
    assert state["pool"]["free_count"][0] == llm.shape.num_pages and (state["entries"]["state"] == FREE).all()
    # an idle kernel waits for work (past the watchdog's 5 s), then serves, then shuts down
    with LLM(folder, device="megakernel", max_batch=2, page_size=4) as idle:
        wait_until(lambda: idle.stats().status == "serving", TIMEOUT, "serving")
        time.sleep(6.0)
        assert idle.device.alive
        out = idle.submit([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True)).result(timeout=TIMEOUT)
        assert len(out.token_ids) == 4
    assert not idle.device.alive and idle.device.error is None


def test_the_profile_records_every_task_of_the_steps_it_was_on_for(checkpoints):
    """MegakernelDevice.profile on while a request decodes, then off: the ring's complete steps hold every task of
    the serving tables once, on an SM of the GPU, its times in order (taken, inputs ready, body started, done)."""
    folder = checkpoints["qwen3", "bfloat16"].folder
    with LLM(folder, device="megakernel", max_batch=2, page_size=4) as llm:
        handle = llm.submit([1, 2, 3], SamplingParams(max_new_tokens=POSITIONS - 8, ignore_eos=True))
        wait_until(lambda: len(handle.poll()[0]) > 1, TIMEOUT, "a token")
        start = llm.stats().steps
        llm.device.profile(True)
        wait_until(lambda: llm.stats().steps >= start + 12, TIMEOUT, "12 steps")
        llm.device.profile(False)
        stop = llm.stats().steps
        wait_until(lambda: llm.stats().steps >= stop + 2, TIMEOUT, "2 more steps")
        steps = llm.device.profile_records()
        labels, kinds, layers = llm.device.profile_tasks()
        handle.cancel()
    assert steps and len(labels) == len(kinds) == len(layers)
    for step, records in steps.items():
        assert [r.index for r in records] == [step * len(kinds) + k for k in range(len(kinds))]
        for r in records:
            assert 0 < r.taken_ns <= r.ready_ns <= r.started_ns <= r.done_ns and r.sm < 1024, r


def test_a_damaged_page_pool_stops_the_kernel_at_its_next_step(checkpoints):
    """A page put twice on the free stack (written into the device's memory while the kernel waits for work): the
    block's pool check at the next step finds it, the kernel stops and the request fails with the pool's error."""
    from mdsl.gpu.driver import check, driver
    from mdsl.serving.params import ServingError
    from mdsl.serving.protocol import device_region

    folder = checkpoints["llama3", "float32"].folder
    with LLM(folder, device="megakernel", max_batch=2, page_size=4) as llm:
        first = llm.submit([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True)).result(timeout=TIMEOUT)
        assert len(first.token_ids) == 4
        wait_until(lambda: llm.stats().running == 0, TIMEOUT, "an idle kernel")
        kernel = llm.device.kernel
        at = kernel.params.device_state + device_region(llm.shape).offsets["free_pages"]
        pages = np.zeros(2, np.int32)
        check(driver.cuMemcpyDtoH(pages.ctypes.data, at, 8), "cuMemcpyDtoH")
        pages[0] = pages[1]
        check(driver.cuMemcpyHtoD(at, pages.ctypes.data, 8), "cuMemcpyHtoD")
        handle = llm.submit([4, 5, 6], SamplingParams(max_new_tokens=4, ignore_eos=True))
        with pytest.raises(ServingError, match="lost or duplicated"):
            handle.result(timeout=TIMEOUT)
        wait_until(lambda: not llm.device.alive, TIMEOUT, "the kernel stopped")
        assert isinstance(llm.device.error, ServingError)

"""The GPU serving device (`LLM(..., device="gpu")`) on tiny checkpoints (float32 and bfloat16 weights):
for Llama-3, Qwen3, Qwen2, Mistral, Phi-3, Gemma-2, Qwen3-MoE and Qwen2-MoE, its logits agree with the CPU device's (the
reference's bits, which match transformers) within float32 rounding, and within the 16-bit roundings of the
keys, values and linears' inputs for 16-bit checkpoints, and its greedy tokens equal them up to a near-tie; its
16-bit pools hold the CPU device's values; a request's logits are bit-identical whatever shares its steps,
when it arrives and however its prompt is chunked; seeded sampling repeats; a full page pool preempts and
recomputes without changing a token."""
from __future__ import annotations

import numpy as np
import pytest

from mdsl import LLM, SamplingParams
from mdsl.gpu import has_gpu
from tests.serving.conftest import arrivals_of, drive, random_prompts, write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="no GPU")]

#: the GPU's logits within this share of a row's largest logit of the CPU device's: float32 rounding; with a
#: 16-bit checkpoint also keys, values and linears' inputs rounded to the neighbouring 16-bit value (the
#: GPU's float32 values differ from the CPU's in their last bits, which may fall on either side of a rounding
#: boundary: a step of up to 2^-7 of the value in bfloat16), which moves these tiny models' logits by up to
#: about 3% (emulated on the CPU with every value off by 3e-5 of itself before its rounding)
TOLERANCE = {"float32": 1.6e-4, "bfloat16": 2.0 ** -4}


class Checkpoints(dict):
    """(architecture, dtype) -> a tiny random checkpoint, written when first asked for."""

    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def __missing__(self, key):
        arch, dtype, *wide = key   # (wide: rows of that many values, a multiple of 128: norm_squares)
        shape = dict(hidden_size=wide[0], intermediate_size=64) if wide else {}
        self[key] = write_checkpoint(self.factory.mktemp(f"{arch}-{dtype}"), arch, positions=320, torch_dtype=dtype,
                                     **shape)
        return self[key]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return Checkpoints(tmp_path_factory)


def served(folder: str, device: str, arrivals: dict, capture: bool = True, attention_grid: int = 0,
           **kwargs) -> tuple:
    """(key -> RequestOutput, key -> {position: [logits rows]}, peak running) of `arrivals` driven step by step
    (on the GPU, with steps replayed as CUDA graphs or not: none fails to capture). `attention_grid`: the
    tensor-core attention's persistent grid in place of the GPU's (a few blocks, so that a step's decode
    rows outnumber them and run solo: attention_solo)."""
    with LLM(folder, device=device, **kwargs) as llm:
        llm.device.record_logits = True
        llm.device.capture = capture
        if attention_grid:
            llm.device.attention_grid = attention_grid
        handles = drive(llm, arrivals)
        outputs = {k: h.result() for k, h in handles.items()}
        logits = {k: llm.device.logits.pop(out.request_id) for k, out in outputs.items()}
        if device == "gpu":
            assert not llm.device._uncaptured
            assert (llm.device.replays > 0) == capture
        return outputs, logits, llm.stats().peak_running


def agree(gpu: tuple, cpu: tuple, prompts: list, dtype: str = "float32") -> None:
    """The GPU device's logits equal the CPU device's within TOLERANCE (of the checkpoint's dtype), and its
    tokens up to a near-tie, a top-2 margin within twice that or 1e-3 (after which a request goes its own way)."""
    (gpu, gpu_logits, _), (cpu, cpu_logits, _) = gpu, cpu
    tolerance = TOLERANCE[dtype]
    tie = max(1e-3, 2 * tolerance)
    agreed = 0
    for i in range(len(prompts)):
        ours, theirs = gpu[i].token_ids, cpu[i].token_ids
        n = len(prompts[i])
        for k, (a, b) in enumerate(zip(ours, theirs)):
            row = cpu_logits[i][n - 1 + k][0]
            mine = gpu_logits[i][n - 1 + k][0]
            scale = float(np.max(np.abs(row)))
            np.testing.assert_allclose(mine, row, rtol=0, atol=tolerance * max(1.0, scale), err_msg=f"request {i}")
            if a != b:     # only a near-tie in the CPU device's logits may break the other way
                top2 = np.sort(row)[-2:]
                assert top2[1] - top2[0] <= tie * max(1.0, scale), (i, k, a, b, top2)
                break
            agreed += 1
        else:
            assert ours == theirs
    assert agreed >= 0.9 * sum(len(o.token_ids) for o in cpu.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama3", "qwen3", "qwen2", "mistral", "phi3", "gemma2", "qwen3_moe", "qwen2_moe"])
def test_32_requests_agree_with_the_cpu_device(checkpoints, arch, dtype):
    ckpt = checkpoints[arch, dtype]
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, 32)
    params = [SamplingParams(max_new_tokens=int(n)) for n in rng.integers(3, 13, 32)]
    arrivals = arrivals_of(rng, prompts, params, 40)
    gpu = served(ckpt.folder, "gpu", arrivals, max_batch=32, page_size=4)
    cpu = served(ckpt.folder, "cpu", arrivals, max_batch=32, page_size=4)
    assert gpu[2] >= 8
    agree(gpu, cpu, prompts, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_pools_hold_the_cpu_devices_keys_and_values(checkpoints, dtype):
    """kv_append rounds to nearest even as the CPU device does: the first layer's pools (prompt positions only,
    so that no sampled token differs) are the CPU device's values, but where the GPU's float32 key or value
    fell on the other side of a rounding boundary: then the neighbouring 16-bit value. Deeper layers' keys and
    values come from inputs that already differ in their last bits (the two devices' sums in other orders):
    16-bit values, within a few 16-bit steps of the pool's scale."""
    from mdsl.ir.dtypes import bf16, f16, round_to_dtype

    kind, step = {"bfloat16": (bf16, 2.0 ** -7), "float16": (f16, 2.0 ** -10)}[dtype]
    ckpt = checkpoints["qwen3", dtype]
    rng = np.random.default_rng(13)
    prompts = random_prompts(rng, 16, 1, 40)
    params = [SamplingParams(max_new_tokens=1)] * 16
    arrivals = arrivals_of(rng, prompts, params, 8)
    pools = {}
    for device in ("gpu", "cpu"):
        with LLM(ckpt.folder, device=device, max_batch=8, page_size=4, kv_pages=48) as llm:
            drive(llm, arrivals)
            pools[device] = llm.device.kv_pools()
    assert sorted(pools["gpu"]) == sorted(pools["cpu"])
    for name, cpu in pools["cpu"].items():
        gpu, written = pools["gpu"][name], cpu != 0
        assert gpu.shape == cpu.shape and np.count_nonzero(written) > 1000
        assert np.array_equal(round_to_dtype(gpu, kind), gpu) and not np.any(gpu[~written])
        same = gpu == cpu
        if name.endswith(".0"):
            assert same[written].mean() > 0.8, (name, same[written].mean())   # (a truncating rounding: half)
            assert np.all(np.abs(gpu - cpu)[~same] <= step * np.abs(cpu)[~same] + 2.0 ** -24), name
        else:
            assert same[written].mean() > 0.5, (name, same[written].mean())
            assert np.abs(gpu - cpu).max() <= 4 * step * np.abs(cpu).max(), name


@pytest.mark.parametrize("arch", ["llama3", "mistral", "gemma2"])
def test_contexts_of_several_attention_splits_agree_with_the_cpu_device(tmp_path, arch):
    """Contexts of several attention splits (64 keys each at these ranges): the splits' partials folded in
    order (a sliding window of 270 keys and Gemma-2's soft-capping included)."""
    window = {} if arch == "llama3" else {"sliding_window": 270}
    ckpt = write_checkpoint(tmp_path, arch, positions=320, torch_dtype="float32", **window)
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, 6, 240, 300)
    params = [SamplingParams(max_new_tokens=6) for _ in prompts]
    arrivals = arrivals_of(rng, prompts, params, 4)
    gpu = served(ckpt.folder, "gpu", arrivals, max_batch=6, page_size=16)
    cpu = served(ckpt.folder, "cpu", arrivals, max_batch=6, page_size=16)
    agree(gpu, cpu, prompts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_long_rows_splits_follow_its_own_range(tmp_path, dtype):
    """Ranges past SPLIT_KEYS * MAX_SPLITS keys take longer splits (128 keys from 4097 keys on): a request
    across that length agrees with the CPU device, and its logits are the same bits under engines of
    different max_seq and step budgets, alone or beside other requests (the split is the row's own)."""
    from mdsl.serving.gpu import MAX_SPLITS, SPLIT_KEYS

    longest = SPLIT_KEYS * MAX_SPLITS + 64
    ckpt = write_checkpoint(tmp_path, "llama3", positions=2 * longest, torch_dtype=dtype)
    rng = np.random.default_rng(12)
    prompts = random_prompts(rng, 1, longest - 64, longest - 56) + random_prompts(rng, 3, 20, 200)
    params = [SamplingParams(max_new_tokens=8)] * 4
    alone = {0: [(0, prompts[0], params[0])]}
    shared = {0: [(1, prompts[1], params[1])], 2: [(0, prompts[0], params[0]), (2, prompts[2], params[2])],
              9: [(3, prompts[3], params[3])]}
    short = served(ckpt.folder, "gpu", alone, max_batch=1, page_size=16, max_seq=longest)
    roomy = served(ckpt.folder, "gpu", shared, max_batch=4, page_size=16, max_seq=2 * longest,
                   max_tokens_per_step=61)
    cpu = served(ckpt.folder, "cpu", alone, max_batch=1, page_size=16, max_seq=longest)
    agree(short, cpu, prompts[:1], dtype)
    assert short[0][0].token_ids == roomy[0][0].token_ids
    assert sorted(short[1][0]) == sorted(roomy[1][0]) and max(short[1][0]) > SPLIT_KEYS * MAX_SPLITS
    for pos, (row,) in short[1][0].items():
        assert np.array_equal(row, roomy[1][0][pos][0]), pos


def test_the_op_profile_times_every_op_and_leaves_the_tokens_alone(checkpoints):
    ckpt = checkpoints["qwen3", "bfloat16"]
    prompts = random_prompts(np.random.default_rng(9), 4, 20, 40)
    params = SamplingParams(max_new_tokens=12)
    with LLM(ckpt.folder, device="gpu", max_batch=4, page_size=16) as llm:
        plain = [h.result().token_ids for h in [llm.submit(p, params) for p in prompts]]
        llm.device.profile_ops(True)
        profiled = [h.result().token_ids for h in [llm.submit(p, params) for p in prompts]]
        ops = llm.device.profile_ops(False)
        llm.device.profile_ops(True, kernels=True)
        by_kernel = [h.result().token_ids for h in [llm.submit(p, params) for p in prompts]]
        kernels = llm.device.profile_ops(False)
        nodes = {n.op for n in llm.device.nodes}
    assert profiled == plain and by_kernel == plain
    # (ops fused with the one after them are timed together, as "a+b")
    assert nodes == {op for name in ops if name != "gather" for op in name.split("+")}
    assert all(us > 0 and steps > 0 for us, steps in ops.values())
    # by kernel: "op: kernel" for every op that launches (an op's kernels named as launched)
    assert {name.split(": ")[0] for name in kernels} == set(ops)
    assert all(": " in name and us > 0 and steps > 0 for name, (us, steps) in kernels.items())
    assert any(name.startswith("attention: attention") for name in kernels)


def chunked_runs(folder: str, prompts: list, params: list, seed: int, steps: int) -> dict:
    """max_tokens_per_step -> served(...) of the requests arriving at random steps below `steps` (another
    arrival order for each budget), at budgets of 256, 64, 7 and 1 tokens a step (prompts alone too); at 7 and
    1 on a tensor-core attention grid of 2 blocks, so that its decode rows and short chunks run solo (one split
    a warp) where the others' run in a block each."""
    runs = {}
    for k, budget in enumerate((256, 64, 7, 1)):
        arrivals = arrivals_of(np.random.default_rng(seed + k), prompts, params, steps)
        runs[budget] = served(folder, "gpu", arrivals, max_batch=len(prompts), page_size=16,
                              max_tokens_per_step=budget, max_prefill_tokens=budget,
                              attention_grid=2 if budget < 64 else 0)
    return runs


def same_bits_alone(folder: str, prompts: list, params: list, runs: dict, requests) -> None:
    """Each of `requests` run alone gives the tokens, and every position's logits bit for bit, of every run
    of `runs` (chunked_runs)."""
    with LLM(folder, device="gpu", max_batch=1, page_size=16) as llm:
        llm.device.record_logits = True
        for i in requests:
            out = llm.submit(prompts[i], params[i]).result()
            alone = llm.device.logits.pop(out.request_id)
            for budget, (outputs, logits, _) in runs.items():
                assert outputs[i].token_ids == out.token_ids, (i, budget)
                assert sorted(logits[i]) == sorted(alone), (i, budget)
                for pos, (row,) in alone.items():
                    assert np.array_equal(row, logits[i][pos][0]), (i, budget, pos)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_a_requests_logits_do_not_depend_on_the_batch_or_the_chunking(checkpoints, arch):
    ckpt = checkpoints[arch, "bfloat16"]
    rng = np.random.default_rng(4)
    prompts = random_prompts(rng, 24, 1, 300)
    params = [SamplingParams(max_new_tokens=int(n)) for n in rng.integers(2, 9, 24)]
    runs = chunked_runs(ckpt.folder, prompts, params, 10, 30)
    assert runs[256][2] >= 4
    same_bits_alone(ckpt.folder, prompts, params, runs, range(0, 24, 3))


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_a_norm_run_by_the_linear_after_it_agrees_and_keeps_every_requests_bits(checkpoints, arch):
    """Rows 128 wide, bfloat16 (gpu.py's norm_squares): the linear that writes a norm's rows writes their sums
    of squares, and the norm then runs inside the next linear in steps below 32 rows (no rms_norm launch but
    the first layer's) and as its kernel from 32. 32 requests agree with the CPU device, and a request's
    logits are the same bits alone as in steps of 256, 64, 7 and 1 tokens (its prompt's rows normalised by the
    kernel in the first two, by the linears in the others, as in every decode step)."""
    ckpt = checkpoints[arch, "bfloat16", 128]
    layers = ckpt.raw["num_hidden_layers"]
    with LLM(ckpt.folder, device="gpu", max_batch=2, page_size=16) as llm:
        dev, launched = llm.device, []
        dev.capture = False
        dev.on_launch = launched.append
        out = llm.submit(list(range(1, 81)), SamplingParams(max_new_tokens=3)).result()   # (80 rows, then 1)
        dev.on_launch = None
    # the prompt's step: its 80 rows' norms up to the narrowing by the kernel (the first layer's two and the
    # second's first), the sampled row's two after it by the linears; each decode step: the first layer's input
    # norm alone (the embedding writes its rows, no sums of squares)
    norms = [name for name in launched if name.startswith("rms_norm")]
    assert layers == 2 and len(out.token_ids) == 3 and len(norms) == 3 + 2, norms
    rng = np.random.default_rng(13)
    prompts = random_prompts(rng, 32)
    params = [SamplingParams(max_new_tokens=int(n)) for n in rng.integers(3, 13, 32)]
    arrivals = arrivals_of(rng, prompts, params, 40)
    agree(served(ckpt.folder, "gpu", arrivals, max_batch=32, page_size=4),
          served(ckpt.folder, "cpu", arrivals, max_batch=32, page_size=4), prompts, "bfloat16")
    prompts = random_prompts(rng, 16, 1, 300)
    params = [SamplingParams(max_new_tokens=int(n)) for n in rng.integers(2, 9, 16)]
    runs = chunked_runs(ckpt.folder, prompts, params, 20, 30)
    same_bits_alone(ckpt.folder, prompts, params, runs, range(0, 16, 3))


def test_seeded_sampling_repeats_whatever_shares_the_steps(checkpoints):
    ckpt = checkpoints["qwen3", "float32"]
    rng = np.random.default_rng(6)
    settings = [dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.7), dict(temperature=1.3, top_k=20)]
    prompts = random_prompts(rng, 6)
    sampled = [SamplingParams(seed=200 + i, max_new_tokens=10, **settings[i % 3]) for i in range(6)]
    fillers = random_prompts(rng, 10)
    first = arrivals_of(rng, prompts + fillers, sampled + [SamplingParams(max_new_tokens=5)] * 10, 12)
    second = arrivals_of(rng, prompts, sampled, 3)
    a, _, _ = served(ckpt.folder, "gpu", first, max_batch=16, page_size=4)
    b, _, _ = served(ckpt.folder, "gpu", second, max_batch=16, page_size=4)
    assert [a[i].token_ids for i in range(6)] == [b[i].token_ids for i in range(6)]
    assert len({a[i].token_ids for i in range(6)}) > 1


def test_a_full_page_pool_preempts_and_recomputes_the_same_tokens(checkpoints):
    ckpt = checkpoints["llama3", "float32"]
    rng = np.random.default_rng(7)
    prompts = random_prompts(rng, 12, 8, 24)
    params = [SamplingParams(max_new_tokens=12) for _ in prompts]
    arrivals = arrivals_of(rng, prompts, params, 4)
    with LLM(ckpt.folder, device="gpu", max_batch=12, page_size=4, kv_pages=24) as llm:
        handles = drive(llm, arrivals)
        outputs = {k: h.result() for k, h in handles.items()}
        assert llm.stats().preemptions > 0
        assert llm.stats().free_pages == llm.stats().num_pages
    roomy, _, _ = served(ckpt.folder, "gpu", {0: [(i, p, s) for i, (p, s) in enumerate(zip(prompts, params))]},
                         max_batch=12, page_size=4)
    for i in range(12):
        assert outputs[i].token_ids == roomy[i].token_ids, i


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("bfloat16", 2)])
def test_the_pool_is_sized_from_a_share_of_the_gpus_memory(checkpoints, dtype, itemsize):
    from mdsl.gpu.driver import check, driver, get_device

    ckpt = checkpoints["qwen3", dtype]
    get_device(0)
    free, total = check(driver.cuMemGetInfo(), "cuMemGetInfo")
    # a share above what is in use now (the other test processes on this GPU hold some of it)
    fraction = min(0.95, (total - free) / total + 0.1)
    with LLM(ckpt.folder, device="gpu", max_batch=4, gpu_memory_fraction=fraction) as llm:
        # layers x (k, v) x kv heads x head_dim x the checkpoint's dtype
        page_bytes = 2 * 2 * 2 * 8 * itemsize * llm.shape.page_size
        assert sum(p.nbytes for p in llm.device._pools.values()) == llm.shape.num_pages * page_bytes
        # (what other processes hold changes between the two looks at the free memory: bounds only)
        assert 4 * llm.shape.pages_per_request < llm.shape.num_pages
        assert llm.shape.num_pages * page_bytes <= fraction * total
        assert len(llm.submit([1, 2, 3], SamplingParams(max_new_tokens=4)).result().token_ids) == 4


def test_steps_replayed_as_graphs_give_the_bits_of_launched_steps(checkpoints):
    ckpt = checkpoints["llama3", "bfloat16"]
    rng = np.random.default_rng(8)
    prompts = random_prompts(rng, 10)
    params = [SamplingParams(max_new_tokens=int(n)) for n in rng.integers(4, 16, 10)]
    arrivals = arrivals_of(rng, prompts, params, 10)
    replayed, replayed_logits, _ = served(ckpt.folder, "gpu", arrivals, max_batch=10, page_size=4)
    launched, launched_logits, _ = served(ckpt.folder, "gpu", arrivals, capture=False, max_batch=10, page_size=4)
    for i in range(10):
        assert replayed[i].token_ids == launched[i].token_ids
        for pos, rows in launched_logits[i].items():
            assert all(np.array_equal(a, b) for a, b in zip(rows, replayed_logits[i][pos])), (i, pos)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_prefix_cache_keeps_every_requests_bits(checkpoints, dtype):
    """Requests sharing a system prompt, arriving at random steps in steps of a few tokens: with the prefix
    cache they read its full pages from the pool where an earlier request computed them, and their tokens
    and every logits row they compute are the run's without the cache bit for bit (the GPU device's keys and
    values do not depend on the step that wrote them); and they agree with the CPU device's."""
    ckpt = checkpoints["qwen3", dtype]
    rng = np.random.default_rng(14)
    system = random_prompts(rng, 1, 37, 37)[0]
    prompts = [system + p for p in random_prompts(rng, 12, 1, 9)]
    params = [SamplingParams(max_new_tokens=int(n)) for n in rng.integers(2, 8, 12)]
    arrivals = arrivals_of(rng, prompts, params, 30)
    engine = dict(max_batch=6, page_size=4, max_tokens_per_step=16)
    fresh = served(ckpt.folder, "gpu", arrivals, prefix_caching=False, **engine)
    with LLM(ckpt.folder, device="gpu", **engine) as llm:
        llm.device.record_logits = True
        handles = drive(llm, arrivals)
        outputs = {k: h.result() for k, h in handles.items()}
        logits = {k: llm.device.logits.pop(out.request_id) for k, out in outputs.items()}
        assert llm.stats().cached_tokens >= 36
    for i in range(12):
        assert outputs[i].token_ids == fresh[0][i].token_ids, i
        for pos, rows in logits[i].items():
            assert all(np.array_equal(row, fresh[1][i][pos][0]) for row in rows), (i, pos)
    agree(fresh, served(ckpt.folder, "cpu", arrivals, **engine), prompts, dtype)


def first_maximum(row: np.ndarray) -> int:
    """The index argmax_rows gives a row: its first largest value above -inf, NaN never (2^31 - 1 for none)."""
    ok = ~np.isnan(row) & (row > -np.inf)
    return int(np.flatnonzero(ok & (row == row[ok].max()))[0]) if ok.any() else 0x7FFFFFFF


def test_the_greedy_tokens_are_each_rows_first_maximum(checkpoints):
    """argmax_rows (a row's values cut into parts, a block each, the parts' first maxima taken by the row's
    last block) gives each row's first maximum: the lower index of a tie across parts and within one, NaN
    never, a row of -inf none; at widths of one part, of many and past the most parts a row takes, launched
    twice at each (the count of a row's parts done is ready again after a launch)."""
    import ctypes

    from mdsl.gpu.arrays import DeviceArray
    from mdsl.gpu.driver import get_device
    from mdsl.ir.dtypes import f32, i32
    from mdsl.serving.gpu import ARGMAX_MOST_PARTS, ARGMAX_SPAN, THREADS, argmax_parts

    rng = np.random.default_rng(5)
    with LLM(checkpoints["qwen3", "float32"].folder, device="gpu", max_batch=4) as llm:
        dev = llm.device
        get_device(dev.ordinal)
        for width in (1, 7, ARGMAX_SPAN, ARGMAX_SPAN + 1, 151936, ARGMAX_SPAN * ARGMAX_MOST_PARTS * 3 + 5):
            x = rng.standard_normal((5, width)).astype(np.float32)
            if width > 1:
                x[0, [width // 3, width - 1]] = 50.0                  # a tie, the second in a later part
                x[1, : width // 2] = np.nan                           # NaN before the largest value
                x[1, width - 1] = 9.0
                x[3, [width // 2, width // 2 + 1]] = 7.0              # a tie of neighbours
            x[2] = -np.inf
            x[4, 0] = np.nan
            expected = [first_maximum(row) for row in x]
            values = DeviceArray.from_numpy(x, f32, device=dev.ordinal)
            for _ in range(2):
                best = DeviceArray((5,), i32, device=dev.ordinal)
                dev.launch("argmax_rows", (5, argmax_parts(width)), THREADS,
                           [ctypes.c_void_p(best.ptr), ctypes.c_void_p(values.ptr), ctypes.c_int(width),
                            ctypes.c_void_p(dev._argmax_parts), ctypes.c_void_p(dev._argmax_counts)])
                dev._sync()
                assert best.to_numpy().tolist() == expected, width


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_nan_weights_fail_every_request_with_no_maximum(checkpoints, tmp_path, temperature):
    """Logits without a maximum (NaN everywhere) stop the device with NoMaximum on every request, as on the
    CPU device: the greedy rows' argmax_rows answer (2^31 - 1) is never taken for a token."""
    from mdsl.megakernel.modelgraph.checkpoint import save_checkpoint
    from mdsl.serving import ServingError

    ckpt = checkpoints["qwen3", "bfloat16"]
    weights = dict(ckpt.weights)
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], np.nan)
    save_checkpoint(str(tmp_path), ckpt.raw, weights)
    with LLM(str(tmp_path), device="gpu", max_batch=4) as llm:
        handles = [llm.submit([1, 2, 3 + i], SamplingParams(max_new_tokens=4, temperature=temperature))
                   for i in range(3)]
        for h in handles:
            with pytest.raises(ServingError, match="no maximum"):
                h.result(timeout=120)
        assert llm.stats().status == "failed"

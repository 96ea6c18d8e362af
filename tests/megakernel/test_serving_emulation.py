"""The megakernel's serving tables (mdsl.megakernel.runtime.serving_plan) run by their numpy emulator
(tests/megakernel/serving_emulator.py) under random worker counts and interleavings: requests of 1 to 40 prompt
tokens arriving at chosen steps, steps of 1, 7 and 64 rows, pools small enough to preempt, greedy and seeded
top-k / top-p requests. Every request's tokens and every sampled row's logits are the CPU device's (with
record_logits: hence ReferenceModel's with the pool's kv_dtype) bit for bit in float32; where a row's range is
cut into several splits, and in bfloat16 (rounded where the kernel rounds), a request's tokens and logits are the
same bits however the steps batch and chunk it. A deadlock fails a test. The tables' checker catches broken
tables, and the graphs the tables cannot run are refused."""
from __future__ import annotations

import shutil
import subprocess

import attrs
import numpy as np
import pytest

from mdsl import LLM, SamplingParams
from mdsl.errors import UnsupportedError
from mdsl.ir.dtypes import bf16, round_to_dtype
from mdsl.megakernel.modelgraph.model import parse_model_graph, print_model_graph
from mdsl.megakernel.runtime.serving_plan import (ATTN_ITEM, SCHEDULE_EVENT, SERVING_LAYOUTS, STEP, check_serving_plan,
                                                  plan_serving)
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import Access, Kind, PlanError
from mdsl.serving.protocol import ServingShape
from tests.megakernel.serving_emulator import ServingEmulator
from tests.megakernel.tiny import tiny_model
from tests.serving.conftest import drive, wait_until, write_checkpoint

VOCAB = 96
POSITIONS = 64


class Host:
    """The host's side of an emulated launch, called by each SCHEDULE: before step s it submits the requests
    arriving at s (key -> handle in `handles`) and waits until the engine has published them; it says whether
    anything more is to come (later arrivals, requests the engine holds or has queued)."""

    def __init__(self, llm, arrivals: dict):
        self.llm, self.arrivals, self.handles = llm, arrivals, {}
        self.last = max(arrivals, default=0)

    def __call__(self, step: int) -> bool:
        for key, prompt, params in self.arrivals.get(step, ()):
            self.handles[key] = self.llm.submit(prompt, params)
        if self.arrivals.get(step):
            wait_until(lambda: self.llm.stats().host_pending == 0 or
                       self.llm.device.queued() == self.llm.shape.queue_slots, what="publication")
        stats = self.llm.stats()
        return step < self.last or stats.host_pending > 0 or stats.queued > 0


def emulate(folder: str, arrivals: dict, workers: int, seed: int, **engine):
    """The requests served by the emulated tables; (key -> RequestOutput, key -> position -> logits rows of its
    sampled rows, the engine's stats, the emulator). `split_keys` and `max_row_splits` among `engine` are the
    plan's."""
    options = {name: engine.pop(name) for name in ("split_keys", "max_row_splits") if name in engine}
    with LLM(folder, **engine) as llm:
        llm.device.hold()
        plan = plan_serving(llm.device.graph, decoder_shape(llm.config), llm.shape, workers=workers, **options)
        check_serving_plan(plan)
        emulator = ServingEmulator(plan, llm, workers, np.random.default_rng(seed))
        host = Host(llm, arrivals)
        emulator.run(host)
        outputs = {key: h.result(timeout=60) for key, h in host.handles.items()}
        stats = llm.stats()
    return outputs, {key: emulator.logits[out.request_id] for key, out in outputs.items()}, stats, emulator


def on_the_cpu_device(folder: str, arrivals: dict, **engine):
    """The same requests served by the CPU device: (key -> RequestOutput, key -> position -> logits rows)."""
    with LLM(folder, **engine) as llm:
        llm.device.record_logits = True
        handles = drive(llm, arrivals)
        outputs = {key: h.result() for key, h in handles.items()}
        return outputs, {key: llm.device.logits.pop(out.request_id) for key, out in outputs.items()}


def requests(rng, n: int, steps: int) -> dict:
    """step -> [(key, prompt, params)]: prompts of 1 to 40 tokens, greedy and seeded top-k / top-p requests."""
    settings = [{}, {}, dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.8),
                dict(temperature=1.3, top_k=20, top_p=0.9)]
    arrivals: dict = {}
    for i in range(n):
        prompt = [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(1, 41)))]
        params = SamplingParams(max_new_tokens=int(rng.integers(2, 9)), ignore_eos=True, seed=1000 + i,
                                **settings[int(rng.integers(len(settings)))])
        arrivals.setdefault(int(rng.integers(0, steps)), []).append((i, prompt, params))
    return arrivals


def pool_pages(arrivals: dict, page_size: int, spare: int) -> int:
    """A pool `spare` pages above the longest request's: small enough that requests preempt each other."""
    longest = max(len(p) + s.max_new_tokens - 1 for batch in arrivals.values() for _, p, s in batch)
    return -(-longest // page_size) + spare


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return {arch: write_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=5, positions=POSITIONS)
            for arch in ("llama3", "qwen3", "qwen2", "mistral", "phi3")}


@pytest.mark.parametrize(("arch", "budget", "workers"), [("llama3", 7, 5), ("qwen3", 64, 17), ("qwen2", 1, 3),
                                                         ("mistral", 7, 1), ("phi3", 64, 9), ("llama3", 64, 2)])
def test_the_tables_give_the_cpu_devices_tokens_and_logits_bit_for_bit(checkpoints, arch, budget, workers):
    rng = np.random.default_rng(workers * 100 + budget)
    n = 5 if budget == 1 else 9
    arrivals = requests(rng, n, 8)
    engine = dict(max_batch=5, page_size=4, kv_pages=pool_pages(arrivals, 4, 3), max_tokens_per_step=budget)
    folder = checkpoints[arch].folder
    outputs, logits, stats, emulator = emulate(folder, arrivals, workers, workers, **engine)
    want, want_logits = on_the_cpu_device(folder, arrivals, **engine)
    assert (stats.preemptions > 0 and stats.peak_running >= 3) or budget == 1   # (one row a step: one at a time)
    for key, out in outputs.items():
        assert out.token_ids == want[key].token_ids and out.finish_reason == "length"
        prompt_end = len(out.prompt_token_ids) - 1   # every token sampled once, at the position before it
        assert sorted(logits[key]) == list(range(prompt_end, prompt_end + len(out.token_ids)))
        for pos, rows in logits[key].items():
            assert all(np.array_equal(row, want_logits[key][pos][0]) for row in rows), (key, pos)
    assert np.isfinite(emulator.k_pool).any()


def test_rows_cut_into_several_splits_give_the_same_bits_however_batched(checkpoints):
    """Splits of 4 keys, at most 3 a row (wider ones past 12 keys): every row of more than 4 positions merges;
    two differently batched launches agree bit for bit, and with the CPU device to float32 rounding."""
    folder = checkpoints["qwen3"].folder
    rng = np.random.default_rng(7)
    arrivals = requests(rng, 8, 6)
    late = {step + 3 * (i % 2): batch for i, (step, batch) in enumerate(sorted(arrivals.items()))}
    splits = dict(split_keys=4, max_row_splits=3)
    first, first_logits, _, emulator = emulate(folder, arrivals, 7, 1, max_batch=4, page_size=4, max_tokens_per_step=7,
                                               **splits)
    assert max(emulator.plan.split_width(n) for n in range(1, POSITIONS)) == 24
    assert len(emulator.plan.row_splits(40)) == 3 and len(emulator.plan.row_splits(11)) == 3
    second, second_logits, _, _ = emulate(folder, late, 12, 2, max_batch=8, page_size=8, max_tokens_per_step=64,
                                          **splits)
    want, want_logits = on_the_cpu_device(folder, arrivals, max_batch=8, page_size=4, max_tokens_per_step=64)
    for key, out in first.items():
        assert out.token_ids == second[key].token_ids == want[key].token_ids
        for pos, rows in first_logits[key].items():
            assert all(np.array_equal(row, second_logits[key][pos][0]) for row in rows)
            reference = want_logits[key][pos][0]
            np.testing.assert_allclose(rows[0], reference, rtol=0, atol=2e-5 * np.abs(reference).max())


def test_bf16_rounding_gives_the_same_bits_however_batched(tmp_path):
    """A bfloat16 checkpoint: every activation the tables store and every key and value in the pool is a bfloat16
    value; a request's tokens and logits are the same bits in two differently batched launches, and near the
    CPU device's (which rounds only what it caches)."""
    ckpt = write_checkpoint(tmp_path, "llama3", seed=6, positions=POSITIONS, torch_dtype="bfloat16")
    rng = np.random.default_rng(8)
    arrivals = requests(rng, 7, 5)
    spread = {4 * step: batch for step, batch in arrivals.items()}
    engine = dict(max_batch=4, page_size=4, kv_pages=pool_pages(arrivals, 4, 2), max_tokens_per_step=7)
    first, first_logits, stats, emulator = emulate(ckpt.folder, arrivals, 6, 3, **engine)
    assert stats.preemptions > 0
    stored = [emulator.buf[name] for name in ("h", "mid", "qkv", "attn", "act")] + [emulator.k_pool, emulator.v_pool]
    for values in stored:   # (the last step's rows; the rest is SCHEDULE's NaN)
        values = values[np.isfinite(values)]
        assert values.size and np.count_nonzero(values) and np.array_equal(round_to_dtype(values, bf16), values)
    second, second_logits, _, _ = emulate(ckpt.folder, spread, 11, 4, max_batch=2, page_size=8, max_tokens_per_step=64)
    _, unrounded = on_the_cpu_device(ckpt.folder, arrivals, **engine)
    for key, out in first.items():
        assert out.token_ids == second[key].token_ids
        for pos, rows in first_logits[key].items():
            assert np.isfinite(rows[0]).all() and np.array_equal(round_to_dtype(rows[0], bf16), rows[0])
            assert all(np.array_equal(row, second_logits[key][pos][0]) for row in rows)
        prompt_end = min(first_logits[key])      # (the same tokens before it on both devices)
        cpu = unrounded[key][prompt_end][0]
        np.testing.assert_allclose(first_logits[key][prompt_end][0], cpu, rtol=0, atol=0.05 * np.abs(cpu).max())


# ---- the tables themselves

SHAPE = ServingShape(max_batch=5, page_size=4, num_pages=20, max_seq=POSITIONS, max_tokens_per_step=7)


def _plan(arch: str = "llama3", workers: int = 9, **overrides):
    config, graph, _ = tiny_model(arch, max_position_embeddings=POSITIONS, **overrides)
    return plan_serving(graph, decoder_shape(config), SHAPE, workers=workers)


@pytest.mark.parametrize("workers", [1, 4, 64])
def test_the_tables_are_the_one_row_tables_with_schedule_first_and_samplers_last(workers):
    plan = _plan(workers=workers)
    check_serving_plan(plan)
    kinds = [t.kind for t in plan.tasks]
    assert kinds[0] is Kind.SCHEDULE and kinds[-plan.samplers:] == [Kind.SAMPLE] * plan.samplers
    assert plan.samplers == min(SHAPE.max_batch, workers)
    assert [(t.kind, t.layer, t.begin, t.end) for t in plan.tasks[1:-plan.samplers]] == \
        [(t.kind, t.layer, t.begin, t.end) for t in plan.base.tasks[:-1]]
    assert plan.events[0].previous_step and plan.initial_events()[0] == plan.samplers
    assert list(plan.initial_events()[1:]) == [0] * (len(plan.events) - 1)
    tasks, waits, signals = plan.tables()
    assert tasks.shape == (len(plan.tasks), 8) and waits[0].tolist() == [0, plan.samplers]
    # a row's splits by its position alone: 64 keys, or the multiple of 64 that makes at most 64 splits
    assert plan.split_width(4096) == 64 and plan.split_width(4097) == 128
    items = plan.items([0, 5, 63])
    assert items.dtype == ATTN_ITEM.dtype() and items["row"].tolist() == [0, 1, 2]
    assert items["hi"].tolist() == [1, 6, 64]


def test_the_checker_catches_a_missing_wait_and_a_task_that_leads_nowhere():
    plan = _plan()
    attention = next(k for k, t in enumerate(plan.tasks) if t.kind is Kind.ATTN)
    waits = list(plan.waits)
    waits[attention] = ()
    with pytest.raises(PlanError, match="without waiting"):
        check_serving_plan(attrs.evolve(plan, waits=tuple(waits)))
    last_down = max(k for k, t in enumerate(plan.tasks) if t.kind is Kind.DOWN)
    dropped = [tuple(e for e in w if last_down not in plan.events[e].producers) for w in plan.waits]
    with pytest.raises(PlanError):
        check_serving_plan(attrs.evolve(plan, waits=tuple(dropped)))
    with pytest.raises(PlanError, match="SCHEDULE"):
        check_serving_plan(attrs.evolve(plan, waits=((),) + plan.waits[1:]))
    # a layer's ATTN task that waits for the step's tables only would rewrite the partials under a merge
    k = next(k for k, t in enumerate(plan.tasks) if t.kind is Kind.ATTN and t.layer == 1)
    tasks, waits = list(plan.tasks), list(plan.waits)
    tasks[k], waits[k] = attrs.evolve(tasks[k], reads=(Access(STEP, 0, 1),)), (SCHEDULE_EVENT,)
    with pytest.raises(PlanError, match="partials"):
        check_serving_plan(attrs.evolve(plan, tasks=tuple(tasks), waits=tuple(waits)))


@pytest.mark.parametrize(("arch", "overrides", "what"), [("gemma2", {"sliding_window": 64}, "linear_norm_residual|"
                                                          "softcap|norm_1p"),
                                                         ("qwen3_moe", {}, "norm_moe_router")])
def test_graphs_the_tables_cannot_run_are_refused(arch, overrides, what):
    with pytest.raises(UnsupportedError, match=what):
        _plan(arch, **overrides)


def test_layers_with_different_windows_are_refused_naming_the_attention():
    """The serving tables cut a row's range by one window for every layer: a graph whose layers' windows differ
    (a Mistral whose first layer reads every position) is refused at its attention's line."""
    config, graph, _ = tiny_model("mistral", max_position_embeddings=POSITIONS)
    mixed = parse_model_graph(print_model_graph(graph).replace("window=5", "window=0", 1))
    with pytest.raises(UnsupportedError, match=r"windows differ \(\[0, 5\]") as e:
        plan_serving(mixed, decoder_shape(config), SHAPE, workers=9)
    assert e.value.loc.file.endswith("architectures.py") and "mdsl.LLM" in e.value.hint


def test_the_c_declarations_compile_with_the_hosts_sizes_and_offsets():
    source = _plan().c_declarations()
    nvrtc = pytest.importorskip("mdsl.backend.cuda.nvrtc")
    nvrtc.compile_ptx(source)
    if shutil.which("g++") is None:
        pytest.skip("no host C++ compiler to check the offsets with offsetof")
    for layout in SERVING_LAYOUTS:
        assert f"static_assert(sizeof({layout.name}) == {layout.size}" in source
    run = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-x", "c++", "-"],
                         input="#include <cstddef>\n" + source, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr

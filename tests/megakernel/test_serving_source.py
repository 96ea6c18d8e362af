"""The serving kernel's CUDA C++ (mdsl.megakernel.runtime.serving_source) compiles with NVRTC to an sm_90a cubin
without spills for tiny Llama-3, Qwen3, Qwen2, Mistral and Phi-3 models (f32 and bf16) and for Qwen3-8B's shape;
its text is the one-row runtime's with the SERVE section and the serving tables' declarations, and the one-row
kernel's text does not change with the section's existence."""
import re

import attrs
import pytest

from mdsl.ir.dtypes import bf16, f32
from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.model_config import config_from_dict
from mdsl.megakernel.runtime.kernel_source import KERNEL_NAME, PARAMS, SERVE_PARAMS, WARPS, runtime_source
from mdsl.megakernel.runtime.models import MODELS
from mdsl.megakernel.runtime.serving_plan import build_serving_plan, plan_serving
from mdsl.megakernel.runtime.serving_source import (ROW_FLOATS, ROW_GROUP, attention_chunk, generate_serving_source,
                                                    serving_row_floats, serving_shared_floats)
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import Kind
from mdsl.serving.protocol import ServingShape
from tests.megakernel.test_runtime_source import H200_SMS, assert_fits
from tests.megakernel.tiny import tiny_model
from tests.shared import compiled_once

# a kernel compiled once per test run: a tiny Qwen3's serving kernel is a tiny Llama-3's but for the model named in a
# comment, and one compile takes seconds
pytestmark = pytest.mark.shared_compile_cache

POSITIONS = 64
SHAPE = ServingShape(max_batch=5, page_size=4, num_pages=20, max_seq=POSITIONS, max_tokens_per_step=7)
# Qwen3-8B served on an H200: 64 requests of 4096 positions, pages of 16, 256 rows a step
QWEN3_8B = ServingShape(max_batch=64, page_size=16, num_pages=64 * 256, max_seq=4096, max_tokens_per_step=256)


def tiny_plan(arch: str, dtype=f32, workers: int = H200_SMS, shape: ServingShape = SHAPE, **overrides):
    config, _, _ = tiny_model(arch, max_position_embeddings=POSITIONS, **overrides)
    config = attrs.evolve(config, dtype=dtype)
    graph = step_function(config).trace(config, max_positions=shape.max_seq)
    return plan_serving(graph, decoder_shape(config), shape, workers=workers)


def compiled(plan):
    source = generate_serving_source(plan)
    return source, compiled_once(source.text, arch="sm_90a").resources[KERNEL_NAME]


@pytest.mark.parametrize(("arch", "dtype"), [("llama3", f32), ("llama3", bf16), ("qwen3", f32), ("qwen3", bf16),
                                             ("qwen2", bf16), ("mistral", f32), ("phi3", bf16)], ids=str)
def test_tiny_models_serving_kernels_compile_without_spills(arch, dtype):
    source, resources = compiled(tiny_plan(arch, dtype))
    assert_fits(source, resources)
    assert f"using T = {'__nv_bfloat16' if dtype is bf16 else 'float'};" in source.text


@pytest.mark.slow
def test_qwen3_8b_serving_kernel_compiles_without_spills():
    config = attrs.evolve(config_from_dict(MODELS["qwen3-8b"]), dtype=bf16)
    plan = build_serving_plan(decoder_shape(config), QWEN3_8B, workers=H200_SMS)
    source, resources = compiled(plan)
    assert_fits(source, resources)
    # the down-projection's 12288-wide rows three at a time, the 4096-wide ones eight, in 160 KiB
    assert serving_row_floats(plan) == ROW_FLOATS and ROW_FLOATS // 12288 == 3 and ROW_FLOATS // 4096 >= ROW_GROUP
    assert plan.split_width(QWEN3_8B.max_seq) == 64 and plan.max_items == 256 * 64


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3-0.6b", "llama-3.2-1b"])
def test_the_serving_benchmarks_kernels_compile_without_spills(model):
    """The engine refuses a kernel that spills: the benchmark models' serving kernels (bf16, 64 requests, 64 rows a
    step: benchmarks/serve.py's) do not."""
    config = attrs.evolve(config_from_dict(MODELS[model]), dtype=bf16)
    shape = ServingShape(max_batch=64, page_size=16, num_pages=64 * 80, max_seq=1280, max_tokens_per_step=64)
    source, resources = compiled(build_serving_plan(decoder_shape(config), shape, workers=H200_SMS))
    assert_fits(source, resources)


def test_a_model_wide_enough_to_slice_k_compiles_without_spills():
    """tests/gpu/test_gpu_megakernel_serving.py's wide bf16 model (sliced K, several runs, two staged groups)."""
    plan = tiny_plan("qwen3", bf16, shape=attrs.evolve(SHAPE, max_tokens_per_step=64), hidden_size=512,
                     intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    assert_fits(*compiled(plan))


def test_the_serving_kernel_is_the_runtime_with_its_serve_section_and_the_serving_declarations():
    plan = tiny_plan("qwen3", workers=9)
    text = generate_serving_source(plan).text
    # the protocol's structs and offsets, the scheduler, the serving tables' declarations, before the runtime
    runtime = text.index("constexpr int NT = ")
    for declared in ("struct QueueSlot", "namespace sched", "SCHED inline unsigned begin_step", "struct AttnItem",
                     "constexpr long long SERVE_MERGE_COUNTS_OFFSET", "constexpr long long MAX_ROWS = 7;"):
        assert -1 < text.index(declared) < runtime, declared
    assert f"constexpr int TASKS = {len(plan.tasks)};" in text
    lm_first = next(k for k, t in enumerate(plan.tasks) if t.kind is Kind.LMHEAD)
    assert f"constexpr int LM_FIRST = {lm_first};" in text
    tiles = [plan.append_tiles(g) for g in range(plan.shape.kv_heads)]
    assert f"__constant__ int APPEND_TILES[HKV] = {{{', '.join(map(str, tiles))}}};" in text
    assert "constexpr int SERVE_WINDOW = 0;" in text
    # the serving bodies and dispatch, none of the one-row ones; the linear kinds and the LM head handed over early
    # (their bodies wait on the slot's ready barrier), no one-row prefetch of attention's rows
    dispatch = text[text.index("bool run_task("):]
    for call in ("return schedule_task(p, step, work);", "return qkv_task(p, t, ready, work, red, step);",
                 "attention_items_task(p, t, work);", "return lmhead_rows_task(p, t, ready, k - LM_FIRST",
                 "sample_rows_task(p, t"):
        assert call in dispatch, call
    assert "attention_task(p, t, ready" not in text and "sample_task(p, t, step" not in text
    assert "append_kv(p, t, step, work);" in text and "rows_linear<H, 2>(" in text
    assert "prefetch_kv_rows(p.layers" not in text and "early = early_kind(t.kind)" in text
    early = re.search(r"constexpr int EARLY_KINDS = (.*?);", text, re.S).group(1)
    assert "KIND_QKV" in early and "KIND_LMHEAD" in early and "if (!inputs_ready(ready)) return false;" in text
    struct = re.search(r"struct Params \{(.*?)\};", text, re.S).group(1)
    assert [line.split()[-1].rstrip(";") for line in struct.strip().splitlines()] == \
        [name for _, name in PARAMS + SERVE_PARAMS]


def test_the_one_row_runtime_keeps_its_text_without_the_serve_section():
    plain, serving = runtime_source(), runtime_source(frozenset({"SERVE"}))
    for name in ("schedule_task", "attention_items_task", "STATE_IDLE", "char* host;"):
        assert name not in plain and name in serving, name
    assert "#if" not in plain.replace("#if defined", "") and "#if MK_" not in serving
    assert "prefetch_kv_rows(p.layers[t.layer]" in plain and "early = early_kind(t.kind)" in plain


def test_the_serving_kernels_shared_memory_holds_each_body():
    plan = tiny_plan("llama3", workers=9)
    source = generate_serving_source(plan)
    floats = serving_shared_floats(plan)
    assert source.smem_bytes == 4 * (2 * WARPS + max(floats.values()))
    s = plan.shape
    assert floats["schedule"] == SHAPE.max_batch + SHAPE.max_tokens_per_step + 1
    assert floats["linear"] == min(ROW_GROUP * max(s.hidden, s.intermediate, s.attention_width), ROW_FLOATS)
    # an attention item is a warp's: its scratch, q heads and a chunk of 32 value rows, whatever the keys of a split
    assert attention_chunk(plan) == 32
    assert floats["attention"] == WARPS * (2 * s.group * s.head_dim + 32 * s.head_dim * s.dtype.itemsize // 4)
    assert plan.split_width(POSITIONS) == 64

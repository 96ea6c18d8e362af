"""The megakernel's CUDA C++ compiles with NVRTC to an sm_90a cubin without spills, for tiny Llama-3,
Qwen3, Qwen2, Mistral and Phi-3 models (f32 and bf16) and the Llama-3.2-1B, Qwen3-0.6B and Qwen3-8B shapes; the host's view of
the kernel's parameter block agrees with the device's; the device code is headers of one concern each."""
import ctypes
import functools
import re
from pathlib import Path

import attrs
import pytest

from mdsl.backend.cuda.nvrtc import compile_cuda, compile_ptx, disassemble
from mdsl.ir.dtypes import bf16, f32
from mdsl.megakernel.modelgraph.model_config import config_from_dict
from mdsl.megakernel.runtime.kernel_source import (BLOCK_THREADS, KERNEL_NAME, PARAMS, THREADS, KernelOptionError,
                                                   generate_source, runtime_source)
from mdsl.megakernel.runtime.megakernel_engine import OPTION_HINTS
from mdsl.megakernel.runtime.megakernel_options import MegakernelOptions, OptionError
from mdsl.megakernel.runtime.models import MODELS
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import build_plan
from tests.megakernel.tiny import tiny_model
from tests.shared import compiled_once

# a kernel compiled once per test run: several configurations here make the same program (an option at its
# default, a tiny Qwen3 whose kernel is a tiny Llama-3's but for the model named in a comment), and one compile
# of a full-size model's kernel takes seconds
pytestmark = pytest.mark.shared_compile_cache

H200_SMS = 132
SMEM_LIMIT = 227 * 1024   # Hopper's opt-in shared memory per block
SM_REGISTERS = 64 * 1024  # Hopper's register file per SM (32-bit registers)
REGISTER_UNIT = 8         # registers are allocated per thread in multiples of 8
ALL_KINDS = ("qkv", "oproj", "gateup", "down", "lmhead")
RUNTIME = Path(__file__).resolve().parents[2] / "mdsl" / "megakernel" / "runtime"


def compile_plan(plan, options=MegakernelOptions()):
    source = generate_source(plan, options)
    module = compiled_once(source.text, arch="sm_90a")
    return source, module, module.resources[KERNEL_NAME]


def assert_fits(source, resources):
    """No spills, and one worker block (compute, scheduler and idle warps) fits on an SM: its registers and
    its shared memory (the dynamic part the engine asks for plus the static slots)."""
    assert resources.spill_store_bytes == 0 and resources.spill_load_bytes == 0, resources
    assert resources.stack_bytes == 0, resources
    assert resources.registers <= 255
    per_thread = -(-resources.registers // REGISTER_UNIT) * REGISTER_UNIT
    assert per_thread * BLOCK_THREADS <= SM_REGISTERS, resources
    assert source.smem_bytes + resources.smem_bytes <= SMEM_LIMIT
    assert resources.smem_bytes >= 2 * 64, "the two task slots live in static shared memory"


def tiny_bf16_plan(arch="qwen3", **kwargs):
    config, _, _ = tiny_model(arch)
    return build_plan(decoder_shape(attrs.evolve(config, dtype=bf16)), workers=8, max_seq=24, **kwargs)


@pytest.mark.parametrize(("arch", "dtype"), [("llama3", f32), ("llama3", bf16), ("qwen3", f32), ("qwen3", bf16),
                                             ("qwen2", f32), ("qwen2", bf16), ("mistral", f32), ("mistral", bf16),
                                             ("phi3", f32), ("phi3", bf16)], ids=str)
def test_tiny_models_compile_without_spills(arch, dtype):
    config, _, _ = tiny_model(arch)
    shape = decoder_shape(attrs.evolve(config, dtype=dtype))
    plan = build_plan(shape, workers=H200_SMS, max_seq=config.max_positions)
    source, module, resources = compile_plan(plan)
    assert module.arch == "sm_90a" and module.cubin.startswith(b"\x7fELF")
    assert_fits(source, resources)
    assert f"using T = {'__nv_bfloat16' if dtype is bf16 else 'float'};" in source.text


def test_the_device_code_is_headers_of_one_concern_each():
    """device.cu includes its headers, which kernel_source.py expands in place (the compile cache's key is the whole
    text); no file over ~400 lines, at most 8 `if constexpr` branches in all."""
    files = [RUNTIME / "device.cu", *sorted(RUNTIME.glob("*.cuh"))]
    included = re.findall(r'^#include "(\w+\.cuh)"$', files[0].read_text(), re.MULTILINE)
    assert sorted(included) == sorted(f.name for f in files[1:])
    assert all(len(f.read_text().splitlines()) <= 400 for f in files), {f.name: len(f.read_text().splitlines())
                                                                       for f in files}
    assert sum(f.read_text().count("if constexpr") for f in files) <= 8
    text = runtime_source()
    assert "#include \"" not in text and all(f.read_text().splitlines()[-1] in text for f in files[1:])
    assert text.count("extern \"C\" __global__") == 1


def test_attention_lanes_share_key_rows_without_spills():
    config, _, _ = tiny_model("llama3", head_dim=16)
    plan = build_plan(decoder_shape(config), workers=H200_SMS, max_seq=config.max_positions)
    source = generate_source(plan)
    assert "constexpr int ATTN_LANES = 4;" in source.text   # 16 f32 values: 4 vectors of 16 bytes
    assert "constexpr int ATTN_LANES = 2;" in generate_source(attrs.evolve(plan, shape=decoder_shape(
        attrs.evolve(config, dtype=bf16)))).text   # 2 vectors: 2 lanes
    assert_fits(source, compiled_once(source.text, arch="sm_90a").resources[KERNEL_NAME])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_full_size_models_compile_without_spills(name):
    shape = decoder_shape(config_from_dict(MODELS[name]))
    source, _, resources = compile_plan(build_plan(shape, workers=H200_SMS, max_seq=4096))
    assert_fits(source, resources)


# Gemma-2-2B's published shape (config.json; the weights of the tests are random)
GEMMA_2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
# tests/gpu/test_megakernel.py's tiny Gemma-2 (its checkpoint's config.json, max_seq 64)
GPU_TINY_GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 160,
    "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "sliding_window": 128, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 4.0,
    "final_logit_softcapping": 8.0, "hidden_activation": "gelu_pytorch_tanh",
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gpu_tests_tiny_gemma2_compiles_without_spills(dtype):
    """Gemma-2's sections (EMBED_SCALE, NORM_1P, LM_HEAD_1P, ROW_NORM, SOFTCAP) in the kernel of the GPU test's model,
    on an H200's workers."""
    shape = decoder_shape(config_from_dict({**GPU_TINY_GEMMA2, "torch_dtype": dtype}))
    source, _, resources = compile_plan(build_plan(shape, workers=H200_SMS, max_seq=64))
    assert_fits(source, resources)
    assert "norm_residual_row<NormedRow1p<H>>" in source.text and "constexpr float SOFTCAP = 4.0f;" in source.text


@pytest.mark.slow
def test_gemma2_2b_compiles_without_spills():
    """At its published context, 8192 positions: its sliding layers read the last 4096 (the LAYER_WINDOW table)."""
    shape = decoder_shape(config_from_dict(GEMMA_2_2B))
    plan = build_plan(shape, workers=H200_SMS, max_seq=8192)
    assert plan.windows == (4096, 0) * 13
    source, _, resources = compile_plan(plan)
    assert_fits(source, resources)


def test_the_runtime_uses_acquire_release_events_and_no_grid_barrier():
    config, _, _ = tiny_model("llama3")
    text = generate_source(build_plan(decoder_shape(config), workers=8, max_seq=24)).text
    assert "ld.acquire.gpu" in text and "red.release.gpu" in text
    assert "grid.sync" not in text and "cooperative_groups" not in text
    assert "prefetch.global.L2" in text   # an attention split's cached rows stream into L2 while it waits


def test_a_scheduler_warp_feeds_the_compute_warps_through_named_barriers():
    config, _, _ = tiny_model("llama3")
    plan = build_plan(decoder_shape(config), workers=8, max_seq=24)
    text = generate_source(plan).text
    runtime = text[text.index("constexpr int NT = "):]
    assert "__syncthreads()" not in runtime, "the compute warps' barriers must leave the scheduler warp out"
    assert "bar.sync %0, %1;" in runtime and "bar.arrive %0, %1;" in runtime
    assert f"constexpr int NT = {THREADS};" in runtime and "constexpr int BLOCK = NT + 32;" in runtime
    assert "constexpr int LAUNCH = BLOCK + 32;" in runtime and BLOCK_THREADS == THREADS + 64
    # the compute warps never spin on an event: the acquire loads are the scheduler's alone
    compute = runtime[runtime.index("__device__ void compute("):runtime.index("extern \"C\"")]
    assert "ld_acquire" not in compute and "wait_for_inputs" not in compute


def test_the_parameter_block_layout_is_shared():
    from mdsl.megakernel.runtime.megakernel_engine import Params

    config, _, _ = tiny_model("qwen3")
    text = generate_source(build_plan(decoder_shape(config), workers=8, max_seq=24)).text
    struct = re.search(r"struct Params \{(.*?)\};", text, re.S).group(1)
    names = [line.split()[-1].rstrip(";") for line in struct.strip().splitlines()]
    assert names == [name for _, name in PARAMS] == [name for name, _ in Params._fields_]
    assert f"sizeof(Params) == {ctypes.sizeof(Params)}" in text


def test_more_attention_splits_than_a_warp_merges_or_wider_heads_than_the_threads_are_refused():
    from mdsl.errors import UnsupportedError

    with pytest.raises(ValueError, match="1 to 32 attention splits per kv head, not 33"):
        generate_source(tiny_bf16_plan(splits=33))
    config, _, _ = tiny_model("qwen3", head_dim=512)
    with pytest.raises(UnsupportedError, match="a head's 512 values one a compute thread"):
        generate_source(build_plan(decoder_shape(config), workers=8, max_seq=24))


@functools.cache
def qwen3_8b_plan(max_seq=1200):
    """Qwen3-8B's one-GPU plan (bf16), built once for the tests that read it."""
    config = attrs.evolve(config_from_dict(MODELS["qwen3-8b"]), dtype=bf16)
    return build_plan(decoder_shape(config), workers=H200_SMS, max_seq=max_seq)


@functools.cache
def qwen3_8b_rank_plan():
    """The plan of one of two tensor-parallel ranks of Qwen3-8B (bf16) for the decode benchmark's 1064 positions,
    built once for the tests below. Its default kernel is the one test_runtime_tensor_parallel.py checks the
    engine's defaults of, compiled once for both."""
    from mdsl.megakernel.parallel.gpu_group import shard_config
    from mdsl.megakernel.runtime.task_plan import for_ranks

    config = shard_config(attrs.evolve(config_from_dict(MODELS["qwen3-8b"]), dtype=bf16), 2)
    return for_ranks(build_plan(decoder_shape(config), workers=H200_SMS, max_seq=1064), 2)


@pytest.mark.slow
def test_an_input_rows_loads_are_all_in_flight_before_its_first_store():
    """A rank's QKV input row: 16 elements of h and of the norm weights a thread, loaded before the first
    shared store (one memory round trip; a store between them would keep the next element's generic loads
    behind it: 16 round trips)."""
    text = generate_source(qwen3_8b_rank_plan()).text.replace("__device__ void qkv_task(",
                                                              "__device__ __noinline__ void qkv_task(")
    sass = disassemble(compile_cuda(text, arch="sm_90a").cubin).splitlines()
    start = next(k for k, line in enumerate(sass) if re.match(r"^\$\S*qkv_task\S*:$", line.strip()))
    body = sass[start:]
    first_store = next(k for k, line in enumerate(body) if re.search(r"\bSTS\b", line))
    loads = [line for line in body[:first_store] if re.search(r"\bLD(G)?\.E(\.\w+)*\s+R\d+,", line)]
    assert len(loads) >= 2 * 16, "\n".join(body[:first_store])


def _weight_row_and_barrier_order(source_text: str, function: str) -> str:
    """The order of `function`'s weight loads (W: ld.global.nc), copies into shared memory (C: cp.async), bf16
    input-row loads (r) and barriers (|) in the PTX, whose order is the program's."""
    text = source_text.replace(f"__device__ void {function}(", f"__device__ __noinline__ void {function}(")
    lines = compile_ptx(text).splitlines()
    start = [k for k, line in enumerate(lines) if line.startswith(".func") and function in line][-1]
    body = lines[start:]
    order = ""
    for line in body[:body.index("}")]:
        if "ld.global.nc.L1::no_allocate" in line:
            order += "W"
        elif "cp.async.cg.shared.global" in line:
            order += "C"
        elif re.search(r"\bld(\.global)?\.u16\b", line):
            order += "r"
        elif re.search(r"\bbar(rier)?\.sync\b", line):
            order += "|"
    return order


def test_weights_first_issues_a_linear_tasks_weight_loads_between_its_input_rows_halves():
    """WEIGHTS_FIRST: a gate/up task handed over with its inputs complete issues its first weight loads
    (ld.global.nc) after its input row's loads (bf16: ld.u16; issued before them, the weights delayed them)
    and before the row's norm and its compute barriers; without it, after the barriers. Read in the PTX,
    whose order is the program's (ptxas interleaves the SASS)."""
    plan = tiny_bf16_plan()
    half = generate_source(plan, MegakernelOptions(weights_first=0.5)).text
    none = generate_source(plan, MegakernelOptions(weights_first=0.0)).text
    assert "constexpr int WEIGHTS_FIRST_EIGHTHS = 4;" in half and "constexpr int WEIGHTS_FIRST_EIGHTHS = 0;" in none
    assert re.search(r"r+W+\|", _weight_row_and_barrier_order(half, "gateup_task"))
    assert not re.search(r"r+W", _weight_row_and_barrier_order(none, "gateup_task"))
    source = generate_source(plan, MegakernelOptions(weights_first=1.0))
    assert_fits(source, compiled_once(source.text, arch="sm_90a").resources[KERNEL_NAME])


@pytest.mark.slow
@pytest.mark.parametrize(("world", "share"), [(1, 0.0), (1, 0.5), (1, 1.0), (2, 0.5), (2, 1.0)])
def test_qwen3_8b_compiles_without_spills_at_each_share_of_the_first_pass(world, share):
    """Every weight kind early, with each share of the first pass with the input row (both paths' registers
    at once), on one GPU and on a rank."""
    plan = qwen3_8b_rank_plan() if world == 2 else qwen3_8b_plan(4096)
    source = generate_source(plan, MegakernelOptions(weights_first=share))
    assert_fits(source, compiled_once(source.text, arch="sm_90a").resources[KERNEL_NAME])


def test_an_early_task_issues_its_weight_loads_before_waiting_for_its_inputs():
    """A gate/up task handed over before its inputs are complete issues its whole first pass of weight loads,
    then waits on its slot's ready barrier, then loads its input row."""
    order = _weight_row_and_barrier_order(generate_source(tiny_bf16_plan()).text, "gateup_task")
    assert re.search(r"W{16}\|r", order), order   # LOADS = 16 in flight per lane, then the wait, then the row


def test_an_early_task_copies_its_next_pass_into_shared_memory_while_it_waits():
    """second_pass_kinds: an early gate/up task issues its first pass of weight loads into registers, then the
    next pass's 16 chunks a thread as cp.async copies into the early buffer (beside the tasks' shared memory),
    then waits and loads its row. Without a second pass nothing is reserved."""
    from mdsl.megakernel.runtime.kernel_source import EARLY_BUFFER_BYTES

    plan = tiny_bf16_plan()
    one = generate_source(plan, MegakernelOptions(second_pass_kinds=()))
    two = generate_source(plan, MegakernelOptions(second_pass_kinds=("gateup",)))
    assert "constexpr int EARLY_PASSES = 1;" in one.text and "constexpr int EARLY_PASSES = 2;" in two.text
    offset = int(re.search(r"constexpr int EARLY_OFFSET = (\d+);", two.text).group(1))
    assert offset >= one.smem_bytes and offset % 128 == 0 and two.smem_bytes == offset + EARLY_BUFFER_BYTES
    order = _weight_row_and_barrier_order(two.text, "gateup_task")
    assert re.search(r"W{16}\|r+C+", order), order
    assert_fits(two, compiled_once(two.text, arch="sm_90a").resources[KERNEL_NAME])
    assert generate_source(plan, MegakernelOptions(second_pass_kinds="gateup")).text == two.text


def test_rank_sums_is_one_gpus_and_keeps_its_running_sums_after_the_residual():
    """rank_sums keeps the slices' running sums after the residual in shared memory, compiles without
    spills, and is refused on a rank's plan."""
    from mdsl.megakernel.runtime.cuda_bodies import residual_columns
    from mdsl.megakernel.runtime.task_plan import for_ranks

    plan = tiny_bf16_plan()
    plain, summed = generate_source(plan), generate_source(plan, MegakernelOptions(rank_sums=2))
    assert summed.smem_bytes == plain.smem_bytes + 4 * residual_columns(plan)
    assert_fits(summed, compiled_once(summed.text, arch="sm_90a").resources[KERNEL_NAME])
    with pytest.raises(OptionError, match="rank_sums 2 under tensor parallelism") as info:
        generate_source(for_ranks(plan, 2), MegakernelOptions(rank_sums=2))
    assert "leave it 1" in info.value.hint


def test_attention_preload_keeps_its_rows_after_the_tasks_shared_memory():
    """attention_preload: ATTN_PRELOAD on, its split's key and value rows counted in the task's shared memory
    after the rest (ATTN_PRELOAD_OFFSET), the copies issued before the wait for its inputs in the PTX; refused
    where they do not fit, and left out by default there."""
    from mdsl.megakernel.runtime.kernel_source import attention_floats, attention_preload_offset, shared_memory_bytes

    plan = tiny_bf16_plan()
    shape = plan.shape
    plain = generate_source(plan, MegakernelOptions(attention_preload=False))
    preload = generate_source(plan, MegakernelOptions(attention_preload=True))
    assert "constexpr bool ATTN_PRELOAD = false;" in plain.text and "constexpr bool ATTN_PRELOAD = true;" in preload.text
    rows = 2 * plan.max_chunk * shape.head_dim * shape.dtype.itemsize
    offset = attention_preload_offset(plan)
    assert f"constexpr int ATTN_PRELOAD_OFFSET = {offset};" in preload.text
    assert offset % 16 == 0 and offset >= 4 * attention_floats(plan)
    assert shared_memory_bytes(plan, True) >= 4 * 2 * 8 + offset + rows >= shared_memory_bytes(plan)
    assert_fits(preload, compiled_once(preload.text, arch="sm_90a").resources[KERNEL_NAME])
    text = preload.text.replace("__device__ void attention_task(", "__device__ __noinline__ void attention_task(")
    lines = compile_ptx(text).splitlines()
    start = [k for k, line in enumerate(lines) if line.startswith(".func") and "attention_task" in line][-1]
    body = lines[start:]
    first_copy = next(k for k, line in enumerate(body) if "cp.async.cg.shared.global" in line)
    first_barrier = next(k for k, line in enumerate(body) if re.search(r"\bbar(rier)?\.sync\b", line))
    assert first_copy < first_barrier   # the copies, then the ready barrier (the wait for the inputs)
    long_split = build_plan(shape, workers=8, max_seq=16384, splits=1, min_chunk=16384)
    with pytest.raises(KernelOptionError, match="attention_preload's key and value rows") as info:
        generate_source(long_split, MegakernelOptions(attention_preload=True))
    assert info.value.option == "attention_preload" and info.value.option in OPTION_HINTS
    # None (the default): where the rows fit
    assert "constexpr bool ATTN_PRELOAD = false;" in generate_source(long_split).text
    assert "constexpr bool ATTN_PRELOAD = true;" in generate_source(plan).text


@pytest.mark.slow
def test_qwen3_8b_summing_like_two_ranks_compiles_without_spills():
    """One GPU's Qwen3-8B kernel with rank_sums=2 and the two ranks' attention splits (the GPU test's
    bit-for-bit reference for two GPUs, at full size)."""
    plan = build_plan(decoder_shape(attrs.evolve(config_from_dict(MODELS["qwen3-8b"]), dtype=bf16)),
                      workers=H200_SMS, max_seq=4096, splits=32, min_chunk=32)
    source = generate_source(plan, MegakernelOptions(rank_sums=2))
    assert_fits(source, compiled_once(source.text, arch="sm_90a").resources[KERNEL_NAME])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("options", [MegakernelOptions(second_pass_kinds=("oproj",)),
                                     MegakernelOptions(second_pass_kinds=()),
                                     MegakernelOptions(second_pass_kinds=ALL_KINDS, attention_preload=False),
                                     MegakernelOptions(attention_preload=True)],
                         ids=["second-pass-oproj", "no-second-pass", "second-pass-all", "preload"])
def test_qwen3_8b_with_an_option_compiles_without_spills(world, options):
    """Each GPU count's kernel with the other's second pass, every kind's second pass, or attention's rows
    preloaded, beside its default share of the first pass with the input row."""
    plan = qwen3_8b_rank_plan() if world == 2 else qwen3_8b_plan(4096)
    source = generate_source(plan, options)
    assert_fits(source, compiled_once(source.text, arch="sm_90a").resources[KERNEL_NAME])


def test_the_sass_comparison_names_each_configuration_and_what_differs(tmp_path, capsys):
    """scripts/compare_megakernel_sass.py: the engine's default configurations (and kept options at other
    values) build with this checkout's API, and `compare` tells the same SASS from a different one."""
    import importlib.util
    import json

    path = RUNTIME.parents[2] / "scripts" / "compare_megakernel_sass.py"
    spec = importlib.util.spec_from_file_location("compare_megakernel_sass", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    chosen = script.configurations()
    assert {"qwen3-8b-1064", "qwen3-8b-tp2-rank-1064", "qwen3-8b-rank-of-2-1064", "llama-3.2-1b-4096"} <= set(chosen)
    assert chosen["qwen3-8b-rank-of-2-1064"][4] == MegakernelOptions().for_world(2)
    sass = "        /*0000*/                   LDC R1, c[0x0][0x28] ;\n        /*0010*/                   EXIT ;\n"
    for folder, text in (("a", sass), ("b", sass.replace("LDC R1", "MOV R1"))):
        (tmp_path / folder).mkdir()
        for name in ("same", "other"):
            (tmp_path / folder / f"{name}.sass").write_text(sass if name == "same" else text)
            (tmp_path / folder / f"{name}.json").write_text(json.dumps(
                {"smem_bytes": 1, "preload": True, "resources": {"registers": 168}}))
    assert script.compare(tmp_path / "a", tmp_path / "b", recompiles=0) == 1
    out = capsys.readouterr().out
    assert "same: identical SASS" in out and "other: SASS differs: 2 -> 2 instructions, 2 lines changed" in out

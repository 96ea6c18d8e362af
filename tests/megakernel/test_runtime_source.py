"""The megakernel's CUDA C++ compiles with NVRTC to an sm_90a cubin without spills, for tiny Llama-3 and
Qwen3 models (f32 and bf16) and the Llama-3.2-1B, Qwen3-0.6B and Qwen3-8B shapes; the host's view of
the kernel's parameter block agrees with the device's."""
import ctypes
import functools
import re

import attrs
import pytest

from mdsl.backend.cuda.nvrtc import compile_cuda, compile_ptx, disassemble, sass_opcodes
from mdsl.ir.dtypes import bf16, f32
from mdsl.megakernel.config import config_from_dict
from mdsl.megakernel.runtime.models import MODELS
from mdsl.megakernel.runtime.plan import build_plan
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.engine import OPTION_HINTS
from mdsl.megakernel.runtime.source import (BLOCK_THREADS, KERNEL_NAME, PARAMS, SCHEDULES, THREADS, KernelOptionError,
                                            generate_source)
from tests.megakernel.tiny import tiny_model

H200_SMS = 132
SMEM_LIMIT = 227 * 1024   # Hopper's opt-in shared memory per block
SM_REGISTERS = 64 * 1024  # Hopper's register file per SM (32-bit registers)
REGISTER_UNIT = 8         # registers are allocated per thread in multiples of 8


def compile_plan(plan, schedule="static", prefetch_ahead=1):
    source = generate_source(plan, schedule, prefetch_ahead)
    module = compile_cuda(source.text, arch="sm_90a")
    return source, module, module.resources[KERNEL_NAME]


def assert_fits(source, resources):
    """No spills, and one worker block (compute, scheduler and loader warps) fits on an SM: its registers and
    its shared memory (the dynamic part the engine asks for plus the static slots)."""
    assert resources.spill_store_bytes == 0 and resources.spill_load_bytes == 0, resources
    assert resources.stack_bytes == 0, resources
    assert resources.registers <= 255
    per_thread = -(-resources.registers // REGISTER_UNIT) * REGISTER_UNIT
    assert per_thread * BLOCK_THREADS <= SM_REGISTERS, resources
    assert source.smem_bytes + resources.smem_bytes <= SMEM_LIMIT
    assert resources.smem_bytes >= 2 * 64, "the two task slots live in static shared memory"


@pytest.mark.parametrize(("arch", "dtype", "schedule"), [
    ("llama3", f32, "static"), ("llama3", bf16, "static"), ("qwen3", f32, "static"), ("qwen3", bf16, "static"),
    ("llama3", bf16, "queue"), ("qwen3", bf16, "static-ahead2")], ids=str)
def test_tiny_models_compile_without_spills(arch, dtype, schedule):
    assert set(SCHEDULES) == {"static", "queue"}
    config, _, _ = tiny_model(arch)
    shape = decoder_shape(attrs.evolve(config, dtype=dtype))
    plan = build_plan(shape, workers=H200_SMS, max_seq=config.max_positions)
    ahead = 2 if schedule.endswith("-ahead2") else 1
    source, module, resources = compile_plan(plan, schedule.removesuffix("-ahead2"), ahead)
    assert f"constexpr int PREFETCH_AHEAD = {ahead};" in source.text
    assert module.arch == "sm_90a" and module.cubin.startswith(b"\x7fELF")
    assert_fits(source, resources)
    assert f"using T = {'__nv_bfloat16' if dtype is bf16 else 'float'};" in source.text


def test_attention_lanes_share_key_rows_without_spills():
    config, _, _ = tiny_model("llama3", head_dim=16)
    plan = build_plan(decoder_shape(config), workers=H200_SMS, max_seq=config.max_positions)
    source = generate_source(plan, attention_lanes=4)
    assert "constexpr int ATTN_LANES = 4;" in source.text   # 16 f32 values: 4 vectors of 16 bytes
    assert "constexpr int ATTN_LANES = 2;" in generate_source(attrs.evolve(plan, shape=decoder_shape(
        attrs.evolve(config, dtype=bf16))), attention_lanes=4).text   # 2 vectors: 2 lanes
    assert_fits(source, compile_cuda(source.text, arch="sm_90a").resources[KERNEL_NAME])
    with pytest.raises(ValueError, match="attention_lanes"):
        generate_source(plan, attention_lanes=3)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_full_size_models_compile_without_spills(name):
    shape = decoder_shape(config_from_dict(MODELS[name]))
    source, _, resources = compile_plan(build_plan(shape, workers=H200_SMS, max_seq=4096))
    assert_fits(source, resources)


def test_the_runtime_uses_acquire_release_events_and_no_grid_barrier():
    config, _, _ = tiny_model("llama3")
    text = generate_source(build_plan(decoder_shape(config), workers=8, max_seq=24)).text
    assert "ld.acquire.gpu" in text and "red.release.gpu" in text
    assert "grid.sync" not in text and "cooperative_groups" not in text
    assert "cp.async.bulk.prefetch.L2" in text   # weights stream into L2 while a task waits


def test_a_scheduler_warp_feeds_the_compute_warps_through_named_barriers():
    config, _, _ = tiny_model("llama3")
    plan = build_plan(decoder_shape(config), workers=8, max_seq=24)
    text = generate_source(plan).text
    runtime = text[text.index("constexpr int NT = "):]
    assert "__syncthreads()" not in runtime, "the compute warps' barriers must leave the scheduler warp out"
    assert "bar.sync %0, %1;" in runtime and "bar.arrive %0, %1;" in runtime
    assert f"constexpr int NT = {THREADS};" in runtime and "constexpr int BLOCK = NT + 32;" in runtime
    assert "constexpr int LAUNCH = BLOCK + 32;" in runtime and BLOCK_THREADS == THREADS + 64   # + the loader warp
    # the compute warps never spin on an event: the acquire loads are the scheduler's alone
    compute = runtime[runtime.index("__device__ void compute("):runtime.index("extern \"C\"")]
    assert "ld_acquire" not in compute and "wait_for_inputs" not in compute
    assert "constexpr bool STATIC_SCHEDULE = true;" in text
    assert "constexpr bool STATIC_SCHEDULE = false;" in generate_source(plan, "queue").text
    with pytest.raises(ValueError, match="schedules are static, queue"):
        generate_source(plan, "round-robin")
    for schedule, ahead in (("static", 0), ("static", 5), ("queue", 2)):
        with pytest.raises(ValueError, match="prefetch_ahead is 1 to 4"):
            generate_source(plan, schedule, ahead)


def test_the_parameter_block_layout_is_shared():
    from mdsl.megakernel.runtime.engine import Params

    config, _, _ = tiny_model("qwen3")
    text = generate_source(build_plan(decoder_shape(config), workers=8, max_seq=24)).text
    struct = re.search(r"struct Params \{(.*?)\};", text, re.S).group(1)
    names = [line.split()[-1].rstrip(";") for line in struct.strip().splitlines()]
    assert names == [name for _, name in PARAMS] == [name for name, _ in Params._fields_]
    assert f"sizeof(Params) == {ctypes.sizeof(Params)}" in text


def test_staging_takes_the_tiles_that_fit_next_to_the_task_inputs():
    from mdsl.megakernel.runtime.plan import Kind
    from mdsl.megakernel.runtime.source import SMEM_PER_BLOCK, plan_staging, tile_weight_bytes

    config = attrs.evolve(config_from_dict(MODELS["llama-3.2-1b"]), dtype=bf16)
    plan = build_plan(decoder_shape(config), workers=H200_SMS, max_seq=1200)
    staging = plan_staging(plan)
    # 16 o-proj rows of 2048 bf16 fit; gate/up (63 rows of both) does not; QKV and down are never staged
    assert staging.kinds == ((Kind.OPROJ, 16),) and staging.buffers == 1
    assert staging.buffer_bytes == (tile_weight_bytes(plan, Kind.OPROJ),) == (16 * 2048 * 2,)
    assert tile_weight_bytes(plan, Kind.GATEUP) > SMEM_PER_BLOCK
    assert staging.offset % 128 == 0 and staging.smem_bytes <= SMEM_PER_BLOCK
    assert plan_staging(plan, enabled=False).kinds == ()
    # with heads, gate/up's first columns (a row of each matrix: 2 x 2048 x 2 bytes) in what is left
    heads = plan_staging(plan, heads=True)
    (oproj, _), (gateup, columns) = heads.kinds
    assert (oproj, gateup) == (Kind.OPROJ, Kind.GATEUP) and heads.buffer_bytes[1] == columns * 2 * 2048 * 2
    assert heads.smem_bytes <= SMEM_PER_BLOCK - 512 < heads.smem_bytes + 2 * 2048 * 2 + 128
    big = qwen3_8b_plan()
    assert plan_staging(big).kinds == ()   # 32 o-proj rows of 4096: 256 KB, more than an SM has
    # its head: 22 of the 32 rows next to the 48 KB input row of the down-proj; no room left for gate/up
    assert plan_staging(big, heads=True).kinds == ((Kind.OPROJ, 22),)
    rank = qwen3_8b_rank_plan()   # a rank of two: its whole o-proj tile, then 4 gate/up columns of 16 KB
    assert plan_staging(rank).kinds == ((Kind.OPROJ, 32),)
    assert plan_staging(rank, heads=True).kinds == ((Kind.OPROJ, 32), (Kind.GATEUP, 4))
    assert plan_staging(rank, heads=True, max_buffer_bytes=8192).kinds == ((Kind.OPROJ, 2),)   # < one gate/up column
    # QKV staged: one buffer for every staged kind, as large as the largest tile (a rank's 24 QKV columns
    # of 8 KB), and QKV's copy late; one GPU's 47 QKV columns do not fit whole, 22 of them do
    qkv = plan_staging(rank, kinds=(Kind.QKV, Kind.OPROJ, Kind.GATEUP), heads=True)
    assert qkv.shared and qkv.buffers == 1 and qkv.buffer_bytes == (24 * 4096 * 2,)
    assert qkv.kinds == ((Kind.QKV, 24), (Kind.OPROJ, 32), (Kind.GATEUP, 12))
    assert qkv.late_mask == 1 << int(Kind.QKV) and {qkv.buffer_of(k) for k, _ in qkv.kinds} == {0}
    assert plan_staging(big, kinds=(Kind.QKV,)).kinds == ()
    assert plan_staging(big, kinds=(Kind.QKV,), heads=True).kinds == ((Kind.QKV, 22),)
    assert not plan_staging(rank).shared and plan_staging(rank).late_mask == 0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_staged_tiles_compile_without_spills(schedule):
    from mdsl.megakernel.runtime.plan import Kind

    config, _, _ = tiny_model("qwen3")
    plan = build_plan(decoder_shape(attrs.evolve(config, dtype=bf16)), workers=H200_SMS, max_seq=config.max_positions)
    source = generate_source(plan, schedule, stage_weights=True, prefetch_kib=256)
    assert source.staging.buffers == 2 and [kind for kind, _ in source.staging.kinds] == [Kind.OPROJ, Kind.GATEUP]
    assert "constexpr int STAGE_BUFFERS = 2;" in source.text and "PREFETCH_BYTES = 262144ll" in source.text
    assert source.smem_bytes == source.staging.offset + sum(source.staging.buffer_bytes)
    module = compile_cuda(source.text, arch="sm_90a")
    assert_fits(source, module.resources[KERNEL_NAME])
    # tile heads: 256-byte buffers hold 4 of an o-proj tile's 8 columns and 2 of a gate/up tile's
    heads = generate_source(plan, schedule, stage_weights=True, stage_heads=True, stage_buffer_bytes=256)
    assert heads.staging.kinds == ((Kind.OPROJ, 4), (Kind.GATEUP, 2)) and heads.staging.buffer_bytes == (256, 256)
    assert "case KIND_GATEUP: return 2;" in heads.text and "case 1: return 256;" in heads.text
    if schedule == "static":   # (one compile of the heads is enough: ~15 s on CI's 2 cores)
        assert_fits(heads, compile_cuda(heads.text, arch="sm_90a").resources[KERNEL_NAME])
    # QKV, o-proj and gate/up through one buffer, QKV's copy late
    shared = generate_source(plan, schedule, stage_weights=True, stage_kinds=(Kind.QKV, Kind.OPROJ, Kind.GATEUP))
    assert shared.staging.buffers == 1 and len(shared.staging.kinds) == 3
    assert "constexpr int LATE_STAGE_KINDS = 1;" in shared.text and "case KIND_GATEUP: return 0;" in shared.text
    if schedule == "static":
        assert_fits(shared, compile_cuda(shared.text, arch="sm_90a").resources[KERNEL_NAME])
    with pytest.raises(ValueError, match="prefetch_kib"):
        generate_source(plan, prefetch_kib=8)
    with pytest.raises(ValueError, match="refine stage_weights"):
        generate_source(plan, stage_heads=True)
    with pytest.raises(ValueError, match="refine stage_weights"):
        generate_source(plan, stage_kinds=(Kind.QKV,))


@functools.cache
def qwen3_8b_plan():
    """Qwen3-8B's one-GPU plan (bf16, 1200 positions), built once for the tests that read it."""
    config = attrs.evolve(config_from_dict(MODELS["qwen3-8b"]), dtype=bf16)
    return build_plan(decoder_shape(config), workers=H200_SMS, max_seq=1200)


@functools.cache
def qwen3_8b_rank_plan():
    """The plan of one of two tensor-parallel ranks of Qwen3-8B (bf16), built once for the tests below."""
    from mdsl.megakernel.runtime.plan import for_ranks
    from mdsl.megakernel.runtime.tp import shard_config

    config = shard_config(attrs.evolve(config_from_dict(MODELS["qwen3-8b"]), dtype=bf16), 2)
    return for_ranks(build_plan(decoder_shape(config), workers=H200_SMS, max_seq=1200), 2)


def test_streaming_ring_holds_whole_columns_of_every_kind():
    from mdsl.megakernel.runtime.plan import Kind
    from mdsl.megakernel.runtime.source import SMEM_PER_BLOCK, item_weight_bytes, plan_streaming

    one = qwen3_8b_plan()
    ring = plan_streaming(one)
    items = dict(ring.items)
    assert set(items) == {Kind.QKV, Kind.OPROJ, Kind.GATEUP, Kind.DOWN, Kind.LMHEAD}
    # a down-proj column is 12288 bf16 (24 KB): seven buffers of ~25 KB (eight would not hold one), a
    # sub-tile per warp in flight
    assert item_weight_bytes(one, Kind.DOWN) == 24576 and (ring.buffers, items[Kind.DOWN]) == (7, 1)
    assert ring.buffer_bytes >= 24576 and items[Kind.QKV] == 3   # 3 rows of 4096 bf16
    assert ring.offset % 128 == 0 and ring.smem_bytes <= SMEM_PER_BLOCK
    for kind, per in ring.items:
        assert 1 <= per * item_weight_bytes(one, kind) <= ring.buffer_bytes
    rank = qwen3_8b_rank_plan()
    shard_ring = plan_streaming(rank)
    # a rank's columns are at most 16 KB (gate/up): twelve buffers, more than the eight warps
    assert shard_ring.buffers == 12 and dict(shard_ring.items)[Kind.GATEUP] == 1
    assert dict(shard_ring.items)[Kind.OPROJ] == 4   # 31 or 32 columns of 2048 bf16 a tile: 4 per warp
    small = plan_streaming(rank, buffer_bytes=16 * 1024)
    assert (small.buffers, small.buffer_bytes, dict(small.items)[Kind.GATEUP]) == (12, 16384, 1)
    with pytest.raises(KernelOptionError, match="two buffers of a weight column") as info:
        plan_streaming(rank, buffer_bytes=8 * 1024)   # a gate/up column (two rows of 4096 bf16) is 16 KB
    assert info.value.option == "stream_buffer_bytes" and info.value.option in OPTION_HINTS


def test_streamed_weights_compile_without_spills_and_need_the_static_schedule():
    config, _, _ = tiny_model("qwen3")
    plan = build_plan(decoder_shape(attrs.evolve(config, dtype=bf16)), workers=H200_SMS, max_seq=config.max_positions)
    source = generate_source(plan, stream_weights=True, stream_buffer_bytes=256)
    ring = source.streaming
    assert ring.buffers == 16 and ring.buffer_bytes == 256 and source.staging.buffers == 0
    assert "constexpr int STREAM_BUFFERS = 16;" in source.text and "constexpr int STAGE_BUFFERS = 0;" in source.text
    assert source.smem_bytes == ring.offset + 16 * 256
    assert_fits(source, compile_cuda(source.text, arch="sm_90a").resources[KERNEL_NAME])
    plain = generate_source(plan)
    assert "constexpr int STREAM_BUFFERS = 0;" in plain.text and plain.streaming.buffers == 0
    for options in ({"schedule": "queue"}, {"stage_weights": True}):
        with pytest.raises(ValueError, match="stream_weights needs the static schedule"):
            generate_source(plan, stream_weights=True, **options)
    short = generate_source(plan, stream_weights=("qkv", "oproj"))
    assert [kind.name for kind, _ in short.streaming.items] == ["QKV", "OPROJ"]
    assert f"constexpr int STREAM_KINDS = {(1 << 0) | (1 << 3)};" in short.text
    with pytest.raises(ValueError, match="stream_weights names kinds of qkv, oproj, gateup, down, lmhead"):
        generate_source(plan, stream_weights=("attn",))


@pytest.mark.slow
def test_streamed_qwen3_8b_rank_compiles_without_spills():
    source = generate_source(qwen3_8b_rank_plan(), stream_weights=True)
    module = compile_cuda(source.text, arch="sm_90a")
    assert_fits(source, module.resources[KERNEL_NAME])
    # the loader reads a task's weight pointers once, not per sub-tile: no global load between the bulk
    # copies of one task's sub-tiles (one such load per 16 KB held the stream to ~16 GB/s an SM)
    sass = disassemble(module.cubin).splitlines()
    copies = [k for k, line in enumerate(sass) if "UBLKCP" in line]
    assert copies and not any("LDG" in line for line in sass[copies[0]:copies[-1]])


@pytest.mark.slow
def test_an_input_rows_loads_are_all_in_flight_before_its_first_store():
    """A rank's QKV input row: two f32 partials of 16 elements a thread, loaded before the first shared
    store (one memory round trip; a store between them kept the next element's generic loads behind it:
    16 round trips)."""
    text = generate_source(qwen3_8b_rank_plan()).text.replace("__device__ void qkv_task(",
                                                              "__device__ __noinline__ void qkv_task(")
    sass = disassemble(compile_cuda(text, arch="sm_90a").cubin).splitlines()
    start = next(k for k, line in enumerate(sass) if re.match(r"^\$\S*qkv_task\S*:$", line.strip()))
    body = sass[start:]
    first_store = next(k for k, line in enumerate(body) if re.search(r"\bSTS\b", line))
    loads = [line for line in body[:first_store] if re.search(r"\bLD(G)?\.E(\.\w+)*\s+R\d+,", line)]
    assert len(loads) >= 2 * 16, "\n".join(body[:first_store])


def test_the_l2_head_prefetch_covers_the_kinds_asked_for():
    from mdsl.megakernel.runtime.plan import Kind
    from mdsl.megakernel.runtime.source import WEIGHT_KINDS

    config, _, _ = tiny_model("llama3")
    plan = build_plan(decoder_shape(config), workers=8, max_seq=24)
    every = sum(1 << int(kind) for kind in WEIGHT_KINDS)
    assert f"constexpr int PREFETCH_KINDS = {every};" in generate_source(plan).text
    kinds = (Kind.OPROJ, Kind.GATEUP, Kind.LMHEAD)
    short = generate_source(plan, prefetch_kinds=kinds)
    assert f"constexpr int PREFETCH_KINDS = {sum(1 << int(kind) for kind in kinds)};" in short.text
    none = generate_source(plan, prefetch_kinds=())
    assert "constexpr int PREFETCH_KINDS = 0;" in none.text
    assert_fits(short, compile_cuda(short.text, arch="sm_90a").resources[KERNEL_NAME])
    # the mask gates the scheduler's bulk L2 prefetches: with no kind the compiler drops them all
    bulk_prefetches = [sass_opcodes(disassemble(compile_cuda(source.text, arch="sm_90a").cubin)).get("UBLKPF", 0)
                       for source in (short, none)]
    assert bulk_prefetches[0] >= 1 and bulk_prefetches[1] == 0, bulk_prefetches


def test_weights_first_issues_a_linear_tasks_weight_loads_before_its_input_row():
    """WEIGHTS_FIRST: gate/up's first weight loads (ld.global.nc) come after its input row's loads (bf16:
    ld.u16; issued before them, the weights delayed them) and before the row's norm and its compute barriers
    in the generated code; without it, after the barriers. Read in the PTX, whose order is the program's
    (ptxas interleaves the SASS)."""
    config, _, _ = tiny_model("qwen3")
    plan = build_plan(decoder_shape(attrs.evolve(config, dtype=bf16)), workers=8, max_seq=24)

    def first_row_load_weight_load_and_barrier(weights_first: bool) -> tuple:
        text = generate_source(plan, weights_first=0.5 if weights_first else 0.0).text
        assert f"constexpr bool WEIGHTS_FIRST = {'true' if weights_first else 'false'};" in text
        assert f"constexpr int WEIGHTS_FIRST_EIGHTHS = {4 if weights_first else 0};" in text
        lines = compile_ptx(text.replace("__device__ void gateup_task(", "__device__ __noinline__ void gateup_task(")
                            ).splitlines()
        start = [k for k, line in enumerate(lines) if line.startswith(".func") and "gateup_task" in line][-1]
        body = lines[start:]
        body = body[:body.index("}")]
        row = next(k for k, line in enumerate(body) if re.search(r"\bld(\.global)?\.u16\b", line))
        load = next(k for k, line in enumerate(body) if "ld.global.nc.L1::no_allocate" in line)
        barrier = next(k for k, line in enumerate(body) if re.search(r"\bbar(rier)?\.sync\b", line))
        return row, load, barrier

    row, load, barrier = first_row_load_weight_load_and_barrier(True)
    assert row < load < barrier
    row, load, barrier = first_row_load_weight_load_and_barrier(False)
    assert row < barrier < load
    source = generate_source(plan, weights_first=1.0)
    assert_fits(source, compile_cuda(source.text, arch="sm_90a").resources[KERNEL_NAME])
    with pytest.raises(ValueError, match="weights_first is a share of a pass"):
        generate_source(plan, weights_first=1.5)


@pytest.mark.slow
@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize("world", [1, 2])
def test_weights_first_qwen3_8b_compiles_without_spills(world, share):
    plan = qwen3_8b_rank_plan() if world == 2 else build_plan(
        decoder_shape(attrs.evolve(config_from_dict(MODELS["qwen3-8b"]), dtype=bf16)), workers=H200_SMS, max_seq=1200)
    source = generate_source(plan, weights_first=share, stage_weights=world == 2, stage_late=world == 2)
    assert_fits(source, compile_cuda(source.text, arch="sm_90a").resources[KERNEL_NAME])


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_unrolled_attention_compiles_without_spills(arch):
    config, _, _ = tiny_model(arch)
    plan = build_plan(decoder_shape(attrs.evolve(config, dtype=bf16)), workers=8, max_seq=24)
    assert "constexpr bool ATTN_UNROLLED = false;" in generate_source(plan).text
    source = generate_source(plan, attention_unrolled=True, attention_lanes=4)
    assert "constexpr bool ATTN_UNROLLED = true;" in source.text
    assert_fits(source, compile_cuda(source.text, arch="sm_90a").resources[KERNEL_NAME])


@pytest.mark.slow
def test_unrolled_attention_qwen3_8b_rank_compiles_without_spills_and_batches_the_value_rows():
    """Without spills; and the weighted values' batch of eight value rows (four 2-byte loads a lane each) is
    loaded with no branch between the loads: a row loaded behind a branch of its own was converted inside it,
    so each row cost a round trip."""
    source = generate_source(qwen3_8b_rank_plan(), attention_unrolled=True, weights_first=1.0, stage_weights=True,
                             stage_late=True)
    assert_fits(source, compile_cuda(source.text, arch="sm_90a").resources[KERNEL_NAME])
    text = source.text.replace("__device__ void attention_task(", "__device__ __noinline__ void attention_task(")
    sass = disassemble(compile_cuda(text, arch="sm_90a").cubin).splitlines()
    start = next(k for k, line in enumerate(sass) if re.match(r"^\$\S*attention_task\S*:$", line.strip()))
    end = next(k for k in range(start + 1, len(sass)) if re.match(r"^\$\S+:$", sass[k].strip()))
    longest = run = 0
    for line in sass[start:end]:
        if re.search(r"\bLDG?\.E\.U16\b", line):
            run += 1
            longest = max(longest, run)
        elif re.search(r"\b(BRA|BSYNC|FFMA)\b", line):
            run = 0
    assert longest >= 8 * 4, longest


def _weight_row_and_barrier_order(source_text: str, function: str) -> str:
    """The order of `function`'s weight loads (W: ld.global.nc), bf16 input-row loads (r) and barriers (|)
    in the PTX, whose order is the program's."""
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


def test_an_early_kinds_task_issues_its_weight_loads_before_waiting_for_its_inputs():
    """EARLY_KINDS: a gate/up task handed over before its inputs are complete issues its whole first pass of
    weight loads, then waits on its slot's ready barrier, then loads its input row; without early kinds, no
    weight load comes before a barrier that a row load follows. Only kinds with weight rows are early."""
    from mdsl.megakernel.runtime.plan import Kind

    config, _, _ = tiny_model("qwen3")
    plan = build_plan(decoder_shape(attrs.evolve(config, dtype=bf16)), workers=8, max_seq=24)
    plain = generate_source(plan)
    assert "constexpr int EARLY_KINDS = 0;" in plain.text
    assert not re.search(r"W\|r", _weight_row_and_barrier_order(plain.text, "gateup_task"))
    early = generate_source(plan, early_kinds=(Kind.GATEUP,))
    assert f"constexpr int EARLY_KINDS = {1 << int(Kind.GATEUP)};" in early.text
    order = _weight_row_and_barrier_order(early.text, "gateup_task")
    assert re.search(r"W{16}\|r", order), order   # LOADS = 16 in flight per lane, then the wait, then the row
    assert_fits(early, compile_cuda(early.text, arch="sm_90a").resources[KERNEL_NAME])
    with pytest.raises(ValueError, match="early_kinds are kinds that read weight rows"):
        generate_source(plan, early_kinds=(Kind.ATTN,))


def test_an_early_task_copies_its_next_pass_into_shared_memory_while_it_waits():
    """early_passes=2: an early gate/up task issues its first pass of weight loads into registers, then the
    next pass's 16 chunks a thread as cp.async copies into the early buffer (beside the tasks' shared memory,
    after any staging buffer), then waits and loads its row. Without early kinds nothing is reserved."""
    from mdsl.megakernel.runtime.plan import Kind
    from mdsl.megakernel.runtime.source import EARLY_BUFFER_BYTES

    config, _, _ = tiny_model("qwen3")
    plan = build_plan(decoder_shape(attrs.evolve(config, dtype=bf16)), workers=8, max_seq=24)
    one = generate_source(plan, early_kinds=(Kind.GATEUP,))
    two = generate_source(plan, early_kinds=(Kind.GATEUP,), early_passes=2)
    assert "constexpr int EARLY_PASSES = 1;" in one.text and "constexpr int EARLY_PASSES = 2;" in two.text
    offset = int(re.search(r"constexpr int EARLY_OFFSET = (\d+);", two.text).group(1))
    assert offset >= one.smem_bytes and offset % 128 == 0 and two.smem_bytes == offset + EARLY_BUFFER_BYTES
    order = _weight_row_and_barrier_order(two.text, "gateup_task")
    assert re.search(r"W{16}\|r+C+", order), order
    assert_fits(two, compile_cuda(two.text, arch="sm_90a").resources[KERNEL_NAME])
    staged = generate_source(plan, early_kinds=(Kind.GATEUP,), early_passes=2, stage_weights=True,
                             stage_kinds=(Kind.QKV, Kind.OPROJ), stage_heads=True)
    offset = int(re.search(r"constexpr int EARLY_OFFSET = (\d+);", staged.text).group(1))
    assert offset >= staged.staging.smem_bytes and staged.smem_bytes + 512 <= SMEM_LIMIT
    assert generate_source(plan, early_passes=2).smem_bytes == generate_source(plan).smem_bytes   # no early kind
    with pytest.raises(ValueError, match="early_passes is one of"):
        generate_source(plan, early_kinds=(Kind.GATEUP,), early_passes=3)


def test_rank_sums_is_one_gpus_and_reads_its_weights_from_global_memory():
    """rank_sums keeps the slices' running sums after the residual in shared memory, compiles without
    spills, and is refused on a rank's plan or with the o-proj or down-proj staged."""
    from mdsl.megakernel.runtime.bodies import residual_columns
    from mdsl.megakernel.runtime.plan import Kind, for_ranks

    config, _, _ = tiny_model("qwen3")
    plan = build_plan(decoder_shape(attrs.evolve(config, dtype=bf16)), workers=8, max_seq=24)
    plain, summed = generate_source(plan), generate_source(plan, rank_sums=2)
    assert summed.smem_bytes == plain.smem_bytes + 4 * residual_columns(plan)
    assert_fits(summed, compile_cuda(summed.text, arch="sm_90a").resources[KERNEL_NAME])
    with pytest.raises(ValueError, match="rank_sums is 1, or on one GPU's plan"):
        generate_source(for_ranks(plan, 2), rank_sums=2)
    for staged in ((Kind.OPROJ,), (Kind.GATEUP,)):
        with pytest.raises(KernelOptionError, match="no kind can be staged or streamed") as info:
            generate_source(plan, rank_sums=2, stage_weights=True, stage_kinds=staged)
        assert info.value.option == "rank_sums" and info.value.option in OPTION_HINTS
    with pytest.raises(KernelOptionError, match="no kind can be staged or streamed"):
        generate_source(plan, rank_sums=2, stream_weights=("qkv",))


def test_attention_preload_makes_attention_early_and_keeps_its_rows_after_its_shared_memory():
    """attention_preload: ATTN_PRELOAD on, attention among the early kinds (its copies fly while it waits), its
    split's key and value rows counted in the task's shared memory after the rest (ATTN_PRELOAD_OFFSET), the
    copies issued before the wait in the PTX; refused where they do not fit."""
    from mdsl.megakernel.runtime.plan import Kind
    from mdsl.megakernel.runtime.source import attention_floats, attention_preload_offset, shared_memory_bytes

    config, _, _ = tiny_model("qwen3")
    shape = decoder_shape(attrs.evolve(config, dtype=bf16))
    plan = build_plan(shape, workers=8, max_seq=24)
    plain, preload = generate_source(plan), generate_source(plan, attention_preload=True)
    assert "constexpr bool ATTN_PRELOAD = false;" in plain.text and "constexpr bool ATTN_PRELOAD = true;" in preload.text
    assert f"constexpr int EARLY_KINDS = {1 << int(Kind.ATTN)};" in preload.text
    rows = 2 * plan.max_chunk * shape.head_dim * shape.dtype.itemsize
    offset = attention_preload_offset(plan)
    assert f"constexpr int ATTN_PRELOAD_OFFSET = {offset};" in preload.text
    assert offset % 16 == 0 and offset >= 4 * attention_floats(plan)
    assert shared_memory_bytes(plan, True) >= 4 * 2 * 8 + offset + rows >= shared_memory_bytes(plan)
    assert_fits(preload, compile_cuda(preload.text, arch="sm_90a").resources[KERNEL_NAME])
    text = preload.text.replace("__device__ void attention_task(", "__device__ __noinline__ void attention_task(")
    lines = compile_ptx(text).splitlines()
    start = [k for k, line in enumerate(lines) if line.startswith(".func") and "attention_task" in line][-1]
    body = lines[start:]
    first_copy = next(k for k, line in enumerate(body) if "cp.async.cg.shared.global" in line)
    first_barrier = next(k for k, line in enumerate(body) if re.search(r"\bbar(rier)?\.sync\b", line))
    assert first_copy < first_barrier   # the copies, then the ready barrier (the wait for the inputs)
    long_split = build_plan(shape, workers=8, max_seq=16384, splits=1, min_chunk=16384)
    with pytest.raises(KernelOptionError, match="attention_preload's key and value rows") as info:
        generate_source(long_split, attention_preload=True)
    assert info.value.option == "attention_preload" and info.value.option in OPTION_HINTS
    # None (the one-GPU engine's default): where the rows fit
    assert "constexpr bool ATTN_PRELOAD = false;" in generate_source(long_split, attention_preload=None).text
    assert "constexpr bool ATTN_PRELOAD = true;" in generate_source(plan, attention_preload=None).text


@pytest.mark.slow
def test_qwen3_8b_summing_like_two_ranks_compiles_without_spills():
    """One GPU's Qwen3-8B kernel with rank_sums=2 and the two ranks' attention splits (the GPU test's
    bit-for-bit reference for two GPUs, at full size)."""
    from mdsl.megakernel.runtime.source import WEIGHT_KINDS

    plan = build_plan(decoder_shape(attrs.evolve(config_from_dict(MODELS["qwen3-8b"]), dtype=bf16)),
                      workers=H200_SMS, max_seq=4096, splits=32, min_chunk=32)
    source = generate_source(plan, early_kinds=WEIGHT_KINDS, rank_sums=2)
    assert_fits(source, compile_cuda(source.text, arch="sm_90a").resources[KERNEL_NAME])


@pytest.mark.slow
@pytest.mark.parametrize(("world", "share"), [(1, 0.0), (2, 1.0), (1, 1.0)])
def test_early_qwen3_8b_compiles_without_spills(world, share):
    """Every weight kind early (the engine's default), with the input row's share of the first pass of each
    GPU count's default and the whole pass on one GPU (both paths' registers at once)."""
    from mdsl.megakernel.runtime.source import WEIGHT_KINDS

    plan = qwen3_8b_rank_plan() if world == 2 else build_plan(
        decoder_shape(attrs.evolve(config_from_dict(MODELS["qwen3-8b"]), dtype=bf16)), workers=H200_SMS, max_seq=4096)
    source = generate_source(plan, early_kinds=WEIGHT_KINDS, weights_first=share)
    assert_fits(source, compile_cuda(source.text, arch="sm_90a").resources[KERNEL_NAME])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("option", [{"early_passes": 2}, {"attention_preload": True}], ids=["early2", "preload"])
def test_qwen3_8b_with_an_option_compiles_without_spills(world, option):
    """Two early passes, or attention's rows preloaded, beside each GPU count's default share of the first pass
    with the input row."""
    from mdsl.megakernel.runtime.source import WEIGHT_KINDS

    plan = qwen3_8b_rank_plan() if world == 2 else build_plan(
        decoder_shape(attrs.evolve(config_from_dict(MODELS["qwen3-8b"]), dtype=bf16)), workers=H200_SMS, max_seq=4096)
    source = generate_source(plan, early_kinds=WEIGHT_KINDS, weights_first=1.0 if world == 2 else 0.0, **option)
    assert_fits(source, compile_cuda(source.text, arch="sm_90a").resources[KERNEL_NAME])

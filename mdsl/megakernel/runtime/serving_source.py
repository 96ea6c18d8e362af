"""The serving kernel's CUDA C++ (docs/design.md, "The megakernel's serving tables"): the resident megakernel that
runs a ServingPlan's tables, step after step, with the serving scheduler inside the launch.

Its text is the one-row kernel's (kernel_source.py: the CUDA backend's prelude, the model's constants, device.cu and
its headers) with the runtime's SERVE section kept (serve.cuh, serve_rows.cuh, serve_tensor.cuh, serve_attention.cuh,
serve_sampling.cuh: SCHEDULE and the bodies over a step's rows; the protocol's regions in Params), the task bodies of
serving_bodies.py in place of the one-row ones, and before the runtime the C declarations it runs over: the serving protocol's structs, sizes
and region offsets (mdsl.serving.protocol.c_declarations), the scheduler (mdsl/serving/scheduler.cuh with its
regions) and the serving tables' (ServingPlan.c_declarations: ServeWork, AttnItem, the serve region's offsets).
The one-row constants are the base plan's; TASKS and LM_FIRST are the serving tables'. The linear kinds and the LM
head are early kinds (worker.cuh): handed over before their inputs are complete, their first weight rows prefetched
to L2 while the block waits for them; the others are handed over with their inputs complete."""
from __future__ import annotations

from mdsl.backend.cuda.prelude import INCLUDES, PRELUDE
from mdsl.errors import UnsupportedError
from mdsl.megakernel.runtime.cuda_bodies import runtime_sections
from mdsl.megakernel.runtime.kernel_source import (BODIES_MARKER, SMEM_PER_BLOCK, STATIC_SMEM_RESERVE, WARPS,
                                                   MegakernelSource, kernel_layout, linear_row_floats, model_lines,
                                                   runtime_source)
from mdsl.megakernel.runtime.megakernel_options import MegakernelOptions
from mdsl.megakernel.runtime.serving_bodies import generate_serving_bodies
from mdsl.megakernel.runtime.serving_plan import ServingPlan
from mdsl.serving.protocol import c_declarations
from mdsl.serving.scheduler import scheduler_source

# Rows a pass of a linear tile's weight loads serves at most on CUDA cores (serve_rows.cuh's ROW_GROUP), and the shared
# memory a linear task's input rows may take (160 KiB: on CUDA cores, Qwen3-8B's down-projection rows of 12288 values
# three at a time, its 4096-wide rows eight at a time; on tensor cores, 64 rows of 1024 16-bit values, 16 of 4096)
ROW_GROUP = 8
ROW_FLOATS = 40 * 1024
# the profile's ring: the task records of the last PROFILE_STEPS steps (worker.cuh; the host picks the steps by
# turning the profile on and off while the kernel runs)
PROFILE_STEPS = 8
# the one-row choices the serving kernel's constants are written with: its bodies load their inputs once they are
# complete, and read attention's keys where they lie in the pool
OPTIONS = MegakernelOptions(attention_preload=False, weights_first=0.0, second_pass_kinds=(), rank_sums=1)


def serving_row_floats(plan: ServingPlan) -> int:
    """Shared floats of a linear task's input rows (SERVE_ROW_FLOATS). 16-bit models: ROW_FLOATS, the staged rows of
    the tensor cores' groups (serve_tensor.cuh: up to 64 rows of T, 16 at least, or the kind keeps CUDA cores);
    float32 models: ROW_GROUP rows of the widest input, or what ROW_FLOATS holds of them (one at least)."""
    widest = linear_row_floats(plan.base)
    if plan.shape.dtype.itemsize == 2:
        return max(widest, ROW_FLOATS)
    return max(widest, min(ROW_GROUP * widest, ROW_FLOATS))


def attention_chunk(plan: ServingPlan) -> int:
    """Keys an attention item's warp scores and stages at once (ATTN_CHUNK: a key a lane, its value row copied into
    the warp's shared memory): 32, or the power of two under it whose value rows and q heads of every warp fit in
    ROW_FLOATS (a wide head of float32 values)."""
    s, width = plan.shape, plan.shape.dtype.itemsize
    chunk = 32
    while chunk > 1 and WARPS * (chunk * s.head_dim * width / 4 + 2 * s.group * s.head_dim) > ROW_FLOATS:
        chunk //= 2
    return chunk


def serving_shared_floats(plan: ServingPlan) -> dict:
    """Each body's shared floats after the block reductions' scratch: a linear task's input rows (the LM head's
    too), an ATTN item's per-warp scratch, q heads and staged value rows (serve_attention.cuh's
    attention_items_task: an item is a warp's), the KV append's per-warp scratch and key, SCHEDULE's words per chunk
    and per row."""
    s = plan.shape
    attention = WARPS * (2 * s.group * s.head_dim + -(-attention_chunk(plan) * s.head_dim * s.dtype.itemsize // 4))
    return {"linear": serving_row_floats(plan), "attention": attention, "append": 2 * WARPS * s.head_dim,
            "schedule": plan.serving.max_batch + plan.max_rows + 1}


# what narrows each body's shared memory where it is the widest
SHARED_HINTS = {"linear": "the model's widest linear input row does not fit; serve it on device='gpu'",
                "attention": "the model's query heads per kv head and head_dim do not fit; serve it on device='gpu'",
                "append": "the model's head_dim does not fit; serve it on device='gpu'",
                "schedule": "a smaller max_batch or max_tokens_per_step narrows SCHEDULE's words"}


def append_tiles(plan: ServingPlan) -> list:
    """Per kv head, the QKV tiles of a layer counted on its append counter (every layer has as many)."""
    return [plan.append_tiles(g) for g in range(plan.shape.kv_heads)]


def generate_serving_source(plan: ServingPlan) -> MegakernelSource:
    """The serving kernel for `plan` and its dynamic shared memory per worker block. UnsupportedError where its
    shared memory does not fit an SM."""
    base = plan.base
    options = OPTIONS.for_world(base.world)
    layout = kernel_layout(base, options, stream=False)
    tiles = ", ".join(str(n) for n in append_tiles(plan))
    extra = (f"constexpr int ROW_GROUP = {ROW_GROUP};   // rows a linear tile's pass of weight loads serves at most",
             f"constexpr int SERVE_ROW_FLOATS = {serving_row_floats(plan)};   // a linear task's input rows",
             f"constexpr int ATTN_CHUNK = {attention_chunk(plan)};   // an attention item's keys scored at once",
             f"constexpr int SERVE_WINDOW = {plan.attention_window};   // a row's keys at most (0: its whole range)",
             f"constexpr int PROFILE_STEPS = {PROFILE_STEPS};   // the profile's ring of the last steps' records",
             f"__constant__ int APPEND_TILES[HKV] = {{{tiles}}};   // per kv head: the QKV tiles counting on it")
    lines = model_lines(base, options, layout, tasks=plan.tasks, extra=extra)
    runtime = runtime_source(runtime_sections(base) | {"SERVE"}).replace(BODIES_MARKER,
                                                                          generate_serving_bodies(plan))
    text = "\n".join([INCLUDES, PRELUDE, c_declarations(plan.serving), scheduler_source(regions=True),
                      plan.c_declarations(), *lines, runtime])
    floats = serving_shared_floats(plan)
    smem = 4 * (2 * WARPS + max(floats.values()))
    if smem > SMEM_PER_BLOCK - STATIC_SMEM_RESERVE:
        raise UnsupportedError(f"the serving kernel needs {smem} bytes of shared memory per block ({floats} floats), "
                               f"an SM has {SMEM_PER_BLOCK - STATIC_SMEM_RESERVE}",
                               hint=SHARED_HINTS[max(floats, key=floats.get)])
    return MegakernelSource(text, smem)

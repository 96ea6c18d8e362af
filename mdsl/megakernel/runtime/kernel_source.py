"""The megakernel's CUDA C++: the model's constants, the CUDA backend's prelude (its element-type
conversions and warp reductions, shared with every superoptimized kernel), the runtime in device.cu and
the headers it includes (one concern each: sync, loads, residual, gemv, merge, attention, sampling, worker),
and the task bodies generated for the plan's layer ops (cuda_bodies.py), compiled with NVRTC for sm_90a.

The headers are expanded in place (`runtime_source`), so that the source text NVRTC compiles, and the
compile cache keys, are the whole kernel."""
from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Optional

import attrs
import numpy as np

from mdsl.backend.cuda.prelude import INCLUDES, PRELUDE
from mdsl.errors import UnsupportedError
from mdsl.ir.dtypes import bf16, f32, round_to_dtype
from mdsl.megakernel.runtime.cuda_bodies import generate_bodies, residual_columns, runtime_sections
from mdsl.megakernel.runtime.megakernel_options import MAX_SPLITS, WEIGHT_KIND_NAMES, MegakernelOptions
from mdsl.megakernel.runtime.profile import BODY_MARKS
from mdsl.megakernel.runtime.task_plan import SERVING_KINDS, Kind, TaskPlan

KERNEL_NAME = "mdsl_megakernel"
THREADS = 256                    # device.cu's NT: the compute warps' threads
WARPS = THREADS // 32
BLOCK_THREADS = THREADS + 64     # device.cu's LAUNCH: + the scheduler warp and a warp that leaves at once
PROFILE_WORDS = 5 + BODY_MARKS   # device.cu's PROFILE_WORDS: 64-bit words per task index in the profile
_CUDA_TYPES = {bf16: "__nv_bfloat16", f32: "float"}
_RUNTIME = Path(__file__).parent


# the kernel's one parameter, field by field (C type, name); every field is 8 bytes, so the host's
# ctypes mirror (engine.Params) cannot disagree on padding
PARAMS = (
    ("const Task*", "tasks"), ("const int2*", "waits"), ("const int*", "signals"),
    ("unsigned*", "events"),            # per event: completions so far in this launch
    ("int*", "state"),                  # the stop step, tokens generated, the next token, the watchdog's report
    ("const LayerWeights*", "layers"), ("const T*", "embed"), ("const T*", "final_norm"), ("const T*", "lm_head"),
    ("const float*", "rope_cos"), ("const float*", "rope_sin"),   # [MAX_SEQ][D / 2]
    ("T*", "hs"), ("T*", "mids"), ("T*", "qkvs"), ("T*", "attns"), ("T*", "acts"),   # per layer
    ("float*", "parts"), ("float*", "logits"), ("float*", "best_value"), ("int*", "best_index"),
    ("const int*", "prompt"), ("int*", "out_tokens"), ("const int*", "eos"),
    ("unsigned long long*", "profile"),  # PROFILE_WORDS words per task index, or null
    # tensor parallelism (plan.world > 1; null / 0 on one GPU): this rank, the byte offset from a symmetric
    # buffer to each peer's copy of it, and this rank's f32 partials of the residual stream ([layer][rank][H])
    ("long long", "rank"), ("const long long*", "peer_delta"), ("float*", "h_parts"), ("float*", "mid_parts"),
    # the peers' partials of the residual stream as flagged words (tag << 32 | f32 bits)
    ("unsigned long long*", "h_relay"), ("unsigned long long*", "mid_relay"),
    ("unsigned*", "attn_done"),          # attention splits finished per (layer, kv head)
    ("long long", "prompt_len"), ("long long", "start_pos"), ("long long", "num_steps"), ("long long", "max_new"),
    ("long long", "num_eos"), ("double", "temperature"), ("double", "top_p"), ("unsigned long long", "seed"),
)
# the serving kernel's (the SERVE section) after them: the protocol's host region (pinned and mapped into the
# device's address space) and device region, the scheduler's workspace (mdsl.serving.scheduler), and the step's
# work (ServingPlan.region)
SERVE_PARAMS = (("char*", "host"), ("char*", "device_state"), ("char*", "workspace"), ("char*", "serve"))


# The runtime's optional sections: the lines between `#if MK_<NAME>` and `#else` (or `#endif`) are the kernel's
# where a task body needs the section (cuda_bodies.runtime_sections), those between `#else` and `#endif`
# where none does; the directives themselves never reach the source, so the kernel of a decoder that needs
# no section is the runtime's text without them, byte for byte (the golden digests of Llama-3's and Qwen3's).
SECTIONS = {
    "QKV_BIAS": "LayerWeights' pointers to the q, k and v projections' biases (Qwen2)",
    "WINDOW": "attention over the last LAYER_WINDOW[layer] positions only where that is not 0 (sliding windows "
              "shorter than the KV cache, per layer)",
    "MOE": "a mixture of experts' layers: LayerWeights' router, expert table and routing buffers, moe.cuh",
    "SOFTCAP": "attention's scores soft-capped to SOFTCAP * tanh(score / SOFTCAP), rounded as eager attention rounds "
               "them (Gemma-2)",
    "NORM_1P": "the input rows normalised by 1 + the norm weight (a fused norm's unit_offset: Gemma's RMSNorm)",
    "LM_HEAD_1P": "the LM head's row normalised by 1 + the final norm's weight",
    "ROW_NORM": "an o-proj's or down-proj's output row normalised, by its last tile, before its residual add "
                "(linear_norm_residual: Gemma-2's post-norms), and LayerWeights' pointers to those norms",
    "EMBED_SCALE": "the sampler's next embedding row times EMBED_SCALE (Gemma's embeddings)",
    "SERVE": "the serving tables' kernel (serving_source.py): SCHEDULE and the bodies over a step's rows (serve.cuh, "
             "serve_rows.cuh, serve_tensor.cuh, serve_attention.cuh, serve_sampling.cuh), the protocol's regions in "
             "Params (SERVE_PARAMS)",
}
_DIRECTIVE = re.compile(r"#(if|else|endif)\b")
_SECTION = re.compile(r"#if MK_(\w+)\n")

BODIES_MARKER = "// task bodies: generated by kernel_source.py (cuda_bodies.py)\n"
_PARAMS_MARKER = "// struct Params: generated by kernel_source.py from PARAMS (the host fills the same fields)\n"
_INCLUDE = re.compile(r'^#include "([a-z_]+\.cuh)"\n', re.MULTILINE)


def _resolve_sections(text: str, sections: frozenset) -> str:
    """The text with each optional section's lines kept or dropped (SECTIONS) and its directives removed."""
    out, section, keep = [], None, True
    for line in text.splitlines(keepends=True):
        directive = _DIRECTIVE.match(line)
        if directive is None:
            if keep:
                out.append(line)
            continue
        opening = _SECTION.fullmatch(line)
        if directive.group(1) == "if":
            assert section is None and opening is not None and opening.group(1) in SECTIONS, line
            section = opening.group(1)
            keep = section in sections
        else:
            assert section is not None, line
            keep = directive.group(1) == "endif" or section not in sections
            section = None if directive.group(1) == "endif" else section
    assert section is None, f"section {section} is not closed"
    return "".join(out)


@cache
def runtime_source(sections: frozenset = frozenset()) -> str:
    """device.cu with its headers expanded in place, its optional sections resolved (SECTIONS: `sections`
    kept, the others dropped) and the Params struct written from PARAMS (and SERVE_PARAMS in the SERVE
    section's kernel; the task bodies' place still marked by BODIES_MARKER)."""
    unknown = sorted(set(sections) - set(SECTIONS))
    assert not unknown, f"no runtime sections {unknown}"
    text = _INCLUDE.sub(lambda m: (_RUNTIME / m.group(1)).read_text(), (_RUNTIME / "device.cu").read_text())
    text = _resolve_sections(text, frozenset(sections))
    params = PARAMS + (SERVE_PARAMS if "SERVE" in sections else ())
    fields = "\n".join(f"  {ctype} {name};" for ctype, name in params)
    struct = (f"{_PARAMS_MARKER}struct Params {{\n{fields}\n}};\n"
              f"static_assert(sizeof(Params) == {8 * len(params)}, \"every Params field is 8 bytes\");\n")
    assert text.count(BODIES_MARKER) == 1 and text.count(_PARAMS_MARKER) == 1 and not _INCLUDE.search(text)
    return text.replace(_PARAMS_MARKER, struct)


class KernelOptionError(ValueError):
    """An option of generate_source that this plan rules out (a buffer that does not fit); `option` names it,
    so that a caller can say how to fix it."""

    def __init__(self, message: str, option: str):
        super().__init__(message)
        self.option = option


def linear_row_floats(plan: TaskPlan) -> int:
    """The widest linear input row (f32): where a linear task's residual columns start (RESIDUAL_OFFSET); with a
    mixture of experts, an expert down-projection's slots' rows and their weighted products (moe.cuh)."""
    s = plan.shape
    return max(s.hidden, s.intermediate, s.attention_width, expert_down_floats(plan))


MOE_KINDS = (Kind.ROUTER, Kind.EXPERT_UP, Kind.EXPERT_DOWN)


def expert_down_floats(plan: TaskPlan) -> int:
    """The shared floats of the widest EXPERT_DOWN task (moe.cuh's expert_down_task): every slot's activation row,
    then each slot's weighted product of the task's rows; 0 without a mixture of experts."""
    s = plan.shape
    rows = max((t.end - t.begin for t in plan.tasks if t.kind is Kind.EXPERT_DOWN), default=None)
    return 0 if rows is None else s.experts_per_token * (s.expert_intermediate + rows)


def _moe_constants(plan: TaskPlan) -> dict:
    """The MOE section's constants: the experts, how many a token takes, their hidden width, whether their weights
    are renormalised, the router's tiles per layer, and the kinds' numbers."""
    s = plan.shape
    layer = next(t.layer for t in plan.tasks if t.kind is Kind.ROUTER)
    return {"MOE_E": s.experts, "MOE_K": s.experts_per_token, "MOE_I": s.expert_intermediate,
            "MOE_NORM_TOPK": int(s.config.norm_topk_prob),
            "MOE_ROUTER_TILES": sum(t.kind is Kind.ROUTER and t.layer == layer for t in plan.tasks),
            **{f"KIND_{kind.name}": int(kind) for kind in MOE_KINDS}}


def shared_memory_bytes(plan: TaskPlan, attention_preload: bool = False, stream_stages: int = 0) -> int:
    """The largest task's shared memory: a linear's input row and its tile's residual, an attention
    task's q heads, new k and v, per-warp scratch, scores, statistics and per-warp sums (then, with
    `attention_preload`, its split's cached key and value rows, or with `stream_stages` the ring its rows
    stream through: device.cu's ATTN_PRELOAD_OFFSET), or the merge's halves of a head; plus the block
    reductions' scratch."""
    s = plan.shape
    linear = linear_row_floats(plan) + residual_columns(plan)
    attention = attention_preload_offset(plan) // 4 if attention_preload or stream_stages else attention_floats(plan)
    if attention_preload:
        attention += 2 * plan.max_chunk * s.head_dim * s.dtype.itemsize // 4
    elif stream_stages:
        attention += stream_stages * stream_round(plan) * s.head_dim * s.dtype.itemsize // 4
    return 4 * (2 * WARPS + max(linear, attention, s.head_dim))


# Attention's streamed rows (device.cu's ATTN_STREAM, where a split's rows are not preloaded): with S ring stages,
# S - 1 rounds of rows are in flight while one is read. An SM's share of the copy bandwidth (4.25 TB/s over 132
# SMs, 32 bytes a nanosecond) over a DRAM round trip under load (about 2 us) is 64 KB: the stages in flight
# hold that much, where it fits.
STREAM_BYTES = 64 * 1024


# Cached positions a score lane takes a round (device.cu's ROUND_SPANS): a round's positions are a ring stage's rows,
# and each round costs a block barrier and a stage's wait.
ROUND_SPANS = 1


def stream_round(plan: TaskPlan) -> int:
    """Cached positions a round of attention's scores covers (device.cu's ROUND): a ring stage's rows."""
    return ROUND_SPANS * THREADS // attention_lanes(plan)


def stream_stages(plan: TaskPlan, early_bytes: int) -> int:
    """The ring stages an attention split's rows stream through where they are not preloaded: enough for
    STREAM_BYTES in flight, or as many (2 at least) as fit beside the rest; 0 (rows read where they lie) where
    not even 2 fit."""
    stage_bytes = stream_round(plan) * plan.shape.head_dim * plan.shape.dtype.itemsize
    for stages in range(1 + -(-STREAM_BYTES // stage_bytes), 1, -1):
        if shared_memory_bytes(plan, False, stages) + early_bytes <= SMEM_PER_BLOCK - STATIC_SMEM_RESERVE:
            return stages
    return 0


# Attention's score lanes: 4 lanes share a cached position's key row, each with its share of the row's 16-byte
# vectors in flight at once, their sums met by shuffles (fewer where a key row has fewer vectors).
ATTENTION_LANES = 4
# Attention's q heads in shared memory: each score lane's span of a head's dimensions (D / ATTN_LANES) is
# followed by Q_PAD unused floats, so that the lanes sharing a cached position read different banks (unpadded,
# the lanes' spans lie 32 floats apart, on the same banks: every q read a 4-way conflict, which bounds the
# scores). A head takes D + 32 floats: the lanes' padding, and for D a multiple of 32 every head starts on a
# 128-byte line.
Q_PAD = 4
Q_HEAD_GAP = 32


def q_stride(plan: TaskPlan) -> int:
    """Floats between two q heads in attention's shared memory (device.cu's Q_STRIDE)."""
    return plan.shape.head_dim + Q_HEAD_GAP


def attention_floats(plan: TaskPlan) -> int:
    """An attention task's shared floats besides its preloaded rows: its q heads, new k and v, per-warp
    scratch, scores, statistics and per-warp sums (device.cu's attention_task lays them out in this order)."""
    s = plan.shape
    return (s.group * q_stride(plan) + 2 * s.head_dim + WARPS * s.head_dim + s.group * plan.max_chunk + 2 * s.group
            + WARPS * s.group * s.head_dim)


def attention_preload_offset(plan: TaskPlan) -> int:
    """Where an attention task's preloaded key and value rows start, in bytes (16-byte aligned, after
    attention_floats): device.cu's ATTN_PRELOAD_OFFSET."""
    return _round_up(4 * attention_floats(plan), 16)


def attention_lanes(plan: TaskPlan) -> int:
    """The lanes per cached position in attention's scores: ATTENTION_LANES, or fewer where a key row has fewer
    16-byte vectors than that (each lane takes an equal share)."""
    vectors = plan.shape.head_dim * plan.shape.dtype.itemsize // 16
    lanes = ATTENTION_LANES
    while vectors % lanes:
        lanes //= 2
    return lanes


# Hopper's shared memory per block (opt-in); the kernel's static shared memory (task slots) is kept out of
# what the dynamic part may use
SMEM_PER_BLOCK = 232448
STATIC_SMEM_RESERVE = 512
_EARLY_ALIGN = 128
# An early task's second pass of weight loads (MegakernelOptions.second_pass_kinds): every compute thread's
# LOADS 16-byte chunks (device.cu: NT threads x 16 loads x 16 bytes)
EARLY_BUFFER_BYTES = 256 * 16 * 16
WEIGHT_KINDS = (Kind.QKV, Kind.OPROJ, Kind.GATEUP, Kind.DOWN, Kind.LMHEAD)   # the kinds that read weight rows
_KIND_OF_NAME = dict(zip(WEIGHT_KIND_NAMES, WEIGHT_KINDS))


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@attrs.frozen
class MegakernelSource:
    text: str
    smem_bytes: int      # dynamic shared memory per worker block


def _float_literal(x: float) -> str:
    return f"{float(x)!r}f"


def generate_source(plan: TaskPlan, options: MegakernelOptions = MegakernelOptions(),
                    stream: bool = True) -> MegakernelSource:
    """The kernel for `plan` under `options` (their defaults for the plan's world size: for_world). Its
    attention rows are preloaded (ATTN_PRELOAD) as `options.attention_preload` says, or with None where they
    fit in shared memory beside the rest (a long max_seq's split may not); rows not preloaded stream through a
    ring in shared memory (ATTN_STREAM: stream_stages), or with `stream` False are read where they lie (the
    engine's fallback where the ring's code spills a kernel at its register cap); a linear task's first pass of weight
    loads issued with its input row in eighths of `weights_first` (the registers of both at once: the whole
    pass fits the largest kernels at the 168 registers of a 320-thread block, with none to spare); an early
    task of `second_pass_kinds` copies its second pass into the early buffer (EARLY_BUFFER_BYTES beside the
    rest, no registers); with `rank_sums` the o-proj and down-proj tiles sum their products as that many
    ranks do (bodies.write_linear_body). KernelOptionError where preloaded rows asked for do not fit."""
    options = options.for_world(plan.world)
    layout = kernel_layout(plan, options, stream)
    runtime = runtime_source(runtime_sections(plan)).replace(BODIES_MARKER, generate_bodies(plan, options.rank_sums))
    text = "\n".join([INCLUDES, PRELUDE, *model_lines(plan, options, layout), runtime])
    return MegakernelSource(text, layout.smem_bytes)


@attrs.frozen
class KernelLayout:
    """What generate_source derives from a plan and its options before writing the kernel: the share of the
    first pass with the input row (eighths), the kinds with a second pass and the early buffer's bytes, whether
    attention's rows are preloaded or stream through `stages` ring stages, the tasks' shared memory (`base`) and
    the early buffer's offset."""

    eighths: int
    two_pass: frozenset
    early_bytes: int
    preload: bool
    stages: int
    base: int
    sums_row: int
    early_offset: int

    @property
    def smem_bytes(self) -> int:
        return self.early_offset + self.early_bytes if self.early_bytes else self.base + self.sums_row


def kernel_layout(plan: TaskPlan, options: MegakernelOptions, stream: bool = True) -> KernelLayout:
    """generate_source's choices for `plan` under `options` (already for_world), checked."""
    s = plan.shape
    if s.dtype not in _CUDA_TYPES:
        raise ValueError(f"the megakernel's element types are bf16 and f32, not {s.dtype}")
    if not 1 <= plan.splits <= MAX_SPLITS:
        raise ValueError(f"the megakernel merges 1 to {MAX_SPLITS} attention splits per kv head, not {plan.splits}")
    if s.head_dim > THREADS:
        raise UnsupportedError(f"the megakernel merges a head's {s.head_dim} values one a compute thread, of which "
                               f"it has {THREADS}",
                               hint="run the model with the CPU simulator (mdsl.megakernel.taskgraph.simulator)")
    eighths = 0 if options.weights_first == 0 else max(1, round(options.weights_first * 8))   # of the pass's loads
    two_pass = frozenset(_KIND_OF_NAME[name] for name in options.second_pass_kinds)
    early_bytes = EARLY_BUFFER_BYTES if two_pass else 0
    sums_row = 4 * residual_columns(plan) if options.rank_sums > 1 else 0   # running sums' floats, after the residual
    preload = options.attention_preload
    if preload is None:   # where the split's rows fit beside the rest
        preload = shared_memory_bytes(plan, True) + early_bytes <= SMEM_PER_BLOCK - STATIC_SMEM_RESERVE
    stages = 0 if preload or not stream else stream_stages(plan, early_bytes)
    base = shared_memory_bytes(plan, preload, stages)
    if base + early_bytes > SMEM_PER_BLOCK - STATIC_SMEM_RESERVE:
        raise KernelOptionError(f"attention_preload's key and value rows ({2 * plan.max_chunk} rows of a split at "
                                f"max_seq {plan.max_seq}) do not fit in shared memory beside the rest",
                                "attention_preload")
    return KernelLayout(eighths, two_pass, early_bytes, preload, stages, base, sums_row,
                        _round_up(base + sums_row, _EARLY_ALIGN))


def model_lines(plan: TaskPlan, options: MegakernelOptions, layout: KernelLayout, tasks: Optional[tuple] = None,
                extra: tuple = ()) -> list:
    """The kernel's constants (namespace mk): the model's, the plan's and the layout's; `tasks`: the task table
    the kernel runs where it is not the plan's own (the serving tables: TASKS and LM_FIRST are theirs); `extra`
    lines close the namespace's constants."""
    s = plan.shape
    tasks = plan.tasks if tasks is None else tasks
    lm_first = next(k for k, t in enumerate(tasks) if t.kind is Kind.LMHEAD)
    constants = {
        "H": s.hidden, "I": s.intermediate, "HQ": s.heads, "HKV": s.kv_heads, "D": s.head_dim, "V": s.vocab,
        "L": s.layers, "QKV": s.qkv_rows, "SPLITS": plan.splits, "MAX_SEQ": plan.max_seq,
        "MAX_CHUNK": plan.max_chunk, "MIN_CHUNK": plan.min_chunk, "TASKS": len(tasks), "LM_FIRST": lm_first,
        "LM_TILES": plan.lm_tiles, "WORLD": plan.world, "RESIDUAL_OFFSET": linear_row_floats(plan),
        "RESIDUAL_COLUMNS": max(residual_columns(plan), 1),
        **{f"KIND_{kind.name}": int(kind) for kind in Kind if kind not in MOE_KINDS + SERVING_KINDS},
    }
    sections = runtime_sections(plan)
    attention = dict(plan.op_of(Kind.ATTN).attrs)
    scale = attention.get("scale") or s.head_dim ** -0.5   # (scaled_attention's own scale, else 1/sqrt(head_dim))
    section_constants = []
    if "WINDOW" in sections:   # (constant memory: a task's layer is the same on every lane, a broadcast read)
        section_constants.append(f"__constant__ int LAYER_WINDOW[L] = {{{', '.join(map(str, plan.windows))}}};")
    if "SOFTCAP" in sections:
        cap = attention["softcap"]
        section_constants += [f"constexpr float SOFTCAP = {_float_literal(cap)};",
                              f"constexpr float SOFTCAP_INVERSE = {_float_literal(np.float32(1.0) / np.float32(cap))};"]
    if "EMBED_SCALE" in sections:   # (transformers' normalizer: sqrt(hidden) as a tensor of the model's dtype)
        factor = round_to_dtype(np.array([plan.embedding_scale], np.float32), s.dtype)[0]
        section_constants.append(f"constexpr float EMBED_SCALE = {_float_literal(factor)};")
    if "MOE" in sections:
        constants.update(_moe_constants(plan))
    lines = [f"// the model: {s}", "namespace mk {", f"using T = {_CUDA_TYPES[s.dtype]};"]
    lines += [f"constexpr int {name} = {value};" for name, value in constants.items()]
    lines += [f"constexpr int ATTN_LANES = {attention_lanes(plan)};",
              f"constexpr int ROUND_SPANS = {ROUND_SPANS};   // cached positions a score lane takes a round",
              f"constexpr int Q_STRIDE = {q_stride(plan)};   // floats between attention's q heads",
              f"constexpr int Q_PAD = {Q_PAD};",
              f"constexpr int WEIGHTS_FIRST_EIGHTHS = {layout.eighths};",
              "constexpr bool WEIGHTS_FIRST = WEIGHTS_FIRST_EIGHTHS > 0;",
              f"constexpr bool ATTN_PRELOAD = {'true' if layout.preload else 'false'};",
              f"constexpr int ATTN_STREAM = {layout.stages};   // ring stages of attention's streamed rows (0: none)",
              f"constexpr int ATTN_PRELOAD_OFFSET = {attention_preload_offset(plan)};   // bytes from a task's memory",
              f"constexpr int EARLY_PASSES = {2 if layout.early_bytes else 1};",
              f"constexpr int EARLY_PASS_KINDS = {sum(1 << int(k) for k in layout.two_pass)};",
              f"constexpr int EARLY_OFFSET = {layout.early_offset};   // the early buffer (EARLY_PASSES > 1)",
              f"constexpr int EARLY_BYTES = {layout.early_bytes};",
              f"constexpr float EPS = {_float_literal(s.eps)};",
              f"constexpr float SCALE = {_float_literal(scale)};", *section_constants, *extra, "}  // namespace mk"]
    return lines

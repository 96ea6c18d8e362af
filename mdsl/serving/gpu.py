"""The GPU serving device (`LLM(..., device="gpu")`): the CPU device's scheduler on the host, each step's
forward on the GPU.

The scheduler (cancel, plan, pages, admit, sample, stream, retire) is the CPU device's, unchanged: it
runs in the device thread over the same device-region views, so admission, paging and preemption are
those the CI tests prove. What moves to the GPU is the step's forward and the KV pool: the weights (in
the checkpoint's dtype), the page pools ([pages, page_size, kv heads, head dim] per cache, in the
checkpoint's dtype: the values the CPU device's float32 pools hold) and the float32 activations live in
device memory, and every layer op of the step function runs as kernels over all the step's token rows
(mdsl/serving/step_kernels.cu), by its rule in `GPU_STEP_RULES` (one rule per op, the GPU twin of
mdsl.serving.steprules.STEP_RULES). Linear layers with 16-bit weights run on tensor cores (wgmma and TMA on
a Hopper GPU: mdsl.serving.gpu_wgmma; mma.sync elsewhere), and attention over 16-bit pools too
(attention_mma.cuh: tiles of a chunk's rows, mma.sync); the others run on the CUDA cores. A step uploads its
rows (token, position, entry) and the page tables, runs the program, and reads back the logits of the rows
that sample; a step of a shape (rows, rows that sample) seen before replays the program as a CUDA graph.

Every kernel keeps a row's reductions in an order fixed by the row alone (step_kernels.cu says how), so a
request's logits are bit-identical whatever else shares its steps and however its prompt is chunked.

The scheduler runs on the host, so each step costs a host round trip; the megakernel's in-kernel
scheduler over the same protocol (docs/design.md, "Serving") removes it.
"""
from __future__ import annotations

import ctypes
import functools
import gc
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Optional

import attrs
import numpy as np

from mdsl.errors import UnsupportedError
from mdsl.ir.dtypes import bf16, f16, f32, i32
from mdsl.ir.rules import RuleTable
from mdsl.lowering.options import arch_number
from mdsl.megakernel.modelgraph.layers import LAYER_OPS, attention_options, rope_cos_sin
from mdsl.megakernel.modelgraph.model import TOKENS
from mdsl.serving.cpu import CpuDevice, narrowing, serving_nodes
from mdsl.serving.gpu_launch import dependent_launch, launch_kernel
from mdsl.serving.gpu_wgmma import NORMED_ROWS, row_tile
from mdsl.serving.protocol import kv_pool_shape
from mdsl.serving.sampling import NoMaximum

SOURCE = Path(__file__).with_name("step_kernels.cu")
ATTENTION_MMA_SOURCE = Path(__file__).with_name("attention_mma.cuh")   # (appended to SOURCE)
ACTIVATIONS_SOURCE = Path(__file__).with_name("activations.cuh")      # (prepended; gpu_wgmma's module has it too)
DEPENDENT_LAUNCH_SOURCE = Path(__file__).with_name("dependent_launch.cuh")   # (prepended, as in gpu_wgmma's)
ROW_NORMS_SOURCE = Path(__file__).with_name("row_norms.cuh")   # (prepended, as in gpu_wgmma's)
THREADS = 256                    # threads of a row-wise kernel's block
NORM_THREADS = 1024              # rms_norm's block (one a row)
NORM_TILE = 128                  # row_norms.cuh's TILE: the columns of a row's sum of squares (norm_squares)
ATTENTION_THREADS = 128          # step_kernels.cu's ATT_THREADS
MAX_DIM = 256                    # step_kernels.cu's attention kernels: head dim (a multiple of 4) ...
GROUPS = {1: (1, 2, 4, 8, 16), 2: (1, 2, 4)}   # ... and query heads per KV head, by float4s a lane (DV)
MMA_DIM = 128                    # attention_mma.cuh: head dims (a multiple of 8) up to AMMA_DIM ...
MMA_GROUPS = (1, 2, 4, 8, 16)    # ... query heads per KV head (dividing its 64 M rows) ...
MMA_ROWS = 64                    # ... the (row, query head) pairs of a tile (AMMA_ROWS) ...
MMA_SMEM = 102400                # ... its shared memory (AMMA_SMEM; a solo tile's kernel AMMA_SOLO_SMEM) ...
MMA_SOLO_SMEM = 98304
MMA_SPLIT_KEYS = 128             # ... a split's keys where the range allows (AMMA_SPLIT_KEYS) ...
MMA_UNIT = 64                    # ... the most splits of an item (AMMA_UNIT) ...
MMA_TILE_WARPS = 4               # ... and its warps (AMMA_WARPS)
SPLIT_KEYS = 64                  # attention: a split's keys where the range allows (step_kernels.cu's ATT_SPLIT_KEYS)
MAX_SPLITS = 64                  # ... and the most splits of a row's range (its ATT_MAX_SPLITS, which says why 64)
HEADS_PER_BLOCK = 8              # head_rms_norm, head_norm_rope: one warp a head (NORM_ROPE_WARPS)
LINEAR_WARPS = 8                 # linear: one warp an output column at a time
MMA_WARPS = 8                    # linear_mma: a block's warps, each a slice of k
_SUFFIX = {f32: "f32", bf16: "bf16", f16: "f16"}

_log = logging.getLogger(__name__)


@attrs.frozen
class Operand:
    """A value of the step on the device: its pointer, its shape ([rows, width] for activations, the
    weight's own shape for weights) and dtype."""

    ptr: int
    shape: tuple
    dtype: object
    name: str = ""

    @property
    def width(self) -> int:
        return int(self.shape[-1])


@attrs.frozen(eq=False)
class GpuBatch:
    """What a rule knows of the step besides its operands: its row count, the device arrays of each row's
    token, position and entry, the page table, and the device running it."""

    rows: int
    tokens: int
    positions: int
    entries: int
    page_table: int
    device: "GpuDevice"


#: layer op -> rule(operands, results, attrs, GpuBatch): launches the op's kernel(s) over the batch's rows,
#: writing the results' device buffers
GPU_STEP_RULES: RuleTable[Callable] = RuleTable("GPU serving device", Callable, "mdsl.serving.gpu (GPU_STEP_RULES)",
                                                registry=LAYER_OPS)


def _weighted(name: str, weight: Operand) -> str:
    suffix = _SUFFIX.get(weight.dtype)
    if suffix is None:
        raise UnsupportedError(f"the GPU serving device has no {name} kernel for {weight.dtype} weights",
                               hint="serve a float32, bfloat16 or float16 checkpoint")
    return f"{name}_{suffix}"


def _spread(rows: int, width: int) -> tuple:
    """The grid of a row-wise element-wise kernel: (rows, blocks a row), a thread two elements or fewer."""
    return rows, max(1, -(-width // (2 * THREADS)))


def act_mul_grid(rows: int, half: int) -> tuple:
    """act_mul's grid for rows of `half` outputs: four elements a thread where half is a multiple of 4 (its
    16-byte vectors; rows on 16 bytes), else _spread's."""
    return (rows, max(1, -(-half // (4 * THREADS)))) if half % 4 == 0 else _spread(rows, half)


def _ints(*values) -> list:
    return [ctypes.c_int(int(v)) for v in values]


def _embedding(xs, outs, a, b):
    tokens, table = xs
    b.device.launch(_weighted("embedding", table), _spread(b.rows, table.width), THREADS,
                    [_p(outs[0]), ctypes.c_void_p(b.tokens), _p(table), *_ints(table.width)])


def _rms_norm(xs, outs, a, b, one_plus: int = 0):
    """(With `hand` in a: the rows rounded for the linear after it, which loads them by TMA, instead;
    handed_rows. With `squares`: the row's mean square from the sums of squares beside x, and below
    NORMED_ROWS rows no launch: that linear normalises the rows itself; norm_squares.)"""
    x, w = xs
    dev = b.device
    squares = dev.squares_of(a["squares"]) if a.get("squares") else None
    if squares is not None and row_tile(b.rows) < NORMED_ROWS:
        dev.wgmma.normalise(outs[0].ptr, x.ptr, squares, w.ptr, a["eps"], one_plus)
        return
    rounded = dev.wgmma.hand(outs[0].ptr) if a.get("hand") else None
    dev.launch(_weighted("rms_norm", w), (b.rows,), NORM_THREADS,
               [_p(outs[0]), _p(x), _p(w), *_ints(x.width), ctypes.c_float(a["eps"]), *_ints(one_plus),
                ctypes.c_void_p(rounded), ctypes.c_void_p(squares)])


def tensor_core_dtype(k: int, weights) -> Optional[object]:
    """The 16-bit dtype of a linear whose weights all share one and whose input width k is a multiple of
    32: it runs on tensor cores (step_kernels.cu's linear_mma); None: on the CUDA cores."""
    dtypes = {w.dtype for w in weights}
    if len(dtypes) == 1 and k % 32 == 0 and next(iter(dtypes)) in (bf16, f16):
        return next(iter(dtypes))
    return None


def mma_splits(tiles: int, k: int, sms: int) -> int:
    """The blocks over which a tensor-core linear of `tiles` 16-column tiles splits k: enough for two
    blocks an SM, each warp of a block keeping at least one 32-k chunk; by the weights alone, never the rows."""
    return max(1, min(8, -(-2 * sms // tiles), k // 32 // MMA_WARPS))


MAX_PARTS = 4                    # step_kernels.cu's: weights side by side in one linear launch


class _Parts(ctypes.Structure):   # step_kernels.cu's serve::Parts
    _fields_ = [("w", ctypes.c_void_p * MAX_PARTS), ("start", ctypes.c_int * (MAX_PARTS + 1)), ("count", ctypes.c_int)]


class _TileStarts(ctypes.Structure):   # step_kernels.cu's serve::TileStarts
    _fields_ = [("start", ctypes.c_int * (MAX_PARTS + 1))]


def _starts(sizes: list) -> list:
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out + [out[-1]] * (MAX_PARTS + 1 - len(out))


def linear_launches(k: int, weights: list) -> list:
    """The launches of a linear over `weights` side by side: (weights, tensor-core dtype or None, 16-column
    tiles), up to MAX_PARTS weights of one dtype each."""
    launches, i = [], 0
    while i < len(weights):
        group = [weights[i]]
        while i + len(group) < len(weights) and len(group) < MAX_PARTS and \
                weights[i + len(group)].dtype is weights[i].dtype:
            group.append(weights[i + len(group)])
        i += len(group)
        launches.append((group, tensor_core_dtype(k, group), sum(-(-int(w.shape[0]) // 16) for w in group)))
    return launches


def _linear(xs, outs, a, b, residual: Optional[Operand] = None):
    x, *ws = xs
    dev, offset = b.device, 0
    squares = dev.squares_of(a["squares"]) if a.get("squares") else None   # (norm_squares: one wgmma launch)
    res = ctypes.c_void_p(residual.ptr if residual is not None else None)
    for group, mma, tiles in linear_launches(x.width, ws):
        sizes = [int(w.shape[0]) for w in group]
        parts = _Parts((ctypes.c_void_p * MAX_PARTS)(*[w.ptr for w in group]),
                       (ctypes.c_int * (MAX_PARTS + 1))(*_starts(sizes)), len(group))
        if mma is not None and dev.wgmma is not None:
            dev.wgmma.launch(outs[0], x, group, residual, b.rows, offset, squares=squares)
        elif mma is not None:
            starts = _TileStarts((ctypes.c_int * (MAX_PARTS + 1))(*_starts([-(-n // 16) for n in sizes])))
            dev.launch(_weighted("linear_mma", group[0]), (tiles, mma_splits(tiles, x.width, dev.sms)), MMA_WARPS * 32,
                       [_p(outs[0]), ctypes.c_void_p(dev.partials), ctypes.c_void_p(dev.linear_arrivals), _p(x), parts,
                        starts, res, *_ints(b.rows, x.width, outs[0].width, offset)])
        else:
            blocks = max(1, min(-(-sum(sizes) // LINEAR_WARPS), 4 * dev.sms))
            dev.launch(_weighted("linear", group[0]), (blocks,), LINEAR_WARPS * 32,
                       [_p(outs[0]), _p(x), parts, res, *_ints(b.rows, x.width, outs[0].width, offset)])
        offset += sum(sizes)


def _linear_add(xs, outs, a, b):
    """A linear and the add right after it that alone reads its result: the add's other operand (last of
    xs) is the linear's residual."""
    _linear(xs[:-1], outs, a, b, residual=xs[-1])


def lower_program(nodes: list, narrow_at: int, logits: str, gates: bool = False) -> list:
    """The step's program: per node, (rule, attributes, operand names, result names, op); a linear and the
    add after it, and a head norm and the rope after it, run as one (residual_adds, fusible_pairs; the
    second node's entry is None), and with `gates` (a Hopper GPU's wgmma linears) a gate|up linear and the
    act_mul or geglu after it (gated_linears), and the norm whose rows such a linear takes from the rows'
    sums of squares that the wgmma linear+add before it writes (norm_squares: both entries say `squares`, the
    rows' name); a rope appends the keys and values its attention reads (kv_appends: the attention's entry
    says `appended`)."""
    kept = {logits}
    fused = residual_adds(nodes, narrow_at, kept)
    norm_ropes = set(fusible_pairs(nodes, narrow_at, kept, "head_rms_norm", "rope"))
    gated = gated_linears(nodes, narrow_at, kept) if gates else {}
    handing = handed_rows(nodes, narrow_at, kept, gated) if gates else {}
    squares = norm_squares(nodes, narrow_at, fused, handing) if gates else {}
    summed = {j: nodes[i].inputs[0].name for i, j in squares.items()}   # (the linears that write the sums)
    appends = kv_appends(nodes, narrow_at, kept)
    appended = set(appends.values())
    program: list = []
    for i, n in enumerate(nodes):
        names, results = [v.name for v in n.inputs], [v.name for v in n.outputs]
        # the entry of a rope that appends the keys and values (its own, or its head norm's with it) reads the
        # attention's pools too
        rope = i + 1 if i in norm_ropes else i if i - 1 not in norm_ropes else None
        if rope in appends:
            names += [v.name for v in nodes[appends[rope]].inputs[1:3]]
        after = [v.name for v in nodes[i + 1].outputs] if i + 1 < len(nodes) else []
        if i in fused:
            program.append((_linear_add, dict(n.attr_dict, **({"squares": summed[i]} if i in summed else {})),
                            names + [fused[i]], after, "linear+add"))
        elif i in gated:
            program.append((_gated_linear, {"act": gated[i], "hand": handing.get(i)}, names, after,
                            f"linear+{nodes[i + 1].op}"))
        elif i in handing or i in appended:
            attrs = dict(n.attr_dict, **({"hand": handing[i]} if i in handing else {}),
                         **({"squares": names[0]} if i in squares else {}),
                         **({"appended": True} if i in appended else {}))
            program.append((GPU_STEP_RULES[n.op], attrs, names, results, n.op))
        elif i in norm_ropes:
            program.append((_head_norm_rope, (n.attr_dict, nodes[i + 1].attr_dict), names, after,
                            "head_rms_norm+rope"))
        elif i - 1 in fused or i - 1 in norm_ropes or i - 1 in gated:
            program.append(None)
        else:
            program.append((GPU_STEP_RULES[n.op], n.attr_dict, names, results, n.op))
    return program


def step_slots(graph, gates: bool = False) -> tuple:
    """(program, narrowing index, the values gathered at it, value name -> slot, each slot's width) of the
    GPU device's steps over `graph` (lower_program, activation_slots; `gates`: lower_program's)."""
    nodes, caches = serving_nodes(graph)
    narrow_at = narrowing(nodes, caches)
    program = lower_program(nodes, narrow_at, graph.logits.name, gates)
    narrowed = {v.name for n in nodes[narrow_at:] for v in n.inputs} & \
        {v.name for n in nodes[:narrow_at] for v in n.outputs}
    widths = {v.name: int(v.shape[-1]) for n in nodes for v in n.outputs}
    return (program, narrow_at, narrowed, *activation_slots(program, narrow_at, narrowed, {graph.logits.name}, widths))


def activation_slots(program: list, narrow_at: int, narrowed: set, kept: set, widths: dict) -> tuple:
    """The step's activation buffers by liveness: (value name -> slot, each slot's width) for the values the
    entries of `program` write (lower_program's: (rule, attributes, names read, names written, op), None
    for an op run by the entry before it), `widths` each value's. A value is live from the entry that writes
    it to the last that reads it (the gather at `narrow_at` for the `narrowed` ones, the step's end for the
    `kept` ones, read by the host); an entry's results take slots of their width that no live value holds,
    and a value read at an entry is live through it, so no entry writes over what it reads. A model's layers
    then share a few buffers of each width instead of one a value (its depth times fewer bytes)."""
    last: dict = {}
    for i, entry in enumerate(program):
        if entry is not None:
            for name in entry[2]:
                last[name] = i
    for name in narrowed:
        last[name] = max(last.get(name, -1), narrow_at)
    for name in kept:
        last[name] = len(program)
    free: dict = {}          # width -> slots no live value holds
    live: dict = {}          # name -> slot
    slot_of: dict = {}
    slot_widths: list = []
    for i, entry in enumerate(program):
        if entry is None:
            continue
        for name in [n for n, k in live.items() if last.get(n, -1) < i]:
            free.setdefault(slot_widths[live[name]], []).append(live.pop(name))
        for name in entry[3]:
            width = widths[name]
            if free.get(width):
                slot = free[width].pop()
            else:
                slot = len(slot_widths)
                slot_widths.append(width)
            slot_of[name] = live[name] = slot
    return slot_of, slot_widths


def _readers(nodes: list) -> dict:
    """value name -> how many of the nodes' operands it is."""
    readers: dict = {}
    for n in nodes:
        for v in n.inputs:
            readers[v.name] = readers.get(v.name, 0) + 1
    return readers


def kv_appends(nodes: list, narrow_at: int, kept: set) -> dict:
    """rope node index -> the attention node index whose q|k|v rows only it writes and only that attention
    reads (nothing past the step does: `kept`), the two on one side of the narrowing: the rope's kernel (or
    the head norm's with it: fusible_pairs) appends the rows' keys and values to the attention's pools, which
    the attention's own KV append launch would write from those rows (step_kernels.cu's Append)."""
    readers = _readers(nodes)
    found = {}
    for i, n in enumerate(nodes):
        if n.op != "rope" or n.outputs[0].name in kept or readers.get(n.outputs[0].name) != 1:
            continue
        for j in range(i + 1, len(nodes)):
            m = nodes[j]
            if m.op in ("attention", "scaled_attention") and m.inputs[0].name == n.outputs[0].name and \
                    (i < narrow_at) == (j < narrow_at):
                found[i] = j
                break
    return found


def fusible_pairs(nodes: list, narrow_at: int, kept: set, producer: str, consumer: str) -> list:
    """The indices i where node i (op `producer`) and node i + 1 (op `consumer`) can run as one: the
    consumer alone reads the producer's result (once; nothing past the step does: `kept`) and the two lie
    on one side of the narrowing."""
    readers = _readers(nodes)
    return [i for i, (n, m) in enumerate(zip(nodes, nodes[1:]))
            if n.op == producer and m.op == consumer and i + 1 != narrow_at and n.outputs[0].name not in kept
            and readers.get(n.outputs[0].name) == 1 and [v.name for v in m.inputs].count(n.outputs[0].name) == 1]


def residual_adds(nodes: list, narrow_at: int, kept: set) -> dict:
    """linear node index -> the other operand's name of the add right after it, for each linear whose
    result only that add reads (fusible_pairs): the pair runs as one launch, the sum in the linear's
    epilogue (x + y in float32 either way round)."""
    fused = {}
    for i in fusible_pairs(nodes, narrow_at, kept, "linear", "add"):
        names = [v.name for v in nodes[i + 1].inputs]
        fused[i] = names[1 - names.index(nodes[i].outputs[0].name)]
    return fused


def gated_linears(nodes: list, narrow_at: int, kept: set) -> dict:
    """linear node index -> the activation code (step_kernels.cu's `activate`) of the act_mul or geglu right
    after it, for each linear of two 16-bit weights of one shape (gate, up) and an input width that is a
    multiple of 32 (a tensor-core linear: tensor_core_dtype) whose result only that op reads
    (fusible_pairs): the pair runs as one wgmma launch (linear_wgmma.cuh's gated form), so the gate|up
    values are never written and read back."""
    found = {}
    for i in fusible_pairs(nodes, narrow_at, kept, "linear", "act_mul") + \
            fusible_pairs(nodes, narrow_at, kept, "linear", "geglu"):
        n, m = nodes[i], nodes[i + 1]
        code = 1 if m.op == "geglu" else _ACTIVATIONS.get(m.attr_dict.get("act"))
        weights = n.inputs[1:]
        if code is None or len(weights) != 2 or tuple(weights[0].shape) != tuple(weights[1].shape) or \
                tensor_core_dtype(int(n.inputs[0].shape[-1]), weights) is None:
            continue
        found[i] = code
    return found


def _gated_linear(xs, outs, a, b):
    """A gate|up linear and the act_mul (or geglu) that alone reads it, as one launch (gated_linears)."""
    x, gate, up = xs
    b.device.wgmma.launch(outs[0], x, [gate, up], None, b.rows, 0, act=a["act"], hand=a["hand"] is not None)


def handed_rows(nodes: list, narrow_at: int, kept: set, gated: dict) -> dict:
    """node index -> the 16-bit dtype in which the next op, a linear on wgmma that alone reads the node's rows
    (its input rows, one launch: up to MAX_PARTS 16-bit weights of one dtype), takes them rounded: an
    rms_norm's (or rms_norm_1p's) right before it (the norm's weight of that dtype), an attention's (any pools:
    it rounds to the linear's dtype) and a gated linear's (`gated`: its products) two nodes before it. The
    producer writes them rounded to the weights' dtype into a buffer the linear loads by TMA at any row count
    (gpu_wgmma's `hand`): what the linear's own round_rows kernel would write from the float32 rows, or its
    producer warpgroup store in shared memory below 64 rows; those are then never written, nor read back."""
    def takes(linear, dtype) -> bool:
        weights = linear.inputs[1:]
        return (1 <= len(weights) <= MAX_PARTS and all(w.dtype is dtype for w in weights)
                and tensor_core_dtype(int(linear.inputs[0].shape[-1]), weights) is not None)

    found = {}
    for op in ("rms_norm", "rms_norm_1p"):
        for i in fusible_pairs(nodes, narrow_at, kept, op, "linear"):
            norm, linear = nodes[i], nodes[i + 1]
            if linear.inputs[0].name == norm.outputs[0].name and takes(linear, norm.inputs[1].dtype):
                found[i] = norm.inputs[1].dtype
    for op in ("attention", "scaled_attention"):
        for i in fusible_pairs(nodes, narrow_at, kept, op, "linear"):
            linear = nodes[i + 1]
            dtype = tensor_core_dtype(int(linear.inputs[0].shape[-1]), linear.inputs[1:])
            if linear.inputs[0].name == nodes[i].outputs[0].name and dtype is not None and takes(linear, dtype):
                found[i] = dtype
    for op in ("act_mul", "geglu"):
        for j in fusible_pairs(nodes, narrow_at, kept, op, "linear"):
            linear = nodes[j + 1]
            if j - 1 in gated and linear.inputs[0].name == nodes[j].outputs[0].name and \
                    takes(linear, nodes[j - 1].inputs[1].dtype):
                found[j - 1] = nodes[j - 1].inputs[1].dtype
    return found


def norm_squares(nodes: list, narrow_at: int, fused: dict, handing: dict) -> dict:
    """norm node index -> the linear node index whose residual sum (a linear and the add after it as one wgmma
    launch: `fused`, residual_adds) is the norm's input rows, for each rms_norm (or rms_norm_1p) that hands its
    rows to the wgmma linear after it (`handing`, handed_rows) where that linear's weights are one launch of
    16-bit weights and the rows' width a multiple of 128, the two on one side of the narrowing: the linear
    writes each row's sum of squares a 128-column tile beside the rows (row_norms.cuh), and the norm reads them
    instead of summing the row again. Below NORMED_ROWS rows the norm then launches nothing: the next linear's
    producer normalises the rows as it stages them (`_rms_norm`), the same bits as the norm's kernel writes at
    more rows."""
    producers = {nodes[j + 1].outputs[0].name: j for j in fused}
    found = {}
    for i in handing:
        norm = nodes[i]
        j = producers.get(norm.inputs[0].name) if norm.op in ("rms_norm", "rms_norm_1p") else None
        if j is None or (j < narrow_at) != (i < narrow_at):
            continue
        linear = nodes[j]
        weights = linear.inputs[1:]
        if len(weights) == 1 and tensor_core_dtype(int(linear.inputs[0].shape[-1]), weights) is not None and \
                int(weights[0].shape[0]) % NORM_TILE == 0:
            found[i] = j
    return found


def _append_args(pools: tuple, dtype, b) -> tuple:
    """(the KV append's kernel arguments, whether the kernel appends): the pools (kv_appends: the attention's,
    of the attention that alone reads the rows), where they hold `dtype` (the kernel's W), else null ones."""
    dev = b.device
    fused = bool(pools) and pools[0].dtype is dtype
    k_pool, v_pool = (_p(pools[0]), _p(pools[1])) if fused else (ctypes.c_void_p(None), ctypes.c_void_p(None))
    return [k_pool, v_pool, ctypes.c_void_p(b.entries), ctypes.c_void_p(b.page_table),
            *_ints(dev.shape.pages_per_request, dev.shape.page_size)], fused


def _kv_append(pools: tuple, qkv: Operand, a: dict, b) -> None:
    """Each row's key and value heads of `qkv` into its request's page at its position (attributes `a`: an
    attention's or rope's heads)."""
    k_pool, v_pool = pools
    hq, hkv, d = a["q_heads"], a["kv_heads"], a["head_dim"]
    b.device.launch(_weighted("kv_append", k_pool), _spread(b.rows, hkv * d), THREADS,
                    [_p(k_pool), _p(v_pool), _p(qkv), ctypes.c_void_p(b.positions), ctypes.c_void_p(b.entries),
                     ctypes.c_void_p(b.page_table), *_ints(b.device.shape.pages_per_request, b.device.shape.page_size,
                                                           hq, hkv, d)])


def _head_norm_rope(xs, outs, a, b):
    """head_rms_norm then rope (attributes a = (the norm's, the rope's)) as one kernel; with the pools of the
    attention after it (xs' last two: kv_appends) the KV append too."""
    (norm, rope), (x, wq, wk), pools = a, xs[:3], tuple(xs[3:])
    cos, sin = b.device.rope_tables(rope)
    heads = rope["q_heads"] + 2 * rope["kv_heads"]
    append, fused = _append_args(pools, wq.dtype, b)
    b.device.launch(_weighted("head_norm_rope", wq), (b.rows, -(-heads // HEADS_PER_BLOCK)), HEADS_PER_BLOCK * 32,
                    [_p(outs[0]), _p(x), _p(wq), _p(wk), ctypes.c_void_p(cos), ctypes.c_void_p(sin),
                     ctypes.c_void_p(b.positions), *_ints(rope["q_heads"], rope["kv_heads"], rope["head_dim"]),
                     ctypes.c_float(norm["eps"]), *append])
    if pools and not fused:
        _kv_append(pools, outs[0], rope, b)


def _add_bias(xs, outs, a, b):
    x = xs[0]
    bias = b.device.joined(xs[1:])
    b.device.launch(_weighted("add_bias", bias), _spread(b.rows, x.width), THREADS,
                    [_p(outs[0]), _p(x), _p(bias), *_ints(x.width)])


def _head_rms_norm(xs, outs, a, b):
    x, wq, wk = xs
    heads = a["q_heads"] + 2 * a["kv_heads"]
    b.device.launch(_weighted("head_rms_norm", wq), (b.rows, -(-heads // HEADS_PER_BLOCK)), HEADS_PER_BLOCK * 32,
                    [_p(outs[0]), _p(x), _p(wq), _p(wk), *_ints(a["q_heads"], a["kv_heads"], a["head_dim"]),
                     ctypes.c_float(a["eps"])])


def _rope(xs, outs, a, b):
    """(With the pools of the attention after it, xs' last two: kv_appends, the KV append too.)"""
    cos, sin = b.device.rope_tables(a)
    pools = tuple(xs[1:])
    append, _ = _append_args(pools, pools[0].dtype if pools else f32, b)
    b.device.launch(_weighted("rope", pools[0]) if pools else "rope_f32", _spread(b.rows, xs[0].width), THREADS,
                    [_p(outs[0]), _p(xs[0]), ctypes.c_void_p(cos), ctypes.c_void_p(sin), ctypes.c_void_p(b.positions),
                     *_ints(a["q_heads"], a["kv_heads"], a["head_dim"]), *append])


def attention_split(n: int, keys: int = SPLIT_KEYS) -> tuple:
    """(keys a split, splits) of a row whose causal range holds n keys, as step_kernels.cu's attention cuts
    it: splits of `keys` keys (attention_mma.cuh's: MMA_SPLIT_KEYS), or of the multiple of them that makes
    MAX_SPLITS of them or fewer where n is longer. A function of the row's own range alone, so its split
    points (and bits) never depend on max_seq or on the rows beside it, and a short range is never read in a
    few long splits."""
    split = keys * max(1, -(-n // (keys * MAX_SPLITS)))
    return split, -(-n // split)


def attention_blocks(max_seq: int) -> int:
    """The blocks of a row's attention per KV head (the launch's grid z, and the partials' records a row and
    query head): the most splits a range of up to max_seq keys takes (attention_split), so every row's
    splits have a block; a block past its row's splits returns at once."""
    return min(MAX_SPLITS, -(-max_seq // SPLIT_KEYS))


def attention_heads(nodes) -> list:
    """The attributes of the attention ops among `nodes`."""
    return [n.attr_dict for n in nodes if n.op in ("attention", "scaled_attention")]


def attention_partials(heads: list, rows: int, max_seq: int) -> int:
    """The floats of attention's per-split partials for `rows` rows: (dim values, max, sum, padding) per row,
    query head and block, for the widest of the attention ops' attributes `heads`."""
    return max([rows * a["q_heads"] * attention_blocks(max_seq) * (a["head_dim"] + 4) for a in heads] or [1])


def on_tensor_cores(a: dict, kv_dtype, arch: str) -> bool:
    """Whether the attention of attributes `a` over pools of kv_dtype runs on tensor cores (attention_mma.cuh)
    on a GPU of `arch`: 16-bit pools, head dims a multiple of 8 up to MMA_DIM, query heads a KV head dividing
    MMA_ROWS, compute capability 8.0 or later. A choice by the model and the GPU alone, so every row of a
    model's steps runs the one arithmetic."""
    hq, hkv, d = a["q_heads"], a["kv_heads"], a["head_dim"]
    return (kv_dtype in (bf16, f16) and d % 8 == 0 and d <= MMA_DIM and hq % hkv == 0
            and hq // hkv in MMA_GROUPS and arch_number(arch) >= 80)


def _attention_kernel(a: dict, kv_dtype=f32, arch: str = "sm_90a") -> str:
    hq, hkv, d = a["q_heads"], a["kv_heads"], a["head_dim"]
    if on_tensor_cores(a, kv_dtype, arch):
        return f"attention_mma_{hq // hkv}"
    dv = 1 if d <= 128 else 2
    if hq % hkv or hq // hkv not in GROUPS[dv] or d > MAX_DIM or d % 4:
        raise UnsupportedError(f"the GPU serving device's attention takes head_dim a multiple of 4 up to {MAX_DIM} "
                               f"and {list(GROUPS[dv])} query heads per KV head at that dim; this model has "
                               f"head_dim {d} and {hq} query heads over {hkv} KV heads",
                               hint="serve the model on device='cpu'")
    return f"attention_{hq // hkv}_{dv}"


def tile_rows(a: dict) -> int:
    """The rows of one of attention_mma's tiles for attributes `a`: its M rows over the query heads a KV head."""
    return MMA_ROWS // (a["q_heads"] // a["kv_heads"])


def attention_tiles(positions: np.ndarray, starts: np.ndarray, counts: np.ndarray, rows: int,
                    window: int) -> tuple:
    """(first row, rows, splits) of each of attention_mma's tiles of a step, int64 arrays: the step's chunks
    (rows starts[i] .. starts[i] + counts[i], in row order, covering the step) cut into tiles of up to `rows`
    rows, each with the most splits any of its rows has (attention_split of the row's own range, window
    start .. its position, in splits of MMA_SPLIT_KEYS)."""
    counts, starts = np.asarray(counts, np.int64), np.asarray(starts, np.int64)
    if counts.max(initial=0) <= rows:   # a chunk a tile (decode rows, short chunks): the common step
        first, size = starts, counts
    else:
        per = -(-counts // rows)
        chunk = np.repeat(np.arange(len(counts)), per)
        k = np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per)
        first = starts[chunk] + k * rows
        size = np.minimum(rows, counts[chunk] - k * rows)
    positions = np.asarray(positions, np.int64)
    n = positions + 1 - (np.maximum(positions - window + 1, 0) if window > 0 else 0)
    split = MMA_SPLIT_KEYS * np.maximum(1, -(-n // (MMA_SPLIT_KEYS * MAX_SPLITS)))
    splits = np.maximum.reduceat(-(-n // split), first) if len(first) else np.zeros(0, np.int64)
    return first, size, splits


def attention_items(tiles: tuple, unit=1) -> np.ndarray:
    """attention_mma's work of a step from its tiles (attention_tiles): (first row, rows, first split, end
    split) per item, int32 [items, 4], `unit` consecutive splits of a tile an item (fewer in its last); `unit`
    is one count for every tile or an array of one per tile."""
    first, size, splits = tiles
    unit = np.broadcast_to(np.asarray(unit, np.int64), np.shape(first))
    groups = -(-splits // unit)
    tile = np.repeat(np.arange(len(first)), groups)
    s = unit[tile] * (np.arange(int(groups.sum())) - np.repeat(np.cumsum(groups) - groups, groups))
    return np.stack([first[tile], size[tile], s, np.minimum(s + unit[tile], splits[tile])], axis=1).astype(np.int32)


def item_unit(splits: int, kv_heads: int, grid: int) -> int:
    """The splits an item of a shared tile takes (attention_items' unit) for a step of `splits` tile splits:
    about a block's share of the persistent grid's work, from 1 to MMA_UNIT. A tile of that many splits or
    fewer is one item, whole: it folds its splits itself, with no partials written and read again (a prompt
    chunk's tiles, where they fill the grid); a longer one's splits spread over more blocks."""
    return int(min(MMA_UNIT, max(1, -(-splits * kv_heads // grid))))


def solo(size, tile: int):
    """Whether tiles of `size` rows (of at most `tile`) can run solo (attention_solo): their M rows one
    warp's, rows at most a quarter of a tile (a decode row, a short chunk)."""
    return MMA_TILE_WARPS * np.asarray(size, np.int64) <= tile


def solo_tiles(tiles: tuple, tile: int, kv_heads: int, grid: int) -> np.ndarray:
    """Which of a step's tiles run solo: those that can, where their splits (times the KV heads) outnumber
    the grid's blocks. Fewer take a block each in attention_mma (each split's keys loaded by the block's four
    warps, a block ahead) rather than a warp each; either way a split's arithmetic is the same."""
    first, size, splits = tiles
    can = solo(size, tile)
    return can & (int(np.sum(splits[can])) * kv_heads > grid)


def tile_units(tiles: tuple, alone: np.ndarray, kv_heads: int, grid: int) -> np.ndarray:
    """The splits of each of a step's tiles an item takes, `alone` the tiles that run solo (solo_tiles). A
    solo tile's run one a warp of the block: as many as spread the step's solo splits over the grid, up to its
    MMA_TILE_WARPS warps. A shared tile: item_unit's count."""
    first, size, splits = tiles
    spread = -(-int(np.sum(splits[alone])) * kv_heads // grid)
    return np.where(alone, min(MMA_TILE_WARPS, max(1, spread)), item_unit(int(np.sum(splits)), kv_heads, grid))


def step_items(positions: np.ndarray, chunks: np.ndarray, tile: int, window: int, kv_heads: int,
               grid: int) -> tuple:
    """(items, solo items, done) of attention's kernels for a step of rows at `positions` in `chunks` (the
    scheduler's records: each chunk's first row and row count), for tiles of `tile` rows, a sliding `window`
    (0: none), `kv_heads` KV heads and a persistent grid of `grid` blocks: the solo tiles' items first
    (attention_solo's), then the shared tiles' (attention_mma's); done: int32 per row, 1 where its tile is a
    shared one of one item (whole: attention_mma folds its splits, attention_fold leaves the row)."""
    tiles = attention_tiles(positions, chunks["row"], chunks["count"], tile, window)
    # (what follows depends on the tiles and the grid alone: a decode step's are its step before's until a
    # row's range passes a split's end or the batch changes, so it is computed once for them)
    key = (tile, kv_heads, grid, *(t.tobytes() for t in tiles))
    found = _STEP_ITEMS.get(key)
    if found is not None:
        return found
    alone = solo_tiles(tiles, tile, kv_heads, grid)
    units = tile_units(tiles, alone, kv_heads, grid)
    items = attention_items(tiles, units)
    routed = np.repeat(alone, -(-tiles[2] // units))   # (attention_items' items of each tile, in tile order)
    done = np.repeat(~alone & (tiles[2] <= units), tiles[1]).astype(np.int32)   # (tiles in row order)
    found = (np.concatenate([items[routed], items[~routed]]), int(routed.sum()), done)
    for array in (found[0], done):
        array.flags.writeable = False   # (shared by the steps that find them)
    if len(_STEP_ITEMS) >= STEP_ITEMS_KEPT:
        _STEP_ITEMS.clear()   # (one call: devices on other threads may use it meanwhile)
    _STEP_ITEMS[key] = found
    return found


#: step_items' answers of the last steps, by their tiles, grid and heads (a decode step's repeat for as many
#: steps as its rows' splits have keys, 128 or more); a few, for the attention kinds of a model and the devices
#: of a process
STEP_ITEMS_KEPT = 16
_STEP_ITEMS: dict = {}


def most_items(a: dict, rows: int, max_batch: int, max_seq: int) -> int:
    """The most items attention_items gives a step of up to `rows` rows and `max_batch` requests: its tiles
    times attention_blocks(max_seq) (the CUDA-core rule's most splits, at least the tensor-core rule's)."""
    r = tile_rows(a)
    tiles = min(rows, -(-rows // r) + min(rows, max_batch))
    return tiles * attention_blocks(max_seq)


#: argmax_rows' values a block (its THREADS threads' eight each) and the most blocks a row
ARGMAX_SPAN = 8 * THREADS
ARGMAX_MOST_PARTS = 256


def argmax_parts(width: int) -> int:
    """The blocks of argmax_rows a row of `width` values: a block every ARGMAX_SPAN values, at most
    ARGMAX_MOST_PARTS (a vocabulary's row over several SMs, each thread's values all loading at once)."""
    return max(1, min(ARGMAX_MOST_PARTS, -(-width // ARGMAX_SPAN)))


ROUNDED_KINDS = {bf16: 1, f16: 2}   # step_kernels.cu's RowsOut kinds: the 16-bit dtype of rows handed over


def _attention(xs, outs, a, b):
    qkv, k_pool, v_pool = xs
    hq, hkv, d = a["q_heads"], a["kv_heads"], a["head_dim"]
    dev = b.device
    kernel = _weighted(_attention_kernel(a, k_pool.dtype, dev.arch), k_pool)
    ps, pages = dev.shape.page_size, dev.shape.pages_per_request
    if not a.get("appended"):   # (else the rope before it appended the rows' keys and values: kv_appends)
        _kv_append((k_pool, v_pool), qkv, a, b)
    options = attention_options(a)
    scale, softcap = ctypes.c_float(options["scale"] or 1.0 / np.sqrt(d)), ctypes.c_float(options["softcap"])
    window, blocks = a.get("window", 0), attention_blocks(dev.shape.max_seq)
    pools = [_p(k_pool), _p(v_pool), ctypes.c_void_p(b.positions), ctypes.c_void_p(b.entries),
             ctypes.c_void_p(b.page_table), *_ints(pages, ps, hq, hkv, d), scale, softcap, *_ints(window)]
    partials = ctypes.c_void_p(dev.attention_partials)
    # (with `hand`: the rows rounded to its dtype for the o linear after it, which loads them by TMA, instead;
    # handed_rows)
    rounded = [ctypes.c_void_p(dev.wgmma.hand(outs[0].ptr)), *_ints(ROUNDED_KINDS[a["hand"]])] if a.get("hand") \
        else [ctypes.c_void_p(None), *_ints(0)]
    if on_tensor_cores(a, k_pool.dtype, dev.arch):
        # the solo tiles' items (ranges[0] .. ranges[1]) and the shared tiles' (ranges[1] .. ranges[2]), each
        # kernel launched where the step has items for it, and the fold where some row's tile leaves partials
        # (the step's graph is keyed by which: _forward)
        work = (tile_rows(a), window, hkv)
        items, ranges, done, _ = dev.attention_work[work]
        solo_used, shared_used, fold_used = dev.attention_kinds[work]
        for name, at, smem, used in zip((kernel.replace("_mma_", "_solo_"), kernel), (0, 4), (MMA_SOLO_SMEM, MMA_SMEM),
                                        (solo_used, shared_used)):
            if used:
                dev.launch(name, (dev.attention_grid,), ATTENTION_THREADS,
                           [_p(outs[0]), partials, _p(qkv), *pools, ctypes.c_void_p(items),
                            ctypes.c_void_p(ranges + at), *_ints(blocks), *rounded], smem=smem)
        if fold_used:
            dev.launch(f"attention_fold_{hq // hkv}", (b.rows, hkv, hq // hkv), ATTENTION_THREADS,
                       [_p(outs[0]), partials, ctypes.c_void_p(b.positions), ctypes.c_void_p(done),
                        *_ints(hq, d, window, blocks), *rounded])
    else:
        dev.launch(kernel, (b.rows, hkv, blocks), ATTENTION_THREADS,
                   [_p(outs[0]), partials, ctypes.c_void_p(dev.attention_arrivals), _p(qkv), *pools, *rounded])


_ACTIVATIONS = {"silu": 0, "gelu": 2, "sigmoid": 3}   # step_kernels.cu's `activate` codes (1: geglu's tanh GELU)
MOE_WARPS = 8                    # step_kernels.cu's mixture of experts: a block's warps, a column a warp ...
MOE_MAX_EXPERTS = 1024           # ... a router's experts ...
MOE_MAX_K = 32                   # ... and the most it picks


def _activation(act: str, op: str) -> int:
    code = _ACTIVATIONS.get(act)
    if code is None:
        raise UnsupportedError(f"the GPU serving device has no kernel for {op}'s activation {act!r}",
                               hint=f"its kernels compute {sorted(_ACTIVATIONS)}")
    return code


def _act_mul(xs, outs, a, b):
    b.device.launch("act_mul", act_mul_grid(b.rows, outs[0].width), THREADS,
                    [_p(outs[0]), _p(xs[0]), *_ints(outs[0].width, _activation(a["act"], "act_mul"))])


def _gated_scale(xs, outs, a, b):
    x, gate = xs
    b.device.launch("gated_scale", _spread(b.rows, x.width), THREADS,
                    [_p(outs[0]), _p(x), _p(gate), *_ints(x.width, _activation(a["act"], "gated_scale"))])


def _moe_router(xs, outs, a, b):
    """The routing rows: each row's router logits, softmax and top_k (step_kernels.cu's moe_router)."""
    x, router = xs
    b.device.launch(_weighted("moe_router", router), (b.rows,), MOE_WARPS * 32,
                    [_p(outs[0]), _p(x), _p(router),
                     *_ints(router.shape[0], a["top_k"], x.width, a["norm_topk_prob"])])


def _moe_experts(xs, outs, a, b):
    """Each row's picked experts' gated MLPs, each expert's weights read once for the rows that picked it
    (step_kernels.cu: moe_plan lists the step's picked experts and the rows that picked each; moe_up and moe_down
    a block per (picked expert, columns), into the device's scratch of hidden rows and of products; moe_sum each
    row's slots in expert order)."""
    x, routing, *ws = xs
    dev, inter, h = b.device, int(ws[0].shape[0]), x.width
    table, top_k = dev.expert_tables[ws[0].name]
    experts, act = routing.width, _activation(a["act"], "moe_experts")
    picked = min(experts, b.rows * top_k)   # (the most experts the step's rows can pick)
    plan = ctypes.c_void_p(dev.expert_plan)
    dev.launch("moe_plan", (1,), MOE_MAX_EXPERTS, [plan, _p(routing), *_ints(b.rows, experts)])
    dev.launch(_weighted("moe_up", ws[0]), (picked, -(-inter // MOE_WARPS)), MOE_WARPS * 32,
               [ctypes.c_void_p(dev.expert_hidden), _p(x), plan, ctypes.c_void_p(table),
                *_ints(experts, top_k, h, inter, act)])
    dev.launch(_weighted("moe_down", ws[0]), (picked, -(-h // MOE_WARPS)), MOE_WARPS * 32,
               [ctypes.c_void_p(dev.expert_products), ctypes.c_void_p(dev.expert_hidden), plan,
                ctypes.c_void_p(table), *_ints(experts, top_k, h, inter)])
    dev.launch("moe_sum", _spread(b.rows, h), THREADS,
               [_p(outs[0]), ctypes.c_void_p(dev.expert_products), _p(routing), *_ints(experts, top_k, h)])


def _geglu(xs, outs, a, b):
    b.device.launch("act_mul", act_mul_grid(b.rows, outs[0].width), THREADS,
                    [_p(outs[0]), _p(xs[0]), *_ints(outs[0].width, 1)])


def _mapped(kind: int, param: str):
    def rule(xs, outs, a, b):
        b.device.launch("map_rows", _spread(b.rows, xs[0].width), THREADS,
                        [_p(outs[0]), _p(xs[0]), *_ints(xs[0].width, kind), ctypes.c_float(a[param])])

    return rule


def _add(xs, outs, a, b):
    b.device.launch("add", _spread(b.rows, xs[0].width), THREADS,
                    [_p(outs[0]), _p(xs[0]), _p(xs[1]), *_ints(xs[0].width)])


def _p(operand: Operand) -> ctypes.c_void_p:
    return ctypes.c_void_p(operand.ptr)


for _op, _rule in {"embedding": _embedding, "rms_norm": _rms_norm, "linear": _linear, "add_bias": _add_bias,
                   "head_rms_norm": _head_rms_norm, "rope": _rope, "attention": _attention,
                   "scaled_attention": _attention, "act_mul": _act_mul, "add": _add,
                   "rms_norm_1p": lambda xs, outs, a, b: _rms_norm(xs, outs, a, b, one_plus=1), "geglu": _geglu,
                   "scale": _mapped(0, "factor"), "softcap": _mapped(1, "cap"), "gated_scale": _gated_scale,
                   "moe_router": _moe_router, "moe_experts": _moe_experts}.items():
    GPU_STEP_RULES.register(_op, _rule)


@functools.lru_cache(maxsize=None)
def kernel_source() -> str:
    return (DEPENDENT_LAUNCH_SOURCE.read_text() + "\n" + ACTIVATIONS_SOURCE.read_text() + "\n" +
            ROW_NORMS_SOURCE.read_text() + "\n" + SOURCE.read_text() + "\n" + ATTENTION_MMA_SOURCE.read_text())


class GpuDevice(CpuDevice):
    """The serving device with its forward on a GPU (`ordinal`); the scheduler is the CPU device's."""

    def __init__(self, *args, ordinal: int = 0, **kwargs):
        self.ordinal = ordinal
        super().__init__(*args, **kwargs)

    # ---- set-up: weights, pools, buffers, kernels

    def _prepare(self, weights: dict, caches: tuple) -> None:
        from mdsl.backend.cuda.nvrtc import compile_source
        from mdsl.gpu.arrays import DeviceArray
        from mdsl.gpu.driver import check, driver, get_device, require_gpu, target_arch

        require_gpu("the GPU serving device (device='gpu')")
        for n in self.nodes:
            if n.op not in GPU_STEP_RULES:
                raise UnsupportedError(f"the GPU serving device has no kernel for layer op {n.op}",
                                       loc=n.loc, hint="serve the model on device='cpu'")
        self._check_experts()
        self._driver, self._check = driver, check
        self._device = get_device(self.ordinal)
        self.sms = self._device._attribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.arch = target_arch(self.ordinal)
        self._arrays: list = []

        def array(values: Optional[np.ndarray], shape: tuple, dtype) -> int:
            a = DeviceArray.from_numpy(values, dtype, device=self.ordinal) if values is not None else \
                DeviceArray(shape, dtype, device=self.ordinal)
            if values is None:
                check(driver.cuMemsetD8(a.ptr, 0, max(1, a.nbytes)), "cuMemsetD8")
            self._arrays.append(a)
            return a.ptr

        self._new_array = array
        rows, shape = self.shape.step_rows, self.shape
        self.values: dict = {}
        self._vectors: dict = {}         # host copies of the 1-d weights (norms, biases)
        for w in self.graph.weights:
            host = np.asarray(weights[w.name], np.float32)
            self.values[w.name] = Operand(array(host, host.shape, w.dtype), tuple(host.shape), w.dtype, w.name)
            if host.ndim == 1:
                self._vectors[w.name] = host
        self._pools: dict = {}
        for s in caches:   # (in the checkpoint's dtype: kv_append rounds the float32 keys and values to it)
            pool = kv_pool_shape(shape, *s.shape[1:])
            self.values[s.name] = Operand(array(None, pool, self.kv_dtype), pool, self.kv_dtype, s.name)
            self._pools[s.name] = self._arrays[-1]
        # every value the step's program writes: a [step rows, width] float32 buffer shared with the values
        # of its width that are no longer read when it is written (activation_slots), and its copy of the
        # rows that go on past the narrowing (gathered there)
        # (a Hopper GPU runs its tensor-core linears on wgmma, which fuses a gated MLP's activation)
        self._program, _, narrowed, slot_of, slot_widths = step_slots(self.graph, gates=self.arch == "sm_90a")
        slots = [Operand(array(None, (rows, w), f32), (rows, w), f32) for w in slot_widths]
        self._buffers: dict = {name: slots[k] for name, k in slot_of.items()}
        # the rows' sums of squares a 128-column tile (norm_squares), a buffer beside each slot that holds rows a
        # norm reads so: the linear writes a value's rows and their sums together, and the norm reads both while
        # the value holds the slot
        summed = {e[1]["squares"] for e in self._program if e is not None and isinstance(e[1], dict)
                  and e[1].get("squares")}
        sums = {k: array(None, (rows, slot_widths[k] // NORM_TILE), f32) for k in {slot_of[v] for v in summed}}
        self._squares: dict = {name: sums[slot_of[name]] for name in summed}
        self._narrowed: dict = {}
        self._tokens = array(None, (rows,), i32)
        self._positions = array(None, (rows,), i32)
        self._row_entries = array(None, (rows,), i32)
        self._keep = array(None, (rows,), i32)
        self._page_table = array(None, (shape.max_batch, shape.pages_per_request), i32)
        self._ropes: dict = {}
        self._joined: dict = {}
        module = compile_source(kernel_source(), self.arch)
        self._module = check(driver.cuModuleLoadData(module.cubin), "cuModuleLoadData")
        self._functions: dict = {}
        self._stream = check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value),
                             "cuStreamCreate")
        #: the launch of every kernel of a step on sm_90 or later: allowed to start while the one before it
        #: ends (dependent_launch.cuh); None before sm_90, where each waits for the one before
        self.dependent_launch = dependent_launch(driver, self._stream) if arch_number(self.arch) >= 90 else None
        # what the rules read besides the values, made before any capture: the rope tables, the joined
        # biases, and the narrowed copies of the values read past the narrowing
        for n in self.nodes:
            if n.op == "rope":
                self.rope_tables(n.attr_dict)
            elif n.op == "add_bias":
                self.joined([self.values[v.name] for v in n.inputs[1:]])
        partials, tiles, tensor_core = 1, 1, []
        for n in self.nodes:
            if n.op == "linear":
                k = int(n.inputs[0].shape[-1])
                for group, mma, count in linear_launches(k, [self.values[v.name] for v in n.inputs[1:]]):
                    if mma is not None:
                        partials = max(partials, mma_splits(count, k, self.sms) * rows * count * 16)
                        tiles = max(tiles, count)
                        tensor_core.append((k, [int(w.shape[0]) for w in group]))
        # on a Hopper GPU the tensor-core linears run on wgmma (mdsl.serving.gpu_wgmma), elsewhere on mma.sync
        self.wgmma = None
        if tensor_core and target_arch(self.ordinal) == "sm_90a":
            from mdsl.serving.gpu_wgmma import WgmmaLinears, scratch

            partials, tiles = scratch(tensor_core, rows, self.sms)
            self.wgmma = WgmmaLinears(self, max(k for k, _ in tensor_core))
        # a tensor-core linear's split-k partials and the count of each tile's splits done, of one at a time
        self.partials = array(None, (partials,), f32)
        self.linear_arrivals = array(None, (tiles,), i32)
        # attention's per-split partials (dim values, max, sum per row, query head and split) and the count
        # of each row's and KV head's splits done, of one attention at a time
        heads = attention_heads(self.nodes)
        for a in heads:
            _attention_kernel(a, self.kv_dtype, self.arch)   # (refused here, before any step, where none fits)
        # attention_mma's work of each step, per (tile rows, window, KV heads) of the attention ops on tensor
        # cores: its items and their count, written by the step before its program runs
        self.attention_work: dict = {}
        self.attention_kinds: dict = {}   # ... whether it has solo items, shared ones, rows to fold
        for a in heads:
            key = (tile_rows(a), a.get("window", 0), a["kv_heads"])
            if on_tensor_cores(a, self.kv_dtype, self.arch) and key not in self.attention_work:
                most = most_items(a, rows, shape.max_batch, shape.max_seq)
                self.attention_work[key] = (array(None, (most, 4), i32), array(None, (3,), i32),
                                            array(None, (rows,), i32), most)
        self.attention_partials = array(None, (attention_partials(heads, rows, shape.max_seq),), f32)
        self.attention_arrivals = array(None, (max([rows * a["kv_heads"] for a in heads] or [1]),), i32)
        # the persistent grid: the blocks an SM holds (of each G alike; the fewer of attention_mma and
        # attention_solo) times the SMs
        self.attention_grid = self.sms * min(
            self._blocks_per_sm(f"attention_{kind}_{MMA_GROUPS[-1]}_bf16", ATTENTION_THREADS, smem)
            for kind, smem in (("mma", MMA_SMEM), ("solo", MMA_SOLO_SMEM))) if self.attention_work else 1
        # a mixture of experts: per moe_experts node (by its first gate weight's name) the device array of its 3E
        # weights' addresses and its router's top_k; one scratch of hidden rows for the widest
        self.expert_tables: dict = {}
        hidden = products = pairs = 1
        for n, top_k in self._experts():
            addresses = np.array([self.values[v.name].ptr for v in n.inputs[2:]], np.uint64).view(np.int32)
            self.expert_tables[n.inputs[2].name] = (array(addresses, addresses.shape, i32), top_k)
            hidden = max(hidden, rows * top_k * int(n.inputs[2].shape[0]))
            products = max(products, rows * top_k * int(n.inputs[0].shape[-1]))
            pairs = max(pairs, 2 * rows * top_k)
        self.expert_hidden = array(None, (hidden,), f32)
        self.expert_products = array(None, (products,), f32)
        self.expert_plan = array(None, (1 + 3 * MOE_MAX_EXPERTS + pairs,), i32)   # (step_kernels.cu's moe_plan)
        self._best = array(None, (rows,), i32)            # the device's greedy tokens of the kept rows
        self._greedy_tokens: Optional[np.ndarray] = None   # ... where they are every chunk's (_forward)
        # argmax_rows' first maximum of each part of a row (value, index) and each row's count of parts done
        self._argmax_parts = array(None, (rows, ARGMAX_MOST_PARTS, 2), i32)
        self._argmax_counts = array(None, (rows,), i32)
        self._device_tokens: dict = {}
        for name in sorted(narrowed & set(self._buffers)):
            b = self._buffers[name]
            self._narrowed[name] = Operand(array(None, b.shape, f32), b.shape, f32)
        check(driver.cuCtxSynchronize(), "uploading the weights")   # (copied on the default stream)
        self._seen: set = set()          # the (rows, kept rows) of the steps run so far
        self._graphs: "OrderedDict" = OrderedDict()   # (rows, kept rows) -> the step's program as a CUDA graph
        self._uncaptured: set = set()    # the shapes whose capture failed
        self.replays = 0                 # steps run as graph replays
        self._profile: Optional[dict] = None   # op -> [seconds, steps] while profile_ops runs
        self._profiled: dict = {}        # ((rows, kept rows, ...), by kernel) -> (graph with events, its events)
        self._profile_kernels = False    # profile_ops' events after each kernel, not each op
        #: called with each kernel's name after its launch (profile_ops' kernel events), where set
        self.on_launch: Optional[Callable] = None

    def squares_of(self, name: str) -> int:
        """The device address of the sums of squares beside value `name`'s rows (norm_squares)."""
        return self._squares[name]

    def _experts(self) -> list:
        """(moe_experts node, its router's top_k) of each mixture of experts."""
        routers = {n.outputs[0].name: n for n in self.nodes if n.op == "moe_router"}
        return [(n, routers[n.inputs[1].name].attr_dict["top_k"]) for n in self.nodes if n.op == "moe_experts"]

    def _check_experts(self) -> None:
        """Refuse, before any memory is taken, a mixture of experts the step kernels cannot run."""
        for n in self.nodes:
            problem = None
            if n.op == "moe_router" and int(n.inputs[1].shape[0]) > MOE_MAX_EXPERTS:
                problem = f"its {n.inputs[1].shape[0]} experts (at most {MOE_MAX_EXPERTS})"
            elif n.op == "moe_router" and n.attr_dict["top_k"] > MOE_MAX_K:
                problem = f"its top_k {n.attr_dict['top_k']} (at most {MOE_MAX_K})"
            elif n.op == "moe_experts" and not any(m.op == "moe_router" and m.outputs[0].name == n.inputs[1].name
                                                   for m in self.nodes):
                problem = "its routing row, which no moe_router of the step makes (the kernels take its top_k)"
            elif n.op == "moe_experts" and len({v.dtype for v in n.inputs[2:]}) > 1:
                problem = "its experts' weights of different dtypes"
            if problem:
                raise UnsupportedError(f"the GPU serving device cannot run {n.op} with {problem}", loc=n.loc,
                                       hint="serve the model on device='cpu'")

    # ---- what the rules use

    def _function(self, name: str, smem: int = 0):
        function = self._functions.get(name)
        if function is None:
            d = self._driver
            function = self._functions[name] = self._check(d.cuModuleGetFunction(self._module, name.encode()),
                                                           f"cuModuleGetFunction({name})")
            if smem > 48 * 1024:
                self._check(d.cuFuncSetAttribute(
                    function, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                    f"allowing {name} its shared memory")
        return function

    def _blocks_per_sm(self, name: str, block: int, smem: int) -> int:
        return max(1, self._check(self._driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            self._function(name, smem), block, smem), f"the occupancy of {name}"))

    def launch(self, name: str, grid: tuple, block: int, args: list, smem: int = 0) -> None:
        launch_kernel(self, self._function(name, smem), name, grid, block, smem, args)

    def rope_tables(self, a: dict) -> tuple:
        """Device tables of cos and sin [max_seq, head_dim] for the rope attributes `a`, as the reference
        computes them per position."""
        key = tuple(sorted(a.items()))
        if key not in self._ropes:
            pairs = [rope_cos_sin(a, p) for p in range(self.shape.max_seq)]
            cos = np.stack([c for c, _ in pairs]).astype(np.float32)
            sin = np.stack([s for _, s in pairs]).astype(np.float32)
            self._ropes[key] = (self._new_array(cos, cos.shape, f32), self._new_array(sin, sin.shape, f32))
        return self._ropes[key]

    def joined(self, parts: list) -> Operand:
        """One device vector of the weight vectors `parts` end to end (a fused projection's biases)."""
        key = tuple(p.name for p in parts)
        if key not in self._joined:
            dtype = parts[0].dtype
            if any(p.dtype is not dtype for p in parts):
                raise UnsupportedError(f"the GPU serving device adds the biases {list(key)} of one dtype only")
            host = np.concatenate([self._vectors[name] for name in key])
            self._joined[key] = Operand(self._new_array(host, host.shape, dtype), host.shape, dtype)
        return self._joined[key]

    def kv_pools(self) -> dict:
        """Cache name -> a host copy of its KV pool's values (float32), between steps."""
        from mdsl.gpu.driver import get_device

        get_device(self.ordinal)
        self._sync()
        return {name: np.asarray(a.to_numpy(), np.float32) for name, a in self._pools.items()}

    # ---- the step

    def _upload(self, ptr: int, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, np.int32)
        if values.nbytes:   # (from pageable memory: returns once the values are staged)
            self._check(self._driver.cuMemcpyHtoDAsync(ptr, values.ctypes.data, values.nbytes, self._stream),
                        "cuMemcpyHtoDAsync")

    def _forward(self, step, chunks, rows) -> dict:
        """The step's forward on the GPU: row -> logits for the rows whose chunk samples there (every row
        while `record_logits`). A step whose (rows, kept rows) ran before replays its program as a CUDA
        graph (captured at its second occurrence): a decode step's hundreds of launches cost one."""
        from mdsl.gpu.driver import get_device

        get_device(self.ordinal)          # this thread's context
        n = len(rows)
        keep = (np.arange(n) if self.record_logits else
                (chunks["row"] + chunks["count"] - 1)[chunks["sample"] == 1].astype(np.int64))
        self._upload(self._tokens, rows["token"])
        self._upload(self._positions, rows["position"])
        self._upload(self._row_entries, np.repeat(chunks["entry"].astype(np.int32), chunks["count"].astype(np.int64)))
        self._upload(self._page_table, self.state["page_table"])
        self._upload(self._keep, keep)
        for (tile, window, kv_heads), (items, count, done, most) in self.attention_work.items():
            work, alone, folded = step_items(rows["position"], chunks, tile, window, kv_heads, self.attention_grid)
            assert len(work) <= most, (len(work), most)   # (most_items bounds every step's)
            self._upload(items, work)
            self._upload(count, np.array([0, alone, len(work)], np.int32))
            self._upload(done, folded)
            self.attention_kinds[tile, window, kv_heads] = (alone > 0, len(work) > alone, not folded.all())
        # (a step's program launches the attention kernels its items need: steps of other kinds, other graphs)
        key = (n, len(keep), tuple(self.attention_kinds.values()))
        graph = self._graphs.get(key)
        profile = self._profile   # (read once: profile_ops, on the host's thread, may stop it meanwhile)
        if profile is not None and key in self._graphs:
            logits = self._run_profiled(key, profile)
        elif graph is not None:
            self._graphs.move_to_end(key)
            self.replays += 1
            self._check(self._driver.cuGraphLaunch(graph, self._stream), "cuGraphLaunch")
            logits = self._logits_of(key)
        elif key in self._seen and self.capture and key not in self._uncaptured:
            logits = self._capture(key)
        else:
            self._seen.add(key)
            logits = self._run_program(*key[:2])
        self._device_tokens, self._greedy_tokens = {}, None
        if logits is None:
            self._check_pool_beside()
            self._sync()
            return {}
        # greedy requests' tokens are chosen on the device; the logits come back for the rows sampled on the
        # host (and every row while record_logits)
        row_entries = np.repeat(chunks["entry"], chunks["count"])[keep]
        greedy = self.state["entries"]["request"]["temperature"][row_entries] == 0
        any_greedy = bool(greedy.any())
        best = np.empty(len(keep), np.int32)
        if any_greedy:
            self.launch("argmax_rows", (len(keep), argmax_parts(logits.width)), THREADS,
                        [ctypes.c_void_p(self._best), _p(logits), *_ints(logits.width),
                         ctypes.c_void_p(self._argmax_parts), ctypes.c_void_p(self._argmax_counts)])
        self._check_pool_beside()
        if any_greedy:
            self._check(self._driver.cuMemcpyDtoHAsync(best.ctypes.data, self._best, best.nbytes, self._stream),
                        "reading the greedy tokens")
        wanted = np.arange(len(keep)) if self.record_logits else np.flatnonzero(~greedy)
        out = np.empty((len(keep), logits.width), np.float32)
        row_bytes = logits.width * 4
        for i in wanted.tolist():
            self._check(self._driver.cuMemcpyDtoHAsync(out[i].ctypes.data, logits.ptr + i * row_bytes, row_bytes,
                                                       self._stream), "reading the logits")
        self._sync()
        if any_greedy and int(best[greedy].max()) >= logits.width:
            raise NoMaximum()   # (argmax_rows' 2^31 - 1: no value above -inf, as first_maximum says)
        if len(keep) == len(chunks) and not len(wanted):
            # every chunk samples (keep: their last rows, in chunk order) and every one greedily: the device's
            # tokens are the step's, in chunk order (_samples), with no per-row dict
            self._greedy_tokens = best
            return {}
        self._device_tokens = {int(r): int(t) for r, t, g in zip(keep.tolist(), best.tolist(), greedy) if g}
        return {int(keep[i]): out[i] for i in wanted.tolist()}

    def _samples(self, logits: dict):
        """The step's tokens: the device's greedy ones as an array in chunk order where _forward left them
        (every chunk samples, greedily), else CpuDevice's chunk -> token."""
        return self._greedy_tokens if self._greedy_tokens is not None else super()._samples(logits)

    def _check_pool_beside(self) -> None:
        """The pool's check (_check_pool_now) while the step's kernels run, where it costs the step nothing (the
        host waits for them next; at a pool of 100,000 pages the check takes about 200 µs of a host's time); a
        damaged pool stops the device once its stream is idle."""
        try:
            self._check_pool_now()
        except BaseException:
            self._sync()
            raise

    def _token(self, e: int, logits: dict, row: int, pos: int) -> int:
        token = self._device_tokens.get(row)
        return super()._token(e, logits, row, pos) if token is None else token

    #: steps that ran before replay as CUDA graphs (a test turns it off to compare)
    capture = True
    MAX_GRAPHS = 64

    def _sync(self) -> None:
        self._check(self._driver.cuStreamSynchronize(self._stream), "running the step")

    def _run_program(self, n: int, kept: int, mark: Optional[Callable] = None) -> Optional[Operand]:
        """Launch the step's kernels for n rows of which `kept` go on past the narrowing; the logits'
        buffer (None when no row samples). `mark(op)` follows each op's launches."""
        mark = mark or (lambda op: None)
        values = dict(self.values)
        values[TOKENS] = None
        batch = GpuBatch(n, self._tokens, self._positions, self._row_entries, self._page_table, self)
        for i, entry in enumerate(self._program):
            if i == self._narrow_at and kept < n:
                if not kept:
                    return None
                for name in self._narrowed:
                    self.launch("gather", _spread(kept, values[name].width), THREADS,
                                [_p(self._narrowed[name]), _p(values[name]), ctypes.c_void_p(self._keep),
                                 *_ints(values[name].width)])
                    values[name] = self._narrowed[name]
                mark("gather")
                batch = attrs.evolve(batch, rows=kept)
            if entry is None:     # (the second op of a pair run as one, by the entry before it)
                continue
            rule, attrs_, names, results, op = entry
            outs = [self._buffers[r] for r in results]
            rule([values[name] for name in names], outs, attrs_, batch)
            mark(op)
            values.update(zip(results, outs))
        return values[self.graph.logits.name]

    # ---- where a step's time goes

    def profile_ops(self, on: bool, kernels: bool = False) -> dict:
        """Start (on) or stop timing each layer op of the steps that replay a CUDA graph: such a step then
        replays a twin of its graph with an event recorded after each op's kernels (with `kernels`, after
        each kernel: the times are keyed "op: kernel"), so the times are those of the replayed program (no
        launch gaps of the host; but an event between two kernels keeps the second from starting before the
        first ends, as dependent launches otherwise let it: the times sum to more than the step). Returns op
        -> (microseconds per step, steps timed) of the steps timed since the start; the greedy argmax and the
        copies are not in it."""
        times, self._profile = self._profile or {}, ({} if on else None)
        self._profile_kernels = kernels
        return {op: (1e6 * seconds / steps, steps) for op, (seconds, steps) in times.items()}

    def _run_profiled(self, key: tuple, profile: dict) -> Optional[Operand]:
        """Replay `key`'s graph with its events, adding each op's time to `profile` (the dict profile_ops
        started: stopped meanwhile, its times are simply not returned)."""
        d, check = self._driver, self._check
        kernels = self._profile_kernels
        if (key, kernels) not in self._profiled:
            events: list = []
            launched: list = []   # (kernel, its event) since the last op's end, with `kernels`

            def record():
                event = check(d.cuEventCreate(0), "cuEventCreate")
                check(d.cuEventRecordWithFlags(event, self._stream, d.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL),
                      "cuEventRecordWithFlags")
                return event

            def mark(op):
                if kernels:
                    events.extend((f"{op}: {name}", event) for name, event in launched)
                    launched.clear()
                else:
                    events.append((op, record()))

            if kernels:
                self.on_launch = lambda name: launched.append((name, record()))

            start = check(d.cuEventCreate(0), "cuEventCreate")
            collecting = gc.isenabled()
            gc.disable()          # (as in _capture: no collection inside the capture)
            try:
                check(d.cuStreamBeginCapture(self._stream, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
                      "cuStreamBeginCapture")
                try:
                    check(d.cuEventRecordWithFlags(start, self._stream,
                                                   d.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL),
                          "cuEventRecordWithFlags")
                    self._run_program(*key[:2], mark=mark)
                finally:          # (the stream leaves capture whatever failed)
                    self.on_launch = None
                    ended = d.cuStreamEndCapture(self._stream)
            finally:
                if collecting:
                    gc.enable()
            captured = check(ended, "cuStreamEndCapture")
            graph = check(d.cuGraphInstantiate(captured, 0), "cuGraphInstantiate")
            check(d.cuGraphDestroy(captured), "cuGraphDestroy")
            self._profiled[key, kernels] = (graph, start, events)
        graph, start, events = self._profiled[key, kernels]
        check(d.cuGraphLaunch(graph, self._stream), "cuGraphLaunch")
        self._sync()
        before = start
        for op, event in events:
            ms = check(d.cuEventElapsedTime(before, event), "cuEventElapsedTime")
            seconds, steps = profile.get(op, (0.0, 0))
            profile[op] = (seconds + ms / 1e3, steps)
            before = event
        for op in {op for op, _ in events}:
            seconds, steps = profile[op]
            profile[op] = (seconds, steps + 1)
        return self._logits_of(key)

    def _logits_of(self, key: tuple) -> Optional[Operand]:
        return self._buffers[self.graph.logits.name] if key[1] else None

    def _capture(self, key: tuple) -> Optional[Operand]:
        """Capture the program for `key` as a graph, keep it (the least recently used goes past
        MAX_GRAPHS) and launch it. A capture that fails leaves the shape to run launched."""
        from mdsl.gpu.driver import CudaError, error_text

        d, check = self._driver, self._check
        collecting = gc.isenabled()
        # no collection meanwhile: one could free a closed engine's device memory, on the default stream,
        # inside this thread's capture
        gc.disable()
        try:
            check(d.cuStreamBeginCapture(self._stream, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
                  "cuStreamBeginCapture")
            try:
                logits, failure = self._run_program(*key[:2]), None
            except CudaError as e:
                logits, failure = None, e
            err, captured = d.cuStreamEndCapture(self._stream)
        finally:
            if collecting:
                gc.enable()
        if failure is not None or err != d.CUresult.CUDA_SUCCESS:
            if captured:
                d.cuGraphDestroy(captured)
            self._seen.discard(key)
            self._uncaptured.add(key)
            _log.warning("the GPU serving device could not capture a step of %d rows as a CUDA graph (%s); its "
                         "steps run launched", key[0], failure or error_text(err))
            return self._run_program(*key[:2])
        graph = check(d.cuGraphInstantiate(captured, 0), "cuGraphInstantiate")
        check(d.cuGraphDestroy(captured), "cuGraphDestroy")
        self._graphs[key] = graph
        if len(self._graphs) > self.MAX_GRAPHS:
            _, old = self._graphs.popitem(last=False)
            check(d.cuGraphExecDestroy(old), "cuGraphExecDestroy")
        check(d.cuGraphLaunch(graph, self._stream), "cuGraphLaunch")
        return logits


def kv_cache_budget(graph, fraction: float, step_rows: int, ordinal: int = 0) -> int:
    """The KV pool's bytes when the GPU device may take `fraction` of the GPU's memory: that share, less
    the memory already in use, the weights, the step's activation buffers and attention's partials."""
    from mdsl.gpu.driver import check, driver, get_device, require_gpu, target_arch

    require_gpu("sizing the KV cache by gpu_memory_fraction")
    get_device(ordinal)
    free, total = check(driver.cuMemGetInfo(), "cuMemGetInfo")
    weights = sum(int(np.prod(w.shape)) * w.dtype.itemsize for w in graph.weights)
    _, _, narrowed, _, slot_widths = step_slots(graph, gates=target_arch(ordinal) == "sm_90a")
    widths = {v.name: int(v.shape[-1]) for n in graph.nodes for v in n.outputs}
    activations = 4 * step_rows * (sum(slot_widths) + sum(widths[name] for name in narrowed))
    partials = 4 * attention_partials(attention_heads(graph.nodes), step_rows, graph.max_positions)
    return int(fraction * total) - (total - free) - weights - activations - partials

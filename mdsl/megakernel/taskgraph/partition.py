"""Partitioning a model graph into a task graph: each layer op's rule in `TASK_RULES` cuts the op into
tiles; `build_task_graph` collects them and links them by events.

Tiles per op (the `tile` entries a task body reads):
* column ops (embedding, linear, add_bias, act_mul, geglu, scale, softcap, add, argmax.partial): `col_start`, `col_stop`, a range of
  output columns; widths chosen so that a wide op has at least `num_sms` tiles.
* rms_norm, rms_norm_1p: `row` (decode has one row: one task).
* head_rms_norm, rope: `head`, a head of the fused q|k|v row (query heads, then key heads, then value
  heads, which are copied through).
* attention.partial: `kv_head`, `split`, `splits`: one KV head's queries over one of `splits` ranges of
  positions 0..position (scaled_attention: of its window's positions), anchored at the position (the last split holds it and appends this step's key
  and value to the cache); writes per-split outputs and log-sum-exps to scratch.
  attention.combine: `kv_head`: merges the splits of one KV head's queries.
* argmax.reduce, sample: no tile entries (one task over the partial results / all logits).
* moe_router: `row` (one task). moe.up: `expert`, `col_start`, `col_stop`: hidden columns of one expert;
  moe.down: `col_start`, `col_stop`: output columns summed over the experts the routing row picks.
"""
from __future__ import annotations

import math
from typing import Callable

import attrs

from mdsl.ir.dtypes import f32, i32
from mdsl.ir.rules import RuleTable
from mdsl.ir.types import TensorType, Var
from mdsl.megakernel.modelgraph.layers import LAYER_OPS, gate_up_rows, split_biases
from mdsl.megakernel.modelgraph.model import TOKENS, ModelGraph
from mdsl.megakernel.taskgraph.tasks import (ACTIVATION, SCRATCH, STATE, WEIGHT, Buffer, PartitionConfig, Region,
                                             TaskGraph, build_events)


@attrs.frozen
class TaskSpec:
    kind: str
    tile: tuple
    reads: tuple
    writes: tuple


def full(var: Var, dynamic: bool = False) -> Region:
    return Region(var.name, tuple((0, n) for n in var.shape), dynamic)


def columns(var: Var, start: int, stop: int) -> Region:
    return Region(var.name, ((0, 1), (start, stop)))


def balanced_tiles(n: int, count: int, min_width: int) -> list:
    """[start, stop) ranges splitting n columns into `count` near-equal tiles of at least min_width (fewer
    tiles where n is narrower): the GPU runtime's rows per linear task."""
    count = max(1, min(count, n // min_width))
    return [(n * k // count, n * (k + 1) // count) for k in range(count)]


def column_tiles(n: int, config: PartitionConfig) -> list:
    """(start, stop) ranges covering 0..n: at least num_sms of them when n allows, widths a multiple of
    column_align (or a power of two below it); with config.min_columns, `balanced_tiles` instead."""
    if config.min_columns is not None:
        return balanced_tiles(n, config.num_sms, config.min_columns)
    width = max(1, n // config.num_sms)
    if width >= config.column_align:
        width -= width % config.column_align
    else:
        width = 1 << (width.bit_length() - 1)
    return [(a, min(a + width, n)) for a in range(0, n, width)]


def _col_tile(a: int, b: int) -> tuple:
    return (("col_start", a), ("col_stop", b))


def _embedding_tasks(node, config):
    tokens, table = node.inputs
    out = node.output
    return [TaskSpec(node.op, _col_tile(a, b),
                     (full(tokens, dynamic=True), Region(table.name, ((0, table.shape[0]), (a, b)), dynamic=True)),
                     (columns(out, a, b),)) for a, b in column_tiles(out.shape[1], config)], []


def _row_tasks(node, config):
    return [TaskSpec(node.op, (("row", 0),), tuple(map(full, node.inputs)), (full(node.output),))], []


def weight_rows(weights, start: int, stop: int) -> list:
    """(weight index, first row, end row, first output column) of each weight that output columns
    start..stop of a fused linear fall in (or of each bias vector of add_bias, concatenated alike)."""
    out, base = [], 0
    for i, w in enumerate(weights):
        n = w.shape[0]
        lo, hi = max(start, base), min(stop, base + n)
        if lo < hi:
            out.append((i, lo - base, hi - base, lo))
        base += n
    return out


def weight_row_tasks(kind: str, shared_reads: tuple, ws, output: Var, config) -> list:
    """(start, stop, TaskSpec) per column tile of `output`: the task reads `shared_reads` and the rows of the
    weights ws (fused along their rows) that produce its columns, and writes its columns."""
    specs = []
    for a, b in column_tiles(output.shape[1], config):
        rows = [Region(ws[i].name, ((r0, r1), (0, ws[i].shape[1]))) for i, r0, r1, _ in weight_rows(ws, a, b)]
        specs.append((a, b, TaskSpec(kind, _col_tile(a, b), (*shared_reads, *rows), (columns(output, a, b),))))
    return specs


def _linear_tasks(node, config):
    x, *ws = node.inputs
    return [spec for _, _, spec in weight_row_tasks("linear", (full(x),), ws, node.output, config)], []


def _add_bias_tasks(node, config):
    x, *bs = node.inputs
    return [TaskSpec("add_bias", _col_tile(a, b),
                     (columns(x, a, b), *(Region(bs[i].name, ((r0, r1),)) for i, r0, r1, _ in weight_rows(bs, a, b))),
                     (columns(node.output, a, b),)) for a, b in column_tiles(node.output.shape[1], config)], []


def _per_head_tasks(node, config):
    a = node.attr_dict
    hq, hkv, d = a["q_heads"], a["kv_heads"], a["head_dim"]
    qkv, *norm_weights = node.inputs
    specs = []
    for h in range(hq + 2 * hkv):
        reads = [columns(qkv, h * d, (h + 1) * d)]
        if norm_weights and h < hq + hkv:
            reads.append(full(norm_weights[0] if h < hq else norm_weights[1]))
        specs.append(TaskSpec(node.op, (("head", h),), tuple(reads), (columns(node.output, h * d, (h + 1) * d),)))
    return specs, []


def kv_split_count(kv_heads: int, config: PartitionConfig) -> int:
    return config.kv_splits or max(1, math.ceil(config.num_sms / kv_heads))


def split_range(position: int, split: int, splits: int) -> tuple:
    """Positions [start, stop) of one split of 0..position: equal chunks anchored at the position, so
    the last split always holds it (early splits may be empty)."""
    chunk = math.ceil((position + 1) / splits)
    stop = max(0, position + 1 - (splits - 1 - split) * chunk)
    return max(0, stop - chunk), stop


def chunked_split_range(position: int, split: int, splits: int, min_chunk: int) -> tuple:
    """Positions [start, stop) of one split of 0..position: chunks of max(min_chunk, ceil((position + 1) /
    splits)) from position 0, so the split holding the position (the one that appends it to the KV cache)
    is the last non-empty one; later splits are empty. The GPU runtime's rule (fused rope_attention)."""
    chunk = max(min_chunk, -(-(position + 1) // splits))
    return min(split * chunk, position + 1), min(split * chunk + chunk, position + 1)


def split_positions_bound(positions: int, split: int, splits: int, min_chunk: int) -> tuple:
    """The positions one split of chunked_split_range may cover at any position below `positions`: its
    chunk grows from min_chunk to max(min_chunk, ceil(positions / splits))."""
    widest = max(min_chunk, -(-positions // splits))
    return min(positions, split * min_chunk), min(positions, (split + 1) * widest)


def attention_scratch(node) -> tuple:
    """The scratch buffers of an attention node: per-split outputs [splits, Hq, D] and log-sum-exps."""
    out = node.output
    return f"{out.name}.partial_out", f"{out.name}.partial_lse"


def _attention_tasks(node, config):
    a = node.attr_dict
    hq, hkv, d = a["q_heads"], a["kv_heads"], a["head_dim"]
    group = hq // hkv
    qkv, k_cache, v_cache = node.inputs
    splits = kv_split_count(hkv, config)
    part_out, part_lse = attention_scratch(node)
    positions = k_cache.shape[0]
    scratch = [Buffer(part_out, TensorType((splits, hq, d), f32), SCRATCH),
               Buffer(part_lse, TensorType((splits, hq), f32), SCRATCH)]
    specs = []
    for h in range(hkv):
        q_cols = columns(qkv, h * group * d, (h + 1) * group * d)
        k_cols = columns(qkv, (hq + h) * d, (hq + h + 1) * d)
        v_cols = columns(qkv, (hq + hkv + h) * d, (hq + hkv + h + 1) * d)
        caches = [Region(c.name, ((0, positions), (h, h + 1), (0, d)), dynamic=True) for c in (k_cache, v_cache)]
        heads = (h * group, (h + 1) * group)
        for s in range(splits):
            writes = [Region(part_out, ((s, s + 1), heads, (0, d))), Region(part_lse, ((s, s + 1), heads))]
            if s == splits - 1:
                writes += caches
            specs.append(TaskSpec("attention.partial", (("kv_head", h), ("split", s), ("splits", splits)),
                                  (q_cols, k_cols, v_cols, *caches), tuple(writes)))
    for h in range(hkv):
        heads = (h * group, (h + 1) * group)
        specs.append(TaskSpec("attention.combine", (("kv_head", h),),
                              (Region(part_out, ((0, splits), heads, (0, d))), Region(part_lse, ((0, splits), heads))),
                              (columns(node.output, h * group * d, (h + 1) * group * d),)))
    return specs, scratch


def _act_mul_tasks(node, config):
    gu, out = node.inputs[0], node.output
    half = out.shape[1]
    return [TaskSpec(node.op, _col_tile(a, b), (columns(gu, a, b), columns(gu, half + a, half + b)),
                     (columns(out, a, b),)) for a, b in column_tiles(half, config)], []


def _elementwise_tasks(node, config):
    x = node.inputs[0]
    return [TaskSpec(node.op, _col_tile(a, b), (columns(x, a, b),), (columns(node.output, a, b),))
            for a, b in column_tiles(node.output.shape[1], config)], []


def _gated_scale_tasks(node, config):
    """Column tiles of the row, each reading the one-value gate whole."""
    x, gate = node.inputs
    return [TaskSpec(node.op, _col_tile(a, b), (columns(x, a, b), full(gate)), (columns(node.output, a, b),))
            for a, b in column_tiles(node.output.shape[1], config)], []


def moe_scratch(node) -> str:
    """The scratch buffer of a moe_experts node: each expert's hidden row act(gate x) * up x, [E, inter]."""
    return f"{node.output.name}.expert_hidden"


def _moe_experts_tasks(node, config):
    """moe.up: one expert's hidden columns (its gate and up rows); moe.down: output columns from every picked
    expert's down rows. Every task reads the routing row: a task of an expert it does not pick reads none of
    that expert's weights."""
    x, routing, *ws = node.inputs
    experts = routing.shape[1]
    gates, ups, downs = ws[:experts], ws[experts:2 * experts], ws[2 * experts:]
    inter = gates[0].shape[0]
    hidden = moe_scratch(node)
    specs = []
    for e in range(experts):
        for a, b in column_tiles(inter, config):
            specs.append(TaskSpec("moe.up", (("expert", e), *_col_tile(a, b)),
                                  (full(x), full(routing), *(Region(w.name, ((a, b), (0, w.shape[1])))
                                                             for w in (gates[e], ups[e]))),
                                  (Region(hidden, ((e, e + 1), (a, b))),)))
    for a, b in column_tiles(node.output.shape[1], config):
        specs.append(TaskSpec("moe.down", _col_tile(a, b),
                              (full(routing), Region(hidden, ((0, experts), (0, inter))),
                               *(Region(w.name, ((a, b), (0, inter))) for w in downs)),
                              (columns(node.output, a, b),)))
    return specs, [Buffer(hidden, TensorType((experts, inter), f32), SCRATCH)]


def _add_tasks(node, config):
    x, y = node.inputs
    return [TaskSpec("add", _col_tile(a, b), (columns(x, a, b), columns(y, a, b)), (columns(node.output, a, b),))
            for a, b in column_tiles(node.output.shape[1], config)], []


def argmax_scratch(node) -> tuple:
    return f"{node.output.name}.partial_value", f"{node.output.name}.partial_index"


def _argmax_tasks(node, config):
    logits, tokens = node.inputs
    tiles = column_tiles(logits.shape[1], config)
    values, indices = argmax_scratch(node)
    scratch = [Buffer(values, TensorType((len(tiles),), f32), SCRATCH),
               Buffer(indices, TensorType((len(tiles),), i32), SCRATCH)]
    specs = [TaskSpec("argmax.partial", (*_col_tile(a, b), ("slot", j)), (columns(logits, a, b),),
                      (Region(values, ((j, j + 1),)), Region(indices, ((j, j + 1),))))
             for j, (a, b) in enumerate(tiles)]
    specs.append(TaskSpec("argmax.reduce", (("slots", len(tiles)),),
                          (Region(values, ((0, len(tiles)),)), Region(indices, ((0, len(tiles)),))),
                          (full(node.output), full(tokens, dynamic=True))))
    return specs, scratch


def _sample_tasks(node, config):
    logits, tokens = node.inputs
    return [TaskSpec("sample", (), (full(logits),), (full(node.output), full(tokens, dynamic=True)))], []


# fused ops (mdsl.megakernel.taskgraph.layer_fusion); tile entries as above, plus:
# * rope_attention.partial: `kv_head`, `split`, `splits`, `min_chunk` (positions by chunked_split_range;
#   the split holding the position appends it to the cache, so every split declares the cache write);
#   rope_attention.combine: `head`, one query head.
# * linear_norm_residual: `col_start`, `col_stop` (the linear's raw columns, into scratch); its `.norm` task:
#   no tile entries (the whole row normalised and added to the residual).
# * lm_head: `col_start`, `col_stop`, `slot`: logits columns and the tile's best (value, index) in slot;
#   lm_head.argmax / lm_head.sample: no tile entries.
# * moe_router.logits: `col_start`, `col_stop`: rows of the router (the logits of those experts);
#   moe_router.route: no tile entries (the softmax, the top-k: the routing row).
# * moe.expert_up: `slot`, `col_start`, `col_stop`: hidden columns of the slot-th expert the routing row picks
#   (routing_slots: the router's top-k order); it may read the rows of any expert's gate and up weights (dynamic
#   regions), the body reads the picked one's only. moe.expert_down: `col_start`, `col_stop`: output columns,
#   the slots' down rows summed in slot order, plus the residual.

def _norm_linear_tasks(node, config):
    x, norm, *ws = node.inputs
    return [spec for _, _, spec in weight_row_tasks("norm_linear", (full(x), full(norm)), ws, node.output, config)], []


def _norm_linear_bias_tasks(node, config):
    x, norm, *rest = node.inputs
    ws, bs = split_biases(rest)
    return [attrs.evolve(spec, reads=(*spec.reads, *(Region(bs[i].name, ((r0, r1),)) for i, r0, r1, _ in
                                                     weight_rows(bs, a, b))))
            for a, b, spec in weight_row_tasks("norm_linear_bias", (full(x), full(norm)), ws, node.output, config)], []


def _norm_gate_up_tasks(node, config):
    x, norm, *ws = node.inputs
    return [TaskSpec(node.op, _col_tile(a, b),
                     (full(x), full(norm), *(Region(w.name, ((r0, r1), (0, w.shape[1])))
                                             for w, r0, r1 in gate_up_rows(ws, a, b))),
                     (columns(node.output, a, b),)) for a, b in column_tiles(node.output.shape[1], config)], []


def _linear_residual_tasks(node, config):
    x, residual, *ws = node.inputs
    specs = []
    for a, b, spec in weight_row_tasks("linear_residual", (full(x),), ws, node.output, config):
        specs.append(attrs.evolve(spec, reads=(columns(residual, a, b), *spec.reads)))
    return specs, []


def _linear_add_residual_tasks(node, config):
    x, addend, residual, *ws = node.inputs
    specs = []
    for a, b, spec in weight_row_tasks("linear_add_residual", (full(x),), ws, node.output, config):
        specs.append(attrs.evolve(spec, reads=(columns(addend, a, b), columns(residual, a, b), *spec.reads)))
    return specs, []


def normed_output_scratch(node) -> str:
    """The scratch row of a linear_norm_residual node: the linear's output before its norm."""
    return f"{node.output.name}.raw"


def _linear_norm_residual_tasks(node, config):
    """Column tiles of the linear's raw output row (scratch), then one task normalising the whole row and adding
    it to the residual."""
    x, residual, norm, *ws = node.inputs
    raw = normed_output_scratch(node)
    row = Var(raw, TensorType((1, node.output.shape[1]), f32))
    specs = [spec for _, _, spec in weight_row_tasks(node.op, (full(x),), ws, row, config)]
    specs.append(TaskSpec(f"{node.op}.norm", (), (full(row), full(residual), full(norm)), (full(node.output),)))
    return specs, [Buffer(raw, row.type, SCRATCH)]


def _rope_attention_tasks(node, config):
    a = node.attr_dict
    hq, hkv, d = a["q_heads"], a["kv_heads"], a["head_dim"]
    group = hq // hkv
    qkv, k_cache, v_cache, *norms = node.inputs
    splits = kv_split_count(hkv, config)
    part_out, part_lse = attention_scratch(node)
    scratch = [Buffer(part_out, TensorType((splits, hq, d), f32), SCRATCH),
               Buffer(part_lse, TensorType((splits, hq), f32), SCRATCH)]
    specs = []
    for h in range(hkv):
        heads = (h * group, (h + 1) * group)
        qkv_reads = [columns(qkv, h * group * d, (h + 1) * group * d), columns(qkv, (hq + h) * d, (hq + h + 1) * d),
                     columns(qkv, (hq + hkv + h) * d, (hq + hkv + h + 1) * d)]
        for s in range(splits):
            caches = [Region(c.name, (split_positions_bound(k_cache.shape[0], s, splits, config.attention_min_chunk),
                                      (h, h + 1), (0, d)), dynamic=True) for c in (k_cache, v_cache)]
            tile = (("kv_head", h), ("split", s), ("splits", splits), ("min_chunk", config.attention_min_chunk))
            writes = (Region(part_out, ((s, s + 1), heads, (0, d))), Region(part_lse, ((s, s + 1), heads)), *caches)
            specs.append(TaskSpec("rope_attention.partial", tile, (*qkv_reads, *caches, *map(full, norms)), writes))
    for head in range(hq):
        specs.append(TaskSpec("rope_attention.combine", (("head", head),),
                              (Region(part_out, ((0, splits), (head, head + 1), (0, d))),
                               Region(part_lse, ((0, splits), (head, head + 1)))),
                              (columns(node.output, head * d, (head + 1) * d),)))
    return specs, scratch


def _rope_scaled_attention_tasks(node, config):
    """rope_attention's tasks; a split's positions start at the window's first position, so each split may
    read any cached position (its cache regions are whole)."""
    specs, scratch = _rope_attention_tasks(node, config)
    caches = {c.name: c for c in node.inputs[1:3]}

    def whole(region: Region) -> Region:
        return full(caches[region.buffer], dynamic=True) if region.buffer in caches else region

    return [attrs.evolve(s, reads=tuple(map(whole, s.reads)), writes=tuple(map(whole, s.writes))) for s in specs], \
        scratch


def _lm_head_tasks(final_kind: str, reads_logits: bool):
    def rule(node, config):
        x, norm, head, tokens = node.inputs
        logits, token = node.outputs
        tiles = weight_row_tasks("lm_head", (full(x), full(norm)), (head,), logits, config)
        values, indices = argmax_scratch(node)
        scratch = [Buffer(values, TensorType((len(tiles),), f32), SCRATCH),
                   Buffer(indices, TensorType((len(tiles),), i32), SCRATCH)]
        specs = [attrs.evolve(spec, tile=(*spec.tile, ("slot", j)),
                              writes=(*spec.writes, Region(values, ((j, j + 1),)), Region(indices, ((j, j + 1),))))
                 for j, (_, _, spec) in enumerate(tiles)]
        slots = (Region(values, ((0, len(tiles)),)), Region(indices, ((0, len(tiles)),)))
        specs.append(TaskSpec(final_kind, (), (full(logits),) if reads_logits else slots,
                              (full(token), full(tokens, dynamic=True))))
        return specs, scratch

    return rule


def moe_logits_scratch(node) -> str:
    """The scratch row of a norm_moe_router node: the router's logits [1, E]."""
    return f"{node.output.name}.logits"


def _norm_moe_router_tasks(node, config):
    x, norm, router = node.inputs
    experts = router.shape[0]
    logits = moe_logits_scratch(node)
    specs = [TaskSpec("moe_router.logits", _col_tile(a, b),
                      (full(x), full(norm), Region(router.name, ((a, b), (0, router.shape[1])))),
                      (Region(logits, ((0, 1), (a, b))),)) for a, b in column_tiles(experts, config)]
    specs.append(TaskSpec("moe_router.route", (), (Region(logits, ((0, 1), (0, experts))),), (full(node.output),)))
    return specs, [Buffer(logits, TensorType((1, experts), f32), SCRATCH)]


def expert_slot_tiles(inter: int, top_k: int, config: PartitionConfig) -> list:
    """(slot, start, stop) of the fused experts' gate/up tiles: each slot's hidden columns cut into num_sms // top_k
    tiles (one per worker over the slots together), as column ops are cut."""
    per_slot = attrs.evolve(config, num_sms=max(1, config.num_sms // top_k))
    return [(j, a, b) for j in range(top_k) for a, b in column_tiles(inter, per_slot)]


def _norm_moe_experts_residual_tasks(node, config):
    """moe.expert_up per (slot, hidden columns), moe.expert_down per output column range (module docstring)."""
    x, norm, routing, residual, *ws = node.inputs
    experts = routing.shape[1]
    gates, ups, downs = ws[:experts], ws[experts:2 * experts], ws[2 * experts:]
    inter, top_k = gates[0].shape[0], node.attr_dict["top_k"]
    hidden = moe_scratch(node)
    specs = []
    for j, a, b in expert_slot_tiles(inter, top_k, config):
        specs.append(TaskSpec("moe.expert_up", (("slot", j), *_col_tile(a, b)),
                              (full(x), full(norm), full(routing),
                               *(Region(w.name, ((a, b), (0, w.shape[1])), dynamic=True) for w in (*gates, *ups))),
                              (Region(hidden, ((j, j + 1), (a, b))),)))
    for a, b in column_tiles(node.output.shape[1], config):
        specs.append(TaskSpec("moe.expert_down", _col_tile(a, b),
                              (full(routing), Region(hidden, ((0, top_k), (0, inter))), columns(residual, a, b),
                               *(Region(w.name, ((a, b), (0, inter)), dynamic=True) for w in downs)),
                              (columns(node.output, a, b),)))
    return specs, [Buffer(hidden, TensorType((top_k, inter), f32), SCRATCH)]


@attrs.frozen
class TaskRule:
    """How a layer op is cut into tasks: `split(node, config)` is its `TaskSpec`s and the scratch buffers
    they use."""

    split: Callable


#: every layer op has one
TASK_RULES: RuleTable[TaskRule] = RuleTable("task-graph partition", TaskRule,
                                            "mdsl.megakernel.taskgraph.partition (TASK_RULES)", registry=LAYER_OPS,
                                            needs=lambda op: True)
for _name, _rule in {
    "embedding": _embedding_tasks, "rms_norm": _row_tasks, "linear": _linear_tasks,
    "add_bias": _add_bias_tasks, "head_rms_norm": _per_head_tasks, "rope": _per_head_tasks, "attention": _attention_tasks,
    "scaled_attention": _attention_tasks, "rope_scaled_attention": _rope_scaled_attention_tasks,
    "moe_router": _row_tasks, "moe_experts": _moe_experts_tasks, "gated_scale": _gated_scale_tasks,
    "rms_norm_1p": _row_tasks, "geglu": _act_mul_tasks, "scale": _elementwise_tasks, "softcap": _elementwise_tasks,
    "act_mul": _act_mul_tasks, "add": _add_tasks, "argmax": _argmax_tasks, "sample": _sample_tasks,
    "norm_linear": _norm_linear_tasks, "norm_linear_bias": _norm_linear_bias_tasks, "norm_gate_up": _norm_gate_up_tasks, "linear_residual": _linear_residual_tasks,
    "linear_add_residual": _linear_add_residual_tasks,
    "norm_geglu": _norm_gate_up_tasks, "linear_norm_residual": _linear_norm_residual_tasks,
    "norm_1p_linear": _norm_linear_tasks, "lm_head_1p_argmax": _lm_head_tasks("lm_head.argmax", False),
    "lm_head_1p_sample": _lm_head_tasks("lm_head.sample", True),
    "scaled_embedding": _embedding_tasks,
    "rope_attention": _rope_attention_tasks, "lm_head_argmax": _lm_head_tasks("lm_head.argmax", False),
    "lm_head_sample": _lm_head_tasks("lm_head.sample", True),
    "norm_moe_router": _norm_moe_router_tasks, "norm_moe_experts_residual": _norm_moe_experts_residual_tasks,
}.items():
    TASK_RULES.register(_name, TaskRule(_rule))


def build_task_graph(graph: ModelGraph, config: PartitionConfig = PartitionConfig()) -> TaskGraph:
    """The model graph's tasks in node order (a topological order), linked by events; validated."""
    buffers = [Buffer(w.name, w.type, WEIGHT) for w in graph.weights]
    buffers += [Buffer(s.name, s.type, STATE) for s in graph.states]
    specs = []
    for index, node in enumerate(graph.nodes):
        buffers += [Buffer(v.name, v.type, ACTIVATION) for v in node.outputs]
        node_specs, scratch = TASK_RULES.lookup(node.op, node.loc).split(node, config)
        buffers += scratch
        specs += [(s.kind, index, node.op, s.tile, s.reads, s.writes) for s in node_specs]
    assert buffers[len(graph.weights)].name == TOKENS
    tasks, events = build_events(tuple(buffers), specs)
    return TaskGraph(graph, config, tuple(buffers), tasks, events).validate()

"""Numpy task bodies of the fused layer ops (mdsl.megakernel.fusion), attached to their registry entries
as `task_bodies` like those of task_bodies.py; the tiles are documented with the ops' rules in
partition.py. Each body computes what the GPU runtime's task of the same tile computes (runtime/plan.py
lowers these tasks to its table rows), in float32."""
from __future__ import annotations

import numpy as np

from mdsl.megakernel.epilogues import epilogue_of, evaluate, products
from mdsl.megakernel.layers import (attend, extend_layer_op, rms_normalize, rope_cos_sin, rotate_heads, sample_token,
                                    sample_uniform)
from mdsl.megakernel.partition import argmax_scratch, attention_scratch, chunked_split_range, weight_rows
from mdsl.megakernel.task_bodies import argmax_reduce, emit_token


def _cols(task) -> tuple:
    return task.tile_value("col_start"), task.tile_value("col_stop")


def _normed_input(node, buf) -> np.ndarray:
    """rms_norm of the node's first operand by its second (the fused ops' norm weight)."""
    x, norm = node.inputs[0], node.inputs[1]
    return rms_normalize(buf[x.name], buf[norm.name], node.attr_dict["eps"])


def linear_columns(row: np.ndarray, weights, buf, start: int, stop: int) -> np.ndarray:
    """Columns start..stop of row @ concat(weights).T (weights [out, in], fused along their rows)."""
    return np.concatenate([row.reshape(-1).astype(np.float32) @ buf[weights[i].name][r0:r1].T
                           for i, r0, r1, _ in weight_rows(weights, start, stop)])


def _norm_linear(task, node, buf, ctx):
    a, b = _cols(task)
    buf[node.output.name][0, a:b] = linear_columns(_normed_input(node, buf), node.inputs[2:], buf, a, b)


def _norm_gate_up(task, node, buf, ctx):
    a, b = _cols(task)
    row = _normed_input(node, buf)
    graph = epilogue_of(node.op, node.attr_dict)
    columns = {name: linear_columns(row, (w,), buf, a, b) for name, w in zip(products(graph), node.inputs[2:])}
    buf[node.output.name][0, a:b] = evaluate(graph, columns)


def _linear_residual(task, node, buf, ctx):
    a, b = _cols(task)
    x, residual, *ws = node.inputs
    graph = epilogue_of(node.op, node.attr_dict)
    (product,) = products(graph)
    buf[node.output.name][0, a:b] = evaluate(graph, {
        product: linear_columns(buf[x.name], ws, buf, a, b), "residual": buf[residual.name][0, a:b]})


def _rope_attention_partial(task, node, buf, ctx):
    a = node.attr_dict
    hq, hkv, d = a["q_heads"], a["kv_heads"], a["head_dim"]
    group = hq // hkv
    h, s = task.tile_value("kv_head"), task.tile_value("split")
    qkv, k_cache, v_cache, *norms = node.inputs
    row = buf[qkv.name][0].astype(np.float32)
    pos = ctx.position
    cos, sin = rope_cos_sin(a, pos)

    def prepare(heads: np.ndarray, norm) -> np.ndarray:   # q/k norm, then RoPE
        if norm is not None:
            heads = rms_normalize(heads, buf[norm.name], a["eps"])
        return rotate_heads(heads, cos, sin)

    q_norm, k_norm = norms if norms else (None, None)
    q = prepare(row[h * group * d:(h + 1) * group * d].reshape(group, d), q_norm)
    start, stop = chunked_split_range(pos, s, task.tile_value("splits"), task.tile_value("min_chunk"))
    if start <= pos < stop:   # this split holds the newest position: it appends the key and value
        buf[k_cache.name][pos, h] = prepare(row[(hq + h) * d:(hq + h + 1) * d].reshape(1, d), k_norm)[0]
        buf[v_cache.name][pos, h] = row[(hq + hkv + h) * d:(hq + hkv + h + 1) * d]
    part_out, part_lse = attention_scratch(node)
    heads = slice(h * group, (h + 1) * group)
    buf[part_out][s, heads], buf[part_lse][s, heads] = attend(q, buf[k_cache.name][start:stop, h],
                                                               buf[v_cache.name][start:stop, h])


def _rope_attention_combine(task, node, buf, ctx):
    head, d = task.tile_value("head"), node.attr_dict["head_dim"]
    part_out, part_lse = attention_scratch(node)
    lse = buf[part_lse][:, head]                               # [splits]; an empty split has -inf
    weight = np.exp(lse - lse.max()).astype(np.float32)
    merged = (weight[:, None] * buf[part_out][:, head]).sum(axis=0) / weight.sum()
    buf[node.output.name][0, head * d:(head + 1) * d] = merged


def _lm_head(task, node, buf, ctx):
    a, b = _cols(task)
    logits = linear_columns(_normed_input(node, buf), node.inputs[2:3], buf, a, b)
    buf[node.outputs[0].name][0, a:b] = logits
    best = int(np.argmax(logits))   # the lowest index on ties, as argmax
    values, indices = argmax_scratch(node)
    j = task.tile_value("slot")
    buf[values][j], buf[indices][j] = logits[best], a + best


def _lm_head_sample(task, node, buf, ctx):
    a = node.attr_dict
    u = sample_uniform(a["seed"], ctx.position)
    emit_token(node, buf, ctx, sample_token(buf[node.outputs[0].name], a["temperature"], a["top_p"], u))


_BODIES = {
    "norm_linear": {"norm_linear": _norm_linear}, "norm_gate_up": {"norm_gate_up": _norm_gate_up},
    "linear_residual": {"linear_residual": _linear_residual},
    "rope_attention": {"rope_attention.partial": _rope_attention_partial,
                       "rope_attention.combine": _rope_attention_combine},
    "lm_head_argmax": {"lm_head": _lm_head, "lm_head.argmax": argmax_reduce},
    "lm_head_sample": {"lm_head": _lm_head, "lm_head.sample": _lm_head_sample},
}
for _op, _bodies in _BODIES.items():
    extend_layer_op(_op, task_bodies=_bodies)

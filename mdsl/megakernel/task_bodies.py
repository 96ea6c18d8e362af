"""Numpy task bodies: what one task of each kind computes on its tile, the semantics the GPU task
bodies implement too. Attached to the layer ops' registry entries as `task_bodies` ({kind: body});
a body is `body(task, node, buffers, ctx)` and writes its outputs into `buffers` (name -> array)."""
from __future__ import annotations

import numpy as np

from mdsl.megakernel.layers import (activation, attend, extend_layer_op, rms_normalize, rope_cos_sin, rotate_heads,
                                    sample_token, sample_uniform, store_next_token)
from mdsl.megakernel.partition import argmax_scratch, attention_scratch, split_range, weight_rows


def _cols(task) -> tuple:
    return task.tile_value("col_start"), task.tile_value("col_stop")


def _embedding(task, node, buf, ctx):
    a, b = _cols(task)
    tokens, table = (buf[v.name] for v in node.inputs)
    buf[node.output.name][0, a:b] = table[int(tokens[ctx.position]), a:b]


def _rms_norm(task, node, buf, ctx):
    x, w = (buf[v.name] for v in node.inputs)
    buf[node.output.name][:] = rms_normalize(x, w, node.attr_dict["eps"])


def _linear(task, node, buf, ctx):
    a, b = _cols(task)
    x, *ws = node.inputs
    row = buf[x.name].astype(np.float32)
    out = buf[node.output.name]
    for i, r0, r1, col in weight_rows(ws, a, b):
        out[0, col:col + r1 - r0] = row[0] @ buf[ws[i].name][r0:r1].T


def _head_slices(task, node):
    a = node.attr_dict
    h, d = task.tile_value("head"), a["head_dim"]
    kind = "q" if h < a["q_heads"] else "k" if h < a["q_heads"] + a["kv_heads"] else "v"
    return kind, slice(h * d, (h + 1) * d)


def _head_rms_norm(task, node, buf, ctx):
    kind, cols = _head_slices(task, node)
    qkv, wq, wk = node.inputs
    head = buf[qkv.name][0, cols]
    if kind != "v":
        head = rms_normalize(head, buf[(wq if kind == "q" else wk).name], node.attr_dict["eps"])
    buf[node.output.name][0, cols] = head


def _rope(task, node, buf, ctx):
    kind, cols = _head_slices(task, node)
    head = buf[node.inputs[0].name][0, cols]
    if kind != "v":
        cos, sin = rope_cos_sin(node.attr_dict, ctx.position)
        head = rotate_heads(head, cos, sin)
    buf[node.output.name][0, cols] = head


def _attention_partial(task, node, buf, ctx):
    a = node.attr_dict
    hq, hkv, d = a["q_heads"], a["kv_heads"], a["head_dim"]
    group = hq // hkv
    h, s, splits = task.tile_value("kv_head"), task.tile_value("split"), task.tile_value("splits")
    qkv, k_cache, v_cache = node.inputs
    row = buf[qkv.name][0]
    q = row[h * group * d:(h + 1) * group * d].reshape(group, d)
    k_new = row[(hq + h) * d:(hq + h + 1) * d]
    v_new = row[(hq + hkv + h) * d:(hq + hkv + h + 1) * d]
    pos = ctx.position
    start, stop = split_range(pos, s, splits)
    keys = buf[k_cache.name][start:stop, h].copy()
    values = buf[v_cache.name][start:stop, h].copy()
    if stop == pos + 1:   # the split holding this step's position: its key and value are new
        keys[-1], values[-1] = k_new, v_new
    if s == splits - 1:
        buf[k_cache.name][pos, h], buf[v_cache.name][pos, h] = k_new, v_new
    part_out, part_lse = attention_scratch(node)
    heads = slice(h * group, (h + 1) * group)
    buf[part_out][s, heads], buf[part_lse][s, heads] = attend(q, keys, values)


def _attention_combine(task, node, buf, ctx):
    a = node.attr_dict
    group, d = a["q_heads"] // a["kv_heads"], a["head_dim"]
    h = task.tile_value("kv_head")
    part_out, part_lse = attention_scratch(node)
    heads = slice(h * group, (h + 1) * group)
    lse = buf[part_lse][:, heads]                     # [splits, group]
    weight = np.exp(lse - lse.max(axis=0, keepdims=True)).astype(np.float32)
    merged = (weight[:, :, None] * buf[part_out][:, heads]).sum(axis=0) / weight.sum(axis=0)[:, None]
    buf[node.output.name][0, h * group * d:(h + 1) * group * d] = merged.reshape(-1)


def _act_mul(task, node, buf, ctx):
    a, b = _cols(task)
    gu = buf[node.inputs[0].name]
    half = node.output.shape[1]
    buf[node.output.name][0, a:b] = activation(node.attr_dict["act"], gu[0, a:b]) * gu[0, half + a:half + b]


def _add(task, node, buf, ctx):
    a, b = _cols(task)
    x, y = (buf[v.name] for v in node.inputs)
    buf[node.output.name][0, a:b] = x[0, a:b] + y[0, a:b]


def _argmax_partial(task, node, buf, ctx):
    a, b = _cols(task)
    j = task.tile_value("slot")
    tile = buf[node.inputs[0].name][0, a:b]
    best = int(np.argmax(tile))
    values, indices = argmax_scratch(node)
    buf[values][j], buf[indices][j] = tile[best], a + best


def emit_token(node, buf, ctx, token: int) -> None:
    """The token into the node's last output and the token history (its state operand)."""
    buf[node.outputs[-1].name][0] = token
    store_next_token(buf[node.inputs[node.opdef.state_inputs[0]].name], token, ctx)


def argmax_reduce(task, node, buf, ctx):
    values, indices = argmax_scratch(node)
    emit_token(node, buf, ctx, int(buf[indices][int(np.argmax(buf[values]))]))


def _sample(task, node, buf, ctx):
    a = node.attr_dict
    token = sample_token(buf[node.inputs[0].name], a["temperature"], a["top_p"], sample_uniform(a["seed"], ctx.position))
    emit_token(node, buf, ctx, token)


_BODIES = {
    "embedding": {"embedding": _embedding}, "rms_norm": {"rms_norm": _rms_norm}, "linear": {"linear": _linear},
    "head_rms_norm": {"head_rms_norm": _head_rms_norm}, "rope": {"rope": _rope},
    "attention": {"attention.partial": _attention_partial, "attention.combine": _attention_combine},
    "act_mul": {"act_mul": _act_mul}, "add": {"add": _add},
    "argmax": {"argmax.partial": _argmax_partial, "argmax.reduce": argmax_reduce}, "sample": {"sample": _sample},
}
for _op, _bodies in _BODIES.items():
    extend_layer_op(_op, task_bodies=_bodies)

import mdsl.megakernel.fused_bodies  # noqa: E402,F401  (the fused ops' bodies, attached the same way)

"""Numpy task bodies: what one task of each kind computes on its tile, in float32, the semantics the GPU
task bodies implement too (the runtime's task plan lowers these tasks to its table rows). Every layer op,
fused (taskgraph.layer_fusion) or not, has its bodies in `TASK_BODIES` ({kind: body}); a body is
`body(task, node, buffers, ctx)` and writes its outputs into `buffers` (name -> array). The tiles are
documented with the ops' rules in partition.py."""
from __future__ import annotations

from typing import Mapping

import attrs
import numpy as np

from mdsl.ir.rules import RuleTable
from mdsl.megakernel.modelgraph.epilogues import epilogue_of, evaluate, products
from mdsl.megakernel.modelgraph.layers import (LAYER_OPS, ROW_FUNCTIONS, activation, attend, attention_options,
                                               expert_weights, fused_normalize, gate_up_rows, gelu_tanh, rms_normalize,
                                               rope_cos_sin, rotate_heads, route, routing_slots, sample_token,
                                               sample_uniform, scale_row, split_biases, store_next_token, window_start)
from mdsl.megakernel.taskgraph.partition import (argmax_scratch, attention_scratch, chunked_split_range,
                                                 moe_logits_scratch, moe_scratch, normed_output_scratch, split_range,
                                                 weight_rows)


def _cols(task) -> tuple:
    return task.tile_value("col_start"), task.tile_value("col_stop")


def _embedding(task, node, buf, ctx):
    a, b = _cols(task)
    tokens, table = (buf[v.name] for v in node.inputs)
    buf[node.output.name][0, a:b] = table[int(tokens[ctx.position]), a:b]


def _scaled_embedding(task, node, buf, ctx):
    a, b = _cols(task)
    tokens, table = (buf[v.name] for v in node.inputs)
    buf[node.output.name][0, a:b] = scale_row(table[int(tokens[ctx.position]), a:b], node.attr_dict)


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


def _add_bias(task, node, buf, ctx):
    a, b = _cols(task)
    x, *bs = node.inputs
    out = buf[node.output.name]
    for i, r0, r1, col in weight_rows(bs, a, b):
        out[0, col:col + r1 - r0] = buf[x.name][0, col:col + r1 - r0] + buf[bs[i].name][r0:r1]


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
    lo = window_start(a, pos)
    start, stop = (lo + p for p in split_range(pos - lo, s, splits))
    keys = buf[k_cache.name][start:stop, h].copy()
    values = buf[v_cache.name][start:stop, h].copy()
    if stop == pos + 1:   # the split holding this step's position: its key and value are new
        keys[-1], values[-1] = k_new, v_new
    if s == splits - 1:
        buf[k_cache.name][pos, h], buf[v_cache.name][pos, h] = k_new, v_new
    part_out, part_lse = attention_scratch(node)
    heads = slice(h * group, (h + 1) * group)
    buf[part_out][s, heads], buf[part_lse][s, heads] = attend(q, keys, values, **attention_options(a))


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


def _geglu(task, node, buf, ctx):
    a, b = _cols(task)
    gu = buf[node.inputs[0].name]
    half = node.output.shape[1]
    buf[node.output.name][0, a:b] = gelu_tanh(gu[0, a:b]) * gu[0, half + a:half + b]


def _elementwise(task, node, buf, ctx):
    a, b = _cols(task)
    buf[node.output.name][0, a:b] = ROW_FUNCTIONS[node.op](buf[node.inputs[0].name][0, a:b], node.attr_dict)


def _gated_scale(task, node, buf, ctx):
    a, b = _cols(task)
    x, gate = node.inputs
    buf[node.output.name][0, a:b] = node.opdef.reference([buf[x.name][:, a:b], buf[gate.name]], node.attr_dict, ctx)[0]


def _by_reference(task, node, buf, ctx):
    """A one-task op: its reference on the whole operands."""
    outs = node.opdef.reference([buf[v.name] for v in node.inputs], node.attr_dict, ctx)
    for v, out in zip(node.outputs, outs):
        buf[v.name][:] = out


def _picked(node, buf) -> np.ndarray:
    return buf[node.inputs[1].name].reshape(-1)


def _moe_up(task, node, buf, ctx):
    e = task.tile_value("expert")
    if _picked(node, buf)[e] == 0:     # not picked: none of its weights is read
        return
    a, b = _cols(task)
    x, routing, *ws = node.inputs
    gates, ups, _ = expert_weights(ws, routing.shape[1])
    row = buf[x.name].reshape(-1).astype(np.float32)
    buf[moe_scratch(node)][e, a:b] = activation(node.attr_dict["act"], row @ buf[gates[e].name][a:b].T) * \
        (row @ buf[ups[e].name][a:b].T)


def _moe_down(task, node, buf, ctx):
    a, b = _cols(task)
    routing = _picked(node, buf)
    _, _, downs = expert_weights(node.inputs[2:], routing.size)
    out = np.zeros(b - a, np.float32)
    for e in np.flatnonzero(routing):
        out += routing[e] * (buf[moe_scratch(node)][e] @ buf[downs[e].name][a:b].T)
    buf[node.output.name][0, a:b] = out


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


# the fused layer ops
def _normed_input(node, buf) -> np.ndarray:
    """rms_norm of the node's first operand by its second (the fused ops' norm weight, or 1 + it: unit_offset)."""
    x, norm = node.inputs[0], node.inputs[1]
    return fused_normalize(buf[x.name], buf[norm.name], node.attr_dict)


def linear_columns(row: np.ndarray, weights, buf, start: int, stop: int) -> np.ndarray:
    """Columns start..stop of row @ concat(weights).T (weights [out, in], fused along their rows)."""
    return np.concatenate([row.reshape(-1).astype(np.float32) @ buf[weights[i].name][r0:r1].T
                           for i, r0, r1, _ in weight_rows(weights, start, stop)])


def _norm_linear(task, node, buf, ctx):
    a, b = _cols(task)
    buf[node.output.name][0, a:b] = linear_columns(_normed_input(node, buf), node.inputs[2:], buf, a, b)


def _norm_linear_bias(task, node, buf, ctx):
    a, b = _cols(task)
    ws, bs = split_biases(node.inputs[2:])
    graph = epilogue_of(node.op, node.attr_dict)
    (product,) = products(graph)
    bias = np.concatenate([buf[bs[i].name][r0:r1] for i, r0, r1, _ in weight_rows(bs, a, b)])
    buf[node.output.name][0, a:b] = evaluate(graph, {product: linear_columns(_normed_input(node, buf), ws, buf, a, b),
                                                     "bias": bias})


def _norm_gate_up(task, node, buf, ctx):
    a, b = _cols(task)
    row = _normed_input(node, buf)
    graph = epilogue_of(node.op, node.attr_dict)
    columns = {name: row.reshape(-1).astype(np.float32) @ buf[w.name][r0:r1].T
               for name, (w, r0, r1) in zip(products(graph), gate_up_rows(node.inputs[2:], a, b))}
    buf[node.output.name][0, a:b] = evaluate(graph, columns)


def _linear_residual(task, node, buf, ctx):
    a, b = _cols(task)
    x, residual, *ws = node.inputs
    graph = epilogue_of(node.op, node.attr_dict)
    (product,) = products(graph)
    buf[node.output.name][0, a:b] = evaluate(graph, {
        product: linear_columns(buf[x.name], ws, buf, a, b), "residual": buf[residual.name][0, a:b]})


def _linear_add_residual(task, node, buf, ctx):
    a, b = _cols(task)
    x, addend, residual, *ws = node.inputs
    graph = epilogue_of(node.op, node.attr_dict)
    (product,) = products(graph)
    buf[node.output.name][0, a:b] = evaluate(graph, {
        product: linear_columns(buf[x.name], ws, buf, a, b), "addend": buf[addend.name][0, a:b],
        "residual": buf[residual.name][0, a:b]})


def _linear_norm_residual(task, node, buf, ctx):
    a, b = _cols(task)
    x, _, _, *ws = node.inputs
    buf[normed_output_scratch(node)][0, a:b] = linear_columns(buf[x.name], ws, buf, a, b)


def _linear_norm_residual_norm(task, node, buf, ctx):
    _, residual, norm, *_ = node.inputs
    normed = fused_normalize(buf[normed_output_scratch(node)], buf[norm.name], node.attr_dict)
    buf[node.output.name][:] = buf[residual.name] + normed


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
    lo = window_start(a, pos)
    start, stop = (lo + p for p in chunked_split_range(pos - lo, s, task.tile_value("splits"),
                                                       task.tile_value("min_chunk")))
    if start <= pos < stop:   # this split holds the newest position: it appends the key and value
        buf[k_cache.name][pos, h] = prepare(row[(hq + h) * d:(hq + h + 1) * d].reshape(1, d), k_norm)[0]
        buf[v_cache.name][pos, h] = row[(hq + hkv + h) * d:(hq + hkv + h + 1) * d]
    part_out, part_lse = attention_scratch(node)
    heads = slice(h * group, (h + 1) * group)
    buf[part_out][s, heads], buf[part_lse][s, heads] = attend(q, buf[k_cache.name][start:stop, h],
                                                               buf[v_cache.name][start:stop, h], **attention_options(a))


def _rope_attention_combine(task, node, buf, ctx):
    head, d = task.tile_value("head"), node.attr_dict["head_dim"]
    part_out, part_lse = attention_scratch(node)
    lse = buf[part_lse][:, head]                               # [splits]; an empty split has -inf
    weight = np.exp(lse - lse.max()).astype(np.float32)
    merged = (weight[:, None] * buf[part_out][:, head]).sum(axis=0) / weight.sum()
    buf[node.output.name][0, head * d:(head + 1) * d] = merged


def _lm_head(task, node, buf, ctx):
    a, b = _cols(task)
    graph = epilogue_of(node.op, node.attr_dict)   # (the product, or its soft-cap)
    (product,) = products(graph)
    logits = evaluate(graph, {product: linear_columns(_normed_input(node, buf), node.inputs[2:3], buf, a, b)})
    buf[node.outputs[0].name][0, a:b] = logits
    best = int(np.argmax(logits))   # the lowest index on ties, as argmax
    values, indices = argmax_scratch(node)
    j = task.tile_value("slot")
    buf[values][j], buf[indices][j] = logits[best], a + best


def _lm_head_sample(task, node, buf, ctx):
    a = node.attr_dict
    u = sample_uniform(a["seed"], ctx.position)
    emit_token(node, buf, ctx, sample_token(buf[node.outputs[0].name], a["temperature"], a["top_p"], u))


def _moe_router_logits(task, node, buf, ctx):
    a, b = _cols(task)
    buf[moe_logits_scratch(node)][0, a:b] = linear_columns(_normed_input(node, buf), node.inputs[2:3], buf, a, b)


def _moe_router_route(task, node, buf, ctx):
    a = node.attr_dict
    buf[node.output.name][:] = route(buf[moe_logits_scratch(node)], a["top_k"], a["norm_topk_prob"])


def _slot_expert(task, node, buf):
    """The expert of the task's slot (routing_slots' order), or None where the routing row picks fewer."""
    slots = routing_slots(buf[node.inputs[2].name])
    j = task.tile_value("slot")
    return int(slots[j]) if j < len(slots) else None


def _moe_expert_up(task, node, buf, ctx):
    e = _slot_expert(task, node, buf)
    if e is None:
        return
    a, b = _cols(task)
    gates, ups, _ = expert_weights(node.inputs[4:], node.inputs[2].shape[1])
    row = _normed_input(node, buf).reshape(-1).astype(np.float32)
    graph = epilogue_of(node.op, node.attr_dict)
    gate, up = products(graph)
    buf[moe_scratch(node)][task.tile_value("slot"), a:b] = evaluate(
        graph, {gate: row @ buf[gates[e].name][a:b].T, up: row @ buf[ups[e].name][a:b].T})


def _moe_expert_down(task, node, buf, ctx):
    a, b = _cols(task)
    routing = buf[node.inputs[2].name].reshape(-1)
    _, _, downs = expert_weights(node.inputs[4:], routing.size)
    out = np.zeros(b - a, np.float32)
    for j, e in enumerate(routing_slots(routing)):
        out += routing[e] * (buf[moe_scratch(node)][j] @ buf[downs[e].name][a:b].T)
    buf[node.output.name][0, a:b] = buf[node.inputs[3].name][0, a:b] + out


@attrs.frozen
class TaskBodies:
    """A layer op's task bodies: `bodies[kind]` computes one task of that kind."""

    bodies: Mapping


#: every layer op has them (the CPU simulators run any graph)
TASK_BODIES: RuleTable[TaskBodies] = RuleTable("task bodies (numpy)", TaskBodies,
                                               "mdsl.megakernel.taskgraph.numpy_bodies (TASK_BODIES)",
                                               registry=LAYER_OPS, needs=lambda op: True)
for _op, _bodies in {
    "embedding": {"embedding": _embedding}, "rms_norm": {"rms_norm": _rms_norm}, "linear": {"linear": _linear},
    "add_bias": {"add_bias": _add_bias}, "head_rms_norm": {"head_rms_norm": _head_rms_norm}, "rope": {"rope": _rope},
    "attention": {"attention.partial": _attention_partial, "attention.combine": _attention_combine},
    "act_mul": {"act_mul": _act_mul}, "add": {"add": _add}, "rms_norm_1p": {"rms_norm_1p": _by_reference},
    "moe_router": {"moe_router": _by_reference}, "moe_experts": {"moe.up": _moe_up, "moe.down": _moe_down},
    "gated_scale": {"gated_scale": _gated_scale},
    "geglu": {"geglu": _geglu}, "scale": {"scale": _elementwise}, "softcap": {"softcap": _elementwise},
    "argmax": {"argmax.partial": _argmax_partial, "argmax.reduce": argmax_reduce}, "sample": {"sample": _sample},
    "norm_linear": {"norm_linear": _norm_linear}, "norm_linear_bias": {"norm_linear_bias": _norm_linear_bias},
    "norm_gate_up": {"norm_gate_up": _norm_gate_up}, "norm_geglu": {"norm_geglu": _norm_gate_up},
    "linear_norm_residual": {"linear_norm_residual": _linear_norm_residual,
                             "linear_norm_residual.norm": _linear_norm_residual_norm},
    "scaled_embedding": {"scaled_embedding": _scaled_embedding}, "norm_1p_linear": {"norm_linear": _norm_linear},
    "lm_head_1p_argmax": {"lm_head": _lm_head, "lm_head.argmax": argmax_reduce},
    "lm_head_1p_sample": {"lm_head": _lm_head, "lm_head.sample": _lm_head_sample},
    "linear_residual": {"linear_residual": _linear_residual},
    "linear_add_residual": {"linear_add_residual": _linear_add_residual},
    "rope_attention": {"rope_attention.partial": _rope_attention_partial,
                       "rope_attention.combine": _rope_attention_combine},
    "scaled_attention": {"attention.partial": _attention_partial, "attention.combine": _attention_combine},
    "rope_scaled_attention": {"rope_attention.partial": _rope_attention_partial,
                              "rope_attention.combine": _rope_attention_combine},
    "lm_head_argmax": {"lm_head": _lm_head, "lm_head.argmax": argmax_reduce},
    "lm_head_sample": {"lm_head": _lm_head, "lm_head.sample": _lm_head_sample},
    "norm_moe_router": {"moe_router.logits": _moe_router_logits, "moe_router.route": _moe_router_route},
    "norm_moe_experts_residual": {"moe.expert_up": _moe_expert_up, "moe.expert_down": _moe_expert_down},
}.items():
    TASK_BODIES.register(_op, TaskBodies(_bodies))

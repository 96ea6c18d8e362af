"""The layer-op registry of model graphs: one entry per layer op, holding its attributes, its shape
rule and its numpy reference semantics. What a later layer does with an op is that layer's rule, in its
own table over this registry (`mdsl.ir.rules.RuleTable`, as for `mdsl.ir.ops`): the task graph's
`partition.TASK_RULES` and `numpy_bodies.TASK_BODIES`, the fusion pass's, the runtime's, the tensor-parallel
split's.

A decode step works on one token: activations are rows `f32[1, N]`, computed in float32 whatever the
weights' dtype. The current position is not a tensor but the step's `StepContext`. Ops may update
model state in place (`state_inputs`): attention appends to the KV cache, argmax/sample write the next
token into the token history that the next step's embedding reads.
"""
from __future__ import annotations

import math
from typing import Optional

import attrs
import numpy as np

from mdsl.errors import DTypeError, ShapeError, UnsupportedError, ValidationError
from mdsl.ir.dtypes import DType, f32, i32, round_to_dtype
from mdsl.ir.ops import AttrSpec, OpDef, get_op
from mdsl.ir.types import TensorType


@attrs.frozen
class StepContext:
    """What a step knows besides tensors: the position of its token, the prompt's length (the token after
    a prompt position is the prompt's own, never the sampled one), the dtype whose values the KV caches
    hold (keys and values are rounded to it as they are appended: float32, unrounded, by default, or the
    checkpoint's dtype, as transformers' cache and the serving engine's pools hold them), and the dtype a
    linear's input row is rounded to before its product (float32, unrounded, by default, or a 16-bit
    checkpoint's dtype: the serving engine's tensor cores take 16-bit operands, as transformers' model in
    that dtype holds its activations)."""

    position: int
    prompt_length: int = 1
    kv_dtype: DType = attrs.field(default=f32, kw_only=True)
    operand_dtype: DType = attrs.field(default=f32, kw_only=True)


@attrs.frozen(eq=False)
class LayerOpDef(OpDef):
    """An `OpDef` at the model level; `reference` takes (arrays, attrs dict, StepContext)."""

    category: str = "layer"
    levels: frozenset = frozenset({"model"})
    state_inputs: tuple = ()    # indices of inputs that the op updates in place


LAYER_OPS: dict[str, LayerOpDef] = {}


def register_layer_op(op: LayerOpDef) -> LayerOpDef:
    if op.name in LAYER_OPS:
        raise ValueError(f"layer op {op.name} registered twice")
    LAYER_OPS[op.name] = op
    return op


def get_layer_op(name: str) -> LayerOpDef:
    op = LAYER_OPS.get(name)
    if op is None:
        raise UnsupportedError(f"unknown layer op {name!r}", hint=f"known layer ops: {', '.join(sorted(LAYER_OPS))}")
    return op


# ---------------------------------------------------------------------------------------------
# shape helpers

def _row(n: int) -> TensorType:
    return TensorType((1, n), f32)


def _require_row(op: str, t: TensorType, what: str, width: Optional[int] = None) -> int:
    if t.rank != 2 or t.shape[0] != 1:
        raise ShapeError(f"{op}: {what} must be one row [1, N], got {t}")
    if width is not None and t.shape[1] != width:
        raise ShapeError(f"{op}: {what} must be [1, {width}], got {t}")
    return t.shape[1]


def _require_shape(op: str, t: TensorType, what: str, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ShapeError(f"{op}: {what} must have shape {list(shape)}, got {t}")


def _require_float(op: str, t: TensorType, what: str) -> None:
    if not t.dtype.is_float:
        raise DTypeError(f"{op}: {what} must be a floating-point tensor, got {t}")


def qkv_width(a: dict) -> int:
    return (a["q_heads"] + 2 * a["kv_heads"]) * a["head_dim"]


def _check_heads(op: str, a: dict) -> None:
    if a["q_heads"] % a["kv_heads"]:
        raise ShapeError(f"{op}: {a['q_heads']} query heads do not split into groups over {a['kv_heads']} KV heads")


_HEADS = (AttrSpec("q_heads", "int"), AttrSpec("kv_heads", "int"), AttrSpec("head_dim", "int"))


# ---------------------------------------------------------------------------------------------
# embedding: the row of the table for the token at the current position

def _embedding_infer(types, a):
    tokens, table = types
    if tokens.dtype is not i32 or tokens.rank != 1:
        raise DTypeError(f"embedding: the token history must be i32[max_positions], got {tokens}")
    if table.rank != 2:
        raise ShapeError(f"embedding: the table must be [vocab, hidden], got {table}")
    return (_row(table.shape[1]),)


def _embedding_ref(xs, a, ctx):
    tokens, table = xs
    return [np.asarray(table[int(tokens[ctx.position])], np.float32)[None, :]]


# rms_norm over the row, scaled by a weight

def _rms_norm_infer(types, a):
    x, w = types
    n = _require_row("rms_norm", x, "the input")
    _require_shape("rms_norm", w, "the weight", (n,))
    return (_row(n),)


def rms_normalize(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32)
    inv = np.float32(1.0) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))
    return (x * inv * w.astype(np.float32)).astype(np.float32)


def _rms_norm_ref(xs, a, ctx):
    return [rms_normalize(xs[0], xs[1], a["eps"])]


# linear: y = x @ concat(weights).T with weights [out, in] (Hugging Face layout); several weights make a
# fused projection (q|k|v, gate|up)

def _linear_infer(types, a):
    x, *ws = types
    if not ws:
        raise ShapeError("linear takes an input and at least one weight")
    k = _require_row("linear", x, "the input")
    for i, w in enumerate(ws):
        _require_float("linear", w, f"weight {i}")
        if w.rank != 2 or w.shape[1] != k:
            raise ShapeError(f"linear: weight {i} must be [out, {k}] for an input of width {k}, got {w}")
    return (_row(sum(w.shape[0] for w in ws)),)


def _linear_ref(xs, a, ctx):
    x, *ws = xs
    x = operand(x.astype(np.float32), ctx.operand_dtype)
    return [np.concatenate([x @ w.astype(np.float32).T for w in ws], axis=1)]


# add_bias: a projection's biases added to its output row, one bias vector per weight of the (fused)
# projection, concatenated as its weights are (Qwen2's q|k|v biases)

def _add_bias_infer(types, a):
    x, *bs = types
    if not bs:
        raise ShapeError("add_bias takes a row and at least one bias vector")
    n = _require_row("add_bias", x, "the input")
    for i, b in enumerate(bs):
        _require_float("add_bias", b, f"bias {i}")
        if b.rank != 1:
            raise ShapeError(f"add_bias: bias {i} must be a vector [N], got {b}")
    width = sum(b.shape[0] for b in bs)
    if width != n:
        raise ShapeError(f"add_bias: the biases cover {width} columns of a row of {n}")
    return (_row(n),)


def _add_bias_ref(xs, a, ctx):
    x, *bs = xs
    return [(x.astype(np.float32) + np.concatenate([b.astype(np.float32) for b in bs])[None, :]).astype(np.float32)]


# head_rms_norm: Qwen3's q/k norm, an rms_norm over each query and key head of the fused q|k|v row
# (value heads pass through)

def _head_rms_norm_infer(types, a):
    qkv, wq, wk = types
    _check_heads("head_rms_norm", a)
    _require_row("head_rms_norm", qkv, "the q|k|v row", qkv_width(a))
    _require_shape("head_rms_norm", wq, "the query norm weight", (a["head_dim"],))
    _require_shape("head_rms_norm", wk, "the key norm weight", (a["head_dim"],))
    return (qkv,)


def split_heads(row: np.ndarray, a: dict):
    """The fused q|k|v row as (q [Hq, D], k [Hkv, D], v [Hkv, D]) views."""
    hq, hkv, d = a["q_heads"], a["kv_heads"], a["head_dim"]
    flat = row.reshape(-1)
    return (flat[:hq * d].reshape(hq, d), flat[hq * d:(hq + hkv) * d].reshape(hkv, d),
            flat[(hq + hkv) * d:].reshape(hkv, d))


def _head_rms_norm_ref(xs, a, ctx):
    out = xs[0].astype(np.float32).copy()
    q, k, _ = split_heads(out, a)
    q[:] = rms_normalize(q, xs[1], a["eps"])
    k[:] = rms_normalize(k, xs[2], a["eps"])
    return [out]


# rope: rotary position embedding of the query and key heads (rotate-half form), plain theta or
# Llama-3's frequency scaling (scaling_factor != 1 with low/high frequency factors)

_ROPE_ATTRS = (AttrSpec("theta", "float"), AttrSpec("scaling_factor", "float", 1.0),
               AttrSpec("low_freq_factor", "float", 1.0), AttrSpec("high_freq_factor", "float", 4.0),
               AttrSpec("original_max_position", "int", 0))


def _rope_infer(types, a):
    _check_heads("rope", a)
    if a["head_dim"] % 2:
        raise ShapeError(f"rope: head_dim must be even, got {a['head_dim']}")
    _require_row("rope", types[0], "the q|k|v row", qkv_width(a))
    return (types[0],)


def rope_inv_freq(a: dict) -> np.ndarray:
    """Inverse frequencies in float32, as transformers computes them (rope_type default or llama3)."""
    d = a["head_dim"]
    inv = (1.0 / (a["theta"] ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))).astype(np.float32)
    if a["original_max_position"] <= 0:
        return inv
    factor, low, high = a["scaling_factor"], a["low_freq_factor"], a["high_freq_factor"]
    old_len = a["original_max_position"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(a: dict, position: int):
    freqs = rope_inv_freq(a) * np.float32(position)
    emb = np.concatenate([freqs, freqs]).astype(np.float32)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def rotate_heads(heads: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = heads.shape[-1] // 2
    rotated = np.concatenate([-heads[..., half:], heads[..., :half]], axis=-1)
    return (heads * cos + rotated * sin).astype(np.float32)


def _rope_ref(xs, a, ctx):
    out = xs[0].astype(np.float32).copy()
    q, k, _ = split_heads(out, a)
    cos, sin = rope_cos_sin(a, ctx.position)
    q[:] = rotate_heads(q, cos, sin)
    k[:] = rotate_heads(k, cos, sin)
    return [out]


# attention over the KV cache: append this position's key and value, then causal softmax attention of
# every query head over positions 0..position of its KV head (grouped query heads)

def _attention_infer(types, a):
    qkv, k_cache, v_cache = types
    _check_heads("attention", a)
    _require_row("attention", qkv, "the q|k|v row", qkv_width(a))
    for what, c in (("key cache", k_cache), ("value cache", v_cache)):
        if c.rank != 3 or c.shape[1:] != (a["kv_heads"], a["head_dim"]):
            raise ShapeError(f"attention: the {what} must be [max_positions, {a['kv_heads']}, {a['head_dim']}], got {c}")
    return (_row(a["q_heads"] * a["head_dim"]),)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float = 0.0, softcap: float = 0.0):
    """Softmax attention of q [G, D] over keys/values [T, D]: (output [G, D], log-sum-exp [G]); an empty
    range gives zeros and -inf (a weight of zero in the combine). Scores are scaled by `scale` (0:
    1/sqrt(D)) and, with `softcap` > 0, soft-capped to softcap * tanh(score / softcap) (Gemma-2)."""
    g, d = q.shape
    if keys.shape[0] == 0:
        return np.zeros((g, d), np.float32), np.full(g, -np.inf, np.float32)
    scores = (q.astype(np.float32) @ keys.astype(np.float32).T) * np.float32(scale or 1.0 / math.sqrt(d))
    if softcap:
        scores = (np.tanh(scores / np.float32(softcap)) * np.float32(softcap)).astype(np.float32)
    top = scores.max(axis=1, keepdims=True)
    p = np.exp(scores - top)
    total = p.sum(axis=1, keepdims=True)
    out = (p @ values.astype(np.float32)) / total
    return out.astype(np.float32), (top + np.log(total)).reshape(g).astype(np.float32)


def cached(x: np.ndarray, kv_dtype: DType) -> np.ndarray:
    """Float32 keys or values as a KV cache of kv_dtype values holds them: rounded to it (to nearest, ties
    to even, as torch's and CUDA's conversions round)."""
    return x if kv_dtype is f32 else round_to_dtype(x, kv_dtype)


def operand(x: np.ndarray, dtype: DType) -> np.ndarray:
    """A linear's float32 input as its product reads it with operands of `dtype`: rounded to it (to nearest,
    ties to even), or unchanged for float32."""
    return x if dtype is f32 else round_to_dtype(x, dtype)


def _attention_ref(xs, a, ctx):
    qkv, k_cache, v_cache = xs
    q, k, v = split_heads(qkv.astype(np.float32), a)
    pos = ctx.position
    k_cache[pos], v_cache[pos] = cached(k, ctx.kv_dtype), cached(v, ctx.kv_dtype)
    group = a["q_heads"] // a["kv_heads"]
    out = np.empty_like(q)
    for h in range(a["kv_heads"]):
        rows = slice(h * group, (h + 1) * group)
        out[rows], _ = attend(q[rows], k_cache[:pos + 1, h], v_cache[:pos + 1, h])
    return [out.reshape(1, -1)]


# scaled_attention: attention over the last `window` positions only (Mistral's sliding window; 0: every
# position), scores scaled by `scale` (0: 1/sqrt(head_dim); Gemma-2's query_pre_attn_scalar^-0.5) and
# soft-capped by `softcap` (0: none; Gemma-2's attn_logit_softcapping)

_ATTENTION_OPTIONS = (AttrSpec("window", "int", 0), AttrSpec("scale", "float", 0.0, minimum=0.0),
                      AttrSpec("softcap", "float", 0.0, minimum=0.0))


def _scaled_attention_infer(types, a):
    if a["window"] < 0:
        raise ShapeError(f"scaled_attention: window must be >= 0 (0: every position), got {a['window']}")
    return _attention_infer(types, a)


def window_start(a: dict, position: int) -> int:
    """The first position attention at `position` reads: position - window + 1 (0 without a window)."""
    window = a.get("window", 0)
    return max(0, position - window + 1) if window else 0


def attention_options(a: dict) -> dict:
    """`attend`'s scale and softcap of an attention op's attributes (the defaults for plain attention)."""
    return {"scale": a.get("scale", 0.0), "softcap": a.get("softcap", 0.0)}


def _scaled_attention_ref(xs, a, ctx):
    qkv, k_cache, v_cache = xs
    q, k, v = split_heads(qkv.astype(np.float32), a)
    pos = ctx.position
    k_cache[pos], v_cache[pos] = cached(k, ctx.kv_dtype), cached(v, ctx.kv_dtype)
    group, lo = a["q_heads"] // a["kv_heads"], window_start(a, pos)
    out = np.empty_like(q)
    for h in range(a["kv_heads"]):
        rows = slice(h * group, (h + 1) * group)
        out[rows], _ = attend(q[rows], k_cache[lo:pos + 1, h], v_cache[lo:pos + 1, h], **attention_options(a))
    return [out.reshape(1, -1)]


# act_mul: a gated MLP's act(gate) * up over the fused gate|up row (SwiGLU: act = silu); `act` names an
# element-wise operator of mdsl.ir.ops, whose reference computes it here

def _act_mul_infer(types, a):
    n = _require_row("act_mul", types[0], "the gate|up row")
    if n % 2:
        raise ShapeError(f"act_mul: the gate|up row must have an even width, got {types[0]}")
    return (_row(n // 2),)


def activation(name: str, x: np.ndarray) -> np.ndarray:
    """The element-wise operator `name` (mdsl.ir.ops) on x, in float32."""
    (y,) = get_op(name).reference([np.asarray(x, np.float32)], {})
    return np.asarray(y, np.float32)


def _act_mul_ref(xs, a, ctx):
    gu = xs[0].astype(np.float32)
    half = gu.shape[1] // 2
    return [activation(a["act"], gu[:, :half]) * gu[:, half:]]


# add: the residual connection

def _add_infer(types, a):
    x, y = types
    n = _require_row("add", x, "the first operand")
    _require_row("add", y, "the second operand", n)
    return (_row(n),)


def _add_ref(xs, a, ctx):
    return [(xs[0].astype(np.float32) + xs[1].astype(np.float32)).astype(np.float32)]


# Gemma-2's ops: rms_norm_1p (its norm scales by 1 + weight), geglu (its MLP's tanh-approximate GELU gate), and
# two element-wise ops of a row: scale (its embeddings times sqrt(hidden)) and softcap (its final logits capped)

def _rms_norm_1p_ref(xs, a, ctx):
    x, w = xs
    return [rms_normalize(x, np.float32(1.0) + w.astype(np.float32), a["eps"])]


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (transformers' gelu_pytorch_tanh), in float32."""
    x = np.asarray(x, np.float32)
    inner = np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * x * x * x)
    return (np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))).astype(np.float32)


def _geglu_ref(xs, a, ctx):
    gu = xs[0].astype(np.float32)
    half = gu.shape[1] // 2
    return [(gelu_tanh(gu[:, :half]) * gu[:, half:]).astype(np.float32)]


def _row_infer(name: str):
    def infer(types, a):
        return (_row(_require_row(name, types[0], "the input")),)

    return infer


def scale_row(x: np.ndarray, a: dict) -> np.ndarray:
    return (x.astype(np.float32) * np.float32(a["factor"])).astype(np.float32)


def softcap_row(x: np.ndarray, a: dict) -> np.ndarray:
    cap = np.float32(a["cap"])
    return (np.tanh(x.astype(np.float32) / cap) * cap).astype(np.float32)


#: the element-wise ops of a row: op -> its function of (row, attrs)
ROW_FUNCTIONS = {"scale": scale_row, "softcap": softcap_row}


# a sparse mixture of experts (Qwen3-MoE): moe_router picks the top_k of E experts for the row (softmax over
# the router's logits, the top_k probabilities renormalised with norm_topk_prob) as a routing row [1, E], zero
# for the experts not picked; moe_experts sums routing[e] * down_e(act(gate_e x) * up_e x) over the picked
# experts only (operands: x, the routing row, then E gate, E up and E down weights)

def _moe_router_infer(types, a):
    x, router = types
    h = _require_row("moe_router", x, "the input")
    if router.rank != 2 or router.shape[1] != h:
        raise ShapeError(f"moe_router: the router weight must be [experts, {h}], got {router}")
    if not 1 <= a["top_k"] <= router.shape[0]:
        raise ShapeError(f"moe_router: top_k must be 1..{router.shape[0]} (the experts), got {a['top_k']}")
    return (_row(router.shape[0]),)


def route(logits: np.ndarray, top_k: int, norm_topk_prob: bool) -> np.ndarray:
    """The routing row of the router's logits [E]: softmax, the top_k largest (the lower index on ties),
    renormalised to sum to 1 with norm_topk_prob; zero elsewhere."""
    z = logits.reshape(-1).astype(np.float32)
    p = np.exp(z - z.max())
    p = (p / p.sum()).astype(np.float32)
    picked = np.argsort(-p, kind="stable")[:top_k]
    out = np.zeros_like(p)
    out[picked] = p[picked] / p[picked].sum() if norm_topk_prob else p[picked]
    return out[None, :].astype(np.float32)


def _operand_dtype(ctx) -> DType:
    """The dtype a product's input is rounded to (StepContext.operand_dtype; float32 without a step)."""
    return ctx.operand_dtype if ctx is not None else f32


def _moe_router_ref(xs, a, ctx):
    x, router = xs
    x = operand(x.astype(np.float32), _operand_dtype(ctx))
    return [route(x @ router.astype(np.float32).T, a["top_k"], a["norm_topk_prob"])]


def expert_weights(weights, experts: int) -> tuple:
    """moe_experts' weight operands as (gates, ups, downs), E of each."""
    return weights[:experts], weights[experts:2 * experts], weights[2 * experts:]


def _moe_experts_infer(types, a):
    x, routing, *ws = types
    h = _require_row("moe_experts", x, "the input")
    experts = _require_row("moe_experts", routing, "the routing row")
    if len(ws) != 3 * experts:
        raise ShapeError(f"moe_experts: {experts} experts need {3 * experts} weights (gates, ups, downs), got {len(ws)}")
    gates, ups, downs = expert_weights(ws, experts)
    inter = gates[0].shape[0] if gates[0].rank == 2 else -1
    for what, group, shape in (("gate", gates, (inter, h)), ("up", ups, (inter, h)), ("down", downs, (h, inter))):
        for e, w in enumerate(group):
            _require_float("moe_experts", w, f"expert {e}'s {what} weight")
            _require_shape("moe_experts", w, f"expert {e}'s {what} weight", shape)
    return (_row(h),)


def expert_output(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, act: str,
                  operand_dtype: DType = f32) -> np.ndarray:
    """One expert's gated MLP of the row x, each product's input rounded to `operand_dtype` as a linear's."""
    x = operand(x.reshape(-1).astype(np.float32), operand_dtype)
    hidden = activation(act, x @ gate.astype(np.float32).T) * (x @ up.astype(np.float32).T)
    return (operand(hidden.astype(np.float32), operand_dtype) @ down.astype(np.float32).T).astype(np.float32)


def _moe_experts_ref(xs, a, ctx):
    x, routing, *ws = xs
    gates, ups, downs = expert_weights(ws, routing.shape[1])
    out = np.zeros(x.shape[1], np.float32)
    for e in np.flatnonzero(routing.reshape(-1)):
        out += routing[0, e] * expert_output(x, gates[e], ups[e], downs[e], a["act"], _operand_dtype(ctx))
    return [out[None, :]]


# ... fused (mdsl.megakernel.taskgraph.layer_fusion): norm_moe_router, the router of a normalised row;
# norm_moe_experts_residual, residual + moe_experts(rms_norm(x), routing), the residual add in its epilogue

def _norm_moe_router_infer(types, a):
    x, norm, router = types
    (row,) = _rms_norm_infer((x, norm), a)
    return _moe_router_infer((row, router), a)


def _norm_moe_router_ref(xs, a, ctx):
    x, norm, router = xs
    return _moe_router_ref([rms_normalize(x, norm, a["eps"]), router], a, ctx)


def _norm_moe_experts_residual_infer(types, a):
    x, norm, routing, residual, *ws = types
    if not 1 <= a["top_k"] <= routing.shape[-1]:
        raise ShapeError(f"norm_moe_experts_residual: top_k must be 1..{routing.shape[-1]} (the experts), "
                         f"got {a['top_k']}")
    (row,) = _rms_norm_infer((x, norm), a)
    (out,) = _moe_experts_infer((row, routing, *ws), a)
    return _add_infer((residual, out), a)


def _norm_moe_experts_residual_ref(xs, a, ctx):
    x, norm, routing, residual, *ws = xs
    (out,) = _moe_experts_ref([rms_normalize(x, norm, a["eps"]), routing, *ws], a, ctx)
    return _add_ref([residual, out], a, ctx)


def routing_slots(routing: np.ndarray) -> np.ndarray:
    """The experts a routing row picks, in the router's top-k order (the larger weight first, the lower index on
    ties): slot j of the fused experts' tasks is the j-th of them."""
    row = routing.reshape(-1)
    picked = np.flatnonzero(row)
    return picked[np.argsort(-row[picked], kind="stable")]


# gated_scale: a row times an element-wise operator of a one-value row (Qwen2-MoE's shared expert's output times
# sigmoid of its gate projection)

def _gated_scale_infer(types, a):
    x, gate = types
    n = _require_row("gated_scale", x, "the row")
    _require_row("gated_scale", gate, "the gate", 1)
    return (_row(n),)


def _gated_scale_ref(xs, a, ctx):
    x, gate = (v.astype(np.float32) for v in xs)
    return [(activation(a["act"], gate) * x).astype(np.float32)]


# argmax and sample: the next token, also written into the token history after the current position
# (unless that position still holds a prompt token)

def _token_infer(name: str):
    def infer(types, a):
        logits, tokens = types
        _require_row(name, logits, "the logits")
        if tokens.dtype is not i32 or tokens.rank != 1:
            raise DTypeError(f"{name}: the token history must be i32[max_positions], got {tokens}")
        if name == "sample" and not (a["temperature"] > 0 and 0 < a["top_p"] <= 1):
            raise ValidationError(f"sample: temperature must be > 0 and top_p in (0, 1], got {a['temperature']}, "
                             f"{a['top_p']}")
        return (TensorType((1,), i32),)

    return infer


def store_next_token(tokens: np.ndarray, token: int, ctx: StepContext) -> None:
    nxt = ctx.position + 1
    if nxt >= ctx.prompt_length and nxt < tokens.shape[0]:
        tokens[nxt] = token


def _argmax_ref(xs, a, ctx):
    token = int(np.argmax(xs[0].reshape(-1)))
    store_next_token(xs[1], token, ctx)
    return [np.array([token], np.int32)]


_MASK64 = (1 << 64) - 1


def sample_uniform(seed: int, position: int) -> float:
    """A reproducible uniform in [0, 1) for (seed, position): splitmix64, as a GPU would compute it."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0 ** -53


def sample_token(logits: np.ndarray, temperature: float, top_p: float, u: float) -> int:
    """Top-p (nucleus) sampling: softmax(logits / temperature), the most likely tokens whose mass first
    reaches top_p (ties by lower index), one picked by inverse CDF at u."""
    z = logits.reshape(-1).astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    mass = np.cumsum(p[order])
    keep = int(np.searchsorted(mass, top_p, side="left")) + 1
    kept = mass[:min(keep, mass.size)]
    pick = int(np.searchsorted(kept, u * kept[-1], side="right"))
    return int(order[min(pick, kept.size - 1)])


def _sample_ref(xs, a, ctx):
    token = sample_token(xs[0], a["temperature"], a["top_p"], sample_uniform(a["seed"], ctx.position))
    store_next_token(xs[1], token, ctx)
    return [np.array([token], np.int32)]


_SAMPLING = (AttrSpec("temperature", "float"), AttrSpec("top_p", "float", 1.0), AttrSpec("seed", "int", 0))


def _layer(name: str, arity, infer, reference, attr_specs: tuple = (), state_inputs: tuple = (), doc: str = ""):
    register_layer_op(LayerOpDef(name=name, arity=arity, attr_specs=attr_specs, infer=infer, reference=reference,
                                 state_inputs=state_inputs, doc=doc))


_layer("embedding", 2, _embedding_infer, _embedding_ref, doc="the table row of the token at the current position")
_layer("rms_norm", 2, _rms_norm_infer, _rms_norm_ref, (AttrSpec("eps", "float"),),
       doc="x * rsqrt(mean(x^2) + eps) * w over the row")
_layer("linear", None, _linear_infer, _linear_ref, doc="x @ concat(weights).T; weights are [out, in]")
_layer("add_bias", None, _add_bias_infer, _add_bias_ref,
       doc="x + concat(biases): a projection's biases, one vector per weight, concatenated as the weights are")
_layer("head_rms_norm", 3, _head_rms_norm_infer, _head_rms_norm_ref, (*_HEADS, AttrSpec("eps", "float")),
       doc="rms_norm of each query and key head (Qwen3 q/k norm)")
_layer("rope", 1, _rope_infer, _rope_ref, (*_HEADS, *_ROPE_ATTRS),
       doc="rotary embedding of query and key heads at the current position")
_layer("attention", 3, _attention_infer, _attention_ref, _HEADS, state_inputs=(1, 2),
       doc="append k, v to the cache; causal grouped-query attention over 0..position")
_layer("scaled_attention", 3, _scaled_attention_infer, _scaled_attention_ref, (*_HEADS, *_ATTENTION_OPTIONS),
       state_inputs=(1, 2), doc="attention (append k, v; grouped queries) over the last `window` positions (0: all), "
                                "scores scaled by `scale` (0: 1/sqrt(head_dim)) and soft-capped by `softcap` (0: none)")
_ACT = AttrSpec("act", "op", "silu")
_layer("act_mul", 1, _act_mul_infer, _act_mul_ref, (_ACT,),
       doc="act(gate) * up over the gate|up row (a gated MLP; act: an element-wise operator, silu for SwiGLU)")
_layer("add", 2, _add_infer, _add_ref, doc="element-wise sum (residual)")
_layer("rms_norm_1p", 2, _rms_norm_infer, _rms_norm_1p_ref, (AttrSpec("eps", "float"),),
       doc="x * rsqrt(mean(x^2) + eps) * (1 + w) over the row (Gemma's RMSNorm)")
_layer("geglu", 1, _act_mul_infer, _geglu_ref,
       doc="gelu_tanh(gate) * up over the gate|up row (Gemma's MLP, GELU's tanh approximation)")
_layer("scale", 1, _row_infer("scale"), lambda xs, a, ctx: [scale_row(xs[0], a)], (AttrSpec("factor", "float"),),
       doc="x * factor (Gemma's embeddings times sqrt(hidden))")
_layer("softcap", 1, _row_infer("softcap"), lambda xs, a, ctx: [softcap_row(xs[0], a)],
       (AttrSpec("cap", "float", minimum=1e-30),), doc="cap * tanh(x / cap) (Gemma-2's logit soft-capping)")
_layer("gated_scale", 2, _gated_scale_infer, _gated_scale_ref, (AttrSpec("act", "op", "sigmoid"),),
       doc="act(gate) * x: a row scaled by an element-wise operator of its one-value gate row (Qwen2-MoE's shared "
           "expert times sigmoid of its gate)")
_layer("moe_router", 2, _moe_router_infer, _moe_router_ref,
       (AttrSpec("top_k", "int"), AttrSpec("norm_topk_prob", "bool", False)),
       doc="the routing row [1, E]: softmax of x @ router.T, its top_k kept (renormalised with norm_topk_prob)")
_layer("moe_experts", None, _moe_experts_infer, _moe_experts_ref, (_ACT,),
       doc="sum over the experts the routing row picks of routing[e] * down_e(act(gate_e x) * up_e x); operands: "
           "x, routing, E gate, E up, E down weights")
_layer("norm_moe_router", 3, _norm_moe_router_infer, _norm_moe_router_ref,
       (AttrSpec("eps", "float"), AttrSpec("top_k", "int"), AttrSpec("norm_topk_prob", "bool", False)),
       doc="moe_router of rms_norm(x, norm): the routing row of a normalised row (fused)")
_layer("norm_moe_experts_residual", None, _norm_moe_experts_residual_infer, _norm_moe_experts_residual_ref,
       (AttrSpec("eps", "float"), _ACT, AttrSpec("top_k", "int")),
       doc="residual + moe_experts(rms_norm(x, norm), routing, ...): the mixture of experts of a normalised row with "
           "the residual add (fused), the routing row from a router of `top_k` experts; operands: x, norm, routing, "
           "residual, E gate, E up, E down weights")
_layer("argmax", 2, _token_infer("argmax"), _argmax_ref, state_inputs=(1,),
       doc="the most likely token (lowest index on ties), stored after the position")
_layer("sample", 2, _token_infer("sample"), _sample_ref,
       _SAMPLING, state_inputs=(1,), doc="seeded temperature/top-p sampling, stored after the position")


# ---------------------------------------------------------------------------------------------
# fused ops (made by mdsl.megakernel.taskgraph.layer_fusion): each is the composition of the ops above it folds, so
# its reference is theirs applied in turn; the task graph then has one hop per fused op, not per op.

def _norm_linear_infer(types, a):
    x, norm, *ws = types
    (row,) = _rms_norm_infer((x, norm), a)
    return _linear_infer((row, *ws), a)


def fused_normalize(x: np.ndarray, w: np.ndarray, a: dict) -> np.ndarray:
    """A fused op's rms_norm of x by its norm weight w: scaled by w, or by 1 + w where the op's `unit_offset`
    says so (rms_norm_1p, Gemma's)."""
    if a.get("unit_offset"):
        return _rms_norm_1p_ref([x, w], a, None)[0]
    return rms_normalize(x, w, a["eps"])


def _norm_linear_ref(xs, a, ctx):
    x, norm, *ws = xs
    return _linear_ref([fused_normalize(x, norm, a), *ws], a, ctx)


def split_biases(operands) -> tuple:
    """norm_linear_bias's operands after the input and the norm as (weights, biases): as many bias vectors
    as weight matrices, each with its weight's rows."""
    count = len(operands) // 2
    return tuple(operands[:count]), tuple(operands[count:])


def _norm_linear_bias_infer(types, a):
    x, norm, *rest = types
    ws, bs = split_biases(rest)
    if not ws or len(rest) % 2 or any(w.rank != 2 or b.rank != 1 or b.shape[0] != w.shape[0] for w, b in zip(ws, bs)):
        raise ShapeError(f"norm_linear_bias takes the input, the norm weight, the weight matrices and one bias per "
                         f"matrix with its rows; got {[str(t) for t in types]}")
    (row,) = _norm_linear_infer((x, norm, *ws), a)
    return _add_bias_infer((row, *bs), a)


def _norm_linear_bias_ref(xs, a, ctx):
    x, norm, *rest = xs
    ws, bs = split_biases(rest)
    return _add_bias_ref([*_norm_linear_ref([x, norm, *ws], a, ctx), *bs], a, ctx)


def gate_up_rows(weights, start: int, stop: int) -> tuple:
    """(weight, first row, end row) of the gate's and the up projection's rows of gated columns start..stop:
    rows of a gate and an up weight, or of one weight holding the gate's rows, then the up's (Phi-3's
    gate_up_proj)."""
    if len(weights) == 2:
        return tuple((w, start, stop) for w in weights)
    (w,) = weights
    half = w.shape[0] // 2
    return (w, start, stop), (w, half + start, half + stop)


def _norm_gate_up_infer(types, a):
    x, norm, *ws = types
    if len(ws) == 2 and ws[0].shape != ws[1].shape:
        raise ShapeError(f"norm_gate_up: the gate and up weights must have one shape, got {ws[0]} and {ws[1]}")
    if len(ws) not in (1, 2):
        raise ShapeError(f"norm_gate_up takes the input, the norm weight and a gate and an up weight (or one gate|up "
                         f"weight); got {len(types)} operands")
    return _act_mul_infer(_norm_linear_infer(types, a), a)


def _norm_gate_up_ref(xs, a, ctx):
    return _act_mul_ref(_norm_linear_ref(xs, a, ctx), a, ctx)


def _norm_geglu_ref(xs, a, ctx):
    return _geglu_ref(_norm_linear_ref(xs, a, ctx), a, ctx)


def _linear_residual_infer(types, a):
    x, residual, *ws = types
    (out,) = _linear_infer((x, *ws), a)
    return _add_infer((residual, out), a)


def _linear_residual_ref(xs, a, ctx):
    x, residual, *ws = xs
    return _add_ref([residual, _linear_ref([x, *ws], a, ctx)[0]], a, ctx)


def _linear_add_residual_infer(types, a):
    x, addend, residual, *ws = types
    (out,) = _linear_infer((x, *ws), a)
    (out,) = _add_infer((addend, out), a)
    return _add_infer((residual, out), a)


def _linear_add_residual_ref(xs, a, ctx):
    x, addend, residual, *ws = xs
    (out,) = _add_ref([addend, _linear_ref([x, *ws], a, ctx)[0]], a, ctx)
    return _add_ref([residual, out], a, ctx)


def _linear_norm_residual_infer(types, a):
    x, residual, norm, *ws = types
    (out,) = _linear_infer((x, *ws), a)
    (out,) = _rms_norm_infer((out, norm), a)
    return _add_infer((residual, out), a)


def _linear_norm_residual_ref(xs, a, ctx):
    x, residual, norm, *ws = xs
    (out,) = _linear_ref([x, *ws], a, ctx)
    return _add_ref([residual, fused_normalize(out, norm, a)], a, ctx)


def _scaled_embedding_ref(xs, a, ctx):
    return [scale_row(_embedding_ref(xs, a, ctx)[0], a)]


def _rope_attention_infer(types, a):
    qkv, k_cache, v_cache, *norms = types
    if len(norms) not in (0, 2):
        raise ShapeError(f"rope_attention takes q|k|v, the two caches and optionally the q and k norm weights "
                         f"(3 or 5 operands), got {len(types)}")
    if norms:
        _head_rms_norm_infer((qkv, *norms), a)
    (qkv,) = _rope_infer((qkv,), a)
    return _attention_infer((qkv, k_cache, v_cache), a)


def _rope_attention_ref(xs, a, ctx):
    qkv, k_cache, v_cache, *norms = xs
    if norms:
        (qkv,) = _head_rms_norm_ref([qkv, *norms], a, ctx)
    (qkv,) = _rope_ref([qkv], a, ctx)
    return _attention_ref([qkv, k_cache, v_cache], a, ctx)


def _rope_scaled_attention_infer(types, a):
    (qkv,) = _rope_infer(types[:1], a)
    return _scaled_attention_infer((qkv, *types[1:]), a)


def _rope_scaled_attention_ref(xs, a, ctx):
    qkv, k_cache, v_cache = xs
    (qkv,) = _rope_ref([qkv], a, ctx)
    return _scaled_attention_ref([qkv, k_cache, v_cache], a, ctx)


def _lm_head_infer(name: str):
    def infer(types, a):
        x, norm, head, tokens = types
        (logits,) = _norm_linear_infer((x, norm, head), a)
        return (logits, *_token_infer(name)((logits, tokens), a))

    return infer


def _lm_head_ref(token_ref):
    def reference(xs, a, ctx):
        x, norm, head, tokens = xs
        (logits,) = _norm_linear_ref([x, norm, head], a, ctx)
        if a.get("softcap"):
            logits = softcap_row(logits, {"cap": a["softcap"]})
        return [logits, *token_ref([logits, tokens], a, ctx)]

    return reference


_EPS = AttrSpec("eps", "float")
_layer("norm_linear", None, _norm_linear_infer, _norm_linear_ref, (_EPS,),
       doc="rms_norm(x, norm) @ concat(weights).T: a linear reading the normalised row (q|k|v)")
_layer("norm_linear_bias", None, _norm_linear_bias_infer, _norm_linear_bias_ref, (_EPS,),
       doc="rms_norm(x, norm) @ concat(weights).T + concat(biases): a biased linear reading the normalised row "
           "(Qwen2's q|k|v); operands: x, norm, the weights, then one bias per weight")
_layer("norm_gate_up", None, _norm_gate_up_infer, _norm_gate_up_ref, (_EPS, _ACT),
       doc="act(n @ gate.T) * (n @ up.T), n = rms_norm(x, norm): a gated MLP's first half (SwiGLU: act = silu); "
           "operands: x, norm, the gate and the up weight, or one weight of the gate's rows then the up's")
_layer("linear_residual", None, _linear_residual_infer, _linear_residual_ref,
       doc="residual + x @ concat(weights).T: a linear with the residual add in its epilogue")
_layer("linear_add_residual", None, _linear_add_residual_infer, _linear_add_residual_ref,
       doc="residual + (addend + x @ concat(weights).T): a linear with two adds in its epilogue, the inner one first "
           "(a parallel block's x + (o_proj(attn) + mlp)); operands: x, addend, residual, the weights")
# the flavour of a fused norm: the weight w scales the normalised row as w (rms_norm), or with unit_offset as 1 + w
# (rms_norm_1p, Gemma's); the ops named for rms_norm_1p have it set
_UNIT_OFFSET = AttrSpec("unit_offset", "bool", False)
_NORM = (_EPS, _UNIT_OFFSET)
_layer("norm_1p_linear", None, _norm_linear_infer, _norm_linear_ref, (_EPS, AttrSpec("unit_offset", "bool", True)),
       doc="rms_norm_1p(x, norm) @ concat(weights).T: norm_linear of a row normalised by 1 + norm (Gemma's q|k|v)")
_layer("norm_geglu", None, _norm_gate_up_infer, _norm_geglu_ref, _NORM,
       doc="gelu_tanh(n @ gate.T) * (n @ up.T), n = rms_norm(x, norm): a GeGLU MLP's first half (Gemma's); operands "
           "as norm_gate_up's")
_layer("linear_norm_residual", None, _linear_norm_residual_infer, _linear_norm_residual_ref, _NORM,
       doc="residual + rms_norm(x @ concat(weights).T, norm): a linear whose output row is normalised before the "
           "residual add (Gemma-2's post-attention and post-feedforward norms); operands: x, residual, norm, the "
           "weights")
_layer("scaled_embedding", 2, _embedding_infer, _scaled_embedding_ref, (AttrSpec("factor", "float"),),
       doc="the table row of the token at the current position, times factor (Gemma's embeddings)")
_layer("rope_attention", None, _rope_attention_infer, _rope_attention_ref,
       (*_HEADS, *_ROPE_ATTRS, AttrSpec("eps", "float", 0.0)), state_inputs=(1, 2),
       doc="optional q/k head rms_norm (weights as operands 4 and 5, eps), RoPE, the KV-cache append and attention")
_layer("rope_scaled_attention", 3, _rope_scaled_attention_infer, _rope_scaled_attention_ref,
       (*_HEADS, *_ROPE_ATTRS, *_ATTENTION_OPTIONS), state_inputs=(1, 2),
       doc="RoPE, the KV-cache append and scaled_attention (a window, a query scale, soft-capped scores)")
_layer("lm_head_argmax", 4, _lm_head_infer("argmax"), _lm_head_ref(_argmax_ref), (_EPS,), state_inputs=(3,),
       doc="(logits, token): rms_norm, the LM head and argmax, the token stored after the position")
_layer("lm_head_sample", 4, _lm_head_infer("sample"), _lm_head_ref(_sample_ref), (_EPS, *_SAMPLING),
       state_inputs=(3,), doc="(logits, token): rms_norm, the LM head and seeded temperature/top-p sampling")
# ... of a row normalised by 1 + the norm weight, the logits soft-capped to softcap * tanh(logit / softcap) where
# softcap > 0 (Gemma-2's final_logit_softcapping)
_LM_HEAD_1P = (_EPS, AttrSpec("unit_offset", "bool", True), AttrSpec("softcap", "float", 0.0, minimum=0.0))
_layer("lm_head_1p_argmax", 4, _lm_head_infer("argmax"), _lm_head_ref(_argmax_ref), _LM_HEAD_1P, state_inputs=(3,),
       doc="(logits, token): rms_norm_1p, the LM head (soft-capped where softcap > 0) and argmax")
_layer("lm_head_1p_sample", 4, _lm_head_infer("sample"), _lm_head_ref(_sample_ref), (*_LM_HEAD_1P, *_SAMPLING),
       state_inputs=(3,), doc="(logits, token): rms_norm_1p, the LM head (soft-capped where softcap > 0) and seeded "
                              "temperature/top-p sampling")

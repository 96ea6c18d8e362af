"""The CPU device's forward over one step's token rows: a rule per layer op (`STEP_RULES`) computes the op
for every row of the step at once, the rows of several requests side by side ([rows, N] activations, as
the megakernel's GEMM tiles take the step's tokens), each request's rows a chunk of consecutive positions.

Every rule gives each row the bits that the op's reference (mdsl.megakernel.modelgraph.layers) gives the
row alone at its position, so a request's logits depend neither on how its prompt is chunked nor on what
shares its steps:

- a linear multiplies the rows by the weight as a stack of one-row products (numpy's matmul over
  [rows, 1, K]: per row the gemv the reference's one-row product makes), never as one [rows, K] GEMM,
  whose kernel and blocking OpenBLAS chooses by the row count, so that a row's dot products would be
  summed in an order that depends on how many rows share the product; a 16-bit checkpoint's linear
  first rounds its input to that dtype (`operand_dtype`), as the GPU's tensor cores take it;
- element-wise ops and the norms work along each row (numpy reduces a row the same whatever rows lie
  beside it), and RoPE takes each row's cos and sin at its own position;
- a mixture of experts' router and experts run the reference on each row alone (each row's router picks its
  own experts, whose products are that row's gemvs);
- attention appends the keys and values of a chunk's rows to the request's pages at once (rounded to the
  checkpoint's dtype, as transformers' cache and the reference with that kv_dtype hold them), then gives each
  query row the softmax over exactly its causal range (the cached prefix and the chunk's keys up to its
  own): the reference's reductions over that range. A masked product over the chunk's whole key range
  would not do: BLAS picks its kernels by the key count and numpy's pairwise sum changes its tree with the
  length, so a row's bits would change with the chunk. (A GPU attention tile gets the same invariance
  its own way: key tiles at absolute positions, masked keys as exact zeros in a reduction of fixed shape.)
"""
from __future__ import annotations

from typing import Callable

import attrs
import numpy as np

from mdsl.ir.dtypes import DType, f32
from mdsl.ir.rules import RuleTable
from mdsl.megakernel.modelgraph.layers import (LAYER_OPS, StepContext, attend, attention_options, cached, operand,
                                              rms_normalize, rope_cos_sin, rotate_heads, window_start)


@attrs.frozen(eq=False)
class StepBatch:
    """What a rule knows of the step besides its operands: each row's token and position, the chunks
    (entry, first position, positions, first row), the paged KV cache's page tables, the dtype whose
    values the pools hold (the checkpoint's: keys and values are rounded to it as they are appended) and
    the one a linear's input is rounded to (the checkpoint's: StepContext.operand_dtype)."""

    tokens: np.ndarray
    positions: np.ndarray
    chunks: tuple
    page_table: np.ndarray
    page_size: int
    kv_dtype: DType = f32
    operand_dtype: DType = f32

    def rows(self, keep: np.ndarray) -> "StepBatch":
        """The batch of rows `keep` only, past the last KV write (no chunk is left to attend)."""
        return StepBatch(self.tokens[keep], self.positions[keep], (), self.page_table, self.page_size, self.kv_dtype,
                         self.operand_dtype)


#: layer op -> rule(operands with one row per step token, attrs, StepBatch) -> results, row for row. The
#: ops are those of the unfused step functions, which is what the serving engine runs; the token choosers
#: have none (the device samples per request).
STEP_RULES: RuleTable[Callable] = RuleTable("CPU serving device", Callable, "mdsl.serving.steprules (STEP_RULES)",
                                            registry=LAYER_OPS)


def rows_times(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [rows, K] @ w.T (w [N, K]): each row's product alone, as the reference's one-row product."""
    x = np.ascontiguousarray(x, np.float32)
    return np.matmul(x[:, None, :], w.astype(np.float32, copy=False).T)[:, 0, :]


def _heads(qkv: np.ndarray, a: dict):
    """The [rows, q|k|v] array as (q [rows, Hq, D], k [rows, Hkv, D], v [rows, Hkv, D]) views."""
    hq, hkv, d = a["q_heads"], a["kv_heads"], a["head_dim"]
    heads = qkv.reshape(qkv.shape[0], hq + 2 * hkv, d)
    return heads[:, :hq], heads[:, hq:hq + hkv], heads[:, hq + hkv:]


def _embedding(xs, a, batch):
    return [np.asarray(xs[1][batch.tokens], np.float32)]


def _linear(xs, a, batch):
    x, *ws = xs
    x = operand(np.asarray(x, np.float32), batch.operand_dtype)
    return [np.concatenate([rows_times(x, w) for w in ws], axis=1)]


def _head_rms_norm(xs, a, batch):
    out = xs[0].astype(np.float32).copy()
    q, k, _ = _heads(out, a)
    q[:] = rms_normalize(q, xs[1], a["eps"])
    k[:] = rms_normalize(k, xs[2], a["eps"])
    return [out]


def _rope(xs, a, batch):
    out = xs[0].astype(np.float32).copy()
    q, k, _ = _heads(out, a)
    table = {int(p): rope_cos_sin(a, int(p)) for p in np.unique(batch.positions)}
    cos = np.stack([table[int(p)][0] for p in batch.positions])[:, None, :]
    sin = np.stack([table[int(p)][1] for p in batch.positions])[:, None, :]
    q[:] = rotate_heads(q, cos, sin)
    k[:] = rotate_heads(k, cos, sin)
    return [out]


def _attention(xs, a, batch):
    qkv, k_pool, v_pool = xs
    q, k, v = _heads(qkv.astype(np.float32), a)
    ps, group = batch.page_size, a["q_heads"] // a["kv_heads"]
    out = np.empty_like(q)
    for entry, start, count, row in batch.chunks:
        table, end = batch.page_table[entry], start + count
        positions = np.arange(start, end)
        pages, slots = table[positions // ps], positions % ps
        # the chunk's KV append, all its rows at once, rounded as the reference's cache rounds them
        k_pool[pages, slots] = cached(k[row:row + count], batch.kv_dtype)
        v_pool[pages, slots] = cached(v[row:row + count], batch.kv_dtype)
        n = -(-end // ps)
        keys = k_pool[table[:n]].reshape(n * ps, *k_pool.shape[2:])
        values = v_pool[table[:n]].reshape(n * ps, *v_pool.shape[2:])
        for i in range(count):
            # the prefix and the chunk's keys up to row i, from the window's start (scaled_attention's)
            lo, causal = window_start(a, start + i), start + i + 1
            for h in range(a["kv_heads"]):
                g = slice(h * group, (h + 1) * group)
                out[row + i, g], _ = attend(q[row + i, g], keys[lo:causal, h], values[lo:causal, h],
                                            **attention_options(a))
    return [out.reshape(out.shape[0], -1)]


def _as_reference(name: str):
    """An op that works along each row already: its reference over all the rows."""
    reference = LAYER_OPS[name].reference
    return lambda xs, a, batch: reference(xs, a, None)


def _rms_norm(xs, a, batch):
    return [rms_normalize(xs[0], xs[1], a["eps"])]


def _row_by_row(name: str, rows_operands: int):
    """An op whose reference takes one row: the reference of each row alone (its first `rows_operands` operands
    that row's, the others whole), with the step's operand dtype, so that a row gets its bits whatever shares the
    step (a mixture of experts: each row's router picks its own experts)."""
    reference = LAYER_OPS[name].reference

    def rule(xs, a, batch):
        ctx = StepContext(0, operand_dtype=batch.operand_dtype)
        rows, rest = xs[:rows_operands], list(xs[rows_operands:])
        return [np.concatenate([reference([x[r:r + 1] for x in rows] + rest, a, ctx)[0]
                                for r in range(rows[0].shape[0])], axis=0)]

    return rule


for _op, _rule in {"embedding": _embedding, "rms_norm": _rms_norm, "linear": _linear,
                   "add_bias": _as_reference("add_bias"), "head_rms_norm": _head_rms_norm, "rope": _rope,
                   "attention": _attention, "scaled_attention": _attention, "act_mul": _as_reference("act_mul"),
                   "add": _as_reference("add"), "rms_norm_1p": _as_reference("rms_norm_1p"),
                   "geglu": _as_reference("geglu"), "scale": _as_reference("scale"),
                   "softcap": _as_reference("softcap"), "moe_router": _row_by_row("moe_router", 1),
                   "moe_experts": _row_by_row("moe_experts", 2), "gated_scale": _as_reference("gated_scale")}.items():
    STEP_RULES.register(_op, _rule)

"""The task-graph fusion pass: a model graph in, the same computation with fewer, fused layer ops out.

Unfused, every op of a model graph is a hop of the task graph: a single-task rms_norm that every tile of
the next linear waits for, separate rope / head-norm / residual-add tasks. `fuse` folds

* rms_norm into the linear(s) that read it: `norm_linear` (q|k|v; `norm_linear_bias` with the projection's
  add_bias, one bias per weight), `norm_gate_up` (with act(gate) * up; `norm_geglu` with geglu),
  `lm_head_argmax` / `lm_head_sample` (the final norm, the LM head and the token); rms_norm_1p (Gemma's, the
  fused op's `unit_offset`) into `norm_1p_linear`, `norm_geglu` and `lm_head_1p_argmax` / `lm_head_1p_sample`,
  these with the logits' softcap between the LM head and the token;
* a linear whose output is normalised, then added to a row (Gemma-2's post-norms): `linear_norm_residual`;
* an embedding times a constant (Gemma's): `scaled_embedding`;
* a residual add into the linear it adds: `linear_residual` (o-proj, down-proj); two adds, the linear's
  output added to one row and the sum to another, `linear_add_residual` (a parallel block's
  x + (o_proj(attn) + mlp): the second linear stays a plain `linear`), unless the outer add's other operand
  is a linear that takes it as its own residual (then each linear gets one add: (x + o) + mlp);
* the q/k head norm, RoPE and the KV-cache append into attention: `rope_attention`; RoPE and the append
  into scaled_attention (a window, a query scale, soft-capping): `rope_scaled_attention`.
* rms_norm into a mixture of experts' router (`norm_moe_router`) and experts, with the residual add of the
  experts' output: `norm_moe_experts_residual`.

Each fused op is a layer op of its own (layers.py: shape rule and reference; partition.py: tasks;
numpy_bodies.py: task bodies). A rule of `FUSION_RULES` belongs to the op that anchors a pattern (linear,
rope); it returns the fused node and the nodes it replaces. A chain is fused
only where its intermediate values have no other reader; a norm is folded into each linear that reads it
and dropped once nothing reads it any more. The fused node keeps the last replaced node's place (every
operand is defined before it) and the anchor's source location.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

import attrs

from mdsl.errors import MdslError, ValidationError
from mdsl.ir.rules import RuleTable
from mdsl.megakernel.modelgraph.layers import LAYER_OPS, get_layer_op
from mdsl.megakernel.modelgraph.model import LayerNode, ModelGraph


@attrs.frozen
class Fusion:
    node: LayerNode
    replaces: tuple      # indices of the nodes the fused node stands for (the anchor among them)


class _Uses:
    """Who reads each value of a graph: nodes (by index) and the graph's outputs."""

    def __init__(self, graph: ModelGraph):
        self.graph = graph
        self.producer = {v.name: i for i, n in enumerate(graph.nodes) for v in n.outputs}
        self.readers: dict = {}
        for i, n in enumerate(graph.nodes):
            for v in n.inputs:
                self.readers.setdefault(v.name, []).append(i)
        self.outputs = Counter(v.name for v in graph.outputs)

    def producing(self, var, op: str) -> Optional[tuple]:
        """(index, node) of the node of kind `op` that makes var, or None."""
        i = self.producer.get(var.name)
        if i is None or self.graph.nodes[i].op != op:
            return None
        return i, self.graph.nodes[i]

    def only_reader(self, var, ops: tuple, *, as_output_too: bool = False) -> Optional[tuple]:
        """(index, node) of the one node reading var if its op is one of `ops` (and var is no graph output
        unless as_output_too), else None."""
        readers = self.readers.get(var.name, [])
        if len(readers) != 1 or (self.outputs[var.name] and not as_output_too):
            return None
        node = self.graph.nodes[readers[0]]
        return (readers[0], node) if node.op in ops else None


def _fused(op: str, inputs: tuple, outputs: tuple, attr_pairs: tuple, anchor: LayerNode) -> LayerNode:
    """A fused node with its attributes in the op's declared order (defaults filled), at the anchor's line."""
    return LayerNode(op, inputs, outputs, get_layer_op(op).normalize_attrs(dict(attr_pairs)), anchor.loc)


_NORMS = ("rms_norm", "rms_norm_1p")   # a fused op's norm: scaled by the weight, or by 1 + weight (unit_offset)


def _norm_attrs(norm: LayerNode) -> tuple:
    """The fused op's attributes of the norm it folds: eps, and unit_offset for rms_norm_1p."""
    return norm.attrs + ((("unit_offset", True),) if norm.op == "rms_norm_1p" else ())


def _producing_norm(var, uses: _Uses) -> Optional[tuple]:
    return next((found for found in (uses.producing(var, op) for op in _NORMS) if found is not None), None)


def _fuse_linear(index: int, node: LayerNode, uses: _Uses) -> Optional[Fusion]:
    x, *ws = node.inputs
    norm = _producing_norm(x, uses)
    if norm is not None:
        _, norm_node = norm
        raw, norm_weight = norm_node.inputs
        eps, one_plus = _norm_attrs(norm_node), norm_node.op == "rms_norm_1p"
        logits, capped = node.output, ()
        softcap = uses.only_reader(node.output, ("softcap",))   # (the LM head's logits soft-capped: Gemma-2's)
        if softcap is not None and one_plus and len(ws) == 1:
            logits, capped = softcap[1].output, (softcap[0],)
            eps += (("softcap", softcap[1].attr_dict["cap"]),)
        token = uses.only_reader(logits, ("argmax", "sample"), as_output_too=True)
        if token is not None and len(ws) == 1 and token[1].inputs[0] == logits:
            j, t = token
            fused = _fused(f"lm_head_{'1p_' if one_plus else ''}{t.op}", (raw, norm_weight, ws[0], t.inputs[1]),
                           (logits, t.output), eps + t.attrs, node)
            return Fusion(fused, (index, *capped, j))
        if capped:
            return None
        gated = uses.only_reader(node.output, ("geglu",) if one_plus else ("act_mul", "geglu"))
        if gated is not None and (len(ws) == 2 and ws[0].shape == ws[1].shape or len(ws) == 1):   # (gate|up: one)
            j, g = gated
            op = "norm_gate_up" if g.op == "act_mul" else "norm_geglu"
            return Fusion(_fused(op, (raw, norm_weight, *ws), g.outputs, eps + g.attrs, node), (index, j))
        if one_plus:   # (q|k|v of a row normalised by 1 + weight: Gemma's)
            return Fusion(_fused("norm_1p_linear", (raw, norm_weight, *ws), node.outputs, eps, node), (index,))
        biased = uses.only_reader(node.output, ("add_bias",))
        if biased is not None and biased[1].inputs[0] == node.output and \
                [b.shape[0] for b in biased[1].inputs[1:]] == [w.shape[0] for w in ws]:
            j, b = biased
            return Fusion(_fused("norm_linear_bias", (raw, norm_weight, *ws, *b.inputs[1:]), b.outputs, eps, node),
                          (index, j))
        return Fusion(_fused("norm_linear", (raw, norm_weight, *ws), node.outputs, eps, node), (index,))
    post_norm = next((found for found in (uses.only_reader(node.output, (op,)) for op in _NORMS) if found), None)
    if post_norm is not None and post_norm[1].inputs[0] == node.output:
        return _fuse_normed_residual(index, node, post_norm, uses)
    add = uses.only_reader(node.output, ("add",))
    if add is None:
        return None
    j, a = add
    addend = _other(a, node.output)
    if addend is None:
        return None
    outer = uses.only_reader(a.output, ("add",))
    if outer is not None and not _carries(outer[1], a.output, uses):
        k, b = outer
        residual = _other(b, a.output)
        if residual is not None:
            return Fusion(_fused("linear_add_residual", (x, addend, residual, *ws), b.outputs, (), node),
                          (index, j, k))
    return Fusion(_fused("linear_residual", (x, addend, *ws), a.outputs, (), node), (index, j))


def _fuse_normed_residual(index: int, node: LayerNode, post_norm: tuple, uses: _Uses) -> Optional[Fusion]:
    """residual + norm(linear): a linear's output row normalised, then added to the residual stream (Gemma-2's
    post-attention and post-feedforward norms): `linear_norm_residual`."""
    i, norm = post_norm
    add = uses.only_reader(norm.output, ("add",))
    if add is None:
        return None
    j, a = add
    residual = _other(a, norm.output)
    if residual is None:
        return None
    x, *ws = node.inputs
    return Fusion(_fused("linear_norm_residual", (x, residual, norm.inputs[1], *ws), a.outputs, _norm_attrs(norm),
                         node), (index, i, j))


def _fuse_scale(index: int, node: LayerNode, uses: _Uses) -> Optional[Fusion]:
    """An embedding row times a constant (Gemma's embeddings times sqrt(hidden)): `scaled_embedding`."""
    embedding = uses.producing(node.inputs[0], "embedding")
    if embedding is None or uses.only_reader(node.inputs[0], ("scale",)) is None:
        return None
    i, e = embedding
    return Fusion(_fused("scaled_embedding", e.inputs, node.outputs, node.attrs, e), (i, index))


def _other(add: LayerNode, var) -> Optional[object]:
    """The operand of `add` beside var, or None where var is both."""
    other = add.inputs[1] if add.inputs[0] == var else add.inputs[0]
    return None if other == var else other


def _carries(add: LayerNode, var, uses: _Uses) -> bool:
    """Whether add's other operand (beside var) is a linear's output that add alone reads: that linear then
    takes the add as its own residual (linear_residual), as (x + o_proj(attn)) + down_proj(act) is two."""
    other = _other(add, var)
    return other is not None and uses.producing(other, "linear") is not None and \
        uses.only_reader(other, ("add",)) is not None


_HEAD_ATTRS = ("q_heads", "kv_heads", "head_dim")


def _fuse_rope(index: int, node: LayerNode, uses: _Uses) -> Optional[Fusion]:
    attention = uses.only_reader(node.output, ("attention", "scaled_attention"))
    if attention is None or attention[1].inputs[0] != node.output or \
            any(pair not in node.attrs for pair in attention[1].attrs if pair[0] in _HEAD_ATTRS):   # heads as rope's
        return None
    j, att = attention
    if att.op == "scaled_attention":   # (its window, scale and softcap; no head norm folded)
        options = tuple(pair for pair in att.attrs if pair[0] not in _HEAD_ATTRS)
        fused = _fused("rope_scaled_attention", (node.inputs[0], *att.inputs[1:]), att.outputs,
                       node.attrs + options, att)
        return Fusion(fused, (index, j))
    qkv, replaces, norms, eps = node.inputs[0], [index, j], (), ()
    head_norm = uses.producing(qkv, "head_rms_norm")
    if head_norm is not None and uses.only_reader(qkv, ("rope",)) is not None and \
            all(pair in node.attrs for pair in head_norm[1].attrs if pair[0] != "eps"):
        i, hn = head_norm
        qkv, norms, eps = hn.inputs[0], hn.inputs[1:], (("eps", hn.attr_dict["eps"]),)
        replaces.append(i)
    fused = _fused("rope_attention", (qkv, *att.inputs[1:], *norms), att.outputs, node.attrs + eps, att)
    return Fusion(fused, tuple(sorted(replaces)))


def _fuse_moe_router(index: int, node: LayerNode, uses: _Uses) -> Optional[Fusion]:
    norm = uses.producing(node.inputs[0], "rms_norm")
    if norm is None:
        return None
    raw, norm_weight = norm[1].inputs
    return Fusion(_fused("norm_moe_router", (raw, norm_weight, node.inputs[1]), node.outputs,
                         norm[1].attrs + node.attrs, node), (index,))


def _fuse_moe_experts(index: int, node: LayerNode, uses: _Uses) -> Optional[Fusion]:
    """The experts of a normalised row, routed by a moe_router, whose output one add alone reads: residual +
    experts (the router's top_k: the slots the fused op's tasks run)."""
    x, routing, *ws = node.inputs
    norm = uses.producing(x, "rms_norm")
    router = uses.producing(routing, "moe_router")
    add = uses.only_reader(node.output, ("add",))
    residual = _other(add[1], node.output) if add is not None else None
    if norm is None or router is None or residual is None:
        return None
    raw, norm_weight = norm[1].inputs
    j, a = add
    top_k = (("top_k", router[1].attr_dict["top_k"]),)
    return Fusion(_fused("norm_moe_experts_residual", (raw, norm_weight, routing, residual, *ws), a.outputs,
                         norm[1].attrs + node.attrs + top_k, node), (index, j))


@attrs.frozen
class FusionRule:
    """The patterns anchored at an op: `fuse(index, node, uses)` is a `Fusion`, or None where none applies."""

    fuse: Callable


FUSION_RULES: RuleTable[FusionRule] = RuleTable("task-graph fusion pass", FusionRule,
                                                "mdsl.megakernel.taskgraph.layer_fusion (FUSION_RULES)",
                                                registry=LAYER_OPS)
FUSION_RULES.register("linear", FusionRule(_fuse_linear))
FUSION_RULES.register("rope", FusionRule(_fuse_rope))
FUSION_RULES.register("moe_router", FusionRule(_fuse_moe_router))
FUSION_RULES.register("moe_experts", FusionRule(_fuse_moe_experts))
FUSION_RULES.register("scale", FusionRule(_fuse_scale))


def fuse(graph: ModelGraph) -> ModelGraph:
    """The graph with every pattern above fused, nodes no longer read dropped; the weights, states and
    outputs (logits, token) unchanged. Fusing a fused graph changes nothing."""
    uses = _Uses(graph)
    placed: dict = {}     # index of a fusion's last replaced node -> the fused node
    gone: set = set()
    for index, node in enumerate(graph.nodes):
        rule = FUSION_RULES.get(node.op)
        if rule is None or index in gone:
            continue
        fusion = rule.fuse(index, node, uses)
        if fusion is None or gone.intersection(fusion.replaces):
            continue
        gone.update(fusion.replaces)
        placed[max(fusion.replaces)] = fusion.node
    nodes = [placed.get(i, n) for i, n in enumerate(graph.nodes) if i not in gone or i in placed]
    return _checked(attrs.evolve(graph, nodes=_without_unread(nodes, graph)))


def _without_unread(nodes: list, graph: ModelGraph) -> tuple:
    """Drop nodes whose outputs nobody reads and which update no state (a norm folded into its linears)."""
    read = {v.name for v in graph.outputs}
    kept = []
    for n in reversed(nodes):
        if n.opdef.state_inputs or any(v.name in read for v in n.outputs):
            kept.append(n)
            read.update(v.name for v in n.inputs)
    return tuple(reversed(kept))


def _checked(graph: ModelGraph) -> ModelGraph:
    """Every node's operands defined before it and its output types those its op's rule infers."""
    defined = {v.name for v in (*graph.weights, *graph.states)}
    for n in graph.nodes:
        missing = [v.name for v in n.inputs if v.name not in defined]
        if missing:
            raise ValidationError(f"fusion placed {n.op} before its operand {missing[0]}", loc=n.loc)
        try:
            types = n.opdef.infer_types(tuple(v.type for v in n.inputs), n.attrs)
        except MdslError as e:
            raise e.with_loc(n.loc)
        if types != tuple(v.type for v in n.outputs):
            raise ValidationError(f"fused {n.op} infers {types}, not its outputs' {[str(v.type) for v in n.outputs]}",
                                  loc=n.loc)
        defined.update(v.name for v in n.outputs)
    return graph

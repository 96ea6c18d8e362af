"""The element-wise epilogues of the fused linear layer ops: what a task computes, column by column,
from its dot products, written as thread graphs of the superoptimizer's operators (mdsl.ir.ops).

One definition for every executor: the CPU simulator's task bodies evaluate it (`evaluate`), the
megakernel's CUDA task bodies are generated from it through the CUDA backend's rule table
(runtime/cuda_bodies.py), and the tests hold both to the unfused layer ops' references. An epilogue's inputs
are named by what they hold: one product per weight matrix a column multiplies (`product`, or `gate` and
`up`) and, for the residual ops, `residual` (and `addend`, a row added to the product before the residual);
its one output is the column's value. Evaluated `eagerly`
for a dtype, every node's result is rounded to it, as PyTorch's eager ops round each result: how the
megakernel matches transformers token for token in bf16.

Each linear op's epilogue (the fused ones', and a plain linear's: its product) is its rule in `EPILOGUE_RULES`.
"""
from __future__ import annotations

import functools
from typing import Callable, Mapping, Optional

import attrs
import numpy as np

from mdsl.errors import ValidationError
from mdsl.ir.dtypes import DType, round_to_dtype
from mdsl.ir.graph import ThreadGraph
from mdsl.ir.rules import RuleTable
from mdsl.ir.text import parse
from mdsl.megakernel.modelgraph.layers import LAYER_OPS


def _thread_graph(text: str) -> ThreadGraph:
    graph = parse(text)
    assert isinstance(graph, ThreadGraph) and len(graph.outputs) == 1, text
    return graph


PRODUCT = _thread_graph("""thread {
  in %product: f32[1]
  out %product
}""")

def _plus(operand: str) -> ThreadGraph:
    """operand + product: a residual add, or a projection's bias."""
    return _thread_graph(f"""thread {{
  in %product: f32[1]
  in %{operand}: f32[1]
  %out: f32[1] = add(%{operand}, %product)
  out %out
}}""")


RESIDUAL_ADD = _plus("residual")
BIASED = _plus("bias")
# residual + (addend + product): the inner add first, as a parallel block's x + (o_proj(attn) + mlp) (rounded
# after each add, as eager ops round them)
ADD_THEN_RESIDUAL = _thread_graph("""thread {
  in %product: f32[1]
  in %addend: f32[1]
  in %residual: f32[1]
  %sum: f32[1] = add(%addend, %product)
  %out: f32[1] = add(%residual, %sum)
  out %out
}""")


@functools.cache
def gated(act: str) -> ThreadGraph:
    """A gated MLP's act(gate) * up (SwiGLU: act = silu); `act` names an element-wise operator."""
    return _thread_graph(f"""thread {{
  in %gate: f32[1]
  in %up: f32[1]
  %act: f32[1] = {act}(%gate)
  %out: f32[1] = mul(%act, %up)
  out %out
}}""")


# Functions that PyTorch computes in one op (one rounding to the model's dtype) and mdsl.ir.ops has no operator
# for, written with its operators: the values named `within_*` are inside the op, and the eager evaluation leaves
# them unrounded (`EpilogueRule.within`). tanh(y) = 2 sigmoid(2y) - 1; GELU's tanh approximation
# 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2 / pi), is x sigmoid(2k (x + 0.044715 x^3)).
_GELU_TANH_2K = 2.0 * (2.0 / np.pi) ** 0.5


@functools.cache
def geglu() -> ThreadGraph:
    """A GeGLU MLP's gelu_tanh(gate) * up (Gemma's; transformers' gelu_pytorch_tanh, one op). PyTorch's bits but
    in the far negative tail (gate below about -3), where its 0.5 x (1 + tanh) cancels and x sigmoid does not:
    values of 1e-4 and less, which the down-proj's sums do not see."""
    return _thread_graph(f"""thread {{
  in %gate: f32[1]
  in %up: f32[1]
  %within_square: f32[1] = mul(%gate, %gate)
  %within_cube: f32[1] = mul(%within_square, %gate)
  %within_cubic: f32[1] = mul_scalar(%within_cube) {{value=0.044715}}
  %within_inner: f32[1] = add(%gate, %within_cubic)
  %within_scaled: f32[1] = mul_scalar(%within_inner) {{value={_GELU_TANH_2K!r}}}
  %within_sigmoid: f32[1] = sigmoid(%within_scaled)
  %act: f32[1] = mul(%gate, %within_sigmoid)
  %out: f32[1] = mul(%act, %up)
  out %out
}}""")


@functools.cache
def softcapped(cap: float) -> ThreadGraph:
    """A logit soft-capped to cap * tanh(logit / cap), as eager PyTorch computes it on the GPU: the division by
    a scalar a product with its f32 reciprocal, each op's result rounded (Gemma-2's final logits)."""
    inverse = float(np.float32(1.0) / np.float32(cap))
    return _thread_graph(f"""thread {{
  in %product: f32[1]
  %scaled: f32[1] = mul_scalar(%product) {{value={inverse!r}}}
  %within_doubled: f32[1] = mul_scalar(%scaled) {{value=2.0}}
  %within_sigmoid: f32[1] = sigmoid(%within_doubled)
  %within_twice: f32[1] = mul_scalar(%within_sigmoid) {{value=2.0}}
  %tanh: f32[1] = add_scalar(%within_twice) {{value=-1.0}}
  %out: f32[1] = mul_scalar(%tanh) {{value={float(cap)!r}}}
  out %out
}}""")


def within(graph: ThreadGraph) -> frozenset:
    """The values of the epilogue inside one PyTorch op (named `within_*`), which eager ops do not round."""
    return frozenset(n.output.name for n in graph.nodes if n.output.name.startswith("within_"))


@attrs.frozen
class EpilogueRule:
    """A fused linear op's epilogue: `graph(attrs)`, its thread graph for the op's attribute dict.
    `rounded_once`: the epilogue is one PyTorch op with its product (addmm's x @ W.T + b, computed in f32),
    so its value is rounded to the model's dtype once, not each node's as eager ops round them. Otherwise every
    value is rounded but those inside one PyTorch op (`within`)."""

    graph: Callable[[Mapping], ThreadGraph]
    rounded_once: bool = False


def _lm_head(a: Mapping) -> ThreadGraph:
    """The LM head's logit: its product, soft-capped where the op's softcap is set."""
    return softcapped(a["softcap"]) if a["softcap"] else PRODUCT


EPILOGUE_RULES: RuleTable[EpilogueRule] = RuleTable("fused linears' epilogues", EpilogueRule,
                                                    "mdsl.megakernel.modelgraph.epilogues (EPILOGUE_RULES)",
                                                    registry=LAYER_OPS)
for _op, _graph in {"linear": lambda a: PRODUCT, "norm_linear": lambda a: PRODUCT,
                    "norm_gate_up": lambda a: gated(a["act"]), "linear_residual": lambda a: RESIDUAL_ADD,
                    "linear_add_residual": lambda a: ADD_THEN_RESIDUAL, "lm_head_argmax": lambda a: PRODUCT,
                    "lm_head_sample": lambda a: PRODUCT, "norm_1p_linear": lambda a: PRODUCT,
                    "lm_head_1p_argmax": _lm_head, "lm_head_1p_sample": _lm_head}.items():
    EPILOGUE_RULES.register(_op, EpilogueRule(_graph))
EPILOGUE_RULES.register("norm_linear_bias", EpilogueRule(lambda a: BIASED, rounded_once=True))
# a mixture of experts: the router's logits, and each picked expert's act(gate) * up (its down-projection's
# weighted sum over the slots is the runtime's own: moe.cuh)
EPILOGUE_RULES.register("norm_moe_router", EpilogueRule(lambda a: PRODUCT))
EPILOGUE_RULES.register("norm_moe_experts_residual", EpilogueRule(lambda a: gated(a["act"])))
# (linear_norm_residual's tiles make the raw output row; its norm and residual add follow over the whole row)
EPILOGUE_RULES.register("norm_geglu", EpilogueRule(lambda a: geglu()))
EPILOGUE_RULES.register("linear_norm_residual", EpilogueRule(lambda a: PRODUCT))


def epilogue_of(op: str, attrs: Mapping) -> ThreadGraph:
    """The epilogue of a layer op applied with `attrs` (its attribute dict)."""
    rule = EPILOGUE_RULES.get(op)
    if rule is None:
        raise ValidationError(f"the layer op {op} has no epilogue")
    return rule.graph(attrs)


#: the epilogue inputs that are no product: the residual stream's column, the projection's bias, a row added to
#: the product before the residual
OPERANDS = ("residual", "bias", "addend")


def products(graph: ThreadGraph) -> tuple:
    """The names of the epilogue's product inputs, in order: one per weight matrix a column multiplies."""
    return tuple(v.name for v in graph.inputs if v.name not in OPERANDS)


def has_residual(graph: ThreadGraph) -> bool:
    return any(v.name == "residual" for v in graph.inputs)


def has_bias(graph: ThreadGraph) -> bool:
    return any(v.name == "bias" for v in graph.inputs)


def has_addend(graph: ThreadGraph) -> bool:
    return any(v.name == "addend" for v in graph.inputs)


def evaluate_op(op: str, attrs: Mapping, inputs: Mapping[str, np.ndarray], dtype: DType) -> np.ndarray:
    """The epilogue of a layer op over arrays of columns, rounded to `dtype` as the model rounds it: each
    node's result (eager ops), or once (an op whose rule says `rounded_once`)."""
    if EPILOGUE_RULES.lookup(op).rounded_once:
        value = evaluate(epilogue_of(op, attrs), inputs)
        return round_to_dtype(value, dtype).astype(np.float32).reshape(value.shape)
    return evaluate(epilogue_of(op, attrs), inputs, dtype)


def evaluate(graph: ThreadGraph, inputs: Mapping[str, np.ndarray], dtype: Optional[DType] = None) -> np.ndarray:
    """The epilogue over arrays of columns (float32 math). With `dtype`, the inputs and every node's
    result but those inside one PyTorch op (`within`) are rounded to it (eager PyTorch); without, nothing is
    rounded."""
    def rounded(x):
        x = np.asarray(x, np.float32)
        return round_to_dtype(x, dtype).astype(np.float32).reshape(x.shape) if dtype is not None else x

    inside = within(graph)
    env = {v.name: rounded(inputs[v.name]) for v in graph.inputs}
    for node in graph.nodes:
        with np.errstate(over="ignore"):   # (a sigmoid's exp(-x) of a large negative x: inf, the sigmoid 0)
            (value,) = node.opdef.reference([env[v.name] for v in node.inputs], node.attr_dict)
        value = np.asarray(value, np.float32)
        env[node.output.name] = value if node.output.name in inside else rounded(value)
    return env[graph.outputs[0].name]


def is_additive(graph: ThreadGraph, samples: int = 16, seed: int = 0) -> bool:
    """Whether f(a + b) = f(a) + f(b) over all inputs jointly (checked in float64 on random values):
    what lets tensor-parallel ranks apply the epilogue to their partial products, the residual given to
    one rank only, and sum the results."""
    rng = np.random.default_rng(seed)

    def f(values: dict) -> np.ndarray:
        env = dict(values)
        for node in graph.nodes:
            (env[node.output.name],) = node.opdef.reference([env[v.name] for v in node.inputs], node.attr_dict)
        return env[graph.outputs[0].name]

    a = {v.name: rng.standard_normal(samples) for v in graph.inputs}
    b = {v.name: rng.standard_normal(samples) for v in graph.inputs}
    both = {name: a[name] + b[name] for name in a}
    return bool(np.allclose(f(both), f(a) + f(b), rtol=1e-12, atol=1e-12))

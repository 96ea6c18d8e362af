"""The numpy reference forward of a model graph: float32 math, a KV cache, one token per step (a
prompt is prefilled as successive steps). The oracle of the simulator and, through the Hugging Face
cross-check, of the model definitions themselves."""
from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from mdsl.errors import ShapeError
from mdsl.ir.dtypes import DType, f32
from mdsl.megakernel.modelgraph.layers import StepContext
from mdsl.megakernel.modelgraph.model import TOKENS, ModelGraph


@attrs.frozen
class Generation:
    """The tokens after the prompt, and the logits of every step (one row per position)."""

    tokens: tuple
    logits: np.ndarray


def initial_states(graph: ModelGraph, prompt_ids: Sequence[int]) -> dict:
    """Zeroed state with the prompt in the token history."""
    if not 0 < len(prompt_ids) <= graph.max_positions:
        raise ShapeError(f"a prompt of {len(prompt_ids)} tokens does not fit {graph.max_positions} positions",
                         hint="give at least one token, and at most the model's max_positions")
    states = {s.name: np.zeros(s.shape, np.int32 if s.dtype.name == "i32" else np.float32) for s in graph.states}
    states[TOKENS][:len(prompt_ids)] = np.asarray(prompt_ids, np.int32)
    return states


def check_steps(graph: ModelGraph, prompt_ids: Sequence[int], max_new_tokens: int) -> int:
    steps = len(prompt_ids) - 1 + max_new_tokens
    if steps + 1 > graph.max_positions:
        raise ShapeError(f"{len(prompt_ids)} prompt tokens and {max_new_tokens} new ones need {steps + 1} positions; "
                         f"the model has {graph.max_positions}", hint="generate fewer tokens or give max_positions")
    return steps


class ReferenceModel:
    """`step()` runs one position; `generate()` prefills the prompt and decodes. The KV caches hold
    `kv_dtype` values: float32 (unrounded, the default), or the checkpoint's dtype (transformers' cache and
    the serving engine's pools: mdsl.serving.cpu.kv_dtype); a linear's input is rounded to `operand_dtype`
    (float32: unrounded, the default; the serving engine rounds to a 16-bit checkpoint's dtype)."""

    def __init__(self, graph: ModelGraph, weights: dict, kv_dtype: DType = f32, operand_dtype: DType = f32):
        self.graph, self.kv_dtype, self.operand_dtype = graph, kv_dtype, operand_dtype
        self.weights = {name: np.asarray(weights[name], np.float32) for name in (w.name for w in graph.weights)}

    def step(self, states: dict, ctx: StepContext):
        """Logits [1, vocab] and the next token at ctx.position; states are updated in place."""
        values = {**self.weights, **states}
        for node in self.graph.nodes:
            outs = node.opdef.reference([values[v.name] for v in node.inputs], node.attr_dict, ctx)
            values.update({v.name: out for v, out in zip(node.outputs, outs)})
        return values[self.graph.logits.name], int(values[self.graph.token.name][0])

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        steps = check_steps(self.graph, prompt_ids, max_new_tokens)
        states = initial_states(self.graph, prompt_ids)
        ctx_len = len(prompt_ids)
        logits = []
        for pos in range(steps):
            row, _ = self.step(states, StepContext(pos, ctx_len, kv_dtype=self.kv_dtype, operand_dtype=self.operand_dtype))
            logits.append(row.reshape(-1))
        new = tuple(int(t) for t in states[TOKENS][ctx_len:ctx_len + max_new_tokens])
        return Generation(new, np.stack(logits) if logits else np.zeros((0, self.graph.logits.shape[1]), np.float32))

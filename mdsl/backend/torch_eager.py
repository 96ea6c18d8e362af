"""Kernel graphs run op by op with PyTorch: the "PyTorch eager" baseline that `mdsl optimize` times a
plan against on a GPU. Each kernel-level operator has a rule in `TORCH_RULES`; torch is imported only
when a graph runs (it is never a dependency of mdsl)."""
from __future__ import annotations

from typing import Callable, Sequence

import attrs

from mdsl.ir.graph import KernelGraph
from mdsl.ir.ops import KERNEL
from mdsl.ir.rules import RuleTable


@attrs.frozen
class TorchRule:
    """An operator as PyTorch calls: `run(torch, input tensors, attrs dict)` -> its output tensors."""

    run: Callable


#: graph-defined operators have no rule: a graph with one is not run op by op
TORCH_RULES: RuleTable[TorchRule] = RuleTable(
    "PyTorch eager baseline", TorchRule, "mdsl.backend.torch_eager (TORCH_RULES)",
    needs=lambda op: KERNEL in op.levels and not op.is_graph_defined)


def _rms_norm(t, xs, a):
    x = xs[0]
    return [x * t.rsqrt(x.float().square().mean(dim=a["dim"], keepdim=True) + a["eps"]).to(x.dtype)]


def _split(t, xs, a):
    return list(t.split(xs[0], list(a["sizes"]), dim=a["dim"]))


_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "i32": "int32"}

for _name, _rule in {
    "exp": lambda t, xs, a: [t.exp(xs[0])],
    "silu": lambda t, xs, a: [t.nn.functional.silu(xs[0])],
    "gelu": lambda t, xs, a: [t.nn.functional.gelu(xs[0])],
    "relu": lambda t, xs, a: [t.relu(xs[0])],
    "sigmoid": lambda t, xs, a: [t.sigmoid(xs[0])],
    "sqrt": lambda t, xs, a: [t.sqrt(xs[0])],
    "rsqrt": lambda t, xs, a: [t.rsqrt(xs[0])],
    "square": lambda t, xs, a: [t.square(xs[0])],
    "neg": lambda t, xs, a: [t.neg(xs[0])],
    "reciprocal": lambda t, xs, a: [t.reciprocal(xs[0])],
    "mul_scalar": lambda t, xs, a: [xs[0] * a["value"]],
    "add_scalar": lambda t, xs, a: [xs[0] + a["value"]],
    "pow_scalar": lambda t, xs, a: [t.pow(xs[0], a["exponent"])],
    "clamp": lambda t, xs, a: [t.clamp(xs[0], a["min"], a["max"])],
    "cast": lambda t, xs, a: [xs[0].to(getattr(t, _DTYPES[a["dtype"].name]))],
    "add": lambda t, xs, a: [xs[0] + xs[1]],
    "sub": lambda t, xs, a: [xs[0] - xs[1]],
    "mul": lambda t, xs, a: [xs[0] * xs[1]],
    "div": lambda t, xs, a: [xs[0] / xs[1]],
    "matmul": lambda t, xs, a: [t.matmul(xs[0], xs[1])],
    "sum": lambda t, xs, a: [t.sum(xs[0], dim=a["dim"], keepdim=a["keepdim"])],
    "mean": lambda t, xs, a: [t.mean(xs[0], dim=a["dim"], keepdim=a["keepdim"])],
    "max": lambda t, xs, a: [t.amax(xs[0], dim=a["dim"], keepdim=a["keepdim"])],
    "rms_norm": _rms_norm,
    "concat": lambda t, xs, a: [t.cat(list(xs), dim=a["dim"])],
    "split": _split,
    "reshape": lambda t, xs, a: [xs[0].reshape(a["shape"])],
    "transpose": lambda t, xs, a: [xs[0].permute(a["perm"]).contiguous()],
}.items():
    TORCH_RULES.register(_name, TorchRule(_rule))


def supports(graph: KernelGraph) -> bool:
    """Whether every node of the graph has a torch rule (graph-defined ops have none)."""
    return all(n.op in TORCH_RULES for n in graph.nodes)


def torch_program(graph: KernelGraph):
    """A function of torch tensors that evaluates the graph, one PyTorch call per operator; the per-node
    work (rule lookup, attributes) is done once, here."""
    import torch

    steps = [(TORCH_RULES[n.op].run, [v.name for v in n.inputs], [v.name for v in n.outputs], n.attr_dict)
             for n in graph.nodes]
    in_names, out_names = [v.name for v in graph.inputs], [v.name for v in graph.outputs]

    def run(*tensors):
        env = dict(zip(in_names, tensors))
        for rule, ins, outs, attrs in steps:
            env.update(zip(outs, rule(torch, [env[name] for name in ins], attrs)))
        return [env[name] for name in out_names]

    return run


def run_torch(graph: KernelGraph, inputs: Sequence) -> list:
    """Evaluate the graph on torch tensors, one PyTorch call per operator."""
    return torch_program(graph)(*inputs)

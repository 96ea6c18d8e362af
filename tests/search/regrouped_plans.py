"""Candidates of a product regrouped into heads and normalised per head (Qwen3's q/k norm), one per kind of
choice: a grid over whole groups, rows and groups with a loop, and a split loop whose combine runs the norm;
for the backends' tests (the PTX simulator, the GPU)."""
from __future__ import annotations

import attrs

import mdsl
from mdsl import Tensor, f16
from mdsl.ir.graph import KernelGraph
from mdsl.search.dims import Labels
from mdsl.search.guided import LIFT_RULES, Choice, lift
from mdsl.search.layout import boundary_views


def regrouped_program(rows: int = 4, k: int = 256, n: int = 256, group: int = 64) -> KernelGraph:
    """x @ w regrouped into heads of `group` columns, normalised per head, weighted by g and regrouped back."""
    heads = n // group

    @mdsl.kernel(name="regrouped_heads")
    def program(x: Tensor[rows, k, f16], w: Tensor[k, n, f16], g: Tensor[1, 1, group, f16]):
        h = mdsl.reshape(x @ w, rows, heads, group)
        return mdsl.reshape(mdsl.rms_norm(h, eps=1e-6) * g, rows, n)

    return program.graph


def regrouped_candidates(rows: int = 4, k: int = 256, n: int = 256, group: int = 64) -> dict:
    """name -> the whole program with its core lifted under one choice (the views around it kept)."""
    heads = n // group
    graph = regrouped_program(rows, k, n, group)
    wrapped = boundary_views(graph, LIFT_RULES)
    labels = Labels(wrapped.core)
    row, column = (labels.label(wrapped.core.nodes[0].outputs[0].name, d) for d in (0, 1))
    loop = labels.label(graph.inputs[1].name, 0)
    choices = {"groups-grid": Choice(grid=((row, rows), (column, heads)), loop=None),
               "rows-and-groups-loop": Choice(grid=((row, 2), (column, heads // 2)), loop=loop, forloop=4),
               "split-loop-combine": Choice(grid=((column, heads),), loop=loop, forloop=2, split=2)}
    return {name: attrs.evolve(graph, nodes=wrapped.around(lift(wrapped.core, choice, labels)))
            for name, choice in choices.items()}

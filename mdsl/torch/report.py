"""`mdsl.torch.explain(model, *inputs)`: what the "mdsl" backend makes of a model, region by region."""
from __future__ import annotations

from collections import Counter
from typing import Optional

import attrs
import torch

from mdsl.search.config import SearchConfig
from mdsl.torch.backend import DEFAULT_SEARCH, compiler


@attrs.frozen
class RegionReport:
    """One region: its aten operators (in graph order), its operand and result types, and its plan:
    kernels and estimated time of the traced program and of the plan chosen."""

    name: str
    aten_ops: tuple
    inputs: tuple
    outputs: tuple
    kernels_before: int
    kernels_after: int
    seconds_before: float
    seconds_after: float
    provisional: bool
    no_plan: str = ""      # why the region has no plan (it runs its traced program unoptimized)

    def __str__(self) -> str:
        ops = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in Counter(self.aten_ops).items())
        plan = (f"{self.kernels_before} kernel(s) ({self.seconds_before * 1e6:.3g} us estimated) -> "
                f"{self.kernels_after} ({self.seconds_after * 1e6:.3g} us)")
        if self.no_plan:
            plan = f"none ({self.no_plan}); its {self.kernels_before} kernel(s) run unoptimized"
        elif self.provisional:
            plan += ", provisional (the search's time cap cut it short)"
        return (f"{self.name}: {len(self.aten_ops)} aten op(s): {ops}\n"
                f"    reads {', '.join(self.inputs)}; writes {', '.join(self.outputs)}\n"
                f"    plan: {plan}")


@attrs.frozen
class LeftToTorch:
    """Nodes that torch computes, grouped by operator and reason."""

    aten: str
    reason: str
    count: int

    def __str__(self) -> str:
        return f"{self.aten} x{self.count}: {self.reason}"


@attrs.frozen
class Report:
    """The regions of every graph the backend received, the operators left to torch (what keeps the
    regions apart), and what compiled them in each graph (`handoffs`: `mdsl.torch.backend.Handoff`s)."""

    graphs: int
    regions: tuple
    left_to_torch: tuple
    handoffs: tuple = ()

    def __str__(self) -> str:
        lines = [f"mdsl backend: {self.graphs} graph(s), {len(self.regions)} mdsl region(s), "
                 f"{sum(o.count for o in self.left_to_torch)} op(s) left to torch"]
        lines += [str(r) for r in self.regions]
        if self.left_to_torch:
            lines.append("left to torch:")
            lines += [f"    {o}" for o in self.left_to_torch]
        lines += [f"graph {k}: {h}" if self.graphs > 1 else str(h) for k, h in enumerate(self.handoffs)]
        return "\n".join(lines)


def explain(model, *inputs, search: Optional[SearchConfig] = None, inductor: bool = True, **kwargs) -> Report:
    """Compile `model` (a module or function) with the "mdsl" backend (`inductor` as in
    `mdsl.torch.compiler`), run it once on `inputs` (and keyword `kwargs`) without gradients, and report
    its regions with their plans (searched with `search`, default the backend's), the operators left to
    torch with the reason for each, and what compiled those."""
    config = DEFAULT_SEARCH if search is None else search
    graphs: list = []
    compiled = torch.compile(model, backend=compiler(config, inductor=inductor, on_graph=graphs.append))
    with torch.no_grad():
        compiled(*inputs, **kwargs)
    from mdsl.search.cost import estimate
    from mdsl.search.engine import SearchUnavailable

    regions = []
    for partitioned in graphs:
        for region in partitioned.regions:
            name = region.name if len(graphs) == 1 else f"graph {graphs.index(partitioned)} {region.name}"
            head = (name, tuple(region.aten_ops), tuple(str(s.type) for s in region.specs),
                    tuple(str(v.type) for v in region.graph().outputs))
            try:
                plan = region.kernel.optimize(*region.specs)
            except SearchUnavailable as e:
                traced = estimate(region.graph())
                regions.append(RegionReport(*head, traced.launches, traced.launches, traced.seconds, traced.seconds,
                                            False, e.message))
                continue
            regions.append(RegionReport(*head, plan.original_cost.launches, plan.cost.launches,
                                        plan.original_cost.seconds, plan.cost.seconds, plan.provisional))
    left = Counter(entry for partitioned in graphs for entry in partitioned.left.values())
    return Report(len(graphs), tuple(regions),
                  tuple(LeftToTorch(aten, reason, n) for (aten, reason), n in sorted(left.items())),
                  tuple(partitioned.handoff for partitioned in graphs))

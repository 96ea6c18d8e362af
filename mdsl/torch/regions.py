"""FX graphs of aten operators cut into regions that mdsl computes, and each region as an mdsl kernel.

A node is supported when the mapping table (`mdsl.torch.aten`) has its overload, every tensor it reads
and writes is an f16/bf16/f32 tensor of static shape and rank >= 1, the entry's condition holds, and the
lowering applied to traced tensors of those types gives torch's own result types (mdsl's shape and dtype
rules: torch promotes mixed dtypes, mdsl asks for a cast). torch's `CapabilityBasedPartitioner` groups
supported nodes into maximal regions that keep the graph acyclic; a region that only moves data (views,
transposes, copies) stays with torch, where it costs nothing. Each region becomes a `RegionKernel` (a
`KernelFunction` whose body replays the region's nodes through the table) called from the graph in the
region's place.
"""
from __future__ import annotations

import inspect
import operator
from typing import Optional, Sequence

import attrs
import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.tools_common import stable_topological_sort

from mdsl.errors import MdslError
from mdsl.frontend.kernel import KernelFunction
from mdsl.frontend.tensor import TensorSpec
from mdsl.frontend.tracer import KernelTracer, sanitize_name
from mdsl.ir.types import MAX_ELEMENTS
from mdsl.search.config import SearchConfig
from mdsl.torch.aten import aten_name, rule_of
from mdsl.torch.dtypes import host_results, mdsl_dtype


def _example(value):
    """The example value of an FX argument (a node's `meta["val"]`), anything else as it is."""
    return value.meta.get("val") if isinstance(value, Node) else value


def _spec_problem(value, what: str) -> Optional[str]:
    """Why an example value is no tensor mdsl holds, or None."""
    if not isinstance(value, torch.Tensor):
        return f"{what} is a {type(value).__name__} computed at run time, not a tensor"
    if any(not isinstance(d, int) for d in value.shape):
        return f"{what} has a symbolic shape {list(value.shape)} (compile with dynamic=False to specialise)"
    if mdsl_dtype(value.dtype) is None or not value.dtype.is_floating_point:
        return f"{what} is {str(value.dtype).replace('torch.', '')} (mdsl computes f16, bf16 and f32)"
    if value.dim() == 0:
        return f"{what} is a 0-dim tensor"
    if value.numel() == 0 or value.numel() > MAX_ELEMENTS:
        return f"{what} has {value.numel()} elements"
    return None


def _spec(value: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(int(d) for d in value.shape), mdsl_dtype(value.dtype))


def _results(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def unsupported_reason(node: Node) -> Optional[str]:
    """Why mdsl does not compute FX node `node` (a `call_function` of an aten graph), or None."""
    if node.op != "call_function":
        return f"a {node.op} node"
    if node.target is operator.getitem:
        source = node.args[0]
        return None if isinstance(source, Node) and unsupported_reason(source) is None else \
            "an element of a result that torch computes"
    rule = rule_of(node.target)
    if rule is None:
        return f"no mapping for {aten_name(node.target)}"
    for a in node.all_input_nodes:
        problem = _spec_problem(_example(a), f"operand {a.name}")
        if problem:
            return problem
    for k, out in enumerate(_results(node.meta.get("val"))):
        problem = _spec_problem(out, "the result" if k == 0 and not isinstance(node.meta.get("val"), (tuple, list))
                                else f"result {k}")
        if problem:
            return problem
    args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), _example)
    reason = rule.condition(args, kwargs)
    if reason:
        return reason
    return _lowering_problem(node)


def _lowering_problem(node: Node) -> Optional[str]:
    """Why the node's lowering, applied to traced tensors of its operands' types, fails or gives other
    types than torch's, or None."""
    tracer = KernelTracer("check")
    traced = {a: tracer.add_input(sanitize_name(a.name), _spec(_example(a)).type) for a in node.all_input_nodes}
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: traced[a])
    try:
        got = _results(rule_of(node.target).lower(args, kwargs))
    except MdslError as e:
        return f"mdsl: {e.message}"
    want = _results(node.meta["val"])
    for k, (g, w) in enumerate(zip(got, want)):
        spec = _spec(w)
        if (tuple(g.shape), g.dtype) != (spec.shape, spec.dtype):
            return f"mdsl's result {k} is {g.var.type}, torch's is {spec.type}"
    return None if len(got) == len(want) else f"mdsl gives {len(got)} result(s), torch {len(want)}"


class _Support(OperatorSupportBase):
    """The partitioner's question, answered by `unsupported_reason`; the reasons are kept."""

    def __init__(self):
        self.reasons: dict = {}

    def is_node_supported(self, submodules, node: Node) -> bool:
        reason = unsupported_reason(node)
        if reason is not None:
            self.reasons[node] = reason
        return reason is None


def _computes(node: Node) -> bool:
    rule = None if node.target is operator.getitem else rule_of(node.target)
    return rule is not None and rule.computes


class RegionKernel(KernelFunction):
    """The mdsl kernel of a region: its body replays the region's nodes through the mapping table. Its
    plans come from searches of the backend's configuration (only the target arch is the caller's)."""

    def __init__(self, region: "Region", search: SearchConfig):
        def body(*tensors):
            env = dict(zip(region.inputs, tensors))
            for node, target, node_args, node_kwargs in region.steps:
                args, kwargs = torch.fx.node.map_arg((node_args, node_kwargs), env.__getitem__)
                env[node] = args[0][args[1]] if target is operator.getitem else rule_of(target).lower(args, kwargs)
            return tuple(env[n] for n in region.outputs)

        # names that depend only on the region's position in its own program: regions alike (a model's
        # layers) trace to the same text, so one plan-cache entry serves them all
        body.__signature__ = inspect.Signature(
            [inspect.Parameter(f"in{k}", inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in range(len(region.inputs))])
        body.__qualname__ = body.__name__ = "mdsl_region"
        super().__init__(body, "mdsl_region")
        self.search = search

    def optimize(self, *args, config=None, cache=True, progress=None, log_path=None):
        search = self.search if config is None else attrs.evolve(self.search, arch=config.arch)
        return super().optimize(*args, config=search, cache=cache, progress=progress, log_path=log_path)


@attrs.define(eq=False)
class Region:
    """A maximal group of supported nodes: its nodes in graph order with their targets and arguments
    (`steps`, kept as they are when the region is found: the graph's nodes are replaced by the region's
    call), the values it reads (`inputs`) and those read outside it (`outputs`), the example types of the
    inputs, and its kernel."""

    name: str
    steps: tuple
    inputs: list
    outputs: list
    specs: tuple = ()
    kernel: Optional[RegionKernel] = None

    @property
    def nodes(self) -> list:
        return [step[0] for step in self.steps]

    @property
    def aten_ops(self) -> list:
        return [aten_name(target) for _, target, _, _ in self.steps if target is not operator.getitem]

    def graph(self):
        """The region's traced kernel graph."""
        return self.kernel.trace(*self.specs)

    def __call__(self, *tensors):
        """The region's results on torch tensors: CUDA tensors through the kernel's GPU path (torch's
        current stream, outputs from torch's allocator), CPU tensors through the reference interpreter."""
        if tensors and tensors[0].is_cuda:
            results = _results(self.kernel(*(t.contiguous() for t in tensors)))
            # a result that is an argument unchanged (a region returning what it reads) must not alias it
            return tuple(r.clone() if any(r is t for t in tensors) else r for r in results)
        return tuple(host_results(self.kernel(*tensors), self.graph()))


class RegionModule(torch.nn.Module):
    """A region as a submodule of the graph module that calls it."""

    def __init__(self, region: Region):
        super().__init__()
        self.region = region

    def forward(self, *tensors):
        return self.region(*tensors)


@attrs.frozen
class Partitioned:
    """An aten graph module with its regions replaced by calls of their kernels (`module`), the regions,
    and why each node left to torch is (FX node name -> (aten name, reason))."""

    module: GraphModule
    regions: tuple
    left: dict


def partition(gm: GraphModule, search: SearchConfig, prefix: str = "mdsl_region_") -> Partitioned:
    """Cut `gm` (an aten graph with example values in `meta["val"]`) into mdsl regions, in place."""
    support = _Support()
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups = [sorted(p.nodes, key=order.__getitem__) for p in partitioner.propose_partitions()]
    groups = sorted((g for g in groups if any(_computes(n) for n in g)), key=lambda g: order[g[0]])
    left = {n.name: (aten_name(n.target), reason) for n, reason in support.reasons.items()
            if n.op == "call_function" and n.target is not operator.getitem}
    regions = tuple(_region(f"{prefix}{k}", group, search) for k, group in enumerate(groups))
    renamed: dict = {}   # an earlier region's output -> the getitem of its call that replaces it
    for region in regions:
        renamed.update(_replace(gm, region, [renamed.get(a, a) for a in region.inputs]))
    stable_topological_sort(gm)
    gm.graph.lint()
    gm.recompile()
    return Partitioned(gm, regions, left)


def _region(name: str, nodes: Sequence[Node], search: SearchConfig) -> Region:
    members = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in members))
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    steps = tuple((n, n.target, n.args, n.kwargs) for n in nodes)
    region = Region(name, steps, inputs, outputs, tuple(_spec(_example(a)) for a in inputs))
    region.kernel = RegionKernel(region, search)
    return region


def _replace(gm: GraphModule, region: Region, operands: list) -> dict:
    """The region's nodes replaced by one call of its module on `operands` (its inputs as the graph now
    holds them) and one getitem per output; returns output node -> its getitem."""
    gm.add_submodule(region.name, RegionModule(region))
    graph = gm.graph
    nodes = region.nodes
    members = set(nodes)
    with graph.inserting_after(nodes[-1]):
        call = graph.call_module(region.name, tuple(operands))
    anchor, items = call, {}
    for k, out in enumerate(region.outputs):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, k))
        item.meta["val"] = out.meta.get("val")
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
        anchor = items[out] = item
    for n in reversed(nodes):
        graph.erase_node(n)
    return items

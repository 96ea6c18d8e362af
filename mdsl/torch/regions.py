"""FX graphs of aten operators cut into regions that mdsl computes, and each region as an mdsl kernel.

A node is supported when the mapping table (`mdsl.torch.aten`) has its overload, every tensor it reads
and writes is an f16/bf16/f32 tensor of rank >= 1 whose only symbolic dim (if any) is its leading one,
the entry's condition holds, and the lowering applied to traced tensors of those types gives torch's own
result types (mdsl's shape and dtype rules: torch promotes mixed dtypes, mdsl asks for a cast). Conditions
and that check see symbolic sizes as the sizes of the example that dynamo compiles for (their hints), so
they add no guard to the compiled graph. torch's `CapabilityBasedPartitioner` groups
supported nodes into maximal regions that keep the graph acyclic; a region that only moves data (views,
transposes, copies) stays with torch, where it costs nothing. Each region becomes a torch operator
(`mdsl.torch.custom_ops.region_op`) called from the graph in the region's place, on the region's tensors
and the symbolic sizes its nodes read. At run time the sizes are numbers: each distinct set of them has
its own `RegionKernel` (a `KernelFunction` whose body replays the region's nodes through the table), so
one compiled graph serves every size of a symbolic batch or token dim, each size's plan coming from the
plan cache (a shape family re-targets a plan found at another size without a search).

A region's results keep the layouts of the values they replace (`node.meta["val"]`): the graph's later
operators were traced on those, and some depend on them (a view of a transposed result; an operator whose
result follows its operand's layout, as an element-wise one or torch's fused attention does, then a view of
that).
A result that the example lays out other than row-major (a transposed one) is computed by the kernel in its
memory order, a permute of it being the kernel's last step (where the region's own transpose made it, the
two compose and the transpose is not computed), and returned as a view in the example's dim order; a
row-major result is the kernel's own, as it is.
"""
from __future__ import annotations

import hashlib
import inspect
import operator
from collections import Counter
from typing import Optional, Sequence

import attrs
import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.tools_common import stable_topological_sort

import mdsl.frontend.functions as F
from mdsl.errors import MdslError
from mdsl.frontend.kernel import KernelFunction
from mdsl.frontend.tensor import TensorSpec
from mdsl.frontend.tracer import KernelTracer, sanitize_name
from mdsl.ir.types import MAX_ELEMENTS
from mdsl.search.config import SearchConfig
from mdsl.torch.aten import aten_name, rule_of
from mdsl.torch.custom_ops import region_op
from mdsl.torch.dtypes import host_results, mdsl_dtype


#: views whose values a region replays without their strides
_VALUE_OPS = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
              torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}


def _example(value):
    """The example value of an FX argument (a node's `meta["val"]`), anything else as it is."""
    return value.meta.get("val") if isinstance(value, Node) else value


def _hint(size) -> Optional[int]:
    """A size as a number: an int, or a symbolic size's value in the example (None where it has none)."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else None
    return None


def _is_size(value) -> bool:
    return isinstance(value, torch.SymInt)


def _spec_problem(value, what: str) -> Optional[str]:
    """Why an example value is no tensor mdsl holds, or None."""
    if not isinstance(value, torch.Tensor):
        return f"{what} is a {type(value).__name__} computed at run time, not a tensor"
    shape = [_hint(d) for d in value.shape]
    if any(d is None for d in shape):
        return f"{what} has a size known only at run time (data-dependent) in {list(value.shape)}"
    if any(not isinstance(d, int) for d in value.shape[1:]):
        return (f"{what} has the symbolic shape {list(value.shape)} (mdsl specialises only a symbolic leading "
                f"dim per size; mark the others static)")
    if mdsl_dtype(value.dtype) is None or not value.dtype.is_floating_point:
        return f"{what} is {str(value.dtype).replace('torch.', '')} (mdsl computes f16, bf16 and f32)"
    if value.dim() == 0:
        return f"{what} is a 0-dim tensor"
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0 or numel > MAX_ELEMENTS:
        return f"{what} has {numel} elements"
    return None


def _spec(value: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(_hint(d) for d in value.shape), mdsl_dtype(value.dtype))


@attrs.frozen
class _Example:
    """A tensor as a rule's condition sees it: its shape in numbers (symbolic sizes as their hints)."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device


def _hinted(value):
    """An FX argument as conditions see it: tensors as `_Example`s, symbolic sizes as numbers."""
    value = _example(value)
    if isinstance(value, torch.Tensor):
        return _Example(tuple(_hint(d) for d in value.shape), value.dtype, value.device)
    return _hint(value) if _is_size(value) else value


def _results(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _layout(value: torch.Tensor) -> Optional[tuple]:
    """The order of an example result's dims from outermost to innermost in memory, where that is not
    their own (a transposed result), else None. A layout that is not dense (an expanded or a sliced
    result) is read as torch's `empty_like` reads it: dense, in the same order."""
    shape = [_hint(d) for d in value.shape]
    strides = [_hint(s) for s in value.stride()]
    if None in shape or None in strides:
        return None
    like = torch.empty_like(torch.empty_strided(shape, strides, device="meta"))
    if like.is_contiguous():
        return None
    # dense dims tie on a stride only where one has size 1, whose place in memory is immaterial
    return tuple(sorted(range(len(shape)), key=lambda d: (-like.stride(d), -shape[d])))


def _inverse(order: tuple) -> tuple:
    return tuple(sorted(range(len(order)), key=order.__getitem__))


def _laid_out(result: torch.Tensor, order: Optional[tuple]) -> torch.Tensor:
    """A copy of `result` whose dims lie in memory in `order` (None: row-major)."""
    if order is None:
        return result.clone(memory_format=torch.contiguous_format)
    return result.permute(order).clone(memory_format=torch.contiguous_format).permute(_inverse(order))


def _empty_laid_out(like: torch.Tensor, order: Optional[tuple]) -> torch.Tensor:
    """An empty tensor of `like`'s shape and dtype whose dims lie in memory in `order` (None: row-major)."""
    if order is None:
        return like.new_empty(like.shape)
    return like.new_empty([like.shape[d] for d in order]).permute(_inverse(order))


def _computes_tensors(node: Node) -> bool:
    """Whether an FX node's results are tensors (not sizes computed from symbolic sizes)."""
    return any(isinstance(v, torch.Tensor) for v in _results(node.meta.get("val")))


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
        if _is_size(_example(a)):
            if _hint(_example(a)) is None:
                return f"operand {a.name} is a size known only at run time (data-dependent)"
            continue
        problem = _spec_problem(_example(a), f"operand {a.name}")
        if problem:
            return problem
    for k, out in enumerate(_results(node.meta.get("val"))):
        problem = _spec_problem(out, "the result" if k == 0 and not isinstance(node.meta.get("val"), (tuple, list))
                                else f"result {k}")
        if problem:
            return problem
    args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), _hinted)
    reason = rule.condition(args, kwargs)
    if reason:
        return reason
    return _lowering_problem(node)


def _lowering_problem(node: Node) -> Optional[str]:
    """Why the node's lowering, applied to traced tensors of its operands' types, fails or gives other
    types than torch's, or None."""
    tracer = KernelTracer("check")
    traced = {a: _hint(_example(a)) if _is_size(_example(a)) else
              tracer.add_input(sanitize_name(a.name), _spec(_example(a)).type) for a in node.all_input_nodes}
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


_PERMUTES = (torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.t.default)


def _permutation(target, args: tuple, rank: int) -> Optional[tuple]:
    """The operand's dim behind each result dim of a transpose, permute or t step, else None."""
    if target is torch.ops.aten.permute.default:
        return tuple(d % rank for d in args[1])
    if target not in _PERMUTES:
        return None
    perm = list(range(rank))
    a, b = (0, rank - 1) if target is torch.ops.aten.t.default else (args[1] % rank, args[2] % rank)
    perm[a], perm[b] = perm[b], perm[a]
    return tuple(perm)


def _written(region: "Region") -> tuple:
    """Per output of the region: (the value the kernel computes, the permutation of it that the kernel
    returns, or None). An output laid out in memory in another order than its dims' (`kernel_layouts`)
    is returned as its permutation into that order; where it is the region's own transpose of a value,
    the two permutations compose, so that a transpose that the layout undoes is not computed at all."""
    steps = {node: (target, args) for node, target, args, _ in region.steps}
    written = []
    for node, order in zip(region.outputs, region.kernel_layouts):
        while order is not None and node in steps:
            perm = _permutation(*steps[node], len(order))
            if perm is None:
                break
            order, node = tuple(perm[d] for d in order), steps[node][1][0]
            order = None if order == tuple(range(len(order))) else order
        written.append((node, order))
    return tuple(written)


def _needed(steps: tuple, values) -> tuple:
    """The steps that the values depend on, in their order."""
    needed = set(values)
    for node, _, args, kwargs in reversed(steps):
        if node in needed:
            torch.fx.node.map_arg((args, kwargs), needed.add)
    return tuple(step for step in steps if step[0] in needed)


class RegionKernel(KernelFunction):
    """The mdsl kernel of a region at given values of the symbolic sizes it reads (`sizes`): its body
    replays the region's nodes through the mapping table and returns its outputs, each laid out as
    `Region.kernel_layouts` says (`_written`). Its plans come from searches of the backend's
    configuration (only the target arch is the caller's)."""

    def __init__(self, region: "Region", search: SearchConfig, sizes: tuple = ()):
        written = _written(region)
        steps = _needed(region.steps, [node for node, _ in written])

        def body(*tensors):
            env = dict(zip(region.inputs, tensors))
            env.update(zip(region.sizes, sizes))
            for node, target, node_args, node_kwargs in steps:
                args, kwargs = torch.fx.node.map_arg((node_args, node_kwargs), env.__getitem__)
                env[node] = args[0][args[1]] if target is operator.getitem else rule_of(target).lower(args, kwargs)
            return tuple(env[node] if order is None else F.permute(env[node], list(order)) for node, order in written)

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
    call), the tensors it reads (`inputs`), the symbolic sizes its nodes read (`sizes`), the values read
    outside it (`outputs`), the example types of the inputs (symbolic sizes as in the example), the
    backend's search, and its torch operator. `layouts`: per output, the order of its dims in memory
    where the example's is not row-major (`_layout`), else None; `kernel_layouts`: those the kernel
    writes (its result is that permutation of the output), else None: where the order moves a symbolic
    leading dim inward, the kernel keeps its result row-major (one program's plans serve the sizes of its
    leading dim) and torch copies it into the layout. `calls` counts the calls that ran mdsl's kernel, by
    `size_key` (the empty tuple where nothing is symbolic); `replays` those that ran torch's operators
    because the kernel does not trace at those sizes (`replay_reasons` says why)."""

    name: str
    steps: tuple
    inputs: list
    sizes: list
    outputs: list
    specs: tuple = ()
    search: Optional[SearchConfig] = None
    layouts: tuple = ()
    kernel_layouts: tuple = ()
    op: object = None
    kernels: dict = attrs.field(factory=dict)
    calls: Counter = attrs.field(factory=Counter)
    replays: Counter = attrs.field(factory=Counter)
    replay_reasons: dict = attrs.field(factory=dict)

    @property
    def nodes(self) -> list:
        return [step[0] for step in self.steps]

    @property
    def aten_ops(self) -> list:
        return [aten_name(target) for _, target, _, _ in self.steps if target is not operator.getitem]

    @property
    def example_sizes(self) -> tuple:
        """The values of `sizes` in the example the graph was compiled for."""
        return tuple(_hint(_example(s)) for s in self.sizes)

    def kernel_at(self, sizes: tuple) -> RegionKernel:
        """The region's kernel at these values of its symbolic sizes."""
        kernel = self.kernels.get(sizes)
        if kernel is None:
            kernel = self.kernels[sizes] = RegionKernel(self, self.search, sizes)
        return kernel

    @property
    def kernel(self) -> RegionKernel:
        """The kernel at the example's sizes."""
        return self.kernel_at(self.example_sizes)

    def graph(self):
        """The region's traced kernel graph at the example's sizes."""
        return self.kernel.trace(*self.specs)

    def __call__(self, tensors, sizes=()) -> tuple:
        """The region's results on torch tensors, laid out as `layouts` says: CUDA tensors through the
        kernel's GPU path (torch's current stream, outputs from torch's allocator), CPU tensors through
        the reference interpreter. At sizes where the kernel does not trace (a lowering that the example's
        sizes allowed refuses them), torch's own operators compute them."""
        sizes = tuple(int(s) for s in sizes)
        kernel = self.kernel_at(sizes)
        key = self.size_key(tensors, sizes)
        try:
            graph = kernel.trace(*tensors)
        except MdslError as e:
            self.replays[key] += 1
            self.replay_reasons.setdefault(key, e.message)
            return tuple(_laid_out(r, order) for r, order in zip(self.replay(tensors, sizes), self.layouts))
        self.calls[key] += 1
        if tensors and tensors[0].is_cuda:
            tensors = tuple(t.contiguous() for t in tensors)
            results = _results(kernel(*tensors))
            # a result that is an argument unchanged (a region returning what it reads) must not alias it
            results = tuple(r.clone() if any(r is t for t in tensors) else r for r in results)
        else:
            results = host_results(kernel(*tensors), graph)
        return self._from_kernel(results)

    def _from_kernel(self, results) -> tuple:
        """The kernel's results in the layouts of `layouts`: a view where the kernel wrote that order."""
        return tuple(r if order is None else r.permute(_inverse(order)) if written is not None else
                     _laid_out(r, order) for r, order, written in zip(results, self.layouts, self.kernel_layouts))

    def size_key(self, tensors, sizes) -> tuple:
        """The leading size of each input whose leading dim is symbolic, then the values of `sizes`."""
        leading = tuple(int(t.shape[0]) for t, a in zip(tensors, self.inputs)
                        if not isinstance(_example(a).shape[0], int))
        return leading + tuple(sizes)

    def replay(self, tensors, sizes=()) -> tuple:
        """The region's nodes run as torch's own operators (on fake tensors: its results' shapes). Views
        run as reshapes: the region reads values, and its operands' strides may differ from the example's
        (Inductor lays tensors out its own way)."""
        env = dict(zip(self.inputs, tensors))
        env.update(zip(self.sizes, sizes))
        for node, target, node_args, node_kwargs in self.steps:
            args, kwargs = torch.fx.node.map_arg((node_args, node_kwargs), env.__getitem__)
            env[node] = _VALUE_OPS.get(target, target)(*args, **kwargs)
        return tuple(env[n] for n in self.outputs)

    def fake(self, tensors, sizes=()) -> tuple:
        """The shapes, dtypes and layouts of the region's results (as `__call__` returns them)."""
        return tuple(_empty_laid_out(r, order) for r, order in zip(self.replay(tensors, sizes), self.layouts))


@attrs.frozen
class Partitioned:
    """An aten graph module with its regions replaced by calls of their operators (`module`), the
    regions, why each node left to torch is (FX node name -> (aten name, reason)), and what compiled the
    rest (`handoff`, set by the backend)."""

    module: GraphModule
    regions: tuple
    left: dict
    handoff: object = None


def partition(gm: GraphModule, search: SearchConfig, prefix: str = "mdsl_region_", *,
              arch: Optional[str] = None) -> Partitioned:
    """Cut `gm` (an aten graph with example values in `meta["val"]`) into mdsl regions, in place.
    `arch`: the GPU the graph runs on, where its regions' plans are looked up now: a region whose plan
    the cache lacks and the search cannot make on this machine (`mdsl.search.engine.search_unavailable`)
    is left to torch, with the reason, rather than run unoptimized."""
    support = _Support()
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups = [sorted(p.nodes, key=order.__getitem__) for p in partitioner.propose_partitions()]
    groups = sorted((g for g in groups if any(_computes(n) for n in g)), key=lambda g: order[g[0]])
    left = {n.name: (aten_name(n.target), reason) for n, reason in support.reasons.items()
            if n.op == "call_function" and n.target is not operator.getitem and _computes_tensors(n)}
    if arch is not None:
        groups = [g for g in groups if not _without_plan(g, search, arch, left)]
    regions = tuple(_region(f"{prefix}{k}", group, search) for k, group in enumerate(groups))
    renamed: dict = {}   # an earlier region's output -> the getitem of its call that replaces it
    for region in regions:
        renamed.update(_replace(gm, region, [renamed.get(a, a) for a in (*region.inputs, *region.sizes)]))
    stable_topological_sort(gm)
    gm.graph.lint()
    gm.recompile()
    return Partitioned(gm, regions, left)


def _without_plan(nodes: Sequence[Node], search: SearchConfig, arch: str, left: dict) -> bool:
    """Whether the group of nodes has no plan for `arch` that this machine can serve or search; if so,
    each of its nodes that computes a tensor is added to `left` with the reason."""
    from mdsl.search.engine import SearchUnavailable, search_unavailable

    unavailable = search_unavailable(search)
    if unavailable is None:
        return False
    region = _region("mdsl_region", nodes, search, operator_too=False)
    try:
        region.kernel.optimize(*region.specs, config=SearchConfig(arch=arch))
    except SearchUnavailable:
        reason = f"the plan cache has no plan for its region, and the search cannot run here ({unavailable})"
        left.update({n.name: (aten_name(n.target), reason) for n in nodes
                     if n.target is not operator.getitem and _computes_tensors(n)})
        return True
    except MdslError:   # a region that does not trace at the example's sizes: its calls replay torch's operators
        pass
    return False


def _region(name: str, nodes: Sequence[Node], search: SearchConfig, operator_too: bool = True) -> Region:
    members = set(nodes)
    reads = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in members))
    inputs = [a for a in reads if not _is_size(_example(a))]
    sizes = [a for a in reads if _is_size(_example(a))]
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    steps = tuple((n, n.target, n.args, n.kwargs) for n in nodes)
    layouts = tuple(_layout(_example(n)) for n in outputs)
    kernel_layouts = tuple(None if order is None or (order[0] != 0 and not isinstance(_example(n).shape[0], int))
                           else order for n, order in zip(outputs, layouts))
    region = Region(name, steps, inputs, sizes, outputs, tuple(_spec(_example(a)) for a in inputs), search,
                    layouts, kernel_layouts)
    if operator_too:
        region.op = region_op(f"region_{_digest(region)}", region, region.fake)
    return region


def _digest(region: Region) -> str:
    """A digest of what the region computes: its operators and constants, how its nodes connect, its
    operands' types (symbolic sizes by name), its results' layouts and the search. Regions alike share an
    operator."""
    index = {n: f"in{k}" for k, n in enumerate(region.inputs)}
    index.update({n: f"size{k}" for k, n in enumerate(region.sizes)})
    index.update({n: f"n{k}" for k, n in enumerate(region.nodes)})
    lines = [f"{index[a]}: {list(_example(a).shape)} {_example(a).dtype}" for a in region.inputs]
    for node, target, args, kwargs in region.steps:
        args, kwargs = torch.fx.node.map_arg((args, kwargs), index.__getitem__)
        lines.append(f"{index[node]} = {aten_name(target)}{args!r} {kwargs!r}")
    lines.append(f"return {[index[n] for n in region.outputs]} search {region.search!r}")
    if any(order is not None for order in region.layouts):
        lines.append(f"laid out {region.layouts} by the kernel {region.kernel_layouts}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _replace(gm: GraphModule, region: Region, operands: list) -> dict:
    """The region's nodes replaced by one call of its operator on `operands` (its inputs as the graph now
    holds them, then its sizes) and one getitem per output; returns output node -> its getitem."""
    graph = gm.graph
    nodes = region.nodes
    members = set(nodes)
    tensors, sizes = operands[:len(region.inputs)], operands[len(region.inputs):]
    with graph.inserting_after(nodes[-1]):
        call = graph.call_function(region.op, (list(tensors), list(sizes)))
    call.meta["mdsl_region"] = region.name
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

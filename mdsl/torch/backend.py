"""The dynamo backend `torch.compile(model, backend="mdsl")`.

Dynamo hands the backend a graph of torch calls; AOTAutograd (`aot_autograd`) turns it into a functional
graph of aten operators with example values, which `mdsl.torch.regions.partition` cuts into mdsl regions,
each called as a torch operator (its optimized plan on CUDA tensors, the reference interpreter on CPU
tensors). Inductor (`torch._inductor.compile_fx.compile_fx`) compiles the graph that calls them: it fuses
the operators mdsl leaves (layer norm, fused attention, integer ops) and calls each region as an opaque
extern kernel. Where Inductor fails on a graph, or there is nothing left for it to compile, the graph
runs as torch's eager operators, and `mdsl.torch.explain` says so. A backward pass, where inputs need
gradients, runs as torch's eager operators: mdsl computes forward passes only.

On CUDA tensors each region's plan is looked up when the graph is partitioned. Where the plan cache has none
and the search cannot run on the machine (z3 is not installed: `mdsl.search.engine.search_unavailable`),
the region's operators are left to Inductor, with that reason in the report, at once: compiling never
waits on a search that cannot find the plan the cache's key promises.

A symbolic dim (torch.compile's default dynamic shapes make a dim symbolic when a second size arrives)
that is the leading dim of every region tensor it appears in leaves the region in mdsl: the region's
kernel is traced per size at run time, so that one compiled graph serves every batch size.

dynamo's and functorch's helpers are imported where a graph is compiled: importing this module (as
`mdsl.torch.compiler` and `DEFAULT_SEARCH` do) loads torch but not them.

An inference graph (no input needs gradients) keeps its writes to its inputs (a static KV cache's update,
as Inductor keeps them), and where its inputs are CUDA tensors of static shapes and every input it writes
is one of dynamo's static inputs (parameters, buffers, tensors marked with
`torch._dynamo.mark_static_address`), its calls replay one CUDA graph of the whole compiled graph, mdsl's
regions and Inductor's kernels together (`mdsl.torch.cuda_graphs`): a small model's decode step, hundreds
of short kernels, then costs the host one graph launch instead of one launch per kernel.
`compiler(cuda_graphs=False)` launches the kernels one by one, as the graph's code calls them.
"""
from __future__ import annotations

import copy
import operator
import time
import warnings
from typing import Callable, Optional

import attrs
import torch

from mdsl.search.config import SearchConfig
from mdsl.torch.cuda_graphs import graphed, mutated_inputs
from mdsl.torch.regions import _computes_tensors, partition

#: The search a region's kernel runs on its first CUDA call (the plan cache answers later ones): short,
#: since a model has many regions; `compiler(search=...)` asks for a longer one.
DEFAULT_SEARCH = SearchConfig(budget_s=30.0, work=2_000)


@attrs.frozen
class Handoff:
    """What compiled the part of a graph that mdsl's regions leave: "inductor" or "eager" (torch's own
    operators, with the reason in `reason`), the number of operators it got, and its compile time;
    `cuda_graph`: whether the graph's calls replay a CUDA graph, or why not (empty where its inputs are not
    CUDA tensors or none was asked for)."""

    compiler: str
    ops: int
    seconds: float
    reason: str = ""
    cuda_graph: str = ""

    def __str__(self) -> str:
        if self.compiler == "inductor":
            text = f"Inductor compiled {self.ops} op(s) around the regions in {self.seconds:.3g} s"
        else:
            text = f"{self.ops} op(s) run as torch's eager operators: {self.reason}"
        return f"{text}; {self.cuda_graph}" if self.cuda_graph else text


def _eager(gm, example_inputs):
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)


def _left_ops(gm) -> int:
    """The graph's operators that compute tensors outside mdsl's regions."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
               and "mdsl_region" not in n.meta and _computes_tensors(n))


def _hand_off(gm, example_inputs, inductor: bool):
    """The compiled graph (a boxed function) and its `Handoff`."""
    from functorch.compile import make_boxed_func

    ops = _left_ops(gm)
    if not inductor:
        return make_boxed_func(gm.forward), Handoff("eager", ops, 0.0, "compiled with inductor=False")
    if ops == 0:
        return make_boxed_func(gm.forward), Handoff("eager", ops, 0.0, "mdsl's regions compute the whole graph")
    from torch._inductor.compile_fx import compile_fx

    fallback = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    start = time.perf_counter()
    try:
        compiled = compile_fx(gm, example_inputs)
    except Exception as e:   # Inductor's own failure, on a graph eager torch runs: the documented fallback
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        reason = f"Inductor failed ({type(e).__name__}: {message})"
        warnings.warn(f"mdsl backend: {reason}; the operators mdsl leaves run as torch's eager operators",
                      stacklevel=2)
        return make_boxed_func(fallback.forward), Handoff("eager", ops, 0.0, reason)
    return make_boxed_func(compiled), Handoff("inductor", ops, time.perf_counter() - start)


def _static_inputs() -> tuple:
    """Positions of the graph's inputs that dynamo knows to keep their addresses (parameters, buffers,
    tensors marked static), as AOTAutograd records them for the graph being compiled."""
    from torch._guards import TracingContext

    metadata = getattr(TracingContext.try_get(), "fw_metadata", None)
    return tuple(getattr(metadata, "static_input_indices", None) or ())


def _gpu_arch(example_inputs) -> Optional[str]:
    """The arch of the GPU the graph's example tensors are on (the first CUDA one), or None: on the host,
    regions run on the reference interpreter and need no plan."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            from mdsl.gpu.driver import target_arch

            return target_arch(value.device.index or 0)
    return None


def compiler(search: Optional[SearchConfig] = None, *, inductor: bool = True, cuda_graphs: bool = True,
             on_graph: Optional[Callable] = None) -> Callable:
    """A dynamo backend whose regions are searched with `search` (default `DEFAULT_SEARCH`) and whose
    other operators Inductor compiles (`inductor=False`: torch's eager operators run them, which skips
    Inductor's C++/Triton compile); an inference graph on CUDA tensors replays a CUDA graph where that
    computes what its calls compute (`cuda_graphs=False`: never); `on_graph(partitioned)` sees each aten
    graph's `mdsl.torch.regions.Partitioned` with its `Handoff` (what `explain` reads).
    `torch.compile(model, backend="mdsl")` is `compiler()`."""
    config = DEFAULT_SEARCH if search is None else search

    def forward(gm, example_inputs, inference: bool = False):
        # read first: Inductor's own AOTAutograd pass replaces the tracing context's metadata
        static = _static_inputs() if inference and cuda_graphs else ()
        partitioned = partition(gm, config, arch=_gpu_arch(example_inputs))
        written = mutated_inputs(partitioned.module.graph)   # before Inductor, which may rewrite the graph
        compiled, handoff = _hand_off(partitioned.module, example_inputs, inductor)
        if inference and cuda_graphs:
            compiled, note = graphed(compiled, example_inputs, static, written)
            handoff = attrs.evolve(handoff, cuda_graph=note)
        if on_graph is not None:
            on_graph(attrs.evolve(partitioned, handoff=handoff))
        return compiled

    def inference(gm, example_inputs):
        return forward(gm, example_inputs, inference=True)

    def backend(gm, example_inputs, **kwargs):
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=forward, bw_compiler=_eager, inference_compiler=inference,
                            keep_inference_input_mutations=True)(gm, example_inputs, **kwargs)

    return backend


#: what `backend="mdsl"` names
mdsl_backend = compiler()


def register_backend() -> None:
    """Register `mdsl_backend` with dynamo as "mdsl", unless dynamo knows that name already (from the
    entry point, which it loads on lookup, or an earlier registration)."""
    import torch._dynamo

    if "mdsl" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(mdsl_backend, name="mdsl")

"""The "mdsl" backend's compiled inference graphs replayed from CUDA graphs.

A decode step of a small model is hundreds of short kernels; launched one by one from Python (Inductor's
wrapper code, mdsl's region calls), the host's time per launch is the step's time. `GraphedForward` captures
the whole compiled graph into one CUDA graph and replays it, so that a call costs the host one graph launch.
It applies where a replay computes what a call computes (`graph_problem`): every input a CUDA tensor of one
GPU with static sizes and strides, and every input the graph writes (a static KV cache, its position) a
static one: a parameter, a buffer, or a tensor marked with `torch._dynamo.mark_static_address` (dynamo's
static inputs, whose addresses do not change from call to call).

Each call computes the graph once (a graph that writes its inputs, a cache position, must not run twice):
* the first runs the compiled function as it is, on torch's current stream, so that what compiles lazily
  (mdsl's plans and executables, Triton's autotuning) does so outside any capture;
* the second runs it on the graph's own stream, where the libraries then have their per-stream state
  (cuBLAS workspaces: none is allocated during a capture);
* the third captures it on that stream (a capture computes nothing) and replays it; later calls replay.
Before a replay, inputs that are not static are copied into the graph's own tensors, and static ones are
checked to be where they were at the capture (a moved one, a parameter reallocated, is captured again).
Results are copies of the graph's outputs, which the next replay overwrites, so that a result kept from an
earlier call stays as it was; copies keep each output's strides and offset, and outputs that share
storage share their copy (torch rebuilds views of an output from those); an output that aliases an input
is returned as it is. Where the capture fails, a warning says why and calls run the compiled function as it
is. A call made while the current stream is being captured (the caller's own CUDA graph) runs it as it is.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence

import torch


def mutated_inputs(graph: torch.fx.Graph) -> list:
    """Positions of the graph's inputs that an operator writes (`copy_` of a kept input mutation)."""
    placeholders = {node: k for k, node in enumerate(graph.find_nodes(op="placeholder"))}
    written = set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for k, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[k] if k < len(node.args) else node.kwargs.get(argument.name)
            if value in placeholders:
                written.add(placeholders[value])
    return sorted(written)


def graph_problem(example_inputs: Sequence, static: Sequence[int], mutated: Sequence[int]) -> Optional[str]:
    """Why calls of a graph with these example inputs cannot replay a CUDA graph, or None."""
    if not example_inputs:
        return "the graph has no inputs"
    devices = set()
    for k, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            return f"input {k} is a {type(x).__name__}, not a tensor"
        if x.device.type != "cuda":
            return f"input {k} is on {x.device}"
        if any(not isinstance(d, int) for d in (*x.shape, *x.stride())):
            return f"input {k} has symbolic sizes {list(x.shape)}"
        devices.add(x.device)
    if len(devices) > 1:
        return f"the inputs are on {len(devices)} GPUs"
    moving = sorted(set(mutated) - set(static))
    if moving:
        return f"the graph writes input(s) {moving}, whose addresses are not static"
    return None


class GraphedForward:
    """A boxed compiled function (it takes the list of inputs) whose calls replay a CUDA graph of it;
    `static`: positions of the inputs read in place (dynamo's static inputs); the others are copied."""

    _boxed_call = True

    def __init__(self, fn: Callable, static: Sequence[int], device):
        self.fn = fn
        self.static = frozenset(static)
        self.device = device
        self.calls = 0
        self.problem: Optional[str] = None   # why calls no longer replay a graph (the capture failed)
        self.stream = None
        self.graph = None
        self.buffers: dict = {}       # input position -> the graph's copy of that input
        self.addresses: list = []     # per input position: its address at the capture where read in place
        self.in_place: list = []      # the positions of inputs read in place
        self.outputs: list = []
        self.aliases: list = []       # per output: whether it shares storage with an input

    # -- the CUDA parts (a test replaces them with a simulation on the CPU)

    def _capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def _graph_stream(self):
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        return self.stream

    def _call_on_graph_stream(self, args: list) -> list:
        """The compiled function run on the graph's stream, ordered after and before the current one."""
        stream, current = self._graph_stream(), torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            outputs = self.fn(args)
        current.wait_stream(stream)
        for out in outputs:   # made on the graph's stream, used on the current one
            if isinstance(out, torch.Tensor) and out.is_cuda:
                out.record_stream(current)
        return outputs

    def _capture(self, inputs: list) -> tuple:
        """(a graph whose `replay()` computes `self.fn(inputs)` again, the outputs it writes)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.graph(graph, stream=self._graph_stream(),
                                                               capture_error_mode="thread_local"):
            outputs = self.fn(list(inputs))
        return graph, list(outputs)

    # -- the calls

    def __call__(self, args: list):
        self.calls += 1
        if self.problem is not None or self.calls == 1 or self._capturing():
            return self.fn(args)
        if self.calls == 2:
            return self._call_on_graph_stream(list(args))
        if self.graph is None or not self._still_in_place(args):
            try:
                self._record(args)
            except Exception as e:   # nothing ran: the calls go on uncaptured, once the reason is said
                self.graph = None
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                self.problem = f"{type(e).__name__}: {first}"
                warnings.warn(f"mdsl backend: capturing the compiled graph into a CUDA graph failed "
                              f"({self.problem}); its calls run uncaptured", stacklevel=2)
                return self.fn(args)
        self._load(args)
        self.graph.replay()
        return self._results()

    def _record(self, args: list) -> None:
        self.graph, self.outputs, self.buffers = None, [], {}
        inputs = list(args)
        for k, x in enumerate(args):
            # an input that overlaps itself (an expanded tensor) cannot be copied into: it is read in place
            if k not in self.static and not torch._debug_has_internal_overlap(x):
                inputs[k] = self.buffers[k] = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype,
                                                                  device=x.device)
        self.in_place = [k for k in range(len(args)) if k not in self.buffers]
        self.addresses = [None if k in self.buffers else x.data_ptr() for k, x in enumerate(args)]
        self._load(args)
        graph, outputs = self._capture(inputs)
        storages = {x.untyped_storage().data_ptr() for x in inputs}
        self.aliases = [isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in storages
                        for o in outputs]
        self.graph, self.outputs = graph, outputs

    def _still_in_place(self, args: list) -> bool:
        """Whether every input read in place is where it was at the capture."""
        same = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)   # CUDA builds have it
        if same is not None:
            return same(args, self.addresses, self.in_place)
        return all(args[k].data_ptr() == self.addresses[k] for k in self.in_place)

    def _load(self, args: list) -> None:
        if self.buffers:
            positions = list(self.buffers)
            torch._foreach_copy_([self.buffers[k] for k in positions], [args[k] for k in positions])

    def _results(self) -> list:
        """Copies of the outputs (strides and offsets kept; outputs of one storage share its copy)."""
        copies: dict = {}
        results = []
        for out, alias in zip(self.outputs, self.aliases):
            if not isinstance(out, torch.Tensor) or alias:
                results.append(out)
                continue
            storage = out.untyped_storage()
            copy = copies.get(storage.data_ptr())
            if copy is None:
                copy = copies[storage.data_ptr()] = storage.clone()
            results.append(torch.empty(0, dtype=out.dtype, device=out.device).set_(
                copy, out.storage_offset(), out.size(), out.stride()))
        return results


def graphed(fn: Callable, example_inputs: Sequence, static: Sequence[int], mutated: Sequence[int]) -> tuple:
    """(`fn`, a compiled boxed function of a graph with these example inputs, static inputs and inputs it
    writes, as a `GraphedForward` where its calls can replay a CUDA graph, else `fn` itself; what to say
    about it: "" where no input is a CUDA tensor)."""
    problem = graph_problem(example_inputs, static, mutated)
    if problem is None:
        return GraphedForward(fn, [k for k in static if k < len(example_inputs)], example_inputs[0].device), \
            "its calls replay a CUDA graph"
    on_cuda = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    return fn, (f"no CUDA graph: {problem}" if on_cuda else "")

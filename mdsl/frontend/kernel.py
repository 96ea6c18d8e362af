"""`@mdsl.kernel`: a Python function traced into a kernel graph, per shape/dtype signature."""
from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Callable, Optional, Sequence

import numpy as np

from mdsl.errors import DTypeError, MdslError, ShapeError, TraceError
from mdsl.frontend.source import caller_frame, caller_loc
from mdsl.frontend.tensor import TensorSpec
from mdsl.frontend.tracer import _ACTIVE_KERNEL_TRACERS, KernelTracer, SymbolicTensor, common_tracer, sanitize_name
from mdsl.gpu.signature import as_outputs, call_key
from mdsl.ir.dtypes import dtype_of_array
from mdsl.ir.graph import KernelGraph
from mdsl.ir.ops import KERNEL
from mdsl.ir.types import check_shape


_DLPACK_CUDA_DEVICES = (2, 13)   # kDLCUDA, kDLCUDAManaged


def _is_device_array(value) -> bool:
    """Whether an argument lives on the GPU: torch CUDA tensors and mdsl DeviceArrays (`is_cuda`),
    `__cuda_array_interface__` exporters, and DLPack exporters on a CUDA device."""
    is_cuda = getattr(value, "is_cuda", None)
    if isinstance(is_cuda, bool):
        return is_cuda
    if hasattr(value, "__cuda_array_interface__"):
        return True
    dlpack_device = getattr(value, "__dlpack_device__", None)
    return dlpack_device is not None and dlpack_device()[0] in _DLPACK_CUDA_DEVICES


def _to_host(value) -> np.ndarray:
    """A numpy view of a host array (numpy, or a CPU torch tensor; torch bf16 goes through float32)."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch"):
        t = value.detach()
        return t.float().numpy() if str(t.dtype) == "torch.bfloat16" else t.numpy()
    return np.asarray(value)


_STORAGE = {"f16": np.float16, "bf16": np.float32, "f32": np.float32, "i32": np.int32}
_MAX_PREPARED_CALLS = 256   # GPU call signatures kept per kernel; past them the cache starts again


class KernelFunction:
    """What `@mdsl.kernel` returns. Call it with arrays, or inspect `.graph` / `.trace(...)`."""

    def __init__(self, fn: Callable, name: Optional[str] = None, scope: Optional[dict] = None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = name or fn.__name__
        self.signature = inspect.signature(fn)
        self.params = list(self.signature.parameters.values())
        for p in self.params:
            if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                raise TraceError(f"kernel {self.name}: parameter {p.name} must be a plain positional parameter",
                                 loc=frame_loc_of(fn), hint="*args, **kwargs and keyword-only parameters are not traced")
        self.annotations = self._read_annotations(scope)
        self._graphs: dict = {}
        self._tracing: set = set()      # signatures being traced now (a kernel that calls itself)
        self._executables: dict = {}   # ((shape, dtype name, device) per argument, backend) -> runtime.Executable
        self._calls: dict = {}         # mdsl.gpu.signature.call_key -> mdsl.gpu.calls.PreparedCall
        self._last_call = None         # the prepared call that answered last (its `fast` where it has one), tried first
        self.tunings: list = []        # the autotune.TuneResult of each first GPU call that tuned, in call order
        self._arg_labels = tuple(f"kernel {self.name}: argument {p.name}" for p in self.params)

    def _read_annotations(self, scope: Optional[dict]) -> dict:
        # string annotations (from __future__ import annotations) may name the defining scope's locals
        try:
            hints = inspect.get_annotations(self.fn, eval_str=True, locals=scope)
        except MdslError as e:
            e.loc = frame_loc_of(self.fn)
            raise
        except Exception as e:  # a name in a string annotation that does not resolve
            raise TraceError(f"kernel {self.name}: cannot evaluate its annotations ({e})", loc=frame_loc_of(self.fn),
                             hint="annotations may use module-level names and the locals of the function that "
                                  "defines the kernel")
        specs = {}
        for p in self.params:
            hint = hints.get(p.name)
            if isinstance(hint, TensorSpec):
                specs[p.name] = hint
            elif hint is not None:
                raise TraceError(f"kernel {self.name}: parameter {p.name} is annotated {hint!r}, not Tensor[...]",
                                 loc=frame_loc_of(self.fn), hint="write x: Tensor[16, 4096, mdsl.f16], or leave it "
                                                                 "unannotated to take the shape from the first call")
        return specs

    def __repr__(self) -> str:
        return f"<mdsl.kernel {self.name}>"

    # -- tracing ---------------------------------------------------------------------------------

    def _check_arity(self, args: Sequence) -> None:
        if len(args) != len(self.params):
            raise TraceError(f"kernel {self.name} takes {len(self.params)} tensor(s), got {len(args)}",
                             loc=caller_loc(), hint=f"call it as {self.name}({', '.join(p.name for p in self.params)})")

    def _specs(self, args: Sequence) -> tuple:
        self._check_arity(args)
        specs = []
        for p, a in zip(self.params, args):
            spec = a if isinstance(a, TensorSpec) else self._spec_of(p.name, a)
            want = self.annotations.get(p.name)
            if want is not None and want.shape == spec.shape and want.dtype != spec.dtype:
                raise DTypeError(f"kernel {self.name}: argument {p.name} is {spec} but is annotated {want}",
                                 loc=caller_loc(), hint=f"convert it to {want.dtype.long_name} first")
            if want is not None and want != spec:
                raise ShapeError(f"kernel {self.name}: argument {p.name} is {spec} but is annotated {want}",
                                 loc=caller_loc(), hint=f"pass a {want.dtype.long_name} array of shape {list(want.shape)}")
            specs.append(spec)
        return tuple(specs)

    def _spec_of(self, name: str, value) -> TensorSpec:
        shape = getattr(value, "shape", None)
        if shape is None or not hasattr(value, "dtype"):
            raise TraceError(f"kernel {self.name}: argument {name} is a {type(value).__name__}, not an array",
                             loc=caller_loc(), hint="pass numpy arrays, torch tensors or mdsl.Tensor[...] specs")
        try:
            dtype = dtype_of_array(value)
        except DTypeError as e:
            raise DTypeError(f"kernel {self.name}: argument {name}: {e.message}", loc=caller_loc(), hint=e.hint)
        dims = tuple(int(d) for d in shape)
        try:
            check_shape(dims, dtype, f"kernel {self.name}: argument {name}")
        except MdslError as e:
            raise e.with_loc(caller_loc())
        return TensorSpec(dims, dtype)

    def _annotated_specs(self) -> tuple:
        missing = [p.name for p in self.params if p.name not in self.annotations]
        if missing:  # points at the definition: the caller may be mdsl's command line, not the user's code
            raise TraceError(f"kernel {self.name}: parameter(s) {', '.join(missing)} have no Tensor[...] annotation",
                             loc=frame_loc_of(self.fn),
                             hint="annotate them (x: Tensor[16, 4096, mdsl.f16]), or call .trace(...) / the kernel "
                                  "with arrays")
        return tuple(self.annotations[p.name] for p in self.params)

    def trace(self, *args) -> KernelGraph:
        """The kernel graph for these arguments' shapes and dtypes (arrays or Tensor[...] specs); cached."""
        specs = self._specs(args) if args else self._annotated_specs()
        graph = self._graphs.get(specs)
        if graph is None:
            graph = self._graphs[specs] = self._trace(specs)
        return graph

    @property
    def graph(self) -> KernelGraph:
        """The kernel graph of the annotated signature."""
        return self.trace()

    def _trace(self, specs: tuple) -> KernelGraph:
        from mdsl.ir.dump import dump_ir

        if specs in self._tracing:
            raise TraceError(f"kernel {self.name} calls itself with the same shapes, which never ends",
                             loc=caller_loc(), hint="tracing runs the Python function: write the repetition as a "
                                                    "Python loop over a fixed count instead of recursion")
        tracer = KernelTracer(sanitize_name(self.name))   # the IR's names are identifiers: `<lambda>` is not
        args = [tracer.add_input(p.name, s.type) for p, s in zip(self.params, specs)]
        _ACTIVE_KERNEL_TRACERS.append(tracer)
        self._tracing.add(specs)
        try:
            result = self.fn(*args)
        finally:
            self._tracing.discard(specs)
            _ACTIVE_KERNEL_TRACERS.pop()
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        for i, out in enumerate(outputs):
            if not isinstance(out, SymbolicTensor) or out.tracer is not tracer:
                what = f"output {i}" if len(outputs) > 1 else "the result"
                raise TraceError(f"kernel {self.name}: {what} is {type(out).__name__}, not a tensor of this kernel",
                                 loc=frame_loc_of(self.fn),
                                 hint="return a traced tensor or a tuple of them (computed from the parameters)")
        graph = tracer.finish(outputs)
        dump_ir("trace", graph)
        return graph

    # -- optimizing ------------------------------------------------------------------------------

    def optimize(self, *args, config=None, cache=True, progress=None, log_path=None):
        """The best verified plan for these arguments' shapes (as in `.trace`; none: the annotated
        signature), from the plan cache or a search (`mdsl.search.engine.optimize`). No GPU needed.
        `progress`: None (a status line on stderr while it searches, when stderr is a terminal), True
        (always), False (never), or a callable given the search's `SearchStats` now and then."""
        # imported here: the frontend must not pull in the search (and its processes) at import time
        from mdsl.search.config import SearchConfig
        from mdsl.search.engine import optimize

        return optimize(self.trace(*args), config if config is not None else SearchConfig(), cache=cache,
                        progress=progress, log_path=log_path)

    # -- running ---------------------------------------------------------------------------------

    def __call__(self, *args, out=None, stream=None, backend: str = "cuda", **kwargs):
        """Run the kernel. Arguments are positional or named by the kernel's parameters. GPU arrays
        (torch CUDA tensors, mdsl DeviceArrays, anything with `__cuda_array_interface__` or a CUDA
        `__dlpack__`) run the optimized program on the GPU: `out` (one array, or a tuple with one per
        output) receives the results, `stream` orders the launches (default: torch's current stream for
        torch tensors, else the legacy default stream), `backend` picks the code generator ("cuda": CUDA
        C++ by NVRTC; "ptx": PTX by llvmlite). The first GPU call with a given signature (each array's
        type, shape, dtype, device and layout; out= and stream= given or not) checks everything and
        compiles; a repeated one reads the data pointers, allocates the outputs and launches
        (mdsl.gpu.calls). Host arrays (numpy, CPU torch) run through the numpy reference interpreter.
        Inside another kernel's trace, the call records this kernel's operations there (its graph is
        inlined)."""
        if kwargs:
            args = self._positional(args, kwargs)
        prepared = self._last_call
        if prepared is not None:   # a GPU call was checked before: this signature again reads, allocates, launches
            try:
                results = prepared(args, out, stream, backend)
                if results is None and len(self._calls) > 1:   # another signature checked before?
                    prepared = self._prepared(args, out, stream, backend)
                    if prepared is not None:
                        results = prepared(args, out, stream, backend)
            except MdslError as e:
                raise e.with_loc(caller_loc())
            if results is not None:
                return results
        if any(isinstance(a, SymbolicTensor) for a in args):
            if out is not None or stream is not None:
                raise TraceError(f"kernel {self.name} called inside a trace with out= or stream=", loc=caller_loc(),
                                 hint="inside a kernel, call another kernel with its tensors only; its results are "
                                      "returned")
            return self._inline(args)
        if out is not None or stream is not None or any(_is_device_array(a) for a in args):
            try:
                return self._run_on_gpu(args, out, stream, backend)
            except MdslError as e:
                raise e.with_loc(caller_loc())
        graph = self.trace(*args)
        from mdsl.backend.reference import run_kernel_graph

        outs = run_kernel_graph(graph, [_to_host(a) for a in args], precision="float32", round_storage=True)
        results = tuple(np.asarray(o).astype(_STORAGE[v.type.dtype.name]) for o, v in zip(outs, graph.outputs))
        return results[0] if len(results) == 1 else results

    def _prepared(self, args: Sequence, out, stream, backend: str):
        """The prepared call of this call's signature, made the one tried first; None where there is none."""
        try:
            prepared = self._calls.get(call_key(args, out, stream, backend))
        except Exception:   # not only torch tensors and DeviceArrays: the checked path says what is wrong
            return None
        if prepared is not None:
            self._last_call = prepared.fast or prepared
        return prepared

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        """The arguments in parameter order, from positional and named ones."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TraceError(f"kernel {self.name}: {e}", loc=caller_loc(),
                             hint=f"call it as {self.name}({', '.join(p.name for p in self.params)}); out=, "
                                  "stream= and backend= are the call's own options") from None
        return tuple(bound.arguments[p.name] for p in self.params)

    def _inline(self, args: Sequence):
        """This kernel applied to tensors of the kernel being traced: its nodes recorded there."""
        self._check_arity(args)
        for p, a in zip(self.params, args):
            if not isinstance(a, SymbolicTensor):
                raise TraceError(f"kernel {self.name}: argument {p.name} is a {type(a).__name__}, not a tensor of "
                                 "the kernel being traced", loc=caller_loc(),
                                 hint="inside a kernel, pass another kernel tensors computed from your parameters")
        tracer = common_tracer(args, f"kernel {self.name}")
        if tracer.level != KERNEL:
            raise TraceError(f"kernel {self.name} is called inside a block graph", loc=caller_loc(),
                             hint="call it outside the `with mdsl.block_graph(...)` block, on kernel tensors")
        graph = self.trace(*(TensorSpec(a.shape, a.dtype) for a in args))
        results = tracer.inline(graph, args)
        return results[0] if len(results) == 1 else results

    def _run_on_gpu(self, args: Sequence, out, stream, backend: str = "cuda"):
        """The checked call: every argument adapted and checked, the executable looked up (compiled on a
        miss), the launch; then, under the call's key, what a repeated call needs (mdsl.gpu.calls)."""
        # imported here: `import mdsl` must not load cuda.bindings (nor torch)
        from mdsl.backend.cuda import runtime
        from mdsl.gpu.calls import PreparedCall

        runtime.check_backend(backend)
        runtime.require_gpu()
        self._check_arity(args)
        handle = runtime.launch_stream(args, stream)
        runtime.release_pending(handle)
        views = [runtime.device_view(a, label, handle) for a, label in zip(args, self._arg_labels)]
        for view, label in zip(views, self._arg_labels):
            if view.device != views[0].device:
                raise runtime.ArgumentError(f"{label} is on GPU {view.device}, but argument {self.params[0].name} "
                                            f"is on GPU {views[0].device}", hint="move every argument to the same GPU")
        exe_key = (tuple((v.shape, v.dtype.name, v.device) for v in views), backend)
        executable = self._executables.get(exe_key)
        if executable is None:
            executable = self._executables[exe_key] = self._compile(views, backend)
        outputs = None if out is None else as_outputs(out)
        torch_outputs = out is None and any(runtime.is_torch_tensor(a) for a in args)
        results = executable.launch_views(views, outputs, handle, inputs_checked=True, torch_outputs=torch_outputs)
        prepared = PreparedCall.of(executable, args, outputs, stream_given=stream is not None,
                                   torch_outputs=torch_outputs, backend=backend)
        if prepared is not None:   # only torch tensors and DeviceArrays, whose signatures are keys
            if len(self._calls) >= _MAX_PREPARED_CALLS:
                self._calls.clear()
            self._calls[call_key(args, out, stream, backend)] = prepared
            self._last_call = prepared.fast or prepared
        return results[0] if len(results) == 1 else results

    def _compile(self, views: Sequence, backend: str = "cuda"):
        """The executable for these arguments' shapes, dtypes and device: plan, emit, compile, load."""
        from mdsl.backend.cuda import runtime

        specs = tuple(TensorSpec(v.shape, v.dtype) for v in views)
        device = views[0].device if views else 0
        arch = runtime.target_arch(device)
        plan = self._gpu_plan(specs, arch)
        if plan is None:
            return runtime.compile_graph(self.trace(*specs), arch=arch, device=device, backend=backend)
        graph, options = self._tuned(plan, device) if backend == "cuda" and _autotune_first_call() \
            else (plan.graph, None)
        return runtime.compile_graph(graph, arch=arch, device=device, backend=backend, options=options)

    def _gpu_plan(self, specs: tuple, arch: str):
        """The optimized plan, or None where the plan cache has none and the search cannot run (a module it
        needs, such as z3, is not installed): the traced program then runs unoptimized."""
        from mdsl.search.config import SearchConfig
        from mdsl.search.engine import SearchUnavailable

        try:
            return self.optimize(*specs, config=SearchConfig(arch=arch))
        except SearchUnavailable as e:
            warnings.warn(f"kernel {self.name}: running the traced program unoptimized: {e.message}", stacklevel=4)
        except ModuleNotFoundError as e:
            warnings.warn(f"kernel {self.name}: running the traced program unoptimized: the search needs "
                          f"{e.name}, which is not installed", stacklevel=4)
        return None

    def _tuned(self, plan, device: int) -> tuple:
        """(graph, CUDA options) of the fastest correct of the plan's candidates and the program as written
        under a few lowering options, timed on the GPU (`autotune.first_call_set`; cached per device, so
        that only the first call of a program on a machine tunes); the plan's choice as lowered by default
        where no variant runs correctly."""
        from mdsl.backend.cuda import autotune

        todo = autotune.first_call_set(plan)
        try:
            best = autotune.autotune(todo.graphs, plan.original, spaces=todo.spaces, names=todo.names, device=device,
                                     samples=10, calls=5, budget_s=autotune.FIRST_CALL_BUDGET_S, checked=True)
        except MdslError as e:
            warnings.warn(f"kernel {self.name}: running the plan's choice untuned: {e.message}", stacklevel=4)
            return plan.graph, None
        self.tunings.append(best)
        return best.graph, best.options


def _autotune_first_call() -> bool:
    """Whether a kernel's first GPU call tunes its plan (`Kernel._tuned`): yes, unless $MDSL_AUTOTUNE is 0
    (the GPU tests, which check each plan's own lowering, and callers that tune ahead of time)."""
    return os.environ.get("MDSL_AUTOTUNE", "").strip().lower() not in ("0", "false", "off", "no")


def frame_loc_of(fn: Callable):
    """The location of a function's definition."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    from mdsl.errors import SourceLoc

    return SourceLoc(code.co_filename, code.co_firstlineno)


def kernel(fn: Optional[Callable] = None, *, name: Optional[str] = None):
    """Decorator: trace `fn` into a kernel graph. Usable as @mdsl.kernel or @mdsl.kernel(name=...)."""
    frame = caller_frame()
    scope = dict(frame.f_locals) if frame is not None else None
    if fn is None:
        return lambda f: KernelFunction(f, name, scope)
    return KernelFunction(fn, name, scope)

"""`@mdsl.kernel`: a Python function traced into a kernel graph, per shape/dtype signature."""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional, Sequence

import numpy as np

from mdsl.errors import DTypeError, MdslError, ShapeError, TraceError, UnsupportedError
from mdsl.frontend.source import caller_frame, caller_loc
from mdsl.frontend.tensor import TensorSpec
from mdsl.frontend.tracer import _ACTIVE_KERNEL_TRACERS, KernelTracer, SymbolicTensor
from mdsl.ir.dtypes import dtype_of_array
from mdsl.ir.graph import KernelGraph


def _is_device_array(value) -> bool:
    if hasattr(value, "__cuda_array_interface__"):
        return True
    return bool(getattr(value, "is_cuda", False))


def _to_host(value) -> np.ndarray:
    """A numpy view of a host array (numpy, or a CPU torch tensor; torch bf16 goes through float32)."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch"):
        t = value.detach()
        return t.float().numpy() if str(t.dtype) == "torch.bfloat16" else t.numpy()
    return np.asarray(value)


_STORAGE = {"f16": np.float16, "bf16": np.float32, "f32": np.float32, "i32": np.int32}


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

    def _specs(self, args: Sequence) -> tuple:
        if len(args) != len(self.params):
            raise TraceError(f"kernel {self.name} takes {len(self.params)} tensor(s), got {len(args)}",
                             loc=caller_loc(), hint=f"call it as {self.name}({', '.join(p.name for p in self.params)})")
        specs = []
        for p, a in zip(self.params, args):
            spec = a if isinstance(a, TensorSpec) else self._spec_of(p.name, a)
            want = self.annotations.get(p.name)
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
        return TensorSpec(tuple(int(d) for d in shape), dtype)

    def _annotated_specs(self) -> tuple:
        missing = [p.name for p in self.params if p.name not in self.annotations]
        if missing:
            raise TraceError(f"kernel {self.name}: parameter(s) {', '.join(missing)} have no Tensor[...] annotation",
                             loc=caller_loc(), hint="annotate them, or call .trace(...) / the kernel with arrays")
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

        tracer = KernelTracer(self.name)
        args = [tracer.add_input(p.name, s.type) for p, s in zip(self.params, specs)]
        _ACTIVE_KERNEL_TRACERS.append(tracer)
        try:
            result = self.fn(*args)
        finally:
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

    # -- running ---------------------------------------------------------------------------------

    def __call__(self, *args):
        """Run the kernel. Host (numpy / CPU torch) arrays run through the numpy reference interpreter."""
        graph = self.trace(*args)
        if any(_is_device_array(a) for a in args):
            raise UnsupportedError(f"kernel {self.name}: GPU arrays were passed, but this version of mdsl has no "
                                   "GPU backend yet", loc=caller_loc(),
                                   hint="pass numpy arrays to run the reference interpreter")
        from mdsl.backend.reference import run_kernel_graph

        outs = run_kernel_graph(graph, [_to_host(a) for a in args], precision="float32", round_storage=True)
        results = tuple(np.asarray(o).astype(_STORAGE[v.type.dtype.name]) for o, v in zip(outs, graph.outputs))
        return results[0] if len(results) == 1 else results


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

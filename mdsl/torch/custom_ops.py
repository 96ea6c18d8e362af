"""`@mdsl.kernel`s as torch custom operators (`torch.ops.mdsl.<name>`).

The operator's schema takes the kernel's parameters as tensors and returns a list of tensors (one per
output of the kernel's trace for the arguments' shapes). Its fake implementation traces the kernel for
the fake arguments' shapes and dtypes and returns empty tensors of the trace's output types, so that
torch.compile captures a call without a graph break; on CUDA tensors it calls the kernel's GPU path (on
torch's current stream, its outputs from torch's caching allocator: what a CUDA graph capture needs), on
CPU tensors the reference interpreter.

An operator's name is the kernel's name and a digest of where it is defined (module, qualified name,
parameters), so that it is the same in every process that defines the kernel the same way; another
kernel of the same name and digest (a kernel defined again) gets a numbered name of its own.

The "mdsl" backend's regions are operators of this library too (`region_op`): `region_<digest>(Tensor[]
tensors, SymInt[] sizes) -> Tensor[]`, named by a digest of what the region computes, so that Inductor
(whose compiled graphs are cached across processes) calls them as opaque extern kernels.
"""
from __future__ import annotations

import hashlib

import torch

from mdsl.errors import TraceError
from mdsl.frontend.kernel import KernelFunction
from mdsl.frontend.tracer import sanitize_name
from mdsl.torch.dtypes import host_results, torch_dtype

_LIBRARY = torch.library.Library("mdsl", "FRAGMENT")
#: op name -> the CustomOp registered under it
_REGISTERED: dict = {}
#: region op name -> the callable its CPU and CUDA implementations run (the latest region of that digest)
_REGIONS: dict = {}


class CustomOp:
    """A kernel registered as `torch.ops.mdsl.<name>`: call it like the kernel (one tensor per
    parameter); it returns one tensor, or a tuple where the kernel has several outputs."""

    def __init__(self, kernel: KernelFunction, name: str):
        self.kernel = kernel
        self.name = name
        self.op = getattr(torch.ops.mdsl, name).default

    def __repr__(self) -> str:
        return f"<torch.ops.mdsl.{self.name}: mdsl kernel {self.kernel.name}>"

    def __call__(self, *tensors):
        results = self.op(*tensors)
        return results[0] if len(results) == 1 else tuple(results)


def _digest(kernel: KernelFunction) -> str:
    where = f"{getattr(kernel.fn, '__module__', '')}.{getattr(kernel.fn, '__qualname__', kernel.name)}" \
            f"({', '.join(p.name for p in kernel.params)})"
    return hashlib.sha256(where.encode()).hexdigest()[:8]


def _cpu(kernel: KernelFunction):
    def run(*tensors):
        return host_results(kernel(*tensors), kernel.trace(*tensors))
    return run


def _cuda(kernel: KernelFunction):
    def run(*tensors):
        tensors = tuple(t.contiguous() for t in tensors)
        results = kernel(*tensors)
        results = results if isinstance(results, tuple) else (results,)
        # an output that is an argument unchanged (a kernel returning its input) must not alias it
        return [r.clone() if any(r is t for t in tensors) else r for r in results]
    return run


def inductor_fallback(name: str) -> None:
    """Make `torch.ops.mdsl.<name>` an extern kernel of Inductor's, as Inductor's implicit fallback makes an
    operator it has no lowering for at its first call, with the layout constraint that fallback gives it
    (the operator's tag, else Inductor's default for custom operators). Done before Inductor lowers the graph
    (from the operator's fake implementation, which runs while torch.compile traces it): on the implicit
    path torch 2.11 formats each argument's IR for a log line whether or not anything logs it (2.13 formats
    it lazily), and a region's arguments print the whole graph above them, recursively, so that the compile of
    a 28-layer model's decode step does not end there."""
    import sys

    lowering = sys.modules.get("torch._inductor.lowering")
    op = getattr(torch.ops.mdsl, name).default
    if lowering is None or op in lowering.lowerings:   # (no Inductor in this compile: nothing to prepare)
        return
    try:
        from torch._library.utils import get_layout_constraint_tag

        constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
    except (ImportError, AttributeError):   # a torch without layout tags: Inductor's fallback takes none either
        constraint = None
    lowering.make_fallback(op, layout_constraint=constraint, warn=False)


def _fake(kernel: KernelFunction, name: str):
    def shapes(*tensors):
        inductor_fallback(name)
        graph = kernel.trace(*tensors)
        return [tensors[0].new_empty(v.type.shape, dtype=torch_dtype(v.type.dtype)) for v in graph.outputs]
    return shapes


def custom_op(kernel: KernelFunction) -> CustomOp:
    """Register `kernel` (an `@mdsl.kernel`) as the torch custom operator `torch.ops.mdsl.<name>`; the same
    kernel gives the same operator again."""
    if not isinstance(kernel, KernelFunction):
        raise TraceError(f"mdsl.torch.custom_op takes an @mdsl.kernel, not a {type(kernel).__name__}",
                         hint="decorate the function with @mdsl.kernel first")
    if not kernel.params:
        raise TraceError(f"kernel {kernel.name} has no parameters: a torch operator needs a tensor to run on",
                         hint="give the kernel at least one tensor parameter")
    for op in _REGISTERED.values():
        if op.kernel is kernel:
            return op
    base = f"{sanitize_name(kernel.name)}_{_digest(kernel)}"
    name, k = base, 1
    while name in _REGISTERED:
        k += 1
        name = f"{base}_{k}"
    params = ", ".join(f"Tensor {sanitize_name(p.name)}" for p in kernel.params)
    _LIBRARY.define(f"{name}({params}) -> Tensor[]")
    _LIBRARY.impl(name, _cpu(kernel), "CPU")
    _LIBRARY.impl(name, _cuda(kernel), "CUDA")
    torch.library.register_fake(f"mdsl::{name}", _fake(kernel, name), lib=_LIBRARY)
    op = _REGISTERED[name] = CustomOp(kernel, name)
    return op


def region_op(name: str, run, fake):
    """The operator `torch.ops.mdsl.<name>(tensors, sizes)` (a region of the "mdsl" backend): `run(tensors,
    sizes)` computes its results, `fake(tensors, sizes)` their shapes, dtypes and strides. A name is a digest of
    what the region computes, so that a region defined again (a model compiled again) reuses its operator."""
    if name not in _REGIONS:
        _LIBRARY.define(f"{name}(Tensor[] tensors, SymInt[] sizes) -> Tensor[]")
        _LIBRARY.impl(name, lambda tensors, sizes: list(_REGIONS[name][0](tensors, sizes)), "CPU")
        _LIBRARY.impl(name, lambda tensors, sizes: list(_REGIONS[name][0](tensors, sizes)), "CUDA")
        def shapes(tensors, sizes):
            inductor_fallback(name)
            return list(_REGIONS[name][1](tensors, sizes))

        torch.library.register_fake(f"mdsl::{name}", shapes, lib=_LIBRARY)
    _REGIONS[name] = (run, fake)
    return getattr(torch.ops.mdsl, name).default

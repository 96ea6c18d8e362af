"""Calls prepared per argument signature: the host side of a repeated kernel call kept to what changes
between calls.

Every check a call makes of its arrays, except where their data starts, depends only on each array's
*signature* (mdsl.gpu.signature: its type, shape, dtype, whether it is on the GPU and on which one,
whether it is compact row-major). A caller checks a call's arguments once on the checked path (`device_view`,
`Executable.launch_views`), then keeps a `PreparedCall` for the signature. The prepared call guards itself:
called with arguments of another signature it answers None, having done nothing, so a caller tries the
prepared call it used last before it computes a key to look another one up. A call with its signature reads
the stream, the data pointers, checks their alignment, allocates the outputs and launches.

Only torch tensors and `DeviceArray`s are prepared: other arrays (`__cuda_array_interface__`, DLPack)
say where their data is ready through a protocol call, so each of their calls takes the checked path.

The call a user makes most, torch tensors in and torch tensors out (allocated, or passed as out=), has a
function of its own (`PreparedCall.fast`): Python source written for the
signature's argument and output counts (`fast_source`), with no loop, no tuple of the signature, and the
C launcher's call inlined, since every 100 ns of a generic loop counts against a launch that costs a few µs.
"""
from __future__ import annotations

from operator import methodcaller
from typing import Callable, Optional, Sequence

from mdsl.gpu.arrays import ALIGNMENT, ArgumentError, DeviceArray, is_torch_tensor, stream_handle, torch_stream_reader
from mdsl.gpu.signature import as_outputs


_DATA_PTR = methodcaller("data_ptr")   # torch tensors' and DeviceArrays' data pointer
_MISALIGNED = ALIGNMENT - 1


def _preparable(value) -> bool:
    return type(value) is DeviceArray or is_torch_tensor(value)


def _signature(values: Sequence) -> tuple:
    """What the guard compares of each array (with its device, the same for all, and its contiguity, which
    the checked path has required): its type, shape and dtype."""
    return tuple((type(v), v.shape, v.dtype) for v in values)


class PreparedCall:
    """An executable's call on arguments of one signature, checked once on the checked path: a call checks
    that the arguments have that signature (and the call the same options: out= and stream= given or not,
    the backend), reads the stream (the one given, else torch's current stream where torch tensors are
    passed, else the legacy default stream), orders DeviceArrays' pending work before it, reads the
    pointers, checks their alignment, allocates the outputs (or takes out=) and launches. It returns None,
    having launched nothing, for arguments of another signature and where the checked path must say what
    is wrong (a misaligned array, a stream it cannot use)."""

    __slots__ = ("_executable", "_launch", "_backend", "_stream_given", "_out_given", "_arity", "_signature",
                 "_out_signature", "_device", "_current_stream", "_arrays", "_out_arrays", "_empty_like",
                 "_templates", "_single", "fast")

    def __init__(self, executable, args: Sequence, outputs: Optional[Sequence], *, stream_given: bool,
                 torch_outputs: bool, backend: str = "cuda"):
        self._executable = executable
        self._launch = executable.launch
        self._backend = backend
        self._stream_given = stream_given
        self._out_given = outputs is not None
        self._arity = len(args)
        self._signature = _signature(args)
        self._out_signature = None if outputs is None else _signature(outputs)
        self._device = executable.device
        self._empty_like, self._templates = executable.torch_templates() if torch_outputs else (None, None)
        self._single = len(executable.output_types) == 1
        self._current_stream = None
        if not stream_given and any(is_torch_tensor(a) for a in args):   # launch_stream's choice
            self._current_stream = torch_stream_reader()
        self._arrays = tuple(k for k, a in enumerate(args) if type(a) is DeviceArray)
        self._out_arrays = () if outputs is None else tuple(k for k, o in enumerate(outputs) if type(o) is DeviceArray)
        #: this call as one generated function, `fast(args, out, stream, backend)`, where the arrays are all
        #: torch tensors (None otherwise); it answers as the call does
        self.fast: Optional[Callable] = None
        if args and all(is_torch_tensor(a) for a in (*args, *(outputs or ()))):
            self.fast = self._generate()

    @classmethod
    def of(cls, executable, args: Sequence, outputs: Optional[Sequence], *, stream_given: bool,
           torch_outputs: bool, backend: str = "cuda") -> Optional["PreparedCall"]:
        """The prepared call for these arguments, which the checked path has just launched on; None where
        some argument is of a kind that is checked at every call."""
        if not all(_preparable(v) for v in (*args, *(outputs or ()))):
            return None
        return cls(executable, args, outputs, stream_given=stream_given, torch_outputs=torch_outputs,
                   backend=backend)

    def _generate(self) -> Callable:
        exe = self._executable
        names = {"BACKEND": self._backend, "DEVICE": self._device, "MISALIGNED": _MISALIGNED, "as_outputs": as_outputs,
                 "current_stream": self._current_stream, "stream_handle": stream_handle, "ArgumentError": ArgumentError,
                 "empty_like": self._empty_like, "launch": exe.launch}
        # inlined where the C launcher runs kernels only (with cuBLAS's GEMMs, Executable.launch takes the
        # handle's lock and sets its stream, and launches the graph made for repeated pointers) and the graph
        # of the launches is made or refused (a first run on a stream the caller was capturing left it to a
        # later run, which Executable.launch makes)
        native = exe.native if exe._library is None and not exe._graphable else None
        if native is not None:
            names.update(lock=exe._lock, call=native.call, run=native.run, failed=exe._native_failed)
        for prefix, signature in (("A", self._signature), ("O", self._out_signature or ())):
            for k, (kind, shape, dtype) in enumerate(signature):
                names.update({f"{prefix}K{k}": kind, f"{prefix}S{k}": shape, f"{prefix}D{k}": dtype})
        for k, template in enumerate(self._templates or ()):
            names[f"T{k}"] = template
        namespace: dict = {}
        exec(compile(fast_source(self._arity, len(exe.output_types), self._out_given, self._stream_given,
                                 native is not None),
                     f"<mdsl call of {exe.name}>", "exec"), names, namespace)
        return namespace["fast"]

    def matches(self, args: Sequence, out, stream, backend: str) -> bool:
        """Whether a call with these arguments and options has this call's signature."""
        if (len(args) != self._arity or (stream is not None) is not self._stream_given or
                (out is not None) is not self._out_given or backend != self._backend):
            return False
        device = self._device
        for a, (kind, shape, dtype) in zip(args, self._signature):
            if type(a) is not kind or a.dtype is not dtype or a.shape != shape or a.get_device() != device or \
                    not a.is_contiguous():
                return False
        if out is not None:
            outputs = as_outputs(out)
            if len(outputs) != len(self._out_signature):
                return False
            for o, (kind, shape, dtype) in zip(outputs, self._out_signature):
                if type(o) is not kind or o.dtype is not dtype or o.shape != shape or o.get_device() != device or \
                        not o.is_contiguous():
                    return False
        return True

    def __call__(self, args: Sequence, out=None, stream=None, backend: str = "cuda"):
        """The call's results (as the checked path returns them), or None where it must take that path."""
        if not self.matches(args, out, stream, backend):
            return None
        if stream is not None:
            try:
                handle = stream_handle(stream)
            except ArgumentError:
                return None
        elif self._current_stream is not None:
            handle = self._current_stream(self._device)
        else:
            handle = 0
        for k in self._arrays:   # their data is ready on their own streams
            args[k].order_before(handle)
        if out is not None:
            outputs = as_outputs(out)
            for k in self._out_arrays:
                outputs[k].order_before(handle)
        elif self._templates is not None:
            empty_like = self._empty_like
            outputs = [empty_like(t) for t in self._templates]
        else:
            outputs = self._executable.new_outputs(handle, False)
        pointers = [*map(_DATA_PTR, args), *map(_DATA_PTR, outputs)]
        for p in pointers:
            if p & _MISALIGNED:
                return None
        self._launch(pointers, handle)
        if out is not None:
            for k in self._out_arrays:
                outputs[k].stream = handle   # its contents are ready once this stream gets there
        return outputs[0] if self._single else tuple(outputs)


def _guard(value: str, prefix: str, k: int) -> str:
    return (f"type({value}) is not {prefix}K{k} or {value}.dtype is not {prefix}D{k} or {value}.shape != {prefix}S{k} "
            f"or {value}.get_device() != DEVICE or not {value}.is_contiguous()")


def fast_source(arity: int, outputs: int, out_given: bool, stream_given: bool, native: bool) -> str:
    """The source of `PreparedCall.fast` for `arity` torch tensors in and `outputs` out (passed as out=, or
    allocated: torch.empty_like of the templates T0...), launched on the stream given (`stream_given`) or
    torch's current one, through the C launcher's call array (`native`) or `Executable.launch`. Names it
    reads: BACKEND, DEVICE, MISALIGNED, as_outputs, current_stream, stream_handle, ArgumentError, empty_like,
    launch, lock, call, run, failed; per argument k AKk (type), ASk (shape), ADk (dtype); per output k OKk,
    OSk, ODk (out=) or Tk (its template)."""
    a = [f"a{k}" for k in range(arity)]
    o = [f"o{k}" for k in range(outputs)]
    pa, po = [f"p{k}" for k in range(arity)], [f"q{k}" for k in range(outputs)]
    lines = ["def fast(args, out, stream, backend):",
             f"    if stream is {'' if stream_given else 'not '}None or backend != BACKEND or len(args) != {arity} or "
             f"out is {'' if out_given else 'not '}None:",
             "        return None",
             f"    {', '.join(a)}, = args"]
    guards = [_guard(v, "A", k) for k, v in enumerate(a)]
    if out_given:
        lines += ["    outs = as_outputs(out)", f"    if len(outs) != {outputs}:", "        return None",
                  f"    {', '.join(o)}, = outs"]
        guards += [_guard(v, "O", k) for k, v in enumerate(o)]
    lines += ["    if (" + " or\n            ".join(guards) + "):", "        return None"]
    lines += [f"    {p} = {v}.data_ptr()" for p, v in zip(pa, a)]
    checked = pa + (po if out_given else [])   # torch's allocations are aligned
    if not out_given:
        lines += [f"    {v} = empty_like(T{k})" for k, v in enumerate(o)]
    lines += [f"    {p} = {v}.data_ptr()" for p, v in zip(po, o)]
    lines += [f"    if ({' | '.join(checked)}) & MISALIGNED:", "        return None"]
    if stream_given:
        lines += ["    try:", "        handle = stream_handle(stream)", "    except ArgumentError:", "        return None"]
    else:
        lines += ["    handle = current_stream(DEVICE)"]
    if native:
        lines += ["    with lock:", "        call[1] = handle"]
        lines += [f"        call[{2 + k}] = {p}" for k, p in enumerate(pa + po)]
        lines += ["        err = run(call)", "    if err:", f"        failed(err, ({', '.join(pa + po)},), handle)"]
    else:
        lines += [f"    launch(({', '.join(pa + po)},), handle)"]
    lines += [f"    return {o[0] if outputs == 1 else '(' + ', '.join(o) + ',)'}"]
    return "\n".join(lines) + "\n"

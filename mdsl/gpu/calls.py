"""Calls prepared per argument signature: the host side of a repeated kernel call kept to what changes
between calls.

Every check a call makes of its arrays, except where their data starts, depends only on each array's
*signature* (mdsl.gpu.signature: its type, shape, dtype, whether it is on the GPU and on which one,
whether it is compact row-major). A caller checks a call's arguments once on the checked path (`device_view`,
`Executable.launch_views`), then keeps a `PreparedCall` under the signature; a later call with the same
signature reads the data pointers, checks their alignment, allocates the outputs and launches.

Only torch tensors and `DeviceArray`s are prepared: other arrays (`__cuda_array_interface__`, DLPack)
say where their data is ready through a protocol call, so each of their calls takes the checked path.
"""
from __future__ import annotations

from functools import reduce
from operator import methodcaller, or_
from typing import Optional, Sequence

from mdsl.gpu.arrays import ALIGNMENT, ArgumentError, DeviceArray, is_torch_tensor, stream_handle, torch_stream_reader
from mdsl.gpu.signature import as_outputs


_DATA_PTR = methodcaller("data_ptr")   # torch tensors' and DeviceArrays' data pointer


def _preparable(value) -> bool:
    return type(value) is DeviceArray or is_torch_tensor(value)


class PreparedCall:
    """An executable's call on arguments of one signature, checked once on the checked path: a call reads
    the stream (the one given, else torch's current stream where torch tensors are passed, else the
    legacy default stream), orders DeviceArrays' pending work before it, reads the pointers, checks their
    alignment, allocates the outputs (or takes out=) and launches. It returns None, having launched
    nothing, where the checked path must say what is wrong (a misaligned array, a stream it cannot use)."""

    __slots__ = ("_executable", "_launch", "_current_stream", "_device", "_arrays", "_out_arrays", "_torch_empty",
                 "_torch_specs", "_single")

    def __init__(self, executable, args: Sequence, outputs: Optional[Sequence], *, stream_given: bool,
                 torch_outputs: bool):
        self._executable = executable
        self._launch = executable.launch
        self._torch_empty, self._torch_specs = executable.torch_outputs() if torch_outputs else (None, ())
        self._single = len(executable.output_types) == 1
        self._current_stream = self._device = None
        if not stream_given:   # launch_stream's choice, which depends only on the signature
            first = next((a for a in args if is_torch_tensor(a) and a.is_cuda), None)
            if first is not None:
                self._current_stream, self._device = torch_stream_reader(), first.get_device()
        self._arrays = tuple(k for k, a in enumerate(args) if type(a) is DeviceArray)
        self._out_arrays = () if outputs is None else tuple(k for k, o in enumerate(outputs) if type(o) is DeviceArray)

    @classmethod
    def of(cls, executable, args: Sequence, outputs: Optional[Sequence], *, stream_given: bool,
           torch_outputs: bool) -> Optional["PreparedCall"]:
        """The prepared call for these arguments, which the checked path has just launched on; None where
        some argument is of a kind that is checked at every call."""
        if not all(_preparable(v) for v in (*args, *(outputs or ()))):
            return None
        return cls(executable, args, outputs, stream_given=stream_given, torch_outputs=torch_outputs)

    def __call__(self, args: Sequence, out, stream):
        """The call's results (as the checked path returns them), or None where it must take that path."""
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
        if self._torch_empty is not None:
            empty = self._torch_empty
            outputs = [empty(shape, dtype=dtype, device=device) for shape, dtype, device in self._torch_specs]
        elif out is None:
            outputs = self._executable.new_outputs(handle, False)
        else:
            outputs = as_outputs(out)
            for k in self._out_arrays:
                outputs[k].order_before(handle)
        pointers = [*map(_DATA_PTR, args), *map(_DATA_PTR, outputs)]
        if reduce(or_, pointers) % ALIGNMENT:
            return None
        self._launch(pointers, handle)
        if out is not None:
            for k in self._out_arrays:
                outputs[k].stream = handle   # its contents are ready once this stream gets there
        return outputs[0] if self._single else tuple(outputs)

"""The driver's entry points that mdsl's C launcher calls (mdsl.gpu.launcher), as ctypes callbacks into a
Python stand-in of cuda.bindings' driver: the launcher runs for real, the driver is recorded. The stand-in
receives the calls as it would from the cuda.bindings path (the stream as `("stream", handle)`, the kernel
as the name its cuModuleGetFunction returned), so one recorder serves both launch paths."""
from __future__ import annotations

import ctypes
import itertools
from types import SimpleNamespace

import pytest

from mdsl.gpu import launcher

#: the context the stand-in devices hold and the stand-in driver says is current, unless a test changes it
CONTEXT = 0xC0C0


class LaunchRecorder:
    """cuda.bindings' launch and copy calls, recorded (`calls`) and answered with success; `arity`: kernel name ->
    its parameters, whose values a launch records."""

    def __init__(self, arity: dict):
        self.arity, self.calls = arity, []

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        block = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        pointers = [ctypes.cast(block[k], ctypes.POINTER(ctypes.c_uint64))[0] for k in range(self.arity[function])]
        self.calls.append(("launch", function, (gx, gy, gz), (bx, by, bz), smem, stream, pointers))
        return (0,)

    def cuMemcpyDtoDAsync(self, dst, src, size, stream):
        self.calls.append(("copy", dst, src, size, stream))
        return (0,)


class FakeFunction(str):
    """A kernel handle as a stand-in cuModuleGetFunction returns it: its name, which int() turns into a
    handle the C launcher can pass back (`NativeDriver` turns it into the name again)."""

    _ids = itertools.count(0x1000)
    by_id: dict = {}

    def __new__(cls, name: str):
        self = super().__new__(cls, name)
        self.id = next(cls._ids)
        cls.by_id[self.id] = self
        return self

    def __int__(self) -> int:
        return self.id


class _Attribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int32), ("pad", ctypes.c_int32), ("value", ctypes.c_char * 64)]


class _Config(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("shared_bytes", ctypes.c_uint32),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint32)]


_V, _U = ctypes.c_void_p, ctypes.c_uint32
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, _V, _U, _U, _U, _U, _U, _U, _U, _V, _V, _V)
_LAUNCH_EX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_Config), _V, _V, _V)
_COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, _V)
_CURRENT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_V))
_SET_NODE = ctypes.CFUNCTYPE(ctypes.c_int, _V, _V, ctypes.POINTER(launcher.KernelNodeParams))
_GRAPH_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, _V, _V)
_CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, _V, ctypes.POINTER(ctypes.c_int))


class NativeDriver:
    """ENTRY_POINTS for the C launcher, forwarding to `fake` (a stand-in of cuda.bindings' driver with
    cuLaunchKernel and cuMemcpyDtoDAsync). A launch with programmatic stream serialization reaches
    `fake.cuLaunchKernel` too, with `overlapped` recorded in `self.overlapped`. `current` is the context
    cuCtxGetCurrent answers; `errors` maps a kernel name to the CUresult its launch returns. An exception in
    a callback cannot cross the C launcher: it is kept in `failures` (`check()` raises it) and the call
    answers CUDA_ERROR_UNKNOWN."""

    def __init__(self, fake, *, graphs: bool = False):
        """`graphs`: the driver has the entry points of a graph's launch too (cuGraphExecKernelNodeSetParams,
        cuGraphLaunch, cuStreamIsCapturing: `capturing` holds the streams being captured), which record into
        `fake.calls` as ("node", graph, node, kernel name, grid, block, shared bytes, the parameters' values)
        and ("graph", graph, stream)."""
        self.fake, self.current, self.errors, self.overlapped, self.failures = fake, CONTEXT, {}, [], []
        self.capturing = set()   # the streams cuStreamIsCapturing says are being captured

        def launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            name = FakeFunction.by_id[function]
            (err,) = fake.cuLaunchKernel(name, gx, gy, gz, bx, by, bz, smem, ("stream", stream or 0), params, extra)
            return self.errors.get(name, err)

        def launch_ex(config, function, params, extra):
            c = config.contents
            attributes = [(c.attrs[k].id, int.from_bytes(c.attrs[k].value[:4], "little")) for k in range(c.num_attrs)]
            self.overlapped.append((FakeFunction.by_id[function], attributes))
            return launch(function, *c.grid, *c.block, c.shared_bytes, c.stream, params, extra)

        def copy(dst, src, size, stream):
            (err,) = fake.cuMemcpyDtoDAsync(dst, src, size, ("stream", stream or 0))
            return err

        def current(out):
            out[0] = self.current
            return 0

        def set_node(graph, node, params):
            p = params.contents
            name = FakeFunction.by_id[p.function]
            block = ctypes.cast(p.params, ctypes.POINTER(ctypes.c_void_p))
            values = [ctypes.cast(block[k], ctypes.POINTER(ctypes.c_uint64))[0] for k in range(fake.arity[name])]
            fake.calls.append(("node", graph, node, name, tuple(p.grid), tuple(p.block), p.shared_bytes, values))
            return self.errors.get(name, 0)

        def graph_launch(graph, stream):
            fake.calls.append(("graph", graph, ("stream", stream or 0)))
            return 0

        def capturing(stream, status):
            status[0] = 1 if (stream or 0) in self.capturing else 0   # CU_STREAM_CAPTURE_STATUS_ACTIVE, _NONE
            return 0

        def kept(fn):
            def call(*args):
                try:
                    return fn(*args)
                except BaseException as e:
                    self.failures.append(e)
                    return 999
            return call

        kinds = ((_LAUNCH, launch), (_LAUNCH_EX, launch_ex), (_COPY, copy), (_CURRENT, current),
                 (_SET_NODE, set_node), (_GRAPH_LAUNCH, graph_launch), (_CAPTURING, capturing))
        self._callbacks = tuple(kind(kept(fn)) for kind, fn in kinds[:len(kinds) if graphs else 4])
        self.entries = {name: ctypes.cast(cb, ctypes.c_void_p).value
                        for name, cb in zip(launcher.ENTRY_POINTS, self._callbacks)}


    def check(self) -> None:
        if self.failures:
            raise self.failures[0]


#: a driver whose entry points do nothing: for timing the launcher's host side without a GPU
_STUB_SOURCE = f"""
int mdsl_stub_ok(void) {{ return 0; }}
int mdsl_stub_current(void **context) {{ *context = (void *){CONTEXT}; return 0; }}
"""
_STUB: dict = {}


def stub_entries() -> dict:
    """ENTRY_POINTS of a compiled driver stub (every call succeeds at once, the current context is CONTEXT)."""
    if not _STUB:
        import subprocess
        import tempfile
        from pathlib import Path

        compiler = launcher._compiler()
        if compiler is None:
            pytest.skip("no C compiler for the driver stub")
        directory = Path(tempfile.mkdtemp(prefix="mdsl-stub-"))
        (directory / "stub.c").write_text(_STUB_SOURCE)
        subprocess.run([*compiler, "-O2", "-shared", "-fPIC", "-o", str(directory / "stub.so"),
                        str(directory / "stub.c")], check=True, capture_output=True)
        lib = ctypes.CDLL(str(directory / "stub.so"))
        ok, current = (ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in ("mdsl_stub_ok", "mdsl_stub_current"))
        _STUB.update({name: ok for name in launcher.ENTRY_POINTS}, cuCtxGetCurrent=current, lib=lib)
    return {name: _STUB[name] for name in launcher.ENTRY_POINTS}


#: the launch paths an Executable takes: through mdsl's C launcher, and through cuda.bindings
LAUNCH_PATHS = ("c", "bindings")


def use_launch_path(monkeypatch, path: str, fake, *, stub: bool = False) -> NativeDriver:
    """Executables made from here on launch through `path`, on the stand-in driver `fake` (`stub`: the C
    launcher's calls reach `stub_entries()` instead, which record nothing and cost nothing)."""
    native = NativeDriver(fake)
    entries = stub_entries() if stub and path == "c" else native.entries
    monkeypatch.setattr(launcher, "driver_entries", lambda: dict(entries))
    if path == "bindings":
        monkeypatch.setattr(launcher, "library", lambda: None)
    elif launcher.library() is None:
        pytest.skip("mdsl's C launcher cannot be built here (no C compiler)")
    return native


def fake_device(**extra) -> SimpleNamespace:
    """A stand-in of mdsl.gpu.driver.Device for an Executable: no driver call."""
    return SimpleNamespace(max_smem=227 * 1024, context=CONTEXT, activate=lambda: None, **extra)

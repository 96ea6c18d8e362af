"""An executable whose program has cuBLAS GEMMs (whose kernels' parameters are cuBLAS's, so no graph of its
launches can be given new pointers) captures the program whole for a stream and set of pointers that repeats,
and launches that graph for them. Without a GPU: the real C launcher over a recording stand-in of the driver
(tests/backend/native_driver.py), the cuBLAS context a stand-in that records how the handle is set."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from mdsl.gpu import launcher
from mdsl.ir.dtypes import f32
from mdsl.ir.graph import KernelGraph, make_var
from tests.backend.native_driver import NativeDriver, fake_device
from tests.backend.test_runtime_cpu import RecordingDriver, node


class CaptureDriver(RecordingDriver):
    """The driver calls of a capture, recorded: streams made and destroyed, captures begun and ended, graphs
    instantiated and destroyed. `captured`: the stream handles the caller is capturing; `refuse`: the
    capture's start fails (CUDA_ERROR_NOT_SUPPORTED)."""

    class CUstreamCaptureStatus:
        CU_STREAM_CAPTURE_STATUS_NONE, CU_STREAM_CAPTURE_STATUS_ACTIVE = 0, 1

    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    CUstreamCaptureMode = SimpleNamespace(CU_STREAM_CAPTURE_MODE_RELAXED=2)

    def __init__(self, arity: dict):
        super().__init__(arity)
        self.captured, self.refuse, self.made = set(), False, 0

    def cuStreamIsCapturing(self, stream):
        return 0, int(stream[1] in self.captured)

    def cuStreamCreate(self, flags):
        self.made += 1
        return 0, 0x5000 + self.made

    def cuStreamDestroy(self, stream):
        self.calls.append(("destroy stream", stream))
        return (0,)

    def cuStreamBeginCapture(self, stream, mode):
        self.calls.append(("begin", stream))
        return (801 if self.refuse else 0,)

    def cuStreamEndCapture(self, stream):
        self.calls.append(("end", stream))
        return 0, 0x6000 + stream

    def cuGraphInstantiate(self, graph, flags):
        return 0, graph + 0x1000

    def cuGraphExecDestroy(self, graph_exec):
        self.calls.append(("destroy exec", graph_exec))
        return (0,)

    def cuGraphDestroy(self, graph):
        self.calls.append(("destroy graph", graph))
        return (0,)


class Library:
    """The executable's cuBLAS context as far as a capture goes: its lock, and how the handle's stream is set."""

    def __init__(self):
        self.lock, self.calls = threading.Lock(), []

    def use_stream(self, stream):
        self.calls.append(("use", stream))

    def capture_on(self, capture, like):
        self.calls.append(("capture on", capture, "workspace of", like))

    def forget_stream(self):
        self.calls.append(("forget",))


@pytest.fixture
def exe(monkeypatch):
    """Two kernels (exp, then exp of it) on the C launcher, made an executable whose GEMMs cuBLAS runs."""
    from mdsl.backend.cuda import emit_cuda
    from mdsl.gpu import executable

    if launcher.library() is None:
        pytest.skip("mdsl's C launcher cannot be built here (no C compiler)")
    x = make_var("x", (4, 8), f32)
    n1, e = node("exp", [x], "e")
    n2, y = node("exp", [e], "y")
    program = emit_cuda(KernelGraph("g", [x], [n1, n2], [y]), arch="sm_90a")
    fake = CaptureDriver({launch.name: len(launch.args) for launch in program.launches})
    native = NativeDriver(fake, graphs=True)
    monkeypatch.setattr(launcher, "driver_entries", lambda: dict(native.entries))
    monkeypatch.setattr(executable, "driver", fake)
    monkeypatch.setattr(executable, "get_device", lambda device: fake_device(make_current=lambda: None))
    monkeypatch.setattr(executable, "cu_stream", lambda handle: ("stream", handle))
    made = executable.Executable(program, SimpleNamespace(load=lambda: "module"))
    assert made.native is not None and made._by_pointers is None   # its own kernels: one graph, new pointers each call
    made._graphable, made._library = False, Library()
    made._by_pointers = {} if made._may_graph_by_pointers() else None
    assert made._by_pointers == {}
    fake.calls.clear()
    yield SimpleNamespace(exe=made, fake=fake, native=native, kernels=[launch.name for launch in program.launches])
    native.check()


def _run(t, x, y, stream):
    start = len(t.fake.calls)
    t.exe.run_pointers([x], [y], stream=stream)
    return t.fake.calls[start:]


def _launched(t, calls, stream, x, y):
    """Whether `calls` are the two kernels on `stream` with the pointers x and y (the intermediate between)."""
    kinds = [(c[0], c[1], c[5]) for c in calls if c[0] == "launch"]
    if kinds != [("launch", name, ("stream", stream)) for name in t.kernels] or len(calls) != 2:
        return False
    return calls[0][6][0] == x and calls[1][6][1] == y


def test_the_second_run_on_the_same_stream_and_pointers_captures_them_and_later_runs_launch_the_graph(exe):
    t = exe
    assert _launched(t, _run(t, 0x1000, 0x2000, 7), 7, 0x1000, 0x2000)
    second = _run(t, 0x1000, 0x2000, 7)
    # run as ever, then captured on a stream of its own with cuBLAS set to that stream and stream 7's workspace
    assert _launched(t, second[:2], 7, 0x1000, 0x2000)
    capture = 0x5001
    assert second[2] == ("begin", capture) and _launched(t, second[3:5], capture, 0x1000, 0x2000)
    assert second[5:] == [("end", capture), ("destroy stream", capture)]
    assert t.exe._library.calls == [("capture on", capture, "workspace of", 7), ("forget",)]
    graph_exec = 0x6000 + capture + 0x1000
    for _ in range(2):
        assert _run(t, 0x1000, 0x2000, 7) == [("graph", graph_exec, ("stream", 7))]
    # another pointer, another stream: launched launch by launch
    assert _launched(t, _run(t, 0x1000, 0x3000, 7), 7, 0x1000, 0x3000)
    assert _launched(t, _run(t, 0x1000, 0x2000, 9), 7 + 2, 0x1000, 0x2000)
    assert len(t.exe._by_pointers) == 1


def test_a_stream_the_caller_is_capturing_gets_the_launches_and_no_graph_of_its_own(exe):
    t = exe
    for _ in range(2):
        _run(t, 0x1000, 0x2000, 7)
    t.fake.captured.add(7)    # (as Python's driver and the C launcher's entry points see it)
    t.native.capturing.add(7)
    for _ in range(3):   # the graph made for stream 7 is not launched into the caller's capture, none is made
        assert _launched(t, _run(t, 0x1000, 0x2000, 7), 7, 0x1000, 0x2000)
        assert _launched(t, _run(t, 0x1000, 0x4000, 7), 7, 0x1000, 0x4000)
    assert len(t.exe._by_pointers) == 1 and t.fake.made == 1


def test_at_most_pointer_graphs_sets_are_captured(exe, monkeypatch):
    from mdsl.gpu import executable

    t = exe
    monkeypatch.setattr(executable, "POINTER_GRAPHS", 2)
    for y in (0x2000, 0x3000, 0x4000):
        for _ in range(2):
            _run(t, 0x1000, y, 7)
    assert len(t.exe._by_pointers) == 2 and t.fake.made == 2
    assert _launched(t, _run(t, 0x1000, 0x4000, 7), 7, 0x1000, 0x4000)
    assert [c[0] for c in _run(t, 0x1000, 0x3000, 7)] == ["graph"]


def test_a_driver_that_refuses_a_capture_stops_the_captures_and_keeps_the_graphs_made(exe):
    t = exe
    for _ in range(2):
        _run(t, 0x1000, 0x2000, 7)
    t.fake.refuse = True
    for _ in range(2):
        _run(t, 0x1000, 0x3000, 7)
    assert t.exe.graph_refusal.startswith("cuStreamBeginCapture: ")
    assert [c[0] for c in t.fake.calls if c[0].startswith("destroy ")] == ["destroy stream", "destroy stream"]
    assert [c[0] for c in _run(t, 0x1000, 0x2000, 7)] == ["graph"]   # (another thread may be launching it)
    assert _launched(t, _run(t, 0x1000, 0x3000, 7), 7, 0x1000, 0x3000)
    t.fake.refuse = False
    for _ in range(2):
        _run(t, 0x1000, 0x5000, 7)
    assert t.fake.made == 2 and len(t.exe._by_pointers) == 1   # no capture tried again
    t.exe.close()


def test_close_destroys_each_graph_made(exe):
    t = exe
    for y in (0x2000, 0x3000):
        for _ in range(2):
            _run(t, 0x1000, y, 7)
    t.fake.calls.clear()
    t.exe.close()
    assert sorted(c[1] for c in t.fake.calls if c[0] == "destroy exec") == [0x7000 + 0x5001, 0x7000 + 0x5002]
    assert len([c for c in t.fake.calls if c[0] == "destroy graph"]) == 2

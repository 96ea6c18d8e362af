"""The GPU runtime's parts that need no GPU: the GPU check, the no-GPU error, lazy imports, argument
checks made before any driver call, DLPack capsules, buffer planning and stream handles.

Tests that assume there is no GPU skip themselves on a machine with one (tests/gpu covers it there).
"""
from __future__ import annotations

import ctypes
import gc
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

import mdsl
from mdsl import Tensor, f16, f32
from mdsl import gpu as runtime
from mdsl.gpu import ArgumentError, NoGPUError, dlpack
from mdsl.ir.graph import KernelGraph, Node, make_var
from mdsl.ir.ops import get_op
from tests.backend.native_driver import LAUNCH_PATHS, FakeFunction, LaunchRecorder, fake_device, use_launch_path

no_gpu = pytest.mark.skipif(runtime.has_gpu(), reason="this machine has a GPU (tests/gpu covers it)")


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


class FakeCudaArray:
    """Says it is a GPU array through __cuda_array_interface__; its pointer is never dereferenced."""

    def __init__(self, shape=(4, 8), typestr="<f2", ptr=0x7F0000000000, strides=None):
        self.shape = shape
        self.dtype = {"<f2": "float16", "<f4": "float32"}.get(typestr, typestr)
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3,
                                         "strides": strides}


@mdsl.kernel
def double(x: Tensor[4, 8, f16]):
    return x + x


# ---------------------------------------------------------------------------------------------
# without a GPU

@no_gpu
def test_has_gpu_is_false_in_a_fresh_process_and_can_be_asked_again():
    out = run_python("""
        from mdsl.backend.cuda.runtime import has_gpu
        print(has_gpu(), has_gpu())
    """)
    assert out.split() == ["False", "False"]


@no_gpu
def test_a_gpu_array_without_a_gpu_raises_no_gpu_error_with_the_promised_hint():
    with pytest.raises(NoGPUError) as info:
        double(FakeCudaArray())
    text = str(info.value)
    assert isinstance(info.value, mdsl.MdslError)
    assert "needs an NVIDIA GPU" in text
    assert "optimize()" in text and "compiling CUDA source" in text and "numpy arrays" in text
    assert "test_runtime_cpu.py" in text   # it points at the call


@no_gpu
def test_out_or_stream_asks_for_the_gpu():
    x = np.ones((4, 8), np.float16)
    with pytest.raises(NoGPUError):
        double(x, out=np.empty_like(x))
    with pytest.raises(NoGPUError):
        double(x, stream=0)


@no_gpu
def test_device_arrays_and_compiled_executables_need_a_gpu():
    with pytest.raises(NoGPUError):
        runtime.DeviceArray((4,), f32)
    with pytest.raises(NoGPUError):
        runtime.compile_graph(double.graph)


@no_gpu
def test_target_arch_without_a_gpu_is_the_h200s():
    assert runtime.target_arch() == "sm_90a"


def test_host_arrays_still_run_on_the_reference_interpreter():
    x = np.arange(32, dtype=np.float16).reshape(4, 8)
    np.testing.assert_array_equal(double(x), x + x)


def test_import_mdsl_loads_neither_cuda_bindings_nor_torch():
    out = run_python("""
        import sys
        import numpy as np
        import mdsl
        from mdsl import Tensor, f32

        @mdsl.kernel
        def k(x: Tensor[4, f32]):
            return mdsl.exp(x)

        k(np.zeros(4, np.float32))   # a host call does not load them either
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cuda")))
    """)
    assert out == "[]"


def test_a_dtype_that_differs_from_the_annotation_is_a_dtype_error():
    with pytest.raises(mdsl.DTypeError, match="argument x is Tensor\\[4, 8, f32\\] but is annotated"):
        double(np.ones((4, 8), np.float32))


# ---------------------------------------------------------------------------------------------
# argument checks that come before any driver call

def test_host_memory_is_refused_with_a_hint():
    with pytest.raises(ArgumentError, match="in host memory") as info:
        runtime.device_view(np.ones(4, np.float32), "argument x")
    assert "DeviceArray.from_numpy" in str(info.value)


def test_something_that_is_no_array_is_refused():
    with pytest.raises(ArgumentError, match="is a list, not a GPU array"):
        runtime.device_view([1.0, 2.0], "argument x")


def test_misaligned_cuda_array_interface_pointer():
    with pytest.raises(ArgumentError, match="not 16-byte aligned"):
        runtime.device_view(FakeCudaArray(ptr=0x7F0000000002), "argument x")


def test_non_compact_cuda_array_interface_strides():
    with pytest.raises(ArgumentError, match="not compact row-major"):
        runtime.device_view(FakeCudaArray(shape=(4, 8), strides=(2, 8)), "argument x")   # a transposed view


def test_unsupported_cuda_array_interface_dtype():
    with pytest.raises(mdsl.DTypeError, match="'<f8'"):
        runtime.device_view(FakeCudaArray(typestr="<f8"), "argument x")


class FakeDLPackCuda:
    """A DLPack exporter on CUDA device 0 describing memory at a fake address."""

    def __init__(self, ptr=0x7F0000000000, dtype=(dlpack.FLOAT, 16, 1)):
        self.ptr, self.dtype = ptr, dtype
        self.streams = []

    def __dlpack_device__(self):
        return (dlpack.KDL_CUDA, 0)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return dlpack.export(self.ptr, (4, 8), self.dtype, (dlpack.KDL_CUDA, 0), self)


def test_dlpack_cuda_arguments_are_read_without_the_driver():
    fake = FakeDLPackCuda()
    view = runtime.device_view(fake, "argument x", stream=0)
    assert view == runtime.View(0x7F0000000000, (4, 8), f16, 0)
    assert fake.streams == [1]   # DLPack spells the legacy default stream 1
    with pytest.raises(ArgumentError, match="not 16-byte aligned"):
        runtime.device_view(FakeDLPackCuda(ptr=0x7F0000000008), "argument x")
    with pytest.raises(mdsl.DTypeError, match="code 2, 64 bits"):
        runtime.device_view(FakeDLPackCuda(dtype=(dlpack.FLOAT, 64, 1)), "argument x")
    gc.collect()
    assert dlpack.exported_count() == 0


def test_device_arrays_are_recognised_by_the_frontend_without_the_driver():
    from mdsl.frontend.kernel import _is_device_array

    assert _is_device_array(FakeCudaArray()) and _is_device_array(FakeDLPackCuda())
    assert not _is_device_array(np.ones(3)) and not _is_device_array([1.0])


# ---------------------------------------------------------------------------------------------
# DLPack capsules, checked against numpy's own implementation

class Exporter:
    """Exports a numpy array's memory through mdsl's dlpack.export, for numpy to consume."""

    def __init__(self, array):
        self.array = array

    def __dlpack_device__(self):
        return (dlpack.KDL_CPU, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        versioned = max_version is not None and max_version >= (1, 0)
        return dlpack.export(self.array.ctypes.data, self.array.shape, (dlpack.FLOAT, 32, 1), (dlpack.KDL_CPU, 0),
                             self.array, versioned=versioned)


@pytest.mark.parametrize("versioned", [False, True])
def test_exported_capsules_are_consumed_by_numpy(versioned):
    source = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    capsule = Exporter(source).__dlpack__(max_version=(1, 0) if versioned else None)
    assert dlpack.read(capsule).shape == (2, 3, 4)
    del capsule   # an unconsumed capsule releases its tensor
    gc.collect()
    assert dlpack.exported_count() == 0

    exporter = Exporter(source)
    view = np.from_dlpack(exporter)
    del exporter
    assert dlpack.exported_count() == 1   # numpy holds it now
    np.testing.assert_array_equal(view, source)
    assert view.ctypes.data == source.ctypes.data   # shared, not copied
    del view
    gc.collect()
    assert dlpack.exported_count() == 0   # numpy called the deleter


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_numpy_capsules_are_read(max_version):
    a = np.arange(12, dtype=np.float16).reshape(3, 4)
    got = dlpack.read(a.__dlpack__(max_version=max_version))
    assert got.data == a.ctypes.data and got.shape == (3, 4)
    assert got.dtype == (dlpack.FLOAT, 16, 1) and got.device == (dlpack.KDL_CPU, 0)
    assert got.strides is None or dlpack.is_compact(got.shape, got.strides)
    t = dlpack.read(a.T.__dlpack__())
    assert t.shape == (4, 3) and not dlpack.is_compact(t.shape, t.strides)


def test_compactness_ignores_dims_of_size_one():
    assert dlpack.is_compact((4, 1, 8), (8, 123, 1))
    assert not dlpack.is_compact((4, 8), (1, 4))
    assert dlpack.compact_strides((2, 3, 4)) == (12, 4, 1)


# ---------------------------------------------------------------------------------------------
# buffer planning

class Launch:
    def __init__(self, name, *args):
        self.name, self.args = name, args


def node(op, inputs, out, **attrs):
    opdef = get_op(op)
    pairs = opdef.normalize_attrs(attrs)
    (t,) = opdef.infer_types(tuple(v.type for v in inputs), pairs)
    var = make_var(out, t.shape, t.dtype)
    return Node(op, inputs, (var,), pairs), var


def test_intermediates_get_scratch_and_arguments_get_bindings():
    x, w = make_var("x", (4, 8), f32), make_var("w", (8, 2), f32)
    n1, e = node("exp", [x], "e")
    n2, y = node("matmul", [e, w], "y")
    graph = KernelGraph("g", [x, w], [n1, n2], [y])
    plan = runtime.plan_buffers(graph, [Launch("k1", "x", "e"), Launch("k2", "e", "w", "y")], ())
    assert plan.launch_slots == ((0, 1), (1, 2, 3))
    assert plan.bindings == ((0, 0), (2, 1), (3, 2))   # x: input 0, w: input 1, y: output 0
    assert plan.scratch == ((1, 4 * 8 * 4),) and plan.copies == ()


def test_views_share_buffers_and_outputs_living_elsewhere_are_copied():
    x = make_var("x", (4, 8), f32)
    n1, r = node("reshape", [x], "r", shape=(8, 4))       # a view of an input, returned: a copy
    n2, e = node("exp", [x], "e")
    n3, v = node("reshape", [e], "v", shape=(32,))        # the kernel writes e straight into output v
    graph = KernelGraph("g", [x], [n1, n2, n3], [r, v, v])
    plan = runtime.plan_buffers(graph, [Launch("k", "x", "e")], [("r", "x"), ("v", "e")])
    assert plan.launch_slots == ((0, 1),)
    assert plan.bindings == ((0, 0), (1, 2))              # e lives in output 1 (argument 2)
    assert plan.scratch == ()
    assert plan.copies == ((1, 0, 128), (3, 2, 128))      # r <- x, the second v <- the first


def test_group_counters_get_a_slot_of_their_own_after_the_launch_s_values():
    x = make_var("x", (4, 8), f32)
    n1, e = node("exp", [x], "e")
    n2, y = node("neg", [e], "y")
    graph = KernelGraph("g", [x], [n1, n2], [y])
    pair = Launch("k", "x", "e", "y")
    pair.counters = 3   # a split and its combine in one launch: 3 groups
    plan = runtime.plan_buffers(graph, [pair], ())
    assert plan.launch_slots == ((0, 1, 2, 3),) and plan.slots == 4
    assert plan.counters == ((3, 3 * 4),) and plan.scratch == ((1, 4 * 8 * 4),)


def test_group_counters_never_share_a_slot_with_a_later_launch_s_values():
    """A pair followed by a kernel with values of its own: the counters' slot comes after every value's (a
    counter slot numbered before the later values were would also be the slot of one of them, and the pair
    would count its groups' arrivals in that value's memory)."""
    x, w = make_var("x", (4, 8), f32), make_var("w", (8, 2), f32)
    n1, e = node("exp", [x], "e")
    n2, y = node("neg", [e], "y")
    n3, z = node("matmul", [y, w], "z")
    graph = KernelGraph("g", [x, w], [n1, n2, n3], [z])
    pair = Launch("k", "x", "e", "y")
    pair.counters = 2
    plan = runtime.plan_buffers(graph, [pair, Launch("k3", "y", "w", "z")], ())
    values = {s for slots in plan.launch_slots for s in slots} - {s for s, _ in plan.counters}
    assert plan.counters == ((5, 2 * 4),) and values == {0, 1, 2, 3, 4} and plan.slots == 6
    assert plan.launch_slots == ((0, 1, 2, 5), (2, 3, 4))


def test_a_program_naming_an_unknown_value_is_refused():
    x = make_var("x", (4,), f32)
    n1, e = node("exp", [x], "e")
    graph = KernelGraph("g", [x], [n1], [e])
    with pytest.raises(ValueError, match="names %nope"):
        runtime.plan_buffers(graph, [Launch("k", "x", "nope")], ())


# ---------------------------------------------------------------------------------------------
# launching, on a recording stand-in for the driver


class RecordingDriver(LaunchRecorder):
    """The driver calls an Executable makes, recorded; every call succeeds."""

    class CUfunction_attribute:
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = "max dynamic shared memory"

    def __init__(self, arity: dict):
        super().__init__(arity)
        self.next_pointer = 0x10000

    def cuModuleGetFunction(self, module, name):
        return 0, FakeFunction(name.decode())

    def cuMemAlloc(self, size):
        self.next_pointer += 0x10000
        self.calls.append(("alloc", size))
        return 0, self.next_pointer

    def cuMemsetD8(self, ptr, value, size):
        return (0,)

    def cuFuncSetAttribute(self, function, attribute, value):
        self.calls.append(("attribute", function, value))
        return (0,)

    def cuMemFree(self, ptr):
        return (0,)

    def cuModuleUnload(self, module):
        return (0,)


@pytest.mark.parametrize("path", LAUNCH_PATHS)
def test_a_call_fills_each_launch_s_parameters_and_launches_in_order_on_its_stream(monkeypatch, path):
    """Executable.run_pointers, the launch path every call takes (through mdsl's C launcher, and through
    cuda.bindings): each kernel gets its arguments' pointers (inputs, outputs, and the intermediates
    allocated once), in the program's order, on the call's stream; an output that lives in another
    argument's buffer is copied after."""
    from mdsl.backend.cuda import emit_cuda
    from mdsl.gpu import executable
    from mdsl.lowering.options import CudaOptions

    x, w = make_var("x", (4, 8), f32), make_var("w", (8, 2), f32)
    n1, e = node("exp", [x], "e")
    n2, y = node("matmul", [e, w], "y")
    n3, r = node("reshape", [x], "r", shape=(8, 4))    # a view of an input, returned: a copy
    # mdsl's own kernel for the matmul (tests/backend/test_library_gemm.py: its cuBLAS call instead)
    program = emit_cuda(KernelGraph("g", [x, w], [n1, n2, n3], [y, r]), arch="sm_90a",
                        options=CudaOptions(library_gemm=False))
    fake = RecordingDriver({launch.name: len(launch.args) for launch in program.launches})
    native = use_launch_path(monkeypatch, path, fake)
    monkeypatch.setattr(executable, "driver", fake)
    monkeypatch.setattr(executable, "get_device", lambda device: fake_device())
    monkeypatch.setattr(executable, "cu_stream", lambda handle: ("stream", handle))
    module = SimpleNamespace(load=lambda: "module")
    exe = executable.Executable(program, module)
    assert (exe.native is not None) == (path == "c")
    (scratch,) = [call[1] for call in fake.calls if call[0] == "alloc"]
    assert scratch == 4 * 8 * 4   # e, in f32
    fake.calls.clear()
    exe.run_pointers([0x1000, 0x2000], [0x3000, 0x4000], stream=7)
    launches = [call for call in fake.calls if call[0] == "launch"]
    assert [call[1] for call in launches] == [launch.name for launch in program.launches]
    e_ptr = launches[0][6][1]
    assert launches[0][6][:2] == [0x1000, e_ptr] and e_ptr not in (0x1000, 0x2000, 0x3000, 0x4000)
    assert launches[1][6] == [e_ptr, 0x2000, 0x3000]
    assert all(call[5] == ("stream", 7) for call in launches)
    assert [(launch.grid, launch.block) for launch in program.launches] == [(call[2], call[3]) for call in launches]
    assert fake.calls[-1] == ("copy", 0x4000, 0x1000, 4 * 8 * 4, ("stream", 7))
    native.check()
    exe.close()


class ReleaseRecorder(RecordingDriver):
    """Records frees and unloads too; `captured`: the stream handles cuStreamIsCapturing says are capturing."""

    class CUstreamCaptureStatus:
        CU_STREAM_CAPTURE_STATUS_NONE, CU_STREAM_CAPTURE_STATUS_ACTIVE = 0, 1

    def __init__(self, arity: dict):
        super().__init__(arity)
        self.captured = set()

    def cuMemFree(self, ptr):
        self.calls.append(("free", ptr))
        return (0,)

    def cuModuleUnload(self, module):
        self.calls.append(("unload", module))
        return (0,)

    def cuStreamIsCapturing(self, stream):
        return 0, int(stream[1] in self.captured)


def test_an_executable_the_collector_collects_frees_at_mdsl_s_next_driver_call_never_inside_a_capture(monkeypatch):
    """An Executable whose last reference goes frees at once; one that Python's cyclic collector collects (at
    any allocation, while some stream may be captured into a CUDA graph: cuMemFree there invalidates the
    capture) queues its frees, and the next safe point makes them, unless the stream it is about to use is being
    captured."""
    from mdsl.backend.cuda import emit_cuda
    from mdsl.gpu import driver as driver_module
    from mdsl.gpu import executable

    x = make_var("x", (4, 8), f32)
    n1, e = node("exp", [x], "e")
    n2, y = node("exp", [e], "y")
    program = emit_cuda(KernelGraph("g", [x], [n1, n2], [y]), arch="sm_90a")
    fake = ReleaseRecorder({launch.name: len(launch.args) for launch in program.launches})
    use_launch_path(monkeypatch, "bindings", fake)
    for module in (executable, driver_module):
        monkeypatch.setattr(module, "driver", fake)
        monkeypatch.setattr(module, "cu_stream", lambda handle: ("stream", handle))
    monkeypatch.setattr(executable, "get_device", lambda device: fake_device())
    monkeypatch.setattr(driver_module, "has_gpu", lambda: True)
    monkeypatch.setattr(driver_module, "_PENDING", [])
    frees = lambda: [call for call in fake.calls if call[0] in ("free", "unload")]   # noqa: E731

    dropped = executable.Executable(program, SimpleNamespace(load=lambda: "dropped"))
    del dropped   # its last reference: freed at once
    assert ("unload", "dropped") in frees() and driver_module._PENDING == []

    fake.calls.clear()
    cycle = [executable.Executable(program, SimpleNamespace(load=lambda: "module"))]
    cycle.append(cycle)   # only the cyclic collector frees it
    (scratch,) = [call[1] for call in fake.calls if call[0] == "alloc"]
    scratch_ptr = fake.next_pointer
    del cycle
    gc.collect()
    assert frees() == [] and len(driver_module._PENDING) == 1
    fake.captured.add(7)
    driver_module.release_pending(7)   # stream 7 is being captured: not now
    assert frees() == [] and len(driver_module._PENDING) == 1
    driver_module.release_pending(8)
    assert frees() == [("free", scratch_ptr), ("unload", "module")] and driver_module._PENDING == []
    assert scratch == 4 * 8 * 4

    fake.calls.clear()   # loading a module is a safe point too
    cycle = [executable.Executable(program, SimpleNamespace(load=lambda: "first"))]
    cycle.append(cycle)
    del cycle
    gc.collect()
    executable.Executable(program, SimpleNamespace(load=lambda: "second")).close()
    assert frees().index(("unload", "first")) < frees().index(("unload", "second")) and driver_module._PENDING == []


@pytest.mark.parametrize("path", LAUNCH_PATHS)
def test_a_split_and_its_combine_in_one_launch_get_their_counters_zeroed_once(monkeypatch, path):
    """The counters of a split and its combine in one launch (mdsl.lowering.onelaunch): allocated once with
    the executable, zeroed (the intermediates are filled with NaN), passed after the launch's tensors, the same
    buffer at every call (each launch leaves it zero: no clearing per call)."""
    from mdsl.backend.cuda import emit_cuda
    from mdsl.gpu import executable
    from tests.backend.ptx.plans import split_k

    program = emit_cuda(split_k(), arch="sm_90a")
    (launch,) = program.launches
    assert launch.counters == 4

    class Recording(RecordingDriver):
        def cuMemsetD8(self, ptr, value, size):
            self.calls.append(("memset", ptr, value, size))
            return (0,)

    fake = Recording({launch.name: len(launch.args) + 1})
    native = use_launch_path(monkeypatch, path, fake)
    monkeypatch.setattr(executable, "driver", fake)
    monkeypatch.setattr(executable, "get_device", lambda device: fake_device())
    monkeypatch.setattr(executable, "cu_stream", lambda handle: ("stream", handle))
    exe = executable.Executable(program, SimpleNamespace(load=lambda: "module"))
    memsets = {call[1]: (call[2], call[3]) for call in fake.calls if call[0] == "memset"}
    fake.calls.clear()
    for stream in (7, 8):
        exe.run_pointers([0x1000, 0x2000], [0x3000], stream=stream)
    first, second = [call[6] for call in fake.calls if call[0] == "launch"]
    assert first == second and first[:2] == [0x1000, 0x2000] and first[3] == 0x3000
    partials, counters = first[2], first[4]
    assert memsets[counters] == (0, 4 * 4) and memsets[partials] == (0xFF, 8 * 128 * 4)
    assert not any(call[0] == "memset" for call in fake.calls)   # nothing cleared per call
    native.check()
    exe.close()


# ---------------------------------------------------------------------------------------------
# streams

def test_stream_handles():
    class CoreStream:
        def __cuda_stream__(self):
            return (0, 1234)

    class TorchStream:
        cuda_stream = 99

    assert runtime.stream_handle(None) == 0
    assert runtime.stream_handle(7) == 7
    assert runtime.stream_handle(CoreStream()) == 1234
    assert runtime.stream_handle(TorchStream()) == 99
    with pytest.raises(ArgumentError, match="cannot use a str as a CUDA stream"):
        runtime.stream_handle("default")
    assert runtime.launch_stream([np.ones(2)]) == 0

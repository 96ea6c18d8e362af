"""`@mdsl.kernel` called on GPU arrays, without a GPU: torch is a stand-in module (`FakeTorch`), the driver
a recorder (`FakeDriver`, reached through cuda.bindings' calls or, on the C launcher's path, through
tests/backend/native_driver.py's callbacks; each test runs on both paths), and compiling emits the traced
graph's CUDA without NVRTC. What is checked:
a repeated call with the same signature does no argument checking and no compiling, only reads pointers,
allocates outputs and launches; a call whose signature differs (shape, dtype, strides, device) is
checked again and refused with the same errors; outputs are fresh per call; out= and stream= work.

`python -m tests.backend.cuda.test_kernel_call` prints the host time per call of the public path with
the launch stubbed (read, never asserted).
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import sys
import time
from types import SimpleNamespace

import pytest

import mdsl
from mdsl import Tensor, f16
from mdsl.backend.cuda import runtime
from mdsl.errors import DTypeError, ShapeError
from mdsl.gpu import arrays, driver as gpu_driver, executable, launcher
from mdsl.gpu.arrays import ArgumentError, DeviceArray
from mdsl.lowering.options import CudaOptions
from tests.backend.native_driver import CONTEXT, LAUNCH_PATHS, FakeFunction, use_launch_path

MiB = 1 << 20


# ---------------------------------------------------------------------------------------------
# stand-ins for torch and the driver

class FakeDType:
    def __init__(self, name: str, itemsize: int):
        self.name, self.itemsize = name, itemsize

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class FakeTensor:
    """What the runtime reads of a torch tensor; its memory is an address that is never dereferenced."""

    __module__ = "torch"   # what tells a torch tensor from other arrays

    def __init__(self, shape, dtype: FakeDType, *, device: int = 0, ptr: int = 0, strides=None):
        self.shape = shape if type(shape) is tuple else tuple(shape)
        self.dtype = dtype
        self._device = device
        self.is_cuda = device >= 0
        self._strides = strides
        self._contiguous = strides is None or tuple(strides) == _compact(self.shape)
        self._ptr = ptr or FakeTorch.allocate(self.shape, dtype)

    def data_ptr(self) -> int:
        return self._ptr

    def get_device(self) -> int:
        return self._device

    def stride(self) -> tuple:
        return _compact(self.shape) if self._strides is None else tuple(self._strides)

    def is_contiguous(self) -> bool:
        return self._contiguous

    def expand(self, shape) -> "FakeTensor":
        """A view of this one-element tensor at `shape` (every stride 0), as an output template is made."""
        assert self.shape == (), "only a one-element tensor is expanded here"
        return FakeTensor(shape, self.dtype, device=self._device, ptr=self._ptr, strides=(0,) * len(shape))


def _compact(shape) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class FakeTorch(SimpleNamespace):
    """The parts of the torch module the runtime uses: current streams, dtypes, torch.empty."""

    _next = itertools.count(1)

    def __init__(self):
        super().__init__(float16=FakeDType("float16", 2), float32=FakeDType("float32", 4),
                         float64=FakeDType("float64", 8), Tensor=FakeTensor)
        self.current = {0: 0x5000, 1: 0x5100}   # device -> its current stream's handle
        self.empties = []
        self.record = True   # keep the outputs made in `empties` (not when timing: they would pile up)
        self._C = SimpleNamespace(_cuda_getCurrentRawStream=lambda device: self.current[device])

    @classmethod
    def allocate(cls, shape, dtype) -> int:
        return 0x7F0000000000 + next(cls._next) * MiB

    def device(self, kind: str, index: int):
        return (kind, index)

    def empty(self, shape, *, dtype, device):
        return FakeTensor(shape, dtype, device=device[1])

    def empty_like(self, t):
        """A fresh compact tensor of t's shape, dtype and device (the outputs a call allocates: `empties`)."""
        new = FakeTensor(t.shape, t.dtype, device=t.get_device())
        if self.record:
            self.empties.append(new)
        return new


class FakeDriver:
    """The driver calls an Executable and a DeviceArray make, recorded; every call succeeds."""

    class CUfunction_attribute:
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = "max dynamic shared memory"

    class CUstream:
        pass

    def __init__(self, arity: dict, record: bool = True):
        self.calls, self.arity, self.record = [], arity, record   # kernel name -> its parameter count
        self.next_pointer = 0x10000

    def cuModuleGetFunction(self, module, name):
        return 0, FakeFunction(name.decode())

    def cuMemAlloc(self, size):
        self.next_pointer += 0x10000
        return 0, self.next_pointer

    def cuMemAllocAsync(self, size, stream):
        self.calls.append(("alloc async", size, stream))
        return 0, FakeTorch.allocate((size,), None)

    def cuMemFreeAsync(self, ptr, stream):
        return (0,)

    def cuMemsetD8(self, ptr, value, size):
        return (0,)

    def cuFuncSetAttribute(self, function, attribute, value):
        return (0,)

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        if self.record:
            block = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            pointers = [ctypes.cast(block[k], ctypes.POINTER(ctypes.c_uint64))[0]
                        for k in range(self.arity[function])]
            self.calls.append(("launch", function, stream, pointers))
        return (0,)

    def cuMemcpyDtoDAsync(self, dst, src, size, stream):
        self.calls.append(("copy", dst, src, size, stream))
        return (0,)

    def cuMemFree(self, ptr):
        return (0,)

    def cuModuleUnload(self, module):
        return (0,)

    def launches(self) -> list:
        return [c for c in self.calls if c[0] == "launch"]


class FakeDevice:
    max_smem = 227 * 1024
    context = CONTEXT

    def __init__(self):
        self.orders = []
        self.native = None   # the NativeDriver whose current context make_current sets

    def activate(self) -> None:
        pass

    def make_current(self) -> None:
        self.native.current = self.context

    def order(self, waiter: int, signaller: int) -> None:
        self.orders.append((waiter, signaller))


class Counter:
    """Wraps a function and counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


class Rig(SimpleNamespace):
    """Everything a test patched in, and the counters it reads."""


def install(monkeypatch, *kernels, record: bool = True, launch_path: str = "c") -> Rig:
    """Run `kernel` on fakes: torch, the driver, the device, and a compiler that emits the traced graph's
    CUDA (no search, no NVRTC); count argument checks and compiles (`record`: and record the launches;
    without it, the stand-ins cost as little as they can, for timing). The executables launch through
    `launch_path` (tests/backend/native_driver.py)."""
    from mdsl.backend.cuda import emit_cuda

    torch = FakeTorch()
    torch.record = record
    device = FakeDevice()
    fake = FakeDriver({}, record)
    device.native = use_launch_path(monkeypatch, launch_path, fake, stub=not record)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(arrays, "_TORCH_DTYPES", {})
    monkeypatch.setattr(gpu_driver, "has_gpu", lambda: True)
    for module in (executable, arrays):
        monkeypatch.setattr(module, "driver", fake)
        monkeypatch.setattr(module, "get_device", lambda ordinal=0: device)
        monkeypatch.setattr(module, "cu_stream", lambda handle: ("stream", handle))

    def compile_graph(graph, *, arch=None, device=0, backend="cuda", options=None):
        # kernels only: the stand-in driver launches kernels, and cuBLAS is not among the stand-ins
        program = emit_cuda(graph, arch="sm_90a", options=CudaOptions(library_gemm=False))
        fake.arity.update({launch.name: len(launch.args) for launch in program.launches})
        return executable.Executable(program, SimpleNamespace(load=lambda: "module"), device=device)

    rig = Rig(torch=torch, driver=fake, device=device, native=device.native, compile=Counter(compile_graph),
              device_view=Counter(runtime.device_view), launch_stream=Counter(runtime.launch_stream))
    monkeypatch.setattr(runtime, "compile_graph", rig.compile)
    if record:
        monkeypatch.setattr(runtime, "device_view", rig.device_view)
        monkeypatch.setattr(executable, "device_view", rig.device_view)
        monkeypatch.setattr(runtime, "launch_stream", rig.launch_stream)
    monkeypatch.setattr(runtime, "target_arch", lambda device=0: "sm_90a")
    for kernel in kernels:
        monkeypatch.setattr(kernel, "_gpu_plan", lambda specs, arch: None)   # no plan: the traced graph
    return rig


@contextlib.contextmanager
def compiled_on_fakes(monkeypatch, *kernels, record: bool = True, launch_path: str = "c"):
    """`install`, with the kernels' executables and prepared calls the block's own: made on the fakes, and
    closed while the fakes are in place."""
    for kernel in kernels:
        monkeypatch.setattr(kernel, "_executables", {})
        monkeypatch.setattr(kernel, "_calls", {})
        monkeypatch.setattr(kernel, "_last_call", None)
    rig = install(monkeypatch, *kernels, record=record, launch_path=launch_path)
    try:
        yield rig
        rig.native.check()
    finally:
        for kernel in kernels:
            for exe in kernel._executables.values():
                exe.close()
            kernel._calls.clear()
            kernel._last_call = None


# ---------------------------------------------------------------------------------------------
# the kernels

@mdsl.kernel
def add(x: Tensor[4, 64, f16], y: Tensor[4, 64, f16]):   # one launch: one call is one recorded launch
    return x + y


@mdsl.kernel
def scale_add(x: Tensor[4, 64, f16], y: Tensor[4, 64, f16]):
    return x * 2.0 + y


@mdsl.kernel
def norm_linear(x, w):
    return mdsl.rms_norm(x) @ w


@mdsl.kernel
def sum_and_product(x: Tensor[4, 64, f16], y: Tensor[4, 64, f16]):   # two outputs
    return x + y, x * y


# ---------------------------------------------------------------------------------------------
# host time per call, with the launch stubbed

def _per_call_us(fn, calls: int, repeats: int) -> float:
    """The fastest of `repeats` runs of `calls` calls, in µs of this thread's CPU time per call (the least
    disturbed by other work on a shared machine)."""
    for _ in range(200):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        samples.append((time.thread_time() - start) / calls * 1e6)
    return min(samples)


def measure_host_path(calls: int = 20000, repeats: int = 5) -> list:
    """[(label, µs per call)]: the public call path's host time on stand-in torch tensors, with the driver's
    launch a no-op, through each launch path (the C launcher calling a compiled driver stub; cuda.bindings'
    calls answered by the Python stand-in): mdsl's own Python, plus the stand-ins' cost, which the last row
    gives alone (for the C launcher's path, whose driver stub costs nothing)."""
    rows = []
    for path in LAUNCH_PATHS:
        with pytest.MonkeyPatch.context() as monkeypatch, \
                compiled_on_fakes(monkeypatch, add, scale_add, norm_linear, record=False, launch_path=path) as rig:
            h = rig.torch.float16
            x, y, out = (FakeTensor((4, 64), h) for _ in range(3))
            xb, w = FakeTensor((1, 4096), h), FakeTensor((4096, 4096), h)
            cases = [("add(x, y): output allocated", lambda: add(x, y)),
                     ("add(x, y, out=out)", lambda: add(x, y, out=out)),
                     ("add(x, y, stream=7)", lambda: add(x, y, stream=7)),
                     ("scale_add(x, y): output allocated", lambda: scale_add(x, y)),
                     ("norm_linear(x, w): batch 1, output allocated", lambda: norm_linear(xb, w))]
            for label, call in cases:
                call()
                launches = sum(len(exe.program.launches) for k in (add, scale_add, norm_linear)
                               for exe in k._executables.values() if label.startswith(k.name + "("))
                rows.append((f"{label}, {launches} launch(es), launched through {path}",
                             _per_call_us(call, calls, repeats)))
            if path == "c":
                template = FakeTensor((), h).expand((4, 64))

                def stand_ins():   # what a call of add(x, y) spends outside mdsl: the tensor attributes it reads
                    for t in (x, y):
                        t.shape, t.dtype, t.get_device(), t.is_contiguous(), t.data_ptr()
                    rig.torch._C._cuda_getCurrentRawStream(0)
                    rig.torch.empty_like(template).data_ptr()

                rows.append(("the stand-ins alone, as add(x, y) uses them", _per_call_us(stand_ins, calls, repeats)))
    return rows

# ---------------------------------------------------------------------------------------------
# the prepared path

@pytest.fixture(params=LAUNCH_PATHS)
def rig(monkeypatch, request):
    with compiled_on_fakes(monkeypatch, add, norm_linear, sum_and_product, launch_path=request.param) as rig:
        yield rig


@pytest.fixture
def c_rig(monkeypatch):
    """The rig, launching through the C launcher only (for what only that path does)."""
    with compiled_on_fakes(monkeypatch, add, launch_path="c") as rig:
        yield rig


def halves(rig, *shapes, **options):
    return [FakeTensor(shape, rig.torch.float16, **options) for shape in shapes]


def checks(rig) -> tuple:
    """(argument checks, stream look-ups, compiles) so far."""
    return rig.device_view.calls, rig.launch_stream.calls, rig.compile.calls


def test_a_repeated_call_checks_and_compiles_nothing_and_launches_on_its_own_pointers(rig):
    x, y = halves(rig, (4, 64), (4, 64))
    first = add(x, y)
    after_first = checks(rig)
    assert after_first == (3, 1, 1)   # two inputs and the output checked, the stream chosen, one compile
    x2, y2 = halves(rig, (4, 64), (4, 64))
    second = add(x2, y2)
    assert checks(rig) == after_first, "a repeated call with the same signature was checked or compiled again"
    assert len(add._calls) == 1 and len(add._executables) == 1
    (_, _, stream1, ptrs1), (_, _, stream2, ptrs2) = rig.driver.launches()
    assert ptrs1 == [x.data_ptr(), y.data_ptr(), first.data_ptr()]
    assert ptrs2 == [x2.data_ptr(), y2.data_ptr(), second.data_ptr()]
    assert stream1 == stream2 == ("stream", rig.torch.current[0])   # torch's current stream
    assert second is not first and second.data_ptr() != first.data_ptr(), "outputs are not fresh per call"
    assert (second.shape, second.dtype, second.get_device()) == ((4, 64), rig.torch.float16, 0)
    assert rig.torch.empties == [first, second]


def test_the_current_torch_stream_is_read_at_every_call(rig):
    x, y = halves(rig, (4, 64), (4, 64))
    add(x, y)
    rig.torch.current[0] = 0x7777   # as under `with torch.cuda.stream(s)`
    add(x, y)
    assert [call[2] for call in rig.driver.launches()] == [("stream", 0x5000), ("stream", 0x7777)]
    assert rig.compile.calls == 1


@pytest.mark.parametrize("change, error, fragment", [
    ("shape", ShapeError, "argument x is Tensor[4, 32, f16] but is annotated Tensor[4, 64, f16]"),
    ("dtype", DTypeError, "argument x is Tensor[4, 64, f32] but is annotated"),
    ("strides", ArgumentError, "argument x is not contiguous (strides (1, 4) for shape (4, 64))"),
    ("host", ArgumentError, "argument x is a torch tensor on the CPU"),
    ("device", ArgumentError, "argument y is on GPU 1, but argument x is on GPU 0"),
    ("alignment", ArgumentError, "argument x starts at address 0x7f0000000002, which is not 16-byte aligned"),
])
def test_a_changed_argument_is_checked_again_and_refused_before_any_launch(rig, change, error, fragment):
    x, y = halves(rig, (4, 64), (4, 64))
    add(x, y)
    add(x, y)
    before = checks(rig)
    h = rig.torch.float16
    bad = {"shape": lambda: (FakeTensor((4, 32), h), y),
           "dtype": lambda: (FakeTensor((4, 64), rig.torch.float32), y),
           "strides": lambda: (FakeTensor((4, 64), h, strides=(1, 4)), y),
           "host": lambda: (FakeTensor((4, 64), h, device=-1), y),
           "device": lambda: (x, FakeTensor((4, 64), h, device=1)),
           "alignment": lambda: (FakeTensor((4, 64), h, ptr=0x7F0000000002), y)}[change]()
    launched = len(rig.driver.launches())
    with pytest.raises(error) as info:
        add(*bad)
    assert fragment in str(info.value)
    assert "test_kernel_call.py" in str(info.value), "the error does not point at the call"
    assert "hint:" in str(info.value)
    assert len(rig.driver.launches()) == launched, f"{change}: a launch happened although an argument was refused"
    assert checks(rig)[0] > before[0], f"{change}: the changed argument was not checked again"
    after = checks(rig)
    add(x, y)   # the good signature still takes the prepared path
    assert checks(rig) == after and len(rig.driver.launches()) == launched + 1


def test_each_signature_gets_its_own_executable(rig):
    x, w = halves(rig, (1, 256), (256, 64))
    norm_linear(x, w)
    norm_linear(x, w)
    assert rig.compile.calls == 1
    x8 = FakeTensor((8, 256), rig.torch.float16)
    y8 = norm_linear(x8, w)
    assert rig.compile.calls == 2 and y8.shape == (8, 64)
    x1, w1 = halves(rig, (1, 256), (256, 64), device=1)
    y1 = norm_linear(x1, w1)
    assert rig.compile.calls == 3 and y1.get_device() == 1, "arguments on another GPU need their own executable"
    assert rig.driver.launches()[-1][2] == ("stream", rig.torch.current[1])
    before = checks(rig)
    for args in ((x, w), (x8, w), (x1, w1)):
        norm_linear(*args)
    assert checks(rig) == before and len(norm_linear._calls) == 3


def test_the_prepared_calls_kept_per_kernel_are_bounded(rig, monkeypatch):
    from mdsl.frontend import kernel as frontend

    monkeypatch.setattr(frontend, "_MAX_PREPARED_CALLS", 2)
    w = FakeTensor((256, 64), rig.torch.float16)
    for rows in (1, 2, 3, 1):
        assert norm_linear(FakeTensor((rows, 256), rig.torch.float16), w).shape == (rows, 64)
        assert len(norm_linear._calls) <= 2
    assert rig.compile.calls == 3, "an executable was compiled again: only prepared calls are dropped"


def test_out_is_written_and_returned_and_checked_once_per_signature(rig):
    x, y = halves(rig, (4, 64), (4, 64))
    out = FakeTensor((4, 64), rig.torch.float16)
    assert add(x, y, out=out) is out
    before = checks(rig)
    out2 = FakeTensor((4, 64), rig.torch.float16)
    assert add(x, y, out=(out2,)) is out2
    assert checks(rig) == before
    assert [call[3][-1] for call in rig.driver.launches()] == [out.data_ptr(), out2.data_ptr()]
    assert rig.torch.empties == [], "out= was given, yet outputs were allocated"
    with pytest.raises(ShapeError, match="output 0 of .* has shape \\[4, 32\\]"):
        add(x, y, out=FakeTensor((4, 32), rig.torch.float16))
    with pytest.raises(ArgumentError, match="has 1 output\\(s\\), got 2"):
        add(x, y, out=(out, out2))
    with pytest.raises(ArgumentError, match="not 16-byte aligned"):
        add(x, y, out=FakeTensor((4, 64), rig.torch.float16, ptr=0x7F0000000008))
    assert len(rig.driver.launches()) == 2


def test_stream_is_read_at_every_call_and_a_bad_one_is_refused(rig):
    x, y = halves(rig, (4, 64), (4, 64))
    add(x, y, stream=7)
    add(x, y, stream=SimpleNamespace(cuda_stream=9))   # a torch.cuda.Stream
    assert [call[2] for call in rig.driver.launches()] == [("stream", 7), ("stream", 9)]
    assert rig.compile.calls == 1 and rig.launch_stream.calls == 1
    with pytest.raises(ArgumentError, match="cannot use a str as a CUDA stream") as info:
        add(x, y, stream="default")
    assert "test_kernel_call.py" in str(info.value)
    assert len(rig.driver.launches()) == 2


def test_named_arguments_take_the_prepared_path_too(rig):
    x, y = halves(rig, (4, 64), (4, 64))
    add(x, y)
    before = checks(rig)
    add(y=y, x=x)
    assert checks(rig) == before
    assert rig.driver.launches()[-1][3][:2] == [x.data_ptr(), y.data_ptr()]


def test_device_arrays_are_ordered_after_their_streams_at_every_call(rig):
    made = []

    def array(stream):
        made.append(DeviceArray((4, 64), f16, stream=stream))
        return made[-1]

    try:
        x, y = array(3), array(0)
        z = add(x, y)
        z2 = add(x, y)
        assert isinstance(z2, DeviceArray) and z2 is not z and z2.ptr != z.ptr and z2.stream == 0
        made += [z, z2]
        assert rig.device.orders == [(0, 3), (0, 3)], "x's pending work on stream 3 was not waited for"
        assert rig.compile.calls == 1 and rig.device_view.calls == 3
        out = array(5)
        add(x, y, out=out, stream=4)
        add(x, y, out=out, stream=4)
        assert rig.device.orders[2:] == [(4, 3), (4, 0), (4, 5), (4, 3), (4, 0)]
        assert out.stream == 4   # its contents are ready once stream 4 gets there
    finally:   # the stand-in driver's memory: nothing to free through the real one
        for a in made:
            a.ptr = 0


def test_arrays_read_through_their_protocols_are_checked_at_every_call(rig, monkeypatch):
    from tests.backend.test_runtime_cpu import FakeCudaArray

    monkeypatch.setattr(arrays, "_pointer_device", lambda ptr, what: 0)   # no GPU memory to ask the driver about
    x, y = FakeCudaArray((4, 64)), FakeCudaArray((4, 64))
    add(x, y)
    add(x, y)
    assert add._calls == {} and rig.device_view.calls == 6 and rig.compile.calls == 1
    assert len(rig.driver.launches()) == 2


def test_an_argument_whose_signature_cannot_be_read_gets_the_checked_path_s_error(rig):
    class Odd:
        is_cuda, shape, dtype = True, (4, 64), "float16"

        def get_device(self):
            return 0

        def is_contiguous(self):
            raise RuntimeError("this layout has no contiguity")

    x, y = halves(rig, (4, 64), (4, 64))
    add(x, y)
    with pytest.raises(ArgumentError, match="argument x is a Odd, not a GPU array"):
        add(Odd(), y)


def test_a_call_of_torch_tensors_takes_the_generated_path_and_others_the_general_one(rig):
    from mdsl.gpu.calls import PreparedCall

    x, y = halves(rig, (4, 64), (4, 64))
    add(x, y)
    assert add._last_call.__name__ == "fast", "torch tensors in, outputs allocated: not the generated path"
    add(x, y, stream=7)
    assert add._last_call.__name__ == "fast"
    d = DeviceArray.__new__(DeviceArray)   # a DeviceArray with no memory: never launched on here
    d.shape, d.dtype, d.device, d.ptr, d.stream = (4, 64), f16, 0, 0x7F0000000000, 0
    add(x, d)
    assert isinstance(add._last_call, PreparedCall), "a DeviceArray: the general prepared call"
    d.ptr = 0
    out = FakeTensor((4, 64), rig.torch.float16)
    add(x, y, out=out)
    assert add._last_call.__name__ == "fast"
    before = checks(rig)
    for _ in range(2):   # each signature again: prepared (the last one tried first, the others looked up)
        add(x, y)
        add(x, y, stream=7)
        assert add(x, y, out=out) is out
    assert checks(rig) == before and len(add._calls) == 4
    assert [c[3][2] for c in rig.driver.launches()][-3:-1] != [out.data_ptr()] * 2   # fresh outputs
    assert rig.driver.launches()[-1][3] == [x.data_ptr(), y.data_ptr(), out.data_ptr()]


def test_two_outputs_are_allocated_fresh_or_written_into_on_the_generated_path(rig):
    x, y = halves(rig, (4, 64), (4, 64))
    sum_and_product(x, y)
    before = checks(rig)
    s, p = sum_and_product(x, y)
    assert checks(rig) == before and sum_and_product._last_call.__name__ == "fast"
    (exe,) = sum_and_product._executables.values()
    n = len(exe.program.launches)
    assert sorted({ptr for c in rig.driver.launches()[-n:] for ptr in c[3]}) == \
        sorted([x.data_ptr(), y.data_ptr(), s.data_ptr(), p.data_ptr()])
    assert s is not p and s.data_ptr() != p.data_ptr()
    outs = halves(rig, (4, 64), (4, 64))
    assert sum_and_product(x, y, out=outs) == tuple(outs)
    assert sum_and_product(x, y, out=list(outs)) == tuple(outs)
    assert sorted({ptr for c in rig.driver.launches()[-n:] for ptr in c[3]}) == \
        sorted([x.data_ptr(), y.data_ptr(), *(o.data_ptr() for o in outs)])
    with pytest.raises(ArgumentError, match="has 2 output\\(s\\), got 1"):
        sum_and_product(x, y, out=outs[0])
    with pytest.raises(DTypeError, match="output 1 of .* is float32"):
        sum_and_product(x, y, out=(outs[0], FakeTensor((4, 64), rig.torch.float32)))


def test_a_misaligned_output_passed_in_is_refused_on_the_generated_path(rig):
    x, y = halves(rig, (4, 64), (4, 64))
    add(x, y, out=FakeTensor((4, 64), rig.torch.float16))
    launched = len(rig.driver.launches())
    with pytest.raises(ArgumentError, match="not 16-byte aligned"):
        add(x, y, out=FakeTensor((4, 64), rig.torch.float16, ptr=0x7F0000000004))
    assert len(rig.driver.launches()) == launched


def test_a_context_made_current_elsewhere_is_made_the_executable_s_again(c_rig):
    rig = c_rig
    x, y = halves(rig, (4, 64), (4, 64))
    add(x, y)
    rig.native.current = 0xBAD   # as after another library made its own context current
    z = add(x, y)
    assert rig.native.current == CONTEXT
    assert rig.driver.launches()[-1][3] == [x.data_ptr(), y.data_ptr(), z.data_ptr()]
    assert len(rig.driver.launches()) == 2


def test_a_failed_launch_raises_mdsl_s_error_naming_the_kernel(c_rig, monkeypatch):
    from mdsl.errors import MdslError

    monkeypatch.setattr(executable, "error_text", lambda err: f"CUresult {err}")
    x, y = halves(c_rig, (4, 64), (4, 64))
    add(x, y)
    (name,) = {c[1] for c in c_rig.driver.launches()}
    c_rig.native.errors[name] = 700
    with pytest.raises(MdslError, match="launching a kernel of add failed: CUresult 700") as info:
        add(x, y)
    assert "test_kernel_call.py" in str(info.value), "the error does not point at the call"


@pytest.mark.parametrize("arity, outputs", [(1, 1), (2, 1), (3, 2), (5, 3)])
@pytest.mark.parametrize("out_given", [False, True])
@pytest.mark.parametrize("stream_given", [False, True])
@pytest.mark.parametrize("native", [False, True])
def test_the_generated_source_compiles_for_any_count(arity, outputs, out_given, stream_given, native):
    from mdsl.gpu.calls import fast_source

    source = fast_source(arity, outputs, out_given, stream_given, native)
    compile(source, "<test>", "exec")
    assert source.count(".data_ptr()") == arity + outputs
    assert source.count("empty_like(") == (0 if out_given else outputs)
    assert ("run(call)" in source) == native


def test_the_key_holds_each_argument_s_signature():
    from mdsl.gpu.signature import call_key, signature

    h = FakeTorch().float16
    args = (FakeTensor((4, 64), h), FakeTensor((64,), h, device=1, strides=(2,)))
    assert call_key(args, None, None, "cuda")[3:] == signature(args)
    assert signature(args)[1] == (FakeTensor, (64,), h, True, 1, False)
    assert call_key(args, args[0], 7, "ptx")[:3] == ("ptx", False, signature(args[:1]))


def test_host_arrays_still_run_on_the_interpreter_after_a_gpu_call(rig):
    import numpy as np

    x, y = halves(rig, (4, 64), (4, 64))
    add(x, y)
    a = np.ones((4, 64), np.float16)
    np.testing.assert_array_equal(add(a, a), a + a)


# ---------------------------------------------------------------------------------------------
# on a GPU, with torch: the same path for real

@pytest.mark.gpu
@pytest.mark.skipif(not runtime.has_gpu(), reason="no NVIDIA GPU and driver on this machine")
def test_on_the_gpu_each_repeated_call_computes_its_own_inputs(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(add, "_executables", {})
    monkeypatch.setattr(add, "_calls", {})
    monkeypatch.setattr(add, "_last_call", None)
    monkeypatch.setattr(add, "_gpu_plan", lambda specs, arch: None)   # no search: the traced graph

    def pair():
        return [torch.randn(4, 64, device="cuda", dtype=torch.float16) for _ in range(2)]

    results = []
    for _ in range(3):
        x, y = pair()
        z = add(x, y)
        torch.testing.assert_close(z, x + y)
        results.append(z)
    assert len({z.data_ptr() for z in results}) == 3 and len(add._calls) == 1
    assert add._last_call.__name__ == "fast", "a repeated call of torch tensors did not take the generated path"
    if launcher._compiler() is not None:
        (exe,) = add._executables.values()
        assert exe.native is not None, "the C launcher was not used, although a C compiler is here"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # torch's current stream, read at every call
        x, y = pair()
        z = add(x, y)
    side.synchronize()
    torch.testing.assert_close(z, x + y)
    out = torch.full((4, 64), float("nan"), device="cuda", dtype=torch.float16)
    for _ in range(2):
        x, y = pair()
        assert add(x, y, out=out, stream=torch.cuda.current_stream()) is out
        torch.testing.assert_close(out, x + y)
    with pytest.raises(ArgumentError, match="argument x is not contiguous"):
        add(torch.randn(64, 4, device="cuda", dtype=torch.float16).t(), y)
    with pytest.raises(ArgumentError, match="not 16-byte aligned"):
        add(torch.randn(257, device="cuda", dtype=torch.float16)[1:].reshape(4, 64), y)


def test_host_time_per_call_is_printed(capsys):
    rows = measure_host_path(calls=2000, repeats=3)
    with capsys.disabled():
        print("\nhost CPU time per call (µs), launch stubbed, fastest of 3 x 2000 calls:")
        for label, micros in rows:
            print(f"  {micros:8.2f}  {label}")
    assert [label for label, _ in rows][0].startswith("add(x, y)")


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    print(f"host CPU time per call (µs), launch stubbed, fastest of 5 x {calls} calls:")
    for label, micros in measure_host_path(calls):
        print(f"  {micros:8.2f}  {label}")


if __name__ == "__main__":
    main()

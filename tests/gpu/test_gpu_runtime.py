"""The GPU runtime on a GPU: DeviceArrays, torch and foreign arrays, hand-written programs through
Executable (outputs allocated or passed in, streams, > 48 KB of shared memory), every bad argument
refused before anything is launched, `@mdsl.kernel` called on GPU arrays, and launch overhead
(measured and printed, never asserted)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import attrs

import numpy as np
import pytest

import mdsl
from mdsl import Tensor, f16, f32
from mdsl.backend.cuda import runtime
from mdsl.gpu import ArgumentError, DeviceArray, Executable
from mdsl.errors import DTypeError, ShapeError
from mdsl.ir.dtypes import bf16, i32, round_to_dtype
from tests.gpu import handwritten
from tests.gpu.harness import SEED, random_inputs, reference, relative_error, rng_for

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    assert torch.cuda.is_available(), "torch cannot see the GPU that the CUDA driver reports"
    return torch


def load(program) -> Executable:
    return Executable(program, runtime.compile_source(program.source, runtime.target_arch()))


def rand(shape, seed_key: str, dtype=np.float32) -> np.ndarray:
    return rng_for(seed_key).standard_normal(shape).astype(dtype)


def test_the_target_is_hopper():
    assert runtime.target_arch() == "sm_90a", f"compute capability {runtime._device(0).capability}"


# ---------------------------------------------------------------------------------------------
# DeviceArray

@pytest.mark.parametrize("dtype", [f16, bf16, f32, i32], ids=lambda d: d.name)
def test_device_array_round_trip(dtype):
    x = rand((37, 129), f"round-trip-{dtype.name}") * 100
    if dtype is i32:
        x = x.astype(np.int32)
    want = round_to_dtype(x.astype(np.float64), dtype) if dtype.is_float else x
    array = DeviceArray.from_numpy(x, dtype)
    assert (array.shape, array.dtype, array.nbytes) == ((37, 129), dtype, 37 * 129 * dtype.itemsize)
    assert array.ptr % runtime.ALIGNMENT == 0
    back = array.to_numpy()
    np.testing.assert_array_equal(back.astype(np.float64), want.astype(np.float64),
                                  err_msg=f"seed {SEED}: {dtype} data changed on its way to the GPU and back")


def test_device_arrays_are_consumed_by_torch_without_copies(torch):
    for dtype, tdtype in [(f16, torch.float16), (bf16, torch.bfloat16), (f32, torch.float32), (i32, torch.int32)]:
        x = (rand((8, 33), "dlpack-to-torch") * 10).astype(np.int32 if dtype is i32 else np.float32)
        array = DeviceArray.from_numpy(x, dtype)
        t = torch.from_dlpack(array)
        assert t.dtype == tdtype and t.is_cuda and tuple(t.shape) == (8, 33)
        assert t.data_ptr() == array.ptr, "torch copied the DeviceArray instead of sharing it"
        want = torch.from_numpy(array.to_numpy()).to(tdtype).cuda()
        del array   # the tensor keeps the memory alive
        assert torch.equal(t, want), f"{dtype}: torch sees other values than the DeviceArray holds"
    x = rand((8, 33), "cai-to-torch")
    array = DeviceArray.from_numpy(x, f32)
    t = torch.as_tensor(array, device="cuda")   # through __cuda_array_interface__
    assert t.data_ptr() == array.ptr
    np.testing.assert_array_equal(t.cpu().numpy(), x)


class CudaArrayInterfaceOnly:
    def __init__(self, t):
        self.__cuda_array_interface__ = t.__cuda_array_interface__
        self.shape, self.dtype = tuple(t.shape), str(t.dtype)


class DLPackOnly:
    def __init__(self, t):
        self.t, self.shape, self.dtype = t, tuple(t.shape), str(t.dtype)

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def test_torch_and_foreign_gpu_arrays_are_read_in_place(torch):
    t = torch.randn(16, 24, device="cuda", dtype=torch.float16)
    want = runtime.View(t.data_ptr(), (16, 24), f16, t.get_device())
    for value in (t, CudaArrayInterfaceOnly(t), DLPackOnly(t)):
        assert runtime.device_view(value, "x") == want, type(value).__name__
    b = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16)
    assert runtime.device_view(DLPackOnly(b), "x").dtype is bf16


# ---------------------------------------------------------------------------------------------
# Executable on hand-written programs

def test_axpy_with_device_arrays_allocated_and_passed_in_outputs():
    n = 1000
    exe = load(handwritten.axpy(n))
    x, y = rand(n, "axpy-x"), rand(n, "axpy-y")
    want = 2 * x.astype(np.float64) + y
    (z,) = exe([DeviceArray.from_numpy(x), DeviceArray.from_numpy(y)])
    assert isinstance(z, DeviceArray) and z.dtype is f32
    np.testing.assert_allclose(z.to_numpy(), want, rtol=1e-6, err_msg="axpy with mdsl-allocated output")
    out = DeviceArray.from_numpy(np.full(n, np.nan, np.float32))
    (same,) = exe([DeviceArray.from_numpy(x), DeviceArray.from_numpy(y)], [out])
    assert same is out
    np.testing.assert_allclose(out.to_numpy(), want, rtol=1e-6, err_msg="axpy into a passed-in output")


def test_axpy_with_torch_tensors_on_a_side_stream(torch):
    n = 4096
    exe = load(handwritten.axpy(n))
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        (z,) = exe([x, y])      # torch's current stream: the side stream
    stream.synchronize()
    assert isinstance(z, torch.Tensor) and z.is_cuda and z.dtype == torch.float32
    torch.testing.assert_close(z, 2 * x + y)
    out = torch.full((n,), float("nan"), device="cuda")
    exe([x, y], [out], stream=stream)
    stream.synchronize()
    torch.testing.assert_close(out, 2 * x + y)


def test_collected_executables_and_arrays_leave_a_cuda_graph_capture_intact(torch):
    """An Executable and a DeviceArray collected while torch captures a CUDA graph (the cyclic collector runs
    at any allocation) free nothing there, which would invalidate the capture; their frees wait for mdsl's
    next driver call outside it."""
    import gc

    from mdsl.gpu import driver as driver_module

    n = 4096
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        z = x * 2 + y   # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    gc.disable()   # (the cycle below is collected inside the capture, not before it)
    try:
        doomed = [load(handwritten.axpy(n)), DeviceArray.from_numpy(np.ones(n, np.float32))]
        doomed.append(doomed)   # a cycle: only the cyclic collector frees it
        del doomed
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            z = x * 2 + y
            gc.collect()
            z = z + 1
    finally:
        gc.enable()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(z, x * 2 + y + 1)
    assert driver_module._PENDING, "the collected objects freed nothing"
    kept = DeviceArray.from_numpy(np.ones(4, np.float32))   # an allocation outside the capture makes the frees
    assert not driver_module._PENDING and kept.ptr


def test_run_pointers_is_the_unchecked_fast_path(torch):
    n = 512
    exe = load(handwritten.axpy(n))
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    z = torch.full((n,), float("nan"), device="cuda")
    torch.cuda.synchronize()   # run_pointers uses the legacy default stream here
    exe.run_pointers([x.data_ptr(), y.data_ptr()], [z.data_ptr()])
    torch.cuda.synchronize()
    torch.testing.assert_close(z, 2 * x + y)


def test_more_than_48_kb_of_dynamic_shared_memory():
    program = handwritten.reverse_through_shared_memory(blocks=6)
    exe = load(program)
    x = rand(program.graph.inputs[0].shape, "smem")
    (z,) = exe([DeviceArray.from_numpy(x)])
    np.testing.assert_array_equal(z.to_numpy(), -x)


# ---------------------------------------------------------------------------------------------
# bad arguments: refused before anything is launched

@pytest.fixture(scope="module")
def axpy_exe():
    return load(handwritten.axpy(256))


def bad_arguments(torch):
    good = torch.randn(256, device="cuda")
    return [
        ("wrong shape", ShapeError, "has shape [255]", [torch.randn(255, device="cuda"), good]),
        ("wrong dtype", DTypeError, "float16", [good.half(), good]),
        ("a CPU tensor", ArgumentError, "on the CPU", [good.cpu(), good]),
        ("a numpy array", ArgumentError, "in host memory", [np.zeros(256, np.float32), good]),
        ("non-contiguous", ArgumentError, "not contiguous", [torch.randn(512, device="cuda")[::2], good]),
        ("misaligned", ArgumentError, "not 16-byte aligned", [torch.randn(257, device="cuda")[1:], good]),
        ("too few inputs", ArgumentError, "takes 2 input(s), got 1", [good]),
    ]


def test_every_bad_argument_is_an_mdsl_error_before_any_launch(torch, axpy_exe):
    for what, error, fragment, inputs in bad_arguments(torch):
        out = torch.full((256,), float("nan"), device="cuda")
        with pytest.raises(error) as info:
            axpy_exe(inputs, [out])
        assert fragment in str(info.value), f"{what}: {info.value}"
        assert "hint:" in str(info.value), f"{what}: the error gives no hint: {info.value}"
        torch.cuda.synchronize()
        assert torch.isnan(out).all(), f"{what}: the kernel ran although an argument was refused"


def test_bad_outputs_are_refused_too(torch, axpy_exe):
    x = torch.randn(256, device="cuda")
    with pytest.raises(ArgumentError, match="1 output"):
        axpy_exe([x, x], [x.clone(), x.clone()])
    with pytest.raises(ShapeError):
        axpy_exe([x, x], [torch.empty(128, device="cuda")])


# ---------------------------------------------------------------------------------------------
# @mdsl.kernel on GPU arrays

@mdsl.kernel
def norm_linear(x: Tensor[8, 64, f16], w: Tensor[64, 32, f16]):
    return mdsl.rms_norm(x) @ w


@pytest.fixture(autouse=True)
def quick_search(monkeypatch):
    """The kernel's first GPU call searches for a plan: keep that search short here."""
    optimize = type(norm_linear).optimize

    def quick(*specs, config):
        return optimize(norm_linear, *specs, config=attrs.evolve(config, budget_s=20.0, workers=2))

    monkeypatch.setattr(norm_linear, "optimize", quick)


def expected(kernel, *arrays) -> np.ndarray:
    (want,) = reference(kernel.graph, [np.asarray(a, np.float32) for a in arrays])
    return want


def half_tensors(torch, *shapes):
    return [torch.randn(*shape, device="cuda", dtype=torch.float16) for shape in shapes]


def test_kernel_on_torch_tensors(torch):
    x, w = half_tensors(torch, (8, 64), (64, 32))
    y = norm_linear(x, w)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float16 and tuple(y.shape) == (8, 32)
    want = expected(norm_linear, x.cpu().float().numpy(), w.cpu().float().numpy())
    err = relative_error(y.float().cpu().numpy(), want)
    assert err < 3e-3, f"rms_norm(x) @ w on torch tensors: relative error {err:.2e}"
    out = torch.full((8, 32), float("nan"), device="cuda", dtype=torch.float16)
    assert norm_linear(x, w, out=out) is out
    torch.testing.assert_close(out, y)
    assert len(norm_linear._executables) == 1, "a second call with the same shapes compiled again"


def test_kernel_on_device_arrays():
    x, w = random_inputs(norm_linear.graph, rng_for("kernel-on-device-arrays"))
    y = norm_linear(DeviceArray.from_numpy(x, f16), DeviceArray.from_numpy(w, f16))
    assert isinstance(y, DeviceArray)
    err = relative_error(y.to_numpy().astype(np.float64), expected(norm_linear, x, w))
    assert err < 3e-3, f"rms_norm(x) @ w on DeviceArrays: relative error {err:.2e} (seed {SEED})"


def test_kernel_errors_name_the_argument(torch):
    x, w = half_tensors(torch, (8, 64), (64, 32))
    with pytest.raises(ArgumentError, match="argument w is a ndarray in host memory"):
        norm_linear(x, w.cpu().numpy())
    with pytest.raises(ShapeError, match="argument x is Tensor\\[8, 32, f16\\] but is annotated"):
        norm_linear(x[:, :32].contiguous(), w)
    with pytest.raises(DTypeError, match="argument w is Tensor\\[64, 32, f32\\] but is annotated"):
        norm_linear(x, w.float())
    with pytest.raises(mdsl.TraceError, match="takes 2 tensor"):
        norm_linear(x)


def test_kernel_through_the_ptx_backend():
    x, w = random_inputs(norm_linear.graph, rng_for("kernel-through-ptx"))
    try:
        y = norm_linear(DeviceArray.from_numpy(x, f16), DeviceArray.from_numpy(w, f16), backend="ptx")
        assert any(backend == "ptx" for _, backend in norm_linear._executables)
        err = relative_error(y.to_numpy().astype(np.float64), expected(norm_linear, x, w))
        assert err < 3e-3, f"rms_norm(x) @ w through the PTX backend: relative error {err:.2e} (seed {SEED})"
    finally:   # the other tests count the executables compiled with the default backend
        for key in [k for k in norm_linear._executables if k[1] == "ptx"]:
            del norm_linear._executables[key]


# ---------------------------------------------------------------------------------------------
# launch overhead: printed, never asserted

def test_launch_overhead_is_measured(torch, capsys):
    path = Path(__file__).resolve().parents[2] / "scripts" / "launch_overhead.py"
    spec = importlib.util.spec_from_file_location("launch_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.measure(calls=2000, repeats=3)
    with capsys.disabled():
        print("\nhost time per call (µs), median of 3 x 2000 calls:")
        for label, micros in rows:
            print(f"  {micros:8.2f}  {label}")
    assert rows


def test_the_empty_kernel_launches_on_a_stream_and_closes():
    """runtime.EmptyKernel, what the kernel benchmark times as one launch's cost: it launches as mdsl's
    executables do, the stream completes, and closing unloads it once."""
    from cuda.bindings import driver

    kernel = runtime.EmptyKernel()
    for _ in range(3):
        kernel(0)
    (err,) = driver.cuCtxSynchronize()
    assert not err, f"the empty kernel's launches failed: {err}"
    kernel.close()
    kernel.close()


@mdsl.kernel(name="chain")
def chain(x: Tensor[64, 1024, f16], b: Tensor[1, 1024, f16]):
    return mdsl.silu(mdsl.rms_norm(mdsl.softmax(x, dim=-1) + b, eps=1e-6)) * 2.0


def test_a_program_of_several_kernels_launches_as_one_graph_with_each_kernel_s_results(torch):
    """Nine kernels (the program as written) launched as one CUDA graph by the C launcher, their parameters
    set from each call's pointers: the bits of the kernels launched one by one, for every call, on another
    stream, with out=; and inside a caller's capture, where the kernels go one by one into its graph."""
    graphed, plain = runtime.compile_graph(chain.graph), runtime.compile_graph(chain.graph)
    if graphed.native is None:
        pytest.skip("mdsl's C launcher is not available here")
    plain._graphable = False
    assert len(graphed.program.launches) == 9 and graphed._graphable
    g = torch.Generator(device="cuda").manual_seed(SEED)
    xs = [torch.randn(64, 1024, device="cuda", generator=g).half() for _ in range(3)]
    b = torch.randn(1, 1024, device="cuda", generator=g).half()
    got = [graphed([x, b])[0] for x in xs]
    assert graphed._graph is not None and graphed.native.graph is not None
    for x, y in zip(xs, got):
        assert torch.equal(y, plain([x, b])[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = torch.empty_like(got[0])
        graphed([xs[1], b], [out])
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, got[1])
    static = xs[2].clone()
    capture = torch.cuda.CUDAGraph()
    with torch.cuda.graph(capture):
        captured = graphed([static, b])[0]
    static.copy_(xs[0])
    capture.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, got[0])
    want = expected(chain, xs[0].float().cpu().numpy(), b.float().cpu().numpy())
    assert relative_error(got[0].float().cpu().numpy(), want) < 3e-3


def test_a_first_run_inside_a_caller_s_capture_leaves_the_graph_to_the_next_prepared_call(torch):
    """The graph of the launches is made at a run on a stream that is not being captured: where the first
    run was inside a caller's capture, the call prepared next (the public path's) makes it."""
    from mdsl.gpu.calls import PreparedCall

    exe, plain = runtime.compile_graph(chain.graph), runtime.compile_graph(chain.graph)
    if exe.native is None:
        pytest.skip("mdsl's C launcher is not available here")
    plain._graphable = False
    g = torch.Generator(device="cuda").manual_seed(SEED)
    x, b = torch.randn(64, 1024, device="cuda", generator=g).half(), torch.randn(1, 1024, device="cuda", generator=g).half()
    capture = torch.cuda.CUDAGraph()
    with torch.cuda.graph(capture):
        exe([x, b])
    capture.reset()   # (not left to the collector, which may run inside another test's capture)
    assert exe._graphable and exe._graph is None
    prepared = PreparedCall.of(exe, [x, b], None, stream_given=False, torch_outputs=True)
    got = prepared.fast([x, b], None, None, "cuda")
    assert exe._graph is not None and not exe._graphable
    assert torch.equal(got, plain([x, b])[0])

"""Library GEMMs without a GPU: which kernels the lowering hands to cuBLAS (mdsl.lowering.gemm), the cuBLAS
arguments for them checked against numpy by an emulation of cuBLAS's column-major contract that reads and
writes host memory at the pointers it is given (mdsl.gpu.cublas), the handle's streams, workspaces and
statuses, and the fallback to mdsl's own kernel where the library cannot be loaded or started."""
from __future__ import annotations

import ctypes
import math
import warnings

import numpy as np
import pytest

from mdsl.backend.cuda import emit_cuda
from mdsl.backend.ptx.codegen import emit_llvm
from mdsl.gpu import cublas
from mdsl.gpu.program import LibraryGemm
from mdsl.ir.dtypes import bf16, f16, f32, i32
from mdsl.ir.graph import Node
from mdsl.ir.types import TensorType, Var
from mdsl.lowering.gemm import library_gemm, library_read_transposes
from mdsl.lowering.options import CudaOptions
from tests.backend.cuda.builder import Graph
from tests.backend.ptx.plans import rms_norm_linear_skinny

EMITTERS = {"cuda": emit_cuda, "ptx": emit_llvm}


def _matmul(a_shape, b_shape, dtype=f16):
    g = Graph("mm")
    a, b = g.input("a", a_shape, dtype), g.input("b", b_shape, dtype)
    g.op("matmul", a, b)
    return g.build()


# ---------------------------------------------------------------------------------------------
# the lowering's decision

@pytest.mark.parametrize("dtype", [f16, bf16, f32], ids=lambda d: d.name)
def test_a_plain_matmul_is_a_library_gemm(dtype):
    (node,) = _matmul((3, 77), (77, 45), dtype).nodes
    assert library_gemm(node) == LibraryGemm(dtype.name, 3, 45, 77)


@pytest.mark.parametrize("a_shape, b_shape, want", [
    ((5, 3, 7), (5, 7, 9), LibraryGemm("f16", 3, 9, 7, 5, 21, 63, 27)),           # both batched
    ((2, 5, 3, 7), (2, 5, 7, 9), LibraryGemm("f16", 3, 9, 7, 10, 21, 63, 27)),    # two batch dims
    ((3, 7), (5, 7, 9), LibraryGemm("f16", 3, 9, 7, 5, 0, 63, 27)),               # one left matrix for all
    ((1, 3, 7), (5, 7, 9), LibraryGemm("f16", 3, 9, 7, 5, 0, 63, 27)),
    ((5, 3, 7), (1, 5, 7, 9), LibraryGemm("f16", 3, 9, 7, 5, 21, 63, 27)),        # leading 1s aside
    ((5, 3, 7), (7, 9), LibraryGemm("f16", 15, 9, 7)),                            # folded into the rows
    ((2, 5, 3, 7), (1, 1, 7, 9), LibraryGemm("f16", 30, 9, 7)),
    ((1, 1, 3, 7), (7, 9), LibraryGemm("f16", 3, 9, 7)),
])
def test_a_batched_matmul_s_strides(a_shape, b_shape, want):
    (node,) = _matmul(a_shape, b_shape).nodes
    assert library_gemm(node) == want


@pytest.mark.parametrize("a_shape, b_shape", [((4, 1, 3, 7), (3, 7, 9)), ((2, 3, 3, 7), (3, 7, 9)),
                                              ((3, 3, 7), (2, 1, 7, 9))])
def test_a_matmul_broadcast_over_part_of_its_batch_keeps_mdsl_s_kernel(a_shape, b_shape):
    (node,) = _matmul(a_shape, b_shape).nodes
    assert library_gemm(node) is None


def test_other_kernels_are_not_library_gemms():
    g = Graph("others")
    x = g.input("x", (4, 8), f16)
    g.op("exp", x)
    g.op("sum", x, dim=1)
    assert [library_gemm(n) for n in g.build().nodes] == [None, None]
    # integer operands (the IR's matmul takes floats; a node made by hand may not)
    ints = [Var(n, TensorType((4, 4), i32)) for n in ("a", "b", "c")]
    assert library_gemm(Node("matmul", ints[:2], ints[2:])) is None
    mixed = Node("matmul", [Var("a", TensorType((4, 4), f16)), Var("b", TensorType((4, 4), f32))],
                 [Var("c", TensorType((4, 4), f32))])
    assert library_gemm(mixed) is None


@pytest.mark.parametrize("backend", sorted(EMITTERS))
def test_both_backends_mark_the_plain_matmul_s_launch_and_keep_its_kernel(backend):
    g = Graph("chain")
    x, w = g.input("x", (2, 3, 40), bf16), g.input("w", (40, 24), bf16)
    g.op("exp", g.op("matmul", x, w))
    graph = g.build()
    program = EMITTERS[backend](graph, options=CudaOptions())
    assert [launch.library for launch in program.launches] == [LibraryGemm("bf16", 6, 24, 40), None]
    assert [launch.args for launch in program.launches][0] == ("x", "w", "matmul")
    off = EMITTERS[backend](graph, options=CudaOptions(library_gemm=False))
    assert [launch.library for launch in off.launches] == [None, None]
    # the kernel is written either way (it runs where cuBLAS cannot): the same code with the option off
    assert off.source == program.source
    assert [launch.name for launch in off.launches] == [launch.name for launch in program.launches]


@pytest.mark.parametrize("backend", sorted(EMITTERS))
def test_a_custom_kernel_s_matmul_is_not_a_library_gemm(backend):
    graph = rms_norm_linear_skinny(2, 2, columns=64, blocks=4, k=64)
    assert any(node.op == "custom" for node in graph.nodes)
    program = EMITTERS[backend](graph, options=CudaOptions())
    assert program.launches and all(launch.library is None for launch in program.launches)


def test_the_environment_switches_library_gemms_off():
    assert CudaOptions.from_env({}).library_gemm
    assert not CudaOptions.from_env({"MDSL_CUDA_CUBLAS": "0"}).library_gemm


def _times_transposed(w_shape, perm, dtype=bf16, x_shape=None):
    """x @ transpose(w, perm): a linear layer's product as a traced torch graph gives it (w: [out, in])."""
    g = Graph("linear")
    w = g.input("w", w_shape, dtype)
    wt = g.op("transpose", w, perm=perm)
    x = g.input("x", x_shape or (3, wt.shape[-2]), dtype)
    g.op("matmul", x, wt)
    return g.build()


@pytest.mark.parametrize("backend", sorted(EMITTERS))
def test_a_matmul_of_a_transposed_operand_reads_the_transpose_s_input(backend):
    graph = _times_transposed((24, 40), (1, 0))
    program = EMITTERS[backend](graph, options=CudaOptions())
    transpose, matmul = program.launches
    assert transpose.library is None and transpose.library_args == ()
    assert matmul.library == LibraryGemm("bf16", 3, 24, 40, trans_b=True)
    assert matmul.args == ("x", "transpose", "matmul")          # its kernel reads the transpose's value
    assert matmul.library_args == ("x", "w", "matmul")          # cuBLAS reads the weight itself
    off = EMITTERS[backend](graph, options=CudaOptions(library_gemm=False))
    assert [(launch.library, launch.library_args) for launch in off.launches] == [(None, ()), (None, ())]


@pytest.mark.parametrize("w_shape, perm, x_shape, want", [
    ((5, 9, 7), (0, 2, 1), (5, 3, 7), LibraryGemm("bf16", 3, 9, 7, 5, 21, 63, 27, trans_b=True)),  # batched keys
    ((9, 7), (1, 0), (5, 3, 7), LibraryGemm("bf16", 15, 9, 7, trans_b=True)),                     # rows folded
    ((7, 5, 9), (1, 0, 2), (3, 7), None),        # another permutation: the transpose's value, untransposed
])
def test_only_a_swap_of_the_last_two_dims_is_read_transposed(w_shape, perm, x_shape, want):
    g = Graph("t")
    w = g.input("w", w_shape, bf16)
    wt = g.op("transpose", w, perm=perm)
    x = g.input("x", x_shape, bf16)
    g.op("matmul", x, wt if len(wt.shape) == 3 or want is not None else g.op("reshape", wt, shape=(7, 45)))
    graph = g.build()
    (launch,) = [launch for launch in emit_cuda(graph, options=CudaOptions()).launches if launch.library]
    if want is None:
        assert not launch.library.trans_b and launch.library_args == ()
    else:
        assert launch.library == want and launch.library_args[1] == "w"


# ---------------------------------------------------------------------------------------------
# cuBLAS's column-major contract, emulated on host memory

_NUMPY = {cublas.CUDA_DTYPES["f32"]: np.float32, cublas.CUDA_DTYPES["f16"]: np.float16}
_GEMM_EX = ("handle", "transa", "transb", "m", "n", "k", "alpha", "A", "Atype", "lda", "B", "Btype", "ldb", "beta",
            "C", "Ctype", "ldc", "computeType", "algo")
_STRIDED = ("handle", "transa", "transb", "m", "n", "k", "alpha", "A", "Atype", "lda", "strideA", "B", "Btype", "ldb",
            "strideB", "beta", "C", "Ctype", "ldc", "strideC", "batchCount", "computeType", "algo")


def _value(arg):
    """The value a C function receives for a ctypes argument (a byref: the value it points to)."""
    return (arg._obj if type(arg).__name__ == "CArgObject" else arg).value


class EmulatedCublas:
    """cuBLAS's GEMMs by their column-major contract, on host buffers whose addresses stand for device
    pointers: for each i < batchCount, C_i = alpha op(A_i) op(B_i) + beta C_i (C_i unread where beta is 0)
    with X_i the matrix at X + i strideX, column j of it ldX elements after column j - 1. Arguments cuBLAS refuses are refused
    (CUBLAS_STATUS_INVALID_VALUE); a matrix that would reach outside its buffer fails the test."""

    INVALID_VALUE = 7

    def __init__(self, gemm_status: int = 0, create_status: int = 0, stream_status: int = 0):
        self.buffers: dict = {}     # address -> (numpy array, element count)
        self.calls: list = []
        self.gemm_status, self.create_status, self.stream_status = gemm_status, create_status, stream_status

    def buffer(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        self.buffers[array.ctypes.data] = array
        return array.ctypes.data

    def cublasCreate_v2(self, ref):
        self.calls.append(("create",))
        ref._obj.value = 0x1234
        return self.create_status

    def cublasSetStream_v2(self, handle, stream):
        self.calls.append(("stream", stream or 0))
        return self.stream_status

    def cublasSetWorkspace_v2(self, handle, workspace, size):
        self.calls.append(("workspace", workspace, size))
        return 0

    def cublasGetStatusName(self, status):
        return {7: b"CUBLAS_STATUS_INVALID_VALUE", 13: b"CUBLAS_STATUS_EXECUTION_FAILED",
                1: b"CUBLAS_STATUS_NOT_INITIALIZED"}[status]

    def cublasGetStatusString(self, status):
        return b"what the library says"

    def cublasGemmEx(self, *args):
        assert len(args) == len(_GEMM_EX)
        return self._gemm(dict(zip(_GEMM_EX, map(_value, args))) | {"strideA": 0, "strideB": 0, "strideC": 0,
                                                                      "batchCount": 1})

    def cublasGemmStridedBatchedEx(self, *args):
        assert len(args) == len(_STRIDED)
        return self._gemm(dict(zip(_STRIDED, map(_value, args))))

    def _matrix(self, address, index, stride, rows, cols, ld, dtype):
        array = self.buffers[address]
        assert array.dtype == dtype, f"a {array.dtype} buffer passed as {dtype}"
        where = index * stride + np.arange(rows)[:, None] + ld * np.arange(cols)[None, :]
        assert where.max() < array.size, "cuBLAS would read or write outside the buffer"
        return array.reshape(-1), where

    def _gemm(self, a: dict) -> int:
        self.calls.append(("gemm", a))
        if self.gemm_status:
            return self.gemm_status
        m, n, k = a["m"], a["n"], a["k"]
        rows_a, rows_b = (m if a["transa"] == 0 else k), (k if a["transb"] == 0 else n)
        if min(m, n, k) < 0 or a["lda"] < max(1, rows_a) or a["ldb"] < max(1, rows_b) or a["ldc"] < max(1, m):
            return self.INVALID_VALUE
        assert a["Atype"] == a["Btype"] == a["Ctype"] and a["computeType"] == cublas.CUBLAS_COMPUTE_32F
        dtype = _NUMPY[a["Atype"]]
        for i in range(a["batchCount"]):
            flat_a, at = self._matrix(a["A"], i, a["strideA"], rows_a, k if a["transa"] == 0 else m, a["lda"], dtype)
            flat_b, bt = self._matrix(a["B"], i, a["strideB"], rows_b, n if a["transb"] == 0 else k, a["ldb"], dtype)
            flat_c, ct = self._matrix(a["C"], i, a["strideC"], m, n, a["ldc"], dtype)
            op_a = flat_a[at].astype(np.float64) if a["transa"] == 0 else flat_a[at].astype(np.float64).T
            op_b = flat_b[bt].astype(np.float64) if a["transb"] == 0 else flat_b[bt].astype(np.float64).T
            product = a["alpha"] * op_a @ op_b
            flat_c[ct] = (product if a["beta"] == 0 else product + a["beta"] * flat_c[ct]).astype(dtype)
        return 0


class FakeDriver:
    """cuMemAlloc as the workspaces take it: distinct addresses, none touched; streams in `captured` are
    being captured into a CUDA graph."""

    class CUstreamCaptureStatus:
        CU_STREAM_CAPTURE_STATUS_NONE, CU_STREAM_CAPTURE_STATUS_ACTIVE = 0, 1

    def __init__(self):
        self.allocated: list = []
        self.captured: set = set()

    def cuStreamIsCapturing(self, stream):
        return 0, int(stream in self.captured)

    def cuMemAlloc(self, size):
        self.allocated.append(size)
        return 0, 0x7000_0000 + len(self.allocated) * size


@pytest.fixture
def fake(monkeypatch):
    """cuBLAS replaced by the emulation, on a GPU 0 that is never touched."""
    lib, drv = EmulatedCublas(), FakeDriver()
    monkeypatch.setattr(cublas, "_LIBRARY", {"lib": lib})
    monkeypatch.setattr(cublas, "_CONTEXTS", {})
    monkeypatch.setattr(cublas, "_WARNED", set())
    monkeypatch.setattr(cublas, "get_device", lambda ordinal: None)
    monkeypatch.setattr(cublas, "driver", drv)
    monkeypatch.setattr(cublas, "cu_stream", lambda handle: handle)
    lib.driver = drv
    return lib


def _operands(a_shape, b_shape, dtype, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in (a_shape, b_shape)]


@pytest.mark.parametrize("a_shape, b_shape", [
    ((1, 64), (64, 40)), ((3, 77), (77, 45)), ((64, 9), (9, 13)), ((1, 1), (1, 1)),
    ((5, 3, 7), (5, 7, 9)), ((2, 5, 1, 7), (2, 5, 7, 9)), ((3, 7), (5, 7, 9)), ((5, 3, 7), (7, 9)),
    ((2, 4, 3, 7), (1, 1, 7, 9)), ((5, 3, 7), (1, 5, 7, 9)),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: d.__name__)
def test_the_cublas_call_computes_the_row_major_product(fake, a_shape, b_shape, dtype):
    graph = _matmul(a_shape, b_shape, f32 if dtype is np.float32 else f16)
    (launch,) = emit_cuda(graph, options=CudaOptions()).launches
    a, b = _operands(a_shape, b_shape, dtype, seed=sum(a_shape) * 31 + sum(b_shape))
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    c = np.full(want.shape, np.nan, dtype)
    ptrs = (ctypes.c_uint64 * 5)()
    slots = (3, 0, 4)   # parameter slots in no particular order: A, B, C
    step = cublas.gemm_step(launch.library, 0, ptrs, slots, "mm")
    for slot, array in zip(slots, (a, b, c)):
        ptrs[slot] = fake.buffer(array)
    step(0)
    tol = 1e-5 if dtype is np.float32 else 2e-3
    np.testing.assert_allclose(c.astype(np.float64), want, rtol=tol, atol=tol * math.sqrt(a_shape[-1]))


@pytest.mark.parametrize("x_shape, w_shape, perm", [
    ((1, 64), (40, 64), (1, 0)), ((3, 77), (45, 77), (1, 0)), ((5, 3, 7), (9, 7), (1, 0)),
    ((5, 3, 7), (5, 9, 7), (0, 2, 1)), ((2, 4, 1, 7), (2, 4, 9, 7), (0, 1, 3, 2)),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: d.__name__)
def test_the_cublas_call_reads_a_transposed_right_operand_from_its_source(fake, x_shape, w_shape, perm, dtype):
    g = Graph("t")
    w = g.input("w", w_shape, f32 if dtype is np.float32 else f16)
    x = g.input("x", x_shape, f32 if dtype is np.float32 else f16)
    g.op("matmul", x, g.op("transpose", w, perm=perm))
    launch = next(launch for launch in emit_cuda(g.build(), options=CudaOptions()).launches if launch.library)
    assert launch.library.trans_b
    x_value, w_value = _operands(x_shape, w_shape, dtype, seed=sum(x_shape) * 7 + sum(w_shape))
    want = np.matmul(x_value.astype(np.float64), np.transpose(w_value.astype(np.float64), perm))
    c = np.full(want.shape, np.nan, dtype)
    ptrs = (ctypes.c_uint64 * 3)()
    step = cublas.gemm_step(launch.library, 0, ptrs, (2, 0, 1), "mm")   # slots of x, w (the source) and the product
    for slot, array in zip((2, 0, 1), (x_value, w_value, c)):
        ptrs[slot] = fake.buffer(array)
    step(0)
    tol = 1e-5 if dtype is np.float32 else 2e-3
    np.testing.assert_allclose(c.astype(np.float64), want, rtol=tol, atol=tol * math.sqrt(x_shape[-1]))


def test_the_gemm_arguments_follow_the_prototypes(fake):
    ptrs = (ctypes.c_uint64 * 3)()
    single = cublas.gemm_arguments(LibraryGemm("bf16", 3, 45, 77), ctypes.c_void_p(9), ptrs, (0, 1, 2))
    batched = cublas.gemm_arguments(LibraryGemm("f16", 3, 9, 7, 5, 0, 63, 27), ctypes.c_void_p(9), ptrs, (0, 1, 2))
    ptrs[0], ptrs[1], ptrs[2] = 0xA000, 0xB000, 0xC000   # written after the arguments were built
    one = dict(zip(_GEMM_EX, map(_value, single)))
    assert one == {"handle": 9, "transa": 0, "transb": 0, "m": 45, "n": 3, "k": 77, "alpha": 1.0, "A": 0xB000,
                   "Atype": 14, "lda": 45, "B": 0xA000, "Btype": 14, "ldb": 77, "beta": 0.0, "C": 0xC000, "Ctype": 14,
                   "ldc": 45, "computeType": 68, "algo": -1}
    many = dict(zip(_STRIDED, map(_value, batched)))
    assert {k: many[k] for k in ("m", "n", "k", "A", "lda", "strideA", "B", "ldb", "strideB", "C", "ldc", "strideC",
                                 "batchCount", "Atype")} == \
        {"m": 9, "n": 3, "k": 7, "A": 0xB000, "lda": 9, "strideA": 63, "B": 0xA000, "ldb": 7, "strideB": 0,
         "C": 0xC000, "ldc": 9, "strideC": 27, "batchCount": 5, "Atype": 2}
    assert [type(arg) for arg in batched[10:15:4]] == [ctypes.c_longlong] * 2   # 64-bit strides


# ---------------------------------------------------------------------------------------------
# handles, streams, workspaces and statuses

def test_each_stream_gets_its_own_workspace_set_after_the_stream(fake):
    ptrs = (ctypes.c_uint64 * 3)()
    a, b, c = np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), np.zeros((2, 4), np.float32)
    for slot, array in enumerate((a, b, c)):
        ptrs[slot] = fake.buffer(array)
    step = cublas.gemm_step(LibraryGemm("f32", 2, 4, 3), 0, ptrs, (0, 1, 2), "mm")
    for stream in (0, 0, 77, 77, 0):
        step(stream)
    kinds = [call[0] if call[0] != "stream" else f"stream {call[1]}" for call in fake.calls]
    assert kinds == ["create", "stream 0", "workspace", "gemm", "gemm", "stream 77", "workspace", "gemm", "gemm",
                     "stream 0", "workspace", "gemm"]
    workspaces = [call[1] for call in fake.calls if call[0] == "workspace"]
    assert workspaces[0] == workspaces[2] != workspaces[1], "a stream's workspace is its own, and kept"
    assert fake.driver.allocated == [cublas.WORKSPACE_BYTES] * 2
    np.testing.assert_array_equal(c, np.full((2, 4), 3.0))


def test_a_stream_being_captured_gets_no_workspace_until_it_runs_uncaptured(fake):
    step = cublas.gemm_step(LibraryGemm("f16", 3, 9, 7), 0, (ctypes.c_uint64 * 3)(), (0, 1, 2), "mm")
    fake.driver.captured.add(9)
    fake.gemm_status = 13   # the product itself is not what this test is about
    with pytest.raises(cublas.CublasError):
        step(9)
    assert ("workspace", None, 0) in fake.calls and fake.driver.allocated == []
    fake.driver.captured.clear()
    with pytest.raises(cublas.CublasError):
        step(0)
    with pytest.raises(cublas.CublasError):
        step(9)
    assert fake.driver.allocated == [cublas.WORKSPACE_BYTES] * 2


def test_a_capture_s_stream_gets_the_workspace_of_the_stream_its_graph_will_run_on(fake):
    step = cublas.gemm_step(LibraryGemm("f16", 3, 9, 7), 0, (ctypes.c_uint64 * 3)(), (0, 1, 2), "mm")
    ctx = cublas.context(0)
    with ctx.lock:
        ctx.capture_on(50, 7)
    assert ctx.stream == 50 and ctx.stream_word.value == 50
    ctx.forget_stream()
    assert ctx.stream is None and ctx.stream_word.value == cublas.NO_STREAM
    fake.gemm_status = 13   # the product itself is not what this test is about
    with pytest.raises(cublas.CublasError):
        step(7)
    calls = [c[:2] for c in fake.calls if c[0] in ("stream", "workspace")]
    workspace = calls[1][1]
    assert calls == [("stream", 7), ("workspace", workspace), ("stream", 50), ("workspace", workspace),
                     ("stream", 7), ("workspace", workspace)]   # (a stream forgotten is set again)
    assert fake.driver.allocated == [cublas.WORKSPACE_BYTES]


def test_a_failed_gemm_is_an_error_naming_the_call(fake):
    fake.gemm_status = 13
    step = cublas.gemm_step(LibraryGemm("f16", 3, 9, 7, 5, 0, 63, 27), 0, (ctypes.c_uint64 * 3)(), (0, 1, 2),
                            "k_matmul of k")
    with pytest.raises(cublas.CublasError, match=r"cublasGemmStridedBatchedEx for k_matmul of k .*"
                                                 r"CUBLAS_STATUS_EXECUTION_FAILED") as e:
        step(0)
    assert "MDSL_CUDA_CUBLAS=0" in e.value.hint


def test_a_failed_stream_change_is_an_error_naming_the_call(fake):
    fake.stream_status = 7
    step = cublas.gemm_step(LibraryGemm("f16", 3, 9, 7), 0, (ctypes.c_uint64 * 3)(), (0, 1, 2), "mm")
    with pytest.raises(cublas.CublasError, match="cublasSetStream_v2 failed: CUBLAS_STATUS_INVALID_VALUE"):
        step(5)


def test_a_handle_that_cannot_be_created_falls_back_with_one_warning(fake):
    fake.create_status = 1
    with pytest.warns(RuntimeWarning, match="cublasCreate_v2 failed: CUBLAS_STATUS_NOT_INITIALIZED"):
        assert cublas.gemm_step(LibraryGemm("f16", 3, 9, 7), 0, (ctypes.c_uint64 * 3)(), (0, 1, 2), "mm") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cublas.gemm_step(LibraryGemm("f16", 3, 9, 7), 0, (ctypes.c_uint64 * 3)(), (0, 1, 2), "mm") is None
    assert fake.calls == [("create",)]


def test_a_missing_library_falls_back_with_one_warning_and_touches_no_gpu(monkeypatch):
    import cuda.pathfinder

    def not_found(name):
        raise cuda.pathfinder.DynamicLibNotFoundError(f"lib{name}.so.13 not found")

    def no_gpu(ordinal):
        raise AssertionError("the GPU was touched")

    monkeypatch.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", not_found)
    monkeypatch.setattr(cublas, "_LIBRARY", {})
    monkeypatch.setattr(cublas, "_CONTEXTS", {})
    monkeypatch.setattr(cublas, "_WARNED", set())
    monkeypatch.setattr(cublas, "get_device", no_gpu)
    with pytest.warns(RuntimeWarning, match=r"cuBLAS could not be loaded .*libcublas.so.13 not found.*"
                                            r'own GEMM kernel.*pip install "mdsl\[cublas\]"'):
        assert cublas.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cublas.context(0) is None
        assert cublas.gemm_step(LibraryGemm("f16", 3, 9, 7), 0, (ctypes.c_uint64 * 3)(), (0, 1, 2), "mm") is None


def test_the_installed_library_loads_without_a_gpu(monkeypatch):
    pytest.importorskip("nvidia.cu13", reason="the nvidia-cublas wheel is not installed here")
    monkeypatch.setattr(cublas, "_LIBRARY", {})
    lib = cublas.library()
    if lib is None:
        pytest.skip("no libcublas here")
    assert cublas.status_text(lib, 7).startswith("CUBLAS_STATUS_INVALID_VALUE (")
    assert all(hasattr(lib, name) for name in ("cublasGemmEx", "cublasGemmStridedBatchedEx",
                                               "cublasSetWorkspace_v2", "cublasSetStream_v2", "cublasCreate_v2"))


# ---------------------------------------------------------------------------------------------
# in an Executable

class HostDriver(FakeDriver):
    """The driver calls of an Executable on host memory: allocations are numpy buffers the emulated cuBLAS
    reads and writes (memset fills them), kernel launches are recorded in the emulation's log."""

    def __init__(self, lib: EmulatedCublas):
        super().__init__()
        self.lib, self.held = lib, []

    def cuMemAlloc(self, size):
        buffer = np.zeros(size // 4, np.float32)
        self.held.append(buffer)
        return 0, self.lib.buffer(buffer)

    def cuMemsetD8(self, ptr, value, size):
        self.lib.buffers[ptr].view(np.uint8)[:] = value
        return (0,)

    def cuModuleGetFunction(self, module, name):
        return 0, name.decode()

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.lib.calls.append(("launch", function, stream))
        return (0,)

    def cuMemFree(self, ptr):
        return (0,)

    def cuModuleUnload(self, module):
        return (0,)


def _host_executable(fake, monkeypatch, graph):
    from types import SimpleNamespace

    from mdsl.gpu import executable

    host = HostDriver(fake)
    monkeypatch.setattr(executable, "driver", host)
    monkeypatch.setattr(cublas, "driver", host)
    monkeypatch.setattr(executable, "get_device", lambda device: SimpleNamespace(max_smem=227 * 1024,
                                                                                  activate=lambda: None))
    monkeypatch.setattr(executable, "cu_stream", lambda handle: ("stream", handle))
    return executable.Executable(emit_cuda(graph, options=CudaOptions()), SimpleNamespace(load=lambda: "module")), host


def test_an_executable_runs_the_matmul_in_cublas_between_its_kernels(fake, monkeypatch):
    g = Graph("chain")
    x, w = g.input("x", (4, 8), f32), g.input("w", (8, 3), f32)
    y = g.op("exp", g.op("matmul", g.op("exp", x), w))
    exe, host = _host_executable(fake, monkeypatch, g.build([y]))
    assert exe.library_launches == ("chain_matmul",)
    e_buffer, product = host.held[:2]   # the intermediates, in the order the launches first use them
    e_buffer[:] = np.arange(32, dtype=np.float32) / 8   # what the exp kernel would have written
    weights, out = np.linspace(-1, 1, 24, dtype=np.float32), np.zeros(12, np.float32)
    exe.run_pointers([fake.buffer(np.zeros(32, np.float32)), fake.buffer(weights)], [fake.buffer(out)], stream=5)
    log = [call[:2] if call[0] in ("launch", "stream") else call[0] for call in fake.calls]
    assert log == ["create", ("launch", "chain_exp"), ("stream", 5), "workspace", "gemm", ("launch", "chain_exp_1")]
    want = e_buffer.reshape(4, 8).astype(np.float64) @ weights.reshape(8, 3)
    np.testing.assert_allclose(product, want.reshape(-1), rtol=1e-6)


def test_a_transpose_only_cublas_reads_through_its_source_is_not_launched(fake, monkeypatch):
    g = Graph("linear")
    w, x = g.input("w", (3, 8), f32), g.input("x", (4, 8), f32)
    y = g.op("exp", g.op("matmul", x, g.op("transpose", w, perm=(1, 0))))
    graph = g.build([y])
    exe, host = _host_executable(fake, monkeypatch, graph)
    assert exe.elided == ("linear_transpose",) and exe.library_launches == ("linear_matmul",)
    # the cost model's view of the same graph (mdsl.lowering.gemm.library_read_transposes) agrees
    assert [graph.nodes[k].op for k in library_read_transposes(graph)] == ["transpose"]
    weights, inputs, out = (np.linspace(-1, 1, 24, dtype=np.float32), np.arange(32, dtype=np.float32) / 8,
                            np.zeros(12, np.float32))
    exe.run_pointers([fake.buffer(weights), fake.buffer(inputs)], [fake.buffer(out)], stream=5)
    log = [call[:2] if call[0] in ("launch", "stream") else call[0] for call in fake.calls]
    assert log == ["create", ("stream", 5), "workspace", "gemm", ("launch", "linear_exp")]
    # the product, which the exp kernel reads, is x @ w^T computed from w itself; the transpose's value has no
    # buffer (the intermediates allocated: the product's alone)
    (product,) = host.held[:1]
    assert product.size == 12 and [b.size for b in host.held[1:]] == [32 * 2**20 // 4]   # then cuBLAS's workspace
    want = inputs.reshape(4, 8).astype(np.float64) @ weights.reshape(3, 8).T
    np.testing.assert_allclose(product, want.reshape(-1), rtol=1e-6)


@pytest.mark.parametrize("also", ["a kernel reads it", "it is an output"])
def test_a_transpose_read_otherwise_is_still_launched(fake, monkeypatch, also):
    g = Graph("linear")
    w, x = g.input("w", (3, 8), f32), g.input("x", (4, 8), f32)
    wt = g.op("transpose", w, perm=(1, 0))
    y = g.op("matmul", x, wt)
    graph = g.build([y, g.op("exp", wt)] if also == "a kernel reads it" else [y, wt])
    exe, _ = _host_executable(fake, monkeypatch, graph)
    assert exe.elided == () and exe.library_launches == ("linear_matmul",) and not library_read_transposes(graph)
    outputs = [fake.buffer(np.zeros(12, np.float32)), fake.buffer(np.zeros(24, np.float32))]
    exe.run_pointers([fake.buffer(np.zeros(24, np.float32)), fake.buffer(np.zeros(32, np.float32))], outputs, stream=5)
    assert [call[1] for call in fake.calls if call[0] == "launch"][0] == "linear_transpose"


def test_without_cublas_the_transpose_runs_for_the_matmul_s_own_kernel(monkeypatch):
    from types import SimpleNamespace

    from mdsl.gpu import executable

    lib = EmulatedCublas()
    host = HostDriver(lib)
    monkeypatch.setattr(cublas, "_LIBRARY", {"lib": None})
    monkeypatch.setattr(cublas, "_CONTEXTS", {})
    monkeypatch.setattr(cublas, "_WARNED", {"library"})
    monkeypatch.setattr(executable.launcher, "library", lambda: None)   # the launches go through the driver's calls
    monkeypatch.setattr(executable, "driver", host)
    monkeypatch.setattr(executable, "get_device", lambda device: SimpleNamespace(max_smem=227 * 1024,
                                                                                  activate=lambda: None))
    monkeypatch.setattr(executable, "cu_stream", lambda handle: ("stream", handle))
    g = Graph("linear")
    w, x = g.input("w", (3, 8), f32), g.input("x", (4, 8), f32)
    y = g.op("matmul", x, g.op("transpose", w, perm=(1, 0)))
    exe = executable.Executable(emit_cuda(g.build([y]), options=CudaOptions()), SimpleNamespace(load=lambda: "module"))
    assert exe.elided == () and exe.library_launches == ()
    exe.run_pointers([lib.buffer(np.zeros(24, np.float32)), lib.buffer(np.zeros(32, np.float32))],
                     [lib.buffer(np.zeros(12, np.float32))], stream=5)
    assert [call[1] for call in lib.calls] == ["linear_transpose", "linear_matmul"]

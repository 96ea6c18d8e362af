"""The Hopper GEMM on an H100/H200 (mdsl.backend.cuda.hopper_gemm: wgmma, TMA, mbarriers): C = A W^T for bf16
and f16 operands against the float32 product of the same rounded operands, element by element, for every
tile width (128, 192, 256) over ragged M (1, 17, 64, 1000, 1024), N (128 to 6144, odd ones, ones that are
no multiple of 8) and K (multiples of 8 down to 8, tails shorter than a stage); outputs poisoned with NaN
and followed by a guard that must stay untouched; f32 products with bias and residual (the residual also
the output itself); Qwen3-8B's linear shapes at M = 1024 with the width the host picks; on a side stream
and replayed from a CUDA graph; and the refusals (K not a multiple of 8, f32 or mixed operands, a
misaligned operand). The PTX backend's kernel (mdsl/backend/ptx/hopper_gemm.py) runs the tile widths and
epilogues too, and gives the CUDA kernel's bits.

    pytest tests/gpu/test_gpu_hopper_gemm.py -m gpu
"""
from __future__ import annotations

import math

import pytest

from mdsl.backend.cuda import hopper_gemm as hg
from mdsl.backend.ptx import hopper_gemm as ptx_gemm
from mdsl.errors import DTypeError, ShapeError
from mdsl.gpu import hopper_gemm as host
from mdsl.gpu.arrays import ArgumentError
from tests.gpu.harness import SEED

pytestmark = pytest.mark.gpu

#: each backend's kernel, launched alike
GEMMS = {"cuda": hg.hopper_gemm, "ptx": ptx_gemm.hopper_gemm}

ROWS = (1, 17, 64, 1000, 1024)
#: (N, K): one stage of K and less (8, 16), tails of 8 past a stage (72, 4104), N below, at and past a tile,
#: odd (129: single stores), and Qwen3-8B's q|k|v projection
COLUMNS = [(128, 64), (136, 16), (129, 8), (1000, 72), (200, 1000), (256, 4104), (6144, 4096)]
QWEN3_8B = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]   # (K, N) of its linear layers
GUARD = 4096   # elements after the output that the kernel must not write


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    assert torch.cuda.is_available(), "torch cannot see the GPU that the CUDA driver reports"
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper GEMM needs a compute capability 9.0 GPU")
    torch.backends.cuda.matmul.allow_tf32 = False   # the reference is a float32 product
    return torch


def _dtype(torch, name: str):
    return {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[name]


def operands(torch, m: int, n: int, k: int, dtype: str, tag: str):
    """A [m, k] and W [n, k], W scaled so that C's elements are about 1."""
    g = torch.Generator(device="cuda").manual_seed(SEED + sum(map(ord, tag)) + 7919 * m + 31 * n + k)
    a = torch.randn(m, k, generator=g, device="cuda").to(_dtype(torch, dtype))
    w = (torch.randn(n, k, generator=g, device="cuda") / math.sqrt(k)).to(_dtype(torch, dtype))
    return a, w


def poisoned(torch, m: int, n: int, dtype: str):
    """An [m, n] output at the start of a NaN-filled buffer, and the buffer (its tail is the guard)."""
    buffer = torch.full((m * n + GUARD,), float("nan"), dtype=_dtype(torch, dtype), device="cuda")
    return buffer[:m * n].view(m, n), buffer


def expect_close(torch, got, want, out_dtype: str, what: str) -> None:
    """Every element within the rounding of C's dtype (relative) plus f32 summation-order noise (absolute)."""
    rtol = {"bf16": 2.0 ** -7, "f16": 2.0 ** -10, "f32": 1e-5}[out_dtype]
    got = got.float()
    assert bool(torch.isfinite(got).all()), f"{what}: {int((~torch.isfinite(got)).sum())} elements not written"
    bad = (got - want).abs() > 1e-4 + rtol * want.abs()
    if bool(bad.any()):
        rows, cols = torch.nonzero(bad, as_tuple=True)
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements differ, first at "
                             f"({int(rows[0])}, {int(cols[0])}): {float(got[rows[0], cols[0]])} for "
                             f"{float(want[rows[0], cols[0]])}; rows {int(rows.min())}..{int(rows.max())}, "
                             f"columns {int(cols.min())}..{int(cols.max())}")


def reference(a, w, bias=None, residual=None):
    want = a.float() @ w.float().T
    if bias is not None:
        want = want + bias.float()
    if residual is not None:
        want = want + residual.float()
    return want


@pytest.mark.parametrize("n, k", COLUMNS, ids=lambda v: str(v))
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bn", hg.TILE_NS)
@pytest.mark.parametrize("dtype", hg.INPUT_DTYPES)
@pytest.mark.parametrize("backend", GEMMS)
def test_each_tile_width_computes_the_product(torch, monkeypatch, backend, dtype, bn, m, n, k):
    monkeypatch.setattr(host, "tile_n", lambda *args: bn)
    a, w = operands(torch, m, n, k, dtype, "tiles")
    out, buffer = poisoned(torch, m, n, dtype)
    assert GEMMS[backend](a, w, out) is out
    torch.cuda.synchronize()
    expect_close(torch, out, reference(a, w), dtype, f"{dtype} M={m} N={n} K={k}, {bn}-column tiles")
    assert bool(torch.isnan(buffer[m * n:]).all()), "the kernel wrote past the end of C"


@pytest.mark.parametrize("dtype", hg.INPUT_DTYPES)
@pytest.mark.parametrize("backend", GEMMS)
def test_f32_products_with_bias_and_residual(torch, backend, dtype):
    m, n, k = 1000, 1000, 200
    a, w = operands(torch, m, n, k, dtype, "epilogue")
    bias = torch.randn(n, device="cuda").to(_dtype(torch, dtype))
    residual = torch.randn(m, n, device="cuda")
    c = GEMMS[backend](a, w, out_dtype="f32")
    assert c.dtype == torch.float32 and c.shape == (m, n)
    expect_close(torch, c, reference(a, w), "f32", f"{dtype} -> f32")
    c = GEMMS[backend](a, w, bias=bias, residual=residual, out_dtype="f32")
    expect_close(torch, c, reference(a, w, bias, residual), "f32", f"{dtype} -> f32 + bias + residual")
    # the residual stream updated in place: the output is the residual
    stream = torch.randn(m, n, device="cuda").to(_dtype(torch, dtype))
    want = reference(a, w, residual=stream)
    assert GEMMS[backend](a, w, stream, residual=stream) is stream
    expect_close(torch, stream, want, dtype, f"{dtype} + residual, in place")


def _bits(torch, x):
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("bn", hg.TILE_NS)
@pytest.mark.parametrize("dtype, out_dtype", [("bf16", "bf16"), ("f16", "f16"), ("bf16", "f32"), ("f16", "f32")])
def test_the_ptx_backend_s_kernel_gives_the_cuda_kernel_s_bits(torch, monkeypatch, dtype, out_dtype, bn):
    monkeypatch.setattr(host, "tile_n", lambda *args: bn)
    for m, n, k in ((1000, 1000, 4104), (17, 129, 72), (1024, 6144, 4096)):
        a, w = operands(torch, m, n, k, dtype, "bits")
        bias = torch.randn(n, device="cuda").to(_dtype(torch, dtype))
        residual = torch.randn(m, n, device="cuda").to(_dtype(torch, out_dtype))
        for extra in ({}, {"bias": bias}, {"bias": bias, "residual": residual}):
            c = hg.hopper_gemm(a, w, out_dtype=out_dtype, **extra)
            p = ptx_gemm.hopper_gemm(a, w, out_dtype=out_dtype, **extra)
            differ = int((_bits(torch, c) != _bits(torch, p)).sum())
            assert differ == 0, f"M={m} N={n} K={k} {sorted(extra)}: {differ} elements' bits differ"


@pytest.mark.parametrize("k, n", QWEN3_8B)
def test_qwen3_8b_s_linear_shapes_at_1024_rows(torch, k, n):
    a, w = operands(torch, 1024, n, k, "bf16", "qwen3")
    want = reference(a, w)
    expect_close(torch, hg.hopper_gemm(a, w), want, "bf16", f"Qwen3-8B [1024, {k}] x [{n}, {k}]^T, "
                 f"{hg.tile_n(1024, n, host._sms(0))}-column tiles")


def test_device_arrays_and_numpy_inputs_through_the_runtime(torch):
    import numpy as np

    from mdsl.backend.cuda import runtime
    from mdsl.ir.dtypes import f16

    rng = np.random.default_rng(SEED)
    a, w = rng.standard_normal((64, 72)).astype(np.float16), (rng.standard_normal((130, 72)) / 8).astype(np.float16)
    c = runtime.hopper_gemm(runtime.DeviceArray.from_numpy(a), runtime.DeviceArray.from_numpy(w))
    assert type(c) is runtime.DeviceArray and c.dtype is f16 and c.shape == (64, 130)
    want = a.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(c.to_numpy().astype(np.float64), want, rtol=2.0 ** -10, atol=1e-3)


@pytest.mark.parametrize("backend", GEMMS)
def test_on_a_side_stream_and_replayed_from_a_cuda_graph(torch, backend):
    m, n, k = 300, 520, 264
    a, w = operands(torch, m, n, k, "bf16", "graph")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        c = GEMMS[backend](a, w)   # on torch's current stream: the side one
    side.synchronize()
    expect_close(torch, c, reference(a, w), "bf16", "on a side stream")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        GEMMS[backend](a, w, out)
    for tag in ("first", "second"):   # new operands in the captured buffers
        fresh_a, fresh_w = operands(torch, m, n, k, "bf16", tag)
        a.copy_(fresh_a)
        w.copy_(fresh_w)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expect_close(torch, out, reference(a, w), "bf16", f"graph replay, {tag} operands")


def test_what_it_refuses(torch):
    a, w = operands(torch, 16, 32, 64, "bf16", "errors")
    with pytest.raises(ShapeError, match="multiple of 8"):
        hg.hopper_gemm(a[:, :60].contiguous(), w[:, :60].contiguous())
    with pytest.raises(DTypeError, match="bf16 or f16"):
        hg.hopper_gemm(a.float(), w.float())
    with pytest.raises(DTypeError, match="one dtype"):
        hg.hopper_gemm(a, w.half())
    with pytest.raises(ShapeError, match="same K"):
        hg.hopper_gemm(a, w[:, :56].contiguous())
    misaligned = torch.empty(16 * 64 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(16, 64)
    with pytest.raises(ArgumentError, match="16-byte aligned"):
        hg.hopper_gemm(misaligned, w)
    with pytest.raises(ShapeError, match="bias"):
        hg.hopper_gemm(a, w, bias=torch.zeros(31, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(DTypeError, match="residual"):
        hg.hopper_gemm(a, w, residual=torch.zeros(16, 32, dtype=torch.float32, device="cuda"))

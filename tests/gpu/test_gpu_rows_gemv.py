"""The rows kernel on an H100/H200 (mdsl.backend.cuda.rows_gemv: mma.sync over up to 64 rows, weights in
fragment order): y = x W^T for R in (1, 3, 8, 17, 64) rows, N = 4096 and K = 4096 and 12288 (one and 12 K
slices), both feature tiles a warp, against the float64 product of the same bf16 operands; a row's outputs
bit-identical alone, inside 64 rows, at another place among them and with either tiles a warp; fragment order
on torch tensors; DeviceArrays in and out; and the bandwidth function (`python -m mdsl.backend.cuda.rows_gemv`'s table).

    pytest tests/gpu/test_gpu_rows_gemv.py -m gpu
    python -m mdsl.backend.cuda.rows_gemv        # GB/s of weight bytes at R = 1, 8, 32, 64
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from mdsl.backend.cuda import rows_gemv as rg
from tests.gpu.harness import SEED

pytestmark = pytest.mark.gpu

N = 4096
KS = (4096, 12288)


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    assert torch.cuda.is_available(), "torch cannot see the GPU that the CUDA driver reports"
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("mma.sync on bf16 needs compute capability 8.0 or later")
    return torch


@pytest.fixture(scope="module")
def weights(torch):
    """{K: (W [N, K] bf16, repack_for_mma(W))}, W scaled so that y's elements are about 1."""
    g = torch.Generator(device="cuda").manual_seed(SEED)
    out = {}
    for k in KS:
        w = (torch.randn(N, k, generator=g, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
        out[k] = w, rg.repack_for_mma(w).contiguous()
    return out


def rows_of(torch, rows: int, k: int, tag: int):
    g = torch.Generator(device="cuda").manual_seed(SEED + 7919 * rows + k + tag)
    return torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)


def expect_close(torch, got, x, w, what: str) -> None:
    """Every element within 2^-12 of the sum of its products' magnitudes of the float64 product (f32 sums of
    exact bf16 products are far closer; a misplaced row, feature or k is far off)."""
    want = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    assert bool(torch.isfinite(got).all()), f"{what}: {int((~torch.isfinite(got)).sum())} elements not written"
    bad = (got.double() - want).abs() > 2.0 ** -12 * scale
    if bool(bad.any()):
        rows, cols = torch.nonzero(bad, as_tuple=True)
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements differ, first at ({int(rows[0])}, "
                             f"{int(cols[0])}): {float(got[rows[0], cols[0]])} for {float(want[rows[0], cols[0]])}")


@pytest.mark.parametrize("mt", rg.TILES)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("rows", (1, 3, 8, 17, 64))
def test_products_match_the_float64_product(torch, weights, rows, k, mt):
    w, packed = weights[k]
    x = rows_of(torch, rows, k, 0)
    out = torch.full((rows, N), float("nan"), device="cuda")
    assert rg.rows_gemv(x, packed, out, mt=mt) is out
    torch.cuda.synchronize()
    expect_close(torch, out, x, w, f"R={rows} N={N} K={k} MT={mt}")


@pytest.mark.parametrize("k", KS)
def test_a_rows_outputs_do_not_depend_on_the_batch(torch, weights, k):
    _, packed = weights[k]
    x = rows_of(torch, 64, k, 1)
    full = rg.rows_gemv(x, packed, mt=1)
    assert torch.equal(rg.rows_gemv(x, packed, mt=2), full), "MT changes the bits"
    for r in (0, 5, 38, 63):
        assert torch.equal(rg.rows_gemv(x[r:r + 1], packed)[0], full[r]), f"row {r} alone"
    g = torch.Generator(device="cuda").manual_seed(SEED + k)
    order = torch.randperm(64, generator=g, device="cuda")
    assert torch.equal(rg.rows_gemv(x[order], packed), full[order]), "the rows in another order"
    for rows in (3, 17, 40):
        assert torch.equal(rg.rows_gemv(x[order[:rows]].contiguous(), packed), full[order[:rows]]), f"{rows} rows"
    # beside other rows than its own batch's
    other = rows_of(torch, 9, k, 2)
    mixed = torch.cat([other[:4], x[7:8], other[4:]])
    assert torch.equal(rg.rows_gemv(mixed, packed)[4], full[7]), "row 7 among others"


def test_fragment_order_on_torch_tensors(torch, weights):
    w, packed = weights[KS[0]]
    assert packed.shape == (N // 16, KS[0] // 16, 32, 8)
    assert torch.equal(rg.unpack_from_mma(packed), w)
    cpu = rg.repack_for_mma(w[:64, :128].view(torch.int16).cpu().numpy())
    assert np.array_equal(rg.repack_for_mma(w[:64, :128]).view(torch.int16).cpu().numpy(), cpu)


def test_device_arrays_in_and_out(torch):
    from mdsl.gpu.arrays import DeviceArray
    from mdsl.ir.dtypes import bf16, round_to_dtype

    rng = np.random.default_rng(SEED)
    x = round_to_dtype(rng.standard_normal((5, 256)).astype(np.float32), bf16)
    w = round_to_dtype((rng.standard_normal((96, 256)) / 16).astype(np.float32), bf16)
    y = rg.rows_gemv(DeviceArray.from_numpy(x, bf16), DeviceArray.from_numpy(rg.repack_for_mma(w), bf16))
    assert type(y) is DeviceArray and y.shape == (5, 96)
    np.testing.assert_allclose(y.to_numpy(), x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-5, atol=1e-5)


def test_the_bandwidth_function_reports_each_row_count(torch):
    table = rg.bandwidth(rows_list=(1, 64), n=1024, k=2048, repeats=2)
    assert [rows for rows, _, _ in table] == [1, 64] and all(gbs > 0 for _, gbs, _ in table)

"""The GPU serving device's wgmma linear (mdsl/serving/linear_wgmma.cuh, mdsl.serving.gpu_wgmma) on the H200:
out = x @ [weights side by side].T (+ residual, also in place), x rounded to the weights' bf16, agrees with
float64 within float32 summation, for ragged column counts, k not a multiple of the 64-wide stage, every row
tile and split; and a row's result is bit-identical whatever the step's row count and the row's place in it,
its k splits in blocks of their own, in runs of several a block or one after another in one block (the batch
invariance the serving device promises, which rests on wgmma's sums not depending on the instruction's n), and
whether its rows come rounded from the op before (handed over, loaded by TMA) or from their float32 values."""
from __future__ import annotations

import numpy as np
import pytest

from mdsl.gpu import has_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="no GPU")]


def _hopper() -> bool:
    from mdsl.gpu.driver import get_device

    return get_device(0).capability == (9, 0)


def _operand(ptr, shape, dtype):
    from mdsl.serving.gpu import Operand

    return Operand(ptr, tuple(shape), dtype)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("k,sizes", [(352, [200, 72, 72]), (1024, [512]), (64, [40, 130]), (4096, [384, 128]),
                                     (1024, [4096, 4096, 2048]), (4096, [4096]), (4096, [2560])])
def test_the_product_agrees_with_float64_and_each_row_is_the_same_whatever_the_step(k, sizes):
    if not _hopper():
        pytest.skip("wgmma needs a compute capability 9.0 GPU")
    from mdsl.gpu.driver import check, driver
    from mdsl.ir.dtypes import bf16, f32, round_to_dtype
    from mdsl.serving.gpu_wgmma import Standalone, WgmmaLinears, launch_grid

    rng = np.random.default_rng(k)
    max_rows = 256
    dev = Standalone(max_rows, [(k, sizes)])
    linears = WgmmaLinears(dev, k)
    weights = [round_to_dtype(rng.standard_normal((n, k)).astype(np.float32), bf16) for n in sizes]
    w_ops = [_operand(dev._new_array(w, w.shape, bf16), w.shape, bf16) for w in weights]
    x = rng.standard_normal((max_rows, k)).astype(np.float32)
    width = sum(sizes) + 8   # (the linear writes columns offset .. offset + sum(sizes) - 1 of wider rows)
    residual = rng.standard_normal((max_rows, width)).astype(np.float32)
    x_op = _operand(dev._new_array(x, x.shape, f32), x.shape, f32)
    r_op = _operand(dev._new_array(residual, residual.shape, f32), residual.shape, f32)
    out = _operand(dev._new_array(None, (max_rows, width), f32), (max_rows, width), f32)
    # x rounded to bf16, as a norm before the linear hands its rows over
    rounded = _operand(dev._new_array(round_to_dtype(x, bf16), x.shape, bf16), x.shape, bf16)
    # the product's operand: x rounded to the weights' dtype (a value on the other side would be off by 2^-8)
    expected = round_to_dtype(x, bf16).astype(np.float64) @ np.concatenate(weights).astype(np.float64).T
    results = {}
    for rows in (1, 7, 8, 9, 33, 100, 128, 129, 256):
        for with_residual in (False, True, "in place"):
            check(driver.cuMemsetD8(out.ptr, 0, max_rows * width * 4), "cuMemsetD8")
            if with_residual == "in place":   # (out is the residual: each value read before it is written)
                start = np.zeros_like(residual)
                start[:rows, 4:4 + sum(sizes)] = residual[:rows, 4:4 + sum(sizes)]
                check(driver.cuMemcpyHtoD(out.ptr, start.ctypes.data, start.nbytes), "cuMemcpyHtoD")
            source = out if with_residual == "in place" else r_op if with_residual else None
            linears.launch(out, x_op, w_ops, source, rows, offset=4)
            check(driver.cuStreamSynchronize(dev._stream), "the linear")
            got = np.empty((max_rows, width), np.float32)
            check(driver.cuMemcpyDtoH(got.ctypes.data, out.ptr, got.nbytes), "cuMemcpyDtoH")
            block = got[:rows, 4:4 + sum(sizes)].astype(np.float64)
            want = expected[:rows] + (residual[:rows, 4:4 + sum(sizes)] if with_residual else 0.0)
            scale = np.abs(expected[:rows]).max()
            grid = launch_grid(rows, sizes, k, dev.sms)
            assert np.abs(block - want).max() <= 2e-5 * scale, (rows, with_residual, grid)
            # the columns the linear does not own, and the rows past the step's, are untouched
            assert not got[:, :4].any() and not got[:, 4 + sum(sizes):].any() and not got[rows:].any()
            if not with_residual:
                results[rows] = got[:rows, 4:4 + sum(sizes)].copy()
            # the rows handed over rounded by the op before (loaded by TMA at every row tile): the same bits
            check(driver.cuMemsetD8(out.ptr, 0, max_rows * width * 4), "cuMemsetD8")
            if with_residual == "in place":
                check(driver.cuMemcpyHtoD(out.ptr, start.ctypes.data, start.nbytes), "cuMemcpyHtoD")
            linears.handed = (x_op.ptr, rounded.ptr)
            linears.launch(out, x_op, w_ops, source, rows, offset=4)
            assert linears.handed is None
            check(driver.cuStreamSynchronize(dev._stream), "the linear")
            again = np.empty((max_rows, width), np.float32)
            check(driver.cuMemcpyDtoH(again.ctypes.data, out.ptr, again.nbytes), "cuMemcpyDtoH")
            assert np.array_equal(again.view(np.uint32), got.view(np.uint32)), (rows, with_residual)
    # the splits in blocks of their own at a few rows, in one block of 128 rows (many weight tiles) or of 64
    # (few) at 256: the same bits
    splits = launch_grid(1, sizes, k, dev.sms)[2]
    if sum(sizes) > 8192:
        assert splits > 1 and launch_grid(256, sizes, k, dev.sms)[:2] == ((128, 1), (2, 80, 1))
    if sizes in ([4096], [2560]):
        assert splits > 1 and launch_grid(256, sizes, k, dev.sms)[0] == (64, 1)
        assert launch_grid(256, sizes, k, dev.sms)[1][2] == 1
    for rows, got in results.items():   # bit for bit: row r alike in every step that holds it
        assert np.array_equal(got.view(np.uint32), results[256][:rows].view(np.uint32)), rows


def _activated(g: np.ndarray, u: np.ndarray, act: int) -> np.ndarray:
    """act(g) * u in float64 (step_kernels.cu's `activate` codes: 0 silu, 1 GELU's tanh form, 2 erf GELU)."""
    import math

    g = g.astype(np.float64)
    if act == 0:
        a = g / (1.0 + np.exp(-g))
    elif act == 1:
        a = 0.5 * g * (1.0 + np.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3)))
    else:
        a = 0.5 * g * (1.0 + np.vectorize(math.erf)(g / math.sqrt(2.0)))
    return a * u


@pytest.mark.timeout(300)
@pytest.mark.parametrize("k,half,act", [(1024, 4096, 0), (352, 200, 1), (4096, 1536, 2), (64, 64, 0)])
def test_the_gated_form_is_the_activated_product_of_the_plain_ones_and_each_row_the_same_whatever_the_step(
        k, half, act):
    """The gated launch (act(x @ gate.T) * (x @ up.T), the act_mul fused into its gate|up linear) against the
    plain launch's gate and up columns activated in float64 (the activations' own float32 roundings apart), for
    every row tile and split, its columns past the gate's untouched; a row's values bit-identical whatever the
    step's row count."""
    if not _hopper():
        pytest.skip("wgmma needs a compute capability 9.0 GPU")
    from mdsl.gpu.driver import check, driver
    from mdsl.ir.dtypes import bf16, f32, round_to_dtype
    from mdsl.serving.gpu_wgmma import Standalone, WgmmaLinears, launch_grid

    rng = np.random.default_rng(k + half)
    max_rows = 256
    dev = Standalone(max_rows, [(k, [half, half]), (half, [136])])
    linears = WgmmaLinears(dev, max(k, half))
    weights = [round_to_dtype(rng.standard_normal((half, k)).astype(np.float32) / np.sqrt(k), bf16) for _ in "gu"]
    w_ops = [_operand(dev._new_array(w, w.shape, bf16), w.shape, bf16) for w in weights]
    x = rng.standard_normal((max_rows, k)).astype(np.float32)
    x_op = _operand(dev._new_array(x, x.shape, f32), x.shape, f32)
    plain = _operand(dev._new_array(None, (max_rows, 2 * half), f32), (max_rows, 2 * half), f32)
    width = half + 8   # (the gated launch writes columns 0 .. half - 1 of wider rows)
    gated = _operand(dev._new_array(None, (max_rows, width), f32), (max_rows, width), f32)

    def run(out, rows: int, act_code: int, w: int) -> np.ndarray:
        check(driver.cuMemsetD8(out.ptr, 0, max_rows * w * 4), "cuMemsetD8")
        linears.launch(out, x_op, w_ops, None, rows, 0, act=act_code)
        check(driver.cuStreamSynchronize(dev._stream), "the linear")
        got = np.empty((max_rows, w), np.float32)
        check(driver.cuMemcpyDtoH(got.ctypes.data, out.ptr, got.nbytes), "cuMemcpyDtoH")
        return got

    results = {}
    for rows in (1, 7, 8, 9, 33, 100, 128, 129, 256):
        sums = run(plain, rows, -1, 2 * half)[:rows]
        got = run(gated, rows, act, width)
        want = _activated(sums[:, :half], sums[:, half:].astype(np.float64), act)
        assert np.abs(got[:rows, :half] - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), rows
        assert not got[:, half:].any() and not got[rows:].any()
        results[rows] = got[:rows, :half].copy()
    for rows, got in results.items():
        assert np.array_equal(got.view(np.uint32), results[256][:rows].view(np.uint32)), rows
    if (k, half) == (4096, 1536):   # (at 256 rows, every split in the block of 64 rows: the same bits)
        shape, (_, _, blocks), splits = launch_grid(256, [half, half], k, dev.sms, gated=True)
        assert shape == (64, 1) and blocks == 1 < splits

    # handed over: the products go rounded to bf16 into the buffer the next launch loads by TMA instead (the
    # float32 rows untouched), and it computes the bits it computes from the float32 products (its own
    # rounding of them: staged by its producer below 64 rows, round_rows from 64)
    down = round_to_dtype(rng.standard_normal((136, half)).astype(np.float32) / np.sqrt(half), bf16)
    d_op = [_operand(dev._new_array(down, down.shape, bf16), down.shape, bf16)]
    products = _operand(dev._new_array(None, (max_rows, half), f32), (max_rows, half), f32)
    after = _operand(dev._new_array(None, (max_rows, 136), f32), (max_rows, 136), f32)
    for rows in (1, 7, 8, 33, 64, 100, 129, 256):
        check(driver.cuMemcpyHtoD(products.ptr, results[256].ctypes.data, results[256][:rows].nbytes), "cuMemcpyHtoD")
        linears.launch(after, products, d_op, None, rows, 0)        # from the float32 products
        check(driver.cuStreamSynchronize(dev._stream), "the linear")
        from_float = np.empty((max_rows, 136), np.float32)
        check(driver.cuMemcpyDtoH(from_float.ctypes.data, after.ptr, from_float.nbytes), "cuMemcpyDtoH")
        check(driver.cuMemsetD8(products.ptr, 0, max_rows * half * 4), "cuMemsetD8")
        linears.launch(products, x_op, w_ops, None, rows, 0, act=act, hand=True)
        address, buffer = linears.handed
        assert address == products.ptr
        check(driver.cuStreamSynchronize(dev._stream), "the linear")
        handed = np.empty((rows, half), np.uint16)
        check(driver.cuMemcpyDtoH(handed.ctypes.data, buffer, handed.nbytes), "cuMemcpyDtoH")
        rounded = round_to_dtype(results[256][:rows], bf16)
        assert np.array_equal(handed, (rounded.view(np.uint32) >> 16).astype(np.uint16)), rows
        untouched = np.empty((max_rows, half), np.float32)
        check(driver.cuMemcpyDtoH(untouched.ctypes.data, products.ptr, untouched.nbytes), "cuMemcpyDtoH")
        assert not untouched.any(), rows
        linears.launch(after, products, d_op, None, rows, 0)        # from the handed rows
        assert linears.handed is None
        check(driver.cuStreamSynchronize(dev._stream), "the linear")
        from_handed = np.empty((max_rows, 136), np.float32)
        check(driver.cuMemcpyDtoH(from_handed.ctypes.data, after.ptr, from_handed.nbytes), "cuMemcpyDtoH")
        assert np.array_equal(from_handed[:rows].view(np.uint32), from_float[:rows].view(np.uint32)), rows

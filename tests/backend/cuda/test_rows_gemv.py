"""The rows kernel (mdsl/backend/cuda/rows_gemv.cuh and .py) without a GPU: fragment order and its inverse, a
numpy model of one warp's fragments (which lane holds which weight, row and sum, as the PTX ISA defines mma.m16n8k16
and ldmatrix, with the addresses and store indices the header computes) reproducing x W^T, the grid's K slices
fixed by K alone, and each configuration compiling for sm_90a without spills to HMMA, LDSM and streamed 16-byte
loads. Running it: tests/gpu/test_gpu_rows_gemv.py."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from mdsl.backend.cuda import rows_gemv as rg
from mdsl.backend.cuda.nvrtc import compile_cuda, nvdisasm_path, sass_instructions
from mdsl.errors import ShapeError, UnsupportedError
from tests.shared import disassembled

SM_REGISTERS = 65536
MEGAKERNEL_THREADS = 320   # a megakernel block: 8 compute warps, the scheduler warp and an idle one


def test_repack_and_unpack_are_inverse_permutations():
    rng = np.random.default_rng(0)
    for n, k in ((16, 16), (48, 32), (4096, 64)):
        w = rng.integers(0, 2 ** 16, size=(n, k), dtype=np.uint16)   # bf16 bits: any 16-bit pattern
        packed = rg.repack_for_mma(w)
        assert packed.shape == (n // 16, k // 16, 32, 8) and packed.dtype == w.dtype
        assert np.array_equal(rg.unpack_from_mma(packed), w)
        assert np.array_equal(np.sort(packed, axis=None), np.sort(w, axis=None))   # a permutation


def test_repack_on_torch_tensors_is_the_numpy_repack():
    torch = pytest.importorskip("torch")
    w = torch.randn(64, 96).to(torch.bfloat16)
    packed = rg.repack_for_mma(w)
    assert np.array_equal(packed.view(torch.int16).numpy(), rg.repack_for_mma(w.view(torch.int16).numpy()))
    assert torch.equal(rg.unpack_from_mma(packed), w)


def test_a_lane_holds_its_a_fragment_in_register_order():
    """PTX ISA, mma.m16n8k16 A (16-bit): a0, a1 at row groupID, a2, a3 at groupID + 8, columns 2 threadID_in_group
    + {0, 1}; a4 .. a7 the same 8 columns on."""
    w = np.arange(32 * 48, dtype=np.int64).reshape(32, 48)
    packed = rg.repack_for_mma(w)
    at = lambda r, c: w[16 + r, 32 + c]  # noqa: E731  (tile 1, k16 step 2)
    assert list(packed[1, 2, 0]) == [at(0, 0), at(0, 1), at(8, 0), at(8, 1), at(0, 8), at(0, 9), at(8, 8), at(8, 9)]
    assert list(packed[1, 2, 5]) == [at(1, 2), at(1, 3), at(9, 2), at(9, 3), at(1, 10), at(1, 11), at(9, 10),
                                     at(9, 11)]
    assert list(packed[1, 2, 31]) == [at(7, 6), at(7, 7), at(15, 6), at(15, 7), at(7, 14), at(7, 15), at(15, 14),
                                      at(15, 15)]


def test_repack_refuses_shapes_that_are_not_whole_blocks():
    with pytest.raises(ShapeError, match="multiples of 16"):
        rg.repack_for_mma(np.zeros((4096, 4100), np.uint16))
    with pytest.raises(ShapeError, match="32, 8"):
        rg.unpack_from_mma(np.zeros((2, 2, 16, 16), np.uint16))


# ---------------------------------------------------------------------------------------------
# a numpy model of one warp: the PTX ISA's fragment layouts, written element by element (not through
# rows_gemv.FRAGMENT_ROW / COL), and the header's own index expressions (checked to be in its text)

ADDRESS = "((lane / 16) * 8 + lane % 8) * stride + ((lane / 8) % 2) * 16"
STEP_ADDRESS = "p * 16 * stride + s * 32"
STORE_ROW, STORE_FEATURE = "t * 8 + 2 * q + (i & 1)", "(tile0 + m) * 16 + g + (i / 2) * 8"


def test_the_model_uses_the_headers_index_expressions():
    text = rg.HEADER.read_text()
    for expression in (ADDRESS, STEP_ADDRESS, STORE_ROW, STORE_FEATURE):
        assert expression in text, expression


def a_matrix(fragments: np.ndarray) -> np.ndarray:
    """The 16 x 16 A operand that 32 lanes' fragments ([32, 8] elements a0..a7) give mma.m16n8k16."""
    a = np.full((16, 16), np.nan)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for i in range(8):
            row = g + 8 * (i in (2, 3, 6, 7))
            col = 2 * q + (i & 1) + 8 * (i >= 4)
            a[row, col] = fragments[lane, i]
    assert not np.isnan(a).any()
    return a


def b_matrix(fragments: np.ndarray) -> np.ndarray:
    """The 16 x 8 B operand of 32 lanes' fragments ([32, 4] elements b0..b3: b0, b1 one register, b2, b3 the other)."""
    b = np.full((16, 8), np.nan)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for i in range(4):
            b[2 * q + (i & 1) + 8 * (i >= 2), g] = fragments[lane, i]
    assert not np.isnan(b).any()
    return b


def d_fragments(d: np.ndarray) -> np.ndarray:
    """The 16 x 8 sums as 32 lanes hold them ([32, 4]: c0, c1 at row groupID, c2, c3 at groupID + 8)."""
    out = np.zeros((32, 4))
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for i in range(4):
            out[lane, i] = d[g + 8 * (i >= 2), 2 * q + (i & 1)]
    return out


def ldmatrix_x4(smem: np.ndarray, addresses: list) -> np.ndarray:
    """ldmatrix.sync.aligned.m8n8.x4.b16: lane 8 j + r gives the address of row r of matrix j (8 consecutive
    16-bit elements); lane l receives, of each matrix j, row l / 4's elements 2 (l % 4) and + 1 (register j).
    smem is 16-bit elements, addresses in bytes."""
    out = np.zeros((32, 4, 2))
    for lane in range(32):
        for j in range(4):
            address = addresses[8 * j + lane // 4]
            assert address % 16 == 0
            start = address // 2 + 2 * (lane % 4)
            out[lane, j] = smem[start:start + 2]
    return out


def eval_expression(expression: str, **names) -> int:
    return eval(expression.replace("/", "//"), {}, names)


def warp_model(packed: np.ndarray, x: np.ndarray, kslice: int, mt: int, tile0: int, n_total: int) -> dict:
    """{(row, feature): sum} of one warp's RowsTile<mt> over K slice 0, in the header's order: the rows staged as
    RowSlice stages them, ldmatrix reading them at the header's addresses, one mma per (tile, n8 tile) a k16 step,
    each lane's sums stored at the header's indices."""
    rows, k = x.shape
    stride = 2 * kslice + 16
    rows16 = -(-rows // 16) * 16
    smem = np.zeros(rows16 * stride // 2)
    for r in range(rows):
        smem[r * stride // 2:r * stride // 2 + min(k, kslice)] = x[r, :kslice]
    n8, steps = -(-rows // 8), min(k, kslice) // 16
    acc = np.zeros((mt, n8, 32, 4))
    for s in range(steps):
        b = []
        for p in range(-(-n8 // 2)):
            addresses = [eval_expression(ADDRESS, lane=lane, stride=stride) + eval_expression(STEP_ADDRESS, p=p,
                                                                                                stride=stride, s=s)
                         for lane in range(32)]
            regs = ldmatrix_x4(smem, addresses)
            b += [regs[:, 0:2].reshape(32, 4), regs[:, 2:4].reshape(32, 4)]   # (b0, b1) of n8 tiles 2p, 2p + 1
        for m in range(mt):
            a = a_matrix(packed[tile0 + m, s])
            for t in range(n8):
                acc[m, t] += d_fragments(a @ b_matrix(b[t]))
    out = {}
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for m in range(mt):
            for t in range(n8):
                for i in range(4):
                    r = eval_expression(STORE_ROW, t=t, q=q, i=i)
                    n = eval_expression(STORE_FEATURE, tile0=tile0, m=m, g=g, i=i)
                    if r < rows:
                        assert (r, n) not in out
                        out[r, n] = acc[m, t, lane, i]
    assert n_total >= (tile0 + mt) * 16
    return out


@pytest.mark.parametrize(("rows", "mt"), [(1, 1), (3, 2), (8, 1), (17, 2), (24, 1)])
def test_the_warps_fragments_compute_x_w_transposed(rows, mt):
    rng = np.random.default_rng(rows)
    n, k, kslice = 64, 128, 64
    x = rng.integers(-4, 5, size=(rows, k)).astype(np.float64)   # small integers: exact sums
    w = rng.integers(-4, 5, size=(n, k)).astype(np.float64)
    packed = rg.repack_for_mma(w)
    tile0 = 2
    got = warp_model(packed, x, kslice, mt, tile0, n)
    want = x[:, :kslice] @ w[:, :kslice].T
    assert sorted(got) == [(r, f) for r in range(rows) for f in range(16 * tile0, 16 * (tile0 + mt))]
    for (r, f), value in got.items():
        assert value == want[r, f], (r, f)


def test_ldmatrix_reads_eight_rows_on_distinct_banks():
    """Each 8-lane phase of ldmatrix reads 8 rows' 16 bytes at one k: the 16-byte pad puts them on 8 different
    4-bank groups."""
    stride = 2 * rg.KSLICE + 16
    for s in (0, 1, 63):
        addresses = [eval_expression(ADDRESS, lane=lane, stride=stride) + s * 32 for lane in range(32)]
        for phase in range(4):
            groups = {(a % 128) // 16 for a in addresses[8 * phase:8 * phase + 8]}
            assert len(groups) == 8


# ---------------------------------------------------------------------------------------------
# the grid


def test_the_k_slices_depend_on_k_alone():
    for n, k in ((4096, 4096), (4096, 12288), (12288, 4096), (6144, 4096), (16, 1040)):
        plans = {rows: rg.launch_plan(rows, n, k) for rows in range(1, 65)}
        assert {p.slices for p in plans.values()} == {-(-k // rg.KSLICE)}
        assert len({(p.blocks, p.tiles_per_block) for p in plans.values()}) == 1
        plan = plans[64]
        assert plan.blocks * plan.tiles_per_block >= n // 16 > (plan.blocks - 1) * plan.tiles_per_block
        assert plan.blocks * plan.slices <= rg.H200_SMS or plan.tiles_per_block == 1
    assert rg.smem_bytes(64) <= 227 * 1024 and rg.smem_bytes(1) == 16 * (2 * rg.KSLICE + 16)
    for mt in rg.TILES:
        assert rg.launch_plan(5, 4096, 4096, mt).tiles_per_block % mt == 0


def test_launch_plan_refuses_more_rows_than_a_batch():
    with pytest.raises(ShapeError, match="1 to 64 rows"):
        rg.launch_plan(65, 4096, 4096)
    with pytest.raises(UnsupportedError, match="tiles a warp"):
        rg.kernel_source(3)


# ---------------------------------------------------------------------------------------------
# the device code


@pytest.fixture(scope="module", params=rg.TILES, ids=lambda mt: f"mt{mt}")
def compiled(request):
    return request.param, compile_cuda(rg.kernel_source(request.param), arch="sm_90a")


@pytest.mark.timeout(120)
def test_each_configuration_compiles_for_sm_90a_without_spills(compiled):
    mt, module = compiled
    r = module.resources[rg.kernel_name(mt, rg.KSLICE)]
    assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, r
    assert r.registers * rg.THREADS <= SM_REGISTERS and r.smem_bytes == 0, r
    if mt == 1:   # fits beside the megakernel's scheduler warps
        assert -(-r.registers // 8) * 8 * MEGAKERNEL_THREADS <= SM_REGISTERS, r


@pytest.mark.timeout(120)
def test_the_sass_multiplies_on_hmma_from_ldmatrix_and_streamed_loads(compiled):
    if nvdisasm_path() is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    mt, module = compiled
    code = collections.Counter(sass_instructions(disassembled(module.cubin))[rg.kernel_name(mt, rg.KSLICE)])
    depth = rg.LOADS // mt
    # a full ring's steps for each n8 count 1..8, and the same again for the tail: 2 * depth * mt * (1 + ... + 8)
    assert code["HMMA.16816.F32.BF16"] == 2 * depth * mt * 36
    assert code["LDSM.16.M88.4"] == 2 * depth * (1 + 1 + 2 + 2 + 3 + 3 + 4 + 4)
    streamed = [op for op in code if op.startswith("LDG.")]   # (LDGSTS: cp.async)
    assert streamed == ["LDG.E.NA.LTC256B.128.CONSTANT"], streamed   # the weights, the only global loads
    assert code["LDGSTS.E.BYPASS.128"] >= 1                 # the rows staged by cp.async
    assert not any(op.startswith(("LDL", "STL")) for op in code)

"""The Hopper GEMM (mdsl/backend/cuda/hopper_gemm.cuh and .py, and the same kernel as the PTX backend's LLVM IR,
mdsl/backend/ptx/hopper_gemm.py) without a GPU: each configuration of each backend compiles for sm_90a without
spills, its SASS issues wgmma (HGMMA) from TMA-loaded stages (UTMALDG) guarded by mbarriers (SYNCS), the
host's constants agree with the device's, and the tensor maps, tile widths and errors are the ones the kernel
needs. Running it: tests/gpu/test_gpu_hopper_gemm.py."""
from __future__ import annotations

import re

import numpy as np
import pytest

from mdsl.backend.cuda import hopper_gemm as hg
from mdsl.backend.cuda.nvrtc import compile_cuda, compile_ptx, nvdisasm_path, sass_instructions
from mdsl.backend.ptx import hopper_gemm as ptx_gemm
from mdsl.backend.ptx.compile import assemble, assembler, llvm_to_ptx, ptx_target
from mdsl.errors import DTypeError, ShapeError, UnsupportedError
from tests.shared import disassembled

#: (operands, product, tile width): every tile width, both operand dtypes, each product dtype
CONFIGS = [("bf16", "bf16", 256), ("f16", "f32", 128), ("bf16", "f32", 192), ("f16", "f16", 256)]
H200_SMS = 132
SM_REGISTERS = 65536


@pytest.fixture(scope="module", params=[(backend, c) for backend in ("cuda", "ptx") for c in CONFIGS],
                ids=lambda p: "-".join(map(str, (p[0], *p[1]))))
def compiled(request):
    backend, (dtype, out_dtype, bn) = request.param
    if backend == "cuda":
        return request.param[1], compile_cuda(hg.kernel_source(dtype, out_dtype, bn), arch="sm_90a")
    if assembler() is None:
        pytest.skip("no PTX assembler here (nvJitLink or ptxas)")
    ptx = llvm_to_ptx(ptx_gemm.llvm_source(dtype, out_dtype, bn), "sm_90a", specific=True)
    assert ".target sm_90a" in ptx   # wgmma and setmaxnreg exist only for the arch-specific target
    return request.param[1], assemble(ptx)


@pytest.mark.timeout(120)
def test_each_configuration_compiles_for_sm_90a_without_spills(compiled):
    (dtype, out_dtype, bn), module = compiled
    r = module.resources[hg.kernel_name(dtype, out_dtype, bn)]
    assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, r
    # every thread of the block's three warpgroups holds its registers at once: one block fits an SM
    assert r.registers * hg.THREADS <= SM_REGISTERS, r
    assert r.smem_bytes == 0   # all of it dynamic: the launch asks for smem_bytes(bn)
    # ptxas serializes wgmmas it cannot prove independent of the code around them, and says so
    assert "wgmma" not in module.log and "Performance" not in module.log, module.log


@pytest.mark.timeout(120)
def test_the_sass_runs_wgmma_on_tma_loaded_stages_guarded_by_mbarriers(compiled):
    if nvdisasm_path() is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    (dtype, out_dtype, bn), module = compiled
    sass = disassembled(module.cubin)
    code = sass_instructions(sass)[hg.kernel_name(dtype, out_dtype, bn)]
    count = lambda prefix: sum(op.startswith(prefix) for op in code)  # noqa: E731
    # a stage's four k16 steps, each one wgmma over the consumer's 64 rows and the tile's bn columns, reading
    # both operands from shared memory (gdesc: a descriptor pair); f16 operands are the unnamed default
    wgmmas = re.findall(r"HGMMA\.(\w+)\.F32(\.BF16)? R\d+, gdesc\[", sass)
    want = (f"64x{bn}x16", ".BF16" if dtype == "bf16" else "")
    assert wgmmas == [want] * (hg.BK // 16) and count("HGMMA") == len(wgmmas)
    assert count("UTMALDG.2D") == 2                     # the stage's A tile and W tile
    assert count("UTMACCTL.PF") == 2                    # both tensor maps prefetched
    assert count("SYNCS.EXCH.64") == 2 * hg.stages(bn)  # a full and an empty mbarrier per stage
    assert count("SYNCS.PHASECHK.TRANS64.TRYWAIT") >= 2  # the consumers wait for full stages, the producer for empty
    assert count("SYNCS.ARRIVE.TRANS64") >= 2           # expect-tx arrivals and the consumers' releases
    assert count("WARPGROUP.ARRIVE") >= 1 and count("WARPGROUP.DEPBAR") >= 2   # wgmma.fence, wait_group 1 and 0
    assert count("HMMA") == count("LDGSTS") == count("LDS") == 0   # no mma.sync, cp.async or shared loads
    assert count("LDL") == count("STL") == 0
    # the consumer keeps one stage's wgmmas in flight: wait_group 1 inside the loop, 0 after it
    depbars = [op for op in code if op.startswith("WARPGROUP.DEPBAR")]
    assert depbars == ["WARPGROUP.DEPBAR.LE"] * len(depbars)


def test_the_host_s_tile_constants_are_the_device_s():
    asserts = "".join(
        f"static_assert(mdsl::hopper::GemmTile<__nv_bfloat16, {bn}>::{name} == {value}, \"{name} {bn}\");\n"
        for bn in hg.TILE_NS
        for name, value in (("STAGES", hg.stages(bn)), ("SMEM_BYTES", hg.smem_bytes(bn)), ("BM", hg.BM),
                            ("BK", hg.BK), ("THREADS", hg.THREADS)))
    compile_ptx(hg.kernel_source("bf16", "bf16", 256) + asserts, arch="sm_90a")   # a failed assert fails the compile


def test_a_descriptor_names_a_128_byte_swizzled_k_major_tile():
    # PTX ISA, wgmma matrix descriptor: start address >> 4 in bits 0-13, leading byte offset >> 4 in 16-29,
    # stride byte offset >> 4 in 32-45 (8 rows of 128 bytes), swizzle mode in 62-63 (1: 128 bytes)
    address = 0x2A400 + 2 * 32   # a 1024-aligned stage, k16 step 2
    want = (address >> 4) | (16 >> 4) << 16 | (1024 >> 4) << 32 | 1 << 62
    compile_ptx(hg.kernel_source("bf16", "bf16", 256) +
                f"static_assert(mdsl::hopper::descriptor({address}u) == {want}ull, \"descriptor\");\n"
                f"static_assert(mdsl::hopper::descriptor(0x2A400u) + 4 == {want}ull, \"k16 steps\");\n",
                arch="sm_90a")


def test_the_stages_fill_the_shared_memory_an_h200_block_gets():
    assert [hg.stages(bn) for bn in hg.TILE_NS] == [6, 5, 4]
    for bn in hg.TILE_NS:
        assert 160 * 1024 <= hg.smem_bytes(bn) <= 227 * 1024, bn   # cudaDevAttrMaxSharedMemoryPerBlockOptin


def test_the_wgmma_instruction_names_every_accumulator():
    text = hg.wgmma_source("f16", 192)
    assert "wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16" in text
    # mma(d, a, b) adds to d; mma(d, a, b, keep) adds to d where keep, else starts from zero (scale-d)
    assert text.count('"+f"(d[') == 2 * 96 and "%95}, %96, %97, 1, 1, 1, 0, 0;" in text
    assert "setp.ne.b32 keep, %98, 0;" in text and "%95}, %96, %97, keep, 1, 1, 0, 0;" in text
    assert "struct Wgmma<__half, 192>" in text


def test_unsupported_configurations_are_refused():
    for args in (("f32", "f32", 256), ("bf16", "i32", 256), ("bf16", "bf16", 64)):
        with pytest.raises(UnsupportedError):
            hg.kernel_source(*args)
        with pytest.raises(UnsupportedError):
            ptx_gemm.llvm_source(*args)


def test_the_ptx_kernel_has_the_cuda_kernel_s_name_parameters_and_bounds():
    ptx = llvm_to_ptx(ptx_gemm.llvm_source("f16", "f32", 128), "sm_90a", specific=True)
    name = hg.kernel_name("f16", "f32", 128)
    params = re.search(rf"\.entry {name}\((.*?)\)", ptx, flags=re.S).group(1)
    # two 128-byte tensor maps by value (64-byte aligned, as `const __grid_constant__ TensorMap`), then C, bias,
    # residual, M, N, K: the CUDA kernel's launch parameters
    kinds = re.findall(r"\.param (\.align 64 \.b8|\.u64|\.u32)", params)
    assert kinds == [".align 64 .b8"] * 2 + [".u64"] * 3 + [".u32"] * 3, params
    assert params.count("[128]") == 2
    assert "cvta.param" in ptx   # TMA reads the maps where they are, not a local copy
    assert f".maxntid {hg.THREADS}" in ptx and ".minnctapersm 1" in ptx
    # the lowered kernels' PTX stays plain sm_90, which loads on the `a` device too
    assert ptx_target("sm_90a") == "sm_90" and ptx_target("sm_90a", specific=True) == "sm_90a"


@pytest.mark.parametrize("rows, k, dtype, box_rows", [(1024, 4096, "bf16", 128), (6144, 4096, "bf16", 192),
                                                      (1000, 72, "f16", 128), (1, 8, "bf16", 256)])
def test_a_tensor_map_covers_the_operand_in_swizzled_boxes(rows, k, dtype, box_rows):
    args = hg.tensor_map_arguments(rows, k, dtype, box_rows)
    assert args.dims == (k, rows)                   # K innermost
    assert args.strides == (2 * k,) and args.strides[0] % 16 == 0
    assert args.box == (hg.BK, box_rows) and args.box[0] * 2 == 128   # a box row is one 128-byte swizzle span
    assert all(1 <= b <= 256 for b in args.box) and args.element_strides == (1, 1)
    assert (args.swizzle, args.interleave, args.oob_fill) == ("128B", "NONE", "NONE")   # zeros outside


def test_the_driver_gets_its_own_enums():
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver

    args = hg.tensor_map_arguments(1000, 72, "f16", 128)
    got = hg.encode_arguments(args, 0x7F0000001000)
    assert got[0] == driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    assert got[1:3] == (2, 0x7F0000001000)
    assert [int(d) for d in got[3]] == [72, 1000] and [int(s) for s in got[4]] == [144]
    assert [int(b) for b in got[5]] == [64, 128] and [int(e) for e in got[6]] == [1, 1]
    assert got[7:] == (driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                       driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                       driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                       driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    assert hg.encode_arguments(hg.tensor_map_arguments(8, 16, "bf16", 256), 0)[0] == \
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16


@pytest.mark.parametrize("m, n, want", [
    (1024, 4096, 256),    # 128 tiles: one wave
    (1024, 24576, 256),   # 768 tiles: 6 waves (128 wide: 12)
    (1024, 6144, 192),    # 256 tiles of 192: 2 waves, where 256 wide takes 2 and 128 wide 3
    (17, 6144, 128),      # one row of tiles: the narrowest keeps the most SMs busy
    (4096, 4096, 256),
])
def test_the_tile_width_covers_the_product_in_the_fewest_weighted_waves(m, n, want):
    assert hg.tile_n(m, n, H200_SMS) == want


@pytest.mark.parametrize("k", [0, 4, 12, 4095])
def test_k_must_keep_tma_rows_16_byte_aligned(k):
    with pytest.raises(ShapeError, match="multiple of 8") as e:
        hg.check_operands((4, k), "bf16", (8, k), "bf16")
    assert "pad" in e.value.hint


def test_the_operands_must_be_16_bit_matrices_of_one_dtype_and_one_k():
    assert hg.check_operands((17, 72), "f16", (200, 72), "f16") == (17, 200, 72)
    with pytest.raises(ShapeError, match="same K"):
        hg.check_operands((4, 64), "bf16", (64, 8), "bf16")
    with pytest.raises(ShapeError, match="matrices"):
        hg.check_operands((2, 4, 64), "bf16", (8, 64), "bf16")
    with pytest.raises(DTypeError, match="bf16 or f16") as e:
        hg.check_operands((4, 64), "f32", (8, 64), "f32")
    assert "torch.matmul" in e.value.hint
    with pytest.raises(DTypeError, match="one dtype"):
        hg.check_operands((4, 64), "bf16", (8, 64), "f16")


def test_without_a_gpu_the_call_says_so(monkeypatch):
    from mdsl.gpu import driver

    monkeypatch.setattr(driver, "has_gpu", lambda: False)
    with pytest.raises(driver.NoGPUError):
        hg.hopper_gemm(np.zeros((4, 8), np.float16), np.zeros((8, 8), np.float16))


def test_the_kernel_source_is_the_header_with_one_wgmma_and_one_entry_point():
    source = hg.kernel_source("bf16", "f32", 192)
    assert source.count("template <> struct Wgmma<") == 1
    assert re.findall(r'extern "C" __global__ void __launch_bounds__\((\d+), 1\) (\w+)\(', source) == \
        [(str(hg.THREADS), "mdsl_hopper_gemm_bf16_f32_n192")]
    assert "const __grid_constant__ mdsl::hopper::TensorMap a" in source

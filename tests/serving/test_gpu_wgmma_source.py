"""The GPU serving device's wgmma linear without a GPU: every kernel compiles for sm_90a without spills and fits an
SM, its SASS runs one wgmma of each row tile's width a k16 step on stages of a TMA-loaded weight tile and the
rows' rounded tile (stored by the producer up to 32 rows, loaded by TMA from 64), the host's constants are the
kernel's, and the row tiles and k splits are the ones batch invariance needs (splits from the weights alone,
never empty). Running it: tests/gpu/test_gpu_serving_wgmma.py, and the serving device's tests on an H200."""
from __future__ import annotations

import re

import pytest

from mdsl.serving import gpu_wgmma as G

H200_SMS = 132
H200_SMEM = 232448          # the opt-in dynamic shared memory of a block
SM_SMEM = 233472            # an SM's shared memory, of which each resident block's runtime reserves 1 KB
SM_REGISTERS = 65536


@pytest.fixture(scope="module")
def module():
    from mdsl.backend.cuda.nvrtc import compile_cuda

    return compile_cuda(G.kernel_source(), arch="sm_90a")


@pytest.mark.timeout(180)
def test_every_kernel_compiles_for_sm_90a_without_spills_and_its_resident_blocks_fit_an_sm(module):
    # every row tile, two blocks an SM below the largest, and one of 64 rows and one of 128 rows past it
    assert G.SHAPES == tuple((rn, 2) for rn in G.ROW_TILES[:-1]) + ((64, 1), (G.ROW_TILES[-1], 1))
    shapes = {G.kernel_name(d, rn, blocks): (rn, blocks) for d in ("bf16", "f16") for rn, blocks in G.SHAPES}
    assert set(module.resources) == set(shapes) | {"round_rows_bf16", "round_rows_f16"}
    for name, r in module.resources.items():
        assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, (name, r)
        if name in shapes:
            rn, blocks = shapes[name]
            assert blocks * r.registers * G.THREADS <= SM_REGISTERS, (name, r)
            assert G.smem_bytes(rn, blocks) + r.smem_bytes <= H200_SMEM, (name, r)
            assert blocks * (G.smem_bytes(rn, blocks) + r.smem_bytes + 1024) <= SM_SMEM, (name, r)
            assert G.stages(rn, blocks) >= 4, (name, rn)   # a few stages in flight
    # ptxas serializes wgmmas it cannot prove independent of the code around them, and warns
    assert "warning" not in module.log.lower() and "Performance" not in module.log, module.log


@pytest.mark.timeout(180)
def test_the_sass_runs_one_wgmma_a_k16_step_on_staged_rows_and_a_tma_loaded_weight_tile(module):
    from mdsl.backend.cuda.nvrtc import nvdisasm_path
    from tests.shared import disassembled

    if nvdisasm_path() is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    sass = disassembled(module.cubin)
    for rn, blocks in G.SHAPES:
        name = G.kernel_name("bf16", rn, blocks)
        body = sass.split(f".text.{name}:")[1].split(".text.")[0]
        wgmmas = re.findall(r"HGMMA\.(\w+)\.F32\.BF16 R\d+, gdesc\[", body)
        # one per k16 step: in the loop of a split, and where two sets of sums are taken in turn, in its copy
        # for each set
        copies = 3 if G.two_sets(rn, blocks) else 1
        assert wgmmas == [f"64x{rn}x16"] * (G.BK // 16) * copies, (rn, wgmmas)
        # the weight tile by TMA: one load of the block's weight, or gated two (the gate's and the up's halves),
        # the first stages' before the wait for the kernel before this one (ACQBULK: dependent_launch.cuh) and
        # the others' in the producer's loop after it, as every other access to memory
        before, wait, after = body.partition("ACQBULK")
        assert wait and "ACQBULK" not in after, rn
        assert len(re.findall(r"UTMALDG\.2D", before)) == 3, rn
        assert not re.search(r"\b(LDG|STG|ATOMG|RED|LD\.E|ST\.E)\b", before), rn
        # ... and the rows' tile by TMA (rows handed over rounded, or rounded by round_rows); below TMA_ROWS rows
        # a second loop of the producer's, for rows not handed over, loads the weights and stores the rows'
        # chunks by its threads, made visible to wgmma
        staged = rn < G.TMA_ROWS
        assert len(re.findall(r"UTMALDG\.2D", after)) == 3 + 1 + 3 * staged, rn
        assert (len(re.findall(r"STS\.64", after)) >= 1 and "FENCE.VIEW.ASYNC.S" in after) == staged, rn
        # ... its float32 rows and norm weights copied (cp.async: LDGSTS) into the float slots stages ahead,
        # its first stages' copies before the row's 1 / rms and its barrier (2), the others' in the loop
        assert ("LDGSTS" in after) == staged, rn
        if staged:
            barrier = after.index("BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ")
            assert "LDGSTS" in after[:barrier] and "LDGSTS" in after[barrier:], rn
        # the consumer warpgroups' own barrier (1) twice in the gated epilogue's hand-over between them and twice
        # around the tile's values for its rows' sums of squares; the producer's (2) once, where it stages rows,
        # after each row's 1 / rms of a norm it runs
        assert len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING 0x1, 0x100 ", body)) == 4, rn
        assert len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING 0x2, 0x80 ", body)) == staged, rn
        # a block alone on its SM: the producer gives registers to the consumers (their splits' running total
        # beside the accumulators) and each returns to the kernel's count before the split fold: two
        # deallocations, two allocations; a paired block keeps the kernel's count throughout
        if blocks == 1:
            assert len(re.findall(r"USETMAXREG\.DEALLOC", body)) == 2, rn
            assert len(re.findall(r"USETMAXREG\.TRY_ALLOC", body)) == 2, rn
        else:
            assert "USETMAXREG" not in body, rn
    for d in ("bf16", "f16"):   # round_rows waits for the kernel before it as well
        body = sass.split(f".text.round_rows_{d}:")[1].split(".text.")[0]
        assert body.index("ACQBULK") < body.index("LDG"), d


def test_the_host_constants_are_the_kernels():
    source = G.SOURCE.read_text()
    for name, value in (("MAX_PARTS", G.MAX_PARTS), ("FEATURES", G.FEATURES), ("BK", G.BK), ("THREADS", G.THREADS)):
        assert re.search(rf"constexpr int {name} = (\d+);", source).group(1) == str(value)
    assert f"constexpr bool TMA_ROWS = RN >= {G.TMA_ROWS};" in source
    assert f"constexpr int STAGE_SPACE = {G.STAGE_SPACE};" in source
    assert f"constexpr int PAIRED_SPACE = {G.PAIRED_SPACE};" in source


@pytest.mark.timeout(180)
def test_the_hosts_shared_memory_and_stages_are_the_rings():
    # (the launch asks for smem_bytes: less than the ring lays out would let its stages run past it)
    from mdsl.backend.cuda.nvrtc import compile_cuda

    ring = "mdsl::serve_tc::Ring"
    checks = "".join(f'static_assert({ring}<{rn}, {b}>::SMEM_BYTES == {G.smem_bytes(rn, b)}, "smem {rn}");\n'
                     f'static_assert({ring}<{rn}, {b}>::STAGES == {G.stages(rn, b)}, "stages {rn}");\n'
                     f'static_assert({ring}<{rn}, {b}>::TWO_SETS == {str(G.two_sets(rn, b)).lower()}, "sets");\n'
                     for rn, b in G.SHAPES)
    compile_cuda(G.kernel_source() + checks, arch="sm_90a")


def test_a_row_tile_holds_the_steps_rows_up_to_the_largest_and_past_it_gives_the_sms_a_block_each():
    assert [G.row_tile(r) for r in (1, 8, 9, 16, 17, 64, 65, 128, 129, 256)] == \
        [8, 8, 16, 16, 32, 64, 128, 128, 128, 128]
    for rows in range(1, 129):   # one row tile: two blocks an SM below the largest
        rn = G.row_tile(rows)
        for tiles in (1, 48, 1000):
            assert G.launch_shape(rows, tiles, H200_SMS) == (rn, 2 if rn < 128 else 1)
    # past 128 rows one block an SM, of 64 rows while they are one an SM at most (the weight tiles few), else 128
    for rows in (129, 200, 256, 300, 512, 1024, 4096):
        for tiles in range(1, 300):
            shape = G.launch_shape(rows, tiles, H200_SMS)
            assert shape == ((64 if tiles * -(-rows // 64) <= H200_SMS else 128), 1), (rows, tiles)
            assert shape in G.SHAPES
    # Qwen3-8B at 256 rows: o's and down's 32 tiles in 128 blocks of 64 rows, q|k|v's 48 in 96 of 128 rows
    assert G.launch_shape(256, 32, H200_SMS) == (64, 1) and G.launch_shape(256, 48, H200_SMS) == (128, 1)


@pytest.mark.parametrize("tiles,k", [(1, 64), (3, 328), (4, 1024), (48, 4096), (192, 4096), (32, 12288), (8, 100)])
def test_the_k_splits_are_never_empty_and_each_runs_enough_steps(tiles, k):
    splits = G.wgmma_splits(tiles, k, H200_SMS)
    steps = -(-k // G.BK)
    per = -(-steps // splits)
    assert 1 <= splits <= steps and (splits - 1) * per < steps   # the kernel's last split has a step
    assert splits == 1 or per >= G.MIN_STEPS
    assert splits * tiles >= min(2 * H200_SMS, tiles * max(1, steps // G.MIN_STEPS)) // 2
    assert splits == 1 or splits * tiles <= 2 * H200_SMS   # one wave of two blocks an SM


def test_the_scratch_covers_the_partials_and_arrivals_of_the_largest_step():
    # split blocks write partials only at one row tile (128 rows at most): every launch up to 256 rows fits
    linears = [(4096, [4096, 1024, 1024]), (12288, [4096]), (1024, [64])]
    partials, arrivals = G.scratch(linears, 256, H200_SMS)
    qkv = G.wgmma_splits(48, 4096, H200_SMS) * 128 * 48 * G.FEATURES
    down = G.wgmma_splits(32, 12288, H200_SMS) * 128 * 32 * G.FEATURES
    assert partials == max(qkv, down) and arrivals == 48
    for rows in range(1, 257, 7):
        for k, sizes in linears:
            _, (row_tiles, tiles, blocks), splits = G.launch_grid(rows, sizes, k, H200_SMS)
            if blocks > 1:
                assert row_tiles == 1 and splits * rows * tiles * G.FEATURES <= partials, (rows, sizes)
                assert row_tiles * tiles <= arrivals, (rows, sizes)


def test_a_tiles_splits_run_in_blocks_of_their_own_at_one_row_tile_and_past_it_in_the_tiles_block():
    for tiles in range(1, 400, 3):
        for k in (64, 1024, 4096, 12288):
            splits = G.wgmma_splits(tiles, k, H200_SMS)
            assert G.split_blocks(1, splits) == splits                  # a step of one row tile
            assert all(G.split_blocks(row_tiles, splits) == 1 for row_tiles in (2, 3, 8))


def test_only_a_block_alone_on_its_sm_runs_several_splits():
    # a block runs a run of several splits only where its producer gives the consumers the registers that hold
    # the splits' running total (one block an SM): a paired block runs one split
    for rows in (1, 8, 9, 32, 33, 64, 65, 128, 129, 256, 512, 4096):
        for tiles, k in ((1, 64), (32, 4096), (48, 4096), (192, 4096), (32, 12288), (1187, 4096)):
            (rn, per_sm), (row_tiles, _, blocks), splits = G.launch_grid(rows, [tiles * G.FEATURES], k, H200_SMS)
            assert blocks in (1, splits) and rn * row_tiles >= rows, (rows, tiles, k)
            if blocks < splits:
                assert per_sm == 1 and rn >= G.TMA_ROWS, (rows, tiles, k)


@pytest.mark.parametrize("rows,k,sizes,shape,grid,splits", [
    (1, 4096, [4096, 1024, 1024], (8, 2), (1, 48, 5), 5),      # Qwen3-8B's q|k|v at a decode step: one wave
    (1, 4096, [12288, 12288], (8, 2), (1, 192, 1), 1),         # gate|up: its tiles fill the wave alone
    (256, 4096, [4096, 1024, 1024], (128, 1), (2, 48, 1), 5),  # two tiles of 128 rows: 96 blocks, the splits in each
    (256, 4096, [4096], (64, 1), (4, 32, 1), 8),               # o's: 128 blocks of 64 rows
    (256, 1024, [4096, 4096, 2048], (128, 1), (2, 80, 1), 3),  # 80 tiles: 64-row blocks would stack two an SM
    (100, 4096, [4096], (128, 1), (1, 32, 8), 8),              # one row tile of 128: a block a split
    (1024, 3072, [1024], (64, 1), (16, 8, 1), 12),             # Qwen3-0.6B's down: 8 tiles, 128 blocks of 64 rows
])
def test_a_launchs_grid_is_row_tiles_by_weight_tiles_by_split_blocks(rows, k, sizes, shape, grid, splits):
    assert G.launch_grid(rows, sizes, k, H200_SMS) == (shape, grid, splits)

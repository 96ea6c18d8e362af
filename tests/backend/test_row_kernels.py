"""Kernel-level reductions and norms (mdsl.lowering.grid.kernel_row_loop), without a GPU: the lowering's
lanes, loads and grid for few long rows and many short ones, and both backends' kernels compiled for
sm_90a with no spills, their SASS reading each row once in 16-byte loads where the row allows it, and the
cost model's blocks for them. The kernels computed on the CPU: tests/backend/ptx/test_ptx_simulated.py (`test_row_kernels`); on the GPU:
tests/gpu/test_gpu_ops.py (the `rows-` cases)."""
from __future__ import annotations

import pytest

from mdsl.ir import bf16, f16, f32
from mdsl.ir.dtypes import DType
from mdsl.lowering.grid import ROW_OPS, RowLoop, kernel_row_loop, row_kernel_grid
from mdsl.search.cost import H200, kernel_costs
from tests.backend.backends import BACKENDS, emit, kernel_instructions, module, needs_nvdisasm
from tests.backend.cuda.builder import Graph

pytestmark = pytest.mark.shared_compile_cache   # a program's code compiled once per test run (tests/shared.py)


def row_graph(op: str, shape: tuple, dtype: DType, dim: int = -1):
    """One kernel-level `op` (a reduction or rms_norm) over `dim` of an input of `shape`."""
    g = Graph(f"{op}_{'x'.join(map(str, shape))}_{dtype.name}")
    x = g.input("x", shape, dtype)
    if op == "rms_norm":
        g.op(op, x, dim=dim, eps=1e-6)
    else:
        g.op(op, x, dim=dim, keepdim=False)
    return g.build()


def _lowered(op: str, shape: tuple, dtype: DType, dim: int = -1) -> tuple:
    node = row_graph(op, shape, dtype, dim).nodes[0]
    loop = kernel_row_loop(node)
    return loop, loop.threads(), row_kernel_grid(node)


def test_few_long_rows_get_a_block_each():
    """8 rows of 8192: a block of 512 threads per row, 16-byte loads (8 f16 or 4 f32 elements), the
    row's 16 elements a lane kept in registers."""
    assert _lowered("rms_norm", (8, 8192), f16) == (RowLoop(512, 8, True), 512, (8, 1, 1))
    assert _lowered("sum", (8, 8192), f32) == (RowLoop(512, 4, True), 512, (8, 1, 1))
    assert _lowered("max", (2, 4, 8192), bf16) == (RowLoop(512, 8, True), 512, (8, 1, 1))


def test_many_short_rows_keep_a_warp_each():
    """4096 rows of 128: a warp per row as before, 8 rows a block of 256 threads, 4 elements a lane in one load."""
    assert _lowered("rms_norm", (4096, 128), f16) == (RowLoop(32, 4, True), 256, (512, 1, 1))
    assert _lowered("mean", (4096, 128), f32) == (RowLoop(32, 4, True), 256, (512, 1, 1))


def test_lanes_grow_past_a_warp_where_a_row_would_not_fit_a_lanes_registers():
    # rows enough to fill the GPU with a warp each, but 8192 / 32 elements a lane: 256 lanes, 32 elements
    assert _lowered("rms_norm", (4096, 8192), f16)[0] == RowLoop(256, 8, True)
    # a warp each fills the GPU and keeps 32 elements a lane
    assert _lowered("rms_norm", (4096, 1024), f16)[0] == RowLoop(32, 8, True)
    # a row too long for a block's registers: read again for the write
    assert _lowered("rms_norm", (1, 32768), f16)[0] == RowLoop(512, 8, False)


def test_loads_are_as_wide_as_the_rows_length_allows():
    assert _lowered("rms_norm", (8, 8190), f16)[0] == RowLoop(512, 2, True)     # 2 elements: 4 bytes
    assert _lowered("sum", (7, 33), f16)[0] == RowLoop(32, 1, True)            # odd: an element a load
    assert _lowered("sum", (16, 1000), f32)[0] == RowLoop(128, 4, True)        # 250 loads over 128 lanes
    assert _lowered("sum", (2, 3), f32)[0] == RowLoop(2, 1, True)


def test_a_reduction_over_a_leading_dim_reads_a_row_a_thread():
    """The rows are the contiguous ones: neighbouring threads read neighbouring elements."""
    assert _lowered("sum", (16, 64, 32), f16, dim=0) == (RowLoop(1, 1, True), 256, (8, 1, 1))
    assert _lowered("rms_norm", (64, 8, 32), f32, dim=0)[0] == RowLoop(1, 1, False)


#: (op, shape, dtype) -> (16-byte loads, 16-byte stores) in the kernel's SASS
_WIDE = {
    ("rms_norm", (8, 8192), f16): (2, 2),     # each lane's 16 elements read once, written from registers
    ("rms_norm", (8, 8192), f32): (4, 4),
    ("sum", (8, 8192), bf16): (2, 0),
    ("rms_norm", (1, 32768), f16): (8, 4),    # not resident: read again for the write
}
_COMPILED = [*_WIDE, ("rms_norm", (4096, 128), f16), ("max", (4096, 128), f32), ("rms_norm", (8, 8190), bf16),
             ("mean", (7, 33), f16), ("sum", (4096, 8192), f16)]


def _case_id(case: tuple) -> str:
    op, shape, dtype = case
    return f"{op}-{'x'.join(map(str, shape))}-{dtype.name}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", _COMPILED, ids=_case_id)
def test_row_kernels_compile_for_sm_90a_without_spills(backend, case):
    op, shape, dtype = case
    program = emit(backend, row_graph(op, shape, dtype))
    (launch,) = program.launches
    r = module(backend, program).resources[launch.name]
    assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, f"{case}: {r}"
    assert r.registers * launch.block[0] <= 65536


@needs_nvdisasm
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(_WIDE, key=_case_id), ids=_case_id)
def test_the_sass_reads_rows_in_16_byte_loads_and_meets_the_warps_in_shared_memory(backend, case):
    op, shape, dtype = case
    program = emit(backend, row_graph(op, shape, dtype))
    (launch,) = program.launches
    instructions = kernel_instructions(module(backend, program).cubin)[launch.name]
    loads = [i for i in instructions if i.startswith("LDG")]
    stores = [i for i in instructions if i.startswith("STG")]
    assert loads == ["LDG.E.128.CONSTANT"] * _WIDE[case][0], loads
    assert sum(1 for i in stores if i.startswith("STG.E.128")) == _WIDE[case][1], stores
    assert sum(1 for i in instructions if i.startswith("BAR.SYNC")) == 2   # the warps' results met, then read


@pytest.mark.parametrize("backend", ["cuda", "ptx"])
def test_the_row_ops_are_the_ones_each_backend_lowers_as_rows(backend):
    """ROW_OPS (which the cost model launches on `row_kernel_grid`) are the ops whose kernel-level rule is
    a reduction or a norm."""
    import importlib

    rules = importlib.import_module(f"mdsl.backend.{backend}.rules")
    table = rules.CUDA_RULES if backend == "cuda" else rules.PTX_RULES
    row_rules = (rules.Reduction, rules.RmsNorm)
    assert {op for op in ROW_OPS if isinstance(table[op], row_rules)} == ROW_OPS
    assert all(not isinstance(table[op], row_rules) for op in table if op not in ROW_OPS)


def test_the_cost_model_counts_the_row_kernels_blocks():
    """8 rows take 8 blocks of the 132 SMs; 4096 rows fill the device."""
    few, many = (kernel_costs(row_graph("rms_norm", shape, f16))[0] for shape in ((8, 8192), (4096, 128)))
    assert (few.blocks, many.blocks) == (8, H200.sms)
    assert few.seconds > H200.launch_s + few.dram_bytes / H200.dram_bytes_per_s

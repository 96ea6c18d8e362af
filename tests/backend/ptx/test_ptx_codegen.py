"""LLVM IR emission of the PTX backend: the NVVM features the kernels are made of (address spaces,
special registers, barriers, warp shuffles, 16-bit conversions, 16-byte vector accesses), the op markers,
and the IR builder's folding. What both backends emit alike: tests/backend/test_codegen.py."""
from __future__ import annotations

import re

import pytest

from mdsl.backend.ptx import emit_llvm, llvm_to_ptx
from mdsl.ir import bf16, f16, f32
from mdsl.lowering.names import OP_MARKER
from mdsl.lowering.options import CudaOptions
from tests.backend.cuda.builder import Graph
from tests.backend.cuda.coverage import coverage_graphs


def _ptx(graph) -> str:
    return llvm_to_ptx(emit_llvm(graph).llvm_ir)


@pytest.mark.timeout(60)
def test_kernels_are_entries_marked_with_their_ops_and_launch_bounds():
    graph = coverage_graphs()["accumulators_f16"]
    program = emit_llvm(graph)
    ptx = llvm_to_ptx(program.llvm_ir)
    for launch, node in zip(program.launches, program.graph.nodes):
        entry = ptx.index(f".visible .entry {launch.name}(")
        body = ptx[entry:ptx.index("\n}", entry)]
        assert f".maxntid {launch.block[0]}" in body
        markers = [line.split(OP_MARKER, 1)[1] for line in body.splitlines() if OP_MARKER in line]
        assert markers[0].startswith(f"%{node.outputs[0].name}") and f"= {node.op}(" in markers[0]
        # every block-level op of the custom kernel has its marker, in the schedule's order
        assert {m.split(" = ")[1].split("(")[0] for m in markers[1:]} >= {n.op for n in node.body.nodes}


@pytest.mark.timeout(60)
def test_block_kernels_use_shared_memory_barriers_and_warp_shuffles():
    ptx = _ptx(coverage_graphs()["accumulators_f16"])
    assert ".extern .shared .align 16 .b8 mdsl_smem[]" in ptx
    assert re.search(r"ld\.shared\.", ptx) and re.search(r"st\.shared\.", ptx)
    assert re.search(r"bar\.sync\s+0;", ptx)
    assert re.search(r"shfl\.sync\.bfly\.b32", ptx)                 # row reductions across lanes
    assert re.search(r"mov\.u32\s+%r\d+, %tid\.x", ptx) and "%ctaid.x" in ptx


@pytest.mark.timeout(60)
def test_16_byte_copies_between_global_and_shared_memory():
    g = Graph("wide_copies")
    x = g.input("x", (64, 128), f16)
    b = g.block(grid=(4,), forloop=2)
    b.output(b.op("accum", b.input(x, imap=(0,), fmap=1)), omap=(0,))
    b.done()
    graph = g.build()
    # (streamed, the loop would read device memory straight into registers: no copies)
    synchronous = llvm_to_ptx(emit_llvm(graph, options=CudaOptions(stages=1, stream=False)).llvm_ir)
    # 8 elements (16 bytes) at a time, through the read-only data path (an input: ld.global.nc)
    assert re.search(r"ld\.global\.nc\.v4\.(b|u)32", synchronous), "f16 rows of 64 are read 16 bytes at a time"
    assert re.search(r"st\.shared\.v4\.(b|u)32", synchronous) and "cp.async" not in synchronous
    pipelined = llvm_to_ptx(emit_llvm(graph, options=CudaOptions(stages=2, stream=False)).llvm_ir)   # no register in between
    assert re.search(r"cp\.async\.cg\.shared\.global \[%rd?\d+(\+\d+)?\], \[%rd\d+(\+\d+)?\], 16;", pipelined)
    assert "cp.async.commit_group;" in pipelined and re.search(r"cp\.async\.wait_group\s+1;", pipelined)
    assert not re.search(r"ld\.global(\.nc)?\.v4", pipelined)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype, load, store", [(f16, r"cvt\.f32\.f16", r"cvt\.rn\.f16\.f32"),
                                                (bf16, r"cvt\.f32\.bf16", r"cvt\.rn\.bf16\.f32")])
def test_16_bit_values_are_computed_in_f32(dtype, load, store):
    g = Graph(f"convert_{dtype.name}")
    x = g.input("x", (8, 96), dtype)
    g.op("gelu", x)
    ptx = _ptx(g.build())
    assert re.search(load, ptx) and re.search(store, ptx)
    assert re.search(r"fma\.rn\.f32", ptx)        # the polynomial of erf, in f32


@pytest.mark.timeout(60)
def test_kernel_level_matmul_tiles_through_static_shared_memory():
    g = Graph("gemm")
    g.op("matmul", g.input("a", (3, 40, 96), f32), g.input("b", (96, 72), f32))
    program = emit_llvm(g.build())
    (launch,) = program.launches
    assert launch.grid == (2, 1, 3) and launch.block == (256, 1, 1) and launch.smem_bytes == 0
    ptx = llvm_to_ptx(program.llvm_ir)
    assert re.search(r"\.shared \.align 16 \.b8 gemm_matmul_a\[\d+\]", ptx) and "%ctaid.z" in ptx


def _kernel_function(params: int = 1):
    from mdsl.backend.ptx.llvm import KernelFunction, ModuleBuilder

    return KernelFunction(ModuleBuilder("folding"), "k", params, 64)


def test_the_builder_folds_constants_and_identities_as_it_writes():
    from mdsl.backend.ptx.llvm import f32, i32

    fn = _kernel_function()
    b, tid = fn.b, fn.sreg("tid.x")
    assert b.add(i32(2), i32(3)).constant == 5 and b.mul(i32(4), i32(8)).constant == 32
    assert b.udiv(i32(17), i32(4)).constant == 4 and b.urem(i32(17), i32(4)).constant == 1
    assert b.add(tid, i32(0)) is tid and b.mul(tid, i32(1)) is tid and b.mul(tid, i32(0)).constant == 0
    assert b.icmp_unsigned("<", i32(3), i32(4)).constant == 1
    assert b.select(b.icmp_unsigned("<", i32(5), i32(4)), tid, i32(7)).constant == 7
    assert b.sub(i32(1), i32(2)).opname == "sub"          # a negative result stays an instruction
    x = fn.var(f32(1.5)).get()
    quarter = b.fdiv(x, f32(4.0))                        # exact: a multiply by 2^-2
    assert quarter.opname == "fmul" and quarter.operands[1].constant == 0.25
    assert b.fdiv(x, f32(3.0)).opname == "fdiv"          # not a power of two: a true division


def test_a_constant_part_of_an_offset_becomes_an_address_immediate_and_unrolled_offsets_share_one_base():
    from mdsl.backend.ptx.llvm import Array, i32

    fn = _kernel_function()
    b, tid = fn.b, fn.sreg("tid.x")
    tile = Array(fn.params[0], "f16", (16, 64), (72, 1))   # rows padded to 72 elements
    at = fn.address(tile, b.add(b.add(tid, i32(8)), i32(4)))
    assert at.opname == "getelementptr" and at.operands[1].constant == 12          # (tile + tid) + 12
    assert at.operands[0].operands[1].opname == "zext"
    # elements tid and tid + 128 of a loop over 16 x 64 (128 = 2 rows): one offset computed, plus 2 rows
    first = fn.offset(tid, (16, 64), tile)
    assert first.opname == "add"    # (tid / 64) * 72 + tid % 64
    later = fn.offset(b.add(tid, i32(128)), (16, 64), tile)
    assert later.opname == "add" and later.operands[0] is first and later.operands[1].constant == 2 * 72
    ragged = fn.offset(b.add(tid, i32(100)), (16, 64), tile)   # not whole rows: computed in full
    assert first not in ragged.operands and ragged.opname == "add"

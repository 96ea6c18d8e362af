"""The PTX backend's kernels against the CUDA backend's, instruction by instruction, without a GPU: for
every benchmark case's plan (.plans, else its guided plan), under the default options and under the
256-thread blocks the autotuner picks for most cases, both backends' cubins for sm_90a are disassembled
and each PTX kernel must take the CUDA kernel's paths: global loads of inputs through the read-only
data path (LDG...CONSTANT, from `!invariant.load`), exp as one MUFU.EX2 (CUDA's expf, not a
polynomial: no FRND / F2I), converted stores of whole vectors (no 16-bit global stores where CUDA has
none), and at most 10% more SASS instructions than the CUDA kernel; the same for the autotuner's
tuned picks the PTX backend runs slower (tests/backend/ptx/plans.py: skinny loops, LoRA), with no spills
and at most 10% more registers; and, launched to overlap their predecessors (CudaOptions.overlap), the
same waits for the previous kernel with no global access before them. Plus IR-level checks of the row loops' unrolling, of the vector stores
and of the mma K loops of warps that lack their last tile."""
from __future__ import annotations

import functools
import re

import pytest

from mdsl import f16, f32
from mdsl.backend.cuda import compile_cuda, emit_cuda
from mdsl.backend.cuda.nvrtc import nvdisasm_path
from mdsl.backend.ptx import assembler, emit_llvm
from mdsl.lowering.options import CudaOptions
from tests.backend.acceptance import assembled_module
from tests.backend.backends import kernel_instructions
from tests.backend.cuda.builder import Graph
from tests.backend.ptx.plans import case_names, lora_tuned, plan_graph, tuned_plans

pytestmark = pytest.mark.shared_compile_cache   # PTX and cubins compiled once per session (tests/shared.py)

ARCH = "sm_90a"
OPTIONS = {"default": CudaOptions(), "256 threads": CudaOptions(threads=256)}
MORE_INSTRUCTIONS = 1.10   # the PTX kernel's SASS instructions over the CUDA kernel's, at most
MORE_REGISTERS = 1.10      # its registers over the CUDA kernel's (the tuned plans), at most

needs_tools = pytest.mark.skipif(assembler() is None or nvdisasm_path() is None,
                                 reason="no PTX assembler or no nvdisasm here: the SASS cannot be read")


@functools.lru_cache(maxsize=64)
def both_backends(case: str, option_name: str) -> tuple:
    graph, options = plan_graph(case), OPTIONS[option_name]
    cuda = kernel_instructions(compile_cuda(emit_cuda(graph, arch=ARCH, options=options).source, arch=ARCH).cubin)
    ptx = kernel_instructions(assembled_module(emit_llvm(graph, arch=ARCH, options=options).llvm_ir)[1].cubin)
    # (the PTX cubin may hold subroutines beside the kernels: the division's slow path)
    assert set(cuda) <= set(ptx), "both backends launch the same kernels"
    return cuda, ptx


def count_matching(instructions: list, pattern: str) -> int:
    """How many of the instructions match the pattern (whole opcodes with their modifiers)."""
    return sum(1 for op in instructions if re.fullmatch(pattern, op))


def assert_same_paths(where: str, theirs: list, ours: list) -> None:
    """A PTX kernel's SASS instructions against the CUDA kernel's: the same data paths (global loads on the
    read-only path but where the CUDA kernel's are not: a combine in its split's launch reads the partials the
    launch wrote), no more than MORE_INSTRUCTIONS times as many instructions."""
    def writable(instructions: list) -> int:
        return len([op for op in instructions if op.startswith("LDG.") and "CONSTANT" not in op])

    assert writable(ours) <= writable(theirs), \
        f"{where}: {writable(ours)} global loads outside the read-only data path, CUDA {writable(theirs)}"
    if count_matching(theirs, r"MUFU\.EX2"):
        assert count_matching(ours, r"MUFU\.EX2") and not count_matching(ours, r"FRND.*|F2I.*"), \
            f"{where}: exp is not CUDA's expf (one MUFU.EX2)"
    if not count_matching(theirs, r"STG\.E\.U16"):
        assert not count_matching(ours, r"STG\.E\.U16"), f"{where}: 16-bit global stores where CUDA stores vectors"
    assert not count_matching(ours, r"(LDL|STL).*"), f"{where}: local memory"
    assert len(ours) <= MORE_INSTRUCTIONS * len(theirs), \
        f"{where}: {len(ours)} SASS instructions, the CUDA kernel {len(theirs)}"


@needs_tools
@pytest.mark.parametrize("option_name", list(OPTIONS))
@pytest.mark.parametrize("case", case_names())
def test_ptx_kernels_take_the_cuda_kernels_paths(case, option_name):
    cuda, ptx = both_backends(case, option_name)
    for kernel, theirs in cuda.items():
        assert_same_paths(f"{case} ({option_name}) {kernel}", theirs, ptx[kernel])


@functools.lru_cache(maxsize=8)
def tuned_modules(name: str) -> tuple:
    """The CUDA and PTX modules (with their resources) of a tuned plan, and their kernels' SASS."""
    graph, options = tuned_plans()[name]
    cuda = compile_cuda(emit_cuda(graph, arch=ARCH, options=options).source, arch=ARCH)
    ptx = assembled_module(emit_llvm(graph, arch=ARCH, options=options).llvm_ir)[1]
    return cuda, ptx, kernel_instructions(cuda.cubin), kernel_instructions(ptx.cubin)


@needs_tools
@pytest.mark.parametrize("name", sorted(tuned_plans()))
def test_tuned_plans_take_the_cuda_kernels_paths(name):
    """The autotuner's picks that the PTX backend runs slower than the CUDA backend
    (skinny loops, LoRA): the same paths, no spills, at most MORE_REGISTERS times the registers."""
    cuda, ptx, theirs, ours = tuned_modules(name)
    for kernel in theirs:
        where = f"tuned {name} {kernel}"
        assert_same_paths(where, theirs[kernel], ours[kernel])
        r, cr = ptx.resources[kernel], cuda.resources[kernel]
        assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, f"{where}: {r}"
        assert r.registers <= MORE_REGISTERS * cr.registers, f"{where}: {r.registers} registers, CUDA {cr.registers}"


#: a SASS instruction that reads or writes global memory (what an overlapping kernel must not issue before
#: its wait for the previous kernel, ACQBULK)
GLOBAL_ACCESS = r"(LDG|STG|LD|ST|ATOM|RED)\..*|LDGSTS.*"


def assert_waits_before_global_access(where: str, theirs: list, ours: list) -> None:
    """The wait for the previous kernel (ACQBULK) and the launch of the next (PREEXIT) as often as in the
    CUDA kernel, no global memory touched before the wait, and the same L2 prefetches before it."""
    for pattern in (r"ACQBULK", r"PREEXIT"):
        assert count_matching(ours, pattern) == count_matching(theirs, pattern), \
            f"{where}: {count_matching(ours, pattern)} {pattern}, CUDA {count_matching(theirs, pattern)}"
    if "ACQBULK" in theirs:
        before, cudas = ours[:ours.index("ACQBULK")], theirs[:theirs.index("ACQBULK")]
        assert not count_matching(before, GLOBAL_ACCESS), f"{where}: global memory touched before the wait"
        assert count_matching(before, r"CCTL\.E\.PF2") == count_matching(cudas, r"CCTL\.E\.PF2"), \
            f"{where}: not the CUDA kernel's L2 prefetches before the wait"


@needs_tools
@pytest.mark.parametrize("case", case_names())
def test_overlapping_kernels_wait_before_touching_memory(case):
    """CudaOptions.overlap (programmatic dependent launch): every custom kernel launched to overlap its
    predecessor, as the CUDA backend's, waiting for it before any global access."""
    graph, options = plan_graph(case), CudaOptions(overlap=True)
    cuda_program, program = emit_cuda(graph, arch=ARCH, options=options), emit_llvm(graph, arch=ARCH, options=options)
    assert [(launch.name, launch.overlap) for launch in program.launches] == \
        [(launch.name, launch.overlap) for launch in cuda_program.launches]
    assert any(launch.overlap for launch in program.launches)
    theirs = kernel_instructions(compile_cuda(cuda_program.source, arch=ARCH).cubin)
    ours = kernel_instructions(assembled_module(program.llvm_ir)[1].cubin)
    for kernel in theirs:
        assert_waits_before_global_access(f"{case} (overlap) {kernel}", theirs[kernel], ours[kernel])


def test_a_warp_without_its_last_mma_tile_runs_a_k_loop_of_its_own():
    """LoRA's tuned blocks: 2 mma tiles a matmul on 4 warps. The check that a warp has its tile wraps the
    whole K loop (as the CUDA backend's), not each K step: a loop body holds MMA_IN_FLIGHT steps' operand
    loads and mmas with no branch between them (ptxas issues the loads of several steps ahead)."""
    from mdsl.backend.ptx.mma import MMA_IN_FLIGHT

    kernel = _kernel_ir(emit_llvm(lora_tuned(k=256, columns=32), options=CudaOptions(stages=1)).llvm_ir)
    bodies = [body for body in _loop_bodies(kernel) if "mma.sync" in body]
    assert bodies and all(body.count("mma.sync") == MMA_IN_FLIGHT for body in bodies)


def _rms_norm_block(length: int) -> object:
    g = Graph("row_loops")
    x = g.input("x", (4, length), f32)
    b = g.block(grid=(4,), forloop=1, threads=32)
    b.output(b.op("accum", b.op("rms_norm", b.input(x, imap=(0,)), dim=1, eps=1e-6)), omap=(0,))
    b.done()
    return g.build()


def _kernel_ir(llvm_ir: str) -> str:
    start = llvm_ir.index("define ptx_kernel")
    return llvm_ir[start:llvm_ir.index("\n}\n", start)]


def _loop_bodies(kernel_ir: str) -> list:
    """The text of each `body` block of the kernel (a loop's body, up to the next block)."""
    return re.findall(r"^body\.\d+:\n(.*?)(?=^\S)", kernel_ir + "\nend:", re.MULTILINE | re.DOTALL)


def test_row_loops_are_unrolled_four_times_as_the_cuda_backends():
    """rms_norm's fold (the sum of squares) and its scaling loop: 4 rows' elements a trip (CUDA: #pragma
    unroll 4), whole groups unguarded (1024 elements over 32 lanes: 32 trips, a multiple of 4)."""
    kernel = _kernel_ir(emit_llvm(_rms_norm_block(1024), options=CudaOptions(stages=1)).llvm_ir)
    bodies = _loop_bodies(kernel)
    folds = [body for body in bodies if 'call float @"llvm.fma.f32"' in body]
    scales = [body for body in bodies if "fmul" in body and "store float" in body]
    assert folds and all(body.count('@"llvm.fma.f32"') == 4 for body in folds)
    assert scales and all(body.count("store float") == 4 for body in scales)
    assert all("then." not in body for body in folds + scales), "whole groups need no guard"


def test_converted_copies_store_whole_vectors():
    """An f32 tile stored to an f16 output 8 elements at a time: converted in registers, one 16-byte
    store (the CUDA backend's mdsl::copy), not 8 stores of 2 bytes."""
    g = Graph("converted_store")
    x = g.input("x", (8, 64), f16)
    b = g.block(grid=(1,), forloop=1, threads=64)
    b.output(b.op("accum", b.op("exp", b.input(x, imap=(None,)))), omap=(None,))   # an f32 tile
    b.done()
    graph = g.build()
    kernel = _kernel_ir(emit_llvm(graph, options=CudaOptions(stages=1)).llvm_ir)
    assert re.search(r"store <8 x half> %t\d+, ptr addrspace\(1\) %t\d+, align 16", kernel)
    assert not re.search(r"store half .*addrspace\(1\)", kernel)

"""The PTX backend's skinny loop (mdsl/backend/ptx/skinny.py, the CUDA backend's `mdsl::Skinny`):

* which kernels take it (those `skinny_plan` qualifies, under `CudaOptions(skinny=True)` only):
  tests/backend/test_skinny_loop.py, with the CUDA backend's;
* its numbers on the CPU simulator (tests/backend/ptx/simulator.py executes the streamed loads, the byte
  permutes and mma.sync as the PTX ISA defines them) against the reference, over the shapes that change
  its code: X of 2, 3 and 16 rows (one or two 8-row tiles, rows past M), one or two column groups, 16-
  and 8-byte loads, a warp's lanes duplicating chunks, two weights, the steady loop with and without
  the last slabs after it, row accumulators (accum_rms, accum_sum) and none, f16 and bf16, prologues of
  X alone and of X and vectors along K (`(x - b) @ w`, `(x * g) @ w`), the vectors loaded at X's k (a
  vector loaded at another k is caught);
* its SASS against the CUDA backend's on the autotuner's tuned skinny plans (RMSNorm + Linear at
  batch 1 and 8, Gated MLP, at the benchmark's sizes): the same 16-byte no-allocate weight loads, mmas,
  X's 8-byte loads, byte permutes, L2 prefetches, barriers and shuffles (test_ptx_parity.py checks the
  data paths, spills, registers and instruction counts of the same kernels);
* the kernel overlapping its predecessor (programmatic dependent launch): its numbers on the simulator,
  and the same launches and, in the SASS, the same fences and wait for the previous kernel (nothing but
  L2 prefetches and shared-memory stores before it) as the CUDA kernels;
* steps of two slabs (`CudaOptions.wide_x`: X's fragments in 16-byte loads, 8 weight rows a lane): its
  numbers on the simulator, and in the SASS the CUDA kernel's loads, mmas and L2 prefetches.
"""
from __future__ import annotations

import functools
import re

import attrs
import pytest

from mdsl import bf16, f16
from mdsl.backend.cuda import compile_cuda, emit_cuda
from mdsl.backend.ptx import emit_llvm
from mdsl.lowering.options import CudaOptions
from tests.backend.acceptance import assembled_module
from tests.backend.backends import kernel_instructions
from tests.backend.cuda.builder import Graph
from tests.backend.ptx.plans import gated_mlp_skinny, rms_norm_linear_skinny, tuned_skinny_plans
from tests.backend.ptx.test_ptx_parity import (ARCH, assert_same_paths, assert_waits_before_global_access, count_matching,
                                               needs_tools, tuned_modules)
from tests.backend.ptx.test_ptx_simulated import check_simulated
from tests.backend.ptx.test_ptx_simulated import pytestmark as needs_simulator

pytestmark = pytest.mark.shared_compile_cache   # PTX and cubins compiled once per session (tests/shared.py)

SKINNY = CudaOptions(skinny=True)
STREAMED = "ld.global.nc.L1::no_allocate"


def _row_sums(rows: int, k: int, columns: int, blocks: int, forloop: int, threads: int = 128) -> object:
    """rms_norm_linear's loop with an accum_sum of X beside the accum_rms: two row folds."""
    g = Graph(f"skinny_row_sums_{rows}x{k}x{columns}")
    x, w = g.input("x", (rows, k), f16), g.input("w", (k, columns), f16)
    b = g.block(grid=(blocks,), forloop=forloop, threads=threads)
    xt, wt = b.input(x, imap=(None,), fmap=1), b.input(w, imap=(1,), fmap=0)
    total, norm = b.op("accum_sum", xt), b.op("accum_rms", xt, eps=1e-6)
    s = b.op("accum", b.op("matmul", xt, wt))
    b.output(b.op("add", b.op("div", s, norm), total), omap=(1,))
    b.done()
    return g.build()


def _prologue(rows: int, k: int, columns: int, blocks: int, forloop: int, dtype=f16, norm: bool = True) -> object:
    """rms_norm(silu(2 x)) @ w (`norm`), else exp(x / 8) @ w: the operand computed from X by a prologue."""
    g = Graph(f"skinny_prologue_{rows}x{k}x{columns}_{'norm' if norm else 'exp'}")
    x, w = g.input("x", (rows, k), dtype), g.input("w", (k, columns), dtype)
    b = g.block(grid=(blocks,), forloop=forloop)
    xt, wt = b.input(x, imap=(None,), fmap=1), b.input(w, imap=(1,), fmap=0)
    if norm:
        a = b.op("silu", b.op("mul_scalar", xt, value=2.0))
        b.output(b.op("div", b.op("accum", b.op("matmul", a, wt)), b.op("accum_rms", a, eps=1e-6)), omap=(1,))
    else:
        a = b.op("exp", b.op("mul_scalar", xt, value=0.125))
        b.output(b.op("accum", b.op("matmul", a, wt)), omap=(1,))
    b.done()
    return g.build()


def _vector_prologue(rows: int, k: int, columns: int, blocks: int, forloop: int, op: str, dtype=f16,
                     rank: int = 2, norm: bool = False) -> object:
    """(x op b) @ w, b a vector along K ([1, K], or [K] at `rank` 1) broadcast over X's rows; `norm`: with
    the row fold of the operand (rms_norm(x op b) @ w)."""
    g = Graph(f"skinny_vector_{op}_{rows}x{k}x{columns}_{dtype.name}_rank{rank}{'_norm' if norm else ''}")
    x, w = g.input("x", (rows, k), dtype), g.input("w", (k, columns), dtype)
    v = g.input("b", (1, k) if rank == 2 else (k,), dtype)
    b = g.block(grid=(blocks,), forloop=forloop)
    xt, wt = b.input(x, imap=(None,), fmap=1), b.input(w, imap=(1,), fmap=0)
    a = b.op(op, xt, b.input(v, imap=(None,), fmap=rank - 1))
    s = b.op("accum", b.op("matmul", a, wt))
    b.output(b.op("div", s, b.op("accum_rms", a, eps=1e-6)) if norm else s, omap=(1,))
    b.done()
    return g.build()


#: small skinny programs, each changing the loop's code: (graph, threads)
SIMULATED = {
    # 2 rows, 64 columns a block (8 chunks of 16 bytes, one group), 4 warps along K; K = 640 a block:
    # 40 slabs, the steady loop twice, then the last slabs
    "rows-2-tail": (rms_norm_linear_skinny(2, 2, columns=128, blocks=2, k=640), None),
    # 16 rows (two 8-row tiles of X), bf16, 8 warps along K, K = 512 (no slab after the steady loop)
    "rows-16-bf16-threads-256": (rms_norm_linear_skinny(16, 4, columns=128, blocks=2, k=512, dtype=bf16), 256),
    # 3 rows (rows past M in the tile), 128 columns a block: two column groups, 2 warps along K each
    "rows-3-two-groups": (rms_norm_linear_skinny(3, 4, columns=256, blocks=2, k=256), None),
    # 32 columns a block: 8-byte loads (8 chunks of 4 columns); 16 columns: 4 chunks, lanes duplicating
    "8-byte-loads": (rms_norm_linear_skinny(4, 2, columns=64, blocks=2, k=384), None),
    "duplicated-chunks": (rms_norm_linear_skinny(5, 2, columns=32, blocks=2, k=256), None),
    # two weights (one slab a step), no row accumulator, then a second kernel
    "two-weights": (gated_mlp_skinny(rows=8, k=512, columns=128, blocks=2, splits=2, forloop=4), None),
    "row-sums": (_row_sums(6, 512, 128, 2, 4), None),
    # a prologue computing the operand from X, with the row fold of its values and without a fold; bf16
    "prologue-norm": (_prologue(5, 512, 128, 2, 4), None),
    "prologue-exp-bf16": (_prologue(16, 384, 64, 2, 3, dtype=bf16, norm=False), None),
    # a prologue reading a vector along K: (x - b) @ w and (x * g) @ w in f16 and bf16, b [1, K] and g [K];
    # 16 rows (two tiles of X, one vector fragment for both) with the row fold of the operand
    "vector-sub": (_vector_prologue(5, 512, 128, 2, 4, "sub"), None),
    "vector-sub-bf16": (_vector_prologue(3, 384, 64, 2, 3, "sub", dtype=bf16), None),
    "vector-mul": (_vector_prologue(4, 512, 64, 2, 4, "mul", rank=1), None),
    "vector-mul-bf16-norm": (_vector_prologue(16, 384, 64, 2, 3, "mul", dtype=bf16, rank=1, norm=True), None),
    # weights stored [N, K] (a linear layer's [out, in]), loaded along K: 16- and 8-byte chunks, two weights
    "transposed-rows-2-tail": (rms_norm_linear_skinny(2, 2, columns=128, blocks=2, k=640, transposed=True), None),
    "transposed-8-byte-loads-bf16": (rms_norm_linear_skinny(4, 2, columns=64, blocks=2, k=384, dtype=bf16,
                                                            transposed=True), None),
    "transposed-two-weights": (gated_mlp_skinny(rows=8, k=512, columns=128, blocks=2, splits=2, forloop=4,
                                                transposed=True), None),
}


def _options(threads) -> CudaOptions:
    return CudaOptions(skinny=True, threads=threads)


@needs_simulator
@pytest.mark.parametrize("name", sorted(SIMULATED))
def test_skinny_loop_numbers_on_the_simulator(name):
    graph, threads = SIMULATED[name]
    options = _options(threads)
    assert STREAMED in emit_llvm(graph, options=options).llvm_ir, f"{name}: not lowered as a skinny loop"
    check_simulated(graph, seed=11, options=options)


@needs_simulator
@pytest.mark.parametrize("name", ["vector-sub", "vector-mul-bf16-norm"])
def test_a_vector_loaded_at_another_k_is_caught(name, monkeypatch):
    """Each lane loading the vector's elements of lane t = 0 (its first 4 of every slab) instead of those at
    its own X fragment's k gives other numbers than the reference: the tests above can fail."""
    from mdsl.backend.ptx import skinny
    from mdsl.backend.ptx.llvm import i32

    built = skinny.SkinnyLoop.__init__

    def misplaced(self, bk, plan, parts, warps, prologue=None):
        built(self, bk, plan, parts, warps, prologue)
        self.vs = [self.fn.address(parts[v], i32(0)) for v in plan.shape.vectors]

    monkeypatch.setattr(skinny.SkinnyLoop, "__init__", misplaced)
    graph, threads = SIMULATED[name]
    assert STREAMED in emit_llvm(graph, options=_options(threads)).llvm_ir, f"{name}: not lowered as a skinny loop"
    with pytest.raises(AssertionError, match="relative error"):
        check_simulated(graph, seed=11, options=_options(threads))


# ---------------------------------------------------------------------------------------------
# SASS against the CUDA backend's (the same paths, registers and spills: test_ptx_parity.py)

#: mmas and weight loads of the PTX kernel against the CUDA kernel's: LLVM drops the last slabs' code
#: where the steady loop's exit proves them past K (rms_norm_linear: 1 slab of 8 in the tail), nvcc keeps it
FEWER_SLABS = 0.85


@needs_tools
@pytest.mark.parametrize("name", sorted(tuned_skinny_plans()))
def test_skinny_kernels_match_the_cuda_kernels_sass(name):
    _, _, theirs_by_kernel, ours_by_kernel = tuned_modules(name)
    skinny_kernels = [k for k, ins in theirs_by_kernel.items() if count_matching(ins, r"LDG\.E\.NA\.(64|128)\.CONSTANT")]
    assert skinny_kernels, f"{name}: the CUDA backend ran no skinny loop"
    for kernel in skinny_kernels:
        theirs, ours = theirs_by_kernel[kernel], ours_by_kernel[kernel]
        where = f"{name} {kernel}"
        # weight loads (16 or 8 bytes, no L1 allocation), mmas, X's fragments, the weights' byte permutes
        for pattern in (r"LDG\.E\.NA\.128\.CONSTANT", r"LDG\.E\.NA\.64\.CONSTANT", r"HMMA\.16816\.F32",
                        r"LDG\.E\.64\.CONSTANT", r"PRMT"):
            mine, cudas = count_matching(ours, pattern), count_matching(theirs, pattern)
            assert FEWER_SLABS * cudas <= mine <= cudas, f"{where}: {mine} {pattern}, CUDA {cudas}"
        for pattern in (r"CCTL\.E\.PF2", r"BAR\.SYNC.*", r"SHFL\.BFLY.*"):   # L2 prefetches, barriers, quads
            assert count_matching(ours, pattern) == count_matching(theirs, pattern), \
                f"{where}: {count_matching(ours, pattern)} {pattern}, CUDA {count_matching(theirs, pattern)}"


# ---------------------------------------------------------------------------------------------
# the skinny options: simulated, and their SASS and launches against the CUDA backend's


@needs_simulator
@pytest.mark.parametrize("name", ["rows-2-tail", "rows-3-two-groups", "two-weights"])
def test_staggered_walks_on_the_simulator(name):
    """CudaOptions.stagger: block b of the grid walks its slabs from slab b SLABS / blocks on, wrapping
    around (2 blocks: the second starts half-way; with the two weights' 2 x 2 grid, a quarter apart)."""
    graph, threads = SIMULATED[name]
    check_simulated(graph, seed=13, options=attrs.evolve(_options(threads), stagger=True))


@needs_simulator
@pytest.mark.parametrize("name", ["rows-2-tail", "two-weights"])
def test_a_longer_prefetch_lead_on_the_simulator(name):
    """CudaOptions.lead 4: the L2 prefetches of the iterations up to 4 ahead (clamped to the last slab
    past the end) change no value."""
    graph, threads = SIMULATED[name]
    options = attrs.evolve(_options(threads), lead=4)
    assert emit_llvm(graph, options=options).llvm_ir.count("prefetch.global.L2") > \
        emit_llvm(graph, options=_options(threads)).llvm_ir.count("prefetch.global.L2")
    check_simulated(graph, seed=14, options=options)


#: programs run in steps of two slabs (CudaOptions.wide_x; every K here is whole 32-row pairs), each with
#: what else changes its code: (program, options beside wide_x). M > 8; two weights (one step a buffer)
#: with staggered walks; 8-byte loads (two steps a buffer) with a lead of 4; the row accumulators folding
#: all 4 words of X's fragments, overlapping; lead 0 at an overlapping start (its prefetches alone); a
#: prologue's vectors along K in 16-byte loads, overlapping, and staggered with a row fold; weights stored
#: [N, K], each lane's loads of them 16 bytes along K, overlapping and staggered
WIDE = [("rows-2-tail", {}), ("rows-16-bf16-threads-256", {}), ("two-weights", {"stagger": True}),
        ("8-byte-loads", {"lead": 4}), ("row-sums", {"overlap": True}),
        ("rows-3-two-groups", {"lead": 0, "overlap": True}), ("vector-sub", {"overlap": True}),
        ("vector-mul-bf16-norm", {"stagger": True}), ("transposed-8-byte-loads-bf16", {"overlap": True}),
        ("transposed-two-weights", {"stagger": True, "lead": 0})]


@needs_simulator
@pytest.mark.parametrize("name, extra", WIDE, ids=[name for name, _ in WIDE])
def test_wide_x_steps_on_the_simulator(name, extra):
    """CudaOptions.wide_x: a warp's step spans two 16-row slabs, lane t's rows 8t .. 8t + 7, X's words
    2h, 2h + 1 of one 16-byte load feeding the mmas of slab h."""
    graph, threads = SIMULATED[name]
    options = attrs.evolve(_options(threads), wide_x=True, **extra)
    x_loads = "load <4 x i32>"   # X's 16-byte fragments (the weights' loads are inline asm)
    assert emit_llvm(graph, options=options).llvm_ir.count(x_loads) > \
        emit_llvm(graph, options=attrs.evolve(options, wide_x=False)).llvm_ir.count(x_loads), f"{name}: not wide"
    check_simulated(graph, seed=15, options=options)


@needs_simulator
@pytest.mark.parametrize("name", ["rows-16-bf16-threads-256", "row-sums"])
def test_an_overlapping_start_on_the_simulator(name):
    """CudaOptions.overlap: the simulator runs the kernels one after another, griddepcontrol does nothing;
    what it checks is that the L2 prefetch before the wait changes no value."""
    graph, threads = SIMULATED[name]
    options = attrs.evolve(_options(threads), overlap=True)
    program = emit_llvm(graph, options=options)
    assert STREAMED in program.llvm_ir and any(launch.overlap for launch in program.launches), name
    check_simulated(graph, seed=12, options=options)


@functools.lru_cache(maxsize=16)
def _split(name: str, overlap: bool, stagger: bool, lead: int = 2, wide_x: bool = False) -> tuple:
    graph, options = tuned_skinny_plans()[name]
    options = attrs.evolve(options, overlap=overlap, stagger=stagger, lead=lead, wide_x=wide_x)
    cuda_program, program = emit_cuda(graph, arch=ARCH, options=options), emit_llvm(graph, arch=ARCH, options=options)
    cuda = compile_cuda(cuda_program.source, arch=ARCH)
    ptx = assembled_module(program.llvm_ir)
    return cuda_program, program, cuda, ptx, kernel_instructions(cuda.cubin), kernel_instructions(ptx[1].cubin)


#: (overlap, stagger, lead, wide_x): the kernel overlapping its predecessor (programmatic dependent launch,
#: CudaOptions.overlap), and each block walking K from its own slab on (CudaOptions.stagger) overlapping, as
#: the autotuner may pick it, with the L2 prefetches 0 (the overlapping start's only), 2 or 4 iterations
#: ahead (CudaOptions.lead), and in steps of two slabs (CudaOptions.wide_x)
SPLITS = [(True, False, 2, False), (True, True, 2, False), (True, True, 4, False), (True, False, 0, False),
          (True, True, 2, True)]

#: the skinny loop's instructions the PTX kernel has exactly as often as the CUDA kernel where no slab
#: of the tail is dropped (FEWER_SLABS): weight and X loads, mmas, permutes, L2 prefetches
SKINNY_LOOP = (r"LDG\.E\.NA\.128\.CONSTANT", r"LDG\.E\.NA\.64\.CONSTANT", r"LDG\.E\.128\.CONSTANT",
               r"LDG\.E\.64\.CONSTANT", r"HMMA\.16816\.F32", r"PRMT", r"CCTL\.E\.PF2")


@needs_tools
@pytest.mark.parametrize("overlap, stagger, lead, wide_x", SPLITS)
@pytest.mark.parametrize("name", sorted(tuned_skinny_plans()))
def test_overlap_and_stagger_match_the_cuda_kernels(name, overlap, stagger, lead, wide_x):
    """The same launches (grid, block, shared memory, the overlapping launch), and in the SASS the same
    fences; with overlap the same wait for the previous kernel (ACQBULK) with nothing but L2
    prefetches and shared-memory stores before it, and the same PREEXIT. In steps of two slabs (wide_x:
    every K here is whole pairs of slabs, all three steady loops leave none to the tail) the same
    16-byte loads of the weights and X, mmas, permutes and L2 prefetches as the CUDA kernel."""
    cuda_program, program, cuda, (module, assembled), theirs_by_kernel, ours_by_kernel = \
        _split(name, overlap, stagger, lead, wide_x)
    assert bool(re.search(r"mdsl::Skinny<(?:[^,<>]+, ){12}true>", cuda_program.source)) == wide_x, \
        f"{name}: WIDE_X (mdsl::Skinny's last argument) not as asked"
    launches = [(launch.name, launch.grid, launch.block, launch.smem_bytes, launch.overlap)
                for launch in program.launches]
    assert launches == [(launch.name, launch.grid, launch.block, launch.smem_bytes, launch.overlap)
                        for launch in cuda_program.launches]
    assert any(launch.overlap for launch in program.launches) == overlap
    for kernel, theirs in theirs_by_kernel.items():
        ours, where = ours_by_kernel[kernel], \
            f"{name} (overlap {overlap}, stagger {stagger}, lead {lead}, wide_x {wide_x}) " \
            f"{kernel}"
        assert_same_paths(where, theirs, ours)
        r = assembled.resources[kernel]
        assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, f"{where}: {r}"
        for pattern in (r"MEMBAR\.ALL\.GPU", r"CCTL\.IVALL"):
            assert count_matching(ours, pattern) == count_matching(theirs, pattern), \
                f"{where}: {count_matching(ours, pattern)} {pattern}, CUDA {count_matching(theirs, pattern)}"
        assert_waits_before_global_access(where, theirs, ours)
        for pattern in SKINNY_LOOP if wide_x else (r"CCTL\.E\.PF2",):
            assert count_matching(ours, pattern) == count_matching(theirs, pattern), \
                f"{where}: {count_matching(ours, pattern)} {pattern}, CUDA {count_matching(theirs, pattern)}"


@needs_tools
def test_weights_stored_n_by_k_load_as_the_cuda_kernel_does():
    """A weight stored [N, K] (its rows streamed along K), in steps of two slabs (which leave no slab to the
    tail here): the PTX kernel, whose numbers the simulator checks above, has the CUDA kernel's weight and X
    loads, mmas and permutes (none for the weight's fragments), and neither sends a weight row to L2 ahead."""
    graph = rms_norm_linear_skinny(2, 8, columns=6144, blocks=96, k=4096, transposed=True)
    options = CudaOptions(skinny=True, overlap=True, wide_x=True)
    cuda_program = emit_cuda(graph, arch=ARCH, options=options)
    assert re.search(r"mdsl::Skinny<[^<>]*, true>", cuda_program.source), "WT (mdsl::Skinny's last argument) not set"
    theirs_by_kernel = kernel_instructions(compile_cuda(cuda_program.source, arch=ARCH).cubin)
    ours_by_kernel = kernel_instructions(
        assembled_module(emit_llvm(graph, arch=ARCH, options=options).llvm_ir)[1].cubin)
    for kernel, theirs in theirs_by_kernel.items():
        ours = ours_by_kernel[kernel]
        for pattern in SKINNY_LOOP:
            mine, cuda = count_matching(ours, pattern), count_matching(theirs, pattern)
            assert mine == cuda, f"{kernel}: {mine} {pattern}, CUDA {cuda}"
        assert count_matching(theirs, r"HMMA\.16816\.F32") > 0 and count_matching(theirs, r"CCTL\.E\.PF2") == 0

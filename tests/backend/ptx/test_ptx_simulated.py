"""The PTX backend's kernels computed on the CPU (tests/backend/ptx/simulator.py: the same LLVM IR
compiled for the host, one host thread per GPU thread) against the reference interpreter, on fresh
random inputs, with the GPU tests' tolerances: every element-wise op and reduction in three dtypes,
reductions and norms over few long rows and many short ones, every accumulator, matmuls split every
way, maps on 3-D grids, and the standard kernels; and the fast paths (tensor cores, sums in their
registers, cp.async pipelines, unrolled loops) under each option set, with the simulator executing
mma.sync and cp.async as the PTX ISA defines them."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from mdsl.backend.ptx import emit_llvm
from mdsl.backend.ptx.llvm import KernelFunction
from mdsl.ir import bf16, f16, f32, i32
from mdsl.lowering.options import CudaOptions
from tests.backend.cuda.builder import Graph
from tests.backend.cuda.coverage import coverage_graphs
from tests.backend.cuda.fast_paths import EVERY_OPTION_SET, OPTION_SETS, fast_path_graphs
from tests.backend.ptx import simulator
from tests.backend.ptx.plans import split_attention
from tests.gpu.coverage import coverage_graphs as combination_graphs
from tests.gpu.harness import random_inputs, reference, relative_error, tolerance


def _host_converts_f16() -> bool:
    try:
        import llvmlite.binding as llvm

        return bool(llvm.get_host_cpu_features().get("f16c", False))
    except Exception:  # not an x86 host, or features unknown
        return False


pytestmark = pytest.mark.skipif(not _host_converts_f16(), reason="the simulator needs a host CPU with F16C "
                                "(f16 conversions as instructions)")


def check_simulated(graph, seed: int = 0, positive=(), options=None, copies: str = "wait") -> None:
    inputs = random_inputs(graph, np.random.default_rng(seed), positive)
    want = reference(graph, inputs)
    got = simulator.run(emit_llvm(graph, options=options), inputs, copies=copies)
    tol = tolerance(graph)
    for k, (g, w, var) in enumerate(zip(got, want, graph.outputs)):
        what = f"output {k} %{var.name} {var.type} of {graph.name}"
        if var.dtype is i32:
            assert np.array_equal(g, w), f"{what}: {int((g != w).sum())} integers differ"
            continue
        assert not np.isnan(g).any(), f"{what}: {int(np.isnan(g).sum())} NaN (never written, or computed as NaN)"
        err = relative_error(g, np.asarray(w, dtype=np.float64))
        assert err <= tol, f"{what}: relative error {err:.2e} over {tol:.0e}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [f"{family}_{d}" for family in ("elementwise", "reductions")
                                  for d in ("f16", "bf16", "f32")])
def test_elementwise_and_reductions(name):
    graph = coverage_graphs()[name]
    check_simulated(graph, positive=range(len(graph.inputs)))   # sqrt, rsqrt and reciprocal of inputs


@functools.cache
def _combinations() -> dict:
    """Each accumulator with the rows split and a loop over the columns, every matmul split, and a
    few 3-D grids and permuted omaps."""
    every = combination_graphs(f16)
    chosen = [cid for cid in every if cid.endswith("rows-split-loop-over-cols") or cid.startswith("matmul")]
    chosen += ["accum_sum_rescale-one-block-long-loop", "accum_rescale-loop-over-rows",
               "grid3-imap120-fmap2-omap210", "grid3-imap021-fmap--omap021", "maps-grid2x4-imap10-fmap0-omap01"]
    return {cid: every[cid] for cid in chosen}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case_id", sorted(_combinations()))
def test_custom_kernels(case_id):
    check_simulated(_combinations()[case_id], seed=1)


def _standard_kernels(dtype):
    """One of each kernel-level op on small shapes (ragged against the tiles and the blocks)."""
    g = Graph(f"standard_{dtype.name}")
    a = g.input("a", (2, 40, 24), dtype)
    g.op("matmul", a, g.input("b", (24, 72), dtype))          # a batch against a matrix, ragged tiles
    g.op("matmul", g.input("c", (2, 1, 8, 16), dtype), g.input("d", (3, 16, 8), dtype))   # broadcast batch
    for op, dim in (("sum", 0), ("mean", 2), ("max", 1)):
        g.op(op, a, dim=dim, keepdim=dim == 1)
    g.op("rms_norm", a, dim=1, eps=1e-6)
    g.op("concat", a, g.op("neg", a), dim=2)
    g.ops("split", a, sizes=(10, 30), dim=1)
    as_int = g.op("cast", g.op("mul_scalar", a, value=8.0), dtype=i32)
    g.op("transpose", as_int, perm=(2, 0, 1))
    g.op("sum", g.op("reshape", a, shape=(48, 40)), dim=0)
    return g.build()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", (f16, bf16), ids=lambda d: d.name)   # f32: the custom kernels' outputs
def test_standard_kernels(dtype):
    check_simulated(_standard_kernels(dtype), seed=2)


#: kernel-level reductions and norms (mdsl.lowering.grid.kernel_row_loop): few long rows (a block of 512
#: lanes a row, 16-byte loads, the row resident; a row not a multiple of the widest load; a row read again),
#: many short rows (a warp a row) and ragged ones
_ROW_SHAPES = {"few-long": (8, 8192), "few-long-ragged": (8, 8190), "one-longer-than-registers": (1, 32768),
               "many-short": (512, 128), "ragged": (40, 33), "middle": (2, 1000)}


def _row_kernels(shape: tuple, dtype):
    g = Graph(f"rows_{'x'.join(map(str, shape))}_{dtype.name}")
    x = g.input("x", shape, dtype)
    g.op("rms_norm", x, dim=-1, eps=1e-6)
    for op in ("sum", "mean", "max"):
        g.op(op, x, dim=-1, keepdim=op == "max")
    return g.build()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, dtype", [(n, d) for n in sorted(_ROW_SHAPES) for d in (f16, f32)]
                         + [("few-long-ragged", bf16), ("many-short", bf16)],   # bf16: its conversions differ
                         ids=lambda p: p.name if hasattr(p, "long_name") else p)
def test_row_kernels(name, dtype):
    check_simulated(_row_kernels(_ROW_SHAPES[name], dtype), seed=11)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", (f16, f32), ids=lambda d: d.name)
def test_row_kernels_over_a_leading_dim(dtype):
    """A thread a row, the rows the contiguous ones: a norm's row of 16 kept in registers, one of 64 read again."""
    g = Graph(f"leading_rows_{dtype.name}")
    g.op("rms_norm", g.input("x", (8, 16, 32), dtype), dim=1, eps=1e-6)
    y = g.input("y", (64, 8, 32), dtype)
    g.op("rms_norm", y, dim=0, eps=1e-6)
    g.op("max", y, dim=0, keepdim=True)
    check_simulated(g.build(), seed=12)


def test_row_kernels_that_skip_the_warps_combine_are_caught(monkeypatch):
    """A row of 512 lanes whose warps' results are not combined (each lane keeps its warp's) is wrong."""
    from mdsl.backend.ptx import loops

    monkeypatch.setattr(loops, "warps_reduce", lambda fn, value, lanes, block, combine:
                        loops.group_reduce(fn, value, loops.WARP, combine))
    with pytest.raises(AssertionError, match="relative error"):
        check_simulated(_row_kernels((8, 8192), f32), seed=11)


def test_a_kernel_that_writes_nothing_is_caught():
    """The simulator starts every buffer as NaN: an output no kernel writes cannot pass."""
    g = Graph("two_kernels")
    x = g.input("x", (8, 32), f32)
    g.op("neg", x)
    g.op("exp", x)
    graph = g.build()
    program = emit_llvm(graph)
    skipped = type(program)(program.llvm_ir, program.launches[1:], program.aliases, program.graph, program.arch)
    got = simulator.run(skipped, random_inputs(graph, np.random.default_rng(0)))
    assert np.isnan(got[0]).all() and not np.isnan(got[1]).any()


# ---------------------------------------------------------------------------------------------
# the fast paths

_FAST_OPTIONS = ("default", "no-mma", "no-register-accumulators", "synchronous-loads", "pipeline-2", "pipeline-4",
                 "threads-64", "rolled-loops")
_FAST_PROGRAMS = ("ragged_matmuls_f16", "batched_matmuls_f16", "ragged_attention_f16", "narrow_rows_f16")


#: the programs each option set runs on: ragged tensor-core tiles with a sum in registers beside one
#: that is not, and online softmax on tiles; the others run under the default options and a few sets
#: that change their kernels most
_EVERY_SET_ON = ("ragged_matmuls_f16", "ragged_attention_f16")
_SOME_SETS = ("default", "no-mma", "threads-64")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, options", [(name, o) for name in _FAST_PROGRAMS
                                           for o in (_FAST_OPTIONS if name in _EVERY_SET_ON else _SOME_SETS)])
def test_fast_path_programs_under_option_sets(name, options):
    check_simulated(fast_path_graphs()[name], seed=3, options=OPTION_SETS[options])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(n for n in fast_path_graphs() if n not in _FAST_PROGRAMS
                                        and not n.startswith("kernel_matmuls")))
def test_the_other_fast_path_programs(name):
    check_simulated(fast_path_graphs()[name], seed=4, options=CudaOptions())


def _kernel_matmuls(dtype):
    """Kernel-level matmuls on tensor cores: K of 7 steps of 32 (the ring of 4 buffers wraps), rows of
    A and B 16-byte copies can take, and a ragged one (K = 20, N = 70) copied element by element."""
    g = Graph(f"kernel_mma_{dtype.name}")
    g.op("matmul", g.input("a", (20, 200), dtype), g.input("b", (200, 24), dtype))
    g.op("matmul", g.input("c", (18, 20), dtype), g.input("d", (20, 70), dtype))
    return g.build()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", (f16, bf16), ids=lambda d: d.name)
def test_kernel_level_matmuls_on_tensor_cores(dtype):
    graph = _kernel_matmuls(dtype)
    assert "mma.sync" in emit_llvm(graph, options=CudaOptions()).llvm_ir
    check_simulated(graph, seed=5, options=CudaOptions())


@pytest.mark.timeout(120)
def test_copies_that_land_as_soon_as_issued():
    """cp.async copies landing early (at issue) overwrite nothing another thread still reads."""
    check_simulated(fast_path_graphs()["ragged_attention_f16"], seed=6, options=CudaOptions(stages=4), copies="issue")


@pytest.mark.timeout(120)
def test_reading_a_tile_before_its_copies_are_waited_for_is_caught(monkeypatch):
    """Waiting for one group too few leaves the iteration's tile unwritten when it is read: the
    simulator's late copies make that show (NaN or wrong values), so the tests above can fail."""
    wait = KernelFunction.copy_async_wait
    monkeypatch.setattr(KernelFunction, "copy_async_wait", lambda fn, pending: wait(fn, pending + 1 if pending else 0))
    graph = fast_path_graphs()["ragged_matmuls_f16"]
    with pytest.raises(AssertionError, match="NaN|relative error"):
        check_simulated(graph, seed=3, options=CudaOptions(stages=3))


# ---------------------------------------------------------------------------------------------
# the lowerings of the benchmark plans: row-resident attention, streamed combines, hoisting

@pytest.mark.timeout(120)
@pytest.mark.parametrize("qknorm, options", [(False, o) for o in ("default", "no-rows", "pipeline-2")] +
                         [(True, o) for o in ("default", "no-hoist", "no-stream", "no-mma", "synchronous-loads")])
def test_split_attention_plans(qknorm, options):
    """The searched GQA / QKNorm plans' structure (tests/backend/ptx/plans.py) under each switch of
    their lowerings: the row-resident chain with ldmatrix operands and the next iteration's copies
    issued behind the opening barrier, Q's rms_norm hoisted, the combine folded from device memory."""
    check_simulated(split_attention(qknorm), seed=7, options=EVERY_OPTION_SET[options])


@pytest.mark.timeout(120)
def test_split_attention_copies_that_land_as_soon_as_issued():
    """Copies issued behind the barrier that opens an iteration (the loop ends in registers) land in
    the slot the last iteration read: landing at once must overwrite nothing a thread still reads."""
    check_simulated(split_attention(True), seed=8, options=CudaOptions(stages=2), copies="issue")


@pytest.mark.timeout(120)
def test_a_long_streamed_combine_is_a_loop():
    """A combine of 36 splits (over FULL_UNROLL: a loop, 4 iterations a trip) folded from device memory."""
    from mdsl.lowering.streamed import FULL_UNROLL

    g = Graph("long_combine")
    m, x = g.input("m", (4, 36), f32), g.input("x", (4, 36 * 8), f32)
    b = g.block(grid=(2,), forloop=36, threads=64)
    mt, xt = b.input(m, imap=(0,), fmap=1), b.input(x, imap=(0,), fmap=1)   # [2, 1], [2, 8]
    b.output(b.op("add", b.op("accum_rescale", xt, mt), b.op("accum_max", mt)), omap=(0,))
    b.done()
    graph = g.build()
    assert graph.custom_nodes()[0].body.forloop > FULL_UNROLL
    program = emit_llvm(graph, options=CudaOptions())
    assert program.llvm_ir.count('call float @"mdsl_exp"') == 4 * 2   # 4 iterations a trip, 2 weights each
    check_simulated(graph, seed=9, options=CudaOptions())


def _some_warps_lack_a_tile():
    """6 mma tiles (16 x 48) on 4 warps: warps 0 and 1 hold 2, warps 2 and 3 one (their K loop of one
    tile, in the else branch of the check for the last), over K of 80 a block (a loop of 5 steps)."""
    g = Graph("warps_lacking_a_tile")
    x, w = g.input("x", (16, 160), f16), g.input("w", (160, 96), f16)
    b = g.block(grid=(2,), forloop=2, threads=128)
    acc = b.op("accum", b.op("matmul", b.input(x, imap=(None,), fmap=1), b.input(w, imap=(1,), fmap=0)))
    b.output(acc, omap=(1,))
    b.done()
    return g.build()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["lora_tuned", "warps_lacking_a_tile"])
def test_warps_that_lack_their_last_mma_tile(name):
    """The K loops written inside the check that a warp has its last tile (mdsl/backend/ptx/mma.py):
    LoRA's tuned blocks (2 tiles a matmul on 4 warps: half the warps have none), and warps holding 2 or 1."""
    from tests.backend.ptx.plans import lora_tuned

    graph = lora_tuned(k=64, columns=32) if name == "lora_tuned" else _some_warps_lack_a_tile()
    for options in (CudaOptions(), CudaOptions(register_accumulators=False)):
        check_simulated(graph, seed=10, options=options)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["groups-grid", "rows-and-groups-loop", "split-loop-combine"])
def test_a_tile_regrouped_into_heads(name):
    from tests.search.regrouped_plans import regrouped_candidates

    check_simulated(regrouped_candidates()[name], seed=2)

"""The fast paths of both backends, without a GPU: the same `CudaOptions` switch them (given to the emitter,
or from the environment), tensor cores (HMMA in the SASS) in exactly the kernels where the lowering puts a
matmul on them and never with mma off, cp.async (LDGSTS) in exactly the kernels whose inputs are pipelined,
a sum kept in registers saving its stage and its barrier, loops unrolled as asked, and every fast-path
program compiling clean (no spills, no stack, within shared memory and the register file) under every
option set that changes it. Each backend's own: tests/backend/cuda/test_cuda_fast_paths.py and
tests/backend/ptx/test_ptx_fast_paths.py; the GPU runs the same programs against the reference
(tests/gpu/test_gpu_fast_paths.py)."""
from __future__ import annotations

import re

import attrs
import pytest

from mdsl.backend.cuda.nvrtc import nvdisasm_path
from mdsl.ir.dtypes import bf16, f16, f32
from mdsl.lowering.block import lower
from mdsl.lowering.options import CudaOptions
from tests.backend.acceptance import assert_compiles_clean
from tests.backend.backends import (BACKENDS, BARRIER, EMITTERS, emit, has_mma, kernel_body, kernel_code,
                                    kernel_instructions, kernels_with, module, needs_nvdisasm)
from tests.backend.cuda.fast_paths import EVERY_OPTION_SET, OPTION_SETS, fast_path_graphs, options_env
from tests.backend.cuda.programs import example_kernels
from tests.backend.ptx.plans import matmul_case_names, plan_graph
from tests.gpu.harness import with_dtype

pytestmark = pytest.mark.shared_compile_cache   # a program's code compiled once per session (tests/shared.py)

#: the default fast paths, every one of which both backends implement
DEFAULT = CudaOptions()


@pytest.mark.parametrize("backend", EMITTERS)
def test_the_emitter_reads_the_environment_when_given_no_options(backend, monkeypatch):
    graph = fast_path_graphs()["ragged_matmuls_f16"]
    chosen = CudaOptions(mma=False, stages=2)
    for key, value in options_env(chosen).items():
        monkeypatch.setenv(key, value)
    assert emit(backend, graph).source == emit(backend, graph, chosen).source
    if backend == "ptx":
        assert emit(backend, graph).options == chosen
    for key in options_env(DEFAULT):
        monkeypatch.delenv(key)
    assert has_mma(backend, kernel_code(backend, emit(backend, graph)))


@needs_nvdisasm
@pytest.mark.parametrize("backend", BACKENDS)
def test_f32_matmuls_keep_their_precision(backend):
    """An f32 program is not rounded to 16 bits for the tensor cores: its matmuls stay scalar."""
    graph = with_dtype(fast_path_graphs()["ragged_matmuls_f16"], f16, f32)
    program = emit(backend, graph, DEFAULT)
    assert not has_mma(backend, kernel_code(backend, program))
    assert not kernels_with(module(backend, program).cubin, "HMMA")


def _kernel_plans(program, options: CudaOptions) -> list:
    """(launch, node, the lowering of a custom node's body or None) for each kernel of the program, with the
    options as the backends honour them (a block size in the options replaces the body's)."""
    out = []
    for launch, node in zip(program.launches, program.graph.nodes):
        lowered = None
        if node.op == "custom":
            body = node.body if options.threads is None else attrs.evolve(node.body, threads=options.threads)
            lowered = lower(body, tuple(v.type for v in node.inputs), options)
        out.append((launch, node, lowered))
    return out


def tensor_core_kernels(program, options: CudaOptions) -> set:
    """The kernels the lowering puts on tensor cores: custom kernels with a block matmul it chose for
    mma.sync, kernel-level matmuls of 16-bit operands."""
    return {launch.name for launch, node, lowered in _kernel_plans(program, options)
            if (lowered.mma if lowered is not None else
                node.op == "matmul" and options.mma and {v.dtype for v in node.inputs} in ({f16}, {bf16}))}


def _has_matmul(graph) -> bool:
    return any(n.op == "matmul" for c in graph.custom_nodes() for n in c.body.nodes) or \
        any(n.op == "matmul" for n in graph.nodes)


def _matmul_program_names() -> list:
    """Programs with matmuls on 16-bit operands, named here and built on first use: the fast-path set, the
    hand-written fused examples and the benchmark cases' plans (tests/backend/ptx/plans.py)."""
    names = [name for name, graph in fast_path_graphs().items() if _has_matmul(graph)]
    names += [f"example {name}" for name, graph in example_kernels().items()
              if graph.custom_nodes() and _has_matmul(graph)]
    return sorted(names) + [f"plan of {case}" for case in matmul_case_names()]


def matmul_program(name: str):
    if name.startswith("example "):
        return example_kernels()[name.removeprefix("example ")]
    if name.startswith("plan of "):
        return plan_graph(name.removeprefix("plan of "))
    return fast_path_graphs()[name]


@needs_nvdisasm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", _matmul_program_names())
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_cores_in_exactly_the_kernels_the_lowering_chose(backend, name):
    graph = matmul_program(name)
    program = emit(backend, graph, DEFAULT)
    with_hmma = kernels_with(module(backend, program).cubin, "HMMA")
    assert with_hmma, f"no HMMA in the SASS of {name}"
    assert with_hmma == tensor_core_kernels(program, DEFAULT)
    off = attrs.evolve(DEFAULT, mma=False)
    slow = emit(backend, graph, off)
    assert not has_mma(backend, kernel_code(backend, slow)) and not tensor_core_kernels(slow, off)   # nothing else makes HMMA


def pipelined_kernels(program, options: CudaOptions) -> set:
    """The kernels that copy asynchronously by the lowering's plan: custom kernels whose inputs have a
    ring of copies, and kernel-level matmuls on the tensor-core tile (a ring of four; fewer rows take the row
    kernel, which loads its fragments from global memory) with rows of A or B that 16-byte copies can take."""
    from mdsl.backend.cuda.rules import ROWS_GEMM_MAX_M

    on_tensor_cores = tensor_core_kernels(program, options)
    out = set()
    for launch, node, lowered in _kernel_plans(program, options):
        if lowered is not None:
            if lowered.memory.slot_bytes:
                out.add(launch.name)
        elif launch.name in on_tensor_cores and node.inputs[0].shape[-2] > ROWS_GEMM_MAX_M and \
                (node.inputs[0].shape[-1] % 8 == 0 or node.output.shape[-1] % 8 == 0):
            out.add(launch.name)   # rows of 16 bytes in A or in B
    return out


@needs_nvdisasm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(fast_path_graphs()))
@pytest.mark.parametrize("backend", BACKENDS)
def test_cp_async_exactly_in_the_pipelined_kernels(backend, name):
    """Under the default pipeline, none, and with mma off (kernel-level matmuls pipeline on tensor cores
    only); the representatives under a pipeline of 2 too."""
    for options_name in ("default", "synchronous-loads", "no-mma") + (("pipeline-2",) if name in REPRESENTATIVES else ()):
        options = OPTION_SETS[options_name]
        program = emit(backend, fast_path_graphs()[name], options)
        with_ldgsts = kernels_with(module(backend, program).cubin, "LDGSTS")
        assert with_ldgsts == pipelined_kernels(program, options), options_name
        if options.stages == 1:
            assert not any(node.op == "custom" and launch.name in with_ldgsts
                           for launch, node in zip(program.launches, program.graph.nodes)), options_name


def test_the_fast_path_set_pipelines_and_skips_what_it_should():
    """The cases above are not vacuous: some kernels are pipelined, the narrow rows are not."""
    program = emit("cuda", fast_path_graphs()["ragged_matmuls_f16"], DEFAULT)
    assert len(pipelined_kernels(program, DEFAULT)) == len(program.launches) == 2
    assert not pipelined_kernels(emit("cuda", fast_path_graphs()["narrow_rows_f16"], DEFAULT), DEFAULT)
    assert len(pipelined_kernels(emit("cuda", fast_path_graphs()["kernel_matmuls_bf16"], DEFAULT), DEFAULT)) == 2


#: what each backend's code has where a kernel copies asynchronously
COPY_ASYNC = {"cuda": "copy_async", "ptx": "cp.async"}


@pytest.mark.parametrize("backend", EMITTERS)
def test_rows_too_narrow_for_cp_async_are_loaded_synchronously(backend):
    graph = fast_path_graphs()["narrow_rows_f16"]
    node = graph.custom_nodes()[0]
    lowered = lower(node.body, tuple(v.type for v in node.inputs), CudaOptions(stages=3))
    assert lowered.memory.stages == 1 and not lowered.memory.slot_bytes
    assert COPY_ASYNC[backend] not in kernel_code(backend, emit(backend, graph, CudaOptions(stages=3)))


@pytest.mark.parametrize("backend", EMITTERS)
def test_a_sum_in_registers_saves_its_stage_and_its_barrier(backend):
    """accum(matmul) kept in the mma fragments runs in its matmul's stage: an iteration has one barrier
    fewer; the kernel's barriers are the schedule's (after the loads, after each loop stage, after the
    finalization and the fragments' store, after each post stage)."""
    graph = fast_path_graphs()["ragged_matmuls_f16"]
    node = graph.custom_nodes()[0]
    kernel = f"{graph.name}_{node.outputs[0].name}"
    types = tuple(v.type for v in node.inputs)
    kept = lower(node.body, types, DEFAULT)
    shared = lower(node.body, types, CudaOptions(register_accumulators=False))
    assert list(kept.register_accumulated) == [1] and not shared.register_accumulated
    assert len(kept.schedule.loop) == len(shared.schedule.loop) - 1
    for options, lowered, per_iteration in ((DEFAULT, kept, 2), (CudaOptions(register_accumulators=False), shared, 3)):
        assert 1 + len(lowered.schedule.loop) == per_iteration
        after_loop = 1 if lowered.register_accumulated else 0   # accum has no finalize of its own
        body = kernel_body(backend, emit(backend, graph, options), kernel)
        assert body.count(BARRIER[backend]) == per_iteration + after_loop + len(lowered.schedule.post)
    if backend == "cuda":
        assert "in the registers of the mma fragments" in emit(backend, graph, DEFAULT).source


#: a block loop over a tile's elements in CUDA C++, with its unroll count
THREAD_LOOP = re.compile(r"#pragma unroll (\d+)\n\s*for \(int i = threadIdx\.x;")


@pytest.mark.parametrize("backend", EMITTERS)
def test_block_loops_unroll_as_asked(backend):
    graph = fast_path_graphs()["ragged_matmuls_f16"]
    code = {u: emit(backend, graph, CudaOptions(unroll=u)).source for u in (1, 2, 4)}
    if backend == "cuda":   # each loop's #pragma unroll
        pragmas = {u: set(THREAD_LOOP.findall(c)) for u, c in code.items()}
        assert pragmas[1] == {"1"} and "2" in pragmas[2] and "4" in pragmas[4]
    else:   # silu over the second kernel's [6, 80] tile by 64 threads (8 trips each): rolled, one body; four
        # times unrolled, a loop of four bodies (the last three guarded)
        exp_calls = {u: c.count('call float @"mdsl_exp"') for u, c in code.items()}
        assert exp_calls[2] == exp_calls[1] + 1 and exp_calls[4] == exp_calls[1] + 3


def _longest_run_of_loads(instructions: list, load: str, store: str) -> int:
    """The most `load` instructions that follow one another with no `store` between them."""
    longest = run = 0
    for op in instructions:
        if op.startswith(load):
            run += 1
            longest = max(longest, run)
        elif op.startswith(store):
            run = 0
    return longest


@needs_nvdisasm
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_operands_prologue_loads_a_threads_elements_before_it_stores_them(backend):
    """neg(x) @ w and neg(x * b) @ w on 64x64 tiles: the prologue's loop over the shared-memory tiles
    (32 elements a thread) loads `unroll` (4) elements of a thread before it stores the first, so that
    four round trips to shared memory are in flight, not one (a store may alias a later load: the
    compiler keeps them in the order written). The copies stay asynchronous (LDGSTS)."""
    program = emit(backend, fast_path_graphs()["prologue_matmuls_f16"], DEFAULT)
    cubin = module(backend, program).cubin
    sass = kernel_instructions(cubin)
    kernels = [name for name in sass if name.startswith("prologue_matmuls_f16")]
    assert len(kernels) == 2
    for kernel in kernels:
        assert _longest_run_of_loads(sass[kernel], "LDS.U16", "STS") >= DEFAULT.unroll, kernel
    assert kernels_with(cubin, "LDGSTS") >= set(kernels)


#: programs that between them take every fast path (test_the_representatives_take_every_lowering): every
#: option set is compiled for these, every other program under the default options
REPRESENTATIVES = ("flash_decoding_f16", "ragged_matmuls_f16", "split_combine_f16")
#: a benchmark plan that takes the lowerings only attention plans take (the PTX backend's plan tests)
REPRESENTATIVE_PLAN = "qknorm_bs1"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, options", [(name, o) for name in sorted(fast_path_graphs())
                                           for o in (sorted(EVERY_OPTION_SET) if name in REPRESENTATIVES else ["default"])])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fast_path_programs_compile_clean(backend, name, options):
    """Clean (no spills, no stack, within shared memory and the register file), with tensor-core
    instructions (HMMA) in the SASS of exactly the kernels whose code calls the tensor cores; in the PTX
    backend's, ldmatrix (LDSM) exactly where its IR has it."""
    program, compiled = assert_compiles_clean(fast_path_graphs()[name], backend, EVERY_OPTION_SET[options])
    if nvdisasm_path() is None:
        return   # the SASS cannot be read here
    with_hmma, with_ldsm = kernels_with(compiled.cubin, "HMMA"), kernels_with(compiled.cubin, "LDSM")
    for launch in program.launches:
        code = kernel_body(backend, program, launch.name)
        assert has_mma(backend, code) == (launch.name in with_hmma), f"{launch.name} under {options}"
        if backend == "ptx":
            assert ("ldmatrix" in code) == (launch.name in with_ldsm), f"{launch.name} under {options}"


def test_the_representatives_take_every_lowering():
    """What makes them representative: between them, every lowering the options switch is taken."""
    taken = set()
    for graph in [fast_path_graphs()[name] for name in REPRESENTATIVES] + [plan_graph(REPRESENTATIVE_PLAN)]:
        for node in graph.custom_nodes():
            lowered = lower(node.body, tuple(v.type for v in node.inputs), DEFAULT)
            taken |= {name for name, on in (("mma", lowered.mma), ("register_accumulators", lowered.register_accumulated),
                                             ("stages", lowered.memory.slot_bytes), ("rows", lowered.rows),
                                             ("stream", lowered.streamed), ("hoist", lowered.schedule.pre)) if on}
    assert taken == {"mma", "register_accumulators", "stages", "rows", "stream", "hoist"}

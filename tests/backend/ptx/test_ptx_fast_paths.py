"""The PTX backend's fast paths, without a GPU, against the CUDA backend's: the same `CudaOptions`
switch them (given to emit_llvm, or from the environment), tensor cores (HMMA in the SASS of the
assembled cubin) in exactly the kernels where the CUDA backend's SASS has them and never with
mma off, cp.async (LDGSTS) exactly in the kernels whose inputs are pipelined, and every fast-path
program and every benchmark case's searched plan (.plans) assembling clean (no spills, no stack)
under every option set. The simulator checks the numbers (test_ptx_simulated.py); the GPU test
(test_ptx_gpu.py) runs the same programs on the device."""
from __future__ import annotations

import contextlib
import functools

import attrs
import pytest

from mdsl.backend.cuda import compile_cuda, emit_cuda
from mdsl.backend.cuda.nvrtc import nvdisasm_path, sass_instructions
from mdsl.backend.ptx import assembler, emit_llvm
from mdsl.ir.dtypes import bf16, f16, f32
from mdsl.lowering.block import lower
from mdsl.lowering.options import CudaOptions
from tests.backend.acceptance import assembled_module, assert_assembles_clean
from tests.backend.cuda.fast_paths import OPTION_SETS, fast_path_graphs, options_env
from tests.backend.ptx.plans import EVERY_OPTION_SET, case_names, matmul_case_names, plan_graph, stored_plans
from tests.gpu.harness import with_dtype
from tests.shared import disassembled

pytestmark = [pytest.mark.skipif(assembler() is None, reason="neither nvJitLink nor ptxas is installed"),
              pytest.mark.shared_compile_cache]   # PTX and cubins compiled once per session (tests/shared.py)
needs_nvdisasm = pytest.mark.skipif(nvdisasm_path() is None, reason="nvdisasm is not installed "
                                    "(pip install nvidia-cuda-nvdisasm): the SASS cannot be read")

#: the default fast paths, every one of which both backends implement
BOTH = CudaOptions()


def kernel_instructions(cubin: bytes) -> dict:
    """Kernel name (or subroutine) -> its SASS instructions in order (nvrtc.sass_instructions); the cubin
    disassembled once per session (tests/shared.py)."""
    return sass_instructions(disassembled(cubin))


def kernel_opcodes(cubin: bytes) -> dict:
    """Kernel name -> {opcode (its first dotted part) -> instructions}, from the cubin's SASS."""
    out: dict = {}
    for kernel, instructions in kernel_instructions(cubin).items():
        counts = out[kernel] = {}
        for op in instructions:
            counts[op.split(".")[0]] = counts.get(op.split(".")[0], 0) + 1
    return out


@functools.lru_cache(maxsize=256)
def _opcodes_of(llvm_ir: str) -> dict:
    return kernel_opcodes(assembled_module(llvm_ir)[1].cubin)


def _ptx_opcodes(graph, options: CudaOptions) -> tuple:
    program = emit_llvm(graph, options=options)
    return program, _opcodes_of(program.llvm_ir)


def _cuda_opcodes(graph, options: CudaOptions) -> dict:
    return kernel_opcodes(compile_cuda(emit_cuda(graph, options=options).source).cubin)


def test_emit_llvm_reads_the_environment_when_given_no_options(monkeypatch):
    graph = fast_path_graphs()["ragged_matmuls_f16"]
    for key, value in options_env(CudaOptions(mma=False, stages=2)).items():
        monkeypatch.setenv(key, value)
    assert emit_llvm(graph).llvm_ir == emit_llvm(graph, options=CudaOptions(mma=False, stages=2)).llvm_ir
    assert emit_llvm(graph).options == CudaOptions(mma=False, stages=2)
    for key in options_env(CudaOptions()):
        monkeypatch.delenv(key)
    assert "mma.sync.aligned.m16n8k16" in emit_llvm(graph).llvm_ir


def _matmul_program_names() -> list:
    """Programs with 16-bit matmuls: the fast-path set and the benchmark cases' searched plans with one
    (named here, built on first use; the examples and guided plans: test_acceptance assembles them)."""
    names = [name for name, graph in fast_path_graphs().items()
             if any(n.op == "matmul" for c in graph.custom_nodes() for n in c.body.nodes)
             or any(n.op == "matmul" for n in graph.nodes)]
    return names + [f"searched plan of {case}" for case in matmul_case_names()]


def _matmul_program(name: str):
    if name.startswith("searched plan of "):
        return plan_graph(name.removeprefix("searched plan of "))
    return fast_path_graphs()[name]


def _kernel_plans(program) -> list:
    """(launch, node, the CUDA lowering of a custom node's body or None) for each kernel of the program,
    with the program's options as the PTX backend honours them."""
    options = program.options
    out = []
    for launch, node in zip(program.launches, program.graph.nodes):
        lowered = None
        if node.op == "custom":
            body = node.body if options.threads is None else attrs.evolve(node.body, threads=options.threads)
            lowered = lower(body, tuple(v.type for v in node.inputs), options)
        out.append((launch, node, lowered))
    return out


def _tensor_core_kernels(program) -> set:
    """The kernels the CUDA backend's lowering puts on tensor cores, for the program's options: custom
    kernels with a block matmul it chose for mma.sync, kernel-level matmuls of 16-bit operands."""
    mma = program.options.mma
    return {launch.name for launch, node, lowered in _kernel_plans(program)
            if (lowered.mma if lowered is not None else
                node.op == "matmul" and mma and {v.dtype for v in node.inputs} in ({f16}, {bf16}))}


@needs_nvdisasm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(_matmul_program_names()))
def test_tensor_cores_in_exactly_the_kernels_the_cuda_lowering_chose(name):
    graph = _matmul_program(name)
    program, fast = _ptx_opcodes(graph, BOTH)
    with_hmma = {k for k, ops in fast.items() if ops.get("HMMA", 0)}
    assert with_hmma, f"no HMMA in the SASS of {name}"
    assert with_hmma == _tensor_core_kernels(program)
    slow = emit_llvm(graph, options=attrs.evolve(BOTH, mma=False))
    assert "mma.sync" not in slow.llvm_ir and not _tensor_core_kernels(slow)   # nothing else makes HMMA


@needs_nvdisasm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["ragged_matmuls_bf16", "kernel_matmuls_f16", "searched plan of lora"])
def test_tensor_cores_where_the_cuda_backends_sass_has_them(name):
    graph = _matmul_program(name)
    _, ptx = _ptx_opcodes(graph, BOTH)
    cuda = _cuda_opcodes(graph, BOTH)
    assert {k for k, ops in ptx.items() if ops.get("HMMA", 0)} == {k for k, ops in cuda.items() if ops.get("HMMA", 0)}


@needs_nvdisasm
def test_f32_matmuls_keep_their_precision():
    """An f32 program is not rounded to 16 bits for the tensor cores: its matmuls stay scalar."""
    graph = with_dtype(fast_path_graphs()["ragged_matmuls_f16"], f16, f32)
    program, opcodes = _ptx_opcodes(graph, BOTH)
    assert "mma.sync" not in program.llvm_ir and not any(ops.get("HMMA", 0) for ops in opcodes.values())


def _pipelined_kernels(program) -> set:
    """The kernels that copy asynchronously by the lowering's plan: custom kernels whose inputs have
    a ring of copies, and kernel-level matmuls on tensor cores (a ring of four) with rows of A or B
    that 16-byte copies can take."""
    on_tensor_cores = _tensor_core_kernels(program)
    out = set()
    for launch, node, lowered in _kernel_plans(program):
        if lowered is not None:
            if lowered.memory.slot_bytes:
                out.add(launch.name)
        elif launch.name in on_tensor_cores and (node.inputs[0].shape[-1] % 8 == 0 or node.output.shape[-1] % 8 == 0):
            out.add(launch.name)   # rows of 16 bytes in A or in B
    return out


@needs_nvdisasm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(fast_path_graphs()))
def test_cp_async_exactly_in_the_pipelined_kernels(name):
    for options in ("default", "synchronous-loads", "no-mma"):
        program, opcodes = _ptx_opcodes(fast_path_graphs()[name], OPTION_SETS[options])
        with_ldgsts = {k for k, ops in opcodes.items() if ops.get("LDGSTS", 0)}
        assert with_ldgsts == _pipelined_kernels(program), options
        if OPTION_SETS[options].stages == 1:
            assert not any(node.op == "custom" and launch.name in with_ldgsts
                           for launch, node in zip(program.launches, program.graph.nodes)), options


def test_the_fast_path_set_pipelines_and_skips_what_it_should():
    """The cases above are not vacuous: some kernels are pipelined, the narrow rows are not."""
    program = emit_llvm(fast_path_graphs()["ragged_matmuls_f16"], options=BOTH)
    assert len(_pipelined_kernels(program)) == len(program.launches) == 2
    assert not _pipelined_kernels(emit_llvm(fast_path_graphs()["narrow_rows_f16"], options=BOTH))
    assert len(_pipelined_kernels(emit_llvm(fast_path_graphs()["kernel_matmuls_bf16"], options=BOTH))) == 2


def test_a_sum_in_registers_saves_its_stage_and_its_barrier():
    """accum(matmul) kept in the fragments runs in its matmul's stage (the CUDA lowering's schedule):
    an iteration has one barrier fewer; the kernel's barriers are the schedule's (after the loads,
    after each loop stage, after the finalization and the fragments' store, after each post stage)."""
    graph = fast_path_graphs()["ragged_matmuls_f16"]
    node = graph.custom_nodes()[0]
    kernel = f"{graph.name}_{node.outputs[0].name}"
    types = tuple(v.type for v in node.inputs)
    for options, per_iteration in ((BOTH, 2), (attrs.evolve(BOTH, register_accumulators=False), 3)):
        lowered = lower(node.body, types, options)
        assert 1 + len(lowered.schedule.loop) == per_iteration
        after_loop = 1 if lowered.register_accumulated else 0   # accum has no finalize of its own
        llvm_ir = emit_llvm(graph, options=options).llvm_ir
        start = llvm_ir.index(f'define ptx_kernel void @"{kernel}"')
        body = llvm_ir[start:llvm_ir.index("\n}\n", start)]
        assert body.count('call void @"llvm.nvvm.barrier0"()') == per_iteration + after_loop + len(lowered.schedule.post)


def test_block_loops_unroll_as_asked():
    """silu over the second kernel's [6, 80] tile by 64 threads (8 trips each): rolled, one body; four
    times unrolled, a loop of four bodies (the last three guarded)."""
    graph = fast_path_graphs()["ragged_matmuls_f16"]
    exp_calls = {u: emit_llvm(graph, options=attrs.evolve(BOTH, unroll=u)).llvm_ir.count('call float @"mdsl_exp"')
                 for u in (1, 2, 4)}
    assert exp_calls[2] == exp_calls[1] + 1 and exp_calls[4] == exp_calls[1] + 3


def _kernel_ir(llvm_ir: str, name: str) -> str:
    start = llvm_ir.index(f'define ptx_kernel void @"{name}"')
    return llvm_ir[start:llvm_ir.index("\n}\n", start)]


def _assembles_clean_under(graph, option_sets: dict) -> None:
    """Each option set's program assembled once (sets that emit the same IR, such as a switch the
    program has no use for, share one assembly), clean, with tensor-core instructions (HMMA) and
    ldmatrix (LDSM) in the SASS of exactly the kernels whose IR has mma.sync and ldmatrix."""
    seen = set()
    for name, options in sorted(option_sets.items()):
        llvm_ir = emit_llvm(graph, options=options).llvm_ir
        if llvm_ir in seen:
            continue
        seen.add(llvm_ir)
        program, _ = assert_assembles_clean(graph, options)
        if nvdisasm_path() is None:
            continue   # the SASS cannot be read here
        opcodes = _opcodes_of(llvm_ir)
        for launch in program.launches:
            kernel = _kernel_ir(llvm_ir, launch.name)
            ops = opcodes[launch.name]
            assert ("mma.sync" in kernel) == (ops.get("HMMA", 0) > 0), f"{launch.name} under {name}: {ops}"
            assert ("ldmatrix" in kernel) == (ops.get("LDSM", 0) > 0), f"{launch.name} under {name}: {ops}"


#: programs that between them take every switch's path: row-resident attention with hoisting and
#: ldmatrix (flash_decoding), sums in registers on ragged tiles (ragged_matmuls), a streamed combine
#: (split_combine) and QKNorm's searched plan (all three lowerings, the benchmark's shapes); every
#: option set is assembled for these, every other program under the default options
REPRESENTATIVES = ("flash_decoding_f16", "ragged_matmuls_f16", "split_combine_f16")
REPRESENTATIVE_PLAN = "qknorm_bs1"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(fast_path_graphs()))
def test_fast_path_programs_assemble_clean(name):
    options = EVERY_OPTION_SET if name in REPRESENTATIVES else {"default": BOTH}
    _assembles_clean_under(fast_path_graphs()[name], options)


#: the switches of the lowerings that only attention plans take, for the representative plan (the
#: fast-path representatives above take every option set)
_PLAN_SWITCHES = ("default", "no-rows", "no-hoist", "no-stream")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", case_names())
def test_benchmark_plans_assemble_clean(name):
    options = {o: EVERY_OPTION_SET[o] for o in (_PLAN_SWITCHES if name == REPRESENTATIVE_PLAN else ["default"])}
    _assembles_clean_under(plan_graph(name), options)


def test_the_representatives_take_every_lowering():
    """What makes them representative: between them, every lowering the options switch is taken."""
    taken = set()
    for graph in [fast_path_graphs()[name] for name in REPRESENTATIVES] + [plan_graph(REPRESENTATIVE_PLAN)]:
        for node in graph.custom_nodes():
            lowered = lower(node.body, tuple(v.type for v in node.inputs), BOTH)
            taken |= {name for name, on in (("mma", lowered.mma), ("register_accumulators", lowered.register_accumulated),
                                             ("stages", lowered.memory.slot_bytes), ("rows", lowered.rows),
                                             ("stream", lowered.streamed), ("hoist", lowered.schedule.pre)) if on}
    assert taken == {"mma", "register_accumulators", "stages", "rows", "stream", "hoist"}


def test_every_benchmark_case_has_a_plan_here():
    from benchmarks import kernels

    assert case_names() == sorted(kernels.case_names())
    assert sorted(stored_plans()) in ([], case_names())   # a checkout's stored plans: every case's, or none


def _main_loop_events(graph, monkeypatch) -> list:
    """What the custom kernel's `forloop` loop body emits, in order: 'barrier', 'wait N', 'copy'."""
    from mdsl.backend.ptx.llvm import KernelFunction

    events, depth, forloop = [], [0], graph.custom_nodes()[0].body.forloop
    inside = []
    loop = KernelFunction.loop

    @contextlib.contextmanager
    def recording_loop(fn, start, stop, step):
        main = depth[0] == 0 and stop == forloop and step == 1 and not inside
        depth[0] += 1
        if main:
            inside.append(True)
        with loop(fn, start, stop, step) as i:
            yield i
        depth[0] -= 1
        if main:
            inside.pop()

    def record(what):
        def method(fn, *args):
            if inside:
                events.append(what if what != "wait" else f"wait {args[0]}")
            return original[what](fn, *args)
        return method

    original = {"barrier": KernelFunction.barrier, "wait": KernelFunction.copy_async_wait,
                "copy": KernelFunction.copy_async}
    monkeypatch.setattr(KernelFunction, "loop", recording_loop)
    for what, name in (("barrier", "barrier"), ("wait", "copy_async_wait"), ("copy", "copy_async")):
        monkeypatch.setattr(KernelFunction, name, record(what))
    emit_llvm(graph, options=BOTH)
    return events


@pytest.mark.parametrize("name", ["flash_decoding_f16", "row_attention_bf16"])
def test_row_resident_loops_have_one_barrier_an_iteration_and_copies_behind_it(name, monkeypatch):
    """As the CUDA backend's (test_cuda_rows): the chain needs no barrier of its own, and the next
    iteration's copies are issued behind the one barrier that opens an iteration."""
    events = _main_loop_events(fast_path_graphs()[name], monkeypatch)
    assert events.count("barrier") == 1 and "copy" in events
    assert events[0] == "wait 1" and events[1] == "barrier" and set(events[2:]) == {"copy"}   # 3 stages

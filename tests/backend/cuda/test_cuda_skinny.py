"""The skinny loop (mdsl.lowering.skinny, written by mdsl.backend.cuda.skinny), without a GPU: which block graphs
qualify, the code it writes (no shared-memory tiles for X and the weights, no barrier in the loop), NVRTC for
sm_90a with no spills, the SASS (128-bit non-allocating weight loads, tensor cores, no cp.async), the
autotuner's space and the launch overlapping the previous kernel. The switch, as the PTX backend's:
tests/backend/test_skinny_loop.py. tests/gpu/test_gpu_skinny.py runs every program here against the float64
reference (the PTX backend's port of the loop has its own tests under tests/backend/ptx)."""
from __future__ import annotations

import itertools
import re

import pytest

from mdsl.backend.cuda import autotune, emit_cuda
from mdsl.backend.cuda.nvrtc import compile_cuda, nvdisasm_path, sass_opcodes
from mdsl.errors import UnsupportedError
from mdsl.lowering.block import lower
from mdsl.lowering.options import CudaOptions
from mdsl.search import guided
from tests.backend.cuda.programs import SKINNY_PROGRAMS, example_kernels, guided_plan, skinny_program
from tests.shared import disassembled as disassemble

pytestmark = pytest.mark.shared_compile_cache   # a program's cubin compiled once per session (tests/shared.py)

SKINNY = CudaOptions(skinny=True)
needs_nvdisasm = pytest.mark.skipif(nvdisasm_path() is None, reason="nvdisasm is not installed "
                                    "(pip install nvidia-cuda-nvdisasm): the SASS cannot be read")


def _lowered(graph, options=SKINNY, k: int = 0):
    node = graph.custom_nodes()[k]
    return node.body, lower(node.body, tuple(v.type for v in node.inputs), options, skinny=options.skinny)


@pytest.mark.parametrize("name", SKINNY_PROGRAMS)
def test_the_first_kernel_qualifies_and_keeps_no_input_tile(name):
    bg, lowered = _lowered(skinny_program(name))
    assert lowered.skinny is not None
    placed = {t.name for t in lowered.memory.lifetimes}
    assert not placed & {i.var.name for i in bg.inputs}     # X and the weights come from device memory
    assert lowered.smem_bytes > lowered.memory.total          # the warps' partial sums after the tiles


def test_what_does_not_qualify_keeps_the_tile_loop():
    # RMSNorm+Linear split along K folds squares of X in the loop (a mul node), LoRA has no loop over K,
    # attention's scores are not a weight stream; and the switch off or a PTX-style call never takes it
    split = next(g for g in _guided("rms_norm_linear.rms_norm_linear_bs8") if len(g.custom_nodes()) == 2)
    for graph in (split, guided_plan("lora.lora"), guided_plan("gqa.gqa")):
        assert _lowered(graph)[1].skinny is None
    graph = skinny_program("rms_norm_linear_bs8")
    assert _lowered(graph, CudaOptions())[1].skinny is None
    node = graph.custom_nodes()[0]
    assert lower(node.body, tuple(v.type for v in node.inputs), SKINNY).skinny is None   # not asked: not taken
    assert _lowered(graph, CudaOptions(skinny=True, threads=96))[1].skinny is not None  # any whole warps


def _guided(name):
    return itertools.islice(guided.generate(example_kernels()[name]), 12)


def test_the_code_streams_without_a_barrier_in_the_loop_and_reduces_over_the_warps():
    source = emit_cuda(skinny_program("rms_norm_linear_bs8"), options=SKINNY).source
    kernel = source[source.index("extern \"C\" __global__"):]
    assert "mdsl::Skinny<__half, 16, 32, 4096, 4096, 6144, 4, 1, 4>::run(" in kernel
    loop = kernel[kernel.index("::run("):kernel.index("::store_part(")]
    assert "__syncthreads" not in loop and "copy_async" not in kernel
    assert "fmaf(x, x, v)" in loop                              # accum_rms folded from X's fragments
    assert "sqrtf(s_accum_rms[i] / 4096.0f + 1e-06f)" in kernel  # then finalized by its own rule
    gated = emit_cuda(skinny_program("gated_mlp"), options=SKINNY).source
    assert "mdsl::Skinny<__half, 8, 32, 4096, 4096, 4096, 4, 2, 4>::run(" in gated


@pytest.mark.parametrize("threads", [None, 256])
@pytest.mark.parametrize("name", SKINNY_PROGRAMS)
def test_it_compiles_for_sm_90a_without_spills(name, threads):
    program = emit_cuda(skinny_program(name), arch="sm_90a", options=CudaOptions(skinny=True, threads=threads))
    module = compile_cuda(program.source, arch="sm_90a")
    first = module.resources[program.launches[0].name]
    assert first.spill_store_bytes == 0 and first.spill_load_bytes == 0 and first.stack_bytes == 0, module.log
    assert first.registers <= 255


@pytest.mark.parametrize("name", ["vector_prologue_linear_bs1", "vector_prologue_rms_norm_linear_bs16_bf16"])
def test_a_prologue_reads_its_vectors_beside_x_and_compiles_without_spills(name):
    """(x - b) @ w, rms_norm(x * g) @ w: the vector's pointer goes to the loop (VECS 1), the prologue takes its
    element at X's k and rounds as the tile would; with 16-byte fragments, staggered and overlapping too,
    no spills; in the SASS, a vector fragment's load per step beside X's (one row of X: as many)."""
    graph = skinny_program(name)
    vector = graph.custom_nodes()[0].body.inputs[1].var.name
    for options in (SKINNY, CudaOptions(skinny=True, wide_x=True, stagger=True, overlap=True, lead=0)):
        program = emit_cuda(graph, arch="sm_90a", options=options)
        kernel = program.source[program.source.index("extern \"C\" __global__"):]
        assert re.search(r"mdsl::Skinny<[^>]*, 1>::run\(skinny_acc, [^\n]*", kernel), kernel
        assert re.search(rf"const __(half|nv_bfloat16)\* const skinny_v\[1\] = {{g_{vector}\w*}};", kernel), kernel
        assert "mdsl::prologue([](float x, const float* v)" in kernel and ", skinny_prologue, skinny_v);" in kernel
        assert re.search(r"mdsl::from_float<__(half|nv_bfloat16)>\(x [-*] v\[0\]\)", kernel), kernel
        module = compile_cuda(program.source, arch="sm_90a")
        first = module.resources[program.launches[0].name]
        assert first.spill_store_bytes == 0 and first.spill_load_bytes == 0 and first.stack_bytes == 0, module.log
        if nvdisasm_path() is not None and name.endswith("bs1") and not options.wide_x:
            ops = re.findall(r"LDG\.E\.(?:NA\.)?\d+\.CONSTANT", disassemble(module.cubin))
            x_and_vector, weights = ops.count("LDG.E.64.CONSTANT"), ops.count("LDG.E.NA.64.CONSTANT")
            # a step: 4 rows of the weight, a fragment of X and one of b
            assert x_and_vector > 0 and weights == 2 * x_and_vector, ops


@needs_nvdisasm
@pytest.mark.parametrize("name, load", [("rms_norm_linear_bs8_64_columns", "LDG.E.NA.128.CONSTANT"),
                                        ("rms_norm_linear_bs1", "LDG.E.NA.64.CONSTANT"),
                                        ("rms_norm_linear_bs8", "LDG.E.NA.64.CONSTANT"),
                                        ("gated_mlp", "LDG.E.NA.64.CONSTANT")])
def test_the_sass_streams_the_weights_past_l1_in_wide_loads(name, load):
    """16-byte loads where a block's columns are whole 64-column groups; the benchmark plans' 32 columns
    a block take 8-byte loads instead, every lane a distinct 4-column chunk (16-byte loads would leave
    half the lanes loading copies: the same bytes in flight for twice the registers)."""
    program = emit_cuda(skinny_program(name), arch="sm_90a", options=SKINNY)
    sass = disassemble(compile_cuda(program.source, arch="sm_90a").cubin)
    wide = sass.count(load)
    mats = 2 if name.startswith("gated") else 1
    assert wide >= 2 * 4 * mats                    # both register buffers: 4 rows of each weight a slab
    assert "HMMA.16816.F32" in sass and "LDGSTS" not in sass
    ops = sass_opcodes(sass)
    assert ops.get("LDG", 0) - wide < wide         # the rest: X's 8-byte fragments, fewer than the weights'


def test_the_autotuner_tries_it_once_per_block_size_where_it_applies():
    """What `autotune` times and scripts/precompile_parallel.py compiles: `emitted_variants` over each
    candidate's space (`tuning_set`: the full one for the plan's own, the trimmed one for its variants)."""
    space = autotune.parameter_space()
    trimmed = autotune.parameter_space(stages=autotune.VARIANT_STAGES)
    assert {o.skinny for o in space} == {o.skinny for o in trimmed} == {False, True}
    skinny_kinds = len(autotune.OVERLAP) * len(autotune.STAGGER) * len(autotune.LEADS) * len(autotune.WIDE_X)
    per_stage_and_threads = 1 + skinny_kinds   # the tile loop; each skinny one
    unprefetched = skinny_kinds // len(autotune.LEADS) * autotune.LEADS.count(0) * len(autotune.UNPREFETCHED_THREADS)
    assert len(space) == len(autotune.STAGES) * (len(autotune.THREADS) * per_stage_and_threads + unprefetched)
    rnl, gqa, wide = (skinny_program("rms_norm_linear_bs8"), guided_plan("gqa.gqa"),
                      skinny_program("rms_norm_linear_bs8_64_columns"))
    emitted = autotune.emitted_variants([rnl, gqa, wide], space, "sm_90a", [space, space, trimmed])
    tried = [v for v, problem in emitted if not problem]
    for k in (0, 2):
        skinny = {(v.options.threads, v.options.overlap, v.options.stagger, v.options.lead, v.options.wide_x)
                  for v in tried if v.candidate == k and v.options.skinny}
        assert skinny == {(t, o, g, d, y) for d in autotune.LEADS
                          for t in (*autotune.THREADS, *(autotune.UNPREFETCHED_THREADS if d == 0 else ()))
                          for o in autotune.OVERLAP for g in autotune.STAGGER for y in autotune.WIDE_X}
    # gqa does not qualify: its tile loop again (dropped), unless overlapping its predecessor
    assert {(v.options.overlap, v.options.stagger, v.options.lead, v.options.wide_x)
            for v in tried if v.candidate == 1 and v.options.skinny} == {(True, False, 2, False)}


def test_switched_off_in_the_environment_the_autotuner_does_not_try_it(monkeypatch):
    monkeypatch.setenv("MDSL_CUDA_SKINNY", "0")
    assert {o.skinny for o in autotune.parameter_space()} == {False}
    assert {o.skinny for o in autotune.parameter_space(skinny=(True,))} == {True}   # asked for: given


# ---- overlapping the previous kernel (CudaOptions.overlap: programmatic dependent launch)

def test_an_overlapping_tile_kernel_waits_first():
    # the split and its combine in one launch (mdsl.lowering.onelaunch): the combine waits for nothing more
    program = emit_cuda(guided_plan("gqa.gqa"), arch="sm_90a", options=CudaOptions(overlap=True))
    assert len(program.launches) == 1 and all(launch.overlap for launch in program.launches)
    for kernel in program.source.split("extern \"C\" __global__")[1:]:
        body = kernel[kernel.index("{"):]
        assert body.index("mdsl::wait_for_previous_kernel();") < body.index("mdsl::let_next_kernel_launch();")
        assert "g_" not in body[:body.index("mdsl::wait_for_previous_kernel();")]   # no device tensor before
    plain = emit_cuda(guided_plan("gqa.gqa"), arch="sm_90a", options=CudaOptions()).source
    assert "wait_for_previous_kernel();" not in plain[plain.index("extern \"C\" __global__"):]


def test_an_overlapping_kernel_prefetches_then_waits_before_touching_memory():
    graph = skinny_program("rms_norm_linear_bs8_64_columns")
    program = emit_cuda(graph, arch="sm_90a", options=CudaOptions(skinny=True, overlap=True))
    assert [launch.overlap for launch in program.launches] == [True]
    kernel = program.source[program.source.index("extern \"C\" __global__"):]
    order = [kernel.index(s) for s in ("::prefetch_start(skinny_w);", "mdsl::wait_for_previous_kernel();",
                                       "mdsl::let_next_kernel_launch();", "::run(skinny_acc")]
    assert order == sorted(order)
    assert not any(launch.overlap for launch in emit_cuda(graph, arch="sm_90a", options=SKINNY).launches)
    # before sm_90 there is no programmatic dependent launch: the kernel is the plain one
    old = emit_cuda(graph, arch="sm_80", options=CudaOptions(skinny=True, overlap=True))
    assert old.source == emit_cuda(graph, arch="sm_80", options=SKINNY).source and not old.launches[0].overlap
    assert CudaOptions.from_env({"MDSL_CUDA_OVERLAP": "1"}) == CudaOptions(overlap=True)


def _sass_by_kernel(cubin: bytes) -> dict:
    """Each kernel's SASS instruction lines."""
    out, kernel = {}, None
    for line in disassemble(cubin).splitlines():
        section = re.match(r"^\.text\.(\S+):", line)
        if section:
            kernel = out.setdefault(section.group(1), [])
        elif kernel is not None and re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s", line):
            kernel.append(line)
    return out


_GLOBAL_ACCESS = re.compile(r"\b(LDG|STG|LD|ST|LDGSTS|ATOM|ATOMG|RED)\b")


@needs_nvdisasm
@pytest.mark.parametrize("name", ["rms_norm_linear_bs1", "rms_norm_linear_bs8_64_columns", "gated_mlp", "gqa"])
def test_in_the_sass_no_global_access_comes_before_the_wait(name):
    """griddepcontrol.wait is ACQBULK, launch_dependents PREEXIT: in a skinny kernel the L2 prefetches
    (CCTL.E.PF2) of the first slabs come before the wait, every global load, copy and store after it; in
    the tile kernels (gqa: attention and its combine) the wait comes first."""
    graph = guided_plan("gqa.gqa") if name == "gqa" else skinny_program(name)
    program = emit_cuda(graph, arch="sm_90a", options=CudaOptions(skinny=True, overlap=True))
    module = compile_cuda(program.source, arch="sm_90a")
    kernels = _sass_by_kernel(module.cubin)
    assert set(kernels) == {launch.name for launch in program.launches}
    for launch in program.launches:
        resources, lines = module.resources[launch.name], kernels[launch.name]
        assert resources.spill_store_bytes == 0, module.log
        wait = next(k for k, line in enumerate(lines) if "ACQBULK" in line)
        assert any("PREEXIT" in line for line in lines[wait:])
        assert not [line for line in lines[:wait] if _GLOBAL_ACCESS.search(line)], launch.name
        if name != "gqa":
            assert resources.registers <= 168 and any("CCTL.E.PF2" in line for line in lines[:wait])


def test_the_runtime_launches_an_overlapping_kernel_with_programmatic_serialization():
    pytest.importorskip("cuda.bindings")
    from mdsl.backend.cuda import runtime

    config = runtime.overlapping_launch((384, 1, 1), (128, 1, 1), 42048)   # builds a structure: no driver call
    assert (config.gridDimX, config.blockDimX, config.sharedMemBytes, config.numAttrs) == (384, 128, 42048, 1)
    attribute = config.attrs[0]
    assert attribute.id.name == "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION"
    assert attribute.value.programmaticStreamSerializationAllowed == 1


# ---- staggered walks over K (CudaOptions.stagger)

@pytest.mark.parametrize("name", ["rms_norm_linear_bs8_64_columns", "rms_norm_linear_5_rows_65_slabs", "gated_mlp"])
def test_a_staggered_loop_compiles_without_spills(name):
    graph = skinny_program(name)
    program = emit_cuda(graph, arch="sm_90a", options=CudaOptions(skinny=True, stagger=True))
    kernel = program.source[program.source.index("extern \"C\" __global__"):]
    assert re.search(r"mdsl::Skinny<[^>]*, true>::run\(", kernel)
    assert "true>" not in emit_cuda(graph, arch="sm_90a", options=SKINNY).source.split("extern \"C\" __global__")[1]
    module = compile_cuda(program.source, arch="sm_90a")
    first = module.resources[program.launches[0].name]
    assert first.spill_store_bytes == 0 and first.stack_bytes == 0 and first.registers <= 168, module.log
    assert CudaOptions.from_env({"MDSL_CUDA_SKINNY": "1", "MDSL_CUDA_STAGGER": "1"}) == CudaOptions(skinny=True, stagger=True)


# ---- the L2 prefetch lead (CudaOptions.lead)

@pytest.mark.parametrize("name", ["rms_norm_linear_bs8_64_columns", "gated_mlp"])
def test_a_longer_prefetch_lead_sends_more_slabs_ahead_and_compiles_without_spills(name):
    """lead 4: the loop prefetches the slabs of the iteration 4 ahead, and iterations 1-3 before it (the
    default 2: iteration 1 before, 2 ahead); the defaulted template arguments appear only when changed."""
    graph = skinny_program(name)
    default = emit_cuda(graph, arch="sm_90a", options=SKINNY).source
    program = emit_cuda(graph, arch="sm_90a", options=CudaOptions(skinny=True, lead=4))
    assert re.search(r"mdsl::Skinny<[^>]*, false, 4>::run\(", program.source)
    assert not re.search(r"mdsl::Skinny<[^>]*, (true|false), \d+>::run\(", default)
    staggered = emit_cuda(graph, arch="sm_90a", options=CudaOptions(skinny=True, lead=4, stagger=True)).source
    assert re.search(r"mdsl::Skinny<[^>]*, true, 4>::run\(", staggered)
    module = compile_cuda(program.source, arch="sm_90a")
    first = module.resources[program.launches[0].name]
    assert first.spill_store_bytes == 0 and first.stack_bytes == 0, module.log
    if nvdisasm_path() is not None:   # in the SASS: two more iterations' L2 prefetches before the loop
        prefetches = {lead: disassemble(compile_cuda(emit_cuda(graph, arch="sm_90a", options=CudaOptions(
            skinny=True, lead=lead)).source, arch="sm_90a").cubin).count("CCTL.E.PF2") for lead in (2, 4)}
        assert prefetches[4] > prefetches[2], prefetches
    assert CudaOptions.from_env({"MDSL_CUDA_LEAD": "4"}) == CudaOptions(lead=4)
    with pytest.raises(UnsupportedError, match="prefetch lead"):
        CudaOptions(lead=9)
    if nvdisasm_path() is not None:   # lead 0: no L2 prefetches in the loop; overlapping, those of the start
        def prefetches(**kw) -> int:
            source = emit_cuda(graph, arch="sm_90a", options=CudaOptions(skinny=True, **kw)).source
            return disassemble(compile_cuda(source, arch="sm_90a").cubin).count("CCTL.E.PF2")
        assert prefetches(lead=0) == 0
        assert 0 < prefetches(lead=0, overlap=True) < prefetches(lead=2, overlap=True)


def test_prefetches_take_both_lines_where_a_group_s_row_crosses_one():
    """48 columns a block: 96-byte rows at multiples of 32 bytes cross lines; 64 (128 bytes at multiples of
    128) and 32 (64 bytes in 8-byte loads, at multiples of 64) do not."""
    from mdsl.lowering.skinny import straddles
    from mdsl.ir.skinny import skinny_shape
    from mdsl.ir.text import parse_graph
    from tests.ir.skinny_texts import rms_norm_linear

    def crosses(n: int, blocks: int) -> bool:
        graph = parse_graph(rms_norm_linear(16, n, blocks=blocks))
        return straddles(skinny_shape(graph.custom_nodes()[0].body), n * blocks)

    assert crosses(48, 128) and not crosses(64, 96) and not crosses(32, 192)
    source = emit_cuda(parse_graph(rms_norm_linear(16, 48, blocks=128)), arch="sm_90a", options=SKINNY).source
    assert re.search(r"mdsl::Skinny<[^>]*, false, 2, true>::run\(", source)


# ---- steps of two slabs, X's fragments in 16-byte loads (CudaOptions.wide_x)

@pytest.mark.parametrize("name", ["rms_norm_linear_bs8", "rms_norm_linear_bs8_64_columns", "gated_mlp"])
def test_wide_x_loads_x_in_16_bytes_and_halves_its_loads(name):
    """wide_x: the loop's X fragments are 16-byte loads (LDG.E.128.CONSTANT, L1-allocating: the weights' are
    .NA), half as many X loads as 8-byte ones, the weights' loads as wide as before; no spills. Where the
    block's K is not whole pairs of slabs (65 slabs), the plan keeps 16-row steps."""
    graph = skinny_program(name)
    narrow = emit_cuda(graph, arch="sm_90a", options=SKINNY)
    wide = emit_cuda(graph, arch="sm_90a", options=CudaOptions(skinny=True, wide_x=True))
    assert re.search(r"mdsl::Skinny<[^>]*, false, 2, false, true>::run\(", wide.source)
    assert _lowered(graph, CudaOptions(skinny=True, wide_x=True))[1].skinny.wide_x
    odd = skinny_program("rms_norm_linear_5_rows_65_slabs")
    assert not _lowered(odd, CudaOptions(skinny=True, wide_x=True))[1].skinny.wide_x
    module = compile_cuda(wide.source, arch="sm_90a")
    first = module.resources[wide.launches[0].name]
    assert first.spill_store_bytes == 0 and first.stack_bytes == 0, module.log
    if nvdisasm_path() is not None:
        sass_wide, sass_narrow = disassemble(module.cubin), disassemble(compile_cuda(narrow.source, arch="sm_90a").cubin)
        x_wide = len(re.findall(r"LDG\.E\.128\.CONSTANT", sass_wide))
        x_narrow = len(re.findall(r"LDG\.E\.64\.CONSTANT", sass_narrow))
        assert x_wide > 0 and "LDG.E.64.CONSTANT" not in sass_wide
        assert "LDG.E.NA." in sass_wide   # the weights still streamed past L1
        assert x_wide * 2 <= x_narrow + 2   # (the unrolled steady state and tail may round)
    assert CudaOptions.from_env({"MDSL_CUDA_WIDE_X": "1"}) == CudaOptions(wide_x=True)

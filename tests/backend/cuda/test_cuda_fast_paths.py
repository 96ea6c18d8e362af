"""The CUDA backend's fast paths, without a GPU: the switches (CudaOptions and the environment),
tensor cores (HMMA in the SASS) exactly where a block matmul qualifies, cp.async (LDGSTS) exactly
where inputs are pipelined, and every program compiling clean (no spills, no stack) under every
option set. The GPU tests run the same programs against the reference (tests/gpu/test_gpu_fast_paths.py)."""
from __future__ import annotations

import re

import pytest

from mdsl.backend.cuda import compile_cuda, emit_cuda
from mdsl.backend.cuda.nvrtc import nvdisasm_path, sass_opcodes
from mdsl.errors import UnsupportedError
from mdsl.ir.dtypes import bf16, f16, f32
from mdsl.lowering.block import lower
from mdsl.lowering.options import CudaOptions
from tests.backend.acceptance import assert_compiles_clean, compiled
from tests.backend.cuda.fast_paths import FALLBACKS, OPTION_SETS, fast_path_graphs, options_env
from tests.backend.cuda.programs import example_kernels, guided_plan, matmul_benchmark_names
from tests.gpu.harness import with_dtype
from tests.shared import disassembled as disassemble

pytestmark = pytest.mark.shared_compile_cache   # a program's cubin compiled once per session (tests/shared.py)

needs_nvdisasm = pytest.mark.skipif(nvdisasm_path() is None, reason="nvdisasm is not installed "
                                    "(pip install nvidia-cuda-nvdisasm): the SASS cannot be read")


def test_options_from_the_environment():
    assert CudaOptions.from_env({}) == CudaOptions()
    env = {"MDSL_CUDA_MMA": "0", "MDSL_CUDA_REGACC": "off", "MDSL_CUDA_STAGES": "2", "MDSL_CUDA_THREADS": "256",
           "MDSL_CUDA_UNROLL": "1"}
    assert CudaOptions.from_env(env) == CudaOptions(mma=False, register_accumulators=False, stages=2, threads=256,
                                                    unroll=1)
    assert CudaOptions.from_env({"MDSL_CUDA_MMA": "1", "MDSL_CUDA_STAGES": " "}).mma


@pytest.mark.parametrize("env, words", [({"MDSL_CUDA_MMA": "maybe"}, "not a switch"),
                                        ({"MDSL_CUDA_STAGES": "9"}, "1 to 4"),
                                        ({"MDSL_CUDA_STAGES": "two"}, "not an integer"),
                                        ({"MDSL_CUDA_THREADS": "100"}, "multiple of 32"),
                                        ({"MDSL_CUDA_UNROLL": "3"}, "1, 2, 4, 8")])
def test_bad_option_values_say_what_to_set(env, words):
    with pytest.raises(UnsupportedError, match=words) as info:
        CudaOptions.from_env(env)
    assert info.value.hint


def test_emit_cuda_reads_the_environment_when_given_no_options(monkeypatch):
    graph = fast_path_graphs()["ragged_matmuls_f16"]
    monkeypatch.setenv("MDSL_CUDA_MMA", "0")
    assert emit_cuda(graph).source == emit_cuda(graph, options=CudaOptions(mma=False)).source
    monkeypatch.delenv("MDSL_CUDA_MMA")
    assert "mdsl::BlockMma<__half" in emit_cuda(graph).source


def _matmul_program_names() -> list:
    """Programs with matmuls on 16-bit operands: the fast-path set, the hand-written fused examples
    and the guided plans of the benchmarks with a matmul (named here, searched on first use)."""
    out = [name for name, graph in fast_path_graphs().items()
           if any(n.op == "matmul" for c in graph.custom_nodes() for n in c.body.nodes) or name.startswith("kernel_")]
    out += [f"example {name}" for name, graph in example_kernels().items()
            if any(n.op == "matmul" for c in graph.custom_nodes() for n in c.body.nodes)]
    return out + [f"guided plan of {name}" for name in matmul_benchmark_names()]


def _matmul_program(name: str):
    if name.startswith("example "):
        return example_kernels()[name.removeprefix("example ")]
    if name.startswith("guided plan of "):
        return guided_plan(name.removeprefix("guided plan of "))
    return fast_path_graphs()[name]


@needs_nvdisasm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(_matmul_program_names()))
def test_block_matmuls_run_on_tensor_cores_and_only_when_asked(name):
    graph = _matmul_program(name)
    fast = sass_opcodes(disassemble(compiled(emit_cuda(graph, options=CudaOptions()).source).cubin))
    assert fast.get("HMMA", 0) > 0, f"no HMMA in the SASS of {name}"
    # with mma off no kernel calls the tensor-core templates (the prelude's, uninstantiated, make no SASS:
    # test_f32_matmuls_keep_their_precision compiles such a program)
    slow = emit_cuda(graph, options=CudaOptions(mma=False)).source.split("}  // namespace mdsl")[1]
    assert not any(word in slow for word in ("BlockMma<", "RowMma<", "gemm_tile_mma<"))


@needs_nvdisasm
def test_f32_matmuls_keep_their_precision():
    """An f32 program is not rounded to 16 bits for the tensor cores: its matmuls stay scalar."""
    graph = with_dtype(fast_path_graphs()["ragged_matmuls_f16"], f16, f32)
    program = emit_cuda(graph, options=CudaOptions())
    assert "BlockMma" not in program.source.split("}  // namespace mdsl")[1]
    assert sass_opcodes(disassemble(compile_cuda(program.source).cubin)).get("HMMA", 0) == 0


@needs_nvdisasm
@pytest.mark.parametrize("stages, copies", [(1, False), (2, True), (3, True)])
def test_inputs_are_copied_asynchronously_when_pipelined(stages, copies):
    graph = fast_path_graphs()["ragged_matmuls_f16"]
    sass = sass_opcodes(disassemble(compile_cuda(emit_cuda(graph, options=CudaOptions(stages=stages)).source).cubin))
    assert (sass.get("LDGSTS", 0) > 0) == copies


def test_kernel_level_matmuls_take_the_tensor_core_tile_only_when_asked():
    graph = fast_path_graphs()["kernel_matmuls_bf16"]
    fast, slow = (emit_cuda(graph, options=CudaOptions(mma=mma)).source.split("}  // namespace mdsl")[1]
                  for mma in (True, False))
    assert fast.count("mdsl::gemm_tile_mma<__nv_bfloat16,") == 3 and "gemm_tile_mma" not in slow
    assert "gemm_tile_mma" not in emit_cuda(with_dtype(graph, bf16, f32)).source.split("}  // namespace mdsl")[1]


def test_rows_too_narrow_for_cp_async_are_loaded_synchronously():
    graph = fast_path_graphs()["narrow_rows_f16"]
    node = graph.custom_nodes()[0]
    lowered = lower(node.body, tuple(v.type for v in node.inputs), CudaOptions(stages=3))
    assert lowered.memory.stages == 1 and not lowered.memory.slot_bytes
    assert "copy_async" not in emit_cuda(graph, options=CudaOptions(stages=3)).source.split("}  // namespace mdsl")[1]


def test_the_pipeline_keeps_stage_copies_of_each_per_iteration_input():
    graph = fast_path_graphs()["ragged_matmuls_f16"]
    node = graph.custom_nodes()[0]
    types = tuple(v.type for v in node.inputs)
    one, three = lower(node.body, types, CudaOptions(stages=1)), lower(node.body, types, CudaOptions(stages=3))
    assert three.memory.stages == 3 and set(three.memory.slot_bytes) == {i.var.name for i in node.body.inputs}
    for name, slot in three.memory.slot_bytes.items():
        size = {t.name: t.size for t in three.memory.lifetimes}[name]
        assert size == 3 * slot == 3 * {t.name: t.size for t in one.memory.lifetimes}[name]
    assert three.memory.total > one.memory.total


def test_a_sum_in_registers_saves_its_stage():
    graph = fast_path_graphs()["ragged_matmuls_f16"]
    node = graph.custom_nodes()[0]
    types = tuple(v.type for v in node.inputs)
    kept = lower(node.body, types, CudaOptions())
    shared = lower(node.body, types, CudaOptions(register_accumulators=False))
    assert list(kept.register_accumulated) == [1] and not shared.register_accumulated
    assert len(kept.schedule.loop) == len(shared.schedule.loop) - 1
    source = emit_cuda(graph, options=CudaOptions()).source
    assert "in the registers of the mma fragments" in source


#: programs that between them take every fast path (tests/backend/ptx/test_ptx_fast_paths.py checks
#: that they do): every option set is compiled for these, every other program under the default options
REPRESENTATIVES = ("flash_decoding_f16", "ragged_matmuls_f16", "split_combine_f16")
#: the examples compiled with each fast path off (every example compiles under the defaults in
#: test_cuda_acceptance): the hand-written fused kernels (tensor cores, sums in registers, pipelines,
#: row-resident attention, streamed combine) and a specification of standard kernels (the GEMM tile)
REPRESENTATIVE_EXAMPLES = ("gqa.gqa_flash", "rms_norm_linear.rms_norm_linear_fused", "gated_mlp.gated_mlp_fused",
                           "lora.lora")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, options", [(name, o) for name in sorted(fast_path_graphs())
                                           for o in (sorted(OPTION_SETS) if name in REPRESENTATIVES else ["default"])])
def test_fast_path_programs_compile_clean(name, options):
    program = emit_cuda(fast_path_graphs()[name], options=OPTION_SETS[options])
    _check_clean(program)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", FALLBACKS)
@pytest.mark.parametrize("name", REPRESENTATIVE_EXAMPLES)
def test_examples_compile_clean_with_each_fast_path_off(name, options, monkeypatch):
    for key, value in options_env(OPTION_SETS[options]).items():
        monkeypatch.setenv(key, value)
    assert_compiles_clean(example_kernels()[name])


def _check_clean(program) -> None:
    module = compiled(program.source)
    for launch in program.launches:
        r = module.resources[launch.name]
        assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, f"{launch.name}: {r}"


def test_the_option_sets_round_trip_through_the_environment():
    for options in OPTION_SETS.values():
        assert CudaOptions.from_env(options_env(options)) == options


def test_block_loops_unroll_as_asked():
    graph = fast_path_graphs()["ragged_matmuls_f16"]
    thread_loop = re.compile(r"#pragma unroll (\d+)\n\s*for \(int i = threadIdx\.x;")
    rolled, unrolled = (thread_loop.findall(emit_cuda(graph, options=CudaOptions(unroll=u)).source) for u in (1, 4))
    assert rolled and set(rolled) == {"1"} and "4" in unrolled

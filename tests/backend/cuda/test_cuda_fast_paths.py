"""The CUDA backend's fast paths, without a GPU: the switches (CudaOptions and the environment, bad values
refused with what to set), the GEMM tile on tensor cores only when asked, the pipeline's stage copies, and
the examples compiling clean with each fast path off. What both backends share:
tests/backend/test_fast_paths.py. The GPU tests run the same programs against the reference
(tests/gpu/test_gpu_fast_paths.py)."""
from __future__ import annotations

import pytest

from mdsl.backend.cuda import emit_cuda
from mdsl.errors import UnsupportedError
from mdsl.ir.dtypes import bf16, f16, f32
from mdsl.lowering.block import lower
from mdsl.lowering.options import CudaOptions
from tests.backend.acceptance import assert_compiles_clean
from tests.backend.cuda.fast_paths import FALLBACKS, OPTION_SETS, fast_path_graphs, options_env
from tests.backend.cuda.programs import example_kernels
from tests.gpu.harness import with_dtype

pytestmark = pytest.mark.shared_compile_cache   # a program's cubin compiled once per session (tests/shared.py)


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


def test_kernel_level_matmuls_take_the_tensor_core_tile_only_when_asked():
    graph = fast_path_graphs()["kernel_matmuls_bf16"]
    fast, slow = (emit_cuda(graph, options=CudaOptions(mma=mma)).source.split("}  // namespace mdsl")[1]
                  for mma in (True, False))
    tensor_cores = fast.count("mdsl::gemm_tile_mma<__nv_bfloat16,") + fast.count("mdsl::gemm_rows_mma<__nv_bfloat16,")
    assert tensor_cores == 3 and "gemm_tile_mma" not in slow and "gemm_rows_mma<" not in slow
    assert "gemm_tile_mma" not in emit_cuda(with_dtype(graph, bf16, f32)).source.split("}  // namespace mdsl")[1]


def test_kernel_level_matmuls_of_few_rows_take_the_row_kernel():
    """At most ROWS_GEMM_MAX_M rows: 16 columns a block (mdsl::gemm_rows_mma), a batch per grid z; past them
    the 64x64 tile; without tensor cores the scalar tile."""
    from mdsl.backend.cuda.rules import ROWS_GEMM_COLUMNS, ROWS_GEMM_MAX_M
    from tests.backend.cuda.builder import Graph

    g = Graph("few_rows")
    g.op("matmul", g.input("a", (ROWS_GEMM_MAX_M, 300), f16), g.input("b", (300, 1000), f16))
    g.op("matmul", g.input("c", (2, 1, 40), bf16), g.input("d", (2, 40, 33), bf16))
    g.op("matmul", g.input("e", (ROWS_GEMM_MAX_M + 1, 40), f16), g.input("f", (40, 33), f16))
    graph = g.build()
    program = emit_cuda(graph, options=CudaOptions(library_gemm=False))
    code = program.source.split("}  // namespace mdsl")[1]
    assert code.count("mdsl::gemm_rows_mma<") == 2 and code.count("mdsl::gemm_tile_mma<") == 1
    assert [launch.grid for launch in program.launches] == [(-(-1000 // ROWS_GEMM_COLUMNS), 1, 1),
                                                             (-(-33 // ROWS_GEMM_COLUMNS), 1, 2),
                                                             (1, -(-(ROWS_GEMM_MAX_M + 1) // 64), 1)]
    scalar = emit_cuda(graph, options=CudaOptions(library_gemm=False, mma=False)).source
    assert "mdsl::gemm_rows_mma<" not in scalar.split("}  // namespace mdsl")[1]


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


#: the examples compiled with each fast path off (every example compiles under the defaults in
#: tests/backend/test_acceptance.py): the hand-written fused kernels (tensor cores, sums in registers, pipelines,
#: row-resident attention, streamed combine) and a specification of standard kernels (the GEMM tile)
REPRESENTATIVE_EXAMPLES = ("gqa.gqa_flash", "rms_norm_linear.rms_norm_linear_fused", "gated_mlp.gated_mlp_fused",
                           "lora.lora")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", FALLBACKS)
@pytest.mark.parametrize("name", REPRESENTATIVE_EXAMPLES)
def test_examples_compile_clean_with_each_fast_path_off(name, options, monkeypatch):
    for key, value in options_env(OPTION_SETS[options]).items():
        monkeypatch.setenv(key, value)
    assert_compiles_clean(example_kernels()[name])


def test_the_option_sets_round_trip_through_the_environment():
    for options in OPTION_SETS.values():
        assert CudaOptions.from_env(options_env(options)) == options



"""The PTX backend's fast paths, without a GPU, against the CUDA backend's: tensor cores (HMMA in the
SASS of the assembled cubin) in exactly the kernels where the CUDA backend's SASS has them, and every
benchmark case's plan (.plans, else its guided plan) assembling clean under the switches of the lowerings
it takes. What both backends share: tests/backend/test_fast_paths.py. The simulator checks the numbers
(test_ptx_simulated.py); the GPU tests (test_ptx_gpu.py, tests/gpu) run the same programs on the device."""
from __future__ import annotations

import pytest

from mdsl.backend.cuda.nvrtc import nvdisasm_path
from mdsl.backend.ptx import assembler, emit_llvm
from mdsl.lowering.options import CudaOptions
from tests.backend.acceptance import assert_assembles_clean
from tests.backend.backends import emit, has_mma, kernel_body, kernels_with, module, needs_nvdisasm
from tests.backend.cuda.fast_paths import EVERY_OPTION_SET
from tests.backend.ptx.plans import case_names, plan_graph, stored_plans
from tests.backend.test_fast_paths import REPRESENTATIVE_PLAN, matmul_program

pytestmark = [pytest.mark.skipif(assembler() is None, reason="neither nvJitLink nor ptxas is installed"),
              pytest.mark.shared_compile_cache]   # PTX and cubins compiled once per session (tests/shared.py)

#: the default fast paths, every one of which both backends implement
BOTH = CudaOptions()


@needs_nvdisasm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["ragged_matmuls_bf16", "kernel_matmuls_f16", "plan of lora"])
def test_tensor_cores_where_the_cuda_backends_sass_has_them(name):
    graph = matmul_program(name)
    ptx, cuda = (kernels_with(module(backend, emit(backend, graph, BOTH)).cubin, "HMMA") for backend in ("ptx", "cuda"))
    assert ptx == cuda


def _assembles_clean_under(graph, option_sets: dict) -> None:
    """Each option set's program assembled once (sets that emit the same IR, such as a switch the
    program has no use for, share one assembly), clean, with tensor-core instructions (HMMA) and
    ldmatrix (LDSM) in the SASS of exactly the kernels whose IR has mma.sync and ldmatrix."""
    seen = set()
    for name, options in sorted(option_sets.items()):
        program = emit_llvm(graph, options=options)
        if program.llvm_ir in seen:
            continue
        seen.add(program.llvm_ir)
        program, compiled = assert_assembles_clean(graph, options)
        if nvdisasm_path() is None:
            continue   # the SASS cannot be read here
        with_hmma, with_ldsm = kernels_with(compiled.cubin, "HMMA"), kernels_with(compiled.cubin, "LDSM")
        for launch in program.launches:
            kernel = kernel_body("ptx", program, launch.name)
            assert has_mma("ptx", kernel) == (launch.name in with_hmma), f"{launch.name} under {name}"
            assert ("ldmatrix" in kernel) == (launch.name in with_ldsm), f"{launch.name} under {name}"


#: the switches of the lowerings that only attention plans take, for the representative plan (the
#: fast-path representatives of tests/backend/test_fast_paths.py take every option set)
_PLAN_SWITCHES = ("default", "no-rows", "no-hoist", "no-stream")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", case_names())
def test_benchmark_plans_assemble_clean(name):
    options = {o: EVERY_OPTION_SET[o] for o in (_PLAN_SWITCHES if name == REPRESENTATIVE_PLAN else ["default"])}
    _assembles_clean_under(plan_graph(name), options)


def test_every_benchmark_case_has_a_plan_here():
    from benchmarks import kernels

    assert case_names() == sorted(kernels.case_names())
    assert sorted(stored_plans()) in ([], case_names())   # a checkout's stored plans: every case's, or none



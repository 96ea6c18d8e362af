"""The GPU serving device's parts that need no GPU: its rule table covers the ops the CPU device serves,
its step kernels compile for the H200 without spills, and without a GPU `device="gpu"` says so. Its
behaviour on a GPU is tests/gpu/test_gpu_serving.py's."""
from __future__ import annotations

import pytest

from mdsl import LLM
from mdsl.gpu import has_gpu
from mdsl.gpu.driver import NoGPUError
from mdsl.serving.gpu import GPU_STEP_RULES, GROUPS, kernel_source
from mdsl.serving.steprules import STEP_RULES


def test_the_gpu_rules_cover_the_ops_the_cpu_device_serves():
    assert set(GPU_STEP_RULES) == set(STEP_RULES)


def test_the_step_kernels_compile_for_sm_90a_without_spills():
    from mdsl.backend.cuda.nvrtc import compile_cuda

    resources = compile_cuda(kernel_source(), arch="sm_90a").resources
    weighted = ("embedding", "rms_norm", "linear", "add_bias", "head_rms_norm")
    expected = {f"{name}_{s}" for name in weighted for s in ("f32", "bf16", "f16")}
    expected |= {f"{name}_{s}" for name in ("linear_mma",) for s in ("bf16", "f16")}
    expected |= {f"attention_{g}_{dv}" for dv, groups in GROUPS.items() for g in groups}
    expected |= {"rope", "kv_append", "act_mul", "add", "gather", "sum_splits", "argmax_rows", "map_rows"}
    assert set(resources) == expected
    for name, r in resources.items():
        assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, (name, r)


@pytest.mark.skipif(has_gpu(), reason="a GPU is present")
def test_without_a_gpu_the_gpu_device_says_so(checkpoints):
    with pytest.raises(NoGPUError):
        LLM(checkpoints["llama3"].folder, device="gpu")

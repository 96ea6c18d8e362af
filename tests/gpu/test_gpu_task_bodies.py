"""A plan's block run as tasks by a persistent worker (mdsl.backend.cuda.task, tests/backend/tasks.py's runner:
fewer workers than tasks, a scheduler warp outside the compute threads' named barrier) computes the bits the
plan's kernel computes, for each program and with the skinny loop where it applies."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mdsl.gpu import has_gpu

pytestmark = pytest.mark.skipif(not has_gpu(), reason="no GPU")


@pytest.mark.parametrize("skinny", [False, True])
@pytest.mark.parametrize("name", ["norm_linear", "gated", "softmax_rows", "wide_norm"])
def test_a_blocks_tasks_compute_the_kernels_bits(name, skinny):
    from mdsl import gpu as runtime
    from mdsl.backend.cuda.nvrtc import compile_source
    from mdsl.backend.cuda.task import emit_task
    from mdsl.gpu.driver import check, driver, get_device
    from mdsl.lowering.options import CudaOptions
    from tests.backend.tasks import plan_graph, runner_source
    from tests.gpu.harness import poisoned, random_inputs, rng_for, upload

    graph = plan_graph(name)
    options = CudaOptions(skinny=skinny)
    executable = runtime.compile_graph(graph, options=options)
    inputs = random_inputs(graph, rng_for(f"task-{name}-{skinny}"))
    want = poisoned(graph)
    executable(upload(inputs, graph), want)

    body = emit_task(graph, options=options)
    get_device(0)
    module = check(driver.cuModuleLoadData(compile_source(runner_source(body), "sm_90a").cubin), "loading the runner")
    runner = check(driver.cuModuleGetFunction(module, b"runner"), "cuModuleGetFunction")
    check(driver.cuFuncSetAttribute(runner, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    body.smem_bytes), "allowing the runner its shared memory")
    # the body's parameters: its node's inputs and outputs, found among the graph's by name
    ins, outs = upload(inputs, graph), poisoned(graph)
    by_name = {v.name: a for v, a in zip((*graph.inputs, *graph.outputs), (*ins, *outs))}
    arrays = [by_name[v.name] for v in (*body.inputs, *body.outputs)]
    pointers = [ctypes.c_void_p(a.ptr) for a in arrays]
    params = (ctypes.c_void_p * len(pointers))(*[ctypes.addressof(p) for p in pointers])
    workers = min(3, body.tasks)
    check(driver.cuLaunchKernel(runner, workers, 1, 1, body.threads + 32, 1, 1, body.smem_bytes, 0,
                                ctypes.addressof(params), 0), "launching the runner")
    check(driver.cuCtxSynchronize(), "running the runner")
    for got, expected, var in zip(outs, want, graph.outputs):
        g, w = got.to_numpy(), expected.to_numpy()
        assert not np.isnan(w.astype(np.float64)).any(), var.name
        assert np.array_equal(g, w), f"{name}: %{var.name} differs at {np.argwhere(g != w)[:4].tolist()}"

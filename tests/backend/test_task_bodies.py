"""A plan's custom kernel's block as a task's device function (mdsl.backend.cuda.task): written from the kernel's
lowered form without what only a launch has, compiled inside a persistent worker; what it refuses. The GPU test
(tests/gpu/test_gpu_task_bodies.py) runs it against the kernel."""
from __future__ import annotations

import re

import pytest

import mdsl
from mdsl import Tensor, f16
from mdsl.backend.cuda.codegen import emit_cuda
from mdsl.backend.cuda.nvrtc import compile_source
from mdsl.backend.cuda.task import emit_task
from mdsl.errors import UnsupportedError
from mdsl.lowering.options import CudaOptions
from tests.backend.tasks import PROGRAMS, plan_graph, runner_source


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_plans_block_is_a_task_that_a_persistent_worker_compiles(name):
    graph = plan_graph(name)
    for options in (CudaOptions(), CudaOptions(skinny=True, overlap=True, stagger=True)):
        body = emit_task(graph, options=options)
        code = body.source
        # the block's coordinates, barriers and shared memory are the function's; nothing waits on a launch
        for launch_only in ("blockIdx", "gridDim", "blockDim", "__syncthreads", "extern __shared__",
                            "wait_for_previous_kernel", "let_next_kernel_launch"):
            assert launch_only not in code, (name, launch_only)
        skinny = re.search(r"mdsl::Skinny<([^>]*)>", code)
        if skinny:   # (its walk over K not staggered by a block index: STAGGER, the 10th argument, false)
            assert skinny.group(1).split(", ")[9:10] in ([], ["false"]), (name, skinny.group(1))
        assert "mdsl::block_sync<BAR, " in code
        assert re.search(r"template <int BAR>\n__device__ __forceinline__ void \w+_task\(", code)
        assert [v.name for v in body.inputs] == [v.name for v in graph.nodes[0].inputs]
        assert body.tasks == body.grid[0] * body.grid[1] * body.grid[2] >= 1
        compile_source(runner_source(body), "sm_90a")
        # the kernel's own body: its own barriers, one for each of the task's
        kernel = emit_cuda(graph, options=options).source.split("// " + "-" * 98, 1)[1]
        assert "block_sync<BAR" not in kernel
        assert kernel.count("__syncthreads();") == code.count("mdsl::block_sync<BAR, ") > 0, name


def test_a_plan_of_more_than_one_kernel_has_no_task_body():
    @mdsl.kernel
    def two(x: Tensor[8, 64, f16], w: Tensor[64, 64, f16]):
        return mdsl.softmax(x, dim=0) @ w      # as written: two kernels

    with pytest.raises(UnsupportedError, match="one custom kernel"):
        emit_task(two.graph)

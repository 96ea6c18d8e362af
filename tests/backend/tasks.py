"""Programs whose plans are one custom kernel, and a stand-in persistent worker that runs a plan's block as
tasks (mdsl.backend.cuda.task): the CPU test compiles it, the GPU test runs it beside the plan's kernel."""
from __future__ import annotations

import functools

import mdsl
from mdsl import Tensor, f16
from mdsl.backend.cuda.prelude import INCLUDES, PRELUDE
from mdsl.backend.cuda.source import ctype
from mdsl.ir.graph import BlockGraph
from mdsl.search.config import SearchConfig


def _norm_linear():
    @mdsl.kernel
    def norm_linear(x: Tensor[8, 256, f16], w: Tensor[256, 512, f16]):
        return mdsl.rms_norm(x) @ w
    return norm_linear.graph


def _gated():
    @mdsl.kernel
    def gated(x: Tensor[4, 128, f16], g: Tensor[128, 256, f16], u: Tensor[128, 256, f16]):
        return mdsl.silu(x @ g) * (x @ u)
    return gated.graph


def _softmax_rows():
    @mdsl.kernel
    def softmax_rows(x: Tensor[64, 1024, f16], b: Tensor[1, 1024, f16]):
        return mdsl.softmax(x * 0.5 + b, dim=-1)
    return softmax_rows.graph


def _wide_norm():
    @mdsl.kernel
    def wide_norm(x: Tensor[16, 4096, f16], w: Tensor[1, 4096, f16]):
        return mdsl.rms_norm(x) * w
    return wide_norm.graph


PROGRAMS = {"norm_linear": _norm_linear, "gated": _gated, "softmax_rows": _softmax_rows, "wide_norm": _wide_norm}
CONFIG = SearchConfig(budget_s=90, workers=1, exhaustive=False, min_blocks=1)
#: the stand-in worker's barrier for its compute threads (its scheduler warp waits at barrier 0 meanwhile)
BAR = 1


@functools.cache
def plan_graph(name: str):
    """The searched plan's graph of PROGRAMS[name], checked to be one custom kernel."""
    from mdsl.search.engine import search

    graph = search(PROGRAMS[name](), CONFIG).plan().graph
    assert [type(n.body) for n in graph.nodes] == [BlockGraph], (name, [n.op for n in graph.nodes])
    return graph


def runner_source(body) -> str:
    """A translation unit: the prelude, the task body, and `runner`, a persistent worker of the body's threads
    plus a scheduler warp: the warp's first lane takes the block's next task (blockIdx.x, then gridDim.x further
    each time) and hands it over through shared memory at barrier 0; the compute threads run it with barrier
    BAR among themselves while the warp waits at barrier 0 for the next hand-over. Fewer workers than tasks run
    several each in turn, the task's shared memory reused."""
    gx, gy, _ = body.grid
    params = [f"const {ctype(v.dtype)}* a{i}" for i, v in enumerate(body.inputs)]
    params += [f"{ctype(v.dtype)}* a{len(body.inputs) + i}" for i, v in enumerate(body.outputs)]
    args = ", ".join(f"a{i}" for i in range(len(params)))
    return INCLUDES + PRELUDE + body.source + f"""
extern "C" __global__ void __launch_bounds__({body.threads + 32}, 1) runner({', '.join(params)}) {{
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int task;
  for (int k = 0;; ++k) {{
    if (threadIdx.x == {body.threads}) task = k == 0 ? int(blockIdx.x) : task + int(gridDim.x);
    __syncthreads();
    const int t = task;
    if (t >= {body.tasks}) return;
    if (threadIdx.x < {body.threads}) {body.name}<{BAR}>({args}, t % {gx}, t / {gx} % {gy}, t / ({gx * gy}), smem);
    __syncthreads();
  }}
}}
"""

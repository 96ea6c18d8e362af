"""CUDA programs written by hand, to test the runtime apart from the code generator: an axpy, and a
kernel that needs more than 48 KB of dynamic shared memory."""
from __future__ import annotations

from mdsl.backend.cuda.codegen import CudaProgram
from mdsl.gpu.program import KernelLaunch
from mdsl.ir.dtypes import f32
from mdsl.ir.graph import KernelGraph, Node, make_var
from mdsl.ir.ops import get_op

THREADS = 256
SMEM_FLOATS = 16384   # 64 KB: over the 48 KB a kernel gets without opting in


def _graph(name: str, n: int, ops: list) -> KernelGraph:
    """A kernel graph of element-wise ops on f32[n] vectors (the types the runtime checks against):
    `ops` is [(op, input names, output name, attributes)]."""
    values = {}
    inputs = []
    nodes = []
    for op, ins, out, attrs in ops:
        for name_ in ins:
            if name_ not in values:
                values[name_] = make_var(name_, (n,), f32)
                inputs.append(values[name_])
        values[out] = make_var(out, (n,), f32)
        nodes.append(Node(op, [values[i] for i in ins], [values[out]], get_op(op).normalize_attrs(attrs)))
    return KernelGraph(name, inputs, nodes, [nodes[-1].outputs[0]])


def axpy(n: int) -> CudaProgram:
    """z = 2x + y on f32[n]: one launch with arguments (x, y, z); `t` (2x) is never materialised."""
    source = f"""
extern "C" __global__ void axpy(const float* __restrict__ x, const float* __restrict__ y, float* __restrict__ z) {{
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < {n}u) z[i] = 2.0f * x[i] + y[i];
}}
"""
    graph = _graph("axpy", n, [("mul_scalar", ["x"], "t", {"value": 2.0}), ("add", ["t", "y"], "z", {})])
    launch = KernelLaunch("axpy", ((n + THREADS - 1) // THREADS, 1, 1), (THREADS, 1, 1), 0, ("x", "y", "z"), 1)
    return CudaProgram(source, (launch,), (), graph)


def reverse_through_shared_memory(blocks: int) -> CudaProgram:
    """z = -x on f32[blocks * 16384], each block staging its 64 KB slice in dynamic shared memory and
    reading it back reversed twice (so a wrong smem size or a missing barrier shows)."""
    n = blocks * SMEM_FLOATS
    source = f"""
extern "C" __global__ void __launch_bounds__({THREADS})
negate_via_smem(const float* __restrict__ x, float* __restrict__ z) {{
  extern __shared__ float stage[];
  const float* src = x + blockIdx.x * {SMEM_FLOATS};
  float* dst = z + blockIdx.x * {SMEM_FLOATS};
  for (unsigned i = threadIdx.x; i < {SMEM_FLOATS}u; i += blockDim.x) stage[{SMEM_FLOATS} - 1 - i] = src[i];
  __syncthreads();
  for (unsigned i = threadIdx.x; i < {SMEM_FLOATS}u; i += blockDim.x) dst[i] = -stage[{SMEM_FLOATS} - 1 - i];
}}
"""
    graph = _graph("negate", n, [("neg", ["x"], "z", {})])
    launch = KernelLaunch("negate_via_smem", (blocks, 1, 1), (THREADS, 1, 1), SMEM_FLOATS * 4, ("x", "z"), 0)
    return CudaProgram(source, (launch,), (), graph)

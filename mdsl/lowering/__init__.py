"""The lowering both backends emit: a kernel graph's kernels as the CUDA backend (mdsl.backend.cuda, C++)
and the PTX backend (mdsl.backend.ptx, LLVM IR) write them, decided once.

* `options`: which fast paths the code takes (`CudaOptions`, the MDSL_CUDA_* switches);
* `program`: the graph the backends write, one kernel (or alias) per node; `gemm`: which of them are plain
  matmuls the runtime may hand to cuBLAS; `names`: kernel and value names, and the op markers; `grid`: grids, lanes and thread counts; `index`: index arithmetic;
* `block`: a block graph's lowering (`Lowered`: schedule, layout, memory plan and the choices on them),
  with the plans of `mma` (tensor cores), `rows` (row-resident chains), `streamed` (folds from device
  memory) and `skinny` (weights streamed into registers);
* `kernel`: a custom kernel's lowered form (`CustomKernel`): what it does, in order, step by step; a split
  and its combine as one kernel (`OneLaunchKernel`), where `onelaunch` says they qualify.
"""

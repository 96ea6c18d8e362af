"""The GPU runtime: the CUDA driver (`driver`), device arrays and the array protocols of other libraries
(`arrays`, `dlpack`), executables that launch a compiled program's kernels (`executable`), what a code
generator hands the runtime (`program`), the on-disk compile cache (`cache`), and the code generators by
backend name (`generators`: `compile_graph`). It imports no backend: backends register their code
generators with it.

Arguments: torch tensors, anything with `__cuda_array_interface__` (v2/v3) or a CUDA `__dlpack__`,
and `DeviceArray`s; each must be a compact row-major array on the GPU whose address is 16-byte aligned.
"""
from mdsl.gpu.arrays import (ALIGNMENT, ArgumentError, DeviceArray, View, device_view, is_torch_tensor,
                             launch_stream, stream_handle)
from mdsl.gpu.driver import CudaError, NoGPUError, has_gpu, l2_bytes, require_gpu, target_arch
from mdsl.gpu.executable import BufferPlan, EmptyKernel, Executable, overlapping_launch, plan_buffers
from mdsl.gpu.generators import BACKENDS, CodeGenerator, check_backend, compile_graph, generator, register
from mdsl.gpu.program import CompiledModule, KernelLaunch, Resources

__all__ = ["ALIGNMENT", "ArgumentError", "DeviceArray", "View", "device_view", "is_torch_tensor", "launch_stream",
           "stream_handle", "CudaError", "NoGPUError", "has_gpu", "l2_bytes", "require_gpu", "target_arch",
           "BufferPlan", "EmptyKernel", "Executable", "overlapping_launch", "plan_buffers", "BACKENDS",
           "CodeGenerator", "check_backend", "compile_graph", "generator", "register", "CompiledModule",
           "KernelLaunch", "Resources"]

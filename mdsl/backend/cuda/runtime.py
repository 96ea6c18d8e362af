"""The GPU runtime (mdsl.gpu) under the CUDA backend's name, with the CUDA backend's compiler: the module
the frontend, the megakernel engine, the benchmarks and the scripts call `runtime`. `compile_source` is
NVRTC's compile of CUDA source (mdsl.backend.cuda.nvrtc), once per process; `hopper_gemm` is the standalone
wgmma/TMA product C = A W^T (mdsl.backend.cuda.hopper_gemm)."""
from mdsl.backend.cuda.hopper_gemm import hopper_gemm
from mdsl.backend.cuda.nvrtc import compile_source
from mdsl.gpu.arrays import (ALIGNMENT, ArgumentError, DeviceArray, View, device_view, is_torch_tensor,
                             launch_stream, stream_handle)
from mdsl.gpu.driver import (CudaError, NoGPUError, driver, has_gpu, l2_bytes, release_pending, require_gpu,
                             target_arch)
from mdsl.gpu.driver import check as _check
from mdsl.gpu.driver import cu_stream as _cu_stream
from mdsl.gpu.driver import error_text as _error_text
from mdsl.gpu.driver import get_device as _device
from mdsl.gpu.executable import BufferPlan, EmptyKernel, Executable, overlapping_launch, plan_buffers
from mdsl.gpu.generators import BACKENDS, check_backend, compile_graph

__all__ = ["compile_source", "hopper_gemm", "ALIGNMENT", "ArgumentError", "DeviceArray", "View", "device_view", "is_torch_tensor",
           "launch_stream", "stream_handle", "CudaError", "NoGPUError", "driver", "has_gpu", "l2_bytes",
           "release_pending", "require_gpu", "target_arch", "BufferPlan", "EmptyKernel", "Executable",
           "overlapping_launch", "plan_buffers", "BACKENDS", "check_backend", "compile_graph", "_check", "_cu_stream", "_error_text",
           "_device"]

"""The GPU runtime: the CUDA driver (`driver`), device arrays and the array protocols of other libraries
(`arrays`, `dlpack`), executables that launch a compiled program's kernels (`executable`), calls checked
once per argument signature and then only launched (`signature`, `calls`), what a code generator hands
the runtime (`program`), the on-disk compile cache (`cache`), and the code generators by
backend name (`generators`: `compile_graph`). It imports no backend: backends register their code
generators with it.

Arguments: torch tensors, anything with `__cuda_array_interface__` (v2/v3) or a CUDA `__dlpack__`,
and `DeviceArray`s; each must be a compact row-major array on the GPU whose address is 16-byte aligned.

The names below are the runtime's API, each loaded from its module when first used: importing mdsl.gpu
(or a backend, which registers with it) loads neither cuda.bindings nor any CUDA library.
"""
import importlib

_EXPORTS = {
    "mdsl.gpu.arrays": ("ALIGNMENT", "ArgumentError", "DeviceArray", "View", "device_view", "is_torch_tensor",
                        "launch_stream", "stream_handle"),
    "mdsl.gpu.driver": ("CudaError", "NoGPUError", "has_gpu", "l2_bytes", "require_gpu", "target_arch"),
    "mdsl.gpu.executable": ("BufferPlan", "EmptyKernel", "Executable", "overlapping_launch", "plan_buffers"),
    "mdsl.gpu.generators": ("BACKENDS", "CodeGenerator", "check_backend", "compile_graph", "generator", "register"),
    "mdsl.gpu.program": ("CompiledModule", "KernelLaunch", "Resources"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'mdsl.gpu' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))

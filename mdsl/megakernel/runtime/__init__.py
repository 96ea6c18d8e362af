"""The megakernel's GPU runtime: the device task tables of one persistent kernel (task_plan), its CUDA C++
(kernel_source, the task bodies generated per layer op in cuda_bodies, device.cu and its headers), its
options (megakernel_options), the host engine (megakernel_engine: weights, KV cache, generate) and the
profiler's trace export and replay."""
from mdsl.megakernel.runtime.kernel_source import KERNEL_NAME, generate_source
from mdsl.megakernel.runtime.megakernel_options import MegakernelOptions
from mdsl.megakernel.runtime.shape import DecoderShape, decoder_shape
from mdsl.megakernel.runtime.task_plan import Kind, TaskPlan, build_plan, check_plan, for_ranks

__all__ = ["MegakernelOptions", "Kind", "TaskPlan", "build_plan", "check_plan", "for_ranks", "DecoderShape",
           "decoder_shape", "KERNEL_NAME", "generate_source", "MegakernelEngine", "compile_model"]


def __getattr__(name):
    if name in ("MegakernelEngine", "compile_model"):   # the engine imports the driver bindings: when asked for
        from mdsl.megakernel.runtime import megakernel_engine

        return getattr(megakernel_engine, name)
    raise AttributeError(name)

"""The megakernel's GPU runtime: task tables for one persistent kernel (plan), its CUDA C++ (source,
device.cu), the host engine (engine: weights, KV cache, generate) and the profiler's trace export."""
from mdsl.megakernel.runtime.plan import Kind, TaskPlan, build_plan, check_plan
from mdsl.megakernel.runtime.shape import DecoderShape, decoder_shape
from mdsl.megakernel.runtime.source import KERNEL_NAME, generate_source

__all__ = ["Kind", "TaskPlan", "build_plan", "check_plan", "DecoderShape", "decoder_shape", "KERNEL_NAME",
           "generate_source", "MegakernelEngine", "compile_model"]


def __getattr__(name):
    if name in ("MegakernelEngine", "compile_model"):   # the engine imports the driver bindings: when asked for
        from mdsl.megakernel.runtime import engine

        return getattr(engine, name)
    raise AttributeError(name)

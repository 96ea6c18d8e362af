"""The megakernel's GPU runtime: task tables for one persistent kernel (plan), its CUDA C++ (source,
device.cu and its headers), its options (options), the host engine (engine: weights, KV cache, generate),
tensor parallelism over the GPUs of one host (tp, nvshmem) and the profiler's trace export."""
from mdsl.megakernel.runtime.options import MegakernelOptions
from mdsl.megakernel.runtime.plan import Kind, TaskPlan, build_plan, check_plan, for_ranks
from mdsl.megakernel.runtime.shape import DecoderShape, decoder_shape
from mdsl.megakernel.runtime.source import KERNEL_NAME, generate_source
from mdsl.megakernel.runtime.tp import TensorParallelGroup, shard_config

__all__ = ["MegakernelOptions", "Kind", "TaskPlan", "build_plan", "check_plan", "for_ranks", "DecoderShape",
           "decoder_shape", "KERNEL_NAME", "generate_source", "MegakernelEngine", "compile_model",
           "TensorParallelGroup", "shard_config"]


def __getattr__(name):
    if name in ("MegakernelEngine", "compile_model"):   # the engine imports the driver bindings: when asked for
        from mdsl.megakernel.runtime import engine

        return getattr(engine, name)
    raise AttributeError(name)

"""Serving many requests at once: continuous batching over a paged KV cache, per-request sampling and
streamed tokens. `LLM` is the host engine; it speaks the protocol of `mdsl.serving.protocol` to a
device: the CPU device (`mdsl.serving.cpu`, numpy), the GPU device (`mdsl.serving.gpu`: the same scheduler on
the host, each step's forward on the GPU) or the megakernel device (`mdsl.serving.megakernel`: the scheduler and
every step inside one resident kernel)."""
from mdsl.serving.engine import LLM, RequestHandle, RequestOutput, ServingStats
from mdsl.serving.params import SamplingParams, ServingError

__all__ = ["LLM", "RequestHandle", "RequestOutput", "SamplingParams", "ServingError", "ServingStats"]

"""mdsl: a Python DSL that superoptimizes tensor programs into fast GPU kernels.

    import mdsl
    from mdsl import Tensor, f16

    @mdsl.kernel
    def rms_norm_linear(x: Tensor[16, 4096, f16], w: Tensor[4096, 6144, f16]):
        return mdsl.rms_norm(x) @ w

    print(rms_norm_linear.graph)     # the traced kernel graph
"""
from mdsl._version import __version__
from mdsl.errors import (DTypeError, MdslError, ParseError, ShapeError, TraceError, UnsupportedError,
                         ValidationError)
from mdsl.frontend.functions import *  # noqa: F401,F403 - the operator functions (PUBLIC_FUNCTIONS)
from mdsl.frontend.functions import PUBLIC_FUNCTIONS as _OPERATOR_FUNCTIONS
from mdsl.frontend.kernel import KernelFunction, kernel
from mdsl.frontend.tensor import Tensor, TensorSpec
from mdsl.frontend.tracer import BlockBuilder, block_graph
from mdsl.ir.dtypes import bf16, f16, f32, i32
from mdsl.megakernel.modelgraph.model import ModelFunction, model
from mdsl.serving import LLM, SamplingParams

__all__ = [
    "MdslError", "DTypeError", "ParseError", "ShapeError", "TraceError", "UnsupportedError", "ValidationError",
    *_OPERATOR_FUNCTIONS, "KernelFunction", "kernel", "Tensor", "TensorSpec",
    "BlockBuilder", "block_graph", "bf16", "f16", "f32", "i32", "ModelFunction", "model", "LLM", "SamplingParams",
]

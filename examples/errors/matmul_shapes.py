"""A kernel with a shape error, to show what mdsl reports:

    mdsl optimize examples/errors/matmul_shapes.py:rms_norm_linear

W has 2048 rows where X has 4096 columns, so the product cannot be formed. The error names this file,
the line and the expression, and says how to fix it.
"""
import mdsl
from mdsl import Tensor, f16


@mdsl.kernel
def rms_norm_linear(x: Tensor[2, 4096, f16], w: Tensor[2048, 6144, f16]):
    y = mdsl.rms_norm(x)
    return y @ w

"""LoRA: a linear layer plus its low-rank adapter, X·W + X·A·B.

X (16, 256), W (256, 4096), A (256, 16), B (16, 4096): the adapter's rank is 16.
"""
import numpy as np

import mdsl
from mdsl import Tensor, f16


@mdsl.kernel
def lora(x: Tensor[16, 256, f16], w: Tensor[256, 4096, f16], a: Tensor[256, 16, f16], b: Tensor[16, 4096, f16]):
    return x @ w + x @ a @ b


if __name__ == "__main__":
    print(lora.graph, end="\n\n")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 256)).astype(np.float16)
    w = (rng.standard_normal((256, 4096)) / 16).astype(np.float16)
    a = (rng.standard_normal((256, 16)) / 16).astype(np.float16)
    b = (rng.standard_normal((16, 4096)) / 4).astype(np.float16)
    y = lora(x, w, a, b)
    print("output", y.shape, y.dtype)

"""nTrans, the nGPT residual update: rms_norm(X + α ⊙ (rms_norm(H) − X)).

H (the block's output), X (the hidden state) and α (the learned step sizes) are each (8·bs, 4096).
The norms are over the hidden dim.
"""
import numpy as np

import mdsl
from mdsl import Tensor, f16


def make_ntrans(bs: int = 1, hidden: int = 4096) -> mdsl.KernelFunction:
    rows = 8 * bs

    @mdsl.kernel(name=f"ntrans_bs{bs}")
    def ntrans(h: Tensor[rows, hidden, f16], x: Tensor[rows, hidden, f16], alpha: Tensor[rows, hidden, f16]):
        return mdsl.rms_norm(x + alpha * (mdsl.rms_norm(h) - x))

    return ntrans


ntrans = make_ntrans(1)
ntrans_bs8 = make_ntrans(8)


if __name__ == "__main__":
    print(ntrans.graph, end="\n\n")
    rng = np.random.default_rng(0)
    h, x = (rng.standard_normal((8, 4096)).astype(np.float16) for _ in range(2))
    alpha = rng.uniform(0.0, 0.1, (8, 4096)).astype(np.float16)
    y = ntrans(h, x, alpha)
    rms = np.sqrt(np.mean(np.square(y.astype(np.float32)), axis=-1))
    print("output", y.shape, y.dtype, "rms of the first rows:", rms[:4])

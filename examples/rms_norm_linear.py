"""RMSNorm + Linear: rms_norm(X) @ W with X (2·bs, 4096) and W (4096, 6144).

`rms_norm_linear` is the specification. `rms_norm_linear_fused` is the fused kernel written by
hand: since rms_norm(X) @ W = (X @ W) / rms(X) row by row, one loop over K accumulates both the
product and the sum of squares, and the division happens once, after the loop.
"""
import numpy as np

import mdsl
from mdsl import Tensor, f16

EPS = 1e-6  # the spec and the fused kernel must use the same epsilon


def make_rms_norm_linear(bs: int = 1, k: int = 4096, n: int = 6144) -> mdsl.KernelFunction:
    m = 2 * bs

    @mdsl.kernel(name=f"rms_norm_linear_bs{bs}")
    def rms_norm_linear(x: Tensor[m, k, f16], w: Tensor[k, n, f16]):
        return mdsl.rms_norm(x, eps=EPS) @ w

    return rms_norm_linear


def make_rms_norm_linear_fused(m: int = 2, k: int = 4096, n: int = 6144, grid_x: int = 48, forloop: int = 64,
                               eps: float = EPS) -> mdsl.KernelFunction:
    """One custom kernel: grid_x blocks each own n / grid_x columns of W and loop over K in `forloop` steps."""

    @mdsl.kernel
    def rms_norm_linear_fused(x: Tensor[m, k, f16], w: Tensor[k, n, f16]):
        with mdsl.block_graph(grid=(grid_x,), forloop=forloop) as b:
            xt = b.input(x, imap=(None,), fmap=1)    # every block reads all of X, a K-chunk per iteration
            wt = b.input(w, imap=(1,), fmap=0)       # W's columns split over the grid, its rows over the loop
            y = b.accum(xt @ wt) / b.accum_rms(xt, eps=eps)
            b.output(y, omap=(1,))                   # blocks' column tiles side by side
        return b.results[0]

    return rms_norm_linear_fused


rms_norm_linear = make_rms_norm_linear(1)
rms_norm_linear_bs8 = make_rms_norm_linear(8)
rms_norm_linear_fused = make_rms_norm_linear_fused()


if __name__ == "__main__":
    print(rms_norm_linear.graph, end="\n\n")
    print(rms_norm_linear_fused.graph, end="\n\n")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4096)).astype(np.float16)
    w = (rng.standard_normal((4096, 6144)) / 64).astype(np.float16)
    y = rms_norm_linear(x, w)
    print("output", y.shape, y.dtype)
    print("fused vs rms_norm(X) @ W: max |diff| =", np.abs(rms_norm_linear_fused(x, w) - y).max())

"""QKNorm + attention: GQA decode attention with RMSNorm over the head dim of Q and of K first.

Shapes as in `gqa.py`. The head dim is Q's last dim but K's dim 1, since K is stored transposed.
"""
import numpy as np

import mdsl
from mdsl import Tensor, f16


def make_qknorm(bs: int = 1, kv_len: int = 4096, queries: int = 256, head_dim: int = 64) -> mdsl.KernelFunction:
    heads = 2 * bs

    @mdsl.kernel(name=f"qknorm_bs{bs}")
    def qknorm(q: Tensor[heads, queries, head_dim, f16], k: Tensor[heads, head_dim, kv_len, f16],
               v: Tensor[heads, kv_len, head_dim, f16]):
        q = mdsl.rms_norm(q, dim=-1)
        k = mdsl.rms_norm(k, dim=1)
        return mdsl.softmax(q @ k) @ v

    return qknorm


qknorm = make_qknorm(1)
qknorm_bs8 = make_qknorm(8)


if __name__ == "__main__":
    print(qknorm.graph, end="\n\n")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 256, 64)).astype(np.float16)
    k = rng.standard_normal((2, 64, 4096)).astype(np.float16)
    v = rng.standard_normal((2, 4096, 64)).astype(np.float16)
    out = qknorm(q, k, v)
    print("output", out.shape, out.dtype, "row sums of |out| (first 4):", np.abs(out[0, :4]).sum(-1))

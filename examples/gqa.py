"""GQA decode attention: softmax(Q·K)·V for one decode step of grouped-query attention.

Q (2·bs, 256, 64): per KV head, 256 query rows (query heads × tokens) of head dim 64.
K (2·bs, 64, 4096) and V (2·bs, 4096, 64): that KV head's keys (stored transposed) and values.

`gqa` is the specification the superoptimizer starts from. `gqa_flash` is flash-decoding written by
hand as two custom kernels: the first splits the KV length over blocks and runs online softmax over
chunks of it; the second combines the per-split partial results.
"""
import numpy as np

import mdsl
from mdsl import Tensor, f16


def make_gqa(bs: int = 1, kv_len: int = 4096, queries: int = 256, head_dim: int = 64) -> mdsl.KernelFunction:
    heads = 2 * bs

    @mdsl.kernel(name=f"gqa_bs{bs}")
    def gqa(q: Tensor[heads, queries, head_dim, f16], k: Tensor[heads, head_dim, kv_len, f16],
            v: Tensor[heads, kv_len, head_dim, f16]):
        return mdsl.softmax(q @ k) @ v

    return gqa


def make_gqa_flash(bs: int = 1, splits: int = 16, forloop: int = 4, row_blocks: int = 4, kv_len: int = 4096,
                   queries: int = 256, head_dim: int = 64) -> mdsl.KernelFunction:
    """Flash-decoding on grid (heads, splits, row_blocks): block (h, s, r) owns the r-th slice of
    head h's query rows and the s-th slice of its KV length, which it walks in `forloop` chunks."""
    heads = 2 * bs

    @mdsl.kernel(name=f"gqa_flash_bs{bs}")
    def gqa_flash(q: Tensor[heads, queries, head_dim, f16], k: Tensor[heads, head_dim, kv_len, f16],
                  v: Tensor[heads, kv_len, head_dim, f16]):
        with mdsl.block_graph(grid=(heads, splits, row_blocks), forloop=forloop) as b:
            qt = b.input(q, imap=(0, None, 1))            # this block's query rows, every iteration
            kt = b.input(k, imap=(0, 2, None), fmap=2)    # this split's keys, one chunk per iteration
            vt = b.input(v, imap=(0, 1, None), fmap=1)
            s = qt @ kt
            m = mdsl.max(s, -1, keepdim=True)             # the chunk's row maximum
            e = mdsl.exp(s - m)
            # online softmax: each chunk's partial results are scaled by exp(m - the split's maximum)
            b.output(b.accum_rescale(e @ vt, m), omap=(0, 2, 1))   # O: splits side by side along dim 2
            b.output(b.accum_sum_rescale(e, m), omap=(0, 2, 1))    # L: the row sums of exp
            b.output(b.accum_max(m), omap=(0, 2, 1))               # M: the row maxima
        o_splits, l_splits, m_splits = b.results

        # combine: loop over the splits, rescaling each to the overall maximum
        with mdsl.block_graph(grid=(heads, row_blocks), forloop=splits) as c:
            ot = c.input(o_splits, imap=(0, 1), fmap=2)
            lt = c.input(l_splits, imap=(0, 1), fmap=2)
            mt = c.input(m_splits, imap=(0, 1), fmap=2)
            c.output(c.accum_rescale(ot, mt) / c.accum_rescale(lt, mt), omap=(0, 1))
        return c.results[0]

    return gqa_flash


gqa = make_gqa(1)
gqa_bs8 = make_gqa(8)
gqa_flash = make_gqa_flash(1)


if __name__ == "__main__":
    print(gqa.graph, end="\n\n")
    print(gqa_flash.graph, end="\n\n")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 256, 64)).astype(np.float16)
    k = rng.standard_normal((2, 64, 4096)).astype(np.float16)
    v = rng.standard_normal((2, 4096, 64)).astype(np.float16)
    out = gqa(q, k, v)
    print("output", out.shape, out.dtype)
    print("flash-decoding vs softmax(Q·K)·V: max |diff| =", np.abs(gqa_flash(q, k, v) - out).max())

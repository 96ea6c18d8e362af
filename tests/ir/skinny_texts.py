"""Block graphs with a skinny loop (mdsl.ir.skinny) in the textual IR, shared by the IR tests and the CUDA
backend's programs (tests/backend/cuda/programs.SKINNY_PROGRAMS)."""
from __future__ import annotations

_RNL = """kernel rnl_{m}_rows(%x: f16[{m}, {k}], %w: f16[{k}, {cols}]) {{
  %matmul: f16[{m}, {cols}] = custom(%x, %w) block(grid=[{blocks}, 1, 1], threads=128, forloop={forloop}) {{
    in %x: f16[{m}, {kt}] imap=[-, -, -] fmap=1
    in %w: f16[{kt}, {n}] imap=[1, -, -] fmap=0
    %accum_rms: f16[{m}, 1] = accum_rms(%x) {{eps=1e-06}}
    %matmul: f16[{m}, {n}] = matmul(%x, %w)
    %accum: f16[{m}, {n}] = accum(%matmul)
    %div: f16[{m}, {n}] = div(%accum, %accum_rms)
    out %div omap=[1, -, -]
  }}
  return %matmul
}}"""


def rms_norm_linear(m: int, n: int, blocks: int = 96, k: int = 4096, forloop: int = 32) -> str:
    """RMSNorm+Linear's block graph: X of m rows times a weight of n columns a block over `blocks` blocks,
    the block's K (all of it) in `forloop` iterations."""
    return _RNL.format(m=m, n=n, blocks=blocks, cols=n * blocks, k=k, forloop=forloop, kt=k // forloop)

_PROLOGUE = """kernel prologue_{m}_rows(%x: f16[{m}, {k}], %w: f16[{k}, {cols}]) {{
  %matmul: f16[{m}, {cols}] = custom(%x, %w) block(grid=[{blocks}, 1, 1], threads=128, forloop={forloop}) {{
    in %x: f16[{m}, {kt}] imap=[-, -, -] fmap=1
    in %w: f16[{kt}, {n}] imap=[1, -, -] fmap=0
    %mul_scalar: f16[{m}, {kt}] = mul_scalar(%x) {{value=2.0}}
    %silu: f16[{m}, {kt}] = silu(%mul_scalar)
    %accum_rms: f16[{m}, 1] = accum_rms(%silu) {{eps=1e-06}}
    %matmul: f16[{m}, {n}] = matmul(%silu, %w)
    %accum: f16[{m}, {n}] = accum(%matmul)
    %div: f16[{m}, {n}] = div(%accum, %accum_rms)
    out %div omap=[1, -, -]
  }}
  return %matmul
}}"""


def prologue_linear(m: int, n: int, blocks: int = 96, k: int = 4096, forloop: int = 32) -> str:
    """rms_norm(silu(2 x)) @ w: RMSNorm+Linear's block graph with an element-wise prologue on X (its
    values computed from X's fragments in the loop), shaped as `rms_norm_linear`."""
    return _PROLOGUE.format(m=m, n=n, blocks=blocks, cols=n * blocks, k=k, forloop=forloop, kt=k // forloop)

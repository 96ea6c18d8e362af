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

_VECTOR = """kernel vector_prologue_{m}_rows(%x: {e}[{m}, {k}], %b: {e}[{vector}], %w: {e}[{k}, {cols}]) {{
  %matmul: {e}[{m}, {cols}] = custom(%x, %b, %w) block(grid=[{blocks}, 1, 1], threads=128, forloop={forloop}) {{
    in %x: {e}[{m}, {kt}] imap=[-, -, -] fmap=1
    in %b: {e}[{vector_tile}] imap=[-, -, -] fmap={vector_fmap}
    in %w: {e}[{kt}, {n}] imap=[1, -, -] fmap=0
{body}
  }}
  return %matmul
}}"""

_VECTOR_BODIES = {
    "sub": """    %sub: {e}[{m}, {kt}] = sub(%x, %b)
    %matmul: {e}[{m}, {n}] = matmul(%sub, %w)
    %accum: {e}[{m}, {n}] = accum(%matmul)
    out %accum omap=[1, -, -]""",
    "mul_rms": """    %mul: {e}[{m}, {kt}] = mul(%x, %b)
    %accum_rms: {e}[{m}, 1] = accum_rms(%mul) {{eps=1e-06}}
    %matmul: {e}[{m}, {n}] = matmul(%mul, %w)
    %accum: {e}[{m}, {n}] = accum(%matmul)
    %div: {e}[{m}, {n}] = div(%accum, %accum_rms)
    out %div omap=[1, -, -]""",
}


def vector_prologue_linear(m: int, n: int, blocks: int = 96, k: int = 4096, forloop: int = 32, body: str = "sub",
                           dtype: str = "f16", rank: int = 2) -> str:
    """A prologue reading a vector along K, b ([1, K], or [K] at `rank` 1), broadcast over X's rows: `(x - b)
    @ w` ("sub"), or rms_norm(x * b) @ w ("mul_rms": the row fold of the operand too), shaped as
    `rms_norm_linear`."""
    kt = k // forloop
    fields = dict(m=m, n=n, blocks=blocks, cols=n * blocks, k=k, forloop=forloop, kt=kt, e=dtype,
                  vector=f"1, {k}" if rank == 2 else k, vector_tile=f"1, {kt}" if rank == 2 else kt,
                  vector_fmap=rank - 1)
    return _VECTOR.format(body=_VECTOR_BODIES[body].format(**fields), **fields)

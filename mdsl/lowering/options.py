"""The lowering options: which fast paths the emitted code takes, the same for both backends (the names
keep the CUDA backend's, where they began).

Every fast path can be switched off, by the caller (`CudaOptions(...)` given to `emit_cuda` or
`emit_llvm`) or, where the caller gives none, by the environment, so that a run on a GPU can compare a
new path with the old one without changing code:

    MDSL_CUDA_MMA=0         block-level matmuls as scalar FMA loops instead of tensor-core mma.sync
    MDSL_CUDA_REGACC=0      accum(matmul(..)) kept in shared memory instead of the mma's registers
    MDSL_CUDA_STAGES=n      per-iteration input tiles loaded n deep with cp.async (1: synchronous loads)
    MDSL_CUDA_THREADS=n     threads per block of custom kernels (default: the block graph's own)
    MDSL_CUDA_UNROLL=n      unrolling of block-level element loops (1: rolled)
    MDSL_CUDA_STREAM=0      loops that only fold input tiles element-wise (split combines) through shared
                            memory instead of each thread folding its elements from device memory (`streamed.py`)
    MDSL_CUDA_HOIST=0       loop-invariant block nodes computed every iteration instead of once before the loop
    MDSL_CUDA_ROWS=0        loop chains on the same rows (online softmax) through shared memory, op by op,
                            instead of in the mma registers of the warp owning the rows (`rows.py`)
    MDSL_CUDA_SKINNY=1      loops of matmuls of at most 16 rows stream their weights from device memory into
                            registers (`skinny.py`) instead of through shared-memory tiles (off by default: the
                            autotuner tries both; MDSL_CUDA_SKINNY=0 keeps it from trying the skinny loop)
    MDSL_CUDA_STAGGER=1     each block of a skinny loop walks its K from its own starting slab (wrapping around),
                            so that the blocks do not read the same rows of X and the weights at the same moment
    MDSL_CUDA_LEAD=n        a skinny loop sends the weight slabs of the loop iteration n ahead to L2 (default 2;
                            0: no L2 prefetches): the DRAM bytes in flight per SM, without registers
    MDSL_CUDA_WIDE_X=1      a skinny loop's warps step over two slabs of K at once, lane t's mma rows 8t .. 8t + 7,
                            so that X's fragments of both come in one 16-byte load (each X load touches one line
                            per row of X: half the lines, half the loads)
    MDSL_CUDA_OVERLAP=1     custom kernels (sm_90+) let the next kernel launch while they run and wait for the
                            previous one before touching memory (programmatic dependent launch, griddepcontrol);
                            a skinny kernel sends its first weight slabs to L2 before that wait: launch and
                            ramp-up overlap the previous kernel's tail (off by default; the autotuner tries both)
    MDSL_CUDA_CUBLAS=0      kernel-level matmuls run mdsl's own GEMM kernel instead of cuBLAS (`gemm.py`; the
                            kernel is in the program either way: it runs where cuBLAS cannot be loaded)

A split and its combine run as one launch wherever they qualify (`onelaunch.py`), with no switch: the same
code of both kernels, the same results bit for bit, a launch fewer.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

import attrs

from mdsl.errors import UnsupportedError

MAX_STAGES = 4
DEFAULT_STAGES = 3
MAX_THREADS = 1024
DEFAULT_UNROLL = 4
UNROLLS = (1, 2, 4, 8)
OVERLAP_MIN_ARCH = 90          # programmatic dependent launch (griddepcontrol)
MAX_LEAD = 8                   # loop iterations a skinny loop's L2 prefetches run ahead of its loads


def _check_stages(instance, attribute, value: int) -> None:
    if not 1 <= value <= MAX_STAGES:
        raise UnsupportedError(f"{value} pipeline stages: the CUDA backend pipelines 1 to {MAX_STAGES} deep",
                               hint=f"set MDSL_CUDA_STAGES (or CudaOptions.stages) between 1 and {MAX_STAGES}")


def _check_threads(instance, attribute, value: Optional[int]) -> None:
    if value is not None and not (32 <= value <= MAX_THREADS and value % 32 == 0):
        raise UnsupportedError(f"{value} threads per block: use a multiple of 32 between 32 and {MAX_THREADS}",
                               hint="set MDSL_CUDA_THREADS (or CudaOptions.threads) to 64, 128, 256, ...")


def _check_unroll(instance, attribute, value: int) -> None:
    if value not in UNROLLS:
        raise UnsupportedError(f"unrolling {value} times: use one of {', '.join(map(str, UNROLLS))}",
                               hint="set MDSL_CUDA_UNROLL (or CudaOptions.unroll) to 1, 2, 4 or 8")


def _check_lead(instance, attribute, value: int) -> None:
    if not 0 <= value <= MAX_LEAD:
        raise UnsupportedError(f"an L2 prefetch lead of {value} iterations: use 0 (no prefetches) to {MAX_LEAD}",
                               hint=f"set MDSL_CUDA_LEAD (or CudaOptions.lead) between 0 and {MAX_LEAD}")


@attrs.frozen
class CudaOptions:
    mma: bool = True                       # tensor-core (mma.sync) block matmuls on 16-bit operands
    register_accumulators: bool = True     # accum(matmul) in the mma's f32 registers across the loop
    stages: int = attrs.field(default=DEFAULT_STAGES, validator=_check_stages)  # cp.async pipeline depth
    threads: Optional[int] = attrs.field(default=None, validator=_check_threads)  # custom kernels' block size
    unroll: int = attrs.field(default=DEFAULT_UNROLL, validator=_check_unroll)  # block-level element loops
    rows: bool = True                      # row-resident chains in the mma registers (rows.py)
    hoist: bool = True                     # loop-invariant block nodes once, before the loop
    stream: bool = True                    # element-wise folding loops straight from device memory (streamed.py)
    skinny: bool = False                   # matmuls of <= 16 rows stream their weights into registers (skinny.py)
    overlap: bool = False                  # custom kernels launched to overlap their predecessor (griddepcontrol)
    stagger: bool = False                  # skinny blocks start their walk over K at staggered slabs
    lead: int = attrs.field(default=2, validator=_check_lead)  # skinny loop iterations its L2 prefetches run ahead
    wide_x: bool = False                   # a skinny loop's steps of two slabs, X's fragments in 16-byte loads
    library_gemm: bool = True              # kernel-level matmuls through cuBLAS where it loads (gemm.py)

    @classmethod
    def from_env(cls, env: Optional[Mapping] = None) -> "CudaOptions":
        env = os.environ if env is None else env
        default = cls()
        threads = env.get("MDSL_CUDA_THREADS")
        return cls(mma=_flag(env, "MDSL_CUDA_MMA", default.mma),
                   register_accumulators=_flag(env, "MDSL_CUDA_REGACC", default.register_accumulators),
                   stages=_integer(env, "MDSL_CUDA_STAGES", default.stages),
                   threads=_integer(env, "MDSL_CUDA_THREADS", None) if threads else None,
                   unroll=_integer(env, "MDSL_CUDA_UNROLL", default.unroll),
                   rows=_flag(env, "MDSL_CUDA_ROWS", default.rows),
                   hoist=_flag(env, "MDSL_CUDA_HOIST", default.hoist),
                   stream=_flag(env, "MDSL_CUDA_STREAM", default.stream),
                   skinny=_flag(env, "MDSL_CUDA_SKINNY", default.skinny),
                   overlap=_flag(env, "MDSL_CUDA_OVERLAP", default.overlap),
                   stagger=_flag(env, "MDSL_CUDA_STAGGER", default.stagger),
                   lead=_integer(env, "MDSL_CUDA_LEAD", default.lead),
                   wide_x=_flag(env, "MDSL_CUDA_WIDE_X", default.wide_x),
                   library_gemm=_flag(env, "MDSL_CUDA_CUBLAS", default.library_gemm))


def _flag(env: Mapping, name: str, default: bool) -> bool:
    text = env.get(name, "").strip().lower()
    if not text:
        return default
    if text in ("0", "false", "off", "no"):
        return False
    if text in ("1", "true", "on", "yes"):
        return True
    raise UnsupportedError(f"{name}={env[name]!r} is not a switch", hint=f"set {name}=0 or {name}=1")


def _integer(env: Mapping, name: str, default: Optional[int]) -> Optional[int]:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise UnsupportedError(f"{name}={text!r} is not an integer", hint=f"set {name} to a whole number") from None


def arch_number(arch: str) -> int:
    """sm_90a -> 90."""
    digits = "".join(ch for ch in arch.split("_", 1)[-1] if ch.isdigit())
    return int(digits) if digits else 0

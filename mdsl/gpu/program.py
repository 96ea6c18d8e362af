"""What a code generator hands the runtime, and what its compiler reports.

A *program* is a code generator's output for one kernel graph: `source` (the text it compiles), `launches`
(`KernelLaunch`, in execution order), `aliases` ((value name, aliased value name): views that need no kernel, such
as reshape) and `graph` (the kernel graph it implements). A launch with a `library` GEMM (`LibraryGemm`: a plain
matmul) is run by cuBLAS where the runtime can load it (mdsl.gpu.cublas), else by its kernel, which the program has
all the same; a library GEMM may read an operand from the buffer of its transpose (`LibraryGemm.trans_b`,
`KernelLaunch.library_args`), and a transpose that only such GEMMs read is then not launched
(`mdsl.gpu.executable.elided_launches`). Every pointer a kernel takes is a contiguous row-major device tensor named
by `KernelLaunch.args` (inputs first, then outputs), 16-byte aligned (a kernel that reads a split's part or writes
a concat's piece in place takes the tensor the value lies in, and adds the offset itself: `mdsl.lowering.views`); a
launch with `counters` takes one more, its group counters (a buffer of the runtime's, not a value of the graph). A
*module* is the compiled program: a cubin with ptxas's report (`CompiledModule`), or an object whose `load()` gives
the driver's module handle (PTX that the driver compiles as it loads it).
"""
from __future__ import annotations

import re
from typing import Optional

import attrs


@attrs.frozen
class LibraryGemm:
    """A plain matmul as a BLAS library runs it: C = A @ B for `batch` row-major matrices, A m x k, B k x n and
    C m x n, each stored contiguously (leading dims k, n and n), the i-th of each `stride_*` elements after
    the first (0: one matrix for every batch). Operands and product are `dtype` ("f16", "bf16" or "f32");
    products are summed in f32 and the sum rounded to `dtype` once (what the verifier's bounds assume).
    `trans_b`: B is read from the buffer of its transpose (n x k matrices, leading dim k), as a kernel graph's
    `x @ transpose(w)` reads `w` itself (`mdsl.lowering.gemm`)."""

    dtype: str
    m: int
    n: int
    k: int
    batch: int = 1
    stride_a: int = 0
    stride_b: int = 0
    stride_c: int = 0
    trans_b: bool = False


@attrs.frozen
class KernelLaunch:
    name: str                # the kernel's (entry function's) name
    grid: tuple              # (x, y, z)
    block: tuple             # (threads, 1, 1)
    smem_bytes: int          # dynamic shared memory (more than 48 KB: the runtime raises the kernel's limit)
    args: tuple              # kernel-graph value names passed as pointers, in parameter order
    node_index: int          # the kernel-graph node it implements
    overlap: bool = False    # launched with programmatic stream serialization: it waits for its predecessor
                             # (griddepcontrol.wait) before touching memory, so it may start before that ends
    library: Optional[LibraryGemm] = None   # the same product as a library GEMM (args: A, B, C)
    counters: int = 0        # a split and its combine in one launch (mdsl.lowering.onelaunch): it implements
                             # node_index and the next node, and takes after `args` a pointer to this many
                             # 32-bit counters, zero before each launch and after it (the runtime allocates
                             # them zeroed once)
    library_args: tuple = () # the values the library GEMM reads and writes (A, B, C) where they are not `args`:
                             # with `library.trans_b`, B's is the transpose's input


@attrs.frozen
class Resources:
    registers: int
    smem_bytes: int          # static shared memory (the dynamic part is the launch's)
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


@attrs.frozen
class CompiledModule:
    cubin: bytes
    log: str
    resources: dict          # kernel name -> Resources
    arch: str


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_resources(log: str) -> dict:
    """Kernel name -> Resources, from ptxas's verbose report (in NVRTC's log, or nvJitLink's, or its own)."""
    found: dict = {}
    name, frame = None, (0, 0, 0)
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            name, frame = m.group(1), (0, 0, 0)
        elif (m := _FRAME.search(line)) and name:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _USED.search(line)) and name:
            found[name] = Resources(int(m.group(1)), int(m.group(2) or 0), *frame)
    return found

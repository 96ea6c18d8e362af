"""A CPU simulator of the PTX backend's kernels, for CI without a GPU: the same LLVM IR that becomes
PTX, compiled for the host instead, each GPU thread of a block run as a host thread.

The IR is retargeted as text: address spaces dropped (global and shared memory are host memory; the
dynamic shared memory is one host buffer, blocks run one after another), the op markers (inline asm)
removed, and the NVVM intrinsics (special registers, the barrier, the warp shuffle) replaced by calls
back into Python: a special register reads the calling thread's coordinates, the barrier is a
barrier of the block's threads (`_Barrier`: threading.Barrier's semantics), a shuffle exchanges values
through a per-warp slot array between two waits on the warp's barrier. A barrier that some thread never
reaches times out (a kernel whose barriers are not uniform fails instead of hanging).

The tensor cores and asynchronous copies are simulated from their PTX ISA semantics, independently
of how the backend builds their operands:
* `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}` (inline asm) becomes a call that hands the lane's
  registers to Python; when the warp's 32 lanes have arrived, the 16 x 16 A, 16 x 8 B and 16 x 8 C are
  assembled from the fragments as the ISA lays them out ("Matrix Fragments for mma.m16n8k16": lane
  l = 4 g + t holds A's rows g and g + 8 at columns 2t, 2t + 1 and 2t + 8, 2t + 9, B's rows 2t, 2t + 1
  and 2t + 8, 2t + 9 at column g, C's rows g and g + 8 at columns 2t, 2t + 1; the lower column or row
  in the lower 16 bits), D = A B + C is computed in float64 and rounded to f32, and each lane gets its
  four elements of D.
* `cvt.rn.{f16x2,bf16x2}.f32` (inline asm) rounds two floats into one register (the first source in
  the upper half).
* `prmt.b32` (inline asm, the default mode) picks each byte of the result from the 8 bytes of its two
  sources by the selector's nibbles; `ld.global.nc.L1::no_allocate.v{2,4}.u32` (inline asm) loads the
  words, failing on an address not aligned to the vector; `prefetch.global.L2` does nothing, and so do
  `griddepcontrol.wait` / `launch_dependents` (the kernels run one after another).
* `cp.async` copies (the NVVM intrinsics) are queued per thread, `commit_group` closes a group and
  `wait_group N` performs every group but the newest N: a copy lands as late as the ISA allows, so a
  kernel that reads a tile before waiting for it reads what was there before (NaN at first). With
  `copies="issue"` they land when issued instead (a slot overwritten while another thread still reads
  it shows then). A copy never waited for by the end of the kernel is an error.

A split and its combine in one launch (mdsl.lowering.onelaunch) meet at group counters:
`atom.acq_rel.gpu.global.add.u32` and `atom.global.exch.b32` (inline asm) are host atomics on the counter
(callbacks under a lock; no fence is needed where the blocks run one after another), `bar.red.or.pred`
(`llvm.nvvm.barrier0.or`) a barrier that ors the block's votes, and a thread that returns before the kernel's
end has exited: the block's barrier stops waiting for it (as `bar.sync` does not wait for exited threads).
The counters a launch takes start zero and must be zero again when it ends. The blocks of a grid run one
after another in the grid's order, or in its reverse or a shuffled order (`run`'s `order`), so that any
block of a group may be the last to arrive.

Each block has its own shared memory (the module's `mdsl_smem` becomes a callback's pointer). A kernel
with a thread-block cluster (its `cluster_dim_x` annotation) runs a cluster's blocks together, on
host threads of their own: `barrier.cluster.arrive` / `wait` are the ISA's phases (a thread's wait
returns once every thread of the cluster has arrived in that phase; a thread may leave without
arriving again), `mapa.shared::cluster` gives an address in a block's shared memory (its rank in the
high bits) and `st.shared::cluster` stores there; shared-memory addresses as 32-bit values are offsets.

What it checks is the IR's semantics: index arithmetic, loops, tiles, barriers, shuffles, dtype
conversions, fragments. Not NVPTX's code generation or ptxas (the acceptance tests assemble every
program).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import threading
from typing import Sequence

import numpy as np

from mdsl.backend.ptx import PtxProgram
from mdsl.gpu.arrays import from_device_bits, to_device_bits
from mdsl.ir.dtypes import DType
from mdsl.ir.graph import KernelGraph

SMEM_BYTES = 256 * 1024
BARRIER_TIMEOUT_S = 60.0
_SREGS = ("tid.x", "ntid.x", "ctaid.x", "ctaid.y", "ctaid.z", "nctaid.x", "nctaid.y", "nctaid.z")
_HOST_DTYPES = {"f16": np.float16, "bf16": np.uint16, "f32": np.float32, "i32": np.int32}


# bf16 on the host: 16-bit integers, converted by these (x86 has no bf16 conversion in general)
_BF16_HELPERS = """
define internal i16 @sim_to_bf16(float %x) {
  %bits = bitcast float %x to i32
  %nan = fcmp uno float %x, %x
  %lsb = lshr i32 %bits, 16
  %odd = and i32 %lsb, 1
  %bias = add i32 %odd, 32767
  %rounded = add i32 %bits, %bias
  %high = lshr i32 %rounded, 16
  %half = trunc i32 %high to i16
  %out = select i1 %nan, i16 32704, i16 %half
  ret i16 %out
}
define internal float @sim_from_bf16(i16 %x) {
  %wide = zext i16 %x to i32
  %bits = shl i32 %wide, 16
  %out = bitcast i32 %bits to float
  ret float %out
}
"""

# the tensor cores and cp.async, through callbacks (see the module docstring)
_MMA_HELPERS = """
declare void @sim_mma(i32, i32, i32, i32, i32, i32, i32, float, float, float, float, ptr)
""" + "".join(f"""
define internal {{float, float, float, float}} @sim_mma_{name}(i32 %a0, i32 %a1, i32 %a2, i32 %a3, i32 %b0, i32 %b1,
                                                            float %c0, float %c1, float %c2, float %c3) {{
  %d = alloca [4 x float], align 16
  call void @sim_mma(i32 {kind}, i32 %a0, i32 %a1, i32 %a2, i32 %a3, i32 %b0, i32 %b1,
                     float %c0, float %c1, float %c2, float %c3, ptr %d)
  %p1 = getelementptr float, ptr %d, i32 1
  %p2 = getelementptr float, ptr %d, i32 2
  %p3 = getelementptr float, ptr %d, i32 3
  %d0 = load float, ptr %d
  %d1 = load float, ptr %p1
  %d2 = load float, ptr %p2
  %d3 = load float, ptr %p3
  %r0 = insertvalue {{float, float, float, float}} undef, float %d0, 0
  %r1 = insertvalue {{float, float, float, float}} %r0, float %d1, 1
  %r2 = insertvalue {{float, float, float, float}} %r1, float %d2, 2
  %r3 = insertvalue {{float, float, float, float}} %r2, float %d3, 3
  ret {{float, float, float, float}} %r3
}}
""" for kind, name in enumerate(("f16", "bf16")))
_MMA_KINDS = ("f16", "bf16")
# ldmatrix (the NVVM intrinsics), through a callback with the lane's row address
_LDMATRIX_HELPERS = """
declare void @sim_ldmatrix(i32, ptr, ptr)
""" + "".join(f"""
define internal {{{', '.join(['i32'] * count)}}} @sim_ldmatrix_{name}(ptr %row) {{
  %d = alloca [4 x i32], align 16
  call void @sim_ldmatrix(i32 {kind}, ptr %row, ptr %d)
""" + "".join(f"""  %p{e} = getelementptr i32, ptr %d, i32 {e}
  %w{e} = load i32, ptr %p{e}
  %r{e} = insertvalue {{{', '.join(['i32'] * count)}}} {'undef' if e == 0 else f'%r{e - 1}'}, i32 %w{e}, {e}
""" for e in range(count)) + f"""  ret {{{', '.join(['i32'] * count)}}} %r{count - 1}
}}
""" for kind, (name, count) in enumerate((("x4", 4), ("x2_trans", 2))))
_LDMATRIX_KINDS = (("x4", 4, False), ("x2_trans", 2, True))   # name, matrices, transposed
_LDMATRIX = re.compile(r'@"llvm\.nvvm\.ldmatrix\.sync\.aligned\.m8n8\.(x4|x2\.trans)\.b16"')
# cvt.rn.{f16x2,bf16x2}.f32 d, hi, lo (inline asm): both rounded, hi in the upper 16 bits
_PACK_HELPERS = """
define internal i32 @sim_pack_f16(float %hi, float %lo) {
  %h = fptrunc float %hi to half
  %l = fptrunc float %lo to half
  %hb = bitcast half %h to i16
  %lb = bitcast half %l to i16
  %hw = zext i16 %hb to i32
  %lw = zext i16 %lb to i32
  %up = shl i32 %hw, 16
  %out = or i32 %up, %lw
  ret i32 %out
}
define internal i32 @sim_pack_bf16(float %hi, float %lo) {
  %hb = call i16 @sim_to_bf16(float %hi)
  %lb = call i16 @sim_to_bf16(float %lo)
  %hw = zext i16 %hb to i32
  %lw = zext i16 %lb to i32
  %up = shl i32 %hw, 16
  %out = or i32 %up, %lw
  ret i32 %out
}
"""
# cvt.sat.f32.f32 (llvm.nvvm.saturate.f): clamped to [0, 1], NaN to 0
_SATURATE_HELPER = """
define internal float @sim_saturate(float %x) {
  %below = fcmp ult float %x, 0.0
  %low = select i1 %below, float 0.0, float %x
  %above = fcmp ogt float %low, 1.0
  %out = select i1 %above, float 1.0, float %low
  ret float %out
}
"""
# prmt.b32 d, a, b, selector (default mode: byte i of d is byte (selector >> 4i) & 7 of the 8 bytes b:a,
# replicating that byte's sign bit where (selector >> 4i) & 8)
_PERMUTE_HELPER = """
define internal i32 @sim_prmt(i32 %a, i32 %b, i32 %sel) {
  %lo = zext i32 %a to i64
  %hi0 = zext i32 %b to i64
  %hi = shl i64 %hi0, 32
  %v = or i64 %hi, %lo
""" + "".join(f"""  %s{i}a = lshr i32 %sel, {4 * i}
  %n{i} = and i32 %s{i}a, 7
  %m{i} = and i32 %s{i}a, 8
  %n{i}w = zext i32 %n{i} to i64
  %sh{i} = mul i64 %n{i}w, 8
  %x{i}w = lshr i64 %v, %sh{i}
  %x{i}a = trunc i64 %x{i}w to i32
  %x{i} = and i32 %x{i}a, 255
  %neg{i}a = and i32 %x{i}, 128
  %neg{i} = icmp ne i32 %neg{i}a, 0
  %sign{i} = select i1 %neg{i}, i32 255, i32 0
  %rep{i} = icmp ne i32 %m{i}, 0
  %y{i} = select i1 %rep{i}, i32 %sign{i}, i32 %x{i}
  %z{i} = shl i32 %y{i}, {8 * i}
""" for i in range(4)) + """  %d01 = or i32 %z0, %z1
  %d23 = or i32 %z2, %z3
  %d = or i32 %d01, %d23
  ret i32 %d
}
"""
_PERMUTE_ASM = re.compile(r'call i32 asm\s+(?:sideeffect\s+)?"prmt\.b32 \$0, \$1, \$2, (0x[0-9a-fA-F]+);", "=r,r,r"\((i32 \S+), (i32 \S+)\)')
# ld.global.nc.L1::no_allocate.v{2,4}.u32 (inline asm): host loads of the words, the address checked
# for the vector's alignment (`sim_misaligned` reports it)
_STREAMED_HELPERS = """
declare void @sim_misaligned(ptr, i32)
""" + "".join(f"""
define internal {{{', '.join(['i32'] * n)}}} @sim_ld_nc_v{n}(ptr %p) {{
  %address = ptrtoint ptr %p to i64
  %off = and i64 %address, {4 * n - 1}
  %bad = icmp ne i64 %off, 0
  br i1 %bad, label %misaligned, label %load
misaligned:
  call void @sim_misaligned(ptr %p, i32 {4 * n})
  br label %load
load:
""" + "".join(f"""  %p{e} = getelementptr i32, ptr %p, i32 {e}
  %w{e} = load i32, ptr %p{e}
  %r{e} = insertvalue {{{', '.join(['i32'] * n)}}} {'undef' if e == 0 else f'%r{e - 1}'}, i32 %w{e}, {e}
""" for e in range(n)) + f"""  ret {{{', '.join(['i32'] * n)}}} %r{n - 1}
}}
""" for n in (2, 4))
# thread-block clusters: the barriers (arrive / wait apart), mapa and stores into another block's shared
# memory (inline asm), and shared-memory addresses as 32-bit values (ptrtoint): callbacks
_CLUSTER_HELPERS = """
declare ptr @sim_smem()
declare i32 @sim_shared_offset(ptr)
declare void @sim_cluster_arrive()
declare void @sim_cluster_wait()
declare i32 @sim_mapa(i32, i32)
declare void @sim_cluster_store(i32, float)
"""
_CLUSTER_BARRIER = re.compile(r'call void asm sideeffect "barrier\.cluster\.(arrive|wait)(?:\.\w+)*;", "[^"]*"\(\)')
_MAPA = re.compile(r'call i32 asm (?:sideeffect )?"mapa\.shared::cluster\.u32 [^"]*", "=r,r,r"')
_CLUSTER_STORE = re.compile(r'call void asm sideeffect "st\.shared::cluster\.f32 [^"]*", "[^"]*"')
_SHARED_TO_INT = re.compile(r"(%\S+) = ptrtoint ptr (%\S+) to i32")
_STREAMED_ASM = re.compile(r'asm sideeffect "ld\.global\.nc\.L1::no_allocate\.v(2|4)\.u32 [^"]*", "[^"]*"')
_PACK_ASM = re.compile(r'asm\s+(?:sideeffect\s+)?"cvt\.rn\.(f16|bf16)x2\.f32 \$0, \$1, \$2;", "=r,f,f"')
_MMA_ASM = re.compile(r'asm sideeffect "mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(f16|bf16)\.\1\.f32 [^"]*", "[^"]*"')
_CP_ASYNC = re.compile(r'"llvm\.nvvm\.cp\.async\.c[ag]\.shared\.global\.(4|8|16)"')
# a group counter's atomics (inline asm: add of an immediate, exchange for an immediate): callbacks
_ATOMIC_ASM = re.compile(r'call i32 asm sideeffect "atom\.(?:acq_rel\.gpu\.)?global\.(add)\.u32 \$0, \[\$1\], (\d+);", '
                         r'"[^"]*"\((ptr \S+)\)|'
                         r'call i32 asm sideeffect "atom\.global\.(exch)\.b32 \$0, \[\$1\], (\d+);", '
                         r'"[^"]*"\((ptr \S+)\)')
_ATOMIC_HELPERS = """
declare i32 @sim_atom_add(ptr, i32)
declare i32 @sim_atom_exch(ptr, i32)
"""


def _atomic_call(found: re.Match) -> str:
    op, value, pointer = found.group(1, 2, 3) if found.group(1) else found.group(4, 5, 6)
    return f"call i32 @sim_atom_{op}({pointer}, i32 {value})"


def _bf16_constant(found: re.Match) -> str:
    bits = int(found.group(1), 16)
    return str(bits - (1 << 16) if bits >= 1 << 15 else bits)


def host_ir(llvm_ir: str) -> str:
    """The module retargeted for the host (see the module docstring)."""
    out = []
    kernel_start = False
    for line in llvm_ir.splitlines():
        stripped = line.strip()
        if stripped.startswith("define ptx_kernel "):
            kernel_start = True
        elif kernel_start and stripped.endswith(":"):   # a kernel's first block: its block's shared memory
            out.append(line)
            out.append('  %sim.smem = call ptr @sim_smem()')
            kernel_start = False
            continue
        if not stripped.startswith('@"mdsl_smem"'):
            line = line.replace('@"mdsl_smem"', "%sim.smem")
        if stripped.startswith(("target triple", "target datalayout", "!")) or 'asm sideeffect "//' in line \
                or 'asm sideeffect "prefetch.global.L2 ' in line or 'asm sideeffect "griddepcontrol.' in line:
            # op markers; L2 prefetches change no value; the kernels run one after another (griddepcontrol)
            continue
        if stripped.startswith('@"mdsl_smem"'):
            line = f'@"mdsl_smem" = global [{SMEM_BYTES} x i8] zeroinitializer, align 16'
        line = re.sub(r" addrspace\([13]\)", "", line)
        line = re.sub(r", !invariant\.load !\d+", "", line)   # the metadata is dropped
        line = line.replace("define ptx_kernel ", "define ")
        line = re.sub(r'llvm\.nvvm\.read\.ptx\.sreg\.(\w+)\.(\w)', r"sim_sreg_\1_\2", line)
        line = line.replace('"llvm.nvvm.barrier0"', '"sim_barrier"').replace('"llvm.nvvm.shfl.sync.bfly.f32"', '"sim_shfl"')
        line = line.replace('"llvm.nvvm.barrier0.or"', '"sim_barrier_or"')
        line = _ATOMIC_ASM.sub(_atomic_call, line)
        line = _MMA_ASM.sub(r"@sim_mma_\1", line)
        line = _PACK_ASM.sub(r"@sim_pack_\1", line)
        line = _STREAMED_ASM.sub(r"@sim_ld_nc_v\1", line)
        line = _PERMUTE_ASM.sub(lambda found: f"call i32 @sim_prmt({found.group(2)}, {found.group(3)}, "
                                              f"i32 {int(found.group(1), 16)})", line)
        line = _CP_ASYNC.sub(r'"sim_cp_async_\1"', line)
        line = _CLUSTER_BARRIER.sub(r"call void @sim_cluster_\1()", line)
        line = _MAPA.sub("call i32 @sim_mapa", line)
        line = _CLUSTER_STORE.sub("call void @sim_cluster_store", line)
        line = _SHARED_TO_INT.sub(r"\1 = call i32 @sim_shared_offset(ptr \2)", line)
        if line.lstrip().startswith("declare") and _LDMATRIX.search(line):
            continue   # defined by _LDMATRIX_HELPERS
        line = _LDMATRIX.sub(lambda found: f"@sim_ldmatrix_{found.group(1).replace('.', '_')}", line)
        if line.lstrip().startswith("declare") and '@"llvm.nvvm.saturate.f"' in line:
            continue   # defined by _SATURATE_HELPER
        line = line.replace('@"llvm.nvvm.saturate.f"', "@sim_saturate")
        line = line.replace('"llvm.nvvm.cp.async.commit.group"', '"sim_cp_async_commit"')
        line = line.replace('"llvm.nvvm.cp.async.wait.group"', '"sim_cp_async_wait"')
        line = re.sub(r"(%\S+) = fpext bfloat (%\S+) to float", r"\1 = call float @sim_from_bf16(i16 \2)", line)
        line = re.sub(r"(%\S+) = fptrunc float (%\S+) to bfloat", r"\1 = call i16 @sim_to_bf16(float \2)", line)
        line = re.sub(r"\b0xR([0-9A-Fa-f]{4})\b", _bf16_constant, line)   # a bf16 constant as its bits
        out.append(line.replace("bfloat", "i16"))
    return "\n".join(out) + "\n" + _BF16_HELPERS + _MMA_HELPERS + _PACK_HELPERS + _LDMATRIX_HELPERS + _SATURATE_HELPER + \
        _PERMUTE_HELPER + _STREAMED_HELPERS + _CLUSTER_HELPERS + _ATOMIC_HELPERS


_LANE_GROUP, _LANE_THREAD = np.arange(32) // 4, np.arange(32) % 4   # a lane's group g and thread t in it


class _Phase:
    """One phase of a `_Barrier`: the gate its waiters pass (locked until the phase completes or breaks)."""

    def __init__(self):
        self.gate = threading.Lock()
        self.gate.acquire()
        self.broken = False

    def open(self) -> None:
        try:
            self.gate.release()
        except RuntimeError:   # already open
            pass


class _Barrier:
    """threading.Barrier's semantics for the simulated threads: `wait` returns once all `parties` threads
    have arrived, after the last of them has run `action`; a wait longer than `timeout`, an action that
    raises, or `abort` breaks the barrier (its waiters and every later wait raise BrokenBarrierError).
    Its waiters are woken by a chain of lock hand-offs (the last thread to arrive opens the phase's gate,
    each woken waiter opens it for the next): threading.Barrier's Condition takes several times longer
    to wake a block's hundreds of threads under the GIL."""

    def __init__(self, parties: int, action=None, timeout=None):
        self.parties, self._action, self._timeout = parties, action, timeout
        self._lock = threading.Lock()
        self._count = 0
        self._broken = False
        self._phase = _Phase()

    def wait(self) -> None:
        with self._lock:
            if self._broken:
                raise threading.BrokenBarrierError
            phase = self._phase
            self._count += 1
            if self._count == self.parties:   # the last to arrive: the action, then the others go
                self._complete()
                return
        if not phase.gate.acquire(timeout=-1 if self._timeout is None else self._timeout):
            with self._lock:
                self._break()
            raise threading.BrokenBarrierError
        phase.open()   # the next waiter's turn
        if phase.broken:
            raise threading.BrokenBarrierError

    def _complete(self) -> None:
        """The phase's action, then its waiters go (with the lock held)."""
        phase = self._phase
        if self._action is not None:
            try:
                self._action()
            except BaseException:
                self._break()
                raise
        self._count, self._phase = 0, _Phase()
        phase.open()

    def leave(self) -> None:
        """A party exits: the barrier waits for one fewer (until `parties` is set again); a phase that waited
        only for it completes."""
        with self._lock:
            self.parties -= 1
            if self._count and self._count == self.parties and not self._broken:
                self._complete()

    def _break(self) -> None:
        self._broken = self._phase.broken = True
        self._phase.open()

    def abort(self) -> None:
        with self._lock:
            self._break()


class _Block:
    """The state the threads of one running block share."""

    def __init__(self, threads: int, copies: str):
        self.threads = threads
        self.barrier = _Barrier(threads, timeout=BARRIER_TIMEOUT_S)
        self.votes = np.zeros(threads, dtype=np.int32)   # each thread's vote at a bar.red.or
        self.warps = [_Barrier(min(32, threads - w), timeout=BARRIER_TIMEOUT_S) for w in range(0, threads, 32)]
        self.slots = np.zeros(threads, dtype=np.float32)
        self.errors: list = []
        self.copies = copies
        # per warp: each lane's mma registers (a0..a3, b0, b1 as 32-bit words; c0..c3) and the product
        self.mma_words = np.zeros((len(self.warps), 32, 6), dtype=np.uint32)
        self.mma_c = np.zeros((len(self.warps), 32, 4), dtype=np.float32)
        self.mma_kind = [0] * len(self.warps)
        self.mma_d = np.zeros((len(self.warps), 32, 4), dtype=np.float32)
        self.mma_barriers = [_Barrier(32, action=functools.partial(self._mma, w), timeout=BARRIER_TIMEOUT_S)
                             for w in range(len(self.warps))] if threads % 32 == 0 else []
        self.ldmatrix_rows = np.zeros((len(self.warps), 32), dtype=np.uint64)
        self.ldmatrix_kind = [0] * len(self.warps)
        self.ldmatrix_out = np.zeros((len(self.warps), 32, 4), dtype=np.uint32)
        self.ldmatrix_barriers = [_Barrier(32, action=functools.partial(self._ldmatrix, w), timeout=BARRIER_TIMEOUT_S)
                                  for w in range(len(self.warps))] if threads % 32 == 0 else []

    def _ldmatrix(self, warp: int) -> None:
        """The warp's ldmatrix (run by one lane, all 32 waiting): matrix m's 8 rows of 8 16-bit elements
        from the addresses of lanes 8m .. 8m + 7 (each 16-byte aligned, as the ISA requires); lane l
        gets register m = row l / 4, columns 2 (l % 4) and the next of matrix m (of its transpose with
        .trans), the lower column in the lower half."""
        name, count, transposed = _LDMATRIX_KINDS[self.ldmatrix_kind[warp]]
        for lane in range(8 * count):
            address = int(self.ldmatrix_rows[warp, lane])
            if address % 16:
                raise AssertionError(f"ldmatrix.{name}: lane {lane}'s row address {address:#x} is not 16-byte aligned")
        for m in range(count):
            rows = np.stack([np.frombuffer(ctypes.string_at(int(self.ldmatrix_rows[warp, 8 * m + r]), 16), np.uint16)
                             for r in range(8)])
            matrix = (rows.T if transposed else rows).astype(np.uint32)
            g, t = _LANE_GROUP, _LANE_THREAD   # lane l = 4 g + t: register m = row g, columns 2 t and 2 t + 1
            self.ldmatrix_out[warp, :, m] = matrix[g, 2 * t] | (matrix[g, 2 * t + 1] << 16)

    def _mma(self, warp: int) -> None:
        """D = A B + C for the warp, from its lanes' fragments (run by one lane, all 32 waiting)."""
        words, c = self.mma_words[warp], self.mma_c[warp]
        halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).astype(np.uint16)   # [lane, register, half]
        if _MMA_KINDS[self.mma_kind[warp]] == "f16":
            values = halves.view(np.float16).astype(np.float64)
        else:
            values = (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        a, bm, cm = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
        g, t = _LANE_GROUP, _LANE_THREAD   # all 32 lanes at once: lane l = 4 g + t
        for reg, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            a[row, col], a[row, col + 1] = values[:, reg, 0], values[:, reg, 1]
        for reg, row in enumerate((2 * t, 2 * t + 8)):
            bm[row, g], bm[row + 1, g] = values[:, 4 + reg, 0], values[:, 4 + reg, 1]
        cm[g, 2 * t], cm[g, 2 * t + 1], cm[g + 8, 2 * t], cm[g + 8, 2 * t + 1] = c[:, 0], c[:, 1], c[:, 2], c[:, 3]
        d = (a @ bm + cm).astype(np.float32)
        self.mma_d[warp] = np.stack([d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]], axis=1)


_LOCAL = threading.local()   # .coords: this thread's special registers; .block: its _Block


def _guarded(fn):
    def call(*args):
        try:
            return fn(*args)
        except BaseException as e:   # an exception cannot cross the C frames: record it, keep going
            _LOCAL.block.errors.append(e)
            return 0

    return call


def _sreg(name: str):
    return _guarded(lambda: _LOCAL.coords[name])


def _barrier() -> None:
    _LOCAL.block.barrier.wait()


def _barrier_or(value: int) -> int:
    """bar.red.or: a barrier of the block's (non-exited) threads; whether any of them voted non-zero."""
    block, tid = _LOCAL.block, _LOCAL.coords["tid.x"]
    block.votes[tid] = value != 0
    block.barrier.wait()
    result = int(block.votes.any())
    block.barrier.wait()   # every thread has read the votes before any votes again
    return result


_ATOMICS = threading.Lock()


def _atomic(update):
    """A 32-bit atomic on global memory: the old value; the new one is update(old, operand)."""
    def call(address: int, operand: int) -> int:
        with _ATOMICS:
            word = ctypes.c_uint32.from_address(address)
            old = word.value
            word.value = update(old, operand) & 0xFFFFFFFF
        return old

    return call


def _shuffle(mask: int, value: float, lane_mask: int, clamp: int) -> float:
    block, tid = _LOCAL.block, _LOCAL.coords["tid.x"]
    warp = block.warps[tid // 32]
    block.slots[tid] = value
    warp.wait()
    other = float(block.slots[tid ^ lane_mask])
    warp.wait()
    return other


def _mma(kind: int, a0: int, a1: int, a2: int, a3: int, b0: int, b1: int, c0: float, c1: float, c2: float,
         c3: float, out: int) -> None:
    block, tid = _LOCAL.block, _LOCAL.coords["tid.x"]
    if not block.mma_barriers:
        raise AssertionError("mma.sync in a block that is not whole warps")
    warp, lane = tid // 32, tid % 32
    block.mma_words[warp, lane] = [w & 0xFFFFFFFF for w in (a0, a1, a2, a3, b0, b1)]
    block.mma_c[warp, lane] = (c0, c1, c2, c3)
    block.mma_kind[warp] = kind
    block.mma_barriers[warp].wait()
    ctypes.memmove(out, block.mma_d[warp, lane].ctypes.data, 16)


def _ldmatrix(kind: int, row: int, out: int) -> None:
    block, tid = _LOCAL.block, _LOCAL.coords["tid.x"]
    if not block.ldmatrix_barriers:
        raise AssertionError("ldmatrix in a block that is not whole warps")
    warp, lane = tid // 32, tid % 32
    block.ldmatrix_rows[warp, lane] = row
    block.ldmatrix_kind[warp] = kind
    block.ldmatrix_barriers[warp].wait()
    ctypes.memmove(out, block.ldmatrix_out[warp, lane].ctypes.data, 16)   # the next action needs this lane too


def _cp_async(nbytes: int):
    def copy(dst: int, src: int) -> None:
        if _LOCAL.block.copies == "issue":
            ctypes.memmove(dst, src, nbytes)
        else:
            _LOCAL.open_group.append((dst, src, nbytes))

    return copy


def _cp_async_commit() -> None:
    _LOCAL.groups.append(_LOCAL.open_group)
    _LOCAL.open_group = []


def _cp_async_wait(pending: int) -> None:
    groups = _LOCAL.groups
    done, _LOCAL.groups = (groups[:-pending], groups[-pending:]) if pending else (groups, [])
    for group in done:
        for dst, src, nbytes in group:
            ctypes.memmove(dst, src, nbytes)


class _Cluster:
    """The blocks of one thread-block cluster running together: each one's shared memory, and the
    cluster barrier's phases (a thread's arrive counts towards its next phase; its wait returns once every
    thread of the cluster has arrived in that phase)."""

    def __init__(self, blocks: int, threads: int):
        self.smem = [_aligned(SMEM_BYTES, np.uint8) for _ in range(blocks)]
        self.threads = blocks * threads
        self.arrived: dict = {}
        self.condition = threading.Condition()

    def arrive(self) -> None:
        with self.condition:
            phase = _LOCAL.arrive_phase
            self.arrived[phase] = self.arrived.get(phase, 0) + 1
            _LOCAL.arrive_phase += 1
            self.condition.notify_all()

    def wait(self) -> None:
        phase = _LOCAL.wait_phase
        if phase >= _LOCAL.arrive_phase:
            raise AssertionError("barrier.cluster.wait before this thread's arrive")
        with self.condition:
            if not self.condition.wait_for(lambda: self.arrived.get(phase, 0) == self.threads, BARRIER_TIMEOUT_S):
                raise AssertionError(f"barrier.cluster.wait: {self.arrived.get(phase, 0)} of the cluster's "
                                     f"{self.threads} threads arrived")
        _LOCAL.wait_phase += 1


_CLUSTER_RANK_SHIFT = 24   # a mapa address: (the block's rank + 1) << 24 | the offset in its shared memory


def _smem() -> int:
    return _LOCAL.cluster.smem[_LOCAL.rank].ctypes.data


def _shared_offset(address: int) -> int:
    offset = address - _smem()
    if not 0 <= offset < SMEM_BYTES:
        raise AssertionError(f"a shared-memory address {address:#x} outside the block's shared memory")
    return offset


def _mapa(offset: int, rank: int) -> int:
    if not 0 <= rank < len(_LOCAL.cluster.smem):
        raise AssertionError(f"mapa to block {rank} of a cluster of {len(_LOCAL.cluster.smem)}")
    return (rank + 1) << _CLUSTER_RANK_SHIFT | _shared_offset(_smem() + offset)


def _cluster_store(address: int, value: float) -> None:
    rank, offset = (address >> _CLUSTER_RANK_SHIFT) - 1, address & ((1 << _CLUSTER_RANK_SHIFT) - 1)
    if not 0 <= rank < len(_LOCAL.cluster.smem) or offset % 4:
        raise AssertionError(f"st.shared::cluster to {address:#x}: not an aligned address that mapa gave")
    _LOCAL.cluster.smem[rank][offset:offset + 4].view(np.float32)[0] = value


def _misaligned(address: int, nbytes: int) -> None:
    raise AssertionError(f"a {nbytes}-byte vector load from {address:#x}, not {nbytes}-byte aligned")


@functools.cache
def _callbacks() -> dict:
    """Name -> (ctypes callback, kept alive here)."""
    made = {f"sim_sreg_{s.replace('.', '_')}": ctypes.CFUNCTYPE(ctypes.c_int32)(_sreg(s)) for s in _SREGS}
    made["sim_barrier"] = ctypes.CFUNCTYPE(None)(_guarded(_barrier))
    made["sim_barrier_or"] = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32)(_guarded(_barrier_or))
    made["sim_atom_add"] = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32)(
        _guarded(_atomic(lambda old, value: old + value)))
    made["sim_atom_exch"] = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32)(
        _guarded(_atomic(lambda old, value: value)))
    made["sim_shfl"] = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_int32, ctypes.c_float, ctypes.c_int32,
                                        ctypes.c_int32)(_guarded(_shuffle))
    made["sim_mma"] = ctypes.CFUNCTYPE(None, *[ctypes.c_int32] * 7, *[ctypes.c_float] * 4, ctypes.c_void_p)(
        _guarded(_mma))
    made["sim_ldmatrix"] = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p)(_guarded(_ldmatrix))
    for nbytes in (4, 8, 16):
        made[f"sim_cp_async_{nbytes}"] = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(
            _guarded(_cp_async(nbytes)))
    made["sim_smem"] = ctypes.CFUNCTYPE(ctypes.c_void_p)(_guarded(_smem))
    made["sim_shared_offset"] = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)(_guarded(_shared_offset))
    made["sim_cluster_arrive"] = ctypes.CFUNCTYPE(None)(_guarded(lambda: _LOCAL.cluster.arrive()))
    made["sim_cluster_wait"] = ctypes.CFUNCTYPE(None)(_guarded(lambda: _LOCAL.cluster.wait()))
    made["sim_mapa"] = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32, ctypes.c_int32)(_guarded(_mapa))
    made["sim_cluster_store"] = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_float)(_guarded(_cluster_store))
    made["sim_misaligned"] = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)(_guarded(_misaligned))
    made["sim_cp_async_commit"] = ctypes.CFUNCTYPE(None)(_guarded(_cp_async_commit))
    made["sim_cp_async_wait"] = ctypes.CFUNCTYPE(None, ctypes.c_int32)(_guarded(_cp_async_wait))
    return made


def _engine(llvm_ir: str):
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    for name, callback in _callbacks().items():
        llvm.add_symbol(name, ctypes.cast(callback, ctypes.c_void_p).value)
    module = llvm.parse_assembly(host_ir(llvm_ir))
    module.verify()
    # the host's own features: f16 and bf16 conversions as instructions (F16C, AVX512-BF16), not as
    # calls to compiler-rt helpers that a JIT cannot find
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=1)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    return engine


def _aligned(nbytes: int, dtype) -> np.ndarray:
    """A 64-byte aligned host buffer filled with 0xFF bytes (the kernels make 16-byte accesses)."""
    raw = np.full(nbytes + 64, 0xFF, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype)


def _to_host(x: np.ndarray, dtype: DType) -> np.ndarray:
    values = to_device_bits(x, dtype).reshape(-1)    # as the runtime uploads it (bf16 rounded to nearest even)
    out = _aligned(values.nbytes, values.dtype)
    out[:] = values
    return out


#: the orders `run` runs a grid's blocks in: the grid's (x fastest), its reverse, or shuffled (a seed)
ORDERS = ("grid", "reversed")


def run(program: PtxProgram, inputs: Sequence[np.ndarray], copies: str = "wait", order="grid") -> list:
    """Run the program's kernels in order on host buffers; the graph's outputs as float64 arrays.
    Intermediate buffers and the shared memory start filled with 0xFF bytes (NaN in every float
    dtype), so that what no kernel wrote shows; a launch's group counters start zero, and must end so.
    `copies`: when cp.async copies land ("wait": at the wait_group that covers them, the latest the ISA
    allows; "issue": at once). `order`: the order of each grid's blocks (one of ORDERS, or an int: the
    seed of a shuffled order)."""
    if copies not in ("wait", "issue"):
        raise ValueError(f"copies={copies!r}: 'wait' or 'issue'")
    if order not in ORDERS and not isinstance(order, int):
        raise ValueError(f"order={order!r}: one of {ORDERS} or a seed")
    graph: KernelGraph = program.graph
    engine = _engine(program.llvm_ir)
    aliases = dict(program.aliases)
    types = {v.name: v.type for v in graph.inputs}
    for node in graph.nodes:
        types.update((v.name, v.type) for v in node.outputs)
    buffers: dict = {}
    for v, x in zip(graph.inputs, inputs):
        buffers[v.name] = _to_host(x, v.dtype)

    def buffer(name: str) -> np.ndarray:
        root = aliases.get(name, name)
        if root not in buffers:
            t = types[root]
            buffers[root] = _aligned(t.nbytes, _HOST_DTYPES[t.dtype.name])
        return buffers[root]

    with _one_cpu():
        for launch in program.launches:
            args = [buffer(a) for a in launch.args]
            counters = np.zeros(launch.counters, dtype=np.uint32)
            if launch.counters:
                args.append(counters)
            kernel = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * len(args))(engine.get_function_address(launch.name))
            _run_launch(kernel, [a.ctypes.data for a in args], launch, cluster_size(program.llvm_ir, launch.name),
                        copies, order)
            if counters.any():
                raise AssertionError(f"{launch.name} left {int((counters != 0).sum())} of its {launch.counters} group "
                                     f"counters non-zero (the next launch would find them so): {counters.tolist()}")
    return [from_device_bits(buffer(v.name).reshape(v.shape), v.dtype).astype(np.float64) for v in graph.outputs]


@contextlib.contextmanager
def _one_cpu():
    """The simulated threads (created by this thread: they inherit its affinity) on one CPU, the n-th the
    process may use for pytest-xdist worker n: their hand-offs (barriers, the GIL), one after another in any
    case, take several times longer between CPUs. Only where the system lets a thread choose its CPUs."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = None
    if not allowed or len(allowed) == 1:
        yield
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    os.sched_setaffinity(0, {sorted(allowed)[int(worker) % len(allowed) if worker.isdigit() else 0]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def cluster_size(llvm_ir: str, kernel: str) -> int:
    """The kernel's thread-block cluster size along x (its `cluster_dim_x` annotation), 1 without one."""
    node = re.search(r'^(!\d+) = !\{ptr @"' + re.escape(kernel) + r'", !"cluster_dim_x", i32 (\d+)\}', llvm_ir, re.M)
    return int(node.group(2)) if node else 1


def _run_launch(kernel, pointers: list, launch, cluster: int, copies: str, order="grid") -> None:
    """The launch's clusters of `cluster` blocks (consecutive along x) one after another in `order` (`run`'s),
    the blocks of a cluster together, on one set of host threads (one per GPU thread of each block of a
    cluster); each block with its own shared memory, filled with 0xFF bytes before it starts."""
    threads = launch.block[0]
    grid = launch.grid
    if grid[0] % cluster:
        raise AssertionError(f"{launch.name}: a grid of {grid[0]} blocks along x is not whole clusters of {cluster}")
    blocks = [_Block(threads, copies) for _ in range(cluster)]
    sequence = [(x, y, z) for z in range(grid[2]) for y in range(grid[1]) for x in range(0, grid[0], cluster)]
    if order == "reversed":
        sequence.reverse()
    elif isinstance(order, int):
        np.random.default_rng(order).shuffle(sequence)
    errors: list = []
    clusters: list = [_Cluster(cluster, threads)]   # the first cluster's: fresh shared memory, 0xFF bytes

    def next_cluster() -> None:
        clusters[0] = _Cluster(cluster, threads)   # fresh shared memory for the next cluster of blocks
        for block in blocks:   # every thread of the next blocks is there from the start
            block.barrier.parties = threads
            block.votes[:] = 0

    # every thread done with a cluster of blocks before the next one starts (on its fresh shared memory)
    together = _Barrier(cluster * threads, action=next_cluster, timeout=BARRIER_TIMEOUT_S)

    def thread(rank: int, tid: int) -> None:
        block = _LOCAL.block = blocks[rank]
        _LOCAL.rank = rank
        try:
            for x, y, z in sequence:
                _LOCAL.cluster, _LOCAL.arrive_phase, _LOCAL.wait_phase = clusters[0], 0, 0
                _LOCAL.coords = {"tid.x": tid, "ntid.x": threads, "ctaid.x": x + rank, "ctaid.y": y, "ctaid.z": z,
                                 "nctaid.x": grid[0], "nctaid.y": grid[1], "nctaid.z": grid[2]}
                _LOCAL.groups, _LOCAL.open_group = [], []
                kernel(*pointers)
                block.votes[tid] = 0
                block.barrier.leave()   # exited: the block's barriers wait for the others only
                if any(_LOCAL.groups) or _LOCAL.open_group:
                    raise AssertionError(f"thread {tid} of block {(x + rank, y, z)} ended with cp.async copies it "
                                         "never waited for")
                together.wait()            # every thread done with it before the next one starts
        except BaseException as e:
            errors.append(e)
            for barrier in (together, *(b for block in blocks for b in (block.barrier, *block.warps, *block.mma_barriers,
                                                                         *block.ldmatrix_barriers))):
                barrier.abort()

    previous = threading.stack_size(4 * 1024 * 1024)
    try:
        workers = [threading.Thread(target=thread, args=(r, t)) for r in range(cluster) for t in range(threads)]
    finally:
        threading.stack_size(previous)
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    errors += [e for block in blocks for e in block.errors]
    if errors:
        raise AssertionError(f"{launch.name}: {errors[0]!r} ({len(errors)} error(s) in the simulated threads)")

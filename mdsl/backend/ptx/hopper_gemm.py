"""The Hopper GEMM as LLVM IR for llvmlite's NVPTX target: the kernel of mdsl/backend/cuda/hopper_gemm.cuh,
C[M, N] = A[M, K] W[N, K]^T (+ bias[N]) (+ residual[M, N]) on wgmma and TMA, compiled for sm_90a.

It is that kernel written in a second language, step for step: one 128 x BN tile of C a block, a producer
thread loading 64-wide K steps of A and W with TMA (`cp.async.bulk.tensor`, 128-byte swizzle) into a ring of
stages guarded by full and empty mbarriers, two consumer warpgroups issuing four `wgmma.mma_async` m64nBNk16
a stage from shared-memory descriptors (one stage in flight while the next is awaited), and the epilogue's
masked stores. The configuration, parameters and launch are the ones both kernels share
(mdsl.gpu.hopper_gemm: the tile, stages, shared memory, name, tile width and tensor maps), so this module's
`hopper_gemm` launches this kernel where the CUDA backend's would run, and the two are written to compute the
same bits (tests/gpu/test_gpu_hopper_gemm.py compares them): the same wgmma sequence over the same stages,
the epilogue's additions in the same order, rounded once the same way.

The asynchronous instructions (mbarriers, TMA, wgmma and its fences) are inline PTX, which the NVPTX back-end
passes through; the tensor maps are `nvvm.grid_constant` parameters (the generic address TMA reads is the
parameter's own, `cvta.param`, as for `const __grid_constant__` in CUDA). The module targets `sm_90a` (wgmma
exists only there), the one PTX backend module that keeps the arch's `a` (`compile_ptx(..., specific=True)`).
The consumers' loop over K is one asm statement (`consumer_loop` says why); the producer's loop keeps its
counters in allocas, which SROA makes registers. The kernel's resources are ptxas's report, which the tests
check (no spills, within the launch bounds' count, no serialized wgmma).
"""
from __future__ import annotations

import functools
from typing import Optional

from mdsl.errors import UnsupportedError
from mdsl.gpu.hopper_gemm import (BK, BM, INPUT_DTYPES, OUTPUT_DTYPES, THREADS, TILE_NS, kernel_name, launch_gemm,
                                  stages)

#: each dtype's LLVM type and size in bytes
_TYPES = {"bf16": ("bfloat", 2), "f16": ("half", 2), "f32": ("float", 4)}
CONSUMERS = 2


class _Writer:
    """Lines of one function's body, with fresh value names."""

    def __init__(self):
        self.lines: list = []
        self._count = 0

    def fresh(self, stem: str = "v") -> str:
        self._count += 1
        return f"%{stem}{self._count}"

    def __call__(self, line: str) -> None:
        self.lines.append(f"  {line}")

    def value(self, expression: str, stem: str = "v") -> str:
        name = self.fresh(stem)
        self(f"{name} = {expression}")
        return name

    def label(self, name: str) -> None:
        self.lines.append(f"{name}:")

    def labels(self, *stems: str) -> list:
        self._count += 1
        return [f"{stem}{self._count}" for stem in stems]


def _asm(text: str) -> str:
    """An inline-asm string as LLVM IR writes it (newlines escaped)."""
    return '"' + text.replace("\\", "\\5C").replace('"', "\\22").replace("\n", "\\0A") + '"'


def _void_asm(w: _Writer, text: str, constraints: str = "", args: str = "") -> None:
    w(f"call void asm sideeffect {_asm(text)}, \"{constraints}\"({args})")


def _floats(count: int) -> str:
    return "{" + ", ".join(["float"] * count) + "}"


def _wait(w: _Writer, bar: str, parity: str) -> None:
    w(f"call void @mdsl_barrier_wait(i32 {bar}, i32 {parity})")


_PRELUDE = r"""
declare i32 @llvm.nvvm.read.ptx.sreg.tid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.ctaid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.ctaid.y()
declare void @llvm.nvvm.barrier0()

@mdsl_smem = external addrspace(3) global [0 x i8], align 16

; waits until the mbarrier's phase of parity `parity` has completed; 2^30 failed tries (tens of seconds) trap,
; so that the launch fails instead of hanging (hopper_gemm.cuh's barrier_wait)
define internal void @mdsl_barrier_wait(i32 %bar, i32 %parity) alwaysinline nounwind {
entry:
  br label %try
try:
  %tries = phi i32 [ 0, %entry ], [ %next, %again ]
  %done = call i32 asm sideeffect "{\0A .reg .pred p;\0A mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2;\0A selp.u32 $0, 1, 0, p;\0A}", "=r,r,r,~{memory}"(i32 %bar, i32 %parity)
  %ok = icmp ne i32 %done, 0
  br i1 %ok, label %out, label %again
again:
  %next = add i32 %tries, 1
  %stuck = icmp eq i32 %next, 1073741824
  br i1 %stuck, label %trap, label %try
trap:
  call void asm sideeffect "trap;", ""()
  unreachable
out:
  ret void
}
"""


def _store_pair(out_dtype: str, dtype: str) -> str:
    """StoreEpilogue::store<true>: a pair of adjacent columns of C, + bias[col] and + residual where given,
    rounded once to C's dtype, stored where inside M x N (the pair at once where an even row length keeps it
    aligned to its size)."""
    tc, size = _TYPES[out_dtype]
    te, _ = _TYPES[dtype]
    # a value in f32: the 16-bit ones widened (exact), an f32 one as it is (bitcast: the same value, no
    # arithmetic that could turn -0 into +0)
    to_f32 = {"float": "bitcast float {} to float", "half": "fpext half {} to float",
              "bfloat": "fpext bfloat {} to float"}
    from_f32 = {"float": "bitcast float {} to float", "half": "fptrunc float {} to half",
                "bfloat": "fptrunc float {} to bfloat"}
    w = _Writer()
    w.lines.append("entry:")
    w("%inside_rows = icmp slt i32 %row, %m")
    w("%inside_cols = icmp slt i32 %col, %n")
    w("%inside = and i1 %inside_rows, %inside_cols")
    w("br i1 %inside, label %body, label %done")
    w.label("body")
    w("%row64 = sext i32 %row to i64")
    w("%n64 = sext i32 %n to i64")
    w("%col64 = sext i32 %col to i64")
    w("%line = mul i64 %row64, %n64")
    w("%at = add i64 %line, %col64")
    w("%col1 = add i32 %col, 1")
    w("%pair = icmp slt i32 %col1, %n")
    def add_where_given(what: str, index: str, etype: str, align: int, x: str, came_from: str, y: str) -> None:
        """%{y}0, %{y}1 = %{x}0, %{x}1 + what[index], what[index + 1] where `what` is not null (the second
        element only where the pair is)."""
        t, s = what[0], {"bias": "v", "residual": "u"}[what]
        w(f"%has_{what} = icmp ne ptr addrspace(1) %{what}, null")
        w(f"br i1 %has_{what}, label %add_{what}, label %after_{what}")
        w.label(f"add_{what}")
        w(f"%{t}0p = getelementptr inbounds {etype}, ptr addrspace(1) %{what}, i64 {index}")
        w(f"%{t}0 = load {etype}, ptr addrspace(1) %{t}0p, align {align}")
        w(f"%{t}0f = " + to_f32[etype].format(f"%{t}0"))
        w(f"%{s}{t}0 = fadd float %{x}0, %{t}0f")
        w(f"br i1 %pair, label %{what}1, label %after_{what}1")
        w.label(f"{what}1")
        w(f"%{t}1p = getelementptr inbounds {etype}, ptr addrspace(1) %{t}0p, i64 1")
        w(f"%{t}1 = load {etype}, ptr addrspace(1) %{t}1p, align {align}")
        w(f"%{t}1f = " + to_f32[etype].format(f"%{t}1"))
        w(f"br label %after_{what}1")
        w.label(f"after_{what}1")
        w(f"%{t}1v = phi float [ %{t}1f, %{what}1 ], [ 0.0, %add_{what} ]")
        w(f"%{s}{t}1 = fadd float %{x}1, %{t}1v")
        w(f"br label %after_{what}")
        w.label(f"after_{what}")
        for i in (0, 1):
            w(f"%{y}{i} = phi float [ %{s}{t}{i}, %after_{what}1 ], [ %{x}{i}, %{came_from} ]")

    add_where_given("bias", "%col64", te, 2, "v", "body", "u")
    add_where_given("residual", "%at", tc, size, "u", "after_bias", "s")
    w("%c0 = " + from_f32[tc].format("%s0"))
    w("%c1 = " + from_f32[tc].format("%s1"))
    w(f"%cp = getelementptr inbounds {tc}, ptr addrspace(1) %c, i64 %at")
    w("%n_odd = and i32 %n, 1")
    w("%n_even = icmp eq i32 %n_odd, 0")
    w("%together = and i1 %pair, %n_even")
    w("br i1 %together, label %both, label %apart")
    w.label("both")
    w(f"%two0 = insertelement <2 x {tc}> poison, {tc} %c0, i32 0")
    w(f"%two = insertelement <2 x {tc}> %two0, {tc} %c1, i32 1")
    w(f"store <2 x {tc}> %two, ptr addrspace(1) %cp, align {2 * size}")
    w("br label %done")
    w.label("apart")
    w(f"store {tc} %c0, ptr addrspace(1) %cp, align {size}")
    w("br i1 %pair, label %second, label %done")
    w.label("second")
    w(f"%cp1 = getelementptr inbounds {tc}, ptr addrspace(1) %cp, i64 1")
    w(f"store {tc} %c1, ptr addrspace(1) %cp1, align {size}")
    w("br label %done")
    w.label("done")
    w("ret void")
    return ("define internal void @mdsl_store_pair(ptr addrspace(1) %c, ptr addrspace(1) %bias, "
            "ptr addrspace(1) %residual, i32 %m, i32 %n, i32 %row, i32 %col, float %v0, float %v1) "
            "alwaysinline nounwind {\n" + "\n".join(w.lines) + "\n}\n")


#: a wgmma descriptor's constant fields (hopper_gemm.cuh's `descriptor`): leading byte offset 16 >> 4, stride
#: byte offset 1024 >> 4 (8 rows of 128 bytes), the 128-byte swizzle
_DESCRIPTOR = (1 << 16) | (64 << 32) | (1 << 62)


def consumer_loop(dtype: str, bn: int) -> str:
    """GemmTile::consume as one PTX asm statement: its outputs $0 .. $(bn / 2 - 1) are the consumer thread's
    sums, its inputs the step count ($n + 0), the ring's 1024-aligned shared address ($n + 1), the consumer's
    byte offset in an A tile ($n + 2) and whether the thread signals its warp's releases ($n + 3, lane 0).

    Why PTX: wgmma reads and writes its accumulators in place, and a statement that reads and writes a value
    ties an output to an input, which LLVM's NVPTX back-end turns into a copy to a fresh register at every
    such statement; the copies between a stage's wgmmas and across the loop's steps make ptxas serialize them
    (or spill, 256 registers live at a copy). Written as one statement with outputs only, the sums stay in
    the same registers from the zeros to the last step, as nvcc keeps them for the CUDA kernel. The loop is
    GemmTile::consume's: wait for the stage's full barrier, its four k16 steps, commit, wait until at most
    this stage's wgmmas run, release the step before's stage (lane 0 of each warp), next stage; after the
    last step wait for all and release its stage. A wait of 2^30 failed tries traps (barrier_wait)."""
    regs, count = bn // 2, stages(bn)
    a_bytes, stage_bytes = BM * BK * 2, (BM + bn) * BK * 2
    k, base, rows, signals = (f"${regs + i}" for i in range(4))
    acc = ", ".join(f"${i}" for i in range(regs))
    lines = [".reg .pred more, ready, wrap, stuck, release, sig;",
             ".reg .b32 kt, stage, phase, previous, tries, full, empty, a_at, w_at, field;",
             ".reg .b64 da, dw;",
             f"setp.ne.b32 sig, {signals}, 0;",
             "mov.b32 kt, 0;", "mov.b32 stage, 0;", "mov.b32 phase, 0;", "mov.b32 previous, 0;",
             *(f"mov.b32 ${i}, 0;" for i in range(regs)),
             f"setp.lt.s32 more, kt, {k};",
             "@!more bra.uni DONE;",
             "STEP:",
             f"mad.lo.u32 full, stage, 8, {base};",
             f"add.u32 full, full, {count * stage_bytes};",
             "mov.b32 tries, 0;",
             "WAIT:",
             "mbarrier.try_wait.parity.shared::cta.b64 ready, [full], phase;",
             "@ready bra.uni FULL;",
             "add.u32 tries, tries, 1;",
             "setp.eq.u32 stuck, tries, 1073741824;",
             "@stuck trap;",
             "bra.uni WAIT;",
             "FULL:",
             f"mad.lo.u32 a_at, stage, {stage_bytes}, {base};",
             f"add.u32 w_at, a_at, {a_bytes};",
             f"add.u32 a_at, a_at, {rows};"]
    for at, d in (("a_at", "da"), ("w_at", "dw")):
        lines += [f"and.b32 field, {at}, 262143;", "shr.u32 field, field, 4;", f"cvt.u64.u32 {d}, field;",
                  f"or.b64 {d}, {d}, {_DESCRIPTOR};"]
    lines.append("wgmma.fence.sync.aligned;")
    for j in range(BK // 16):   # the k16 step j of a stage starts 32 j bytes in: each descriptor plus 2 j
        if j:
            lines += ["add.u64 da, da, 2;", "add.u64 dw, dw, 2;"]
        lines.append(f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{dtype}.{dtype} {{{acc}}}, da, dw, 1, 1, 1, 0, 0;")
    lines += ["wgmma.commit_group.sync.aligned;",
              "wgmma.wait_group.sync.aligned 1;",
              # the step before's wgmmas are done: its stage is free (no step before the first)
              "setp.gt.s32 release, kt, 0;",
              "and.pred release, release, sig;",
              f"mad.lo.u32 empty, previous, 8, {base};",
              f"add.u32 empty, empty, {count * stage_bytes + 8 * count};",
              "@release mbarrier.arrive.shared::cta.b64 _, [empty];",
              "mov.b32 previous, stage;",
              "add.u32 stage, stage, 1;",
              f"setp.eq.u32 wrap, stage, {count};",
              "@wrap mov.b32 stage, 0;",
              "@wrap xor.b32 phase, phase, 1;",
              "add.s32 kt, kt, 1;",
              f"setp.lt.s32 more, kt, {k};",
              "@more bra.uni STEP;",
              "wgmma.wait_group.sync.aligned 0;",
              f"mad.lo.u32 empty, previous, 8, {base};",
              f"add.u32 empty, empty, {count * stage_bytes + 8 * count};",
              "@sig mbarrier.arrive.shared::cta.b64 _, [empty];",
              "DONE:"]
    return "{\n" + "\n".join(lines) + "\n}"


@functools.cache
def llvm_source(dtype: str, out_dtype: str, bn: int) -> str:
    """The LLVM module of one configuration: the kernel `kernel_name(dtype, out_dtype, bn)` with the CUDA
    kernel's parameters (tensor maps of A and W, C, bias, residual, M, N, K) and launch (THREADS threads,
    `smem_bytes(bn)` bytes of dynamic shared memory, grid ceil(M / BM) x ceil(N / bn))."""
    if dtype not in INPUT_DTYPES or out_dtype not in OUTPUT_DTYPES or bn not in TILE_NS:
        raise UnsupportedError(f"no Hopper GEMM for {dtype} operands, a {out_dtype} product and {bn}-column tiles",
                               hint=f"operands {INPUT_DTYPES}, products {OUTPUT_DTYPES}, tiles {TILE_NS}")
    name = kernel_name(dtype, out_dtype, bn)
    regs, count = bn // 2, stages(bn)
    a_bytes, w_bytes = BM * BK * 2, bn * BK * 2
    stage_bytes = a_bytes + w_bytes
    w = _Writer()
    w.lines.append("entry:")
    # the ring's stages, then the full and empty barriers (GemmTile's layout), from the dynamic shared memory's
    # start rounded up to the swizzle's 1024-byte period (declared 16-byte aligned: the rounding is done, not
    # assumed; smem_bytes has the slack)
    stage = w.value("alloca i32, align 4", "stage")
    phase = w.value("alloca i32, align 4", "phase")
    kt = w.value("alloca i32, align 4", "kt")
    tid = w.value("call i32 @llvm.nvvm.read.ptx.sreg.tid.x()", "tid")
    bx = w.value("call i32 @llvm.nvvm.read.ptx.sreg.ctaid.x()", "bx")
    by = w.value("call i32 @llvm.nvvm.read.ptx.sreg.ctaid.y()", "by")
    raw = w.value(f"trunc i64 {w.value('ptrtoint ptr addrspace(3) @mdsl_smem to i64')} to i32")
    base = w.value(f"and i32 {w.value(f'add i32 {raw}, 1023')}, -1024", "base")
    barriers = w.value(f"add i32 {base}, {count * stage_bytes}", "barriers")
    map_a = w.value("ptrtoint ptr %a to i64", "map_a")
    map_w = w.value("ptrtoint ptr %w to i64", "map_w")

    def full(s: str) -> str:
        return w.value(f"add i32 {barriers}, {w.value(f'mul i32 {s}, 8')}", "full")

    def empty(s: str) -> str:
        return w.value(f"add i32 {full(s)}, {8 * count}", "empty")

    def tile(s: str, offset: int) -> str:
        start = w.value(f"add i32 {base}, {w.value(f'mul i32 {s}, {stage_bytes}')}")
        return w.value(f"add i32 {start}, {offset}")

    def next_stage() -> None:   # Ring::next
        s = w.value(f"add i32 {w.value(f'load i32, ptr {stage}')}, 1")
        wrap = w.value(f"icmp eq i32 {s}, {count}")
        w(f"store i32 {w.value(f'select i1 {wrap}, i32 0, i32 {s}')}, ptr {stage}")
        p = w.value(f"load i32, ptr {phase}")
        flipped = w.value(f"xor i32 {p}, 1")
        w(f"store i32 {w.value(f'select i1 {wrap}, i32 {flipped}, i32 {p}')}, ptr {phase}")

    def loop(body, k_tiles: str) -> None:   # for (kt = 0; kt < k_tiles; ++kt) body(kt)
        head, run, end = w.labels("head", "run", "end")
        w(f"store i32 0, ptr {kt}")
        w(f"br label %{head}")
        w.label(head)
        at = w.value(f"load i32, ptr {kt}")
        w(f"br i1 {w.value(f'icmp slt i32 {at}, {k_tiles}')}, label %{run}, label %{end}")
        w.label(run)
        body(at)
        w(f"store i32 {w.value(f'add i32 {at}, 1')}, ptr {kt}")
        w(f"br label %{head}")
        w.label(end)

    def when(condition: str, body) -> None:
        then, after = w.labels("then", "after")
        w(f"br i1 {condition}, label %{then}, label %{after}")
        w.label(then)
        body()
        w(f"br label %{after}")
        w.label(after)

    first = w.value(f"icmp eq i32 {tid}, 0", "first")

    def init() -> None:   # GemmTile::init, by one thread, and both maps prefetched
        for s in range(count):
            _void_asm(w, "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r,~{memory}",
                      f"i32 {full(str(s))}, i32 1")
            _void_asm(w, "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r,~{memory}",
                      f"i32 {empty(str(s))}, i32 {CONSUMERS * 4}")
        _void_asm(w, "fence.mbarrier_init.release.cluster;", "~{memory}")
        for m in (map_a, map_w):
            _void_asm(w, "prefetch.tensormap [$0];", "l,~{memory}", f"i64 {m}")

    when(first, init)
    w("call void @llvm.nvvm.barrier0()")
    m0 = w.value(f"mul i32 {bx}, {BM}", "m0")
    n0 = w.value(f"mul i32 {by}, {bn}", "n0")
    k_tiles = w.value(f"sdiv i32 {w.value(f'add i32 %k, {BK - 1}')}, {BK}", "k_tiles")
    w(f"store i32 0, ptr {stage}")
    w(f"store i32 0, ptr {phase}")
    warpgroup = w.value(f"udiv i32 {tid}, 128", "warpgroup")
    producer, consumer = w.labels("producer", "consumer")
    w(f"br i1 {w.value(f'icmp eq i32 {warpgroup}, 0')}, label %{producer}, label %{consumer}")

    # the producer: one thread fills the ring (GemmTile::produce); the warpgroup's other threads end
    w.label(producer)

    def produce(at: str) -> None:
        s = w.value(f"load i32, ptr {stage}")
        p = w.value(f"load i32, ptr {phase}")
        _wait(w, empty(s), w.value(f"xor i32 {p}, 1"))
        bar = full(s)
        _void_asm(w, "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r,~{memory}",
                  f"i32 {bar}, i32 {stage_bytes}")
        inner = w.value(f"mul i32 {at}, {BK}")
        for offset, m, outer in ((0, map_a, m0), (a_bytes, map_w, n0)):
            _void_asm(w, "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                         "[$0], [$1, {$3, $4}], [$2];", "r,l,r,r,r,~{memory}",
                      f"i32 {tile(s, offset)}, i64 {m}, i32 {bar}, i32 {inner}, i32 {outer}")
        next_stage()

    when(first, lambda: loop(produce, k_tiles))
    w("ret void")

    # the consumers: 64 rows of the tile each, summed over K (GemmTile::consume) by one asm statement, its
    # accumulators outputs only ("=f"): see consumer_loop
    w.label(consumer)
    index = w.value(f"sub i32 {warpgroup}, 1", "index")
    lane = w.value(f"and i32 {tid}, 31", "lane")
    signals = w.value(f"zext i1 {w.value(f'icmp eq i32 {lane}, 0')} to i32", "signals")
    rows = w.value(f"mul i32 {index}, {64 * BK * 2}", "rows")
    operands = (("r", f"i32 {k_tiles}"), ("r", f"i32 {base}"), ("r", f"i32 {rows}"), ("r", f"i32 {signals}"))
    text = consumer_loop(dtype, bn)
    constraints = ",".join(["=f"] * regs + [c for c, _ in operands])
    result = w.value(f"call {_floats(regs)} asm sideeffect {_asm(text)}, \"{constraints},~{{memory}}\"("
                     f"{', '.join(v for _, v in operands)})", "sums")

    # the epilogue (GemmTile::each, StoreEpilogue): per 8-column group j, thread (warp, g = lane / 4,
    # q = lane % 4) holds rows 16 warp + g and + 8 of columns 8 j + 2 q and 8 j + 2 q + 1
    t = w.value(f"and i32 {tid}, 127")
    warp_rows = w.value(f"mul i32 {w.value(f'udiv i32 {t}, 32')}, 16")
    group = w.value(f"add i32 {warp_rows}, {w.value(f'udiv i32 {lane}, 4')}")
    in_tile = w.value(f"add i32 {w.value(f'mul i32 {index}, 64')}, {group}")
    row = w.value(f"add i32 {m0}, {in_tile}", "row")
    row8 = w.value(f"add i32 {row}, 8", "row8")
    quad = w.value(f"and i32 {lane}, 3")
    col = w.value(f"add i32 {n0}, {w.value(f'mul i32 {quad}, 2')}", "col")
    values = [w.value(f"extractvalue {_floats(regs)} {result}, {i}") for i in range(regs)]
    for j in range(bn // 8):
        cj = w.value(f"add i32 {col}, {8 * j}")
        for r, (i0, i1) in ((row, (4 * j, 4 * j + 1)), (row8, (4 * j + 2, 4 * j + 3))):
            w(f"call void @mdsl_store_pair(ptr addrspace(1) %c, ptr addrspace(1) %bias, ptr addrspace(1) %residual, "
              f"i32 %m, i32 %n, i32 {r}, i32 {cj}, float {values[i0]}, float {values[i1]})")
    w("ret void")

    kernel = (f"define ptx_kernel void @{name}(ptr byval([16 x i64]) align 64 \"nvvm.grid_constant\" %a, "
              f"ptr byval([16 x i64]) align 64 \"nvvm.grid_constant\" %w, ptr addrspace(1) %c, "
              f"ptr addrspace(1) %bias, ptr addrspace(1) %residual, i32 %m, i32 %n, i32 %k) {{\n"
              + "\n".join(w.lines) + "\n}\n")
    annotations = (f"!nvvm.annotations = !{{!0, !1, !2}}\n!0 = !{{ptr @{name}, !\"kernel\", i32 1}}\n"
                   f"!1 = !{{ptr @{name}, !\"maxntidx\", i32 {THREADS}}}\n!2 = !{{ptr @{name}, !\"minctasm\", i32 1}}\n")
    return ('target triple = "nvptx64-nvidia-cuda"\n' + _PRELUDE + "\n" + _store_pair(out_dtype, dtype) + "\n"
            + kernel + "\n" + annotations)


def load_module(dtype: str, out_dtype: str, bn: int):
    """The configuration's kernel: its LLVM IR compiled to PTX for sm_90a (cached) and loaded by the driver."""
    from mdsl.backend.ptx.compile import compile_ptx

    return compile_ptx(llvm_source(dtype, out_dtype, bn), "sm_90a", specific=True).load()


def hopper_gemm(a, w, out=None, *, bias=None, residual=None, out_dtype: Optional[str] = None, stream=None):
    """C = A @ W^T (+ bias) (+ residual) on this module's kernel: `mdsl.gpu.hopper_gemm.launch_gemm` says what it
    takes and returns (the CUDA backend's `hopper_gemm` takes the same)."""
    return launch_gemm(a, w, out, bias=bias, residual=residual, out_dtype=out_dtype, stream=stream, backend="ptx",
                       load=load_module)

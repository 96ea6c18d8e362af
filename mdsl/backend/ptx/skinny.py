"""The skinny loop as LLVM IR: the loop the lowering plans (mdsl.lowering.skinny, which says which block
graphs qualify and describes the load schedule), written as the CUDA prelude's `mdsl::Skinny` writes it,
with the same fragment layout and partial-sum meeting, so that both backends sum the same products in the
same order:

* lane (g, t) of a warp holds chunk g (VEC columns) of rows 4t .. 4t + 3 of each 16-row slab of a weight,
  loaded with 16-byte (8-byte) `ld.global.nc.L1::no_allocate`, and X's 4 elements at 4t of rows g and
  g + 8 (8-byte read-only loads); slabs are dealt to the warps along K (KW of them), STEP slabs a warp
  loads into one register buffer, two buffers in turn (one's loads in flight while the other's mmas run);
  the rows of the slabs after the next are sent to L2 ahead (`prefetch.global.L2`);
* the products on tensor cores with W as the A operand (m16n8k16, four byte permutes per 16 bytes of W),
  X's rows the mma's 8 columns (MT tiles of 8);
* each warp's sums into shared memory (f32), met in a fixed order after one barrier; the row
  accumulators of X (accum_rms's sum of squares) folded from the X fragments the mmas read, by the warps
  of the first column group, each row's folds met over the quad, then over the warps;
* with the plan's `overlap` (programmatic dependent launch): the kernel sends its first slabs to L2, then
  waits for the previous kernel (`griddepcontrol.wait`) before it touches global memory and lets the next
  one launch; `KernelLaunch.overlap` has the runtime launch it to overlap;
* with the plan's `stagger`: block b walks its slabs from slab b SLABS / blocks on, wrapping around, so
  that the blocks do not read the same rows at the same moment;
* with the plan's `wide_x`: a warp's step ("slab" below) spans two 16-row slabs of K, lane t's rows 8t ..
  8t + 7: 8 weight rows a weight, X's fragments of both slabs in one 16-byte load (words 2h, 2h + 1 for the
  mmas of slab h, which take weight rows 4h .. 4h + 3 of the lane's);
* with a prologue reading vectors along K (`(x - b) @ w`): each vector's fragment at X's k (loaded as a
  row of X is, one for all its rows) in every slab of the register buffers beside X's;
* with weights stored [N, K] (`SkinnyShape.transposed`): lane (g, t) loads each of its chunk's VEC rows of N
  at K = rows t .. rows t + rows - 1 (8 bytes, wide_x 16), whose words are its A fragments as they come (no
  byte permutes), and no weight row is sent to L2 ahead.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

from llvmlite import ir

from mdsl.backend.ptx.llvm import ELEMENT_TYPES, I32, I64, Array, f32, i32
from mdsl.backend.ptx.loops import FOLDS, chain_values
from mdsl.backend.ptx.rule_table import PTX_RULES
from mdsl.ir.graph import BlockGraph
from mdsl.ir.skinny import GROUP_CHUNKS, MAX_ROWS, SLAB
from mdsl.lowering.kernel import FINALIZED
from mdsl.lowering.skinny import ROW_FOLDS, SkinnyPlan, scratch_bytes, straddles

_WORD_STRUCTS = {4: ir.LiteralStructType([I32] * 4), 2: ir.LiteralStructType([I32] * 2)}
LOW_HALVES, HIGH_HALVES = 0x5410, 0x7632   # __byte_perm selectors: (a.lo, b.lo), (a.hi, b.hi)


class SkinnyLoop:
    """One block's skinny loop: `mdsl::Skinny<E, M, N, K, LDX, LDW, WARPS, MATS, VEC, ..., WIDE_X>` with the
    same constants (SPAN: `span`, ROWS: `rows`), each thread's pointers, and the code of its members."""

    def __init__(self, bk, skinny: SkinnyPlan, parts: dict, warps: int, prologue: Optional[Callable] = None):
        fn, b = bk.fn, bk.fn.b
        shape = skinny.shape
        self.bk, self.fn, self.shape, self.warps, self.skinny = bk, fn, shape, warps, skinny
        # (an element of X, [the vectors' elements at its k]) (f32) -> the operand's, or None: the operand is X
        self.prologue = prologue
        self.vec = shape.columns_per_load()
        self.mats, self.mt = len(shape.weights), -(-shape.m // 8)
        self.group = min(shape.chunks(), GROUP_CHUNKS)
        self.groups = shape.groups()
        self.kw_warps = skinny.warps_along_k(warps)
        self.span = skinny.span                 # 16-row slabs of K in one step of a warp
        self.rows = skinny.lane_rows            # rows of a step each lane loads, from row `rows` t
        self.slabs, self.words = skinny.steps, self.vec // 2   # slabs: the steps of the block's K
        self.step = skinny.step
        x = parts[shape.x]
        self.dtype = x.dtype
        self.etype = ELEMENT_TYPES[x.dtype]
        ldx, self.ldw = x.strides[0], parts[shape.weights[0]].strides[0]
        tid = fn.sreg("tid.x")
        lane = b.urem(tid, i32(32))
        self.warp, self.g, self.t = b.udiv(tid, i32(32)), b.udiv(lane, i32(4)), b.urem(lane, i32(4))
        self.kw = b.udiv(self.warp, i32(self.groups))
        self.start = None   # stagger: the slab this block's walk over K starts from (the grid's share of K)
        if skinny.stagger:
            x_, y_, z_ = (fn.sreg(f"ctaid.{a}") for a in "xyz")
            nx, ny, nz = (fn.sreg(f"nctaid.{a}") for a in "xyz")
            block = b.add(x_, b.mul(nx, b.add(y_, b.mul(ny, z_))))
            self.start = b.udiv(b.mul(block, i32(self.slabs)), b.mul(nx, b.mul(ny, nz)))
        group_of_warp = b.urem(self.warp, i32(self.groups))
        # the warps of the first column group fold X (None: every warp, one group)
        self.folds = None if self.groups == 1 else b.icmp_unsigned("==", group_of_warp, i32(0))
        chunk_in_group = self.g if self.group == GROUP_CHUNKS else b.urem(self.g, i32(self.group))
        self.chunk = b.add(b.mul(group_of_warp, i32(self.group)), chunk_in_group)
        rows_t = b.mul(self.t, i32(self.rows))
        self.xs = []
        for mt in range(self.mt):
            row = b.add(self.g, i32(mt * 8))
            if (mt + 1) * 8 > shape.m:   # rows past M read row M - 1 (never stored)
                row = b.select(b.icmp_unsigned("<", row, i32(shape.m)), row, i32(shape.m - 1))
            self.xs.append(fn.address(x, b.add(b.mul(row, i32(ldx)), rows_t)))
        self.vs = [fn.address(parts[name], rows_t) for name in shape.vectors]   # one row each
        first_row = b.mul(rows_t, i32(self.ldw))
        self.ws, self.lines = [], []
        for name in shape.weights:
            w = parts[name]
            if shape.transposed:   # the chunk's first row of N, at K = rows t
                self.ws.append(fn.address(w, b.add(b.mul(self.chunk, i32(self.vec * self.ldw)), rows_t)))
                continue
            self.ws.append(fn.address(w, b.add(first_row, b.mul(self.chunk, i32(self.vec)))))
            self.lines.append(fn.address(w, b.add(first_row, b.mul(group_of_warp, i32(self.group * self.vec)))))

    # -- memory

    def _at(self, ptr, offset):
        """ptr + offset elements (offset: an i32 value, zero-extended, or an int)."""
        b = self.fn.b
        if isinstance(offset, int):
            return ptr if offset == 0 else b.gep(ptr, [i32(offset)], inbounds=True, source_etype=self.etype)
        return b.gep(ptr, [b.zext(offset, I64)], inbounds=True, source_etype=self.etype)

    def _streamed(self, ptr, n: int) -> list:
        """`n` words of a weight's row (VEC columns, or with the weights stored [N, K] a lane's rows of K):
        `ld.global.nc.L1::no_allocate` (the prelude's Streamed)."""
        regs = ",".join(f"${k}" for k in range(n))
        words = self.fn.b.asm(ir.FunctionType(_WORD_STRUCTS[n], [ptr.type]),
                              f"ld.global.nc.L1::no_allocate.v{n}.u32 {{{regs}}}, [${n}];",
                              ",".join(["=r"] * n + ["l"]), [ptr], True)
        return [self.fn.b.extract_value(words, k) for k in range(n)]

    def _walked(self, slab):
        """The slab of K the walk's slab-th step reads (stagger: from this block's start on, wrapping)."""
        b = self.fn.b
        return slab if self.start is None else b.urem(b.add(slab, self.start), i32(self.slabs))

    def _k(self, slab):
        """The first row of K of the walk's slab-th step."""
        return self.fn.b.mul(self._walked(slab), i32(SLAB * self.span))

    def load(self, slab, clamp: bool = True) -> tuple:
        """A slab's registers: (w[mat][row 0..rows - 1][word], x[mt] as a tuple of 2 span words, v[vector]
        as such a tuple); a slab past the end loads the last one again (its values unused) when `clamp`."""
        fn, b = self.fn, self.fn.b
        if clamp:
            slab = b.select(b.icmp_unsigned("<", slab, i32(self.slabs)), slab, i32(self.slabs - 1))
        k = self._k(slab)
        w = []
        for ws in self.ws:
            if self.shape.transposed:   # the chunk's VEC rows of N, each at the step's K
                row = self._at(ws, k)
                w.append([self._streamed(self._at(row, i * self.ldw), self.rows // 2) for i in range(self.vec)])
                continue
            row = self._at(ws, b.mul(k, i32(self.ldw)))   # the next rows at constant offsets (immediates)
            w.append([self._streamed(self._at(row, i * self.ldw), self.words) for i in range(self.rows)])
        words = 2 * self.span

        def fragment(at) -> tuple:   # read-only: ld.global.nc.v2 (wide_x: .v4, both slabs' fragments)
            vector = b.load(self._at(at, k), typ=ir.VectorType(I32, words), align=4 * words)
            return tuple(b.extract_element(vector, i32(e)) for e in range(words))

        return w, [fragment(xs) for xs in self.xs], [fragment(vs) for vs in self.vs]

    def prefetch(self, first, start: bool = False) -> None:
        """The weight rows of the 2 STEP slabs first, first + KW, ... sent to L2: lane (g, t) takes rows
        rows t .. rows t + rows - 1 of slab g % (2 STEP), from its column group's first column (a line)."""
        fn, b = self.fn, self.fn.b
        # no L2 prefetches in the loop (CudaOptions.lead 0), nor of a weight stored [N, K]
        if (self.skinny.lead == 0 and not start) or self.shape.transposed:
            return
        slab = b.add(first, b.mul(b.urem(self.g, i32(2 * self.step)), i32(self.kw_warps)))
        k = self._k(b.select(b.icmp_unsigned("<", slab, i32(self.slabs)), slab, i32(self.slabs - 1)))
        # a group's row crossing a line (straddles): its last element's line too
        ends = (0, self.group * self.vec - 1) if straddles(self.shape, self.ldw) else (0,)
        for line in self.lines:
            row = self._at(line, b.mul(k, i32(self.ldw)))
            for i in range(self.rows):
                for end in ends:
                    b.asm(ir.FunctionType(ir.VoidType(), [row.type]), "prefetch.global.L2 [$0];", "l",
                          [self._at(row, i * self.ldw + end)], True)

    # -- arithmetic

    def _permute(self, a, c, selector: int):
        return self.fn.b.asm(ir.FunctionType(I32, [I32, I32]), f"prmt.b32 $0, $1, $2, {hex(selector)};",
                             "=r,r,r", [a, c], False)

    def multiply(self, acc: list, slab: tuple) -> None:
        w, x = slab[:2]
        for mat in range(self.mats):
            for h in range(self.span):   # wide_x: the step's two slabs, rows 4h .. 4h + 3 of the lane's
                for j in range(self.words):
                    # rows g and g + 8 of the mma's A: columns 2j, 2j + 1 of the lane's chunk, k its rows 4h ..
                    if self.shape.transposed:   # words 2h, 2h + 1 of its loads of those columns' rows
                        a = [w[mat][2 * j][2 * h], w[mat][2 * j + 1][2 * h],
                             w[mat][2 * j][2 * h + 1], w[mat][2 * j + 1][2 * h + 1]]
                    else:
                        rows = [w[mat][4 * h + i][j] for i in range(4)]
                        a = [self._permute(rows[r], rows[r + 1], selector)
                             for r in (0, 2) for selector in (LOW_HALVES, HIGH_HALVES)]
                    for mt in range(self.mt):   # X's words 2h, 2h + 1 (rows past M: a copy of row M - 1)
                        d = acc[mat][mt][j]
                        out = self.fn.mma_m16n8k16(self.dtype, a, list(x[mt][2 * h:2 * h + 2]), [v.get() for v in d])
                        for var, value in zip(d, out):
                            var.set(value)

    def _unpack(self, word) -> list:
        b = self.fn.b
        pair = b.bitcast(word, ir.VectorType(self.etype, 2))
        return [b.fpext(b.extract_element(pair, i32(e)), ir.FloatType()) for e in range(2)]

    def slab_step(self, acc: list, slab: tuple, folds: list) -> None:
        """One slab multiplied; the operand's elements folded (rows below M, warps of the first column
        group). The operand is X's fragments, or the prologue's value of each of their elements (and of the
        vectors' at their k)."""
        fn, b = self.fn, self.fn.b
        if self.prologue is not None:
            w, x, v = slab
            slab = (w, [tuple(self._mapped(word, [vector[e] for vector in v]) for e, word in enumerate(words))
                        for words in x], v)
        self.multiply(acc, slab)
        if not folds:
            return
        with _when(fn, self.folds):
            for mt in range(self.mt):
                row_inside = None if (mt + 1) * 8 <= self.shape.m else \
                    b.icmp_unsigned("<", b.add(self.g, i32(mt * 8)), i32(self.shape.m))
                with _when(fn, row_inside):
                    values = [v for word in slab[1][mt] for v in self._unpack(word)]
                    for fold, var in folds:
                        for value in values:
                            var[mt].set(fold.step(fn, var[mt].get(), value))

    def _mapped(self, word, vectors: list):
        """A word of two elements of X as the prologue maps them (with the words of the vectors at their k),
        rounded to X's type (cvt.rn)."""
        lo, hi = self._unpack(word)
        pairs = [self._unpack(v) for v in vectors]
        return self.fn.pack_floats(self.prologue(lo, [p[0] for p in pairs]), self.prologue(hi, [p[1] for p in pairs]),
                                   self.dtype)

    def steps(self, acc: list, slabs: list, first, whole: bool, folds: list) -> None:
        """The slabs first, first + KW, ... of a buffer: all of them (`whole`), else those that exist."""
        fn, b = self.fn, self.fn.b
        for q, slab in enumerate(slabs):
            if whole:
                self.slab_step(acc, slab, folds)
                continue
            with fn.when(b.icmp_unsigned("<", b.add(first, i32(q * self.kw_warps)), i32(self.slabs))):
                self.slab_step(acc, slab, folds)

    def run(self, acc: list, folds: list) -> None:
        """acc += this warp's part of X W for each weight; each fold sees every element of X's rows g,
        g + 8 in the block's K exactly once over the block. Two register buffers in turn; the steady
        state has no branch, the last slabs follow, each checked."""
        fn, b = self.fn, self.fn.b
        kw, stride = self.kw_warps, 2 * self.step * self.kw_warps
        buffered = self._buffer([self.load(b.add(self.kw, i32(q * kw))) for q in range(self.step)])
        for ahead in range(1, self.skinny.lead):   # the iterations up to the lead's (CudaOptions.lead)
            self.prefetch(b.add(self.kw, i32(2 * ahead * self.step * kw)))
        stop = max(0, self.slabs - (2 * self.step - 1) * kw)
        with fn.loop(self.kw, stop, stride) as slab:
            self.prefetch(b.add(slab, i32(2 * self.skinny.lead * self.step * kw)))
            a = self._read(buffered)
            later = [self.load(b.add(slab, i32((self.step + q) * kw)), clamp=False) for q in range(self.step)]
            self.steps(acc, a, slab, True, folds)
            self._write(buffered, [self.load(b.add(slab, i32((2 * self.step + q) * kw))) for q in range(self.step)])
            self.steps(acc, later, b.add(slab, i32(self.step * kw)), True, folds)
        with fn.when(b.icmp_unsigned("<", slab, i32(self.slabs))):   # fewer than 2 STEP slabs left
            a = self._read(buffered)
            later = [self.load(b.add(slab, i32((self.step + q) * kw))) for q in range(self.step)]
            self.steps(acc, a, slab, False, folds)
            self.steps(acc, later, b.add(slab, i32(self.step * kw)), False, folds)

    def _buffer(self, slabs: list) -> list:
        """A register buffer carried across the loop (Vars), holding `slabs`."""
        var = self.fn.var
        return [([[[var(v) for v in row] for row in w] for w in ws], [[var(v) for v in pair] for pair in xs],
                 [[var(v) for v in pair] for pair in vs]) for ws, xs, vs in slabs]

    @staticmethod
    def _read(buffered: list) -> list:
        return [([[[v.get() for v in row] for row in w] for w in ws], [tuple(v.get() for v in pair) for pair in xs],
                 [tuple(v.get() for v in pair) for pair in vs]) for ws, xs, vs in buffered]

    @staticmethod
    def _write(buffered: list, slabs: list) -> None:
        for (ws, xs, vs), (w_values, x_values, v_values) in zip(buffered, slabs):
            for w, w_now in zip(ws, w_values):
                for row, row_now in zip(w, w_now):
                    for var, value in zip(row, row_now):
                        var.set(value)
            for pair, pair_now in zip(xs + vs, x_values + v_values):
                for var, value in zip(pair, pair_now):
                    var.set(value)

    def store_part(self, acc: list, part: Array) -> None:
        """This warp's sums into part (f32, MATS x KW x M x part_row: weight, warp along K, row of X, column)."""
        fn, b = self.fn, self.fn.b
        m_rows, n = self.shape.m, self.skinny.part_row()
        distinct = None if self.group == GROUP_CHUNKS else b.icmp_unsigned("<", self.g, i32(self.group))
        with _when(fn, distinct):
            column = b.mul(self.chunk, i32(self.vec))
            two_t = b.mul(self.t, i32(2))
            for mat in range(self.mats):
                base = b.mul(b.add(self.kw, i32(mat * self.kw_warps)), i32(m_rows * n))
                for mt in range(self.mt):
                    for e in range(4):
                        m = b.add(two_t, i32(mt * 8 + (e & 1)))
                        inside = None if mt * 8 + 8 <= m_rows else b.icmp_unsigned("<", m, i32(m_rows))
                        with _when(fn, inside):
                            at = b.add(b.add(base, b.mul(m, i32(n))), column)
                            for j in range(self.words):
                                fn.store_float(part, b.add(at, i32(2 * j + (e >> 1))), acc[mat][mt][j][e].get())


def _when(fn, cond):
    """The code written inside runs where `cond` holds (None: always, no branch)."""
    return contextlib.nullcontext() if cond is None else fn.when(cond)


def emit_skinny(bk, bg: BlockGraph, skinny: SkinnyPlan, parts: dict, part_ptr) -> None:
    """The loop: each warp's streamed part, its partial sums met in shared memory (at `part_ptr`) into the
    accumulators' tiles, and the row accumulators' folds into theirs, then finalized by their own rules
    (mdsl/backend/cuda/skinny.py's `emit_skinny`, statement for statement)."""
    fn, b = bk.fn, bk.fn.b
    shape, warps = skinny.shape, bg.threads // 32
    loop = SkinnyLoop(bk, skinny, parts, warps, _prologue(fn, bg, shape))
    mats, mt_tiles = loop.mats, loop.mt
    for i in shape.rows:
        PTX_RULES[bg.nodes[i].op].init(bk, bg.nodes[i])
    part = Array(part_ptr, "f32", (scratch_bytes(skinny, warps) // 4,), (1,))
    acc = [[[[fn.var(f32(0.0)) for _ in range(4)] for _ in range(loop.words)] for _ in range(mt_tiles)]
           for _ in range(mats)]
    row_folds = [_fold(bg.nodes[i]) for i in shape.rows]
    folds = [(fold, [fn.var(f32(fold.identity)) for _ in range(mt_tiles)]) for fold in row_folds]
    if skinny.overlap:   # no global memory touched above: the previous kernel may still be running
        loop.prefetch(loop.kw, start=True)   # the warp's first two register buffers' slabs: changes no value
        fn.wait_for_previous_kernel()   # its writes are visible from here on
        fn.let_next_kernel_launch()
    loop.run(acc, folds)
    loop.store_part(acc, part)
    for r, (fold, running) in enumerate(folds):
        fn.marker_for(bg.nodes[shape.rows[r]])
        for mt in range(mt_tiles):
            v = running[mt].get()
            for lanes in (1, 2):   # the quad, as mdsl::quad_reduce
                v = fold.combine(fn, v, fn.shuffle_xor(v, lanes))
            row = b.add(loop.g, i32(mt * 8))
            first_lane = b.icmp_unsigned("==", loop.t, i32(0))
            inside = first_lane if (mt + 1) * 8 <= shape.m else \
                b.and_(first_lane, b.icmp_unsigned("<", row, i32(shape.m)))
            with fn.when(inside):
                at = b.add(b.mul(loop.warp, i32(MAX_ROWS)), row)
                fn.store_float(part, b.add(at, i32(skinny.row_folds_at(r, warps))), v)
    fn.barrier()
    _sums_into_tiles(bk, bg, skinny, part, warps)
    fn.barrier()
    finishing = [i for i in shape.rows if bg.nodes[i].op in FINALIZED]
    for i in finishing:
        fn.marker_for(bg.nodes[i])
        PTX_RULES[bg.nodes[i].op].finalize(bk, bg.nodes[i])
    if finishing:
        fn.barrier()


def _prologue(fn, bg: BlockGraph, shape) -> Optional[Callable]:
    """The prologue as a function of an element of X and the vectors' elements at its k (f32, in
    `shape.vectors`' order) giving the operand's (each node's value rounded to its dtype as its tile would
    hold it), or None where there is none (mdsl/backend/cuda/skinny.py's `_prologue`)."""
    if not shape.prologue:
        return None

    def value(x, vectors):
        reg = {shape.x: x, **dict(zip(shape.vectors, vectors))}
        for i in shape.prologue:
            node = bg.nodes[i]
            args = [reg[v.name] for v in node.inputs]
            if node.op == "fused":   # a chain of element-wise ops in f32, rounded where it is stored
                v = chain_values(fn, node.body, args)[node.body.outputs[0].name]
            else:
                v = PTX_RULES[node.op].value(fn, node, args)
            dtype = node.output.type.dtype.name
            reg[node.output.name] = v if dtype == "f32" else fn.to_float(fn.from_float(v, dtype), dtype)
        return reg[shape.left]

    return value


def _fold(node):
    """The fold of a row accumulator of X (mdsl.lowering.skinny.ROW_FOLDS)."""
    return FOLDS[ROW_FOLDS[node.op]]


def _sums_into_tiles(bk, bg: BlockGraph, skinny: SkinnyPlan, part: Array, warps: int) -> None:
    """The block's sums over its warps' partials, in a fixed order, into the accumulators' tiles, and the
    row accumulators' folds over the warps combined into theirs (on the thread of each row)."""
    fn, b = bk.fn, bk.fn.b
    shape = skinny.shape
    kw, row, size = skinny.warps_along_k(warps), skinny.part_row(), shape.m * shape.n
    for mat, i in enumerate(shape.sums):
        fn.marker_for(bg.nodes[i])

        def element(e, mat=mat) -> None:
            total = f32(0.0)
            # e's place in a warp's padded rows
            at = b.add(b.mul(b.udiv(e, i32(shape.n)), i32(row)), b.urem(e, i32(shape.n)))
            for w in range(kw):   # the warps' partial sums, in a fixed order
                total = b.fadd(total, fn.load_float(part, b.add(at, i32((mat * kw + w) * shape.m * row))))
            tile = bk.tile(bg.nodes[shape.sums[mat]].output)
            fn.store_float(tile, fn.offset(e, (shape.m, shape.n), tile), total)

        bk.threads.for_each(fn, size, element)
    tid = fn.sreg("tid.x")
    for r, i in enumerate(shape.rows):
        node = bg.nodes[i]
        fold = _fold(node)
        fn.marker_for(node)
        first = skinny.row_folds_at(r, warps)
        with fn.when(b.icmp_unsigned("<", tid, i32(shape.m))):
            v = fn.load_float(part, b.add(tid, i32(first)))
            for w in range(1, warps):
                v = fold.combine(fn, v, fn.load_float(part, b.add(tid, i32(first + w * MAX_ROWS))))
            tile = bk.tile(node.output)
            at = fn.offset(tid, tuple(tile.shape), tile)
            fn.store_float(tile, at, fold.combine(fn, fn.load_float(tile, at), v))

"""Block-level matmuls on tensor cores as LLVM IR: the CUDA backend's `mdsl::BlockMma` (prelude; which
matmuls qualify: mdsl.lowering.mma) with the same warp and fragment decomposition, so that both
backends sum the same products in the same order per mma.sync.

C = A B for BATCH matrices (A: BATCH x M x K, B: BATCH x K x N, C: BATCH x M x N) by the block's warps:
C's 16 x 8 tiles are dealt to the warps in turn (fragment j of warp w accumulates tile w + j WARPS), each
tile summed over K in steps of 16 by mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}. Lane l of a warp
(g = l / 4, t = l % 4) holds A's elements (g | g + 8, 2t | 2t + 8 and the next column), B's (2t | 2t + 8
and the next row, g) and C's (g | g + 8, 2t and 2t + 1) of its tile (PTX ISA, "Matrix Fragments for
mma.m16n8k16"). Elements outside M, N or K read as zero; an operand stored in another type than the
mma's (an f32 tile) is rounded to it, as the program's dtype says.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

from llvmlite import ir

from mdsl.backend.ptx.llvm import F32, I16, I32, Array, KernelFunction, Var, f32, i32
from mdsl.lowering.mma import MmaShape, batch_stride

MMA_M, MMA_N, MMA_K = 16, 8, 16
FLOAT_PAIR = ir.VectorType(F32, 2)
MMA_IN_FLIGHT = 4         # independent mma.sync a K step's code issues at least (CUDA: K unrolled 4 times)


class BlockMma:
    """The IR of one `MmaShape` in a kernel: fragments (Vars, 4 floats per 16 x 8 tile a warp holds),
    products into them, and the elements they hold."""

    def __init__(self, fn: KernelFunction, shape: MmaShape, dtype: str):
        self.fn, self.shape, self.dtype = fn, shape, dtype
        b, tid = fn.b, fn.sreg("tid.x")
        self.tm, self.tn = -(-shape.m // MMA_M), -(-shape.n // MMA_N)
        self.tiles = shape.batch * self.tm * self.tn
        lane = b.urem(tid, i32(32))
        self.warp, self.g, self.t = b.udiv(tid, i32(32)), b.udiv(lane, i32(4)), b.urem(lane, i32(4))
        self.lane16 = b.urem(tid, i32(16))   # the row of an ldmatrix a lane addresses

    def ldmatrix_b(self, w: Array) -> bool:
        """Whether B's fragments come by ldmatrix.trans (the CUDA prelude's `b_fragment`): B of the mma's
        type, rows a multiple of 16 bytes apart, whole 8-column groups and 16-row K steps."""
        return w.dtype == self.dtype and w.strides[-2] % 8 == 0 and self.shape.n % 8 == 0 and self.shape.k % 16 == 0

    def b_fragment(self, w: Array, k0, n0, guard_k: bool) -> list:
        """B's two registers for the K step at k0 and the 8 columns at n0 (w: a K x N tile)."""
        fn, b = self.fn, self.fn.b
        ldw = w.strides[-2]
        if self.ldmatrix_b(w):
            return fn.ldmatrix_x2_trans(fn.address(w, b.add(b.mul(b.add(k0, self.lane16), i32(ldw)), n0)))
        r, col = b.add(k0, b.mul(self.t, i32(2))), b.add(n0, self.g)
        at = b.add(b.mul(r, i32(ldw)), col)
        return [self._along_column(w, r, col, at, guard_k),
                self._along_column(w, b.add(r, i32(8)), col, b.add(at, i32(8 * ldw)), guard_k)]

    @property
    def per_warp(self) -> int:
        return self.shape.fragments_per_warp

    def zeroed(self) -> list:
        """PER_WARP fragments of 4 f32 Vars, zero."""
        return [[self.fn.var(f32(0.0)) for _ in range(4)] for _ in range(self.per_warp)]

    def _tile_coordinates(self) -> list:
        """(j, batch, m0, n0, guard) for each tile j of the warp's: `guard` is whether the warp has a
        tile j (uniform over the warp), None where every warp has one."""
        b, warps = self.fn.b, self.shape.warps
        out = []
        for j in range(self.per_warp):
            tile = b.add(self.warp, i32(j * warps)) if j else self.warp
            batch = b.udiv(tile, i32(self.tm * self.tn)) if self.shape.batch > 1 else i32(0)
            m0 = b.mul(b.urem(b.udiv(tile, i32(self.tn)), i32(self.tm)), i32(MMA_M)) if self.tm > 1 else i32(0)
            n0 = b.mul(b.urem(tile, i32(self.tn)), i32(MMA_N)) if self.tn > 1 else i32(0)
            guard = None if (j + 1) * warps <= self.tiles else b.icmp_unsigned("<", tile, i32(self.tiles))
            out.append((j, batch, m0, n0, guard))
        return out

    def _guarded(self, guard, body: Callable) -> None:
        if guard is None:
            body()
        else:
            with self.fn.when(guard):
                body()

    def multiply(self, frags: list, a: Array, w: Array, out_batch: tuple) -> None:
        """frags += A B (each warp its tiles); a, w: the operands' tiles, batched as the output. K is
        the outer loop and the warp's tiles the inner one (each tile still sums its products in K's
        order, as the CUDA backend's): a K step issues an mma per tile, independent of each other."""
        fn, b = self.fn, self.fn.b
        m, n, k = self.shape.m, self.shape.n, self.shape.k
        sa, sw = batch_stride(a, out_batch), batch_stride(w, out_batch)
        lda, ldw = a.strides[-2], w.strides[-2]
        tiles = []
        two_t = b.mul(self.t, i32(2))
        ldmatrix = self.ldmatrix_b(w)
        for j, batch, m0, n0, guard in self._tile_coordinates():
            a_at = Array(fn.address(a, b.mul(batch, i32(sa))), a.dtype, (m, k), (lda, 1)) if sa else \
                a.viewed((m, k), (lda, 1))
            w_at = Array(fn.address(w, b.mul(batch, i32(sw))), w.dtype, (k, n), (ldw, 1)) if sw else \
                w.viewed((k, n), (ldw, 1))
            rows = (b.add(m0, self.g), b.add(m0, b.add(self.g, i32(8))))
            col = b.add(n0, self.g)
            # where the lane's rows of A and its column of B start (B's at row 2t, or ldmatrix's row), once
            # for every step
            starts = tuple(b.mul(r, i32(lda)) for r in rows)
            w_start = b.add(b.mul(self.lane16, i32(ldw)), n0) if ldmatrix else b.add(b.mul(two_t, i32(ldw)), col)
            tiles.append((j, guard, a_at, w_at, rows, starts, col, w_start))

        def step(k0, guard_k: bool, active: list) -> None:
            c0 = b.add(k0, two_t)
            c8 = b.add(c0, i32(8))
            w_step = b.mul(k0, i32(ldw)) if not isinstance(k0, ir.Constant) else i32(k0.constant * ldw)
            for j, guard, a_at, w_at, rows, starts, col, w_start in active:
                def product(j=j, a_at=a_at, w_at=w_at, rows=rows, starts=starts, col=col, w_start=w_start) -> None:
                    fa = [self._along_row(a_at, r, start, c, sa, guard_k) for c in (c0, c8)
                          for r, start in zip(rows, starts)]
                    at = b.add(w_start, w_step)
                    if ldmatrix:
                        fb = fn.ldmatrix_x2_trans(fn.address(w_at, at))
                    else:
                        fb = [self._along_column(w_at, c0, col, at, guard_k),
                              self._along_column(w_at, c8, col, b.add(at, i32(8 * ldw)), guard_k)]
                    d = fn.mma_m16n8k16(self.dtype, fa, fb, [v.get() for v in frags[j]])
                    for var, value in zip(frags[j], d):
                        var.set(value)

                product()

        # only a warp's last tile can be missing (PER_WARP is the tiles over the warps, rounded up): the K
        # loop is written for the warps that have it and again for those that do not, as the CUDA
        # backend's loop over K inside the tile's check, so that no branch separates a K step's operand
        # loads from its mma (ptxas then issues the loads of several steps before their mmas)
        last = tiles[-1][1]
        if last is None:
            self._k_steps(lambda k0, guard_k: step(k0, guard_k, tiles))
        elif len(tiles) == 1:
            with fn.when(last):
                self._k_steps(lambda k0, guard_k: step(k0, guard_k, tiles))
        else:
            for case in fn.chain([last]):
                active = tiles if case == 0 else tiles[:-1]
                self._k_steps(lambda k0, guard_k, active=active: step(k0, guard_k, active))

    def _k_steps(self, step: Callable) -> None:
        """step(k0, guard) for k0 = 0, 16, ... below K; guard: the step reaches past K. A group of steps
        issues at least MMA_IN_FLIGHT mma (the warp's tiles times the steps): written out in full where
        K is that short, else a loop over such groups."""
        whole, ragged = divmod(self.shape.k, MMA_K)
        group = max(1, -(-MMA_IN_FLIGHT // self.per_warp))
        if whole <= group:
            for s in range(whole):
                step(i32(s * MMA_K), False)
        else:
            unroll = max(u for u in range(1, group + 1) if whole % u == 0)
            with self.fn.loop(i32(0), whole * MMA_K, unroll * MMA_K) as k0:
                for u in range(unroll):
                    step(k0 if u == 0 else self.fn.b.add(k0, i32(u * MMA_K)), False)
        if ragged:
            step(i32(whole * MMA_K), True)

    def _load_at(self, p: Array, at, inside, etype: Optional[ir.Type]):
        """The element of p at offset `at` (its raw bits, or `etype` read there: a word of several, or
        None: the element as f32), zero where `inside` is false (None: always inside)."""
        fn, b = self.fn, self.fn.b
        if inside is not None:
            at = b.select(inside, at, i32(0))   # read an element that exists
        value = b.load(fn.address(p, at), typ=etype) if etype is not None else fn.load_float(p, at)
        return value if inside is None else b.select(inside, value, ir.Constant(value.type, None))

    def _inside(self, r, rows: int, guard_rows: bool, c, cols: int, guard_cols: bool):
        b, terms = self.fn.b, []
        if guard_rows:
            terms.append(b.icmp_unsigned("<", r, i32(rows)))
        if guard_cols:
            terms.append(b.icmp_unsigned("<", c, i32(cols)))
        if not terms:
            return None
        return terms[0] if len(terms) == 1 else b.and_(terms[0], terms[1])

    def _along_row(self, p: Array, r, row_start, c, matrix_stride: int, guard_k: bool):
        """Elements (r, c) and (r, c + 1) of A (row r starts at offset `row_start`) as a pair of the
        mma's type (c is even)."""
        fn, b = self.fn, self.fn.b
        rows, cols = p.shape
        guard_rows = rows % MMA_M != 0
        at = b.add(row_start, c)
        inside = self._inside(r, rows, guard_rows, c, cols, guard_k)
        paired = p.strides[0] % 2 == 0 and cols % 2 == 0 and matrix_stride % 2 == 0   # (r, c) starts an aligned pair
        if paired and p.dtype == self.dtype:   # one 4-byte word
            return self._load_at(p, at, inside, I32)
        if paired and p.dtype == "f32":        # one 8-byte word, rounded to the pair in one instruction
            two = self._load_at(p, at, inside, FLOAT_PAIR)
            return fn.pack_floats(b.extract_element(two, i32(0)), b.extract_element(two, i32(1)), self.dtype)
        c1 = b.add(c, i32(1))
        lo = self._load_at(p, at, inside, None)
        hi = self._load_at(p, b.add(at, i32(1)), self._inside(r, rows, guard_rows, c1, cols, guard_k or cols % 2 != 0),
                           None)
        return fn.pack_floats(lo, hi, self.dtype)

    def _along_column(self, p: Array, r, c, at, guard_k: bool):
        """Elements (r, c) and (r + 1, c) of B (the first at offset `at`) as a pair of the mma's type (r
        is even)."""
        fn, b = self.fn, self.fn.b
        rows, cols = p.shape
        guard_cols = cols % MMA_N != 0
        values = []
        for row, offset, guard_rows in ((r, at, guard_k), (b.add(r, i32(1)), b.add(at, i32(p.strides[0])),
                                                           guard_k or rows % 2 != 0)):
            inside = self._inside(row, rows, guard_rows, c, cols, guard_cols)
            if p.dtype == self.dtype:   # the 16 bits as they are
                values.append(b.zext(self._load_at(p, offset, inside, I16), I32))
            else:
                values.append(self._load_at(p, offset, inside, None))
        return fn.pair(*values) if p.dtype == self.dtype else fn.pack_floats(*values, self.dtype)

    def each(self, running: list, product: list, f: Callable, per_row: Optional[Callable] = None) -> None:
        """f(running Var, product value, batch, row, column[, row value]) on every element of C the
        warp holds; `per_row(batch, row)`, when given, is computed once per row of a tile the lane
        holds (rows g and g + 8) and handed to f with each element of that row."""
        fn, b = self.fn, self.fn.b
        m, n, warps = self.shape.m, self.shape.n, self.shape.warps
        two_t = b.mul(self.t, i32(2))
        # where the warps divide a row of tiles, tiles j and j' of a warp have the same rows when
        # j // (TN / WARPS) agree: their row values are computed once (by the first, unguarded)
        same_rows = self.tn // warps if self.tn % warps == 0 else None
        known: dict = {}
        for j, batch, m0, n0, guard in self._tile_coordinates():
            def tile(j=j, batch=batch, m0=m0, n0=n0, guard=guard) -> None:
                for half in range(2):
                    row = b.add(m0, b.add(self.g, i32(8))) if half else b.add(m0, self.g)
                    extra = ()
                    key = None if same_rows is None else (j // same_rows, half)
                    if per_row is not None and key in known:
                        extra = known[key]
                    elif per_row is not None:
                        inside_rows = b.icmp_unsigned("<", row, i32(m)) if m % MMA_M else None
                        extra = (per_row(batch, row if inside_rows is None else b.select(inside_rows, row, i32(0))),)
                        if key is not None and guard is None:
                            known[key] = extra
                    for e in (2 * half, 2 * half + 1):
                        col = b.add(n0, b.add(two_t, i32(e % 2)))
                        inside = self._inside(row, m, m % MMA_M != 0, col, n, n % MMA_N != 0)
                        with fn.when(inside) if inside is not None else contextlib.nullcontext():
                            f(running[j][e], product[j][e].get(), batch, row, col, *extra)

            self._guarded(guard, tile)

    def store(self, frags: list, out: Array) -> None:
        """C = frags, rounded to C's type."""
        fn, b = self.fn, self.fn.b
        sc, ldc = batch_stride(out, out.shape[:-2]), out.strides[-2]

        def put(var: Var, value, batch, row, col) -> None:
            at = b.add(b.mul(row, i32(ldc)), col)
            fn.store_float(out, b.add(b.mul(batch, i32(sc)), at) if sc else at, value)

        self.each(frags, frags, put)

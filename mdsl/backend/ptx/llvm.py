"""Helpers for writing LLVM IR (as text, `irtext`; llvmlite.ir's types and constants) for the NVPTX
target: element types (bf16 included),
a kernel function under construction (`KernelFunction`: structured loops and branches, mutable
variables, NVVM special registers, barriers, warp shuffles, the op markers), arrays in global or
shared memory with f32 loads and stores, and index arithmetic over row-major (padded, broadcast)
arrays.

Mutable values (a reduction's running value) live in `alloca`s of the entry block; the optimisation
pipeline run before code generation (SROA / mem2reg) turns them into registers, so the PTX has no
local memory.
"""
from __future__ import annotations

import contextlib
import functools
import math
import struct
from typing import Iterator, Optional, Sequence

import attrs
import numpy as np
from llvmlite import ir

from mdsl.backend.ptx import mathlib
from mdsl.backend.ptx.irtext import Builder, Function, Module, Value, ref
from mdsl.ir.graph import Node
from mdsl.lowering.index import contiguous_strides, merged_dims
from mdsl.lowering.names import OP_MARKER, describe

TRIPLE = "nvptx64-nvidia-cuda"   # the data layout is the target machine's, set when compiling
GLOBAL = 1   # address spaces
SHARED = 3


class BFloatType(ir.types._BaseFloatType):
    """LLVM's `bfloat`, which llvmlite.ir lacks."""

    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self) -> str:
        return "bfloat"

    def format_constant(self, value: float) -> str:
        return "0xR%04X" % (struct.unpack("<I", struct.pack("<f", value))[0] >> 16)


BFloatType._create_instance()

F32 = ir.FloatType()
F16 = ir.HalfType()
BF16 = BFloatType()
I32 = ir.IntType(32)
I64 = ir.IntType(64)
I8 = ir.IntType(8)
I16 = ir.IntType(16)
I1 = ir.IntType(1)
VOID = ir.VoidType()
ELEMENT_TYPES = {"f16": F16, "bf16": BF16, "f32": F32, "i32": I32}
MMA_PTX_TYPES = {"f16": "f16", "bf16": "bf16"}   # the tensor cores' 16-bit operand types
#: integer words of a vector copy, by its size in bytes
WORDS = {2: ir.IntType(16), 4: I32, 8: I64, 16: ir.VectorType(I32, 4)}
_QUAD = ir.LiteralStructType([F32] * 4)
_FOUR_WORDS = ir.LiteralStructType([I32] * 4)
_TWO_WORDS = ir.LiteralStructType([I32] * 2)
_PACK_TYPE = ir.FunctionType(I32, [F32, F32])
_MARKER_TYPE = ir.FunctionType(VOID, [])


@functools.lru_cache(maxsize=4096)
def f32(value: float) -> ir.Constant:
    """An f32 constant of the value rounded to f32 (the precision the kernels compute in; beyond its
    range, infinite)."""
    with np.errstate(over="ignore"):
        return ir.Constant(F32, float(np.float32(value)))


@functools.lru_cache(maxsize=4096)
def i32(value: int) -> ir.Constant:
    return ir.Constant(I32, int(value))


def marker_text(description: str) -> str:
    """An op marker as a PTX comment; characters that inline asm gives a meaning are replaced."""
    clean = description.translate(str.maketrans({"$": "S", "{": "(", "}": ")", "|": "/", "\n": " ", "\\": "/"}))
    return OP_MARKER + clean


@attrs.frozen
class Array:
    """An array in memory as the emitted IR sees it: a pointer value, the dtype name it is stored
    as, its shape and its strides (in elements)."""

    ptr: ir.Value
    dtype: str
    shape: tuple
    strides: tuple

    @classmethod
    def contiguous(cls, ptr: ir.Value, dtype: str, shape: tuple) -> "Array":
        return cls(ptr, dtype, tuple(shape), contiguous_strides(tuple(shape)))

    def viewed(self, shape: tuple, strides: tuple) -> "Array":
        return attrs.evolve(self, shape=tuple(shape), strides=tuple(strides))

    @property
    def etype(self) -> ir.Type:
        return ELEMENT_TYPES[self.dtype]


_INTEGER_FOLDS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
                  "udiv": lambda a, b: a // b, "urem": lambda a, b: a % b, "shl": lambda a, b: a << b,
                  "and_": lambda a, b: a & b, "or_": lambda a, b: a | b}
_UNSIGNED_COMPARISONS = {"<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
                         ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}


def _known(value) -> Optional[int]:
    """The value of an integer constant (non-negative i32 or i1), else None."""
    if isinstance(value, ir.Constant) and isinstance(value.type, ir.IntType) and isinstance(value.constant, int) \
            and value.constant >= 0:
        return value.constant
    return None


class FoldingBuilder(Builder):
    """An IRBuilder that folds integer arithmetic on constants (and x + 0, x * 1, x * 0, x / 1, x & true,
    select on a known condition) as it writes: the index arithmetic of unrolled code is mostly
    constants, and what is not written costs neither Python, nor LLVM's parser, nor its code
    generator (this is what InstCombine did for these kernels, at a fraction of the cost)."""

    def _fold(self, name: str, a, b, write):
        x, y = _known(a), _known(b)
        if x is not None and y is not None and a.type == b.type and a.type.width in (1, 32):
            if name in ("udiv", "urem") and y == 0:
                return write()
            result = _INTEGER_FOLDS[name](x, y)
            if 0 <= result < (1 << (a.type.width - (1 if a.type.width == 32 else 0))):
                return ir.Constant(a.type, result)
        if name in ("add", "or_") and y == 0 or name == "sub" and y == 0 or name == "shl" and y == 0:
            return a
        if name in ("add", "or_") and x == 0:
            return b
        if name == "mul" and (y == 1 or x == 1):
            return a if y == 1 else b
        if name == "mul" and (y == 0 or x == 0):
            return ir.Constant(a.type, 0)
        if name == "udiv" and y == 1:
            return a
        if name == "and_" and a.type.width == 1 and (x == 1 or y == 1):
            return b if x == 1 else a
        return write()

    def fdiv(self, lhs, rhs, name=""):
        """x / 2^k as x * 2^-k (exact: the same value, a multiply instead of a division sequence)."""
        if isinstance(rhs, ir.Constant) and rhs.type == F32 and isinstance(rhs.constant, float):
            mantissa, exponent = math.frexp(rhs.constant)
            if mantissa == 0.5 and -125 <= exponent <= 126:
                return self.fmul(lhs, ir.Constant(F32, math.ldexp(1.0, 1 - exponent)), name)
        return super().fdiv(lhs, rhs, name)

    def icmp_unsigned(self, cmpop, lhs, rhs, name=""):
        x, y = _known(lhs), _known(rhs)
        if x is not None and y is not None:
            return ir.Constant(I1, int(_UNSIGNED_COMPARISONS[cmpop](x, y)))
        return super().icmp_unsigned(cmpop, lhs, rhs, name)

    def select(self, cond, lhs, rhs, name="", flags=()):
        known = _known(cond) if cond.type is I1 else None
        if known is not None:
            return lhs if known else rhs
        return super().select(cond, lhs, rhs, name, flags)


def _folding(name: str):
    def method(self, lhs, rhs, label=""):
        return self._fold(name, lhs, rhs, lambda: getattr(Builder, name)(self, lhs, rhs, label))

    method.__name__ = name
    return method


for _name in _INTEGER_FOLDS:
    setattr(FoldingBuilder, _name, _folding(_name))


class ModuleBuilder:
    """One LLVM module: kernels, intrinsic declarations and shared-memory globals."""

    def __init__(self, name: str):
        self.module = Module(name, TRIPLE)
        self._dynamic_smem: Optional[Value] = None
        self._invariant: Optional[str] = None

    def intrinsic(self, name: str, ret: ir.Type, args: Sequence[ir.Type]):
        return self.module.declare(name, ret, args)

    def math_function(self, name: str) -> Function:
        """`float mdsl_<name>(float)` of mathlib, defined once per module, always inlined (the
        kernels call exp many times: written once, the module is smaller to build and to parse)."""
        full = f"mdsl_{name}"
        found = self.module.globals.get(full)
        if found is not None:
            return found
        fn = Function(self.module, full, F32, [(F32, "")], prefix="internal ", attributes="alwaysinline nounwind")
        body = _MathBody(self, Builder(fn, fn.append_basic_block("entry")))
        body.b.ret(getattr(mathlib, name)(body, fn.args[0]))
        return fn

    def annotate(self, fn: Function, key: str, value: int) -> None:
        self.module.add_named_metadata("nvvm.annotations", self.module.metadata(f'ptr {fn.ref}, !"{key}", i32 {value}'))

    def invariant(self) -> str:
        """The empty node `!invariant.load` refers to."""
        if self._invariant is None:
            self._invariant = self.module.metadata("")
        return self._invariant

    def dynamic_smem(self) -> Value:
        """A pointer to the block's dynamic shared memory (`extern __shared__`), sized at launch."""
        if self._dynamic_smem is None:
            self._dynamic_smem = self.module.global_variable("mdsl_smem", ir.ArrayType(I8, 0), SHARED,
                                                             "external addrspace(3) global [0 x i8], align 16")
        return self._dynamic_smem

    def static_smem(self, name: str, etype: ir.Type, count: int) -> Value:
        """A pointer to a shared array of its own (`__shared__ T name[count]`)."""
        array = ir.ArrayType(etype, count)
        return self.module.global_variable(name, array, SHARED, f"internal addrspace(3) global {array} undef, align 16")

    def text(self) -> str:
        return self.module.text()


class _MathBody:
    """What mathlib needs (`b`, `call_math`) inside a module's math function."""

    def __init__(self, mb: ModuleBuilder, b: Builder):
        self.mb, self.b = mb, b

    def call_math(self, name: str, *args) -> Value:
        return self.b.call(self.mb.intrinsic(f"llvm.{name}.f32", F32, [a.type for a in args]), list(args))

    def saturate(self, x) -> Value:
        """x clamped to [0, 1] (NaN: 0), cvt.sat.f32.f32."""
        return self.b.call(self.mb.intrinsic("llvm.nvvm.saturate.f", F32, [F32]), [x])


class Var:
    """A mutable f32 (or i32) value: an alloca that the optimiser promotes to a register."""

    def __init__(self, fn: "KernelFunction", slot: Value, ty: ir.Type):
        self.fn, self.slot, self.ty = fn, slot, ty

    def get(self) -> Value:
        return self.fn.b.load(self.slot, typ=self.ty)

    def set(self, value) -> None:
        self.fn.b.store(value, self.slot)


class KernelFunction:
    """A kernel (`.entry`) under construction: its parameters are 16-byte aligned, non-aliasing
    global pointers, the first `read_only` of them never written (their loads are marked
    `!invariant.load`: ld.global.nc, the read-only data path, as the CUDA backend's `const __restrict__`).
    `b` is the builder positioned where the next code goes."""

    def __init__(self, mb: ModuleBuilder, name: str, n_params: int, threads: int, read_only: int = 0):
        self.mb = mb
        ptr = ir.PointerType(addrspace=GLOBAL)
        params = [(ptr, "noalias readonly align 16" if k < read_only else "noalias align 16") for k in range(n_params)]
        self.fn = Function(mb.module, name, VOID, params, prefix="ptx_kernel ")
        self.threads = threads
        # the kernel mark and its launch bounds, as __launch_bounds__(threads, 1)
        for key, value in (("kernel", 1), ("maxntidx", threads), ("minctasm", 1)):
            mb.annotate(self.fn, key, value)
        self._entry = self.fn.append_basic_block("allocas")   # allocas and special registers
        self._allocas = Builder(self.fn, self._entry)
        # a * b + c fused into one fma where the code generator sees it, as nvcc does by default (the
        # CUDA backend's kernels); mathlib's functions are written without it, their rounding exact
        self.b = FoldingBuilder(self.fn, self.fn.append_basic_block("start"), contract=True)
        if read_only:
            self.b.read_only = frozenset(self.fn.args[:read_only])
            self.b.invariant = mb.invariant()
        self._sregs: dict = {}
        self._memo: dict = {}   # (what, basic block, operands) -> what was computed there (`in_block`)

    @property
    def params(self) -> list:
        return list(self.fn.args)

    def finish(self) -> None:
        self.b.ret_void()
        self._allocas.branch(self.fn.blocks[1])

    # -- values ----------------------------------------------------------------------------------

    def intrinsic(self, name: str, ret: ir.Type, args: Sequence) -> Value:
        return self.b.call(self.mb.intrinsic(name, ret, [a.type for a in args]), list(args))

    def sreg(self, name: str) -> Value:
        """A special register (`tid.x`, `ntid.x`, `ctaid.y`, `nctaid.x`...), read once per kernel, in the
        entry block (which dominates every use)."""
        if name not in self._sregs:
            self._sregs[name] = self._allocas.call(self.mb.intrinsic(f"llvm.nvvm.read.ptx.sreg.{name}", I32, []), [])
        return self._sregs[name]

    def shared_pointer(self, g: Value) -> Value:
        """A shared-memory global as a pointer (the global's reference is one)."""
        return g

    def var(self, init) -> Var:
        slot = self._allocas.alloca(init.type)
        self.b.store(init, slot)
        return Var(self, slot, init.type)

    def call_math(self, name: str, *args: ir.Value) -> ir.Value:
        """An LLVM intrinsic on f32 (`fma`, `sqrt`, `maxnum`, `trunc`...)."""
        return self.intrinsic(f"llvm.{name}.f32", F32, args)

    def math(self, name: str, x: ir.Value) -> ir.Value:
        """A mathlib function (`exp`, `erf`) of x."""
        return self.b.call(self.mb.math_function(name), [x])

    # -- control flow ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def loop(self, start: ir.Value, stop, step) -> Iterator[ir.Value]:
        """`for (i = start; i < stop; i += step)` (unsigned): yields i; the body is the caller's."""
        b = self.b
        stop, step = _as_i32(stop), _as_i32(step)
        head, body, done = (self.fn.append_basic_block(n) for n in ("loop", "body", "after"))
        before = b.block
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I32, name="i")
        i.add_incoming(start, before)
        b.cbranch(b.icmp_unsigned("<", i, stop), body, done)
        b.position_at_end(body)
        yield i
        nxt = b.add(i, step)
        i.add_incoming(nxt, b.block)
        b.branch(head)
        b.position_at_end(done)

    @contextlib.contextmanager
    def when(self, cond: ir.Value) -> Iterator[None]:
        if _known(cond) == 1:   # always: no branch
            yield
            return
        with self.b.if_then(cond):
            yield

    def if_values(self, cond: Optional[ir.Value], body) -> list:
        """body() (a list of values) computed where `cond` holds, else zeros (same types): the values
        are usable after the branch (phis at its end). `cond` None: body() unguarded."""
        if cond is None or _known(cond) == 1:
            return body()
        b = self.b
        before = b.block
        then, merge = self.fn.append_basic_block("then"), self.fn.append_basic_block("endif")
        b.cbranch(cond, then, merge)
        b.position_at_end(then)
        values = body()
        end = b.block
        b.branch(merge)
        b.position_at_end(merge)
        out = []
        for value in values:
            phi = b.phi(value.type)
            phi.add_incoming(value, end)
            phi.add_incoming(ir.Constant(value.type, None), before)
            out.append(phi)
        return out

    def chain(self, conditions: Sequence[ir.Value]) -> Iterator[int]:
        """An if / else-if chain with a last `else`: yields the index of each case in turn, with the
        builder inside it (conditions[k] guards case k; the last case has none)."""
        b = self.b
        merge = self.fn.append_basic_block("chain_end")
        for k in range(len(conditions) + 1):
            if k < len(conditions):
                case, rest = self.fn.append_basic_block("case"), self.fn.append_basic_block("else")
                b.cbranch(conditions[k], case, rest)
                b.position_at_end(case)
            yield k
            b.branch(merge)
            if k < len(conditions):
                b.position_at_end(rest)
        b.position_at_end(merge)

    # -- synchronisation and the warp -----------------------------------------------------------

    def barrier(self) -> None:
        self.intrinsic("llvm.nvvm.barrier0", VOID, [])

    def wait_for_previous_kernel(self) -> None:
        """griddepcontrol.wait (programmatic dependent launch): the previous kernel of the stream has
        finished and its writes are visible (at once for a kernel launched without the attribute)."""
        self.b.asm(ir.FunctionType(VOID, []), "griddepcontrol.wait;", "~{memory}", [], True)

    def let_next_kernel_launch(self) -> None:
        """griddepcontrol.launch_dependents: the next overlapping kernel of the stream may launch."""
        self.b.asm(ir.FunctionType(VOID, []), "griddepcontrol.launch_dependents;", "~{memory}", [], True)

    def shuffle_xor(self, value: ir.Value, lane_mask: int) -> ir.Value:
        return self.intrinsic("llvm.nvvm.shfl.sync.bfly.f32", F32, [i32(-1), value, i32(lane_mask), i32(31)])

    # -- asynchronous copies and tensor cores (sm_80+) -------------------------------------------

    def copy_async(self, dst: ir.Value, src: ir.Value, nbytes: int) -> None:
        """cp.async of `nbytes` (4, 8 or 16) from global `src` to shared `dst`, both aligned to it:
        .cg (L2 only) for 16 bytes, as the CUDA backend's copy_async, .ca for less."""
        level = "cg" if nbytes == 16 else "ca"
        self.intrinsic(f"llvm.nvvm.cp.async.{level}.shared.global.{nbytes}", VOID, [dst, src])

    def copy_async_commit(self) -> None:
        """Close this thread's group of cp.async copies issued since the last commit."""
        self.intrinsic("llvm.nvvm.cp.async.commit.group", VOID, [])

    def copy_async_wait(self, pending: int) -> None:
        """Wait until at most `pending` of this thread's committed groups are still in flight."""
        self.intrinsic("llvm.nvvm.cp.async.wait.group", VOID, [i32(pending)])

    def mma_m16n8k16(self, dtype: str, a: Sequence[ir.Value], b: Sequence[ir.Value], c: Sequence[ir.Value]) -> list:
        """D = A B + C on the tensor cores for one warp (mma.sync.aligned.m16n8k16.row.col, f32
        accumulators): a, b are the lane's 4 and 2 registers of 16-bit pairs (i32), c its 4 floats;
        the lane's 4 floats of D. Every lane of the warp must execute it."""
        ptx = MMA_PTX_TYPES[dtype]
        text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32 {{$0,$1,$2,$3}}, {{$4,$5,$6,$7}}, "
                "{$8,$9}, {$10,$11,$12,$13};")
        d = self.b.asm(ir.FunctionType(_QUAD, [I32] * 6 + [F32] * 4), text, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3",
                       [*a, *b, *c], True)
        return [self.b.extract_value(d, e) for e in range(4)]

    def ldmatrix_x4(self, row: ir.Value) -> list:
        """ldmatrix.sync.aligned.m8n8.x4 (shared memory, 16-bit elements): lanes 8m .. 8m + 7 give the
        16-byte aligned row addresses of 8 x 8 matrix m; each lane gets its 4 registers (register m:
        row lane / 4, columns 2 (lane % 4) and the next of matrix m). Every lane of the warp must
        execute it."""
        words = self.intrinsic("llvm.nvvm.ldmatrix.sync.aligned.m8n8.x4.b16", _FOUR_WORDS, [row])
        return [self.b.extract_value(words, e) for e in range(4)]

    def ldmatrix_x2_trans(self, row: ir.Value) -> list:
        """ldmatrix.sync.aligned.m8n8.x2.trans: lanes 0 .. 15 give the row addresses of two 8 x 8
        matrices, each lane gets register m = rows 2 (lane % 4) and the next, column lane / 4 of matrix m
        (an mma B fragment of a row-major K x N tile)."""
        words = self.intrinsic("llvm.nvvm.ldmatrix.sync.aligned.m8n8.x2.trans.b16", _TWO_WORDS, [row])
        return [self.b.extract_value(words, e) for e in range(2)]

    def pack_floats(self, lo: ir.Value, hi: ir.Value, dtype: str) -> ir.Value:
        """Two f32 values rounded to `dtype` (f16 or bf16, to nearest even) as one register, `lo` in the
        low half: cvt.rn.{f16x2,bf16x2}.f32, one instruction (its first source goes high)."""
        return self.b.asm(_PACK_TYPE, f"cvt.rn.{MMA_PTX_TYPES[dtype]}x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo], False)

    def bits16(self, value: ir.Value, dtype: str) -> ir.Value:
        """The 16 bits of an f32 value rounded to `dtype` (f16 or bf16), as an i32 (high half zero)."""
        return self.b.zext(self.b.bitcast(self.from_float(value, dtype), I16), I32)

    def pair(self, lo: ir.Value, hi: ir.Value) -> ir.Value:
        """Two 16-bit values (i32, high halves zero) as one register: `lo` in the low half."""
        return self.b.or_(lo, self.b.shl(hi, i32(16)))

    def marker(self, text: str) -> None:
        """The op marker as a comment in the PTX (an empty inline asm holding it)."""
        self.b.asm(_MARKER_TYPE, marker_text(text), "", [], True)

    def marker_for(self, node: Node) -> None:
        self.marker(describe(node))

    # -- index arithmetic and memory --------------------------------------------------------------

    def offset(self, index: ir.Value, shape: tuple, operand: Array) -> ir.Value:
        """The offset in `operand` of element `index` of a row-major loop over `shape`
        (mdsl.lowering.index.merged_dims). For index x + c with c a multiple of the inner dims' size (an
        unrolled loop's later bodies), that is x's offset (computed once in a basic block) plus a constant."""
        dims = tuple(merged_dims(shape, operand.shape, operand.strides))
        base, constant = _constant_part(index)
        inner = math.prod(size for size, _ in dims[1:])
        if constant and dims and constant % inner == 0:
            delta = constant // inner * dims[0][1]
            return self.b.add(self._offset(base, dims), i32(delta))
        return self._offset(index, dims)

    def in_block(self, what, operands: tuple, make):
        """make()'s value, computed once per basic block for these operands (values, by identity; kept
        alive with the result, so that their ids stay theirs): later uses in the block reuse it."""
        key = (what, id(self.b.block), *map(id, operands))
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = (self.b.block, operands, make())
        return found[2]

    def _offset(self, index: ir.Value, dims: tuple) -> ir.Value:
        return self.in_block(dims, (index,), lambda: self._computed_offset(index, dims))

    def _computed_offset(self, index: ir.Value, dims: tuple) -> ir.Value:
        b, total, inner = self.b, None, 1
        for k in reversed(range(len(dims))):
            size, stride = dims[k]
            if stride:
                coord = index if inner == 1 else b.udiv(index, i32(inner))
                if k > 0:
                    coord = b.urem(coord, i32(size))
                term = coord if stride == 1 else b.mul(coord, i32(stride))
                total = term if total is None else b.add(term, total)
            inner *= size
        return total if total is not None else i32(0)

    def address(self, array: Array, offset: ir.Value) -> ir.Value:
        """The element at `offset`. An offset x + c (c a constant) is addressed as (array + x) + c, so that
        the code generator puts c in the instruction's immediate and shares array + x between the
        accesses of an unrolled loop (an i32 index would be sign-extended: sext(x + c) is not sext(x) + c)."""
        base, constant = _constant_part(offset)
        start = self.in_block(("start", array.etype), (array.ptr, base), lambda: self._start(array, base))
        return self.b.gep(start, [i32(constant)], inbounds=True, source_etype=array.etype) if constant else start

    def _start(self, array: Array, base) -> Value:
        if _known(base) is None:   # every index is below 2^31: zero-extended (one instruction less than a sign)
            base = self.in_block("zext", (base,), lambda: self.b.zext(base, I64))
        return self.b.gep(array.ptr, [base], inbounds=True, source_etype=array.etype)

    def load(self, array: Array, offset: ir.Value) -> ir.Value:
        return self.b.load(self.address(array, offset), typ=array.etype)

    def load_float(self, array: Array, offset: ir.Value) -> ir.Value:
        return self.to_float(self.load(array, offset), array.dtype)

    def store_float(self, array: Array, offset: ir.Value, value: ir.Value) -> None:
        self.b.store(self.from_float(value, array.dtype), self.address(array, offset))

    def load_floats(self, array: Array, offset: ir.Value, count: int) -> list:
        """`count` consecutive elements as f32 values: one access (aligned to it, as the caller guarantees)."""
        if count == 1:
            return [self.load_float(array, offset)]
        vector = self.b.load(self.address(array, offset), typ=_vector_type(array.etype, count),
                             align=count * ITEMSIZE[array.dtype])
        return [self.to_float(self.b.extract_element(vector, i32(j)), array.dtype) for j in range(count)]

    def store_floats(self, array: Array, offset: ir.Value, values: list) -> None:
        """f32 values at `offset` onwards, rounded to the array's dtype: one access of up to 16 bytes (the
        caller guarantees the alignment), as `write_vector`."""
        self.write_vector(array, offset, [self.from_float(v, array.dtype) for v in values])

    def to_float(self, value: ir.Value, dtype: str) -> ir.Value:
        if dtype == "f32":
            return value
        if dtype == "i32":
            return self.b.sitofp(value, F32)
        return self.b.fpext(value, F32)

    def from_float(self, value: ir.Value, dtype: str) -> ir.Value:
        """Rounded to nearest even (f16, bf16); truncated toward zero (i32)."""
        if dtype == "f32":
            return value
        if dtype == "i32":
            return self.b.fptosi(value, I32)
        return self.b.fptrunc(value, ELEMENT_TYPES[dtype])

    def convert(self, value: ir.Value, src: str, dst: str) -> ir.Value:
        """A copy between two dtypes through f32; exact between equal ones (i32 included)."""
        return value if src == dst else self.from_float(self.to_float(value, src), dst)

    def read_vector(self, src: Array, offset: ir.Value, vector: int, dst_dtype: str) -> list:
        """`vector` consecutive elements, to be written as `dst_dtype`: one access when the dtypes
        agree (the caller guarantees the alignment), else each element converted."""
        if src.dtype == dst_dtype:
            nbytes = vector * ITEMSIZE[src.dtype]
            return [self.b.load(self.address(src, offset), typ=WORDS[nbytes], align=nbytes)]
        return [self.convert(self.load(src, offset if j == 0 else self.b.add(offset, i32(j))), src.dtype, dst_dtype)
                for j in range(vector)]

    def write_vector(self, dst: Array, offset: ir.Value, values: list) -> None:
        """What `read_vector` read, at `offset` of `dst`: converted elements of up to 16 bytes in all are
        stored as one vector (one access, as the CUDA backend's `mdsl::copy`: `dst` is aligned to it)."""
        if len(values) == 1 and values[0].type != dst.etype:   # a word holding the elements unconverted
            self.b.store(values[0], self.address(dst, offset), align=_WORD_BYTES[str(values[0].type)])
            return
        nbytes = len(values) * ITEMSIZE[dst.dtype]
        if len(values) > 1 and nbytes in WORDS:
            vector = _vector_type(dst.etype, len(values))
            packed = ir.Constant(vector, ir.Undefined)
            for j, value in enumerate(values):
                packed = self.b.insert_element(packed, value, i32(j))
            self.b.store(packed, self.address(dst, offset), align=nbytes)
            return
        for j, value in enumerate(values):
            self.b.store(value, self.address(dst, offset if j == 0 else self.b.add(offset, i32(j))))


ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4, "i32": 4}


@functools.lru_cache(maxsize=None)
def _vector_type(etype: ir.Type, count: int) -> ir.VectorType:
    return ir.VectorType(etype, count)


_WORD_BYTES = {str(word): nbytes for nbytes, word in WORDS.items()}


def _constant_part(offset: ir.Value) -> tuple:
    """(x, c) where `offset` is the sum x + c of a value and a positive constant (x + c1 + c2 too), else
    (offset, 0)."""
    constant = 0
    while isinstance(offset, Value) and offset.opname == "add":
        c = _known(offset.operands[1])
        if not c:
            break
        constant, offset = constant + c, offset.operands[0]
    return offset, constant


def _as_i32(value) -> ir.Value:
    return i32(value) if isinstance(value, int) else value

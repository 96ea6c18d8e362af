"""LLVM IR written as text while it is built: values, basic blocks, functions and a module, with an
instruction builder whose methods have llvmlite.ir's IRBuilder signatures (the subset the PTX backend
and mathlib use), so that the code writing the kernels reads the same.

Why not llvmlite.ir: building its objects (name uniquing per value) and printing them (str.format per
operand, on every print) would dominate PTX generation (docs/tried-kernels.md). Here an instruction is
one f-string when it is written, a value is its type and its reference (`%tN`), and printing the module
joins lines.
Types and constants stay llvmlite.ir's (`ir.Constant`, `ir.IntType`...): their text is cached.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

from llvmlite import ir

_TYPE_TEXT: dict = {}   # id(type) -> (type, text): the type is kept so that its id is never reused


def type_text(t: ir.Type) -> str:
    found = _TYPE_TEXT.get(id(t))
    if found is None:
        found = _TYPE_TEXT[id(t)] = (t, str(t))
    return found[1]


def ref(v) -> str:
    """A value's reference: `%t3`, `@"name"`, or a constant's text."""
    try:
        return v.ref
    except AttributeError:   # an ir.Constant: its text, kept on it
        v.ref = v.get_reference()
        return v.ref


def typed(v) -> str:
    """`type reference`, as an operand is written (kept on the value)."""
    try:
        return v.typed
    except AttributeError:   # an ir.Constant
        v.typed = f"{type_text(v.type)} {ref(v)}"
        return v.typed


class Value:
    """An SSA value: its type, its reference, and (for instructions) the opcode and operands that wrote
    it (what the folding builder looks at). `root`: the kernel parameter a pointer was derived from."""

    __slots__ = ("type", "ref", "opname", "operands", "root", "typed")

    def __init__(self, type: ir.Type, ref: str, opname: str = "", operands: tuple = (), root=None,
                 type_name: Optional[str] = None):
        self.type, self.ref, self.opname, self.operands, self.root = type, ref, opname, operands, root
        self.typed = f"{type_name or type_text(type)} {ref}"

    def get_reference(self) -> str:
        return self.ref

    def __repr__(self) -> str:
        return f"<{self.opname or 'value'} {type_text(self.type)} {self.ref}>"


class Phi(Value):
    __slots__ = ("incoming",)

    def __init__(self, type: ir.Type, ref: str):
        super().__init__(type, ref, "phi")
        self.incoming: list = []

    def add_incoming(self, value, block: "Block") -> None:
        self.incoming.append((value, block))

    def text(self) -> str:
        edges = ", ".join(f"[{ref(v)}, %\"{b.name}\"]" for v, b in self.incoming)
        return f"  {self.ref} = phi {type_text(self.type)} {edges}"


class Block:
    __slots__ = ("name", "lines", "terminated")

    def __init__(self, name: str):
        self.name, self.lines, self.terminated = name, [], False

    def text(self) -> str:
        return "\n".join([f"{self.name}:"] + [line if isinstance(line, str) else line.text() for line in self.lines])


class Function:
    """A function definition: `header` is the `define` line up to its parameter list, `params` its
    parameters' text; blocks are appended as the body is written."""

    def __init__(self, module: "Module", name: str, ret: ir.Type, params: Sequence[tuple], prefix: str = "",
                 attributes: str = "nounwind"):
        self.module, self.name, self.ret = module, name, ret
        self.args = [Value(t, f"%p{k}", root=None) for k, (t, _) in enumerate(params)]
        for arg in self.args:
            arg.root = arg
        self._params = ", ".join(f"{type_text(t)}{' ' + attrs if attrs else ''} %p{k}"
                                 for k, (t, attrs) in enumerate(params))
        self._prefix, self._attributes = prefix, attributes
        self.blocks: list = []
        self._names = 0
        self.ref = f'@"{name}"'
        module.define(name, self)

    def append_basic_block(self, name: str = "bb") -> Block:
        self._names += 1
        block = Block(f"{name}.{self._names}")
        self.blocks.append(block)
        return block

    def fresh(self) -> str:
        self._names += 1
        return f"%t{self._names}"

    def text(self) -> str:
        head = f"define {self._prefix}{type_text(self.ret)} {self.ref}({self._params}) {self._attributes} {{"
        return "\n".join([head] + [b.text() for b in self.blocks] + ["}"])


class Declaration:
    __slots__ = ("name", "ret", "ref", "text")

    def __init__(self, name: str, ret: ir.Type, args: Sequence[ir.Type]):
        self.name, self.ret, self.ref = name, ret, f'@"{name}"'
        self.text = f"declare {type_text(ret)} {self.ref}({', '.join(type_text(a) for a in args)})"


class Module:
    def __init__(self, name: str, triple: str):
        self.name, self.triple = name, triple
        self.globals: dict = {}       # name -> Function, Declaration or global Value
        self._global_lines: list = []
        self._metadata: list = []     # numbered metadata nodes' text
        self._named: dict = {}        # named metadata -> node numbers

    def define(self, name: str, thing) -> None:
        if name in self.globals:
            raise ValueError(f"the module already defines {name!r}")
        self.globals[name] = thing

    def declare(self, name: str, ret: ir.Type, args: Sequence[ir.Type]) -> Declaration:
        found = self.globals.get(name)
        if found is None:
            found = Declaration(name, ret, args)
            self.define(name, found)
        return found

    def global_variable(self, name: str, etype: ir.Type, addrspace: int, text: str) -> Value:
        """A global `@"name" = <text>` (text: linkage, address space, type, initializer, alignment)."""
        value = Value(ir.PointerType(addrspace=addrspace), f'@"{name}"')
        self.define(name, value)
        self._global_lines.append(f'{value.ref} = {text}')
        return value

    def metadata(self, text: str) -> str:
        """A numbered metadata node `!{...}` (text: its operands); its reference."""
        self._metadata.append(text)
        return f"!{len(self._metadata) - 1}"

    def add_named_metadata(self, name: str, node: str) -> None:
        self._named.setdefault(name, []).append(node)

    def text(self) -> str:
        parts = [f'; ModuleID = "{self.name}"', f'target triple = "{self.triple}"', 'target datalayout = ""', ""]
        parts += self._global_lines
        parts += [g.text for g in self.globals.values() if isinstance(g, Declaration)]
        parts += [g.text() for g in self.globals.values() if isinstance(g, Function)]
        parts += [f"!{name} = !{{{', '.join(nodes)}}}" for name, nodes in self._named.items()]
        parts += [f"!{k} = !{{{text}}}" for k, text in enumerate(self._metadata)]
        return "\n".join(parts) + "\n"


_ICMP_UNSIGNED = {"<": "ult", "<=": "ule", ">": "ugt", ">=": "uge", "==": "eq", "!=": "ne"}
_FCMP_ORDERED = {"<": "olt", "<=": "ole", ">": "ogt", ">=": "oge", "==": "oeq", "!=": "one", "ord": "ord"}
_FCMP_UNORDERED = {"<": "ult", "<=": "ule", ">": "ugt", ">=": "uge", "==": "ueq", "!=": "une", "uno": "uno"}


class Builder:
    """Writes instructions at the end of a block (IRBuilder's methods; `name` arguments are ignored:
    every value is `%tN`). `contract`: float adds and multiplies carry the `contract` flag. `invariant`: the metadata reference marking loads through read-only kernel
    parameters (`ld.global.nc`), None for none; `read_only`: those parameters."""

    def __init__(self, fn: Function, block: Block, contract: bool = False):
        self.fn, self.block = fn, block
        self.read_only: frozenset = frozenset()
        self.invariant: Optional[str] = None
        self.contract = contract   # fadd / fsub / fmul may fuse into fma (nvcc's default, --fmad=true)

    def position_at_end(self, block: Block) -> None:
        self.block = block

    def _value(self, type: ir.Type, text: str, opname: str, operands: tuple, root=None, type_name=None) -> Value:
        fn = self.fn
        fn._names += 1
        name = f"%t{fn._names}"
        self.block.lines.append(f"  {name} = {text}")
        return Value(type, name, opname, operands, root, type_name)

    def _void(self, text: str) -> None:
        self.block.lines.append(f"  {text}")

    # -- arithmetic

    def _binary(self, op: str, lhs, rhs, opname: str) -> Value:
        type_name = type_text(lhs.type)
        return self._value(lhs.type, f"{op} {type_name} {ref(lhs)}, {ref(rhs)}", opname, (lhs, rhs), None, type_name)

    def fneg(self, x, name="", flags=()):
        return self._value(x.type, f"fneg {typed(x)}", "fneg", (x,))

    def icmp_unsigned(self, cmpop, lhs, rhs, name=""):
        return self._value(ir.IntType(1), f"icmp {_ICMP_UNSIGNED[cmpop]} {typed(lhs)}, {ref(rhs)}", "icmp", (lhs, rhs))

    def fcmp_ordered(self, cmpop, lhs, rhs, name="", flags=()):
        return self._value(ir.IntType(1), f"fcmp {_FCMP_ORDERED[cmpop]} {typed(lhs)}, {ref(rhs)}", "fcmp", (lhs, rhs))

    def fcmp_unordered(self, cmpop, lhs, rhs, name="", flags=()):
        return self._value(ir.IntType(1), f"fcmp {_FCMP_UNORDERED[cmpop]} {typed(lhs)}, {ref(rhs)}", "fcmp", (lhs, rhs))

    def select(self, cond, lhs, rhs, name="", flags=()):
        return self._value(lhs.type, f"select {typed(cond)}, {typed(lhs)}, {typed(rhs)}", "select", (cond, lhs, rhs))

    def _cast(self, op: str, value, typ: ir.Type) -> Value:
        return self._value(typ, f"{op} {typed(value)} to {type_text(typ)}", op, (value,))

    def extract_value(self, agg, idx, name=""):
        return self._value(agg.type.elements[idx], f"extractvalue {typed(agg)}, {idx}", "extractvalue", (agg,))

    def extract_element(self, vector, idx, name=""):
        return self._value(vector.type.element, f"extractelement {typed(vector)}, {typed(idx)}", "extractelement",
                           (vector, idx))

    def insert_element(self, vector, value, idx, name=""):
        return self._value(vector.type, f"insertelement {typed(vector)}, {typed(value)}, {typed(idx)}",
                           "insertelement", (vector, value, idx))

    # -- memory

    def gep(self, ptr, indices, inbounds=False, name="", source_etype=None):
        text = ", ".join(typed(i) for i in indices)
        return self._value(ptr.type, f"getelementptr{' inbounds' if inbounds else ''} {type_text(source_etype)}, "
                                     f"{typed(ptr)}, {text}", "getelementptr", (ptr, *indices),
                           getattr(ptr, "root", None))

    def load(self, ptr, name="", align=None, typ=None):
        text = f"load {type_text(typ)}, {typed(ptr)}"
        if align:
            text += f", align {align}"
        if self.invariant is not None and getattr(ptr, "root", None) in self.read_only:
            text += f", !invariant.load {self.invariant}"
        return self._value(typ, text, "load", (ptr,))

    def store(self, value, ptr, align=None):
        self._void(f"store {typed(value)}, {typed(ptr)}{f', align {align}' if align else ''}")

    def alloca(self, typ, name=""):
        return self._value(ir.PointerType(), f"alloca {type_text(typ)}", "alloca", ())

    # -- calls

    def call(self, fn, args, name=""):
        text = f"call {type_text(fn.ret)} {fn.ref}({', '.join(typed(a) for a in args)})"
        if isinstance(fn.ret, ir.VoidType):
            self._void(text)
            return None
        return self._value(fn.ret, text, "call", tuple(args))

    def asm(self, ftype, asm, constraint, args, side_effect, name=""):
        """Inline assembly (`ftype`: an ir.FunctionType)."""
        callee = f"asm {'sideeffect ' if side_effect else ''}\"{asm}\", \"{constraint}\""
        text = f"call {type_text(ftype.return_type)} {callee}({', '.join(typed(a) for a in args)})"
        if isinstance(ftype.return_type, ir.VoidType):
            self._void(text)
            return None
        return self._value(ftype.return_type, text, "call", tuple(args))

    # -- control flow

    def phi(self, typ, name=""):
        phi = Phi(typ, self.fn.fresh())
        self.block.lines.append(phi)
        return phi

    def branch(self, target: Block) -> None:
        self._void(f'br label %"{target.name}"')
        self.block.terminated = True

    def cbranch(self, cond, truebr: Block, falsebr: Block) -> None:
        self._void(f'br {typed(cond)}, label %"{truebr.name}", label %"{falsebr.name}"')
        self.block.terminated = True

    def ret_void(self) -> None:
        self._void("ret void")
        self.block.terminated = True

    def ret(self, value) -> None:
        self._void(f"ret {typed(value)}")
        self.block.terminated = True

    @contextlib.contextmanager
    def if_then(self, pred) -> Iterator[None]:
        then, merge = self.fn.append_basic_block("then"), self.fn.append_basic_block("endif")
        self.cbranch(pred, then, merge)
        self.position_at_end(then)
        yield
        if not self.block.terminated:
            self.branch(merge)
        self.position_at_end(merge)


def _binary_method(opcode: str):
    if opcode in _CONTRACTIBLE:
        def method(self, lhs, rhs, name="", flags=()):
            return self._binary(f"{opcode} contract" if self.contract else opcode, lhs, rhs, opcode)
    else:
        def method(self, lhs, rhs, name="", flags=()):
            return self._binary(opcode, lhs, rhs, opcode)

    return method


def _cast_method(opcode: str):
    def method(self, value, typ, name=""):
        return self._cast(opcode, value, typ)

    return method


_CONTRACTIBLE = ("fadd", "fsub", "fmul")
# IRBuilder's method name -> the instruction
_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "udiv": "udiv", "urem": "urem", "shl": "shl", "lshr": "lshr",
           "ashr": "ashr", "and_": "and", "or_": "or", "fadd": "fadd", "fsub": "fsub", "fmul": "fmul", "fdiv": "fdiv"}
for _method, _opcode in _BINARY.items():
    setattr(Builder, _method, _binary_method(_opcode))
for _opcode in ("zext", "bitcast", "fpext", "fptrunc", "sitofp", "fptosi", "ptrtoint"):
    setattr(Builder, _opcode, _cast_method(_opcode))

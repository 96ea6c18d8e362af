"""The textual LLVM IR writer (mdsl/backend/ptx/irtext.py): what each builder call writes, the marks
the PTX backend relies on (`!invariant.load` only through read-only parameters, `contract` only where
asked), and a module that LLVM's parser and verifier accept."""
from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir

from mdsl.backend.ptx.irtext import Builder, Function, Module

F32, I32, I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
GLOBAL_PTR = ir.PointerType(addrspace=1)


def _kernel(contract: bool = False) -> tuple:
    module = Module("unit", "nvptx64-nvidia-cuda")
    fn = Function(module, "k", ir.VoidType(), [(GLOBAL_PTR, "noalias readonly"), (GLOBAL_PTR, "noalias")],
                  prefix="ptx_kernel ")
    b = Builder(fn, fn.append_basic_block("entry"), contract=contract)
    b.read_only = frozenset(fn.args[:1])
    b.invariant = module.metadata("")
    return module, fn, b


def test_instructions_are_written_as_they_are_built():
    module, fn, b = _kernel()
    x = b.load(b.gep(fn.args[0], [ir.Constant(I64, 4)], inbounds=True, source_etype=F32), typ=F32, align=4)
    y = b.fmul(x, ir.Constant(F32, 2.0))
    b.store(y, fn.args[1])
    lines = fn.blocks[0].lines
    assert lines[0] == f'  {x.operands[0].ref} = getelementptr inbounds float, ptr addrspace(1) %p0, i64 4'
    assert lines[1] == f"  {x.ref} = load float, ptr addrspace(1) {x.operands[0].ref}, align 4, !invariant.load !0"
    assert lines[2] == f"  {y.ref} = fmul float {x.ref}, 0x4000000000000000" and y.opname == "fmul" and y.operands[0] is x
    assert lines[3] == f"  store float {y.ref}, ptr addrspace(1) %p1"


def test_only_loads_through_read_only_parameters_are_invariant():
    module, fn, b = _kernel()
    b.load(b.gep(fn.args[0], [ir.Constant(I64, 1)], source_etype=F32), typ=F32)   # derived from %p0
    b.load(fn.args[1], typ=F32)                                                     # an output
    loads = [line for line in fn.blocks[0].lines if " = load " in line]
    assert "!invariant.load" in loads[0] and "!invariant.load" not in loads[1]


def test_contract_marks_float_adds_and_multiplies_only_where_asked():
    for contract in (False, True):
        module, fn, b = _kernel(contract)
        x = b.load(fn.args[0], typ=F32)
        b.fadd(b.fmul(x, x), x)
        b.fdiv(x, x)
        text = "\n".join(fn.blocks[0].lines)
        assert ("fmul contract float" in text and "fadd contract float" in text) == contract
        assert "fdiv float" in text and "fdiv contract" not in text


def test_a_module_with_branches_and_phis_parses_and_verifies():
    module, fn, b = _kernel()
    entry = b.block
    loop, body, done = (fn.append_basic_block(n) for n in ("loop", "body", "done"))
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(I32)
    i.add_incoming(ir.Constant(I32, 0), entry)
    b.cbranch(b.icmp_unsigned("<", i, ir.Constant(I32, 8)), body, done)
    b.position_at_end(body)
    at = b.gep(fn.args[1], [b.zext(i, I64)], inbounds=True, source_etype=F32)
    with b.if_then(b.icmp_unsigned("==", i, ir.Constant(I32, 3))):
        b.store(b.sitofp(i, F32), at)
    nxt = b.add(i, ir.Constant(I32, 1))
    latch = b.block   # the if_then's merge block
    i.add_incoming(nxt, latch)
    b.branch(loop)
    b.position_at_end(done)
    b.ret_void()
    text = module.text()
    # a phi is written with the incoming edges it has when the module is printed
    assert f'  {i.ref} = phi i32 [0, %"{entry.name}"], [{nxt.ref}, %"{latch.name}"]' in text.splitlines()
    assert latch is not body and "!0 = !{}" in text
    parsed = llvm.parse_assembly(text)
    parsed.verify()
    assert parsed.get_function("k") is not None

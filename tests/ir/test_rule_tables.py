"""The rule tables (mdsl.ir.rules): every operator has every rule each consumer needs, and an operator added
the way any is (its definition, its frontend function, one line per table) runs through tracing, the
reference interpreter, the abstract expressions, the finite-field verifier and both backends' code."""
from __future__ import annotations

import numpy as np
import pytest

import mdsl
import mdsl.megakernel.runtime.cuda_bodies  # noqa: F401 - its tables (the megakernel's consumers)
import mdsl.megakernel.taskgraph.simulator  # noqa: F401
from mdsl import Tensor, f16, f32
from mdsl.backend.cuda import emit_cuda
from mdsl.backend.cuda import loops as cuda_loops
from mdsl.backend.cuda import rules as cuda_rules
from mdsl.backend.cuda.rows import CUDA_ROW_RULES
from mdsl.backend.cuda.rule_table import CUDA_RULES
from mdsl.backend.cuda.streamed import CUDA_STREAMED_RULES
from mdsl.backend.ptx import emit_llvm
from mdsl.backend.ptx import loops as ptx_loops
from mdsl.backend.ptx import rules as ptx_rules
from mdsl.backend.ptx.llvm import f32 as f32_constant
from mdsl.backend.ptx.rows import PTX_ROW_RULES
from mdsl.backend.ptx.rule_table import PTX_RULES
from mdsl.backend.ptx.streamed import PTX_STREAMED_RULES
from mdsl.backend.torch_eager import TORCH_RULES, TorchRule
from mdsl.errors import UnsupportedError
from mdsl.frontend.functions import bind
from mdsl.ir import ops
from mdsl.ir.rules import TABLES, RuleTable
from mdsl.lowering.block import lower
from mdsl.lowering.kernel import FINALIZED
from mdsl.lowering.options import CudaOptions
from mdsl.lowering.rows import ROW_RULES
from mdsl.lowering.skinny import ROW_FOLDS
from mdsl.lowering.streamed import STREAMED_RULES
from mdsl.megakernel.modelgraph.epilogues import EPILOGUE_RULES
from mdsl.megakernel.modelgraph.layers import LAYER_OPS
from mdsl.megakernel.parallel.collectives import COLLECTIVE_RULES
from mdsl.megakernel.parallel.tensor_parallel import SHARD_RULES
from mdsl.megakernel.runtime.cuda_bodies import CUDA_TASK_RULES
from mdsl.megakernel.runtime.task_plan import DEVICE_RULES
from mdsl.megakernel.taskgraph.layer_fusion import FUSION_RULES
from mdsl.megakernel.taskgraph.numpy_bodies import TASK_BODIES
from mdsl.megakernel.taskgraph.partition import TASK_RULES
from mdsl.passes.abstract import ABSTRACT_RULES, output_terms, parse_term, unary_heads
from mdsl.passes.finite_field import FIELD_RULES, oracle
from mdsl.passes.layout import SCRATCH_RULES
from mdsl.passes.verify import verify
from mdsl.search.dims import DIMS_RULES
from mdsl.search.guided import LIFT_RULES, SPLIT_RULES
from mdsl.serving.gpu import GPU_STEP_RULES
from mdsl.serving.steprules import STEP_RULES
from tests.backend.cuda.builder import Graph
from tests.backend.ptx import simulator
from tests.gpu.harness import random_inputs, reference, relative_error, tolerance

#: every table, by its consumer: the operators' (the megakernel's below)
OPERATOR_TABLES = (ABSTRACT_RULES, FIELD_RULES, SCRATCH_RULES, ROW_RULES, STREAMED_RULES, ROW_FOLDS, CUDA_RULES,
                   CUDA_ROW_RULES, CUDA_STREAMED_RULES, PTX_RULES, PTX_ROW_RULES, PTX_STREAMED_RULES, TORCH_RULES,
                   DIMS_RULES, LIFT_RULES, SPLIT_RULES)
LAYER_TABLES = (EPILOGUE_RULES, FUSION_RULES, TASK_RULES, TASK_BODIES, DEVICE_RULES, CUDA_TASK_RULES, SHARD_RULES,
                COLLECTIVE_RULES, STEP_RULES, GPU_STEP_RULES)


def test_every_table_is_checked_here():
    assert {id(t) for t in TABLES} == {id(t) for t in OPERATOR_TABLES + LAYER_TABLES}, \
        "a rule table this test does not know: add it to OPERATOR_TABLES or LAYER_TABLES"
    assert all(t.registry is ops.OPS for t in OPERATOR_TABLES)
    assert all(t.registry is LAYER_OPS for t in LAYER_TABLES)


@pytest.mark.parametrize("table", OPERATOR_TABLES + LAYER_TABLES, ids=lambda t: t.consumer)
def test_every_operator_has_every_rule_its_consumers_need(table):
    """What each table needs is read from the registry: the abstract expressions every operator, the
    finite-field verifier every one but the graph-defined (their bodies are evaluated), each backend a
    rule with the methods of every level its operator appears at (`rule_methods`), each backend's fast
    paths every operator their lowering accepts, the task graph every layer op."""
    assert not table.missing(), f"the {table.consumer} lacks rules: {table.missing()}"


def test_the_tables_need_what_the_registry_says():
    assert all(ABSTRACT_RULES.needs(op) for op in ops.OPS.values())
    assert not FIELD_RULES.needs(ops.OPS["custom"]) and FIELD_RULES.needs(ops.OPS["accum"])
    assert CUDA_RULES.provides(ops.OPS["exp"]) == ("kernel", "block", "expr")
    assert PTX_RULES.provides(ops.OPS["exp"]) == ("kernel", "block", "value")
    assert PTX_RULES.provides(ops.OPS["accum_rescale"]) == ("init", "update", "finalize", "fold_product")
    assert CUDA_RULES.provides(ops.OPS["custom"]) == ("kernel",)
    assert CUDA_RULES.provides(ops.OPS["fused"]) == ("block",)
    # the fast paths hold every element-wise op by its category, and each backend writes what they hold
    assert {name for name, op in ops.OPS.items() if op.is_elementwise} | {"fused"} <= set(ROW_RULES)
    assert set(CUDA_ROW_RULES) == set(PTX_ROW_RULES) == set(ROW_RULES)
    assert set(CUDA_STREAMED_RULES) == set(PTX_STREAMED_RULES) == set(STREAMED_RULES)


def test_every_operator_has_its_reference_semantics():
    """The reference semantics are part of an operator's definition: every one but the graph-defined
    (whose body is its meaning) has a shape rule and a numpy reference."""
    for name, op in ops.OPS.items():
        assert op.is_graph_defined or (op.infer is not None and op.reference is not None), name


@pytest.mark.parametrize("backend", ["cuda", "ptx"])
def test_the_backends_finalize_and_fold_what_the_lowering_says(backend):
    table, folds = (CUDA_RULES, cuda_loops.FOLDS) if backend == "cuda" else (PTX_RULES, ptx_loops.FOLDS)
    for name, op in ops.OPS.items():
        if op.is_accumulator:
            assert (table[name].finalize is not None) == (name in FINALIZED), f"{backend}: {name}'s last step"
    assert {fold for _, fold in ROW_FOLDS.items()} <= set(folds)


# ---------------------------------------------------------------------------------------------
# the table itself


def test_a_missing_rule_names_the_operator_and_the_consumer(monkeypatch):
    monkeypatch.delitem(CUDA_RULES, "matmul")
    with pytest.raises(UnsupportedError, match="the CUDA backend has no rule for matmul") as info:
        CUDA_RULES["matmul"]
    assert "mdsl.backend.cuda.rules" in info.value.hint
    assert CUDA_RULES.missing(["matmul", "exp"]) == {"matmul": "no rule"}


def test_rules_are_typed_and_given_once():
    table = RuleTable("test consumer", cuda_rules.Elementwise, "tests/ir/test_rule_tables.py")
    try:
        with pytest.raises(TypeError, match="not a Elementwise"):
            table.register("exp", lambda node, a: "x")
        with pytest.raises(ValueError, match="not a registered operator"):
            table.register("no_such_op", cuda_rules.Elementwise(lambda node, a: "x"))
        table.register("exp", cuda_rules.Elementwise(lambda node, a: "x"))
        with pytest.raises(ValueError, match="has a rule in the test consumer already"):
            table.register("exp", cuda_rules.Elementwise(lambda node, a: "y"))
    finally:
        TABLES.remove(table)


def test_a_category_rule_covers_operators_added_later():
    assert ROW_RULES.get("silu") is ROW_RULES.get("add") is not None          # element-wise: by category
    assert ROW_RULES.get("rms_norm") is None and "rms_norm" not in ROW_RULES  # no rule of its own, no category's
    assert list(ROW_RULES) == [name for name in ops.OPS if name in ROW_RULES]


# ---------------------------------------------------------------------------------------------
# a unary operator added in the test, as any is added


SOFTSIGN = "softsign"


@pytest.fixture
def softsign():
    """softsign(x) = x / (1 + |x|): its definition, its frontend function and one line per table that needs
    it (the abstract expressions and the fast paths take a unary operator by its category); removed after
    the test, so that no other test sees it."""
    ops.register(ops.unary_op(SOFTSIGN, lambda x: x / (1.0 + np.abs(x)), "x / (1 + |x|)"))
    FIELD_RULES.register(SOFTSIGN, oracle(SOFTSIGN))
    CUDA_RULES.register(SOFTSIGN, cuda_rules.Elementwise(lambda node, a: f"{a[0]} / (1.0f + fabsf({a[0]}))"))
    PTX_RULES.register(SOFTSIGN, ptx_rules.Elementwise(
        lambda fn, node, a: fn.b.fdiv(a[0], fn.b.fadd(f32_constant(1.0), fn.call_math("fabs", a[0])))))
    TORCH_RULES.register(SOFTSIGN, TorchRule(lambda t, xs, a: [t.nn.functional.softsign(xs[0])]))

    def function(x):
        """x / (1 + |x|), element-wise."""
        return bind(SOFTSIGN, [x])[0]

    try:
        yield function
    finally:
        for table in TABLES:
            table.unregister(SOFTSIGN)
        ops.unregister(SOFTSIGN)


def _traced(softsign):
    @mdsl.kernel
    def scaled(x: Tensor[16, 64, f32], y: Tensor[16, 64, f32]):
        return softsign(x) * 2.0 + y

    return scaled


def test_an_added_operator_has_every_rule_and_leaves_nothing_behind(softsign):
    assert ops.OPS[SOFTSIGN].is_unary and SOFTSIGN in ops.unary_operator_names()
    for table in TABLES:
        assert not table.missing(), f"the {table.consumer} lacks rules: {table.missing()}"
    assert SOFTSIGN in ABSTRACT_RULES and SOFTSIGN in ROW_RULES and SOFTSIGN in CUDA_ROW_RULES


def test_no_table_keeps_the_added_operator():
    assert SOFTSIGN not in ops.OPS and not any(SOFTSIGN in table for table in TABLES)


def test_an_added_operator_traces_and_runs_in_the_reference_interpreter(softsign):
    kernel = _traced(softsign)
    assert [n.op for n in kernel.graph.nodes] == [SOFTSIGN, "mul_scalar", "add"]
    x, y = np.random.default_rng(0).standard_normal((2, 16, 64)).astype(np.float32)
    np.testing.assert_allclose(kernel(x, y), x / (1 + np.abs(x)) * 2 + y, rtol=1e-6)


def test_an_added_operator_has_an_abstract_expression(softsign):
    assert SOFTSIGN in unary_heads()
    (term,) = output_terms(_traced(softsign).graph)
    assert str(term) == "add(mul(const(2), softsign(x0)), x1)"
    assert parse_term(str(term)) is term


def test_the_verifier_proves_rewrites_of_an_added_operator(softsign):
    original = _traced(softsign).graph

    @mdsl.kernel
    def doubled(x: Tensor[16, 64, f32], y: Tensor[16, 64, f32]):
        s = softsign(x)
        return y + (s + s)

    @mdsl.kernel
    def tripled(x: Tensor[16, 64, f32], y: Tensor[16, 64, f32]):
        return softsign(x) * 3.0 + y

    @mdsl.kernel
    def other_oracle(x: Tensor[16, 64, f32], y: Tensor[16, 64, f32]):
        return mdsl.sigmoid(x) * 2.0 + y

    assert verify(original, doubled.graph).equivalent
    for wrong in (tripled, other_oracle):
        result = verify(original, wrong.graph)
        assert not result.equivalent and "finite-field test 1" in result.reason, wrong.graph.name


def _custom_kernels():
    """softsign at the kernel level, inside a custom kernel's loop (a fused thread graph), and inside a
    row-resident chain between two tensor-core matmuls."""
    g = Graph("softsign_kernels")
    x = g.input("x", (64, 256), f32)
    g.op(SOFTSIGN, x)
    b = g.block(grid=(4,), forloop=4, threads=128)
    scaled = b.op("mul_scalar", b.op(SOFTSIGN, b.input(x, imap=(0,), fmap=1)), value=0.5)
    b.output(b.op("accum", scaled), omap=(0,))
    b.done()
    q, k, v = g.input("q", (2, 32, 32), f16), g.input("k", (2, 32, 48), f16), g.input("v", (2, 48, 32), f16)
    b = g.block(grid=(2,), forloop=2, threads=64)
    qt, kt, vt = b.input(q, imap=(0,)), b.input(k, imap=(0,), fmap=2), b.input(v, imap=(0,), fmap=1)
    b.output(b.op("accum", b.op("matmul", b.op(SOFTSIGN, b.op("matmul", qt, kt)), vt)), omap=(0,))
    b.done()
    return g.build()


def test_both_backends_write_an_added_operator_at_every_level(softsign):
    graph = _custom_kernels()
    rows_body = graph.nodes[2].body
    lowered = lower(rows_body, tuple(v.type for v in graph.nodes[2].inputs), CudaOptions())
    held = {rows_body.nodes[i].op for i in lowered.rows.nodes}
    assert SOFTSIGN in held and "matmul" in held, "softsign is in the row-resident chain"
    source = emit_cuda(graph, options=CudaOptions()).source
    functions = source.split('extern "C" __global__')[1:]   # one a launch: the kernel, the loop, the rows
    assert len(functions) == 3 and all("(1.0f + fabsf(" in f for f in functions)
    assert "mdsl::RowMma" in source
    llvm_ir = emit_llvm(graph, options=CudaOptions()).llvm_ir
    assert "llvm.fabs.f32" in llvm_ir


@pytest.mark.timeout(300)
def test_the_ptx_kernels_of_an_added_operator_compute_its_reference(softsign):
    """The PTX backend's code run by the CPU simulator of its LLVM IR (tests/backend/ptx/simulator.py)."""
    graph = _custom_kernels()
    inputs = random_inputs(graph, np.random.default_rng(0))
    want = reference(graph, inputs)
    got = simulator.run(emit_llvm(graph, options=CudaOptions()), inputs)
    for g, w, var in zip(got, want, graph.outputs):
        assert relative_error(g, np.asarray(w, np.float64)) <= tolerance(graph), var.name

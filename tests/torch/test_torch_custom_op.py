"""mdsl kernels as torch custom operators (mdsl.torch.custom_op): the CPU implementation (the reference
interpreter), the fake implementation under FakeTensorMode, torch's own operator checks, and a call inside
torch.compile(fullgraph=True) that dynamo captures as one graph."""
from __future__ import annotations

import numpy as np
import pytest

import mdsl
from mdsl.errors import MdslError


@mdsl.kernel
def norm_matmul(x, w):
    return mdsl.rms_norm(x) @ w


@mdsl.kernel
def two_results(x):
    return mdsl.silu(x), mdsl.sum(x, dim=-1, keepdim=True)


@pytest.fixture
def custom_op(torch):
    import mdsl.torch

    return mdsl.torch.custom_op


def _torch_norm_matmul(torch, x, w):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-6) @ w


def test_the_operator_runs_the_kernel_on_cpu_tensors(torch, custom_op):
    op = custom_op(norm_matmul)
    x, w = torch.randn(4, 64), torch.randn(64, 32)
    got = op(x, w)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == (4, 32)
    np.testing.assert_allclose(got.numpy(), norm_matmul(x.numpy(), w.numpy()), rtol=1e-6)
    torch.testing.assert_close(got, _torch_norm_matmul(torch, x, w), rtol=1e-5, atol=1e-5)


def test_one_kernel_one_operator_and_another_kernel_of_that_name_gets_its_own(torch, custom_op):
    op = custom_op(norm_matmul)
    assert custom_op(norm_matmul) is op
    assert op.name.startswith("norm_matmul_") and getattr(torch.ops.mdsl, op.name).default is op.op

    @mdsl.kernel(name="norm_matmul")
    def other(x, w):
        return x @ w

    assert custom_op(other).name != op.name


def test_several_results_come_back_as_a_tuple_in_their_dtypes(torch, custom_op):
    op = custom_op(two_results)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    act, total = op(x)
    assert act.dtype == total.dtype == torch.bfloat16 and act.shape == (3, 16) and total.shape == (3, 1)
    torch.testing.assert_close(act, torch.nn.functional.silu(x.float()).bfloat16(), rtol=1e-2, atol=1e-2)


def test_the_fake_implementation_gives_the_traced_shapes_and_dtypes(torch, custom_op):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    op = custom_op(norm_matmul)
    with FakeTensorMode():
        out = op(torch.empty(7, 64, dtype=torch.float16), torch.empty(64, 48, dtype=torch.float16))
        assert isinstance(out, FakeTensor) and out.shape == (7, 48) and out.dtype == torch.float16
        with pytest.raises(MdslError, match="inner dimensions differ"):
            op(torch.empty(7, 64), torch.empty(32, 48))


def test_torchs_operator_checks_pass(torch, custom_op):
    op = custom_op(norm_matmul)
    results = torch.library.opcheck(op.op, (torch.randn(4, 64), torch.randn(64, 32)))
    assert set(results.values()) == {"SUCCESS"}, results


def test_torch_compile_captures_the_operator_in_one_graph(torch, custom_op):
    from torch._dynamo.testing import CompileCounterWithBackend

    op = custom_op(norm_matmul)
    counter = CompileCounterWithBackend("aot_eager")

    def model(x, w):
        return torch.relu(op(x, w)) * 2.0

    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x, w = torch.randn(5, 64), torch.randn(64, 16)
    torch.testing.assert_close(compiled(x, w), torch.relu(_torch_norm_matmul(torch, x, w)) * 2.0, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes}
    assert any(op.name in t for t in targets), targets


def test_what_is_not_a_kernel_is_refused_with_a_hint(custom_op):
    with pytest.raises(MdslError, match="takes an @mdsl.kernel") as e:
        custom_op(lambda x: x)
    assert "decorate" in e.value.hint



@mdsl.kernel
def scaled_pair(x):
    return mdsl.silu(x), mdsl.sum(x, dim=-1, keepdim=True)


def test_under_inductor_the_operator_is_an_extern_kernel_registered_before_lowering(torch, custom_op, monkeypatch):
    # Inductor's implicit fallback formats every argument's IR, recursively, for a log line (eagerly in torch
    # 2.11): over a chain of mdsl operators that is the whole graph above each, which is why the operator is
    # registered as a fallback from its fake implementation, before Inductor lowers the graph
    import torch._inductor.exc as exc
    import torch._inductor.lowering as lowering
    from torch._inductor.compile_fx import compile_fx

    def formatted(*args, **kwargs):
        raise AssertionError("Inductor took the implicit-fallback path for an mdsl operator")

    monkeypatch.setattr(exc.OperatorIssue, "operator_str", staticmethod(formatted))
    op = custom_op(scaled_pair)
    default = getattr(torch.ops.mdsl, op.name).default
    registered_before = []

    def backend(gm, example_inputs):
        registered_before.append(default in lowering.lowerings)
        return compile_fx(gm, example_inputs)

    def model(x):
        for _ in range(3):
            a, b = op(x)
            x = a * b
        return x

    x = torch.randn(4, 32)
    got = torch.compile(model, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
    assert registered_before == [True]

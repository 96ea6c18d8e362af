"""Thread-graph fusion: IR in, IR out, and the same values under the reference interpreter."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from mdsl.backend.reference import run_block_graph, run_kernel_graph
from mdsl.ir import validate_kernel_graph
from mdsl.ir.dtypes import round_to_dtype
from mdsl.ir.text import parse_graph, print_graph
from mdsl.passes.fusion import fuse_block_graph, fuse_kernel_graph
from tests.backend.cuda.programs import block_graphs, example_kernels
from tests.strategies import block_input_tensors, kernel_graphs

ATTENTION = """\
kernel attention(%q: f16[2, 16, 64], %k: f16[2, 64, 128], %v: f16[2, 128, 64]) {
  %o: f16[2, 16, 64] = custom(%q, %k, %v) block(grid=[2, 1, 1], threads=128, forloop=4) {
    in %bq: f16[1, 16, 64] imap=[0, -, -] fmap=-
    in %bk: f16[1, 64, 32] imap=[0, -, -] fmap=2
    in %bv: f16[1, 32, 64] imap=[0, -, -] fmap=1
    %s: f16[1, 16, 32] = matmul(%bq, %bk)
    %t: f16[1, 16, 32] = mul_scalar(%s) {value=0.125}
    %m: f16[1, 16, 1] = max(%t) {dim=-1, keepdim=true}
    %d: f16[1, 16, 32] = sub(%t, %m)
    %e: f16[1, 16, 32] = exp(%d)
    %pv: f16[1, 16, 64] = matmul(%e, %bv)
    %num: f16[1, 16, 64] = accum_rescale(%pv, %m)
    %den: f16[1, 16, 1] = accum_sum_rescale(%e, %m)
    %r: f16[1, 16, 1] = reciprocal(%den)
    %o: f16[1, 16, 64] = mul(%num, %r)
    %y: f16[1, 16, 64] = silu(%o)
    out %y omap=[0, -, -]
  }
  return %o
}"""

# %t has two users (max and sub): it stays a tile; sub+exp fuse; after the loop, reciprocal's result
# is broadcast by mul (a smaller shape: it would be recomputed per element), so only mul+silu fuse
FUSED = """\
kernel attention(%q: f16[2, 16, 64], %k: f16[2, 64, 128], %v: f16[2, 128, 64]) {
  %o: f16[2, 16, 64] = custom(%q, %k, %v) block(grid=[2, 1, 1], threads=128, forloop=4) {
    in %bq: f16[1, 16, 64] imap=[0, -, -] fmap=-
    in %bk: f16[1, 64, 32] imap=[0, -, -] fmap=2
    in %bv: f16[1, 32, 64] imap=[0, -, -] fmap=1
    %s: f16[1, 16, 32] = matmul(%bq, %bk)
    %t: f16[1, 16, 32] = mul_scalar(%s) {value=0.125}
    %m: f16[1, 16, 1] = max(%t) {dim=-1, keepdim=true}
    %e: f16[1, 16, 32] = fused(%t, %m) thread {
      in %t: f16[1, 16, 32]
      in %m: f16[1, 16, 1]
      %d: f16[1, 16, 32] = sub(%t, %m)
      %e: f16[1, 16, 32] = exp(%d)
      out %e
    }
    %pv: f16[1, 16, 64] = matmul(%e, %bv)
    %num: f16[1, 16, 64] = accum_rescale(%pv, %m)
    %den: f16[1, 16, 1] = accum_sum_rescale(%e, %m)
    %r: f16[1, 16, 1] = reciprocal(%den)
    %y: f16[1, 16, 64] = fused(%num, %r) thread {
      in %num: f16[1, 16, 64]
      in %r: f16[1, 16, 1]
      %o: f16[1, 16, 64] = mul(%num, %r)
      %y: f16[1, 16, 64] = silu(%o)
      out %y
    }
    out %y omap=[0, -, -]
  }
  return %o
}"""


def _random_inputs(graph, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [round_to_dtype(rng.uniform(0.25, 1.0, v.shape), v.dtype) if v.dtype.is_float
            else rng.integers(-8, 8, v.shape) for v in graph.inputs]


def _same_values(a, b, graph) -> None:
    inputs = _random_inputs(graph)
    for x, y in zip(run_kernel_graph(a, inputs), run_kernel_graph(b, inputs)):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.timeout(30)
def test_chains_become_fused_nodes():
    fused = fuse_kernel_graph(parse_graph(ATTENTION))
    assert print_graph(fused) == FUSED
    validate_kernel_graph(fused)
    _same_values(parse_graph(ATTENTION), fused, fused)


@pytest.mark.timeout(30)
def test_what_does_not_fuse():
    graph = parse_graph(ATTENTION)
    body = graph.nodes[0].body
    # a chain's intermediate that is also an output stays a tile
    kept = body.__class__(body.grid, body.threads, body.forloop, body.inputs, body.nodes,
                          body.outputs + (body.outputs[0].__class__(body.nodes[-2].outputs[0], (0, None, None)),))
    fused = fuse_block_graph(kept)
    assert [n.op for n in fused.nodes][-2:] == ["mul", "silu"]
    # accumulators and matmuls are never absorbed; a lone element-wise node stays as it is
    assert {n.op for n in fused.nodes} == {"matmul", "mul_scalar", "max", "fused", "accum_rescale",
                                           "accum_sum_rescale", "reciprocal", "mul", "silu"}


@pytest.mark.timeout(30)
def test_fusion_is_idempotent_and_keeps_graphs_without_chains():
    fused = fuse_kernel_graph(parse_graph(ATTENTION))
    assert fuse_kernel_graph(fused) == fused
    spec = example_kernels()["gqa.gqa"]  # no custom node: nothing to fuse
    assert fuse_kernel_graph(spec) == spec


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(example_kernels()))
def test_fusion_preserves_the_examples(name):
    graph = example_kernels()[name]
    fused = fuse_kernel_graph(graph)
    validate_kernel_graph(fused)
    if graph.custom_nodes() and max(v.type.numel for v in graph.inputs) <= 2**20:
        _same_values(graph, fused, graph)


@pytest.mark.timeout(60)
def test_fusion_preserves_every_block_graph_of_the_coverage_set():
    for name, bg in block_graphs().items():
        if name.startswith(("gqa", "qknorm", "gated_mlp", "rms_norm_linear")):
            continue  # the large examples: the test above
        fused = fuse_block_graph(bg)
        assert len(fused.nodes) <= len(bg.nodes)
        shapes = [t.shape for t in block_input_tensors(bg)]
        rng = np.random.default_rng(1)
        inputs = [rng.uniform(0.25, 1.0, s) for s in shapes]
        for x, y in zip(run_block_graph(bg, inputs), run_block_graph(fused, inputs)):
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12, equal_nan=True, err_msg=name)


@pytest.mark.timeout(60)
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kernel_graphs())
def test_fusion_preserves_random_graphs(graph):
    fused = fuse_kernel_graph(graph)
    validate_kernel_graph(fused)
    _same_values(graph, fused, graph)


@pytest.mark.timeout(30)
def test_dump_after_fusion(monkeypatch, capsys):
    monkeypatch.setenv("MDSL_DUMP_IR", "1")
    fuse_kernel_graph(parse_graph(ATTENTION))
    assert capsys.readouterr().err == f"// ----- IR after fusion -----\n{FUSED}\n"

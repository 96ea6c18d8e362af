"""The example programs: every kernel traces, validates, prints and round-trips through the textual and
JSON forms, every demo runs, and every hand-written block graph computes what its specification does
(on float64 inputs, for several grids and for-loop ranges), which checks the imap / fmap / omap and
accumulator semantics end to end."""
from __future__ import annotations

import runpy

import numpy as np
import pytest

import mdsl
from mdsl.backend.reference import run_kernel_graph
from mdsl.ir import serialize, text, validate_kernel_graph
from tests.examples_util import EXAMPLES, NAMES, example_kernels, load_example

example = load_example
kernels = example_kernels


def test_the_benchmark_examples_are_all_there():
    assert NAMES == ["gated_mlp", "gqa", "lora", "ntrans", "qknorm", "rms_norm_linear"]


@pytest.mark.parametrize("name", NAMES)
def test_example_kernels_trace_validate_print_and_round_trip(name):
    found = kernels(name)
    assert found, f"{name}.py defines no kernels"
    for kernel in found.values():
        graph = kernel.graph
        validate_kernel_graph(graph)
        printed = str(graph)
        assert printed.startswith(f"kernel {graph.name}(")
        assert text.parse_graph(printed) == graph
        assert serialize.loads(serialize.dumps(graph)) == graph


@pytest.mark.parametrize("name", NAMES)
def test_example_runs_as_a_program(name, capsys):
    runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith("kernel ")
    assert "output (" in out


def test_benchmark_shapes():
    gqa, rnl = example("gqa"), example("rms_norm_linear")
    assert [v.shape for v in gqa.gqa_bs8.graph.inputs] == [(16, 256, 64), (16, 64, 4096), (16, 4096, 64)]
    assert [v.shape for v in example("qknorm").qknorm_bs8.graph.inputs] == [(16, 256, 64), (16, 64, 4096),
                                                                            (16, 4096, 64)]
    assert [v.shape for v in rnl.rms_norm_linear_bs8.graph.inputs] == [(16, 4096), (4096, 6144)]
    assert [v.shape for v in example("ntrans").ntrans_bs8.graph.inputs] == [(64, 4096)] * 3
    assert [v.shape for v in example("lora").lora.graph.inputs] == [(16, 256), (256, 4096), (256, 16), (16, 4096)]
    assert [v.shape for v in example("gated_mlp").gated_mlp.graph.inputs] == [(8, 4096), (4096, 4096), (4096, 4096)]
    assert all(v.dtype is mdsl.f16 for v in gqa.gqa.graph.inputs)


def test_fused_and_specified_rms_norm_use_the_same_eps():
    rnl = example("rms_norm_linear")
    (norm, _) = rnl.rms_norm_linear.graph.nodes
    (custom,) = rnl.rms_norm_linear_fused.graph.nodes
    (acc_rms,) = [n for n in custom.body.nodes if n.op == "accum_rms"]
    assert norm.attr("eps") == acc_rms.attr("eps") == rnl.EPS


# ---------------------------------------------------------------------------------------------
# hand-written block graphs == their specifications

def assert_same_outputs(spec: mdsl.KernelFunction, handwritten: mdsl.KernelFunction, seed: int = 0) -> None:
    spec_graph, hand_graph = spec.graph, handwritten.graph
    assert [v.type for v in spec_graph.inputs] == [v.type for v in hand_graph.inputs]
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(v.shape) for v in spec_graph.inputs]
    (expected,) = run_kernel_graph(spec_graph, inputs, precision="float64")
    (got,) = run_kernel_graph(hand_graph, inputs, precision="float64")
    assert got.shape == expected.shape
    assert np.max(np.abs(got - expected)) < 1e-9 * np.max(np.abs(expected))


@pytest.mark.parametrize("bs, k, n, grid_x, forloop", [
    (1, 64, 48, 1, 1),
    (1, 64, 48, 4, 8),
    (2, 128, 96, 12, 16),
    (1, 32, 32, 32, 32),
])
def test_fused_rms_norm_linear_matches_its_spec(bs, k, n, grid_x, forloop):
    rnl = example("rms_norm_linear")
    assert_same_outputs(rnl.make_rms_norm_linear(bs, k=k, n=n),
                        rnl.make_rms_norm_linear_fused(2 * bs, k, n, grid_x=grid_x, forloop=forloop))


@pytest.mark.parametrize("m, k, n, grid_x, forloop", [
    (8, 64, 32, 1, 1),
    (8, 64, 32, 4, 8),
    (4, 128, 64, 16, 4),
    (2, 32, 16, 16, 32),
])
def test_fused_gated_mlp_matches_its_spec(m, k, n, grid_x, forloop):
    mlp = example("gated_mlp")
    assert_same_outputs(mlp.make_gated_mlp(m, k, n), mlp.make_gated_mlp_fused(m, k, n, grid_x, forloop))


@pytest.mark.parametrize("bs, kv_len, queries, head_dim, splits, forloop, row_blocks", [
    (1, 64, 8, 4, 1, 1, 1),       # one block per head: plain softmax, no rescaling
    (1, 64, 8, 4, 1, 8, 1),       # online softmax within one block
    (1, 64, 8, 4, 4, 2, 2),
    (2, 128, 16, 8, 8, 4, 4),
    (1, 32, 4, 4, 16, 2, 1),
])
def test_flash_decoding_gqa_matches_softmax_qk_v(bs, kv_len, queries, head_dim, splits, forloop, row_blocks):
    gqa = example("gqa")
    shape = dict(kv_len=kv_len, queries=queries, head_dim=head_dim)
    assert_same_outputs(gqa.make_gqa(bs, **shape),
                        gqa.make_gqa_flash(bs, splits=splits, forloop=forloop, row_blocks=row_blocks, **shape))

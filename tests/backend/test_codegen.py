"""Emission by both backends, without compiling: the program's launches and aliases as the graph and its
lowering say, views of views, an operator without a rule refused, and no CUDA library loaded by the import
(every operator's rules: tests/ir/test_rule_tables.py). Each backend's own code:
tests/backend/cuda/test_cuda_codegen.py (CUDA C++), tests/backend/ptx/test_ptx_codegen.py (LLVM IR, PTX)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from mdsl.backend.cuda.rule_table import CUDA_RULES
from mdsl.backend.ptx.rule_table import PTX_RULES
from mdsl.errors import UnsupportedError
from mdsl.ir import f16
from mdsl.lowering.block import lower
from mdsl.lowering.options import CudaOptions
from mdsl.passes.fusion import fuse_kernel_graph
from tests.backend.backends import EMITTERS, emit
from tests.backend.cuda.builder import Graph
from tests.backend.cuda.programs import example_kernels
from tests.strategies import example_graphs

#: each backend's rule table
RULES = {"cuda": CUDA_RULES, "ptx": PTX_RULES}
#: how each backend names itself in its errors
NAMES = {"cuda": "CUDA", "ptx": "PTX"}


@pytest.mark.parametrize("backend", EMITTERS)
def test_an_operator_without_a_rule_is_refused(backend, monkeypatch):
    g = Graph("no_rule")
    g.op("exp", g.input("x", (8,), f16))
    monkeypatch.delitem(RULES[backend], "exp")
    with pytest.raises(UnsupportedError, match=f"the {NAMES[backend]} backend has no rule for exp"):
        emit(backend, g.build())


def _entry(backend: str, program, launch) -> bool:
    """Whether the program's code defines the launch's kernel (with its block size, in CUDA C++)."""
    if backend == "cuda":
        return f'extern "C" __global__ void __launch_bounds__({launch.block[0]}, 1)\n{launch.name}(' in program.source
    return f'define ptx_kernel void @"{launch.name}"(' in program.llvm_ir


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["gqa.gqa_flash", "rms_norm_linear.rms_norm_linear_fused"])
@pytest.mark.parametrize("backend", EMITTERS)
def test_launches_follow_the_graph(backend, name):
    graph, options = example_kernels()[name], CudaOptions()
    program = emit(backend, graph, options)
    assert program.graph == fuse_kernel_graph(graph)
    combined = {l.node_index + 1 for l in program.launches if l.counters}   # combines in their split's launch
    assert [l.node_index for l in program.launches] == [i for i in range(len(program.graph.nodes)) if i not in combined]
    assert program.aliases == ()
    for launch in program.launches:
        node = program.graph.nodes[launch.node_index]
        body = node.body
        assert launch.grid == body.grid and launch.block == (body.threads, 1, 1)
        if not launch.counters:   # (a split's launch: tests/backend/test_onelaunch.py)
            assert launch.args == tuple(v.name for v in (*node.inputs, *node.outputs))
            assert launch.smem_bytes == lower(body, tuple(v.type for v in node.inputs), options).memory.total
        assert _entry(backend, program, launch)
    if name == "gqa.gqa_flash":   # flash decoding's split and its combine (2 x 4 groups of 16 splits) in one launch
        assert [(l.name, l.counters) for l in program.launches] == [("gqa_flash_bs1_div", 2 * 4)]
    # the same kernels as the CUDA backend's, launched alike
    cuda = emit("cuda", graph, options)
    assert [(l.name, l.grid, l.block, l.args, l.node_index, l.smem_bytes) for l in program.launches] == \
           [(l.name, l.grid, l.block, l.args, l.node_index, l.smem_bytes) for l in cuda.launches]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", EMITTERS)
def test_standard_kernels_and_views(backend):
    graph = example_graphs()["layout"]
    program = emit(backend, graph)
    ops = [graph.nodes[l.node_index].op for l in program.launches]
    assert ops == ["split", "concat", "transpose", "cast", "clamp", "mean", "rms_norm", "sub", "cast"]
    assert program.aliases == (("d", "c"),)           # reshape: a view, no kernel
    transpose = program.launches[2]
    assert transpose.args == ("d", "e")               # the view's own name; the runtime resolves it
    split = program.launches[0]
    assert split.args == ("x", "a", "b") and split.block == (256, 1, 1)
    cuda = emit("cuda", graph)
    assert [(l.grid, l.block, l.args) for l in program.launches] == [(l.grid, l.block, l.args) for l in cuda.launches]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", EMITTERS)
def test_a_view_of_a_view_aliases_the_original(backend):
    g = Graph("views")
    x = g.input("x", (4, 6), f16)
    y = g.op("reshape", g.op("reshape", x, shape=(24,)), shape=(6, 4))
    program = emit(backend, g.build([g.op("neg", y)]))
    assert program.aliases == (("reshape", "x"), ("reshape_1", "x"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", EMITTERS)
def test_importing_the_backend_loads_no_cuda_library(backend):
    code = (f"import sys, mdsl, mdsl.backend.{backend}, mdsl.backend.{backend}.codegen; "
            "assert not [m for m in sys.modules if m.startswith('cuda')], sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)

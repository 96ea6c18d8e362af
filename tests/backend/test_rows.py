"""Row-resident chains (mdsl.lowering.rows) through both backends, without a GPU: one barrier an iteration
with the next iteration's copies issued behind it, tensor cores fed by ldmatrix with no spills, the
attention plans taking the chain and compiling clean, and the tile lowering's B fragments loaded by
ldmatrix. Which nodes stay in registers, and the CUDA code: tests/backend/cuda/test_cuda_rows.py. The GPU
tests run these programs against the reference under every option set (tests/gpu/test_gpu_fast_paths.py)."""
from __future__ import annotations

import contextlib
import re

import pytest

from mdsl.lowering.block import lower
from mdsl.lowering.options import CudaOptions
from tests.backend.backends import BACKENDS, EMITTERS, emit, kernels_with, module, needs_nvdisasm
from tests.backend.cuda.fast_paths import fast_path_graphs
from tests.backend.cuda.programs import guided_plan

pytestmark = pytest.mark.shared_compile_cache   # a program's code compiled once per session (tests/shared.py)

#: CUDA C++'s barrier, waits for copies in flight and 16-byte copies, in the text of a loop
_CUDA_EVENT = re.compile(r"__syncthreads\(\)|copy_async_wait<(\d+)>|copy_async<16>")


def _cuda_loop_events(graph) -> list:
    program = emit("cuda", graph)
    body = program.source[program.source.index(program.launches[0].name + "("):]
    start = body.index("for (int it = 0;")
    loop = body[start:body.index("copy_async_wait<0>", start)]
    return ["barrier" if m.group(0) == "__syncthreads()" else f"wait {m.group(1)}" if m.group(1) else "copy"
            for m in _CUDA_EVENT.finditer(loop)]


def _ptx_loop_events(graph, monkeypatch) -> list:
    """What the PTX kernel's `forloop` loop body emits, recorded as the emitter writes it."""
    from mdsl.backend.ptx.llvm import KernelFunction

    events, depth, forloop = [], [0], graph.custom_nodes()[0].body.forloop
    inside = []
    loop = KernelFunction.loop

    @contextlib.contextmanager
    def recording_loop(fn, start, stop, step):
        main = depth[0] == 0 and stop == forloop and step == 1 and not inside
        depth[0] += 1
        if main:
            inside.append(True)
        with loop(fn, start, stop, step) as i:
            yield i
        depth[0] -= 1
        if main:
            inside.pop()

    def record(what):
        def method(fn, *args):
            if inside:
                events.append(what if what != "wait" else f"wait {args[0]}")
            return original[what](fn, *args)
        return method

    original = {"barrier": KernelFunction.barrier, "wait": KernelFunction.copy_async_wait,
                "copy": KernelFunction.copy_async}
    monkeypatch.setattr(KernelFunction, "loop", recording_loop)
    for what, name in (("barrier", "barrier"), ("wait", "copy_async_wait"), ("copy", "copy_async")):
        monkeypatch.setattr(KernelFunction, name, record(what))
    emit("ptx", graph, CudaOptions())
    return events


@pytest.mark.parametrize("name", ["flash_decoding_f16", "row_attention_bf16"])
@pytest.mark.parametrize("backend", EMITTERS)
def test_one_barrier_an_iteration_and_copies_behind_it(backend, name, monkeypatch):
    """What the custom kernel's main loop does, in order ('barrier', 'wait N', 'copy'): the chain needs no
    barrier of its own, and the next iteration's copies are issued behind the one barrier that opens an
    iteration; 3 stages: the copies of the next iteration stay in flight."""
    graph = fast_path_graphs()[name]
    events = _cuda_loop_events(graph) if backend == "cuda" else _ptx_loop_events(graph, monkeypatch)
    assert events.count("barrier") == 1 and "copy" in events
    assert events[0] == "wait 1" and events[1] == "barrier" and set(events[2:]) == {"copy"}


def _no_spills(compiled) -> None:
    for resources in compiled.resources.values():
        assert resources.spill_store_bytes == 0 and resources.spill_load_bytes == 0 and resources.stack_bytes == 0


@needs_nvdisasm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["flash_decoding_f16", "row_attention_bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_cores_fed_by_ldmatrix_and_no_spills(backend, name):
    compiled = module(backend, emit(backend, fast_path_graphs()[name]))
    assert kernels_with(compiled.cubin, "HMMA")
    assert kernels_with(compiled.cubin, "LDSM"), "no ldmatrix in the SASS"
    _no_spills(compiled)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["gqa.gqa", "gqa.gqa_bs8", "qknorm.qknorm", "qknorm.qknorm_bs8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_attention_plans_take_it_and_compile_clean(backend, name):
    graph = guided_plan(name)
    node = graph.custom_nodes()[0]
    assert lower(node.body, tuple(v.type for v in node.inputs)).rows is not None
    _no_spills(module(backend, emit(backend, graph)))


@needs_nvdisasm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tile_matmuls_load_whole_b_fragments_with_ldmatrix(backend):
    """The GEMV-like plans' B tiles (weights, 16-byte rows) go to the mma by ldmatrix.trans, not 16-bit loads."""
    compiled = module(backend, emit(backend, guided_plan("rms_norm_linear.rms_norm_linear")))
    assert kernels_with(compiled.cubin, "LDSM")

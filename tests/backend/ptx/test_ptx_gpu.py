"""The PTX backend's fast paths on the GPU (marked `gpu`, skipped without one): the benchmark cases' searched
plans and the split plans' structure (tests/backend/ptx/plans.py) with the default fast paths and each
switched off, built by `runtime.compile_graph(..., backend="ptx")` (which reads the options from the
environment, as the autotuner's runs do) and compared with the reference interpreter by the GPU tests' harness; the loaded modules
report no spills. The skinny loop (`CudaOptions.skinny`) runs on the autotuner's skinny plans (RMSNorm +
Linear at batch 1 and 8, Gated MLP), alone, overlapping the previous kernel, with staggered walks over K and
in steps of two slabs (`CudaOptions.wide_x`, with the L2 lead of 2 or none), and on every benchmark plan
(those it does not qualify keep the tile loop); every benchmark plan's kernels launched to overlap their
predecessors (`CudaOptions.overlap`). The fast-path programs under every option set run through both
backends in tests/gpu/test_gpu_fast_paths.py.

    MDSL_GPU_BACKENDS=ptx .venv/bin/python -m pytest -q -p no:cacheprovider tests/backend/ptx/test_ptx_gpu.py
"""
from __future__ import annotations

import attrs
import pytest

from mdsl.gpu import has_gpu
from mdsl.lowering.options import CudaOptions
from tests.backend.cuda.fast_paths import EVERY_OPTION_SET, FALLBACKS, options_env
from tests.backend.ptx.plans import case_names, plan_graph, split_attention, tuned_skinny_plans

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="no NVIDIA GPU and driver on this machine")]


@pytest.fixture
def ptx_backend(monkeypatch):
    from tests.gpu import harness

    monkeypatch.setattr(harness, "BACKEND", "ptx")
    return harness


def _use(monkeypatch, options_name: str, sets: dict = EVERY_OPTION_SET) -> None:
    _use_options(monkeypatch, sets[options_name])


def _use_options(monkeypatch, options: CudaOptions) -> None:
    skinny = {"MDSL_CUDA_SKINNY": str(int(options.skinny)), "MDSL_CUDA_OVERLAP": str(int(options.overlap)),
              "MDSL_CUDA_STAGGER": str(int(options.stagger)), "MDSL_CUDA_LEAD": str(options.lead),
              "MDSL_CUDA_WIDE_X": str(int(options.wide_x))}
    for key, value in {**options_env(options), **skinny}.items():
        monkeypatch.setenv(key, value)


def _check(harness, graph, test_id: str, what: str) -> None:
    harness.check_graph(graph, test_id, what=what)
    executable = harness.build(graph, what)   # the same program again: the runtime caches nothing here
    for name, r in executable.module.resources.items():
        assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, f"{what}: {name}: {r}"


_PLAN_OPTIONS = ("default",) + FALLBACKS + ("no-hoist", "no-stream")


@pytest.mark.parametrize("options", _PLAN_OPTIONS)
@pytest.mark.parametrize("name", case_names())
def test_benchmark_plan_through_ptx(name, options, monkeypatch, ptx_backend):
    _use(monkeypatch, options)
    _check(ptx_backend, plan_graph(name), f"ptx-plan:{name}:{options}",
           f"the searched plan of {name} through the PTX backend with options {options}")


#: what the autotuner picks for most benchmark cases (and the kernel benchmark's PTX contender then runs)
_TUNED_OPTIONS = {"threads-256-pipeline-2": CudaOptions(threads=256, stages=2),
                  "threads-256-pipeline-3": CudaOptions(threads=256, stages=3),
                  "skinny": CudaOptions(skinny=True), "skinny-threads-256": CudaOptions(skinny=True, threads=256),
                  "threads-256-overlap": CudaOptions(threads=256, overlap=True)}


@pytest.mark.parametrize("options", sorted(_TUNED_OPTIONS))
@pytest.mark.parametrize("name", case_names())
def test_benchmark_plan_through_ptx_at_the_tuned_block_size(name, options, monkeypatch, ptx_backend):
    _use(monkeypatch, options, _TUNED_OPTIONS)
    _check(ptx_backend, plan_graph(name), f"ptx-plan:{name}:{options}",
           f"the searched plan of {name} through the PTX backend with options {options}")


@pytest.mark.parametrize("overlap, stagger, lead, wide_x",
                         [(False, False, 2, False), (True, False, 2, False), (False, True, 2, False),
                          (True, True, 2, False), (True, True, 2, True), (True, False, 0, True)])
@pytest.mark.parametrize("name", sorted(tuned_skinny_plans()))
def test_tuned_skinny_plan_through_ptx(name, overlap, stagger, lead, wide_x, monkeypatch, ptx_backend):
    """The skinny loop (weights streamed into registers, mma.sync with W as the A operand) at the
    benchmark's sizes, as the autotuner picked it for the CUDA backend, launched to overlap the previous
    kernel (programmatic dependent launch), with staggered walks over K, and in steps of two slabs
    (wide_x) with the L2 lead of 2 or none, against float64."""
    graph, options = tuned_skinny_plans()[name]
    options = attrs.evolve(options, overlap=overlap, stagger=stagger, lead=lead, wide_x=wide_x)
    _use_options(monkeypatch, options)
    _check(ptx_backend, graph, f"ptx-skinny:{name}" + (":overlap" if overlap else "") +
           (":stagger" if stagger else "") + (f":lead {lead}" if lead != 2 else "") + (":wide_x" if wide_x else ""),
           f"the tuned skinny plan of {name} through the PTX backend with options {options}")


@pytest.mark.parametrize("options", _PLAN_OPTIONS)
@pytest.mark.parametrize("qknorm", [False, True], ids=["gqa", "qknorm"])
def test_split_attention_through_ptx(qknorm, options, monkeypatch, ptx_backend):
    """The split plans' structure at the simulator's sizes (tests/backend/ptx/plans.py), as the CPU
    tests run it, on the device: the row-resident chain, hoisting and the streamed combine."""
    _use(monkeypatch, options)
    graph = split_attention(qknorm)
    _check(ptx_backend, graph, f"ptx-split:{graph.name}:{options}", f"{graph.name} through the PTX backend with "
           f"options {options}")

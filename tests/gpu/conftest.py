"""GPU tests: marked `gpu`, skipped where there is no GPU (checked once, without touching the driver
where there is none), run cheapest and most basic first so that `-x` stops at the root cause."""
from __future__ import annotations

import os
import secrets

import pytest

from mdsl.gpu import BACKENDS, has_gpu

_ORDER = ("test_gpu_runtime", "test_gpu_ops", "test_gpu_coverage", "test_gpu_examples")
#: The modules whose programs are built by harness.build: each of their tests runs once per backend
#: (MDSL_GPU_BACKENDS=cuda or =ptx runs one of them).
_PER_BACKEND = ("test_gpu_ops", "test_gpu_coverage", "test_gpu_examples", "test_gpu_fast_paths",
                "test_gpu_regrouped")


def pytest_configure(config):
    # one seed for the whole run, pytest-xdist's workers included (they inherit the environment)
    os.environ.setdefault("MDSL_GPU_SEED", str(secrets.randbits(31)))


def pytest_report_header(config):
    from tests.gpu.harness import SEED

    return f"mdsl GPU tests: {'a GPU is present' if has_gpu() else 'no GPU, skipped'}; seed {SEED} (MDSL_GPU_SEED)"


def _backends() -> list:
    chosen = [b for b in os.environ.get("MDSL_GPU_BACKENDS", ",".join(BACKENDS)).split(",") if b]
    unknown = sorted(set(chosen) - set(BACKENDS))
    if unknown:
        raise pytest.UsageError(f"MDSL_GPU_BACKENDS names unknown backends {unknown}; known: {list(BACKENDS)}")
    return chosen


def pytest_generate_tests(metafunc):
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    if "gpu_backend" in metafunc.fixturenames and module in _PER_BACKEND:
        metafunc.parametrize("gpu_backend", _backends(), indirect=True)


@pytest.fixture(autouse=True)
def gpu_backend(request, monkeypatch):
    """The backend harness.build compiles with: each backend in turn where the test is parametrized."""
    from tests.gpu import harness

    backend = getattr(request, "param", "cuda")
    monkeypatch.setattr(harness, "BACKEND", backend)
    return backend


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="no NVIDIA GPU and driver on this machine")
    gpu = has_gpu()
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip)

    def rank(item) -> int:
        name = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        return _ORDER.index(name) if name in _ORDER else len(_ORDER)

    # reorder this directory's tests among the places they hold (a stable sort keeps each module's order)
    places = [k for k, item in enumerate(items) if rank(item) < len(_ORDER)]
    for k, item in zip(places, sorted((items[k] for k in places), key=rank)):
        items[k] = item


@pytest.fixture(autouse=True)
def _no_first_call_tuning(monkeypatch):
    """A kernel's first GPU call runs its plan's choice as lowered by default: the GPU tests check each plan's
    own lowering (tests/gpu/test_gpu_autotune.py tunes on purpose)."""
    monkeypatch.setenv("MDSL_AUTOTUNE", "0")

"""GPU tests: marked `gpu`, skipped where there is no GPU (checked once, without touching the driver
where there is none), run cheapest and most basic first so that `-x` stops at the root cause."""
from __future__ import annotations

import os
import secrets

import pytest

from mdsl.backend.cuda.runtime import has_gpu

_ORDER = ("test_gpu_runtime", "test_gpu_ops", "test_gpu_coverage", "test_gpu_examples")


def pytest_configure(config):
    # one seed for the whole run, pytest-xdist's workers included (they inherit the environment)
    os.environ.setdefault("MDSL_GPU_SEED", str(secrets.randbits(31)))


def pytest_report_header(config):
    from tests.gpu.harness import SEED

    return f"mdsl GPU tests: {'a GPU is present' if has_gpu() else 'no GPU, skipped'}; seed {SEED} (MDSL_GPU_SEED)"


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

"""A search's worker processes run their BLAS and OpenMP single-threaded (mdsl.search.worker.SINGLE_THREADED):
the search's parallelism is its pool of workers, and a thread pool per library in every worker makes them
spin against each other (two workers on two cores verified a gqa_bs8 candidate in 28-35 s each, against
6-8 s each with one thread). The process that runs the search keeps its own environment."""
from __future__ import annotations

import concurrent.futures as cf
import os

import pytest

from mdsl.search import worker


def _environment() -> dict:
    return {name: os.environ.get(name) for name in worker.SINGLE_THREADED}


@pytest.mark.timeout(120)
def test_workers_start_with_single_threaded_blas_and_the_searching_process_keeps_its_environment(monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "7")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    worker.end_server()   # (a server an earlier search started would do, but this checks the start too)
    worker.start_server()
    with cf.ProcessPoolExecutor(max_workers=1, mp_context=worker.context()) as pool:
        assert pool.submit(_environment).result() == worker.SINGLE_THREADED
    assert os.environ["OPENBLAS_NUM_THREADS"] == "7" and "MKL_NUM_THREADS" not in os.environ
    worker.end_server()

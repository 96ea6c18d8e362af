"""A search's worker processes run their BLAS and OpenMP single-threaded (mdsl.search.worker.SINGLE_THREADED):
the search's parallelism is its pool of workers, and a thread pool per library in every worker makes them
spin against each other (two workers on two cores verified a gqa_bs8 candidate in 28-35 s each, against
6-8 s each with one thread). The process that runs the search keeps its own environment."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: in a fresh interpreter (its own forkserver, started by the search's worker module): the environment a
#: worker sees, and the searching process's own afterwards
SCRIPT = """
import concurrent.futures as cf, json, os
from mdsl.search import worker

if __name__ == "__main__":
    worker.start_server()
    names = list(worker.SINGLE_THREADED)
    with cf.ProcessPoolExecutor(max_workers=1, mp_context=worker.context()) as pool:
        # (os.getenv: a worker starts without this script's module, so the call names an importable function)
        seen = dict(zip(names, pool.map(os.getenv, names)))
    print(json.dumps({"worker": seen, "own": {name: os.getenv(name) for name in names}}))
"""


@pytest.mark.timeout(120)
def test_workers_start_with_single_threaded_blas_and_the_searching_process_keeps_its_environment(tmp_path):
    from mdsl.search import worker

    script = tmp_path / "workers.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in worker.SINGLE_THREADED}
    env["OPENBLAS_NUM_THREADS"] = "7"
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["worker"] == worker.SINGLE_THREADED
    assert seen["own"] == {name: "7" if name == "OPENBLAS_NUM_THREADS" else None for name in worker.SINGLE_THREADED}

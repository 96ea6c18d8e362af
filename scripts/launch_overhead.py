"""Host launch overhead of mdsl's GPU runtime: the time per call of each path a user can take, beside
the raw driver launch it is built on and torch's own launch, for a tiny element-wise kernel (its GPU
time is a couple of microseconds, so the host side is what gets measured).

Run on a GPU machine from the repository root: `PYTHONPATH=. python3 scripts/launch_overhead.py [calls]`.
Nothing is asserted: the numbers are for reading.
"""
from __future__ import annotations

import statistics
import sys
import time
import warnings

N = 4096   # elements: 16 KB per vector, a few microseconds of GPU time


def _time_per_call(fn, calls: int, repeats: int, sync) -> float:
    """Median over `repeats` of the host time of `calls` calls, in microseconds per call."""
    for _ in range(min(calls, 200)):   # warm up: caches, allocator pools, lazy loading
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return statistics.median(samples)


def _cases():
    """(label, function) for every path, the floor first."""
    try:
        import torch
    except ImportError:
        torch = None
    import numpy as np

    import mdsl
    from mdsl import Tensor, f32
    from mdsl.backend.cuda import runtime
    from mdsl.backend.cuda.runtime import DeviceArray, Executable
    from tests.gpu import handwritten

    program = handwritten.axpy(N)
    exe = Executable(program, runtime.compile_source(program.source, runtime.target_arch()))
    rng = np.random.default_rng()
    x, y, z = (DeviceArray.from_numpy(rng.standard_normal(N).astype(np.float32)) for _ in range(3))
    ins, outs = [x.ptr, y.ptr], [z.ptr]
    exe.run_pointers(ins, outs)   # binds x, y, z into the parameter block that the floor case launches with
    launch = runtime.driver.cuLaunchKernel
    # exactly what the executable launches (config: the overlapping launch's, None for a plain launch)
    function, gx, gy, gz, bx, by, bz, smem, params, config = exe._launches[0]
    assert config is None, "the handwritten kernel is launched plainly"
    stream = runtime._cu_stream(0)
    cases = [
        ("cuLaunchKernel with its arguments prepared (the floor)",
         lambda: launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, 0)),
        ("Executable.run_pointers (unchecked)", lambda: exe.run_pointers(ins, outs)),
        ("Executable([DeviceArray x2], [out])", lambda: exe([x, y], [z])),
        ("Executable([DeviceArray x2]), output allocated", lambda: exe([x, y])),
    ]
    if torch is None:
        return cases, lambda: runtime.driver.cuCtxSynchronize()
    tx, ty, tz = (torch.randn(N, device="cuda") for _ in range(3))

    @mdsl.kernel
    def axpy(a: Tensor[N, f32], b: Tensor[N, f32]):
        return a * 2.0 + b

    with warnings.catch_warnings():   # where the search cannot run, the first call says so once
        warnings.simplefilter("ignore")
        axpy(tx, ty)
    cases += [
        ("Executable([torch x2], [out])", lambda: exe([tx, ty], [tz])),
        ("Executable([torch x2]), output allocated", lambda: exe([tx, ty])),
        ("@mdsl.kernel(torch x2, out=...), compiled", lambda: axpy(tx, ty, out=tz)),
        ("@mdsl.kernel(torch x2), compiled, output allocated", lambda: axpy(tx, ty)),
        ("torch.add(x, y, alpha=2, out=z) (for comparison)", lambda: torch.add(ty, tx, alpha=2, out=tz)),
    ]
    return cases, torch.cuda.synchronize


def measure(calls: int = 20000, repeats: int = 5) -> list:
    """[(label, microseconds per call)] for each path."""
    cases, sync = _cases()
    return [(label, _time_per_call(fn, calls, repeats, sync)) for label, fn in cases]


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    rows = measure(calls)
    print(f"host time per call, median of 5 runs of {calls} calls, f32[{N}] axpy (one kernel):")
    for label, micros in rows:
        print(f"  {micros:8.2f} us  {label}")


if __name__ == "__main__":
    main()

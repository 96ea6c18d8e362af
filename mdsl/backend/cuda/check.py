"""Run a plan on the GPU once: compile it, check it against the float64 reference interpreter on fresh
random inputs, and time it next to PyTorch eager (when torch is installed). `mdsl optimize` prints this
under each plan on a machine with a GPU."""
from __future__ import annotations

import attrs
import numpy as np

from mdsl.backend.reference import run_kernel_graph
from mdsl.ir.dtypes import bf16, f16, round_to_dtype

#: ||out - ref|| / ||ref|| bounds, by the loosest dtype of the graph's tensors
_TOLERANCE = {f16.name: 3e-3, bf16.name: 1e-2}
_F32_TOLERANCE = 1e-3  # matmuls may run in tf32


@attrs.frozen
class GpuReport:
    device: str
    rel_error: float
    bound: float
    mdsl_us: float
    torch_us: float = float("nan")   # NaN: torch not installed, or the program has no torch form

    @property
    def ok(self) -> bool:
        return bool(self.rel_error <= self.bound)

    def lines(self) -> list:
        verdict = "ok" if self.ok else "FAILED"
        out = [f"# gpu:      {self.device}: relative error {self.rel_error:.2e} against the float64 reference "
               f"(bound {self.bound:.0e}): {verdict}"]
        timing = f"# time:     mdsl {self.mdsl_us:.1f} us per call"
        if self.torch_us == self.torch_us:
            # a plan that launches nothing (it returns its inputs) takes no time: no ratio then
            ratio = f" ({self.torch_us / self.mdsl_us:.2f}x)" if self.mdsl_us > 0 else ""
            timing += f"; the original program op by op in PyTorch {self.torch_us:.1f} us{ratio}"
        return out + [timing + " (mean of back-to-back calls between CUDA events, after warm-up; "
                               "benchmarks/kernels.py is the careful comparison)"]


def _ok(result):
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def _time_us(call, reps: int) -> float:
    """Mean time of `call` over `reps` back-to-back calls on the default stream, by CUDA events."""
    from cuda.bindings import driver

    for _ in range(max(3, reps // 10)):
        call()
    start, end = _ok(driver.cuEventCreate(0)), _ok(driver.cuEventCreate(0))
    try:
        _ok(driver.cuEventRecord(start, 0))
        for _ in range(reps):
            call()
        _ok(driver.cuEventRecord(end, 0))
        _ok(driver.cuEventSynchronize(end))
        return _ok(driver.cuEventElapsedTime(start, end)) * 1e3 / reps
    finally:
        driver.cuEventDestroy(start)
        driver.cuEventDestroy(end)


def _torch_us(graph, host: list, reps: int) -> float:
    try:
        import torch
    except ImportError:
        return float("nan")
    from mdsl.backend import torch_eager

    if not torch_eager.supports(graph) or not torch.cuda.is_available():
        return float("nan")
    names = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
    tensors = [torch.tensor(x, dtype=names[v.dtype.name], device="cuda") for x, v in zip(host, graph.inputs)]
    program = torch_eager.torch_program(graph)
    with torch.cuda.stream(torch.cuda.default_stream()):  # the legacy default stream, as mdsl's launches
        return _time_us(lambda: program(*tensors), reps)


def run_plan(plan, *, seed: int = 0, reps: int = 200, backend: str = "cuda") -> GpuReport:
    """Compile (with `backend`: "cuda" or "ptx") and run `plan.graph` on GPU 0 (callers check
    `runtime.has_gpu()` first)."""
    from mdsl.backend.cuda import runtime

    graph = plan.graph
    rng = np.random.default_rng(seed)
    host = [round_to_dtype(rng.standard_normal(v.shape), v.dtype) for v in graph.inputs]
    executable = runtime.compile_graph(graph, backend=backend)
    inputs = [runtime.DeviceArray.from_numpy(x, v.dtype) for x, v in zip(host, graph.inputs)]
    outputs = executable(inputs)
    got = [np.asarray(o.to_numpy(), dtype=np.float64) for o in outputs]
    want = run_kernel_graph(plan.original, host, precision="float64")
    error = max(float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-300)) if np.all(np.isfinite(g)) else np.inf
                for g, w in zip(got, want))
    dtypes = {v.dtype.name for v in graph.inputs} | {v.dtype.name for v in graph.outputs}
    bound = max((_TOLERANCE.get(d, _F32_TOLERANCE) for d in dtypes), default=_F32_TOLERANCE)
    mdsl_us = _time_us(lambda: executable(inputs, outputs), reps)
    return GpuReport(_device_name(), error, bound, mdsl_us, _torch_us(plan.original, host, reps))


def _device_name() -> str:
    from cuda.bindings import driver

    raw = _ok(driver.cuDeviceGetName(64, _ok(driver.cuDeviceGet(0))))
    return raw.split(b"\0", 1)[0].decode(errors="replace")

"""Host time of an mdsl kernel called as a user calls it, `k(*torch_cuda_tensors)`, against the launch the
kernel benchmark times and the kernel's own GPU time; and the public path's host overhead, which issue 31
asks to be <= 5 µs.

    python benchmarks/call_overhead.py [--cases rms_norm_linear_bs1,...] [--calls 200] [--samples 40]
                                       [--sets 8] [--budget 30] [--out DIR]

For each case (CASES: small kernels, where the host side of a call matters most):
* public: `k(*tensors)` back to back, the outputs allocated by the call (torch tensors); the same call on
  --sets input sets in turn (public_sets: how benchmarks/random_programs.py calls a program, its inputs rotated
  past the L2; an executable with cuBLAS GEMMs keeps a graph for each set of pointers that repeats); and
  `k(*tensors, out=out)`. A case's opening call searches a plan (--budget seconds at most; the plan cache answers
  later runs), compiles and checks; the calls timed are the repeated ones, with the same signature.
* launcher: how the executable launches: "c" (mdsl's C launcher, mdsl.gpu.launcher: every kernel in one call)
  or "cuda.bindings" (where the launcher cannot be built); with "c", public_bindings is the public path with
  the executable made to launch through cuda.bindings instead, for comparison. "c, graph": the launcher
  launches the kernels as one CUDA graph (a program of two or more kernels without a cuBLAS GEMM), and
  public_kernels is the public path with the graph set aside (each kernel launched), for comparison; the
  launch floor stays the kernels launched one by one, so such a case's overhead can come out below zero.
* unchecked: `Executable.run_pointers` on the same executable, the launch benchmarks/kernels.py times as
  its mdsl contender (no argument checks, no allocation).
* launch floor: host time of as many empty kernels as the case launches, launched the way the executable
  launches (one call of the C launcher running them all, or one cuda.bindings cuLaunchKernel each): what
  the driver's launches cost by themselves.
* overhead: public minus the launch floor (and overhead_out: public out= minus the launch floor). This is the
  public path's host overhead: what a call costs the host beyond the driver's launches it needs (reading
  and checking the arguments' signature, the stream and the data pointers, allocating the outputs, calling
  the launcher). The GPU time is not in it: the host never waits for the GPU while a batch is timed (see
  Method). The target is <= 5 µs (TARGET_US).
* GPU: the kernel alone: a CUDA graph of --graph-calls unchecked launches replayed between two CUDA events,
  divided by the launches (no host time in it).
And once per run, the floors a call is built on: an empty kernel launched through cuda.bindings as mdsl
launches its kernels without the C launcher (runtime.EmptyKernel), the same launch through the C launcher,
through ctypes straight into libcuda, and torch.empty / torch.empty_like of a small tensor.

Method: host time is time.perf_counter around a batch of --calls back-to-back calls, synchronized after
the batch and outside the timed part; a batch is short enough that the launch queue never fills, so the
host never waits for the GPU. Reported: the median over --samples batches (and the 10th percentile), in
µs per call. Nothing is asserted.

Writes call_overhead.json (every number and the environment) and call_overhead.md (the table) under
--out (default $OUT, else ./bench_out); prints the table. Needs a GPU, torch and cuda.bindings.
"""
from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # run as a script from anywhere, with or without mdsl installed
    sys.path.insert(0, str(ROOT))

from benchmarks.provenance import provenance  # noqa: E402 - needs ROOT on sys.path

SCHEMA = 2   # 2: the launcher, the launch floor and the overhead per case; the C launcher's floor
TARGET_US = 5.0   # the public path's host overhead per call that issue 31 asks for (see `overhead`)


def _cases() -> dict:
    """Case name -> (kernel, [(shape, torch dtype name)] per argument)."""
    import mdsl
    from mdsl import Tensor, f16, f32

    @mdsl.kernel
    def rms_norm_linear_bs1(x: Tensor[1, 4096, f16], w: Tensor[4096, 4096, f16]):
        return mdsl.rms_norm(x) @ w

    @mdsl.kernel
    def silu_mul_add_bs8(x: Tensor[8, 4096, f16], y: Tensor[8, 4096, f16]):
        return mdsl.silu(x) * y + x

    @mdsl.kernel
    def axpy_f32(a: Tensor[4096, f32], b: Tensor[4096, f32]):
        return a * 2.0 + b

    @mdsl.kernel
    def mlp_block_bs8(x: Tensor[8, 2048, f16], wg: Tensor[2048, 2816, f16], wu: Tensor[2048, 2816, f16],
                      wd: Tensor[2816, 2048, f16]):
        h = mdsl.rms_norm(x)
        return (mdsl.silu(h @ wg) * (h @ wu)) @ wd + x

    # two programs of benchmarks/random_programs.py's seed 97 (programs 28 and 24), two outputs each: one kernel
    # of mdsl's own, and a cuBLAS GEMM beside mdsl's kernels (the executable's graphs for repeated pointers)
    @mdsl.kernel
    def matmul_two_activations_bs2(x: Tensor[2, 2048, f16], w: Tensor[2048, 1024, f16], g: Tensor[2, 1024, f16]):
        v = x @ w
        return mdsl.silu(v), mdsl.gelu(v - g)

    @mdsl.kernel
    def exp_linear_bs4(x: Tensor[4, 4096, f16], w: Tensor[4096, 1024, f16]):
        s = mdsl.silu(x)
        e = mdsl.exp(s)
        return e @ w, e - s

    kernels = (rms_norm_linear_bs1, silu_mul_add_bs8, axpy_f32, mlp_block_bs8, matmul_two_activations_bs2,
               exp_linear_bs4)
    return {k.name: (k, [(tuple(v.type.shape), v.type.dtype.long_name) for v in k.graph.inputs]) for k in kernels}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per timed batch")
    p.add_argument("--samples", type=int, default=40, help="timed batches per measurement")
    p.add_argument("--graph-calls", type=int, default=20, help="launches per CUDA graph for the GPU time")
    p.add_argument("--sets", type=int, default=8, help="input sets the rotated public calls take in turn")
    p.add_argument("--budget", type=float, default=30.0, help="search budget (s) of a case's opening call")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench_out"),
                   help="output directory (default: $OUT when set, else ./bench_out)")
    return p.parse_args(argv)


def host_time(fn: Callable, calls: int, samples: int, sync: Callable) -> dict:
    """µs per call of `fn` back to back: median and 10th percentile over `samples` batches of `calls`."""
    for _ in range(calls):   # warm-up: caches, the allocator's pool, lazy loading
        fn()
    sync()
    per_call = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    per_call.sort()
    return {"median_us": statistics.median(per_call), "p10_us": per_call[len(per_call) // 10], "samples": samples,
            "calls": calls}


def gpu_time(torch, launch: Callable, launches: int, replays: int = 50) -> dict:
    """µs per launch of `launch` on the GPU alone: a CUDA graph of `launches` of it, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up off the capture, as torch.cuda.graph asks
        for _ in range(3):
            launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    times.sort()
    return {"median_us": statistics.median(times), "p10_us": times[len(times) // 10], "replays": replays,
            "launches": launches}


def _ctypes_launcher(empty) -> Callable:
    """The empty kernel's launch on the legacy default stream through ctypes straight into libcuda (no
    cuda.bindings in between)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int
    function = int(empty._function)
    return lambda: fn(function, 1, 1, 1, 32, 1, 1, 0, None, None, None)


def floors(args, torch, runtime) -> dict:
    """Host µs per call of what a call is built on."""
    sync = torch.cuda.synchronize
    out = {}
    empty = runtime.EmptyKernel()
    try:
        out["empty_launch_cuda_bindings"] = host_time(lambda: empty(0), args.calls, args.samples, sync)
        native = empty.native(1)
        out["empty_launch_mdsl_c"] = host_time(lambda: native(0), args.calls, args.samples, sync) if native else \
            {"error": "mdsl's C launcher is not available here"}
        try:
            launch = _ctypes_launcher(empty)
            if launch():
                raise RuntimeError("cuLaunchKernel through ctypes returned an error")
            out["empty_launch_ctypes"] = host_time(launch, args.calls, args.samples, sync)
        except Exception as e:   # informative only: the run goes on
            out["empty_launch_ctypes"] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        sync()
        empty.close()
    device = torch.device("cuda", torch.cuda.current_device())
    out["torch_empty"] = host_time(lambda: torch.empty((8, 4096), dtype=torch.float16, device=device),
                                   args.calls, args.samples, sync)
    like = torch.empty((8, 4096), dtype=torch.float16, device=device)
    out["torch_empty_like"] = host_time(lambda: torch.empty_like(like), args.calls, args.samples, sync)
    return out


def launch_floor(args, torch, runtime, exe) -> dict:
    """Host µs per call of as many empty kernels as `exe` launches, launched as `exe` launches them."""
    launches = len(exe.program.launches)
    empty = runtime.EmptyKernel(exe.device)
    try:
        native = empty.native(launches) if exe.native is not None else None
        if native is not None:
            return host_time(lambda: native(0), args.calls, args.samples, torch.cuda.synchronize)

        def bindings():
            for _ in range(launches):
                empty(0)

        return host_time(bindings, args.calls, args.samples, torch.cuda.synchronize)
    finally:
        torch.cuda.synchronize()
        empty.close()


def overhead(public: Optional[dict], floor: Optional[dict]) -> Optional[float]:
    """The public path's host overhead, µs per call: its median host time minus the launch floor's."""
    if not public or not floor or "error" in public or "error" in floor:
        return None
    return public["median_us"] - floor["median_us"]


def measure_case(args, torch, kernel, specs: list) -> dict:
    import attrs

    from mdsl.backend.cuda import runtime

    sync = torch.cuda.synchronize
    optimize = type(kernel).optimize

    def bounded(*arrays, config):   # the opening call's search, within --budget
        return optimize(kernel, *arrays, config=attrs.evolve(config, budget_s=args.budget))

    kernel.optimize = bounded
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    sets = [[torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(getattr(torch, dtype))
             for shape, dtype in specs] for _ in range(max(1, args.sets))]
    tensors = sets[0]
    rec: dict = {"inputs": [[list(shape), dtype] for shape, dtype in specs]}
    start = time.perf_counter()
    with warnings.catch_warnings():   # where the search cannot run, the opening call says so once
        warnings.simplefilter("ignore")
        first = kernel(*tensors)
    sync()
    rec["first_call_s"] = time.perf_counter() - start
    (exe,) = kernel._executables.values()
    rec["launches"] = len(exe.program.launches)
    rec["launcher"] = "c" if exe.native is not None else "cuda.bindings"
    graph = exe.native.graph if exe.native is not None else None
    rec["graph"] = graph is not None
    outputs = tuple(torch.empty_like(f) for f in (first if isinstance(first, tuple) else (first,)))
    out = outputs if len(outputs) > 1 else outputs[0]   # out= as the call takes it
    rec["outputs"] = len(outputs)
    rec["public"] = host_time(lambda: kernel(*tensors), args.calls, args.samples, sync)
    turn = itertools.cycle(sets)   # the input sets in turn, as benchmarks/random_programs.py calls a program
    rec["public_sets"] = host_time(lambda: kernel(*next(turn)), args.calls, args.samples, sync)
    # a program with cuBLAS GEMMs: the graphs captured for its repeated pointers (Executable._graph_for)
    rec["graphs_by_pointers"] = len(exe._by_pointers or ())
    if graph is not None:   # the same calls with the kernels launched one by one
        nodes = exe.native.graph_nodes
        exe.native.use_graph(None, ())
        try:
            rec["public_kernels"] = host_time(lambda: kernel(*tensors), args.calls, args.samples, sync)
        finally:
            exe.native.use_graph(graph, nodes)
    rec["public_out"] = host_time(lambda: kernel(*tensors, out=out), args.calls, args.samples, sync)
    if exe.native is not None:   # the same calls through cuda.bindings: prepared again without the launcher
        native, exe.native = exe.native, None
        try:
            kernel._calls.clear()
            kernel._last_call = None
            kernel(*tensors)
            rec["public_bindings"] = host_time(lambda: kernel(*tensors), args.calls, args.samples, sync)
        finally:
            exe.native = native
            kernel._calls.clear()
            kernel._last_call = None
            kernel(*tensors)
    rec["launch_floor"] = launch_floor(args, torch, runtime, exe)
    rec["overhead_us"] = overhead(rec["public"], rec["launch_floor"])
    rec["overhead_out_us"] = overhead(rec["public_out"], rec["launch_floor"])
    ins, outs = [t.data_ptr() for t in tensors], [o.data_ptr() for o in outputs]
    stream = torch.cuda.current_stream().cuda_stream
    rec["unchecked"] = host_time(lambda: exe.run_pointers(ins, outs, stream), args.calls, args.samples, sync)
    rec["gpu"] = gpu_time(torch, lambda: exe.run_pointers(ins, outs, torch.cuda.current_stream().cuda_stream),
                          args.graph_calls)
    # the timed paths compute the same thing (a library GEMM captured in a CUDA graph may take another of
    # cuBLAS's kernels, whose sums round differently)
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if exe.library_launches else {}
    torch.testing.assert_close(kernel(*tensors), out, **tolerance)
    return rec


def _us(entry: Optional[dict]) -> str:
    if not entry:
        return "—"
    if "error" in entry:
        return "error"
    return f"{entry['median_us']:.2f}"


def _overhead(value: Optional[float]) -> str:
    if value is None:
        return "—"
    return f"**{value:.2f}**" + ("" if value <= TARGET_US else " (over)")


def render_markdown(results: dict) -> str:
    meta = results["meta"]
    gpu = (meta.get("gpu") or {}).get("name") or "?"
    lines = [f"# Host time per call (µs, median of {meta['samples']} batches of {meta['calls']} calls)", "",
             f"{gpu}, torch {meta.get('torch', '?')}, mdsl {meta.get('mdsl_commit') or '?'}. Host overhead: the "
             f"public call's host time minus the launch floor (as many empty kernels launched the same way); "
             f"target <= {TARGET_US:g} µs.", "",
             "| case | launches | launcher | public `k(*x)` | public `out=` | public, input sets in turn | "
             "public, kernels one by one | public, cuda.bindings | unchecked `run_pointers` | launch floor | "
             "host overhead | overhead, `out=` | GPU (kernel alone) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rec in results["cases"].items():
        if "error" in rec:
            lines.append(f"| {name} | failed: {rec['error']} | | | | | | | | | | | |")
            continue
        launcher = rec.get("launcher", "?") + (", graph" if rec.get("graph") else "")
        lines.append(f"| {name} | {rec['launches']} | {launcher} | {_us(rec['public'])} | "
                     f"{_us(rec['public_out'])} | {_us(rec.get('public_sets'))} | {_us(rec.get('public_kernels'))} | "
                     f"{_us(rec.get('public_bindings'))} | {_us(rec['unchecked'])} | "
                     f"{_us(rec.get('launch_floor'))} | {_overhead(rec.get('overhead_us'))} | "
                     f"{_overhead(rec.get('overhead_out_us'))} | {_us(rec['gpu'])} |")
    fl = results.get("floors") or {}
    lines += ["", "| floor | host µs per call |", "|---|---:|",
              f"| empty kernel, cuLaunchKernel through cuda.bindings | {_us(fl.get('empty_launch_cuda_bindings'))} |",
              f"| empty kernel, through mdsl's C launcher | {_us(fl.get('empty_launch_mdsl_c'))} |",
              f"| empty kernel, cuLaunchKernel through ctypes | {_us(fl.get('empty_launch_ctypes'))} |",
              f"| torch.empty((8, 4096), f16) | {_us(fl.get('torch_empty'))} |",
              f"| torch.empty_like(an (8, 4096) f16 tensor) | {_us(fl.get('torch_empty_like'))} |"]
    return "\n".join(lines) + "\n"


def write_outputs(results: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "call_overhead.json", "md": out / "call_overhead.md"}
    paths["json"].write_text(json.dumps(results, indent=1))
    paths["md"].write_text(render_markdown(results))
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("the call overhead benchmark needs torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("torch sees no CUDA GPU: the call overhead benchmark needs one", file=sys.stderr)
        return 2
    from mdsl.backend.cuda import runtime

    runtime.require_gpu("the call overhead benchmark")
    cases = _cases()
    names = [n for n in args.cases.split(",") if n] or list(cases)
    unknown = sorted(set(names) - set(cases))
    if unknown:
        print(f"unknown case(s) {unknown}; known: {', '.join(cases)}", file=sys.stderr)
        return 2
    meta = provenance("call_overhead.py", sys.argv[1:] if argv is None else list(argv), gpu=True)
    meta.update(torch=torch.__version__, calls=args.calls, samples=args.samples, graph_calls=args.graph_calls,
                budget_s=args.budget)
    results = {"schema": SCHEMA, "meta": meta, "cases": {}, "floors": {}}
    try:
        results["floors"] = floors(args, torch, runtime)
        for name in names:
            print(f"== {name}", flush=True)
            kernel, specs = cases[name]
            try:
                results["cases"][name] = measure_case(args, torch, kernel, specs)
            except Exception as e:   # the other cases are still worth measuring
                results["cases"][name] = {"error": f"{type(e).__name__}: {e}"}
            write_outputs(results, args.out)
    finally:   # whatever happened, what is done is written
        paths = write_outputs(results, args.out)
        print(f"written: {', '.join(str(p) for p in paths.values())}\n")
        print(render_markdown(results), flush=True)
    return 0 if all("error" not in rec for rec in results["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

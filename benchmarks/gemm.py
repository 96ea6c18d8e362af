"""Plain matmuls as mdsl runs them when a plan leaves them unfused, against torch.matmul, at LLM shapes.

    python benchmarks/gemm.py [--dtype bf16] [--rows 1,16,64] [--sizes 4096,8192 | --shapes 4096:6144,...]
                              [--public] [--out DIR]

For each shape [M, K] @ [K, N] (M in --rows; K and N each in --sizes, or the K:N pairs of --shapes) the
contenders are:
* `cublas`: the single-matmul program compiled by the runtime (`compile_graph`), whose launch is a library
  GEMM (mdsl.gpu.cublas), called as an Executable on torch tensors (arguments checked, host time included);
* `kernel`: the same program with MDSL_CUDA_CUBLAS's option off: mdsl's own GEMM kernel;
* `public` (--public): `kernel(x, w)` through `@mdsl.kernel`, the plan from the search (which may fuse the
  product into a custom kernel; the row says which);
* `wgmma` (bf16 and f16 on compute capability 9.0): the Hopper GEMM (mdsl.backend.cuda.hopper_gemm: wgmma and
  TMA), `hopper_gemm(x, w_t)` on the weight as checkpoints store it, [N, K] (each set's w transposed once,
  before timing);
* `wgmma_ptx`: the same kernel from the PTX backend (mdsl.backend.ptx.hopper_gemm: LLVM IR through llvmlite's
  NVPTX target), its `hopper_gemm(x, w_t)`;
* `torch`: torch.matmul.

The issue's shapes, Qwen3-8B's linear layers at M = 1024:
`--rows 1024 --shapes 4096:6144,4096:4096,4096:24576,12288:4096`.

Method (as benchmarks/random_programs.py's `measure_on_gpu`): random inputs in sets that together exceed
twice the L2, every call taking the next set; each contender's output on the first set checked against
float64 (relative error within the verifier's bound for the dtype, `mdsl.passes.verify.FLOAT_BOUNDS`), a
contender that fails reported and not timed; then warm-up, `--reps` samples of `--batch` back-to-back
calls between two CUDA events, the median reported in microseconds per call. Writes gemm.json (with
`provenance.py`'s meta) and gemm.md under --out (default $OUT, else ./bench_out) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # run as a script from anywhere, with or without mdsl installed
    sys.path.insert(0, str(ROOT))

from benchmarks.provenance import provenance  # noqa: E402 - needs ROOT on sys.path

CONTENDERS = ("cublas", "kernel", "public", "wgmma", "wgmma_ptx", "torch")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=("f16", "bf16", "f32"))
    parser.add_argument("--rows", default="1,16,64", help="the M of each shape, comma-separated")
    parser.add_argument("--sizes", default="4096,8192", help="the K and N of each shape, comma-separated")
    parser.add_argument("--shapes", default="", help="K:N pairs, comma-separated (instead of every K and N of --sizes)")
    parser.add_argument("--public", action="store_true", help="also time @mdsl.kernel's call (searches each plan)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--out", help="where the JSON and Markdown go (default $OUT, else ./bench_out)")
    args = parser.parse_args(argv)
    args.rows, args.sizes = _ints(args.rows), _ints(args.sizes)
    args.shapes = [tuple(int(v) for v in pair.split(":")) for pair in args.shapes.split(",") if pair.strip()]
    if any(len(pair) != 2 for pair in args.shapes):
        parser.error("--shapes takes K:N pairs, e.g. 4096:6144,12288:4096")
    return args


def _ints(text: str) -> list:
    return [int(part) for part in text.split(",") if part.strip()]


def shapes(rows: Sequence[int], sizes: Sequence[int], pairs: Sequence[tuple] = ()) -> list:
    """(M, K, N) for every M in `rows` and every (K, N) of `pairs`, or every K and N in `sizes` without pairs."""
    pairs = pairs or [(k, n) for k in sizes for n in sizes]
    return [(m, k, n) for m in rows for k, n in pairs]


def _us(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.1f}"


def markdown(meta: dict, rows: list) -> str:
    head = (f"# Plain matmuls: mdsl (cuBLAS, its own kernels) against torch.matmul, {meta.get('dtype')}\n\n"
            f"µs per call, host time included (median of {meta.get('reps')} samples of {meta.get('batch')} "
            "calls); speed-up = torch / cublas; wgmma / torch = torch's time over wgmma's (the share of torch's "
            "throughput the Hopper GEMM reaches).\n\n"
            "| M | K | N | cublas | kernel | public | wgmma | wgmma ptx | torch | speed-up | wgmma / torch | notes |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        speedup = f"{r['torch_us'] / r['cublas_us']:.2f}×" if r.get("torch_us") and r.get("cublas_us") else "—"
        share = f"{r['torch_us'] / r['wgmma_us']:.2f}×" if r.get("torch_us") and r.get("wgmma_us") else "—"
        notes = [f"{c}: {r[c + '_error']}" for c in CONTENDERS if r.get(c + "_error")]
        if not r.get("cublas_library", True):
            notes.append("cublas: cuBLAS did not load (mdsl's kernel ran)")
        if r.get("public_plan"):
            notes.append(f"public plan: {r['public_plan']}")
        if r.get("wgmma_tile"):
            notes.append(f"wgmma tile {r['wgmma_tile']}")
        notes = "; ".join(notes)
        lines.append(f"| {r['m']} | {r['k']} | {r['n']} | " + " | ".join(_us(r.get(f"{c}_us")) for c in CONTENDERS)
                     + f" | {speedup} | {share} | {notes} |")
    return head + "\n".join(lines) + "\n"


def measure(m: int, k: int, n: int, args: argparse.Namespace) -> dict:
    import torch

    import mdsl
    from mdsl.backend.cuda import runtime
    from mdsl.frontend.tensor import TensorSpec
    from mdsl.ir.dtypes import dtype_from_name
    from mdsl.lowering.options import CudaOptions
    from mdsl.passes.verify import FLOAT_BOUNDS

    dtype = dtype_from_name(args.dtype)
    tdtype = getattr(torch, dtype.long_name)

    @mdsl.kernel
    def mm(x, w):
        return x @ w

    per_call = (m * k + k * n + m * n) * dtype.itemsize
    sets = max(2, min(64, math.ceil(2 * runtime.l2_bytes() / per_call)))
    generator = torch.Generator(device="cuda").manual_seed(m * 1_000_003 + k * 1009 + n)
    inputs = [(torch.randn(m, k, device="cuda", generator=generator).to(tdtype),
               torch.randn(k, n, device="cuda", generator=generator).to(tdtype)) for _ in range(sets)]
    want = inputs[0][0].double() @ inputs[0][1].double()

    graph = mm.trace(TensorSpec((m, k), dtype), TensorSpec((k, n), dtype))
    cublas = runtime.compile_graph(graph)
    kernel = runtime.compile_graph(graph, options=CudaOptions(library_gemm=False))
    row: dict = {"m": m, "k": k, "n": n, "cublas_library": bool(cublas.library_launches)}
    contenders = {"cublas": lambda x, w: cublas([x, w])[0], "kernel": lambda x, w: kernel([x, w])[0]}
    why_not = _wgmma_missing(torch, dtype)
    if why_not:
        row["wgmma_error"] = row["wgmma_ptx_error"] = why_not
    else:
        from mdsl.backend.ptx.hopper_gemm import hopper_gemm as ptx_hopper_gemm
        from mdsl.gpu import hopper_gemm

        transposed = {id(w): w.t().contiguous() for _, w in inputs}   # [N, K], as checkpoints store weights
        contenders["wgmma"] = lambda x, w: runtime.hopper_gemm(x, transposed[id(w)])
        contenders["wgmma_ptx"] = lambda x, w: ptx_hopper_gemm(x, transposed[id(w)])
        row["wgmma_tile"] = f"{hopper_gemm.BM}x{hopper_gemm.tile_n(m, n, hopper_gemm._sms(0))}"
    contenders["torch"] = torch.matmul
    if args.public:
        plan = mm.optimize(TensorSpec((m, k), dtype), TensorSpec((k, n), dtype),
                           config=_search_config(runtime.target_arch()))
        row["public_plan"] = ", ".join(node.op for node in plan.graph.nodes)
        contenders["public"] = mm

    def problem(fn) -> Optional[str]:
        got = fn(*inputs[0]).double()
        error = float(torch.linalg.norm(got - want) / torch.linalg.norm(want))
        if not bool(torch.isfinite(got).all()) or error > FLOAT_BOUNDS[dtype.name]:
            return f"relative error {error:.2e} over {FLOAT_BOUNDS[dtype.name]:.0e}"
        return None

    def timed(fn) -> float:
        for x, w in inputs:
            fn(x, w)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples, j = [], 0
        for _ in range(args.reps):
            start.record()
            for _ in range(args.batch):
                fn(*inputs[j % sets])
                j += 1
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) * 1e3 / args.batch)
        return statistics.median(samples)

    with torch.no_grad():
        for name, fn in contenders.items():
            why = problem(fn)
            row[f"{name}_us"] = None if why else timed(fn)
            if why:
                row[f"{name}_error"] = why
    return row


def _wgmma_missing(torch, dtype) -> Optional[str]:
    """Why the Hopper GEMM does not run here, or None."""
    if dtype.name not in ("bf16", "f16"):
        return f"no {dtype.name} operands (bf16 or f16)"
    if torch.cuda.get_device_capability() != (9, 0):
        return "needs compute capability 9.0"
    return None


def _search_config(arch: str):
    from mdsl.search.config import SearchConfig

    return SearchConfig(arch=arch)   # the call path's own config, so that `mm(x, w)` finds this plan cached


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    meta = provenance("gemm.py", sys.argv[1:] if argv is None else list(argv), gpu=True)
    meta.update(dtype=args.dtype, reps=args.reps, batch=args.batch)
    rows = []
    for m, k, n in shapes(args.rows, args.sizes, args.shapes):
        rows.append(measure(m, k, n, args))
        print(json.dumps(rows[-1]), flush=True)
    (out / "gemm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(meta, rows)
    (out / "gemm.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU serving device's linears at the benchmark models' shapes, on their own (mdsl.serving.gpu_wgmma: wgmma
and TMA on an H200): µs per launch of each linear of a layer (qkv, o + residual, gate|up, down + residual) and
of the LM head, at decode and prefill row counts, against the floor (bytes over 4.25 TB/s or flops over 750
TFLOP/s) and torch's bf16 linear (cuBLAS) over the same rows. Each launch's output is checked against float64
first. Weights are rotated over copies past twice the L2, as a decode step finds them: in memory. Each
contender's launches are replayed from a CUDA graph, as the serving device's steps are.

    python3 benchmarks/serve_linears.py [--models qwen3-8b] [--rows 1,8,32,64,256] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:   # run as a script from anywhere, with or without mdsl installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import provenance, write_outputs   # noqa: E402

BANDWIDTH = 4.25e12   # bytes/s: the H200's measured copy bandwidth
TENSOR_RATE = 750e12  # bf16 FLOP/s


def layer_linears(config: dict) -> list:
    """(name, k, [weight rows side by side], with a residual) of one decoder layer's linears and the LM head,
    as the serving device launches them (q|k|v and gate|up side by side)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return [("qkv", h, [q, kv, kv], False), ("o", q, [h], True), ("gate_up", h, [inter, inter], False),
            ("down", inter, [h], True), ("lm_head", h, [config["vocab_size"]], False)]


def floor_us(rows: int, k: int, n: int, residual: bool) -> float:
    """The launch's floor: its bf16 weights, f32 input rows and f32 output (and residual) rows over the
    bandwidth, or its products over the tensor rate, whichever is more."""
    moved = 2 * n * k + 4 * rows * k + 4 * rows * n * (2 if residual else 1)
    return max(moved / BANDWIDTH, 2 * rows * n * k / TENSOR_RATE) * 1e6


def _time(torch, launch, copies: int, samples: int, stream, calls: int = 20) -> float:
    """Median µs per launch over `samples` replays of a CUDA graph of `calls` back-to-back launches (the weight
    copies taken in turn), between CUDA events: the GPU's time, as a serving step's graph replays it, without
    the host's launch cost."""
    with torch.cuda.stream(stream):
        for i in range(2 * copies):
            launch(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            launch(i % copies)
    graph.replay()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def bench_model(torch, name: str, config: dict, rows_list: list, samples: int) -> list:
    from mdsl.gpu.driver import l2_bytes
    from mdsl.ir.dtypes import bf16, f32
    from mdsl.serving.gpu import Operand
    from mdsl.serving.gpu_wgmma import Standalone, WgmmaLinears, launch_grid

    linears = layer_linears(config)
    most = max(rows_list)
    stream = torch.cuda.Stream()   # the graphs' capture stream: the linear launches on it
    dev = Standalone(most, [(k, sizes) for _, k, sizes, _ in linears], stream=stream.cuda_stream)
    wgmma = WgmmaLinears(dev, max(k for _, k, _, _ in linears))
    gen = torch.Generator(device="cuda").manual_seed(0)
    out_rows = []
    for op, k, sizes, with_residual in linears:
        n = sum(sizes)
        copies = max(1, -(-2 * l2_bytes(0) // (2 * n * k)))
        weights = [[torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for m in sizes]
                   for _ in range(copies)]
        joined = [torch.cat(ws) for ws in weights]
        x = torch.randn(most, k, device="cuda", dtype=torch.float32, generator=gen)
        residual = torch.randn(most, n, device="cuda", dtype=torch.float32, generator=gen)
        out = torch.empty(most, n, device="cuda", dtype=torch.float32)
        x_op, out_op = Operand(x.data_ptr(), (most, k), f32), Operand(out.data_ptr(), (most, n), f32)
        r_op = Operand(residual.data_ptr(), (most, n), f32) if with_residual else None
        w_ops = [[Operand(w.data_ptr(), (w.shape[0], k), bf16) for w in ws] for ws in weights]
        xb = x.to(torch.bfloat16)
        torch.cuda.synchronize()   # (the linear's stream does not wait for the default stream's initialisation)
        for rows in rows_list:
            def ours(i, rows=rows):
                # the rows handed over rounded by the op before, as the serving device's norms, attention and
                # gated gate|up hand them to the linear after them (handed_rows in mdsl/serving/gpu.py): x's,
                # rounded to bf16 as the device rounds them
                wgmma.handed = (x_op.ptr, xb.data_ptr())
                wgmma.launch(out_op, x_op, w_ops[i], r_op, rows, 0)

            with torch.cuda.stream(stream):
                ours(0)
            torch.cuda.synchronize()
            want = xb[:rows].double() @ joined[0].double().T + (residual[:rows].double() if with_residual else 0)
            error = (out[:rows].double() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
            (rn, _), grid, splits = launch_grid(rows, sizes, k, dev.sms)
            row = {"model": name, "op": op, "rows": rows, "k": k, "n": n, "residual": with_residual,
                   "floor_us": floor_us(rows, k, n, with_residual), "error": error,
                   "row_tile": rn, "splits": splits, "blocks": grid[0] * grid[1] * grid[2]}
            if error > 1e-4:
                row["failed"] = f"max error {error:.2e} of the largest value (float64 on the rounded rows)"
            else:
                row["mdsl_us"] = _time(torch, ours, copies, samples, stream)
                row["torch_us"] = _time(torch, lambda i, rows=rows: torch.nn.functional.linear(xb[:rows], joined[i]),
                                        copies, samples, stream)
            out_rows.append(row)
            print(_line(row), flush=True)
        del weights, joined
    return out_rows


HEADER = ("| model | op | rows | k | n | blocks | floor µs | mdsl µs | mdsl % of floor | torch µs | torch / mdsl |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def _line(r: dict) -> str:
    if "failed" in r:
        return f"| {r['model']} | {r['op']} | {r['rows']} | {r['k']} | {r['n']} | {r['blocks']} | - | " \
               f"failed: {r['failed']} | - | - | - |"
    return (f"| {r['model']} | {r['op']} | {r['rows']} | {r['k']} | {r['n']} | {r['blocks']} | {r['floor_us']:.1f} | "
            f"{r['mdsl_us']:.1f} | {100 * r['floor_us'] / r['mdsl_us']:.0f}% | {r['torch_us']:.1f} | "
            f"{r['torch_us'] / r['mdsl_us']:.2f}× |")


def main(argv=None) -> int:
    import torch

    from mdsl.megakernel.runtime.models import MODELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--rows", default="1,8,32,64,256", help="comma-separated row counts (a step's tokens)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="write serve_linears.json and .md here")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("serve_linears.py: the wgmma linear needs a compute capability 9.0 GPU (an H100/H200)", file=sys.stderr)
        return 2
    result = {"meta": provenance("serve_linears.py", sys.argv[1:] if argv is None else argv, gpu=True), "rows": []}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):   # the clocks up from idle before the first timing
        a @ a
    torch.cuda.synchronize()
    del a
    rows_list = [int(v) for v in args.rows.split(",")]
    print(HEADER, flush=True)
    for name in models:
        result["rows"] += bench_model(torch, name, MODELS[name], rows_list, args.samples)
    text = HEADER + "\n" + "\n".join(_line(r) for r in result["rows"])
    if args.out is not None:
        write_outputs(args.out, "serve_linears", result, text)
    return 1 if any("failed" in r for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())

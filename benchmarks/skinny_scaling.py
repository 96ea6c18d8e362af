"""How the skinny loop's time scales with its grid: is RMSNorm+Linear at batch 1-8 bound by each SM's draw
(the time stays flat as blocks, one an SM, are added) or by the DRAM (the time grows with the bytes)?

For X of M rows (2: batch 1, 16: batch 8) and K = 4096, the weight has `blocks` x N columns, each block
streaming N columns over all of K (a row segment of 2 N bytes, rows 2 N blocks bytes apart). Each grid is
timed as the autotuner times (rotated inputs past twice the L2, CUDA events, correctness first) with the
kernel benchmark's picks (the skinny loop, staggered, overlapping its predecessor; own and 256 threads).

    python3 benchmarks/skinny_scaling.py [--blocks 48,66,96,120,132] [--rows 2,16] [--columns 64,128] [--lead 2]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:   # run as a script from anywhere, with or without mdsl installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda text: [int(v) for v in text.split(",")]   # noqa: E731
    p.add_argument("--blocks", type=ints, default=[48, 66, 96, 120, 132])
    p.add_argument("--rows", type=ints, default=[2, 16])
    p.add_argument("--columns", type=ints, default=[64])
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--lead", type=int, default=2, help="CudaOptions.lead: iterations the L2 prefetches run ahead")
    args = p.parse_args()

    from mdsl.backend.cuda import autotune, runtime
    from mdsl.lowering.options import CudaOptions
    from mdsl.ir.text import parse_graph
    from tests.ir.skinny_texts import rms_norm_linear   # the tests' RMSNorm+Linear block graph text

    runtime.require_gpu("timing the skinny loop")
    space = [CudaOptions(skinny=True, stagger=True, overlap=True, lead=args.lead),
             CudaOptions(skinny=True, stagger=True, overlap=True, threads=256, lead=args.lead)]
    print("| rows | blocks | columns a block | MB | own threads µs | 256 threads µs | best TB/s | GB/s an SM |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in args.rows:
        for n in args.columns:
            for blocks in args.blocks:
                graph = parse_graph(rms_norm_linear(m, n, blocks=blocks, forloop=64))
                result = autotune.autotune([graph], graph, space=space, samples=args.samples, cache=False)
                times = {t.variant.options.threads: t.us for t in result.timings}
                bytes_moved = 2 * (m * 4096 + 4096 * n * blocks + m * n * blocks)
                best = min(t for t in times.values() if t is not None)
                cells = [f"{times.get(t):.2f}" if times.get(t) is not None else "-" for t in (None, 256)]
                print(f"| {m} | {blocks} | {n} | {bytes_moved / 1e6:.1f} | {cells[0]} | {cells[1]} | "
                      f"{bytes_moved / best / 1e6:.2f} | {bytes_moved / blocks / best / 1e3:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

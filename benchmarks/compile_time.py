"""Compile time per kernel: the PTX backend (LLVM IR by llvmlite.ir, PTX by llvmlite's NVPTX target)
against the CUDA backend (CUDA C++, cubin by NVRTC), on the plans of the ten benchmark cases. No GPU.

    python benchmarks/compile_time.py [--reps 3] [--cases gqa_bs1,lora] [--assemble] [--json out.json]

Plans: each case's plan from the plan cache (SearchConfig(budget_s=--budget, seed 0, sm_90a); the
kernel benchmark's plans: MDSL_CACHE_DIR=.plans), else its best guided plan (mdsl.search.guided,
seconds, no z3). Each backend compiles each plan from scratch (no disk cache) --reps times, the
backends taking turns; the median is reported, per program and per kernel (program time / launches):

* cuda: emit_cuda + NVRTC to a cubin (NVRTC runs ptxas inside; what a GPU run needs);
* ptx: emit_llvm + parse, optimise and emit PTX (what the driver loads; it JIT-assembles it there);
* ptx+ptxas (--assemble): the PTX assembled to a cubin as well (ptxas or nvJitLink), for a like-for-like
  comparison with NVRTC's cubin.

--sass: instead of timing, each kernel's ptxas registers and SASS instructions (nvdisasm) from the PTX of
the lean pass pipeline (`mdsl.backend.ptx.compile.LEAN_PIPELINE`, the default) against the same with
InstCombine after SROA (the pipeline before it), so that compile time is not bought with slower kernels.

--mix: instead of timing, each kernel's SASS instruction mix from the CUDA backend against the PTX
backend (registers, spills, instructions, and the counts of the instruction kinds that tell the code
paths apart: global loads by width and cache form, mmas, byte permutes, barriers, shuffles, local
memory), under the lowering options --skinny and --threads give both (the autotuner's picks):

    python benchmarks/compile_time.py --mix --skinny --cases rms_norm_linear_bs1,gated_mlp

The speed-up is NVRTC's time over PTX generation's. The first compile of each backend in the process
(library loading, target set-up) is made before timing.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cases import cases  # noqa: E402 - needs ROOT on sys.path
from benchmarks.provenance import provenance  # noqa: E402

ARCH = "sm_90a"


def plan_graph(kernel, budget: float):
    """The case's plan: the cached one when there is one, else the best guided plan."""
    from mdsl.search import guided

    try:
        from mdsl.search.config import SearchConfig
        from mdsl.search.engine import cached_plan

        plan = cached_plan(kernel.graph, SearchConfig(budget_s=budget, seed=0, arch=ARCH))
        if plan is not None:
            return plan.graph, "cached plan"
    except ModuleNotFoundError:   # the search's modules (z3) are not installed
        pass
    return next(guided.generate(kernel.graph)), "guided plan"


def time_cuda(graph) -> float:
    from mdsl.backend.cuda import emit_cuda
    from mdsl.backend.cuda.nvrtc import _compile, _nvrtc

    start = time.perf_counter()
    program = emit_cuda(graph, arch=ARCH)
    _compile(_nvrtc(), program.source, ARCH, ())
    return time.perf_counter() - start


def time_ptx(graph, assemble: bool) -> float:
    from mdsl.backend.ptx import assemble as assemble_ptx
    from mdsl.backend.ptx import emit_llvm, llvm_to_ptx

    start = time.perf_counter()
    program = emit_llvm(graph, arch=ARCH)
    ptx = llvm_to_ptx(program.llvm_ir, ARCH)
    if assemble:
        assemble_ptx(ptx, ARCH)
    return time.perf_counter() - start


def sass_rows(name: str, graph) -> list:
    """Per kernel: registers and SASS instructions with the lean pipeline and with InstCombine."""
    from mdsl.backend.cuda.nvrtc import disassemble, sass_instructions
    from mdsl.backend.ptx import assemble as assemble_ptx
    from mdsl.backend.ptx import emit_llvm, llvm_to_ptx
    from mdsl.backend.ptx.compile import LEAN_PIPELINE

    with_instcombine = LEAN_PIPELINE[:LEAN_PIPELINE.index("sroa") + 1] + ("instruction_combine",) + \
        LEAN_PIPELINE[LEAN_PIPELINE.index("sroa") + 1:]
    program = emit_llvm(graph, arch=ARCH)
    found = {}
    for label, passes in (("lean", LEAN_PIPELINE), ("instcombine", with_instcombine)):
        assembled = assemble_ptx(llvm_to_ptx(program.llvm_ir, ARCH, passes=passes), ARCH)
        counts = {k: len(v) for k, v in sass_instructions(disassemble(assembled.cubin)).items()}
        found[label] = {k: (r.registers, counts.get(k, 0)) for k, r in assembled.resources.items()}
    return [{"case": name, "kernel": k, "lean": found["lean"][k], "instcombine": found["instcombine"][k]}
            for k in found["lean"]]


#: instruction kinds the --mix table counts (a regular expression over opcodes with their modifiers)
MIX = {"instructions": r".*", "LDG.128 NA": r"LDG\.E\.NA\.128\.CONSTANT", "LDG.64 NA": r"LDG\.E\.NA\.64\.CONSTANT",
       "LDG const": r"LDG\.E(\.64|\.128)?\.CONSTANT", "LDG other": r"LDG\.(?!.*CONSTANT).*",
       "LDGSTS": r"LDGSTS.*", "HMMA": r"HMMA.*", "LDSM": r"LDSM.*", "PRMT": r"PRMT", "CCTL": r"CCTL.*",
       "BAR": r"BAR.*", "SHFL": r"SHFL.*", "BRA": r"BRA.*", "LDL/STL": r"(LDL|STL).*"}


def mix_rows(name: str, graph, options) -> list:
    """Per kernel: (kind, CUDA count, PTX count) for the registers, spills and MIX's instruction kinds."""
    from mdsl.backend.cuda import compile_cuda, emit_cuda
    from mdsl.backend.cuda.nvrtc import disassemble, sass_instructions
    from mdsl.backend.ptx import assemble as assemble_ptx
    from mdsl.backend.ptx import emit_llvm, llvm_to_ptx

    cuda = compile_cuda(emit_cuda(graph, arch=ARCH, options=options).source, arch=ARCH)
    ptx = assemble_ptx(llvm_to_ptx(emit_llvm(graph, arch=ARCH, options=options).llvm_ir, ARCH), ARCH)
    mine, theirs = sass_instructions(disassemble(ptx.cubin)), sass_instructions(disassemble(cuda.cubin))
    rows = []
    for kernel, resources in cuda.resources.items():
        ours = ptx.resources[kernel]
        counts = [("registers", resources.registers, ours.registers),
                  ("spilled bytes", resources.spill_store_bytes, ours.spill_store_bytes)]
        counts += [(kind, sum(1 for op in theirs[kernel] if re.fullmatch(pattern, op)),
                    sum(1 for op in mine[kernel] if re.fullmatch(pattern, op))) for kind, pattern in MIX.items()]
        rows.append({"case": name, "kernel": kernel, "counts": counts})
    return rows


def interleaved_medians(reps: int, measures: dict) -> dict:
    """name -> the median of `reps` runs of measures[name](), the measures taking turns (so that a
    machine whose load changes during the run weighs on each alike)."""
    samples: dict = {name: [] for name in measures}
    for _ in range(reps):
        for name, measure in measures.items():
            samples[name].append(measure())
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3, help="compiles per backend and case; the median is reported")
    p.add_argument("--cases", help="comma-separated case names (default: all ten)")
    p.add_argument("--budget", type=float, default=120.0, help="the plan cache's search budget (part of its key)")
    p.add_argument("--assemble", action="store_true", help="also time PTX generation followed by ptxas")
    p.add_argument("--json", type=Path, help="write every number here")
    p.add_argument("--sass", action="store_true", help="compare registers and SASS instructions of the pass "
                   "pipelines instead of timing")
    p.add_argument("--mix", action="store_true", help="compare the CUDA and PTX kernels' SASS instruction mixes "
                   "instead of timing")
    p.add_argument("--skinny", action="store_true", help="with --mix: the skinny loop where it qualifies")
    p.add_argument("--threads", type=int, help="with --mix: threads per block of the custom kernels")
    args = p.parse_args(argv)
    kernels = cases()
    names = args.cases.split(",") if args.cases else list(kernels)
    from mdsl.backend.ptx import emit_llvm

    if args.mix:
        from mdsl.lowering.options import CudaOptions

        options = CudaOptions(skinny=args.skinny, threads=args.threads)
        print(f"CUDA / PTX, {options}")
        for name in names:
            for row in mix_rows(name, plan_graph(kernels[name], args.budget)[0], options):
                print(f"{row['case']} {row['kernel']}: " + ", ".join(f"{kind} {c} / {x}" for kind, c, x in row["counts"]),
                      flush=True)
        return 0

    if args.sass:
        print("| case | kernel | registers lean / InstCombine | SASS instructions lean / InstCombine |\n|---|---|---|---|")
        for name in names:
            for row in sass_rows(name, plan_graph(kernels[name], args.budget)[0]):
                print(f"| {row['case']} | {row['kernel']} | {row['lean'][0]} / {row['instcombine'][0]} | "
                      f"{row['lean'][1]} / {row['instcombine'][1]} |", flush=True)
        return 0

    rows = []
    warmed = False
    for name in names:
        graph, source = plan_graph(kernels[name], args.budget)
        launches = len(emit_llvm(graph, arch=ARCH).launches)
        if not warmed:
            time_cuda(graph), time_ptx(graph, args.assemble)
            warmed = True
        measures = {"nvrtc_s": lambda: time_cuda(graph), "ptx_s": lambda: time_ptx(graph, False)}
        if args.assemble:
            measures["ptx_ptxas_s"] = lambda: time_ptx(graph, True)
        row = {"case": name, "plan": source, "kernels": launches, **interleaved_medians(args.reps, measures)}
        row["speedup"] = row["nvrtc_s"] / row["ptx_s"]
        rows.append(row)
        print(f"{name}: {launches} kernel(s), NVRTC {1e3 * row['nvrtc_s'] / launches:.1f} ms/kernel, "
              f"PTX {1e3 * row['ptx_s'] / launches:.1f} ms/kernel ({row['speedup']:.1f}x)", flush=True)
    head = "| case | plan | kernels | NVRTC ms/kernel | PTX ms/kernel | speed-up |" + \
           (" PTX+ptxas ms/kernel |" if args.assemble else "")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        k = r["kernels"]
        line = (f"| {r['case']} | {r['plan']} | {k} | {1e3 * r['nvrtc_s'] / k:.1f} | {1e3 * r['ptx_s'] / k:.1f} | "
                f"{r['speedup']:.1f}x |")
        if args.assemble:
            line += f" {1e3 * r['ptx_ptxas_s'] / k:.1f} |"
        lines.append(line)
    total_nvrtc = sum(r["nvrtc_s"] for r in rows)
    total_ptx = sum(r["ptx_s"] for r in rows)
    kernels_total = sum(r["kernels"] for r in rows)
    lines.append(f"\nall cases: NVRTC {1e3 * total_nvrtc / kernels_total:.1f} ms/kernel, PTX "
                 f"{1e3 * total_ptx / kernels_total:.1f} ms/kernel: {total_nvrtc / total_ptx:.1f}x; "
                 f"smallest per-case speed-up {min(r['speedup'] for r in rows):.1f}x")
    print("\n".join(lines))
    if args.json:
        meta = provenance("compile_time.py", sys.argv[1:] if argv is None else argv)
        args.json.write_text(json.dumps({"schema": 1, "meta": meta, "arch": ARCH, "reps": args.reps, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile, in parallel, every (mugraph, options) pair the kernel benchmark's autotuner will time, into the
cubin cache under $MDSL_CACHE_DIR, so that the GPU run's time goes to timing: on the GPU machine (16
cores) NVRTC takes about half a second a kernel, one after another inside the harness several minutes.

    MDSL_CACHE_DIR=$PWD/.plans python3 scripts/precompile_parallel.py --jobs 15 [--autotune 3 --variants 8] [CASE ...]

With --first-call, instead: every plan under $MDSL_CACHE_DIR (the random programs', the torch backend's
regions'), the kernels a program's first GPU call compiles to tune it (`autotune.first_call_set` under
FIRST_CALL_SPACE), so that the call's time goes to timing; NVRTC compiles for sm_90a without a GPU, so a
cache carried to the GPU machine can be filled on any machine:

    MDSL_CACHE_DIR=$PWD/.plans-random python3 scripts/precompile_parallel.py --first-call

Reads the plan cache (plans and stored tuning variants) only: no search, no z3."""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _compile(job: tuple) -> str:
    source, arch = job
    from mdsl.backend.cuda.nvrtc import compile_cuda
    from mdsl.errors import MdslError

    try:
        compile_cuda(source, arch=arch)
        return ""
    except MdslError as e:
        return str(e).splitlines()[0]


def sources(names: list, limit: int, variants: int, arch: str) -> list:
    from benchmarks.cases import cases
    from mdsl.backend.cuda.autotune import emitted_variants, parameter_space, tuning_set
    from mdsl.backend.cuda.codegen import emit_cuda
    from mdsl.search.config import SearchConfig
    from mdsl.search.engine import cached_plan

    out = {}
    kernels = cases()
    for name in names:
        plan = cached_plan(kernels[name].graph, SearchConfig(budget_s=120.0, arch=arch))
        if plan is None:
            print(f"{name}: no plan in the cache", flush=True)
            continue
        todo = tuning_set(plan, limit, variants)
        pairs = [v for v, problem in emitted_variants(todo.graphs, parameter_space(), arch, todo.spaces, todo.names)
                 if not problem]
        for v in pairs:
            out[emit_cuda(todo.graphs[v.candidate], arch=arch, options=v.options).source] = name
        print(f"{name}: {len(pairs)} variant(s)", flush=True)
    return list(out)


def first_call_sources(arch: str) -> list:
    """The sources of every cached plan's first-call tuning set (each distinct source once)."""
    from mdsl.backend.cuda.autotune import FIRST_CALL_SPACE, emitted_variants, first_call_set
    from mdsl.backend.cuda.codegen import emit_cuda
    from mdsl.search.cache import CorruptEntry, PlanCache, _read_bounded, _read_entry
    from mdsl.search.cache_check import entry_keys
    from mdsl.errors import MdslError

    cache = PlanCache()
    out = {}
    for key in entry_keys(cache.root)[0]:
        # read only: an entry this script cannot read is reported and left for the searches' own reads to judge
        # (PlanCache.load_key deletes what fails its key check, and a region's key names its searcher)
        try:
            plan = _read_entry(_read_bounded(cache.path(key)), key, None)
        except (OSError, ValueError, CorruptEntry, MdslError) as e:
            print(f"{key}: not read ({type(e).__name__}: {e})", flush=True)
            continue
        todo = first_call_set(plan)
        pairs = [v for v, problem in emitted_variants(todo.graphs, FIRST_CALL_SPACE, arch, todo.spaces, todo.names)
                 if not problem]
        for v in pairs:
            out[emit_cuda(todo.graphs[v.candidate], arch=arch, options=v.options).source] = key
        print(f"{plan.original.name}: {len(pairs)} variant(s)", flush=True)
    return list(out)


def main() -> int:
    from benchmarks.kernels import case_names

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="*")
    p.add_argument("--jobs", type=int, default=max(1, multiprocessing.cpu_count() - 1))
    p.add_argument("--autotune", type=int, default=3, help="the plan's best N candidates (as kernels.py --autotune)")
    p.add_argument("--variants", type=int, default=8, help="stored tuning variants per plan (as kernels.py --variants)")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--first-call", action="store_true",
                   help="every cached plan's first-call tuning set instead of the benchmark cases'")
    args = p.parse_args()
    t0 = time.perf_counter()
    todo = (first_call_sources(args.arch) if args.first_call
            else sources(args.cases or case_names(), args.autotune, args.variants, args.arch))
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        problems = [p for p in pool.imap_unordered(_compile, [(s, args.arch) for s in todo]) if p]
    print(f"compiled {len(todo) - len(problems)} of {len(todo)} kernels in {time.perf_counter() - t0:.1f} s "
          f"with {args.jobs} processes", flush=True)
    for problem in problems:
        print("  failed:", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

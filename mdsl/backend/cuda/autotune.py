"""GPU autotuning: a plan's verified candidates (the chosen mugraph and `Plan.alternatives`) and its
verified tuning variants (`mdsl.search.variants`: the same fused structure under other grids, splits
and loop lengths), each lowered with a few settings of the CUDA backend (`CudaOptions`: pipeline depth,
threads per block), compiled, checked against the float64 reference and timed on the GPU; the fastest
correct one is cached per device.

    plan = kernel.optimize()
    todo = tuning_set(plan)                                    # reads the variants; verifies nothing
    best = autotune(todo.graphs, plan.original, spaces=todo.spaces, names=todo.names)   # needs a GPU
    executable = runtime.compile_graph(best.graph, options=best.options)

Timing: CUDA events around `calls` back-to-back launches (the unchecked launch path, as the kernel
benchmark launches), after warm-up; the median over `samples`. The calls rotate over copies of the
inputs that exceed twice the L2 cache (`rotation_sets`), as the benchmark's do: a weight of 50 MB read
again from a 60 MB L2 times faster than it runs in a model.
A variant whose output is off (relative L2 error over the dtype's bound) or that fails to compile or
run is never chosen; the report says why. The cache lives under `$MDSL_CACHE_DIR/autotune` (default
`~/.cache/mdsl/autotune`), one JSON entry per (programs, device, arch, parameter space, mdsl version),
written atomically and validated when read (an entry that does not fit is ignored with a warning and
tuned again). Only `autotune` itself touches the GPU; the parameter space, the variants and the
cache are plain Python (tested without a GPU).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import json
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import attrs
import numpy as np

from mdsl.backend.cuda.codegen import emit_cuda
from mdsl.errors import MdslError
from mdsl.gpu.cache import write_atomic
from mdsl.gpu.cache import cache_dir as _cache_dir
from mdsl.gpu.calls import PreparedCall
from mdsl.ir.graph import KernelGraph
from mdsl.ir.text import print_graph
from mdsl.lowering.options import CudaOptions

SCHEMA = 2                          # 2: timed over inputs rotated past L2, on the unchecked path
STAGES = (2, 3, 4)
THREADS = (None, 256)               # None: each block graph's own
SKINNY = (False, True)              # the skinny loop (matmuls of <= 16 rows, skinny.py) where it qualifies
OVERLAP = (False, True)             # custom kernels launched to overlap their predecessors (sm_90+), with the skinny options
STAGGER = (False, True)             # the skinny loop's blocks walking K from staggered slabs
# loop iterations the skinny loop's L2 prefetches run ahead of its loads (0: none; a lead of 4 is in
# docs/tried-kernels.md)
LEADS = (2, 0)
WIDE_X = (False, True)              # the skinny loop's steps of two slabs, X's fragments in 16-byte loads
# more warps where the skinny loop sends nothing to L2 ahead (lead 0): its bytes in flight are then the
# register buffers' alone, a block's warps times their two buffers (384 threads: 170 registers each at most)
UNPREFETCHED_THREADS = (384,)
SKINNY_LOOP = "::run(skinny_acc"   # in a kernel's source: the skinny loop was taken
VARIANT_STAGES = (2, 3)             # the trimmed space of tuning variants (they are many)
_TOLERANCE = {"f16": 3e-3, "bf16": 1e-2, "f32": 1e-3}   # ||got - ref|| / ||ref||, loosest dtype of the program
#: the lowering options a kernel's first GPU call times for each candidate (`first_call_set`): the tile loop
#: with the default pipeline, and the skinny loop (where it qualifies) overlapping its predecessor, with L2
#: prefetches and without them with X in 16-byte loads: few, since that call compiles each. Each again with
#: mdsl's own GEMM kernels in place of cuBLAS's (a candidate without a library GEMM lowers the same and is
#: dropped as a repeat): a library GEMM's call costs the host far more than a kernel's launch, and a program
#: of own kernels alone launches as one CUDA graph (mdsl.gpu.executable), so where the host bounds a call the
#: own kernels win; where the GPU does, cuBLAS's tiles mostly do. Only the call's time decides.
_FIRST_CALL_LOOPS = (CudaOptions(), CudaOptions(skinny=True, overlap=True),
                     CudaOptions(skinny=True, overlap=True, lead=0, wide_x=True))
FIRST_CALL_SPACE = _FIRST_CALL_LOOPS + tuple(attrs.evolve(o, library_gemm=False) for o in _FIRST_CALL_LOOPS)
#: seconds a first call's tuning measures for: past them the candidates' remaining options are not timed
#: (each candidate's first option always is), so that a program of many candidates costs bounded time
FIRST_CALL_BUDGET_S = 30.0


@attrs.frozen
class Variant:
    candidate: int                 # index into the candidates (0: the plan's chosen mugraph)
    options: CudaOptions
    name: str = attrs.field(default="", eq=False)   # what the candidate is, for reports

    def describe(self) -> str:
        o = self.options
        threads = "own threads" if o.threads is None else f"{o.threads} threads"
        name = f" ({self.name})" if self.name else ""
        loop = "skinny loop where it qualifies" if o.skinny else f"{o.stages}-stage pipeline"
        if o.skinny and o.stagger:
            loop += " (staggered)"
        if o.skinny and o.lead != 2:
            loop += f" (L2 prefetch {o.lead} iterations ahead)"
        if o.skinny and o.wide_x:
            loop += " (X in 16-byte loads)"
        if o.overlap:
            loop += ", overlapping its predecessor"
        if not o.library_gemm:
            loop += ", own GEMM kernels"
        return f"candidate {self.candidate}{name}, {loop}, {threads}"


@attrs.frozen
class Timing:
    variant: Variant
    us: Optional[float]            # median time per call; None: not timed (see `problem`)
    problem: str = ""              # why it was not timed: compile or run failure, wrong output


@attrs.frozen
class TuneResult:
    graph: KernelGraph             # the fastest correct candidate
    variant: Variant
    us: float
    timings: tuple = ()            # every variant's Timing (empty when read from the cache)
    cached: bool = False

    @property
    def options(self) -> CudaOptions:
        return self.variant.options

    def lines(self) -> list:
        out = [f"autotune: {self.variant.describe()}: {self.us:.2f} us per call" + (" (cached)" if self.cached else "")]
        for t in sorted(self.timings, key=lambda t: (t.us is None, t.us or 0.0)):
            out.append(f"  {t.variant.describe()}: " + (f"{t.us:.2f} us" if t.us is not None else t.problem))
        return out


def plan_candidates(plan, limit: Optional[int] = None) -> list:
    """The plan's chosen mugraph, then its verified alternatives, best first (at most `limit` in all)."""
    return ([plan.graph] + [alt.graph for alt in plan.alternatives])[:limit]


@attrs.frozen
class TuningSet:
    """What `autotune` times for one plan: the mugraphs, each one's lowering options, each one's name."""

    graphs: tuple
    spaces: tuple
    names: tuple


def tuning_set(plan, limit: int = 3, variants: int = 8, cache=None) -> TuningSet:
    """The plan's best `limit` verified candidates, each under the full parameter space, then up to
    `variants` of its stored tuning variants (`mdsl.search.variants`), each under the trimmed space
    (VARIANT_STAGES x THREADS), so that compile counts stay in bounds. Reads the plan cache's variants
    entry only: no search, no verification (and no z3) here."""
    from mdsl.search.variants import tuning_candidates

    own = plan_candidates(plan, limit)
    found = tuning_candidates(plan, limit, variants=variants, cache=cache) if variants else []
    keys = {g.key for g in own}
    extra = [c.graph for c in found if c.graph.key not in keys]
    full, trimmed = parameter_space(), parameter_space(stages=VARIANT_STAGES)
    names = ["the plan's choice"] + [f"alternative {k}" for k in range(1, len(own))] + \
            [f"variant {k + 1}: {describe_grid(g)}" for k, g in enumerate(extra)]
    return TuningSet(tuple(own + extra), tuple([full] * len(own) + [trimmed] * len(extra)), tuple(names))


def first_call_set(plan, limit: int = 3) -> TuningSet:
    """What a kernel's first GPU call times (`mdsl.frontend.kernel`): the plan's best `limit` verified
    candidates and the program as written (its unfused kernels, the library's matmuls among them: the
    candidate that is never slower than running each op alone), each under FIRST_CALL_SPACE."""
    own = plan_candidates(plan, limit)
    names = ["the plan's choice"] + [f"alternative {k}" for k in range(1, len(own))]
    if plan.original.key not in {g.key for g in own}:
        own.append(plan.original)
        names.append("the program as written")
    return TuningSet(tuple(own), (FIRST_CALL_SPACE,) * len(own), tuple(names))


def compiled_registers(graph: KernelGraph, arch: str = "sm_90a") -> Callable[[int], Optional[int]]:
    """For `mdsl.search.cost.gpu_estimate(registers=...)`: node index -> registers per thread (spilled ones
    included) of that node's kernel (of a split and its combine in one launch: their kernel's) as ptxas
    reported it for a cubin the cache already holds (the graph's own block size, the tuning variants'
    pipeline depths), else None. Never compiles."""
    from mdsl.backend.cuda.nvrtc import cached_resources

    for options in parameter_space(stages=VARIANT_STAGES, threads=(None,), skinny=(False,)):
        try:
            program = emit_cuda(graph, arch=arch, options=options)
            found = cached_resources(program.source, arch=arch)
        except MdslError:   # a lowering the backend refuses, or no NVRTC to key the cache with
            continue
        if found is not None:
            needed = {}
            for launch in program.launches:
                if launch.name in found:
                    r = found[launch.name]
                    nodes = (launch.node_index, launch.node_index + 1) if launch.counters else (launch.node_index,)
                    needed.update((index, r.registers + -(-r.spill_store_bytes // 4)) for index in nodes)
            return needed.get
    return lambda index: None


def describe_grid(graph: KernelGraph) -> str:
    """Each custom kernel's grid and loop: "64x2 blocks x 4 iterations ; 64 blocks x 2 iterations"."""
    return " ; ".join("x".join(str(g) for g in n.body.grid if g > 1) + f" blocks x {n.body.forloop} iteration(s)"
                      for n in graph.nodes if n.body is not None)


def parameter_space(stages: Sequence[int] = STAGES, threads: Sequence = THREADS,
                    skinny: Optional[Sequence[bool]] = None, overlap: Sequence[bool] = OVERLAP,
                    stagger: Sequence[bool] = STAGGER, leads: Sequence[int] = LEADS,
                    wide_x: Sequence[bool] = WIDE_X, unprefetched_threads: Sequence = UNPREFETCHED_THREADS) -> list:
    """The lowering options tried for every candidate: each pipeline depth with each block size, with and
    without the skinny loop, tensor cores and register accumulators on (their correctness is what the GPU
    tests check). The skinny loop has no pipeline, and where it does not qualify the tile loop is emitted:
    `variants` drops the repeated sources, so it adds one compile per block size where it applies; it is
    tried with each of `overlap` (every custom kernel launched to overlap its predecessor: programmatic
    dependent launch, sm_90+; so a graph without a skinny loop gets its tile loop timed overlapping too,
    and no more), each of `stagger`, each of `leads` (how many loop iterations ahead its weight slabs are
    sent to L2) and each of `wide_x` (steps of two slabs, X's fragments in 16-byte loads; where that does
    not apply the source repeats and is dropped). Without L2 prefetches (lead 0) the skinny loop is also
    tried with `unprefetched_threads` (more warps, more loads in flight).
    `skinny` None: SKINNY, unless the environment switches the skinny loop off (MDSL_CUDA_SKINNY=0)."""
    if skinny is None:
        switched_off = os.environ.get("MDSL_CUDA_SKINNY", "").strip().lower() in ("0", "false", "off", "no")
        skinny = (False,) if switched_off else SKINNY
    return [CudaOptions(stages=s, threads=t, skinny=k, overlap=o, stagger=g, lead=d, wide_x=v)
            for k in skinny for o in (overlap if k else (False,))
            for g in (stagger if k else (False,)) for d in (leads if k else (2,))
            for v in (wide_x if k else (False,))
            for t in (*threads, *(unprefetched_threads if k and d == 0 else ())) for s in stages]


def variants(candidates: Sequence[KernelGraph], space: Sequence[CudaOptions], *, arch: str = "sm_90a",
             spaces: Optional[Sequence] = None, names: Optional[Sequence[str]] = None) -> list:
    """Every (candidate, options) pair, without those whose emitted source repeats an earlier one
    (a graph that cannot pipeline deeper, a block already of that size) or that do not emit, in order.
    `spaces`: each candidate's own options (default: `space` for all)."""
    return [v for v, problem in emitted_variants(candidates, space, arch, spaces, names) if not problem]


def emitted_variants(candidates, space, arch: str, spaces=None, names=None) -> list:
    """(Variant, "" or why it does not emit) for every distinct (candidate, options) pair."""
    out, seen = [], set()
    for k, graph in enumerate(candidates):
        for options in (spaces[k] if spaces is not None else space):
            variant = Variant(k, options, names[k] if names else "")
            try:
                program = emit_cuda(graph, arch=arch, options=options)
            except MdslError as e:  # a lowering the backend refuses: reported, never timed
                out.append((variant, f"does not emit: {e}"))
                continue
            if options.threads in UNPREFETCHED_THREADS and SKINNY_LOOP not in program.source:
                continue   # tried for the skinny loop only: dropped like a repeated source
            # (the same source with other launches in cuBLAS is another variant)
            lowered = (program.source, tuple(launch.library is not None for launch in program.launches))
            if lowered not in seen:
                seen.add(lowered)
                out.append((variant, ""))
    return out


# ---------------------------------------------------------------------------------------------
# the cache


def cache_dir() -> Path:
    return _cache_dir("autotune")


def cache_key(candidates: Sequence[KernelGraph], device: str, arch: str, space: Sequence[CudaOptions],
              spaces: Optional[Sequence] = None, checked: bool = False) -> str:
    from mdsl.search.plan import mdsl_version

    material = {"schema": SCHEMA, "programs": [print_graph(g) for g in candidates], "device": device, "arch": arch,
                "space": [attrs.asdict(o) for o in space], "mdsl_version": mdsl_version()}
    if spaces is not None:
        material["spaces"] = [[attrs.asdict(o) for o in s] for s in spaces]
    if checked:   # timed through the checked call: another ranking
        material["checked"] = True
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def store(key: str, result: TuneResult, device: str) -> Optional[Path]:
    path = cache_dir() / f"{key}.json"
    entry = {"mdsl_autotune": SCHEMA, "key": key, "device": device, "candidate": result.variant.candidate,
             "options": attrs.asdict(result.variant.options), "us": result.us}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(entry, sort_keys=True, indent=1).encode())
    except OSError as e:
        warnings.warn(f"mdsl: could not write the autotune cache entry {path}: {e}", stacklevel=2)
        return None
    return path


def load(key: str, candidates: Sequence[KernelGraph], device: str,
         names: Optional[Sequence[str]] = None) -> Optional[TuneResult]:
    """The cached result under `key`, or None (an entry that does not fit warns and is ignored)."""
    path = cache_dir() / f"{key}.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        entry = json.loads(text)
        if not isinstance(entry, dict) or entry.get("mdsl_autotune") != SCHEMA:
            raise ValueError(f"not an autotune entry of schema {SCHEMA}")
        if entry.get("key") != key or entry.get("device") != device:
            raise ValueError("it belongs to another key or device")
        candidate = entry["candidate"]
        if not (isinstance(candidate, int) and 0 <= candidate < len(candidates)):
            raise ValueError(f"candidate {candidate!r} is not one of the {len(candidates)} candidates")
        options = CudaOptions(**entry["options"])
        us = float(entry["us"])
        if not (us > 0 and np.isfinite(us)):
            raise ValueError(f"its time {us!r} is not a positive number")
    except Exception as e:  # untrusted data: whatever is wrong with it, tune again
        warnings.warn(f"mdsl: ignoring the autotune cache entry {path}: {type(e).__name__}: {e}", stacklevel=2)
        return None
    return TuneResult(candidates[candidate], Variant(candidate, options, names[candidate] if names else ""), us,
                      cached=True)


# ---------------------------------------------------------------------------------------------
# on the GPU


def autotune(candidates: Sequence[KernelGraph], original: KernelGraph, *, space: Optional[Sequence] = None,
             spaces: Optional[Sequence] = None, names: Optional[Sequence[str]] = None, device: int = 0,
             samples: int = 30, calls: int = 10, seed: int = 0, cache: bool = True,
             budget_s: Optional[float] = None, checked: bool = False) -> TuneResult:
    """The fastest correct (candidate, options) on GPU `device` (callers check `runtime.has_gpu()`).
    `spaces`: each candidate's own options (see `tuning_set`), else `space` for all. Every variant's
    source is compiled first, on all cores (NVRTC releases the GIL), into the compile cache; each
    candidate's first option is timed before any candidate's others, and with `budget_s`, options not
    yet timed when that many seconds of measuring have passed are left out (reported so). `checked`: time
    the checked call (`_measure`), as a kernel's first call tunes."""
    from mdsl.backend.cuda import runtime

    runtime.require_gpu("autotuning on the GPU")
    space = list(space if space is not None else parameter_space())
    spaces = None if spaces is None else [list(s) for s in spaces]
    arch = runtime.target_arch(device)
    name = _device_name(device)
    key = cache_key(candidates, name, arch, space, spaces, checked)
    if cache:
        cached = load(key, candidates, name, names)
        if cached is not None:
            return cached
    host = _inputs(original, seed)
    want = _reference(original, host)
    rotated = _rotated_inputs(original, host, device)
    emitted = emitted_variants(candidates, space, arch, spaces, names)
    _compile_all([(candidates[v.candidate], v.options) for v, problem in emitted if not problem], arch)
    firsts = {}
    for k, (v, _) in enumerate(emitted):
        firsts.setdefault(v.candidate, k)
    start, timings = time.monotonic(), {}
    for k in sorted(range(len(emitted)), key=lambda k: (firsts[emitted[k][0].candidate] != k, k)):
        v, problem = emitted[k]
        if problem:
            timings[k] = Timing(v, None, problem)
        elif budget_s is not None and firsts[v.candidate] != k and time.monotonic() - start > budget_s:
            timings[k] = Timing(v, None, f"not timed: the tuning's {budget_s:g} s had passed")
        else:
            timings[k] = _measure(candidates[v.candidate], v, host, want, rotated, arch, device, samples, calls,
                                  checked)
    timings = [timings[k] for k in range(len(emitted))]
    timed = [t for t in timings if t.us is not None]
    if not timed:
        raise MdslError("autotune: no variant ran correctly on the GPU:\n" + "\n".join(
            f"  {t.variant.describe()}: {t.problem}" for t in timings))
    best = min(timed, key=lambda t: t.us)
    result = TuneResult(candidates[best.variant.candidate], best.variant, best.us, tuple(timings))
    if cache:
        store(key, result, name)
    return result


def _compile_all(variants: Sequence, arch: str) -> None:
    """Each (graph, options)'s CUDA source compiled into the compile cache, in threads (a failure is left
    for the variant's own compile to report)."""
    from mdsl.backend.cuda.nvrtc import compile_cuda

    def compile_one(variant) -> None:
        graph, options = variant
        try:
            compile_cuda(emit_cuda(graph, arch=arch, options=options).source, arch=arch)
        except MdslError:
            pass

    if len(variants) > 1:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(variants), os.cpu_count() or 1)) as pool:
            list(pool.map(compile_one, variants))


def _inputs(graph: KernelGraph, seed: int) -> list:
    """The check's inputs: the verifier's float test's (standard normal draws, as the dtype holds them)."""
    from mdsl.passes.float_check import float_inputs

    return float_inputs(tuple(graph.inputs), np.random.default_rng(seed).bit_generator.state, 1.0)


@attrs.frozen(eq=False)
class Expected:
    """What a variant's outputs are checked against, as the verifier's float test checks a candidate: the
    program's float64 outputs, the elements judged (`float_check.judged_elements`: where the program as
    written is finite in float64 and at its own precision, and not within the error bound of the dtype's
    overflow; standard normal inputs overflow a long f16 chain, and there no result is wrong) and each
    output's bound (the dtype's tolerance, or ORIGINAL_SLACK times the program's own error)."""

    reference: list
    judged: list
    bounds: list

    def problem(self, got: Sequence) -> Optional[str]:
        """Why `got` is wrong, or None."""
        from mdsl.passes.float_check import rel_error

        for k, (g, ref, where, bound) in enumerate(zip(got, self.reference, self.judged, self.bounds)):
            error = rel_error(np.asarray(g, dtype=np.float64), ref, where)
            if not error <= bound:
                return f"wrong output: output {k} has relative error {error:.2e} over {bound:.0e}"
        return None


def _reference(graph: KernelGraph, host: list) -> Expected:
    from mdsl.backend.reference import run_kernel_graph
    from mdsl.passes.float_check import ORIGINAL_SLACK, judged_elements, rel_error

    with np.errstate(all="ignore"):   # an overflow of the program's own is what `judged` leaves out
        reference = [np.asarray(r, dtype=np.float64) for r in run_kernel_graph(graph, host, precision="float64")]
        own = run_kernel_graph(graph, host, precision="float32", round_storage=True)
    judged = [judged_elements(ref, mine, var.dtype) for ref, mine, var in zip(reference, own, graph.outputs)]
    bounds = [max(tolerance(graph), ORIGINAL_SLACK * rel_error(np.asarray(mine, dtype=np.float64), ref, where))
              for ref, mine, where in zip(reference, own, judged)]
    return Expected(reference, judged, bounds)


def tolerance(graph: KernelGraph) -> float:
    dtypes = {v.dtype.name for v in (*graph.inputs, *graph.outputs)}
    return max((_TOLERANCE.get(d, _TOLERANCE["f32"]) for d in dtypes), default=_TOLERANCE["f32"])


def rotation_sets(call_bytes: int, l2_bytes: int, cap_bytes: int = 2**30, most: int = 64) -> int:
    """How many copies of a call's inputs the timing rotates over: enough that a copy has left L2 (twice
    its size) before its turn comes again, at most `most` and `cap_bytes` in all, at least one."""
    call_bytes = max(1, call_bytes)
    return max(1, min(most, -(-2 * l2_bytes // call_bytes), cap_bytes // call_bytes))


def _rotated_inputs(graph: KernelGraph, host: list, device: int) -> list:
    """Copies of the program's inputs on the GPU (`rotation_sets` of them), each a list of DeviceArrays."""
    from mdsl.backend.cuda import runtime

    call_bytes = sum(v.type.nbytes for v in graph.inputs)
    return [[runtime.DeviceArray.from_numpy(x, v.dtype, device=device) for x, v in zip(host, graph.inputs)]
            for _ in range(rotation_sets(call_bytes, runtime.l2_bytes(device)))]


def _measure(graph, variant: Variant, host, want, rotated: list, arch: str, device: int, samples: int,
             calls: int, checked: bool = False) -> Timing:
    """Checked on fresh inputs (the checked call), then timed over the rotated copies in turn: through the
    unchecked launch (`run_pointers`, as the kernel benchmark launches), or with `checked` the call a kernel
    repeats (`mdsl.gpu.calls.PreparedCall`: its host time counts, so a program of library GEMMs, each a
    library call, or of kernels launched one by one costs what it costs a user, where a program of own
    kernels launches as one CUDA graph)."""
    from mdsl.backend.cuda import runtime

    executable = None
    try:
        executable = runtime.compile_graph(graph, arch=arch, device=device, options=variant.options)
        inputs = [runtime.DeviceArray.from_numpy(x, v.dtype, device=device) for x, v in zip(host, graph.inputs)]
        outputs = executable(inputs)
        problem = want.problem([o.to_numpy() for o in outputs])
        if problem:
            return Timing(variant, None, problem)
        turn = itertools.count()
        if checked:   # as a kernel's repeated call runs it: the call prepared for the arguments' signature
            prepared = PreparedCall.of(executable, rotated[0], outputs, stream_given=False, torch_outputs=False)

            def call():
                args = rotated[next(turn) % len(rotated)]
                if prepared is None or prepared(args, outputs) is None:
                    executable(args, outputs)

            return Timing(variant, _median_us(call, samples, calls, warm=2 * len(rotated)))
        pointers = [[a.ptr for a in copy] for copy in rotated]
        out = [o.ptr for o in outputs]
        return Timing(variant, _median_us(lambda: executable.run_pointers(pointers[next(turn) % len(pointers)], out, 0),
                                          samples, calls, warm=2 * len(rotated)))
    except MdslError as e:
        return Timing(variant, None, f"failed: {e}")
    finally:   # (the chosen variant is compiled again from the cubin cache: each timed one is freed here)
        if executable is not None:
            executable.close()


def _median_us(call, samples: int, calls: int, warm: int = 0) -> float:
    """Median over `samples` of the time per call of `calls` back-to-back calls (CUDA events on the
    legacy default stream, where the calls launch), after at least `warm` calls of warm-up (each rotated set
    of inputs twice: an executable with cuBLAS GEMMs captures a set's graph at its second run, as a repeated
    call reaches its steady state)."""
    from cuda.bindings import driver

    from mdsl.backend.cuda.check import _ok

    for _ in range(max(3, calls, warm)):
        call()
    start, end = _ok(driver.cuEventCreate(0)), _ok(driver.cuEventCreate(0))
    try:
        times = []
        for _ in range(samples):
            _ok(driver.cuEventRecord(start, 0))
            for _ in range(calls):
                call()
            _ok(driver.cuEventRecord(end, 0))
            _ok(driver.cuEventSynchronize(end))
            times.append(_ok(driver.cuEventElapsedTime(start, end)) * 1e3 / calls)
        return statistics.median(times)
    finally:
        driver.cuEventDestroy(start)
        driver.cuEventDestroy(end)


def _device_name(device: int) -> str:
    from cuda.bindings import driver

    from mdsl.backend.cuda.check import _ok

    raw = _ok(driver.cuDeviceGetName(64, _ok(driver.cuDeviceGet(device))))
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m mdsl.backend.cuda.autotune [PLAN.json ...]`: tune the given plan cache entries (default:
    every entry under $MDSL_CACHE_DIR/plans) on GPU 0 and print each one's variants, fastest first."""
    import argparse

    from mdsl.backend.cuda import runtime
    from mdsl.search.cache import PlanCache, default_dir

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("entries", nargs="*", type=Path)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--candidates", type=int, default=3, help="the plan's best candidates tuned")
    parser.add_argument("--variants", type=int, default=8, help="stored tuning variants tuned besides them")
    parser.add_argument("--no-cache", dest="cache", action="store_false")
    args = parser.parse_args(argv)
    if not runtime.has_gpu():
        print("autotune: no GPU on this machine")
        return 2
    for path in args.entries or sorted((default_dir() / "plans").glob("*.json")):
        cache = PlanCache(path.parent.parent)
        plan = cache.load_key(path.stem)   # checked as every read of the cache is (a failing entry warns)
        if plan is None:
            print(f"== {path.name}: skipped, not a plan cache entry that passes its checks")
            continue
        todo = tuning_set(plan, args.candidates, args.variants, cache)
        result = autotune(todo.graphs, plan.original, spaces=todo.spaces, names=todo.names, samples=args.samples,
                          cache=args.cache)
        print(f"== {plan.original.name} ({path.name})", *result.lines(), sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

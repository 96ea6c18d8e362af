"""What the GPU tests share: fresh inputs, the reference, the run on the GPU and a failure report that
explains itself (the person who reads it may have nothing but the log).

Method: fresh random inputs every run (never zeros), rounded to each
input's dtype; the reference is mdsl's interpreter in float64 on those same rounded inputs, storing
every kernel-level tensor rounded to its dtype as the GPU does (so only in-kernel arithmetic may
differ); outputs are poisoned with NaN before the run; ‖gpu − ref‖ / ‖ref‖ must be within the dtype's
tolerance and NaN never passes; a value past the dtype's range (an infinity where it is stored) must be one
on both sides (`mismatches`).
"""
from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pytest

from mdsl import gpu as runtime
from mdsl.backend.reference import run_kernel_graph
from mdsl.ir.dtypes import DType, bf16, f16, i32
from mdsl.ir.graph import BlockGraph, KernelGraph, Node, ThreadGraph
from mdsl.ir.text import print_graph
from mdsl.ir.types import Var

TOLERANCES = {"f32": 1e-4, "f16": 3e-3, "bf16": 1e-2}
TF32_TOLERANCE = 1e-3   # f32 matrix products may run on tensor cores in tf32

#: The run's seed: fresh for each run unless MDSL_GPU_SEED repeats one (every report prints it).
SEED = int(os.environ.get("MDSL_GPU_SEED") or secrets.randbits(31))
#: Where failing programs are written (scripts/gpu_check.sh sets it); none: not written.
ARTIFACTS = os.environ.get("MDSL_GPU_ARTIFACTS")
#: The code generator `build` compiles with (conftest's `gpu_backend` fixture sets it per test).
BACKEND = "cuda"
_I32_POISON = -(2**31) + 7


def rng_for(test_id: str) -> np.random.Generator:
    """A generator per test, derived from the run's seed, so that one seed reproduces one test."""
    digest = hashlib.sha256(f"{SEED}:{test_id}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "big"))


# ---------------------------------------------------------------------------------------------
# graphs

def kernel_values(graph: KernelGraph) -> list:
    return list(graph.inputs) + [v for n in graph.nodes for v in n.outputs]


def _ops(graph) -> set:
    ops = set()
    for n in graph.nodes:
        ops.add(n.op)
        if n.body is not None:
            ops |= _ops(n.body)
    return ops


def tolerance(graph: KernelGraph) -> float:
    """The loosest tolerance among the graph's float dtypes (tf32's for f32 graphs with a matmul)."""
    names = {v.dtype.name for v in kernel_values(graph) if v.dtype.is_float}
    tol = max(TOLERANCES[n] for n in names) if names else 0.0
    return TF32_TOLERANCE if tol == TOLERANCES["f32"] and "matmul" in _ops(graph) else tol


def with_dtype(graph: KernelGraph, old: DType, new: DType) -> KernelGraph:
    """The same program with every `old` tensor (and cast target) made `new`, at every level."""

    def var(v: Var) -> Var:
        return Var(v.name, v.type.with_dtype(new)) if v.dtype is old else v

    def node(n: Node) -> Node:
        attrs_ = tuple((k, new if a is old else a) for k, a in n.attrs)
        return Node(n.op, [var(v) for v in n.inputs], [var(v) for v in n.outputs], attrs_, body(n.body), n.loc)

    def body(b):
        if isinstance(b, BlockGraph):
            return BlockGraph(b.grid, b.threads, b.forloop, [type(i)(var(i.var), i.imap, i.fmap) for i in b.inputs],
                              [node(n) for n in b.nodes], [type(o)(var(o.var), o.omap) for o in b.outputs])
        if isinstance(b, ThreadGraph):
            return ThreadGraph([var(v) for v in b.inputs], [node(n) for n in b.nodes], [var(v) for v in b.outputs])
        return b

    return KernelGraph(graph.name, [var(v) for v in graph.inputs], [node(n) for n in graph.nodes],
                       [var(v) for v in graph.outputs])


# ---------------------------------------------------------------------------------------------
# inputs and the reference

def random_inputs(graph: KernelGraph, rng: np.random.Generator, positive: Sequence[int] = ()) -> list:
    """Fresh inputs whose values each input's dtype holds exactly (float32 arrays; i32: int32):
    standard normal, or |N(0,1)| + 0.5 for the inputs in `positive` (operands of sqrt, rsqrt,
    fractional powers and divisors)."""
    inputs = []
    for k, v in enumerate(graph.inputs):
        if v.dtype is i32:
            inputs.append(rng.integers(-1000, 1000, v.shape, dtype=np.int32))
            continue
        x = rng.standard_normal(v.shape, dtype=np.float32)
        if k in positive:
            x = np.abs(x) + np.float32(0.5)
        if v.dtype is f16:
            x = x.astype(np.float16).astype(np.float32)
        elif v.dtype is bf16:
            x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)   # truncated: exact in bf16
        inputs.append(x)
    return inputs


def reference(graph: KernelGraph, inputs: Sequence[np.ndarray]) -> list:
    return run_kernel_graph(graph, inputs, precision="float64", round_storage=True)


# ---------------------------------------------------------------------------------------------
# running on the GPU

def upload(values: Sequence[np.ndarray], graph: KernelGraph) -> list:
    return [runtime.DeviceArray.from_numpy(x, v.dtype) for x, v in zip(values, graph.inputs)]


def poisoned(graph: KernelGraph) -> list:
    """One output array per graph output, filled with NaN (i32: an unlikely value)."""
    return [runtime.DeviceArray.from_numpy(np.full(v.shape, _I32_POISON if v.dtype is i32 else np.nan), v.dtype)
            for v in graph.outputs]


def build(graph: KernelGraph, what: str) -> runtime.Executable:
    """Emit, compile and load; a failure names the stage and shows the program."""
    try:
        return runtime.compile_graph(graph, backend=BACKEND)
    except Exception as e:
        pytest.fail(f"{what}: could not build the GPU program with the {BACKEND} backend ({type(e).__name__}):\n{e}\n\n"
                    f"the mugraph:\n{print_graph(graph)}", pytrace=False)


def run(executable: runtime.Executable, inputs: Sequence[np.ndarray]) -> list:
    """Inputs uploaded, outputs poisoned, the program run, the outputs read back as float64."""
    graph = executable.graph
    outputs = poisoned(graph)
    executable(upload(inputs, graph), outputs)
    return [o.to_numpy().astype(np.float64) for o in outputs]


def check_graph(graph: KernelGraph, test_id: str, *, positive: Sequence[int] = (), what: Optional[str] = None,
                tol: Optional[float] = None) -> runtime.Executable:
    """Run `graph` on the GPU on fresh inputs and compare every output with the reference; the executable."""
    what = what or f"{graph.name} [{test_id}]"
    inputs = random_inputs(graph, rng_for(test_id), positive)
    want = reference(graph, inputs)
    if any(np.isnan(w).any() for w in want):
        pytest.fail(f"{what}: the reference itself has NaN: the test's inputs are outside the program's domain "
                    f"(a test bug, not a GPU one)\n{print_graph(graph)}", pytrace=False)
    executable = build(graph, what)
    got = run(executable, inputs)
    compare(executable, got, want, tol if tol is not None else tolerance(graph), what)
    return executable


# ---------------------------------------------------------------------------------------------
# comparison and the report

def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    norm = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / norm) if norm else float(np.linalg.norm(got))


def mismatches(got: np.ndarray, want: np.ndarray, dtype: DType, tol: float) -> tuple:
    """(relative error over the elements finite on both sides, the elements that fail, a summary or None).
    NaN never passes. An infinity (a value past the dtype's range, rounded as it is stored) passes where the
    other side has the same sign and is an infinity too or within 10 x tol of the dtype's largest finite
    value (so rounding just below or past the edge on either side counts as agreement); elsewhere it fails."""
    want = np.asarray(want, dtype=np.float64)
    nan = np.isnan(got)
    finite = np.isfinite(got) & np.isfinite(want)
    infinite = ~nan & ~finite
    edge = (1.0 - 10 * tol) * dtype.largest
    agreeing = infinite & (np.sign(got) == np.sign(want)) & (np.minimum(np.abs(got), np.abs(want)) >= edge)
    err = relative_error(np.where(finite, got, 0.0), np.where(finite, want, 0.0))
    if not (nan.any() or (infinite & ~agreeing).any() or not err <= tol):
        return err, np.zeros(got.shape, dtype=bool), None
    scale = max(float(np.sqrt(np.mean(np.where(finite, want, 0.0) ** 2))), 1e-30)
    gap = np.abs(np.where(finite, got, 0.0) - np.where(finite, want, 0.0))
    bad = nan | (infinite & ~agreeing) | (finite & (gap > tol * scale * 10))
    summary = (f"relative error ‖gpu − ref‖/‖ref‖ = {err:.3e} (tolerance {tol:.0e} for this graph's dtypes"
               + (f", over the {int(finite.sum())} elements finite on both sides" if not finite.all() else "") + ")"
               + (f"; {int(nan.sum())} of {got.size} elements are NaN: never written (outputs are poisoned "
                  "with NaN before the run) or computed as NaN" if nan.any() else "")
               + (f"; {int((infinite & ~agreeing).sum())} elements infinite on one side only (past the {dtype} "
                  "range on the GPU or in the reference, not both)" if (infinite & ~agreeing).any() else "")
               + (f"; {int(agreeing.sum())} elements past the {dtype} range on both sides, as equal"
                  if agreeing.any() else ""))
    return err, bad, summary


def compare(executable: runtime.Executable, got: Sequence, want: Sequence, tol: float, what: str) -> None:
    problems = []
    for k, (g, w, var) in enumerate(zip(got, want, executable.graph.outputs)):
        w = np.asarray(w, dtype=np.float64)
        if var.dtype is i32:
            bad = g != w
            if bad.any():
                problems.append(_describe(k, var, g, w, bad, f"{int(bad.sum())} of {g.size} integers differ"))
            continue
        _, bad, summary = mismatches(g, w, var.dtype, tol)
        if summary is not None:
            problems.append(_describe(k, var, g, w, bad, summary))
    if problems:
        pytest.fail(_report(executable, what, problems), pytrace=False)


def _describe(k: int, var: Var, got: np.ndarray, want: np.ndarray, bad: np.ndarray, summary: str) -> str:
    lines = [f"output {k} %{var.name} {var.type}: {summary}"]
    where = np.argwhere(bad)
    if len(where):
        lines.append(f"  {len(where)} of {got.size} elements are off by more than 10 x tolerance x rms(ref); "
                     f"their indices span " + ", ".join(f"dim {d}: {lo}..{hi}" for d, (lo, hi)
                                                        in enumerate(zip(where.min(0), where.max(0))))
                     + f" (shape {list(got.shape)})")
        for idx in where[:6]:
            i = tuple(int(j) for j in idx)
            lines.append(f"  at {list(i)}: gpu {got[i]:.6g}, reference {want[i]:.6g}")
    return "\n".join(lines)


def _report(executable: runtime.Executable, what: str, problems: list) -> str:
    program = executable.program
    launches = "\n".join(f"  {l.name}: grid {tuple(l.grid)}, block {tuple(l.block)}, {l.smem_bytes} B dynamic smem, "
                         f"args {', '.join(l.args)}" for l in program.launches)
    saved = _save(executable, what)
    return "\n".join([
        f"{what}: the GPU result ({BACKEND} backend) differs from the reference interpreter (float64 on the same "
        f"rounded inputs, tensors stored rounded to their dtypes)",
        *problems,
        f"seed {SEED}: rerun this test with MDSL_GPU_SEED={SEED} to get the same inputs",
        f"launches:\n{launches}",
        f"compiler: {getattr(executable.module, 'resources', '')}",
        f"CUDA source: {saved or 'set MDSL_GPU_ARTIFACTS=<dir> to have it written'}",
        f"the mugraph as compiled:\n{print_graph(executable.graph)}",
    ])


def _save(executable: runtime.Executable, what: str) -> Optional[str]:
    if not ARTIFACTS:
        return None
    folder = Path(ARTIFACTS)
    folder.mkdir(parents=True, exist_ok=True)
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in what)[:120]
    path = folder / f"{stem}.{'ll' if BACKEND == 'ptx' else 'cu'}"   # the PTX backend's source is LLVM IR
    path.write_text(f"// {what}\n/* the mugraph:\n{print_graph(executable.graph)}\n*/\n{executable.program.source}")
    if BACKEND == "ptx":
        path.with_suffix(".ptx").write_text(executable.module.ptx)
    return str(path)

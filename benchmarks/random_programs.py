"""The superoptimizer on programs it has never seen: random programs drawn from the operator registry.

    python benchmarks/random_programs.py --seed 0 [--count 100] [--budget 120] [--workers 2] [--out DIR]
    python benchmarks/random_programs.py --seed 0 --count 20 --budget 20          # a quick sample
    python benchmarks/random_programs.py --seed 0 --count 30 --gpu                # on a GPU: time them too
    python benchmarks/random_programs.py --merge A/random_programs.json B/random_programs.json --out DIR
                                                                   # parts of one run (--first, --count) as one

Each program (`draw(seed, index)`: the seed and its index decide it, nothing else) is a chain or DAG of
3 to 12 registry operators over the shapes of an LLM layer (rows 1-64, hidden 1,024-8,192, f16):
matmuls (one input's several products among them: q/k/v, gate/up), the registry's element-wise
operators (unary, with a scalar, binary against a bias, a gate or another value), reductions to a
per-row scalar that scales a later value, rms_norm, layer norm and softmax (as mdsl composes them),
and layout changes (split, concat, a reshape or a transpose and back). It is written as the Python a
user would write (`RandomProgram.source`), traced by `@mdsl.kernel`, and searched cold
(`kernel.optimize` with a plan cache of its own) under `--budget` seconds (the cap) and `--work` (the
work budget, default the search's).

Reported per program: kernels before and after, estimated time before and after (the cost model),
search seconds, whether the plan is provisional (the cap cut its search short), and a float check of
the plan independent of the search's (fresh inputs with weights scaled as a layer's: the plan in
float32 with every tensor stored in f16 against the original in float64, held to the verifier's
bounds, `mdsl.passes.verify.FLOAT_BOUNDS` or `ORIGINAL_SLACK` times the original's own error). Then
the fraction fused (fewer kernels than the original), a histogram of kernels removed, the reasons the
plans' kernel boundaries give (`Plan.explain`), and how many searches ran past their cap by more
than 5 s. Writes random_programs.json (rows and run metadata, `provenance.py`) and random_programs.md
under --out (default $OUT, else ./bench_out).

GPU columns (`--gpu`, where torch sees a GPU): `measure_on_gpu` times each program as a user calls it,
`kernel(*torch_cuda_tensors)` through the public call path with the plan from the plan cache (so
search with the default --budget and --work, which the call path's config has, and carry --cache),
inputs rotated over sets larger than twice the L2, against PyTorch eager, eager captured in a CUDA
graph and torch.compile, after checking every contender's output against the float64 reference, once every
program's search is done, in passes over the programs (PASSES: no contender is timed in a process that another's
torch.compile or profiler has slowed).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import attrs
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # run as a script from anywhere, with or without mdsl installed
    sys.path.insert(0, str(ROOT))

from benchmarks.provenance import provenance  # noqa: E402 - needs ROOT on sys.path

SCHEMA = 1
ROWS = (1, 2, 4, 8, 16, 32, 64)
HIDDEN = (1024, 2048, 4096, 8192)
EXPERTS = 8                    # a router's outputs: a softmax over a few experts
OVER_CAP_S = 5.0               # a search may end this much after its cap (the acceptance's allowance)
MIN_OPS, MAX_OPS = 3, 12
#: Unary element-wise operators whose inputs may be any real (sqrt, rsqrt and reciprocal are not drawn:
#: normal inputs make them NaN or unbounded, in the program as in its plans).
UNDEFINED_SOMEWHERE = frozenset({"sqrt", "rsqrt", "reciprocal"})


# ---------------------------------------------------------------------------------------------
# drawing programs

@attrs.frozen
class Value:
    name: str
    shape: tuple


@attrs.frozen
class Step:
    """One operator application: `kind` names how it is written (see `_MDSL` and `_TORCH`)."""

    kind: str
    args: tuple          # value names
    outs: tuple          # value names
    params: tuple = ()   # (name, value) pairs


@attrs.define
class RandomProgram:
    name: str
    rows: int
    inputs: list = attrs.field(factory=list)    # Value, with a role in `roles`
    roles: dict = attrs.field(factory=dict)     # input name -> "activation" | "weight" | "bias" | "gate"
    steps: list = attrs.field(factory=list)
    outputs: list = attrs.field(factory=list)
    shapes: dict = attrs.field(factory=dict)    # value name -> shape
    ops: int = 0                                # registry operators the steps trace into

    # -- building ------------------------------------------------------------------------------

    def input(self, shape: tuple, role: str) -> str:
        prefix = {"activation": "x", "weight": "w", "bias": "b", "gate": "g"}[role]
        name = f"{prefix}{sum(1 for r in self.roles.values() if r == role)}"
        self.inputs.append(Value(name, tuple(shape)))
        self.roles[name] = role
        self.shapes[name] = tuple(shape)
        return name

    def add(self, kind: str, args: Sequence[str], out_shapes: Sequence[tuple], ops: int, **params) -> list:
        outs = [f"v{len(self.shapes) - len(self.inputs) + k}" for k in range(len(out_shapes))]
        for o, s in zip(outs, out_shapes):
            self.shapes[o] = tuple(s)
        self.steps.append(Step(kind, tuple(args), tuple(outs), tuple(sorted(params.items()))))
        self.ops += ops
        return outs

    # -- writing -------------------------------------------------------------------------------

    def source(self) -> str:
        """The program as the Python a user writes: one @mdsl.kernel function."""
        params = ", ".join(f"{v.name}: Tensor[{', '.join(map(str, v.shape))}, f16]" for v in self.inputs)
        lines = ["import mdsl", "from mdsl import Tensor, f16", "", "",
                 f"@mdsl.kernel(name={self.name!r})", f"def program({params}):"]
        for step in self.steps:
            lines.append(f"    {', '.join(step.outs)} = {_MDSL[step.kind](step)}")
        lines.append(f"    return {', '.join(self.outputs)}")
        return "\n".join(lines) + "\n"

    def torch_source(self) -> str:
        """The same program in PyTorch (the GPU baselines)."""
        lines = ["import torch", "import torch.nn.functional as F", "", "",
                 f"def program({', '.join(v.name for v in self.inputs)}):"]
        for step in self.steps:
            lines.append(f"    {', '.join(step.outs)} = {_TORCH[step.kind](step)}")
        lines.append(f"    return {', '.join(self.outputs)}{',' if len(self.outputs) == 1 else ''}")
        return "\n".join(lines) + "\n"

    def kernel(self):
        """The traced @mdsl.kernel function (its source is registered with linecache, so that the IR's
        source locations and tracebacks show it)."""
        import linecache

        filename = f"<random program {self.name}>"
        text = self.source()
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        scope: dict = {}
        exec(compile(text, filename, "exec"), scope)   # noqa: S102 - the benchmark's own generated program
        return scope["program"]


def _args(step: Step) -> list:
    return list(step.args)


def _param(step: Step, name: str):
    return dict(step.params)[name]


_MDSL = {
    "matmul": lambda s: f"{s.args[0]} @ {s.args[1]}",
    "unary": lambda s: f"mdsl.{_param(s, 'op')}({s.args[0]})",
    "mul_scalar": lambda s: f"{s.args[0]} * {_param(s, 'value')!r}",
    "add_scalar": lambda s: f"{s.args[0]} + {_param(s, 'value')!r}",
    "binary": lambda s: f"{s.args[0]} {_param(s, 'symbol')} {s.args[1]}",
    "reduce": lambda s: f"mdsl.{_param(s, 'op')}({s.args[0]}, dim=-1, keepdim=True)",
    "rms_norm": lambda s: f"mdsl.rms_norm({s.args[0]}, eps={_param(s, 'eps')!r})",
    "softmax": lambda s: f"mdsl.softmax({s.args[0]}, dim=-1)",
    "layer_norm": lambda s: (f"(_{s.outs[0]} := {s.args[0]} - mdsl.mean({s.args[0]}, dim=-1, keepdim=True)) * "
                             f"mdsl.rsqrt(mdsl.mean(mdsl.square(_{s.outs[0]}), dim=-1, keepdim=True) + "
                             f"{_param(s, 'eps')!r})"),
    "split": lambda s: f"mdsl.split({s.args[0]}, {list(_param(s, 'sizes'))}, dim=-1)",
    "concat": lambda s: f"mdsl.concat([{', '.join(s.args)}], dim=-1)",
    "reshape": lambda s: f"mdsl.reshape({s.args[0]}, {', '.join(map(str, _param(s, 'shape')))})",
    "transpose": lambda s: f"mdsl.transpose({s.args[0]}, 0, 1)",
}

_TORCH_UNARY = {"exp": "torch.exp({})", "silu": "F.silu({})", "gelu": "F.gelu({})", "relu": "torch.relu({})",
                "sigmoid": "torch.sigmoid({})", "square": "{0} * {0}", "neg": "-{}"}

_TORCH = {
    "matmul": lambda s: f"{s.args[0]} @ {s.args[1]}",
    "unary": lambda s: _TORCH_UNARY[_param(s, "op")].format(s.args[0]),
    "mul_scalar": lambda s: f"{s.args[0]} * {_param(s, 'value')!r}",
    "add_scalar": lambda s: f"{s.args[0]} + {_param(s, 'value')!r}",
    "binary": lambda s: f"{s.args[0]} {_param(s, 'symbol')} {s.args[1]}",
    "reduce": lambda s: f"{s.args[0]}.{ {'sum': 'sum', 'mean': 'mean', 'max': 'amax'}[_param(s, 'op')] }(-1, keepdim=True)",
    "rms_norm": lambda s: f"{s.args[0]} * torch.rsqrt({s.args[0]}.square().mean(-1, keepdim=True) + {_param(s, 'eps')!r})",
    "softmax": lambda s: f"torch.softmax({s.args[0]}, dim=-1)",
    "layer_norm": lambda s: f"F.layer_norm({s.args[0]}, ({s.args[0]}.shape[-1],), eps={_param(s, 'eps')!r})",
    "split": lambda s: f"torch.split({s.args[0]}, {list(_param(s, 'sizes'))}, dim=-1)",
    "concat": lambda s: f"torch.cat([{', '.join(s.args)}], dim=-1)",
    "reshape": lambda s: f"{s.args[0]}.reshape({', '.join(map(str, _param(s, 'shape')))})",
    "transpose": lambda s: f"{s.args[0]}.transpose(0, 1)",
}


def _unary_ops() -> list:
    """The registry's element-wise operators of one operand and no attributes, defined on every real."""
    from mdsl.ir.ops import unary_operator_names

    return [n for n in unary_operator_names() if n not in UNDEFINED_SOMEWHERE and n in _TORCH_UNARY]


class _Drawer:
    """Draws one program: steps until it has 3 to 12 operators, on values of shape [rows, d]."""

    # how often each kind of step is drawn (a composite counts its operators against the limit)
    KINDS = {"matmul": 6, "products": 2, "unary": 4, "scalar": 2, "binary": 4, "rowscale": 2, "rms_norm": 2,
             "layer_norm": 1, "softmax": 2, "router": 1, "split": 1, "concat": 1, "reshape": 1, "transpose": 1}
    OPS = {"matmul": 1, "products": 2, "unary": 1, "scalar": 1, "binary": 1, "rowscale": 2, "rms_norm": 1,
           "layer_norm": 7, "softmax": 5, "router": 8, "split": 1, "concat": 1, "reshape": 3, "transpose": 3}

    def __init__(self, seed: int, index: int, rows: Sequence[int] = ROWS, hidden: Sequence[int] = HIDDEN):
        self.rng = np.random.default_rng([seed, index])
        self.hidden = tuple(hidden)
        rows = int(self.rng.choice(rows))
        self.p = RandomProgram(f"random_s{seed}_{index}", rows)
        self.target = int(self.rng.integers(MIN_OPS, MAX_OPS + 1))
        self.unary = _unary_ops()
        self.consumed: set = set()
        self.live = [self.p.input((rows, int(self.rng.choice(self.hidden))), "activation")]

    def draw(self) -> RandomProgram:
        tries = 0
        while self.p.ops < self.target and tries < 200:
            tries += 1
            kinds = [k for k in self.KINDS if self.p.ops + self.OPS[k] <= self.target]
            weights = np.array([self.KINDS[k] for k in kinds], dtype=float)
            kind = str(self.rng.choice(kinds, p=weights / weights.sum()))
            getattr(self, f"_{kind}")()
        leaves = [v for v in self.p.shapes if v.startswith("v") and v not in self.consumed]
        self.p.outputs = leaves or [self.live[-1]]   # every value nothing reads is returned: no dead code
        return self.p

    # -- helpers ---------------------------------------------------------------------------------

    def operand(self) -> str:
        """A live [rows, hidden] value, most often the newest (a chain), sometimes an older one (a DAG)."""
        pool = [v for v in self.live if len(self.p.shapes[v]) == 2 and self.p.shapes[v][1] >= min(self.hidden)]
        if len(pool) > 1 and self.rng.random() < 0.3:
            return pool[int(self.rng.integers(0, len(pool) - 1))]
        return pool[-1]

    def use(self, *names: str) -> None:
        self.consumed.update(names)

    def emit(self, kind: str, args: Sequence[str], shapes: Sequence[tuple], ops: int, **params) -> list:
        self.use(*args)
        outs = self.p.add(kind, args, shapes, ops, **params)
        self.live.extend(outs)
        return outs

    def width(self, v: str) -> int:
        return self.p.shapes[v][-1]

    def out_width(self, d: int) -> int:
        """A matmul's output width: a hidden size, small enough that one weight stays at most 8192 x 8192."""
        return int(self.rng.choice([h for h in self.hidden if h * d <= max(self.hidden) ** 2]))

    # -- kinds of steps ----------------------------------------------------------------------------

    def _matmul(self) -> None:
        x = self.operand()
        d = self.width(x)
        w = self.p.input((d, self.out_width(d)), "weight")
        self.emit("matmul", [x, w], [(self.p.rows, self.p.shapes[w][1])], 1)

    def _products(self) -> None:
        """Independent products of one value (q/k/v, gate/up): horizontal fusion's shape."""
        x = self.operand()
        d = self.width(x)
        for _ in range(2):
            w = self.p.input((d, self.out_width(d)), "weight")
            self.emit("matmul", [x, w], [(self.p.rows, self.p.shapes[w][1])], 1)

    def _unary(self) -> None:
        x = self.operand()
        op = str(self.rng.choice(self.unary))
        self.emit("unary", [x], [self.p.shapes[x]], 1, op=op)

    def _scalar(self) -> None:
        x = self.operand()
        if self.rng.random() < 0.5:
            self.emit("mul_scalar", [x], [self.p.shapes[x]], 1, value=float(self.rng.choice([0.125, 0.5, 2.0, -1.5])))
        else:
            self.emit("add_scalar", [x], [self.p.shapes[x]], 1, value=float(self.rng.choice([0.5, 1.0, -0.25])))

    def _binary(self) -> None:
        x = self.operand()
        shape = self.p.shapes[x]
        same = [v for v in self.live if v != x and self.p.shapes[v] == shape]
        choice = self.rng.random()
        if same and choice < 0.4:
            y = same[-1]
        elif choice < 0.7:
            y = self.p.input((1, shape[-1]), "bias")
        else:
            y = self.p.input(shape, "gate")
        self.emit("binary", [x, y], [shape], 1, symbol=str(self.rng.choice(["+", "-", "*"])))

    def _rowscale(self) -> None:
        """A per-row scalar (a reduction kept as [rows, 1]) scaling a value."""
        x = self.operand()
        (s,) = self.emit("reduce", [x], [(self.p.rows, 1)], 1, op=str(self.rng.choice(["sum", "mean", "max"])))
        y = self.operand()
        self.emit("binary", [y, s], [self.p.shapes[y]], 1, symbol="*")

    def _rms_norm(self) -> None:
        x = self.operand()
        self.emit("rms_norm", [x], [self.p.shapes[x]], 1, eps=1e-6)

    def _layer_norm(self) -> None:
        x = self.operand()
        self.emit("layer_norm", [x], [self.p.shapes[x]], 7, eps=1e-5)

    def _softmax(self) -> None:
        x = self.operand()
        self.emit("softmax", [x], [self.p.shapes[x]], 5)

    def _router(self) -> None:
        """A softmax over a few experts and its largest weight, scaling a value row by row."""
        x = self.operand()
        w = self.p.input((self.width(x), EXPERTS), "weight")
        (logits,) = self.emit("matmul", [x, w], [(self.p.rows, EXPERTS)], 1)
        (probs,) = self.emit("softmax", [logits], [(self.p.rows, EXPERTS)], 5)
        (gate,) = self.emit("reduce", [probs], [(self.p.rows, 1)], 1, op="max")
        self.live = [v for v in self.live if v not in (logits, probs)]
        y = self.operand()
        self.emit("binary", [y, gate], [self.p.shapes[y]], 1, symbol="*")

    def _split(self) -> None:
        x = self.operand()
        d = self.width(x)
        if d >= 2 * min(self.hidden):   # halves of a hidden size at least
            self.emit("split", [x], [(self.p.rows, d // 2)] * 2, 1, sizes=(d // 2, d // 2))

    def _concat(self) -> None:
        x = self.operand()
        others = [v for v in self.live if v != x and len(self.p.shapes[v]) == 2
                  and self.width(v) >= min(self.hidden) and self.width(x) + self.width(v) <= max(self.hidden)]
        if others:
            y = others[-1]
            self.emit("concat", [x, y], [(self.p.rows, self.width(x) + self.width(y))], 1)

    def _reshape(self) -> None:
        """Heads: [rows, d] as [rows, 2, d/2], normalised per head, and back."""
        x = self.operand()
        d = self.width(x)
        (h,) = self.emit("reshape", [x], [(self.p.rows, 2, d // 2)], 1, shape=(self.p.rows, 2, d // 2))
        (n,) = self.emit("rms_norm", [h], [(self.p.rows, 2, d // 2)], 1, eps=1e-6)
        self.live = [v for v in self.live if v not in (h, n)]
        self.emit("reshape", [n], [(self.p.rows, d)], 1, shape=(self.p.rows, d))

    def _transpose(self) -> None:
        x = self.operand()
        rows, d = self.p.shapes[x]
        (t,) = self.emit("transpose", [x], [(d, rows)], 1)
        (s,) = self.emit("mul_scalar", [t], [(d, rows)], 1, value=0.5)
        self.live = [v for v in self.live if v not in (t, s)]
        self.emit("transpose", [s], [(rows, d)], 1)


def draw(seed: int, index: int, rows: Sequence[int] = ROWS, hidden: Sequence[int] = HIDDEN) -> RandomProgram:
    """Program `index` of run `seed`: the same program for the same pair, on any machine. `rows` and
    `hidden` are the sizes drawn from (the tests draw small ones)."""
    return _Drawer(seed, index, rows, hidden).draw()


# ---------------------------------------------------------------------------------------------
# one program: search, check

def float_inputs(program: RandomProgram, graph, seed: int) -> list:
    """Inputs as a layer sees them: activations, biases and gates standard normal, weights scaled by
    1/sqrt(fan-in) (so that values stay of order one through the layer), rounded to f16."""
    from mdsl.ir.dtypes import round_to_dtype

    rng = np.random.default_rng(seed)
    out = []
    for v in graph.inputs:
        draw_ = rng.standard_normal(v.shape)
        if program.roles.get(v.name) == "weight":
            draw_ /= math.sqrt(v.shape[0])
        out.append(round_to_dtype(draw_, v.dtype).astype(np.float32))
    return out


def float_check(plan, inputs: list) -> tuple:
    """(passed, worst relative error, its bound): the plan in float32 with f16 storage against the
    original in float64, each output held to the verifier's bound for its dtype or ORIGINAL_SLACK times
    the original's own error at that precision, over the elements the search's float test judges
    (`mdsl.passes.float_check.judged_elements`); non-finite there fails."""
    from mdsl.backend.reference import run_kernel_graph
    from mdsl.passes.float_check import judged_elements
    from mdsl.passes.verify import FLOAT_BOUNDS, ORIGINAL_SLACK

    with np.errstate(all="ignore"):
        reference = run_kernel_graph(plan.original, inputs, precision="float64")
        own = run_kernel_graph(plan.original, inputs, precision="float32", round_storage=True)
        got = run_kernel_graph(plan.graph, inputs, precision="float32", round_storage=True)
    checks = []
    for var, ref, mine, cand in zip(plan.original.outputs, reference, own, got):
        finite = judged_elements(ref, mine, var.dtype)
        if not np.all(np.isfinite(cand[finite])):
            return False, math.inf, FLOAT_BOUNDS[var.dtype.name]
        scale = max(float(np.linalg.norm(ref[finite])), 1e-300)
        error = float(np.linalg.norm(cand[finite] - ref[finite])) / scale
        own_error = float(np.linalg.norm(mine[finite] - ref[finite])) / scale
        checks.append((error, max(FLOAT_BOUNDS[var.dtype.name], ORIGINAL_SLACK * own_error)))
    error, bound = max(checks, key=lambda eb: eb[0] / eb[1])
    return all(e <= b for e, b in checks), error, bound


def _boundary_kind(reason: str) -> str:
    """A boundary reason's kind, for the summary (its first words, without numbers)."""
    for key, kind in (("layout change", "layout op"), ("shared memory", "shared memory"),
                      ("share no tensor", "independent kernels"), ("faster apart", "cost model: faster apart"),
                      ("different parts", "cost model: other parts cheaper"),
                      ("split loop", "split loop + combine"), ("budget", "budget"), ("time cap", "time cap"),
                      ("reduced instance", "screen failed"), ("not kept", "fused plan not kept"),
                      ("no grid or loop choice", "does not lift"), ("parts of at most", "part too long")):
        if key in reason:
            return kind
    return "other"


def run_one(program: RandomProgram, config, seed: int) -> dict:
    """Search one program cold (the plan cache at $MDSL_CACHE_DIR) and check its plan."""
    kernel = program.kernel()
    graph = kernel.graph
    start = time.perf_counter()
    plan = kernel.optimize(config=config)
    seconds = time.perf_counter() - start
    passed, error, bound = float_check(plan, float_inputs(program, graph, seed))
    before, after = plan.original_cost, plan.cost
    return {
        "program": program.name, "rows": program.rows, "ops": len(graph.nodes),
        "kernels_before": before.launches, "kernels_after": after.launches,
        "estimate_before_us": round(before.seconds * 1e6, 3), "estimate_after_us": round(after.seconds * 1e6, 3),
        "search_s": round(seconds, 2), "over_cap_s": round(max(0.0, seconds - config.budget_s), 2),
        "provisional": plan.provisional, "float_ok": bool(passed), "float_error": error, "float_bound": bound,
        "verified": plan.evidence.describe(), "fused": after.launches < before.launches,
        "boundaries": [b.reason for b in plan.explanation],
        "family": None if plan.family is None else list(plan.family.sizes),
        "plan_digest": plan_digest(plan),
        "source": program.source(),
    }


def plan_digest(plan) -> str:
    """A plan's identity: the hash of its graph's text form (the same plan prints the same text)."""
    import hashlib

    from mdsl.ir.printer import print_graph

    return hashlib.sha256(print_graph(plan.graph).encode()).hexdigest()[:16]


def same_plans(rows: list, other: list) -> dict:
    """The programs of both runs whose searches both finished within the cap (neither provisional), and
    those of them whose plans differ: a search's outcome must not depend on the machine's load."""
    theirs = {r["program"]: r for r in other}
    both = [r for r in rows if r["program"] in theirs and not r["provisional"] and not theirs[r["program"]]["provisional"]]
    return {"compared": len(both),
            "differ": [r["program"] for r in both if r.get("plan_digest") != theirs[r["program"]].get("plan_digest")]}


# ---------------------------------------------------------------------------------------------
# GPU timing (the lead's H200 run): as a user calls the kernel

#: the contenders in the order of the passes over the programs: every program's public call and eager run are timed
#: before any program's CUDA graphs are captured, and those before torch.compile and torch's profiler run, since a
#: process that has run them is slower at torch calls after (on an H100 host, a public call of two outputs took
#: 11.8 µs of host time, and 15.5 µs in the same process once six programs' contenders had run), which would
#: charge other programs' baselines to a program's host time
PASSES = (("mdsl", "eager"), ("cuda_graph", "mdsl_graph"), ("compile",), ("kernels",))


def measure_on_gpu(programs: Sequence[RandomProgram], reps: int = 100, batch: int = 10, l2_bytes: int = 60 * 2**20,
                   compile_baseline: bool = True, progress=None) -> list:
    """Per program, microseconds per call of the plan (`kernel(*tensors)`: the public call path, host time
    included, the plan from the plan cache under the default search config) and of PyTorch eager, eager captured
    in a CUDA graph and torch.compile, each checked first against the float64 reference (a contender whose output
    is off is reported, not timed); the plan replayed in a CUDA graph (its GPU time) and each of its kernels'
    times. Inputs rotate over sets that together exceed twice the L2, a batch of `batch` back-to-back calls
    between two CUDA events per sample, the median of `reps` samples. The contenders are timed in PASSES over
    the programs. `progress(index, pass, out)` is called after each program's pass with what it has so far."""
    outs: list = [{} for _ in programs]
    kernels = [program.kernel() for program in programs]
    for step, names in enumerate(PASSES):
        if names == ("compile",) and not compile_baseline:
            continue
        for index, (program, kernel, out) in enumerate(zip(programs, kernels, outs)):
            bench = _Contenders(program, kernel, l2_bytes, reps, batch)
            for name in names:
                bench.run(name, out)
            out.update(speedups(out, compile_baseline))
            if progress is not None:
                progress(index, step, out)
    return outs


class _Contenders:
    """One program's contenders on the GPU: its input sets, the float64 reference and the timing method."""

    def __init__(self, program: RandomProgram, kernel, l2_bytes: int, reps: int, batch: int):
        import torch

        self.torch, self.kernel, self.reps, self.batch = torch, kernel, reps, batch
        graph = kernel.graph
        scope: dict = {}
        exec(compile(program.torch_source(), f"<torch {program.name}>", "exec"), scope)   # noqa: S102
        self.eager = scope["program"]
        per_call = sum(v.type.nbytes for v in (*graph.inputs, *graph.outputs))
        sets = max(2, min(256, math.ceil(2 * l2_bytes / max(per_call, 1))))
        host = [float_inputs(program, graph, seed) for seed in range(sets)]
        self.device = [[torch.from_numpy(a).to("cuda", torch.float16) for a in inputs] for inputs in host]
        self._first = host[0]

    @functools.cached_property
    def reference(self) -> tuple:
        """(the float64 outputs on the first input set, each output's error bound), made in the passes that check
        a contender only."""
        from mdsl.backend.reference import run_kernel_graph

        graph = self.kernel.graph
        want = run_kernel_graph(graph, self._first, precision="float64")
        return want, _float_bounds(graph, self._first, want)

    def run(self, name: str, out: dict) -> None:
        """Time contender `name` into `out` (as `attempt` records it)."""
        kernel = self.kernel
        if name == "mdsl":
            attempt(out, "mdsl", lambda: self.checked_and_timed(lambda *a: kernel(*a), out, "first_call_s"))
            if kernel.tunings:
                out["mdsl_choice"] = kernel.tunings[-1].variant.describe()
        elif name == "eager":
            attempt(out, "eager", lambda: self.checked_and_timed(self.eager, out))
        elif name == "cuda_graph":
            attempt(out, "cuda_graph", lambda: self.timed(self.graphed(self.eager)))   # (checked as eager)
        elif name == "mdsl_graph":   # where the public call's time goes: the GPU's part
            if out.get("mdsl_us") is not None:
                attempt(out, "mdsl_graph", lambda: self.timed(self.graphed(kernel)))
        elif name == "compile":
            attempt(out, "compile", lambda: self.checked_and_timed(self.torch.compile(self.eager), out))
        elif name == "kernels":   # and each kernel's
            if out.get("mdsl_us") is not None:
                out["mdsl_kernels_us"] = kernel_times(kernel, self.device)
        else:
            raise ValueError(f"no contender {name!r}")

    def correct(self, fn) -> Optional[str]:
        """Why the contender's outputs on the first input set are off (None: within the verifier's
        bound for f16, or the original's own error at that precision times ORIGINAL_SLACK)."""
        with self.torch.no_grad():
            got = fn(*self.device[0])
        got = got if isinstance(got, (tuple, list)) else (got,)
        want, bounds = self.reference
        for g, w, bound in zip(got, want, bounds):
            g = g.float().cpu().numpy().astype(np.float64)
            error = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-300))
            if not np.all(np.isfinite(g[np.isfinite(w)])) or error > bound:
                return f"relative error {error:.2e} over {bound:.1e}"
        return None

    def timed(self, fn) -> float:
        torch, device = self.torch, self.device
        for inputs in device * 2:   # warm-up: every set twice (a call's steady state: mdsl captures a graph for
            fn(*inputs)             # a set of pointers at its second run where cuBLAS runs its GEMMs)
        torch.cuda.synchronize()
        samples = []
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        k = 0
        for _ in range(self.reps):
            start.record()
            for _ in range(self.batch):
                fn(*device[k % len(device)])
                k += 1
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) * 1e3 / self.batch)
        return statistics.median(samples)

    def graphed(self, fn):
        torch = self.torch
        graphs = []
        for inputs in self.device:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn(*inputs)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(*inputs)
            graphs.append(g)
        index = {id(inputs[0]): i for i, inputs in enumerate(self.device)}
        return lambda *inputs: graphs[index[id(inputs[0])]].replay()

    def checked_and_timed(self, fn, out: dict, first_call: Optional[str] = None) -> float:
        start = time.perf_counter()
        problem = self.correct(fn)
        if first_call:   # the first call's seconds: mdsl's compiles, and tunes where it does (kernel.tunings)
            out[first_call] = round(time.perf_counter() - start, 2)
        if problem:
            raise ContenderError(problem)
        return self.timed(fn)


class ContenderError(Exception):
    """A contender's output is off (the reason is the message)."""


def attempt(out: dict, name: str, run) -> None:
    """out[name + "_us"]: what `run()` measures, or None with out[name + "_error"] saying why it could not (its
    output is off, it raised: a capture the driver refused, a compile that failed): one contender's failure is
    the program's row, not the end of the run."""
    try:
        out[f"{name}_us"] = run()
    except ContenderError as e:
        out[f"{name}_us"], out[f"{name}_error"] = None, str(e)
    except Exception as e:   # noqa: BLE001 (reported in the row)
        out[f"{name}_us"], out[f"{name}_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"


def speedups(out: dict, compile_baseline: bool = True) -> dict:
    """mdsl's speed-up over the best PyTorch baseline and over eager, where mdsl and every baseline the run times
    were measured: against the baselines that happened to run, a failed one (possibly the fastest) would flatter
    mdsl. None otherwise (the summary counts such programs as not compared)."""
    names = ("eager", "cuda_graph") + (("compile",) if compile_baseline else ())
    baselines = [out.get(f"{name}_us") for name in names]
    if not out.get("mdsl_us") or not all(baselines):
        return {"speedup_vs_best": None, "speedup_vs_eager": None}
    return {"speedup_vs_best": min(baselines) / out["mdsl_us"], "speedup_vs_eager": out["eager_us"] / out["mdsl_us"]}


def kernel_times(kernel, device: list, calls: int = 20) -> dict:
    """GPU microseconds per call of each kernel a call of `kernel` launches (torch's profiler, by kernel
    name), over `calls` calls on the rotated input sets."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(calls):
            kernel(*device[k % len(device)])
        torch.cuda.synchronize()
    out = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total:
            out[event.key[:80]] = round(total / calls, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _float_bounds(graph, inputs: list, reference: list) -> list:
    """Per output, the relative error a correct implementation may have in f16: the verifier's bound for
    the dtype, or ORIGINAL_SLACK times the program's own error run in float32 with f16 storage."""
    from mdsl.backend.reference import run_kernel_graph
    from mdsl.passes.verify import FLOAT_BOUNDS, ORIGINAL_SLACK

    with np.errstate(all="ignore"):
        own = run_kernel_graph(graph, inputs, precision="float32", round_storage=True)
    out = []
    for var, mine, ref in zip(graph.outputs, own, reference):
        finite = np.isfinite(ref) & np.isfinite(mine)
        error = float(np.linalg.norm(mine[finite] - ref[finite]) / max(np.linalg.norm(ref[finite]), 1e-300))
        out.append(max(FLOAT_BOUNDS[var.dtype.name], ORIGINAL_SLACK * error))
    return out


def _gpu_present() -> bool:
    try:
        import torch
    except ModuleNotFoundError:
        return False
    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------
# the run

def summarise(rows: list, budget_s: float) -> dict:
    n = len(rows)
    removed = Counter(r["kernels_before"] - r["kernels_after"] for r in rows)
    reasons = Counter(_boundary_kind(b) for r in rows for b in r["boundaries"])
    summary = {
        "programs": n, "fused": sum(r["fused"] for r in rows),
        "fused_fraction": round(sum(r["fused"] for r in rows) / n, 3) if n else None,
        "float_failures": sum(not r["float_ok"] for r in rows),
        "provisional": sum(r["provisional"] for r in rows),
        "over_cap": sum(r["over_cap_s"] > OVER_CAP_S for r in rows),
        "worse": sum(r["kernels_after"] > r["kernels_before"] or r["estimate_after_us"] > r["estimate_before_us"]
                     for r in rows),
        "kernels_removed_histogram": {str(k): removed[k] for k in sorted(removed)},
        "boundary_reasons": dict(reasons.most_common()),
        "search_s_median": round(statistics.median(r["search_s"] for r in rows), 2) if rows else None,
        "search_s_max": max((r["search_s"] for r in rows), default=None),
        "budget_s": budget_s,
    }
    compared = [r["gpu"]["speedup_vs_best"] for r in rows if r.get("gpu", {}).get("speedup_vs_best")]
    if compared:
        summary["gpu_geomean_speedup_vs_best"] = math.exp(statistics.mean(math.log(s) for s in compared))
        summary["gpu_slower_than_eager"] = sum(1 for r in rows if (r["gpu"].get("speedup_vs_eager") or 1) < 1)
    if any("gpu" in r for r in rows):
        summary["gpu_not_compared"] = sum(1 for r in rows if "gpu" in r and not r["gpu"].get("speedup_vs_best"))
    return summary


def merged(runs: Sequence[dict]) -> dict:
    """The runs of parts of one seed's programs (each its --first and --count: a device's time limit per
    command splits a GPU run) as one run, rows in program order, the summary made again from them. The parts
    must be of the same seed, budgets, commit and GPU, and no program may be in two. Its meta is the first
    part's, with `first` and `count` covering the programs and each part's command, date and programs under
    `parts`."""
    if not runs:
        raise ValueError("no runs to merge")
    metas = [run["meta"] for run in runs]
    for key in ("seed", "budget_s", "work", "mdsl_commit"):
        values = {json.dumps(m.get(key)) for m in metas}
        if len(values) > 1:
            raise ValueError(f"the runs differ in {key}: {', '.join(sorted(values))}")
    gpus = {(m.get("gpu") or {}).get("name") for m in metas}
    if len(gpus) > 1:
        raise ValueError(f"the runs were timed on different GPUs: {', '.join(sorted(map(str, gpus)))}")
    rows = [row for run in runs for row in run["rows"]]
    names = [row["program"] for row in rows]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"programs in more than one run: {', '.join(twice)}")
    rows.sort(key=lambda row: int(row["program"].rsplit("_", 1)[1]))
    meta = dict(metas[0])
    meta["parts"] = [{"command": m.get("command"), "date": m.get("date"), "first": m.get("first"),
                      "count": m.get("count")} for m in metas]
    meta["command"] = " and ".join(str(m.get("command")) for m in metas)
    meta["first"] = min(m.get("first", 0) for m in metas)
    meta["count"] = len(rows)
    return {"schema": SCHEMA, "meta": meta, "summary": summarise(rows, meta["budget_s"]), "rows": rows}


def markdown(meta: dict, rows: list, summary: dict) -> str:
    s = summary
    lines = [f"# Random programs (seed {meta['seed']}, {s['programs']} programs)", "",
             f"Run: {meta['date']}, {meta['host']}, {meta['cpus']} CPUs, load {meta['load']}, commit "
             f"`{meta['mdsl_commit']}`, `{meta['command']}`; cap {meta['budget_s']} s, work {meta['work']}, "
             f"{meta['workers']} workers.", "",
             f"- fused (fewer kernels than the original): {s['fused']} of {s['programs']} ({s['fused_fraction']:.1%})",
             f"- float-check failures: {s['float_failures']}; plans worse than the original (kernels or estimate): "
             f"{s['worse']}",
             f"- provisional (cut short by the cap): {s['provisional']}; searches over their cap by more than "
             f"{OVER_CAP_S:g} s: {s['over_cap']}",
             f"- search seconds: median {s['search_s_median']}, max {s['search_s_max']}",
             "- kernels removed (before - after): "
             + ", ".join(f"{k}: {v}" for k, v in s["kernels_removed_histogram"].items()),
             "- kernel boundaries left, by reason: " + ", ".join(f"{k} {v}" for k, v in s["boundary_reasons"].items())]
    if "same_as" in s:
        lines.append(f"- against `{s['same_as']['file']}` (the same programs under another load): "
                     f"{s['same_as']['compared']} finished in both, plans differ for "
                     f"{', '.join(s['same_as']['differ']) or 'none'}")
    if "gpu_geomean_speedup_vs_best" in s:
        lines.append(f"- GPU: geomean speed-up over the best PyTorch baseline {s['gpu_geomean_speedup_vs_best']:.2f}x; "
                     f"slower than eager: {s['gpu_slower_than_eager']}; not compared (a contender failed: its row "
                     f"says why): {s.get('gpu_not_compared', 0)}")
    gpu = any("gpu" in r for r in rows)
    head = "| program | rows | ops | kernels | est. us | search s | float | provisional |"
    rule = "|---|---:|---:|---:|---:|---:|---|---|"
    if gpu:
        head += " mdsl us | mdsl graph us | eager us | graph us | compile us |"
        rule += "---:|---:|---:|---:|---:|"
    lines += ["", head, rule]
    for r in rows:
        line = (f"| {r['program']} | {r['rows']} | {r['ops']} | {r['kernels_before']} -> {r['kernels_after']} | "
                f"{r['estimate_before_us']} -> {r['estimate_after_us']} | {r['search_s']} | "
                f"{'ok' if r['float_ok'] else 'FAIL'} {r['float_error']:.1e} | {'yes' if r['provisional'] else ''} |")
        if gpu:
            g = r.get("gpu", {})
            line += "".join(f" {g.get(k) and round(g[k], 2)} |" for k in ("mdsl_us", "mdsl_graph_us", "eager_us",
                                                                           "cuda_graph_us", "compile_us"))
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, help="the run's seed: it decides every program (required but with --merge)")
    parser.add_argument("--count", type=int, default=100, help="programs to draw (default 100)")
    parser.add_argument("--first", type=int, default=0, help="index of the first program (to split a run)")
    parser.add_argument("--budget", type=float, default=120.0, help="each search's wall-clock cap (default 120 s)")
    parser.add_argument("--work", type=int, help="each search's work budget (default: the search's)")
    parser.add_argument("--workers", type=int, default=2, help="verification processes per search (default 2)")
    parser.add_argument("--cache", help="an empty or new directory for the plans (default: a temporary one); "
                                        "keep it for a GPU run")
    parser.add_argument("--gpu", action="store_true", help="also time each program on the GPU (needs torch)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile on the GPU")
    parser.add_argument("--out", help="where the JSON and Markdown go (default $OUT, else ./bench_out)")
    parser.add_argument("--print", dest="show", action="store_true", help="print the programs' sources and stop")
    parser.add_argument("--same-as", help="another run's random_programs.json (same seed and budgets, another "
                                          "machine load): report the finished programs whose plans differ")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="write the runs of parts of one seed's "
                        "programs (random_programs.json files) as one run under --out, and stop")
    args = parser.parse_args(argv)
    if args.merge:
        try:
            run = merged([json.loads(Path(f).read_text()) for f in args.merge])
        except (OSError, ValueError, KeyError) as e:
            parser.error(f"--merge: {e}")
        out_dir = Path(args.out or os.environ.get("OUT") or "bench_out")
        out_dir.mkdir(parents=True, exist_ok=True)
        text = markdown(run["meta"], run["rows"], run["summary"])
        (out_dir / "random_programs.json").write_text(json.dumps(run, indent=1))
        (out_dir / "random_programs.md").write_text(text)
        print(text)
        return 0
    if args.seed is None:
        parser.error("--seed is required (but with --merge)")
    if args.count < 1:
        parser.error("--count must be at least 1")
    programs = [draw(args.seed, i) for i in range(args.first, args.first + args.count)]
    if args.show:
        print("\n\n".join(p.source() for p in programs))
        return 0
    if args.gpu and not _gpu_present():
        parser.error("--gpu: torch sees no GPU here")

    from mdsl.search.config import SearchConfig

    cache = Path(args.cache or tempfile.mkdtemp(prefix="mdsl-random-programs-"))
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["MDSL_CACHE_DIR"] = str(cache)   # the searches' plan cache, and the GPU call path's
    config = SearchConfig(budget_s=args.budget, workers=args.workers,
                          **({"work": args.work} if args.work is not None else {}))
    out_dir = Path(args.out or os.environ.get("OUT") or "bench_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = provenance("random_programs.py", sys.argv[1:] if argv is None else list(argv), gpu=args.gpu)
    meta.update(seed=args.seed, count=args.count, first=args.first, budget_s=args.budget, work=config.work,
                workers=args.workers)
    rows = []

    def write() -> None:   # after each program: a run cut short keeps what it measured
        summary = summarise(rows, args.budget)
        if args.same_as:
            summary["same_as"] = {"file": args.same_as, **same_plans(rows, json.loads(Path(args.same_as).read_text())["rows"])}
        meta["load_end"] = [round(x, 2) for x in os.getloadavg()]
        (out_dir / "random_programs.json").write_text(json.dumps({"schema": SCHEMA, "meta": meta, "summary": summary,
                                                                  "rows": rows}, indent=1))
        (out_dir / "random_programs.md").write_text(markdown(meta, rows, summary))

    for program in programs:
        row = run_one(program, config, args.seed)
        rows.append(row)
        print(f"{row['program']}: {row['ops']} ops, kernels {row['kernels_before']} -> {row['kernels_after']}, "
              f"{row['estimate_before_us']} -> {row['estimate_after_us']} us est., search {row['search_s']} s"
              f"{' (provisional)' if row['provisional'] else ''}, float {'ok' if row['float_ok'] else 'FAIL'}",
              flush=True)
        write()
    if args.gpu:
        def progress(index: int, step: int, out: dict) -> None:
            rows[index]["gpu"] = out
            print(f"{rows[index]['program']}: {', '.join(PASSES[step])} timed", flush=True)
            write()

        measure_on_gpu(programs, compile_baseline=args.compile, progress=progress)
    print(markdown(meta, rows, summarise(rows, args.budget)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hypothesis strategies for random valid mugraphs, shared by the IR, pass and backend tests.

`kernel_graphs()` builds a kernel graph op by op: every operator is chosen among those that fit the
values at hand, its attributes are drawn to fit their shapes and its output types come from the
registry's `infer_types`, so the graphs are valid by construction (each one is validated before it is
returned). Some nodes are `custom` kernels with a random block graph (grid, imap/fmap, ops inside the
for-loop, accumulators of every kind, ops after the loop, omaps), some of which hold a `fused`
thread graph.
"""
from __future__ import annotations

import math
from typing import Optional

from hypothesis import strategies as st

from mdsl.errors import SourceLoc
from mdsl.ir import BlockGraph, BlockInput, BlockOutput, KernelGraph, Node, ThreadGraph, bf16, f16, f32, i32
from mdsl.ir.ops import OPS, get_op
from mdsl.ir.text import parse_graph
from mdsl.ir.types import TensorType, Var
from mdsl.ir.validate import (SMEM_LIMIT_BYTES, input_tile_type, shared_memory_peak, validate_block_graph,
                              validate_kernel_graph, validate_thread_graph)

DIMS = (1, 2, 3, 4, 6, 8, 12, 16)   # tensor dims are products of small factors
MAX_NUMEL = 4096                     # keeps every tile of a custom kernel within shared memory
FLOAT_DTYPES = (f16, bf16, f32)
UNARY = tuple(name for name, op in OPS.items() if op.is_unary)              # in the registry's order
BINARY = tuple(name for name, op in OPS.items() if op.is_binary)
ACCUMULATORS = tuple(name for name, op in OPS.items() if op.is_accumulator)

# names that look like keywords or numbers: the printer and parser must not care
NAME_STEMS = ("t", "x", "acc", "in", "out", "return", "kernel", "block", "inf", "nan", "v.1", "_", "a_b.c", "T")
FILE_NAMES = ("/path/examples/model.py", "C:\\work\\kernel.py", "a:12", "x:1:2-3", "with space.py", "#hash.py",
              '"quoted".py', " lead.py", "tab\tname.py", "new\nline.py", "", "ünï.py", "sep\u2028.py")

floats = st.floats(allow_nan=False, width=64)                # clamp bounds: +-inf allowed
finite_floats = st.floats(allow_nan=False, allow_infinity=False)  # scalar operands are finite
locs = st.none() | st.builds(
    SourceLoc,
    file=st.sampled_from(FILE_NAMES) | st.text(max_size=12),
    line=st.integers(1, 99_999),
    col=st.none() | st.integers(0, 300),
    end_col=st.none() | st.integers(0, 300),
)


def all_locs(graph) -> list:
    """The source locations of every node, bodies included, in order (Node equality ignores them)."""
    out = []
    for node in graph.nodes:
        out.append(node.loc)
        if node.body is not None:
            out += all_locs(node.body)
    return out


def _broadcastable(a: tuple, b: tuple) -> bool:
    return all(x == y or 1 in (x, y) for x, y in zip(reversed(a), reversed(b)))


class _Scope:
    """The values of one graph under construction (kernel, block or thread level) and its nodes."""

    def __init__(self, draw):
        self.draw = draw
        self.values: list = []
        self.nodes: list = []
        self.taken: set = set()

    def name(self) -> str:
        stem = self.draw(st.sampled_from(NAME_STEMS))
        name = stem if stem not in self.taken else f"{stem}{len(self.taken)}"
        while name in self.taken:
            name += "_"
        self.taken.add(name)
        return name

    def var(self, ttype: TensorType) -> Var:
        return Var(self.name(), ttype)

    def pick(self, pool: list, ok=lambda v: True) -> Optional[Var]:
        fits = [v for v in pool if ok(v)]
        return self.draw(st.sampled_from(fits)) if fits else None

    def add(self, op: str, inputs: list, attrs: Optional[dict] = None, pool: Optional[list] = None) -> Optional[list]:
        """Append `op(inputs)` with output types from the registry; None when an output is too large."""
        pairs = get_op(op).normalize_attrs(attrs or {})
        types = get_op(op).infer_types(tuple(v.type for v in inputs), pairs)
        if any(t.numel > MAX_NUMEL for t in types):
            return None
        return self.emit(Node(op, inputs, [self.var(t) for t in types], pairs, None, self.draw(locs)), pool)

    def emit(self, node: Node, pool: Optional[list] = None) -> list:
        self.nodes.append(node)
        (self.values if pool is None else pool).extend(node.outputs)
        return list(node.outputs)

    # --- element-wise operators, at every level --------------------------------------------------

    def unary(self, x: Var, pool=None) -> list:
        op = self.draw(st.sampled_from(UNARY + ("mul_scalar", "add_scalar", "pow_scalar", "clamp", "cast")))
        if op in ("mul_scalar", "add_scalar"):
            return self.add(op, [x], {"value": self.draw(finite_floats)}, pool)
        if op == "pow_scalar":
            return self.add(op, [x], {"exponent": self.draw(finite_floats)}, pool)
        if op == "clamp":
            lo, hi = sorted(self.draw(st.lists(floats, min_size=2, max_size=2)))
            return self.add(op, [x], {"min": lo, "max": hi}, pool)
        if op == "cast":
            return self.add(op, [x], {"dtype": self.draw(st.sampled_from(FLOAT_DTYPES))}, pool)
        return self.add(op, [x], pool=pool)

    def binary(self, x: Var, y: Var, pool=None) -> Optional[list]:
        a, b = (x, y) if self.draw(st.booleans()) else (y, x)
        return self.add(self.draw(st.sampled_from(BINARY)), [a, b], pool=pool)


def _float(v: Var) -> bool:
    return v.dtype.is_float


# ---------------------------------------------------------------------------------------------
# kernel graphs


class _Kernel(_Scope):
    def __init__(self, draw):
        super().__init__(draw)
        self.inputs: list = []
        self.dtype = draw(st.sampled_from(FLOAT_DTYPES))

    def new_input(self, shape, dtype=None) -> Var:
        var = self.var(TensorType(shape, dtype or self.dtype))
        self.inputs.append(var)
        self.values.append(var)
        return var

    def shape(self, min_rank: int = 0) -> list:
        return self.draw(st.lists(st.sampled_from(DIMS), min_size=min_rank, max_size=3))

    def step(self) -> None:
        """One node: a random operator applied to values it fits; an element-wise op when none fits."""
        builders = {
            "unary": (_float, self.unary), "binary": (_float, self.kernel_binary),
            "matmul": (lambda v: _float(v) and v.type.rank >= 2, self.matmul),
            "reduce": (lambda v: _float(v) and v.type.rank >= 1, self.reduce),
            "rms_norm": (lambda v: _float(v) and v.type.rank >= 1, self.rms_norm),
            "concat": (lambda v: v.type.rank >= 1, self.concat),
            "split": (lambda v: any(d >= 2 for d in v.shape), self.split),
            "reshape": (lambda v: True, self.reshape), "transpose": (lambda v: True, self.transpose),
            "custom": (lambda v: _float(v) and v.type.rank >= 1, self.custom),
            "to_int": (_float, lambda v: self.add("cast", [v], {"dtype": i32})),
        }
        kind = self.draw(st.sampled_from(list(builders) + ["custom", "custom", "binary", "unary"]))
        ok, build = builders[kind]
        x = self.pick(self.values, ok)
        if x is None or build(x) is None:
            x = self.pick(self.values)
            if x.dtype.is_float:
                self.unary(x)  # never grows a tensor, so always fits
            else:
                self.add("cast", [x], {"dtype": self.dtype})

    def kernel_binary(self, x: Var):
        y = self.pick(self.values, lambda v: v.dtype == x.dtype and _broadcastable(v.shape, x.shape))
        if y is None or self.draw(st.booleans()):
            # a new operand that broadcasts against x: leading dims dropped, some dims set to 1
            shape = list(x.shape[self.draw(st.integers(0, x.type.rank)):])
            ones = self.draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
            y = self.new_input([1 if one else d for d, one in zip(shape, ones)], x.dtype)
        return self.binary(x, y)

    def matmul(self, x: Var):
        w = self.pick(self.values, lambda v: v.dtype == x.dtype and v.type.rank == 2 and v.shape[0] == x.shape[-1])
        if w is None or self.draw(st.booleans()):
            w = self.new_input([x.shape[-1], self.draw(st.sampled_from(DIMS))], x.dtype)
        return self.add("matmul", [x, w])

    def reduce(self, x: Var):
        dim = self.draw(st.integers(-x.type.rank, x.type.rank - 1))
        return self.add(self.draw(st.sampled_from(("sum", "mean", "max"))), [x],
                        {"dim": dim, "keepdim": self.draw(st.booleans())})

    def rms_norm(self, x: Var):
        eps = self.draw(st.sampled_from([1e-6, 1e-5]) | st.floats(0, 1))
        return self.add("rms_norm", [x], {"dim": self.draw(st.integers(-x.type.rank, x.type.rank - 1)), "eps": eps})

    def concat(self, x: Var):
        dim = self.draw(st.integers(0, x.type.rank - 1))
        others = []
        for _ in range(self.draw(st.integers(0, 2))):
            shape = list(x.shape)
            shape[dim] = self.draw(st.sampled_from(DIMS))
            same = self.pick(self.values, lambda v: v.dtype == x.dtype and v.shape == tuple(shape))
            others.append(same or self.new_input(shape, x.dtype))
        return self.add("concat", [x, *others], {"dim": dim - self.draw(st.sampled_from([0, x.type.rank]))})

    def split(self, x: Var):
        dim = self.draw(st.sampled_from([d for d in range(x.type.rank) if x.shape[d] >= 2]))
        n = x.shape[dim]
        cuts = sorted(self.draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=3)))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
        return self.add("split", [x], {"sizes": sizes, "dim": dim})

    def reshape(self, x: Var):
        primes = _prime_factors(x.type.numel)
        bins = self.draw(st.lists(st.integers(0, 2), min_size=len(primes), max_size=len(primes)))
        rank = self.draw(st.integers(max(bins, default=0) + 1 if primes else 0, 3))
        shape = [math.prod(p for p, b in zip(primes, bins) if b == i) for i in range(rank)]
        return self.add("reshape", [x], {"shape": shape})

    def transpose(self, x: Var):
        return self.add("transpose", [x], {"perm": self.draw(st.permutations(range(x.type.rank)))})

    def custom(self, x: Var):
        operands, body = _Block(self, x).build()
        if body is None:
            return None
        types = validate_block_graph(body, tuple(v.type for v in operands))
        return self.emit(Node("custom", operands, [self.var(t) for t in types], (), body, self.draw(locs)))


def _prime_factors(n: int) -> list:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


# ---------------------------------------------------------------------------------------------
# block graphs


class _Block(_Scope):
    """A random custom kernel reading `x` (and maybe a matmul partner, a twin of x, another value)."""

    def __init__(self, kernel: _Kernel, x: Var):
        super().__init__(kernel.draw)
        self.kernel = kernel
        self.x = x
        self.inputs: list = []
        self.operands: list = []
        self.loop: list = []   # values computed inside the for-loop
        self.post: list = []   # values computed after it

    def build(self) -> tuple:
        draw, x = self.draw, self.x
        self.grid = self.draw_grid()
        self.forloop = draw(st.sampled_from([1, 1, 2, 3, 4]))
        imap = self.draw_imap(x.type)
        fmap = self.draw_fmap(x.type, imap)
        xt = self.read(x, imap, fmap)
        if xt.type.numel > MAX_NUMEL:
            return self.operands, None
        if x.type.rank >= 2 and draw(st.booleans()):
            wt = self.read_matmul_partner(x, imap, fmap)
            if draw(st.booleans()):
                self.add("matmul", [xt, wt], pool=self.loop)
        if draw(st.booleans()):  # a twin of x: same tile, for binary and fused ops
            self.read(self.kernel.new_input(x.shape, x.dtype), imap, fmap)
        if draw(st.booleans()):
            y = self.kernel.pick(self.kernel.values, lambda v: _float(v) and v is not x)
            if y is not None:
                y_imap = self.draw_imap(y.type)
                self.read(y, y_imap, self.draw_fmap(y.type, y_imap))
        for _ in range(draw(st.integers(0, 4))):
            self.block_step(self.loop)
        splits = sum(g > 1 for g in self.grid)
        first = self.accumulate(xt if draw(st.booleans()) else self.pick(
            self.loop, lambda v: _float(v) and v.type.rank >= max(splits, 1) and v.type.numel <= MAX_NUMEL))
        for _ in range(draw(st.integers(0, 2))):
            self.accumulate(self.pick(self.loop, lambda v: _float(v) and v.type.numel <= MAX_NUMEL))
        for _ in range(draw(st.integers(0, 3))):
            self.block_step(self.post)
        outs = [first] + draw(st.lists(st.sampled_from([v for v in self.post if v.type.rank >= splits]), max_size=2))
        outputs = [BlockOutput(v, self.draw_omap(v)) for v in dict.fromkeys(outs)]
        threads = draw(st.sampled_from([32, 64, 128, 256, 1024]))
        body = BlockGraph(self.grid, threads, self.forloop, self.inputs, self.nodes, outputs)
        if shared_memory_peak(body) > SMEM_LIMIT_BYTES:
            return self.operands, None
        return self.operands, body

    # --- maps ---------------------------------------------------------------------------------

    def draw_grid(self) -> list:
        """Grid sizes that divide dims of x, at most one split grid dim per dim of x."""
        grid, free = [1, 1, 1], list(range(self.x.type.rank))
        for g in range(3):
            if free and self.draw(st.booleans()):
                d = self.draw(st.sampled_from(free))
                sizes = [s for s in (2, 3, 4) if self.x.shape[d] % s == 0]
                if sizes:
                    grid[g] = self.draw(st.sampled_from(sizes))
                    free.remove(d)
        return grid

    def draw_imap(self, t: TensorType) -> list:
        imap, shape = [None, None, None], list(t.shape)
        for g, size in enumerate(self.grid):
            dims = [d for d in range(t.rank) if shape[d] % size == 0 and d not in imap]
            if size > 1 and dims and self.draw(st.integers(0, 3)):
                imap[g] = self.draw(st.sampled_from(dims))
                shape[imap[g]] //= size
        return imap

    def draw_fmap(self, t: TensorType, imap: list) -> Optional[int]:
        tile = input_tile_type(t, self.grid, 1, imap, None)
        dims = [d for d in range(t.rank) if tile.shape[d] % self.forloop == 0]
        return self.draw(st.sampled_from([None, *dims, *dims]))

    def draw_omap(self, v: Var) -> list:
        dims = iter(self.draw(st.permutations(range(v.type.rank))))
        return [next(dims) if size > 1 else None for size in self.grid]

    def read(self, operand: Var, imap: list, fmap: Optional[int]) -> Var:
        var = self.var(input_tile_type(operand.type, self.grid, self.forloop, imap, fmap))
        self.operands.append(operand)
        self.inputs.append(BlockInput(var, imap, fmap))
        self.loop.append(var)
        return var

    def read_matmul_partner(self, x: Var, imap: list, fmap: Optional[int]) -> Var:
        """A new [K, N] operand whose tile is [K', N'] when x's tile is [..., K']: it follows x's
        splits of K, and one grid dim that replicates x may split N."""
        last = x.type.rank - 1
        w_imap = [0 if d == last else None for d in imap]
        n = self.draw(st.sampled_from(DIMS))
        free = [g for g, (size, d) in enumerate(zip(self.grid, imap)) if size > 1 and d is None]
        if free and self.draw(st.booleans()):
            g = self.draw(st.sampled_from(free))
            w_imap[g] = 1
            n *= self.grid[g]
        return self.read(self.kernel.new_input([x.shape[-1], n], x.dtype), w_imap, 0 if fmap == last else None)

    # --- operators ----------------------------------------------------------------------------

    def block_step(self, pool: list) -> None:
        x = self.pick(pool, _float)
        if x is None:
            return
        kind = self.draw(st.sampled_from(("unary", "binary", "matmul", "reduce", "rms_norm", "concat", "fused")))
        built = None
        if kind == "binary":
            y = self.pick(pool, lambda v: v.dtype == x.dtype and _broadcastable(v.shape, x.shape))
            built = self.binary(x, y, pool)
        elif kind == "matmul" and x.type.rank >= 2:
            w = self.pick(pool, lambda v: v.dtype == x.dtype and v.type.rank >= 2 and v.shape[-2] == x.shape[-1]
                          and _broadcastable(v.shape[:-2], x.shape[:-2]))
            built = w and self.add("matmul", [x, w], pool=pool)
        elif kind == "reduce" and x.type.rank >= 1:
            built = self.add(self.draw(st.sampled_from(("sum", "mean", "max"))), [x],
                             {"dim": self.draw(st.integers(-x.type.rank, x.type.rank - 1)), "keepdim": self.draw(st.booleans())},
                             pool)
        elif kind == "rms_norm" and x.type.rank >= 1:
            built = self.add("rms_norm", [x], {"dim": -1, "eps": self.draw(st.sampled_from([1e-6, 0.5]))}, pool)
        elif kind == "concat" and x.type.rank >= 1:
            built = self.add("concat", [x, x], {"dim": self.draw(st.integers(0, x.type.rank - 1))}, pool)
        elif kind == "fused":
            built = self.fused(x, pool)
        if built is None:
            self.unary(x, pool)

    def fused(self, x: Var, pool: list) -> list:
        inputs = [x] + self.draw(st.lists(st.sampled_from([v for v in pool if v.type == x.type]), max_size=1))
        body = _Thread(self.draw, [v.type for v in inputs]).build()
        types = validate_thread_graph(body, tuple(v.type for v in inputs))
        return self.emit(Node("fused", inputs, [self.var(t) for t in types], (), body, self.draw(locs)), pool)

    def accumulate(self, x: Var) -> Var:
        """Close the loop over x with a random accumulator; rescaling ones get a row maximum m."""
        kind = self.draw(st.sampled_from(ACCUMULATORS if x.type.rank >= 1 else ("accum", "accum_max")))
        if kind in ("accum_rescale", "accum_sum_rescale"):
            (m,) = self.add("max", [x], {"dim": -1, "keepdim": True}, self.loop)
            if self.draw(st.booleans()):  # the online-softmax shape: exp(x - m)
                (d,) = self.add("sub", [x, m], pool=self.loop)
                (x,) = self.add("exp", [d], pool=self.loop)
            inputs = [x, m]
        else:
            inputs = [x]
        attrs = {"eps": self.draw(st.sampled_from([1e-6, 1e-5]))} if kind == "accum_rms" else None
        (acc,) = self.add(kind, inputs, attrs, self.post)
        return acc


class _Thread(_Scope):
    """A random element-wise chain over inputs of the given types."""

    def __init__(self, draw, types: list):
        super().__init__(draw)
        self.inputs = [self.var(t) for t in types]
        self.values.extend(self.inputs)

    def build(self) -> ThreadGraph:
        for _ in range(self.draw(st.integers(1, 3))):
            x = self.pick(self.values, _float)
            y = self.pick(self.values, lambda v: v.type == x.type)
            if self.draw(st.booleans()):
                self.binary(x, y)
            else:
                self.unary(x)
        produced = [v for n in self.nodes for v in n.outputs]
        outs = [produced[-1]] + self.draw(st.lists(st.sampled_from(self.values), max_size=1))
        return ThreadGraph(self.inputs, self.nodes, list(dict.fromkeys(outs)))


@st.composite
def kernel_graphs(draw, max_nodes: int = 8) -> KernelGraph:
    """Random valid kernel graphs with 1 to `max_nodes` top-level nodes."""
    k = _Kernel(draw)
    for _ in range(draw(st.integers(1, 2))):
        k.new_input(k.shape(min_rank=draw(st.sampled_from([0, 1, 1, 2, 2, 2, 3]))))
    for _ in range(draw(st.integers(1, max_nodes))):
        k.step()
    last = k.nodes[-1].outputs[0]
    outputs = [last] + draw(st.lists(st.sampled_from(k.values), max_size=2))
    graph = KernelGraph(draw(st.sampled_from(("g", "rms_norm_linear", "kernel", "k.v1", "_"))),
                        k.inputs, k.nodes, outputs)
    validate_kernel_graph(graph)
    return graph


# ---------------------------------------------------------------------------------------------
# hand-written graphs: every accumulator kind, thread graphs, multi-output nodes, layout operators

EXAMPLES = {
    "rms_norm_linear": """\
kernel rms_norm_linear(%x: f16[16, 4096], %w: f16[4096, 6144]) {
  %y: f16[16, 6144] = custom(%x, %w) block(grid=[48, 1, 1], threads=128, forloop=64) {
    in %bx: f16[16, 64] imap=[-, -, -] fmap=1
    in %bw: f16[64, 128] imap=[1, -, -] fmap=0
    %m: f16[16, 128] = matmul(%bx, %bw)  # @ examples/rms_norm_linear.py:8:11-31
    %acc: f16[16, 128] = accum(%m)
    %r: f16[16, 1] = accum_rms(%bx) {eps=1e-06}
    %o: f16[16, 128] = fused(%acc, %r) thread {
      in %p: f16[16, 128]
      in %q: f16[16, 1]
      %d: f16[16, 128] = div(%p, %q)
      %s: f16[16, 128] = silu(%d)  # @ examples/rms_norm_linear.py:9:4-12
      out %s
    }
    out %o omap=[1, -, -]
  }  # @ examples/rms_norm_linear.py:8:11-31
  return %y
}""",
    "attention": """\
kernel attention(%q: f16[2, 16, 64], %k: f16[2, 64, 128], %v: f16[2, 128, 64]) {
  %qs: f16[2, 16, 64] = mul_scalar(%q) {value=0.125}  # @ C:\\attn.py:3
  %out: f16[2, 16, 64], %row.max: f16[2, 16, 1] = custom(%qs, %k, %v) block(grid=[2, 1, 1], threads=128, forloop=4) {
    in %bq: f16[1, 16, 64] imap=[0, -, -] fmap=-
    in %bk: f16[1, 64, 32] imap=[0, -, -] fmap=2
    in %bv: f16[1, 32, 64] imap=[0, -, -] fmap=1
    %s: f16[1, 16, 32] = matmul(%bq, %bk)
    %m: f16[1, 16, 1] = max(%s) {dim=-1, keepdim=true}
    %d: f16[1, 16, 32] = sub(%s, %m)
    %e: f16[1, 16, 32] = exp(%d)
    %pv: f16[1, 16, 64] = matmul(%e, %bv)
    %num: f16[1, 16, 64] = accum_rescale(%pv, %m)
    %den: f16[1, 16, 1] = accum_sum_rescale(%e, %m)
    %mx: f16[1, 16, 1] = accum_max(%m)
    %o: f16[1, 16, 64] = div(%num, %den)
    out %o omap=[0, -, -]
    out %mx omap=[0, -, -]
  }  # @ "attn.py:12":40
  return %out, %row.max
}""",
    "row_stats": """\
kernel row_stats(%a: f32[32, 64], %b: f32[32, 64]) {
  %st: f32[32, 2], %ms: f32[32, 2] = custom(%a, %b) block(grid=[4, 2, 1], threads=64, forloop=4) {
    in %ta: f32[8, 8] imap=[0, 1, -] fmap=1
    in %tb: f32[8, 8] imap=[0, 1, -] fmap=1
    %ab: f32[8, 8] = mul(%ta, %tb)
    %s: f32[8, 1] = accum_sum(%ab)
    %mean: f32[8, 1] = accum_mean(%ta)
    %rms: f32[8, 1] = accum_rms(%tb) {eps=1e-05}
    %t: f32[8, 1] = add(%s, %mean)
    %u: f32[8, 1] = div(%t, %rms)
    out %u omap=[0, 1, -]
    out %mean omap=[0, 1, -]
  }
  %total: f32[32] = sum(%st) {dim=1, keepdim=false}
  return %total, %ms
}""",
    "layout": """\
kernel layout(%x: bf16[4, 6], %y: bf16[4, 2]) {
  %a: bf16[4, 2], %b: bf16[4, 4] = split(%x) {sizes=[2, 4], dim=1}
  %c: bf16[4, 4] = concat(%a, %y) {dim=-1}
  %d: bf16[2, 8] = reshape(%c) {shape=[2, 8]}
  %e: bf16[8, 2] = transpose(%d) {perm=[1, 0]}
  %f: f32[8, 2] = cast(%e) {dtype=f32}
  %g: f32[8, 2] = clamp(%f) {min=-inf, max=0.5}
  %h: f32[8, 1] = mean(%g) {dim=-1, keepdim=true}
  %i: f32[8, 2] = rms_norm(%g) {dim=0, eps=1e-05}
  %j: f32[8, 2] = sub(%i, %h)
  %k: i32[8, 2] = cast(%j) {dtype=i32}
  return %k, %b
}""",
}


def example_graphs() -> dict:
    """The hand-written EXAMPLES, parsed (and so validated)."""
    return {name: parse_graph(text) for name, text in EXAMPLES.items()}


def block_input_tensors(bg: BlockGraph) -> list:
    """The device tensors whose tiles a block graph's inputs are (the inverse of input_tile_type)."""
    out = []
    for i in bg.inputs:
        shape = list(i.var.shape)
        for size, d in zip(bg.grid, i.imap):
            if d is not None:
                shape[d] *= size
        if i.fmap is not None:
            shape[i.fmap] *= bg.forloop
        out.append(i.var.type.with_shape(shape))
    return out

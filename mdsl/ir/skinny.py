"""The shape of a skinny loop: a block graph whose loop multiplies one X of at most 16 rows by weights
that each block streams once (a GEMV-like matmul at batch 1-8: RMSNorm+Linear, Gated MLP).

This is structure only, shared by the lowering (mdsl.lowering.skinny, which adds what the code needs:
dtypes, alignment, a fold for each row accumulator) and the cost model
(mdsl.search.cost.gpu_estimate, which models the skinny loop's bytes in flight); neither imports the
other. `loads_in_flight` states the backend's load schedule (`mdsl::Skinny` in the CUDA prelude) for the
cost model.
"""
from __future__ import annotations

from typing import Optional

import attrs

from mdsl.ir.graph import BlockGraph
from mdsl.ir.ops import THREAD

MAX_ROWS = 16             # X's rows: two 8-column mma tiles
SLAB = 16                 # rows of K a warp takes a step
LOADS = (8, 4)            # columns one load of a weight row covers: 16 bytes, else 8
GROUP_CHUNKS = 8          # chunks a warp covers (fewer: its other lanes duplicate them)
REGISTER_BUFFER = 16      # 16-bit elements a thread's register buffer holds per row of a slab
# blocks of a thread-block cluster that may split one block's K (sm_90+) that the cost model and the autotuner
# consider: none, as the split loop is slower than the unsplit one (docs/performance.md, "Tried and rejected")
CLUSTERS = (1,)


@attrs.frozen
class SkinnyShape:
    x: str              # the input the loop streams as its left operand
    weights: tuple      # the right operands' input names, one per matmul, in node order
    sums: tuple         # node index of each matmul's accum, in the weights' order
    rows: tuple         # node indices of the other loop accumulators (of the operand, one value per row)
    m: int              # X's rows
    n: int              # the weights' columns (the block's)
    k: int              # the block's whole K (forloop x the tile's)
    # node indices of the element-wise loop nodes that compute the operand from X, in node order (a
    # prologue: `x * 2.0 @ w`, `silu(x) @ w`, `(x - b) @ w`), applied to X's elements as they are loaded
    prologue: tuple = ()
    operand: str = ""   # the value every matmul and row accumulator reads: the prologue's last, or X ("")
    # the inputs of one value per element of K ([1, K] or [K], broadcast along X's rows) the prologue reads,
    # each loaded at the K of X's fragments (`b` of `(x - b) @ w`)
    vectors: tuple = ()
    # node indices of the block-level transposes through which the matmuls read weights stored [N, K] (a
    # linear layer's [out, in], its loop dim its last): each lane's loads of them run along K; () where
    # every weight is stored [K, N]
    transposes: tuple = ()

    @property
    def transposed(self) -> bool:
        """Whether the weights are stored [N, K] (read through `transposes`)."""
        return bool(self.transposes)

    @property
    def left(self) -> str:
        """The name of the matmuls' left operand: X itself, or the prologue's result."""
        return self.operand or self.x

    def columns_per_load(self) -> Optional[int]:
        """8 (16-byte loads) unless 4 (8-byte loads) leave fewer of a warp's lanes duplicating others:
        a block of 32 columns is 8 chunks of 4 (every lane distinct), not 4 of 8 (half the lanes copies).
        None where neither cuts the columns into chunks that fit (36: 9 chunks of 4, 4.5 of 8)."""
        fitting = [v for v in LOADS if self.n % v == 0 and _chunks_fit(self.n // v)]
        return max(fitting, key=lambda v: (min(self.n // v, GROUP_CHUNKS), v)) if fitting else None

    def chunks(self) -> int:
        return self.n // self.columns_per_load()

    def groups(self) -> int:
        """Column groups (8 chunks each, fewer where there are fewer): one per warp along N."""
        return max(1, self.chunks() // GROUP_CHUNKS)

    def fits(self, warps: int) -> bool:
        """The weights' columns in whole chunks: fewer than 8 (one group, lanes past them duplicate),
        or whole groups of 8 that the warps divide among themselves."""
        return warps >= 1 and self.columns_per_load() is not None and warps % self.groups() == 0

    def splits_over(self, cluster: int) -> bool:
        """Whether `cluster` blocks can split the block's K into whole slabs, one contiguous run each."""
        return cluster >= 1 and (self.k // SLAB) % cluster == 0

    def slabs_per_step(self) -> int:
        """Slabs a warp loads at once into one register buffer: 16 elements a row of each, 4 rows."""
        return max(1, REGISTER_BUFFER // (self.columns_per_load() * len(self.weights)))

    def loads_in_flight(self, warps: int) -> int:
        """Distinct weight bytes a block has in flight at most: each thread's two register buffers of
        `slabs_per_step` slabs x 4 rows x one load per weight; of a warp's lanes, those past the chunks
        load duplicates."""
        load_bytes = 2 * self.columns_per_load()
        distinct = min(self.chunks(), GROUP_CHUNKS) / GROUP_CHUNKS
        return int(warps * 32 * 2 * self.slabs_per_step() * len(self.weights) * 4 * load_bytes * distinct)


def _chunks_fit(chunks: int) -> bool:
    return 1 <= chunks < GROUP_CHUNKS or chunks % GROUP_CHUNKS == 0


def skinny_shape(bg: BlockGraph) -> Optional[SkinnyShape]:
    """The block graph's skinny loop, or None: every loop node (before the accumulators close it) is a
    2-D matmul of one operand (at most 16 rows, along K its last dim) by a 2-D input weight (fmap along K,
    its first dim), or by the transpose of one stored [N, K] (fmap along K, its last dim; every weight
    alike), read by nothing but one `accum`; that accum; such a transpose; an accumulator of the operand
    giving one value per row; or an element-wise node of the prologue, which computes the operand from the
    input X (fmap along K) and vectors along K (`prologue_of`). Every input is X, a weight or such a
    vector; the block's K is whole 16-row slabs; the weights' columns whole 8-column chunks."""
    post = bg.post_loop_vars()
    inputs = {i.var.name: i for i in bg.inputs}
    readers: dict = {}
    for i, node in enumerate(bg.nodes):
        for v in node.inputs:
            readers.setdefault(v.name, []).append(i)
    loop = [i for i, n in enumerate(bg.nodes) if n.opdef.is_accumulator or not any(v.name in post for v in n.outputs)]
    matmuls = [i for i in loop if bg.nodes[i].op == "matmul"]
    if not matmuls:
        return None
    left = bg.nodes[matmuls[0]].inputs[0]
    made = {n.outputs[0].name: j for j, n in enumerate(bg.nodes) if j in loop}
    weights, sums, transposes, covered = [], [], [], set()
    for i in matmuls:
        a, w = bg.nodes[i].inputs
        sum_of = readers.get(bg.nodes[i].output.name, [])
        if a.name != left.name or len(sum_of) != 1 or bg.nodes[sum_of[0]].op != "accum":
            return None
        t = made.get(w.name)
        if t is not None:   # a weight stored [N, K], transposed for the product and read by it alone
            node = bg.nodes[t]
            if node.op != "transpose" or tuple(node.attr("perm")) != (1, 0) or readers[w.name] != [i] \
                    or not _streamed(inputs.get(node.inputs[0].name), 1):
                return None
            transposes.append(t)
            covered.add(t)
            w = node.inputs[0]
        elif not _streamed(inputs.get(w.name), 0):
            return None
        weights.append(w.name)
        sums.append(sum_of[0])
        covered |= {i, sum_of[0]}
    if transposes and len(transposes) != len(matmuls):   # one layout for all the weights
        return None
    others = [i for i in loop if i not in covered]
    prologue = [i for i in others if not bg.nodes[i].opdef.is_accumulator]
    found = prologue_of(bg, prologue, left.name) if prologue else (left.name, ())
    if found is None:
        return None
    x, vectors = found
    rows = [i for i in others if i not in prologue]
    for i in rows:
        node = bg.nodes[i]
        if [v.name for v in node.inputs] != [left.name] or tuple(node.output.shape) != (left.shape[0], 1):
            return None
    if not _streamed(inputs.get(x), 1) or set(inputs) != {x, *weights, *vectors} or set(vectors) & {x, *weights}:
        return None
    m, kt = left.shape
    n = bg.nodes[matmuls[0]].output.shape[-1]
    stored = (n, kt) if transposes else (kt, n)
    if m > MAX_ROWS or (kt * bg.forloop) % SLAB or any(tuple(inputs[w].var.shape) != stored for w in weights):
        return None
    shape = SkinnyShape(x, tuple(weights), tuple(sums), tuple(rows), m, n, kt * bg.forloop, tuple(prologue),
                        left.name if prologue else "", vectors, tuple(transposes))
    return shape if shape.columns_per_load() is not None else None


def prologue_of(bg: BlockGraph, prologue: list, operand: str) -> Optional[tuple]:
    """(X, vectors): the input X and the inputs of one value per element of K (`vectors`, in the block
    graph's input order) from which the loop nodes `prologue` (node indices, in node order) compute
    `operand` element by element, or None. Each node is an element-wise operator (or a fused chain of
    them) of one result shaped as the operand, reading X, a vector or the results of those before it,
    and each leads to the operand (none is computed for nothing). X is shaped as the operand; a vector is
    shaped [1, K] or [K] with the operand's K, its loop dim (fmap) along K, and broadcast along X's rows."""
    made = {bg.nodes[i].output.name: i for i in prologue}
    if operand not in made:
        return None
    leaves: set = set()
    shape = tuple(bg.nodes[made[operand]].output.shape)
    for i in prologue:
        node = bg.nodes[i]
        elementwise = THREAD in node.opdef.levels or (node.op == "fused" and len(node.outputs) == 1)
        if not elementwise or len(node.outputs) != 1 or tuple(node.output.shape) != shape or not node.inputs:
            return None
        for v in node.inputs:
            if v.name not in made:
                leaves.add(v.name)
            elif made[v.name] >= i:
                return None
    read = [i for i in bg.inputs if i.var.name in leaves]
    # X: the first shaped as the operand (of one row, a vector [1, K] is too: either may be X, the other
    # broadcast over its one row)
    x = next((i for i in read if tuple(i.var.shape) == shape), None)
    vectors = tuple(i.var.name for i in read if i is not x)
    if len(read) != len(leaves) or x is None or not all(_along_k(i, shape[-1]) for i in read if i is not x):
        return None
    needed, frontier = set(), [operand]
    while frontier:
        name = frontier.pop()
        if name in made and made[name] not in needed:
            needed.add(made[name])
            frontier += [v.name for v in bg.nodes[made[name]].inputs]
    return (x.var.name, vectors) if needed == set(prologue) else None


def _along_k(inp, kt: int) -> bool:
    """Whether a block input is a vector along K of `kt` elements a tile: [1, kt] or [kt], its loop dim K."""
    shape = tuple(inp.var.shape)
    return shape in ((1, kt), (kt,)) and inp.fmap == len(shape) - 1


def _streamed(inp, fmap: int) -> bool:
    return inp is not None and inp.var.type.rank == 2 and inp.fmap == fmap

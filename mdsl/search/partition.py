"""Partial fusion: a program cut into parts, each part superoptimized by the guided generator's lifting
rules, and the cheapest combination kept.

**Parts** are runs of consecutive operators in a topological order of the program that keeps chains together
(`order`: a consumer right after its producer where it can be): a contiguous run is convex (no path leaves
it and comes back), so it can be replaced by kernels that read what it reads and write what the rest of the
program reads of it. Where a value has both a reader of the newest value and a sibling reader ready (a norm
read by two products, one of which feeds a third), a second order puts the sibling first (`orders`); the
program is partitioned in each (`analysed`: one partition after the other, the chains' order first, so that
it finds what it finds alone; a set of operators that is a run of two is one part, lifted once), and the
best combination of each partition cheaper than the chains' order's is yielded before that one's.
**Copies**: a value that several operators read, computed by an element-wise operator, can be the reason no
kernel holds a fusion (writing it once for all its readers needs a tile no block holds: a scaled input that
is returned and also read by a product); the program's `duplicated` form computes it once per reader, and is
partitioned too, in its orders and its own (each copy right before its reader). A part has 2 to
MAX_PART_NODES operators, all with a block-level rule (element-wise, matmul, reduction, norm: the guided
generator's categories; a concat of whole rows, a reshape of tiles that hold whole groups) once its views
move to its boundary (`mdsl.search.layout`), connected through the tensors they pass or share (a shared
input joins independent products of it into one kernel: q, k and v). Each part is a program of its own, the
*sub-program*, whose inputs are the values it reads from outside and whose outputs are the values read after
it (or returned).

**Superoptimizing a part**: `guided.lift_all` lifts the sub-program under each structure's smallest tiles
(a probe), and the parts the best combination uses under every grid/loop choice (`Partition.analyse`), so
the lifting rules apply per part: an element-wise chain runs in its producer's epilogue or consumer's
prologue (it lifts into the same block graph), a norm's statistics fold into the next matmul's loop
(accum_rms), softmax into online softmax, a contraction is split across blocks (split-K, split-KV),
outputs with different last-dim labels share one grid dim (horizontal fusion), and per-row scalars
(a reduction's keepdim result) are computed in the block of the matmul they scale.

**The combination**: a dynamic program over the node order picks, for the whole program, the parts
and single operators whose estimated costs (`mdsl.search.cost.estimate`, additive over kernels) sum
to the least. A transpose that cuBLAS reads in place (`mdsl.lowering.gemm.library_read_transposes`) costs
nothing apart; a fused part that reads its value pays for its kernel, which then has to run (two such parts
both pay it). A part's candidates are screened lazily, cheapest first: only those the best
combination uses are checked (`mdsl.search.screen`, a finite-field test on a reduced instance of the
sub-program), a failed one gives way to its next candidate, and the program is solved again until
every part it uses has passed. Leaving every operator apart is always a combination, so the result
never costs more than the original, and a part never has more kernels than operators (a lifting makes
one kernel, or two for a split loop, from at least two operators).

**Soundness.** The assembled program (each part replaced by its candidate) is yielded to the search
engine as an `Assembly`, which the verifier checks part by part at full size: each replacement
against the sub-program it replaces, on inputs of the sub-program's own, with the finite-field and
float tests of any candidate. The whole is then equivalent by substitution: every operator outside
the parts is the original's (or a copy of one, in the duplicated form, which computes the same values
from the same inputs), and a replacement equal to its sub-program as a function of the values
it reads leaves every later value unchanged. A part's tests pass a wrong replacement with probability
at most its bound, so the assembly's bound is the sum of its parts' (a union bound). The operators
left apart (often the largest products) are not evaluated at all, and the original's runs are the
parts', not the whole program's. The screens use randomness of their own (the seed's child
`screen.SCREEN_KEY`), so the candidates this generator chooses depend on no draw of the full-size
tests: the verifier's bound holds for them as for any candidate.

After the best assembly come fallbacks (the best combination without one of its fused parts), which
the verifier may accept where the best fails at full size. What the generator learned of every part
(why it did not fuse: an op without a block-level rule, the shared memory a tile needs, a failed
screen, the cost model, the budget) is recorded in `stats.partition` for the plan's explanation.

**Cheap parts first** (`generate_cheap`, the search's first generator). Verifying a candidate costs
what running its program at full size in the field costs: seconds per GFLOP on a CPU. A program of
more than DEAR_FLOPS (large products) can take longer to verify whole than the search's time cap,
and the guided generator's whole-program candidates, verified first, would then leave a cut search
with nothing fused. For such a program the same analysis runs first over its cheap parts only (at
most CHEAP_PART_FLOPS each: element-wise chains, norms, softmax, small products), and their best
combination is verified part by part before any whole-program candidate: a cut search still returns
it, and a search that runs its course ranks it with the rest. Its record stands until the full
analysis (`generate`) records its own, which keeps the cheap assemblies and what it did not reach.
"""
from __future__ import annotations

from typing import Iterator, Optional

import attrs

from mdsl.ir.graph import KernelGraph, Node
from mdsl.ir.types import Var, fresh_name
from mdsl.ir.validate import SMEM_LIMIT_BYTES, validate_kernel_graph
from mdsl.lowering.gemm import library_read_transposes
from mdsl.search.config import SearchConfig
from mdsl.search.cost import estimate
from mdsl.search.guided import LIFT_RULES, lift_all
from mdsl.search.layout import HANDLED, Wrapped, boundary_views
from mdsl.search.records import Assembly
from mdsl.search.screen import screen
from mdsl.search.stats import SearchStats

#: Operators in one part at most: a residual add, a norm spelled out in its element-wise steps and its scale
#: make ten (each part is probed before any is lifted under every choice, so the long parts are reached).
MAX_PART_NODES = 10
#: A part's cheapest lifted candidates kept for the combination.
PART_CANDIDATES = 4
#: Work steps one reduced-instance screen costs (of the "partition screens" allowance: the screens have
#: their own, so that an analysis that spends the "partition" allowance, one step per choice lifted, still
#: has the parts it found screened and combined).
SCREEN_STEPS = 20
#: A program of more floating-point work than this is dear to verify whole (a full-size test runs it in the
#: field: seconds per GFLOP on a CPU); its cheap parts are fused and verified first (`generate_cheap`).
DEAR_FLOPS = 2 ** 30
#: A part of at most this much floating-point work is cheap to verify.
CHEAP_PART_FLOPS = DEAR_FLOPS // 8
#: Assemblies yielded after the best, each without one of its fused parts.
FALLBACKS = 2
#: The splits of a part's loop label across blocks: at most this many (parts are searched many at a time).
PART_MAX_SPLIT = 16

_UNSCREENED = "not screened"   # a candidate's screen verdict when the budget ended first

# what the record says of a part
FUSED, UNLIFTABLE, DISCONNECTED, NO_LIFT, SCREENED_OUT, NOT_TRIED, DEAR = (
    "fused", "unliftable", "disconnected", "no lift", "screened out", "not tried", "dear")


@attrs.define
class _Part:
    program: KernelGraph
    status: str = NOT_TRIED
    reason: str = ""
    complete: bool = False        # every grid and loop choice was lifted (the budget did not cut it short)
    refined: bool = False         # lifted under every choice, not only each structure's probe
    wrapped: Optional[Wrapped] = None   # its layout changes moved to its boundary (`layout.boundary_views`)
    options: list = attrs.field(factory=list)   # [graph, cost, screened: None | True | failure reason]

    def current(self) -> Optional[list]:
        """The cheapest candidate that has neither failed its screen nor been left unscreened."""
        return next((o for o in self.options if o[2] is None or o[2] is True), None)


def subprogram(graph: KernelGraph, start: int, stop: int) -> Optional[KernelGraph]:
    """Nodes start..stop-1 as a program: inputs the values they read from outside (in order of first use),
    outputs the values they define that later nodes read or the program returns (None if none)."""
    nodes = graph.nodes[start:stop]
    defined = {v.name for n in nodes for v in n.outputs}
    inputs: dict = {}
    for n in nodes:
        for v in n.inputs:
            if v.name not in defined:
                inputs.setdefault(v.name, v)
    read_after = {v.name for n in (*graph.nodes[:start], *graph.nodes[stop:]) for v in n.inputs}
    read_after |= {v.name for v in graph.outputs}
    outputs = [v for n in nodes for v in n.outputs if v.name in read_after]
    if not outputs:
        return None
    return KernelGraph(f"{graph.name}_part{start}_{stop}", list(inputs.values()), nodes, outputs)


def ordered(graph: KernelGraph, siblings_first: bool = False) -> KernelGraph:
    """The program with its nodes in `order`."""
    return attrs.evolve(graph, nodes=[graph.nodes[i] for i in order(graph, siblings_first)])


def order(graph: KernelGraph, siblings_first: bool = False) -> list:
    """The program's nodes (their indices) in a topological order that keeps chains together, so that a
    producer and its consumers can be one run: next comes a ready node with a block-level rule before one without
    (a layout change that may move to a part's boundary waits while it can), then the one that reads the
    most recently computed value, then a sibling of the last node placed (an operator of its category
    reading a value it reads: two element-wise ops of one input, one kernel between them), then the
    program's own order. A program traced breadth first (a value used by a layout change and by an
    element-wise op, or by two products) then has its fusible consumers beside their producer.
    `siblings_first` puts a sibling before the reader of the newest value: a norm read by two products,
    one of which feeds a third, then has the norm and both products in one run (the chain's order has the
    norm, the first product and its consumer)."""
    producer = {v.name: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    needs = [{producer[v.name] for v in n.inputs if v.name in producer} for n in graph.nodes]
    done: dict = {}   # node index -> its position in the new order
    placed = []

    def sibling(i: int) -> bool:
        last = graph.nodes[placed[-1]] if placed else None
        node = graph.nodes[i]
        return last is not None and last.opdef.category == node.opdef.category and \
            bool({v.name for v in last.inputs} & {v.name for v in node.inputs})

    def key(i: int) -> tuple:
        liftable = LIFT_RULES.get(graph.nodes[i].op) is not None and graph.nodes[i].op not in HANDLED
        recent = max((done[p] for p in needs[i]), default=-1)
        return (liftable, sibling(i), recent, -i) if siblings_first else (liftable, recent, sibling(i), -i)

    while len(placed) < len(graph.nodes):
        ready = [i for i in range(len(graph.nodes)) if i not in done and needs[i] <= done.keys()]
        pick = max(ready, key=key)
        done[pick] = len(placed)
        placed.append(pick)
    return placed


def orders(graph: KernelGraph) -> list:
    """The orders a partition cuts into runs: chains first, and siblings first where that differs."""
    first, second = order(graph), order(graph, siblings_first=True)
    return [first] if first == second else [first, second]


def duplicated(graph: KernelGraph) -> Optional[KernelGraph]:
    """The program with each element-wise operator that several operators read computed once per reader
    (a copy for each reader after the first, placed before it; the original serves the first reader and the
    program's outputs), producers before their consumers' copies are counted, so a chain of element-wise
    steps is copied whole; None where no operator has two readers. Each copy computes the same values, so
    the program is the same function; a part can then fuse a copy into its reader's kernel (a scaled input
    in a product's prologue) where writing the value once for all its readers would need a tile no block
    holds, and a value no longer read needs no kernel. At most as many copies as the program has operators."""
    nodes = list(graph.nodes)
    taken = {v.name for v in graph.inputs} | {v.name for n in nodes for v in n.outputs}
    copied = 0
    k = len(nodes) - 1
    while k >= 0:
        node = nodes[k]
        if node.opdef.category != "elementwise" or len(node.outputs) != 1:
            k -= 1
            continue
        name = node.outputs[0].name
        readers = [r for r in range(k + 1, len(nodes)) if any(v.name == name for v in nodes[r].inputs)]
        if len(readers) < 2 or copied + len(readers) - 1 > len(graph.nodes):
            k -= 1
            continue
        for r in reversed(readers[1:]):   # the later readers first: earlier indices stay put
            copy = Var(fresh_name(name, taken), node.outputs[0].type)
            reader = nodes[r]
            nodes[r] = attrs.evolve(reader, inputs=[copy if v.name == name else v for v in reader.inputs])
            nodes.insert(r, attrs.evolve(node, outputs=[copy]))
            copied += 1
        k -= 1   # (the node's own producers, before it, now have its copies among their readers)
    return attrs.evolve(graph, nodes=nodes) if copied else None


def _connected(nodes) -> bool:
    """Whether the nodes form one group through the values they pass or share."""
    group = list(range(len(nodes)))

    def find(i):
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    first_reader: dict = {}
    producer = {v.name: i for i, n in enumerate(nodes) for v in n.outputs}
    for i, n in enumerate(nodes):
        for v in n.inputs:
            for j in (producer.get(v.name), first_reader.setdefault(v.name, i)):
                if j is not None:
                    group[find(i)] = find(j)
    return len({find(i) for i in range(len(nodes))}) == 1


class Partition:
    """One program's parts in one order of its nodes, their candidates and the best combination (see the
    module docstring). Partitions of the same program in other orders, or of its duplicated form, share
    `lifted`: a part is one set of operators reading and returning the same values, whichever partition
    makes it a run, and is lifted once."""

    def __init__(self, graph: KernelGraph, config: SearchConfig, stats: SearchStats, *,
                 max_flops: Optional[int] = None, work: str = "partition", nodes: Optional[list] = None,
                 lifted: Optional[dict] = None):
        """`max_flops`: parts of more floating-point work are left out (`generate_cheap`); `work`: the
        work allowance its liftings spend (its screens spend `work` + " screens"); `nodes`: the order (node
        indices of `graph`; default `order`); `lifted`: the parts already found in other orders."""
        self.order = order(graph) if nodes is None else list(nodes)
        graph = attrs.evolve(graph, nodes=[graph.nodes[i] for i in self.order])
        self.graph, self.config, self.stats = graph, config, stats
        self.max_flops, self.work, self.screen_work = max_flops, work, f"{work} screens"
        self.lifted = {} if lifted is None else lifted   # (its operators, inputs, outputs: names) -> _Part
        self.n = len(graph.nodes)
        single = [estimate(subprogram(graph, i, i + 1) or _lone(graph, i)) for i in range(self.n)]
        # A transpose that cuBLAS reads in place (its readers are library GEMMs: mdsl.lowering.gemm) costs
        # nothing left apart; a fused part that reads it needs it made, and pays its kernel (`_made`).
        in_place = library_read_transposes(graph)
        self.made_cost = {graph.nodes[i].outputs[0].name: single[i] for i in in_place}
        self.single = [attrs.evolve(c, seconds=0.0, dram_bytes=0, launches=0, flops=0, kernels=())
                       if i in in_place else c for i, c in enumerate(single)]
        self.parts: dict = {}
        self.stopped = ""   # "work" or "time" when the search's allowance or cap ended the analysis

    # -- the parts -------------------------------------------------------------------------------

    def analyse(self, rest: bool = True) -> None:
        """`probe`, `refine`, then (`rest`) `refine_rest`."""
        self.probe()
        self.refine()
        if rest:
            self.refine_rest()

    def probe(self) -> None:
        """Every part probed, shortest first (each fusion of two operators before the longer ones)."""
        for length in range(2, min(MAX_PART_NODES, self.n) + 1):
            for start in range(0, self.n - length + 1):
                part = self._part(start, start + length)
                if part is not None and part.status == NOT_TRIED and not self.stopped:
                    self._lift(part, refine=False)

    def refine(self) -> None:
        """The parts of the best combination lifted under every choice, the combination solved again, until
        it uses refined parts only."""
        while not self.stopped:
            pending = [self.parts[i, j] for i, j, option in self.best()
                       if option is not None and not self.parts[i, j].refined]
            if not pending:
                break
            for part in pending:
                if not self.stopped:
                    self._lift(part, refine=True)

    def refine_rest(self) -> None:
        """The other parts that lift, under every choice, those whose probes save the most against their
        operators apart first."""
        rest = sorted(((i, j) for (i, j), p in self.parts.items()
                       if p is not None and p.status == FUSED and not p.refined),
                      key=lambda s: (self._apart(*s) - self.parts[s].options[0][1].seconds, s[1] - s[0]),
                      reverse=True)
        for span in rest:
            if not self.stopped and not self.parts[span].refined:
                self._lift(self.parts[span], refine=True)

    def _part(self, start: int, stop: int) -> Optional[_Part]:
        if (start, stop) in self.parts:
            return self.parts[start, stop]
        nodes = self.graph.nodes[start:stop]
        program = subprogram(self.graph, start, stop)
        if program is None:
            self.parts[start, stop] = None
            return None
        # the same operators reading and returning the same values: the same part in any order or form
        key = (frozenset(n.outputs[0].name for n in nodes), frozenset(v.name for v in program.inputs),
               frozenset(v.name for v in program.outputs))
        if key in self.lifted:
            self.parts[start, stop] = self.lifted[key]
            return self.lifted[key]
        part = _Part(program)
        blocked = next((n for n in nodes if LIFT_RULES.get(n.op) is None), None)
        # layout changes move to the boundary where they can (views cost nothing); a reshape that
        # stays inside lifts where the tiles hold whole groups (`guided`)
        if (blocked is None or blocked.op in HANDLED) and any(n.op in HANDLED for n in nodes):
            part.wrapped = boundary_views(program, LIFT_RULES)
        if blocked is not None and part.wrapped is None:
            part.status, part.reason = UNLIFTABLE, _unliftable(blocked)
        elif not _connected(nodes):
            part.status, part.reason = DISCONNECTED, "the kernels share no tensor"
        elif self.max_flops is not None and estimate(program).flops > self.max_flops:
            part.status = DEAR
            part.reason = (f"it is dear to verify ({estimate(program).flops / 1e9:.3g} GFLOP), so it comes "
                           "after the cheap parts")
        self.parts[start, stop] = self.lifted[key] = part
        return part

    def _apart(self, start: int, stop: int) -> float:
        """The estimated seconds of the operators start..stop-1, each a kernel of its own."""
        return sum(s.seconds for s in self.single[start:stop])

    def _lift(self, part: _Part, refine: bool) -> None:
        """Lift the part under each structure's probe (`guided.lift_all`'s probes_only), or, to `refine`
        it, under every choice; its options are the cheapest PART_CANDIDATES of what either found."""
        wrapped, program = part.wrapped, part.program
        result = lift_all(program if wrapped is None else wrapped.core, self.config, self.stats, work=self.work,
                          limit=PART_CANDIDATES, probe=True, probes_only=not refine, max_split=PART_MAX_SPLIT)
        if not result.complete:
            self.stopped = "time" if self.stats.out_of_time() else "work"
        found = result.candidates if wrapped is None else \
            [attrs.evolve(program, nodes=wrapped.around(g)) for g in result.candidates]
        if not found and not part.options:   # no probe lifts: neither does any other choice
            part.complete = result.complete
            if result.complete:
                part.status, part.reason = NO_LIFT, _no_lift_reason(result.failures)
            return
        keys = {g.key for g in found}
        options = [[g, estimate(g), None] for g in found] + [o for o in part.options if o[0].key not in keys]
        part.options = sorted(options, key=lambda o: o[1])[:PART_CANDIDATES]
        part.status = FUSED
        part.refined = part.refined or refine
        part.complete = refine and result.complete

    # -- the combination ---------------------------------------------------------------------------

    def best(self, excluded: frozenset = frozenset()) -> list:
        """[(start, stop, option or None)] covering every node, the least total estimated cost; parts in
        `excluded` ((start, stop) pairs) are left out."""
        inf = (float("inf"), 0)
        best = [(0.0, 0)] + [inf] * self.n
        back: list = [None] * (self.n + 1)
        for j in range(1, self.n + 1):
            s = self.single[j - 1]
            best[j], back[j] = (best[j - 1][0] + s.seconds, best[j - 1][1] + s.launches), (j - 1, None)
            for i in range(max(0, j - MAX_PART_NODES), j - 1):
                part = self.parts.get((i, j))
                option = part.current() if part is not None and (i, j) not in excluded else None
                if option is None:
                    continue
                made = self._made(i, j)
                total = (best[i][0] + option[1].seconds + sum(c.seconds for c in made),
                         best[i][1] + option[1].launches + len(made))
                if total < best[j]:
                    best[j], back[j] = total, (i, option)
        out, j = [], self.n
        while j > 0:
            i, option = back[j]
            out.append((i, j, option))
            j = i
        return out[::-1]

    def total(self, combination: list) -> tuple:
        """A combination's estimated (seconds, launches)."""
        seconds, launches = 0.0, 0
        for i, j, option in combination:
            costs = [self.single[i]] if option is None else [option[1], *self._made(i, j)]
            seconds += sum(c.seconds for c in costs)
            launches += sum(c.launches for c in costs)
        return seconds, launches

    def _made(self, i: int, j: int) -> list:
        """The costs of the transposes cuBLAS would read in place (`made_cost`) that nodes i .. j - 1 read:
        fused into a part's kernel, they read the transpose's value, which must then be made."""
        if not self.made_cost:
            return []
        names = {v.name for node in self.graph.nodes[i:j] for v in node.inputs if v.name in self.made_cost}
        return [self.made_cost[name] for name in sorted(names)]

    def screened_best(self, excluded: frozenset = frozenset()) -> list:
        """`best`, after screening the candidates it uses (a failed one gives way to the part's next)."""
        while True:
            combination = self.best(excluded)
            pending = [(i, j, o) for i, j, o in combination if o is not None and o[2] is None]
            if not pending:
                return combination
            for i, j, option in pending:
                part = self.parts[i, j]
                late = self.stats.out_of_time()
                if late or not self.stats.work(self.screen_work, SCREEN_STEPS):
                    self.stopped = self.stopped or ("time" if late else "work")
                    option[2] = _UNSCREENED
                    failure = (f"the search's {'time cap' if late else 'work budget'} ran out "
                               "before its fused candidate was screened")
                else:
                    failure = screen(part.program, option[0], self.config.seed)
                    option[2] = True if failure is None else failure
                if failure is not None and part.current() is None:
                    part.status, part.reason = SCREENED_OUT, failure

    def assemble(self, combination: list) -> KernelGraph:
        """The program with each chosen part replaced by its candidate (kernel-level names kept unique)."""
        taken = {v.name for v in self.graph.inputs} | {v.name for n in self.graph.nodes for v in n.outputs}
        nodes: list = []
        for i, j, option in combination:
            if option is None:
                nodes.extend(self.graph.nodes[i:j])
            else:
                nodes.extend(_renamed(option[0], self.parts[i, j].program, taken))
        return KernelGraph(self.graph.name, self.graph.inputs, nodes, self.graph.outputs)

    # -- the record --------------------------------------------------------------------------------

    def record(self, assemblies: dict) -> dict:
        """What the plan's explanation reads: per analysed part its status and reason, the best fused
        option's cost, and which parts each yielded assembly used."""
        parts = {}
        for (i, j), part in self.parts.items():
            if part is None:
                continue
            option = part.current()
            parts[f"{i}:{j}"] = {"status": part.status, "reason": part.reason, "complete": part.complete,
                                "fused_s": option[1].seconds if option is not None else None,
                                "launches": option[1].launches if option is not None else None,
                                "copies": sum(k.name in ("split", "concat") for k in option[1].kernels)
                                if option is not None else None,
                                "apart_s": self._apart(i, j)}
        return {"nodes": [_describe(n) for n in self.graph.nodes], "program": self.graph,
                "order": [n.outputs[0].name for n in self.graph.nodes], "parts": parts, "stopped": self.stopped,
                "max_part_nodes": MAX_PART_NODES, "assemblies": assemblies,
                "single_s": [s.seconds for s in self.single]}


def _lone(graph: KernelGraph, i: int) -> KernelGraph:
    """Node i alone as a program (a node whose outputs nothing reads)."""
    node = graph.nodes[i]
    ins = list({v.name: v for v in node.inputs}.values())
    return KernelGraph(f"{graph.name}_node{i}", ins, [node], list(node.outputs))


def _unliftable(node: Node) -> str:
    what = "a layout change" if node.opdef.category == "layout" else f"a {node.opdef.category} operator"
    return f"{node.op} %{node.outputs[0].name} is {what} without a block-level rule: it runs as a kernel of its own"


def _no_lift_reason(failures: dict) -> str:
    """The reason most choices gave; for shared memory, the least any choice needs."""
    if not failures:
        return "no grid or loop choice exists for it"
    smem = [m for _, m in failures.values() if "of shared memory" in m]
    if smem:
        least = min(float(m.split("need ")[1].split(" KB")[0]) for m in smem)
        return (f"its tiles need at least {least:.0f} KB of shared memory per block under every grid and loop "
                f"choice that lifts it, over the {SMEM_LIMIT_BYTES // 1024} KB limit")
    count, message = max(failures.values(), key=lambda cm: cm[0])
    total = sum(c for c, _ in failures.values())
    return f"no grid or loop choice lifts it ({count} of {total}: {message})"


def _describe(node: Node) -> str:
    return f"{node.op} %{node.outputs[0].name}" if node.outputs else node.op


def _renamed(candidate: KernelGraph, program: KernelGraph, taken: set) -> list:
    """The candidate's nodes, each value it defines that its program does not return renamed apart from
    `taken` (which grows)."""
    keep = {v.name for v in program.outputs}
    names: dict = {}
    for n in candidate.nodes:
        for v in n.outputs:
            if v.name in keep:
                continue
            name, k = v.name, 0
            while name in taken:
                k += 1
                name = f"{v.name}_{k}"
            taken.add(name)
            names[v.name] = name

    def rename(v: Var) -> Var:
        return Var(names[v.name], v.type) if v.name in names else v

    return [attrs.evolve(n, inputs=[rename(v) for v in n.inputs], outputs=[rename(v) for v in n.outputs])
            for n in candidate.nodes]


def generate(graph: KernelGraph, config: SearchConfig = SearchConfig(), stats: Optional[SearchStats] = None
             ) -> Iterator[KernelGraph]:
    """The best combination of fused parts, then up to FALLBACKS combinations each without one of its
    fused parts (verified only if the best is not), each an `Assembly` (verified part by part); nothing
    where no part fuses. Records what it learned in `stats.partition` (with what `generate_cheap`
    recorded before it that this analysis did not reach)."""
    stats = stats if stats is not None else SearchStats()
    if len(graph.nodes) < 2:
        return
    yield from _assemblies(graph, config, stats)


def generate_cheap(graph: KernelGraph, config: SearchConfig = SearchConfig(), stats: Optional[SearchStats] = None
                   ) -> Iterator[KernelGraph]:
    """For a program of more than DEAR_FLOPS: `generate` over its parts of at most CHEAP_PART_FLOPS
    (its own work allowances, "cheap parts" and "cheap parts screens"); nothing for another program."""
    stats = stats if stats is not None else SearchStats()
    if len(graph.nodes) < 2 or estimate(graph).flops <= DEAR_FLOPS:
        return
    yield from _assemblies(graph, config, stats, max_flops=CHEAP_PART_FLOPS, work="cheap parts")


def analysed(graph: KernelGraph, config: SearchConfig, stats: SearchStats, **options) -> list:
    """The program partitioned in each of its `orders`, then its `duplicated` form in each of that one's and
    its own, one partition after the other (each probed, refined and its other parts refined before the next
    spends any work: the first, the program in the chains' order, finds what it finds alone; a part is
    lifted once whichever partition has it). The copies' form refines only the parts its best combination
    uses: its other parts are mostly the program's with a copy added, whose refinement costs a search as
    much again for what the program's own parts mostly give."""
    lifted: dict = {}
    program_orders = orders(graph)
    partitions = [Partition(graph, config, stats, nodes=nodes, lifted=lifted, **options) for nodes in program_orders]
    copies = duplicated(graph)
    if copies is not None:   # (its own order has each copy right before its reader)
        own = list(range(len(copies.nodes)))
        copies_orders = orders(copies)
        copies_orders += [own] if own not in copies_orders else []
        partitions += [Partition(copies, config, stats, nodes=nodes, lifted=lifted, **options)
                       for nodes in copies_orders]
    written = len(program_orders)
    for k, partition in enumerate(partitions):   # (the copies' form: only the parts its best combination uses)
        if not any(p.stopped for p in partitions):
            partition.analyse(rest=k < written)
    stopped = next((p.stopped for p in partitions if p.stopped), "")
    for partition in partitions:
        partition.stopped = stopped
    return partitions


def _assemblies(graph: KernelGraph, config: SearchConfig, stats: SearchStats, **options) -> Iterator[KernelGraph]:
    """The best combination of the program in the chains' order, then its fallbacks; before them, the best
    combination of each other partition (`analysed`) that is cheaper, cheapest first (each verified whatever
    becomes of the others: the finer model that orders the verified candidates may prefer any of them)."""
    partitions: list = []
    found: list = []   # (partition, {candidate key: spans}, its candidates)
    try:
        partitions = analysed(graph, config, stats, **options)
        first = partitions[0]
        bests = [(p.total(p.screened_best()), k) for k, p in enumerate(partitions)]
        cheaper = [partitions[k] for cost, k in sorted(bests) if cost < bests[0][0]]
        taken: set = set()
        for partition in (*cheaper, first):
            combination = partition.screened_best()
            fused = [(i, j) for i, j, o in combination if o is not None]
            plans = [combination] if fused else []
            for span in (fused[:FALLBACKS] if len(fused) > 1 and partition is first else ()):
                other = partition.screened_best(frozenset({span}))
                if any(o is not None for _, _, o in other):
                    plans.append(other)
            assemblies, candidates = {}, []
            for plan in plans:
                candidate = partition.assemble(plan)
                validate_kernel_graph(candidate)
                if candidate.key not in taken:
                    taken.add(candidate.key)
                    assemblies[candidate.key] = [[i, j] for i, j, o in plan if o is not None]
                    parts = tuple((partition.parts[i, j].program, o[0]) for i, j, o in plan if o is not None)
                    primary = candidates[0].graph.key if candidates else None
                    candidates.append(Assembly(candidate, parts, primary))
            found.append((partition, assemblies, candidates))
    finally:   # also when the search stops it early: the explanation reads what it learned
        if partitions:
            mine = next((a for p, a, _ in found if p is partitions[0]), {})
            record = partitions[0].record(mine)
            others = [p.record(a) for p, a, _ in found if p is not partitions[0]]
            if others:
                record["others"] = others
            stats.partition = _merged_record(record, stats.partition)
    for _, _, candidates in found:
        yield from candidates


def _merged_record(record: dict, earlier: Optional[dict]) -> dict:
    """`record` with what an earlier analysis of the same program (`generate_cheap`'s) found that it does
    not have: that one's assemblies after its own (the first is the analysis' best), and its parts where
    this one has none or did not try them (an earlier span that is no run of this record's order is left
    out)."""
    if not earlier:
        return record
    moved = _span_mover(earlier["order"], record["order"])
    assemblies = {**record["assemblies"]}
    for key, spans in earlier["assemblies"].items():
        runs = [moved(i, j) for i, j in spans]
        if key not in assemblies and None not in runs:
            assemblies[key] = [list(run) for run in runs]
    parts = dict(record["parts"])
    for span, part in earlier["parts"].items():
        run = moved(*map(int, span.split(":")))
        if run is None:
            continue
        span = f"{run[0]}:{run[1]}"
        if span not in parts or (parts[span]["status"] == NOT_TRIED and part["status"] != DEAR):
            parts[span] = part
    others = [*record.get("others", ()), *earlier.get("others", ())]
    return {**record, "assemblies": assemblies, "parts": parts, **({"others": others} if others else {})}


def _span_mover(before: list, after: list):
    """(i, j) -> the run of the `after` order holding the nodes before[i:j], or None where they are no run
    (or not all in it: a copy of the other's `duplicated` form)."""
    at = {node: k for k, node in enumerate(after)}

    def moved(i: int, j: int) -> Optional[tuple]:
        if any(node not in at for node in before[i:j]):
            return None
        places = sorted(at[node] for node in before[i:j])
        return (places[0], places[-1] + 1) if places[-1] - places[0] == j - i - 1 else None
    return moved

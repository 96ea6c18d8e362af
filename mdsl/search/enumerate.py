"""Exhaustive generation: one custom kernel for the whole program, its block graph enumerated
bottom-up in canonical order and pruned by abstract expressions (Mirage §3.1-3.3).

It fills in behind the guided generator: it knows no lifting rules, only the registry's block
operators with their shape rules (`infer`), dimension facts (`dims`) and abstract expressions
(`abstract`), so it finds block graphs that no rule describes.

**Outer choices** come from the program's dimension labels (`dims.Labels`), so that they are
consistent by construction. A *grid* splits up to three *free* labels (indices of every output that no
operator contracts); each input and output with such a label is split along it (its imap/omap), the
others are replicated. A *frame* is a loop choice: a contracted label that no output has, walked by
the for-loop in every input that has it (its fmap), and a range R from the config; or no loop.

**Inner search**, once per frame: a depth-first search adds block operators one at a time, on tiles of
the *unsplit* tensors (only the loop cuts them). No block operator may reduce a free label, so shapes,
labels and abstract terms do not depend on the grid, and each closed block graph (a *program*) is
instantiated afterwards for every grid and thread count, cheapest first by the cost model. A value
carries its tile type, a label per dim (None for size 1), its abstract term and its phase (in the loop
or after it). Candidate operators are pruned, each counted under its reason in `stats`:

* ``order``: an operator's rank, (newest operand, operands, operator, attributes), must exceed the
  previous operator's. Every DAG of operators has exactly one such order (the greedy topological
  one), so no program comes twice and none is missed; commutative operators take sorted operands.
* ``phase``: accumulators take loop values; other operators do not mix the loop and after it.
* ``dead-end``: what nobody reads yet (inputs included) can still be read or be an output within
  ``max_block_ops``, and unread loop values can still reach an accumulator.
* ``shape``: the registry's shape rule rejects the tiles.
* ``dims``: aligned dims carry one label; reduced dims carry a label the program contracts; a loop
  dim summed chunk-wise by an accumulator (`Folded`) may be reduced but not contracted by a matmul.
* ``abstract-expression``: the term is not a subexpression of an output's (`SubexprChecker`, after
  a polynomial-degree bound that needs no z3); ``abstract-expression: unknown`` where z3 ran out of
  its resource limit without an answer (pruned all the same: the search's bound, not a refutation).
* ``stabiliser``, ``rescale``: the abstract rules drop a max subtracted inside exp and a rescaling
  accumulator's scale, which is right only in softmax; so a max is computed only by programs that
  compute one, and a rescaling accumulator's scale is a max the accumulated value was shifted by.
* ``loop-invariant``: a value that does not depend on the loop is accumulated only by a max (any
  other accumulator would add R copies).
* ``redundant``: the value is already there, or a sibling computes it (same type, labels, term).
* ``shared-memory``: the tiles do not fit even under the finest grid (and, per grid, at the end).

A block graph *closes* when no loop value is left unread and every unread value is an output: each
output is matched by a post-loop value with its type, its labels and an equivalent term (each a
subexpression of the other). Terms forget indices and some axioms hold only with them (a sum of a
product with a factor constant along the sum), so a closed program is also run once, as one block,
in float64 against the program, at reduced sizes (``numerics``; `_Screen` says which, and counts
under ``unscreened`` the programs it leaves to the verifier). The search ends when every frame is
done, after ``max_states`` states (the config's work budget: a count, so that where it stops does not
depend on the machine's speed), or at the search's deadline (the wall-clock cap), which every z3
query also stops at; the reason is counted under ``stopped``.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import attrs
import numpy as np

from mdsl.backend.reference import run_kernel_graph
from mdsl.errors import MdslError
from mdsl.ir.dtypes import f32
from mdsl.ir.graph import BlockGraph, BlockInput, BlockOutput, KernelGraph, Node
from mdsl.ir.ops import BLOCK, OPS, OpDef
from mdsl.ir.types import TensorType, Var, fresh_name
from mdsl.ir.validate import SMEM_LIMIT_BYTES, input_tile_type, shared_memory_peak, validate_kernel_graph
from mdsl.passes.abstract import Term, abstract_terms, node_terms, subterms, var
from mdsl.passes.subexpr import OutOfTime, SubexprChecker
from mdsl.search.config import SearchConfig
from mdsl.search.cost import estimate
from mdsl.search.dims import DIMS_RULES, Labels
from mdsl.search.resize import elements as _elements, encodes_size, float_constants, seen_attributes
from mdsl.search.stats import PRUNED, SearchStats

#: The smallest chunk of the loop label one iteration works on (smaller dims allow two iterations).
MIN_LOOP_CHUNK = 8
#: Each z3 query's wall-clock limit: a safety only. The deterministic resource limit (`subexpr.DEFAULT_RLIMIT`)
#: decides every query, so that what is pruned does not depend on how busy the machine is.
Z3_TIMEOUT_MS = 60_000
#: z3 resource units (`SubexprStats.rlimit`) a step of the work budget grants the enumeration's
#: abstract-expression queries: a state costs one step and the queries their units, so that a program
#: whose states each need long queries ends by its work budget, not by the wall-clock cap, the same on any
#: machine. The ten benchmark kernels' whole enumerations spend at most 24 M units (ntrans), under half
#: of the 50 M a budget of 10,000 steps grants.
SOLVER_UNITS_PER_STEP = 5_000


class _OutOfBudget(Exception):
    """The state, solver or time budget ran out."""


# ---------------------------------------------------------------------------------------------
# labels

@attrs.frozen
class Joined:
    """The label of a dim that joins dims of other labels (a concat along it)."""

    parts: tuple


@attrs.frozen
class Folded:
    """The label of a loop-label dim after a plain accumulator: each element sums one position of
    every chunk. A reduction of the tile finishes the sum; a matmul over it would multiply sums."""

    label: Any


def _var_labels(labels: Labels, v: Var) -> tuple:
    return tuple(labels.label(v.name, d) if n > 1 else None for d, n in enumerate(v.shape))


def _result_labels(node: Node, operands: list, contracted: frozenset, loop) -> Optional[tuple]:
    """The labels of `node`'s result, or None when its dims do not line up. `loop` is the label the
    for-loop walks (None without a loop)."""
    opdef = node.opdef
    facts = DIMS_RULES[node.op](node)
    out = node.outputs[0].shape
    result: list = [None] * len(out)
    for (i, d), (_, e) in facts.same:
        label = operands[i][d]
        if label is None:
            continue
        if result[e] not in (None, label):
            return None
        result[e] = label
    for (i, d), (j, e) in facts.joint:
        if operands[i][d] != operands[j][e] or isinstance(operands[i][d], Folded):
            return None
    if not all(_reducible(operands[i][d], contracted) for i, d, _ in facts.contracted):
        return None
    for e, n in enumerate(out):
        if n > 1 and result[e] is None:  # a dim no fact relates, such as the one a concat joins
            parts = tuple(labels[e] for labels in operands if len(labels) == len(out))
            if len(set(parts)) < len(parts):  # pieces of one index side by side: a copy, not a join
                return None
            result[e] = Joined(parts)
    if opdef.is_accumulator and loop is not None:
        result = [Folded(l) if l == loop else l for l in result]
    return tuple(result)


def _reducible(label, contracted: frozenset) -> bool:
    """May a block operator reduce a dim of this label? Only one the program contracts."""
    if isinstance(label, Joined):
        return all(_reducible(p, contracted) for p in label.parts)
    if isinstance(label, Folded):
        return _reducible(label.label, contracted)
    return label in contracted


# ---------------------------------------------------------------------------------------------
# a cheap refutation

_LINEAR_HEADS = frozenset({"add", "neg", "sum", "max", "concat"})


def _degree(term: Term) -> float:
    """The polynomial degree of a term in the inputs, infinite where a head is not a polynomial one.
    The axioms keep the degree of a polynomial, and its subexpressions have no larger degree, so a
    term of a larger degree than every target's is no subexpression of one (no z3 needed)."""
    if term.head in ("var", "const"):
        return 1 if term.head == "var" else 0
    degrees = [_degree(a) for a in term.args]
    if term.head == "mul":
        return sum(degrees)
    return max(degrees) if term.head in _LINEAR_HEADS else math.inf


# ---------------------------------------------------------------------------------------------
# outer choices

@attrs.frozen
class Frame:
    loop: Any = None       # the label the for-loop walks, or None
    forloop: int = 1


@attrs.frozen
class Grid:
    splits: tuple = ()     # ((label, parts), ...) for grid dims x, y, z

    @property
    def dims(self) -> tuple:
        sizes = tuple(p for _, p in self.splits)
        return sizes + (1,) * (3 - len(sizes))

    @property
    def blocks(self) -> int:
        return math.prod(self.dims)

    def map_of(self, labels: tuple) -> tuple:
        """The imap/omap of a tile with these dim labels: the dim each grid dim splits, or None."""
        out = tuple(labels.index(l) if l in labels else None for l, _ in self.splits)
        return out + (None,) * (3 - len(out))


def _powers_of_two(n: int) -> list:
    return [p for p in (2 ** k for k in range(n.bit_length())) if n % p == 0]


def _splits(n: int, limit: int) -> list:
    """Ways to split a dim of size n over blocks: powers of two, or whatever leaves power-of-two tiles."""
    powers = _powers_of_two(n)
    return sorted({p for p in powers if 1 < p <= limit} | {n // t for t in powers if 1 < n // t <= limit})


def _grids(free: list, labels: Labels, config: SearchConfig) -> list:
    """Grids over up to three free labels with at most max_blocks blocks, and at least min_blocks (or as
    many as the program has, when fewer)."""
    grids = []
    for k in range(min(3, len(free)) + 1):
        for chosen in itertools.combinations(free, k):
            for parts in itertools.product(*(_splits(labels.size(l), config.max_blocks) for l in chosen)):
                if math.prod(parts) <= config.max_blocks:
                    grids.append(Grid(tuple(zip(chosen, parts))))
    floor = min(config.min_blocks, max(g.blocks for g in grids))
    return [g for g in grids if g.blocks >= floor]


def _loop_ranges(n: int, config: SearchConfig) -> list:
    chunk = max(2, min(MIN_LOOP_CHUNK, n // 2))
    return [r for r in sorted(config.forloop_ranges) if r > 1 and n % r == 0 and n // r >= chunk]


# ---------------------------------------------------------------------------------------------
# the operators the search tries

@attrs.frozen
class _Operator:
    opdef: OpDef
    arity: int
    commutative: bool
    idempotent: bool     # an accumulator that gives back a tile accumulated several times unchanged


def _commutative(op: OpDef) -> bool:
    """A binary element-wise operator whose abstract expression ignores the operands' order."""
    if not (op.is_elementwise and op.arity == 2):
        return False
    t = TensorType((2,), f32)
    node = Node(op.name, [Var("a", t), Var("b", t)], [Var("c", t)], op.normalize_attrs({}))
    return node_terms(node, [var(0), var(1)]) == node_terms(node, [var(1), var(0)])


#: Block-level operators the enumeration leaves out: a block-level reshape's shape is a tile's, which no
#: attribute of the program gives (the guided lifting places it, where tiles hold whole groups), and a
#: transpose only moves a tile's elements (the guided lifting places it where the program transposes).
NOT_ENUMERATED = frozenset({"reshape", "transpose"})


def _operators() -> list:
    """Every block-level operator of the registry (n-ary ones with two operands) but NOT_ENUMERATED, by name."""
    ops = sorted((op for op in OPS.values() if BLOCK in op.levels and not op.is_graph_defined
                  and op.name not in NOT_ENUMERATED), key=lambda o: o.name)
    return [_Operator(op, op.arity or 2, _commutative(op), _idempotent(op)) for op in ops]


def _idempotent(op: OpDef) -> bool:
    """An accumulator (of one operand) whose reference gives back a tile accumulated twice (a max)."""
    if not (op.is_accumulator and op.arity == 1):
        return False
    tile = np.arange(1.0, 5.0).reshape(2, 2)
    (out,) = op.reference([[tile], [tile]], dict(op.normalize_attrs({})))
    return out.shape == tile.shape and np.array_equal(out, tile)


class _Attributes:
    """The attribute choices of an operator on operands of a given rank: every dim for `dim`, both
    values of a flag, and for the rest the values the program itself uses (or the default)."""

    def __init__(self, graph: KernelGraph):
        self.seen = {key: tuple(values) for key, values in seen_attributes(graph).items()}
        self.cache: dict = {}

    def choices(self, op: OpDef, rank: int) -> list:
        """(normalised attribute pairs, their text for ranking) for each choice."""
        key = (op.name, rank)
        if key not in self.cache:
            options = [[(spec.name, v) for v in self._values(spec, rank)] for spec in op.attr_specs]
            normal = [op.normalize_attrs(dict(combo)) for combo in itertools.product(*options)]
            self.cache[key] = [(pairs, repr(pairs)) for pairs in normal]
        return self.cache[key]

    def _values(self, spec, rank: int) -> tuple:
        if spec.name == "dim":
            return tuple(range(rank))
        if spec.kind == "bool":
            return (False, True)
        return self.seen.get((spec.name, spec.kind)) or (() if spec.required else (spec.default,))


# ---------------------------------------------------------------------------------------------
# the problem: what does not change between frames

@attrs.frozen
class _Target:
    type: TensorType
    labels: tuple
    term: Term


class _Problem:
    def __init__(self, graph: KernelGraph, config: SearchConfig):
        self.graph, self.config = graph, config
        self.labels = Labels(graph)
        terms = abstract_terms(graph)
        self.targets = [_Target(v.type, _var_labels(self.labels, v), terms[v.name]) for v in graph.outputs]
        self.degree = max(_degree(t.term) for t in self.targets)
        self.computes_max = any(t.head == "max" for term in terms.values() for t in subterms(term))
        read = {t.param for target in self.targets for t in subterms(target.term) if t.head == "var"}
        self.used = [i for i in range(len(graph.inputs)) if i in read]  # the inputs the outputs depend on
        self.input_labels = [_var_labels(self.labels, graph.inputs[i]) for i in self.used]
        self.contracted = frozenset(self.labels.contracted_labels())
        out_labels = [set(t.labels) - {None} for t in self.targets]
        self.free = sorted(set.intersection(*out_labels) - self.contracted) if out_labels else []
        self.grids = _grids(self.free, self.labels, config)
        self.finest = {l: max(dict(g.splits).get(l, 1) for g in self.grids) for l in self.free}
        self.frames = self._frames(set().union(*out_labels))
        self.operators = _operators()
        self.attributes = _Attributes(graph)

    def _frames(self, output_labels: set) -> list:
        read = {l for labels in self.input_labels for l in labels} - {None}
        loops = sorted(self.contracted & read - output_labels)
        return [Frame(l, r) for l in loops for r in _loop_ranges(self.labels.size(l), self.config)] + [Frame()]

    def supported(self) -> bool:
        """One custom op can stand for the program: its outputs are distinct computed tensors."""
        names = [v.name for v in self.graph.outputs]
        computed = {v.name for n in self.graph.nodes for v in n.outputs}
        return len(set(names)) == len(names) and set(names) <= computed and bool(self.used)

    def smallest(self, t: TensorType, labels: tuple) -> TensorType:
        """A tile's size under the finest split of each free label: a lower bound on every grid."""
        return t.with_shape([-(-n // self.finest.get(l, 1)) for n, l in zip(t.shape, labels)])


# ---------------------------------------------------------------------------------------------
# the inner search

@attrs.frozen
class Value:
    var: Var             # one loop iteration's tile of the unsplit tensors
    small: Var           # the same under the finest grid (for the shared-memory bound)
    labels: tuple
    term: Term
    post: bool           # computed after the loop
    looped: bool         # depends on what the loop walks (constant over the loop otherwise)
    ancestors: frozenset = frozenset()  # the indices of the values it is computed from


@attrs.frozen
class Step:
    op: str
    operands: tuple
    attrs: tuple


@attrs.frozen
class Program:
    """A closed block graph: its frame, its operators and the value each output takes."""

    frame: Frame
    steps: tuple
    outputs: tuple
    labels: tuple        # the labels of every value, inputs first


class _Budget:
    """The generator's states (at most `max_states`), its z3 queries' resource units (at most
    `max_states` x SOLVER_UNITS_PER_STEP, as `solver_units()` counts them) and the search's deadline (the
    wall-clock cap)."""

    def __init__(self, max_states: int, stats: SearchStats):
        self.max_states, self.stats = max_states, stats
        self.states = 0
        self.solver_units: Callable[[], int] = lambda: 0

    def tick(self) -> None:
        """One more state (and a poll of the search: its counts reach it only when a frame ends)."""
        self.states += 1
        if self.states > self.max_states:
            raise _OutOfBudget("states")
        if self.solver_units() > self.max_states * SOLVER_UNITS_PER_STEP:
            raise _OutOfBudget("solver")
        self.check_time()
        self.stats.poll()

    def check_time(self) -> None:
        if self.time_left() <= 0:
            raise _OutOfBudget("time")

    def time_left(self) -> float:
        """Seconds before the search's deadline."""
        return math.inf if self.stats.deadline is None else self.stats.deadline - time.monotonic()


class _Matcher:
    """Does a value's term compute an output's: is each a subexpression of the other?"""

    def __init__(self, targets: list, time_left: Optional[Callable[[], float]] = None):
        self.targets = [t.term for t in targets]
        self.time_left = time_left
        self.forward = [SubexprChecker([t], time_left=time_left, timeout_ms=Z3_TIMEOUT_MS) for t in self.targets]
        self.backward: dict = {}
        self.spent = 0   # the z3 resource units its checkers' queries spent (kept as they go: a budget reads it
        # at every state, and the backward checkers are one a term)

    def rlimit(self) -> int:
        return self.spent

    def matches(self, term: Term, k: int) -> bool:
        target = self.targets[k]
        if term is target:
            return True
        if term not in self.backward:
            self.backward[term] = SubexprChecker([term], time_left=self.time_left, timeout_ms=Z3_TIMEOUT_MS)
        forward, backward = self.forward[k], self.backward[term]
        before = forward.stats.rlimit + backward.stats.rlimit
        try:
            return forward.is_subexpression(term) and backward.is_subexpression(target)
        finally:
            self.spent += forward.stats.rlimit + backward.stats.rlimit - before


class _Search:
    """The depth-first search of one frame; `checker` and `matcher` are shared between frames."""

    def __init__(self, problem: _Problem, frame: Frame, checker: Optional[SubexprChecker], matcher: _Matcher,
                 budget: _Budget, stats: SearchStats):
        self.problem, self.frame, self.checker, self.matcher = problem, frame, checker, matcher
        self.budget, self.stats = budget, stats
        self.max_ops = problem.config.max_block_ops
        self.values: list = [self._input(slot) for slot in range(len(problem.used))]
        self.n_inputs = len(self.values)
        self.steps: list = []
        self.ranks: list = []
        self.uses: list = [0] * self.n_inputs
        self.seen: set = {self._identity(v) for v in self.values}
        self.outcomes: dict = {}   # (operator, attributes, operand identities) -> Value fields, or a reason
        self.pruned: Counter = Counter()

    def _input(self, slot: int) -> Value:
        labels = self.problem.input_labels[slot]
        tensor = self.problem.graph.inputs[self.problem.used[slot]]
        fmap = labels.index(self.frame.loop) if self.frame.loop in labels else None
        tile = input_tile_type(tensor.type, (1, 1, 1), self.frame.forloop, (None,) * 3, fmap)
        v = Var(f"v{slot}", tile)
        return Value(v, Var(v.name, self.problem.smallest(tile, labels)), labels, var(self.problem.used[slot]), False,
                     fmap is not None)

    @staticmethod
    def _identity(v: Value) -> tuple:
        return v.var.type, v.labels, v.post, v.term

    def run(self) -> Iterator[Program]:
        try:
            yield from self._walk()
        finally:
            for reason, n in sorted(self.pruned.items()):
                self.stats.count(PRUNED, reason, n)

    # -- the walk --------------------------------------------------------------------------------

    def _walk(self) -> Iterator[Program]:
        self.budget.tick()
        outputs = self._closing()
        if outputs is not None:
            yield Program(self.frame, tuple(self.steps), outputs, tuple(v.labels for v in self.values))
        if len(self.steps) == self.max_ops:
            return
        children: set = set()  # siblings that compute the same value lead to the same programs
        for rank, op, operands, attr_pairs in self._candidates():
            value = self._try(op, operands, attr_pairs)
            if value is None:
                continue
            if self._identity(value) in children:
                self.pruned["redundant"] += 1
                continue
            children.add(self._identity(value))
            self._push(rank, Step(op.name, operands, attr_pairs), value)
            yield from self._walk()
            self._pop()

    def _push(self, rank: tuple, step: Step, value: Value) -> None:
        for i in set(step.operands):
            self.uses[i] += 1
        self.steps.append(step)
        self.ranks.append(rank)
        self.values.append(value)
        self.uses.append(0)
        self.seen.add(self._identity(value))

    def _pop(self) -> None:
        step = self.steps.pop()
        self.ranks.pop()
        self.seen.discard(self._identity(self.values.pop()))
        self.uses.pop()
        for i in set(step.operands):
            self.uses[i] -= 1

    # -- candidates in canonical order -----------------------------------------------------------

    def _candidates(self) -> list:
        """(rank, operator, operands, attributes) of the operators that may come next, by rank.
        Operands are drawn from one phase (loop values only, for accumulators); the others are
        counted as pruned by phase without being built."""
        last = self.ranks[-1] if self.ranks else None
        newest = last[0] if last else 0
        ends = _Ends(self)
        pools = ([i for i, v in enumerate(self.values) if not v.post], [i for i, v in enumerate(self.values) if v.post])
        out = []
        for op in self.problem.operators:
            opdef = op.opdef
            built = 0
            for post, pool in enumerate(pools[:1] if opdef.is_accumulator else pools):
                for operands in _operand_tuples(pool, op, newest):
                    built += 1
                    reason = self._misfit(op, operands, bool(post) or opdef.is_accumulator, ends)
                    if reason is not None:
                        self.pruned[reason] += 1
                        continue
                    for pairs, text in self.problem.attributes.choices(opdef, self.values[operands[0]].var.type.rank):
                        rank = (max(operands), operands, opdef.name, text)
                        if last is not None and rank <= last:
                            self.pruned["order"] += 1
                        else:
                            out.append((rank, opdef, operands, pairs))
            self.pruned["phase"] += _count_operand_tuples(len(self.values), op, newest) - built
        out.sort(key=lambda c: c[0])
        return out

    def _misfit(self, op: _Operator, operands: tuple, post: bool, ends: "_Ends") -> Optional[str]:
        """Why `op` cannot take these operands whatever its attributes, or None."""
        if ends.needed(operands, post) > ends.room:
            return "dead-end"
        if not op.opdef.is_accumulator:
            return None
        if len(operands) == 2 and not self._rescales(operands):
            return "rescale"
        if self.frame.forloop > 1 and not self.values[operands[0]].looped and not op.idempotent:
            return "loop-invariant"  # the same tile R times over: only a maximum gives it back
        return None

    def _rescales(self, operands: tuple) -> bool:
        """A rescaling accumulator's abstract expression drops its scale, which is only right in online
        softmax: the scale is a maximum that the accumulated value was shifted by, in a program that
        computes a maximum."""
        x, m = (self.values[i] for i in operands)
        return self.problem.computes_max and m.term.head == "max" and operands[1] in x.ancestors

    # -- one operator ----------------------------------------------------------------------------

    def _try(self, op: OpDef, operands: tuple, attr_pairs: tuple) -> Optional[Value]:
        """The value `op` computes, or None (counted by reason) when it is pruned."""
        args = [self.values[i] for i in operands]
        key = (op.name, attr_pairs, tuple(self._identity(a) for a in args))
        if key not in self.outcomes:
            self.outcomes[key] = self._outcome(op, args, attr_pairs)
        outcome = self.outcomes[key]
        if isinstance(outcome, str):
            self.pruned[outcome] += 1
            return None
        out_type, labels, term = outcome
        v = Var(f"v{len(self.values)}", out_type)
        ancestors = frozenset(operands).union(*(a.ancestors for a in args))
        value = Value(v, Var(v.name, self.problem.smallest(out_type, labels)), labels, term,
                      op.is_accumulator or args[0].post, any(a.looped for a in args), ancestors)
        if self._identity(value) in self.seen:
            self.pruned["redundant"] += 1
            return None
        if self._shared_memory(Step(op.name, operands, attr_pairs), value) > SMEM_LIMIT_BYTES:
            self.pruned["shared-memory"] += 1
            return None
        return value

    def _outcome(self, op: OpDef, args: list, attr_pairs: tuple):
        """(type, labels, term) of `op` on these operands, or the reason it is pruned: what does not
        depend on the rest of the block graph."""
        try:
            (out_type,) = op.infer_types(tuple(a.var.type for a in args), attr_pairs)
        except (MdslError, ValueError):
            return "shape"
        node = Node(op.name, [a.var for a in args], [Var("out", out_type)], attr_pairs)
        labels = _result_labels(node, [a.labels for a in args], self.problem.contracted, self.frame.loop)
        if labels is None:
            return "dims"
        (term,) = node_terms(node, [a.term for a in args], self.frame.forloop)
        if not self.problem.computes_max and any(t.head == "max" for t in subterms(term)):
            return "stabiliser"  # the checker takes a max an exponent subtracts for softmax's: see _rescales
        checker = self.checker
        self.budget.check_time()  # a z3 query may take a while: stop first if the time is up
        if checker is not None:
            if _degree(term) > self.problem.degree:
                return "abstract-expression"
            unknown = checker.stats.unknown
            if not checker.is_subexpression(term):
                return "abstract-expression" if checker.stats.unknown == unknown else "abstract-expression: unknown"
        return out_type, labels, term

    def _shared_memory(self, step: Step, value: Value) -> int:
        """The peak shared memory of the block graph so far under the finest grid (a lower bound)."""
        values = self.values + [value]
        if sum(max(4, v.small.type.dtype.itemsize) * v.small.type.numel for v in values) <= SMEM_LIMIT_BYTES:
            return 0  # everything at once fits: no need to walk the lifetimes
        steps = self.steps + [step]
        nodes = [Node(s.op, [values[i].small for i in s.operands], [values[self.n_inputs + k].small], s.attrs)
                 for k, s in enumerate(steps)]
        inputs = [BlockInput(v.small, (None,) * 3, None) for v in values[:self.n_inputs]]
        return shared_memory_peak(BlockGraph((1, 1, 1), 32, self.frame.forloop, inputs, nodes, ()))

    # -- closing ---------------------------------------------------------------------------------

    def _closing(self) -> Optional[tuple]:
        """For each output, the value it takes, when the block graph can close here."""
        if not self.steps or not self.values[-1].post:
            return None
        unread = {i for i in range(self.n_inputs, len(self.values)) if self.uses[i] == 0}
        if any(not self.values[i].post for i in unread):
            return None
        options = [[i for i in range(self.n_inputs, len(self.values)) if self._matches(self.values[i], k)]
                   for k in range(len(self.problem.targets))]
        for outputs in itertools.product(*options):
            if unread <= set(outputs):
                return outputs
        return None

    def _matches(self, value: Value, k: int) -> bool:
        target = self.problem.targets[k]
        return (value.post and value.var.type == target.type and value.labels == target.labels
                and self.matcher.matches(value.term, k))


class _Ends:
    """The values nobody reads yet, at one state: every one of them (inputs included) must be read or
    be an output, and an operator reads at most two and adds one; loop values among them must reach an
    accumulator, which takes at most two."""

    def __init__(self, search: _Search):
        values = search.values
        self.unread = frozenset(i for i, n in enumerate(search.uses) if n == 0)
        self.loops = frozenset(i for i in self.unread if i >= search.n_inputs and not values[i].post)
        self.outputs = len(search.problem.targets)
        self.room = search.max_ops - len(search.steps) - 1   # operators after the next one

    def needed(self, operands: tuple, post: bool) -> int:
        """The fewest operators that can close the block graph after one on `operands`."""
        read = self.unread.intersection(operands)
        left = len(self.unread) - len(read) + 1
        loops = len(self.loops) - len(self.loops.intersection(operands)) + (not post)
        return max(left - self.outputs, -(-loops // 2))


def _operand_tuples(pool: list, op: _Operator, newest: int) -> Iterator[tuple]:
    """Operand tuples from `pool` (ascending indices) whose newest operand is at least `newest`: no
    operator with a smaller one can follow the last."""
    if op.arity == 1:
        yield from ((i,) for i in pool if i >= newest)
        return
    for hi in pool:
        if hi < newest:
            continue
        for lo in pool:
            if lo > hi:
                break
            yield (lo, hi)
            if lo != hi and not op.commutative:
                yield (hi, lo)


def _count_operand_tuples(n: int, op: _Operator, newest: int) -> int:
    """How many operand tuples over n values `_operand_tuples` would give from all of them."""
    if op.arity == 1:
        return n - newest
    return sum(hi + 1 if op.commutative else 2 * hi + 1 for hi in range(newest, n))


# ---------------------------------------------------------------------------------------------
# from programs to kernel graphs

def _kernel_graph(problem: _Problem, program: Program, grid: Grid, threads: int,
                  graph: Optional[KernelGraph] = None) -> KernelGraph:
    """The kernel graph of one program under one grid (not validated); `graph`: the program at other
    sizes (the screen's), default the problem's own."""
    graph, frame = graph or problem.graph, program.frame
    taken: set = set()
    inputs, values = [], []
    for slot, i in enumerate(problem.used):
        tensor, labels = graph.inputs[i], problem.input_labels[slot]
        fmap = labels.index(frame.loop) if frame.loop in labels else None
        imap = grid.map_of(labels)
        tile = Var(fresh_name(tensor.name, taken), input_tile_type(tensor.type, grid.dims, frame.forloop, imap, fmap))
        inputs.append(BlockInput(tile, imap, fmap))
        values.append(tile)
    nodes = []
    for step in program.steps:
        args = [values[i] for i in step.operands]
        (out_type,) = OPS[step.op].infer_types(tuple(a.type for a in args), step.attrs)
        values.append(Var(fresh_name(step.op, taken), out_type))
        nodes.append(Node(step.op, args, [values[-1]], step.attrs))
    outputs = [BlockOutput(values[i], grid.map_of(program.labels[i])) for i in program.outputs]
    body = BlockGraph(grid.dims, threads, frame.forloop, inputs, nodes, outputs)
    node = Node("custom", [graph.inputs[i] for i in problem.used], graph.outputs, body=body)
    return KernelGraph(graph.name, graph.inputs, [node], graph.outputs)


#: The size every label that can shrink takes in the numeric screen (the loop label: this many elements
#: per iteration, times the frame's range).
SCREEN_SIZE = 8
#: The most elements (all tensors of the program, inputs included) a screen evaluates; a program that
#: cannot shrink below it is not screened (the verifier decides), so that memory stays bounded.
SCREEN_ELEMENTS = 1 << 22
UNSCREENED = "unscreened"   # the stats category of programs the screen leaves to the verifier, by reason


class _CannotResize(Exception):
    """A node whose output does not follow the labels' new sizes; `labels` are the ones it touches."""

    def __init__(self, labels: frozenset):
        super().__init__()
        self.labels = labels


def _resized(graph: KernelGraph, labels: Labels, size_of) -> KernelGraph:
    """`graph` with every dim of label L resized to `size_of(L)` and each node's types inferred again, or
    _CannotResize at the first node whose rule disagrees (a reshape's shape, a concat's sum of sizes,
    a custom kernel's grid)."""
    def retyped(v: Var) -> Var:
        return Var(v.name, v.type.with_shape([size_of(labels.label(v.name, d)) for d in range(v.type.rank)]))

    env = {v.name: retyped(v) for v in graph.inputs}
    nodes = []
    for node in graph.nodes:
        args = [env[v.name] for v in node.inputs]
        want = [retyped(v) for v in node.outputs]
        try:
            got = node.opdef.infer_types(tuple(a.type for a in args), node.attrs) if node.body is None else None
        except (MdslError, ValueError):
            got = None
        if got is None or list(got) != [v.type for v in want]:
            touched = [*node.inputs, *node.outputs]
            raise _CannotResize(frozenset(labels.label(v.name, d) for v in touched for d in range(v.type.rank)))
        env.update((v.name, v) for v in want)
        nodes.append(attrs.evolve(node, inputs=args, outputs=want))
    return KernelGraph(graph.name, [env[v.name] for v in graph.inputs], nodes, [env[v.name] for v in graph.outputs])


def _sizes_in_constants(graph: KernelGraph, labels: Labels) -> set:
    """The labels whose size n a float attribute of the program may stand for (n, 1/n, √n or 1/√n: a sum
    times 1/n for a mean, a 1/√d attention scale). They keep their size in the screen, where a
    candidate that reads the size itself (a mean) would otherwise differ from the program."""
    constants = float_constants([graph])
    every = {labels.label(v.name, d) for v in (*graph.inputs, *(o for n in graph.nodes for o in n.outputs))
             for d in range(v.type.rank)}
    return {label for label in every if encodes_size(constants, labels.size(label))}


class _Instance:
    """The program at the sizes one frame screens at, on random inputs, and its outputs in float64."""

    def __init__(self, graph: KernelGraph, seed: int):
        self.graph = graph
        rng = np.random.default_rng(seed)
        self.inputs = [rng.standard_normal(v.shape) if v.dtype.is_float else rng.integers(0, 4, v.shape).astype(float)
                       for v in graph.inputs]
        with np.errstate(all="ignore"):
            self.expected = run_kernel_graph(graph, self.inputs)


class _Screen:
    """A closed block graph (as one block) and the program on the same random inputs, in float64.
    Abstract expressions forget indices, and some axioms hold only for them (a sum of a product with
    a factor constant along the sum), so a block graph whose term matches can still compute
    something else; one cheap evaluation catches it before its every grid goes to the verifier.

    It runs at reduced sizes: every label shrinks to SCREEN_SIZE (the loop label to SCREEN_SIZE
    elements per iteration, so that the frame's range still divides it), except labels whose size an
    operator's rule fixes (found by inferring the program's types again: a node that disagrees fixes
    every label it touches) or a constant of the program may encode (`_sizes_in_constants`). A
    program's blocks never depend on the grid (no block operator reduces a free label), and the same
    operators on smaller tiles compute the same function of their inputs, so what the screen looks
    for, indices that abstract terms forget, shows at any size of at least two, while its memory and
    time no longer grow with the shapes. A program that stays above SCREEN_ELEMENTS even so, or whose
    block graph does not fit the reduced tiles, is not screened: its candidates go to the verifier,
    which decides."""

    def __init__(self, problem: "_Problem", seed: int, stats: Optional[SearchStats] = None):
        self.problem, self.seed = problem, seed
        self.stats = stats if stats is not None else SearchStats()
        self.instances: dict = {}   # frame -> _Instance, or None where the program cannot be screened

    def passes(self, program: "Program") -> Optional[bool]:
        """Whether the program computes what the original does; None where it is not screened (counted
        under ``unscreened`` by the reason)."""
        instance = self._instance(program.frame)
        if instance is None:
            self.stats.count(UNSCREENED, "too large to evaluate")
            return None
        try:
            candidate = _kernel_graph(self.problem, program, Grid(), self.problem.config.thread_counts[0],
                                      instance.graph)
        except MdslError:
            self.stats.count(UNSCREENED, "does not fit the reduced sizes")
            return None
        try:
            with np.errstate(all="ignore"):  # non-finite values are compared, not warned about
                got = run_kernel_graph(candidate, instance.inputs)
        except MdslError:
            return False
        return all(_close(a, b) for a, b in zip(got, instance.expected))

    def _instance(self, frame: "Frame") -> Optional[_Instance]:
        if frame not in self.instances:
            graph = self._reduced(frame)
            fits = graph is not None and _elements(graph) <= SCREEN_ELEMENTS
            self.instances[frame] = _Instance(graph, self.seed) if fits else None
        return self.instances[frame]

    def _reduced(self, frame: "Frame") -> Optional[KernelGraph]:
        labels, fixed = self.problem.labels, _sizes_in_constants(self.problem.graph, self.problem.labels)

        def size_of(label) -> int:
            n = labels.size(label)
            if label in fixed or n <= SCREEN_SIZE:
                return n
            if label == frame.loop:
                return frame.forloop * min(n // frame.forloop, SCREEN_SIZE)
            return SCREEN_SIZE

        while True:
            try:
                return _resized(self.problem.graph, labels, size_of)
            except _CannotResize as e:
                if e.labels <= fixed:   # at full size already: the program itself does not infer
                    return None
                fixed |= e.labels


def _close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-6) -> bool:
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)):
        return False
    scale = max(float(np.linalg.norm(want[finite])), np.finfo(float).tiny)
    return float(np.linalg.norm(got[finite] - want[finite])) <= rtol * scale


def _instances(problem: _Problem, program: Program, budget: "_Budget", stats: SearchStats) -> list:
    """The program under every grid and thread count that fits, cheapest first by the cost model."""
    out = []
    for grid in problem.grids:
        budget.check_time()
        for threads in problem.config.thread_counts:
            try:
                candidate = _kernel_graph(problem, program, grid, threads)
                if shared_memory_peak(candidate.nodes[0].body) > SMEM_LIMIT_BYTES:
                    stats.count(PRUNED, "shared-memory")
                    continue
                validate_kernel_graph(candidate)
            except MdslError:
                stats.count(PRUNED, "shape")
                continue
            out.append(candidate)
    return sorted(out, key=estimate)


# ---------------------------------------------------------------------------------------------
# the generator

def generate(graph: KernelGraph, config: SearchConfig = SearchConfig(), stats: Optional[SearchStats] = None, *,
             max_states: Optional[int] = None, prune: bool = True) -> Iterator[KernelGraph]:
    """Candidates of one custom kernel for the whole program, in canonical order (see the module
    docstring). `max_states` bounds the states explored (default: the config's work budget);
    `prune=False` turns the abstract-expression check off (to measure what it prunes)."""
    stats = stats if stats is not None else SearchStats()
    problem = _Problem(graph, config)
    if not problem.supported():
        return
    budget = _Budget(max_states or config.work, stats)
    checker = SubexprChecker([t.term for t in problem.targets], time_left=budget.time_left,
                             timeout_ms=Z3_TIMEOUT_MS) if prune else None
    matcher = _Matcher(problem.targets, budget.time_left)
    budget.solver_units = lambda: matcher.rlimit() + (checker.stats.rlimit if checker is not None else 0)
    screen = _Screen(problem, config.seed, stats)
    try:
        for frame in problem.frames:
            for program in _Search(problem, frame, checker, matcher, budget, stats).run():
                budget.check_time()
                if screen.passes(program) is False:
                    stats.count(PRUNED, "numerics")
                    continue
                yield from _instances(problem, program, budget, stats)
    except _OutOfBudget as e:
        stats.count("stopped", f"enumerate: {e}")
    except OutOfTime:
        stats.count("stopped", "enumerate: time")
    finally:
        stats.count("states", "enumerate", budget.states)

"""The subexpression check that prunes the search: is a candidate tensor's abstract expression a
subexpression of the target's, A_eq ∪ A_sub ⊨ sub(term, E) (Mirage §4.3)?

Most queries never reach z3. A syntactic pre-check answers True when the term literally occurs in
the target (an add/mul may take any sub-multiset of a target node's operands, a sum any divisor of a
target sum's size) and False when the term uses an input, constant, head or parameter that the
target lacks, or a reduction size that does not divide the product of the target's sizes: the
axioms never create any of these, so the answer is exact.

The rest go to z3, with the axioms encoded once per checker and a fresh solver per query (so an
answer never depends on the queries before it) under a deterministic `rlimit` and a wall-clock
timeout as a backstop. An `unknown` answer at those limits prunes, like a refutation, and is counted
apart: it is the search's resource bound, not a proof. A checker given its search's `time_left`
gives no query more time than that, and a query that it stops raises `OutOfTime` (nothing is
answered or cached). z3's own Ctrl-C trap is off: it would swallow the signal and end the query as
`unknown`; the signal is handled by Python as soon as the query returns (its limits bound the wait).

The encoding: an uninterpreted sort T; a function per head (`add, mul, div : T×T→T`, unary heads
T→T, `pow` and `clamp` with Real parameters, `rms` with its literal Int size); `sum` and `max` take
their size as a vector of Int exponents over the primes of the target's sizes (6144 = 2^11·3 is
(11, 1)), so merging nested sums adds exponents and "a partial sum over a divisor of n is a
subexpression of the sum over n" is a componentwise ≤ — both linear, and exact, unlike Mirage's
⌈log₂ n⌉. A_sub's reflexivity and transitivity enter as the seed sub(E, E) plus downward rules
sub(f(.., a, ..), y) → sub(a, y): for a fixed target this is the same relation, and E-matching
instantiates a few lemmas per sub-term instead of a cubic number of transitivity instances.
Cancellation (div(mul(x, y), y) = x) is deliberately not an axiom: with it everything would be a
subexpression of everything.

Max stabilisers: a candidate may compute the max that online softmax subtracts before an exponent
(`max(n, s)`, `add(s, neg(max(n, s)))`) although the target, whose max the exp rule stripped (see
`abstract`), has none. A term that fails is retried as exp of itself with its max-subtractions
dropped and max(n, x) read as x: a max is worth computing only where an exponent will subtract it.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Iterable, Optional

import z3

from mdsl.passes.abstract import (COMMUTATIVE_HEADS, Term, rebuild, strip_max_subtraction, subterms, unary,
                                  unary_heads)

DEFAULT_RLIMIT = 300_000      # valid queries of the benchmark kernels use about 10 000
DEFAULT_TIMEOUT_MS = 2_000
_OPAQUE_HEADS = frozenset({"var", "const", "pow", "clamp", "rms"})   # no axiom changes their parameter
_SIZED_HEADS = ("sum", "max")                                      # their sizes split and merge


class OutOfTime(Exception):
    """The checker's time ran out before or during a z3 query: the query has no answer."""


@dataclass
class SubexprStats:
    queries: int = 0        # calls of is_subexpression
    cache_hits: int = 0     # (term, target) pairs answered from the cache
    syntactic: int = 0      # pairs decided by the pre-check
    z3_calls: int = 0
    proved: int = 0         # z3: unsat, i.e. a subexpression
    refuted: int = 0        # z3: sat, or the instantiations saturated without a proof
    unknown: int = 0        # z3: out of rlimit or time; pruned all the same
    seconds: float = 0.0    # time spent in is_subexpression
    z3_seconds: float = 0.0
    rlimit: int = 0         # z3's resource units spent by the queries: their work, the same on any machine


# ---------------------------------------------------------------------------------------------
# the syntactic pre-check

def _factorize(n: int) -> Counter:
    out: Counter = Counter()
    p = 2
    while p * p <= n:
        while n % p == 0:
            out[p] += 1
            n //= p
        p += 1
    if n > 1:
        out[n] += 1
    return out


@dataclass(frozen=True)
class _Signature:
    """What a term is made of: the pre-check compares these."""

    heads: frozenset
    opaque: frozenset         # (head, param) of var/const/pow/clamp/rms nodes
    sizes: dict               # sum/max -> Counter of the prime factors of all their sizes, multiplied

    @classmethod
    def of(cls, term: Term) -> "_Signature":
        nodes = list(subterms(term))
        sizes = {h: Counter() for h in _SIZED_HEADS}
        for t in nodes:
            if t.head in sizes:
                sizes[t.head] += _factorize(t.param)
        return cls(frozenset(t.head for t in nodes),
                   frozenset((t.head, t.param) for t in nodes if t.head in _OPAQUE_HEADS), sizes)

    def covers(self, other: "_Signature") -> bool:
        """False when `other` has something no term equal to ours can contain."""
        return (other.heads <= self.heads and other.opaque <= self.opaque
                and all(other.sizes[h] <= self.sizes[h] for h in _SIZED_HEADS))


class _Target:
    """A target term with the indexes of the pre-check."""

    def __init__(self, term: Term):
        self.term = term
        self.subterms = frozenset(subterms(term))
        self.signature = _Signature.of(term)
        self.operands = [(t.head, Counter(t.args)) for t in self.subterms if t.head in COMMUTATIVE_HEADS]
        self.reduced: dict = {}
        for t in self.subterms:
            if t.head in _SIZED_HEADS:
                self.reduced.setdefault((t.head, t.args[0]), []).append(t.param)

    def precheck(self, term: Term, signature: _Signature) -> Optional[bool]:
        """True or False when the answer needs no proof, None otherwise."""
        if term in self.subterms:
            return True
        if term.head in COMMUTATIVE_HEADS:
            mine = Counter(term.args)
            if any(head == term.head and mine <= theirs for head, theirs in self.operands):
                return True
        if term.head in _SIZED_HEADS:
            if any(size % term.param == 0 for size in self.reduced.get((term.head, term.args[0]), ())):
                return True
        if not self.signature.covers(signature):
            return False
        return None


# ---------------------------------------------------------------------------------------------
# the z3 encoding

class _Encoding:
    """The axioms over one context, and the translation of terms into it."""

    def __init__(self, primes: tuple):
        ctx = self.ctx = z3.Context()
        self.primes = primes
        T = self.T = z3.DeclareSort("T", ctx)
        I, R, B = z3.IntSort(ctx), z3.RealSort(ctx), z3.BoolSort(ctx)
        ints = [I] * len(primes)
        self.fn = {name: z3.Function(name, T, T, T) for name in ("add", "mul", "div", "concat")}
        self.unary = sorted(unary_heads())
        self.fn.update({name: z3.Function(name, T, T) for name in self.unary})
        self.fn.update({"pow": z3.Function("pow", R, T, T), "clamp": z3.Function("clamp", R, R, T, T),
                        "rms": z3.Function("rms", I, T, T)})
        self.fn.update({name: z3.Function(name, *ints, T, T) for name in _SIZED_HEADS})
        self.sub = z3.Function("sub", T, T, B)
        self.atoms: dict = {}
        self.memo: dict = {}
        self.axioms = self._a_sub() + self._a_eq()

    # -- helpers
    def _vars(self, names: str):
        return [z3.Const(n, self.T) for n in names.split()]

    def _degrees(self, name: str):
        return [z3.Int(f"{name}{k}", self.ctx) for k in range(len(self.primes))]

    def _forall(self, variables, body, *patterns):
        return z3.ForAll(variables, body, patterns=list(patterns) or None)

    # -- A_sub: sub(E, E) is seeded per query; these rules carry sub down to the sub-terms
    def _a_sub(self) -> list:
        f, sub = self.fn, self.sub
        a, b, y = self._vars("a b y")
        e1, e2 = z3.Real("e1", self.ctx), z3.Real("e2", self.ctx)
        n = z3.Int("n", self.ctx)
        i, j = self._degrees("i"), self._degrees("j")
        out = []
        for name in ("add", "mul", "div", "concat"):           # (3)-(6), and concat's pieces
            top = sub(f[name](a, b), y)
            out.append(self._forall([a, b, y], z3.Implies(top, z3.And(sub(a, y), sub(b, y))), top))
        for name in self.unary:                                 # (7)-(12), and neg, rsqrt, ...
            top = sub(f[name](a), y)
            out.append(self._forall([a, y], z3.Implies(top, sub(a, y)), top))
        for params, app in (([e1], f["pow"](e1, a)), ([e1, e2], f["clamp"](e1, e2, a)),   # (13)
                            ([n], f["rms"](n, a))):                                         # (14)
            top = sub(app, y)
            out.append(self._forall([*params, a, y], z3.Implies(top, sub(a, y)), top))
        for name in _SIZED_HEADS:
            top = sub(f[name](*j, a), y)                         # (15)
            out.append(self._forall([*j, a, y], z3.Implies(top, sub(a, y)), top))
            part = f[name](*i, a)                                # (16): i | j in exponent form
            divides = z3.And(*(z3.And(0 <= p, p <= q) for p, q in zip(i, j)))
            out.append(self._forall([*i, *j, a, y], z3.Implies(z3.And(top, divides), sub(part, y)),
                                    z3.MultiPattern(top, part)))
        return out

    # -- A_eq
    def _a_eq(self) -> list:
        f = self.fn
        add_, mul, div, neg = f["add"], f["mul"], f["div"], f["neg"]
        x, y, z = self._vars("x y z")
        i, j = self._degrees("i"), self._degrees("j")
        out = []

        def both_ways(variables, lhs, rhs):
            out.append(self._forall(variables, lhs == rhs, lhs, rhs))

        for op in (add_, mul):
            out.append(self._forall([x, y], op(x, y) == op(y, x), op(x, y)))       # (1), (2)
            both_ways([x, y, z], op(op(x, y), z), op(x, op(y, z)))                 # (3), (4)
        both_ways([x, y, z], mul(add_(x, y), z), add_(mul(x, z), mul(y, z)))       # (5)
        both_ways([x, y, z], div(add_(x, y), z), add_(div(x, z), div(y, z)))       # (6)
        both_ways([x, y, z], mul(x, div(y, z)), div(mul(x, y), z))                 # (7)
        both_ways([x, y], mul(neg(x), y), neg(mul(x, y)))                          # negation moves out
        both_ways([x, y], div(neg(x), y), neg(div(x, y)))
        zero = [z3.IntVal(0, self.ctx)] * len(self.primes)
        total = [p + q for p, q in zip(i, j)]
        for name in _SIZED_HEADS:
            red = f[name]
            out.append(self._forall([x], red(*zero, x) == x, red(*zero, x)))                      # (8)
            out.append(self._forall([*i, *j, x], red(*i, red(*j, x)) == red(*total, x), red(*i, red(*j, x))))  # (9)
        s = f["sum"]
        both_ways([*i, x, y], s(*i, add_(x, y)), add_(s(*i, x), s(*i, y)))        # (10), generalised
        both_ways([*i, x, y], s(*i, mul(x, y)), mul(s(*i, x), y))                 # (11)
        both_ways([*i, x, y], s(*i, div(x, y)), div(s(*i, x), y))                 # (12)
        both_ways([*i, x], s(*i, neg(x)), neg(s(*i, x)))
        return out

    # -- terms
    def degree(self, size: int) -> Optional[list]:
        """The exponent vector of `size`, or None when it has a prime the encoding lacks."""
        factors = _factorize(size)
        if any(p not in self.primes for p in factors):
            return None
        return [z3.IntVal(factors[p], self.ctx) for p in self.primes]

    def encodable(self, term: Term) -> bool:
        return all(self.degree(t.param) is not None for t in subterms(term) if t.head in _SIZED_HEADS)

    def expr(self, term: Term):
        cached = self.memo.get(term)
        if cached is None:
            cached = self.memo[term] = self._translate(term)
        return cached

    def _real(self, value: Fraction):
        return z3.RealVal(f"{value.numerator}/{value.denominator}", self.ctx)

    def _translate(self, t: Term):
        if t.head in ("var", "const"):
            return self.atom(t)
        args = [self.expr(a) for a in t.args]
        fn = self.fn[t.head]
        if t.head in ("add", "mul", "concat"):                 # n-ary: nest to the right
            out = args[-1]
            for a in reversed(args[:-1]):
                out = fn(a, out)
            return out
        if t.head in _SIZED_HEADS:
            return fn(*self.degree(t.param), *args)
        if t.head == "rms":
            return fn(z3.IntVal(t.param, self.ctx), *args)
        if t.head == "pow":
            return fn(self._real(t.param), *args)
        if t.head == "clamp":
            return fn(self._real(t.param[0]), self._real(t.param[1]), *args)
        return fn(*args)

    def atom(self, t: Term):
        if t not in self.atoms:
            self.atoms[t] = z3.Const(str(t), self.T)
        return self.atoms[t]


# ---------------------------------------------------------------------------------------------
# the checker

def _destabilise(term: Term, memo: dict) -> Term:
    """The term with max-subtractions dropped from sums and max(n, x) read as x."""
    done = memo.get(term)
    if done is None:
        stripped = strip_max_subtraction(term)
        if term.head == "max":
            done = _destabilise(term.args[0], memo)
        elif stripped is not term:
            done = _destabilise(stripped, memo)
        else:
            args = tuple(_destabilise(a, memo) for a in term.args)
            done = term if args == term.args else rebuild(term, args)
        memo[term] = done
    return done


class SubexprChecker:
    """Answers `is_subexpression(term)`: is `term` a subexpression of one of the target terms?

    `precheck=False` sends every query to z3 (to test the axioms); `rlimit` bounds each z3 query
    deterministically, `timeout_ms` in wall-clock time; `time_left` (seconds the caller has left, e.g.
    its search's) bounds it further, and a query that reaches it raises OutOfTime."""

    def __init__(self, target_terms: Iterable[Term], *, rlimit: int = DEFAULT_RLIMIT,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS, precheck: bool = True,
                 time_left: Optional[Callable[[], float]] = None):
        self.targets = [_Target(t) for t in dict.fromkeys(target_terms)]
        if not self.targets:
            raise ValueError("a subexpression checker needs at least one target term")
        self.rlimit = rlimit
        self.timeout_ms = timeout_ms
        self.time_left = time_left
        self.precheck = precheck
        self.stats = SubexprStats()
        self._cache: dict = {}
        self._destabilised: dict = {}
        self._signatures: dict = {}
        self._encoding: Optional[_Encoding] = None
        self._rlimit_counts: dict = {}   # id(context) -> its rlimit count after the last query

    def is_subexpression(self, term: Term) -> bool:
        start = time.perf_counter()
        self.stats.queries += 1
        try:
            if self._accepts(term):
                return True
            plain = _destabilise(term, self._destabilised)
            return plain is not term and self._accepts(unary("exp", plain))
        finally:
            self.stats.seconds += time.perf_counter() - start

    def _accepts(self, term: Term) -> bool:
        return any(self._check(term, target) for target in self.targets)

    def _check(self, term: Term, target: _Target) -> bool:
        key = (term, target.term)
        if key in self._cache:
            self.stats.cache_hits += 1
            return self._cache[key]
        answer = target.precheck(term, self._signature(term)) if self.precheck else None
        if answer is None:
            answer = self._prove(term, target)
        else:
            self.stats.syntactic += 1
        self._cache[key] = answer
        return answer

    def _signature(self, term: Term) -> _Signature:
        if term not in self._signatures:
            self._signatures[term] = _Signature.of(term)
        return self._signatures[term]

    @property
    def encoding(self) -> _Encoding:
        if self._encoding is None:
            primes = set()
            for target in self.targets:
                for h in _SIZED_HEADS:
                    primes.update(target.signature.sizes[h])
            self._encoding = _Encoding(tuple(sorted(primes)) or (2,))
        return self._encoding

    def _prove(self, term: Term, target: _Target) -> bool:
        enc = self.encoding
        if not enc.encodable(term):      # a size with a prime no target size has: never derivable
            self.stats.syntactic += 1
            return False
        timeout_ms, cut = self._timeout_ms()
        start = time.perf_counter()
        solver = z3.SimpleSolver(ctx=enc.ctx)
        solver.set("rlimit", self.rlimit)
        solver.set("timeout", timeout_ms)
        solver.set("ctrl_c", False)   # a Ctrl-C reaches Python (see the module docstring)
        # E-matching alone: a goal the axioms do not imply ends as "incomplete quantifiers" once the
        # instantiations saturate, usually within milliseconds; model-based instantiation would
        # instead search for a counter-model until the rlimit runs out
        solver.set("smt.mbqi", False)
        solver.add(*enc.axioms)
        goal = enc.expr(target.term)
        solver.add(enc.sub(goal, goal), z3.Not(enc.sub(enc.expr(term), goal)))
        result = solver.check()
        self.stats.z3_calls += 1
        self.stats.rlimit += self._rlimit_spent(solver, enc.ctx)
        self.stats.z3_seconds += time.perf_counter() - start
        if result == z3.unsat:
            self.stats.proved += 1
            return True
        if result == z3.sat or "incomplete" in solver.reason_unknown():
            self.stats.refuted += 1    # a counter-model, or every instantiation tried without a proof
            return False
        if cut and time.perf_counter() - start >= timeout_ms / 1000:   # the caller's time, not the rlimit
            raise OutOfTime("the time ran out during a z3 query")
        self.stats.unknown += 1        # out of rlimit or time
        return False

    def _rlimit_spent(self, solver, ctx) -> int:
        """The resource units of the query just made: the growth of its context's count (z3 keeps one a
        context, and the checker's context runs one query at a time; a count below the last one is a
        solver's own, all this query's)."""
        statistics = solver.statistics()
        count = next((int(statistics.get_key_value(k)) for k in statistics.keys() if k == "rlimit count"), None)
        if count is None:   # a z3 without the statistic: the units are not known
            return 0
        last = self._rlimit_counts.get(id(ctx), 0)
        self._rlimit_counts[id(ctx)] = count
        return count - last if count >= last else count

    def _timeout_ms(self) -> tuple:
        """(the query's wall-clock limit in ms, whether the caller's time left sets it); OutOfTime when
        no time is left."""
        if self.time_left is None:
            return self.timeout_ms, False
        left_ms = self.time_left() * 1000.0
        if left_ms < 1.0:
            raise OutOfTime("no time left for a z3 query")
        return (int(left_ms), True) if left_ms < self.timeout_ms else (self.timeout_ms, False)

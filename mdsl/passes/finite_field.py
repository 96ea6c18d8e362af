"""The finite-field semantics of the mugraph: the exact half of the verifier (docs/design.md, section "Verification").

One test draws primes q and p = 2q + 1 (q < 2^24, so p < 2^25), an element ω of order q in Z_p and a
secret that keys the test's random oracles. A value is an integer array of shape tensor shape + (2,):
`[..., 0]` holds the residue mod p (the value itself), `[..., 1]` the residue mod q (what an exp
reads). What an operator computes is int64; an input may be held as int32 (`Field.random_input`: 4 or
8 bytes an element rather than 16, which at large shapes is the difference between gigabytes and a
few hundred megabytes), and every rule reads either. Each operator but the graph-defined ones has a
rule (`FieldRule`) in `FIELD_RULES`:

* add, sub, mul, neg, sums and matmuls are exact in both residues; div and reciprocal multiply by the
  modular inverse, with inverse(0) := 0 (Fermat's x^(m-2); deterministic, so both programs see the same
  value: a zero divisor, which has probability about 1/p per element, can only cost a false rejection
  of a rewrite that relies on b/b = 1);
* exp(t) = ω^(t mod q) mod p, so exp(a + b) = exp(a)·exp(b) and a subtracted maximum cancels; its
  q-residue is a random-oracle function of its p-residue, so exp(exp(x)) is still a function of x;
* scalars (eps, mul_scalar values, 1/n of a mean) enter as rationals: the simplest rational that the
  float represents (1/6 for 1.0/6, 1/10^6 for 1e-6), which maps distinct floats to distinct rationals;
* every operator without a field meaning is a random oracle of the test: a keyed hash (splitmix64 mixing
  with a salt derived from the test's secret and the operator's key) of the p-residue of its argument,
  applied identically in both programs. Where the real operator is built from another one the rule
  is built the same way, so that programs written either way agree: silu(x) = x·σ(x) with σ the sigmoid
  oracle, gelu(x) = x·Φ(x), rsqrt = 1/sqrt, rms_norm = x / sqrt(mean(x²) + eps), accum_rms =
  sqrt(mean of squares + eps) with the same sqrt oracle, x^(k/2) = sqrt(x)^k;
* max is the maximum under a random total order of the field (the order of a keyed hash of the
  p-residue): like the real max it returns one of its arguments, is idempotent, commutative and
  associative, so a max of tile maxima (accum_max over max) equals the max of the whole row; the
  rescaling accumulators use the same order for their running maximum M, which cancels in online
  softmax whatever element it picks.

Oracles read only the p-residue: the q-residue of a value computed through an exp depends on how it was
computed (exp(a)·exp(b) and exp(a + b) agree mod p, not mod q), so reading it would reject correct
rewrites. For the same reason outputs are compared by their p-residues, and the theory (Mirage's) covers
programs with at most one exp on any input-to-output path.

Each rule also bounds the degree of its outputs as rational functions of the inputs, counting oracle and
exp values as fresh variables (`degrees`): the verifier's false-pass probability comes from it.
"""
from __future__ import annotations

import hashlib
import math
from fractions import Fraction
from typing import Callable, Iterable, Optional, Sequence

import attrs
import numpy as np

from mdsl.errors import ShapeError
from mdsl.ir import evaluate
from mdsl.ir.evaluate import WIDEN_ELEMENTS
from mdsl.ir.graph import BlockGraph, KernelGraph, Node
from mdsl.ir.ops import OpDef
from mdsl.ir.rules import RuleTable
from mdsl.ir.types import TensorType, Var

#: q is drawn from [2^23, 2^24), so p = 2q + 1 < 2^25 and a product of two residues fits 50 bits.
Q_RANGE = (2 ** 23, 2 ** 24)
#: Random residues are drawn this many at a time (int64 draws, kept as int32).
DRAW_ELEMENTS = 2 ** 20
_EXP_SPLIT = 12          # exp tables: ω^t = LOW[t mod 2^12] · HIGH[t >> 12], two tables of 2^12 entries
_HALF = 13               # matmul: one operand's residues split into a 13-bit low half and a high half below 2^12
MATMUL_CHUNK = 2 ** 15   # K per float64 product: 2^15 terms below 2^13 · 2^25 = 2^38 sum below 2^53, exact in float64

Deg = tuple  # (numerator degree, denominator degree) of a rational function


# ---------------------------------------------------------------------------------------------
# primes, hashing, rationals

def is_prime(n: int) -> bool:
    """Miller-Rabin with the bases 2, 3, 5, 7: deterministic below 3.2·10^9."""
    if n < 2:
        return False
    for small in (2, 3, 5, 7):
        if n % small == 0:
            return n == small
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in (2, 3, 5, 7):
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def draw_primes(rng: np.random.Generator) -> tuple:
    """Random primes (p, q) with p = 2q + 1 and q in Q_RANGE."""
    while True:
        q = int(rng.integers(*Q_RANGE)) | 1
        if is_prime(q) and is_prime(2 * q + 1):
            return 2 * q + 1, q


_GOLDEN, _M1, _M2 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def mix(x: np.ndarray, salt: int) -> np.ndarray:
    """A keyed 64-bit hash of each element (splitmix64's finaliser after an odd multiply and the salt:
    a bijection of 64-bit words for each salt, so distinct residues never collide)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x).astype(np.uint64) * _GOLDEN + np.uint64(salt)
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def simplest_rational(value: float) -> Fraction:
    """The rational with the smallest denominator (among powers-of-ten bounds) that rounds to the finite
    float `value`: what the programmer meant by 1.0 / 6 or 1e-6. Distinct floats never share it."""
    exact = Fraction(value)
    for digits in range(1, 18):
        r = exact.limit_denominator(10 ** digits)
        if float(r) == value:
            return r
    return exact


# ---------------------------------------------------------------------------------------------
# one test's field

def _power_table(base: int, step: int, p: int) -> np.ndarray:
    table, x, mult = [], 1, pow(base, step, p)
    for _ in range(1 << _EXP_SPLIT):
        table.append(x)
        x = x * mult % p
    return np.array(table, dtype=np.int64)


def _exact_matmul(a: np.ndarray, b: np.ndarray, m: int) -> np.ndarray:
    """a @ b mod m for residues below 2^25 and K <= MATMUL_CHUNK, with float64 BLAS: the smaller operand is
    split in halves, whose products with the other one are exact (the sums stay below 2^53), and
    recombined in int64. Both halves go through one product (a's stacked as rows, b's as columns), so
    the larger operand (a weight matrix, say) is converted and read once per piece of K."""
    split_a = a.size <= b.size
    axis = -2 if split_a else -1
    part = a if split_a else b
    # shifts and masks rather than divmod: integer division is what numpy does slowly
    halves = np.concatenate([part >> _HALF, part & ((1 << _HALF) - 1)], axis=axis).astype(np.float64)
    whole = (b if split_a else a).astype(np.float64)
    both = np.matmul(halves, whole) if split_a else np.matmul(whole, halves)
    high, low = (half.astype(np.int64) for half in np.split(both, 2, axis=axis))
    return (high % m * ((1 << _HALF) % m) + low) % m


def matmul_mod(a: np.ndarray, b: np.ndarray, m: int) -> np.ndarray:
    """Batched a @ b mod m, exact for residues below 2^25 and any K: in pieces of K of at most MATMUL_CHUNK,
    small enough that the larger operand's piece, converted to float64, has about WIDEN_ELEMENTS
    elements (sums of exact products mod m: the pieces do not change the result)."""
    k = a.shape[-1]
    per_k = max(a.size, b.size) // max(1, k)   # the larger operand's elements per index of K
    step = max(1, min(MATMUL_CHUNK, WIDEN_ELEMENTS // max(1, per_k)))
    total = _exact_matmul(a[..., :step], b[..., :step, :], m)
    for start in range(step, k, step):
        stop = start + step
        total = (total + _exact_matmul(a[..., start:stop], b[..., start:stop, :], m)) % m
    return total


@attrs.frozen(eq=False)
class Field:
    """The field of one test: Z_p (values) and Z_q (exponents), ω of order q, the oracles' secret."""

    p: int
    q: int
    omega: int
    secret: bytes = attrs.field(repr=False)
    modulus: np.ndarray = attrs.field(init=False, repr=False)   # [p, q], broadcast over the residue axis
    _exp_low: np.ndarray = attrs.field(init=False, repr=False)
    _exp_high: np.ndarray = attrs.field(init=False, repr=False)

    @modulus.default
    def _modulus(self):
        return np.array([self.p, self.q], dtype=np.int64)

    @_exp_low.default
    def _low(self):
        return _power_table(self.omega, 1, self.p)

    @_exp_high.default
    def _high(self):
        return _power_table(self.omega, 1 << _EXP_SPLIT, self.p)

    @classmethod
    def draw(cls, rng: np.random.Generator) -> "Field":
        """Fresh primes, a random ω of order q (g² for a random g: (p − 1)/q = 2) and oracle secret."""
        p, q = draw_primes(rng)
        while True:
            omega = pow(int(rng.integers(2, p - 1)), 2, p)
            if omega != 1:
                return cls(p, q, omega, rng.bytes(16))

    def random(self, shape: tuple, rng: np.random.Generator) -> np.ndarray:
        """Uniformly random residues: u in Z_p outside exponents, v in Z_q inside them."""
        return self.random_input(shape, rng).astype(np.int64)

    def random_input(self, shape: tuple, rng: np.random.Generator, q_read: bool = True,
                     q_drawn: bool = True) -> np.ndarray:
        """`random`'s residues (the same draws: all the p-residues, then all the q-residues, drawn in
        pieces of DRAW_ELEMENTS) held as int32. Without `q_read`, where nothing reads the q-residues,
        the p-residues are held once and read as both (the residue axis has stride 0); without
        `q_drawn` the q-residues are not drawn at all, which leaves `rng` elsewhere: for an input
        after which nothing is drawn from it."""
        size = math.prod(shape)
        held = np.empty((size, 2 if q_read else 1), dtype=np.int32)
        for k, m in enumerate((self.p, self.q)):
            if k == 1 and not (q_read or q_drawn):
                break
            for start in range(0, size, DRAW_ELEMENTS):
                draws = rng.integers(0, m, min(DRAW_ELEMENTS, size - start))
                if k < held.shape[1]:
                    held[start:start + len(draws), k] = draws
        if not q_read:
            held = np.lib.stride_tricks.as_strided(held, (size, 2), (held.strides[0], 0), writeable=False)
        return held.reshape(tuple(shape) + (2,))

    # -- arithmetic ------------------------------------------------------------------------------

    def rational(self, r: Fraction) -> np.ndarray:
        """r in both fields (0 in the rare field whose prime divides r's denominator)."""
        return np.array([r.numerator * pow(r.denominator, -1, m) % m if r.denominator % m else 0
                         for m in (self.p, self.q)], dtype=np.int64)

    def scalar(self, value: float) -> np.ndarray:
        """A float attribute: its simplest rational; ±inf (valid in a graph) a random constant of the test."""
        if not math.isfinite(value):
            return self.oracle(f"scalar {value!r}", np.zeros(2, dtype=np.int64))
        return self.rational(simplest_rational(value))

    def _per_residue(self, op: Callable, a, b) -> np.ndarray:
        """op(a, b) mod p in the p-residues and mod q in the q-residues. Each residue on its own, with a
        scalar modulus: numpy's inner loops then run along the tensor rather than along the pair. In
        int64 whatever the operands hold (a product of two residues takes 50 bits)."""
        a, b = np.asarray(a), np.asarray(b)
        out = np.empty(np.broadcast_shapes(a.shape, b.shape), dtype=np.int64)
        for k, m in enumerate((self.p, self.q)):
            np.remainder(op(a[..., k], b[..., k], dtype=np.int64), m, out=out[..., k])
        return out

    def add(self, a, b):
        return self._per_residue(np.add, a, b)

    def sub(self, a, b):
        return self._per_residue(np.subtract, a, b)

    def mul(self, a, b):
        return self._per_residue(np.multiply, a, b)

    def sum_of_products(self, pairs: Iterable[tuple]) -> np.ndarray:
        """Σ a·b over the pairs (a, b), reduced every 2^13 terms: products of residues are below 2^50,
        so that many add up in int64 without overflow, and no product is reduced on its own."""
        total = None
        for n, (a, b) in enumerate(pairs, 1):
            term = np.multiply(a, b, dtype=np.int64)
            total = term if total is None else np.add(total, term, out=total if total.shape == term.shape else None)
            if n % (1 << 13) == 0:
                total %= self.modulus
        return total % self.modulus

    def neg(self, a):
        return -a % self.modulus

    def _pow(self, x: np.ndarray, exponents: np.ndarray) -> np.ndarray:
        """x^e per residue (square and multiply; exponents holds e for mod p and e for mod q)."""
        result, base, e = np.ones_like(x, dtype=np.int64), x % self.modulus, np.array(exponents, dtype=np.int64)
        while np.any(e > 0):
            result = np.where(e & 1, result * base % self.modulus, result)
            base, e = base * base % self.modulus, e >> 1
        return result

    def inverse(self, x):
        """x^(m − 2) per residue: the inverse, and 0 for 0."""
        return self._pow(x, self.modulus - 2)

    def div(self, a, b):
        return self.mul(a, self.inverse(b))

    def power(self, x, n: int):
        """x^n for any integer n (the exponent reduced by Fermat: x^(m − 1) = 1 unless x = 0)."""
        e = abs(n)
        y = self._pow(x, np.array([(e - 1) % (m - 1) + 1 if e else 0 for m in (self.p, self.q)]))
        return y if n >= 0 else self.inverse(y)

    def sum(self, x, axis: int, keepdims: bool = False):
        return np.sum(x, axis=axis, keepdims=keepdims, dtype=np.int64) % self.modulus

    def mean(self, x, axis: int, keepdims: bool = False):
        return self.mul(self.sum(x, axis, keepdims), self.rational(Fraction(1, x.shape[axis])))

    def matmul(self, a, b):
        return np.stack([matmul_mod(a[..., k], b[..., k], m) for k, m in enumerate((self.p, self.q))], axis=-1)

    def matmul_p_only(self, a, b):
        """matmul's p-residues, with q-residues 0: for a product whose q-residues nothing reads."""
        p = matmul_mod(a[..., 0], b[..., 0], self.p)
        return np.stack([p, np.zeros_like(p)], axis=-1)

    # -- exp and the random oracles ------------------------------------------------------------

    def salt(self, key: str) -> int:
        """The salt of oracle `key` in this test: a keyed hash of the key with the test's secret."""
        return int.from_bytes(hashlib.blake2b(key.encode(), key=self.secret, digest_size=8).digest(), "little")

    def _hash(self, key: str, residues: np.ndarray, m: int) -> np.ndarray:
        return (mix(residues, self.salt(key)) % np.uint64(m)).astype(np.int64)

    def exp(self, x):
        t = x[..., 1]
        value = self._exp_low[t & ((1 << _EXP_SPLIT) - 1)] * self._exp_high[t >> _EXP_SPLIT] % self.p
        return np.stack([value, self._hash("exp", value, self.q)], axis=-1)

    def oracle(self, key: str, x):
        """A random function of x's p-residue, fresh in every test and for every key."""
        return np.stack([self._hash(key, x[..., 0], self.p), self._hash(key + "/q", x[..., 0], self.q)], axis=-1)

    def sqrt(self, x):
        return self.oracle("sqrt", x)

    def max(self, x, axis: int, keepdims: bool = False):
        """The maximum along `axis` under the test's random total order of the field."""
        index = np.expand_dims(np.argmax(mix(x[..., 0], self.salt("max")), axis=axis), axis)
        out = np.take_along_axis(x, index[..., None], axis=axis)
        return out if keepdims else np.squeeze(out, axis=axis)


# ---------------------------------------------------------------------------------------------
# rules

@attrs.frozen
class FieldRule:
    """An operator's finite-field meaning and the degree bound of its outputs.

    `apply(field, values, attrs)` returns the output values; accumulators get, instead of values, the
    list of their inputs at each loop iteration. `degree(degrees, types, attrs, loop)` returns the
    output degrees from the input degrees and types (`loop`: the for-loop range, for accumulators).
    """

    apply: Callable
    degree: Callable
    reads_q: tuple = ()                        # inputs whose q-residues it reads, whatever its outputs feed
    apply_p_only: Optional[Callable] = None    # as apply, for outputs whose q-residues nothing reads: it
    # computes their p-residues only (q-residues 0), where that saves real work
    # an accumulator's running form: fold(field, attrs, p_only) -> an object whose add(inputs) takes one
    # iteration's inputs and whose result() gives apply's outputs (their p-residues alone with p_only), so
    # that a block graph need not hold every iteration's inputs; None where it cannot fold (or not p_only)
    fold: Optional[Callable] = None


FRESH: Deg = (1, 0)  # an oracle or exp value: a fresh variable in the bound's model


def _plus(a: Deg, b: Deg) -> Deg:
    return (max(a[0] + b[1], b[0] + a[1]), a[1] + b[1])


def _times(a: Deg, b: Deg) -> Deg:
    return (a[0] + b[0], a[1] + b[1])


def _over(a: Deg, b: Deg) -> Deg:
    return (a[0] + b[1], a[1] + b[0])


def _sum_of(a: Deg, n: int) -> Deg:
    """A sum of n terms of degree a, each with its own denominator."""
    return (a[0] + (n - 1) * a[1], n * a[1])


def _power_degree(a: Deg, n: int) -> Deg:
    return (n * a[0], n * a[1]) if n >= 0 else (-n * a[1], -n * a[0])


def _axis(x: np.ndarray, dim: int) -> int:
    """A tensor dim as an axis of a field value (whose last axis holds the two residues)."""
    return dim % (x.ndim - 1)


def _dim_size(t: TensorType, dim: int) -> int:
    return t.shape[dim % t.rank]


def _elementwise(fn: Callable, degree: Callable) -> FieldRule:
    """A rule whose output is fn(field, *inputs, attrs); degree(input degrees, attrs)."""
    return FieldRule(lambda f, xs, a: [fn(f, *xs, a)], lambda ds, ts, a, loop: [degree(*ds, a)])


def _oracle(key: Callable) -> FieldRule:
    return _elementwise(lambda f, x, a: f.oracle(key(a), x), lambda d, a: FRESH)


def oracle(name: str) -> FieldRule:
    """The rule of a unary operator without a field meaning: the test's random oracle keyed by `name`."""
    return _oracle(lambda a: name)


def _times_oracle(key: str) -> FieldRule:
    """x · g(x) with g an oracle (silu = x·σ(x), gelu = x·Φ(x))."""
    return _elementwise(lambda f, x, a: f.mul(x, f.oracle(key, x)), lambda d, a: _times(d, FRESH))


def _halves(exponent: float) -> Optional[int]:
    """k when the exponent is k/2 for an integer k, else None."""
    k = 2 * exponent
    return int(k) if math.isfinite(k) and k.is_integer() else None


def _pow_scalar(f: Field, x, a):
    k = _halves(a["exponent"])
    if k is None:
        return f.oracle(f"pow {a['exponent']!r}", x)
    return f.power(x, k // 2) if k % 2 == 0 else f.power(f.sqrt(x), k)  # x^(k/2) = sqrt(x)^k


def _pow_scalar_degree(d: Deg, a) -> Deg:
    k = _halves(a["exponent"])
    if k is None:
        return FRESH
    return _power_degree(d, k // 2) if k % 2 == 0 else _power_degree(FRESH, k)


def _reduction(fn: Callable, degree: Callable) -> FieldRule:
    """sum / mean / max over attrs['dim']: fn(field, x, axis, keepdim); degree(d, size of the dim)."""
    return FieldRule(lambda f, xs, a: [fn(f, xs[0], _axis(xs[0], a["dim"]), a["keepdim"])],
                     lambda ds, ts, a, loop: [degree(ds[0], _dim_size(ts[0], a["dim"]))])


def _rms_norm(f: Field, x, a):
    mean_square = f.mean(f.mul(x, x), _axis(x, a["dim"]), keepdims=True)
    return f.div(x, f.sqrt(f.add(mean_square, f.scalar(a["eps"]))))


def _split(f: Field, xs, a):
    return np.split(xs[0], np.cumsum(a["sizes"])[:-1], axis=_axis(xs[0], a["dim"]))


# accumulators: `its` is the list, per loop iteration, of the accumulator's inputs (with a leading
# block axis: the rules reduce the stacked iterations' axis 0 and axes counted from the end only)

def _stack(its, k: int = 0) -> np.ndarray:
    return np.stack([it[k] for it in its])


def _iteration_sum(f: Field, its, k: int = 0) -> np.ndarray:
    """Σ over the iterations of their input k, added one at a time rather than stacked (the iterations of
    a large block graph take tens of megabytes): int64 sums of residues below 2^25, exact for 2^38 terms."""
    total = np.array(its[0][k], dtype=np.int64)
    for it in its[1:]:
        total = np.add(total, it[k], out=total if total.shape == np.shape(it[k]) else None)
    return total % f.modulus


def _row_sums(f: Field, its) -> np.ndarray:
    """Sum over the iterations and the tile's last dim (kept)."""
    return f.sum(_iteration_sum(f, its), axis=-2, keepdims=True)


def _row_mean(f: Field, its) -> np.ndarray:
    return f.mul(_row_sums(f, its), f.rational(Fraction(1, len(its) * its[0][0].shape[-2])))


def _rescaled_sum(f: Field, its, x: Sequence) -> np.ndarray:
    """Σ_i exp(m_i − M)·x_i with M the maximum of the m_i under the field's order (it cancels)."""
    m = _stack(its, 1)
    return f.sum_of_products(zip(f.exp(f.sub(m, f.max(m, axis=0, keepdims=True))), x))


def _accum_rms(f: Field, its, a):
    """sqrt(mean of squares + eps), the same field value (so the same oracle value) as rms_norm's."""
    squares = [[f.mul(it[0], it[0])] for it in its]
    return f.sqrt(f.add(_row_mean(f, squares), f.scalar(a["eps"])))


def _accumulator(fn: Callable, degree: Callable, fold: Optional[Callable] = None) -> FieldRule:
    """fn(field, iterations, attrs); degree(input degrees, loop range, the tile's type); fold: FieldRule.fold."""
    return FieldRule(lambda f, its, a: [fn(f, its, a)], lambda ds, ts, a, loop: [degree(ds, loop, ts[0])],
                     fold=fold)


class _SumFold:
    """accum, accum_sum, accum_mean, accum_rms as a running sum of the iterations' residues (of their
    squares for accum_rms): the int64 sum of residues below 2^25 that `_iteration_sum` makes, so the same
    values in both residues."""

    def __init__(self, f: Field, op: str, a: dict):
        self.f, self.op, self.a = f, op, a
        self.total, self.count, self.width = None, 0, 0

    def add(self, its: list) -> None:
        x = its[0]
        if self.op == "accum_rms":
            x = self.f.mul(x, x)
        self.total = np.array(x, dtype=np.int64) if self.total is None else self.total + x
        self.count, self.width = self.count + 1, x.shape[-2]

    def result(self) -> list:
        f, total = self.f, self.total % self.f.modulus
        if self.op == "accum":
            return [total]
        rows = f.sum(total, axis=-2, keepdims=True)
        if self.op == "accum_sum":
            return [rows]
        mean = f.mul(rows, f.rational(Fraction(1, self.count * self.width)))
        return [mean if self.op == "accum_mean" else f.sqrt(f.add(mean, f.scalar(self.a["eps"])))]


class _MaxFold:
    """accum_max: the maximum so far under the test's order; an equal one later does not replace it, as
    `Field.max` takes the first of equal maxima."""

    def __init__(self, f: Field):
        self.salt, self.best, self.rank = f.salt("max"), None, None

    def add(self, its: list) -> None:
        x = its[0]
        rank = mix(x[..., 0], self.salt)
        if self.best is None:
            self.best, self.rank = np.array(x, dtype=np.int64), rank
            return
        later = rank > self.rank
        self.best, self.rank = np.where(later[..., None], x, self.best), np.where(later, rank, self.rank)

    def result(self) -> list:
        return [self.best]


class _RescaledFold:
    """accum_rescale and accum_sum_rescale, p-residues only: Σ_i exp(m_i − M)·x_i = ω^(−M) Σ_i ω^(m_i)·x_i
    mod p (exp's p-residue is ω to the power of the argument's q-residue, and ω has order q), with the
    maximum M of the m_i found as `_MaxFold` finds it; the sum reduced every 2^13 terms, as
    `Field.sum_of_products` reduces it."""

    def __init__(self, f: Field, rows: bool):
        self.f, self.rows, self.top, self.total, self.count = f, rows, _MaxFold(f), None, 0

    def add(self, its: list) -> None:
        x, m = its
        if self.rows:
            x = self.f.sum(x, axis=-2, keepdims=True)
        self.top.add([m])
        term = np.multiply(self.f.exp(m)[..., 0], x[..., 0], dtype=np.int64)
        self.total = term if self.total is None else self.total + term
        self.count += 1
        if self.count % (1 << 13) == 0:
            self.total %= self.f.p

    def result(self) -> list:
        f = self.f
        scale = f.exp(f.neg(self.top.best))[..., 0]
        p = self.total % f.p * scale % f.p
        return [np.stack([p, np.zeros_like(p)], axis=-1)]


def _same(d: Deg, a) -> Deg:
    return d


FIELD_RULES: RuleTable[FieldRule] = RuleTable("finite-field verifier", FieldRule,
                                               "mdsl.passes.finite_field (FIELD_RULES)",
                                               needs=lambda op: not op.is_graph_defined)

for _name, _rule in {
    "exp": attrs.evolve(_elementwise(lambda f, x, a: f.exp(x), lambda d, a: FRESH), reads_q=(0,)),
    "silu": _times_oracle("sigmoid"),
    "gelu": _times_oracle("gelu"),
    "relu": oracle("relu"),
    "sigmoid": oracle("sigmoid"),
    "sqrt": _elementwise(lambda f, x, a: f.sqrt(x), lambda d, a: FRESH),
    "rsqrt": _elementwise(lambda f, x, a: f.inverse(f.sqrt(x)), lambda d, a: _over((0, 0), FRESH)),
    "square": _elementwise(lambda f, x, a: f.mul(x, x), lambda d, a: _power_degree(d, 2)),
    "neg": _elementwise(lambda f, x, a: f.neg(x), _same),
    "reciprocal": _elementwise(lambda f, x, a: f.inverse(x), lambda d, a: _power_degree(d, -1)),
    "mul_scalar": _elementwise(lambda f, x, a: f.mul(x, f.scalar(a["value"])), _same),
    "add_scalar": _elementwise(lambda f, x, a: f.add(x, f.scalar(a["value"])), lambda d, a: _plus(d, (0, 0))),
    "pow_scalar": _elementwise(_pow_scalar, _pow_scalar_degree),
    "clamp": _oracle(lambda a: f"clamp {a['min']!r} {a['max']!r}"),
    # float -> int truncation is taken as exact: mdsl's integers are indices, whose casts are exact
    "cast": _elementwise(lambda f, x, a: x, _same),
    "add": _elementwise(lambda f, x, y, a: f.add(x, y), lambda d, e, a: _plus(d, e)),
    "sub": _elementwise(lambda f, x, y, a: f.sub(x, y), lambda d, e, a: _plus(d, e)),
    "mul": _elementwise(lambda f, x, y, a: f.mul(x, y), lambda d, e, a: _times(d, e)),
    "div": _elementwise(lambda f, x, y, a: f.div(x, y), lambda d, e, a: _over(d, e)),
    "matmul": FieldRule(lambda f, xs, a: [f.matmul(*xs)],
                        lambda ds, ts, a, loop: [_sum_of(_times(*ds), ts[0].shape[-1])],
                        apply_p_only=lambda f, xs, a: [f.matmul_p_only(*xs)]),
    "sum": _reduction(Field.sum, _sum_of),
    "mean": _reduction(Field.mean, _sum_of),
    "max": _reduction(Field.max, lambda d, n: d),  # it picks one of its arguments
    "rms_norm": _elementwise(_rms_norm, lambda d, a: _over(d, FRESH)),
    "concat": FieldRule(lambda f, xs, a: [np.concatenate(xs, axis=_axis(xs[0], a["dim"]))],
                        lambda ds, ts, a, loop: [tuple(map(max, zip(*ds)))]),
    "split": FieldRule(_split, lambda ds, ts, a, loop: [ds[0]] * len(a["sizes"])),
    "reshape": _elementwise(lambda f, x, a: x.reshape(tuple(a["shape"]) + (2,)), _same),
    "transpose": _elementwise(lambda f, x, a: np.transpose(x, tuple(a["perm"]) + (x.ndim - 1,)), _same),
    "accum": _accumulator(lambda f, its, a: _iteration_sum(f, its), lambda ds, r, t: _sum_of(ds[0], r),
                          lambda f, a, p_only: _SumFold(f, "accum", a)),
    "accum_sum": _accumulator(lambda f, its, a: _row_sums(f, its), lambda ds, r, t: _sum_of(ds[0], r * t.shape[-1]),
                              lambda f, a, p_only: _SumFold(f, "accum_sum", a)),
    "accum_mean": _accumulator(lambda f, its, a: _row_mean(f, its), lambda ds, r, t: _sum_of(ds[0], r * t.shape[-1]),
                               lambda f, a, p_only: _SumFold(f, "accum_mean", a)),
    "accum_rms": _accumulator(_accum_rms, lambda ds, r, t: FRESH, lambda f, a, p_only: _SumFold(f, "accum_rms", a)),
    "accum_max": _accumulator(lambda f, its, a: f.max(_stack(its), axis=0), lambda ds, r, t: ds[0],
                              lambda f, a, p_only: _MaxFold(f)),
    # (the rescaling accumulators exponentiate their maxima, input 1; they fold where only their outputs'
    # p-residues are read: exp's q-residue is a hash of its p-residue, which no running form gives)
    "accum_rescale": attrs.evolve(_accumulator(lambda f, its, a: _rescaled_sum(f, its, [it[0] for it in its]),
                                               lambda ds, r, t: _sum_of(_times(ds[0], FRESH), r),
                                               lambda f, a, p_only: _RescaledFold(f, False) if p_only else None),
                                  reads_q=(1,)),
    "accum_sum_rescale": attrs.evolve(_accumulator(
        lambda f, its, a: _rescaled_sum(f, its, f.sum(_stack(its), axis=-2, keepdims=True)),
        lambda ds, r, t: _sum_of(_times(_sum_of(ds[0], t.shape[-1]), FRESH), r),
        lambda f, a, p_only: _RescaledFold(f, True) if p_only else None), reads_q=(1,)),
}.items():
    FIELD_RULES.register(_name, _rule)


def field_rule(opdef: OpDef) -> FieldRule:
    return FIELD_RULES.lookup(opdef.name)


# ---------------------------------------------------------------------------------------------
# evaluation

def q_residues_read(graph: KernelGraph) -> frozenset:
    """The names of the values whose q-residues may be read: those an exp or a rescaling accumulator
    reads (`FieldRule.reads_q`), and, going backwards, every input of an operator with such an output
    (whatever the operator, so the set can only be too large). Outputs are compared by p-residue, so
    nothing else reads a q-residue. Names are not unique across the levels of a mugraph (a block
    graph may reuse a kernel-level name): one read at any level counts at every level."""
    read: set = set()

    def walk(nodes: Sequence[Node], live: set) -> None:
        for node in reversed(nodes):
            outputs_read = [v.name in live for v in node.outputs]
            if node.opdef.is_graph_defined:
                body = node.body
                if isinstance(body, BlockGraph):
                    inputs, outputs = [i.var for i in body.inputs], [o.var for o in body.outputs]
                else:
                    inputs, outputs = body.inputs, body.outputs
                inner = {v.name for v, r in zip(outputs, outputs_read) if r}
                walk(body.nodes, inner)
                needed = [v.name in inner for v in inputs]
            else:
                reads_q = field_rule(node.opdef).reads_q
                needed = [any(outputs_read) or k in reads_q for k in range(len(node.inputs))]
            live.update(v.name for v, n in zip(node.inputs, needed) if n)
        read.update(live)

    walk(graph.nodes, set())
    return frozenset(read)


_RESIDUE_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def inputs_q_read(graph: KernelGraph) -> list:
    """For each input of the graph, whether its q-residues may be read (`q_residues_read`)."""
    read = q_residues_read(graph)
    return [v.name in read for v in graph.inputs]


@attrs.frozen
class FieldSemantics:
    """`mdsl.ir.evaluate`'s walk over values in one test's field. With `q_read` (the names from
    `q_residues_read`), an operator none of whose outputs is in it skips its q-residues where its rule
    can (`FieldRule.apply_p_only`); without it every residue is computed."""

    field: Field
    q_read: Optional[frozenset] = None

    def take_input(self, var: Var, array) -> np.ndarray:
        array = self.convert(array)
        if array.shape != var.shape + (2,):
            raise ShapeError(f"the field value of input %{var.name} must have shape "
                                   f"{list(var.shape + (2,))}, got {list(array.shape)}")
        array = array.view()
        array.flags.writeable = False
        return array

    def store(self, var: Var, value: np.ndarray) -> np.ndarray:
        return value

    def convert(self, value) -> np.ndarray:
        """int32 and int64 residues as they are (an input held narrow is not widened whole)."""
        value = np.asarray(value)
        return value if value.dtype in _RESIDUE_DTYPES else value.astype(np.int64)

    def shape(self, value: np.ndarray) -> tuple:
        return value.shape[:-1]

    def apply(self, node: Node, args: list) -> list:
        rule = field_rule(node.opdef)
        if (rule.apply_p_only is not None and self.q_read is not None
                and not any(v.name in self.q_read for v in node.outputs)):
            return rule.apply_p_only(self.field, args, node.attr_dict)
        return rule.apply(self.field, args, node.attr_dict)

    def accumulate(self, node: Node, iterations: list) -> list:
        return field_rule(node.opdef).apply(self.field, iterations, node.attr_dict)

    def fold(self, node: Node):
        """The accumulator's running form (FieldRule.fold), or None: p-residues only where nothing reads
        its outputs' q-residues (known only with `q_read`)."""
        rule = field_rule(node.opdef)
        if rule.fold is None:
            return None
        p_only = self.q_read is not None and not any(v.name in self.q_read for v in node.outputs)
        return rule.fold(self.field, node.attr_dict, p_only)

    def empty(self, type_: TensorType) -> np.ndarray:
        return np.full(type_.shape + (2,), -1, dtype=np.int64)  # no residue is negative


def run_in_field(graph: KernelGraph, inputs: Sequence[np.ndarray], field: Field) -> list:
    """Evaluate a kernel graph on field values (arrays of shape tensor shape + (2,)). The outputs'
    p-residues are exact; q-residues that nothing reads may be left 0 (see `q_residues_read`)."""
    return evaluate.run_kernel_graph(graph, inputs, FieldSemantics(field, q_residues_read(graph)))


# ---------------------------------------------------------------------------------------------
# degrees

class _Degrees:
    """Walks a graph with the rules' degree bounds; remembers the largest (numerator + denominator)
    degree of any value, which bounds what an oracle or an exp may read."""

    def __init__(self):
        self.largest = 0

    def nodes(self, nodes: Sequence[Node], env: dict, loop: int) -> None:
        for node in nodes:
            ins = [env[v.name] for v in node.inputs]
            if node.opdef.is_graph_defined:
                outs = self.body(node.body, ins)
            else:
                outs = field_rule(node.opdef).degree(ins, [v.type for v in node.inputs], node.attr_dict, loop)
            for var, deg in zip(node.outputs, outs):
                env[var.name] = deg
                self.largest = max(self.largest, sum(deg))

    def body(self, body, ins: list) -> list:
        if isinstance(body, BlockGraph):
            inputs, outputs, loop = [i.var for i in body.inputs], [o.var for o in body.outputs], body.forloop
        else:
            inputs, outputs, loop = body.inputs, body.outputs, 1
        env = {v.name: d for v, d in zip(inputs, ins)}
        self.nodes(body.nodes, env, loop)
        return [env[v.name] for v in outputs]


def degrees(graph: KernelGraph) -> tuple:
    """Degree bounds (numerator, denominator) of the graph's outputs as rational functions of its
    inputs, with oracle and exp values as fresh variables; and the largest degree of any value."""
    walk = _Degrees()
    env = {v.name: (1, 0) for v in graph.inputs}
    walk.nodes(graph.nodes, env, 1)
    return [env[v.name] for v in graph.outputs], max([walk.largest] + [sum(env[v.name]) for v in graph.outputs])

"""Abstract expressions: what each tensor computes, as a term over the kernel graph's inputs.

The search prunes a partial candidate unless every tensor's term is a subexpression of the target's
term (`mdsl.passes.subexpr`). Terms forget indices, layouts and dtypes: `matmul(a, b)` is
`sum(k, mul(a, b))`, a reduction over n elements is `sum(n, .)`, a layout op is the identity. A
concat of pieces that compute different expressions is a `concat` term that remembers where the
pieces lie, so that a split recovers them and a matmul of two concatenations along the contracted
dim becomes a sum of matmuls (LoRA's (X | X.A).(W ; B) = X.W + X.A.B).

Terms are immutable and hash-consed: building the same term twice gives the same object, so equality
is identity and terms are cheap dict keys. The constructors below canonicalise where it is free
(flatten and sort add/mul, fold constants, merge nested sums, drop sums over 1), so that many queries
are settled by comparing terms, without z3.

Every operator in `mdsl.ir.ops.OPS` has a rule (`AbstractRule`: its inputs' terms -> its outputs'),
in this module's table `ABSTRACT_RULES`. An element-wise operator of one operand and no attributes
(`OpDef.is_unary`) is an uninterpreted function of its name, unless it has a rule of its own (exp, neg).

Two rules deliberately compute less than the operator does, for online softmax. A max subtracted
inside an exponent does not change what softmax computes (it cancels between numerator and
denominator), so `exp` strips subtracted max terms, and the rescaling accumulators drop their
scale. This only affects pruning, which is a heuristic for completeness: the finite-field verifier
decides whether a candidate is correct.
"""
from __future__ import annotations

import functools
import re
import weakref
from fractions import Fraction
from typing import Any, Callable, Iterable, Sequence

import attrs

from mdsl.errors import ParseError
from mdsl.ir.graph import BlockGraph, KernelGraph, Node, ThreadGraph
from mdsl.ir.ops import OPS
from mdsl.ir.rules import RuleTable

REDUCTION_HEADS = frozenset({"sum", "max", "rms"})
COMMUTATIVE_HEADS = frozenset({"add", "mul"})


def is_unary_head(head: str) -> bool:
    """Whether `head` is an element-wise function of one term: an operator of the registry that is unary
    (`OpDef.is_unary`: exp, sqrt, silu, ..., neg)."""
    op = OPS.get(head)
    return op is not None and op.is_unary


def unary_heads() -> frozenset:
    return frozenset(name for name, op in OPS.items() if op.is_unary)


# ---------------------------------------------------------------------------------------------
# terms

_TABLE: "weakref.WeakValueDictionary[tuple, Term]" = weakref.WeakValueDictionary()


class Term:
    """One node of an abstract expression: `head` names the function, `args` are sub-terms and
    `param` the non-term argument (input index, constant, reduction size, exponent, clamp bounds,
    concat placement). Build terms with the constructor functions of this module, not directly."""

    __slots__ = ("head", "args", "param", "_hash", "_text", "__weakref__")

    head: str
    args: tuple
    param: Any

    def __new__(cls, head: str, args: tuple = (), param: Any = None) -> "Term":
        key = (head, args, param)
        term = _TABLE.get(key)
        if term is None:
            term = object.__new__(cls)
            for name, value in zip(("head", "args", "param", "_hash", "_text"), (*key, hash(key), None)):
                object.__setattr__(term, name, value)
            _TABLE[key] = term
        return term

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("terms are immutable")

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # unpickling goes through __new__, so terms stay hash-consed across processes
        return (Term, (self.head, self.args, self.param))

    def __repr__(self) -> str:
        return f"Term({str(self)!r})"

    def __str__(self) -> str:
        if self._text is None:
            object.__setattr__(self, "_text", _render(self))
        return self._text


def _fmt(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    if value.denominator <= 1 << 20:
        return f"{value.numerator}/{value.denominator}"
    return repr(float(value))


def _render(t: Term) -> str:
    if t.head == "var":
        return f"x{t.param}"
    if t.head == "const":
        return f"const({_fmt(t.param)})"
    inner = ", ".join(map(str, t.args))
    if t.head in REDUCTION_HEADS:
        return f"{t.head}({t.param}, {inner})"
    if t.head == "pow":
        return f"pow({inner}, {_fmt(t.param)})"
    if t.head == "clamp":
        return f"clamp({_fmt(t.param[0])}, {_fmt(t.param[1])}, {inner})"
    if t.head == "concat":
        dim, sizes = t.param
        return f"concat[{'?' if dim is None else dim}: {', '.join(map(str, sizes))}]({inner})"
    return f"{t.head}({inner})"


def _num(value) -> Fraction:
    """Constants are exact: a float becomes the fraction it denotes."""
    return value if isinstance(value, Fraction) else Fraction(value)


def _sort_key(t: Term) -> str:
    return str(t)


# ---------------------------------------------------------------------------------------------
# constructors (canonicalising)

def var(index: int) -> Term:
    """Input `index` of the kernel graph, printed x<index>."""
    return Term("var", (), int(index))


def const(value) -> Term:
    return Term("const", (), _num(value))


def _flatten(head: str, terms: Iterable[Term]) -> list:
    out = []
    for t in terms:
        out.extend(t.args if t.head == head else (t,))
    return out


def _commutative(head: str, args: list, unit: Fraction, fold: Callable) -> Term:
    """add/mul: flatten, fold the constants into one (dropped when it is the unit), sort the rest."""
    args = _flatten(head, args)
    rest = [a for a in args if a.head != "const"]
    folded = unit
    for a in args:
        if a.head == "const":
            folded = fold(folded, a.param)
    if folded != unit or not rest:
        rest.append(const(folded))
    if len(rest) == 1:
        return rest[0]
    return Term(head, tuple(sorted(rest, key=_sort_key)))


def add(*terms: Term) -> Term:
    return _commutative("add", list(terms), Fraction(0), lambda a, b: a + b)


def mul(*terms: Term) -> Term:
    return _commutative("mul", list(terms), Fraction(1), lambda a, b: a * b)


def neg(x: Term) -> Term:
    if x.head == "neg":
        return x.args[0]
    if x.head == "const":
        return const(-x.param)
    return Term("neg", (x,))


def sub(x: Term, y: Term) -> Term:
    return add(x, neg(y))


def div(x: Term, y: Term) -> Term:
    if y.head == "const" and y.param != 0:
        return mul(x, const(1 / y.param))
    return Term("div", (x, y))


def unary(head: str, x: Term) -> Term:
    """An element-wise function applied to x: exp, sqrt, rsqrt, silu, gelu, relu, sigmoid, square,
    reciprocal or neg."""
    if not is_unary_head(head):
        raise ValueError(f"{head} is not a unary head ({', '.join(sorted(unary_heads()))})")
    return neg(x) if head == "neg" else Term(head, (x,))


def power(x: Term, exponent) -> Term:
    exponent = _num(exponent)
    return x if exponent == 1 else Term("pow", (x,), exponent)


def clamp(x: Term, lo, hi) -> Term:
    return Term("clamp", (x,), (_num(lo), _num(hi)))


def reduction(head: str, size: int, x: Term) -> Term:
    """sum, max or rms of x over `size` elements. A reduction over one element is x; nested sums
    (and maxes) merge into one over the product of the sizes; a sum pulls out constant factors and
    negation, so partial sums of a scaled term still merge."""
    if head not in REDUCTION_HEADS:
        raise ValueError(f"{head} is not a reduction head ({', '.join(sorted(REDUCTION_HEADS))})")
    size = int(size)
    if size < 1:
        raise ValueError(f"a reduction over {size} elements")
    if size == 1:
        return x
    if head in ("sum", "max") and x.head == head:
        return reduction(head, size * x.param, x.args[0])
    if head == "sum" and x.head == "neg":
        return neg(reduction(head, size, x.args[0]))
    if head == "sum" and x.head == "mul" and any(a.head == "const" for a in x.args):
        factors = [a for a in x.args if a.head == "const"]
        return mul(reduction(head, size, mul(*(a for a in x.args if a.head != "const"))), *factors)
    return Term(head, (x,), size)


def concat(pieces: Sequence[Term], dim, sizes: Sequence[int]) -> Term:
    """Pieces joined along `dim` (counted from the end, None when unknown) with extents `sizes`.
    Pieces that all compute the same expression concatenate to that expression."""
    pieces = tuple(pieces)
    if all(p is pieces[0] for p in pieces):
        return pieces[0]
    return Term("concat", pieces, (None if dim is None else int(dim), tuple(int(s) for s in sizes)))


def rebuild(term: Term, args: Sequence[Term]) -> Term:
    """`term` with its arguments replaced, canonicalised again."""
    args = tuple(args)
    head, param = term.head, term.param
    if head in ("add", "mul"):
        return (add if head == "add" else mul)(*args)
    if head == "div":
        return div(*args)
    if is_unary_head(head):
        return unary(head, *args)
    if head in REDUCTION_HEADS:
        return reduction(head, param, *args)
    if head == "pow":
        return power(*args, param)
    if head == "clamp":
        return clamp(*args, *param)
    if head == "concat":
        return concat(args, *param)
    return term  # var, const: no arguments


# ---------------------------------------------------------------------------------------------
# traversal and parsing

def subterms(term: Term) -> list:
    """Every distinct sub-term of `term` (itself included), children before parents."""
    seen: set = set()
    order: list = []
    stack = [(term, False)]
    while stack:
        t, expanded = stack.pop()
        if expanded:
            order.append(t)
        elif t not in seen:
            seen.add(t)
            stack.append((t, True))
            stack.extend((a, False) for a in reversed(t.args))
    return order


_TOKEN = re.compile(r"""\s*(?:
      (?P<num>-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?(?:/\d+)?)     # 3, -1.5, 1e-06, 1/4096
    | (?P<name>[A-Za-z_]\w*)
    | (?P<sym>[(),:?\[\]]))""", re.VERBOSE)


def _tokens(text: str) -> list:
    out, pos = [], 0
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ParseError(f"cannot read a term at column {pos + 1}: {text[pos:pos + 20]!r}")
        out.append(m.group(m.lastgroup))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks = _tokens(text)
        self.i = 0

    def fail(self, what: str):
        got = self.toks[self.i] if self.i < len(self.toks) else "the end"
        raise ParseError(f"term {self.text!r}: expected {what}, found {got!r}")

    def peek(self) -> str:
        return self.toks[self.i] if self.i < len(self.toks) else ""

    def take(self, expected: str = None) -> str:
        if self.i >= len(self.toks) or (expected is not None and self.toks[self.i] != expected):
            self.fail(repr(expected) if expected else "more input")
        self.i += 1
        return self.toks[self.i - 1]

    def number(self) -> Fraction:
        tok = self.take()
        try:  # a decimal is read as the float it names, so that printed floats read back exactly
            return Fraction(float(tok)) if re.search(r"[.eE]", tok) else Fraction(tok)
        except ValueError:
            self.fail("a number")

    def numbers(self) -> list:
        out = [self.number()]
        while self.peek() == ",":
            self.take(",")
            out.append(self.number())
        return out

    def placement(self) -> tuple:
        """A concat's `[dim: size, size, ...]`, dim `?` when unknown."""
        self.take("[")
        dim = None if self.peek() == "?" else int(self.number())
        if dim is None:
            self.take("?")
        self.take(":")
        sizes = [int(n) for n in self.numbers()]
        self.take("]")
        return dim, sizes

    def terms(self) -> list:
        out = [self.term()]
        while self.peek() == ",":
            self.take(",")
            out.append(self.term())
        return out

    def term(self) -> Term:
        name = self.take()
        if re.fullmatch(r"x\d+", name):
            return var(int(name[1:]))
        if name == "concat":
            dim, sizes = self.placement()
        self.take("(")
        if name == "const":
            out = const(self.number())
        elif name in REDUCTION_HEADS:
            size = int(self.number())
            self.take(",")
            out = reduction(name, size, self.term())
        elif name == "pow":
            x = self.term()
            self.take(",")
            out = power(x, self.number())
        elif name == "clamp":
            lo = self.number()
            self.take(",")
            hi = self.number()
            self.take(",")
            out = clamp(self.term(), lo, hi)
        elif name == "concat":
            out = concat(self.terms(), dim, sizes)
        elif name in ("add", "mul"):
            out = (add if name == "add" else mul)(*self.terms())
        elif name == "div":
            x, y = self.terms()
            out = div(x, y)
        elif is_unary_head(name):
            out = unary(name, self.term())
        else:
            raise ParseError(f"term {self.text!r}: unknown head {name!r}")
        self.take(")")
        return out


def parse_term(text: str) -> Term:
    """The term printed as `text` (the inverse of str(term)), canonicalised."""
    parser = _Parser(text)
    term = parser.term()
    if parser.i != len(parser.toks):
        parser.fail("the end")
    return term


# ---------------------------------------------------------------------------------------------
# per-operator rules

@attrs.frozen
class AbstractRule:
    """An operator's abstract expression: `terms(args, node, forloop)` gives one term per output of
    `node` from its inputs' terms `args` (`forloop`: the block graph's R)."""

    terms: Callable[[tuple, Node, int], tuple]


def strip_max_subtraction(t: Term) -> Term:
    """add(a, neg(max(...))) -> a: what an exponent reads once the softmax max cancels."""
    if t.head != "add":
        return t
    kept = [a for a in t.args if not (a.head == "neg" and a.args[0].head == "max")]
    return add(*kept) if kept else t


def _exp(args, node, forloop):
    return (unary("exp", strip_max_subtraction(args[0])),)


@functools.lru_cache(maxsize=None)
def function(head: str) -> AbstractRule:
    """The rule of a unary operator: the uninterpreted function `head` of its operand."""
    return AbstractRule(lambda args, node, forloop: (unary(head, args[0]),))


def _size(node: Node, dim: int, operand: int = 0) -> int:
    return node.inputs[operand].type.shape[dim]


def _contracted_pieces(a: Term, b: Term):
    """(a1 | a2) @ (b1 ; b2) = a1 @ b1 + a2 @ b2 when both operands are concatenated along the
    contracted dim with the same extents (LoRA's W.X + B.A.X = (W | B).(X ; A.X))."""
    if a.head == b.head == "concat" and a.param[0] == -1 and b.param[0] == -2 and a.param[1] == b.param[1]:
        return list(zip(a.args, b.args, a.param[1]))
    return None


def _matmul(args, node, forloop):
    a, b = args
    pieces = _contracted_pieces(a, b) or [(a, b, _size(node, -1))]
    return (add(*(reduction("sum", k, mul(x, y)) for x, y, k in pieces)),)


def _reduce(head: str) -> Callable:
    return lambda args, node, forloop: (reduction(head, _size(node, node.attr("dim")), args[0]),)


def _mean(args, node, forloop):
    n = _size(node, node.attr("dim"))
    return (mul(reduction("sum", n, args[0]), const(Fraction(1, n))),)


def _rms_norm(args, node, forloop):
    (x,) = args
    return (div(x, reduction("rms", _size(node, node.attr("dim")), x)),)  # eps does not change the expression


def _from_end(dim: int, rank: int) -> int:
    return dim % rank - rank


def _concat(args, node, forloop):
    rank = node.inputs[0].type.rank
    dim = node.attr("dim") % rank
    return (concat(args, _from_end(dim, rank), [v.type.shape[dim] for v in node.inputs]),)


def _split(args, node, forloop):
    (x,) = args
    dim = _from_end(node.attr("dim"), node.inputs[0].type.rank)
    if x.head == "concat" and x.param == (dim, node.attr("sizes")):
        return x.args
    return (x,) * len(node.outputs)


def _reshape(args, node, forloop):
    (x,) = args
    if x.head != "concat" or node.inputs[0].type.shape == node.outputs[0].type.shape:
        return (x,)
    return (concat(x.args, None, x.param[1]),)  # the pieces no longer lie along a known dim


def _transpose(args, node, forloop):
    (x,) = args
    if x.head != "concat" or x.param[0] is None:
        return (x,)
    rank = node.inputs[0].type.rank
    dim = node.attr("perm").index(x.param[0] + rank)
    return (concat(x.args, _from_end(dim, rank), x.param[1]),)


def _identity(args, node, forloop):
    return (args[0],)


def _custom(args, node, forloop):
    terms = block_terms(node.body, args)
    return tuple(terms[o.var.name] for o in node.body.outputs)


def _fused(args, node, forloop):
    terms = thread_terms(node.body, args)
    return tuple(terms[v.name] for v in node.body.outputs)


def _accumulate(head: str, over_last: bool, scale: Callable = None) -> Callable:
    """Accumulators reduce over the R loop iterations (times the tile's last dim when they reduce
    it). The rescaling accumulators' second operand (the running max) is dropped: see the module
    docstring."""
    def rule(args, node, forloop):
        n = forloop * (_size(node, -1) if over_last else 1)
        out = reduction(head, n, args[0])
        return (out if scale is None else mul(out, const(scale(n))),)
    return rule


ABSTRACT_RULES: RuleTable[AbstractRule] = RuleTable(
    "abstract-expression pass", AbstractRule, "mdsl.passes.abstract (ABSTRACT_RULES)", needs=lambda op: True,
    by_category=lambda op: function(op.name) if op.is_unary else None)

for _name, _rule in {
    "exp": _exp,
    "mul_scalar": lambda args, node, forloop: (mul(args[0], const(node.attr("value"))),),
    "add_scalar": lambda args, node, forloop: (add(args[0], const(node.attr("value"))),),
    "pow_scalar": lambda args, node, forloop: (power(args[0], node.attr("exponent")),),
    "clamp": lambda args, node, forloop: (clamp(args[0], node.attr("min"), node.attr("max")),),
    "cast": _identity,
    "add": lambda args, node, forloop: (add(*args),),
    "sub": lambda args, node, forloop: (sub(*args),),
    "mul": lambda args, node, forloop: (mul(*args),),
    "div": lambda args, node, forloop: (div(*args),),
    "matmul": _matmul,
    "sum": _reduce("sum"),
    "mean": _mean,
    "max": _reduce("max"),
    "rms_norm": _rms_norm,
    "concat": _concat,
    "split": _split,
    "reshape": _reshape,
    "transpose": _transpose,
    "custom": _custom,
    "fused": _fused,
    "accum": _accumulate("sum", False),
    "accum_sum": _accumulate("sum", True),
    "accum_mean": _accumulate("sum", True, lambda n: Fraction(1, n)),
    "accum_rms": _accumulate("rms", True),
    "accum_max": _accumulate("max", False),
    "accum_rescale": _accumulate("sum", False),
    "accum_sum_rescale": _accumulate("sum", True),
}.items():
    ABSTRACT_RULES.register(_name, AbstractRule(_rule))


# ---------------------------------------------------------------------------------------------
# the pass

def node_terms(node: Node, args: Sequence[Term], forloop: int = 1) -> tuple:
    """The terms of `node`'s outputs given its inputs' terms; `forloop` is the block graph's R."""
    outs = tuple(ABSTRACT_RULES.lookup(node.op, node.loc).terms(tuple(args), node, forloop))
    assert len(outs) == len(node.outputs), f"{node.op}: the rule gave {len(outs)} terms for {len(node.outputs)} outputs"
    return outs


def _run(nodes: Iterable[Node], env: dict, forloop: int) -> dict:
    for node in nodes:
        outs = node_terms(node, [env[v.name] for v in node.inputs], forloop)
        env.update(zip((v.name for v in node.outputs), outs))
    return env


def block_terms(graph: BlockGraph, input_terms: Sequence[Term]) -> dict:
    """Var name -> term for the tiles of a (possibly partial) block graph: input i's tile has
    `input_terms[i]`, the term of the tensor it is cut from. Outputs are not needed, so the search
    can ask after each op it adds."""
    env = dict(zip((i.var.name for i in graph.inputs), input_terms, strict=True))
    return _run(graph.nodes, env, graph.forloop)


def thread_terms(graph: ThreadGraph, input_terms: Sequence[Term]) -> dict:
    env = dict(zip((v.name for v in graph.inputs), input_terms, strict=True))
    return _run(graph.nodes, env, 1)


def abstract_terms(graph: KernelGraph) -> dict:
    """Var name -> term for every tensor of the kernel graph; graph-defined ops are inlined."""
    env = {v.name: var(i) for i, v in enumerate(graph.inputs)}
    return _run(graph.nodes, env, 1)


def output_terms(graph: KernelGraph) -> tuple:
    """The terms of the graph's outputs, in order: the targets of the subexpression check."""
    terms = abstract_terms(graph)
    return tuple(terms[v.name] for v in graph.outputs)

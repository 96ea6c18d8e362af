"""The operator registry: one entry per operator, saying what it is.

An entry carries the levels it may appear at (kernel, block, thread), its category, its attributes,
its shape/dtype rule and its reference semantics in numpy. What a later layer does with an operator
(its abstract expression, its finite-field meaning, each backend's code) is that layer's rule, kept in
the layer's own table (`mdsl.ir.rules.RuleTable`), so that adding an operator never means editing a
switch statement elsewhere. Lists of operators are read from the registry (`category`, `is_unary`, ...),
never copied by hand.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import attrs
import numpy as np

from mdsl.errors import DTypeError, ShapeError, UnsupportedError, ValidationError, short_repr
from mdsl.ir.dtypes import DType, dtype_from_name
from mdsl.ir.types import TensorType

KERNEL, BLOCK, THREAD = "kernel", "block", "thread"
ALL_LEVELS = frozenset({KERNEL, BLOCK, THREAD})
KERNEL_AND_BLOCK = frozenset({KERNEL, BLOCK})

_REQUIRED = object()


@attrs.frozen
class AttrSpec:
    """One attribute of an operator. `kind` is int | float | bool | ints | dtype | op (the name of a
    registered element-wise operator of one operand and no attributes, such as an activation).

    A float is finite unless `infinite` allows +-inf (a clamp bound); NaN never is. `minimum` is
    the smallest float allowed (an epsilon is >= 0). These are the only range rules of attributes:
    tracing, validation and both parsers apply them through `OpDef.normalize_attrs`."""

    name: str
    kind: str
    default: Any = _REQUIRED
    minimum: Optional[float] = None
    infinite: bool = False

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def convert(self, value: Any, op: str) -> Any:
        try:
            if self.kind == "int":
                if isinstance(value, bool) or int(value) != value:
                    raise TypeError
                return int(value)
            if self.kind == "float":
                if isinstance(value, (bool, np.bool_, str, bytes)):
                    raise TypeError
                try:
                    number = float(value)
                except OverflowError:
                    raise ValidationError(f"attribute {self.name}={short_repr(value)} of {op} is beyond the range of "
                                          "a float64 (about 1.8e308)", hint="write the number meant") from None
                return self._in_range(number, op)
            if self.kind == "bool":
                if not isinstance(value, (bool, np.bool_)):
                    raise TypeError
                return bool(value)
            if self.kind == "ints":
                if any(isinstance(v, (bool, np.bool_)) for v in value):
                    raise TypeError
                out = tuple(int(v) for v in value)
                if any(o != v for o, v in zip(out, value)):
                    raise TypeError
                return out
            if self.kind == "dtype":
                return value if isinstance(value, DType) else dtype_from_name(str(value))
            if self.kind == "op":
                known = OPS.get(value) if isinstance(value, str) else None
                if known is None or not known.is_unary:
                    raise ValidationError(f"attribute {self.name}={short_repr(value)} of {op} must name an element-wise "
                                          "operator of one operand and no attributes",
                                          hint=f"one of {', '.join(unary_operator_names())}")
                return value
        except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float64, inf to int
            pass
        raise ValidationError(f"attribute {self.name}={short_repr(value)} of {op} must be of kind {self.kind}",
                              hint=f"{self.name} is {self._kind_text()}")

    def _kind_text(self) -> str:
        if self.kind == "float":
            text = "a number or +-inf (not NaN)" if self.infinite else "a finite number"
            return text if self.minimum is None else f"{text} >= {self.minimum:g}"
        return {"int": "an integer", "bool": "true or false", "ints": "a list of integers",
                "dtype": "a dtype name"}.get(self.kind, f"of kind {self.kind}")

    def _in_range(self, value: float, op: str) -> float:
        if math.isnan(value) or (math.isinf(value) and not self.infinite):
            hint = "a NaN or infinite value comes from a division by zero or an overflow; write the number meant"
        elif self.minimum is not None and value < self.minimum:
            hint = f"use a {self.name} of at least {self.minimum:g}"
        else:
            return value
        raise ValidationError(f"attribute {self.name}={value!r} of {op} must be {self._kind_text()}", hint=hint)


@attrs.frozen(eq=False)
class OpDef:
    name: str
    category: str                 # elementwise | matmul | reduction | norm | layout | accumulator | graph
    levels: frozenset
    arity: Optional[int]          # number of inputs; None means one or more
    attr_specs: tuple = ()
    infer: Optional[Callable] = None       # (input types, attrs dict) -> tuple of output types
    reference: Optional[Callable] = None   # (arrays, attrs dict) -> list of arrays; accumulators: (per-iteration input lists, attrs)
    body_level: Optional[str] = None       # graph-defined ops: the level of their body
    doc: str = ""

    @property
    def is_accumulator(self) -> bool:
        return self.category == "accumulator"

    @property
    def is_elementwise(self) -> bool:
        return self.category == "elementwise"

    @property
    def is_unary(self) -> bool:
        """An element-wise function of one operand and no attributes (exp, silu, ...): what an `op`
        attribute may name, and an uninterpreted function of the abstract expressions."""
        return self.is_elementwise and self.arity == 1 and not self.attr_specs

    @property
    def is_binary(self) -> bool:
        """An element-wise function of two operands, numpy-broadcast (add, sub, mul, div)."""
        return self.is_elementwise and self.arity == 2

    @property
    def is_graph_defined(self) -> bool:
        return self.body_level is not None

    def normalize_attrs(self, given: dict) -> tuple:
        """Fill defaults, check kinds, reject unknown names; a hashable tuple of pairs in declared order."""
        known = {s.name: s for s in self.attr_specs}
        unknown = set(given) - set(known)
        if unknown:
            raise ValidationError(f"{self.name} has no attribute {sorted(unknown)[0]!r}",
                                  hint=f"its attributes are: {', '.join(known) or 'none'}")
        out = []
        for spec in self.attr_specs:
            if spec.name in given:
                out.append((spec.name, spec.convert(given[spec.name], self.name)))
            elif spec.required:
                raise ValidationError(f"{self.name} needs the attribute {spec.name!r}")
            else:
                out.append((spec.name, spec.default))
        return tuple(out)

    def infer_types(self, input_types: tuple, attr_pairs: tuple) -> tuple:
        if self.arity is not None and len(input_types) != self.arity:
            raise ShapeError(f"{self.name} takes {self.arity} operand(s), got {len(input_types)}")
        if self.arity is None and not input_types:
            raise ShapeError(f"{self.name} takes at least one operand")
        return tuple(self.infer(tuple(input_types), dict(attr_pairs)))


OPS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in OPS:
        raise ValueError(f"operator {op.name} registered twice")
    OPS[op.name] = op
    return op


def unregister(name: str) -> None:
    """Remove an operator (one made for a test; its rules are removed from their tables separately)."""
    OPS.pop(name, None)


def get_op(name: str) -> OpDef:
    op = OPS.get(name)
    if op is None:
        raise UnsupportedError(f"unknown operator {name!r}", hint=f"known operators: {', '.join(sorted(OPS))}")
    return op


def unary_operator_names() -> list:
    """The element-wise operators of one operand and no attributes (what an `op` attribute may name)."""
    return sorted(name for name, op in OPS.items() if op.is_unary)


# ---------------------------------------------------------------------------------------------
# shape/dtype helpers

def _require_float(op: str, types) -> None:
    for i, t in enumerate(types):
        if not t.dtype.is_float:
            raise DTypeError(f"{op} needs floating-point operands, operand {i} is {t}",
                             hint="cast indices to a float type with mdsl.cast(x, mdsl.f32) first")


def _require_same_dtype(op: str, types) -> DType:
    first = types[0].dtype
    for t in types[1:]:
        if t.dtype != first:
            raise DTypeError(f"{op} operands have different dtypes: {', '.join(str(u) for u in types)}",
                             hint="cast one operand with mdsl.cast(x, dtype) so both agree")
    return first


def broadcast_shapes(op: str, *shapes: tuple) -> tuple:
    """numpy broadcasting, with an error that names the clashing dimension."""
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(-rank, 0):
        dims = {s[i] for s in shapes if len(s) >= -i} - {1}
        if len(dims) > 1:
            shown = " and ".join(f"[{', '.join(map(str, s))}]" for s in shapes)
            raise ShapeError(f"{op}: shapes {shown} do not broadcast (dimension {i}: {' vs '.join(map(str, sorted(dims)))})",
                             hint="broadcasting follows numpy: each dimension must match or be 1")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def norm_dim(op: str, dim: int, rank: int) -> int:
    if not -rank <= dim < rank:
        raise ShapeError(f"{op}: dim {short_repr(dim)} is out of range for a tensor of rank {rank}",
                         hint=f"dims count from 0 to {rank - 1}, or from the end: -1 is the last")
    return dim % rank


def _same_type(name):
    def infer(types, attrs_):
        _require_float(name, types[:1])
        return (types[0],)
    return infer


# ---------------------------------------------------------------------------------------------
# element-wise unary operators

def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[x.dtype])(x) if x.size else x.copy()


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


_UNARY: dict[str, tuple[Callable, str]] = {
    "exp": (np.exp, "e^x"),
    "silu": (lambda x: x * _sigmoid(x), "x * sigmoid(x)"),
    "gelu": (lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))), "exact (erf) GELU"),
    "relu": (lambda x: np.maximum(x, 0), "max(x, 0)"),
    "sigmoid": (_sigmoid, "1 / (1 + e^-x)"),
    "sqrt": (np.sqrt, "square root"),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), "1 / sqrt(x)"),
    "square": (np.square, "x * x"),
    "neg": (np.negative, "-x"),
    "reciprocal": (lambda x: 1.0 / x, "1 / x"),
}


def unary_op(name: str, fn: Callable, doc: str) -> OpDef:
    """The entry of an element-wise function of one operand and no attributes (`is_unary`), at every level,
    of a float operand's type; `fn` is its numpy semantics."""
    return OpDef(name, "elementwise", ALL_LEVELS, 1, (), _same_type(name), lambda xs, a: [fn(xs[0])], doc=doc)


for _name, (_fn, _doc) in _UNARY.items():
    register(unary_op(_name, _fn, _doc))

_SCALAR_UNARY = {
    "mul_scalar": (("value", "float"), lambda x, a: x * x.dtype.type(a["value"]), "x * value"),
    "add_scalar": (("value", "float"), lambda x, a: x + x.dtype.type(a["value"]), "x + value"),
    "pow_scalar": (("exponent", "float"), lambda x, a: np.power(x, x.dtype.type(a["exponent"])), "x ** exponent"),
}
for _name, ((_an, _ak), _fn, _doc) in _SCALAR_UNARY.items():
    register(OpDef(_name, "elementwise", ALL_LEVELS, 1, (AttrSpec(_an, _ak),), _same_type(_name),
                   (lambda fn: lambda xs, a: [fn(xs[0], a)])(_fn), doc=_doc))


def _clamp_infer(types, a):
    if a["min"] > a["max"]:
        raise ValidationError(f"clamp: min {a['min']} is greater than max {a['max']}",
                              hint="clamp(x, min, max) needs min <= max")
    return _same_type("clamp")(types, a)


register(OpDef("clamp", "elementwise", ALL_LEVELS, 1, (AttrSpec("min", "float", infinite=True),
                                                      AttrSpec("max", "float", infinite=True)),
               _clamp_infer, lambda xs, a: [np.clip(xs[0], a["min"], a["max"])], doc="min(max(x, min), max)"))


register(OpDef("cast", "elementwise", ALL_LEVELS, 1, (AttrSpec("dtype", "dtype"),),
               lambda types, a: (types[0].with_dtype(a["dtype"]),),
               lambda xs, a: [xs[0] if a["dtype"].is_float else np.trunc(xs[0])],
               doc="convert to another dtype (rounding happens where the value is stored)"))


# ---------------------------------------------------------------------------------------------
# element-wise binary operators (numpy broadcasting)

def _binary_infer(name):
    def infer(types, a):
        _require_float(name, types)
        dtype = _require_same_dtype(name, types)
        return (TensorType(broadcast_shapes(name, types[0].shape, types[1].shape), dtype),)
    return infer


for _name, _fn in {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}.items():
    register(OpDef(_name, "elementwise", ALL_LEVELS, 2, (), _binary_infer(_name),
                   (lambda fn: lambda xs, a: [fn(xs[0], xs[1])])(_fn), doc=f"element-wise {_name}"))


# ---------------------------------------------------------------------------------------------
# matmul

def _matmul_infer(types, a):
    x, w = types
    _require_float("matmul", types)
    dtype = _require_same_dtype("matmul", types)
    if x.rank < 2 or w.rank < 2:
        raise ShapeError(f"matmul needs operands of rank >= 2, got {x} and {w}",
                         hint="reshape a vector v of length n to [1, n] (or [n, 1]) first")
    if x.shape[-1] != w.shape[-2]:
        raise ShapeError(f"matmul: inner dimensions differ: {x} @ {w} ({x.shape[-1]} != {w.shape[-2]})",
                         hint="the last dim of the left operand must equal the second-to-last of the right; "
                              "transpose one operand (mdsl.transpose) if it is stored the other way round")
    batch = broadcast_shapes("matmul", x.shape[:-2], w.shape[:-2])
    return (TensorType(batch + (x.shape[-2], w.shape[-1]), dtype),)


register(OpDef("matmul", "matmul", KERNEL_AND_BLOCK, 2, (), _matmul_infer,
               lambda xs, a: [np.matmul(xs[0], xs[1])], doc="batched matrix product over the last two dims"))


# ---------------------------------------------------------------------------------------------
# reductions over one dim

def _reduce_infer(name):
    def infer(types, a):
        (x,) = types
        _require_float(name, types)
        d = norm_dim(name, a["dim"], x.rank)
        shape = list(x.shape)
        if a["keepdim"]:
            shape[d] = 1
        else:
            del shape[d]
        return (x.with_shape(shape),)
    return infer


for _name, _fn in {"sum": np.sum, "mean": np.mean, "max": np.max}.items():
    register(OpDef(_name, "reduction", KERNEL_AND_BLOCK, 1, (AttrSpec("dim", "int"), AttrSpec("keepdim", "bool", False)),
                   _reduce_infer(_name),
                   (lambda fn: lambda xs, a: [fn(xs[0], axis=a["dim"], keepdims=a["keepdim"])])(_fn),
                   doc=f"{_name} over one dimension"))


def _rms_norm_infer(types, a):
    _require_float("rms_norm", types)
    norm_dim("rms_norm", a["dim"], types[0].rank)
    return (types[0],)


def _rms_norm_ref(xs, a):
    x = xs[0]
    ms = np.mean(np.square(x), axis=a["dim"], keepdims=True)
    return [x / np.sqrt(ms + x.dtype.type(a["eps"]))]


register(OpDef("rms_norm", "norm", KERNEL_AND_BLOCK, 1, (AttrSpec("dim", "int", -1), AttrSpec("eps", "float", 1e-6, minimum=0.0)),
               _rms_norm_infer, _rms_norm_ref, doc="x / sqrt(mean(x^2 over dim) + eps)"))


# ---------------------------------------------------------------------------------------------
# layout operators

def _concat_infer(types, a):
    dtype = _require_same_dtype("concat", types)
    rank = types[0].rank
    if any(t.rank != rank for t in types):
        raise ShapeError(f"concat: operands have different ranks: {', '.join(map(str, types))}")
    d = norm_dim("concat", a["dim"], rank)
    for t in types[1:]:
        for i in range(rank):
            if i != d and t.shape[i] != types[0].shape[i]:
                raise ShapeError(f"concat along dim {a['dim']}: {types[0]} and {t} differ in dimension {i}")
    shape = list(types[0].shape)
    shape[d] = sum(t.shape[d] for t in types)
    return (TensorType(shape, dtype),)


register(OpDef("concat", "layout", KERNEL_AND_BLOCK, None, (AttrSpec("dim", "int"),), _concat_infer,
               lambda xs, a: [np.concatenate(xs, axis=a["dim"])], doc="join tensors along one dim"))


def _split_infer(types, a):
    (x,) = types
    d = norm_dim("split", a["dim"], x.rank)
    sizes = a["sizes"]
    if not sizes or any(s <= 0 for s in sizes) or sum(sizes) != x.shape[d]:
        raise ShapeError(f"split: sizes {list(sizes)} must be positive and add up to dimension {a['dim']} "
                         f"of {x} ({x.shape[d]})")
    outs = []
    for s in sizes:
        shape = list(x.shape)
        shape[d] = s
        outs.append(x.with_shape(shape))
    return tuple(outs)


def _split_ref(xs, a):
    cuts = np.cumsum(a["sizes"])[:-1]
    return [np.ascontiguousarray(p) for p in np.split(xs[0], cuts, axis=a["dim"])]


register(OpDef("split", "layout", frozenset({KERNEL}), 1, (AttrSpec("sizes", "ints"), AttrSpec("dim", "int")),
               _split_infer, _split_ref, doc="cut a tensor into consecutive pieces along one dim"))


def _reshape_infer(types, a):
    (x,) = types
    shape = a["shape"]
    if any(s <= 0 for s in shape) or math.prod(shape) != x.numel:
        raise ShapeError(f"reshape: cannot view {x} ({x.numel} elements) as [{', '.join(map(short_repr, shape))}]",
                         hint="the new shape's dims are positive and multiply to the same number of elements")
    return (x.with_shape(shape),)


# At the block level a reshape regroups a tile (the guided lifting places one where a tile holds whole groups:
# mdsl.search.guided); a kernel-level one is a view of its operand.
register(OpDef("reshape", "layout", KERNEL_AND_BLOCK, 1, (AttrSpec("shape", "ints"),), _reshape_infer,
               lambda xs, a: [np.reshape(xs[0], a["shape"])], doc="same elements in row-major order, new shape"))


def _transpose_infer(types, a):
    (x,) = types
    perm = a["perm"]
    if sorted(perm) != list(range(x.rank)):
        raise ShapeError(f"transpose: {list(perm)} is not a permutation of the {x.rank} dims of {x}")
    return (x.with_shape([x.shape[p] for p in perm]),)


# At the block level a transpose permutes a tile's dims (the guided lifting places one where a program reads a
# tensor transposed: a linear layer's weight stored [out, in], read in place by the kernel that multiplies by it).
register(OpDef("transpose", "layout", KERNEL_AND_BLOCK, 1, (AttrSpec("perm", "ints"),), _transpose_infer,
               lambda xs, a: [np.transpose(xs[0], a["perm"]).copy()], doc="permute dims"))


# ---------------------------------------------------------------------------------------------
# graph-defined operators: the body is interpreted, so there is no infer/reference of their own

def _typed_by_body(types, a):
    raise ValidationError("the output types of a graph-defined op come from its body",
                          hint="validate the node (mdsl.ir.validate.check_node) instead of calling infer_types")


register(OpDef("custom", "graph", frozenset({KERNEL}), None, (), _typed_by_body, body_level=BLOCK,
               doc="a custom kernel whose body is a block graph"))
register(OpDef("fused", "graph", frozenset({BLOCK}), None, (), _typed_by_body, body_level=THREAD,
               doc="an element-wise chain kept in registers; its body is a thread graph"))


# ---------------------------------------------------------------------------------------------
# accumulators: close a block graph's for-loop. The reference receives, for each of the R
# iterations, the list of the accumulator's inputs at that iteration, each with a leading block axis
# (mdsl.ir.evaluate runs the blocks side by side): the rules stack the iterations on a new axis 0 and
# reduce only it and axes counted from the end.

def _last_to_one(t: TensorType) -> TensorType:
    if t.rank == 0:
        raise ShapeError("accumulators that reduce the last dim need a tensor of rank >= 1")
    return t.with_shape(t.shape[:-1] + (1,))


def _acc_infer(reduce_last: bool, rescaled: bool):
    def infer(types, a):
        _require_float("accumulator", types)
        x = types[0]
        out = _last_to_one(x) if reduce_last else x
        if rescaled:
            scale = types[1]
            _require_same_dtype("rescaling accumulator", types)
            if scale.rank != out.rank or broadcast_shapes("rescaling accumulator", scale.shape, out.shape) != out.shape:
                raise ShapeError(f"rescaling accumulator: the scale {scale} must have the rank of {out} and broadcast to it",
                                 hint="keep the reduced dim of the row maximum: mdsl.max(s, dim=-1, keepdim=True)")
        return (out,)
    return infer


def _stack(iters, k=0):
    return np.stack([it[k] for it in iters])


def _acc_rms(iters, a):
    x = _stack(iters)
    count = x.shape[0] * x.shape[-1]
    ms = np.sum(np.square(x), axis=(0, x.ndim - 1)) / count
    return [np.sqrt(ms + x.dtype.type(a["eps"]))[..., None]]


def _rescale_weights(iters):
    m = _stack(iters, 1)
    return np.exp(m - np.max(m, axis=0))


_ACCUMULATORS = {
    "accum": (False, False, (), lambda it, a: [np.sum(_stack(it), axis=0)],
              "sum of the tile over the loop iterations"),
    "accum_sum": (True, False, (), lambda it, a: [np.sum(_stack(it), axis=(0, -1))[..., None]],
                  "sum over the iterations and the tile's last dim"),
    "accum_mean": (True, False, (), lambda it, a: [np.mean(_stack(it), axis=(0, -1))[..., None]],
                   "mean over the iterations and the tile's last dim"),
    "accum_rms": (True, False, (AttrSpec("eps", "float", 1e-6, minimum=0.0),), _acc_rms,
                  "sqrt(mean of squares over the iterations and the last dim + eps)"),
    "accum_max": (False, False, (), lambda it, a: [np.max(_stack(it), axis=0)],
                  "element-wise maximum over the iterations"),
    "accum_rescale": (False, True, (), lambda it, a: [np.sum(_rescale_weights(it) * _stack(it), axis=0)],
                      "online softmax: sum_i exp(m_i - max_j m_j) * x_i for inputs (x, m)"),
    "accum_sum_rescale": (True, True, (),
                          lambda it, a: [np.sum(_rescale_weights(it) * np.sum(_stack(it), axis=-1, keepdims=True), axis=0)],
                          "online softmax: sum_i exp(m_i - max_j m_j) * rowsum(x_i) for inputs (x, m)"),
}
for _name, (_red, _resc, _specs, _ref, _doc) in _ACCUMULATORS.items():
    register(OpDef(_name, "accumulator", frozenset({BLOCK}), 2 if _resc else 1, _specs,
                   _acc_infer(_red, _resc), _ref, doc=_doc))

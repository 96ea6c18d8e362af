"""The aten -> mdsl mapping: one typed entry per aten operator overload that mdsl computes.

An entry names the aten overload (as `torch.ops` spells it), the registry operators its lowering binds
(`mdsl.ir.ops.OPS`), the lowering itself (the operator applied to traced tensors through mdsl's operator
functions, so that mdsl's own shape and dtype rules check it) and, where the overload takes arguments mdsl
has no meaning for (a rounding mode, a tanh-approximated GELU, a step), a check that says why a given call
is left to torch. Whether a region is worth a kernel is read from the registry: an entry whose operators
are all of the layout category (or none: `clone`) computes nothing of its own.

tests/torch/test_torch_aten.py checks that every entry's aten overload exists and that every operator it
names is registered.
"""
from __future__ import annotations

import numbers
from typing import Callable, Optional

import attrs

import mdsl.frontend.functions as F
from mdsl.ir.ops import OPS


def _no_condition(args: tuple, kwargs: dict) -> Optional[str]:
    return None


@attrs.frozen
class AtenRule:
    """How one aten overload becomes mdsl operators.

    `aten`: the overload's name ("aten.mm.default"); `ops`: the registry operators `lower` binds;
    `lower(args, kwargs)`: the result(s) on traced tensors (the node's tensor arguments are traced
    tensors, the rest as the FX node holds them); `condition(args, kwargs)`: why this call is left to
    torch, or None (it sees the same arguments, with tensors as traced tensors or their example values)."""

    aten: str
    ops: tuple
    lower: Callable
    condition: Callable = _no_condition
    doc: str = ""

    @property
    def computes(self) -> bool:
        """Whether the entry does arithmetic (some operator outside the layout category)."""
        return any(OPS[op].category != "layout" for op in self.ops)


#: aten overload name -> its rule
ATEN_RULES: dict[str, AtenRule] = {}


def rule(aten: str, ops: tuple, condition: Callable = _no_condition, doc: str = ""):
    """Decorator: register the lowering of `aten` (binding the registry operators `ops`)."""
    def register(lower: Callable) -> Callable:
        if aten in ATEN_RULES:
            raise ValueError(f"{aten} has an mdsl mapping already")
        ATEN_RULES[aten] = AtenRule(aten, tuple(ops), lower, condition, doc or (lower.__doc__ or "").strip())
        return lower
    return register


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------
# matrix products

def _ranks_at_least_2(args, kwargs) -> Optional[str]:
    ranks = [len(a.shape) for a in args[:2] if hasattr(a, "shape")]
    return None if all(r >= 2 for r in ranks) else "a matrix-vector product (an operand of rank 1)"


@rule("aten.mm.default", ("matmul",))
def _mm(args, kwargs):
    """a @ b"""
    return F.matmul(args[0], args[1])


@rule("aten.bmm.default", ("matmul",))
def _bmm(args, kwargs):
    """a @ b, batched"""
    return F.matmul(args[0], args[1])


@rule("aten.matmul.default", ("matmul",), _ranks_at_least_2)
def _matmul(args, kwargs):
    """a @ b with broadcast batch dims"""
    return F.matmul(args[0], args[1])


def _addmm_factors(args, kwargs) -> Optional[str]:
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    return None if _is_number(beta) and _is_number(alpha) else "beta/alpha that are not numbers"


@rule("aten.addmm.default", ("matmul", "add", "mul_scalar"), _addmm_factors)
def _addmm(args, kwargs):
    """beta * bias + alpha * (a @ b)"""
    bias, a, b = args[:3]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    product = F.matmul(a, b)
    product = product if alpha == 1 else F.mul(product, alpha)
    return F.add(product, bias if beta == 1 else F.mul(bias, beta))


# ---------------------------------------------------------------------------------------------
# element-wise arithmetic: a tensor and a tensor or a Python number (mdsl's scalar forms)

def _scalar_alpha(args, kwargs) -> Optional[str]:
    return None if _is_number(kwargs.get("alpha", 1)) else "an alpha that is not a number"


def _operands_are_tensors_or_numbers(args, kwargs) -> Optional[str]:
    for a in args[:2]:
        if not (hasattr(a, "shape") or _is_number(a)):
            return f"an operand of type {type(a).__name__}"
    if not any(hasattr(a, "shape") for a in args[:2]):
        return "no tensor operand"
    return None


def _binary_condition(args, kwargs) -> Optional[str]:
    return _operands_are_tensors_or_numbers(args, kwargs) or _scalar_alpha(args, kwargs)


@rule("aten.add.Tensor", ("add", "add_scalar", "mul_scalar"), _binary_condition)
def _add(args, kwargs):
    """a + alpha * b"""
    a, b = args[:2]
    alpha = kwargs.get("alpha", 1)
    return F.add(a, b if alpha == 1 else F.mul(b, alpha))


@rule("aten.sub.Tensor", ("sub", "add_scalar", "mul_scalar", "neg"), _binary_condition)
def _sub(args, kwargs):
    """a - alpha * b"""
    a, b = args[:2]
    alpha = kwargs.get("alpha", 1)
    return F.sub(a, b if alpha == 1 else F.mul(b, alpha))


@rule("aten.rsub.Scalar", ("add_scalar", "neg", "mul_scalar"), _binary_condition)
def _rsub(args, kwargs):
    """b - alpha * a (a tensor, b a number)"""
    a, b = args[:2]
    alpha = kwargs.get("alpha", 1)
    return F.sub(b, a if alpha == 1 else F.mul(a, alpha))


@rule("aten.mul.Tensor", ("mul", "mul_scalar"), _operands_are_tensors_or_numbers)
def _mul(args, kwargs):
    """a * b"""
    return F.mul(args[0], args[1])


def _true_division(args, kwargs) -> Optional[str]:
    if kwargs.get("rounding_mode") is not None:
        return f"rounding_mode={kwargs['rounding_mode']!r} (mdsl divides exactly)"
    if _is_number(args[1]) and args[1] == 0:
        return "a division by the number 0"
    return _operands_are_tensors_or_numbers(args, kwargs)


@rule("aten.div.Tensor", ("div", "mul_scalar", "reciprocal"), _true_division)
def _div(args, kwargs):
    """a / b"""
    return F.div(args[0], args[1])


def _number_exponent(args, kwargs) -> Optional[str]:
    return None if _is_number(args[1]) else "a tensor exponent"


@rule("aten.pow.Tensor_Scalar", ("pow_scalar", "square", "sqrt", "rsqrt", "reciprocal"), _number_exponent)
def _pow(args, kwargs):
    """x ** number"""
    return F.power(args[0], args[1])


def _unary(aten: str, op: str) -> None:
    function = getattr(F, op)
    rule(aten, (op,), doc=f"mdsl.{op}(x)")(lambda args, kwargs: function(args[0]))


for _aten, _op in {"aten.neg.default": "neg", "aten.exp.default": "exp", "aten.rsqrt.default": "rsqrt",
                   "aten.sqrt.default": "sqrt", "aten.reciprocal.default": "reciprocal",
                   "aten.silu.default": "silu", "aten.relu.default": "relu",
                   "aten.sigmoid.default": "sigmoid"}.items():
    _unary(_aten, _op)


def _exact_gelu(args, kwargs) -> Optional[str]:
    approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    return None if approximate == "none" else f"approximate={approximate!r} (mdsl's gelu is the exact, erf one)"


@rule("aten.gelu.default", ("gelu",), _exact_gelu)
def _gelu(args, kwargs):
    """exact (erf) GELU"""
    return F.gelu(args[0])


# ---------------------------------------------------------------------------------------------
# reductions and softmax

def _dims(args, kwargs) -> list:
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    return [dims] if isinstance(dims, int) else list(dims or ())


def _keepdim(args, kwargs) -> bool:
    return bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))


def _reduction_condition(args, kwargs) -> Optional[str]:
    if kwargs.get("dtype") is not None:
        return f"an accumulation dtype ({kwargs['dtype']})"
    dims = _dims(args, kwargs)
    if not dims:
        return "a reduction over every dim (to a 0-dim tensor)"
    if not _keepdim(args, kwargs) and len(dims) >= len(args[0].shape):
        return "a reduction to a 0-dim tensor"
    return None


def _reduction(aten: str, op: str) -> None:
    function = getattr(F, op)
    rule(aten, (op,), _reduction_condition, doc=f"mdsl.{op} over the given dims")(
        lambda args, kwargs: function(args[0], tuple(_dims(args, kwargs)), keepdim=_keepdim(args, kwargs)))


_reduction("aten.mean.dim", "mean")
_reduction("aten.sum.dim_IntList", "sum")
_reduction("aten.amax.default", "max")


def _softmax_in_its_dtype(args, kwargs) -> Optional[str]:
    return "half_to_float=True (a float32 result of a half operand)" if args[2] else None


@rule("aten._softmax.default", ("max", "sub", "exp", "sum", "div"), _softmax_in_its_dtype)
def _softmax(args, kwargs):
    """softmax over one dim (max-subtracted)"""
    return F.softmax(args[0], args[1])


# ---------------------------------------------------------------------------------------------
# layout: views become mdsl's reshape/transpose/split/concat (values, not aliases)

def _static_sizes(args, kwargs) -> Optional[str]:
    sizes = args[1]
    return None if all(isinstance(s, int) for s in sizes) else "a size computed at run time (a symbolic shape)"


def _view(aten: str) -> None:
    rule(aten, ("reshape",), _static_sizes, doc="mdsl.reshape(x, sizes)")(
        lambda args, kwargs: F.reshape(args[0], list(args[1])))


for _aten in ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"):
    _view(_aten)


@rule("aten.unsqueeze.default", ("reshape",))
def _unsqueeze(args, kwargs):
    """a dim of size 1 inserted"""
    x, dim = args[0], args[1]
    shape = list(x.shape)
    shape.insert(dim % (len(shape) + 1), 1)
    return F.reshape(x, shape)


def _squeezable(args, kwargs) -> Optional[str]:
    x = args[0]
    dims = _dims(args, kwargs)
    kept = [d for i, d in enumerate(x.shape) if not (i in {k % len(x.shape) for k in dims} and d == 1)]
    return None if kept else "a squeeze to a 0-dim tensor"


@rule("aten.squeeze.dim", ("reshape",), _squeezable)
def _squeeze(args, kwargs):
    """a dim of size 1 dropped"""
    x = args[0]
    d = args[1] % len(x.shape)
    return x if x.shape[d] != 1 else F.reshape(x, [s for i, s in enumerate(x.shape) if i != d])


@rule("aten.transpose.int", ("transpose",))
def _transpose(args, kwargs):
    """two dims swapped"""
    return F.transpose(args[0], args[1], args[2])


@rule("aten.permute.default", ("transpose",))
def _permute(args, kwargs):
    """dims reordered"""
    return F.permute(args[0], list(args[1]))


def _matrix(args, kwargs) -> Optional[str]:
    return None if len(args[0].shape) == 2 else f"t() of a tensor of rank {len(args[0].shape)}"


@rule("aten.t.default", ("transpose",), _matrix)
def _t(args, kwargs):
    """a matrix transposed"""
    return F.transpose(args[0], 0, 1)


def _expandable(args, kwargs) -> Optional[str]:
    if any(not isinstance(s, int) for s in args[1]):
        return "a size computed at run time (a symbolic shape)"
    return None


@rule("aten.expand.default", ("reshape", "concat"), _expandable)
def _expand(args, kwargs):
    """dims of size 1 repeated (concatenated copies): mdsl has no broadcast view"""
    x, sizes = args[0], list(args[1])
    shape = [1] * (len(sizes) - len(x.shape)) + list(x.shape)
    if len(shape) != len(x.shape):
        x = F.reshape(x, shape)
    for d, (have, want) in enumerate(zip(shape, sizes)):
        if want != -1 and want != have:
            x = F.concat([x] * want, dim=d)
    return x


@rule("aten.cat.default", ("concat",))
def _cat(args, kwargs):
    """tensors joined along a dim"""
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    return tensors[0] if len(tensors) == 1 else F.concat(tensors, dim=dim)


@rule("aten.split.Tensor", ("split",))
def _split(args, kwargs):
    """pieces of one size along a dim"""
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    return F.split(args[0], args[1], dim)


@rule("aten.split_with_sizes.default", ("split",))
def _split_with_sizes(args, kwargs):
    """pieces of the given sizes along a dim"""
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    return F.split(args[0], list(args[1]), dim)


def _slice_bounds(args, kwargs) -> tuple:
    x = args[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % len(x.shape)
    n = x.shape[dim]
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    start, end, _ = slice(start, end).indices(n)
    return dim, start, max(start, end), n


def _unit_step(args, kwargs) -> Optional[str]:
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    if step != 1:
        return f"a slice with step {step}"
    _, start, end, _ = _slice_bounds(args, kwargs)
    return "an empty slice" if end <= start else None


def _range(x, dim: int, start: int, end: int):
    """x[start:end] along `dim`: the middle piece of a split (x itself where the range is all of it)."""
    n = x.shape[dim]
    if start == 0 and end == n:
        return x
    pieces = F.split(x, [s for s in (start, end - start, n - end) if s > 0], dim)
    return pieces[1 if start > 0 else 0]


@rule("aten.slice.Tensor", ("split",), _unit_step)
def _slice(args, kwargs):
    """a contiguous range of one dim"""
    dim, start, end, _ = _slice_bounds(args, kwargs)
    return _range(args[0], dim, start, end)


@rule("aten.select.int", ("split", "reshape"))
def _select(args, kwargs):
    """one index of a dim, the dim dropped"""
    x = args[0]
    dim = args[1] % len(x.shape)
    index = args[2] % x.shape[dim]
    return F.reshape(_range(x, dim, index, index + 1), [s for i, s in enumerate(x.shape) if i != dim])


def _kept(args, kwargs):
    """the same values (functional graphs never write into a copy)"""
    return args[0]


for _aten in ("aten.clone.default", "aten.alias.default", "aten.detach.default"):
    rule(_aten, (), doc="the same values (a functional graph never writes into a copy)")(_kept)


def _dtype_only(args, kwargs) -> Optional[str]:
    from mdsl.torch.dtypes import mdsl_dtype

    other = sorted(k for k, v in kwargs.items() if k not in ("dtype", "memory_format", "layout", "device")
                   and v not in (None, False))
    if other:
        return f"_to_copy with {', '.join(other)}"
    device = kwargs.get("device")
    if device is not None and hasattr(args[0], "device") and device != args[0].device:
        return f"a copy to another device ({device})"
    dtype = kwargs.get("dtype")
    if dtype is not None and mdsl_dtype(dtype) is None:
        return f"a cast to {dtype}"
    return None


@rule("aten._to_copy.default", ("cast",), _dtype_only)
def _to_copy(args, kwargs):
    """a cast to another float dtype"""
    from mdsl.torch.dtypes import mdsl_dtype

    dtype = kwargs.get("dtype")
    return args[0] if dtype is None else F.cast(args[0], mdsl_dtype(dtype))


def rule_of(target) -> Optional[AtenRule]:
    """The rule of an FX node's target (an aten OpOverload), or None."""
    return ATEN_RULES.get(aten_name(target))


def aten_name(target) -> str:
    """"aten.mm.default" for torch.ops.aten.mm.default; a readable name for any other target."""
    name = getattr(target, "name", None)
    if callable(name) and getattr(target, "namespace", None):
        # OpOverload.name() is "aten::mm" or "aten::add.Tensor"
        base, _, overload = name().partition(".")
        return f"{base.replace('::', '.')}.{overload or 'default'}"
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__name__', repr(target))}".lstrip(".")

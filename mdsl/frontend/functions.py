"""The `mdsl.*` operator functions and the Python operators of symbolic tensors.

Each function checks its operands and binds one registry operator (`bind`), or a short composition
(softmax). Python scalars become the scalar forms of the operators (`x * 2` is `mul_scalar`). Every public
function of this module but `bind` is an operator function, exported as `mdsl.<name>` (`PUBLIC_FUNCTIONS`).
"""
from __future__ import annotations

import inspect
import math
import numbers
from typing import Sequence, Union

import numpy as np

from mdsl.errors import MdslError, ShapeError, TraceError, UnsupportedError, short_repr
from mdsl.frontend.source import caller_loc
from mdsl.frontend.tracer import SymbolicTensor, as_symbolic, common_tracer
from mdsl.ir.dtypes import DType
from mdsl.ir.ops import norm_dim


def bind(op: str, tensors: Sequence, **attrs) -> list:
    """Record registry operator `op` on traced tensors with attributes `attrs`: its outputs."""
    tensors = [as_symbolic(t, f"operand {i} of {op}") for i, t in enumerate(tensors)]
    return common_tracer(tensors, op).bind(op, tensors, attrs)


def _one(op: str, tensors: Sequence, **attrs) -> SymbolicTensor:
    return bind(op, tensors, **attrs)[0]


def _is_scalar(value) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return False
    return isinstance(value, numbers.Real) or (isinstance(value, np.ndarray) and value.ndim == 0)


# ---------------------------------------------------------------------------------------------
# element-wise unary

def exp(x):
    """e**x, element-wise."""
    return _one("exp", [x])


def silu(x):
    """x * sigmoid(x)."""
    return _one("silu", [x])


def gelu(x):
    """Exact GELU: 0.5 x (1 + erf(x / sqrt 2))."""
    return _one("gelu", [x])


def relu(x):
    return _one("relu", [x])


def sigmoid(x):
    return _one("sigmoid", [x])


def sqrt(x):
    return _one("sqrt", [x])


def rsqrt(x):
    """1 / sqrt(x)."""
    return _one("rsqrt", [x])


def square(x):
    return _one("square", [x])


def neg(x):
    return _one("neg", [x])


def reciprocal(x):
    return _one("reciprocal", [x])


def clamp(x, min: float, max: float):
    """Limit x to [min, max]."""
    return _one("clamp", [x], min=min, max=max)


def cast(x, dtype: Union[DType, str]):
    """Convert to another dtype."""
    return _one("cast", [x], dtype=dtype)


# ---------------------------------------------------------------------------------------------
# element-wise binary, with Python scalars on either side

def _scalar(value, op: str) -> float:
    try:
        number = float(value)
    except OverflowError:
        raise TraceError(f"{op} with the scalar {short_repr(value)}, beyond the range of a float64 (about 1.8e308)",
                         loc=caller_loc(), hint="scalars become float constants of the kernel: use one a float "
                                                "can hold") from None
    if not math.isfinite(number):
        raise TraceError(f"{op} with the non-finite scalar {number}", loc=caller_loc(),
                         hint="scalars become float constants of the kernel: use a finite one")
    return number


def add(x, y):
    """x + y with numpy broadcasting; either side may be a Python scalar."""
    if _is_scalar(y):
        return _one("add_scalar", [x], value=_scalar(y, "add"))
    if _is_scalar(x):
        return _one("add_scalar", [y], value=_scalar(x, "add"))
    return _one("add", [x, y])


def sub(x, y):
    if _is_scalar(y):
        return _one("add_scalar", [x], value=-_scalar(y, "sub"))
    if _is_scalar(x):
        return _one("add_scalar", [neg(y)], value=_scalar(x, "sub"))
    return _one("sub", [x, y])


def mul(x, y):
    if _is_scalar(y):
        return _one("mul_scalar", [x], value=_scalar(y, "mul"))
    if _is_scalar(x):
        return _one("mul_scalar", [y], value=_scalar(x, "mul"))
    return _one("mul", [x, y])


def div(x, y):
    if _is_scalar(y):
        c = _scalar(y, "div")
        if c == 0:
            raise TraceError("division of a tensor by the scalar 0", loc=caller_loc())
        return _one("mul_scalar", [x], value=1.0 / c)
    if _is_scalar(x):
        c = _scalar(x, "div")
        r = reciprocal(y)
        return r if c == 1.0 else _one("mul_scalar", [r], value=c)
    return _one("div", [x, y])


_POWER_SHORTCUTS = {2.0: "square", 0.5: "sqrt", -0.5: "rsqrt", -1.0: "reciprocal"}


def power(x, exponent):
    """x ** exponent for a scalar exponent (common exponents map to square, sqrt, rsqrt, reciprocal)."""
    if not _is_scalar(exponent):
        raise UnsupportedError("a tensor exponent is not supported", loc=caller_loc(),
                               hint="use a Python number as the exponent, or mdsl.exp(y * log(x)) by hand")
    e = _scalar(exponent, "power")
    if e == 1.0:
        return as_symbolic(x, "the base of **")
    if e in _POWER_SHORTCUTS:
        return _one(_POWER_SHORTCUTS[e], [x])
    return _one("pow_scalar", [x], exponent=e)


def matmul(x, w):
    """Batched matrix product over the last two dims (batch dims broadcast)."""
    return _one("matmul", [x, w])


# ---------------------------------------------------------------------------------------------
# reductions and norms

def _reduce(op: str, x, dim, keepdim: bool):
    x = as_symbolic(x, f"the operand of {op}")
    if dim is None:
        raise ShapeError(f"{op} needs a dim", loc=caller_loc(), hint=f"write mdsl.{op}(x, dim=-1)")
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    try:
        dims = sorted({norm_dim(op, d, x.ndim) for d in dims}, reverse=True)
    except MdslError as e:
        raise e.with_loc(caller_loc())
    for d in dims:  # highest first, so the remaining dims keep their numbers
        x = _one(op, [x], dim=d, keepdim=keepdim)
    return x


def sum(x, dim=None, keepdim: bool = False):  # noqa: A001 - the mdsl.sum name is the point
    """Sum over `dim` (an int or a tuple of ints)."""
    return _reduce("sum", x, dim, keepdim)


def mean(x, dim=None, keepdim: bool = False):
    return _reduce("mean", x, dim, keepdim)


def max(x, dim=None, keepdim: bool = False):  # noqa: A001
    """Maximum over `dim`."""
    return _reduce("max", x, dim, keepdim)


def rms_norm(x, dim: int = -1, eps: float = 1e-6):
    """x / sqrt(mean(x**2 over dim) + eps); multiply by a weight afterwards if the model has one."""
    x = as_symbolic(x, "the operand of rms_norm")
    try:
        d = norm_dim("rms_norm", dim, x.ndim)
    except MdslError as e:
        raise e.with_loc(caller_loc())
    return _one("rms_norm", [x], dim=d, eps=eps)


def softmax(x, dim: int = -1):
    """exp(x - max) / sum(exp(x - max)) over `dim` (max-subtracted, as numerically safe kernels do)."""
    m = max(x, dim, keepdim=True)
    e = exp(sub(x, m))
    return div(e, sum(e, dim, keepdim=True))


# ---------------------------------------------------------------------------------------------
# layout

def concat(tensors: Sequence, dim: int = 0):
    tensors = [as_symbolic(t, f"concat operand {i}") for i, t in enumerate(tensors)]
    if not tensors:
        raise ShapeError("concat of no tensors", loc=caller_loc())
    try:
        d = norm_dim("concat", dim, tensors[0].ndim)
    except MdslError as e:
        raise e.with_loc(caller_loc())
    return _one("concat", tensors, dim=d)


def split(x, split_size_or_sizes, dim: int = 0) -> tuple:
    """torch semantics: an int gives pieces of that size (the last may be smaller); a list gives the sizes."""
    x = as_symbolic(x, "the operand of split")
    try:
        d = norm_dim("split", dim, x.ndim)
    except MdslError as e:
        raise e.with_loc(caller_loc())
    n = x.shape[d]
    if isinstance(split_size_or_sizes, numbers.Integral):
        step = int(split_size_or_sizes)
        if step <= 0:
            raise ShapeError(f"split size must be positive, got {step}", loc=caller_loc())
        sizes = [min(step, n - i) for i in range(0, n, step)]
    else:
        sizes = [int(s) for s in split_size_or_sizes]
    return bind("split", [x], sizes=sizes, dim=d)


def chunk(x, chunks: int, dim: int = 0) -> tuple:
    """torch semantics: `chunks` pieces of ceil(n / chunks) (fewer if that already covers n)."""
    x = as_symbolic(x, "the operand of chunk")
    if chunks <= 0:
        raise ShapeError(f"chunk count must be positive, got {chunks}", loc=caller_loc())
    try:
        n = x.shape[norm_dim("chunk", dim, x.ndim)]
    except MdslError as e:
        raise e.with_loc(caller_loc())
    return split(x, -(-n // chunks), dim)


def reshape(x, *shape):
    """New shape with the same elements in row-major order; one dim may be -1."""
    x = as_symbolic(x, "the operand of reshape")
    if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
        shape = tuple(shape[0])
    shape = [int(s) for s in shape]
    if shape.count(-1) > 1:
        raise ShapeError("reshape: at most one dim may be -1", loc=caller_loc())
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        total = int(np.prod(x.shape))
        if known <= 0 or total % known:
            raise ShapeError(f"reshape: cannot view {x.var.type} as {shape}", loc=caller_loc())
        shape[shape.index(-1)] = total // known
    return _one("reshape", [x], shape=shape)


def permute(x, perm: Sequence[int]):
    """Reorder the dims: output dim i is input dim perm[i]."""
    x = as_symbolic(x, "the operand of permute")
    return _one("transpose", [x], perm=[p % x.ndim if -x.ndim <= p < x.ndim else p for p in perm])


def transpose(x, dim0: int = -2, dim1: int = -1):
    """Swap two dims (by default the last two)."""
    x = as_symbolic(x, "the operand of transpose")
    try:
        a, b = norm_dim("transpose", dim0, x.ndim), norm_dim("transpose", dim1, x.ndim)
    except MdslError as e:
        raise e.with_loc(caller_loc())
    perm = list(range(x.ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return _one("transpose", [x], perm=perm)


# ---------------------------------------------------------------------------------------------
# Python operators of symbolic tensors

def _scalar_to_tensor_power(self, base):
    raise UnsupportedError("a scalar raised to a tensor power is not supported", loc=caller_loc(),
                           hint="for c ** x use mdsl.exp(x * math.log(c))")


# numpy functions and ufuncs applied to traced tensors: Python operators reach numpy's arithmetic
# ufuncs when the other operand is a numpy scalar or array (`np.float32(2) * x`), and run as the
# operators; any other numpy function needs values, so its error names the mdsl function to use.

_UFUNC_OPERATORS = {np.add: add, np.subtract: sub, np.multiply: mul, np.true_divide: div, np.matmul: matmul,
                    np.power: power, np.negative: neg, np.positive: lambda x: x}
_MDSL_EQUIVALENTS = {
    "exp": "exp", "sqrt": "sqrt", "square": "square", "negative": "neg", "reciprocal": "reciprocal",
    "clip": "clamp", "sum": "sum", "mean": "mean", "max": "max", "amax": "max", "concatenate": "concat",
    "concat": "concat", "split": "split", "array_split": "chunk", "reshape": "reshape", "transpose": "transpose",
    "permute_dims": "permute", "matmul": "matmul", "dot": "matmul", "maximum": "relu or mdsl.clamp",
    "astype": "cast",
}


def _numpy_error(name: str, tensor: SymbolicTensor) -> TraceError:
    same = _MDSL_EQUIVALENTS.get(name)
    hint = (f"use mdsl.{same} instead" if same else
            f"mdsl has no {name}; it traces: {', '.join(f'mdsl.{f}' for f in PUBLIC_FUNCTIONS)}")
    return TraceError(f"numpy.{name} cannot run on traced tensor %{tensor.var.name} {tensor.var.type}: a traced "
                      "tensor has no values, so mdsl's own functions must record the operation",
                      loc=caller_loc(), hint=hint)


def _array_ufunc(self, ufunc, method, *inputs, **kwargs):
    operator = _UFUNC_OPERATORS.get(ufunc)
    if operator is not None and method == "__call__" and not kwargs:
        return operator(*inputs)
    raise _numpy_error(ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}", self)


# numpy functions that read only the shape work as on arrays (code branches on shapes while tracing)
_SHAPE_FUNCTIONS = {np.shape: lambda t: t.shape, np.ndim: lambda t: t.ndim,
                    np.size: lambda t, axis=None: math.prod(t.shape) if axis is None else t.shape[axis]}


def _array_function(self, func, types, args, kwargs):
    shape_function = _SHAPE_FUNCTIONS.get(func)
    if shape_function is not None and args and args[0] is self:
        return shape_function(*args, **kwargs)
    raise _numpy_error(func.__name__, self)


#: the operator functions, in the order they are defined: every public function of this module but `bind`
PUBLIC_FUNCTIONS = tuple(name for name, value in list(globals().items())
                         if inspect.isfunction(value) and value.__module__ == __name__
                         and not name.startswith("_") and name != "bind")
__all__ = list(PUBLIC_FUNCTIONS)   # what `from mdsl.frontend.functions import *` gives: mdsl.<name>


def _install_operators() -> None:
    T = SymbolicTensor
    T.__array_ufunc__ = _array_ufunc
    T.__array_function__ = _array_function
    T.__add__ = add
    T.__radd__ = lambda self, other: add(other, self)
    T.__sub__ = sub
    T.__rsub__ = lambda self, other: sub(other, self)
    T.__mul__ = mul
    T.__rmul__ = lambda self, other: mul(other, self)
    T.__truediv__ = div
    T.__rtruediv__ = lambda self, other: div(other, self)
    T.__matmul__ = matmul
    T.__rmatmul__ = lambda self, other: matmul(other, self)
    T.__neg__ = neg
    T.__pos__ = lambda self: self
    T.__pow__ = power
    T.__rpow__ = _scalar_to_tensor_power
    T.T = property(lambda self: transpose(self))
    T.sum = sum
    T.mean = mean
    T.max = max
    T.reshape = reshape
    T.transpose = transpose
    T.permute = permute


_install_operators()

"""Tensor types and SSA values shared by every level of the mugraph."""
from __future__ import annotations

import math

import attrs

from mdsl.errors import ShapeError, short_repr
from mdsl.ir.dtypes import DType

#: Elements of one tensor: generated kernels index tensors with 32-bit integers.
MAX_ELEMENTS = 2**31 - 1
#: Dims of one tensor (numpy's limit: the reference interpreter, which verifies plans, is numpy).
MAX_RANK = 32


def _shape(value) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


@attrs.frozen(cache_hash=True)
class TensorType:
    shape: tuple[int, ...] = attrs.field(converter=_shape)
    dtype: DType

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def with_shape(self, shape) -> "TensorType":
        return TensorType(shape, self.dtype)

    def with_dtype(self, dtype: DType) -> "TensorType":
        return TensorType(self.shape, dtype)

    def __str__(self) -> str:
        return f"{self.dtype.name}[{', '.join(map(str, self.shape))}]"


@attrs.frozen(cache_hash=True)
class Var:
    """A named SSA value: a device tensor (kernel level), a shared-memory tile (block level) or a
    register fragment (thread level)."""

    name: str
    type: TensorType

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    def __str__(self) -> str:
        return f"%{self.name}"


def fresh_name(base: str, taken: set) -> str:
    """`base`, or `base_1`, `base_2`, ...: the first not in `taken`, which it joins."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def check_shape(shape, dtype: DType, what: str = "a tensor") -> None:
    """Raise ShapeError unless `shape` is a tensor shape mdsl can hold: at most MAX_RANK dims, each a
    positive int, at most MAX_ELEMENTS elements. The tracer, the validator and both parsers call this."""
    shape = tuple(shape)
    if len(shape) > MAX_RANK:
        raise ShapeError(f"{what} has {len(shape)} dims, more than mdsl's limit of {MAX_RANK}",
                         hint="merge dims with reshape")
    shown = f"{dtype.name}[{', '.join(map(short_repr, shape))}]"
    for i, d in enumerate(shape):
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
            raise ShapeError(f"{what} {shown}: dim {i} is {short_repr(d)}, not a positive integer",
                             hint="every dim of a tensor is at least 1")
    numel = math.prod(shape)
    if numel > MAX_ELEMENTS:
        raise ShapeError(f"{what} {shown} has {short_repr(numel)} elements, over mdsl's limit of 2^31 - 1 "
                         f"({MAX_ELEMENTS}) elements per tensor ({short_repr(numel * dtype.itemsize)} bytes)",
                         hint="generated kernels index tensors with 32-bit integers: split the work into "
                              "smaller tensors")


def check_tensor_type(t: TensorType, what: str = "a tensor") -> None:
    check_shape(t.shape, t.dtype, what)

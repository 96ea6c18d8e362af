"""Tensor types and SSA values shared by every level of the mugraph."""
from __future__ import annotations

import math

import attrs

from mdsl.ir.dtypes import DType


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

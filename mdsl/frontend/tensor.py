"""`Tensor[16, 4096, f16]`: the annotation that fixes a kernel parameter's shape and dtype."""
from __future__ import annotations

import attrs

from mdsl.errors import DTypeError, MdslError, ShapeError, short_repr
from mdsl.frontend.source import caller_loc
from mdsl.ir.dtypes import DType, dtype_from_name
from mdsl.ir.types import TensorType, check_shape


@attrs.frozen
class TensorSpec:
    """A static shape and dtype, as written in an annotation or read off an argument."""

    shape: tuple
    dtype: DType

    @property
    def type(self) -> TensorType:
        return TensorType(self.shape, self.dtype)

    def __repr__(self) -> str:
        return f"Tensor[{', '.join(map(str, self.shape))}, {self.dtype.name}]"


class Tensor:
    """Annotation for kernel parameters: `x: Tensor[16, 4096, f16]` (dims first, dtype last)."""

    def __init__(self, *args, **kwargs):
        raise TypeError("mdsl.Tensor is an annotation: write Tensor[16, 4096, f16]")

    def __class_getitem__(cls, item) -> TensorSpec:
        items = item if isinstance(item, tuple) else (item,)
        if not items:
            raise ShapeError("Tensor[()] names no dims and no dtype", loc=caller_loc(),
                             hint="write e.g. Tensor[16, 4096, mdsl.f16]")
        *dims, dtype = items
        if not isinstance(dtype, DType):
            if not isinstance(dtype, str):
                raise DTypeError(f"Tensor[...] must end with a dtype, got {dtype!r}", loc=caller_loc(),
                                 hint="write e.g. Tensor[16, 4096, mdsl.f16]")
            try:
                dtype = dtype_from_name(dtype)
            except DTypeError as e:
                raise e.with_loc(caller_loc())
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims):
            raise ShapeError(f"Tensor[...] dims must be positive integers, got [{', '.join(map(short_repr, dims))}]",
                             loc=caller_loc(), hint="write e.g. Tensor[16, 4096, mdsl.f16]")
        try:
            check_shape(dims, dtype, "Tensor[...]")
        except MdslError as e:
            raise e.with_loc(caller_loc())
        return TensorSpec(tuple(dims), dtype)

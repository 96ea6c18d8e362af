"""Element types of mugraph tensors: f16, bf16, f32 for data, i32 for indices."""
from __future__ import annotations

import attrs
import numpy as np

from mdsl.errors import DTypeError


@attrs.frozen
class DType:
    name: str          # the short name used in the textual IR: "f16"
    itemsize: int      # bytes per element in device memory
    is_float: bool
    numpy_name: str    # the numpy dtype that stores it on the host ("bfloat16" has none: stored as float32)
    long_name: str     # spelled out in messages: "float16"
    largest: float     # the largest finite value (a float result past it is an infinity where it is stored)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"mdsl.{self.name}"

    def __reduce__(self):
        # one object per dtype, also across processes (code compares dtypes with `is`)
        return dtype_from_name, (self.name,)


f16 = DType("f16", 2, True, "float16", "float16", 65504.0)
bf16 = DType("bf16", 2, True, "float32", "bfloat16", (2 - 2.0 ** -7) * 2.0 ** 127)
f32 = DType("f32", 4, True, "float32", "float32", float(np.finfo(np.float32).max))
i32 = DType("i32", 4, False, "int32", "int32", 2.0 ** 31 - 1)

DTYPES: dict[str, DType] = {d.name: d for d in (f16, bf16, f32, i32)}
_ALIASES = {"float16": f16, "half": f16, "bfloat16": bf16, "float32": f32, "float": f32, "int32": i32}


def dtype_from_name(name: str) -> DType:
    d = DTYPES.get(name) or _ALIASES.get(name)
    if d is None:
        raise DTypeError(f"unsupported dtype {name!r}",
                         hint="mdsl tensors are f16, bf16 or f32 (i32 for indices)")
    return d


def dtype_of_array(arr) -> DType:
    """The mdsl dtype of a host or device array (numpy, torch, anything with a .dtype)."""
    raw = str(getattr(arr, "dtype", type(arr).__name__))
    name = raw.replace("torch.", "").replace("numpy.", "")
    d = DTYPES.get(name) or _ALIASES.get(name)
    if d is None:
        raise DTypeError(f"unsupported dtype {raw}",
                         hint="pass f16, bf16 or f32 arrays (i32 for indices); cast float64 data with .astype(np.float32)")
    return d


_BF16_MAX = (2 - 2.0**-7) * 2.0**127


def round_to_dtype(x: np.ndarray, dtype: DType) -> np.ndarray:
    """Round float values to what `dtype` can hold (round-to-nearest-even), keeping x's numpy type."""
    if dtype is f32:
        return x.astype(np.float32).astype(x.dtype)
    if dtype is f16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(x.dtype)
    if dtype is bf16:
        # round-to-nearest-even to 8 significant bits directly from x (no double rounding via f32)
        mant, exp = np.frexp(x.astype(np.float64))
        exp = np.maximum(exp, -125)  # below 2**-126 bf16 is subnormal: a fixed ulp of 2**-133
        with np.errstate(over="ignore", invalid="ignore"):
            r = np.ldexp(np.round(np.ldexp(x.astype(np.float64), 8 - exp)), exp - 8)
            r = np.where(np.abs(r) > _BF16_MAX, np.copysign(np.inf, r), r)
        return np.asarray(r, dtype=x.dtype).reshape(np.shape(x))
    return x

"""torch dtypes and mdsl's: the float types both have (and i32, for indices)."""
from __future__ import annotations

from typing import Optional

import torch

from mdsl.ir.dtypes import DType, bf16, f16, f32, i32

_TORCH = {f16: torch.float16, bf16: torch.bfloat16, f32: torch.float32, i32: torch.int32}
_MDSL = {t: d for d, t in _TORCH.items()}


def mdsl_dtype(dtype: torch.dtype) -> Optional[DType]:
    """mdsl's dtype for a torch dtype, or None where mdsl has none (float64, int64, bool, ...)."""
    return _MDSL.get(dtype)


def torch_dtype(dtype: DType) -> torch.dtype:
    return _TORCH[dtype]


def host_results(results, graph) -> list:
    """A kernel's host results (numpy arrays, as `KernelFunction.__call__` returns them for host
    arguments: one array or a tuple) as CPU torch tensors of the dtypes of `graph`'s outputs."""
    arrays = results if isinstance(results, tuple) else (results,)
    return [torch.from_numpy(a.copy()).to(_TORCH[v.type.dtype]) for a, v in zip(arrays, graph.outputs)]

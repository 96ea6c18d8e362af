"""mdsl inside PyTorch programs (needs torch: `pip install "mdsl[torch]"`).

    import mdsl.torch                                  # the "mdsl" dynamo backend, and the names below

    fast = torch.compile(model, backend="mdsl")        # mdsl superoptimizes the regions it computes
    print(mdsl.torch.explain(model, x))                # which regions, their plans, what torch keeps
    op = mdsl.torch.custom_op(my_kernel)               # an @mdsl.kernel as torch.ops.mdsl.<name>

`import mdsl` never imports torch. This package imports torch, dynamo and Inductor only when they are used:
its names load their modules on first access, and torch finds the "mdsl" backend through the package's
`torch_dynamo_backends` entry point, loading `mdsl.torch.backend` when a model is compiled with it. Where
the installed metadata lacks that entry point (a checkout on PYTHONPATH, an install older than it), importing
this package registers the backend with dynamo itself, so that `backend="mdsl"` works either way.
"""
from __future__ import annotations

import importlib
import importlib.util
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from mdsl.errors import UnsupportedError

if importlib.util.find_spec("torch") is None:   # pragma: no cover - the test extra installs torch
    raise UnsupportedError("mdsl.torch needs PyTorch, which is not installed",
                           hint='pip install "mdsl[torch]" (torch 2.4 or newer)')

if TYPE_CHECKING:
    from mdsl.torch.aten import ATEN_RULES, AtenRule
    from mdsl.torch.backend import DEFAULT_SEARCH, compiler, mdsl_backend
    from mdsl.torch.custom_ops import CustomOp, custom_op
    from mdsl.torch.report import Report, explain

#: the package's names -> the module that defines each
_MODULES = {"ATEN_RULES": "aten", "AtenRule": "aten", "DEFAULT_SEARCH": "backend", "compiler": "backend",
            "mdsl_backend": "backend", "CustomOp": "custom_ops", "custom_op": "custom_ops", "Report": "report",
            "explain": "report"}

#: the entry point pyproject.toml declares: torch.compile's backend lookup loads it
BACKEND_ENTRY_POINT = "mdsl.torch.backend:mdsl_backend"


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'mdsl.torch' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"mdsl.torch.{_MODULES[name]}"), name)
    return value


def __dir__() -> list:
    return sorted([*globals(), *_MODULES])


def _backend_entry_point_installed() -> bool:
    """Whether the installed metadata names the "mdsl" backend in the `torch_dynamo_backends` group."""
    return any(ep.name == "mdsl" and ep.value == BACKEND_ENTRY_POINT
               for ep in entry_points(group="torch_dynamo_backends"))


if not _backend_entry_point_installed():
    from mdsl.torch.backend import register_backend

    register_backend()

__all__ = ["ATEN_RULES", "AtenRule", "CustomOp", "DEFAULT_SEARCH", "Report", "compiler", "custom_op", "explain",
           "mdsl_backend"]

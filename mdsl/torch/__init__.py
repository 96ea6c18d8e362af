"""mdsl inside PyTorch programs (needs torch: `pip install "mdsl[torch]"`).

    import mdsl.torch                                  # registers the "mdsl" dynamo backend

    fast = torch.compile(model, backend="mdsl")        # mdsl superoptimizes the regions it computes
    print(mdsl.torch.explain(model, x))                # which regions, their plans, what torch keeps
    op = mdsl.torch.custom_op(my_kernel)               # an @mdsl.kernel as torch.ops.mdsl.<name>

`import mdsl` never imports torch; importing this package does.
"""
from mdsl.errors import UnsupportedError

try:
    import torch
except ModuleNotFoundError as e:   # pragma: no cover - the test extra installs torch
    raise UnsupportedError(f"mdsl.torch needs PyTorch, which is not installed ({e})",
                           hint='pip install "mdsl[torch]" (torch 2.4 or newer)') from None

from mdsl.torch.aten import ATEN_RULES, AtenRule
from mdsl.torch.backend import DEFAULT_SEARCH, compiler, mdsl_backend
from mdsl.torch.custom_ops import CustomOp, custom_op
from mdsl.torch.explain import Report, explain

if "mdsl" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(mdsl_backend, name="mdsl")

__all__ = ["ATEN_RULES", "AtenRule", "CustomOp", "DEFAULT_SEARCH", "Report", "compiler", "custom_op", "explain",
           "mdsl_backend"]

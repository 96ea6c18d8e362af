"""The dynamo backend `torch.compile(model, backend="mdsl")`.

Dynamo hands the backend a graph of torch calls; AOTAutograd (`aot_autograd`) turns it into a functional
graph of aten operators with example values, which `mdsl.torch.regions.partition` cuts into mdsl regions.
Each region runs as an mdsl kernel (its optimized plan on CUDA tensors, the reference interpreter on CPU
tensors); every other node runs as torch's own eager operator. A backward pass, where inputs need
gradients, runs as torch's own operators too: mdsl computes forward passes only.
"""
from __future__ import annotations

from typing import Callable, Optional

from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from mdsl.search.config import SearchConfig
from mdsl.torch.regions import partition

#: The search a region's kernel runs on its first CUDA call (the plan cache answers later ones): short,
#: since a model has many regions; `compiler(search=...)` asks for a longer one.
DEFAULT_SEARCH = SearchConfig(budget_s=30.0, work=2_000)


def _eager(gm, example_inputs):
    return make_boxed_func(gm.forward)


def compiler(search: Optional[SearchConfig] = None, *, on_graph: Optional[Callable] = None) -> Callable:
    """A dynamo backend whose regions are searched with `search` (default `DEFAULT_SEARCH`);
    `on_graph(partitioned)` sees each aten graph's `mdsl.torch.regions.Partitioned` (what `explain` reads).
    `torch.compile(model, backend="mdsl")` is `compiler()`."""
    config = DEFAULT_SEARCH if search is None else search

    def forward(gm, example_inputs):
        partitioned = partition(gm, config)
        if on_graph is not None:
            on_graph(partitioned)
        return make_boxed_func(partitioned.module.forward)

    def backend(gm, example_inputs, **kwargs):
        return aot_autograd(fw_compiler=forward, bw_compiler=_eager)(gm, example_inputs, **kwargs)

    return backend


#: what `backend="mdsl"` names
mdsl_backend = compiler()

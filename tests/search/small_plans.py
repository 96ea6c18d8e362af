"""Small plans in a plan cache, for the tests of tuning variants (CPU and GPU): each is a real search
(the guided generator's two best candidates, verified by the default verifier) stored by `optimize`."""
from __future__ import annotations

import itertools

from mdsl.search.cache import PlanCache
from mdsl.search.config import SearchConfig
from mdsl.search.engine import cached_plan, optimize
from tests.examples_util import load_example

CONFIG = SearchConfig(budget_s=60.0, workers=1, top_k=3, exhaustive=False, min_blocks=1)

SMALL = {
    "gqa": lambda: load_example("gqa").make_gqa(1, kv_len=256, queries=16, head_dim=16).graph,
    "rms_norm_linear": lambda: load_example("rms_norm_linear").make_rms_norm_linear(1, k=256, n=192).graph,
    "gated_mlp": lambda: load_example("gated_mlp").make_gated_mlp(8, 256, 128).graph,
}


def two_guided(graph, config):
    """The guided generator's two cheapest candidates: enough for a plan with an alternative."""
    from mdsl.search.guided import generate  # (here: a reader of the stored plan needs no generator)

    return itertools.islice(generate(graph, config), 2)


def small_plan(name: str, root) -> tuple:
    """(plan as read back from the plan cache under `root`, that PlanCache)."""
    cache = PlanCache(root)
    graph = SMALL[name]()
    optimize(graph, CONFIG, cache=cache, generators=[two_guided])
    return cached_plan(graph, CONFIG, cache=cache, generators=[two_guided]), cache

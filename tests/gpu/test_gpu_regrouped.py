"""A product regrouped into heads, normalised per head and weighted (Qwen3's q/k norm), lifted under each
kind of choice (tests/search/regrouped_plans.py), on the GPU against the reference: the block-level reshape
of each backend on padded tiles, in the tile loop, after a loop and in a split's combine."""
from __future__ import annotations

import pytest

from tests.gpu.harness import check_graph
from tests.search.regrouped_plans import regrouped_candidates


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["groups-grid", "rows-and-groups-loop", "split-loop-combine"])
@pytest.mark.parametrize("shape", [(4, 256, 256, 64), (16, 512, 4096, 128)], ids=["small", "heads-of-128"])
def test_a_tile_regrouped_into_heads_on_the_gpu(name, shape):
    check_graph(regrouped_candidates(*shape)[name], f"regrouped:{name}:{shape}")

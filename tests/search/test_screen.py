"""The reduced-instance screen (mdsl/search/screen.py, mdsl/search/resize.py): a candidate and its
original shrunk together and compared in one finite-field test before the full-size verification. It
rejects what the full-size tests reject and nothing they accept."""
from __future__ import annotations

import itertools

import attrs
import pytest

from mdsl.ir.graph import KernelGraph, Node
from mdsl.ir.ops import get_op
from mdsl.passes.verify import verify
from mdsl.search import guided
from mdsl.search.config import SearchConfig
from mdsl.search.resize import elements, reduced
from mdsl.search.screen import screen
from tests.examples_util import load_example

SMALL = {
    "gqa": lambda: load_example("gqa").make_gqa(1, kv_len=256, queries=16, head_dim=16).graph,
    "rms_norm_linear": lambda: load_example("rms_norm_linear").make_rms_norm_linear(1, k=256, n=192).graph,
    "gated_mlp": lambda: load_example("gated_mlp").make_gated_mlp(8, 256, 128).graph,
    "lora": lambda: load_example("lora").lora.graph,
}


def _candidates(graph, n: int = 3) -> list:
    return list(itertools.islice(guided.generate(graph, SearchConfig(min_blocks=1)), n))


def _body_swapped(candidate: KernelGraph, old: str, new: str) -> KernelGraph:
    """The candidate with its first block operator `old` replaced by `new` (same operands and attributes)."""
    nodes = []
    done = False
    for node in candidate.nodes:
        if node.body is not None and not done:
            inner = []
            for m in node.body.nodes:
                if m.op == old and not done:
                    names = {spec.name for spec in get_op(new).attr_specs}
                    m = attrs.evolve(m, op=new, attrs=get_op(new).normalize_attrs({k: v for k, v in m.attrs
                                                                                      if k in names}))
                    done = True
                inner.append(m)
            node = attrs.evolve(node, body=attrs.evolve(node.body, nodes=inner))
        nodes.append(node)
    assert done, f"no {old} in the candidate"
    return attrs.evolve(candidate, nodes=nodes)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_a_candidate_shrinks_with_its_original_and_still_validates(name):
    graph = SMALL[name]()
    for candidate in _candidates(graph):
        pair = reduced([graph, candidate])
        assert pair is not None
        small_graph, small_candidate = pair
        assert elements(small_graph) < elements(graph) and elements(small_candidate) < elements(candidate)
        assert [n.op for n in small_candidate.nodes] == [n.op for n in candidate.nodes]
        assert [n.body.grid for n in small_candidate.nodes if n.body] == [n.body.grid for n in candidate.nodes if n.body]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_screen_agrees_with_the_full_size_verifier(name):
    graph = SMALL[name]()
    checked = wrong = 0
    for candidate in _candidates(graph, 2):
        mutants = [candidate]
        for old, new in (("accum", "accum_max"), ("silu", "gelu"), ("exp", "sigmoid"), ("rms_norm", "neg"),
                         ("div", "mul"), ("add", "sub")):
            if old != new and any(m.op == old for n in candidate.nodes if n.body for m in n.body.nodes):
                mutants.append(_body_swapped(candidate, old, new))
        for mutant in mutants:
            full = verify(graph, mutant, tests=2, seed=3).equivalent
            screened = screen(graph, mutant, seed=3) is None
            assert screened == full, (name, full)
            checked += 1
            wrong += not full
    assert checked >= 4 and wrong >= 2


def test_a_program_at_llm_sizes_is_screened_on_a_few_thousand_elements():
    graph = load_example("gated_mlp").make_gated_mlp(8, 4096, 4096).graph
    candidate = _candidates(graph, 1)[0]
    small = reduced([graph, candidate])
    assert sum(elements(g) for g in small) < 10**6 < elements(graph)
    assert screen(graph, candidate, seed=0) is None
    assert screen(graph, _body_swapped(candidate, "silu", "gelu"), seed=0).startswith("on a reduced instance")


def test_sizes_a_constant_may_encode_keep_their_size():
    graph = SMALL["gqa"]()
    scaled = KernelGraph(graph.name, graph.inputs,
                         [*graph.nodes[:1], Node("mul_scalar", graph.nodes[0].outputs,
                                                 [graph.nodes[0].outputs[0].__class__("scaled", graph.nodes[0].outputs[0].type)],
                                                 get_op("mul_scalar").normalize_attrs({"value": 0.25}))],
                         [graph.nodes[0].outputs[0].__class__("scaled", graph.nodes[0].outputs[0].type)])
    small, _ = reduced([scaled, scaled])
    assert small.inputs[0].shape[-1] == 16   # head dim 16: 1/sqrt(16) = 0.25 keeps it

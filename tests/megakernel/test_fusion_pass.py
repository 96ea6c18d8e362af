"""The megakernel's fusion pass (mdsl.megakernel.taskgraph.layer_fusion: model graph -> model graph) and the implied-wait
pass (task graph -> task graph): which ops fold where, what is left alone, and that the fused graph, cut into tasks and run by the
simulator under random interleavings, computes the reference forward of the unfused graph."""
import importlib.util
import random
import re
from pathlib import Path

import numpy as np
import pytest

import mdsl
from mdsl.errors import ShapeError
from mdsl.ir.dtypes import f32
from mdsl.ir.types import TensorType
from mdsl.megakernel.modelgraph.architectures import sampling_decode
from mdsl.megakernel.modelgraph.layers import get_layer_op
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.taskgraph.layer_fusion import fuse
from mdsl.megakernel.taskgraph.partition import build_task_graph, chunked_split_range, split_positions_bound
from mdsl.megakernel.taskgraph.simulator import Simulator
from mdsl.megakernel.taskgraph.tasks import PartitionConfig, TaskGraph, without_implied_waits
from tests.megakernel.test_model import Cfg
from tests.megakernel.tiny import tiny_model

PROMPT = [5, 17, 3]
LAYER = ["norm_linear", "rope_attention", "linear_residual", "norm_gate_up", "linear_residual"]


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_the_decoder_fuses_to_five_ops_a_layer(arch):
    config, graph, weights = tiny_model(arch, seed=7)
    fused = fuse(graph)
    assert [n.op for n in fused.nodes] == ["embedding", *LAYER * config.num_layers, "lm_head_argmax"]
    assert (fused.weights, fused.states, fused.outputs) == (graph.weights, graph.states, graph.outputs)
    attention = next(n for n in fused.nodes if n.op == "rope_attention")
    assert len(attention.inputs) == (5 if config.qk_norm else 3)
    assert attention.attr_dict["theta"] == config.rope.attrs()["theta"]
    residual = next(n for n in fused.nodes if n.op == "linear_residual")
    assert residual.inputs[1] == fused.nodes[0].output   # the o-proj adds the embedding row
    assert fuse(fused).key == fused.key                   # nothing left to fuse
    assert all(n.loc is not None and n.loc.file.endswith("architectures.py") for n in fused.nodes)
    want = ReferenceModel(graph, weights).generate(PROMPT, 6)
    got = ReferenceModel(fused, weights).generate(PROMPT, 6)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-6)


def test_sampling_fuses_into_the_lm_head():
    config, _, _ = tiny_model("qwen3")
    fused = fuse(sampling_decode("qwen3", temperature=0.7, top_p=0.8, seed=4).trace(config))
    last = fused.nodes[-1]
    assert last.op == "lm_head_sample" and last.attr_dict == {"eps": config.rms_norm_eps, "temperature": 0.7,
                                                               "top_p": 0.8, "seed": 4}
    assert last.outputs == fused.outputs


@mdsl.model
def shared_norm(m, cfg):
    table = m.weight("embed", [cfg.vocab, cfg.hidden])
    x = m.embedding(table)
    h = m.rms_norm(x, m.weight("norm", [cfg.hidden]), 1e-6)
    a = m.linear(h, m.weight("a", [cfg.hidden, cfg.hidden]))
    b = m.linear(h, m.weight("b", [cfg.hidden, cfg.hidden]))
    twice = m.linear(x, m.weight("c", [cfg.hidden, cfg.hidden]))   # read by two adds: stays a linear
    x = m.add(m.add(a, b), m.add(h, twice))                          # h is read by an add: the norm stays
    gate_up = m.linear(x, m.weight("gate", [12, cfg.hidden]), m.weight("up", [12, cfg.hidden]))
    x = m.add(x, m.linear(m.act_mul(gate_up), m.weight("down", [cfg.hidden, 12])))
    logits = m.linear(m.add(x, twice), table)                          # down's two adds: linear_add_residual
    return logits, m.argmax(logits)


def test_partial_patterns_fuse_only_where_nothing_else_reads_the_intermediate():
    graph = shared_norm.trace(Cfg())
    fused = fuse(graph)
    ops = [n.op for n in fused.nodes]
    assert ops == ["embedding", "rms_norm", "norm_linear", "norm_linear", "linear", "add", "add", "add",
                   "linear", "act_mul", "linear_add_residual", "linear", "argmax"]
    assert fused.nodes[2].inputs[:2] == graph.nodes[1].inputs   # the raw row and the norm weight
    rng = np.random.default_rng(1)
    weights = {w.name: rng.standard_normal(w.shape).astype(np.float32) for w in graph.weights}
    want = ReferenceModel(graph, weights).generate([3, 4], 3)
    got = ReferenceModel(fused, weights).generate([3, 4], 3)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    tg = build_task_graph(fused, PartitionConfig(num_sms=4, column_align=2))
    sim = Simulator(without_implied_waits(tg), weights).generate([3, 4], 3, workers=3, seed=2)
    np.testing.assert_allclose(sim.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_fused_ops_check_their_operands():
    row, w = TensorType((1, 8), f32), TensorType((8,), f32)
    with pytest.raises(ShapeError, match="gate and up weights must have one shape"):
        get_layer_op("norm_gate_up").infer_types((row, w, TensorType((6, 8), f32), TensorType((4, 8), f32)),
                                                 (("eps", 1e-6),))
    heads = get_layer_op("rope_attention").normalize_attrs({"q_heads": 2, "kv_heads": 1, "head_dim": 2, "theta": 1e4})
    cache = TensorType((4, 1, 2), f32)
    with pytest.raises(ShapeError, match="3 or 5 operands"):
        get_layer_op("rope_attention").infer_types((row, cache, cache, TensorType((2,), f32)), heads)


DEVICE_LIKE = PartitionConfig(num_sms=7, kv_splits=3, min_columns=8, attention_min_chunk=2)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("config", [PartitionConfig(num_sms=8, column_align=4), DEVICE_LIKE,
                                    PartitionConfig(num_sms=3, kv_splits=1, column_align=4)])
def test_the_fused_task_graph_computes_the_reference_forward(arch, config):
    _, graph, weights = tiny_model(arch, seed=7)
    want = ReferenceModel(graph, weights).generate(PROMPT, 6)
    full = build_task_graph(fuse(graph), config)
    rng = random.Random(config.num_sms)
    for task_graph in (full, without_implied_waits(full)):
        sim = Simulator(task_graph, weights)
        for dispatch in ("queue", "round_robin"):
            got = sim.generate(PROMPT, 6, workers=rng.randint(1, 9), seed=rng.randrange(1 << 30), dispatch=dispatch)
            assert got.tokens == want.tokens
            np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_fused_sampling_task_graph_matches_the_reference():
    config, _, weights = tiny_model("qwen3", seed=3)
    graph = sampling_decode("qwen3", temperature=0.8, top_p=0.9, seed=11).trace(config)
    want = ReferenceModel(graph, weights).generate(PROMPT, 8)
    task_graph = without_implied_waits(build_task_graph(fuse(graph), DEVICE_LIKE))
    got = Simulator(task_graph, weights).generate(PROMPT, 8, workers=4, seed=5)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def _same_step_ancestors(tg: TaskGraph) -> list:
    events = {e.id: e for e in tg.events}
    ancestors = []
    for t in tg.tasks:
        mine = set()
        for w in t.waits:
            if w.step_offset == 0:
                for p in events[w.event].producers:
                    mine |= {p} | ancestors[p]
        ancestors.append(mine)
    return ancestors


@pytest.mark.parametrize("fused", [False, True])
def test_implied_waits_are_dropped_and_nothing_else(fused):
    _, graph, _ = tiny_model("qwen3")
    before = build_task_graph(fuse(graph) if fused else graph, PartitionConfig(num_sms=6, column_align=4))
    after = without_implied_waits(before)
    assert len(after.tasks) == len(before.tasks) and len(after.events) < len(before.events)
    old_events = {e.id: e for e in before.events}
    new_events = {e.id: e for e in after.events}
    assert [e.id for e in after.events] == list(range(len(after.events)))
    assert all(e.consumers for e in after.events)
    # the same dependencies, transitively: every task has the same same-step ancestors
    assert _same_step_ancestors(after) == _same_step_ancestors(before)
    for old, new in zip(before.tasks, after.tasks):
        kept = {(new_events[w.event].producers, w.step_offset) for w in new.waits}
        assert kept <= {(old_events[w.event].producers, w.step_offset) for w in old.waits}
        for w in new.waits:
            assert old.id in new_events[w.event].consumers
    if fused:   # one hop per consumer: each task waits for one event (the residual row is implied)
        assert max(len(t.waits) for t in after.tasks) == 1
        o_proj = next(t for t in after.tasks if t.kind == "linear_residual")
        (wait,) = o_proj.waits
        assert {after.tasks[p].kind for p in new_events[wait.event].producers} == {"rope_attention.combine"}


@pytest.mark.parametrize("positions,splits,min_chunk", [(24, 3, 2), (24, 7, 1), (2048, 16, 64), (100, 16, 64),
                                                        (5, 4, 1)])
def test_chunked_splits_cover_each_position_once_within_their_declared_box(positions, splits, min_chunk):
    for position in range(positions):
        ranges = [chunked_split_range(position, s, splits, min_chunk) for s in range(splits)]
        covered = [p for lo, hi in ranges for p in range(lo, hi)]
        assert covered == list(range(position + 1))
        holder = [s for s, (lo, hi) in enumerate(ranges) if lo <= position < hi]
        assert len(holder) == 1 and all(lo == hi for lo, hi in ranges[holder[0] + 1:])   # the last non-empty
        for s, (lo, hi) in enumerate(ranges):
            box = split_positions_bound(positions, s, splits, min_chunk)
            assert lo == hi or box[0] <= lo < hi <= box[1]


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_the_task_graph_the_gpu_tables_are_lowered_from_computes_the_reference(arch, monkeypatch):
    from mdsl.megakernel.runtime import task_plan as plan_module
    from mdsl.megakernel.runtime.shape import decoder_shape

    monkeypatch.setattr(plan_module, "MIN_CHUNK", 2)   # several non-empty splits at these short contexts
    config, graph, weights = tiny_model(arch, seed=5)
    splits = plan_module.attention_splits(decoder_shape(config), 9, config.max_positions)
    task_graph = without_implied_waits(build_task_graph(fuse(graph), plan_module.device_partition(9, splits)))
    assert splits == 4 and {t.tile_value("min_chunk") for t in task_graph.tasks if t.kind.endswith(".partial")} == {2}
    want = ReferenceModel(graph, weights).generate(PROMPT, 12)
    got = Simulator(task_graph, weights).generate(PROMPT, 12, workers=6, seed=8)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_the_statistics_script_prints_the_fused_graph(capsys):
    path = Path(__file__).resolve().parents[2] / "scripts" / "megakernel_taskgraph_stats.py"
    spec = importlib.util.spec_from_file_location("megakernel_taskgraph_stats", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--models", "qwen3-0.6b", "--sms", "4", "--positions", "256", "--unfused"])
    out = capsys.readouterr().out
    fused = re.search(r"## qwen3-0.6b, fused: (\d+) tasks, (\d+) events", out)
    unfused = re.search(r"## qwen3-0.6b, unfused: (\d+) tasks, (\d+) events", out)
    assert fused and unfused and int(fused.group(1)) < int(unfused.group(1))
    # 28 layers x (4 q|k|v tiles, 4 x 2 attention splits, 16 combines, 4 + 4 + 4 linear tiles), the LM head
    assert "| norm_linear | 112 |" in out and "| rope_attention.partial | 224 |" in out and "| lm_head | 4 |" in out

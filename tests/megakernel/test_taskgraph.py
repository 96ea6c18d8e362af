"""The task graph: tiles that fill the SMs, events that wait for exactly the producer tiles a task
reads, thresholds that grow with the step, validation, and the textual/DOT forms and statistics."""
import json
from collections import Counter

import attrs
import pytest

from mdsl.errors import ValidationError
from mdsl.megakernel.taskgraph.partition import build_task_graph, column_tiles
from mdsl.megakernel.taskgraph.tasks import ACTIVATION, SCRATCH, Event, PartitionConfig, TaskGraph
from tests.megakernel.tiny import tiny_model

WIDE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2,
            head_dim=64, num_hidden_layers=1, max_position_embeddings=64)


@pytest.fixture(scope="module")
def wide_qwen():
    _, graph, _ = tiny_model("qwen3", **WIDE)
    return build_task_graph(graph)     # the default: 132 SMs


def test_wide_ops_fill_132_sms(wide_qwen):
    tasks_per_node = Counter(t.node for t in wide_qwen.tasks)
    for index, node in enumerate(wide_qwen.model.nodes):
        n = tasks_per_node[index]
        if node.op == "linear":
            assert n >= 132, (node.op, node.output, n)
            widths = {t.tile_value("col_stop") - t.tile_value("col_start") for t in wide_qwen.tasks if t.node == index}
            assert all(w % 16 == 0 for w in widths) or max(widths) < 16
        elif node.op == "rms_norm":
            assert n == 1          # per row; decode has one
        elif node.op == "attention":
            kinds = Counter(t.kind for t in wide_qwen.tasks if t.node == index)
            assert kinds == {"attention.partial": 2 * 66, "attention.combine": 2}


@pytest.mark.parametrize("n,sms,align", [(2048, 132, 16), (8192, 132, 16), (100, 132, 16), (24, 5, 4), (7, 3, 1)])
def test_column_tiles_cover_and_fill(n, sms, align):
    tiles = column_tiles(n, PartitionConfig(num_sms=sms, column_align=align))
    assert [c for a, b in tiles for c in range(a, b)] == list(range(n))
    assert len(tiles) >= min(n, sms)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
def test_events_wait_for_exactly_the_tiles_read(arch):
    _, graph, _ = tiny_model(arch)
    tg = build_task_graph(graph, PartitionConfig(num_sms=6, column_align=4, kv_splits=2))
    events = {e.id: e for e in tg.events}
    kinds = {b.name: b.kind for b in tg.buffers}
    for t in tg.tasks:
        same_step = {p for w in t.waits if w.step_offset == 0 for p in events[w.event].producers}
        needed = {o.id for o in tg.tasks[:t.id] for r in t.reads if kinds[r.buffer] in (ACTIVATION, SCRATCH)
                  for w in o.writes if w.intersects(r)}
        assert same_step == needed, t
        for w in t.waits:
            assert t.id in events[w.event].consumers
    # the one cross-step wait: the embedding on the previous step's token
    cross = [(t.kind, w) for t in tg.tasks for w in t.waits if w.step_offset != 0]
    assert {k for k, _ in cross} == {"embedding"}
    assert all(tg.tasks[p].kind == "argmax.reduce" for _, w in cross for p in events[w.event].producers)
    # events are shared: fewer events than waits (e.g. every linear tile waits on the one rms_norm)
    assert len(tg.events) < sum(len(t.waits) for t in tg.tasks)


def test_thresholds_grow_with_the_step():
    e = Event(0, (3, 4, 5), (9,))
    assert [e.threshold(s) for s in range(3)] == [3, 6, 9]
    assert [e.threshold(s, -1) for s in range(3)] == [0, 3, 6]


def test_validation_rejects_broken_graphs():
    _, graph, _ = tiny_model("llama3")
    tg = build_task_graph(graph, PartitionConfig(num_sms=4, column_align=4))
    # a task whose output nobody reads would not be finished before the next step overwrites it
    orphan = attrs.evolve(tg.tasks[1], id=len(tg.tasks), signals=(), waits=())
    with pytest.raises(ValidationError, match="not an ancestor of the token write"):
        TaskGraph(tg.model, tg.config, tg.buffers, (*tg.tasks, orphan), tg.events).validate()
    # an event whose producer never signals it
    silent = list(tg.tasks)
    silent[0] = attrs.evolve(silent[0], signals=())
    with pytest.raises(ValidationError, match="signalled by"):
        TaskGraph(tg.model, tg.config, tg.buffers, silent, tg.events).validate()
    # a write outside its buffer
    bad = list(tg.tasks)
    region = bad[1].writes[0]
    bad[1] = attrs.evolve(bad[1], writes=(attrs.evolve(region, box=((0, 1), (0, 999))),))
    with pytest.raises(ValidationError, match="outside its buffer"):
        TaskGraph(tg.model, tg.config, tg.buffers, bad, tg.events).validate()


def test_text_dot_and_stats(wide_qwen):
    s = wide_qwen.stats()
    assert s["tasks"] == len(wide_qwen.tasks) and s["events"] == len(wide_qwen.events)
    # every weight is read once per step (the tied table as the LM head; as the embedding only one
    # dynamic row), except the q/k norm weights, which every query/key head's task reads
    table = wide_qwen.buffer("model.embed_tokens.weight")
    weights_read = sum(wide_qwen.region_bytes(r) for t in wide_qwen.tasks for r in t.reads
                       if wide_qwen.buffer(r.buffer).kind == "weight" and not r.dynamic)
    heads, kv_heads, head_dim = WIDE["num_attention_heads"], WIDE["num_key_value_heads"], WIDE["head_dim"]
    assert weights_read == s["weight_bytes"] + (heads - 1 + kv_heads - 1) * head_dim * 4
    assert s["dynamic_bytes_read_at_most"] >= table.type.nbytes
    linear = next(p for p in s["per_task"] if p["kind"] == "linear")
    assert linear["bytes_read"] > linear["bytes_written"] > 0
    text = str(wide_qwen)
    assert text.startswith("taskgraph qwen3 {") and "task 0 embedding {col_start=0, col_stop=" in text
    assert "wait e" in text and "@-1" in text
    dot = wide_qwen.to_dot()
    assert dot.count(" -> ") == sum(len(wide_qwen.events[w.event].producers) for t in wide_qwen.tasks
                                    for w in t.waits)
    assert "style=dashed" in dot
    data = json.loads(json.dumps(wide_qwen.to_json()))
    assert len(data["tasks"]) == s["tasks"] and data["config"]["num_sms"] == 132
    first = data["tasks"][0]
    assert first["kind"] == "embedding" and first["waits"][0]["step_offset"] == -1
    assert first["reads"][0] == {"buffer": "tokens", "box": [[0, 64]], "dynamic": True}

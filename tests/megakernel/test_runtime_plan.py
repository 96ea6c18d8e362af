"""The megakernel's device task tables, lowered from the fused TaskGraph: tiles, events that wait only for
the producer tiles a task reads (less those already implied), the rules check_plan enforces, the tables
the device reads (pinned by digest), and the graphs the device cannot run."""
import hashlib

import attrs
import numpy as np
import pytest

import mdsl
from mdsl.errors import UnsupportedError
from mdsl.ir.dtypes import bf16, f16
from mdsl.megakernel.modelgraph.architectures import sampling_decode
from mdsl.megakernel.modelgraph.model_config import config_from_dict
from mdsl.megakernel.runtime import task_plan as plan_module
from mdsl.megakernel.runtime.models import MODELS
from mdsl.megakernel.runtime.shape import decoder_shape, rope_tables
from mdsl.megakernel.runtime.task_plan import (EMBEDDING, MIN_ROWS_PER_TILE, Event, Kind, PlanError, build_plan,
                                               check_plan, plan_model, tiles)
from tests.megakernel.tiny import tiny_model


def tiny_plan(arch="qwen3", workers=132, splits=None, **overrides):
    config, _, _ = tiny_model(arch, **overrides)
    return build_plan(decoder_shape(config), workers=workers, max_seq=config.max_positions, splits=splits)


@pytest.mark.parametrize("n,count", [(96, 132), (3072, 132), (128256, 132), (7, 4), (1000, 3)])
def test_tiles_cover_the_rows_once(n, count):
    ranges = tiles(n, count)
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert len(ranges) <= count
    assert all(hi - lo >= min(n, MIN_ROWS_PER_TILE) for lo, hi in ranges)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
@pytest.mark.parametrize("workers", [1, 7, 132])
def test_tiny_plans_follow_the_rules(arch, workers):
    plan = tiny_plan(arch, workers)
    check_plan(plan)
    kinds = [t.kind for t in plan.tasks]
    assert kinds[-1] is Kind.SAMPLE and kinds.count(Kind.SAMPLE) == 1
    # a layer's ops come in dependency order
    first = {k: kinds.index(k) for k in set(kinds)}
    assert first[Kind.QKV] < first[Kind.ATTN] < first[Kind.OPROJ] < first[Kind.GATEUP] < first[Kind.DOWN] \
        < first[Kind.LMHEAD] < first[Kind.SAMPLE]


@pytest.mark.parametrize("workers", [1, 7, 132])
def test_a_mixture_of_experts_plan_follows_the_rules(workers):
    """Qwen3-MoE: the router's tiles, then the experts' gate/up tiles (waiting for every router tile: the last
    one routes), then the down tiles (waiting for every gate/up tile: each sums every slot)."""
    plan = tiny_plan("qwen3_moe", workers, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32)
    check_plan(plan)
    kinds = [t.kind for t in plan.tasks]
    assert kinds.index(Kind.OPROJ) < kinds.index(Kind.ROUTER) < kinds.index(Kind.EXPERT_UP) \
        < kinds.index(Kind.EXPERT_DOWN) < kinds.index(Kind.QKV, kinds.index(Kind.EXPERT_DOWN))
    assert Kind.GATEUP not in kinds and Kind.DOWN not in kinds
    layer0 = [k for k, t in enumerate(plan.tasks) if t.layer == 0]
    router = [k for k in layer0 if kinds[k] is Kind.ROUTER]
    up = [k for k in layer0 if kinds[k] is Kind.EXPERT_UP]
    for k in layer0:
        producers = {p for e in plan.waits[k] for p in plan.events[e].producers}
        if kinds[k] is Kind.EXPERT_UP:
            assert producers == set(router)
        elif kinds[k] is Kind.EXPERT_DOWN:
            assert producers == set(up)
    # the up tiles: about one per worker over the slots, every slot's rows covered once
    assert len(up) == 4 * min(max(1, workers // 4), 32 // MIN_ROWS_PER_TILE)
    assert sorted((plan.tasks[k].begin, plan.tasks[k].end) for k in up)[-1][1] == 4 * 32


def test_consumers_wait_only_for_the_tiles_they_read():
    plan = tiny_plan("qwen3", 132, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=32)
    s = plan.shape
    qkv_tiles = [k for k, t in enumerate(plan.tasks) if t.kind is Kind.QKV and t.layer == 0]
    for k, task in enumerate(plan.tasks):
        if task.kind is Kind.ATTN and task.layer == 0:
            (event,) = plan.waits[k]
            producers = plan.events[event].producers
            rows = set()
            for p in producers:
                rows.update(range(plan.tasks[p].begin, plan.tasks[p].end))
            g = task.begin
            needed = set(range(g * s.group * s.head_dim, (g + 1) * s.group * s.head_dim))
            for base in (s.attention_width, s.attention_width + s.kv_heads * s.head_dim):   # k, v
                needed |= set(range(base + g * s.head_dim, base + (g + 1) * s.head_dim))
            assert needed <= rows
            assert len(producers) < len(qkv_tiles), "an attention task waits for every qkv tile"
            # and no producer it waits for is one it does not read
            for p in producers:
                assert needed & set(range(plan.tasks[p].begin, plan.tasks[p].end)), (k, p)


def test_the_residual_read_is_implied_not_waited_for():
    plan = tiny_plan("llama3")
    for k, task in enumerate(plan.tasks):
        if task.kind in (Kind.OPROJ, Kind.DOWN):
            producer_kinds = {plan.tasks[p].kind for e in plan.waits[k] for p in plan.events[e].producers}
            assert producer_kinds == {Kind.ATTN if task.kind is Kind.OPROJ else Kind.GATEUP}


def test_the_embedding_is_the_only_cross_step_event():
    plan = tiny_plan("llama3")
    embedding = [e for e, ev in enumerate(plan.events) if not ev.producers]
    assert embedding == [0] and plan.events[0].initial == 1
    waiters = [plan.tasks[k] for k, w in enumerate(plan.waits) if 0 in w]
    assert {t.kind for t in waiters} == {Kind.QKV} and {t.layer for t in waiters} == {0}
    assert plan.signals[-1] == (0,)
    assert all(any(r.buffer == EMBEDDING for r in t.reads) for t in waiters)


def test_tables_encode_the_plan():
    plan = tiny_plan("qwen3", 16)
    tasks, waits, signals = plan.tables()
    assert tasks.dtype == np.int32 and tasks.shape == (len(plan.tasks), 8)
    for k, (kind, layer, begin, end, wb, wc, sb, sc) in enumerate(tasks):
        t = plan.tasks[k]
        assert (kind, layer, begin, end) == (int(t.kind), t.layer, t.begin, t.end)
        assert [tuple(w) for w in waits[wb:wb + wc]] == [(e, plan.events[e].per_step) for e in plan.waits[k]]
        assert list(signals[sb:sb + sc]) == list(plan.signals[k])
    assert list(plan.initial_events()) == [e.initial for e in plan.events]


def _broken(plan, **changes):
    return attrs.evolve(plan, **changes)


def test_check_plan_finds_a_missing_wait():
    plan = tiny_plan("llama3")
    k = next(k for k, t in enumerate(plan.tasks) if t.kind is Kind.OPROJ)
    waits = list(plan.waits)
    waits[k] = ()
    with pytest.raises(PlanError, match="without waiting"):
        check_plan(_broken(plan, waits=tuple(waits)))


def test_check_plan_finds_a_forward_wait_and_a_miscounted_event():
    plan = tiny_plan("llama3")
    events = list(plan.events)
    last = len(events) - 1
    events[last] = Event(events[last].producers[:-1])
    with pytest.raises(PlanError, match="signalled by"):
        check_plan(_broken(plan, events=tuple(events)))
    waits = list(plan.waits)
    waits[0] = (last,)   # the first task waits for the LM head tiles
    with pytest.raises(PlanError, match="later task"):
        check_plan(_broken(plan, waits=tuple(waits)))


def test_check_plan_finds_a_task_that_does_not_lead_to_the_sampler():
    plan = tiny_plan("llama3")
    k = next(k for k, t in enumerate(plan.tasks) if t.kind is Kind.LMHEAD)
    events = [Event(tuple(p for p in e.producers if p != k), e.initial) if e.producers else e for e in plan.events]
    signals = [s if i != k else () for i, s in enumerate(plan.signals)]
    with pytest.raises(PlanError, match="do not lead to the sampler|without waiting"):
        check_plan(_broken(plan, events=tuple(events), signals=tuple(signals)))


# sha256 (first 16 digits) of tables() and initial_events(): the rows, events, waits and signals the device
# reads, pinned (a change to the lowering that changes them shows here); a rank of two's tables under
# ("rank", model)
TABLES = {
    "llama-3.2-1b": "988670fdc243963c", "qwen3-0.6b": "01b1f4e3ca27069c", "qwen3-8b": "41fca2929bbd0f3d",
    ("rank", "llama-3.2-1b"): "25e8f9b96dd8302f", ("rank", "qwen3-0.6b"): "9a5eff4181a07ea3",
    ("rank", "qwen3-8b"): "6c18da04ffaef0f5",
    ("tiny", 1): "9d351e0f7e98edd2", ("tiny", 7): "3cdce1785451fe80", ("tiny", 17): "3d9f3b20f7814461",
    ("tiny", 132): "0eba7e3bb683fbd5",
}


def tables_digest(plan) -> str:
    h = hashlib.sha256()
    for table in (*plan.tables(), plan.initial_events()):
        h.update(table.tobytes())
        h.update(str(table.shape).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
@pytest.mark.parametrize("workers", [1, 7, 17, 132])
def test_tiny_tables_are_pinned(arch, workers):
    # (as many splits as fill the workers, past MAX_SPLITS: at most the 24 positions)
    config, _, _ = tiny_model(arch)
    splits = max(1, min(workers // config.num_kv_heads, config.max_positions))
    assert tables_digest(tiny_plan(arch, workers, splits=splits)) == TABLES[("tiny", workers)]


@pytest.mark.parametrize(("kv_heads", "workers", "splits", "min_chunk"), [
    (8, 132, 16, 64), (4, 132, 32, 32), (2, 132, 32, 32), (8, 64, 8, 64), (8, 7, 1, 64), (2, 17, 8, 64),
    (1, 132, 32, 32), (4, 68, 17, 32)])
def test_attention_splits_fill_the_workers_up_to_two_combine_groups(kv_heads, workers, splits, min_chunk):
    shape = decoder_shape(attrs.evolve(config_from_dict(MODELS["qwen3-8b"]), num_kv_heads=kv_heads))
    assert plan_module.attention_splits(shape, workers, 4096) == splits
    assert plan_module.attention_splits(shape, workers, 3) == min(splits, 3)
    plan = build_plan(decoder_shape(tiny_model("qwen3")[0]), workers=8, max_seq=64, splits=splits)
    assert plan.min_chunk == plan_module.default_min_chunk(splits) == min_chunk


@pytest.mark.parametrize("name", sorted(MODELS))
def test_full_size_plans_follow_the_rules(name):
    shape = decoder_shape(config_from_dict(MODELS[name]))
    plan = build_plan(shape, workers=132, max_seq=2048)
    check_plan(plan)
    assert tables_digest(plan) == TABLES[name]
    stats = plan.statistics()
    assert stats["tasks_by_kind"]["QKV"] == shape.layers * 132
    assert stats["events"] < 30 * shape.layers, "events are per consumer group, not per task"
    assert max(map(len, plan.waits)) <= max(2, shape.kv_heads)   # (an o-proj tile: each kv head's merge)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_ranks_tables_are_pinned(name):
    from mdsl.megakernel.parallel.gpu_group import shard_config
    from mdsl.megakernel.runtime.task_plan import for_ranks

    shape = decoder_shape(shard_config(config_from_dict(MODELS[name]), 2))
    plan = for_ranks(build_plan(shape, workers=132, max_seq=2048), 2)
    check_plan(plan)
    assert tables_digest(plan) == TABLES[("rank", name)]


def test_unsupported_models_are_refused_with_the_reason():
    config, _, _ = tiny_model("llama3")
    with pytest.raises(UnsupportedError, match="float16"):
        decoder_shape(attrs.evolve(config, dtype=f16))
    with pytest.raises(UnsupportedError, match="multiple of 8"):
        decoder_shape(attrs.evolve(config, dtype=bf16, hidden_size=36))


def test_rope_tables_match_the_reference_rotation():
    from mdsl.megakernel.modelgraph.layers import rope_cos_sin

    config, _, _ = tiny_model("llama3")
    shape = decoder_shape(config)
    cos, sin = rope_tables(shape, 20)
    for position in (0, 3, 19):
        want_cos, want_sin = rope_cos_sin({"head_dim": shape.head_dim, **config.rope.attrs()}, position)
        half = shape.head_dim // 2
        np.testing.assert_allclose(cos[position], want_cos[:half], rtol=0, atol=2e-7)
        np.testing.assert_allclose(sin[position], want_sin[:half], rtol=0, atol=2e-7)


def test_a_sampling_graph_lowers_to_the_same_tables():
    config, graph, _ = tiny_model("qwen3")
    shape = decoder_shape(config)
    sampling = sampling_decode("qwen3", temperature=0.5, seed=2).trace(config)
    plans = [plan_model(g, shape, workers=7, max_seq=config.max_positions) for g in (graph, sampling)]
    assert tables_digest(plans[0]) == tables_digest(plans[1]) == TABLES[("tiny", 7)]


class Cfg:
    max_positions = 24


def _tiny_decoder_with(change):
    """The tiny Llama-3 step function with one line changed by `change(m, x, h)` -> (x, logits)."""
    config, _, _ = tiny_model("llama3", num_hidden_layers=1)

    @mdsl.model
    def changed(m, cfg):
        from mdsl.megakernel.modelgraph.architectures import _decoder

        logits = _decoder(m, config)
        return change(m, logits)

    return config, changed.trace(Cfg())


@mdsl.model
def doubled_embedding(m, cfg):
    table = m.weight("model.embed_tokens.weight", [96, 32])
    x = m.embedding(table)
    x = m.add(x, x)
    logits = m.linear(m.rms_norm(x, m.weight("model.norm.weight", [32]), 1e-5), table)
    return logits, m.argmax(logits)


def test_an_op_without_a_device_lowering_is_refused_with_its_line():
    config, _, _ = tiny_model("qwen3")
    with pytest.raises(UnsupportedError, match=r"cannot run add %t\d+: it has no device lowering") as e:
        plan_model(doubled_embedding.trace(Cfg()), decoder_shape(config), workers=4, max_seq=24)
    assert e.value.loc is not None and e.value.loc.file.endswith("test_runtime_plan.py")
    assert "x = m.add(x, x)" in str(e.value)


def _with_weight(graph, suffix: str, **changes):
    """The graph with its weight whose name ends with `suffix` changed (a new name, type)."""
    def change(v):
        return attrs.evolve(v, **changes) if v.name.endswith(suffix) else v

    return attrs.evolve(graph, weights=tuple(map(change, graph.weights)), nodes=tuple(
        attrs.evolve(n, inputs=tuple(map(change, n.inputs))) for n in graph.nodes))


def test_a_graph_that_differs_from_the_decoder_is_refused_naming_the_difference():
    config, graph = _tiny_decoder_with(lambda m, logits: (logits, m.argmax(logits)))
    shape = decoder_shape(config)
    plan_model(graph, shape, workers=4, max_seq=24)   # the decoder itself lowers
    with pytest.raises(UnsupportedError, match="the model's 0.5"):
        plan_model(graph, decoder_shape(attrs.evolve(config, rms_norm_eps=0.5)), workers=4, max_seq=24)
    o_proj = next(w for w in graph.weights if w.name.endswith("o_proj.weight"))
    wrong = _with_weight(graph, "o_proj.weight", type=attrs.evolve(o_proj.type, dtype=bf16))
    with pytest.raises(UnsupportedError, match=r"linear_residual .*o_proj\.weight: bf16.* where the device reads "
                                               r"o_proj of layer 0: 32 rows of f32"):
        plan_model(wrong, shape, workers=4, max_seq=24)


def test_weights_are_bound_by_the_part_they_play_not_by_name():
    """A weight of any name fills the device slot of the op that reads it: the engine uploads it by that name."""
    config, graph = _tiny_decoder_with(lambda m, logits: (logits, m.argmax(logits)))
    shape = decoder_shape(config)
    renamed = _with_weight(graph, "o_proj.weight", name="my.o_proj")
    plan = plan_model(renamed, shape, workers=4, max_seq=24)
    check_plan(plan)
    assert plan.weight("o_proj", 0).name == "my.o_proj" and plan.weight("o_proj", 0).row == 0
    assert plan.weight("lm_head").name == "lm_head.weight" and plan.weight("q_norm", 0) is None
    assert plan.tables()[0].tolist() == plan_model(graph, shape, workers=4, max_seq=24).tables()[0].tolist()

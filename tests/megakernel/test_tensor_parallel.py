"""Tensor parallelism on the CPU: the N-rank plan, its numpy reference over ranks and the N-rank
simulator (random interleavings, random worker counts, a simulated put-with-signal transport) give
the single-rank model's logits and tokens; per-tile events; bad world sizes; sharded loading."""
import os
import random

import attrs
import numpy as np
import pytest

from mdsl.errors import ParseError, ShapeError, ValidationError
from mdsl.megakernel.modelgraph.architectures import sampling_decode, step_function
from mdsl.megakernel.modelgraph.checkpoint import load_weights, read_weights, save_checkpoint
from mdsl.megakernel.modelgraph.model_config import load_config
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.modelgraph.safetensors import SafetensorsFile, open_checkpoint, write_safetensors
from mdsl.megakernel.parallel.tensor_parallel import (Split, TensorParallelReference, TensorParallelTaskGraph,
                                                      _check_puts, build_tensor_parallel_task_graph, load_rank_weights,
                                                      tensor_parallel)
from mdsl.megakernel.parallel.tp_simulator import TensorParallelSimulator, _Message, _Rank
from mdsl.megakernel.taskgraph.partition import build_task_graph
from mdsl.megakernel.taskgraph.simulator import SimulationError, Simulator
from mdsl.megakernel.taskgraph.tasks import PartitionConfig
from tests.megakernel.tiny import tiny_config_dict, tiny_model

PROMPT = [5, 17, 3]
NEW_TOKENS = 5
HEADS = {"num_attention_heads": 8, "num_key_value_heads": 4}   # splits over 1, 2 and 4 ranks
PARTITION = PartitionConfig(num_sms=6, column_align=4, kv_splits=2)


def _tp(arch, world_size, seed=1, **overrides):
    config, graph, weights = tiny_model(arch, seed=seed, **{**HEADS, **overrides})
    plan = tensor_parallel(graph, world_size)
    return graph, weights, plan, [plan.shard_weights(weights, r) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize(("arch", "act"), [("llama3", "silu"), ("qwen2", "silu"), ("qwen3", "silu"),
                                         ("llama3", "gelu")])
def test_n_rank_simulation_equals_the_single_rank_model(arch, act, world_size):
    # (seed 1 of the tiny Qwen2 repeats one token: a weak comparison)
    graph, weights, plan, rank_weights = _tp(arch, world_size, seed=4 if arch == "qwen2" else 1, hidden_act=act)
    assert {n.attr_dict["act"] for n in graph.nodes if n.op == "act_mul"} == {act}
    reference = ReferenceModel(graph, weights).generate(PROMPT, NEW_TOKENS)
    single = Simulator(build_task_graph(graph, PARTITION), weights).generate(PROMPT, NEW_TOKENS, workers=3, seed=1)
    over_ranks = TensorParallelReference(plan, rank_weights).generate(PROMPT, NEW_TOKENS)
    sim = TensorParallelSimulator(build_tensor_parallel_task_graph(plan, PARTITION), rank_weights)
    rng = random.Random(world_size)
    for dispatch in ("queue", "round_robin"):
        got = sim.generate(PROMPT, NEW_TOKENS, seed=rng.randrange(1 << 30), dispatch=dispatch,
                           workers=[rng.randint(1, 5) for _ in range(world_size)])
        assert got.tokens == reference.tokens == single.tokens == over_ranks.tokens
        assert got.logits.shape == reference.logits.shape == (len(PROMPT) - 1 + NEW_TOKENS, graph.logits.shape[1])
        for expected in (reference.logits, single.logits, over_ranks.logits):
            np.testing.assert_allclose(got.logits, expected, rtol=1e-5, atol=1e-5)
    assert (sim.puts_delivered > 0 and sim.bytes_sent > 0) == (world_size > 1)   # a group of one sends nothing
    assert len(set(reference.tokens)) > 1    # the tokens fed back change from step to step


def test_sampling_gathers_the_logits_and_samples_alike_on_every_rank():
    config, _, _ = tiny_model("qwen3", **HEADS)
    graph = sampling_decode("qwen3", temperature=0.8, top_p=0.9, seed=11).trace(config)
    _, _, weights = tiny_model("qwen3", seed=3, **HEADS)
    plan = tensor_parallel(graph, 2)
    assert [n.op for n in plan.graph.nodes][-2:] == ["all_gather", "sample"]
    rank_weights = [plan.shard_weights(weights, r) for r in range(2)]
    expected = ReferenceModel(graph, weights).generate(PROMPT, 8)
    got = TensorParallelSimulator(build_tensor_parallel_task_graph(plan, PARTITION), rank_weights).generate(
        PROMPT, 8, seed=5)
    assert got.tokens == expected.tokens
    np.testing.assert_allclose(got.logits, expected.logits, rtol=1e-5, atol=1e-5)


def test_the_plan_splits_like_megatron():
    graph, weights, plan, rank_weights = _tp("llama3", 2)
    axes = dict(plan.weight_axes)
    p = "model.layers.0."
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert axes[p + name + ".weight"] == 0, name           # column parallel: output rows dealt out
    assert axes[p + "self_attn.o_proj.weight"] == axes[p + "mlp.down_proj.weight"] == 1   # row parallel
    assert axes["model.embed_tokens.weight"] == axes["lm_head.weight"] == 0              # by vocabulary
    assert axes[p + "input_layernorm.weight"] is None and axes["model.norm.weight"] is None
    local = plan.graph
    assert local.weight(p + "self_attn.k_proj.weight").shape == (16, 32)       # 2 of 4 KV heads of 8
    assert local.weight(p + "mlp.down_proj.weight").shape == (32, 24)
    assert [s.shape for s in local.states[1:3]] == [(24, 2, 8), (24, 2, 8)]    # each rank caches its KV heads
    attention = next(n for n in local.nodes if n.op == "attention").attr_dict
    assert (attention["q_heads"], attention["kv_heads"]) == (4, 2)
    ops = [n.op for n in local.nodes]
    assert ops.count("all_reduce") == 2 * 2 + 1 and ops.count("tp_argmax") == 1 and "argmax" not in ops
    assert local.logits.shape == (1, 48) and plan.logits_layout == Split((96,))
    # the shards put back together are the model's weights
    for name, axis in plan.weight_axes:
        whole = weights[name] if axis is None else np.concatenate([rw[name] for rw in rank_weights], axis=axis)
        np.testing.assert_array_equal(whole, weights[name])
    assert local.weight_bytes() < graph.weight_bytes() and "2 ranks" in plan.summary()


def test_tied_embedding_is_split_once_by_vocabulary():
    _, _, plan, _ = _tp("qwen3", 4)
    assert dict(plan.weight_axes)["model.embed_tokens.weight"] == 0
    assert plan.graph.weight("model.embed_tokens.weight").shape == (24, 32)
    assert plan.graph.logits.shape == (1, 24)


def _sum_tasks(tp: TensorParallelTaskGraph, node: int) -> list:
    return [t for t in tp.local.tasks if t.node == node and t.kind == "all_reduce.sum"]


def test_consumers_wait_only_for_the_reduced_tiles_they_read():
    _, _, plan, _ = _tp("llama3", 4)
    tp = build_tensor_parallel_task_graph(plan, PARTITION)
    tasks, events = tp.local.tasks, {e.id: e for e in tp.local.events}
    reduce_nodes = [i for i, n in enumerate(plan.graph.nodes) if n.op == "all_reduce"]
    o_proj = reduce_nodes[1]                     # the first layer's o_proj reduction
    sums = _sum_tasks(tp, o_proj)
    assert len(sums) > 1
    for s in sums:
        tile = s.tile_dict
        # locally: only this tile's send, which waits only for the linear tiles that write its columns
        (local_wait,) = s.waits
        (send,) = [tasks[p] for p in events[local_wait.event].producers]
        assert send.kind == "all_reduce.send" and send.tile_dict == tile
        for w in send.waits:
            for p in events[w.event].producers:
                a, b = tasks[p].tile_value("col_start"), tasks[p].tile_value("col_stop")
                assert tasks[p].kind == "linear" and a < tile["col_stop"] and tile["col_start"] < b
        # remotely: the same send on each of the 3 other ranks, one put each
        (remote,) = tp.remote_waits[s.id]
        assert sorted(tp.remote_events[remote].producers) == [(send.id, k) for k in (1, 2, 3)]
        assert [(p.peer, p.events) for p in tp.puts[send.id]] == [(k, (remote,)) for k in (1, 2, 3)]
        # the residual add of these columns waits for this sum alone
        adds = [t for t in tasks if t.kind == "add" and t.node == o_proj + 1 and
                t.tile_value("col_start") < tile["col_stop"] and tile["col_start"] < t.tile_value("col_stop")]
        assert adds
        for a in adds:
            assert {p for w in a.waits for p in events[w.event].producers if tasks[p].node == o_proj} == {s.id}
    assert "remote event" in str(tp) and tp.put_bytes(sums[0].id - len(sums)) > 0


def test_wider_communication_tiles_keep_the_results_and_the_per_tile_waits():
    graph, weights, _, _ = _tp("llama3", 2)
    plan = tensor_parallel(graph, 2, tile_columns=12)       # hidden 32: tiles 0:12, 12:24, 24:32
    tp = build_tensor_parallel_task_graph(plan, PARTITION)
    tasks, events = tp.local.tasks, {e.id: e for e in tp.local.events}
    o_proj = [i for i, n in enumerate(plan.graph.nodes) if n.op == "all_reduce"][1]
    sums = _sum_tasks(tp, o_proj)
    assert [(t.tile_value("col_start"), t.tile_value("col_stop")) for t in sums] == [(0, 12), (12, 24), (24, 32)]
    for add in (t for t in tasks if t.kind == "add" and t.node == o_proj + 1):
        a, b = add.tile_value("col_start"), add.tile_value("col_stop")
        waited = {p for w in add.waits for p in events[w.event].producers if tasks[p].node == o_proj}
        assert waited == {s.id for s in sums if s.tile_value("col_start") < b and a < s.tile_value("col_stop")}
    rank_weights = [plan.shard_weights(weights, r) for r in range(2)]
    expected = ReferenceModel(graph, weights).generate(PROMPT, 3)
    got = TensorParallelSimulator(tp, rank_weights).generate(PROMPT, 3, seed=2)
    assert got.tokens == expected.tokens
    np.testing.assert_allclose(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValidationError, match="tile_columns must be 0 or a positive"):
        tensor_parallel(graph, 2, tile_columns=-1)


@pytest.mark.parametrize("world_size,heads,allowed", [
    (3, "the 4 query heads and the 2 KV heads of rope", "1, 2"),
    (4, "the 2 KV heads of rope", "1, 2"),
    (8, "the 4 KV heads of rope", "1, 2, 4"),
])
def test_a_world_size_that_does_not_divide_the_heads_says_which_do(world_size, heads, allowed):
    _, graph, _ = tiny_model("llama3", **(HEADS if world_size == 8 else {}))
    with pytest.raises(ShapeError, match=rf"over {world_size} ranks: {heads} do not split into {world_size}") as info:
        tensor_parallel(graph, world_size)
    assert f"world sizes this model allows: {allowed}" in str(info.value)
    assert info.value.loc is not None and info.value.loc.file.endswith("architectures.py")


def test_a_vocabulary_that_does_not_divide_names_the_weight():
    _, graph, _ = tiny_model("llama3", vocab_size=90, **HEADS)
    with pytest.raises(ShapeError, match=r"the 90 rows of weight model\.embed_tokens\.weight do not split into 4"):
        tensor_parallel(graph, 4)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "2"])
def test_a_world_size_must_be_a_positive_count(bad):
    _, graph, _ = tiny_model("llama3")
    with pytest.raises(ValidationError, match="positive number of ranks"):
        tensor_parallel(graph, bad)


def test_a_rank_outside_the_group_is_refused():
    _, weights, plan, _ = _tp("llama3", 2)
    with pytest.raises(ValidationError, match="rank 2 is not one of the 2 ranks"):
        plan.shard_weights(weights, 2)


def test_collectives_need_every_rank_outside_a_group_of_one():
    _, _, plan, _ = _tp("llama3", 2)
    node = next(n for n in plan.graph.nodes if n.op == "all_reduce")
    with pytest.raises(Exception, match="combines the values of 2 ranks"):
        node.opdef.reference([np.ones((1, 32), np.float32)], node.attr_dict, None)
    one = tensor_parallel(tiny_model("llama3")[1], 1)
    node = next(n for n in one.graph.nodes if n.op == "all_reduce")
    x = np.arange(32, dtype=np.float32).reshape(1, 32)
    np.testing.assert_array_equal(node.opdef.reference([x], node.attr_dict, None)[0], x)


# ---------------------------------------------------------------------------------------------
# the checker: missing remote waits, lost puts, ranks running ahead

def _tp_sim(world_size=2, arch="llama3"):
    _, _, plan, rank_weights = _tp(arch, world_size)
    return build_tensor_parallel_task_graph(plan, PARTITION), rank_weights


def test_a_missing_remote_wait_is_caught_before_the_task_runs():
    tp, rank_weights = _tp_sim()
    victim = _sum_tasks(tp, next(i for i, n in enumerate(tp.plan.graph.nodes) if n.op == "all_reduce"))[0].id
    waits = list(tp.remote_waits)
    waits[victim] = ()
    sim = TensorParallelSimulator(attrs.evolve(tp, remote_waits=waits), rank_weights)
    with pytest.raises(SimulationError, match=f"task {victim} .* started before the put of task .* arrived"):
        for seed in range(40):
            sim.generate(PROMPT, 2, seed=seed)


def test_a_lost_put_is_a_deadlock():
    tp, rank_weights = _tp_sim()
    sender = next(t.id for t in tp.local.tasks if t.kind == "tp_argmax.send")
    puts = list(tp.puts)
    puts[sender] = ()
    with pytest.raises(SimulationError, match=r"deadlock: .*tp_argmax\.reduce.*r\d+: 0/1"):
        TensorParallelSimulator(attrs.evolve(tp, puts=puts), rank_weights).generate(PROMPT, 2, seed=0)


def _ranks_exchanging_only_tokens(tp: TensorParallelTaskGraph) -> TensorParallelTaskGraph:
    """The task graph with its all_reduces made local (sums read only the rank's own slot, sends put
    nothing): the ranks meet only where they exchange their best tokens."""
    tasks, puts, waits = list(tp.local.tasks), list(tp.puts), list(tp.remote_waits)
    for t in tp.local.tasks:
        if t.kind == "all_reduce.sum":
            tasks[t.id] = attrs.evolve(t, reads=tuple(attrs.evolve(r, box=((0, 1), *r.box[1:])) for r in t.reads))
            waits[t.id] = ()
        if t.kind == "all_reduce.send":
            puts[t.id] = ()
    return attrs.evolve(tp, local=attrs.evolve(tp.local, tasks=tasks), puts=puts, remote_waits=waits)


def test_validate_refuses_remote_reads_without_a_wait_and_puts_that_can_overtake_a_reader():
    tp, _ = _tp_sim()
    victim = next(t.id for t in tp.local.tasks if t.kind == "all_reduce.sum")
    waits = list(tp.remote_waits)
    waits[victim] = ()
    with pytest.raises(ValidationError, match=f"task {victim} \\(all_reduce.sum\\) reads what task .* puts without "
                                              "waiting for it"):
        attrs.evolve(tp, remote_waits=waits).validate()
    # a rank that does not wait for the others in a step may put its next step's best token before they
    # read this step's
    with pytest.raises(ValidationError, match=r"tp_argmax\.send\) from rank -1 in step s \+ 1 may land before task "
                                              r"\d+ \(tp_argmax\.reduce\) has read step s's"):
        _ranks_exchanging_only_tokens(tp).validate()


def test_a_rank_running_a_step_ahead_is_caught_when_its_put_lands():
    tp, rank_weights = _tp_sim()
    sim = TensorParallelSimulator(_ranks_exchanging_only_tokens(tp), rank_weights)
    with pytest.raises(SimulationError, match=r"tp_argmax\.send\) of step \d+ from rank \d overwrote rank \d's data "
                                              r"before its task \d+ \(tp_argmax\.reduce"):
        for seed in range(40):
            sim.generate(PROMPT, 4, seed=seed, workers=[1, 6], speeds=[0.01, 1.0])


def test_a_put_landing_early_or_out_of_order_is_caught():
    """A put of step 1 must not land before the receiver's readers finished step 0, nor before the
    same put of step 0 (the graphs built here never do that: the ranks' exchange of best tokens ends
    every step; the checker guards graphs that would)."""
    tp, rank_weights = _tp_sim()
    sim = TensorParallelSimulator(tp, rank_weights)
    send = next(t for t in tp.local.tasks if t.kind == "all_reduce.send")
    (put,) = tp.puts[send.id]
    ranks = [_Rank(s, r, 1, [], "queue", PROMPT) for r, s in enumerate(sim.sims)]
    data = tuple((dst, np.zeros(1, np.float32)) for _, dst in put.regions)
    step1 = _Message(1, 0, send.id, put.peer, 1, data, put.events)
    with pytest.raises(SimulationError, match="of step 1 from rank 1 reached rank 0 before that of step 0"):
        sim._deliver(step1, ranks)
    ranks[0].delivered[(send.id, put.peer)] = 1       # step 0's landed, and nothing on rank 0 has read it
    with pytest.raises(SimulationError, match=r"overwrote rank 0's data before its task \d+ \(all_reduce\.sum"):
        sim._deliver(step1, ranks)


def test_a_put_into_a_slot_that_a_local_task_writes_is_refused():
    tp, _ = _tp_sim()
    send = next(t for t in tp.local.tasks if t.kind == "all_reduce.send")
    (put,) = tp.puts[send.id]
    src, _ = put.regions[0]
    raw = [() for _ in tp.local.tasks]
    raw[send.id] = (attrs.evolve(put, regions=((src, src),)),)
    with pytest.raises(ValidationError, match="which task .* there writes too"):
        _check_puts(tp.local, raw, [(send.id, 1, src)])


# ---------------------------------------------------------------------------------------------
# sharded checkpoint loading

def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.parametrize("arch,dtype,itemsize", [("llama3", "float32", 4), ("qwen3", "bfloat16", 2)])
def test_each_rank_reads_only_its_slices(tmp_path, arch, dtype, itemsize):
    folder = str(tmp_path)
    _, _, weights = tiny_model(arch, seed=1, **HEADS)
    save_checkpoint(folder, tiny_config_dict(arch, torch_dtype=dtype, **HEADS), weights, shards=3)
    config = load_config(folder)
    graph = step_function(config).trace(config)
    whole = load_weights(graph, folder)
    plan = tensor_parallel(graph, 2)
    for rank in range(2):
        located = open_checkpoint(folder)
        slices = plan.weight_slices(rank)
        before = _rchar() if os.path.exists("/proc/self/io") else None
        got = read_weights(graph, located, folder, slices)
        sliced_bytes = sum(plan.graph.weight(name).type.numel * itemsize for name in slices)
        if before is not None:     # the slices come through read(2); whole tensors (the norms) through a map
            assert sliced_bytes <= _rchar() - before < sliced_bytes + 4096
        expected = plan.shard_weights(whole, rank)
        assert got.keys() == expected.keys()
        for name in got:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
        read = sum(sf.bytes_read for sf in {id(sf): sf for sf in located.values()}.values())
        assert read == plan.graph.weight_bytes() < graph.weight_bytes()    # the rank's shard, nothing more
        loaded = load_rank_weights(plan, folder, rank)
        assert all(np.array_equal(loaded[n], got[n]) for n in got)


def test_a_sharded_load_still_names_a_mismatching_tensor(tmp_path):
    _, graph, weights = tiny_model("llama3", **HEADS)
    weights = dict(weights)
    weights["model.layers.1.self_attn.o_proj.weight"] = np.zeros((32, 60), np.float32)
    save_checkpoint(str(tmp_path), tiny_config_dict("llama3", **HEADS), weights)
    plan = tensor_parallel(graph, 2)
    with pytest.raises(ShapeError, match=r"o_proj\.weight .* has shape \[32, 60\], expected \[32, 64\]"):
        load_rank_weights(plan, str(tmp_path), 1)
    del weights["model.layers.1.self_attn.o_proj.weight"]
    save_checkpoint(str(tmp_path), tiny_config_dict("llama3", **HEADS), weights)
    with pytest.raises(ParseError, match=r"no tensor model\.layers\.1\.self_attn\.o_proj\.weight"):
        load_rank_weights(plan, str(tmp_path), 0)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
def test_read_slice_reads_one_axis_range(tmp_path, kind):
    path = str(tmp_path / "t.safetensors")
    x = np.random.default_rng(0).standard_normal((3, 10, 4)).astype(np.float32)
    write_safetensors(path, {"x": x}, {"x": kind})
    sf = SafetensorsFile(path)
    whole = sf.read("x")
    for axis, (a, b) in ((0, (1, 3)), (1, (2, 7)), (2, (1, 2)), (1, (4, 4))):
        before = sf.bytes_read
        part = sf.read_slice("x", axis, a, b)
        np.testing.assert_array_equal(part, np.take(whole, np.arange(a, b), axis=axis))
        assert sf.bytes_read - before == part.size * {"f32": 4, "f16": 2, "bf16": 2}[kind]
    with pytest.raises(ShapeError, match=r"cannot slice 8:12 of axis 1 of tensor x \(shape \[3, 10, 4\]\)"):
        sf.read_slice("x", 1, 8, 12)
    with open(path, "r+b") as f:     # the file shrinks after its header was read
        f.truncate(sf.data_start + 16)
    with pytest.raises(ParseError, match="tensor x ends early"):
        sf.read_slice("x", 0, 2, 3)

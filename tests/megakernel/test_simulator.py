"""The CPU simulator: random interleavings and worker counts give the reference forward's logits and
tokens; a missing dependency or a deadlock is reported."""
import random

import attrs
import numpy as np
import pytest

from mdsl.megakernel.modelgraph.architectures import sampling_decode
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.taskgraph.partition import build_task_graph
from mdsl.megakernel.taskgraph.simulator import SimulationError, Simulator
from mdsl.megakernel.taskgraph.tasks import PartitionConfig, TaskGraph
from tests.megakernel.tiny import tiny_model

PROMPT = [5, 17, 3]


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("num_sms,kv_splits", [(8, None), (16, 3), (5, 1)])
def test_simulator_matches_reference_under_random_interleavings(arch, num_sms, kv_splits):
    config, graph, weights = tiny_model(arch, seed=7)
    expected = ReferenceModel(graph, weights).generate(PROMPT, 6)
    task_graph = build_task_graph(graph, PartitionConfig(num_sms=num_sms, column_align=4, kv_splits=kv_splits))
    sim = Simulator(task_graph, weights)
    rng = random.Random(num_sms)
    for dispatch in ("queue", "round_robin", "queue"):
        got = sim.generate(PROMPT, 6, workers=rng.randint(1, 12), seed=rng.randrange(1 << 30), dispatch=dispatch)
        assert got.tokens == expected.tokens
        assert got.logits.shape == (len(PROMPT) - 1 + 6, config.vocab_size)
        np.testing.assert_allclose(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    assert len(set(expected.tokens)) > 1   # the tokens fed back change from step to step


def test_simulator_sampling_matches_reference():
    config, _, _ = tiny_model("qwen3")
    graph = sampling_decode("qwen3", temperature=0.8, top_p=0.9, seed=11).trace(config)
    _, _, weights = tiny_model("qwen3", seed=3)
    expected = ReferenceModel(graph, weights).generate(PROMPT, 8)
    got = Simulator(build_task_graph(graph, PartitionConfig(num_sms=6)), weights).generate(PROMPT, 8, workers=3,
                                                                                             seed=5)
    assert got.tokens == expected.tokens
    np.testing.assert_allclose(got.logits, expected.logits, rtol=1e-5, atol=1e-5)


def _without_wait(task_graph: TaskGraph, task_id: int) -> TaskGraph:
    """The task graph with one task's waits dropped (events keep their producers)."""
    tasks = list(task_graph.tasks)
    tasks[task_id] = attrs.evolve(tasks[task_id], waits=())
    return TaskGraph(task_graph.model, task_graph.config, task_graph.buffers, tasks, task_graph.events)


@pytest.mark.parametrize("kind,when", [("linear", "this step"), ("attention.combine", "this step"),
                                       ("embedding", "the previous step")])
def test_a_missing_wait_is_caught_before_the_task_runs(kind, when):
    _, graph, weights = tiny_model("llama3")
    task_graph = build_task_graph(graph, PartitionConfig(num_sms=4, column_align=4))
    victim = [t.id for t in task_graph.tasks if t.kind == kind][-1]
    sim = Simulator(_without_wait(task_graph, victim), weights)
    with pytest.raises(SimulationError, match=f"task {victim} .*started before .* finished {when}"):
        for seed in range(40):   # some interleaving runs the task before its producer
            sim.generate(PROMPT, 3, workers=6, seed=seed)


def test_a_deadlock_is_reported():
    _, graph, weights = tiny_model("llama3")
    task_graph = build_task_graph(graph, PartitionConfig(num_sms=4, column_align=4))
    # a wait on an event that the last task signals: every worker ends up waiting
    last = task_graph.tasks[-1]
    first = attrs.evolve(task_graph.tasks[0], waits=task_graph.tasks[0].waits + (last.waits[0],))
    broken = TaskGraph(task_graph.model, task_graph.config, task_graph.buffers,
                       (first, *task_graph.tasks[1:]), task_graph.events)
    with pytest.raises(SimulationError, match="deadlock"):
        Simulator(broken, weights).generate(PROMPT, 2, workers=3, seed=0)

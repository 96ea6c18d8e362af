"""Tiny Llama-3 and Qwen3 checkpoints for the serving tests, a driver that runs the CPU device's steps by
hand so that each request arrives at a chosen step, and the choice of the CPU device's scheduler."""
from __future__ import annotations

import time

import attrs
import pytest

from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.checkpoint import random_weights, save_checkpoint
from mdsl.megakernel.modelgraph.model_config import config_from_dict
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.serving import engine
from tests.megakernel.tiny import tiny_config_dict

POSITIONS = 64
LONG_POSITIONS = 320        # prompts of up to 300 tokens and their new tokens


@attrs.frozen(eq=False)
class Checkpoint:
    folder: str
    raw: dict
    graph: object
    weights: dict

    def reference(self) -> ReferenceModel:
        return ReferenceModel(self.graph, self.weights)


def write_checkpoint(folder, arch: str, seed: int = 0, positions: int = POSITIONS, **overrides) -> Checkpoint:
    raw = tiny_config_dict(arch, max_position_embeddings=positions, **overrides)
    config = config_from_dict(raw)
    graph = step_function(config).trace(config)
    weights = random_weights(graph, seed, scale=0.3)
    save_checkpoint(str(folder), raw, weights)
    return Checkpoint(str(folder), raw, graph, weights)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    return {arch: write_checkpoint(tmp_path_factory.mktemp(arch), arch) for arch in ("llama3", "qwen3")}


@pytest.fixture(scope="session")
def long_checkpoints(tmp_path_factory) -> dict:
    return {arch: write_checkpoint(tmp_path_factory.mktemp(f"{arch}-long"), arch, positions=LONG_POSITIONS)
            for arch in ("llama3", "qwen3")}


@pytest.fixture(params=["python", "native"])
def scheduler(request, monkeypatch) -> str:
    """The scheduler of the CPU devices that the test's engines make: CpuDevice's own (Python), or the
    megakernel's C++ scheduler built for the host (tests/serving/native_scheduler.py; skipped where it
    cannot be built)."""
    if request.param == "native":
        from tests.serving.native_scheduler import NativeSchedulerDevice, host_library

        host_library()
        monkeypatch.setattr(engine, "CpuDevice", NativeSchedulerDevice)
    return request.param


def wait_until(condition, timeout: float = 60.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.001)


VOCAB = 96   # the tiny checkpoints' vocabulary (write_checkpoint)


def random_prompts(rng, n: int, low: int = 1, high: int = 20) -> list:
    return [[int(t) for t in rng.integers(0, VOCAB, int(rng.integers(low, high + 1)))] for _ in range(n)]


def arrivals_of(rng, prompts: list, params: list, steps: int) -> dict:
    """step -> [(key, prompt, params)]: each request arriving at a random step below `steps`."""
    arrivals: dict = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        arrivals.setdefault(int(rng.integers(0, steps)), []).append((i, prompt, p))
    return arrivals


def drive(llm, arrivals: dict, max_steps: int = 5000) -> dict:
    """Hold the device and run its steps here: before step s, submit arrivals[s] (a list of (key, prompt,
    params)) and wait until the host has published them. Returns key -> handle once all are done."""
    llm.device.hold()
    handles: dict = {}
    last = max(arrivals, default=0)
    for step in range(max_steps):
        for key, prompt, params in arrivals.get(step, ()):
            handles[key] = llm.submit(prompt, params)
        if arrivals.get(step):
            wait_until(lambda: llm.stats().host_pending == 0 or llm.device.queued() == llm.shape.queue_slots,
                       what="publication")
        if step >= last and all(h.done() for h in handles.values()):
            break
        if not llm.device.step() and step >= last:
            time.sleep(0.001)     # nothing ran: the host thread is still reading the last records
    else:
        raise AssertionError(f"requests unfinished after {max_steps} steps")
    llm.device.resume()
    return handles

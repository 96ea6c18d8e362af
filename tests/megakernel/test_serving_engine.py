"""The serving kernel's host side without a GPU (mdsl.megakernel.runtime.serving_engine's dry run, and
mdsl.serving.megakernel's reading of a launch's end): the parameter block points at buffers of the sizes the
serving tables, the protocol's regions and the scheduler's workspace say, the layer table points into the pools, the
words written before each launch, the launch's step limit, and how each way a launch stops becomes the device's
error or its next launch."""
import ctypes
import re

import numpy as np
import pytest

from mdsl.errors import MdslError, ShapeError
from mdsl.megakernel.runtime.serving_engine import (HOST_STOP, NO_STOP, STATE_BAD_TOKEN, STATE_LAUNCH_END,
                                                    STATE_SERVE_ERROR, STATE_STOP, STATE_WORDS, Params, ServingKernel,
                                                    steps_per_launch)
from mdsl.megakernel.runtime.serving_source import generate_serving_source
from mdsl.megakernel.runtime.shape import LAYER_WEIGHTS, QKV_BIASES
from mdsl.serving.params import ServingError
from mdsl.serving.protocol import FREE, ServingShape, device_region, kv_pool_shape
from mdsl.serving.scheduler import ERROR_REQUEST, STATE, workspace_bytes
from tests.megakernel.tiny import tiny_model

POSITIONS = 64
SHAPE = ServingShape(max_batch=5, page_size=4, num_pages=20, max_seq=POSITIONS, max_tokens_per_step=7)
HOST = 0x7000_0000_0000   # a stand-in for the host region's device address
POINTERS = ("tasks", "waits", "signals", "events", "state", "layers", "embed", "final_norm", "lm_head", "rope_cos",
            "rope_sin", "hs", "mids", "qkvs", "attns", "acts", "parts", "logits", "best_value", "best_index", "host",
            "device_state", "workspace", "serve")


def dry_kernel(arch: str = "qwen3", workers: int = 9, **overrides) -> ServingKernel:
    config, graph, weights = tiny_model(arch, max_position_embeddings=POSITIONS, **overrides)
    return ServingKernel(config, graph, weights, SHAPE, host_region=HOST, workers=workers, dry_run=True)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_the_parameter_block_points_at_buffers_of_the_tables_sizes(arch):
    kernel = dry_kernel(arch)
    plan, p, s = kernel.plan, kernel.params, kernel.plan.shape
    layout = kernel.layout()
    starts = {a.address: a for a in layout.values()}
    for name in POINTERS:
        value = getattr(p, name)
        assert value, name
        assert name == "host" or value in starts, name   # (every buffer's first element)
    assert p.host == HOST
    assert layout["serve"].nbytes == plan.region().size and starts[p.serve].name == "serve"
    assert layout["device_state"].nbytes == device_region(SHAPE).size and starts[p.device_state].name == "device_state"
    assert layout["workspace"].nbytes == workspace_bytes(SHAPE) and starts[p.workspace].name == "workspace"
    sizes = plan.activations()
    for name, field in (("h", "hs"), ("mid", "mids"), ("qkv", "qkvs"), ("attn", "attns"), ("act", "acts")):
        assert starts[getattr(p, field)].nbytes == int(np.prod(sizes[name])) * s.dtype.itemsize, name
    assert layout["parts"].nbytes == 4 * int(np.prod(sizes["parts"]))
    assert layout["logits"].nbytes == 4 * SHAPE.max_batch * s.vocab
    assert layout["best_value"].nbytes == layout["best_index"].nbytes == 4 * SHAPE.max_batch * plan.lm_tiles
    assert layout["events"].nbytes == 4 * len(plan.events) and layout["state"].nbytes == 4 * STATE_WORDS
    assert layout["tasks"].nbytes == 4 * 8 * len(plan.tasks)
    assert p.num_steps == kernel.steps_per_launch == steps_per_launch(plan)


def test_the_layer_table_points_into_the_pools_and_the_bound_weights():
    kernel = dry_kernel("qwen2")
    p, s = kernel.params, kernel.plan.shape
    pool = int(np.prod(kv_pool_shape(SHAPE, s.kv_heads, s.head_dim))) * s.dtype.itemsize
    layout = kernel.layout()
    assert layout["k_pool"].nbytes == layout["v_pool"].nbytes == s.layers * pool
    table = kernel.memory.uploads["layers"].view(np.uint64).reshape(s.layers, -1)
    assert table.shape[1] == len(LAYER_WEIGHTS) + 2 + len(QKV_BIASES)   # sync.cuh's LayerWeights with QKV_BIAS
    k, v = len(LAYER_WEIGHTS), len(LAYER_WEIGHTS) + 1
    for layer in range(s.layers):
        assert table[layer, k] == layout["k_pool"].address + layer * pool
        assert table[layer, v] == layout["v_pool"].address + layer * pool
        q_proj = kernel.plan.weight("q_proj", layer)
        assert table[layer, 0] == layout[q_proj.name].address + q_proj.offset(s.dtype.itemsize)
        assert all(table[layer, len(LAYER_WEIGHTS) + 2:])   # (Qwen2's biases)
    qwen3 = dry_kernel("qwen3")
    table = qwen3.memory.uploads["layers"].view(np.uint64).reshape(s.layers, -1)
    assert table.shape[1] == len(LAYER_WEIGHTS) + 2 and all(table[:, LAYER_WEIGHTS.index("q_norm")])


def test_the_device_region_starts_as_the_cpu_devices_and_each_launch_resets_its_words():
    kernel = dry_kernel()
    views = device_region(SHAPE).views(kernel.initial_device_state())
    assert (views["entries"]["state"] == FREE).all() and (views["page_table"] == -1).all()
    assert views["pool"]["free_count"][0] == SHAPE.num_pages == views["pool"]["num_pages"][0]
    assert views["free_pages"].tolist() == list(range(SHAPE.num_pages))[::-1]   # page 0 on top
    (events, initial), (state, words), (serve, zeros) = kernel.launch_words()
    p = kernel.params
    assert (events, state, serve) == (p.events, p.state, p.serve)
    assert initial.tolist() == [kernel.plan.samplers] + [0] * (len(kernel.plan.events) - 1)
    assert words[STATE_STOP] == NO_STOP and not words[:STATE_STOP].any() and not words[STATE_STOP + 1:].any()
    assert zeros.nbytes == kernel.plan.region().size and not zeros.any()


def test_a_launch_runs_as_many_steps_as_its_counters_hold():
    kernel = dry_kernel(workers=132)
    n = kernel.steps_per_launch
    most = max(max(e.per_step for e in kernel.plan.events),
               max(kernel.plan.append_tiles(g) for g in range(kernel.plan.shape.kv_heads)))
    assert 2 <= n and most * n <= 2**32 - 1 < most * (n + 1)


def test_the_hosts_parameter_block_is_the_serving_kernels():
    kernel = dry_kernel()
    text = generate_serving_source(kernel.plan).text
    struct = re.search(r"struct Params \{(.*?)\};", text, re.S).group(1)
    assert [line.split()[-1].rstrip(";") for line in struct.strip().splitlines()] == [n for n, _ in Params._fields_]
    assert f"sizeof(Params) == {ctypes.sizeof(Params)}" in text


def test_missing_weights_are_refused():
    config, graph, weights = tiny_model("llama3", max_position_embeddings=POSITIONS)
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ShapeError, match="down_proj"):
        ServingKernel(config, graph, weights, SHAPE, host_region=HOST, workers=4, dry_run=True)
    with pytest.raises(MdslError, match="worker count"):
        ServingKernel(config, graph, weights, SHAPE, host_region=HOST, dry_run=True)


# ---- a launch's end (mdsl.serving.megakernel.launch_ended)

def _state(**words) -> np.ndarray:
    state = np.zeros(STATE_WORDS, np.int32)
    state[STATE_STOP] = NO_STOP
    for index, value in words.items():
        state[int(index)] = value
    return state


def test_each_way_a_launch_stops_becomes_a_relaunch_a_stop_or_an_error():
    from mdsl.gpu.driver import CudaError
    from mdsl.serving.megakernel import launch_ended

    plan = dry_kernel().plan
    scheduler = np.zeros(1, STATE.dtype())[0]
    assert launch_ended(plan, _state(**{str(STATE_LAUNCH_END): 1, str(STATE_STOP): 41}), scheduler)
    assert not launch_ended(plan, _state(**{str(STATE_STOP): 12}), scheduler)                  # the shutdown word
    assert not launch_ended(plan, _state(**{str(STATE_STOP): HOST_STOP, str(STATE_LAUNCH_END): 1}), scheduler)
    with pytest.raises(CudaError, match=r"task 3 \(.*\) of step 7 .* event 2 \(count 5, needed 9"):
        launch_ended(plan, _state(**{"6": 4, "7": 7, "8": 2, "9": 5, "10": 9, str(STATE_STOP): -1}), scheduler)
    bad = np.zeros(1, STATE.dtype())[0]
    bad["bad_request"]["request_id"], bad["bad_request"]["prompt_len"] = 17, 0
    with pytest.raises(ServingError, match="request 17 breaks the protocol: prompt_len 0"):
        launch_ended(plan, _state(**{str(STATE_SERVE_ERROR): ERROR_REQUEST}), bad)
    with pytest.raises(MdslError, match="no maximum"):
        launch_ended(plan, _state(**{str(STATE_BAD_TOKEN): 1, str(STATE_SERVE_ERROR): 16}), scheduler)


def test_without_a_gpu_the_megakernel_device_says_so(tmp_path):
    from mdsl import LLM
    from mdsl.gpu import has_gpu
    from mdsl.gpu.driver import NoGPUError
    from tests.serving.conftest import write_checkpoint

    if has_gpu():
        pytest.skip("a GPU is present")
    checkpoint = write_checkpoint(tmp_path, "qwen3")
    with pytest.raises(NoGPUError, match="device='megakernel'"):
        LLM(checkpoint.folder, device="megakernel")


class _ScriptedKernel:
    """A serving kernel whose launches end as `ends` says (state words, one list per launch)."""

    def __init__(self, plan, ends: list):
        self.plan, self.ends, self.launched = plan, list(ends), 0
        self.params = Params()
        self.params.state, self.params.workspace = 1, 2

    def launch(self, stream) -> None:
        self.launched += 1

    def copy_out(self, address: int, nbytes: int, stream) -> np.ndarray:
        if address == self.params.state:
            return self.ends[self.launched - 1].view(np.uint8)
        return np.zeros(nbytes, np.uint8)


def _device_thread(monkeypatch, ends: list, stopping: bool = False):
    """MegakernelDevice's thread run here over a scripted kernel: (the device, its control block)."""
    from mdsl.gpu import driver
    from mdsl.serving import megakernel
    from mdsl.serving.protocol import host_region

    monkeypatch.setattr(driver, "get_device", lambda device=0: None)
    device = object.__new__(megakernel.MegakernelDevice)
    region = host_region(SHAPE)
    device.host, device.device, device.error, device.launches = region.views(region.allocate()), 0, None, 0
    device.kernel, device._stopping, device._stream = _ScriptedKernel(dry_kernel().plan, ends), stopping, None
    device._watch = lambda: None
    woken = []
    device._notify_host = lambda: woken.append(1)
    device._run()
    assert woken
    return device, device.host["control"][0]


def test_the_device_thread_launches_again_until_the_kernel_stops(monkeypatch):
    from mdsl.serving.protocol import FAILED, STOPPED

    ended = _state(**{str(STATE_LAUNCH_END): 1, str(STATE_STOP): 1})
    device, control = _device_thread(monkeypatch, [ended, ended, _state(**{str(STATE_STOP): 4})])
    assert device.launches == 3 and device.error is None and control["status"] == STOPPED
    device, control = _device_thread(monkeypatch, [ended, _state(**{str(STATE_SERVE_ERROR): 2})])
    assert device.launches == 2 and control["status"] == FAILED
    assert isinstance(device.error, ServingError) and "lost or duplicated a page" in str(device.error)
    device, control = _device_thread(monkeypatch, [ended], stopping=True)   # (the host's stop came first)
    assert device.launches == 0 and control["status"] == STOPPED


def test_the_profile_ring_gives_the_records_of_its_complete_steps():
    """worker.cuh's serving profile: a ring of PROFILE_STEPS steps' records, each with its step + 1 beside its SM;
    a step whose every task was recorded comes back with the records' indices step * tasks + task, a step the
    kernel was still recording (or never recorded) does not."""
    from mdsl.megakernel.runtime.kernel_source import PROFILE_WORDS
    from mdsl.megakernel.runtime.serving_source import PROFILE_STEPS

    kernel = dry_kernel()
    tasks = len(kernel.plan.tasks)
    assert kernel.layout()["profile"].nbytes == 8 * PROFILE_WORDS * PROFILE_STEPS * tasks
    assert f"constexpr int PROFILE_STEPS = {PROFILE_STEPS};" in kernel.source.text
    ring = np.zeros((PROFILE_STEPS * tasks, PROFILE_WORDS), np.uint64)
    step = PROFILE_STEPS + 1                      # (its records at the ring's second step)
    for task in range(tasks):
        ring[tasks + task, :5] = [7 | (step + 1) << 32, 100 + task, 110 + task, 120 + task, 130 + task]
    for task in range(tasks - 1):                 # the next step, one task short
        ring[2 * tasks + task, :5] = [(step + 2) << 32, 1, 2, 3, 4]
    steps = kernel.profile_records(ring.view(np.uint8).ravel())
    assert list(steps) == [step] and len(steps[step]) == tasks
    record = steps[step][5]
    assert (record.index, record.sm, record.taken_ns, record.ready_ns, record.started_ns, record.done_ns) == (
        step * tasks + 5, 7, 105, 115, 125, 135)
    assert kernel.profile_records(np.zeros(ring.nbytes, np.uint8)) == {}

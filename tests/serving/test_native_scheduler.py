"""The megakernel's scheduler (mdsl/serving/scheduler.cuh) against the CPU device's Python scheduler: the
C++ built for the host (tests/serving/native_scheduler.py) and CpuDevice, stepped by hand side by side
under the same random workloads by a deterministic host, write the same device state, control words and
ring records after every step; they raise the same errors; a full ring keeps a step's records staged
until the host reads; the same source compiles for sm_90a with NVRTC inside a kernel whose one thread
runs a step, without a stack frame."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

from mdsl.serving.cpu import CpuDevice
from mdsl.serving.params import ServingError
from mdsl.serving.protocol import (FINISHED, FREE, HAS_TOKEN, MAX_STOP, PREEMPTED, REASON_STOP,
                                   RUNNING, ServingShape, c_declarations, host_region)
from mdsl.serving import scheduler
from mdsl.serving.scheduler import scheduler_source, workspace_bytes
from tests.serving.conftest import VOCAB
from tests.serving.native_scheduler import NativeScheduler, NativeSchedulerDevice, host_library, sizes_of

DEVICE_ARRAYS = ("entries", "page_table", "history", "pool", "free_pages", "step", "chunks", "rows")


class Host:
    """The host's side of the protocol, as the engine does it (handles, the queue, cancel flags, the
    ring), without threads and with its choices (how many records it reads, and when) from its own seeded
    generator: two devices given two such hosts with the same seed see the same host as long as they
    write the same records."""

    def __init__(self, shape: ServingShape, seed: int, eager: float):
        region = host_region(shape)
        self.buffer = region.allocate()
        self.views = region.views(self.buffer)
        self.shape, self.rng, self.eager = shape, np.random.default_rng(seed), eager
        self.free_handles = list(range(shape.handles))[::-1]
        self.pending: list = []        # (request id, fields) waiting for a queue slot
        self.prompts: dict = {}        # request id -> prompt
        self.handle: dict = {}         # request id -> handle, until its last record is read
        self.tokens: dict = {}         # request id -> tokens streamed
        self.done: dict = {}           # request id -> finish reason (or "host" where cancelled on the host)
        self.records: list = []
        self.published = self.read = 0
        self.full_waits = 0            # the device waited on a full ring
        self.cancelled_in: list = []   # where each cancelled request was: "host", "queue", its entry state
        self.device = None

    def notify(self) -> None:
        """The device's doorbell: read some of the records (at least one where the ring is full)."""
        available = self.available()
        if available == len(self.views["ring"]):
            self.full_waits += 1
            self.read_ring(int(self.rng.integers(1, available + 1)))
        elif available and self.rng.random() < self.eager:
            self.read_ring(int(self.rng.integers(0, available + 1)))
        self.device.wake()

    def available(self) -> int:
        ring, n = self.views["ring"], 0
        while n < len(ring) and int(ring["seq"][(self.read + n) % len(ring)]) == self.read + n + 1:
            n += 1
        return n

    def read_ring(self, count: int) -> None:
        ring = self.views["ring"]
        for _ in range(count):
            rec = ring[self.read % len(ring)]
            assert int(rec["seq"]) == self.read + 1
            rid, flags = int(rec["request_id"]), int(rec["flags"])
            self.records.append(tuple(int(rec[f]) for f in ("request_id", "token", "position", "flags", "reason")))
            self.read += 1
            self.views["control"]["ring_read"] = self.read
            assert rid in self.handle, rid
            if flags & HAS_TOKEN:
                assert int(rec["position"]) == self.prompts[rid].size + len(self.tokens[rid])
                self.tokens[rid].append(int(rec["token"]))
            if flags & FINISHED:
                self.free_handles.append(self.handle.pop(rid))
                self.done[rid] = int(rec["reason"])

    def submit(self, rid: int, prompt: np.ndarray, request: dict) -> None:
        self.prompts[rid], self.tokens[rid] = prompt, []
        self.pending.append((rid, request))

    def publish(self) -> None:
        queue, control = self.views["queue"], self.views["control"]
        while self.pending and self.free_handles and self.published - int(control["queue_taken"][0]) < len(queue):
            rid, request = self.pending.pop(0)
            h = self.handle[rid] = self.free_handles.pop()
            self.views["cancel"][h] = 0
            self.views["prompts"][h, :self.prompts[rid].size] = self.prompts[rid]
            slot = queue[self.published % len(queue)]
            slot["request"] = tuple(request.get(name, 0) for name in slot["request"].dtype.names)
            slot["request"]["handle"] = h
            slot["seq"] = self.published + 1
            self.published += 1

    def cancel(self, rid: int) -> None:
        if rid in self.done:
            return
        waiting = [i for i, (r, _) in enumerate(self.pending) if r == rid]
        if waiting:
            del self.pending[waiting[0]]
            self.done[rid] = "host"
            self.cancelled_in.append("host")
            return
        entries = self.device.state["entries"]
        admitted = np.flatnonzero((entries["state"] != FREE) & (entries["request"]["request_id"] == rid))
        self.cancelled_in.append(int(entries["state"][admitted[0]]) if len(admitted) else "queue")
        self.views["cancel"][self.handle[rid]] = 1
        self.views["control"]["cancels"] += 1


def workload(rng, shape: ServingShape, n: int) -> tuple:
    """(step -> [(request id, prompt, request fields)], step -> [request ids to cancel])."""
    arrivals, cancels = {}, {}
    for rid in range(n):
        length = int(rng.integers(1, 21))
        new = int(rng.integers(1, 13))     # (20 + 12 - 1 positions: shapes() gives them pages)
        stops = [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(0, MAX_STOP + 1)))]
        sampled = rng.random() < 0.5
        request = dict(request_id=rid, seed=int(rng.integers(1 << 40)), prompt_len=length, max_new_tokens=new,
                       top_k=int(rng.integers(0, 8)) if sampled else 0, temperature=1.1 if sampled else 0.0,
                       top_p=0.9 if sampled else 1.0, num_stop=len(stops),
                       stop_ids=stops + [-1] * (MAX_STOP - len(stops)))
        arrival = int(rng.integers(0, 30))
        arrivals.setdefault(arrival, []).append((rid, rng.integers(0, VOCAB, length).astype(np.int32), request))
        if rng.random() < 0.35:
            cancels.setdefault(arrival + int(rng.integers(0, 40)), []).append(rid)
    return arrivals, cancels


def assert_same(python: CpuDevice, native: CpuDevice, at: str) -> None:
    for name in DEVICE_ARRAYS:
        assert python.state[name].tobytes() == native.state[name].tobytes(), f"{name} differs {at}"
    assert python.host["control"].tobytes() == native.host["control"].tobytes(), f"control differs {at}"
    assert python.host["ring"].tobytes() == native.host["ring"].tobytes(), f"ring differs {at}"


def shape_of(rng, budget: int) -> ServingShape:
    page_size = int(rng.choice([1, 2, 4, 8]))
    # the longest request (20 + 12 - 1 positions) fits; a few pages more at most, so that the pool runs out
    num_pages = -(-31 // page_size) + int(rng.integers(0, 3))
    return ServingShape(int(rng.integers(2, 7)), page_size, num_pages, 40, budget)


def run_side_by_side(ckpt, shape: ServingShape, seed: int, requests: int = 24) -> Host:
    """A random workload on the Python-scheduled and the C++-scheduled device, stepped together and compared
    after every step; the first device's host."""
    arrivals, cancels = workload(np.random.default_rng(seed), shape, requests)
    eager = [0.05, 0.3, 1.0][seed % 3]      # a host that reads seldom lets the ring fill
    hosts = [Host(shape, seed, eager) for _ in range(2)]
    python, native = (kind(ckpt.graph, ckpt.weights, shape, host.views, host.notify)
                      for kind, host in zip((CpuDevice, NativeSchedulerDevice), hosts))
    for host, device in zip(hosts, (python, native)):
        host.device = device
    assert_same(python, native, "at the start")
    for step in range(2000):
        for host in hosts:
            for rid, prompt, request in arrivals.get(step, ()):
                host.submit(rid, prompt, request)
            for rid in cancels.get(step, ()):
                host.cancel(rid)
            host.read_ring(int(host.rng.integers(0, host.available() + 1)) if host.rng.random() < eager else 0)
            host.publish()
        worked = [device.step() for device in (python, native)]
        assert worked[0] == worked[1], f"step {step}"
        assert_same(python, native, f"after step {step} (seed {seed}, {shape})")
        assert hosts[0].records == hosts[1].records and hosts[0].done == hosts[1].done
        if len(hosts[0].done) == requests:
            break
    else:
        raise AssertionError(f"requests unfinished after 2000 steps (seed {seed}, {shape})")
    assert python.state["pool"]["free_count"][0] == shape.num_pages
    return hosts[0]


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_the_native_scheduler_writes_what_the_python_scheduler_writes_after_every_step(checkpoints, budget):
    host_library()
    seen: dict = {"preemptions": 0, "full ring": 0, "stop": 0}
    for seed in range(8):
        rng = np.random.default_rng(1000 + seed)
        host = run_side_by_side(checkpoints["llama3" if seed % 2 else "qwen3"], shape_of(rng, budget), seed)
        seen["preemptions"] += int(host.views["control"]["preemptions"][0])
        seen["full ring"] += host.full_waits
        seen["stop"] += list(host.done.values()).count(REASON_STOP)
        for where in host.cancelled_in:
            seen[where] = seen.get(where, 0) + 1
    # what the workloads went through: full rings, stop ids, cancellations on the host, in the queue and
    # of running entries, and with chunks (a budget of one token runs one request at a time) preemptions
    # and cancelled preempted entries
    assert seen["full ring"] and seen["stop"] and seen["host"] and seen["queue"] and seen[RUNNING], seen
    assert budget == 1 or (seen["preemptions"] and seen.get(PREEMPTED)), seen


def test_a_request_that_breaks_the_protocol_and_a_damaged_pool_raise_the_same_errors(checkpoints):
    host_library()
    ckpt = checkpoints["llama3"]
    shape = ServingShape(max_batch=2, page_size=4, num_pages=8, max_seq=32)
    errors = []
    for kind in (CpuDevice, NativeSchedulerDevice):
        host = Host(shape, 0, 1.0)
        device = host.device = kind(ckpt.graph, ckpt.weights, shape, host.views, host.notify)
        host.submit(7, np.arange(5, dtype=np.int32), dict(request_id=7, prompt_len=5, max_new_tokens=28,
                                                          temperature=0.0, top_p=1.0))
        host.publish()
        with pytest.raises(ServingError, match="request 7 breaks the protocol") as broken:
            device.step()
        fresh = kind(ckpt.graph, ckpt.weights, shape, Host(shape, 0, 1.0).views, host.notify)
        fresh.state["free_pages"][0] = fresh.state["free_pages"][1]
        with pytest.raises(ServingError, match="lost or duplicated") as damaged:
            fresh.step()
        errors.append((str(broken.value), str(damaged.value)))
    assert errors[0] == errors[1]


def test_a_full_ring_keeps_the_records_staged_until_the_host_reads_and_the_next_step_waits_for_them(checkpoints):
    ckpt = checkpoints["qwen3"]
    shape = ServingShape(max_batch=1, page_size=4, num_pages=8, max_seq=32)     # a ring of 4 records
    host = Host(shape, 0, 0.0)
    host.device = CpuDevice(ckpt.graph, ckpt.weights, shape, host.views, host.notify)   # (its regions)
    native = NativeScheduler(host_library(), shape, host.views, host.device.state)
    host.submit(3, np.arange(6, dtype=np.int32), dict(request_id=3, prompt_len=6, max_new_tokens=8, top_p=1.0))
    host.publish()

    def step(token: int) -> int:
        native.begin()
        native.end([token])         # (the sampler's token for the step's one chunk)
        assert native.tell_host and native.worked
        return native.flush()

    assert [step(10 + k) for k in range(5)] == [0, 0, 0, 0, 1]     # the fifth record waits for room
    assert host.available() == 4 and native.state["staged"][0] - native.state["flushed"][0] == 1
    host.read_ring(2)
    assert native.flush() == 0 and host.available() == 3
    assert step(15) == 0 and step(16) == 1
    with pytest.raises(ServingError, match="before the last step's ring records were published"):
        native.begin()
    with pytest.raises(ServingError, match="before the last step's ring records were published"):
        native.end([17])            # an error stays: every later call answers it
    host.read_ring(4)
    assert native.flush() == 0
    host.read_ring(1)
    assert host.tokens[3] == list(range(10, 17)) and 3 not in host.done
    entries = host.device.state["entries"]
    assert entries["generated"][0] == 7 and entries["context"][0] == 12
    assert list(host.device.state["history"][0, :13]) == list(range(6)) + list(range(10, 17))
    assert host.views["control"]["steps"][0] == 7 and host.views["control"]["tokens"][0] == 12


def test_the_error_codes_workspace_and_state_agree_with_the_header():
    lib = host_library()
    text = (Path(scheduler.__file__).with_name("scheduler_base.cuh")).read_text()
    codes = dict(re.findall(r"^\s+(OK|ERROR_\w+) = (\d+),", text, re.MULTILINE))
    assert {name: getattr(scheduler, name) for name in codes} == {name: int(v) for name, v in codes.items()}
    assert len(codes) == 5
    for shape in (ServingShape(2, 4, 8, 32), ServingShape(64, 16, 4096, 4096, 256), ServingShape(5, 1, 33, 40, 7)):
        sizes = (ctypes.c_uint32 * 9)(*sizes_of(shape))
        assert lib.mdsl_scheduler_workspace_bytes(sizes) == workspace_bytes(shape)


KERNEL = r"""
extern "C" __global__ void serving_scheduler(void* host, void* device, void* workspace, const int* tokens,
                                             unsigned* answer) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  sched::Serving s = sched::serving_of_regions(host, device, workspace);
  unsigned error = sched::begin_step(s);
  if (!error) error = sched::end_step(s, tokens);
  while (!error && sched::flush_records(s)) {   // the ring is full: wait for the host, or its shutdown
    if (*(volatile unsigned*)&s.control->shutdown) break;
    __nanosleep(1000);
  }
  *answer = error;
}
"""


def test_the_scheduler_compiles_for_sm_90a_in_one_thread_of_a_kernel_without_a_stack_frame():
    nvrtc = pytest.importorskip("mdsl.backend.cuda.nvrtc")
    shape = ServingShape(max_batch=64, page_size=16, num_pages=4096, max_seq=4096)
    source = c_declarations(shape) + scheduler_source(regions=True) + KERNEL
    module = nvrtc.compile_cuda(source, arch="sm_90a")
    resources = module.resources["serving_scheduler"]
    assert resources.stack_bytes == resources.spill_store_bytes == 0, resources
    assert "ld.acquire.sys.global.u64" in nvrtc.compile_ptx(source, arch="sm_90a")


@pytest.mark.parametrize("damage", [None, "free twice", "held twice", "out of range", "lost"])
def test_the_pool_check_shared_by_a_blocks_threads_answers_as_one_thread(checkpoints, damage):
    """check_pool_part's split (the megakernel's SCHEDULE block: 256 threads, warps taking the entries' page tables)
    over any number of threads finds what one thread's check_pool finds, on a pool with pages in several entries'
    tables: OK on a sound pool; ERROR_POOL where a page is twice on the free stack, in two page tables, out of
    range, or lost."""
    host_library()
    ckpt = checkpoints["llama3"]
    shape = ServingShape(max_batch=5, page_size=2, num_pages=40, max_seq=32)
    host = Host(shape, 0, 1.0)
    device = host.device = NativeSchedulerDevice(ckpt.graph, ckpt.weights, shape, host.views, host.notify)
    for rid in range(4):
        host.submit(rid, np.arange(3 + 2 * rid, dtype=np.int32) % VOCAB,
                    dict(request_id=rid, prompt_len=3 + 2 * rid, max_new_tokens=8, temperature=0.0, top_p=1.0))
    host.publish()
    for _ in range(3):
        device.step()
    state = device.state
    held = np.flatnonzero(state["entries"]["num_pages"] > 0)
    assert len(held) >= 2 and state["pool"]["free_count"][0] >= 2
    first, second = (state["page_table"][e] for e in held[:2])
    if damage == "free twice":
        state["free_pages"][0] = state["free_pages"][1]
    elif damage == "held twice":
        first[0] = second[0]
    elif damage == "out of range":
        second[0] = shape.num_pages
    elif damage == "lost":
        state["pool"]["free_count"] -= 1
    want = 0 if damage is None else scheduler.ERROR_POOL
    for threads in (1, 3, 32, 64, 256, 288):
        device.scheduler.state["error"] = 0
        assert device.scheduler.check_pool_split(threads) == want, threads

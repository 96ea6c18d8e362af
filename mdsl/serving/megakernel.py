"""The megakernel serving device (`LLM(..., device="megakernel")`): the scheduler and every step's forward inside
one resident kernel (mdsl.megakernel.runtime.serving_engine), which talks to the host engine only through the
protocol's host region, pinned and mapped into the GPU's address space.

The kernel polls the request queue, the cancel flags and the shutdown word itself, so waking it costs nothing; a
thread of this device launches it, relaunches it where a launch ends at its last step (its event counters' range:
the requests, pages and pools stay in device memory), wakes the host engine's thread whenever the ring holds a
record it has not read or a queue slot was taken, and turns the way a launch stopped into the device's status and
error. docs/design.md ("The megakernel's serving tables") describes the kernel.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import threading
import time
import weakref
from typing import Callable, Mapping, Optional

import numpy as np

from mdsl.errors import MdslError
from mdsl.megakernel.modelgraph.model import ModelGraph
from mdsl.megakernel.modelgraph.model_config import ModelConfig
from mdsl.megakernel.runtime.serving_engine import (ERROR_BAD_LOGITS, HOST_STOP, STATE_BAD_TOKEN, STATE_LAUNCH_END,
                                                    STATE_PROFILE, STATE_SERVE_ERROR, STATE_STOP, STATE_STUCK,
                                                    STATE_WORDS, ServingKernel)
from mdsl.megakernel.runtime.serving_plan import ServingPlan
from mdsl.serving.protocol import FAILED, SERVING, STOPPED, Region, ServingShape, device_region
from mdsl.serving.sampling import NoMaximum
from mdsl.serving.scheduler import STATE, scheduler_error

WATCH_S = 1e-4     # the device thread's look at the ring and the queue while the kernel runs


def pinned_memory(region: Region, device: int = 0) -> np.ndarray:
    """A zeroed buffer of the region's size in page-locked host memory mapped into the GPU's address space (the
    kernel reads and writes it over PCIe), freed once no view of it is left."""
    from mdsl.gpu.driver import check, driver, get_device, release, require_gpu

    require_gpu("the megakernel serving device (device='megakernel')")
    get_device(device)
    flags = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
    pointer = int(check(driver.cuMemHostAlloc(region.size, flags), "cuMemHostAlloc"))
    ctypes.memset(pointer, 0, region.size)
    raw = (ctypes.c_uint8 * region.size).from_address(pointer)
    weakref.finalize(raw, release, functools.partial(driver.cuMemFreeHost, pointer))   # (never inside a capture)
    return np.frombuffer(raw, np.uint8)


def launch_ended(plan: ServingPlan, state: np.ndarray, scheduler_state: np.ndarray) -> bool:
    """Whether a launch that returned ended at its last step, so that the host launches again (False: it stopped,
    on the shutdown word or the host's stop). Raises what stopped it otherwise: a deadlock the watchdog caught (the
    task, its step and the event it waited for), the scheduler's error (`scheduler_state`: its State record, as
    mdsl.serving.scheduler.scheduler_error says), or logits without a maximum."""
    from mdsl.gpu.driver import CudaError

    task, step, event, count, need = (int(v) for v in state[STATE_STUCK])
    if task:
        producers = plan.events[event].producers
        raise CudaError(f"the serving megakernel deadlocked: task {task - 1} ({plan.tasks[task - 1].label()}) of step "
                        f"{step} of its launch waited over 5 s for event {event} (count {count}, needed {need}; "
                        f"producers {list(producers[:8])}{' ...' if len(producers) > 8 else ''}); every worker "
                        "stopped", hint="a bug in mdsl's serving tables or runtime: please report it with this message")
    error = int(state[STATE_SERVE_ERROR])
    if error == ERROR_BAD_LOGITS or state[STATE_BAD_TOKEN]:
        raise NoMaximum()
    if error:
        raise scheduler_error(error, scheduler_state["bad_request"])
    return bool(state[STATE_LAUNCH_END]) and int(state[STATE_STOP]) != HOST_STOP


class MegakernelDevice:
    """Serves requests from the host views (protocol.host_region, in pinned_memory) with one resident kernel of
    the model (config, graph, weights by the graph's names) on GPU `device`."""

    PREFIX_CACHE = False   # (its scheduler, in the kernel, has none)

    @staticmethod
    def host_memory(region: Region) -> np.ndarray:
        return pinned_memory(region)

    def __init__(self, config: ModelConfig, graph: ModelGraph, weights: Mapping, shape: ServingShape, host: dict,
                 notify_host: Callable[[], None], device: int = 0):
        from mdsl.gpu.driver import check, driver, get_device

        get_device(device)
        self.graph, self.shape, self.host, self.device = graph, shape, host, device
        pointer = host["control"].ctypes.data   # (the region's start: control is its first array)
        mapped = int(check(driver.cuMemHostGetDevicePointer(pointer, 0), "cuMemHostGetDevicePointer"))
        self.kernel = ServingKernel(config, graph, weights, shape, host_region=mapped, device=device)
        host["control"]["free_pages"] = shape.num_pages
        self._notify_host = notify_host
        flags = int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)   # (beside the stop word's copy)
        self._stream = check(driver.cuStreamCreate(flags), "cuStreamCreate")
        self._stop_stream = check(driver.cuStreamCreate(flags), "cuStreamCreate")
        self._stopping = False
        self.error: Optional[BaseException] = None
        self.launches = 0
        self._thread = threading.Thread(target=self._run, name="mdsl-megakernel-device", daemon=True)

    # ---- what the host engine calls

    def start(self) -> None:
        self._thread.start()
        # a resident kernel left running would hold the process's exit (the context's teardown waits for it)
        atexit.register(self.stop, 5.0)

    def wake(self) -> None:
        """Nothing: the kernel polls the queue, the cancel flags, the shutdown word and the ring's reads itself."""

    def resume(self) -> None:
        """Nothing: the kernel is never held."""

    def _state_word(self, index: int, value: int) -> None:
        """Write a state word of the running kernel (on a stream of its own, beside the kernel's)."""
        from mdsl.gpu.driver import check, driver

        word = np.array([value], np.int32)
        check(driver.cuMemcpyHtoDAsync(self.kernel.params.state + 4 * index, word.ctypes.data, 4, self._stop_stream),
              "cuMemcpyHtoDAsync")
        check(driver.cuStreamSynchronize(self._stop_stream), "cuStreamSynchronize")

    def stop(self, timeout: float) -> None:
        """Leave now, whatever is admitted: every worker leaves at its next wait (HOST_STOP in the stop word)."""
        self._stopping = True
        if self._thread.is_alive():
            self._state_word(STATE_STOP, HOST_STOP)
        self.join(timeout)

    def profile(self, on: bool) -> None:
        """Profile the kernel's tasks from now on (on) or no longer: their SMs and times go into a ring of the last
        serving_source.PROFILE_STEPS steps (profile_records reads it)."""
        self._state_word(STATE_PROFILE, int(on))

    def profile_records(self) -> dict:
        """{step of the launch: [TaskRecord]} of the ring's complete steps (profile.summary and layer_phases read
        them with the plan's kinds and layers: profile_tasks). Read after profile(False) and a step or two, so that
        no record is being written."""
        k = self.kernel
        return k.profile_records(k.copy_out(k.params.profile, k.layout()["profile"].nbytes, self._stop_stream))

    def profile_tasks(self) -> tuple:
        """(labels, kinds, layers) of a step's tasks, in the records' order."""
        tasks = self.kernel.plan.tasks
        return (tuple(t.label() for t in tasks), tuple(t.kind.name.lower() for t in tasks),
                tuple(t.layer for t in tasks))

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    prefix = None   # (no prefix cache: the kernel's scheduler has none)

    def take_cached_tokens(self, request_id: int) -> int:
        """The prompt tokens a request found in the prefix cache: none here (the kernel's scheduler has none)."""
        return 0

    def queued(self) -> int:
        """Requests published in the queue and not yet taken."""
        queue, taken = self.host["queue"], int(self.host["control"]["queue_taken"][0])
        n = 0
        while n < len(queue) and int(queue["seq"][(taken + n) % len(queue)]) == taken + n + 1:
            n += 1
        return n

    def device_state(self) -> dict:
        """A copy of the protocol's device region (entries, page tables, histories, the pool), once the kernel has
        stopped (tests and debugging)."""
        if self._thread.is_alive():
            raise MdslError("the device region is read once the serving kernel has stopped",
                            hint="close the LLM first")
        region = device_region(self.shape)
        return region.views(self.kernel.copy_out(self.kernel.params.device_state, region.size, self._stream))

    # ---- the device thread

    def _run(self) -> None:
        from mdsl.gpu.driver import get_device

        control = self.host["control"]
        try:
            get_device(self.device)
            control["status"] = SERVING
            while not self._stopping:
                self.kernel.launch(self._stream)
                self.launches += 1
                self._watch()
                state = self.kernel.copy_out(self.kernel.params.state, 4 * STATE_WORDS, self._stream).view(np.int32)
                workspace = self.kernel.copy_out(self.kernel.params.workspace, STATE.size, self._stream)
                if not launch_ended(self.kernel.plan, state, workspace.view(STATE.dtype())[0]):
                    break
            control["status"] = STOPPED
        except BaseException as e:   # the host turns it into an error on every unfinished request
            self.error = e
            control["status"] = FAILED
        self._notify_host()

    def _watch(self) -> None:
        """Until the launch returns: wake the host whenever the ring holds a record it has not read or the kernel
        took a queue slot."""
        from mdsl.gpu.driver import CudaError, driver, error_text

        control, ring = self.host["control"], self.host["ring"]
        taken = int(control["queue_taken"][0])
        while True:
            (result,) = driver.cuStreamQuery(self._stream)
            if result == driver.CUresult.CUDA_SUCCESS:
                return
            if result != driver.CUresult.CUDA_ERROR_NOT_READY:
                raise CudaError(f"the serving megakernel failed: {error_text(result)}")
            read, now_taken = int(control["ring_read"][0]), int(control["queue_taken"][0])
            if int(ring["seq"][read % len(ring)]) == read + 1 or now_taken != taken:
                taken = now_taken
                self._notify_host()
            time.sleep(WATCH_S)

    def close(self) -> None:
        self.kernel.close()

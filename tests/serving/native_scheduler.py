"""The serving scheduler's C++ (mdsl/serving/scheduler.cuh) built for the host, and the CPU device that it
schedules.

The host build is the protocol's structs (c_layouts), scheduler.cuh and the C entry points of
scheduler_host.cpp, compiled by the system C++ compiler (`$CXX`, else c++, g++ or clang++) into a shared
library at first use, through mdsl.gpu.launcher's cached build (written atomically, checked on load), in
the test run's shared directory (tests/shared.py) so that every test process builds it once at most.
`NativeSchedulerDevice` is CpuDevice with its step's scheduling done by that library over the same views;
its forward and sampling are CpuDevice's. It lives with the tests: the engine has no use for a host-side
C++ scheduler, whose purpose is proving the megakernel's scheduler equal to the Python one.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from mdsl.gpu.cache import cache_root
from mdsl.gpu.launcher import cached_library, find_compiler
from mdsl.serving.cpu import IDLE_WAIT_S, CpuDevice, _Stop
from mdsl.serving.protocol import ServingShape, c_layouts
from mdsl.serving.scheduler import STATE, scheduler_error, scheduler_source, workspace_bytes
from tests.shared import shared_dir

HOST_SOURCE = Path(__file__).with_name("scheduler_host.cpp")
HOST_ARRAYS = ("control", "queue", "ring", "cancel", "prompts")
DEVICE_ARRAYS = ("entries", "page_table", "history", "pool", "free_pages", "step", "chunks", "rows")

_LIBRARY: dict = {}


def host_source() -> bytes:
    return "\n".join(["#include <cstddef>", c_layouts(), scheduler_source(), HOST_SOURCE.read_text()]).encode()


def _load(path: Path, ident: str):
    lib = ctypes.CDLL(str(path))
    lib.mdsl_scheduler_id.restype = ctypes.c_char_p
    found = lib.mdsl_scheduler_id()
    if found != ident.encode():
        raise RuntimeError(f"{path} is build {found!r}, not {ident}")
    lib.mdsl_scheduler_state_layout.argtypes, lib.mdsl_scheduler_state_layout.restype = [ctypes.c_int], ctypes.c_int64
    offsets = [lib.mdsl_scheduler_state_layout(i) for i in range(len(STATE.fields))]
    if lib.mdsl_scheduler_state_layout(-1) != STATE.size or offsets != list(STATE.offsets.values()):
        raise RuntimeError(f"{path} lays out sched::State as {offsets}, mdsl.serving.scheduler.STATE as "
                           f"{list(STATE.offsets.values())}")
    pointers, sizes = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint32)
    lib.mdsl_scheduler_workspace_bytes.argtypes, lib.mdsl_scheduler_workspace_bytes.restype = [sizes], ctypes.c_uint64
    for name in ("begin", "flush"):
        function = getattr(lib, f"mdsl_scheduler_{name}")
        function.argtypes, function.restype = [pointers, sizes], ctypes.c_uint32
    lib.mdsl_scheduler_check_pool_split.argtypes = [pointers, sizes, ctypes.c_uint32]
    lib.mdsl_scheduler_check_pool_split.restype = ctypes.c_uint32
    lib.mdsl_scheduler_end.argtypes = [pointers, sizes, ctypes.POINTER(ctypes.c_int32)]
    lib.mdsl_scheduler_end.restype = ctypes.c_uint32
    return lib


def host_library():
    """The scheduler's host build, built once; skips the calling test where it cannot be had (no C++
    compiler), saying why."""
    if "lib" not in _LIBRARY:
        folder = (shared_dir() or cache_root()) / "scheduler"
        try:
            _LIBRARY["lib"] = cached_library(host_source(), lambda ident: folder / f"scheduler-{ident}.so", _load,
                                             find_compiler("CXX", ("c++", "g++", "clang++")), language="c++",
                                             id_macro="MDSL_SCHEDULER_ID", flags=("-std=c++17",),
                                             what="C++ compiler")
        except RuntimeError as e:
            _LIBRARY["lib"], _LIBRARY["why"] = None, str(e)
    if _LIBRARY["lib"] is None:
        pytest.skip(f"the scheduler's host build cannot be had: {_LIBRARY['why']}")
    return _LIBRARY["lib"]


def sizes_of(shape: ServingShape) -> list:
    """sched::Sizes' nine words."""
    return [shape.max_batch, shape.page_size, shape.num_pages, shape.max_seq, shape.max_tokens_per_step,
            shape.queue_slots, shape.ring_records, shape.handles, shape.pages_per_request]


class NativeScheduler:
    """The C++ scheduler over a device's views: `host` (the host region's) and `state` (the device
    region's), with a workspace of its own. Each call raises the ServingError of an error it answers."""

    def __init__(self, lib, shape: ServingShape, host: dict, state: dict):
        self.lib = lib
        self.workspace = np.zeros(workspace_bytes(shape), np.uint8)
        self.state = self.workspace[:STATE.size].view(STATE.dtype())
        arrays = [host[name] for name in HOST_ARRAYS] + [state[name] for name in DEVICE_ARRAYS] + [self.workspace]
        assert all(a.flags.c_contiguous for a in arrays)
        self._arrays = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
        self._sizes = (ctypes.c_uint32 * 9)(*sizes_of(shape))
        self._tokens = (ctypes.c_int32 * shape.max_batch)()

    def _check(self, code: int) -> None:
        if code:
            raise scheduler_error(code, self.state["bad_request"][0])

    def begin(self) -> None:
        self._check(self.lib.mdsl_scheduler_begin(self._arrays, self._sizes))

    def end(self, tokens) -> None:
        """`tokens`: the sampled token by chunk (the chunks that do not sample: anything)."""
        self._tokens[:len(tokens)] = tokens
        self._check(self.lib.mdsl_scheduler_end(self._arrays, self._sizes, self._tokens))

    def check_pool_split(self, threads: int) -> int:
        """The pool's check shared by `threads` threads (run one after another): OK or ERROR_POOL."""
        return self.lib.mdsl_scheduler_check_pool_split(self._arrays, self._sizes, threads)

    def flush(self) -> int:
        """Publishes what the ring has room for; the records still staged."""
        return self.lib.mdsl_scheduler_flush(self._arrays, self._sizes)

    @property
    def worked(self) -> bool:
        return bool(self.state["worked"][0])

    @property
    def tell_host(self) -> bool:
        return bool(self.state["tell_host"][0])


class NativeSchedulerDevice(CpuDevice):
    """CpuDevice whose steps the C++ scheduler plans and records: begin_step, the forward and sampling of
    CpuDevice, end_step, then the records into the ring, waiting for the host where it is full as
    CpuDevice._emit waits."""

    PREFIX_CACHE = False   # (the C++ scheduler has none)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.shape.step_rows == self.shape.max_tokens_per_step, "the C++ scheduler has one token budget"
        self.scheduler = NativeScheduler(host_library(), self.shape, self.host, self.state)

    def _step(self, tell_early: bool = False) -> bool:
        scheduler = self.scheduler
        scheduler.begin()
        scheduler.flush()            # what the ring has room for now: the host reads it during the forward
        chosen = self._run_chunks() if self.state["step"]["num_rows"][0] else {}
        scheduler.end([chosen.get(c, -1) for c in range(int(self.state["step"]["num_chunks"][0]))])
        while scheduler.flush():
            if self._stop:
                raise _Stop()
            self._notify_host()
            self._bell.wait(IDLE_WAIT_S)
        if scheduler.tell_host:
            self._notify_host()
        return scheduler.worked

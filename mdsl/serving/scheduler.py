"""The serving scheduler's C++ (scheduler.cuh and its parts beside this module): its source as one text,
its workspace's size, and the errors its answers stand for.

The same source is the megakernel's scheduler (NVRTC, `__device__` functions run by one thread at every
step boundary) and, compiled by the host's C++ compiler, what the tests run beside the CPU device's
Python scheduler (tests/serving/native_scheduler.py). docs/design.md ("Serving") describes it.
"""
from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from mdsl.serving.params import ServingError
from mdsl.serving.protocol import REQUEST, RING_RECORD, U32, U64, Field, Layout, ServingShape

_HERE = Path(__file__).parent
_INCLUDE = re.compile(r'^#include "(scheduler_[a-z]+\.cuh)"\n', re.MULTILINE)

# scheduler_base.cuh's answers
OK, ERROR_REQUEST, ERROR_POOL, ERROR_UNFLUSHED, ERROR_BOUNDS = range(5)


@cache
def scheduler_source(regions: bool = False) -> str:
    """scheduler.cuh with its parts expanded in place; with `regions`, scheduler_regions.cuh after it (which
    needs c_declarations(shape) before it). The protocol's structs (protocol.c_layouts or c_declarations)
    go first."""
    text = _INCLUDE.sub(lambda m: (_HERE / m.group(1)).read_text(), (_HERE / "scheduler.cuh").read_text())
    assert not _INCLUDE.search(text)
    return text + ((_HERE / "scheduler_regions.cuh").read_text() if regions else "")


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


# scheduler_base.cuh's sched::State, at the start of the workspace (the host build checks its offsets)
STATE = Layout("State", [
    Field("written", U64),           # ring records published
    Field("staged", U32), Field("flushed", U32),   # the step's records staged, and published of those
    Field("worked", U32),            # begin_step cancelled, admitted or planned something
    Field("tell_host", U32),         # the step wrote a record or took a queue slot
    Field("error", U32),             # the first error (ERROR_*)
    Field("stamp", U32),             # the pool check's mark
    Field("peak_running", U32),      # the control block's device words as last written
    Field("cancels_seen", U32),      # the host's count of cancel flags at the last scan
    Field("queue_taken", U64), Field("steps", U64), Field("preemptions", U64), Field("tokens", U64),
    Field("bad_request", REQUEST),   # ERROR_REQUEST: the request
], "the scheduler's own state")


def stage_capacity(shape: ServingShape) -> int:
    """Records a step stages at most (scheduler_base.cuh's stage_capacity says why)."""
    return 2 * shape.max_batch + shape.queue_slots


def workspace_bytes(shape: ServingShape) -> int:
    """The scheduler's workspace (its state, staged records and scratch), as scheduler_base.cuh lays it out."""
    at = _round_up(STATE.size, 32) + RING_RECORD.size * stage_capacity(shape)
    return _round_up(at + 4 * (4 * shape.max_batch + shape.num_pages), 128)


def broken_request(request) -> ServingError:
    """A request whose fields break the protocol (prompt_len, max_new_tokens, handle or num_stop out of
    range): `request` is a REQUEST record."""
    return ServingError(f"request {int(request['request_id'])} breaks the protocol: prompt_len "
                        f"{int(request['prompt_len'])}, max_new_tokens {int(request['max_new_tokens'])}, handle "
                        f"{int(request['handle'])}, num_stop {int(request['num_stop'])}")


def damaged_pool() -> ServingError:
    return ServingError("the page pool lost or duplicated a page")


def scheduler_error(code: int, bad_request=None) -> ServingError:
    """The error the scheduler's answer `code` stands for; `bad_request`: State::bad_request (ERROR_REQUEST)."""
    if code == ERROR_REQUEST:
        return broken_request(bad_request)
    if code == ERROR_POOL:
        return damaged_pool()
    if code == ERROR_UNFLUSHED:
        return ServingError("the scheduler began a step before the last step's ring records were published",
                            hint="call flush_records until it answers 0 before begin_step")
    if code == ERROR_BOUNDS:
        return ServingError("the scheduler's state is damaged: a page table, a history or the step's rows would "
                            "be written past its end")
    return ServingError(f"the scheduler answered {code}, which is no error it knows")

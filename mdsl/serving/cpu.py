"""The CPU device: the device side of the serving protocol in numpy, one step at a time in a thread.

It does what the megakernel's in-kernel scheduler is specified to do (docs/design.md, "Serving"):
cancel, grow pages (preempting the youngest request when the pool is empty), admit, run every running
request one position, sample, stream, retire. Each request's position runs alone through the model
graph's op references (mdsl.megakernel.modelgraph.layers) with its KV cache gathered from its pages, so its
logits are bit-identical to `ReferenceModel`'s whatever else is in the batch: no batched matmul whose
summation order could depend on the batch."""
from __future__ import annotations

import math
import threading
from typing import Callable, Optional

import numpy as np

from mdsl.errors import UnsupportedError
from mdsl.megakernel.modelgraph.layers import StepContext
from mdsl.megakernel.modelgraph.model import TOKENS, ModelGraph
from mdsl.serving.params import ServingError
from mdsl.serving.protocol import (FAILED, FINISHED, FREE, HAS_TOKEN, MAX_STOP, PREEMPTED, REASON_CANCELLED,
                                   REASON_LENGTH, REASON_NONE, REASON_STOP, RUNNING, SERVING, STOPPED,
                                   WAS_PREEMPTED, ServingShape, device_region, kv_pool_shape)
from mdsl.serving.sampling import sample

IDLE_WAIT_S = 0.05     # the longest an idle device sleeps between looks at the queue and the control words


class Doorbell:
    """A wake-up between threads: `wait` returns when rung (or at the timeout); what the ringer wrote
    before ringing is visible to the waiter, who then looks at the shared memory itself."""

    def __init__(self):
        self._event = threading.Event()

    def ring(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)
        self._event.clear()


class _Stop(Exception):
    """The host stopped the device while it waited for room in the ring."""


def serving_nodes(graph: ModelGraph) -> tuple:
    """(the nodes that compute the logits, the KV-cache states): every node but the one choosing the
    token; the caches are the states other than the token history."""
    chooser = [n for n in graph.nodes if graph.token in n.outputs]
    nodes = tuple(n for n in graph.nodes if n not in chooser)
    if not any(graph.logits in n.outputs for n in nodes):
        raise UnsupportedError(f"model {graph.name} computes its logits in the node that chooses the token",
                               hint="serve the unfused model graph (its step function's trace)")
    caches = tuple(s for s in graph.states if s.name != TOKENS)
    names = {s.name for s in caches}
    for n in nodes:
        for i in n.opdef.state_inputs:
            if n.inputs[i].name not in names:
                raise UnsupportedError(f"layer op {n.op} updates {n.inputs[i].name}, which serving does not page",
                                       hint="the serving engine pages KV caches [positions, ...] written at the "
                                            "step's position only")
    return nodes, caches


def kv_bytes_per_token(graph: ModelGraph) -> int:
    """The CPU device's KV pool bytes per cached position (float32 rows of every cache)."""
    return sum(4 * math.prod(s.shape[1:]) for s in serving_nodes(graph)[1])


class CpuDevice:
    """Serves requests from the host views (protocol.host_region) with the model graph and weights."""

    def __init__(self, graph: ModelGraph, weights: dict, shape: ServingShape, host: dict,
                 notify_host: Callable[[], None]):
        self.graph, self.shape, self.host = graph, shape, host
        self.nodes, caches = serving_nodes(graph)
        self.weights = {w.name: np.asarray(weights[w.name], np.float32) for w in graph.weights}
        region = device_region(shape)
        self.state = region.views(region.allocate())
        self.kv = {s.name: np.zeros(kv_pool_shape(shape, *s.shape[1:]), np.float32) for s in caches}
        # per node: its reference, attributes, operand names, which operands are paged caches, result names
        self._program = [(n.opdef.reference, n.attr_dict, [v.name for v in n.inputs],
                          [i for i, v in enumerate(n.inputs) if v.name in self.kv], [v.name for v in n.outputs])
                         for n in self.nodes]
        pool = self.state["pool"]
        pool["num_pages"], pool["page_size"], pool["free_count"] = shape.num_pages, shape.page_size, shape.num_pages
        self.state["free_pages"][:] = np.arange(shape.num_pages, dtype=np.int32)[::-1]   # page 0 on top
        self.state["page_table"][:] = -1
        host["control"]["free_pages"] = shape.num_pages
        self._written = 0                 # ring records written
        self._tell_host = False
        self._notify_host = notify_host
        self._bell = Doorbell()
        self._step_lock = threading.Lock()
        self._held = False
        self._stop = False
        self.error: Optional[BaseException] = None
        # position -> logits rows, per request id, while `record_logits` (tests compare them)
        self.record_logits = False
        self.logits: dict = {}
        self._thread = threading.Thread(target=self._run, name="mdsl-cpu-device", daemon=True)

    # ---- what the host engine calls

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """The host published a request, set a cancel flag or the shutdown word, or read ring records."""
        self._bell.ring()

    def stop(self, timeout: float) -> None:
        """Leave now, whatever is admitted (after the shutdown word, for a device that cannot drain)."""
        self._stop = True
        self.wake()
        self.join(timeout)

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- for tests and debugging: hold the thread and run steps by hand

    def hold(self) -> None:
        """The thread runs no step until `resume`; `step` runs one in the caller's thread."""
        self._held = True
        with self._step_lock:     # a step under way finishes first
            pass

    def resume(self) -> None:
        self._held = False
        self.wake()

    def step(self) -> bool:
        """One scheduler step; whether anything happened (a request ran, was admitted or retired)."""
        with self._step_lock:
            return self._step()

    def queued(self) -> int:
        """Requests published in the queue and not yet taken."""
        queue, taken = self.host["queue"], int(self.host["control"]["queue_taken"][0])
        n = 0
        while n < len(queue) and int(queue["seq"][(taken + n) % len(queue)]) == taken + n + 1:
            n += 1
        return n

    # ---- the loop

    def _run(self) -> None:
        control = self.host["control"]
        control["status"] = SERVING
        try:
            while not self._stop:
                worked = False
                if not self._held:
                    with self._step_lock:
                        worked = self._step()
                if control["shutdown"][0] and not np.any(self.state["entries"]["state"] != FREE):
                    break
                if not worked:
                    self._bell.wait(IDLE_WAIT_S)
            control["status"] = STOPPED
        except _Stop:
            control["status"] = STOPPED
        except BaseException as e:   # the host turns it into an error on every unfinished request
            self.error = e
            control["status"] = FAILED
        self._notify_host()

    def _step(self) -> bool:
        entries, control = self.state["entries"], self.host["control"]
        self._tell_host = False
        worked = self._cancel()
        if not self._grow_pages():     # a step that had to preempt admits nothing
            worked = self._admit() or worked
        running = np.flatnonzero(entries["state"] == RUNNING)
        for e in running:
            self._advance(int(e))
        control["running"] = len(running)
        if len(running):
            control["steps"] += 1
            control["peak_running"] = max(int(control["peak_running"][0]), len(running))
        control["free_pages"] = self.state["pool"]["free_count"][0]
        self._check_pool()
        if self._tell_host:
            self._notify_host()
        return worked or len(running) > 0

    # ---- the scheduler's parts

    def _cancel(self) -> bool:
        entries, cancel = self.state["entries"], self.host["cancel"]
        found = False
        for e in np.flatnonzero(entries["state"] != FREE):
            req = entries["request"][e]
            if cancel[req["handle"]]:
                self._emit(req["request_id"], -1, req["prompt_len"] + entries["generated"][e], FINISHED,
                           REASON_CANCELLED)
                self._release(int(e))
                found = True
        return found

    def _grow_pages(self) -> bool:
        """A page for every running request whose next position starts one, oldest first; when none is
        free, the youngest running request is preempted (perhaps the one in need). Whether any was."""
        entries, pool = self.state["entries"], self.state["pool"]
        preempted = False
        for e in self._by_age(RUNNING):
            if entries["state"][e] != RUNNING or entries["context"][e] < entries["num_pages"][e] * self.shape.page_size:
                continue
            while pool["free_count"][0] == 0:
                victim = self._by_age(RUNNING)[-1]
                self._preempt(victim)
                preempted = True
                if victim == e:
                    break
            if entries["state"][e] == RUNNING:
                self._take_page(e)
        return preempted

    def _admit(self) -> bool:
        """Preempted requests (oldest first), then the queue in order, while an entry and the pages for
        the request's known tokens are free; the first that cannot be admitted stops admission."""
        entries, pool = self.state["entries"], self.state["pool"]
        admitted = False
        for e in self._by_age(PREEMPTED):
            known = entries["request"]["prompt_len"][e] + entries["generated"][e]
            if pool["free_count"][0] < self._pages_for(known):
                return admitted
            entries["state"][e] = RUNNING
            self._take_page(e)
            admitted = True
        control, queue = self.host["control"], self.host["queue"]
        while True:
            k = int(control["queue_taken"][0])
            slot = queue[k % len(queue)]
            if int(slot["seq"]) != k + 1:
                return admitted
            req = slot["request"].copy()
            self._check_request(req)
            if self.host["cancel"][req["handle"]]:      # cancelled while queued: finished without an entry
                control["queue_taken"] = k + 1
                self._emit(req["request_id"], -1, req["prompt_len"], FINISHED, REASON_CANCELLED)
                admitted = True
                continue
            free = np.flatnonzero(entries["state"] == FREE)
            if not len(free) or pool["free_count"][0] < self._pages_for(req["prompt_len"]):
                return admitted
            e = int(free[0])
            entries["request"][e] = req
            entries["arrival"][e], entries["context"][e], entries["generated"][e] = k, 0, 0
            entries["state"][e] = RUNNING
            n = int(req["prompt_len"])
            self.state["history"][e, :n] = self.host["prompts"][req["handle"], :n]
            control["queue_taken"] = k + 1             # the slot is copied: the host may reuse it
            self._tell_host = True
            self._take_page(e)
            admitted = True

    def _advance(self, e: int) -> None:
        """Run entry e's next position; past its known tokens, sample and stream the next one."""
        entries = self.state["entries"]
        req = entries["request"][e]
        pos, prompt_len, generated = int(entries["context"][e]), int(req["prompt_len"]), int(entries["generated"][e])
        logits = self._forward(e, pos, prompt_len)
        if self.record_logits:
            self.logits.setdefault(int(req["request_id"]), {}).setdefault(pos, []).append(logits)
        entries["context"][e] = pos + 1
        if pos + 1 < prompt_len + generated:          # the next token is known: the prompt's, or one recomputed
            return
        token = sample(logits, temperature=float(req["temperature"]), top_k=int(req["top_k"]),
                       top_p=float(req["top_p"]), seed=int(req["seed"]), position=pos)
        self.state["history"][e, pos + 1] = token
        entries["generated"][e] = generated + 1
        if token in req["stop_ids"][:req["num_stop"]]:
            reason = REASON_STOP
        elif generated + 1 >= req["max_new_tokens"]:
            reason = REASON_LENGTH
        else:
            reason = REASON_NONE
        self._emit(req["request_id"], token, pos + 1, HAS_TOKEN | (FINISHED if reason else 0), reason)
        if reason:
            self._release(e)

    def _forward(self, e: int, pos: int, prompt_len: int) -> np.ndarray:
        """The logits at `pos` of entry e: the graph's op references on this request's row alone, each KV
        cache operand gathered from its pages (rows laid out as the contiguous cache's) and the row the op
        writes at `pos` put back into its page."""
        ps = self.shape.page_size
        table = self.state["page_table"][e]
        n, page, row = pos // ps + 1, table[pos // ps], pos % ps
        ctx = StepContext(pos, prompt_len)
        values = dict(self.weights)
        values[TOKENS] = self.state["history"][e]
        for reference, attrs, names, caches, results in self._program:
            ins = [values[name] if i not in caches else
                   self.kv[name][table[:n]].reshape(n * ps, *self.kv[name].shape[2:]) for i, name in enumerate(names)]
            outs = reference(ins, attrs, ctx)
            for i in caches:
                self.kv[names[i]][page, row] = ins[i][pos]
            values.update(zip(results, outs))
        return np.asarray(values[self.graph.logits.name], np.float32).reshape(-1)

    # ---- pages, entries, records

    def _by_age(self, state: int) -> list:
        entries = self.state["entries"]
        found = np.flatnonzero(entries["state"] == state)
        return [int(e) for e in found[np.argsort(entries["arrival"][found], kind="stable")]]

    def _pages_for(self, tokens) -> int:
        return -(-int(tokens) // self.shape.page_size)

    def _take_page(self, e: int) -> None:
        pool, entries = self.state["pool"], self.state["entries"]
        top = int(pool["free_count"][0]) - 1
        k = int(entries["num_pages"][e])
        self.state["page_table"][e, k] = self.state["free_pages"][top]
        pool["free_count"] = top
        entries["num_pages"][e] = k + 1

    def _free_pages(self, e: int) -> None:
        pool, entries = self.state["pool"], self.state["entries"]
        k, top = int(entries["num_pages"][e]), int(pool["free_count"][0])
        self.state["free_pages"][top:top + k] = self.state["page_table"][e, k - 1::-1] if k else []
        self.state["page_table"][e, :k] = -1
        pool["free_count"] = top + k
        entries["num_pages"][e] = 0

    def _preempt(self, e: int) -> None:
        """Free e's pages; it keeps its entry and history, and recomputes its tokens when re-admitted."""
        entries = self.state["entries"]
        req = entries["request"][e]
        self._free_pages(e)
        entries["state"][e], entries["context"][e] = PREEMPTED, 0
        self.host["control"]["preemptions"] += 1
        self._emit(req["request_id"], -1, req["prompt_len"] + entries["generated"][e], WAS_PREEMPTED, REASON_NONE)

    def _release(self, e: int) -> None:
        self._free_pages(e)
        self.state["entries"]["state"][e] = FREE

    def _emit(self, request_id, token, position, flags: int, reason: int) -> None:
        """Ring record n: its fields, then its sequence word; wait while the host has not read record n - R."""
        ring, control = self.host["ring"], self.host["control"]
        while self._written - int(control["ring_read"][0]) >= len(ring):
            if self._stop:
                raise _Stop()
            self._notify_host()
            self._bell.wait(IDLE_WAIT_S)
        rec = ring[self._written % len(ring)]
        rec["request_id"], rec["token"], rec["position"] = request_id, token, position
        rec["flags"], rec["reason"] = flags, reason
        rec["seq"] = self._written + 1
        self._written += 1
        self._tell_host = True

    def _check_request(self, req) -> None:
        """The host's side of the contract, checked before the device relies on it."""
        n, new = int(req["prompt_len"]), int(req["max_new_tokens"])
        if not (0 < n and 0 < new and n + new <= self.shape.max_seq and req["handle"] < self.shape.handles
                and req["num_stop"] <= MAX_STOP and self._pages_for(n + new - 1) <= self.shape.num_pages):
            raise ServingError(f"request {int(req['request_id'])} breaks the protocol: prompt_len {n}, max_new_tokens "
                               f"{new}, handle {int(req['handle'])}, num_stop {int(req['num_stop'])}")

    def _check_pool(self) -> None:
        """Every page is either free or in exactly one admitted request's page table."""
        entries, pool = self.state["entries"], self.state["pool"]
        held = [self.state["page_table"][e, :entries["num_pages"][e]] for e in range(self.shape.max_batch)]
        pages = np.concatenate([self.state["free_pages"][:pool["free_count"][0]], *held])
        if len(pages) != self.shape.num_pages or len(np.unique(pages)) != self.shape.num_pages:
            raise ServingError("the page pool lost or duplicated a page")

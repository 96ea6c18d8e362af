"""The serving protocol between the host engine and a device, defined once.

Every structure the two sides share is a `Layout`: fields with a C type, an array count and an offset
under the C ABI's natural alignment (x86-64 and CUDA agree). From the same table the host builds numpy
structured dtypes (views over one buffer) and a device its C structs (`c_declarations`), so the two
cannot disagree on a field's place. docs/design.md ("Serving") gives the protocol's rules.

Host memory (pinned and device-mapped on a GPU; `host_region`): the control words, the request queue,
the token ring, a cancel flag and a prompt row per request handle. Device memory (`device_region`):
the batch's entries, their page tables and token histories, the page pool's free list, and the step's
work: its chunks (a run of consecutive positions of one request) and its token rows, which the
scheduler writes and the compute tasks read. The KV pool itself is the model's (`kv_pool_shape`).
"""
from __future__ import annotations

import math
from typing import Union

import attrs
import numpy as np

# C scalar type -> numpy type (little-endian, the layouts' byte order on both sides)
SCALARS = {"int": "<i4", "unsigned int": "<u4", "long long": "<i8", "unsigned long long": "<u8", "float": "<f4"}
REGION_ALIGN = 128               # every array of a region starts on its own 128-byte line (a GPU L2 line)

MAX_STOP = 16                    # stop token ids per request (the user's, plus the checkpoint's EOS)
DEFAULT_MAX_TOKENS_PER_STEP = 256   # the LLM's default token budget of a step (its docstring says why)
DEFAULT_MAX_PREFILL_TOKENS = 1024   # ... and of a step of prompt chunks alone on the GPU device (likewise)

# entry states (ENTRY.state)
FREE, RUNNING, PREEMPTED = 0, 1, 2
# ring record flags (RING_RECORD.flags)
HAS_TOKEN, FINISHED, WAS_PREEMPTED = 1, 2, 4
# finish reasons (RING_RECORD.reason); the host names them
REASON_NONE, REASON_STOP, REASON_LENGTH, REASON_CANCELLED = 0, 1, 2, 3
REASONS = {REASON_STOP: "stop", REASON_LENGTH: "length", REASON_CANCELLED: "cancelled"}
# device status (CONTROL.status)
STARTING, SERVING, STOPPED, FAILED = 0, 1, 2, 3
STATUSES = {STARTING: "starting", SERVING: "serving", STOPPED: "stopped", FAILED: "failed"}


@attrs.frozen
class Field:
    """One member: a scalar C type (SCALARS) or a nested Layout; `count` > 1 makes it an array."""

    name: str
    ctype: Union[str, "Layout"]
    count: int = 1

    @property
    def align(self) -> int:
        return self.ctype.align if isinstance(self.ctype, Layout) else np.dtype(SCALARS[self.ctype]).itemsize

    @property
    def size(self) -> int:
        one = self.ctype.size if isinstance(self.ctype, Layout) else np.dtype(SCALARS[self.ctype]).itemsize
        return one * self.count


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


@attrs.frozen
class Layout:
    """A C struct: its fields in order, each at the next offset its alignment allows."""

    name: str
    fields: tuple = attrs.field(converter=tuple)
    doc: str = ""

    @property
    def align(self) -> int:
        return max(f.align for f in self.fields)

    @property
    def offsets(self) -> dict:
        out, at = {}, 0
        for f in self.fields:
            at = _round_up(at, f.align)
            out[f.name] = at
            at += f.size
        return out

    @property
    def size(self) -> int:
        last = self.fields[-1]
        return _round_up(self.offsets[last.name] + last.size, self.align)

    def dtype(self) -> np.dtype:
        """The numpy structured dtype with the same offsets and size."""
        formats = []
        for f in self.fields:
            base = f.ctype.dtype() if isinstance(f.ctype, Layout) else np.dtype(SCALARS[f.ctype])
            formats.append((base, (f.count,)) if f.count > 1 else base)
        offsets = self.offsets
        return np.dtype({"names": [f.name for f in self.fields], "formats": formats,
                         "offsets": [offsets[f.name] for f in self.fields], "itemsize": self.size})

    def c_struct(self) -> str:
        lines = [f"// {self.doc}"] if self.doc else []
        lines.append(f"struct {self.name} {{")
        for f in self.fields:
            ctype = f.ctype.name if isinstance(f.ctype, Layout) else f.ctype
            lines.append(f"  {ctype} {f.name}{f'[{f.count}]' if f.count > 1 else ''};")
        lines.append("};")
        lines.append(f'static_assert(sizeof({self.name}) == {self.size}, "{self.name}: the host\'s size");')
        # NVRTC has no offsetof: the offsets are asserted where <cstddef> defines it (a host compiler's check;
        # CUDA lays these types out as the host does)
        lines.append("#ifdef offsetof")
        lines += [f'static_assert(offsetof({self.name}, {name}) == {at}, "{self.name}.{name}");'
                  for name, at in self.offsets.items()]
        lines.append("#endif")
        return "\n".join(lines)


U64, I64, U32, I32, F32 = "unsigned long long", "long long", "unsigned int", "int", "float"

REQUEST = Layout("Request", [
    Field("request_id", U64), Field("seed", U64),
    Field("handle", U32),            # the request's row of the prompt arena and index of its cancel flag
    Field("prompt_len", U32), Field("max_new_tokens", U32),
    Field("top_k", U32),             # 0: every token
    Field("temperature", F32),       # 0: greedy
    Field("top_p", F32),             # 1: every token
    Field("num_stop", U32), Field("stop_ids", I32, MAX_STOP),
], "a request as the host submits it; the device copies it whole into its entry")

QUEUE_SLOT = Layout("QueueSlot", [
    Field("seq", U64),               # k + 1 once request k is in the slot; written last
    Field("request", REQUEST),
], "request queue slot k % Q (host writes, device reads)")

RING_RECORD = Layout("RingRecord", [
    Field("seq", U64),               # n + 1 once record n is in the slot; written last
    Field("request_id", U64),
    Field("token", I32),             # the new token (flags & HAS_TOKEN), else -1
    Field("position", U32),          # the token's position in its sequence (prompt_len + tokens before it)
    Field("flags", U32),             # HAS_TOKEN | FINISHED | WAS_PREEMPTED
    Field("reason", U32),            # the finish reason when FINISHED
], "token ring record n % R (device writes, host reads)")

CONTROL = Layout("Control", [
    # the host's words
    Field("shutdown", U32),          # 1: stop once no request is admitted
    Field("cancels", U32),           # cancel flags set (the host counts each after its flag): a device scans the
                                     # flags only when the count moved
    Field("ring_read", U64),         # ring records the host has read: the device may overwrite those
    Field("host_line", U64, 14),     # the device's words start on the next 128-byte line
    # the device's words
    Field("queue_taken", U64),       # queue slots the device has consumed: the host may reuse those
    Field("steps", U64),             # steps that ran at least one request
    Field("preemptions", U64),
    Field("tokens", U64),            # token rows run (prompt, recomputed and decode positions), all steps
    Field("status", U32),            # STARTING | SERVING | STOPPED | FAILED
    Field("running", U32),           # entries that ran in the last step
    Field("peak_running", U32),
    Field("free_pages", U32),        # the pool's free pages after the last step
    Field("step_tokens", U32),       # token rows of the last step (at most max_tokens_per_step)
], "the control block: the host's words, then the device's")

ENTRY = Layout("Entry", [
    Field("request", REQUEST),
    Field("arrival", U64),           # the request's submission number k: smaller is older
    Field("state", U32),             # FREE | RUNNING | PREEMPTED
    Field("context", U32),           # positions whose K and V are in its pages: the next position to run
    Field("generated", U32),         # tokens produced (and streamed) so far
    Field("num_pages", U32),         # pages in its page table
], "one batch slot of the device: a request admitted (running, or preempted and waiting to recompute)")

POOL = Layout("Pool", [
    Field("num_pages", U32), Field("page_size", U32),
    Field("free_count", U32),        # free_pages[0 .. free_count) are free (a stack)
    Field("pad", U32),
], "the KV page pool's header")

STEP = Layout("Step", [
    Field("num_chunks", U32),        # chunks[0 .. num_chunks): at most one per running entry
    Field("num_rows", U32),          # rows[0 .. num_rows): the step's tokens, at most max_tokens_per_step
    Field("num_samples", U32),       # chunks whose last row samples the entry's next token
    Field("pad", U32),
], "the step's header: the scheduler writes it, with chunks and rows, before the step's compute tasks")

CHUNK = Layout("Chunk", [
    Field("entry", U32),             # the entry (batch slot) whose positions these are
    Field("start", U32),             # its first position: the entry's context before the step
    Field("count", U32),             # positions start .. start + count - 1, one row each
    Field("row", U32),               # its first row in the step's rows; its rows are consecutive
    Field("sample", U32),            # 1: its last row's logits choose the entry's next token
    Field("pad", U32),
], "one request's run of consecutive positions in a step: one decode token, or a chunk of its prompt "
   "(or of the known tokens it recomputes after a preemption)")

STEP_ROW = Layout("StepRow", [
    Field("token", I32),             # the token at that position (the entry's history)
    Field("position", U32),          # its position in its sequence (RoPE's, the causal mask's)
    Field("chunk", U32),             # its chunk's index in chunks
], "one token row of a step: a row of every linear's GEMM over the step's tokens")

LAYOUTS = (REQUEST, QUEUE_SLOT, RING_RECORD, CONTROL, ENTRY, POOL, STEP, CHUNK, STEP_ROW)


@attrs.frozen
class ServingShape:
    """The sizes both sides agree on: batch slots, pages, positions, the step's token budget, queue and
    ring capacities."""

    max_batch: int
    page_size: int
    num_pages: int
    max_seq: int
    max_tokens_per_step: int = DEFAULT_MAX_TOKENS_PER_STEP
    max_prefill_tokens: int = 0      # the tokens of a step no request decodes in (0: max_tokens_per_step)

    @property
    def step_rows(self) -> int:
        """The most token rows a step has: a step with decode tokens runs at most max_tokens_per_step, one
        of prompt chunks alone at most max_prefill_tokens."""
        return max(self.max_tokens_per_step, self.max_prefill_tokens)

    @property
    def queue_slots(self) -> int:
        """The device admits at most max_batch requests a step, so that many slots keep it fed."""
        return self.max_batch

    @property
    def ring_records(self) -> int:
        """A step writes at most one record per entry: four steps' worth before the device waits."""
        return 4 * self.max_batch

    @property
    def handles(self) -> int:
        """Prompt rows and cancel flags: one per request in the queue or admitted."""
        return self.queue_slots + self.max_batch

    @property
    def pages_per_request(self) -> int:
        return math.ceil(self.max_seq / self.page_size)


@attrs.frozen
class Array:
    """One array of a region: a Layout's records or a scalar C type, `shape` elements."""

    name: str
    ctype: Union[str, Layout]
    shape: tuple = attrs.field(converter=tuple)

    def dtype(self) -> np.dtype:
        return self.ctype.dtype() if isinstance(self.ctype, Layout) else np.dtype(SCALARS[self.ctype])

    @property
    def nbytes(self) -> int:
        return self.dtype().itemsize * math.prod(self.shape)


@attrs.frozen
class Region:
    """Arrays laid out one after another in one buffer, each at a REGION_ALIGN boundary."""

    name: str
    arrays: tuple = attrs.field(converter=tuple)

    @property
    def offsets(self) -> dict:
        out, at = {}, 0
        for a in self.arrays:
            out[a.name] = at
            at = _round_up(at + a.nbytes, REGION_ALIGN)
        return out

    @property
    def size(self) -> int:
        return sum(_round_up(a.nbytes, REGION_ALIGN) for a in self.arrays)

    def allocate(self) -> np.ndarray:
        """A zeroed buffer of the region's size (the CPU device's memory; a GPU maps its own)."""
        return np.zeros(self.size, np.uint8)

    def views(self, buffer: np.ndarray) -> dict:
        """Name -> numpy view of that array inside `buffer` (uint8, at least `size` bytes)."""
        out = {}
        for a in self.arrays:
            at = self.offsets[a.name]
            out[a.name] = buffer[at:at + a.nbytes].view(a.dtype()).reshape(a.shape)
        return out

    def c_offsets(self) -> str:
        """The arrays' byte offsets and element counts as C constants (`HOST_QUEUE_OFFSET`, ...)."""
        lines = []
        for a in self.arrays:
            key = f"{self.name.upper()}_{a.name.upper()}"
            lines.append(f"constexpr long long {key}_OFFSET = {self.offsets[a.name]};")
            lines.append(f"constexpr long long {key}_COUNT = {math.prod(a.shape)};")
        lines.append(f"constexpr long long {self.name.upper()}_BYTES = {self.size};")
        return "\n".join(lines)


def host_region(shape: ServingShape) -> Region:
    """The host memory both sides touch (pinned and device-mapped on a GPU)."""
    return Region("host", [
        Array("control", CONTROL, (1,)),
        Array("queue", QUEUE_SLOT, (shape.queue_slots,)),
        Array("ring", RING_RECORD, (shape.ring_records,)),
        Array("cancel", U32, (shape.handles,)),                   # 1: cancel the request holding the handle
        Array("prompts", I32, (shape.handles, shape.max_seq)),    # a handle's prompt tokens
    ])


def device_region(shape: ServingShape) -> Region:
    """The device's own state (device memory on a GPU); the host reads it only for tests and stats."""
    return Region("device", [
        Array("entries", ENTRY, (shape.max_batch,)),
        Array("page_table", I32, (shape.max_batch, shape.pages_per_request)),
        Array("history", I32, (shape.max_batch, shape.max_seq)),  # prompt and produced tokens per entry
        Array("pool", POOL, (1,)),
        Array("free_pages", I32, (shape.num_pages,)),
        Array("step", STEP, (1,)),
        Array("chunks", CHUNK, (shape.max_batch,)),
        Array("rows", STEP_ROW, (shape.step_rows,)),
    ])


def kv_pool_shape(shape: ServingShape, kv_heads: int, head_dim: int) -> tuple:
    """One layer's key (or value) pool: pages of page_size rows, each row one position's kv heads, the
    rows laid out as in a contiguous cache, so a page is a run of page_size cached positions."""
    return (shape.num_pages, shape.page_size, kv_heads, head_dim)


def c_layouts() -> str:
    """The protocol's part that no shape changes: its constants (MAX_STOP, entry states, record flags,
    finish reasons, statuses) and every layout as a C struct (with static_asserts of the host's offsets).
    What a build serving every shape includes: the scheduler's host build (mdsl.serving.scheduler)."""
    constants = {"MAX_STOP": MAX_STOP, "ENTRY_FREE": FREE, "ENTRY_RUNNING": RUNNING, "ENTRY_PREEMPTED": PREEMPTED,
                 "RECORD_HAS_TOKEN": HAS_TOKEN, "RECORD_FINISHED": FINISHED, "RECORD_PREEMPTED": WAS_PREEMPTED,
                 "REASON_NONE": REASON_NONE, "REASON_STOP": REASON_STOP, "REASON_LENGTH": REASON_LENGTH,
                 "REASON_CANCELLED": REASON_CANCELLED, "STATUS_STARTING": STARTING, "STATUS_SERVING": SERVING,
                 "STATUS_STOPPED": STOPPED, "STATUS_FAILED": FAILED}
    parts = [f"constexpr long long {k} = {v};" for k, v in constants.items()]
    parts += [layout.c_struct() for layout in LAYOUTS]
    return "\n".join(parts) + "\n"


def c_declarations(shape: ServingShape) -> str:
    """c_layouts, then the shape's sizes as constants (MAX_BATCH, PAGE_SIZE, ...) and both regions'
    offsets: what a device's source includes."""
    constants = {"MAX_BATCH": shape.max_batch, "PAGE_SIZE": shape.page_size, "NUM_PAGES": shape.num_pages,
                 "SERVE_MAX_SEQ": shape.max_seq, "QUEUE_SLOTS": shape.queue_slots, "RING_RECORDS": shape.ring_records,
                 "HANDLES": shape.handles, "PAGES_PER_REQUEST": shape.pages_per_request,
                 "MAX_TOKENS_PER_STEP": shape.max_tokens_per_step}
    parts = [c_layouts().rstrip("\n")]
    parts += [f"constexpr long long {k} = {v};" for k, v in constants.items()]
    parts += [host_region(shape).c_offsets(), device_region(shape).c_offsets()]
    return "\n".join(parts) + "\n"

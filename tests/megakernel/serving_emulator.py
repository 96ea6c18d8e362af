"""The megakernel's serving tables (mdsl.megakernel.runtime.serving_plan) executed on the CPU: numpy task bodies
over per-row buffers, the paged KV pools and the plan's serve region, run by device.cu's worker loop under random
interleavings (tests/megakernel/emulation.py), with the scheduler of an mdsl.LLM's CPU device (held, so that
its thread runs no step) over that device's protocol views: SCHEDULE calls the CPU device's two halves of a
step around the tables' forward (`_end_step` of the previous step, then `_begin_step`), SAMPLE its sampler.

Every value is computed with the CPU device's arithmetic (mdsl.serving.steprules: rms_normalize's float32
norm, one row's product with a whole weight, RoPE at the row's position, `attend`'s softmax over a split of
the row's own range), and rounded to the model's dtype where the kernel rounds (nothing rounds in float32): a
float32 model's sampled logits are the CPU device's bits wherever a row's range is one split. Where a row has
several splits, their merge (in split order) is not `attend`'s one softmax: its bits are the same whatever the
step, which the tests check by serving the requests twice, differently batched.

SCHEDULE fills the step's activations with NaN, and the pool rows of the positions the step appends, so that a
task reading a value before its producer wrote it shows in the logits."""
import math

import numpy as np

from mdsl.ir.dtypes import round_to_dtype
from mdsl.megakernel.modelgraph.layers import cached, rope_cos_sin
from mdsl.megakernel.runtime.serving_plan import ServingPlan
from mdsl.megakernel.runtime.shape import QKV_BIASES
from mdsl.megakernel.runtime.task_plan import Kind
from mdsl.serving.protocol import FREE
from mdsl.serving.steprules import rows_times
from tests.megakernel.emulation import Slots, run_workers

QKV_SLOTS = ("q_proj", "k_proj", "v_proj")
MAX_STEPS = 5000


class ServingEmulator(Slots):
    def __init__(self, plan: ServingPlan, llm, workers: int, rng):
        self.plan, self.s, self.llm, self.dev, self.workers, self.rng = plan, plan.shape, llm, llm.device, workers, rng
        if llm.shape != plan.serving:
            raise ValueError(f"the plan is for {plan.serving}, the engine {llm.shape}")
        self.w = self.dev.weights
        self.kv_dtype = self.dev.kv_dtype       # the pools hold the checkpoint's dtype's values
        self.state = self.dev.state             # the protocol's device region: the scheduler's
        region = plan.region()
        self.serve = region.views(region.allocate())
        self.buf = {name: np.full(shape, np.nan, np.float32) for name, shape in plan.activations().items()}
        s, serving = self.s, plan.serving
        pool = (s.layers, serving.num_pages, serving.page_size, s.kv_heads, s.head_dim)
        self.k_pool, self.v_pool = np.zeros(pool, np.float32), np.zeros(pool, np.float32)
        self.attention_attrs = plan.op_of(Kind.ATTN).attr_dict
        self.lm_first = next(k for k, t in enumerate(plan.tasks) if t.kind is Kind.LMHEAD)
        self.logits: dict = {}      # request id -> position -> the logits rows its sampled rows had
        self.steps = 0

    def round(self, x):
        return round_to_dtype(np.asarray(x, np.float32), self.s.dtype)

    def run(self, host) -> None:
        """Serve until `host(step)` (called by each SCHEDULE before the scheduler's half: it submits what arrives
        at that step and returns whether anything more is to come) has nothing more and no entry is admitted."""
        self.host, self.stop = host, None
        n = len(self.plan.tasks)
        run_workers(self.plan, self.workers, self.rng, self.execute,
                    lambda: math.inf if self.stop is None else self.stop * n)

    def execute(self, step, k):
        t = self.plan.tasks[k]
        body = {Kind.SCHEDULE: self.schedule, Kind.QKV: self.qkv, Kind.ATTN: self.attention,
                Kind.OPROJ: self.projection, Kind.DOWN: self.projection, Kind.GATEUP: self.gate_up,
                Kind.LMHEAD: self.lm_head, Kind.SAMPLE: self.sample}[t.kind]
        body(t, step, k)

    # ---- the step's tables

    @property
    def num_rows(self) -> int:
        return int(self.state["step"]["num_rows"][0])

    def row_entry(self, r: int) -> int:
        return int(self.state["chunks"]["entry"][self.state["rows"]["chunk"][r]])

    def slots(self, entry: int, positions):
        """(pages, rows within them) of an entry's positions: its page table's pages."""
        positions = np.asarray(positions)
        ps = self.plan.serving.page_size
        return self.state["page_table"][entry, positions // ps], positions % ps

    # ---- SCHEDULE

    def schedule(self, t, step, k):
        """The step boundary: the previous step's end (its sampled tokens chosen: streamed, entries retired), the
        host's arrivals, the next step's tables, its attention items and sampling rows and the h0 rows; or, with
        nothing admitted and nothing more to come, the launch's end."""
        dev, serve = self.dev, self.serve
        if step:
            rows, work = self.state["rows"], serve["work"][0]
            tokens = {int(rows["chunk"][r]): int(serve["chosen"][j])
                      for j, r in enumerate(serve["sample_rows"][:int(work["num_samples"])])}
            dev._end_step(tokens)
            dev._flush_host()
        assert step < MAX_STEPS, "the requests do not finish"
        more = self.host(step)
        if not more and not np.any(self.state["entries"]["state"] != FREE) and not dev.queued():
            self.stop = step        # the device's SCHEDULE does not signal: the step's other tasks never run
            return
        _, n = dev._begin_step()
        dev._flush_host()
        self.steps += 1
        rows, chunks = self.state["rows"][:n], self.state["chunks"][:int(self.state["step"]["num_chunks"][0])]
        items = self.plan.items(rows["position"])
        serve["items"][:len(items)] = items
        sampling = (chunks["row"] + chunks["count"] - 1)[chunks["sample"] == 1]
        serve["sample_rows"][:len(sampling)] = sampling
        serve["work"]["num_items"], serve["work"]["num_samples"] = len(items), len(sampling)
        assert not serve["merge_counts"].any()     # (each merging item reset its counter)
        for values in self.buf.values():
            values[:] = np.nan
        for c in chunks:     # the pool rows this step appends, so that a read before the append shows
            pages, slots = self.slots(int(c["entry"]), np.arange(c["start"], c["start"] + c["count"]))
            self.k_pool[:, pages, slots] = np.nan
            self.v_pool[:, pages, slots] = np.nan
        self.buf["h"][0, :n] = self.layer(None, "embed")[rows["token"]]

    # ---- the linear kinds: their columns of every row

    def normalize(self, x, weight, eps):
        """rms_normalize's float32 norm of each row (of the last axis), rounded where the kernel rounds."""
        x = np.asarray(x, np.float32)
        inv = np.float32(1.0) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))
        return self.round(self.round(x * inv) * weight)

    def products(self, x, slots, layer):
        """x @ (the slots' rows).T for every row, as the CPU device's linear computes it: per graph weight the
        slots are bound to, each row's product with the whole weight (rows_times), each slot its rows of it, in
        slot order (a tile keeps its columns: each column's dot product is the whole row's)."""
        whole, parts = {}, []
        for slot in slots:
            bound = self.plan.weight(slot, layer)
            if bound.name not in whole:
                whole[bound.name] = rows_times(x, self.w[bound.name])
            parts.append(whole[bound.name][:, bound.row:bound.row + self.s.slot_shape(slot)[0]])
        return np.concatenate(parts, axis=1)

    def qkv(self, t, step, k):
        s, n, layer = self.s, self.num_rows, t.layer
        a, b = t.begin, t.end
        if n:
            x = self.normalize(self.stream(t.kind, "row", layer)[:n], self.layer(layer, "input_layernorm"), s.eps)
            biases = {"bias": np.concatenate([self.layer(layer, name) for name in QKV_BIASES])[a:b]} \
                if self.layer(layer, "q_bias") is not None else {}
            self.buf["qkv"][layer, :n, a:b] = self.epilogue(t.kind, product=self.products(x, QKV_SLOTS, layer)[:, a:b],
                                                            **biases)
        counts = self.serve["append_counts"]
        for g in self.plan.appended_heads(t):   # the tile completing a kv head's key and value columns appends it
            counts[layer, g] += 1
            if counts[layer, g] == self.plan.append_tiles(g, layer) * (step + 1):
                self.append(layer, g, n)

    def prepare(self, heads, norm, positions):
        """Heads [rows, heads, D] q/k-normed (where the model has the norm) and rotated at each row's position."""
        a = self.attention_attrs
        if norm is not None:
            heads = self.normalize(heads, norm, a["eps"])
        table = [rope_cos_sin(a, int(p)) for p in positions]
        cos = self.round(np.stack([c for c, _ in table]))[:, None, :]
        sin = self.round(np.stack([s for _, s in table]))[:, None, :]
        half = heads.shape[-1] // 2
        rotated = np.concatenate([-heads[..., half:], heads[..., :half]], axis=-1)
        return self.round(self.round(heads * cos) + self.round(rotated * sin))

    def append(self, layer, g, n):
        """Kv head g's key and value of every row of the step into its entry's page slot for its position."""
        s, d = self.s, self.s.head_dim
        if not n:
            return
        qkv, rows = self.buf["qkv"][layer, :n], self.state["rows"][:n]
        k_col, v_col = s.attention_width + g * d, s.attention_width + (s.kv_heads + g) * d
        keys = self.prepare(qkv[:, None, k_col:k_col + d], self.layer(layer, "k_norm"), rows["position"])[:, 0]
        for r in range(n):
            (page,), (slot,) = self.slots(self.row_entry(r), [rows["position"][r]])
            self.k_pool[layer, page, slot, g] = cached(keys[r], self.kv_dtype)
            self.v_pool[layer, page, slot, g] = cached(qkv[r, v_col:v_col + d], self.kv_dtype)

    # ---- ATTN: its share of the step's items, the last item of a (row, kv head) merging

    def attention(self, t, step, k):
        s, layer, g, u = self.s, t.layer, t.begin, t.end
        d, group = s.head_dim, s.group
        items = self.serve["items"][:int(self.serve["work"]["num_items"][0])]
        rows = self.state["rows"]
        a = self.attention_attrs
        scale = np.float32(a.get("scale") or 1.0 / math.sqrt(d))
        for i in range(u, len(items), self.plan.attention_tasks):
            item = items[i]
            r, lo, hi = int(item["row"]), int(item["lo"]), int(item["hi"])
            pos = int(rows["position"][r])
            q = self.prepare(self.buf["qkv"][layer, r:r + 1, g * group * d:(g + 1) * group * d].reshape(1, group, d),
                             self.layer(layer, "q_norm"), [pos])[0]
            pages, slots = self.slots(self.row_entry(r), np.arange(lo, hi))
            keys, values = self.k_pool[layer, pages, slots, g], self.v_pool[layer, pages, slots, g]
            # attend's arithmetic over the split's keys: its scores, maximum, sum and weighted values
            scores = (q.astype(np.float32) @ keys.astype(np.float32).T) * scale
            top = scores.max(axis=1, keepdims=True)
            p = np.exp(scores - top)
            total = p.sum(axis=1, keepdims=True)
            weighted = self.round(p) @ values.astype(np.float32)
            self.buf["parts"][g, i] = np.concatenate([top, total, weighted], axis=1)
            counts = self.serve["merge_counts"]
            counts[layer, r, g] += 1
            if counts[layer, r, g] == item["splits"]:    # the row's last item of the kv head merges, and resets
                self.merge(layer, g, r, int(item["first"]), int(item["splits"]))
                counts[layer, r, g] = 0

    def merge(self, layer, g, r, first, splits):
        """A row's splits of kv head g merged in split order: each split's sums scaled by exp(its max - the max);
        one split is attend's (p @ values) / sum exactly."""
        s, d = self.s, self.s.head_dim
        parts = self.buf["parts"][g, first:first + splits]
        top = parts[:, :, 0].max(axis=0)
        weighted = total = None
        for j in range(splits):
            scale = np.exp(parts[j, :, 0] - top)
            w, t = scale[:, None] * parts[j, :, 2:], scale * parts[j, :, 1]
            weighted, total = (w, t) if j == 0 else (weighted + w, total + t)
        out = weighted / total[:, None]
        self.buf["attn"][layer, r, g * s.group * d:(g + 1) * s.group * d] = self.round(out).reshape(-1)

    def projection(self, t, step, k):
        n, layer = self.num_rows, t.layer
        if not n:
            return
        slot, source = ("o_proj", "attn") if t.kind is Kind.OPROJ else ("down_proj", "act")
        product = self.products(self.buf[source][layer, :n], (slot,), layer)[:, t.begin:t.end]
        operands = {role: self.stream(t.kind, role, layer)[:n, t.begin:t.end] for role in ("residual", "addend")
                    if self.stream(t.kind, role, layer) is not None}
        self.stream(t.kind, "out", layer)[:n, t.begin:t.end] = self.epilogue(t.kind, product=product, **operands)

    def gate_up(self, t, step, k):
        s, n, layer = self.s, self.num_rows, t.layer
        if not n:
            return
        x = self.normalize(self.stream(t.kind, "row", layer)[:n], self.layer(layer, "post_attention_layernorm"), s.eps)
        both = self.products(x, ("gate_proj", "up_proj"), layer)
        gate, up = both[:, t.begin:t.end], both[:, s.intermediate + t.begin:s.intermediate + t.end]
        self.buf["act"][layer, :n, t.begin:t.end] = self.epilogue(t.kind, gate=gate, up=up)

    # ---- the LM head and the samplers: the sampling rows only

    def sampling_rows(self):
        return self.serve["sample_rows"][:int(self.serve["work"]["num_samples"][0])]

    def lm_head(self, t, step, k):
        s, rows = self.s, self.sampling_rows()
        if not len(rows):
            return
        x = self.normalize(self.buf["h"][s.layers, rows], self.layer(None, "final_norm"), s.eps)
        logits = self.epilogue(t.kind, product=self.products(x, ("lm_head",), None)[:, t.begin:t.end])
        self.buf["logits"][:len(rows), t.begin:t.end] = logits
        best = self.buf["best"][:len(rows), k - self.lm_first]
        best[:, 0], best[:, 1] = logits.max(axis=1), t.begin + np.argmax(logits, axis=1)

    def sample(self, t, step, k):
        entries, rows = self.state["entries"], self.state["rows"]
        for j in range(t.begin, len(self.sampling_rows()), self.plan.samplers):
            r = int(self.sampling_rows()[j])
            e, pos = self.row_entry(r), int(rows["position"][r])
            logits = self.buf["logits"][j].copy()
            token = self.dev._token(e, {r: logits}, r, pos)
            if entries["request"]["temperature"][e] == 0:   # greedy: the tiles' bests give the first maximum too
                bests = self.buf["best"][j]
                assert token == int(max(bests.tolist(), key=lambda vi: (vi[0], -vi[1]))[1])
            self.serve["chosen"][j] = token
            request = int(entries["request"]["request_id"][e])
            self.logits.setdefault(request, {}).setdefault(pos, []).append(logits)

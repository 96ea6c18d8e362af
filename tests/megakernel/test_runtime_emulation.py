"""The megakernel's task tables executed on the CPU by a numpy mirror of device.cu's task bodies and
worker loop: worker w of W takes the task indices w, w + W, ... in order, a task runs only once its events
reach producers * (step + 1), and the next worker to run is picked at random among those whose task is
ready. The tokens and logits must equal the numpy reference forward (mdsl.megakernel.modelgraph.reference) of
the same tiny Llama-3, Qwen3, Qwen2 (q|k|v biases), Mistral (a sliding window), Phi-3 (fused weights, a
sliding window) and Gemma-2 (windows on alternate layers) models, with the prompt prefilled as steps of the
same launch (and of a user's parallel block: tests/megakernel/test_parallel_block.py); a deadlock (no
worker's task ever ready) fails the test. This checks the tables and the bodies' index arithmetic (tiles,
attention splits of each layer's window and the split that appends to the KV cache, the merge of a kv head's
splits by the last one, the fused norms and residuals, the step bookkeeping) without a GPU; the GPU tests
check the CUDA."""
import math

import attrs
import numpy as np
import pytest

from mdsl.ir.dtypes import bf16, round_to_dtype
from mdsl.megakernel.modelgraph.model import parse_model_graph, print_model_graph
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.runtime.shape import QKV_BIASES, decoder_shape, expert_slot, rope_tables
from mdsl.megakernel.runtime.task_plan import Kind, build_plan, check_plan, plan_model
from tests.megakernel.emulation import Slots, run_workers
from tests.megakernel.tiny import tiny_model


class Emulator(Slots):
    """device.cu's Params and bodies in numpy (f32 math, values rounded to the model's dtype where the
    kernel rounds them), its weights those the plan binds to the device's slots (TaskPlan.weights), its
    bodies' residual-stream rows those the plan's kinds read and write (KindOp.streams)."""

    def __init__(self, plan, config, weights, workers: int, rng):
        self.plan, self.s, self.rng, self.workers = plan, plan.shape, rng, workers
        self.w = {k: np.asarray(v, np.float32) for k, v in weights.items()}
        s = self.s
        self.round = lambda x: round_to_dtype(np.asarray(x, np.float32), s.dtype)
        self.cos, self.sin = rope_tables(s, plan.max_seq)
        self.k_cache = np.zeros((s.layers, plan.max_seq, s.kv_heads, s.head_dim), np.float32)
        self.v_cache = np.zeros_like(self.k_cache)
        self.head = self.layer(None, "lm_head")

    def norm(self, x, weight, eps, unit_offset=False):
        r = 1.0 / math.sqrt(float(np.mean(x.astype(np.float64) ** 2)) + eps)
        if unit_offset:   # (gemv.cuh's NormedRow1p: rounded once)
            return self.round(x * np.float32(r) * (np.float32(1.0) + weight))
        return self.round(weight * self.round(x * np.float32(r)))

    def unit_offset(self, kind) -> bool:
        return bool(self.plan.op_of(kind).attr_dict.get("unit_offset"))

    def prepare_head(self, x, norm_weight, pos):
        if norm_weight is not None:
            x = self.norm(x, norm_weight, self.s.eps)
        half = self.s.head_dim // 2
        c, sn = self.round(np.tile(self.cos[pos], 2)), self.round(np.tile(self.sin[pos], 2))
        rotated = np.concatenate([-x[half:], x[:half]])
        return self.round(self.round(x * c) + self.round(rotated * sn))

    def run(self, tokens, max_new):
        """One launch from position 0; returns (new tokens, logits of the last step)."""
        s, plan = self.s, self.plan
        n_tasks = len(plan.tasks)
        steps = len(tokens) - 1 + max_new
        self.buf = {"h": np.zeros((s.layers + 1, s.hidden), np.float32), "mid": np.zeros((s.layers, s.hidden), np.float32),
                    "qkv": np.zeros((s.layers, s.qkv_rows), np.float32),
                    "attn": np.zeros((s.layers, s.attention_width), np.float32),
                    "act": np.zeros((s.layers, s.intermediate), np.float32),
                    "parts": np.zeros((s.layers, s.heads, plan.splits, s.head_dim + 2), np.float32),
                    "logits": np.zeros(s.vocab, np.float32), "best": [None] * plan.lm_tiles}
        if s.experts:   # a mixture of experts' buffers (LayerWeights' MOE section)
            k, mi = s.experts_per_token, s.expert_intermediate
            self.buf.update(router_logits=np.zeros((s.layers, s.experts), np.float32),
                            route_ids=np.zeros((s.layers, k), np.int64), route_weights=np.zeros((s.layers, k), np.float32),
                            expert_acts=np.zeros((s.layers, k * mi), np.float32))
        self.router_counts = {}
        self.next_embedding(tokens[0])
        self.tokens, self.max_new, self.out, self.stop = list(tokens), max_new, [], None
        self.split_counts = {}
        self.tile_counts = {}   # (kind, layer) -> tiles done (linear_norm_residual's last tile)
        self.tiles = {kind: sum(u.kind is kind and u.layer == 0 for u in plan.tasks) for kind in (Kind.OPROJ, Kind.DOWN)}

        def last() -> int:   # the launch ends after `steps` steps, or after the step whose sampler stops it
            return n_tasks * (steps if self.stop is None else min(steps, self.stop + 1)) - 1

        run_workers(plan, self.workers, self.rng, lambda step, k: self.execute(plan.tasks[k], step, k), last)
        return self.out, self.buf["logits"].copy()

    def execute(self, t, step, k):
        s, b, pos = self.s, self.buf, step
        if t.kind is Kind.QKV:
            x = self.norm(self.stream(t.kind, "row", t.layer), self.layer(t.layer, "input_layernorm"), s.eps,
                          self.unit_offset(t.kind))
            w = np.concatenate([self.layer(t.layer, n) for n in ("q_proj", "k_proj", "v_proj")])
            biases = {"bias": np.concatenate([self.layer(t.layer, n) for n in QKV_BIASES])[t.begin:t.end]} \
                if self.layer(t.layer, "q_bias") is not None else {}
            b["qkv"][t.layer, t.begin:t.end] = self.epilogue(t.kind, product=w[t.begin:t.end] @ x, **biases)
        elif t.kind is Kind.ATTN:
            self.attention(t.layer, t.begin, t.end, pos)
            done = self.split_counts.get((t.layer, t.begin), 0) + 1   # the kv head's last split of the step merges
            self.split_counts[t.layer, t.begin] = done
            if done == self.plan.splits * (step + 1):
                for head in range(t.begin * s.group, (t.begin + 1) * s.group):
                    self.combine(t.layer, head)
        elif t.kind in (Kind.OPROJ, Kind.DOWN):
            weight, source = ("o_proj", "attn") if t.kind is Kind.OPROJ else ("down_proj", "act")
            product = self.layer(t.layer, weight)[t.begin:t.end] @ b[source][t.layer]
            if self.plan.op_of(t.kind).op == "linear_norm_residual":   # raw rows; the last tile normalises the row
                out = self.stream(t.kind, "out", t.layer)
                out[t.begin:t.end] = self.round(product)
                key = (t.kind, t.layer)
                self.tile_counts[key] = self.tile_counts.get(key, 0) + 1
                if self.tile_counts[key] == self.tiles[t.kind] * (step + 1):
                    norm = self.layer(t.layer, "attn_post_norm" if t.kind is Kind.OPROJ else "mlp_post_norm")
                    normed = self.norm(out.copy(), norm, s.eps, self.unit_offset(t.kind))
                    out[:] = self.round(self.stream(t.kind, "residual", t.layer) + normed)
                return
            operands = {role: self.stream(t.kind, role, t.layer)[t.begin:t.end] for role in ("residual", "addend")
                        if self.stream(t.kind, role, t.layer) is not None}
            self.stream(t.kind, "out", t.layer)[t.begin:t.end] = self.epilogue(t.kind, product=product, **operands)
        elif t.kind is Kind.GATEUP:
            x = self.norm(self.stream(t.kind, "row", t.layer), self.layer(t.layer, "post_attention_layernorm"), s.eps,
                          self.unit_offset(t.kind))
            b["act"][t.layer, t.begin:t.end] = self.epilogue(
                t.kind, gate=self.layer(t.layer, "gate_proj")[t.begin:t.end] @ x,
                up=self.layer(t.layer, "up_proj")[t.begin:t.end] @ x)
        elif t.kind is Kind.LMHEAD:
            x = self.norm(b["h"][s.layers], self.layer(None, "final_norm"), s.eps, self.unit_offset(t.kind))
            logits = self.epilogue(t.kind, product=self.head[t.begin:t.end] @ x)
            b["logits"][t.begin:t.end] = logits
            b["best"][k - next(i for i, u in enumerate(self.plan.tasks) if u.kind is Kind.LMHEAD)] = \
                (float(logits.max()), t.begin + int(np.argmax(logits)))
        elif t.kind in (Kind.ROUTER, Kind.EXPERT_UP, Kind.EXPERT_DOWN):
            self.experts(t, step)
        else:
            self.sample(step, pos)

    def experts(self, t, step):
        """A mixture of experts' tasks (moe.cuh): the router's tiles (the last one of a step routes), the picked
        experts' gate/up rows per slot, the down-projection summed over the slots in order."""
        s, b = self.s, self.buf
        k, mi = s.experts_per_token, s.expert_intermediate
        if t.kind is Kind.EXPERT_DOWN:
            acts = b["expert_acts"][t.layer]
            total = np.zeros(t.end - t.begin, np.float32)
            for j, (e, weight) in enumerate(zip(b["route_ids"][t.layer], b["route_weights"][t.layer])):
                down = self.layer(t.layer, expert_slot("expert_down", int(e)))[t.begin:t.end]
                total += self.round(self.round(down @ acts[j * mi:(j + 1) * mi]) * weight)
            residual = self.stream(t.kind, "residual", t.layer)[t.begin:t.end]
            self.stream(t.kind, "out", t.layer)[t.begin:t.end] = self.round(residual + self.round(total))
            return
        x = self.norm(self.stream(t.kind, "row", t.layer), self.layer(t.layer, "post_attention_layernorm"), s.eps)
        if t.kind is Kind.EXPERT_UP:
            slot = t.begin // mi
            e = int(b["route_ids"][t.layer, slot])
            rows = slice(t.begin - slot * mi, t.end - slot * mi)
            b["expert_acts"][t.layer, t.begin:t.end] = self.epilogue(
                t.kind, gate=self.layer(t.layer, expert_slot("expert_gate", e))[rows] @ x,
                up=self.layer(t.layer, expert_slot("expert_up", e))[rows] @ x)
            return
        b["router_logits"][t.layer, t.begin:t.end] = self.epilogue(
            t.kind, product=self.layer(t.layer, "router")[t.begin:t.end] @ x)
        done = self.router_counts.get(t.layer, 0) + 1   # the layer's last router tile of the step routes
        self.router_counts[t.layer] = done
        if done == sum(u.kind is Kind.ROUTER and u.layer == t.layer for u in self.plan.tasks) * (step + 1):
            z = b["router_logits"][t.layer]
            p = np.exp(z - z.max()).astype(np.float32)
            p = (p / p.sum()).astype(np.float32)
            picked = np.argsort(-p, kind="stable")[:k]   # the lower expert on ties
            weights = p[picked] / p[picked].sum() if s.config.norm_topk_prob else p[picked]
            b["route_ids"][t.layer], b["route_weights"][t.layer] = picked, self.round(weights)

    def combine(self, layer, head):
        s, b = self.s, self.buf
        part = b["parts"][layer, head]
        top = part[:, 0].max()
        scale = np.where(part[:, 0] == -np.inf, 0.0, np.exp(part[:, 0] - top))
        out = (scale[:, None] * part[:, 2:]).sum(0) / (scale * part[:, 1]).sum()
        b["attn"][layer, head * s.head_dim:(head + 1) * s.head_dim] = self.round(out)

    def attention(self, layer, g, split, pos):
        s, b = self.s, self.buf
        d, group = s.head_dim, s.group
        qkv = b["qkv"][layer]
        lo, hi = self.plan.attention_range(pos, split, layer)
        qn, kn = self.layer(layer, "q_norm"), self.layer(layer, "k_norm")
        q = np.stack([self.prepare_head(qkv[h * d:(h + 1) * d], qn, pos) for h in range(g * group, (g + 1) * group)])
        if lo <= pos < hi:   # the split holding the newest position appends it to the cache
            k_row = s.attention_width + g * d
            v_row = s.attention_width + s.kv_heads * d + g * d
            self.k_cache[layer, pos, g] = self.prepare_head(qkv[k_row:k_row + d], kn, pos)
            self.v_cache[layer, pos, g] = qkv[v_row:v_row + d]
        for h in range(group):
            part = b["parts"][layer, g * group + h, split]
            if hi <= lo:
                part[:] = 0.0
                part[0] = -np.inf
                continue
            a = self.plan.op_of(Kind.ATTN).attr_dict
            scale, cap = np.float32(a.get("scale") or s.head_dim ** -0.5), np.float32(a.get("softcap", 0.0))
            if cap:   # (attention.cuh's SOFTCAP section: eager attention's roundings, its normalised weights)
                scores = self.round(self.k_cache[layer, lo:hi, g] @ q[h])
                scores = self.round(self.round(scores * scale) * (np.float32(1.0) / cap))
                scores = self.round(self.round(np.tanh(scores)) * cap)
                m = scores.max()
                e = np.exp(scores - m)
                weights = self.round(e / e.sum())
                total = weights @ self.v_cache[layer, lo:hi, g]
                split_sum = 1.0 if self.plan.splits == 1 else e.sum()
                part[0], part[1], part[2:] = m, split_sum, total * split_sum
                continue
            scores = self.k_cache[layer, lo:hi, g] @ q[h] * scale
            m = scores.max()
            e = np.exp(scores - m)
            part[0], part[1], part[2:] = m, e.sum(), self.round(e) @ self.v_cache[layer, lo:hi, g]

    def bests(self) -> list:
        return self.buf["best"]

    def next_embedding(self, token) -> None:
        row = self.layer(None, "embed")[token]
        if self.plan.embedding_scale:   # (sampling.cuh's EMBED_SCALE: the scale rounded to the dtype, then the row)
            row = self.round(row * self.round(np.float32(self.plan.embedding_scale)))
        self.buf["h"][0] = row

    def sample(self, step, pos):
        value, token = max(self.bests(), key=lambda vi: (vi[0], -vi[1]))
        next_pos = pos + 1
        stop = next_pos >= self.plan.max_seq
        if next_pos < len(self.tokens):
            token = self.tokens[next_pos]
        else:
            self.out.append(token)
            stop = stop or len(self.out) >= self.max_new
        if stop:
            self.stop = step
        else:
            self.next_embedding(token)


@pytest.mark.parametrize("workers", [1, 3, 17])
@pytest.mark.parametrize("arch", ["llama3", "qwen3", "qwen2", "mistral", "phi3"])
def test_the_tables_compute_the_reference_forward(arch, workers):
    config, graph, weights = tiny_model(arch, seed=3)
    plan = build_plan(decoder_shape(config), workers=workers, max_seq=config.max_positions)
    check_plan(plan)
    prompt, new = [3, 17, 42, 5], 8
    want = ReferenceModel(graph, weights).generate(prompt, new)
    got, last_logits = Emulator(plan, config, weights, workers, np.random.default_rng(workers)).run(prompt, new)
    assert tuple(got) == want.tokens
    np.testing.assert_allclose(last_logits, want.logits[-1], rtol=0, atol=2e-5 * np.abs(want.logits[-1]).max())


@pytest.mark.parametrize("workers", [1, 4, 13])
@pytest.mark.parametrize(("norm_topk_prob", "layers"), [(True, {}), (False, {"num_hidden_layers": 3, "mlp_only_layers": [1]})])
def test_the_tables_of_a_mixture_of_experts_compute_the_reference_forward(workers, norm_topk_prob, layers):
    """Qwen3-MoE: the router's tiles (the last one routes), the picked experts' gate/up tiles per slot and the
    down-projection summed over the slots; a dense layer between sparse ones (mlp_only_layers)."""
    config, graph, weights = tiny_model("qwen3_moe", seed=2, num_experts=8, norm_topk_prob=norm_topk_prob, **layers)
    plan = build_plan(decoder_shape(config), workers=workers, max_seq=config.max_positions)
    check_plan(plan)
    kinds = {t.kind for t in plan.tasks}
    assert {Kind.ROUTER, Kind.EXPERT_UP, Kind.EXPERT_DOWN} <= kinds and (Kind.GATEUP in kinds) == bool(layers)
    prompt, new = [3, 17, 42, 5], 10
    want = ReferenceModel(graph, weights).generate(prompt, new)
    got, last_logits = Emulator(plan, config, weights, workers, np.random.default_rng(workers)).run(prompt, new)
    assert tuple(got) == want.tokens and len(set(got)) > 3
    np.testing.assert_allclose(last_logits, want.logits[-1], rtol=0, atol=2e-5 * np.abs(want.logits[-1]).max())


@pytest.mark.parametrize("hidden_act", ["gelu", "relu", "sigmoid"])
def test_the_mlp_activation_follows_the_config(hidden_act):
    """config.json's hidden_act becomes the gate/up tasks' epilogue (the bodies the device generates)."""
    config, graph, weights = tiny_model("llama3", seed=4, hidden_act=hidden_act)
    plan = build_plan(decoder_shape(config), workers=7, max_seq=config.max_positions)
    assert plan.op_of(Kind.GATEUP).attr_dict["act"] == hidden_act
    prompt, new = [9, 2, 31], 6
    want = ReferenceModel(graph, weights).generate(prompt, new)
    got, last_logits = Emulator(plan, config, weights, 7, np.random.default_rng(4)).run(prompt, new)
    assert tuple(got) == want.tokens
    np.testing.assert_allclose(last_logits, want.logits[-1], rtol=0, atol=2e-5 * np.abs(want.logits[-1]).max())
    silu = ReferenceModel(*tiny_model("llama3", seed=4)[1:]).generate(prompt, new)
    assert not np.allclose(silu.logits[-1], want.logits[-1])   # the activation mattered


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
@pytest.mark.parametrize(("min_chunk", "explicit"), [(1, False), (4, False), (32, False), (3, True)])
def test_attention_splits_cover_the_positions_once(monkeypatch, min_chunk, explicit, arch):
    """Several splits at these short contexts: MIN_CHUNK lowered, or a plan's own min_chunk (the engine's
    attention_min_chunk); over every position, or Mistral's sliding window of the last 5."""
    from mdsl.megakernel.runtime import task_plan as plan_module
    from mdsl.megakernel.runtime.kernel_source import generate_source

    if not explicit:
        monkeypatch.setattr(plan_module, "MIN_CHUNK", min_chunk)
    config, graph, weights = tiny_model(arch, seed=1)
    plan = build_plan(decoder_shape(config), workers=64, max_seq=config.max_positions,
                      min_chunk=min_chunk if explicit else None)
    assert plan.splits > 4 and plan.min_chunk == min_chunk   # empty splits early on must weigh nothing
    assert plan.attention_window == config.sliding_window
    text = generate_source(plan).text
    assert f"constexpr int MIN_CHUNK = {min_chunk};" in text
    assert ("__constant__ int LAYER_WINDOW[L] = {5, 5};" in text) == (arch == "mistral")
    _assert_splits_cover_the_positions(plan, config)
    prompt = [1, 2]
    want = ReferenceModel(graph, weights).generate(prompt, 12)
    got, _ = Emulator(plan, config, weights, 5, np.random.default_rng(0)).run(prompt, 12)
    assert tuple(got) == want.tokens


def _assert_splits_cover_the_positions(plan, config):
    """At every position, each layer's splits cut its window (or every position) into adjacent ranges, the
    newest position in exactly one of them, none longer than the plan's max_chunk."""
    for layer in range(config.num_layers):
        window = config.window(layer)
        assert plan.window(layer) == (window if window < plan.max_seq else 0)
        for position in range(plan.max_seq):
            ranges = [plan.attention_range(position, k, layer) for k in range(plan.splits)]
            first = max(0, position + 1 - plan.window(layer)) if plan.window(layer) else 0
            assert ranges[0][0] == first and max(hi for _, hi in ranges) == position + 1
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert sum(lo <= position < hi for lo, hi in ranges) == 1
            assert all(hi - lo <= plan.max_chunk for lo, hi in ranges)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3_moe"])
def test_bf16_rounding_follows_the_tables_without_nan(arch):
    config, graph, weights = tiny_model(arch, seed=2)
    config = attrs.evolve(config, dtype=bf16)
    rounded = {k: round_to_dtype(np.asarray(v, np.float32), config.dtype) for k, v in weights.items()}
    plan = build_plan(decoder_shape(config), workers=9, max_seq=config.max_positions)
    got, logits = Emulator(plan, config, rounded, 9, np.random.default_rng(1)).run([4, 8], 6)
    assert len(got) == 6 and np.isfinite(logits).all()
    assert np.array_equal(logits, round_to_dtype(logits, config.dtype))


# Gemma-2: its window as long as the KV cache (every layer's attention is then one device body), its scaled
# embedding, (1 + weight) norms, soft-capped scores and logits, GeGLU, and the o-proj's and down-proj's rows
# normalised by their last tile before the residual add
def _gemma2(seed: int, **overrides):
    return tiny_model("gemma2", seed=seed, sliding_window=24, **overrides)


@pytest.mark.parametrize("workers", [1, 3, 17])
def test_gemma2_tables_compute_the_reference_forward(workers):
    config, graph, weights = _gemma2(3)
    plan = build_plan(decoder_shape(config), workers=workers, max_seq=config.max_positions)
    check_plan(plan)
    kinds = {k.kind: k for k in plan.kind_ops}
    assert (kinds[Kind.OPROJ].op, kinds[Kind.DOWN].op, kinds[Kind.GATEUP].op) == \
        ("linear_norm_residual", "linear_norm_residual", "norm_geglu")
    assert kinds[Kind.LMHEAD].attr_dict["softcap"] == 3.0 and kinds[Kind.ATTN].attr_dict["softcap"] == 2.0
    assert plan.embedding_scale == config.hidden_size ** 0.5
    prompt, new = [3, 17, 42, 5], 8
    want = ReferenceModel(graph, weights).generate(prompt, new)
    got, last_logits = Emulator(plan, config, weights, workers, np.random.default_rng(workers)).run(prompt, new)
    assert tuple(got) == want.tokens
    np.testing.assert_allclose(last_logits, want.logits[-1], rtol=0, atol=2e-5 * np.abs(want.logits[-1]).max())


def test_gemma2_bf16_rounding_follows_the_tables_without_nan():
    config, graph, weights = _gemma2(2)
    config = attrs.evolve(config, dtype=bf16)
    rounded = {k: round_to_dtype(np.asarray(v, np.float32), config.dtype) for k, v in weights.items()}
    for splits in (1, 3):   # (one split's weights are eager attention's; several merge their normalised sums)
        plan = build_plan(decoder_shape(config), workers=9, max_seq=config.max_positions, splits=splits,
                          min_chunk=2)
        got, logits = Emulator(plan, config, rounded, 9, np.random.default_rng(1)).run([4, 8], 6)
        assert len(got) == 6 and np.isfinite(logits).all() and np.abs(logits).max() <= 3.0
        assert np.array_equal(logits, round_to_dtype(logits, config.dtype))


@pytest.mark.parametrize(("layer_types", "splits", "workers"), [
    (None, None, 5),                                                                   # every other layer, from the first
    (["full_attention", "sliding_attention", "sliding_attention"], 3, 7),
    (["sliding_attention", "full_attention", "sliding_attention"], 5, 1)])
def test_gemma2_windows_shorter_than_the_kv_cache_are_read_per_layer(layer_types, splits, workers):
    """Gemma-2's sliding layers over the last 4 positions of a 24-position KV cache, its full layers over every
    position, in one kernel (the WINDOW section's LAYER_WINDOW table), decoding well past the window: the tables
    give the reference forward's tokens and last logits."""
    overrides = {"sliding_window": 4} if layer_types is None else \
        {"sliding_window": 4, "num_hidden_layers": 3, "layer_types": layer_types}
    config, graph, weights = tiny_model("gemma2", seed=5, **overrides)
    plan = build_plan(decoder_shape(config), workers=workers, max_seq=config.max_positions,
                      **({"splits": splits, "min_chunk": 1} if splits else {}))
    check_plan(plan)
    assert plan.windows == tuple(config.window(layer) for layer in range(config.num_layers))
    assert len(set(plan.windows)) == 2 and plan.op_of(Kind.ATTN).attr_dict["window"] == 0
    _assert_splits_cover_the_positions(plan, config)
    prompt, new = [3, 17, 42, 5, 9, 1], 14
    want = ReferenceModel(graph, weights).generate(prompt, new)
    got, last_logits = Emulator(plan, config, weights, workers, np.random.default_rng(workers)).run(prompt, new)
    assert tuple(got) == want.tokens
    np.testing.assert_allclose(last_logits, want.logits[-1], rtol=0, atol=2e-5 * np.abs(want.logits[-1]).max())
    # the same model whose window covers the cache: other logits (the window mattered)
    wide = ReferenceModel(*tiny_model("gemma2", seed=5, **{**overrides, "sliding_window": 24})[1:])
    assert not np.allclose(wide.generate(prompt, new).logits[-1], want.logits[-1], rtol=0.05)


def test_the_windows_are_the_graphs_own_per_layer():
    """A step function's attention windows are the device's, layer by layer, whatever the config says: a Mistral
    graph whose first layer reads every position (its window 0) and whose second reads the last 5."""
    config, graph, weights = tiny_model("mistral", seed=6)
    mixed = parse_model_graph(print_model_graph(graph).replace("window=5", "window=0", 1))
    plan = plan_model(mixed, decoder_shape(config), workers=6, max_seq=config.max_positions, splits=4, min_chunk=1)
    check_plan(plan)
    assert plan.windows == (0, 5)
    prompt, new = [7, 3, 11], 16
    want = ReferenceModel(mixed, weights).generate(prompt, new)
    got, last_logits = Emulator(plan, config, weights, 6, np.random.default_rng(6)).run(prompt, new)
    assert tuple(got) == want.tokens
    np.testing.assert_allclose(last_logits, want.logits[-1], rtol=0, atol=2e-5 * np.abs(want.logits[-1]).max())
    assert not np.allclose(ReferenceModel(graph, weights).generate(prompt, new).logits[-1], want.logits[-1], rtol=0.05)

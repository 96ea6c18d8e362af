"""The tensor-parallel megakernel's tables (`for_ranks`) executed on the CPU by N numpy mirrors of
device.cu with WORLD = N, one per rank, each over its shard of a tiny model: an o-proj / down-proj tile puts
its partial into its own slot and to the peers as words tagged step + 1, then holds its worker until the
peers' words of its rows carry that tag (the device's relay_rows polls), sums the rows in rank order into
the rank's whole row, which its readers read (checked: written for their step), and signals this rank only;
a word is never overwritten before the rank it was put to has read it (checked). The LM head's bests are
gathered by global token id, the rank holding the token puts its embedding row into every rank's h[0], and
every signal flagged REMOTE is counted on every rank. Workers of all ranks interleave at random, each
taking its rank's task indices in the static schedule's order.
The tokens must equal the single-rank numpy reference forward, and a deadlock fails the test. (The GPU
test is tests/gpu/test_tensor_parallel_gpu.py.)"""
import numpy as np
import pytest

from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.parallel.gpu_group import shard_config
from mdsl.megakernel.parallel.tensor_parallel import tensor_parallel
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import RELAYED_KINDS, Kind, build_plan, check_plan, for_ranks
from tests.megakernel.test_runtime_emulation import Emulator
from tests.megakernel.tiny import tiny_model


class RankEmulator(Emulator):
    """One rank: its shard's weights, its own buffers, and its copies of the gathered buffers, which
    the other ranks' puts write into."""

    def __init__(self, plan, config, weights, workers, rng, rank, world):
        super().__init__(plan, config, weights, workers, rng)
        self.rank, self.world = rank, world
        s = self.s
        self.h_parts = np.zeros((s.layers + 1, world, s.hidden), np.float32)
        self.mid_parts = np.zeros((s.layers, world, s.hidden), np.float32)
        # each rank's whole rows (and the step each was written for), the peers' tagged words, and
        # the tag this rank last read of each word
        self.single = {"h_parts": np.zeros((s.layers + 1, s.hidden), np.float32),
                       "mid_parts": np.zeros((s.layers, s.hidden), np.float32)}
        self.written_for = {name: np.full(a.shape, -1, np.int64) for name, a in self.single.items()}
        self.relay_value = {name: np.zeros(a.shape, np.float32) for name, a in (("h_parts", self.h_parts),
                                                                               ("mid_parts", self.mid_parts))}
        self.relay_tag = {name: np.zeros(a.shape, np.int64) for name, a in self.relay_value.items()}
        self.relay_read = {name: np.zeros(a.shape, np.int64) for name, a in self.relay_value.items()}
        self.step = -1
        self.best = [None] * (world * plan.lm_tiles)
        self.events = plan.initial_events().astype(np.int64)
        self.peers = []   # every rank, this one included, in rank order

    def stream(self, parts, layer):
        name = "h_parts" if parts is self.h_parts else "mid_parts"
        assert (self.written_for[name][layer] == self.step).all(), f"read {name}[{layer}] of another step"
        return self.single[name][layer].copy()

    def put(self, name, index, value):
        for peer in self.peers:
            getattr(peer, name)[index] = value

    def put_tagged(self, name, layer, rows, value, tag):
        """The relay: this rank's partial into its own slot, and to every peer as words tagged `tag`, none of
        which may overwrite a word its rank has not read yet."""
        index = (layer, self.rank, rows)
        getattr(self, name)[index] = value
        for peer in self.peers:
            if peer is not self:
                previous = peer.relay_tag[name][index]
                assert ((previous == 0) | (peer.relay_read[name][index] == previous)).all(), \
                    f"rank {self.rank} overwrote {name}[{layer}] words rank {peer.rank} had not read"
                peer.relay_value[name][index] = value
                peer.relay_tag[name][index] = tag

    @staticmethod
    def relayed(t):
        """(residual-stream buffer, layer) of an o-proj / down-proj tile's rows."""
        return ("mid_parts", t.layer) if t.kind is Kind.OPROJ else ("h_parts", t.layer + 1)

    def relay_ready(self, t, step) -> bool:
        name, layer = self.relayed(t)
        peers = [k for k in range(self.world) if k != self.rank]
        return bool(np.all(self.relay_tag[name][layer, peers, t.begin:t.end] == step + 1))

    def relay(self, t, step):
        """The tile's rows summed in rank order (its own slot, the peers' words) into the rank's whole row."""
        name, layer = self.relayed(t)
        rows = slice(t.begin, t.end)
        partials = np.stack([getattr(self, name)[layer, k, rows] if k == self.rank else
                             self.relay_value[name][layer, k, rows] for k in range(self.world)])
        for k in range(self.world):
            if k != self.rank:
                self.relay_read[name][layer, k, rows] = step + 1
        self.single[name][layer, rows] = self.round(partials.sum(axis=0, dtype=np.float32))
        self.written_for[name][layer, rows] = step

    def begin(self, tokens, max_new):
        s = self.s
        self.buf = {"qkv": np.zeros((s.layers, s.qkv_rows), np.float32),
                    "attn": np.zeros((s.layers, s.attention_width), np.float32),
                    "act": np.zeros((s.layers, s.intermediate), np.float32),
                    "parts": np.zeros((s.layers, s.heads, self.plan.splits, s.head_dim + 2), np.float32),
                    "logits": np.zeros(s.vocab, np.float32)}
        self.tokens, self.max_new, self.out, self.stop = list(tokens), max_new, [], None
        self.split_counts = {}
        self.next_embedding(tokens[0])

    def bests(self) -> list:
        return self.best

    def next_embedding(self, token):
        local = token - self.rank * self.s.vocab
        if 0 <= local < self.s.vocab:   # the rank holding the row puts it whole into every rank's h[0]
            row = self.w["model.embed_tokens.weight"][local]
            for peer in self.peers:
                peer.single["h_parts"][0] = self.round(row)   # (the device's row is the model's dtype)
                peer.written_for["h_parts"][0] = self.step + 1

    def execute(self, t, step, k):
        s, b = self.s, self.buf
        self.step = step
        if t.kind is Kind.QKV:
            x = self.norm(self.stream(self.h_parts, t.layer), self.layer(t.layer, "input_layernorm"), s.eps)
            w = np.concatenate([self.layer(t.layer, n) for n in ("q_proj", "k_proj", "v_proj")])
            b["qkv"][t.layer, t.begin:t.end] = self.round(w[t.begin:t.end] @ x)
        elif t.kind in (Kind.OPROJ, Kind.DOWN):
            weight, source, residual, out, layer = (
                ("o_proj", "attn", self.h_parts, "mid_parts", t.layer) if t.kind is Kind.OPROJ else
                ("down_proj", "act", self.mid_parts, "h_parts", t.layer + 1))
            partial = self.layer(t.layer, weight)[t.begin:t.end] @ b[source][t.layer]
            if self.rank == 0:
                partial = self.stream(residual, t.layer)[t.begin:t.end] + partial
            self.put_tagged(out, layer, slice(t.begin, t.end), partial, step + 1)
        elif t.kind is Kind.GATEUP:
            x = self.norm(self.stream(self.mid_parts, t.layer), self.layer(t.layer, "post_attention_layernorm"), s.eps)
            g = self.round(self.layer(t.layer, "gate_proj")[t.begin:t.end] @ x)
            u = self.round(self.layer(t.layer, "up_proj")[t.begin:t.end] @ x)
            b["act"][t.layer, t.begin:t.end] = self.round(self.round(g / (1 + np.exp(-g))) * u)
        elif t.kind is Kind.LMHEAD:
            x = self.norm(self.stream(self.h_parts, s.layers), self.w["model.norm.weight"], s.eps)
            logits = self.round(self.head[t.begin:t.end] @ x)
            b["logits"][t.begin:t.end] = logits
            tile = k - next(i for i, u in enumerate(self.plan.tasks) if u.kind is Kind.LMHEAD)
            best = (float(logits.max()), self.rank * s.vocab + t.begin + int(np.argmax(logits)))
            self.put("best", self.rank * self.plan.lm_tiles + tile, best)
        else:
            super().execute(t, step, k)

    def signal(self, k):
        for e in self.plan.signals[k]:
            for peer in (self.peers if self.plan.events[e].ranks > 1 else [self]):
                peer.events[e] += 1


def run_ranks(ranks, tokens, max_new, rng):
    """Every rank's workers interleaved at random, worker w of W taking its rank's task indices w, w + W, ...
    An o-proj / down-proj tile runs in two parts: its products, then (its worker held meanwhile) its rows'
    sum once the peers' words are there, then its signals."""
    n_tasks = len(ranks[0].plan.tasks)
    steps = len(tokens) - 1 + max_new
    for r in ranks:
        r.peers = ranks
    for r in ranks:
        r.begin(tokens, max_new)
    held = [[w for w in range(r.workers)] for r in ranks]
    while True:
        ready = []
        for ri, r in enumerate(ranks):
            for w, index in enumerate(held[ri]):
                if index is None:
                    continue
                if isinstance(index, tuple):   # a tile waiting for its peers' words
                    step, k = divmod(index[1], n_tasks)
                    if r.relay_ready(r.plan.tasks[k], step):
                        ready.append((ri, w))
                    continue
                step, k = divmod(index, n_tasks)
                if index >= steps * n_tasks or (r.stop is not None and step > r.stop):
                    held[ri][w] = None
                    continue
                if all(r.events[e] >= r.plan.events[e].per_step * (step + 1) for e in r.plan.waits[k]):
                    ready.append((ri, w))
        if not ready:
            assert all(h is None for hs in held for h in hs), f"deadlock: every worker waits ({held})"
            return [r.out for r in ranks]
        ri, w = ready[rng.integers(len(ready))]
        r = ranks[ri]
        if isinstance(held[ri][w], tuple):
            step, k = divmod(held[ri][w][1], n_tasks)
            r.relay(r.plan.tasks[k], step)
        else:
            step, k = divmod(held[ri][w], n_tasks)
            r.execute(r.plan.tasks[k], step, k)
            if r.plan.tasks[k].kind in RELAYED_KINDS:
                held[ri][w] = ("relay", held[ri][w])
                continue
        r.signal(k)
        held[ri][w] = step * n_tasks + k + r.workers


@pytest.mark.parametrize(("arch", "world", "workers"), [
    ("llama3", 2, 3), ("qwen3", 2, 5), ("qwen3", 2, 1), ("llama3", 2, 8), ("qwen3", 2, 4), ("qwen3", 2, 6),
    ("llama3", 2, 9)])
def test_the_ranks_tables_compute_the_single_rank_reference(arch, world, workers):
    config, graph, weights = tiny_model(arch, seed=3)
    split = tensor_parallel(step_function(config).trace(config), world)
    shard = shard_config(config, world)
    plan = for_ranks(build_plan(decoder_shape(shard), workers=workers, max_seq=config.max_positions), world)
    check_plan(plan)
    cross = [e for e in plan.events if e.ranks > 1]
    assert all({plan.tasks[k].kind for k in e.producers} & {Kind.LMHEAD, Kind.SAMPLE} or not e.producers
               for e in cross)
    rng = np.random.default_rng(workers)
    ranks = [RankEmulator(plan, shard, split.shard_weights(weights, r), workers, rng, r, world) for r in range(world)]
    prompt, new = [3, 17, 42, 5], 8
    want = ReferenceModel(graph, weights).generate(prompt, new)
    outs = run_ranks(ranks, prompt, new, rng)
    assert all(tuple(out) == want.tokens for out in outs), (outs, want.tokens)
    logits = np.concatenate([r.buf["logits"] for r in ranks])
    np.testing.assert_allclose(logits, want.logits[-1], rtol=0, atol=2e-5 * np.abs(want.logits[-1]).max())


def _two_llama3_ranks() -> tuple:
    """Two ranks of the tiny Llama-3 on 3 workers each, and their rng."""
    config, graph, weights = tiny_model("llama3", seed=3)
    split = tensor_parallel(step_function(config).trace(config), 2)
    shard = shard_config(config, 2)
    plan = for_ranks(build_plan(decoder_shape(shard), workers=3, max_seq=config.max_positions), 2)
    rng = np.random.default_rng(0)
    return [RankEmulator(plan, shard, split.shard_weights(weights, r), 3, rng, r, 2) for r in range(2)], rng


def test_a_remote_signal_dropped_is_a_deadlock():
    ranks, rng = _two_llama3_ranks()
    ranks[1].signal = lambda k, r=ranks[1]: [r.events.__setitem__(e, r.events[e] + 1) for e in r.plan.signals[k]]
    with pytest.raises(AssertionError, match="deadlock"):
        run_ranks(ranks, [3, 17], 2, rng)


def test_a_relayed_word_of_the_wrong_step_is_a_deadlock():
    """Under the relay a tile sums its rows only once the peers' words carry its step's tag: a rank whose
    down-proj words to its peer carry the previous step's tag stops every rank."""
    ranks, rng = _two_llama3_ranks()
    put_tagged = ranks[1].put_tagged
    ranks[1].put_tagged = lambda name, layer, rows, value, tag: put_tagged(name, layer, rows, value,
                                                                           tag - (name == "h_parts"))
    with pytest.raises(AssertionError, match="deadlock"):
        run_ranks(ranks, [3, 17], 2, rng)

"""A decoder of the user's own on the GPU megakernel's planner and runtime, without a GPU:
examples/megakernel/parallel_block.py (a parallel attention + MLP block: one norm read by the q|k|v and the
gate/up projections, a GELU-gated MLP, x + (o_proj(attn) + mlp), tied embeddings, weights of its own names).

* it fuses to the device's kinds: the o-proj a plain `linear`, the down-proj `linear_add_residual` (the two adds
  in the graph's order), the gate/up normalising the layer's input row as the q|k|v does;
* the planner lowers it by rule (check_plan holds), binding each weight slot to the graph weight that plays its
  part (one norm for both of a layer's norm slots, the embedding table for the LM head), and the engine uploads
  each weight once;
* the tables, run by the numpy emulator of the device's bodies, compute its reference forward (f32 and bf16), and
  so do the other association of its residual, (x + o) + mlp, and the adds in another order;
* its kernel compiles for sm_90a without spills (f32, bf16);
* what the device cannot hold is refused naming the op and the step function's line.
"""
import numpy as np
import pytest

import mdsl
from mdsl.errors import UnsupportedError
from mdsl.gpu.driver import NoGPUError
from mdsl.ir.dtypes import round_to_dtype
from mdsl.megakernel.modelgraph.checkpoint import random_weights
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.runtime.megakernel_engine import MegakernelEngine, Params, compile_model
from mdsl.megakernel.runtime.shape import LAYER_WEIGHTS, decoder_shape
from mdsl.megakernel.runtime.task_plan import Kind, check_plan, plan_model
from mdsl.megakernel.taskgraph.layer_fusion import fuse
from tests.megakernel.test_runtime_emulation import Emulator
from tests.megakernel.test_runtime_source import assert_fits, compile_plan
from tests.megakernel.tiny import parallel_block_example

PROMPT = [1, 7, 42]
NEW = 16


def _model(dtype: str = "float32", seed: int = 1, layers: int = 2):
    return parallel_block_example().build(layers=layers, positions=len(PROMPT) + NEW, dtype=dtype, seed=seed)


def _plan(config, graph, workers: int = 8):
    plan = plan_model(graph, decoder_shape(config), workers=workers, max_seq=config.max_positions)
    check_plan(plan)
    return plan


def test_the_parallel_block_fuses_to_the_devices_kinds():
    config, graph, weights = _model()
    fused = fuse(graph)
    layer = ["norm_linear", "rope_attention", "norm_gate_up", "linear", "linear_add_residual"]
    assert [n.op for n in fused.nodes] == ["embedding", *layer * config.num_layers, "lm_head_argmax"]
    qkv, _, gate_up, o_proj, down = fused.nodes[1:6]
    assert gate_up.inputs[:2] == qkv.inputs[:2]   # the layer's input row and its one norm weight
    assert gate_up.attr_dict["act"] == "gelu"
    x, addend, residual = down.inputs[:3]
    assert (addend, residual) == (o_proj.output, fused.nodes[0].output)   # x + (o + mlp)
    assert fused.nodes[-1].inputs[2].name == "embed"                     # the tied LM head
    want = ReferenceModel(graph, weights).generate(PROMPT, 6)
    got = ReferenceModel(fused, weights).generate(PROMPT, 6)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_the_planner_binds_each_weight_by_the_part_it_plays():
    config, graph, _ = _model()
    plan = _plan(config, graph)
    ops = {k.kind: k for k in plan.kind_ops}
    assert (ops[Kind.OPROJ].op, ops[Kind.DOWN].op) == ("linear", "linear_add_residual")
    assert ops[Kind.QKV].stream("row") == ops[Kind.GATEUP].stream("row") == ("h", 0)   # both normalise h[l]
    assert ops[Kind.OPROJ].stream("out") == ("mid", 0)                                  # o_proj(attn) alone
    assert (ops[Kind.DOWN].stream("addend"), ops[Kind.DOWN].stream("residual"), ops[Kind.DOWN].stream("out")) == \
        (("mid", 0), ("h", 0), ("h", 1))                                                # h[l] + (o + mlp)
    for layer in range(config.num_layers):
        assert plan.weight("input_layernorm", layer).name == plan.weight("post_attention_layernorm", layer).name \
            == f"layers.{layer}.norm"
        assert [plan.weight(slot, layer).name for slot in ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")] == \
            [f"layers.{layer}.{w}" for w in ("q", "k", "v", "o", "down")]
        assert plan.weight("q_norm", layer) is None
    assert plan.weight("lm_head").name == plan.weight("embed").name == "embed"


def _uploads(config, graph) -> tuple:
    """(the tensors the engine uploads by name, with stand-in addresses; the per-layer pointer table; Params), no
    GPU (the engine's `_upload_weights` with its allocations recorded)."""
    engine = object.__new__(MegakernelEngine)
    engine.shape, engine.max_seq, engine.params = decoder_shape(config), config.max_positions, Params()
    engine.plan = _plan(config, graph)
    uploaded, arrays = [], []

    def weight(weights, name, shape):
        uploaded.append((name, shape))
        return len(uploaded) << 32

    engine._weight, engine._zeros = weight, lambda count, dtype: 0
    engine._array = lambda values, dtype: arrays.append(values) or 0
    engine._upload_weights({})
    return uploaded, arrays[-1].view(np.uint64).reshape(config.num_layers, -1), engine.params


def test_the_engine_uploads_each_weight_once_by_its_graph_name():
    config, graph, _ = _model()
    uploaded, table, params = _uploads(config, graph)
    names = [name for name, _ in uploaded]
    assert sorted(names) == sorted(w.name for w in graph.weights) and len(set(names)) == len(names)
    assert dict(uploaded) == {w.name: w.shape for w in graph.weights}
    assert params.lm_head == params.embed == (names.index("embed") + 1) << 32
    ln1, ln2 = LAYER_WEIGHTS.index("input_layernorm"), LAYER_WEIGHTS.index("post_attention_layernorm")
    for layer, row in enumerate(table):
        assert row[ln1] == row[ln2] == (names.index(f"layers.{layer}.norm") + 1) << 32
        assert row[LAYER_WEIGHTS.index("q_norm")] == row[LAYER_WEIGHTS.index("k_norm")] == 0


@pytest.mark.parametrize("workers", [1, 5, 16])
def test_the_tables_compute_the_reference_forward(workers):
    config, graph, weights = _model()
    want = ReferenceModel(graph, weights).generate(PROMPT, NEW)
    assert len(set(want.tokens)) > 3
    plan = _plan(config, graph, workers)
    got, last_logits = Emulator(plan, config, weights, workers, np.random.default_rng(workers)).run(PROMPT, NEW)
    assert tuple(got) == want.tokens
    np.testing.assert_allclose(last_logits, want.logits[-1], rtol=0, atol=2e-5 * np.abs(want.logits[-1]).max())


def test_the_bf16_tables_round_as_the_device_and_keep_the_reference_tokens():
    config, graph, weights = _model("bfloat16")
    want = ReferenceModel(graph, weights).generate(PROMPT, NEW)
    plan = _plan(config, graph, 9)
    got, logits = Emulator(plan, config, weights, 9, np.random.default_rng(2)).run(PROMPT, NEW)
    assert tuple(got) == want.tokens   # (this seed has no bf16 tie in its 16 tokens)
    assert np.array_equal(logits, round_to_dtype(logits, config.dtype))


def reordered(sequential: bool):
    """The parallel block with other names and its residual added as (x + o) + mlp, the MLP written first
    (`sequential`), or as x + (mlp + o), the o-proj written first."""
    @mdsl.model(name="sequential" if sequential else "o_proj_first")
    def block(m, cfg):
        h, d = cfg.hidden_size, cfg.head_dim
        heads = {"q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": d}
        embed = m.weight("tok", [cfg.vocab_size, h])
        x = m.embedding(embed)
        for i in range(cfg.num_layers):
            def w(name, *shape):
                return m.weight(f"blocks.{i}.{name}", list(shape))

            def mlp():
                return m.linear(m.act_mul(m.linear(normed, w("fc_gate", cfg.intermediate_size, h),
                                                   w("fc_up", cfg.intermediate_size, h)), "gelu"),
                                w("fc_down", h, cfg.intermediate_size))

            def attention():
                qkv = m.linear(normed, w("q", cfg.num_heads * d, h), w("k", cfg.num_kv_heads * d, h),
                               w("v", cfg.num_kv_heads * d, h))
                k_cache, v_cache = m.kv_cache(i, cfg.num_kv_heads, d)
                attn = m.attention(m.rope(qkv, **heads, **cfg.rope.attrs()), k_cache, v_cache, **heads)
                return m.linear(attn, w("out", h, cfg.num_heads * d))

            normed = m.rms_norm(x, w("ln", h), cfg.rms_norm_eps)
            if sequential:
                f = mlp()
                x = m.add(m.add(x, attention()), f)
            else:
                o = attention()
                x = m.add(x, m.add(mlp(), o))
        logits = m.linear(m.rms_norm(x, m.weight("ln_f", [h]), cfg.rms_norm_eps), embed)
        return logits, m.argmax(logits)

    return block


@pytest.mark.parametrize(("sequential", "ops", "streams"), [
    # (x + o) + mlp: the o-proj adds x (into mid), the down-proj adds mid (into the next layer's h)
    (True, ("linear_residual", "linear_residual"), ((("residual", "h", 0), ("out", "mid", 0)),
                                                     (("residual", "mid", 0), ("out", "h", 1)))),
    # x + (mlp + o), the o-proj first: the down-proj alone (into mid), the o-proj adds it and then x
    (False, ("linear_add_residual", "linear"), ((("addend", "mid", 0), ("residual", "h", 0), ("out", "h", 1)),
                                                 (("out", "mid", 0),))),
])
def test_either_order_of_the_parallel_residual_lowers_and_computes_its_reference(sequential, ops, streams):
    config = _model()[0]
    graph = reordered(sequential).trace(config)
    weights = random_weights(graph, seed=3, scale=1.0)
    plan = _plan(config, graph, 7)
    kinds = {k.kind: k for k in plan.kind_ops}
    assert (kinds[Kind.OPROJ].op, kinds[Kind.DOWN].op) == ops
    assert (kinds[Kind.OPROJ].streams, kinds[Kind.DOWN].streams) == streams
    assert plan.weight("post_attention_layernorm", 1).name == "blocks.1.ln" and plan.weight("lm_head").name == "tok"
    want = ReferenceModel(graph, weights).generate(PROMPT, NEW)
    got, _ = Emulator(plan, config, weights, 7, np.random.default_rng(0)).run(PROMPT, NEW)
    assert tuple(got) == want.tokens and len(set(want.tokens)) > 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_parallel_blocks_kernel_compiles_without_spills(dtype):
    config, graph, _ = parallel_block_example().build(positions=64, dtype=dtype)
    plan = plan_model(graph, decoder_shape(config), workers=132, max_seq=64)
    source, _, resources = compile_plan(plan)
    assert_fits(source, resources)
    assert "const float r_sum = round_t(r_addend + r_product);" in source.text       # o + mlp, then x
    assert "const float r_addend = round_t(mid_at(p, t.layer, r));" in source.text
    assert "StreamRow row{{}, p.hs, t.layer, w.ln2};" in source.text                  # the gate/up normalises h
    assert "erff(r_gate" in source.text                                               # exact GELU


@mdsl.model
def stale_mlp(m, cfg):
    """A block whose MLP in layer 1 normalises the row layer 0 began with: no row of the device's layer 1."""
    h, d = cfg.hidden_size, cfg.head_dim
    heads = {"q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": d}
    embed = m.weight("embed", [cfg.vocab_size, h])
    x = first = m.embedding(embed)
    for i in range(cfg.num_layers):
        def w(name, *shape):
            return m.weight(f"layers.{i}.{name}", list(shape))

        qkv = m.linear(m.rms_norm(x, w("norm", h), cfg.rms_norm_eps), w("q", cfg.num_heads * d, h),
                       w("k", cfg.num_kv_heads * d, h), w("v", cfg.num_kv_heads * d, h))
        k_cache, v_cache = m.kv_cache(i, cfg.num_kv_heads, d)
        attn = m.attention(m.rope(qkv, **heads, **cfg.rope.attrs()), k_cache, v_cache, **heads)
        gated = m.act_mul(m.linear(m.rms_norm(first, w("mlp_norm", h), cfg.rms_norm_eps),
                                   w("gate", cfg.intermediate_size, h), w("up", cfg.intermediate_size, h)), "gelu")
        mlp = m.linear(gated, w("down", h, cfg.intermediate_size))
        x = m.add(x, m.add(m.linear(attn, w("o", h, cfg.num_heads * d)), mlp))
    logits = m.linear(m.rms_norm(x, m.weight("final_norm", [h]), cfg.rms_norm_eps), embed)
    return logits, m.argmax(logits)


def test_a_row_the_device_does_not_keep_for_its_layer_is_refused_with_the_line():
    config = _model()[0]
    graph = stale_mlp.trace(config)
    with pytest.raises(UnsupportedError, match=r"cannot run norm_gate_up .*act0 is written twice \(its layer is "
                                               r"that of the row it normalises, t0 \(h0\)\)") as e:
        plan_model(graph, decoder_shape(config), workers=4, max_seq=config.max_positions)
    assert e.value.loc.file.endswith("test_parallel_block.py")
    assert "    gated = m.act_mul(m.linear(m.rms_norm(first" in str(e.value)
    with pytest.raises(UnsupportedError, match="norm_gate_up"):   # before any GPU is needed
        compile_model(stale_mlp, config, {})


def test_compile_model_accepts_it_and_then_needs_the_gpu():
    from mdsl.gpu import has_gpu

    if has_gpu():
        pytest.skip("checks the behaviour without a GPU (tests/gpu/test_megakernel.py runs it on one)")
    config, _, weights = _model()
    with pytest.raises(NoGPUError):
        compile_model(parallel_block_example().parallel_block, config, weights)

"""The architectures added in Python only (Mistral, Phi-3, Gemma-2, Qwen3-MoE): each one's reference forward,
the CPU simulator of its task graph (fused and unfused) token for token over 16+ steps in float32, the
tensor-parallel simulation where its ops split, a checkpoint round trip under its Hugging Face names, and
the GPU planner's tables (Mistral, Phi-3) or its refusal naming the op it has no device body for and the
line of the step function (Gemma-2, Qwen3-MoE).
(test_hf_architectures.py holds the reference forwards to transformers' own model classes.)"""
import random

import attrs
import numpy as np
import pytest

from mdsl.errors import UnsupportedError
from mdsl.gpu.driver import NoGPUError
from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.checkpoint import load_model, save_checkpoint
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.parallel.tensor_parallel import (TensorParallelReference, build_tensor_parallel_task_graph,
                                                      tensor_parallel)
from mdsl.megakernel.parallel.tp_simulator import TensorParallelSimulator
from mdsl.megakernel.runtime.megakernel_engine import compile_model
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.kernel_source import generate_source
from mdsl.megakernel.runtime.task_plan import Kind, check_plan, plan_model
from mdsl.megakernel.taskgraph.layer_fusion import fuse
from mdsl.megakernel.taskgraph.partition import build_task_graph
from mdsl.megakernel.taskgraph.simulator import Simulator
from mdsl.megakernel.taskgraph.tasks import PartitionConfig
from tests.megakernel.tiny import tiny_config_dict, tiny_model

PROMPT = [5, 17, 3]
STEPS = 17                       # new tokens: positions 0..18, well past the tiny sliding windows
PARTITIONS = (PartitionConfig(num_sms=6, kv_splits=3, min_columns=8, attention_min_chunk=2),
              PartitionConfig(num_sms=5, column_align=4, kv_splits=2))
HEADS = {"num_attention_heads": 8, "num_key_value_heads": 4}   # splits over 1, 2 and 4 ranks


def _simulated_equals_reference(graph, weights, seed: int = 0):
    want = ReferenceModel(graph, weights).generate(PROMPT, STEPS)
    assert len(set(want.tokens)) > 3, want.tokens   # a varied sequence: a weak comparison otherwise
    for g in (graph, fuse(graph)):
        for k, partition in enumerate(PARTITIONS):
            got = Simulator(build_task_graph(g, partition), weights).generate(
                PROMPT, STEPS, workers=4, seed=seed + k, dispatch=("queue", "round_robin")[k % 2])
            assert got.tokens == want.tokens
            np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    return want


def _tensor_parallel_equals_reference(graph, weights, world_size: int):
    plan = tensor_parallel(graph, world_size)
    rank_weights = [plan.shard_weights(weights, r) for r in range(world_size)]
    want = ReferenceModel(graph, weights).generate(PROMPT, STEPS)
    over_ranks = TensorParallelReference(plan, rank_weights).generate(PROMPT, STEPS)
    sim = TensorParallelSimulator(build_tensor_parallel_task_graph(plan, PARTITIONS[1]), rank_weights)
    rng = random.Random(world_size)
    got = sim.generate(PROMPT, STEPS, seed=rng.randrange(1 << 30), workers=[rng.randint(1, 4) for _ in range(world_size)])
    assert got.tokens == over_ranks.tokens == want.tokens
    for logits in (got.logits, over_ranks.logits):
        np.testing.assert_allclose(logits, want.logits, rtol=1e-5, atol=1e-5)


def _round_trip(tmp_path, arch: str, graph, weights, **overrides):
    save_checkpoint(str(tmp_path), tiny_config_dict(arch, **overrides), weights)
    loaded = load_model(str(tmp_path))
    assert loaded.config.architecture == arch and loaded.graph.key == graph.key
    assert set(loaded.weights) == set(weights)
    for name, w in weights.items():
        np.testing.assert_array_equal(loaded.weights[name], w)
    got, want = (ReferenceModel(g, w).generate(PROMPT, 4) for g, w in ((loaded.graph, loaded.weights), (graph, weights)))
    assert got.tokens == want.tokens
    np.testing.assert_array_equal(got.logits, want.logits)


def _refused(config, graph, weights, op: str, reason: str, line: str):
    with pytest.raises(UnsupportedError, match=f"cannot run {op} .*{reason}") as e:
        plan_model(graph, decoder_shape(config), workers=4, max_seq=24)
    assert e.value.loc.file.endswith("architectures.py")
    text = str(e.value)
    assert line in text and "^^^" in text
    with pytest.raises(UnsupportedError, match=op):   # before any GPU is needed
        compile_model(step_function(config), config, weights)


# ---------------------------------------------------------------------------------------------
# Mistral: Llama-style, attention over the last sliding_window positions

def _mistral(**overrides):
    return tiny_model("mistral", seed=2, **overrides)


def test_mistral_reads_only_its_sliding_window():
    config, graph, weights = _mistral()
    assert config.sliding_window == 5
    attention = [n for n in graph.nodes if n.op == "scaled_attention"]
    assert len(attention) == config.num_layers and all(n.attr_dict["window"] == 5 for n in attention)
    assert [n.op for n in fuse(graph).nodes].count("rope_scaled_attention") == config.num_layers
    want = _simulated_equals_reference(graph, weights)
    # the window matters: the same weights with full attention differ once the sequence outgrows it ...
    full = attrs.evolve(config, sliding_window=0)
    unwindowed = ReferenceModel(step_function(full).trace(full), weights).generate(PROMPT, STEPS)
    assert np.allclose(unwindowed.logits[:5], want.logits[:5], rtol=1e-5, atol=1e-6)
    assert not np.allclose(unwindowed.logits[5:], want.logits[5:], rtol=1e-3, atol=1e-3)
    # ... and a window as long as the sequence is full attention
    _, wide, _ = _mistral(sliding_window=24)
    np.testing.assert_allclose(ReferenceModel(wide, weights).generate(PROMPT, STEPS).logits, unwindowed.logits,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 4])
def test_mistral_over_tensor_parallel_ranks(world_size):
    _, graph, weights = _mistral(**HEADS)
    _tensor_parallel_equals_reference(graph, weights, world_size)


def test_a_mistral_checkpoint_round_trips(tmp_path):
    _, graph, weights = _mistral()
    _round_trip(tmp_path, "mistral", graph, weights)


def test_mistral_without_a_window_is_the_llama_decoder():
    config, graph, _ = _mistral(sliding_window=None)
    assert config.sliding_window == 0 and "scaled_attention" not in {n.op for n in graph.nodes}


def test_mistral_lowers_to_the_gpu_reading_only_its_window():
    """The device's attention reads the window's positions (the kernel's WINDOW section, each layer's window in
    its table); a window as long as the KV cache is plain causal attention, the kernel of a model without one."""
    config, graph, weights = _mistral()
    plan = plan_model(graph, decoder_shape(config), workers=4, max_seq=24)
    check_plan(plan)
    assert plan.op_of(Kind.ATTN).op == "rope_scaled_attention" and plan.attention_window == config.sliding_window == 5
    text = generate_source(plan).text
    assert "__constant__ int LAYER_WINDOW[L] = {5, 5};" in text and "pos + 1 - window" in text
    with pytest.raises(NoGPUError):   # lowered on any machine; then it needs the GPU
        compile_model(step_function(config), config, weights)
    sources = []
    for window in (24, None):   # the KV cache's 24 positions, or no sliding window
        config, graph, _ = _mistral(sliding_window=window)
        plan = plan_model(graph, decoder_shape(config), workers=4, max_seq=24)
        assert plan.attention_window == 0
        sources.append(generate_source(plan).text)
    assert "WINDOW" not in sources[0] and sources[0] == sources[1]


@pytest.mark.parametrize("option", [{"softcap": 2.0}, {"scale": 0.3}])
def test_a_windowed_attention_with_its_own_scale_or_soft_cap_lowers_to_the_gpu(option):
    """The device's attention scales scores by the op's scale (SCALE) and soft-caps them as eager attention does
    (the SOFTCAP section: Gemma-2's)."""
    config, graph, _ = _mistral()
    graph = attrs.evolve(graph, nodes=tuple(
        attrs.evolve(n, attrs=n.opdef.normalize_attrs({**n.attr_dict, **option})) if n.op == "scaled_attention"
        else n for n in graph.nodes))
    plan = plan_model(graph, decoder_shape(config), workers=4, max_seq=24)
    check_plan(plan)
    attention = plan.op_of(Kind.ATTN).attr_dict
    assert {name: attention[name] for name in option} == option
    text = generate_source(plan).text
    assert ("constexpr float SOFTCAP = 2.0f;" in text) == ("softcap" in option)
    assert f"constexpr float SCALE = {option.get('scale', config.head_dim ** -0.5)!r}f;" in text


# ---------------------------------------------------------------------------------------------
# Phi-3: the q|k|v and gate|up projections one weight each in the checkpoint, a sliding window

def _phi3(**overrides):
    return tiny_model("phi3", seed=1, **overrides)


def test_phi3_reads_its_fused_projections_as_the_fused_rows():
    config, graph, weights = _phi3()
    assert config.fused_projections and config.sliding_window == 7
    names = {w.name for w in graph.weights}
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= names
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
    _simulated_equals_reference(graph, weights, seed=5)
    # the same computation as the decoder with the projections split: Mistral's on the split weights
    mistral = tiny_config_dict("mistral", sliding_window=7)
    split = dict(weights)
    for i in range(config.num_layers):
        p, (q, kv, inter) = f"model.layers.{i}.", (config.num_heads * 8, config.num_kv_heads * 8, 48)
        qkv, gate_up = split.pop(p + "self_attn.qkv_proj.weight"), split.pop(p + "mlp.gate_up_proj.weight")
        split.update({p + "self_attn.q_proj.weight": qkv[:q], p + "self_attn.k_proj.weight": qkv[q:q + kv],
                      p + "self_attn.v_proj.weight": qkv[q + kv:], p + "mlp.gate_proj.weight": gate_up[:inter],
                      p + "mlp.up_proj.weight": gate_up[inter:]})
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    other = config_from_dict(mistral)
    np.testing.assert_allclose(ReferenceModel(step_function(other).trace(other), split).generate(PROMPT, STEPS).logits,
                               ReferenceModel(graph, weights).generate(PROMPT, STEPS).logits, rtol=1e-5, atol=1e-5)


def test_a_phi3_checkpoint_round_trips(tmp_path):
    _, graph, weights = _phi3()
    _round_trip(tmp_path, "phi3", graph, weights)


@pytest.mark.parametrize("rope", [{"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                                                    "long_factor": [2.0] * 4}},
                                  {"partial_rotary_factor": 0.5},
                                  {"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.75}}])
def test_phi3_rope_variants_are_refused_by_the_config(rope):
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    with pytest.raises(UnsupportedError, match="longrope|partial_rotary_factor") as e:
        config_from_dict(tiny_config_dict("phi3", **rope))
    assert e.value.hint


@pytest.mark.parametrize("window", [7, None])
def test_phi3_lowers_to_the_gpu_reading_its_fused_weights(window):
    """The device reads the checkpoint's qkv_proj and gate_up_proj (the engine points its q, k, v and gate,
    up weights into their rows: test_runtime_engine.py), and attention reads Phi-3's window."""
    config, graph, weights = _phi3(sliding_window=window)
    plan = plan_model(graph, decoder_shape(config), workers=4, max_seq=24)
    check_plan(plan)
    fused = fuse(graph)
    reads = {n.op: [v.name for v in n.inputs[2:]] for n in fused.nodes if n.op in ("norm_linear", "norm_gate_up")}
    assert reads == {"norm_linear": ["model.layers.1.self_attn.qkv_proj.weight"],
                     "norm_gate_up": ["model.layers.1.mlp.gate_up_proj.weight"]}
    assert plan.attention_window == (window or 0)
    with pytest.raises(NoGPUError):
        compile_model(step_function(config), config, weights)


def test_phi3_is_not_split_over_ranks_with_a_clear_error():
    """A fused q|k|v weight's rows dealt out evenly would hand a rank the wrong heads: the split refuses it."""
    _, graph, _ = _phi3(**HEADS)
    with pytest.raises(UnsupportedError, match="q\\|k\\|v row of a column-parallel projection"):
        tensor_parallel(graph, 2)


# ---------------------------------------------------------------------------------------------
# Gemma-2: scaled embeddings, (1 + weight) norms before and after attention and the MLP, GeGLU, query scaling,
# soft-capped scores and logits, a sliding window on every other layer

def _gemma2(**overrides):
    return tiny_model("gemma2", seed=3, **overrides)


def test_gemma2_runs_in_the_simulator_as_in_the_reference_forward():
    config, graph, weights = _gemma2(num_hidden_layers=3)
    assert config.sliding_layers == (True, False, True) and config.attention_scale == 12 ** -0.5
    windows = [n.attr_dict["window"] for n in graph.nodes if n.op == "scaled_attention"]
    assert windows == [4, 0, 4]
    ops = [n.op for n in graph.nodes]
    assert ops.count("rms_norm_1p") == 4 * 3 + 1 and ops[1] == "scale" and ops[-2] == "softcap"
    want = _simulated_equals_reference(graph, weights, seed=11)
    # each Gemma-2 feature changes the forward: the soft-caps, the query scale, the window
    for change in ({"final_logit_softcapping": None}, {"attn_logit_softcapping": None},
                   {"query_pre_attn_scalar": 8}, {"layer_types": ["full_attention"] * 3}):
        _, other, _ = _gemma2(num_hidden_layers=3, **change)
        assert not np.allclose(ReferenceModel(other, weights).generate(PROMPT, STEPS).logits, want.logits,
                               rtol=1e-3, atol=1e-3), change
    assert np.abs(want.logits).max() < 3.0   # capped at final_logit_softcapping


@pytest.mark.parametrize("world_size", [2, 4])
def test_gemma2_over_tensor_parallel_ranks(world_size):
    _, graph, weights = _gemma2(**HEADS)
    _tensor_parallel_equals_reference(graph, weights, world_size)


def test_a_gemma2_checkpoint_round_trips(tmp_path):
    _, graph, weights = _gemma2()
    _round_trip(tmp_path, "gemma2", graph, weights)


@pytest.mark.parametrize(("change", "message"), [({"hidden_activation": "relu"}, "hidden_activation"),
                                                 ({"layer_types": ["full_attention"]}, "layer_types")])
def test_gemma2_config_errors(change, message):
    from mdsl.errors import MdslError
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    with pytest.raises(MdslError, match=message) as e:
        config_from_dict(tiny_config_dict("gemma2", **change))
    assert e.value.hint


def test_gemma2_lowers_to_the_gpu_by_its_ops_rules():
    """Every Gemma-2 op has its device body: the scaled embedding (EMBED_SCALE), (1 + weight) norms (NORM_1P,
    LM_HEAD_1P), the o-proj's and down-proj's rows normalised before their residual adds (ROW_NORM), soft-capped
    scores (SOFTCAP) and logits, GeGLU; its attention one device body whether its window is at least the KV cache
    (no WINDOW section) or shorter on every other layer (each layer's window in the WINDOW section's table)."""
    config, graph, _ = _gemma2()
    short = step_function(config).trace(config, max_positions=4)   # (the window: 4)
    plan = plan_model(short, decoder_shape(config), workers=4, max_seq=4)
    check_plan(plan)
    ops = {k.kind: k.op for k in plan.kind_ops}
    assert ops == {Kind.QKV: "norm_1p_linear", Kind.ATTN: "rope_scaled_attention", Kind.OPROJ: "linear_norm_residual",
                   Kind.GATEUP: "norm_geglu", Kind.DOWN: "linear_norm_residual", Kind.LMHEAD: "lm_head_1p_argmax",
                   Kind.SAMPLE: "lm_head_1p_argmax"}
    assert plan.op_of(Kind.ATTN).attr_dict["window"] == 0 and plan.attention_window == 0
    text = generate_source(plan).text
    for constant in ("SOFTCAP = 2.0f", f"EMBED_SCALE = {float(np.float32(config.hidden_size ** 0.5))!r}f",
                     f"SCALE = {12 ** -0.5!r}f"):
        assert f"constexpr float {constant};" in text, constant
    assert "norm_residual_row<NormedRow1p<H>>" in text and "StreamRow1p row" in text and "LAYER_WINDOW" not in text
    long = plan_model(graph, decoder_shape(config), workers=4, max_seq=24)
    check_plan(long)
    assert long.windows == (4, 0) and long.op_of(Kind.ATTN).attr_dict["window"] == 0
    assert "__constant__ int LAYER_WINDOW[L] = {4, 0};" in generate_source(long).text
    with pytest.raises(UnsupportedError, match="windows differ"):
        long.attention_window


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE: top-k softmax routing over E experts; only the picked experts' weights are read

def _qwen3_moe(**overrides):
    return tiny_model("qwen3_moe", seed=1, **overrides)


def _picked_experts(graph, weights) -> list:
    """Per step, per layer, the experts the reference forward's router picks."""
    routers = [n for n in graph.nodes if n.op == "moe_router"]
    picked = []
    reference = ReferenceModel(graph, weights)
    from mdsl.megakernel.modelgraph.layers import StepContext
    from mdsl.megakernel.modelgraph.reference import initial_states
    states = initial_states(graph, PROMPT)
    for pos in range(len(PROMPT) - 1 + STEPS):
        values = {**reference.weights, **states}
        for node in graph.nodes:
            outs = node.opdef.reference([values[v.name] for v in node.inputs], node.attr_dict,
                                        StepContext(pos, len(PROMPT)))
            values.update({v.name: out for v, out in zip(node.outputs, outs)})
        picked.append([tuple(np.flatnonzero(values[r.output.name].reshape(-1))) for r in routers])
    return picked


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_runs_in_the_simulator_reading_only_the_picked_experts(norm_topk_prob):
    config, graph, weights = _qwen3_moe(norm_topk_prob=norm_topk_prob)
    assert [n.op for n in graph.nodes].count("moe_experts") == config.num_layers
    _simulated_equals_reference(graph, weights, seed=7)
    picked = _picked_experts(graph, weights)
    assert all(len(layer) == config.experts_per_token for step in picked for layer in step)
    assert len({layer for step in picked for layer in step}) > 3    # the choice changes with the token
    expected = {}
    for step in picked:
        for layer, experts in enumerate(step):
            for e in experts:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                    expected[name] = expected.get(name, 0) + weights[name].size * 4
    for g in (graph, fuse(graph)):
        sim = Simulator(build_task_graph(g, PARTITIONS[0]), weights)
        sim.generate(PROMPT, STEPS, workers=3, seed=2)
        read = {n: b for n, b in sim.weight_bytes_read.items() if ".mlp.experts." in n}
        assert read == expected
        # the router and the dense weights are read at every step
        steps = len(PROMPT) - 1 + STEPS
        assert sim.weight_bytes_read["model.layers.1.mlp.gate.weight"] == steps * weights[
            "model.layers.1.mlp.gate.weight"].size * 4
    # top_k of E experts' bytes per layer and step, not all E
    per_expert = 3 * config.moe_intermediate_size * config.hidden_size * 4
    assert sum(expected.values()) == steps * config.num_layers * config.experts_per_token * per_expert


def test_qwen3_moe_dense_layers_and_routing():
    config, graph, _ = _qwen3_moe(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert config.dense_layers == (0, 2, 3) and [config.sparse(i) for i in range(4)] == [False, True, False, False]
    assert [n.op for n in graph.nodes].count("moe_experts") == 1
    from mdsl.megakernel.modelgraph.layers import route
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.0], np.float32)
    r = route(logits, 2, True).reshape(-1)
    assert list(np.flatnonzero(r)) == [1, 3] and np.isclose(r.sum(), 1.0)
    p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    np.testing.assert_allclose(route(logits, 3, False).reshape(-1)[[1, 3, 4]], p[[1, 3, 4]], rtol=1e-6)


def test_a_qwen3_moe_config_may_name_its_experts_num_local_experts():
    """transformers 5's save_pretrained writes num_local_experts; the Hub's configs num_experts."""
    from mdsl.megakernel.modelgraph.model_config import config_from_dict

    raw = tiny_config_dict("qwen3_moe")
    raw["num_local_experts"] = raw.pop("num_experts")
    assert config_from_dict(raw).num_experts == 6


def test_a_qwen3_moe_checkpoint_round_trips(tmp_path):
    _, graph, weights = _qwen3_moe()
    _round_trip(tmp_path, "qwen3_moe", graph, weights)


def test_qwen3_moe_lowers_to_the_device_by_the_fused_ops_rules_and_is_refused_over_ranks():
    config, graph, weights = _qwen3_moe(num_hidden_layers=3, mlp_only_layers=[1])
    plan = plan_model(graph, decoder_shape(config), workers=4, max_seq=24)
    check_plan(plan)
    assert {k.kind: k.op for k in plan.kind_ops if k.op.startswith("norm_moe")} == {
        Kind.ROUTER: "norm_moe_router", Kind.EXPERT_UP: "norm_moe_experts_residual",
        Kind.EXPERT_DOWN: "norm_moe_experts_residual"}
    assert {t.layer for t in plan.tasks if t.kind is Kind.ROUTER} == {0, 2}   # layer 1's MLP is dense
    assert {t.layer for t in plan.tasks if t.kind is Kind.GATEUP} == {1}
    # the up tiles cover every slot's hidden columns once (slot j's rows j * MI ..)
    up = sorted((t.begin, t.end) for t in plan.tasks if t.kind is Kind.EXPERT_UP and t.layer == 0)
    assert up[0][0] == 0 and up[-1][1] == config.experts_per_token * config.moe_intermediate_size
    assert all(a[1] == b[0] for a, b in zip(up, up[1:]))
    # each expert's gate, up and down weight fills its slot of the layer's expert table
    for e in range(config.num_experts):
        bound = plan.weight(f"expert_down.{e}", 2)
        assert bound.name == f"model.layers.2.mlp.experts.{e}.down_proj.weight" and bound.row == 0
    assert plan.weight("router", 0).name == "model.layers.0.mlp.gate.weight" and plan.weight("router", 1) is None
    assert "constexpr int MOE_K = 2;" in generate_source(plan).text
    from mdsl.megakernel.runtime.task_plan import DEVICE_RULES, NotOnDevice
    assert all(isinstance(DEVICE_RULES[op], NotOnDevice) for op in ("moe_router", "moe_experts"))
    with pytest.raises(UnsupportedError, match="moe_router .*mixture of experts is not split"):
        tensor_parallel(graph, 2)


def test_a_mixture_of_experts_of_an_unnormalised_row_is_refused_for_the_gpu():
    """The device's experts read a normalised row of the residual stream (norm_moe_experts_residual): a step function
    whose experts read the row itself keeps moe_experts, which is refused naming its line."""
    import mdsl

    @mdsl.model
    def unnormalised(m, cfg):
        h, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        embed = m.weight("model.embed_tokens.weight", [cfg.vocab_size, h])
        x = m.embedding(embed)
        routing = m.moe_router(m.rms_norm(x, m.weight("norm", [h]), cfg.rms_norm_eps), m.weight("gate", [e, h]),
                               top_k=cfg.experts_per_token, norm_topk_prob=cfg.norm_topk_prob)
        weights = [m.weight(f"e{k}.{proj}", shape) for proj, shape in
                   (("gate", [inter, h]), ("up", [inter, h]), ("down", [h, inter])) for k in range(e)]
        x = m.add(x, m.moe_experts(x, routing, *weights))
        logits = m.linear(m.rms_norm(x, m.weight("model.norm.weight", [h]), cfg.rms_norm_eps), embed)
        return logits, m.argmax(logits)

    config, _, _ = _qwen3_moe()
    with pytest.raises(UnsupportedError, match="cannot run moe_experts .*routed by a moe_router") as e:
        plan_model(unnormalised.trace(config, max_positions=24), decoder_shape(config), workers=4, max_seq=24)
    assert "m.moe_experts(x, routing" in str(e.value)


@pytest.mark.parametrize("arch", ["gemma2", "mistral", "qwen3_moe"])
def test_an_architectures_sampling_model_is_its_greedy_model_up_to_the_last_op(arch):
    """sampling_decode builds each architecture's own forward (Gemma-2's is not the shared decoder's), then samples."""
    from mdsl.megakernel.modelgraph.architectures import sampling_decode

    config, greedy, _ = tiny_model(arch)
    sampling = sampling_decode(arch, temperature=0.7, top_p=0.9, seed=3).trace(config)
    assert [n.op for n in sampling.nodes[:-1]] == [n.op for n in greedy.nodes[:-1]]
    assert (greedy.nodes[-1].op, sampling.nodes[-1].op) == ("argmax", "sample")
    assert sampling.weights == greedy.weights


# ---------------------------------------------------------------------------------------------
# Qwen2-MoE: Qwen2's attention (q|k|v biases), routed experts and a shared expert scaled by sigmoid of its gate

def test_qwen2_moe_runs_in_the_simulator_with_its_shared_expert():
    config, graph, weights = tiny_model("qwen2_moe", seed=6)
    assert config.shared_expert_size == 24 and config.dense_layers == (1,)
    ops = [n.op for n in graph.nodes]
    assert ops.count("moe_experts") == ops.count("gated_scale") == 2 and ops.count("add_bias") == 3
    want = _simulated_equals_reference(graph, weights, seed=3)
    # the shared expert's gate matters: with its weights 0 (sigmoid(0) = 1/2 scales the shared expert) other logits
    halved = {**weights, **{n: np.zeros_like(w) for n, w in weights.items() if n.endswith("shared_expert_gate.weight")}}
    assert not np.allclose(ReferenceModel(graph, halved).generate(PROMPT, STEPS).logits, want.logits, rtol=1e-3)


def test_a_qwen2_moe_checkpoint_round_trips(tmp_path):
    _, graph, weights = tiny_model("qwen2_moe", seed=6)
    _round_trip(tmp_path, "qwen2_moe", graph, weights)


def test_qwen2_moe_is_refused_for_the_gpu_naming_its_shared_experts_gate_and_over_ranks():
    """The device has no body for the shared expert's gated output (gated_scale): refused at its line before any other
    op; tensor parallelism refuses the mixture of experts."""
    config, graph, weights = tiny_model("qwen2_moe", seed=6)
    _refused(config, graph, weights, "gated_scale", "no device lowering: the device has no body scaling a row",
             "m.gated_scale(shared, gate")
    with pytest.raises(UnsupportedError, match="not split over ranks"):
        tensor_parallel(graph, 2)


def test_qwen2_moe_config_errors():
    from mdsl.errors import MdslError
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    for change, message in (({"qkv_bias": False}, "qkv_bias"), ({"shared_expert_intermediate_size": 0},
                                                                "shared_expert_intermediate_size")):
        with pytest.raises(MdslError, match=message) as e:
            config_from_dict(tiny_config_dict("qwen2_moe", **change))
        assert e.value.hint

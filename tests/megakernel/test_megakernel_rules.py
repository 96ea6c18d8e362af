"""The megakernel lowers a model graph by its layer ops' rules, not by recognising an architecture:

* every layer op has every rule the megakernel's consumers need (its numpy reference, task partition, numpy
  task bodies for every task kind it makes, device lowering or the reason it has none, a CUDA body for each
  op the device lowers, a tensor-parallel split or the reason it has none);
* a step function written by a user that computes the built-in decoder lowers to the built-in's tables;
* Qwen2 (q|k|v biases) runs in the reference forward, the CPU simulator and tensor parallelism on the CPU,
  and lowers to the GPU's tables, its biases in the q|k|v projection's epilogue; an add_bias that the
  device cannot fold into it is refused naming add_bias and the line of the step function, with a caret;
* the tiny configurations' device tables, source and layout keep their digests
  (scripts/dump_megakernel_plans.py golden).
"""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import mdsl
from mdsl.errors import UnsupportedError
from mdsl.gpu.driver import NoGPUError
from mdsl.megakernel.modelgraph.architectures import sampling_decode, step_function
from mdsl.megakernel.modelgraph.checkpoint import load_model, save_checkpoint
from mdsl.megakernel.modelgraph.epilogues import EPILOGUE_RULES
from mdsl.megakernel.modelgraph.layers import LAYER_OPS
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.parallel.tensor_parallel import SHARD_RULES, NotSharded, ShardRule, tensor_parallel
from mdsl.megakernel.runtime.cuda_bodies import CUDA_TASK_RULES
from mdsl.megakernel.runtime.megakernel_engine import compile_model, device_plan
from mdsl.megakernel.runtime.megakernel_options import MegakernelOptions
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import (DEVICE_RULES, DeviceRule, Kind, NotOnDevice, build_plan, check_plan,
                                               plan_model)
from mdsl.megakernel.taskgraph.layer_fusion import fuse
from mdsl.megakernel.taskgraph.numpy_bodies import TASK_BODIES
from mdsl.megakernel.taskgraph.partition import TASK_RULES, build_task_graph
from mdsl.megakernel.taskgraph.simulator import Simulator
from mdsl.megakernel.taskgraph.tasks import PartitionConfig
from tests.megakernel.tiny import parallel_block_example, tiny_config_dict, tiny_model

PROMPT = [5, 17, 3]
REPO = Path(__file__).resolve().parents[2]


def test_every_layer_op_has_every_megakernel_rule():
    for name, op in LAYER_OPS.items():
        assert callable(op.reference), name
        assert name in TASK_RULES and name in TASK_BODIES, name
        device = DEVICE_RULES.get(name)
        assert isinstance(device, (DeviceRule, NotOnDevice)), f"{name}: no device lowering and no reason"
        if isinstance(device, NotOnDevice):
            assert device.reason.strip(), name
        else:
            assert name in CUDA_TASK_RULES, f"{name} lowers to device rows without a CUDA body"
        shard = SHARD_RULES.get(name)
        assert isinstance(shard, (ShardRule, NotSharded)), f"{name}: no tensor-parallel split and no reason"
        assert isinstance(shard, ShardRule) or shard.reason.strip(), name
    # the device's linears' element-wise epilogues, which the numpy and CUDA bodies both evaluate
    for name in ("linear", "norm_linear", "norm_gate_up", "linear_residual", "linear_add_residual", "lm_head_argmax",
                 "lm_head_sample"):
        assert name in EPILOGUE_RULES, name


def _task_graphs():
    for arch in ("llama3", "mistral", "phi3", "qwen2", "qwen3"):
        config, graph, _ = tiny_model(arch, num_attention_heads=8, num_key_value_heads=4)
        sampling = sampling_decode(arch, temperature=0.7, seed=1).trace(config)
        split = () if config.fused_projections else (tensor_parallel(graph, 2).graph, tensor_parallel(sampling, 2).graph)
        for g in (graph, fuse(graph), sampling, fuse(sampling), *split):
            yield build_task_graph(g, PartitionConfig(num_sms=5, column_align=4, kv_splits=2))
    config, graph, _ = tiny_model("gemma2", num_attention_heads=8, num_key_value_heads=4)
    sampling = sampling_decode("gemma2", temperature=0.7, seed=1).trace(config)
    for g in (graph, fuse(graph), tensor_parallel(graph, 2).graph, fuse(sampling)):
        yield build_task_graph(g, PartitionConfig(num_sms=5, column_align=4, kv_splits=2))
    for arch in ("qwen3_moe", "qwen2_moe"):   # (not split over ranks)
        config, graph, _ = tiny_model(arch)
        for g in (graph, fuse(graph)):
            yield build_task_graph(g, PartitionConfig(num_sms=5, column_align=4, kv_splits=2))
    _, graph, _ = parallel_block_example().build(layers=2, positions=24)   # a user's: linear_add_residual
    for g in (graph, fuse(graph)):
        yield build_task_graph(g, PartitionConfig(num_sms=5, column_align=4, kv_splits=2))


def test_the_numpy_bodies_cover_every_task_kind_the_partitions_make():
    seen = set()
    for task_graph in _task_graphs():
        for t in task_graph.tasks:
            op = task_graph.model.nodes[t.node].op
            assert t.kind in TASK_BODIES[op].bodies, f"{op} makes {t.kind} tasks without a body"
            seen.add(op)
    assert seen == set(LAYER_OPS)


@mdsl.model
def my_decoder(m, cfg):
    """The Llama-3 / Qwen3 decoder as a user writes it: no code of mdsl's built-in step functions."""
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    heads = {"q_heads": hq, "kv_heads": hkv, "head_dim": d}
    embed = m.weight("model.embed_tokens.weight", [cfg.vocab_size, h])
    x = m.embedding(embed)
    for i in range(cfg.num_layers):
        def w(name, *shape):
            return m.weight(f"model.layers.{i}.{name}.weight", list(shape))

        qkv = m.linear(m.rms_norm(x, w("input_layernorm", h), cfg.rms_norm_eps), w("self_attn.q_proj", hq * d, h),
                       w("self_attn.k_proj", hkv * d, h), w("self_attn.v_proj", hkv * d, h))
        if cfg.qkv_bias:   # (one bias vector for the three weights: not the device's q|k|v biases)
            qkv = m.add_bias(qkv, m.weight(f"model.layers.{i}.self_attn.qkv_bias", [(hq + 2 * hkv) * d]))
        if cfg.qk_norm:
            qkv = m.head_rms_norm(qkv, w("self_attn.q_norm", d), w("self_attn.k_norm", d), eps=cfg.rms_norm_eps,
                                  **heads)
        k_cache, v_cache = m.kv_cache(i, hkv, d)
        attn = m.attention(m.rope(qkv, **heads, **cfg.rope.attrs()), k_cache, v_cache, **heads)
        x = m.add(m.linear(attn, w("self_attn.o_proj", h, hq * d)), x)
        normed = m.rms_norm(x, w("post_attention_layernorm", h), cfg.rms_norm_eps)
        act = m.act_mul(m.linear(normed, w("mlp.gate_proj", cfg.intermediate_size, h),
                                 w("mlp.up_proj", cfg.intermediate_size, h)), cfg.hidden_act)
        x = m.add(x, m.linear(act, w("mlp.down_proj", h, cfg.intermediate_size)))
    head = embed if cfg.tie_word_embeddings else m.weight("lm_head.weight", [cfg.vocab_size, h])
    logits = m.linear(m.rms_norm(x, m.weight("model.norm.weight", [h]), cfg.rms_norm_eps), head)
    return logits, m.argmax(logits)


def _same_plan(a, b) -> None:
    for x, y in zip(a.tables(), b.tables()):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.initial_events(), b.initial_events())
    assert (a.splits, a.min_chunk, a.lm_tiles, a.kind_ops) == (b.splits, b.min_chunk, b.lm_tiles, b.kind_ops)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
@pytest.mark.parametrize("workers", [4, 9])
def test_a_users_step_function_of_the_decoder_lowers_to_the_builtin_tables(arch, workers):
    config, _, weights = tiny_model(arch)
    graph = my_decoder.trace(config, max_positions=24)
    assert graph.key != step_function(config).trace(config, max_positions=24).key   # another op order
    options = MegakernelOptions()
    _same_plan(device_plan(config, graph, workers=workers, max_seq=24, options=options),
               build_plan(decoder_shape(config), workers=workers, max_seq=24))
    _same_plan(device_plan(config, None, workers=workers, max_seq=24, options=options),
               build_plan(decoder_shape(config), workers=workers, max_seq=24))
    with pytest.raises(NoGPUError):   # lowered on any machine; then it needs the GPU
        compile_model(my_decoder, config, weights, max_seq=24)


def _qwen2(seed: int = 4):
    return tiny_model("qwen2", seed=seed)


def test_qwen2_runs_in_the_simulator_as_in_the_reference_forward():
    config, graph, weights = _qwen2()
    assert config.qkv_bias and not config.qk_norm
    biases = [n for n in graph.nodes if n.op == "add_bias"]
    assert len(biases) == config.num_layers
    assert [v.name for v in biases[0].inputs[1:]] == [f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"]
    want = ReferenceModel(graph, weights).generate(PROMPT, 6)
    assert len(set(want.tokens)) > 1
    fused = fuse(graph)
    assert [n.op for n in fused.nodes[1:3]] == ["norm_linear_bias", "rope_attention"]
    for g in (graph, fused):
        got = Simulator(build_task_graph(g, PartitionConfig(num_sms=6, kv_splits=2, min_columns=8,
                                                            attention_min_chunk=2)), weights).generate(
            PROMPT, 6, workers=4, seed=3)
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    # the biases matter: without them the forward differs
    unbiased = {k: (np.zeros_like(v) if k.endswith(".bias") else v) for k, v in weights.items()}
    assert not np.allclose(ReferenceModel(graph, unbiased).generate(PROMPT, 6).logits, want.logits)


def test_qwen2_lowers_to_the_gpu_with_its_biases_in_the_qkv_epilogue():
    config, graph, weights = _qwen2()
    plan = plan_model(graph, decoder_shape(config), workers=4, max_seq=24)
    check_plan(plan)
    assert plan.op_of(Kind.QKV).op == "norm_linear_bias"
    with pytest.raises(NoGPUError):   # lowered on any machine; then it needs the GPU
        compile_model(step_function(config), config, weights)


def test_an_add_bias_the_device_cannot_fold_is_refused_naming_it_and_its_line():
    """One bias vector for the three q|k|v weights is no bias per weight: norm_linear_bias does not take it."""
    config, _, _ = _qwen2()
    graph = my_decoder.trace(config, max_positions=24)
    assert "add_bias" in [n.op for n in fuse(graph).nodes]
    with pytest.raises(UnsupportedError, match=r"cannot run add_bias .*adds biases only to the q\|k\|v projection") as e:
        plan_model(graph, decoder_shape(config), workers=4, max_seq=24)
    assert e.value.loc.file.endswith("test_megakernel_rules.py")
    text = str(e.value)
    assert "qkv = m.add_bias(qkv, m.weight(" in text and "^^^" in text
    with pytest.raises(UnsupportedError, match="add_bias"):   # before any GPU is needed
        compile_model(my_decoder, config, {})


def test_a_qwen2_checkpoint_loads_with_its_biases(tmp_path):
    config, graph, weights = _qwen2()
    save_checkpoint(str(tmp_path), tiny_config_dict("qwen2"), weights)
    loaded = load_model(str(tmp_path))
    assert loaded.config.architecture == "qwen2" and loaded.graph.key == graph.key
    assert ReferenceModel(loaded.graph, loaded.weights).generate(PROMPT, 4).tokens == \
        ReferenceModel(graph, weights).generate(PROMPT, 4).tokens


def _dump_script():
    spec = importlib.util.spec_from_file_location("dump_megakernel_plans", REPO / "scripts" / "dump_megakernel_plans.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_the_tiny_configurations_keep_their_device_tables_source_and_layout():
    """The digests of what the engine would put on the GPU (scripts/dump_megakernel_plans.py golden: its
    tables, source text and device layout), committed where they were made; a change meant to alter them
    regenerates the file."""
    script = _dump_script()
    lines = script.GOLDEN.read_text().splitlines()
    golden = dict(reversed(line.split("  ")) for line in lines)
    chosen = script.configurations()
    assert set(golden) == {n for n in chosen if n.startswith(("tiny-", "gpu-tiny-"))}
    changed = [name for name in sorted(golden) if script.digest_of(name, chosen[name]) != golden[name]]
    assert not changed, f"the dumps of {changed} changed (scripts/dump_megakernel_plans.py dump shows them)"

"""The GPU serving device's parts that need no GPU: its rule table covers the ops the CPU device serves,
its step kernels compile for the H200 without spills, and without a GPU `device="gpu"` says so. Its
behaviour on a GPU is tests/gpu/test_gpu_serving.py's."""
from __future__ import annotations

import pytest

from mdsl import LLM
from mdsl.gpu import has_gpu
from mdsl.gpu.driver import NoGPUError
from mdsl.serving.gpu import GPU_STEP_RULES, GROUPS, kernel_source
from mdsl.serving.steprules import STEP_RULES


def test_the_gpu_rules_cover_the_ops_the_cpu_device_serves():
    assert set(GPU_STEP_RULES) == set(STEP_RULES)


def test_the_step_kernels_compile_for_sm_90a_without_spills():
    from mdsl.backend.cuda.nvrtc import compile_cuda

    resources = compile_cuda(kernel_source(), arch="sm_90a").resources
    weighted = ("embedding", "rms_norm", "linear", "add_bias", "head_rms_norm", "head_norm_rope", "kv_append")
    expected = {f"{name}_{s}" for name in weighted for s in ("f32", "bf16", "f16")}
    expected |= {f"{name}_{s}" for name in ("linear_mma",) for s in ("bf16", "f16")}
    expected |= {f"attention_{g}_{dv}_{s}" for dv, groups in GROUPS.items() for g in groups
                 for s in ("f32", "bf16", "f16")}   # (pools of each dtype)
    expected |= {"rope", "act_mul", "add", "gather", "argmax_rows", "map_rows"}
    assert set(resources) == expected
    for name, r in resources.items():
        assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, (name, r)


@pytest.mark.skipif(has_gpu(), reason="a GPU is present")
def test_without_a_gpu_the_gpu_device_says_so(checkpoints):
    with pytest.raises(NoGPUError):
        LLM(checkpoints["llama3"].folder, device="gpu")


def _graph(arch: str):
    from mdsl.megakernel.modelgraph.architectures import step_function
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    from tests.megakernel.tiny import tiny_config_dict

    config = config_from_dict(tiny_config_dict(arch))
    return step_function(config).trace(config)


@pytest.mark.parametrize("arch", ["llama3", "gemma2"])
def test_each_residual_add_runs_in_the_linear_before_it(arch):
    """The o-proj's and down-proj's adds fuse into them (Llama); Gemma-2's post-norms sit between the linear
    and the add, so nothing fuses there; never across the narrowing."""
    from mdsl.serving.gpu import residual_adds

    graph = _graph(arch)
    nodes = list(graph.nodes)
    narrow_at = 1 + max(i for i, n in enumerate(nodes) if n.op in ("attention", "scaled_attention"))
    fused = residual_adds(nodes, narrow_at, {graph.logits.name})
    layers = sum(n.op in ("attention", "scaled_attention") for n in nodes)
    if arch == "llama3":
        assert len(fused) == 2 * layers
    else:
        assert not fused
    for i, other in fused.items():
        linear, add = nodes[i], nodes[i + 1]
        assert (linear.op, add.op) == ("linear", "add") and i + 1 != narrow_at
        assert {v.name for v in add.inputs} == {linear.outputs[0].name, other}
        assert sum(v.name == linear.outputs[0].name for n in nodes for v in n.inputs) == 1
    # the same graph with its narrowing just past a linear: that pair stays apart
    first = min(fused) if fused else None
    if first is not None:
        assert first not in residual_adds(nodes, first + 1, {graph.logits.name})


def test_a_linears_weights_run_side_by_side_in_launches_of_one_dtype():
    import attrs

    from mdsl.ir.dtypes import bf16, f32
    from mdsl.serving.gpu import MAX_PARTS, Operand, linear_launches

    def w(n, dtype=bf16):
        return Operand(0, (n, 64), dtype)

    qkv = [w(40), w(8), w(8)]
    assert linear_launches(64, qkv) == [(qkv, bf16, 3 + 1 + 1)]
    assert linear_launches(48, qkv) == [(qkv, None, 5)]          # k not a multiple of 32: the CUDA cores
    six = [w(16)] * 6
    assert [len(g) for g, _, _ in linear_launches(64, six)] == [MAX_PARTS, 6 - MAX_PARTS]
    mixed = [w(16), attrs.evolve(w(16), dtype=f32), w(16)]
    assert [(len(g), d) for g, d, _ in linear_launches(64, mixed)] == [(1, bf16), (1, None), (1, bf16)]


def test_a_head_norm_and_the_rope_after_it_run_as_one_in_every_layer():
    from mdsl.serving.gpu import fusible_pairs

    graph = _graph("qwen3")
    nodes = list(graph.nodes)
    pairs = fusible_pairs(nodes, len(nodes), {graph.logits.name}, "head_rms_norm", "rope")
    assert len(pairs) == sum(n.op == "attention" for n in nodes)
    assert all((nodes[i].op, nodes[i + 1].op) == ("head_rms_norm", "rope") for i in pairs)
    # a result read past the step (kept) does not fuse, nor a pair the narrowing falls between
    assert pairs[0] not in fusible_pairs(nodes, len(nodes), {nodes[pairs[0]].outputs[0].name}, "head_rms_norm", "rope")
    assert pairs[0] not in fusible_pairs(nodes, pairs[0] + 1, {graph.logits.name}, "head_rms_norm", "rope")


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1024, 4095, 4096, 4097, 8192, 8193, 32768, 131071])
def test_a_rows_attention_splits_are_whole_warps_of_keys_and_at_most_max_splits(n):
    from mdsl.serving.gpu import MAX_SPLITS, SPLIT_KEYS, attention_split

    split, splits = attention_split(n)
    assert split % SPLIT_KEYS == 0 and splits <= MAX_SPLITS and (splits - 1) * split < n <= splits * split
    assert split == SPLIT_KEYS or -(-n // (split - SPLIT_KEYS)) > MAX_SPLITS   # the smallest that fits
    if n <= SPLIT_KEYS * MAX_SPLITS:   # a range of 1024 keys takes 16 splits of 64, whatever max_seq is
        assert (split, splits) == (SPLIT_KEYS, -(-n // SPLIT_KEYS))


@pytest.mark.parametrize("max_seq", [1, 64, 65, 1000, 4096, 4097, 9000])
def test_every_rows_splits_have_a_block(max_seq):
    """The launch's blocks a row and KV head are the most splits any range up to max_seq takes (a longer
    range's splits are longer, and may be fewer than a shorter one's)."""
    from mdsl.serving.gpu import attention_blocks, attention_split

    assert attention_blocks(max_seq) == max(attention_split(n)[1] for n in range(1, max_seq + 1))


def test_the_kernels_split_constants_are_the_hosts():
    import re

    from mdsl.serving.gpu import ATTENTION_THREADS, MAX_SPLITS, SPLIT_KEYS

    source = kernel_source()
    for name, value in (("ATT_SPLIT_KEYS", SPLIT_KEYS), ("ATT_MAX_SPLITS", MAX_SPLITS)):
        assert re.search(rf"constexpr int {name} = (\d+);", source).group(1) == str(value)
    assert ATTENTION_THREADS == 4 * 32 and "constexpr int ATT_WARPS = 4;" in source

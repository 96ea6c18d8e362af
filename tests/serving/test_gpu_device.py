"""The GPU serving device's parts that need no GPU: its rule table covers the ops the CPU device serves,
its step kernels compile for the H200 without spills, and without a GPU `device="gpu"` says so. Its
behaviour on a GPU is tests/gpu/test_gpu_serving.py's."""
from __future__ import annotations

import numpy as np
import pytest

from mdsl import LLM, SamplingParams
from mdsl.gpu import has_gpu
from mdsl.gpu.driver import NoGPUError
from mdsl.serving.gpu import GPU_STEP_RULES, GROUPS, MMA_GROUPS, kernel_source
from mdsl.serving.steprules import STEP_RULES


def test_the_gpu_rules_cover_the_ops_the_cpu_device_serves():
    assert set(GPU_STEP_RULES) == set(STEP_RULES)


@pytest.mark.timeout(300)
def test_the_step_kernels_compile_for_sm_90a_and_run_their_products_on_wgmma_and_wait_before_memory():
    """Every step kernel compiles for sm_90a without spills (one compile of the module, the slowest of the
    suite's, for all these checks). attention_mma's products are wgmmas (m64n64k16, A from registers): S's a
    k16 step of dims (hi and lo) and P V's a k16 step of keys and half of the dims (hi and lo), in a variant of
    each for head dims up to 64 (one half) and up to 128 (two), none serialized by ptxas; attention_solo stays
    on mma.sync. And every step kernel, launched allowed to start while the kernel before it ends
    (dependent_launch.cuh), waits for it (griddepcontrol.wait: ACQBULK) before its first load or store of
    global memory."""
    import re

    from mdsl.backend.cuda.nvrtc import compile_cuda, nvdisasm_path
    from tests.shared import disassembled

    module = compile_cuda(kernel_source(), arch="sm_90a")
    weighted = ("embedding", "rms_norm", "linear", "add_bias", "head_rms_norm", "head_norm_rope", "rope",
                "kv_append", "moe_router", "moe_up", "moe_down")   # (rope_W: its KV append into pools of W)
    expected = {f"{name}_{s}" for name in weighted for s in ("f32", "bf16", "f16")}
    expected |= {f"{name}_{s}" for name in ("linear_mma",) for s in ("bf16", "f16")}
    expected |= {f"attention_{g}_{dv}_{s}" for dv, groups in GROUPS.items() for g in groups
                 for s in ("f32", "bf16", "f16")}   # (pools of each dtype)
    expected |= {f"attention_{kind}_{g}_{s}" for kind in ("mma", "solo") for g in MMA_GROUPS
                 for s in ("bf16", "f16")}   # (16-bit pools)
    expected |= {f"attention_fold_{g}" for g in MMA_GROUPS}
    expected |= {"act_mul", "add", "gather", "argmax_rows", "map_rows", "gated_scale", "moe_plan", "moe_sum"}
    assert set(module.resources) == expected
    for name, r in module.resources.items():
        assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, (name, r)
    assert "C7515" not in module.log and "serialized" not in module.log, module.log
    if nvdisasm_path() is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    sass = disassembled(module.cubin)
    for g in MMA_GROUPS:
        for s, t in (("bf16", "BF16"), ("f16", "F16")):
            shared = sass.split(f".text.attention_mma_{g}_{s}:")[1].split(".text.")[0]
            wgmmas = re.findall(r"HGMMA\.(\w+)\.F32(?:\.(\w+))? R\d+, R\d+, gdesc\[", shared)
            halves = (1 + 2) * 2 * 4   # (variants of one and two halves; hi and lo; k16 steps of a half's dims)
            assert len(wgmmas) == 2 * halves and {w[0] for w in wgmmas} == {"64x64x16"}, (g, s, wgmmas)
            assert "HMMA" not in shared, (g, s)
            solo = sass.split(f".text.attention_solo_{g}_{s}:")[1].split(".text.")[0]
            assert "HGMMA" not in solo and "HMMA.16816.F32" in solo, (g, s)
    parts = re.split(r"\n\s*\.text\.(\w+):", sass)
    bodies = dict(zip(parts[1::2], parts[2::2]))
    for name in module.resources:
        first = re.search(r"\b(LDG|STG|ATOMG|RED|LD\.E|ST\.E|LDGSTS|UTMALDG)\b|\bACQBULK\b", bodies[name])
        assert first is not None and first.group(0) == "ACQBULK", (name, first and first.group(0))


@pytest.mark.skipif(has_gpu(), reason="a GPU is present")
def test_without_a_gpu_the_gpu_device_says_so(checkpoints):
    with pytest.raises(NoGPUError):
        LLM(checkpoints["llama3"].folder, device="gpu")


def _graph(arch: str, **overrides):
    from mdsl.megakernel.modelgraph.architectures import step_function
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    from tests.megakernel.tiny import tiny_config_dict

    config = config_from_dict(tiny_config_dict(arch, **overrides))
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


@pytest.mark.parametrize("arch,dtype,act", [("llama3", "bfloat16", 0), ("qwen3", "float16", 0),
                                            ("gemma2", "bfloat16", 1), ("llama3", "float32", None),
                                            ("qwen3_moe", "bfloat16", None)])
def test_a_gate_up_linear_of_16_bit_weights_runs_with_the_activation_after_it(arch, dtype, act):
    """gated_linears: each dense MLP's gate|up linear and the act_mul (silu) or geglu (GELU's tanh form)
    after it, with 16-bit weights (tensor cores); nothing with float32 weights, nor a mixture of experts'
    (whose experts run in moe_experts); the program runs the pair as one entry (with gates: a Hopper GPU),
    and the gate|up values then have no buffer."""
    from mdsl.serving.cpu import narrowing, serving_nodes
    from mdsl.serving.gpu import gated_linears, lower_program, step_slots

    graph = _graph(arch, torch_dtype=dtype)
    nodes, caches = serving_nodes(graph)
    narrow_at = narrowing(nodes, caches)
    found = gated_linears(nodes, narrow_at, {graph.logits.name})
    layers = sum(n.op in ("attention", "scaled_attention") for n in nodes)
    if act is None:
        assert not found
        return
    assert len(found) == layers and set(found.values()) == {act}
    for i in found:
        linear, gate = nodes[i], nodes[i + 1]
        assert linear.op == "linear" and gate.op in ("act_mul", "geglu") and len(linear.inputs) == 3
        assert linear.inputs[1].shape == linear.inputs[2].shape
    program = lower_program(nodes, narrow_at, graph.logits.name, gates=True)
    for i, code in found.items():
        rule, attrs, reads, writes, op = program[i]
        assert program[i + 1] is None and attrs["act"] == code and op == f"linear+{nodes[i + 1].op}"
        assert reads == [v.name for v in nodes[i].inputs] and writes == [nodes[i + 1].outputs[0].name]
    assert lower_program(nodes, narrow_at, graph.logits.name)[min(found) + 1] is not None   # (without gates)
    gate_up = {nodes[i].outputs[0].name for i in found}
    assert not gate_up & set(step_slots(graph, gates=True)[3]) and gate_up <= set(step_slots(graph)[3])


@pytest.mark.parametrize("arch,dtype", [("llama3", "bfloat16"), ("qwen3", "float16"), ("gemma2", "bfloat16"),
                                        ("qwen3_moe", "bfloat16"), ("llama3", "float32")])
def test_the_rows_of_a_linear_that_alone_reads_a_norm_attention_or_gated_product_come_rounded_from_it(arch, dtype):
    """handed_rows: with 16-bit weights, every rms_norm (Gemma's rms_norm_1p) whose only reader is the
    linear right after it as its input rows (the q|k|v and gate|up projections' norms, the final norm before
    the LM head where the narrowing does not lie between), every attention (read by the o projection alone)
    and every gated linear whose product only the down projection reads, hands its rows rounded to the
    linear's dtype (the program's entry says `hand`, that dtype); none with float32 weights; never a norm
    whose result anything else reads (Gemma's post-norms, read by adds)."""
    from mdsl.serving.cpu import narrowing, serving_nodes
    from mdsl.serving.gpu import gated_linears, handed_rows, lower_program

    graph = _graph(arch, torch_dtype=dtype, intermediate_size=64)   # (the down projection's k a multiple of 32)
    nodes, caches = serving_nodes(graph)
    narrow_at = narrowing(nodes, caches)
    kept = {graph.logits.name}
    gated = gated_linears(nodes, narrow_at, kept)
    handing = handed_rows(nodes, narrow_at, kept, gated)
    layers = sum(n.op in ("attention", "scaled_attention") for n in nodes)
    if dtype == "float32":
        assert not handing
        return
    readers = {}
    for n in nodes:
        for v in n.inputs:
            readers.setdefault(v.name, []).append(n)
    for i in handing:
        value = nodes[i + 1 if i in gated else i].outputs[0].name
        (reader,) = readers[value]
        assert reader.op == "linear" and reader.inputs[0].name == value
        assert nodes[i].op in ("rms_norm", "rms_norm_1p", "attention", "scaled_attention") or i in gated
        assert handing[i] is reader.inputs[1].dtype and handing[i].long_name == dtype
    attentions = [i for i in handing if nodes[i].op in ("attention", "scaled_attention")]
    assert len(attentions) >= layers - 1   # (the last layer's where the narrowing lies between it and o)
    norms = [i for i in handing if i not in gated and i not in attentions]
    assert len(norms) >= 2 * layers if arch != "qwen3_moe" else len(norms) >= layers   # (MoE: the experts' norm no)
    assert set(gated) <= set(handing)   # every gated product goes to a down projection
    program = lower_program(nodes, narrow_at, graph.logits.name, gates=True)
    def hands(entry) -> bool:
        return entry is not None and isinstance(entry[1], dict) and bool(entry[1].get("hand"))

    assert {i: e[1]["hand"] for i, e in enumerate(program) if hands(e)} == handing
    assert not any(hands(e) for e in lower_program(nodes, narrow_at, graph.logits.name))


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "gemma2", "qwen3_moe"])
def test_the_rope_before_an_attention_appends_its_keys_and_values(arch):
    """kv_appends: the rope that alone writes an attention's q|k|v rows (Qwen3's with its head norm, as one
    entry) reads that attention's pools too and appends the rows' keys and values; the attention's entry
    says `appended` (no KV append launch of its own). Every layer's, on the GPU device's program with or
    without wgmma."""
    from mdsl.serving.cpu import narrowing, serving_nodes
    from mdsl.serving.gpu import kv_appends, lower_program

    graph = _graph(arch, torch_dtype="bfloat16", intermediate_size=64)
    nodes, caches = serving_nodes(graph)
    narrow_at = narrowing(nodes, caches)
    appends = kv_appends(nodes, narrow_at, {graph.logits.name})
    attentions = [j for j, n in enumerate(nodes) if n.op in ("attention", "scaled_attention")]
    assert sorted(appends.values()) == attentions
    for gates in (False, True):
        program = lower_program(nodes, narrow_at, graph.logits.name, gates=gates)
        for i, j in appends.items():
            assert nodes[i].op == "rope" and nodes[j].inputs[0].name == nodes[i].outputs[0].name
            entry = program[i] if program[i] is not None else program[i - 1]   # (a head norm's pair: its entry)
            pools = [v.name for v in nodes[j].inputs[1:3]]
            assert entry[2][-2:] == pools and entry[4] in ("rope", "head_rms_norm+rope")
            assert program[j][1].get("appended") is True and program[j][2][1:3] == pools


def _slots(arch: str, layers: int, gates: bool = False) -> tuple:
    """step_slots of a tiny checkpoint of `layers` layers (bf16 where `gates`, so that its gated linears fuse),
    and its logits' name and its values' widths."""
    from mdsl.serving.gpu import step_slots

    graph = _graph(arch, num_hidden_layers=layers, torch_dtype="bfloat16" if gates else "float32")
    widths = {v.name: int(v.shape[-1]) for n in graph.nodes for v in n.outputs}
    return (*step_slots(graph, gates), graph.logits.name, widths)


@pytest.mark.parametrize("gates", [False, True])
@pytest.mark.parametrize("arch", ["llama3", "qwen3", "gemma2", "qwen3_moe"])
def test_the_step_values_share_buffers_only_where_their_lives_do_not_meet(arch, gates):
    """step_slots (activation_slots): every value the program writes has a slot of its width; two values
    share one only where one is last read before the other is written (an entry's results never take what
    it reads; the values gathered at the narrowing live to it, the logits to the end); and deeper models
    take no more slots (the layers reuse them)."""
    program, narrow_at, narrowed, slot_of, slot_widths, logits, widths = _slots(arch, 3, gates)
    written = {name: i for i, entry in enumerate(program) if entry is not None for name in entry[3]}
    last = {}
    for i, entry in enumerate(program):
        if entry is not None:
            last.update((name, i) for name in entry[2])
    for name in narrowed:
        last[name] = max(last.get(name, -1), narrow_at)
    last[logits] = len(program)
    assert set(slot_of) == set(written)
    assert all(slot_widths[slot_of[name]] == widths[name] for name in written)
    for a in written:
        for b in written:
            if a < b and slot_of[a] == slot_of[b]:
                first, second = sorted((a, b), key=written.get)
                assert last.get(first, -1) < written[second], (first, second)
    assert len(slot_widths) < len(written) / 2
    assert len(_slots(arch, 6, gates)[4]) == len(slot_widths)


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


@pytest.mark.parametrize("half", [1, 3, 4, 96, 1023, 1024, 12288])
def test_act_muls_grid_gives_every_output_a_thread(half):
    # (act_mul: four consecutive elements a thread where half is a multiple of 4, else _spread's one or two)
    from mdsl.serving.gpu import THREADS, act_mul_grid

    rows, blocks = act_mul_grid(5, half)
    per = 4 if half % 4 == 0 else 2
    assert rows == 5 and blocks * THREADS * per >= half and (blocks - 1) * THREADS * per < half


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


def test_the_tensor_core_attentions_constants_are_the_hosts():
    import re

    from mdsl.serving.gpu import MAX_SPLITS, MMA_DIM, MMA_ROWS, MMA_SMEM, MMA_SOLO_SMEM, MMA_SPLIT_KEYS, \
        MMA_TILE_WARPS, MMA_UNIT

    source = kernel_source()

    def constant(name):
        return int(re.search(rf"constexpr int {name} = (\d+)", source).group(1))

    assert re.search(r"constexpr int AMMA_UNIT = ATT_MAX_SPLITS;", source)   # (an item can hold a whole tile)
    assert 16 * constant("AMMA_WARPS") == MMA_ROWS and constant("AMMA_WARPS") == MMA_TILE_WARPS
    assert constant("AMMA_DIM") == MMA_DIM
    keys, stride = constant("AMMA_KEYS"), MMA_DIM + 8
    # keys and values, two stages, 16-bit; and a float of folded values for each M row's dim
    assert MMA_SMEM == 2 * 2 * keys * stride * 2 + MMA_ROWS * MMA_DIM * 4
    assert MMA_SOLO_SMEM == MMA_TILE_WARPS * constant("AMMA_RING") * keys * 64 * 2   # a ring of halves a warp
    assert constant("AMMA_SPLIT_KEYS") == MMA_SPLIT_KEYS and MMA_UNIT == MAX_SPLITS


def _step(rng, max_batch: int, rows: int, max_seq: int):
    """Random chunks of a step: (positions, starts, counts) of up to max_batch requests and `rows` rows."""
    counts = rng.multinomial(rows - max_batch, np.ones(max_batch) / max_batch) + 1 if rows >= max_batch else \
        np.ones(rows, np.int64)
    counts = counts[counts > 0]
    starts = np.cumsum(counts) - counts
    ends = [int(rng.integers(c, max_seq + 1)) for c in counts]
    positions = np.concatenate([np.arange(e - c, e) for e, c in zip(ends, counts)])
    return positions, starts, counts


@pytest.mark.parametrize("group, window, unit", [(1, 0, 1), (4, 0, 1), (16, 0, 3), (2, 100, 8)])
def test_attention_items_give_every_row_each_of_its_splits_once_within_the_bound(group, window, unit):
    """Each row of a step is in one tile of its own chunk, its tile's items hold each of the row's splits once
    (attention_split of its own range), at most `unit` an item, and no step has more items than most_items
    (the device buffer)."""
    from mdsl.serving.gpu import MMA_SPLIT_KEYS, attention_items, attention_split, attention_tiles, most_items, \
        tile_rows

    a = {"q_heads": 2 * group, "kv_heads": 2}
    rng = np.random.default_rng(group + window)
    for rows, max_batch, max_seq in ((256, 8, 9000), (64, 64, 300), (5, 3, 70), (256, 64, 4200)):
        positions, starts, counts = _step(rng, max_batch, rows, max_seq)
        items = attention_items(attention_tiles(positions, starts, counts, tile_rows(a), window), unit)
        assert len(items) <= most_items(a, rows, max_batch, max_seq)
        chunk_of = np.repeat(np.arange(len(counts)), counts)
        seen = {}
        for first, size, s0, s1 in items.tolist():
            assert 1 <= size <= tile_rows(a) and len(set(chunk_of[first:first + size])) == 1
            assert 1 <= s1 - s0 <= unit
            for r in range(first, first + size):
                assert not seen.setdefault(r, set()) & set(range(s0, s1)), r
                seen[r] |= set(range(s0, s1))
        assert sorted(seen) == list(range(len(positions)))
        for r, splits in seen.items():
            pos = int(positions[r])
            lo = max(0, pos - window + 1) if window else 0
            assert set(range(attention_split(pos - lo + 1, MMA_SPLIT_KEYS)[1])) <= splits, r


def test_solo_tiles_take_a_split_a_warp_where_their_splits_outnumber_the_grid_and_come_first():
    """A tile whose M rows fit one warp (a decode row; rows x query heads a KV head <= 16) runs solo, one
    split a warp, where the step's such splits (times the KV heads) outnumber the grid's blocks: its items
    hold as many splits as spread them over the grid, up to the block's MMA_TILE_WARPS warps. Otherwise, and
    for a wider tile (a prompt chunk), items of item_unit's count. The solo tiles' items come first
    (attention_solo's, then attention_mma's)."""
    from mdsl.serving.gpu import MMA_TILE_WARPS, attention_items, attention_tiles, item_unit, step_items, \
        solo_tiles, tile_rows, tile_units

    a = {"q_heads": 8, "kv_heads": 2}                      # 4 query heads a KV head: tiles of 16 rows
    tile = tile_rows(a)
    # a decode row at position 1000 (8 splits of 128 keys), a 4-row chunk (solo) and a 40-row chunk (shared)
    positions = np.concatenate([[1000], np.arange(496, 500), np.arange(900, 940)])
    starts, counts = np.array([0, 1, 5]), np.array([1, 4, 40])
    chunks = np.zeros(3, [("row", np.int64), ("count", np.int64)])
    chunks["row"], chunks["count"] = starts, counts
    tiles = attention_tiles(positions, starts, counts, tile, 0)
    assert tiles[1].tolist() == [1, 4, 16, 16, 8] and tiles[2].tolist() == [8, 4, 8, 8, 8]
    # 12 solo splits x 2 KV heads: 6 a block of a grid of 4, so the block's 4 warps; 3 on a grid of 8; on a
    # grid of 24 or more blocks, a block each in attention_mma
    for grid, spread in ((4, MMA_TILE_WARPS), (8, 3), (23, 2), (24, None), (100, None)):
        shared = item_unit(int(tiles[2].sum()), a["kv_heads"], grid)
        units = tile_units(tiles, solo_tiles(tiles, tile, a["kv_heads"], grid), a["kv_heads"], grid)
        assert units.tolist() == [spread or shared] * 2 + [shared] * 3, grid
        items = attention_items(tiles, units)
        ordered, alone, _ = step_items(positions, chunks, tile, 0, a["kv_heads"], grid)
        assert sorted(map(tuple, ordered.tolist())) == sorted(map(tuple, items.tolist()))
        if spread is None:
            assert alone == 0
        else:
            assert alone == len(items[items[:, 1] <= 4])
            assert ordered[:alone, 1].max() <= 4 and ordered[alone:, 1].min() > 4
    alone = solo_tiles(tiles, tile, a["kv_heads"], 4)
    decode = attention_items(tiles, tile_units(tiles, alone, a["kv_heads"], 4))
    decode = decode[decode[:, 0] == 0]
    assert decode[:, 2].tolist() == [0, 4] and decode[:, 3].tolist() == [4, 8]


def test_a_decode_steps_work_lists_are_its_step_befores_until_a_rows_range_passes_a_splits_end():
    """step_items answers a step whose tiles (rows, counts, splits), grid and heads it met before with the
    same read-only arrays, and a step that differs in any of them (a row's range one key past a split's end,
    another grid, a row more) with what it computes afresh."""
    from mdsl.serving import gpu as G

    def chunks_of(n: int) -> np.ndarray:
        chunks = np.zeros(n, [("row", np.int64), ("count", np.int64)])
        chunks["row"], chunks["count"] = np.arange(n), 1
        return chunks

    def fresh(*args) -> tuple:
        G._STEP_ITEMS.clear()
        return G.step_items(*args)

    def same(x: tuple, y: tuple) -> bool:
        return np.array_equal(x[0], y[0]) and x[1] == y[1] and np.array_equal(x[2], y[2])

    rows = np.array([5, 300, 1000, 126])
    G._STEP_ITEMS.clear()
    first = G.step_items(rows, chunks_of(4), 16, 0, 2, 8)
    assert not first[0].flags.writeable and not first[2].flags.writeable
    again = G.step_items(rows + 1, chunks_of(4), 16, 0, 2, 8)      # (every range within its splits)
    assert again[0] is first[0] and again[2] is first[2]
    for args in ((rows + 2, chunks_of(4), 16, 0, 2, 8),              # row 3's range: 129 keys, a second split
                 (rows, chunks_of(4), 16, 0, 2, 64), (rows, chunks_of(4), 16, 0, 4, 8),
                 (np.append(rows, 7), chunks_of(5), 16, 0, 2, 8)):
        met = G.step_items(*args)
        assert met[0] is not first[0] and same(met, fresh(*args))
    assert same(G.step_items(rows, chunks_of(4), 16, 0, 2, 8), first)


def test_attention_runs_on_tensor_cores_for_16_bit_pools_of_head_dims_up_to_128_from_sm_80():
    from mdsl.ir.dtypes import bf16, f16, f32
    from mdsl.serving.gpu import _attention_kernel, on_tensor_cores

    a = {"q_heads": 32, "kv_heads": 8, "head_dim": 128}
    assert all(on_tensor_cores(a, dtype, arch) for dtype, arch in ((bf16, "sm_90a"), (f16, "sm_80"), (bf16, "sm_100")))
    assert _attention_kernel(a, bf16, "sm_90a") == "attention_mma_4"
    # float32 pools, a head dim past 128 or not a multiple of 8, a GPU before sm_80, 32 query heads a KV head:
    # the CUDA-core kernel
    for other, dtype, arch in ((a, f32, "sm_90a"), (dict(a, head_dim=256), bf16, "sm_90a"),
                               (dict(a, head_dim=12), bf16, "sm_90a"), (a, bf16, "sm_75")):
        assert not on_tensor_cores(other, dtype, arch)
        assert _attention_kernel(other, dtype, arch).startswith("attention_")
    assert not on_tensor_cores({"q_heads": 32, "kv_heads": 1, "head_dim": 64}, bf16, "sm_90a")


@pytest.mark.parametrize("arch, budget", [("llama3", 7), ("mistral", 64)])
def test_the_work_lists_of_the_schedulers_steps_cover_each_rows_splits_within_the_bound(tmp_path, monkeypatch, arch,
                                                                                     budget):
    """The tensor-core attention's work list (step_items) of every step the scheduler runs (requests of up to
    300 tokens arriving at random steps, chunked prompts beside decode rows, Mistral's sliding window): its
    tiles lie within one chunk each, every row has each of its splits once, no step has more items than
    the device buffer holds (most_items), and a row is done (left by attention_fold) exactly where its shared
    tile is one item of all its splits."""
    from mdsl.serving.cpu import CpuDevice
    from mdsl.serving.gpu import MMA_SPLIT_KEYS, attention_heads, attention_split, most_items, step_items, tile_rows
    from tests.serving.conftest import arrivals_of, drive, random_prompts, write_checkpoint

    ckpt = write_checkpoint(tmp_path, arch, positions=320, sliding_window=150) if arch == "mistral" else \
        write_checkpoint(tmp_path, arch, positions=320)
    steps, wholes = [], []
    forward = CpuDevice._forward

    def checked(self, step, chunks, rows):
        for a in attention_heads(self.nodes):
            window = a.get("window", 0)
            items, alone, done = step_items(rows["position"], chunks, tile_rows(a), window, a["kv_heads"], grid=4)
            can = 4 * items[:, 1] <= tile_rows(a)   # (solo tiles first, or none solo)
            assert can[:alone].all() and (alone == 0 or not can[alone:].any())
            assert len(items) <= most_items(a, self.shape.step_rows, self.shape.max_batch,
                                            self.shape.max_seq)
            chunk_of = np.repeat(np.arange(len(chunks)), chunks["count"])
            seen: dict = {}
            for first, size, s0, s1 in items.tolist():
                assert 1 <= size <= tile_rows(a) and len(set(chunk_of[first:first + size])) == 1
                for r in range(first, first + size):
                    assert not seen.setdefault(r, set()) & set(range(s0, s1)), r
                    seen[r] |= set(range(s0, s1))
            whole = {r for first, size, s0, s1 in items[alone:].tolist() for r in range(first, first + size)
                     if s0 == 0 and s1 - s0 >= attention_split(_range(rows["position"], first, size, window),
                                                               MMA_SPLIT_KEYS)[1]}
            for r, pos in enumerate(rows["position"].tolist()):
                lo = max(0, pos - window + 1) if window else 0
                splits = attention_split(pos - lo + 1, MMA_SPLIT_KEYS)[1]
                assert set(range(splits)) <= seen[r], (r, pos)
                # done: the row's tile is shared and one item holds all its splits (attention_mma folds them)
                assert done[r] == (r in whole), (r, pos)
            wholes.append(int(done.sum()))
            steps.append(len(rows))
        return forward(self, step, chunks, rows)

    monkeypatch.setattr(CpuDevice, "_forward", checked)
    rng = np.random.default_rng(17)
    prompts = random_prompts(rng, 10, 1, 300)
    params = [SamplingParams(max_new_tokens=int(n)) for n in rng.integers(2, 12, 10)]
    with LLM(ckpt.folder, device="cpu", max_batch=6, page_size=16, max_tokens_per_step=budget) as llm:
        handles = drive(llm, arrivals_of(rng, prompts, params, 20))
        assert all(h.result().token_ids for h in handles.values())
    assert max(steps) > 1 and len(steps) > 20 and max(wholes) > 0


def _range(positions, first: int, size: int, window: int) -> int:
    """The most keys of the ranges of rows first .. first + size - 1 (their tile's splits are its longest's)."""
    top = int(positions[first:first + size].max())
    return top + 1 - (max(0, top - window + 1) if window else 0)


def _bare_device(graph, max_tokens_per_step: int = 256):
    """A GPU device's host side without a GPU: its nodes and shape only (what its checks read)."""
    from mdsl.serving.gpu import GpuDevice
    from mdsl.serving.protocol import ServingShape

    device = object.__new__(GpuDevice)
    device.nodes = list(graph.nodes)
    device.shape = ServingShape(max_batch=4, page_size=4, num_pages=8, max_seq=24,
                                max_tokens_per_step=max_tokens_per_step)
    return device


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_a_mixture_of_experts_pairs_each_experts_op_with_its_routers_top_k(arch):
    from tests.megakernel.tiny import tiny_model

    config, graph, _ = tiny_model(arch)
    device = _bare_device(graph)
    device._check_experts()
    pairs = device._experts()
    assert [top_k for _, top_k in pairs] == [config.experts_per_token] * sum(map(config.sparse, range(config.num_layers)))
    assert all(n.inputs[2].name.endswith("experts.0.gate_proj.weight") for n, _ in pairs)


@pytest.mark.parametrize(("overrides", "tokens", "what"), [
    ({"num_experts": 1100, "num_experts_per_tok": 2}, 256, "its 1100 experts"),
    ({"num_experts": 40, "num_experts_per_tok": 33}, 256, "its top_k 33")])
def test_a_mixture_of_experts_beyond_the_kernels_is_refused_by_name(overrides, tokens, what):
    from mdsl.errors import UnsupportedError
    from mdsl.megakernel.modelgraph.architectures import step_function
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    from tests.megakernel.tiny import tiny_config_dict

    config = config_from_dict(tiny_config_dict("qwen3_moe", **overrides))
    device = _bare_device(step_function(config).trace(config), tokens)
    with pytest.raises(UnsupportedError, match=f"cannot run moe_router with {what}") as e:
        device._check_experts()
    assert e.value.loc.file.endswith("architectures.py") and "device='cpu'" in e.value.hint


@pytest.mark.parametrize("arch,dtype", [("llama3", "bfloat16"), ("qwen3", "float16"), ("gemma2", "bfloat16"),
                                        ("qwen3_moe", "bfloat16"), ("llama3", "float32")])
@pytest.mark.parametrize("hidden", [128, 32])
def test_a_norm_after_a_residual_linear_takes_its_sums_of_squares_from_it(arch, dtype, hidden):
    """norm_squares: with 16-bit weights and rows a multiple of 128 wide, every rms_norm that hands its rows to
    the wgmma linear after it and whose input is a wgmma linear's residual sum (Llama's and Qwen3's norms but the
    first layer's, which the embedding writes) takes the rows' sums of
    squares from that linear: both entries of the program say `squares`, the rows' name. None for Gemma-2 (its
    pre-norms read an add of a post-norm), float32 weights, rows of another width or without wgmma."""
    from mdsl.serving.cpu import narrowing, serving_nodes
    from mdsl.serving.gpu import gated_linears, handed_rows, lower_program, norm_squares, residual_adds

    graph = _graph(arch, torch_dtype=dtype, hidden_size=hidden, intermediate_size=64)
    nodes, caches = serving_nodes(graph)
    narrow_at = narrowing(nodes, caches)
    kept = {graph.logits.name}
    fused = residual_adds(nodes, narrow_at, kept)
    handing = handed_rows(nodes, narrow_at, kept, gated_linears(nodes, narrow_at, kept))
    squares = norm_squares(nodes, narrow_at, fused, handing)
    layers = sum(n.op in ("attention", "scaled_attention") for n in nodes)
    if arch in ("llama3", "qwen3") and dtype != "float32" and hidden == 128:
        norms = [i for i, n in enumerate(nodes) if n.op == "rms_norm"]
        assert set(squares) == set(norms[1:]) and len(norms) == 2 * layers + 1
    elif arch != "qwen3_moe":
        assert not squares
    for i, j in squares.items():
        norm, linear, add = nodes[i], nodes[j], nodes[j + 1]
        assert norm.op in ("rms_norm", "rms_norm_1p") and i in handing and j in fused
        assert (linear.op, add.op) == ("linear", "add") and add.outputs[0].name == norm.inputs[0].name
        assert (j < narrow_at) == (i < narrow_at) and len(linear.inputs) == 2
    program = lower_program(nodes, narrow_at, graph.logits.name, gates=True)
    said = {i: e[1]["squares"] for i, e in enumerate(program)
            if e is not None and isinstance(e[1], dict) and e[1].get("squares")}
    assert said == {**{i: nodes[i].inputs[0].name for i in squares},
                    **{j: nodes[i].inputs[0].name for i, j in squares.items()}}
    assert all(not (isinstance(e[1], dict) and e[1].get("squares"))
               for e in lower_program(nodes, narrow_at, graph.logits.name) if e is not None)


def test_the_norms_tile_is_the_wgmma_linears_columns_a_block():
    from mdsl.serving import gpu, gpu_wgmma

    assert gpu.NORM_TILE == gpu_wgmma.FEATURES
    assert f"constexpr int TILE = {gpu.NORM_TILE};" in gpu.ROW_NORMS_SOURCE.read_text()

"""The megakernel's generated task bodies (runtime/cuda_bodies.py): each plan kind's body written from its layer
op's rule and epilogue, the operators' code from the CUDA backend's rule table, eager rounding on one GPU,
partial sums under tensor parallelism, and the dispatch covering the plan's kinds."""
import re

import attrs
import pytest

from mdsl.errors import UnsupportedError
from mdsl.ir.dtypes import bf16, f32
from mdsl.ir.text import parse
from mdsl.megakernel.modelgraph.epilogues import EPILOGUE_RULES, EpilogueRule, gated
from mdsl.megakernel.runtime.cuda_bodies import generate_bodies, linear_bodies, residual_columns
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import Kind, build_plan, for_ranks
from tests.megakernel.test_runtime_source import assert_fits, compile_plan
from tests.megakernel.tiny import tiny_model


def tiny_plan(arch="llama3", **overrides):
    config, _, _ = tiny_model(arch, **overrides)
    return build_plan(decoder_shape(attrs.evolve(config, dtype=bf16)), workers=16, max_seq=config.max_positions)


def function(text: str, name: str) -> str:
    """The text of one generated function (up to the closing brace at column 0)."""
    start = text.index(f" {name}(")
    return text[start:text.index("\n}\n", start)]


@pytest.mark.parametrize(("act", "code"), [("silu", "r_gate / (1.0f + expf(-r_gate))"),
                                           ("gelu", "0.5f * r_gate * (1.0f + erff(r_gate * 0.70710678118654752f))"),
                                           ("relu", "fmaxf(r_gate, 0.0f)")])
def test_the_gate_up_body_computes_the_models_activation(act, code):
    body = function(generate_bodies(tiny_plan(hidden_act=act)), "gateup_task")
    assert f"const float r_act = round_t({code});" in body
    assert "const float r_out = round_t(r_act * r_up);" in body
    assert "task_gemv<H, 2>" in body and "(j == 0 ? w.wg : w.wu)" in body


def test_one_gpu_rounds_every_result_and_ranks_leave_partial_sums():
    plan = tiny_plan()
    one = function(generate_bodies(plan), "oproj_task")
    assert "const float r_product = round_t(acc[0]);" in one
    assert "const float r_out = round_t(r_residual + r_product);" in one
    assert "stream_put(p, p.mids, p.mid_parts, p.mid_relay, t.layer, r, r_out, tag);" in one
    assert "relay_rows" not in one
    ranks = generate_bodies(for_ranks(plan, 2))
    rank = function(ranks, "oproj_task")
    assert "round_t" not in rank and "(p.rank == 0 ? h_at(p, t.layer, r) : 0.0f)" in rank
    assert "round_t(r_act * r_up)" in function(ranks, "gateup_task")   # a buffer, not the residual stream
    # a rank's tile then sums its rows over the ranks (the relay)
    assert "relay_rows(p, p.mids, p.mid_parts, p.mid_relay, t.layer, t.begin, t.end, tag);" in rank
    assert "relay_rows(p, p.hs, p.h_parts, p.h_relay, t.layer + 1," in function(ranks, "down_task")
    assert "oproj_task(p, t, ready, work, red, unsigned(step + 1));" in ranks   # its tag: step + 1


def test_one_gpu_sums_like_ranks_when_asked():
    """rank_sums=N: one GPU's o-proj and down-proj multiply each rank's slice of the row alone (gemv over K / N
    from slice k's columns), the residual in the first slice's epilogue only, unrounded, and add the slices'
    results in rank order from 0.0f, rounding once when the last is stored, as the relay sums the ranks'
    partials; the other kinds are one GPU's."""
    plan = tiny_plan()
    bodies = generate_bodies(plan, 2)
    body = function(bodies, "oproj_task")
    assert "task_gemv<(HQ * D) / 2, 1>(t, ready, work," in body and "round_t" not in body
    assert "rank_sums_row[r - t.begin] = 0.0f + r_out;" in body
    assert "gemv<(HQ * D) / 2, 1>(t.begin, t.end, work + 1 * ((HQ * D) / 2)," in body
    assert "w.wo + (long long)r * (HQ * D) + 1 * ((HQ * D) / 2)" in body
    first, second = body.index("task_gemv<"), body.index(" gemv<(HQ * D) / 2, 1>")
    assert "residual_row[r - t.begin]" in body[first:second] and "const float r_residual = 0.0f;" in body[second:]
    assert body[second:].count("stream_put(") == 1 and "stream_put(" not in body[first:second]
    assert "const float sum = rank_sums_row[r - t.begin] + r_out;" in body
    four = function(generate_bodies(plan, 4), "down_task")
    assert [f"gemv<(I) / 4, 1>(t.begin, t.end, work + {k} * ((I) / 4)," in four for k in (1, 2, 3)] == [True] * 3
    assert four.count("rank_sums_row[r - t.begin] = sum;") == 2 and four.count("stream_put(") == 1
    assert function(bodies, "qkv_task") == function(generate_bodies(plan), "qkv_task")
    assert generate_bodies(for_ranks(plan, 2), 2) == generate_bodies(for_ranks(plan, 2))   # ranks: their own sums


def test_the_residual_is_loaded_with_the_input_row_not_in_the_epilogue():
    """The epilogue runs one column after another: a residual read there would be a global round trip each.
    Each thread loads its columns' residual just before the input row, in the row's first half (which
    runs once the task's inputs are complete, even for a task handed over early), and leaves it in shared
    memory."""
    plan = tiny_plan()
    widest = max(t.end - t.begin for t in plan.tasks if t.kind in (Kind.OPROJ, Kind.DOWN))
    assert residual_columns(plan) == widest > 0
    for name, residual in (("oproj_task", "h_at(p, t.layer, r)"), ("down_task", "mid_at(p, t.layer, r)")):
        body = function(generate_bodies(plan), name)
        # task_gemv takes the epilogue, then the input row's two halves (row.load, row.finish): the residual's
        # loads come in the first, before the row's, its shared-memory stores with the row's
        gemv, epilogue_store = body.index("task_gemv<"), body.index("stream_put(")
        prefetch, load = body.index(residual), body.index("row.load(")
        assert gemv < epilogue_store < prefetch < load < body.index("row.finish(work);") \
            < body.index("residual_row[r - t.begin] = residual_value[c];")
        assert body.count(residual) == 1
        assert re.search(r"const float r_residual = (round_t\()?residual_row\[r - t\.begin\]\)?;", body)
    assert "residual_value" not in function(generate_bodies(plan), "qkv_task")   # no residual there


NOT_ADDITIVE = parse("""thread {
  in %product: f32[1]
  in %residual: f32[1]
  %out: f32[1] = mul(%residual, %product)
  out %out
}""")


def test_tensor_parallel_refuses_an_epilogue_its_ranks_cannot_split(monkeypatch):
    monkeypatch.setitem(EPILOGUE_RULES, "linear_residual", EpilogueRule(lambda a: NOT_ADDITIVE))
    plan = tiny_plan()
    assert "const float r_out = round_t(r_residual * r_product);" in function(generate_bodies(plan), "down_task")
    with pytest.raises(UnsupportedError, match="DOWN epilogue is not additive|OPROJ epilogue is not additive"):
        generate_bodies(for_ranks(plan, 2))


def test_an_epilogue_must_read_what_the_body_computes(monkeypatch):
    monkeypatch.setitem(EPILOGUE_RULES, "norm_linear", EpilogueRule(lambda a: gated("silu")))
    with pytest.raises(UnsupportedError, match="QKV epilogue reads 2 product"):
        generate_bodies(tiny_plan())


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_the_dispatch_covers_the_plans_kinds(arch):
    plan = tiny_plan(arch)
    text = generate_bodies(plan)
    dispatch = function(text, "run_task")
    kinds = {k.kind for k in plan.kind_ops}
    # (a mixture of experts' kinds, and SCHEDULE: the serving tables', serving_plan.py)
    assert kinds == {t.kind for t in plan.tasks} == set(Kind) - {Kind.ROUTER, Kind.EXPERT_UP, Kind.EXPERT_DOWN,
                                                                 Kind.SCHEDULE}
    assert set(re.findall(r"case KIND_(\w+):", dispatch)) == {k.name for k in kinds}
    assert {b.kind.name for b in linear_bodies(plan)} == {"QKV", "OPROJ", "GATEUP", "DOWN", "LMHEAD"}
    # q|k|v rows are concatenated: a tile may span all three matrices
    qkv = function(text, "qkv_task")
    assert "r < (HQ * D) ? w.wq + (long long)r * (H) : r < (HQ * D + HKV * D) ? w.wk" in qkv


@pytest.mark.parametrize("dtype", [f32, bf16], ids=str)
def test_a_mixture_of_experts_body_reads_the_picked_experts_rows_and_compiles_without_spills(dtype):
    """Qwen3-MoE (a dense layer between two sparse ones): the router's tiles route once the last is done, the
    gate/up tiles find their slot's expert in the layer's table, the down tiles sum the slots (moe.cuh)."""
    config, _, _ = tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1], num_experts=8)
    plan = build_plan(decoder_shape(attrs.evolve(config, dtype=dtype)), workers=132, max_seq=24)
    source, _, resources = compile_plan(plan)
    assert_fits(source, resources)
    text = generate_bodies(plan)
    assert {b.kind.name for b in linear_bodies(plan)} == {"QKV", "OPROJ", "GATEUP", "DOWN", "LMHEAD", "ROUTER",
                                                           "EXPERT_UP"}
    up = function(text, "expert_up_task")
    assert "const int expert = w.route_ids[slot];" in up
    assert "(j == 0 ? gate : up) + (long long)(r - first) * (H)" in up
    assert "route_experts(p, t, tag);" in function(text, "router_task")
    dispatch = function(text, "run_task")
    assert "case KIND_EXPERT_DOWN: expert_down_task(p, t, work, p.hs, t.layer + 1, [&](int r) { return mid_at(p, " \
           "t.layer, r); });" in dispatch
    for name, value in (("MOE_E", 8), ("MOE_K", 2), ("MOE_I", 16), ("KIND_ROUTER", 12)):
        assert f"constexpr int {name} = {value};" in source.text


def test_a_gelu_model_compiles_without_spills():
    source, _, resources = compile_plan(tiny_plan(hidden_act="gelu"))
    assert "erff(r_gate" in source.text
    assert_fits(source, resources)


def test_gemma2s_bodies_round_as_transformers_rounds():
    """Gemma-2's: GELU's tanh approximation computed in f32 and rounded once (transformers' one op), then the
    product with up; the o-proj's raw rows rounded and left for the last tile's norm and residual add; its input
    rows normalised by 1 + weight; the LM head's soft-capped logit rounded after each of its ops."""
    config, _, _ = tiny_model("gemma2", sliding_window=24)
    plan = build_plan(decoder_shape(attrs.evolve(config, dtype=bf16)), workers=16, max_seq=24)
    text = generate_bodies(plan)
    gate_up = function(text, "gateup_task")
    assert "const float r_within_sigmoid = 1.0f / (1.0f + expf(-r_within_scaled));" in gate_up
    assert "const float r_act = round_t(r_gate * r_within_sigmoid);" in gate_up
    assert "const float r_out = round_t(r_act * r_up);" in gate_up and "StreamRow1p row" in gate_up
    oproj = function(text, "oproj_task")
    assert "stream_put(p, p.mids, p.mid_parts, p.mid_relay, t.layer, r, r_product, tag);" in oproj
    tiles = sum(t.kind is Kind.OPROJ and t.layer == 0 for t in plan.tasks)
    assert (f"norm_residual_row<NormedRow1p<H>>(p, p.mids + (long long)(t.layer) * H, w.pn_attn, [&](int r) "
            f"{{ return h_at(p, t.layer, r); }}, 2 * t.layer + 0, {tiles}, tag, work, red);") in oproj
    assert "w.pn_mlp, [&](int r) { return mid_at(p, t.layer, r); }, 2 * t.layer + 1" in function(text, "down_task")
    logit = text[text.index("struct LmHeadLogit"):]
    assert "const float r_scaled = round_t(r_product * 0.33333334f);" in logit
    assert "const float r_tanh = round_t(r_within_twice + -1.0f);" in logit
    with pytest.raises(UnsupportedError, match="tensor parallelism"):
        generate_bodies(for_ranks(plan, 2))
    with pytest.raises(UnsupportedError, match="rank_sums"):
        generate_bodies(plan, rank_sums=2)

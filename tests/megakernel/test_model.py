"""@mdsl.model tracing: the model graph, its textual and DOT forms, structural keys, errors with
the user's line, and the layer-op registry's completeness."""
import re

import numpy as np
import pytest

import mdsl
import mdsl.megakernel.taskgraph.numpy_bodies  # noqa: F401  (attaches the `task_bodies` rules)
import mdsl.megakernel.taskgraph.partition  # noqa: F401  (attaches the `tasks` rules)
from mdsl.errors import ParseError, ShapeError, TraceError, ValidationError
from mdsl.ir.dtypes import f32
from mdsl.megakernel.modelgraph.architectures import sampling_decode
from mdsl.megakernel.modelgraph.layers import LAYER_OPS
from mdsl.megakernel.modelgraph.model import parse_model_graph, print_model_graph
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.taskgraph.layer_fusion import fuse
from tests.megakernel.tiny import tiny_model


class Cfg:
    vocab, hidden, max_positions = 16, 8, 6


@mdsl.model
def two_layer_mlp(m, cfg):
    table = m.weight("embed", [cfg.vocab, cfg.hidden])
    x = m.embedding(table)
    h = m.rms_norm(x, m.weight("norm", [cfg.hidden]), 1e-6)
    up = m.linear(h, m.weight("gate", [12, cfg.hidden]), m.weight("up", [12, cfg.hidden]))
    x = m.add(x, m.linear(m.act_mul(up), m.weight("down", [cfg.hidden, 12])))
    logits = m.linear(x, table)   # tied head
    return logits, m.argmax(logits)


def test_user_model_traces_prints_and_runs():
    g = two_layer_mlp.trace(Cfg())
    assert [n.op for n in g.nodes] == ["embedding", "rms_norm", "linear", "act_mul", "linear", "add", "linear",
                                       "argmax"]
    assert [w.name for w in g.weights] == ["embed", "norm", "gate", "up", "down"]
    text = str(g)
    assert "weight %embed: f32[16, 8]" in text and "state %tokens: i32[6]" in text
    assert re.search(r"%t2: f32\[1, 24\] = linear\(%t1, %gate, %up\)  # @ .*test_model.py:\d+", text)
    assert text.rstrip().endswith("return %t6, %t7\n}")
    dot = g.to_dot()
    assert dot.startswith("digraph model {") and "shape=cylinder" in dot and 'label="update"' in dot
    rng = np.random.default_rng(0)
    weights = {w.name: rng.standard_normal(w.shape).astype(np.float32) for w in g.weights}
    out = ReferenceModel(g, weights).generate([3, 4], 3)
    assert len(out.tokens) == 3 and out.logits.shape == (4, 16)


def test_structural_key_ignores_activation_names_not_weights():
    a, b = two_layer_mlp.trace(Cfg()), two_layer_mlp.trace(Cfg())   # traced twice (Cfg() is a new key)
    assert a is not b and a == b and a.key == b.key
    _, llama, _ = tiny_model("llama3")
    _, qwen, _ = tiny_model("qwen3")
    assert len({a.key, llama.key, qwen.key}) == 3


def test_shape_error_points_at_the_users_line():
    @mdsl.model
    def bad(m, cfg):
        x = m.embedding(m.weight("embed", [16, 8]))
        y = m.linear(x, m.weight("w", [4, 5]))   # the line the error names
        return y, m.argmax(y)

    with pytest.raises(ShapeError) as info:
        bad.trace(Cfg())
    err = info.value
    assert "weight 0 must be [out, 8]" in err.message
    assert err.loc.file.endswith("test_model.py") and "m.weight(\"w\", [4, 5])" in err.loc.source_line()


def test_tracing_errors():
    @mdsl.model
    def returns_one(m, cfg):
        return m.embedding(m.weight("embed", [16, 8]))

    with pytest.raises(TraceError, match="must return \\(logits, token\\)"):
        returns_one.trace(Cfg())

    @mdsl.model
    def retyped(m, cfg):
        m.weight("w", [2, 2])
        m.weight("w", [2, 3])

    with pytest.raises(ShapeError, match="declared as f32\\[2, 2\\] and again as f32\\[2, 3\\]"):
        retyped.trace(Cfg())

    @mdsl.model
    def not_a_value(m, cfg):
        return m.rms_norm(np.zeros((1, 8)), m.weight("n", [8]), 1e-6)

    with pytest.raises(TraceError, match="operand 0 is a ndarray"):
        not_a_value.trace(Cfg())

    @mdsl.model
    def cold(m, cfg):
        logits = m.linear(m.embedding(m.weight("embed", [16, 8])), m.weight("embed", [16, 8]))
        return logits, m.sample(logits, temperature=0.0)

    with pytest.raises(ValidationError, match="temperature must be > 0"):
        cold.trace(Cfg())


def test_every_layer_op_has_a_shape_rule_and_a_reference():
    # its rules in the later layers' tables: tests/ir/test_rule_tables.py
    for name, op in LAYER_OPS.items():
        assert op.infer is not None and op.reference is not None, name


def test_builtin_graphs_have_the_architecture_ops():
    _, llama, _ = tiny_model("llama3")
    _, qwen, _ = tiny_model("qwen3")
    assert "head_rms_norm" not in {n.op for n in llama.nodes}
    assert sum(n.op == "head_rms_norm" for n in qwen.nodes) == 2
    assert "lm_head.weight" in {w.name for w in llama.weights}
    assert "lm_head.weight" not in {w.name for w in qwen.weights}    # tied
    assert qwen.nodes[-2].inputs[1].name == "model.embed_tokens.weight"
    rope = next(n for n in llama.nodes if n.op == "rope").attr_dict
    assert (rope["scaling_factor"], rope["original_max_position"]) == (8.0, 8)
    assert llama.logits.type.dtype is f32 and llama.token.shape == (1,)


def _round_trips(graph):
    text = print_model_graph(graph)
    back = parse_model_graph(text)
    assert back == graph and back.key == graph.key
    assert print_model_graph(back) == text
    assert [n.loc for n in back.nodes] == [n.loc for n in graph.nodes]


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
def test_the_text_form_round_trips(arch):
    config, graph, _ = tiny_model(arch)
    _round_trips(graph)
    _round_trips(fuse(graph))
    _round_trips(sampling_decode(arch, temperature=0.7, top_p=0.9, seed=3).trace(config))
    _round_trips(two_layer_mlp.trace(Cfg()))


def test_the_mlp_activation_is_an_attribute_that_round_trips():
    _, graph, _ = tiny_model("llama3", hidden_act="gelu")
    assert {n.attr_dict["act"] for n in graph.nodes if n.op == "act_mul"} == {"gelu"}
    assert "act_mul(%" in str(graph) and "{act=gelu}" in str(graph)
    _round_trips(graph)
    fused = fuse(graph)
    assert {n.attr_dict["act"] for n in fused.nodes if n.op == "norm_gate_up"} == {"gelu"}
    _round_trips(fused)


def test_a_parsed_graph_runs_like_the_traced_one():
    _, graph, weights = tiny_model("qwen3")
    parsed = parse_model_graph(str(graph))
    assert ReferenceModel(parsed, weights).generate([1, 2], 3).tokens == ReferenceModel(graph, weights).generate(
        [1, 2], 3).tokens


_TEXT = """model tiny {
  weight %embed: f32[16, 8]
  state %tokens: i32[6]
  %t0: f32[1, 8] = embedding(%tokens, %embed)
  %t1: f32[1, 16] = linear(%t0, %embed)
  %t2: i32[1] = argmax(%t1, %tokens)
  return %t1, %t2
}"""


@pytest.mark.parametrize("change,message,line", [
    (("embedding(", "embeding("), "unknown layer op 'embeding'", 4),
    (("linear(%t0", "linear(%t9"), "undefined value %t9", 5),
    (("%t1: f32[1, 16] =", "%t1: f32[1, 15] ="), r"linear gives f32\[1, 16\], declared f32\[1, 15\]", 5),
    (("linear(%t0, %embed)", "linear(%t0, %tokens)"), "weight 0 must be", 5),
    (("return %t1, %t2", "return %t2"), r"returns \(logits, token\), got 1", 7),
    (("state %tokens: i32[6]", "state %tokens: f32[6]"), "token history", 4),
    (("%t0: f32[1, 8] = embedding", "%t0: f32[1, 8] = embedding {eps=1.0}"), r"expected '\('", 4),
    (("%t1: f32[1, 16] = linear(%t0, %embed)", "%t1: f32[1, 4] = act_mul(%t0) {act=softmax}"),
     "act='softmax' of act_mul must name an element-wise operator of one operand", 5),
])
def test_parse_errors_point_at_the_line(change, message, line):
    parse_model_graph(_TEXT)
    with pytest.raises(ParseError, match=message) as e:
        parse_model_graph(_TEXT.replace(*change))
    assert e.value.loc.line == line

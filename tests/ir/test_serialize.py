"""The JSON IR: exact round trips at every level, a strict schema, and errors naming the bad field."""
import copy
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings

from mdsl.errors import ParseError, ShapeError
from mdsl.ir.serialize import dumps, from_json, loads, to_json
from mdsl.ir.text import parse, print_graph
from tests.strategies import EXAMPLES, all_locs, example_graphs, kernel_graphs


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kernel_graphs())
def test_random_graphs_round_trip(g):
    back = from_json(to_json(g))
    assert back == g
    assert all_locs(back) == all_locs(g)
    again = loads(dumps(g))
    assert again == g and all_locs(again) == all_locs(g)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_round_trip(name):
    g = example_graphs()[name]
    back = loads(dumps(g))
    assert back == g and all_locs(back) == all_locs(g)
    assert print_graph(back) == EXAMPLES[name]


def test_block_and_thread_graphs_round_trip():
    custom = example_graphs()["rms_norm_linear"].nodes[0]
    fused = custom.body.nodes[3]
    for graph, kind in ((custom.body, "block"), (fused.body, "thread")):
        data = to_json(graph)
        assert (data["mdsl_ir"], data["kind"]) == (1, kind)
        back = from_json(json.loads(json.dumps(data)))
        assert back == graph and all_locs(back) == all_locs(graph)


def test_schema():
    data = to_json(example_graphs()["rms_norm_linear"])
    assert set(data) == {"mdsl_ir", "kind", "name", "inputs", "nodes", "outputs"}
    assert data["inputs"][0] == {"name": "x", "shape": [16, 4096], "dtype": "f16"}
    assert data["outputs"] == ["y"]
    custom = data["nodes"][0]
    assert custom["op"] == "custom" and custom["inputs"] == ["x", "w"] and custom["attrs"] == {}
    assert custom["loc"] == {"file": "examples/rms_norm_linear.py", "line": 8, "col": 11, "end_col": 31}
    body = custom["body"]
    assert (body["kind"], body["grid"], body["threads"], body["forloop"]) == ("block", [48, 1, 1], 128, 64)
    assert body["inputs"][1] == {"var": {"name": "bw", "shape": [64, 128], "dtype": "f16"},
                                 "imap": [1, None, None], "fmap": 0}
    assert body["outputs"] == [{"var": "o", "omap": [1, None, None]}]
    accum_rms = body["nodes"][2]
    assert accum_rms["attrs"] == {"eps": 1e-06} and "body" not in accum_rms and "loc" not in accum_rms
    assert body["nodes"][3]["body"]["kind"] == "thread"


def test_dumps_is_sorted_indented_strict_json():
    g = example_graphs()["layout"]  # clamp min=-inf
    text = dumps(g)
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=1)
    assert "Infinity" not in text and '"min": "-inf"' in text
    assert loads(text).nodes[5].attr("min") == -math.inf


@pytest.mark.parametrize("op,attrs,message", [
    ("add_scalar", {"value": "nan"}, "attribute value=nan of add_scalar must be a finite number"),
    ("add_scalar", {"value": "inf"}, "attribute value=inf of add_scalar must be a finite number"),
    ("clamp", {"min": "nan", "max": 1.0}, "attribute min=nan of clamp must be a number or +-inf (not NaN)"),
    ("rms_norm", {"eps": "nan"}, "attribute eps=nan of rms_norm must be a finite number >= 0"),
])
def test_non_finite_attributes_are_rejected(op, attrs, message):
    g = parse("kernel k(%x: f32[4]) {\n  %y: f32[4] = exp(%x)\n  return %y\n}")
    data = to_json(g)
    data["nodes"][0].update(op=op, attrs=attrs)
    with pytest.raises(ParseError) as e:
        loads(json.dumps(data))
    assert f"nodes[0].attrs: {message}" in str(e.value) and e.value.hint


# --- malformed data ----------------------------------------------------------------------------

def _data():
    return to_json(example_graphs()["attention"])


def _broken(edit):
    data = copy.deepcopy(_data())
    edit(data)
    with pytest.raises(ParseError) as e:
        from_json(data)
    return e.value.message


def _set(path, value):
    def edit(data):
        *head, last = path
        for key in head:
            data = data[key]
        data[last] = value
    return edit


def _delete(path):
    def edit(data):
        *head, last = path
        for key in head:
            data = data[key]
        del data[last]
    return edit


@pytest.mark.parametrize("edit,message", [
    (_set(["mdsl_ir"], 2), "mdsl_ir: unsupported version 2"),
    (_set(["mdsl_ir"], True), "mdsl_ir: unsupported version true"),
    (_delete(["mdsl_ir"]), "unsupported version null"),
    (_set(["kind"], "warp"), "kind: expected 'kernel', 'block' or 'thread'"),
    (_delete(["nodes"]), "the document: missing key 'nodes'"),
    (_set(["name"], 7), "name: expected a string, got 7"),
    (_set(["inputs", 1, "shape"], [64, "128"]), "inputs[1].shape[1]: expected an integer"),
    (_set(["inputs", 1, "shape", 0], True), "inputs[1].shape[0]: expected an integer, got true"),
    (_set(["inputs", 0, "dtype"], "f64"), "inputs[0].dtype: unknown dtype 'f64'"),
    (_set(["nodes", 1, "inputs", 1], "nope"), "nodes[1].inputs[1]: undefined value %nope"),
    (_set(["nodes", 1, "inputs"], "qs"), "nodes[1].inputs: expected a list"),
    (_set(["nodes", 0, "op"], "frobnicate"), "nodes[0].op: unknown operator 'frobnicate'"),
    (_set(["nodes", 0, "attrs"], {"value": "big"}), "nodes[0].attrs: attribute value='big'"),
    (_set(["nodes", 0, "attrs"], {"scale": 2.0}), "nodes[0].attrs: mul_scalar has no attribute 'scale'"),
    (_set(["nodes", 0, "attrs"], [1]), "nodes[0].attrs: expected an object"),
    (_set(["nodes", 0, "loc", "line"], "3"), "nodes[0].loc.line: expected an integer"),
    (_set(["nodes", 0, "loc", "col"], 1.5), "nodes[0].loc.col: expected an integer"),
    (_set(["nodes", 1, "outputs", 1, "name"], "out"), "nodes[1].outputs[1]: %out is already defined"),
    (_set(["nodes", 1, "body", "kind"], "kernel2"), "nodes[1].body.kind: expected"),
    (_set(["nodes", 1, "body", "grid"], [2, 1, 1, 1]), "nodes[1].body.grid: expected at most 3 entries"),
    (_set(["nodes", 1, "body", "inputs", 2, "fmap"], "1"), "nodes[1].body.inputs[2].fmap: expected an integer"),
    (_set(["nodes", 1, "body", "inputs", 0, "imap"], [0, "x"]), "nodes[1].body.inputs[0].imap[1]: expected an integer"),
    (_delete(["nodes", 1, "body", "threads"]), "nodes[1].body: missing key 'threads'"),
    (_set(["nodes", 1, "body", "nodes", 2, "inputs", 0], "q"), "nodes[1].body.nodes[2].inputs[0]: undefined value %q"),
    (_set(["nodes", 1, "body", "outputs", 0, "var"], "zz"), "nodes[1].body.outputs[0].var: undefined value %zz"),
    (_set(["outputs", 0], "missing"), "outputs[0]: undefined value %missing"),
    (_set(["nodes", 1], []), "nodes[1]: expected an object, got []"),
])
def test_malformed_data_names_the_field(edit, message):
    assert message in _broken(edit)


def test_not_an_object():
    with pytest.raises(ParseError, match="the document: expected an object"):
        from_json([1, 2])


def test_not_json():
    with pytest.raises(ParseError, match="not valid JSON") as e:
        loads('{"mdsl_ir": 1,\n "kind": }')
    assert e.value.loc.line == 2


def test_invalid_kernel_graph_is_rejected():
    data = _data()
    data["nodes"][0]["outputs"][0]["shape"] = [2, 16, 65]
    with pytest.raises(ShapeError):
        from_json(data)

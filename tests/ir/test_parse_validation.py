"""Parsed IR is validated exactly as traced IR: the shape, attribute and launch rules live in one place
(`mdsl.ir.types.check_shape`, the registry's `AttrSpec`s, `mdsl.ir.validate.check_launch`), and the
tracer, the text parser and the JSON reader all apply them. Errors name the text line or the JSON field
and carry a hint."""
import json
import math

import pytest

import mdsl
from mdsl import Tensor, f32
from mdsl.errors import MdslError, ParseError, ShapeError, SourceLoc, ValidationError
from mdsl.frontend.functions import bind
from mdsl.ir.serialize import from_json, loads, to_json
from mdsl.ir.text import parse, print_graph
from mdsl.ir.types import MAX_ELEMENTS, MAX_RANK


def _kernel(shape: str, *body: str, ret: str = "%x") -> str:
    return "\n".join([f"kernel k(%x: f32[{shape}]) {{", *body, f"  return {ret}", "}"])


def _text_error(text: str, cls=MdslError) -> MdslError:
    with pytest.raises(cls) as info:
        parse(text)
    assert info.value.hint, str(info.value)
    return info.value


def _json_error(data: dict, cls=MdslError) -> MdslError:
    with pytest.raises(cls) as info:
        loads(json.dumps(data))
    assert info.value.hint, str(info.value)
    return info.value


# ---------------------------------------------------------------------------------------------
# tensor shapes

@pytest.mark.parametrize("shape,message", [
    ("0", "dim 0 is 0, not a positive integer"),
    ("4, -3", "dim 1 is -3, not a positive integer"),
    ("99999999999999999, 99999999999999", "has about 2^102 elements, over mdsl's limit of 2^31 - 1"),
    ("65536, 65536", "has 4294967296 elements, over mdsl's limit of 2^31 - 1 (2147483647) elements per tensor"),
    (", ".join(["1"] * (MAX_RANK + 1)), f"has {MAX_RANK + 1} dims, more than mdsl's limit of {MAX_RANK}"),
])
def test_bad_shapes_are_rejected_at_their_line(shape, message):
    e = _text_error(_kernel("4", f"  %y: f32[{shape}] = exp(%x)", ret="%y"), ShapeError)
    assert (e.loc.file, e.loc.line) == ("<text>", 2) and message in e.message
    e = _text_error(_kernel(shape), ShapeError)
    assert (e.loc.file, e.loc.line) == ("<text>", 1) and message in e.message


def test_the_largest_tensor_is_accepted():
    parse(_kernel(f"{MAX_ELEMENTS}"))
    _text_error(_kernel(f"{MAX_ELEMENTS + 1}"), ShapeError)


@pytest.mark.parametrize("shape,message", [
    ([0], "inputs[0].shape: the tensor f32[0]: dim 0 is 0"),
    ([-1, 4], "inputs[0].shape: the tensor f32[-1, 4]: dim 0 is -1"),
    ([2**40, 2**40], "inputs[0].shape: the tensor f32[1099511627776, 1099511627776] has about 2^80 elements"),
])
def test_bad_shapes_in_json_name_the_field(shape, message):
    data = to_json(parse(_kernel("4")))
    data["inputs"][0]["shape"] = shape
    assert message in str(_json_error(data, ParseError))


def test_the_tracer_applies_the_same_shape_rule():
    @mdsl.kernel
    def outer(x: Tensor[65536, 1, f32], w: Tensor[1, 65536, f32]):
        return x @ w

    with pytest.raises(ShapeError, match="the result of matmul f32.65536, 65536. has 4294967296 elements") as e:
        outer.graph
    assert e.value.loc.file == __file__ and e.value.hint
    with pytest.raises(ShapeError, match="dims must be positive"):
        Tensor[0, f32]
    with pytest.raises(ShapeError, match="over mdsl's limit"):
        Tensor[2**31, f32]


# ---------------------------------------------------------------------------------------------
# attributes: the same rule for traced, printed and serialized graphs

BAD_ATTRIBUTES = [
    ("rms_norm", {"eps": math.nan}, "attribute eps=nan of rms_norm must be a finite number >= 0"),
    ("rms_norm", {"eps": math.inf}, "attribute eps=inf of rms_norm must be a finite number >= 0"),
    ("rms_norm", {"eps": -1e-6}, "attribute eps=-1e-06 of rms_norm must be a finite number >= 0"),
    ("clamp", {"min": math.nan, "max": 1.0}, "attribute min=nan of clamp must be a number or +-inf (not NaN)"),
    ("clamp", {"min": 0.0, "max": math.nan}, "attribute max=nan of clamp must be a number or +-inf (not NaN)"),
    ("clamp", {"min": 2.0, "max": 1.0}, "clamp: min 2.0 is greater than max 1.0"),
    ("mul_scalar", {"value": math.nan}, "attribute value=nan of mul_scalar must be a finite number"),
    ("add_scalar", {"value": -math.inf}, "attribute value=-inf of add_scalar must be a finite number"),
    ("pow_scalar", {"exponent": math.inf}, "attribute exponent=inf of pow_scalar must be a finite number"),
    ("mul_scalar", {"value": 10**400}, "attribute value=about 2^1328 of mul_scalar is beyond the range of a float64"),
    ("mul_scalar", {"value": True}, "attribute value=True of mul_scalar must be of kind float"),
    ("sum", {"dim": 10**30, "keepdim": False}, "sum: dim about 2^99 is out of range for a tensor of rank 1"),
    ("sum", {"dim": 0.5, "keepdim": False}, "attribute dim=0.5 of sum must be of kind int"),
    ("reshape", {"shape": [0, 4]}, "reshape: cannot view f32[4] (4 elements) as [0, 4]"),
]


def _one_op_graph(op: str, attrs: dict):
    """The one-node graph op(x) on f32[4], built without validation (bad attributes and all)."""
    from mdsl.ir.graph import KernelGraph, Node
    from mdsl.ir.types import TensorType, Var

    x, y = Var("x", TensorType((4,), f32)), Var("y", TensorType((4,), f32))
    return KernelGraph("k", [x], [Node(op, [x], [y], tuple(attrs.items()))], [y])


@pytest.mark.parametrize("op,attrs,message", BAD_ATTRIBUTES)
def test_bad_attributes_are_rejected_by_tracing_text_and_json(op, attrs, message):
    with pytest.raises(MdslError) as traced:  # the tracer: bind normalizes the attributes and infers the types
        mdsl.kernel(lambda x: bind(op, [x], **attrs)[0]).trace(Tensor[4, f32])
    assert message in traced.value.message and traced.value.hint, str(traced.value)
    text = print_graph(_one_op_graph(op, attrs))
    e = _text_error(text)
    assert message in e.message and (e.loc.file, e.loc.line) == ("<text>", 2)
    data = to_json(_one_op_graph(op, attrs))
    data["nodes"][0]["attrs"] = {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v)
                                 for k, v in attrs.items()}
    e = _json_error(data)
    assert message in e.message and e.message.startswith("nodes[0]"), e.message


@pytest.mark.parametrize("attrs", [{"min": -math.inf, "max": math.inf}, {"min": 0.0, "max": 0.0}])
def test_infinite_clamp_bounds_are_valid_everywhere(attrs):
    g = mdsl.kernel(lambda x: mdsl.clamp(x, **attrs)).trace(Tensor[4, f32])
    assert parse(print_graph(g)) == g and loads(json.dumps(to_json(g))) == g


# ---------------------------------------------------------------------------------------------
# launch parameters of block graphs

BLOCK = """\
kernel k(%x: f32[4]) {
  %y: f32[4] = custom(%x) block(grid=[GRID], threads=THREADS, forloop=LOOP) {
    in %bx: f32[2] imap=[0, -, -] fmap=-
    %a: f32[2] = accum(%bx)
    out %a omap=[0, -, -]
  }
  return %y
}"""


def _block(grid="2, 1, 1", threads="32", loop="1") -> str:
    return BLOCK.replace("GRID", grid).replace("THREADS", threads).replace("LOOP", loop)


@pytest.mark.parametrize("field,edit,message", [
    ("grid", {"grid": "0, 1, 1"}, "grid [0, 1, 1]: dim x must be an integer from 1 to 2147483647"),
    ("grid", {"grid": "2, 70000, 1"}, "grid [2, 70000, 1]: dim y must be an integer from 1 to 65535"),
    ("forloop", {"loop": "0"}, "the for-loop range must be an integer from 1 to 2147483647, got 0"),
    ("forloop", {"loop": "99999999999999999999"}, "the for-loop range must be an integer from 1 to 2147483647"),
    ("threads", {"threads": "0"}, "a block of 0 threads: use a multiple of 32 between 32 and 1024"),
])
def test_bad_launch_parameters(field, edit, message):
    parse(_block())
    e = _text_error(_block(**edit), ValidationError)
    assert message in e.message and (e.loc.file, e.loc.line) == ("<text>", 2)
    data = to_json(parse(_block()))
    data["nodes"][0]["body"][field] = json.loads(f"[{edit['grid']}]" if field == "grid" else next(iter(edit.values())))
    e = _json_error(data, ValidationError)
    assert e.message.startswith(f"nodes[0].body.{field}: ") and message in e.message


def test_json_validation_errors_name_the_field_inside_a_body():
    data = to_json(parse(_block()))
    data["nodes"][0]["body"]["nodes"][0]["outputs"][0]["shape"] = [3]
    with pytest.raises(ShapeError) as info:
        loads(json.dumps(data))
    assert info.value.message == "nodes[0].body.nodes[0]: accum: %a is declared f32[3] but the operator gives f32[2]"


@pytest.mark.parametrize("field", ["line", "col", "end_col"])
def test_json_source_locations_hold_what_the_text_form_can(field):
    """A location the text form could not print back (a negative line or column) is rejected."""
    data = to_json(parse(_kernel("4", "  %y: f32[4] = exp(%x)  # @ user.py:3:4-9", ret="%y")))
    data["nodes"][0]["loc"][field] = -1
    e = _json_error(data, ParseError)
    assert e.message == f"nodes[0].loc.{field}: expected a line or column number (>= 0), got -1"


def test_kernel_names_are_identifiers():
    data = to_json(parse(_kernel("4")))
    data["name"] = "my kernel"
    assert _json_error(data, ValidationError).message == "name: 'my kernel' is not a valid kernel name"


# ---------------------------------------------------------------------------------------------
# nesting and enormous numbers: ParseErrors, never RecursionError or ValueError


def test_deeply_nested_text_is_a_parse_error():
    nested = "".join(f"  %n{k}: f32[4] = fused() thread {{\n" for k in range(5000))
    e = _text_error("kernel k(%x: f32[4]) {\n" + nested + "}", ParseError)
    assert e.message == "graph bodies nest more than 2 deep" and e.loc.line == 4
    e = _text_error(_kernel("4", "  %y: f32[4] = exp(%x) {v=" + "[" * 5000 + "}", ret="%y"), ParseError)
    assert e.loc.line == 2


def test_deeply_nested_json_is_a_parse_error():
    with pytest.raises(ParseError, match="nests too deeply") as e:
        loads("[" * 100_000 + "]" * 100_000)
    assert e.value.hint
    thread = {"kind": "thread", "inputs": [], "outputs": [], "nodes": []}
    for _ in range(3):
        thread = {"kind": "thread", "inputs": [], "outputs": [],
                  "nodes": [{"op": "fused", "inputs": [], "outputs": [], "attrs": {}, "body": thread}]}
    with pytest.raises(ParseError, match=r"nodes\[0\].body.nodes\[0\].body: graph bodies nest more than 2 deep"):
        from_json({"mdsl_ir": 1, **thread})


def test_integers_of_thousands_of_digits():
    e = _text_error(_kernel("9" * 5000), ParseError)
    assert "has 5000 digits, too many to read" in e.message and e.loc.line == 1
    e = _text_error(_kernel("4", "  %y: f32[4] = exp(%x)  # @ user.py:" + "9" * 5000, ret="%y"), ParseError)
    assert "too many digits" in e.message and e.loc.line == 2
    with pytest.raises(ParseError, match="too many digits"):
        loads('{"mdsl_ir": ' + "9" * 5000 + "}")
    with pytest.raises(ParseError, match=r"mdsl_ir: unsupported version about 2\^16609"):
        from_json({"mdsl_ir": 10**5000})


def test_a_location_naming_a_device_is_not_read():
    """The message of an error at a node whose `# @` location names /dev/zero renders without reading it."""
    e = _text_error(_kernel("4", "  %y: f32[5] = exp(%x)  # @ /dev/zero:1:0-3", ret="%y"), ShapeError)
    assert SourceLoc("/dev/zero", 1, 0, 3).render() == ""
    assert "<text>:2" in str(e)

"""The JSON form of the mugraph (what the search cache stores), at its three levels.

    {"mdsl_ir": 1, "kind": "kernel", "name": ..., "inputs": [TENSOR], "nodes": [NODE], "outputs": [NAME]}
    {"mdsl_ir": 1, "kind": "block", "grid": [x, y, z], "threads": T, "forloop": R,
     "inputs": [{"var": TENSOR, "imap": [d|null]*3, "fmap": d|null}], "nodes": [NODE],
     "outputs": [{"var": NAME, "omap": [d|null]*3}]}
    {"mdsl_ir": 1, "kind": "thread", "inputs": [TENSOR], "nodes": [NODE], "outputs": [NAME]}

    TENSOR = {"name": "x", "shape": [16, 4096], "dtype": "f16"}
    NODE = {"op": "rms_norm", "inputs": [NAME], "outputs": [TENSOR], "attrs": {"eps": 1e-06, ...},
            "body": GRAPH (no "mdsl_ir"), "loc": {"file", "line", "col", "end_col"}}  # body, loc optional

Values are referred to by name after their definition. Attribute values are JSON numbers, booleans,
lists and dtype names; infinite and NaN floats are the strings "inf", "-inf", "nan" (strict JSON).
"""
from __future__ import annotations

import json
import math
from typing import Any, Optional, Union

from mdsl.errors import MdslError, ParseError, SourceLoc, short_repr
from mdsl.ir.dtypes import DTYPES, DType
from mdsl.ir.graph import BlockGraph, BlockInput, BlockOutput, KernelGraph, Node, ThreadGraph
from mdsl.ir.ops import OpDef, get_op
from mdsl.ir.types import TensorType, Var, check_shape
from mdsl.ir.validate import check_launch, validate_kernel_graph

VERSION = 1
# A kernel's custom op holds a block graph, whose fused op holds a thread graph: nothing nests deeper.
_MAX_BODY_DEPTH = 2
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
Graph = Union[KernelGraph, BlockGraph, ThreadGraph]

# ---------------------------------------------------------------------------------------------
# writing


def to_json(graph: Graph) -> dict:
    return {"mdsl_ir": VERSION, **_graph(graph)}


def dumps(graph: Graph) -> str:
    return json.dumps(to_json(graph), sort_keys=True, indent=1, allow_nan=False)


def _graph(g: Graph) -> dict:
    if isinstance(g, KernelGraph):
        return {"kind": "kernel", "name": g.name, "inputs": [_tensor(v) for v in g.inputs],
                "nodes": [_node(n) for n in g.nodes], "outputs": [v.name for v in g.outputs]}
    if isinstance(g, BlockGraph):
        return {"kind": "block", "grid": list(g.grid), "threads": g.threads, "forloop": g.forloop,
                "inputs": [{"var": _tensor(i.var), "imap": list(i.imap), "fmap": i.fmap} for i in g.inputs],
                "nodes": [_node(n) for n in g.nodes],
                "outputs": [{"var": o.var.name, "omap": list(o.omap)} for o in g.outputs]}
    if isinstance(g, ThreadGraph):
        return {"kind": "thread", "inputs": [_tensor(v) for v in g.inputs],
                "nodes": [_node(n) for n in g.nodes], "outputs": [v.name for v in g.outputs]}
    raise TypeError(f"not a mugraph: {type(g).__name__}")


def _tensor(v: Var) -> dict:
    return {"name": v.name, "shape": list(v.shape), "dtype": v.dtype.name}


def _node(n: Node) -> dict:
    out = {"op": n.op, "inputs": [v.name for v in n.inputs], "outputs": [_tensor(v) for v in n.outputs],
           "attrs": {k: _attr(v) for k, v in n.attrs}}
    if n.body is not None:
        out["body"] = _graph(n.body)
    if n.loc is not None:
        out["loc"] = {"file": n.loc.file, "line": n.loc.line, "col": n.loc.col, "end_col": n.loc.end_col}
    return out


def _attr(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # "inf", "-inf", "nan": float() reads them back
    if isinstance(v, DType):
        return v.name
    if isinstance(v, tuple):
        return [_attr(x) for x in v]
    return v


# ---------------------------------------------------------------------------------------------
# reading: every check names the offending field, e.g. nodes[3].inputs[1]


def loads(text: str) -> Graph:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ParseError(f"not valid JSON: {e.msg}", loc=SourceLoc("<json>", e.lineno, e.colno - 1)) from None
    except RecursionError:
        raise ParseError("not a mugraph: the JSON nests too deeply to read",
                         hint=f"graph bodies nest at most {_MAX_BODY_DEPTH} deep") from None
    except ValueError:  # an integer of more digits than Python converts
        raise ParseError("not a mugraph: an integer of too many digits to read",
                         hint="no size, dim or attribute of a mugraph needs that many") from None
    return from_json(data)


def from_json(data: Any) -> Graph:
    """Read a graph of any level; malformed data raises ParseError, an invalid kernel graph the
    error of the rule it breaks, its message starting with the path of the failing field."""
    _object(data, "the document")
    version = data.get("mdsl_ir")
    if type(version) is not int or version != VERSION:
        raise ParseError(f"mdsl_ir: unsupported version {_describe(version)} (this mdsl reads version {VERSION})")
    graph = _read_graph(data, "", 0)
    if isinstance(graph, KernelGraph):
        try:
            validate_kernel_graph(graph)
        except MdslError as e:
            if e.ir_path is not None:
                e.message = f"{e.ir_path}: {e.message}"
                e.args = (e.message,)
            raise
    return graph


def _fail(path: str, message: str) -> ParseError:
    return ParseError(f"{path or 'the document'}: {message}",
                      hint="the JSON form is what mdsl.ir.serialize.dumps writes (schema: mdsl/ir/serialize.py)")


def _describe(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):  # not JSON data, or an int of too many digits
        text = short_repr(value) if not isinstance(value, (list, dict)) else f"a {type(value).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."


def _object(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise _fail(path, f"expected an object, got {_describe(value)}")
    return value


def _field(obj: dict, key: str, path: str) -> tuple:
    """The value at `key` and its path."""
    sub = f"{path}.{key}" if path else key
    if key not in obj:
        raise _fail(path, f"missing key {key!r}")
    return obj[key], sub


def _int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, f"expected an integer, got {_describe(value)}")
    return value


def _opt_int(value: Any, path: str) -> Optional[int]:
    return None if value is None else _int(value, path)


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _fail(path, f"expected a string, got {_describe(value)}")
    return value


def _list(value: Any, path: str, item) -> list:
    """`item(element, its path)` for every element of a JSON list."""
    if not isinstance(value, list):
        raise _fail(path, f"expected a list, got {_describe(value)}")
    return [item(x, f"{path}[{i}]") for i, x in enumerate(value)]


def _get(obj: dict, key: str, path: str, read) -> Any:
    """`read(value, its path)` of the value at `key`."""
    return read(*_field(obj, key, path))


def _items(obj: dict, key: str, path: str, read) -> list:
    """`read(element, its path)` for every element of the list at `key`."""
    value, sub = _field(obj, key, path)
    return _list(value, sub, read)


def _triple(value: Any, path: str, item) -> list:
    entries = _list(value, path, item)
    if len(entries) > 3:
        raise _fail(path, f"expected at most 3 entries (grid x, y, z), got {len(entries)}")
    return entries


def _grid(value: Any, path: str) -> list:
    return _triple(value, path, _int)


def _grid_map(value: Any, path: str) -> list:
    """imap/omap: for each grid dim, a tensor dim or null."""
    return _triple(value, path, _opt_int)


def _tensor_var(value: Any, path: str) -> Var:
    obj = _object(value, path)
    dtype_name = _get(obj, "dtype", path, _str)
    if dtype_name not in DTYPES:
        raise _fail(f"{path}.dtype", f"unknown dtype {dtype_name!r} (expected one of {', '.join(DTYPES)})")
    shape = _items(obj, "shape", path, _int)
    try:
        check_shape(shape, DTYPES[dtype_name], "the tensor")
    except MdslError as e:
        raise ParseError(f"{path}.shape: {e.message}", hint=e.hint) from None
    return Var(_get(obj, "name", path, _str), TensorType(shape, DTYPES[dtype_name]))


class _Scope:
    """Values defined so far in one graph, by name."""

    def __init__(self):
        self.vars: dict = {}

    def define(self, var: Var, path: str) -> Var:
        if var.name in self.vars:
            raise _fail(path, f"%{var.name} is already defined")
        self.vars[var.name] = var
        return var

    def use(self, value: Any, path: str) -> Var:
        var = self.vars.get(_str(value, path))
        if var is None:
            raise _fail(path, f"undefined value %{value}")
        return var


def _read_graph(value: Any, path: str, depth: int) -> Graph:
    """A graph; `depth` counts the bodies around it (a kernel, or a top-level block or thread graph: 0)."""
    obj = _object(value, path)
    kind = _get(obj, "kind", path, _str)
    readers = {"kernel": _read_kernel, "block": _read_block, "thread": _read_thread}
    if kind not in readers:
        raise _fail(f"{path}.kind" if path else "kind", f"expected 'kernel', 'block' or 'thread', got {_describe(kind)}")
    if kind != "kernel" and not path:
        depth += 1   # a top-level block or thread graph is a body itself
    if depth > _MAX_BODY_DEPTH:
        raise ParseError(f"{path}: graph bodies nest more than {_MAX_BODY_DEPTH} deep",
                         hint="a kernel's custom op holds a block graph, a block graph's fused op holds a "
                              "thread graph, and a thread graph holds element-wise ops only")
    return readers[kind](obj, path, _Scope(), depth)


def _read_kernel(obj: dict, path: str, scope: _Scope, depth: int) -> KernelGraph:
    name = _get(obj, "name", path, _str)
    inputs = _items(obj, "inputs", path, lambda v, p: scope.define(_tensor_var(v, p), p))
    nodes = _items(obj, "nodes", path, lambda v, p: _read_node(v, p, scope, depth))
    outputs = _items(obj, "outputs", path, scope.use)
    return KernelGraph(name, inputs, nodes, outputs)


def _read_block(obj: dict, path: str, scope: _Scope, depth: int) -> BlockGraph:
    def block_input(value, p):
        entry = _object(value, p)
        var = scope.define(_get(entry, "var", p, _tensor_var), f"{p}.var")
        imap = _get(entry, "imap", p, _grid_map)
        return BlockInput(var, imap, _get(entry, "fmap", p, _opt_int))

    def block_output(value, p):
        entry = _object(value, p)
        var = _get(entry, "var", p, scope.use)
        return BlockOutput(var, _get(entry, "omap", p, _grid_map))

    grid = _get(obj, "grid", path, _grid)
    threads = _get(obj, "threads", path, _int)
    forloop = _get(obj, "forloop", path, _int)
    try:
        check_launch(tuple(grid) + (1,) * (3 - len(grid)), threads, forloop)
    except MdslError as e:
        raise type(e)(f"{path}.{e.ir_path}: {e.message}" if path else f"{e.ir_path}: {e.message}", hint=e.hint) from None
    inputs = _items(obj, "inputs", path, block_input)
    nodes = _items(obj, "nodes", path, lambda v, p: _read_node(v, p, scope, depth))
    outputs = _items(obj, "outputs", path, block_output)
    return BlockGraph(grid, threads, forloop, inputs, nodes, outputs)


def _read_thread(obj: dict, path: str, scope: _Scope, depth: int) -> ThreadGraph:
    inputs = _items(obj, "inputs", path, lambda v, p: scope.define(_tensor_var(v, p), p))
    nodes = _items(obj, "nodes", path, lambda v, p: _read_node(v, p, scope, depth))
    outputs = _items(obj, "outputs", path, scope.use)
    return ThreadGraph(inputs, nodes, outputs)


def _read_node(value: Any, path: str, scope: _Scope, depth: int) -> Node:
    obj = _object(value, path)
    op_name, op_path = _field(obj, "op", path)
    op_name = _str(op_name, op_path)
    try:
        op = get_op(op_name)
    except MdslError as e:
        raise ParseError(f"{op_path}: {e.message}", hint=e.hint) from None
    inputs = _items(obj, "inputs", path, scope.use)
    outputs = _items(obj, "outputs", path, _tensor_var)
    raw_attrs, attrs_path = _field(obj, "attrs", path)
    raw_attrs = _object(raw_attrs, attrs_path)
    try:
        attrs = op.normalize_attrs(_non_finite_floats(op, raw_attrs))
    except MdslError as e:
        raise ParseError(f"{attrs_path}: {e.message}", hint=e.hint) from None
    body = _read_graph(*_field(obj, "body", path), depth + 1) if "body" in obj else None
    loc = _read_loc(*_field(obj, "loc", path)) if "loc" in obj else None
    for k, var in enumerate(outputs):
        scope.define(var, f"{path}.outputs[{k}]")
    return Node(op.name, inputs, outputs, attrs, body, loc)


def _non_finite_floats(op: OpDef, raw: dict) -> dict:
    """The attributes with "inf", "-inf" and "nan" read as floats where the operator wants a float."""
    floats = {s.name for s in op.attr_specs if s.kind == "float"}
    return {k: _NON_FINITE.get(v, v) if k in floats and isinstance(v, str) else v for k, v in raw.items()}


def _count(value: Any, path: str) -> int:
    """A line or column number: an integer >= 0 (what the text form's `# @ FILE:LINE:COL-END` holds)."""
    number = _int(value, path)
    if number < 0:
        raise _fail(path, f"expected a line or column number (>= 0), got {_describe(value)}")
    return number


def _read_loc(value: Any, path: str) -> SourceLoc:
    obj = _object(value, path)
    col, end_col = obj.get("col"), obj.get("end_col")
    return SourceLoc(_get(obj, "file", path, _str), _get(obj, "line", path, _count),
                     None if col is None else _count(col, f"{path}.col"),
                     None if end_col is None else _count(end_col, f"{path}.end_col"))

"""The mugraph's text, printed (mdsl.ir.text describes it and parses it back).

The printer knows the graphs by their fields, not by their classes: mdsl.ir.graph prints through it
(`str(graph)`), so it imports nothing of mdsl.ir.graph.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from mdsl.errors import SourceLoc
from mdsl.ir.dtypes import DType
from mdsl.ir.types import Var


def print_graph(g) -> str:
    """The text of a kernel graph (`str(graph)`)."""
    params = ", ".join(_decl(v) for v in g.inputs)
    lines = [f"kernel {g.name}({params}) {{"]
    for node in g.nodes:
        lines += _node_lines(node, 2)
    lines.append(f"  return {', '.join(map(str, g.outputs))}".rstrip())
    lines.append("}")
    return "\n".join(lines)


def print_block_graph(bg, indent: int = 0) -> str:
    """`indent` is that of the line the header starts on; the header itself is not indented, so that
    it can follow a `custom` node's `=`."""
    return "\n".join(_body_lines(bg, indent))


def print_thread_graph(tg, indent: int = 0) -> str:
    return "\n".join(_body_lines(tg, indent))


def print_node(node, indent: int = 0) -> str:
    return "\n".join(_node_lines(node, indent))


def _decl(v: Var) -> str:
    return f"{v}: {v.type}"


def _node_lines(node, indent: int) -> list:
    outs = ", ".join(_decl(v) for v in node.outputs)
    head = f"{' ' * indent}{outs} = {node.op}({', '.join(map(str, node.inputs))})"
    if node.attrs:
        head += " " + format_attrs(node.attrs)
    if node.body is None:
        return [head + _loc_comment(node.loc)]
    lines = _body_lines(node.body, indent)
    lines[0] = f"{head} {lines[0]}"
    lines[-1] += _loc_comment(node.loc)
    return lines


def _body_lines(g, indent: int) -> list:
    """Header (unindented), inner lines indented by 2 more spaces, closing brace. A block graph is the
    body with a launch (a grid), a thread graph the one without."""
    pad = " " * (indent + 2)
    if hasattr(g, "grid"):
        header = f"block(grid={_ints(g.grid)}, threads={g.threads}, forloop={g.forloop}) {{"
        ins = [f"{pad}in {_decl(i.var)} imap={_map(i.imap)} fmap={_entry(i.fmap)}" for i in g.inputs]
        outs = [f"{pad}out {o.var} omap={_map(o.omap)}" for o in g.outputs]
    elif hasattr(g, "nodes"):
        header = "thread {"
        ins = [f"{pad}in {_decl(v)}" for v in g.inputs]
        outs = [f"{pad}out {v}" for v in g.outputs]
    else:
        raise TypeError(f"a node body must be a block or thread graph, not {type(g).__name__}")
    nodes = [line for n in g.nodes for line in _node_lines(n, indent + 2)]
    return [header, *ins, *nodes, *outs, " " * indent + "}"]


def _ints(values) -> str:
    return f"[{', '.join(map(str, values))}]"


def _entry(d: Optional[int]) -> str:
    return "-" if d is None else str(d)


def _map(entries) -> str:
    return f"[{', '.join(map(_entry, entries))}]"


def format_attrs(pairs: tuple) -> str:
    """`{name=value, ...}` as the text form writes attributes; '' for none."""
    if not pairs:
        return ""
    return "{" + ", ".join(f"{k}={_attr_value(v)}" for k, v in pairs) + "}"


def _attr_value(v) -> str:
    if isinstance(v, bool):  # before int: bool is an int
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)  # shortest text that reads back to the same float, and inf/nan
    if isinstance(v, int):
        return str(v)
    if isinstance(v, DType):
        return v.name
    if isinstance(v, str) and v.isidentifier():   # an operator's name (an `op` attribute)
        return v
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(map(_attr_value, v)) + "]"
    raise TypeError(f"cannot print attribute value {v!r}")


def _loc_comment(loc: Optional[SourceLoc]) -> str:
    if loc is None:
        return ""
    text = f"  # @ {_loc_file(loc.file)}:{loc.line}"
    if loc.col is not None:
        text += f":{loc.col}"
    if loc.end_col is not None:
        text += f"-{loc.end_col}"
    return text


def _loc_file(file: str) -> str:
    # The location is read from the right, with the shortest file name that fits; a name ending in
    # `:123` would lose digits to the line, so it (and any name the line cannot hold) goes in quotes.
    plain = file.isprintable() and file == file.strip() and not file.startswith('"') and not re.search(r":\d+\Z", file)
    return file if plain else json.dumps(file)

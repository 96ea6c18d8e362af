"""The DOT (Graphviz) form of the mugraph, for pictures: `dot -Tsvg graph.dot > graph.svg`.

Kernel inputs and outputs are ellipses and operators boxes. A `custom` node is drawn as a cluster
holding its block graph: its inputs (with imap/fmap on the edges that feed them), its operators
(accumulators filled, so the end of the for-loop stands out) and its outputs (with their omap). A
`fused` node is a cluster inside that cluster holding its thread graph. Vertex ids are generated
(`n0`, `n1`, ...), so value names appear only in quoted labels.
"""
from __future__ import annotations

import itertools
from typing import Optional, Union

from mdsl.ir.graph import BlockGraph, KernelGraph, Node, ThreadGraph
from mdsl.ir.text import format_attrs
from mdsl.ir.types import Var

Graph = Union[KernelGraph, BlockGraph, ThreadGraph]

_ACCUMULATOR_STYLE = {"style": "filled,bold", "fillcolor": "lightgoldenrod1"}


def to_dot(graph: Graph) -> str:
    writer = _Writer()
    if isinstance(graph, KernelGraph):
        writer.line(f"label={_quote(f'kernel {graph.name}')}; labelloc=t;")
        writer.kernel(graph)
    elif isinstance(graph, (BlockGraph, ThreadGraph)):
        writer.body(graph, [], [])
    else:
        raise TypeError(f"not a mugraph: {type(graph).__name__}")
    return "\n".join(["digraph mdsl {", '  node [fontname="monospace"]; edge [fontname="monospace"];',
                      *writer.lines, *writer.edges, "}"]) + "\n"


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _decl(v: Var) -> str:
    return f"{v}: {v.type}"


def _entry(d) -> str:
    return "-" if d is None else str(d)


def _map(entries) -> str:
    return "[" + ", ".join(map(_entry, entries)) + "]"


def _op_label(node: Node) -> str:
    head = f"{node.op} {format_attrs(node.attrs)}".rstrip()
    return "\n".join([head, *map(_decl, node.outputs)])


class _Producer:
    """Where a value comes from: a vertex, and the edge label naming the value when that vertex
    makes several."""

    def __init__(self, vertex: str, label: Optional[str] = None):
        self.vertex = vertex
        self.label = label


class _Writer:
    def __init__(self):
        self.lines: list = []
        self.edges: list = []  # written last, at the top: an edge inside a cluster pulls its ends into it
        self.depth = 1
        self.vertices = itertools.count()
        self.clusters = itertools.count()

    def line(self, text: str) -> None:
        self.lines.append("  " * self.depth + text)

    def vertex(self, label: str, **style: str) -> str:
        vid = f"n{next(self.vertices)}"
        attrs = "".join(f", {k}={_quote(v)}" for k, v in style.items())
        self.line(f"{vid} [label={_quote(label)}{attrs}];")
        return vid

    def edge(self, src: _Producer, dst: str, label: Optional[str] = None) -> None:
        text = "\n".join(t for t in (src.label, label) if t)
        self.edges.append(f"  {src.vertex} -> {dst}" + (f" [label={_quote(text)}]" if text else "") + ";")

    def kernel(self, g: KernelGraph) -> None:
        producers = {v.name: _Producer(self.vertex(_decl(v), shape="ellipse")) for v in g.inputs}
        self.nodes(g.nodes, producers)
        for v in g.outputs:
            self.edge(producers[v.name], self.vertex(f"return {_decl(v)}", shape="ellipse", style="bold"))

    def nodes(self, nodes, producers: dict) -> None:
        for node in nodes:
            operands = [producers[v.name] for v in node.inputs]
            if node.body is not None:
                outs = self.body(node.body, operands, node.outputs, node.op)
                producers.update((v.name, _Producer(vid)) for v, vid in zip(node.outputs, outs))
                continue
            style = _ACCUMULATOR_STYLE if node.opdef.is_accumulator else {}
            vid = self.vertex(_op_label(node), shape="box", **style)
            for src in operands:
                self.edge(src, vid)
            several = len(node.outputs) > 1
            producers.update((v.name, _Producer(vid, str(v) if several else None)) for v in node.outputs)

    def body(self, g: Union[BlockGraph, ThreadGraph], operands: list, results, op: str = "") -> list:
        """A block or thread graph as a cluster fed by `operands`; the vertex ids of its outputs."""
        self.line(f"subgraph cluster_{next(self.clusters)} {{")
        self.depth += 1
        if isinstance(g, BlockGraph):
            title = f"block grid={list(g.grid)} threads={g.threads} forloop={g.forloop}"
            ins = [(i.var, f"imap={_map(i.imap)} fmap={_entry(i.fmap)}") for i in g.inputs]
            outs = [(o.var, f" omap={_map(o.omap)}") for o in g.outputs]
        else:
            title = "thread"
            ins = [(v, "") for v in g.inputs]
            outs = [(v, "") for v in g.outputs]
        self.line(f"label={_quote(f'{op}: {title}' if op else title)}; style=rounded;")
        producers = {}
        for k, (var, maps) in enumerate(ins):
            # the maps label the edge from the operand; a graph drawn alone shows them in the vertex
            fed = k < len(operands)
            vid = self.vertex(f"in {_decl(var)}" + (f"\n{maps}" if maps and not fed else ""), shape="invhouse")
            if fed:
                self.edge(operands[k], vid, maps or None)
            producers[var.name] = _Producer(vid)
        self.nodes(g.nodes, producers)
        vids = []
        for k, (var, omap) in enumerate(outs):
            result = f"\n{_decl(results[k])}" if k < len(results) else ""
            vid = self.vertex(f"out {var}{omap}{result}", shape="house")
            self.edge(producers[var.name], vid)
            vids.append(vid)
        self.depth -= 1
        self.line("}")
        return vids

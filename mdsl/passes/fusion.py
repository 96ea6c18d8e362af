"""Thread-graph fusion: element-wise chains of a block graph become `fused` nodes kept in registers.

An element-wise node joins the node that consumes it when its result has that one user and nothing
else needs it as a tile: the user is element-wise too, runs in the same phase (the for-loop body or
after the loop), the value is not a block output, and it has the user's shape (a smaller, broadcast
operand would be recomputed for every element it is broadcast to). Each group of joined nodes is an
in-tree whose root's result leaves the group; it becomes one `fused` node at the root's position,
whose thread graph holds the members in their original order. A lone element-wise node stays as it is.
"""
from __future__ import annotations

import attrs

from mdsl.ir.dump import dump_ir
from mdsl.ir.graph import BlockGraph, KernelGraph, Node, ThreadGraph


def fuse_kernel_graph(graph: KernelGraph) -> KernelGraph:
    """The graph with every custom node's block graph fused."""
    nodes = [attrs.evolve(n, body=fuse_block_graph(n.body, dump=False)) if isinstance(n.body, BlockGraph) else n
             for n in graph.nodes]
    fused = attrs.evolve(graph, nodes=nodes)
    dump_ir("fusion", fused)
    return fused


def fuse_block_graph(bg: BlockGraph, *, dump: bool = True) -> BlockGraph:
    root = _group_roots(bg)
    members: dict = {}
    for i, r in enumerate(root):
        members.setdefault(r, []).append(i)
    # at its root's position a group's inputs are all defined
    nodes = [_fused_node([bg.nodes[k] for k in members[r]]) if len(members[r]) > 1 else bg.nodes[r]
             for r in sorted(members)]
    fused = attrs.evolve(bg, nodes=nodes)
    if dump:
        dump_ir("fusion", fused)
    return fused


def _fusible(node: Node) -> bool:
    return node.opdef.is_elementwise and len(node.outputs) == 1


def _group_roots(bg: BlockGraph) -> list:
    """For each node, the index of the node whose fused group it joins (itself when it joins none)."""
    users: dict = {}
    for i, node in enumerate(bg.nodes):
        for v in node.inputs:
            users.setdefault(v.name, set()).add(i)
    kept = {o.var.name for o in bg.outputs}
    root = list(range(len(bg.nodes)))
    for i in reversed(range(len(bg.nodes))):  # users first, so that a chain joins its final root
        node = bg.nodes[i]
        if not _fusible(node):
            continue
        out = node.output
        (user, *more) = sorted(users.get(out.name, ())) or [None]
        if user is None or more or out.name in kept:
            continue
        consumer = bg.nodes[user]
        # an element-wise user of a loop value is in the loop too (anything else would mix phases)
        if _fusible(consumer) and consumer.output.shape == out.shape:
            root[i] = root[user]
    return root


def _fused_node(group: list) -> Node:
    """One `fused` node computing the group's root from the values the group reads."""
    defined = {v.name for n in group for v in n.outputs}
    inputs = list(dict.fromkeys(v for n in group for v in n.inputs if v.name not in defined))
    result = group[-1].output
    body = ThreadGraph(inputs, group, [result])
    return Node("fused", inputs, [result], body=body, loc=group[-1].loc)

"""The straightforward walk that `mdsl.ir.evaluate` vectorises, kept as its test oracle: each block of
a custom kernel runs on its own, iteration by iteration, on copies of its tiles, and writes its output
tiles where its omap says. Generic over a `Semantics` like the real walk; it checks nothing (it is
only ever given valid graphs)."""
from __future__ import annotations

import itertools

from mdsl.ir.graph import BlockGraph, KernelGraph
from mdsl.ir.ops import BLOCK, THREAD
from mdsl.ir.validate import output_tensor_type


def run_kernel_graph(graph: KernelGraph, inputs: list, sem) -> list:
    env = {v.name: sem.store(v, sem.take_input(v, a)) for v, a in zip(graph.inputs, inputs)}
    for node in graph.nodes:
        _run_nodes(sem, [node], env)
        for v in node.outputs:
            env[v.name] = sem.store(v, env[v.name])
    return [env[v.name] for v in graph.outputs]


def _run_nodes(sem, nodes, env: dict) -> None:
    for node in nodes:
        args = [env[v.name] for v in node.inputs]
        if node.opdef.body_level == BLOCK:
            outs = _run_block_graph(sem, node.body, args)
        elif node.opdef.body_level == THREAD:
            inner = {v.name: sem.convert(a) for v, a in zip(node.body.inputs, args)}
            _run_nodes(sem, node.body.nodes, inner)
            outs = [inner[v.name] for v in node.body.outputs]
        else:
            outs = sem.apply(node, args)
        env.update((v.name, sem.convert(o)) for v, o in zip(node.outputs, outs))


def _part(shape: tuple, dim_map: tuple, grid: tuple, block: tuple) -> tuple:
    """The slices of `block`'s part of a tensor of `shape` split along `dim_map`."""
    out = [slice(None)] * len(shape)
    for d, size, b in zip(dim_map, grid, block):
        if d is not None:
            n = shape[d] // size
            out[d] = slice(b * n, (b + 1) * n)
    return tuple(out)


def _iteration(tile_shape: tuple, fmap, i: int) -> tuple:
    out = [slice(None)] * len(tile_shape)
    if fmap is not None:
        out[fmap] = slice(i * tile_shape[fmap], (i + 1) * tile_shape[fmap])
    return tuple(out)


def _run_block_graph(sem, bg: BlockGraph, inputs: list) -> list:
    inputs = [sem.convert(a) for a in inputs]
    out_types = [output_tensor_type(o.var.type, bg.grid, o.omap) for o in bg.outputs]
    outputs = [sem.empty(t) for t in out_types]
    post = bg.post_loop_vars()
    accumulators = [n for n in bg.nodes if n.opdef.is_accumulator]
    loop = [n for n in bg.nodes if not n.opdef.is_accumulator and n.outputs[0].name not in post]
    after = [n for n in bg.nodes if not n.opdef.is_accumulator and n.outputs[0].name in post]
    x, y, z = bg.grid
    for bz, by, bx in itertools.product(range(z), range(y), range(x)):
        block = (bx, by, bz)
        parts = [a[_part(sem.shape(a), inp.imap, bg.grid, block)] for a, inp in zip(inputs, bg.inputs)]
        collected = [[] for _ in accumulators]
        for i in range(bg.forloop):
            env = {inp.var.name: part[_iteration(inp.var.shape, inp.fmap, i)].copy()
                   for inp, part in zip(bg.inputs, parts)}
            _run_nodes(sem, loop, env)
            for node, per_iteration in zip(accumulators, collected):
                per_iteration.append([env[v.name] for v in node.inputs])
        env = {}
        for node, per_iteration in zip(accumulators, collected):
            env.update((v.name, sem.convert(o)) for v, o in zip(node.outputs, sem.accumulate(node, per_iteration)))
        _run_nodes(sem, after, env)
        for out, t, o in zip(outputs, out_types, bg.outputs):
            out[_part(t.shape, o.omap, bg.grid, block)] = env[o.var.name]
    return outputs

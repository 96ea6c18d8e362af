"""Layer ops of tensor-parallel model graphs: communication between ranks and the vocabulary-split
embedding. Each is one entry of the layer-op registry holding its shape rule, with its rules in the
task graph's tables (`partition.TASK_RULES`, `numpy_bodies.TASK_BODIES`) and, for a collective, in
`COLLECTIVE_RULES`: its numpy semantics over ranks (`over_ranks`: (inputs per rank, attrs, contexts per
rank) -> outputs per rank) and, for the tasks that send, its `puts` (kind -> (task, node) -> Puts): what
a task writes into other ranks' memory.

Every rank runs the same model graph and task graph on its own shard of the weights; the rank is a
runtime value (`RankStepContext.rank`), as it will be a kernel parameter on the GPU.

Communication is one-sided, the way NVSHMEM's put-with-signal works: a sending task writes its tile
into a per-source slot of an `inbox` buffer on every other rank and adds one to an event counter
there; the consumer on that rank waits until its counter has heard from every other rank. Slots are
relative: slot k of rank r holds what rank (r - k) mod N sent (slot 0 is the rank's own copy), so
the task graph is the same on every rank.

* `all_reduce(x)` (world_size, tile_columns): the sum over ranks of x, in rank order (so that every rank gets the
  same bits). Tasks per column tile (`tile_columns` wide, or the partition's column tiles): `all_reduce.send` copies the tile into slot 0 and puts it into
  slot k of rank r + k; `all_reduce.sum` adds the N slots of its tile. A consumer of the sum waits
  only for the summed tiles it reads.
* `all_gather(x)` (world_size, tile_columns): the ranks' rows side by side in rank order, [1, N * n]; tasks
  `all_gather.send` (as above) and `all_gather.assemble` (a tile of every rank's part).
* `tp_argmax(logits_shard, tokens)` (world_size): the index of the largest logit over every rank's
  vocabulary shard (rank r holds columns r * n .. (r + 1) * n; ties go to the lower index), written
  into the token history like `argmax`. Tasks: `argmax.partial` per tile, `tp_argmax.send` (the
  rank's best (value, global index) pair, put to every rank), `tp_argmax.reduce` (the best of the N
  pairs).
* `vocab_embedding(tokens, table_shard)`: the token's row if this rank's shard of the table holds
  it, zeros otherwise; an `all_reduce` makes it the embedding. Not a collective: its per-rank
  `reference` reads the rank from the context.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import attrs
import numpy as np
from attrs import field

from mdsl.errors import ShapeError, UnsupportedError
from mdsl.ir.dtypes import f32, i32
from mdsl.ir.ops import AttrSpec
from mdsl.ir.rules import RuleTable
from mdsl.ir.types import TensorType
from mdsl.megakernel.modelgraph.layers import (LAYER_OPS, LayerOpDef, StepContext, get_layer_op, register_layer_op,
                                               store_next_token)
from mdsl.megakernel.runtime.task_plan import DEVICE_RULES, NotOnDevice
from mdsl.megakernel.taskgraph.numpy_bodies import TASK_BODIES, TaskBodies
from mdsl.megakernel.taskgraph.partition import (TASK_RULES, TaskRule, TaskSpec, argmax_scratch, column_tiles,
                                                 columns, full)
from mdsl.megakernel.taskgraph.tasks import SCRATCH, Buffer, Region


@attrs.frozen
class RankStepContext(StepContext):
    """A step's context on one rank of a tensor-parallel group."""

    rank: int = 0
    world_size: int = 1


@attrs.frozen(cache_hash=True)
class Put:
    """A one-sided write into rank (rank + peer) mod N: each (source, destination) region pair copies
    the sender's source region into the receiver's destination region (same shape), then the
    receiver's remote events listed in `events` are incremented (the put's signal)."""

    peer: int
    regions: tuple = field(converter=tuple)
    events: tuple = field(default=(), converter=tuple)


def rank_of(ctx) -> int:
    return getattr(ctx, "rank", 0)


def inbox_slot(receiver: int, sender: int, world_size: int) -> int:
    """The slot of `receiver`'s inbox that holds what `sender` sent."""
    return (receiver - sender) % world_size


def _box(region: Region, rows: tuple) -> Region:
    """The region with its first dim replaced by `rows`."""
    return Region(region.buffer, (rows, *region.box[1:]), region.dynamic)


def _peer_puts(world_size: int, *own: Region) -> tuple:
    """Puts of the sender's slot-0 regions into slot k of rank + k, for every other rank."""
    return tuple(Put(k, tuple((r, _box(r, (k, k + 1))) for r in own)) for k in range(1, world_size))


def _world(node) -> int:
    return node.attr_dict["world_size"]


def _cols(task) -> tuple:
    return task.tile_value("col_start"), task.tile_value("col_stop")


def _col_tile(a: int, b: int) -> tuple:
    return (("col_start", a), ("col_stop", b))


def _require_row(op: str, t: TensorType) -> int:
    if t.rank != 2 or t.shape[0] != 1 or not t.dtype.is_float:
        raise ShapeError(f"{op}: the input must be one floating-point row [1, N], got {t}")
    return t.shape[1]


def _check_world(op: str, a: dict) -> None:
    if a["world_size"] < 1:
        raise ShapeError(f"{op}: world_size must be at least 1, got {a['world_size']}")
    if a.get("tile_columns", 0) < 0:
        raise ShapeError(f"{op}: tile_columns must be 0 (the partition's column tiles) or positive, got "
                         f"{a['tile_columns']}")


def _single_rank_reference(op: str, over_ranks):
    """The per-rank reference of a collective: defined alone only for a group of one rank."""
    def reference(xs, a, ctx):
        if a["world_size"] != 1:
            raise UnsupportedError(f"{op} combines the values of {a['world_size']} ranks; one rank's inputs do "
                                   "not determine it",
                                   hint="run tensor-parallel graphs with "
                                        "mdsl.megakernel.parallel.tensor_parallel.TensorParallelReference")
        return over_ranks([xs], a, [ctx])[0]

    return reference


_WORLD = (AttrSpec("world_size", "int"),)
_TILED = (*_WORLD, AttrSpec("tile_columns", "int", 0))   # columns per sent tile; 0: the partition's column tiles


@attrs.frozen
class CollectiveRule:
    """A collective's meaning over ranks: `over_ranks(inputs per rank, attrs, contexts per rank)` -> outputs
    per rank; `puts[kind](task, node)`: what a task of that kind writes into other ranks' memory."""

    over_ranks: Callable
    puts: Mapping = field(factory=dict)


#: the ops that combine the ranks' values (what tensor_parallel runs over all ranks at once)
COLLECTIVE_RULES: RuleTable[CollectiveRule] = RuleTable("collectives over ranks", CollectiveRule,
                                                        "mdsl.megakernel.parallel.collectives (COLLECTIVE_RULES)",
                                                        registry=LAYER_OPS)


def _register(name: str, arity: int, infer, over_ranks, doc: str, *, tasks: Callable, task_bodies: Mapping,
              puts: Mapping, state_inputs: tuple = (), attr_specs=_TILED) -> None:
    """A collective's registry entry (attributes, shape rule, its reference on one rank) and its rules:
    semantics over ranks and puts, tasks, task bodies."""
    register_layer_op(LayerOpDef(name=name, arity=arity, attr_specs=attr_specs, infer=infer,
                                 reference=_single_rank_reference(name, over_ranks), state_inputs=state_inputs,
                                 doc=doc))
    COLLECTIVE_RULES.register(name, CollectiveRule(over_ranks, puts))
    TASK_RULES.register(name, TaskRule(tasks))
    TASK_BODIES.register(name, TaskBodies(task_bodies))
    DEVICE_RULES.register(name, NotOnDevice(ON_THE_DEVICE))


# a tensor-parallel rank's device tables are those of its shard's decoder with the ranks' exchanges built into
# their task kinds (task_plan.for_ranks), not lowered from the split graph's collectives
ON_THE_DEVICE = ("a rank's megakernel exchanges the residual stream's partials inside the o-proj and down-proj tasks "
                 "and the LM head's bests through the sampler (task_plan.for_ranks); it has no task kind of its own")


# ---------------------------------------------------------------------------------------------
# all_reduce

def _all_reduce_infer(types, a):
    _check_world("all_reduce", a)
    n = _require_row("all_reduce", types[0])
    return (TensorType((1, n), f32),)


def _all_reduce_over_ranks(inputs: Sequence, a: dict, ctxs: Sequence) -> list:
    total = np.asarray(inputs[0][0], np.float32).copy()
    for xs in inputs[1:]:
        total += np.asarray(xs[0], np.float32)
    return [[total.copy()] for _ in inputs]


def inbox_name(node) -> str:
    return f"{node.output.name}.inbox"


def _send_tasks(node, config, kind: str):
    """Per column tile of the input: copy into slot 0 of the inbox (puts carry it to the other ranks)."""
    x, world = node.inputs[0], _world(node)
    n = x.shape[1]
    inbox = inbox_name(node)
    scratch = [Buffer(inbox, TensorType((world, n), f32), SCRATCH)]
    width = node.attr_dict["tile_columns"]
    tiles = column_tiles(n, config) if width <= 0 else [(a, min(a + width, n)) for a in range(0, n, width)]
    specs = [TaskSpec(kind, _col_tile(a, b), (columns(x, a, b),), (Region(inbox, ((0, 1), (a, b))),))
             for a, b in tiles]
    return specs, scratch, tiles


def _all_reduce_tasks(node, config):
    specs, scratch, tiles = _send_tasks(node, config, "all_reduce.send")
    inbox, world = inbox_name(node), _world(node)
    specs += [TaskSpec("all_reduce.sum", _col_tile(a, b), (Region(inbox, ((0, world), (a, b))),),
                       (columns(node.output, a, b),)) for a, b in tiles]
    return specs, scratch


def _send_puts(task, node) -> tuple:
    a, b = _cols(task)
    return _peer_puts(_world(node), Region(inbox_name(node), ((0, 1), (a, b))))


def _send_body(task, node, buf, ctx):
    a, b = _cols(task)
    buf[inbox_name(node)][0, a:b] = buf[node.inputs[0].name][0, a:b]


def _all_reduce_sum(task, node, buf, ctx):
    a, b = _cols(task)
    world, rank = _world(node), rank_of(ctx)
    inbox = buf[inbox_name(node)]
    total = inbox[inbox_slot(rank, 0, world), a:b].copy()
    for sender in range(1, world):      # rank order: every rank adds the same values in the same order
        total += inbox[inbox_slot(rank, sender, world), a:b]
    buf[node.output.name][0, a:b] = total


_register("all_reduce", 1, _all_reduce_infer, _all_reduce_over_ranks, "the sum over ranks (in rank order) of each "
          "rank's row", tasks=_all_reduce_tasks, puts={"all_reduce.send": _send_puts},
          task_bodies={"all_reduce.send": _send_body, "all_reduce.sum": _all_reduce_sum})


# ---------------------------------------------------------------------------------------------
# all_gather

def _all_gather_infer(types, a):
    _check_world("all_gather", a)
    n = _require_row("all_gather", types[0])
    return (TensorType((1, n * a["world_size"]), f32),)


def _all_gather_over_ranks(inputs: Sequence, a: dict, ctxs: Sequence) -> list:
    row = np.concatenate([np.asarray(xs[0], np.float32) for xs in inputs], axis=1)
    return [[row.copy()] for _ in inputs]


def _all_gather_tasks(node, config):
    specs, scratch, tiles = _send_tasks(node, config, "all_gather.send")
    inbox, world, n = inbox_name(node), _world(node), node.inputs[0].shape[1]
    specs += [TaskSpec("all_gather.assemble", _col_tile(a, b), (Region(inbox, ((0, world), (a, b))),),
                       tuple(columns(node.output, q * n + a, q * n + b) for q in range(world)))
              for a, b in tiles]
    return specs, scratch


def _all_gather_assemble(task, node, buf, ctx):
    a, b = _cols(task)
    world, rank, n = _world(node), rank_of(ctx), node.inputs[0].shape[1]
    inbox, out = buf[inbox_name(node)], buf[node.output.name]
    for sender in range(world):
        out[0, sender * n + a:sender * n + b] = inbox[inbox_slot(rank, sender, world), a:b]


_register("all_gather", 1, _all_gather_infer, _all_gather_over_ranks, "every rank's row side by side, in rank order",
          tasks=_all_gather_tasks, puts={"all_gather.send": _send_puts},
          task_bodies={"all_gather.send": _send_body, "all_gather.assemble": _all_gather_assemble})


# ---------------------------------------------------------------------------------------------
# tp_argmax: the argmax over the vocabulary shards of every rank

def _tp_argmax_infer(types, a):
    _check_world("tp_argmax", a)
    return get_layer_op("argmax").infer(types, {})


def _tp_argmax_over_ranks(inputs: Sequence, a: dict, ctxs: Sequence) -> list:
    row = np.concatenate([np.asarray(xs[0], np.float32).reshape(-1) for xs in inputs])
    token = int(np.argmax(row))
    for xs, ctx in zip(inputs, ctxs):
        store_next_token(xs[1], token, ctx)
    return [[np.array([token], np.int32)] for _ in inputs]


def pair_scratch(node) -> tuple:
    return f"{node.output.name}.pair_value", f"{node.output.name}.pair_index"


def _tp_argmax_tasks(node, config):
    logits, tokens = node.inputs
    world = _world(node)
    tiles = column_tiles(logits.shape[1], config)
    values, indices = argmax_scratch(node)
    pair_value, pair_index = pair_scratch(node)
    scratch = [Buffer(values, TensorType((len(tiles),), f32), SCRATCH),
               Buffer(indices, TensorType((len(tiles),), i32), SCRATCH),
               Buffer(pair_value, TensorType((world,), f32), SCRATCH),
               Buffer(pair_index, TensorType((world,), i32), SCRATCH)]
    specs = [TaskSpec("argmax.partial", (*_col_tile(a, b), ("slot", j)), (columns(logits, a, b),),
                      (Region(values, ((j, j + 1),)), Region(indices, ((j, j + 1),))))
             for j, (a, b) in enumerate(tiles)]
    own = (Region(pair_value, ((0, 1),)), Region(pair_index, ((0, 1),)))
    specs.append(TaskSpec("tp_argmax.send", (("slots", len(tiles)),),
                          (Region(values, ((0, len(tiles)),)), Region(indices, ((0, len(tiles)),))), own))
    specs.append(TaskSpec("tp_argmax.reduce", (), (Region(pair_value, ((0, world),)), Region(pair_index, ((0, world),))),
                          (full(node.output), full(tokens, dynamic=True))))
    return specs, scratch


def _tp_argmax_puts(task, node) -> tuple:
    pair_value, pair_index = pair_scratch(node)
    return _peer_puts(_world(node), Region(pair_value, ((0, 1),)), Region(pair_index, ((0, 1),)))


def _tp_argmax_send(task, node, buf, ctx):
    values, indices = argmax_scratch(node)
    best = int(np.argmax(buf[values]))        # the lowest tile index among equal maxima
    pair_value, pair_index = pair_scratch(node)
    buf[pair_value][0] = buf[values][best]
    buf[pair_index][0] = rank_of(ctx) * node.inputs[0].shape[1] + int(buf[indices][best])


def _tp_argmax_reduce(task, node, buf, ctx):
    pair_value, pair_index = pair_scratch(node)
    values, indices = buf[pair_value], buf[pair_index]
    nan = np.isnan(values)     # as np.argmax: a NaN wins, then the largest value; ties: the lowest index
    token = int(indices[nan].min() if nan.any() else indices[values == values.max()].min())
    buf[node.output.name][0] = token
    store_next_token(buf[node.inputs[1].name], token, ctx)


_register("tp_argmax", 2, _tp_argmax_infer, _tp_argmax_over_ranks, "the most likely token over every rank's "
          "vocabulary shard, stored after the position", state_inputs=(1,), attr_specs=_WORLD, tasks=_tp_argmax_tasks,
          puts={"tp_argmax.send": _tp_argmax_puts},
          task_bodies={"argmax.partial": TASK_BODIES["argmax"].bodies["argmax.partial"],
                       "tp_argmax.send": _tp_argmax_send, "tp_argmax.reduce": _tp_argmax_reduce})


# ---------------------------------------------------------------------------------------------
# vocab_embedding: the embedding of a rank's vocabulary shard (an all_reduce completes it)

def vocab_row(tokens: np.ndarray, table: np.ndarray, ctx) -> int:
    """The token's row in this rank's shard of the table, or -1 when another rank holds it."""
    row = int(tokens[ctx.position]) - rank_of(ctx) * table.shape[0]
    return row if 0 <= row < table.shape[0] else -1


def _vocab_embedding_ref(xs, a, ctx):
    tokens, table = xs
    row = vocab_row(tokens, table, ctx)
    out = np.zeros((1, table.shape[1]), np.float32)
    if row >= 0:
        out[0] = table[row]
    return [out]


def _vocab_embedding_tasks(node, config):
    specs, scratch = TASK_RULES["embedding"].split(node, config)
    return [attrs.evolve(s, kind="vocab_embedding") for s in specs], scratch


def _vocab_embedding_body(task, node, buf, ctx):
    a, b = _cols(task)
    tokens, table = (buf[v.name] for v in node.inputs)
    row = vocab_row(tokens, table, ctx)
    buf[node.output.name][0, a:b] = table[row, a:b] if row >= 0 else 0.0


register_layer_op(LayerOpDef(name="vocab_embedding", arity=2, infer=get_layer_op("embedding").infer,
                             reference=_vocab_embedding_ref,
                             doc="the token's row of this rank's vocabulary shard, or zeros"))
TASK_RULES.register("vocab_embedding", TaskRule(_vocab_embedding_tasks))
TASK_BODIES.register("vocab_embedding", TaskBodies({"vocab_embedding": _vocab_embedding_body}))
DEVICE_RULES.register("vocab_embedding", NotOnDevice(ON_THE_DEVICE))

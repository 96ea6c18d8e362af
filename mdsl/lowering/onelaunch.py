"""A split loop and its combine in one launch: which pairs of custom kernels qualify, and how the first
kernel's blocks group.

The search splits a loop over blocks where more parallelism pays (split-K of a skinny matmul, split-KV of
attention): a first kernel K1 writes f32 partial results, a second K2 combines them (its loop walks the
splits, then its epilogue). Launched apart, the second launch costs a launch (~2 µs on kernels of 10 µs).
Launched as one kernel (each backend writes it: mdsl.backend.cuda.onelaunch, mdsl.backend.ptx.onelaunch),
K1's grid runs K1's body; then each block issues its stores of the partials, passes a barrier, and one of
its threads makes them visible at GPU scope (fence.acq_rel.gpu) and adds 1 to its *group's* counter
(atom.add.acq_rel.gpu). The block whose add completes the group (the last of it to arrive) resets the
counter to 0, so that the counters stay zero from one launch to the next (allocated zeroed once, with the
executable, never cleared per call), and runs K2's body as the K2 block of its group: K2's block index is
the group's (`Groups.coordinate`), K2's threads run it (the block's threads past them exit first: a barrier
does not wait for exited threads) and K2's tiles reuse the shared memory after the barrier that tells the
block it is the last (the launch's dynamic shared memory is the larger of the two kernels'). K2's body is
the same code as its own kernel's, reading the same partials in the same order: the results are the two
launches' bit for bit.

Which pairs qualify (`one_launch_pairs`): K1 and K2 are consecutive custom kernels of the kernel graph and

1. K2 reads K1's outputs, and nothing but K2 reads them (no other kernel, not the graph's outputs): they
   are the pair's scratch. K2 may read other tensors too (none of them is K1's: K1 writes only its
   outputs).
2. Each K2 block reads, of every output of K1, exactly the tiles a group of K1 blocks writes, and the
   groups partition K1's grid. By index algebra on the maps: for K2's input i reading K1's output O (K1's
   omap w and tile t; K2's imap m, fmap f, loop of L), along each dim d of O, K1's blocks write n1 tiles
   (n1 = K1's grid along the axis a1 with w[a1] = d, else 1) and K2's blocks read n2 parts (n2 = K2's grid
   along the axis a2 with m[a2] = d, else 1) of N/n2 elements each (the validated tile times L along f).
   K2's part along d is the k = n1 / n2 consecutive K1 tiles i k .. i k + k - 1 where n2 divides n1; and
   every K2 axis of more than one block maps a dim of O (else two K2 blocks read one tile). Then K1 block b
   belongs to the group of K2 block c with c[a2] = b[a1] // k for each K1 axis a1 (with d = w[a1] and a2
   the K2 axis that maps d; 0 on K2's axes of one block), and a group has the product of the k blocks. Every
   K2 input reading a K1 output must give the same grouping.
3. K2's threads are at most K1's (the launch has K1's); K2 has no skinny loop (its prologue waits for
   the previous kernel and its staggered walk reads the block's own coordinates).

The cost model (mdsl.search.cost) charges a qualifying pair one launch.
"""
from __future__ import annotations

import math
from typing import Optional

import attrs

from mdsl.ir.graph import BlockGraph, KernelGraph, Node
from mdsl.ir.skinny import skinny_shape


@attrs.frozen
class Groups:
    """How K1's blocks meet: per K2 grid axis (x, y, z), (the K1 axis, K1 blocks along it per group), or
    None where K2 has one block along it; `size` K1 blocks a group (the arrivals that complete it); `grid`
    K2's grid, one group (and one counter) per K2 block."""

    axes: tuple
    size: int
    grid: tuple

    @property
    def count(self) -> int:
        return math.prod(self.grid)

    def coordinate(self, axis: int) -> Optional[tuple]:
        """K2's block index along `axis` as (K1 axis, divisor): K1's block index along that axis divided by
        the divisor; None: 0."""
        return self.axes[axis]

    def counter_terms(self) -> tuple:
        """The group's counter, the K2 block's linear index (x fastest), as a sum of terms (K1 axis,
        divisor, multiplier): K1's block index along the axis, divided, times the multiplier."""
        terms, stride = [], 1
        for axis, size in enumerate(self.grid):
            if self.axes[axis] is not None:
                terms.append((*self.axes[axis], stride))
            stride *= size
        return tuple(terms)


@attrs.frozen
class SplitPair:
    """Two consecutive custom kernels written as one (`first`, `second`: their indices in the graph), the
    launch's tensors (`inputs`: K1's, then K2's others, each once; `outputs`: K1's, the partials, then
    K2's) and the grouping."""

    first: int
    second: int
    groups: Groups
    inputs: tuple
    outputs: tuple


def _axis_of(dim_map: tuple, dim: int) -> Optional[int]:
    return next((a for a, d in enumerate(dim_map) if d == dim), None)


def _grouping(k1: BlockGraph, omap: tuple, rank: int, k2: BlockGraph, imap: tuple) -> Optional[tuple]:
    """The grouping one K2 input reading one K1 output implies: per K1 axis (the K2 axis, blocks a group)
    for K1's axes of more than one block; None where a K2 block does not read whole K1 tiles of one group."""
    out = []
    mapped = set()
    for d in range(rank):
        a1, a2 = _axis_of(omap, d), _axis_of(imap, d)
        n1 = k1.grid[a1] if a1 is not None else 1
        n2 = k2.grid[a2] if a2 is not None else 1
        if n1 % n2:
            return None
        if a2 is not None:
            mapped.add(a2)
        if a1 is not None:
            out.append((a1, a2, n1 // n2))
    if any(n > 1 and a not in mapped for a, n in enumerate(k2.grid)):
        return None   # K2's blocks along that axis read the same tiles
    return tuple(sorted(out))


def pair_groups(first: Node, second: Node, threads: Optional[int] = None) -> Optional[Groups]:
    """The grouping of K1's (`first`'s) blocks that K2 (`second`) reads under rules 2 and 3 (rule 1 is the
    graph's: `one_launch_pairs`), or None where they do not hold. `threads`: both kernels' block size where
    the lowering sets one (CudaOptions.threads)."""
    k1, k2 = first.body, second.body
    if not (isinstance(k1, BlockGraph) and isinstance(k2, BlockGraph)):
        return None
    t1, t2 = (threads, threads) if threads is not None else (k1.threads, k2.threads)
    if t2 > t1 or skinny_shape(k2) is not None:
        return None
    written = {v.name: out for v, out in zip(first.outputs, k1.outputs)}
    found = None
    for tensor, inp in zip(second.inputs, k2.inputs):
        out = written.get(tensor.name)
        if out is None:
            continue
        grouping = _grouping(k1, out.omap, tensor.type.rank, k2, inp.imap)
        if grouping is None or (found is not None and grouping != found):
            return None
        found = grouping
    if found is None:
        return None
    axes = [None, None, None]
    for a1, a2, k in found:
        if a2 is not None:
            axes[a2] = (a1, k)
    size = math.prod(k for _, _, k in found)
    return Groups(tuple(axes), size, tuple(k2.grid))


def one_launch_pairs(graph: KernelGraph, threads: Optional[int] = None) -> tuple:
    """The pairs of `graph`'s kernels that run as one launch (`SplitPair`, in the graph's order, none
    sharing a kernel): rule 1 here, rules 2 and 3 by `pair_groups`."""
    users = graph.users()
    returned = {v.name for v in graph.outputs}
    pairs, k = [], 0
    while k + 1 < len(graph.nodes):
        first, second = graph.nodes[k], graph.nodes[k + 1]
        outputs = {v.name for v in first.outputs}
        private = all(v not in returned and all(u is second for u in users.get(v, ())) and users.get(v)
                      for v in outputs)
        groups = pair_groups(first, second, threads) if private and first.body is not None else None
        if groups is None:
            k += 1
            continue
        inputs = list(dict.fromkeys(first.inputs))
        inputs += [v for v in dict.fromkeys(second.inputs) if v.name not in outputs and v not in inputs]
        pairs.append(SplitPair(k, k + 1, groups, tuple(inputs), (*first.outputs, *second.outputs)))
        k += 2
    return tuple(pairs)

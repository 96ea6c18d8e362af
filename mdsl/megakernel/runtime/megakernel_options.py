"""The megakernel's options: one frozen, validated object that `MegakernelEngine` and `generate_source` take.

Every field is either the default of some configuration (one GPU, or a rank of a tensor-parallel job) or
what the tests need to check one configuration against another (`rank_sums`, the attention splits). A field
left None takes its configuration's value: `for_world` fills those that depend on the world size, the plan
and the device the others (`workers`: the SM count; `attention_splits` and `attention_min_chunk`:
plan.attention_splits and plan.default_min_chunk; `attention_preload`: source.generate_source).

    MegakernelEngine(config, weights, options=MegakernelOptions(attention_splits=4))
"""
from __future__ import annotations

from typing import Optional

import attrs

from mdsl.errors import MdslError

# Attention splits per kv head at most: a split's maximum and sum in each lane of a warp, whose shuffles merge
# them (merge.cuh's combine_head); plan.attention_splits fills the workers up to it.
MAX_SPLITS = 32
# The kinds that read weight rows, by name: every one is handed to the compute warps before its inputs are
# complete (its first pass of weight loads issued while it waits); `second_pass_kinds` names some of them.
WEIGHT_KIND_NAMES = ("qkv", "oproj", "gateup", "down", "lmhead")
MAX_RANK_SUMS = 8
MAX_MIN_CHUNK = 4096


class OptionError(MdslError):
    """A megakernel option out of its range, or one its configuration rules out."""


def _kind_names(value):
    """A kind name alone, or a list of them, as a tuple (None stays None: the world's default)."""
    if value is None or isinstance(value, str):
        return value if value is None else (value,)
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.frozen
class MegakernelOptions:
    """`workers`: worker blocks, one per SM (None: the device's SM count). `attention_splits`: splits of the
    cached positions per kv head, 1 to 32 (a split's partials merge in one warp's lanes; None: as many as
    fill the workers), each of at least `attention_min_chunk` positions (None: 64, or 32 past 16 splits).
    `attention_preload`: an attention split copies its cached key and value rows into shared memory as it
    starts, before its inputs are complete, and reads them there (None: where they fit beside the rest and
    the kernel does not spill with them); rows not preloaded stream through a ring of shared memory, a few
    rounds of them in flight. `weights_first`: the share (0 to 1) of a linear task's first pass
    of weight loads issued once its input row's loads are out, before the row is normalised, when the task
    was not handed over early. `second_pass_kinds`: the kinds (of WEIGHT_KIND_NAMES) whose early tasks also
    copy their second pass of weight loads into shared memory while the row is normalised. `rank_sums` (one
    GPU only): the o-proj and down-proj tiles sum their products as that many tensor-parallel ranks do, so
    that with the ranks' attention splits one GPU computes their bits (the tests' reference for N GPUs)."""

    workers: Optional[int] = None
    attention_splits: Optional[int] = None
    attention_min_chunk: Optional[int] = None
    attention_preload: Optional[bool] = None
    weights_first: Optional[float] = None
    second_pass_kinds: Optional[tuple] = attrs.field(default=None, converter=_kind_names)
    rank_sums: int = 1

    def __attrs_post_init__(self):
        def refuse(field: str, hint: str):
            raise OptionError(f"MegakernelOptions.{field} {getattr(self, field)!r}", hint=hint)

        if self.workers is not None and not (_is_int(self.workers) and self.workers >= 1):
            refuse("workers", "a positive number of worker blocks (one per SM), or None for the device's SM count")
        if self.attention_splits is not None and not (_is_int(self.attention_splits)
                                                      and 1 <= self.attention_splits <= MAX_SPLITS):
            refuse("attention_splits", f"1 to {MAX_SPLITS} splits per kv head (a split's partials merge in one "
                                       "warp's lanes), or None for as many as fill the SMs")
        if self.attention_min_chunk is not None and not (_is_int(self.attention_min_chunk)
                                                         and 1 <= self.attention_min_chunk <= MAX_MIN_CHUNK):
            refuse("attention_min_chunk", f"1 to {MAX_MIN_CHUNK} positions per attention split at least, or None "
                                          "for the plan's default")
        if self.attention_preload not in (None, True, False):
            refuse("attention_preload", "True, False, or None for wherever a split's rows fit")
        if self.weights_first is not None and not (isinstance(self.weights_first, (int, float))
                                                   and not isinstance(self.weights_first, bool)
                                                   and 0.0 <= self.weights_first <= 1.0):
            refuse("weights_first", "the share of a linear task's first pass of weight loads issued with its input "
                                    "row: 0 (none) to 1 (all), or None for the world size's default")
        if self.second_pass_kinds is not None and not (isinstance(self.second_pass_kinds, tuple) and all(
                isinstance(k, str) and k in WEIGHT_KIND_NAMES for k in self.second_pass_kinds)):
            refuse("second_pass_kinds", f"some of the kinds {', '.join(WEIGHT_KIND_NAMES)} (() for none), or None "
                                        "for the world size's default")
        if not (_is_int(self.rank_sums) and 1 <= self.rank_sums <= MAX_RANK_SUMS):
            refuse("rank_sums", f"1, or on one GPU the ranks (2 to {MAX_RANK_SUMS}) whose sums the o-proj and "
                                "down-proj tiles compute")

    def for_world(self, world: int) -> "MegakernelOptions":
        """These options with the defaults of `world` ranks where they are None. Under tensor parallelism a
        linear task issues its whole first pass of weight loads with its input row (`weights_first` 1; on one
        GPU none: the faster of the two on each), and an early o-proj task has its second pass in flight too (a
        rank's o-proj tile is then on chip whole while it waits for attention; one GPU's tile is twice as large,
        and runs faster without). benchmarks/decode.py --variants measures the other values, and --rank-of N
        gives a rank's defaults to a rank's shapes on one GPU."""
        if world > 1 and self.rank_sums != 1:
            raise OptionError(f"MegakernelOptions.rank_sums {self.rank_sums} under tensor parallelism ({world} ranks)",
                              hint="rank_sums makes one GPU compute the ranks' sums; leave it 1 for the ranks")
        tensor_parallel = world > 1
        return attrs.evolve(
            self,
            weights_first=(1.0 if tensor_parallel else 0.0) if self.weights_first is None else self.weights_first,
            second_pass_kinds=(("oproj",) if tensor_parallel else ()) if self.second_pass_kinds is None
            else self.second_pass_kinds)

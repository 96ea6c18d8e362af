"""Tensor-parallel decoding on the GPUs of one host: one process per GPU, each running the megakernel on
its shard of the model (mdsl.megakernel.tensor_parallel's Megatron split: its query and KV heads, its MLP
columns, its vocabulary slice), the residual stream all-reduced and the LM head's bests gathered inside
the kernels through NVSHMEM (device.cu's top comment; runtime/nvshmem.py).

    group = TensorParallelGroup.from_pretrained("path/to/checkpoint", world=2, max_seq=2048)
    tokens = group.generate([1, 2, 3], max_new_tokens=32)     # every rank makes the same tokens
    group.close()

`TensorParallelGroup` starts the rank processes itself (spawn; rank r on GPU r) and drives them through
pipes; each rank reads only its slices of the checkpoint. `mdsl generate --tp N` uses it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Callable, Optional, Sequence

import attrs

from mdsl.errors import MdslError
from mdsl.megakernel.config import ModelConfig

_START_TIMEOUT_S = 600     # compiling and loading a rank (a large checkpoint from disk) may take minutes
_RUN_TIMEOUT_S = 600


class TensorParallelError(MdslError):
    pass


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """One rank's model: 1/world of the query heads, KV heads, MLP columns and vocabulary. A world size
    that does not divide them gets tensor_parallel's error, naming the op and the sizes allowed."""
    from mdsl.megakernel.architectures import step_function
    from mdsl.megakernel.tensor_parallel import tensor_parallel

    tensor_parallel(step_function(config).trace(config), world)   # raises a ShapeError naming what does not split
    return attrs.evolve(config, num_heads=config.num_heads // world, num_kv_heads=config.num_kv_heads // world,
                        intermediate_size=config.intermediate_size // world, vocab_size=config.vocab_size // world)


def rank_weights(config: ModelConfig, folder: str, rank: int, world: int) -> dict:
    """Rank's weights from a checkpoint folder, reading only its slices of the split tensors."""
    from mdsl.megakernel.architectures import step_function
    from mdsl.megakernel.tensor_parallel import load_rank_weights, tensor_parallel

    return load_rank_weights(tensor_parallel(step_function(config).trace(config), world), folder, rank)


@attrs.frozen
class RankSpec:
    """What every rank builds: the whole model's config, where its weights come from (a checkpoint folder,
    or `make_weights(shard_config, device_ordinal)`, a picklable function), and the engine's settings."""

    config: ModelConfig
    world: int
    folder: Optional[str] = None
    make_weights: Optional[Callable] = None
    max_seq: Optional[int] = None
    eos_token_ids: tuple = ()
    engine_options: tuple = ()       # (name, value) pairs for MegakernelEngine


def peer_traffic(plan) -> list:
    """Per task of a rank's plan: (waits for other ranks' tiles, puts its own to them), for the trace."""
    return [(any(plan.events[e].ranks > 1 for e in waits), any(plan.events[e].ranks > 1 for e in signals))
            for waits, signals in zip(plan.waits, plan.signals)]


def _rank_main(rank: int, spec: RankSpec, conn) -> None:
    """A rank's process: join NVSHMEM (rank 0 makes the id, the parent hands it on), build the engine on
    GPU `rank`, then serve ("run", kwargs) until ("close",)."""
    from mdsl.megakernel.runtime import nvshmem

    for name, value in nvshmem.SAFE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    try:
        from mdsl.backend.cuda import runtime
        from mdsl.megakernel.runtime.engine import MegakernelEngine, RankGroup

        runtime._device(rank)   # the primary context current before NVSHMEM (it uses the CUDA runtime)
        if rank == 0:
            conn.send(("uid", nvshmem.unique_id()))
        kind, uid = conn.recv()
        pe = nvshmem.init(rank, spec.world, uid)
        config = shard_config(spec.config, spec.world)
        weights = (rank_weights(spec.config, spec.folder, rank, spec.world) if spec.folder is not None
                   else spec.make_weights(config, rank))
        engine = MegakernelEngine(config, weights, max_seq=spec.max_seq, device=rank, eos_token_ids=spec.eos_token_ids,
                                  ranks=RankGroup(rank, spec.world, pe), **dict(spec.engine_options))
        del weights
        conn.send(("ready", {"tasks_per_step": len(engine.plan.tasks), "workers": engine.workers,
                             "labels": [t.label() for t in engine.plan.tasks],
                             "kinds": [t.kind.name.lower() for t in engine.plan.tasks],
                             "peers": peer_traffic(engine.plan)}))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        message = conn.recv()
        if message[0] == "close":
            break
        try:
            run = engine.run(*message[1], **message[2])
            conn.send(("run", run))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    engine.close()
    pe.close()
    conn.send(("closed", None))


class TensorParallelGroup:
    """`world` rank processes (rank r on GPU r), each with its shard and its megakernel."""

    def __init__(self, spec: RankSpec):
        from mdsl.megakernel.runtime import nvshmem

        if spec.world < 2:
            raise TensorParallelError(f"tensor parallelism needs at least 2 ranks, got {spec.world}")
        if not nvshmem.available():
            nvshmem._library()   # raises the error saying what to install
        self.spec = spec
        self.world = spec.world
        context = mp.get_context("spawn")   # CUDA contexts do not survive fork
        self._conns, self._procs = [], []
        for rank in range(self.world):
            parent, child = context.Pipe()
            process = context.Process(target=_rank_main, args=(rank, spec, child), daemon=True)
            process.start()
            self._conns.append(parent)
            self._procs.append(process)
        try:
            kind, uid = self._receive(0, _START_TIMEOUT_S, "starting")
            for conn in self._conns:
                conn.send(("uid", uid))
            self.info = [self._receive(rank, _START_TIMEOUT_S, "building its engine", want="ready")[1]
                         for rank in range(self.world)]
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_pretrained(cls, folder: str, world: int, *, max_seq: Optional[int] = None, **engine_options):
        from mdsl.megakernel.config import load_config
        from mdsl.megakernel.runtime.engine import eos_token_ids

        config = load_config(folder)
        if max_seq:
            config = config.with_max_positions(max_seq)
        return cls(RankSpec(config, world, folder=folder, max_seq=max_seq, eos_token_ids=eos_token_ids(folder),
                            engine_options=tuple(engine_options.items())))

    def _receive(self, rank: int, timeout: float, doing: str, want: Optional[str] = None):
        conn = self._conns[rank]
        if not conn.poll(timeout):
            raise TensorParallelError(f"rank {rank} did not answer within {timeout:.0f} s while {doing}")
        try:
            kind, value = conn.recv()
        except EOFError:
            raise TensorParallelError(f"rank {rank}'s process died while {doing} "
                                      f"(exit code {self._procs[rank].exitcode})") from None
        if kind == "error":
            raise TensorParallelError(f"rank {rank} failed while {doing}:\n{value}")
        if want is not None and kind != want:
            raise TensorParallelError(f"rank {rank} answered {kind!r} while {doing}")
        return kind, value

    def run(self, tokens: Sequence[int], max_new_tokens: int, **options) -> list:
        """MegakernelEngine.run on every rank at once; each rank's Run, in rank order."""
        for conn in self._conns:
            conn.send(("run", (list(tokens), max_new_tokens), options))
        runs = [self._receive(rank, _RUN_TIMEOUT_S, "running", want="run")[1] for rank in range(self.world)]
        if len({run.tokens for run in runs}) != 1:
            raise TensorParallelError("the ranks made different tokens: " +
                                      "; ".join(f"rank {r}: {list(run.tokens)}" for r, run in enumerate(runs)),
                                      hint="a bug in mdsl's tensor-parallel runtime: please report it")
        return runs

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, **options) -> list:
        return list(self.run(prompt_ids, max_new_tokens, **options)[0].tokens)

    def close(self) -> None:
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(("close",))
                if conn.poll(60):
                    conn.recv()
            except (OSError, EOFError):
                pass
        for process in self._procs:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        self._conns, self._procs = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

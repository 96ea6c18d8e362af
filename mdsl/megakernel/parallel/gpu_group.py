"""Tensor-parallel decoding on the GPUs of one host: one process per GPU, each running the megakernel on
its shard of the model (mdsl.megakernel.parallel.tensor_parallel's Megatron split: its query and KV heads, its MLP
columns, its vocabulary slice), the residual stream all-reduced and the LM head's bests gathered inside
the kernels through NVSHMEM (device.cu's top comment, residual.cuh; nvshmem.py).

    group = TensorParallelGroup.from_pretrained("path/to/checkpoint", world=2, max_seq=2048)
    tokens = group.generate([1, 2, 3], max_new_tokens=32)     # every rank makes the same tokens
    group.close()

`TensorParallelGroup` starts the rank processes itself (spawn; rank r on GPU r) and drives them through
pipes; each rank reads only its slices of the checkpoint. `mdsl generate --tp N` uses it. Under a
launcher that starts the processes itself (torchrun, mpirun: RANK / WORLD_SIZE / LOCAL_RANK or Open MPI's
and PMI's equivalents), `launched_rank()` says which rank this process is and `join_launched` builds its
engine; rank 0's NVSHMEM id reaches the others through a file (`FileRendezvous`).

    torchrun --nproc-per-node 2 -m mdsl generate --model DIR --prompt-ids 1,2,3 --tp 2
"""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
from typing import Callable, Optional, Sequence

import attrs

from mdsl.errors import MdslError
from mdsl.megakernel.modelgraph.model_config import ModelConfig
from mdsl.megakernel.runtime.megakernel_options import MegakernelOptions

_START_TIMEOUT_S = 600     # compiling and loading a rank (a large checkpoint from disk) may take minutes
_RUN_TIMEOUT_S = 600


class TensorParallelError(MdslError):
    pass


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """One rank's model: 1/world of the query heads, KV heads, MLP columns and vocabulary. A world size
    that does not divide them gets tensor_parallel's error, naming the op and the sizes allowed."""
    from mdsl.megakernel.modelgraph.architectures import step_function
    from mdsl.megakernel.parallel.tensor_parallel import tensor_parallel

    tensor_parallel(step_function(config).trace(config), world)   # raises a ShapeError naming what does not split
    return attrs.evolve(config, num_heads=config.num_heads // world, num_kv_heads=config.num_kv_heads // world,
                        intermediate_size=config.intermediate_size // world, vocab_size=config.vocab_size // world)


def rank_weights(config: ModelConfig, folder: str, rank: int, world: int) -> dict:
    """Rank's weights from a checkpoint folder, reading only its slices of the split tensors."""
    from mdsl.megakernel.modelgraph.architectures import step_function
    from mdsl.megakernel.parallel.tensor_parallel import load_rank_weights, tensor_parallel

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
    options: MegakernelOptions = MegakernelOptions()


def peer_traffic(plan) -> list:
    """Per task of a rank's plan: (waits for other ranks' tiles, puts its own to them), for the trace. A
    signalled event says both; a relayed tile (o-proj, down-proj) puts its partials to the peers and waits for
    its peers' words of its rows (in its body)."""
    # (the driving process imports no runtime module early)
    from mdsl.megakernel.runtime.task_plan import RELAYED_KINDS

    traffic = []
    for task, waits, signals in zip(plan.tasks, plan.waits, plan.signals):
        relayed = plan.world > 1 and task.kind in RELAYED_KINDS
        traffic.append((relayed or any(plan.events[e].ranks > 1 for e in waits),
                        relayed or any(plan.events[e].ranks > 1 for e in signals)))
    return traffic


def build_rank_engine(rank: int, device: int, spec: RankSpec, exchange: Callable):
    """Join NVSHMEM as `rank` on GPU `device` and build the rank's engine. `exchange(uid)`: rank 0 passes
    its NVSHMEM id (bytes) and every rank gets rank 0's back."""
    from mdsl.backend.cuda import runtime
    from mdsl.megakernel.parallel import nvshmem
    from mdsl.megakernel.runtime.megakernel_engine import MegakernelEngine, RankGroup

    for name, value in nvshmem.SAFE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    runtime._device(device)   # the primary context current before NVSHMEM (it uses the CUDA runtime)
    uid = exchange(nvshmem.unique_id() if rank == 0 else None)
    pe = nvshmem.init(rank, spec.world, uid)
    config = shard_config(spec.config, spec.world)
    weights = (rank_weights(spec.config, spec.folder, rank, spec.world) if spec.folder is not None
               else spec.make_weights(config, device))
    return MegakernelEngine(config, weights, options=spec.options, max_seq=spec.max_seq, device=device,
                            eos_token_ids=spec.eos_token_ids, ranks=RankGroup(rank, spec.world, pe))


def engine_info(engine) -> dict:
    """What the driving process needs of a rank's plan: sizes, task labels and kinds, peer traffic, attention's
    splits (a one-GPU engine with these and rank_sums computes the ranks' bits)."""
    return {"tasks_per_step": len(engine.plan.tasks), "workers": engine.workers,
            "attention_splits": engine.plan.splits, "attention_min_chunk": engine.plan.min_chunk,
            "labels": [t.label() for t in engine.plan.tasks], "kinds": [t.kind.name.lower() for t in engine.plan.tasks],
            "layers": [t.layer for t in engine.plan.tasks],
            "peers": peer_traffic(engine.plan)}


def _rank_main(rank: int, spec: RankSpec, conn) -> None:
    """A rank's process: join NVSHMEM (rank 0 makes the id, the parent hands it on), build the engine on
    GPU `rank`, then serve ("run", kwargs) until ("close",)."""
    def exchange(uid):
        if uid is not None:
            conn.send(("uid", uid))
        return conn.recv()[1]

    try:
        engine = build_rank_engine(rank, rank, spec, exchange)
        conn.send(("ready", engine_info(engine)))
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
    engine.ranks.pe.close()
    conn.send(("closed", None))


# ---------------------------------------------------------------------------------------------
# processes started by an external launcher

_LAUNCHER_VARIABLES = (("RANK", "WORLD_SIZE", "LOCAL_RANK"),                                    # torchrun
                       ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # Open MPI
                       ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"))                               # MPICH / Hydra
_RENDEZVOUS_TIMEOUT_S = 300


def launched_rank(environ=os.environ) -> Optional[tuple]:
    """(rank, world, local rank) when a launcher started this process as one of several, else None."""
    for rank, world, local in _LAUNCHER_VARIABLES:
        if rank in environ and world in environ:
            size = int(environ[world])
            if size > 1:
                return int(environ[rank]), size, int(environ.get(local, environ[rank]))
    return None


class FileRendezvous:
    """Rank 0's NVSHMEM id handed to the other ranks through a file: written atomically by rank 0, read by
    the others once it is newer than their own start (so a file left by an earlier job is not taken).
    The path: MDSL_TP_RENDEZVOUS, else one in the temporary folder named after the launcher's job."""

    def __init__(self, path: Optional[str] = None, environ=os.environ, timeout_s: float = _RENDEZVOUS_TIMEOUT_S):
        job = (environ.get("TORCHELASTIC_RUN_ID") or environ.get("OMPI_MCA_ess_base_jobid")
               or environ.get("PMI_ID") or f"{environ.get('MASTER_ADDR', 'local')}-{environ.get('MASTER_PORT', '0')}")
        self.path = path or environ.get("MDSL_TP_RENDEZVOUS") or os.path.join(
            tempfile.gettempdir(), f"mdsl-tp-{''.join(c if c.isalnum() else '-' for c in job)}.uid")
        self.timeout_s = timeout_s
        self.started = time.time()

    def __call__(self, uid: Optional[bytes]) -> bytes:
        if uid is not None:
            temporary = f"{self.path}.{os.getpid()}.tmp"
            with open(temporary, "wb") as f:
                f.write(uid)
            os.replace(temporary, self.path)
            return uid
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                if os.stat(self.path).st_mtime >= self.started - 10:
                    with open(self.path, "rb") as f:
                        data = f.read()
                    if len(data) == 128:
                        return data
            except FileNotFoundError:
                pass
            time.sleep(0.05)
        raise TensorParallelError(f"rank 0's NVSHMEM id did not appear in {self.path} within {self.timeout_s:.0f} s",
                                  hint="every rank must see the same temporary folder (or set MDSL_TP_RENDEZVOUS to a "
                                       "shared path); rank 0 may have failed: see its output")


def join_launched(spec: RankSpec):
    """This launcher-started process's engine (its rank and GPU from the launcher's variables)."""
    found = launched_rank()
    if found is None:
        raise TensorParallelError("no launcher started this process as one of several ranks (RANK / WORLD_SIZE "
                                  "are not set)", hint="use TensorParallelGroup (mdsl generate --tp N) to start them")
    rank, world, local = found
    if world != spec.world:
        raise TensorParallelError(f"the launcher started {world} processes for a {spec.world}-way split",
                                  hint=f"start {spec.world} processes (torchrun --nproc-per-node {spec.world})")
    return build_rank_engine(rank, local, spec, FileRendezvous())


class TensorParallelGroup:
    """`world` rank processes (rank r on GPU r), each with its shard and its megakernel."""

    def __init__(self, spec: RankSpec):
        from mdsl.megakernel.parallel import nvshmem

        if spec.world < 2:
            raise TensorParallelError(f"tensor parallelism needs at least 2 ranks, got {spec.world}")
        nvshmem.require()   # before spawning anything: says what to install
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

    @staticmethod
    def spec_from_pretrained(folder: str, world: int, *, max_seq: Optional[int] = None,
                             options: MegakernelOptions = MegakernelOptions()) -> RankSpec:
        from mdsl.megakernel.modelgraph.model_config import eos_token_ids, load_config

        config = load_config(folder)
        if max_seq:
            config = config.with_max_positions(max_seq)
        return RankSpec(config, world, folder=folder, max_seq=max_seq, eos_token_ids=eos_token_ids(folder, config.vocab_size),
                        options=options)

    @classmethod
    def from_pretrained(cls, folder: str, world: int, *, max_seq: Optional[int] = None,
                        options: MegakernelOptions = MegakernelOptions()):
        return cls(cls.spec_from_pretrained(folder, world, max_seq=max_seq, options=options))

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

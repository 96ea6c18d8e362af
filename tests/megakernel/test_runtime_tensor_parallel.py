"""The tensor-parallel megakernel's host side without a GPU: a rank's shard config, its task tables (the
events every rank signals, the remote-signal flags), the kernel source compiled for 2 ranks without
spills, and the NVSHMEM binding's structures. The GPU runs are in tests/gpu/test_tensor_parallel_gpu.py."""
import attrs
import pytest

from mdsl.errors import ShapeError
from mdsl.ir.dtypes import bf16
from mdsl.megakernel.modelgraph.model_config import config_from_dict
from mdsl.megakernel.parallel import nvshmem
from mdsl.megakernel.parallel.gpu_group import shard_config
from mdsl.megakernel.runtime.kernel_source import KERNEL_NAME, generate_source
from mdsl.megakernel.runtime.models import MODELS
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import (CROSS_RANK_KINDS, RELAYED_KINDS, REMOTE, Kind, build_plan, check_plan,
                                               for_ranks)
from tests.megakernel.test_runtime_source import assert_fits
from tests.megakernel.tiny import tiny_model
from tests.shared import compiled_once

# Qwen3-8B's rank kernel is test_runtime_source.py's too: compiled once per test run
pytestmark = pytest.mark.shared_compile_cache


def test_a_shard_holds_its_part_of_the_heads_columns_and_vocabulary():
    config, _, _ = tiny_model("qwen3")
    shard = shard_config(config, 2)
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size, shard.vocab_size) == (2, 1, 24, 48)
    assert (shard.hidden_size, shard.head_dim, shard.num_layers) == (config.hidden_size, config.head_dim, 2)


def test_a_world_size_that_does_not_divide_the_kv_heads_is_refused_naming_it():
    config, _, _ = tiny_model("llama3")
    with pytest.raises(ShapeError, match="KV heads") as info:
        shard_config(config, 4)
    assert "world sizes this model allows: 1, 2" in str(info.value)


def _rank_plan(arch="qwen3", world=2, dtype=None, **overrides):
    config, _, _ = tiny_model(arch, **overrides)
    shard = shard_config(config if dtype is None else attrs.evolve(config, dtype=dtype), world)
    single = build_plan(decoder_shape(shard), workers=132, max_seq=config.max_positions)
    return single, for_ranks(single, world)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_events_of_what_every_rank_reads_count_every_ranks_producers(arch):
    """The LM head's bests and the sampler's embedding row are signalled on every rank; the o-proj and
    down-proj tiles relay their rows (each sums its rows over the ranks itself), so their events are this
    rank's."""
    single, plan = _rank_plan(arch)
    check_plan(plan)
    assert plan.world == 2 and plan.tasks == single.tasks and plan.waits == single.waits
    crossing = relayed = 0
    for before, after in zip(single.events, plan.events):
        kinds = {plan.tasks[k].kind for k in before.producers} or {Kind.SAMPLE}
        if kinds <= set(RELAYED_KINDS):
            relayed += 1
            assert after == before
        elif kinds <= set(CROSS_RANK_KINDS):
            crossing += 1
            assert (after.ranks, after.per_step, after.initial) == (2, 2 * before.per_step, 2 * before.initial)
        else:
            assert after == before
    # o-proj and down-proj feed every layer's next ops; the LM head the sampler, the sampler the next step
    assert relayed >= 2 * config_layers(plan) and crossing >= 2
    tasks, waits, signals = plan.tables()
    for row, task in zip(tasks, plan.tasks):
        flags = {bool(e & REMOTE) for e in signals[row[6]:row[6] + row[7]]}
        assert flags <= {task.kind in (Kind.LMHEAD, Kind.SAMPLE)}
    for event, count in waits:
        remote = bool(event & REMOTE)
        event &= ~REMOTE
        assert count == plan.events[event].per_step and remote == (plan.events[event].ranks == 2)


def config_layers(plan) -> int:
    return plan.shape.layers


def test_one_gpu_tables_have_no_remote_signals():
    single, _ = _rank_plan()
    _, _, signals = single.tables()
    assert not any(e & REMOTE for e in signals) and for_ranks(single, 1) is single


def test_the_two_rank_kernel_relays_its_residual_stream_and_compiles_without_spills():
    """Each o-proj and down-proj body ends in relay_rows (the tile sums its rows over the ranks), the kernel
    compiles without spills, and one GPU's has no relay."""
    single, plan = _rank_plan("qwen3", dtype=bf16, head_dim=32)
    source = generate_source(plan)
    assert "constexpr int WORLD = 2;" in source.text and "constexpr int ATTN_LANES = 4;" in source.text
    def bodies(text):
        return text[text.index("// ---- task bodies"):]

    assert bodies(source.text).count("relay_rows(p, ") == 2   # the o-proj's and the down-proj's
    assert "relay_rows(p, " not in bodies(generate_source(single).text)
    assert_fits(source, compiled_once(source.text, arch="sm_90a").resources[KERNEL_NAME])


@pytest.mark.slow
def test_qwen3_8b_ranks_defaults_compile_without_spills():
    """The engine's defaults for a rank of two: 32 attention splits (two merge groups), every kind early, the
    whole first pass with the input row, the o-proj's second pass, the relay."""
    config = attrs.evolve(config_from_dict(MODELS["qwen3-8b"]), dtype=bf16)
    plan = for_ranks(build_plan(decoder_shape(shard_config(config, 2)), workers=132, max_seq=1064), 2)
    check_plan(plan)
    assert (plan.splits, plan.min_chunk) == (32, 32)
    source = generate_source(plan)
    assert "constexpr int WEIGHTS_FIRST_EIGHTHS = 8;" in source.text and "EARLY_PASSES = 2;" in source.text
    assert_fits(source, compiled_once(source.text, arch="sm_90a").resources[KERNEL_NAME])


def test_a_rank_spec_reaches_the_rank_processes_intact():
    import pickle

    from mdsl.megakernel.parallel.gpu_group import RankSpec

    config, _, _ = tiny_model("qwen3")
    spec = RankSpec(attrs.evolve(config, dtype=bf16), 2, folder="/checkpoint")
    back = pickle.loads(pickle.dumps(spec))
    assert back == spec and back.config.dtype is bf16   # the code compares dtypes by identity


def test_the_nvshmem_structures_match_the_headers():
    sizes = [nvshmem.ctypes.sizeof(s) for s in (nvshmem._UniqueId, nvshmem._UniqueIdArgs, nvshmem._InitArgs,
                                                  nvshmem._InitAttr)]
    assert sizes == [128, 24, 128, 144]
    assert nvshmem.SAFE_ENVIRONMENT["NVSHMEM_DISABLE_NVLS"] == "1"


def test_without_nvshmem_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setenv("MDSL_NVSHMEM_LIB", "")
    monkeypatch.setattr(nvshmem, "_lib", None)
    monkeypatch.setattr(nvshmem.importlib.util, "find_spec", lambda name: None)
    assert not nvshmem.available()
    with pytest.raises(nvshmem.NvshmemError, match="nvidia-nvshmem-cu13"):
        nvshmem.unique_id()


def test_the_ranks_trace_names_waits_for_peers_and_puts(tmp_path):
    import gzip
    import json

    from mdsl.megakernel.parallel.gpu_group import peer_traffic
    from mdsl.megakernel.runtime.profile import TaskRecord, write_rank_traces

    _, plan = _rank_plan("llama3")
    peers = peer_traffic(plan)
    kinds = [t.kind for t in plan.tasks]
    # the residual stream's tiles put to the peers and wait for theirs; their readers do not
    for (waits, puts), task, task_waits in zip(peers, plan.tasks, plan.waits):
        assert puts == (task.kind in CROSS_RANK_KINDS)
        signalled = any(plan.events[e].ranks > 1 for e in task_waits)   # (the embedding row, the LM head's bests)
        assert waits == (task.kind in RELAYED_KINDS or signalled), task
        assert not signalled or task.layer == 0 or task.kind is Kind.SAMPLE, task
    assert peers[0][0] and not any(waits for (waits, _), kind in zip(peers, kinds) if kind is Kind.GATEUP)
    n = len(plan.tasks)
    gateup = kinds.index(Kind.GATEUP)
    oproj = kinds.index(Kind.OPROJ)
    per_rank = [[TaskRecord(gateup, 3, 1000, 1500, 1600, 2000), TaskRecord(n + oproj, 4, 2100, 2200, 2200, 2600)],
                [TaskRecord(gateup, 3, 1100, 1400, 1400, 1900)]]
    path = tmp_path / "tp.json.gz"
    write_rank_traces(str(path), per_rank, [t.label() for t in plan.tasks], [k.name.lower() for k in kinds], peers)
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}
    assert {e["name"] for e in slices if e["cat"] == "wait-remote"} == {"wait for peers"}
    assert any(e["cat"] == "oproj+put" and e["args"]["step"] == 1 for e in slices)
    assert min(e["ts"] for e in slices) == 0.0   # one time axis from the first record of any rank


def test_ranks_are_aligned_on_their_samplers_and_overlap_is_measured():
    from mdsl.megakernel.runtime.profile import TaskRecord, align_ranks, peer_overlap

    per_step = 3   # task 1 puts to the peers and task 2 is the sampler; task 0 waits for the peers
    peers = [(True, False), (False, True), (False, True)]
    rank0 = [TaskRecord(0, 0, 0, 50, 50, 200), TaskRecord(1, 1, 0, 0, 100, 150), TaskRecord(2, 2, 150, 160, 160, 170),
             TaskRecord(5, 2, 300, 310, 310, 330), TaskRecord(8, 2, 500, 510, 510, 530)]
    skew = 400_000   # rank 1's clock runs 400 µs ahead
    rank1 = [attrs.evolve(r, taken_ns=r.taken_ns + skew, ready_ns=r.ready_ns + skew, started_ns=r.started_ns + skew,
                          done_ns=r.done_ns + skew + (5 if r.index == 5 else 0)) for r in rank0]
    aligned = align_ranks([rank0, rank1], per_step)
    assert aligned[0] == rank0
    assert [r.started_ns for r in aligned[1]] == [r.started_ns for r in rank0]   # median shift: exactly 400 µs
    measured = peer_overlap(rank0, per_step, peers)
    # task 1 (done at 150) and the first sampler (170) finish while task 0 runs on SM 0 until 200
    assert measured["put_tasks"] == 4 and measured["mean_busy_sms_at_put"] == 0.5
    assert measured["overlapped_fraction"] == 0.5
    assert measured["exposed_peer_wait_ns"] == 50


def test_the_launchers_variables_name_this_processs_rank():
    from mdsl.megakernel.parallel.gpu_group import launched_rank

    assert launched_rank({}) is None
    assert launched_rank({"RANK": "0", "WORLD_SIZE": "1"}) is None          # one process: nothing to join
    assert launched_rank({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == (1, 2, 1)   # torchrun
    assert launched_rank({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                          "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == (3, 4, 1)   # mpirun (Open MPI)
    assert launched_rank({"PMI_RANK": "1", "PMI_SIZE": "2"}) == (1, 2, 1)


def test_the_file_rendezvous_hands_rank_0s_id_over_and_ignores_an_old_file(tmp_path):
    import os
    import threading
    import time

    from mdsl.megakernel.parallel.gpu_group import FileRendezvous, TensorParallelError

    path = tmp_path / "job.uid"
    path.write_bytes(b"o" * 128)
    os.utime(path, (time.time() - 3600, time.time() - 3600))   # left by a job an hour ago
    env = {"TORCHELASTIC_RUN_ID": "job/1"}
    assert FileRendezvous(environ=env).path.endswith("mdsl-tp-job-1.uid")
    reader = FileRendezvous(str(path), timeout_s=10)
    got = []
    thread = threading.Thread(target=lambda: got.append(reader(None)))
    thread.start()
    time.sleep(0.3)
    assert not got                                  # the old file is not taken
    assert FileRendezvous(str(path))(b"n" * 128) == b"n" * 128
    thread.join(10)
    assert got == [b"n" * 128]
    with pytest.raises(TensorParallelError, match="did not appear"):
        FileRendezvous(str(tmp_path / "never.uid"), timeout_s=0.2)(None)

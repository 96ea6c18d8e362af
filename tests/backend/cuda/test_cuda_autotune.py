"""GPU autotuning without a GPU: the parameter space, the variants (duplicates of one source dropped)
and the per-device cache (atomic, validated when read). Timing itself: tests/gpu/test_gpu_autotune.py."""
from __future__ import annotations

import json

import pytest

from mdsl.backend.cuda import autotune
from mdsl.backend.cuda.autotune import TuneResult, Variant, cache_key, load, parameter_space, store, variants
from mdsl.lowering.options import CudaOptions
from tests.backend.cuda.fast_paths import fast_path_graphs

DEVICE = "NVIDIA H200"


def test_the_parameter_space_crosses_depths_and_block_sizes():
    space = parameter_space(stages=(2, 3), threads=(None, 128), skinny=(False,))
    assert space == [CudaOptions(stages=2), CudaOptions(stages=3), CudaOptions(stages=2, threads=128),
                     CudaOptions(stages=3, threads=128)]
    assert all(o.mma and o.register_accumulators for o in parameter_space())
    skinny_kinds = len(autotune.OVERLAP) * len(autotune.STAGGER) * len(autotune.WIDE_X)
    unprefetched = skinny_kinds * autotune.LEADS.count(0) * len(autotune.UNPREFETCHED_THREADS)
    assert len(parameter_space()) == len(autotune.STAGES) * (
        len(autotune.THREADS) * (1 + skinny_kinds * len(autotune.LEADS)) + unprefetched)
    assert {o.threads for o in parameter_space() if not o.skinny or o.lead != 0} == set(autotune.THREADS)


def test_variants_that_emit_the_same_source_are_timed_once():
    pipelined, narrow = fast_path_graphs()["ragged_matmuls_f16"], fast_path_graphs()["narrow_rows_f16"]
    space = parameter_space(stages=(2, 3), threads=(None,), skinny=(False,))
    # the narrow rows cannot be copied with cp.async: every depth lowers to the same synchronous kernel
    assert variants([pipelined, narrow], space) == [Variant(0, space[0]), Variant(0, space[1]), Variant(1, space[0])]


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    return tmp_path / "autotune"


def _result(candidates, k=1, us=12.5):
    return TuneResult(candidates[k], Variant(k, CudaOptions(stages=4, threads=128)), us)


def test_the_cache_returns_what_was_stored(cache_root):
    candidates = list(fast_path_graphs().values())[:2]
    key = cache_key(candidates, DEVICE, "sm_90a", parameter_space())
    assert load(key, candidates, DEVICE) is None
    path = store(key, _result(candidates), DEVICE)
    assert path.parent == cache_root and [p.name for p in cache_root.iterdir()] == [path.name]  # no temp file left
    got = load(key, candidates, DEVICE)
    assert got.cached and got.graph == candidates[1] and got.us == 12.5
    assert got.variant == Variant(1, CudaOptions(stages=4, threads=128))


def test_the_key_depends_on_programs_device_arch_and_space():
    a, b = list(fast_path_graphs().values())[:2]
    key = cache_key([a, b], DEVICE, "sm_90a", parameter_space())
    assert len({key, cache_key([b, a], DEVICE, "sm_90a", parameter_space()),
                cache_key([a, b], "NVIDIA H100", "sm_90a", parameter_space()),
                cache_key([a, b], DEVICE, "sm_80", parameter_space()),
                cache_key([a, b], DEVICE, "sm_90a", parameter_space(stages=(2,)))}) == 5


@pytest.mark.parametrize("damage", ["not json", "schema", "key", "device", "candidate", "options", "time"])
def test_a_damaged_entry_is_ignored_with_a_warning(cache_root, damage):
    candidates = list(fast_path_graphs().values())[:2]
    key = cache_key(candidates, DEVICE, "sm_90a", parameter_space())
    path = store(key, _result(candidates), DEVICE)
    entry = json.loads(path.read_text())
    changes = {"schema": ("mdsl_autotune", 99), "key": ("key", "0" * 64), "device": ("device", "another GPU"),
               "candidate": ("candidate", 7), "options": ("options", {"stages": 9}), "time": ("us", -1.0)}
    if damage == "not json":
        path.write_text("{truncated")
    else:
        field, value = changes[damage]
        entry[field] = value
        path.write_text(json.dumps(entry))
    with pytest.warns(UserWarning, match="ignoring the autotune cache entry"):
        assert load(key, candidates, DEVICE) is None


def test_relative_error_and_tolerance():
    import numpy as np

    want = [np.ones((4, 4))]
    assert autotune.relative_error([np.ones((4, 4))], want) == 0.0
    assert autotune.relative_error([np.full((4, 4), np.nan)], want) == float("inf")
    assert autotune.relative_error([np.ones((4, 4)) * 1.01], want) == pytest.approx(0.01)
    assert autotune.tolerance(fast_path_graphs()["ragged_matmuls_bf16"]) == 1e-2
    assert autotune.tolerance(fast_path_graphs()["ragged_matmuls_f16"]) == 3e-3


def test_the_command_needs_a_gpu(capsys):
    from mdsl.backend.cuda import runtime

    if runtime.has_gpu():
        pytest.skip("this machine has a GPU: tests/gpu/test_gpu_autotune.py runs the command's work")
    assert autotune.main([]) == 2
    assert "no GPU" in capsys.readouterr().out


def test_the_timing_rotates_over_input_copies_that_exceed_twice_the_l2():
    from mdsl.backend.cuda.autotune import rotation_sets

    l2 = 60 * 2**20
    assert rotation_sets(50 * 2**20, l2) == 3            # rms_norm_linear's 50 MB weight: 150 MB > 120 MB
    assert rotation_sets(64 * 2**20, l2) == 2            # gated_mlp's two weights
    assert rotation_sets(2**20, l2) == 64                # small inputs: at most 64 copies
    assert rotation_sets(2**20, l2, cap_bytes=10 * 2**20) == 10   # within the memory cap
    assert rotation_sets(2**31, l2) == 1 and rotation_sets(0, l2) == 64

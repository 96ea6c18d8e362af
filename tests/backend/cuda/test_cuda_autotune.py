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


def test_the_key_depends_on_programs_device_arch_space_and_timed_path():
    a, b = list(fast_path_graphs().values())[:2]
    key = cache_key([a, b], DEVICE, "sm_90a", parameter_space())
    assert len({key, cache_key([b, a], DEVICE, "sm_90a", parameter_space()),
                cache_key([a, b], "NVIDIA H100", "sm_90a", parameter_space()),
                cache_key([a, b], DEVICE, "sm_80", parameter_space()),
                cache_key([a, b], DEVICE, "sm_90a", parameter_space(stages=(2,))),
                cache_key([a, b], DEVICE, "sm_90a", parameter_space(), checked=True)}) == 6


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


def test_the_tolerance_is_the_loosest_dtypes():
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


# ---------------------------------------------------------------------------------------------
# a kernel's first GPU call


def _small_plan():
    from mdsl.search.engine import optimize
    from tests.search.small_plans import CONFIG, SMALL, two_guided

    return optimize(SMALL["rms_norm_linear"](), CONFIG, cache=False, generators=[two_guided])


def test_a_first_call_times_the_plans_candidates_and_the_program_as_written():
    import attrs

    plan = _small_plan()
    fused = attrs.evolve(plan, alternatives=tuple(a for a in plan.alternatives if a.graph.key != plan.original.key))
    todo = autotune.first_call_set(fused)
    assert todo.graphs[0] == plan.graph and todo.graphs[-1] == plan.original
    assert todo.names[0] == "the plan's choice" and todo.names[-1] == "the program as written"
    assert len(todo.graphs) == len(fused.alternatives) + 2 and set(todo.spaces) == {autotune.FIRST_CALL_SPACE}
    assert autotune.first_call_set(plan).graphs.count(plan.original) == 1   # an alternative already: once
    kept_as_written = attrs.evolve(plan, graph=plan.original, alternatives=())
    assert autotune.first_call_set(kept_as_written).graphs == (plan.original,)   # timed once, not twice


def test_a_first_call_also_times_own_gemm_kernels_where_the_library_would_run_a_gemm():
    """The program as written keeps its matmul kernel-level: cuBLAS runs it, or with library_gemm off mdsl's
    own GEMM kernel (the same source, another launch): both are timed. A fused candidate without a
    kernel-level matmul lowers the same either way, so its own-GEMM options are dropped as repeats."""
    plan = _small_plan()
    space = autotune.FIRST_CALL_SPACE
    assert {o.library_gemm for o in space} == {True, False}
    as_written = [v for v, problem in autotune.emitted_variants([plan.original], space, "sm_90a") if not problem]
    assert {v.options.library_gemm for v in as_written} == {True, False}
    assert any("own GEMM kernels" in v.describe() for v in as_written)
    fused = [v for v, problem in autotune.emitted_variants([plan.graph], space, "sm_90a") if not problem]
    assert plan.graph != plan.original and all(n.op != "matmul" or n.body is not None for n in plan.graph.nodes)
    assert fused and all(v.options.library_gemm for v in fused)


def _fake_gpu(monkeypatch, clock: list, seconds_per_variant: float) -> list:
    """autotune's GPU steps replaced: each measured variant advances `clock` and is recorded in order."""
    from mdsl.backend.cuda import runtime

    measured = []

    def measure(graph, variant, *args):
        measured.append(variant)
        clock[0] += seconds_per_variant
        return autotune.Timing(variant, 10.0 + len(measured))

    monkeypatch.setattr(runtime, "require_gpu", lambda *a: None)
    monkeypatch.setattr(runtime, "target_arch", lambda device=0: "sm_90a")
    monkeypatch.setattr(autotune, "_device_name", lambda device: DEVICE)
    monkeypatch.setattr(autotune, "_inputs", lambda graph, seed: [])
    monkeypatch.setattr(autotune, "_reference", lambda graph, host: [])
    monkeypatch.setattr(autotune, "_rotated_inputs", lambda graph, host, device: [])
    monkeypatch.setattr(autotune, "_compile_all", lambda variants, arch: None)
    monkeypatch.setattr(autotune, "_measure", measure)
    monkeypatch.setattr(autotune.time, "monotonic", lambda: clock[0])
    return measured


def test_each_candidates_first_option_is_timed_first_and_the_budget_bounds_the_rest(monkeypatch, cache_root):
    candidates = list(fast_path_graphs().values())[:3]
    space = [CudaOptions(stages=2), CudaOptions(stages=3), CudaOptions(stages=4)]
    emitted = [v for v, problem in autotune.emitted_variants(candidates, space, "sm_90a") if not problem]
    firsts = [next(v for v in emitted if v.candidate == k) for k in range(3)]
    clock = [0.0]
    measured = _fake_gpu(monkeypatch, clock, seconds_per_variant=1.0)
    result = autotune.autotune(candidates, candidates[0], space=space, budget_s=4.5, cache=False)
    assert measured[:3] == firsts                     # every candidate timed, before any second option
    assert len(measured) == 5 < len(emitted)          # past 4.5 s, no more (each took 1 s)
    assert result.variant == firsts[0] and result.us == 11.0
    skipped = [t for t in result.timings if t.us is None]
    assert len(skipped) == len(emitted) - 5 and all("4.5 s had passed" in t.problem for t in skipped)
    measured.clear()
    autotune.autotune(candidates, candidates[0], space=space, cache=False)   # no budget: every variant
    assert sorted(measured, key=emitted.index) == emitted


def test_a_kernels_first_call_compiles_the_tuned_choice_or_the_plans_when_tuning_fails(monkeypatch):
    import warnings

    from mdsl.backend.cuda import runtime
    from mdsl.errors import MdslError
    from tests.examples_util import load_example

    monkeypatch.delenv("MDSL_AUTOTUNE", raising=False)
    kernel = load_example("rms_norm_linear").make_rms_norm_linear(1, k=256, n=192)
    plan = _small_plan()
    compiled = []
    monkeypatch.setattr(runtime, "target_arch", lambda device=0: "sm_90a")
    monkeypatch.setattr(runtime, "compile_graph", lambda graph, **kw: compiled.append((graph, kw.get("options"))))
    monkeypatch.setattr(kernel, "_gpu_plan", lambda specs, arch: plan)
    tuned = TuneResult(plan.original, Variant(1, CudaOptions(skinny=True, overlap=True)), 3.0)
    monkeypatch.setattr(autotune, "autotune", lambda *a, **kw: tuned)
    views = [attrs_view(v) for v in kernel.graph.inputs]
    kernel._compile(views)
    assert compiled[-1] == (plan.original, CudaOptions(skinny=True, overlap=True)) and kernel.tunings == [tuned]

    def fails(*a, **kw):
        raise MdslError("autotune: no variant ran correctly on the GPU")

    monkeypatch.setattr(autotune, "autotune", fails)
    with pytest.warns(UserWarning, match="running the plan's choice untuned: autotune: no variant ran"):
        kernel._compile(views)
    assert compiled[-1] == (plan.graph, None)
    monkeypatch.setenv("MDSL_AUTOTUNE", "0")          # tuning off: the plan's choice, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel._compile(views)
    assert compiled[-1] == (plan.graph, None)


def attrs_view(var):
    """A stand-in for a checked argument's view: its shape, dtype and device."""
    from types import SimpleNamespace

    return SimpleNamespace(shape=var.shape, dtype=var.dtype, device=0)


def test_a_variant_is_judged_where_the_program_as_written_is_finite_as_the_verifier_judges():
    """Standard normal inputs overflow a long f16 chain: where the program's own f16 result is inf, no
    variant's result is wrong (it is not judged); elsewhere a variant is held to the dtype's bound."""
    import numpy as np

    from mdsl.ir.dtypes import f16
    from tests.backend.cuda.builder import Graph

    g = Graph("overflowing")
    x = g.input("x", (4096,), f16)
    graph = g.build(outputs=[g.op("mul_scalar", x, value=40000.0)])   # |x| > 1.64 overflows f16
    host = autotune._inputs(graph, seed=0)
    expected = autotune._reference(graph, host)
    (judged,) = expected.judged
    assert 0 < judged.sum() < judged.size                     # the overflowing elements are left out
    exact = np.asarray(host[0], dtype=np.float64) * 40000.0
    as_f16 = exact.astype(np.float16).astype(np.float64)      # inf where the program overflows
    assert expected.problem([as_f16]) is None
    wrong = as_f16.copy()
    wrong[np.flatnonzero(judged)[:40]] *= 1.5
    assert "output 0 has relative error" in expected.problem([wrong])
    broken = as_f16.copy()
    broken[np.flatnonzero(judged)[0]] = np.nan
    assert "relative error inf" in expected.problem([broken])


@pytest.mark.parametrize("outcome", ["timed", "checked", "wrong output", "launch failed"])
def test_a_timed_variant_closes_its_executable_whatever_its_timing_gives(monkeypatch, outcome):
    """_measure closes the executable it compiled once its timing ends: timed (unchecked or checked launches),
    refused for a wrong output, or failed with mdsl's error (the chosen variant is compiled again from the
    cubin cache, so no timed executable waits for the collector)."""
    from types import SimpleNamespace

    import numpy as np

    from mdsl.backend.cuda import runtime
    from mdsl.errors import MdslError

    closed, launches = [], []
    array = SimpleNamespace(ptr=0, to_numpy=lambda: np.zeros(2, np.float32))

    class Executable:
        def __call__(self, inputs, outputs=None):
            if outcome == "launch failed":
                raise MdslError("the launch failed")
            launches.append("checked")
            return [array]

        def run_pointers(self, inputs, outputs, stream):
            launches.append("unchecked")

        def close(self):
            closed.append(self)

    def median_us(call, samples, calls, warm=0):   # (the events' timing needs a GPU: the calls alone here)
        assert warm == 2   # each rotated set twice (one here)
        for _ in range(samples * calls):
            call()
        return 1.0

    monkeypatch.setattr(autotune, "_median_us", median_us)
    monkeypatch.setattr(runtime, "compile_graph", lambda *args, **kwargs: Executable())
    monkeypatch.setattr(runtime.DeviceArray, "from_numpy", staticmethod(lambda x, dtype, device=0: array))
    graph = SimpleNamespace(inputs=[SimpleNamespace(dtype="f32")])
    want = SimpleNamespace(problem=lambda outputs: "wrong output" if outcome == "wrong output" else "")
    variant = Variant(0, CudaOptions())
    timing = autotune._measure(graph, variant, [np.zeros(2, np.float32)], want, [[array]], "sm_90a", 0,
                               samples=2, calls=3, checked=outcome == "checked")
    assert len(closed) == 1
    assert (timing.us is not None) == (outcome in ("timed", "checked"))
    assert outcome in timing.problem or timing.us is not None
    if timing.us is not None:
        assert launches.count("checked" if outcome == "checked" else "unchecked") == 2 * 3 + (outcome == "checked")

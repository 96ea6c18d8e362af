"""The skinny loop on the GPU (mdsl.lowering.skinny): the benchmark plans of RMSNorm+Linear at batch 1 and 8
and of Gated MLP, at the benchmark's sizes, and the coverage programs beside them
(tests/backend/cuda/programs.SKINNY_PROGRAMS), with the block's own threads and with 256, and launched to
overlap the previous kernel, against the float64 reference on fresh inputs, and walking K from staggered
slabs; kernels overlapping their predecessors in chains (skinny ones, and the tile kernels of the other
benchmark plans); and the autotuner times the skinny loop beside the tile loop, all correct.

    pytest tests/gpu/test_gpu_skinny.py -m gpu
"""
from __future__ import annotations

import numpy as np
import pytest

from mdsl import gpu as runtime
from mdsl.backend.cuda import autotune
from mdsl.ir.text import parse_graph
from mdsl.lowering.options import CudaOptions, arch_number
from tests.backend.cuda.programs import SKINNY_PROGRAMS, guided_plan, skinny_program
from tests.gpu.harness import compare, poisoned, random_inputs, reference, rng_for, run, tolerance, upload
from tests.ir.skinny_texts import rms_norm_linear


@pytest.mark.gpu
@pytest.mark.parametrize("threads, overlap, stagger, lead, wide_x", [
    (None, False, False, 2, False), (256, False, False, 2, False), (None, True, False, 2, False),
    (None, False, True, 2, False), (256, True, True, 2, False), (None, True, True, 4, False),
    (256, False, False, 0, False), (None, True, True, 2, True), (256, True, True, 0, True),
    (None, False, True, 2, True), (384, True, False, 0, True)])
@pytest.mark.parametrize("name", SKINNY_PROGRAMS)
def test_the_skinny_loop_computes_the_program(name, threads, overlap, stagger, lead, wide_x):
    graph = skinny_program(name)
    what = (f"{name}, skinny loop, {threads or 'own'} threads, overlap {overlap}, staggered {stagger}, "
            f"L2 prefetch lead {lead}, wide X {wide_x}")
    test_id = f"skinny:{name}:{threads}" + (":overlap" if overlap else "") + (":stagger" if stagger else "") + \
        (f":lead {lead}" if lead != 2 else "") + (":wide_x" if wide_x else "")
    inputs = random_inputs(graph, rng_for(test_id))
    want = reference(graph, inputs)
    options = CudaOptions(skinny=True, threads=threads, overlap=overlap, stagger=stagger, lead=lead, wide_x=wide_x)
    executable = runtime.compile_graph(graph, options=options)
    source = executable.program.source
    assert "::run(skinny_acc" in source, f"{what}: the skinny loop was not taken"
    compare(executable, run(executable, inputs), want, tolerance(graph), what)


@pytest.mark.gpu
def test_overlapping_kernels_wait_for_their_predecessor_s_writes_and_reads():
    """Two skinny kernels launched to overlap their predecessors (programmatic dependent launch), the
    second reading what the first writes, three rounds on one stream with no synchronization: each
    second kernel must see its first's output (read after write), and each first kernel must not
    overwrite that output before the previous second kernel has read it (write after read)."""
    first = parse_graph(rms_norm_linear(16, 64, blocks=96, k=4096))              # X W1 -> Y: f16[16, 6144]
    second = parse_graph(rms_norm_linear(16, 64, blocks=32, k=6144, forloop=32))  # Y W2 -> Z: f16[16, 2048]
    options = CudaOptions(skinny=True, overlap=True)
    a, b = (runtime.compile_graph(g, options=options) for g in (first, second))
    assert all(launch.overlap for launch in a.program.launches + b.program.launches)
    rng = rng_for("skinny:overlap chain")
    xs = [random_inputs(first, rng)[0] for _ in range(3)]
    w1, w2 = random_inputs(first, rng)[1], random_inputs(second, rng)[1]
    w1_gpu = runtime.DeviceArray.from_numpy(w1, first.inputs[1].dtype)
    w2_gpu = runtime.DeviceArray.from_numpy(w2, second.inputs[1].dtype)
    xs_gpu = [upload([x], first)[0] for x in xs]
    y = runtime.DeviceArray((16, 6144), first.outputs[0].dtype)
    zs = [poisoned(second)[0] for _ in xs]
    for x, z in zip(xs_gpu, zs):
        a([x, w1_gpu], [y])
        b([y, w2_gpu], [z])
    for k, (x, z) in enumerate(zip(xs, zs)):
        want = reference(second, [reference(first, [x, w1])[0], w2])
        compare(b, [z.to_numpy().astype(np.float64)], want, tolerance(second), f"round {k} of the overlapping pair")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gqa.gqa", "qknorm.qknorm", "lora.lora", "ntrans.ntrans", "gated_mlp.gated_mlp"])
def test_tile_kernels_overlapping_their_predecessors_compute_the_program(name):
    """Every custom kernel launched to overlap its predecessor (CudaOptions.overlap, the tile loop): the
    second kernel of a plan reads what the first writes; three calls back to back on one stream, each
    into its own output, each checked."""
    graph = guided_plan(name)
    executable = runtime.compile_graph(graph, options=CudaOptions(overlap=True))
    if arch_number(runtime.target_arch()) >= 90:
        program = executable.program
        assert all(launch.overlap == (program.graph.nodes[launch.node_index].op == "custom") for launch in program.launches)
    rng = rng_for(f"overlap:{name}")
    rounds = [random_inputs(graph, rng) for _ in range(3)]
    outputs = [poisoned(graph) for _ in rounds]
    for inputs, out in zip(rounds, outputs):
        executable(upload(inputs, graph), out)
    for k, (inputs, out) in enumerate(zip(rounds, outputs)):
        got = [o.to_numpy().astype(np.float64) for o in out]
        compare(executable, got, reference(graph, inputs), tolerance(graph), f"{name}, overlapping, call {k}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rms_norm_linear_bs1", "rms_norm_linear_bs8", "gated_mlp"])
def test_the_autotuner_times_the_skinny_loop_beside_the_tile_loop(name, tmp_path, monkeypatch):
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path))
    graph = skinny_program(name)
    space = autotune.parameter_space(stages=(3,), threads=(None,))
    result = autotune.autotune([graph], graph, space=space, samples=5, calls=3, cache=False)
    report = "\n".join(result.lines())
    skinny_kinds = len(autotune.OVERLAP) * len(autotune.STAGGER) * len(autotune.LEADS) * len(autotune.WIDE_X)
    unprefetched = skinny_kinds // len(autotune.LEADS) * autotune.LEADS.count(0) * len(autotune.UNPREFETCHED_THREADS)
    assert len(result.timings) == 1 + skinny_kinds + unprefetched, report   # the tile loop; each skinny one
    assert all(t.us is not None for t in result.timings), report   # both correct, both timed

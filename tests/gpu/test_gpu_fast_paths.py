"""The fast paths of both backends (conftest runs each test once per backend) on the GPU against the
reference, each switched on and off: the
fast-path programs (ragged and batched tensor-core matmuls, sums in registers, pipelines of every
depth, other block sizes, hoisting and streamed combines off) under every option set, their loaded modules
reporting no spills, the same programs reading each input from and writing each output into a wider tensor
in place (mdsl.lowering.views),
and every example program (as written, and the
guided plan of each specification) with each fast path off, so that a run shows both settings of
every switch correct (the default settings run in test_gpu_examples and test_gpu_coverage); and split plans
with their combine in the split's launch (mdsl.lowering.onelaunch): repeated calls against the reference,
bit for bit against the two launches, and two executables on two streams at once."""
from __future__ import annotations

import pytest

import mdsl
from mdsl.search.guided import generate
from tests.backend.cuda.fast_paths import EVERY_OPTION_SET, FALLBACKS, fast_path_graphs, options_env
from tests.backend.cuda.views import read_in_place, write_in_place
from tests.examples_util import EXAMPLES, load_example
from tests.gpu.harness import check_graph


def _use(monkeypatch, options_name: str) -> None:
    for key, value in options_env(EVERY_OPTION_SET[options_name]).items():
        monkeypatch.setenv(key, value)


@pytest.mark.gpu
@pytest.mark.parametrize("options", sorted(EVERY_OPTION_SET))
@pytest.mark.parametrize("name", sorted(fast_path_graphs()))
def test_fast_path_program_on_the_gpu(name, options, monkeypatch):
    _use(monkeypatch, options)
    what = f"{name} with options {options}"
    executable = check_graph(fast_path_graphs()[name], f"fast-path:{name}:{options}", what=what)
    for kernel, r in executable.module.resources.items():   # as the loaded module reports them
        assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, f"{what}: {kernel}: {r}"


@pytest.mark.gpu
@pytest.mark.parametrize("dim", (-1, 0))
@pytest.mark.parametrize("name", sorted(fast_path_graphs()))
def test_fast_path_program_in_place_on_the_gpu(name, dim):
    """Each input read in place as the middle part of a wider tensor and each output written in place as the
    middle piece of one (mdsl.lowering.views), under the default fast paths: the same kernels through the wider
    tensors' strides from an offset."""
    graph = write_in_place(read_in_place(fast_path_graphs()[name], dim), dim)
    executable = check_graph(graph, f"fast-path-in-place:{name}:{dim}", what=f"{name} read in place along {dim}")
    for kernel, r in executable.module.resources.items():
        assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, f"{name}: {kernel}: {r}"


def _examples() -> list:
    out = []
    for path in sorted(EXAMPLES.glob("*.py")):
        for name, kernel in vars(load_example(path.stem)).items():
            if isinstance(kernel, mdsl.KernelFunction) and not name.endswith("_bs8"):
                for variant in ("as-written", "guided") if not kernel.graph.custom_nodes() else ("as-written",):
                    out.append(pytest.param(kernel, variant, id=f"{path.stem}.{name}-{variant}"))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("options", FALLBACKS)
@pytest.mark.parametrize("kernel, variant", _examples())
def test_example_with_a_fast_path_off_on_the_gpu(kernel, variant, options, monkeypatch):
    _use(monkeypatch, options)
    graph = kernel.graph if variant == "as-written" else next(generate(kernel.graph))
    check_graph(graph, f"example:{kernel.name}:{variant}:{options}",
                what=f"example {kernel.name} ({variant}) with options {options}")


# ---------------------------------------------------------------------------------------------
# a split and its combine in one launch (mdsl.lowering.onelaunch)

#: name -> (the plan, the switches beside the defaults): the benchmarks' split-KV plans (GQA and QKNorm,
#: 64 groups of 4 KV splits), the split-K plan of `(x * 2.0) @ w` at x f16[4, 8192], w [8192, 2048] (64 groups
#: of 2 K splits) with a tile-loop split, a skinny one and a skinny one overlapping its predecessor, a combine
#: of fewer threads than its split and a coarser one reading an input of the program too; and the split-K plan
#: followed by a kernel with values of its own (its buffers are numbered after the pair's counters' once were)
SPLIT_PLANS = {
    "gqa": (lambda: _guided_plan("gqa.gqa"), {}),
    "qknorm": (lambda: _guided_plan("qknorm.qknorm"), {}),
    "split-k": (lambda: _split_k(), {}),
    "split-k-skinny": (lambda: _split_k(), {"MDSL_CUDA_SKINNY": "1"}),
    "split-k-skinny-overlap": (lambda: _split_k(), {"MDSL_CUDA_SKINNY": "1", "MDSL_CUDA_OVERLAP": "1"}),
    "split-k-fewer-combine-threads": (lambda: _split_k(combine_threads=64), {"MDSL_CUDA_SKINNY": "1"}),
    "split-k-coarser-combine-scaled": (lambda: _split_k(combine_columns=64, scale=True), {}),
    "split-k-then-a-kernel": (lambda: _split_k(then_matmul=True), {}),
}


def _guided_plan(name: str):
    from tests.backend.cuda.programs import guided_plan

    return guided_plan(name)


def _split_k(**kwargs):
    from tests.backend.ptx.plans import split_k

    return split_k(rows=4, k=8192, columns=2048, block_columns=32, splits=2, forloop=16, **kwargs)


def _split_plan(name: str, monkeypatch):
    make, env = SPLIT_PLANS[name]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return make()


def _two_launches(graph, what: str, monkeypatch):
    """The plan built with each kernel launched alone (no pair qualifies)."""
    from mdsl.lowering import program as lowering_program
    from tests.gpu.harness import build

    with monkeypatch.context() as patch:
        patch.setattr(lowering_program, "one_launch_pairs", lambda graph, threads=None: ())
        executable = build(graph, what)
    assert len(executable.program.launches) == len(graph.nodes), what
    return executable


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SPLIT_PLANS))
def test_a_split_and_its_combine_in_one_launch_on_the_gpu(name, monkeypatch):
    """One launch: five calls in a row on fresh inputs, each against the reference (each call must find its
    group counters zero, as the previous one left them: else its combines run early or never), then bit for
    bit against the plan launched as two kernels."""
    import numpy as np

    from tests.gpu.harness import build, compare, random_inputs, reference, rng_for, run, tolerance

    graph = _split_plan(name, monkeypatch)
    what = f"{name} in one launch"
    executable = build(graph, what)
    assert len(executable.program.launches) == len(graph.nodes) - 1, what
    assert executable.program.launches[0].counters > 0, what
    rng = rng_for(f"one-launch:{name}")
    for call in range(5):
        inputs = random_inputs(graph, rng, positive=range(len(graph.inputs)))
        got = run(executable, inputs)
        compare(executable, got, reference(graph, inputs), tolerance(graph), f"{what}, call {call}")
    apart = run(_two_launches(graph, f"{name} in two launches", monkeypatch), inputs)
    for k, (g, a) in enumerate(zip(got, apart)):
        assert np.array_equal(g, a), f"{what}: output {k}: {int((g != a).sum())} elements differ from two launches'"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gqa", "split-k-skinny"])
def test_split_plans_on_two_streams_at_once_each_with_its_executable(name, monkeypatch):
    """Calls that overlap on two streams use two executables (Executable's docstring), each with its own group
    counters and partials: twenty calls a stream, alternating, none waiting for the other stream, each into
    its own output, all correct."""
    torch = pytest.importorskip("torch")
    from tests.gpu.harness import build, compare, random_inputs, reference, rng_for, tolerance

    graph = _split_plan(name, monkeypatch)
    executables = [build(graph, f"{name}, stream {k}") for k in range(2)]
    streams = [torch.cuda.Stream() for _ in executables]
    dtypes = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
    rng = rng_for(f"one-launch-streams:{name}")
    inputs = [random_inputs(graph, rng, positive=range(len(graph.inputs))) for _ in range(2)]
    tensors = [[torch.from_numpy(x).to("cuda", dtypes[v.dtype.name]) for x, v in zip(xs, graph.inputs)]
               for xs in inputs]
    torch.cuda.synchronize()
    outputs = [[], []]
    for _ in range(20):
        for k, (executable, stream) in enumerate(zip(executables, streams)):
            with torch.cuda.stream(stream):
                outputs[k].append(executable(tensors[k]))
    torch.cuda.synchronize()
    for k, (executable, xs) in enumerate(zip(executables, inputs)):
        want = reference(graph, xs)
        for call, out in enumerate(outputs[k]):
            got = [o.float().cpu().numpy().astype("float64") for o in out]
            compare(executable, got, want, tolerance(graph), f"{name}, stream {k}, call {call}")

"""Plain matmuls through cuBLAS on a GPU (mdsl.gpu.cublas): f16, bf16 and f32, one product and batches
(each operand batched, one left matrix for every batch, a batch folded into the rows), M = 1, 3 and 64 with
N and K not multiples of 8, products that read and write intermediates, on both backends, on a stream of
torch's and captured in a CUDA graph; through the public call path (`kernel(*torch_tensors)`, plan searched) too. Every output is
checked against float64 numpy on the same rounded inputs (NaN-poisoned outputs where mdsl does not
allocate them), f32 at f32's tolerance (no TF32), and every matmul is checked to have run in cuBLAS; then
the fallbacks: cuBLAS missing, and MDSL_CUDA_CUBLAS=0's option, run mdsl's kernel with the same results."""
from __future__ import annotations

import numpy as np
import pytest

import mdsl
from mdsl.gpu import BACKENDS, compile_graph, cublas
from mdsl.ir.dtypes import bf16, f16, f32
from mdsl.lowering.options import CudaOptions
from tests.backend.cuda.builder import Graph
from tests.gpu.harness import TOLERANCES, compare, random_inputs, reference, rng_for, run

pytestmark = [pytest.mark.gpu, pytest.mark.shared_compile_cache]

DTYPES = [f16, bf16, f32]
#: (left shape, right shape): M = 1, 3, 64 with odd N and K; batches of each kind
PRODUCTS = [((1, 77), (77, 45)), ((3, 100), (100, 72)), ((64, 129), (129, 33)),
            ((3, 5, 33), (3, 33, 20)), ((5, 33), (3, 33, 20)), ((2, 3, 40), (40, 24))]


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    assert torch.cuda.is_available(), "torch cannot see the GPU that the CUDA driver reports"
    return torch


def products(dtype):
    """Every product of PRODUCTS, and silu(x @ w) @ w2 (cuBLAS writing an intermediate, a kernel reading it,
    cuBLAS reading the kernel's output), each an output."""
    g = Graph(f"gemms_{dtype.name}")
    for k, (a_shape, b_shape) in enumerate(PRODUCTS):
        g.outputs.append(g.op("matmul", g.input(f"a{k}", a_shape, dtype), g.input(f"b{k}", b_shape, dtype)))
    x, w, w2 = g.input("x", (3, 40), dtype), g.input("w", (40, 24), dtype), g.input("w2", (24, 17), dtype)
    g.outputs.append(g.op("matmul", g.op("silu", g.op("matmul", x, w)), w2))
    return g.build(g.outputs)


def check(graph, test_id: str, **compile_args):
    inputs = random_inputs(graph, rng_for(test_id))
    executable = compile_graph(graph, **compile_args)
    compare(executable, run(executable, inputs), reference(graph, inputs), TOLERANCES[graph.inputs[0].dtype.name],
            f"{graph.name} [{test_id}]")
    return executable


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_plain_matmuls_run_in_cublas(dtype, backend):
    graph = products(dtype)
    executable = check(graph, f"cublas-{dtype.name}-{backend}", backend=backend)
    matmuls = sum(node.op == "matmul" for node in graph.nodes)
    assert len(executable.library_launches) == matmuls, executable.library_launches
    assert executable.native is not None, "cuBLAS's GEMMs and the kernels run from the C launcher"


def transposed_products(dtype):
    """x @ transpose(w) as a linear layer's traced graph has it (w: [out, in]), batched keys q @ transpose(k),
    and a transposed weight that a kernel reads as well (exp of it: its transpose must still run)."""
    g = Graph(f"transposed_{dtype.name}")
    x, w = g.input("x", (3, 40), dtype), g.input("w", (24, 40), dtype)
    g.outputs.append(g.op("matmul", x, g.op("transpose", w, perm=(1, 0))))
    q, k = g.input("q", (4, 1, 32), dtype), g.input("k", (4, 9, 32), dtype)
    g.outputs.append(g.op("matmul", q, g.op("transpose", k, perm=(0, 2, 1))))
    x2, w2 = g.input("x2", (5, 24), dtype), g.input("w2", (17, 24), dtype)
    shared = g.op("transpose", w2, perm=(1, 0))
    g.outputs += [g.op("matmul", x2, shared), g.op("exp", shared)]
    return g.build(g.outputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_a_transposed_right_operand_is_read_from_its_source(dtype, backend):
    executable = check(transposed_products(dtype), f"cublas-transposed-{dtype.name}-{backend}", backend=backend)
    assert len(executable.library_launches) == 3, executable.library_launches
    # the weight's and the keys' transposes are left out; the one exp reads too still runs
    assert len(executable.elided) == 2, executable.elided


def test_without_cublas_mdsl_s_kernels_run_after_one_warning(monkeypatch):
    def not_found():   # cuBLAS's lookup only: NVRTC, which the same process loads, must still be found
        raise OSError("libcublas.so.13: cannot open shared object file")

    monkeypatch.setattr(cublas, "_open", not_found)
    monkeypatch.setattr(cublas, "_LIBRARY", {})
    monkeypatch.setattr(cublas, "_CONTEXTS", {})
    monkeypatch.setattr(cublas, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="cuBLAS could not be loaded"):
        executable = check(products(f16), "no-cublas")
    assert executable.library_launches == ()


def test_the_option_off_runs_mdsl_s_kernels():
    executable = check(products(bf16), "cublas-off", options=CudaOptions(library_gemm=False))
    assert executable.library_launches == ()


#: few rows (mdsl::gemm_rows_mma: K shared by a block's warps, 16 columns a block) at its bounds: 1, 16, 17
#: (two row tiles), 64 rows, 65 (the 64x64 tile), K of many steps and not a multiple of 16, N not a multiple
#: of 16, batches
ROWS_PRODUCTS = [((1, 2000), (2000, 1000)), ((16, 1030), (1030, 200)), ((17, 300), (300, 90)),
                 ((64, 777), (777, 130)), ((65, 300), (300, 90)), ((2, 4, 513), (2, 513, 24)), ((5, 7), (7, 9))]


@pytest.mark.parametrize("dtype", [f16, bf16], ids=lambda d: d.name)
def test_few_rows_run_mdsl_s_row_kernel(dtype):
    g = Graph(f"rows_{dtype.name}")
    for k, (a_shape, b_shape) in enumerate(ROWS_PRODUCTS):
        g.outputs.append(g.op("matmul", g.input(f"a{k}", a_shape, dtype), g.input(f"b{k}", b_shape, dtype)))
    graph = g.build(g.outputs)
    executable = check(graph, f"rows-{dtype.name}", options=CudaOptions(library_gemm=False))
    assert executable.library_launches == ()
    again = run(executable, random_inputs(graph, rng_for(f"rows-{dtype.name}")))   # the same bits every run
    first = run(executable, random_inputs(graph, rng_for(f"rows-{dtype.name}")))
    assert all(np.array_equal(a, b) for a, b in zip(again, first))


def test_a_torch_stream_gets_its_own_workspace(torch):
    graph = products(f16)
    inputs = random_inputs(graph, rng_for("cublas-stream"))
    want = reference(graph, inputs)
    executable = compile_graph(graph)
    stream = torch.cuda.Stream()
    tensors = [torch.from_numpy(x).to("cuda", torch.float16) for x in inputs]
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        for _ in range(2):   # the stream set once, then kept
            got = executable(tensors)
    stream.synchronize()
    assert stream.cuda_stream in cublas.context(0).workspaces
    compare(executable, [g.float().cpu().numpy().astype(np.float64) for g in got], want, TOLERANCES["f16"],
            "on a torch stream")


def test_a_call_captured_in_a_cuda_graph_replays(torch):
    graph = products(f16)
    inputs = random_inputs(graph, rng_for("cublas-cuda-graph"))
    executable = compile_graph(graph)
    tensors = [torch.from_numpy(x).to("cuda", torch.float16) for x in inputs]
    outputs = [torch.full(v.shape, float("nan"), dtype=torch.float16, device="cuda") for v in graph.outputs]
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):   # a fresh stream, captured: its GEMMs get no workspace
        executable(tensors, outputs)
    cuda_graph.replay()
    torch.cuda.synchronize()
    compare(executable, [o.float().cpu().numpy().astype(np.float64) for o in outputs], reference(graph, inputs),
            TOLERANCES["f16"], "captured in a CUDA graph")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("a_shape, b_shape", [((3, 77), (77, 45)), ((2, 64, 33), (2, 33, 20))])
def test_the_public_call_path_runs_an_unfused_matmul_in_cublas(torch, monkeypatch, dtype, a_shape, b_shape):
    made = []

    def spy(*args, **kwargs):
        step = real(*args, **kwargs)
        made.append(step)
        return step

    real = cublas.gemm_step
    monkeypatch.setattr(cublas, "gemm_step", spy)

    @mdsl.kernel
    def mm(x, w):
        return x @ w

    rng = rng_for(f"public-{dtype.name}-{len(a_shape)}")
    host = [rng.standard_normal(s).astype(np.float32) for s in (a_shape, b_shape)]
    tdtype = getattr(torch, dtype.long_name)
    x, w = (torch.from_numpy(h).to("cuda", tdtype) for h in host)
    a64, b64 = (t.double().cpu().numpy() for t in (x, w))   # the inputs as rounded to the dtype
    got = mm(x, w)
    assert made and all(step is not None for step in made), "the matmul did not run in cuBLAS"
    want = np.matmul(a64, b64)
    got64 = got.double().cpu().numpy()
    error = float(np.linalg.norm(got64 - want) / np.linalg.norm(want))
    assert np.isfinite(got64).all() and error <= TOLERANCES[dtype.name], f"relative error {error:.2e}"


def test_two_streams_alternating_through_the_c_launcher_each_set_before_its_gemms(torch):
    """The C launcher runs a program's GEMMs on the handle's stream only: a call on another stream has
    Python set that stream (and its workspace) first. Calls alternating between two streams, each correct."""
    graph = products(f16)
    inputs = random_inputs(graph, rng_for("cublas-two-streams"))
    want = reference(graph, inputs)
    executable = compile_graph(graph)
    assert executable.native is not None
    tensors = [torch.from_numpy(x).to("cuda", torch.float16) for x in inputs]
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    results = []
    for k in range(6):
        with torch.cuda.stream(streams[k % 2]):
            results.append(executable(tensors))
        streams[k % 2].synchronize()   # one executable: its calls must not overlap
    for got in results:
        compare(executable, [g.float().cpu().numpy().astype(np.float64) for g in got], want, TOLERANCES["f16"],
                "alternating streams")
    assert {s.cuda_stream for s in streams} <= set(cublas.context(0).workspaces)


def test_a_repeated_call_launches_the_program_captured_for_its_pointers(torch):
    """A program with cuBLAS GEMMs (the products of PRODUCTS, and silu of a few-row product of long K that cuBLAS
    splits over its workspace) called again on the same stream and pointers is captured whole for them, and
    later calls on them launch that graph: the bits of the program launched launch by launch, for two sets of pointers in
    turn, new values under the same pointers, on a side stream (a graph of its own), and inside a caller's
    capture (the launches go into its graph)."""
    g = Graph("graphed_gemms")
    for k, (a_shape, b_shape) in enumerate(PRODUCTS):
        g.outputs.append(g.op("matmul", g.input(f"a{k}", a_shape, f16), g.input(f"b{k}", b_shape, f16)))
    x, w = g.input("xs", (4, 8192), f16), g.input("ws", (8192, 512), f16)
    g.outputs.append(g.op("silu", g.op("matmul", x, w)))
    graph = g.build(g.outputs)
    graphed, plain = compile_graph(graph), compile_graph(graph)
    if graphed.native is None:
        pytest.skip("mdsl's C launcher is not available here")
    assert graphed._by_pointers == {} and graphed.library_launches
    plain._by_pointers = None
    sets = [[torch.from_numpy(a).to("cuda", torch.float16) for a in random_inputs(graph, rng_for(f"graphed-{s}"))]
            for s in range(2)]
    outs = [[torch.full(v.type.shape, float("nan"), dtype=torch.float16, device="cuda") for v in graph.outputs]
            for _ in sets]

    def same(inputs, outputs):
        want = plain(inputs)
        torch.cuda.synchronize()
        return all(torch.equal(o, w) for o, w in zip(outputs, want))

    for _ in range(3):
        for inputs, outputs in zip(sets, outs):
            graphed(inputs, outputs)
    torch.cuda.synchronize()
    assert len(graphed._by_pointers) == 2
    assert all(same(inputs, outputs) for inputs, outputs in zip(sets, outs))
    compare(graphed, [o.float().cpu().numpy().astype(np.float64) for o in outs[0]],
            reference(graph, [a.float().cpu().numpy() for a in sets[0]]), TOLERANCES["f16"], "graphed")
    for a in sets[0]:   # new values under the same pointers
        a.copy_(torch.randn_like(a.float()).half())
    graphed(sets[0], outs[0])
    assert same(sets[0], outs[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            graphed(sets[1], outs[1])
    torch.cuda.current_stream().wait_stream(side)
    assert len(graphed._by_pointers) == 3 and same(sets[1], outs[1])
    captured = [torch.full_like(o, float("nan")) for o in outs[1]]
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        graphed(sets[1], captured)
    cuda_graph.replay()
    torch.cuda.synchronize()
    cuda_graph.reset()   # (not left to the collector, which may run inside another test's capture)
    assert len(graphed._by_pointers) == 3
    # (the caller's fresh capture stream has no workspace: cuBLAS may run other kernels there, as in
    # test_a_call_captured_in_a_cuda_graph_replays)
    compare(graphed, [c.float().cpu().numpy().astype(np.float64) for c in captured],
            reference(graph, [a.float().cpu().numpy() for a in sets[1]]), TOLERANCES["f16"], "in a caller's capture")
    graphed.close()

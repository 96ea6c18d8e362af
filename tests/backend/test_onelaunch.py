"""A split and its combine in one launch (mdsl.lowering.onelaunch), without a GPU: which pairs of kernels
qualify and how the split's blocks group, on the search's split plans (split-K of a skinny matmul, split-KV
attention, the benchmarks' guided plans) and on pairs that must not qualify; what both backends write of a
pair (one kernel, its launch: the split's grid and threads, the larger shared memory, the counters after its
tensors), compiled for sm_90a (NVRTC; the PTX backend's through ptxas or nvJitLink) with no spills, and its
SASS: one arrival (an acq_rel atomic add at GPU scope), one reset, one barrier that ors the block's votes, and
the combine's loads of the partials past the read-only path. The fused kernels' numbers, against the reference
and bit for bit against the two launches, on the CPU simulator: tests/backend/ptx/test_ptx_onelaunch.py; the
cost model's charge: tests/search/test_cost.py; on the GPU: tests/gpu/test_gpu_fast_paths.py."""
from __future__ import annotations

import attrs
import pytest

from mdsl.ir.dtypes import f16, f32
from mdsl.lowering.kernel import lower_custom
from mdsl.lowering.onelaunch import Groups, one_launch_pairs
from mdsl.lowering.options import CudaOptions
from tests.backend.backends import BACKENDS, EMITTERS, emit, kernel_code, kernel_instructions, module, needs_nvdisasm
from tests.backend.cuda.builder import Graph
from tests.backend.cuda.programs import guided_plan
from tests.backend.ptx.plans import split_attention, split_k

SKINNY = CudaOptions(skinny=True)


def _only_pair(graph, threads=None):
    pairs = one_launch_pairs(graph, threads)
    assert len(pairs) == 1, f"{graph.name}: {len(pairs)} pairs"
    return pairs[0]


# ---------------------------------------------------------------------------------------------
# which pairs qualify


def test_a_split_k_plan_groups_the_splits_of_each_column_block():
    # 4 x 2 blocks (column blocks x K splits); the combine's block x reads column block x of both splits
    pair = _only_pair(split_k())
    assert (pair.first, pair.second) == (0, 1)
    assert pair.groups == Groups(((0, 1), None, None), 2, (4, 1, 1))
    assert pair.groups.counter_terms() == ((0, 1, 1),)
    assert [v.name for v in pair.inputs] == ["x", "w"]
    assert [v.type for v in pair.outputs] == [split_k().nodes[0].outputs[0].type, split_k().outputs[0].type]


def test_a_coarser_combine_groups_neighbouring_column_blocks():
    # combine blocks of 64 columns over split blocks of 32: combine block x reads split blocks 2x, 2x + 1
    pair = _only_pair(split_k(combine_columns=64))
    assert pair.groups == Groups(((0, 2), None, None), 4, (2, 1, 1))
    assert pair.groups.counter_terms() == ((0, 2, 1),)


def test_the_combine_may_read_the_program_s_inputs_too():
    pair = _only_pair(split_k(scale=True))
    assert [v.name for v in pair.inputs] == ["x", "w", "s"]


def test_split_kv_attention_groups_the_splits_of_each_head_and_row_block():
    # grid (heads, row blocks, splits) = (2, 2, 4); the combine's (2, 2) blocks each read 4 splits
    pair = _only_pair(split_attention(False, heads=2, queries=64))
    assert pair.groups == Groups(((0, 1), (1, 1), None), 4, (2, 2, 1))
    assert pair.groups.counter_terms() == ((0, 1, 1), (1, 1, 2))


@pytest.mark.parametrize("name", ["gqa.gqa", "qknorm.qknorm"])
def test_the_benchmarks_split_kv_plans_qualify(name):
    graph = guided_plan(name)
    pair = _only_pair(graph)
    first, second = graph.nodes[pair.first].body, graph.nodes[pair.second].body
    assert pair.groups.size * pair.groups.count == first.num_blocks and pair.groups.grid == second.grid
    assert pair.groups.size == first.grid[2]   # the KV splits


def _combine_reading_twice(grouped_alike: bool):
    """A split-K pair whose combine reads the partials twice: as the split's column blocks, and either so
    again or as a whole (every split's every column: tiles of every group)."""
    g = Graph("read_twice")
    x, w = g.input("x", (4, 256), f16), g.input("w", (256, 128), f16)
    b = g.block(grid=(4, 2), forloop=2)
    total = b.op("accum", b.op("matmul", b.input(x, imap=(None, 1), fmap=1), b.input(w, imap=(1, 0), fmap=0)))
    b.output(b.op("cast", total, dtype=f32), omap=(1, 0))
    (partials,) = b.done()
    c = g.block(grid=(4,), forloop=2)
    mine = c.op("accum", c.input(partials, imap=(1,), fmap=0))
    if grouped_alike:
        other = c.op("accum_max", c.input(partials, imap=(1,), fmap=0))
    else:
        other = c.op("sum", c.op("accum", c.input(partials, fmap=0)), dim=1, keepdim=True)
    c.output(c.op("cast", c.op("add", mine, other), dtype=f16), omap=(1,))
    c.done()
    return g.build(outputs=[g.nodes[-1].outputs[0]])


def _replicated_combine():
    """The combine's blocks along y read the same partials (a grid axis its reads do not split)."""
    g = Graph("replicated_combine")
    x, w = g.input("x", (4, 256), f16), g.input("w", (256, 128), f16)
    b = g.block(grid=(4, 2), forloop=2)
    total = b.op("accum", b.op("matmul", b.input(x, imap=(None, 1), fmap=1), b.input(w, imap=(1, 0), fmap=0)))
    b.output(b.op("cast", total, dtype=f32), omap=(1, 0))
    (partials,) = b.done()
    c = g.block(grid=(4, 2), forloop=2)
    c.output(c.op("cast", c.op("accum", c.input(partials, imap=(1, None), fmap=0)), dtype=f16), omap=(1, 0))
    c.done()
    return g.build(outputs=[g.nodes[-1].outputs[0]])


def _with_partials(read_elsewhere: bool):
    """split_k's pair with its partials also read by a third kernel, or returned."""
    graph = split_k()
    partials = graph.nodes[0].outputs[0]
    if not read_elsewhere:
        return attrs.evolve(graph, outputs=(*graph.outputs, partials))
    g = Graph("partials_read_elsewhere")
    g.inputs, g.nodes = list(graph.inputs), list(graph.nodes)
    g.taken = {v.name for n in graph.nodes for v in n.outputs} | {v.name for v in graph.inputs}
    g.op("exp", partials)
    return g.build(outputs=[graph.outputs[0], g.nodes[-1].outputs[0]])


def _kernel_between():
    """split_k's pair with an element-wise kernel between the split and the combine."""
    graph = split_k()
    exp = Graph("between")
    exp.taken = {v.name for n in graph.nodes for v in n.outputs} | {v.name for v in graph.inputs}
    y = exp.op("exp", graph.inputs[0])
    nodes = (graph.nodes[0], exp.nodes[0], graph.nodes[1])
    return attrs.evolve(graph, nodes=nodes, outputs=(*graph.outputs, y))


NOT_QUALIFYING = {
    # a split block's tile read by two combine blocks (combine blocks of 16 columns, split blocks of 32)
    "a tile read by two combine blocks": lambda: split_k(combine_columns=16),
    "combine blocks reading the same tiles": _replicated_combine,
    "reads of the partials grouping differently": lambda: _combine_reading_twice(grouped_alike=False),
    "partials read by another kernel": lambda: _with_partials(read_elsewhere=True),
    "partials returned": lambda: _with_partials(read_elsewhere=False),
    "a kernel between": _kernel_between,
    "a combine of more threads": lambda: split_k(combine_threads=256),
}


@pytest.mark.parametrize("case", sorted(NOT_QUALIFYING))
def test_pairs_that_do_not_qualify(case):
    assert one_launch_pairs(NOT_QUALIFYING[case]()) == ()


def test_reads_that_group_alike_qualify():
    assert _only_pair(_combine_reading_twice(grouped_alike=True)).groups.size == 2


def test_the_block_size_the_options_set_is_both_kernels():
    # the combine's 256 threads against the split's 128: no pair, unless CudaOptions.threads sets both
    assert one_launch_pairs(split_k(combine_threads=256)) == ()
    assert _only_pair(split_k(combine_threads=256), threads=256).groups.size == 2


# ---------------------------------------------------------------------------------------------
# what both backends write

#: (graph, options): split-K with a tile-loop split, a skinny split (and overlapping its predecessor), a
#: combine of fewer threads, a coarser combine reading an input too; split-KV attention of 2 heads
PROGRAMS = {
    "split-k": (lambda: split_k(), CudaOptions()),
    "split-k-skinny": (lambda: split_k(), SKINNY),
    "split-k-skinny-overlap": (lambda: split_k(), CudaOptions(skinny=True, overlap=True)),
    "split-k-fewer-combine-threads": (lambda: split_k(combine_threads=64), SKINNY),
    "split-k-coarser-combine-scaled": (lambda: split_k(combine_columns=64, scale=True), CudaOptions()),
    "split-kv-attention": (lambda: split_attention(False, heads=2, queries=64), CudaOptions()),
}


@pytest.mark.parametrize("backend", EMITTERS)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_pair_is_one_launch(backend, name):
    make, options = PROGRAMS[name]
    graph = make()
    pair = _only_pair(graph)
    program = emit(backend, graph, options)
    (launch,) = program.launches
    first, second = (lower_custom(graph.nodes[k], options, "sm_90a") for k in (pair.first, pair.second))
    assert launch.grid == first.grid and launch.block == (first.threads, 1, 1)
    assert launch.smem_bytes == max(first.smem_bytes, second.smem_bytes)
    assert launch.args == tuple(v.name for v in (*pair.inputs, *pair.outputs))
    assert launch.counters == pair.groups.count and launch.node_index == pair.first
    assert launch.overlap == first.overlap and launch.library is None


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_both_backends_launch_the_same(name):
    make, options = PROGRAMS[name]
    graph = make()
    launches = [emit(backend, graph, options).launches for backend in EMITTERS]
    assert launches[0] == launches[1]


def test_the_cuda_source_has_one_kernel_for_the_pair():
    code = kernel_code("cuda", emit("cuda", split_attention(False, heads=2, queries=64), CudaOptions()))
    assert code.count('extern "C" __global__') == 1
    assert code.count("atom.acq_rel.gpu.global.add.u32") == 1 and code.count("__syncthreads_or(") == 1


@pytest.mark.parametrize("backend", EMITTERS)
@pytest.mark.parametrize("options", [CudaOptions(overlap=True), CudaOptions(skinny=True, overlap=True)],
                         ids=["tile-loop", "skinny"])
def test_the_combine_waits_for_no_previous_kernel_of_its_own(backend, options):
    # the split, overlapping its predecessor, waits once; the combine, in the same launch, does not
    code = kernel_code(backend, emit(backend, split_k(), options))
    assert code.count("mdsl::wait_for_previous_kernel();" if backend == "cuda" else "griddepcontrol.wait;") == 1


# ---------------------------------------------------------------------------------------------
# compiled


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_pair_compiles_without_spills(backend, name):
    make, options = PROGRAMS[name]
    program = emit(backend, make(), options)
    compiled = module(backend, program)
    (launch,) = program.launches
    r = compiled.resources[launch.name]
    assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, f"{name}: {r}"
    assert r.registers * launch.block[0] <= 65536


def _count(instructions: list, prefix: str) -> int:
    return sum(1 for op in instructions if op.startswith(prefix))


@needs_nvdisasm
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["split-k", "split-k-skinny", "split-kv-attention"])
def test_the_sass_arrives_once_and_reads_the_partials_past_the_read_only_path(backend, name):
    """One arrival, one reset, one barrier that ors the votes; the combine's loads of the partials the
    split wrote in the same launch are plain loads: the same read-only (.CONSTANT) loads as the split's kernel
    launched alone, and plain ones besides."""
    make, options = PROGRAMS[name]
    graph = make()
    program = emit(backend, graph, options)
    ours = kernel_instructions(module(backend, program).cubin)[program.launches[0].name]
    assert _count(ours, "ATOMG.E.ADD.STRONG.GPU") == 1 and _count(ours, "ATOMG.E.EXCH") == 1
    assert _count(ours, "BAR.RED.OR") == 1
    split_alone = attrs.evolve(graph, nodes=graph.nodes[:1], outputs=graph.nodes[0].outputs)
    alone = emit(backend, split_alone, options)
    theirs = kernel_instructions(module(backend, alone).cubin)[alone.launches[0].name]
    read_only = [op for op in ours if op.startswith("LDG") and "CONSTANT" in op]
    assert len(read_only) == _count([op for op in theirs if "CONSTANT" in op], "LDG")
    assert _count(ours, "LDG.E") + _count(ours, "LDGSTS") > _count(theirs, "LDG.E") + _count(theirs, "LDGSTS")

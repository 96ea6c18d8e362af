"""The cost model: a mugraph's device-memory traffic, launches (one per kernel, but one for a split and its
combine where they qualify: mdsl.lowering.onelaunch; none for a view (mdsl.lowering.views), nor for a
transpose that cuBLAS reads in place: mdsl.lowering.gemm.library_read_transposes), shared memory and
parallelism, and the time they imply on a target GPU. It ranks verified candidates before (and without)
measurement, and gives each program its roofline floor.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import attrs

from mdsl.ir.graph import BlockGraph, KernelGraph, Node
from mdsl.ir.skinny import CLUSTERS, MAX_ROWS, skinny_shape
from mdsl.ir.types import TensorType
from mdsl.ir.validate import SMEM_LIMIT_BYTES, shared_memory_peak
from mdsl.lowering.gemm import library_read_transposes
from mdsl.lowering.grid import ROW_OPS, row_kernel_grid
from mdsl.lowering.onelaunch import one_launch_pairs
from mdsl.lowering.views import launches_nothing, layout_copies, strided_views
from mdsl.search.chain import tile_loop


@attrs.frozen
class Device:
    """What the cost model knows about a GPU."""

    name: str
    sms: int
    dram_bytes_per_s: float      # measured device-to-device copy rate, bytes read + written
    matmul_flops_per_s: float    # dense f16/bf16 tensor-core rate
    l2_bytes: int
    smem_per_block: int
    launch_s: float              # host launch overhead of one kernel
    l2_bytes_per_s: float        # aggregate L2 bandwidth (replicated reads are served there)
    memory_latency_s: float      # one global-memory round trip
    sm_bytes_per_s: float        # what one SM can pull from L2 (about 64 B per clock)
    pipeline_stages: int = 2     # loads in flight per block (double buffering)
    # a load that hits in L2, which a combine run in its split's launch makes (it reads the partials the split
    # just wrote): a round number under half of `memory_latency_s`, not fitted to a measurement
    l2_latency_s: float = 0.4e-6
    # occupancy and loop latency, for `gpu_estimate` (the ranking of tuning variants)
    smem_per_sm: int = 228 * 1024
    threads_per_sm: int = 2048
    max_blocks_per_sm: int = 8   # what registers usually allow a block of tensor-core tiles
    # A tile loop's iteration on the H200 (`_tile_fit`): the block's serial chain of barrier-separated
    # stages, each thread's elements of the stages' tile ops, each warp's chain of dependent mma steps; the
    # values fitted to the kernels the H200's profiler and autotuner timed in docs/results
    # (scripts/cost_vs_measured.py prints each against its estimate)
    step_s: float = 0.24e-6      # one barrier-separated stage: the barrier and the stage's start
    thread_element_s: float = 12e-9   # one element of a tile op on one thread (tile read, op, tile write)
    mma_step_s: float = 27e-9    # one step of a warp's chain of dependent mma.sync, fragments from shared memory
    # what one SM's tile loop draws from DRAM (cp.async copies into shared memory): 2 and 4 pipeline stages
    # time alike (docs/results/kernels.json), so a draw, not the latency, bounds it
    tile_sm_bytes_per_s: float = 32e9
    sm_dram_bytes_per_s: float = 50e9  # what one SM's loads draw from DRAM at best (the skinny loop's)
    # what one busy SM's skinny loop draws (weights and X together), fitted to the H200 autotuner's times of
    # rms_norm_linear (96 blocks, 128 or 256 threads) and gated_mlp (64 blocks) (docs/results/kernels.json);
    # a fit, not a cause: more blocks per SM (clusters, 3 on most SMs) do not draw more (docs/tried-kernels.md)
    skinny_sm_bytes_per_s: float = 40e9
    sm_elements_per_s: float = 25e9    # element-wise work on one SM (the skinny loop's epilogue)
    # A tile whose rows are shorter than `dram_run_bytes` draws proportionally less. (`estimate` weighs runs
    # against 64 bytes of its own: its costs are part of the stored plans.)
    dram_run_bytes: int = 128
    registers_per_sm: int = 65536
    max_registers_per_thread: int = 255  # beyond it ptxas spills to local memory
    # an element step on registers spilled to local memory costs this many more (times the spilled share
    # of the thread's registers): fitted to the H200's attention tiles of two row tiles a warp
    spill_factor: float = 3.0


#: The H200 as measured on the test machine (docs/design.md, section "Search"): 4.25 TB/s device-to-device
#: copy, ~750 TFLOP/s bf16.
H200 = Device("NVIDIA H200", 132, 4.25e12, 750e12, 60 * 2**20, SMEM_LIMIT_BYTES, 2.0e-6, 10e12, 1.0e-6, 120e9)


@attrs.frozen
class KernelCost:
    name: str
    dram_bytes: int        # unique bytes read and written in device memory
    l2_bytes: int          # bytes requested by all blocks (replicated reads included)
    flops: int
    blocks: int
    smem_bytes: int
    seconds: float


@attrs.frozen(order=True)
class Cost:
    seconds: float         # first: the estimated time ranks candidates
    dram_bytes: int
    launches: int
    smem_bytes: int
    flops: int = attrs.field(order=False)
    kernels: tuple = attrs.field(order=False, default=())

    def __str__(self) -> str:
        return (f"{self.seconds * 1e6:.2f} us est., {self.dram_bytes / 1e6:.3f} MB moved, {self.launches} launch(es), "
                f"{self.smem_bytes // 1024} KB smem max, {self.flops / 1e9:.3f} GFLOP")


def _matmul_flops(node: Node) -> int:
    a, b = node.inputs
    out = node.outputs[0]
    return 2 * math.prod(out.shape) * a.shape[-1]


def _node_flops(node: Node) -> int:
    if node.op == "matmul":
        return _matmul_flops(node)
    if node.body is not None:
        return _block_flops(node.body) if isinstance(node.body, BlockGraph) else sum(
            math.prod(o.shape) for n in node.body.nodes for o in n.outputs)
    return sum(math.prod(o.shape) for o in node.outputs)


def _block_flops(graph: BlockGraph, matmul_only: bool = False) -> int:
    post = graph.post_loop_vars()
    total = 0
    for n in graph.nodes:
        if matmul_only and n.op != "matmul":
            continue
        times = 1 if any(v.name in post for v in n.outputs) else graph.forloop
        total += _node_flops(n) * times
    return total * graph.num_blocks


def _kernel_time(device: Device, dram: int, flops: int, blocks: int) -> float:
    # A grid with fewer blocks than SMs cannot draw full bandwidth or issue on every SM.
    share = min(1.0, blocks / device.sms)
    memory = dram / (device.dram_bytes_per_s * share)
    compute = flops / (device.matmul_flops_per_s * share)
    return max(memory, compute) + device.launch_s


def _contiguous_bytes(tile: TensorType, tensor: TensorType) -> int:
    """Bytes of the longest contiguous run in a tile of a row-major tensor."""
    run = tile.dtype.itemsize
    for t, n in zip(reversed(tile.shape), reversed(tensor.shape)):
        run *= t
        if t != n:
            break
    return run


@attrs.frozen
class _Traffic:
    dram: int            # unique bytes read and written
    l2: int              # bytes requested by all blocks
    useful: float        # bytes read, weighted by how badly their accesses coalesce
    out_bytes: int
    per_iteration: int   # bytes one block loads per loop iteration
    loop_input_bytes: int  # of those, the tiles that change along the loop (they are pipelined)


def _traffic(node: Node, device: Device, run_bytes: int = 64) -> _Traffic:
    """`run_bytes`: the contiguous run below which reads are weighted as wasting DRAM bursts."""
    graph: BlockGraph = node.body
    dram = l2 = 0
    useful = 0.0
    per_iteration = loop_inputs = 0
    for inp, tensor in zip(graph.inputs, node.inputs):
        split = math.prod(g for g, d in zip(graph.grid, inp.imap) if d is not None)
        replicated = tensor.type.nbytes * graph.num_blocks // split
        l2 += replicated
        # replicated reads come from L2 when the tensor fits there
        read = tensor.type.nbytes if tensor.type.nbytes <= device.l2_bytes // 2 else replicated
        dram += read
        # contiguous runs shorter than `run_bytes` (two 32-byte sectors for `estimate`) waste DRAM bursts
        useful += read / min(1.0, _contiguous_bytes(inp.var.type, tensor.type) / run_bytes)
        per_iteration += inp.var.type.nbytes
        loop_inputs += inp.var.type.nbytes if inp.fmap is not None else 0
    out_bytes = sum(v.type.nbytes for v in node.outputs)
    return _Traffic(dram + out_bytes, l2 + out_bytes, useful, out_bytes, per_iteration, loop_inputs)


def _custom_cost(node: Node, device: Device, in_l2: frozenset = frozenset()) -> KernelCost:
    """`in_l2`: names of the inputs that lie in L2 when the kernel starts (a combine's partials, which its
    split wrote in the same launch): a kernel that reads only such inputs waits an L2 hit per round trip."""
    graph: BlockGraph = node.body
    t = _traffic(node, device)
    dram, l2, useful, out_bytes, per_iteration = t.dram, t.l2, t.useful, t.out_bytes, t.per_iteration
    flops = _block_flops(graph)
    smem = shared_memory_peak(graph)
    # Little's law: a block keeps `pipeline_stages` iterations of loads in flight per memory latency
    resident = max(1, min(-(-graph.num_blocks // device.sms), device.smem_per_block // max(smem, 1), 8))
    active = min(device.sms, graph.num_blocks)
    latency = device.l2_latency_s if all(v.name in in_l2 for v in node.inputs) else device.memory_latency_s
    latency_bw = active * resident * device.pipeline_stages * per_iteration / latency
    bandwidth = min(device.dram_bytes_per_s * active / device.sms, latency_bw)
    seconds = max(useful + out_bytes, 0) / bandwidth
    l2_rate = min(device.l2_bytes_per_s, active * device.sm_bytes_per_s)
    seconds = max(seconds, flops / (device.matmul_flops_per_s * active / device.sms), l2 / l2_rate)
    return KernelCost(node.op, dram, l2, flops, graph.num_blocks, smem, seconds + device.launch_s)


def _library_cost(node: Node, device: Device, views: dict) -> KernelCost:
    """A kernel-level op's standard kernel: a reduction or norm on the grid the lowering gives it (a block
    per row at least for few rows: `row_kernel_grid`), any other sized to fill the device. A split moves only
    its parts that are not strided views, a concat its pieces not written in place (`mdsl.lowering.views`)."""
    if node.op in ("split", "concat"):
        copies = layout_copies(node, views)
        dram = 2 * copies.elements * node.inputs[0].dtype.itemsize if copies is not None else 0
    else:
        dram = sum(v.type.nbytes for v in node.inputs) + sum(v.type.nbytes for v in node.outputs)
    flops = _node_flops(node)
    blocks = min(row_kernel_grid(node)[0], device.sms) if node.op in ROW_OPS else device.sms
    return KernelCost(node.op, dram, dram, flops, blocks, 0, _kernel_time(device, dram, flops, blocks))


def combined(graph: KernelGraph) -> frozenset:
    """Indices of the kernels that run in their predecessor's launch: the combines of the splits that
    qualify for one launch (mdsl.lowering.onelaunch)."""
    return frozenset(pair.second for pair in one_launch_pairs(graph))


def kernel_costs(graph: KernelGraph, device: Device = H200) -> list:
    """Each kernel's cost, in the graph's order. A combine run in its split's launch (`combined`) costs
    its kernel's time without a launch: the last block of each of the split's groups runs the combine's
    block as soon as it arrives, after the group's slowest block, so that the last group's combine starts
    when the split's slowest block ends (the split's time) and the combines take, spread over the SMs as the
    groups complete, what the combine's grid takes. The partials it reads, written by its group moments
    before, are L2 hits (`Device.l2_latency_s`)."""
    return _kernel_costs(graph, device, combined(graph))


def launched(graph: KernelGraph, views: Optional[dict] = None) -> list:
    """Indices of the nodes that launch a kernel: not views, nor splits and concats left with nothing to copy
    (`mdsl.lowering.views`), nor transposes that cuBLAS reads in place
    (`mdsl.lowering.gemm.library_read_transposes`). `views`: the graph's `strided_views`, where known."""
    in_place = library_read_transposes(graph)
    views = strided_views(graph) if views is None else views
    return [index for index, node in enumerate(graph.nodes)
            if not launches_nothing(node, views) and index not in in_place]


def _kernel_costs(graph: KernelGraph, device: Device, combines: frozenset) -> list:
    out = []
    views = strided_views(graph)
    for index in launched(graph, views):
        node = graph.nodes[index]
        in_l2 = frozenset(v.name for v in graph.nodes[index - 1].outputs) if index in combines else frozenset()
        cost = _custom_cost(node, device, in_l2) if node.body is not None else _library_cost(node, device, views)
        if index in combines:
            cost = attrs.evolve(cost, seconds=cost.seconds - device.launch_s)
        out.append(cost)
    return out


def estimate(graph: KernelGraph, device: Device = H200) -> Cost:
    """The cost of running `graph` as one kernel launch per non-view node, but one per split and its
    combine where they qualify for one launch (`kernel_costs`). The kernels' times are summed by
    `math.fsum`, correctly rounded: the builtin `sum` of floats rounds differently from one Python to
    another (3.12 compensates its rounding, 3.11 does not), and a plan's costs are re-checked on whatever
    machine reads it (`same_cost`)."""
    combines = combined(graph)
    ks = _kernel_costs(graph, device, combines)
    return Cost(math.fsum(k.seconds for k in ks), sum(k.dram_bytes for k in ks), len(ks) - len(combines),
                max((k.smem_bytes for k in ks), default=0), sum(k.flops for k in ks), tuple(ks))


#: How far apart two estimates of one graph's time may be and still agree: far above the rounding of a
#: sum of a few hundred kernel times, far below any difference that could reorder candidates.
SAME_COST_REL = 1e-9


def same_cost(stored: Cost, estimated: Cost) -> bool:
    """Whether `stored` (a cost read back from a plan) is `estimated` (the cost model's estimate of the
    same graph): every count equal, every time equal up to rounding. A plan written by another Python
    summed its kernels' times with other rounding (`estimate`), which is the same estimate."""
    def same(a, b) -> bool:
        if isinstance(a, float) or isinstance(b, float):
            return isinstance(a, (int, float)) and isinstance(b, (int, float)) \
                and math.isclose(a, b, rel_tol=SAME_COST_REL, abs_tol=0.0)
        return type(a) is type(b) and a == b

    if not (isinstance(stored, Cost) and isinstance(estimated, Cost)) or len(stored.kernels) != len(estimated.kernels):
        return False
    pairs = [(stored, estimated), *zip(stored.kernels, estimated.kernels)]
    if not all(isinstance(k, KernelCost) for pair in pairs[1:] for k in pair):
        return False
    # a Cost's fields but its kernels, then each kernel's fields
    return all(same(a, b) for s, e in pairs
               for a, b in zip(attrs.astuple(s, recurse=False), attrs.astuple(e, recurse=False))
               if not isinstance(a, tuple) or not isinstance(b, tuple))


# ---------------------------------------------------------------------------------------------
# the GPU-aware estimate: occupancy, waves and serial loop latency, for ranking tuning variants


@attrs.frozen
class KernelFit:
    """How one custom kernel's grid sits on the GPU."""

    blocks: int
    resident: int          # blocks one SM holds at once (shared memory, threads)
    per_sm: int            # blocks the busiest SM runs
    rounds: int            # of those, how many run one after another
    fill: float            # blocks / (per_sm x SMs): 1.0 when every SM has the same work
    iterations: int        # serial loop iterations per block
    steps: int             # barrier-separated steps of one iteration
    in_flight_per_sm: int  # bytes of loads in flight on the busiest SM
    smem_bytes: int        # per block, with the pipeline's copies
    registers: int         # per thread, spilled ones included (compiled or estimated)
    memory_s: float        # the loads alone
    compute_s: float       # the work alone, but its barriers
    latency_s: float       # the serial chain's barriers (rounds x (iterations x steps and the steps after))
                           # and, without a pipeline, each iteration's wait for its copies
    seconds: float
    lowering: str = "tile"  # or "skinny": the weights streamed into registers (mdsl.ir.skinny)
    cluster: int = 1        # blocks of a thread-block cluster each block's K is split over (skinny only)


@attrs.frozen
class GpuEstimate:
    seconds: float
    kernels: tuple         # KernelFit of each custom kernel

    def describe(self) -> str:
        return " ; ".join(f"{k.blocks} blocks ({k.lowering} loop{_clustered(k)}, {k.fill:.0%} fill, {k.rounds} round(s) of "
                          f"{k.iterations} iteration(s), {k.in_flight_per_sm // 1024} KB in flight/SM, "
                          f"{k.registers} registers)" for k in self.kernels)


def _clustered(fit: "KernelFit") -> str:
    return f" in clusters of {fit.cluster}" if fit.cluster > 1 else ""


def _block_work(graph: BlockGraph, device: Device) -> tuple:
    """(seconds of one loop iteration's work, of the post-loop work, steps per iteration, post-loop
    steps) of one block on one SM: matmuls at the SM's tensor-core rate, other ops per element."""
    post = graph.post_loop_vars()
    sm_flops = device.matmul_flops_per_s / device.sms
    loop_s = post_s = 0.0
    loop_steps = post_steps = 0
    for n in graph.nodes:
        seconds = _matmul_flops(n) / sm_flops if n.op == "matmul" else _node_flops(n) / device.sm_elements_per_s
        if n.opdef.is_accumulator or not any(v.name in post for v in n.outputs):
            loop_s, loop_steps = loop_s + seconds, loop_steps + 1   # an accumulator updates every iteration
        else:
            post_s, post_steps = post_s + seconds, post_steps + 1
    return loop_s, post_s, loop_steps, post_steps


#: `estimate_registers`' model, fitted to ptxas's reports for sm_90a (NVRTC) of row-resident attention
#: tiles (16x64 + 16x64 per warp fits the registers, 16x128 + 16x64 just fits, larger ones spill) and of
#: the block-tiled GEMVs (rms_norm_linear, gated_mlp), which need far fewer.
_BASE_REGISTERS = 60
_REGISTERS_PER_FLOAT = 2    # a product's element, its transformed copy and the next mma's operand


def _row_resident(graph: BlockGraph) -> bool:
    """Whether a loop matmul's product feeds more loop work than its accumulator (online softmax's
    chain): the CUDA backend then keeps whole 16-row tiles of it in each warp's registers."""
    post = graph.post_loop_vars()
    products = {n.outputs[0].name for n in graph.nodes if n.op == "matmul" and n.outputs[0].name not in post}
    return any(v.name in products for n in graph.nodes if not n.opdef.is_accumulator for v in n.inputs
               if n.outputs[0].name not in post)


def estimate_registers(graph: BlockGraph) -> int:
    """Registers per thread a block graph's kernel needs (spilled ones included), without compiling it:
    the loop matmuls' products, kept in mma fragments. Row-resident (see `_row_resident`): each warp
    holds ceil(row tiles / warps) whole 16-row tiles, cols / 2 floats each per thread; otherwise the
    product is spread over the block's threads."""
    post = graph.post_loop_vars()
    warps = max(1, graph.threads // 32)
    resident = _row_resident(graph)
    floats = 0
    for n in graph.nodes:
        if n.op != "matmul" or n.outputs[0].name in post:
            continue
        shape = n.outputs[0].shape
        if resident:
            row_tiles = math.prod(shape[:-2]) * -(-shape[-2] // 16)
            floats += -(-row_tiles // warps) * shape[-1] // 2
        else:
            floats += -(-math.prod(shape) // graph.threads)
    return _BASE_REGISTERS + _REGISTERS_PER_FLOAT * floats


def _tile_bytes(node: Node, device: Device) -> tuple:
    """(bytes of one iteration's tiles, of the tiles loaded once and the outputs) of one block, each read
    weighted by how much of a DRAM burst its rows use (rows shorter than `dram_run_bytes` draw less)."""
    graph: BlockGraph = node.body
    loop = once = 0.0
    for inp, tensor in zip(graph.inputs, node.inputs):
        weighted = inp.var.type.nbytes / min(1.0, _contiguous_bytes(inp.var.type, tensor.type) / device.dram_run_bytes)
        if inp.fmap is not None:
            loop += weighted
        else:
            once += weighted
    return loop, once + sum(v.type.nbytes for v in node.outputs) / graph.num_blocks


def _tile_fit(node: Node, device: Device, stages: int, registers: Optional[int] = None) -> KernelFit:
    """A tile loop on the GPU. Each SM runs `min(per_sm, resident)` blocks at once, `rounds` times over. An
    iteration of them takes the longer of their copies, at what one SM's tile loop draws (its share of DRAM
    bandwidth at most), and a block's serial work (`mdsl.search.chain`: the barrier-separated stages, a
    thread's elements, a warp's dependent mma steps; the SM's tensor cores bound the matmuls too): the
    pipeline overlaps them. Without a pipeline (one stage, or one iteration) the copies come first, a
    memory round trip after they are issued, then the work. The work done once and the tiles loaded once
    add to the iterations; the replicated reads served by L2 bound the whole."""
    graph: BlockGraph = node.body
    t = _traffic(node, device, device.dram_run_bytes)
    loop = tile_loop(node, stages)
    blocks = graph.num_blocks
    registers = estimate_registers(graph) if registers is None else registers
    allocated = -(-min(registers, device.max_registers_per_thread) // 8) * 8   # ptxas allocates by 8
    resident = max(1, min(device.smem_per_sm // max(loop.smem_bytes, 1), device.threads_per_sm // graph.threads,
                          device.registers_per_sm // (allocated * graph.threads), device.max_blocks_per_sm))
    per_sm = -(-blocks // device.sms)
    rounds = -(-per_sm // resident)
    fill = blocks / (per_sm * device.sms)
    together = min(per_sm, resident)
    in_flight = together * loop.depth * (t.loop_input_bytes or t.per_iteration)
    active = min(blocks, device.sms)
    rate = min(device.dram_bytes_per_s / active, device.tile_sm_bytes_per_s)
    loop_bytes, once_bytes = _tile_bytes(node, device)
    spilled = max(0, registers - device.max_registers_per_thread) / max(registers, 1)
    sm_flops = device.matmul_flops_per_s / device.sms

    def work(w) -> float:
        serial = (w.elements * device.thread_element_s * (1 + device.spill_factor * spilled)
                  + w.mma_steps * device.mma_step_s)
        return max(serial, together * w.flops / sm_flops)

    copies, once_copies = together * loop_bytes / rate, together * once_bytes / rate
    each = work(loop.iteration) + loop.iteration.stages * device.step_s
    pipelined = loop.depth > 1 and graph.forloop > 1
    # without a pipeline an iteration's copies come first, a memory round trip after they are issued (the
    # other blocks on the SM work meanwhile), then the work
    waiting = device.memory_latency_s / together if loop.waits else 0.0
    iteration = max(copies, each) if pipelined else waiting + copies + each
    once = once_copies + work(loop.once) + loop.once.stages * device.step_s
    memory = rounds * (graph.forloop * copies + once_copies)
    compute = rounds * (graph.forloop * work(loop.iteration) + work(loop.once))
    latency = rounds * (graph.forloop * (loop.iteration.stages * device.step_s + waiting)
                        + loop.once.stages * device.step_s)
    l2 = per_sm * t.l2 / blocks / min(device.sm_bytes_per_s, device.l2_bytes_per_s / active)
    seconds = max(rounds * (graph.forloop * iteration + once), l2) + device.launch_s
    return KernelFit(blocks, resident, per_sm, rounds, fill, graph.forloop, loop.iteration.stages, in_flight,
                     loop.smem_bytes, registers, memory, compute, latency, seconds)


def gpu_estimate(graph: KernelGraph, device: Device = H200, stages: int = 3,
                 registers: Optional[Callable[[int], Optional[int]]] = None, skinny: bool = False) -> GpuEstimate:
    """A finer estimate than `estimate` of one mugraph's time on `device`, for choosing among mugraphs of
    one structure with other grids and loops: it counts waves (the busiest SM's blocks), blocks resident
    per SM (the lowering's shared memory with up to `stages` pipelined copies of the loop's tiles,
    threads, registers), what an SM's tile loop draws, how contiguous the tiles' rows are, the serial
    work of a loop iteration (`mdsl.search.chain`), whether the pipeline overlaps it with the copies, and
    the spills of a kernel that needs more registers than a thread has (`_tile_fit`). Library kernels and
    views count as `estimate` counts them.

    `registers(node_index)`: the registers per thread (spilled ones included) of the compiled kernel of
    the graph's node at that index, where a compiled kernel is at hand (None: `estimate_registers`).
    `skinny`: a kernel with a skinny loop (`mdsl.ir.skinny`) counts as the faster of its two lowerings
    (the autotuner times both: `CudaOptions.skinny`)."""
    fits, seconds, combines, views = [], 0.0, combined(graph), strided_views(graph)
    for index in launched(graph, views):
        node = graph.nodes[index]
        if node.body is None or not isinstance(node.body, BlockGraph):
            seconds += _library_cost(node, device, views).seconds
            continue
        fit = _tile_fit(node, device, stages, registers(index) if registers is not None else None)
        streamed = _skinny_fit(node, device) if skinny else None
        fits.append(streamed if streamed is not None and streamed.seconds < fit.seconds else fit)
        if index in combines:   # in its split's launch, after the group's slowest block (`kernel_costs`)
            fits[-1] = attrs.evolve(fits[-1], seconds=fits[-1].seconds - device.launch_s)
        seconds += fits[-1].seconds
    return GpuEstimate(seconds, tuple(fits))


#: registers a thread of the skinny loop takes: two register buffers of loads (64), addresses, X's fragments,
#: the accumulators, the fold; more with a second 8-row tile of X (its fragments and accumulators in every
#: buffer). Fitted to ptxas's reports for sm_90a of the skinny loops of one and two weights at 2 to 16 rows.
_SKINNY_BASE_REGISTERS = 128
_SKINNY_REGISTERS_PER_TILE = 32   # each 8-row tile of X past the first


def _skinny_fit(node: Node, device: Device) -> Optional[KernelFit]:
    """How a kernel with a skinny loop (mdsl.ir.skinny) sits on the GPU, or None where it has none: the
    fastest of its K split over clusters of each of `CLUSTERS` blocks that split it (the CUDA backend's
    `CudaOptions.cluster`; the autotuner times each)."""
    graph: BlockGraph = node.body
    shape = skinny_shape(graph)
    if shape is None or graph.threads % 32 or not shape.fits(graph.threads // 32):
        return None
    fits = [_skinny_cluster_fit(node, shape, cluster, device) for cluster in CLUSTERS if shape.splits_over(cluster)]
    return min(fits, key=lambda f: f.seconds)


def _skinny_cluster_fit(node: Node, shape, cluster: int, device: Device) -> KernelFit:
    """The skinny loop with its K split over clusters of `cluster` blocks: no pipeline, no barrier in the
    loop; each warp keeps `SkinnyShape.loads_in_flight` of the weights in flight (Little's law sets what
    an SM draws) and an SM draws at most `skinny_sm_bytes_per_s` of weights and X together; the loop's
    latency is one memory round trip, then the partial sums meet (in a cluster: once more, across its
    blocks) and the epilogue runs."""
    graph: BlockGraph = node.body
    warps = graph.threads // 32
    t = _traffic(node, device, device.dram_run_bytes)
    blocks = graph.num_blocks * cluster
    tiles = -(-shape.m // 8)
    registers = _SKINNY_BASE_REGISTERS + _SKINNY_REGISTERS_PER_TILE * (tiles - 1)
    allocated = -(-registers // 8) * 8
    meeting = cluster * (len(shape.weights) * shape.m * shape.n + len(shape.rows) * MAX_ROWS) if cluster > 1 else 0
    smem = 4 * (len(shape.weights) * (warps // shape.groups()) * shape.m * shape.n + len(shape.rows) * warps * MAX_ROWS
                + meeting)
    smem += shared_memory_peak(graph) - sum(i.var.type.nbytes for i in graph.inputs)   # no input tiles
    resident = max(1, min(device.smem_per_sm // max(smem, 1), device.threads_per_sm // graph.threads,
                          device.registers_per_sm // (allocated * graph.threads), device.max_blocks_per_sm))
    per_sm = -(-blocks // device.sms)
    rounds = -(-per_sm // resident)
    fill = blocks / (per_sm * device.sms)
    in_flight = min(per_sm, resident) * shape.loads_in_flight(warps)
    active = min(blocks, device.sms)
    dram_rate = min(device.dram_bytes_per_s / active, device.sm_dram_bytes_per_s, in_flight / device.memory_latency_s)
    x_bytes = (shape.m + len(shape.vectors)) * shape.k * 2 / cluster   # a block's X and vectors, from L2
    dram = per_sm * (t.useful + t.out_bytes) / blocks
    memory = max(dram / dram_rate, (dram + per_sm * x_bytes) / device.skinny_sm_bytes_per_s,
                 per_sm * t.l2 / blocks / min(device.sm_bytes_per_s, device.l2_bytes_per_s / active))
    _, post_s, _, post_steps = _block_work(graph, device)
    padded_flops = 2 * 8 * tiles * shape.n * shape.k * len(shape.weights) / cluster   # X's rows padded to 8-row tiles
    compute = per_sm * (padded_flops / (device.matmul_flops_per_s / device.sms) + post_s)
    meetings = 2 if cluster == 1 else 3
    latency = rounds * (device.memory_latency_s + (post_steps + meetings) * device.step_s)
    seconds = max(memory, compute) + latency + device.launch_s
    return KernelFit(blocks, resident, per_sm, rounds, fill, 1, 0, in_flight, smem, registers, memory, compute,
                     latency, seconds, "skinny", cluster)


@attrs.frozen
class Floor:
    bytes: int          # each graph input read once, each output written once
    flops: int          # the matmul work of the program
    seconds: float      # max(bytes / bandwidth, flops / matmul rate)
    bound: str          # "memory" or "compute"


def roofline_floor(graph: KernelGraph, device: Device = H200) -> Floor:
    """The time no implementation can beat by much (METHOD.md's two numbers)."""
    seen = {v.name for v in graph.inputs}
    nbytes = sum(v.type.nbytes for v in graph.inputs)
    nbytes += sum(v.type.nbytes for v in {o.name: o for o in graph.outputs}.values() if v.name not in seen)
    flops = sum(_matmul_flops(n) for n in graph.nodes if n.op == "matmul")
    flops += sum(_block_flops(n.body, matmul_only=True) for n in graph.nodes if isinstance(n.body, BlockGraph))
    memory, compute = nbytes / device.dram_bytes_per_s, flops / device.matmul_flops_per_s
    return Floor(nbytes, flops, max(memory, compute), "memory" if memory >= compute else "compute")

"""The cost model: a mugraph's device-memory traffic, launches, shared memory and parallelism, and
the time they imply on a target GPU. It ranks verified candidates before (and without) measurement,
and gives each program its roofline floor.
"""
from __future__ import annotations

import math

import attrs

from mdsl.ir.graph import BlockGraph, KernelGraph, Node
from mdsl.ir.types import TensorType
from mdsl.ir.validate import SMEM_LIMIT_BYTES, shared_memory_peak


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


#: Measured on the H200 test machine (design.md): 4.25 TB/s copy, ~750 TFLOP/s bf16.
H200 = Device("NVIDIA H200", 132, 4.25e12, 750e12, 60 * 2**20, SMEM_LIMIT_BYTES, 2.0e-6, 10e12, 1.0e-6, 120e9)

#: Layout operators that are views of their input: no kernel, no traffic.
_VIEWS = frozenset({"reshape"})


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


def _custom_cost(node: Node, device: Device) -> KernelCost:
    graph: BlockGraph = node.body
    dram = l2 = 0
    useful = 0.0      # dram bytes weighted by how well their accesses coalesce
    per_iteration = 0  # bytes one block loads per loop iteration
    for inp, tensor in zip(graph.inputs, node.inputs):
        split = math.prod(g for g, d in zip(graph.grid, inp.imap) if d is not None)
        replicated = tensor.type.nbytes * graph.num_blocks // split
        l2 += replicated
        # replicated reads come from L2 when the tensor fits there
        read = tensor.type.nbytes if tensor.type.nbytes <= device.l2_bytes // 2 else replicated
        dram += read
        # contiguous runs shorter than two 32-byte sectors waste DRAM bursts
        useful += read / min(1.0, _contiguous_bytes(inp.var.type, tensor.type) / 64)
        per_iteration += inp.var.type.nbytes
    out_bytes = sum(v.type.nbytes for v in node.outputs)
    dram += out_bytes
    l2 += out_bytes
    flops = _block_flops(graph)
    smem = shared_memory_peak(graph)
    # Little's law: a block keeps `pipeline_stages` iterations of loads in flight per memory latency
    resident = max(1, min(-(-graph.num_blocks // device.sms), device.smem_per_block // max(smem, 1), 8))
    active = min(device.sms, graph.num_blocks)
    latency_bw = active * resident * device.pipeline_stages * per_iteration / device.memory_latency_s
    bandwidth = min(device.dram_bytes_per_s * active / device.sms, latency_bw)
    seconds = max(useful + out_bytes, 0) / bandwidth
    l2_rate = min(device.l2_bytes_per_s, active * device.sm_bytes_per_s)
    seconds = max(seconds, flops / (device.matmul_flops_per_s * active / device.sms), l2 / l2_rate)
    return KernelCost(node.op, dram, l2, flops, graph.num_blocks, smem, seconds + device.launch_s)


def _library_cost(node: Node, device: Device) -> KernelCost:
    dram = sum(v.type.nbytes for v in node.inputs) + sum(v.type.nbytes for v in node.outputs)
    flops = _node_flops(node)
    # a library kernel sizes its own grid to fill the device
    return KernelCost(node.op, dram, dram, flops, device.sms, 0, _kernel_time(device, dram, flops, device.sms))


def kernel_costs(graph: KernelGraph, device: Device = H200) -> list:
    out = []
    for node in graph.nodes:
        if node.op in _VIEWS:
            continue
        out.append(_custom_cost(node, device) if node.body is not None else _library_cost(node, device))
    return out


def estimate(graph: KernelGraph, device: Device = H200) -> Cost:
    """The cost of running `graph` as one kernel launch per non-view node."""
    ks = kernel_costs(graph, device)
    return Cost(sum(k.seconds for k in ks), sum(k.dram_bytes for k in ks), len(ks),
                max((k.smem_bytes for k in ks), default=0), sum(k.flops for k in ks), tuple(ks))


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

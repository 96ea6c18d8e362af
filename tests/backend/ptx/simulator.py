"""A CPU simulator of the PTX backend's kernels, for CI without a GPU: the same LLVM IR that becomes
PTX, compiled for the host instead, each GPU thread of a block run as a host thread.

The IR is retargeted as text: address spaces dropped (global and shared memory are host memory; the
dynamic shared memory is one host buffer, blocks run one after another), the op markers (inline asm)
removed, and the NVVM intrinsics (special registers, the barrier, the warp shuffle) replaced by calls
back into Python: a special register reads the calling thread's coordinates, the barrier is a
`threading.Barrier` of the block's threads, a shuffle exchanges values through a per-warp slot array
between two waits on the warp's barrier. A barrier that some thread never reaches times out
(a kernel whose barriers are not uniform fails instead of hanging).

What it checks is the IR's semantics: index arithmetic, loops, tiles, barriers, shuffles, dtype
conversions. Not NVPTX's code generation or ptxas (the acceptance tests assemble every program).
"""
from __future__ import annotations

import ctypes
import functools
import re
import threading
from typing import Sequence

import numpy as np

from mdsl.backend.cuda.runtime import _from_device_bits, _to_device_bits
from mdsl.backend.ptx import PtxProgram
from mdsl.ir.dtypes import DType
from mdsl.ir.graph import KernelGraph

SMEM_BYTES = 256 * 1024
BARRIER_TIMEOUT_S = 60.0
_SREGS = ("tid.x", "ntid.x", "ctaid.x", "ctaid.y", "ctaid.z", "nctaid.x", "nctaid.y", "nctaid.z")
_HOST_DTYPES = {"f16": np.float16, "bf16": np.uint16, "f32": np.float32, "i32": np.int32}


# bf16 on the host: 16-bit integers, converted by these (x86 has no bf16 conversion in general)
_BF16_HELPERS = """
define internal i16 @sim_to_bf16(float %x) {
  %bits = bitcast float %x to i32
  %nan = fcmp uno float %x, %x
  %lsb = lshr i32 %bits, 16
  %odd = and i32 %lsb, 1
  %bias = add i32 %odd, 32767
  %rounded = add i32 %bits, %bias
  %high = lshr i32 %rounded, 16
  %half = trunc i32 %high to i16
  %out = select i1 %nan, i16 32704, i16 %half
  ret i16 %out
}
define internal float @sim_from_bf16(i16 %x) {
  %wide = zext i16 %x to i32
  %bits = shl i32 %wide, 16
  %out = bitcast i32 %bits to float
  ret float %out
}
"""


def host_ir(llvm_ir: str) -> str:
    """The module retargeted for the host (see the module docstring)."""
    out = []
    for line in llvm_ir.splitlines():
        stripped = line.strip()
        if stripped.startswith(("target triple", "target datalayout", "!")) or 'asm sideeffect "//' in line:
            continue
        if stripped.startswith('@"mdsl_smem"'):
            line = f'@"mdsl_smem" = global [{SMEM_BYTES} x i8] zeroinitializer, align 16'
        line = re.sub(r" addrspace\([13]\)", "", line)
        line = line.replace("define ptx_kernel ", "define ")
        line = re.sub(r'llvm\.nvvm\.read\.ptx\.sreg\.(\w+)\.(\w)', r"sim_sreg_\1_\2", line)
        line = line.replace('"llvm.nvvm.barrier0"', '"sim_barrier"').replace('"llvm.nvvm.shfl.sync.bfly.f32"', '"sim_shfl"')
        line = re.sub(r"(%\S+) = fpext bfloat (%\S+) to float", r"\1 = call float @sim_from_bf16(i16 \2)", line)
        line = re.sub(r"(%\S+) = fptrunc float (%\S+) to bfloat", r"\1 = call i16 @sim_to_bf16(float \2)", line)
        out.append(line.replace("bfloat", "i16"))
    return "\n".join(out) + "\n" + _BF16_HELPERS


class _Block:
    """The state the threads of one running block share."""

    def __init__(self, threads: int):
        self.barrier = threading.Barrier(threads, timeout=BARRIER_TIMEOUT_S)
        self.warps = [threading.Barrier(min(32, threads - w), timeout=BARRIER_TIMEOUT_S) for w in range(0, threads, 32)]
        self.slots = np.zeros(threads, dtype=np.float32)
        self.errors: list = []


_LOCAL = threading.local()   # .coords: this thread's special registers; .block: its _Block


def _guarded(fn):
    def call(*args):
        try:
            return fn(*args)
        except BaseException as e:   # an exception cannot cross the C frames: record it, keep going
            _LOCAL.block.errors.append(e)
            return 0

    return call


def _sreg(name: str):
    return _guarded(lambda: _LOCAL.coords[name])


def _barrier() -> None:
    _LOCAL.block.barrier.wait()


def _shuffle(mask: int, value: float, lane_mask: int, clamp: int) -> float:
    block, tid = _LOCAL.block, _LOCAL.coords["tid.x"]
    warp = block.warps[tid // 32]
    block.slots[tid] = value
    warp.wait()
    other = float(block.slots[tid ^ lane_mask])
    warp.wait()
    return other


@functools.cache
def _callbacks() -> dict:
    """Name -> (ctypes callback, kept alive here)."""
    made = {f"sim_sreg_{s.replace('.', '_')}": ctypes.CFUNCTYPE(ctypes.c_int32)(_sreg(s)) for s in _SREGS}
    made["sim_barrier"] = ctypes.CFUNCTYPE(None)(_guarded(_barrier))
    made["sim_shfl"] = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_int32, ctypes.c_float, ctypes.c_int32,
                                        ctypes.c_int32)(_guarded(_shuffle))
    return made


def _engine(llvm_ir: str):
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    for name, callback in _callbacks().items():
        llvm.add_symbol(name, ctypes.cast(callback, ctypes.c_void_p).value)
    module = llvm.parse_assembly(host_ir(llvm_ir))
    module.verify()
    # the host's own features: f16 and bf16 conversions as instructions (F16C, AVX512-BF16), not as
    # calls to compiler-rt helpers that a JIT cannot find
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=1)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    return engine


def _aligned(nbytes: int, dtype) -> np.ndarray:
    """A 64-byte aligned host buffer filled with 0xFF bytes (the kernels make 16-byte accesses)."""
    raw = np.full(nbytes + 64, 0xFF, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype)


def _to_host(x: np.ndarray, dtype: DType) -> np.ndarray:
    values = _to_device_bits(x, dtype).reshape(-1)    # as the runtime uploads it (bf16 rounded to nearest even)
    out = _aligned(values.nbytes, values.dtype)
    out[:] = values
    return out


def run(program: PtxProgram, inputs: Sequence[np.ndarray]) -> list:
    """Run the program's kernels in order on host buffers; the graph's outputs as float64 arrays.
    Intermediate buffers and the shared memory start filled with 0xFF bytes (NaN in every float
    dtype), so that what no kernel wrote shows."""
    graph: KernelGraph = program.graph
    engine = _engine(program.llvm_ir)
    aliases = dict(program.aliases)
    types = {v.name: v.type for v in graph.inputs}
    for node in graph.nodes:
        types.update((v.name, v.type) for v in node.outputs)
    buffers: dict = {}
    for v, x in zip(graph.inputs, inputs):
        buffers[v.name] = _to_host(x, v.dtype)

    def buffer(name: str) -> np.ndarray:
        root = aliases.get(name, name)
        if root not in buffers:
            t = types[root]
            buffers[root] = _aligned(t.nbytes, _HOST_DTYPES[t.dtype.name])
        return buffers[root]

    smem_address = engine.get_global_value_address("mdsl_smem") if '@"mdsl_smem"' in program.llvm_ir else 0
    for launch in program.launches:
        args = [buffer(a) for a in launch.args]
        kernel = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * len(args))(engine.get_function_address(launch.name))
        _run_launch(kernel, [a.ctypes.data for a in args], launch, smem_address)
    return [_from_device_bits(buffer(v.name).reshape(v.shape), v.dtype).astype(np.float64) for v in graph.outputs]


def _run_launch(kernel, pointers: list, launch, smem_address: int) -> None:
    """The launch's blocks one after another, on one set of host threads (one per GPU thread)."""
    threads = launch.block[0]
    block = _Block(threads)
    grid = launch.grid
    order = [(x, y, z) for z in range(grid[2]) for y in range(grid[1]) for x in range(grid[0])]

    def thread(tid: int) -> None:
        _LOCAL.block = block
        try:
            for x, y, z in order:
                if tid == 0 and smem_address:
                    ctypes.memset(smem_address, 0xFF, SMEM_BYTES)
                block.barrier.wait()       # shared memory reset before the block starts
                _LOCAL.coords = {"tid.x": tid, "ntid.x": threads, "ctaid.x": x, "ctaid.y": y, "ctaid.z": z,
                                 "nctaid.x": grid[0], "nctaid.y": grid[1], "nctaid.z": grid[2]}
                kernel(*pointers)
                block.barrier.wait()       # every thread done with it before the next one
        except BaseException as e:
            block.errors.append(e)
            block.barrier.abort()

    previous = threading.stack_size(4 * 1024 * 1024)
    try:
        workers = [threading.Thread(target=thread, args=(t,)) for t in range(threads)]
    finally:
        threading.stack_size(previous)
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if block.errors:
        raise AssertionError(f"{launch.name}: {block.errors[0]!r} ({len(block.errors)} error(s) in the simulated "
                             "threads)")

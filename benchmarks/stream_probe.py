"""How fast can one worker block per SM stream weights: the compute warps' own loads (the megakernel's
gemv: 16-byte `ld.global.nc`, 16 per lane in flight) against a loader warp's `cp.async.bulk` copies
through a shared-memory ring (the megakernel's `stream_weights`: sub-tiles of SUB bytes in NB buffers,
the compute warps taking sub-tiles in turn). Each of the grid's blocks (one per SM) reads its own
contiguous `--mb-per-sm` MB; the buffers rotate over three copies of the whole, so nothing is in L2 from
the previous launch. GB/s per SM and in all, median of `--samples` launches timed by CUDA events.

    PYTHONPATH=. python3 benchmarks/stream_probe.py [--mb-per-sm 6] [--rings 16x12,24x8,48x4]

The question it answers: is the ring's steady-state stream as fast as the loads (the megakernel's gate/up
ran at ~18.6 GB/s per SM through the ring, ~29 GB/s with the loads, eighth session)? (The ninth session's
run read only the first half of each 8 KB row on the loads path, so its "6.93 TB/s" counted twice the
bytes read: ~3.5 TB/s; the ring rows, 4.1 TB/s, were right. Fixed since.)
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SOURCE = r"""
constexpr int NT = 256, NW = 8, LAUNCH = NT + 32;
constexpr int SUB = %(sub)d, NB = %(nb)d, RING = %(ring)d;   // RING: 0 = the compute warps' own loads

__device__ __forceinline__ unsigned smem_address(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ uint4 ld_weights(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%%0, %%1, %%2, %%3}, [%%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ld_shared(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%%0, %%1, %%2, %%3}, [%%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_address(p)));
  return v;
}
__device__ __forceinline__ void bar_init(unsigned long long* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%%0], 1;" :: "r"(smem_address(b)) : "memory");
}
__device__ __forceinline__ void bar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%%0];" :: "r"(smem_address(b)) : "memory");
}
__device__ __forceinline__ void bar_expect(unsigned long long* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%%0], %%1;" :: "r"(smem_address(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(unsigned long long* b, unsigned parity) {
  unsigned done;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%%1], %%2;\n selp.u32 %%0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(smem_address(b)), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%%0], [%%1], %%2, [%%3];"
               :: "r"(smem_address(dst)), "l"(src), "r"(bytes), "r"(smem_address(b)) : "memory");
}

extern "C" __global__ void __launch_bounds__(LAUNCH, 1) probe(const char* src, long long per_block, unsigned* sink) {
  extern __shared__ __align__(128) char ring[];
  __shared__ unsigned long long full[NB > 0 ? NB : 1], empty[NB > 0 ? NB : 1];
  __shared__ volatile long long issued;
  const char* mine = src + blockIdx.x * per_block;
  const int warp = threadIdx.x / 32, lane = threadIdx.x %% 32;
  unsigned acc = 0;
  if (threadIdx.x == 0) {
    issued = 0;
    for (int b = 0; b < NB; ++b) { bar_init(&full[b]); bar_init(&empty[b]); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (!RING) {
    if (warp < NW) {   // rows of 8 KB, one per warp at a time, 16 chunks of 16 bytes per lane: 16 in flight
      constexpr int ROW = 8192, U = ROW / 16 / 32;
      const long long rows = per_block / ROW;
      for (long long row = warp; row < rows; row += NW) {
        uint4 v[U];
        for (int u = 0; u < U; ++u) v[u] = ld_weights(mine + row * ROW + (lane + 32 * u) * 16);
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
      }
    }
  } else if (warp == NW) {   // the loader
    const long long subs = per_block / SUB;
    for (long long n = 0; n < subs; ++n) {
      const int b = int(n %% NB);
      if (n >= NB) bar_wait(&empty[b], unsigned((n / NB - 1) & 1));
      if (lane == 0) {
        bar_expect(&full[b], SUB);
        __threadfence_block();
        issued = n + 1;
      }
      __syncwarp();
      for (int off = lane * 16384; off < SUB; off += 32 * 16384)
        bulk_copy(ring + (long long)b * SUB + off, mine + n * SUB + off, SUB - off < 16384 ? SUB - off : 16384, &full[b]);
    }
  } else {                   // the compute warps: sub-tiles warp, warp + NW, ...
    const long long subs = per_block / SUB;
    for (long long n = warp; n < subs; n += NW) {
      const int b = int(n %% NB);
      while (issued <= n) __nanosleep(20);
      bar_wait(&full[b], unsigned((n / NB) & 1));
      const char* tile = ring + (long long)b * SUB;
      for (int c = lane * 16; c < SUB; c += 32 * 16 * 8) {
        uint4 v[8];
        for (int u = 0; u < 8; ++u) v[u] = c + u * 512 < SUB ? ld_shared(tile + c + u * 512) : make_uint4(0, 0, 0, 0);
        for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
      }
      __syncwarp();
      if (lane == 0) bar_arrive(&empty[b]);
    }
  }
  if (acc == 0x9e3779b9u) sink[threadIdx.x] = acc;   // keeps the loads
}
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb-per-sm", type=float, default=6.0, help="bytes each block streams (MB): ~200 µs a launch")
    p.add_argument("--rings", default="8x24,16x12,24x8,32x6,48x4",
                   help="comma-separated SUBxNB: sub-tile KiB x buffers (at most ~227 KiB in all)")
    p.add_argument("--samples", type=int, default=20)
    args = p.parse_args()

    import torch

    from mdsl.backend.cuda import runtime
    from mdsl.backend.cuda.runtime import _check, driver

    runtime.require_gpu("the streaming probe")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [("loads (gemv)", 0, 0)] + [
        (f"ring {sub} KiB x {nb}", int(sub) * 1024, int(nb)) for sub, nb in (r.split("x") for r in args.rings.split(","))]
    per_block = int(args.mb_per_sm * 1e6) // (96 * 1024) * (96 * 1024)   # whole sub-tiles of 8-48 KiB
    copies = [torch.empty(per_block * sms, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(3)]
    sink = torch.zeros(512, dtype=torch.int32, device="cuda")
    print(f"{sms} blocks, {per_block / 1e6:.2f} MB each, {per_block * sms / 1e6:.0f} MB a launch")
    print("| path | µs a launch | TB/s | GB/s an SM |")
    print("|---|---:|---:|---:|")
    for label, sub, nb in configs:
        text = SOURCE % {"sub": sub or 16, "nb": nb or 1, "ring": 1 if sub else 0}
        cubin = runtime.compile_source(text, runtime.target_arch()).cubin
        module = _check(driver.cuModuleLoadData(cubin), "loading the probe")
        function = _check(driver.cuModuleGetFunction(module, b"probe"), "cuModuleGetFunction")
        smem = sub * nb
        if smem > 48 * 1024:
            _check(driver.cuFuncSetAttribute(
                function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                "allowing the probe its shared memory")
        times = []
        for k in range(args.samples + 3):
            src = ctypes.c_uint64(copies[k % 3].data_ptr())
            size = ctypes.c_int64(per_block)
            out = ctypes.c_uint64(sink.data_ptr())
            params = (ctypes.c_void_p * 3)(ctypes.addressof(src), ctypes.addressof(size), ctypes.addressof(out))
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _check(driver.cuLaunchKernel(function, sms, 1, 1, 288, 1, 1, smem,
                                         torch.cuda.current_stream().cuda_stream, ctypes.addressof(params), 0),
                   "launching the probe")
            stop.record()
            stop.synchronize()
            if k >= 3:
                times.append(start.elapsed_time(stop) * 1e3)
        us = statistics.median(times)
        print(f"| {label} | {us:.1f} | {per_block * sms / us / 1e6:.2f} | {per_block / us / 1e3:.1f} |", flush=True)
        driver.cuModuleUnload(module)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a staged tile's bulk copy costs the warps around it, one block per SM, every block at once (as
when the megakernel's workers stage a QKV tile each, 25 MB in all):

- *issue*: how long the issuing warp (the megakernel's scheduler warp) takes to issue the copy's 16 KB
  `cp.async.bulk` pieces, one per lane: the time before it can go on to poll the task's inputs;
- *landed*: from the first issue until the copy's mbarrier completes;
- *release*: how long one thread's `red.release.{gpu,sys}` (after a few global stores, as a task's
  signal follows its results) holds that thread, with and without the copy in flight;
- the same with the bytes prefetched into L2 (`cp.async.bulk.prefetch.L2`, the scheduler's head prefetch
  of a task's weights, issued while the task before runs) instead of copied: no mbarrier, so no
  *landed*.

The twelfth session's first run: a release holds its thread 0.34 µs (gpu) / 1.63 µs (sys) with nothing
in flight, 4-5.7 µs with a 128-192 KiB copy in flight. Without the L2 head prefetch one GPU ran Qwen3-8B
1.8% faster (its o-proj 1.9 µs a layer): the prefetch rows say whether a release waits for those too.

The eleventh session measured two effects that these isolate: with a QKV tile's copy issued just before
the down-proj's signals, the down-proj -> QKV hop grew from 3 to 8 µs (does a release wait for the SM's
copies in flight?), and with the copy issued after the signals, the QKV bodies still started ~1 µs
later (does issuing 12 bulk copies stall the scheduler warp?). Cycles are the SM clock's (clock64),
medians over the blocks of `--samples` launches.

    PYTHONPATH=. python3 benchmarks/copy_probe.py [--kib 64,128,192] [--prefetch-kib 96,192]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = {"gpu": 0, "sys": 1}   # the release's scope
# (per block: issue, landed and release cycles)
RESULTS = 3

SOURCE = r"""
constexpr int LAUNCH = 288, ISSUER = 8;   // warps 0-7 as the compute warps, warp 8 as the scheduler

__device__ __forceinline__ unsigned smem_address(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem_address(dst)), "l"(src), "r"(bytes), "r"(smem_address(b)) : "memory");
}
__device__ __forceinline__ bool landed(unsigned long long* b) {
  unsigned done;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(done) : "r"(smem_address(b)) : "memory");
  return done != 0;
}

// copy_bytes: 0 (nothing) or the tile's bytes; scope: 0 release.gpu, 1 release.sys; prefetch: the bytes go
// to L2 only (cp.async.bulk.prefetch.L2), not into shared memory
extern "C" __global__ void __launch_bounds__(LAUNCH, 1) probe(const char* src, int copy_bytes, int scope,
                                                              unsigned* results_out, unsigned* flags, float* rows,
                                                              int prefetch) {
  extern __shared__ __align__(128) char tile[];
  __shared__ unsigned long long full;
  unsigned long long* results = reinterpret_cast<unsigned long long*>(results_out) + blockIdx.x * 3;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_address(&full)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == ISSUER) {
    const long long t0 = clock64();
    if (copy_bytes > 0 && prefetch) {
      const char* mine = src + (long long)blockIdx.x * copy_bytes;
      for (int off = lane * 16384; off < copy_bytes; off += 32 * 16384)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                     :: "l"(mine + off), "r"(unsigned(copy_bytes - off < 16384 ? copy_bytes - off : 16384)) : "memory");
    } else if (copy_bytes > 0) {
      if (lane == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_address(&full)),
                     "r"(unsigned(copy_bytes)) : "memory");
      __syncwarp();
      const char* mine = src + (long long)blockIdx.x * copy_bytes;
      for (int off = lane * 16384; off < copy_bytes; off += 32 * 16384)
        bulk_copy(tile + off, mine + off, copy_bytes - off < 16384 ? copy_bytes - off : 16384, &full);
    }
    __syncwarp();
    const long long t1 = clock64();
    asm volatile("bar.arrive 1, 64;" ::: "memory");   // the copy is issued: thread 0 may signal
    if (copy_bytes > 0 && !prefetch) while (!landed(&full)) {}
    const long long t2 = clock64();
    if (lane == 0) { results[0] = t1 - t0; results[1] = t2 - t0; }
  } else if (warp == 0) {
    asm volatile("bar.sync 1, 64;" ::: "memory");
    // a task's results, then its signal (thread 0 after the compute barrier, as in the megakernel)
    rows[(long long)blockIdx.x * 32 + lane] = float(lane);
    __syncwarp();
    if (lane == 0) {
      const long long t3 = clock64();
      if (scope == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(flags + blockIdx.x) : "memory");
      else asm volatile("red.release.sys.global.add.u32 [%0], 1;" :: "l"(flags + blockIdx.x) : "memory");
      const long long t4 = clock64();
      results[2] = t4 - t3;
    }
  }
}
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kib", default="64,128,192", help="comma-separated copy sizes per block (KiB)")
    p.add_argument("--prefetch-kib", default="96,192",
                   help="comma-separated L2 prefetch sizes per block (KiB; the megakernel's default head: 96)")
    p.add_argument("--samples", type=int, default=10)
    args = p.parse_args()

    import torch

    from mdsl.backend.cuda import runtime
    from mdsl.backend.cuda.runtime import _check, driver

    runtime.require_gpu("the copy probe")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    device = _check(driver.cuDeviceGet(torch.cuda.current_device()), "cuDeviceGet")
    khz = _check(driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, device),
                 "reading the SM clock")
    sizes = [int(k) * 1024 for k in args.kib.split(",")]
    prefetch_sizes = [int(k) * 1024 for k in args.prefetch_kib.split(",") if k.strip()]
    largest = max(sizes + prefetch_sizes)
    copies = [torch.empty(largest * sms, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(3)]
    results = torch.zeros(sms * RESULTS, dtype=torch.int64, device="cuda")
    flags = torch.zeros(sms, dtype=torch.int32, device="cuda")
    rows = torch.zeros(sms * 32, dtype=torch.float32, device="cuda")
    cubin = runtime.compile_source(SOURCE, runtime.target_arch()).cubin
    module = _check(driver.cuModuleLoadData(cubin), "loading the probe")
    function = _check(driver.cuModuleGetFunction(module, b"probe"), "cuModuleGetFunction")
    _check(driver.cuFuncSetAttribute(function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     largest), "allowing the probe its shared memory")
    us = 1e3 / khz   # µs per cycle
    print(f"{sms} blocks at once, SM clock {khz / 1e3:.0f} MHz; medians over blocks and launches (µs)")
    print("| in flight per block | release | issue | landed | release held |")
    print("|---|---|---:|---:|---:|")
    runs = [(b, False) for b in [0] + sizes] + [(b, True) for b in prefetch_sizes]
    for copy_bytes, prefetch in runs:
        for scope, mode in MODES.items():
            samples = {"issue": [], "landed": [], "release": []}
            for k in range(args.samples + 2):
                src = ctypes.c_uint64(copies[k % 3].data_ptr())
                size, how = ctypes.c_int32(copy_bytes), ctypes.c_int32(mode)
                out, flag, row = (ctypes.c_uint64(t.data_ptr()) for t in (results, flags, rows))
                to_l2 = ctypes.c_int32(int(prefetch))
                params = (ctypes.c_void_p * 7)(*(ctypes.addressof(a) for a in (src, size, how, out, flag, row, to_l2)))
                _check(driver.cuLaunchKernel(function, sms, 1, 1, 288, 1, 1, largest,
                                             torch.cuda.current_stream().cuda_stream, ctypes.addressof(params), 0),
                       "launching the probe")
                torch.cuda.synchronize()
                if k >= 2:
                    cycles = results.view(sms, RESULTS).cpu().tolist()
                    for issue, land, release in cycles:
                        samples["issue"].append(issue * us)
                        samples["landed"].append(land * us)
                        samples["release"].append(release * us)
            med = {name: statistics.median(v) for name, v in samples.items()}
            label = (f"{copy_bytes // 1024} KiB " + ("L2 prefetch" if prefetch else "copy")) if copy_bytes else "none"
            landed = "-" if prefetch else f"{med['landed']:.2f}"
            print(f"| {label} | {scope} | {med['issue']:.2f} | {landed} | {med['release']:.2f} |", flush=True)
    driver.cuModuleUnload(module)
    return 0


if __name__ == "__main__":
    sys.exit(main())

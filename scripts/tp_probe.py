"""Check the tensor-parallel megakernel's transport on this host: NVSHMEM initialised over N GPUs (one
process each), symmetric buffers reachable by stores from every peer, and the latency of the
megakernel's put-with-signal (a block's stores into the peer's buffer, a release add on the peer's
counter, with or without a system-scope fence before it; the peer acquires and checks the data), and of
flagged words (each value with its round's flag in one 8-byte store, polled by the peer), as ping-pongs.

    python3 scripts/tp_probe.py --world 2                    # on a machine with 2 GPUs
    python3 scripts/tp_probe.py --world 2 --floats 32,2048   # each size under each mode
"""
from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KERNEL = r"""
// mode 0: the megakernel's put-with-signal (stores, then a release add on the peer's counter, cumulative
// over the block's stores after its barrier); mode 1: the same with an explicit system-scope fence first;
// mode 2: flagged words (value, round + 1), one relaxed system-scope store each, which the peer polls
extern "C" __global__ void ping_pong(float* mine, float* peer_data, unsigned* my_flag, unsigned* peer_flag,
                                     int rounds, int first, int n, int mode) {
  unsigned long long* my_words = reinterpret_cast<unsigned long long*>(mine + 2 * n + 2);
  unsigned long long* peer_words = reinterpret_cast<unsigned long long*>(peer_data + 2 * n + 2);
  for (int r = 0; r < rounds; ++r) {
    if ((r & 1) == first) {          // my turn: put n floats and signal
      if (mode == 2) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
          const unsigned long long w = (unsigned long long)(r + 1) << 32 | __float_as_uint(float(r * n + i));
          asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(peer_words + i), "l"(w) : "memory");
        }
      } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) peer_data[i] = float(r * n + i);
        __syncthreads();
        if (threadIdx.x == 0) {
          if (mode == 1) asm volatile("fence.acq_rel.sys;" ::: "memory");
          asm volatile("red.release.sys.global.add.u32 [%0], 1;" :: "l"(peer_flag) : "memory");
        }
      }
    } else if (mode == 2) {          // the peer's turn: each thread polls its words, then checks them
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        unsigned long long w;
        do { asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(w) : "l"(my_words + i) : "memory"); }
        while (unsigned(w >> 32) != unsigned(r + 1));
        if (__uint_as_float(unsigned(w)) != float(r * n + i)) mine[n] = 1.0f;
      }
    } else {                         // the peer's turn: wait for its signal, check its data
      if (threadIdx.x == 0) {
        unsigned seen;
        do { asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(seen) : "l"(my_flag) : "memory"); }
        while (seen < unsigned(r / 2 + 1));
      }
      __syncthreads();
      for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (mine[i] != float(r * n + i)) { mine[n] = 1.0f; }   // a wrong value: flag it
    }
    __syncthreads();
  }
}
"""


MODES = {"signal": 0, "fence-signal": 1, "flagged": 2}


def worker(rank: int, world: int, queue, results, rounds: int, sizes: list) -> None:
    from mdsl.backend.cuda import runtime
    from mdsl.backend.cuda.runtime import _check, driver
    from mdsl.megakernel.parallel import nvshmem

    try:
        runtime._device(rank)
        if rank == 0:
            uid = nvshmem.unique_id()
            for _ in range(world - 1):
                queue.put(uid)
        else:
            uid = queue.get(timeout=60)
        t0 = time.perf_counter()
        pe = nvshmem.init(rank, world, uid)
        init_s = time.perf_counter() - t0
        n_max = max(sizes)
        size = 4 * (4 * n_max + 4)      # data [n], the error flag, the words [n] (8 bytes each) after 2n + 2
        data = pe.malloc(size)
        flag = pe.malloc(64)
        peer = (rank + 1) % world
        peer_data, peer_flag = pe.peer_address(data, peer), pe.peer_address(flag, peer)
        module = runtime.compile_source(KERNEL, runtime.target_arch(rank))
        handle = _check(driver.cuModuleLoadData(module.cubin), "load")
        function = _check(driver.cuModuleGetFunction(handle, b"ping_pong"), "function")
        report = {"init_s": round(init_s, 3), "peer_data": hex(peer_data), "local": hex(data), "data_ok": True}
        for n in sizes:
            for name, mode in MODES.items():
                _check(driver.cuMemsetD8(data, 0, size), "memset")
                _check(driver.cuMemsetD8(flag, 0, 64), "memset")
                _check(driver.cuCtxSynchronize(), "sync")
                pe.barrier()
                args = [ctypes.c_uint64(data), ctypes.c_uint64(peer_data), ctypes.c_uint64(flag),
                        ctypes.c_uint64(peer_flag), ctypes.c_int(rounds), ctypes.c_int(rank % 2), ctypes.c_int(n),
                        ctypes.c_int(mode)]
                pointers = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
                start, end = (_check(driver.cuEventCreate(0), "event") for _ in range(2))
                _check(driver.cuEventRecord(start, 0), "record")
                _check(driver.cuLaunchKernel(function, 1, 1, 1, 256, 1, 1, 0, 0, ctypes.addressof(pointers), 0),
                       "launch")
                _check(driver.cuEventRecord(end, 0), "record")
                _check(driver.cuCtxSynchronize(), "sync")
                ms = _check(driver.cuEventElapsedTime(start, end), "elapsed")
                error = (ctypes.c_float * 1)()
                _check(driver.cuMemcpyDtoH(error, data + 4 * n, 4), "copy")
                report[f"{name} {4 * n} B one_way_us"] = round(ms * 1e3 / rounds, 3)
                report["data_ok"] = report["data_ok"] and error[0] == 0.0
                pe.barrier()
        results.put((rank, report))
        pe.close()
    except Exception as e:  # reported by the parent
        results.put((rank, {"error": f"{type(e).__name__}: {e}"}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--floats", default="32,2048",
                    help="floats per put, comma-separated (32: a tile's partials; 2048: 8 KiB)")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    sizes = [int(n) for n in args.floats.split(",")]
    procs = [ctx.Process(target=worker, args=(r, args.world, queue, results, args.rounds, sizes))
             for r in range(args.world)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        try:
            rank, info = results.get(timeout=180)
        except Exception:
            break
        got[rank] = info
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    for rank in range(args.world):
        print(f"rank {rank}: {got.get(rank, 'no report (hung or crashed)')}")
    ok = len(got) == args.world and all(i.get("data_ok") for i in got.values())
    print("transport OK" if ok else "transport FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

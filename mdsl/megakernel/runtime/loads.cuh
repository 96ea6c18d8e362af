// Weight loads and the copies that run ahead of a task: 16-byte loads past L1 (the weights are read-only for
// the whole launch), and cp.async copies into shared memory, in flight without registers: an early task's
// second pass of weight loads (EARLY_PASSES > 1) and attention's preloaded key and value rows (ATTN_PRELOAD).
// Part of device.cu (kernel_source.py expands it in place).

namespace mk {

__device__ __forceinline__ uint4 ld_weights(const T* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ unsigned shared_address(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }
// 16 bytes of shared memory at `address` (volatile: not hoisted above the wait for what fills them)
__device__ __forceinline__ uint4 ld_shared16(unsigned address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
  return v;
}

// ---- cp.async: 16 bytes a thread, complete for that thread at copies_wait.
// An early task's next pass (EARLY_PASSES > 1, source.py): once its inputs are there and its row's loads
// issued, each compute thread copies the 16-byte chunks of its warp's next pass of weight loads into its own
// slots of the early buffer while the row is normalised and the first pass multiplied, and reads them back
// itself once the pass comes (no barrier: a thread reads only what it copied). Slot k of thread i is 16 bytes
// at (k * NT + i) * 16: a warp's 32 lanes write and read 512 consecutive bytes.
extern __shared__ __align__(16) unsigned char dynamic_smem[];
__device__ __forceinline__ unsigned early_slot(int k) {
  return shared_address(dynamic_smem) + unsigned(EARLY_OFFSET + (k * NT + int(threadIdx.x)) * 16);
}
__device__ __forceinline__ void copy_async(unsigned slot, const T* p) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(slot), "l"(p) : "memory");
}
__device__ __forceinline__ void copies_wait() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}
// ---- the bulk copy engine (TMA, 1-D): `bytes` contiguous bytes (16-byte aligned, a multiple of 16) from global
// into shared memory by one instruction, complete when the mbarrier at `bar` has seen them land (its phase
// then flips). Attention's streamed rows (ATTN_STREAM): one per ring stage, issued by one thread.
__device__ __forceinline__ void barrier_init(unsigned bar) {   // one arrival a phase: the issuing thread's
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
}
// the barrier inits visible to the bulk copy engine, and this block's earlier writes of shared memory through the
// generic proxy (other tasks' use of the same bytes) ordered before the engine's writes
__device__ __forceinline__ void bulk_fences() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ bool barrier_try(unsigned bar, unsigned parity) {
  unsigned done;
  asm volatile("{\n"
               "  .reg .pred p;\n"
               "  mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
               "  selp.u32 %0, 1, 0, p;\n"
               "}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
// a copy that never lands (a protocol error) fails the launch after some seconds instead of hanging the GPU
__device__ __forceinline__ void barrier_wait(unsigned bar, unsigned parity) {
  for (unsigned polls = 0; !barrier_try(bar, parity); ++polls)
    if (polls == (1u << 26)) __trap();
}

// ---- early tasks: the scheduler hands the task of an early kind (EARLY_KINDS: every kind with weight rows,
// and attention when its rows are preloaded or streamed) to the compute warps before its inputs are complete; they issue
// its first weight loads (or copies), then wait on the slot's ready barrier, `ready` (0: a task whose inputs
// were complete when it was handed over), before they read its inputs.
#if MK_MOE
// (and a mixture of experts' router; not its experts' tasks, whose weights are those the routing picks)
constexpr int EARLY_KINDS = (1 << KIND_QKV) | (1 << KIND_OPROJ) | (1 << KIND_GATEUP) | (1 << KIND_DOWN) |
                            (1 << KIND_LMHEAD) | (ATTN_PRELOAD || ATTN_STREAM > 0 ? 1 << KIND_ATTN : 0) |
                            (1 << KIND_ROUTER);
#else
constexpr int EARLY_KINDS = (1 << KIND_QKV) | (1 << KIND_OPROJ) | (1 << KIND_GATEUP) | (1 << KIND_DOWN) |
                            (1 << KIND_LMHEAD) | (ATTN_PRELOAD || ATTN_STREAM > 0 ? 1 << KIND_ATTN : 0);
#endif
__device__ __forceinline__ void wait_inputs(int ready) {
  if (ready != 0) named_sync(ready, BLOCK);
}

}  // namespace mk

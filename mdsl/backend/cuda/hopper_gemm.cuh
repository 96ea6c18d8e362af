// Hopper GEMM tiles: C[M, N] = A[M, K] W[N, K]^T on wgmma and TMA (sm_90a), 16-bit operands, f32 sums.
//
// Both operands are K-major, as callers hold them: activations row-major [M, K], weights as checkpoints store
// an nn.Linear's, [N, K]. A block computes one BM x BN tile of C with three warpgroups:
// * warpgroup 0, the producer: one thread walks K in BK-wide steps, loading each step's A tile (BM x BK) and
//   W tile (BN x BK) with TMA (cp.async.bulk.tensor.2d, 128-byte swizzle) into a ring of STAGES stages; a
//   stage's `full` mbarrier completes when its bytes have landed, its `empty` mbarrier when both consumers
//   are done reading it.
// * warpgroups 1 and 2, the consumers: 64 rows of the tile each, their 64 x BN f32 sums in registers
//   (BN / 2 a thread), four wgmma.mma_async m64nBNk16 a stage, reading both operands from shared memory
//   through matrix descriptors. A consumer keeps one stage's wgmmas in flight while it waits for the next
//   stage, and frees a stage once the wgmmas that read it are done (wgmma.wait_group 1).
// TMA fills the rows and columns past M, N and K with zeros, so ragged shapes need no masking until the
// epilogue's stores. The 128-byte swizzle TMA writes is the one the descriptors name: rows of BK = 64
// 16-bit elements (128 bytes), the 16-byte chunks of row r XOR-permuted by r % 8, tiles 1024-byte aligned.
//
// `GemmTile` is the building block (shared-memory ring, producer, consumer, fragment walk); the standalone
// kernel (`gemm_kernel`) runs one tile a block and stores it through `StoreEpilogue` (+ bias, + residual).
// The wgmma instructions themselves (`Wgmma<E, N>`, one asm statement with N / 2 accumulator operands) are
// written out by hopper_gemm.py where the marker below stands.

namespace mdsl {
namespace hopper {

// a TMA descriptor as cuTensorMapEncodeTiled writes it: 128 opaque bytes, 64-byte aligned
struct alignas(64) TensorMap { unsigned long long opaque[16]; };

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ---- mbarriers (shared::cta addresses)
__device__ __forceinline__ void barrier_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// makes initialized mbarriers visible to the async proxy (TMA's complete_tx) and to the other threads
__device__ __forceinline__ void barrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void barrier_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// one arrival that also expects `bytes` of TMA transactions before the phase completes
__device__ __forceinline__ void barrier_expect_bytes(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// waits until the phase of parity `parity` has completed (try_wait suspends for a while before it fails); a
// wait of 2^30 failed tries (tens of seconds) never ends: it traps, so that the launch fails instead of hanging
__device__ __forceinline__ void barrier_wait(unsigned bar, unsigned parity) {
  unsigned done, tries = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    if (++tries == (1u << 30)) __trap();
  } while (!done);
}

// ---- TMA: the box at (inner, outer) elements of `map`'s tensor into shared memory at `dst`, counted on `bar`
__device__ __forceinline__ void tma_load(unsigned dst, const TensorMap* map, unsigned bar, int inner, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(inner), "r"(outer)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// ---- wgmma
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// setmaxnreg: the registers a thread of this warpgroup holds from here on (a multiple of 8, 24 .. 256), given
// back to the block's pool (`registers_down`) or taken from it (`registers_up`, which waits until the pool has
// them); the kernel's own count (its launch bounds') is where every warpgroup starts
template <int N> __device__ __forceinline__ void registers_down() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N> __device__ __forceinline__ void registers_up() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
// pins the accumulators between the asynchronous wgmmas and the code around them: the compiler may not move
// their reads or writes across this point (the wgmma asm alone does not tell it when the hardware writes them)
template <int R> __device__ __forceinline__ void fence_registers(float (&acc)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// the descriptor of a K-major operand tile in 128-byte swizzled rows, as TMA writes it: start address >> 4
// (bits 0-13), leading byte offset 16 >> 4 (bits 16-29; unused where a k16 step stays inside one swizzled row),
// stride byte offset 1024 >> 4 (bits 32-45: from one 8-row group to the next), swizzle mode 1 = 128 bytes
// (bits 62-63). The base offset (bits 49-51) is 0: tiles are 1024-byte aligned. The swizzle acts on address
// bits, so the k16 step j of a stage starts 32 j bytes in: the descriptor plus 2 j.
constexpr __device__ __forceinline__ unsigned long long descriptor(unsigned address) {
  return static_cast<unsigned long long>((address & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

template <typename E, int N> struct Wgmma;
// wgmma instructions: generated by hopper_gemm.py

// ---- the tile: BM x BN of C over all of K, by one producer thread and CONSUMERS warpgroups
template <typename E, int BN_>
struct GemmTile {
  static constexpr int BM = 128, BN = BN_, BK = 64, CONSUMERS = 2;
  static constexpr int THREADS = 128 * (1 + CONSUMERS);
  static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int STAGES = 204800 / STAGE_BYTES;   // 200 KiB of stages: 4 of BN 256, 5 of 192, 6 of 128
  static constexpr int BARRIERS = 2 * STAGES * 8;
  // + 1024: the dynamic shared memory's start is rounded up to the swizzle's 1024-byte period
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + BARRIERS + 1024;
  static constexpr int ACC = BN / 2;                     // f32 sums a consumer thread holds (64 x BN / 128)
  static_assert(BN % 64 == 0 && BN <= 256, "BN: 128, 192 or 256 (one wgmma covers the tile's columns)");
  static_assert(A_BYTES % 1024 == 0 && B_BYTES % 1024 == 0, "tiles keep the 1024-byte swizzle alignment");

  // where a producer or consumer is in the ring; both start at stage 0 of phase 0 and step alike
  struct Ring {
    int stage = 0;
    unsigned phase = 0;
    __device__ __forceinline__ void next() {
      if (++stage == STAGES) stage = 0, phase ^= 1;
    }
  };

  unsigned base;   // shared address of stage 0: STAGES x (A tile, W tile), then the full and empty barriers

  __device__ static GemmTile at(unsigned char* smem) {
    return GemmTile{(smem_address(smem) + 1023u) & ~1023u};
  }
  __device__ __forceinline__ unsigned a_tile(int s) const { return base + s * STAGE_BYTES; }
  __device__ __forceinline__ unsigned w_tile(int s) const { return base + s * STAGE_BYTES + A_BYTES; }
  __device__ __forceinline__ unsigned full(int s) const { return base + STAGES * STAGE_BYTES + 8 * s; }
  __device__ __forceinline__ unsigned empty(int s) const { return full(s) + 8 * STAGES; }

  // by one thread, before a barrier of the whole block
  __device__ void init() const {
    for (int s = 0; s < STAGES; ++s) {
      barrier_init(full(s), 1);               // the producer's arrival, with the stage's TMA bytes
      barrier_init(empty(s), CONSUMERS * 4);  // each consumer warp, once its wgmmas have read the stage
    }
    barrier_init_fence();
  }

  // by one thread: k_tiles steps of the tile at (m0, n0), each into the next stage once it is free (the
  // producer's first pass waits for the phase before 0, which a fresh barrier counts as complete)
  __device__ void produce(const TensorMap* a, const TensorMap* w, int m0, int n0, int k_tiles, Ring& ring) const {
    for (int kt = 0; kt < k_tiles; ++kt) {
      barrier_wait(empty(ring.stage), ring.phase ^ 1);
      barrier_expect_bytes(full(ring.stage), STAGE_BYTES);   // out-of-bounds zeros count: the whole box lands
      tma_load(a_tile(ring.stage), a, full(ring.stage), kt * BK, m0);
      tma_load(w_tile(ring.stage), w, full(ring.stage), kt * BK, n0);
      ring.next();
    }
  }

  // by the 128 threads of consumer warpgroup `consumer`: acc = its 64 rows of the tile, summed over k_tiles steps
  __device__ void consume(float (&acc)[ACC], int consumer, int k_tiles, Ring& ring) const {
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.0f;
    const unsigned rows = consumer * 64 * BK * 2;   // this warpgroup's 64 rows of the A tile
    const bool signals = threadIdx.x % 32 == 0;
    int previous = 0;
    for (int kt = 0; kt < k_tiles; ++kt) {
      barrier_wait(full(ring.stage), ring.phase);
      const unsigned long long da = descriptor(a_tile(ring.stage) + rows), dw = descriptor(w_tile(ring.stage));
      fence_registers(acc);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < BK / 16; ++j) Wgmma<E, BN>::mma(acc, da + 2 * j, dw + 2 * j);
      wgmma_commit();
      fence_registers(acc);
      if (kt > 0) {   // the previous stage's wgmmas are done once at most this stage's are in flight
        wgmma_wait<1>();
        fence_registers(acc);
        if (signals) barrier_arrive(empty(previous));
      }
      previous = ring.stage;
      ring.next();
    }
    wgmma_wait<0>();
    fence_registers(acc);
    if (k_tiles > 0 && signals) barrier_arrive(empty(previous));
  }

  // f(row, col, v0, v1) for each pair of adjacent columns a consumer thread holds, row and col in the tile:
  // wgmma's f32 layout, per 8-column group j, thread (warp w, g = lane / 4, q = lane % 4) holds rows
  // 16 w + g and 16 w + g + 8 of columns 8 j + 2 q and 8 j + 2 q + 1
  template <typename F> __device__ __forceinline__ static void each(const float (&acc)[ACC], int consumer, F f) {
    const int t = threadIdx.x % 128, lane = t % 32;
    const int row = consumer * 64 + (t / 32) * 16 + lane / 4, col = 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      f(row, 8 * j + col, acc[4 * j], acc[4 * j + 1]);
      f(row + 8, 8 * j + col, acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
};

// ---- the standalone kernel's epilogue: C = A W^T (+ bias[col]) (+ residual), rounded once to TC, stored
// where inside M x N; bias (E, length N) and residual (TC, M x N like C, may be C itself) are optional
template <typename E, typename TC>
struct StoreEpilogue {
  TC* c;
  const E* bias;
  const TC* residual;
  int m, n;

  // a pair of adjacent columns; FUSED: adds the bias and the residual where given
  template <bool FUSED> __device__ __forceinline__ void store(int row, int col, float v0, float v1) const {
    if (row >= m || col >= n) return;
    const long long at = static_cast<long long>(row) * n + col;
    const bool pair = col + 1 < n;
    if (FUSED) {
      if (bias != nullptr) v0 += to_float(bias[col]), v1 += pair ? to_float(bias[col + 1]) : 0.0f;
      if (residual != nullptr) v0 += to_float(residual[at]), v1 += pair ? to_float(residual[at + 1]) : 0.0f;
    }
    if (pair && n % 2 == 0) {   // an even row length keeps every pair aligned to its size
      if constexpr (Same<TC, float>::value) {
        *reinterpret_cast<float2*>(c + at) = make_float2(v0, v1);
      } else {
        TC both[2] = {from_float<TC>(v0), from_float<TC>(v1)};
        *reinterpret_cast<unsigned*>(c + at) = *reinterpret_cast<const unsigned*>(both);
      }
    } else {
      c[at] = from_float<TC>(v0);
      if (pair) c[at + 1] = from_float<TC>(v1);
    }
  }
};

// one BM x BN tile of C a block: blockIdx.x walks M (the blocks that run together share W's tile, read once
// from device memory, while A stays in L2), blockIdx.y walks N
template <typename E, typename TC, int BN>
__device__ __forceinline__ void gemm_kernel(unsigned char* smem, const TensorMap* a, const TensorMap* w, TC* c,
                                            const E* bias, const TC* residual, int m, int n, int k) {
  using Tile = GemmTile<E, BN>;
  const Tile tile = Tile::at(smem);
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    tile.init();
    tma_prefetch(a);
    tma_prefetch(w);
  }
  __syncthreads();
  const int m0 = blockIdx.x * Tile::BM, n0 = blockIdx.y * BN, k_tiles = (k + Tile::BK - 1) / Tile::BK;
  typename Tile::Ring ring;
  if (warpgroup == 0) {   // the producer's other 127 threads have nothing to do
    if (threadIdx.x == 0) tile.produce(a, w, m0, n0, k_tiles, ring);
    return;
  }
  float acc[Tile::ACC];
  tile.consume(acc, warpgroup - 1, k_tiles, ring);
  const StoreEpilogue<E, TC> out{c, bias, residual, m, n};
  if (bias == nullptr && residual == nullptr) {   // the plain product's stores, without the fused loads' code
    Tile::each(acc, warpgroup - 1,
               [&](int r, int col, float v0, float v1) { out.template store<false>(m0 + r, n0 + col, v0, v1); });
  } else {
    Tile::each(acc, warpgroup - 1,
               [&](int r, int col, float v0, float v1) { out.template store<true>(m0 + r, n0 + col, v0, v1); });
  }
}

}  // namespace hopper
}  // namespace mdsl

// The GPU serving device's linear on Hopper's tensor cores (sm_90a): out[r, offset + c] = sum_k x[r, k] w[c, k]
// (+ residual[r, offset + c]) for the columns c of up to MAX_PARTS weights side by side, with wgmma and TMA
// (mdsl/backend/cuda/hopper_gemm.cuh's mbarriers, tensor-map loads, descriptors and fences).
//
// The weights are wgmma's A operand (64 output columns a consumer warpgroup, 128 a block) and the step's rows
// its B operand (RN rows a block: 8 for a decode step of one row, up to 128), so a step of few rows computes
// few padded products. Each float32 input value is rounded to W as it is staged (step_kernels.cu's
// `operand`: the linear's input as every kernel of it reads it), one wgmma a k16 step.
//
// Batch invariance: a row's sums are the same sequence of wgmmas over k whatever RN, the row's place in its
// tile and the other rows (wgmma's f32 sums of one output do not depend on the instruction's n, nor on the
// row's position: checked on the H200 by tests/gpu/test_gpu_serving_wgmma.py); k splits into `splits`
// contiguous ranges of 64-wide k steps by the weights alone (the host's wgmma_splits), each summed from zero,
// and the splits' sums are added in split order. A tile's splits run in `blocks` blocks (grid z, the host's
// split_blocks), each a run of consecutive splits: every split in a block of its own at one row tile (the
// weights' bytes bound the step), one block past it (many rows: the host's launch_shape gives the grid its
// blocks by the row tile). The first block adds its splits' sums as each ends (a
// running total in registers: the prefix of the split-order additions) and writes that total; every other
// block writes each split's sums (a float cannot be added ahead of the splits before it); the tile's last
// block to finish adds those partials in order. One block writes no partials. The same f32 additions
// whatever the blocks.
//
// Gated (act >= 0): the linear of a gate|up pair of equal weights whose only reader is act_mul, out[r, c] =
// act(x[r] . gate[c]) * (x[r] . up[c]) (activations.cuh's `gated`, the act_mul kernel's arithmetic): a block's
// 128 weight rows are 64 of the gate (the first consumer warpgroup's) and the same 64 of the up weight (the
// second's), two TMA loads a stage of 64-row boxes, so a thread of each holds the same outputs' sums; the
// second hands its sums to the first through shared memory, which writes the products. The gate and up sums
// are the plain linear's (the same k splits: by the plain launch's tiles), and the [rows, 2 x half] values
// between the linear and act_mul are never written. With `handed` the products go there instead, rounded to W:
// the rows the next linear, which alone reads them, loads by TMA (gpu_wgmma.py's handed rows: its round_rows
// launch, and the float32 rows, skipped).
//
// An rms_norm's two ends (row_norms.cuh, gpu.py's norm_squares): with `squares` the launch writes each output
// row's sum of squares of its 128-column tile beside the rows (a residual sum that a norm reads next), and with
// a Norm the producer normalises the float32 rows it stages (the norm's input, below the host's NORMED_ROWS)
// from their tiles' sums, so that the norm runs no kernel of its own.
//
// Grid: (row tiles, weight tiles, split blocks), the row tiles fastest, so that the blocks of one weight tile
// run together and its bytes come from memory once a step, not once a row tile.
//
// A block: a producer warpgroup and two consumer warpgroups (64 weight columns each). For each 64-wide k
// step the producer's first thread loads the weight tile (128 x 64) with TMA, which fills columns past the
// weight's rows and k past its width with zeros, into a ring of stages, and the rows' tile (RN x 64)
// comes beside it, rounded to W, by TMA where the rows are in memory rounded: handed over by the op before
// (gpu_wgmma.py's `hand`: a norm, attention or a gated linear writes its rows rounded for this launch), or
// from 64 rows written by `round_rows` beforehand (staging 128 rows by the producer's threads is slower than
// the tensor cores); else, up to 32 rows, the producer's 128 threads round and store them in the 128-byte
// swizzled layout TMA writes (no launch before the linear's, which a decode step would pay in every linear).

namespace mdsl {
namespace serve_tc {

using namespace mdsl::hopper;

constexpr int MAX_PARTS = 4;
constexpr int FEATURES = 128;   // output columns a block: 64 a consumer warpgroup
constexpr int HALF = FEATURES / 2;   // ... of each weight, gated
constexpr int BK = 64;          // k a stage: one 128-byte swizzled row of 16-bit values
constexpr int THREADS = 384;
constexpr int STAGE_SPACE = 196608;   // shared memory for a block's stages, one block an SM
constexpr int PAIRED_SPACE = 113664;  // ... two blocks an SM (each block's 1 KB reserve and alignment slack left)

// the weights' tensor maps and where each weight's columns go: part i's columns are output columns
// start[i] .. start[i + 1] - 1 and blocks (x) tile[i] .. tile[i + 1] - 1; tile[MAX_PARTS] is every tile's count
struct WeightMaps {
  TensorMap map[MAX_PARTS];
};
struct Parts {
  int start[MAX_PARTS + 1];
  int tile[MAX_PARTS + 1];
  int count;
};
// the rms_norm of the rows, where the launch runs it (gpu.py's norm_squares: below NORMED_ROWS rows, the norm's
// input rows x staged by the producer): each row's tiles' sums of squares (`squares`, [rows][k / 128], written
// by the linear that wrote x) and the norm's weights `w` (W), eps and whether it scales by 1 + w; squares null:
// the rows as they are
struct Norm {
  const float* squares;
  const void* w;
  float eps;
  int one_plus;
};

// x rounded to W: grid (rows, blocks a row), one row of k values a blockIdx.x
template <typename W>
__device__ __forceinline__ void round_rows(W* rounded, const float* x, int k) {
  const long long base = static_cast<long long>(blockIdx.x) * k;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < k; i += gridDim.y * blockDim.x)
    rounded[base + i] = from_float<W>(x[base + i]);
}

// BLOCKS: the blocks an SM holds. Two where a step holds one row tile: its weights' bytes bound it, and two
// blocks an SM keep its splits (2 x SMs blocks at most: the host's wgmma_splits) in one wave, half the shared
// memory each; one past it (the host's launch_shape), where a block runs its tile's splits one after another
template <int RN, int BLOCKS> struct Ring {
  static constexpr bool TMA_ROWS = RN >= 64;   // the rows' tiles always loaded by TMA (below: where handed)
  static constexpr bool PAIRED = BLOCKS == 2;
  static_assert(BLOCKS == 2 || (BLOCKS == 1 && TMA_ROWS), "one block an SM from TMA_ROWS rows, else two");
  static constexpr int W_BYTES = FEATURES * BK * 2, X_BYTES = RN * BK * 2;
  static constexpr int STAGE_BYTES = W_BYTES + X_BYTES;
  // as many stages as fit the block's share of shared memory (8 at most): at 128 rows a stage's wgmmas take
  // about 0.26 us at the tensor cores' peak, 512 cycles, and only several stages in flight cover a load from
  // memory
  static constexpr int SPACE = PAIRED ? PAIRED_SPACE : STAGE_SPACE;
  // below TMA_ROWS rows, a ring of FLOATS slots where the producer's threads copy (cp.async) the float32 rows
  // and the norm's weights a stage needs, FLOATS - 1 stages ahead of rounding them into the stage: a copy's
  // latency (an L2 one, while every SM streams weights) paid once a stage would bound a block's run of k
  // steps, where the weights' bytes should
  static constexpr int FLOATS = TMA_ROWS ? 0 : 3;
  static constexpr int FLOAT_BYTES = RN * BK * 4 + 4 * 128;   // a slot: the rows' tile, each warp's 64 weights
  static constexpr int STAGES = (SPACE - FLOATS * FLOAT_BYTES) / STAGE_BYTES < 8
                                    ? (SPACE - FLOATS * FLOAT_BYTES) / STAGE_BYTES : 8;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + FLOATS * FLOAT_BYTES + 16 * STAGES + 1024;
  static constexpr int ACC = RN / 2;   // f32 sums a consumer thread holds (64 x RN / 128)
  // a block alone on its SM runs a tile's k splits one after another (a step of several row tiles), the
  // running total of their sums in registers beside the accumulators (in shared memory at 128 rows it would
  // take two of six stages' space, and each split's end would read and write 128 KB of it; in the 80
  // registers of a paired block some would spill, the 168 of a block alone hold them). The producer
  // warpgroup, whose one thread issues TMA loads, gives registers to the consumers (setmaxnreg), each
  // warpgroup back at the kernel's count before the split fold that all of them run; ptxas allocates within
  // the kernel's count whatever setmaxnreg says (the same registers and no spills without it)
  static constexpr int REGISTERS = 65536 / (3 * 128) / 8 * 8;   // the kernel's count (one block an SM): 168
  // a run of splits in two sets of sums taken in turn, each split's set folded into the total while the next
  // split's first wgmmas run (no drain of the pipeline at a split's end), where three sets fit the registers
  static constexpr bool TWO_SETS = !PAIRED && 3 * ACC + 48 <= REGISTERS;
  static constexpr int PRODUCER_REGISTERS = 56, CONSUMER_REGISTERS = 224;
  static_assert(PAIRED || PRODUCER_REGISTERS + 2 * CONSUMER_REGISTERS <= 3 * REGISTERS, "the block's registers");
  static_assert(RN % 8 == 0 && RN <= 256 && X_BYTES % 1024 == 0, "RN: a multiple of 8 rows, 1024-byte tiles");

  unsigned base;
  __device__ __forceinline__ unsigned w_tile(int s) const { return base + s * STAGE_BYTES; }
  __device__ __forceinline__ unsigned x_tile(int s) const { return w_tile(s) + W_BYTES; }
  __device__ __forceinline__ unsigned floats(int i) const { return base + STAGES * STAGE_BYTES + i * FLOAT_BYTES; }
  __device__ __forceinline__ unsigned full(int s) const { return floats(FLOATS) + 8 * s; }
  __device__ __forceinline__ unsigned empty(int s) const { return full(s) + 8 * STAGES; }
};

// the consumer warpgroups' (threads 128 .. 383) barrier: the producer's warpgroup does not wait on it
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

__device__ __forceinline__ void store_shared(unsigned address, uint2 v) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(address), "r"(v.x), "r"(v.y) : "memory");
}

__device__ __forceinline__ void cp_async(unsigned smem, const void* global, bool live) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(global), "r"(live ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async8(unsigned smem, const void* global, bool live) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(smem), "l"(global), "r"(live ? 8 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// a producer thread's share of one stage's rows (RN x 64 values of x as float4s, float4 f of the tile to
// thread f % 128: a warp's copies cover whole 128-byte lines, so that the blocks, which all read the same rows
// at about the same time, ask the L2 for each line as few times as possible). A thread's float4s are all of
// one group of 4 columns (128 threads, 16 float4s a row), so that the 4 norm weights of those columns serve
// them all: a warp's first 16 lanes copy the stage's 64 weights, which its lanes read after a __syncwarp.
// Otherwise each thread reads back only what it copied itself: no barrier between the producer's warps.
template <int RN> struct StagedRows {
  static constexpr int VECS = RN * BK / 4, PER = (VECS + 127) / 128;
  static constexpr int WEIGHTS = RN * BK * 4;   // the slot's weights, 128 bytes a warp

  // copies rows r0 .. r0 + RN - 1 of x, k k0 .. k0 + 63 (zeros past the step's rows and past k: k is a
  // multiple of 32, so a float4 lies wholly inside or outside it), and where `w` (the norm's weights, W) the
  // weights of its columns (a warp's first 16 lanes), into the slot at `slot`; one cp.async group
  template <typename W>
  static __device__ __forceinline__ void copy(unsigned slot, const float* x, const W* w, int r0, int rows, int k0,
                                              int k) {
    const int kk = k0 + 4 * (threadIdx.x % (BK / 4));
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int f = threadIdx.x + 128 * i, r = f / (BK / 4);
      const bool live = r0 + r < rows && kk < k;
      if (f < VECS) cp_async(slot + 16 * f, live ? x + static_cast<long long>(r0 + r) * k + kk : x, live);
    }
    if (w && threadIdx.x % 32 < BK / 4)
      cp_async8(slot + WEIGHTS + 128 * (threadIdx.x / 32) + 8 * (threadIdx.x % 32), kk < k ? w + kk : w, kk < k);
    cp_async_commit();
  }

  // the slot's rows rounded to W into an RN x 64 tile: row r's 16-byte chunk c (8 values) at r * 128 +
  // 16 (c ^ r % 8), TMA's 128-byte swizzle; a float4 is half a chunk. `inverse` (shared memory, a float a row of
  // the tile), where the rows are normalised: each value first becomes the norm's (row_norms.cuh's `normed`) of
  // its row's inverse
  template <typename W>
  static __device__ __forceinline__ void store(unsigned tile, unsigned slot, const float* inverse, int one_plus) {
    uint2 scale = make_uint2(0u, 0u);
    if (inverse) {
      __syncwarp();   // (the warp's copied weights, each lane's copy complete: cp.async.wait_group)
      asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(scale.x), "=r"(scale.y)
                   : "r"(slot + WEIGHTS + 128 * (threadIdx.x / 32) + 8 * (threadIdx.x % (BK / 4))) : "memory");
    }
    const W* const w = reinterpret_cast<const W*>(&scale);
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int f = threadIdx.x + 128 * i, r = f / (BK / 4), q = f % (BK / 4);
      if (f >= VECS) break;
      float4 x;
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
                   : "r"(slot + 16 * f) : "memory");
      if (inverse) {
        const float inv = inverse[r];
        x = make_float4(mdsl_norm::normed(x.x, inv, to_float(w[0]), one_plus),
                        mdsl_norm::normed(x.y, inv, to_float(w[1]), one_plus),
                        mdsl_norm::normed(x.z, inv, to_float(w[2]), one_plus),
                        mdsl_norm::normed(x.w, inv, to_float(w[3]), one_plus));
      }
      __align__(8) W h[4] = {from_float<W>(x.x), from_float<W>(x.y), from_float<W>(x.z), from_float<W>(x.w)};
      store_shared(tile + r * 128 + 16 * ((q / 2) ^ (r % 8)) + 8 * (q % 2), *reinterpret_cast<const uint2*>(h));
    }
    // the generic proxy's stores made visible to wgmma's reads (the async proxy) before the stage is full
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
};

// The splits' partials of one tile (rows r0 .., the tile's FEATURES columns of each row's `width` partials)
// summed in split order and written from output column `first_out` on (`cols` of the tile's columns lie in
// the weight), with the residual added, or gated: the tile's first HALF columns (the gate's) and last HALF
// (the up's) taken together into `act`'s products. Each thread holds float4s of 4 columns of the written
// ones, VECS / THREADS or so: every load of one split in flight before any is added (the splits one after
// another would wait out an L2 latency per value). With `squares`, each row's sum of squares of the tile's
// columns goes to squares[row][first_out / 128] (row_norms.cuh: a warp holds a row's 128 columns, lane l
// columns 4l .. 4l + 3, the layout of tile_squares).
template <typename W, int RN, bool GATED>
__device__ __forceinline__ void fold_splits(float* out, W* handed, const float* part, const float* residual, int rows,
                                            int width, int splits, int r0, int cols, long long first_out,
                                            int out_width, int act, float* squares) {
  constexpr int COLS = GATED ? HALF : FEATURES;   // the tile's written columns
  constexpr int SOURCES = GATED ? 2 : 1;          // ... each the sum of these partial columns (gate, up)
  constexpr int VECS = RN * COLS / 4, PER = (VECS + THREADS - 1) / THREADS;
  constexpr int ROWS_APART = THREADS * 4 / COLS;   // between a thread's consecutive float4s
  const long long step = static_cast<long long>(rows) * width;
  // thread t's i-th float4: row r0 + t / (COLS / 4) + ROWS_APART i, columns 4 (t % (COLS / 4)) .. + 3 of the
  // written ones (recomputed where used: registers for every offset beside the sums spill at RN = 64)
  const int r1 = r0 + threadIdx.x / (COLS / 4), cc = 4 * (threadIdx.x % (COLS / 4));
  const float* const first = part + static_cast<long long>(r1) * width + blockIdx.y * FEATURES + cc;
  auto held = [&](int i) { return threadIdx.x + i * THREADS < VECS && r1 + ROWS_APART * i < rows; };
  auto at = [&](int i, int source) { return static_cast<long long>(ROWS_APART * i) * width + source * HALF; };
  float4 total[SOURCES][PER];
#pragma unroll
  for (int u = 0; u < SOURCES; ++u)
#pragma unroll
    for (int i = 0; i < PER; ++i)
      total[u][i] = held(i) ? __ldcg(reinterpret_cast<const float4*>(first + at(i, u))) : make_float4(0, 0, 0, 0);
  for (int v = 1; v < splits; ++v) {
    float4 more[SOURCES][PER];
#pragma unroll
    for (int u = 0; u < SOURCES; ++u)
#pragma unroll
      for (int i = 0; i < PER; ++i)
        more[u][i] =
            held(i) ? __ldcg(reinterpret_cast<const float4*>(first + v * step + at(i, u))) : make_float4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < SOURCES; ++u)
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        total[u][i].x += more[u][i].x;
        total[u][i].y += more[u][i].y;
        total[u][i].z += more[u][i].z;
        total[u][i].w += more[u][i].w;
      }
  }
  if (GATED)
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      float* const g = &total[0][i].x;
      const float* const u = &total[SOURCES - 1][i].x;
#pragma unroll
      for (int j = 0; j < 4; ++j) g[j] = mdsl_act::gated(g[j], u[j], act);
    }
  // (each residual value loaded before any store, as in the consumers' stores)
  if (!GATED && residual)
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      if (!held(i)) continue;
      const long long o = static_cast<long long>(r1 + ROWS_APART * i) * out_width + first_out + cc;
      float* const sums = &total[0][i].x;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (cc + j < cols) sums[j] = residual[o + j] + sums[j];
    }
  static_assert(GATED || COLS == 4 * 32, "a warp's float4s: one row's tile");
  if (!GATED && squares)
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      if (!held(i)) continue;   // (the same for a warp's threads: one row)
      float v[4] = {total[0][i].x, total[0][i].y, total[0][i].z, total[0][i].w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (cc + j >= cols) v[j] = 0.0f;
      const float sum = mdsl_norm::tile_squares(v[0], v[1], v[2], v[3]);
      if (cc == 0)
        squares[static_cast<long long>(r1 + ROWS_APART * i) * (out_width / mdsl_norm::TILE) +
                first_out / mdsl_norm::TILE] = sum;
    }
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    if (!held(i)) continue;
    const long long o = static_cast<long long>(r1 + ROWS_APART * i) * out_width + first_out + cc;
    const float sums[4] = {total[0][i].x, total[0][i].y, total[0][i].z, total[0][i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (cc + j >= cols) break;
      if (GATED && handed)
        handed[o + j] = from_float<W>(sums[j]);
      else
        out[o + j] = sums[j];
    }
  }
}

template <typename W, int RN, int BLOCKS>
__device__ __forceinline__ void linear(unsigned char* smem, const WeightMaps& weights, const TensorMap* rounded,
                                       const float* x, float* out, float* part, int* arrivals,
                                       const float* residual, const Parts& parts, int rows, int k, int out_width,
                                       int offset, int splits, int act, W* handed, int rows_rounded,
                                       const Norm& norm, float* squares) {
  using R = Ring<RN, BLOCKS>;
  // the rows' tiles by TMA from the rounded rows' map (`rows_rounded`: the host's; always from 64 rows), else
  // stored by the producer's threads from the float32 rows x
  const bool tma_rows = R::TMA_ROWS || rows_rounded;
  __shared__ int last;
  __shared__ float inverse[RN];   // normalised rows: each row's 1 / rms (the producer's)
  // this block's weight (constant indices: the parts' fields stay in the parameter space)
  int p = 0, first_tile = 0, start = 0, end = parts.start[1];
#pragma unroll
  for (int i = 1; i < MAX_PARTS; ++i)
    if (i < parts.count && int(blockIdx.y) >= parts.tile[i]) {
      p = i;
      first_tile = parts.tile[i];
      start = parts.start[i];
      end = parts.start[i + 1];
    }
  const bool gated = act >= 0;   // (parts: the gate's columns alone, in tiles of HALF; map[1] the up weight's)
  const int f0 = (blockIdx.y - first_tile) * (gated ? HALF : FEATURES);   // the tile's first column in the weight
  const int n = end - start;                              // the weight's columns
  const int col0 = start + f0;                            // ... the tile's first in the output
  const int r0 = blockIdx.x * RN;
  // the block's splits: `runs` consecutive ones (the last block fewer) of a grid of gridDim.z split blocks;
  // the first block sums its own as they end (`in_block`); partial `slot` of split v past the first block's
  // (its total at slot 0)
  const int runs = (splits + gridDim.z - 1) / gridDim.z;
  // (a paired block, at a step of one row tile, runs one split: never runs of them)
  const bool whole = gridDim.z == 1, in_block = !R::PAIRED && blockIdx.z == 0 && runs > 1;
  const int steps = (k + BK - 1) / BK, per = (steps + splits - 1) / splits;
  const int v0 = blockIdx.z * runs, v1 = v0 + runs < splits ? v0 + runs : splits;
  auto slot = [&](int v) { return v < runs ? 0 : v - runs + 1; };
  // the block's k steps s0 .. s1 - 1 from its index z in the grid's split blocks (the producer computes them
  // again after its setmaxnreg, from z read again: ptxas spills a value a thread carries across setmaxnreg)
  auto k_steps = [&](int z, int& s0, int& s1) {
    const int a = z * runs, b = a + runs < splits ? a + runs : splits;
    s0 = a * per;
    s1 = b * per < steps ? b * per : steps;
  };
  const int warpgroup = threadIdx.x / 128;
  const R ring{(smem_address(smem) + 1023u) & ~1023u};
  if (threadIdx.x == 0) {
    for (int s = 0; s < R::STAGES; ++s) {
      // the expect-tx arrival of the stage's TMA bytes, and each producer thread's once it stored its rows
      barrier_init(ring.full(s), tma_rows ? 1 : 1 + 128);
      barrier_init(ring.empty(s), 2 * 4);   // each consumer warp, once its wgmmas have read the stage
    }
    barrier_init_fence();
    tma_prefetch(&weights.map[p]);
    if (gated) tma_prefetch(&weights.map[1]);
    if (tma_rows) tma_prefetch(rounded);
  }
  __syncthreads();
  float acc[R::ACC];
#pragma unroll
  for (int i = 0; i < R::ACC; ++i) acc[i] = 0.0f;
  int stage = 0;
  unsigned phase = 0;
  // k step s's weight tile into stage `at`: 128 rows of the block's weight, or gated 64 of the gate's and the
  // same 64 of the up's
  auto load_weights = [&](int at, int s) {
    if (gated) {
      tma_load(ring.w_tile(at), &weights.map[0], ring.full(at), s * BK, f0);
      tma_load(ring.w_tile(at) + R::W_BYTES / 2, &weights.map[1], ring.full(at), s * BK, f0);
    } else {
      tma_load(ring.w_tile(at), &weights.map[p], ring.full(at), s * BK, f0);
    }
  };
  // the first stages' weight tiles (no kernel writes the weights) are on their way before the step's wait
  // (dependent_launch.cuh), while the kernel before this one ends; their stages are empty, as at every start
  if (threadIdx.x == 0) {
    int s0, s1;
    k_steps(blockIdx.z, s0, s1);
    for (int i = 0; i < s1 - s0 && i < R::STAGES; ++i) {
      barrier_expect_bytes(ring.full(i), tma_rows ? R::STAGE_BYTES : R::W_BYTES);
      load_weights(i, s0 + i);
    }
  }
  mdsl_pdl::step_wait();
  if (warpgroup == 0) {
    if constexpr (!R::PAIRED) registers_down<R::PRODUCER_REGISTERS>();
    unsigned z;
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    int s0, s1;
    k_steps(z, s0, s1);
    const int prefetched = s1 - s0 < R::STAGES ? s1 - s0 : R::STAGES;
    if (tma_rows) {
      if (threadIdx.x == 0) {
        for (int s = s0; s < s1; ++s) {
          if (s - s0 >= prefetched) {
            barrier_wait(ring.empty(stage), phase ^ 1);
            barrier_expect_bytes(ring.full(stage), R::STAGE_BYTES);
            load_weights(stage, s);
          }
          tma_load(ring.x_tile(stage), rounded, ring.full(stage), s * BK, r0);
          if (++stage == R::STAGES) stage = 0, phase ^= 1;
        }
      }
    } else if constexpr (R::FLOATS > 0) {   // (from TMA_ROWS rows, tma_rows always)
      using Staged = StagedRows<RN>;
      const W* const scale = norm.squares ? static_cast<const W*>(norm.w) : nullptr;
      // the first FLOATS - 1 stages' rows on their way (a group each, empty past s1: wait_group counts groups)
      for (int i = 0; i < R::FLOATS - 1; ++i) {
        if (s0 + i < s1) Staged::copy(ring.floats(i), x, scale, r0, rows, (s0 + i) * BK, k);
        else cp_async_commit();
      }
      // normalised rows: each row's 1 / rms (row_norms.cuh) from its tiles' sums of squares, a thread a row,
      // its loads in flight with the first stages' rows (0 for the tile's rows past the step's: their zeros stay)
      if (norm.squares) {
        if (threadIdx.x < RN)
          inverse[threadIdx.x] = r0 + int(threadIdx.x) < rows
              ? mdsl_norm::inverse_rms(norm.squares + static_cast<long long>(r0 + threadIdx.x) * (k / mdsl_norm::TILE),
                                       k, norm.eps)
              : 0.0f;
        asm volatile("bar.sync 2, 128;" ::: "memory");   // (the producer warpgroup's threads alone)
      }
      for (int s = s0, slot = 0; s < s1; ++s) {
        // the slot this stage's copy leaves is the one the stage before read (this thread's reads, done)
        const int ahead = s + R::FLOATS - 1, into = slot == 0 ? R::FLOATS - 1 : slot - 1;
        if (ahead < s1) Staged::copy(ring.floats(into), x, scale, r0, rows, ahead * BK, k);
        else cp_async_commit();
        cp_async_wait<R::FLOATS - 1>();   // this stage's group
        barrier_wait(ring.empty(stage), phase ^ 1);
        if (threadIdx.x == 0 && s - s0 >= prefetched) {
          barrier_expect_bytes(ring.full(stage), R::W_BYTES);
          load_weights(stage, s);
        }
        Staged::template store<W>(ring.x_tile(stage), ring.floats(slot), norm.squares ? inverse : nullptr,
                                  norm.one_plus);
        barrier_arrive(ring.full(stage));
        if (++slot == R::FLOATS) slot = 0;
        if (++stage == R::STAGES) stage = 0, phase ^= 1;
      }
    }
    if constexpr (!R::PAIRED) {
      if (whole) return;
      registers_up<R::REGISTERS>();
    }
  } else {
    if constexpr (!R::PAIRED) registers_up<R::CONSUMER_REGISTERS>();
    const unsigned columns = (warpgroup - 1) * 64 * BK * 2;   // this warpgroup's 64 rows of the weight tile
    const bool signals = threadIdx.x % 32 == 0;
    // in_block: the splits' sums folded in split order as they complete, total = ((p0 + p1) + p2) ..., the
    // f32 additions of the last block's fold below, so the same bits as a grid of splits
    float total[R::PAIRED ? 1 : R::ACC];
    // wgmma's f32 layout: per 8-row group j, thread (warp w, g = lane / 4, q = lane % 4) of the warpgroup holds
    // columns 16 w + g and 16 w + g + 8 of its 64, rows 8 j + 2 q and 8 j + 2 q + 1
    const int t = threadIdx.x % 128, lane = t % 32;
    const int c = (warpgroup - 1) * 64 + (t / 32) * 16 + lane / 4, q = 2 * (lane % 4);
    const int width = parts.tile[MAX_PARTS] * FEATURES;   // a partial's row: every tile's columns
    // the sums as partial `at` (gated: the up's partials at HALF on)
    auto store_partial = [&](int at) {
#pragma unroll
      for (int i = 0; i < R::ACC; ++i) {
        const int j = i / 4, e = i % 4;
        const int cc = c + 8 * (e / 2), r = r0 + 8 * j + q + e % 2;
        if (f0 + (gated ? cc % HALF : cc) < n && r < rows)
          part[(static_cast<long long>(at) * rows + r) * width + blockIdx.y * FEATURES + cc] = acc[i];
      }
    };
    // split v's k steps into the sums d (each stage's wgmmas, then the stage before released once at most this
    // one's are in flight). With `folds` (two sets of sums taken in turn), at the split's first step past the
    // block's first split the split before's sums `done` are complete, and are folded into the total while this
    // split's first wgmmas run (one set: the caller folds a split's sums once its last wgmmas are done)
    auto run_split = [&](bool folds, float (&d)[R::ACC], float (&done)[R::ACC], int v, int& previous) {
      const int end = (v + 1) * per < steps ? (v + 1) * per : steps;
      for (int s = v * per; s < end; ++s) {
        barrier_wait(ring.full(stage), phase);
        const unsigned long long dw = descriptor(ring.w_tile(stage) + columns), dx = descriptor(ring.x_tile(stage));
        fence_registers(d);
        wgmma_fence();
        Wgmma<W, RN>::mma(d, dw, dx, s != v * per);   // (a split's sums start from zero)
#pragma unroll
        for (int j = 1; j < BK / 16; ++j) Wgmma<W, RN>::mma(d, dw + 2 * j, dx + 2 * j);
        wgmma_commit();
        fence_registers(d);
        if (previous >= 0) {   // the previous stage's wgmmas are done once at most this stage's are in flight
          wgmma_wait<1>();
          fence_registers(d);
          if (signals) barrier_arrive(ring.empty(previous));
          if (folds && s == v * per && v > v0) {
            fence_registers(done);
#pragma unroll
            for (int i = 0; i < R::ACC; ++i) total[i] = v - 1 == 0 ? done[i] : total[i] + done[i];
          }
        }
        previous = stage;
        if (++stage == R::STAGES) stage = 0, phase ^= 1;
      }
    };
    if constexpr (R::TWO_SETS) {
      if (in_block) {
        float other[R::ACC];
#pragma unroll
        for (int i = 0; i < R::ACC; ++i) other[i] = 0.0f;   // (before any wgmma: each split's first clears it)
        int previous = -1;
        for (int v = v0; v < v1; v += 2) {
          run_split(true, acc, other, v, previous);
          if (v + 1 < v1) run_split(true, other, acc, v + 1, previous);
        }
        wgmma_wait<0>();
        fence_registers(acc);
        fence_registers(other);
        if (signals) barrier_arrive(ring.empty(previous));
        // the last split's sums: `acc` after an odd count of the block's splits, else `other`
        if ((v1 - v0) % 2) {
#pragma unroll
          for (int i = 0; i < R::ACC; ++i) total[i] = v1 - 1 == 0 ? acc[i] : total[i] + acc[i];
        } else {
#pragma unroll
          for (int i = 0; i < R::ACC; ++i) total[i] = v1 - 1 == 0 ? other[i] : total[i] + other[i];
        }
      }
    }
    for (int v = v0; v < v1 && !(R::TWO_SETS && in_block); ++v) {
      int previous = -1;
      run_split(false, acc, acc, v, previous);
      wgmma_wait<0>();
      fence_registers(acc);
      if (previous >= 0 && signals) barrier_arrive(ring.empty(previous));
      if (in_block || blockIdx.z > 0) {
        if (in_block)
#pragma unroll
          for (int i = 0; i < (R::PAIRED ? 0 : R::ACC); ++i) total[i] = v == 0 ? acc[i] : total[i] + acc[i];
        else
          store_partial(slot(v));
      }
    }
    if (in_block)
#pragma unroll
      for (int i = 0; i < (R::PAIRED ? 0 : R::ACC); ++i) acc[i] = total[i];
    if (!whole) {   // the first block's total (a later block wrote its splits' sums as each ended)
      if (blockIdx.z == 0) store_partial(0);
    } else {
      if (gated) {
        // the up sums to the gate's threads through the ring (every stage read: both warpgroups' wgmmas done)
        static_assert(R::STAGES * R::STAGE_BYTES >= R::ACC * 128 * 4, "a warpgroup's sums fit the stages");
        float* const handed = reinterpret_cast<float*>(smem + (ring.base - smem_address(smem))) + t;
        consumers_sync();
        if (warpgroup == 2)
#pragma unroll
          for (int i = 0; i < R::ACC; ++i) handed[i * 128] = acc[i];
        consumers_sync();
        if (warpgroup == 2) return;
#pragma unroll
        for (int i = 0; i < R::ACC; ++i) acc[i] = mdsl_act::gated(acc[i], handed[i * 128], act);
      }
      // the sums stored 16 (or ACC) at a time, each batch's residual values loaded before any of its stores:
      // `out` may be `residual` (added in place), so a load is not moved above an earlier store, and a load, add
      // and store one value after another would wait out a memory latency per value (a grid of splits writes
      // partials: the tile's last block adds the residual)
      constexpr int BATCH = R::ACC < 16 ? R::ACC : 16;
      const bool adds = residual != nullptr, summed = squares != nullptr && !gated;
#pragma unroll
      for (int b0 = 0; b0 < R::ACC; b0 += BATCH) {
        float add[BATCH];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
          const int j = (b0 + b) / 4, e = (b0 + b) % 4;
          const int cc = c + 8 * (e / 2), r = r0 + 8 * j + q + e % 2;
          add[b] = adds && f0 + cc < n && r < rows
                       ? residual[static_cast<long long>(r) * out_width + offset + col0 + cc] : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
          const int j = (b0 + b) / 4, e = (b0 + b) % 4;
          const int cc = c + 8 * (e / 2), r = r0 + 8 * j + q + e % 2;
          if (f0 + cc < n && r < rows) {
            const float v = acc[b0 + b];
            if (gated && handed)
              handed[static_cast<long long>(r) * out_width + offset + col0 + cc] = from_float<W>(v);
            else
              out[static_cast<long long>(r) * out_width + offset + col0 + cc] = adds ? add[b] + v : v;
          }
        }
        if (summed)   // (the values written, kept for the rows' sums of squares below)
#pragma unroll
          for (int b = 0; b < BATCH; ++b) {
            const float v = acc[b0 + b];
            acc[b0 + b] = f0 + c + 8 * ((b0 + b) % 4 / 2) < n ? (adds ? add[b] + v : v) : 0.0f;
          }
      }
      if (summed) {
        // each row's sum of squares of the tile's columns (row_norms.cuh's layout: a warp a row, lane l its
        // columns 4l .. 4l + 3), the values through the ring's first bytes as [RN][128] floats: both consumer
        // warpgroups' wgmmas have read every stage once both pass the barrier
        static_assert(R::STAGES * R::STAGE_BYTES >= RN * FEATURES * 4, "a tile's values fit the stages");
        float* const values = reinterpret_cast<float*>(smem + (ring.base - smem_address(smem)));
        consumers_sync();
#pragma unroll
        for (int i = 0; i < R::ACC; ++i) {
          const int j = i / 4, e = i % 4;
          values[(8 * j + q + e % 2) * FEATURES + c + 8 * (e / 2)] = acc[i];
        }
        consumers_sync();
        const int warp = (threadIdx.x - 128) / 32;
        for (int rr = warp; rr < RN && r0 + rr < rows; rr += 8) {
          const float4 v = *reinterpret_cast<const float4*>(values + rr * FEATURES + 4 * lane);
          const float sum = mdsl_norm::tile_squares(v.x, v.y, v.z, v.w);
          if (lane == 0)
            squares[static_cast<long long>(r0 + rr) * (out_width / mdsl_norm::TILE) +
                    (offset + col0) / mdsl_norm::TILE] = sum;
        }
      }
    }
    if constexpr (!R::PAIRED) {
      if (whole) return;
      registers_down<R::REGISTERS>();
    }
  }
  if (whole) return;
  // the tile's last block to finish sums the partials in split order
  __threadfence();
  __syncthreads();
  const int tile = blockIdx.y * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) {
    last = atomicAdd(arrivals + tile, 1) == gridDim.z - 1;
    if (last) arrivals[tile] = 0;   // ready for the next launch
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const long long first_out = static_cast<long long>(offset) + col0;
  if (gated)
    fold_splits<W, RN, true>(out, handed, part, residual, rows, parts.tile[MAX_PARTS] * FEATURES, slot(splits - 1) + 1,
                             r0, n - f0, first_out, out_width, act, nullptr);
  else
    fold_splits<W, RN, false>(out, handed, part, residual, rows, parts.tile[MAX_PARTS] * FEATURES,
                              slot(splits - 1) + 1, r0, n - f0, first_out, out_width, act, squares);
}

}  // namespace serve_tc
}  // namespace mdsl

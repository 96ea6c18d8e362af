// Decode-sized linears over R rows on tensor cores (sm_80+; compiled for sm_90a):
//
//     y[r, n] = sum_k x[r, k] W[n, k],   r < R <= 64, x and W bf16, sums in f32
//
// The weights dominate the bytes (a decode step reads every weight once), so a warp streams W from DRAM with
// 16-byte loads, LOADS of them a lane in flight, and multiplies on mma.sync.m16n8k16: the weights are the M side
// (A: 16 features x 16 k), the rows the N side (B: 16 k x 8 rows, R padded up to whole n8 tiles), 4 f32 sums a
// thread per (16-feature tile, n8 tile).
//
// * Weights in fragment order (rows_gemv.py's repack_for_mma, once at load): a 16 x 16 block of W is exactly one
//   A fragment a lane, 4 registers = 8 bf16 = 16 bytes, so W' is [N/16][K/16][32 lanes][8]: one 16-byte load a
//   lane is one mma's A operand, a warp's load is 512 contiguous bytes, and there is no shuffle, no shared
//   memory and no ldmatrix between DRAM and the tensor core. (Loading W's own rows into fragments moves 4-byte
//   pieces: 4 loads a fragment; staging through shared memory with cp.async or TMA and ldmatrix costs shared
//   memory the rows need and a barrier a stage. In registers, LOADS = 16 a lane is 64 KB in flight an SM with
//   8 warps, twice the 32 KB a DRAM round trip at an SM's share of 4.25 TB/s needs.)
// * Rows in shared memory as bf16, one K slice of them at a time ([rows rounded up to 16][KSLICE], each row
//   padded by 16 bytes: ldmatrix reads 8 rows' 16 bytes at one k a phase, and a row stride of 16 mod 128 bytes
//   puts those 8 on 8 different 4-bank groups), loaded into B fragments with ldmatrix.x4 (two n8 tiles' b0, b1
//   at one k16 step). Staged with cp.async after the warps' first weight loads are issued.
// * Split-K is across blocks, by K alone: slice s is k in [s * KSLICE, (s + 1) * KSLICE); a warp sums its
//   tile's slice in k16 steps, in order, each step one mma per n8 tile (the sum's order within a step is the
//   tensor core's, the same for every column), and writes its slice's partial sums; RowsReduce adds the slices
//   in order, partial[0] + partial[1] + ... . Nothing in that order depends on R or on a row's place among the
//   rows (an mma's columns are independent), so a row's outputs are bit-identical whatever else is batched
//   with it.
//
// `RowsTile<MT>` is the building block: MT 16-feature tiles over one K slice, a warp's LOADS-deep ring of
// weight loads (issued by `start`, so that a caller can issue them before its rows are there), the products
// (`run`), and the partial sums' stores (`store`). `rows_gemv_kernel` runs it over a grid of (tile ranges,
// K slices); `rows_reduce_kernel` adds the slices.

namespace mdsl {
namespace rows {

constexpr int WARPS = 8;                  // warps a block
constexpr int MAX_ROWS = 64;
constexpr int MAX_N8 = MAX_ROWS / 8;      // n8 tiles of rows
constexpr int LOADS = 16;                 // 16-byte weight loads a lane in flight

// 16 bytes of the weights past L1 (read once a step: L1 would only evict the rows' neighbours)
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// (volatile: not hoisted above the barrier after the rows are staged)
__device__ __forceinline__ void ldmatrix_x4(unsigned (&b)[4], unsigned address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(address));
}

// d += A B: A one lane's fragment of 16 features x 16 k (a0..a3), B its fragment of 16 k x 8 rows (b0, b1)
__device__ __forceinline__ void mma(float (&d)[4], uint4 a, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

// A K slice of the rows in shared memory: row r at r * STRIDE bytes, its k16 step s at s * 32.
template <int KSLICE>
struct RowSlice {
  static_assert(KSLICE % 64 == 0, "a row's bytes a multiple of 128, so that the 16-byte pad shifts rows by 4 banks");
  static constexpr int STRIDE = 2 * KSLICE + 16;
  // rows [0, rows) of x ([rows][k] bf16, row-major) at columns [k0, k0 + kn) into `smem`, and zeros in the rows
  // up to a multiple of 16 (ldmatrix.x4 reads n8 tiles in pairs); cp.async, complete for the whole block at
  // the barrier
  __device__ __forceinline__ static void stage(unsigned char* smem, const unsigned short* x, int rows, int k, int k0,
                                               int kn) {
    const int chunks = kn / 8, rows16 = (rows + 15) / 16 * 16;
    for (int i = threadIdx.x; i < rows16 * chunks; i += blockDim.x) {
      const int r = i / chunks, c = i - r * chunks;
      unsigned char* dst = smem + r * STRIDE + c * 16;
      if (r < rows)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                     :: "r"(smem_address(dst)), "l"(x + (long long)r * k + k0 + c * 8) : "memory");
      else
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
  }
};

// MT 16-feature tiles of W' over `steps` k16 steps, a warp's products with the staged rows.
template <int MT>
struct RowsTile {
  static_assert(LOADS % MT == 0, "a ring slot holds one k16 step of every tile");
  static constexpr int DEPTH = LOADS / MT;   // k16 steps in flight
  uint4 ring[DEPTH][MT];
  const uint4* w[MT];
  int steps;
  float acc[MT][MAX_N8][4];

  // issues the ring's first DEPTH steps: tiles tile0 .. tile0 + MT of W' ([tiles][k_steps][32][8]) from k16 step
  // step0 (a tile past `tile_end` loads tile0 again, and stores nothing)
  __device__ __forceinline__ void start(const uint4* packed, int k_steps, int tile0, int tile_end, int step0,
                                        int steps_) {
    const int lane = threadIdx.x % 32;
    steps = steps_;
#pragma unroll
    for (int m = 0; m < MT; ++m)
      w[m] = packed + ((long long)(tile0 + m < tile_end ? tile0 + m : tile0) * k_steps + step0) * 32 + lane;
#pragma unroll
    for (int j = 0; j < DEPTH; ++j)
#pragma unroll
      for (int m = 0; m < MT; ++m)
        if (j < steps) ring[j][m] = ld_stream(w[m] + j * 32);
  }

  // acc = the tiles' products with rows [0, 8 * n8) of the slice at shared address `xs` (row stride `stride`),
  // step by step in order; each step's slot refilled with the step DEPTH later once its mmas are issued. One
  // instantiation per n8 (a branch around each mma.sync costs a convergence barrier and a warpsync an mma).
  __device__ __forceinline__ void run(unsigned xs, int stride, int n8) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int t = 0; t < MAX_N8; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][t][i] = 0.0f;
    // ldmatrix.x4's matrices: (n8 tile 2p, k 0..7), (2p, k 8..15), (2p + 1, k 0..7), (2p + 1, k 8..15); lane l
    // gives row l % 8 of matrix l / 8
    const int lane = threadIdx.x % 32;
    const unsigned base = xs + unsigned(((lane / 16) * 8 + lane % 8) * stride + ((lane / 8) % 2) * 16);
    switch (n8) {
      case 1: run_n8<1>(base, stride); break;
      case 2: run_n8<2>(base, stride); break;
      case 3: run_n8<3>(base, stride); break;
      case 4: run_n8<4>(base, stride); break;
      case 5: run_n8<5>(base, stride); break;
      case 6: run_n8<6>(base, stride); break;
      case 7: run_n8<7>(base, stride); break;
      default: run_n8<8>(base, stride); break;
    }
  }
  template <int N8>
  __device__ __forceinline__ void run_n8(unsigned base, int stride) {
    int first = 0;
    for (; first + DEPTH <= steps; first += DEPTH)
#pragma unroll
      for (int j = 0; j < DEPTH; ++j) step<N8>(j, first + j, base, stride);
#pragma unroll
    for (int j = 0; j < DEPTH; ++j)
      if (first + j < steps) step<N8>(j, first + j, base, stride);   // warp-uniform
  }
  // k16 step s from ring slot j
  template <int N8>
  __device__ __forceinline__ void step(int j, int s, unsigned base, int stride) {
    unsigned b[(N8 + 1) / 2][4];   // (an odd N8's last pair reads rows staged as zeros)
#pragma unroll
    for (int p = 0; p < (N8 + 1) / 2; ++p) ldmatrix_x4(b[p], base + unsigned(p * 16 * stride + s * 32));
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int t = 0; t < N8; ++t) mma(acc[m][t], ring[j][m], b[t / 2][(t % 2) * 2], b[t / 2][(t % 2) * 2 + 1]);
#pragma unroll
    for (int m = 0; m < MT; ++m)
      if (s + DEPTH < steps) ring[j][m] = ld_stream(w[m] + (s + DEPTH) * 32);
  }

  // out[r][n] (row stride n_total) = the sums of rows r < rows, features n of tiles tile0 .. tile_end: lane l
  // holds, of n8 tile t, features l / 4 (d0, d1) and l / 4 + 8 (d2, d3) of rows 2 (l % 4) + {0, 1}
  __device__ __forceinline__ void store(float* out, int n_total, int rows, int tile0, int tile_end) const {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int t = 0; t < MAX_N8; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = t * 8 + 2 * q + (i & 1), n = (tile0 + m) * 16 + g + (i / 2) * 8;
          if (tile0 + m < tile_end && r < rows) out[(long long)r * n_total + n] = acc[m][t][i];
        }
  }
};

// Block (x, y): tiles [x * tiles_per_block, ...) over K slice y; partial[y][r][n] its sums. Each warp takes the
// block's groups of MT tiles in turn; its first group's weight loads go out before the rows are staged.
template <int MT, int KSLICE>
__device__ __forceinline__ void rows_gemv_kernel(unsigned char* smem, const uint4* packed, const unsigned short* x,
                                                 float* partial, int rows, int n, int k, int tiles_per_block) {
  const int tiles = n / 16, k_steps = k / 16, warp = threadIdx.x / 32;
  const int k0 = blockIdx.y * KSLICE, kn = min(KSLICE, k - k0), n8 = (rows + 7) / 8;
  const int tile_begin = blockIdx.x * tiles_per_block, tile_end = min(tiles, tile_begin + tiles_per_block);
  float* out = partial + (long long)blockIdx.y * rows * n;
  RowsTile<MT> tile;
  int tile0 = tile_begin + warp * MT;
  if (tile0 < tile_end) tile.start(packed, k_steps, tile0, tile_end, k0 / 16, kn / 16);
  RowSlice<KSLICE>::stage(smem, x, rows, k, k0, kn);
  for (; tile0 < tile_end; tile0 += WARPS * MT) {
    if (tile0 != tile_begin + warp * MT) tile.start(packed, k_steps, tile0, tile_end, k0 / 16, kn / 16);
    tile.run(smem_address(smem), RowSlice<KSLICE>::STRIDE, n8);
    tile.store(out, n, rows, tile0, tile_end);
  }
}

// y[i] = partial[0][i] + partial[1][i] + ... + partial[slices - 1][i], in that order
__device__ __forceinline__ void rows_reduce_kernel(const float* partial, float* y, int slices, long long count) {
  const long long step = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count; i += step) {
    float sum = partial[i];
    for (int s = 1; s < slices; ++s) sum += partial[s * count + i];
    y[i] = sum;
  }
}

}  // namespace rows
}  // namespace mdsl

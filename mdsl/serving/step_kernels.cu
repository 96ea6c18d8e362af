// The GPU serving device's step kernels (mdsl/serving/gpu.py): one kernel per layer op of the unfused step
// function, each over all the token rows of a step at once ([rows, N] float32 activations, several
// requests side by side), weights and the KV pools in the checkpoint's dtype W (float, __nv_bfloat16 or
// __half; each kernel that reads them is instantiated for the three as NAME_f32, NAME_bf16, NAME_f16).
//
// Batch invariance: a row's value never depends on the other rows of its step. Every reduction of a row
// runs in an order fixed by the row's own sizes (its width, its position): a linear's dot product is the
// same lane partition and shuffle tree for every row whatever the row count, a norm is one block's fixed
// tree (or the row's tiles' sums of squares in tile order: row_norms.cuh), and attention splits the row's own
// causal range (window start .. position, n keys) into key ranges anchored at the range's first position, of
// 64 keys, or of the multiple of 64 that makes ATT_MAX_SPLITS of them or fewer where n is longer (split = 64 *
// max(1, ceil(n / (64 * ATT_MAX_SPLITS)))): a function of n alone, never of max_seq or of the step; it folds
// them in order. So a request's logits are bit-identical whatever shares its steps and however its prompt is
// chunked.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace serve {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

// an input value of a linear with weights in W as the product reads it: rounded to W (to nearest, ties to
// even) for 16-bit weights, as the tensor cores take their operands and as transformers' model in that dtype
// holds its activations; unchanged for float32 weights
template <typename W>
__device__ __forceinline__ float operand(float x);
template <>
__device__ __forceinline__ float operand<float>(float x) { return x; }
template <>
__device__ __forceinline__ float operand<__nv_bfloat16>(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
template <>
__device__ __forceinline__ float operand<__half>(float x) { return __half2float(__float2half_rn(x)); }

// a float32 value rounded to W (to nearest, ties to even) and stored as W
template <typename W>
__device__ __forceinline__ W from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

constexpr int WARP = 32;
constexpr int NORM_ROPE_WARPS = 8;   // head_norm_rope: heads a block
constexpr int MAX_HEAD_DIM = 256;
#define INF __int_as_float(0x7f800000)   // +infinity (NVRTC has no <cmath>)

// A row-wise element-wise kernel runs on grid (rows, blocks a row): element i of a row is thread
// ELEMENT's, then every ELEMENTS on. Spread over blocks, a thread has one or a few elements, so a row's
// elements are loaded together rather than one memory round trip after another.
#define ELEMENT (int(blockIdx.y * blockDim.x + threadIdx.x))
#define ELEMENTS (int(gridDim.y * blockDim.x))

// sum over a warp by a fixed xor tree; lane 0's result is the one used (lanes may differ in the last bit)
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// sum over the block: each warp's tree, then the warps' sums in warp order; every thread gets the result
__device__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  __syncthreads();   // red may still be read by the previous reduction
  if (threadIdx.x % WARP == 0) red[threadIdx.x / WARP] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < int(blockDim.x) / WARP; ++w) total += red[w];
  return total;
}

// ---- embedding: out[r] = table[tokens[r]]

template <typename W>
__device__ void embedding(float* out, const int* tokens, const W* table, int width) {
  const int r = blockIdx.x;
  const W* row = table + (long long)tokens[r] * width;
  for (int i = ELEMENT; i < width; i += ELEMENTS) out[(long long)r * width + i] = to_f(row[i]);
}

// ---- rms_norm: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * (w or 1 + w); one block (NORM_THREADS) a row.
// With `rounded` the values go there instead, rounded to W: the rows a Hopper linear that alone reads them
// loads by TMA (gpu_wgmma.py's handed rows: its round_rows kernel, and the float32 rows, skipped). With
// `squares` the row's mean square comes from its tiles' sums of squares, which the linear that wrote x wrote
// beside it (row_norms.cuh: the arithmetic of the wgmma linear that runs this norm itself at fewer rows)

constexpr int NORM_PER = 4;   // a thread's values of a row held in registers (rows up to NORM_PER blocks wide)

template <typename W>
__device__ void rms_norm(float* out, const float* x, const W* w, int width, float eps, int one_plus, W* rounded,
                         const float* squares) {
  __shared__ float red[32];
  const long long base = (long long)blockIdx.x * width;
  const float* const tiles = squares ? squares + (long long)blockIdx.x * (width / mdsl_norm::TILE) : nullptr;
  auto put = [&](int i, float v) {
    if (rounded)
      rounded[base + i] = from_f<W>(v);
    else
      out[base + i] = v;
  };
  float ss = 0.0f;
  if (width <= NORM_PER * int(blockDim.x)) {
    // the row's values and the weights load together (one memory latency, not one and then another), and
    // the sums are the loop's below: a thread's values in ascending order
    float xv[NORM_PER], scale[NORM_PER];
#pragma unroll
    for (int j = 0; j < NORM_PER; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      xv[j] = i < width ? x[base + i] : 0.0f;
      scale[j] = i < width ? to_f(w[i]) : 0.0f;
    }
    if (!tiles)
#pragma unroll
      for (int j = 0; j < NORM_PER; ++j)
        if (threadIdx.x + j * blockDim.x < width) ss = fmaf(xv[j], xv[j], ss);
    const float inv = tiles ? mdsl_norm::inverse_rms(tiles, width, eps)
                            : 1.0f / sqrtf(block_sum(ss, red) / float(width) + eps);
#pragma unroll
    for (int j = 0; j < NORM_PER; ++j) {
      const int i = threadIdx.x + j * blockDim.x;
      if (i >= width) break;
      put(i, mdsl_norm::normed(xv[j], inv, scale[j], one_plus));
    }
    return;
  }
  if (!tiles)
#pragma unroll 4
    for (int i = threadIdx.x; i < width; i += blockDim.x) ss = fmaf(x[base + i], x[base + i], ss);
  const float inv = tiles ? mdsl_norm::inverse_rms(tiles, width, eps)
                          : 1.0f / sqrtf(block_sum(ss, red) / float(width) + eps);
#pragma unroll 4
  for (int i = threadIdx.x; i < width; i += blockDim.x)
    put(i, mdsl_norm::normed(x[base + i], inv, to_f(w[i]), one_plus));
}

// ---- linear: out[r, offset + c] = sum_k x[r, k] * w[c, k] (+ residual[r, offset + c]) for the columns c of up
// to MAX_PARTS weights side by side (a fused projection's q|k|v, gate|up: one launch), w [n, k] in the Hugging
// Face layout. The residual is the add that follows the linear in the step function (the residual stream's
// x + W y), fused where the linear's result has no other reader. With 16-bit weights each input value is
// rounded to W first (`operand`), as on the tensor cores, so every kernel of a linear takes the same operands.
// A warp takes one weight row (an output column) at a time and every row of the step, ROWS rows at once: each
// 16-byte vector of weights is loaded once per ROWS rows. Lane l sums the vectors l, l + 32, ... of the row
// in order, then the warp's xor tree: the same order for every row, however many rows the step has.

constexpr int MAX_PARTS = 4;
// weights side by side: part i holds columns [start[i], start[i + 1]); start[count ..] is every column
struct Parts {
  const void* w[MAX_PARTS];
  int start[MAX_PARTS + 1];
  int count;
};

constexpr int ROWS = 8;

template <typename W>
__device__ __forceinline__ void load_vec(const W* p, float* v);
template <>
__device__ __forceinline__ void load_vec<float>(const float* p, float* v) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}
template <>
__device__ __forceinline__ void load_vec<__nv_bfloat16>(const __nv_bfloat16* p, float* v) {
  const uint4 a = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&a);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = __bfloat162float(e[j]);
}
template <>
__device__ __forceinline__ void load_vec<__half>(const __half* p, float* v) {
  const uint4 a = *reinterpret_cast<const uint4*>(p);
  const __half* e = reinterpret_cast<const __half*>(&a);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = __half2float(e[j]);
}

template <typename W>
__device__ __forceinline__ void linear(float* out, const float* x, const Parts& parts, const float* residual,
                                       int rows, int k, int out_width, int offset) {
  constexpr int VEC = 16 / sizeof(W);
  const int lane = threadIdx.x % WARP, warps = blockDim.x / WARP, n = parts.start[MAX_PARTS];   // (every column)
  const bool vectors = k % VEC == 0;   // (a property of the weight, never of the step)
  for (int c = blockIdx.x * warps + threadIdx.x / WARP; c < n; c += gridDim.x * warps) {
    // the column's weight (its arrays indexed by constants only: an index known at run time would copy the
    // parameter to local memory)
    const void* wp = parts.w[0];
    int start = 0;
#pragma unroll
    for (int i = 1; i < MAX_PARTS; ++i)
      if (i < parts.count && c >= parts.start[i]) {
        wp = parts.w[i];
        start = parts.start[i];
      }
    const W* wr = static_cast<const W*>(wp) + (long long)(c - start) * k;
    for (int r0 = 0; r0 < rows; r0 += ROWS) {
      float acc[ROWS];
#pragma unroll
      for (int i = 0; i < ROWS; ++i) acc[i] = 0.0f;
      if (vectors) {
        for (int v0 = lane * VEC; v0 < k; v0 += WARP * VEC) {
          float wv[VEC];
          load_vec<W>(wr + v0, wv);
#pragma unroll
          for (int i = 0; i < ROWS; ++i) {
            if (r0 + i < rows) {
              const float* xr = x + (long long)(r0 + i) * k + v0;
#pragma unroll
              for (int j = 0; j < VEC; ++j) acc[i] = fmaf(wv[j], operand<W>(xr[j]), acc[i]);
            }
          }
        }
      } else {
        for (int j = lane; j < k; j += WARP) {
          const float wv = to_f(wr[j]);
#pragma unroll
          for (int i = 0; i < ROWS; ++i)
            if (r0 + i < rows) acc[i] = fmaf(wv, operand<W>(x[(long long)(r0 + i) * k + j]), acc[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        const float s = warp_sum(acc[i]);
        if (lane == 0 && r0 + i < rows) {
          const long long at = (long long)(r0 + i) * out_width + offset + c;
          out[at] = residual ? residual[at] + s : s;
        }
      }
    }
  }
}

// ---- linear on tensor cores (16-bit weights, k a multiple of 32): mma.sync m16n8k16 with the weight rows as A
// (16 output columns) and the input rows as B (8 rows), f32 accumulators. Each float32 input value is rounded
// to W in registers as it is loaded (`operand`: the linear's input as every kernel of it reads it).
// Each lane loads 16 contiguous bytes of a weight row and of an input row per 32 k: the mma's k order is a
// permutation of memory's (the same for both operands, so the sum is the product's), which lets every load
// be a 16-byte one. k splits over `splits` blocks of a 16-column tile and over each block's MMA_WARPS warps
// (summed in warp order); the block of a tile that finishes last sums the splits' partials in split order
// and writes the tile. Both splits are fixed by the weights' n and k alone, so a row's result depends on its
// own values only, whatever rows share the step. A 16-column tile lies within one weight (each weight's
// columns start a tile).

constexpr int MMA_WARPS = 8;
constexpr int MMA_GROUPS = 8;    // row groups of 8 a pass (64 rows)
struct TileStarts {              // the first 16-column tile of each part, and the tiles' count last
  int start[MAX_PARTS + 1];
};

// 8 float32 values rounded to W, packed as a 16-byte vector of W pairs
template <typename W>
__device__ __forceinline__ unsigned pack2(float a, float b);
template <>
__device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}
template <>
__device__ __forceinline__ unsigned pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}
template <typename W>
__device__ __forceinline__ uint4 round8(const float* x) {
  const float4 a = *reinterpret_cast<const float4*>(x), b = *reinterpret_cast<const float4*>(x + 4);
  return make_uint4(pack2<W>(a.x, a.y), pack2<W>(a.z, a.w), pack2<W>(b.x, b.y), pack2<W>(b.z, b.w));
}

template <typename W>
__device__ __forceinline__ void mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                                         unsigned a3, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                                  unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 ld16(const void* p) { return *reinterpret_cast<const uint4*>(p); }

// 32 k of one 16-column tile and one row group: the weight rows' vectors w0 (column group) and w1 (column
// group + 8), the input row's vector xv; lane (group, tig) holds k tig * 8 .. tig * 8 + 7 of the 32
template <typename W>
__device__ __forceinline__ void mma_32(float (&d)[4], uint4 w0, uint4 w1, uint4 xv) {
  mma_16816<W>(d, w0.x, w1.x, w0.y, w1.y, xv.x, xv.y);
  mma_16816<W>(d, w0.z, w1.z, w0.w, w1.w, xv.z, xv.w);
}

// N consecutive 32-k chunks from chunk s of the tile's two column groups' weight rows (w0, w1) against the
// row groups of the pass from row r0: the N chunks' weights are loaded before any is used (memory in
// flight), and accumulated in chunk order
constexpr int IN_FLIGHT = 4;
template <typename W, int N>
__device__ __forceinline__ void mma_chunks(float (&acc)[MMA_GROUPS][4], const W* w0, const W* w1, const float* x,
                                           int s, int r0, int rows, int k, int group, int tig) {
  uint4 wa[N], wb[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    wa[i] = ld16(w0 + (s + i) * 32);
    wb[i] = ld16(w1 + (s + i) * 32);
  }
#pragma unroll
  for (int g = 0; g < MMA_GROUPS; ++g) {
    if (r0 + g * 8 < rows) {   // (warp-uniform)
      const int r = r0 + g * 8 + group;
      const long long at = (long long)(r < rows ? r : rows - 1) * k + s * 32 + tig * 8;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        mma_32<W>(acc[g], wa[i], wb[i], round8<W>(x + at + i * 32));
      }
    }
  }
}

// out = x @ w.T (+ residual) for the 16 columns of tile blockIdx.x: with splits, through part[split] (rows x
// tiles * 16) and the last block's sum of them
template <typename W>
__device__ __forceinline__ void linear_mma(float* out, float* part, int* arrivals, const float* x, const Parts& parts,
                           const int* tile_start, const float* residual, int rows, int k, int out_width, int offset) {
  __shared__ float red[MMA_WARPS][MMA_GROUPS][4][WARP];
  __shared__ int last;
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, group = lane >> 2, tig = lane & 3;
  // this tile's weight: its pointer, first column in the output, columns and first tile (constant indices)
  const void* wp = parts.w[0];
  int start = 0, end = parts.start[1], first_tile = 0;
#pragma unroll
  for (int i = 1; i < MAX_PARTS; ++i)
    if (i < parts.count && int(blockIdx.x) >= tile_start[i]) {
      wp = parts.w[i];
      start = parts.start[i];
      end = parts.start[i + 1];
      first_tile = tile_start[i];
    }
  const int n = end - start;                                     // this weight's columns
  const int t0 = (blockIdx.x - first_tile) * 16;                 // the tile's first column in the weight
  const int col0 = start + t0;                                   // ... in the output
  const int width = tile_start[MAX_PARTS] * 16;                  // a partial's row: every tile's columns
  const W* w = static_cast<const W*>(wp);
  const int c0 = t0 + group, c1 = c0 + 8;
  const W* w0 = w + (long long)(c0 < n ? c0 : n - 1) * k + tig * 8;   // (columns past n load a real row; never stored)
  const W* w1 = w + (long long)(c1 < n ? c1 : n - 1) * k + tig * 8;
  // this block's and this warp's 32-k chunks
  const int chunks = k / 32, splits = gridDim.y;
  const int per_block = (chunks + splits - 1) / splits, b0 = blockIdx.y * per_block;
  const int b1 = b0 + per_block < chunks ? b0 + per_block : chunks;
  const int per_warp = (per_block + MMA_WARPS - 1) / MMA_WARPS, s0 = b0 + warp * per_warp;
  const int s1 = s0 + per_warp < b1 ? s0 + per_warp : b1;
  for (int r0 = 0; r0 < rows; r0 += MMA_GROUPS * 8) {
    float acc[MMA_GROUPS][4];
#pragma unroll
    for (int g = 0; g < MMA_GROUPS; ++g)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[g][j] = 0.0f;
    // the warp's chunks in order, IN_FLIGHT chunks' weights loaded at once, then the shorter tail
    int s = s0;
    for (; s + IN_FLIGHT <= s1; s += IN_FLIGHT) mma_chunks<W, IN_FLIGHT>(acc, w0, w1, x, s, r0, rows, k, group, tig);
    if (s + 2 <= s1) {
      mma_chunks<W, 2>(acc, w0, w1, x, s, r0, rows, k, group, tig);
      s += 2;
    }
    if (s < s1) mma_chunks<W, 1>(acc, w0, w1, x, s, r0, rows, k, group, tig);
#pragma unroll
    for (int g = 0; g < MMA_GROUPS; ++g)
#pragma unroll
      for (int j = 0; j < 4; ++j) red[warp][g][j][lane] = acc[g][j];
    __syncthreads();
    // warp g sums row group g's slices in warp order; accumulator j of lane (group, tig) is column
    // group + 8 (j / 2) of the tile, row tig * 2 + j % 2 of the group
    for (int g = warp; g < MMA_GROUPS; g += MMA_WARPS) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float total = red[0][g][j][lane];
        for (int v = 1; v < MMA_WARPS; ++v) total += red[v][g][j][lane];
        const int c = group + 8 * (j / 2), r = r0 + g * 8 + tig * 2 + j % 2;
        if (t0 + c < n && r < rows) {
          if (splits == 1) {
            const long long at = (long long)r * out_width + offset + col0 + c;
            out[at] = residual ? residual[at] + total : total;
          } else {
            part[((long long)blockIdx.y * rows + r) * width + blockIdx.x * 16 + c] = total;
          }
        }
      }
    }
    __syncthreads();   // red is rewritten by the next pass
  }
  if (splits == 1) return;
  // the tile's last block to finish sums the splits' partials in split order
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(arrivals + blockIdx.x, 1) == splits - 1;
    if (last) arrivals[blockIdx.x] = 0;   // ready for the next launch
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int cols = n - t0 < 16 ? n - t0 : 16;
  for (int e = threadIdx.x; e < rows * 16; e += blockDim.x) {
    const int r = e / 16, c = e % 16;
    if (c >= cols) continue;
    const long long from = (long long)r * width + blockIdx.x * 16 + c, step = (long long)rows * width;
    float total = __ldcg(part + from);
    for (int v = 1; v < splits; ++v) total += __ldcg(part + v * step + from);
    const long long at = (long long)r * out_width + offset + col0 + c;
    out[at] = residual ? residual[at] + total : total;
  }
}

// ---- argmax of each row (the first maximum): the greedy requests' tokens, chosen on the device. A row's
// values are cut into gridDim.y parts of consecutive values, a block each (one block a row would read a
// vocabulary's logits with one SM's loads); each block writes its part's first maximum (value, index) to
// `parts`, and the row's last block to finish (counted in `counts`, which it resets for the next launch)
// takes the first maximum of the parts: the same answer in any order of the blocks, since the first maximum
// of a row is the first maximum of its parts' first maxima

// the first maximum of the block's (v, at) pairs, at thread 0 (the lower index of equal values; a NaN never
// wins, as `x > v` never holds for it)
__device__ __forceinline__ void block_first_max(float& v, int& at) {
  __shared__ float value[32];
  __shared__ int index[32];
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oat = __shfl_xor_sync(0xffffffffu, at, o);
    if (ov > v || (ov == v && oat < at)) { v = ov; at = oat; }
  }
  if (threadIdx.x % WARP == 0) { value[threadIdx.x / WARP] = v; index[threadIdx.x / WARP] = at; }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < int(blockDim.x) / WARP; ++w)
      if (value[w] > v || (value[w] == v && index[w] < at)) { v = value[w]; at = index[w]; }
  __syncthreads();   // (the shared pairs are free for another reduction)
}

__device__ void argmax_rows(int* best, const float* x, int width, int2* parts, int* counts) {
  __shared__ bool last;
  const int row = blockIdx.x, part = blockIdx.y, n = gridDim.y;
  const int span = (width + n - 1) / n, lo = part * span, hi = min(width, lo + span);
  const long long base = (long long)row * width;
  float v = -INF;
  int at = 0x7fffffff;
#pragma unroll 8
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x)
    if (x[base + i] > v) { v = x[base + i]; at = i; }   // (a thread's indices ascend: its first maximum)
  block_first_max(v, at);
  if (threadIdx.x == 0) {
    parts[(long long)row * n + part] = make_int2(__float_as_int(v), at);
    __threadfence();   // (the part is visible before the count says so)
    last = atomicAdd(counts + row, 1) == n - 1;
    if (last) counts[row] = 0;   // ready for the next launch
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  v = -INF;
  at = 0x7fffffff;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int2 p = __ldcg(parts + (long long)row * n + i);
    const float pv = __int_as_float(p.x);
    if (pv > v || (pv == v && p.y < at)) { v = pv; at = p.y; }
  }
  block_first_max(v, at);
  if (threadIdx.x == 0) best[row] = at;
}

// ---- add_bias: out[r, c] = x[r, c] + b[c]

template <typename W>
__device__ void add_bias(float* out, const float* x, const W* b, int width) {
  const long long base = (long long)blockIdx.x * width;
  for (int i = ELEMENT; i < width; i += ELEMENTS) out[base + i] = __fadd_rn(x[base + i], to_f(b[i]));
}

// The KV append (kv_append's arithmetic) done by the op that writes the q|k|v rows the attention reads (rope,
// head_norm_rope), where nothing else reads them: each row's key and value heads also go into its request's
// page at its position, rounded to the pools' P, so the kv_append launch is gone. k_pool null: none.
template <typename P>
struct Append {
  P* k_pool;
  P* v_pool;
  const int* entries;
  const int* page_table;
  int pages_per_request, page_size;

  // where row r's keys and values at position pos go: the first value's index in its page's slot (read the
  // row's entry and page once, before its values are ready, so that those reads are not on their path)
  __device__ __forceinline__ long long slot(int r, int pos, int kv_heads, int dim) const {
    if (!k_pool) return 0;
    const int page = page_table[(long long)entries[r] * pages_per_request + pos / page_size];
    return ((long long)page * page_size + pos % page_size) * kv_heads * dim;
  }
  // head h's value d into the pools at `at` (slot's), if h is a key or value head
  __device__ __forceinline__ void put_at(long long at, int h, int d, float v, int q_heads, int kv_heads,
                                         int dim) const {
    if (!k_pool || h < q_heads) return;
    if (h < q_heads + kv_heads)
      k_pool[at + (long long)(h - q_heads) * dim + d] = from_f<P>(v);
    else
      v_pool[at + (long long)(h - q_heads - kv_heads) * dim + d] = from_f<P>(v);
  }
  // head h's value d (of the q|k|v row r at position pos) into the pools, if h is a key or value head
  __device__ __forceinline__ void put(int r, int pos, int h, int d, float v, int q_heads, int kv_heads,
                                      int dim) const {
    if (!k_pool || h < q_heads) return;
    put_at(slot(r, pos, kv_heads, dim), h, d, v, q_heads, kv_heads, dim);
  }
};

// ---- head_rms_norm: an rms_norm over each query head (weight wq) and key head (weight wk) of the q|k|v row;
// value heads are copied. One warp a head: grid (rows, heads / NORM_ROPE_WARPS). With ROPE the normalised
// head goes through shared memory and is rotated from there as the rope kernel rotates it (head_norm_rope:
// the two ops fused where the rope alone reads the norm; the same arithmetic, so the same bits).

template <typename W, bool ROPE>
__device__ __forceinline__ void head_norm(float* out, const float* x, const W* wq, const W* wk, const float* cos_table,
                                          const float* sin_table, const int* positions, int q_heads, int kv_heads,
                                          int dim, float eps, Append<W> append = {}) {
  __shared__ float y[ROPE ? NORM_ROPE_WARPS : 1][ROPE ? MAX_HEAD_DIM : 1];
  constexpr int PER = MAX_HEAD_DIM / WARP;   // a lane's values of a head: dims lane, lane + 32, ...
  const int heads = q_heads + 2 * kv_heads, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int h = blockIdx.y * NORM_ROPE_WARPS + warp;
  if (h >= heads) return;
  const long long base = (long long)blockIdx.x * heads * dim + (long long)h * dim;
  const bool copied = h >= q_heads + kv_heads;   // (a value head)
  const W* w = h < q_heads ? wq : wk;
  // every read of the head's work in flight before any is used: its values and weights, and with ROPE the
  // row's position, its page (Append::slot) and the position's cos and sin (two memory latencies, where
  // reading each where it is first used made five)
  float xv[PER], wv[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int d = lane + WARP * j;
    xv[j] = d < dim ? x[base + d] : 0.0f;
    wv[j] = d < dim && !copied ? to_f(w[d]) : 0.0f;
  }
  const int pos = ROPE ? positions[blockIdx.x] : 0;
  const long long at = ROPE ? append.slot(blockIdx.x, pos, kv_heads, dim) : 0;
  if (copied) {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int d = lane + WARP * j;
      if (d >= dim) break;
      out[base + d] = xv[j];
      if (ROPE) append.put_at(at, h, d, xv[j], q_heads, kv_heads, dim);
    }
    return;
  }
  float cv[ROPE ? PER : 1], sv[ROPE ? PER : 1];
  if (ROPE)
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int d = lane + WARP * j;
      cv[j] = d < dim ? cos_table[(long long)pos * dim + d] : 0.0f;
      sv[j] = d < dim ? sin_table[(long long)pos * dim + d] : 0.0f;
    }
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < PER; ++j)
    if (lane + WARP * j < dim) ss = fmaf(xv[j], xv[j], ss);
  const float inv = 1.0f / sqrtf(__shfl_sync(0xffffffffu, warp_sum(ss), 0) / float(dim) + eps);
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int d = lane + WARP * j;
    if (d >= dim) break;
    const float normed = __fmul_rn(__fmul_rn(xv[j], inv), wv[j]);
    if (ROPE) y[warp][d] = normed;
    else out[base + d] = normed;
  }
  if (!ROPE) return;
  __syncwarp();
  const int half = dim / 2;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int d = lane + WARP * j;
    if (d >= dim) break;
    const float rotated = d < half ? -y[warp][d + half] : y[warp][d - half];
    const float v = __fadd_rn(__fmul_rn(y[warp][d], cv[j]), __fmul_rn(rotated, sv[j]));
    out[base + d] = v;
    append.put_at(at, h, d, v, q_heads, kv_heads, dim);
  }
}

template <typename W>
__device__ void head_rms_norm(float* out, const float* x, const W* wq, const W* wk, int q_heads, int kv_heads,
                              int dim, float eps) {
  head_norm<W, false>(out, x, wq, wk, nullptr, nullptr, nullptr, q_heads, kv_heads, dim, eps);
}

template <typename W>
__device__ void head_norm_rope(float* out, const float* x, const W* wq, const W* wk, const float* cos_table,
                               const float* sin_table, const int* positions, int q_heads, int kv_heads, int dim,
                               float eps, Append<W> append) {
  head_norm<W, true>(out, x, wq, wk, cos_table, sin_table, positions, q_heads, kv_heads, dim, eps, append);
}

// ---- rope: the query and key heads rotated (rotate-half form) by the row's position's cos and sin (tables
// [positions, dim] computed on the host as the reference computes them); value heads copied

template <typename P>
__device__ void rope(float* out, const float* x, const float* cos_table, const float* sin_table,
                     const int* positions, int q_heads, int kv_heads, int dim, Append<P> append) {
  const int heads = q_heads + 2 * kv_heads, half = dim / 2, pos = positions[blockIdx.x];
  const long long base = (long long)blockIdx.x * heads * dim;
  const float* c = cos_table + (long long)pos * dim;
  const float* s = sin_table + (long long)pos * dim;
  const long long at = append.slot(blockIdx.x, pos, kv_heads, dim);   // (the row's page read once, up front)
  for (int i = ELEMENT; i < heads * dim; i += ELEMENTS) {
    const int h = i / dim, d = i % dim;
    float v;
    if (h >= q_heads + kv_heads) {
      v = x[base + i];
    } else {
      const float rotated = d < half ? -x[base + i + half] : x[base + i - half];
      v = __fadd_rn(__fmul_rn(x[base + i], c[d]), __fmul_rn(rotated, s[d]));
    }
    out[base + i] = v;
    append.put_at(at, h, d, v, q_heads, kv_heads, dim);
  }
}

// ---- the KV append: each row's key and value heads into its request's page at its position (pools
// [pages, page_size, kv_heads, dim] of W, the checkpoint's dtype: the float32 keys and values rounded to
// nearest, ties to even, as torch's cache in the model's dtype holds them and the CPU device's pools do)

template <typename W>
__device__ void kv_append(W* k_pool, W* v_pool, const float* qkv, const int* positions, const int* entries,
                          const int* page_table, int pages_per_request, int page_size, int q_heads, int kv_heads,
                          int dim) {
  const Append<W> append{k_pool, v_pool, entries, page_table, pages_per_request, page_size};
  const int r = blockIdx.x, pos = positions[r];
  const long long base = (long long)r * (q_heads + 2 * kv_heads) * dim;
  for (int i = q_heads * dim + ELEMENT; i < (q_heads + 2 * kv_heads) * dim; i += ELEMENTS)
    append.put(r, pos, i / dim, i % dim, qkv[base + i], q_heads, kv_heads, dim);
}

// a lane's four values of a key or value (dims d .. d + 3) as attention loads them from pools of W: a float4
// (16 bytes) of float pools, four 16-bit values (8 bytes) of the others, widened to a float4 where used
template <typename W>
struct Four {
  using T = uint2;
};
template <>
struct Four<float> {
  using T = float4;
};
template <typename W>
__device__ __forceinline__ typename Four<W>::T load4(const W* p);
template <>
__device__ __forceinline__ float4 load4<float>(const float* p) { return *reinterpret_cast<const float4*>(p); }
template <>
__device__ __forceinline__ uint2 load4<__nv_bfloat16>(const __nv_bfloat16* p) {
  return *reinterpret_cast<const uint2*>(p);
}
template <>
__device__ __forceinline__ uint2 load4<__half>(const __half* p) { return *reinterpret_cast<const uint2*>(p); }
template <typename W>
__device__ __forceinline__ float4 widen(typename Four<W>::T v);
template <>
__device__ __forceinline__ float4 widen<float>(float4 v) { return v; }
template <>
__device__ __forceinline__ float4 widen<__nv_bfloat16>(uint2 v) {
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
template <>
__device__ __forceinline__ float4 widen<__half>(uint2 v) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

// ---- attention of one row's query heads of one KV head group over the row's causal range (window start ..
// its position) of its request's pages, split over blocks: grid (rows, kv_heads, blocks), ATT_WARPS warps,
// where blocks is the most splits a range of the engine's max_seq takes (mdsl/serving/gpu.py).
// The row's range of n keys is cut into splits of `split` keys anchored at its first position (split s: keys
// lo + s * split ..), split = 64 * max(1, ceil(n / (64 * ATT_MAX_SPLITS))): 64 keys where that makes
// ATT_MAX_SPLITS or fewer, else the multiple of 64 that does. Which keys a split holds depends on the row's
// own range alone (never on max_seq or the step); a block past the row's splits returns at once. Within a
// split, warp w takes the w-th quarter of the keys and walks them in chunks of C keys in order, a chunk's
// keys and values loaded together: lane l holds dims 4l .. 4l + 3 (and 128 on) of each key and query (the
// keys' and values' W widened to float where used; a warp's load is 128 contiguous dims of a key, 512 bytes
// of float pools, 256 of 16-bit ones), a score is the warp's xor-tree sum, and the warp keeps an online
// softmax (running max, sum and weighted values). The block then folds its warps in warp order into the
// split's partial (max, sum, weighted values per query head); the block of the row and KV head that
// finishes last folds the splits' partials in split order into the output. Every order is fixed by the row:
// the result is the same whatever rows share the step, however many splits run at once.

constexpr int ATT_WARPS = 4;
constexpr int ATT_THREADS = ATT_WARPS * WARP;
constexpr int MAX_DIM = 256;     // head dim: at most two float4 a lane
constexpr int ATT_SPLIT_KEYS = 64;   // a split's keys where the range allows (a warp's 16 in one to four chunks)
// The most splits of a row's range. A long range at batch 1 needs many to read its pages at full bandwidth
// (each warp has a chunk's keys in flight): a 32k-key range over 8 KV heads makes 8 * 64 = 512 blocks of 512
// keys, one wave of the H200's 132 SMs at the 4 blocks an SM that the registers of 2 or 4 query heads a KV
// head allow (16-bit pools), where 32 splits filled half of it and 128 would make two waves of the same
// keys. The partials are sized for it: rows * q_heads * min(64, ceil(max_seq / 64)) * (dim + 4) floats (at
// 256 rows, 32 query heads of 128 dims and max_seq 4096 or more: 277 MB), and the fold reads one record a
// split a value.
constexpr int ATT_MAX_SPLITS = 64;
constexpr float SKIPPED = -1.0f;     // the fold's weight of a split without scores (a weight is never negative)

// 2^x, a subnormal result flushed to zero: one MUFU.EX2 (exp2f without fast math adds five instructions)
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The fold of a row's splits, one split after another in split order: a running (max, sum, values) meets
// split k's partial (max m_k, sum l_k, values v_k) as top' = max(top, m_k), sum = l_k w + sum u and
// values = v_k w + values u, of weights u = exp(top - top') (0 while nothing is folded) and w = exp(m_k - top')
// (BASE2: 2^(..), the maxima of scores in base 2); a split without scores (max -inf) is left out. The output
// is values / sum. Each step depends on the splits before it alone, so a block that walks a row's splits in
// order folds them as it goes (attention_mma.cuh, a tile's item of all its splits) to the same bits as
// fold_splits over their written partials.
struct FoldWeights {
  float kept, added;   // u and w
};
template <bool BASE2>
__device__ __forceinline__ FoldWeights fold_weights(float& top, float mk) {
  const float next = fmaxf(top, mk);
  const FoldWeights w{top == -INF ? 0.0f : BASE2 ? ex2(top - next) : __expf(top - next),
                      BASE2 ? ex2(mk - next) : __expf(mk - next)};
  top = next;
  return w;
}
// (rounded products and sums, never contracted otherwise: the one arithmetic wherever a fold runs)
__device__ __forceinline__ float fold_in(float sofar, float x, FoldWeights w) {
  return __fmaf_rn(x, w.added, __fmul_rn(sofar, w.kept));
}

// Where attention writes a row's values: its float32 output, or, with `rounded`, the same places of a buffer of
// 16-bit values rounded to the o linear's dtype (1: bf16, 2: f16), the rows that linear alone reads and
// loads by TMA (gpu_wgmma.py's handed rows: the float32 rows are then never written, nor read back)
struct RowsOut {
  float* out;
  void* rounded;
  int kind;

  __device__ __forceinline__ void put(long long i, float v) const {
    if (!rounded)
      out[i] = v;
    else if (kind == 1)
      static_cast<__nv_bfloat16*>(rounded)[i] = __float2bfloat16_rn(v);
    else
      static_cast<__half*>(rounded)[i] = __float2half_rn(v);
  }
  // values i and i + 1 (i even), as one store
  __device__ __forceinline__ void put2(long long i, float2 v) const {
    if (!rounded)
      *reinterpret_cast<float2*>(out + i) = v;
    else if (kind == 1)
      *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(rounded) + i) = __floats2bfloat162_rn(v.x, v.y);
    else
      *reinterpret_cast<__half2*>(static_cast<__half*>(rounded) + i) = __floats2half2_rn(v.x, v.y);
  }
};

// The weights of one query head's splits (records `recs`: (dim values, max, sum, padding) per split), by the
// lanes of one warp: the running max before and after split k is a prefix maximum (a maximum is the same in
// any order), so lane k % 32 takes split k's weights, fold_weights of those two, into kept[k] and added[k]
// (kept SKIPPED for a split without scores); lane 0 then folds the sums in split order and returns the head's
// sum (the other lanes' answer is unused)
template <bool BASE2>
__device__ float split_weights(const float* recs, int dim, int splits, float* kept, float* added, float* sums) {
  const int lane = threadIdx.x % WARP, record = dim + 4;
  float carry = -INF;   // (the maximum of the splits before this round's)
  for (int k0 = 0; k0 < splits; k0 += WARP) {
    const int k = k0 + lane;
    const float mk = k < splits ? __ldcg(recs + k * record + dim) : -INF;
    float top = mk;   // (the inclusive prefix maximum over the round's lanes)
#pragma unroll
    for (int o = 1; o < WARP; o *= 2) {
      const float y = __shfl_up_sync(0xffffffffu, top, o);
      if (lane >= o) top = fmaxf(top, y);
    }
    top = fmaxf(top, carry);
    float before = __shfl_up_sync(0xffffffffu, top, 1);
    if (lane == 0) before = carry;
    carry = __shfl_sync(0xffffffffu, top, WARP - 1);
    if (k < splits) {
      sums[k] = __ldcg(recs + k * record + dim + 1);
      if (mk == -INF) {
        kept[k] = SKIPPED;
      } else {
        const FoldWeights w = fold_weights<BASE2>(before, mk);
        kept[k] = w.kept;
        added[k] = w.added;
      }
    }
  }
  __syncwarp();
  float sum = 0.0f;
  if (lane == 0)
    for (int k = 0; k < splits; ++k)
      if (kept[k] != SKIPPED) sum = fold_in(sum, sums[k], FoldWeights{kept[k], added[k]});
  return sum;
}

// One value's fold over the splits (`at`: its place in split 0's record, `record` floats a split), by the
// weights split_weights left: FOLD_LOADS splits' values loaded at once (load_values), then folded in split
// order; `v` holds the first batch, loaded by the caller (which may have other work in flight meanwhile). The
// fold's order and arithmetic are one value's whatever the batch
constexpr int FOLD_LOADS = 16;
__device__ __forceinline__ void load_values(float (&v)[FOLD_LOADS], const float* at, int record, int k0, int splits) {
#pragma unroll
  for (int i = 0; i < FOLD_LOADS; ++i) v[i] = k0 + i < splits ? __ldcg(at + (k0 + i) * record) : 0.0f;
}
__device__ __forceinline__ float fold_value(float (&v)[FOLD_LOADS], const float* at, int record, int splits,
                                            const float* kept, const float* added) {
  float total = 0.0f;
  for (int k0 = 0; k0 < splits; k0 += FOLD_LOADS) {
    if (k0 > 0) load_values(v, at, record, k0, splits);
#pragma unroll
    for (int i = 0; i < FOLD_LOADS; ++i)
      if (k0 + i < splits && kept[k0 + i] != SKIPPED)
        total = fold_in(total, v[i], FoldWeights{kept[k0 + i], added[k0 + i]});
  }
  return total;
}

// fold_splits: the fold of a row's splits for the G query heads h * G .. of KV head h, by the block's
// ATT_WARPS warps, once every split's partial is in `part` (records of (dim values, max, sum, padding) per
// row, query head and split of max_splits): per query head, the splits' weights once (split_weights, a warp
// a head), then each value's fold over the splits by those weights (fold_value). The CUDA-core kernel ends
// with it; attention_mma's partials are folded by fold_head, a block a query head, to the same bits.
template <int G, bool BASE2 = false>
__device__ void fold_splits(RowsOut out, const float* part, int r, int h, int q_heads, int dim, int splits,
                            int max_splits) {
  __shared__ float kept[G][ATT_MAX_SPLITS], added[G][ATT_MAX_SPLITS], sums[G][ATT_MAX_SPLITS];
  __shared__ float head_sum[G];
  const int warp = threadIdx.x / WARP, record = dim + 4;
  for (int g = warp; g < G; g += ATT_WARPS) {
    const float* recs = part + ((long long)r * q_heads + h * G + g) * max_splits * record;
    const float sum = split_weights<BASE2>(recs, dim, splits, kept[g], added[g], sums[g]);
    if (threadIdx.x % WARP == 0) head_sum[g] = sum;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < G * dim; e += ATT_THREADS) {
    const int g = e / dim, d = e % dim;
    const float* at = part + ((long long)r * q_heads + h * G + g) * max_splits * record + d;
    float v[FOLD_LOADS];
    load_values(v, at, record, 0, splits);
    out.put(((long long)r * q_heads + h * G + g) * dim + d, fold_value(v, at, record, splits, kept[g], added[g]) /
                                                            head_sum[g]);
  }
  __syncthreads();   // (the shared weights are free for the next fold)
}

// The fold of query head q's splits of row r by a block of its own: fold_splits' arithmetic for one head, its
// values' first loads issued before the weights are computed (the two latencies overlap), a value a thread
// (a head dim up to ATT_THREADS: one round)
template <bool BASE2>
__device__ void fold_head(RowsOut out, const float* part, int r, int q, int q_heads, int dim, int splits,
                          int max_splits) {
  __shared__ float kept[ATT_MAX_SPLITS], added[ATT_MAX_SPLITS], sums[ATT_MAX_SPLITS];
  __shared__ float head_sum;
  const int record = dim + 4;
  const float* recs = part + ((long long)r * q_heads + q) * max_splits * record;
  for (int d0 = 0; d0 < dim; d0 += ATT_THREADS) {
    const int d = d0 + threadIdx.x;
    const float* at = recs + (d < dim ? d : 0);
    float v[FOLD_LOADS];   // (the first batch of this value's splits, loading while the weights are made)
    load_values(v, at, record, 0, d < dim ? splits : 0);
    if (d0 == 0) {
      if (threadIdx.x < WARP) {
        const float sum = split_weights<BASE2>(recs, dim, splits, kept, added, sums);
        if (threadIdx.x == 0) head_sum = sum;
      }
      __syncthreads();
    }
    if (d < dim)
      out.put(((long long)r * q_heads + q) * dim + d, fold_value(v, at, record, splits, kept, added) / head_sum);
  }
}

// G query heads per KV head; DV float4s a lane holds of a head (dim <= 128 * DV); pools of W
template <int G, int DV, typename W>
__device__ void attention(RowsOut out, float* part, int* arrivals, const float* qkv, const W* k_pool, const W* v_pool,
                          const int* positions, const int* entries, const int* page_table, int pages_per_request,
                          int page_size, int q_heads, int kv_heads, int dim, float scale, float softcap, int window) {
  // keys (and values) a warp has in flight, as registers allow: twice as many of 16-bit pools (a key's
  // values take half the registers until used), so that a warp reads as many bytes at once as of float pools
  constexpr int C = (G * DV <= 2 ? 8 : G * DV <= 8 ? 4 : 2) * (sizeof(W) == 2 && G * DV <= 8 ? 2 : 1);
  using Raw = typename Four<W>::T;
  __shared__ float wm[ATT_WARPS][G], wl[ATT_WARPS][G];
  __shared__ float4 wacc[ATT_WARPS][G][DV * WARP];
  __shared__ int last;
  const int r = blockIdx.x, h = blockIdx.y, s = blockIdx.z, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
  const int pos = positions[r];
  const int lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
  const int n = pos - lo + 1, most = ATT_SPLIT_KEYS * ATT_MAX_SPLITS;
  const int split = ATT_SPLIT_KEYS * max(1, (n + most - 1) / most), splits = (n + split - 1) / split;
  const int max_splits = gridDim.z;   // (the partials' records a row and query head)
  if (s >= splits) return;
  const int first = lo + s * split, end = min(pos + 1, first + split);       // keys [first, end)
  const int quarter = (split + ATT_WARPS - 1) / ATT_WARPS;
  const int k0 = first + warp * quarter, k1 = min(end, k0 + quarter);
  const int* table = page_table + (long long)entries[r] * pages_per_request;
  const int heads = q_heads + 2 * kv_heads;
  const float* row = qkv + (long long)r * heads * dim;
  float4 q[G][DV], acc[G][DV];
  float m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INF;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < DV; ++i) {
      const int d = 4 * lane + 128 * i;
      q[g][i] = d < dim ? *reinterpret_cast<const float4*>(row + (h * G + g) * dim + d) : make_float4(0, 0, 0, 0);
      acc[g][i] = make_float4(0, 0, 0, 0);
    }
  }
  const long long stride = (long long)kv_heads * dim;
  for (int j0 = k0; j0 < k1; j0 += C) {
    // the chunk's keys and values loaded together (one memory round trip a chunk)
    Raw kc[C][DV], vc[C][DV];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int j = j0 + c < k1 ? j0 + c : j0;
      const long long at = ((long long)table[j / page_size] * page_size + j % page_size) * stride + (long long)h * dim;
#pragma unroll
      for (int i = 0; i < DV; ++i) {
        const int d = 4 * lane + 128 * i;
        const bool live = j0 + c < k1 && d < dim;
        kc[c][i] = live ? load4<W>(k_pool + at + d) : Raw{};
        vc[c][i] = live ? load4<W>(v_pool + at + d) : Raw{};
      }
    }
    float sc[C][G];
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < DV; ++i) {
          const float4 key = widen<W>(kc[c][i]);
          dot = fmaf(q[g][i].x, key.x, dot);
          dot = fmaf(q[g][i].y, key.y, dot);
          dot = fmaf(q[g][i].z, key.z, dot);
          dot = fmaf(q[g][i].w, key.w, dot);
        }
        float v = __shfl_sync(0xffffffffu, warp_sum(dot), 0) * scale;
        if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
        sc[c][g] = j0 + c < k1 ? v : -INF;
      }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float top = m[g];
#pragma unroll
      for (int c = 0; c < C; ++c) top = fmaxf(top, sc[c][g]);
      const float rescale = m[g] == -INF ? 0.0f : __expf(m[g] - top);
      m[g] = top;
      float sum = 0.0f;
      float4 tile[DV];
#pragma unroll
      for (int i = 0; i < DV; ++i) tile[i] = make_float4(0, 0, 0, 0);
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const float p = sc[c][g] == -INF ? 0.0f : __expf(sc[c][g] - top);
        sum += p;
#pragma unroll
        for (int i = 0; i < DV; ++i) {
          const float4 value = widen<W>(vc[c][i]);
          tile[i].x = fmaf(p, value.x, tile[i].x);
          tile[i].y = fmaf(p, value.y, tile[i].y);
          tile[i].z = fmaf(p, value.z, tile[i].z);
          tile[i].w = fmaf(p, value.w, tile[i].w);
        }
      }
      l[g] = fmaf(l[g], rescale, sum);
#pragma unroll
      for (int i = 0; i < DV; ++i) {
        acc[g][i].x = fmaf(acc[g][i].x, rescale, tile[i].x);
        acc[g][i].y = fmaf(acc[g][i].y, rescale, tile[i].y);
        acc[g][i].z = fmaf(acc[g][i].z, rescale, tile[i].z);
        acc[g][i].w = fmaf(acc[g][i].w, rescale, tile[i].w);
      }
    }
  }
  // the warps folded in warp order into the split's partial: [row, q head, split] of (dim values, max, sum, pad)
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      wm[warp][g] = m[g];
      wl[warp][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < DV; ++i) wacc[warp][g][lane + WARP * i] = acc[g][i];
  }
  __syncthreads();
  const int record = dim + 4;   // (dim values, max, sum, padding: 16-byte aligned records)
  for (int e = threadIdx.x; e < G * DV * WARP; e += ATT_THREADS) {
    const int g = e / (DV * WARP), v = e % (DV * WARP), d = 4 * (v % WARP) + 128 * (v / WARP);
    float top = -INF;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) top = fmaxf(top, wm[w][g]);
    float sum = 0.0f;
    float4 total = make_float4(0, 0, 0, 0);
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) {
      if (wm[w][g] == -INF) continue;   // a warp without keys
      const float f = __expf(wm[w][g] - top);
      sum = fmaf(wl[w][g], f, sum);
      const float4 a = wacc[w][g][v];
      total.x = fmaf(a.x, f, total.x);
      total.y = fmaf(a.y, f, total.y);
      total.z = fmaf(a.z, f, total.z);
      total.w = fmaf(a.w, f, total.w);
    }
    float* rec = part + (((long long)r * q_heads + h * G + g) * max_splits + s) * record;
    if (d < dim) *reinterpret_cast<float4*>(rec + d) = total;
    if (v == 0) {
      rec[dim] = top;
      rec[dim + 1] = sum;
    }
  }
  // the last of the row's splits to finish (of this KV head) folds them in split order
  if (splits > 1) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      int* count = arrivals + (long long)r * kv_heads + h;
      last = atomicAdd(count, 1) == splits - 1;
      if (last) *count = 0;   // ready for the next step
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
  } else {
    __syncthreads();
  }
  fold_splits<G>(out, part, r, h, q_heads, dim, splits, max_splits);
}

// ---- element-wise ops of a row

using mdsl_act::activate;   // (activations.cuh, prepended to this source)
using mdsl_act::gated;

// act_mul: out[r, i] = act(gu[r, i]) * gu[r, half + i]; where half is a multiple of 4 and the rows lie on 16
// bytes, a thread's elements are four consecutive ones, read and written as 16-byte vectors (the host's grid
// gives such a row a quarter of the threads: act_mul_grid)
__device__ void act_mul(float* out, const float* gu, int half, int act) {
  const long long in = (long long)blockIdx.x * 2 * half, o = (long long)blockIdx.x * half;
  const unsigned long long bases = reinterpret_cast<unsigned long long>(out) | reinterpret_cast<unsigned long long>(gu);
  if (half % 4 == 0 && (bases & 15) == 0) {
    for (int i = 4 * ELEMENT; i < half; i += 4 * ELEMENTS) {
      const float4 g = *reinterpret_cast<const float4*>(gu + in + i);
      const float4 u = *reinterpret_cast<const float4*>(gu + in + half + i);
      *reinterpret_cast<float4*>(out + o + i) =
          make_float4(gated(g.x, u.x, act), gated(g.y, u.y, act), gated(g.z, u.z, act), gated(g.w, u.w, act));
    }
    return;
  }
  for (int i = ELEMENT; i < half; i += ELEMENTS) out[o + i] = gated(gu[in + i], gu[in + half + i], act);
}

// gated_scale: out[r, i] = act(gate[r]) * x[r, i] (a shared expert's output times sigmoid of its gate)
__device__ void gated_scale(float* out, const float* x, const float* gate, int width, int act) {
  const long long base = (long long)blockIdx.x * width;
  const float a = activate(gate[blockIdx.x], act);
  for (int i = ELEMENT; i < width; i += ELEMENTS) out[base + i] = __fmul_rn(a, x[base + i]);
}

// an element-wise function of a row: kind 0, x * param (scaled embeddings); 1, param * tanh(x / param)
// (soft-capped logits)
__device__ void map_rows(float* out, const float* x, int width, int kind, float param) {
  const long long base = (long long)blockIdx.x * width;
  for (int i = ELEMENT; i < width; i += ELEMENTS)
    out[base + i] = kind == 0 ? __fmul_rn(x[base + i], param) : __fmul_rn(tanhf(__fdiv_rn(x[base + i], param)), param);
}

__device__ void add(float* out, const float* x, const float* y, int width) {
  const long long base = (long long)blockIdx.x * width;
  for (int i = ELEMENT; i < width; i += ELEMENTS) out[base + i] = __fadd_rn(x[base + i], y[base + i]);
}

// ---- a mixture of experts (moe_router, moe_experts): each row's router picks its own top_k experts, whose gated
// MLPs alone are read for the row. A row's logits, probabilities and products are its own warps' fixed orders
// (lane-strided sums, the xor tree, lane 0's result), so its experts and its output do not depend on the other
// rows of the step.

constexpr int MOE_WARPS = 8;
constexpr int MOE_MAX_EXPERTS = 1024;   // a row's probabilities in shared memory
constexpr int MOE_MAX_K = 32;

// The step's plan of its mixture of experts: the experts its rows picked and, for each, the rows that picked it.
// plan[0]: their count; plan[1 + 3i .. 3 + 3i]: the i-th picked expert (in expert order), the first of its (row,
// slot) pairs and their count; the pairs from plan + MOE_PAIRS (row, then the row's slot of the expert: its picks
// before it), each expert's in row order. One block of MOE_MAX_EXPERTS threads, thread e expert e's (counts and
// their prefix sums by warp shuffles, then the warps' totals in warp order), so the lists are made once a step
// rather than by every block of moe_up and moe_down.
constexpr int MOE_PAIRS = 1 + 3 * MOE_MAX_EXPERTS;
__device__ void moe_plan(int* plan, const float* routing, int rows, int experts) {
  __shared__ int pairs_of[MOE_MAX_EXPERTS / WARP], picked_of[MOE_MAX_EXPERTS / WARP];
  const int e = threadIdx.x, warp = e / WARP, lane = e % WARP;
  int mine = 0;
  for (int r = 0; e < experts && r < rows; ++r) mine += routing[(long long)r * experts + e] != 0.0f;
  int upto = mine;   // (the warp's inclusive prefix sum of the counts)
#pragma unroll
  for (int o = 1; o < WARP; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, upto, o);
    if (lane >= o) upto += v;
  }
  const unsigned used = __ballot_sync(0xffffffffu, mine > 0);
  if (lane == WARP - 1) pairs_of[warp] = upto;
  if (lane == 0) picked_of[warp] = __popc(used);
  __syncthreads();
  int first = upto - mine, index = __popc(used & ((1u << lane) - 1u));
  for (int w = 0; w < warp; ++w) {
    first += pairs_of[w];
    index += picked_of[w];
  }
  if (mine > 0) {
    plan[1 + 3 * index] = e;
    plan[2 + 3 * index] = first;
    plan[3 + 3 * index] = mine;
    int* pair = plan + MOE_PAIRS + 2 * first;
    for (int r = 0; r < rows; ++r) {
      const float* route = routing + (long long)r * experts;
      if (route[e] == 0.0f) continue;
      int j = 0;
      for (int f = 0; f < e; ++f) j += route[f] != 0.0f;
      pair[0] = r;
      pair[1] = j;
      pair += 2;
    }
  }
  if (e == 0) {
    int total = 0;
    for (int w = 0; w < MOE_MAX_EXPERTS / WARP; ++w) total += picked_of[w];
    plan[0] = total;
  }
}

// ROWS rows' dot products with one weight row w (k values), the row vectors of each from its own input row xs[i]
// (`n` of them in use): every weight vector loaded once for the rows, each row summed alone (lane l the vectors l,
// l + 32, ... in order, then the xor tree, lane 0's), so a row's bits are the same however many rows share the
// weight
template <typename W>
__device__ __forceinline__ void rows_dot(const W* w, const float* const (&xs)[ROWS], int n, int k, float (&out)[ROWS]) {
  constexpr int VEC = 16 / sizeof(W);
  const int lane = threadIdx.x % WARP;
  float acc[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) acc[i] = 0.0f;
  if (k % VEC == 0) {
    for (int v0 = lane * VEC; v0 < k; v0 += WARP * VEC) {
      float wv[VEC];
      load_vec<W>(w + v0, wv);
#pragma unroll
      for (int i = 0; i < ROWS; ++i)
        if (i < n) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[i] = fmaf(wv[j], operand<W>(xs[i][v0 + j]), acc[i]);
        }
    }
  } else {
    for (int j = lane; j < k; j += WARP) {
      const float wv = to_f(w[j]);
#pragma unroll
      for (int i = 0; i < ROWS; ++i)
        if (i < n) acc[i] = fmaf(wv, operand<W>(xs[i][j]), acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < ROWS; ++i) out[i] = __shfl_sync(0xffffffffu, warp_sum(acc[i]), 0);
}

// sum_k w[k] * operand<W>(x[k]) by one warp, every lane given lane 0's: rows_dot of one row
template <typename W>
__device__ __forceinline__ float warp_dot(const W* w, const float* x, int k) {
  const float* xs[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) xs[i] = x;
  float out[ROWS];
  rows_dot<W>(w, xs, 1, k, out);
  return out[0];
}

// moe_router: routing[r] = the top_k of softmax(router x[r]) (the lower expert on ties), renormalised to sum to 1
// with norm_topk_prob, zero elsewhere (mdsl.megakernel.modelgraph.layers.route). One block of MOE_WARPS warps a
// row: warp w the logits of experts w, w + MOE_WARPS, ...; then warp 0 the softmax (the maximum, the exponentials'
// lane-strided sums, each probability divided by the sum) and top_k rounds of the largest probability left, the
// picked ones summed in top-k order.
template <typename W>
__device__ void moe_router(float* routing, const float* x, const W* router, int experts, int top_k, int k,
                           int norm_topk_prob) {
  __shared__ float p[MOE_MAX_EXPERTS];
  __shared__ int picked[MOE_MAX_K];
  __shared__ float value[MOE_MAX_K];
  const int r = blockIdx.x, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const float* xr = x + (long long)r * k;
  for (int e = warp; e < experts; e += MOE_WARPS) {
    const float z = warp_dot<W>(router + (long long)e * k, xr, k);
    if (lane == 0) p[e] = z;
  }
  __syncthreads();
  if (warp != 0) return;
  float top = -INF;
  for (int e = lane; e < experts; e += WARP) top = fmaxf(top, p[e]);
  top = __shfl_sync(0xffffffffu, warp_max(top), 0);
  float total = 0.0f;
  for (int e = lane; e < experts; e += WARP) {
    p[e] = expf(p[e] - top);
    total += p[e];
  }
  total = __shfl_sync(0xffffffffu, warp_sum(total), 0);
  float* out = routing + (long long)r * experts;
  for (int e = lane; e < experts; e += WARP) {
    p[e] = __fdiv_rn(p[e], total);
    out[e] = 0.0f;
  }
  __syncwarp();
  for (int j = 0; j < top_k; ++j) {
    float best = -1.0f;   // (probabilities are >= 0; a picked one is set to -1)
    int at = experts;
    for (int e = lane; e < experts; e += WARP)
      if (p[e] > best) {   // (a lane's experts in increasing order: its first largest)
        best = p[e];
        at = e;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, o);
      const int where = __shfl_xor_sync(0xffffffffu, at, o);
      if (other > best || (other == best && where < at)) {
        best = other;
        at = where;
      }
    }
    if (lane == 0) {
      picked[j] = at;
      value[j] = best;
      p[at] = -1.0f;
    }
    __syncwarp();
  }
  if (lane == 0) {
    float sum = 0.0f;
    for (int j = 0; j < top_k; ++j) sum = __fadd_rn(sum, value[j]);
    for (int j = 0; j < top_k; ++j) out[picked[j]] = norm_topk_prob ? __fdiv_rn(value[j], sum) : value[j];
  }
}

// moe_experts' first part: hidden[r, j, c] = act((gate_e x[r])[c]) * (up_e x[r])[c] for every row r that picked
// expert e, j its slot; grid (the most experts a step can pick, column blocks): block x takes the plan's x-th picked
// expert's columns (past the plan's count a block exits), a warp one column, every weight row read once a step for
// all the rows that picked its expert, ROWS of them a pass. `weights`: the E gate, E up and E down weights'
// addresses.
template <typename W>
__device__ void moe_up(float* hidden, const float* x, const int* plan, const void* const* weights, int experts,
                       int top_k, int k, int inter, int act) {
  if (int(blockIdx.x) >= plan[0]) return;
  const int* entry = plan + 1 + 3 * blockIdx.x;
  const int e = entry[0], n = entry[2], warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int* pairs = plan + MOE_PAIRS + 2 * entry[1];   // (row, slot) of each row that picked e
  const W* gate = static_cast<const W*>(weights[e]);
  const W* up = static_cast<const W*>(weights[experts + e]);
  for (int c = blockIdx.y * MOE_WARPS + warp; c < inter; c += gridDim.y * MOE_WARPS) {
    for (int i0 = 0; i0 < n; i0 += ROWS) {
      const float* xs[ROWS];
#pragma unroll
      for (int i = 0; i < ROWS; ++i) xs[i] = x + (long long)pairs[2 * (i0 + i < n ? i0 + i : i0)] * k;
      float g[ROWS], u[ROWS];
      rows_dot<W>(gate + (long long)c * k, xs, n - i0, k, g);
      rows_dot<W>(up + (long long)c * k, xs, n - i0, k, u);
      if (lane == 0) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i)
          if (i0 + i < n) {
            const long long slot = (long long)pairs[2 * (i0 + i)] * top_k + pairs[2 * (i0 + i) + 1];
            hidden[slot * inter + c] = gated(g[i], u[i], act);
          }
      }
    }
  }
}

// moe_experts' second part: products[r, j, c] = (down_e hidden[r, j])[c] for every row r that picked expert e, j
// its slot; grid and blocks as moe_up's
template <typename W>
__device__ void moe_down(float* products, const float* hidden, const int* plan, const void* const* weights,
                         int experts, int top_k, int h, int inter) {
  if (int(blockIdx.x) >= plan[0]) return;
  const int* entry = plan + 1 + 3 * blockIdx.x;
  const int e = entry[0], n = entry[2], warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int* pairs = plan + MOE_PAIRS + 2 * entry[1];
  const W* down = static_cast<const W*>(weights[2 * experts + e]);
  for (int c = blockIdx.y * MOE_WARPS + warp; c < h; c += gridDim.y * MOE_WARPS) {
    for (int i0 = 0; i0 < n; i0 += ROWS) {
      const float* xs[ROWS];
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        const int at = i0 + i < n ? i0 + i : i0;
        xs[i] = hidden + ((long long)pairs[2 * at] * top_k + pairs[2 * at + 1]) * inter;
      }
      float s[ROWS];
      rows_dot<W>(down + (long long)c * inter, xs, n - i0, inter, s);
      if (lane == 0) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i)
          if (i0 + i < n) products[((long long)pairs[2 * (i0 + i)] * top_k + pairs[2 * (i0 + i) + 1]) * h + c] = s[i];
      }
    }
  }
}

// moe_experts' output: out[r, c] = the sum over the row's picked experts e, in expert order (its slots' order), of
// routing[r, e] * products[r, slot, c], in float32 (the reference's order); a thread a column of a row
__device__ void moe_sum(float* out, const float* products, const float* routing, int experts, int top_k, int h) {
  const int r = blockIdx.x;
  const float* route = routing + (long long)r * experts;
  for (int c = ELEMENT; c < h; c += ELEMENTS) {
    float acc = 0.0f;
    for (int e = 0, j = 0; e < experts && j < top_k; ++e) {
      const float weight = route[e];
      if (weight == 0.0f) continue;
      acc = __fadd_rn(acc, __fmul_rn(weight, products[((long long)r * top_k + j) * h + c]));
      ++j;
    }
    out[(long long)r * h + c] = acc;
  }
}

// the rows `keep` of x, in order (past the last KV write only the rows that sample go on)
__device__ void gather(float* out, const float* x, const int* keep, int width) {
  const long long from = (long long)keep[blockIdx.x] * width, to = (long long)blockIdx.x * width;
  for (int i = ELEMENT; i < width; i += ELEMENTS) out[to + i] = x[from + i];
}

}  // namespace serve

// NAME_SUFFIX: serve::NAME for weights of type TYPE (ARGS name it W)
#define WEIGHTED(NAME, SUFFIX, TYPE, PARAMS, ARGS) \
  extern "C" __global__ void NAME##_##SUFFIX PARAMS {  \
    using W = TYPE;                                    \
    mdsl_pdl::step_wait();                             \
    serve::NAME<W> ARGS;                               \
  }
#define EVERY_DTYPE(NAME, PARAMS, ARGS)         \
  WEIGHTED(NAME, f32, float, PARAMS, ARGS)      \
  WEIGHTED(NAME, bf16, __nv_bfloat16, PARAMS, ARGS) \
  WEIGHTED(NAME, f16, __half, PARAMS, ARGS)

EVERY_DTYPE(embedding, (float* out, const int* tokens, const void* table, int width),
            (out, tokens, static_cast<const W*>(table), width))
EVERY_DTYPE(rms_norm, (float* out, const float* x, const void* w, int width, float eps, int one_plus, void* rounded,
                       const float* squares),
            (out, x, static_cast<const W*>(w), width, eps, one_plus, static_cast<W*>(rounded), squares))
EVERY_DTYPE(linear, (float* out, const float* x, serve::Parts parts, const float* residual, int rows, int k,
                     int out_width, int offset),
            (out, x, parts, residual, rows, k, out_width, offset))
// the tensor-core linear, for the 16-bit weights
#define SIXTEEN_BIT(NAME, PARAMS, ARGS)         \
  WEIGHTED(NAME, bf16, __nv_bfloat16, PARAMS, ARGS) \
  WEIGHTED(NAME, f16, __half, PARAMS, ARGS)
SIXTEEN_BIT(linear_mma, (float* out, float* part, int* arrivals, const float* x, serve::Parts parts,
                         serve::TileStarts tiles, const float* residual, int rows, int k, int out_width, int offset),
            (out, part, arrivals, x, parts, tiles.start, residual, rows, k, out_width, offset))
EVERY_DTYPE(add_bias, (float* out, const float* x, const void* b, int width), (out, x, static_cast<const W*>(b), width))
EVERY_DTYPE(head_rms_norm, (float* out, const float* x, const void* wq, const void* wk, int q_heads, int kv_heads,
                            int dim, float eps),
            (out, x, static_cast<const W*>(wq), static_cast<const W*>(wk), q_heads, kv_heads, dim, eps))

// (head_norm_rope_W and rope_W with the KV append into pools of W where k_pool is not null: serve::Append)
EVERY_DTYPE(head_norm_rope, (float* out, const float* x, const void* wq, const void* wk, const float* cos_table,
                             const float* sin_table, const int* positions, int q_heads, int kv_heads, int dim,
                             float eps, void* k_pool, void* v_pool, const int* entries, const int* page_table,
                             int pages_per_request, int page_size),
            (out, x, static_cast<const W*>(wq), static_cast<const W*>(wk), cos_table, sin_table, positions, q_heads,
             kv_heads, dim, eps,
             serve::Append<W>{static_cast<W*>(k_pool), static_cast<W*>(v_pool), entries, page_table,
                              pages_per_request, page_size}))
EVERY_DTYPE(rope, (float* out, const float* x, const float* cos_table, const float* sin_table, const int* positions,
                   int q_heads, int kv_heads, int dim, void* k_pool, void* v_pool, const int* entries,
                   const int* page_table, int pages_per_request, int page_size),
            (out, x, cos_table, sin_table, positions, q_heads, kv_heads, dim,
             serve::Append<W>{static_cast<W*>(k_pool), static_cast<W*>(v_pool), entries, page_table,
                              pages_per_request, page_size}))
EVERY_DTYPE(kv_append, (void* k_pool, void* v_pool, const float* qkv, const int* positions, const int* entries,
                         const int* page_table, int pages_per_request, int page_size, int q_heads, int kv_heads,
                         int dim),
            (static_cast<W*>(k_pool), static_cast<W*>(v_pool), qkv, positions, entries, page_table, pages_per_request,
             page_size, q_heads, kv_heads, dim))
// attention for G query heads per KV head (1, 2, 4, 8 or 16) and head dims up to 128 * DV (mdsl/serving/gpu.py
// checks), over pools of each W: attention_G_DV_SUFFIX
#define ATTENTION_OF(G, DV, SUFFIX, TYPE)                                                                          \
  extern "C" __global__ void __launch_bounds__(serve::ATT_THREADS) attention_##G##_##DV##_##SUFFIX(                \
      float* out, float* part, int* arrivals, const float* qkv, const void* k_pool, const void* v_pool,          \
      const int* positions, const int* entries, const int* page_table, int pages_per_request, int page_size,     \
      int q_heads, int kv_heads, int dim, float scale, float softcap, int window, void* rounded, int kind) {     \
    mdsl_pdl::step_wait();                                                                                       \
    serve::attention<G, DV, TYPE>(serve::RowsOut{out, rounded, kind}, part, arrivals, qkv,                       \
                                  static_cast<const TYPE*>(k_pool),                                              \
                                  static_cast<const TYPE*>(v_pool), positions, entries, page_table,              \
                                  pages_per_request, page_size, q_heads, kv_heads, dim, scale, softcap, window); \
  }
#define ATTENTION(G, DV)                   \
  ATTENTION_OF(G, DV, f32, float)          \
  ATTENTION_OF(G, DV, bf16, __nv_bfloat16) \
  ATTENTION_OF(G, DV, f16, __half)
ATTENTION(1, 1)
ATTENTION(2, 1)
ATTENTION(4, 1)
ATTENTION(8, 1)
ATTENTION(16, 1)
ATTENTION(1, 2)
ATTENTION(2, 2)
ATTENTION(4, 2)
EVERY_DTYPE(moe_router, (float* routing, const float* x, const void* router, int experts, int top_k, int k,
                         int norm_topk_prob),
            (routing, x, static_cast<const W*>(router), experts, top_k, k, norm_topk_prob))
EVERY_DTYPE(moe_up, (float* hidden, const float* x, const int* plan, const void* const* weights, int experts, int top_k,
                     int k, int inter, int act),
            (hidden, x, plan, weights, experts, top_k, k, inter, act))
EVERY_DTYPE(moe_down, (float* products, const float* hidden, const int* plan, const void* const* weights, int experts,
                       int top_k, int h, int inter),
            (products, hidden, plan, weights, experts, top_k, h, inter))
extern "C" __global__ void __launch_bounds__(serve::MOE_MAX_EXPERTS) moe_plan(int* plan, const float* routing,
                                                                           int rows, int experts) {
  mdsl_pdl::step_wait();
  serve::moe_plan(plan, routing, rows, experts);
}
extern "C" __global__ void moe_sum(float* out, const float* products, const float* routing, int experts, int top_k,
                                   int h) {
  mdsl_pdl::step_wait();
  serve::moe_sum(out, products, routing, experts, top_k, h);
}
extern "C" __global__ void act_mul(float* out, const float* gu, int half, int act) {
  mdsl_pdl::step_wait();
  serve::act_mul(out, gu, half, act);
}
extern "C" __global__ void gated_scale(float* out, const float* x, const float* gate, int width, int act) {
  mdsl_pdl::step_wait();
  serve::gated_scale(out, x, gate, width, act);
}
extern "C" __global__ void add(float* out, const float* x, const float* y, int width) {
  mdsl_pdl::step_wait();
  serve::add(out, x, y, width);
}
extern "C" __global__ void map_rows(float* out, const float* x, int width, int kind, float param) {
  mdsl_pdl::step_wait();
  serve::map_rows(out, x, width, kind, param);
}
extern "C" __global__ void argmax_rows(int* best, const float* x, int width, int2* parts, int* counts) {
  mdsl_pdl::step_wait();
  serve::argmax_rows(best, x, width, parts, counts);
}
extern "C" __global__ void gather(float* out, const float* x, const int* keep, int width) {
  mdsl_pdl::step_wait();
  serve::gather(out, x, keep, width);
}

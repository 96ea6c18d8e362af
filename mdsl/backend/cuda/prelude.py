"""The device helpers every generated translation unit starts with (namespace `mdsl`).

Only cuda_fp16.h and cuda_bf16.h are included: under NVRTC the C standard headers do not exist and
the CCCL ones cost seconds of compile time, so the few traits needed are written here."""

INCLUDES = """\
#include <cuda_fp16.h>
#include <cuda_bf16.h>
"""

PRELUDE = r"""
namespace mdsl {

// ---- element types: every value is computed in f32 and rounded where it is stored
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(int x) { return static_cast<float>(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ int from_float<int>(float x) { return static_cast<int>(x); }

// a copy between two types goes through f32; between equal types it is exact (i32 included)
template <typename D, typename S> struct Convert {
  static __device__ __forceinline__ D run(S x) { return from_float<D>(to_float(x)); }
};
template <typename T> struct Convert<T, T> {
  static __device__ __forceinline__ T run(T x) { return x; }
};
template <typename D, typename S> __device__ __forceinline__ D convert(S x) { return Convert<D, S>::run(x); }

template <typename A, typename B> struct Same { static constexpr bool value = false; };
template <typename A> struct Same<A, A> { static constexpr bool value = true; };

template <int BYTES> struct Word;
template <> struct Word<2> { using type = unsigned short; };
template <> struct Word<4> { using type = unsigned int; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<16> { using type = uint4; };

// V consecutive elements: one access when the types agree (both sides aligned to it), else converted
template <int V, typename D, typename S>
__device__ __forceinline__ void copy(D* __restrict__ dst, const S* __restrict__ src) {
  if constexpr (Same<D, S>::value) {
    using W = typename Word<sizeof(S) * V>::type;
    *reinterpret_cast<W*>(dst) = *reinterpret_cast<const W*>(src);
  } else if constexpr (sizeof(D) * V <= 16 && sizeof(D) * V >= 2) {  // converted in registers, one store
    using W = typename Word<sizeof(D) * V>::type;
    union { W word; D lanes[V]; } out;
#pragma unroll
    for (int j = 0; j < V; ++j) out.lanes[j] = convert<D>(src[j]);
    *reinterpret_cast<W*>(dst) = out.word;
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) dst[j] = convert<D>(src[j]);
  }
}

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// exp(m - top) for online softmax; an empty running maximum (-inf) weighs nothing
__device__ __forceinline__ float rescale(float m, float top) { return m == neg_inf() ? 0.0f : expf(m - top); }

// The barrier of a block's threads: __syncthreads where the block is a kernel's own (BAR 0), else named barrier
// BAR over the THREADS threads (the first ones of the CUDA block) that run it as a task of a persistent worker,
// whose other warps (its scheduler) go on meanwhile (mdsl.backend.cuda.task)
template <int BAR, int THREADS>
__device__ __forceinline__ void block_sync() {
  if constexpr (BAR == 0)
    __syncthreads();
  else
    asm volatile("bar.sync %0, %1;\n" :: "n"(BAR), "n"(THREADS) : "memory");
}

// ---- reductions across the G consecutive lanes of a group (G a power of two, at most 32);
// every lane of the warp takes part, and every lane of a group ends with the group's result
struct Sum { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };
struct Max { __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); } };

template <int G, typename Op>
__device__ __forceinline__ float group_reduce(float v, Op op) {
#pragma unroll
  for (int o = G / 2; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// the same over a group of G consecutive threads that are G / 32 whole warps: each warp's result through
// `part` (shared, a float per warp of the block), combined in warp order on every thread of the group;
// every thread of the block takes part (two barriers: block_sync's)
template <int G, int BAR = 0, int THREADS = 0, typename Op>
__device__ __forceinline__ float warps_reduce(float v, Op op, float* part) {
  constexpr int WARPS = G / 32;
  v = group_reduce<32>(v, op);
  const int warp = threadIdx.x / 32, first = warp / WARPS * WARPS;
  if (threadIdx.x % 32 == 0) part[warp] = v;
  block_sync<BAR, THREADS>();
  v = part[first];
#pragma unroll
  for (int k = 1; k < WARPS; ++k) v = op(v, part[first + k]);
  block_sync<BAR, THREADS>();  // every group has read `part` before it is written again
  return v;
}

// V consecutive elements as floats, and back: one access (aligned to it) where V elements make a word
template <int V, typename T>
__device__ __forceinline__ void load_floats(float* x, const T* __restrict__ p) {
  if constexpr (V == 1) {
    x[0] = to_float(*p);
  } else {
    using W = typename Word<sizeof(T) * V>::type;
    union { W word; T lanes[V]; } in;
    in.word = *reinterpret_cast<const W*>(p);
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] = to_float(in.lanes[j]);
  }
}
template <int V, typename T>
__device__ __forceinline__ void store_floats(T* __restrict__ p, const float* x) {
  if constexpr (V == 1) {
    *p = from_float<T>(x[0]);
  } else if constexpr (sizeof(T) * V <= 16) {
    using W = typename Word<sizeof(T) * V>::type;
    union { W word; T lanes[V]; } out;
#pragma unroll
    for (int j = 0; j < V; ++j) out.lanes[j] = from_float<T>(x[j]);
    *reinterpret_cast<W*>(p) = out.word;
  } else {
    store_floats<V / 2>(p, x);
    store_floats<V / 2>(p + V / 2, x + V / 2);
  }
}

// ---- asynchronous copies (sm_80+): global -> shared without registers, waited for by group
template <int BYTES>
__device__ __forceinline__ void copy_async(void* dst, const void* src) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" :: "r"(s), "l"(src), "n"(BYTES) : "memory");
  }
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// wait until at most N of this thread's groups are still in flight
template <int N> __device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// ---- tensor cores (sm_80+): mma.sync m16n8k16, 16-bit operands E (__half or __nv_bfloat16), f32 accumulators
template <typename E> __device__ __forceinline__ unsigned pack(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&h);
}

template <typename E> struct Mma;
// D += A B for one 16x8x16 step; PTX names the 16-bit type (one instruction per type, so a macro)
#define MDSL_MMA_M16N8K16(E, PTX)                                                                          \
  template <> struct Mma<E> {                                                                              \
    static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) { \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 {%0,%1,%2,%3}, "             \
                   "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                               \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                         \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));                    \
    }                                                                                                      \
  };
MDSL_MMA_M16N8K16(__half, "f16")
MDSL_MMA_M16N8K16(__nv_bfloat16, "bf16")
#undef MDSL_MMA_M16N8K16

// ldmatrix: 8x8 16-bit matrices from shared memory into mma fragments, one row address a lane
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

// C = A B for BATCH matrices by the block's WARPS warps on tensor cores. A is BATCH x M x K (rows LDA
// apart, matrices SA apart; SA = 0 repeats one), B is BATCH x K x N (LDB, SB), C is BATCH x M x N (LDC,
// SC); elements outside M, N or K read as zero, so any size works (the bs1 cases have M = 2..16).
// C's 16x8 tiles are dealt to the warps in turn: fragment j of a warp accumulates tile warp + j WARPS.
// Operands stored in another type than E (f32 tiles) are rounded to E, as the program's dtype says.
template <typename E, int BATCH, int M, int N, int K, int WARPS>
struct BlockMma {
  static constexpr int TM = (M + 15) / 16, TN = (N + 7) / 8, TILES = BATCH * TM * TN;
  static constexpr int PER_WARP = (TILES + WARPS - 1) / WARPS;
  using Fragments = float[PER_WARP][4];

  // elements (r, c) and (r, c + 1) of a ROWS x COLS array (rows LD apart) as a pair of E
  template <int ROWS, int COLS, int LD, typename S>
  static __device__ __forceinline__ unsigned along_row(const S* p, int r, int c) {
    if constexpr (Same<S, E>::value && LD % 2 == 0 && COLS % 2 == 0) {  // c is even: one aligned 4-byte load
      return (r < ROWS && c < COLS) ? *reinterpret_cast<const unsigned*>(p + r * LD + c) : 0u;
    } else {
      const float lo = (r < ROWS && c < COLS) ? to_float(p[r * LD + c]) : 0.0f;
      const float hi = (r < ROWS && c + 1 < COLS) ? to_float(p[r * LD + c + 1]) : 0.0f;
      return pack<E>(lo, hi);
    }
  }
  // elements (r, c) and (r + 1, c)
  template <int ROWS, int COLS, int LD, typename S>
  static __device__ __forceinline__ unsigned along_column(const S* p, int r, int c) {
    if constexpr (Same<S, E>::value) {  // the two 16-bit values side by side, no conversion
      union { unsigned word; unsigned short half[2]; } pair;
      const unsigned short* const bits = reinterpret_cast<const unsigned short*>(p);
      pair.half[0] = (r < ROWS && c < COLS) ? bits[r * LD + c] : 0;
      pair.half[1] = (r + 1 < ROWS && c < COLS) ? bits[(r + 1) * LD + c] : 0;
      return pair.word;
    } else {
      const float lo = (r < ROWS && c < COLS) ? to_float(p[r * LD + c]) : 0.0f;
      const float hi = (r + 1 < ROWS && c < COLS) ? to_float(p[(r + 1) * LD + c]) : 0.0f;
      return pack<E>(lo, hi);
    }
  }

  // B's fragments (k0..k0+15, n0..n0+7) of a K x N row-major matrix: ldmatrix.trans where the rows are
  // 16-byte aligned whole 8-element groups, else element by element (zeros outside)
  template <int LDB, typename TB>
  static __device__ __forceinline__ void b_fragment(unsigned (&fb)[2], const TB* w, int k0, int n0) {
    if constexpr (Same<TB, E>::value && LDB % 8 == 0 && N % 8 == 0 && K % 16 == 0) {
      ldmatrix_x2_trans(fb, w + (k0 + threadIdx.x % 16) * LDB + n0);
    } else {
      const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
      fb[0] = along_column<K, N, LDB>(w, k0 + 2 * t, n0 + g);
      fb[1] = along_column<K, N, LDB>(w, k0 + 2 * t + 8, n0 + g);
    }
  }

  static __device__ __forceinline__ void zero(Fragments& acc) {
#pragma unroll
    for (int j = 0; j < PER_WARP; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
  }

  // acc += A B (each warp its tiles)
  template <int LDA, int SA, int LDB, int SB, typename TA, typename TB>
  static __device__ __forceinline__ void multiply(Fragments& acc, const TA* __restrict__ A, const TB* __restrict__ B) {
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int j = 0; j < PER_WARP; ++j) {
      const int tile = warp + j * WARPS;
      if (tile < TILES) {  // the same on the whole warp, as mma.sync needs
        const int b = tile / (TM * TN), m0 = (tile / TN) % TM * 16, n0 = tile % TN * 8;
        const TA* const a = A + b * SA;
        const TB* const w = B + b * SB;
#pragma unroll 4
        for (int k0 = 0; k0 < K; k0 += 16) {
          const unsigned fa[4] = {along_row<M, K, LDA>(a, m0 + g, k0 + 2 * t), along_row<M, K, LDA>(a, m0 + g + 8, k0 + 2 * t),
                                  along_row<M, K, LDA>(a, m0 + g, k0 + 2 * t + 8),
                                  along_row<M, K, LDA>(a, m0 + g + 8, k0 + 2 * t + 8)};
          unsigned fb[2];
          b_fragment<LDB>(fb, w, k0, n0);
          Mma<E>::run(acc[j], fa, fb);
        }
      }
    }
  }

  // f(running element, product element, matrix, row, column) on every element of C the warp holds
  template <typename R, typename F>
  static __device__ __forceinline__ void each(R& running, const Fragments& product, F f) {
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int j = 0; j < PER_WARP; ++j) {
      const int tile = warp + j * WARPS;
      if (tile < TILES) {
        const int b = tile / (TM * TN), m0 = (tile / TN) % TM * 16, n0 = tile % TN * 8;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = m0 + g + (e / 2) * 8, n = n0 + 2 * t + e % 2;
          if (m < M && n < N) f(running[j][e], product[j][e], b, m, n);
        }
      }
    }
  }

  // C = acc, rounded to C's type
  template <int LDC, int SC, typename TC>
  static __device__ __forceinline__ void store(const Fragments& acc, TC* __restrict__ C) {
    each(acc, acc, [&](float value, float, int b, int m, int n) { C[b * SC + m * LDC + n] = from_float<TC>(value); });
  }
};

// ---- row-resident tensor-core values: warp w owns the 16-row tiles w, w + WARPS, ... of BATCH x M rows
// and every column of them, in mma C-fragment layout (thread g = lane / 4, t = lane % 4 holds rows g and
// g + 8 of a tile, columns 2t and 2t + 1 of each 8-column group). Row reductions need only the 4 lanes of
// a quad, and a product can feed the next mma as its A operand straight from registers (no shared memory).
template <typename E, int BATCH, int M, int N, int K, int WARPS>
struct RowMma : BlockMma<E, BATCH, M, N, K, WARPS> {
  using Base = BlockMma<E, BATCH, M, N, K, WARPS>;
  static constexpr int TM = (M + 15) / 16, TN = (N + 7) / 8, TK = (K + 7) / 8, ROW_TILES = BATCH * TM;
  static constexpr int RT = (ROW_TILES + WARPS - 1) / WARPS;
  using Matrix = float[RT][TN][4];

  // the row tile this warp's j-th is (over BATCH x TM), or -1: the same on the whole warp
  static __device__ __forceinline__ int tile(int j) {
    const int t = threadIdx.x / 32 + j * WARPS;
    return t < ROW_TILES ? t : -1;
  }

  // c += A B, A (BATCH x M x K, rows LDA apart, matrices SA apart) read from shared memory
  template <int LDA, int SA, int LDB, int SB, typename TA, typename TB>
  static __device__ __forceinline__ void multiply(Matrix& c, const TA* __restrict__ A, const TB* __restrict__ B) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < RT; ++j) {
      const int rt = tile(j);
      if (rt < 0) continue;
      const int b = rt / TM, m0 = rt % TM * 16;
      const TA* const a = A + b * SA;
      const TB* const w = B + b * SB;
#pragma unroll
      for (int k0 = 0; k0 < K; k0 += 16) {
        unsigned fa[4];
        if constexpr (Same<TA, E>::value && LDA % 8 == 0 && M % 16 == 0 && K % 16 == 0) {
          ldmatrix_x4(fa, a + (m0 + lane % 16) * LDA + k0 + lane / 16 * 8);
        } else {
          fa[0] = Base::template along_row<M, K, LDA>(a, m0 + g, k0 + 2 * t);
          fa[1] = Base::template along_row<M, K, LDA>(a, m0 + g + 8, k0 + 2 * t);
          fa[2] = Base::template along_row<M, K, LDA>(a, m0 + g, k0 + 2 * t + 8);
          fa[3] = Base::template along_row<M, K, LDA>(a, m0 + g + 8, k0 + 2 * t + 8);
        }
#pragma unroll
        for (int n = 0; n < TN; ++n) {
          unsigned fb[2];
          Base::template b_fragment<LDB>(fb, w, k0, n * 8);
          Mma<E>::run(c[j][n], fa, fb);
        }
      }
    }
  }

  // c += P B, P (BATCH x M x K) a row-resident value of this warp (K / 8 column groups, columns past K zero)
  template <int LDB, int SB, typename TB>
  static __device__ __forceinline__ void multiply_rows(Matrix& c, const float (&p)[RT][TK][4], const TB* __restrict__ B) {
#pragma unroll
    for (int j = 0; j < RT; ++j) {
      const int rt = tile(j);
      if (rt < 0) continue;
      const TB* const w = B + rt / TM * SB;
#pragma unroll
      for (int kk = 0; kk < TK; kk += 2) {
        const unsigned fa[4] = {pack<E>(p[j][kk][0], p[j][kk][1]), pack<E>(p[j][kk][2], p[j][kk][3]),
                                kk + 1 < TK ? pack<E>(p[j][kk + 1][0], p[j][kk + 1][1]) : 0u,
                                kk + 1 < TK ? pack<E>(p[j][kk + 1][2], p[j][kk + 1][3]) : 0u};
#pragma unroll
        for (int n = 0; n < TN; ++n) {
          unsigned fb[2];
          Base::template b_fragment<LDB>(fb, w, kk * 8, n * 8);
          Mma<E>::run(c[j][n], fa, fb);
        }
      }
    }
  }
};

// every element of a row-resident matrix or row vector set to `value`
template <int RT, int TN> __device__ __forceinline__ void fill_rows(float (&x)[RT][TN][4], float value) {
#pragma unroll
  for (int j = 0; j < RT; ++j)
#pragma unroll
    for (int n = 0; n < TN; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[j][n][e] = value;
}
template <int RT> __device__ __forceinline__ void fill_rows(float (&x)[RT][2], float value) {
#pragma unroll
  for (int j = 0; j < RT; ++j) x[j][0] = x[j][1] = value;
}
// the fold of a row's values over the 4 lanes of its quad
template <typename F> __device__ __forceinline__ float quad_reduce(float v, F f) {
  v = f(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return f(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// ROWS x COLS elements of a row-major R x C matrix from (r0, c0) into dst (rows LD apart): 16-byte
// cp.async copies where a row's 8 elements are inside the matrix and aligned, else one by one (zeros outside)
template <int ROWS, int COLS, int LD, int R, int C, int THREADS, typename E>
__device__ __forceinline__ void stage_tile(E* __restrict__ dst, const E* __restrict__ src, int r0, int c0) {
  const E zero = from_float<E>(0.0f);
  for (int v = threadIdx.x; v < ROWS * COLS / 8; v += THREADS) {
    const int r = v / (COLS / 8), c = v % (COLS / 8) * 8;
    E* const to = dst + r * LD + c;
    if (C % 8 == 0 && r0 + r < R && c0 + c + 8 <= C) {
      copy_async<16>(to, src + (r0 + r) * C + c0 + c);
    } else {
      for (int j = 0; j < 8; ++j) to[j] = (r0 + r < R && c0 + c + j < C) ? src[(r0 + r) * C + c0 + c + j] : zero;
    }
  }
}

// ---- skinny matmuls (X of M <= 16 rows): C = X W over a K x N slice of each of MATS weights W, streamed
// from device memory in loads that skip L1 (no shared memory), on tensor cores with W as the mma's A
// operand: the mma's 16 rows are 16 columns of W, its 8 columns 8 rows of X (M <= 8: one mma, else two).
// A warp's step is a slab of 16 rows of K: lane (g = lane / 4, t = lane % 4) loads the VEC columns of
// chunk `chunk()` (VEC = 8: 16-byte loads; 4: 8-byte loads, where 8-column chunks would leave lanes idle)
// in rows 4t .. 4t + 3 -- a warp's load is 4 rows x 8 VEC contiguous elements -- and byte permutes pair
// rows (4t, 4t + 1) and (4t + 2, 4t + 3) into the A fragments of VEC / 2 mmas (mma j: the chunk's columns
// 2j, 2j + 1). Any order of K does if X's fragments take the same one: one 8-byte load of X's row g at 4t.
// Warp w takes the (8 VEC)-column group w % GROUPS and the slabs w / GROUPS + i KW; the next step's loads
// are written before this step's mmas (registers double-buffered: 2 x STEP x MATS x 8 VEC bytes a thread).
// ptxas may still sink a buffer's loads below the other buffer's mmas (it did, on sm_90a), so the slabs
// of the iteration after next are also sent to L2 (`prefetch`): DRAM's bytes in flight do not hang on
// that schedule. Chunks fewer than 8: lanes g >= CHUNKS load a duplicate chunk (addresses the same
// instruction loads anyway: no extra traffic) and store nothing.
template <int VEC> struct Streamed;
template <> struct Streamed<8> {   // 16 bytes
  static __device__ __forceinline__ void load(unsigned (&r)[4], const void* p) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "l"(p));
  }
};
template <> struct Streamed<4> {   // 8 bytes
  static __device__ __forceinline__ void load(unsigned (&r)[2], const void* p) {
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "l"(p));
  }
};
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" :: "l"(p)); }
template <typename E> __device__ __forceinline__ float2 unpack(unsigned bits);
template <> __device__ __forceinline__ float2 unpack<__half>(unsigned bits) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}
template <> __device__ __forceinline__ float2 unpack<__nv_bfloat16>(unsigned bits) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}

#if __CUDA_ARCH__ >= 900
// programmatic dependent launch: the previous kernel of the stream has finished and its writes are visible
// (returns at once for a kernel launched without the programmatic attribute); the next kernel may launch
__device__ __forceinline__ void wait_for_previous_kernel() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void let_next_kernel_launch() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
#endif

// the skinny loop's operand is X as loaded (NoPrologue), or a prologue's value of each element of X: f(x),
// or f(x, v) where the loop has vectors along K (v: their values at x's k, one per vector)
struct NoPrologue {
  static constexpr bool ACTIVE = false;
};
template <typename L> struct Prologue {
  static constexpr bool ACTIVE = true;
  L f;
  __device__ __forceinline__ float operator()(float x) const { return f(x); }
  __device__ __forceinline__ float operator()(float x, const float* v) const { return f(x, v); }
};
template <typename L> __device__ __forceinline__ Prologue<L> prologue(L f) { return Prologue<L>{f}; }

// STAGGER: block b walks its slabs from slab b SLABS / blocks on, wrapping around (any order of K does), so
// that the blocks do not all read the same rows of X and of the weights at the same moment. LEAD: the loop
// iterations (2 STEP slabs of each warp) its L2 prefetches run ahead of its loads (0: none). STRADDLE: a column group's
// row may cross a 128-byte line (mdsl.lowering.skinny.straddles): its prefetches take both lines.
// WIDE_X: a step ("slab" below) is
// two slabs of K, 32 rows, in which lane t's mma k indices of the first are rows 8t .. 8t + 3 and of the
// second 8t + 4 .. 8t + 7: X's fragments of both come in one 16-byte load of row g at 8t (half the X load
// instructions, and of the lines each touches: one per row of X), the weights' in 8 loads of rows 8t + i.
// VECS: vectors along K the prologue reads (`(x - b) @ w`), each broadcast along X's rows: a fragment of
// each at X's k in every slab, loaded as a row fragment of X is.
// WT: the weights are stored N x K (a linear layer's [out, in]; LDW: a row of N): lane (g, t) loads each of
// its chunk's VEC rows of N at K = ROWS t .. ROWS t + ROWS - 1 (8 bytes, 16 with WIDE_X), whose words are its
// A fragments as they come (no byte permutes); their rows are not sent to L2 ahead (the prefetches walk a
// K x N weight's lines).
template <typename E, int M, int N, int K, int LDX, int LDW, int WARPS, int MATS, int VEC, bool STAGGER = false,
          int LEAD = 2, bool STRADDLE = false, bool WIDE_X = false, int VECS = 0, bool WT = false>
struct Skinny {
  static constexpr int MT = (M + 7) / 8;            // 8-row tiles of X: mmas per A fragment
  static constexpr int CHUNKS = N / VEC;            // VEC-column chunks of W
  static constexpr int GROUP = CHUNKS < 8 ? CHUNKS : 8;
  static constexpr int GROUPS = CHUNKS / GROUP;     // column groups, one per warp
  static constexpr int KW = WARPS / GROUPS;         // warps along K
  static constexpr int SPAN = WIDE_X ? 2 : 1;       // 16-row slabs of K in one step of a warp
  static constexpr int ROWS = 4 * SPAN;             // rows of a step each lane loads, from row ROWS t
  static constexpr int SLABS = K / (16 * SPAN);     // steps of the block's K
  static constexpr int WORDS = VEC / 2;             // 32-bit words a load brings: mmas per slab and weight
  static constexpr int STEP = 16 / (VEC * MATS * SPAN) > 0 ? 16 / (VEC * MATS * SPAN) : 1;   // steps a warp loads at once
  static constexpr int PART_LD = N + 1;             // a row of the partial sums: odd, no bank conflicts (SkinnyPlan.part_row)
  static constexpr int VS = VECS > 0 ? VECS : 1;    // the vectors' arrays (of VECS 0: one, never loaded)
  static constexpr int WROWS = WT ? VEC : ROWS;     // rows of a weight a lane loads a step (of K; WT: of N)
  static constexpr int WLOAD = WT ? ROWS : VEC;     // ... and the elements of each load
  static_assert(VEC == 4 || VEC == 8, "skinny: 8- or 16-byte loads");
  static_assert(M >= 1 && M <= 16 && N % VEC == 0 && K % (16 * SPAN) == 0, "skinny: M <= 16, N % VEC == 0, K whole steps");
  static_assert(!WIDE_X || LDX % 8 == 0, "skinny: rows of X aligned to 16 bytes for WIDE_X");
  static_assert(CHUNKS % GROUP == 0 && WARPS % GROUPS == 0, "skinny: column groups and warps do not divide");
  static_assert(LDW % WLOAD == 0 && LDX % 4 == 0, "skinny: rows of W aligned to a load, of X to 8 bytes");
  using Acc = float[MATS][MT][WORDS][4];   // [weight][X tile][mma j][fragment element]

  struct Slab {
    unsigned w[MATS][WROWS][WLOAD / 2];
    unsigned x[MT][2 * SPAN];   // X's row fragments: 4 (WIDE_X: 8) elements
    unsigned v[VS][2 * SPAN];   // each vector's fragment at the same k
  };

  // the slab of K the walk's slab-th step reads (STAGGER: this block's walk starts part of the way in)
  static __device__ __forceinline__ int walked(int slab) {
    if constexpr (STAGGER) {
      const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
      const unsigned blocks = gridDim.x * gridDim.y * gridDim.z;
      return (slab + static_cast<int>(block * SLABS / blocks)) % SLABS;
    } else {
      return slab;
    }
  }

  static __device__ __forceinline__ int chunk() {
    return (threadIdx.x / 32) % GROUPS * GROUP + (threadIdx.x % 32 / 4) % GROUP;
  }

  // a slab's loads from this thread's pointers (w: row ROWS t of its chunk; x: its rows of X at ROWS t; v: each
  // vector at ROWS t); a slab past the end loads the last one again (its values unused): no predicates, no zeroing
  template <bool CLAMP = true>
  static __device__ __forceinline__ void load(Slab& s, const E* const (&x)[MT], const E* const (&w)[MATS],
                                              const E* const (&v)[VS], int slab) {
    const int k = walked(CLAMP && slab >= SLABS ? SLABS - 1 : slab) * 16 * SPAN;
#pragma unroll
    for (int mat = 0; mat < MATS; ++mat) {
      const E* const row = w[mat] + (WT ? k : k * LDW);   // the next rows at constant offsets (immediates)
#pragma unroll
      for (int i = 0; i < WROWS; ++i) Streamed<WLOAD>::load(s.w[mat][i], row + i * LDW);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) load_x(s.x[mt], x[mt] + k);
#pragma unroll
    for (int i = 0; i < VECS; ++i) load_x(s.v[i], v[i] + k);
  }

  // a row fragment of X: 8 bytes, or 16 (WIDE_X), by the read-only path
  static __device__ __forceinline__ void load_x(unsigned (&to)[2 * SPAN], const E* from) {
    if constexpr (WIDE_X) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(from));
      to[0] = v.x; to[1] = v.y; to[2] = v.z; to[3] = v.w;
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(from));
      to[0] = v.x; to[1] = v.y;
    }
  }

  // lane (g, t)'s row ROWS t of its column group's first column in each weight (see `prefetch`)
  static __device__ __forceinline__ void group_rows(const E* (&lines)[MATS], const E* const (&W)[MATS]) {
#pragma unroll
    for (int mat = 0; mat < MATS; ++mat) lines[mat] = W[mat] + ROWS * (threadIdx.x % 4) * LDW + (threadIdx.x / 32) % GROUPS * GROUP * VEC;
  }

  // the slabs of this warp's first two register buffers sent to L2: a prefetch changes no value, so it may
  // run before the previous kernel has finished (programmatic dependent launch), and `run` then finds them there
  static __device__ __forceinline__ void prefetch_start(const E* const (&W)[MATS]) {
    const E* lines[MATS];
    group_rows(lines, W);
    prefetch<true>(lines, threadIdx.x / 32 / GROUPS);   // also at LEAD 0: the start is what overlaps
  }

  // the weight rows of the 2 STEP slabs first, first + KW, ... sent to L2 ahead of their loads (no registers
  // held: DRAM's bytes in flight do not depend on where ptxas schedules the loads, which then find the rows
  // in L2). Lane (g, t) takes rows ROWS t .. ROWS t + ROWS - 1 of slab g % (2 STEP), from its column group's
  // first column (p: row ROWS t there): a group's row is at most 128 bytes, a line, or two where it STRADDLEs them
  template <bool START = false>
  static __device__ __forceinline__ void prefetch(const E* const (&p)[MATS], int first) {
    // no L2 prefetches in the loop (the register buffers' loads alone), nor of an N x K weight's rows
    if constexpr (WT || (LEAD == 0 && !START)) return;
    const int slab = first + (threadIdx.x % 32 / 4) % (2 * STEP) * KW;
    const int k = walked(slab < SLABS ? slab : SLABS - 1) * 16 * SPAN;
#pragma unroll
    for (int mat = 0; mat < MATS; ++mat)
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        prefetch_l2(p[mat] + (k + i) * LDW);
        if constexpr (STRADDLE) prefetch_l2(p[mat] + (k + i) * LDW + GROUP * VEC - 1);
      }
  }

  static __device__ __forceinline__ void multiply(Acc& acc, const Slab& s, const unsigned (&x)[MT][2 * SPAN]) {
#pragma unroll
    for (int mat = 0; mat < MATS; ++mat)
#pragma unroll
      for (int h = 0; h < SPAN; ++h)   // WIDE_X: the step's two slabs, rows 4h .. 4h + 3 of the lane's
#pragma unroll
      for (int j = 0; j < WORDS; ++j) {
        const unsigned (&w)[WROWS][WLOAD / 2] = s.w[mat];
        // rows g and g + 8 of the mma's A: columns 2j and 2j + 1 of the lane's chunk; its k: rows 4h .. 4h + 3
        // of the lane's (WT: words 2h, 2h + 1 of its loads of those columns' rows)
        unsigned a[4];
        if constexpr (WT) {
          a[0] = w[2 * j][2 * h], a[1] = w[2 * j + 1][2 * h];
          a[2] = w[2 * j][2 * h + 1], a[3] = w[2 * j + 1][2 * h + 1];
        } else {
          a[0] = __byte_perm(w[4 * h][j], w[4 * h + 1][j], 0x5410);
          a[1] = __byte_perm(w[4 * h][j], w[4 * h + 1][j], 0x7632);
          a[2] = __byte_perm(w[4 * h + 2][j], w[4 * h + 3][j], 0x5410);
          a[3] = __byte_perm(w[4 * h + 2][j], w[4 * h + 3][j], 0x7632);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const unsigned b[2] = {x[mt][2 * h], x[mt][2 * h + 1]};   // rows past M: a copy of row M - 1, never stored
          Mma<E>::run(acc[mat][mt][j], a, b);
        }
      }
  }

  // one slab multiplied, the operand's elements folded (rows below M, warps of the first column group); the
  // operand is X's fragments, or (a prologue P) P's value of each of their elements (and of the vectors' at
  // their k), rounded to E
  template <typename F, typename P>
  static __device__ __forceinline__ void slab_step(Acc& acc, const Slab& s, bool folds, F& fold, P& pro) {
    const int g = threadIdx.x % 32 / 4;
    unsigned x[MT][2 * SPAN];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int word = 0; word < 2 * SPAN; ++word) {
        if constexpr (P::ACTIVE && VECS > 0) {
          const float2 v = unpack<E>(s.x[mt][word]);
          float lo[VS], hi[VS];
#pragma unroll
          for (int i = 0; i < VECS; ++i) {
            const float2 u = unpack<E>(s.v[i][word]);
            lo[i] = u.x; hi[i] = u.y;
          }
          x[mt][word] = pack<E>(pro(v.x, lo), pro(v.y, hi));
        } else if constexpr (P::ACTIVE) {
          const float2 v = unpack<E>(s.x[mt][word]);
          x[mt][word] = pack<E>(pro(v.x), pro(v.y));
        } else {
          x[mt][word] = s.x[mt][word];
        }
      }
    multiply(acc, s, x);
    if (folds) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt * 8 + g < M) {
#pragma unroll
          for (int word = 0; word < 2 * SPAN; ++word) {
            const float2 v = unpack<E>(x[mt][word]);
            fold(mt, v.x); fold(mt, v.y);
          }
        }
      }
    }
  }

  // the slabs first, first + KW, ... of a buffer: all of them (`whole`), else those that exist
  template <bool WHOLE, typename F, typename P>
  static __device__ __forceinline__ void step(Acc& acc, const Slab (&s)[STEP], int first, bool folds, F& fold, P& pro) {
#pragma unroll
    for (int q = 0; q < STEP; ++q) {
      if (WHOLE || first + q * KW < SLABS) slab_step(acc, s[q], folds, fold, pro);   // the same on the whole warp
    }
  }

  // acc = this warp's part of A W for each weight, A = X or its prologue's value P(X) element by element
  // (P(X, V): of X and the VECS vectors V along K); fold(mt, a) sees every element a of A's rows mt * 8 + g
  // (g = lane / 4) in the block's K exactly once over the block (warps of the first column group only)
  template <typename F, typename P = NoPrologue>
  static __device__ __forceinline__ void run(Acc& acc, const E* __restrict__ X, const E* const (&W)[MATS], F fold,
                                             P pro = P(), const E* const* V = nullptr) {
    static_assert(VECS == 0 || P::ACTIVE, "skinny: vectors along K are read by a prologue");
#pragma unroll
    for (int mat = 0; mat < MATS; ++mat)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < WORDS; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mat][mt][j][e] = 0.0f;
    const int warp = threadIdx.x / 32, kw = warp / GROUPS, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    const bool folds = warp % GROUPS == 0;
    const E* xs[MT];
    const E* ws[MATS];
    const E* vs[VS] = {};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int row = mt * 8 + g < M ? mt * 8 + g : M - 1;
      xs[mt] = X + row * LDX + ROWS * t;
    }
#pragma unroll
    for (int i = 0; i < VECS; ++i) vs[i] = V[i] + ROWS * t;
    const E* lines[MATS];
    group_rows(lines, W);
#pragma unroll
    for (int mat = 0; mat < MATS; ++mat)
      ws[mat] = WT ? W[mat] + chunk() * VEC * LDW + ROWS * t : W[mat] + ROWS * t * LDW + chunk() * VEC;
    // two register buffers in turn: one's loads in flight while the other's mmas run. The steady state
    // has no branch (every slab of both buffers exists), so that the loads stay where they are written
    // (ptxas sank them below branchy mma blocks, next to their use); the last slabs follow, each checked
    // Each iteration also sends the slabs of the one LEAD ahead to L2 (those up to it went before).
    Slab a[STEP], b[STEP];
#pragma unroll
    for (int q = 0; q < STEP; ++q) load(a[q], xs, ws, vs, kw + q * KW);
#pragma unroll
    for (int ahead = 1; ahead < LEAD; ++ahead) prefetch(lines, kw + 2 * ahead * STEP * KW);
    int slab = kw;
#pragma unroll 1
    for (; slab + (2 * STEP - 1) * KW < SLABS; slab += 2 * STEP * KW) {
      prefetch(lines, slab + 2 * (LEAD > 0 ? LEAD : 1) * STEP * KW);
#pragma unroll
      for (int q = 0; q < STEP; ++q) load<false>(b[q], xs, ws, vs, slab + (STEP + q) * KW);   // within K
      step<true>(acc, a, slab, folds, fold, pro);
#pragma unroll
      for (int q = 0; q < STEP; ++q) load(a[q], xs, ws, vs, slab + (2 * STEP + q) * KW);
      step<true>(acc, b, slab + STEP * KW, folds, fold, pro);
    }
    if (slab < SLABS) {   // fewer than 2 STEP slabs left: a holds the first STEP of them
#pragma unroll
      for (int q = 0; q < STEP; ++q) load(b[q], xs, ws, vs, slab + (STEP + q) * KW);
      step<false>(acc, a, slab, folds, fold, pro);
      step<false>(acc, b, slab + STEP * KW, folds, fold, pro);
    }
  }

  // this warp's sums into part (f32, MATS x KW x M x PART_LD: weight, warp along K, row of X, column of W)
  static __device__ __forceinline__ void store_part(const Acc& acc, float* __restrict__ part) {
    const int warp = threadIdx.x / 32, kw = warp / GROUPS, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    if (g >= GROUP) return;   // a duplicate chunk
    const int c = chunk();
#pragma unroll
    for (int mat = 0; mat < MATS; ++mat)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < WORDS; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int m = mt * 8 + 2 * t + (e & 1), n = c * VEC + 2 * j + (e >> 1);
            if (m < M) part[((mat * KW + kw) * M + m) * PART_LD + n] = acc[mat][mt][j][e];
          }
  }
};

// ---- one 64x64 tile of C = A B on tensor cores (A, B of the 16-bit type E; row-major, A is M x K, B is
// K x N) for a block of 256 threads: K in steps of 32 through a ring of STAGES shared-memory buffers, the
// tiles of the next STAGES - 1 steps in flight (cp.async) while one step multiplies
template <typename E, int M, int N, int K, typename TC>
__device__ __forceinline__ void gemm_tile_mma(const E* __restrict__ A, const E* __restrict__ B, TC* __restrict__ C) {
  constexpr int BM = 64, BN = 64, BK = 32, LDA = BK + 8, LDB = BN + 8, THREADS = 256, STAGES = 4;
  using Tile = BlockMma<E, 1, BM, BN, BK, THREADS / 32>;
  __shared__ __align__(16) E As[STAGES][BM * LDA];
  __shared__ __align__(16) E Bs[STAGES][BK * LDB];
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  auto load = [&](int step) {  // one commit group per step, empty past the end (every wait counts the same)
    if (step * BK < K) {
      stage_tile<BM, BK, LDA, M, K, THREADS>(As[step % STAGES], A, m0, step * BK);
      stage_tile<BK, BN, LDB, K, N, THREADS>(Bs[step % STAGES], B, step * BK, n0);
    }
    copy_async_commit();
  };
  typename Tile::Fragments acc;
  Tile::zero(acc);
  for (int step = 0; step < STAGES - 1; ++step) load(step);
  for (int step = 0; step * BK < K; ++step) {
    load(step + STAGES - 1);  // into the buffer the last step read: free since that step's closing barrier
    copy_async_wait<STAGES - 1>();
    __syncthreads();
    Tile::template multiply<LDA, 0, LDB, 0>(acc, As[step % STAGES], Bs[step % STAGES]);
    __syncthreads();
  }
  Tile::each(acc, acc, [&](float value, float, int, int m, int n) {
    if (m0 + m < M && n0 + n < N) C[(m0 + m) * N + n0 + n] = from_float<TC>(value);
  });
}

// ---- 16 columns of C = A B on tensor cores for few rows (M <= ROWS_GEMM_MAX_M, 64; A, B of the 16-bit type E,
// row-major, A is M x K, B is K x N) for a block of 256 threads. The product streams B, and a 64x64 tile would
// leave most SMs idle and each block a long walk over K, so a block takes 16 columns and its 8 warps share
// K: warp w takes the 16-row steps w, w + 8, ... of B (neighbouring warps read neighbouring rows), each lane
// loading its fragments' 16-bit values straight from global memory, UNROLL steps' loads issued before their
// products. The warps' sums are added in warp order through shared memory: C's bits depend on (M, N, K) alone.
template <typename E, int M, int N, int K, typename TC>
__device__ __forceinline__ void gemm_rows_mma(const E* __restrict__ A, const E* __restrict__ B, TC* __restrict__ C) {
  constexpr int WARPS = 8, BN = 16, TM = (M + 15) / 16, STEPS = (K + 15) / 16, UNROLL = 4;
  static_assert(TM <= 4, "gemm_rows_mma takes at most 64 rows");
  using Tile = BlockMma<E, 1, M, N, K, WARPS>;
  __shared__ float part[WARPS][TM * 16][BN + 1];
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
  const int n0 = blockIdx.x * BN;
  float acc[TM][2][4];
#pragma unroll
  for (int mt = 0; mt < TM; ++mt)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.0f;
  for (int s0 = warp; s0 < STEPS; s0 += WARPS * UNROLL) {
    unsigned fb[UNROLL][2][2];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {   // (rows past K read as zeros)
      const int k0 = (s0 + u * WARPS) * 16;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        fb[u][j][0] = Tile::template along_column<K, N, N>(B, k0 + 2 * t, n0 + j * 8 + g);
        fb[u][j][1] = Tile::template along_column<K, N, N>(B, k0 + 2 * t + 8, n0 + j * 8 + g);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int k0 = (s0 + u * WARPS) * 16;
      if (k0 < K) {   // the same on the whole warp, as mma.sync needs
#pragma unroll
        for (int mt = 0; mt < TM; ++mt) {
          const int m0 = mt * 16;
          const unsigned fa[4] = {Tile::template along_row<M, K, K>(A, m0 + g, k0 + 2 * t),
                                  Tile::template along_row<M, K, K>(A, m0 + g + 8, k0 + 2 * t),
                                  Tile::template along_row<M, K, K>(A, m0 + g, k0 + 2 * t + 8),
                                  Tile::template along_row<M, K, K>(A, m0 + g + 8, k0 + 2 * t + 8)};
          Mma<E>::run(acc[mt][0], fa, fb[u][0]);
          Mma<E>::run(acc[mt][1], fa, fb[u][1]);
        }
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < TM; ++mt)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) part[warp][mt * 16 + g + (e / 2) * 8][j * 8 + 2 * t + e % 2] = acc[mt][j][e];
  __syncthreads();
  for (int i = threadIdx.x; i < M * BN; i += 32 * WARPS) {
    const int m = i / BN, n = i % BN;
    if (n0 + n < N) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) sum += part[w][m][n];
      C[m * N + n0 + n] = from_float<TC>(sum);
    }
  }
}

// ---- one 64x64 tile of C = A B (row-major; A is M x K, B is K x N) for a block of 256 threads:
// K is walked in steps of 16 through shared memory, each thread keeps a 4x4 piece of C in registers
template <int M, int N, int K, typename TA, typename TB, typename TC>
__device__ __forceinline__ void gemm_tile(const TA* __restrict__ A, const TB* __restrict__ B, TC* __restrict__ C) {
  constexpr int BM = 64, BN = 64, BK = 16;
  __shared__ float As[BK][BM + 4];  // A transposed, so that a thread reads its 4 rows' values at once
  __shared__ float Bs[BK][BN];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < K; k0 += BK) {
    for (int e = threadIdx.x; e < BM * BK; e += 256) {
      const int r = e / BK, c = e % BK;
      As[c][r] = (m0 + r < M && k0 + c < K) ? to_float(A[(m0 + r) * K + k0 + c]) : 0.0f;
    }
    for (int e = threadIdx.x; e < BK * BN; e += 256) {
      const int r = e / BN, c = e % BN;
      Bs[r][c] = (k0 + r < K && n0 + c < N) ? to_float(B[(k0 + r) * N + n0 + c]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = As[k][ty * 4 + i];
        b[i] = Bs[k][tx + 16 * i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = m0 + ty * 4 + i, n = n0 + tx + 16 * j;
      if (m < M && n < N) C[m * N + n] = from_float<TC>(acc[i][j]);
    }
}

}  // namespace mdsl
"""

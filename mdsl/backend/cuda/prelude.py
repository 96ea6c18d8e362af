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
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) dst[j] = convert<D>(src[j]);
  }
}

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// exp(m - top) for online softmax; an empty running maximum (-inf) weighs nothing
__device__ __forceinline__ float rescale(float m, float top) { return m == neg_inf() ? 0.0f : expf(m - top); }

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

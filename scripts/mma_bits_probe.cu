// Whether mma.sync m16n8k16 and wgmma m64n64k16 (bf16 operands, f32 accumulators) give the same bits for the
// same chain of k16 steps from the same accumulator: the premise of running a prompt chunk's attention tiles on
// wgmma while a decode row's tile runs on mma.sync (a row's bits must not depend on which kernel ran it). Both
// of wgmma's forms are checked: A from shared memory (SS) and A from registers (RS, as attention's queries and
// weights would be), B K-major in the 128-byte swizzle TMA writes (as attention's keys would be), and RS with B
// MN-major (B's transpose, N contiguous, in the same swizzle: as attention's values would be, read with the
// instruction's transpose flag).
// For 2,048 blocks of random 64 x 64 operands (normal; exponents spread over 2^-12 .. 2^12; B non-negative, as
// softmax weights are) and accumulators, chains of 1, 2 and 8 k16 steps: how many outputs differ in bits from
// mma.sync's, and each instruction's worst error against a float64 sum.
//
//     nvcc -gencode arch=compute_90a,code=sm_90a -O2 -o /tmp/mma_bits scripts/mma_bits_probe.cu && /tmp/mma_bits
#include <cuda_bf16.h>
#include <cstdio>
#include <cstring>
#include <vector>
#include <random>
#include <cmath>

constexpr int M = 64, N = 64, K = 64, KS = K / 16, NT = N / 8, OUT = 4;   // mma.sync, SS, RS, RS B MN-major

// 128-byte swizzle, 1024 bytes between groups of 8 rows (SBO), `lbo` bytes between an MN-major operand's blocks
// of 64 elements along N (as attention's values in two halves of 64 dims, 8192 bytes apart; unused at N = 64)
// and 16 for a K-major one (which ignores it)
__device__ __forceinline__ unsigned long long descriptor(unsigned address, unsigned lbo = 16) {
  return static_cast<unsigned long long>((address & 0x3FFFF) >> 4) | (static_cast<unsigned long long>(lbo >> 4) << 16) |
         (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ unsigned pack(const __nv_bfloat16* p) { return *reinterpret_cast<const unsigned*>(p); }

#define D32(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),        \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),      \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define R32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26," \
  "%27,%28,%29,%30,%31}"

// a: [blocks][M][K], b: [blocks][N][K] (D = A B^T), c: [blocks][M][N] the first accumulator;
// d: [blocks][OUT][M][N]
__global__ void __launch_bounds__(128) probe(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c,
                                             float* d, int steps) {
  __shared__ __align__(1024) __nv_bfloat16 sa[M * K];
  __shared__ __align__(1024) __nv_bfloat16 sb[N * K];
  __shared__ __align__(1024) __nv_bfloat16 st[K * N];   // B's transpose: row k holds B[0..63][k]
  const __nv_bfloat16* A = a + (size_t)blockIdx.x * M * K;
  const __nv_bfloat16* B = b + (size_t)blockIdx.x * N * K;
  const float* C = c + (size_t)blockIdx.x * M * N;
  float* D = d + (size_t)blockIdx.x * OUT * M * N;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  // A and B in the 128-byte swizzled K-major layout: row r's 16-byte chunk q at r * 128 + 16 (q ^ r % 8)
  for (int i = tid; i < M * 8; i += 128) {
    const int r = i / 8, q = i % 8;
    *reinterpret_cast<uint4*>(reinterpret_cast<char*>(sa) + r * 128 + 16 * (q ^ (r % 8))) =
        *reinterpret_cast<const uint4*>(A + r * K + 8 * q);
    *reinterpret_cast<uint4*>(reinterpret_cast<char*>(sb) + r * 128 + 16 * (q ^ (r % 8))) =
        *reinterpret_cast<const uint4*>(B + r * K + 8 * q);
  }
  // element (k, n) of the transpose at byte k * 128 + 16 ((n / 8) ^ k % 8) + 2 (n % 8): B MN-major, the swizzle
  for (int i = tid; i < K * N; i += 128) {
    const int k = i / N, n = i % N;
    st[k * 64 + 8 * ((n / 8) ^ (k % 8)) + n % 8] = B[n * K + k];
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  // this thread's accumulators of n8 tile j: (row r0, columns 8j + 2t, + 1), (row r1, the same columns)
  const int r0 = 16 * warp + g, r1 = r0 + 8;
  float acc[OUT][4 * NT];
  for (int o = 0; o < OUT; ++o)
    for (int j = 0; j < NT; ++j) {
      acc[o][4 * j + 0] = C[r0 * N + 8 * j + 2 * t];
      acc[o][4 * j + 1] = C[r0 * N + 8 * j + 2 * t + 1];
      acc[o][4 * j + 2] = C[r1 * N + 8 * j + 2 * t];
      acc[o][4 * j + 3] = C[r1 * N + 8 * j + 2 * t + 1];
    }
  const unsigned as = static_cast<unsigned>(__cvta_generic_to_shared(sa));
  const unsigned bs = static_cast<unsigned>(__cvta_generic_to_shared(sb));
  const unsigned ts = static_cast<unsigned>(__cvta_generic_to_shared(st));
  for (int s = 0; s < steps; ++s) {
    const int kk = s % KS, k0 = 16 * kk;
    // this warp's A fragment of the k16 step (mma.sync's, and wgmma's register A of the warp's 16 rows)
    const unsigned a0 = pack(A + r0 * K + k0 + 2 * t), a1 = pack(A + r1 * K + k0 + 2 * t);
    const unsigned a2 = pack(A + r0 * K + k0 + 2 * t + 8), a3 = pack(A + r1 * K + k0 + 2 * t + 8);
    for (int j = 0; j < NT; ++j) {
      const unsigned b0 = pack(B + (8 * j + g) * K + k0 + 2 * t), b1 = pack(B + (8 * j + g) * K + k0 + 2 * t + 8);
      float* m = &acc[0][4 * j];
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};"
                   : "+f"(m[0]), "+f"(m[1]), "+f"(m[2]), "+f"(m[3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    const unsigned long long da = descriptor(as) + 2 * kk, db = descriptor(bs) + 2 * kk;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " R32 ", %32, %33, 1, 1, 1, 0, 0;"
                 : D32(acc[1]) : "l"(da), "l"(db));
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " R32 ", {%32,%33,%34,%35}, %36, 1, 1, 1, 0;"
                 : D32(acc[2]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
    // (the transpose's k16 step: 16 rows of 128 bytes further)
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " R32 ", {%32,%33,%34,%35}, %36, 1, 1, 1, 1;"
                 : D32(acc[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(descriptor(ts + 2048 * kk, 8192)));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  for (int o = 0; o < OUT; ++o)
    for (int j = 0; j < NT; ++j) {
      float* out = D + o * M * N;
      out[r0 * N + 8 * j + 2 * t] = acc[o][4 * j + 0];
      out[r0 * N + 8 * j + 2 * t + 1] = acc[o][4 * j + 1];
      out[r1 * N + 8 * j + 2 * t] = acc[o][4 * j + 2];
      out[r1 * N + 8 * j + 2 * t + 1] = acc[o][4 * j + 3];
    }
}

int main() {
  const int blocks = 2048;
  const char* names[OUT] = {"mma.sync", "wgmma SS", "wgmma RS", "wgmma RS, B MN-major"};
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-12, 12);
  int failures = 0;
  for (int mode = 0; mode < 3; ++mode) {
    for (int steps : {1, 2, 8}) {
      std::vector<__nv_bfloat16> a((size_t)blocks * M * K), b((size_t)blocks * N * K);
      std::vector<float> c((size_t)blocks * M * N);
      for (auto& x : a) x = __float2bfloat16(mode == 0 ? nd(rng) : std::ldexp(nd(rng), ex(rng)));
      for (auto& x : b) x = __float2bfloat16(mode == 2 ? std::fabs(nd(rng)) : nd(rng));
      for (auto& x : c) x = mode == 0 ? 0.0f : std::ldexp(nd(rng), ex(rng));
      __nv_bfloat16 *da, *db;
      float *dc, *dd;
      cudaMalloc(&da, a.size() * 2);
      cudaMalloc(&db, b.size() * 2);
      cudaMalloc(&dc, c.size() * 4);
      cudaMalloc(&dd, c.size() * 4 * OUT);
      cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(dc, c.data(), c.size() * 4, cudaMemcpyHostToDevice);
      probe<<<blocks, 128>>>(da, db, dc, dd, steps);
      const cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) {
        printf("error %s\n", cudaGetErrorString(e));
        return 2;
      }
      std::vector<float> h(c.size() * OUT);
      cudaMemcpy(h.data(), dd, h.size() * 4, cudaMemcpyDeviceToHost);
      long long differ[OUT] = {0, 0, 0, 0};
      double worst[OUT] = {0, 0, 0, 0};
      for (size_t i = 0; i < c.size(); ++i) {
        const size_t blk = i / (M * N), r = (i % (M * N)) / N, n = i % N;
        double ref = c[i];   // the chain's sum in float64
        for (int s = 0; s < steps; ++s)
          for (int k = 16 * (s % KS); k < 16 * (s % KS) + 16; ++k)
            ref += (double)__bfloat162float(a[blk * M * K + r * K + k]) *
                   (double)__bfloat162float(b[blk * N * K + n * K + k]);
        for (int o = 0; o < OUT; ++o) {
          const float got = h[(blk * OUT + o) * M * N + r * N + n];
          if (memcmp(&got, &h[(blk * OUT) * M * N + r * N + n], 4)) ++differ[o];
          worst[o] = fmax(worst[o], fabs(got - ref) / (fabs(ref) + 1e-30));
        }
      }
      printf("mode %d, %d k16 steps:", mode, steps);
      for (int o = 0; o < OUT; ++o) printf("  %s: %lld differ, worst rel err %.2g;", names[o], differ[o], worst[o]);
      printf("\n");
      failures += differ[1] != 0 || differ[2] != 0 || differ[3] != 0;
      cudaFree(da);
      cudaFree(db);
      cudaFree(dc);
      cudaFree(dd);
    }
  }
  printf(failures ? "wgmma's bits differ from mma.sync's\n" : "the same bits\n");
  return failures ? 1 : 0;
}

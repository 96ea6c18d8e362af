// Whether mma.sync m16n8k16 and wgmma m64n8k16 (bf16 operands, f32 accumulators) give the same bits for the
// same chain of k16 steps from the same accumulator: the premise of running a prompt chunk's attention tiles on
// wgmma while a decode row's tile runs on mma.sync (a row's bits must not depend on which kernel ran it).
// For 2,048 blocks of random 64 x 64 and 8 x 64 operands (normal; exponents spread over 2^-12 .. 2^12; the
// second operand non-negative, as softmax weights are) and accumulators, chains of 1, 2 and 8 k16 steps: how
// many outputs differ in bits, and each instruction's worst error against a float64 sum.
//
//     nvcc -gencode arch=compute_90a,code=sm_90a -O2 -o /tmp/mma_bits scripts/mma_bits_probe.cu && /tmp/mma_bits
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#include <cmath>

constexpr int M = 64, N = 8, K = 64, KS = K / 16;

__device__ __forceinline__ unsigned long long descriptor(unsigned address) {
  return static_cast<unsigned long long>((address & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ unsigned pack(const __nv_bfloat16* p) { return *reinterpret_cast<const unsigned*>(p); }

// a: [blocks][M][K], b: [blocks][N][K], c: [blocks][M][N] initial, d_mma / d_wg: [blocks][M][N]
__global__ void __launch_bounds__(128) probe(const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c,
                                             float* d_mma, float* d_wg, int steps) {
  __shared__ __align__(1024) __nv_bfloat16 sa[M * K];
  __shared__ __align__(1024) __nv_bfloat16 sb[N * K];
  const __nv_bfloat16* A = a + (size_t)blockIdx.x * M * K;
  const __nv_bfloat16* B = b + (size_t)blockIdx.x * N * K;
  const float* C = c + (size_t)blockIdx.x * M * N;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  // stage A and B in the 128-byte swizzled K-major layout: row r's 16-byte chunk q at r*128 + 16*(q ^ r%8)
  for (int i = tid; i < M * 8; i += 128) {
    const int r = i / 8, q = i % 8;
    *reinterpret_cast<uint4*>(reinterpret_cast<char*>(sa) + r * 128 + 16 * (q ^ (r % 8))) =
        *reinterpret_cast<const uint4*>(A + r * K + 8 * q);
  }
  for (int i = tid; i < N * 8; i += 128) {
    const int r = i / 8, q = i % 8;
    *reinterpret_cast<uint4*>(reinterpret_cast<char*>(sb) + r * 128 + 16 * (q ^ (r % 8))) =
        *reinterpret_cast<const uint4*>(B + r * K + 8 * q);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int r0 = 16 * warp + g, r1 = r0 + 8, c0 = 2 * t;
  // mma.sync: this warp's 16 rows
  float m[4] = {C[r0 * N + c0], C[r0 * N + c0 + 1], C[r1 * N + c0], C[r1 * N + c0 + 1]};
  for (int s = 0; s < steps; ++s) {
    const int k0 = 16 * (s % KS);
    const unsigned a0 = pack(A + r0 * K + k0 + 2 * t), a1 = pack(A + r1 * K + k0 + 2 * t);
    const unsigned a2 = pack(A + r0 * K + k0 + 2 * t + 8), a3 = pack(A + r1 * K + k0 + 2 * t + 8);
    const unsigned b0 = pack(B + g * K + k0 + 2 * t), b1 = pack(B + g * K + k0 + 2 * t + 8);
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(m[0]), "+f"(m[1]), "+f"(m[2]), "+f"(m[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  // wgmma: the warpgroup's 64 rows, one k16 step at a time, waited each time
  float w[4] = {C[r0 * N + c0], C[r0 * N + c0 + 1], C[r1 * N + c0], C[r1 * N + c0 + 1]};
  const unsigned as = static_cast<unsigned>(__cvta_generic_to_shared(sa)), bs = static_cast<unsigned>(__cvta_generic_to_shared(sb));
  for (int s = 0; s < steps; ++s) {
    const int j = s % KS;
    const unsigned long long da = descriptor(as) + 2 * j, db = descriptor(bs) + 2 * j;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, %4, %5, 1, 1, 1, 0, 0;"
                 : "+f"(w[0]), "+f"(w[1]), "+f"(w[2]), "+f"(w[3]) : "l"(da), "l"(db));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  float* DM = d_mma + (size_t)blockIdx.x * M * N;
  float* DW = d_wg + (size_t)blockIdx.x * M * N;
  DM[r0 * N + c0] = m[0]; DM[r0 * N + c0 + 1] = m[1]; DM[r1 * N + c0] = m[2]; DM[r1 * N + c0 + 1] = m[3];
  DW[r0 * N + c0] = w[0]; DW[r0 * N + c0 + 1] = w[1]; DW[r1 * N + c0] = w[2]; DW[r1 * N + c0 + 1] = w[3];
}

int main() {
  const int blocks = 2048;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-12, 12);
  for (int mode = 0; mode < 3; ++mode) {
    for (int steps : {1, 2, 8}) {
      std::vector<__nv_bfloat16> a((size_t)blocks * M * K), b((size_t)blocks * N * K);
      std::vector<float> c((size_t)blocks * M * N);
      for (auto& x : a) x = __float2bfloat16(mode == 0 ? nd(rng) : std::ldexp(nd(rng), ex(rng)));
      for (auto& x : b) x = __float2bfloat16(mode == 2 ? std::fabs(nd(rng)) : nd(rng));   // (2: weights >= 0, as P)
      for (auto& x : c) x = mode == 0 ? 0.0f : std::ldexp(nd(rng), ex(rng));
      __nv_bfloat16 *da, *db; float *dc, *dm, *dw;
      cudaMalloc(&da, a.size() * 2); cudaMalloc(&db, b.size() * 2); cudaMalloc(&dc, c.size() * 4);
      cudaMalloc(&dm, c.size() * 4); cudaMalloc(&dw, c.size() * 4);
      cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice);
      cudaMemcpy(dc, c.data(), c.size() * 4, cudaMemcpyHostToDevice);
      probe<<<blocks, 128>>>(da, db, dc, dm, dw, steps);
      cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) { printf("error %s\n", cudaGetErrorString(e)); return 1; }
      std::vector<float> hm(c.size()), hw(c.size());
      cudaMemcpy(hm.data(), dm, c.size() * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(hw.data(), dw, c.size() * 4, cudaMemcpyDeviceToHost);
      // the chain's sum in float64: both instructions compute the product
      long long differ = 0; double worst = 0.0, worst_ref = 0.0;
      for (size_t i = 0; i < c.size(); ++i) {
        if (memcmp(&hm[i], &hw[i], 4)) ++differ;
        const size_t blk = i / (M * N), r = (i % (M * N)) / N, n = i % N;
        double ref = c[i];
        for (int s = 0; s < steps; ++s)
          for (int k = 16 * (s % KS); k < 16 * (s % KS) + 16; ++k)
            ref += (double)__bfloat162float(a[blk * M * K + r * K + k]) * (double)__bfloat162float(b[blk * N * K + n * K + k]);
        worst = fmax(worst, fabs(hm[i] - ref) / (fabs(ref) + 1e-30));
        worst_ref = fmax(worst_ref, fabs(hw[i] - ref) / (fabs(ref) + 1e-30));
      }
      printf("mode %d steps %d: %lld of %zu outputs differ in bits; worst rel err mma %.3g wgmma %.3g\n", mode, steps,
             differ, c.size(), worst, worst_ref);
      cudaFree(da); cudaFree(db); cudaFree(dc); cudaFree(dm); cudaFree(dw);
    }
  }
  return 0;
}

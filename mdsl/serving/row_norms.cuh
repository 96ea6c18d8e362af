// An rms_norm's statistics carried by the op that writes its input rows (gpu.py's norm_squares), written once
// for the GPU serving device's two modules: the wgmma linear whose residual sum is a norm's input writes each
// row's sum of squares a 128-column tile, and the norm, run by the next wgmma linear as it stages its rows or by
// step_kernels.cu's rms_norm, adds them in tile order. Whoever writes a tile's sum (the block that holds the
// tile's values, or the tile's last split block) and whoever normalises a row (the linear, or the kernel), the
// arithmetic is these functions', so a row's normalised values have the same bits at any row count.

namespace mdsl_norm {

constexpr int TILE = 128;   // the columns of a tile's sum (the wgmma linear's FEATURES)

// a tile's sum of squares, lane l of a warp holding its columns 4l .. 4l + 3 (zeros past the row's width): the
// lane's four in column order, then the warp's xor tree; lane 0's sum is the tile's
__device__ __forceinline__ float tile_squares(float a, float b, float c, float d) {
  float s = fmaf(a, a, 0.0f);
  s = fmaf(b, b, s);
  s = fmaf(c, c, s);
  s = fmaf(d, d, s);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// 1 / rms of a row of `width` values from its tiles' sums of squares `squares` (width / TILE of them), added in
// tile order, the loads of 32 tiles (a row of 4,096) all in flight before the first addition: where the next
// linear normalises its rows, a thread a row, each round of loads is an L2 latency before its first stage
__device__ __forceinline__ float inverse_rms(const float* squares, int width, float eps) {
  constexpr int FLIGHT = 32;
  const int tiles = width / TILE;
  float total = 0.0f;
  for (int i = 0; i < tiles; i += FLIGHT) {
    float v[FLIGHT];
#pragma unroll
    for (int j = 0; j < FLIGHT; ++j) v[j] = i + j < tiles ? squares[i + j] : 0.0f;
#pragma unroll
    for (int j = 0; j < FLIGHT; ++j)
      if (i + j < tiles) total += v[j];
  }
  return 1.0f / sqrtf(total / float(width) + eps);
}

// a value of the normalised row, as the norm writes it before any rounding: x times 1 / rms, times the weight
// (or 1 + weight)
__device__ __forceinline__ float normed(float x, float inverse, float weight, int one_plus) {
  return __fmul_rn(__fmul_rn(x, inverse), one_plus ? 1.0f + weight : weight);
}

}  // namespace mdsl_norm

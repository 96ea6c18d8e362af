// The activations of the GPU serving device's gated products (step_kernels.cu's act_mul, gated_scale and the
// experts' hidden values, linear_wgmma.cuh's gate|up epilogue), written once: a kernel that fuses the gate
// into a linear computes the bits of the act_mul kernel it replaces.

namespace mdsl_act {

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// act 0: silu, 1: GELU's tanh approximation (geglu), 2: exact (erf) GELU, 3: sigmoid (gpu.py's _ACTIVATIONS)
__device__ __forceinline__ float activate(float g, int act) {
  if (act == 0) return silu(g);
  if (act == 1) {
    const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.0f + tanhf(inner));
  }
  if (act == 2) return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
  return 1.0f / (1.0f + __expf(-g));
}

// act(g) * u, the gated product's one rounding after the activation's
__device__ __forceinline__ float gated(float g, float u, int act) { return __fmul_rn(activate(g, act), u); }

}  // namespace mdsl_act

// The merge of a kv head's attention splits into its query heads' outputs, by the split that finishes last
// (attention.cuh's attention_task). Part of device.cu (kernel_source.py expands it in place).

namespace mk {

// Lane s's split: its scale (its maximum's against the top one), and every lane the scales' weighted sum of
// the splits' sums, from one head's partials `part` (at most 32 splits): a warp's shuffles, the same bits in
// every warp
struct SplitScales {
  float scale, den;
};
__device__ __forceinline__ SplitScales split_scales(const float* part, int lane) {
  const float m = lane < SPLITS ? __ldcg(part + lane * PART) : mdsl::neg_inf();
  const float l = lane < SPLITS ? __ldcg(part + lane * PART + 1) : 0.0f;
  float top = m;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
  const float scale = lane < SPLITS ? mdsl::rescale(m, top) : 0.0f;
  float den = scale * l;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) den += __shfl_xor_sync(0xffffffffu, den, o);
  return {scale, den};
}

// Merges the SPLITS partial results of one query head of a layer into its attention output, by the whole
// block: lane s of every warp holds split s's maximum and sum, so that the top maximum, each split's scale and
// the scales' weighted sum are a warp's shuffles, with no shared memory and no barrier; thread d (+ D) holds
// its value of the first (second) half of the splits, loaded first, so that they land while the scales are
// computed; the halves meet in shared memory (one barrier; none with at most 16 splits). Every warp computes
// the same bits (xor shuffles). The partials were written by other blocks and are read from L2 (ld.cg: this
// SM's L1 may hold an earlier step's).
static_assert(SPLITS <= 32 && D <= NT, "a split's maximum and sum in each lane, a head's values one a thread");
constexpr int COMBINE_GROUPS = SPLITS > 16 && 2 * D <= NT ? 2 : 1;          // threads per value
constexpr int COMBINE_HELD = (SPLITS + COMBINE_GROUPS - 1) / COMBINE_GROUPS;   // values a thread holds
__device__ __forceinline__ void combine_head(const Params& p, int layer, int head, float* sm) {
  const float* part = p.parts + ((long long)layer * HQ + head) * SPLITS * PART;
  T* out = p.attns + (long long)layer * HQ * D + (long long)head * D;
  // the thread's index read here (volatile), not hoisted: the offsets derived from it, kept live from the
  // kernel's start, spilled the tiny models' kernels
  unsigned tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int lane = int(tid % 32), d = int(tid % D), group = int(tid / D);
  float values[COMBINE_HELD];
#pragma unroll
  for (int j = 0; j < COMBINE_HELD; ++j) {
    const int s = group * COMBINE_HELD + j;
    values[j] = group < COMBINE_GROUPS && s < SPLITS ? __ldcg(part + s * PART + 2 + d) : 0.0f;
  }
  const SplitScales scales = split_scales(part, lane);
  const float scale = scales.scale, den = scales.den;
  float num = 0.0f;
#pragma unroll
  for (int j = 0; j < COMBINE_HELD; ++j)
    num = fmaf(__shfl_sync(0xffffffffu, scale, (group * COMBINE_HELD + j) % 32), values[j], num);
  if constexpr (COMBINE_GROUPS == 2) {
    if (group == 1) sm[d] = num;
    compute_sync();
    if (group == 0) out[d] = mdsl::from_float<T>((num + sm[d]) / den);
  } else {
    if (group == 0) out[d] = mdsl::from_float<T>(num / den);
  }
}

// The merge of the G query heads of kv head g at once, each thread MERGE_EACH adjacent values of one head (a
// warp within one head, so that lane s holds split s's maximum and sum of the warp's head, as in combine_head),
// every load in flight together: merged one head after another (combine_head G times), each head's round trip
// and barrier comes after the last's. The same chains of the same products as combine_head (its groups, then
// their sum), so the same bits.
constexpr int MERGE_EACH = G * D >= NT ? G * D / NT : 1;   // (1: compiled but not called)
constexpr bool MERGE_AT_ONCE = G * D >= NT && G * D % NT == 0 && MERGE_EACH <= 2 &&
                               D % (32 * MERGE_EACH) == 0;
__device__ __forceinline__ void merge_heads(const Params& p, int layer, int g) {
  unsigned tid;   // (read here, as in combine_head)
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int lane = int(tid % 32), first = int(tid) * MERGE_EACH, h = first / D, d = first % D;
  const float* part = p.parts + ((long long)layer * HQ + g * G + h) * SPLITS * PART;
  T* out = p.attns + (long long)layer * HQ * D + (long long)(g * G + h) * D + d;
  constexpr int SLOTS_HELD = COMBINE_GROUPS * COMBINE_HELD;
  float values[SLOTS_HELD][MERGE_EACH];
#pragma unroll
  for (int s = 0; s < SLOTS_HELD; ++s) {
    const float* at = part + s * PART + 2 + d;
    if constexpr (MERGE_EACH == 2) {   // (PART and d even: 8-byte aligned)
      const float2 v = s < SPLITS ? __ldcg(reinterpret_cast<const float2*>(at)) : make_float2(0.0f, 0.0f);
      values[s][0] = v.x;
      values[s][1] = v.y;
    } else {
      values[s][0] = s < SPLITS ? __ldcg(at) : 0.0f;
    }
  }
  const SplitScales scales = split_scales(part, lane);
  const float scale = scales.scale, den = scales.den;
  float total[MERGE_EACH];
#pragma unroll
  for (int group = 0; group < COMBINE_GROUPS; ++group) {
    float num[MERGE_EACH];
#pragma unroll
    for (int e = 0; e < MERGE_EACH; ++e) num[e] = 0.0f;
#pragma unroll
    for (int j = 0; j < COMBINE_HELD; ++j) {
      const int s = group * COMBINE_HELD + j;
      const float weight = __shfl_sync(0xffffffffu, scale, s % 32);
#pragma unroll
      for (int e = 0; e < MERGE_EACH; ++e) num[e] = fmaf(weight, values[s][e], num[e]);
    }
#pragma unroll
    for (int e = 0; e < MERGE_EACH; ++e) total[e] = group == 0 ? num[e] : total[e] + num[e];
  }
#pragma unroll
  for (int e = 0; e < MERGE_EACH; ++e) out[e] = mdsl::from_float<T>(total[e] / den);
}

}  // namespace mk

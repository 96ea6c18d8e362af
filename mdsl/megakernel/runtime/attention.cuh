// Attention: a split of a kv head's cached positions (its q heads' scores, softmax statistics and weighted
// values), and the merge of a kv head's splits by the split that finishes last. Part of device.cu (kernel_source.py
// expands it in place).

namespace mk {

// attention's q heads in shared memory: dimension d of a head at q_at(d), each score lane's span of the head
// followed by Q_PAD unused floats (kernel_source.q_stride), so that the lanes of one position read different banks
constexpr int Q_SPAN = D / ATTN_LANES;   // a score lane's dimensions of a head
__device__ __forceinline__ int q_at(int d) { return d + d / Q_SPAN * Q_PAD; }
static_assert(D - 1 + (ATTN_LANES - 1) * Q_PAD < Q_STRIDE && Q_STRIDE % 4 == 0 && Q_SPAN % 4 == 0,
              "kernel_source.q_stride holds every lane's padded span, 16-byte aligned");

// one head (D values) through the optional rms norm and RoPE at `pos`, by one warp, into out (f32; a q head,
// Q_LAYOUT, at q_at). The head, its norm weights and the position's cos / sin are loaded together: one memory
// round trip, not three.
template <bool Q_LAYOUT>
__device__ void prepare_head(const T* x, const T* norm, const Params& p, long long pos, float* tmp, float* out) {
  const int lane = threadIdx.x % 32;
  constexpr int PER = (D + 31) / 32;
  const float* cs = p.rope_cos + pos * (D / 2);
  const float* sn = p.rope_sin + pos * (D / 2);
  float v[PER], weight[PER], c[PER], s[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int d = lane + 32 * j, f = d % (D / 2);
    const bool in = d < D;
    v[j] = in ? mdsl::to_float(x[d]) : 0.0f;
    weight[j] = in && norm != nullptr ? mdsl::to_float(norm[d]) : 0.0f;
    c[j] = in ? round_t(cs[f]) : 0.0f;
    s[j] = in ? round_t(sn[f]) : 0.0f;
  }
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < PER; ++j) ss = fmaf(v[j], v[j], ss);
  ss = mdsl::group_reduce<32>(ss, mdsl::Sum());
  const float r = rsqrtf(ss / float(D) + EPS);
#pragma unroll
  for (int j = 0; j < PER; ++j)
    if (lane + 32 * j < D) {
      if (norm != nullptr) v[j] = round_t(weight[j] * round_t(v[j] * r));
      tmp[lane + 32 * j] = v[j];
    }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int d = lane + 32 * j;
    if (d < D) {
      const float rotated = d < D / 2 ? -tmp[d + D / 2] : tmp[d - D / 2];
      out[Q_LAYOUT ? q_at(d) : d] = round_t(round_t(v[j] * c[j]) + round_t(rotated * s[j]));
    }
  }
  __syncwarp();
}

// Positions [lo, hi) of split `split` at position `pos` (task_plan.attention_range): at least MIN_CHUNK
// positions a split, so a short context is one split, whose softmax weights are relative to the true
// maximum as in transformers' fused attention. lo > hi for a split past the end (it has no positions).
#if MK_WINDOW
// The positions are the last WINDOW up to pos (a sliding window), chunked from the window's first.
__device__ __forceinline__ void split_positions(long long pos, int split, long long& lo, long long& hi) {
  const long long first = pos + 1 > WINDOW ? pos + 1 - WINDOW : 0, n = pos + 1 - first;
  const long long even = (n + SPLITS - 1) / SPLITS, chunk = even > MIN_CHUNK ? even : MIN_CHUNK;
  lo = first + split * chunk;
  hi = lo + chunk < pos + 1 ? lo + chunk : pos + 1;
}
#else
__device__ __forceinline__ void split_positions(long long pos, int split, long long& lo, long long& hi) {
  const long long n = pos + 1, even = (n + SPLITS - 1) / SPLITS, chunk = even > MIN_CHUNK ? even : MIN_CHUNK;
  lo = split * chunk;
  hi = lo + chunk < n ? lo + chunk : n;
}
#endif

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

// Attention of the G query heads of kv head g over split `split` of positions [0, pos]: q (and, in the
// split holding pos, k) normed and rotated, k and v appended to the cache, partial softmax sums out; the kv
// head's split that finishes last in this step also merges its heads (no combine task: one dependency hop
// less a layer).
// ATTN_PRELOAD (kernel_source.py): the split's cached key and value rows (all but the new position's) copied into
// shared memory with cp.async as the task starts, before it waits for its inputs (attention is then an early
// kind: the copies fly through the QKV phase's end and the hop), so that the scores and the weighted values
// read shared memory instead of waiting on L2 or DRAM. Their place: ATTN_PRELOAD_OFFSET, after the task's
// other shared memory (kernel_source.attention_floats counts it), 16-byte aligned.
__device__ __forceinline__ void preload_kv_rows(const LayerWeights& w, int g, long long lo, int count, long long pos,
                                                T* kbuf, T* vbuf) {
  constexpr int KV_VECTORS = D * int(sizeof(T)) / 16, PER = 16 / int(sizeof(T));
  for (int e = int(threadIdx.x); e < count * KV_VECTORS; e += NT) {
    const int i = e / KV_VECTORS, c = e % KV_VECTORS;
    const long long q = lo + i;
    if (q == pos) continue;   // the new position's row: not in the cache yet (its split appends it)
    const long long at = (q * HKV + g) * D + c * PER;
    copy_async(shared_address(kbuf + i * D + c * PER), w.k_cache + at);
    copy_async(shared_address(vbuf + i * D + c * PER), w.v_cache + at);
  }
}

__device__ void attention_task(const Params& p, const Task& t, int ready, long long step, long long pos, float* sm) {
  const int g = t.begin, split = t.end;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const LayerWeights& w = p.layers[t.layer];
  const T* qkv = p.qkvs + (long long)t.layer * QKV;
  long long lo, hi;
  split_positions(pos, split, lo, hi);
  const bool owner = lo <= pos && pos < hi;
  float* qs = sm;                      // [G][Q_STRIDE]: each head's score lanes' spans Q_PAD floats apart
  float* knew = qs + G * Q_STRIDE;     // [D]
  float* vnew = knew + D;              // [D]
  float* tmp = vnew + D;               // [NW][D]
  float* scores = tmp + NW * D;        // [G][MAX_CHUNK]
  float* stats = scores + G * MAX_CHUNK;   // [G][2]
  T* kbuf = reinterpret_cast<T*>(reinterpret_cast<char*>(sm) + ATTN_PRELOAD_OFFSET);   // [MAX_CHUNK][D] (ATTN_PRELOAD)
  T* vbuf = kbuf + MAX_CHUNK * D;                                                       // [MAX_CHUNK][D]
  if constexpr (ATTN_PRELOAD) {   // (an early kind then: its q, k and v rows are complete after the wait)
    preload_kv_rows(w, g, lo, int(hi > lo ? hi - lo : 0), pos, kbuf, vbuf);
    wait_inputs(ready);
  }
  for (int h = warp; h < G + (owner ? 1 : 0); h += NW) {
    if (h < G) prepare_head<true>(qkv + (g * G + h) * D, w.qn, p, pos, tmp + warp * D, qs + h * Q_STRIDE);
    else prepare_head<false>(qkv + HQ * D + g * D, w.kn, p, pos, tmp + warp * D, knew);
  }
  const long long cache_row = (pos * HKV + g) * D;
  if (owner)
    for (int d = threadIdx.x; d < D; d += NT) vnew[d] = mdsl::to_float(qkv[HQ * D + HKV * D + g * D + d]);
  if constexpr (ATTN_PRELOAD) copies_wait();   // this thread's rows; the barrier below, every thread's
  compute_sync();
  mark(p, 0);
  if (owner)
    for (int d = threadIdx.x; d < D; d += NT) {
      w.k_cache[cache_row + d] = mdsl::from_float<T>(knew[d]);
      w.v_cache[cache_row + d] = mdsl::from_float<T>(vnew[d]);
    }
  // scores: ATTN_LANES lanes per position, each its share of the key row as 16-byte vectors (all in flight
  // at once), the lanes' sums met by shuffles; rounds of NT / ATTN_LANES positions
  const int count = int(hi > lo ? hi - lo : 0);
  constexpr int KV_VECTORS = D * int(sizeof(T)) / 16, PER = 16 / int(sizeof(T));
  constexpr int LANE_VECTORS = KV_VECTORS / ATTN_LANES;
  static_assert(KV_VECTORS % ATTN_LANES == 0 && 32 % ATTN_LANES == 0, "ATTN_LANES splits a key row evenly");
  const int sub = threadIdx.x % ATTN_LANES;
  const float* q_lane = qs + sub * Q_PAD;   // (q_at: this lane's span, padded)
  for (int base = 0; base < count; base += NT / ATTN_LANES) {   // uniform over the block: shuffles are safe
    const int i = base + threadIdx.x / ATTN_LANES;
    const long long q = lo + i;
    float acc[G];
#pragma unroll
    for (int h = 0; h < G; ++h) acc[h] = 0.0f;
    if (i < count && q == pos) {   // the new key, from shared memory, in the cached keys' order
      for (int d = sub * (D / ATTN_LANES); d < (sub + 1) * (D / ATTN_LANES); ++d)
#pragma unroll
        for (int h = 0; h < G; ++h) acc[h] = fmaf(q_lane[h * Q_STRIDE + d], knew[d], acc[h]);
    } else if (i < count) {
      const uint4* kc = reinterpret_cast<const uint4*>(ATTN_PRELOAD ? kbuf + i * D : w.k_cache + (q * HKV + g) * D) +
                        sub * LANE_VECTORS;
#pragma unroll   // every vector of the row in flight at once: one L2 round trip, not LANE_VECTORS / 4
      for (int c = 0; c < LANE_VECTORS; ++c) {
        const uint4 raw = kc[c];
        const T* e = reinterpret_cast<const T*>(&raw);
        const int d0 = (sub * LANE_VECTORS + c) * PER;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
          const float k = mdsl::to_float(e[j]);
#pragma unroll
          for (int h = 0; h < G; ++h) acc[h] = fmaf(q_lane[h * Q_STRIDE + d0 + j], k, acc[h]);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
      for (int o = ATTN_LANES / 2; o > 0; o /= 2) acc[h] += __shfl_xor_sync(0xffffffffu, acc[h], o);
    if (i < count && sub == 0)
#pragma unroll
      for (int h = 0; h < G; ++h) scores[h * MAX_CHUNK + i] = acc[h] * SCALE;
  }
  compute_sync();
  mark(p, 1);
  for (int h = warp; h < G; h += NW) {
    float m = mdsl::neg_inf();
    for (int i = lane; i < count; i += 32) m = fmaxf(m, scores[h * MAX_CHUNK + i]);
    m = mdsl::group_reduce<32>(m, mdsl::Max());
    float l = 0.0f;
    for (int i = lane; i < count; i += 32) {   // the sum in f32, the weights of the values rounded to T
      const float e = expf(scores[h * MAX_CHUNK + i] - m);   // (as flash / memory-efficient attention do)
      scores[h * MAX_CHUNK + i] = round_t(e);
      l += e;
    }
    l = mdsl::group_reduce<32>(l, mdsl::Sum());
    if (lane == 0) { stats[2 * h] = m; stats[2 * h + 1] = l; }
  }
  compute_sync();
  mark(p, 2);
  // weighted values: warp w takes positions w, w + NW, ...; lane takes dims lane, lane + 32, ... of
  // every head; the warps' sums meet in shared memory
  constexpr int DJ = (D + 31) / 32;
  float acc[G][DJ];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int j = 0; j < DJ; ++j) acc[h][j] = 0.0f;
#pragma unroll 8   // eight positions' value rows in flight at once
  for (int i = warp; i < count; i += NW) {
    const long long q = lo + i;
    const T* vc = ATTN_PRELOAD ? vbuf + i * D : w.v_cache + (q * HKV + g) * D;
    float v[DJ];
#pragma unroll
    for (int j = 0; j < DJ; ++j) {
      const int d = lane + 32 * j;
      v[j] = d < D ? (q == pos ? vnew[d] : mdsl::to_float(vc[d])) : 0.0f;
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
      const float weight = scores[h * MAX_CHUNK + i];
#pragma unroll
      for (int j = 0; j < DJ; ++j) acc[h][j] = fmaf(weight, v[j], acc[h][j]);
    }
  }
  float* sums = stats + 2 * G;          // [NW][G][D]
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int j = 0; j < DJ; ++j)
      if (lane + 32 * j < D) sums[(warp * G + h) * D + lane + 32 * j] = acc[h][j];
  compute_sync();
  mark(p, 3);
  float* part = p.parts + (long long)t.layer * HQ * SPLITS * PART;
  for (int e = threadIdx.x; e < G * D; e += NT) {
    const int h = e / D, d = e % D;
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < NW; ++k) total += sums[k * G * D + e];
    float* out = part + ((long long)(g * G + h) * SPLITS + split) * PART;
    out[2 + d] = total;
    if (d == 0) { out[0] = stats[2 * h]; out[1] = stats[2 * h + 1]; }
  }
  __shared__ int last_split;
  compute_sync();                    // every thread's partials are written
  if (threadIdx.x == 0) {
    // publish, count, and the last one reads: one acq_rel atomic (cumulative over the compute barrier above,
    // as red.release is) in place of the threadFenceReduction pattern's two fences around a relaxed one
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                 : "=r"(before) : "l"(p.attn_done + t.layer * HKV + g) : "memory");
    last_split = before + 1u == unsigned(SPLITS) * unsigned(step + 1);
  }
  compute_sync();
  if (last_split) {
    if constexpr (MERGE_AT_ONCE) {
      merge_heads(p, t.layer, g);
    } else {
      for (int h = 0; h < G; ++h) {
        if (h > 0) compute_sync();   // (sm: the previous head's halves read)
        combine_head(p, t.layer, g * G + h, sm);
      }
    }
  }
}

// An attention split's cached keys and values (the positions before `pos`: the newest one this task writes)
// into L2, by the scheduler warp's lanes as it takes the task, before its inputs are complete: one
// prefetch.global.L2 per 128-byte line.
__device__ __forceinline__ void prefetch_kv_rows(const LayerWeights& w, int g, int split, long long pos, int lane) {
  long long lo, hi;
  split_positions(pos, split, lo, hi);
  hi = hi < pos ? hi : pos;
  constexpr int ROW_BYTES = D * int(sizeof(T)), LINE = 128, LINES = (ROW_BYTES + LINE - 1) / LINE;
  for (long long i = lane; i < (hi - lo) * LINES; i += 32) {
    const long long q = lo + i / LINES;
    const long long offset = (q * HKV + g) * (long long)ROW_BYTES + (i % LINES) * LINE;
    const char* k = reinterpret_cast<const char*>(w.k_cache) + offset;
    const char* v = reinterpret_cast<const char*>(w.v_cache) + offset;
    asm volatile("prefetch.global.L2 [%0];" :: "l"(k) : "memory");
    asm volatile("prefetch.global.L2 [%0];" :: "l"(v) : "memory");
  }
}

}  // namespace mk

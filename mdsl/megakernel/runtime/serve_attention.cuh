// The serving kernel's attention (the SERVE section): the KV append of a step's rows into the paged pools by the QKV
// tile that completes a kv head's columns, an ATTN task's items (one split of one row's range each: its q heads'
// scores over the split's keys, read through the row's entry's page table, and their softmax partials), and the
// merge of a row's splits in split order by the item that finishes last. Part of device.cu (kernel_source.py
// expands it in place).

namespace mk {

// Kv head g's key (q/k-normed where the model has the norm, rotated at the row's position: attention.cuh's
// prepare_head) and value of every row of the step into its entry's pool row for its position, a warp a row.
// The head's columns come from every QKV tile that meets them, which counted themselves before this tile saw the
// count complete.
__device__ void append_head(const Params& p, int layer, int g, float* sm) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const LayerWeights& w = p.layers[layer];
  float* tmp = sm + warp * 2 * D;   // [NW][2][D]: prepare_head's scratch, then the key
  float* key = tmp + D;
  const int rows = int(step_header(p).num_rows);
  for (int r = warp; r < rows; r += NW) {
    const StepRow row = step_rows(p)[r];
    const T* qkv = row_of(p.qkvs, layer, r, QKV);
    prepare_head<false>(qkv + HQ * D + g * D, w.kn, p, row.position, tmp, key);
    const long long at = pool_row(p, entry_of(p, row), row.position, g);
    for (int d = lane; d < D; d += 32) {
      w.k_cache[at + d] = mdsl::from_float<T>(key[d]);
      w.v_cache[at + d] = qkv[HQ * D + HKV * D + g * D + d];
    }
    __syncwarp();   // (tmp and key: the warp's next row)
  }
}

// (QKV, after its columns of every row) each kv head whose key or value columns the task's columns meet: the task
// counts itself on the head's (layer, head) append counter (one acq_rel atomic: its columns released, the others'
// acquired), and the task that brings it to the head's tiles (APPEND_TILES) times (step + 1) appends the head.
__device__ void append_kv(const Params& p, const Task& t, long long step, float* sm) {
  __shared__ int completes;
  compute_sync();   // every thread's columns are stored
  for (int g = 0; g < HKV; ++g) {
    const int k0 = HQ * D + g * D, v0 = HQ * D + HKV * D + g * D;
    if (!((t.begin < k0 + D && k0 < t.end) || (t.begin < v0 + D && v0 < t.end))) continue;
    if (threadIdx.x == 0) {
      unsigned before;
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                   : "=r"(before) : "l"(append_counter(p, t.layer, g)) : "memory");
      completes = before + 1u == unsigned(APPEND_TILES[g]) * unsigned(step + 1);
    }
    compute_sync();
    if (completes) append_head(p, t.layer, g, sm);
    compute_sync();   // (completes and sm: the next head's)
  }
}

// Row `item.row`'s splits of kv head g merged into its attention columns in split order, each split's sums scaled by
// exp(its maximum - the row's), a product and a sum each (no fused multiply-add: the serving emulator's arithmetic),
// by the `count` threads from `first` (a warp). The partials were written by other warps: read from L2.
__device__ void merge_row(const Params& p, int layer, int g, const AttnItem& item, int first, int count) {
  T* out = row_of(p.attns, layer, int(item.row), HQ * D) + g * G * D;
  const float* parts = p.parts + ((long long)g * MAX_ITEMS + item.first) * G * PART;
  for (int e = first; e < G * D; e += count) {
    const int h = e / D, d = e % D;
    float top = mdsl::neg_inf();
    for (unsigned j = 0; j < item.splits; ++j) top = fmaxf(top, __ldcg(parts + (j * G + h) * PART));
    float weighted = 0.0f, total = 0.0f;
    for (unsigned j = 0; j < item.splits; ++j) {
      const float* part = parts + (j * G + h) * PART;
      const float scale = expf(__ldcg(part) - top);
      const float value = __fmul_rn(scale, __ldcg(part + 2 + d)), sum = __fmul_rn(scale, __ldcg(part + 1));
      weighted = j == 0 ? value : __fadd_rn(weighted, value);
      total = j == 0 ? sum : __fadd_rn(total, sum);
    }
    out[e] = mdsl::from_float<T>(weighted / total);
  }
}

// A lane's VL value dimensions (lane * VL ...) of a pool row, as one vector load where they fill a 4-, 8- or 16-byte
// one (a warp's loads of a row then cover it contiguously).
constexpr int VL = (D + 31) / 32;
__device__ __forceinline__ void load_value_span(const T* row, int lane, float* v) {
  constexpr int BYTES = VL * int(sizeof(T));
  const T* at = row + lane * VL;
  if constexpr (D % 32 == 0 && BYTES == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(at);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < VL; ++j) v[j] = mdsl::to_float(e[j]);
  } else if constexpr (D % 32 == 0 && BYTES == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(at);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < VL; ++j) v[j] = mdsl::to_float(e[j]);
  } else if constexpr (D % 32 == 0 && BYTES == 4) {
    const unsigned raw = *reinterpret_cast<const unsigned*>(at);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < VL; ++j) v[j] = mdsl::to_float(e[j]);
  } else {
#pragma unroll
    for (int j = 0; j < VL; ++j) v[j] = lane * VL + j < D ? mdsl::to_float(at[j]) : 0.0f;
  }
}

// The L2 prefetch of one pool row (the bulk copy engine's: one instruction for its D values)
__device__ __forceinline__ void prefetch_row(const T* row) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(row), "n"(D * int(sizeof(T))) : "memory");
}

// ATTN (layer, kv head g = t.begin): the step's attention items t.end + ATTN_TASKS * (w + NW * n) on warp w, each
// item a warp's alone (no block barrier: a block's warps run as many items at once). Per item the warp prefetches
// its keys' and values' pool rows to L2, norms and rotates its row's G query heads (prepare_head), and runs the
// split's keys in chunks of 32, a key a lane: the lane's scores (its key row's dot products in dimension order), an
// online softmax per head (the chunk's maximum by shuffles, earlier sums rescaled by exp(old - new maximum), the sum
// in f32 per lane and added over the lanes at the end, the values' weights rounded to T) and the weighted values,
// lane l holding dimensions l * VL ... of every head, the chunk's keys in position order. Its partials [kv head]
// [item][head] (maximum, sum, D values) are a function of the row and split alone. Then the item counts itself on its
// (layer, row, kv head) merge counter; the warp that brings it to the row's splits merges them and sets it back to 0
// (its last access this step: the next is a later step's, which descends from its SCHEDULE, which waits for this
// step's every task).
__device__ void attention_items_task(const Params& p, const Task& t, float* sm) {
  const int g = t.begin, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const LayerWeights& w = p.layers[t.layer];
  float* tmp = sm + warp * (G + 1) * D;   // [NW][G + 1][D]: prepare_head's scratch, then the warp's q heads
  float* qs = tmp + D;
  constexpr int KV_VECTORS = D * int(sizeof(T)) / 16, PER = 16 / int(sizeof(T));
  constexpr int KG = KV_VECTORS < 16 ? KV_VECTORS : 16;   // a key row's 16-byte vectors in flight at once
  static_assert(KV_VECTORS % KG == 0, "a key row splits into groups of vectors evenly");
  const int items = int(serve_work(p).num_items);
  for (int i = t.end + ATTN_TASKS * warp; i < items; i += ATTN_TASKS * NW) {
    const AttnItem item = serve_items(p)[i];
    const StepRow row = step_rows(p)[item.row];
    const unsigned entry = entry_of(p, row);
    const int count = int(item.hi - item.lo);
    for (int k = lane; k < count; k += 32) {
      const long long at = pool_row(p, entry, item.lo + k, g);
      prefetch_row(w.k_cache + at);
      prefetch_row(w.v_cache + at);
    }
    const T* qkv = row_of(p.qkvs, t.layer, int(item.row), QKV);
    for (int h = 0; h < G; ++h) prepare_head<false>(qkv + (g * G + h) * D, w.qn, p, row.position, tmp, qs + h * D);
    float m[G], l[G], acc[G][VL];
#pragma unroll
    for (int h = 0; h < G; ++h) {
      m[h] = mdsl::neg_inf();
      l[h] = 0.0f;
#pragma unroll
      for (int j = 0; j < VL; ++j) acc[h][j] = 0.0f;
    }
    for (int base = 0; base < count; base += 32) {   // (uniform over the warp: the shuffles below)
      const int n = count - base < 32 ? count - base : 32;
      long long at = 0;
      float s[G];
#pragma unroll
      for (int h = 0; h < G; ++h) s[h] = 0.0f;
      if (lane < n) {
        at = pool_row(p, entry, item.lo + base + lane, g);
        const uint4* kc = reinterpret_cast<const uint4*>(w.k_cache + at);
        for (int c0 = 0; c0 < KV_VECTORS; c0 += KG) {
          uint4 raw[KG];
#pragma unroll
          for (int c = 0; c < KG; ++c) raw[c] = kc[c0 + c];
#pragma unroll
          for (int c = 0; c < KG; ++c) {
            const T* e = reinterpret_cast<const T*>(&raw[c]);
#pragma unroll
            for (int j = 0; j < PER; ++j) {
              const int d = (c0 + c) * PER + j;
              const float key = mdsl::to_float(e[j]);
#pragma unroll
              for (int h = 0; h < G; ++h) s[h] = fmaf(qs[h * D + d], key, s[h]);
            }
          }
        }
      }
      float weight[G];
#pragma unroll
      for (int h = 0; h < G; ++h) {
        const float score = lane < n ? s[h] * SCALE : mdsl::neg_inf();
        const float top = fmaxf(m[h], mdsl::group_reduce<32>(score, mdsl::Max()));
        const float alpha = expf(m[h] - top);   // (0 at the first chunk: m is -inf, top finite)
        const float e = lane < n ? expf(score - top) : 0.0f;
        l[h] = l[h] * alpha + e;
        weight[h] = round_t(e);
        m[h] = top;
#pragma unroll
        for (int j = 0; j < VL; ++j) acc[h][j] *= alpha;
      }
      for (int j0 = 0; j0 < n; j0 += 8) {   // 8 value rows in flight at once
        float v[8][VL];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const long long row_at = __shfl_sync(0xffffffffu, at, j0 + u);
          if (j0 + u < n) load_value_span(w.v_cache + row_at, lane, v[u]);
          else
#pragma unroll
            for (int j = 0; j < VL; ++j) v[u][j] = 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
#pragma unroll
          for (int h = 0; h < G; ++h) {
            const float wt = __shfl_sync(0xffffffffu, weight[h], j0 + u);
#pragma unroll
            for (int j = 0; j < VL; ++j) acc[h][j] = fmaf(wt, v[u][j], acc[h][j]);
          }
      }
    }
    float* part = p.parts + ((long long)g * MAX_ITEMS + i) * G * PART;
#pragma unroll
    for (int h = 0; h < G; ++h) {
      const float total = mdsl::group_reduce<32>(l[h], mdsl::Sum());
#pragma unroll
      for (int j = 0; j < VL; ++j)
        if (lane * VL + j < D) part[h * PART + 2 + lane * VL + j] = acc[h][j];
      if (lane == 0) {
        part[h * PART] = m[h];
        part[h * PART + 1] = total;
      }
    }
    __threadfence();   // this lane's partials, before lane 0's release below
    __syncwarp();
    unsigned* counter = merge_counter(p, t.layer, int(item.row), g);
    unsigned before = 0;
    if (lane == 0)
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
    if (__shfl_sync(0xffffffffu, before + 1u == item.splits, 0)) {
      __threadfence();   // (the other warps' partials, acquired by lane 0)
      merge_row(p, t.layer, g, item, lane, 32);
      if (lane == 0) *counter = 0u;
    }
    __syncwarp();   // (tmp and qs: the warp's next item)
  }
}

}  // namespace mk

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
// exp(its maximum - the row's), a product and a sum each (no fused multiply-add: the serving emulator's arithmetic).
// The partials were written by other blocks: read from L2.
__device__ void merge_row(const Params& p, int layer, int g, const AttnItem& item) {
  T* out = row_of(p.attns, layer, int(item.row), HQ * D) + g * G * D;
  const float* parts = p.parts + ((long long)g * MAX_ITEMS + item.first) * G * PART;
  for (int e = threadIdx.x; e < G * D; e += NT) {
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

// ATTN (layer, kv head g = t.begin): the step's attention items t.end, t.end + ATTN_TASKS, ... Per item its row's
// G query heads normed and rotated (prepare_head), their scores over the split's keys (ATTN_LANES lanes a key, as
// attention.cuh's), a softmax per head (the sum in f32, the values' weights rounded to T) and the weighted values
// (warp w the positions w, w + NW, ..., the warps' sums added in warp order): partials [kv head][item][head]
// (maximum, sum, D values). Then the item counts itself on its (layer, row, kv head) merge counter; the one that
// brings it to the row's splits merges them and sets it back to 0 (its last access this step: the next is a later
// step's, which descends from its SCHEDULE, which waits for this step's every task).
__device__ void attention_items_task(const Params& p, const Task& t, float* sm) {
  const int g = t.begin, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const LayerWeights& w = p.layers[t.layer];
  float* qs = sm;                           // [G][Q_STRIDE]
  float* tmp = qs + G * Q_STRIDE;           // [NW][D]
  float* scores = tmp + NW * D;             // [G][ITEM_KEYS]
  float* stats = scores + G * ITEM_KEYS;    // [G][2]
  float* sums = stats + 2 * G;              // [NW][G][D]
  __shared__ int merges;
  constexpr int KV_VECTORS = D * int(sizeof(T)) / 16, PER = 16 / int(sizeof(T));
  constexpr int LANE_VECTORS = KV_VECTORS / ATTN_LANES, DJ = (D + 31) / 32;
  const int items = int(serve_work(p).num_items);
  for (int i = t.end; i < items; i += ATTN_TASKS) {   // (uniform over the block)
    const AttnItem item = serve_items(p)[i];
    const StepRow row = step_rows(p)[item.row];
    const unsigned entry = entry_of(p, row);
    const int count = int(item.hi - item.lo);
    const T* qkv = row_of(p.qkvs, t.layer, int(item.row), QKV);
    for (int h = warp; h < G; h += NW)
      prepare_head<true>(qkv + (g * G + h) * D, w.qn, p, row.position, tmp + warp * D, qs + h * Q_STRIDE);
    compute_sync();
    const int sub = threadIdx.x % ATTN_LANES;
    const float* q_lane = qs + sub * Q_PAD;
    for (int base = 0; base < count; base += NT / ATTN_LANES) {   // (uniform: the shuffles below)
      const int k = base + threadIdx.x / ATTN_LANES;
      float acc[G];
#pragma unroll
      for (int h = 0; h < G; ++h) acc[h] = 0.0f;
      if (k < count) {
        const uint4* kc = reinterpret_cast<const uint4*>(w.k_cache + pool_row(p, entry, item.lo + k, g)) +
                          sub * LANE_VECTORS;
#pragma unroll
        for (int c = 0; c < LANE_VECTORS; ++c) {
          const uint4 raw = kc[c];
          const T* e = reinterpret_cast<const T*>(&raw);
          const int d0 = (sub * LANE_VECTORS + c) * PER;
#pragma unroll
          for (int j = 0; j < PER; ++j) {
            const float key = mdsl::to_float(e[j]);
#pragma unroll
            for (int h = 0; h < G; ++h) acc[h] = fmaf(q_lane[h * Q_STRIDE + d0 + j], key, acc[h]);
          }
        }
      }
#pragma unroll
      for (int h = 0; h < G; ++h)
#pragma unroll
        for (int o = ATTN_LANES / 2; o > 0; o /= 2) acc[h] += __shfl_xor_sync(0xffffffffu, acc[h], o);
      if (k < count && sub == 0)
#pragma unroll
        for (int h = 0; h < G; ++h) scores[h * ITEM_KEYS + k] = acc[h] * SCALE;
    }
    compute_sync();
    for (int h = warp; h < G; h += NW) {
      float m = mdsl::neg_inf();
      for (int k = lane; k < count; k += 32) m = fmaxf(m, scores[h * ITEM_KEYS + k]);
      m = mdsl::group_reduce<32>(m, mdsl::Max());
      float l = 0.0f;
      for (int k = lane; k < count; k += 32) {   // the sum in f32, the weights of the values rounded to T
        const float e = expf(scores[h * ITEM_KEYS + k] - m);
        scores[h * ITEM_KEYS + k] = round_t(e);
        l += e;
      }
      l = mdsl::group_reduce<32>(l, mdsl::Sum());
      if (lane == 0) {
        stats[2 * h] = m;
        stats[2 * h + 1] = l;
      }
    }
    compute_sync();
    float acc[G][DJ];
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
      for (int j = 0; j < DJ; ++j) acc[h][j] = 0.0f;
    for (int k = warp; k < count; k += NW) {
      const T* vc = w.v_cache + pool_row(p, entry, item.lo + k, g);
      float v[DJ];
#pragma unroll
      for (int j = 0; j < DJ; ++j) v[j] = lane + 32 * j < D ? mdsl::to_float(vc[lane + 32 * j]) : 0.0f;
#pragma unroll
      for (int h = 0; h < G; ++h) {
        const float weight = scores[h * ITEM_KEYS + k];
#pragma unroll
        for (int j = 0; j < DJ; ++j) acc[h][j] = fmaf(weight, v[j], acc[h][j]);
      }
    }
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
      for (int j = 0; j < DJ; ++j)
        if (lane + 32 * j < D) sums[(warp * G + h) * D + lane + 32 * j] = acc[h][j];
    compute_sync();
    float* part = p.parts + ((long long)g * MAX_ITEMS + i) * G * PART;
    for (int e = threadIdx.x; e < G * D; e += NT) {
      const int h = e / D, d = e % D;
      float total = 0.0f;
#pragma unroll
      for (int k = 0; k < NW; ++k) total += sums[k * G * D + e];
      part[h * PART + 2 + d] = total;
      if (d == 0) {
        part[h * PART] = stats[2 * h];
        part[h * PART + 1] = stats[2 * h + 1];
      }
    }
    compute_sync();   // every thread's partials are written
    unsigned* counter = merge_counter(p, t.layer, int(item.row), g);
    if (threadIdx.x == 0) {
      unsigned before;
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
      merges = before + 1u == item.splits;
    }
    compute_sync();
    if (merges) {
      merge_row(p, t.layer, g, item);
      if (threadIdx.x == 0) *counter = 0u;
    }
    compute_sync();   // (merges, and the shared memory the next item rewrites)
  }
}

}  // namespace mk

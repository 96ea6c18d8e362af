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

// Row `item.row`'s splits of kv head g merged into its attention columns by one warp: per head, lane j holds splits
// j, j + 32, ... (their maxima and sums), the row's maximum and the splits' scales exp(maximum - the row's) by
// shuffles, the scaled sums added over the lanes in a fixed tree; then lane l's dimensions (l * VL ...) summed over
// the splits in split order, a product and a sum each. The partials were written by other warps: read from L2.
constexpr int VL = (D + 31) / 32;   // a lane's value dimensions
constexpr int SPLIT_LANES = (MAX_ROW_SPLITS + 31) / 32;
__device__ void merge_row(const Params& p, int layer, int g, const AttnItem& item, int lane) {
  T* out = row_of(p.attns, layer, int(item.row), HQ * D) + g * G * D;
  const float* parts = p.parts + ((long long)g * MAX_ITEMS + item.first) * G * PART;
  const int splits = int(item.splits);
  for (int h = 0; h < G; ++h) {
    float top = mdsl::neg_inf(), most[SPLIT_LANES], sums[SPLIT_LANES];
#pragma unroll
    for (int k = 0; k < SPLIT_LANES; ++k) {
      const int j = lane + 32 * k;
      most[k] = j < splits ? __ldcg(parts + (j * G + h) * PART) : mdsl::neg_inf();
      sums[k] = j < splits ? __ldcg(parts + (j * G + h) * PART + 1) : 0.0f;
      top = fmaxf(top, most[k]);
    }
    top = mdsl::group_reduce<32>(top, mdsl::Max());
    float scale[SPLIT_LANES], total = 0.0f;
#pragma unroll
    for (int k = 0; k < SPLIT_LANES; ++k) {
      scale[k] = lane + 32 * k < splits ? expf(most[k] - top) : 0.0f;
      total = __fadd_rn(total, __fmul_rn(scale[k], sums[k]));
    }
    total = mdsl::group_reduce<32>(total, mdsl::Sum());
    float weighted[VL] = {};
#pragma unroll
    for (int k = 0; k < SPLIT_LANES; ++k)
      for (int j0 = 32 * k; j0 < splits && j0 < 32 * (k + 1); j0 += 8) {   // 8 splits' loads in flight at once
        float v[8][VL];
#pragma unroll
        for (int u = 0; u < 8; ++u)
#pragma unroll
          for (int j = 0; j < VL; ++j)
            v[u][j] = j0 + u < splits && lane * VL + j < D
                          ? __ldcg(parts + ((j0 + u) * G + h) * PART + 2 + lane * VL + j) : 0.0f;
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const float sc = __shfl_sync(0xffffffffu, scale[k], (j0 + u) % 32);
          if (j0 + u < splits)
#pragma unroll
            for (int j = 0; j < VL; ++j) {
              const float value = __fmul_rn(sc, v[u][j]);
              weighted[j] = j0 + u == 0 ? value : __fadd_rn(weighted[j], value);
            }
        }
      }
#pragma unroll
    for (int j = 0; j < VL; ++j)
      if (lane * VL + j < D) out[h * D + lane * VL + j] = mdsl::from_float<T>(weighted[j] / total);
  }
}

// A lane's VL value dimensions (lane * VL ...) of a value row (in the pool or staged in shared memory): where D is a
// multiple of 32, one load of the span (a warp's loads of a row cover it contiguously), its alignment the largest
// power of two that divides its bytes, at most 16
constexpr int SPAN_BYTES = VL * int(sizeof(T));
constexpr int SPAN_ALIGN = (SPAN_BYTES & -SPAN_BYTES) < 16 ? (SPAN_BYTES & -SPAN_BYTES) : 16;
struct alignas(SPAN_ALIGN) ValueSpan { T e[VL]; };
__device__ __forceinline__ void load_value_span(const T* row, int lane, float* v) {
  const T* at = row + lane * VL;
  if (D % 32 == 0) {
    const ValueSpan span = *reinterpret_cast<const ValueSpan*>(at);
#pragma unroll
    for (int j = 0; j < VL; ++j) v[j] = mdsl::to_float(span.e[j]);
  } else {
#pragma unroll
    for (int j = 0; j < VL; ++j) v[j] = lane * VL + j < D ? mdsl::to_float(at[j]) : 0.0f;
  }
}

// The row's G query heads of a kv head (x: the first's D values), normed and rotated as attention.cuh's prepare_head
// does one, every head's loads issued before any is used: out[h * D + d]; tmp holds G * D floats.
__device__ __forceinline__ void prepare_q_heads(const T* x, const T* norm, const Params& p, long long pos, float* tmp,
                                                float* out) {
  const int lane = threadIdx.x % 32;
  constexpr int PER = (D + 31) / 32;
  const float* cs = p.rope_cos + pos * (D / 2);
  const float* sn = p.rope_sin + pos * (D / 2);
  float v[G][PER], weight[PER], c[PER], s[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int d = lane + 32 * j, f = d % (D / 2);
    const bool in = d < D;
#pragma unroll
    for (int h = 0; h < G; ++h) v[h][j] = in ? mdsl::to_float(x[h * D + d]) : 0.0f;
    weight[j] = in && norm != nullptr ? mdsl::to_float(norm[d]) : 0.0f;
    c[j] = in ? round_t(cs[f]) : 0.0f;
    s[j] = in ? round_t(sn[f]) : 0.0f;
  }
#pragma unroll
  for (int h = 0; h < G; ++h) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) ss = fmaf(v[h][j], v[h][j], ss);
    const float r = rsqrtf(mdsl::group_reduce<32>(ss, mdsl::Sum()) / float(D) + EPS);
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (lane + 32 * j < D) {
        if (norm != nullptr) v[h][j] = round_t(weight[j] * round_t(v[h][j] * r));
        tmp[h * D + lane + 32 * j] = v[h][j];
      }
  }
  __syncwarp();
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int d = lane + 32 * j;
      if (d < D) {
        const float rotated = d < D / 2 ? -tmp[h * D + d + D / 2] : tmp[h * D + d - D / 2];
        out[h * D + d] = round_t(round_t(v[h][j] * c[j]) + round_t(rotated * s[j]));
      }
    }
  __syncwarp();
}

// A chunk's value rows (n keys from position lo, a key a lane): the lane's copied into the warp's staged values
// (cp.async: in flight without registers)
constexpr int KV_VECTORS = D * int(sizeof(T)) / 16;
__device__ __forceinline__ void copy_values(const LayerWeights& w, const Params& p, unsigned entry, unsigned lo, int g,
                                            int n, int lane, T* values) {
  if (lane >= n) return;
  constexpr int PER = 16 / int(sizeof(T));
  const T* vrow = w.v_cache + pool_row(p, entry, lo + lane, g);
  for (int c = 0; c < KV_VECTORS; ++c) copy_async(shared_address(values + lane * D + c * PER), vrow + c * PER);
}

// The L2 prefetch of one pool row (the bulk copy engine's: one instruction for its D values)
__device__ __forceinline__ void prefetch_row(const T* row) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(row), "n"(D * int(sizeof(T))) : "memory");
}

// ATTN (layer, kv head g = t.begin): the step's attention items t.end + ATTN_TASKS * (w + NW * n) on warp w, each
// item a warp's alone (no block barrier: a block's warps run as many items at once). Per item the warp prefetches
// its keys' and values' pool rows to L2, copies its first chunk's value rows, norms and rotates its row's G query
// heads (prepare_q_heads) meanwhile, and runs the split's keys in chunks of ATTN_CHUNK, a key a lane: the lane's
// value row copied into the warp's shared memory (cp.async) while it scores its key row (dot products in dimension
// order); an online softmax per head (the chunk's maximum by shuffles, earlier sums rescaled by exp(old - new
// maximum), the sum in f32 per lane and added over the lanes at the end, the values' weights rounded to T); the
// staged values weighted, lane l holding dimensions l * VL ... of every head, the chunk's keys in position order.
// Its partials [kv head][item][head] (maximum, sum, D values) are a function of the row and split alone. Then the
// item counts itself on its (layer, row, kv head) merge counter; the warp that brings it to the row's splits merges
// them and sets it back to 0 (its last access this step: the next is a later step's, which descends from its
// SCHEDULE, which waits for this step's every task). Profile marks (warp 0's first item): its tables read and rows
// prefetched, its q heads, its keys and values, its partials out and counted.
__device__ void attention_items_task(const Params& p, const Task& t, float* sm) {
  const int g = t.begin, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const LayerWeights& w = p.layers[t.layer];
  constexpr int PER = 16 / int(sizeof(T));
  constexpr int KG = KV_VECTORS < 16 ? KV_VECTORS : 16;   // a key row's 16-byte vectors in flight at once
  constexpr int WARP_FLOATS = 2 * G * D + (ATTN_CHUNK * D * int(sizeof(T)) + 3) / 4;
  static_assert(KV_VECTORS % KG == 0, "a key row splits into groups of vectors evenly");
  // per warp: prepare_q_heads' scratch [G][D], q heads [G][D], staged values [ATTN_CHUNK][D]
  float* tmp = sm + warp * WARP_FLOATS;
  float* qs = tmp + G * D;
  T* values = reinterpret_cast<T*>(qs + G * D);
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
    // the first chunk's value rows copied before the q heads are prepared: their trips from memory overlap
    copy_values(w, p, entry, item.lo, g, count < ATTN_CHUNK ? count : ATTN_CHUNK, lane, values);
    const bool first = i == t.end;   // (the profile's marks: warp 0's first item, on thread 0)
    if (first) mark(p, 0);
    prepare_q_heads(row_of(p.qkvs, t.layer, int(item.row), QKV) + g * G * D, w.qn, p, row.position, tmp, qs);
    if (first) mark(p, 1);
    float m[G], l[G], acc[G][VL];
#pragma unroll
    for (int h = 0; h < G; ++h) {
      m[h] = mdsl::neg_inf();
      l[h] = 0.0f;
#pragma unroll
      for (int j = 0; j < VL; ++j) acc[h][j] = 0.0f;
    }
    for (int base = 0; base < count; base += ATTN_CHUNK) {   // (uniform over the warp: the shuffles below)
      const int n = count - base < ATTN_CHUNK ? count - base : ATTN_CHUNK;
      float s[G];
#pragma unroll
      for (int h = 0; h < G; ++h) s[h] = 0.0f;
      if (base > 0) copy_values(w, p, entry, item.lo + base, g, n, lane, values);
      if (lane < n) {
        const uint4* kc = reinterpret_cast<const uint4*>(w.k_cache + pool_row(p, entry, item.lo + base + lane, g));
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
      copies_wait();   // this lane's value row; the warp barrier, every lane's
      __syncwarp();
      for (int j0 = 0; j0 < n; j0 += 8) {
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          float v[VL];
          if (j0 + u < n) load_value_span(values + (j0 + u) * D, lane, v);
#pragma unroll
          for (int h = 0; h < G; ++h) {
            const float wt = __shfl_sync(0xffffffffu, weight[h], (j0 + u) % 32);
            if (j0 + u < n)
#pragma unroll
              for (int j = 0; j < VL; ++j) acc[h][j] = fmaf(wt, v[j], acc[h][j]);
          }
        }
      }
      __syncwarp();   // (the staged values: the next chunk's copies)
    }
    if (first) mark(p, 2);
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
    if (first) mark(p, 3);
    if (__shfl_sync(0xffffffffu, before + 1u == item.splits, 0)) {
      __threadfence();   // (the other warps' partials, acquired by lane 0)
      merge_row(p, t.layer, g, item, lane);
      if (lane == 0) *counter = 0u;
    }
    __syncwarp();   // (tmp and qs: the warp's next item)
  }
}

}  // namespace mk

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

// Positions [lo, hi) of split `split` of layer `layer` at position `pos` (task_plan.attention_range): at least
// MIN_CHUNK positions a split, so a short context is one split, whose softmax weights are relative to the true
// maximum as in transformers' fused attention. lo > hi for a split past the end (it has no positions).
#if MK_WINDOW
// The positions are the last LAYER_WINDOW[layer] up to pos (the layer's sliding window; 0: every position),
// chunked from the window's first.
__device__ __forceinline__ void split_positions(long long pos, int split, int layer, long long& lo, long long& hi) {
  const long long window = LAYER_WINDOW[layer];
  const long long first = window > 0 && pos + 1 > window ? pos + 1 - window : 0, n = pos + 1 - first;
  const long long even = (n + SPLITS - 1) / SPLITS, chunk = even > MIN_CHUNK ? even : MIN_CHUNK;
  lo = first + split * chunk;
  hi = lo + chunk < pos + 1 ? lo + chunk : pos + 1;
}
#else
__device__ __forceinline__ void split_positions(long long pos, int split, int layer, long long& lo, long long& hi) {
  const long long n = pos + 1, even = (n + SPLITS - 1) / SPLITS, chunk = even > MIN_CHUNK ? even : MIN_CHUNK;
  lo = split * chunk;
  hi = lo + chunk < n ? lo + chunk : n;
}
#endif

// Attention of the G query heads of kv head g over split `split` of positions [0, pos]: q (and, in the
// split holding pos, k) normed and rotated, k and v appended to the cache, partial softmax sums out; the kv
// head's split that finishes last in this step also merges its heads (no combine task: one dependency hop
// less a layer).
// ATTN_PRELOAD (kernel_source.py): the split's cached key and value rows (all but the new position's) copied into
// shared memory with cp.async as the task starts, before it waits for its inputs (attention is then an early
// kind: the copies fly through the QKV phase's end and the hop), so that the scores and the weighted values
// read shared memory instead of waiting on L2 or DRAM. Their place: ATTN_PRELOAD_OFFSET, after the task's
// other shared memory (kernel_source.attention_floats counts it), 16-byte aligned.
// ATTN_STREAM (kernel_source.py, where the split's rows do not fit in shared memory: long contexts): the split's
// cached rows pass through a ring of ATTN_STREAM stages in shared memory, a stage the ROUND positions of one round
// of scores (or of weighted values), copied ATTN_STREAM - 1 rounds ahead of their use: the keys' first stages as
// the task starts, before it waits for its inputs (an early kind, as with ATTN_PRELOAD), the values' while the
// softmax runs. A stage is one bulk copy (its rows are contiguous: kv_row), issued by one thread and awaited on the
// stage's mbarrier: per-thread copies of 16 bytes kept too few bytes in flight for an SM's share of DRAM (about 12
// GB/s a split, where gemv's loads reach 27). So a split keeps ATTN_STREAM - 1 stages of rows in flight, where
// loading each round's rows itself would keep one. The products and their order are those of the direct reads:
// the same bits.
// A layer's key (value) cache: kv head g's rows of positions 0 .. MAX_SEQ one after another, D values a row, so
// that a split's rows are one contiguous range (DRAM pages read through, not a row in every one)
__device__ __forceinline__ long long kv_row(long long q, int g) { return ((long long)g * MAX_SEQ + q) * D; }

constexpr int ROUND = ROUND_SPANS * NT / ATTN_LANES;   // cached positions a round of scores (ROUND_SPANS a lane)
constexpr int RING = ATTN_STREAM > 0 ? ATTN_STREAM : 1;       // the ring's stages (1: rows not streamed)
static_assert(ROUND % NW == 0, "a warp's weighted values continue from one round into the next in position order");
static_assert(RING <= 32 && D * sizeof(T) % 16 == 0, "a stage's phase is a bit of a word; its rows whole 16 bytes");
__shared__ __align__(8) unsigned long long ring_full[RING];   // per stage: its bulk copy has landed

// (thread 0, as a streamed split starts) the stages' barriers at their first phase
__device__ __forceinline__ void ring_start() {
  if (ATTN_STREAM > 0 && threadIdx.x == 0) {
    for (int s = 0; s < RING; ++s) barrier_init(shared_address(ring_full + s));
    bulk_fences();
  }
}

// (thread 0) the rows of `round` (of the split's `count` from position lo) into its stage, where it has rows; the
// new position's row is copied too, and not read (the split that holds it takes it from shared memory)
__device__ __forceinline__ void stream_kv_rows(const T* cache, int g, long long lo, int count, int round, T* ring) {
  if (threadIdx.x == 0 && round * ROUND < count) {
    const int rows = count - round * ROUND < ROUND ? count - round * ROUND : ROUND;
    bulk_copy(shared_address(ring + round % RING * ROUND * D), cache + kv_row(lo + round * ROUND, g),
              unsigned(rows * D * sizeof(T)), shared_address(ring_full + round % RING));
  }
}

// The stage of the round before `round`, which every thread has read by the barrier, refilled with the rows RING - 1
// rounds on; then the stage of `round` awaited (its phase bit in `phases`, the same in every thread)
__device__ __forceinline__ void next_stage(const T* cache, int g, long long lo, int count, int round, T* ring,
                                           unsigned& phases) {
  compute_sync();
  stream_kv_rows(cache, g, lo, count, round + RING - 1, ring);
  const int s = round % RING;
  barrier_wait(shared_address(ring_full + s), (phases >> s) & 1u);
  phases ^= 1u << s;
}

__device__ __forceinline__ void preload_kv_rows(const LayerWeights& w, int g, long long lo, int count, long long pos,
                                                T* kbuf, T* vbuf) {
  constexpr int KV_VECTORS = D * int(sizeof(T)) / 16, PER = 16 / int(sizeof(T));
  for (int e = int(threadIdx.x); e < count * KV_VECTORS; e += NT) {
    const int i = e / KV_VECTORS, c = e % KV_VECTORS;
    const long long q = lo + i;
    if (q == pos) continue;   // the new position's row: not in the cache yet (its split appends it)
    const long long at = kv_row(q, g) + c * PER;
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
  split_positions(pos, split, t.layer, lo, hi);
  const bool owner = lo <= pos && pos < hi;
  float* qs = sm;                      // [G][Q_STRIDE]: each head's score lanes' spans Q_PAD floats apart
  float* knew = qs + G * Q_STRIDE;     // [D]
  float* vnew = knew + D;              // [D]
  float* tmp = vnew + D;               // [NW][D]
  float* scores = tmp + NW * D;        // [G][MAX_CHUNK]
  float* stats = scores + G * MAX_CHUNK;   // [G][2]
  T* kbuf = reinterpret_cast<T*>(reinterpret_cast<char*>(sm) + ATTN_PRELOAD_OFFSET);   // [MAX_CHUNK][D] (ATTN_PRELOAD)
  T* vbuf = kbuf + MAX_CHUNK * D;                                                       // [MAX_CHUNK][D]
  T* ring = kbuf;                                                                       // (ATTN_STREAM)
  const int count = int(hi > lo ? hi - lo : 0), rounds = (count + ROUND - 1) / ROUND;
  // (an early kind where its rows are preloaded or streamed: its q, k and v rows are complete after the wait)
  unsigned phases = 0;   // (ATTN_STREAM) per ring stage, the parity of its next phase
  if constexpr (ATTN_PRELOAD) preload_kv_rows(w, g, lo, count, pos, kbuf, vbuf);
  else ring_start();
  for (int r = 0; r < ATTN_STREAM - 1; ++r) stream_kv_rows(w.k_cache, g, lo, count, r, ring);
  wait_inputs(ready);
  for (int h = warp; h < G + (owner ? 1 : 0); h += NW) {
    if (h < G) prepare_head<true>(qkv + (g * G + h) * D, w.qn, p, pos, tmp + warp * D, qs + h * Q_STRIDE);
    else prepare_head<false>(qkv + HQ * D + g * D, w.kn, p, pos, tmp + warp * D, knew);
  }
  const long long cache_row = kv_row(pos, g);
  if (owner)
    for (int d = threadIdx.x; d < D; d += NT) vnew[d] = mdsl::to_float(qkv[HQ * D + HKV * D + g * D + d]);
  if constexpr (ATTN_PRELOAD) copies_wait();   // this thread's rows; the barrier below, every thread's
  compute_sync();
  mark(p, 0);
  if (owner) {
    for (int d = threadIdx.x; d < D; d += NT) {
      w.k_cache[cache_row + d] = mdsl::from_float<T>(knew[d]);
      w.v_cache[cache_row + d] = mdsl::from_float<T>(vnew[d]);
    }
    // the next steps' streamed splits read these rows with the bulk copy engine (the async proxy): the stores
    // ordered before those reads, as the events' release and acquire order them for generic loads
    if (ATTN_STREAM > 0) asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  // scores: ATTN_LANES lanes per position, each its share of the key row as 16-byte vectors (all in flight
  // at once), the lanes' sums met by shuffles; rounds of NT / ATTN_LANES positions
  constexpr int KV_VECTORS = D * int(sizeof(T)) / 16, PER = 16 / int(sizeof(T));
  constexpr int LANE_VECTORS = KV_VECTORS / ATTN_LANES;
  static_assert(KV_VECTORS % ATTN_LANES == 0 && 32 % ATTN_LANES == 0, "ATTN_LANES splits a key row evenly");
  const int sub = threadIdx.x % ATTN_LANES;
  const float* q_lane = qs + sub * Q_PAD;   // (q_at: this lane's span, padded)
  for (int round = 0; round < rounds; ++round) {   // uniform over the block: shuffles and barriers are safe
    if (ATTN_STREAM > 0) next_stage(w.k_cache, g, lo, count, round, ring, phases);
#pragma unroll   // a round's spans: their key rows in flight together
    for (int span = 0; span < ROUND_SPANS; ++span) {
      const int i = round * ROUND + span * (NT / ATTN_LANES) + threadIdx.x / ATTN_LANES;
      const long long q = lo + i;
      float acc[G];
#pragma unroll
      for (int h = 0; h < G; ++h) acc[h] = 0.0f;
      if (i < count && q == pos) {   // the new key, from shared memory, in the cached keys' order
        for (int d = sub * (D / ATTN_LANES); d < (sub + 1) * (D / ATTN_LANES); ++d)
#pragma unroll
          for (int h = 0; h < G; ++h) acc[h] = fmaf(q_lane[h * Q_STRIDE + d], knew[d], acc[h]);
      } else if (i < count) {
        const T* key = ATTN_PRELOAD     ? kbuf + i * D
                       : ATTN_STREAM > 0 ? ring + (round % RING * ROUND + i % ROUND) * D
                                         : w.k_cache + kv_row(q, g);
        const uint4* kc = reinterpret_cast<const uint4*>(key) + sub * LANE_VECTORS;
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
#if MK_SOFTCAP
      // soft-capped as eager attention computes them (transformers' one kernel for soft-capped scores): each op's
      // result rounded to T, the division by the cap a product with its f32 reciprocal
      if (i < count && sub == 0)
#pragma unroll
        for (int h = 0; h < G; ++h)
          scores[h * MAX_CHUNK + i] =
              round_t(round_t(tanhf(round_t(round_t(round_t(acc[h]) * SCALE) * SOFTCAP_INVERSE))) * SOFTCAP);
#else
      if (i < count && sub == 0)
#pragma unroll
        for (int h = 0; h < G; ++h) scores[h * MAX_CHUNK + i] = acc[h] * SCALE;
#endif
    }
  }
  compute_sync();
  mark(p, 1);
  // the values' first stages fly while the softmax runs (every thread is done with the keys' ring)
  for (int r = 0; r < ATTN_STREAM - 1; ++r) stream_kv_rows(w.v_cache, g, lo, count, r, ring);
  for (int h = warp; h < G; h += NW) {
    float m = mdsl::neg_inf();
    for (int i = lane; i < count; i += 32) m = fmaxf(m, scores[h * MAX_CHUNK + i]);
    m = mdsl::group_reduce<32>(m, mdsl::Max());
#if MK_SOFTCAP
    // eager attention's softmax: the weights normalised in f32, then rounded to T; one split's partial is then the
    // output (its sum stored as 1), several splits' are their sums times their weights' sum (merged as ever)
    float l = 0.0f;
    for (int i = lane; i < count; i += 32) l += expf(scores[h * MAX_CHUNK + i] - m);
    l = mdsl::group_reduce<32>(l, mdsl::Sum());
    for (int i = lane; i < count; i += 32) scores[h * MAX_CHUNK + i] = round_t(expf(scores[h * MAX_CHUNK + i] - m) / l);
    if (lane == 0) { stats[2 * h] = m; stats[2 * h + 1] = SPLITS == 1 ? 1.0f : l; }
#else
    float l = 0.0f;
    for (int i = lane; i < count; i += 32) {   // the sum in f32, the weights of the values rounded to T
      const float e = expf(scores[h * MAX_CHUNK + i] - m);   // (as flash / memory-efficient attention do)
      scores[h * MAX_CHUNK + i] = round_t(e);
      l += e;
    }
    l = mdsl::group_reduce<32>(l, mdsl::Sum());
    if (lane == 0) { stats[2 * h] = m; stats[2 * h + 1] = l; }
#endif
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
  // a position's weighted values into acc (its value row at vc)
  auto weigh = [&](int i, const T* vc) {
    const long long q = lo + i;
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
  };
  // warp w takes positions w, w + NW, ... (the rounds' positions in order: the same chain of products however
  // they are read)
  for (int round = 0; round < rounds; ++round) {   // (uniform over the block)
    if (ATTN_STREAM > 0) next_stage(w.v_cache, g, lo, count, round, ring, phases);
    const int end = count < (round + 1) * ROUND ? count : (round + 1) * ROUND;
#pragma unroll 8   // eight positions' value rows in flight at once
    for (int i = round * ROUND + warp; i < end; i += NW)
      weigh(i, ATTN_PRELOAD      ? vbuf + i * D
               : ATTN_STREAM > 0 ? ring + (round % RING * ROUND + i % ROUND) * D
                                 : w.v_cache + kv_row(lo + i, g));
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
#if MK_SOFTCAP
    out[2 + d] = SPLITS == 1 ? total : total * stats[2 * h + 1];   // (the normalised weights' sum times their sum)
#else
    out[2 + d] = total;
#endif
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
__device__ __forceinline__ void prefetch_kv_rows(const LayerWeights& w, int layer, int g, int split, long long pos,
                                                 int lane) {
  long long lo, hi;
  split_positions(pos, split, layer, lo, hi);
  hi = hi < pos ? hi : pos;
  // streamed rows: those of the ring's first pass only (the ring keeps ahead of the rest itself; a long split's
  // every row would take the scheduler warp thousands of prefetches before it hands the task over)
  if (ATTN_STREAM > 0 && hi - lo > ATTN_STREAM * ROUND) hi = lo + ATTN_STREAM * ROUND;
  constexpr int ROW_BYTES = D * int(sizeof(T)), LINE = 128, LINES = (ROW_BYTES + LINE - 1) / LINE;
  for (long long i = lane; i < (hi - lo) * LINES; i += 32) {
    const long long q = lo + i / LINES;
    const long long offset = kv_row(q, g) * (long long)sizeof(T) + (i % LINES) * LINE;
    const char* k = reinterpret_cast<const char*>(w.k_cache) + offset;
    const char* v = reinterpret_cast<const char*>(w.v_cache) + offset;
    asm volatile("prefetch.global.L2 [%0];" :: "l"(k) : "memory");
    asm volatile("prefetch.global.L2 [%0];" :: "l"(v) : "memory");
  }
}

}  // namespace mk

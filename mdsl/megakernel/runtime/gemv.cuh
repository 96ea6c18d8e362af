// Matrix-vector products: a linear task's input row (normalised or not) into shared memory, and its weight
// rows' dot products with it, LOADS 16-byte weight loads a lane in flight. Part of device.cu (kernel_source.py
// expands it in place).

namespace mk {

__device__ __forceinline__ float round_t(float x) { return mdsl::to_float(mdsl::from_float<T>(x)); }

// sum of the 16-byte vector w (VEC elements of T) times xs[0 .. VEC)
__device__ __forceinline__ float dot_vec(uint4 w, const float* xs) {
  const T* e = reinterpret_cast<const T*>(&w);
  const float4* x4 = reinterpret_cast<const float4*>(xs);
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < VEC / 4; ++j) {
    const float4 x = x4[j];
    acc = fmaf(mdsl::to_float(e[4 * j + 0]), x.x, acc);
    acc = fmaf(mdsl::to_float(e[4 * j + 1]), x.y, acc);
    acc = fmaf(mdsl::to_float(e[4 * j + 2]), x.z, acc);
    acc = fmaf(mdsl::to_float(e[4 * j + 3]), x.w, acc);
  }
  return acc;
}

__device__ __forceinline__ float block_sum(float v, float* red) {
  v = mdsl::group_reduce<32>(v, mdsl::Sum());
  compute_sync();                              // red may still be read by a previous reduction
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  compute_sync();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < NW; ++w) total += red[w];
  return total;
}

// A compute thread's index (< NT: the compiler then knows which of a row's loads every thread makes, and
// issues them unpredicated, ahead of the weight loads that follow them; predicated, ptxas sank two of a
// rank's three down-proj row loads below them, where they waited for the weights)
__device__ __forceinline__ int compute_thread() {
  const int t = int(threadIdx.x);
  __builtin_assume(t >= 0 && t < NT);
  return t;
}

// An input row in two halves: its loads into registers, then what uses them (gemv issues its first weight
// loads between the two under WEIGHTS_FIRST).
// InputRow: xs[0 .. K) = x as f32, every 16-byte vector of the row loaded before any is stored (one memory
// round trip; element by element, unrolled by 4, the down-proj's 12288-wide row took 12)
template <int K>
struct InputRow {
  static_assert(K % VEC == 0, "an input row is whole 16-byte vectors (so is each layer's row offset)");
  static constexpr int CHUNKS = K / VEC, PER = (CHUNKS + NT - 1) / NT;
  uint4 v[PER];
  __device__ __forceinline__ void load(const T* x) {
    const uint4* vectors = reinterpret_cast<const uint4*>(x);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int c = compute_thread() + j * NT;
      v[j] = c < CHUNKS ? vectors[c] : make_uint4(0, 0, 0, 0);
    }
  }
  __device__ __forceinline__ void finish(float* xs) const {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int c = compute_thread() + j * NT;
      if (c < CHUNKS) {
        const T* e = reinterpret_cast<const T*>(&v[j]);
#pragma unroll
        for (int k = 0; k < VEC; ++k) xs[c * VEC + k] = mdsl::to_float(e[k]);
      }
    }
    compute_sync();
  }
};
// NormedRow: xs[0 .. K) = rms_norm(x) * norm, rounded as transformers rounds it. Every value of x and norm
// weight is loaded into registers before any is used or stored, so the reads cost one memory round trip:
// with a store to xs between them, the compiler could not move the next element's (generic) loads above it
// (the store might alias them), and the row took a round trip per element (16 on a 4096-wide row).
template <int K>
struct NormedRow {
  static constexpr int PER = (K + NT - 1) / NT;
  float v[PER], weight[PER];
  template <typename Value>
  __device__ __forceinline__ void load(Value x, const T* norm) {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = compute_thread() + j * NT;
      v[j] = i < K ? x(i) : 0.0f;
      weight[j] = i < K ? mdsl::to_float(norm[i]) : 0.0f;
    }
  }
  __device__ __forceinline__ void finish(float* xs, float* red) const {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) ss = fmaf(v[j], v[j], ss);
    const float r = rsqrtf(block_sum(ss, red) / float(K) + EPS);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = compute_thread() + j * NT;
      if (i < K) xs[i] = round_t(weight[j] * round_t(v[j] * r));
    }
    compute_sync();
  }
};

// xs[0 .. H) = rms_norm(layer `layer` of a residual-stream buffer, h or mid) * norm, in two halves: the loads,
// then the norm
struct StreamRow {
  NormedRow<H> row;
  const T* single; int layer; const T* norm;
  __device__ __forceinline__ void load() {
    row.load([&](int i) { return mdsl::to_float(single[(long long)layer * H + i]); }, norm);
  }
  __device__ __forceinline__ void finish(float* xs, float* red) const { row.finish(xs, red); }
};
#if MK_NORM_1P
// NormedRow1p: xs[0 .. K) = rms_norm(x) * (1 + norm), the products in f32 and rounded once, as transformers'
// Gemma RMSNorm computes them (a fused norm whose unit_offset is set); loaded as NormedRow is
template <int K>
struct NormedRow1p : NormedRow<K> {
  __device__ __forceinline__ void finish(float* xs, float* red) const {
    constexpr int PER = NormedRow<K>::PER;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) ss = fmaf(this->v[j], this->v[j], ss);
    const float r = rsqrtf(block_sum(ss, red) / float(K) + EPS);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = compute_thread() + j * NT;
      if (i < K) xs[i] = round_t(this->v[j] * r * (1.0f + this->weight[j]));
    }
    compute_sync();
  }
};
// StreamRow's row through NormedRow1p
struct StreamRow1p {
  NormedRow1p<H> row;
  const T* single; int layer; const T* norm;
  __device__ __forceinline__ void load() {
    row.load([&](int i) { return mdsl::to_float(single[(long long)layer * H + i]); }, norm);
  }
  __device__ __forceinline__ void finish(float* xs, float* red) const { row.finish(xs, red); }
};
#endif

// Dot products of weight rows with xs. An item is ROWS rows (row(item, j) points at row j of it); each
// warp takes ITEMS consecutive items at a time and keeps LOADS 16-byte loads per lane in flight before
// the first is used (bandwidth at batch 1 needs about 32 KB in flight per SM). emit(item, acc[ROWS])
// runs on lane 0.
constexpr int LOADS = 16;
static_assert(EARLY_PASSES == 1 || EARLY_BYTES >= NT * LOADS * 16, "the early buffer holds a pass of every thread");
// (`warp`: this warp's place among the compute warps, which take the items in turn)
// `load_row` issues the input row's loads and `finish_row` normalises and stores it into xs (every compute
// warp calls each once: they hold the compute barriers). With WEIGHTS_FIRST a warp issues its first pass of
// weight loads (WEIGHTS_FIRST_EIGHTHS eighths of it) between the two, so that the weights stream while the
// row is normalised and stored; issued before the row's loads, they delayed them
// by their own time (loads return in order). `early` (a task handed over before its inputs were complete,
// load_row waiting for them first): the whole first pass is issued before load_row, so that it streams while
// the task waits (its inputs are not there to be loaded yet); `early_ahead`, its next pass is copied into the
// early buffer once the row's loads are out (EARLY_PASSES > 1).
struct NoRow { __device__ __forceinline__ void operator()() const {} };
template <int K, int ROWS, typename Row, typename Emit, typename LoadRow = NoRow, typename FinishRow = NoRow>
__device__ __forceinline__ void gemv(int begin, int end, const float* xs, Row row, Emit emit,
                                     LoadRow load_row = NoRow{}, FinishRow finish_row = NoRow{},
                                     int warp = threadIdx.x / 32, bool early = false, bool early_ahead = false) {
  constexpr int CH = K / VEC;                              // 16-byte chunks per row
  constexpr int U = CH >= 32 * 8 ? 8 : CH >= 32 * 4 ? 4 : CH >= 32 * 2 ? 2 : 1;   // chunks per row per pass
  constexpr int ITEMS = LOADS / (ROWS * U) > 0 ? LOADS / (ROWS * U) : 1;
  constexpr int R = ITEMS * ROWS, EARLY = (U * WEIGHTS_FIRST_EIGHTHS + 7) / 8;   // (>= 1 under WEIGHTS_FIRST)
  const int lane = threadIdx.x % 32;
  bool row_pending = true;   // warp-uniform
  bool ahead = false;        // warp-uniform: the next pass was copied into the early buffer (EARLY_PASSES > 1)
  // (EARLY_PASSES > 1, an early task) the warp's pass after (first, pass): the next of this item group, or
  // the first of its next group; its chunks into the early buffer, slot u * R + r as v[r][u]
  const auto copy_ahead = [&](int first, int pass) {
    if (pass + 32 * U >= CH) {
      pass = 0;
      first += NW * ITEMS;
    } else {
      pass += 32 * U;
    }
    static_assert(EARLY_PASSES == 1 || R * U <= LOADS, "the early buffer holds LOADS chunks a thread");
    if (first >= end) return false;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        // a row of the tile either way (first < end): compute-sanitizer reports a null row guarded by its own
        // test as copied (a rank's 31-row o-proj tile, its warp 7's second row past the tile)
        const bool in_tile = first + i < end;
        const T* wr = row(in_tile ? first + i : first, j);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (in_tile && pass + lane + 32 * u < CH)
            copy_async(early_slot(u * R + i * ROWS + j), wr + (pass + lane + 32 * u) * VEC);
      }
    return true;
  };
  if (!(WEIGHTS_FIRST || early)) {
    load_row();
    finish_row();
    row_pending = false;
  }
  for (int first = begin + warp * ITEMS; first < end; first += NW * ITEMS) {
    const T* w[R];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int j = 0; j < ROWS; ++j) w[i * ROWS + j] = first + i < end ? row(first + i, j) : nullptr;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int pass = 0; pass < CH; pass += 32 * U) {   // (warp-uniform: load_row's barriers)
      const int c0 = pass + lane;
      uint4 v[R][U];
      const auto load = [&](int u0, int u1) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int r = 0; r < R; ++r)
            if (u0 <= u && u < u1)
              v[r][u] = w[r] == nullptr || c0 + 32 * u >= CH ? make_uint4(0, 0, 0, 0)
                                                            : ld_weights(w[r] + (c0 + 32 * u) * VEC);
      };
      if (row_pending && early) {   // the whole pass while the inputs are awaited
        load(0, U);
        load_row();
        // and the next pass once the row's loads are out (issued before them, the copies delayed them: loads
        // return in order)
        if constexpr (EARLY_PASSES > 1)
          if (early_ahead) ahead = copy_ahead(first, pass);
        finish_row();
        row_pending = false;
      } else if (EARLY_PASSES > 1 && ahead) {   // the pass copied beside the row
        copies_wait();
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int r = 0; r < R; ++r)
            v[r][u] = w[r] == nullptr || c0 + 32 * u >= CH ? make_uint4(0, 0, 0, 0)
                                                            : ld_shared16(early_slot(u * R + r));
        ahead = false;
      } else if (row_pending) {   // EARLY of the pass's U loads before the row is finished
                                  // (registers: see kernel_source.py)
        load_row();
        load(0, EARLY);
        finish_row();
        load(EARLY, U);
        row_pending = false;
      } else {
        load(0, U);
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c0 + 32 * u < CH) {
#pragma unroll
          for (int r = 0; r < R; ++r) acc[r] += dot_vec(v[r][u], xs + (c0 + 32 * u) * VEC);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = mdsl::group_reduce<32>(acc[r], mdsl::Sum());
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
        if (first + i < end) emit(first + i, acc + i * ROWS);
    }
  }
  if (row_pending) {   // a warp without items
    load_row();
    finish_row();
  }
}

// A task's dot products (gemv), the weight rows from global memory. load_row and finish_row load the input row
// into xs (the first weight loads issued between the two under WEIGHTS_FIRST). A task handed over early
// (`ready`: its slot's ready barrier) waits for its inputs just before load_row (every compute warp calls it
// once), its first pass of weight loads issued before (gemv's `early`).
template <int K, int ROWS, typename Row, typename Emit, typename LoadRow, typename FinishRow>
__device__ __forceinline__ void task_gemv(const Task& t, int ready, const float* xs, Row row, Emit emit,
                                          LoadRow load_inputs_row, FinishRow finish_row) {
  const auto load_row = [&] {
    wait_inputs(ready);
    load_inputs_row();
  };
  gemv<K, ROWS>(t.begin, t.end, xs, row, emit, load_row, finish_row, threadIdx.x / 32, ready != 0,
                ((EARLY_PASS_KINDS >> t.kind) & 1) != 0);
}

}  // namespace mk

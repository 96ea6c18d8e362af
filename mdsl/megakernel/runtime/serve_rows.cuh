// The serving kernel's linear tasks over a step's rows (the SERVE section): each row's input into shared memory by a
// warp, then each pass of weight loads serving a group of rows (gemv_rows), each (row, column) product in the order a
// row has alone. Part of device.cu (kernel_source.py expands it in place).

namespace mk {

// ---- linear kinds over the step's rows

// A step row's input, by one warp (a group's rows load and reduce side by side, each its own warp's: one memory round
// trip and no block barrier a row). warp_vectors: each(i, value) for the K values of x, lane l taking its 16-byte
// vectors l, l + 32, ..., 8 of them in flight at once. input_row stores x as f32 into xs; normed_row also sums their
// squares (each lane's in its order, then the warp's shuffle tree), then scales xs in place by rms_norm's factor and
// the norm's weights, rounded as the one-row bodies round them (gemv.cuh's NormedRow).
constexpr int INPUT_BATCH = 8;
template <int K, typename Each>
__device__ __forceinline__ void warp_vectors(const T* x, Each each) {
  static_assert(K % VEC == 0, "an input row is whole 16-byte vectors (so is each layer's row offset)");
  constexpr int CHUNKS = K / VEC;
  const int lane = threadIdx.x % 32;
  const uint4* vectors = reinterpret_cast<const uint4*>(x);
  for (int c0 = 0; c0 < CHUNKS; c0 += 32 * INPUT_BATCH) {
    uint4 v[INPUT_BATCH];
#pragma unroll
    for (int j = 0; j < INPUT_BATCH; ++j) {
      const int c = c0 + lane + 32 * j;
      v[j] = c < CHUNKS ? vectors[c] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < INPUT_BATCH; ++j) {
      const int c = c0 + lane + 32 * j;
      if (c < CHUNKS) {
        const T* e = reinterpret_cast<const T*>(&v[j]);
#pragma unroll
        for (int k = 0; k < VEC; ++k) each(c * VEC + k, mdsl::to_float(e[k]));
      }
    }
  }
}
// The row is stored as f32 (`float* xs`: gemv_rows' inputs) or as T (`Staged`: the tensor cores' A operand,
// serve_tensor.cuh), the same values either way (each is a T value). A lane reads back only what it stored.
struct Staged { T* row; };
__device__ __forceinline__ void store_input(float* xs, int i, float value) { xs[i] = value; }
__device__ __forceinline__ void store_input(Staged xs, int i, float value) { xs.row[i] = mdsl::from_float<T>(value); }
__device__ __forceinline__ float stored_input(const float* xs, int i) { return xs[i]; }
__device__ __forceinline__ float stored_input(Staged xs, int i) { return mdsl::to_float(xs.row[i]); }
template <int K, typename X>
__device__ __forceinline__ void input_row(const T* x, X xs) {
  warp_vectors<K>(x, [&](int i, float value) { store_input(xs, i, value); });
}
// (a row of one batch of vectors, K <= 32 * INPUT_BATCH * VEC: its values and the norm's weights loaded together,
// one trip from memory, the row kept in registers; a longer row is stored, then read back to be scaled)
template <int K, typename X>
__device__ __forceinline__ void normed_row(const T* x, const T* norm, X xs) {
  constexpr int CHUNKS = K / VEC;
  if (CHUNKS <= 32 * INPUT_BATCH) {
    const int lane = threadIdx.x % 32;
    uint4 v[INPUT_BATCH], n[INPUT_BATCH];
#pragma unroll
    for (int j = 0; j < INPUT_BATCH; ++j) {
      const int c = lane + 32 * j;
      v[j] = c < CHUNKS ? reinterpret_cast<const uint4*>(x)[c] : make_uint4(0, 0, 0, 0);
      n[j] = c < CHUNKS ? reinterpret_cast<const uint4*>(norm)[c] : make_uint4(0, 0, 0, 0);
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < INPUT_BATCH; ++j) {
      const T* e = reinterpret_cast<const T*>(&v[j]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) ss = fmaf(mdsl::to_float(e[k]), mdsl::to_float(e[k]), ss);
    }
    const float r = rsqrtf(mdsl::group_reduce<32>(ss, mdsl::Sum()) / float(K) + EPS);
#pragma unroll
    for (int j = 0; j < INPUT_BATCH; ++j) {
      const int c = lane + 32 * j;
      const T* e = reinterpret_cast<const T*>(&v[j]);
      const T* w = reinterpret_cast<const T*>(&n[j]);
      if (c < CHUNKS)
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          store_input(xs, c * VEC + k, round_t(mdsl::to_float(w[k]) * round_t(mdsl::to_float(e[k]) * r)));
    }
    return;
  }
  float ss = 0.0f;
  warp_vectors<K>(x, [&](int i, float value) {
    store_input(xs, i, value);
    ss = fmaf(value, value, ss);
  });
  const float r = rsqrtf(mdsl::group_reduce<32>(ss, mdsl::Sum()) / float(K) + EPS);
  warp_vectors<K>(norm, [&](int i, float weight) {
    store_input(xs, i, round_t(weight * round_t(stored_input(xs, i) * r)));
  });
}

// rows_linear's two bodies, chosen by overload on the tag (serve_tensor.cuh: TensorRows<K>::FITS)
template <bool TENSOR> struct Cores {};

// gemv_rows' layout: gemv's chunks a lane takes a pass (U), items a warp takes at a time (ITEMS), and the rows one
// pass of weight loads serves (GROUP): as many as their accumulators fit beside the loads' registers and their input
// rows fit in SERVE_ROW_FLOATS of shared memory, at most ROW_GROUP
template <int K, int ROWS>
struct RowsGemv {
  static constexpr int CH = K / VEC;
  static constexpr int U = CH >= 32 * 8 ? 8 : CH >= 32 * 4 ? 4 : CH >= 32 * 2 ? 2 : 1;
  static constexpr int ITEMS = LOADS / (ROWS * U) > 0 ? LOADS / (ROWS * U) : 1;
  static constexpr int R = ITEMS * ROWS;
  static constexpr int BY_REGISTERS = 32 / R > 0 ? 32 / R : 1, BY_MEMORY = SERVE_ROW_FLOATS / K;
  static constexpr int FIT = BY_REGISTERS < BY_MEMORY ? BY_REGISTERS : BY_MEMORY;
  static constexpr int GROUP = FIT < ROW_GROUP ? FIT : ROW_GROUP;
  static_assert(BY_MEMORY >= 1, "serving_source.py sizes SERVE_ROW_FLOATS for the widest input row");
};

// (thread 0) the profile's k-th mark of the body now (the serving kernel always has a profile buffer: mark()'s test of
// it is not needed where a caller has no Params)
__device__ __forceinline__ void mark_at(int k) { body_marks[k] = globaltimer(); }

// An early task's wait for its inputs (its slot's ready barrier, `ready`; 0: a task handed over with its inputs
// complete): false where they never come (the launch stops meanwhile), and the body then writes nothing, so that the
// step's rows and the KV pool stay as the last whole step left them.
__device__ __forceinline__ bool inputs_ready(int ready) {
  if (ready == 0) return true;
  named_sync(ready, BLOCK);
  return !early_failed[ready - BAR_READY];
}

// Dot products of weight rows with `nr` input rows at once (row n at xs + n * K, nr <= NR): gemv's items, passes
// and lanes, each weight load used by every row while it is in registers, and each (row, item) accumulated in one
// order, the same whatever the other rows and their count: a row's bits are those it has alone. emit(n, item,
// acc[ROWS]) runs on lane (n * ITEMS + i) % 32 of the warp, item the warp's i-th of its current ITEMS.
template <int K, int ROWS, int NR, typename Row, typename Emit>
__device__ __forceinline__ void gemv_rows(int begin, int end, const float* xs, int nr, Row row, Emit emit) {
  using G = RowsGemv<K, ROWS>;
  constexpr int CH = G::CH, U = G::U, ITEMS = G::ITEMS, R = G::R;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int first = begin + warp * ITEMS; first < end; first += NW * ITEMS) {
    const T* w[R];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int j = 0; j < ROWS; ++j) w[i * ROWS + j] = first + i < end ? row(first + i, j) : nullptr;
    float acc[NR][R];
#pragma unroll
    for (int n = 0; n < NR; ++n)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[n][r] = 0.0f;
    for (int pass = 0; pass < CH; pass += 32 * U) {
      const int c0 = pass + lane;
      uint4 v[R][U];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r)
          v[r][u] = w[r] == nullptr || c0 + 32 * u >= CH ? make_uint4(0, 0, 0, 0) : ld_weights(w[r] + (c0 + 32 * u) * VEC);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c0 + 32 * u < CH) {
#pragma unroll
          for (int n = 0; n < NR; ++n)
            if (n < nr) {
#pragma unroll
              for (int r = 0; r < R; ++r) acc[n][r] += dot_vec(v[r][u], xs + n * K + (c0 + 32 * u) * VEC);
            }
        }
    }
    if (threadIdx.x == 0 && first == begin) mark_at(1);
#pragma unroll
    for (int n = 0; n < NR; ++n)
      if (n < nr) {   // (uniform over the warp)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[n][r] = mdsl::group_reduce<32>(acc[n][r], mdsl::Sum());
      }
    // each (row, item) pair's epilogue on a lane of its own, lane n * ITEMS + i (the shuffle tree left every lane
    // the sums; a select per pair, then one emit on every lane): the epilogues' loads and stores in flight together,
    // not one after another on one lane
    constexpr int PAIRS = NR * ITEMS;
#pragma unroll
    for (int q0 = 0; q0 < PAIRS; q0 += 32) {
      const int q = q0 + lane, n = q / ITEMS, i = q % ITEMS;
      float mine[ROWS];
#pragma unroll
      for (int k = 0; k < ROWS; ++k) mine[k] = 0.0f;
#pragma unroll
      for (int m = 0; m < NR; ++m)
#pragma unroll
        for (int j = 0; j < ITEMS; ++j)
          if (m * ITEMS + j == q)
#pragma unroll
            for (int k = 0; k < ROWS; ++k) mine[k] = acc[m][j * ROWS + k];
      if (q < PAIRS && n < nr && first + i < end) emit(n, first + i, mine);
    }
    if (threadIdx.x == 0 && first == begin) mark_at(2);
  }
}

// The weight rows of a warp's first pass of gemv_rows (its first ITEMS items, each's ROWS rows) into L2, so that
// their loads, issued once the inputs are in shared memory, find them there: the inputs' loads and reductions
// hide the rows' trip from memory. A lane prefetches every 32nd 128-byte line of the rows.
template <int K, int ROWS, typename Row>
__device__ __forceinline__ void prefetch_first_pass(int begin, int end, Row row) {
  using G = RowsGemv<K, ROWS>;
  constexpr int LINES = (K * int(sizeof(T)) + 127) / 128;
  const int lane = threadIdx.x % 32, first = begin + threadIdx.x / 32 * G::ITEMS;
#pragma unroll
  for (int i = 0; i < G::ITEMS; ++i)
    if (first + i < end)
#pragma unroll
      for (int j = 0; j < ROWS; ++j)
        for (int l = lane; l < LINES; l += 32)
          asm volatile("prefetch.global.L2 [%0];" :: "l"(reinterpret_cast<const char*>(row(first + i, j)) + 128 * l));
}

// A linear task's columns for `count` rows on CUDA cores (row_of_index(j): the j-th's index among the step's rows),
// RowsGemv's GROUP rows at a time: each row's input into shared memory as f32 by a warp (input(row, xs + n * K):
// input_row or normed_row), then the group's products (gemv_rows); emit(j, row, column, acc) on a lane of the warp
// (gemv_rows). The first pass's weight rows go to L2 before the task waits for its inputs (an early task: `ready`,
// worker.cuh) and before the first group's inputs load. False, and nothing written, where the inputs never come.
// The profile's mark: the first group's inputs stored.
template <int K, int ROWS, typename RowIndex, typename Input, typename Weights, typename Emit>
__device__ __forceinline__ bool rows_linear_on(Cores<false>, const Params& p, const Task& t, int ready, int count,
                                               RowIndex row_of_index, Input input, Weights weights, Emit emit,
                                               float* xs) {
  constexpr int GROUP = RowsGemv<K, ROWS>::GROUP;
  if (count > 0) prefetch_first_pass<K, ROWS>(t.begin, t.end, weights);
  if (!inputs_ready(ready)) return false;
  for (int j0 = 0; j0 < count; j0 += GROUP) {   // (uniform over the block: the inputs' barriers)
    const int nr = count - j0 < GROUP ? count - j0 : GROUP;
    for (int n = threadIdx.x / 32; n < nr; n += NW) input(row_of_index(j0 + n), xs + n * K);
    compute_sync();   // every warp's rows are stored
    if (j0 == 0) mark(p, 0);
    const auto out = [&](int n, int r, const float* acc) { emit(j0 + n, row_of_index(j0 + n), r, acc); };
    // (a lone row takes the one-row code: the group's accumulators and unrolled rows cost a lone row's products
    // several times their time; a row's sums are the same in both)
    if (nr == 1) gemv_rows<K, ROWS, 1>(t.begin, t.end, xs, nr, weights, out);
    else gemv_rows<K, ROWS, GROUP>(t.begin, t.end, xs, nr, weights, out);
    compute_sync();   // every warp has read the group's inputs before the next group's are stored
  }
  return true;
}

}  // namespace mk

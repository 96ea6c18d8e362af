// The serving kernel's linear tasks over a step's rows on tensor cores (16-bit T): the step rows are the M of
// mma.sync m16n8k16, a task's weight rows its N, 8 at a time (a tile). Every row count, one included, takes this
// path, and a (row, column) sum depends on the task alone (its tile's k order and its K slices), never on the rows
// beside it: a row's bits are those it has alone. Part of device.cu (kernel_source.py expands it in place).

namespace mk {

// A group of step rows' inputs staged as T in shared memory, row n at row + n * TensorRows<K>::KS (rows_linear's
// `input` stores a row into one: serve_rows.cuh's input_row and normed_row have overloads for it).
// K is covered in blocks of 32 values: one 16-byte vector of a weight row a lane of a quad (lanes 4g .. 4g + 3 hold
// weight row g of the tile), two k-steps. A k-step's 16 values are not K's in order: lane t's k indices 2t, 2t + 1,
// 2t + 8, 2t + 9 of step s are the block's values 8t + 4s .. 8t + 4s + 3, which its one 16-byte load of the weight
// row holds; the A fragments read the staged rows in the same order (any fixed order of K gives the same sum in
// exact arithmetic, and this one gives the same bits to every row). A staged row's stride KS is 16 words modulo 32:
// the quarter warps of the A fragments' 16-byte loads (rows g and g + 1) meet no bank twice.
template <int K>
struct TensorRows {
  static constexpr int K32 = (K + 31) / 32 * 32;
  static constexpr int KS = K32 % 64 == 0 ? K32 + 32 : K32;
  static constexpr int NB = K32 / 32;                 // 32-value blocks of K
  static constexpr int U = NB < 16 ? NB : 16;         // blocks a run: a lane's weight loads in flight at once
  static constexpr int RUNS = (NB + U - 1) / U;
  static constexpr int FIT = int(SERVE_ROW_FLOATS * 4 / (KS * int(sizeof(T)))) / 16 * 16;
  static constexpr int GROUP = FIT < 64 ? FIT : 64;   // rows staged at once: MT tiles of 16
  static constexpr int MT = GROUP / 16;
  // (f32 T and inputs too wide for 16 staged rows keep gemv_rows on CUDA cores)
  static constexpr bool FITS = sizeof(T) == 2 && GROUP >= 16;
};

// A task's split of K among warps: S slices (runs s, s + S, ... of K), S = 1 where its tiles keep every warp busy,
// else as many as leave each warp one (tile, slice) unit: a function of the task's columns alone
__device__ __forceinline__ int tensor_slices(int tiles, int runs) {
  if (tiles >= NW || tiles == 0) return 1;
  const int s = NW / tiles;
  return s < runs ? s : runs;
}

// The weight row lane g of a quad holds in `tile` (task column n = tile * 8 + g: item begin + n / ROWS, its product
// n % ROWS), nullptr past the task's last item
template <int ROWS, typename Row>
__device__ __forceinline__ const T* tensor_weight_row(int begin, int end, int tile, Row row) {
  const int n = tile * 8 + int(threadIdx.x % 32) / 4, item = begin + n / ROWS;
  return item < end ? row(item, n % ROWS) : nullptr;
}

// One warp's unit: acc = the staged rows [0, 16 MT) times its tile's weight rows over slice s of S (its runs one after
// another, each run's k-steps in order). Rows at or past nr are not read as a tile (an m tile wholly past them is
// skipped; one partly past reads stale values into rows nobody emits).
template <int K>
__device__ __forceinline__ void tensor_unit(float (&acc)[TensorRows<K>::MT][4], const T* rows, int nr, const T* w,
                                            int s, int slices) {
  using R = TensorRows<K>;
  constexpr int U = R::U, RUNS = R::RUNS;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int m = 0; m < R::MT; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[m][e] = 0.0f;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // (K a multiple of 32: every vector of a block is within K, and no lane's load needs its own test)
  const auto within = [&](int k) { return K % 32 == 0 || k < K; };
  const T* a_lo = rows + g * R::KS + 8 * t;
  for (int run = s; run < RUNS; run += slices) {
    const int k0 = run * U * 32;
    uint4 b[U];
    if (w != nullptr) {
      const T* wk = w + k0 + 8 * t;
#pragma unroll
      for (int u = 0; u < U; ++u)
        b[u] = run * U + u < R::NB && within(k0 + 32 * u + 8 * t) ? ld_weights(wk + 32 * u) : zero;
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) b[u] = zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (run * U + u < R::NB) {   // (uniform over the warp, as mma.sync needs)
        const bool in = within(k0 + 32 * u + 8 * t);
#pragma unroll
        for (int m = 0; m < R::MT; ++m)
          if (16 * m < nr) {
            const T* a = a_lo + 16 * m * R::KS + k0 + 32 * u;
            const uint4 lo = in ? *reinterpret_cast<const uint4*>(a) : zero;
            const uint4 hi = in ? *reinterpret_cast<const uint4*>(a + 8 * R::KS) : zero;
            const unsigned a0[4] = {lo.x, hi.x, lo.y, hi.y}, b0[2] = {b[u].x, b[u].y};
            const unsigned a1[4] = {lo.z, hi.z, lo.w, hi.w}, b1[2] = {b[u].z, b[u].w};
            mdsl::Mma<T>::run(acc[m], a0, b0);
            mdsl::Mma<T>::run(acc[m], a1, b1);
          }
      }
    }
  }
}

// A warp's unit's sums handed to emit(n, item, acc[ROWS]) from the fragments (S = 1): lane (g, t) holds rows
// 16m + g and 16m + g + 8, columns 2t and 2t + 1 of the tile: two items' sums (ROWS = 1) or one item's pair (ROWS = 2)
template <int K, int ROWS, typename Emit>
__device__ __forceinline__ void tensor_emit(const float (&acc)[TensorRows<K>::MT][4], int begin, int end, int tile,
                                            int nr, Emit emit) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int m = 0; m < TensorRows<K>::MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = 16 * m + 8 * h + g;
#pragma unroll
      for (int e = 0; e < 2; e += ROWS) {
        const int item = begin + (tile * 8 + 2 * t + e) / ROWS;
        if (n < nr && item < end) emit(n, item, &acc[m][2 * h + e]);
      }
    }
}

// A unit's weight rows into L2 (its tile's 8 rows over its slice's runs of R::U blocks): lane t of a quad takes
// every 4th 128-byte line of its row's runs
template <int K, int ROWS, typename Row>
__device__ __forceinline__ void tensor_prefetch(int begin, int end, int tile, int s, int slices, Row row) {
  using R = TensorRows<K>;
  const char* w = reinterpret_cast<const char*>(tensor_weight_row<ROWS>(begin, end, tile, row));
  if (w == nullptr) return;
  constexpr int RUN_BYTES = R::U * 32 * int(sizeof(T)), ROW_BYTES = K * int(sizeof(T));
  const int t = threadIdx.x % 4;
  for (int run = s; run < R::RUNS; run += slices)
    for (int at = run * RUN_BYTES + 128 * t; at < (run + 1) * RUN_BYTES && at < ROW_BYTES; at += 4 * 128)
      asm volatile("prefetch.global.L2 [%0];" :: "l"(w + at));
}

// The task's columns for the staged rows [0, nr): units (tile, slice) a warp each, NW at a time; a sliced task's
// units leave their sums in shared memory over the staged rows (every warp done with them), and each (row, item)
// pair is then summed over its slices in slice order by a thread of its own. Profile marks (thread 0, `first`):
// warp 0's products, then its sums handed on.
template <int K, int ROWS, typename Row, typename Emit>
__device__ __forceinline__ void tensor_products(int begin, int end, T* rows, int nr, Row row, Emit emit, bool first) {
  using R = TensorRows<K>;
  static_assert(ROWS == 1 || ROWS == 2, "a fragment's two columns are two items' or one item's products");
  static_assert(NW * R::GROUP * 8 <= SERVE_ROW_FLOATS, "a sliced task's sums fit where its rows were staged");
  // (the task's tiles and slices again, not passed in: kept live across the group loop they cost a spill)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tiles = ((end - begin) * ROWS + 7) / 8;
  const int slices = tensor_slices(tiles, R::RUNS);
  for (int u0 = 0; u0 < tiles * slices; u0 += NW) {   // (uniform over the block)
    const int u = u0 + warp, tile = u / slices;
    float acc[R::MT][4];
    // (a warp's next unit's rows into L2 meanwhile: its loads then wait on L2, not on memory)
    const int next = u + NW;
    if (next < tiles * slices) tensor_prefetch<K, ROWS>(begin, end, next / slices, next % slices, slices, row);
    if (u < tiles * slices)
      tensor_unit<K>(acc, rows, nr, tensor_weight_row<ROWS>(begin, end, tile, row), u % slices, slices);
    if (first && threadIdx.x == 0 && u0 == 0) mark_at(1);
    if (slices == 1) {
      if (u < tiles) tensor_emit<K, ROWS>(acc, begin, end, tile, nr, emit);
    } else {   // (one round: tiles * slices <= NW)
      float* sums = reinterpret_cast<float*>(rows);   // [unit][GROUP rows][8 columns]
      compute_sync();   // every warp has read the staged rows
      if (u < tiles * slices) {
        const int g = lane / 4, t = lane % 4;
#pragma unroll
        for (int m = 0; m < R::MT; ++m)
#pragma unroll
          for (int e = 0; e < 4; ++e) sums[(u * R::GROUP + 16 * m + 8 * (e / 2) + g) * 8 + 2 * t + e % 2] = acc[m][e];
      }
      compute_sync();
      const int items = end - begin;
      for (int q = threadIdx.x; q < nr * items; q += NT) {
        const int n = q / items, i = q % items;
        float sum[ROWS];
#pragma unroll
        for (int j = 0; j < ROWS; ++j) {
          const int c = i * ROWS + j, at = ((c / 8) * slices * R::GROUP + n) * 8 + c % 8;
          sum[j] = sums[at];
          for (int s = 1; s < slices; ++s) sum[j] += sums[at + s * R::GROUP * 8];
        }
        emit(n, begin + i, sum);
      }
    }
    if (first && threadIdx.x == 0 && u0 == 0) mark_at(2);
  }
}

// A linear task's columns for `count` rows on tensor cores: TensorRows' GROUP rows at a time staged as T by a warp a
// row (input(row, Staged)), then the task's units over them (tensor_products). As gemv's body: the first units'
// weight rows go to L2 before the task waits for its inputs; false, and nothing written, where they never come.
template <int K, int ROWS, typename RowIndex, typename Input, typename Weights, typename Emit>
__device__ __forceinline__ bool rows_linear_on(Cores<true>, const Params& p, const Task& t, int ready, int count,
                                               RowIndex row_of_index, Input input, Weights weights, Emit emit,
                                               float* xs) {
  using R = TensorRows<K>;
  const int tiles = ((t.end - t.begin) * ROWS + 7) / 8, slices = tensor_slices(tiles, R::RUNS), u = threadIdx.x / 32;
  // (a warp's first unit's weight rows into L2 before the task waits for its inputs)
  if (count > 0 && u < tiles * slices)
    tensor_prefetch<K, ROWS>(t.begin, t.end, u / slices, u % slices, slices, weights);
  if (!inputs_ready(ready)) return false;
  T* rows = reinterpret_cast<T*>(xs);
  for (int j0 = 0; j0 < count; j0 += R::GROUP) {   // (uniform over the block: the inputs' barriers)
    const int nr = count - j0 < R::GROUP ? count - j0 : R::GROUP;
    for (int n = threadIdx.x / 32; n < nr; n += NW) input(row_of_index(j0 + n), Staged{rows + n * R::KS});
    compute_sync();   // every warp's rows are stored
    if (j0 == 0) mark(p, 0);
    const auto out = [&](int n, int r, const float* acc) { emit(j0 + n, row_of_index(j0 + n), r, acc); };
    tensor_products<K, ROWS>(t.begin, t.end, rows, nr, weights, out, j0 == 0);
    compute_sync();   // every warp is done with the group's rows before the next group's are stored
  }
  return true;
}

// A linear task's columns for `count` rows of the step (row_of_index(j): the j-th's index among the step's rows):
// input(row, xs) stores a row's input (input_row or normed_row) into xs, a RowsInput<K, ROWS>; weights(item, j) is
// an item's j-th weight row; emit(j, row, item, acc[ROWS]) its sums' epilogue. On tensor cores where T is 16-bit and
// 16 rows of K fit in SERVE_ROW_FLOATS, else on CUDA cores (serve_rows.cuh); either way every row count takes the
// same body, so that a row's sums are its own alone. An early task (`ready`: worker.cuh) waits for its inputs inside.
template <int K, int ROWS> constexpr bool ON_TENSOR_CORES = TensorRows<K>::FITS && ROWS <= 2;
template <bool TENSOR> struct RowsInputOf { using type = float*; };
template <> struct RowsInputOf<true> { using type = Staged; };
// what `input` stores a row into (the generated bodies' input functors take it)
template <int K, int ROWS> using RowsInput = typename RowsInputOf<ON_TENSOR_CORES<K, ROWS>>::type;
template <int K, int ROWS, typename RowIndex, typename Input, typename Weights, typename Emit>
__device__ __forceinline__ bool rows_linear(const Params& p, const Task& t, int ready, int count,
                                            RowIndex row_of_index, Input input, Weights weights, Emit emit, float* xs) {
  return rows_linear_on<K, ROWS>(Cores<ON_TENSOR_CORES<K, ROWS>>{}, p, t, ready, count, row_of_index, input, weights,
                                 emit, xs);
}

}  // namespace mk

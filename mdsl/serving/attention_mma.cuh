// The GPU serving device's attention on tensor cores (mdsl/serving/gpu.py picks it for 16-bit KV pools and
// head dims up to 128, a multiple of 8): appended to step_kernels.cu, whose split rule (with longer
// splits) and fold it shares.
//
// A block takes a tile of up to 64 / G consecutive rows of one request (the rows of one prompt chunk, or one
// decode row) and one KV head's G query heads: 64 (row, query head) pairs, the M rows of mma.sync's m16n8k16,
// 16 a warp. For split s, each row's keys are those attention_split(n, AMMA_SPLIT_KEYS) gives it (its own
// range, cut by its own n), walked in blocks of 64 keys at absolute positions 64b .. 64b + 63: the block's
// scores S = Q K^T and P V run on tensor cores, and each M row keeps an online softmax (running max, sum and
// weighted values) over the blocks. A key outside the row's own range is masked for it: no score, a weight
// of exactly zero, and a block without a key of the row leaves its max, sum and values as they were
// (rescaled by exactly 1).
// So what a row computes depends on its own range alone, never on the rows beside it in the tile nor on the
// tile's blocks it does not take part in: its bits are the same whatever its chunk and whatever shares the
// step. The float32 queries and weights are split as x = hi + lo, both in W, and each product runs twice, hi
// then lo (they keep about 16 bits of their mantissa, as attention's float32 reference needs); the keys and
// values are the pool's W. The split's partial (values, max, sum) goes to the records
// the CUDA-core kernel writes; attention_fold then folds each row's splits (fold_splits) in a launch of its
// own, every row and KV head a block (the block of a tile's last split folding them would fold the tile's
// rows one after another).
//
// The items of a step come from the host (mdsl/serving/gpu.py attention_items): a tile and up to AMMA_UNIT of
// its consecutive splits; the grid is persistent, each block taking items x KV heads in turn, so a step's
// launch size never depends on its rows' positions. A tile whose M rows fill one warp at most (a decode row,
// a chunk of a few rows) can run solo (attention_solo, where the host sends it: gpu.py solo_tiles): each warp
// takes its own split of the item (up to AMMA_WARPS splits an item), streaming the halves of a block's keys
// and then of its values through a ring in its own quarter of the shared memory, so the four warps read
// four splits at once. Any tile can run shared (attention_mma): its warps take its M rows, and the item's
// splits are taken one after another, every block of keys and values loaded once for all of them, the next
// loading while a block runs (across the splits' boundaries too). How splits are grouped into items, and
// which kernel and warp run one, changes where a split is computed, never what it computes.

namespace serve {

constexpr int AMMA_WARPS = 4;                      // (ATT_THREADS: fold_splits runs on the same block)
constexpr int AMMA_ROWS = 16 * AMMA_WARPS;         // M rows (row, query head) of a tile
constexpr int AMMA_KEYS = 64;                      // keys of a block
constexpr int AMMA_DIM = 128;                      // the largest head dim
constexpr int AMMA_STRIDE = AMMA_DIM + 8;          // a key's row in shared memory, in W: the padding puts the
                                                   // 8 rows of an ldmatrix in 8 different 16-byte bank groups
constexpr int AMMA_STAGE = AMMA_KEYS * AMMA_STRIDE;   // W of one block's keys (or values)
// a solo warp's ring: RING halves of a block (its 64 keys' or values' dims 0-63 or 64-127, 64 W a key, the
// 16-byte chunks of key r at chunk c ^ (r % 8), so an ldmatrix's 8 rows fall in 8 bank groups)
constexpr int AMMA_HALF = AMMA_KEYS * 64;
constexpr int AMMA_RING = 3;
constexpr int AMMA_SMEM = 2 * 2 * AMMA_STAGE * 2;             // bytes, shared: keys and values, two stages
constexpr int AMMA_SOLO_SMEM = AMMA_WARPS * AMMA_RING * AMMA_HALF * 2;   // ... solo: four warps' rings
// A row's splits: attention_split's rule with splits of 128 keys where that makes ATT_MAX_SPLITS or fewer.
// Longer splits mean fewer partials to write and fold over a prompt (the CUDA-core kernel's 64 keys write
// and fold twice as many), shorter ones more blocks at once for a short context at batch 1 (each split a
// block's chain of key blocks); a long range keeps ATT_MAX_SPLITS splits to spread over the SMs.
constexpr int AMMA_SPLIT_KEYS = 128;
constexpr int AMMA_UNIT = 8;                       // the most splits of a block's item (a tile's consecutive
                                                   // splits, one softmax after another, the queries loaded once)

__device__ __forceinline__ void cp_async16(void* smem, const void* global, bool live) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(global), "r"(live ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm4(unsigned (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void ldsm4_trans(unsigned (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

template <typename W>
__device__ __forceinline__ float low_of(unsigned packed, int half) {
  const W* e = reinterpret_cast<const W*>(&packed);
  return to_f(e[half]);
}

// hi + lo of two float32 values, each packed as a pair of W
template <typename W>
__device__ __forceinline__ void split2(float a, float b, unsigned& hi, unsigned& lo) {
  hi = pack2<W>(a, b);
  lo = pack2<W>(a - low_of<W>(hi, 0), b - low_of<W>(hi, 1));
}

// the 16-byte copies of block b's keys (or values, or both: POOLS) from the pages into shared memory, chunks
// c0 .. c0 + CHUNKS - 1 of each key (all 16 of its 128 dims, padded rows of AMMA_STRIDE, or a half's 8,
// swizzled rows of 64: HALF), by THREADS threads of which this is thread idx: keys of [lo, hi) of the block,
// zeros elsewhere (past the head dim too), so a masked key's value is finite and its zero weight adds exactly
// zero. Thread idx copies chunk idx % CHUNKS of keys idx / CHUNKS, + THREADS / CHUNKS, ... of the block: its
// chunk is fixed and its keys' pages follow one from the next by adding to an offset (no division a chunk),
// and it reads the page table for a batch of its keys (eight; four of a half) before their copies
template <int THREADS, int CHUNKS, int POOLS, typename W>
__device__ __forceinline__ void copy_block(W* const (&dst)[POOLS], const W* const (&src)[POOLS], int idx, int b,
                                           int c0, int lo, int hi, const int* table, int page_size,
                                           long long stride, long long head, int kd, int dim) {
  constexpr bool HALF = CHUNKS == 8;
  constexpr int KEY_STEP = THREADS / CHUNKS, PER = AMMA_KEYS / KEY_STEP, BATCH = HALF ? 4 : PER < 8 ? PER : 8;
  static_assert((CHUNKS == 8 || CHUNKS == AMMA_DIM / 8) && THREADS % CHUNKS == 0 && AMMA_KEYS % KEY_STEP == 0 &&
                PER % BATCH == 0, "a thread's chunk is fixed");
  const int ch = idx % CHUNKS, key0 = idx / CHUNKS, c = c0 + ch;
  if (c < 2 * kd) {   // (the chunks past 2 kd: never read)
    const bool inside = 8 * c < dim;
    const int j0 = b * AMMA_KEYS + key0;
    int page = j0 / page_size, offset = j0 - page * page_size;
#pragma unroll 1
    for (int i0 = 0; i0 < PER; i0 += BATCH) {
      int at[BATCH];   // (a key's place in the pool)
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int j = j0 + KEY_STEP * (i0 + i);
        at[i] = inside && j >= lo && j < hi ? table[page] * page_size + offset : -1;
        for (offset += KEY_STEP; offset >= page_size; offset -= page_size) ++page;
      }
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int key = key0 + KEY_STEP * (i0 + i);
        const long long from = at[i] < 0 ? 0 : (long long)at[i] * stride + head + 8 * c;
        const int to = HALF ? key * 64 + 8 * (ch ^ (key % 8)) : key * AMMA_STRIDE + 8 * ch;
#pragma unroll
        for (int p = 0; p < POOLS; ++p) cp_async16(dst[p] + to, src[p] + from, at[i] >= 0);
      }
    }
  }
  cp_async_commit();
}

template <int G, typename W, bool SOLO>
__device__ void attention_mma(float* part, const float* qkv, const W* k_pool, const W* v_pool, const int* positions,
                              const int* entries, const int* page_table, int pages_per_request, int page_size,
                              int q_heads, int kv_heads, int dim, float scale, float softcap, int window,
                              const int4* items, const int* item_range, int max_splits) {
  constexpr int R = AMMA_ROWS / G;   // rows of a tile
  extern __shared__ __align__(16) unsigned char amma_smem[];
  W* const keys = reinterpret_cast<W*>(amma_smem);   // [stage][key][AMMA_STRIDE]
  W* const values = keys + 2 * AMMA_STAGE;
  // the unit's splits: each row's keys of each (first, end; empty where the row has fewer splits), the keys
  // any row takes (lo_key, hi_key)
  __shared__ int first_of[AMMA_UNIT][R], end_of[AMMA_UNIT][R], lo_key[AMMA_UNIT], hi_key[AMMA_UNIT];
  // a solo tile's query fragments (hi, lo; a lane's registers of each k16 step), read by all its warps (held
  // here, not in registers, so that a warp has room for its ring's copies beside its values and weights)
  __shared__ unsigned q_solo[2][AMMA_DIM / 16][4][WARP];
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, quad = lane / 4, t = lane % 4;
  const int kd = (dim + 15) / 16;            // k16 steps of the head dim (its chunks past dim are zeros)
  const int heads = q_heads + 2 * kv_heads;
  const long long stride = (long long)kv_heads * dim;
  const int first_item = item_range[0], total = (item_range[1] - first_item) * kv_heads;
  for (int v = blockIdx.x; v < total; v += gridDim.x) {
    const int4 item = items[first_item + v / kv_heads];
    const int h = v % kv_heads, row0 = item.x, rows = item.y, s0 = item.z, units = item.w - item.z;
    // the kernel of solo tiles (whose M rows fit one warp: a decode row, a chunk of a few rows) gives each
    // warp its own splits of the item (u = warp, warp + 4, ...) in its own ring of the shared memory; the
    // kernel of shared tiles gives the warps the tile's M rows (16 a warp) and loads every block of keys
    // once for all of them, two stages deep. A split's arithmetic is the same in both, so a row's bits do not
    // depend on which runs its tile. (Two kernels, not one with both: together they spill.)
    constexpr bool solo = SOLO;
    // each row's keys of splits s0 .. s0 + units - 1 (attention_split of its own range)
    if (threadIdx.x < R) {
      const int i = threadIdx.x;
      int lo = 0, split = 1, splits = 0, pos = -1;
      if (i < rows) {
        pos = positions[row0 + i];
        lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        const int n = pos - lo + 1, most = AMMA_SPLIT_KEYS * ATT_MAX_SPLITS;
        split = AMMA_SPLIT_KEYS * max(1, (n + most - 1) / most);
        splits = (n + split - 1) / split;
      }
      for (int u = 0; u < units; ++u) {
        const bool live = s0 + u < splits;
        first_of[u][i] = live ? lo + (s0 + u) * split : 0;
        end_of[u][i] = live ? min(pos + 1, lo + (s0 + u + 1) * split) : 0;
      }
    }
    __syncthreads();
    if (threadIdx.x < units) {
      const int u = threadIdx.x;
      int lo = 0x7fffffff, hi = 0;
      for (int i = 0; i < rows; ++i)
        if (end_of[u][i] > first_of[u][i]) {
          lo = min(lo, first_of[u][i]);
          hi = max(hi, end_of[u][i]);
        }
      lo_key[u] = hi > 0 ? lo : 0;
      hi_key[u] = hi;
    }
    __syncthreads();
    // the blocks of 64 keys of split u that hold a key of some row: the first at or after block b (-1: none)
    auto block_from = [&](int u, int b) {
      for (b = max(b, lo_key[u] / AMMA_KEYS); b * AMMA_KEYS < hi_key[u]; ++b)
        for (int i = 0; i < rows; ++i)
          if (end_of[u][i] > first_of[u][i] && first_of[u][i] < (b + 1) * AMMA_KEYS && end_of[u][i] > b * AMMA_KEYS)
            return b;
      return -1;
    };
    // the unit's steps in order (shared): each split's blocks; the first at or after block b of split u
    // ((units, 0) past the last)
    auto step_from = [&](int u, int b) {
      for (; u < units; ++u, b = 0) {
        const int found = block_from(u, b);
        if (found >= 0) return make_int2(u, found);
      }
      return make_int2(units, 0);
    };
    const int* table = page_table + (long long)entries[row0] * pages_per_request;
    const long long head = (long long)h * dim;
    // this thread's two M rows (quad and quad + 8 of its warp's 16; of the first warp's, solo): their tile
    // row and query head
    const int mwarp = solo ? 0 : warp;
    int mrow[2], mhead[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = 16 * mwarp + quad + 8 * e;
      mrow[e] = m / G;
      mhead[e] = m % G;
    }
    // the queries as A fragments, hi and lo: a k16 step's registers hold (row quad, dims 2t, 2t + 1),
    // (quad + 8, 2t ..), (quad, 2t + 8 ..), (quad + 8, 2t + 8 ..)
    unsigned qh[AMMA_DIM / 16][4], ql[AMMA_DIM / 16][4];   // (a shared tile's: a solo tile's are q_solo)
    auto load_queries = [&](bool solo_tile) {
#pragma unroll
      for (int kk = 0; kk < AMMA_DIM / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int e = r % 2, d = 16 * kk + 2 * t + 8 * (r / 2);
          float2 x = make_float2(0.0f, 0.0f);
          if (kk < kd && d < dim && mrow[e] < rows)
            x = *reinterpret_cast<const float2*>(qkv + (long long)(row0 + mrow[e]) * heads * dim +
                                                 (long long)(h * G + mhead[e]) * dim + d);
          if (solo_tile)
            split2<W>(x.x, x.y, q_solo[0][kk][r][lane], q_solo[1][kk][r][lane]);
          else
            split2<W>(x.x, x.y, qh[kk][r], ql[kk][r]);
        }
    };
    float m[2], l[2], acc[AMMA_DIM / 8][4], sc[AMMA_KEYS / 8][4];
    int first[2], end[2];
    // a split's first block: a fresh softmax
    auto fresh = [&](int u) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        m[e] = -INF;
        l[e] = 0.0f;
        first[e] = mrow[e] < rows ? first_of[u][mrow[e]] : 0;
        end[e] = mrow[e] < rows ? end_of[u][mrow[e]] : 0;
      }
#pragma unroll
      for (int nt = 0; nt < AMMA_DIM / 8; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = 0.0f;
    };
    // where key r's chunk c (16 bytes, dims 8c ..) of a block lies: a shared stage's padded rows, or a solo
    // warp's half (chunks 8 .. 15 in the second) with its swizzle
    auto at_key = [&](const W* base, bool half, int r, int c) {
      return half ? base + r * 64 + 8 * ((c % 8) ^ (r % 8)) : base + r * AMMA_STRIDE + 8 * c;
    };
    // S += Q K^T over the k16 steps k0 .. k1 - 1 of the block's keys ks (half: a solo warp's ring half, its
    // queries in q_solo; else a shared stage, the queries in registers): n8 tiles of keys; ldmatrix's four
    // matrices are keys 16u .. + 7 and 16u + 8 .. + 7, dims 16kk .. + 7 and + 8 .. + 15 (B fragments of n
    // tiles 2u and 2u + 1)
    auto scores_of = [&](const W* ks, bool half, int k0, int k1) {
#pragma unroll
      for (int kk = 0; kk < AMMA_DIM / 16; ++kk) {
        if (kk < k0 || kk >= k1 || kk >= kd) continue;
        unsigned a[4], b[4];   // (a solo tile's from shared memory)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          a[r] = half ? q_solo[0][kk][r][lane] : qh[kk][r];
          b[r] = half ? q_solo[1][kk][r][lane] : ql[kk][r];
        }
#pragma unroll
        for (int n = 0; n < AMMA_KEYS / 16; ++n) {
          unsigned kb[4];
          ldsm4(kb, at_key(ks, half, 16 * n + lane % 8 + 8 * (lane / 16), 2 * kk + (lane / 8) % 2));
          mma_16816<W>(sc[2 * n], a[0], a[1], a[2], a[3], kb[0], kb[1]);
          mma_16816<W>(sc[2 * n], b[0], b[1], b[2], b[3], kb[0], kb[1]);
          mma_16816<W>(sc[2 * n + 1], a[0], a[1], a[2], a[3], kb[2], kb[3]);
          mma_16816<W>(sc[2 * n + 1], b[0], b[1], b[2], b[3], kb[2], kb[3]);
        }
      }
    };
    auto clear_scores = [&]() {
#pragma unroll
      for (int nt = 0; nt < AMMA_KEYS / 8; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) sc[nt][r] = 0.0f;
    };
    // block b's scores S: each M row's online softmax; sc becomes the block's weights, and the max, the sum
    // and the values so far are rescaled to the block's max. Masked scores, the block's max (the quad's four
    // lanes hold a row), weights, their sum in a fixed order, and the rescale of what came before
    auto softmax = [&](int b) {
      float rescale[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float top = m[e];
#pragma unroll
        for (int nt = 0; nt < AMMA_KEYS / 8; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int j = b * AMMA_KEYS + 8 * nt + 2 * t + c;
            float x = sc[nt][2 * e + c] * scale;
            if (softcap > 0.0f) x = tanhf(x / softcap) * softcap;
            x = j >= first[e] && j < end[e] ? x : -INF;
            sc[nt][2 * e + c] = x;
            top = fmaxf(top, x);
          }
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
        rescale[e] = top == m[e] ? 1.0f : m[e] == -INF ? 0.0f : __expf(m[e] - top);
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < AMMA_KEYS / 8; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float x = sc[nt][2 * e + c];
            const float p = x == -INF ? 0.0f : __expf(x - top);
            sc[nt][2 * e + c] = p;
            sum += p;
          }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        l[e] = fmaf(l[e], rescale[e], sum);
        m[e] = top;
      }
#pragma unroll
      for (int nt = 0; nt < AMMA_DIM / 8; ++nt) {
        acc[nt][0] *= rescale[0];
        acc[nt][1] *= rescale[0];
        acc[nt][2] *= rescale[1];
        acc[nt][3] *= rescale[1];
      }
    };
    // the values += P V over the block's values vs, output dims 16 n0 .. 16 n1 - 1 (each dim's sum over the
    // block's keys in the same order whatever the range); the weights' C fragments are the A fragments of
    // k16 steps of keys; ldmatrix.trans's four matrices are keys 16j .. + 7 and + 8 .. + 15, dims 16n .. + 7
    // and + 8 .. + 15
    auto weigh = [&](const W* vs, bool half, int n0, int n1) {
#pragma unroll
      for (int j = 0; j < AMMA_KEYS / 16; ++j) {
        unsigned ph[4], pl[4];
        split2<W>(sc[2 * j][0], sc[2 * j][1], ph[0], pl[0]);
        split2<W>(sc[2 * j][2], sc[2 * j][3], ph[1], pl[1]);
        split2<W>(sc[2 * j + 1][0], sc[2 * j + 1][1], ph[2], pl[2]);
        split2<W>(sc[2 * j + 1][2], sc[2 * j + 1][3], ph[3], pl[3]);
#pragma unroll
        for (int n = 0; n < AMMA_DIM / 16; ++n) {
          if (n < n0 || n >= n1 || n >= kd) continue;
          unsigned vb[4];
          ldsm4_trans(vb, at_key(vs, half, 16 * j + lane % 8 + 8 * ((lane / 8) % 2), 2 * n + lane / 16));
          mma_16816<W>(acc[2 * n], ph[0], ph[1], ph[2], ph[3], vb[0], vb[1]);
          mma_16816<W>(acc[2 * n], pl[0], pl[1], pl[2], pl[3], vb[0], vb[1]);
          mma_16816<W>(acc[2 * n + 1], ph[0], ph[1], ph[2], ph[3], vb[2], vb[3]);
          mma_16816<W>(acc[2 * n + 1], pl[0], pl[1], pl[2], pl[3], vb[2], vb[3]);
        }
      }
    };
    // a split's last block: its partial for each M row with keys in it, [row, q head, split] of (dim
    // values, max, sum, pad)
    auto record = [&](int u) {
      const int size = dim + 4;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (end[e] <= first[e]) continue;
        float* rec = part + (((long long)(row0 + mrow[e]) * q_heads + h * G + mhead[e]) * max_splits + s0 + u) * size;
#pragma unroll
        for (int nt = 0; nt < AMMA_DIM / 8; ++nt) {
          const int d = 8 * nt + 2 * t;
          if (d < dim) *reinterpret_cast<float2*>(rec + d) = make_float2(acc[nt][2 * e], acc[nt][2 * e + 1]);
        }
        if (t == 0) {
          rec[dim] = m[e];
          rec[dim + 1] = l[e];
        }
      }
    };
    if (solo) {
      // the warp's splits; each block's parts (its keys' halves, then its values': one of each where the head
      // dim is 64 or less) stream through the warp's ring, AMMA_RING - 1 parts loading while one is used
      W* const ring = keys + warp * AMMA_RING * AMMA_HALF;
      const int halves = kd > 4 ? 2 : 1;
      if (warp == 0) load_queries(true);
      __syncthreads();
      for (int u = warp; u < units; u += AMMA_WARPS) {
        fresh(u);
        int ib = block_from(u, 0), ip = 0, issued = 0;   // the next part to load: block ib's part ip
        auto issue = [&]() {   // (past the split's last part: an empty group, so the group count holds)
          if (ib < 0) {
            cp_async_commit();
            return;
          }
          W* const to[1] = {ring + issued % AMMA_RING * AMMA_HALF};
          const W* const from[1] = {ip < halves ? k_pool : v_pool};
          copy_block<WARP, 8, 1, W>(to, from, lane, ib, 8 * (ip % halves), lo_key[u], hi_key[u], table, page_size,
                                    stride, head, kd, dim);
          ++issued;
          if (++ip == 2 * halves) {
            ip = 0;
            ib = block_from(u, ib + 1);
          }
        };
        for (int i = 0; i < AMMA_RING - 1; ++i) issue();
        int used = 0;
        // the next part in the ring, once loaded (the one loaded before it is read by now: its slot loads)
        auto next_part = [&]() {
          __syncwarp();
          issue();
          cp_async_wait<AMMA_RING - 1>();
          __syncwarp();
          return ring + used++ % AMMA_RING * AMMA_HALF;
        };
        for (int b = block_from(u, 0); b >= 0;) {
          const int next = block_from(u, b + 1);
          clear_scores();
          for (int hf = 0; hf < halves; ++hf) scores_of(next_part(), true, 4 * hf, 4 * hf + 4);
          softmax(b);
          for (int hf = 0; hf < halves; ++hf) weigh(next_part(), true, 4 * hf, 4 * hf + 4);
          if (next < 0) record(u);
          b = next;
        }
        cp_async_wait<0>();
      }
    } else {
      const bool working = 16 * warp < rows * G;   // the warp has M rows of the tile's rows
      load_queries(false);
      const W* const from[2] = {k_pool, v_pool};
      auto load = [&](int2 step, int st) {
        W* const to[2] = {keys + st * AMMA_STAGE, values + st * AMMA_STAGE};
        copy_block<ATT_THREADS, AMMA_DIM / 8, 2, W>(to, from, threadIdx.x, step.y, 0, lo_key[step.x], hi_key[step.x],
                                                    table, page_size, stride, head, kd, dim);
      };
      int2 step = step_from(0, 0);
      if (step.x < units) load(step, 0);
      for (int st = 0, u_before = -1; step.x < units; st ^= 1) {
        const int u = step.x, b = step.y;
        const int2 next = step_from(u, b + 1);
        if (u != u_before) {
          u_before = u;
          fresh(u);
        }
        if (next.x < units) {
          load(next, st ^ 1);
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        __syncthreads();
        if (working) {
          clear_scores();
          scores_of(keys + st * AMMA_STAGE, false, 0, AMMA_DIM / 16);
          softmax(b);
          weigh(values + st * AMMA_STAGE, false, 0, AMMA_DIM / 16);
          if (next.x != u) record(u);
        }
        __syncthreads();   // (the stage is read: the next load may overwrite it)
        step = next;
      }
    }
    __syncthreads();   // (every thread is past the item's steps: the next item may rewrite its ranges)
  }
}

// the fold of each row's splits once attention_mma's partials are all written: grid (rows, kv heads), a
// block of ATT_THREADS (fold_splits)
template <int G>
__device__ void attention_fold(float* out, const float* part, const int* positions, int q_heads, int dim, int window,
                               int max_splits) {
  const int r = blockIdx.x, h = blockIdx.y, pos = positions[r];
  const int lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
  const int n = pos - lo + 1, most = AMMA_SPLIT_KEYS * ATT_MAX_SPLITS;
  const int split = AMMA_SPLIT_KEYS * max(1, (n + most - 1) / most);
  fold_splits<G>(out, part, r, h, q_heads, dim, (n + split - 1) / split, max_splits);
}

}  // namespace serve

// attention on tensor cores for G query heads per KV head (1, 2, 4, 8 or 16), 16-bit pools:
// attention_mma_G_SUFFIX (shared tiles) and attention_solo_G_SUFFIX (solo tiles), items item_range[0] ..
// item_range[1] - 1 of the step's
#define ATTENTION_MMA_OF(G, SUFFIX, TYPE, SOLO, NAME)                                                          \
  extern "C" __global__ void __launch_bounds__(serve::ATT_THREADS) NAME##_##G##_##SUFFIX(                      \
      float* part, const float* qkv, const void* k_pool, const void* v_pool,                                   \
      const int* positions, const int* entries, const int* page_table, int pages_per_request, int page_size,   \
      int q_heads, int kv_heads, int dim, float scale, float softcap, int window, const int4* items,           \
      const int* item_range, int max_splits) {                                                                 \
    serve::attention_mma<G, TYPE, SOLO>(part, qkv, static_cast<const TYPE*>(k_pool),                           \
                                        static_cast<const TYPE*>(v_pool), positions, entries, page_table,      \
                                        pages_per_request, page_size, q_heads, kv_heads, dim, scale, softcap,  \
                                        window, items, item_range, max_splits);                                \
  }
#define ATTENTION_MMA(G)                                                                                     \
  ATTENTION_MMA_OF(G, bf16, __nv_bfloat16, false, attention_mma)                                              \
  ATTENTION_MMA_OF(G, f16, __half, false, attention_mma)                                                     \
  ATTENTION_MMA_OF(G, bf16, __nv_bfloat16, true, attention_solo)                                             \
  ATTENTION_MMA_OF(G, f16, __half, true, attention_solo)                                                     \
  extern "C" __global__ void __launch_bounds__(serve::ATT_THREADS) attention_fold_##G(                        \
      float* out, const float* part, const int* positions, int q_heads, int dim, int window, int max_splits) { \
    serve::attention_fold<G>(out, part, positions, q_heads, dim, window, max_splits);                        \
  }
ATTENTION_MMA(1)
ATTENTION_MMA(2)
ATTENTION_MMA(4)
ATTENTION_MMA(8)
ATTENTION_MMA(16)

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
// the CUDA-core kernel writes; attention_fold then folds each row's splits (fold_splits' arithmetic) in a
// launch of its own, every row and query head a block (fold_head: the block of a tile's last split folding
// them would fold the tile's rows one after another, and a block a KV head would fold its G heads' values
// one after another, each a memory latency). A shared tile's item of all its splits (a whole item: the
// host's choice where a step has tiles enough to fill the grid, a prompt's chunk) folds each split into its
// rows' output as the split ends, by fold_splits' arithmetic, and writes the output itself: no partials, and
// no fold for its rows (the host tells attention_fold which rows are done).
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

constexpr int AMMA_WARPS = 4;                      // (ATT_THREADS: attention_fold's block too)
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
// a shared tile's folded values (an item of all its splits: its M rows' values so far, floats, each thread's
// own, at [warp][n8 tile][register][lane])
constexpr int AMMA_FOLD = AMMA_ROWS * AMMA_DIM;
constexpr int AMMA_SMEM = 2 * 2 * AMMA_STAGE * 2 + AMMA_FOLD * 4;   // bytes, shared: keys and values, two
                                                                     // stages, and the folded values
constexpr int AMMA_SOLO_SMEM = AMMA_WARPS * AMMA_RING * AMMA_HALF * 2;   // ... solo: four warps' rings
// A row's splits: attention_split's rule with splits of 128 keys where that makes ATT_MAX_SPLITS or fewer.
// Longer splits mean fewer partials to write and fold over a prompt (the CUDA-core kernel's 64 keys write
// and fold twice as many), shorter ones more blocks at once for a short context at batch 1 (each split a
// block's chain of key blocks); a long range keeps ATT_MAX_SPLITS splits to spread over the SMs.
constexpr int AMMA_SPLIT_KEYS = 128;
constexpr int AMMA_UNIT = ATT_MAX_SPLITS;          // the most splits of a block's item (a tile's consecutive
                                                   // splits, one softmax after another, the queries loaded once)
constexpr float AMMA_LOG2E = 1.4426950408889634f;   // 1 / ln 2: scores in base 2 (one MUFU a weight)

// On Hopper (sm_90a) a shared tile runs on wgmma: its 64 M rows are one warpgroup's m64, the queries and weights
// its A operand from registers (the warps' mma.sync A fragments, unchanged), a stage's keys and values its B
// operand from shared memory, each in two halves (dims 0-63, 64-127) of 64 rows of 128 bytes in the 128-byte
// swizzle (chunk c of row r at c ^ (r % 8)), 1024-byte aligned: S = Q K^T one m64n64k16 a k16 step of dims (the
// keys K-major), P V one m64n64k16 a k16 step of keys and half of the dims (the values MN-major). Each
// accumulator takes the products of mma.sync's sequence, hi then lo a k16 step, so a row's bits are those of
// the mma.sync tiles (scripts/mma_bits_probe.cu checks the instructions' bits agree) and do not depend on the
// kernel that runs its tile.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define AMMA_WGMMA 1
#else
#define AMMA_WGMMA 0
#endif
constexpr int AMMA_WG_HALF = AMMA_KEYS * 128;            // bytes of a half (64 rows of 64 dims)
constexpr int AMMA_WG_STAGE = 2 * AMMA_WG_HALF;          // ... of a stage's keys (or values)
constexpr int AMMA_WG_SMEM = 4 * AMMA_WG_STAGE + AMMA_ROWS * AMMA_DIM * 4 + 1024;   // two stages of keys and
                                                         // values, the folded values, the alignment's slack
static_assert(AMMA_WG_SMEM <= AMMA_SMEM, "a shared tile's kernel has AMMA_SMEM bytes on any GPU");


__device__ __forceinline__ void cp_async16(void* smem, const void* global, bool live) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(global), "r"(live ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

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

#if AMMA_WGMMA
// a shared-memory operand's descriptor: 128-byte swizzle, 1024 bytes between groups of 8 rows (SBO), `lbo`
// between 64-element blocks along M / N of an MN-major operand (unused by a K-major one)
__device__ __forceinline__ unsigned long long amma_desc(unsigned address, unsigned lbo) {
  return static_cast<unsigned long long>((address & 0x3FFFF) >> 4) |
         (static_cast<unsigned long long>(lbo >> 4) << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ void amma_wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void amma_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void amma_wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
#define AMMA_D32(d)                                                                                            \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),   \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define AMMA_R36                                                                                               \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28," \
  "%29,%30,%31}, {%32,%33,%34,%35}, %36"
// d (m64n64, this thread's n8 tiles' C fragments) = a (registers, the warp's m16n8k16 A fragment) b (shared
// memory at descriptor b: K-major, TRANS 0; MN-major, TRANS 1), + d where `add` (else d's registers are not
// read: a fresh sum needs no zeroing, which between a wgmma and its wait would serialize them)
template <typename W, int TRANS>
__device__ __forceinline__ void amma_wgmma(float (&d)[8][4], const unsigned (&a)[4], unsigned long long b,
                                           bool add = true);
#define AMMA_WGMMA_OF(TYPE, NAME, TRANS)                                                                       \
  template <>                                                                                                  \
  __device__ __forceinline__ void amma_wgmma<TYPE, TRANS>(float (&d)[8][4], const unsigned (&a)[4],          \
                                                          unsigned long long b, bool add) {                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                  \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." NAME "." NAME " " AMMA_R36 ", p, 1, 1, " #TRANS ";\n}" \
                 : AMMA_D32(d)                                                                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(add)));            \
  }
AMMA_WGMMA_OF(__nv_bfloat16, "bf16", 0)
AMMA_WGMMA_OF(__nv_bfloat16, "bf16", 1)
AMMA_WGMMA_OF(__half, "f16", 0)
AMMA_WGMMA_OF(__half, "f16", 1)

// A shared tile's products on wgmma over H halves of the dims (H = 2 past 64 dims; the loads' chunks past the
// head dim and the queries' dims past it are zeros, whose products add exactly nothing). S += Q K^T over a
// stage's keys at ks: a k16 step of dims an instruction, hi then lo (q: the warp's A fragments of each step).
// S is a fresh sum: the first product does not read sc (0 + x as x: the sign of a zero sum aside, which no
// weight sees). Each waits for its products (softmax reads the scores and rescales the values; the next load
// overwrites the stage), and no branch lies between a wgmma and its wait (ptxas would serialize them)
template <typename W, int H>
__device__ __forceinline__ void amma_wg_scores(float (&sc)[8][4], const unsigned (&qh)[AMMA_DIM / 16][4],
                                               const unsigned (&ql)[AMMA_DIM / 16][4], unsigned ks) {
  amma_wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4 * H; ++kk) {
    const unsigned long long k = amma_desc(ks + (kk / 4) * AMMA_WG_HALF + 32 * (kk % 4), 16);
    amma_wgmma<W, 0>(sc, qh[kk], k, kk > 0);
    amma_wgmma<W, 0>(sc, ql[kk], k);
  }
  amma_wg_commit();
  amma_wg_wait();
}
// values += P V over a stage's values at vs, P the block's weights (sc, C fragments, split hi + lo into A
// fragments as weigh does): a k16 step of keys and a half of the dims an instruction, the halves' hi products
// then their lo ones
template <typename W, int H>
__device__ __forceinline__ void amma_wg_weigh(float (&acc)[AMMA_DIM / 8][4], const float (&sc)[8][4], unsigned vs) {
  unsigned ph[AMMA_KEYS / 16][4], pl[AMMA_KEYS / 16][4];
#pragma unroll
  for (int j = 0; j < AMMA_KEYS / 16; ++j) {
    split2<W>(sc[2 * j][0], sc[2 * j][1], ph[j][0], pl[j][0]);
    split2<W>(sc[2 * j][2], sc[2 * j][3], ph[j][1], pl[j][1]);
    split2<W>(sc[2 * j + 1][0], sc[2 * j + 1][1], ph[j][2], pl[j][2]);
    split2<W>(sc[2 * j + 1][2], sc[2 * j + 1][3], ph[j][3], pl[j][3]);
  }
  float(&lo_dims)[8][4] = *reinterpret_cast<float(*)[8][4]>(&acc[0]);
  float(&hi_dims)[8][4] = *reinterpret_cast<float(*)[8][4]>(&acc[8]);
  amma_wg_fence();
#pragma unroll
  for (int j = 0; j < AMMA_KEYS / 16; ++j) {
    const unsigned long long v0 = amma_desc(vs + 16 * j * 128, AMMA_WG_HALF);
    const unsigned long long v1 = amma_desc(vs + AMMA_WG_HALF + 16 * j * 128, AMMA_WG_HALF);
    amma_wgmma<W, 1>(lo_dims, ph[j], v0);
    if constexpr (H == 2) amma_wgmma<W, 1>(hi_dims, ph[j], v1);
    amma_wgmma<W, 1>(lo_dims, pl[j], v0);
    if constexpr (H == 2) amma_wgmma<W, 1>(hi_dims, pl[j], v1);
  }
  amma_wg_commit();
  amma_wg_wait();
}
#endif

// j / d for 0 <= j < 2^31 by a multiply and a shift (d >= 1, the page size, fixed for the kernel; as CUTLASS's
// FastDivmod): a key's page without a division per key
struct FastDiv {
  int d;
  unsigned mul, shift;
  __device__ explicit FastDiv(int divisor) : d(divisor), mul(0), shift(0) {
    if (divisor > 1) {
      const unsigned p = 31 + (32 - __clz(divisor - 1));   // 31 + ceil(log2 d)
      mul = static_cast<unsigned>(((1ull << p) + divisor - 1) / divisor);
      shift = p - 32;
    }
  }
  __device__ __forceinline__ int of(int j) const {
    return d == 1 ? j : static_cast<int>(__umulhi(static_cast<unsigned>(j), mul) >> shift);
  }
};

// a solo warp's copy of a half of block b's keys (or values) from the pages into its ring slot `dst`: chunks
// c0 .. c0 + 7 of each key (8 of its 16 dims' chunks), swizzled rows of 64 (chunk c of key r at c ^ (r % 8)):
// keys of [lo, hi) of the block, zeros elsewhere (past the head dim too), so a masked key's value is finite
// and its zero weight adds exactly zero. Lane l copies chunk l % 8 of keys l / 8, + 4, ... of the block, eight
// at a time: their pages' table entries read first (L1 holds a block's few), then the copies
template <typename W>
__device__ __forceinline__ void copy_half(W* dst, const W* src, int lane, int b, int c0, int lo, int hi,
                                          const int* table, const FastDiv& page, long long stride, long long head,
                                          int kd, int dim) {
  constexpr int KEY_STEP = WARP / 8, PER = AMMA_KEYS / KEY_STEP, BATCH = 8;
  const int ch = lane % 8, key0 = lane / 8, c = c0 + ch;
  if (c < 2 * kd) {   // (the chunks past 2 kd: never read)
    const bool inside = 8 * c < dim;
    const int j0 = b * AMMA_KEYS + key0;
    const long long offset = head + 8 * c;
#pragma unroll 1
    for (int i0 = 0; i0 < PER; i0 += BATCH) {
      int at[BATCH];   // (a key's place in the pool)
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int j = j0 + KEY_STEP * (i0 + i), q = page.of(j);
        at[i] = inside && j >= lo && j < hi ? __ldg(table + q) * page.d + (j - q * page.d) : -1;
      }
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int key = key0 + KEY_STEP * (i0 + i);
        const long long from = at[i] < 0 ? 0 : (long long)at[i] * stride + offset;
        cp_async16(dst + key * 64 + 8 * (ch ^ (key % 8)), src + from, at[i] >= 0);
      }
    }
  }
  cp_async_commit();
}

__device__ __forceinline__ void ldsm4_at(unsigned (&r)[4], unsigned s) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void ldsm4_trans_at(unsigned (&r)[4], unsigned s) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

template <int G, typename W, bool SOLO>
__device__ void attention_mma(RowsOut out, float* part, const float* qkv, const W* k_pool, const W* v_pool,
                              const int* positions, const int* entries, const int* page_table,
                              int pages_per_request, int page_size, int q_heads, int kv_heads, int dim, float scale,
                              float softcap, int window, const int4* items, const int* item_range, int max_splits) {
  constexpr int R = AMMA_ROWS / G;   // rows of a tile
  extern __shared__ __align__(16) unsigned char amma_smem[];
  // (through an opaque move: the compiler would rebuild the address before each ldmatrix, a dozen instructions)
  unsigned smem = static_cast<unsigned>(__cvta_generic_to_shared(amma_smem));
  asm volatile("mov.b32 %0, %0;" : "+r"(smem));
  constexpr bool WG = AMMA_WGMMA && !SOLO;   // a shared tile on wgmma (Hopper)
  // wgmma's stages from the first 1024-byte boundary: [key or value][stage][half][key][128 bytes]
  const unsigned wg_at = WG ? (smem + 1023) & ~1023u : smem;
  W* const keys = reinterpret_cast<W*>(amma_smem);   // [stage][key][AMMA_STRIDE]
  W* const values = keys + 2 * AMMA_STAGE;
  float* const folded = reinterpret_cast<float*>(WG ? amma_smem + (wg_at - smem) + 4 * AMMA_WG_STAGE
                                                    : reinterpret_cast<unsigned char*>(values + 2 * AMMA_STAGE));
  // ([warp][n8 tile][4][lane])
  // the item's splits: each row's range (its first key, its splits' keys, its splits, past its last key),
  // the keys any row takes of each split (lo_key, hi_key), and the blocks of 64 keys holding some row's keys:
  // bit k of block_bits for block block_base + k (block_base -1: a split over more than 64 blocks, its blocks
  // found by a scan)
  __shared__ int row_lo[R], row_split[R], row_splits[R], row_end[R], lo_key[AMMA_UNIT], hi_key[AMMA_UNIT];
  __shared__ unsigned long long block_bits[AMMA_UNIT];
  __shared__ int block_base[AMMA_UNIT];
  __shared__ __align__(16) int pool_rows[2][8][AMMA_KEYS / 8];   // (a shared tile's: its stages' keys' places)
  // a solo tile's query fragments (hi, lo; a lane's registers of each k16 step), read by all its warps (held
  // here, not in registers, so that a warp has room for its ring's copies beside its values and weights)
  __shared__ unsigned q_solo[2][AMMA_DIM / 16][4][WARP];
  const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, quad = lane / 4, t = lane % 4;
  const int kd = (dim + 15) / 16;            // k16 steps of the head dim (its chunks past dim are zeros)
  const int heads = q_heads + 2 * kv_heads;
  const long long stride = (long long)kv_heads * dim;
  const FastDiv page(page_size);
  // the scores in base 2: a row's weights are 2^(x - max) of x = its scores times scale / ln 2 (soft-capped:
  // cap tanh(score scale / cap) / ln 2), its max and the split's partial max likewise (attention_fold)
  const float scale2 = scale * AMMA_LOG2E, capped = softcap > 0.0f ? scale / softcap : 0.0f;
  const float cap2 = softcap * AMMA_LOG2E;
  // this lane's ldmatrix rows, as byte offsets in a block's keys (the scores' B fragments: key 16n + kr,
  // chunk 2kk + kc) and values (the weights' B fragments: key 16j + vr, chunk 2n + vc): in a shared stage's
  // padded rows (pad_k, pad_v: + a constant a step), or in a solo warp's swizzled half (the chunk's slot
  // (chunk % 8) ^ (key % 8), key % 8 = lane % 8: one offset for each chunk % 8 / 2, the half's k16 step)
  const int kr = lane % 8 + 8 * (lane / 16), kc = (lane / 8) % 2, vr = lane % 8 + 8 * ((lane / 8) % 2),
            vc = lane / 16;
  const unsigned pad_k = 2 * (kr * AMMA_STRIDE + 8 * kc), pad_v = 2 * (vr * AMMA_STRIDE + 8 * vc);
  unsigned swz_k[4], swz_v[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    swz_k[q] = 2 * (kr * 64 + 8 * ((2 * q + kc) ^ (lane % 8)));
    swz_v[q] = 2 * (vr * 64 + 8 * ((2 * q + vc) ^ (lane % 8)));
  }
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
    // each row's range (attention_split of its own range)
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
      row_lo[i] = lo;
      row_split[i] = split;
      row_splits[i] = splits;
      row_end[i] = pos + 1;
    }
    __syncthreads();
    // row i's keys of the item's split u: [first_of, end_of), empty where the row has fewer splits
    auto first_of = [&](int u, int i) {
      return s0 + u < row_splits[i] ? row_lo[i] + (s0 + u) * row_split[i] : 0;
    };
    auto end_of = [&](int u, int i) {
      return s0 + u < row_splits[i] ? min(row_end[i], row_lo[i] + (s0 + u + 1) * row_split[i]) : 0;
    };
    // the item holds all of its tile's splits (a shared tile's: it folds them itself, fold_splits' arithmetic)
    bool whole = !solo && s0 == 0;
    for (int i = 0; i < rows; ++i) whole = whole && row_splits[i] <= units;
    if (threadIdx.x < units) {
      const int u = threadIdx.x;
      int lo = 0x7fffffff, hi = 0;
      for (int i = 0; i < rows; ++i)
        if (end_of(u, i) > first_of(u, i)) {
          lo = min(lo, first_of(u, i));
          hi = max(hi, end_of(u, i));
        }
      lo_key[u] = hi > 0 ? lo : 0;
      hi_key[u] = hi;
      const int base = lo_key[u] / AMMA_KEYS;
      unsigned long long bits = 0;
      if (hi > 0 && (hi - 1) / AMMA_KEYS - base < 64) {
        for (int i = 0; i < rows; ++i)
          if (end_of(u, i) > first_of(u, i)) {
            const int a = first_of(u, i) / AMMA_KEYS - base, z = (end_of(u, i) - 1) / AMMA_KEYS - base;
            bits |= (~0ull >> (63 - (z - a))) << a;
          }
        block_base[u] = base;
      } else {
        block_base[u] = hi > 0 ? -1 : 0;
      }
      block_bits[u] = bits;
    }
    __syncthreads();
    // the blocks of 64 keys of split u that hold a key of some row: the first at or after block b (-1: none)
    auto block_from = [&](int u, int b) {
      const int base = block_base[u];
      if (base < 0) {
        for (b = max(b, lo_key[u] / AMMA_KEYS); b * AMMA_KEYS < hi_key[u]; ++b)
          for (int i = 0; i < rows; ++i)
            if (end_of(u, i) > first_of(u, i) && first_of(u, i) < (b + 1) * AMMA_KEYS &&
                end_of(u, i) > b * AMMA_KEYS)
              return b;
        return -1;
      }
      const int k = max(b - base, 0);
      if (k >= 64) return -1;
      const unsigned long long bits = block_bits[u] >> k;
      return bits ? base + k + __ffsll(static_cast<long long>(bits)) - 1 : -1;
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
        first[e] = mrow[e] < rows ? first_of(u, mrow[e]) : 0;
        end[e] = mrow[e] < rows ? end_of(u, mrow[e]) : 0;
      }
#pragma unroll
      for (int nt = 0; nt < AMMA_DIM / 8; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = 0.0f;
    };
    // S += Q K^T over the k16 steps k0 .. k1 - 1 of the block's keys at shared address ks (half: a solo warp's
    // ring half, its queries in q_solo; else a shared stage, the queries in registers): n8 tiles of keys;
    // ldmatrix's four matrices are keys 16n .. + 7 and 16n + 8 .. + 7, dims 16kk .. + 7 and + 8 .. + 15 (B
    // fragments of n tiles 2n and 2n + 1). Each k16 step's four ldmatrix first, then the hi products of
    // the eight tiles, then the lo ones (each tile's sum in the order hi, lo, a step after another)
    auto scores_of = [&](unsigned ks, bool half, int k0, int k1) {
#pragma unroll
      for (int kk = 0; kk < AMMA_DIM / 16; ++kk) {
        if (kk < k0 || kk >= k1 || kk >= kd) continue;
        unsigned a[4], b[4], kb[AMMA_KEYS / 16][4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          a[r] = half ? q_solo[0][kk][r][lane] : qh[kk][r];
          b[r] = half ? q_solo[1][kk][r][lane] : ql[kk][r];
        }
#pragma unroll
        for (int n = 0; n < AMMA_KEYS / 16; ++n)
          ldsm4_at(kb[n], half ? ks + swz_k[kk % 4] + 2 * 16 * n * 64 : ks + pad_k + 2 * (16 * n * AMMA_STRIDE + 16 * kk));
#pragma unroll
        for (int n = 0; n < AMMA_KEYS / 16; ++n) {
          mma_16816<W>(sc[2 * n], a[0], a[1], a[2], a[3], kb[n][0], kb[n][1]);
          mma_16816<W>(sc[2 * n + 1], a[0], a[1], a[2], a[3], kb[n][2], kb[n][3]);
        }
#pragma unroll
        for (int n = 0; n < AMMA_KEYS / 16; ++n) {
          mma_16816<W>(sc[2 * n], b[0], b[1], b[2], b[3], kb[n][0], kb[n][1]);
          mma_16816<W>(sc[2 * n + 1], b[0], b[1], b[2], b[3], kb[n][2], kb[n][3]);
        }
      }
    };
    auto clear_scores = [&]() {
#pragma unroll
      for (int nt = 0; nt < AMMA_KEYS / 8; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) sc[nt][r] = 0.0f;
    };
    // block b's scores S: each M row's online softmax in base 2; sc becomes the block's weights, and the max,
    // the sum and the values so far are rescaled to the block's max. The scores in base 2, masked (a block
    // where some row of the warp has keys outside its range), the block's max (the quad's four lanes
    // hold a row), weights, their sum in a fixed order (four running sums, added pairwise), and the rescale
    // of what came before. A block inside every range of the warp skips the masks: the same weights and sums,
    // bit for bit, as the masked arithmetic gives its keys (no key is masked there)
    auto softmax_of = [&](bool masked, int b) {   // (inlined twice, masked a constant)
      if (softcap > 0.0f) {
#pragma unroll
        for (int nt = 0; nt < AMMA_KEYS / 8; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r) sc[nt][r] = tanhf(sc[nt][r] * capped) * cap2;
      } else {
#pragma unroll
        for (int nt = 0; nt < AMMA_KEYS / 8; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r) sc[nt][r] *= scale2;
      }
      float rescale[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float top = m[e];
#pragma unroll
        for (int nt = 0; nt < AMMA_KEYS / 8; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float x = sc[nt][2 * e + c];
            if (masked) {
              const int j = b * AMMA_KEYS + 8 * nt + 2 * t + c;
              x = j >= first[e] && j < end[e] ? x : -INF;
              sc[nt][2 * e + c] = x;
            }
            top = fmaxf(top, x);
          }
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
        rescale[e] = top == m[e] ? 1.0f : m[e] == -INF ? 0.0f : ex2(m[e] - top);
        float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < AMMA_KEYS / 8; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float x = sc[nt][2 * e + c];
            const float p = masked && x == -INF ? 0.0f : ex2(x - top);
            sc[nt][2 * e + c] = p;
            sum[nt % 4] += p;
          }
        float total = (sum[0] + sum[1]) + (sum[2] + sum[3]);
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        l[e] = fmaf(l[e], rescale[e], total);
        m[e] = top;
      }
      // (a rescale by exactly 1 changes no value: skipped where the warp has no other)
      if (__any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f)) {
#pragma unroll
        for (int nt = 0; nt < AMMA_DIM / 8; ++nt) {
          acc[nt][0] *= rescale[0];
          acc[nt][1] *= rescale[0];
          acc[nt][2] *= rescale[1];
          acc[nt][3] *= rescale[1];
        }
      }
    };
    auto softmax = [&](int b) {
      bool inside = true;
#pragma unroll
      for (int e = 0; e < 2; ++e)
        inside = inside && (end[e] <= first[e] || (first[e] <= b * AMMA_KEYS && (b + 1) * AMMA_KEYS <= end[e]));
      if (__all_sync(0xffffffffu, inside))
        softmax_of(false, b);
      else
        softmax_of(true, b);
    };
    // the values += P V over the block's values at shared address vs, output dims 16 n0 .. 16 n1 - 1 (each
    // dim's sum over the block's keys in the same order whatever the range); the weights' C fragments are
    // the A fragments of k16 steps of keys; ldmatrix.trans's four matrices are keys 16j .. + 7 and + 8 ..
    // + 15, dims 16n .. + 7 and + 8 .. + 15. NG n steps at a time, their hi products and then their lo ones,
    // so that an accumulator's two products of a k16 step lie 2 NG mma apart (the tensor pipe's latency
    // passes on the others'): four in a shared tile, two in a solo warp, whose ring leaves fewer registers
    constexpr int NG = SOLO ? 2 : 4;
    auto weigh = [&](unsigned vs, bool half, int n0, int n1) {
#pragma unroll
      for (int j = 0; j < AMMA_KEYS / 16; ++j) {
        unsigned ph[4], pl[4];
        split2<W>(sc[2 * j][0], sc[2 * j][1], ph[0], pl[0]);
        split2<W>(sc[2 * j][2], sc[2 * j][3], ph[1], pl[1]);
        split2<W>(sc[2 * j + 1][0], sc[2 * j + 1][1], ph[2], pl[2]);
        split2<W>(sc[2 * j + 1][2], sc[2 * j + 1][3], ph[3], pl[3]);
#pragma unroll
        for (int n = 0; n < AMMA_DIM / 16; n += NG) {
          bool live[NG], any = false;
#pragma unroll
          for (int i = 0; i < NG; ++i) {
            live[i] = n + i >= n0 && n + i < n1 && n + i < kd;
            any = any || live[i];
          }
          if (!any) continue;
          unsigned vb[NG][4];
#pragma unroll
          for (int i = 0; i < NG; ++i)
            if (live[i])
              ldsm4_trans_at(vb[i], half ? vs + swz_v[(n + i) % 4] + 2 * 16 * j * 64
                                         : vs + pad_v + 2 * (16 * j * AMMA_STRIDE + 16 * (n + i)));
#pragma unroll
          for (int i = 0; i < NG; ++i)
            if (live[i]) {
              mma_16816<W>(acc[2 * (n + i)], ph[0], ph[1], ph[2], ph[3], vb[i][0], vb[i][1]);
              mma_16816<W>(acc[2 * (n + i) + 1], ph[0], ph[1], ph[2], ph[3], vb[i][2], vb[i][3]);
            }
#pragma unroll
          for (int i = 0; i < NG; ++i)
            if (live[i]) {
              mma_16816<W>(acc[2 * (n + i)], pl[0], pl[1], pl[2], pl[3], vb[i][0], vb[i][1]);
              mma_16816<W>(acc[2 * (n + i) + 1], pl[0], pl[1], pl[2], pl[3], vb[i][2], vb[i][3]);
            }
        }
      }
    };
    // a split's last block: its partial for each M row with keys in it, [row, q head, split] of (dim
    // values, max (base 2), sum, pad)
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
    // a whole item's fold (fold_splits' arithmetic): each M row's running max and sum, its values in the
    // shared memory (each thread's own: no barrier), split u folded in as it ends, for rows with keys in it
    float fold_top[2] = {-INF, -INF}, fold_sum[2] = {0.0f, 0.0f};
    float* const mine = folded + warp * (AMMA_DIM / 8) * 4 * WARP + lane;   // [n8 tile][register] at WARP apart
    auto fold = [&]() {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (end[e] <= first[e] || m[e] == -INF) continue;   // (as fold_splits leaves a split without scores)
        const FoldWeights w = fold_weights<true>(fold_top[e], m[e]);
        fold_sum[e] = fold_in(fold_sum[e], l[e], w);
#pragma unroll
        for (int nt = 0; nt < AMMA_DIM / 8; ++nt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float* at = mine + (4 * nt + 2 * e + c) * WARP;
            *at = fold_in(*at, acc[nt][2 * e + c], w);
          }
      }
    };
    if constexpr (SOLO) {
      // the warp's splits; each block's parts (its keys' halves, then its values': one of each where the head
      // dim is 64 or less) stream through the warp's ring, AMMA_RING - 1 parts loading while one is used
      W* const ring = keys + warp * AMMA_RING * AMMA_HALF;
      const unsigned ring_at = smem + 2 * warp * AMMA_RING * AMMA_HALF;
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
          copy_half<W>(ring + issued % AMMA_RING * AMMA_HALF, ip < halves ? k_pool : v_pool, lane, ib,
                       8 * (ip % halves), lo_key[u], hi_key[u], table, page, stride, head, kd, dim);
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
          return ring_at + 2 * (used++ % AMMA_RING) * AMMA_HALF;
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
      // the warp has M rows of the tile's rows (on wgmma every warp of the warpgroup takes part)
      const bool working = WG || 16 * warp < rows * G;
      load_queries(false);
      if (whole)
#pragma unroll
        for (int i = 0; i < AMMA_DIM / 8 * 4; ++i) mine[i * WARP] = 0.0f;
      // a step's keys' places in the pool (their pages' table entries read once a block, by thread k for key
      // k, a step ahead of their copies: the reads are in flight while a block runs), -1 outside the split's
      // keys; key k at pool_rows[stage][k % 8][k / 8], so a thread's eight keys (k0, k0 + 8, ..) lie together
      auto row_of = [&](int2 s) {   // (the table entry, -1 outside, and the key's place in its page)
        const int j = s.y * AMMA_KEYS + threadIdx.x, q = page.of(j);
        const bool live = threadIdx.x < AMMA_KEYS && s.x < units && j >= lo_key[min(s.x, units - 1)] &&
                          j < hi_key[min(s.x, units - 1)];
        return make_int2(live ? __ldg(table + q) : -1, j - q * page.d);
      };
      auto keep_row = [&](int st, int2 row) {
        if (threadIdx.x < AMMA_KEYS)
          pool_rows[st][threadIdx.x % 8][threadIdx.x / 8] = row.x < 0 ? -1 : row.x * page.d + row.y;
      };
      // stage st's keys and values: thread i copies chunk i % 16 of keys i / 16, + 8, .. (zeros for a key
      // outside the split's keys and past the head dim, so a masked key's value is finite and its zero weight
      // adds exactly zero; the chunks past 2 kd are never read)
      auto load = [&](int st) {
        const int ch = threadIdx.x % 16, key0 = threadIdx.x / 16;
        if constexpr (WG) {   // (each half wgmma reads whole: its chunks past the head dim zeros)
          if (ch < 8 * (kd > 4 ? 2 : 1)) {
            const int4 r0 = *reinterpret_cast<const int4*>(&pool_rows[st][key0][0]);
            const int4 r1 = *reinterpret_cast<const int4*>(&pool_rows[st][key0][4]);
            const int at[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
            const bool inside = 8 * ch < dim;
            const long long offset = head + 8 * ch;
            // key key0 + 8 i's chunk ch: half ch / 8, row key0 + 8 i, slot (ch % 8) ^ key0
            unsigned char* const to = amma_smem + (wg_at - smem) + st * AMMA_WG_STAGE + (ch / 8) * AMMA_WG_HALF +
                                      key0 * 128 + 16 * ((ch % 8) ^ key0);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              const bool live = inside && at[i] >= 0;
              const long long from = live ? (long long)at[i] * stride + offset : 0;
              cp_async16(to + i * 8 * 128, k_pool + from, live);
              cp_async16(to + 2 * AMMA_WG_STAGE + i * 8 * 128, v_pool + from, live);
            }
          }
        } else if (ch < 2 * kd) {
          const int4 r0 = *reinterpret_cast<const int4*>(&pool_rows[st][key0][0]);
          const int4 r1 = *reinterpret_cast<const int4*>(&pool_rows[st][key0][4]);
          const int at[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
          const bool inside = 8 * ch < dim;
          const long long offset = head + 8 * ch;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const bool live = inside && at[i] >= 0;
            const long long from = live ? (long long)at[i] * stride + offset : 0;
            const int to = st * AMMA_STAGE + (key0 + 8 * i) * AMMA_STRIDE + 8 * ch;
            cp_async16(keys + to, k_pool + from, live);
            cp_async16(values + to, v_pool + from, live);
          }
        }
        cp_async_commit();
      };
      int2 step = step_from(0, 0);
      int2 next = step.x < units ? step_from(step.x, step.y + 1) : make_int2(units, 0);
      keep_row(0, row_of(step));
      keep_row(1, row_of(next));
      __syncthreads();
      if (step.x < units) load(0);
      for (int st = 0, u_before = -1; step.x < units; st ^= 1) {
        const int u = step.x, b = step.y;
        const int2 after = next.x < units ? step_from(next.x, next.y + 1) : make_int2(units, 0);
        if (u != u_before) {
          u_before = u;
          fresh(u);
        }
        if (next.x < units) {
          load(st ^ 1);
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        const int2 row = row_of(after);
        // (the stage's copies, made through the generic proxy, visible to wgmma's reads through the async one)
        if constexpr (WG) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (working) {
          if constexpr (WG) {
#if AMMA_WGMMA
            const unsigned ks = wg_at + st * AMMA_WG_STAGE, vs = wg_at + (2 + st) * AMMA_WG_STAGE;
            if (kd > 4)
              amma_wg_scores<W, 2>(sc, qh, ql, ks);
            else
              amma_wg_scores<W, 1>(sc, qh, ql, ks);
            softmax(b);
            if (kd > 4)
              amma_wg_weigh<W, 2>(acc, sc, vs);
            else
              amma_wg_weigh<W, 1>(acc, sc, vs);
#endif
          } else {
            clear_scores();
            scores_of(smem + 2 * st * AMMA_STAGE, false, 0, AMMA_DIM / 16);
            softmax(b);
            weigh(smem + 2 * (2 + st) * AMMA_STAGE, false, 0, AMMA_DIM / 16);
          }
          if (next.x != u) {
            if (whole)
              fold();
            else
              record(u);
          }
        }
        keep_row(st, row);   // (stage st's rows were read by its copies before the barrier above)
        __syncthreads();     // (the stage is read: the next load may overwrite it)
        step = next;
        next = after;
      }
      // a whole item's output: each M row's folded values over its sum (fold_splits' last step)
      if (whole && working)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (mrow[e] >= rows) continue;
          const long long o = ((long long)(row0 + mrow[e]) * q_heads + h * G + mhead[e]) * dim;
#pragma unroll
          for (int nt = 0; nt < AMMA_DIM / 8; ++nt) {
            const int d = 8 * nt + 2 * t;
            if (d < dim)
              out.put2(o + d, make_float2(mine[(4 * nt + 2 * e) * WARP] / fold_sum[e],
                                          mine[(4 * nt + 2 * e + 1) * WARP] / fold_sum[e]));
          }
        }
    }
    __syncthreads();   // (every thread is past the item's steps: the next item may rewrite its ranges)
  }
}

// the fold of each row's splits once attention_mma's partials are all written: grid (rows, kv heads, G), a
// block of ATT_THREADS a query head (fold_head: fold_splits' arithmetic); a row of `done` is its tile's whole
// item's, folded there
template <int G>
__device__ void attention_fold(RowsOut out, const float* part, const int* positions, const int* done, int q_heads,
                               int dim, int window, int max_splits) {
  const int r = blockIdx.x, h = blockIdx.y, pos = positions[r];
  if (done[r]) return;   // (its tile's whole item folded it)
  const int lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
  const int n = pos - lo + 1, most = AMMA_SPLIT_KEYS * ATT_MAX_SPLITS;
  const int split = AMMA_SPLIT_KEYS * max(1, (n + most - 1) / most);
  fold_head<true>(out, part, r, h * G + blockIdx.z, q_heads, dim, (n + split - 1) / split, max_splits);
}

}  // namespace serve

// attention on tensor cores for G query heads per KV head (1, 2, 4, 8 or 16), 16-bit pools:
// attention_mma_G_SUFFIX (shared tiles) and attention_solo_G_SUFFIX (solo tiles), items item_range[0] ..
// item_range[1] - 1 of the step's
#define ATTENTION_MMA_OF(G, SUFFIX, TYPE, SOLO, NAME)                                                          \
  extern "C" __global__ void __launch_bounds__(serve::ATT_THREADS) NAME##_##G##_##SUFFIX(                      \
      float* out, float* part, const float* qkv, const void* k_pool, const void* v_pool,                       \
      const int* positions, const int* entries, const int* page_table, int pages_per_request, int page_size,   \
      int q_heads, int kv_heads, int dim, float scale, float softcap, int window, const int4* items,           \
      const int* item_range, int max_splits, void* rounded, int kind) {                                        \
    mdsl_pdl::step_wait();                                                                                     \
    serve::attention_mma<G, TYPE, SOLO>(serve::RowsOut{out, rounded, kind}, part, qkv,                        \
                                        static_cast<const TYPE*>(k_pool),                                      \
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
      float* out, const float* part, const int* positions, const int* done, int q_heads, int dim, int window,  \
      int max_splits, void* rounded, int kind) {                                                               \
    mdsl_pdl::step_wait();                                                                                     \
    serve::attention_fold<G>(serve::RowsOut{out, rounded, kind}, part, positions, done, q_heads, dim, window,  \
                             max_splits);                                                                      \
  }
ATTENTION_MMA(1)
ATTENTION_MMA(2)
ATTENTION_MMA(4)
ATTENTION_MMA(8)
ATTENTION_MMA(16)

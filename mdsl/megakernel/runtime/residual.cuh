// The residual stream: h (layers 0..L) and mid (0..L-1), rows of T that the linears read. Under tensor
// parallelism (WORLD > 1) an o-proj or down-proj tile makes this rank's f32 partial of its rows, puts it to
// the peers as flagged words and sums the ranks' partials of its rows itself (the relay, below), so that a
// reader loads one row, as on one GPU. Part of device.cu (kernel_source.py expands it in place).

namespace mk {

// `local` (a symmetric buffer) as peer rank `peer` maps it into this rank's address space
template <typename P>
__device__ __forceinline__ P* on_peer(const Params& p, P* local, int peer) {
  return reinterpret_cast<P*>(reinterpret_cast<char*>(local) + p.peer_delta[peer]);
}
// a value of this rank's into its slot of a gathered buffer, here and on every peer
template <typename P>
__device__ __forceinline__ void put_everywhere(const Params& p, P* gathered, long long slot, P value) {
  gathered[slot] = value;
#pragma unroll
  for (int k = 1; k < WORLD; ++k) *on_peer(p, gathered + slot, (int(p.rank) + k) % WORLD) = value;
}

// element i of layer `layer` of a residual-stream buffer (h or mid)
__device__ __forceinline__ float h_at(const Params& p, int layer, int i) {
  return mdsl::to_float(p.hs[(long long)layer * H + i]);
}
__device__ __forceinline__ float mid_at(const Params& p, int layer, int i) {
  return mdsl::to_float(p.mids[(long long)layer * H + i]);
}
// element i of layer `layer` of a residual-stream buffer: `value` on one GPU; under tensor parallelism this
// rank's partial `value`, into its slot of `parts` here (relay_rows reads it back) and to every peer as a
// flagged word of `relay` (`tag` in the high half: the step + 1 it is written for)
__device__ __forceinline__ void stream_put(const Params& p, T* single, float* parts, unsigned long long* relay,
                                           int layer, int i, float value, unsigned tag) {
  if constexpr (WORLD == 1) {
    single[(long long)layer * H + i] = mdsl::from_float<T>(value);
  } else {
    const long long at = ((long long)layer * WORLD + p.rank) * H + i;
    parts[at] = value;   // (read back by this block's relay_rows, after its barrier)
    const unsigned long long word = (unsigned long long)tag << 32 | __float_as_uint(value);
#pragma unroll
    for (int k = 1; k < WORLD; ++k)   // one 8-byte store: the value never arrives without its tag
      *reinterpret_cast<volatile unsigned long long*>(on_peer(p, relay + at, (int(p.rank) + k) % WORLD)) = word;
  }
}

// The relay of a peer's word of a residual-stream row, polled (relaxed, at system scope: a peer's store)
// until it carries `tag` (its step + 1; the host zeroes the words before a launch). A word is rewritten only
// by the peer's tile of the next step, which cannot start before this rank's step is done
// (docs/design.md, "Tensor parallelism"). NaN once the watchdog stops the launch.
__device__ __forceinline__ float relay_word(const Params& p, const unsigned long long* at, unsigned tag) {
  unsigned long long since = 0;
  for (unsigned round = 1;; ++round) {
    unsigned long long w;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(w) : "l"(at) : "memory");
    if (unsigned(w >> 32) == tag) return __uint_as_float(unsigned(w));
    if (round % 64 == 0 && !keep_polling(p, since, unsigned(w >> 32), tag)) return __int_as_float(0x7fffffff);
  }
}
// Rows [begin, end) of layer `layer` of a residual-stream buffer, by the tile that made this rank's partial
// of them, once the block's epilogue has put it (stream_put): every rank's partial summed in rank order (this
// rank's from its slot, the peers' from the flagged words their tiles of the same rows put here), rounded
// into `single`, which this rank's readers then read as one GPU's do. The tile's events are this rank's only:
// a peer's hop is one NVLink store, not a store, its acknowledgement and a remote add (put-with-signal), and
// its readers load one row instead of every rank's partials. The compute warps sum them, not the scheduler
// warp: its loads would wait behind the next task's first pass of weight loads.
__device__ void relay_rows(const Params& p, T* single, const float* parts, const unsigned long long* relay,
                           int layer, int begin, int end, unsigned tag) {
  compute_sync();   // the warps' lane 0 put the tile's partials into this rank's slot
  mark(p, 1);       // (profile: the products are out; what follows is the wait for the peers' words)
  for (int i = begin + int(threadIdx.x); i < end; i += NT) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < WORLD; ++k) {
      const long long at = ((long long)layer * WORLD + k) * H + i;
      sum += k == int(p.rank) ? parts[at] : relay_word(p, relay + at, tag);
    }
    single[(long long)layer * H + i] = mdsl::from_float<T>(sum);
  }
}

#if MK_ROW_NORM
// A residual-stream row whose linear's output is normalised before its residual add (linear_norm_residual:
// Gemma-2's post-attention and post-feedforward norms). The linear's tiles store their raw rows (rounded to T, as
// transformers' linear output), then count themselves on the layer's counter (`counter`, after attention's
// L * HKV split counters); the tile that finishes last, as attention's last split merges, replaces the whole row
// by residual(i) + the row normalised by `norm` (`Normed`: NormedRow, or NormedRow1p), rounded to T. Its readers
// wait for every tile, the last one's signal coming after the row's rewrite. `row`: other blocks' rows, read
// from L2. `tag`: the step + 1.
template <typename Normed, typename Residual>
__device__ void norm_residual_row(const Params& p, T* row, const T* norm, Residual residual, int counter, int tiles,
                                  unsigned tag, float* xs, float* red) {
  __shared__ int last_tile;
  compute_sync();   // the warps' lane 0 stored the tile's rows
  if (threadIdx.x == 0) {
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                 : "=r"(before) : "l"(p.attn_done + L * HKV + counter) : "memory");
    last_tile = before + 1u == unsigned(tiles) * tag;
  }
  compute_sync();
  if (!last_tile) return;
  Normed normed;
  normed.load([&](int i) { return mdsl::to_float(__ldcg(row + i)); }, norm);
  normed.finish(xs, red);
  for (int i = threadIdx.x; i < H; i += NT) row[i] = mdsl::from_float<T>(residual(i) + xs[i]);
}
#endif
}  // namespace mk

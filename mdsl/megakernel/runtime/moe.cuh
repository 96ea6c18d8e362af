// A mixture of experts' layer (the MOE section: Qwen3-MoE's sparse MLP): the routing, done by the router's tile that
// finishes last, and the experts' down-projection summed over the slots. The router's tiles and the experts'
// gate/up tiles are generated linear bodies (cuda_bodies.py); an expert's weights are found through the layer's
// table of pointers by the id the routing put in a slot, so a step reads the picked experts' weights only.
// Rounded as transformers' Qwen3MoeSparseMoeBlock rounds (its default grouped_mm experts): the router's logits in
// the model's dtype, softmax and top-k in f32, the weights renormalised in f32 and rounded to T; each slot's
// down-projection rounded, times its weight rounded, the slots summed in f32 in top-k order and rounded once.
// Part of device.cu (kernel_source.py expands it in place).

namespace mk {

// The routing of layer t.layer, by the router's tile that finishes last (after every warp stored its logits): a
// count per layer, one acq_rel atomic a tile, as attention's merge counts its splits; `tag` is the step + 1.
// Warp 0 takes the softmax over the MOE_E logits and the MOE_K largest probabilities (the lower expert on ties, as
// torch.topk), renormalised to sum to 1 where MOE_NORM_TOPK; the ids and weights (rounded to T) in that order.
static_assert(MOE_K <= 32, "one lane of warp 0 a picked expert");
__device__ void route_experts(const Params& p, const Task& t, unsigned tag) {
  const LayerWeights& w = p.layers[t.layer];
  __shared__ int last_tile;
  compute_sync();   // every warp's logits are stored
  if (threadIdx.x == 0) {
    unsigned before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(w.router_done) : "memory");
    last_tile = before + 1u == unsigned(MOE_ROUTER_TILES) * tag;
  }
  compute_sync();
  if (!last_tile || threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  constexpr int PER = (MOE_E + 31) / 32;
  float z[PER];
  float top = mdsl::neg_inf();
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int e = lane + 32 * j;
    z[j] = e < MOE_E ? __ldcg(w.router_logits + e) : mdsl::neg_inf();
    top = fmaxf(top, z[j]);
  }
  top = mdsl::group_reduce<32>(top, mdsl::Max());
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    z[j] = lane + 32 * j < MOE_E ? expf(z[j] - top) : 0.0f;
    sum += z[j];
  }
  sum = mdsl::group_reduce<32>(sum, mdsl::Sum());
#pragma unroll
  for (int j = 0; j < PER; ++j) z[j] = lane + 32 * j < MOE_E ? z[j] / sum : -1.0f;   // -1: no expert, or picked
  float mine = 0.0f, total = 0.0f;
  int picked = 0;
#pragma unroll 1
  for (int s = 0; s < MOE_K; ++s) {
    float v = -1.0f;
    int at = MOE_E;
#pragma unroll
    for (int j = 0; j < PER; ++j)   // (the lane's experts in increasing order: the lower one kept on ties)
      if (z[j] > v) { v = z[j]; at = lane + 32 * j; }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
      const int oat = __shfl_xor_sync(0xffffffffu, at, offset);
      if (ov > v || (ov == v && oat < at)) { v = ov; at = oat; }
    }
    at = at < MOE_E ? at : 0;   // (NaN logits: the sampler reports them)
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (lane + 32 * j == at) z[j] = -1.0f;
    if (lane == s) { mine = v; picked = at; }
    total += v;
  }
  if (lane < MOE_K) {
    w.route_ids[lane] = picked;
    w.route_weights[lane] = round_t(MOE_NORM_TOPK ? mine / total : mine);
  }
}

// Dot products of `items` weight rows (row(item): K elements) with their own input rows (xs(item): K floats in
// shared memory), LOADS 16-byte loads a lane in flight as gemv; emit(item, sum) runs on lane 0 of the warp that took
// the item. For rows whose inputs differ (an expert's down-projection per slot).
template <int K, typename Row, typename Xs, typename Emit>
__device__ __forceinline__ void items_gemv(int items, Row row, Xs xs_of, Emit emit) {
  constexpr int CH = K / VEC;
  static_assert(K % VEC == 0, "a row is whole 16-byte vectors");
  constexpr int U = CH >= 32 * 8 ? 8 : CH >= 32 * 4 ? 4 : CH >= 32 * 2 ? 2 : 1;
  constexpr int ITEMS = LOADS / U > 0 ? LOADS / U : 1;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int first = warp * ITEMS; first < items; first += NW * ITEMS) {
    const T* wr[ITEMS];
    const float* xs[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      wr[i] = first + i < items ? row(first + i) : nullptr;
      xs[i] = first + i < items ? xs_of(first + i) : nullptr;
    }
    float acc[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) acc[i] = 0.0f;
    for (int pass = 0; pass < CH; pass += 32 * U) {
      const int c0 = pass + lane;
      uint4 v[ITEMS][U];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int i = 0; i < ITEMS; ++i)
          v[i][u] = wr[i] == nullptr || c0 + 32 * u >= CH ? make_uint4(0, 0, 0, 0) : ld_weights(wr[i] + (c0 + 32 * u) * VEC);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c0 + 32 * u < CH) {
#pragma unroll
          for (int i = 0; i < ITEMS; ++i)
            if (wr[i] != nullptr) acc[i] += dot_vec(v[i][u], xs[i] + (c0 + 32 * u) * VEC);
        }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) acc[i] = mdsl::group_reduce<32>(acc[i], mdsl::Sum());
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
        if (first + i < items) emit(first + i, acc[i]);
    }
  }
}

// EXPERT_DOWN: rows [t.begin, t.end) of the residual-stream row `out` (of layer `out_layer`) = residual(r) + the sum
// over the slots j, in order, of weight_j * (W_down,e_j act_j): every slot's activation row in shared memory, the
// (slot, row) products spread over the warps, each rounded and weighted into shared memory, then summed per row.
template <typename Residual>
__device__ void expert_down_task(const Params& p, const Task& t, float* work, T* out, int out_layer,
                                 Residual residual) {
  const LayerWeights& w = p.layers[t.layer];
  __shared__ int ids[MOE_K];
  __shared__ float weights[MOE_K];
  if (threadIdx.x < MOE_K) {
    ids[threadIdx.x] = w.route_ids[threadIdx.x];
    weights[threadIdx.x] = w.route_weights[threadIdx.x];
  }
  InputRow<MOE_K * MOE_I> acts;
  acts.load(w.expert_acts);
  acts.finish(work);   // (its barrier also publishes ids and weights)
  mark(p, 0);          // the input rows are in shared memory
  const int n = t.end - t.begin;
  float* ys = work + MOE_K * MOE_I;   // [MOE_K][n]: each slot's weighted product
  items_gemv<MOE_I>(MOE_K * n,
      [&](int item) { return w.experts[2 * MOE_E + ids[item / n]] + (long long)(t.begin + item % n) * MOE_I; },
      [&](int item) { return work + (item / n) * MOE_I; },
      [&](int item, float acc) { ys[item] = round_t(round_t(acc) * weights[item / n]); });
  compute_sync();
  for (int r = t.begin + int(threadIdx.x); r < t.end; r += NT) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < MOE_K; ++j) sum += ys[j * n + r - t.begin];
    out[(long long)out_layer * H + r] = mdsl::from_float<T>(residual(r) + round_t(sum));
  }
}

}  // namespace mk

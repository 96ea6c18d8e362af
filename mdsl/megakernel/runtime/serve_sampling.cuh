// The serving kernel's LM head over the step's sampling rows and its samplers: each sampling row's token by its
// request's settings (mdsl.serving.sampling.sample: greedy, or the Gumbel-max over the tokens top-k and top-p allow
// of logit / temperature plus Philox noise keyed by the request's seed and the row's position). Part of device.cu
// (kernel_source.py expands it in place).

namespace mk {

// LMHEAD: vocabulary columns [t.begin, t.end) of the logits of every sampling row (the final norm of its h_L row),
// logit_of(acc) the LM head op's epilogue, into logits[j]; then each sampling row's best (value, token) of the
// tile's columns, the first maximum, into best_value / best_index [j][tile].
template <typename Logit>
__device__ bool lmhead_rows_task(const Params& p, const Task& t, int ready, int tile, float* xs, float* red,
                                 Logit logit_of) {
  const int samples = int(serve_work(p).num_samples);
  const int* rows = sample_rows(p);
  const bool inputs = rows_linear<H, 1>(
      p, t, ready, samples, [&](int j) { return rows[j]; },
      [&](int row, RowsInput<H, 1> x) { normed_row<H>(row_of(p.hs, L, row, H), p.final_norm, x); },
      [&](int r, int) { return p.lm_head + (long long)r * H; },
      [&](int j, int, int r, const float* acc) { p.logits[(long long)j * V + r] = logit_of(acc); }, xs);
  if (!inputs) return false;
  for (int j = 0; j < samples; ++j) {   // (the block's own logits: stored before rows_linear's last barrier)
    float v = mdsl::neg_inf();
    int i = 0x7fffffff;
    for (int r = t.begin + int(threadIdx.x); r < t.end; r += NT) {
      const float x = p.logits[(long long)j * V + r];
      if (better(x, r, v, i)) {
        v = x;
        i = r;
      }
    }
    best_of_block(v, i, red);
    if (threadIdx.x == 0) {
      p.best_value[j * LM_TILES + tile] = v;
      p.best_index[j * LM_TILES + tile] = i;
    }
  }
  return true;
}

// ---- a request's token (temperature > 0): every thread reads the row's logits (from L2: other blocks wrote them)

// a logit's place in the order of values as an unsigned word (-0 as +0: numpy's comparisons hold them equal)
__device__ __forceinline__ unsigned ordered(float x) {
  const unsigned b = __float_as_uint(x + 0.0f);
  return b & 0x80000000u ? ~b : b | 0x80000000u;
}

// block reductions of a count, of doubles and of a maximum (fixed trees: the same bits on every thread)
__device__ __forceinline__ unsigned block_count(unsigned c, float* red) { return unsigned(block_sum(float(c), red)); }
__device__ __forceinline__ double block_sum_double(double v, float* red) {
  double* dred = reinterpret_cast<double*>(red);   // (2 NW floats: NW doubles)
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  compute_sync();
  if (threadIdx.x % 32 == 0) dred[threadIdx.x / 32] = v;
  compute_sync();
  double total = 0.0;
#pragma unroll
  for (int k = 0; k < NW; ++k) total += dred[k];
  return total;
}

__device__ __forceinline__ float block_max(float v, float* red) {
  v = mdsl::group_reduce<32>(v, mdsl::Max());
  compute_sync();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  compute_sync();
  float top = red[0];
#pragma unroll
  for (int k = 1; k < NW; ++k) top = fmaxf(top, red[k]);
  return top;
}

// The tokens a request's top-k and top-p allow: those whose ordered logit is above `above`, or equal to it with an
// id at most `last_tie`, and at least `cut`
struct Allowed {
  unsigned above, last_tie, cut;
  __device__ __forceinline__ bool operator()(float logit, int token) const {
    const unsigned o = ordered(logit);
    return o >= cut && (o > above || (o == above && unsigned(token) <= last_tie));
  }
};

// Top-k: the k largest logits, ties to the lower id (numpy's stable sort of -logits): the k-th largest value by
// bisection of its ordered word, then the ties it takes by bisection of their ids
__device__ Allowed top_k(const float* logits, unsigned k, float* red) {
  Allowed all{0u, unsigned(V), 0u};
  if (k == 0 || k >= unsigned(V)) return all;
  unsigned lo = 0, hi = 0xffffffffu;   // count(ordered >= lo) >= k
  while (lo < hi) {
    const unsigned mid = lo + (hi - lo) / 2 + 1;
    unsigned c = 0;
    for (int i = threadIdx.x; i < V; i += NT) c += ordered(__ldcg(logits + i)) >= mid;
    if (block_count(c, red) >= k) lo = mid;
    else hi = mid - 1;
  }
  unsigned above = 0;
  for (int i = threadIdx.x; i < V; i += NT) above += ordered(__ldcg(logits + i)) > lo;
  const unsigned ties = k - block_count(above, red);   // (>= 1)
  unsigned first = 0, last = unsigned(V) - 1;          // the smallest id whose ties up to it are `ties`
  while (first < last) {
    const unsigned mid = first + (last - first) / 2;
    unsigned c = 0;
    for (int i = threadIdx.x; i <= int(mid); i += NT) c += ordered(__ldcg(logits + i)) == lo;
    if (block_count(c, red) >= ties) last = mid;
    else first = mid + 1;
  }
  return {lo, first, 0u};
}

// Top-p over the tokens top-k allows: the largest logit value whose tokens at or above it hold top_p of the
// probability (softmax of logit / temperature, in f64 as mdsl.serving.sampling computes it), found by bisection of
// its ordered word; every token tied with it stays
__device__ void top_p(const float* logits, double temperature, double top_p, Allowed& allowed, float* red) {
  float best = mdsl::neg_inf();
  for (int i = threadIdx.x; i < V; i += NT) {
    const float x = __ldcg(logits + i);
    if (allowed(x, i)) best = fmaxf(best, x);
  }
  best = block_max(best, red);
  const double z0 = double(best) / temperature;
  const auto mass = [&](unsigned cut) {
    double m = 0.0;
    for (int i = threadIdx.x; i < V; i += NT) {
      const float x = __ldcg(logits + i);
      if (allowed(x, i) && ordered(x) >= cut) m += exp(double(x) / temperature - z0);
    }
    return block_sum_double(m, red);
  };
  const double want = top_p * mass(0u);
  unsigned lo = 0, hi = 0xffffffffu;   // mass(>= lo) >= want
  while (lo < hi) {
    const unsigned mid = lo + (hi - lo) / 2 + 1;
    if (mass(mid) >= want) lo = mid;
    else hi = mid - 1;
  }
  allowed.cut = lo;
}

// Philox4x32-10 Gumbel noise of a request (sampling.cuh's gumbel, keyed by the request's seed)
__device__ __forceinline__ float request_gumbel(unsigned long long seed, long long pos, int token) {
  const uint4 r = philox(make_uint4(unsigned(token), unsigned(pos), unsigned(pos >> 32), 0x6d64736cu),
                         make_uint2(unsigned(seed), unsigned(seed >> 32)));
  const float u = (float(r.x >> 8) + 0.5f) * (1.0f / 16777216.0f);
  return -logf(-logf(u));
}

// A request's token from its row's logits at temperature > 0: the Gumbel-max of logit / temperature + noise over the
// tokens top-k and top-p allow, ties to the lower id
__device__ int sample_request(const float* logits, const Request& q, long long pos, float* red) {
  Allowed allowed = top_k(logits, q.top_k, red);
  if (q.top_p < 1.0f) top_p(logits, double(q.temperature), double(q.top_p), allowed, red);
  float v = mdsl::neg_inf();
  int best = 0x7fffffff;
  for (int i = threadIdx.x; i < V; i += NT) {
    const float x = __ldcg(logits + i);
    if (!allowed(x, i)) continue;
    const float key = x / q.temperature + request_gumbel(q.seed, pos, i);
    if (better(key, i, v, best)) {
      v = key;
      best = i;
    }
  }
  best_of_block(v, best, red);
  return best;
}

// SAMPLE (sampler t.begin of SAMPLERS): sampling rows j = t.begin, t.begin + SAMPLERS, ...: the token of row j's
// request at the row's position into chosen[j]; greedy is the first maximum, which the LM head tiles' bests give. A
// row whose logits have no maximum (NaN) chooses 0 and sets the bad-token word (the next SCHEDULE stops the launch).
__device__ void sample_rows_task(const Params& p, const Task& t, float* red) {
  const int samples = int(serve_work(p).num_samples);
  for (int j = t.begin; j < samples; j += SAMPLERS) {
    const StepRow row = step_rows(p)[sample_rows(p)[j]];
    const Request& q = serving_entries(p)[entry_of(p, row)].request;
    int token;
    if (q.temperature == 0.0f) {
      float v = mdsl::neg_inf();
      int i = 0x7fffffff;
      for (int k = threadIdx.x; k < LM_TILES; k += NT) {
        const float bv = __ldcg(p.best_value + j * LM_TILES + k);
        const int bi = __ldcg(p.best_index + j * LM_TILES + k);
        if (better(bv, bi, v, i)) {
          v = bv;
          i = bi;
        }
      }
      best_of_block(v, i, red);
      token = i;
    } else {
      token = sample_request(p.logits + (long long)j * V, q, row.position, red);
    }
    if (threadIdx.x == 0) {
      if (token < 0 || token >= V) {
        p.state[STATE_BAD_TOKEN] = 1;
        token = 0;
      }
      chosen_tokens(p)[j] = token;
    }
    compute_sync();   // (red: the next row's reductions)
  }
}

}  // namespace mk

// The LM head's tiles (logits and each tile's best token) and the sampler: greedy, temperature (Gumbel-max) or
// nucleus sampling, the stop conditions, and the next step's embedding row. Part of device.cu (kernel_source.py
// expands it in place).

namespace mk {

// Philox4x32-10 counter-based noise, one draw per (seed, position, token)
__device__ __forceinline__ uint4 philox(uint4 c, uint2 k) {
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    k.x += 0x9E3779B9u;
    k.y += 0xBB67AE85u;
  }
  return c;
}
__device__ __forceinline__ float gumbel(const Params& p, long long pos, int token) {
  const uint4 r = philox(make_uint4(unsigned(token), unsigned(pos), unsigned(pos >> 32), 0x6d64736cu),
                         make_uint2(unsigned(p.seed), unsigned(p.seed >> 32)));
  const float u = (float(r.x >> 8) + 0.5f) * (1.0f / 16777216.0f);   // in (0, 1)
  return -logf(-logf(u));
}
// the sampling key of a token: its logit (greedy), or logit / temperature + Gumbel noise
__device__ __forceinline__ float sample_key(const Params& p, long long pos, int token, float logit) {
  return p.temperature > 0.0 ? logit / float(p.temperature) + gumbel(p, pos, token) : logit;
}
// (value, index) pairs: larger value first, then the smaller index (torch.argmax's first maximum)
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

__device__ void best_of_block(float& v, int& i, float* red) {
  int* redi = reinterpret_cast<int*>(red + NW);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) { v = ov; i = oi; }
  }
  compute_sync();
  if (threadIdx.x % 32 == 0) { red[threadIdx.x / 32] = v; redi[threadIdx.x / 32] = i; }
  compute_sync();
  v = red[0];
  i = redi[0];
  for (int w = 1; w < NW; ++w)
    if (better(red[w], redi[w], v, i)) { v = red[w]; i = redi[w]; }
}

// rows of the logits and the tile's best token; logit(acc): a row's logit from its dot product (the LM head
// op's epilogue, generated)
template <typename Logit>
__device__ void lmhead_task(const Params& p, const Task& t, int ready, long long pos, int tile, float* xs, float* red,
                            Logit logit_of) {
#if MK_LM_HEAD_1P
  StreamRow1p row{{}, p.hs, L, p.final_norm};   // (the final norm scales by 1 + weight)
#else
  StreamRow row{{}, p.hs, L, p.final_norm};
#endif
  float best_v = mdsl::neg_inf();
  int best_i = 0x7fffffff;
  const bool nucleus = p.temperature > 0.0 && p.top_p < 1.0;   // the sampler needs every logit first
  task_gemv<H, 1>(t, ready, xs, [&](int r, int) { return p.lm_head + (long long)r * H; },
                [&](int r, const float* acc) {
                  const float logit = logit_of(acc);
                  p.logits[r] = logit;
                  const int token = int(p.rank) * V + r;   // the global token id
                  const float key = nucleus ? logit : sample_key(p, pos, token, logit);
                  if (better(key, token, best_v, best_i)) { best_v = key; best_i = token; }
                },
                [&] { row.load(); },
                [&] {
                  row.finish(xs, red);
                  mark(p, 0);
                });
  // lane 0 of each warp holds its warp's best; the others hold the empty pair
  best_of_block(best_v, best_i, red);
  if (threadIdx.x == 0) {   // every rank's sampler compares every rank's tile bests
    put_everywhere(p, p.best_value, (long long)p.rank * LM_TILES + tile, best_v);
    put_everywhere(p, p.best_index, (long long)p.rank * LM_TILES + tile, best_i);
  }
}

// Nucleus sampling: the largest logit threshold whose tokens hold top_p of the probability (found by
// bisection), then Gumbel-max over the tokens at or above it.
__device__ int nucleus_sample(const Params& p, long long pos, float* red) {
  const float inv_t = 1.0f / float(p.temperature);
  float top = mdsl::neg_inf(), low = -mdsl::neg_inf();
  for (int i = threadIdx.x; i < V; i += NT) { top = fmaxf(top, p.logits[i]); low = fminf(low, p.logits[i]); }
  top = mdsl::group_reduce<32>(top, mdsl::Max());
  low = -mdsl::group_reduce<32>(-low, mdsl::Max());
  compute_sync();
  if (threadIdx.x % 32 == 0) { red[threadIdx.x / 32] = top; red[NW + threadIdx.x / 32] = low; }
  compute_sync();
  for (int w = 0; w < NW; ++w) { top = fmaxf(top, red[w]); low = fminf(low, red[NW + w]); }
  float mass_all = 0.0f;
  for (int i = threadIdx.x; i < V; i += NT) mass_all += expf((p.logits[i] - top) * inv_t);
  const float want = float(p.top_p) * block_sum(mass_all, red);
  float keep = low, drop = top;           // mass(>= keep) >= want; the answer lies in [keep, drop]
  for (int round = 0; round < 40 && keep < drop; ++round) {
    const float mid = 0.5f * (keep + drop);
    if (mid <= keep || mid >= drop) break;
    float mass = 0.0f;
    for (int i = threadIdx.x; i < V; i += NT)
      if (p.logits[i] >= mid) mass += expf((p.logits[i] - top) * inv_t);
    if (block_sum(mass, red) >= want) keep = mid; else drop = mid;
  }
  float best_v = mdsl::neg_inf();
  int best_i = 0x7fffffff;
  for (int i = threadIdx.x; i < V; i += NT)
    if (p.logits[i] >= keep) {
      const float key = sample_key(p, pos, i, p.logits[i]);
      if (better(key, i, best_v, best_i)) { best_v = key; best_i = i; }
    }
  best_of_block(best_v, best_i, red);
  return best_i;
}

// The step's token; then either the next prompt token or the generated one goes to the next step, whose
// embedding row this task writes unless a stop condition (EOS, max tokens, the launch's steps) holds.
// Returns whether the launch goes on: on a stop the task does not signal the embedding's event, so no
// task of a later step ever has its inputs (their waits see the stop and leave).
__device__ bool sample_task(const Params& p, const Task& t, long long step, long long pos, float* red) {
  __shared__ int next_token, go_on;
  int token;
  if (p.temperature > 0.0 && p.top_p < 1.0) {
    token = nucleus_sample(p, pos, red);
  } else {
    float v = mdsl::neg_inf();
    int i = 0x7fffffff;
    for (int k = threadIdx.x; k < WORLD * t.end; k += NT)
      if (better(p.best_value[k], p.best_index[k], v, i)) { v = p.best_value[k]; i = p.best_index[k]; }
    best_of_block(v, i, red);
    token = i;
  }
  if (threadIdx.x == 0) {
    if (token < 0 || token >= VOCAB) {   // no logit compared as a number (NaN): stop, and let the host say so
      p.state[STATE_BAD_TOKEN] = 1;
      token = 0;
    }
    const long long next_pos = pos + 1;
    bool stop = step + 1 >= p.num_steps || next_pos >= MAX_SEQ;
    int next = token;
    if (next_pos < p.prompt_len) {
      next = p.prompt[next_pos];
    } else {
      const int made = p.state[STATE_GENERATED];
      p.out_tokens[made] = token;
      p.state[STATE_GENERATED] = made + 1;
      stop = stop || made + 1 >= p.max_new;
      for (long long e = 0; e < p.num_eos; ++e) stop = stop || token == p.eos[e];
    }
    stop = stop || p.state[STATE_BAD_TOKEN] != 0;
    p.state[STATE_NEXT_TOKEN] = next;
    if (stop) atomicExch(p.state + STATE_STOP, int(step));
    next_token = next;
    go_on = !stop;
  }
  compute_sync();
  const bool going = go_on;
  if (going) {   // the next step's h: the token's embedding row (under TP, the rank holding it puts it)
    const int local = next_token - int(p.rank) * V;
    const T* row = 0 <= local && local < V ? p.embed + (long long)local * H : nullptr;
#if MK_EMBED_SCALE
    // the row times EMBED_SCALE (Gemma's sqrt(hidden), rounded to T as transformers' normalizer), rounded to T
    static_assert(WORLD == 1, "a scaled embedding runs on one GPU (the engine refuses it under tensor parallelism)");
    for (int i = threadIdx.x; i < H; i += NT)
      p.hs[i] = mdsl::from_float<T>(row != nullptr ? mdsl::to_float(row[i]) * EMBED_SCALE : 0.0f);
#else
    if constexpr (WORLD > 1) {   // the row whole, into h[0] here and on every peer
      if (row != nullptr)
        for (int i = threadIdx.x; i < H; i += NT) put_everywhere(p, p.hs, (long long)i, row[i]);
    } else {
      for (int i = threadIdx.x; i < H; i += NT)
        p.hs[i] = mdsl::from_float<T>(row != nullptr ? mdsl::to_float(row[i]) : 0.0f);
    }
#endif
  }
  return going;
}

}  // namespace mk

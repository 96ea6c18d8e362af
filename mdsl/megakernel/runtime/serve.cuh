// The serving kernel's tables (the SERVE section; docs/design.md, "The megakernel's serving tables"): where the
// protocol's step tables and the step's work are, the step rows' buffers, the linear kinds' products over the rows,
// and SCHEDULE, the step boundary, which runs mdsl/serving/scheduler.cuh in one thread. Part of device.cu
// (kernel_source.py expands it in place); serving_source.py puts the protocol's C declarations, the scheduler and
// the serving tables' declarations (ServeWork, AttnItem, the serve region's offsets) before the runtime.

namespace mk {

// the step boundary's state words (sync.cuh's two unused ones and its last): its waits for the host, counted twice
// each (odd while it waits: the watchdog leaves the workers that wait meanwhile alone), the error that stopped the
// launch (sched::ERROR_*, or ERROR_BAD_LOGITS), and 1 where the launch ended at its last step (the host launches again);
// and the host's: nonzero while the tasks are profiled (the decode kernel's generated-token word, unused here)
constexpr int STATE_IDLE = 0, STATE_SERVE_ERROR = 1, STATE_LAUNCH_END = 11, STATE_PROFILE = 3;
constexpr unsigned ERROR_BAD_LOGITS = 16;   // a sampling row's logits had no maximum (NaN)

// ---- the protocol's step tables (the scheduler writes them at the step boundary) and the step's work

__device__ __forceinline__ const Step& step_header(const Params& p) {
  return *reinterpret_cast<const Step*>(p.device_state + DEVICE_STEP_OFFSET);
}
__device__ __forceinline__ const StepRow* step_rows(const Params& p) {
  return reinterpret_cast<const StepRow*>(p.device_state + DEVICE_ROWS_OFFSET);
}
__device__ __forceinline__ const Chunk* step_chunks(const Params& p) {
  return reinterpret_cast<const Chunk*>(p.device_state + DEVICE_CHUNKS_OFFSET);
}
__device__ __forceinline__ const Entry* serving_entries(const Params& p) {
  return reinterpret_cast<const Entry*>(p.device_state + DEVICE_ENTRIES_OFFSET);
}
// the entry (batch slot) of a step row: its chunk's
__device__ __forceinline__ unsigned entry_of(const Params& p, const StepRow& row) {
  return step_chunks(p)[row.chunk].entry;
}
// where the key (value) row of kv head g at position `pos` of an entry lies in a layer's pool ([pages][PAGE_SIZE]
// [HKV][D]): row pos % PAGE_SIZE of the page its page table gives for pos / PAGE_SIZE
__device__ __forceinline__ long long pool_row(const Params& p, unsigned entry, unsigned pos, int g) {
  const int* table = reinterpret_cast<const int*>(p.device_state + DEVICE_PAGE_TABLE_OFFSET);
  const long long page = table[(long long)entry * PAGES_PER_REQUEST + pos / unsigned(PAGE_SIZE)];
  return ((page * PAGE_SIZE + pos % unsigned(PAGE_SIZE)) * HKV + g) * D;
}
__device__ __forceinline__ ServeWork& serve_work(const Params& p) {
  return *reinterpret_cast<ServeWork*>(p.serve + SERVE_WORK_OFFSET);
}
__device__ __forceinline__ AttnItem* serve_items(const Params& p) {
  return reinterpret_cast<AttnItem*>(p.serve + SERVE_ITEMS_OFFSET);
}
__device__ __forceinline__ int* sample_rows(const Params& p) { return reinterpret_cast<int*>(p.serve + SERVE_SAMPLE_ROWS_OFFSET); }
__device__ __forceinline__ int* chosen_tokens(const Params& p) { return reinterpret_cast<int*>(p.serve + SERVE_CHOSEN_OFFSET); }
__device__ __forceinline__ unsigned* merge_counter(const Params& p, int layer, int row, int g) {
  return reinterpret_cast<unsigned*>(p.serve + SERVE_MERGE_COUNTS_OFFSET) + ((long long)layer * MAX_ROWS + row) * HKV + g;
}
__device__ __forceinline__ unsigned* append_counter(const Params& p, int layer, int g) {
  return reinterpret_cast<unsigned*>(p.serve + SERVE_APPEND_COUNTS_OFFSET) + layer * HKV + g;
}

// row `row` of layer `layer` of a buffer of the step rows' values, `width` a row ([layers][MAX_ROWS][width]: the
// residual stream's h and mid, qkv, attn, act)
template <typename P>
__device__ __forceinline__ P* row_of(P* buffer, int layer, int row, int width) {
  return buffer + ((long long)layer * MAX_ROWS + row) * width;
}

// A row's attention range cut into splits by its position alone (ServingPlan.row_splits): its first key (its
// window's, under a sliding window), SPLIT_KEYS keys a split or the multiple of it that makes at most
// MAX_ROW_SPLITS splits, and the splits
struct RowSplits { unsigned first, keys, width, splits; };
__device__ __forceinline__ RowSplits row_splits(unsigned pos) {
  const unsigned first = SERVE_WINDOW > 0 && pos + 1 > unsigned(SERVE_WINDOW) ? pos + 1 - SERVE_WINDOW : 0;
  const unsigned keys = pos + 1 - first, most = unsigned(SPLIT_KEYS * MAX_ROW_SPLITS);
  const unsigned width = unsigned(SPLIT_KEYS) * ((keys + most - 1) / most);
  return {first, keys, width, (keys + width - 1) / width};
}

// ---- linear kinds over the step's rows

// A step row's input, by one warp (a group's rows load and reduce side by side, each its own warp's: one memory round
// trip and no block barrier a row): x's 16-byte vectors, lane l taking vectors l, l + 32, ..., 8 of them in flight at
// once, as f32 into xs. normed_row then sums their squares (each lane's in its order, then the warp's shuffle tree),
// and scales xs in place by rms_norm's factor and the norm's weights, rounded as the one-row bodies round them
// (gemv.cuh's NormedRow).
constexpr int INPUT_BATCH = 8;
template <int K, typename Each>
__device__ __forceinline__ void warp_row_vectors(const T* x, float* xs, Each each) {
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
        for (int k = 0; k < VEC; ++k) {
          const float value = mdsl::to_float(e[k]);
          xs[c * VEC + k] = value;
          each(value);
        }
      }
    }
  }
}
template <int K>
__device__ __forceinline__ void input_row(const T* x, float* xs) {
  warp_row_vectors<K>(x, xs, [](float) {});
}
template <int K>
__device__ __forceinline__ void normed_row(const T* x, const T* norm, float* xs) {
  float ss = 0.0f;
  warp_row_vectors<K>(x, xs, [&](float value) { ss = fmaf(value, value, ss); });
  const float r = rsqrtf(mdsl::group_reduce<32>(ss, mdsl::Sum()) / float(K) + EPS);
  const int lane = threadIdx.x % 32;
  const uint4* weights = reinterpret_cast<const uint4*>(norm);
  constexpr int CHUNKS = K / VEC;
  for (int c0 = 0; c0 < CHUNKS; c0 += 32 * INPUT_BATCH) {
    uint4 wv[INPUT_BATCH];
#pragma unroll
    for (int j = 0; j < INPUT_BATCH; ++j) {
      const int c = c0 + lane + 32 * j;
      wv[j] = c < CHUNKS ? weights[c] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < INPUT_BATCH; ++j) {
      const int c = c0 + lane + 32 * j;
      if (c < CHUNKS) {
        const T* e = reinterpret_cast<const T*>(&wv[j]);
#pragma unroll
        for (int k = 0; k < VEC; ++k) xs[c * VEC + k] = round_t(mdsl::to_float(e[k]) * round_t(xs[c * VEC + k] * r));
      }
    }
  }
}

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
// acc[ROWS]) runs on lane 0.
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
    if (lane == 0) {
#pragma unroll
      for (int n = 0; n < NR; ++n)
#pragma unroll
        for (int i = 0; i < ITEMS; ++i)
          if (n < nr && first + i < end) emit(n, first + i, acc[n] + i * ROWS);
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

// A linear task's columns for `count` rows (row_of_index(j): the j-th's index among the step's rows), RowsGemv's GROUP
// rows at a time: each row's input into shared memory by a warp (input(row, xs + n * K): input_row or normed_row),
// then the group's products (gemv_rows); emit(j, row, column, acc) on a warp's lane 0. The first
// pass's weight rows go to L2 before the task waits for its inputs (an early task: `ready`, worker.cuh) and before the
// first group's inputs load. False, and nothing written, where the inputs never come. The profile's mark: the first
// group's inputs stored.
template <int K, int ROWS, typename RowIndex, typename Input, typename Weights, typename Emit>
__device__ __forceinline__ bool rows_linear(const Params& p, const Task& t, int ready, int count,
                                            RowIndex row_of_index, Input input, Weights weights, Emit emit, float* xs) {
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

// ---- SCHEDULE: the step boundary

// (thread 0) the launch stops: the host's stop (-2), the watchdog's (-1), or a step boundary's
__device__ __forceinline__ bool stopping(const Params& p, long long step) { return ld_relaxed(p.state + STATE_STOP) < step; }

// (thread 0) a wait for the host until done(), polled with __nanosleep back-off and counted in STATE_IDLE; false
// where the launch stops meanwhile
template <typename Done>
__device__ bool wait_for_host(const Params& p, long long step, Done done) {
  atomicAdd(p.state + STATE_IDLE, 1);
  bool going = true;
  for (unsigned ns = 256; !done(); ns = ns < 65536 ? 2 * ns : ns) {
    if (stopping(p, step)) {
      going = false;
      break;
    }
    __nanosleep(ns);
  }
  atomicAdd(p.state + STATE_IDLE, 1);
  return going;
}

// (thread 0) the step's records into the token ring, waiting for the host to read while it is full
__device__ bool flush(const Params& p, const sched::Serving& s, long long step) {
  return sched::flush_records(s) == 0 || wait_for_host(p, step, [&] { return sched::flush_records(s) == 0; });
}

// (thread 0) The step boundary: the previous step's end (each chunk that sampled takes its sampling row's token,
// end_step, and the records go into the ring), then begin_step until a step has chunks to run, waiting for the host
// while nothing is admitted: for a request in the queue, or the shutdown word. Returns whether step `step` runs;
// where not (shutdown with nothing admitted or queued, an error, the launch's stop, or its last step: p.num_steps,
// so that no event's count passes 32 bits), the launch stops after the previous step (STATE_STOP), the error in
// STATE_SERVE_ERROR. `tokens`: a word per chunk.
__device__ bool step_boundary(const Params& p, long long step, int* tokens) {
  const sched::Serving s = sched::serving_of_regions(p.host, p.device_state, p.workspace);
  unsigned error = sched::OK;
  bool going = true;
  if (step > 0) {
    const int samples = int(serve_work(p).num_samples);
    for (int j = 0; j < samples; ++j) tokens[step_rows(p)[sample_rows(p)[j]].chunk] = chosen_tokens(p)[j];
    error = p.state[STATE_BAD_TOKEN] ? ERROR_BAD_LOGITS : sched::end_step(s, tokens);
    going = !error && flush(p, s, step);
  }
  mark(p, 0);
  while (going && !error && step + 1 < p.num_steps) {
    error = sched::plan_step(s);   // (the pool's check: schedule_task's block, once a step runs)
    if (error || !(going = flush(p, s, step))) break;
    if (s.step->num_chunks) return true;
    error = sched::end_step(s, tokens);   // (a step without chunks: its control words, as the CPU device's)
    if (error || !(going = flush(p, s, step))) break;
    bool admitted = false;
    for (unsigned e = 0; e < s.size.max_batch; ++e) admitted = admitted || s.entries[e].state != ENTRY_FREE;
    const auto queued = [&] {
      const unsigned long long k = s.state->queue_taken;
      return sched::load_acquire(&s.queue[k % s.size.queue_slots].seq) == k + 1;
    };
    const auto shutdown = [&] { return sched::load_relaxed(&s.control->shutdown) != 0; };
    if (shutdown() && !admitted && !queued()) break;
    // (an admitted request runs at the next begin_step: one preempted by itself, with the pool its own, is admitted
    // again; with nothing admitted only the host brings work)
    if (!admitted && !s.state->worked) going = wait_for_host(p, step, [&] { return queued() || shutdown(); });
  }
  if (error) p.state[STATE_SERVE_ERROR] = int(error);
  else if (going && step + 1 >= p.num_steps) p.state[STATE_LAUNCH_END] = 1;
  atomicMin(p.state + STATE_STOP, int(step) - 1);
  return false;
}

// The step's work beside the protocol's tables, by the block (a thread a row and a chunk: their records' loads side by
// side), then thread 0's sums in shared memory: each row's first attention item (first[r], and first[rows] the step's
// items) and the sampling rows (each sampling chunk's last row, in chunk order); `last` is scratch of a word a chunk.
// Ends in a compute barrier.
__device__ void plan_work(const Params& p, int* first, int* last) {
  const Step& step = step_header(p);
  const int rows = int(step.num_rows), chunks = int(step.num_chunks);
  for (int r = threadIdx.x; r < rows; r += NT) first[r] = int(row_splits(step_rows(p)[r].position).splits);
  for (int c = threadIdx.x; c < chunks; c += NT) {
    const Chunk& chunk = step_chunks(p)[c];
    last[c] = chunk.sample ? int(chunk.row + chunk.count - 1) : -1;
  }
  compute_sync();
  if (threadIdx.x == 0) {
    int items = 0;
    for (int r = 0; r < rows; ++r) {
      const int splits = first[r];
      first[r] = items;
      items += splits;
    }
    first[rows] = items;
    unsigned samples = 0;
    for (int c = 0; c < chunks; ++c)
      if (last[c] >= 0) sample_rows(p)[samples++] = last[c];
    ServeWork& work = serve_work(p);
    work.num_items = unsigned(items);
    work.num_samples = samples;
  }
  compute_sync();
}

// whether `value` holds in every compute thread (a compute barrier that and-reduces it)
__device__ __forceinline__ bool compute_all(bool value) {
  __syncwarp();
  unsigned all;
  asm volatile("{\n .reg .pred q, r;\n setp.ne.u32 q, %1, 0;\n bar.red.and.pred r, %2, %3, q;\n"
               " selp.u32 %0, 1, 0, r;\n}" : "=r"(all) : "r"(unsigned(value)), "n"(BAR_COMPUTE), "n"(NT) : "memory");
  return all != 0;
}

// (thread 0) the step does not run after all: the scheduler's error stops the launch after the previous step
__device__ void stop_serving(const Params& p, long long step, unsigned error) {
  p.state[STATE_SERVE_ERROR] = int(error);
  atomicMin(p.state + STATE_STOP, int(step) - 1);
}

// SCHEDULE: the step boundary (thread 0), the page pool's check (the block: scheduler.cuh's check_pool, its pages
// shared by the threads), then the step's attention items (each row's splits in order, the rows in order) and h0,
// each row's token's embedding row. false: the step does not run (the launch stops).
__device__ bool schedule_task(const Params& p, long long step, float* work) {
  __shared__ int runs;
  __shared__ unsigned stamp;
  int* tokens = reinterpret_cast<int*>(work);   // [MAX_BATCH]: per chunk, its sampling row's token
  int* first = tokens + MAX_BATCH;              // [MAX_ROWS + 1]: each row's first item
  const sched::Serving s = sched::serving_of_regions(p.host, p.device_state, p.workspace);
  if (threadIdx.x == 0) {
    runs = step_boundary(p, step, tokens);
    if (runs) stamp = sched::pool_stamp(s);
  }
  compute_sync();
  if (!runs) return false;
  mark(p, 1);
  const bool pages_ok = compute_all(sched::check_pool_part(s, stamp, threadIdx.x, NT));
  if (threadIdx.x == 0) {
    const unsigned error = sched::pool_count(s, pages_ok);
    runs = !error;
    if (error) stop_serving(p, step, error);
  }
  compute_sync();
  if (!runs) return false;
  plan_work(p, first, tokens);   // (the previous step's tokens are taken: their words are free)
  mark(p, 2);
  const int rows = int(step_header(p).num_rows), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < rows; r += NW) {
    const RowSplits at = row_splits(step_rows(p)[r].position);
    for (unsigned j = lane; j < at.splits; j += 32) {
      const unsigned lo = at.first + j * at.width, end = (j + 1) * at.width;
      serve_items(p)[first[r] + j] = AttnItem{unsigned(r), j, at.splits, unsigned(first[r]), lo,
                                              at.first + (end < at.keys ? end : at.keys)};
    }
  }
  constexpr int CH = H / VEC;
  for (int e = threadIdx.x; e < rows * CH; e += NT) {
    const int r = e / CH, c = e % CH;
    const long long token = step_rows(p)[r].token;
    reinterpret_cast<uint4*>(row_of(p.hs, 0, r, H))[c] = reinterpret_cast<const uint4*>(p.embed + token * H)[c];
  }
  return true;
}

}  // namespace mk

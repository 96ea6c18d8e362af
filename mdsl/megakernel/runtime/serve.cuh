// The serving kernel's tables (the SERVE section; docs/design.md, "The megakernel's serving tables"): where the
// protocol's step tables and the step's work are, the step rows' buffers, and SCHEDULE, the step boundary, which
// runs mdsl/serving/scheduler.cuh in one thread. Part of device.cu (kernel_source.py expands it in place);
// serving_source.py puts the protocol's C declarations, the scheduler and the serving tables' declarations
// (ServeWork, AttnItem, the serve region's offsets) before the runtime.

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

// (thread 0) The step boundary: the previous step's end (each chunk that sampled has its sampling row's token in
// `tokens`: end_step, and the records go into the ring), then begin_step until a step has chunks to run, waiting for
// the host while nothing is admitted: for a request in the queue, or the shutdown word. Returns whether step `step`
// runs; where not (shutdown with nothing admitted or queued, an error, the launch's stop, or its last step:
// p.num_steps, so that no event's count passes 32 bits), the launch stops after the previous step (STATE_STOP), the
// error in STATE_SERVE_ERROR. `tokens`: a word per chunk.
__device__ bool step_boundary(const Params& p, long long step, int* tokens) {
  const sched::Serving s = sched::serving_of_regions(p.host, p.device_state, p.workspace);
  unsigned error = sched::OK;
  bool going = true;
  if (step > 0) {
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
  if (step > 0) {   // the previous step's tokens: chunk c of sampling row j takes chosen[j] (a thread a row)
    const int samples = int(serve_work(p).num_samples);
    for (int j = threadIdx.x; j < samples; j += NT)
      tokens[step_rows(p)[sample_rows(p)[j]].chunk] = chosen_tokens(p)[j];
  }
  compute_sync();
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

// The worker loop: the scheduler warp takes this worker's tasks in order and waits for their inputs; the
// compute warps run them and signal their events. Part of device.cu (kernel_source.py expands it in place).

namespace mk {

// The scheduler warp waits (lane i for waits i, i + 32, ...) until the task's events reach their count
// for `step`. false: the launch stops (an earlier step's sampler said so, or the watchdog fired). A
// stopping sampler does not signal, so a task whose waits all end belongs to a step that runs: no
// further check of the stop (a global round trip on every dependency hop) is needed.
__device__ bool wait_for_inputs(const Params& p, const Task& t, long long index, long long step, int lane) {
  bool go = true;
  for (int k = lane; k < t.wait_count && go; k += 32) {
    int2 wt = p.waits[t.wait_begin + k];
    const bool remote = WORLD > 1 && (wt.x & REMOTE);
    wt.x &= ~REMOTE;
    const unsigned need = unsigned(wt.y) * unsigned(step + 1);
    unsigned long long since = 0;
#if MK_SERVE
    int idle_seen = 0;   // STATE_IDLE when the watchdog's clock started
#endif
    unsigned spins = 0, seen;
    for (;;) {
      // both loads in flight at once (the acquire orders only what follows it): one round trip a poll
      const int stopped_at = ld_relaxed(p.state + STATE_STOP);
      seen = remote ? ld_acquire_system(p.events + wt.x) : ld_acquire(p.events + wt.x);
      if (seen >= need) break;
      if (stopped_at < step) { go = false; break; }
      if (++spins % 1024 == 0) {
        const unsigned long long now = globaltimer();
        if (since == 0) {
          since = now;
#if MK_SERVE
          idle_seen = ld_relaxed(p.state + STATE_IDLE);
#endif
        } else if (now - since > WATCHDOG_NS) {   // a deadlock: report it, and every worker leaves
#if MK_SERVE
          // (unless the step boundary waits, or has waited meanwhile, for the host: for requests, or for room in
          // the token ring; STATE_IDLE is odd while it waits, and counts its waits)
          const int idle = ld_relaxed(p.state + STATE_IDLE);
          if (idle != idle_seen || idle % 2 != 0) {
            since = now;
            idle_seen = idle;
            continue;
          }
#endif
          if (atomicCAS(p.state + STATE_STUCK_TASK, 0, int(index % TASKS) + 1) == 0) {
            p.state[STATE_STUCK_STEP] = int(step);
            p.state[STATE_STUCK_EVENT] = wt.x;
            p.state[STATE_STUCK_COUNT] = int(seen);
            p.state[STATE_STUCK_NEED] = int(need);
          }
          atomicExch(p.state + STATE_STOP, -1);
          go = false;
          break;
        }
      }
      __nanosleep(32);
    }
  }
  __syncwarp();   // orders every lane's acquire before what the warp does next
  return __all_sync(0xffffffffu, go);
}

// A task of an EARLY_KINDS kind is handed over before its inputs are complete, so that the compute warps
// issue its first weight loads (or attention's row copies) while they wait (gemv's `early`), if its step is
// known to run: an earlier task of the step had its inputs, and a step's tasks all descend from the sampler
// before it, which signals only if the step runs. A step's first task on each worker is handed over once its
// inputs are complete, as every other task is.
__device__ __forceinline__ constexpr bool early_kind(int kind) { return ((EARLY_KINDS >> kind) & 1) != 0; }

// whether the scheduler warp times the task it takes: the decode kernel's whole launch where it has a profile; the
// serving kernel's while the host's STATE_PROFILE word asks (serve.cuh: its records go into a ring of the last
// PROFILE_STEPS steps, so that a resident kernel's profile is of the steps the host chooses)
__device__ __forceinline__ bool profiling(const Params& p) {
#if MK_SERVE
  return p.profile != nullptr && ld_relaxed(p.state + STATE_PROFILE) != 0;
#else
  return p.profile != nullptr;
#endif
}

// The scheduler warp: take this worker's next task index (blockIdx.x + k * workers: any `workers` consecutive
// tasks, such as a linear's tiles, go one to each worker; a worker takes its indices in increasing order, so
// the smallest unfinished task has finished inputs and its worker reaches it: no deadlock while every worker
// is resident), prefetch an attention split's cached rows into L2, wait for its inputs, and hand it over in
// the next slot once the compute warps have emptied it (they run the previous task meanwhile); an early
// kind's task is handed over before the wait, and its slot's ready barrier opened after.
__device__ void schedule(const Params& p, Slot* slots) {
  const int lane = threadIdx.x % 32;
  const long long total = p.num_steps * TASKS;
  long long pad = 0;   // Slot::pad
  bool stopping = false;         // an early task's wait failed: the next slot ends the worker
  long long running_step = -1;   // the last step a task of which had its inputs on this worker
  for (long long k = 0;; ++k) {
    const int s = int(k % SLOTS);
    long long index = stopping ? total : (long long)blockIdx.x + k * (long long)gridDim.x;
    Task t = {};
    unsigned long long taken = 0, ready = 0;
    bool early = false;
    if (index < total) {
      const long long step = index / TASKS;
      t = p.tasks[index % TASKS];
      if (profiling(p)) taken = globaltimer();
      const long long pos = p.start_pos + step;
#if MK_SERVE
      // (an ATTN task's keys are found through the page tables of the step's rows: its items prefetch them)
      (void)pos;
#else
      if (t.kind == KIND_ATTN) prefetch_kv_rows(p.layers[t.layer], t.layer, t.begin, t.end, pos, lane);
#endif
      early = early_kind(t.kind) && step == running_step;
      if (early) {
        if (k >= SLOTS) named_sync(BAR_EMPTY + s, BLOCK);   // the compute warps are done with slot s
        if (lane == 0) slots[s] = Slot{t, index, pad, taken, 0, true, false};
        named_arrive(BAR_FULL + s, BLOCK);
      }
      const bool inputs = wait_for_inputs(p, t, index, step, lane);
      if (!inputs) index = -1;
      else running_step = step;
#if MK_SERVE
      if (taken != 0) ready = globaltimer();   // (the host may turn the profile off meanwhile)
#else
      if (p.profile != nullptr) ready = globaltimer();
#endif
    } else {
      index = -1;
    }
    if (early) {
      if (lane == 0) {
        slots[s].ready_ns = ready;
        slots[s].failed = index < 0;
#if MK_SERVE
        early_failed[s] = index < 0;
#endif
      }
      named_arrive(BAR_READY + s, BLOCK);
      stopping = index < 0;
      continue;
    }
    if (k >= SLOTS) named_sync(BAR_EMPTY + s, BLOCK);   // the compute warps are done with slot s
    if (lane == 0) slots[s] = Slot{t, index, pad, taken, ready, false, false};
    named_arrive(BAR_FULL + s, BLOCK);
    if (index < 0) {
      // the compute warps' last arrival on the other slot, so that no barrier is left half-arrived
      if (k >= 1) named_sync(BAR_EMPTY + (s ^ 1), BLOCK);
      return;
    }
  }
}

// The compute warps: run the tasks of the slots in turn; never wait on another block.
__device__ void compute(const Params& p, const Slot* slots, float* red, float* work, volatile int* finished,
                        volatile int* tasks_done) {
  for (long long k = 0;; ++k) {
    const int s = int(k % SLOTS);
    named_sync(BAR_FULL + s, BLOCK);
    const Slot slot = slots[s];
    if (slot.index < 0) {
      if (threadIdx.x == 0) *finished = 1;
      return;
    }
    const Task& t = slot.task;
    const long long index = slot.index, step = index / TASKS, pos = p.start_pos + step;
    const unsigned long long started = threadIdx.x == 0 && p.profile != nullptr ? globaltimer() : 0;
    if (threadIdx.x == 0 && p.profile != nullptr)
      for (int m = 0; m < MARKS; ++m) body_marks[m] = 0;   // (thread 0 alone writes and reads them)
    const bool signal = run_task(p, t, slot.early ? BAR_READY + s : 0, work, red, step, pos, int(index % TASKS));
    compute_sync();                    // every thread's writes happen before the release below
    if (threadIdx.x == 0) {
      // (an early task's slot: past its ready barrier, which every compute thread passed in its body)
      const bool failed = slot.early && slots[s].failed;
      const unsigned long long done = p.profile != nullptr ? globaltimer() : 0;   // before consumers can start
      // no separate fence: red.release is cumulative over the compute barrier above (every compute
      // thread's writes are ordered before it), as in CUTLASS's GenericBarrier::arrive_inc
      // a remote signal is a release at system scope: cumulative over the block's puts to the peers too
      for (int k = 0; signal && !failed && k < t.signal_count; ++k) {
        const int entry = p.signals[t.signal_begin + k], e = entry & ~REMOTE;
        red_release(p.events + e);
        if (WORLD > 1 && (entry & REMOTE))
          for (int r = 1; r < WORLD; ++r) red_release_system(on_peer(p, p.events, (int(p.rank) + r) % WORLD) + e);
      }
#if MK_SERVE
      // (a ring of the last PROFILE_STEPS steps: the step + 1 beside the SM tells a slot's step, 0 none yet)
      if (slot.taken_ns != 0) {
        unsigned long long* rec = p.profile + (index % (PROFILE_STEPS * TASKS)) * PROFILE_WORDS;
        rec[0] = sm_id() | (unsigned long long)(step + 1) << 32;
#else
      if (p.profile != nullptr) {
        unsigned long long* rec = p.profile + index * PROFILE_WORDS;
        rec[0] = sm_id();
#endif
        rec[1] = slot.taken_ns;
        // an early task's body starts, as the others', once its inputs are ready: at the scheduler's time (a
        // compute thread's %globaltimer read just after the ready barrier reads earlier than that)
        rec[2] = slot.early ? slots[s].ready_ns : slot.ready_ns;
        rec[3] = slot.early ? rec[2] : started;
        rec[4] = done;
        for (int m = 0; m < MARKS; ++m) rec[5 + m] = body_marks[m];
      }
      *tasks_done = int(k + 1);
    }
    named_arrive(BAR_EMPTY + s, BLOCK);
  }
}

}  // namespace mk

// The scheduler's host build: C entry points over the scheduler's functions (mdsl/serving/scheduler.cuh),
// for ctypes. tests/serving/native_scheduler.py compiles it after <cstddef>, the protocol's structs
// (c_layouts) and scheduler.cuh. Each call takes the arrays' addresses, in ARRAYS order (native_scheduler.py),
// and the shape's sizes (sched::Sizes, nine u32s).

#ifndef MDSL_SCHEDULER_ID
#define MDSL_SCHEDULER_ID "unversioned"
#endif

namespace {

sched::Serving serving(void* const* a, const unsigned* z) {
  sched::Serving s;
  s.control = static_cast<Control*>(a[0]);
  s.queue = static_cast<QueueSlot*>(a[1]);
  s.ring = static_cast<RingRecord*>(a[2]);
  s.cancel = static_cast<unsigned*>(a[3]);
  s.prompts = static_cast<int*>(a[4]);
  s.entries = static_cast<Entry*>(a[5]);
  s.page_table = static_cast<int*>(a[6]);
  s.history = static_cast<int*>(a[7]);
  s.pool = static_cast<Pool*>(a[8]);
  s.free_pages = static_cast<int*>(a[9]);
  s.step = static_cast<Step*>(a[10]);
  s.chunks = static_cast<Chunk*>(a[11]);
  s.rows = static_cast<StepRow*>(a[12]);
  s.size = sched::Sizes{z[0], z[1], z[2], z[3], z[4], z[5], z[6], z[7], z[8]};
  sched::bind_workspace(s, a[13]);
  return s;
}

}  // namespace

extern "C" {

const char* mdsl_scheduler_id() { return MDSL_SCHEDULER_ID; }

// sched::State's size (which = -1) and its fields' offsets, in STATE's order (mdsl.serving.scheduler)
long long mdsl_scheduler_state_layout(int which) {
  switch (which) {
    case -1: return sizeof(sched::State);
    case 0: return offsetof(sched::State, written);
    case 1: return offsetof(sched::State, staged);
    case 2: return offsetof(sched::State, flushed);
    case 3: return offsetof(sched::State, worked);
    case 4: return offsetof(sched::State, tell_host);
    case 5: return offsetof(sched::State, error);
    case 6: return offsetof(sched::State, stamp);
    case 7: return offsetof(sched::State, peak_running);
    case 8: return offsetof(sched::State, cancels_seen);
    case 9: return offsetof(sched::State, queue_taken);
    case 10: return offsetof(sched::State, steps);
    case 11: return offsetof(sched::State, preemptions);
    case 12: return offsetof(sched::State, tokens);
    case 13: return offsetof(sched::State, bad_request);
    default: return -1;
  }
}

unsigned long long mdsl_scheduler_workspace_bytes(const unsigned* z) {
  return sched::workspace_bytes(sched::Sizes{z[0], z[1], z[2], z[3], z[4], z[5], z[6], z[7], z[8]});
}

unsigned mdsl_scheduler_begin(void* const* arrays, const unsigned* sizes) {
  return sched::begin_step(serving(arrays, sizes));
}

unsigned mdsl_scheduler_end(void* const* arrays, const unsigned* sizes, const int* tokens) {
  return sched::end_step(serving(arrays, sizes), tokens);
}

// the pool's check as a block of `threads` threads shares it (the megakernel's schedule_task), the threads run one
// after another: a valid interleaving, each page's mark swapped whole
unsigned mdsl_scheduler_check_pool_split(void* const* arrays, const unsigned* sizes, unsigned threads) {
  const sched::Serving s = serving(arrays, sizes);
  const unsigned stamp = sched::pool_stamp(s);
  bool ok = true;
  for (unsigned t = 0; t < threads; ++t) ok = sched::check_pool_part(s, stamp, t, threads) && ok;
  return sched::pool_count(s, ok);
}

unsigned mdsl_scheduler_flush(void* const* arrays, const unsigned* sizes) {
  return sched::flush_records(serving(arrays, sizes));
}

}  // extern "C"

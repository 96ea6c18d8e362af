// The serving scheduler's data and bookkeeping: where the protocol's arrays are (Serving), the shape's
// sizes, the scheduler's own state and scratch (its workspace), the memory-ordering helpers, and the
// pages, entries and ring records it keeps. Part of scheduler.cuh (mdsl.serving.scheduler expands it in
// place); it needs the protocol's structs (mdsl.serving.protocol.c_layouts or c_declarations).

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define SCHED __device__
#else
#define SCHED
#endif

namespace sched {

// what begin_step, end_step and flush_records answer (State::error keeps the first): mdsl.serving.scheduler
// turns each into a ServingError with its message
enum : unsigned {
  OK = 0,
  ERROR_REQUEST = 1,     // a queued request breaks the protocol (State::bad_request holds it)
  ERROR_POOL = 2,        // the page pool lost or duplicated a page
  ERROR_UNFLUSHED = 3,   // begin_step while records of the last step wait for the ring
  ERROR_BOUNDS = 4,      // a page table, a history or the step's rows would be written past its end
};

// ServingShape's sizes as run-time values: one host build serves every shape, and the GPU's caller gives
// the shape's constants, which its compiler folds
struct Sizes {
  unsigned max_batch, page_size, num_pages, max_seq, max_tokens_per_step, queue_slots, ring_records, handles,
      pages_per_request;
};

// the scheduler's own state, at the start of its workspace, which the caller zeroes before the first step
struct State {
  unsigned long long written;   // ring records published: record n = written goes next, into slot n % R
  unsigned staged;              // this step's records in the staging array, the first `flushed` published
  unsigned flushed;
  unsigned worked;              // begin_step cancelled, admitted or planned something
  unsigned tell_host;           // this step wrote a record or took a queue slot: the host has news
  unsigned error;               // the first error (ERROR_*): the device stops
  unsigned stamp;               // check_pool's mark for this step
  // the control block's device words as last written (the control block lies in the host's memory, where a
  // read is a round trip over PCIe: the device reads its own copies)
  unsigned peak_running;
  unsigned cancels_seen;        // the host's count of cancel flags at the last scan of the admitted entries
  unsigned long long queue_taken, steps, preemptions, tokens;
  Request bad_request;          // ERROR_REQUEST: the request its queue slot held
};

// where everything is: the host region's arrays, the device region's, the workspace's, and the sizes
struct Serving {
  Control* control;
  QueueSlot* queue;
  RingRecord* ring;
  unsigned* cancel;
  int* prompts;          // [handles][max_seq]
  Entry* entries;
  int* page_table;       // [max_batch][pages_per_request]
  int* history;          // [max_batch][max_seq]
  Pool* pool;
  int* free_pages;
  Step* step;
  Chunk* chunks;
  StepRow* rows;
  State* state;
  RingRecord* staging;   // stage_capacity records: a step's records before they go into the ring
  unsigned* candidates;  // scratch, max_batch each: entries by age, the plan's entries and counts, its age order
  unsigned* plan_entry;
  unsigned* plan_count;
  unsigned* by_age;
  unsigned* marks;       // num_pages: check_pool's mark per page
  Sizes size;
};

// A step writes at most one record per entry it cancels or preempts (an entry is cancelled or preempted,
// not both), one per queued request cancelled at the queue's head (at most queue_slots: admission reads
// that many slots a step) and one per chunk that samples (at most one chunk per entry).
SCHED inline unsigned stage_capacity(const Sizes& z) { return 2 * z.max_batch + z.queue_slots; }

SCHED inline unsigned long long round_up(unsigned long long n, unsigned long long k) { return (n + k - 1) / k * k; }

// the workspace: State, the staging records, then the u32 scratch arrays
SCHED inline unsigned long long workspace_bytes(const Sizes& z) {
  unsigned long long at = round_up(sizeof(State), 32) + sizeof(RingRecord) * stage_capacity(z);
  return round_up(at + 4ull * (4ull * z.max_batch + z.num_pages), 128);
}

SCHED inline void bind_workspace(Serving& s, void* workspace) {
  char* base = static_cast<char*>(workspace);
  s.state = reinterpret_cast<State*>(base);
  s.staging = reinterpret_cast<RingRecord*>(base + round_up(sizeof(State), 32));
  unsigned* scratch = reinterpret_cast<unsigned*>(s.staging + stage_capacity(s.size));
  s.candidates = scratch;
  s.plan_entry = scratch + s.size.max_batch;
  s.plan_count = scratch + 2 * s.size.max_batch;
  s.by_age = scratch + 3 * s.size.max_batch;
  s.marks = scratch + 4 * s.size.max_batch;
}

// ---- memory order: the queue's and the ring's sequence words, the cancel flags, the control words

SCHED inline unsigned long long load_acquire(const unsigned long long* p) {
#if defined(__CUDA_ARCH__)
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

SCHED inline void store_release(unsigned long long* p, unsigned long long v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

SCHED inline unsigned load_acquire(const unsigned* p) {
#if defined(__CUDA_ARCH__)
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

// a cancel flag guards no data: a relaxed load
SCHED inline unsigned load_relaxed(const unsigned* p) {
#if defined(__CUDA_ARCH__)
  unsigned v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

// a word of the page pool as memory holds it, for its check (past the SM's L1: the check is there to catch pages
// damaged by anyone, the host's copies into device memory too)
template <typename Word>
SCHED inline Word load_checked(const Word* p) {
#if defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  return *p;
#endif
}

// the control block's statistics: relaxed stores the host reads whenever it likes
// every earlier store ordered before every later one, as seen from the host too (the fence of a release pattern:
// one fence, then relaxed flag stores, publishes a batch of records at the cost of one system-scope fence)
SCHED inline void release_fence() {
#if defined(__CUDA_ARCH__)
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#else
  __atomic_thread_fence(__ATOMIC_RELEASE);
#endif
}

SCHED inline void store_relaxed(unsigned* p, unsigned v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
#else
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
#endif
}

SCHED inline void store_relaxed(unsigned long long* p, unsigned long long v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
#else
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
#endif
}

// ---- entries

SCHED inline unsigned fail(const Serving& s, unsigned error) {
  if (!s.state->error) s.state->error = error;
  return s.state->error;
}

// an entry's known tokens: its prompt and the tokens it produced
SCHED inline long long known(const Serving& s, unsigned e) {
  return (long long)s.entries[e].request.prompt_len + s.entries[e].generated;
}

SCHED inline unsigned long long pages_for(const Serving& s, unsigned long long tokens) {
  return (tokens + s.size.page_size - 1) / s.size.page_size;
}

// entries in `state`, oldest (smallest arrival) first, into out; how many. Arrivals are distinct (a
// request's submission number), so the order is the one a sort by arrival gives.
// (The entries' states are read BATCH at a time before any is used: on the GPU one thread runs this, and
// each read is a memory round trip that the insertion's stores would otherwise keep from overlapping.)
SCHED inline unsigned by_age(const Serving& s, unsigned state, unsigned* out) {
  constexpr unsigned BATCH = 8;
  unsigned n = 0;
  for (unsigned e0 = 0; e0 < s.size.max_batch; e0 += BATCH) {
    unsigned states[BATCH];
    for (unsigned k = 0; k < BATCH; ++k) states[k] = e0 + k < s.size.max_batch ? s.entries[e0 + k].state : ~0u;
    for (unsigned k = 0; k < BATCH && e0 + k < s.size.max_batch; ++k) {
      unsigned e = e0 + k;
      if (states[k] != state) continue;
      unsigned long long arrival = s.entries[e].arrival;
      unsigned at = n++;
      for (; at > 0 && s.entries[out[at - 1]].arrival > arrival; --at) out[at] = out[at - 1];
      out[at] = e;
    }
  }
  return n;
}

// the running entry with the largest arrival, or max_batch where none runs
SCHED inline unsigned youngest_running(const Serving& s) {
  unsigned found = s.size.max_batch;
  for (unsigned e = 0; e < s.size.max_batch; ++e) {
    if (s.entries[e].state != ENTRY_RUNNING) continue;
    if (found == s.size.max_batch || s.entries[e].arrival > s.entries[found].arrival) found = e;
  }
  return found;
}

// ---- pages: free_pages[0 .. free_count) is a stack of free page numbers

SCHED inline unsigned take_page(const Serving& s, unsigned e) {
  Entry& entry = s.entries[e];
  unsigned top = s.pool->free_count;
  if (top == 0 || top > s.size.num_pages) return fail(s, ERROR_POOL);
  if (entry.num_pages >= s.size.pages_per_request) return fail(s, ERROR_BOUNDS);
  s.page_table[(unsigned long long)e * s.size.pages_per_request + entry.num_pages] = s.free_pages[top - 1];
  s.pool->free_count = top - 1;
  entry.num_pages += 1;
  return OK;
}

// e's pages back onto the stack, its last page first (so its first page is on top)
SCHED inline unsigned free_pages(const Serving& s, unsigned e) {
  Entry& entry = s.entries[e];
  unsigned k = entry.num_pages, top = s.pool->free_count;
  if (k > s.size.pages_per_request) return fail(s, ERROR_BOUNDS);
  if ((unsigned long long)top + k > s.size.num_pages) return fail(s, ERROR_POOL);
  int* table = s.page_table + (unsigned long long)e * s.size.pages_per_request;
  for (unsigned i = 0; i < k; ++i) {
    s.free_pages[top + i] = table[k - 1 - i];
    table[k - 1 - i] = -1;
  }
  s.pool->free_count = top + k;
  entry.num_pages = 0;
  return OK;
}

// ---- records: staged during the step, published by flush_records

SCHED inline unsigned stage(const Serving& s, unsigned long long request_id, int token, unsigned position,
                            unsigned flags, unsigned reason) {
  State& st = *s.state;
  if (st.staged >= stage_capacity(s.size)) return fail(s, ERROR_BOUNDS);
  RingRecord& r = s.staging[st.staged++];
  r.seq = 0;
  r.request_id = request_id;
  r.token = token;
  r.position = position;
  r.flags = flags;
  r.reason = reason;
  st.tell_host = 1;
  return OK;
}

SCHED inline unsigned release(const Serving& s, unsigned e) {
  unsigned error = free_pages(s, e);
  s.entries[e].state = ENTRY_FREE;
  return error;
}

// free e's pages: it keeps its entry and history, and recomputes its tokens when admitted again
SCHED inline unsigned preempt(const Serving& s, unsigned e) {
  Entry& entry = s.entries[e];
  if (unsigned error = free_pages(s, e)) return error;
  entry.state = ENTRY_PREEMPTED;
  entry.context = 0;
  store_relaxed(&s.control->preemptions, ++s.state->preemptions);
  return stage(s, entry.request.request_id, -1, entry.request.prompt_len + entry.generated, RECORD_PREEMPTED,
               REASON_NONE);
}

}  // namespace sched

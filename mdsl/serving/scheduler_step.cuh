// The scheduler's step (docs/design.md, "The scheduler's step"), split at the forward: begin_step cancels,
// plans, gives pages (preempting), admits and writes the step; end_step advances the entries that ran and
// takes the tokens the forward sampled; flush_records publishes the step's records into the token ring.
// Part of scheduler.cuh (mdsl.serving.scheduler expands it in place). Each function is the CPU device's
// method of the same name (mdsl/serving/cpu.py), step for step, so that the two write the same state.

namespace sched {

// Where the host's count of cancel flags moved since the last look (one read of the host's memory a step, not
// one per entry): every cancelled admitted entry, in entry order: its last record, then its pages and entry
// freed. (The host counts a flag after setting it: the acquire load of the count orders the flags' loads.)
SCHED inline unsigned cancel_admitted(const Serving& s) {
  unsigned cancels = load_acquire(&s.control->cancels);
  if (cancels == s.state->cancels_seen) return OK;
  s.state->cancels_seen = cancels;
  for (unsigned e = 0; e < s.size.max_batch; ++e) {
    Entry& entry = s.entries[e];
    if (entry.state == ENTRY_FREE || !load_relaxed(&s.cancel[entry.request.handle])) continue;
    if (unsigned error = stage(s, entry.request.request_id, -1, entry.request.prompt_len + entry.generated,
                               RECORD_FINISHED, REASON_CANCELLED))
      return error;
    if (unsigned error = release(s, e)) return error;
    s.state->worked = 1;
  }
  return OK;
}

// Entry e's chunk, appended to the plan at *length: its pending tokens, as many as the budget leaves
// (none where the budget is spent). Returns the tokens planned.
SCHED inline unsigned plan_one(const Serving& s, unsigned e, unsigned budget, unsigned* length) {
  long long pending = known(s, e) - (long long)s.entries[e].context;
  if (pending < 1 || budget == 0) return 0;
  unsigned count = pending < (long long)budget ? (unsigned)pending : budget;
  s.plan_entry[*length] = e;
  s.plan_count[*length] = count;
  *length += 1;
  return count;
}

// Chunks for candidates[0 .. n) (entries oldest first) within `budget` tokens, appended to the plan at
// *length: every decode entry (one pending token) first, then the others, each a chunk of its pending
// tokens as long as the budget leaves. Returns the tokens planned.
SCHED inline unsigned plan(const Serving& s, const unsigned* candidates, unsigned n, unsigned budget,
                           unsigned* length) {
  unsigned used = 0;
  for (unsigned pass = 0; pass < 2; ++pass) {
    for (unsigned i = 0; i < n; ++i) {
      unsigned e = candidates[i];
      long long pending = known(s, e) - (long long)s.entries[e].context;
      if (pass == 0 ? pending == 1 : pending > 1) used += plan_one(s, e, budget - used, length);
    }
  }
  return used;
}

// Pages for the plan's chunks [first, *length), oldest entry first; the chunks that can run stay, in plan
// order, with their counts. A chunk whose pages cannot all be had shrinks to the positions its pages
// hold; an entry whose next position has no page and finds none free preempts the youngest running entry
// (perhaps itself) when may_preempt, and otherwise waits. *preempted: whether it preempted.
SCHED inline unsigned give_pages(const Serving& s, unsigned first, unsigned* length, bool may_preempt,
                                 bool* preempted) {
  unsigned n = *length - first;
  unsigned* order = s.by_age;
  for (unsigned i = 0; i < n; ++i) {   // the chunks' indices by their entries' arrival (distinct)
    unsigned long long arrival = s.entries[s.plan_entry[first + i]].arrival;
    unsigned at = i;
    for (; at > 0 && s.entries[s.plan_entry[first + order[at - 1]]].arrival > arrival; --at) order[at] = order[at - 1];
    order[at] = i;
  }
  // each step of the loop below takes a page or preempts an entry, or leaves it
  const unsigned bound = s.size.pages_per_request + s.size.max_batch + 1;
  for (unsigned i = 0; i < n; ++i) {
    unsigned c = first + order[i], e = s.plan_entry[c];
    Entry& entry = s.entries[e];
    long long want = s.plan_count[c];
    for (unsigned guard = 0; guard < bound && entry.state == ENTRY_RUNNING; ++guard) {
      long long room = (long long)entry.num_pages * s.size.page_size - entry.context;
      if (room >= want) break;
      if (s.pool->free_count) {
        if (unsigned error = take_page(s, e)) return error;
      } else if (room != 0 || !may_preempt) {
        want = room;
        break;
      } else {   // the victim is younger than every entry served before e: none of them loses its pages
        if (unsigned error = preempt(s, youngest_running(s))) return error;
        *preempted = true;
      }
    }
    s.plan_count[c] = entry.state == ENTRY_RUNNING && want > 0 ? (unsigned)want : 0;
  }
  unsigned kept = first;
  for (unsigned c = first; c < *length; ++c) {
    if (!s.plan_count[c]) continue;
    s.plan_entry[kept] = s.plan_entry[c];
    s.plan_count[kept] = s.plan_count[c];
    ++kept;
  }
  *length = kept;
  return OK;
}

// an admitted entry runs: its first chunk, within what the budget leaves, joins the plan with its pages
SCHED inline unsigned start(const Serving& s, unsigned e, unsigned* budget, unsigned* length) {
  s.entries[e].state = ENTRY_RUNNING;
  unsigned first = *length;
  plan_one(s, e, *budget, length);
  bool preempted = false;
  if (unsigned error = give_pages(s, first, length, false, &preempted)) return error;
  for (unsigned c = first; c < *length; ++c) *budget -= s.plan_count[c];
  s.state->worked = 1;
  return OK;
}

// CpuDevice._check_request: the host's side of the contract, checked before the device relies on it
SCHED inline bool request_is_valid(const Serving& s, const Request& r) {
  unsigned long long n = r.prompt_len, fresh = r.max_new_tokens;
  return 0 < n && 0 < fresh && n + fresh <= s.size.max_seq && r.handle < s.size.handles && r.num_stop <= MAX_STOP &&
         pages_for(s, n + fresh - 1) <= s.size.num_pages;
}

// Preempted entries (oldest first), then the queue in order, while an entry is free and the free pages
// cover the request's known tokens; the first that cannot be admitted stops admission. A request
// cancelled while queued finishes at the queue's head without an entry. Admission reads at most
// queue_slots slots a step: those the host had published when the step began.
SCHED inline unsigned admit(const Serving& s, unsigned budget, unsigned* length) {
  unsigned n = by_age(s, ENTRY_PREEMPTED, s.candidates);
  for (unsigned i = 0; i < n; ++i) {
    unsigned e = s.candidates[i];
    if (s.pool->free_count < pages_for(s, known(s, e))) return OK;
    if (unsigned error = start(s, e, &budget, length)) return error;
  }
  for (unsigned i = 0; i < s.size.queue_slots; ++i) {
    unsigned long long k = s.state->queue_taken;
    QueueSlot& slot = s.queue[k % s.size.queue_slots];
    if (load_acquire(&slot.seq) != k + 1) return OK;
    const Request& r = slot.request;
    if (!request_is_valid(s, r)) {
      s.state->bad_request = r;
      return fail(s, ERROR_REQUEST);
    }
    if (load_relaxed(&s.cancel[r.handle])) {   // cancelled while queued: finished without an entry
      store_release(&s.control->queue_taken, s.state->queue_taken = k + 1);
      if (unsigned error = stage(s, r.request_id, -1, r.prompt_len, RECORD_FINISHED, REASON_CANCELLED)) return error;
      s.state->worked = 1;
      continue;
    }
    unsigned e = 0;
    while (e < s.size.max_batch && s.entries[e].state != ENTRY_FREE) ++e;
    if (e == s.size.max_batch || s.pool->free_count < pages_for(s, r.prompt_len)) return OK;
    Entry& entry = s.entries[e];
    entry.request = r;
    entry.arrival = k;
    entry.context = 0;
    entry.generated = 0;
    const int* prompt = s.prompts + (unsigned long long)r.handle * s.size.max_seq;
    int* history = s.history + (unsigned long long)e * s.size.max_seq;
    for (unsigned p = 0; p < r.prompt_len; ++p) history[p] = prompt[p];
    store_release(&s.control->queue_taken, s.state->queue_taken = k + 1);   // the slot is copied: the host may reuse it
    s.state->tell_host = 1;
    if (unsigned error = start(s, e, &budget, length)) return error;
  }
  return OK;
}

// the step's header, chunks (in plan order, their rows consecutive) and rows; returns the rows
SCHED inline unsigned write_step(const Serving& s, unsigned length, unsigned* rows_out) {
  unsigned r = 0, samples = 0;
  for (unsigned c = 0; c < length; ++c) {
    unsigned e = s.plan_entry[c], n = s.plan_count[c];
    unsigned first = s.entries[e].context;
    if ((unsigned long long)r + n > s.size.max_tokens_per_step || (unsigned long long)first + n > s.size.max_seq)
      return fail(s, ERROR_BOUNDS);
    unsigned sample = (long long)first + n == known(s, e) ? 1 : 0;
    Chunk& chunk = s.chunks[c];
    chunk.entry = e;
    chunk.start = first;
    chunk.count = n;
    chunk.row = r;
    chunk.sample = sample;
    chunk.pad = 0;
    const int* history = s.history + (unsigned long long)e * s.size.max_seq;
    for (unsigned i = 0; i < n; ++i) {
      s.rows[r + i].token = history[first + i];
      s.rows[r + i].position = first + i;
      s.rows[r + i].chunk = c;
    }
    r += n;
    samples += sample;
  }
  s.step->num_chunks = length;
  s.step->num_rows = r;
  s.step->num_samples = samples;
  *rows_out = r;
  return OK;
}

// Every page is either free or in exactly one entry's page table (CpuDevice._check_pool): each page met
// is marked with the check's stamp, so a page met twice, or out of range, or a count other than
// num_pages, is a lost or duplicated page. The check is split so that any number of threads share it
// (the megakernel's whole block: a pool of thousands of pages is thousands of dependent memory round
// trips for one thread): pool_stamp (one thread), then check_pool_part(s, stamp, t, n) in each thread t
// of n, then pool_count; check_pool runs the three in one thread.

// (one thread) the check's stamp, before any part runs
SCHED inline unsigned pool_stamp(const Serving& s) {
  State& st = *s.state;
  if (++st.stamp == 0) {   // the stamps wrapped: old marks could equal new ones
    for (unsigned p = 0; p < s.size.num_pages; ++p) s.marks[p] = 0;
    st.stamp = 1;
  }
  return st.stamp;
}

// a page's mark swapped for the stamp; the old mark (a block's threads mark at once: an atomic exchange)
SCHED inline unsigned swap_mark(unsigned* mark, unsigned stamp) {
#if defined(__CUDA_ARCH__)
  return atomicExch(mark, stamp);
#else
  unsigned old = *mark;
  *mark = stamp;
  return old;
#endif
}

// thread t of n: pages t, t + n, ... of the free stack, and of the entries' page tables a share: the n
// threads form groups of up to 32 (a warp on the GPU), group g taking entries g, g + groups, ... and its
// threads their pages in turn; false where a page is out of range or was met already. (No early exit:
// PAGE_BATCH page numbers are loaded, then their marks swapped, each batch's round trips in flight
// together; an entry's page count is read by its group alone.)
constexpr unsigned PAGE_BATCH = 8;
SCHED inline bool mark_pages(const Serving& s, const int* pages, unsigned count, unsigned stamp, unsigned t,
                             unsigned n) {
  bool ok = true;
  for (unsigned i0 = t; i0 < count; i0 += PAGE_BATCH * n) {
    int p[PAGE_BATCH];
    for (unsigned k = 0; k < PAGE_BATCH; ++k) p[k] = i0 + k * n < count ? load_checked(pages + i0 + k * n) : 0;
    for (unsigned k = 0; k < PAGE_BATCH; ++k) {
      if (i0 + k * n >= count) break;
      if (p[k] < 0 || (unsigned)p[k] >= s.size.num_pages) ok = false;
      else if (swap_mark(s.marks + p[k], stamp) == stamp) ok = false;
    }
  }
  return ok;
}

SCHED inline bool check_pool_part(const Serving& s, unsigned stamp, unsigned t, unsigned n) {
  const unsigned held = load_checked(&s.pool->free_count);
  const unsigned free_count = held < s.size.num_pages ? held : s.size.num_pages;
  bool ok = mark_pages(s, s.free_pages, free_count, stamp, t, n);
  const unsigned lanes = n < 32 ? n : 32, groups = n / lanes;
  if (t >= groups * lanes) return ok;   // (n not a multiple of 32: the last threads take no entry)
  for (unsigned e = t / lanes; e < s.size.max_batch; e += groups) {
    unsigned count = load_checked(&s.entries[e].num_pages);
    if (count > s.size.pages_per_request) count = s.size.pages_per_request;
    ok = mark_pages(s, s.page_table + (unsigned long long)e * s.size.pages_per_request, count, stamp, t % lanes,
                    lanes) && ok;
  }
  return ok;
}

// (one thread, after every part) OK where every part was and the pages met add up to num_pages
SCHED inline unsigned pool_count(const Serving& s, bool parts_ok) {
  const unsigned held = load_checked(&s.pool->free_count);
  unsigned long long met = held < s.size.num_pages ? held : s.size.num_pages;
  constexpr unsigned BATCH = 8;   // (page counts read BATCH at a time: by_age says why)
  for (unsigned e0 = 0; e0 < s.size.max_batch; e0 += BATCH) {
    unsigned counts[BATCH];
    for (unsigned k = 0; k < BATCH; ++k)
      counts[k] = e0 + k < s.size.max_batch ? load_checked(&s.entries[e0 + k].num_pages) : 0;
    for (unsigned k = 0; k < BATCH; ++k)
      met += counts[k] < s.size.pages_per_request ? counts[k] : s.size.pages_per_request;
  }
  return parts_ok && met == s.size.num_pages ? OK : fail(s, ERROR_POOL);
}

SCHED inline unsigned check_pool(const Serving& s) {
  unsigned stamp = pool_stamp(s);
  return pool_count(s, check_pool_part(s, stamp, 0, 1));
}

// cancel, plan, pages (with preemption), admit (skipped in a step that preempted, so that an admission
// is not undone at once), write the step, and the control words: begin_step without the pool's check
// (the megakernel runs the check with its whole block after this).
SCHED inline unsigned plan_step(const Serving& s) {
  State& st = *s.state;
  if (st.error) return st.error;
  if (st.flushed < st.staged) return fail(s, ERROR_UNFLUSHED);
  st.staged = st.flushed = 0;
  st.worked = st.tell_host = 0;
  if (unsigned error = cancel_admitted(s)) return error;
  unsigned length = 0;
  unsigned budget = s.size.max_tokens_per_step;
  unsigned n = by_age(s, ENTRY_RUNNING, s.candidates);
  budget -= plan(s, s.candidates, n, budget, &length);
  bool preempted = false;
  if (unsigned error = give_pages(s, 0, &length, true, &preempted)) return error;
  if (!preempted) {
    budget = s.size.max_tokens_per_step;
    for (unsigned c = 0; c < length; ++c) budget -= s.plan_count[c];
    if (unsigned error = admit(s, budget, &length)) return error;
  }
  unsigned rows = 0;
  if (unsigned error = write_step(s, length, &rows)) return error;
  Control& control = *s.control;
  store_relaxed(&control.running, length);
  store_relaxed(&control.step_tokens, rows);
  if (length) {
    store_relaxed(&control.steps, ++st.steps);
    store_relaxed(&control.tokens, st.tokens += rows);
    if (length > st.peak_running) store_relaxed(&control.peak_running, st.peak_running = length);
    st.worked = 1;
  }
  return OK;
}

// plan_step, then the pool's check, before the forward reads the page tables. The caller runs the step's
// chunks when step->num_chunks > 0.
SCHED inline unsigned begin_step(const Serving& s) {
  if (unsigned error = plan_step(s)) return error;
  return check_pool(s);
}

// entry e's next token `token`, after position pos: into its history and a record; a stop id or
// max_new_tokens makes it the last, and frees the entry
SCHED inline unsigned choose(const Serving& s, unsigned e, int token, unsigned pos) {
  Entry& entry = s.entries[e];
  const Request& r = entry.request;
  if (pos + 1 >= s.size.max_seq) return fail(s, ERROR_BOUNDS);
  unsigned generated = entry.generated;
  s.history[(unsigned long long)e * s.size.max_seq + pos + 1] = token;
  entry.generated = generated + 1;
  unsigned reason = REASON_NONE;
  for (unsigned i = 0; i < r.num_stop && i < MAX_STOP; ++i)
    if (r.stop_ids[i] == token) reason = REASON_STOP;
  if (reason == REASON_NONE && generated + 1 >= r.max_new_tokens) reason = REASON_LENGTH;
  if (unsigned error = stage(s, r.request_id, token, pos + 1, RECORD_HAS_TOKEN | (reason ? RECORD_FINISHED : 0u),
                             reason))
    return error;
  return reason ? release(s, e) : OK;
}

// After the forward: each chunk's entry advances its context past the chunk, and a chunk with sample = 1
// takes tokens[c], the token the forward sampled from its last row (tokens is indexed by chunk; the
// other chunks' elements are not read). Then the control block's free page count.
SCHED inline unsigned end_step(const Serving& s, const int* tokens) {
  State& st = *s.state;
  if (st.error) return st.error;
  unsigned n = s.step->num_chunks < s.size.max_batch ? s.step->num_chunks : s.size.max_batch;
  for (unsigned c = 0; c < n; ++c) {
    const Chunk chunk = s.chunks[c];
    s.entries[chunk.entry].context = chunk.start + chunk.count;
    if (chunk.sample)
      if (unsigned error = choose(s, chunk.entry, tokens[c], chunk.start + chunk.count - 1)) return error;
  }
  store_relaxed(&s.control->free_pages, s.pool->free_count);
  return OK;
}

// Publish the staged records, in order, while the ring has room: record n goes into slot n % R once the
// host has read record n - R (ring_read, an acquire load), the fields of every record that fits first, then one
// release fence and their seq = n + 1 words (relaxed stores: the fence orders the fields before them). Returns the
// records still staged: 0 once all are in the ring. The caller calls again once the host has read more (on a GPU,
// spinning with __nanosleep while it checks shutdown and its stop word); the next begin_step needs them all
// published.
SCHED inline unsigned flush_records(const Serving& s) {
  State& st = *s.state;
  if (st.flushed >= st.staged) return 0;
  // (ring_read lies in the host's memory: read once a call)
  const unsigned long long read = load_acquire(&s.control->ring_read);
  const unsigned long long room = s.size.ring_records - (st.written - read);
  const unsigned n = st.staged - st.flushed < room ? st.staged - st.flushed : unsigned(room);
  for (unsigned k = 0; k < n; ++k) {
    const RingRecord& r = s.staging[st.flushed + k];
    RingRecord& slot = s.ring[(st.written + k) % s.size.ring_records];
    slot.request_id = r.request_id;
    slot.token = r.token;
    slot.position = r.position;
    slot.flags = r.flags;
    slot.reason = r.reason;
  }
  if (n == 0) return st.staged - st.flushed;
  release_fence();
  for (unsigned k = 0; k < n; ++k)
    store_relaxed(&s.ring[(st.written + k) % s.size.ring_records].seq, st.written + k + 1);
  st.written += n;
  st.flushed += n;
  return st.staged - st.flushed;
}

}  // namespace sched

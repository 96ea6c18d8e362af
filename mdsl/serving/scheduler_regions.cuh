// A Serving over the two regions of one shape: the arrays at the offsets and the sizes that
// mdsl.serving.protocol.c_declarations(shape) declares (HOST_*_OFFSET, DEVICE_*_OFFSET, MAX_BATCH, ...),
// constants a GPU build folds. Needs those declarations and scheduler.cuh before it.

namespace sched {

SCHED inline Serving serving_of_regions(void* host_region, void* device_region, void* workspace) {
  char* host = static_cast<char*>(host_region);
  char* device = static_cast<char*>(device_region);
  Serving s;
  s.control = reinterpret_cast<Control*>(host + HOST_CONTROL_OFFSET);
  s.queue = reinterpret_cast<QueueSlot*>(host + HOST_QUEUE_OFFSET);
  s.ring = reinterpret_cast<RingRecord*>(host + HOST_RING_OFFSET);
  s.cancel = reinterpret_cast<unsigned*>(host + HOST_CANCEL_OFFSET);
  s.prompts = reinterpret_cast<int*>(host + HOST_PROMPTS_OFFSET);
  s.entries = reinterpret_cast<Entry*>(device + DEVICE_ENTRIES_OFFSET);
  s.page_table = reinterpret_cast<int*>(device + DEVICE_PAGE_TABLE_OFFSET);
  s.history = reinterpret_cast<int*>(device + DEVICE_HISTORY_OFFSET);
  s.pool = reinterpret_cast<Pool*>(device + DEVICE_POOL_OFFSET);
  s.free_pages = reinterpret_cast<int*>(device + DEVICE_FREE_PAGES_OFFSET);
  s.step = reinterpret_cast<Step*>(device + DEVICE_STEP_OFFSET);
  s.chunks = reinterpret_cast<Chunk*>(device + DEVICE_CHUNKS_OFFSET);
  s.rows = reinterpret_cast<StepRow*>(device + DEVICE_ROWS_OFFSET);
  s.size = Sizes{MAX_BATCH, PAGE_SIZE, NUM_PAGES, SERVE_MAX_SEQ, MAX_TOKENS_PER_STEP, QUEUE_SLOTS, RING_RECORDS,
                 HANDLES, PAGES_PER_REQUEST};
  bind_workspace(s, workspace);
  return s;
}

}  // namespace sched

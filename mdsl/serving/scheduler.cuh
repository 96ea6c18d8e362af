// The serving scheduler (docs/design.md, "Serving"), written once for the megakernel's scheduler thread
// and for the host: its functions are __device__ under CUDA (NVRTC, nvcc) and plain inline functions
// under a host compiler, over the protocol's C structs (mdsl.serving.protocol). The CPU device's Python
// scheduler (mdsl/serving/cpu.py) is the specification; the tests run this one beside it on the CPU and
// compare their state after every step (tests/serving/test_native_scheduler.py).
//
// A caller fills a Serving (the arrays' addresses and the shape's sizes; scheduler_regions.cuh does it
// from the two regions' base addresses and the shape's constants) with a zeroed workspace of
// workspace_bytes(sizes) (bind_workspace), then at every step boundary, from one thread:
//
//   begin_step(s)          cancel, plan, pages, admit, write step/chunks/rows and the control words
//                          (plan_step), then check the page pool (check_pool, which a block's threads
//                          may share: pool_stamp, check_pool_part, pool_count)
//   (the forward)          over step->num_rows rows, when step->num_chunks > 0; its sampler writes
//                          tokens[c] for each chunk c whose sample is 1
//   end_step(s, tokens)    advance the entries that ran, take the sampled tokens: histories, records,
//                          finished entries freed
//   flush_records(s)       publish the step's records into the token ring; until it answers 0, wait for
//                          the host to read (ring_read) and call it again
//
// Each answers OK or an error (ERROR_*; State::error keeps the first and later calls answer it): the
// device then stops (status failed) and the host raises ServingError (mdsl.serving.scheduler.
// scheduler_error gives its message). A step's records are staged in the workspace and published by
// flush_records, so that no function waits for the host: a full ring leaves records staged, the caller
// waits (on a GPU, __nanosleep back-off while it checks shutdown and its stop word) and calls again. The
// forward may run while records wait; the next begin_step needs them all published.
//
// No allocation, no recursion; every loop is bounded by the shape's sizes.

#include "scheduler_base.cuh"
#include "scheduler_step.cuh"

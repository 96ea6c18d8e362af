// Programmatic dependent launch (sm_90): the GPU serving device launches each kernel of a step allowed to
// start while the kernel before it ends (gpu.py's launch), so that its blocks are already placed, its
// parameters read and, for a linear, its first weight tiles on their way when that kernel's last block
// exits. A kernel so launched must not touch what an earlier kernel of the step writes or reads until
// `step_wait` returns: it holds the thread until every earlier kernel has completed and its writes are
// visible (griddepcontrol.wait). Every kernel of the device calls it before any such access: at its first
// line, or in a linear after issuing the loads of its weights, which no kernel writes. It then lets the
// next kernel launch (griddepcontrol.launch_dependents): that kernel's blocks wait in their own `step_wait`
// while this one runs, and the one after it launches only once they are past it, so at most one kernel
// waits ahead. Before sm_90, and for a kernel launched the ordinary way, both are no-ops.

namespace mdsl_pdl {

__device__ __forceinline__ void step_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace mdsl_pdl

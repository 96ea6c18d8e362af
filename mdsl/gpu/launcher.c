/* mdsl's launcher: an executable's kernels launched in one call from Python (mdsl/gpu/launcher.py).

   Python fills one array per call, `call`: call[0] the address of the executable's Program (built once),
   call[1] the stream, call[2...] the data pointers of its arguments (inputs, then outputs). mdsl_run writes
   the pointers into the program's parameter slots, launches each kernel through the driver's own entry
   points (resolved by Python, so that this file needs no CUDA header or library) and queues the copies of
   outputs that live in another argument's buffer; a launch that cuBLAS runs (a library GEMM) is called through
   the entry point Python resolved in the cuBLAS library. Python calls it through ctypes.PyDLL: the GIL is held
   throughout, so two threads never fill the same slots at once (and Python holds the cuBLAS handle's lock
   around a program with GEMMs).

   No Python header either: only a C compiler is needed. The structures below mirror cuda.h's, under names
   of their own (a file may include both); tests/backend/cuda/test_launcher.py compares them with cuda.h
   where one is installed. */
#include <stddef.h>
#include <stdint.h>

/* MDSL_LAUNCHER_ID is defined by the build (-D): the hash of this file, which the loader checks */
#ifndef MDSL_LAUNCHER_ID
#define MDSL_LAUNCHER_ID "unversioned"
#endif

typedef int Result;   /* CUresult */

/* cuda.h's CUlaunchAttribute: an id, padding to 8 bytes, a union of 64 bytes */
typedef struct {
    int32_t id;
    int32_t pad;
    union {
        char bytes[64];
        int32_t programmatic_stream_serialization_allowed;
    } value;
} LaunchAttribute;

/* cuda.h's CUlaunchConfig */
typedef struct {
    uint32_t grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
    void *stream;
    LaunchAttribute *attrs;
    uint32_t num_attrs;
} LaunchConfig;

enum { PROGRAMMATIC_STREAM_SERIALIZATION = 6 };   /* CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION */

/* cuda.h's CUDA_KERNEL_NODE_PARAMS (its v2, CUDA 12.0's): a kernel node's launch, set anew on the instantiated
   graph before each of its launches */
typedef struct {
    void *function;
    uint32_t grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
    void **params;
    void **extra;
    void *kernel;            /* CUkernel: unused (the function is given) */
    void *context;           /* CUcontext: ignored where the function is given */
} KernelNodeParams;

typedef Result (*LaunchKernel)(void *function, uint32_t gx, uint32_t gy, uint32_t gz, uint32_t bx, uint32_t by,
                                 uint32_t bz, uint32_t shared_bytes, void *stream, void **params, void **extra);
typedef Result (*LaunchKernelEx)(const LaunchConfig *config, void *function, void **params, void **extra);
typedef Result (*MemcpyDtoDAsync)(uint64_t dst, uint64_t src, size_t bytes, void *stream);
typedef Result (*CtxGetCurrent)(void **context);
typedef Result (*GraphExecKernelNodeSetParams)(void *exec, void *node, const KernelNodeParams *params);
typedef Result (*GraphLaunch)(void *exec, void *stream);
typedef Result (*StreamIsCapturing)(void *stream, int *status);   /* status: CUstreamCaptureStatus */

/* cublas_api.h's cublasGemmEx and cublasGemmStridedBatchedEx (enums as int, cublasStatus_t as int) */
typedef int (*GemmEx)(void *handle, int transa, int transb, int m, int n, int k, const void *alpha,
                      const void *a, int a_type, int lda, const void *b, int b_type, int ldb, const void *beta,
                      void *c, int c_type, int ldc, int compute, int algo);
typedef int (*GemmStridedBatchedEx)(void *handle, int transa, int transb, int m, int n, int k, const void *alpha,
                                    const void *a, int a_type, int lda, long long stride_a, const void *b,
                                    int b_type, int ldb, long long stride_b, const void *beta, void *c, int c_type,
                                    int ldc, long long stride_c, int batch, int compute, int algo);

/* a product cuBLAS runs in a launch's place (mdsl.gpu.cublas): its call's arguments, the operands' pointers
   read from the slots when it runs. The handle's stream is the one Python set last (`handle_stream`, which
   Python updates whenever it sets one): a call on another stream is answered LIBRARY_STREAM before anything
   runs, and Python sets the stream (with its workspace) and calls again. */
typedef struct {
    uint64_t entry;          /* cublasGemmEx (batch 1) or cublasGemmStridedBatchedEx */
    uint64_t handle;         /* cublasHandle_t */
    uint64_t handle_stream;  /* const uint64_t *: the stream the handle has */
    uint64_t alpha, beta;    /* const float * */
    int64_t stride_a, stride_b, stride_c;
    int32_t transa, transb, m, n, k, a_slot, lda, b_slot, ldb, c_slot, ldc, dtype, compute, algo, batch, pad;
} Gemm;

/* one kernel launch: everything but the stream, fixed when the executable is loaded; or, with `gemm`, the
   product cuBLAS runs in its place */
typedef struct {
    uint64_t function;       /* CUfunction */
    uint32_t grid[3];
    uint32_t block[3];
    uint32_t shared_bytes;
    uint32_t overlap;        /* 1: launched with programmatic stream serialization (cuLaunchKernelEx) */
    uint64_t params;         /* void **: one pointer per kernel parameter, into the slots */
    uint64_t gemm;           /* const Gemm *, or 0: a kernel */
} Launch;

/* an output whose value lives in another argument's buffer: copied after the launches */
typedef struct {
    int64_t dst, src;        /* argument indices */
    uint64_t bytes;
} Copy;

typedef struct {
    /* the driver's entry points */
    uint64_t launch_kernel, launch_kernel_ex, memcpy_async, ctx_get_current;
    uint64_t context;        /* CUcontext the launches need current */
    uint64_t *slots;         /* the values the parameter blocks point at */
    int64_t n_bindings;
    const int64_t *bindings; /* n_bindings pairs (slot, argument index) */
    int64_t n_launches;
    const Launch *launches;
    int64_t n_copies;
    const Copy *copies;
    /* with `graph`: the launches (kernels only) as one instantiated CUDA graph, a kernel node per launch in
       `nodes`, whose parameters are set from the slots before the graph is launched: one launch of the
       driver for the program, where launching each kernel costs the host a launch each (on a stream that is
       not being captured: a graph launch is no node of a caller's capture) */
    uint64_t graph_set_params, graph_launch, stream_is_capturing;
    uint64_t graph;          /* CUgraphExec, or 0 */
    const uint64_t *nodes;   /* n_launches CUgraphNodes */
} Program;

/* what mdsl_run and mdsl_run_graph return besides 0 (success) and a positive CUresult (the failing call's); a
   cuBLAS call's failure is LIBRARY_FAILED - its cublasStatus_t */
enum { WRONG_CONTEXT = -1, LIBRARY_STREAM = -2, CAPTURING = -3, LIBRARY_FAILED = -1000 };

const char *mdsl_launcher_id(void) { return MDSL_LAUNCHER_ID; }

int64_t mdsl_launcher_sizes(int64_t which) {
    switch (which) {   /* the layouts Python builds, checked when the library is loaded */
    case 0: return sizeof(Launch);
    case 1: return sizeof(Copy);
    case 2: return sizeof(Program);
    case 3: return sizeof(LaunchConfig);
    case 4: return sizeof(LaunchAttribute);
    case 5: return sizeof(Gemm);
    case 6: return sizeof(KernelNodeParams);
    default: return -1;
    }
}

int64_t mdsl_run(const uint64_t *call) {
    const Program *p = (const Program *)(uintptr_t)call[0];
    void *stream = (void *)(uintptr_t)call[1];
    const uint64_t *args = call + 2;
    void *current = NULL;
    Result err = ((CtxGetCurrent)(uintptr_t)p->ctx_get_current)(&current);
    if (err) return err;
    if ((uint64_t)(uintptr_t)current != p->context) return WRONG_CONTEXT;   /* Python makes it current, calls again */
    for (int64_t i = 0; i < p->n_launches; i++) {
        const Gemm *g = (const Gemm *)(uintptr_t)p->launches[i].gemm;
        if (g && *(const uint64_t *)(uintptr_t)g->handle_stream != call[1]) return LIBRARY_STREAM;
    }
    for (int64_t i = 0; i < p->n_bindings; i++)
        p->slots[p->bindings[2 * i]] = args[p->bindings[2 * i + 1]];
    int graphed = p->graph != 0;
    if (graphed) {   /* a stream being captured into a graph of the caller's takes the kernels one by one */
        int status = 1;
        graphed = !((StreamIsCapturing)(uintptr_t)p->stream_is_capturing)(stream, &status) && status == 0;
    }
    if (graphed) {   /* the driver reads each node's parameters (the slots' values) as they are set */
        void *graph = (void *)(uintptr_t)p->graph;
        for (int64_t i = 0; i < p->n_launches; i++) {
            const Launch *l = &p->launches[i];
            KernelNodeParams node = {(void *)(uintptr_t)l->function, l->grid[0], l->grid[1], l->grid[2], l->block[0],
                                     l->block[1], l->block[2], l->shared_bytes, (void **)(uintptr_t)l->params, NULL,
                                     NULL, NULL};
            err = ((GraphExecKernelNodeSetParams)(uintptr_t)p->graph_set_params)(graph, (void *)(uintptr_t)p->nodes[i],
                                                                                 &node);
            if (err) return err;
        }
        err = ((GraphLaunch)(uintptr_t)p->graph_launch)(graph, stream);
        if (err) return err;
    } else for (int64_t i = 0; i < p->n_launches; i++) {
        const Launch *l = &p->launches[i];
        if (l->gemm) {
            const Gemm *g = (const Gemm *)(uintptr_t)l->gemm;
            void *handle = (void *)(uintptr_t)g->handle;
            const void *alpha = (const void *)(uintptr_t)g->alpha, *beta = (const void *)(uintptr_t)g->beta;
            const void *a = (const void *)(uintptr_t)p->slots[g->a_slot], *b = (const void *)(uintptr_t)p->slots[g->b_slot];
            void *c = (void *)(uintptr_t)p->slots[g->c_slot];
            int status = g->batch == 1
                ? ((GemmEx)(uintptr_t)g->entry)(handle, g->transa, g->transb, g->m, g->n, g->k, alpha, a, g->dtype,
                                                 g->lda, b, g->dtype, g->ldb, beta, c, g->dtype, g->ldc, g->compute,
                                                 g->algo)
                : ((GemmStridedBatchedEx)(uintptr_t)g->entry)(handle, g->transa, g->transb, g->m, g->n, g->k, alpha,
                                                               a, g->dtype, g->lda, g->stride_a, b, g->dtype, g->ldb,
                                                               g->stride_b, beta, c, g->dtype, g->ldc, g->stride_c,
                                                               g->batch, g->compute, g->algo);
            if (status) return LIBRARY_FAILED - status;
            continue;
        }
        void *function = (void *)(uintptr_t)l->function;
        void **params = (void **)(uintptr_t)l->params;
        if (!l->overlap) {
            err = ((LaunchKernel)(uintptr_t)p->launch_kernel)(function, l->grid[0], l->grid[1], l->grid[2],
                                                              l->block[0], l->block[1], l->block[2],
                                                              l->shared_bytes, stream, params, NULL);
        } else {   /* may start while the stream's previous kernel runs, once that one lets it */
            LaunchAttribute attribute = {PROGRAMMATIC_STREAM_SERIALIZATION, 0, {{0}}};
            attribute.value.programmatic_stream_serialization_allowed = 1;
            LaunchConfig config = {l->grid[0], l->grid[1], l->grid[2], l->block[0], l->block[1], l->block[2],
                                   l->shared_bytes, stream, &attribute, 1};
            err = ((LaunchKernelEx)(uintptr_t)p->launch_kernel_ex)(&config, function, params, NULL);
        }
        if (err) return err;
    }
    for (int64_t i = 0; i < p->n_copies; i++) {
        const Copy *c = &p->copies[i];
        err = ((MemcpyDtoDAsync)(uintptr_t)p->memcpy_async)(args[c->dst], args[c->src], c->bytes, stream);
        if (err) return err;
    }
    return 0;
}

/* the whole program captured for one stream and one set of pointers (`exec`, a CUgraphExec: the executable's
   graphs by pointers, mdsl.gpu.executable) launched as it is, on call[1]: one launch of the driver where
   cuBLAS's GEMMs cost the host tens of µs each. CAPTURING, having launched nothing, where that stream is being
   captured into a graph of the caller's (Python runs the program instead: its launches join that capture). */
int64_t mdsl_run_graph(const uint64_t *call, uint64_t exec) {
    const Program *p = (const Program *)(uintptr_t)call[0];
    void *stream = (void *)(uintptr_t)call[1];
    void *current = NULL;
    Result err = ((CtxGetCurrent)(uintptr_t)p->ctx_get_current)(&current);
    if (err) return err;
    if ((uint64_t)(uintptr_t)current != p->context) return WRONG_CONTEXT;
    int status = 1;
    err = ((StreamIsCapturing)(uintptr_t)p->stream_is_capturing)(stream, &status);
    if (err) return err;
    if (status) return CAPTURING;
    return ((GraphLaunch)(uintptr_t)p->graph_launch)((void *)(uintptr_t)exec, stream);
}

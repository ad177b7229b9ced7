/*
 * capture.c: a plan's pieces launched as one CUDA graph (MUCUDNN_CUDA_GRAPHS, on by default).
 *
 * A plan turns one convolution into many small calls of a few kernels each, and the GPU spends
 * about a microsecond between any two kernels it is handed one by one: 4.4 ms per training step
 * for VGG-16's plan (benchmarks/results/shim-pytorch-h200.md). Kernels of one CUDA graph start
 * closer together. From a plan entry's second call on, its pieces are captured once on a stream of
 * the shim's own (cuDNN's handle pointed at it for the capture, then back) and the graph is
 * launched on the caller's stream: same kernels, same order, same arguments, so the same results.
 *
 * A graph bakes in its pointers and scalars, so each owner keeps a few graphs keyed by the call's
 * handle, CUDA context, pointers, workspace and alpha/beta (a training loop passes the same ones
 * step after step); a call with other ones is captured anew, replacing the oldest. A graph never
 * outlives what it captured: graph-API piece plans own the graphs that launch them and destroy
 * them when the framework destroys its execution plan, and cudnnDestroy destroys every graph
 * captured with that handle. Captured work does not run, so a
 * capture that fails (a piece's error, or cuDNN doing something a capture cannot hold) is
 * discarded and the pieces run one by one, then and for that entry from then on. Nothing is
 * captured when the caller's stream is itself being captured (the caller's graph takes the pieces
 * as they are) or when the CUDA driver is not in the process (the cuDNN test double).
 *
 * The driver API is the libcuda.so.1 the CUDA runtime loaded (never loaded here), reached
 * through driver.c.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static const mu_driver_table *driver; /* with every capture function: set once, by graphs_available */

static void resolve_driver(void) {
    const mu_driver_table *d = mu_driver();
    if (d == NULL) {
        mu_log(MU_LOG_INFO, "CUDA graphs off: the CUDA driver (libcuda.so.1) is not loaded");
        return;
    }
    if (d->ctx_get_current && d->stream_create && d->stream_is_capturing && d->begin_capture &&
        d->end_capture && d->instantiate && d->launch && d->exec_destroy && d->graph_destroy)
        driver = d;
    else
        mu_log(MU_LOG_INFO, "CUDA graphs off: the CUDA driver lacks stream capture");
}

/* Set when the driver refuses to begin a capture at all: graphs are then off for the process. */
static atomic_bool capture_unsupported;

static bool graphs_available(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (!mu_option_int(MU_OPT_CUDA_GRAPHS)) return false;
    pthread_once(&once, resolve_driver);
    return driver != NULL && !atomic_load(&capture_unsupported);
}

/* This thread's capture stream in the current context (a thread captures on its own stream). */
static CUstream capture_stream(void) {
    enum { CONTEXTS = 8 };
    static _Thread_local struct {
        CUcontext context;
        CUstream stream;
    } streams[CONTEXTS];
    CUcontext context = NULL;
    if (driver->ctx_get_current(&context) != CU_SUCCESS || context == NULL) return NULL;
    for (int i = 0; i < CONTEXTS; i++) {
        if (streams[i].context == context) return streams[i].stream;
        if (streams[i].context == NULL) {
            CUstream stream = NULL;
            if (driver->stream_create(&stream, CU_STREAM_NON_BLOCKING) != CU_SUCCESS) return NULL;
            streams[i].context = context, streams[i].stream = stream;
            return stream;
        }
    }
    return NULL;
}

typedef struct {
    bool used;
    mu_capture_key key;
    CUgraphExec exec;
} mu_graph_slot;

/* One owner's graphs. Every cache is also on the registry list, so that a destroyed handle's
 * graphs can be found in all of them. Lock order: registry_mutex, then a cache's mutex. */
struct mu_graph_cache {
    pthread_mutex_t mutex;
    unsigned long calls;
    bool refused;   /* a capture failed: this owner's pieces run one by one from now on */
    bool announced; /* the first capture was logged */
    int oldest;     /* the slot a new graph replaces when all are used */
    mu_graph_slot slots[MU_GRAPHS_PER_ENTRY];
    struct mu_graph_cache *prev, *next;
};

static pthread_mutex_t registry_mutex = PTHREAD_MUTEX_INITIALIZER;
static struct mu_graph_cache *registry;

static struct mu_graph_cache *owner_graphs(mu_graph_owner *owner) {
    struct mu_graph_cache *cache = atomic_load_explicit(owner, memory_order_acquire);
    if (cache != NULL) return cache;
    pthread_mutex_lock(&registry_mutex);
    cache = atomic_load_explicit(owner, memory_order_acquire);
    if (cache == NULL && (cache = calloc(1, sizeof *cache)) != NULL) {
        pthread_mutex_init(&cache->mutex, NULL);
        cache->next = registry;
        if (registry != NULL) registry->prev = cache;
        registry = cache;
        atomic_store_explicit(owner, cache, memory_order_release);
    }
    pthread_mutex_unlock(&registry_mutex);
    return cache;
}

static void destroy_slot(mu_graph_slot *slot) {
    if (slot->used) driver->exec_destroy(slot->exec); /* launches in flight complete first */
    *slot = (mu_graph_slot){0};
}

void mu_graphs_release(mu_graph_owner *owner) {
    pthread_mutex_lock(&registry_mutex);
    struct mu_graph_cache *cache = atomic_exchange(owner, NULL);
    if (cache != NULL) {
        if (cache->prev != NULL) cache->prev->next = cache->next;
        else registry = cache->next;
        if (cache->next != NULL) cache->next->prev = cache->prev;
    }
    pthread_mutex_unlock(&registry_mutex);
    if (cache == NULL) return;
    pthread_mutex_lock(&cache->mutex);
    for (int i = 0; i < MU_GRAPHS_PER_ENTRY; i++) destroy_slot(&cache->slots[i]);
    pthread_mutex_unlock(&cache->mutex);
    pthread_mutex_destroy(&cache->mutex);
    free(cache);
}

void mu_graphs_forget_handle(cudnnHandle_t handle) {
    int destroyed = 0;
    pthread_mutex_lock(&registry_mutex);
    for (struct mu_graph_cache *cache = registry; cache != NULL; cache = cache->next) {
        pthread_mutex_lock(&cache->mutex);
        for (int i = 0; i < MU_GRAPHS_PER_ENTRY; i++)
            if (cache->slots[i].used && cache->slots[i].key.handle == (uintptr_t)handle)
                destroy_slot(&cache->slots[i]), destroyed++;
        pthread_mutex_unlock(&cache->mutex);
    }
    pthread_mutex_unlock(&registry_mutex);
    if (destroyed > 0)
        mu_log(MU_LOG_DEBUG, "handle %p destroyed: %d CUDA graphs captured with it destroyed", (void *)handle,
               destroyed);
}

static mu_graph_slot *find_slot(struct mu_graph_cache *cache, const mu_capture_key *key) {
    for (int i = 0; i < MU_GRAPHS_PER_ENTRY; i++)
        if (cache->slots[i].used && memcmp(&cache->slots[i].key, key, sizeof *key) == 0) return &cache->slots[i];
    return NULL;
}

/* Captures run(context) on this thread's stream; NULL (and why) if the capture cannot be used. */
static CUgraphExec capture(cudnnHandle_t handle, cudaStream_t caller, mu_pieces_fn run, void *context,
                           const char **why) {
    const mu_real_table *real = mu_real();
    CUstream stream = capture_stream();
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    if (stream == NULL) return *why = "no capture stream", NULL;
    CUresult begun = driver->begin_capture(stream, CU_STREAM_CAPTURE_MODE_RELAXED);
    if (begun != CU_SUCCESS) {
        if (!atomic_exchange(&capture_unsupported, true))
            mu_log(MU_LOG_INFO, "CUDA graphs off: the CUDA driver cannot begin a stream capture "
                   "(CUresult %d)", begun);
        return *why = NULL, NULL;
    }
    cudnnStatus_t set = real->cudnnSetStream(handle, (cudaStream_t)stream);
    if (set == CUDNN_STATUS_SUCCESS) status = run(context);
    real->cudnnSetStream(handle, caller);
    CUgraph graph = NULL;
    CUresult ended = driver->end_capture(stream, &graph);
    CUgraphExec exec = NULL;
    if (set != CUDNN_STATUS_SUCCESS) *why = "cannot point the handle at the capture stream";
    else if (status != CUDNN_STATUS_SUCCESS) *why = "a piece failed while captured";
    else if (ended != CU_SUCCESS || graph == NULL) *why = "cuDNN did something a capture cannot hold";
    else if (driver->instantiate(&exec, graph, 0) != CU_SUCCESS) exec = NULL, *why = "cannot instantiate the graph";
    if (graph != NULL) driver->graph_destroy(graph);
    if (exec == NULL && driver->runtime_get_last_error != NULL) driver->runtime_get_last_error();
    return exec;
}

cudnnStatus_t mu_run_captured(const mu_plan_entry *entry, mu_graph_owner *owner, cudnnHandle_t handle,
                              const mu_capture_key *call_key, mu_pieces_fn run, void *context) {
    if (!graphs_available()) return run(context);
    struct mu_graph_cache *cache = owner_graphs(owner);
    cudaStream_t caller = NULL;
    CUcontext cu_context = NULL;
    int capturing = CU_STREAM_CAPTURE_STATUS_NONE;
    if (cache == NULL || mu_real()->cudnnGetStream(handle, &caller) != CUDNN_STATUS_SUCCESS ||
        driver->ctx_get_current(&cu_context) != CU_SUCCESS ||
        driver->stream_is_capturing((CUstream)caller, &capturing) != CU_SUCCESS ||
        capturing != CU_STREAM_CAPTURE_STATUS_NONE)
        return run(context);
    mu_capture_key key = *call_key;
    key.handle = (uintptr_t)handle, key.context = (uintptr_t)cu_context;
    pthread_mutex_lock(&cache->mutex);
    /* The first call runs as it is: lazy module loading and cuDNN's own first-use work happen
     * outside any capture. */
    if (cache->refused || cache->calls++ == 0) {
        pthread_mutex_unlock(&cache->mutex);
        return run(context);
    }
    mu_graph_slot *slot = find_slot(cache, &key);
    if (slot == NULL) {
        const char *why = NULL;
        CUgraphExec exec = capture(handle, caller, run, context, &why);
        if (exec == NULL && why == NULL) { /* the driver cannot capture: nothing to say per entry */
            pthread_mutex_unlock(&cache->mutex);
            return run(context);
        }
        if (exec == NULL) {
            cache->refused = true;
            pthread_mutex_unlock(&cache->mutex);
            mu_log(MU_LOG_WARNING, "%s N=%d: cannot run the pieces as a CUDA graph (%s); running them "
                   "one by one", entry->key, entry->n, why);
            return run(context); /* captured work never ran: run it now */
        }
        slot = &cache->slots[cache->oldest];
        destroy_slot(slot);
        *slot = (mu_graph_slot){.used = true, .key = key, .exec = exec};
        cache->oldest = (cache->oldest + 1) % MU_GRAPHS_PER_ENTRY;
        if (!cache->announced)
            mu_log(MU_LOG_INFO, "%s N=%d: pieces run as one CUDA graph", entry->key, entry->n);
        else
            mu_log(MU_LOG_DEBUG, "%s N=%d: pieces captured again (other pointers)", entry->key, entry->n);
        cache->announced = true;
    }
    CUresult launched = driver->launch(slot->exec, (CUstream)caller);
    pthread_mutex_unlock(&cache->mutex);
    if (launched != CU_SUCCESS) {
        static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
        mu_log_limited(&limit, MU_LOG_WARNING, "%s N=%d: cannot launch its CUDA graph (CUresult %d); "
                       "running the pieces one by one", entry->key, entry->n, launched);
        return run(context);
    }
    return CUDNN_STATUS_SUCCESS;
}

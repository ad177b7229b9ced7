/*
 * lend.c: workspace a framework lends to the convolutions it runs next (mucudnn_lend_workspace,
 * docs/shim.md "Lent workspace").
 *
 * Under a memory budget online tuning holds each engine's workspace (MUCUDNN_WORKSPACE_HOLD): the
 * framework allocates the held size and the online front's fastest point within it runs. A step
 * has room at some of its points and none at others (mucudnn.torch's plan knows which), so one
 * share for every convolution is either too small where there is room or too large where there is
 * none. Where there is room, the framework allocates a buffer and lends it; a held convolution
 * then runs its front's fastest point within the buffer, where that is faster than its held point.
 *
 * Invariants:
 * 1. One lend at a time, the process's: a lend replaces the last; (NULL, 0) withdraws it.
 * 2. Only convolutions run by the lending thread on the lent stream use it. The framework
 *    withdraws the buffer on that thread before freeing it, so every use was enqueued on that
 *    stream before the free (a caching allocator's reuse is ordered on the stream).
 * 3. A lend changes which of the kernel's measured points runs, never what it computes: a point
 *    of the kernel's own online front, deterministic where the framework's engine is, and the
 *    held point where no point within the buffer is MU_LENT_GAIN faster.
 * 4. The hot path without a lend is one relaxed load.
 */
#include <pthread.h>

#include "internal.h"

static struct {
    pthread_mutex_t mutex;
    void *ptr;
    size_t bytes;
    cudaStream_t stream;
    pthread_t thread;
} lend = {.mutex = PTHREAD_MUTEX_INITIALIZER};
static atomic_bool lent;
static atomic_size_t largest_held, lent_calls;

MU_EXPORT int mucudnn_lend_workspace(void *ptr, size_t bytes, cudaStream_t stream) {
    pthread_mutex_lock(&lend.mutex);
    bool on = ptr != NULL && bytes > 0;
    lend.ptr = on ? ptr : NULL;
    lend.bytes = on ? bytes : 0;
    lend.stream = stream;
    lend.thread = pthread_self();
    atomic_store(&lent, on);
    pthread_mutex_unlock(&lend.mutex);
    return 0;
}

MU_EXPORT size_t mucudnn_held_workspace(void) { return atomic_load(&largest_held); }

MU_EXPORT size_t mucudnn_lent_calls(void) { return atomic_load(&lent_calls); }

void mu_lend_note_held(size_t engine_workspace) {
    size_t seen = atomic_load(&largest_held);
    while (engine_workspace > seen && !atomic_compare_exchange_weak(&largest_held, &seen, engine_workspace)) {
    }
}

bool mu_lent_workspace(cudnnHandle_t handle, size_t more_than, void **ptr, size_t *bytes) {
    if (!atomic_load_explicit(&lent, memory_order_relaxed)) return false;
    cudaStream_t stream = NULL;
    if (mu_real()->cudnnGetStream(handle, &stream) != CUDNN_STATUS_SUCCESS) return false;
    pthread_mutex_lock(&lend.mutex);
    bool usable = lend.ptr != NULL && lend.bytes > more_than && lend.stream == stream &&
                  pthread_equal(lend.thread, pthread_self());
    if (usable) *ptr = lend.ptr, *bytes = lend.bytes;
    pthread_mutex_unlock(&lend.mutex);
    return usable;
}

void mu_lend_count_call(mu_seen *seen, const mu_plan_entry *held, const mu_plan_entry *point) {
    atomic_fetch_add(&lent_calls, 1);
    if (seen != NULL && !atomic_exchange(&seen->lent, true))
        mu_log(MU_LOG_INFO, "%s N=%d: runs a point of %zu bytes of workspace in lent workspace (%.4f ms, the "
               "held point's %zu bytes %.4f ms)", seen->key, seen->n, point->workspace, point->time_ms,
               held->workspace, held->time_ms);
}

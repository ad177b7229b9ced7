/*
 * exec.c: cudnnConvolution{Forward,BackwardData,BackwardFilter} run as a plan's micro-batches.
 *
 * The pieces run in order on consecutive slices along N, each with its own algorithm and math
 * type, in the caller's workspace, on the caller's handle (so its stream), without synchronising
 * and without allocating device memory: the micro-batch descriptors are created once per plan
 * entry. From an entry's second call on they run as one CUDA graph (capture.c).
 *
 * A borrowing piece (":out", forward and backward-data) takes as its workspace the part of the
 * output tensor after its own slice: the later pieces overwrite it, and with beta = 0 nothing
 * there is read. Such a plan runs only when beta is 0 and every borrowing piece fits its room.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>

#include "internal.h"

/* Descriptors of one plan entry's pieces, and the byte distance between samples. */
typedef struct mu_exec_cache {
    cudnnTensorDescriptor_t *x_descs;        /* per piece: N = b, the caller's strides */
    cudnnTensorDescriptor_t *y_descs;
    cudnnConvolutionDescriptor_t *conv_descs; /* per piece: the caller's geometry, the piece's math */
    size_t *legacy_workspace;                 /* per borrowing legacy piece: what it needs */
    size_t x_sample_bytes;
    size_t y_sample_bytes;
} mu_exec_cache;

/* Where a borrowing piece's workspace starts in the output: aligned as cuDNN's allocations are. */
#define MU_BORROW_ALIGNMENT 256

static pthread_mutex_t cache_mutex = PTHREAD_MUTEX_INITIALIZER;

static cudnnStatus_t sliced_tensor(const mu_kernel *k, const int dims[], const int strides[],
                                   int batch, cudnnTensorDescriptor_t *desc) {
    const mu_real_table *real = mu_real();
    int sliced[MU_MAX_DIMS];
    for (int i = 0; i < k->nb_dims; i++) sliced[i] = dims[i];
    sliced[0] = batch;
    cudnnStatus_t status = real->cudnnCreateTensorDescriptor(desc);
    if (status == CUDNN_STATUS_SUCCESS)
        status = real->cudnnSetTensorNdDescriptor(*desc, k->dtype, k->nb_dims, sliced, strides);
    return status;
}

/* A copy of the caller's convolution descriptor with another math type (the caller's stays as is). */
static cudnnStatus_t piece_convolution(cudnnConvolutionDescriptor_t caller, cudnnMathType_t math,
                                       cudnnConvolutionDescriptor_t *desc) {
    const mu_real_table *real = mu_real();
    int spatial, pad[MU_MAX_DIMS], stride[MU_MAX_DIMS], dilation[MU_MAX_DIMS], groups;
    cudnnConvolutionMode_t mode;
    cudnnDataType_t compute_type;
    cudnnReorderType_t reorder = CUDNN_DEFAULT_REORDER;
    cudnnStatus_t status = real->cudnnGetConvolutionNdDescriptor(
        caller, MU_MAX_DIMS - 2, &spatial, pad, stride, dilation, &mode, &compute_type);
    if (status == CUDNN_STATUS_SUCCESS) status = real->cudnnGetConvolutionGroupCount(caller, &groups);
    if (status == CUDNN_STATUS_SUCCESS && real->cudnnGetConvolutionReorderType != NULL)
        status = real->cudnnGetConvolutionReorderType(caller, &reorder);
    if (status == CUDNN_STATUS_SUCCESS) status = real->cudnnCreateConvolutionDescriptor(desc);
    if (status == CUDNN_STATUS_SUCCESS)
        status = real->cudnnSetConvolutionNdDescriptor(*desc, spatial, pad, stride, dilation, mode,
                                                       compute_type);
    if (status == CUDNN_STATUS_SUCCESS) status = real->cudnnSetConvolutionGroupCount(*desc, groups);
    if (status == CUDNN_STATUS_SUCCESS && reorder != CUDNN_DEFAULT_REORDER &&
        real->cudnnSetConvolutionReorderType != NULL)
        status = real->cudnnSetConvolutionReorderType(*desc, reorder);
    if (status == CUDNN_STATUS_SUCCESS) status = real->cudnnSetConvolutionMathType(*desc, math);
    return status;
}

static void destroy_cache(mu_exec_cache *cache, int pieces) {
    const mu_real_table *real = mu_real();
    for (int i = 0; i < pieces; i++) {
        if (cache->x_descs && cache->x_descs[i]) real->cudnnDestroyTensorDescriptor(cache->x_descs[i]);
        if (cache->y_descs && cache->y_descs[i]) real->cudnnDestroyTensorDescriptor(cache->y_descs[i]);
        if (cache->conv_descs && cache->conv_descs[i])
            real->cudnnDestroyConvolutionDescriptor(cache->conv_descs[i]);
    }
    free(cache->x_descs);
    free(cache->y_descs);
    free(cache->conv_descs);
    free(cache->legacy_workspace);
    free(cache);
}

/* The descriptors of piece i in forward terms: its slices, the caller's filter, its convolution. */
static mu_conv_descs piece_descs(const mu_conv_call *call, const mu_exec_cache *cache, int i) {
    return (mu_conv_descs){call->descs.dir, cache->x_descs[i], call->descs.w, cache->conv_descs[i],
                           cache->y_descs[i]};
}

static mu_exec_cache *create_cache(const mu_plan_entry *entry, const mu_kernel *k,
                                   const mu_conv_call *call, cudnnStatus_t *status) {
    mu_exec_cache *cache = calloc(1, sizeof *cache);
    size_t pieces = (size_t)entry->piece_count;
    *status = CUDNN_STATUS_ALLOC_FAILED;
    if (cache == NULL) return NULL;
    cache->x_descs = calloc(pieces, sizeof *cache->x_descs);
    cache->y_descs = calloc(pieces, sizeof *cache->y_descs);
    cache->conv_descs = calloc(pieces, sizeof *cache->conv_descs);
    cache->legacy_workspace = calloc(pieces, sizeof *cache->legacy_workspace);
    if (cache->x_descs && cache->y_descs && cache->conv_descs && cache->legacy_workspace)
        *status = CUDNN_STATUS_SUCCESS;
    for (size_t i = 0; i < pieces && *status == CUDNN_STATUS_SUCCESS; i++) {
        const mu_piece *piece = &entry->pieces[i];
        *status = sliced_tensor(k, k->x_dims, k->x_strides, piece->batch, &cache->x_descs[i]);
        if (*status == CUDNN_STATUS_SUCCESS)
            *status = sliced_tensor(k, k->y_dims, k->y_strides, piece->batch, &cache->y_descs[i]);
        if (*status == CUDNN_STATUS_SUCCESS)
            *status = piece_convolution(call->descs.conv, piece->math, &cache->conv_descs[i]);
        if (*status == CUDNN_STATUS_SUCCESS && piece->borrow && piece->engine == NULL)
        {
            mu_conv_descs descs = piece_descs(call, cache, (int)i);
            *status = mu_workspace_of(call->handle, &descs, piece->algo, &cache->legacy_workspace[i]);
        }
    }
    if (*status != CUDNN_STATUS_SUCCESS) {
        destroy_cache(cache, entry->piece_count);
        return NULL;
    }
    size_t element = mu_dtype_size(k->dtype);
    cache->x_sample_bytes = (size_t)k->x_strides[0] * element;
    cache->y_sample_bytes = (size_t)k->y_strides[0] * element;
    return cache;
}

/* The entry's cache, created by the first caller (double-checked under a mutex). */
static mu_exec_cache *entry_cache(mu_plan_entry *entry, const mu_kernel *k, const mu_conv_call *call,
                                  cudnnStatus_t *status) {
    mu_exec_cache *cache = atomic_load_explicit(&entry->cache, memory_order_acquire);
    *status = CUDNN_STATUS_SUCCESS;
    if (cache != NULL) return cache;
    pthread_mutex_lock(&cache_mutex);
    cache = atomic_load_explicit(&entry->cache, memory_order_acquire);
    if (cache == NULL) {
        cache = create_cache(entry, k, call, status);
        if (cache != NULL) atomic_store_explicit(&entry->cache, cache, memory_order_release);
    }
    pthread_mutex_unlock(&cache_mutex);
    return cache;
}

/* A workspace: the caller's, or a borrowed part of the output. */
typedef struct {
    void *ptr;
    size_t size;
} mu_workspace;

/* One real cudnnConvolution* call of the call's direction, with these descriptors and pointers. */
static cudnnStatus_t run_real(const mu_conv_call *call, const mu_conv_descs *descs, void *x, void *y, int algo,
                              const void *beta, mu_workspace ws) {
    mu_conv_buffers buffers = {x, call->w, y};
    return mu_dir(call->descs.dir)->run(call->handle, descs, &buffers, algo, call->alpha, beta, ws.ptr, ws.size);
}

static mu_workspace callers_workspace(const mu_conv_call *call) {
    return (mu_workspace){call->workspace, call->workspace_size};
}

static cudnnStatus_t run_undivided(const mu_conv_call *call) {
    return run_real(call, &call->descs, call->x, call->y, call->algo, call->beta, callers_workspace(call));
}

/* What piece i may borrow: the output after the first `done` samples (its own slice included),
 * from an aligned start to the end of the tensor. */
static mu_workspace borrowed_room(const mu_plan_entry *entry, const mu_exec_cache *cache,
                                  const mu_conv_call *call, int done) {
    bool fwd = call->descs.dir == MU_DIR_FWD;
    size_t sample = fwd ? cache->y_sample_bytes : cache->x_sample_bytes;
    uintptr_t start = (uintptr_t)(fwd ? call->y : call->x) + (size_t)done * sample;
    uintptr_t end = (uintptr_t)(fwd ? call->y : call->x) + (size_t)entry->n * sample;
    uintptr_t aligned = (start + MU_BORROW_ALIGNMENT - 1) & ~(uintptr_t)(MU_BORROW_ALIGNMENT - 1);
    return aligned < end ? (mu_workspace){(void *)aligned, end - aligned} : (mu_workspace){NULL, 0};
}

static size_t piece_workspace(const mu_plan_entry *entry, const mu_exec_cache *cache,
                              const mu_conv_call *call, int i) {
    return entry->pieces[i].engine != NULL ? mu_g_piece_workspace(call->graph, i) : cache->legacy_workspace[i];
}

/* NULL if the entry's borrowing pieces can run in this call, else why not. */
static const char *borrow_refusal(const mu_plan_entry *entry, const mu_kernel *k,
                                  const mu_exec_cache *cache, const mu_conv_call *call, char *why,
                                  size_t size) {
    if (call->beta == NULL || mu_scale_value(call->beta, k->dtype) != 0.0) /* NULL: cuDNN reports it */
        return "beta is not 0: the plan borrows the output as workspace";
    int done = 0;
    for (int i = 0; i < entry->piece_count; i++) {
        done += entry->pieces[i].batch;
        if (!entry->pieces[i].borrow) continue;
        size_t need = piece_workspace(entry, cache, call, i);
        mu_workspace room = borrowed_room(entry, cache, call, done);
        if (need > room.size) {
            snprintf(why, size, "piece %d needs %zu bytes of workspace, the output after it has %zu",
                     i + 1, need, room.size);
            return why;
        }
    }
    return NULL;
}

/* Failures cuDNN reports while checking arguments, before it touches any output. */
static bool failed_before_writing(cudnnStatus_t status) {
    return status / 1000 == CUDNN_STATUS_BAD_PARAM / 1000 ||
           status / 1000 == CUDNN_STATUS_NOT_SUPPORTED / 1000;
}

/*
 * Runs the pieces. Forward and backward-data write disjoint slices with the caller's alpha and
 * beta; backward-filter accumulates every piece into dw, so only the first uses the caller's
 * beta and the others beta = 1.
 */
static cudnnStatus_t run_pieces(mu_plan_entry *entry, const mu_kernel *k, const mu_exec_cache *cache,
                                const mu_conv_call *call, int *failed_piece) {
    static const float one_float = 1.0f;
    static const double one_double = 1.0;
    const void *one = k->dtype == CUDNN_DATA_DOUBLE ? (const void *)&one_double : (const void *)&one_float;
    char *x = call->x, *y = call->y;
    int done = 0;
    for (int i = 0; i < entry->piece_count; i++) {
        const mu_piece *piece = &entry->pieces[i];
        const void *beta = call->descs.dir == MU_DIR_BWD_FILTER && i > 0 ? one : call->beta;
        done += piece->batch;
        mu_workspace ws = piece->borrow ? borrowed_room(entry, cache, call, done) : callers_workspace(call);
        if (mu_log_enabled(MU_LOG_DEBUG))
            mu_log(MU_LOG_DEBUG, "%s N=%d piece %d/%d: b=%d algo=%s math=%s", entry->key, entry->n,
                   i + 1, entry->piece_count, piece->batch,
                   piece->engine ? "(graph engine)" : mu_algo_name(entry->dir, piece->algo),
                   mu_math_name(piece->math));
        mu_conv_descs descs = piece_descs(call, cache, i);
        cudnnStatus_t status =
            piece->engine != NULL /* the piece's graph plan has its beta built in */
                ? mu_g_run_engine_piece(call->graph, call->handle, i, x, call->w, y, ws.ptr)
                : run_real(call, &descs, x, y, piece->algo, beta, ws);
        if (status != CUDNN_STATUS_SUCCESS) {
            *failed_piece = i;
            return status;
        }
        x += (size_t)piece->batch * cache->x_sample_bytes;
        y += (size_t)piece->batch * cache->y_sample_bytes;
    }
    return CUDNN_STATUS_SUCCESS;
}

/* run_pieces as a mu_pieces_fn (capture.c runs it directly or under a capture). */
typedef struct {
    mu_plan_entry *entry;
    const mu_kernel *k;
    const mu_exec_cache *cache;
    const mu_conv_call *call;
    int failed_piece;
} pieces_run;

static cudnnStatus_t run_pieces_now(void *context) {
    pieces_run *run = context;
    run->failed_piece = -1;
    return run_pieces(run->entry, run->k, run->cache, run->call, &run->failed_piece);
}

/* A scale in a capture key (NULL: cuDNN reports it, so the key only needs to be stable). */
static double key_scale(const void *scale, cudnnDataType_t dtype) {
    return scale != NULL ? mu_scale_value(scale, dtype) : -0.0;
}

static void log_first_call(mu_seen *seen, const mu_kernel *k, const char *how) {
    if (seen == NULL || !mu_log_enabled(MU_LOG_INFO)) return;
    if (atomic_exchange(&seen->first_call_logged, true)) return;
    mu_log(MU_LOG_INFO, "%s N=%d: %s", k->key, k->n, how);
}

static cudnnStatus_t passthrough(const mu_conv_call *call, mu_seen *seen, const mu_kernel *k,
                                 const char *reason) {
    if (seen != NULL) {
        atomic_fetch_add(&seen->passthrough_calls, 1);
        char how[MU_KEY_MAX];
        snprintf(how, sizeof how, "passthrough (%s)", reason);
        log_first_call(seen, k, how);
    }
    return run_undivided(call);
}

/* Plan, or passthrough with the reason. */
static cudnnStatus_t execute(const mu_conv_call *call, mu_plan_entry *entry, mu_seen *seen,
                             const mu_kernel *k) {
    cudnnStatus_t status;
    mu_exec_cache *cache = entry_cache(entry, k, call, &status);
    if (cache == NULL) {
        static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
        mu_log_limited(&limit, MU_LOG_WARNING, "%s N=%d: cannot create micro-batch descriptors (%s); "
                       "running undivided", k->key, k->n, mu_status_text(status));
        return passthrough(call, seen, k, "cannot create micro-batch descriptors");
    }
    if (entry->has_borrow_pieces) {
        char why[160];
        const char *refusal = borrow_refusal(entry, k, cache, call, why, sizeof why);
        if (refusal != NULL) return passthrough(call, seen, k, refusal);
    }
    if (seen != NULL && mu_log_enabled(MU_LOG_INFO) && !atomic_load(&seen->first_call_logged)) {
        char pieces[1024], how[1200];
        mu_plan_pieces_text(entry, pieces, sizeof pieces);
        snprintf(how, sizeof how, "plan, %d pieces: %s (workspace %zu of %zu)", entry->piece_count,
                 pieces, entry->workspace, call->workspace_size);
        log_first_call(seen, k, how);
    }
    pieces_run run = {entry, k, cache, call, -1};
    /* Graphs of graph-API pieces belong to those pieces' plans and die with them. */
    mu_graph_owner *owner = call->graph != NULL ? mu_g_graphs_of(call->graph) : &entry->graphs;
    status = mu_run_captured(entry, owner, call->handle, &(mu_capture_key){
                                 .x = (uintptr_t)call->x, .w = (uintptr_t)call->w, .y = (uintptr_t)call->y,
                                 .workspace = (uintptr_t)call->workspace, .workspace_size = call->workspace_size,
                                 .alpha = key_scale(call->alpha, k->dtype), .beta = key_scale(call->beta, k->dtype),
                                 .entry = (uintptr_t)entry},
                             run_pieces_now, &run);
    int failed_piece = run.failed_piece;
    if (status != CUDNN_STATUS_SUCCESS && failed_piece == 0 && failed_before_writing(status)) {
        /* Nothing was written yet: cuDNN undivided may still run it. Stop using this plan. */
        atomic_store(&entry->disabled, true);
        mu_log(MU_LOG_WARNING, "%s N=%d: the plan's first piece failed (%s); running this kernel "
               "undivided from now on", k->key, k->n, mu_status_text(status));
        return passthrough(call, seen, k, "plan failed");
    }
    if (status != CUDNN_STATUS_SUCCESS) {
        static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
        mu_log_limited(&limit, MU_LOG_WARNING, "%s N=%d: piece %d of the plan failed: %s", k->key,
                       k->n, failed_piece + 1, mu_status_text(status));
    }
    if (seen != NULL) atomic_fetch_add(&seen->planned_calls, 1);
    return status;
}

mu_plan_entry *mu_plan_point(mu_plan_entry *head, size_t available, bool deterministic) {
    mu_plan_entry *best = NULL;
    for (mu_plan_entry *point = head; point != NULL && point->workspace <= available; point = point->next_point) {
        if (atomic_load(&point->disabled) || (deterministic && !mu_plan_legacy_deterministic(point))) continue;
        if (best == NULL || point->time_ms < best->time_ms) best = point;
    }
    return best;
}

/* Under MUCUDNN_WORKSPACE_SLACK (percent): the point of least workspace whose time is within that
 * much of `fastest`, the fastest point the call may take; `fastest` itself without the option.
 * Under a memory budget every byte of workspace at a step's peak is a byte that a saved tensor
 * must leave the device for (offloaded or recomputed), so a point a few percent slower with half
 * the workspace is the cheaper one (mucudnn run --offload sets it). Points are in order of
 * workspace, least first. */
mu_plan_entry *mu_plan_lean_point(mu_plan_entry *head, mu_plan_entry *fastest, bool deterministic) {
    long long slack = mu_option_int(MU_OPT_WORKSPACE_SLACK);
    if (fastest == NULL || slack < 0) return fastest;
    double within = fastest->time_ms * (1.0 + (double)slack / 100.0);
    for (mu_plan_entry *point = head; point != NULL && point->workspace < fastest->workspace;
         point = point->next_point) {
        if (atomic_load(&point->disabled) || (deterministic && !mu_plan_legacy_deterministic(point))) continue;
        if (point->time_ms <= within) return point;
    }
    return fastest;
}

bool mu_plan_legacy_deterministic(const mu_plan_entry *entry) {
    for (int i = 0; i < entry->piece_count; i++)
        if (entry->pieces[i].engine == NULL && !mu_algo_deterministic(entry->dir, entry->pieces[i].algo))
            return false;
    return true;
}

/* Plan or passthrough, once the call is known to be ours. */
static cudnnStatus_t dispatch(const mu_conv_call *call, const mu_state *state) {
    if (state->disabled) return run_undivided(call);
    mu_kernel k;
    const char *why = mu_kernel_from_descs(&call->descs, &k);
    if (why != NULL) {
        static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
        mu_log_limited(&limit, MU_LOG_INFO, "%s call without a kernel key: %s; passthrough",
                       mu_direction_name(call->descs.dir), why);
        mu_count_unkeyed_call();
        return run_undivided(call);
    }
    mu_seen *seen = mu_seen_kernel(&k);
    mu_plan_entry *head = state->plan ? mu_plan_find(state->plan, k.key, k.n, k.hash) : NULL;
    bool legacy_call = call->graph == NULL;
    const char *no_plan = "no plan";
    if (head != NULL) {
        if (state->plan->online) mu_online_note_planned(seen); /* a MUCUDNN_PLAN's kernels are not the file's */
    } else if (legacy_call) {
        head = mu_online_head(call, &k, seen, &no_plan); /* MUCUDNN_ONLINE */
    } else {
        head = mu_g_planned_entry(call->graph); /* a point of an online front (intercept_graph.c) */
    }
    if (head == NULL) return passthrough(call, seen, &k, no_plan);
    /* A caller that chose a deterministic algorithm may need the same bits every run
     * (torch.backends.cudnn.deterministic): it gets no less. On the graph path the point was
     * chosen, for the framework's engine, when its plan was finalized. */
    bool deterministic = legacy_call && mu_algo_deterministic(call->descs.dir, call->algo);
    /* the graph path: the point its plan chose, or one in lent workspace (lend.c) */
    mu_plan_entry *entry = legacy_call       ? mu_plan_point(head, call->workspace_size, deterministic)
                           : call->point != NULL ? call->point
                                                 : mu_g_planned_entry(call->graph);
    if (entry == NULL || atomic_load(&entry->disabled)) {
        char reason[128];
        if (entry != NULL || mu_plan_point(head, SIZE_MAX, false) == NULL)
            snprintf(reason, sizeof reason, "plan disabled after a failure");
        else if (mu_plan_point(head, call->workspace_size, false) != NULL)
            snprintf(reason, sizeof reason, "the caller's algorithm is deterministic, the plan is not");
        else
            snprintf(reason, sizeof reason, "workspace %zu smaller than the plan's %zu", call->workspace_size,
                     head->workspace);
        return passthrough(call, seen, &k, reason);
    }
    /* The point that fits is the caller's own algorithm, undivided: nothing to do. */
    if (legacy_call && entry->piece_count == 1 && entry->pieces[0].engine == NULL &&
        entry->pieces[0].algo == call->algo && entry->pieces[0].math == k.math && !entry->pieces[0].borrow)
        return passthrough(call, seen, &k, "the plan's point is the caller's algorithm");
    mu_conv_call with_pieces;
    if (entry->has_engine_pieces && legacy_call) { /* build (or find) the graph-API pieces */
        const char *why = NULL;
        with_pieces = *call;
        with_pieces.graph = mu_g_pieces_for_legacy(entry, &k, call, &why);
        if (with_pieces.graph == NULL) return passthrough(call, seen, &k, why);
        call = &with_pieces;
    }
    cudnnStatus_t status;
    if (deterministic && !mu_g_plan_deterministic(entry, call->graph))
        status = passthrough(call, seen, &k, "the caller's algorithm is deterministic, the plan is not");
    else
        status = execute(call, entry, seen, &k);
    if (call == &with_pieces) mu_g_pieces_release(with_pieces.graph);
    return status;
}

cudnnStatus_t mu_convolution(const mu_conv_call *call) {
    if (!mu_guard_enter()) return run_undivided(call);
    cudnnStatus_t status = dispatch(call, mu_config());
    mu_guard_leave();
    return status;
}

cudnnStatus_t mu_convolution_guarded(const mu_conv_call *call) { return dispatch(call, mu_config()); }

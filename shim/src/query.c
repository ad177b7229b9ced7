/*
 * query.c: cudnnGetConvolution*Algorithm_v7, cudnnFindConvolution*Algorithm(Ex) and
 * cudnnGetConvolution*WorkspaceSize.
 *
 * For a kernel with a plan the plan comes first among the results (memory = the plan's
 * workspace, so PyTorch allocates enough for it), followed by cuDNN's own; a front plan's points
 * fastest first, those within the memory free now before the others (room.c). With a workspace
 * limit, results above it are removed, so a framework stays inside the limit.
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define SAME_LAYOUT_AS_PERF(type)                                                              \
    _Static_assert(sizeof(type) == sizeof(mu_perf) &&                                          \
                       offsetof(type, algo) == offsetof(mu_perf, algo) &&                      \
                       offsetof(type, status) == offsetof(mu_perf, status) &&                  \
                       offsetof(type, time) == offsetof(mu_perf, time) &&                      \
                       offsetof(type, memory) == offsetof(mu_perf, memory) &&                  \
                       offsetof(type, determinism) == offsetof(mu_perf, determinism) &&        \
                       offsetof(type, mathType) == offsetof(mu_perf, mathType),                \
                   #type " must have the layout of mu_perf")
SAME_LAYOUT_AS_PERF(cudnnConvolutionFwdAlgoPerf_t);
SAME_LAYOUT_AS_PERF(cudnnConvolutionBwdDataAlgoPerf_t);
SAME_LAYOUT_AS_PERF(cudnnConvolutionBwdFilterAlgoPerf_t);

/*
 * The algorithm reported for a plan: one that real cuDNN runs undivided within the plan's
 * workspace, so that running the reported result without the plan stays valid, and as
 * deterministic as the plan, so that a caller who filters results by determinism gets it either
 * way. The pieces' algorithms are preferred (the first piece's first), then every algorithm in
 * enum order (the workspace-free implicit_gemm / algo_0 come first there); failing one of the
 * plan's determinism, any that fits.
 */
int mu_plan_algo(cudnnHandle_t handle, const mu_conv_descs *descs, const mu_plan_entry *entry) {
    bool deterministic = mu_plan_legacy_deterministic(entry);
    for (int i = 0; i < entry->piece_count; i++) {
        int algo = entry->pieces[i].algo;
        if (entry->pieces[i].engine == NULL && mu_algo_deterministic(entry->dir, algo) == deterministic &&
            mu_runs_within(handle, descs, algo, entry->workspace))
            return algo;
    }
    int algo = -1;
    for (int a = 0; a < mu_algo_count(entry->dir) && algo < 0; a++)
        if (mu_algo_deterministic(entry->dir, a) == deterministic && mu_runs_within(handle, descs, a, entry->workspace))
            algo = a;
    return algo >= 0 ? algo : mu_first_algo_within(handle, descs, entry->workspace, false);
}

static bool plan_result(const mu_query *q, const mu_plan_entry *entry, const mu_kernel *k, mu_perf *out) {
    int algo = mu_plan_algo(q->handle, &q->descs, entry);
    if (algo < 0) {
        static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
        mu_log_limited(&limit, MU_LOG_WARNING, "%s N=%d: no algorithm runs undivided within the "
                       "plan's workspace %zu; %s does not offer the plan", k->key, k->n,
                       entry->workspace, q->function);
        return false;
    }
    /* Deterministic only if the plan's pieces and the algorithm that runs in its place are. */
    bool deterministic = mu_plan_legacy_deterministic(entry) && mu_algo_deterministic(entry->dir, algo);
    /* FindEx gets no result that needs more workspace than the caller gave: cuDNN marks those
     * ALLOC_FAILED. */
    bool fits = q->kind != MU_QUERY_FIND_EX || entry->workspace <= q->workspace_size;
    *out = (mu_perf){.algo = algo,
                     .status = fits ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_ALLOC_FAILED,
                     .time = fits ? (float)entry->time_ms : -1.0f,
                     .memory = entry->workspace,
                     .determinism = deterministic ? CUDNN_DETERMINISTIC : CUDNN_NON_DETERMINISTIC,
                     .mathType = k->math}; /* the caller's, so the key stays the same once set */
    mu_log(MU_LOG_DEBUG, "%s %s N=%d: offering the plan %s (algo %s, workspace %zu, %.4f ms)", q->function,
           k->key, k->n, fits ? "first" : "as ALLOC_FAILED", mu_algo_name(entry->dir, algo), entry->workspace,
           entry->time_ms);
    return true;
}

/* Removes results above the limit; if no usable one would remain, keeps them all and warns. */
static int apply_limit(const mu_query *q, const char *what, mu_perf *results, int count,
                       size_t limit, bool has_plan) {
    mu_perf kept[MU_MAX_PERF];
    int kept_count = 0, usable = 0;
    size_t smallest = (size_t)-1;
    for (int i = 0; i < count; i++) {
        if (results[i].status == CUDNN_STATUS_SUCCESS && results[i].memory < smallest)
            smallest = results[i].memory;
        if (results[i].memory > limit) continue;
        usable += results[i].status == CUDNN_STATUS_SUCCESS;
        kept[kept_count++] = results[i];
    }
    if (usable == 0 && !has_plan) {
        static mu_rate_limit rate = MU_RATE_LIMIT_INIT;
        mu_log_limited(&rate, MU_LOG_WARNING, "%s %s: no algorithm fits the workspace limit %zu "
                       "(the smallest needs %zu); offering cuDNN's results unchanged", q->function,
                       what, limit, smallest);
        return count;
    }
    memcpy(results, kept, (size_t)kept_count * sizeof *kept);
    return kept_count;
}

/* How many points of a kernel's front a query offers at most (fastest first). */
#define MU_MAX_POINTS 8

/* The kernel's usable points, fastest first: not disabled, and in a front plan within the
 * workspace limit if one is set (a wr or wd plan's one point is offered whatever the limit: the
 * plan set its workspace). */
static int offered_points(mu_plan_entry *head, const mu_state *state, mu_plan_entry *points[MU_MAX_POINTS]) {
    int count = 0;
    bool capped = state->plan->front && state->has_limit;
    for (mu_plan_entry *point = head; point != NULL; point = point->next_point) {
        if (atomic_load(&point->disabled) || (capped && point->workspace > state->workspace_limit))
            continue;
        if (count == MU_MAX_POINTS) { /* full: it replaces the slowest, if faster */
            if (points[count - 1]->time_ms <= point->time_ms) continue;
            count--;
        }
        int at = count++;
        while (at > 0 && points[at - 1]->time_ms > point->time_ms) points[at] = points[at - 1], at--;
        points[at] = point;
    }
    return count;
}

/* Under memory pressure (room.c) the points within the room come first, each group still fastest
 * first: a framework that falls back on an allocation failure then lands on a fitting point. */
static void room_first(const mu_kernel *k, mu_seen *seen, mu_plan_entry *points[], int count) {
    mu_room_info room;
    if (count < 2 || points[0]->workspace == 0 || !mu_room(&room, points[0]->workspace) || points[0]->workspace <= room.bytes) return;
    mu_plan_entry *fitting[MU_MAX_POINTS], *over[MU_MAX_POINTS];
    int fitting_count = 0, over_count = 0;
    for (int i = 0; i < count; i++) {
        if (points[i]->workspace <= room.bytes) fitting[fitting_count++] = points[i];
        else over[over_count++] = points[i];
    }
    if (fitting_count == 0) return; /* none fits: fastest first, as without a room */
    mu_room_note_degraded(seen, k, points[0]->workspace, fitting[0]->workspace, &room);
    for (int i = 0; i < fitting_count; i++) points[i] = fitting[i];
    for (int i = 0; i < over_count; i++) points[fitting_count + i] = over[i];
}

static cudnnStatus_t rewrite_query(const mu_query *q, const mu_state *state, int requested,
                                   int *returned, void *perf) {
    mu_kernel k;
    const char *why = mu_kernel_from_descs(&q->descs, &k);
    mu_plan_entry *points[MU_MAX_POINTS] = {0};
    int point_count = 0;
    if (why == NULL) {
        mu_seen *seen = mu_seen_kernel(&k);
        mu_plan_entry *head = state->plan != NULL ? mu_plan_find(state->plan, k.key, k.n, k.hash) : NULL;
        if (head != NULL) point_count = offered_points(head, state, points);
        room_first(&k, seen, points, point_count);
    }
    if (point_count == 0 && !state->has_limit) return mu_dir(q->descs.dir)->query(q, requested, returned, perf);

    mu_perf real[MU_MAX_PERF], results[MU_MAX_POINTS + MU_MAX_PERF];
    int count = 0;
    cudnnStatus_t status = mu_dir(q->descs.dir)->query(q, MU_MAX_PERF, &count, real);
    if (status != CUDNN_STATUS_SUCCESS) {
        *returned = 0;
        return status;
    }
    count = count < 0 ? 0 : count > MU_MAX_PERF ? MU_MAX_PERF : count;
    if (state->has_limit)
        count = apply_limit(q, why == NULL ? k.key : "(no kernel key)", real, count, state->workspace_limit,
                            point_count > 0);
    /* The points that can run first, fastest first (a framework tries results in order and falls
     * back to the next on an allocation failure, so it lands on the fastest point that fits);
     * cuDNN's results that succeeded; then points FindEx could not run (ALLOC_FAILED, as cuDNN
     * orders such results); then cuDNN's failed ones. */
    mu_perf unfit[MU_MAX_POINTS];
    int total = 0, unfit_count = 0, real_successes = 0;
    for (int i = 0; i < point_count; i++) {
        mu_perf offered;
        if (!plan_result(q, points[i], &k, &offered)) continue;
        if (offered.status == CUDNN_STATUS_SUCCESS) results[total++] = offered;
        else unfit[unfit_count++] = offered;
    }
    while (real_successes < count && real[real_successes].status == CUDNN_STATUS_SUCCESS) real_successes++;
    memcpy(results + total, real, (size_t)real_successes * sizeof *real);
    total += real_successes;
    memcpy(results + total, unfit, (size_t)unfit_count * sizeof *unfit);
    total += unfit_count;
    memcpy(results + total, real + real_successes, (size_t)(count - real_successes) * sizeof *real);
    total += count - real_successes;
    int copied = total < requested ? total : requested;
    memcpy(perf, results, (size_t)copied * sizeof *results);
    *returned = copied;
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t mu_algorithm_query(const mu_query *q, int requested, int *returned, void *perf) {
    if (!mu_guard_enter()) return mu_dir(q->descs.dir)->query(q, requested, returned, perf);
    const mu_state *state = mu_config();
    cudnnStatus_t status;
    if (state->disabled || requested <= 0 || returned == NULL || perf == NULL)
        status = mu_dir(q->descs.dir)->query(q, requested, returned, perf); /* cuDNN reports bad arguments */
    else
        status = rewrite_query(q, state, requested, returned, perf);
    mu_guard_leave();
    return status;
}

/* The plan's workspace is reported for the one algorithm a query offered for it, never for
 * another: a program that picks its own algorithm and sizes its buffer by it must get a buffer in
 * which cuDNN can run it whenever the plan passes the call through. */
cudnnStatus_t mu_workspace_size_query(const mu_query *q, int algo, size_t *size) {
    if (!mu_guard_enter()) return mu_workspace_of(q->handle, &q->descs, algo, size);
    const mu_state *state = mu_config();
    cudnnStatus_t status = mu_workspace_of(q->handle, &q->descs, algo, size);
    mu_kernel k;
    if (status == CUDNN_STATUS_SUCCESS && size != NULL && !state->disabled &&
        mu_kernel_from_descs(&q->descs, &k) == NULL) {
        mu_seen_kernel(&k);
        mu_plan_entry *head = state->plan ? mu_plan_find(state->plan, k.key, k.n, k.hash) : NULL;
        size_t real_size = *size;
        /* the largest of the points offered with this algorithm: the fastest of them then fits */
        for (mu_plan_entry *point = head; point != NULL; point = point->next_point)
            if (!atomic_load(&point->disabled) && point->workspace > *size &&
                mu_plan_algo(q->handle, &q->descs, point) == algo)
                *size = point->workspace;
        if (*size != real_size)
            mu_log(MU_LOG_DEBUG, "%s %s N=%d: plan workspace %zu (cuDNN says %zu for algo %s)", q->function,
                   k.key, k.n, *size, real_size, mu_algo_name(q->descs.dir, algo));
    }
    mu_guard_leave();
    return status;
}

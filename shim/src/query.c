/*
 * query.c: cudnnGetConvolution*Algorithm_v7, cudnnFindConvolution*Algorithm(Ex) and
 * cudnnGetConvolution*WorkspaceSize.
 *
 * For a kernel with a plan the plan comes first among the results (memory = the plan's
 * workspace, so PyTorch allocates enough for it), followed by cuDNN's own. With a workspace
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

/* Whether cuDNN can run the algorithm undivided within bytes of workspace. */
static bool runs_within(const mu_query *q, int algo, size_t bytes) {
    size_t needed = 0;
    return q->real_workspace_size(q, algo, &needed) == CUDNN_STATUS_SUCCESS && needed <= bytes;
}

/*
 * The algorithm reported for a plan: one that real cuDNN runs undivided within the plan's
 * workspace, so that running the reported result without the plan stays valid. The pieces'
 * algorithms are preferred (the first piece's first), then every algorithm in enum order (the
 * workspace-free implicit_gemm / algo_0 come first there).
 */
static int representative_algo(const mu_query *q, const mu_plan_entry *entry) {
    for (int i = 0; i < entry->piece_count; i++)
        if (entry->pieces[i].engine == NULL && runs_within(q, entry->pieces[i].algo, entry->workspace))
            return entry->pieces[i].algo;
    for (int algo = 0; algo < mu_algo_count(entry->dir); algo++)
        if (runs_within(q, algo, entry->workspace)) return algo;
    return -1;
}

/* The plan is deterministic when cuDNN reports every piece's algorithm as deterministic. */
static cudnnDeterminism_t plan_determinism(const mu_plan_entry *entry, const mu_perf *results, int count) {
    for (int i = 0; i < entry->piece_count; i++) {
        bool deterministic = false;
        for (int r = 0; r < count && !deterministic; r++)
            deterministic = results[r].algo == entry->pieces[i].algo &&
                            results[r].determinism == CUDNN_DETERMINISTIC;
        if (!deterministic) return CUDNN_NON_DETERMINISTIC;
    }
    return CUDNN_DETERMINISTIC;
}

static bool plan_result(const mu_query *q, const mu_plan_entry *entry, const mu_kernel *k,
                        const mu_perf *results, int count, mu_perf *out) {
    int algo = representative_algo(q, entry);
    if (algo < 0) {
        static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
        mu_log_limited(&limit, MU_LOG_WARNING, "%s N=%d: no algorithm runs undivided within the "
                       "plan's workspace %zu; %s does not offer the plan", k->key, k->n,
                       entry->workspace, q->function);
        return false;
    }
    *out = (mu_perf){.algo = algo,
                     .status = CUDNN_STATUS_SUCCESS,
                     .time = (float)entry->time_ms,
                     .memory = entry->workspace,
                     .determinism = plan_determinism(entry, results, count),
                     .mathType = k->math}; /* the caller's, so the key stays the same once set */
    mu_log(MU_LOG_DEBUG, "%s %s N=%d: offering the plan first (algo %s, workspace %zu, %.4f ms)",
           q->function, k->key, k->n, mu_algo_name(entry->dir, algo), entry->workspace, entry->time_ms);
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

static cudnnStatus_t rewrite_query(const mu_query *q, const mu_state *state, int requested,
                                   int *returned, void *perf) {
    mu_kernel k;
    const char *why = mu_kernel_from_descs(&q->descs, &k);
    mu_plan_entry *entry = NULL;
    if (why == NULL) {
        mu_seen_kernel(&k);
        if (state->plan != NULL) entry = mu_plan_find(state->plan, k.key, k.n, k.hash);
        if (entry != NULL && atomic_load(&entry->disabled)) entry = NULL;
    }
    if (entry == NULL && !state->has_limit) return q->real_query(q, requested, returned, perf);

    mu_perf results[1 + MU_MAX_PERF]; /* [0]: the plan's, when offered */
    mu_perf *real_results = results + 1;
    int count = 0;
    cudnnStatus_t status = q->real_query(q, MU_MAX_PERF, &count, real_results);
    if (status != CUDNN_STATUS_SUCCESS) {
        *returned = 0;
        return status;
    }
    count = count < 0 ? 0 : count > MU_MAX_PERF ? MU_MAX_PERF : count;
    if (state->has_limit)
        count = apply_limit(q, why == NULL ? k.key : "(no kernel key)", real_results, count,
                            state->workspace_limit, entry != NULL);
    mu_perf *first = real_results;
    if (entry != NULL && plan_result(q, entry, &k, real_results, count, &results[0])) {
        first = results;
        count++;
    }
    int copied = count < requested ? count : requested;
    memcpy(perf, first, (size_t)copied * sizeof *first);
    *returned = copied;
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t mu_algorithm_query(const mu_query *q, int requested, int *returned, void *perf) {
    if (!mu_guard_enter()) return q->real_query(q, requested, returned, perf);
    const mu_state *state = mu_config();
    cudnnStatus_t status;
    if (state->disabled || requested <= 0 || returned == NULL || perf == NULL)
        status = q->real_query(q, requested, returned, perf); /* cuDNN reports bad arguments */
    else
        status = rewrite_query(q, state, requested, returned, perf);
    mu_guard_leave();
    return status;
}

cudnnStatus_t mu_workspace_size_query(const mu_query *q, int algo, size_t *size) {
    if (!mu_guard_enter()) return q->real_workspace_size(q, algo, size);
    const mu_state *state = mu_config();
    cudnnStatus_t status = q->real_workspace_size(q, algo, size);
    mu_kernel k;
    if (status == CUDNN_STATUS_SUCCESS && size != NULL && !state->disabled &&
        mu_kernel_from_descs(&q->descs, &k) == NULL) {
        mu_seen_kernel(&k);
        mu_plan_entry *entry = state->plan ? mu_plan_find(state->plan, k.key, k.n, k.hash) : NULL;
        if (entry != NULL && !atomic_load(&entry->disabled)) {
            mu_log(MU_LOG_DEBUG, "%s %s N=%d: plan workspace %zu (cuDNN says %zu for algo %s)",
                   q->function, k.key, k.n, entry->workspace, *size, mu_algo_name(entry->dir, algo));
            *size = entry->workspace;
        }
    }
    mu_guard_leave();
    return status;
}

/*
 * directions.c: one table per convolution direction. Each entry holds the real cuDNN functions
 * of that direction in forward terms (x: x or dx, w: w or dw, y: y or dy): workspace size, the
 * convolution itself, Get_v7, Find and FindEx. The rest of the shim never switches on the
 * direction to call cuDNN; it calls through mu_dir(dir).
 */
#include "internal.h"

/* ---- forward ------------------------------------------------------------------------------- */

static cudnnStatus_t fwd_workspace_size(cudnnHandle_t h, const mu_conv_descs *d, int algo, size_t *size) {
    return mu_real()->cudnnGetConvolutionForwardWorkspaceSize(h, d->x, d->w, d->conv, d->y,
                                                              (cudnnConvolutionFwdAlgo_t)algo, size);
}

static cudnnStatus_t fwd_run(cudnnHandle_t h, const mu_conv_descs *d, const mu_conv_buffers *b, int algo,
                             const void *alpha, const void *beta, void *workspace, size_t workspace_size) {
    return mu_real()->cudnnConvolutionForward(h, alpha, d->x, b->x, d->w, b->w, d->conv,
                                              (cudnnConvolutionFwdAlgo_t)algo, workspace, workspace_size,
                                              beta, d->y, b->y);
}

static cudnnStatus_t fwd_query(const mu_query *q, int requested, int *returned, void *perf) {
    const mu_real_table *real = mu_real();
    const mu_conv_descs *d = &q->descs;
    switch (q->kind) {
    case MU_QUERY_GET_V7:
        return real->cudnnGetConvolutionForwardAlgorithm_v7(q->handle, d->x, d->w, d->conv, d->y, requested,
                                                            returned, perf);
    case MU_QUERY_FIND:
        return real->cudnnFindConvolutionForwardAlgorithm(q->handle, d->x, d->w, d->conv, d->y, requested,
                                                          returned, perf);
    case MU_QUERY_FIND_EX:
        return real->cudnnFindConvolutionForwardAlgorithmEx(q->handle, d->x, q->buffers.x, d->w, q->buffers.w,
                                                            d->conv, d->y, q->buffers.y, requested, returned,
                                                            perf, q->workspace, q->workspace_size);
    }
    return CUDNN_STATUS_BAD_PARAM;
}

/* ---- backward data --------------------------------------------------------------------------- */

static cudnnStatus_t bwd_data_workspace_size(cudnnHandle_t h, const mu_conv_descs *d, int algo, size_t *size) {
    return mu_real()->cudnnGetConvolutionBackwardDataWorkspaceSize(h, d->w, d->y, d->conv, d->x,
                                                                   (cudnnConvolutionBwdDataAlgo_t)algo, size);
}

static cudnnStatus_t bwd_data_run(cudnnHandle_t h, const mu_conv_descs *d, const mu_conv_buffers *b, int algo,
                                  const void *alpha, const void *beta, void *workspace, size_t workspace_size) {
    return mu_real()->cudnnConvolutionBackwardData(h, alpha, d->w, b->w, d->y, b->y, d->conv,
                                                   (cudnnConvolutionBwdDataAlgo_t)algo, workspace,
                                                   workspace_size, beta, d->x, b->x);
}

static cudnnStatus_t bwd_data_query(const mu_query *q, int requested, int *returned, void *perf) {
    const mu_real_table *real = mu_real();
    const mu_conv_descs *d = &q->descs;
    switch (q->kind) {
    case MU_QUERY_GET_V7:
        return real->cudnnGetConvolutionBackwardDataAlgorithm_v7(q->handle, d->w, d->y, d->conv, d->x, requested,
                                                                 returned, perf);
    case MU_QUERY_FIND:
        return real->cudnnFindConvolutionBackwardDataAlgorithm(q->handle, d->w, d->y, d->conv, d->x, requested,
                                                               returned, perf);
    case MU_QUERY_FIND_EX:
        return real->cudnnFindConvolutionBackwardDataAlgorithmEx(q->handle, d->w, q->buffers.w, d->y,
                                                                 q->buffers.y, d->conv, d->x, q->buffers.x,
                                                                 requested, returned, perf, q->workspace,
                                                                 q->workspace_size);
    }
    return CUDNN_STATUS_BAD_PARAM;
}

/* ---- backward filter ------------------------------------------------------------------------- */

static cudnnStatus_t bwd_filter_workspace_size(cudnnHandle_t h, const mu_conv_descs *d, int algo, size_t *size) {
    return mu_real()->cudnnGetConvolutionBackwardFilterWorkspaceSize(
        h, d->x, d->y, d->conv, d->w, (cudnnConvolutionBwdFilterAlgo_t)algo, size);
}

static cudnnStatus_t bwd_filter_run(cudnnHandle_t h, const mu_conv_descs *d, const mu_conv_buffers *b, int algo,
                                    const void *alpha, const void *beta, void *workspace, size_t workspace_size) {
    return mu_real()->cudnnConvolutionBackwardFilter(h, alpha, d->x, b->x, d->y, b->y, d->conv,
                                                     (cudnnConvolutionBwdFilterAlgo_t)algo, workspace,
                                                     workspace_size, beta, d->w, b->w);
}

static cudnnStatus_t bwd_filter_query(const mu_query *q, int requested, int *returned, void *perf) {
    const mu_real_table *real = mu_real();
    const mu_conv_descs *d = &q->descs;
    switch (q->kind) {
    case MU_QUERY_GET_V7:
        return real->cudnnGetConvolutionBackwardFilterAlgorithm_v7(q->handle, d->x, d->y, d->conv, d->w,
                                                                   requested, returned, perf);
    case MU_QUERY_FIND:
        return real->cudnnFindConvolutionBackwardFilterAlgorithm(q->handle, d->x, d->y, d->conv, d->w, requested,
                                                                 returned, perf);
    case MU_QUERY_FIND_EX:
        return real->cudnnFindConvolutionBackwardFilterAlgorithmEx(q->handle, d->x, q->buffers.x, d->y,
                                                                   q->buffers.y, d->conv, d->w, q->buffers.w,
                                                                   requested, returned, perf, q->workspace,
                                                                   q->workspace_size);
    }
    return CUDNN_STATUS_BAD_PARAM;
}

/* ---- the table ------------------------------------------------------------------------------- */

#define BIT(n) (1u << (n))

static const mu_direction_ops table[3] = {
    [MU_DIR_FWD] = {.nondeterministic_algos = 0,
                    .workspace_size = fwd_workspace_size, .run = fwd_run, .query = fwd_query},
    /* cuDNN documents these as non-deterministic (atomic adds): bwd_data algo_0, bwd_filter
     * algo_0 and algo_3. */
    [MU_DIR_BWD_DATA] = {.nondeterministic_algos = BIT(CUDNN_CONVOLUTION_BWD_DATA_ALGO_0),
                         .workspace_size = bwd_data_workspace_size, .run = bwd_data_run,
                         .query = bwd_data_query},
    [MU_DIR_BWD_FILTER] = {.nondeterministic_algos =
                               BIT(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0) | BIT(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3),
                           .workspace_size = bwd_filter_workspace_size, .run = bwd_filter_run,
                           .query = bwd_filter_query},
};

const mu_direction_ops *mu_dir(mu_direction dir) { return &table[dir]; }

bool mu_algo_deterministic(mu_direction dir, int algo) {
    return algo < 0 || algo >= 32 || !(table[dir].nondeterministic_algos & BIT(algo));
}

cudnnStatus_t mu_workspace_of(cudnnHandle_t handle, const mu_conv_descs *descs, int algo, size_t *size) {
    return table[descs->dir].workspace_size(handle, descs, algo, size);
}

bool mu_runs_within(cudnnHandle_t handle, const mu_conv_descs *descs, int algo, size_t bytes) {
    size_t need = 0;
    return mu_workspace_of(handle, descs, algo, &need) == CUDNN_STATUS_SUCCESS && need <= bytes;
}

/* cuDNN's heuristics' first algorithm (cudnnGet*Algorithm_v7, their expected fastest first) that
 * runs within bytes, deterministic where asked; else the first in enum order (mu_first_algo_within). */
int mu_best_algo_within(cudnnHandle_t handle, const mu_conv_descs *descs, size_t bytes, bool deterministic) {
    mu_perf perf[MU_MAX_PERF];
    int returned = 0;
    mu_query q = {.descs = *descs, .handle = handle, .kind = MU_QUERY_GET_V7, .function = "heuristics"};
    if (mu_dir(descs->dir)->query(&q, MU_MAX_PERF, &returned, perf) == CUDNN_STATUS_SUCCESS) {
        for (int i = 0; i < returned && i < MU_MAX_PERF; i++) {
            int algo = (int)perf[i].algo;
            if (perf[i].status == CUDNN_STATUS_SUCCESS && (!deterministic || mu_algo_deterministic(descs->dir, algo)) &&
                mu_runs_within(handle, descs, algo, bytes))
                return algo;
        }
    }
    return mu_first_algo_within(handle, descs, bytes, deterministic);
}

int mu_first_algo_within(cudnnHandle_t handle, const mu_conv_descs *descs, size_t bytes, bool deterministic) {
    for (int algo = 0; algo < mu_algo_count(descs->dir); algo++)
        if ((!deterministic || mu_algo_deterministic(descs->dir, algo)) && mu_runs_within(handle, descs, algo, bytes))
            return algo;
    return -1;
}

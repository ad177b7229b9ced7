/* intercept_fwd.c: the interposed forward convolution API (bodies in query.c and exec.c). */
#include "internal.h"

/* The pointers of a cudnnFindConvolutionForwardAlgorithmEx call. */
typedef struct {
    const void *x, *w;
    void *y, *workspace;
    size_t workspace_size;
} find_ex_args;

static cudnnStatus_t real_get_v7(const mu_query *q, int requested, int *returned, void *perf) {
    return mu_real()->cudnnGetConvolutionForwardAlgorithm_v7(q->handle, q->descs.x, q->descs.w,
                                                             q->descs.conv, q->descs.y, requested,
                                                             returned, perf);
}

static cudnnStatus_t real_find(const mu_query *q, int requested, int *returned, void *perf) {
    return mu_real()->cudnnFindConvolutionForwardAlgorithm(q->handle, q->descs.x, q->descs.w,
                                                           q->descs.conv, q->descs.y, requested,
                                                           returned, perf);
}

static cudnnStatus_t real_find_ex(const mu_query *q, int requested, int *returned, void *perf) {
    const find_ex_args *a = q->args;
    return mu_real()->cudnnFindConvolutionForwardAlgorithmEx(
        q->handle, q->descs.x, a->x, q->descs.w, a->w, q->descs.conv, q->descs.y, a->y, requested,
        returned, perf, a->workspace, a->workspace_size);
}

static cudnnStatus_t real_workspace_size(const mu_query *q, int algo, size_t *size) {
    return mu_real()->cudnnGetConvolutionForwardWorkspaceSize(
        q->handle, q->descs.x, q->descs.w, q->descs.conv, q->descs.y, (cudnnConvolutionFwdAlgo_t)algo,
        size);
}

static mu_query make_query(cudnnHandle_t handle, cudnnTensorDescriptor_t x, cudnnFilterDescriptor_t w,
                           cudnnConvolutionDescriptor_t conv, cudnnTensorDescriptor_t y,
                           const char *function,
                           cudnnStatus_t (*real_query)(const mu_query *, int, int *, void *),
                           const void *args) {
    return (mu_query){.descs = {MU_DIR_FWD, x, w, conv, y}, .handle = handle, .function = function,
                      .real_query = real_query, .real_workspace_size = real_workspace_size,
                      .args = args};
}

MU_EXPORT cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t srcDesc, const cudnnFilterDescriptor_t filterDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t destDesc,
    const int requestedAlgoCount, int *returnedAlgoCount, cudnnConvolutionFwdAlgoPerf_t *perfResults) {
    if (MU_REAL_MISSING(cudnnGetConvolutionForwardAlgorithm_v7) ||
        MU_REAL_MISSING(cudnnGetConvolutionForwardWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    mu_query q = make_query(handle, srcDesc, filterDesc, convDesc, destDesc, __func__, real_get_v7, NULL);
    return mu_algorithm_query(&q, requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnFindConvolutionForwardAlgorithm(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const cudnnFilterDescriptor_t wDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t yDesc,
    const int requestedAlgoCount, int *returnedAlgoCount, cudnnConvolutionFwdAlgoPerf_t *perfResults) {
    if (MU_REAL_MISSING(cudnnFindConvolutionForwardAlgorithm) ||
        MU_REAL_MISSING(cudnnGetConvolutionForwardWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    mu_query q = make_query(handle, xDesc, wDesc, convDesc, yDesc, __func__, real_find, NULL);
    return mu_algorithm_query(&q, requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnFindConvolutionForwardAlgorithmEx(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const void *x,
    const cudnnFilterDescriptor_t wDesc, const void *w, const cudnnConvolutionDescriptor_t convDesc,
    const cudnnTensorDescriptor_t yDesc, void *y, const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionFwdAlgoPerf_t *perfResults, void *workSpace, size_t workSpaceSizeInBytes) {
    if (MU_REAL_MISSING(cudnnFindConvolutionForwardAlgorithmEx) ||
        MU_REAL_MISSING(cudnnGetConvolutionForwardWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    find_ex_args args = {x, w, y, workSpace, workSpaceSizeInBytes};
    mu_query q = make_query(handle, xDesc, wDesc, convDesc, yDesc, __func__, real_find_ex, &args);
    return mu_algorithm_query(&q, requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const cudnnFilterDescriptor_t wDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t yDesc,
    cudnnConvolutionFwdAlgo_t algo, size_t *sizeInBytes) {
    if (MU_REAL_MISSING(cudnnGetConvolutionForwardWorkspaceSize)) return CUDNN_STATUS_NOT_INITIALIZED;
    mu_query q = make_query(handle, xDesc, wDesc, convDesc, yDesc, __func__, NULL, NULL);
    return mu_workspace_size_query(&q, (int)algo, sizeInBytes);
}

MU_EXPORT cudnnStatus_t cudnnConvolutionForward(
    cudnnHandle_t handle, const void *alpha, const cudnnTensorDescriptor_t xDesc, const void *x,
    const cudnnFilterDescriptor_t wDesc, const void *w, const cudnnConvolutionDescriptor_t convDesc,
    cudnnConvolutionFwdAlgo_t algo, void *workSpace, size_t workSpaceSizeInBytes, const void *beta,
    const cudnnTensorDescriptor_t yDesc, void *y) {
    if (MU_REAL_MISSING(cudnnConvolutionForward)) return CUDNN_STATUS_NOT_INITIALIZED;
    mu_conv_call call = {.descs = {MU_DIR_FWD, xDesc, wDesc, convDesc, yDesc},
                         .handle = handle, .alpha = alpha, .beta = beta,
                         .x = (void *)x, .w = (void *)w, .y = y, .algo = (int)algo,
                         .workspace = workSpace, .workspace_size = workSpaceSizeInBytes};
    return mu_convolution(&call);
}

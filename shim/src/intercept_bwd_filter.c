/* intercept_bwd_filter.c: the interposed backward-filter API (bodies in query.c and exec.c).
 * In forward terms dy is y and dw is w. */
#include "internal.h"

/* The pointers of a cudnnFindConvolutionBackwardFilterAlgorithmEx call. */
typedef struct {
    const void *x, *dy;
    void *dw, *workspace;
    size_t workspace_size;
} find_ex_args;

static cudnnStatus_t real_get_v7(const mu_query *q, int requested, int *returned, void *perf) {
    return mu_real()->cudnnGetConvolutionBackwardFilterAlgorithm_v7(
        q->handle, q->descs.x, q->descs.y, q->descs.conv, q->descs.w, requested, returned, perf);
}

static cudnnStatus_t real_find(const mu_query *q, int requested, int *returned, void *perf) {
    return mu_real()->cudnnFindConvolutionBackwardFilterAlgorithm(
        q->handle, q->descs.x, q->descs.y, q->descs.conv, q->descs.w, requested, returned, perf);
}

static cudnnStatus_t real_find_ex(const mu_query *q, int requested, int *returned, void *perf) {
    const find_ex_args *a = q->args;
    return mu_real()->cudnnFindConvolutionBackwardFilterAlgorithmEx(
        q->handle, q->descs.x, a->x, q->descs.y, a->dy, q->descs.conv, q->descs.w, a->dw, requested,
        returned, perf, a->workspace, a->workspace_size);
}

static cudnnStatus_t real_workspace_size(const mu_query *q, int algo, size_t *size) {
    return mu_real()->cudnnGetConvolutionBackwardFilterWorkspaceSize(
        q->handle, q->descs.x, q->descs.y, q->descs.conv, q->descs.w,
        (cudnnConvolutionBwdFilterAlgo_t)algo, size);
}

static mu_query make_query(cudnnHandle_t handle, cudnnTensorDescriptor_t x, cudnnTensorDescriptor_t dy,
                           cudnnConvolutionDescriptor_t conv, cudnnFilterDescriptor_t dw,
                           const char *function,
                           cudnnStatus_t (*real_query)(const mu_query *, int, int *, void *),
                           const void *args) {
    return (mu_query){.descs = {MU_DIR_BWD_FILTER, x, dw, conv, dy}, .handle = handle,
                      .function = function, .real_query = real_query,
                      .real_workspace_size = real_workspace_size, .args = args};
}

MU_EXPORT cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t srcDesc, const cudnnTensorDescriptor_t diffDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnFilterDescriptor_t gradDesc,
    const int requestedAlgoCount, int *returnedAlgoCount, cudnnConvolutionBwdFilterAlgoPerf_t *perfResults) {
    if (MU_REAL_MISSING(cudnnGetConvolutionBackwardFilterAlgorithm_v7) ||
        MU_REAL_MISSING(cudnnGetConvolutionBackwardFilterWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    mu_query q = make_query(handle, srcDesc, diffDesc, convDesc, gradDesc, __func__, real_get_v7, NULL);
    return mu_algorithm_query(&q, requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnFindConvolutionBackwardFilterAlgorithm(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnFilterDescriptor_t dwDesc,
    const int requestedAlgoCount, int *returnedAlgoCount, cudnnConvolutionBwdFilterAlgoPerf_t *perfResults) {
    if (MU_REAL_MISSING(cudnnFindConvolutionBackwardFilterAlgorithm) ||
        MU_REAL_MISSING(cudnnGetConvolutionBackwardFilterWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    mu_query q = make_query(handle, xDesc, dyDesc, convDesc, dwDesc, __func__, real_find, NULL);
    return mu_algorithm_query(&q, requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnFindConvolutionBackwardFilterAlgorithmEx(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const void *x,
    const cudnnTensorDescriptor_t dyDesc, const void *y, const cudnnConvolutionDescriptor_t convDesc,
    const cudnnFilterDescriptor_t dwDesc, void *dw, const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionBwdFilterAlgoPerf_t *perfResults, void *workSpace, size_t workSpaceSizeInBytes) {
    if (MU_REAL_MISSING(cudnnFindConvolutionBackwardFilterAlgorithmEx) ||
        MU_REAL_MISSING(cudnnGetConvolutionBackwardFilterWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    find_ex_args args = {x, y, dw, workSpace, workSpaceSizeInBytes};
    mu_query q = make_query(handle, xDesc, dyDesc, convDesc, dwDesc, __func__, real_find_ex, &args);
    return mu_algorithm_query(&q, requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnFilterDescriptor_t gradDesc,
    cudnnConvolutionBwdFilterAlgo_t algo, size_t *sizeInBytes) {
    if (MU_REAL_MISSING(cudnnGetConvolutionBackwardFilterWorkspaceSize)) return CUDNN_STATUS_NOT_INITIALIZED;
    mu_query q = make_query(handle, xDesc, dyDesc, convDesc, gradDesc, __func__, NULL, NULL);
    return mu_workspace_size_query(&q, (int)algo, sizeInBytes);
}

MU_EXPORT cudnnStatus_t cudnnConvolutionBackwardFilter(
    cudnnHandle_t handle, const void *alpha, const cudnnTensorDescriptor_t xDesc, const void *x,
    const cudnnTensorDescriptor_t dyDesc, const void *dy, const cudnnConvolutionDescriptor_t convDesc,
    cudnnConvolutionBwdFilterAlgo_t algo, void *workSpace, size_t workSpaceSizeInBytes, const void *beta,
    const cudnnFilterDescriptor_t dwDesc, void *dw) {
    if (MU_REAL_MISSING(cudnnConvolutionBackwardFilter)) return CUDNN_STATUS_NOT_INITIALIZED;
    mu_conv_call call = {.descs = {MU_DIR_BWD_FILTER, xDesc, dwDesc, convDesc, dyDesc},
                         .handle = handle, .alpha = alpha, .beta = beta,
                         .x = (void *)x, .w = dw, .y = (void *)dy, .algo = (int)algo,
                         .workspace = workSpace, .workspace_size = workSpaceSizeInBytes};
    return mu_convolution(&call);
}

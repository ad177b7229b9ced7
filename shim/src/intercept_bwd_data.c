/* intercept_bwd_data.c: the interposed backward-data API (bodies in query.c and exec.c).
 * In forward terms dx is x and dy is y. */
#include "internal.h"

/* The pointers of a cudnnFindConvolutionBackwardDataAlgorithmEx call. */
typedef struct {
    const void *w, *dy;
    void *dx, *workspace;
    size_t workspace_size;
} find_ex_args;

static cudnnStatus_t real_get_v7(const mu_query *q, int requested, int *returned, void *perf) {
    return mu_real()->cudnnGetConvolutionBackwardDataAlgorithm_v7(
        q->handle, q->descs.w, q->descs.y, q->descs.conv, q->descs.x, requested, returned, perf);
}

static cudnnStatus_t real_find(const mu_query *q, int requested, int *returned, void *perf) {
    return mu_real()->cudnnFindConvolutionBackwardDataAlgorithm(
        q->handle, q->descs.w, q->descs.y, q->descs.conv, q->descs.x, requested, returned, perf);
}

static cudnnStatus_t real_find_ex(const mu_query *q, int requested, int *returned, void *perf) {
    const find_ex_args *a = q->args;
    return mu_real()->cudnnFindConvolutionBackwardDataAlgorithmEx(
        q->handle, q->descs.w, a->w, q->descs.y, a->dy, q->descs.conv, q->descs.x, a->dx, requested,
        returned, perf, a->workspace, a->workspace_size);
}

static cudnnStatus_t real_workspace_size(const mu_query *q, int algo, size_t *size) {
    return mu_real()->cudnnGetConvolutionBackwardDataWorkspaceSize(
        q->handle, q->descs.w, q->descs.y, q->descs.conv, q->descs.x,
        (cudnnConvolutionBwdDataAlgo_t)algo, size);
}

static mu_query make_query(cudnnHandle_t handle, cudnnFilterDescriptor_t w, cudnnTensorDescriptor_t dy,
                           cudnnConvolutionDescriptor_t conv, cudnnTensorDescriptor_t dx,
                           const char *function,
                           cudnnStatus_t (*real_query)(const mu_query *, int, int *, void *),
                           const void *args) {
    return (mu_query){.descs = {MU_DIR_BWD_DATA, dx, w, conv, dy}, .handle = handle,
                      .function = function, .real_query = real_query,
                      .real_workspace_size = real_workspace_size, .args = args};
}

MU_EXPORT cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t filterDesc, const cudnnTensorDescriptor_t diffDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t gradDesc,
    const int requestedAlgoCount, int *returnedAlgoCount, cudnnConvolutionBwdDataAlgoPerf_t *perfResults) {
    if (MU_REAL_MISSING(cudnnGetConvolutionBackwardDataAlgorithm_v7) ||
        MU_REAL_MISSING(cudnnGetConvolutionBackwardDataWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    mu_query q = make_query(handle, filterDesc, diffDesc, convDesc, gradDesc, __func__, real_get_v7, NULL);
    return mu_algorithm_query(&q, requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithm(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t dxDesc,
    const int requestedAlgoCount, int *returnedAlgoCount, cudnnConvolutionBwdDataAlgoPerf_t *perfResults) {
    if (MU_REAL_MISSING(cudnnFindConvolutionBackwardDataAlgorithm) ||
        MU_REAL_MISSING(cudnnGetConvolutionBackwardDataWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    mu_query q = make_query(handle, wDesc, dyDesc, convDesc, dxDesc, __func__, real_find, NULL);
    return mu_algorithm_query(&q, requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithmEx(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc, const void *w,
    const cudnnTensorDescriptor_t dyDesc, const void *dy, const cudnnConvolutionDescriptor_t convDesc,
    const cudnnTensorDescriptor_t dxDesc, void *dx, const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionBwdDataAlgoPerf_t *perfResults, void *workSpace, size_t workSpaceSizeInBytes) {
    if (MU_REAL_MISSING(cudnnFindConvolutionBackwardDataAlgorithmEx) ||
        MU_REAL_MISSING(cudnnGetConvolutionBackwardDataWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    find_ex_args args = {w, dy, dx, workSpace, workSpaceSizeInBytes};
    mu_query q = make_query(handle, wDesc, dyDesc, convDesc, dxDesc, __func__, real_find_ex, &args);
    return mu_algorithm_query(&q, requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t dxDesc,
    cudnnConvolutionBwdDataAlgo_t algo, size_t *sizeInBytes) {
    if (MU_REAL_MISSING(cudnnGetConvolutionBackwardDataWorkspaceSize)) return CUDNN_STATUS_NOT_INITIALIZED;
    mu_query q = make_query(handle, wDesc, dyDesc, convDesc, dxDesc, __func__, NULL, NULL);
    return mu_workspace_size_query(&q, (int)algo, sizeInBytes);
}

MU_EXPORT cudnnStatus_t cudnnConvolutionBackwardData(
    cudnnHandle_t handle, const void *alpha, const cudnnFilterDescriptor_t wDesc, const void *w,
    const cudnnTensorDescriptor_t dyDesc, const void *dy, const cudnnConvolutionDescriptor_t convDesc,
    cudnnConvolutionBwdDataAlgo_t algo, void *workSpace, size_t workSpaceSizeInBytes, const void *beta,
    const cudnnTensorDescriptor_t dxDesc, void *dx) {
    if (MU_REAL_MISSING(cudnnConvolutionBackwardData)) return CUDNN_STATUS_NOT_INITIALIZED;
    mu_conv_call call = {.descs = {MU_DIR_BWD_DATA, dxDesc, wDesc, convDesc, dyDesc},
                         .handle = handle, .alpha = alpha, .beta = beta,
                         .x = dx, .w = (void *)w, .y = (void *)dy, .algo = (int)algo,
                         .workspace = workSpace, .workspace_size = workSpaceSizeInBytes};
    return mu_convolution(&call);
}

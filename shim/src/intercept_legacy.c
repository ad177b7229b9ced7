/*
 * intercept_legacy.c: the interposed legacy convolution API, five functions per direction
 * (Get_v7, Find, FindEx, Get*WorkspaceSize, the convolution). Each wrapper only puts its
 * arguments in forward terms (x: x or dx, w: w or dw, y: y or dy) and hands them to the bodies
 * in query.c and exec.c, which reach the real functions through the direction table
 * (directions.c). A function the real cuDNN lacks answers CUDNN_STATUS_NOT_INITIALIZED.
 */
#include "internal.h"

/* Every query body also needs the direction's workspace-size function. */
#define QUERY_NEEDS(query, workspace_size) (MU_REAL_MISSING(query) || MU_REAL_MISSING(workspace_size))

static cudnnStatus_t query(mu_direction dir, mu_query_kind kind, const char *function, cudnnHandle_t handle,
                           cudnnTensorDescriptor_t x, cudnnFilterDescriptor_t w, cudnnConvolutionDescriptor_t conv,
                           cudnnTensorDescriptor_t y, int requested, int *returned, void *perf) {
    mu_query q = {.descs = {dir, x, w, conv, y}, .handle = handle, .kind = kind, .function = function};
    return mu_algorithm_query(&q, requested, returned, perf);
}

static cudnnStatus_t query_ex(mu_direction dir, const char *function, cudnnHandle_t handle,
                              cudnnTensorDescriptor_t x_desc, const void *x, cudnnFilterDescriptor_t w_desc,
                              const void *w, cudnnConvolutionDescriptor_t conv, cudnnTensorDescriptor_t y_desc,
                              const void *y, int requested, int *returned, void *perf, void *workspace,
                              size_t workspace_size) {
    mu_query q = {.descs = {dir, x_desc, w_desc, conv, y_desc}, .handle = handle, .kind = MU_QUERY_FIND_EX,
                  .function = function, .buffers = {(void *)x, (void *)w, (void *)y},
                  .workspace = workspace, .workspace_size = workspace_size};
    return mu_algorithm_query(&q, requested, returned, perf);
}

static cudnnStatus_t workspace_size(mu_direction dir, const char *function, cudnnHandle_t handle,
                                    cudnnTensorDescriptor_t x, cudnnFilterDescriptor_t w,
                                    cudnnConvolutionDescriptor_t conv, cudnnTensorDescriptor_t y, int algo,
                                    size_t *size) {
    mu_query q = {.descs = {dir, x, w, conv, y}, .handle = handle, .function = function};
    return mu_workspace_size_query(&q, algo, size);
}

static cudnnStatus_t convolution(mu_direction dir, cudnnHandle_t handle, const void *alpha,
                                 cudnnTensorDescriptor_t x_desc, const void *x, cudnnFilterDescriptor_t w_desc,
                                 const void *w, cudnnConvolutionDescriptor_t conv, cudnnTensorDescriptor_t y_desc,
                                 const void *y, int algo, void *workspace, size_t workspace_size,
                                 const void *beta) {
    mu_conv_call call = {.descs = {dir, x_desc, w_desc, conv, y_desc}, .handle = handle, .alpha = alpha,
                         .beta = beta, .x = (void *)x, .w = (void *)w, .y = (void *)y, .algo = algo,
                         .workspace = workspace, .workspace_size = workspace_size};
    return mu_convolution(&call);
}

/* ---- forward ------------------------------------------------------------------------------- */

MU_EXPORT cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t srcDesc, const cudnnFilterDescriptor_t filterDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t destDesc,
    const int requestedAlgoCount, int *returnedAlgoCount, cudnnConvolutionFwdAlgoPerf_t *perfResults) {
    if (QUERY_NEEDS(cudnnGetConvolutionForwardAlgorithm_v7, cudnnGetConvolutionForwardWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    return query(MU_DIR_FWD, MU_QUERY_GET_V7, __func__, handle, srcDesc, filterDesc, convDesc, destDesc,
                 requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnFindConvolutionForwardAlgorithm(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const cudnnFilterDescriptor_t wDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t yDesc,
    const int requestedAlgoCount, int *returnedAlgoCount, cudnnConvolutionFwdAlgoPerf_t *perfResults) {
    if (QUERY_NEEDS(cudnnFindConvolutionForwardAlgorithm, cudnnGetConvolutionForwardWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    return query(MU_DIR_FWD, MU_QUERY_FIND, __func__, handle, xDesc, wDesc, convDesc, yDesc, requestedAlgoCount,
                 returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnFindConvolutionForwardAlgorithmEx(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const void *x,
    const cudnnFilterDescriptor_t wDesc, const void *w, const cudnnConvolutionDescriptor_t convDesc,
    const cudnnTensorDescriptor_t yDesc, void *y, const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionFwdAlgoPerf_t *perfResults, void *workSpace, size_t workSpaceSizeInBytes) {
    if (QUERY_NEEDS(cudnnFindConvolutionForwardAlgorithmEx, cudnnGetConvolutionForwardWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    return query_ex(MU_DIR_FWD, __func__, handle, xDesc, x, wDesc, w, convDesc, yDesc, y, requestedAlgoCount,
                    returnedAlgoCount, perfResults, workSpace, workSpaceSizeInBytes);
}

MU_EXPORT cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const cudnnFilterDescriptor_t wDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t yDesc,
    cudnnConvolutionFwdAlgo_t algo, size_t *sizeInBytes) {
    if (MU_REAL_MISSING(cudnnGetConvolutionForwardWorkspaceSize)) return CUDNN_STATUS_NOT_INITIALIZED;
    return workspace_size(MU_DIR_FWD, __func__, handle, xDesc, wDesc, convDesc, yDesc, (int)algo, sizeInBytes);
}

MU_EXPORT cudnnStatus_t cudnnConvolutionForward(
    cudnnHandle_t handle, const void *alpha, const cudnnTensorDescriptor_t xDesc, const void *x,
    const cudnnFilterDescriptor_t wDesc, const void *w, const cudnnConvolutionDescriptor_t convDesc,
    cudnnConvolutionFwdAlgo_t algo, void *workSpace, size_t workSpaceSizeInBytes, const void *beta,
    const cudnnTensorDescriptor_t yDesc, void *y) {
    if (MU_REAL_MISSING(cudnnConvolutionForward)) return CUDNN_STATUS_NOT_INITIALIZED;
    return convolution(MU_DIR_FWD, handle, alpha, xDesc, x, wDesc, w, convDesc, yDesc, y, (int)algo, workSpace,
                       workSpaceSizeInBytes, beta);
}

/* ---- backward data: dx is x, dy is y --------------------------------------------------------- */

MU_EXPORT cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t filterDesc, const cudnnTensorDescriptor_t diffDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t gradDesc,
    const int requestedAlgoCount, int *returnedAlgoCount, cudnnConvolutionBwdDataAlgoPerf_t *perfResults) {
    if (QUERY_NEEDS(cudnnGetConvolutionBackwardDataAlgorithm_v7, cudnnGetConvolutionBackwardDataWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    return query(MU_DIR_BWD_DATA, MU_QUERY_GET_V7, __func__, handle, gradDesc, filterDesc, convDesc, diffDesc,
                 requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithm(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t dxDesc,
    const int requestedAlgoCount, int *returnedAlgoCount, cudnnConvolutionBwdDataAlgoPerf_t *perfResults) {
    if (QUERY_NEEDS(cudnnFindConvolutionBackwardDataAlgorithm, cudnnGetConvolutionBackwardDataWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    return query(MU_DIR_BWD_DATA, MU_QUERY_FIND, __func__, handle, dxDesc, wDesc, convDesc, dyDesc,
                 requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithmEx(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc, const void *w,
    const cudnnTensorDescriptor_t dyDesc, const void *dy, const cudnnConvolutionDescriptor_t convDesc,
    const cudnnTensorDescriptor_t dxDesc, void *dx, const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionBwdDataAlgoPerf_t *perfResults, void *workSpace, size_t workSpaceSizeInBytes) {
    if (QUERY_NEEDS(cudnnFindConvolutionBackwardDataAlgorithmEx, cudnnGetConvolutionBackwardDataWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    return query_ex(MU_DIR_BWD_DATA, __func__, handle, dxDesc, dx, wDesc, w, convDesc, dyDesc, dy,
                    requestedAlgoCount, returnedAlgoCount, perfResults, workSpace, workSpaceSizeInBytes);
}

MU_EXPORT cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t dxDesc,
    cudnnConvolutionBwdDataAlgo_t algo, size_t *sizeInBytes) {
    if (MU_REAL_MISSING(cudnnGetConvolutionBackwardDataWorkspaceSize)) return CUDNN_STATUS_NOT_INITIALIZED;
    return workspace_size(MU_DIR_BWD_DATA, __func__, handle, dxDesc, wDesc, convDesc, dyDesc, (int)algo,
                          sizeInBytes);
}

MU_EXPORT cudnnStatus_t cudnnConvolutionBackwardData(
    cudnnHandle_t handle, const void *alpha, const cudnnFilterDescriptor_t wDesc, const void *w,
    const cudnnTensorDescriptor_t dyDesc, const void *dy, const cudnnConvolutionDescriptor_t convDesc,
    cudnnConvolutionBwdDataAlgo_t algo, void *workSpace, size_t workSpaceSizeInBytes, const void *beta,
    const cudnnTensorDescriptor_t dxDesc, void *dx) {
    if (MU_REAL_MISSING(cudnnConvolutionBackwardData)) return CUDNN_STATUS_NOT_INITIALIZED;
    return convolution(MU_DIR_BWD_DATA, handle, alpha, dxDesc, dx, wDesc, w, convDesc, dyDesc, dy, (int)algo,
                       workSpace, workSpaceSizeInBytes, beta);
}

/* ---- backward filter: dy is y, dw is w ------------------------------------------------------- */

MU_EXPORT cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t srcDesc, const cudnnTensorDescriptor_t diffDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnFilterDescriptor_t gradDesc,
    const int requestedAlgoCount, int *returnedAlgoCount, cudnnConvolutionBwdFilterAlgoPerf_t *perfResults) {
    if (QUERY_NEEDS(cudnnGetConvolutionBackwardFilterAlgorithm_v7, cudnnGetConvolutionBackwardFilterWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    return query(MU_DIR_BWD_FILTER, MU_QUERY_GET_V7, __func__, handle, srcDesc, gradDesc, convDesc, diffDesc,
                 requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnFindConvolutionBackwardFilterAlgorithm(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnFilterDescriptor_t dwDesc,
    const int requestedAlgoCount, int *returnedAlgoCount, cudnnConvolutionBwdFilterAlgoPerf_t *perfResults) {
    if (QUERY_NEEDS(cudnnFindConvolutionBackwardFilterAlgorithm, cudnnGetConvolutionBackwardFilterWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    return query(MU_DIR_BWD_FILTER, MU_QUERY_FIND, __func__, handle, xDesc, dwDesc, convDesc, dyDesc,
                 requestedAlgoCount, returnedAlgoCount, perfResults);
}

MU_EXPORT cudnnStatus_t cudnnFindConvolutionBackwardFilterAlgorithmEx(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const void *x,
    const cudnnTensorDescriptor_t dyDesc, const void *dy, const cudnnConvolutionDescriptor_t convDesc,
    const cudnnFilterDescriptor_t dwDesc, void *dw, const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionBwdFilterAlgoPerf_t *perfResults, void *workSpace, size_t workSpaceSizeInBytes) {
    if (QUERY_NEEDS(cudnnFindConvolutionBackwardFilterAlgorithmEx, cudnnGetConvolutionBackwardFilterWorkspaceSize))
        return CUDNN_STATUS_NOT_INITIALIZED;
    return query_ex(MU_DIR_BWD_FILTER, __func__, handle, xDesc, x, dwDesc, dw, convDesc, dyDesc, dy,
                    requestedAlgoCount, returnedAlgoCount, perfResults, workSpace, workSpaceSizeInBytes);
}

MU_EXPORT cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnFilterDescriptor_t gradDesc,
    cudnnConvolutionBwdFilterAlgo_t algo, size_t *sizeInBytes) {
    if (MU_REAL_MISSING(cudnnGetConvolutionBackwardFilterWorkspaceSize)) return CUDNN_STATUS_NOT_INITIALIZED;
    return workspace_size(MU_DIR_BWD_FILTER, __func__, handle, xDesc, gradDesc, convDesc, dyDesc, (int)algo,
                          sizeInBytes);
}

MU_EXPORT cudnnStatus_t cudnnConvolutionBackwardFilter(
    cudnnHandle_t handle, const void *alpha, const cudnnTensorDescriptor_t xDesc, const void *x,
    const cudnnTensorDescriptor_t dyDesc, const void *dy, const cudnnConvolutionDescriptor_t convDesc,
    cudnnConvolutionBwdFilterAlgo_t algo, void *workSpace, size_t workSpaceSizeInBytes, const void *beta,
    const cudnnFilterDescriptor_t dwDesc, void *dw) {
    if (MU_REAL_MISSING(cudnnConvolutionBackwardFilter)) return CUDNN_STATUS_NOT_INITIALIZED;
    return convolution(MU_DIR_BWD_FILTER, handle, alpha, xDesc, x, dwDesc, dw, convDesc, dyDesc, dy, (int)algo,
                       workSpace, workSpaceSizeInBytes, beta);
}

/* ---- handles ---------------------------------------------------------------------------------- */

/* What the shim built or captured with a handle dies with it: a later handle may get the same
 * address (and another device), and must not inherit graphs or piece plans made for this one. */
MU_EXPORT cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) {
    if (MU_REAL_MISSING(cudnnDestroy)) return CUDNN_STATUS_NOT_INITIALIZED;
    if (!mu_guard_enter()) return mu_real()->cudnnDestroy(handle);
    if (handle != NULL && !mu_config()->disabled) mu_forget_handle(handle);
    cudnnStatus_t status = mu_real()->cudnnDestroy(handle);
    mu_guard_leave();
    return status;
}

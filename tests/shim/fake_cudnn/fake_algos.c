/*
 * The algorithm model of the cuDNN test double and the convolution entry points built on it:
 * workspace sizes, "not supported" rules, fake times, the Get_v7 / Find / FindEx queries and the
 * three cudnnConvolution* executions. README.md states the model; this file is its definition.
 *
 * The three directions share one implementation. Their tensors are mapped onto the forward
 * roles: the "x role" is x or dx, the "w role" w or dw, the "y role" y or dy.
 */
#define _POSIX_C_SOURCE 200809L

#include "fake_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PTR(p) ((uintptr_t)(const void *)(p))
#define BIT(algo) (1u << (algo))

enum {
    DEFAULT_WORKSPACE_PER_SAMPLE = 4096, /* bytes per sample per algorithm (or engine) index */
    MAX_ALGOS = 8,
    TEXT_MAX = 512,
};

/* Fixed cost of one call, so that fewer, larger micro-batches win when workspace allows. */
static const double CALL_OVERHEAD_MS = 0.01;
/* Fake throughput of algorithm 0: 1e9 multiply-adds (counted as 2 flops) per millisecond. */
static const double FLOPS_PER_MS = 1e9;

/* Written over the workspace an algorithm or engine needs; NaN as float and as double. */
static const uint32_t WORKSPACE_PATTERN = 0xFFF8DEADu;

/* What distinguishes the directions: names, algorithm counts and the family of each algorithm. */
struct direction_info {
    const char *suffix;           /* "Forward", "BackwardData", "BackwardFilter" */
    const char *role_names[3];    /* log names of the x, w and y role buffers */
    int algo_count;               /* cuDNN's *_ALGO_COUNT */
    unsigned fft_algos;           /* unsupported with stride or dilation > 1 */
    unsigned winograd_algos;      /* supported only for 3x3(x3), stride 1, dilation 1, 1 group */
    unsigned nondeterministic_algos;
};

static const struct direction_info DIRECTIONS[3] = {
    [FAKE_FWD] = {"Forward", {"x", "w", "y"}, CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
                  BIT(CUDNN_CONVOLUTION_FWD_ALGO_FFT) | BIT(CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING),
                  BIT(CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD) |
                      BIT(CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED),
                  0},
    [FAKE_BWD_DATA] = {"BackwardData", {"dx", "w", "dy"}, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
                       BIT(CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT) |
                           BIT(CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING),
                       BIT(CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD) |
                           BIT(CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED),
                       BIT(CUDNN_CONVOLUTION_BWD_DATA_ALGO_0)},
    [FAKE_BWD_FILTER] = {"BackwardFilter", {"x", "dw", "dy"},
                         CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
                         BIT(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT) |
                             BIT(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING),
                         BIT(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD) |
                             BIT(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED),
                         BIT(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0) |
                             BIT(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3)},
};

/* Direction-neutral perf result; copied into cuDNN's three (identically laid out) structs. */
struct fake_perf {
    int algo;
    cudnnStatus_t status;
    float time;
    size_t memory;
    cudnnDeterminism_t determinism;
    cudnnMathType_t math;
};

/* The descriptors of one call in forward roles. */
struct call_descriptors {
    const struct cudnnTensorStruct *x;
    const struct cudnnFilterStruct *w;
    const struct cudnnConvolutionStruct *conv;
    const struct cudnnTensorStruct *y;
};

/* The buffers of one call in forward roles. Inputs are never written through these. */
struct call_buffers {
    void *x, *w, *y;
};

/* ---------------------------------------------------------------- the model */

/* The workspace model, of the algorithms here and of the engines of fake_backend.c. */
size_t fake_workspace_bytes(int64_t index, int n)
{
    long long per_sample =
        fake_env_integer("FAKE_CUDNN_WS_PER_SAMPLE", DEFAULT_WORKSPACE_PER_SAMPLE);
    return (size_t)index * (size_t)n * (size_t)per_sample;
}

static bool unit_stride_and_dilation(const struct fake_geometry *g)
{
    for (int i = 0; i < FAKE_SPATIAL; ++i)
        if (g->stride[i] != 1 || g->dilation[i] != 1)
            return false;
    return true;
}

static bool all_filter_dims_three(const struct fake_geometry *g)
{
    for (int i = FAKE_SPATIAL - g->spatial_rank; i < FAKE_SPATIAL; ++i)
        if (g->filter[i] != 3)
            return false;
    return true;
}

static cudnnStatus_t algo_support(enum fake_direction direction, const struct fake_geometry *g,
                                  int algo)
{
    const struct direction_info *info = &DIRECTIONS[direction];
    if ((info->fft_algos & BIT(algo)) && !unit_stride_and_dilation(g))
        return CUDNN_STATUS_NOT_SUPPORTED;
    if ((info->winograd_algos & BIT(algo)) &&
        !(unit_stride_and_dilation(g) && all_filter_dims_three(g) && g->groups == 1))
        return CUDNN_STATUS_NOT_SUPPORTED;
    return CUDNN_STATUS_SUCCESS;
}

float fake_model_time_ms(const struct fake_geometry *g, int algo)
{
    double work = (double)g->n * fake_flops_per_sample(g);
    long long flops_per_ms = fake_env_integer("FAKE_CUDNN_FLOPS_PER_MS", 0);
    double throughput = flops_per_ms > 0 ? (double)flops_per_ms : FLOPS_PER_MS;
    return (float)(CALL_OVERHEAD_MS + work / (throughput * (1.0 + algo)));
}

static struct fake_perf model_perf(enum fake_direction direction, const struct fake_geometry *g,
                                   int algo)
{
    struct fake_perf perf = {
        .algo = algo,
        .status = algo_support(direction, g, algo),
        .determinism = (DIRECTIONS[direction].nondeterministic_algos & BIT(algo))
                           ? CUDNN_NON_DETERMINISTIC
                           : CUDNN_DETERMINISTIC,
        .math = g->math_type,
    };
    bool supported = perf.status == CUDNN_STATUS_SUCCESS;
    perf.memory = supported ? fake_workspace_bytes(algo, g->n) : 0;
    perf.time = supported ? fake_model_time_ms(g, algo) : -1.0f;
    return perf;
}

/* Successes first, then faster first, then lower algorithm index: a total, stable order. */
static int compare_perf(const void *left, const void *right)
{
    const struct fake_perf *a = left, *b = right;
    bool a_ok = a->status == CUDNN_STATUS_SUCCESS, b_ok = b->status == CUDNN_STATUS_SUCCESS;
    if (a_ok != b_ok)
        return a_ok ? -1 : 1;
    if (a_ok && a->time != b->time)
        return a->time < b->time ? -1 : 1;
    return a->algo - b->algo;
}

/* ---------------------------------------------------------------- helpers */

static bool computable_type(cudnnDataType_t type)
{
    return type == CUDNN_DATA_FLOAT || type == CUDNN_DATA_DOUBLE;
}

static double read_scale(const void *scale, cudnnDataType_t type)
{
    return type == CUDNN_DATA_DOUBLE ? *(const double *)scale : (double)*(const float *)scale;
}

/* The workspace pattern (see fake_internal.h), here and in the engines' executions. */
void fake_fill_workspace(void *workspace, size_t bytes)
{
    unsigned char *byte = workspace;
    for (size_t i = 0; i < bytes; ++i) {
        unsigned shift = 8u * (unsigned)(((uintptr_t)(byte + i)) % 4u); /* little-endian word */
        byte[i] = (unsigned char)(WORKSPACE_PATTERN >> shift);
    }
}

static void run_reference(enum fake_direction direction, const struct fake_geometry *g,
                          double alpha, double beta, const struct call_buffers *buffers)
{
    switch (direction) {
    case FAKE_FWD:
        fake_forward(g, alpha, buffers->x, buffers->w, beta, buffers->y);
        break;
    case FAKE_BWD_DATA:
        fake_backward_data(g, alpha, buffers->w, buffers->y, beta, buffers->x);
        break;
    case FAKE_BWD_FILTER:
        fake_backward_filter(g, alpha, buffers->x, buffers->y, beta, buffers->w);
        break;
    }
}

/* Pattern before (catches workspace over an input) and after (over the output), like a GPU
 * algorithm that uses its scratch space throughout. */
static void run_with_workspace(enum fake_direction direction, const struct fake_geometry *g,
                               double alpha, double beta, const struct call_buffers *buffers,
                               void *workspace, size_t needed)
{
    if (needed > 0)
        fake_fill_workspace(workspace, needed);
    run_reference(direction, g, alpha, beta, buffers);
    if (needed > 0)
        fake_fill_workspace(workspace, needed);
}

/* One call with everything it reads by value: run now, or when a captured graph is launched. */
struct deferred_call {
    enum fake_direction direction;
    struct fake_geometry g;
    double alpha, beta;
    struct call_buffers buffers;
    void *workspace;
    size_t needed;
    float time_ms; /* the modelled time: what the fake driver's clock advances by */
};

static void run_deferred(void *argument)
{
    const struct deferred_call *call = argument;
    long long sleep_ms = fake_env_integer("FAKE_CUDNN_SLEEP_MS", 0);
    if (sleep_ms > 0)
        nanosleep(&(struct timespec){sleep_ms / 1000, (long)(sleep_ms % 1000) * 1000000L}, NULL);
    fake_advance_clock(call->time_ms);
    run_with_workspace(call->direction, &call->g, call->alpha, call->beta, &call->buffers,
                       call->workspace, call->needed);
}

static int batch_of(const struct cudnnTensorStruct *x)
{
    return fake_tensor_ok(x) && x->rank > 0 ? x->dims[0] : 0;
}

static const char *math_of(const struct cudnnConvolutionStruct *conv)
{
    return fake_convolution_ok(conv) ? fake_math_name(conv->math_type) : "-";
}

static void function_name(char *name, size_t size, const char *format,
                          enum fake_direction direction)
{
    snprintf(name, size, format, DIRECTIONS[direction].suffix);
}

static void format_tensor(char *text, size_t size, const char *role,
                          const struct cudnnTensorStruct *tensor)
{
    char dims[128] = "-", strides[128] = "-";
    if (fake_tensor_ok(tensor) && tensor->rank > 0) {
        fake_format_ints(dims, sizeof dims, tensor->dims, tensor->rank);
        fake_format_ints(strides, sizeof strides, tensor->strides, tensor->rank);
    }
    snprintf(text, size, "%sdims=%s %sstrides=%s", role, dims, role, strides);
}

/* "algo:status:memory" for each result, comma-separated; "-" for none. */
static void format_results(char *text, size_t size, const struct fake_perf *perf, int count)
{
    size_t used = 0;
    snprintf(text, size, "-");
    for (int i = 0; i < count && used < size; ++i) {
        int written = snprintf(text + used, size - used, "%s%d:%d:%zu", i == 0 ? "" : ",",
                               perf[i].algo, (int)perf[i].status, perf[i].memory);
        if (written < 0)
            return;
        used += (size_t)written;
    }
}

/* ---------------------------------------------------------------- executions */

static cudnnStatus_t check_execution(enum fake_direction direction,
                                     const struct cudnnContext *handle, const void *alpha,
                                     const void *beta,
                                     const struct call_descriptors *descs,
                                     const struct call_buffers *buffers, int algo, void *workspace,
                                     size_t workspace_size, struct fake_geometry *g)
{
    if (!fake_handle_ok(handle) || alpha == NULL || beta == NULL || buffers->x == NULL ||
        buffers->w == NULL || buffers->y == NULL)
        return CUDNN_STATUS_BAD_PARAM;
    cudnnStatus_t status = fake_geometry_build(descs->x, descs->w, descs->conv, descs->y, g);
    if (status != CUDNN_STATUS_SUCCESS)
        return status;
    if (algo < 0 || algo >= DIRECTIONS[direction].algo_count)
        return CUDNN_STATUS_BAD_PARAM;
    if (!computable_type(g->data_type))
        return CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE;
    status = algo_support(direction, g, algo);
    if (status != CUDNN_STATUS_SUCCESS)
        return status;
    size_t needed = fake_workspace_bytes(algo, g->n);
    if (workspace_size < needed || (needed > 0 && workspace == NULL))
        return CUDNN_STATUS_BAD_PARAM;
    if (g->n == fake_env_integer("FAKE_CUDNN_FAIL_N", -1))
        return CUDNN_STATUS_EXECUTION_FAILED; /* injected failure, output untouched */
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t execute(enum fake_direction direction, const struct cudnnContext *handle,
                             const void *alpha, const void *beta,
                             const struct call_descriptors *descs,
                             const struct call_buffers *buffers, int algo, void *workspace,
                             size_t workspace_size)
{
    struct fake_geometry g;
    cudnnStatus_t status = check_execution(direction, handle, alpha, beta, descs, buffers, algo,
                                           workspace, workspace_size, &g);
    /* Read for the log even when the call fails; the x-role tensor decides float or double. */
    cudnnDataType_t scale_type = fake_tensor_ok(descs->x) ? descs->x->data_type : CUDNN_DATA_FLOAT;
    double alpha_value = alpha != NULL ? read_scale(alpha, scale_type) : 0.0;
    double beta_value = beta != NULL ? read_scale(beta, scale_type) : 0.0;
    if (status == CUDNN_STATUS_SUCCESS) {
        struct deferred_call call = {direction, g, alpha_value, beta_value, *buffers, workspace,
                                     fake_workspace_bytes(algo, g.n), fake_model_time_ms(&g, algo)};
        if (!fake_defer(handle->stream, run_deferred, &call, sizeof call))
            run_deferred(&call);
    }

    const struct direction_info *info = &DIRECTIONS[direction];
    char name[64], x_text[TEXT_MAX], y_text[TEXT_MAX];
    function_name(name, sizeof name, "cudnnConvolution%s", direction);
    format_tensor(x_text, sizeof x_text, info->role_names[0], descs->x);
    format_tensor(y_text, sizeof y_text, info->role_names[2], descs->y);
    size_t needed = algo >= 0 && algo < info->algo_count
                        ? fake_workspace_bytes(algo, batch_of(descs->x))
                        : 0;
    fake_log(name, status,
             "n=%d algo=%d math=%s ws=%zu need=%zu alpha=%.17g beta=%.17g %s=0x%" PRIxPTR
             " %s=0x%" PRIxPTR " %s=0x%" PRIxPTR " workspace=0x%" PRIxPTR " %s %s",
             batch_of(descs->x), algo, math_of(descs->conv), workspace_size, needed, alpha_value,
             beta_value, info->role_names[0], PTR(buffers->x), info->role_names[1],
             PTR(buffers->w), info->role_names[2], PTR(buffers->y), PTR(workspace), x_text,
             y_text);
    return status;
}

cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t handle, const void *alpha,
                                      const cudnnTensorDescriptor_t xDesc, const void *x,
                                      const cudnnFilterDescriptor_t wDesc, const void *w,
                                      const cudnnConvolutionDescriptor_t convDesc,
                                      cudnnConvolutionFwdAlgo_t algo, void *workSpace,
                                      size_t workSpaceSizeInBytes, const void *beta,
                                      const cudnnTensorDescriptor_t yDesc, void *y)
{
    const struct call_descriptors descs = {xDesc, wDesc, convDesc, yDesc};
    const struct call_buffers buffers = {(void *)x, (void *)w, y};
    return execute(FAKE_FWD, handle, alpha, beta, &descs, &buffers, (int)algo, workSpace,
                   workSpaceSizeInBytes);
}

cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t handle, const void *alpha,
                                           const cudnnFilterDescriptor_t wDesc, const void *w,
                                           const cudnnTensorDescriptor_t dyDesc, const void *dy,
                                           const cudnnConvolutionDescriptor_t convDesc,
                                           cudnnConvolutionBwdDataAlgo_t algo, void *workSpace,
                                           size_t workSpaceSizeInBytes, const void *beta,
                                           const cudnnTensorDescriptor_t dxDesc, void *dx)
{
    const struct call_descriptors descs = {dxDesc, wDesc, convDesc, dyDesc};
    const struct call_buffers buffers = {dx, (void *)w, (void *)dy};
    return execute(FAKE_BWD_DATA, handle, alpha, beta, &descs, &buffers, (int)algo, workSpace,
                   workSpaceSizeInBytes);
}

cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t handle, const void *alpha,
                                             const cudnnTensorDescriptor_t xDesc, const void *x,
                                             const cudnnTensorDescriptor_t dyDesc, const void *dy,
                                             const cudnnConvolutionDescriptor_t convDesc,
                                             cudnnConvolutionBwdFilterAlgo_t algo, void *workSpace,
                                             size_t workSpaceSizeInBytes, const void *beta,
                                             const cudnnFilterDescriptor_t dwDesc, void *dw)
{
    const struct call_descriptors descs = {xDesc, dwDesc, convDesc, dyDesc};
    const struct call_buffers buffers = {(void *)x, dw, (void *)dy};
    return execute(FAKE_BWD_FILTER, handle, alpha, beta, &descs, &buffers, (int)algo, workSpace,
                   workSpaceSizeInBytes);
}

/* ---------------------------------------------------------------- workspace size queries */

static cudnnStatus_t workspace_size(enum fake_direction direction,
                                    const struct cudnnContext *handle,
                                    const struct call_descriptors *descs, int algo, size_t *size)
{
    struct fake_geometry g;
    cudnnStatus_t status = CUDNN_STATUS_BAD_PARAM;
    if (fake_handle_ok(handle) && size != NULL)
        status = fake_geometry_build(descs->x, descs->w, descs->conv, descs->y, &g);
    if (status == CUDNN_STATUS_SUCCESS && (algo < 0 || algo >= DIRECTIONS[direction].algo_count))
        status = CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS)
        status = algo_support(direction, &g, algo);
    if (status == CUDNN_STATUS_SUCCESS)
        *size = fake_workspace_bytes(algo, g.n);

    char name[80];
    function_name(name, sizeof name, "cudnnGetConvolution%sWorkspaceSize", direction);
    fake_log(name, status, "n=%d algo=%d size=%zu", batch_of(descs->x), algo,
             status == CUDNN_STATUS_SUCCESS ? *size : 0);
    return status;
}

cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(cudnnHandle_t handle,
                                                      const cudnnTensorDescriptor_t xDesc,
                                                      const cudnnFilterDescriptor_t wDesc,
                                                      const cudnnConvolutionDescriptor_t convDesc,
                                                      const cudnnTensorDescriptor_t yDesc,
                                                      cudnnConvolutionFwdAlgo_t algo,
                                                      size_t *sizeInBytes)
{
    const struct call_descriptors descs = {xDesc, wDesc, convDesc, yDesc};
    return workspace_size(FAKE_FWD, handle, &descs, (int)algo, sizeInBytes);
}

cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t dxDesc,
    cudnnConvolutionBwdDataAlgo_t algo, size_t *sizeInBytes)
{
    const struct call_descriptors descs = {dxDesc, wDesc, convDesc, dyDesc};
    return workspace_size(FAKE_BWD_DATA, handle, &descs, (int)algo, sizeInBytes);
}

cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnFilterDescriptor_t gradDesc,
    cudnnConvolutionBwdFilterAlgo_t algo, size_t *sizeInBytes)
{
    const struct call_descriptors descs = {xDesc, gradDesc, convDesc, dyDesc};
    return workspace_size(FAKE_BWD_FILTER, handle, &descs, (int)algo, sizeInBytes);
}

/* ---------------------------------------------------------------- algorithm max counts */

static cudnnStatus_t max_count(enum fake_direction direction, const struct cudnnContext *handle,
                               int *count)
{
    cudnnStatus_t status = fake_handle_ok(handle) && count != NULL ? CUDNN_STATUS_SUCCESS
                                                                   : CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS)
        *count = DIRECTIONS[direction].algo_count;
    char name[80];
    function_name(name, sizeof name, "cudnnGetConvolution%sAlgorithmMaxCount", direction);
    fake_log(name, status, "count=%d", status == CUDNN_STATUS_SUCCESS ? *count : 0);
    return status;
}

cudnnStatus_t cudnnGetConvolutionForwardAlgorithmMaxCount(cudnnHandle_t handle, int *count)
{
    return max_count(FAKE_FWD, handle, count);
}

cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithmMaxCount(cudnnHandle_t handle, int *count)
{
    return max_count(FAKE_BWD_DATA, handle, count);
}

cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(cudnnHandle_t handle, int *count)
{
    return max_count(FAKE_BWD_FILTER, handle, count);
}

/* ---------------------------------------------------------------- Get_v7, Find, FindEx */

enum query_kind { QUERY_GET_V7, QUERY_FIND, QUERY_FIND_EX };

/* The FindEx-only part of a query: the caller's buffers and workspace. */
struct find_ex_args {
    struct call_buffers buffers;
    void *workspace;
    size_t workspace_size;
};

/* FindEx: runs every supported algorithm whose workspace fits, on the caller's buffers. */
static void run_candidates(enum fake_direction direction, const struct fake_geometry *g,
                           const struct find_ex_args *args, struct fake_perf perf[], int count)
{
    size_t available = args->workspace == NULL ? 0 : args->workspace_size;
    for (int i = 0; i < count; ++i) {
        if (perf[i].status != CUDNN_STATUS_SUCCESS)
            continue;
        if (perf[i].memory > available) {
            /* What cuDNN reports when it cannot get the workspace (the old ALLOC_FAILED). */
            perf[i].status = CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED;
            perf[i].time = -1.0f;
            continue;
        }
        run_with_workspace(direction, g, 1.0, 0.0, &args->buffers, args->workspace,
                           perf[i].memory);
    }
}

static cudnnStatus_t query(enum fake_direction direction, enum query_kind kind,
                           const struct cudnnContext *handle, const struct call_descriptors *descs,
                           const struct find_ex_args *find_ex, int requested, int *returned,
                           struct fake_perf results[])
{
    if (!fake_handle_ok(handle) || returned == NULL || requested < 1)
        return CUDNN_STATUS_BAD_PARAM;
    if (find_ex != NULL && (find_ex->buffers.x == NULL || find_ex->buffers.w == NULL ||
                            find_ex->buffers.y == NULL))
        return CUDNN_STATUS_BAD_PARAM;
    struct fake_geometry g;
    cudnnStatus_t status = fake_geometry_build(descs->x, descs->w, descs->conv, descs->y, &g);
    if (status != CUDNN_STATUS_SUCCESS)
        return status;
    if (kind == QUERY_FIND_EX && !computable_type(g.data_type))
        return CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE;

    int count = DIRECTIONS[direction].algo_count;
    struct fake_perf perf[MAX_ALGOS];
    for (int algo = 0; algo < count; ++algo)
        perf[algo] = model_perf(direction, &g, algo);
    if (kind == QUERY_FIND_EX)
        run_candidates(direction, &g, find_ex, perf, count);
    qsort(perf, (size_t)count, sizeof perf[0], compare_perf);

    *returned = requested < count ? requested : count;
    memcpy(results, perf, (size_t)*returned * sizeof perf[0]);
    return CUDNN_STATUS_SUCCESS;
}

static void log_query(enum fake_direction direction, enum query_kind kind, cudnnStatus_t status,
                      const struct call_descriptors *descs, const struct find_ex_args *find_ex,
                      int requested, int returned, const struct fake_perf results[])
{
    static const char *const FORMATS[] = {
        [QUERY_GET_V7] = "cudnnGetConvolution%sAlgorithm_v7",
        [QUERY_FIND] = "cudnnFindConvolution%sAlgorithm",
        [QUERY_FIND_EX] = "cudnnFindConvolution%sAlgorithmEx",
    };
    const struct direction_info *info = &DIRECTIONS[direction];
    char name[80], results_text[TEXT_MAX], extra[TEXT_MAX] = "";
    function_name(name, sizeof name, FORMATS[kind], direction);
    format_results(results_text, sizeof results_text, results,
                   status == CUDNN_STATUS_SUCCESS ? returned : 0);
    if (find_ex != NULL)
        snprintf(extra, sizeof extra,
                 " ws=%zu workspace=0x%" PRIxPTR " %s=0x%" PRIxPTR " %s=0x%" PRIxPTR
                 " %s=0x%" PRIxPTR,
                 find_ex->workspace_size, PTR(find_ex->workspace), info->role_names[0],
                 PTR(find_ex->buffers.x), info->role_names[1], PTR(find_ex->buffers.w),
                 info->role_names[2], PTR(find_ex->buffers.y));
    fake_log(name, status, "n=%d math=%s requested=%d returned=%d results=%s%s",
             batch_of(descs->x), math_of(descs->conv), requested,
             status == CUDNN_STATUS_SUCCESS ? returned : 0, results_text, extra);
}

/* Runs one query, copies its results into the caller's typed perf array (the three perf structs
 * differ in type only), logs it and returns its status from the calling function. */
#define RETURN_QUERY(direction, kind, handle, descs, find_ex, requested, returned, out, algo_type) \
    do {                                                                                           \
        struct fake_perf perf_[MAX_ALGOS];                                                         \
        int count_ = 0;                                                                            \
        cudnnStatus_t status_ = (out) == NULL ? CUDNN_STATUS_BAD_PARAM                             \
                                              : query(direction, kind, handle, descs, find_ex,     \
                                                      requested, &count_, perf_);                  \
        for (int i_ = 0; status_ == CUDNN_STATUS_SUCCESS && i_ < count_; ++i_) {                   \
            memset(&(out)[i_], 0, sizeof (out)[i_]);                                               \
            (out)[i_].algo = (algo_type)perf_[i_].algo;                                            \
            (out)[i_].status = perf_[i_].status;                                                   \
            (out)[i_].time = perf_[i_].time;                                                       \
            (out)[i_].memory = perf_[i_].memory;                                                   \
            (out)[i_].determinism = perf_[i_].determinism;                                         \
            (out)[i_].mathType = perf_[i_].math;                                                   \
        }                                                                                          \
        if (status_ == CUDNN_STATUS_SUCCESS)                                                       \
            *(returned) = count_;                                                                  \
        log_query(direction, kind, status_, descs, find_ex, requested, count_, perf_);             \
        return status_;                                                                            \
    } while (0)

cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t srcDesc,
    const cudnnFilterDescriptor_t filterDesc, const cudnnConvolutionDescriptor_t convDesc,
    const cudnnTensorDescriptor_t destDesc, const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionFwdAlgoPerf_t *perfResults)
{
    const struct call_descriptors descs = {srcDesc, filterDesc, convDesc, destDesc};
    RETURN_QUERY(FAKE_FWD, QUERY_GET_V7, handle, &descs, NULL, requestedAlgoCount,
                 returnedAlgoCount, perfResults, cudnnConvolutionFwdAlgo_t);
}

cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t filterDesc,
    const cudnnTensorDescriptor_t diffDesc, const cudnnConvolutionDescriptor_t convDesc,
    const cudnnTensorDescriptor_t gradDesc, const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionBwdDataAlgoPerf_t *perfResults)
{
    const struct call_descriptors descs = {gradDesc, filterDesc, convDesc, diffDesc};
    RETURN_QUERY(FAKE_BWD_DATA, QUERY_GET_V7, handle, &descs, NULL, requestedAlgoCount,
                 returnedAlgoCount, perfResults, cudnnConvolutionBwdDataAlgo_t);
}

cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t srcDesc,
    const cudnnTensorDescriptor_t diffDesc, const cudnnConvolutionDescriptor_t convDesc,
    const cudnnFilterDescriptor_t gradDesc, const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionBwdFilterAlgoPerf_t *perfResults)
{
    const struct call_descriptors descs = {srcDesc, gradDesc, convDesc, diffDesc};
    RETURN_QUERY(FAKE_BWD_FILTER, QUERY_GET_V7, handle, &descs, NULL, requestedAlgoCount,
                 returnedAlgoCount, perfResults, cudnnConvolutionBwdFilterAlgo_t);
}

cudnnStatus_t cudnnFindConvolutionForwardAlgorithm(cudnnHandle_t handle,
                                                   const cudnnTensorDescriptor_t xDesc,
                                                   const cudnnFilterDescriptor_t wDesc,
                                                   const cudnnConvolutionDescriptor_t convDesc,
                                                   const cudnnTensorDescriptor_t yDesc,
                                                   const int requestedAlgoCount,
                                                   int *returnedAlgoCount,
                                                   cudnnConvolutionFwdAlgoPerf_t *perfResults)
{
    const struct call_descriptors descs = {xDesc, wDesc, convDesc, yDesc};
    RETURN_QUERY(FAKE_FWD, QUERY_FIND, handle, &descs, NULL, requestedAlgoCount, returnedAlgoCount,
                 perfResults, cudnnConvolutionFwdAlgo_t);
}

cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithm(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t dxDesc,
    const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionBwdDataAlgoPerf_t *perfResults)
{
    const struct call_descriptors descs = {dxDesc, wDesc, convDesc, dyDesc};
    RETURN_QUERY(FAKE_BWD_DATA, QUERY_FIND, handle, &descs, NULL, requestedAlgoCount,
                 returnedAlgoCount, perfResults, cudnnConvolutionBwdDataAlgo_t);
}

cudnnStatus_t cudnnFindConvolutionBackwardFilterAlgorithm(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const cudnnTensorDescriptor_t dyDesc,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnFilterDescriptor_t dwDesc,
    const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionBwdFilterAlgoPerf_t *perfResults)
{
    const struct call_descriptors descs = {xDesc, dwDesc, convDesc, dyDesc};
    RETURN_QUERY(FAKE_BWD_FILTER, QUERY_FIND, handle, &descs, NULL, requestedAlgoCount,
                 returnedAlgoCount, perfResults, cudnnConvolutionBwdFilterAlgo_t);
}

cudnnStatus_t cudnnFindConvolutionForwardAlgorithmEx(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const void *x,
    const cudnnFilterDescriptor_t wDesc, const void *w, const cudnnConvolutionDescriptor_t convDesc,
    const cudnnTensorDescriptor_t yDesc, void *y, const int requestedAlgoCount,
    int *returnedAlgoCount, cudnnConvolutionFwdAlgoPerf_t *perfResults, void *workSpace,
    size_t workSpaceSizeInBytes)
{
    const struct call_descriptors descs = {xDesc, wDesc, convDesc, yDesc};
    const struct find_ex_args find_ex = {{(void *)x, (void *)w, y}, workSpace,
                                         workSpaceSizeInBytes};
    RETURN_QUERY(FAKE_FWD, QUERY_FIND_EX, handle, &descs, &find_ex, requestedAlgoCount,
                 returnedAlgoCount, perfResults, cudnnConvolutionFwdAlgo_t);
}

cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithmEx(
    cudnnHandle_t handle, const cudnnFilterDescriptor_t wDesc, const void *w,
    const cudnnTensorDescriptor_t dyDesc, const void *dy,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnTensorDescriptor_t dxDesc, void *dx,
    const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionBwdDataAlgoPerf_t *perfResults, void *workSpace, size_t workSpaceSizeInBytes)
{
    const struct call_descriptors descs = {dxDesc, wDesc, convDesc, dyDesc};
    const struct find_ex_args find_ex = {{dx, (void *)w, (void *)dy}, workSpace,
                                         workSpaceSizeInBytes};
    RETURN_QUERY(FAKE_BWD_DATA, QUERY_FIND_EX, handle, &descs, &find_ex, requestedAlgoCount,
                 returnedAlgoCount, perfResults, cudnnConvolutionBwdDataAlgo_t);
}

cudnnStatus_t cudnnFindConvolutionBackwardFilterAlgorithmEx(
    cudnnHandle_t handle, const cudnnTensorDescriptor_t xDesc, const void *x,
    const cudnnTensorDescriptor_t dyDesc, const void *y,
    const cudnnConvolutionDescriptor_t convDesc, const cudnnFilterDescriptor_t dwDesc, void *dw,
    const int requestedAlgoCount, int *returnedAlgoCount,
    cudnnConvolutionBwdFilterAlgoPerf_t *perfResults, void *workSpace, size_t workSpaceSizeInBytes)
{
    const struct call_descriptors descs = {xDesc, dwDesc, convDesc, dyDesc};
    const struct find_ex_args find_ex = {{(void *)x, dw, (void *)y}, workSpace,
                                         workSpaceSizeInBytes};
    RETURN_QUERY(FAKE_BWD_FILTER, QUERY_FIND_EX, handle, &descs, &find_ex, requestedAlgoCount,
                 returnedAlgoCount, perfResults, cudnnConvolutionBwdFilterAlgo_t);
}

/*
 * liblocaluser.so: a cuDNN user in a local dlopen scope, like PyTorch's libtorch_cuda.so.
 *
 * Linked against libcudnn.so.9 (the test double) and loaded by local_scope_main with
 * dlopen(RTLD_NOW | RTLD_LOCAL), so libcudnn.so.9 enters the process as this library's
 * dependency, in its local scope only: an LD_PRELOADed shim's dlsym(RTLD_NEXT, ...) does not see
 * it, while this library's own calls still bind to the shim (the global scope comes first).
 * Exports local_user_convolve (local_scope_user.h).
 */
#include <stdlib.h>

#include <cudnn.h>

#include "local_scope_user.h"

#define RANK 4

typedef struct {
    cudnnHandle_t handle;
    cudnnTensorDescriptor_t x, y;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
} cudnn_objects;

/* Reals in [-1, 1) from a 32-bit LCG: the same data for the same seed in every process. */
static void fill_random(float *data, size_t count, unsigned *state) {
    for (size_t i = 0; i < count; i++) {
        *state = *state * 1664525u + 1013904223u;
        data[i] = (float)(*state >> 8) / (float)(1u << 23) - 1.0f;
    }
}

static void packed_nchw_strides(const int dims[RANK], int strides[RANK]) {
    strides[RANK - 1] = 1;
    for (int i = RANK - 2; i >= 0; i--) strides[i] = strides[i + 1] * dims[i + 1];
}

/* Creates and sets everything a convolution needs, as PyTorch does (Nd calls, FMA math for
 * float without TF32). Returns the first failing status. */
static cudnnStatus_t set_up(const local_conv_request *r, cudnn_objects *o) {
    const int x_dims[RANK] = {r->n, r->c, r->h, r->w}, y_dims[RANK] = {r->n, r->k, r->h, r->w};
    const int w_dims[RANK] = {r->k, r->c, r->filter, r->filter};
    const int pad[2] = {r->filter / 2, r->filter / 2}, ones[2] = {1, 1};
    int x_strides[RANK], y_strides[RANK];
    packed_nchw_strides(x_dims, x_strides);
    packed_nchw_strides(y_dims, y_strides);
    cudnnStatus_t status;
#define TRY(call) if ((status = (call)) != CUDNN_STATUS_SUCCESS) return status
    TRY(cudnnCreate(&o->handle));
    TRY(cudnnCreateTensorDescriptor(&o->x));
    TRY(cudnnCreateTensorDescriptor(&o->y));
    TRY(cudnnCreateFilterDescriptor(&o->w));
    TRY(cudnnCreateConvolutionDescriptor(&o->conv));
    TRY(cudnnSetTensorNdDescriptor(o->x, CUDNN_DATA_FLOAT, RANK, x_dims, x_strides));
    TRY(cudnnSetTensorNdDescriptor(o->y, CUDNN_DATA_FLOAT, RANK, y_dims, y_strides));
    TRY(cudnnSetFilterNdDescriptor(o->w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, RANK, w_dims));
    TRY(cudnnSetConvolutionNdDescriptor(o->conv, 2, pad, ones, ones, CUDNN_CROSS_CORRELATION,
                                        CUDNN_DATA_FLOAT));
    TRY(cudnnSetConvolutionMathType(o->conv, CUDNN_FMA_MATH));
#undef TRY
    return CUDNN_STATUS_SUCCESS;
}

/* Destroys what set_up created, also after it failed half-way (the rest is NULL). */
static void tear_down(cudnn_objects *o) {
    if (o->conv != NULL) cudnnDestroyConvolutionDescriptor(o->conv);
    if (o->w != NULL) cudnnDestroyFilterDescriptor(o->w);
    if (o->y != NULL) cudnnDestroyTensorDescriptor(o->y);
    if (o->x != NULL) cudnnDestroyTensorDescriptor(o->x);
    if (o->handle != NULL) cudnnDestroy(o->handle);
}

static void query_algorithms(const cudnn_objects *o, local_conv_result *result) {
    int requested = 0;
    if (cudnnGetConvolutionForwardAlgorithmMaxCount(o->handle, &requested) != CUDNN_STATUS_SUCCESS ||
        requested < 1)
        requested = CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
    cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
    if (requested > CUDNN_CONVOLUTION_FWD_ALGO_COUNT) requested = CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
    result->returned = 0;
    result->get_v7_status = (int)cudnnGetConvolutionForwardAlgorithm_v7(
        o->handle, o->x, o->w, o->conv, o->y, requested, &result->returned, perf);
    if (result->get_v7_status == CUDNN_STATUS_SUCCESS && result->returned > 0) {
        result->first_algo = (int)perf[0].algo;
        result->first_status = (int)perf[0].status;
        result->first_memory = perf[0].memory;
    }
}

__attribute__((visibility("default"))) int local_user_convolve(const local_conv_request *r, float *y,
                                                              local_conv_result *result) {
    if (r->n < 1 || r->c < 1 || r->h < 1 || r->w < 1 || r->k < 1 || r->filter < 1 ||
        r->filter % 2 == 0)
        return -1;
    *result = (local_conv_result){.first_algo = -1, .first_status = -1};
    size_t x_count = (size_t)r->n * r->c * r->h * r->w;
    size_t w_count = (size_t)r->k * r->c * r->filter * r->filter;
    float *x = malloc(x_count * sizeof *x), *w = malloc(w_count * sizeof *w);
    void *workspace = r->workspace_bytes ? malloc(r->workspace_bytes) : NULL;
    if (x == NULL || w == NULL || (r->workspace_bytes && workspace == NULL)) {
        free(x), free(w), free(workspace);
        return -1;
    }
    unsigned state = r->seed;
    fill_random(x, x_count, &state);
    fill_random(w, w_count, &state);

    cudnn_objects o = {0};
    result->setup_status = (int)set_up(r, &o);
    result->get_v7_status = result->forward_status = -1;
    if (result->setup_status == CUDNN_STATUS_SUCCESS) {
        query_algorithms(&o, result);
        const float alpha = 1.0f, beta = 0.0f;
        result->forward_status = (int)cudnnConvolutionForward(
            o.handle, &alpha, o.x, x, o.w, w, o.conv, (cudnnConvolutionFwdAlgo_t)r->algo, workspace,
            r->workspace_bytes, &beta, o.y, y);
    }
    tear_down(&o);
    free(x), free(w), free(workspace);
    return 0;
}

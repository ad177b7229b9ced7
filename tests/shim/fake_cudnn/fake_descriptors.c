/*
 * Library-level calls (version, errors, handle, stream) and the tensor, filter and convolution
 * descriptors of the cuDNN test double. Descriptors are plain heap structs; every call is
 * reentrant and logs one line (see README.md, "Call log").
 */
#define _POSIX_C_SOURCE 200809L

#include "fake_internal.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#define PTR(p) ((uintptr_t)(const void *)(p))

enum { DEFAULT_VERSION = 91900, INTS_TEXT = 128 };

/* ---------------------------------------------------------------- validation */

bool fake_handle_ok(const struct cudnnContext *handle)
{
    return handle != NULL && handle->magic == FAKE_MAGIC_HANDLE;
}

bool fake_tensor_ok(const struct cudnnTensorStruct *desc)
{
    return desc != NULL && desc->magic == FAKE_MAGIC_TENSOR;
}

bool fake_filter_ok(const struct cudnnFilterStruct *desc)
{
    return desc != NULL && desc->magic == FAKE_MAGIC_FILTER;
}

bool fake_convolution_ok(const struct cudnnConvolutionStruct *desc)
{
    return desc != NULL && desc->magic == FAKE_MAGIC_CONVOLUTION;
}

/* Bytes per element of the data types a descriptor may carry; 0 for those the double refuses. */
static size_t element_size(cudnnDataType_t type)
{
    switch (type) {
    case CUDNN_DATA_FLOAT:
    case CUDNN_DATA_INT32:
        return 4;
    case CUDNN_DATA_DOUBLE:
    case CUDNN_DATA_INT64:
        return 8;
    case CUDNN_DATA_HALF:
    case CUDNN_DATA_BFLOAT16:
        return 2;
    case CUDNN_DATA_INT8:
    case CUDNN_DATA_UINT8:
        return 1;
    default:
        return 0;
    }
}

static bool rank_ok(int rank)
{
    return rank >= 3 && rank <= CUDNN_DIM_MAX;
}

static bool all_positive(const int *values, int count)
{
    for (int i = 0; i < count; ++i)
        if (values[i] <= 0)
            return false;
    return true;
}

/* Strides of a packed tensor in (N, C, spatial...) order; NHWC puts C innermost. */
static void packed_strides(cudnnTensorFormat_t format, int rank, const int dims[],
                           int64_t strides[])
{
    int64_t running = 1;
    if (format == CUDNN_TENSOR_NHWC) {
        strides[1] = running;
        running *= dims[1];
        for (int i = rank - 1; i >= 2; --i) {
            strides[i] = running;
            running *= dims[i];
        }
        strides[0] = running;
        return;
    }
    for (int i = rank - 1; i >= 0; --i) {
        strides[i] = running;
        running *= dims[i];
    }
}

void fake_filter_strides(const struct cudnnFilterStruct *filter, int64_t strides[])
{
    packed_strides(filter->format, filter->rank, filter->dims, strides);
}

/* ---------------------------------------------------------------- library and handle */

size_t cudnnGetVersion(void)
{
    size_t version = (size_t)fake_env_integer("FAKE_CUDNN_VERSION", DEFAULT_VERSION);
    fake_log("cudnnGetVersion", CUDNN_STATUS_SUCCESS, "version=%zu", version);
    return version;
}

const char *cudnnGetErrorString(cudnnStatus_t status)
{
    switch ((int)status) {
#define NAME(code)                                                                                 \
    case code:                                                                                     \
        return #code;
        NAME(CUDNN_STATUS_SUCCESS)
        NAME(CUDNN_STATUS_NOT_INITIALIZED)
        NAME(CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH)
        NAME(CUDNN_STATUS_DEPRECATED)
        NAME(CUDNN_STATUS_BAD_PARAM)
        NAME(CUDNN_STATUS_BAD_PARAM_NULL_POINTER)
        NAME(CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND)
        NAME(CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT)
        NAME(CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH)
        NAME(CUDNN_STATUS_NOT_SUPPORTED)
        NAME(CUDNN_STATUS_NOT_SUPPORTED_SHAPE)
        NAME(CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE)
        NAME(CUDNN_STATUS_NOT_SUPPORTED_LAYOUT)
        NAME(CUDNN_STATUS_INTERNAL_ERROR)
        NAME(CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED)
        NAME(CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED)
        NAME(CUDNN_STATUS_EXECUTION_FAILED)
#undef NAME
    }
    return "CUDNN_STATUS_UNKNOWN (fake cuDNN)";
}

cudnnStatus_t cudnnCreate(cudnnHandle_t *handle)
{
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    if (handle == NULL) {
        status = CUDNN_STATUS_BAD_PARAM;
    } else {
        struct cudnnContext *created = calloc(1, sizeof *created);
        if (created == NULL) {
            status = CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED;
        } else {
            created->magic = FAKE_MAGIC_HANDLE;
            *handle = created;
        }
    }
    fake_log("cudnnCreate", status, "handle=0x%" PRIxPTR,
             status == CUDNN_STATUS_SUCCESS ? PTR(*handle) : 0);
    return status;
}

cudnnStatus_t cudnnDestroy(cudnnHandle_t handle)
{
    cudnnStatus_t status = fake_handle_ok(handle) ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_BAD_PARAM;
    fake_log("cudnnDestroy", status, "handle=0x%" PRIxPTR, PTR(handle));
    if (status == CUDNN_STATUS_SUCCESS) {
        handle->magic = FAKE_MAGIC_DEAD;
        free(handle);
    }
    return status;
}

cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t streamId)
{
    cudnnStatus_t status = fake_handle_ok(handle) ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS)
        handle->stream = streamId;
    fake_log("cudnnSetStream", status, "handle=0x%" PRIxPTR " stream=0x%" PRIxPTR, PTR(handle),
             PTR(streamId));
    return status;
}

cudnnStatus_t cudnnGetStream(cudnnHandle_t handle, cudaStream_t *streamId)
{
    cudnnStatus_t status = fake_handle_ok(handle) && streamId != NULL ? CUDNN_STATUS_SUCCESS
                                                                      : CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS)
        *streamId = handle->stream;
    fake_log("cudnnGetStream", status, "handle=0x%" PRIxPTR " stream=0x%" PRIxPTR, PTR(handle),
             status == CUDNN_STATUS_SUCCESS ? PTR(*streamId) : 0);
    return status;
}

/* ---------------------------------------------------------------- tensor descriptors */

cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t *tensorDesc)
{
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    struct cudnnTensorStruct *created = NULL;
    if (tensorDesc == NULL)
        status = CUDNN_STATUS_BAD_PARAM;
    else if ((created = calloc(1, sizeof *created)) == NULL)
        status = CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED;
    else {
        created->magic = FAKE_MAGIC_TENSOR;
        *tensorDesc = created;
    }
    fake_log("cudnnCreateTensorDescriptor", status, "desc=0x%" PRIxPTR, PTR(created));
    return status;
}

cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t tensorDesc)
{
    /* cuDNN accepts NULL here (a no-op), as free() does. */
    cudnnStatus_t status = tensorDesc == NULL || fake_tensor_ok(tensorDesc) ? CUDNN_STATUS_SUCCESS
                                                                           : CUDNN_STATUS_BAD_PARAM;
    fake_log("cudnnDestroyTensorDescriptor", status, "desc=0x%" PRIxPTR, PTR(tensorDesc));
    if (status == CUDNN_STATUS_SUCCESS && tensorDesc != NULL) {
        tensorDesc->magic = FAKE_MAGIC_DEAD;
        free(tensorDesc);
    }
    return status;
}

/* Validates and stores an explicit-stride tensor; shared by all tensor Set calls. */
static cudnnStatus_t set_tensor(struct cudnnTensorStruct *desc, cudnnDataType_t type, int rank,
                                const int dims[], const int64_t strides[])
{
    if (!fake_tensor_ok(desc) || dims == NULL)
        return CUDNN_STATUS_BAD_PARAM;
    if (!rank_ok(rank))
        return CUDNN_STATUS_NOT_SUPPORTED;
    if (element_size(type) == 0)
        return CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE;
    if (!all_positive(dims, rank))
        return CUDNN_STATUS_BAD_PARAM;
    int64_t elements = 1;
    for (int i = 0; i < rank; ++i) {
        if (strides[i] <= 0 || strides[i] > INT32_MAX)
            return CUDNN_STATUS_BAD_PARAM;
        elements *= dims[i];
        if (elements > INT32_MAX)
            return CUDNN_STATUS_NOT_SUPPORTED; /* cuDNN's 2 Gi-element limit */
    }
    desc->data_type = type;
    desc->rank = rank;
    for (int i = 0; i < rank; ++i) {
        desc->dims[i] = dims[i];
        desc->strides[i] = (int)strides[i];
    }
    return CUDNN_STATUS_SUCCESS;
}

static void log_tensor_set(const char *function, cudnnStatus_t status,
                           const struct cudnnTensorStruct *desc, cudnnDataType_t type, int rank,
                           const int dims[])
{
    char dims_text[INTS_TEXT], strides_text[INTS_TEXT];
    bool stored = status == CUDNN_STATUS_SUCCESS;
    fake_format_ints(dims_text, sizeof dims_text, dims, dims == NULL || !rank_ok(rank) ? 0 : rank);
    fake_format_ints(strides_text, sizeof strides_text, stored ? desc->strides : NULL,
                     stored ? desc->rank : 0);
    fake_log(function, status, "desc=0x%" PRIxPTR " dt=%d dims=%s strides=%s", PTR(desc),
             (int)type, dims_text, strides_text);
}

static cudnnStatus_t set_packed_tensor(struct cudnnTensorStruct *desc, cudnnTensorFormat_t format,
                                       cudnnDataType_t type, int rank, const int dims[])
{
    if (!fake_tensor_ok(desc) || dims == NULL)
        return CUDNN_STATUS_BAD_PARAM;
    if (format == CUDNN_TENSOR_NCHW_VECT_C)
        return CUDNN_STATUS_NOT_SUPPORTED_LAYOUT; /* vectorised int8 layouts are not faked */
    if (format != CUDNN_TENSOR_NCHW && format != CUDNN_TENSOR_NHWC)
        return CUDNN_STATUS_BAD_PARAM;
    if (!rank_ok(rank))
        return CUDNN_STATUS_NOT_SUPPORTED;
    int64_t strides[CUDNN_DIM_MAX];
    packed_strides(format, rank, dims, strides);
    return set_tensor(desc, type, rank, dims, strides);
}

cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t tensorDesc,
                                         cudnnTensorFormat_t format, cudnnDataType_t dataType,
                                         int n, int c, int h, int w)
{
    const int dims[4] = {n, c, h, w};
    cudnnStatus_t status = set_packed_tensor(tensorDesc, format, dataType, 4, dims);
    log_tensor_set("cudnnSetTensor4dDescriptor", status, tensorDesc, dataType, 4, dims);
    return status;
}

cudnnStatus_t cudnnSetTensor4dDescriptorEx(cudnnTensorDescriptor_t tensorDesc,
                                           cudnnDataType_t dataType, int n, int c, int h, int w,
                                           int nStride, int cStride, int hStride, int wStride)
{
    const int dims[4] = {n, c, h, w};
    const int64_t strides[4] = {nStride, cStride, hStride, wStride};
    cudnnStatus_t status = set_tensor(tensorDesc, dataType, 4, dims, strides);
    log_tensor_set("cudnnSetTensor4dDescriptorEx", status, tensorDesc, dataType, 4, dims);
    return status;
}

cudnnStatus_t cudnnSetTensorNdDescriptor(cudnnTensorDescriptor_t tensorDesc,
                                         cudnnDataType_t dataType, int nbDims, const int dimA[],
                                         const int strideA[])
{
    cudnnStatus_t status = CUDNN_STATUS_BAD_PARAM;
    if (strideA != NULL && rank_ok(nbDims)) {
        int64_t strides[CUDNN_DIM_MAX];
        for (int i = 0; i < nbDims; ++i)
            strides[i] = strideA[i];
        status = set_tensor(tensorDesc, dataType, nbDims, dimA, strides);
    } else if (strideA != NULL) {
        status = CUDNN_STATUS_NOT_SUPPORTED;
    }
    log_tensor_set("cudnnSetTensorNdDescriptor", status, tensorDesc, dataType, nbDims, dimA);
    return status;
}

cudnnStatus_t cudnnSetTensorNdDescriptorEx(cudnnTensorDescriptor_t tensorDesc,
                                           cudnnTensorFormat_t format, cudnnDataType_t dataType,
                                           int nbDims, const int dimA[])
{
    cudnnStatus_t status = set_packed_tensor(tensorDesc, format, dataType, nbDims, dimA);
    log_tensor_set("cudnnSetTensorNdDescriptorEx", status, tensorDesc, dataType, nbDims, dimA);
    return status;
}

cudnnStatus_t cudnnGetTensor4dDescriptor(const cudnnTensorDescriptor_t tensorDesc,
                                         cudnnDataType_t *dataType, int *n, int *c, int *h, int *w,
                                         int *nStride, int *cStride, int *hStride, int *wStride)
{
    int *const dims[4] = {n, c, h, w};
    int *const strides[4] = {nStride, cStride, hStride, wStride};
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    if (!fake_tensor_ok(tensorDesc) || tensorDesc->rank != 4 || dataType == NULL)
        status = CUDNN_STATUS_BAD_PARAM;
    for (int i = 0; i < 4 && status == CUDNN_STATUS_SUCCESS; ++i)
        if (dims[i] == NULL || strides[i] == NULL)
            status = CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS) {
        *dataType = tensorDesc->data_type;
        for (int i = 0; i < 4; ++i) {
            *dims[i] = tensorDesc->dims[i];
            *strides[i] = tensorDesc->strides[i];
        }
    }
    fake_log("cudnnGetTensor4dDescriptor", status, "desc=0x%" PRIxPTR, PTR(tensorDesc));
    return status;
}

cudnnStatus_t cudnnGetTensorNdDescriptor(const cudnnTensorDescriptor_t tensorDesc,
                                         int nbDimsRequested, cudnnDataType_t *dataType,
                                         int *nbDims, int dimA[], int strideA[])
{
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    if (!fake_tensor_ok(tensorDesc) || tensorDesc->rank == 0 || nbDimsRequested < 0 ||
        dataType == NULL || nbDims == NULL ||
        (nbDimsRequested > 0 && (dimA == NULL || strideA == NULL)))
        status = CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS) {
        *dataType = tensorDesc->data_type;
        *nbDims = tensorDesc->rank;
        for (int i = 0; i < nbDimsRequested && i < tensorDesc->rank; ++i) {
            dimA[i] = tensorDesc->dims[i];
            strideA[i] = tensorDesc->strides[i];
        }
    }
    fake_log("cudnnGetTensorNdDescriptor", status, "desc=0x%" PRIxPTR " requested=%d",
             PTR(tensorDesc), nbDimsRequested);
    return status;
}

cudnnStatus_t cudnnGetTensorSizeInBytes(const cudnnTensorDescriptor_t tensorDesc, size_t *size)
{
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    size_t bytes = 0;
    if (!fake_tensor_ok(tensorDesc) || tensorDesc->rank == 0 || size == NULL) {
        status = CUDNN_STATUS_BAD_PARAM;
    } else {
        /* One past the element furthest from the base, so strided views are covered. */
        size_t last = 0;
        for (int i = 0; i < tensorDesc->rank; ++i)
            last += (size_t)(tensorDesc->dims[i] - 1) * (size_t)tensorDesc->strides[i];
        bytes = (last + 1) * element_size(tensorDesc->data_type);
        *size = bytes;
    }
    fake_log("cudnnGetTensorSizeInBytes", status, "desc=0x%" PRIxPTR " size=%zu", PTR(tensorDesc),
             bytes);
    return status;
}

/* ---------------------------------------------------------------- filter descriptors */

cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t *filterDesc)
{
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    struct cudnnFilterStruct *created = NULL;
    if (filterDesc == NULL)
        status = CUDNN_STATUS_BAD_PARAM;
    else if ((created = calloc(1, sizeof *created)) == NULL)
        status = CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED;
    else {
        created->magic = FAKE_MAGIC_FILTER;
        *filterDesc = created;
    }
    fake_log("cudnnCreateFilterDescriptor", status, "desc=0x%" PRIxPTR, PTR(created));
    return status;
}

cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t filterDesc)
{
    cudnnStatus_t status = filterDesc == NULL || fake_filter_ok(filterDesc) ? CUDNN_STATUS_SUCCESS
                                                                           : CUDNN_STATUS_BAD_PARAM;
    fake_log("cudnnDestroyFilterDescriptor", status, "desc=0x%" PRIxPTR, PTR(filterDesc));
    if (status == CUDNN_STATUS_SUCCESS && filterDesc != NULL) {
        filterDesc->magic = FAKE_MAGIC_DEAD;
        free(filterDesc);
    }
    return status;
}

static cudnnStatus_t set_filter(struct cudnnFilterStruct *desc, cudnnDataType_t type,
                                cudnnTensorFormat_t format, int rank, const int dims[])
{
    if (!fake_filter_ok(desc) || dims == NULL)
        return CUDNN_STATUS_BAD_PARAM;
    if (!rank_ok(rank))
        return CUDNN_STATUS_NOT_SUPPORTED;
    if (format != CUDNN_TENSOR_NCHW && format != CUDNN_TENSOR_NHWC)
        return CUDNN_STATUS_NOT_SUPPORTED_LAYOUT;
    if (element_size(type) == 0)
        return CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE;
    if (!all_positive(dims, rank))
        return CUDNN_STATUS_BAD_PARAM;
    desc->data_type = type;
    desc->format = format;
    desc->rank = rank;
    memcpy(desc->dims, dims, (size_t)rank * sizeof dims[0]);
    return CUDNN_STATUS_SUCCESS;
}

static void log_filter_set(const char *function, cudnnStatus_t status,
                           const struct cudnnFilterStruct *desc, cudnnDataType_t type,
                           cudnnTensorFormat_t format, int rank, const int dims[])
{
    char dims_text[INTS_TEXT];
    fake_format_ints(dims_text, sizeof dims_text, dims, dims == NULL || !rank_ok(rank) ? 0 : rank);
    fake_log(function, status, "desc=0x%" PRIxPTR " dt=%d format=%d dims=%s", PTR(desc), (int)type,
             (int)format, dims_text);
}

cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t filterDesc,
                                         cudnnDataType_t dataType, cudnnTensorFormat_t format,
                                         int k, int c, int h, int w)
{
    const int dims[4] = {k, c, h, w};
    cudnnStatus_t status = set_filter(filterDesc, dataType, format, 4, dims);
    log_filter_set("cudnnSetFilter4dDescriptor", status, filterDesc, dataType, format, 4, dims);
    return status;
}

cudnnStatus_t cudnnSetFilterNdDescriptor(cudnnFilterDescriptor_t filterDesc,
                                         cudnnDataType_t dataType, cudnnTensorFormat_t format,
                                         int nbDims, const int filterDimA[])
{
    cudnnStatus_t status = set_filter(filterDesc, dataType, format, nbDims, filterDimA);
    log_filter_set("cudnnSetFilterNdDescriptor", status, filterDesc, dataType, format, nbDims,
                   filterDimA);
    return status;
}

cudnnStatus_t cudnnGetFilter4dDescriptor(const cudnnFilterDescriptor_t filterDesc,
                                         cudnnDataType_t *dataType, cudnnTensorFormat_t *format,
                                         int *k, int *c, int *h, int *w)
{
    int *const dims[4] = {k, c, h, w};
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    if (!fake_filter_ok(filterDesc) || filterDesc->rank != 4 || dataType == NULL || format == NULL)
        status = CUDNN_STATUS_BAD_PARAM;
    for (int i = 0; i < 4 && status == CUDNN_STATUS_SUCCESS; ++i)
        if (dims[i] == NULL)
            status = CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS) {
        *dataType = filterDesc->data_type;
        *format = filterDesc->format;
        for (int i = 0; i < 4; ++i)
            *dims[i] = filterDesc->dims[i];
    }
    fake_log("cudnnGetFilter4dDescriptor", status, "desc=0x%" PRIxPTR, PTR(filterDesc));
    return status;
}

cudnnStatus_t cudnnGetFilterNdDescriptor(const cudnnFilterDescriptor_t filterDesc,
                                         int nbDimsRequested, cudnnDataType_t *dataType,
                                         cudnnTensorFormat_t *format, int *nbDims,
                                         int filterDimA[])
{
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    if (!fake_filter_ok(filterDesc) || filterDesc->rank == 0 || nbDimsRequested < 0 ||
        dataType == NULL || format == NULL || nbDims == NULL ||
        (nbDimsRequested > 0 && filterDimA == NULL))
        status = CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS) {
        *dataType = filterDesc->data_type;
        *format = filterDesc->format;
        *nbDims = filterDesc->rank;
        for (int i = 0; i < nbDimsRequested && i < filterDesc->rank; ++i)
            filterDimA[i] = filterDesc->dims[i];
    }
    fake_log("cudnnGetFilterNdDescriptor", status, "desc=0x%" PRIxPTR " requested=%d",
             PTR(filterDesc), nbDimsRequested);
    return status;
}

/* ---------------------------------------------------------------- convolution descriptors */

cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t *convDesc)
{
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    struct cudnnConvolutionStruct *created = NULL;
    if (convDesc == NULL)
        status = CUDNN_STATUS_BAD_PARAM;
    else if ((created = calloc(1, sizeof *created)) == NULL)
        status = CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED;
    else {
        created->magic = FAKE_MAGIC_CONVOLUTION;
        created->group_count = 1; /* cuDNN's defaults for a fresh descriptor */
        created->math_type = CUDNN_DEFAULT_MATH;
        created->compute_type = CUDNN_DATA_FLOAT;
        created->mode = CUDNN_CONVOLUTION;
        *convDesc = created;
    }
    fake_log("cudnnCreateConvolutionDescriptor", status, "desc=0x%" PRIxPTR, PTR(created));
    return status;
}

cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t convDesc)
{
    cudnnStatus_t status = convDesc == NULL || fake_convolution_ok(convDesc)
                               ? CUDNN_STATUS_SUCCESS
                               : CUDNN_STATUS_BAD_PARAM;
    fake_log("cudnnDestroyConvolutionDescriptor", status, "desc=0x%" PRIxPTR, PTR(convDesc));
    if (status == CUDNN_STATUS_SUCCESS && convDesc != NULL) {
        convDesc->magic = FAKE_MAGIC_DEAD;
        free(convDesc);
    }
    return status;
}

static cudnnStatus_t set_convolution(struct cudnnConvolutionStruct *desc, int spatial_rank,
                                     const int pad[], const int stride[], const int dilation[],
                                     cudnnConvolutionMode_t mode, cudnnDataType_t compute_type)
{
    if (!fake_convolution_ok(desc) || pad == NULL || stride == NULL || dilation == NULL)
        return CUDNN_STATUS_BAD_PARAM;
    if (spatial_rank < 1 || spatial_rank > CUDNN_DIM_MAX - 2)
        return CUDNN_STATUS_NOT_SUPPORTED;
    if (mode != CUDNN_CONVOLUTION && mode != CUDNN_CROSS_CORRELATION)
        return CUDNN_STATUS_BAD_PARAM;
    if (element_size(compute_type) == 0)
        return CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE;
    for (int i = 0; i < spatial_rank; ++i)
        if (pad[i] < 0 || stride[i] <= 0 || dilation[i] <= 0)
            return CUDNN_STATUS_BAD_PARAM;
    desc->spatial_rank = spatial_rank;
    for (int i = 0; i < spatial_rank; ++i) {
        desc->pad[i] = pad[i];
        desc->stride[i] = stride[i];
        desc->dilation[i] = dilation[i];
    }
    desc->mode = mode;
    desc->compute_type = compute_type;
    return CUDNN_STATUS_SUCCESS;
}

static void log_convolution_set(const char *function, cudnnStatus_t status,
                                const struct cudnnConvolutionStruct *desc, int spatial_rank,
                                const int pad[], const int stride[], const int dilation[],
                                cudnnConvolutionMode_t mode, cudnnDataType_t compute_type)
{
    char pad_text[INTS_TEXT], stride_text[INTS_TEXT], dilation_text[INTS_TEXT];
    bool printable = spatial_rank >= 1 && spatial_rank <= CUDNN_DIM_MAX - 2;
    fake_format_ints(pad_text, sizeof pad_text, pad, printable && pad ? spatial_rank : 0);
    fake_format_ints(stride_text, sizeof stride_text, stride,
                     printable && stride ? spatial_rank : 0);
    fake_format_ints(dilation_text, sizeof dilation_text, dilation,
                     printable && dilation ? spatial_rank : 0);
    fake_log(function, status, "desc=0x%" PRIxPTR " pad=%s stride=%s dil=%s mode=%d ct=%d",
             PTR(desc), pad_text, stride_text, dilation_text, (int)mode, (int)compute_type);
}

cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t convDesc, int pad_h,
                                              int pad_w, int u, int v, int dilation_h,
                                              int dilation_w, cudnnConvolutionMode_t mode,
                                              cudnnDataType_t computeType)
{
    const int pad[2] = {pad_h, pad_w}, stride[2] = {u, v}, dilation[2] = {dilation_h, dilation_w};
    cudnnStatus_t status = set_convolution(convDesc, 2, pad, stride, dilation, mode, computeType);
    log_convolution_set("cudnnSetConvolution2dDescriptor", status, convDesc, 2, pad, stride,
                        dilation, mode, computeType);
    return status;
}

cudnnStatus_t cudnnSetConvolutionNdDescriptor(cudnnConvolutionDescriptor_t convDesc,
                                              int arrayLength, const int padA[],
                                              const int filterStrideA[], const int dilationA[],
                                              cudnnConvolutionMode_t mode,
                                              cudnnDataType_t computeType)
{
    cudnnStatus_t status = set_convolution(convDesc, arrayLength, padA, filterStrideA, dilationA,
                                           mode, computeType);
    log_convolution_set("cudnnSetConvolutionNdDescriptor", status, convDesc, arrayLength, padA,
                        filterStrideA, dilationA, mode, computeType);
    return status;
}

cudnnStatus_t cudnnGetConvolution2dDescriptor(const cudnnConvolutionDescriptor_t convDesc,
                                              int *pad_h, int *pad_w, int *u, int *v,
                                              int *dilation_h, int *dilation_w,
                                              cudnnConvolutionMode_t *mode,
                                              cudnnDataType_t *computeType)
{
    int *const outputs[6] = {pad_h, pad_w, u, v, dilation_h, dilation_w};
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    if (!fake_convolution_ok(convDesc) || convDesc->spatial_rank != 2 || mode == NULL ||
        computeType == NULL)
        status = CUDNN_STATUS_BAD_PARAM;
    for (int i = 0; i < 6 && status == CUDNN_STATUS_SUCCESS; ++i)
        if (outputs[i] == NULL)
            status = CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS) {
        *pad_h = convDesc->pad[0];
        *pad_w = convDesc->pad[1];
        *u = convDesc->stride[0];
        *v = convDesc->stride[1];
        *dilation_h = convDesc->dilation[0];
        *dilation_w = convDesc->dilation[1];
        *mode = convDesc->mode;
        *computeType = convDesc->compute_type;
    }
    fake_log("cudnnGetConvolution2dDescriptor", status, "desc=0x%" PRIxPTR, PTR(convDesc));
    return status;
}

cudnnStatus_t cudnnGetConvolutionNdDescriptor(const cudnnConvolutionDescriptor_t convDesc,
                                              int arrayLengthRequested, int *arrayLength,
                                              int padA[], int strideA[], int dilationA[],
                                              cudnnConvolutionMode_t *mode,
                                              cudnnDataType_t *computeType)
{
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    if (!fake_convolution_ok(convDesc) || convDesc->spatial_rank == 0 || arrayLengthRequested < 0 ||
        arrayLength == NULL || mode == NULL || computeType == NULL ||
        (arrayLengthRequested > 0 && (padA == NULL || strideA == NULL || dilationA == NULL)))
        status = CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS) {
        *arrayLength = convDesc->spatial_rank;
        for (int i = 0; i < arrayLengthRequested && i < convDesc->spatial_rank; ++i) {
            padA[i] = convDesc->pad[i];
            strideA[i] = convDesc->stride[i];
            dilationA[i] = convDesc->dilation[i];
        }
        *mode = convDesc->mode;
        *computeType = convDesc->compute_type;
    }
    fake_log("cudnnGetConvolutionNdDescriptor", status, "desc=0x%" PRIxPTR " requested=%d",
             PTR(convDesc), arrayLengthRequested);
    return status;
}

cudnnStatus_t cudnnSetConvolutionGroupCount(cudnnConvolutionDescriptor_t convDesc, int groupCount)
{
    cudnnStatus_t status = fake_convolution_ok(convDesc) && groupCount >= 1
                               ? CUDNN_STATUS_SUCCESS
                               : CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS)
        convDesc->group_count = groupCount;
    fake_log("cudnnSetConvolutionGroupCount", status, "desc=0x%" PRIxPTR " groups=%d",
             PTR(convDesc), groupCount);
    return status;
}

cudnnStatus_t cudnnGetConvolutionGroupCount(cudnnConvolutionDescriptor_t convDesc,
                                            int *groupCount)
{
    cudnnStatus_t status = fake_convolution_ok(convDesc) && groupCount != NULL
                               ? CUDNN_STATUS_SUCCESS
                               : CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS)
        *groupCount = convDesc->group_count;
    fake_log("cudnnGetConvolutionGroupCount", status, "desc=0x%" PRIxPTR " groups=%d",
             PTR(convDesc), status == CUDNN_STATUS_SUCCESS ? *groupCount : 0);
    return status;
}

cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t convDesc,
                                          cudnnMathType_t mathType)
{
    bool known = mathType == CUDNN_DEFAULT_MATH || mathType == CUDNN_TENSOR_OP_MATH ||
                 mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION || mathType == CUDNN_FMA_MATH;
    cudnnStatus_t status = fake_convolution_ok(convDesc) && known ? CUDNN_STATUS_SUCCESS
                                                                  : CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS)
        convDesc->math_type = mathType;
    fake_log("cudnnSetConvolutionMathType", status, "desc=0x%" PRIxPTR " math=%s", PTR(convDesc),
             fake_math_name(mathType));
    return status;
}

cudnnStatus_t cudnnGetConvolutionMathType(cudnnConvolutionDescriptor_t convDesc,
                                          cudnnMathType_t *mathType)
{
    cudnnStatus_t status = fake_convolution_ok(convDesc) && mathType != NULL
                               ? CUDNN_STATUS_SUCCESS
                               : CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS)
        *mathType = convDesc->math_type;
    fake_log("cudnnGetConvolutionMathType", status, "desc=0x%" PRIxPTR " math=%s", PTR(convDesc),
             status == CUDNN_STATUS_SUCCESS ? fake_math_name(*mathType) : "-");
    return status;
}

cudnnStatus_t cudnnSetConvolutionReorderType(cudnnConvolutionDescriptor_t convDesc,
                                             cudnnReorderType_t reorderType)
{
    cudnnStatus_t status = fake_convolution_ok(convDesc) ? CUDNN_STATUS_SUCCESS
                                                         : CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS)
        convDesc->reorder_type = reorderType; /* stored only: the double never reorders */
    fake_log("cudnnSetConvolutionReorderType", status, "desc=0x%" PRIxPTR " reorder=%d",
             PTR(convDesc), (int)reorderType);
    return status;
}

cudnnStatus_t cudnnGetConvolutionReorderType(cudnnConvolutionDescriptor_t convDesc,
                                             cudnnReorderType_t *reorderType)
{
    cudnnStatus_t status = fake_convolution_ok(convDesc) && reorderType != NULL
                               ? CUDNN_STATUS_SUCCESS
                               : CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS)
        *reorderType = convDesc->reorder_type;
    fake_log("cudnnGetConvolutionReorderType", status, "desc=0x%" PRIxPTR, PTR(convDesc));
    return status;
}

/* ---------------------------------------------------------------- output dims */

/* Checks input against filter and convolution; fills the forward output dims (rank of input). */
static cudnnStatus_t forward_output_dims(const struct cudnnConvolutionStruct *conv,
                                         const struct cudnnTensorStruct *input,
                                         const struct cudnnFilterStruct *filter, int out_dims[])
{
    if (!fake_convolution_ok(conv) || !fake_tensor_ok(input) || !fake_filter_ok(filter) ||
        conv->spatial_rank == 0 || input->rank == 0 || filter->rank == 0)
        return CUDNN_STATUS_BAD_PARAM;
    int rank = input->rank;
    if (filter->rank != rank || conv->spatial_rank != rank - 2)
        return CUDNN_STATUS_BAD_PARAM;
    if (input->dims[1] != filter->dims[1] * conv->group_count ||
        filter->dims[0] % conv->group_count != 0)
        return CUDNN_STATUS_BAD_PARAM;
    out_dims[0] = input->dims[0];
    out_dims[1] = filter->dims[0];
    for (int i = 0; i < rank - 2; ++i) {
        out_dims[i + 2] = fake_output_dim(input->dims[i + 2], filter->dims[i + 2], conv->pad[i],
                                          conv->stride[i], conv->dilation[i]);
        if (out_dims[i + 2] < 1)
            return CUDNN_STATUS_BAD_PARAM;
    }
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetConvolution2dForwardOutputDim(const cudnnConvolutionDescriptor_t convDesc,
                                                    const cudnnTensorDescriptor_t inputTensorDesc,
                                                    const cudnnFilterDescriptor_t filterDesc,
                                                    int *n, int *c, int *h, int *w)
{
    int dims[CUDNN_DIM_MAX] = {0};
    cudnnStatus_t status = CUDNN_STATUS_BAD_PARAM;
    if (n != NULL && c != NULL && h != NULL && w != NULL && fake_tensor_ok(inputTensorDesc) &&
        inputTensorDesc->rank == 4)
        status = forward_output_dims(convDesc, inputTensorDesc, filterDesc, dims);
    if (status == CUDNN_STATUS_SUCCESS) {
        *n = dims[0];
        *c = dims[1];
        *h = dims[2];
        *w = dims[3];
    }
    char dims_text[INTS_TEXT];
    fake_format_ints(dims_text, sizeof dims_text, dims, status == CUDNN_STATUS_SUCCESS ? 4 : 0);
    fake_log("cudnnGetConvolution2dForwardOutputDim", status, "dims=%s", dims_text);
    return status;
}

cudnnStatus_t cudnnGetConvolutionNdForwardOutputDim(const cudnnConvolutionDescriptor_t convDesc,
                                                    const cudnnTensorDescriptor_t inputTensorDesc,
                                                    const cudnnFilterDescriptor_t filterDesc,
                                                    int nbDims, int tensorOuputDimA[])
{
    int dims[CUDNN_DIM_MAX] = {0};
    cudnnStatus_t status = CUDNN_STATUS_BAD_PARAM;
    if (tensorOuputDimA != NULL && fake_tensor_ok(inputTensorDesc) &&
        nbDims == inputTensorDesc->rank)
        status = forward_output_dims(convDesc, inputTensorDesc, filterDesc, dims);
    if (status == CUDNN_STATUS_SUCCESS)
        memcpy(tensorOuputDimA, dims, (size_t)nbDims * sizeof dims[0]);
    char dims_text[INTS_TEXT];
    fake_format_ints(dims_text, sizeof dims_text, dims,
                     status == CUDNN_STATUS_SUCCESS ? nbDims : 0);
    fake_log("cudnnGetConvolutionNdForwardOutputDim", status, "dims=%s", dims_text);
    return status;
}

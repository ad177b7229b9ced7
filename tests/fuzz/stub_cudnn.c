/* stub_cudnn.c: see stub_cudnn.h. Also defines mu_real(), so key.c links without real.c. */
#include "stub_cudnn.h"

#include <string.h>

static int32_t stub[STUB_FIELDS];

/* Descriptor handles are never dereferenced: their addresses only tell x from y. */
static char x_tag, y_tag, w_tag, conv_tag;

void stub_set(const int32_t values[STUB_FIELDS]) { memcpy(stub, values, sizeof stub); }

void stub_decode(const uint8_t *data, size_t size, int32_t values[STUB_FIELDS]) {
    memset(values, 0, sizeof(int32_t) * STUB_FIELDS);
    for (size_t i = 0; i < STUB_FIELDS && 4 * i + 4 <= size; i++)
        values[i] = (int32_t)((uint32_t)data[4 * i] | (uint32_t)data[4 * i + 1] << 8 |
                              (uint32_t)data[4 * i + 2] << 16 | (uint32_t)data[4 * i + 3] << 24);
}

mu_conv_descs stub_descs(void) {
    return (mu_conv_descs){(mu_direction)((uint32_t)stub[STUB_DIR] % 3),
                           (cudnnTensorDescriptor_t)(void *)&x_tag, (cudnnFilterDescriptor_t)(void *)&w_tag,
                           (cudnnConvolutionDescriptor_t)(void *)&conv_tag,
                           (cudnnTensorDescriptor_t)(void *)&y_tag};
}

/* Like cuDNN: reports the rank and fills at most the requested number of entries. */
static void copy_dims(int rank, int requested, const int32_t *from, int *to) {
    for (int i = 0; i < rank && i < requested; i++) to[i] = from[i];
}

static cudnnStatus_t get_tensor(const cudnnTensorDescriptor_t desc, int requested, cudnnDataType_t *dtype,
                                int *rank, int dims[], int strides[]) {
    bool is_x = (const void *)desc == (const void *)&x_tag;
    *rank = stub[is_x ? STUB_X_RANK : STUB_Y_RANK];
    if (*rank < 0 || *rank > MU_MAX_DIMS) return CUDNN_STATUS_BAD_PARAM;
    *dtype = (cudnnDataType_t)stub[is_x ? STUB_X_DTYPE : STUB_Y_DTYPE];
    copy_dims(*rank, requested, stub + (is_x ? STUB_X_DIMS : STUB_Y_DIMS), dims);
    copy_dims(*rank, requested, stub + (is_x ? STUB_X_STRIDES : STUB_Y_STRIDES), strides);
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t get_filter(const cudnnFilterDescriptor_t desc, int requested, cudnnDataType_t *dtype,
                                cudnnTensorFormat_t *format, int *rank, int dims[]) {
    (void)desc;
    *rank = stub[STUB_W_RANK];
    if (*rank < 0 || *rank > MU_MAX_DIMS) return CUDNN_STATUS_BAD_PARAM;
    *dtype = (cudnnDataType_t)stub[STUB_W_DTYPE];
    *format = (cudnnTensorFormat_t)stub[STUB_W_FORMAT];
    copy_dims(*rank, requested, stub + STUB_W_DIMS, dims);
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t get_conv(const cudnnConvolutionDescriptor_t desc, int requested, int *length, int pad[],
                              int stride[], int dilation[], cudnnConvolutionMode_t *mode,
                              cudnnDataType_t *compute) {
    (void)desc;
    *length = stub[STUB_SPATIAL];
    if (*length < 0 || *length > MU_MAX_DIMS - 2) return CUDNN_STATUS_BAD_PARAM;
    copy_dims(*length, requested, stub + STUB_PAD, pad);
    copy_dims(*length, requested, stub + STUB_STRIDE, stride);
    copy_dims(*length, requested, stub + STUB_DILATION, dilation);
    *mode = (cudnnConvolutionMode_t)stub[STUB_MODE];
    *compute = (cudnnDataType_t)stub[STUB_COMPUTE];
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t get_math(cudnnConvolutionDescriptor_t desc, cudnnMathType_t *math) {
    (void)desc;
    *math = (cudnnMathType_t)stub[STUB_MATH];
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t get_groups(cudnnConvolutionDescriptor_t desc, int *groups) {
    (void)desc;
    *groups = stub[STUB_GROUPS];
    return CUDNN_STATUS_SUCCESS;
}

const mu_real_table *mu_real(void) {
    static const mu_real_table table = {
        .cudnnGetTensorNdDescriptor = get_tensor,
        .cudnnGetFilterNdDescriptor = get_filter,
        .cudnnGetConvolutionNdDescriptor = get_conv,
        .cudnnGetConvolutionMathType = get_math,
        .cudnnGetConvolutionGroupCount = get_groups,
    };
    return &table;
}

/*
 * key.c: the kernel key of a call, built from its descriptors exactly as docs/kernel-key.md says
 * (Python: mucudnn.problem.ConvProblem.key; both checked against tests/data/keys.txt).
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

static const char *const direction_names[] = {"fwd", "bwd_data", "bwd_filter"};

static const char *const fwd_algos[] = {"implicit_gemm", "implicit_precomp_gemm", "gemm", "direct",
                                        "fft", "fft_tiling", "winograd", "winograd_nonfused"};
static const char *const bwd_data_algos[] = {"algo_0", "algo_1", "fft", "fft_tiling", "winograd",
                                             "winograd_nonfused"};
static const char *const bwd_filter_algos[] = {"algo_0", "algo_1", "fft", "algo_3", "winograd",
                                               "winograd_nonfused", "fft_tiling"};

_Static_assert(sizeof fwd_algos / sizeof *fwd_algos == CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
               "forward algorithm names");
_Static_assert(sizeof bwd_data_algos / sizeof *bwd_data_algos == CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
               "backward-data algorithm names");
_Static_assert(sizeof bwd_filter_algos / sizeof *bwd_filter_algos ==
                   CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
               "backward-filter algorithm names");

static const char *const math_names[] = {"default", "tensor_op", "tensor_op_conv", "fma"};

const char *mu_direction_name(mu_direction dir) { return direction_names[dir]; }

static const char *const *algo_names(mu_direction dir) {
    return dir == MU_DIR_FWD ? fwd_algos : dir == MU_DIR_BWD_DATA ? bwd_data_algos : bwd_filter_algos;
}

int mu_algo_count(mu_direction dir) {
    return dir == MU_DIR_FWD         ? CUDNN_CONVOLUTION_FWD_ALGO_COUNT
           : dir == MU_DIR_BWD_DATA ? CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT
                                    : CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
}

const char *mu_algo_name(mu_direction dir, int algo) {
    return algo >= 0 && algo < mu_algo_count(dir) ? algo_names(dir)[algo] : "?";
}

int mu_algo_from_name(mu_direction dir, const char *name) {
    for (int algo = 0; algo < mu_algo_count(dir); algo++)
        if (strcmp(algo_names(dir)[algo], name) == 0) return algo;
    return -1;
}

const char *mu_math_name(cudnnMathType_t math) {
    return (int)math >= 0 && (int)math < 4 ? math_names[math] : "?";
}

int mu_math_from_name(const char *name) {
    for (int math = 0; math < 4; math++)
        if (strcmp(math_names[math], name) == 0) return math;
    return -1;
}

static const char *dtype_name(cudnnDataType_t dtype) {
    switch (dtype) {
    case CUDNN_DATA_FLOAT: return "f32";
    case CUDNN_DATA_DOUBLE: return "f64";
    case CUDNN_DATA_HALF: return "f16";
    case CUDNN_DATA_BFLOAT16: return "bf16";
    default: return NULL;
    }
}

double mu_scale_value(const void *scale, cudnnDataType_t dtype) {
    return dtype == CUDNN_DATA_DOUBLE ? *(const double *)scale : (double)*(const float *)scale;
}

size_t mu_dtype_size(cudnnDataType_t dtype) {
    switch (dtype) {
    case CUDNN_DATA_FLOAT: return 4;
    case CUDNN_DATA_DOUBLE: return 8;
    case CUDNN_DATA_HALF:
    case CUDNN_DATA_BFLOAT16: return 2;
    default: return 0;
    }
}

uint64_t mu_kernel_hash(const char *key, int n) {
    uint64_t hash = 14695981039346656037ULL; /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)key; *p; p++)
        hash = (hash ^ *p) * 1099511628211ULL;
    hash ^= (uint64_t)(unsigned)n * 0x9E3779B97F4A7C15ULL;
    return hash ^ (hash >> 29);
}

typedef enum { LAYOUT_NONE, LAYOUT_NCHW, LAYOUT_NHWC } layout;

bool mu_packed_strides(int nb_dims, const int dims[], bool channels_last, long long strides[]) {
    /* Hostile dims (2^30 x 2^30 x 2^30 ...) overflow 64 bits: such a stride saturates at
     * LLONG_MAX, which no int stride equals, and so do the strides after it. */
    bool fits = true;
    long long next;
#define MU_STRIDE(to, from, dim) \
    (fits = fits && !__builtin_mul_overflow((from), (long long)(dim), &next), (to) = fits ? next : LLONG_MAX)
    if (!channels_last) {
        strides[nb_dims - 1] = 1;
        for (int i = nb_dims - 2; i >= 0; i--) MU_STRIDE(strides[i], strides[i + 1], dims[i + 1]);
    } else {
        strides[1] = 1;
        MU_STRIDE(strides[nb_dims - 1], 1LL, dims[1]);
        for (int i = nb_dims - 2; i >= 2; i--) MU_STRIDE(strides[i], strides[i + 1], dims[i + 1]);
        MU_STRIDE(strides[0], strides[2], dims[2]);
    }
#undef MU_STRIDE
    return fits;
}

bool mu_strides_packed(int nb_dims, const int dims[], const int strides[], bool channels_last) {
    long long packed[MU_MAX_DIMS];
    (void)mu_packed_strides(nb_dims, dims, channels_last, packed); /* a saturated one never matches */
    for (int i = 0; i < nb_dims; i++)
        if (dims[i] > 1 && strides[i] != packed[i]) return false;
    return true;
}

/* Appends "a x b x c" to the key. */
static int join_dims(char *buf, size_t size, const int values[], int count) {
    int used = 0;
    for (int i = 0; i < count && (size_t)used < size; i++)
        used += snprintf(buf + used, size - (size_t)used, i ? "x%d" : "%d", values[i]);
    return used;
}

/* The descriptor values the key is made of. */
typedef struct {
    cudnnDataType_t x_dtype, y_dtype, w_dtype, compute_type;
    cudnnTensorFormat_t w_format;
    int w_nb_dims, w_dims[MU_MAX_DIMS];
    int spatial, pad[MU_MAX_DIMS], stride[MU_MAX_DIMS], dilation[MU_MAX_DIMS];
    cudnnConvolutionMode_t mode;
    int groups;
} conv_params;

static const char *read_descriptors(const mu_conv_descs *d, mu_kernel *k, conv_params *p) {
    const mu_real_table *real = mu_real();
    int y_nb_dims;
    if (real->cudnnGetTensorNdDescriptor == NULL || real->cudnnGetFilterNdDescriptor == NULL ||
        real->cudnnGetConvolutionNdDescriptor == NULL || real->cudnnGetConvolutionMathType == NULL ||
        real->cudnnGetConvolutionGroupCount == NULL)
        return "cuDNN lacks a descriptor query function";
    if (d->x == NULL || d->y == NULL || d->w == NULL || d->conv == NULL) return "a descriptor is NULL";
    if (real->cudnnGetTensorNdDescriptor(d->x, MU_MAX_DIMS, &p->x_dtype, &k->nb_dims, k->x_dims,
                                         k->x_strides) != CUDNN_STATUS_SUCCESS ||
        real->cudnnGetTensorNdDescriptor(d->y, MU_MAX_DIMS, &p->y_dtype, &y_nb_dims, k->y_dims,
                                         k->y_strides) != CUDNN_STATUS_SUCCESS)
        return "cannot read a tensor descriptor";
    if (real->cudnnGetFilterNdDescriptor(d->w, MU_MAX_DIMS, &p->w_dtype, &p->w_format,
                                         &p->w_nb_dims, p->w_dims) != CUDNN_STATUS_SUCCESS)
        return "cannot read the filter descriptor";
    if (k->nb_dims != 4 && k->nb_dims != 5) return "tensor rank is not 4 or 5";
    if (y_nb_dims != k->nb_dims || p->w_nb_dims != k->nb_dims) return "tensor ranks differ";
    if (real->cudnnGetConvolutionNdDescriptor(d->conv, MU_MAX_DIMS - 2, &p->spatial, p->pad,
                                              p->stride, p->dilation, &p->mode,
                                              &p->compute_type) != CUDNN_STATUS_SUCCESS ||
        real->cudnnGetConvolutionMathType(d->conv, &k->math) != CUDNN_STATUS_SUCCESS ||
        real->cudnnGetConvolutionGroupCount(d->conv, &p->groups) != CUDNN_STATUS_SUCCESS)
        return "cannot read the convolution descriptor";
    if (p->spatial != k->nb_dims - 2) return "convolution and tensor ranks differ";
    return NULL;
}

/* The output size along one spatial dimension, in 64 bits: with int operands (a pad of 1.1e9, a
 * filter of INT_MIN) no step can overflow, checked anyway so that a change of types cannot make it
 * undefined. -1 when the output would be empty or the arithmetic overflows. */
static long long output_extent(int in, int pad, int dilation, int filter, int stride) {
    long long span, reach;
    if (__builtin_mul_overflow((long long)dilation, (long long)filter - 1, &reach) ||
        __builtin_add_overflow((long long)in, 2LL * pad, &span) ||
        __builtin_sub_overflow(span, reach + 1, &span) || span < 0)
        return -1;
    return span / stride + 1;
}

/* Checks what the key cannot express and that x, w and y belong to one convolution. */
static const char *check_keyable(const mu_kernel *k, const conv_params *p) {
    int spatial = k->nb_dims - 2;
    if (dtype_name(p->x_dtype) == NULL) return "data type has no key";
    if (p->y_dtype != p->x_dtype || p->w_dtype != p->x_dtype) return "data types differ";
    if (dtype_name(p->compute_type) == NULL) return "compute type has no key";
    if (mu_math_name(k->math)[0] == '?') return "math type has no key";
    if (p->mode != CUDNN_CONVOLUTION && p->mode != CUDNN_CROSS_CORRELATION) return "unknown mode";
    for (int i = 0; i < k->nb_dims; i++)
        if (k->x_dims[i] < 1 || k->y_dims[i] < 1 || p->w_dims[i] < 1) return "a dimension is below 1";
    if (p->groups < 1 || k->x_dims[1] % p->groups || p->w_dims[0] % p->groups) return "bad group count";
    if (k->y_dims[0] != k->x_dims[0]) return "batch sizes differ";
    if ((long long)p->w_dims[1] * p->groups != k->x_dims[1] || k->y_dims[1] != p->w_dims[0])
        return "channel counts do not match";
    for (int i = 0; i < spatial; i++) {
        if (p->stride[i] < 1 || p->dilation[i] < 1 || p->pad[i] < 0) return "bad convolution geometry";
        long long extent = output_extent(k->x_dims[2 + i], p->pad[i], p->dilation[i], p->w_dims[2 + i],
                                         p->stride[i]);
        if (extent < 0) return "the output would be empty";
        if (k->y_dims[2 + i] != extent) return "output size does not match the convolution";
    }
    return NULL;
}

static const char *build_key(const mu_conv_descs *d, mu_kernel *k, const conv_params *p) {
    /* The filter format names the layout; x and y must be packed in it. A tensor packed both
     * ways (only dims of size 1 differ) fits either, so a channels-last call keeps its nhwc. */
    layout w_layout = p->w_format == CUDNN_TENSOR_NCHW   ? LAYOUT_NCHW
                      : p->w_format == CUDNN_TENSOR_NHWC ? LAYOUT_NHWC
                                                         : LAYOUT_NONE;
    if (w_layout == LAYOUT_NONE) return "filter format has no key";
    bool nhwc = w_layout == LAYOUT_NHWC;
    bool x_packed = mu_strides_packed(k->nb_dims, k->x_dims, k->x_strides, nhwc);
    bool y_packed = mu_strides_packed(k->nb_dims, k->y_dims, k->y_strides, nhwc);
    if (!x_packed || !y_packed) {
        if (mu_strides_packed(k->nb_dims, k->x_dims, k->x_strides, !nhwc) &&
            mu_strides_packed(k->nb_dims, k->y_dims, k->y_strides, !nhwc))
            return "tensor and filter layouts differ";
        return "tensor strides are not packed";
    }

    int spatial = k->nb_dims - 2;
    char *buf = k->key;
    size_t size = sizeof k->key;
    int used = snprintf(buf, size, "dir=%s,dt=%s,ct=%s,math=%s,layout=%s,c=%d,in=",
                        direction_names[d->dir], dtype_name(p->x_dtype), dtype_name(p->compute_type),
                        mu_math_name(k->math), w_layout == LAYOUT_NCHW ? "nchw" : "nhwc", k->x_dims[1]);
    used += join_dims(buf + used, size - (size_t)used, k->x_dims + 2, spatial);
    used += snprintf(buf + used, size - (size_t)used, ",k=%d,f=", p->w_dims[0]);
    used += join_dims(buf + used, size - (size_t)used, p->w_dims + 2, spatial);
    used += snprintf(buf + used, size - (size_t)used, ",pad=");
    used += join_dims(buf + used, size - (size_t)used, p->pad, spatial);
    used += snprintf(buf + used, size - (size_t)used, ",stride=");
    used += join_dims(buf + used, size - (size_t)used, p->stride, spatial);
    used += snprintf(buf + used, size - (size_t)used, ",dil=");
    used += join_dims(buf + used, size - (size_t)used, p->dilation, spatial);
    used += snprintf(buf + used, size - (size_t)used, ",g=%d,mode=%s", p->groups,
                     p->mode == CUDNN_CONVOLUTION ? "conv" : "xcorr");
    if ((size_t)used >= size) return "key too long";
    return NULL;
}

const char *mu_kernel_from_descs(const mu_conv_descs *descs, mu_kernel *kernel) {
    conv_params params;
    const char *why = read_descriptors(descs, kernel, &params);
    if (why == NULL) why = check_keyable(kernel, &params);
    if (why == NULL) why = build_key(descs, kernel, &params);
    if (why != NULL) return why;
    kernel->n = kernel->x_dims[0];
    kernel->dtype = params.x_dtype;
    kernel->hash = mu_kernel_hash(kernel->key, kernel->n);
    return NULL;
}

/* The key grammar of docs/kernel-key.md, exactly as mucudnn.problem.ConvProblem.from_key checks
 * it: names and order, enumerated values, canonical integers in 0..INT32_MAX, dims, ranges, groups
 * and a non-empty output. */
const char *mu_key_check(const char *key, mu_direction *dir) {
    enum { DIR, DT, CT, MATH, LAYOUT, C, IN, K, F, PAD, STRIDE, DIL, G, MODE, FIELDS };
    static const char *const names[FIELDS] = {"dir", "dt",  "ct",  "math",   "layout", "c",   "in",
                                              "k",   "f",   "pad", "stride", "dil",    "g",   "mode"};
    /* Each enumerated field's values, blank-separated; NULL for the integer fields. */
    static const char *const choices[FIELDS] = {
        [DIR] = "fwd bwd_data bwd_filter", [DT] = "f32 f64 f16 bf16", [CT] = "f32 f64 f16 bf16",
        [MATH] = "default tensor_op tensor_op_conv fma", [LAYOUT] = "nchw nhwc", [MODE] = "xcorr conv"};
    long long values[FIELDS][3];
    int counts[FIELDS] = {0};
    const char *p = key;
    for (int i = 0; i < FIELDS; i++) {
        size_t name_length = strlen(names[i]);
        if (strncmp(p, names[i], name_length) != 0 || p[name_length] != '=')
            return "kernel key fields must be dir,dt,ct,math,layout,c,in,k,f,pad,stride,dil,g,mode";
        const char *value = p + name_length + 1;
        size_t value_length = strcspn(value, ",");
        if (value_length == 0) return "empty field in kernel key";
        if (choices[i] != NULL) {
            int found = -1, index = 0;
            for (const char *c = choices[i]; *c; index++) {
                size_t length = strcspn(c, " ");
                if (length == value_length && strncmp(c, value, length) == 0) found = index;
                c += length + (c[length] == ' ');
            }
            if (found < 0) return "kernel key field value is not one of its names";
            if (i == DIR) *dir = (mu_direction)found;
        } else { /* "0" or [1-9][0-9]*, x-joined, each at most INT32_MAX */
            for (const char *s = value; s <= value + value_length; s++) {
                if (counts[i] == 3) return "kernel key field has more than 3 values";
                if (*s < '0' || *s > '9' || (s[0] == '0' && s[1] >= '0' && s[1] <= '9'))
                    return "kernel key field is not x-joined canonical integers";
                long long number = 0;
                for (; *s >= '0' && *s <= '9'; s++)
                    if ((number = number * 10 + (*s - '0')) > 0x7fffffff)
                        return "kernel key integer is over 2147483647";
                values[i][counts[i]++] = number;
                if (s != value + value_length && *s != 'x')
                    return "kernel key field is not x-joined canonical integers";
            }
        }
        p = value + value_length;
        bool last = i + 1 == FIELDS;
        if (last ? *p != '\0' : *p != ',') return "kernel key must have exactly 14 fields";
        p += !last;
    }
    if (counts[C] != 1 || counts[K] != 1 || counts[G] != 1) return "kernel key c, k and g are one integer each";
    int d = counts[IN];
    if (d != 2 && d != 3) return "kernel key in has 2 or 3 spatial dims";
    if (counts[F] != d || counts[PAD] != d || counts[STRIDE] != d || counts[DIL] != d)
        return "kernel key f, pad, stride and dil need one value per spatial dim";
    if (values[C][0] < 1 || values[K][0] < 1 || values[G][0] < 1) return "kernel key c, k and g must be >= 1";
    if (values[C][0] % values[G][0] != 0 || values[K][0] % values[G][0] != 0)
        return "kernel key c and k must be multiples of g";
    for (int j = 0; j < d; j++) {
        if (values[IN][j] < 1 || values[F][j] < 1 || values[STRIDE][j] < 1 || values[DIL][j] < 1)
            return "kernel key in, f, stride and dil must be >= 1";
        /* Output size (in + 2 pad - dil (f - 1) - 1) / stride + 1 >= 1; each term < 2^62. */
        if (values[IN][j] + 2 * values[PAD][j] - values[DIL][j] * (values[F][j] - 1) - 1 < 0)
            return "kernel key geometry has an empty output";
    }
    return NULL;
}

MU_EXPORT int mucudnn_kernel_key(mucudnn_direction direction, cudnnTensorDescriptor_t x,
                                 cudnnFilterDescriptor_t w, cudnnConvolutionDescriptor_t conv,
                                 cudnnTensorDescriptor_t y, char *buf, size_t size, int *n) {
    if (buf == NULL || size == 0) return -2;
    if ((int)direction < 0 || (int)direction > 2) {
        snprintf(buf, size, "unknown direction %d", (int)direction);
        return -1;
    }
    mu_conv_descs descs = {(mu_direction)direction, x, w, conv, y};
    mu_kernel kernel;
    const char *why = mu_kernel_from_descs(&descs, &kernel);
    int length = snprintf(buf, size, "%s", why ? why : kernel.key);
    if ((size_t)length >= size) return -2;
    if (why != NULL) return -1;
    if (n != NULL) *n = kernel.n;
    return 0;
}

/*
 * Convolution geometry checks and the reference loops of the cuDNN test double.
 *
 * Every element is addressed through the descriptors' strides, so any layout (NCHW, NHWC, a
 * slice along N of a larger tensor, ...) works. A 2-D convolution is run as a 3-D one with a
 * depth of 1, so one set of loops serves both. Sums are accumulated in double: the loops are a
 * reference, not a model of any GPU algorithm's rounding.
 */
#include "fake_internal.h"

#include <stdint.h>

/* ---------------------------------------------------------------- geometry */

int fake_output_dim(int in, int filter, int pad, int stride, int dilation)
{
    int dilated_filter = (filter - 1) * dilation + 1;
    int span = in + 2 * pad - dilated_filter;
    return span < 0 ? 0 : span / stride + 1;
}

static void tensor_operand(const struct cudnnTensorStruct *tensor, int spatial_rank,
                           struct fake_operand *operand)
{
    operand->stride_n = tensor->strides[0];
    operand->stride_c = tensor->strides[1];
    int unused = FAKE_SPATIAL - spatial_rank;
    for (int i = 0; i < FAKE_SPATIAL; ++i)
        operand->stride_s[i] = i < unused ? 0 : tensor->strides[2 + i - unused];
}

static void filter_operand(const struct cudnnFilterStruct *filter, int spatial_rank,
                           struct fake_operand *operand)
{
    int64_t strides[CUDNN_DIM_MAX];
    fake_filter_strides(filter, strides);
    operand->stride_n = strides[0]; /* K plays the role of N for the filter */
    operand->stride_c = strides[1];
    int unused = FAKE_SPATIAL - spatial_rank;
    for (int i = 0; i < FAKE_SPATIAL; ++i)
        operand->stride_s[i] = i < unused ? 0 : strides[2 + i - unused];
}

/* Fills the spatial sizes of `g`, checking y's dims against the ones the convolution implies. */
static cudnnStatus_t spatial_geometry(const struct cudnnTensorStruct *x,
                                      const struct cudnnFilterStruct *w,
                                      const struct cudnnConvolutionStruct *conv,
                                      const struct cudnnTensorStruct *y, struct fake_geometry *g)
{
    int unused = FAKE_SPATIAL - g->spatial_rank;
    for (int i = 0; i < FAKE_SPATIAL; ++i) {
        if (i < unused) { /* the missing depth of a 2-D convolution */
            g->in[i] = g->out[i] = g->filter[i] = g->stride[i] = g->dilation[i] = 1;
            g->pad[i] = 0;
            continue;
        }
        int j = i - unused;
        g->in[i] = x->dims[2 + j];
        g->filter[i] = w->dims[2 + j];
        g->pad[i] = conv->pad[j];
        g->stride[i] = conv->stride[j];
        g->dilation[i] = conv->dilation[j];
        g->out[i] =
            fake_output_dim(g->in[i], g->filter[i], g->pad[i], g->stride[i], g->dilation[i]);
        if (g->out[i] < 1 || y->dims[2 + j] != g->out[i])
            return CUDNN_STATUS_BAD_PARAM;
    }
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t fake_geometry_build(const struct cudnnTensorStruct *x,
                                  const struct cudnnFilterStruct *w,
                                  const struct cudnnConvolutionStruct *conv,
                                  const struct cudnnTensorStruct *y, struct fake_geometry *g)
{
    if (!fake_tensor_ok(x) || !fake_tensor_ok(y) || !fake_filter_ok(w) ||
        !fake_convolution_ok(conv))
        return CUDNN_STATUS_BAD_PARAM;
    int rank = x->rank;
    if ((rank != 4 && rank != 5) || y->rank != rank || w->rank != rank ||
        conv->spatial_rank != rank - 2)
        return CUDNN_STATUS_BAD_PARAM;
    if (x->data_type != y->data_type || x->data_type != w->data_type)
        return CUDNN_STATUS_BAD_PARAM;

    g->spatial_rank = rank - 2;
    g->data_type = x->data_type;
    g->math_type = conv->math_type;
    g->n = x->dims[0];
    g->c = x->dims[1];
    g->k = w->dims[0];
    g->groups = conv->group_count;
    if (g->c != w->dims[1] * g->groups || g->k % g->groups != 0)
        return CUDNN_STATUS_BAD_PARAM;
    if (y->dims[0] != g->n || y->dims[1] != g->k)
        return CUDNN_STATUS_BAD_PARAM;
    cudnnStatus_t status = spatial_geometry(x, w, conv, y, g);
    if (status != CUDNN_STATUS_SUCCESS)
        return status;

    g->flip_filter = conv->mode == CUDNN_CONVOLUTION;
    tensor_operand(x, g->spatial_rank, &g->x);
    tensor_operand(y, g->spatial_rank, &g->y);
    filter_operand(w, g->spatial_rank, &g->w);
    return CUDNN_STATUS_SUCCESS;
}

double fake_flops_per_sample(const struct fake_geometry *g)
{
    double taps = (double)(g->c / g->groups);
    for (int i = 0; i < FAKE_SPATIAL; ++i)
        taps *= (double)g->filter[i] * (double)g->out[i];
    return 2.0 * (double)g->k * taps;
}

/* ---------------------------------------------------------------- element access */

static inline double load(const void *base, int64_t index, cudnnDataType_t type)
{
    return type == CUDNN_DATA_DOUBLE ? ((const double *)base)[index]
                                     : (double)((const float *)base)[index];
}

/* out = alpha * sum + beta * out, reading out only when beta != 0 (cuDNN's contract). */
static inline void blend(void *base, int64_t index, cudnnDataType_t type, double alpha, double sum,
                         double beta)
{
    double value = alpha * sum;
    if (beta != 0.0)
        value += beta * load(base, index, type);
    if (type == CUDNN_DATA_DOUBLE)
        ((double *)base)[index] = value;
    else
        ((float *)base)[index] = (float)value;
}

static inline int64_t offset(const struct fake_operand *operand, int n, int c, const int s[])
{
    int64_t at = (int64_t)n * operand->stride_n + (int64_t)c * operand->stride_c;
    for (int i = 0; i < FAKE_SPATIAL; ++i)
        at += (int64_t)s[i] * operand->stride_s[i];
    return at;
}

static int64_t volume(const int sizes[])
{
    int64_t count = 1;
    for (int i = 0; i < FAKE_SPATIAL; ++i)
        count *= sizes[i];
    return count;
}

/* Row-major spatial index of `flat` within `sizes`. */
static void unflatten(int64_t flat, const int sizes[], int index[])
{
    for (int i = FAKE_SPATIAL - 1; i >= 0; --i) {
        index[i] = (int)(flat % sizes[i]);
        flat /= sizes[i];
    }
}

/* The filter element that tap multiplies: mirrored for CUDNN_CONVOLUTION. */
static void filter_element(const struct fake_geometry *g, const int tap[], int element[])
{
    for (int i = 0; i < FAKE_SPATIAL; ++i)
        element[i] = g->flip_filter ? g->filter[i] - 1 - tap[i] : tap[i];
}

/* The input position that output position `out` reads through `tap`; false in the padding. */
static bool input_position(const struct fake_geometry *g, const int out[], const int tap[],
                           int in[])
{
    for (int i = 0; i < FAKE_SPATIAL; ++i) {
        in[i] = out[i] * g->stride[i] - g->pad[i] + tap[i] * g->dilation[i];
        if (in[i] < 0 || in[i] >= g->in[i])
            return false;
    }
    return true;
}

/* The output position that reads input position `in` through `tap`, if there is one. */
static bool output_position(const struct fake_geometry *g, const int in[], const int tap[],
                            int out[])
{
    for (int i = 0; i < FAKE_SPATIAL; ++i) {
        int shifted = in[i] + g->pad[i] - tap[i] * g->dilation[i];
        if (shifted < 0 || shifted % g->stride[i] != 0)
            return false;
        out[i] = shifted / g->stride[i];
        if (out[i] >= g->out[i])
            return false;
    }
    return true;
}

/* ---------------------------------------------------------------- reference loops */

void fake_forward(const struct fake_geometry *g, double alpha, const void *x, const void *w,
                  double beta, void *y)
{
    const int channels_per_group = g->c / g->groups, outputs_per_group = g->k / g->groups;
    const int64_t out_count = volume(g->out), tap_count = volume(g->filter);
    int out[FAKE_SPATIAL], tap[FAKE_SPATIAL], in[FAKE_SPATIAL], element[FAKE_SPATIAL];
    for (int n = 0; n < g->n; ++n)
        for (int k = 0; k < g->k; ++k) {
            const int first_channel = (k / outputs_per_group) * channels_per_group;
            for (int64_t o = 0; o < out_count; ++o) {
                unflatten(o, g->out, out);
                double sum = 0.0;
                for (int ci = 0; ci < channels_per_group; ++ci)
                    for (int64_t t = 0; t < tap_count; ++t) {
                        unflatten(t, g->filter, tap);
                        if (!input_position(g, out, tap, in))
                            continue;
                        filter_element(g, tap, element);
                        sum += load(x, offset(&g->x, n, first_channel + ci, in), g->data_type) *
                               load(w, offset(&g->w, k, ci, element), g->data_type);
                    }
                blend(y, offset(&g->y, n, k, out), g->data_type, alpha, sum, beta);
            }
        }
}

void fake_backward_data(const struct fake_geometry *g, double alpha, const void *w, const void *dy,
                        double beta, void *dx)
{
    const int channels_per_group = g->c / g->groups, outputs_per_group = g->k / g->groups;
    const int64_t in_count = volume(g->in), tap_count = volume(g->filter);
    int out[FAKE_SPATIAL], tap[FAKE_SPATIAL], in[FAKE_SPATIAL], element[FAKE_SPATIAL];
    for (int n = 0; n < g->n; ++n)
        for (int c = 0; c < g->c; ++c) {
            const int group = c / channels_per_group, ci = c % channels_per_group;
            for (int64_t i = 0; i < in_count; ++i) {
                unflatten(i, g->in, in);
                double sum = 0.0;
                for (int ko = 0; ko < outputs_per_group; ++ko) {
                    const int k = group * outputs_per_group + ko;
                    for (int64_t t = 0; t < tap_count; ++t) {
                        unflatten(t, g->filter, tap);
                        if (!output_position(g, in, tap, out))
                            continue;
                        filter_element(g, tap, element);
                        sum += load(w, offset(&g->w, k, ci, element), g->data_type) *
                               load(dy, offset(&g->y, n, k, out), g->data_type);
                    }
                }
                blend(dx, offset(&g->x, n, c, in), g->data_type, alpha, sum, beta);
            }
        }
}

void fake_backward_filter(const struct fake_geometry *g, double alpha, const void *x,
                          const void *dy, double beta, void *dw)
{
    const int channels_per_group = g->c / g->groups, outputs_per_group = g->k / g->groups;
    const int64_t out_count = volume(g->out), tap_count = volume(g->filter);
    int out[FAKE_SPATIAL], tap[FAKE_SPATIAL], in[FAKE_SPATIAL], element[FAKE_SPATIAL];
    for (int k = 0; k < g->k; ++k) {
        const int first_channel = (k / outputs_per_group) * channels_per_group;
        for (int ci = 0; ci < channels_per_group; ++ci)
            for (int64_t t = 0; t < tap_count; ++t) {
                unflatten(t, g->filter, tap);
                double sum = 0.0;
                for (int n = 0; n < g->n; ++n)
                    for (int64_t o = 0; o < out_count; ++o) {
                        unflatten(o, g->out, out);
                        if (!input_position(g, out, tap, in))
                            continue;
                        sum += load(x, offset(&g->x, n, first_channel + ci, in), g->data_type) *
                               load(dy, offset(&g->y, n, k, out), g->data_type);
                    }
                filter_element(g, tap, element);
                blend(dw, offset(&g->w, k, ci, element), g->data_type, alpha, sum, beta);
            }
    }
}

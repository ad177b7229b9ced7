/*
 * stub_cudnn.h: the five cuDNN descriptor queries the shim's key.c makes, answered from one table
 * of integers (no cuDNN, no test double), for the fuzz harnesses and tests/shim/test_shim_key_overflow.py.
 *
 * A case is STUB_FIELDS int32 values, in the order of the STUB_* indices below (tests/fuzz/descs.py
 * writes them from keys.txt-style fields): what cudnnGet{Tensor,Filter,Convolution}NdDescriptor,
 * cudnnGetConvolutionMathType and cudnnGetConvolutionGroupCount report for x, y, w and the
 * convolution. Nothing is checked: hostile values are the point.
 */
#ifndef MUCUDNN_STUB_CUDNN_H
#define MUCUDNN_STUB_CUDNN_H

#include <stdint.h>

#include "internal.h"

enum {
    STUB_DIR, STUB_X_RANK, STUB_Y_RANK, STUB_W_RANK, STUB_SPATIAL,
    STUB_X_DTYPE, STUB_Y_DTYPE, STUB_W_DTYPE, STUB_COMPUTE, STUB_MATH, STUB_MODE, STUB_GROUPS,
    STUB_W_FORMAT,
    STUB_X_DIMS = 13, STUB_X_STRIDES = 21, STUB_Y_DIMS = 29, STUB_Y_STRIDES = 37, STUB_W_DIMS = 45,
    STUB_PAD = 53, STUB_STRIDE = 59, STUB_DILATION = 65,
    STUB_FIELDS = 71
};

/* Sets what the stub's queries report. */
void stub_set(const int32_t values[STUB_FIELDS]);
/* The descriptors to pass to mu_kernel_from_descs (direction from the case, modulo 3). */
mu_conv_descs stub_descs(void);
/* Decodes up to STUB_FIELDS little-endian int32 from bytes (missing ones are 0). */
void stub_decode(const uint8_t *data, size_t size, int32_t values[STUB_FIELDS]);

#endif

/*
 * Internal declarations shared by the translation units of the cuDNN test double.
 *
 * The double implements cuDNN's legacy convolution API and part of the graph (backend) API on host
 * memory (see README.md). Every object a caller holds is one of the structs below or a backend
 * descriptor (private to fake_backend.c); nothing else is global except the log mutex.
 */
#ifndef FAKE_CUDNN_INTERNAL_H
#define FAKE_CUDNN_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cudnn.h>

/* Symbols shared between our own .c files but not exported from the library. */
#define FAKE_INTERNAL __attribute__((visibility("hidden")))

/* Distinct tags catch a descriptor of the wrong kind (or a destroyed one, usually). */
enum fake_magic {
    FAKE_MAGIC_HANDLE = 0x48414e44,      /* "HAND" */
    FAKE_MAGIC_TENSOR = 0x54454e53,      /* "TENS" */
    FAKE_MAGIC_FILTER = 0x46494c54,      /* "FILT" */
    FAKE_MAGIC_CONVOLUTION = 0x434f4e56, /* "CONV" */
    FAKE_MAGIC_BACKEND = 0x4241434b,     /* "BACK": every backend descriptor (fake_backend.c) */
    FAKE_MAGIC_DEAD = 0x44454144,        /* "DEAD": written by Destroy before free */
};

struct cudnnContext {
    uint32_t magic;
    cudaStream_t stream; /* stored only; the double runs synchronously on the host */
};

struct cudnnTensorStruct {
    uint32_t magic;
    cudnnDataType_t data_type;
    int rank; /* 0 until a Set call succeeds */
    int dims[CUDNN_DIM_MAX];
    int strides[CUDNN_DIM_MAX]; /* in elements */
};

struct cudnnFilterStruct {
    uint32_t magic;
    cudnnDataType_t data_type;
    cudnnTensorFormat_t format; /* NCHW = KCRS in memory, NHWC = KRSC */
    int rank;                   /* 0 until a Set call succeeds */
    int dims[CUDNN_DIM_MAX];    /* always (K, C/groups, spatial...) whatever the format */
};

struct cudnnConvolutionStruct {
    uint32_t magic;
    int spatial_rank; /* 0 until a Set call succeeds */
    int pad[CUDNN_DIM_MAX];
    int stride[CUDNN_DIM_MAX];
    int dilation[CUDNN_DIM_MAX];
    cudnnConvolutionMode_t mode;
    cudnnDataType_t compute_type;
    int group_count;
    cudnnMathType_t math_type;
    cudnnReorderType_t reorder_type;
};

/* ---- descriptor validation (fake_descriptors.c) ---- */

FAKE_INTERNAL bool fake_handle_ok(const struct cudnnContext *handle);

/* True when `stream` is being captured (fake_defer.c): run(copy of `argument`) then runs at the
 * graph's launch instead of now. */
FAKE_INTERNAL bool fake_defer(cudaStream_t stream, void (*run)(void *), const void *argument,
                              size_t size);
/* Advances the fake driver's clock (events) by a call's modelled time; nothing without the driver. */
FAKE_INTERNAL void fake_advance_clock(double ms);
FAKE_INTERNAL bool fake_tensor_ok(const struct cudnnTensorStruct *desc);
FAKE_INTERNAL bool fake_filter_ok(const struct cudnnFilterStruct *desc);
FAKE_INTERNAL bool fake_convolution_ok(const struct cudnnConvolutionStruct *desc);

/* Element strides of a packed filter of `rank` dims in (K, C, spatial...) order for `format`. */
FAKE_INTERNAL void fake_filter_strides(const struct cudnnFilterStruct *filter, int64_t strides[]);

/* ---- convolution geometry and reference loops (fake_conv.c) ---- */

/* Spatial dims are always three internally; a 2-D convolution gets a leading depth of 1. */
#define FAKE_SPATIAL 3

/* One tensor operand: base pointer, element strides of (N, C, D, H, W) (unused dims stride 0). */
struct fake_operand {
    int64_t stride_n, stride_c, stride_s[FAKE_SPATIAL];
};

/* Everything a reference loop needs, checked for consistency by fake_geometry_build. */
struct fake_geometry {
    int spatial_rank; /* 2 or 3: the caller's convolution */
    cudnnDataType_t data_type;
    cudnnMathType_t math_type;
    int n, c, k, groups;
    int in[FAKE_SPATIAL], out[FAKE_SPATIAL], filter[FAKE_SPATIAL];
    int pad[FAKE_SPATIAL], stride[FAKE_SPATIAL], dilation[FAKE_SPATIAL];
    bool flip_filter; /* CUDNN_CONVOLUTION mode: the filter is applied mirrored */
    struct fake_operand x, y, w;
};

/*
 * Checks the descriptors of one convolution like cuDNN does and fills `geometry`.
 * `x` is the forward input (x or dx), `y` the forward output (y or dy), `w` the filter (w or dw).
 * Returns CUDNN_STATUS_SUCCESS or CUDNN_STATUS_BAD_PARAM (with nothing guaranteed in `geometry`).
 */
FAKE_INTERNAL cudnnStatus_t fake_geometry_build(const struct cudnnTensorStruct *x,
                                                const struct cudnnFilterStruct *w,
                                                const struct cudnnConvolutionStruct *conv,
                                                const struct cudnnTensorStruct *y,
                                                struct fake_geometry *geometry);

/* Output size of one spatial dim; may be < 1, which callers reject. */
FAKE_INTERNAL int fake_output_dim(int in, int filter, int pad, int stride, int dilation);

/* Multiply-adds of one sample of the forward convolution (same for all three directions). */
FAKE_INTERNAL double fake_flops_per_sample(const struct fake_geometry *geometry);
/* The modelled time of one convolution by algorithm (or engine) `index`: a call overhead plus the
 * work at $FAKE_CUDNN_FLOPS_PER_MS times (1 + index) (fake_algos.c). */
FAKE_INTERNAL float fake_model_time_ms(const struct fake_geometry *geometry, int index);

/*
 * Reference loops: out = alpha * conv(...) + beta * out, accumulated in double. When beta == 0 the
 * output is not read (like cuDNN, so NaN garbage in it does not propagate).
 */
FAKE_INTERNAL void fake_forward(const struct fake_geometry *g, double alpha, const void *x,
                                const void *w, double beta, void *y);
FAKE_INTERNAL void fake_backward_data(const struct fake_geometry *g, double alpha, const void *w,
                                      const void *dy, double beta, void *dx);
FAKE_INTERNAL void fake_backward_filter(const struct fake_geometry *g, double alpha, const void *x,
                                        const void *dy, double beta, void *dw);

/* ---- algorithm model (fake_algos.c) and backend engines (fake_backend.c) ---- */

enum fake_direction { FAKE_FWD = 0, FAKE_BWD_DATA = 1, FAKE_BWD_FILTER = 2 };

/* Workspace bytes of algorithm (or engine) `index` for a batch of `n`: index * n * P, with P =
 * $FAKE_CUDNN_WS_PER_SAMPLE (default 4096). */
FAKE_INTERNAL size_t fake_workspace_bytes(int64_t index, int n);

/* Fills `bytes` of `workspace` with the 32-bit word 0xFFF8DEAD (little-endian, aligned on the
 * address), so that every aligned float or double in it reads as a NaN. */
FAKE_INTERNAL void fake_fill_workspace(void *workspace, size_t bytes);

/* ---- log (fake_log.c) ---- */

/*
 * Appends "FUNC FIELDS status=S\n" to $FAKE_CUDNN_LOG (if set) with one write(2) under a mutex.
 * `fields_format` is printf-style and may be "" for a call without fields.
 */
FAKE_INTERNAL void fake_log(const char *function, cudnnStatus_t status, const char *fields_format,
                            ...) __attribute__((format(printf, 3, 4)));

/* Log-friendly spellings: "0x1234"/"0x0", and "2x3x8x8" for an int array. */
FAKE_INTERNAL const char *fake_math_name(cudnnMathType_t math);
FAKE_INTERNAL void fake_format_ints(char *buffer, size_t size, const int *values, int count);

/* Reads a non-negative integer environment variable; `fallback` when unset or malformed. */
FAKE_INTERNAL long long fake_env_integer(const char *name, long long fallback);

#endif /* FAKE_CUDNN_INTERNAL_H */

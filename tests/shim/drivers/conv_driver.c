/*
 * conv_driver: runs cuDNN legacy convolution calls described on stdin, for the shim's tests.
 *
 * Linked against libcudnn.so.9 (the test double) and run with or without
 * LD_PRELOAD=libmucudnn.so. Each stdin line is one case of space-separated name=value fields:
 *
 *   op=conv|get_v7|find|find_ex|ws|key  dir=fwd|bwd_data|bwd_filter  dt=f32|f64|f16|bf16 ct=..
 *   math=default|tensor_op|tensor_op_conv|fma  layout=nchw|nhwc|padded  n= c= in=HxW|DxHxW k=
 *   f= pad= stride= dil= g= mode=xcorr|conv  alpha= beta= algo= ws=BYTES seed= requested=
 *
 * op=conv runs the call through the public symbol (so through the shim when preloaded) and again
 * through the double's own symbol (dlsym on its handle, which the preload cannot interpose), on
 * the same seeded random data, and prints how far apart the two outputs are:
 *   case I op=conv status=S ref_status=S exact=0|1 max_rel=E workspace=0xPTR
 * op=get_v7/find/find_ex print the results of the query:
 *   case I op=get_v7 status=S returned=R perf=ALGO:STATUS:TIME:MEMORY:MATH:DET,...
 * op=ws prints cudnnGet*WorkspaceSize for algo=; op=key only builds the descriptors.
 * Every case line also carries key=KEY (or nokey=REASON, or key=- without the shim).
 *
 * With argument --threads T the cases are shared among T threads, each with its own handle;
 * output stays in case order. f32 data are small integers, so every sum is exact whatever the
 * order; f64 data are random reals.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cudnn.h>

#define MAX_CASES 4096
#define LINE_MAX_LENGTH 4096
#define OUTPUT_MAX 8192

typedef struct {
    char op[16], dir[16], dt[8], ct[8], math[16], layout[8], mode[8];
    int n, c, k, groups, spatial;
    int in[3], f[3], pad[3], stride[3], dil[3];
    double alpha, beta;
    int algo, requested;
    size_t workspace;
    unsigned seed;
} conv_case;

/* The double's own functions, reached around the preload. */
static struct {
    __typeof__(cudnnConvolutionForward) *forward;
    __typeof__(cudnnConvolutionBackwardData) *backward_data;
    __typeof__(cudnnConvolutionBackwardFilter) *backward_filter;
} direct;

typedef int (*key_fn)(int, cudnnTensorDescriptor_t, cudnnFilterDescriptor_t,
                      cudnnConvolutionDescriptor_t, cudnnTensorDescriptor_t, char *, size_t, int *);
static key_fn shim_key; /* mucudnn_kernel_key, when the shim is preloaded */

static void die(const char *what) {
    fprintf(stderr, "conv_driver: %s\n", what);
    exit(2);
}

#define CHECK(call)                                                                    \
    do {                                                                               \
        cudnnStatus_t status_ = (call);                                                \
        if (status_ != CUDNN_STATUS_SUCCESS) {                                         \
            fprintf(stderr, "conv_driver: %s failed: %d\n", #call, (int)status_);      \
            exit(2);                                                                   \
        }                                                                              \
    } while (0)

/* ---- parsing ------------------------------------------------------------------------------ */

static int parse_dims(const char *text, int out[3]) {
    int count = 0;
    char *end;
    do {
        if (count == 3) die("too many x-joined values");
        out[count++] = (int)strtol(text, &end, 10);
        text = end + 1;
    } while (*end == 'x');
    return count;
}

static void parse_case(char *line, conv_case *c) {
    *c = (conv_case){.op = "conv", .dir = "fwd", .dt = "f32", .ct = "", .math = "fma",
                     .layout = "nchw", .mode = "xcorr", .n = 2, .c = 1, .k = 1, .groups = 1,
                     .alpha = 1, .beta = 0, .algo = 0, .requested = 8, .seed = 1};
    int pad_count = 0, stride_count = 0, dil_count = 0;
    for (char *token = strtok(line, " \t\n"); token; token = strtok(NULL, " \t\n")) {
        char *value = strchr(token, '=');
        if (!value) die("field without '='");
        *value++ = '\0';
#define TEXT(name) else if (strcmp(token, #name) == 0) snprintf(c->name, sizeof c->name, "%s", value)
        if (0) {}
        TEXT(op); TEXT(dir); TEXT(dt); TEXT(ct); TEXT(math); TEXT(layout); TEXT(mode);
        else if (!strcmp(token, "n")) c->n = atoi(value);
        else if (!strcmp(token, "c")) c->c = atoi(value);
        else if (!strcmp(token, "k")) c->k = atoi(value);
        else if (!strcmp(token, "g")) c->groups = atoi(value);
        else if (!strcmp(token, "in")) c->spatial = parse_dims(value, c->in);
        else if (!strcmp(token, "f")) parse_dims(value, c->f);
        else if (!strcmp(token, "pad")) pad_count = parse_dims(value, c->pad);
        else if (!strcmp(token, "stride")) stride_count = parse_dims(value, c->stride);
        else if (!strcmp(token, "dil")) dil_count = parse_dims(value, c->dil);
        else if (!strcmp(token, "alpha")) c->alpha = atof(value);
        else if (!strcmp(token, "beta")) c->beta = atof(value);
        else if (!strcmp(token, "algo")) c->algo = atoi(value);
        else if (!strcmp(token, "requested")) c->requested = atoi(value);
        else if (!strcmp(token, "ws")) c->workspace = strtoull(value, NULL, 10);
        else if (!strcmp(token, "seed")) c->seed = (unsigned)strtoul(value, NULL, 10);
        else die("unknown field");
#undef TEXT
    }
    if (c->spatial == 0) die("in= is required");
    for (int i = 0; i < c->spatial; i++) {
        if (!pad_count) c->pad[i] = 0;
        if (!stride_count) c->stride[i] = 1;
        if (!dil_count) c->dil[i] = 1;
        if (!c->f[i]) c->f[i] = 1;
    }
    if (!c->ct[0]) memcpy(c->ct, c->dt, sizeof c->ct);
}

static cudnnDataType_t dtype_of(const char *name) {
    if (!strcmp(name, "f32")) return CUDNN_DATA_FLOAT;
    if (!strcmp(name, "f64")) return CUDNN_DATA_DOUBLE;
    if (!strcmp(name, "f16")) return CUDNN_DATA_HALF;
    if (!strcmp(name, "bf16")) return CUDNN_DATA_BFLOAT16;
    if (!strcmp(name, "i8")) return CUDNN_DATA_INT8;
    die("unknown data type");
    return CUDNN_DATA_FLOAT;
}

static cudnnMathType_t math_of(const char *name) {
    static const char *const names[] = {"default", "tensor_op", "tensor_op_conv", "fma"};
    for (int i = 0; i < 4; i++)
        if (!strcmp(name, names[i])) return (cudnnMathType_t)i;
    die("unknown math type");
    return CUDNN_DEFAULT_MATH;
}

/* ---- descriptors and data ------------------------------------------------------------------- */

typedef struct {
    cudnnTensorDescriptor_t x, y;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
    size_t x_elems, y_elems, w_elems, elem_size;
    cudnnDataType_t dtype;
} descriptors;

/* Strides of dims (n, c, s...) for a layout; "padded" is NCHW with one unused element per row. */
static size_t make_strides(const char *layout, int rank, const int dims[], int strides[]) {
    int pitch = !strcmp(layout, "padded") ? 1 : 0;
    if (!strcmp(layout, "nhwc")) {
        strides[1] = 1;
        strides[rank - 1] = dims[1];
        for (int i = rank - 2; i >= 2; i--) strides[i] = strides[i + 1] * dims[i + 1];
        strides[0] = strides[2] * dims[2];
    } else {
        strides[rank - 1] = 1;
        strides[rank - 2] = dims[rank - 1] + pitch;
        for (int i = rank - 3; i >= 0; i--) strides[i] = strides[i + 1] * dims[i + 1];
    }
    return (size_t)strides[0] * (size_t)dims[0];
}

static void make_descriptors(const conv_case *c, descriptors *d) {
    int rank = c->spatial + 2;
    int x_dims[5] = {c->n, c->c}, w_dims[5] = {c->k, c->c / c->groups}, y_dims[5] = {c->n, c->k};
    int strides[5];
    d->w_elems = (size_t)c->k * (size_t)(c->c / c->groups);
    for (int i = 0; i < c->spatial; i++) {
        x_dims[2 + i] = c->in[i];
        w_dims[2 + i] = c->f[i];
        y_dims[2 + i] = (c->in[i] + 2 * c->pad[i] - c->dil[i] * (c->f[i] - 1) - 1) / c->stride[i] + 1;
        d->w_elems *= (size_t)c->f[i];
    }
    d->dtype = dtype_of(c->dt);
    d->elem_size = d->dtype == CUDNN_DATA_DOUBLE ? 8 : d->dtype == CUDNN_DATA_FLOAT ? 4 : 2;
    CHECK(cudnnCreateTensorDescriptor(&d->x));
    CHECK(cudnnCreateTensorDescriptor(&d->y));
    CHECK(cudnnCreateFilterDescriptor(&d->w));
    CHECK(cudnnCreateConvolutionDescriptor(&d->conv));
    d->x_elems = make_strides(c->layout, rank, x_dims, strides);
    CHECK(cudnnSetTensorNdDescriptor(d->x, d->dtype, rank, x_dims, strides));
    d->y_elems = make_strides(c->layout, rank, y_dims, strides);
    CHECK(cudnnSetTensorNdDescriptor(d->y, d->dtype, rank, y_dims, strides));
    cudnnTensorFormat_t format = !strcmp(c->layout, "nhwc") ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
    CHECK(cudnnSetFilterNdDescriptor(d->w, d->dtype, format, rank, w_dims));
    CHECK(cudnnSetConvolutionNdDescriptor(d->conv, c->spatial, c->pad, c->stride, c->dil,
                                          !strcmp(c->mode, "conv") ? CUDNN_CONVOLUTION
                                                                   : CUDNN_CROSS_CORRELATION,
                                          dtype_of(c->ct)));
    CHECK(cudnnSetConvolutionGroupCount(d->conv, c->groups));
    CHECK(cudnnSetConvolutionMathType(d->conv, math_of(c->math)));
}

static void destroy_descriptors(descriptors *d) {
    cudnnDestroyTensorDescriptor(d->x);
    cudnnDestroyTensorDescriptor(d->y);
    cudnnDestroyFilterDescriptor(d->w);
    cudnnDestroyConvolutionDescriptor(d->conv);
}

static unsigned next_random(unsigned *state) {
    *state = *state * 1664525u + 1013904223u;
    return *state >> 8;
}

/* f32: integers in [-3, 3] (exact sums in any order); f64: reals in [-1, 1). */
static void *random_buffer(const descriptors *d, size_t elems, unsigned *state) {
    void *buffer = calloc(elems ? elems : 1, d->elem_size);
    if (!buffer) die("out of memory");
    for (size_t i = 0; i < elems; i++) {
        if (d->dtype == CUDNN_DATA_DOUBLE)
            ((double *)buffer)[i] = (double)next_random(state) / (1u << 23) - 1.0;
        else if (d->dtype == CUDNN_DATA_FLOAT)
            ((float *)buffer)[i] = (float)((int)(next_random(state) % 7) - 3);
    }
    return buffer;
}

static double element(const descriptors *d, const void *buffer, size_t i) {
    return d->dtype == CUDNN_DATA_DOUBLE ? ((const double *)buffer)[i] : ((const float *)buffer)[i];
}

/* ---- operations --------------------------------------------------------------------------- */

typedef struct {
    const conv_case *c;
    cudnnHandle_t handle;
    descriptors d;
    void *x, *w, *y, *workspace;
    float alpha_f, beta_f;
} call_context;

static const void *scale(const call_context *ctx, const double *value, const float *value_f) {
    return ctx->d.dtype == CUDNN_DATA_DOUBLE ? (const void *)value : (const void *)value_f;
}

/* The output of the case's direction: y (fwd), x (= dx, bwd_data) or w (= dw, bwd_filter). */
static void **output_of(call_context *ctx, size_t *elems) {
    const char *dir = ctx->c->dir;
    if (!strcmp(dir, "fwd")) return *elems = ctx->d.y_elems, &ctx->y;
    if (!strcmp(dir, "bwd_data")) return *elems = ctx->d.x_elems, &ctx->x;
    return *elems = ctx->d.w_elems, &ctx->w;
}

static cudnnStatus_t run_conv(call_context *ctx, bool through_double) {
    const conv_case *c = ctx->c;
    const descriptors *d = &ctx->d;
    const void *alpha = scale(ctx, &c->alpha, &ctx->alpha_f), *beta = scale(ctx, &c->beta, &ctx->beta_f);
    if (!strcmp(c->dir, "fwd"))
        return (through_double ? direct.forward : cudnnConvolutionForward)(
            ctx->handle, alpha, d->x, ctx->x, d->w, ctx->w, d->conv, (cudnnConvolutionFwdAlgo_t)c->algo,
            ctx->workspace, c->workspace, beta, d->y, ctx->y);
    if (!strcmp(c->dir, "bwd_data"))
        return (through_double ? direct.backward_data : cudnnConvolutionBackwardData)(
            ctx->handle, alpha, d->w, ctx->w, d->y, ctx->y, d->conv, (cudnnConvolutionBwdDataAlgo_t)c->algo,
            ctx->workspace, c->workspace, beta, d->x, ctx->x);
    return (through_double ? direct.backward_filter : cudnnConvolutionBackwardFilter)(
        ctx->handle, alpha, d->x, ctx->x, d->y, ctx->y, d->conv, (cudnnConvolutionBwdFilterAlgo_t)c->algo,
        ctx->workspace, c->workspace, beta, d->w, ctx->w);
}

static int op_conv(call_context *ctx, char *out, size_t size) {
    size_t elems;
    void **output = output_of(ctx, &elems);
    void *initial = malloc(elems * ctx->d.elem_size + 1);
    memcpy(initial, *output, elems * ctx->d.elem_size);
    cudnnStatus_t status = run_conv(ctx, false);
    void *through_shim = *output;
    *output = initial;
    cudnnStatus_t ref_status = run_conv(ctx, true);
    /* Equal values (so -0 == 0; a NaN, e.g. from a workspace overlapping the output, never is). */
    bool exact = true;
    double max_rel = 0;
    for (size_t i = 0; i < elems; i++) {
        double a = element(&ctx->d, through_shim, i), b = element(&ctx->d, initial, i);
        if (a == b) continue;
        exact = false;
        double rel = fabs(a - b) / fmax(fabs(b), 1e-300);
        max_rel = isnan(rel) || rel > max_rel ? (isnan(rel) ? INFINITY : rel) : max_rel;
    }
    *output = through_shim;
    free(initial);
    return snprintf(out, size, " status=%d ref_status=%d exact=%d max_rel=%.3g workspace=0x%lx",
                    (int)status, (int)ref_status, exact, max_rel, (unsigned long)(uintptr_t)ctx->workspace);
}

#define QUERY_ARGS(perf_type)                                                            \
    int returned = -1;                                                                   \
    perf_type *perf = calloc((size_t)(c->requested > 0 ? c->requested : 1), sizeof *perf); \
    cudnnStatus_t status

static int print_perf(char *out, size_t size, cudnnStatus_t status, int returned, const void *results,
                      size_t stride) {
    int used = snprintf(out, size, " status=%d returned=%d perf=", (int)status, returned);
    for (int i = 0; i < returned && i < 64; i++) {
        /* All three perf structs share one layout: algo, status, time, memory, determinism, math. */
        const cudnnConvolutionFwdAlgoPerf_t *p =
            (const cudnnConvolutionFwdAlgoPerf_t *)((const char *)results + (size_t)i * stride);
        used += snprintf(out + used, size - (size_t)used, "%s%d:%d:%g:%zu:%d:%d", i ? "," : "",
                         (int)p->algo, (int)p->status, p->time, p->memory, (int)p->mathType,
                         (int)p->determinism);
    }
    return used;
}

static int op_query(call_context *ctx, char *out, size_t size) {
    const conv_case *c = ctx->c;
    const descriptors *d = &ctx->d;
    bool v7 = !strcmp(c->op, "get_v7"), find = !strcmp(c->op, "find");
    int used;
    if (!strcmp(c->dir, "fwd")) {
        QUERY_ARGS(cudnnConvolutionFwdAlgoPerf_t);
        status = v7 ? cudnnGetConvolutionForwardAlgorithm_v7(ctx->handle, d->x, d->w, d->conv, d->y, c->requested, &returned, perf)
                 : find ? cudnnFindConvolutionForwardAlgorithm(ctx->handle, d->x, d->w, d->conv, d->y, c->requested, &returned, perf)
                 : cudnnFindConvolutionForwardAlgorithmEx(ctx->handle, d->x, ctx->x, d->w, ctx->w, d->conv, d->y, ctx->y,
                                                          c->requested, &returned, perf, ctx->workspace, c->workspace);
        used = print_perf(out, size, status, returned, perf, sizeof *perf);
        free(perf);
    } else if (!strcmp(c->dir, "bwd_data")) {
        QUERY_ARGS(cudnnConvolutionBwdDataAlgoPerf_t);
        status = v7 ? cudnnGetConvolutionBackwardDataAlgorithm_v7(ctx->handle, d->w, d->y, d->conv, d->x, c->requested, &returned, perf)
                 : find ? cudnnFindConvolutionBackwardDataAlgorithm(ctx->handle, d->w, d->y, d->conv, d->x, c->requested, &returned, perf)
                 : cudnnFindConvolutionBackwardDataAlgorithmEx(ctx->handle, d->w, ctx->w, d->y, ctx->y, d->conv, d->x, ctx->x,
                                                               c->requested, &returned, perf, ctx->workspace, c->workspace);
        used = print_perf(out, size, status, returned, perf, sizeof *perf);
        free(perf);
    } else {
        QUERY_ARGS(cudnnConvolutionBwdFilterAlgoPerf_t);
        status = v7 ? cudnnGetConvolutionBackwardFilterAlgorithm_v7(ctx->handle, d->x, d->y, d->conv, d->w, c->requested, &returned, perf)
                 : find ? cudnnFindConvolutionBackwardFilterAlgorithm(ctx->handle, d->x, d->y, d->conv, d->w, c->requested, &returned, perf)
                 : cudnnFindConvolutionBackwardFilterAlgorithmEx(ctx->handle, d->x, ctx->x, d->y, ctx->y, d->conv, d->w, ctx->w,
                                                                 c->requested, &returned, perf, ctx->workspace, c->workspace);
        used = print_perf(out, size, status, returned, perf, sizeof *perf);
        free(perf);
    }
    return used;
}

static int op_workspace_size(call_context *ctx, char *out, size_t size) {
    const conv_case *c = ctx->c;
    const descriptors *d = &ctx->d;
    size_t bytes = 0;
    cudnnStatus_t status;
    if (!strcmp(c->dir, "fwd"))
        status = cudnnGetConvolutionForwardWorkspaceSize(ctx->handle, d->x, d->w, d->conv, d->y,
                                                         (cudnnConvolutionFwdAlgo_t)c->algo, &bytes);
    else if (!strcmp(c->dir, "bwd_data"))
        status = cudnnGetConvolutionBackwardDataWorkspaceSize(ctx->handle, d->w, d->y, d->conv, d->x,
                                                              (cudnnConvolutionBwdDataAlgo_t)c->algo, &bytes);
    else
        status = cudnnGetConvolutionBackwardFilterWorkspaceSize(ctx->handle, d->x, d->y, d->conv, d->w,
                                                                (cudnnConvolutionBwdFilterAlgo_t)c->algo, &bytes);
    return snprintf(out, size, " status=%d size=%zu", (int)status, bytes);
}

static void run_case(cudnnHandle_t handle, int index, const conv_case *c, char *out, size_t size) {
    call_context ctx = {.c = c, .handle = handle, .alpha_f = (float)c->alpha, .beta_f = (float)c->beta};
    make_descriptors(c, &ctx.d);
    int used = snprintf(out, size, "case %d op=%s", index, c->op);
    if (shim_key) {
        char key[512];
        int n = 0, dir = !strcmp(c->dir, "fwd") ? 0 : !strcmp(c->dir, "bwd_data") ? 1 : 2;
        int rc = shim_key(dir, ctx.d.x, ctx.d.w, ctx.d.conv, ctx.d.y, key, sizeof key, &n);
        for (char *p = key; *p; p++) if (*p == ' ') *p = '_';
        used += snprintf(out + used, size - (size_t)used, rc == 0 ? " key=%s" : " nokey=%s", key);
    } else {
        used += snprintf(out + used, size - (size_t)used, " key=-");
    }
    if (strcmp(c->op, "key") != 0) {
        unsigned state = c->seed;
        ctx.x = random_buffer(&ctx.d, ctx.d.x_elems, &state);
        ctx.w = random_buffer(&ctx.d, ctx.d.w_elems, &state);
        ctx.y = random_buffer(&ctx.d, ctx.d.y_elems, &state);
        ctx.workspace = c->workspace ? malloc(c->workspace) : NULL;
        if (!strcmp(c->op, "conv"))
            op_conv(&ctx, out + used, size - (size_t)used);
        else if (!strcmp(c->op, "ws"))
            op_workspace_size(&ctx, out + used, size - (size_t)used);
        else
            op_query(&ctx, out + used, size - (size_t)used);
        free(ctx.x);
        free(ctx.w);
        free(ctx.y);
        free(ctx.workspace);
    }
    destroy_descriptors(&ctx.d);
}

/* ---- main --------------------------------------------------------------------------------- */

static conv_case cases[MAX_CASES];
static char outputs[MAX_CASES][OUTPUT_MAX];
static int case_count, thread_count = 1;

static void *worker(void *arg) {
    int first = (int)(intptr_t)arg;
    cudnnHandle_t handle;
    CHECK(cudnnCreate(&handle));
    for (int i = first; i < case_count; i += thread_count)
        run_case(handle, i, &cases[i], outputs[i], OUTPUT_MAX);
    CHECK(cudnnDestroy(handle));
    return NULL;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--threads")) thread_count = atoi(argv[2]);
    if (thread_count < 1 || thread_count > 64) die("--threads must be 1..64");
    void *library = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);
    if (!library) die("libcudnn.so.9 is not loaded");
    direct.forward = (__typeof__(direct.forward))dlsym(library, "cudnnConvolutionForward");
    direct.backward_data = (__typeof__(direct.backward_data))dlsym(library, "cudnnConvolutionBackwardData");
    direct.backward_filter = (__typeof__(direct.backward_filter))dlsym(library, "cudnnConvolutionBackwardFilter");
    if (!direct.forward || !direct.backward_data || !direct.backward_filter) die("double lacks a function");
    shim_key = (key_fn)dlsym(RTLD_DEFAULT, "mucudnn_kernel_key");

    char line[LINE_MAX_LENGTH];
    while (fgets(line, sizeof line, stdin)) {
        if (line[0] == '#' || line[strspn(line, " \t\n")] == '\0') continue;
        if (case_count == MAX_CASES) die("too many cases");
        parse_case(line, &cases[case_count++]);
    }
    pthread_t threads[64];
    for (int t = 0; t < thread_count; t++)
        if (pthread_create(&threads[t], NULL, worker, (void *)(intptr_t)t)) die("pthread_create failed");
    for (int t = 0; t < thread_count; t++) pthread_join(threads[t], NULL);
    for (int i = 0; i < case_count; i++) puts(outputs[i]);
    return 0;
}

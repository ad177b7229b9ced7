/*
 * conv_driver: runs cuDNN legacy convolution calls described on stdin, for the shim's tests.
 *
 * Linked against libcudnn.so.9 (the test double) and run with or without
 * LD_PRELOAD=libmucudnn.so. Each stdin line is one case of space-separated name=value fields:
 *
 *   op=conv|get_v7|find|find_ex|ws|key  dir=fwd|bwd_data|bwd_filter  dt=f32|f64|f16|bf16 ct=..
 *   math=default|tensor_op|tensor_op_conv|fma  layout=nchw|nhwc|padded  n= c= in=HxW|DxHxW k=
 *   f= pad= stride= dil= g= mode=xcorr|conv  alpha= beta= algo= ws=BYTES seed= requested=
 *   repeat=R (op=conv: the call through the public symbol R times on the same buffers)
 *   null_beta=1 (op=conv: beta is a NULL pointer, which cuDNN reports)
 *   rehandle=1 (op=conv: each of the R calls on a new handle, the previous one destroyed)
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
#define DRIVER_NAME "conv_driver"
#include "driver_common.h"

typedef struct {
    char op[16], dir[16], dt[8], ct[8], math[16], layout[8], mode[8];
    conv_params params;
    int algo, requested, repeat, null_beta;
    size_t workspace;
} conv_case;

static conv_case cases[MAX_CASES];

typedef int (*key_fn)(int, cudnnTensorDescriptor_t, cudnnFilterDescriptor_t,
                      cudnnConvolutionDescriptor_t, cudnnTensorDescriptor_t, char *, size_t, int *);
static key_fn shim_key; /* mucudnn_kernel_key, when the shim is preloaded */

/* ---- parsing ------------------------------------------------------------------------------ */

/* The fields of this driver only (op dir dt ct math layout mode algo requested ws); false for any other name. */
static bool own_field(void *arg, const char *name, const char *value) {
    conv_case *c = arg;
    if (0) {}
    TEXT_FIELD(op); TEXT_FIELD(dir); TEXT_FIELD(dt); TEXT_FIELD(ct); TEXT_FIELD(math); TEXT_FIELD(layout);
    TEXT_FIELD(mode);
    else if (!strcmp(name, "algo")) c->algo = atoi(value);
    else if (!strcmp(name, "requested")) c->requested = atoi(value);
    else if (!strcmp(name, "repeat")) c->repeat = atoi(value);
    else if (!strcmp(name, "null_beta")) c->null_beta = atoi(value);
    else if (!strcmp(name, "ws")) c->workspace = strtoull(value, NULL, 10);
    else return false;
    return true;
}

static void parse_case(char *line, int index) {
    conv_case *c = &cases[index];
    *c = (conv_case){.op = "conv", .dir = "fwd", .dt = "f32", .ct = "", .math = "fma",
                     .layout = "nchw", .mode = "xcorr", .algo = 0, .requested = 8, .repeat = 1};
    parse_fields(line, &c->params, own_field, c);
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

/* ---- descriptors ---------------------------------------------------------------------------- */

/* The case's shapes ("padded" is NCHW with one unused element per row) and legacy descriptors. */
static void make_descriptors(const conv_case *c, shapes *s, legacy *d) {
    make_shapes(&c->params, !strcmp(c->layout, "nhwc"), !strcmp(c->layout, "padded") ? 1 : 0,
                dtype_of(c->dt), s);
    make_legacy_tensors(s, d);
    const conv_params *q = &c->params;
    CHECK(cudnnSetConvolutionNdDescriptor(d->conv, q->spatial, q->pad, q->stride, q->dil,
                                          !strcmp(c->mode, "conv") ? CUDNN_CONVOLUTION
                                                                   : CUDNN_CROSS_CORRELATION,
                                          dtype_of(c->ct)));
    CHECK(cudnnSetConvolutionGroupCount(d->conv, q->groups));
    CHECK(cudnnSetConvolutionMathType(d->conv, math_of(c->math)));
}

/* ---- operations --------------------------------------------------------------------------- */

typedef struct {
    const conv_case *c;
    cudnnHandle_t handle;
    shapes s;
    legacy d;
    void *x, *w, *y, *workspace;
    float alpha_f, beta_f;
} call_context;

static cudnnStatus_t run_conv(call_context *ctx, bool through_double) {
    const conv_case *c = ctx->c;
    const legacy *d = &ctx->d;
    const void *alpha = scale_of(&ctx->s, &c->params.alpha, &ctx->alpha_f);
    const void *beta = c->null_beta ? NULL : scale_of(&ctx->s, &c->params.beta, &ctx->beta_f);
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
    void **output = output_of(ctx->c->dir, &ctx->s, &ctx->x, &ctx->w, &ctx->y, &elems);
    void *initial = malloc(elems * ctx->s.elem_size + 1);
    memcpy(initial, *output, elems * ctx->s.elem_size);
    /* repeat=R: the same call R times on the same buffers, the output restored before each (a
     * plan's second and later calls run as a CUDA graph); the last one is compared. */
    /* rehandle=1: each call on a handle of its own, the previous one destroyed first (a new
     * handle may get the old one's address). */
    cudnnHandle_t callers = ctx->handle;
    if (ctx->c->params.rehandle) CHECK(cudnnCreate(&ctx->handle));
    cudnnStatus_t status = run_conv(ctx, false);
    for (int i = 1; i < ctx->c->repeat; i++) {
        memcpy(*output, initial, elems * ctx->s.elem_size);
        if (ctx->c->params.rehandle) {
            CHECK(cudnnDestroy(ctx->handle));
            CHECK(cudnnCreate(&ctx->handle));
        }
        status = run_conv(ctx, false);
    }
    if (ctx->c->params.rehandle) CHECK(cudnnDestroy(ctx->handle));
    ctx->handle = callers;
    void *through_shim = *output;
    *output = initial;
    cudnnStatus_t ref_status = run_conv(ctx, true);
    double max_rel;
    int exact = compare(&ctx->s, through_shim, initial, elems, &max_rel);
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
    const legacy *d = &ctx->d;
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
    const legacy *d = &ctx->d;
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

static void run_case(cudnnHandle_t handle, int index, char *out, size_t size) {
    const conv_case *c = &cases[index];
    call_context ctx = {.c = c, .handle = handle, .alpha_f = (float)c->params.alpha,
                        .beta_f = (float)c->params.beta};
    make_descriptors(c, &ctx.s, &ctx.d);
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
        random_operands(&ctx.s, c->params.seed, &ctx.x, &ctx.w, &ctx.y);
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
    destroy_legacy(&ctx.d);
}

/* ---- main --------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    shim_key = (key_fn)dlsym(RTLD_DEFAULT, "mucudnn_kernel_key");
    return run_driver(argc, argv, parse_case, run_case);
}

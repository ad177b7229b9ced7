/*
 * driver_common.h: what conv_driver.c and graph_driver.c share. Each driver is one translation
 * unit that defines DRIVER_NAME (its name, the prefix of its error messages) and includes this
 * header; everything here is static, and each driver uses all of it.
 *
 * Both drivers read cases of space-separated name=value fields on stdin; the fields of the
 * convolution itself (n c k g in f pad stride dil alpha beta seed) are parsed here into a
 * conv_params, the others by the driver. Both run their cases on one or more threads (--threads T)
 * and print one output line per case, in case order.
 */
#ifndef DRIVER_COMMON_H
#define DRIVER_COMMON_H

#ifndef DRIVER_NAME
#error "define DRIVER_NAME before including driver_common.h"
#endif

#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cudnn.h>

#define MAX_CASES 4096
#define LINE_MAX_LENGTH 4096
#define OUTPUT_MAX 8192

/* Prints "DRIVER_NAME: what" and exits with status 2. */
static void die(const char *what) {
    fprintf(stderr, DRIVER_NAME ": %s\n", what);
    exit(2);
}

/* Runs a cuDNN call that must succeed; on failure prints it with its status and exits with 2. */
#define CHECK(call)                                                                    \
    do {                                                                               \
        cudnnStatus_t status_ = (call);                                                \
        if (status_ != CUDNN_STATUS_SUCCESS) {                                         \
            fprintf(stderr, DRIVER_NAME ": %s failed: %d\n", #call, (int)status_);     \
            exit(2);                                                                   \
        }                                                                              \
    } while (0)

/* ---- parsing ------------------------------------------------------------------------------ */

/* The convolution fields of a case, common to both drivers. */
typedef struct {
    int n, c, k, groups, spatial;
    int in[3], f[3], pad[3], stride[3], dil[3];
    double alpha, beta;
    unsigned seed;
    int rehandle; /* 1: the case runs on handles of its own, destroyed and created anew between calls */
} conv_params;

/* "AxBxC" (1 to 3 values) into out; returns how many. */
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

/* Within a driver's own-field function (locals `name`, `value` and the case `c`): `else if` the
 * field is the char array c->field, the value copied into it (truncated to fit). */
#define TEXT_FIELD(field) else if (!strcmp(name, #field)) snprintf(c->field, sizeof c->field, "%s", value)

/* Parses one case line (modified in place): the convolution fields into `p`, any other field
 * through own_field(c, name, value), which returns false for a name it does not know. Defaults:
 * n=2 c=1 k=1 g=1 alpha=1 beta=0 seed=1; per spatial dim of in= (required) pad 0, stride 1,
 * dil 1 where the field is absent, f 1 where not given. */
static void parse_fields(char *line, conv_params *p,
                         bool (*own_field)(void *c, const char *name, const char *value), void *c) {
    *p = (conv_params){.n = 2, .c = 1, .k = 1, .groups = 1, .alpha = 1, .beta = 0, .seed = 1};
    int pad_count = 0, stride_count = 0, dil_count = 0;
    for (char *token = strtok(line, " \t\n"); token; token = strtok(NULL, " \t\n")) {
        char *value = strchr(token, '=');
        if (!value) die("field without '='");
        *value++ = '\0';
        if (!strcmp(token, "n")) p->n = atoi(value);
        else if (!strcmp(token, "c")) p->c = atoi(value);
        else if (!strcmp(token, "k")) p->k = atoi(value);
        else if (!strcmp(token, "g")) p->groups = atoi(value);
        else if (!strcmp(token, "in")) p->spatial = parse_dims(value, p->in);
        else if (!strcmp(token, "f")) parse_dims(value, p->f);
        else if (!strcmp(token, "pad")) pad_count = parse_dims(value, p->pad);
        else if (!strcmp(token, "stride")) stride_count = parse_dims(value, p->stride);
        else if (!strcmp(token, "dil")) dil_count = parse_dims(value, p->dil);
        else if (!strcmp(token, "alpha")) p->alpha = atof(value);
        else if (!strcmp(token, "beta")) p->beta = atof(value);
        else if (!strcmp(token, "seed")) p->seed = (unsigned)strtoul(value, NULL, 10);
        else if (!strcmp(token, "rehandle")) p->rehandle = atoi(value);
        else if (!own_field(c, token, value)) die("unknown field");
    }
    if (p->spatial == 0) die("in= is required");
    for (int i = 0; i < p->spatial; i++) {
        if (!pad_count) p->pad[i] = 0;
        if (!stride_count) p->stride[i] = 1;
        if (!dil_count) p->dil[i] = 1;
        if (!p->f[i]) p->f[i] = 1;
    }
}

/* ---- shapes and data ------------------------------------------------------------------------ */

/* Dims (n, c, spatial...) and strides (in elements) of x, w and y, their element counts, and the
 * data type. */
typedef struct {
    int rank;
    bool nhwc; /* w is KRSC, else KCRS */
    int x_dims[5], w_dims[5], y_dims[5];
    int x_strides[5], w_strides[5], y_strides[5];
    size_t x_elems, w_elems, y_elems, elem_size;
    cudnnDataType_t dtype;
} shapes;

/* Strides of dims (n, c, s...): nhwc puts c innermost (for W: KRSC); otherwise NCHW with `pitch`
 * unused elements after each row. Returns the elements spanned. */
static size_t make_strides(bool nhwc, int pitch, int rank, const int dims[], int strides[]) {
    if (nhwc) {
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

/* The shapes of a convolution: x (n, c, in), w (k, c/groups, f), y (n, k, out); x and y laid out
 * as make_strides(nhwc, pitch), w packed. Elements of `dtype` are 8, 4 (float) or 2 bytes. */
static void make_shapes(const conv_params *p, bool nhwc, int pitch, cudnnDataType_t dtype, shapes *s) {
    s->rank = p->spatial + 2;
    s->nhwc = nhwc;
    s->x_dims[0] = s->y_dims[0] = p->n;
    s->x_dims[1] = p->c;
    s->w_dims[0] = s->y_dims[1] = p->k;
    s->w_dims[1] = p->c / p->groups;
    for (int i = 0; i < p->spatial; i++) {
        s->x_dims[2 + i] = p->in[i];
        s->w_dims[2 + i] = p->f[i];
        s->y_dims[2 + i] = (p->in[i] + 2 * p->pad[i] - p->dil[i] * (p->f[i] - 1) - 1) / p->stride[i] + 1;
    }
    s->x_elems = make_strides(nhwc, pitch, s->rank, s->x_dims, s->x_strides);
    s->w_elems = make_strides(nhwc, 0, s->rank, s->w_dims, s->w_strides);
    s->y_elems = make_strides(nhwc, pitch, s->rank, s->y_dims, s->y_strides);
    s->dtype = dtype;
    s->elem_size = dtype == CUDNN_DATA_DOUBLE ? 8 : dtype == CUDNN_DATA_FLOAT ? 4 : 2;
}

/* The linear congruential generator behind the random data. */
static unsigned next_random(unsigned *state) {
    *state = *state * 1664525u + 1013904223u;
    return *state >> 8;
}

/* f32: integers in [-3, 3] (exact sums in any order); f64: reals in [-1, 1); other types: zeros. */
static void *random_buffer(const shapes *s, size_t elems, unsigned *state) {
    void *buffer = calloc(elems ? elems : 1, s->elem_size);
    if (!buffer) die("out of memory");
    for (size_t i = 0; i < elems; i++) {
        if (s->dtype == CUDNN_DATA_DOUBLE)
            ((double *)buffer)[i] = (double)next_random(state) / (1u << 23) - 1.0;
        else if (s->dtype == CUDNN_DATA_FLOAT)
            ((float *)buffer)[i] = (float)((int)(next_random(state) % 7) - 3);
    }
    return buffer;
}

/* Random x, w and y, filled in this order from one generator seeded with `seed`. */
static void random_operands(const shapes *s, unsigned seed, void **x, void **w, void **y) {
    unsigned state = seed;
    *x = random_buffer(s, s->x_elems, &state);
    *w = random_buffer(s, s->w_elems, &state);
    *y = random_buffer(s, s->y_elems, &state);
}

/* Element i of an f32 or f64 buffer. */
static double element(const shapes *s, const void *buffer, size_t i) {
    return s->dtype == CUDNN_DATA_DOUBLE ? ((const double *)buffer)[i] : ((const float *)buffer)[i];
}

/* The output of direction `dir`: y (fwd), x (= dx, bwd_data) or w (= dw, bwd_filter); its element
 * count into *elems. */
static void **output_of(const char *dir, const shapes *s, void **x, void **w, void **y, size_t *elems) {
    if (!strcmp(dir, "fwd")) return *elems = s->y_elems, y;
    if (!strcmp(dir, "bwd_data")) return *elems = s->x_elems, x;
    return *elems = s->w_elems, w;
}

/* Whether `got` equals `expected` element by element; the largest relative difference into
 * *max_rel (INFINITY once a NaN turns up). Equal values (so -0 == 0; a NaN, e.g. from a workspace
 * overlapping the output, never is). */
static int compare(const shapes *s, const void *got, const void *expected, size_t elems, double *max_rel) {
    bool exact = true;
    *max_rel = 0;
    if (s->dtype != CUDNN_DATA_FLOAT && s->dtype != CUDNN_DATA_DOUBLE) { /* 2-byte types: bits only */
        exact = memcmp(got, expected, elems * s->elem_size) == 0;
        *max_rel = exact ? 0 : INFINITY;
        return exact;
    }
    for (size_t i = 0; i < elems; i++) {
        double a = element(s, got, i), b = element(s, expected, i);
        if (a == b) continue;
        exact = false;
        double rel = fabs(a - b) / fmax(fabs(b), 1e-300);
        *max_rel = isnan(rel) ? INFINITY : fmax(rel, *max_rel);
    }
    return exact;
}

/* A scale factor as the legacy calls take it: the double for f64 data, else its float copy. */
static const void *scale_of(const shapes *s, const double *value, const float *as_float) {
    return s->dtype == CUDNN_DATA_DOUBLE ? (const void *)value : (const void *)as_float;
}

/* ---- legacy descriptors -------------------------------------------------------------------- */

typedef struct {
    cudnnTensorDescriptor_t x, y;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
} legacy;

/* Creates the four descriptors and sets x, y and w from the shapes; the caller sets the
 * convolution. */
static void make_legacy_tensors(const shapes *s, legacy *l) {
    CHECK(cudnnCreateTensorDescriptor(&l->x));
    CHECK(cudnnCreateTensorDescriptor(&l->y));
    CHECK(cudnnCreateFilterDescriptor(&l->w));
    CHECK(cudnnCreateConvolutionDescriptor(&l->conv));
    CHECK(cudnnSetTensorNdDescriptor(l->x, s->dtype, s->rank, s->x_dims, s->x_strides));
    CHECK(cudnnSetTensorNdDescriptor(l->y, s->dtype, s->rank, s->y_dims, s->y_strides));
    CHECK(cudnnSetFilterNdDescriptor(l->w, s->dtype, s->nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                     s->rank, s->w_dims));
}

static void destroy_legacy(legacy *l) {
    cudnnDestroyTensorDescriptor(l->x);
    cudnnDestroyTensorDescriptor(l->y);
    cudnnDestroyFilterDescriptor(l->w);
    cudnnDestroyConvolutionDescriptor(l->conv);
}

/* ---- main ---------------------------------------------------------------------------------- */

/* The double's own legacy functions, reached around the preload (dlsym on its handle, which the
 * preload cannot interpose). */
static struct {
    __typeof__(cudnnConvolutionForward) *forward;
    __typeof__(cudnnConvolutionBackwardData) *backward_data;
    __typeof__(cudnnConvolutionBackwardFilter) *backward_filter;
} direct;

typedef void (*run_case_fn)(cudnnHandle_t handle, int index, char *out, size_t size);

static run_case_fn run_one;
static char outputs[MAX_CASES][OUTPUT_MAX];
static int case_count, thread_count = 1;

/* Thread `arg` of thread_count: its own handle, cases arg, arg + thread_count, ... */
static void *worker(void *arg) {
    int first = (int)(intptr_t)arg;
    cudnnHandle_t handle;
    CHECK(cudnnCreate(&handle));
    for (int i = first; i < case_count; i += thread_count) run_one(handle, i, outputs[i], OUTPUT_MAX);
    CHECK(cudnnDestroy(handle));
    return NULL;
}

/* A driver's main: argument --threads T (1..64, default 1); `direct` from the loaded double; every
 * stdin line but blank ones and '#' comments is case 0, 1, ... through parse(line, index); then
 * the cases run on T threads through run(handle, index, out, size) and their lines are printed
 * in case order. */
/* $DRIVER_ALLOCATOR="RESERVED ALLOCATED" (or "fail"): what a framework's caching allocator would
 * say it holds and uses, told to the shim (when preloaded) through mucudnn_set_allocator, as
 * mucudnn's PyTorch site does. */
static size_t allocator_reserved, allocator_allocated;
static int allocator_fails;

static atomic_int allocator_asked;

static void say_allocator_asked(void) { fprintf(stderr, "driver: allocator asked %d times\n", atomic_load(&allocator_asked)); }

static int allocator_stats(size_t *reserved, size_t *allocated) {
    atomic_fetch_add(&allocator_asked, 1);
    *reserved = allocator_reserved;
    *allocated = allocator_allocated;
    return allocator_fails;
}

static void register_allocator(void) {
    const char *text = getenv("DRIVER_ALLOCATOR");
    void (*set)(int (*)(size_t *, size_t *)) =
        (void (*)(int (*)(size_t *, size_t *)))dlsym(RTLD_DEFAULT, "mucudnn_set_allocator");
    if (text == NULL || set == NULL) return;
    unsigned long long reserved = 0, allocated = 0;
    allocator_fails = strcmp(text, "fail") == 0 ? -1 : 0;
    if (!allocator_fails && sscanf(text, "%llu %llu", &reserved, &allocated) != 2)
        die("DRIVER_ALLOCATOR: RESERVED ALLOCATED or fail");
    allocator_reserved = (size_t)reserved;
    allocator_allocated = (size_t)allocated;
    set(allocator_stats);
    atexit(say_allocator_asked);
}

static int run_driver(int argc, char **argv, void (*parse)(char *line, int index), run_case_fn run) {
    if (argc == 3 && !strcmp(argv[1], "--threads")) thread_count = atoi(argv[2]);
    if (thread_count < 1 || thread_count > 64) die("--threads must be 1..64");
    register_allocator();
    void *library = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);
    if (!library) die("libcudnn.so.9 is not loaded");
    direct.forward = (__typeof__(direct.forward))dlsym(library, "cudnnConvolutionForward");
    direct.backward_data = (__typeof__(direct.backward_data))dlsym(library, "cudnnConvolutionBackwardData");
    direct.backward_filter = (__typeof__(direct.backward_filter))dlsym(library, "cudnnConvolutionBackwardFilter");
    if (!direct.forward || !direct.backward_data || !direct.backward_filter) die("double lacks a function");

    char line[LINE_MAX_LENGTH];
    while (fgets(line, sizeof line, stdin)) {
        if (line[0] == '#' || line[strspn(line, " \t\n")] == '\0') continue;
        if (case_count == MAX_CASES) die("too many cases");
        parse(line, case_count++);
    }
    run_one = run;
    pthread_t threads[64];
    for (int t = 0; t < thread_count; t++)
        if (pthread_create(&threads[t], NULL, worker, (void *)(intptr_t)t)) die("pthread_create failed");
    for (int t = 0; t < thread_count; t++) pthread_join(threads[t], NULL);
    for (int i = 0; i < case_count; i++) puts(outputs[i]);
    return 0;
}

#endif /* DRIVER_COMMON_H */

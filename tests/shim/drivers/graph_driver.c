/*
 * graph_driver: runs convolutions through cuDNN's graph (backend) API, described on stdin, for the
 * shim's tests. The sibling of conv_driver.c (the legacy API).
 *
 * Linked against libcudnn.so.9 (the test double) and run with or without
 * LD_PRELOAD=libmucudnn.so. Each stdin line is one case of space-separated name=value fields:
 *
 *   op=exec|heur  dir=fwd|bwd_data|bwd_filter  dt=f32|f64  layout=nchw|nhwc  n= c= in=HxW|DxHxW
 *   k= f= pad= stride= dil= g= alpha= beta= engine=heur|INDEX fuse=0|1 seed= repeat=R
 *   knobs=TYPE.VALUE,...   (engine=INDEX only)
 *
 * The calls follow cudnn-frontend as PyTorch drives it: finalized tensors with UIDs 'x', 'w', 'y'
 * (and a virtual 'v' between the convolution and the ReLU when fuse=1), W packed KCRS (nchw) or
 * KRSC (nhwc), a convolution descriptor, the operation(s), the operation graph; then either the
 * engine heuristics (mode INSTANT: ask the count, create that many engine configs, get them, and
 * keep the first whose execution plan finalizes) or engine=INDEX (engine + engine config with the
 * knob choices + plan). Like PyTorch, which caches only the plan, everything but the plan and its
 * engine config is destroyed before the executions. Then the plan's workspace size is queried,
 * exactly that many bytes are allocated (followed by a canary guard region), and `repeat` times a
 * variant pack is created, executed and destroyed.
 *
 * The reference runs the same convolution `repeat` times through the double's own legacy functions
 * (dlsym on its handle, which the preload cannot interpose), plus a ReLU here for fuse=1, on the
 * same seeded random data (f32: small integers, so sums are exact in any order; f64: random
 * reals; the initial output is random too, so beta != 0 is covered). Output, in case order:
 *
 *   case I op=exec status=S ref_status=S exact=0|1 max_rel=E ws=BYTES engine=E guard=ok|clobbered finalize=S
 *   case I op=heur status=S results=E:FINALIZE_STATUS:WS,...
 *
 * status is the first failing execution's status (0 if all succeeded); finalize the status of the
 * last finalization on the way to the plan (engine=INDEX: engine, engine config, plan; engine=heur:
 * the plans tried in heuristics order until one finalizes); engine the
 * plan's global engine index read back through the plan -> engine config -> engine descriptors,
 * ws the plan's workspace size. op=heur lists every heuristics result in order: its engine index
 * (read back from the config), its plan's finalize status, the config's WORKSPACE_SIZE; status is
 * that of the RESULTS query. A field is -1 when its step was skipped.
 *
 * With argument --threads T the cases are shared among T threads, each with its own handle;
 * output stays in case order.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <float.h>
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
#define MAX_KNOBS 16
#define GUARD_BYTES 256
#define CANARY 0x5A

/* cuDNN 9 marks the handle attributes deprecated (with CUDNN_WARN_DEPRECATED); cudnn-frontend and
 * so PyTorch still set them. */
#define ALLOW_DEPRECATED_BEGIN \
    _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wdeprecated-declarations\"")
#define ALLOW_DEPRECATED_END _Pragma("GCC diagnostic pop")

typedef struct {
    char op[8], dir[16], dt[8], layout[8];
    int n, c, k, groups, spatial;
    int in[3], f[3], pad[3], stride[3], dil[3];
    double alpha, beta;
    int engine; /* -1: heuristics */
    bool fuse;
    unsigned seed;
    int repeat;
    int knob_count;
    int64_t knob_types[MAX_KNOBS], knob_values[MAX_KNOBS];
} graph_case;

/* The double's own legacy functions, reached around the preload. */
static struct {
    __typeof__(cudnnConvolutionForward) *forward;
    __typeof__(cudnnConvolutionBackwardData) *backward_data;
    __typeof__(cudnnConvolutionBackwardFilter) *backward_filter;
} direct;

static void die(const char *what) {
    fprintf(stderr, "graph_driver: %s\n", what);
    exit(2);
}

#define CHECK(call)                                                                    \
    do {                                                                               \
        cudnnStatus_t status_ = (call);                                                \
        if (status_ != CUDNN_STATUS_SUCCESS) {                                         \
            fprintf(stderr, "graph_driver: %s failed: %d\n", #call, (int)status_);     \
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

/* "TYPE.VALUE,TYPE.VALUE" */
static void parse_knobs(const char *text, graph_case *c) {
    char *end;
    while (*text) {
        if (c->knob_count == MAX_KNOBS) die("too many knobs");
        c->knob_types[c->knob_count] = strtoll(text, &end, 10);
        if (*end != '.') die("knobs= wants TYPE.VALUE,...");
        c->knob_values[c->knob_count++] = strtoll(end + 1, &end, 10);
        text = *end == ',' ? end + 1 : end;
    }
}

static void parse_case(char *line, graph_case *c) {
    *c = (graph_case){.op = "exec", .dir = "fwd", .dt = "f32", .layout = "nchw", .n = 2, .c = 1,
                      .k = 1, .groups = 1, .alpha = 1, .beta = 0, .engine = -1, .seed = 1,
                      .repeat = 1};
    int pad_count = 0, stride_count = 0, dil_count = 0;
    for (char *token = strtok(line, " \t\n"); token; token = strtok(NULL, " \t\n")) {
        char *value = strchr(token, '=');
        if (!value) die("field without '='");
        *value++ = '\0';
#define TEXT(name) else if (strcmp(token, #name) == 0) snprintf(c->name, sizeof c->name, "%s", value)
        if (0) {}
        TEXT(op); TEXT(dir); TEXT(dt); TEXT(layout);
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
        else if (!strcmp(token, "engine")) c->engine = !strcmp(value, "heur") ? -1 : atoi(value);
        else if (!strcmp(token, "fuse")) c->fuse = atoi(value) != 0;
        else if (!strcmp(token, "seed")) c->seed = (unsigned)strtoul(value, NULL, 10);
        else if (!strcmp(token, "repeat")) c->repeat = atoi(value);
        else if (!strcmp(token, "knobs")) parse_knobs(value, c);
        else die("unknown field");
#undef TEXT
    }
    if (c->spatial == 0) die("in= is required");
    if (c->fuse && strcmp(c->dir, "fwd") != 0) die("fuse=1 needs dir=fwd");
    if (c->knob_count && c->engine < 0) die("knobs= needs engine=INDEX");
    for (int i = 0; i < c->spatial; i++) {
        if (!pad_count) c->pad[i] = 0;
        if (!stride_count) c->stride[i] = 1;
        if (!dil_count) c->dil[i] = 1;
        if (!c->f[i]) c->f[i] = 1;
    }
}

/* ---- shapes and data ------------------------------------------------------------------------ */

typedef struct {
    int rank;
    int x_dims[5], w_dims[5], y_dims[5];
    int x_strides[5], w_strides[5], y_strides[5];
    size_t x_elems, w_elems, y_elems, elem_size;
    cudnnDataType_t dtype;
} shapes;

/* Packed strides of dims (n, c, s...) for a layout; "nhwc" puts c innermost (for W: KRSC). */
static size_t make_strides(const char *layout, int rank, const int dims[], int strides[]) {
    if (!strcmp(layout, "nhwc")) {
        strides[1] = 1;
        strides[rank - 1] = dims[1];
        for (int i = rank - 2; i >= 2; i--) strides[i] = strides[i + 1] * dims[i + 1];
        strides[0] = strides[2] * dims[2];
    } else if (!strcmp(layout, "nchw")) {
        strides[rank - 1] = 1;
        for (int i = rank - 2; i >= 0; i--) strides[i] = strides[i + 1] * dims[i + 1];
    } else {
        die("layout must be nchw or nhwc");
    }
    return (size_t)strides[0] * (size_t)dims[0];
}

static void make_shapes(const graph_case *c, shapes *s) {
    s->rank = c->spatial + 2;
    s->x_dims[0] = s->y_dims[0] = c->n;
    s->x_dims[1] = c->c;
    s->w_dims[0] = s->y_dims[1] = c->k;
    s->w_dims[1] = c->c / c->groups;
    for (int i = 0; i < c->spatial; i++) {
        s->x_dims[2 + i] = c->in[i];
        s->w_dims[2 + i] = c->f[i];
        s->y_dims[2 + i] = (c->in[i] + 2 * c->pad[i] - c->dil[i] * (c->f[i] - 1) - 1) / c->stride[i] + 1;
    }
    s->x_elems = make_strides(c->layout, s->rank, s->x_dims, s->x_strides);
    s->w_elems = make_strides(c->layout, s->rank, s->w_dims, s->w_strides);
    s->y_elems = make_strides(c->layout, s->rank, s->y_dims, s->y_strides);
    if (!strcmp(c->dt, "f32")) s->dtype = CUDNN_DATA_FLOAT, s->elem_size = 4;
    else if (!strcmp(c->dt, "f64")) s->dtype = CUDNN_DATA_DOUBLE, s->elem_size = 8;
    else die("dt must be f32 or f64");
}

static unsigned next_random(unsigned *state) {
    *state = *state * 1664525u + 1013904223u;
    return *state >> 8;
}

/* f32: integers in [-3, 3] (exact sums in any order); f64: reals in [-1, 1). */
static void *random_buffer(const shapes *s, size_t elems, unsigned *state) {
    void *buffer = malloc(elems * s->elem_size);
    if (!buffer) die("out of memory");
    for (size_t i = 0; i < elems; i++) {
        if (s->dtype == CUDNN_DATA_DOUBLE)
            ((double *)buffer)[i] = (double)next_random(state) / (1u << 23) - 1.0;
        else
            ((float *)buffer)[i] = (float)((int)(next_random(state) % 7) - 3);
    }
    return buffer;
}

static void *copy_buffer(const void *buffer, size_t bytes) {
    void *copy = malloc(bytes);
    if (!copy) die("out of memory");
    return memcpy(copy, buffer, bytes);
}

static double element(const shapes *s, const void *buffer, size_t i) {
    return s->dtype == CUDNN_DATA_DOUBLE ? ((const double *)buffer)[i] : ((const float *)buffer)[i];
}

/* The same ReLU as the double's: negatives to 0, NaNs kept. Packed buffers, so index by index. */
static void relu(const shapes *s, void *buffer, size_t elems) {
    for (size_t i = 0; i < elems; i++) {
        if (element(s, buffer, i) >= 0 || isnan(element(s, buffer, i))) continue;
        if (s->dtype == CUDNN_DATA_DOUBLE) ((double *)buffer)[i] = 0;
        else ((float *)buffer)[i] = 0;
    }
}

/* ---- backend descriptors ------------------------------------------------------------------ */

static cudnnBackendDescriptor_t create(cudnnBackendDescriptorType_t type) {
    cudnnBackendDescriptor_t desc;
    CHECK(cudnnBackendCreateDescriptor(type, &desc));
    return desc;
}

static void set(cudnnBackendDescriptor_t desc, cudnnBackendAttributeName_t name,
                cudnnBackendAttributeType_t type, int64_t count, const void *values) {
    CHECK(cudnnBackendSetAttribute(desc, name, type, count, values));
}

static void set_desc(cudnnBackendDescriptor_t desc, cudnnBackendAttributeName_t name,
                     cudnnBackendDescriptor_t value) {
    set(desc, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
}

static void set_int64(cudnnBackendDescriptor_t desc, cudnnBackendAttributeName_t name, int64_t value) {
    set(desc, name, CUDNN_TYPE_INT64, 1, &value);
}

/* A scale factor as the case's data type: FLOAT for f32, DOUBLE for f64. */
static void set_scale(const shapes *s, cudnnBackendDescriptor_t desc, cudnnBackendAttributeName_t name,
                      double value) {
    float as_float = (float)value;
    if (s->dtype == CUDNN_DATA_DOUBLE) set(desc, name, CUDNN_TYPE_DOUBLE, 1, &value);
    else set(desc, name, CUDNN_TYPE_FLOAT, 1, &as_float);
}

static cudnnBackendDescriptor_t make_tensor(const shapes *s, char uid, const int dims[],
                                            const int strides[], bool is_virtual) {
    cudnnBackendDescriptor_t t = create(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    int64_t dims64[5], strides64[5];
    for (int i = 0; i < s->rank; i++) dims64[i] = dims[i], strides64[i] = strides[i];
    set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &s->dtype);
    set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, s->rank, dims64);
    set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, s->rank, strides64);
    set_int64(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, uid);
    set_int64(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16);
    if (is_virtual) set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    CHECK(cudnnBackendFinalize(t));
    return t;
}

static cudnnBackendDescriptor_t make_convolution(const graph_case *c, const shapes *s) {
    cudnnBackendDescriptor_t conv = create(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
    int64_t spatial = c->spatial, pad[3], stride[3], dil[3];
    for (int i = 0; i < c->spatial; i++) pad[i] = c->pad[i], stride[i] = c->stride[i], dil[i] = c->dil[i];
    cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
    set(conv, CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &s->dtype);
    set(conv, CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode);
    set_int64(conv, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, spatial);
    set(conv, CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, spatial, dil);
    set(conv, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, spatial, stride);
    set(conv, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, spatial, pad);
    set(conv, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, spatial, pad);
    CHECK(cudnnBackendFinalize(conv));
    return conv;
}

/* Everything a case builds before planning; destroyed once the plan exists. */
typedef struct {
    cudnnBackendDescriptor_t x, w, y, v, conv, conv_op, pointwise, relu_op, graph;
} graph_parts;

static cudnnBackendDescriptor_t make_conv_op(const graph_case *c, const shapes *s, graph_parts *p) {
    static const struct {
        const char *dir;
        cudnnBackendDescriptorType_t type;
        cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
    } OPS[] = {
        {"fwd", CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
         CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
         CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
         CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA},
        {"bwd_data", CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA},
        {"bwd_filter", CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA},
    };
    for (size_t i = 0; i < sizeof OPS / sizeof OPS[0]; i++) {
        if (strcmp(c->dir, OPS[i].dir) != 0) continue;
        cudnnBackendDescriptor_t op = create(OPS[i].type);
        set_desc(op, OPS[i].x, p->x);
        set_desc(op, OPS[i].w, p->w);
        set_desc(op, OPS[i].y, c->fuse ? p->v : p->y);
        set_desc(op, OPS[i].conv, p->conv);
        set_scale(s, op, OPS[i].alpha, c->alpha);
        set_scale(s, op, OPS[i].beta, c->beta);
        CHECK(cudnnBackendFinalize(op));
        return op;
    }
    die("dir must be fwd, bwd_data or bwd_filter");
    return NULL;
}

/* A ReLU as cudnn-frontend describes one: mode, precision, NaN propagation and the clip values. */
ALLOW_DEPRECATED_BEGIN
static cudnnBackendDescriptor_t make_relu_op(const shapes *s, graph_parts *p) {
    cudnnPointwiseMode_t mode = CUDNN_POINTWISE_RELU_FWD;
    cudnnNanPropagation_t nan = CUDNN_NOT_PROPAGATE_NAN;
    double lower = 0, upper = s->dtype == CUDNN_DATA_FLOAT ? FLT_MAX : DBL_MAX, slope = 0;
    p->pointwise = create(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    set(p->pointwise, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    set(p->pointwise, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &s->dtype);
    set(p->pointwise, CUDNN_ATTR_POINTWISE_NAN_PROPAGATION, CUDNN_TYPE_NAN_PROPOGATION, 1, &nan);
    set(p->pointwise, CUDNN_ATTR_POINTWISE_RELU_LOWER_CLIP, CUDNN_TYPE_DOUBLE, 1, &lower);
    set(p->pointwise, CUDNN_ATTR_POINTWISE_RELU_UPPER_CLIP, CUDNN_TYPE_DOUBLE, 1, &upper);
    set(p->pointwise, CUDNN_ATTR_POINTWISE_RELU_LOWER_CLIP_SLOPE, CUDNN_TYPE_DOUBLE, 1, &slope);
    CHECK(cudnnBackendFinalize(p->pointwise));
    cudnnBackendDescriptor_t op = create(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, p->pointwise);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, p->v);
    set_desc(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, p->y);
    set_scale(s, op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, 1.0);
    set_scale(s, op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, 1.0);
    CHECK(cudnnBackendFinalize(op));
    return op;
}

static void make_graph(cudnnHandle_t handle, const graph_case *c, const shapes *s, graph_parts *p) {
    *p = (graph_parts){0};
    p->x = make_tensor(s, 'x', s->x_dims, s->x_strides, false);
    p->w = make_tensor(s, 'w', s->w_dims, s->w_strides, false);
    p->y = make_tensor(s, 'y', s->y_dims, s->y_strides, false);
    if (c->fuse) p->v = make_tensor(s, 'v', s->y_dims, s->y_strides, true);
    p->conv = make_convolution(c, s);
    p->conv_op = make_conv_op(c, s, p);
    cudnnBackendDescriptor_t ops[2] = {p->conv_op, NULL};
    if (c->fuse) ops[1] = p->relu_op = make_relu_op(s, p);
    p->graph = create(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    set(p->graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    set(p->graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, c->fuse ? 2 : 1, ops);
    CHECK(cudnnBackendFinalize(p->graph));
}

static void destroy_graph(graph_parts *p) {
    cudnnBackendDescriptor_t all[] = {p->x, p->w, p->y, p->v, p->conv, p->conv_op, p->pointwise,
                                      p->relu_op, p->graph};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i]) CHECK(cudnnBackendDestroyDescriptor(all[i]));
}

/* Finalizes a plan for `config`; on failure destroys it and returns the status. */
static cudnnStatus_t make_plan(cudnnHandle_t handle, cudnnBackendDescriptor_t config,
                               cudnnBackendDescriptor_t *plan) {
    *plan = create(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    set(*plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    set_desc(*plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config);
    cudnnStatus_t status = cudnnBackendFinalize(*plan);
    if (status != CUDNN_STATUS_SUCCESS) {
        CHECK(cudnnBackendDestroyDescriptor(*plan));
        *plan = NULL;
    }
    return status;
}
ALLOW_DEPRECATED_END

/* Engine `c->engine` of the graph with the case's knob choices; the engine's finalize status (the
 * config's when the engine finalized). */
static cudnnStatus_t make_indexed_config(const graph_case *c, cudnnBackendDescriptor_t graph,
                                         cudnnBackendDescriptor_t *config) {
    cudnnBackendDescriptor_t engine = create(CUDNN_BACKEND_ENGINE_DESCRIPTOR), knobs[MAX_KNOBS];
    set_desc(engine, CUDNN_ATTR_ENGINE_OPERATION_GRAPH, graph);
    set_int64(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, c->engine);
    cudnnStatus_t status = cudnnBackendFinalize(engine);
    *config = NULL;
    if (status == CUDNN_STATUS_SUCCESS) {
        *config = create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
        set_desc(*config, CUDNN_ATTR_ENGINECFG_ENGINE, engine);
        for (int i = 0; i < c->knob_count; i++) {
            cudnnBackendKnobType_t type = (cudnnBackendKnobType_t)c->knob_types[i];
            knobs[i] = create(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR);
            set(knobs[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &type);
            set_int64(knobs[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, c->knob_values[i]);
            CHECK(cudnnBackendFinalize(knobs[i]));
        }
        set(*config, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, c->knob_count, knobs);
        for (int i = 0; i < c->knob_count; i++) CHECK(cudnnBackendDestroyDescriptor(knobs[i]));
        status = cudnnBackendFinalize(*config);
    }
    CHECK(cudnnBackendDestroyDescriptor(engine));
    return status;
}

/* The heuristics' engine configs (mode INSTANT), as cudnn-frontend asks for them: count, then
 * that many caller-created configs. */
static cudnnStatus_t heuristics(cudnnBackendDescriptor_t graph, cudnnBackendDescriptor_t **configs,
                                int64_t *count) {
    cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_INSTANT;
    cudnnBackendDescriptor_t heur = create(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    set_desc(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
    set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    CHECK(cudnnBackendFinalize(heur));
    *count = 0;
    *configs = NULL;
    cudnnStatus_t status = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, count, NULL);
    if (status == CUDNN_STATUS_SUCCESS) {
        *configs = calloc((size_t)*count + 1, sizeof **configs);
        for (int64_t i = 0; i < *count; i++) (*configs)[i] = create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
        status = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                          CUDNN_TYPE_BACKEND_DESCRIPTOR, *count, count, *configs);
    }
    CHECK(cudnnBackendDestroyDescriptor(heur));
    return status;
}

static void destroy_all(cudnnBackendDescriptor_t *descs, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        if (descs[i]) CHECK(cudnnBackendDestroyDescriptor(descs[i]));
    free(descs);
}

/* The global index of a config's engine, read back through a fresh engine descriptor. */
static int64_t config_engine(cudnnBackendDescriptor_t config) {
    cudnnBackendDescriptor_t engine = create(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    int64_t count, index = -1;
    CHECK(cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                   1, &count, &engine));
    CHECK(cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1,
                                   &count, &index));
    CHECK(cudnnBackendDestroyDescriptor(engine));
    return index;
}

/* The plan's engine, through plan -> engine config -> engine. */
static int64_t plan_engine(cudnnBackendDescriptor_t plan) {
    cudnnBackendDescriptor_t config = create(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    int64_t count;
    CHECK(cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &count, &config));
    int64_t index = config_engine(config);
    CHECK(cudnnBackendDestroyDescriptor(config));
    return index;
}

static int64_t int64_attribute(cudnnBackendDescriptor_t desc, cudnnBackendAttributeName_t name) {
    int64_t count, value = -1;
    CHECK(cudnnBackendGetAttribute(desc, name, CUDNN_TYPE_INT64, 1, &count, &value));
    return value;
}

/* ---- the two operations -------------------------------------------------------------------- */

typedef struct {
    const graph_case *c;
    cudnnHandle_t handle;
    shapes s;
    void *x, *w, *y; /* forward roles: x or dx, w or dw, y or dy */
} call_context;

/* One plan for the case: engine=INDEX, or the first heuristics config that plans (the others are
 * skipped, as cudnn-frontend does). Returns the last finalize status, -1 if there was nothing to
 * plan. */
static int plan_case(call_context *ctx, cudnnBackendDescriptor_t graph, cudnnBackendDescriptor_t *plan,
                     cudnnBackendDescriptor_t *config) {
    *plan = *config = NULL;
    if (ctx->c->engine >= 0) {
        cudnnStatus_t status = make_indexed_config(ctx->c, graph, config);
        return status == CUDNN_STATUS_SUCCESS ? make_plan(ctx->handle, *config, plan) : status;
    }
    cudnnBackendDescriptor_t *configs;
    int64_t count;
    if (heuristics(graph, &configs, &count) != CUDNN_STATUS_SUCCESS) count = 0;
    int status = -1;
    for (int64_t i = 0; i < count && !*plan; i++) {
        status = make_plan(ctx->handle, configs[i], plan);
        if (*plan) *config = configs[i], configs[i] = NULL; /* the plan's config lives as long */
    }
    destroy_all(configs, count);
    return status;
}

static cudnnStatus_t execute(call_context *ctx, cudnnBackendDescriptor_t plan, void *workspace) {
    int64_t uids[] = {'x', 'w', 'y'};
    void *pointers[] = {ctx->x, ctx->w, ctx->y};
    cudnnBackendDescriptor_t pack = create(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 3, pointers);
    set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 3, uids);
    set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
    CHECK(cudnnBackendFinalize(pack));
    cudnnStatus_t status = cudnnBackendExecute(ctx->handle, plan, pack);
    CHECK(cudnnBackendDestroyDescriptor(pack));
    return status;
}

/* Legacy descriptors of the same convolution, for the reference. */
typedef struct {
    cudnnTensorDescriptor_t x, y;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
} legacy;

static void make_legacy(const call_context *ctx, legacy *l) {
    const graph_case *c = ctx->c;
    const shapes *s = &ctx->s;
    CHECK(cudnnCreateTensorDescriptor(&l->x));
    CHECK(cudnnCreateTensorDescriptor(&l->y));
    CHECK(cudnnCreateFilterDescriptor(&l->w));
    CHECK(cudnnCreateConvolutionDescriptor(&l->conv));
    CHECK(cudnnSetTensorNdDescriptor(l->x, s->dtype, s->rank, s->x_dims, s->x_strides));
    CHECK(cudnnSetTensorNdDescriptor(l->y, s->dtype, s->rank, s->y_dims, s->y_strides));
    CHECK(cudnnSetFilterNdDescriptor(l->w, s->dtype, !strcmp(c->layout, "nhwc") ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                     s->rank, s->w_dims));
    CHECK(cudnnSetConvolutionNdDescriptor(l->conv, c->spatial, c->pad, c->stride, c->dil,
                                          CUDNN_CROSS_CORRELATION, s->dtype));
    CHECK(cudnnSetConvolutionGroupCount(l->conv, c->groups));
}

static void destroy_legacy(legacy *l) {
    cudnnDestroyTensorDescriptor(l->x);
    cudnnDestroyTensorDescriptor(l->y);
    cudnnDestroyFilterDescriptor(l->w);
    cudnnDestroyConvolutionDescriptor(l->conv);
}

/* The case's convolution through the double's legacy functions (algorithm 0: no workspace). */
static cudnnStatus_t reference_once(call_context *ctx, const legacy *l) {
    const graph_case *c = ctx->c;
    float alpha_f = (float)c->alpha, beta_f = (float)c->beta;
    const void *alpha = ctx->s.dtype == CUDNN_DATA_DOUBLE ? (const void *)&c->alpha : (const void *)&alpha_f;
    const void *beta = ctx->s.dtype == CUDNN_DATA_DOUBLE ? (const void *)&c->beta : (const void *)&beta_f;
    if (!strcmp(c->dir, "fwd"))
        return direct.forward(ctx->handle, alpha, l->x, ctx->x, l->w, ctx->w, l->conv,
                              CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, NULL, 0, beta, l->y, ctx->y);
    if (!strcmp(c->dir, "bwd_data"))
        return direct.backward_data(ctx->handle, alpha, l->w, ctx->w, l->y, ctx->y, l->conv,
                                    CUDNN_CONVOLUTION_BWD_DATA_ALGO_0, NULL, 0, beta, l->x, ctx->x);
    return direct.backward_filter(ctx->handle, alpha, l->x, ctx->x, l->y, ctx->y, l->conv,
                                  CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, NULL, 0, beta, l->w, ctx->w);
}

/* The reference, `repeat` times like the graph; fuse=1: the convolution into a zeroed buffer (the
 * double's virtual tensor), then the ReLU into y. */
static cudnnStatus_t reference(call_context *ctx) {
    legacy l;
    make_legacy(ctx, &l);
    cudnnStatus_t first_failure = CUDNN_STATUS_SUCCESS;
    for (int r = 0; r < ctx->c->repeat; r++) {
        void *output = ctx->y;
        if (ctx->c->fuse && !(ctx->y = calloc(ctx->s.y_elems, ctx->s.elem_size))) die("out of memory");
        cudnnStatus_t status = reference_once(ctx, &l);
        if (ctx->c->fuse) {
            if (status == CUDNN_STATUS_SUCCESS) {
                relu(&ctx->s, ctx->y, ctx->s.y_elems);
                memcpy(output, ctx->y, ctx->s.y_elems * ctx->s.elem_size);
            }
            free(ctx->y);
            ctx->y = output;
        }
        if (first_failure == CUDNN_STATUS_SUCCESS) first_failure = status;
    }
    destroy_legacy(&l);
    return first_failure;
}

/* The output of the case's direction: y (fwd), x (= dx, bwd_data) or w (= dw, bwd_filter). */
static void **output_of(call_context *ctx, size_t *elems) {
    const char *dir = ctx->c->dir;
    if (!strcmp(dir, "fwd")) return *elems = ctx->s.y_elems, &ctx->y;
    if (!strcmp(dir, "bwd_data")) return *elems = ctx->s.x_elems, &ctx->x;
    return *elems = ctx->s.w_elems, &ctx->w;
}

/* Equal values (so -0 == 0; a NaN, e.g. from a workspace overlapping the output, never is). */
static int compare(const shapes *s, const void *got, const void *expected, size_t elems, double *max_rel) {
    bool exact = true;
    *max_rel = 0;
    for (size_t i = 0; i < elems; i++) {
        double a = element(s, got, i), b = element(s, expected, i);
        if (a == b) continue;
        exact = false;
        double rel = fabs(a - b) / fmax(fabs(b), 1e-300);
        *max_rel = isnan(rel) ? INFINITY : fmax(rel, *max_rel);
    }
    return exact;
}

/* Executes the plan `repeat` times in a fresh workspace of exactly its size, guarded by a canary. */
static cudnnStatus_t run_plan(call_context *ctx, cudnnBackendDescriptor_t plan, int64_t workspace_size,
                              bool *guard_ok) {
    unsigned char *workspace = malloc((size_t)workspace_size + GUARD_BYTES);
    if (!workspace) die("out of memory");
    memset(workspace + workspace_size, CANARY, GUARD_BYTES);
    cudnnStatus_t first_failure = CUDNN_STATUS_SUCCESS;
    for (int r = 0; r < ctx->c->repeat; r++) {
        cudnnStatus_t status = execute(ctx, plan, workspace);
        if (first_failure == CUDNN_STATUS_SUCCESS) first_failure = status;
    }
    *guard_ok = true;
    for (int i = 0; i < GUARD_BYTES; i++) *guard_ok &= workspace[workspace_size + i] == CANARY;
    free(workspace);
    return first_failure;
}

static int op_exec(call_context *ctx, char *out, size_t size) {
    graph_parts parts;
    make_graph(ctx->handle, ctx->c, &ctx->s, &parts);
    cudnnBackendDescriptor_t plan, config;
    int finalize = plan_case(ctx, parts.graph, &plan, &config);
    destroy_graph(&parts); /* the plan must not depend on them (PyTorch caches plans only) */

    size_t elems;
    void **output = output_of(ctx, &elems);
    void *initial = copy_buffer(*output, elems * ctx->s.elem_size);
    int status = -1;
    int64_t workspace = -1, engine = -1;
    bool guard_ok = true;
    if (plan) {
        workspace = int64_attribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE);
        engine = plan_engine(plan);
        status = run_plan(ctx, plan, workspace, &guard_ok);
        CHECK(cudnnBackendDestroyDescriptor(plan));
    }
    if (config) CHECK(cudnnBackendDestroyDescriptor(config));

    void *through_graph = *output;
    *output = initial;
    cudnnStatus_t ref_status = reference(ctx);
    double max_rel;
    int exact = compare(&ctx->s, through_graph, initial, elems, &max_rel);
    *output = through_graph;
    free(initial);
    return snprintf(out, size,
                    " status=%d ref_status=%d exact=%d max_rel=%.3g ws=%lld engine=%lld guard=%s finalize=%d",
                    status, (int)ref_status, exact, max_rel, (long long)workspace, (long long)engine,
                    guard_ok ? "ok" : "clobbered", finalize);
}

static int op_heur(call_context *ctx, char *out, size_t size) {
    graph_parts parts;
    make_graph(ctx->handle, ctx->c, &ctx->s, &parts);
    cudnnBackendDescriptor_t *configs;
    int64_t count;
    cudnnStatus_t status = heuristics(parts.graph, &configs, &count);
    int used = snprintf(out, size, " status=%d results=%s", (int)status, count ? "" : "-");
    for (int64_t i = 0; status == CUDNN_STATUS_SUCCESS && i < count; i++) {
        cudnnBackendDescriptor_t plan;
        cudnnStatus_t finalize = make_plan(ctx->handle, configs[i], &plan);
        if (plan) CHECK(cudnnBackendDestroyDescriptor(plan));
        used += snprintf(out + used, size - (size_t)used, "%s%lld:%d:%lld", i ? "," : "",
                         (long long)config_engine(configs[i]), (int)finalize,
                         (long long)int64_attribute(configs[i], CUDNN_ATTR_ENGINECFG_WORKSPACE_SIZE));
    }
    destroy_all(configs, count);
    destroy_graph(&parts);
    return used;
}

static void run_case(cudnnHandle_t handle, int index, const graph_case *c, char *out, size_t size) {
    call_context ctx = {.c = c, .handle = handle};
    make_shapes(c, &ctx.s);
    unsigned state = c->seed;
    ctx.x = random_buffer(&ctx.s, ctx.s.x_elems, &state);
    ctx.w = random_buffer(&ctx.s, ctx.s.w_elems, &state);
    ctx.y = random_buffer(&ctx.s, ctx.s.y_elems, &state);
    int used = snprintf(out, size, "case %d op=%s", index, c->op);
    if (!strcmp(c->op, "exec")) op_exec(&ctx, out + used, size - (size_t)used);
    else if (!strcmp(c->op, "heur")) op_heur(&ctx, out + used, size - (size_t)used);
    else die("op must be exec or heur");
    free(ctx.x);
    free(ctx.w);
    free(ctx.y);
}

/* ---- main --------------------------------------------------------------------------------- */

static graph_case cases[MAX_CASES];
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

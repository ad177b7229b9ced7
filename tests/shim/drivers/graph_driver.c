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
 *   replan=K  (K rounds on the same buffers and workspace: plan, `repeat` executions, destroy)
 *   rehandle=1 (each round on a new handle, the previous one destroyed)
 *   populate=1 (after each round's executions: cudnnBackendPopulateCudaGraph with the plan)
 *   lend=BYTES (each execution with a buffer of BYTES lent through mucudnn_lend_workspace, on the
 *   handle's stream, withdrawn after; lendfrom=other: lent from another thread; lendstream=other:
 *   lent on another stream than the handle's)
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
#define DRIVER_NAME "graph_driver"
#include "driver_common.h"

#include <float.h>

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
    conv_params params;
    int engine; /* -1: heuristics */
    bool fuse;
    int repeat, replan, populate;
    long long lend;
    bool lend_other_thread, lend_other_stream;
    int knob_count;
    int64_t knob_types[MAX_KNOBS], knob_values[MAX_KNOBS];
} graph_case;

static graph_case cases[MAX_CASES];

/* ---- parsing ------------------------------------------------------------------------------ */

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

/* The fields of this driver only (op dir dt layout engine fuse repeat knobs); false for any other name. */
static bool own_field(void *arg, const char *name, const char *value) {
    graph_case *c = arg;
    if (0) {}
    TEXT_FIELD(op); TEXT_FIELD(dir); TEXT_FIELD(dt); TEXT_FIELD(layout);
    else if (!strcmp(name, "engine")) c->engine = !strcmp(value, "heur") ? -1 : atoi(value);
    else if (!strcmp(name, "fuse")) c->fuse = atoi(value) != 0;
    else if (!strcmp(name, "repeat")) c->repeat = atoi(value);
    else if (!strcmp(name, "replan")) c->replan = atoi(value);
    else if (!strcmp(name, "populate")) c->populate = atoi(value);
    else if (!strcmp(name, "knobs")) parse_knobs(value, c);
    else if (!strcmp(name, "lend")) c->lend = atoll(value);
    else if (!strcmp(name, "lendfrom")) c->lend_other_thread = !strcmp(value, "other");
    else if (!strcmp(name, "lendstream")) c->lend_other_stream = !strcmp(value, "other");
    else return false;
    return true;
}

static void parse_case(char *line, int index) {
    graph_case *c = &cases[index];
    *c = (graph_case){.op = "exec", .dir = "fwd", .dt = "f32", .layout = "nchw", .engine = -1,
                      .repeat = 1, .replan = 1};
    parse_fields(line, &c->params, own_field, c);
    if (c->fuse && strcmp(c->dir, "fwd") != 0) die("fuse=1 needs dir=fwd");
    if (c->knob_count && c->engine < 0) die("knobs= needs engine=INDEX");
}

/* ---- shapes and data ------------------------------------------------------------------------ */

/* Packed shapes: "nhwc" puts c innermost (for W: KRSC). */
static void graph_shapes(const graph_case *c, shapes *s) {
    bool nhwc = !strcmp(c->layout, "nhwc");
    if (!nhwc && strcmp(c->layout, "nchw") != 0) die("layout must be nchw or nhwc");
    cudnnDataType_t dtype = CUDNN_DATA_FLOAT;
    if (!strcmp(c->dt, "f64")) dtype = CUDNN_DATA_DOUBLE;
    else if (strcmp(c->dt, "f32") != 0) die("dt must be f32 or f64");
    make_shapes(&c->params, nhwc, 0, dtype, s);
}

static void *copy_buffer(const void *buffer, size_t bytes) {
    void *copy = malloc(bytes);
    if (!copy) die("out of memory");
    return memcpy(copy, buffer, bytes);
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
    const conv_params *q = &c->params;
    int64_t spatial = q->spatial, pad[3], stride[3], dil[3];
    for (int i = 0; i < q->spatial; i++) pad[i] = q->pad[i], stride[i] = q->stride[i], dil[i] = q->dil[i];
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
        set_scale(s, op, OPS[i].alpha, c->params.alpha);
        set_scale(s, op, OPS[i].beta, c->params.beta);
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

/* cudnnBackendPopulateCudaGraph of the plan on the case's buffers, into a stand-in graph (the
 * double records nothing into it). */
static cudnnStatus_t populate(call_context *ctx, cudnnBackendDescriptor_t plan, void *workspace) {
    int64_t uids[] = {'x', 'w', 'y'};
    void *pointers[] = {ctx->x, ctx->w, ctx->y};
    static char stand_in_graph;
    cudnnBackendDescriptor_t pack = create(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 3, pointers);
    set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 3, uids);
    set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
    CHECK(cudnnBackendFinalize(pack));
    cudnnStatus_t status = cudnnBackendPopulateCudaGraph(ctx->handle, plan, pack, (cudaGraph_t)&stand_in_graph);
    CHECK(cudnnBackendDestroyDescriptor(pack));
    return status;
}

/* Legacy descriptors of the same convolution, for the reference. */
static void make_reference_legacy(const call_context *ctx, legacy *l) {
    const conv_params *q = &ctx->c->params;
    make_legacy_tensors(&ctx->s, l);
    CHECK(cudnnSetConvolutionNdDescriptor(l->conv, q->spatial, q->pad, q->stride, q->dil,
                                          CUDNN_CROSS_CORRELATION, ctx->s.dtype));
    CHECK(cudnnSetConvolutionGroupCount(l->conv, q->groups));
}

/* The case's convolution through the double's legacy functions (algorithm 0: no workspace). */
static cudnnStatus_t reference_once(call_context *ctx, const legacy *l) {
    const graph_case *c = ctx->c;
    float alpha_f = (float)c->params.alpha, beta_f = (float)c->params.beta;
    const void *alpha = scale_of(&ctx->s, &c->params.alpha, &alpha_f);
    const void *beta = scale_of(&ctx->s, &c->params.beta, &beta_f);
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
    make_reference_legacy(ctx, &l);
    cudnnStatus_t first_failure = CUDNN_STATUS_SUCCESS;
    for (int r = 0; r < ctx->c->repeat * ctx->c->replan; r++) {
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

/* lend=BYTES: mucudnn_lend_workspace, where the shim is preloaded (else nothing is lent). */
typedef int (*lend_fn)(void *, size_t, cudaStream_t);
typedef struct {
    lend_fn lend;
    void *ptr;
    size_t bytes;
    cudaStream_t stream;
} lend_call;

static void *lend_on_thread(void *arg) {
    lend_call *l = arg;
    l->lend(l->ptr, l->bytes, l->stream);
    return NULL;
}

static void lend_workspace(const graph_case *c, cudnnHandle_t handle, void *ptr, size_t bytes) {
    lend_call l = {(lend_fn)dlsym(RTLD_DEFAULT, "mucudnn_lend_workspace"), ptr, bytes, NULL};
    if (l.lend == NULL) return;
    CHECK(cudnnGetStream(handle, &l.stream));
    if (c->lend_other_stream) l.stream = (cudaStream_t)((uintptr_t)l.stream + 0x1000);
    pthread_t thread;
    if (c->lend_other_thread && ptr != NULL) {
        if (pthread_create(&thread, NULL, lend_on_thread, &l) != 0) die("pthread_create");
        pthread_join(thread, NULL);
    } else {
        lend_on_thread(&l);
    }
}

/* Executes the plan `repeat` times in the workspace (and lend=BYTES lent); false in *guard_ok if
 * it wrote past workspace_size (into the canary after it) or past the lent buffer. */
static cudnnStatus_t run_plan(call_context *ctx, cudnnBackendDescriptor_t plan, unsigned char *workspace,
                              int64_t workspace_size, bool *guard_ok) {
    memset(workspace + workspace_size, CANARY, GUARD_BYTES);
    size_t lent_bytes = ctx->c->lend > 0 ? (size_t)ctx->c->lend : 0;
    unsigned char *lent = lent_bytes ? malloc(lent_bytes + GUARD_BYTES) : NULL;
    if (lent_bytes && lent == NULL) die("out of memory");
    if (lent) memset(lent + lent_bytes, CANARY, GUARD_BYTES);
    cudnnStatus_t first_failure = CUDNN_STATUS_SUCCESS;
    for (int r = 0; r < ctx->c->repeat; r++) {
        if (lent) lend_workspace(ctx->c, ctx->handle, lent, lent_bytes);
        cudnnStatus_t status = execute(ctx, plan, workspace);
        if (lent) lend_workspace(ctx->c, ctx->handle, NULL, 0);
        if (first_failure == CUDNN_STATUS_SUCCESS) first_failure = status;
    }
    for (int i = 0; i < GUARD_BYTES; i++) *guard_ok &= workspace[workspace_size + i] == CANARY;
    for (int i = 0; lent && i < GUARD_BYTES; i++) *guard_ok &= lent[lent_bytes + i] == CANARY;
    free(lent);
    return first_failure;
}

static int op_exec(call_context *ctx, char *out, size_t size) {
    size_t elems;
    void **output = output_of(ctx->c->dir, &ctx->s, &ctx->x, &ctx->w, &ctx->y, &elems);
    void *initial = copy_buffer(*output, elems * ctx->s.elem_size);
    int status = -1, finalize = -1, populated = -1;
    int64_t workspace = -1, engine = -1;
    bool guard_ok = true;
    unsigned char *buffer = NULL; /* the workspace, one for every round (the same pointers) */
    cudnnHandle_t callers = ctx->handle;
    for (int round = 0; round < ctx->c->replan; round++) {
        if (ctx->c->params.rehandle) CHECK(cudnnCreate(&ctx->handle));
        graph_parts parts;
        make_graph(ctx->handle, ctx->c, &ctx->s, &parts);
        cudnnBackendDescriptor_t plan, config;
        finalize = plan_case(ctx, parts.graph, &plan, &config);
        destroy_graph(&parts); /* the plan must not depend on them (PyTorch caches plans only) */
        if (plan) {
            workspace = int64_attribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE);
            engine = plan_engine(plan);
            if (!buffer && !(buffer = malloc((size_t)workspace + GUARD_BYTES))) die("out of memory");
            cudnnStatus_t executed = run_plan(ctx, plan, buffer, workspace, &guard_ok);
            if (status <= 0) status = executed;
            if (ctx->c->populate) populated = populate(ctx, plan, buffer);
            CHECK(cudnnBackendDestroyDescriptor(plan));
        }
        if (config) CHECK(cudnnBackendDestroyDescriptor(config));
        if (ctx->c->params.rehandle) CHECK(cudnnDestroy(ctx->handle));
        ctx->handle = callers;
    }
    free(buffer);

    void *through_graph = *output;
    *output = initial;
    cudnnStatus_t ref_status = reference(ctx);
    double max_rel;
    int exact = compare(&ctx->s, through_graph, initial, elems, &max_rel);
    *output = through_graph;
    free(initial);
    return snprintf(out, size,
                    " status=%d ref_status=%d exact=%d max_rel=%.3g ws=%lld engine=%lld guard=%s finalize=%d"
                    " populate=%d",
                    status, (int)ref_status, exact, max_rel, (long long)workspace, (long long)engine,
                    guard_ok ? "ok" : "clobbered", finalize, populated);
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

static void run_case(cudnnHandle_t handle, int index, char *out, size_t size) {
    const graph_case *c = &cases[index];
    call_context ctx = {.c = c, .handle = handle};
    graph_shapes(c, &ctx.s);
    random_operands(&ctx.s, c->params.seed, &ctx.x, &ctx.w, &ctx.y);
    int used = snprintf(out, size, "case %d op=%s", index, c->op);
    if (!strcmp(c->op, "exec")) op_exec(&ctx, out + used, size - (size_t)used);
    else if (!strcmp(c->op, "heur")) op_heur(&ctx, out + used, size - (size_t)used);
    else die("op must be exec or heur");
    free(ctx.x);
    free(ctx.w);
    free(ctx.y);
}

/* ---- main --------------------------------------------------------------------------------- */

/* Where the shim is preloaded: what mucudnn_held_workspace and mucudnn_lent_calls say at the end. */
static void say_lends(void) {
    size_t (*held)(void) = (size_t(*)(void))dlsym(RTLD_DEFAULT, "mucudnn_held_workspace");
    size_t (*calls)(void) = (size_t(*)(void))dlsym(RTLD_DEFAULT, "mucudnn_lent_calls");
    if (held != NULL && calls != NULL)
        fprintf(stderr, "driver: held workspace %zu, lent calls %zu\n", held(), calls());
}

int main(int argc, char **argv) {
    atexit(say_lends);
    return run_driver(argc, argv, parse_case, run_case);
}

/*
 * The graph ("backend") API of the cuDNN test double: enough of cudnnBackend* to build, query and
 * execute single-convolution graphs (forward, backward data, backward filter) and the fused graph
 * convolution forward -> ReLU, called the way cudnn-frontend (so PyTorch) calls them. README.md
 * ("The backend API") states what is implemented and the engine model; this file defines them.
 *
 * Every descriptor is one heap struct: a tag, its type, whether it is finalized, the set of
 * attributes set so far, and the attribute values of its type. A descriptor-valued attribute
 * stores a copy of the other descriptor's values, never a pointer to it (the caller may destroy
 * the original afterwards, as cuDNN allows), so a finalized descriptor is self-contained.
 *
 * Executions map the graph onto the legacy structs and run the reference loops of fake_conv.c.
 */
#define _POSIX_C_SOURCE 200809L

#include "fake_internal.h"

#include <float.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* cuDNN 9 marks a few enumerators deprecated (visible with CUDNN_WARN_DEPRECATED) that cuDNN 9.19
 * and the PyTorch builds on it still use; the double must accept them. */
#define ALLOW_DEPRECATED_BEGIN                                                                     \
    _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wdeprecated-declarations\"")
#define ALLOW_DEPRECATED_END _Pragma("GCC diagnostic pop")

#define PTR(p) ((uintptr_t)(const void *)(p))

/* The attributes of one descriptor type span fewer than 64 consecutive enum values, so this bit
 * is unique within a type. */
#define ATTR_BIT(name) (UINT64_C(1) << ((unsigned)(name) % 64u))

enum {
    MAX_RANK = 5,         /* tensors are 4-D or 5-D (2-D and 3-D convolutions) */
    MAX_GRAPH_OPS = 8,    /* more ops than any supported graph has; larger graphs: NOT_SUPPORTED */
    MAX_KNOBS = 16,       /* knob choices stored per engine config */
    MAX_PACK_ENTRIES = 16,
    ENGINE_COUNT = 4,     /* global engine indices 0..3 */
    TENSOR_CORE_ENGINE = 2,
    INTS_TEXT = 128,   /* 5 x-joined int64s */
    KNOBS_TEXT = 640,  /* MAX_KNOBS "type.value" pairs */
    DETAILS_TEXT = 1024,
};

/* ---------------------------------------------------------------- descriptor contents */

struct tensor_attrs {
    cudnnDataType_t data_type;
    int rank, stride_count;
    int64_t dims[MAX_RANK], strides[MAX_RANK]; /* strides in elements */
    int64_t uid, alignment;
    bool is_virtual;
};

/* The four INT64 arrays of a convolution descriptor, one per spatial dim. */
enum conv_array {
    CONV_DILATIONS,
    CONV_STRIDES,
    CONV_PRE_PADDINGS,
    CONV_POST_PADDINGS,
    CONV_ARRAYS
};

struct convolution_attrs {
    cudnnDataType_t compute_type;
    cudnnConvolutionMode_t mode;
    int64_t spatial_rank;
    int counts[CONV_ARRAYS];
    int64_t values[CONV_ARRAYS][FAKE_SPATIAL];
};

/* A convolution operation, its tensors in forward roles: x = x or dx, w = w or dw, y = y or dy. */
struct conv_op_attrs {
    struct tensor_attrs x, w, y;
    struct convolution_attrs conv;
    double alpha, beta;
};

struct pointwise_attrs {
    cudnnPointwiseMode_t mode;
    cudnnDataType_t math_precision;
    int nan_propagation; /* stored only */
    double lower_clip, upper_clip, lower_clip_slope;
};

struct pointwise_op_attrs {
    struct pointwise_attrs pointwise;
    struct tensor_attrs x, y;
    double alpha1, alpha2; /* y = relu(alpha1 * x); alpha2 (second input) is stored only */
};

/* Any operation; `type` says which member is valid (also once copied into a graph). */
struct op_attrs {
    cudnnBackendDescriptorType_t type;
    union {
        struct conv_op_attrs conv;
        struct pointwise_op_attrs pointwise;
    };
};

struct graph_attrs {
    cudnnHandle_t handle; /* stored only */
    int op_count;
    struct op_attrs ops[MAX_GRAPH_OPS];
};

struct heuristics_attrs {
    struct graph_attrs graph;
    cudnnBackendHeurMode_t mode;
};

struct engine_attrs {
    struct graph_attrs graph;
    int64_t index;
};

struct knob_attrs {
    cudnnBackendKnobType_t type;
    int64_t value;
};

struct engine_config_attrs {
    struct engine_attrs engine;
    int knob_count;
    struct knob_attrs knobs[MAX_KNOBS];
};

struct plan_attrs {
    cudnnHandle_t handle;
    struct engine_config_attrs config;
    size_t workspace; /* fixed at finalization */
};

struct variant_pack_attrs {
    int uid_count, pointer_count;
    int64_t uids[MAX_PACK_ENTRIES];
    void *pointers[MAX_PACK_ENTRIES];
    void *workspace;
};

struct fake_backend {
    uint32_t magic;
    cudnnBackendDescriptorType_t type;
    bool finalized;
    uint64_t set; /* ATTR_BIT of every attribute set successfully */
    union {
        struct tensor_attrs tensor;
        struct convolution_attrs convolution;
        struct op_attrs op;
        struct pointwise_attrs pointwise;
        struct graph_attrs graph;
        struct heuristics_attrs heuristics;
        struct engine_attrs engine;
        struct knob_attrs knob;
        struct engine_config_attrs config;
        struct plan_attrs plan;
        struct variant_pack_attrs pack;
    };
};

static struct fake_backend *backend_of(cudnnBackendDescriptor_t desc)
{
    struct fake_backend *d = desc;
    return d != NULL && d->magic == FAKE_MAGIC_BACKEND ? d : NULL;
}

static bool is_conv_op(cudnnBackendDescriptorType_t type)
{
    return type == CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR ||
           type == CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR ||
           type == CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR;
}

static bool is_op(cudnnBackendDescriptorType_t type)
{
    return is_conv_op(type) || type == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR;
}

static bool is_supported_type(cudnnBackendDescriptorType_t type)
{
    switch (type) {
    case CUDNN_BACKEND_TENSOR_DESCRIPTOR:
    case CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR:
    case CUDNN_BACKEND_POINTWISE_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR:
    case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR:
    case CUDNN_BACKEND_ENGINE_DESCRIPTOR:
    case CUDNN_BACKEND_ENGINECFG_DESCRIPTOR:
    case CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR:
    case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR:
    case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR:
        return true;
    default:
        return false;
    }
}

/* ---------------------------------------------------------------- convolution op roles */

/* The attribute names of each direction's operation, and its name in the log. */
struct conv_op_names {
    cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
    const char *log_name;
};

static const struct conv_op_names CONV_OP_NAMES[3] = {
    [FAKE_FWD] = {CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
                  CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
                  CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
                  CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                  CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
                  CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, "fwd"},
    [FAKE_BWD_DATA] = {CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
                       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
                       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
                       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA, "bwd_data"},
    [FAKE_BWD_FILTER] = {CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
                         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
                         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
                         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA, "bwd_filter"},
};

static enum fake_direction direction_of(cudnnBackendDescriptorType_t conv_op_type)
{
    switch (conv_op_type) {
    case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR:
        return FAKE_BWD_DATA;
    case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR:
        return FAKE_BWD_FILTER;
    default:
        return FAKE_FWD;
    }
}

/* ---------------------------------------------------------------- reading attribute values */

/* The arguments of one SetAttribute call. */
struct attr_in {
    cudnnBackendAttributeType_t type;
    int64_t count;
    const void *values;
};

static cudnnStatus_t check_in(const struct attr_in *in, cudnnBackendAttributeType_t type,
                              int64_t min_count, int64_t max_count)
{
    return in->type == type && in->count >= min_count && in->count <= max_count
               ? CUDNN_STATUS_SUCCESS
               : CUDNN_STATUS_BAD_PARAM;
}

/* One element of `type` (an enum, INT64, BOOLEAN, HANDLE or VOID_PTR) copied into `out`. */
static cudnnStatus_t read_one(const struct attr_in *in, cudnnBackendAttributeType_t type,
                              void *out, size_t size)
{
    cudnnStatus_t status = check_in(in, type, 1, 1);
    if (status == CUDNN_STATUS_SUCCESS)
        memcpy(out, in->values, size);
    return status;
}

/* A scale factor: one FLOAT or DOUBLE. */
static cudnnStatus_t read_scale(const struct attr_in *in, double *out)
{
    if (in->count != 1 || (in->type != CUDNN_TYPE_FLOAT && in->type != CUDNN_TYPE_DOUBLE))
        return CUDNN_STATUS_BAD_PARAM;
    *out = in->type == CUDNN_TYPE_FLOAT ? (double)*(const float *)in->values
                                        : *(const double *)in->values;
    return CUDNN_STATUS_SUCCESS;
}

/* Element `i` of a descriptor array: a finalized descriptor accepted by `accepts`. */
static cudnnStatus_t read_desc_at(const struct attr_in *in, int64_t i,
                                  bool (*accepts)(cudnnBackendDescriptorType_t),
                                  const struct fake_backend **out)
{
    const struct fake_backend *d = backend_of(((const cudnnBackendDescriptor_t *)in->values)[i]);
    if (d == NULL || !d->finalized || !accepts(d->type))
        return CUDNN_STATUS_BAD_PARAM;
    *out = d;
    return CUDNN_STATUS_SUCCESS;
}

/* One finalized descriptor of `type`, its contents copied into `out`. */
static cudnnStatus_t read_desc(const struct attr_in *in, cudnnBackendDescriptorType_t type,
                               void *out, size_t size)
{
    cudnnStatus_t status = check_in(in, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, 1);
    const struct fake_backend *d =
        status == CUDNN_STATUS_SUCCESS ? backend_of(*(const cudnnBackendDescriptor_t *)in->values)
                                       : NULL;
    if (d == NULL || !d->finalized || d->type != type)
        return CUDNN_STATUS_BAD_PARAM;
    memcpy(out, &d->tensor, size); /* every member of the union starts at the same address */
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t read_handle(const struct attr_in *in, cudnnHandle_t *out)
{
    cudnnStatus_t status = read_one(in, CUDNN_TYPE_HANDLE, out, sizeof *out);
    return status == CUDNN_STATUS_SUCCESS && !fake_handle_ok(*out) ? CUDNN_STATUS_BAD_PARAM
                                                                   : status;
}

/* ---------------------------------------------------------------- writing attribute values */

/* The arguments of one GetAttribute call. */
struct attr_out {
    cudnnBackendAttributeType_t type;
    int64_t requested;
    int64_t *count; /* may be NULL */
    void *values;   /* may be NULL: only the count is asked for */
};

/* How many of `total` elements are copied out; reports the count: the copied ones when elements
 * are asked for, else the total (what callers use to size the array of a second call). */
static int64_t output_count(const struct attr_out *out, int64_t total)
{
    bool copying = out->values != NULL && out->requested > 0;
    int64_t copied = copying ? (out->requested < total ? out->requested : total) : 0;
    if (out->count != NULL)
        *out->count = copying ? copied : total;
    return copied;
}

static cudnnStatus_t write_values(const struct attr_out *out, cudnnBackendAttributeType_t type,
                                  const void *values, size_t size, int64_t total)
{
    if (out->type != type)
        return CUDNN_STATUS_BAD_PARAM;
    int64_t copied = output_count(out, total);
    if (copied > 0)
        memcpy(out->values, values, (size_t)copied * size);
    return CUDNN_STATUS_SUCCESS;
}

/* An attribute that has no elements (only its count, 0, is reported). */
static cudnnStatus_t write_none(const struct attr_out *out, cudnnBackendAttributeType_t type)
{
    if (out->type != type)
        return CUDNN_STATUS_BAD_PARAM;
    output_count(out, 0);
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t write_int64(const struct attr_out *out, int64_t value)
{
    return write_values(out, CUDNN_TYPE_INT64, &value, sizeof value, 1);
}

static cudnnStatus_t write_scale(const struct attr_out *out, double value)
{
    float as_float = (float)value;
    if (out->type == CUDNN_TYPE_FLOAT)
        return write_values(out, CUDNN_TYPE_FLOAT, &as_float, sizeof as_float, 1);
    return write_values(out, CUDNN_TYPE_DOUBLE, &value, sizeof value, 1);
}

/* The contents of one descriptor to hand out. */
struct desc_ref {
    cudnnBackendDescriptorType_t type;
    const void *attrs;
    size_t size;
};

/* Copies descriptor contents into the caller's descriptors (created by the caller, of the same
 * type), which become finalized, as cuDNN does for descriptor-valued Get calls. */
static cudnnStatus_t write_descs(const struct attr_out *out, const struct desc_ref refs[],
                                 int64_t total)
{
    if (out->type != CUDNN_TYPE_BACKEND_DESCRIPTOR)
        return CUDNN_STATUS_BAD_PARAM;
    int64_t copied = output_count(out, total);
    for (int64_t i = 0; i < copied; ++i) {
        struct fake_backend *target = backend_of(((cudnnBackendDescriptor_t *)out->values)[i]);
        if (target == NULL || target->type != refs[i].type)
            return CUDNN_STATUS_BAD_PARAM;
        memcpy(&target->tensor, refs[i].attrs, refs[i].size);
        target->finalized = true;
    }
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t write_desc(const struct attr_out *out, cudnnBackendDescriptorType_t type,
                                const void *attrs, size_t size)
{
    const struct desc_ref ref = {type, attrs, size};
    return write_descs(out, &ref, 1);
}

/* ---------------------------------------------------------------- the engine model */

static bool engine_supported(int64_t engine)
{
    return engine != fake_env_integer("FAKE_CUDNN_ENGINE_UNSUPPORTED", -1);
}

/* The finalized graph's convolution (there is exactly one). */
static const struct conv_op_attrs *graph_conv(const struct graph_attrs *graph)
{
    for (int i = 0; i < graph->op_count; ++i)
        if (is_conv_op(graph->ops[i].type))
            return &graph->ops[i].conv;
    return NULL;
}

/* The batch of a finalized graph: N of its convolution's x or dx. */
static int graph_batch(const struct graph_attrs *graph)
{
    return (int)graph_conv(graph)->x.dims[0];
}

/* ---------------------------------------------------------------- the attribute table */

static size_t element_size(cudnnDataType_t type)
{
    switch (type) {
    case CUDNN_DATA_FLOAT:
        return 4;
    case CUDNN_DATA_DOUBLE:
        return 8;
    case CUDNN_DATA_HALF:
    case CUDNN_DATA_BFLOAT16:
        return 2;
    default:
        return 0; /* not accepted in backend tensors */
    }
}

/* One attribute of one descriptor type: where its value lives in struct fake_backend and how it
 * is set and read. A NULL `set` or `get` makes that call NOT_SUPPORTED, as does a name without a
 * row. The generic handlers (set_value ... set_handle) use the members after them; the custom
 * ones find their values themselves. */
struct attr_field;
typedef cudnnStatus_t attr_setter(const struct attr_field *f, struct fake_backend *d,
                                  const struct attr_in *in);
typedef cudnnStatus_t attr_getter(const struct attr_field *f, const struct fake_backend *d,
                                  const struct attr_out *out);

struct attr_field {
    cudnnBackendDescriptorType_t desc_type;
    cudnnBackendAttributeName_t name;
    attr_setter *set;
    attr_getter *get;
    cudnnBackendAttributeType_t type; /* of the elements: set_value, set_array */
    cudnnBackendDescriptorType_t of;  /* of the descriptor held: set_desc */
    size_t offset, size;              /* of the value; arrays: of one element */
    size_t count_offset;              /* arrays: of their int count */
    int64_t min_count, max_count;     /* arrays: the counts accepted */
};

static void *field_of(struct fake_backend *d, size_t offset)
{
    return (char *)d + offset;
}

static const void *const_field_of(const struct fake_backend *d, size_t offset)
{
    return (const char *)d + offset;
}

/* One element of `type` (an enum, INT64, BOOLEAN or VOID_PTR). */
static cudnnStatus_t set_value(const struct attr_field *f, struct fake_backend *d,
                               const struct attr_in *in)
{
    return read_one(in, f->type, field_of(d, f->offset), f->size);
}

static cudnnStatus_t get_value(const struct attr_field *f, const struct fake_backend *d,
                               const struct attr_out *out)
{
    return write_values(out, f->type, const_field_of(d, f->offset), f->size, 1);
}

/* min_count..max_count elements of `type`, and their count. */
static cudnnStatus_t set_array(const struct attr_field *f, struct fake_backend *d,
                               const struct attr_in *in)
{
    cudnnStatus_t status = check_in(in, f->type, f->min_count, f->max_count);
    if (status == CUDNN_STATUS_SUCCESS) {
        memcpy(field_of(d, f->offset), in->values, (size_t)in->count * f->size);
        *(int *)field_of(d, f->count_offset) = (int)in->count;
    }
    return status;
}

static cudnnStatus_t get_array(const struct attr_field *f, const struct fake_backend *d,
                               const struct attr_out *out)
{
    return write_values(out, f->type, const_field_of(d, f->offset), f->size,
                        *(const int *)const_field_of(d, f->count_offset));
}

static cudnnStatus_t set_scale(const struct attr_field *f, struct fake_backend *d,
                               const struct attr_in *in)
{
    return read_scale(in, field_of(d, f->offset));
}

static cudnnStatus_t get_scale(const struct attr_field *f, const struct fake_backend *d,
                               const struct attr_out *out)
{
    return write_scale(out, *(const double *)const_field_of(d, f->offset));
}

static cudnnStatus_t set_desc(const struct attr_field *f, struct fake_backend *d,
                              const struct attr_in *in)
{
    return read_desc(in, f->of, field_of(d, f->offset), f->size);
}

static cudnnStatus_t get_desc(const struct attr_field *f, const struct fake_backend *d,
                              const struct attr_out *out)
{
    return write_desc(out, f->of, const_field_of(d, f->offset), f->size);
}

static cudnnStatus_t set_handle(const struct attr_field *f, struct fake_backend *d,
                                const struct attr_in *in)
{
    return read_handle(in, field_of(d, f->offset));
}

/* -- custom handlers */

static cudnnStatus_t set_tensor_data_type(const struct attr_field *f, struct fake_backend *d,
                                          const struct attr_in *in)
{
    cudnnDataType_t type;
    cudnnStatus_t status = read_one(in, f->type, &type, sizeof type);
    if (status == CUDNN_STATUS_SUCCESS && element_size(type) == 0)
        return CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE;
    if (status == CUDNN_STATUS_SUCCESS)
        d->tensor.data_type = type;
    return status;
}

static cudnnStatus_t set_graph_ops(const struct attr_field *f, struct fake_backend *d,
                                   const struct attr_in *in)
{
    (void)f;
    struct graph_attrs *graph = &d->graph;
    cudnnStatus_t status = check_in(in, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, INT64_MAX);
    if (status != CUDNN_STATUS_SUCCESS)
        return status;
    if (in->count > MAX_GRAPH_OPS)
        return CUDNN_STATUS_NOT_SUPPORTED;
    struct op_attrs ops[MAX_GRAPH_OPS];
    for (int64_t i = 0; i < in->count; ++i) {
        const struct fake_backend *op;
        status = read_desc_at(in, i, is_op, &op);
        if (status != CUDNN_STATUS_SUCCESS)
            return status;
        ops[i] = op->op;
    }
    memcpy(graph->ops, ops, (size_t)in->count * sizeof ops[0]);
    graph->op_count = (int)in->count;
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t get_graph_ops(const struct attr_field *f, const struct fake_backend *d,
                                   const struct attr_out *out)
{
    (void)f;
    const struct graph_attrs *graph = &d->graph;
    struct desc_ref refs[MAX_GRAPH_OPS];
    for (int i = 0; i < graph->op_count; ++i)
        refs[i] = (struct desc_ref){graph->ops[i].type, &graph->ops[i], sizeof graph->ops[i]};
    return write_descs(out, refs, graph->op_count);
}

static cudnnStatus_t get_engine_count(const struct attr_field *f, const struct fake_backend *d,
                                      const struct attr_out *out)
{
    (void)f, (void)d;
    return write_int64(out, ENGINE_COUNT);
}

/* Heuristics: every engine supports every valid graph; the highest index (largest workspace, so
 * fastest in spirit) first. */
static cudnnStatus_t get_heuristics_results(const struct attr_field *f,
                                            const struct fake_backend *d,
                                            const struct attr_out *out)
{
    (void)f;
    struct engine_config_attrs configs[ENGINE_COUNT];
    struct desc_ref refs[ENGINE_COUNT];
    for (int i = 0; i < ENGINE_COUNT; ++i) {
        configs[i] = (struct engine_config_attrs){
            .engine = {.graph = d->heuristics.graph, .index = ENGINE_COUNT - 1 - i}};
        refs[i] = (struct desc_ref){CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &configs[i],
                                    sizeof configs[i]};
    }
    return write_descs(out, refs, ENGINE_COUNT);
}

/* Whether $FAKE_CUDNN_NONDETERMINISTIC_ENGINES ("all", or indices separated by commas) names the
 * engine: such engines carry the NONDETERMINISTIC numerical note. */
static bool engine_nondeterministic(int64_t index)
{
    const char *list = getenv("FAKE_CUDNN_NONDETERMINISTIC_ENGINES");
    if (list == NULL)
        return false;
    if (strcmp(list, "all") == 0)
        return true;
    for (const char *p = list; *p != '\0'; p += strcspn(p, ","), p += *p == ',')
        if (strtoll(p, NULL, 10) == index && *p >= '0' && *p <= '9')
            return true;
    return false;
}

static cudnnStatus_t get_numerical_notes(const struct attr_field *f, const struct fake_backend *d,
                                         const struct attr_out *out)
{
    (void)f;
    cudnnBackendNumericalNote_t notes[2];
    int note_count = 0;
    if (d->engine.index == TENSOR_CORE_ENGINE)
        notes[note_count++] = CUDNN_NUMERICAL_NOTE_TENSOR_CORE;
    if (engine_nondeterministic(d->engine.index))
        notes[note_count++] = CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
    return write_values(out, CUDNN_TYPE_NUMERICAL_NOTE, notes, sizeof notes[0], note_count);
}

static cudnnStatus_t get_behavior_notes(const struct attr_field *f, const struct fake_backend *d,
                                        const struct attr_out *out)
{
    (void)f, (void)d;
    return write_none(out, CUDNN_TYPE_BEHAVIOR_NOTE);
}

static bool is_knob_choice(cudnnBackendDescriptorType_t type)
{
    return type == CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR;
}

static cudnnStatus_t set_knob_choices(const struct attr_field *f, struct fake_backend *d,
                                      const struct attr_in *in)
{
    (void)f;
    cudnnStatus_t status = check_in(in, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, MAX_KNOBS);
    struct knob_attrs knobs[MAX_KNOBS];
    for (int64_t i = 0; status == CUDNN_STATUS_SUCCESS && i < in->count; ++i) {
        const struct fake_backend *knob;
        status = read_desc_at(in, i, is_knob_choice, &knob);
        if (status == CUDNN_STATUS_SUCCESS)
            knobs[i] = knob->knob;
    }
    if (status == CUDNN_STATUS_SUCCESS) {
        memcpy(d->config.knobs, knobs, (size_t)in->count * sizeof knobs[0]);
        d->config.knob_count = (int)in->count;
    }
    return status;
}

static cudnnStatus_t get_knob_choices(const struct attr_field *f, const struct fake_backend *d,
                                      const struct attr_out *out)
{
    (void)f;
    const struct engine_config_attrs *c = &d->config;
    struct desc_ref refs[MAX_KNOBS];
    for (int i = 0; i < c->knob_count; ++i)
        refs[i] = (struct desc_ref){CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, &c->knobs[i],
                                    sizeof c->knobs[i]};
    return write_descs(out, refs, c->knob_count);
}

static cudnnStatus_t get_config_workspace(const struct attr_field *f,
                                          const struct fake_backend *d,
                                          const struct attr_out *out)
{
    (void)f;
    const struct engine_attrs *e = &d->config.engine;
    return write_int64(out, (int64_t)fake_workspace_bytes(e->index, graph_batch(&e->graph)));
}

static cudnnStatus_t get_plan_workspace(const struct attr_field *f, const struct fake_backend *d,
                                        const struct attr_out *out)
{
    (void)f;
    return write_int64(out, (int64_t)d->plan.workspace);
}

/* The value of `member` of struct fake_backend; an array `member`, its int `count`, min..max. */
#define AT(member)                                                                                 \
    .offset = offsetof(struct fake_backend, member),                                               \
    .size = sizeof(((struct fake_backend *)0)->member)
#define ARRAY(member, count, min, max)                                                             \
    .offset = offsetof(struct fake_backend, member),                                               \
    .size = sizeof(((struct fake_backend *)0)->member[0]),                                         \
    .count_offset = offsetof(struct fake_backend, count), .min_count = (min), .max_count = (max)
#define RW set_value, get_value
#define RW_ARRAY set_array, get_array
#define RW_SCALE set_scale, get_scale
#define RW_DESC set_desc, get_desc

/* Short names of the descriptor types in ATTR_FIELDS. */
#define DT_TENSOR CUDNN_BACKEND_TENSOR_DESCRIPTOR
#define DT_CONV CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR
#define DT_CONV_OP CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR /* see forward_name */
#define DT_POINTWISE CUDNN_BACKEND_POINTWISE_DESCRIPTOR
#define DT_POINTWISE_OP CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR
#define DT_GRAPH CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR
#define DT_HEURISTICS CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR
#define DT_ENGINE CUDNN_BACKEND_ENGINE_DESCRIPTOR
#define DT_KNOB CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR
#define DT_CONFIG CUDNN_BACKEND_ENGINECFG_DESCRIPTOR
#define DT_PLAN CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR
#define DT_PACK CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR

/* Descriptor types without Get rows (pointwise, variant packs) are write-only here. */
ALLOW_DEPRECATED_BEGIN
static const struct attr_field ATTR_FIELDS[] = {
    {DT_TENSOR, CUDNN_ATTR_TENSOR_DATA_TYPE, set_tensor_data_type, get_value,
     .type = CUDNN_TYPE_DATA_TYPE, AT(tensor.data_type)},
    {DT_TENSOR, CUDNN_ATTR_TENSOR_DIMENSIONS, RW_ARRAY, .type = CUDNN_TYPE_INT64,
     ARRAY(tensor.dims, tensor.rank, 4, MAX_RANK)},
    /* read back rank strides: finalization requires stride_count == rank */
    {DT_TENSOR, CUDNN_ATTR_TENSOR_STRIDES, RW_ARRAY, .type = CUDNN_TYPE_INT64,
     ARRAY(tensor.strides, tensor.stride_count, 4, MAX_RANK)},
    {DT_TENSOR, CUDNN_ATTR_TENSOR_UNIQUE_ID, RW, .type = CUDNN_TYPE_INT64, AT(tensor.uid)},
    {DT_TENSOR, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, RW, .type = CUDNN_TYPE_INT64,
     AT(tensor.alignment)},
    {DT_TENSOR, CUDNN_ATTR_TENSOR_IS_VIRTUAL, RW, .type = CUDNN_TYPE_BOOLEAN,
     AT(tensor.is_virtual)},

    {DT_CONV, CUDNN_ATTR_CONVOLUTION_COMP_TYPE, RW, .type = CUDNN_TYPE_DATA_TYPE,
     AT(convolution.compute_type)},
    {DT_CONV, CUDNN_ATTR_CONVOLUTION_CONV_MODE, RW, .type = CUDNN_TYPE_CONVOLUTION_MODE,
     AT(convolution.mode)},
    {DT_CONV, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, RW, .type = CUDNN_TYPE_INT64,
     AT(convolution.spatial_rank)},
    {DT_CONV, CUDNN_ATTR_CONVOLUTION_DILATIONS, RW_ARRAY, .type = CUDNN_TYPE_INT64,
     ARRAY(convolution.values[CONV_DILATIONS], convolution.counts[CONV_DILATIONS], 1,
           FAKE_SPATIAL)},
    {DT_CONV, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, RW_ARRAY, .type = CUDNN_TYPE_INT64,
     ARRAY(convolution.values[CONV_STRIDES], convolution.counts[CONV_STRIDES], 1, FAKE_SPATIAL)},
    {DT_CONV, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, RW_ARRAY, .type = CUDNN_TYPE_INT64,
     ARRAY(convolution.values[CONV_PRE_PADDINGS], convolution.counts[CONV_PRE_PADDINGS], 1,
           FAKE_SPATIAL)},
    {DT_CONV, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, RW_ARRAY, .type = CUDNN_TYPE_INT64,
     ARRAY(convolution.values[CONV_POST_PADDINGS], convolution.counts[CONV_POST_PADDINGS], 1,
           FAKE_SPATIAL)},

    {DT_CONV_OP, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, RW_DESC,
     .of = CUDNN_BACKEND_TENSOR_DESCRIPTOR, AT(op.conv.x)},
    {DT_CONV_OP, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, RW_DESC,
     .of = CUDNN_BACKEND_TENSOR_DESCRIPTOR, AT(op.conv.w)},
    {DT_CONV_OP, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, RW_DESC,
     .of = CUDNN_BACKEND_TENSOR_DESCRIPTOR, AT(op.conv.y)},
    {DT_CONV_OP, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, RW_DESC,
     .of = CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, AT(op.conv.conv)},
    {DT_CONV_OP, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, RW_SCALE, AT(op.conv.alpha)},
    {DT_CONV_OP, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, RW_SCALE, AT(op.conv.beta)},

    {DT_POINTWISE, CUDNN_ATTR_POINTWISE_MODE, set_value, NULL, .type = CUDNN_TYPE_POINTWISE_MODE,
     AT(pointwise.mode)},
    {DT_POINTWISE, CUDNN_ATTR_POINTWISE_MATH_PREC, set_value, NULL, .type = CUDNN_TYPE_DATA_TYPE,
     AT(pointwise.math_precision)},
    /* cudnn-frontend sets it for every ReLU */
    {DT_POINTWISE, CUDNN_ATTR_POINTWISE_NAN_PROPAGATION, set_value, NULL,
     .type = CUDNN_TYPE_NAN_PROPOGATION, AT(pointwise.nan_propagation)},
    {DT_POINTWISE, CUDNN_ATTR_POINTWISE_RELU_LOWER_CLIP, set_scale, NULL, AT(pointwise.lower_clip)},
    {DT_POINTWISE, CUDNN_ATTR_POINTWISE_RELU_UPPER_CLIP, set_scale, NULL, AT(pointwise.upper_clip)},
    {DT_POINTWISE, CUDNN_ATTR_POINTWISE_RELU_LOWER_CLIP_SLOPE, set_scale, NULL,
     AT(pointwise.lower_clip_slope)},

    {DT_POINTWISE_OP, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, set_desc, NULL,
     .of = CUDNN_BACKEND_POINTWISE_DESCRIPTOR, AT(op.pointwise.pointwise)},
    {DT_POINTWISE_OP, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, set_desc, NULL,
     .of = CUDNN_BACKEND_TENSOR_DESCRIPTOR, AT(op.pointwise.x)},
    {DT_POINTWISE_OP, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, set_desc, NULL,
     .of = CUDNN_BACKEND_TENSOR_DESCRIPTOR, AT(op.pointwise.y)},
    {DT_POINTWISE_OP, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, set_scale, NULL,
     AT(op.pointwise.alpha1)},
    {DT_POINTWISE_OP, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, set_scale, NULL,
     AT(op.pointwise.alpha2)},

    {DT_GRAPH, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, set_handle, NULL, AT(graph.handle)},
    {DT_GRAPH, CUDNN_ATTR_OPERATIONGRAPH_OPS, .set = set_graph_ops, .get = get_graph_ops},
    {DT_GRAPH, CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT, .get = get_engine_count},

    {DT_HEURISTICS, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, set_desc, NULL,
     .of = CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, AT(heuristics.graph)},
    {DT_HEURISTICS, CUDNN_ATTR_ENGINEHEUR_MODE, set_value, NULL, .type = CUDNN_TYPE_HEUR_MODE,
     AT(heuristics.mode)},
    {DT_HEURISTICS, CUDNN_ATTR_ENGINEHEUR_RESULTS, .get = get_heuristics_results},

    {DT_ENGINE, CUDNN_ATTR_ENGINE_OPERATION_GRAPH, RW_DESC,
     .of = CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, AT(engine.graph)},
    {DT_ENGINE, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, RW, .type = CUDNN_TYPE_INT64, AT(engine.index)},
    {DT_ENGINE, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, .get = get_numerical_notes},
    {DT_ENGINE, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, .get = get_behavior_notes},

    {DT_KNOB, CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, RW, .type = CUDNN_TYPE_KNOB_TYPE, AT(knob.type)},
    {DT_KNOB, CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, RW, .type = CUDNN_TYPE_INT64, AT(knob.value)},

    {DT_CONFIG, CUDNN_ATTR_ENGINECFG_ENGINE, RW_DESC, .of = CUDNN_BACKEND_ENGINE_DESCRIPTOR,
     AT(config.engine)},
    {DT_CONFIG, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, .set = set_knob_choices,
     .get = get_knob_choices},
    {DT_CONFIG, CUDNN_ATTR_ENGINECFG_WORKSPACE_SIZE, .get = get_config_workspace},

    {DT_PLAN, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, set_handle, NULL, AT(plan.handle)},
    {DT_PLAN, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, RW_DESC,
     .of = CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, AT(plan.config)},
    {DT_PLAN, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, .get = get_plan_workspace},

    {DT_PACK, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, set_array, NULL, .type = CUDNN_TYPE_INT64,
     ARRAY(pack.uids, pack.uid_count, 0, MAX_PACK_ENTRIES)},
    {DT_PACK, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, set_array, NULL, .type = CUDNN_TYPE_VOID_PTR,
     ARRAY(pack.pointers, pack.pointer_count, 0, MAX_PACK_ENTRIES)},
    {DT_PACK, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, set_value, NULL, .type = CUDNN_TYPE_VOID_PTR,
     AT(pack.workspace)},
};
ALLOW_DEPRECATED_END

/* The three convolution operations have the same fields under their own attribute names
 * (CONV_OP_NAMES); ATTR_FIELDS lists them under the forward operation's. */
static bool forward_name(cudnnBackendDescriptorType_t conv_op_type,
                         cudnnBackendAttributeName_t *name)
{
    const struct conv_op_names *own = &CONV_OP_NAMES[direction_of(conv_op_type)];
    const struct conv_op_names *fwd = &CONV_OP_NAMES[FAKE_FWD];
    const cudnnBackendAttributeName_t from[] = {own->x, own->w, own->y,
                                                own->conv, own->alpha, own->beta};
    const cudnnBackendAttributeName_t to[] = {fwd->x, fwd->w, fwd->y,
                                              fwd->conv, fwd->alpha, fwd->beta};
    for (size_t i = 0; i < sizeof from / sizeof from[0]; ++i)
        if (*name == from[i]) {
            *name = to[i];
            return true;
        }
    return false;
}

static const struct attr_field *find_field(cudnnBackendDescriptorType_t type,
                                           cudnnBackendAttributeName_t name)
{
    if (is_conv_op(type)) {
        if (!forward_name(type, &name))
            return NULL;
        type = CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR;
    }
    for (size_t i = 0; i < sizeof ATTR_FIELDS / sizeof ATTR_FIELDS[0]; ++i)
        if (ATTR_FIELDS[i].desc_type == type && ATTR_FIELDS[i].name == name)
            return &ATTR_FIELDS[i];
    return NULL;
}

static cudnnStatus_t set_attribute(struct fake_backend *d, cudnnBackendAttributeName_t name,
                                   const struct attr_in *in)
{
    const struct attr_field *f = find_field(d->type, name);
    return f != NULL && f->set != NULL ? f->set(f, d, in) : CUDNN_STATUS_NOT_SUPPORTED;
}

static cudnnStatus_t get_attribute(const struct fake_backend *d, cudnnBackendAttributeName_t name,
                                   const struct attr_out *out)
{
    const struct attr_field *f = find_field(d->type, name);
    return f != NULL && f->get != NULL ? f->get(f, d, out) : CUDNN_STATUS_NOT_SUPPORTED;
}

/* ---------------------------------------------------------------- geometry from backend tensors */

static void legacy_tensor(const struct tensor_attrs *t, struct cudnnTensorStruct *out)
{
    *out = (struct cudnnTensorStruct){.magic = FAKE_MAGIC_TENSOR, .data_type = t->data_type,
                                      .rank = t->rank};
    for (int i = 0; i < t->rank; ++i) {
        out->dims[i] = (int)t->dims[i];
        out->strides[i] = (int)t->strides[i];
    }
}

/* Whether `t` is packed in the order `order` (outermost dim first); dims of size 1 may have any
 * stride, as frameworks give them. */
static bool packed_in_order(const struct tensor_attrs *t, const int order[])
{
    int64_t expected = 1;
    for (int i = t->rank - 1; i >= 0; --i) {
        int dim = order[i];
        if (t->dims[dim] != 1 && t->strides[dim] != expected)
            return false;
        expected *= t->dims[dim];
    }
    return true;
}

/* The legacy filter of a backend W tensor: its strides must be packed KCRS (-> NCHW) or KRSC
 * (-> NHWC), the two filter layouts legacy cuDNN knows. */
static cudnnStatus_t legacy_filter(const struct tensor_attrs *t, struct cudnnFilterStruct *out)
{
    static const int KCRS[2][MAX_RANK] = {{0, 1, 2, 3}, {0, 1, 2, 3, 4}};
    static const int KRSC[2][MAX_RANK] = {{0, 2, 3, 1}, {0, 2, 3, 4, 1}};
    *out = (struct cudnnFilterStruct){.magic = FAKE_MAGIC_FILTER, .data_type = t->data_type,
                                      .rank = t->rank};
    for (int i = 0; i < t->rank; ++i)
        out->dims[i] = (int)t->dims[i];
    if (packed_in_order(t, KCRS[t->rank - 4]))
        out->format = CUDNN_TENSOR_NCHW;
    else if (packed_in_order(t, KRSC[t->rank - 4]))
        out->format = CUDNN_TENSOR_NHWC;
    else
        return CUDNN_STATUS_BAD_PARAM;
    return CUDNN_STATUS_SUCCESS;
}

static void legacy_convolution(const struct convolution_attrs *c, int groups,
                               struct cudnnConvolutionStruct *out)
{
    *out = (struct cudnnConvolutionStruct){.magic = FAKE_MAGIC_CONVOLUTION,
                                           .spatial_rank = (int)c->spatial_rank,
                                           .mode = c->mode,
                                           .compute_type = c->compute_type,
                                           .group_count = groups,
                                           .math_type = CUDNN_DEFAULT_MATH};
    for (int i = 0; i < c->spatial_rank; ++i) {
        out->pad[i] = (int)c->values[CONV_PRE_PADDINGS][i];
        out->stride[i] = (int)c->values[CONV_STRIDES][i];
        out->dilation[i] = (int)c->values[CONV_DILATIONS][i];
    }
}

/* Checks a convolution operation like the legacy calls do and fills its geometry. */
static cudnnStatus_t conv_geometry(const struct conv_op_attrs *op, struct fake_geometry *g)
{
    const struct convolution_attrs *c = &op->conv;
    for (int i = 0; i < c->spatial_rank; ++i)
        if (c->values[CONV_PRE_PADDINGS][i] != c->values[CONV_POST_PADDINGS][i])
            return CUDNN_STATUS_NOT_SUPPORTED; /* asymmetric padding: no legacy equivalent */
    struct cudnnTensorStruct x, y;
    struct cudnnFilterStruct w;
    struct cudnnConvolutionStruct conv;
    cudnnStatus_t status = legacy_filter(&op->w, &w);
    if (status != CUDNN_STATUS_SUCCESS)
        return status;
    legacy_tensor(&op->x, &x);
    legacy_tensor(&op->y, &y);
    legacy_convolution(c, (int)(op->x.dims[1] / op->w.dims[1]), &conv);
    return fake_geometry_build(&x, &w, &conv, &y, g);
}

/* ---------------------------------------------------------------- graphs */

/* What the double can run: one convolution, optionally followed by a ReLU. */
struct graph_view {
    const struct conv_op_attrs *conv;
    enum fake_direction direction;
    const struct pointwise_op_attrs *relu; /* NULL unless fused */
};

static bool same_tensor(const struct tensor_attrs *a, const struct tensor_attrs *b)
{
    return a->uid == b->uid && a->data_type == b->data_type && a->rank == b->rank &&
           a->is_virtual == b->is_virtual &&
           memcmp(a->dims, b->dims, (size_t)a->rank * sizeof a->dims[0]) == 0 &&
           memcmp(a->strides, b->strides, (size_t)a->rank * sizeof a->strides[0]) == 0;
}

static bool distinct_uids(const int64_t uids[], int count)
{
    for (int i = 0; i < count; ++i)
        for (int j = i + 1; j < count; ++j)
            if (uids[i] == uids[j])
                return false;
    return true;
}

static cudnnStatus_t view_single(const struct op_attrs *op, struct graph_view *view)
{
    if (!is_conv_op(op->type))
        return CUDNN_STATUS_NOT_SUPPORTED;
    const struct conv_op_attrs *conv = &op->conv;
    if (conv->x.is_virtual || conv->w.is_virtual || conv->y.is_virtual)
        return CUDNN_STATUS_NOT_SUPPORTED;
    const int64_t uids[] = {conv->x.uid, conv->w.uid, conv->y.uid};
    if (!distinct_uids(uids, 3))
        return CUDNN_STATUS_BAD_PARAM;
    *view = (struct graph_view){conv, direction_of(op->type), NULL};
    return CUDNN_STATUS_SUCCESS;
}

/* Convolution forward into a virtual tensor, which a ReLU reads; in either order in OPS. */
static cudnnStatus_t view_fused(const struct op_attrs ops[2], struct graph_view *view)
{
    int conv_at = ops[0].type == CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR ? 0 : 1;
    const struct op_attrs *conv_op = &ops[conv_at], *relu_op = &ops[1 - conv_at];
    if (conv_op->type != CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR ||
        relu_op->type != CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)
        return CUDNN_STATUS_NOT_SUPPORTED;
    const struct conv_op_attrs *conv = &conv_op->conv;
    const struct pointwise_op_attrs *relu = &relu_op->pointwise;
    if (conv->x.is_virtual || conv->w.is_virtual || !conv->y.is_virtual ||
        relu->y.is_virtual || !same_tensor(&conv->y, &relu->x))
        return CUDNN_STATUS_NOT_SUPPORTED;
    const int64_t uids[] = {conv->x.uid, conv->w.uid, conv->y.uid, relu->y.uid};
    if (!distinct_uids(uids, 4))
        return CUDNN_STATUS_BAD_PARAM;
    *view = (struct graph_view){conv, FAKE_FWD, relu};
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t view_graph(const struct graph_attrs *graph, struct graph_view *view)
{
    switch (graph->op_count) {
    case 1:
        return view_single(&graph->ops[0], view);
    case 2:
        return view_fused(graph->ops, view);
    default:
        return CUDNN_STATUS_NOT_SUPPORTED;
    }
}

/* ---------------------------------------------------------------- Finalize, per descriptor type */

static bool has(const struct fake_backend *d, uint64_t required)
{
    return (d->set & required) == required;
}

static cudnnStatus_t finalize_tensor(const struct fake_backend *d)
{
    const struct tensor_attrs *t = &d->tensor;
    if (!has(d, ATTR_BIT(CUDNN_ATTR_TENSOR_DATA_TYPE) | ATTR_BIT(CUDNN_ATTR_TENSOR_DIMENSIONS) |
                    ATTR_BIT(CUDNN_ATTR_TENSOR_STRIDES) | ATTR_BIT(CUDNN_ATTR_TENSOR_UNIQUE_ID) |
                    ATTR_BIT(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT)))
        return CUDNN_STATUS_BAD_PARAM;
    if (t->stride_count != t->rank || t->alignment <= 0 ||
        t->alignment % (int64_t)element_size(t->data_type) != 0)
        return CUDNN_STATUS_BAD_PARAM;
    for (int i = 0; i < t->rank; ++i)
        if (t->dims[i] < 1 || t->strides[i] < 1)
            return CUDNN_STATUS_BAD_PARAM;
    for (int i = 0; i < t->rank; ++i)
        if (t->dims[i] > INT32_MAX || t->strides[i] > INT32_MAX)
            return CUDNN_STATUS_NOT_SUPPORTED; /* the legacy structs hold ints */
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t finalize_convolution(const struct fake_backend *d)
{
    const struct convolution_attrs *c = &d->convolution;
    if (!has(d, ATTR_BIT(CUDNN_ATTR_CONVOLUTION_COMP_TYPE) |
                    ATTR_BIT(CUDNN_ATTR_CONVOLUTION_CONV_MODE) |
                    ATTR_BIT(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS) |
                    ATTR_BIT(CUDNN_ATTR_CONVOLUTION_DILATIONS) |
                    ATTR_BIT(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES) |
                    ATTR_BIT(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS) |
                    ATTR_BIT(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS)))
        return CUDNN_STATUS_BAD_PARAM;
    if (c->mode != CUDNN_CONVOLUTION && c->mode != CUDNN_CROSS_CORRELATION)
        return CUDNN_STATUS_BAD_PARAM;
    for (int a = 0; a < CONV_ARRAYS; ++a)
        if (c->counts[a] != c->spatial_rank)
            return CUDNN_STATUS_BAD_PARAM;
    if (c->spatial_rank != 2 && c->spatial_rank != 3)
        return CUDNN_STATUS_NOT_SUPPORTED; /* the reference loops do 2-D and 3-D */
    for (int a = 0; a < CONV_ARRAYS; ++a) {
        int64_t least = a == CONV_PRE_PADDINGS || a == CONV_POST_PADDINGS ? 0 : 1;
        for (int i = 0; i < c->spatial_rank; ++i)
            if (c->values[a][i] < least || c->values[a][i] > INT32_MAX)
                return CUDNN_STATUS_BAD_PARAM;
    }
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t finalize_conv_op(const struct fake_backend *d)
{
    const struct conv_op_names *names = &CONV_OP_NAMES[direction_of(d->type)];
    if (!has(d, ATTR_BIT(names->x) | ATTR_BIT(names->w) | ATTR_BIT(names->y) |
                    ATTR_BIT(names->conv)))
        return CUDNN_STATUS_BAD_PARAM;
    struct fake_geometry g;
    return conv_geometry(&d->op.conv, &g);
}

static cudnnStatus_t finalize_pointwise(const struct fake_backend *d)
{
    const struct pointwise_attrs *p = &d->pointwise;
    if (!has(d, ATTR_BIT(CUDNN_ATTR_POINTWISE_MODE)))
        return CUDNN_STATUS_BAD_PARAM;
    /* A plain ReLU, optionally clipped from above: no leaky or shifted variants. */
    if (p->mode != CUDNN_POINTWISE_RELU_FWD || p->lower_clip != 0.0 || p->lower_clip_slope != 0.0)
        return CUDNN_STATUS_NOT_SUPPORTED;
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t finalize_pointwise_op(const struct fake_backend *d)
{
    const struct pointwise_op_attrs *op = &d->op.pointwise;
    if (!has(d, ATTR_BIT(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR) |
                    ATTR_BIT(CUDNN_ATTR_OPERATION_POINTWISE_XDESC) |
                    ATTR_BIT(CUDNN_ATTR_OPERATION_POINTWISE_YDESC)))
        return CUDNN_STATUS_BAD_PARAM;
    if (op->x.rank != op->y.rank ||
        memcmp(op->x.dims, op->y.dims, (size_t)op->x.rank * sizeof op->x.dims[0]) != 0)
        return CUDNN_STATUS_BAD_PARAM;
    return CUDNN_STATUS_SUCCESS;
}

static cudnnStatus_t finalize_graph(const struct fake_backend *d)
{
    if (!has(d, ATTR_BIT(CUDNN_ATTR_OPERATIONGRAPH_OPS)))
        return CUDNN_STATUS_BAD_PARAM;
    struct graph_view view;
    return view_graph(&d->graph, &view);
}

static cudnnStatus_t finalize_heuristics(const struct fake_backend *d)
{
    if (!has(d, ATTR_BIT(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH) |
                    ATTR_BIT(CUDNN_ATTR_ENGINEHEUR_MODE)))
        return CUDNN_STATUS_BAD_PARAM;
    return d->heuristics.mode >= 0 && d->heuristics.mode < CUDNN_HEUR_MODES_COUNT
               ? CUDNN_STATUS_SUCCESS
               : CUDNN_STATUS_BAD_PARAM;
}

static cudnnStatus_t finalize_engine(const struct fake_backend *d)
{
    if (!has(d, ATTR_BIT(CUDNN_ATTR_ENGINE_OPERATION_GRAPH) |
                    ATTR_BIT(CUDNN_ATTR_ENGINE_GLOBAL_INDEX)))
        return CUDNN_STATUS_BAD_PARAM;
    return d->engine.index >= 0 && d->engine.index < ENGINE_COUNT ? CUDNN_STATUS_SUCCESS
                                                                  : CUDNN_STATUS_NOT_SUPPORTED;
}

static cudnnStatus_t finalize_knob(const struct fake_backend *d)
{
    return has(d, ATTR_BIT(CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE) |
                      ATTR_BIT(CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE))
               ? CUDNN_STATUS_SUCCESS
               : CUDNN_STATUS_BAD_PARAM;
}

static cudnnStatus_t finalize_engine_config(const struct fake_backend *d)
{
    return has(d, ATTR_BIT(CUDNN_ATTR_ENGINECFG_ENGINE)) ? CUDNN_STATUS_SUCCESS
                                                         : CUDNN_STATUS_BAD_PARAM;
}

ALLOW_DEPRECATED_BEGIN
static cudnnStatus_t finalize_plan(struct fake_backend *d)
{
    struct plan_attrs *p = &d->plan;
    if (!has(d, ATTR_BIT(CUDNN_ATTR_EXECUTION_PLAN_HANDLE) |
                    ATTR_BIT(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG)))
        return CUDNN_STATUS_BAD_PARAM;
    const struct engine_attrs *engine = &p->config.engine;
    if (!engine_supported(engine->index))
        return CUDNN_STATUS_NOT_SUPPORTED;
    p->workspace = fake_workspace_bytes(engine->index, graph_batch(&engine->graph));
    return CUDNN_STATUS_SUCCESS;
}
ALLOW_DEPRECATED_END

static cudnnStatus_t finalize_variant_pack(const struct fake_backend *d)
{
    if (!has(d, ATTR_BIT(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS) |
                    ATTR_BIT(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS)))
        return CUDNN_STATUS_BAD_PARAM;
    return d->pack.uid_count == d->pack.pointer_count ? CUDNN_STATUS_SUCCESS
                                                      : CUDNN_STATUS_BAD_PARAM;
}

static cudnnStatus_t finalize(struct fake_backend *d)
{
    switch (d->type) {
    case CUDNN_BACKEND_TENSOR_DESCRIPTOR:
        return finalize_tensor(d);
    case CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR:
        return finalize_convolution(d);
    case CUDNN_BACKEND_POINTWISE_DESCRIPTOR:
        return finalize_pointwise(d);
    case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR:
        return finalize_pointwise_op(d);
    case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR:
        return finalize_graph(d);
    case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR:
        return finalize_heuristics(d);
    case CUDNN_BACKEND_ENGINE_DESCRIPTOR:
        return finalize_engine(d);
    case CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR:
        return finalize_knob(d);
    case CUDNN_BACKEND_ENGINECFG_DESCRIPTOR:
        return finalize_engine_config(d);
    case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR:
        return finalize_plan(d);
    case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR:
        return finalize_variant_pack(d);
    default: /* the three convolution operations */
        return finalize_conv_op(d);
    }
}

/* ---------------------------------------------------------------- logging helpers */

static int type_of(const struct fake_backend *d)
{
    return d != NULL ? (int)d->type : -1;
}

static void format_int64s(char *text, size_t size, const int64_t *values, int count)
{
    size_t used = 0;
    snprintf(text, size, "-");
    for (int i = 0; i < count && used < size; ++i) {
        int written = snprintf(text + used, size - used, i == 0 ? "%" PRId64 : "x%" PRId64,
                               values[i]);
        if (written < 0)
            return;
        used += (size_t)written;
    }
}

/* "TYPE.VALUE,..." (the graph driver's knobs= syntax), "-" for none. */
static void format_knobs(char *text, size_t size, const struct knob_attrs knobs[], int count)
{
    size_t used = 0;
    snprintf(text, size, "-");
    for (int i = 0; i < count && used < size; ++i) {
        int written = snprintf(text + used, size - used, "%s%d.%" PRId64, i == 0 ? "" : ",",
                               (int)knobs[i].type, knobs[i].value);
        if (written < 0)
            return;
        used += (size_t)written;
    }
}

/* Extra fields of a SetAttribute line: the knobs of an engine config's KNOB_CHOICES. */
static void set_details(char *text, size_t size, const struct fake_backend *d,
                        cudnnBackendAttributeName_t name, cudnnStatus_t status)
{
    text[0] = '\0';
    if (status == CUDNN_STATUS_SUCCESS && d->type == CUDNN_BACKEND_ENGINECFG_DESCRIPTOR &&
        name == CUDNN_ATTR_ENGINECFG_KNOB_CHOICES) {
        char knobs[KNOBS_TEXT];
        format_knobs(knobs, sizeof knobs, d->config.knobs, d->config.knob_count);
        snprintf(text, size, " knobs=%s", knobs);
    }
}

/* Extra fields of a Finalize line: what an execution plan was made of. */
static void finalize_details(char *text, size_t size, const struct fake_backend *d,
                             cudnnStatus_t status)
{
    text[0] = '\0';
    if (d == NULL || d->type != CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)
        return;
    bool planned = status == CUDNN_STATUS_SUCCESS;
    const struct engine_config_attrs *config = &d->plan.config;
    bool has_config = has(d, ATTR_BIT(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG));
    char knobs[KNOBS_TEXT];
    format_knobs(knobs, sizeof knobs, config->knobs, has_config ? config->knob_count : 0);
    snprintf(text, size, " engine=%" PRId64 " n=%d ws=%zu knobs=%s",
             has_config ? config->engine.index : -1,
             has_config ? graph_batch(&config->engine.graph) : 0, planned ? d->plan.workspace : 0,
             knobs);
}

/* ---------------------------------------------------------------- the public descriptor calls */

/* A fresh descriptor (zeroed) with cuDNN's defaults for optional attributes. */
static void set_defaults(struct fake_backend *d, cudnnBackendDescriptorType_t type)
{
    d->magic = FAKE_MAGIC_BACKEND;
    d->type = type;
    if (is_op(type))
        d->op.type = type;
    if (is_conv_op(type))
        d->op.conv.alpha = 1.0; /* out = 1 * conv + 0 * out */
    if (type == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)
        d->op.pointwise.alpha1 = d->op.pointwise.alpha2 = 1.0;
    if (type == CUDNN_BACKEND_POINTWISE_DESCRIPTOR)
        d->pointwise.upper_clip = DBL_MAX; /* unclipped */
}

cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t descriptorType,
                                           cudnnBackendDescriptor_t *descriptor)
{
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    struct fake_backend *created = NULL;
    if (descriptor == NULL)
        status = CUDNN_STATUS_BAD_PARAM;
    else if (!is_supported_type(descriptorType))
        status = CUDNN_STATUS_NOT_SUPPORTED;
    else if ((created = calloc(1, sizeof *created)) == NULL)
        status = CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED;
    else {
        set_defaults(created, descriptorType);
        *descriptor = created;
    }
    fake_log("cudnnBackendCreateDescriptor", status, "type=%d desc=0x%" PRIxPTR,
             (int)descriptorType, PTR(created));
    return status;
}

cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t descriptor)
{
    struct fake_backend *d = backend_of(descriptor);
    /* NULL is a no-op, as for the legacy Destroy calls. */
    cudnnStatus_t status = descriptor == NULL || d != NULL ? CUDNN_STATUS_SUCCESS
                                                           : CUDNN_STATUS_BAD_PARAM;
    fake_log("cudnnBackendDestroyDescriptor", status, "desc=0x%" PRIxPTR " type=%d",
             PTR(descriptor), type_of(d));
    if (d != NULL) {
        d->magic = FAKE_MAGIC_DEAD;
        /* A CUDA graph may still hold executions of a plan (fake_cuda_driver.c): its memory stays,
         * marked dead, so that replaying them is detected rather than undefined. */
        if (d->type != CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR || getenv("FAKE_CUDA_GRAPHS") == NULL)
            free(d);
    }
    return status;
}

cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t descriptor,
                                       cudnnBackendAttributeName_t attributeName,
                                       cudnnBackendAttributeType_t attributeType,
                                       int64_t elementCount, const void *arrayOfElements)
{
    struct fake_backend *d = backend_of(descriptor);
    const struct attr_in in = {attributeType, elementCount, arrayOfElements};
    cudnnStatus_t status = CUDNN_STATUS_BAD_PARAM;
    /* A finalized descriptor is read-only (cuDNN: BAD_PARAM). */
    if (d != NULL && !d->finalized && elementCount >= 0 &&
        (arrayOfElements != NULL || elementCount == 0))
        status = set_attribute(d, attributeName, &in);
    if (status == CUDNN_STATUS_SUCCESS)
        d->set |= ATTR_BIT(attributeName);
    char details[DETAILS_TEXT] = "";
    if (d != NULL)
        set_details(details, sizeof details, d, attributeName, status);
    fake_log("cudnnBackendSetAttribute", status,
             "desc=0x%" PRIxPTR " type=%d attr=%d atype=%d count=%" PRId64 "%s", PTR(descriptor),
             type_of(d), (int)attributeName, (int)attributeType, elementCount, details);
    return status;
}

cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t const descriptor,
                                       cudnnBackendAttributeName_t attributeName,
                                       cudnnBackendAttributeType_t attributeType,
                                       int64_t requestedElementCount, int64_t *elementCount,
                                       void *arrayOfElements)
{
    const struct fake_backend *d = backend_of(descriptor);
    const struct attr_out out = {attributeType, requestedElementCount, elementCount,
                                 arrayOfElements};
    cudnnStatus_t status = CUDNN_STATUS_BAD_PARAM;
    if (d != NULL && d->finalized && requestedElementCount >= 0)
        status = get_attribute(d, attributeName, &out);
    fake_log("cudnnBackendGetAttribute", status,
             "desc=0x%" PRIxPTR " type=%d attr=%d atype=%d requested=%" PRId64 " count=%" PRId64,
             PTR(descriptor), type_of(d), (int)attributeName, (int)attributeType,
             requestedElementCount,
             status == CUDNN_STATUS_SUCCESS && elementCount != NULL ? *elementCount : -1);
    return status;
}

cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t descriptor)
{
    struct fake_backend *d = backend_of(descriptor);
    cudnnStatus_t status = d != NULL && !d->finalized ? finalize(d) : CUDNN_STATUS_BAD_PARAM;
    if (status == CUDNN_STATUS_SUCCESS)
        d->finalized = true;
    char details[DETAILS_TEXT];
    finalize_details(details, sizeof details, d, status);
    fake_log("cudnnBackendFinalize", status, "desc=0x%" PRIxPTR " type=%d%s", PTR(descriptor),
             type_of(d), details);
    return status;
}

/* ---------------------------------------------------------------- execution */

/* One cudnnBackendExecute call, resolved. Buffers are in forward roles; y is the graph's output
 * (the ReLU's output when fused). */
struct execution {
    const struct fake_backend *plan_desc; /* checked again when a captured execution runs */
    const struct plan_attrs *plan;
    struct graph_view view;
    const struct tensor_attrs *y_tensor;
    struct fake_geometry g;
    void *x, *w, *y;
    void *workspace;
    void *scratch; /* the fused graph's virtual tensor */
};

static bool computable(cudnnDataType_t type)
{
    return type == CUDNN_DATA_FLOAT || type == CUDNN_DATA_DOUBLE;
}

static cudnnStatus_t lookup(const struct variant_pack_attrs *pack, const struct tensor_attrs *t,
                            void **pointer)
{
    for (int i = 0; i < pack->uid_count; ++i)
        if (pack->uids[i] == t->uid) {
            *pointer = pack->pointers[i];
            return *pointer != NULL ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_BAD_PARAM;
        }
    return CUDNN_STATUS_BAD_PARAM;
}

/* Bytes from a tensor's base to one past its furthest element (strided views included). */
static size_t tensor_extent(const struct tensor_attrs *t)
{
    size_t last = 0;
    for (int i = 0; i < t->rank; ++i)
        last += (size_t)(t->dims[i] - 1) * (size_t)t->strides[i];
    return (last + 1) * element_size(t->data_type);
}

static cudnnStatus_t resolve_buffers(const struct variant_pack_attrs *pack, struct execution *e)
{
    const struct conv_op_attrs *conv = e->view.conv;
    cudnnStatus_t status = lookup(pack, &conv->x, &e->x);
    if (status == CUDNN_STATUS_SUCCESS)
        status = lookup(pack, &conv->w, &e->w);
    if (status == CUDNN_STATUS_SUCCESS)
        status = lookup(pack, e->y_tensor, &e->y);
    return status;
}

/* What cudnnBackendExecute checks after the plan, in order; on success `e` is ready to run. */
static cudnnStatus_t prepare(const struct cudnnContext *handle, const struct fake_backend *pack,
                             struct execution *e)
{
    if (!fake_handle_ok(handle) || pack == NULL || !pack->finalized ||
        pack->type != CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)
        return CUDNN_STATUS_BAD_PARAM;
    cudnnStatus_t status = resolve_buffers(&pack->pack, e);
    if (status != CUDNN_STATUS_SUCCESS)
        return status;
    if (!computable(e->g.data_type) || !computable(e->y_tensor->data_type))
        return CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE;
    e->workspace = pack->pack.workspace;
    if (e->plan->workspace > 0 && e->workspace == NULL)
        return CUDNN_STATUS_BAD_PARAM;
    if (e->g.n == fake_env_integer("FAKE_CUDNN_FAIL_N", -1))
        return CUDNN_STATUS_EXECUTION_FAILED; /* injected failure, output untouched */
    if (e->view.relu != NULL && (e->scratch = calloc(1, tensor_extent(&e->view.conv->y))) == NULL)
        return CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED;
    return CUDNN_STATUS_SUCCESS;
}

static double load(const void *base, int64_t index, cudnnDataType_t type)
{
    return type == CUDNN_DATA_DOUBLE ? ((const double *)base)[index]
                                     : (double)((const float *)base)[index];
}

static void store(void *base, int64_t index, cudnnDataType_t type, double value)
{
    if (type == CUDNN_DATA_DOUBLE)
        ((double *)base)[index] = value;
    else
        ((float *)base)[index] = (float)value;
}

/* Element offset of the flat row-major index `flat` over `dims`, through `strides`. */
static int64_t strided_offset(int64_t flat, const struct tensor_attrs *dims,
                              const struct tensor_attrs *strides)
{
    int64_t offset = 0;
    for (int i = dims->rank - 1; i >= 0; --i) {
        offset += (flat % dims->dims[i]) * strides->strides[i];
        flat /= dims->dims[i];
    }
    return offset;
}

/* y = min(max(alpha1 * x, 0), upper clip). NaNs propagate, so that corruption stays visible. */
static void relu(const struct pointwise_op_attrs *op, const void *x, void *y)
{
    int64_t count = 1;
    for (int i = 0; i < op->x.rank; ++i)
        count *= op->x.dims[i];
    for (int64_t flat = 0; flat < count; ++flat) {
        double value = op->alpha1 * load(x, strided_offset(flat, &op->x, &op->x), op->x.data_type);
        if (value < 0.0)
            value = 0.0;
        if (value > op->pointwise.upper_clip)
            value = op->pointwise.upper_clip;
        store(y, strided_offset(flat, &op->x, &op->y), op->y.data_type, value);
    }
}

/* An execution's modelled time: engine e as algorithm e of the legacy model, or
 * $FAKE_CUDNN_ENGINE_US microseconds (tests that need the framework's engine fast or slow). */
static double engine_time_ms(const struct execution *e)
{
    long long fixed_us = fake_env_integer("FAKE_CUDNN_ENGINE_US", -1);
    return fixed_us >= 0 ? (double)fixed_us / 1000.0
                         : (double)fake_model_time_ms(&e->g, (int)e->plan->config.engine.index);
}

static void run(const struct execution *e)
{
    const struct fake_geometry *g = &e->g;
    double alpha = e->view.conv->alpha, beta = e->view.conv->beta;
    fake_advance_clock(engine_time_ms(e));
    if (e->plan->workspace > 0)
        fake_fill_workspace(e->workspace, e->plan->workspace);
    switch (e->view.direction) {
    case FAKE_FWD:
        fake_forward(g, alpha, e->x, e->w, beta, e->view.relu != NULL ? e->scratch : e->y);
        if (e->view.relu != NULL)
            relu(e->view.relu, e->scratch, e->y);
        break;
    case FAKE_BWD_DATA:
        fake_backward_data(g, alpha, e->w, e->y, beta, e->x);
        break;
    case FAKE_BWD_FILTER:
        fake_backward_filter(g, alpha, e->x, e->y, beta, e->w);
        break;
    }
    if (e->plan->workspace > 0)
        fake_fill_workspace(e->workspace, e->plan->workspace);
}

/* A captured execution, run at its graph's launch: the plan it was captured with must still
 * exist (a real graph would read freed memory; see cudnnBackendDestroyDescriptor). */
static void run_execution(void *argument)
{
    struct execution *e = argument;
    if (e->plan_desc->magic != FAKE_MAGIC_BACKEND) {
        fake_log("cudnnBackendExecute", CUDNN_STATUS_BAD_PARAM,
                 "replayed=1 destroyed_plan=0x%" PRIxPTR, PTR(e->plan_desc));
        return;
    }
    run(e);
}

/* The plan's graph, resolved for logging even when the call then fails. */
static bool resolve_plan(const struct fake_backend *plan, struct execution *e)
{
    if (plan == NULL || plan->type != CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR || !plan->finalized)
        return false;
    e->plan_desc = plan;
    e->plan = &plan->plan;
    view_graph(&e->plan->config.engine.graph, &e->view); /* checked when the graph was finalized */
    e->y_tensor = e->view.relu != NULL ? &e->view.relu->y : &e->view.conv->y;
    conv_geometry(e->view.conv, &e->g); /* checked when the operation was finalized */
    return true;
}

static void format_tensor(char *text, size_t size, const char *role,
                          const struct tensor_attrs *t)
{
    char dims[INTS_TEXT], strides[INTS_TEXT];
    format_int64s(dims, sizeof dims, t != NULL ? t->dims : NULL, t != NULL ? t->rank : 0);
    format_int64s(strides, sizeof strides, t != NULL ? t->strides : NULL,
                  t != NULL ? t->rank : 0);
    snprintf(text, size, "%sdims=%s %sstrides=%s", role, dims, role, strides);
}

static void log_execution(cudnnStatus_t status, const struct cudnnContext *handle,
                          const struct execution *e)
{
    bool known = e->plan != NULL;
    const struct engine_config_attrs *config = known ? &e->plan->config : NULL;
    char x_text[3 * INTS_TEXT], y_text[3 * INTS_TEXT];
    format_tensor(x_text, sizeof x_text, "x", known ? &e->view.conv->x : NULL);
    format_tensor(y_text, sizeof y_text, "y", known ? e->y_tensor : NULL);
    fake_log("cudnnBackendExecute", status,
             "dir=%s fused=%d engine=%" PRId64 " n=%d knobs=%d need=%zu alpha=%.17g beta=%.17g"
             " x=0x%" PRIxPTR " w=0x%" PRIxPTR " y=0x%" PRIxPTR " workspace=0x%" PRIxPTR
             " %s %s handle=0x%" PRIxPTR,
             known ? CONV_OP_NAMES[e->view.direction].log_name : "-",
             known && e->view.relu != NULL, known ? config->engine.index : -1,
             known ? e->g.n : 0, known ? config->knob_count : 0, known ? e->plan->workspace : 0,
             known ? e->view.conv->alpha : 0.0, known ? e->view.conv->beta : 0.0, PTR(e->x),
             PTR(e->w), PTR(e->y), PTR(e->workspace), x_text, y_text, PTR(handle));
}

cudnnStatus_t cudnnBackendExecute(cudnnHandle_t handle, cudnnBackendDescriptor_t executionPlan,
                                  cudnnBackendDescriptor_t variantPack)
{
    struct execution e = {0};
    const struct fake_backend *plan = backend_of(executionPlan), *pack = backend_of(variantPack);
    cudnnStatus_t status = resolve_plan(plan, &e) ? prepare(handle, pack, &e)
                                                  : CUDNN_STATUS_BAD_PARAM;
    /* A fused graph's scratch is freed below: only plain convolutions join a captured graph
     * (the plan's descriptors, which `e` points into, outlive it as the shim keeps them). */
    if (status == CUDNN_STATUS_SUCCESS &&
        (e.view.relu != NULL || !fake_defer(handle->stream, run_execution, &e, sizeof e)))
        run(&e);
    free(e.scratch);
    log_execution(status, handle, &e);
    return status;
}

/* cuDNN's native CUDA graph API (9.5+): the double records nothing into the graph; it checks the
 * plan and logs the call with the workspace it was given, so tests see whether the shim let the
 * call through. */
static cudnnStatus_t native_graph(const char *function, cudnnHandle_t handle,
                                  cudnnBackendDescriptor_t executionPlan,
                                  cudnnBackendDescriptor_t variantPack, cudaGraph_t graph)
{
    struct execution e = {0};
    const struct fake_backend *plan = backend_of(executionPlan), *pack = backend_of(variantPack);
    cudnnStatus_t status = graph == NULL               ? CUDNN_STATUS_BAD_PARAM
                           : resolve_plan(plan, &e)    ? prepare(handle, pack, &e)
                                                       : CUDNN_STATUS_BAD_PARAM;
    free(e.scratch);
    fake_log(function, status, "need=%zu workspace=0x%" PRIxPTR, e.plan != NULL ? e.plan->workspace : 0,
             PTR(e.workspace));
    return status;
}

cudnnStatus_t cudnnBackendPopulateCudaGraph(cudnnHandle_t handle, cudnnBackendDescriptor_t executionPlan,
                                            cudnnBackendDescriptor_t variantPack, cudaGraph_t graph)
{
    return native_graph("cudnnBackendPopulateCudaGraph", handle, executionPlan, variantPack, graph);
}

cudnnStatus_t cudnnBackendUpdateCudaGraph(cudnnHandle_t handle, cudnnBackendDescriptor_t executionPlan,
                                          cudnnBackendDescriptor_t variantPack, cudaGraph_t graph)
{
    return native_graph("cudnnBackendUpdateCudaGraph", handle, executionPlan, variantPack, graph);
}

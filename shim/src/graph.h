/*
 * graph.h: what the shim tracks of cuDNN's graph ("backend") API, shared by graph.c (the
 * descriptor table) and intercept_graph.c (the interposed functions).
 *
 * A framework builds a convolution as a chain of backend descriptors: tensors and a convolution
 * descriptor go into an operation, the operation into an operation graph, the graph into an
 * engine (or engine heuristics, whose results are engine configurations), the engine into an
 * engine configuration, the configuration into an execution plan. The table copies, at each
 * link, what the shim needs of the previous one, so an execution plan knows whether it computes
 * one plain convolution and which, even after the framework destroyed the intermediate
 * descriptors (cuDNN allows that once they are set).
 */
#ifndef MUCUDNN_GRAPH_H
#define MUCUDNN_GRAPH_H

#include "internal.h"

/* Deprecated in newer headers (by value here, without the warning), still set by frameworks
 * built against cuDNN 9.0-9.19, and needed by it. */
#define ATTR_OPERATIONGRAPH_HANDLE ((cudnnBackendAttributeName_t)800)
#define ATTR_EXECUTION_PLAN_HANDLE ((cudnnBackendAttributeName_t)400)

/* One tensor as SetAttribute described it. */
typedef struct {
    bool has_uid, has_dtype, is_virtual, vectorized;
    int64_t uid, alignment; /* alignment: BYTE_ALIGNMENT, 0 until set */
    cudnnDataType_t dtype;
    int rank, stride_count; /* 0 until set */
    int64_t dims[MU_MAX_DIMS], strides[MU_MAX_DIMS];
} mu_g_tensor;

/* A convolution descriptor's geometry. */
typedef struct {
    bool has_comp_type, has_mode;
    cudnnDataType_t comp_type;
    cudnnConvolutionMode_t mode;
    int spatial; /* SPATIAL_DIMS, 0 until set */
    int dilation_count, stride_count, pre_count, post_count;
    int64_t dilation[MU_MAX_DIMS], stride[MU_MAX_DIMS], pre[MU_MAX_DIMS], post[MU_MAX_DIMS];
} mu_g_convolution;

/* A convolution operation in forward terms: x (x or dx), w (w or dw), y (y or dy). */
typedef struct {
    mu_direction dir;
    bool has_x, has_w, has_y, has_conv;
    mu_g_tensor x, w, y;
    mu_g_convolution conv;
    double alpha, beta; /* defaults 1 and 0, as cuDNN's */
} mu_g_operation;

/* What a graph-derived descriptor (graph, heuristics, engine, configuration, plan) computes:
 * single is true only for a graph of exactly one convolution operation. */
typedef struct {
    bool single;
    mu_g_operation op;
    cudnnHandle_t handle; /* the graph's, or the plan's own when it sets one */
} mu_g_graph;

/* A variant pack: the buffers of one execution. */
#define MU_G_MAX_UIDS 16
typedef struct {
    int uid_count, pointer_count;
    int64_t uids[MU_G_MAX_UIDS];
    void *pointers[MU_G_MAX_UIDS];
    void *workspace;
} mu_g_variant_pack;

/* The graph-API execution plan of one engine piece, and every descriptor it was built from. */
#define MU_G_PIECE_DESCS (8 + MU_MAX_KNOBS)
typedef struct {
    cudnnBackendDescriptor_t plan; /* NULL for a legacy piece */
    size_t workspace;              /* what the plan needs */
    bool deterministic;            /* its engine has no NONDETERMINISTIC numerical note */
    int desc_count;
    cudnnBackendDescriptor_t descs[MU_G_PIECE_DESCS];
} mu_g_piece_plan;

/* A framework's execution plan run as a micro-batch plan (intercept_graph.c). */
typedef struct mu_g_planned {
    mu_direction dir;
    cudnnTensorDescriptor_t x, y; /* legacy equivalents, for legacy pieces and the fallback */
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
    int64_t uid_x, uid_w, uid_y;
    bool double_scales; /* alpha/beta are passed as double (f64 data) rather than float */
    float alpha_f, beta_f;
    double alpha_d, beta_d;
    /* The point of the kernel's plan it runs. NULL while pending: online tuning chooses it at the
     * first execution (published once with a release store; read with acquire loads). */
    _Atomic(mu_plan_entry *) entry;
    bool deterministic; /* the framework's engine has no NONDETERMINISTIC note: its points must not */
    mu_kernel *pending_kernel; /* pending: the kernel to tune (freed with the plan), else NULL */
    mu_plan_entry *pending_front; /* pending with an online front already known (the online file's,
                                   * or measured for another plan): checked against the engine */
    atomic_bool native;        /* pending, and online tuning gave no usable point: the engine runs */
    atomic_bool undivided;     /* pending within a limit under the engine's workspace, and online tuning
                                * gave no usable point: the fallback algorithm runs undivided */
    size_t workspace;  /* the micro-batch plan's (pending: the engine's, or the limit or hold where that
                        * is less): what the framework is told and allocates */
    size_t engine_workspace; /* what the framework's own engine needs */
    int fallback_algo; /* runs undivided within that workspace, should the plan fail untouched */
    int piece_count;
    mu_g_piece_plan *pieces; /* per piece of the entry, when it has graph-API pieces */
    mu_graph_owner graphs;   /* CUDA graphs of these pieces: destroyed with them (capture.c) */
} mu_g_planned;

/* graph_pieces.c: builds the execution plans of the entry's engine pieces (once, at the
 * framework's finalize). NULL on success, else why not (the pieces are freed then). */
const char *mu_g_build_pieces(mu_g_planned *planned, const mu_g_operation *op, const mu_plan_entry *entry,
                              cudnnHandle_t handle);
/* Destroys the pieces' execution plans and every CUDA graph that launches them. */
void mu_g_free_pieces(mu_g_planned *planned);
/* An engine descriptor's numerical notes: whether it has TENSOR_CORE, and whether it has no
 * NONDETERMINISTIC. False (neither) when they cannot be read: an unknown engine is taken as
 * non-deterministic and without tensor cores. */
bool mu_g_engine_notes(cudnnBackendDescriptor_t engine, bool *tensor_cores, bool *deterministic);


/* Attribute names of a direction's operation, in the order x, w, y, conv, alpha, beta. */
const cudnnBackendAttributeName_t *mu_g_operation_attributes(mu_direction dir);

/* Copies out of the table (taken under its lock). */
bool mu_g_tracked(cudnnBackendDescriptor_t desc, cudnnBackendDescriptorType_t *type);
bool mu_g_graph_of(cudnnBackendDescriptor_t desc, mu_g_graph *graph);
bool mu_g_variant_pack_of(cudnnBackendDescriptor_t desc, mu_g_variant_pack *pack);

/* Table updates, after the real call succeeded. */
void mu_g_track(cudnnBackendDescriptor_t desc, cudnnBackendDescriptorType_t type);
void mu_g_attribute_set(cudnnBackendDescriptor_t desc, cudnnBackendAttributeName_t name,
                        cudnnBackendAttributeType_t type, int64_t count, const void *elements);
/* Descriptors that a GetAttribute filled in from desc (heuristics results, an engine
 * configuration's engine, a plan's configuration) compute what desc computes. */
void mu_g_attribute_got(cudnnBackendDescriptor_t desc, cudnnBackendAttributeName_t name,
                        cudnnBackendAttributeType_t type, int64_t count, void *elements);
/* Forgets desc; returns its micro-batch plan (for the caller to free), NULL if none. */
struct mu_g_planned *mu_g_untrack(cudnnBackendDescriptor_t desc);

/* The micro-batch plan attached to an execution plan, and the kernel it counts calls for. */
void mu_g_set_planned(cudnnBackendDescriptor_t desc, struct mu_g_planned *planned, mu_seen *seen);
struct mu_g_planned *mu_g_planned_of(cudnnBackendDescriptor_t desc, mu_seen **seen);

#endif /* MUCUDNN_GRAPH_H */

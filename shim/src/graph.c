/*
 * graph.c: the table of tracked graph-API descriptors (see graph.h).
 *
 * Only the descriptor types that lead to a convolution's execution plan are tracked; anything
 * else (pointwise, norms, attention...) is never looked at, so graphs that contain such
 * operations are "not a single convolution" and pass through. One mutex guards the table; it is
 * never held while calling cuDNN.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "graph.h"

#define BUCKETS 1024

typedef struct record {
    cudnnBackendDescriptor_t desc;
    cudnnBackendDescriptorType_t type;
    union {
        mu_g_tensor tensor;            /* TENSOR */
        mu_g_convolution convolution;  /* CONVOLUTION */
        mu_g_operation operation;      /* OPERATION_CONVOLUTION_* */
        mu_g_graph graph;              /* OPERATIONGRAPH, ENGINEHEUR, ENGINE, ENGINECFG, EXECUTION_PLAN */
        mu_g_variant_pack pack;        /* VARIANT_PACK */
    } u;
    bool plan_has_own_handle;
    struct mu_g_planned *planned; /* EXECUTION_PLAN with a micro-batch plan */
    mu_seen *seen;                /* EXECUTION_PLAN of a keyed convolution */
    struct record *next;
} record;

static record *buckets[BUCKETS];
static pthread_mutex_t table_mutex = PTHREAD_MUTEX_INITIALIZER;

static size_t bucket_of(const void *desc) { return ((uintptr_t)desc >> 4) % BUCKETS; }

static record *find(const void *desc) {
    for (record *r = buckets[bucket_of(desc)]; r; r = r->next)
        if (r->desc == desc) return r;
    return NULL;
}

static bool is_tracked_type(cudnnBackendDescriptorType_t type) {
    switch (type) {
    case CUDNN_BACKEND_TENSOR_DESCRIPTOR:
    case CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR:
    case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR:
    case CUDNN_BACKEND_ENGINE_DESCRIPTOR:
    case CUDNN_BACKEND_ENGINECFG_DESCRIPTOR:
    case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR:
    case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR: return true;
    default: return false;
    }
}

static bool is_graph_like(cudnnBackendDescriptorType_t type) {
    return type == CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR || type == CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR ||
           type == CUDNN_BACKEND_ENGINE_DESCRIPTOR || type == CUDNN_BACKEND_ENGINECFG_DESCRIPTOR ||
           type == CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR;
}

static mu_direction operation_direction(cudnnBackendDescriptorType_t type) {
    return type == CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR         ? MU_DIR_FWD
           : type == CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR ? MU_DIR_BWD_DATA
                                                                                   : MU_DIR_BWD_FILTER;
}

void mu_g_track(cudnnBackendDescriptor_t desc, cudnnBackendDescriptorType_t type) {
    if (desc == NULL || !is_tracked_type(type)) return;
    record *r = calloc(1, sizeof *r);
    if (r == NULL) return; /* untracked: it simply passes through */
    r->desc = desc;
    r->type = type;
    if (type == CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR ||
        type == CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR ||
        type == CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR) {
        r->u.operation.dir = operation_direction(type);
        r->u.operation.alpha = 1.0;
    }
    pthread_mutex_lock(&table_mutex);
    record *stale = find(desc); /* an address reused after a destroy the shim did not see */
    if (stale != NULL) {
        stale->type = type;
        stale->u = r->u;
        stale->planned = NULL; /* leaked rather than freed here: rare, and freeing needs cuDNN */
        stale->seen = NULL;
        stale->plan_has_own_handle = false;
        free(r);
    } else {
        size_t b = bucket_of(desc);
        r->next = buckets[b];
        buckets[b] = r;
    }
    pthread_mutex_unlock(&table_mutex);
}

struct mu_g_planned *mu_g_untrack(cudnnBackendDescriptor_t desc) {
    struct mu_g_planned *planned = NULL;
    pthread_mutex_lock(&table_mutex);
    for (record **link = &buckets[bucket_of(desc)]; *link; link = &(*link)->next) {
        if ((*link)->desc != desc) continue;
        record *r = *link;
        *link = r->next;
        planned = r->planned;
        free(r);
        break;
    }
    pthread_mutex_unlock(&table_mutex);
    return planned;
}

bool mu_g_tracked(cudnnBackendDescriptor_t desc, cudnnBackendDescriptorType_t *type) {
    pthread_mutex_lock(&table_mutex);
    record *r = find(desc);
    if (r != NULL) *type = r->type;
    pthread_mutex_unlock(&table_mutex);
    return r != NULL;
}

bool mu_g_graph_of(cudnnBackendDescriptor_t desc, mu_g_graph *graph) {
    pthread_mutex_lock(&table_mutex);
    record *r = find(desc);
    bool found = r != NULL && is_graph_like(r->type);
    if (found) *graph = r->u.graph;
    pthread_mutex_unlock(&table_mutex);
    return found;
}

bool mu_g_variant_pack_of(cudnnBackendDescriptor_t desc, mu_g_variant_pack *pack) {
    pthread_mutex_lock(&table_mutex);
    record *r = find(desc);
    bool found = r != NULL && r->type == CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR;
    if (found) *pack = r->u.pack;
    pthread_mutex_unlock(&table_mutex);
    return found;
}

void mu_g_set_planned(cudnnBackendDescriptor_t desc, struct mu_g_planned *planned, mu_seen *seen) {
    pthread_mutex_lock(&table_mutex);
    record *r = find(desc);
    if (r != NULL) {
        r->planned = planned;
        r->seen = seen;
    }
    pthread_mutex_unlock(&table_mutex);
}

struct mu_g_planned *mu_g_planned_of(cudnnBackendDescriptor_t desc, mu_seen **seen) {
    pthread_mutex_lock(&table_mutex);
    record *r = find(desc);
    struct mu_g_planned *planned = r ? r->planned : NULL;
    *seen = r ? r->seen : NULL;
    pthread_mutex_unlock(&table_mutex);
    return planned;
}

/* ---- SetAttribute ------------------------------------------------------------------------- */

/* Copies an INT64 array of at most MU_MAX_DIMS values; the count, or -1 when it does not fit. */
static int copy_ints(cudnnBackendAttributeType_t type, int64_t count, const void *elements, int64_t out[]) {
    if (type != CUDNN_TYPE_INT64 || count < 0 || count > MU_MAX_DIMS) return -1;
    memcpy(out, elements, (size_t)count * sizeof(int64_t));
    return (int)count;
}

static void set_tensor(mu_g_tensor *t, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                       int64_t count, const void *elements) {
    switch (name) {
    case CUDNN_ATTR_TENSOR_UNIQUE_ID:
        t->has_uid = type == CUDNN_TYPE_INT64 && count == 1;
        if (t->has_uid) t->uid = *(const int64_t *)elements;
        break;
    case CUDNN_ATTR_TENSOR_DATA_TYPE:
        t->has_dtype = type == CUDNN_TYPE_DATA_TYPE && count == 1;
        if (t->has_dtype) t->dtype = *(const cudnnDataType_t *)elements;
        break;
    case CUDNN_ATTR_TENSOR_DIMENSIONS: t->rank = copy_ints(type, count, elements, t->dims); break;
    case CUDNN_ATTR_TENSOR_STRIDES: t->stride_count = copy_ints(type, count, elements, t->strides); break;
    case CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT:
        if (type == CUDNN_TYPE_INT64 && count == 1) t->alignment = *(const int64_t *)elements;
        break;
    case CUDNN_ATTR_TENSOR_IS_VIRTUAL:
        t->is_virtual = type == CUDNN_TYPE_BOOLEAN && count == 1 && *(const bool *)elements;
        break;
    case CUDNN_ATTR_TENSOR_VECTOR_COUNT:
        t->vectorized = !(type == CUDNN_TYPE_INT64 && count == 1 && *(const int64_t *)elements == 1);
        break;
    default: break; /* alignment, reordering...: nothing the key depends on */
    }
}

static void set_convolution(mu_g_convolution *c, cudnnBackendAttributeName_t name,
                            cudnnBackendAttributeType_t type, int64_t count, const void *elements) {
    switch (name) {
    case CUDNN_ATTR_CONVOLUTION_COMP_TYPE:
        c->has_comp_type = type == CUDNN_TYPE_DATA_TYPE && count == 1;
        if (c->has_comp_type) c->comp_type = *(const cudnnDataType_t *)elements;
        break;
    case CUDNN_ATTR_CONVOLUTION_CONV_MODE:
        c->has_mode = type == CUDNN_TYPE_CONVOLUTION_MODE && count == 1;
        if (c->has_mode) c->mode = *(const cudnnConvolutionMode_t *)elements;
        break;
    case CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS: {
        int64_t spatial[MU_MAX_DIMS];
        c->spatial = copy_ints(type, count, elements, spatial) == 1 ? (int)spatial[0] : -1;
        break;
    }
    case CUDNN_ATTR_CONVOLUTION_DILATIONS: c->dilation_count = copy_ints(type, count, elements, c->dilation); break;
    case CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES: c->stride_count = copy_ints(type, count, elements, c->stride); break;
    case CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS: c->pre_count = copy_ints(type, count, elements, c->pre); break;
    case CUDNN_ATTR_CONVOLUTION_POST_PADDINGS: c->post_count = copy_ints(type, count, elements, c->post); break;
    default: break;
    }
}

/* The tracked record behind a one-descriptor attribute value, NULL when it is not one. */
static record *referenced(cudnnBackendAttributeType_t type, int64_t count, const void *elements) {
    if (type != CUDNN_TYPE_BACKEND_DESCRIPTOR || count != 1) return NULL;
    return find(*(const cudnnBackendDescriptor_t *)elements);
}

static bool read_scale(cudnnBackendAttributeType_t type, int64_t count, const void *elements, double *value) {
    if (count != 1) return false;
    if (type == CUDNN_TYPE_FLOAT) *value = *(const float *)elements;
    else if (type == CUDNN_TYPE_DOUBLE) *value = *(const double *)elements;
    else return false;
    return true;
}

/* Attribute names of one direction's operation, in the order x, w, y, conv, alpha, beta. */
static const cudnnBackendAttributeName_t operation_attributes[3][6] = {
    {CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
     CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
     CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA},
    {CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA},
    {CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA},
};

const cudnnBackendAttributeName_t *mu_g_operation_attributes(mu_direction dir) {
    return operation_attributes[dir];
}

static void set_operation(mu_g_operation *op, cudnnBackendAttributeName_t name,
                          cudnnBackendAttributeType_t type, int64_t count, const void *elements) {
    const cudnnBackendAttributeName_t *names = operation_attributes[op->dir];
    record *ref = referenced(type, count, elements);
    bool tensor = ref != NULL && ref->type == CUDNN_BACKEND_TENSOR_DESCRIPTOR;
    if (name == names[0] && (op->has_x = tensor)) op->x = ref->u.tensor;
    else if (name == names[1] && (op->has_w = tensor)) op->w = ref->u.tensor;
    else if (name == names[2] && (op->has_y = tensor)) op->y = ref->u.tensor;
    else if (name == names[3] && (op->has_conv = ref != NULL && ref->type == CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR))
        op->conv = ref->u.convolution;
    else if (name == names[4]) read_scale(type, count, elements, &op->alpha);
    else if (name == names[5]) read_scale(type, count, elements, &op->beta);
}

static bool is_operation(const record *r) {
    return r != NULL && (r->type == CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR ||
                         r->type == CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR ||
                         r->type == CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR);
}

/* A graph-like record takes over what the referenced graph-like descriptor computes. */
static void inherit_graph(record *r, const record *from) {
    cudnnHandle_t own = r->u.graph.handle;
    if (from != NULL && is_graph_like(from->type)) r->u.graph = from->u.graph;
    else memset(&r->u.graph, 0, sizeof r->u.graph);
    if (r->plan_has_own_handle) r->u.graph.handle = own;
}

static void set_graph_like(record *r, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                           int64_t count, const void *elements) {
    switch ((int)name) {
    case CUDNN_ATTR_OPERATIONGRAPH_OPS: {
        record *op = NULL;
        if (type == CUDNN_TYPE_BACKEND_DESCRIPTOR && count == 1) op = find(*(const cudnnBackendDescriptor_t *)elements);
        r->u.graph.single = is_operation(op);
        if (r->u.graph.single) r->u.graph.op = op->u.operation;
        break;
    }
    case ATTR_OPERATIONGRAPH_HANDLE:
    case ATTR_EXECUTION_PLAN_HANDLE:
        if (type == CUDNN_TYPE_HANDLE && count == 1) {
            r->u.graph.handle = *(const cudnnHandle_t *)elements;
            r->plan_has_own_handle = (int)name == ATTR_EXECUTION_PLAN_HANDLE;
        }
        break;
    case CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH:
    case CUDNN_ATTR_ENGINE_OPERATION_GRAPH:
    case CUDNN_ATTR_ENGINECFG_ENGINE:
    case CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG: inherit_graph(r, referenced(type, count, elements)); break;
    default: break;
    }
}

void mu_g_attribute_set(cudnnBackendDescriptor_t desc, cudnnBackendAttributeName_t name,
                        cudnnBackendAttributeType_t type, int64_t count, const void *elements) {
    if (elements == NULL && count > 0) return;
    pthread_mutex_lock(&table_mutex);
    record *r = find(desc);
    if (r != NULL) {
        switch (r->type) {
        case CUDNN_BACKEND_TENSOR_DESCRIPTOR: set_tensor(&r->u.tensor, name, type, count, elements); break;
        case CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR:
            set_convolution(&r->u.convolution, name, type, count, elements);
            break;
        case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR: {
            mu_g_variant_pack *p = &r->u.pack;
            bool fits = count >= 0 && count <= MU_G_MAX_UIDS;
            if (name == CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS && type == CUDNN_TYPE_INT64) {
                p->uid_count = fits ? (int)count : -1;
                if (fits) memcpy(p->uids, elements, (size_t)count * sizeof(int64_t));
            } else if (name == CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS && type == CUDNN_TYPE_VOID_PTR) {
                p->pointer_count = fits ? (int)count : -1;
                if (fits) memcpy(p->pointers, elements, (size_t)count * sizeof(void *));
            } else if (name == CUDNN_ATTR_VARIANT_PACK_WORKSPACE && type == CUDNN_TYPE_VOID_PTR && count == 1) {
                p->workspace = *(void *const *)elements;
            }
            break;
        }
        default:
            if (is_operation(r)) set_operation(&r->u.operation, name, type, count, elements);
            else set_graph_like(r, name, type, count, elements);
        }
    }
    pthread_mutex_unlock(&table_mutex);
}

void mu_g_attribute_got(cudnnBackendDescriptor_t desc, cudnnBackendAttributeName_t name,
                        cudnnBackendAttributeType_t type, int64_t count, void *elements) {
    if (type != CUDNN_TYPE_BACKEND_DESCRIPTOR || elements == NULL ||
        (name != CUDNN_ATTR_ENGINEHEUR_RESULTS && name != CUDNN_ATTR_ENGINECFG_ENGINE &&
         name != CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG))
        return;
    pthread_mutex_lock(&table_mutex);
    record *from = find(desc);
    for (int64_t i = 0; from != NULL && is_graph_like(from->type) && i < count; i++) {
        record *to = find(((cudnnBackendDescriptor_t *)elements)[i]);
        if (to != NULL && is_graph_like(to->type)) inherit_graph(to, from);
    }
    pthread_mutex_unlock(&table_mutex);
}

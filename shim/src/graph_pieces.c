/*
 * graph_pieces.c: the graph-API pieces of a micro-batch plan (engine configurations named
 * "eng<G>[.k<T>=<V>...]" in the plan file).
 *
 * Each such piece gets its own execution plan, built once when the framework finalizes its
 * plan: the framework's convolution with N replaced by the piece's batch size, on the engine
 * and knob choices the tuner measured, with beta = 1 for backward-filter pieces after the first
 * (they accumulate into dw). Running a piece is one variant pack and one cudnnBackendExecute
 * on the caller's slices, workspace and handle.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph.h"

/* Builds one piece, keeping every descriptor it creates in piece->descs. */
typedef struct {
    mu_g_piece_plan *piece;
    cudnnStatus_t status;
} builder;

static cudnnBackendDescriptor_t create(builder *b, cudnnBackendDescriptorType_t type) {
    cudnnBackendDescriptor_t desc = NULL;
    if (b->status != CUDNN_STATUS_SUCCESS) return NULL;
    if (b->piece->desc_count == MU_G_PIECE_DESCS) {
        b->status = CUDNN_STATUS_NOT_SUPPORTED;
        return NULL;
    }
    b->status = mu_real()->cudnnBackendCreateDescriptor(type, &desc);
    if (b->status == CUDNN_STATUS_SUCCESS) b->piece->descs[b->piece->desc_count++] = desc;
    return desc;
}

static void set(builder *b, cudnnBackendDescriptor_t desc, cudnnBackendAttributeName_t name,
                cudnnBackendAttributeType_t type, int64_t count, const void *elements) {
    if (b->status == CUDNN_STATUS_SUCCESS)
        b->status = mu_real()->cudnnBackendSetAttribute(desc, name, type, count, elements);
}

static void finalize(builder *b, cudnnBackendDescriptor_t desc) {
    if (b->status == CUDNN_STATUS_SUCCESS) b->status = mu_real()->cudnnBackendFinalize(desc);
}

/* The largest power of two, at most `limit`, that divides `offset` (a slice's byte offset). */
static int64_t alignment_at(int64_t offset, int64_t limit) {
    int64_t alignment = limit > 0 ? limit : 16;
    while (alignment > 1 && offset % alignment != 0) alignment /= 2;
    return alignment;
}

static cudnnBackendDescriptor_t tensor(builder *b, const mu_g_tensor *t, int64_t batch, int64_t offset) {
    int64_t dims[MU_MAX_DIMS];
    memcpy(dims, t->dims, sizeof dims);
    if (batch > 0) dims[0] = batch;
    int64_t alignment = alignment_at(offset, t->alignment);
    cudnnBackendDescriptor_t desc = create(b, CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    set(b, desc, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &t->dtype);
    set(b, desc, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, t->rank, dims);
    set(b, desc, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, t->rank, t->strides);
    set(b, desc, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &t->uid);
    set(b, desc, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    finalize(b, desc);
    return desc;
}

static cudnnBackendDescriptor_t convolution(builder *b, const mu_g_convolution *c) {
    int64_t spatial = c->spatial;
    cudnnBackendDescriptor_t desc = create(b, CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
    set(b, desc, CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &c->comp_type);
    set(b, desc, CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &c->mode);
    set(b, desc, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &spatial);
    set(b, desc, CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, spatial, c->dilation);
    set(b, desc, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, spatial, c->stride);
    set(b, desc, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, spatial, c->pre);
    set(b, desc, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, spatial, c->post);
    finalize(b, desc);
    return desc;
}

static const cudnnBackendDescriptorType_t operation_types[3] = {
    CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
    CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
    CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
};

/* The execution plan of piece `index`: `batch` samples starting `first` samples into the tensors. */
static cudnnStatus_t build_piece(const mu_g_planned *p, const mu_g_operation *op, const mu_piece *spec,
                                 int64_t first, double beta, cudnnHandle_t handle, mu_g_piece_plan *piece) {
    const mu_engine *engine = spec->engine;
    int64_t batch = spec->batch;
    builder b = {piece, CUDNN_STATUS_SUCCESS};
    size_t element = mu_dtype_size(op->x.dtype);
    cudnnBackendDescriptor_t x = tensor(&b, &op->x, batch, first * op->x.strides[0] * (int64_t)element);
    cudnnBackendDescriptor_t w = tensor(&b, &op->w, 0, 0);
    cudnnBackendDescriptor_t y = tensor(&b, &op->y, batch, first * op->y.strides[0] * (int64_t)element);
    cudnnBackendDescriptor_t conv = convolution(&b, &op->conv);

    const cudnnBackendAttributeName_t *names = mu_g_operation_attributes(p->dir);
    cudnnBackendDescriptor_t operation = create(&b, operation_types[p->dir]);
    set(&b, operation, names[0], CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    set(&b, operation, names[1], CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &w);
    set(&b, operation, names[2], CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    set(&b, operation, names[3], CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &conv);
    if (p->double_scales) {
        set(&b, operation, names[4], CUDNN_TYPE_DOUBLE, 1, &op->alpha);
        set(&b, operation, names[5], CUDNN_TYPE_DOUBLE, 1, &beta);
    } else {
        float alpha_f = (float)op->alpha, beta_f = (float)beta;
        set(&b, operation, names[4], CUDNN_TYPE_FLOAT, 1, &alpha_f);
        set(&b, operation, names[5], CUDNN_TYPE_FLOAT, 1, &beta_f);
    }
    finalize(&b, operation);

    cudnnBackendDescriptor_t graph = create(&b, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    set(&b, graph, ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    set(&b, graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &operation);
    finalize(&b, graph);

    cudnnBackendDescriptor_t eng = create(&b, CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    set(&b, eng, CUDNN_ATTR_ENGINE_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
    set(&b, eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &engine->global_index);
    finalize(&b, eng);
    bool tensor_cores;
    if (b.status == CUDNN_STATUS_SUCCESS) mu_g_engine_notes(eng, &tensor_cores, &piece->deterministic);

    cudnnBackendDescriptor_t knobs[MU_MAX_KNOBS];
    for (int i = 0; i < engine->knob_count; i++) {
        cudnnBackendKnobType_t type = (cudnnBackendKnobType_t)engine->knob_types[i];
        knobs[i] = create(&b, CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR);
        set(&b, knobs[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &type);
        set(&b, knobs[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &engine->knob_values[i]);
        finalize(&b, knobs[i]);
    }
    cudnnBackendDescriptor_t config = create(&b, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    set(&b, config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &eng);
    if (engine->knob_count > 0)
        set(&b, config, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, engine->knob_count,
            knobs);
    finalize(&b, config);

    cudnnBackendDescriptor_t plan = create(&b, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    set(&b, plan, ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    set(&b, plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &config);
    finalize(&b, plan);
    int64_t workspace = 0, count = 0;
    if (b.status == CUDNN_STATUS_SUCCESS)
        b.status = mu_real()->cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                       CUDNN_TYPE_INT64, 1, &count, &workspace);
    /* Over the framework's workspace only if it borrows the output (exec.c checks that room). */
    if (b.status == CUDNN_STATUS_SUCCESS && (workspace < 0 || (!spec->borrow && (size_t)workspace > p->workspace)))
        b.status = CUDNN_STATUS_NOT_SUPPORTED;
    if (b.status == CUDNN_STATUS_SUCCESS) {
        piece->plan = plan;
        piece->workspace = (size_t)workspace;
    }
    return b.status;
}

const char *mu_g_build_pieces(mu_g_planned *p, const mu_g_operation *op, const mu_plan_entry *entry,
                              cudnnHandle_t handle) {
    p->pieces = calloc((size_t)entry->piece_count, sizeof *p->pieces);
    if (p->pieces == NULL) return "out of memory";
    p->piece_count = entry->piece_count;
    if (entry->has_borrow_pieces && op->beta != 0.0) {
        mu_g_free_pieces(p);
        return "beta is not 0: the plan's pieces borrow the output as workspace";
    }
    int64_t first = 0;
    for (int i = 0; i < entry->piece_count; i++) {
        const mu_piece *piece = &entry->pieces[i];
        double beta = p->dir == MU_DIR_BWD_FILTER && i > 0 ? 1.0 : op->beta;
        cudnnStatus_t status = piece->engine == NULL ? CUDNN_STATUS_SUCCESS
                               : build_piece(p, op, piece, first, beta, handle, &p->pieces[i]);
        if (status != CUDNN_STATUS_SUCCESS) {
            static _Thread_local char why[160];
            snprintf(why, sizeof why, "piece %d (b=%d, engine %lld): %s", i + 1, piece->batch,
                     (long long)piece->engine->global_index, mu_status_text(status));
            mu_g_free_pieces(p);
            return why;
        }
        first += piece->batch;
    }
    return NULL;
}

void mu_g_free_pieces(mu_g_planned *p) {
    mu_graphs_release(&p->graphs); /* the graphs launch these plans: they go first */
    for (int i = 0; p->pieces != NULL && i < p->piece_count; i++)
        for (int d = p->pieces[i].desc_count - 1; d >= 0; d--) /* the plan first, tensors last */
            mu_real()->cudnnBackendDestroyDescriptor(p->pieces[i].descs[d]);
    free(p->pieces);
    p->pieces = NULL;
    p->piece_count = 0;
}

mu_plan_entry *mu_g_planned_entry(const mu_g_planned *p) {
    return atomic_load_explicit((_Atomic(mu_plan_entry *) *)&p->entry, memory_order_acquire);
}

mu_graph_owner *mu_g_graphs_of(const mu_g_planned *p) { return (mu_graph_owner *)&p->graphs; }

bool mu_g_engine_notes(cudnnBackendDescriptor_t engine, bool *tensor_cores, bool *deterministic) {
    cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
    int64_t count = 0;
    *tensor_cores = false, *deterministic = false;
    if (mu_real()->cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                            CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &count, notes) != CUDNN_STATUS_SUCCESS)
        return false;
    *deterministic = true;
    for (int64_t i = 0; i < count && i < CUDNN_NUMERICAL_NOTE_TYPE_COUNT; i++) {
        *tensor_cores |= notes[i] == CUDNN_NUMERICAL_NOTE_TENSOR_CORE;
        *deterministic &= notes[i] != CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
    }
    return true;
}

bool mu_g_plan_deterministic(const mu_plan_entry *entry, const mu_g_planned *p) {
    if (!mu_plan_legacy_deterministic(entry)) return false;
    for (int i = 0; i < entry->piece_count; i++)
        if (entry->pieces[i].engine != NULL && !(p != NULL && i < p->piece_count && p->pieces[i].deterministic))
            return false;
    return true;
}

size_t mu_g_piece_workspace(const mu_g_planned *p, int index) {
    return p != NULL && index < p->piece_count ? p->pieces[index].workspace : 0;
}

cudnnStatus_t mu_g_run_engine_piece(const mu_g_planned *p, cudnnHandle_t handle, int index, void *x, void *w,
                                    void *y, void *workspace) {
    if (p == NULL || index >= p->piece_count || p->pieces[index].plan == NULL) return CUDNN_STATUS_BAD_PARAM;
    const mu_real_table *real = mu_real();
    cudnnBackendDescriptor_t pack = NULL;
    int64_t uids[3] = {p->uid_x, p->uid_w, p->uid_y};
    void *pointers[3] = {x, w, y};
    cudnnStatus_t status = real->cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack);
    if (status == CUDNN_STATUS_SUCCESS)
        status = real->cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 3, uids);
    if (status == CUDNN_STATUS_SUCCESS)
        status = real->cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                                                3, pointers);
    if (status == CUDNN_STATUS_SUCCESS)
        status = real->cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1,
                                                &workspace);
    if (status == CUDNN_STATUS_SUCCESS) status = real->cudnnBackendFinalize(pack);
    if (status == CUDNN_STATUS_SUCCESS) status = real->cudnnBackendExecute(handle, p->pieces[index].plan, pack);
    if (pack != NULL) real->cudnnBackendDestroyDescriptor(pack);
    return status;
}

/* ---- graph-API pieces for legacy calls -------------------------------------------------------- */

/* One set of piece plans: they bake in the handle they were built with and the call's alpha and
 * beta (the legacy API passes them per call, the graph API at build time). An entry keeps at most
 * LEGACY_SETS_PER_ENTRY sets, newest first (a changing loss scale must not build plans without
 * bound); a set leaves its entry when evicted or when its handle is destroyed, and is freed by
 * the last call still running its pieces. Every field but `planned`'s contents is guarded by
 * legacy_mutex. */
typedef struct mu_g_legacy_pieces {
    mu_g_planned planned; /* only the piece fields are set: the legacy descriptors are the call's */
    cudnnHandle_t handle;
    double alpha, beta;
    char failure[160]; /* why they could not be built ("" when built): not tried again */
    int users;         /* calls between mu_g_pieces_for_legacy and mu_g_pieces_release */
    bool retired;      /* off its entry's list */
    struct mu_g_legacy_pieces *next;
} mu_g_legacy_pieces;

#define LEGACY_SETS_PER_ENTRY 4

static pthread_mutex_t legacy_mutex = PTHREAD_MUTEX_INITIALIZER;

/* The alignment the pieces' tensors declare; calls whose pointers have less pass through. */
#define LEGACY_ALIGNMENT 16

static void legacy_tensor(const int dims[], const int strides[], int rank, cudnnDataType_t dtype, char uid,
                          mu_g_tensor *t) {
    *t = (mu_g_tensor){.has_uid = true, .has_dtype = true, .uid = uid, .alignment = LEGACY_ALIGNMENT,
                       .dtype = dtype, .rank = rank, .stride_count = rank};
    for (int i = 0; i < rank; i++) t->dims[i] = dims[i], t->strides[i] = strides[i];
}

/* The graph operation equal to a keyed legacy call (the key checked the descriptors already). */
static const char *legacy_operation(const mu_kernel *k, const mu_conv_call *call, mu_g_operation *op) {
    const mu_real_table *real = mu_real();
    int rank, w_dims[MU_MAX_DIMS], spatial, pad[MU_MAX_DIMS], stride[MU_MAX_DIMS], dilation[MU_MAX_DIMS];
    cudnnDataType_t w_dtype, compute_type;
    cudnnTensorFormat_t format;
    cudnnConvolutionMode_t mode;
    if (real->cudnnGetFilterNdDescriptor(call->descs.w, MU_MAX_DIMS, &w_dtype, &format, &rank, w_dims) !=
            CUDNN_STATUS_SUCCESS ||
        real->cudnnGetConvolutionNdDescriptor(call->descs.conv, MU_MAX_DIMS - 2, &spatial, pad, stride, dilation,
                                              &mode, &compute_type) != CUDNN_STATUS_SUCCESS)
        return "cannot read the filter or convolution descriptor";
    /* The filter is packed KCRS (NCHW) or KRSC (NHWC): its strides follow from its format. */
    long long packed[MU_MAX_DIMS];
    int w_strides[MU_MAX_DIMS];
    mu_packed_strides(rank, w_dims, format == CUDNN_TENSOR_NHWC, packed);
    for (int i = 0; i < rank; i++) w_strides[i] = (int)packed[i];

    *op = (mu_g_operation){.dir = call->descs.dir, .has_x = true, .has_w = true, .has_y = true, .has_conv = true,
                           .alpha = mu_scale_value(call->alpha, k->dtype), .beta = mu_scale_value(call->beta, k->dtype)};
    legacy_tensor(k->x_dims, k->x_strides, k->nb_dims, k->dtype, 'x', &op->x);
    legacy_tensor(w_dims, w_strides, rank, k->dtype, 'w', &op->w);
    legacy_tensor(k->y_dims, k->y_strides, k->nb_dims, k->dtype, 'y', &op->y);
    mu_g_convolution *c = &op->conv;
    *c = (mu_g_convolution){.has_comp_type = true, .has_mode = true, .comp_type = compute_type, .mode = mode,
                            .spatial = spatial, .dilation_count = spatial, .stride_count = spatial,
                            .pre_count = spatial, .post_count = spatial};
    for (int i = 0; i < spatial; i++)
        c->dilation[i] = dilation[i], c->stride[i] = stride[i], c->pre[i] = c->post[i] = pad[i];
    return NULL;
}

static void free_legacy(mu_g_legacy_pieces *set) {
    mu_g_free_pieces(&set->planned);
    free(set);
}

/* Takes a set off its entry's list (legacy_mutex held); freed now if no call is running it. */
static void retire_legacy(mu_g_legacy_pieces *set) {
    set->retired = true;
    set->next = NULL;
    if (set->users == 0) free_legacy(set);
}

/* The entry's set for this handle, alpha and beta, moved to the front; NULL if none. */
static mu_g_legacy_pieces *find_legacy(mu_plan_entry *entry, cudnnHandle_t handle, double alpha, double beta) {
    mu_g_legacy_pieces *head = atomic_load(&entry->legacy_pieces), *prev = NULL;
    for (mu_g_legacy_pieces *set = head; set != NULL; prev = set, set = set->next) {
        if (set->handle != handle || set->alpha != alpha || set->beta != beta) continue;
        if (prev != NULL) {
            prev->next = set->next;
            set->next = head;
            atomic_store(&entry->legacy_pieces, set);
        }
        return set;
    }
    return NULL;
}

/* Builds the pieces for this call's handle, alpha and beta (a failure is kept too, with why) as
 * the entry's newest set, evicting the oldest beyond LEGACY_SETS_PER_ENTRY. */
static mu_g_legacy_pieces *build_legacy(mu_plan_entry *entry, const mu_kernel *k, const mu_conv_call *call,
                                        double alpha, double beta) {
    mu_g_legacy_pieces *built = calloc(1, sizeof *built);
    if (built == NULL) return NULL;
    *built = (mu_g_legacy_pieces){.handle = call->handle, .alpha = alpha, .beta = beta};
    mu_g_operation op;
    const char *why = legacy_operation(k, call, &op);
    if (why == NULL) {
        built->planned = (mu_g_planned){.dir = op.dir, .uid_x = 'x', .uid_w = 'w', .uid_y = 'y',
                                        .double_scales = k->dtype == CUDNN_DATA_DOUBLE, .workspace = entry->workspace,
                                        .entry = entry};
        why = mu_g_build_pieces(&built->planned, &op, entry, call->handle);
    }
    if (why != NULL) {
        snprintf(built->failure, sizeof built->failure, "cannot build the plan's graph-API pieces: %s", why);
        mu_log(MU_LOG_WARNING, "%s N=%d: %s; running it undivided", k->key, k->n, built->failure);
    }
    built->next = atomic_load(&entry->legacy_pieces);
    atomic_store(&entry->legacy_pieces, built);
    int kept = 1;
    for (mu_g_legacy_pieces *set = built; set->next != NULL; set = set->next, kept++) {
        if (kept == LEGACY_SETS_PER_ENTRY) {
            mu_g_legacy_pieces *evicted = set->next;
            set->next = NULL;
            while (evicted != NULL) {
                mu_g_legacy_pieces *next = evicted->next;
                retire_legacy(evicted);
                evicted = next;
            }
            break;
        }
    }
    return built;
}

const mu_g_planned *mu_g_pieces_for_legacy(mu_plan_entry *entry, const mu_kernel *k, const mu_conv_call *call,
                                           const char **why) {
    if (((uintptr_t)call->x | (uintptr_t)call->w | (uintptr_t)call->y) % LEGACY_ALIGNMENT != 0) {
        *why = "the plan's graph-API pieces need 16-byte aligned tensors";
        return NULL;
    }
    if (call->alpha == NULL || call->beta == NULL) { /* nothing to bake in: cuDNN reports it */
        *why = "alpha or beta is NULL";
        return NULL;
    }
    double alpha = mu_scale_value(call->alpha, k->dtype), beta = mu_scale_value(call->beta, k->dtype);
    pthread_mutex_lock(&legacy_mutex);
    mu_g_legacy_pieces *found = find_legacy(entry, call->handle, alpha, beta);
    if (found == NULL) found = build_legacy(entry, k, call, alpha, beta);
    const mu_g_planned *planned = NULL;
    if (found == NULL) *why = "out of memory";
    else if (found->failure[0] != '\0') *why = found->failure;
    else found->users++, planned = &found->planned;
    pthread_mutex_unlock(&legacy_mutex);
    return planned;
}

void mu_g_pieces_release(const mu_g_planned *planned) {
    if (planned == NULL) return;
    /* planned is the first member of its set */
    mu_g_legacy_pieces *set = (mu_g_legacy_pieces *)((char *)planned - offsetof(mu_g_legacy_pieces, planned));
    pthread_mutex_lock(&legacy_mutex);
    if (--set->users == 0 && set->retired) free_legacy(set);
    pthread_mutex_unlock(&legacy_mutex);
}

void mu_g_legacy_forget_handle(cudnnHandle_t handle) {
    const mu_plan *plan = mu_config()->plan;
    if (plan == NULL) return;
    pthread_mutex_lock(&legacy_mutex);
    for (size_t e = 0; e < plan->entry_count; e++) {
        mu_plan_entry *entry = &plan->entries[e];
        mu_g_legacy_pieces *set = atomic_load(&entry->legacy_pieces), *kept = NULL, **tail = &kept;
        while (set != NULL) {
            mu_g_legacy_pieces *next = set->next;
            if (set->handle == handle) {
                retire_legacy(set);
            } else {
                *tail = set;
                tail = &set->next;
                set->next = NULL;
            }
            set = next;
        }
        atomic_store(&entry->legacy_pieces, kept);
    }
    pthread_mutex_unlock(&legacy_mutex);
}

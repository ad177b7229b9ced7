/*
 * intercept_graph.c: the interposed graph ("backend") API.
 *
 * Every wrapper calls the real function first and then updates the descriptor table (graph.c).
 * Execution plans are where the shim acts, when cudnnBackendFinalize succeeds on a plan whose
 * graph is one plain convolution:
 *   - with a micro-batch plan for its kernel key and N, the plan reports the micro-batch plan's
 *     workspace (so the framework allocates only that) and cudnnBackendExecute runs the pieces
 *     through the legacy path (exec.c), on legacy descriptors built once from the graph's;
 *   - without one, a plan that needs more than the workspace limit (when set) or than the memory
 *     free now (room.c) is refused (CUDNN_STATUS_NOT_SUPPORTED), so the framework takes its next
 *     engine configuration;
 *   - with online tuning on and no front for the kernel, the plan is attached pending: its first
 *     cudnnBackendExecute measures the kernel (online.c) and chooses the point it runs from then on.
 * Graphs of anything else (fused operations, norms, attention) pass through untouched.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph.h"

static void free_planned(mu_g_planned *p) {
    if (p == NULL) return;
    const mu_real_table *real = mu_real();
    if (p->x) real->cudnnDestroyTensorDescriptor(p->x);
    if (p->y) real->cudnnDestroyTensorDescriptor(p->y);
    if (p->w) real->cudnnDestroyFilterDescriptor(p->w);
    if (p->conv) real->cudnnDestroyConvolutionDescriptor(p->conv);
    mu_g_free_pieces(p);
    free(p->pending_kernel);
    free(p);
}

/* ---- the legacy equivalent of a graph's convolution ---------------------------------------- */

/* Whether a tensor (dims and strides checked to fit in int) is packed in that order. */
static bool packed_as(const mu_g_tensor *t, bool channels_last) {
    int dims[MU_MAX_DIMS], strides[MU_MAX_DIMS];
    for (int i = 0; i < t->rank; i++) dims[i] = (int)t->dims[i], strides[i] = (int)t->strides[i];
    return mu_strides_packed(t->rank, dims, strides, channels_last);
}

static const char *check_tensor(const mu_g_tensor *t) {
    if (!t->has_uid || !t->has_dtype) return "a tensor lacks its uid or data type";
    if (t->is_virtual || t->vectorized) return "a tensor is virtual or vectorized";
    if ((t->rank != 4 && t->rank != 5) || t->stride_count != t->rank) return "tensor rank is not 4 or 5";
    for (int i = 0; i < t->rank; i++)
        if (t->dims[i] < 1 || t->dims[i] > INT32_MAX || t->strides[i] < 1 || t->strides[i] > INT32_MAX)
            return "tensor dims or strides out of range";
    return NULL;
}

static const char *check_operation(const mu_g_operation *op) {
    if (!op->has_x || !op->has_w || !op->has_y || !op->has_conv) return "the operation is incomplete";
    const char *why = check_tensor(&op->x);
    if (why == NULL) why = check_tensor(&op->w);
    if (why == NULL) why = check_tensor(&op->y);
    if (why != NULL) return why;
    const mu_g_convolution *c = &op->conv;
    int spatial = op->x.rank - 2;
    if (!c->has_comp_type || !c->has_mode || c->spatial != spatial || c->dilation_count != spatial ||
        c->stride_count != spatial || c->pre_count != spatial || c->post_count != spatial)
        return "the convolution descriptor is incomplete";
    for (int i = 0; i < spatial; i++) {
        if (c->pre[i] != c->post[i]) return "asymmetric padding";
        if (c->pre[i] > INT32_MAX || c->stride[i] > INT32_MAX || c->dilation[i] > INT32_MAX)
            return "convolution geometry out of range";
    }
    if (op->w.dims[1] < 1 || op->x.dims[1] % op->w.dims[1] != 0) return "channels do not divide into groups";
    return NULL;
}

/* What the shim needs to know of the engine the framework's plan runs. */
typedef struct {
    bool tensor_cores;  /* a TENSOR_CORE numerical note */
    bool deterministic; /* no NONDETERMINISTIC numerical note (unknown engine: false) */
    int64_t index;      /* its global index, -1 if unknown */
} engine_notes;

static engine_notes plan_engine_notes(cudnnBackendDescriptor_t plan) {
    const mu_real_table *real = mu_real();
    cudnnBackendDescriptor_t config = NULL, engine = NULL;
    int64_t count = 0;
    engine_notes found = {.index = -1};
    if (real->cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &config) == CUDNN_STATUS_SUCCESS &&
        real->cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                       CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &count, &config) == CUDNN_STATUS_SUCCESS &&
        real->cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &engine) == CUDNN_STATUS_SUCCESS &&
        real->cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                       &count, &engine) == CUDNN_STATUS_SUCCESS) {
        mu_g_engine_notes(engine, &found.tensor_cores, &found.deterministic);
        if (real->cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &count,
                                           &found.index) != CUDNN_STATUS_SUCCESS)
            found.index = -1;
    }
    if (engine) real->cudnnBackendDestroyDescriptor(engine);
    if (config) real->cudnnBackendDestroyDescriptor(config);
    return found;
}

/*
 * The math type that stands for the framework's numerics in the key: for f32, TF32 tensor-core
 * math only when the engine the framework picked uses tensor cores (PyTorch drops such engines
 * when TF32 is off), so a plan never brings TF32 to a run that had none; tensor-op math for
 * f16/bf16; default for f64.
 */
static cudnnMathType_t plan_math(const engine_notes *engine, cudnnDataType_t dtype) {
    if (dtype == CUDNN_DATA_HALF || dtype == CUDNN_DATA_BFLOAT16) return CUDNN_TENSOR_OP_MATH;
    if (dtype != CUDNN_DATA_FLOAT) return CUDNN_DEFAULT_MATH;
    return engine->tensor_cores ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH; /* unknown engine: no TF32 */
}

static cudnnStatus_t legacy_tensor(const mu_g_tensor *t, cudnnTensorDescriptor_t *desc) {
    int dims[MU_MAX_DIMS], strides[MU_MAX_DIMS];
    for (int i = 0; i < t->rank; i++) dims[i] = (int)t->dims[i], strides[i] = (int)t->strides[i];
    cudnnStatus_t status = mu_real()->cudnnCreateTensorDescriptor(desc);
    if (status == CUDNN_STATUS_SUCCESS)
        status = mu_real()->cudnnSetTensorNdDescriptor(*desc, t->dtype, t->rank, dims, strides);
    return status;
}

static cudnnStatus_t legacy_filter(const mu_g_tensor *w, cudnnFilterDescriptor_t *desc) {
    /* The filter format is the memory order of its packed strides. */
    cudnnTensorFormat_t format = packed_as(w, false) ? CUDNN_TENSOR_NCHW
                                 : packed_as(w, true) ? CUDNN_TENSOR_NHWC
                                                      : (cudnnTensorFormat_t)-1;
    if ((int)format < 0) return CUDNN_STATUS_NOT_SUPPORTED_LAYOUT;
    int dims[MU_MAX_DIMS];
    for (int i = 0; i < w->rank; i++) dims[i] = (int)w->dims[i];
    cudnnStatus_t status = mu_real()->cudnnCreateFilterDescriptor(desc);
    if (status == CUDNN_STATUS_SUCCESS)
        status = mu_real()->cudnnSetFilterNdDescriptor(*desc, w->dtype, format, w->rank, dims);
    return status;
}

static cudnnStatus_t legacy_convolution(const mu_g_operation *op, cudnnMathType_t math,
                                        cudnnConvolutionDescriptor_t *desc) {
    const mu_real_table *real = mu_real();
    const mu_g_convolution *c = &op->conv;
    int pad[MU_MAX_DIMS], stride[MU_MAX_DIMS], dilation[MU_MAX_DIMS];
    for (int i = 0; i < c->spatial; i++)
        pad[i] = (int)c->pre[i], stride[i] = (int)c->stride[i], dilation[i] = (int)c->dilation[i];
    cudnnStatus_t status = real->cudnnCreateConvolutionDescriptor(desc);
    if (status == CUDNN_STATUS_SUCCESS)
        status = real->cudnnSetConvolutionNdDescriptor(*desc, c->spatial, pad, stride, dilation, c->mode,
                                                       c->comp_type);
    if (status == CUDNN_STATUS_SUCCESS)
        status = real->cudnnSetConvolutionGroupCount(*desc, (int)(op->x.dims[1] / op->w.dims[1]));
    if (status == CUDNN_STATUS_SUCCESS) status = real->cudnnSetConvolutionMathType(*desc, math);
    return status;
}

/* Legacy descriptors of the graph's convolution, and its kernel. NULL with the reason in *why. */
static mu_g_planned *legacy_equivalent(const engine_notes *engine, const mu_g_operation *op,
                                       mu_kernel *kernel, const char **why) {
    if ((*why = check_operation(op)) != NULL) return NULL;
    mu_g_planned *p = calloc(1, sizeof *p);
    if (p == NULL) {
        *why = "out of memory";
        return NULL;
    }
    p->dir = op->dir;
    p->uid_x = op->x.uid, p->uid_w = op->w.uid, p->uid_y = op->y.uid;
    p->double_scales = op->x.dtype == CUDNN_DATA_DOUBLE;
    p->alpha_f = (float)op->alpha, p->beta_f = (float)op->beta;
    p->alpha_d = op->alpha, p->beta_d = op->beta;
    cudnnStatus_t status = legacy_tensor(&op->x, &p->x);
    if (status == CUDNN_STATUS_SUCCESS) status = legacy_tensor(&op->y, &p->y);
    if (status == CUDNN_STATUS_SUCCESS) status = legacy_filter(&op->w, &p->w);
    if (status == CUDNN_STATUS_SUCCESS)
        status = legacy_convolution(op, plan_math(engine, op->x.dtype), &p->conv);
    if (status != CUDNN_STATUS_SUCCESS) {
        *why = "cuDNN refused the legacy descriptors";
        free_planned(p);
        return NULL;
    }
    mu_conv_descs descs = {p->dir, p->x, p->w, p->conv, p->y};
    if ((*why = mu_kernel_from_descs(&descs, kernel)) != NULL) {
        free_planned(p);
        return NULL;
    }
    return p;
}

/* ---- cudnnBackendFinalize of an execution plan --------------------------------------------- */

static size_t real_plan_workspace(cudnnBackendDescriptor_t plan) {
    int64_t size = 0, count = 0;
    if (mu_real()->cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64,
                                            1, &count, &size) != CUDNN_STATUS_SUCCESS || count != 1 || size < 0)
        return 0;
    return (size_t)size;
}

/*
 * A plan of a kernel without a front, with online tuning on, is attached pending: its point is
 * chosen at its first execution, once measured (choose_online_point). Until then the framework is
 * told `workspace`: the engine's own (`real_workspace`), so it allocates what it would have and any
 * point within that can run; or, under MUCUDNN_WORKSPACE_LIMIT or _HOLD, less (the engine then never
 * runs: the online front's fastest point within it does, or the fallback). The fallback (should the
 * point fail before writing) runs within it too. False when no legacy algorithm runs undivided
 * within it: the plan then stays cuDNN's.
 */
static bool make_pending(mu_g_planned *p, const engine_notes *engine, const mu_kernel *k, cudnnHandle_t handle,
                         size_t workspace, size_t real_workspace) {
    mu_conv_descs descs = {p->dir, p->x, p->w, p->conv, p->y};
    p->workspace = workspace;
    p->engine_workspace = real_workspace;
    p->deterministic = engine->deterministic;
    /* held to a limit, the fallback may run every call (no front): cuDNN's heuristics' pick */
    p->fallback_algo = mu_best_algo_within(handle, &descs, workspace, engine->deterministic);
    if (p->fallback_algo < 0 && engine->deterministic)
        p->fallback_algo = mu_best_algo_within(handle, &descs, workspace, false);
    if (p->fallback_algo < 0 || (p->pending_kernel = malloc(sizeof *k)) == NULL) return false;
    *p->pending_kernel = *k;
    return true;
}

/* Under MUCUDNN_WORKSPACE_HOLD, online tuning's soft limit: the workspace an engine of
 * real_workspace at N is held to, or real_workspace where the hold does not bind. Never less than
 * MU_HOLD_SAMPLES samples' worth of the engine's workspace: a micro-batch of fewer samples leaves
 * the device underused, its points slow (a 3-D U-Net at N = 2 held to 448 MiB ran its backward
 * filter undivided on a slow algorithm, 12x slower), and there the hold buys little memory. */
#define MU_HOLD_SAMPLES 8
static size_t held_workspace(const mu_state *state, size_t real_workspace, int n) {
    if (!state->has_hold || n <= 0) return real_workspace;
    size_t floor = real_workspace / (size_t)n * MU_HOLD_SAMPLES;
    size_t held = state->workspace_hold > floor ? state->workspace_hold : floor;
    return held < real_workspace ? held : real_workspace;
}

/* Attaches a micro-batch plan to a just finalized execution plan when there is one (or a pending
 * one, for online tuning); applies the workspace limit and the room otherwise. Returns the status
 * for the caller's cudnnBackendFinalize. */
static cudnnStatus_t after_plan_finalized(cudnnBackendDescriptor_t plan, const mu_state *state) {
    mu_g_graph graph;
    if (!mu_g_graph_of(plan, &graph) || !graph.single) return CUDNN_STATUS_SUCCESS;
    size_t real_workspace = real_plan_workspace(plan);
    engine_notes engine = plan_engine_notes(plan);
    mu_kernel k;
    const char *why = NULL;
    mu_g_planned *p = legacy_equivalent(&engine, &graph.op, &k, &why);
    bool keyed = p != NULL;
    mu_seen *seen = keyed ? mu_seen_kernel(&k) : NULL;
    mu_plan_entry *head = p && state->plan ? mu_plan_find(state->plan, k.key, k.n, k.hash) : NULL;
    bool front = head != NULL && state->plan->front;
    /* Online tuning: a front this process already has (measured for an earlier plan or call, or
     * read from what another process measured) is used as a front plan's; without one, the plan
     * is tuned at its first execution (pending, below). */
    mu_plan_entry *online_front = head != NULL && state->plan->online ? head : NULL;
    if (head == NULL && keyed) online_front = mu_online_front(seen);
    /* An online front holds legacy algorithms only, and the framework's engine may beat all of
     * them (PyTorch's default path picks among engines the legacy API lacks): its point is chosen
     * at the first execution, where the engine is timed on the same buffers (pending, below). */
    if (online_front != NULL) head = NULL;
    bool tunable = keyed && head == NULL && graph.handle != NULL && mu_online_on();
    if (head != NULL && graph.handle == NULL) {
        static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
        mu_log_limited(&limit, MU_LOG_WARNING, "%s N=%d: the execution plan's graph names no cuDNN handle "
                       "(the shim needs one to prepare the pieces); not using the plan", k.key, k.n);
        head = NULL;
    }
    /* A wr or wd plan has one point, which sets the workspace. A front plan's point is the fastest
     * within the workspace of the engine the framework chose (and the hard limit): never more
     * memory than the framework chose, never slower than its engine where the front holds it; and
     * where the framework's fallback (an allocation failure, cudnn.benchmark's largest free
     * block) chose an engine of little workspace, a micro-batched point rather than a slow engine.
     * Under MUCUDNN_WORKSPACE_SLACK, the point of least workspace within that many percent of it
     * (mu_plan_lean_point). Where that point needs more than the memory free now, a point within
     * it (room.c). */
    mu_plan_entry *entry = NULL;
    if (head != NULL) {
        size_t available = front ? real_workspace : SIZE_MAX;
        if (front && state->has_limit && available > state->workspace_limit)
            available = state->workspace_limit;
        entry = mu_plan_point(head, available, engine.deterministic);
        mu_plan_entry *lean = front ? mu_plan_lean_point(head, entry, engine.deterministic) : entry;
        if (lean != entry) /* a framework may finalize many plans of one kernel: info once, then debug */
            mu_log(seen == NULL || !atomic_exchange(&seen->lean, true) ? MU_LOG_INFO : MU_LOG_DEBUG,
                   "%s N=%d: a point of %zu bytes of workspace (%.4f ms) rather than the fastest's %zu "
                   "(%.4f ms): within MUCUDNN_WORKSPACE_SLACK's %lld %%", k.key, k.n, lean->workspace,
                   lean->time_ms, entry->workspace, entry->time_ms, mu_option_int(MU_OPT_WORKSPACE_SLACK));
        entry = mu_room_point(head, lean, engine.deterministic, &k, seen);
        if (entry == NULL)
            mu_log(MU_LOG_INFO, "%s N=%d: no %spoint of the plan within %zu bytes of workspace; not using the "
                   "plan", k.key, k.n, engine.deterministic ? "deterministic " : "", available);
        else if (front && entry->piece_count == 1 && entry->pieces[0].engine != NULL &&
                 entry->pieces[0].engine->global_index == engine.index && engine.index >= 0) {
            mu_log(MU_LOG_DEBUG, "%s N=%d: the chosen point is the framework's own engine %lld, undivided",
                   k.key, k.n, (long long)engine.index);
            entry = NULL;
        }
    }
    if (entry != NULL && !atomic_load(&entry->disabled)) {
        /* A framework that picked a deterministic engine (torch.backends.cudnn.deterministic)
         * gets deterministic pieces and a deterministic fallback, or no plan. */
        bool deterministic = engine.deterministic;
        mu_conv_descs descs = {p->dir, p->x, p->w, p->conv, p->y};
        p->entry = entry;
        p->deterministic = deterministic;
        p->workspace = entry->workspace;
        p->engine_workspace = real_workspace;
        /* The fallback runs only if the plan fails before writing anything: deterministic when one
         * fits, else any that fits rather than no plan at all. */
        p->fallback_algo = mu_first_algo_within(graph.handle, &descs, entry->workspace, deterministic);
        if (p->fallback_algo < 0 && deterministic)
            p->fallback_algo = mu_first_algo_within(graph.handle, &descs, entry->workspace, false);
        const char *no_pieces = entry->has_engine_pieces && p->fallback_algo >= 0
                                    ? mu_g_build_pieces(p, &graph.op, entry, graph.handle)
                                    : NULL;
        if (no_pieces != NULL)
            mu_log(MU_LOG_WARNING, "%s N=%d: cannot build the plan's graph-API pieces (%s); not using the "
                   "plan", k.key, k.n, no_pieces);
        /* cudnnGetExecutionPlanWorkspaceSize (cuDNN >= 9.23) tells the engine's size, not the
         * plan's: where it exists, a framework may allocate that, so a plan must not need more. */
        if (no_pieces == NULL && p->fallback_algo >= 0 && entry->workspace > real_workspace &&
            mu_real_has("cudnnGetExecutionPlanWorkspaceSize")) {
            mu_log(MU_LOG_INFO, "%s N=%d: the plan needs %zu bytes of workspace, the engine %zu, and this cuDNN "
                   "reports the engine's through cudnnGetExecutionPlanWorkspaceSize; not using the plan", k.key,
                   k.n, entry->workspace, real_workspace);
            no_pieces = "needs more than the engine";
        }
        if (no_pieces == NULL && p->fallback_algo >= 0 && deterministic && !mu_g_plan_deterministic(entry, p)) {
            mu_log(MU_LOG_INFO, "%s N=%d: the framework chose a deterministic engine and the plan is not "
                   "deterministic; not using the plan", k.key, k.n);
            no_pieces = "not deterministic";
        }
        if (p->fallback_algo >= 0 && no_pieces == NULL) {
            mu_log(MU_LOG_INFO, "graph plan %p: %s N=%d runs the micro-batch plan (workspace %zu, the "
                   "engine's %zu)", (void *)plan, k.key, k.n, entry->workspace, real_workspace);
            mu_g_set_planned(plan, p, seen);
            return CUDNN_STATUS_SUCCESS;
        }
        if (p->fallback_algo < 0)
            mu_log(MU_LOG_WARNING, "%s N=%d: no algorithm runs undivided within the plan's workspace %zu, "
                   "so a failing plan would have no way back; not using the plan on the graph path",
                   k.key, k.n, entry->workspace);
    }
    /* No point runs: the engine would run undivided in its own workspace, so it is refused over the
     * hard limit, and over the memory free now, where it would fail to allocate or take the last
     * free memory (room.c): the framework then takes its next configuration. With online tuning
     * on, an engine over the limit (or the hold) is not refused but held to it: the framework's next
     * configurations are engines of less workspace, down to a workspace-free one, which are slow
     * where the online front has a micro-batched point of the fast algorithm within the limit. */
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    bool over_limit = state->has_limit && real_workspace > state->workspace_limit;
    size_t allowed = over_limit ? state->workspace_limit : real_workspace;
    size_t held = keyed && tunable ? held_workspace(state, real_workspace, k.n) : real_workspace;
    if (held < allowed) allowed = held;
    if (over_limit && !tunable) {
        mu_log(MU_LOG_DEBUG, "graph plan %p needs %zu bytes of workspace, over the limit %zu: refused",
               (void *)plan, real_workspace, state->workspace_limit);
        status = CUDNN_STATUS_NOT_SUPPORTED;
    } else if (mu_room_refuses(allowed, keyed ? &k : NULL, seen, plan)) {
        status = CUDNN_STATUS_NOT_SUPPORTED;
    } else if (tunable && make_pending(p, &engine, &k, graph.handle, allowed, real_workspace)) {
        p->pending_front = online_front;
        if (allowed < real_workspace) {
            mu_lend_note_held(real_workspace);
            /* a framework may finalize many plans of one kernel: info once */
            mu_log(seen == NULL || !atomic_exchange(&seen->capped, true) ? MU_LOG_INFO : MU_LOG_DEBUG,
                   "%s N=%d: the engine needs %zu bytes of workspace, over the %s %zu: the framework "
                   "allocates that and the online front's point within it runs", k.key, k.n, real_workspace,
                   allowed == held && !over_limit ? "hold" : "limit", allowed);
        }
        mu_log(MU_LOG_DEBUG, "graph plan %p: %s N=%d is tuned online at its first execution (workspace %zu, "
               "the engine's %zu)", (void *)plan, k.key, k.n, allowed, real_workspace);
        mu_g_set_planned(plan, p, seen);
        return CUDNN_STATUS_SUCCESS;
    } else if (over_limit) {
        mu_log(MU_LOG_DEBUG, "graph plan %p needs %zu bytes of workspace, over the limit %zu, and no algorithm "
               "runs within the limit: refused", (void *)plan, real_workspace, state->workspace_limit);
        status = CUDNN_STATUS_NOT_SUPPORTED;
    }
    free_planned(p);
    mu_g_set_planned(plan, NULL, seen);
    if (!keyed) {
        static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
        mu_log_limited(&limit, MU_LOG_INFO, "graph convolution without a kernel key: %s; passthrough", why);
    }
    return status;
}

/* ---- cudnnBackendExecute of a planned execution plan ---------------------------------------- */

static void *pointer_of(const mu_g_variant_pack *pack, int64_t uid) {
    int count = pack->uid_count < pack->pointer_count ? pack->uid_count : pack->pointer_count;
    for (int i = 0; i < count; i++)
        if (pack->uids[i] == uid) return pack->pointers[i];
    return NULL;
}

/* The framework allocated the engine's workspace (not a limit's below it): the engine may run. */
static bool engine_fits(const mu_g_planned *p) { return p->workspace >= p->engine_workspace; }

/* The framework's own engine, for a pending plan that has no point (yet: a later execution may
 * get one; or for good: p->native). */
static cudnnStatus_t run_engine(cudnnHandle_t handle, cudnnBackendDescriptor_t plan, cudnnBackendDescriptor_t pack,
                                mu_seen *seen, const char *why) {
    static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
    if (seen != NULL) {
        atomic_fetch_add(&seen->passthrough_calls, 1);
        mu_log_limited(&limit, MU_LOG_INFO, "%s N=%d: passthrough on the graph path (%s)", seen->key, seen->n, why);
    }
    return mu_real()->cudnnBackendExecute(handle, plan, pack);
}

/* A point of an online front replaces the framework's engine only when it is at least this much
 * faster on the same call (as a front keeps a point only 2 % faster than the next: thin_front). */
#define MU_ONLINE_ENGINE_GAIN 0.98

/* The framework's execution plan on one call's variant pack, as mu_time_calls runs it. */
typedef struct {
    cudnnHandle_t handle;
    cudnnBackendDescriptor_t plan, pack;
} engine_call;

static cudnnStatus_t execute_engine(void *context) {
    const engine_call *e = context;
    return mu_real()->cudnnBackendExecute(e->handle, e->plan, e->pack);
}

/* The framework engine's time on this call's buffers, in ms; -1 where it cannot be timed without
 * changing a result (beta != 0 accumulates into the output) or without the driver's events. The
 * real execution that follows overwrites what these wrote. */
static double time_engine(cudnnHandle_t handle, cudnnBackendDescriptor_t plan, cudnnBackendDescriptor_t pack,
                          const mu_g_planned *p) {
    double beta = p->double_scales ? p->beta_d : (double)p->beta_f;
    engine_call call = {handle, plan, pack};
    return beta != 0.0 ? -1 : mu_time_calls(handle, execute_engine, &call);
}

/*
 * A pending plan's point: the kernel's front from online tuning (measured now on this call's
 * buffers, or what another thread or process measured), its fastest point within the workspace
 * the framework allocated, deterministic when its engine is. Published on p once (p is shared by
 * the framework's threads). NULL when p has its point, else why not: the framework's engine runs
 * this call, and, where online tuning gave up or no point fits, every later one (p->native); where
 * p is held to a limit under the engine's workspace, the fallback algorithm (p->undivided).
 */
static const char *choose_online_point(mu_g_planned *p, const mu_conv_call *call, mu_seen *seen,
                                       cudnnBackendDescriptor_t plan, cudnnBackendDescriptor_t pack) {
    const mu_kernel *k = p->pending_kernel;
    const char *why = "no plan";
    /* Held to a limit under the engine's workspace, the engine cannot run: the fallback does. */
    atomic_bool *settled = engine_fits(p) ? &p->native : &p->undivided;
    mu_plan_entry *head = p->pending_front != NULL ? p->pending_front : mu_online_head(call, k, seen, &why);
    if (head == NULL) {
        if (mu_online_settled(seen)) atomic_store(settled, true);
        return why;
    }
    mu_plan_entry *entry = mu_plan_point(head, p->workspace, p->deterministic);
    if (entry == NULL || entry->has_engine_pieces) { /* engine pieces are built at finalize only */
        atomic_store(settled, true);
        mu_log(MU_LOG_INFO, "%s N=%d: no %spoint of the online front within the %s %zu bytes of workspace; "
               "the %s runs", k->key, k->n, p->deterministic ? "deterministic " : "",
               engine_fits(p) ? "engine's" : "held", p->workspace,
               engine_fits(p) ? "framework's engine" : "fallback algorithm, undivided,");
        return "no point of the online front fits";
    }
    if (!engine_fits(p)) {
        mu_plan_entry *none = NULL;
        if (atomic_compare_exchange_strong_explicit(&p->entry, &none, entry, memory_order_release,
                                                    memory_order_acquire))
            mu_log(MU_LOG_INFO, "graph plan: %s N=%d runs the online front's point (workspace %zu within the "
                   "held %zu, the engine's %zu; %.4f ms)", k->key, k->n, entry->workspace, p->workspace,
                   p->engine_workspace, entry->time_ms);
        return NULL;
    }
    /* The engine cannot be timed inside a capture: the engine runs this call, a later one compares. */
    if (mu_stream_capturing(call->handle)) return "online tuning: the stream is being captured";
    double engine_ms = time_engine(call->handle, plan, pack, p);
    if (engine_ms < 0 || entry->time_ms >= engine_ms * MU_ONLINE_ENGINE_GAIN) {
        atomic_store(&p->native, true);
        mu_log(MU_LOG_INFO, "%s N=%d: the framework's engine runs: %s (the online front's point within its "
               "workspace %.4f ms)", k->key, k->n, engine_ms < 0 ? "it cannot be timed here" : "as fast or faster",
               entry->time_ms);
        if (engine_ms >= 0) mu_log(MU_LOG_DEBUG, "%s N=%d: engine %.4f ms", k->key, k->n, engine_ms);
        return "the framework's engine is as fast";
    }
    mu_plan_entry *none = NULL;
    if (atomic_compare_exchange_strong_explicit(&p->entry, &none, entry, memory_order_release, memory_order_acquire))
        mu_log(MU_LOG_INFO, "graph plan: %s N=%d runs the online front's point (workspace %zu, the engine's %zu; "
               "%.4f ms, the engine %.4f ms)", k->key, k->n, entry->workspace, p->workspace, entry->time_ms, engine_ms);
    return NULL;
}

/* A point faster than a held plan's must be MU_LENT_GAIN faster to run in lent workspace (as an
 * online point must be to replace the framework's engine). */
#define MU_LENT_GAIN MU_ONLINE_ENGINE_GAIN

/* A plan held under its engine's workspace, on a thread that lent more (lend.c): its front's
 * fastest point within the lent buffer runs there, where that is MU_LENT_GAIN faster. */
static void lend_if_faster(const mu_g_planned *p, mu_seen *seen, mu_conv_call *call) {
    mu_plan_entry *held = mu_g_planned_entry(p), *front;
    void *lent;
    size_t bytes;
    if (held == NULL || p->workspace >= p->engine_workspace ||
        !mu_lent_workspace(call->handle, p->workspace, &lent, &bytes))
        return;
    const mu_state *state = mu_config(); /* the hard limit holds lent workspace too */
    if (state->has_limit && bytes > state->workspace_limit) bytes = state->workspace_limit;
    if (bytes <= p->workspace) return;
    front = p->pending_front != NULL ? p->pending_front : mu_online_front(seen);
    mu_plan_entry *point = front != NULL ? mu_plan_point(front, bytes, p->deterministic) : NULL;
    if (point == NULL || point->has_engine_pieces || point->time_ms >= held->time_ms * MU_LENT_GAIN) return;
    call->point = point;
    call->workspace = lent;
    call->workspace_size = bytes;
    mu_lend_count_call(seen, held, point);
}

static cudnnStatus_t execute_planned(cudnnHandle_t handle, mu_g_planned *p, const mu_g_variant_pack *pack,
                                     mu_seen *seen, cudnnBackendDescriptor_t plan, cudnnBackendDescriptor_t variant_pack) {
    mu_conv_call call = {
        .descs = {p->dir, p->x, p->w, p->conv, p->y},
        .handle = handle,
        .alpha = p->double_scales ? (const void *)&p->alpha_d : (const void *)&p->alpha_f,
        .beta = p->double_scales ? (const void *)&p->beta_d : (const void *)&p->beta_f,
        .x = pointer_of(pack, p->uid_x),
        .w = pointer_of(pack, p->uid_w),
        .y = pointer_of(pack, p->uid_y),
        .algo = p->fallback_algo,
        .workspace = pack->workspace,
        .workspace_size = p->workspace,
        .graph = p,
    };
    if (call.x == NULL || call.w == NULL || call.y == NULL) return CUDNN_STATUS_BAD_PARAM;
    /* pending: a point, else the engine where it fits the framework's workspace, else the
     * fallback algorithm undivided (the planned call without an entry passes through to it) */
    if (mu_g_planned_entry(p) == NULL && !atomic_load_explicit(&p->undivided, memory_order_relaxed)) {
        const char *why = choose_online_point(p, &call, seen, plan, variant_pack);
        if (why != NULL && engine_fits(p)) return run_engine(handle, plan, variant_pack, seen, why);
    }
    lend_if_faster(p, seen, &call);
    return mu_convolution_guarded(&call);
}

/* ---- the interposed functions --------------------------------------------------------------- */

MU_EXPORT cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t descriptorType,
                                                     cudnnBackendDescriptor_t *descriptor) {
    if (MU_REAL_MISSING(cudnnBackendCreateDescriptor)) return CUDNN_STATUS_NOT_INITIALIZED;
    if (!mu_guard_enter()) return mu_real()->cudnnBackendCreateDescriptor(descriptorType, descriptor);
    cudnnStatus_t status = mu_real()->cudnnBackendCreateDescriptor(descriptorType, descriptor);
    if (status == CUDNN_STATUS_SUCCESS && descriptor != NULL && !mu_config()->disabled)
        mu_g_track(*descriptor, descriptorType);
    mu_guard_leave();
    return status;
}

MU_EXPORT cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t descriptor) {
    if (MU_REAL_MISSING(cudnnBackendDestroyDescriptor)) return CUDNN_STATUS_NOT_INITIALIZED;
    if (!mu_guard_enter()) return mu_real()->cudnnBackendDestroyDescriptor(descriptor);
    cudnnStatus_t status = mu_real()->cudnnBackendDestroyDescriptor(descriptor);
    free_planned(mu_g_untrack(descriptor));
    mu_guard_leave();
    return status;
}

MU_EXPORT cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t descriptor,
                                                 cudnnBackendAttributeName_t attributeName,
                                                 cudnnBackendAttributeType_t attributeType, int64_t elementCount,
                                                 const void *arrayOfElements) {
    if (MU_REAL_MISSING(cudnnBackendSetAttribute)) return CUDNN_STATUS_NOT_INITIALIZED;
    if (!mu_guard_enter())
        return mu_real()->cudnnBackendSetAttribute(descriptor, attributeName, attributeType, elementCount,
                                                   arrayOfElements);
    cudnnStatus_t status = mu_real()->cudnnBackendSetAttribute(descriptor, attributeName, attributeType,
                                                               elementCount, arrayOfElements);
    if (status == CUDNN_STATUS_SUCCESS)
        mu_g_attribute_set(descriptor, attributeName, attributeType, elementCount, arrayOfElements);
    mu_guard_leave();
    return status;
}

MU_EXPORT cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t const descriptor,
                                                 cudnnBackendAttributeName_t attributeName,
                                                 cudnnBackendAttributeType_t attributeType,
                                                 int64_t requestedElementCount, int64_t *elementCount,
                                                 void *arrayOfElements) {
    if (MU_REAL_MISSING(cudnnBackendGetAttribute)) return CUDNN_STATUS_NOT_INITIALIZED;
    if (!mu_guard_enter())
        return mu_real()->cudnnBackendGetAttribute(descriptor, attributeName, attributeType,
                                                   requestedElementCount, elementCount, arrayOfElements);
    mu_seen *seen;
    mu_g_planned *planned = attributeName == CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE &&
                                    attributeType == CUDNN_TYPE_INT64 && requestedElementCount >= 1 &&
                                    arrayOfElements != NULL
                                ? mu_g_planned_of(descriptor, &seen)
                                : NULL;
    cudnnStatus_t status = mu_real()->cudnnBackendGetAttribute(
        descriptor, attributeName, attributeType, requestedElementCount, elementCount, arrayOfElements);
    if (status == CUDNN_STATUS_SUCCESS && planned != NULL) {
        *(int64_t *)arrayOfElements = (int64_t)planned->workspace; /* what the framework allocates */
        if (elementCount != NULL) *elementCount = 1;
    } else if (status == CUDNN_STATUS_SUCCESS && elementCount != NULL) {
        int64_t filled = *elementCount < requestedElementCount ? *elementCount : requestedElementCount;
        mu_g_attribute_got(descriptor, attributeName, attributeType, filled, arrayOfElements);
    }
    mu_guard_leave();
    return status;
}

MU_EXPORT cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t descriptor) {
    if (MU_REAL_MISSING(cudnnBackendFinalize)) return CUDNN_STATUS_NOT_INITIALIZED;
    if (!mu_guard_enter()) return mu_real()->cudnnBackendFinalize(descriptor);
    cudnnStatus_t status = mu_real()->cudnnBackendFinalize(descriptor);
    cudnnBackendDescriptorType_t type;
    const mu_state *state = mu_config();
    if (status == CUDNN_STATUS_SUCCESS && !state->disabled && mu_g_tracked(descriptor, &type) &&
        type == CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)
        status = after_plan_finalized(descriptor, state);
    mu_guard_leave();
    return status;
}

MU_EXPORT cudnnStatus_t cudnnBackendExecute(cudnnHandle_t handle, cudnnBackendDescriptor_t executionPlan,
                                            cudnnBackendDescriptor_t variantPack) {
    if (MU_REAL_MISSING(cudnnBackendExecute)) return CUDNN_STATUS_NOT_INITIALIZED;
    if (!mu_guard_enter()) return mu_real()->cudnnBackendExecute(handle, executionPlan, variantPack);
    mu_seen *seen = NULL;
    mu_g_planned *planned = mu_g_planned_of(executionPlan, &seen);
    if (planned != NULL && atomic_load_explicit(&planned->native, memory_order_relaxed)) planned = NULL;
    mu_g_variant_pack pack;
    cudnnStatus_t status;
    if (planned != NULL && mu_g_variant_pack_of(variantPack, &pack)) {
        status = execute_planned(handle, planned, &pack, seen, executionPlan, variantPack);
    } else {
        /* A planned plan never gets here with an unknown variant pack when its workspace is less
         * than the engine's: that would run the engine in a workspace sized for the micro-batch plan. */
        status = planned != NULL && planned->workspace < planned->engine_workspace
                     ? CUDNN_STATUS_BAD_PARAM
                     : mu_real()->cudnnBackendExecute(handle, executionPlan, variantPack);
        if (planned == NULL && seen != NULL) atomic_fetch_add(&seen->passthrough_calls, 1);
    }
    mu_guard_leave();
    return status;
}

/*
 * cuDNN's own CUDA graphs of an execution plan (cudnnBackendPopulateCudaGraph and
 * cudnnBackendUpdateCudaGraph, cuDNN >= 9.5, cudnn-frontend's populate_cuda_graph) record the
 * framework's engine, undivided, in the workspace the framework allocated: the size the shim
 * reported, the micro-batch plan's. That is correct when the engine needs no more; when it does,
 * recording it would let the engine write past the framework's buffer, so the shim refuses
 * (CUDNN_STATUS_NOT_SUPPORTED, one warning per plan kernel) and the framework executes the plan
 * with cudnnBackendExecute, where the pieces run.
 */
static cudnnStatus_t native_graph(cudnnBackendDescriptor_t plan, const char *function,
                                  cudnnStatus_t (*real_call)(cudnnHandle_t, cudnnBackendDescriptor_t,
                                                             cudnnBackendDescriptor_t, cudaGraph_t),
                                  cudnnHandle_t handle, cudnnBackendDescriptor_t pack, cudaGraph_t graph) {
    if (!mu_guard_enter()) return real_call(handle, plan, pack, graph);
    mu_seen *seen = NULL;
    mu_g_planned *planned = mu_g_planned_of(plan, &seen);
    cudnnStatus_t status;
    if (planned != NULL && planned->engine_workspace > planned->workspace) {
        static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
        mu_log_limited(&limit, MU_LOG_WARNING, "%s: %s N=%d: the engine needs %zu bytes of workspace, the "
                       "framework allocated the plan's %zu; refused (execute the plan instead)", function,
                       seen ? seen->key : "?", seen ? seen->n : 0, planned->engine_workspace, planned->workspace);
        status = CUDNN_STATUS_NOT_SUPPORTED;
    } else {
        status = real_call(handle, plan, pack, graph);
    }
    mu_guard_leave();
    return status;
}

MU_EXPORT cudnnStatus_t cudnnBackendPopulateCudaGraph(cudnnHandle_t handle, cudnnBackendDescriptor_t executionPlan,
                                                      cudnnBackendDescriptor_t variantPack, cudaGraph_t graph) {
    if (MU_REAL_MISSING(cudnnBackendPopulateCudaGraph)) return CUDNN_STATUS_NOT_SUPPORTED;
    return native_graph(executionPlan, __func__, mu_real()->cudnnBackendPopulateCudaGraph, handle, variantPack,
                        graph);
}

MU_EXPORT cudnnStatus_t cudnnBackendUpdateCudaGraph(cudnnHandle_t handle, cudnnBackendDescriptor_t executionPlan,
                                                    cudnnBackendDescriptor_t variantPack, cudaGraph_t graph) {
    if (MU_REAL_MISSING(cudnnBackendUpdateCudaGraph)) return CUDNN_STATUS_NOT_SUPPORTED;
    return native_graph(executionPlan, __func__, mu_real()->cudnnBackendUpdateCudaGraph, handle, variantPack,
                        graph);
}

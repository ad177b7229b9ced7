/*
 * online.c: online tuning (MUCUDNN_ONLINE=1, docs/shim.md "Online tuning"). A convolution whose
 * (key, N) has no plan entry is measured on its first call (legacy cudnnConvolution*, or the first
 * cudnnBackendExecute of a graph-API execution plan: intercept_graph.c), as cudnn.benchmark does but
 * with micro-batches: every algorithm of its direction (the caller's math type) at N and at the
 * powers of two below N, timed with driver events on the caller's stream and on the caller's
 * slices. The per-kernel dynamic program turns the measurements into the kernel's time-workspace
 * front (thinned as mucudnn/optimizer/dp.py's thin_front), which is published on the kernel's
 * mu_seen entry and run like a front plan's points from then on, and appended to one plan file
 * per GPU and cuDNN version in MUCUDNN_ONLINE_DIR, which the next process loads as its plan.
 *
 * Invariants:
 * - The caller's data are never changed where the real call will not overwrite them: only the
 *   output of forward and backward-data with beta = 0 is written while measuring (the real call,
 *   after, overwrites all of it); any other output (beta != 0, and backward-filter's dw always)
 *   goes to a scratch buffer of cuMemAlloc.
 * - One process of a node measures a kernel: it holds an flock on the kernel's lock file while
 *   it measures and writes; a process that finds the lock held passes the call through and looks
 *   again later (the front is then in the file). flock dies with its process.
 * - The plan file is only ever replaced whole (written to a temporary file, renamed), under an
 *   flock of its own lock file, merging what other processes wrote: a reader sees the old file or
 *   the new one, and a process killed at any point leaves a valid file. A file this shim cannot
 *   read as its own (malformed, another GPU or cuDNN, not a front plan) is warned about once and
 *   never written.
 * - The hot path (a kernel with a published front) is one acquire load.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* Timed runs per candidate, after one warm-up run; the candidate's time is their mean. */
/* A kernel claimed by another process is looked at again after this long. */
#define MU_ONLINE_RETRY_MS 200
/* The longest a call waits for the plan file's lock (a merge takes milliseconds; a holder stopped,
 * or a child forked while the lock was held, which keeps it, must not hang the caller). */
#define MU_ONLINE_FILE_WAIT_MS 2000
/* Device memory left free when sizing the measuring workspace (the framework's next allocation). */
#define MU_ONLINE_MEMORY_MARGIN ((size_t)256 << 20)
/* The largest N measured: the dynamic program keeps N + 1 partial plans. */
#define MU_ONLINE_MAX_N 65536
#define MU_ONLINE_MAX_SIZES 32
#define MU_ONLINE_MAX_ALGOS 8
/* A point with more pieces is left out of the front (its launches would cost more than it gains). */
#define MU_ONLINE_MAX_PIECES 64
#define MU_ONLINE_MAX_POINTS (MU_ONLINE_MAX_ALGOS * MU_ONLINE_MAX_SIZES)
/* thin_front's rule (mucudnn/optimizer/dp.py FRONT_MIN_GAIN, FRONT_MAX_POINTS). */
#define MU_FRONT_MIN_GAIN 0.02
#define MU_FRONT_MAX_POINTS 6

/* mu_seen.online_state */
enum { STATE_NEW = 0, STATE_BUSY, STATE_DONE, STATE_WAIT };
/* mu_seen.online_reason: why a kernel has no front (counted once each in the exit report) */
enum { REASON_NONE = 0, REASON_BUDGET, REASON_CLAIMED, REASON_FAILED, REASON_TOO_LARGE, REASON_COUNT };
static const char *const reason_text[REASON_COUNT] = {
    "no plan", "online tuning: over MUCUDNN_ONLINE_BUDGET_MS", "online tuning: claimed by another process",
    "online tuning: nothing could be measured", "online tuning: N too large to measure"};
static const char *const reason_label[REASON_COUNT] = {"", "budget", "claimed by another process",
                                                      "nothing measurable", "N too large"};

static struct {
    bool on;
    bool persist;        /* the file may be written (the directory is usable, the file ours) */
    bool locks;          /* lock files can be made in the directory */
    char dir[PATH_MAX];
    char file[PATH_MAX]; /* the plan file of this GPU and cuDNN */
    char name[200];      /* its name in dir, which its lock files start with */
    char gpu[256];
    long cudnn;
    long long budget_ms;
    pthread_mutex_t mutex; /* spent_ms, the file warnings */
    double spent_ms;
    atomic_ulong measured, candidates, from_file, passed[REASON_COUNT];
} online = {.mutex = PTHREAD_MUTEX_INITIALIZER};

static double max_ms(double a, double b) { return a > b ? a : b; } /* the shim links no libm */

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static const char *shown(const char *path, char *buf, size_t size) { return mu_log_escape(path, buf, size); }

/* ---- the directory and the file ------------------------------------------------------------ */

static bool make_directories(const char *path) {
    char partial[PATH_MAX];
    size_t length = strlen(path);
    if (length == 0 || length >= sizeof partial) return false;
    memcpy(partial, path, length + 1);
    for (size_t i = 1; i <= length; i++) {
        if (partial[i] != '/' && partial[i] != '\0') continue;
        char saved = partial[i];
        partial[i] = '\0';
        if (mkdir(partial, 0755) != 0 && errno != EEXIST) return false;
        partial[i] = saved;
    }
    struct stat info;
    return stat(path, &info) == 0 && S_ISDIR(info.st_mode) && access(path, W_OK | X_OK) == 0;
}

/* Why the plan in the file is not this process's online plan, NULL when it is. */
static const char *foreign_plan(const mu_plan *plan, char *why, size_t size) {
    if (strcmp(plan->gpu, online.gpu) != 0)
        snprintf(why, size, "it is for gpu '%s', this process runs on '%s'", plan->gpu, online.gpu);
    else if (plan->cudnn_version != online.cudnn)
        snprintf(why, size, "it is for cudnn %ld, this process runs cudnn %ld", plan->cudnn_version, online.cudnn);
    else if (!plan->front || plan->limit != UINT64_MAX)
        snprintf(why, size, "it is not a front plan without a limit (strategy %s, limit %llu)", plan->strategy,
                 plan->limit);
    else
        return NULL;
    return why;
}

/* Loads the file: NULL when it does not exist (*usable stays true) or cannot be used (*usable
 * false, warned once: the file is then left as it is, never overwritten). */
static mu_plan *load_file(bool *usable) {
    char error[1024], why[512], path[MU_ESCAPED_MAX];
    *usable = true;
    if (access(online.file, F_OK) != 0 && errno == ENOENT) return NULL;
    mu_plan *plan = mu_plan_load(online.file, error, sizeof error);
    const char *problem = plan == NULL ? error : foreign_plan(plan, why, sizeof why);
    if (problem == NULL) return plan;
    *usable = false;
    pthread_mutex_lock(&online.mutex);
    if (online.persist)
        mu_log(MU_LOG_WARNING, "online tuning: %s%s%s; ignored and left as it is (kernels are tuned in memory "
               "only)", plan == NULL ? "" : shown(online.file, path, sizeof path), plan == NULL ? "" : ": ",
               problem);
    online.persist = false;
    pthread_mutex_unlock(&online.mutex);
    mu_plan_free(plan);
    return NULL;
}

/* The file's name: the GPU's name with anything but [A-Za-z0-9._-] as '_', and the cuDNN version. */
static void file_name(char *name, size_t size) {
    char gpu[128];
    size_t i = 0;
    for (; online.gpu[i] != '\0' && i + 1 < sizeof gpu; i++) {
        char c = online.gpu[i];
        bool plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                     c == '-' || c == '_';
        gpu[i] = plain ? c : '_';
    }
    gpu[i] = '\0';
    snprintf(name, size, "%s-cudnn%ld.plan", gpu, online.cudnn);
}

static void report(void);

mu_plan *mu_online_init(bool have_plan) {
    online.on = mu_option_int(MU_OPT_ONLINE) != 0;
    online.budget_ms = mu_option_int(MU_OPT_ONLINE_BUDGET_MS);
    if (!online.on) return NULL;
    atexit(report);
    /* The GPU's name first: it loads libcuda where nothing has yet (a program on the test double). */
    bool named = mu_gpu_name(online.gpu, sizeof online.gpu);
    const mu_driver_table *d = mu_driver();
    if (d == NULL || d->event_create == NULL || d->event_record == NULL || d->event_synchronize == NULL ||
        d->event_elapsed_time == NULL || d->event_destroy == NULL || d->mem_alloc == NULL || d->mem_free == NULL) {
        mu_log(MU_LOG_WARNING, "online tuning off: the CUDA driver (events, memory) is not in the process");
        online.on = false;
        return NULL;
    }
    const mu_real_table *real = mu_real();
    online.cudnn = real->cudnnGetVersion ? (long)real->cudnnGetVersion() : -1;
    if (!named) {
        mu_log(MU_LOG_WARNING, "online tuning: cannot name the GPU (%s); tuning in memory only", online.gpu);
        return NULL;
    }
    const char *dir = mu_option_path(MU_OPT_ONLINE_DIR);
    char path[MU_ESCAPED_MAX];
    if (dir == NULL) {
        mu_log(MU_LOG_WARNING, "online tuning: no MUCUDNN_ONLINE_DIR, XDG_CACHE_HOME or HOME; tuning in memory only");
        return NULL;
    }
    file_name(online.name, sizeof online.name);
    if (snprintf(online.dir, sizeof online.dir, "%s", dir) >= (int)sizeof online.dir ||
        snprintf(online.file, sizeof online.file, "%s/%s", dir, online.name) >= (int)sizeof online.file ||
        !make_directories(dir)) {
        mu_log(MU_LOG_WARNING, "online tuning: MUCUDNN_ONLINE_DIR=%s cannot be created or written (%s); tuning "
               "in memory only, nothing is saved", shown(dir, path, sizeof path), strerror(errno));
        return NULL;
    }
    online.persist = online.locks = true;
    bool usable;
    mu_plan *plan = have_plan ? NULL : load_file(&usable);
    if (plan != NULL) plan->online = true;
    if (plan != NULL)
        mu_log(MU_LOG_INFO, "online tuning: loaded %s: %zu kernel points", shown(online.file, path, sizeof path),
               plan->entry_count);
    return plan;
}

/* ---- the exit report ---------------------------------------------------------------------- */

static void report(void) {
    unsigned long passed = 0;
    char reasons[256] = "";
    size_t used = 0;
    for (int r = 1; r < REASON_COUNT; r++) {
        unsigned long count = atomic_load(&online.passed[r]);
        passed += count;
        if (count > 0 && used < sizeof reasons)
            used += (size_t)snprintf(reasons + used, sizeof reasons - used, "%s%lu %s", used ? ", " : "", count,
                                     reason_label[r]);
    }
    unsigned long measured = atomic_load(&online.measured), from_file = atomic_load(&online.from_file);
    if (measured + from_file + passed == 0) return;
    char path[MU_ESCAPED_MAX];
    char lent[64] = ""; /* lend.c: only where a framework lent workspace that was used */
    size_t lent_calls = mucudnn_lent_calls();
    if (lent_calls > 0) snprintf(lent, sizeof lent, "; %zu calls in lent workspace", lent_calls);
    mu_log_summary("online tuning: measured %lu kernels (%lu candidates timed) in %.0f ms; %lu kernels from %s; "
                   "%lu passed through%s%s%s%s", measured, atomic_load(&online.candidates), online.spent_ms,
                   from_file, online.file[0] ? shown(online.file, path, sizeof path) : "(no file)", passed,
                   passed ? " (" : "", reasons, passed ? ")" : "", lent);
}

void mu_online_note_planned(mu_seen *seen) {
    if (!online.on || seen == NULL || atomic_load_explicit(&seen->online_counted, memory_order_relaxed)) return;
    if (!atomic_exchange(&seen->online_counted, true)) atomic_fetch_add(&online.from_file, 1);
}

/* ---- locks --------------------------------------------------------------------------------- */

/* An flock'ed lock file: -1 when the directory has none to give (no lock: nothing is shared). */
static int lock_path(char *path, size_t size, const char *what) {
    return snprintf(path, size, "%s/locks/%s.%s.lock", online.dir, online.name, what) < (int)size ? 0 : -1;
}

typedef enum { LOCK_TAKEN, LOCK_BUSY, LOCK_NONE } lock_result;

/* wait: for at most MU_ONLINE_FILE_WAIT_MS (LOCK_BUSY after). */
static lock_result take_lock(const char *what, bool wait, int *fd) {
    char path[PATH_MAX + 300], dir[PATH_MAX + 16];
    *fd = -1;
    if (!online.locks) return LOCK_NONE;
    snprintf(dir, sizeof dir, "%s/locks", online.dir);
    if (lock_path(path, sizeof path, what) != 0 || (mkdir(dir, 0755) != 0 && errno != EEXIST) ||
        (*fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644)) < 0) {
        char shown_dir[MU_ESCAPED_MAX];
        pthread_mutex_lock(&online.mutex);
        if (online.locks)
            mu_log(MU_LOG_WARNING, "online tuning: cannot make lock files in %s (%s); tuning in memory only, "
                   "nothing is saved", shown(online.dir, shown_dir, sizeof shown_dir), strerror(errno));
        online.locks = online.persist = false;
        pthread_mutex_unlock(&online.mutex);
        return LOCK_NONE;
    }
    int rc;
    double deadline = now_ms() + MU_ONLINE_FILE_WAIT_MS;
    while ((rc = flock(*fd, LOCK_EX | LOCK_NB)) != 0 &&
           (errno == EINTR || (errno == EWOULDBLOCK && wait && now_ms() < deadline)))
        if (errno == EWOULDBLOCK) nanosleep(&(struct timespec){.tv_nsec = 5000000}, NULL);
    if (rc == 0) return LOCK_TAKEN;
    bool busy = errno == EWOULDBLOCK;
    close(*fd);
    *fd = -1;
    return busy ? LOCK_BUSY : LOCK_NONE;
}

static void release_lock(int fd) {
    if (fd < 0) return;
    flock(fd, LOCK_UN);
    close(fd);
}

/* ---- fronts as plan entries ---------------------------------------------------------------- */

/* A chain of `count` points (workspace ascending through next_point) in one allocation. */
static mu_plan_entry *new_chain(const mu_kernel *k, int count) {
    mu_plan_entry *points = calloc((size_t)count, sizeof *points);
    char *key = strdup(k->key);
    if (points == NULL || key == NULL) {
        free(points);
        free(key);
        return NULL;
    }
    mu_direction dir;
    mu_key_check(k->key, &dir);
    for (int i = 0; i < count; i++) {
        points[i].key = key;
        points[i].dir = dir;
        points[i].n = k->n;
        points[i].hash = k->hash;
        points[i].next_point = i + 1 < count ? &points[i + 1] : NULL;
    }
    return points;
}

/* A copy of a loaded plan's chain (the plan is then freed). */
static mu_plan_entry *copy_chain(const mu_kernel *k, const mu_plan_entry *head) {
    int count = 0;
    for (const mu_plan_entry *p = head; p != NULL; p = p->next_point) count++;
    mu_plan_entry *points = new_chain(k, count);
    if (points == NULL) return NULL;
    int i = 0;
    for (const mu_plan_entry *p = head; p != NULL; p = p->next_point, i++) {
        mu_plan_entry *point = &points[i];
        point->workspace = p->workspace;
        point->time_ms = p->time_ms;
        point->piece_count = p->piece_count;
        point->has_engine_pieces = p->has_engine_pieces;
        point->has_borrow_pieces = p->has_borrow_pieces;
        point->pieces = calloc((size_t)p->piece_count, sizeof *point->pieces);
        if (point->pieces == NULL) return NULL; /* leaked: out of memory already */
        for (int j = 0; j < p->piece_count; j++) {
            point->pieces[j] = p->pieces[j];
            if (p->pieces[j].engine != NULL && (point->pieces[j].engine = malloc(sizeof(mu_engine))) != NULL)
                *point->pieces[j].engine = *p->pieces[j].engine;
            else if (p->pieces[j].engine != NULL)
                return NULL;
        }
    }
    return points;
}

/* The kernel's chain in the file, where another process wrote it; NULL if none. */
static mu_plan_entry *chain_from_file(const mu_kernel *k) {
    bool usable;
    mu_plan *plan = online.persist ? load_file(&usable) : NULL;
    if (plan == NULL) return NULL;
    mu_plan_entry *head = mu_plan_find(plan, k->key, k->n, k->hash);
    mu_plan_entry *chain = head != NULL ? copy_chain(k, head) : NULL;
    mu_plan_free(plan);
    return chain;
}

/* ---- measuring ----------------------------------------------------------------------------- */

typedef struct {
    bool ok;
    double time_ms;
    size_t workspace;
} measured_cell;

typedef struct {
    int size_count, algo_count;
    int sizes[MU_ONLINE_MAX_SIZES];       /* descending: N first */
    measured_cell cell[MU_ONLINE_MAX_ALGOS][MU_ONLINE_MAX_SIZES];
    bool partial;                         /* the budget ran out before every candidate was timed */
} measurements;

static cudnnStatus_t sliced(const mu_kernel *k, const int dims[], const int strides[], int batch,
                            cudnnTensorDescriptor_t *desc) {
    const mu_real_table *real = mu_real();
    int d[MU_MAX_DIMS];
    memcpy(d, dims, sizeof d);
    d[0] = batch;
    cudnnStatus_t status = real->cudnnCreateTensorDescriptor(desc);
    if (status == CUDNN_STATUS_SUCCESS) status = real->cudnnSetTensorNdDescriptor(*desc, k->dtype, k->nb_dims, d, strides);
    return status;
}

/* Bytes of the filter (dw of backward-filter: the scratch it is written to). */
static size_t filter_bytes(const mu_conv_call *call, const mu_kernel *k) {
    cudnnDataType_t dtype;
    cudnnTensorFormat_t format;
    int nb_dims, dims[MU_MAX_DIMS];
    if (mu_real()->cudnnGetFilterNdDescriptor(call->descs.w, MU_MAX_DIMS, &dtype, &format, &nb_dims, dims) !=
        CUDNN_STATUS_SUCCESS)
        return 0;
    size_t elements = 1;
    for (int i = 0; i < nb_dims; i++) elements *= (size_t)dims[i];
    return elements * mu_dtype_size(k->dtype);
}

static CUdeviceptr device_alloc(size_t bytes) {
    CUdeviceptr ptr = 0;
    return bytes > 0 && mu_driver()->mem_alloc(&ptr, bytes) == CU_SUCCESS ? ptr : 0;
}

static double spent_so_far(void) {
    pthread_mutex_lock(&online.mutex);
    double spent = online.spent_ms;
    pthread_mutex_unlock(&online.mutex);
    return spent;
}

/* One candidate of a kernel's measurement: an algorithm on micro-batch descriptors, in a workspace. */
typedef struct {
    const mu_direction_ops *ops;
    const mu_conv_call *call;
    mu_conv_descs descs;
    mu_conv_buffers buffers;
    int algo;
    void *workspace;
    size_t workspace_size;
} candidate;

static cudnnStatus_t run_candidate(void *context) {
    const candidate *c = context;
    return c->ops->run(c->call->handle, &c->descs, &c->buffers, c->algo, c->call->alpha, c->call->beta,
                       c->workspace, c->workspace_size);
}

/*
 * Times every supported (algorithm, size) on the caller's buffers; false when nothing could be
 * measured. Sizes are measured largest first, algorithm 0 (workspace-free) first, so that a
 * measurement the budget cuts short still has an undivided point.
 */
static bool measure(const mu_conv_call *call, const mu_kernel *k, measurements *m, double *spent_ms) {
    const mu_driver_table *d = mu_driver();
    const mu_real_table *real = mu_real();
    const mu_direction_ops *ops = mu_dir(call->descs.dir);
    double started = now_ms(), gpu_ms = 0, before = spent_so_far();
    memset(m, 0, sizeof *m);
    m->algo_count = mu_algo_count(call->descs.dir);
    if (m->algo_count > MU_ONLINE_MAX_ALGOS) m->algo_count = MU_ONLINE_MAX_ALGOS;
    m->sizes[m->size_count++] = k->n;
    for (int b = 1 << 30; b >= 1; b >>= 1)
        if (b < k->n && m->size_count < MU_ONLINE_MAX_SIZES) m->sizes[m->size_count++] = b;

    cudnnTensorDescriptor_t x_descs[MU_ONLINE_MAX_SIZES] = {0}, y_descs[MU_ONLINE_MAX_SIZES] = {0};
    bool ok = true;
    for (int s = 0; s < m->size_count && ok; s++)
        ok = sliced(k, k->x_dims, k->x_strides, m->sizes[s], &x_descs[s]) == CUDNN_STATUS_SUCCESS &&
             sliced(k, k->y_dims, k->y_strides, m->sizes[s], &y_descs[s]) == CUDNN_STATUS_SUCCESS;
    /* The workspace each candidate needs; the largest that fits in free memory is allocated once. */
    size_t most = 0, free_bytes = 0, total_bytes = 0;
    for (int a = 0; a < m->algo_count && ok; a++)
        for (int s = 0; s < m->size_count; s++) {
            mu_conv_descs descs = {call->descs.dir, x_descs[s], call->descs.w, call->descs.conv, y_descs[s]};
            measured_cell *c = &m->cell[a][s];
            c->ok = ops->workspace_size(call->handle, &descs, a, &c->workspace) == CUDNN_STATUS_SUCCESS;
            if (c->ok && c->workspace > most) most = c->workspace;
        }
    size_t room = mu_device_memory(&free_bytes, &total_bytes)
                      ? (free_bytes > MU_ONLINE_MEMORY_MARGIN ? free_bytes - MU_ONLINE_MEMORY_MARGIN : 0)
                      : most;
    CUdeviceptr workspace = 0;
    size_t workspace_size = 0;
    for (size_t want = most < room ? most : room; want > 0 && workspace == 0;) {
        if ((workspace = device_alloc(want)) != 0) workspace_size = want;
        else want /= 2; /* fragmented or raced: less, and the candidates that need more are skipped */
    }
    /* The output the candidates write: the caller's where the real call overwrites all of it. */
    bool zero_beta = call->beta != NULL && mu_scale_value(call->beta, k->dtype) == 0.0;
    size_t element = mu_dtype_size(k->dtype);
    CUdeviceptr scratch = 0;
    void *x = call->x, *w = call->w, *y = call->y;
    if (call->descs.dir == MU_DIR_BWD_FILTER)
        w = (void *)(uintptr_t)(scratch = device_alloc(filter_bytes(call, k)));
    else if (!zero_beta && call->descs.dir == MU_DIR_FWD)
        y = (void *)(uintptr_t)(scratch = device_alloc((size_t)k->y_strides[0] * element * (size_t)k->n));
    else if (!zero_beta)
        x = (void *)(uintptr_t)(scratch = device_alloc((size_t)k->x_strides[0] * element * (size_t)k->n));
    bool needs_scratch = call->descs.dir == MU_DIR_BWD_FILTER || !zero_beta;
    ok = ok && (!needs_scratch || scratch != 0);

    int timed = 0;
    for (int s = 0; s < m->size_count && ok && !m->partial; s++)
        for (int a = 0; a < m->algo_count; a++) {
            measured_cell *c = &m->cell[a][s];
            if (!c->ok) continue;
            double elapsed = max_ms(now_ms() - started, gpu_ms);
            if (before + elapsed >= (double)online.budget_ms) {
                m->partial = true;
                break;
            }
            /* The caller's workspace is free until the real call: what fits it is always measured
             * (the caller's own algorithm among them), however little memory is free. */
            bool in_callers = c->workspace > workspace_size && c->workspace <= call->workspace_size &&
                              call->workspace != NULL;
            candidate run = {ops, call, {call->descs.dir, x_descs[s], call->descs.w, call->descs.conv, y_descs[s]},
                             {x, w, y}, a,
                             c->workspace == 0 ? NULL : in_callers ? call->workspace : (void *)(uintptr_t)workspace,
                             c->workspace};
            double ms = c->workspace <= workspace_size || in_callers ? mu_time_calls(call->handle, run_candidate, &run)
                                                                     : -1;
            c->ok = ms >= 0;
            if (!c->ok) continue;
            c->time_ms = ms;
            gpu_ms += ms * (MU_TIMED_RUNS + 1); /* with the warm-up */
            timed++;
            if (mu_log_enabled(MU_LOG_DEBUG))
                mu_log(MU_LOG_DEBUG, "%s N=%d: online b=%d algo=%s: %.4f ms, workspace %zu", k->key, k->n,
                       m->sizes[s], mu_algo_name(call->descs.dir, a), c->time_ms, c->workspace);
        }
    CUstream stream = NULL; /* mu_time_calls synchronised on its events; anything else queued: */
    if (d->stream_synchronize != NULL &&
        real->cudnnGetStream(call->handle, (cudaStream_t *)&stream) == CUDNN_STATUS_SUCCESS)
        d->stream_synchronize(stream); /* before the buffers go */
    if (workspace != 0) d->mem_free(workspace);
    if (scratch != 0) d->mem_free(scratch);
    for (int s = 0; s < m->size_count; s++) {
        if (x_descs[s]) real->cudnnDestroyTensorDescriptor(x_descs[s]);
        if (y_descs[s]) real->cudnnDestroyTensorDescriptor(y_descs[s]);
    }
    if (!ok) /* what was not measured cannot be used */
        for (int a = 0; a < m->algo_count; a++)
            for (int s = 0; s < m->size_count; s++) m->cell[a][s].ok = false;
    *spent_ms = max_ms(now_ms() - started, gpu_ms);
    atomic_fetch_add(&online.candidates, (unsigned long)timed);
    return ok && timed > 0;
}

/* ---- the per-kernel dynamic program -------------------------------------------------------- */

typedef struct {
    double time_ms;
    size_t workspace;
    int piece_count;
    mu_piece pieces[MU_ONLINE_MAX_PIECES];
} front_point;

/* The fastest partition of N into measured sizes, each size with its fastest algorithm needing
 * at most `limit`; false when there is none. Sizes are tried largest first (as dp.py does). */
static bool best_within(const measurements *m, const mu_kernel *k, size_t limit, double *best, int *choice,
                        front_point *point) {
    double size_time[MU_ONLINE_MAX_SIZES];
    int size_algo[MU_ONLINE_MAX_SIZES];
    for (int s = 0; s < m->size_count; s++) {
        size_time[s] = INFINITY, size_algo[s] = -1;
        for (int a = 0; a < m->algo_count; a++) {
            const measured_cell *c = &m->cell[a][s];
            if (c->ok && c->workspace <= limit && c->time_ms < size_time[s]) size_time[s] = c->time_ms, size_algo[s] = a;
        }
    }
    best[0] = 0;
    for (int n = 1; n <= k->n; n++) {
        best[n] = INFINITY, choice[n] = -1;
        for (int s = 0; s < m->size_count; s++)
            if (m->sizes[s] <= n && size_algo[s] >= 0 && best[n - m->sizes[s]] + size_time[s] < best[n])
                best[n] = best[n - m->sizes[s]] + size_time[s], choice[n] = s;
    }
    if (!isfinite(best[k->n])) return false;
    point->time_ms = best[k->n], point->workspace = 0, point->piece_count = 0;
    for (int n = k->n; n > 0; n -= m->sizes[choice[n]]) {
        int s = choice[n], a = size_algo[s];
        if (point->piece_count == MU_ONLINE_MAX_PIECES) return false;
        point->pieces[point->piece_count++] = (mu_piece){.batch = m->sizes[s], .algo = a, .math = k->math};
        if (m->cell[a][s].workspace > point->workspace) point->workspace = m->cell[a][s].workspace;
    }
    return true;
}

static int compare_pieces(const void *left, const void *right) { /* largest first, then algorithm */
    const mu_piece *a = left, *b = right;
    return a->batch != b->batch ? b->batch - a->batch : a->algo - b->algo;
}

/* The Pareto front of the measurements (workspace ascending, time strictly descending), thinned
 * as dp.py's thin_front; returns the number of points. */
static int build_front(const measurements *m, const mu_kernel *k, front_point *front) {
    double *best = malloc(((size_t)k->n + 1) * sizeof *best);
    int *choice = malloc(((size_t)k->n + 1) * sizeof *choice);
    front_point *all = malloc(MU_ONLINE_MAX_POINTS * sizeof *all), point;
    size_t limits[MU_ONLINE_MAX_POINTS];
    int limit_count = 0, count = 0, all_count = 0;
    if (best == NULL || choice == NULL || all == NULL) goto done;
    for (int a = 0; a < m->algo_count; a++) /* every distinct workspace measured, ascending */
        for (int s = 0; s < m->size_count; s++) {
            if (!m->cell[a][s].ok) continue;
            size_t ws = m->cell[a][s].workspace;
            int at = limit_count;
            bool seen = false;
            for (int i = 0; i < limit_count; i++) seen |= limits[i] == ws;
            if (seen) continue;
            while (at > 0 && limits[at - 1] > ws) limits[at] = limits[at - 1], at--;
            limits[at] = ws, limit_count++;
        }
    for (int i = 0; i < limit_count; i++) {
        if (!best_within(m, k, limits[i], best, choice, &point)) continue;
        if (all_count > 0 && point.time_ms >= all[all_count - 1].time_ms) continue; /* not faster: dominated */
        qsort(point.pieces, (size_t)point.piece_count, sizeof *point.pieces, compare_pieces);
        all[all_count++] = point;
    }
    /* thin_front: keep the smallest and the fastest, and between them only points at least
     * MU_FRONT_MIN_GAIN faster than the last kept; then drop the weakest gains down to the maximum. */
    for (int i = 0; i < all_count; i++)
        if (i == 0 || i == all_count - 1 || all[i].time_ms <= (1.0 - MU_FRONT_MIN_GAIN) * front[count - 1].time_ms)
            front[count++] = all[i];
    while (count > MU_FRONT_MAX_POINTS) {
        int weakest = 1;
        for (int i = 2; i < count - 1; i++)
            if (front[i].time_ms / front[i - 1].time_ms > front[weakest].time_ms / front[weakest - 1].time_ms)
                weakest = i;
        memmove(&front[weakest], &front[weakest + 1], (size_t)(count - weakest - 1) * sizeof *front);
        count--;
    }
done:
    free(all);
    free(best);
    free(choice);
    return count;
}

static mu_plan_entry *chain_of_front(const mu_kernel *k, const front_point *front, int count) {
    mu_plan_entry *points = count > 0 ? new_chain(k, count) : NULL;
    for (int i = 0; points != NULL && i < count; i++) {
        points[i].workspace = front[i].workspace;
        points[i].time_ms = front[i].time_ms;
        points[i].piece_count = front[i].piece_count;
        points[i].pieces = malloc((size_t)front[i].piece_count * sizeof(mu_piece));
        if (points[i].pieces == NULL) return NULL; /* leaked: out of memory already */
        memcpy(points[i].pieces, front[i].pieces, (size_t)front[i].piece_count * sizeof(mu_piece));
    }
    return points;
}

/* ---- the file ------------------------------------------------------------------------------ */

/* The plan-file lines of a chain, with '.' as the decimal point whatever the process's locale. */
static char *kernel_lines(const mu_plan_entry *head) {
    size_t size = 0, used = 0;
    for (const mu_plan_entry *p = head; p != NULL; p = p->next_point) size += strlen(p->key) + 96 + 48 * (size_t)p->piece_count;
    char *text = malloc(size + 1);
    if (text == NULL) return NULL;
    locale_t c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
    locale_t previous = c_locale != (locale_t)0 ? uselocale(c_locale) : (locale_t)0;
    for (const mu_plan_entry *p = head; p != NULL; p = p->next_point) {
        used += (size_t)snprintf(text + used, size - used, "kernel %s %d %zu %.6g", p->key, p->n, p->workspace, p->time_ms);
        for (int i = 0; i < p->piece_count; i++)
            used += (size_t)snprintf(text + used, size - used, " %d:%s:%s", p->pieces[i].batch,
                                     mu_algo_name(p->dir, p->pieces[i].algo), mu_math_name(p->pieces[i].math));
        used += (size_t)snprintf(text + used, size - used, "\n");
    }
    if (c_locale != (locale_t)0) {
        uselocale(previous);
        freelocale(c_locale);
    }
    return text;
}

static bool write_all(int fd, const char *text, size_t length) {
    while (length > 0) {
        ssize_t wrote = write(fd, text, length);
        if (wrote < 0 && errno == EINTR) continue;
        if (wrote <= 0) return false;
        text += wrote, length -= (size_t)wrote;
    }
    return true;
}

/* The file as it is (NULL with *length 0 when it does not exist). */
/* The file's text; NULL when it cannot be read, with *missing set where it does not exist (the
 * one case where a new file is written: a file that exists but cannot be read is never replaced,
 * so no other process's kernels are lost). */
static char *read_text(size_t *length, bool *missing) {
    *length = 0;
    FILE *file = fopen(online.file, "re");
    *missing = file == NULL && errno == ENOENT;
    if (file == NULL) return NULL;
    size_t capacity = 1 << 16;
    char *text = malloc(capacity);
    size_t got;
    while (text != NULL && (got = fread(text + *length, 1, capacity - *length, file)) > 0) {
        *length += got;
        if (*length == capacity) {
            char *bigger = realloc(text, capacity *= 2);
            if (bigger == NULL) free(text);
            text = bigger;
        }
    }
    if (text != NULL && ferror(file)) {
        free(text);
        text = NULL;
    }
    fclose(file);
    return text;
}

/* Appends the kernel's front to the file (under the file's lock: read, merge, write a temporary
 * file, rename). Another process may have added other kernels since this one loaded it. */
static void persist(const mu_kernel *k, const mu_plan_entry *head) {
    int fd;
    char path[MU_ESCAPED_MAX];
    if (!online.persist) return;
    lock_result taken = take_lock("file", true, &fd);
    if (taken == LOCK_BUSY) {
        static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
        mu_log_limited(&limit, MU_LOG_WARNING, "online tuning: the lock of %s was held by another process for "
                       "over %d ms; %s N=%d kept in memory only", shown(online.file, path, sizeof path),
                       MU_ONLINE_FILE_WAIT_MS, k->key, k->n);
    }
    if (taken != LOCK_TAKEN) return;
    bool usable;
    mu_plan *plan = load_file(&usable);
    bool present = plan != NULL && mu_plan_find(plan, k->key, k->n, k->hash) != NULL;
    mu_plan_free(plan);
    char *lines = usable && !present ? kernel_lines(head) : NULL;
    size_t length = 0;
    bool missing = false;
    char *text = lines != NULL ? read_text(&length, &missing) : NULL;
    if (lines != NULL && text == NULL && !missing) {
        static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
        mu_log_limited(&limit, MU_LOG_WARNING, "online tuning: cannot read %s (%s); %s N=%d kept in memory only",
                       shown(online.file, path, sizeof path), strerror(errno), k->key, k->n);
        free(lines);
        lines = NULL;
    }
    char temporary[PATH_MAX + 32];
    snprintf(temporary, sizeof temporary, "%s.tmp.%ld", online.file, (long)getpid());
    int out = lines != NULL ? open(temporary, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644) : -1;
    if (lines != NULL) {
        char header[512];
        int header_length = snprintf(header, sizeof header, "# mucudnn plan file: see docs/plan-format.md "
                                     "(written by online tuning)\nmucudnn-plan 1\ngpu %s\ncudnn %ld\nstrategy front\n"
                                     "limit 18446744073709551615\npolicy powerOfTwo\n", online.gpu, online.cudnn);
        bool ok = out >= 0 && (text != NULL ? write_all(out, text, length) && (length == 0 || text[length - 1] == '\n' ||
                                                                               write_all(out, "\n", 1))
                                            : write_all(out, header, (size_t)header_length)) &&
                  write_all(out, lines, strlen(lines)) && fsync(out) == 0;
        ok = out >= 0 && close(out) == 0 && ok && rename(temporary, online.file) == 0;
        if (!ok) {
            static mu_rate_limit limit = MU_RATE_LIMIT_INIT;
            mu_log_limited(&limit, MU_LOG_WARNING, "online tuning: cannot write %s (%s); kept in memory only",
                           shown(online.file, path, sizeof path), strerror(errno));
            unlink(temporary);
        }
    }
    free(text);
    free(lines);
    release_lock(fd);
}

/* ---- a kernel's first calls ----------------------------------------------------------------- */

static void pass_kernel(mu_seen *seen, int reason, int state) {
    if (atomic_exchange(&seen->online_reason, reason) != reason) atomic_fetch_add(&online.passed[reason], 1);
    atomic_store(&seen->online_state, state);
}

/* The kernel's front now: read from the file or measured, NULL with the reason on the seen entry. */
static mu_plan_entry *tune(const mu_conv_call *call, const mu_kernel *k, mu_seen *seen) {
    if (k->n > MU_ONLINE_MAX_N) {
        pass_kernel(seen, REASON_TOO_LARGE, STATE_DONE);
        return NULL;
    }
    char what[32];
    snprintf(what, sizeof what, "%016llx", (unsigned long long)k->hash);
    int fd;
    if (take_lock(what, false, &fd) == LOCK_BUSY) {
        atomic_store(&seen->online_retry_ms, (long long)now_ms() + MU_ONLINE_RETRY_MS);
        pass_kernel(seen, REASON_CLAIMED, STATE_WAIT);
        return NULL;
    }
    /* What another process measured is read whatever the budget (which bounds measuring only). */
    mu_plan_entry *head = fd >= 0 ? chain_from_file(k) : NULL;
    if (head != NULL) {
        atomic_fetch_add(&online.from_file, 1);
        atomic_store(&seen->online_counted, true);
    } else if (spent_so_far() >= (double)online.budget_ms) {
        release_lock(fd);
        pass_kernel(seen, REASON_BUDGET, STATE_DONE);
        return NULL;
    } else {
        measurements m;
        double spent = 0;
        front_point *front = malloc(MU_ONLINE_MAX_POINTS * sizeof *front);
        bool ok = front != NULL && measure(call, k, &m, &spent);
        pthread_mutex_lock(&online.mutex);
        online.spent_ms += spent;
        pthread_mutex_unlock(&online.mutex);
        int count = ok ? build_front(&m, k, front) : 0;
        head = chain_of_front(k, front, count);
        free(front);
        if (head != NULL) {
            atomic_fetch_add(&online.measured, 1);
            if (!m.partial) persist(k, head); /* a partial front is this process's only */
            char pieces[1024];
            mu_plan_pieces_text(&head[count - 1], pieces, sizeof pieces);
            mu_log(MU_LOG_INFO, "%s N=%d: online tuning measured %d points%s in %.1f ms; fastest %.4f ms: %s "
                   "(workspace %zu)", k->key, k->n, count, m.partial ? " (cut short by the budget)" : "", spent,
                   head[count - 1].time_ms, pieces, head[count - 1].workspace);
        }
    }
    release_lock(fd);
    if (head == NULL) {
        pass_kernel(seen, REASON_FAILED, STATE_DONE);
        return NULL;
    }
    atomic_store_explicit(&seen->online_head, head, memory_order_release);
    atomic_store(&seen->online_state, STATE_DONE);
    return head;
}

bool mu_online_on(void) { return online.on; }

mu_plan_entry *mu_online_front(mu_seen *seen) {
    return online.on && seen != NULL ? atomic_load_explicit(&seen->online_head, memory_order_acquire) : NULL;
}

bool mu_online_settled(mu_seen *seen) {
    return seen != NULL && atomic_load(&seen->online_state) == STATE_DONE &&
           atomic_load_explicit(&seen->online_head, memory_order_acquire) == NULL;
}

mu_plan_entry *mu_online_head(const mu_conv_call *call, const mu_kernel *k, mu_seen *seen, const char **why) {
    if (!online.on || seen == NULL) return NULL;
    mu_plan_entry *head = atomic_load_explicit(&seen->online_head, memory_order_acquire);
    if (head != NULL) return head;
    int state = atomic_load(&seen->online_state);
    if (state == STATE_WAIT && now_ms() < (double)atomic_load(&seen->online_retry_ms)) state = STATE_BUSY;
    /* Measuring synchronises: never inside the caller's own stream capture (retried later). */
    if ((state == STATE_NEW || state == STATE_WAIT) && mu_stream_capturing(call->handle)) {
        *why = "online tuning: the stream is being captured";
        return NULL;
    }
    if ((state == STATE_NEW || state == STATE_WAIT) && atomic_compare_exchange_strong(&seen->online_state, &state, STATE_BUSY))
        head = tune(call, k, seen);
    int reason = atomic_load(&seen->online_reason);
    if (head == NULL) *why = reason != REASON_NONE ? reason_text[reason] : "online tuning: being measured by another thread";
    return head;
}

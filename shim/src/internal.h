/*
 * internal.h: declarations shared by the shim's source files, one section per file.
 *
 * Every interposed function follows the same order (libfaketime style):
 *   1. init:   mu_real() resolves the real cuDNN functions once, mu_config() reads the
 *              environment and the plan once;
 *   2. check:  a nested call (cuDNN calling its own public symbols, or the shim calling cuDNN)
 *              goes straight to the real function (thread-local guard); so does a call the
 *              shim has nothing to do with;
 *   3. call:   the real function, or the micro-batch plan;
 *   4. post:   query results are rewritten, statistics counted.
 */
#ifndef MUCUDNN_INTERNAL_H
#define MUCUDNN_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mucudnn.h"

#define MU_EXPORT __attribute__((visibility("default")))
#define MU_PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))

/* mucudnn/_version.py's version, passed by shim/Makefile as -DMUCUDNN_VERSION_STRING; "unknown" in a
 * build that bypasses the Makefile (the fuzz harnesses). */
#ifndef MUCUDNN_VERSION_STRING
#define MUCUDNN_VERSION_STRING "unknown"
#endif

/* ---- options.c: the environment, read once into one table ------------------------------ */

typedef enum {
    MU_OPT_DISABLE,
    MU_OPT_PLAN,
    MU_OPT_WORKSPACE_LIMIT,
    MU_OPT_RECORD,
    MU_OPT_LOG_LEVEL,
    MU_OPT_LOG_FILE,
    MU_OPT_SUMMARY,
    MU_OPT_CUDA_GRAPHS,
    MU_OPT_MEMORY_BUDGET,
    MU_OPT_ROOM,
    MU_OPT_ROOM_MARGIN,
    MU_OPT_ONLINE,
    MU_OPT_ONLINE_DIR,
    MU_OPT_ONLINE_BUDGET_MS,
    MU_OPT_WORKSPACE_SLACK,
    MU_OPT_WORKSPACE_HOLD,
    MU_OPT_COUNT
} mu_option;

/* Reads every MUCUDNN_* variable (once; later calls do nothing) and configures the log. */
void mu_options_init(void);
/* Whether the variable was set to a valid value (else the default is in effect). */
bool mu_option_is_set(mu_option option);
/* Value of a boolean, size or level option. */
long long mu_option_int(mu_option option);
/* Value of a path option, NULL when unset (MUCUDNN_ONLINE_DIR: its default when unset, NULL when
 * neither $XDG_CACHE_HOME nor $HOME gives one). */
const char *mu_option_path(mu_option option);
/* Prints every option, its value and origin at debug level. */
void mu_options_log(void);

/* A byte size (docs/sizes.md): "123", "64MiB", "1.5 GiB", "2GB"; units B, KiB, MiB, GiB, TiB,
 * KB, MB, GB, TB in any case; a fraction is floored to whole bytes; 0 to 2^63-1. *value is set
 * only on MU_SIZE_OK. The plan file's `limit` is meant to use it too. */
typedef enum { MU_SIZE_OK, MU_SIZE_SYNTAX, MU_SIZE_AMBIGUOUS, MU_SIZE_RANGE } mu_size_result;
mu_size_result mu_parse_size(const char *text, long long *value);
/* What is wrong with a size, for messages ("" for MU_SIZE_OK). */
const char *mu_size_problem(mu_size_result result);

/* ---- log.c: prefixed, leveled, rate-limited messages ------------------------------------ */

typedef enum { MU_LOG_ERROR = 0, MU_LOG_WARNING = 1, MU_LOG_INFO = 2, MU_LOG_DEBUG = 3 } mu_log_level;

/* Per call site state of mu_log_limited. */
typedef struct {
    atomic_int count;
} mu_rate_limit;
#define MU_RATE_LIMIT_INIT {0}

/* Sets the level and destination; path NULL or opening it failing means stderr. */
void mu_log_configure(int level, const char *path);
bool mu_log_enabled(mu_log_level level);
/* One line "mucudnn: LEVEL: message\n", written with one write(). */
void mu_log(mu_log_level level, const char *fmt, ...) MU_PRINTF(2, 3);
/* Like mu_log, but a call site prints at most a few times, then says it goes quiet. */
void mu_log_limited(mu_rate_limit *limit, mu_log_level level, const char *fmt, ...) MU_PRINTF(3, 4);
/* One line "mucudnn: summary: message\n", printed whatever the level. */
void mu_log_summary(const char *fmt, ...) MU_PRINTF(1, 2);

/* Room for a value shown in a message with mu_log_escape (longer ones end in "..."). */
#define MU_ESCAPED_MAX 1024
/* text with control characters and backslashes escaped (\n, \t, \x1b, \\), so that a value echoed
 * in a message keeps it on one line; cut with "..." to fit size (at least 4). Returns buf. */
const char *mu_log_escape(const char *text, char *buf, size_t size);
/* Opens path to append to (created 0644) without ever blocking: a FIFO, socket, directory or
 * block device is refused, and so is a character device unless allow_devices (/dev/null, a
 * terminal; then the process's own stderr is fine too, whatever it is). The descriptor is
 * blocking, close-on-exec; -1 with the reason in why on failure. */
int mu_open_output(const char *path, bool allow_devices, char *why, size_t why_size);

/* ---- real.c: the real cuDNN functions, resolved once with dlsym(RTLD_NEXT) --------------- */

#define MU_REAL_FUNCTIONS(X)                        \
    X(cudnnGetVersion)                              \
    X(cudnnGetErrorString)                          \
    X(cudnnGetStream)                               \
    X(cudnnSetStream)                               \
    X(cudnnDestroy)                                 \
    X(cudnnGetTensorNdDescriptor)                   \
    X(cudnnGetFilterNdDescriptor)                   \
    X(cudnnGetConvolutionNdDescriptor)              \
    X(cudnnGetConvolutionMathType)                  \
    X(cudnnGetConvolutionGroupCount)                \
    X(cudnnGetConvolutionReorderType)               \
    X(cudnnCreateTensorDescriptor)                  \
    X(cudnnSetTensorNdDescriptor)                   \
    X(cudnnDestroyTensorDescriptor)                 \
    X(cudnnCreateFilterDescriptor)                  \
    X(cudnnSetFilterNdDescriptor)                   \
    X(cudnnDestroyFilterDescriptor)                 \
    X(cudnnCreateConvolutionDescriptor)             \
    X(cudnnSetConvolutionNdDescriptor)              \
    X(cudnnSetConvolutionMathType)                  \
    X(cudnnSetConvolutionGroupCount)                \
    X(cudnnSetConvolutionReorderType)               \
    X(cudnnDestroyConvolutionDescriptor)            \
    X(cudnnGetConvolutionForwardAlgorithm_v7)       \
    X(cudnnFindConvolutionForwardAlgorithm)         \
    X(cudnnFindConvolutionForwardAlgorithmEx)       \
    X(cudnnGetConvolutionForwardWorkspaceSize)      \
    X(cudnnConvolutionForward)                      \
    X(cudnnGetConvolutionBackwardDataAlgorithm_v7)  \
    X(cudnnFindConvolutionBackwardDataAlgorithm)    \
    X(cudnnFindConvolutionBackwardDataAlgorithmEx)  \
    X(cudnnGetConvolutionBackwardDataWorkspaceSize) \
    X(cudnnConvolutionBackwardData)                 \
    X(cudnnGetConvolutionBackwardFilterAlgorithm_v7) \
    X(cudnnFindConvolutionBackwardFilterAlgorithm)  \
    X(cudnnFindConvolutionBackwardFilterAlgorithmEx) \
    X(cudnnGetConvolutionBackwardFilterWorkspaceSize) \
    X(cudnnConvolutionBackwardFilter)               \
    X(cudnnBackendCreateDescriptor)                 \
    X(cudnnBackendDestroyDescriptor)                \
    X(cudnnBackendSetAttribute)                     \
    X(cudnnBackendGetAttribute)                     \
    X(cudnnBackendFinalize)                         \
    X(cudnnBackendExecute)                          \
    X(cudnnBackendPopulateCudaGraph)                \
    X(cudnnBackendUpdateCudaGraph)

typedef struct {
#define MU_DECLARE_REAL(name) __typeof__(name) *name;
    MU_REAL_FUNCTIONS(MU_DECLARE_REAL)
#undef MU_DECLARE_REAL
} mu_real_table;

/* Whether the real cuDNN exports a function the shim does not interpose. */
bool mu_real_has(const char *name);
/* The table (resolved on first use); a function cuDNN lacks is NULL, with one error logged. */
const mu_real_table *mu_real(void);

/* True (and logs an error) when a real function is missing; its wrapper then returns
 * CUDNN_STATUS_NOT_INITIALIZED. Usage: if (MU_REAL_MISSING(cudnnX)) return ...; */
bool mu_real_missing(const void *function, const char *name);
/* cudnnGetErrorString through the real table, safe before init. */
const char *mu_status_text(cudnnStatus_t status);
#define MU_REAL_MISSING(name) mu_real_missing((const void *)mu_real()->name, #name)

/* Thread-local recursion guard: mu_guard_enter() is false when this thread is already inside
 * the shim (then call the real function directly and do not call mu_guard_leave). */
bool mu_guard_enter(void);
void mu_guard_leave(void);

/* ---- driver.c: the CUDA driver API, from the libcuda.so.1 the process loaded --------------- */

/* The driver's types as the shim uses them (CUresult and friends are ints and opaque pointers). */
typedef int CUresult;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUgraph;
typedef void *CUgraphExec;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;

enum { CU_SUCCESS = 0, CU_STREAM_NON_BLOCKING = 1, CU_STREAM_CAPTURE_MODE_RELAXED = 2,
       CU_STREAM_CAPTURE_STATUS_NONE = 0, CU_EVENT_DEFAULT = 0 };

/* Any member may be NULL (an old driver); users check what they call. */
typedef struct {
    CUresult (*ctx_get_current)(CUcontext *);
    CUresult (*stream_create)(CUstream *, unsigned int);
    CUresult (*stream_is_capturing)(CUstream, int *);
    CUresult (*stream_synchronize)(CUstream);
    CUresult (*begin_capture)(CUstream, int);
    CUresult (*end_capture)(CUstream, CUgraph *);
    CUresult (*instantiate)(CUgraphExec *, CUgraph, unsigned long long);
    CUresult (*launch)(CUgraphExec, CUstream);
    CUresult (*exec_destroy)(CUgraphExec);
    CUresult (*graph_destroy)(CUgraph);
    CUresult (*mem_get_info)(size_t *free_bytes, size_t *total_bytes);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*event_create)(CUevent *, unsigned int);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_synchronize)(CUevent);
    CUresult (*event_elapsed_time)(float *, CUevent, CUevent);
    CUresult (*event_destroy)(CUevent);
    int (*runtime_get_last_error)(void); /* cudaGetLastError: clears what a failed capture left */
} mu_driver_table;

/* The driver, resolved once; NULL when the process has not loaded libcuda. */
const mu_driver_table *mu_driver(void);
/* cuMemGetInfo of the current context's device; false without a driver or a current context. */
bool mu_device_memory(size_t *free_bytes, size_t *total_bytes);
/* Whether the handle's stream is being captured, or its capture status cannot be read (while a
 * legacy-stream capture runs elsewhere cuStreamIsCapturing fails with
 * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT): nothing that records events or synchronises may run then.
 * False without the driver's cuStreamIsCapturing (no capture). */
bool mu_stream_capturing(cudnnHandle_t handle);

/* The shim's one timing method (online tuning's candidates, and the framework's engine they are
 * compared with): one warm-up call, then MU_TIMED_RUNS calls between two events on the handle's
 * stream. Milliseconds per call, or -1 when a call (the warm-up failing is how an unsupported
 * configuration shows) or the events fail. Synchronises. */
#define MU_TIMED_RUNS 3
typedef cudnnStatus_t (*mu_timed_fn)(void *context);
double mu_time_calls(cudnnHandle_t handle, mu_timed_fn call, void *context);

/* ---- key.c: descriptors -> kernel key (docs/kernel-key.md), algorithm and math names ----- */

typedef enum { MU_DIR_FWD = 0, MU_DIR_BWD_DATA = 1, MU_DIR_BWD_FILTER = 2 } mu_direction;

#define MU_KEY_MAX 512
#define MU_MAX_DIMS 8

/* A convolution's descriptors in forward terms (x: x or dx, y: y or dy, w: w or dw). */
typedef struct {
    mu_direction dir;
    cudnnTensorDescriptor_t x;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
    cudnnTensorDescriptor_t y;
} mu_conv_descs;

/* A convolution's device buffers in the same forward terms. */
typedef struct {
    void *x, *w, *y;
} mu_conv_buffers;

/* What the shim knows about one keyed call. */
typedef struct {
    char key[MU_KEY_MAX];
    uint64_t hash;       /* of (key, n) */
    int n;               /* batch size */
    int nb_dims;         /* 4 or 5 */
    cudnnDataType_t dtype;
    cudnnMathType_t math; /* the caller's descriptor's */
    int x_dims[MU_MAX_DIMS], x_strides[MU_MAX_DIMS];
    int y_dims[MU_MAX_DIMS], y_strides[MU_MAX_DIMS];
} mu_kernel;

/* Keys a call. Returns NULL on success, else a short static reason why it has no key. */
const char *mu_kernel_from_descs(const mu_conv_descs *descs, mu_kernel *kernel);
/* Hash of (key, n), the plan table's and the kernel table's. */
uint64_t mu_kernel_hash(const char *key, int n);
/* Structural check of a key string (all fields, in order); on success *dir is its direction. */
const char *mu_key_check(const char *key, mu_direction *dir);

const char *mu_direction_name(mu_direction dir);
int mu_algo_count(mu_direction dir);
/* Name of an algorithm (docs/plan-format.md), "?" when out of range. */
const char *mu_algo_name(mu_direction dir, int algo);
/* Enum value of an algorithm name, -1 when unknown. */
int mu_algo_from_name(mu_direction dir, const char *name);
const char *mu_math_name(cudnnMathType_t math);
int mu_math_from_name(const char *name);
/* Packed element strides of dims (n, c, s1..sd) in NC(D)HW or, channels_last, N(D)HWC order.
 * False when one exceeds 64 bits (it and those it depends on are then LLONG_MAX). */
bool mu_packed_strides(int nb_dims, const int dims[], bool channels_last, long long strides[]);
/* Whether a tensor is packed in that order; dimensions of size 1 do not decide. */
bool mu_strides_packed(int nb_dims, const int dims[], const int strides[], bool channels_last);
/* Bytes of one element, 0 for data types without a key. */
size_t mu_dtype_size(cudnnDataType_t dtype);
/* The value of an alpha or beta (a double for double data, else a float), as cuDNN reads it. */
double mu_scale_value(const void *scale, cudnnDataType_t dtype);

/* ---- plan.c: the plan file (docs/plan-format.md) ------------------------------------------ */

#define MU_MAX_KNOBS 16
/* The plan-file suffix of a piece that borrows its output's unwritten part (mucudnn/plan.py). */
#define MU_BORROW_MARK "out"

/* A graph-API engine configuration: engine global index and knob choices (mucudnn/engines.py). */
typedef struct {
    int64_t global_index;
    int knob_count;
    int knob_types[MU_MAX_KNOBS];
    int64_t knob_values[MU_MAX_KNOBS];
} mu_engine;

typedef struct {
    int batch;
    int algo;             /* legacy algorithm, -1 for a graph-API engine piece */
    mu_engine *engine;    /* the engine configuration of a graph-API piece, else NULL */
    cudnnMathType_t math;
    bool borrow;          /* ":out": its workspace is the output's part the later pieces write */
} mu_piece;

struct mu_exec_cache;  /* exec.c */
struct mu_graph_cache; /* capture.c */
/* Where an owner keeps its CUDA graphs (capture.c). */
typedef _Atomic(struct mu_graph_cache *) mu_graph_owner;

typedef struct mu_plan_entry {
    char *key;
    mu_direction dir;
    int n;
    size_t workspace;
    double time_ms;
    int piece_count;
    mu_piece *pieces;
    uint64_t hash;
    bool has_engine_pieces; /* graph-API pieces: runs on the graph path only */
    bool has_borrow_pieces; /* pieces that borrow the output: run only with beta = 0 */
    struct mu_plan_entry *next_in_bucket;
    struct mu_plan_entry *next_point; /* front plans: the kernel's next point, more workspace */
    /* Run time state (the rest is immutable after loading). */
    _Atomic(struct mu_exec_cache *) cache; /* micro-batch descriptors, created on first use */
    /* Graph-API piece plans for legacy calls, one set per (handle, alpha, beta), built on first
     * use, a few at most (graph_pieces.c; under its mutex). */
    _Atomic(struct mu_g_legacy_pieces *) legacy_pieces;
    atomic_bool disabled;                   /* set when the plan failed where undivided cuDNN may not */
    mu_graph_owner graphs;                  /* its legacy pieces captured as CUDA graphs (capture.c) */
} mu_plan_entry;

typedef struct {
    char *path;
    char *gpu;
    long cudnn_version;
    char *strategy;
    bool front; /* strategy front: each kernel's lines are the points of its front */
    bool online; /* the online tuning file (online.c): legacy points only, so on the graph path each
                  * kernel's point is checked against the framework's engine before it runs */
    unsigned long long limit;
    char *policy;
    size_t entry_count;
    mu_plan_entry *entries;
    size_t bucket_mask;
    mu_plan_entry **buckets;
} mu_plan;

/* Loads and validates a plan file. NULL on error with "PATH:LINE: what" in error. */
mu_plan *mu_plan_load(const char *path, char *error, size_t error_size);
/* Frees a plan of mu_plan_load (NULL: nothing). */
void mu_plan_free(mu_plan *plan);
/* The entry for (key, n), NULL if none; in a front plan, its point of least workspace (the
 * others follow through next_point). */
mu_plan_entry *mu_plan_find(const mu_plan *plan, const char *key, int n, uint64_t hash);
/* Parses an engine name "eng<G>[.k<T>=<V>...]"; false when it is not one. */
bool mu_engine_parse(const char *name, mu_engine *engine);
/* Frees a plan mu_plan_load returned (nothing of it may be in use). */
void mu_plan_free(mu_plan *plan);
/* "4:implicit_gemm:fma 4:..." into buf (truncated with "..." when long). */
void mu_plan_pieces_text(const mu_plan_entry *entry, char *buf, size_t size);

/* ---- state.c: the process-wide configuration, set up once -------------------------------- */

typedef struct {
    bool disabled;             /* MUCUDNN_DISABLE: pure passthrough */
    mu_plan *plan;             /* NULL when none, malformed or refused */
    bool has_limit;
    size_t workspace_limit;
    bool has_hold;          /* MUCUDNN_WORKSPACE_HOLD: online tuning's soft limit (intercept_graph.c) */
    size_t workspace_hold;
} mu_state;

const mu_state *mu_config(void);
/* Name of the current (or first) GPU from the driver; false with the reason in name otherwise. */
bool mu_gpu_name(char *name, int size);
/* Before cudnnDestroy (intercept_legacy.c): drops every CUDA graph and graph-API piece plan made
 * with the handle (a later handle may get its address). */
void mu_forget_handle(cudnnHandle_t handle);

/* ---- record.c: kernels seen, the record file, the exit summary ---------------------------- */

typedef struct mu_seen {
    char *key;
    int n;
    uint64_t hash;
    atomic_ulong planned_calls;
    atomic_ulong passthrough_calls;
    atomic_bool first_call_logged;
    atomic_bool degraded; /* room.c: given a point of less workspace for lack of memory */
    atomic_bool room_refused; /* room.c: an engine of its refused at finalize for lack of memory */
    atomic_bool lean;         /* given a point of less workspace under MUCUDNN_WORKSPACE_SLACK */
    atomic_bool capped;       /* an engine of it held to MUCUDNN_WORKSPACE_LIMIT or _HOLD (said once) */
    atomic_bool lent;         /* lend.c: ran a point in lent workspace (said once) */
    struct mu_seen *_Atomic next_in_bucket;
    /* Online tuning (online.c): the kernel's measured front, published once complete. */
    _Atomic(struct mu_plan_entry *) online_head;
    atomic_int online_state;          /* online.c's mu_online_state */
    atomic_int online_reason;         /* why it has no front (online.c's reasons) */
    _Atomic long long online_retry_ms; /* claimed by another process: not before this time */
    atomic_bool online_counted;       /* counted in the exit report */
} mu_seen;

/* Opens MUCUDNN_RECORD and registers the summary, as the options say (state.c calls it). */
void mu_record_init(void);
/* The entry of a kernel, added (and recorded) on first sight. NULL only when out of memory. */
mu_seen *mu_seen_kernel(const mu_kernel *kernel);
/* Counts a call that had no key. */
void mu_count_unkeyed_call(void);
/* How many kernels the process ran or queried, and how many of them ran a plan (at exit). */
void mu_seen_totals(size_t *kernels, size_t *planned);

/* ---- exec.c: cudnnConvolution* with a plan ----------------------------------------------- */

/* One intercepted cudnnConvolution* call, in forward terms. */
typedef struct {
    mu_conv_descs descs;
    cudnnHandle_t handle;
    const void *alpha;
    const void *beta;
    void *x;   /* x (fwd, bwd_filter: read) or dx (bwd_data: written) */
    void *w;   /* w (fwd, bwd_data: read) or dw (bwd_filter: written) */
    void *y;   /* y (fwd: written) or dy (bwd_*: read) */
    int algo;  /* the caller's */
    void *workspace;
    size_t workspace_size;
    /* The execution plan's micro-batch pieces on the graph path (intercept_graph.c), else NULL:
     * only there can graph-API engine pieces run. */
    const struct mu_g_planned *graph;
    /* The graph path: the point to run rather than the graph plan's (one of a lent workspace,
     * which call->workspace is then: lend.c); NULL for the plan's. */
    struct mu_plan_entry *point;
} mu_conv_call;

/* The fastest point of the kernel whose entry is head that needs at most `available` bytes of
 * workspace, is not disabled, and (when asked) has deterministic legacy pieces; NULL if none. */
mu_plan_entry *mu_plan_point(mu_plan_entry *head, size_t available, bool deterministic);
/* `fastest`, or under MUCUDNN_WORKSPACE_SLACK the kernel's point of least workspace within that many
 * percent of its time (same rules of use as mu_plan_point). */
mu_plan_entry *mu_plan_lean_point(mu_plan_entry *head, mu_plan_entry *fastest, bool deterministic);
/* Whether every legacy piece's algorithm is deterministic (graph-API pieces are judged by their
 * engines once built: mu_g_plan_deterministic). */
bool mu_plan_legacy_deterministic(const mu_plan_entry *entry);
/* The body of every cudnnConvolution* wrapper. */
cudnnStatus_t mu_convolution(const mu_conv_call *call);
/* The same for a caller already inside the recursion guard (the graph API's executions). */
cudnnStatus_t mu_convolution_guarded(const mu_conv_call *call);
/* ---- lend.c: workspace a framework lends (mucudnn_lend_workspace) ------------------------- */

/* Notes an engine held under its workspace (the largest is what a lend can use: mucudnn_held_workspace). */
void mu_lend_note_held(size_t engine_workspace);
/* The lent buffer, where this thread lent one on the stream of `handle` of more than `more_than`
 * bytes; false otherwise (most calls: one relaxed load). */
bool mu_lent_workspace(cudnnHandle_t handle, size_t more_than, void **ptr, size_t *bytes);
/* Counts a call that ran `point` in lent workspace rather than `held` (info once per kernel). */
void mu_lend_count_call(mu_seen *seen, const struct mu_plan_entry *held, const struct mu_plan_entry *point);

/* ---- online.c: measuring kernels without a plan on first use (MUCUDNN_ONLINE) ------------- */

/* Reads the online options; with MUCUDNN_ONLINE=1 and no MUCUDNN_PLAN, returns the online plan
 * file of this GPU and cuDNN to use as the plan (NULL: none yet, or not usable: warned). Registers
 * the exit report. state.c calls it once. */
mu_plan *mu_online_init(bool have_plan);
/* The front of a kernel that has no plan entry: measured now (on this call's buffers, never
 * changing what the caller will read), read from the online file where another process measured
 * it, or NULL with the reason in *why (pass the call through). Legacy calls, and a graph-API
 * execution plan's first executions (the call built as its planned path builds it): the
 * measurement runs legacy algorithms on the legacy equivalent descriptors either way. */
mu_plan_entry *mu_online_head(const mu_conv_call *call, const mu_kernel *k, mu_seen *seen, const char **why);
/* Whether MUCUDNN_ONLINE is on (after mu_config). */
bool mu_online_on(void);
/* The kernel's front where this process already has one (measured, or read from the file where
 * another process measured it), NULL otherwise; one acquire load. */
mu_plan_entry *mu_online_front(mu_seen *seen);
/* Whether online tuning gave up on the kernel for this process (budget, nothing measurable, N too
 * large), as opposed to a kernel that may still get a front on a later call (claimed by another
 * process, measured by another thread, a stream being captured). */
bool mu_online_settled(mu_seen *seen);
/* Counts, for the exit report, a kernel that ran from the loaded plan (once per kernel). */
void mu_online_note_planned(mu_seen *seen);

/* ---- graph_pieces.c: graph-API pieces as exec.c runs them (the rest is in graph.h) ---------- */

/* The graph-API pieces of `entry` for a legacy call: execution plans built from
 * the call's descriptors on first use. NULL, with the reason in *why, when they cannot be; else
 * held for the caller until mu_g_pieces_release. */
const struct mu_g_planned *mu_g_pieces_for_legacy(mu_plan_entry *entry, const mu_kernel *k,
                                                  const mu_conv_call *call, const char **why);
/* Gives back what mu_g_pieces_for_legacy returned, once its pieces have run. */
void mu_g_pieces_release(const struct mu_g_planned *planned);
/* Destroys the legacy calls' piece plans built with the handle. */
void mu_g_legacy_forget_handle(cudnnHandle_t handle);
/* Whether every piece of the entry gives the same bits on every run (legacy pieces by their
 * algorithm, graph-API pieces by their engine's notes, known once built in planned; NULL:
 * none built, so graph-API pieces count as non-deterministic). */
bool mu_g_plan_deterministic(const mu_plan_entry *entry, const struct mu_g_planned *planned);
/* The point of its kernel's plan a planned execution plan runs (chosen when it was finalized). */
mu_plan_entry *mu_g_planned_entry(const struct mu_g_planned *planned);
/* The CUDA graphs of a planned execution plan's pieces. */
mu_graph_owner *mu_g_graphs_of(const struct mu_g_planned *planned);
/* Runs graph-API piece `index` of a planned execution plan on these slices. */
cudnnStatus_t mu_g_run_engine_piece(const struct mu_g_planned *planned, cudnnHandle_t handle, int index,
                                    void *x, void *w, void *y, void *workspace);
/* The workspace graph-API piece `index` needs (0 if there is no such piece). */
size_t mu_g_piece_workspace(const struct mu_g_planned *planned, int index);

/* ---- capture.c: a plan's pieces as one CUDA graph ----------------------------------------- */

/* What a captured graph bakes in: a call with other values needs another graph. The handle and
 * the CUDA context are part of it (a graph never runs for another handle or device). */
typedef struct {
    uintptr_t handle, context; /* context: filled in by mu_run_captured */
    uintptr_t x, w, y, workspace;
    uint64_t workspace_size;
    double alpha, beta;
    uintptr_t entry; /* the point: one plan's calls may run several (lent workspace: lend.c) */
} mu_capture_key;

/* How many graphs (sets of pointers) one owner keeps. */
#define MU_GRAPHS_PER_ENTRY 4

/* Where an owner keeps its graphs: created on first use, destroyed with mu_graphs_release. A
 * graph's owner is what it captured: the plan entry (legacy pieces, whose descriptors live as
 * long as the plan), or the graph-API piece plans it launched (mu_g_planned), so that it is
 * destroyed with them. mu_graph_owner is declared with mu_plan_entry above. */

/* Runs a plan's pieces on the handle's stream, whatever that stream is. */
typedef cudnnStatus_t (*mu_pieces_fn)(void *context);

/* run(context) as a CUDA graph of owner's, launched on the handle's stream (captured on the
 * owner's second call with this key), or directly where graphs cannot be used. */
cudnnStatus_t mu_run_captured(const mu_plan_entry *entry, mu_graph_owner *owner, cudnnHandle_t handle,
                              const mu_capture_key *key, mu_pieces_fn run, void *context);
/* Destroys the owner's graphs (their launches already made complete first, as CUDA does). */
void mu_graphs_release(mu_graph_owner *owner);
/* Destroys every graph captured with the handle, whatever its owner. */
void mu_graphs_forget_handle(cudnnHandle_t handle);

/* ---- query.c: algorithm queries, workspace sizes, the workspace limit ---------------------- */

/* Layout shared by cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t (static-asserted). */
typedef struct {
    int algo;
    cudnnStatus_t status;
    float time;
    size_t memory;
    cudnnDeterminism_t determinism;
    cudnnMathType_t mathType;
    int reserved[3];
} mu_perf;

#define MU_MAX_PERF 64

typedef enum { MU_QUERY_GET_V7, MU_QUERY_FIND, MU_QUERY_FIND_EX } mu_query_kind;

/* One intercepted Get_v7/Find/FindEx or Get*WorkspaceSize call, in forward terms. */
typedef struct mu_query {
    mu_conv_descs descs;
    cudnnHandle_t handle;
    mu_query_kind kind;
    const char *function;   /* for messages */
    mu_conv_buffers buffers; /* FindEx: the caller's tensors */
    void *workspace;         /* FindEx: the caller's workspace, the most any result may use */
    size_t workspace_size;
} mu_query;

/* The body of every Get_v7/Find/FindEx wrapper; perf is the caller's typed results array. */
cudnnStatus_t mu_algorithm_query(const mu_query *q, int requested, int *returned, void *perf);
/* The body of every cudnnGet*WorkspaceSize wrapper. */
cudnnStatus_t mu_workspace_size_query(const mu_query *q, int algo, size_t *size);
/* The algorithm a query reports for a plan: one real cuDNN runs undivided within the plan's
 * workspace (and deterministic when asked), -1 if none. The only algorithm whose workspace size
 * the shim reports as the plan's. */
int mu_plan_algo(cudnnHandle_t handle, const mu_conv_descs *descs, const mu_plan_entry *entry);

/* ---- room.c: the workspace a convolution may take now (SuperNeurons' rule) ----------------- */

typedef struct {
    size_t bytes;       /* what one workspace may take now */
    size_t free_bytes;  /* the device's free memory (cuMemGetInfo), plus cached_bytes */
    size_t cached_bytes;/* held free by the framework's caching allocator (mucudnn_set_allocator) */
    bool allocator_known; /* the framework's allocator said what it holds and uses */
    size_t budget_left; /* MUCUDNN_MEMORY_BUDGET less what is in use; SIZE_MAX without a budget */
    size_t margin;      /* MUCUDNN_ROOM_MARGIN, kept back from both */
} mu_room_info;

/* The room: the device's free memory and, with MUCUDNN_MEMORY_BUDGET, the budget less what is in
 * use, whichever is less, less the margin. Where the framework's allocator is registered
 * (mucudnn_set_allocator), what it holds free counts as free, and the budget is its own (what
 * `mucudnn run --memory-budget` limits it to): in use is what it has allocated. Otherwise in use is
 * all the device does not have free (total - free). False (no room limit) when it cannot be known
 * (no driver, no current context) or with MUCUDNN_ROOM=0. The framework's allocator is asked
 * only where the device's view leaves less than `need` bytes (its view is never smaller). */
bool mu_room(mu_room_info *room, size_t need);
/* The point of head's kernel to choose instead of `chosen` (the fastest the framework's workspace
 * and the hard limit allow, deterministic when asked): chosen when it fits the room or the room is
 * unknown, else the fastest point within the room, else the smallest point. Never more workspace
 * than chosen. A degraded choice is logged (once per kernel at info) and counted. */
mu_plan_entry *mu_room_point(mu_plan_entry *head, mu_plan_entry *chosen, bool deterministic,
                             const mu_kernel *k, mu_seen *seen);
/* Counts a kernel (once) whose query put a point of less workspace first for lack of memory. */
void mu_room_note_degraded(mu_seen *seen, const mu_kernel *k, size_t from, size_t to, const mu_room_info *room);
/* How many kernels were degraded so far (the exit report). */
size_t mu_room_degraded_kernels(void);
/* Whether an execution plan that runs its engine undivided, needing `workspace` bytes, is to be
 * refused at finalize for lack of memory: more than the room (never an engine of no workspace;
 * never when the room is unknown). A refusal is logged (once per kernel at info) and counted. k
 * and seen may be NULL (a graph without a kernel key: named by the plan's address). */
bool mu_room_refuses(size_t workspace, const mu_kernel *k, mu_seen *seen, const void *plan);
/* How many kernels had an engine refused so far (the exit report). */
size_t mu_room_refused_kernels(void);

/* ---- directions.c: the real cuDNN functions of each direction, in forward terms ------------ */

typedef struct {
    unsigned nondeterministic_algos; /* bit a: cuDNN documents algorithm a as non-deterministic */
    cudnnStatus_t (*workspace_size)(cudnnHandle_t handle, const mu_conv_descs *descs, int algo, size_t *size);
    cudnnStatus_t (*run)(cudnnHandle_t handle, const mu_conv_descs *descs, const mu_conv_buffers *buffers,
                         int algo, const void *alpha, const void *beta, void *workspace, size_t workspace_size);
    /* Get_v7, Find or FindEx (q->kind) with q's arguments and this count and results array. */
    cudnnStatus_t (*query)(const mu_query *q, int requested, int *returned, void *perf);
} mu_direction_ops;

const mu_direction_ops *mu_dir(mu_direction dir);
/* Whether cuDNN's legacy algorithm gives the same bits on every run. */
bool mu_algo_deterministic(mu_direction dir, int algo);
cudnnStatus_t mu_workspace_of(cudnnHandle_t handle, const mu_conv_descs *descs, int algo, size_t *size);
/* Whether cuDNN can run the algorithm undivided within bytes of workspace. */
bool mu_runs_within(cudnnHandle_t handle, const mu_conv_descs *descs, int algo, size_t bytes);
/* The first algorithm (enum order: the workspace-free ones come first) that real cuDNN runs
 * undivided within bytes (and deterministic, when asked); -1 if none. */
int mu_first_algo_within(cudnnHandle_t handle, const mu_conv_descs *descs, size_t bytes, bool deterministic);
/* cuDNN's heuristics' first algorithm (cudnnGet*Algorithm_v7) that runs within bytes, else
 * mu_first_algo_within's. */
int mu_best_algo_within(cudnnHandle_t handle, const mu_conv_descs *descs, size_t bytes, bool deterministic);


#endif /* MUCUDNN_INTERNAL_H */

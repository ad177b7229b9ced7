/*
 * A fake CUDA driver (libcuda.so.1) with the few calls the mucudnn shim uses to learn which GPU
 * it runs on: one device, ordinal 0, named "mucudnn fake GPU" or $FAKE_CUDNN_GPU_NAME; and, with
 * $FAKE_CUDA_GRAPHS, stream capture and graph launches over the cuDNN double (below).
 * Prototypes come from the CUDA toolkit's cuda.h so they cannot drift from the real driver.
 */
#define _POSIX_C_SOURCE 200809L

#include <cuda.h>

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const char DEFAULT_GPU_NAME[] = "mucudnn fake GPU";
enum { FAKE_DRIVER_VERSION = 13000 };

static const char *gpu_name(void)
{
    const char *name = getenv("FAKE_CUDNN_GPU_NAME");
    return name != NULL && name[0] != '\0' ? name : DEFAULT_GPU_NAME;
}

CUresult cuInit(unsigned int Flags)
{
    return Flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuDriverGetVersion(int *driverVersion)
{
    if (driverVersion == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = FAKE_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count)
{
    if (count == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *count = 1;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    if (device == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device)
{
    if (device == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *device = 0; /* as if the primary context of device 0 were current */
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    if (name == NULL || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    /* Like the driver: truncate to len - 1 characters, always terminate. */
    size_t capacity = (size_t)len - 1;
    size_t length = strlen(gpu_name());
    size_t copied = length < capacity ? length : capacity;
    memcpy(name, gpu_name(), copied);
    name[copied] = '\0';
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    if (pStr == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS:
        *pStr = "no error";
        return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE:
        *pStr = "invalid argument";
        return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_DEVICE:
        *pStr = "invalid device ordinal";
        return CUDA_SUCCESS;
    default:
        *pStr = NULL;
        return CUDA_ERROR_INVALID_VALUE;
    }
}

/* ---- stream capture and graphs, when $FAKE_CUDA_GRAPHS is set -------------------------------
 *
 * The double runs every convolution on the host at call time, so a capture here is a list of
 * deferred calls: while a stream of this driver captures, the cuDNN double hands each convolution
 * it would run on that stream to fake_cuda_defer (it finds it with dlopen/dlsym) instead of
 * running it, and cuGraphLaunch runs the list in order, as a GPU would run a captured graph.
 * Without $FAKE_CUDA_GRAPHS, cuStreamBeginCapture answers CUDA_ERROR_NOT_SUPPORTED.
 * $FAKE_CUDA_GRAPHS=invalidate: every capture ends with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED.
 * $FAKE_CUDA_CALLER_CAPTURING=1: streams this driver did not create report an active capture (a
 * framework capturing its own stream); =implicit: asking about them fails with
 * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, as the driver answers for the legacy stream while a blocking
 * stream captures.
 */
#include <pthread.h>
#include <stdio.h>

typedef struct deferred {
    void (*run)(void *);
    void *argument;
    struct deferred *next;
} deferred;

struct fake_stream {
    unsigned magic;
    bool capturing;
    deferred *head, **tail;
};

struct fake_graph {
    deferred *head; /* owned */
};

enum { STREAM_MAGIC = 0x5743a11u };
static pthread_mutex_t capture_mutex = PTHREAD_MUTEX_INITIALIZER;
static char fake_context;

/* One line in the cuDNN double's call log ($FAKE_CUDNN_LOG), in its format: NAME fields status=S. */
static void log_call(const char *name, CUresult result, const char *format, uintptr_t a, uintptr_t b)
{
    const char *path = getenv("FAKE_CUDNN_LOG");
    if (path == NULL || path[0] == '\0')
        return;
    FILE *log = fopen(path, "a");
    if (log == NULL)
        return;
    fprintf(log, "%s ", name);
    fprintf(log, format, a, b);
    fprintf(log, " status=%d\n", (int)result);
    fclose(log);
}

static bool graphs_enabled(void)
{
    const char *value = getenv("FAKE_CUDA_GRAPHS");
    return value != NULL && value[0] != '\0';
}

static struct fake_stream *own_stream(CUstream stream)
{
    struct fake_stream *s = (struct fake_stream *)stream;
    /* Only this driver's streams are dereferenced: the caller's are PyTorch-style handles or 0. */
    return s != NULL && (uintptr_t)s > 4096 && s->magic == STREAM_MAGIC ? s : NULL;
}

static void free_list(deferred *item)
{
    while (item != NULL) {
        deferred *next = item->next;
        free(item->argument);
        free(item);
        item = next;
    }
}

CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    if (pctx == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    const char *none = getenv("FAKE_CUDA_NO_CONTEXT");
    *pctx = none != NULL && strcmp(none, "1") == 0 ? NULL : (CUcontext)&fake_context;
    return CUDA_SUCCESS;
}

/* Streams are never freed: a test process makes a handful, and the magic must stay readable. */
CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    (void)Flags;
    struct fake_stream *s = calloc(1, sizeof *s);
    if (phStream == NULL || s == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    s->magic = STREAM_MAGIC;
    s->tail = &s->head;
    *phStream = (CUstream)s;
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    if (captureStatus == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    const char *caller = getenv("FAKE_CUDA_CALLER_CAPTURING");
    pthread_mutex_lock(&capture_mutex);
    struct fake_stream *s = own_stream(hStream);
    bool active = s != NULL ? s->capturing : caller != NULL && caller[0] == '1';
    pthread_mutex_unlock(&capture_mutex);
    if (s == NULL && caller != NULL && strcmp(caller, "implicit") == 0)
        return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    *captureStatus = active ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

CUresult cuStreamBeginCapture(CUstream hStream, CUstreamCaptureMode mode)
{
    (void)mode;
    if (!graphs_enabled())
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&capture_mutex);
    struct fake_stream *s = own_stream(hStream);
    CUresult result = s == NULL || s->capturing ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (result == CUDA_SUCCESS)
        s->capturing = true, s->head = NULL, s->tail = &s->head;
    pthread_mutex_unlock(&capture_mutex);
    log_call("cuStreamBeginCapture", result, "stream=0x%lx mode=%lu", (uintptr_t)hStream, (uintptr_t)mode);
    return result;
}

CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    if (phGraph == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    *phGraph = NULL;
    pthread_mutex_lock(&capture_mutex);
    struct fake_stream *s = own_stream(hStream);
    if (s == NULL || !s->capturing) {
        pthread_mutex_unlock(&capture_mutex);
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    deferred *list = s->head;
    s->capturing = false, s->head = NULL, s->tail = &s->head;
    pthread_mutex_unlock(&capture_mutex);
    const char *mode = getenv("FAKE_CUDA_GRAPHS");
    struct fake_graph *graph = calloc(1, sizeof *graph);
    if (graph == NULL || (mode != NULL && strcmp(mode, "invalidate") == 0)) {
        free(graph);
        free_list(list);
        log_call("cuStreamEndCapture", CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "stream=0x%lx graph=0x%lx",
                 (uintptr_t)hStream, 0);
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    graph->head = list;
    *phGraph = (CUgraph)graph;
    log_call("cuStreamEndCapture", CUDA_SUCCESS, "stream=0x%lx graph=0x%lx", (uintptr_t)hStream,
             (uintptr_t)graph);
    return CUDA_SUCCESS;
}

/* An executable graph takes the graph's list (the graph is then empty and can be destroyed). */
CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    (void)flags;
    struct fake_graph *graph = (struct fake_graph *)hGraph, *exec = calloc(1, sizeof *exec);
    if (phGraphExec == NULL || graph == NULL || exec == NULL) {
        free(exec);
        return CUDA_ERROR_INVALID_VALUE;
    }
    exec->head = graph->head;
    graph->head = NULL;
    *phGraphExec = (CUgraphExec)exec;
    return CUDA_SUCCESS;
}

CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    (void)hStream;
    struct fake_graph *exec = (struct fake_graph *)hGraphExec;
    if (exec == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    int calls = 0;
    for (deferred *item = exec->head; item != NULL; item = item->next, calls++)
        item->run(item->argument);
    log_call("cuGraphLaunch", CUDA_SUCCESS, "stream=0x%lx calls=%lu", (uintptr_t)hStream, (uintptr_t)calls);
    return CUDA_SUCCESS;
}

CUresult cuGraphDestroy(CUgraph hGraph)
{
    struct fake_graph *graph = (struct fake_graph *)hGraph;
    if (graph == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    free_list(graph->head);
    free(graph);
    return CUDA_SUCCESS;
}

CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    CUresult result = cuGraphDestroy((CUgraph)hGraphExec);
    log_call("cuGraphExecDestroy", result, "exec=0x%lx%.0lu", (uintptr_t)hGraphExec, 0);
    return result;
}

/* For the cuDNN double: 1 (and `argument`, `size` bytes, copied) when `stream` is capturing, so
 * run(copy) belongs to the captured graph; 0 when the caller should run it now. */
__attribute__((visibility("default"))) int fake_cuda_defer(void *stream, void (*run)(void *),
                                                           const void *argument, size_t size)
{
    pthread_mutex_lock(&capture_mutex);
    struct fake_stream *s = own_stream((CUstream)stream);
    if (s == NULL || !s->capturing) {
        pthread_mutex_unlock(&capture_mutex);
        return 0;
    }
    deferred *item = calloc(1, sizeof *item);
    void *copy = malloc(size);
    if (item == NULL || copy == NULL) {
        pthread_mutex_unlock(&capture_mutex);
        free(item), free(copy);
        return 0;
    }
    memcpy(copy, argument, size);
    *item = (deferred){.run = run, .argument = copy};
    *s->tail = item;
    s->tail = &item->next;
    pthread_mutex_unlock(&capture_mutex);
    return 1;
}

/* ---- device memory and events ----------------------------------------------------------------
 *
 * Memory: $FAKE_CUDA_TOTAL_BYTES (default 80 GiB) of device memory, of which $FAKE_CUDA_USED_BYTES
 * (default 0) is taken by others; cuMemAlloc hands out host memory (the double computes on the
 * host) and fails with CUDA_ERROR_OUT_OF_MEMORY past what is free. cuMemGetInfo answers only with
 * a current context, as the driver does ($FAKE_CUDA_NO_CONTEXT=1: none).
 * Time: a fake clock in milliseconds that the cuDNN double advances by its modelled time of each
 * convolution it runs (fake_cuda_advance_ms, found with dlsym); events record the clock.
 */
static pthread_mutex_t memory_mutex = PTHREAD_MUTEX_INITIALIZER;
static size_t allocated_bytes;
static double clock_ms;

static size_t env_bytes(const char *name, size_t fallback)
{
    const char *text = getenv(name);
    return text != NULL && text[0] != '\0' ? (size_t)strtoull(text, NULL, 10) : fallback;
}

static size_t total_bytes(void) { return env_bytes("FAKE_CUDA_TOTAL_BYTES", (size_t)80 << 30); }

static size_t free_bytes_locked(void)
{
    size_t taken = env_bytes("FAKE_CUDA_USED_BYTES", 0) + allocated_bytes;
    return taken < total_bytes() ? total_bytes() - taken : 0;
}

CUresult cuCtxGetCurrent(CUcontext *pctx);

CUresult cuMemGetInfo(size_t *free, size_t *total)
{
    CUcontext context = NULL;
    if (free == NULL || total == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (cuCtxGetCurrent(&context) != CUDA_SUCCESS || context == NULL)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&memory_mutex);
    *free = free_bytes_locked();
    *total = total_bytes();
    pthread_mutex_unlock(&memory_mutex);
    return CUDA_SUCCESS;
}

/* Each block remembers its size in front of it, so that cuMemFree can give it back. */
CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytesize)
{
    if (dptr == NULL || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&memory_mutex);
    bool fits = bytesize <= free_bytes_locked();
    if (fits)
        allocated_bytes += bytesize;
    pthread_mutex_unlock(&memory_mutex);
    size_t *block = fits ? malloc(bytesize + 16) : NULL;
    if (block == NULL) {
        if (fits) {
            pthread_mutex_lock(&memory_mutex);
            allocated_bytes -= bytesize;
            pthread_mutex_unlock(&memory_mutex);
        }
        log_call("cuMemAlloc", CUDA_ERROR_OUT_OF_MEMORY, "bytes=%zu", bytesize, 0);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    block[0] = bytesize;
    *dptr = (CUdeviceptr)(uintptr_t)((char *)block + 16);
    log_call("cuMemAlloc", CUDA_SUCCESS, "bytes=%zu", bytesize, 0);
    return CUDA_SUCCESS;
}

CUresult cuMemFree(CUdeviceptr dptr)
{
    if (dptr == 0)
        return CUDA_ERROR_INVALID_VALUE;
    size_t *block = (size_t *)(void *)((char *)(uintptr_t)dptr - 16);
    pthread_mutex_lock(&memory_mutex);
    allocated_bytes -= block[0];
    pthread_mutex_unlock(&memory_mutex);
    log_call("cuMemFree", CUDA_SUCCESS, "bytes=%zu", block[0], 0);
    free(block);
    return CUDA_SUCCESS;
}

__attribute__((visibility("default"))) void fake_cuda_advance_ms(double ms)
{
    pthread_mutex_lock(&memory_mutex);
    clock_ms += ms;
    pthread_mutex_unlock(&memory_mutex);
}

struct fake_event {
    double at_ms;
    bool recorded;
};

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    (void)Flags;
    if (phEvent == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    struct fake_event *event = calloc(1, sizeof *event);
    if (event == NULL)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *phEvent = (CUevent)(void *)event;
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
    (void)hStream;
    if (hEvent == NULL)
        return CUDA_ERROR_INVALID_HANDLE;
    struct fake_event *event = (struct fake_event *)(void *)hEvent;
    pthread_mutex_lock(&memory_mutex);
    event->at_ms = clock_ms;
    event->recorded = true;
    pthread_mutex_unlock(&memory_mutex);
    return CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent hEvent) { return hEvent != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }

CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    struct fake_event *start = (struct fake_event *)(void *)hStart, *end = (struct fake_event *)(void *)hEnd;
    if (pMilliseconds == NULL || start == NULL || end == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (!start->recorded || !end->recorded)
        return CUDA_ERROR_NOT_READY;
    *pMilliseconds = (float)(end->at_ms - start->at_ms);
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy(CUevent hEvent)
{
    if (hEvent == NULL)
        return CUDA_ERROR_INVALID_HANDLE;
    free((void *)hEvent);
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream hStream)
{
    (void)hStream;
    return CUDA_SUCCESS;
}

/*
 * driver.c: the CUDA driver API, resolved once from the libcuda.so.1 that the CUDA runtime
 * already loaded (never loaded here: a process without CUDA, such as one on the cuDNN test double
 * without its fake driver, simply has no driver). The shim has no build dependency on cuda.h; the
 * few types it needs are declared in internal.h. Versioned names (_v2) are the ones cuda.h maps
 * the plain names to.
 */
#include <dlfcn.h>
#include <pthread.h>

#include "internal.h"

static mu_driver_table driver;
static bool driver_loaded;

static void *loaded(const char *const names[]) {
    for (; *names != NULL; names++) {
        void *handle = dlopen(*names, RTLD_LAZY | RTLD_NOLOAD);
        if (handle != NULL) return handle;
    }
    return NULL;
}

static void resolve(void) {
    static const char *const cuda[] = {"libcuda.so.1", "libcuda.so", NULL};
    static const char *const cudart[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so", NULL};
    void *lib = loaded(cuda);
    if (lib == NULL) return;
    driver_loaded = true;
#define MU_DRIVER(field, symbol) *(void **)&driver.field = dlsym(lib, symbol)
    MU_DRIVER(ctx_get_current, "cuCtxGetCurrent");
    MU_DRIVER(stream_create, "cuStreamCreate");
    MU_DRIVER(stream_is_capturing, "cuStreamIsCapturing");
    MU_DRIVER(stream_synchronize, "cuStreamSynchronize");
    MU_DRIVER(begin_capture, "cuStreamBeginCapture_v2");
    MU_DRIVER(end_capture, "cuStreamEndCapture");
    MU_DRIVER(instantiate, "cuGraphInstantiateWithFlags");
    MU_DRIVER(launch, "cuGraphLaunch");
    MU_DRIVER(exec_destroy, "cuGraphExecDestroy");
    MU_DRIVER(graph_destroy, "cuGraphDestroy");
    MU_DRIVER(mem_get_info, "cuMemGetInfo_v2");
    MU_DRIVER(mem_alloc, "cuMemAlloc_v2");
    MU_DRIVER(mem_free, "cuMemFree_v2");
    MU_DRIVER(event_create, "cuEventCreate");
    MU_DRIVER(event_record, "cuEventRecord");
    MU_DRIVER(event_synchronize, "cuEventSynchronize");
    /* cuda.h 12.8+ maps cuEventElapsedTime to _v2 (same arguments); older drivers have only the first. */
    MU_DRIVER(event_elapsed_time, "cuEventElapsedTime_v2");
    if (driver.event_elapsed_time == NULL) MU_DRIVER(event_elapsed_time, "cuEventElapsedTime");
    MU_DRIVER(event_destroy, "cuEventDestroy_v2");
#undef MU_DRIVER
    void *runtime = loaded(cudart);
    if (runtime == NULL) runtime = RTLD_DEFAULT;
    *(void **)&driver.runtime_get_last_error = dlsym(runtime, "cudaGetLastError");
}

const mu_driver_table *mu_driver(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, resolve);
    return driver_loaded ? &driver : NULL;
}

bool mu_device_memory(size_t *free_bytes, size_t *total_bytes) {
    const mu_driver_table *d = mu_driver();
    CUcontext context = NULL;
    /* cuMemGetInfo needs a current context: without one the process has allocated nothing yet. */
    if (d == NULL || d->mem_get_info == NULL || d->ctx_get_current == NULL ||
        d->ctx_get_current(&context) != CU_SUCCESS || context == NULL)
        return false;
    return d->mem_get_info(free_bytes, total_bytes) == CU_SUCCESS;
}

bool mu_stream_capturing(cudnnHandle_t handle) {
    const mu_driver_table *d = mu_driver();
    CUstream stream = NULL;
    int capturing = CU_STREAM_CAPTURE_STATUS_NONE;
    if (d == NULL || d->stream_is_capturing == NULL ||
        mu_real()->cudnnGetStream(handle, (cudaStream_t *)&stream) != CUDNN_STATUS_SUCCESS)
        return false;
    return d->stream_is_capturing(stream, &capturing) != CU_SUCCESS || capturing != CU_STREAM_CAPTURE_STATUS_NONE;
}

double mu_time_calls(cudnnHandle_t handle, mu_timed_fn call, void *context) {
    const mu_driver_table *d = mu_driver();
    if (d == NULL || !d->event_create || !d->event_record || !d->event_synchronize || !d->event_elapsed_time ||
        !d->event_destroy)
        return -1;
    CUstream stream = NULL;
    CUevent start = NULL, end = NULL;
    double ms = -1;
    cudnnStatus_t status = mu_real()->cudnnGetStream(handle, (cudaStream_t *)&stream);
    if (status == CUDNN_STATUS_SUCCESS && d->event_create(&start, CU_EVENT_DEFAULT) == CU_SUCCESS &&
        d->event_create(&end, CU_EVENT_DEFAULT) == CU_SUCCESS &&
        call(context) == CUDNN_STATUS_SUCCESS /* the warm-up */ && d->event_record(start, stream) == CU_SUCCESS) {
        for (int r = 0; r < MU_TIMED_RUNS && status == CUDNN_STATUS_SUCCESS; r++) status = call(context);
        float elapsed = 0;
        if (status == CUDNN_STATUS_SUCCESS && d->event_record(end, stream) == CU_SUCCESS &&
            d->event_synchronize(end) == CU_SUCCESS && d->event_elapsed_time(&elapsed, start, end) == CU_SUCCESS)
            ms = (double)elapsed / MU_TIMED_RUNS;
    }
    if (start != NULL) d->event_destroy(start);
    if (end != NULL) d->event_destroy(end);
    return ms;
}

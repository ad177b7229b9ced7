/*
 * state.c: the process-wide configuration, set up once on the first intercepted call: options,
 * record file, plan file and the check that the plan was made for this GPU and cuDNN.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static mu_state state;
static pthread_once_t state_once = PTHREAD_ONCE_INIT;

/* The driver API, through dlopen: the shim links nothing of CUDA. CUresult and CUdevice are int. */
typedef int (*cu_init_fn)(unsigned int flags);
typedef int (*cu_ctx_get_device_fn)(int *device);
typedef int (*cu_device_get_fn)(int *device, int ordinal);
typedef int (*cu_device_get_name_fn)(char *name, int length, int device);

/* Name of the current (or first) GPU; false with the reason in name when it cannot be known. */
bool mu_gpu_name(char *name, int size) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (cuda == NULL) {
        snprintf(name, (size_t)size, "cannot load libcuda.so.1: %s", dlerror());
        return false;
    }
    cu_init_fn cu_init = (cu_init_fn)dlsym(cuda, "cuInit");
    cu_ctx_get_device_fn cu_ctx_get_device = (cu_ctx_get_device_fn)dlsym(cuda, "cuCtxGetDevice");
    cu_device_get_fn cu_device_get = (cu_device_get_fn)dlsym(cuda, "cuDeviceGet");
    cu_device_get_name_fn cu_device_get_name = (cu_device_get_name_fn)dlsym(cuda, "cuDeviceGetName");
    int device = 0;
    bool ok = cu_init != NULL && cu_device_get_name != NULL && cu_init(0) == 0;
    if (ok && (cu_ctx_get_device == NULL || cu_ctx_get_device(&device) != 0)) {
        device = 0; /* no current context: the first device */
        if (cu_device_get != NULL && cu_device_get(&device, 0) != 0) device = 0;
    }
    ok = ok && cu_device_get_name(name, size, device) == 0;
    if (!ok) snprintf(name, (size_t)size, "the CUDA driver did not report a device name");
    /* libcuda stays loaded: unloading a driver library inside a CUDA process is asking for trouble. */
    return ok;
}

/* Refuses a plan measured on another GPU or cuDNN (the algorithms and timings would not hold). */
static bool plan_matches_process(const mu_plan *plan) {
    char gpu[256];
    if (!mu_gpu_name(gpu, sizeof gpu)) {
        mu_log(MU_LOG_ERROR, "%s: cannot check the plan's gpu '%s' (%s); passing every call through",
               plan->path, plan->gpu, gpu);
        return false;
    }
    if (strcmp(gpu, plan->gpu) != 0) {
        mu_log(MU_LOG_ERROR, "%s: plan is for gpu '%s' but this process runs on '%s'; passing every "
               "call through", plan->path, plan->gpu, gpu);
        return false;
    }
    const mu_real_table *real = mu_real();
    long version = real->cudnnGetVersion ? (long)real->cudnnGetVersion() : -1;
    if (version != plan->cudnn_version) {
        mu_log(MU_LOG_ERROR, "%s: plan is for cudnn %ld but this process runs cudnn %ld; passing "
               "every call through", plan->path, plan->cudnn_version, version);
        return false;
    }
    return true;
}

/* Why MUCUDNN_PLAN was not used ("" when it was), said again at exit: the load-time line may be
 * long scrolled away when a run ends having planned nothing. */
static char plan_refusal[160];

/* At exit, one line when a plan was given and did nothing: refused, or none of the process's
 * kernels in it; one line when memory pressure degraded kernels to points of less workspace. */
static void report_plan_use(void) {
    const char *path = mu_option_path(MU_OPT_PLAN);
    size_t degraded = mu_room_degraded_kernels();
    if (degraded > 0)
        mu_log(MU_LOG_INFO, "%zu kernels got a front point of less workspace for lack of free memory "
               "(room: MUCUDNN_ROOM_MARGIN, MUCUDNN_MEMORY_BUDGET)", degraded);
    if (plan_refusal[0] != '\0') {
        mu_log(MU_LOG_WARNING, "the plan %s was not used (%s): every call passed through", path, plan_refusal);
        return;
    }
    size_t kernels = 0, planned = 0;
    mu_seen_totals(&kernels, &planned);
    if (state.plan != NULL && kernels > 0 && planned == 0)
        mu_log(MU_LOG_WARNING, "the plan %s ran none of the %zu kernels this process ran (their keys or N "
               "are not in it, or their calls could not use it): every call passed through", path, kernels);
}

static mu_plan *load_plan(const char *path) {
    char error[1024];
    atexit(report_plan_use);
    mu_plan *plan = mu_plan_load(path, error, sizeof error);
    if (plan == NULL) {
        mu_log(MU_LOG_ERROR, "%s; passing every call through", error);
        snprintf(plan_refusal, sizeof plan_refusal, "malformed: see the error above");
        return NULL;
    }
    if (!plan_matches_process(plan)) { /* kept allocated: nothing else to free it for */
        snprintf(plan_refusal, sizeof plan_refusal, "refused for this process: see the error above");
        return NULL;
    }
    mu_log(MU_LOG_INFO, "loaded plan %s: %zu kernel plans (gpu '%s', cudnn %ld, strategy %s, "
           "limit %llu, policy %s)", path, plan->entry_count, plan->gpu, plan->cudnn_version,
           plan->strategy, plan->limit, plan->policy);
    return plan;
}

static void init_state(void) {
    mu_options_init();
    mu_options_log();
    state.disabled = mu_option_int(MU_OPT_DISABLE) != 0;
    if (state.disabled) {
        mu_log(MU_LOG_INFO, "MUCUDNN_DISABLE is set: passing every call through");
        return;
    }
    long long limit = mu_option_int(MU_OPT_WORKSPACE_LIMIT);
    state.has_limit = limit >= 0;
    state.workspace_limit = state.has_limit ? (size_t)limit : 0;
    mu_record_init();
    bool have_plan = mu_option_path(MU_OPT_PLAN) != NULL;
    if (have_plan) state.plan = load_plan(mu_option_path(MU_OPT_PLAN));
    mu_plan *online = mu_online_init(have_plan);
    if (online != NULL) state.plan = online;
}

const mu_state *mu_config(void) {
    pthread_once(&state_once, init_state);
    return &state;
}

void mu_forget_handle(cudnnHandle_t handle) {
    mu_graphs_forget_handle(handle);
    mu_g_legacy_forget_handle(handle);
}

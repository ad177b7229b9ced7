/*
 * state.c: the process-wide configuration, set up once on the first intercepted call: options,
 * record file, plan file (or the one of several made for this GPU and cuDNN) and the check that
 * the plan was made for this GPU and cuDNN.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

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

/* The GPU and cuDNN a plan must have been made for: this process's. */
typedef struct {
    bool gpu_known;
    char gpu[256]; /* its name, or why it is not known */
    long cudnn_version;
} process_identity;

static void identify_process(process_identity *id) {
    id->gpu_known = mu_gpu_name(id->gpu, sizeof id->gpu);
    const mu_real_table *real = mu_real();
    id->cudnn_version = real->cudnnGetVersion ? (long)real->cudnnGetVersion() : -1;
}

static bool plan_is_for(const mu_plan *plan, const process_identity *id) {
    return id->gpu_known && strcmp(id->gpu, plan->gpu) == 0 && id->cudnn_version == plan->cudnn_version;
}

/* Refuses a plan measured on another GPU or cuDNN (the algorithms and timings would not hold). */
static bool plan_matches_process(const mu_plan *plan) {
    process_identity id;
    identify_process(&id);
    if (!id.gpu_known) {
        mu_log(MU_LOG_ERROR, "%s: cannot check the plan's gpu '%s' (%s); passing every call through",
               plan->path, plan->gpu, id.gpu);
        return false;
    }
    if (strcmp(id.gpu, plan->gpu) != 0) {
        mu_log(MU_LOG_ERROR, "%s: plan is for gpu '%s' but this process runs on '%s'; passing every "
               "call through", plan->path, plan->gpu, id.gpu);
        return false;
    }
    if (id.cudnn_version != plan->cudnn_version) {
        mu_log(MU_LOG_ERROR, "%s: plan is for cudnn %ld but this process runs cudnn %ld; passing "
               "every call through", plan->path, plan->cudnn_version, id.cudnn_version);
        return false;
    }
    return true;
}

/* Why MUCUDNN_PLAN was not used ("" when it was), said again at exit: the load-time line may be
 * long scrolled away when a run ends having planned nothing. */
static char plan_refusal[160];

/* At exit, one line when a plan was given and did nothing: refused, or none of the process's
 * kernels in it; one line when memory pressure degraded kernels to points of less workspace, one
 * when it refused kernels' engines. */
static void report_plan_use(void) {
    const char *path = state.plan != NULL ? state.plan->path : mu_option_path(MU_OPT_PLAN);
    size_t degraded = mu_room_degraded_kernels();
    if (degraded > 0)
        mu_log(MU_LOG_INFO, "%zu kernels got a front point of less workspace for lack of free memory "
               "(room: MUCUDNN_ROOM_MARGIN, MUCUDNN_MEMORY_BUDGET)", degraded);
    size_t refused = mu_room_refused_kernels();
    if (refused > 0)
        mu_log(MU_LOG_INFO, "%zu kernels had an engine configuration refused for lack of free memory (the "
               "framework took one of less workspace; room: MUCUDNN_ROOM_MARGIN, MUCUDNN_MEMORY_BUDGET)", refused);
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

static void log_loaded(const mu_plan *plan) {
    mu_log(MU_LOG_INFO, "loaded plan %s: %zu kernel plans (gpu '%s', cudnn %ld, strategy %s, "
           "limit %llu, policy %s)", plan->path, plan->entry_count, plan->gpu, plan->cudnn_version,
           plan->strategy, plan->limit, plan->policy);
}

static mu_plan *load_plan(const char *path) {
    char error[1024];
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
    log_loaded(plan);
    return plan;
}

/* The plan files of MUCUDNN_PLAN's list, in order: each item a file, or a directory standing for
 * its *.plan files by name (empty items, as in a trailing ':', name nothing). Returns the count (at
 * most max; paths are malloc'd) and, in *left_out, how many more the list names: a directory is
 * read whole and sorted before it is cut, so the files kept are the first by name, whatever order
 * the directory lists them in. */
static int compare_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* A directory's *.plan paths, sorted; count in *found (0 and NULL when none or out of memory). */
static char **directory_plans(const char *directory, DIR *dir, size_t *found) {
    char **names = NULL;
    size_t count = 0, capacity = 0;
    for (struct dirent *entry; (entry = readdir(dir)) != NULL;) {
        size_t length = strlen(entry->d_name);
        if (length <= 5 || strcmp(entry->d_name + length - 5, ".plan") != 0 || entry->d_name[0] == '.')
            continue;
        if (count == capacity) {
            size_t grown = capacity ? 2 * capacity : 64;
            char **more = realloc(names, grown * sizeof *names);
            if (more == NULL) break;
            names = more, capacity = grown;
        }
        if (asprintf(&names[count], "%s/%s", directory, entry->d_name) >= 0) count++;
    }
    if (count > 0) qsort(names, count, sizeof *names, compare_names);
    *found = count;
    return names;
}

static size_t list_plan_files(const char *spec, char **paths, size_t max, size_t *left_out) {
    size_t count = 0;
    *left_out = 0;
    char *copy = strdup(spec);
    if (copy == NULL) return 0;
    char *save = NULL;
    for (char *item = strtok_r(copy, ":", &save); item != NULL; item = strtok_r(NULL, ":", &save)) {
        struct stat info;
        DIR *dir = stat(item, &info) == 0 && S_ISDIR(info.st_mode) ? opendir(item) : NULL;
        if (dir == NULL) { /* a file (or what mu_plan_load will say it cannot read) */
            if (count == max) (*left_out)++;
            else if ((paths[count] = strdup(item)) != NULL) count++;
            continue;
        }
        size_t found = 0;
        char **names = directory_plans(item, dir, &found);
        closedir(dir);
        for (size_t i = 0; i < found; i++) {
            if (count < max) paths[count++] = names[i];
            else (*left_out)++, free(names[i]);
        }
        free(names);
    }
    free(copy);
    return count;
}

/* MUCUDNN_PLAN naming several plans (a colon-separated list, directories): the ranks of a job on
 * GPUs of several models share one setting, and each takes the plan made for its GPU and cuDNN
 * (the first in the list's order). Malformed plans are reported and skipped. */
#define MU_MAX_PLAN_FILES 256
static mu_plan *choose_plan(const char *spec) {
    char *paths[MU_MAX_PLAN_FILES];
    size_t left_out = 0;
    size_t count = list_plan_files(spec, paths, MU_MAX_PLAN_FILES, &left_out);
    char shown[MU_ESCAPED_MAX];
    if (left_out > 0)
        mu_log(MU_LOG_WARNING, "MUCUDNN_PLAN names %zu plan files, more than the shim reads: the %zu after "
               "the first %d (in the list's order, a directory's by name) are not considered (MUCUDNN_PLAN=%s)",
               count + left_out, left_out, MU_MAX_PLAN_FILES, mu_log_escape(spec, shown, sizeof shown));
    process_identity id;
    identify_process(&id);
    mu_plan *chosen = NULL;
    char others[512] = "";
    size_t others_used = 0;
    for (size_t i = 0; i < count; i++) {
        char error[1024];
        mu_plan *plan = mu_plan_load(paths[i], error, sizeof error);
        if (plan == NULL) {
            mu_log(MU_LOG_ERROR, "%s; skipped", error);
        } else if (chosen == NULL && plan_is_for(plan, &id)) {
            chosen = plan;
        } else {
            int wrote = snprintf(others + others_used, sizeof others - others_used, "%s'%s' cudnn %ld",
                                 others_used ? ", " : "", plan->gpu, plan->cudnn_version);
            if (wrote > 0 && others_used + (size_t)wrote < sizeof others) others_used += (size_t)wrote;
            mu_plan_free(plan);
        }
        free(paths[i]);
    }
    if (chosen != NULL) {
        mu_log(MU_LOG_INFO, "chose plan %s of the %zu in MUCUDNN_PLAN: the one for gpu '%s', cudnn %ld",
               chosen->path, count, chosen->gpu, chosen->cudnn_version);
        log_loaded(chosen);
        return chosen;
    }
    if (!id.gpu_known)
        mu_log(MU_LOG_ERROR, "MUCUDNN_PLAN=%s: cannot tell which plan is for this process (%s); "
               "passing every call through", mu_log_escape(spec, shown, sizeof shown), id.gpu);
    else
        mu_log(MU_LOG_ERROR, "MUCUDNN_PLAN=%s: none of its %zu plans is for gpu '%s' with cudnn %ld "
               "(they are for: %s); passing every call through", mu_log_escape(spec, shown, sizeof shown),
               count, id.gpu, id.cudnn_version, others_used ? others : "none readable");
    snprintf(plan_refusal, sizeof plan_refusal, "none is for this process: see the error above");
    return NULL;
}

/* One plan file as it always was, or the choice among several. */
static mu_plan *plan_of_setting(const char *spec) {
    struct stat info;
    if (strchr(spec, ':') == NULL && !(stat(spec, &info) == 0 && S_ISDIR(info.st_mode))) return load_plan(spec);
    return choose_plan(spec);
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
    long long hold = mu_option_int(MU_OPT_WORKSPACE_HOLD);
    state.has_hold = hold >= 0;
    state.workspace_hold = state.has_hold ? (size_t)hold : 0;
    mu_record_init();
    bool have_plan = mu_option_path(MU_OPT_PLAN) != NULL;
    if (have_plan) state.plan = plan_of_setting(mu_option_path(MU_OPT_PLAN));
    mu_plan *online = mu_online_init(have_plan);
    if (online != NULL) state.plan = online;
    atexit(report_plan_use);
}

const mu_state *mu_config(void) {
    pthread_once(&state_once, init_state);
    return &state;
}

void mu_forget_handle(cudnnHandle_t handle) {
    mu_graphs_forget_handle(handle);
    mu_g_legacy_forget_handle(handle);
}
